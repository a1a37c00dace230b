#!/usr/bin/env python3
"""Benchmark `shardkit convert hf-to-mcore` against a plain `cp -r` of the same HF checkpoint.

For each requested model size this script

1. synthesises a LLaMA-3-shaped bf16 HF checkpoint (random values, untied embeddings, GQA with 8 KV heads,
   head_dim 128, ffn ~3.5x hidden, vocab 128256) as several safetensors shards plus model.safetensors.index.json and
   config.json, writing one shard at a time (never more than one shard in memory, no transformers model object);
   with --experts N a Mixtral-style MoE instead (every layer N routed experts of --expert-ffn, a router), converted
   with --ep;
2. times `cp -r SRC DST` (the baseline), then `sync` separately (cp leaves its bytes dirty in the page cache while
   the converter fsyncs everything, so "cp+sync" is reported too);
3. times `shardkit convert hf-to-mcore SRC OUT --tp 2 --pp 2 --quiet [--workers N]` as a subprocess while a thread
   polls the process tree (psutil, every --poll seconds) for the summed RSS of the tree, the largest single-process
   RSS and the summed anonymous RSS (RSS minus file-backed/shared pages, i.e. without the mmapped safetensors pages);
4. optionally (--export) times `shardkit convert mcore-to-hf` back to HF;
5. with --formats native,torch_dist, step 3 once per output format (`--format torch_dist`: Megatron-LM's
   torch_dist, written straight from the HF shards), each torch_dist row reported beside the native one of the same
   layout, code and --workers ("vs native": wall, CPU and peak-RSS ratios; issue 17's goal: within 1.3x, RSS
   unchanged).

Before every timed step the page cache is dropped (`sync; echo 3 > /proc/sys/vm/drop_caches`, needs root). When
that is not possible the source is read once untimed (an untimed `cp -r`) so every timed step reads from a warm
cache; the mode used is printed and written to the results.

    .venv/bin/python scripts/bench_convert.py --sizes 1,2 --workers default,1,2 --export --repeats 3
    # MoE (issue 3): 64 experts with a small expert ffn, expert parallel
    .venv/bin/python scripts/bench_convert.py --experts 64 --expert-ffn 704 --hidden 1024 --vocab 32000 --ep 4 \
        --sizes 1,2 --repeats 3
    # A/B a patch without installing it, interleaved in one run (same cache state, same load):
    .venv/bin/python scripts/bench_convert.py --src installed --src patched=/path/to/patched/tree ...

Disk use per size: the source and one more copy at a time (cp's copy and each checkpoint are deleted once timed),
about 2x the model size at peak; with --export the checkpoint it reads, the next one and the export, about 4x (more
with --keep). Everything lives in a fresh directory made inside --workdir and removed at the end unless --keep;
nothing else in --workdir is touched.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import math
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

GB = 1e9
MB = 1 << 20
REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Code:
    """A tree of the converter to run: the installed one, or --src DIR (prepended to PYTHONPATH)."""

    label: str
    root: Path
    env: dict = field(hash=False, compare=False)

    @classmethod
    def parse(cls, spec: str) -> "Code":
        label, _, path = spec.rpartition("=")
        if spec == "installed":
            return cls("installed", REPO, dict(os.environ))
        root = Path(path).resolve()
        if not (root / "convert" / "hf_to_mcore.py").is_file():
            raise SystemExit(f"--src {spec}: no convert/hf_to_mcore.py under {root}")
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(root)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        return cls(label or root.name, root, env)

    def no_verify(self) -> list[str]:
        """`--no-verify` where this tree's converter proves its output by default (it would be timed otherwise);
        nothing for an older tree, whose converter does not verify unless asked (and knows no such flag)."""
        text = (self.root / "shardkit" / "cli.py").read_text() if (self.root / "shardkit" / "cli.py").is_file() else ""
        return ["--no-verify"] if "BooleanOptionalAction, default=None" in text and '"--verify"' in text else []


VOCAB = 128256
HEAD_DIM = 128
KV_HEADS = 8


# -- model shape ------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    vocab: int = VOCAB
    head_dim: int = HEAD_DIM
    kv_heads: int = KV_HEADS
    experts: int = 0  # > 0: Mixtral-style MoE, every layer `experts` routed experts of `expert_ffn`
    expert_ffn: int = 0
    topk: int = 2
    qwen3: bool = False  # Qwen3's names and q/k norms (with experts: Qwen3-MoE's `mlp.experts.{e}.*_proj`)
    n_heads: int = 0  # 0: hidden / head_dim

    @property
    def heads(self) -> int:
        return self.n_heads or self.hidden // self.head_dim

    @property
    def groups(self) -> int:
        return min(self.kv_heads, self.heads)

    @property
    def ffn(self) -> int:
        return ffn_for(self.hidden)

    def layer_tensors(self, i: int) -> list[tuple[str, tuple[int, ...]]]:
        h, F, hd = self.hidden, self.ffn, self.head_dim
        p = f"model.layers.{i}."
        attn = [
            (p + "input_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (self.heads * hd, h)),
            (p + "self_attn.k_proj.weight", (self.groups * hd, h)),
            (p + "self_attn.v_proj.weight", (self.groups * hd, h)),
            (p + "self_attn.o_proj.weight", (h, self.heads * hd)),
            (p + "post_attention_layernorm.weight", (h,)),
        ]
        if self.qwen3:
            attn += [(p + "self_attn.q_norm.weight", (hd,)), (p + "self_attn.k_norm.weight", (hd,))]
        if self.experts and self.qwen3:
            m, E = p + "mlp.", self.expert_ffn
            return attn + [(m + "gate.weight", (self.experts, h))] + [
                t for e in range(self.experts)
                for t in ((f"{m}experts.{e}.gate_proj.weight", (E, h)), (f"{m}experts.{e}.up_proj.weight", (E, h)),
                          (f"{m}experts.{e}.down_proj.weight", (h, E)))]
        if self.experts:
            m, E = p + "block_sparse_moe.", self.expert_ffn
            return attn + [(m + "gate.weight", (self.experts, h))] + [
                t for e in range(self.experts)
                for t in ((f"{m}experts.{e}.w1.weight", (E, h)), (f"{m}experts.{e}.w2.weight", (h, E)),
                          (f"{m}experts.{e}.w3.weight", (E, h)))]
        return attn + [
            (p + "mlp.gate_proj.weight", (F, h)),
            (p + "mlp.up_proj.weight", (F, h)),
            (p + "mlp.down_proj.weight", (h, F)),
        ]

    def tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        """Every HF tensor, in the order transformers saves them."""
        out = [("model.embed_tokens.weight", (self.vocab, self.hidden))]
        for i in range(self.layers):
            out += self.layer_tensors(i)
        out += [("model.norm.weight", (self.hidden,)), ("lm_head.weight", (self.vocab, self.hidden))]
        return out

    @property
    def nbytes(self) -> int:
        return sum(2 * math.prod(s) for _, s in self.tensors())

    def describe(self) -> str:
        mlp = (f"MoE {self.experts} experts (top-{self.topk}) x ffn {self.expert_ffn}" if self.experts else
               f"ffn {self.ffn}")
        return (f"hidden {self.hidden}, {self.layers} layers, {self.heads} heads / {self.groups} KV heads x "
                f"{self.head_dim}, {mlp}, vocab {self.vocab}, untied, bf16: {self.nbytes / GB:.2f} GB")


def ffn_for(hidden: int) -> int:
    """~3.5x hidden, rounded to a multiple of 256 (Llama-3-8B: 4096 -> 14336)."""
    return int(round(3.5 * hidden / 256)) * 256


def shape_for(size_gb: float, hidden: int, layers: int | None, layer_multiple: int, vocab: int = VOCAB,
              experts: int = 0, expert_ffn: int = 0, **extra) -> Shape:
    """The shape closest to `size_gb` at this hidden size (layers a multiple of pp*vpp), unless layers is given;
    `extra`: Shape's other fields (topk, qwen3, n_heads, kv_heads)."""
    moe = dict(experts=experts, expert_ffn=expert_ffn, **extra)
    if layers is None:
        fixed = Shape(hidden, 0, vocab, **moe).nbytes
        per_layer = Shape(hidden, 1, vocab, **moe).nbytes - fixed
        n = round((size_gb * GB - fixed) / per_layer / layer_multiple) * layer_multiple
        layers = max(layer_multiple, n)
    return Shape(hidden, layers, vocab, **moe)


