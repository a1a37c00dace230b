#!/usr/bin/env python3
"""Training-step throughput of shardkit's trainer against HF transformers and megatron-core, in the same run.

One training step = forward, backward and optimizer step (with global-norm clipping) of one micro-batch of
`--mbs` sequences of `--seq` tokens, fp32 on the CPU. Three implementations train the same Llama-shaped config from
the SAME weights on the SAME batch:

- ours:     train/model.py's GPTModel built by `train.parallelize.parallelize`, run by `StageStep` through
            `forward_backward` (the 1F1B driver the trainer uses), then `DistributedOptimizer` reduce/clip/step
            (fp32 main params and gradient buffer, AdamW) -- the trainer's own path, on a process group of one;
- hf:       transformers' LlamaForCausalLM (SDPA attention) with its own loss and torch.optim.AdamW, clipped with
            clip_grad_norm_ (what HF's Trainer does);
- megatron: megatron-core's GPTModel with the local layer spec (`get_gpt_layer_local_spec`) wrapped in its
            DistributedDataParallel (fp32 grad buffer) and its DistributedOptimizer (torch AdamW underneath on CPU),
            built with the CPU shims of tests/megatron_oracle.py on a gloo group of one.

The weights are a randomly initialised LlamaForCausalLM (seeded) saved once with save_pretrained; ours loads them
through the converter's mapping (checkpoint.families.tensor_maps -> canonical tensors), megatron-core through its own
sharded-state-dict keys (which are the canonical names), checked equal after loading. All three therefore compute
the same loss at the first step (printed; a mismatch is reported in the JSON).

Each implementation lives in its own worker process (so peak RSS is per implementation, and megatron-core's
monkey-patches of torch stay out of the others), driven step by step over a pipe. After `--warmup` untimed steps the
parent runs `--steps` rounds, each one timed step per implementation, in rotating order (A B C, B C A, ...): on a
shared machine, load hits all of them alike. Reported: the median step time, tokens/s, the median of the per-round
ratios ours/hf and ours/megatron (adjacent steps, so load swings mostly cancel), peak RSS of each worker while
stepping (VmHWM reset after setup) and over its life, and achieved FLOP/s from train/metrics.py `flops_per_step`
(Megatron's convention; MFU when --peak-tflops is given).

    .venv/bin/python scripts/bench_train.py                          # ~100M-param Llama, 2 threads each
    .venv/bin/python scripts/bench_train.py --size 25m --steps 12    # the 25M Llama of issue 16
    .venv/bin/python scripts/bench_train.py --layers 2 --steps 3 --json out.json --markdown out.md
    .venv/bin/python scripts/bench_train.py --frameworks ours,hf --profile ours   # torch.profiler table of ours

`--launch torchrun` instead runs the real trainer (`shardkit continue-pretrain` under torchrun, gloo) on a converted
checkpoint of the same weights and a synthetic .bin/.idx corpus, once per `--layout` (repeated `--repeats` times,
layouts interleaved), and reads tokens/s from its metrics.jsonl; every collective is timed on each rank
(torch.distributed wrapped in the launched process) to give the share of step time spent in communication:

    .venv/bin/python scripts/bench_train.py --launch torchrun --seq 1024 --mbs 1 --layout tp=1 --layout cp=2 \
        --layout dp=2 --layout tp=2
    # MoE: EP=2 against EP=1 on the same two ranks (DP defaults to EP, so ep=2 is dp=2 ep=2)
    .venv/bin/python scripts/bench_train.py --launch torchrun --experts 8 --topk 2 --layout dp=2 --layout ep=2
    # MoE at TP x EP: tp=2,ep=2 is 4 ranks (TP 2 x DP 2, EP 2 inside DP; sequence parallel, which MoE under TP needs,
    # is switched on for every tp > 1 layout of an MoE model), against EP 2 alone on 2 ranks
    .venv/bin/python scripts/bench_train.py --launch torchrun --experts 8 --topk 2 --layout ep=2 --layout tp=2,ep=2
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench_convert import machine_facts, reuse_dir  # noqa: E402 -- the sibling script (scripts/ is this script's sys.path[0])
from checkpoint.errors import LayoutError  # noqa: E402
from checkpoint.run_layout import RunLayout  # noqa: E402

FRAMEWORKS = ("ours", "hf", "megatron")
MB = 1 << 20
TAG = "BENCH "  # worker -> parent messages on stdout start with this


# -- the benchmarked configuration -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Spec:
    """Model shape, batch and optimizer settings shared by every implementation."""

    hidden: int = 768
    layers: int = 8
    heads: int = 12
    kv_heads: int = 4
    ffn: int = 2048
    vocab: int = 32000
    seq: int = 256
    mbs: int = 2
    threads: int = 2
    seed: int = 1234
    experts: int = 0  # > 0: Mixtral-style MoE (torchrun mode only)
    topk: int = 2
    lr: float = 3e-4
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    clip_grad: float = 1.0
    rms_eps: float = 1e-5
    rope_theta: float = 10000.0

    @property
    def tokens(self) -> int:
        return self.mbs * self.seq

    def hf_config(self):
        import transformers

        common = dict(vocab_size=self.vocab, hidden_size=self.hidden, num_hidden_layers=self.layers,
                      num_attention_heads=self.heads, num_key_value_heads=self.kv_heads, intermediate_size=self.ffn,
                      max_position_embeddings=max(self.seq, 2048), rms_norm_eps=self.rms_eps,
                      rope_theta=self.rope_theta, tie_word_embeddings=False, initializer_range=0.02)
        if self.experts:
            return transformers.MixtralConfig(num_local_experts=self.experts, num_experts_per_tok=self.topk,
                                              sliding_window=None, router_aux_loss_coef=0.0, **common)
        return transformers.LlamaConfig(attention_bias=False, mlp_bias=False, **common)

    def model_config(self):
        """shardkit's ModelConfig of the same model (what the converter reads from config.json)."""
        from checkpoint.config import ModelConfig

        return ModelConfig.from_hf(self.hf_config().to_dict())

    def describe(self) -> str:
        mlp = f"MoE {self.experts} experts top-{self.topk} x ffn {self.ffn}" if self.experts else f"ffn {self.ffn}"
        return (f"hidden {self.hidden}, {self.layers} layers, {self.heads} heads / {self.kv_heads} KV heads, {mlp}, "
                f"vocab {self.vocab}, untied; micro-batch {self.mbs} x seq {self.seq} = {self.tokens} tokens/step; "
                f"fp32, {self.threads} thread(s) per implementation")


def make_weights(spec: Spec, out: Path) -> None:
    """A seeded random LlamaForCausalLM (or Mixtral), saved with save_pretrained: the weights every worker loads."""
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(spec.seed)
    cls = transformers.MixtralForCausalLM if spec.experts else transformers.LlamaForCausalLM
    model = cls(spec.hf_config()).float()
    model.save_pretrained(out, safe_serialization=True)


def ensure_weights(spec: Spec, workdir: Path, log: Callable[[str], None]) -> Path:
    """<workdir>/hf holds the weights of this spec (made once; a workdir reused with another spec is remade)."""
    weights = workdir / "hf"
    stamp = weights / "bench_spec.json"
    model = {k: v for k, v in asdict(spec).items() if k in _MODEL_FIELDS}
    if not stamp.is_file() or json.loads(stamp.read_text()) != model:
        shutil.rmtree(weights, ignore_errors=True)
        log(f"weights: seeded random init -> {weights}")
        make_weights(spec, weights)
        stamp.write_text(json.dumps(model))
    return weights


# the named sizes (--size): the project's ~100M bench and issue 16's small model, where per-step fixed cost shows
SIZES = {"100m": Spec(),
         "25m": Spec(hidden=512, layers=6, heads=8, kv_heads=4, ffn=1792, vocab=4096, mbs=4)}
# the flags that override a size's field
SPEC_FLAGS = ("hidden", "layers", "heads", "kv_heads", "ffn", "vocab", "seq", "mbs", "threads", "seed", "experts",
              "topk")

# what the weights depend on (not the batch, threads or optimizer settings)
_MODEL_FIELDS = ("hidden", "layers", "heads", "kv_heads", "ffn", "vocab", "seed", "experts", "topk", "rms_eps",
                 "rope_theta")