def hf_config(s: Shape) -> dict:
    if s.qwen3:  # Qwen/Qwen3-30B-A3B's config.json keys (Qwen3-8B's without experts), sizes from the shape
        out = {
            "architectures": ["Qwen3MoeForCausalLM" if s.experts else "Qwen3ForCausalLM"],
            "model_type": "qwen3_moe" if s.experts else "qwen3", "attention_bias": False, "attention_dropout": 0.0,
            "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": s.head_dim, "hidden_act": "silu",
            "hidden_size": s.hidden, "initializer_range": 0.02, "intermediate_size": s.ffn,
            "max_position_embeddings": 40960, "max_window_layers": s.layers, "num_attention_heads": s.heads,
            "num_hidden_layers": s.layers, "num_key_value_heads": s.groups, "rms_norm_eps": 1e-06,
            "rope_scaling": None, "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False,
            "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True,
            "use_sliding_window": False, "vocab_size": s.vocab}
        if s.experts:
            out.update(decoder_sparse_step=1, mlp_only_layers=[], moe_intermediate_size=s.expert_ffn,
                       norm_topk_prob=True, num_experts=s.experts, num_experts_per_tok=s.topk,
                       output_router_logits=False, router_aux_loss_coef=0.001)
        return out
    if s.experts:  # Mixtral's config.json keys (mistralai/Mixtral-8x7B-v0.1), sizes from the shape
        return {
            "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "attention_dropout": 0.0,
            "bos_token_id": 1, "eos_token_id": 2, "head_dim": s.head_dim, "hidden_act": "silu",
            "hidden_size": s.hidden, "initializer_range": 0.02, "intermediate_size": s.expert_ffn,
            "max_position_embeddings": 32768, "num_attention_heads": s.heads, "num_experts_per_tok": s.topk,
            "num_hidden_layers": s.layers, "num_key_value_heads": s.groups, "num_local_experts": s.experts,
            "output_router_logits": False, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0,
            "router_aux_loss_coef": 0.02, "sliding_window": None, "tie_word_embeddings": False,
            "torch_dtype": "bfloat16", "transformers_version": "4.45.0", "use_cache": True, "vocab_size": s.vocab,
        }
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "head_dim": s.head_dim,
        "hidden_act": "silu",
        "hidden_size": s.hidden,
        "initializer_range": 0.02,
        "intermediate_size": s.ffn,
        "max_position_embeddings": 131072,
        "mlp_bias": False,
        "num_attention_heads": s.heads,
        "num_hidden_layers": s.layers,
        "num_key_value_heads": s.groups,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.45.0",
        "use_cache": True,
        "vocab_size": s.vocab,
    }