def batch(spec: Spec):
    """The one batch every step of every implementation trains on: (input ids, next-token labels), [mbs, seq]."""
    import torch

    g = torch.Generator().manual_seed(spec.seed + 1)
    tokens = torch.randint(0, spec.vocab, (spec.mbs, spec.seq + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def hf_state(weights: Path) -> dict:
    from safetensors.torch import load_file

    out: dict = {}
    for f in sorted(weights.glob("*.safetensors")):
        out.update(load_file(f))
    return out


# -- implementations (each runs inside its own worker process) -------------------------------------------------------

class Impl:
    """setup() builds model and optimizer from the saved weights; step() runs one training step, returns the loss."""

    def __init__(self, spec: Spec, weights: Path) -> None:
        self.spec, self.weights = spec, weights

    def setup(self) -> dict:
        raise NotImplementedError

    def step(self) -> float:
        raise NotImplementedError

    def close(self) -> None:
        pass


class Ours(Impl):
    """The trainer's path: parallelize -> StageStep -> forward_backward -> DistributedOptimizer reduce/clip/step."""

    def setup(self) -> dict:
        import torch

        from checkpoint.sharding import Rule
        from train import checkpointing as ckpt_io
        from train.loop import init_distributed
        from train.optim import DistributedOptimizer, OptimizerConfig
        from checkpoint.run_layout import RunLayout
        from train.config import ParallelConfig
        from train.parallel.groups import build_groups
        from train.parallelize import parallelize
        from train.parallel.pipeline import StageStep

        s = self.spec
        init_distributed(10.0)
        cfg = s.model_config()
        run = RunLayout()
        groups = build_groups(run)
        layout = run.model_parallel
        model = parallelize(cfg, groups, torch.device("cpu"), torch.float32, ParallelConfig()).model
        table = ckpt_io.param_table(model, cfg, layout, groups)
        canonical = _canonical_from_hf(cfg, self.weights)
        ckpt_io.load_model(_InMemoryCheckpoint(canonical), table, layout, groups)
        del canonical
        trainable = [(lp.name, lp.param) for lp in table if lp.param.requires_grad]
        replicated = {lp.name for lp in table if lp.spec.rule is Rule.REPLICATED}
        tied = {lp.name for lp in table if lp.tied_copy}
        ocfg = OptimizerConfig(lr=s.lr, weight_decay=s.weight_decay, adam_beta1=s.beta1, adam_beta2=s.beta2,
                               adam_eps=s.eps, clip_grad=s.clip_grad)
        self.opt = DistributedOptimizer(trainable, groups, ocfg, replicated, tied, cfg.tie_word_embeddings)
        self.stage = StageStep(model, groups)
        self.ids, self.labels = batch(s)
        self.act_shape = (s.mbs, s.seq, s.hidden)
        return {"params": sum(p.numel() for p in model.parameters())}

    def step(self) -> float:
        import torch

        from train.parallel.pipeline import forward_backward

        self.opt.zero_grad()
        loss = forward_backward(self.stage, [(self.ids, self.labels)], self.act_shape, torch.float32)
        self.opt.reduce_grads()
        self.opt.clip()
        self.opt.step(self.spec.lr)
        return float(loss)

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


class _InMemoryCheckpoint:
    """The one method `train.checkpointing.load_model` needs from a Checkpoint, over in-memory canonical tensors
    (layout tp=1 pp=1: the local region is the whole tensor)."""

    def __init__(self, tensors: dict) -> None:
        self.tensors = tensors

    def read_local(self, key: str, layout, coord) -> tuple:
        return (self.tensors[key],)


def decay_groups(named: list[tuple[str, Any]], weight_decay: float) -> list[dict]:
    """AdamW groups as ours and megatron-core make them: no weight decay on 1-D tensors (norms) and biases."""
    decay = [p for n, p in named if p.ndim > 1 and not n.endswith(".bias")]
    no_decay = [p for n, p in named if not (p.ndim > 1 and not n.endswith(".bias"))]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


class HF(Impl):
    """transformers' LlamaForCausalLM: model(input_ids, labels) -> loss, backward, clip_grad_norm_, AdamW."""

    def setup(self) -> dict:
        import torch
        import transformers

        s = self.spec
        cls = transformers.MixtralForCausalLM if s.experts else transformers.LlamaForCausalLM
        self.model = cls.from_pretrained(self.weights, dtype=torch.float32, attn_implementation="sdpa").train()
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        self.opt = torch.optim.AdamW(decay_groups(named, s.weight_decay), lr=s.lr, betas=(s.beta1, s.beta2),
                                     eps=s.eps)
        self.ids, self.labels = batch(s)
        return {"params": sum(p.numel() for p in self.params)}

    def step(self) -> float:
        import torch

        self.opt.zero_grad(set_to_none=True)
        # shift_labels: the labels are already the next tokens (as for ours and megatron-core), so HF's loss
        # covers all mbs x seq positions instead of shifting them once more
        out = self.model(input_ids=self.ids, labels=self.labels, shift_labels=self.labels, use_cache=False)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, self.spec.clip_grad)
        self.opt.step()
        return float(out.loss.detach())


class Megatron(Impl):
    """megatron-core GPTModel (local spec) + its DistributedDataParallel and DistributedOptimizer, on CPU."""

    def setup(self) -> dict:
        import torch

        from tests.megatron_oracle import build, cuda_as_cpu, global_tensors, init_megatron_cpu

        cuda_as_cpu()
        init_megatron_cpu(port_span=20000)
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        s = self.spec
        cfg = s.model_config()
        model = build({"num_layers": s.layers, "hidden_size": s.hidden, "num_attention_heads": s.heads,
                       "num_query_groups": s.kv_heads, "ffn_hidden_size": s.ffn, "kv_channels": s.hidden // s.heads,
                       "layernorm_epsilon": s.rms_eps, "add_bias_linear": False,
                       "padded_vocab_size": cfg.padded_vocab_size(1), "max_sequence_length": s.seq,
                       "rotary_base": s.rope_theta, "tied": False}).train()
        canonical = _canonical_from_hf(cfg, self.weights)
        _load_megatron(model, canonical)
        got = global_tensors(model)
        bad = sorted(k for k in canonical if k not in got or not torch.equal(got[k], canonical[k]))
        if bad or set(got) != set(canonical):
            raise RuntimeError(f"megatron-core weights differ from the canonical ones after loading: {bad[:5]}")
        del canonical, got
        self.model = model
        self.ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
            use_distributed_optimizer=True, grad_reduce_in_fp32=True, overlap_grad_reduce=False), model)
        self.opt = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=s.lr, weight_decay=s.weight_decay, adam_beta1=s.beta1, adam_beta2=s.beta2,
            adam_eps=s.eps, clip_grad=s.clip_grad, bf16=False, params_dtype=torch.float32,
            use_distributed_optimizer=True), [self.ddp])
        self.ids, self.labels = batch(s)
        self.pos = torch.arange(s.seq)[None].expand(s.mbs, -1)
        self.mask = torch.triu(torch.ones(s.seq, s.seq, dtype=torch.bool), 1)[None, None]
        return {"params": sum(p.numel() for p in model.parameters())}

    def step(self) -> float:
        self.ddp.zero_grad_buffer()
        self.opt.zero_grad()
        loss = self.ddp(self.ids, self.pos, self.mask, labels=self.labels).float().mean()
        loss.backward()
        self.ddp.finish_grad_sync()
        ok, _, _ = self.opt.step()
        if not ok:
            raise RuntimeError("megatron-core's optimizer skipped the step")
        return float(loss.detach())

    def close(self) -> None:
        import torch

        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _canonical_from_hf(cfg, weights: Path) -> dict:
    """HF tensors -> canonical (Megatron sharded-state-dict) tensors through the converter's own mapping."""
    from checkpoint.layout import Layout
    from checkpoint.families import tensor_maps
    from checkpoint.families.mapping import dict_reader, stack_canonical

    return stack_canonical(tensor_maps(cfg, Layout()), dict_reader(hf_state(weights)))


def _load_megatron(model, canonical: dict) -> None:
    """Copy canonical tensors into megatron-core's parameters through its own sharded state dict: each ShardedTensor
    names its canonical key and where its data sits in the global tensor (layer axis prepended, [gate; up] halves as
    separate pieces that are views of fc1)."""
    import torch
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    items = []
    for v in nested_values(model.sharded_state_dict()):
        if isinstance(v, ShardedTensorFactory):
            built = v.build()
            items += list(nested_values(built)) if isinstance(built, (dict, list)) else [built]
        else:
            items.append(v)
    with torch.no_grad():
        for t in items:
            if not isinstance(t, ShardedTensor) or t.key not in canonical:
                continue
            shape = (1,) * t.prepend_axis_num + tuple(t.local_shape)
            region = canonical[t.key][tuple(slice(o, o + n) for o, n in zip(t.global_offset, shape))]
            t.data.copy_(region.reshape(t.data.shape))


IMPLS: dict[str, type[Impl]] = {"ours": Ours, "hf": HF, "megatron": Megatron}


# -- worker process ----------------------------------------------------------------------------------------------------

def _rss_status() -> dict[str, int]:
    """VmRSS / VmHWM (peak since start or the last reset) of this process, bytes (Linux)."""
    out = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    k, v = line.split(":")
                    out[k] = int(v.split()[0]) * 1024
    except OSError:
        pass
    return out


def _reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux clear_refs 5), so the peak measured afterwards is the steps' own."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _send(msg: dict) -> None:
    sys.stdout.write(TAG + json.dumps(msg) + "\n")
    sys.stdout.flush()


def worker_main(name: str, spec: Spec, weights: Path, profile_dir: Path | None) -> None:
    """Set up one implementation, then obey 'step' / 'profile' / 'quit' lines on stdin."""
    import torch

    torch.set_num_threads(spec.threads)
    t0 = time.perf_counter()
    impl = IMPLS[name](spec, weights)
    try:
        info = impl.setup()
    except Exception as e:  # reported as this implementation's result ("where it runs")
        _send({"error": f"{type(e).__name__}: {e}"})
        return
    import gc

    gc.collect()
    rss = _rss_status()
    reset = _reset_peak_rss()
    _send({"ready": True, "setup_seconds": time.perf_counter() - t0, "rss_after_setup": rss.get("VmRSS"),
           "peak_reset": reset, "threads": torch.get_num_threads(), **info})
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "step":
            t, c = time.perf_counter(), time.process_time()
            loss = impl.step()
            _send({"seconds": time.perf_counter() - t, "cpu_seconds": time.process_time() - c, "loss": loss})
        elif cmd == "profile":
            _send(_profile(impl, name, profile_dir))
        elif cmd == "quit":
            rss = _rss_status()
            life = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # VmHWM's lifetime twin, in KiB
            _send({"peak_rss_steps": rss.get("VmHWM") if reset else None,
                   "peak_rss_process": max(life, rss.get("VmHWM", 0))})
            break
    impl.close()