def write_shards(out: Path, tensors, shard_bytes: int, make) -> tuple[dict[str, str], int]:
    """Write (name, shape) `tensors` as safetensors shards of about `shard_bytes` (bf16 sizes; one shard in memory at
    a time) + model.safetensors.index.json; `make(name, shape)` makes each tensor, in order. Returns the weight map
    and the weight bytes. Shared by the benchmarks that synthesize hub checkpoints (bench_verify too)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True)
    groups: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in tensors:
        n = 2 * math.prod(shape)
        if groups[-1] and size + n > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append((name, shape))
        size += n
    weight_map, total_bytes = {}, 0
    for i, group in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        shard = {name: make(name, shape) for name, shape in group}
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        for name, t in shard.items():
            weight_map[name] = fname
            total_bytes += t.numel() * t.element_size()
        del shard
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total_bytes}, "weight_map": weight_map}, indent=2) + "\n")
    return weight_map, total_bytes


def synthesize(out: Path, s: Shape, shard_bytes: int, seed: int = 0) -> int:
    """Write `s` as random bf16 safetensors shards (one shard in memory at a time); returns the weight bytes."""
    import torch

    g = torch.Generator().manual_seed(seed)
    _, total_bytes = write_shards(out, s.tensors(), shard_bytes, lambda name, shape: (
        torch.randn(shape, generator=g, dtype=torch.float32).to(torch.bfloat16) if len(shape) == 1
        else torch.randn(shape, generator=g, dtype=torch.bfloat16)))
    (out / "config.json").write_text(json.dumps(hf_config(s), indent=2) + "\n")
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 128000, "eos_token_id": 128001, "transformers_version": "4.45.0"}, indent=2) + "\n")
    return total_bytes


def run_dir(workdir: Path | str | None, prefix: str) -> Path:
    """This run's own directory: a fresh one made inside --workdir (created if missing), or a temporary one. Every
    benchmark writes only under it and removes only it, so nothing a user already had in --workdir is touched."""
    if workdir is None:
        return Path(tempfile.mkdtemp(prefix=prefix))
    Path(workdir).mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=prefix, dir=workdir))


BENCH_MARK = ".made-by-shardkit-bench"


def reuse_dir(workdir: Path | str, name: str) -> Path:
    """A directory of inputs kept between runs (weights, a converted checkpoint) at WORKDIR/NAME, carrying a mark
    file; one that exists without the mark was not made here and is refused, never emptied."""
    d = Path(workdir) / name
    if d.exists() and not (d / BENCH_MARK).is_file():
        raise SystemExit(f"--workdir: {d} exists and was not made by shardkit's benchmarks; choose another --workdir")
    d.mkdir(parents=True, exist_ok=True)
    (d / BENCH_MARK).touch()
    return d


def dir_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file() and not f.is_symlink())


# -- cache control ----------------------------------------------------------------------------------------------------

def try_drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


# What the converter imports, and what its default proof imports (torch, transformers and the model types' modeling
# modules): re-read untimed after each drop so a timed step pays for reading the model, not for reading torch,
# tensorstore or transformers from disk (cp's own code is a few hundred KB and always cached).
# (its last line is an import statement: bench_scale_out appends modules to it)
WARM_CODE = ("try:\n    import torch, transformers.conversion_mapping, transformers.models.llama.modeling_llama, "
             "transformers.models.mixtral.modeling_mixtral, transformers.models.deepseek_v3.modeling_deepseek_v3\n"
             "except ImportError:\n    pass\n"
             "import convert.hf_to_mcore, convert.mcore_to_hf, checkpoint.reader, shardkit.cli")


def evict(paths: list[Path]) -> None:
    """Drop the page-cache pages of every file below `paths` (sync first, then posix_fadvise DONTNEED per file): a
    cold read of those files without the privilege to drop the whole cache."""
    os.sync()
    for root in paths:
        for p in [root] if root.is_file() else sorted(q for q in root.rglob("*") if q.is_file()):
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


class Cache:
    def __init__(self, mode: str, warm_code: bool = True):
        # "cold" (drop the page cache before each step), "evict" (no privilege for that: evict the source files'
        # pages before each step) or "warm" (--warm: the source read once, untimed)
        self.mode = mode
        self.warm_code = warm_code
        self.codes: list[Code] = []
        self.sources: list[Path] = []  # what "evict" evicts: the benchmark's input files

    @classmethod
    def detect(cls, force_warm: bool, warm_code: bool = True) -> "Cache":
        if force_warm:
            return cls("warm", warm_code)
        if try_drop_caches():
            return cls("cold", warm_code)
        print("note: cannot drop the page cache (sync; echo 3 > /proc/sys/vm/drop_caches failed); evicting the "
              "source files' pages before every timed step instead (posix_fadvise DONTNEED)", file=sys.stderr)
        return cls("evict", warm_code)

    def before_step(self) -> None:
        if self.mode == "cold":
            if not try_drop_caches():
                raise SystemExit("dropping the page cache worked once and then failed; rerun with --warm")
            if self.warm_code:
                for code in self.codes:
                    subprocess.run([sys.executable, "-c", WARM_CODE], check=True, env=code.env)
        elif self.mode == "evict":
            evict(self.sources)
        else:
            os.sync()

    def describe(self) -> str:
        if self.mode == "cold":
            return ("cold: `sync; echo 3 > /proc/sys/vm/drop_caches` before every timed step" +
                    (", then an untimed `python -c 'import torch, transformers..., convert.hf_to_mcore, ...'` so the "
                     "Python libraries (torch, tensorstore, and transformers with the modeling modules the default "
                     "proof imports) are cached again: the model files are read cold, the code warm"
                     if self.warm_code else " (code cold too: --cold-code)"))
        if self.mode == "evict":
            return ("source evicted: the page cache could not be dropped (no privilege), so before every timed step "
                    "`sync` and posix_fadvise(DONTNEED) on every source file drop the source's pages: the source is "
                    "read from the disk (or from the host's cache under a VM, which a guest cannot drop), the code "
                    "warm")
        return ("warm: the source was read once (untimed `cp -r`) so every timed step reads it from the page cache")


# -- measuring a process tree -----------------------------------------------------------------------------------------

@dataclass
class Run:
    label: str
    cmd: list[str]
    wall_s: float = 0.0
    rc: int = 0
    peak_tree_rss: int = 0
    peak_max_rss: int = 0
    peak_tree_anon: int = 0
    peak_procs: int = 0
    cpu_s: float = 0.0
    ru_maxrss: int = 0  # kernel's max RSS over reaped descendants (bytes)
    samples: int = 0
    stderr_tail: str = ""
    extra: dict = field(default_factory=dict)


S3_BUCKET = "bench"


def start_s3(workdir: Path) -> object:
    """A loopback S3 server (moto's server mode, the tests' server) for --formats s3, with the environment the
    shardkit processes read (AWS_ENDPOINT_URL, test credentials, staging below the work directory)."""
    import socket

    import boto3
    from moto.server import ThreadedMotoServer

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    os.environ.update(AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}", AWS_ACCESS_KEY_ID="bench",
                      AWS_SECRET_ACCESS_KEY="bench", AWS_REGION="us-east-1",
                      SHARDKIT_STAGING=str(workdir / "s3-staging"))
    boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"], region_name="us-east-1").create_bucket(
        Bucket=S3_BUCKET)
    return server


def s3_bytes(url: str) -> int:
    import boto3

    bucket, _, prefix = url[len("s3://"):].partition("/")
    s3 = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"], region_name="us-east-1")
    return sum(o["Size"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/")
               for o in page.get("Contents", []))


def s3_remove(url: str) -> None:
    sys.path.insert(0, str(REPO))
    from checkpoint import storage

    storage.ObjectStore(storage.parse(url)).delete_prefix("")


def run_measured(label: str, cmd: list[str], poll_s: float, log: Path, env: dict | None = None) -> Run:
    import psutil

    r = Run(label, cmd)
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    stop = threading.Event()
    with open(log, "wb") as logf:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env)
        root = psutil.Process(proc.pid)

        def sample() -> None:
            try:
                procs = [root] + root.children(recursive=True)
            except psutil.Error:
                return
            tree = anon = biggest = n = 0
            for p in procs:
                try:
                    mi = p.memory_info()
                except psutil.Error:
                    continue
                n += 1
                tree += mi.rss
                anon += max(0, mi.rss - getattr(mi, "shared", 0))
                biggest = max(biggest, mi.rss)
            r.peak_tree_rss = max(r.peak_tree_rss, tree)
            r.peak_tree_anon = max(r.peak_tree_anon, anon)
            r.peak_max_rss = max(r.peak_max_rss, biggest)
            r.peak_procs = max(r.peak_procs, n)
            r.samples += 1

        def poll() -> None:
            while not stop.is_set():
                sample()
                stop.wait(poll_s)

        th = threading.Thread(target=poll, daemon=True)
        th.start()
        r.rc = proc.wait()
        r.wall_s = time.perf_counter() - t0
        stop.set()
        th.join()
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    r.cpu_s = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    r.ru_maxrss = ru1.ru_maxrss * 1024
    r.stderr_tail = log.read_text(errors="replace")[-2000:]
    if r.rc != 0:
        raise SystemExit(f"{label} failed (exit {r.rc}): {' '.join(cmd)}\n{r.stderr_tail}")
    return r


def timed(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True)
    return time.perf_counter() - t0


# -- one size ---------------------------------------------------------------------------------------------------------

def shape_extra(args) -> dict:
    """Shape's fields beyond size and MoE from the command line: Qwen3's names and q/k norms, head counts."""
    return dict(topk=args.topk, qwen3=args.qwen3, n_heads=args.heads or 0, kv_heads=args.kv_heads)


def shardkit_bin() -> str:
    cand = Path(sys.executable).with_name("shardkit")
    if cand.exists():
        return str(cand)
    found = shutil.which("shardkit")
    if not found:
        raise SystemExit("cannot find the shardkit CLI next to this Python or on PATH")
    return found


def bench_size(args, size_gb: float, cache: Cache, work: Path) -> list[dict]:
    s = shape_for(size_gb, args.hidden, args.layers, args.pp * args.vpp, args.vocab, args.experts, args.expert_ffn,
                  **shape_extra(args))
    base = work / f"size{size_gb:g}"
    if base.exists():
        shutil.rmtree(base)
    base.mkdir(parents=True)
    src = base / "hf"
    print(f"\n== size {size_gb:g} GB requested: {s.describe()}" if args.layers is None else
          f"\n== --layers {args.layers}: {s.describe()}", flush=True)
    if args.layers is None and abs(s.nbytes / GB - size_gb) > 0.15 * size_gb:
        one = dataclasses.replace(s, layers=1).nbytes
        fixed = dataclasses.replace(s, layers=0).nbytes
        print(f"   note: {s.nbytes / GB:.2f} GB is the nearest this hidden size allows (layers are a multiple of "
              f"pp*vpp, at least one stage each; one layer is {(one - fixed) / GB:.2f} GB, the untied "
              f"{s.vocab}-row embeddings alone {fixed / GB:.2f} GB)", flush=True)
    if s.experts and s.experts % args.ep:
        raise SystemExit(f"--experts {s.experts} is not divisible by --ep {args.ep}")
    t0 = time.perf_counter()
    synthesize(src, s, int(args.shard_gb * GB), seed=args.seed)
    src_bytes = dir_bytes(src)
    nshards = len(list(src.glob("*.safetensors")))
    print(f"   synthesised {src_bytes / GB:.3f} GB in {nshards} shards in {time.perf_counter() - t0:.1f}s", flush=True)

    cache.sources = [src]
    if cache.mode == "warm":
        dst = base / "cp-warmup"
        timed(["cp", "-r", str(src), str(dst)])
        shutil.rmtree(dst)
    sk = shardkit_bin()
    cps: list[tuple[float, float]] = []
    codes: list[Code] = args.codes
    convs: dict[tuple[str, str, str], list[Run]] = {(c.label, w, f + ("+proof" if p else "")): [] for c in codes
                                                   for w in args.workers for f in args.formats for p in args.proofs}
    exports: dict[str, list[Run]] = {c.label: [] for c in codes}
    out_bytes = exp_bytes = out_chunks = 0
    # repeats are interleaved (cp, convert per tree and workers value, export, cp, ...): drift on a shared disk hits all
    for rep in range(args.repeats):
        tag = f"   [{rep + 1}/{args.repeats}]"
        # (a) baseline: cp -r, and the sync that makes its bytes durable (timed separately)
        dst = base / "cp"
        cache.before_step()
        cp_s = timed(["cp", "-r", str(src), str(dst)])
        sync_s = timed(["sync"])
        cps.append((cp_s, sync_s))
        shutil.rmtree(dst)
        print(f"{tag} cp -r {cp_s:.2f}s ({src_bytes / GB / cp_s:.2f} GB/s), + sync {sync_s:.2f}s", flush=True)
        for code in codes:
            # (b) the converter
            who = f"[{code.label}] " if len(codes) > 1 else ""
            ck0 = base / f"mcore-{code.label}-w{args.workers[0]}"  # the checkpoint the export reads
            for workers, fmt, proof in [(w, f, p) for w in args.workers for f in args.formats for p in args.proofs]:
                native = fmt == "native"
                key = fmt + ("+proof" if proof else "")  # the default command: the conversion and its proof
                out = base / ((f"mcore-{code.label}-w{workers}" if native else f"td-{code.label}-w{workers}")
                              + ("-proof" if proof else ""))
                if fmt == "s3":  # the native format through the object-storage path (checkpoint/storage.py)
                    out = f"s3://{S3_BUCKET}/{base.name}/mcore-{code.label}-w{workers}{'-proof' if proof else ''}"
                elif out.exists():
                    shutil.rmtree(out)
                cmd = [sk, "convert", "hf-to-mcore", str(src), str(out), "--tp", str(args.tp), "--pp", str(args.pp),
                       "--quiet", *([] if proof else code.no_verify())] + \
                    ([] if fmt in ("native", "s3") else ["--format", fmt]) + (["--overwrite"] if fmt == "s3" else [])
                if args.vpp != 1:
                    cmd += ["--vpp", str(args.vpp)]
                if args.ep != 1:
                    cmd += ["--ep", str(args.ep)]
                if args.etp is not None:
                    cmd += ["--etp", str(args.etp)]
                if workers != "default":
                    cmd += ["--workers", str(workers)]
                cache.before_step()
                r = run_measured(f"{who}convert (workers={workers}, {key})", cmd, args.poll,
                                 base / f"convert-{code.label}-w{workers}-{key}.log", code.env)
                if native:
                    out_bytes = dir_bytes(out)
                    out_chunks = sum(1 for f in out.glob("iter_*/model/*/c/**/*") if f.is_file())
                    manifest = json.loads(next(out.glob("iter_*/manifest.json")).read_text())
                    r.extra["inner_s"] = manifest.get("provenance", {}).get("seconds")
                elif fmt == "s3":
                    r.extra["out_bytes"], r.extra["inner_s"] = s3_bytes(str(out)), None
                else:
                    r.extra["out_bytes"] = dir_bytes(out)
                    r.extra["inner_s"] = None
                convs[(code.label, workers, key)].append(r)
                inner = f" (inside shardkit {r.extra['inner_s']}s)" if r.extra["inner_s"] is not None else ""
                print(f"{tag} {who}convert workers={workers} {key}: {r.wall_s:.2f}s{inner}, "
                      f"{src_bytes / GB / r.wall_s:.2f} GB/s; peak RSS tree "
                      f"{r.peak_tree_rss / MB:.0f} MB (anon {r.peak_tree_anon / MB:.0f} MB, {r.peak_procs} procs), max "
                      f"process {r.peak_max_rss / MB:.0f} MB; CPU {r.cpu_s:.1f}s; wrote "
                      f"{(out_bytes if native else r.extra['out_bytes']) / GB:.3f} GB", flush=True)
                # disk: keep at most the checkpoint the export reads and this one
                if fmt == "s3":
                    s3_remove(str(out))
                elif not args.keep and (out != ck0 or not args.export):
                    shutil.rmtree(out)
            # (c) optionally back to HF, from the checkpoint of the first --workers value
            if args.export:
                exp = base / f"export-{code.label}"
                if exp.exists():
                    shutil.rmtree(exp)
                cache.before_step()
                e = run_measured(f"{who}export", [sk, "convert", "mcore-to-hf", str(ck0), str(exp), "--quiet"],
                                 args.poll, base / f"export-{code.label}.log", code.env)
                exp_bytes = dir_bytes(exp)
                exports[code.label].append(e)
                print(f"{tag} {who}export (mcore-to-hf): {e.wall_s:.2f}s, {src_bytes / GB / e.wall_s:.2f} GB/s; peak "
                      f"RSS tree {e.peak_tree_rss / MB:.0f} MB, max process {e.peak_max_rss / MB:.0f} MB; CPU "
                      f"{e.cpu_s:.1f}s", flush=True)
                if args.check_export and rep == 0:
                    check_export(src, exp)
                if not args.keep:
                    shutil.rmtree(exp)
            if not args.keep:
                shutil.rmtree(ck0, ignore_errors=True)

    cp_s = median([c for c, _ in cps])
    cp_sync_s = median([c + sy for c, sy in cps])
    common = dict(size_req_gb=size_gb, size_gb=src_bytes / GB, layers=s.layers, hidden=s.hidden, shards=nshards,
                  experts=s.experts, expert_ffn=s.expert_ffn, hf_tensors=len(s.tensors()), out_chunks=out_chunks,
                  cp_s=cp_s, cp_sync_s=cp_sync_s, cp_gbs=src_bytes / GB / cp_s, cp_runs=cps, repeats=args.repeats)
    rows = []
    for (label, workers, fmt), runs in convs.items():
        wall = median([r.wall_s for r in runs])
        inner = [r.extra["inner_s"] for r in runs]
        nat = convs.get((label, workers, "native")) if fmt != "native" else None
        vs = (dict(vs_native_wall=wall / median([r.wall_s for r in nat]),
                   vs_native_cpu=median([r.cpu_s for r in runs]) / median([r.cpu_s for r in nat]),
                   vs_native_rss=max(r.peak_tree_rss for r in runs) / max(r.peak_tree_rss for r in nat))
              if nat else {})
        rows.append(dict(common, **vs, kind="convert", code=label, workers=str(workers), format=fmt, convert_s=wall,
                         convert_inner_s=median(inner) if None not in inner else None,
                         ratio=wall / cp_s, ratio_sync=wall / cp_sync_s, convert_gbs=src_bytes / GB / wall,
                         peak_tree_mb=max(r.peak_tree_rss for r in runs) / MB,
                         peak_max_mb=max(r.peak_max_rss for r in runs) / MB,
                         peak_anon_mb=max(r.peak_tree_anon for r in runs) / MB,
                         procs=max(r.peak_procs for r in runs), cpu_s=median([r.cpu_s for r in runs]),
                         out_gb=(out_bytes if fmt.startswith("native") else runs[-1].extra["out_bytes"]) / GB,
                         runs_s=[round(r.wall_s, 2) for r in runs],
                         cmd=" ".join(runs[-1].cmd)))
    for label, runs_e in exports.items():
        if not runs_e:
            continue
        wall = median([e.wall_s for e in runs_e])
        rows.append(dict(common, kind="export", code=label, workers="-", export_s=wall, export_ratio=wall / cp_s,
                         export_ratio_sync=wall / cp_sync_s, export_gbs=src_bytes / GB / wall,
                         export_peak_tree_mb=max(e.peak_tree_rss for e in runs_e) / MB,
                         export_peak_max_mb=max(e.peak_max_rss for e in runs_e) / MB,
                         export_cpu_s=median([e.cpu_s for e in runs_e]), export_gb=exp_bytes / GB,
                         runs_s=[round(e.wall_s, 2) for e in runs_e], cmd=" ".join(runs_e[-1].cmd)))
    for r in rows:
        who = f"[{r['code']}] " if len(codes) > 1 else ""
        if r["kind"] == "convert":
            vs = (f"; vs native: {r['vs_native_wall']:.2f}x wall, {r['vs_native_cpu']:.2f}x CPU, "
                  f"{r['vs_native_rss']:.2f}x RSS" if "vs_native_wall" in r else "")
            print(f"   => {who}convert workers={r['workers']} {r['format']}: median {r['convert_s']:.2f}s = "
                  f"{r['ratio']:.2f}x cp ({cp_s:.2f}s), {r['ratio_sync']:.2f}x cp+sync ({cp_sync_s:.2f}s); peak RSS "
                  f"tree {r['peak_tree_mb']:.0f} MB, max process {r['peak_max_mb']:.0f} MB{vs}", flush=True)
        else:
            print(f"   => {who}export: median {r['export_s']:.2f}s = {r['export_ratio']:.2f}x cp, "
                  f"{r['export_ratio_sync']:.2f}x cp+sync; peak RSS tree {r['export_peak_tree_mb']:.0f} MB",
                  flush=True)
    if not args.keep:
        shutil.rmtree(base)
    return rows


def median(xs: list[float]) -> float:
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def check_export(src: Path, exp: Path) -> None:
    """Every exported tensor equals its source tensor bitwise (one tensor in memory at a time)."""
    import torch
    from safetensors import safe_open

    def index(d: Path) -> dict[str, Path]:
        wm = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"] \
            if (d / "model.safetensors.index.json").exists() else None
        if wm is None:
            with safe_open(str(d / "model.safetensors"), "pt") as f:
                return {k: d / "model.safetensors" for k in f.keys()}
        return {k: d / v for k, v in wm.items()}

    a, b = index(src), index(exp)
    if set(a) != set(b):
        raise SystemExit(f"export check: tensor names differ: {sorted(set(a) ^ set(b))[:5]}")
    for name in a:
        with safe_open(str(a[name]), "pt") as fa, safe_open(str(b[name]), "pt") as fb:
            if not torch.equal(fa.get_tensor(name).view(torch.int16), fb.get_tensor(name).view(torch.int16)):
                raise SystemExit(f"export check: {name} differs")
    print(f"   export check: all {len(a)} tensors equal bitwise", flush=True)


# -- report -----------------------------------------------------------------------------------------------------------

def table(rows: list[dict]) -> str:
    multi = len({r["code"] for r in rows}) > 1
    head = ["size GB", "cp s", "convert s", "ratio", "convert GB/s", "peak RSS tree MB", "peak RSS max-process MB",
            "workers", "layers", "cp GB/s", "cp+sync s", "ratio vs cp+sync", "peak anon tree MB", "CPU s",
            "chunks written", "format", "vs native: wall / CPU / RSS"]
    head += ["code"] if multi else []
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---:" for _ in head) + "|"]
    for r in rows:
        if r["kind"] != "convert":
            continue
        vals = [f"{r['size_gb']:.2f}", f"{r['cp_s']:.2f}", f"{r['convert_s']:.2f}", f"{r['ratio']:.2f}",
                f"{r['convert_gbs']:.2f}", f"{r['peak_tree_mb']:.0f}", f"{r['peak_max_mb']:.0f}", r["workers"],
                str(r["layers"]), f"{r['cp_gbs']:.2f}", f"{r['cp_sync_s']:.2f}", f"{r['ratio_sync']:.2f}",
                f"{r['peak_anon_mb']:.0f}", f"{r['cpu_s']:.1f}",
                str(r["out_chunks"]) if r.get("format", "native") == "native" else "-", r.get("format", "native"),
                (f"{r['vs_native_wall']:.2f}x / {r['vs_native_cpu']:.2f}x / {r['vs_native_rss']:.2f}x"
                 if "vs_native_wall" in r else "-")] + ([r["code"]] if multi else [])
        lines.append("| " + " | ".join(vals) + " |")
    return "\n".join(lines)


def export_table(rows: list[dict]) -> str:
    rows = [r for r in rows if r["kind"] == "export"]
    if not rows:
        return ""
    multi = len({r["code"] for r in rows}) > 1
    head = ["size GB", "cp s", "export s", "ratio", "export GB/s", "peak RSS tree MB", "peak RSS max-process MB",
            "CPU s", "ratio vs cp+sync"] + (["code"] if multi else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---:" for _ in head) + "|"]
    for r in rows:
        lines.append("| " + " | ".join([f"{r['size_gb']:.2f}", f"{r['cp_s']:.2f}", f"{r['export_s']:.2f}",
                                         f"{r['export_ratio']:.2f}", f"{r['export_gbs']:.2f}",
                                         f"{r['export_peak_tree_mb']:.0f}", f"{r['export_peak_max_mb']:.0f}",
                                         f"{r['export_cpu_s']:.1f}", f"{r['export_ratio_sync']:.2f}"] +
                                        ([r["code"]] if multi else [])) + " |")
    return "\n".join(lines)


def machine_facts(workdir: Path) -> str:
    def sh(cmd: list[str]) -> str:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout.rstrip()
        except Exception as e:  # noqa: BLE001 - facts are best effort
            return f"({e})"

    probe = workdir if workdir.exists() else workdir.parent
    return "\n".join([f"$ nproc\n{sh(['nproc'])}", f"$ uptime  # load from other users of this machine\n{sh(['uptime'])}",
                      f"$ free -g\n{sh(['free', '-g'])}",
                      f"$ df -h {probe}\n{sh(['df', '-h', str(probe)])}",
                      f"kernel {platform.release()}, python {platform.python_version()}, cpu: {cpu_model()}"])


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def code_fingerprint(root: Path = REPO) -> dict[str, str]:
    """sha256 per converter source file, to notice when they change during a run (shared working trees)."""
    import hashlib

    return {f"{pkg}/{f.name}": hashlib.sha256(f.read_bytes()).hexdigest()[:12]
            for pkg in ("convert", "checkpoint", "shardkit") for f in sorted((root / pkg).glob("*.py"))}


def code_digest(fp: dict[str, str]) -> str:
    import hashlib

    return hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:12]


def parse_args(argv: list[str] | None = None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gb", type=float, default=2.0, help="model size in GB (default 2)")
    ap.add_argument("--sizes", default=None, help="comma-separated sizes in GB, e.g. 1,2 (overrides --size-gb)")
    ap.add_argument("--hidden", type=int, default=2048, help="hidden size, a multiple of 128 (default 2048)")
    ap.add_argument("--vocab", type=int, default=VOCAB, help=f"vocab size (default {VOCAB}, Llama 3)")
    ap.add_argument("--layers", type=int, default=None, help="number of layers (default: from the size)")
    ap.add_argument("--shard-gb", type=float, default=0.5, help="HF shard size in GB (default 0.5)")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--vpp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1, help="expert parallel size (with --experts)")
    ap.add_argument("--etp", type=int, default=None, help="expert tensor parallel size (default: as --tp)")
    ap.add_argument("--experts", type=int, default=0,
                    help="> 0: a Mixtral-style MoE with this many routed experts per layer (e.g. 64)")
    ap.add_argument("--expert-ffn", type=int, default=None,
                    help="expert ffn size with --experts (default: 11/16 x hidden, DeepSeek-V2-Lite's 1408/2048)")
    ap.add_argument("--topk", type=int, default=2, help="experts per token with --experts (config only)")
    ap.add_argument("--qwen3", action="store_true", help="Qwen3's tensor names, q/k norms and config.json "
                    "(with --experts: Qwen3-MoE; Qwen3-30B-A3B width: --hidden 2048 --heads 32 --kv-heads 4 "
                    "--experts 128 --expert-ffn 768 --topk 8 --vocab 151936)")
    ap.add_argument("--heads", type=int, default=None, help="attention heads (default: hidden / 128)")
    ap.add_argument("--kv-heads", type=int, default=KV_HEADS, help=f"KV heads (default {KV_HEADS})")
    ap.add_argument("--workers", default="default",
                    help="comma-separated --workers values to run, 'default' = shardkit's own choice "
                         "(e.g. default,1,2)")
    ap.add_argument("--src", action="append", default=None, metavar="[LABEL=]DIR",
                    help="benchmark the convert/, checkpoint/, shardkit/ packages in DIR (prepended to PYTHONPATH of "
                         "every shardkit subprocess) instead of the installed ones; repeat for an interleaved A/B, "
                         "'installed' names the installed tree, e.g. --src installed --src patched=/tmp/tree")
    ap.add_argument("--formats", default="native",
                    help="comma-separated output formats to convert to, each timed (native, torch_dist, s3; default "
                         "native), e.g. native,torch_dist: torch_dist rows get the 'vs native' ratios; s3: the native "
                         "format to s3://bench/... on a loopback S3 server this script starts (moto's server mode, "
                         "objects in its memory; staging under the work directory), vs native to local disk")
    ap.add_argument("--proof", default="off", choices=("off", "on", "both"),
                    help="time the conversion alone (off: --no-verify where the tree proves by default), the default "
                         "command with its proof (on; rows 'native+proof', 'vs native' = its cost over the "
                         "conversion alone when both run), or both")
    ap.add_argument("--export", action="store_true", help="also time `shardkit convert mcore-to-hf` back")
    ap.add_argument("--check-export", action="store_true", help="with --export: compare every tensor bitwise")
    ap.add_argument("--repeats", type=int, default=1,
                    help="timed runs of every step per size, interleaved; medians are reported (RSS: the maximum)")
    ap.add_argument("--poll", type=float, default=0.05, help="RSS poll interval in seconds (default 0.05)")
    ap.add_argument("--warm", action="store_true", help="do not drop the page cache even when possible")
    ap.add_argument("--cold-code", action="store_true",
                    help="after dropping the cache do not re-warm the Python libraries (torch etc.) either")
    ap.add_argument("--workdir", default="/tmp/shardkit-bench")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write all measurements to this JSON file")
    ap.add_argument("--markdown", default=None, help="also write the report (markdown) to this file")
    args = ap.parse_args(argv)
    args.size_list = [float(x) for x in args.sizes.split(",")] if args.sizes else [args.size_gb]
    args.workers = [w.strip() for w in args.workers.split(",") if w.strip()]
    args.formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    if not args.formats or set(args.formats) - {"native", "torch_dist", "s3"}:
        ap.error(f"--formats: {args.formats!r}: use native, torch_dist and/or s3")
    if args.export and "native" not in args.formats:
        ap.error("--export reads the native checkpoint: add native to --formats")
    for w in args.workers:
        if w != "default" and not (w.isdigit() and int(w) >= 1):
            ap.error(f"--workers: {w!r} is neither 'default' nor a positive integer")
    if args.hidden % HEAD_DIM:
        ap.error(f"--hidden must be a multiple of {HEAD_DIM}")
    if args.layers is not None and args.layers % (args.pp * args.vpp):
        ap.error("--layers must be a multiple of pp*vpp")
    if args.experts < 0 or (args.experts and args.experts % args.ep):
        ap.error(f"--experts {args.experts} must be >= 0 and divisible by --ep {args.ep}")
    if args.ep != 1 and not args.experts:
        ap.error("--ep needs --experts (a MoE shape)")
    args.expert_ffn = (args.expert_ffn or (args.hidden * 11 // 16 // 64) * 64) if args.experts else 0
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    s3_server = start_s3(Path(args.workdir)) if "s3" in args.formats else None  # before Code.parse takes os.environ
    args.codes = [Code.parse(x) for x in (args.src or ["installed"])]
    args.proofs = {"off": [False], "on": [True], "both": [False, True]}[args.proof]
    if len({c.label for c in args.codes}) != len(args.codes):
        raise SystemExit("--src: give every tree its own label (LABEL=DIR)")
    import importlib.util

    if importlib.util.find_spec("psutil") is None:
        raise SystemExit("psutil is required (pip install psutil, or the project's [test] extra)")
    root = Path(args.workdir)
    largest = max(shape_for(g, args.hidden, args.layers, args.pp * args.vpp, args.vocab, args.experts,
                            args.expert_ffn, **shape_extra(args)).nbytes for g in args.size_list)
    # the source and one checkpoint at a time (cp's copy and each checkpoint are removed once timed); --export keeps
    # the checkpoint it reads beside the next one and the export
    need = largest * (4 if args.export or args.keep else 2) * 1.05
    probe = root
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if need > free:
        raise SystemExit(f"need about {need / GB:.1f} GB free under {root}, have {free / GB:.1f} GB")
    work = run_dir(root, "run-")
    cache = Cache.detect(args.warm, warm_code=not args.cold_code)
    cache.codes = args.codes
    facts = machine_facts(work)
    code_before = {c.label: code_fingerprint(c.root) for c in args.codes}
    started = _dt.datetime.now(_dt.timezone.utc)
    cmdline = " ".join([sys.executable, sys.argv[0]] +
                       (argv if argv is not None else sys.argv[1:]))
    print(f"cache mode: {cache.describe()}", flush=True)
    rows: list[dict] = []
    try:
        for g in args.size_list:
            rows += bench_size(args, g, cache, work)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"kept: {work}")
    code_after = {c.label: code_fingerprint(c.root) for c in args.codes}
    load_after = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    notes = []
    for c in args.codes:
        b, a = code_before[c.label], code_after[c.label]
        changed = sorted(k for k in set(b) | set(a) if b.get(k) != a.get(k))
        notes.append(f"{c.label} = {c.root} (convert/, checkpoint/, shardkit/ sha256 {code_digest(b)})" if not changed
                     else f"{c.label} = {c.root}: WARNING, sources changed during this run ({code_digest(b)} -> "
                          f"{code_digest(a)}): {', '.join(changed)}; rerun for clean numbers if any of them is on the "
                          "measured path")
    heads = args.heads or args.hidden // HEAD_DIM
    report = "\n".join([
        f"Command: `{cmdline}`",
        f"Code: {'; '.join(notes)}",
        f"Date: {started.strftime('%Y-%m-%d %H:%M UTC')}",
        f"Cache mode: {cache.describe()}",
        f"Layout: tp={args.tp} pp={args.pp} vpp={args.vpp}"
        + (f" ep={args.ep} etp={args.etp or args.tp}; {'Qwen3-MoE' if args.qwen3 else 'Mixtral'}-style MoE: "
           f"{args.experts} experts (top-{args.topk}) x ffn {args.expert_ffn}, hidden {args.hidden}, " if args.experts
           else f"; {'Qwen3' if args.qwen3 else 'Llama'}-style, hidden {args.hidden}, ffn {ffn_for(args.hidden)}, ") +
        f"{heads} heads / {min(args.kv_heads, heads)} KV heads x {HEAD_DIM}, "
        f"vocab {args.vocab}, untied, bf16, {args.shard_gb:g} GB HF shards",
        "",
        table(rows),
    ])
    et = export_table(rows)
    if et:
        report += "\n\nmcore-to-hf (export back):\n\n" + et
    print("\n" + report)
    if args.markdown:
        Path(args.markdown).write_text(report + "\n\n```\n" + facts + f"\n$ uptime  # at the end\n{load_after}\n```\n")
    if args.json:
        Path(args.json).write_text(json.dumps({"command": cmdline, "date": started.isoformat(), "cache": cache.mode,
                                               "code": {c.label: [str(c.root), code_digest(code_before[c.label]),
                                                                  code_digest(code_after[c.label])]
                                                        for c in args.codes},
                                               "rows": rows}, indent=1) + "\n")
    if s3_server is not None:
        s3_server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