def _profile(impl: Impl, name: str, out: Path | None) -> dict:
    """One step under torch.profiler: the table of the most expensive ops (self CPU time)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        impl.step()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"profile_{name}.txt").write_text(table)
        prof.export_chrome_trace(str(out / f"trace_{name}.json"))
    return {"profile": table}


class Worker:
    """Parent-side handle of a worker process."""

    def __init__(self, name: str, spec: Spec, weights: Path, profile_dir: Path | None) -> None:
        self.name = name
        env = _env_with_repo()
        for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            env[k] = str(spec.threads)
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", name, "--spec-json",
               json.dumps(asdict(spec)), "--weights", str(weights)]
        if profile_dir is not None:
            cmd += ["--profile-dir", str(profile_dir)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                                     cwd=REPO)

    def read(self) -> dict:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(TAG):
                return json.loads(line[len(TAG):])
        raise RuntimeError(f"{self.name} worker exited (rc {self.proc.wait()}); its stderr is above")

    def ask(self, cmd: str) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self.read()

    def finish(self) -> dict:
        try:
            return self.ask("quit")
        finally:
            self.proc.wait(timeout=120)


# -- the in-process comparison (parent) --------------------------------------------------------------------------------

def loadavg() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def run_compare(spec: Spec, frameworks: list[str], warmup: int, steps: int, workdir: Path, peak_tflops: float | None,
                profile: list[str], log: Callable[[str], None] = print) -> dict:
    import torch

    from train.metrics import flops_per_step

    weights = ensure_weights(spec, workdir, log)
    cfg = spec.model_config()
    flops = flops_per_step(cfg, spec.seq, spec.tokens)
    results: dict[str, dict] = {}
    workers: dict[str, Worker] = {}
    load = {"start": loadavg()}
    prof_dir = workdir / "profile" if profile else None
    started = {name: Worker(name, spec, weights, prof_dir) for name in frameworks}  # set-up is not timed
    for name, w in started.items():
        msg = w.read()
        if "error" in msg:
            log(f"{name}: does not run here: {msg['error']}")
            results[name] = {"error": msg["error"]}
            w.proc.wait(timeout=60)
            continue
        workers[name] = w
        results[name] = {k: msg[k] for k in ("setup_seconds", "rss_after_setup", "params", "threads")}
        results[name].update(seconds=[], cpu_seconds=[], losses=[])
        log(f"{name}: ready in {msg['setup_seconds']:.1f} s, {msg['params'] / 1e6:.1f} M params, "
            f"RSS {msg['rss_after_setup'] / MB:.0f} MB")
    names = list(workers)
    for i in range(warmup):
        for n in names:
            r = workers[n].ask("step")
            results[n]["losses"].append(r["loss"])
            results[n].setdefault("warmup_seconds", []).append(r["seconds"])
        log(f"warm-up {i + 1}/{warmup}: " + "  ".join(f"{n} {results[n]['warmup_seconds'][-1]:.2f} s" for n in names))
    rounds: list[dict[str, float]] = []
    for i in range(steps):
        order = names[i % len(names):] + names[: i % len(names)] if names else []
        this = {}
        for n in order:
            r = workers[n].ask("step")
            this[n] = r["seconds"]
            results[n]["seconds"].append(r["seconds"])
            results[n]["cpu_seconds"].append(r["cpu_seconds"])
            results[n]["losses"].append(r["loss"])
        rounds.append(this)
        log(f"step {i + 1}/{steps}: " + "  ".join(f"{n} {this[n]:.2f} s" for n in names) + f"  (load {loadavg()})")
    for n in profile:
        if n in workers:
            log(f"profiling one step of {n}")
            log(workers[n].ask("profile")["profile"])
    for n, w in workers.items():
        results[n].update({k: v for k, v in w.finish().items()})
    load["end"] = loadavg()

    for n in names:
        r = results[n]
        med = statistics.median(r["seconds"]) if r["seconds"] else float("nan")
        r["median_seconds"] = med
        r["median_cpu_seconds"] = statistics.median(r["cpu_seconds"]) if r["cpu_seconds"] else float("nan")
        r["tokens_per_second"] = spec.tokens / med
        r["flops_per_second_megatron"] = flops["megatron"] / med
        r["flops_per_second_torchtitan"] = flops["torchtitan"] / med
        if peak_tflops:
            r["mfu_megatron"] = r["flops_per_second_megatron"] / (peak_tflops * 1e12)
    ratios = {}
    if "ours" in names:
        for base in names:
            if base == "ours":
                continue
            paired = [r[base] / r["ours"] for r in rounds if base in r and "ours" in r]
            ratios[f"ours/{base}"] = {
                "median_of_round_ratios": statistics.median(paired) if paired else None,
                "ratio_of_medians": results["ours"]["tokens_per_second"] / results[base]["tokens_per_second"],
                "cpu_time_ratio_of_medians": (results[base]["median_cpu_seconds"]
                                              / results["ours"]["median_cpu_seconds"]),
                "rounds": paired}
    first = {n: results[n]["losses"][0] for n in names if results[n]["losses"]}
    ref = first.get("ours", next(iter(first.values()), None))
    loss_check = {"first_step_loss": first,
                  "max_rel_diff": max((abs(v - ref) / abs(ref) for v in first.values()), default=0.0) if ref else None}
    return {"spec": asdict(spec), "describe": spec.describe(), "warmup": warmup, "steps": steps,
            "flops_per_step": flops, "results": results, "ratios": ratios, "loss_check": loss_check,
            "load": load, "machine": machine_facts(workdir), "torch": torch.__version__,
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat()}


def _env_with_repo() -> dict:
    """The environment of every child: this checkout first on the path, no warnings or progress bars."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("PYTHONWARNINGS", "ignore")
    env.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    return env




def markdown_compare(res: dict) -> str:
    rows = ["| implementation | median step s | tokens/s | ours / this (wall, paired rounds) | median CPU s / step | "
            "ours / this (CPU time) | achieved GFLOP/s (Megatron conv.) | peak RSS steps MB | peak RSS process MB | "
            "first-step loss |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for n, r in res["results"].items():
        if "error" in r:
            rows.append(f"| {n} | does not run: {r['error'][:80]} | | | | | | | | |")
            continue
        ratio = res["ratios"].get(f"ours/{n}", {})
        wall = "1.00" if n == "ours" else f"{ratio.get('median_of_round_ratios') or float('nan'):.2f}x"
        cpu = "1.00" if n == "ours" else f"{ratio.get('cpu_time_ratio_of_medians') or float('nan'):.2f}x"
        mb = lambda v: f"{v / MB:.0f}" if v else "-"  # noqa: E731
        rows.append(f"| {n} | {r['median_seconds']:.3f} | {r['tokens_per_second']:.0f} | {wall} | "
                    f"{r['median_cpu_seconds']:.2f} | {cpu} | {r['flops_per_second_megatron'] / 1e9:.1f} | "
                    f"{mb(r.get('peak_rss_steps'))} | {mb(r.get('peak_rss_process'))} | {r['losses'][0]:.5f} |")
    lc = res["loss_check"]
    return "\n".join([
        f"Config: {res['describe']}; {res['warmup']} warm-up step(s) excluded, median of {res['steps']} rounds "
        "(rotating order). ours / this > 1 means ours is faster: (wall) median over rounds of this step's time / "
        "ours' in the same round; (CPU time) ratio of the median process CPU seconds per step.",
        f"Load average (1, 5, 15 min) at start {res['load']['start']}, at end {res['load']['end']}; "
        f"torch {res['torch']}.",
        f"First-step losses agree to {lc['max_rel_diff']:.1e} relative (same weights, same batch).", "",
        *rows, "", "```", res["machine"], "```"])


# -- torchrun mode: the real trainer at several layouts ---------------------------------------------------------------

LAYOUT_FLAGS = ("tp", "pp", "vpp", "cp", "ep", "etp")  # the RunLayout fields continue-pretrain takes as --<name>


def parse_layout(text: str) -> RunLayout:
    """'tp=2,cp=2' -> RunLayout(tp=2, cp=2); DP defaults to EP (experts split over DP)."""
    try:
        lay = RunLayout.parse(text)
    except LayoutError as e:
        raise SystemExit(str(e)) from None
    return lay if "dp=" in text else replace(lay, dp=lay.ep)


def prepare_trainer_inputs(spec: Spec, workdir: Path, iters: int, global_batch: int,
                           log: Callable[[str], None]) -> tuple[Path, Path]:
    """A converted checkpoint of the seeded weights and a synthetic corpus big enough for the run."""
    import numpy as np

    from train.data.indexed import token_dtype, write_indexed

    weights, ckpt, prefix = ensure_weights(spec, workdir, log), workdir / "ckpt", workdir / "data" / "corpus"
    latest = ckpt / "latest"
    if not latest.exists() or latest.stat().st_mtime < (weights / "bench_spec.json").stat().st_mtime:
        log(f"converting {weights} -> {ckpt}")
        subprocess.run([sys.executable, "-m", "shardkit.cli", "convert", "hf-to-mcore", str(weights), str(ckpt),
                        "--quiet", "--overwrite", "--no-verify"], check=True, cwd=REPO, env=_env_with_repo())
    need = (iters + 4) * global_batch * (spec.seq + 1) * 2
    rng = np.random.default_rng(spec.seed)
    docs = (rng.integers(0, spec.vocab, size=int(n)) for n in [spec.seq * 4] * max(4, need // (spec.seq * 4) + 1))
    write_indexed(prefix, docs, token_dtype(spec.vocab))
    return ckpt, prefix


def run_torchrun(spec: Spec, layouts: list[dict[str, int]], warmup: int, steps: int, repeats: int, workdir: Path,
                 log: Callable[[str], None] = print, timeout: float = 1800) -> dict:
    """Each layout `repeats` times, interleaved (A B A B ...); tokens/s from the trainer's metrics.jsonl (iterations
    after `warmup`), communication share from the collectives timed inside the ranks (rank 0's view, and the mean)."""
    gbs = {lay: spec.mbs * lay.dp for lay in layouts}
    iters = warmup + steps
    ckpt, prefix = prepare_trainer_inputs(spec, workdir, iters, max(gbs.values()), log)
    per: dict[str, dict] = {lay.label(): {"layout": lay.to_dict(), "runs": []} for lay in layouts}
    load = {"start": loadavg()}
    for rep in range(repeats):
        for lay in layouts:
            name = lay.label()
            out = workdir / "runs" / f"{name.replace(' ', '_')}_{rep}"
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir(parents=True)
            nproc = lay.world
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                   str(Path(__file__).resolve()), "--rank-main", str(out / "comm"), "--",
                   "continue-pretrain", "--load", str(ckpt), "--data", str(prefix), "--save", str(out / "save"),
                   "--micro-batch-size", str(spec.mbs), "--global-batch-size", str(gbs[lay]),
                   "--seq-length", str(spec.seq), "--train-iters", str(iters), "--log-interval", "1",
                   "--lr", str(spec.lr), "--weight-decay", str(spec.weight_decay), "--clip-grad",
                   str(spec.clip_grad), "--lr-decay-style", "constant", "--save-interval", str(10 ** 6),
                   "--eval-interval", "0", "--split", "100,0,0",
                   "--attention-dropout", "0", "--hidden-dropout", "0"]  # megatron-core's side runs without dropout
            for k in LAYOUT_FLAGS:
                if (getattr(lay, k) or 1) > 1:
                    cmd += [f"--{k}", str(getattr(lay, k))]
            if spec.experts and lay.tp > 1:  # MoE under TP needs sequence parallelism (as Megatron asserts)
                cmd.append("--sequence-parallel")
            env = _env_with_repo()
            env["OMP_NUM_THREADS"] = str(max(1, spec.threads // nproc))  # every layout gets --threads cores in all
            t0 = time.perf_counter()
            with open(out / "log.txt", "w") as f:  # the ranks' output, kept for a failed or hung run
                try:
                    rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT,
                                        timeout=timeout).returncode
                except subprocess.TimeoutExpired:
                    rc = f"timed out after {timeout} s"
            if rc:
                err = " | ".join((out / "log.txt").read_text().strip().splitlines()[-3:])
                log(f"{name}: failed ({rc}): {err} (log: {out / 'log.txt'})")
                per[name]["error"] = f"{rc}: {err}"
                continue
            run = _read_run(out, warmup)
            run["wall_seconds"] = time.perf_counter() - t0
            per[name]["runs"].append(run)
            log(f"[{rep + 1}/{repeats}] {name}: {run['tokens_per_second']:.0f} tokens/s, step "
                f"{run['median_step_seconds']:.2f} s, communication {100 * run['comm_share_rank0']:.0f}% "
                f"(rank 0), load {loadavg()}")
    load["end"] = loadavg()
    base = layouts[0].label()
    for name, p in per.items():
        if not p["runs"]:
            continue
        p["tokens_per_second"] = statistics.median(r["tokens_per_second"] for r in p["runs"])
        p["comm_share_rank0"] = statistics.median(r["comm_share_rank0"] for r in p["runs"])
        p["comm_share_mean"] = statistics.median(r["comm_share_mean"] for r in p["runs"])
        if per[base].get("runs"):
            p[f"vs_{base.replace(' ', '_')}"] = p["tokens_per_second"] / per[base]["tokens_per_second"]
    return {"spec": asdict(spec), "describe": spec.describe(), "warmup": warmup, "steps": steps, "repeats": repeats,
            "layouts": per, "baseline": base, "load": load, "machine": machine_facts(workdir),
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat()}


def _read_run(out: Path, warmup: int) -> dict:
    metrics = [json.loads(ln) for ln in (out / "save" / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    timed = [m for m in metrics if m["iteration"] > warmup] or metrics
    comm = {}
    for f in sorted((out / "comm").glob("rank*.jsonl")):
        rows = [json.loads(ln) for ln in f.read_text().splitlines() if ln.strip()]
        rows = [r for r in rows if r["iteration"] > warmup] or rows
        comm[int(f.stem[4:])] = sum(r["comm_seconds"] for r in rows) / max(1e-9, sum(r["step_seconds"] for r in rows))
    step = statistics.median(m["step_seconds"] for m in timed)
    tps = [m.get("tokens_per_s", m.get("tokens_per_second")) for m in timed]  # the key the trainer logs, old or new
    return {"tokens_per_second": statistics.median(tps), "median_step_seconds": step,
            "losses": [m["loss"] for m in metrics], "mem_gib": max((m.get("mem_gib") or 0) for m in metrics),
            "comm_share_rank0": comm.get(0, 0.0), "comm_share_mean": statistics.fmean(comm.values()) if comm else 0.0,
            "comm_share_by_rank": comm}


def rank_main(comm_dir: Path, argv: list[str]) -> int:
    """Inside torchrun: time every torch.distributed collective (and the waits of async ones) on this rank, per
    training iteration, then run the shardkit CLI. Written to <comm_dir>/rank<R>.jsonl."""
    import torch.distributed as dist

    from shardkit import cli
    from train import loop

    spent = [0.0]

    def timed(fn):
        def run(*a, **k):
            t = time.perf_counter()
            out = fn(*a, **k)
            if k.get("async_op") and out is not None:
                return _TimedWork(out, spent)
            spent[0] += time.perf_counter() - t
            return out
        return run

    for name in ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
                 "broadcast", "all_to_all", "all_to_all_single", "barrier", "send", "recv", "batch_isend_irecv"):
        if hasattr(dist, name):
            setattr(dist, name, timed(getattr(dist, name)))
    for name in ("isend", "irecv"):
        orig = getattr(dist, name)
        setattr(dist, name, lambda *a, _f=orig, **k: _TimedWork(_f(*a, **k), spent))

    orig_step = loop.Trainer.train_step

    def train_step(self, *a, **k):
        spent[0] = 0.0
        t = time.perf_counter()
        m = orig_step(self, *a, **k)
        row = {"iteration": self.iteration + 1, "step_seconds": time.perf_counter() - t, "comm_seconds": spent[0]}
        comm_dir.mkdir(parents=True, exist_ok=True)
        with open(comm_dir / f"rank{self.groups.rank}.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        return m

    loop.Trainer.train_step = train_step
    return cli.main(argv)


class _TimedWork:
    """An async work handle whose wait() time counts as communication."""

    def __init__(self, work, spent: list[float]) -> None:
        self.work, self.spent = work, spent

    def wait(self, *a, **k):
        t = time.perf_counter()
        try:
            return self.work.wait(*a, **k)
        finally:
            self.spent[0] += time.perf_counter() - t

    def __getattr__(self, name: str):
        return getattr(self.work, name)


def markdown_torchrun(res: dict) -> str:
    base = res["baseline"].replace(" ", "_")
    rows = [f"| layout | ranks | tokens/s (global) | vs {res['baseline']} | comm share rank 0 | comm share mean | "
            "runs |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    for name, p in res["layouts"].items():
        if not p.get("runs"):
            rows.append(f"| {name} | {p['layout']['world']} | failed: {p.get('error', '')[:80]} | | | | 0 |")
            continue
        rows.append(f"| {name} | {p['layout']['world']} | {p['tokens_per_second']:.0f} | "
                    f"{p.get(f'vs_{base}', float('nan')):.2f}x | {100 * p['comm_share_rank0']:.0f}% | "
                    f"{100 * p['comm_share_mean']:.0f}% | {len(p['runs'])} |")
    return "\n".join([
        f"Config: {res['describe']} in all (threads split over the ranks); `shardkit continue-pretrain` under "
        f"torchrun (gloo), global batch = micro-batch x DP; {res['warmup']} warm-up iteration(s) excluded, median "
        f"of {res['steps']} iterations, median of {res['repeats']} runs per layout (layouts interleaved). Comm share: "
        "time inside torch.distributed calls and waits / step time (on gloo over shared cores it includes waiting "
        "for the slower rank).",
        f"Load average at start {res['load']['start']}, at end {res['load']['end']}.", "", *rows,
        "", "```", res["machine"], "```"])


# -- command line ------------------------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--size", choices=sorted(SIZES), default="100m",
      help="named model and batch: 100m (hidden 768, 8 layers, vocab 32000, micro-batch 2) or 25m (hidden 512, "
           "6 layers, vocab 4096, micro-batch 4); the flags below override its fields")
    for flag in SPEC_FLAGS:
        a(f"--{flag.replace('_', '-')}", type=int,
          help={"mbs": "micro-batch size (sequences per step)", "threads": "torch threads of each implementation",
                "experts": "Mixtral-style MoE with N experts (torchrun mode)"}.get(flag))
    a("--steps", type=int, default=5, help="timed steps (rounds) per implementation; the median is reported")
    a("--warmup", type=int, default=1, help="untimed steps first")
    a("--frameworks", default=",".join(FRAMEWORKS), help="comma-separated subset of ours,hf,megatron")
    a("--peak-tflops", type=float, help="peak FLOP/s of the machine (TFLOP/s) for an MFU figure")
    a("--profile", default="", help="comma-separated implementations to profile for one step after timing")
    a("--launch", choices=["inprocess", "torchrun"], default="inprocess",
      help="inprocess: ours vs hf vs megatron step by step; torchrun: the trainer at each --layout")
    a("--layout", action="append", default=[], help="torchrun mode: e.g. tp=1, dp=2, tp=2, cp=2, ep=2 (repeatable; "
                                                   "the first is the baseline)")
    a("--repeats", type=int, default=2, help="torchrun mode: runs per layout, interleaved")
    a("--workdir", type=Path, help="weights, checkpoints and profiles go to WORKDIR/bench-train, kept for the next run (default: a temporary dir, removed)")
    a("--json", type=Path, help="write the results here")
    a("--markdown", type=Path, help="write a markdown table here")
    # internal
    a("--worker", choices=FRAMEWORKS, help=argparse.SUPPRESS)
    a("--spec-json", help=argparse.SUPPRESS)
    a("--weights", type=Path, help=argparse.SUPPRESS)
    a("--profile-dir", type=Path, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def spec_from(args: argparse.Namespace) -> Spec:
    if args.spec_json:
        return Spec(**json.loads(args.spec_json))
    spec = replace(SIZES[args.size], **{k: getattr(args, k) for k in SPEC_FLAGS if getattr(args, k) is not None})
    if spec.hidden % spec.heads or spec.heads % spec.kv_heads:
        raise SystemExit(f"--hidden {spec.hidden} / --heads {spec.heads} / --kv-heads {spec.kv_heads}: hidden must "
                         "divide by heads and heads by KV heads")
    return spec


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--rank-main"]:
        rest = argv[2:]
        return rank_main(Path(argv[1]), rest[1:] if rest[:1] == ["--"] else rest) or 0
    args = parse_args(argv)
    spec = spec_from(args)
    if args.worker:
        worker_main(args.worker, spec, args.weights, args.profile_dir)
        return 0
    tmp = None
    if args.workdir is None:
        tmp = tempfile.mkdtemp(prefix="bench-train-")
        workdir = Path(tmp)
    else:  # weights and checkpoint reused between runs, in a directory of ours inside --workdir
        workdir = reuse_dir(args.workdir, "bench-train")
    print(f"{spec.describe()}\nworkdir {workdir}; load average {loadavg()}", flush=True)
    try:
        if args.launch == "torchrun":
            layouts = [parse_layout(t) for t in (args.layout or ["tp=1", "dp=2"])]
            res = run_torchrun(spec, layouts, args.warmup, args.steps, args.repeats, workdir,
                               log=lambda s: print(s, flush=True))
            md = markdown_torchrun(res)
        else:
            if spec.experts:
                raise SystemExit("--experts: the in-process comparison is dense only; use --launch torchrun")
            frameworks = [f for f in args.frameworks.split(",") if f]
            bad = [f for f in frameworks if f not in FRAMEWORKS]
            if bad or not frameworks:
                raise SystemExit(f"--frameworks {args.frameworks}: choose from {','.join(FRAMEWORKS)}")
            profile = [f for f in args.profile.split(",") if f]
            res = run_compare(spec, frameworks, args.warmup, args.steps, workdir, args.peak_tflops, profile,
                              log=lambda s: print(s, flush=True))
            md = markdown_compare(res)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    print("\n" + md)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=1))
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(md + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
