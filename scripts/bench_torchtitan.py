#!/usr/bin/env python3
"""Benchmark `shardkit convert torchtitan-to-mcore` (one hop) against the two-hop route through HF (issue 39).

1. synthesises a Llama-3-shaped bf16 torchtitan checkpoint (`step-1/`: DCP `.metadata` + `__0_0.distcp`, torchtitan
   0.3's names, written one tensor at a time by checkpoint's DCPWriter) with its config.json beside;
2. one hop: `shardkit convert torchtitan-to-mcore step-1 OUT --tp 2 --pp 2 --quiet`;
3. two hops, the route a torchtitan user has today: torchtitan's own conversion recipe (its repository's
   scripts/checkpoint_conversion/convert_to_hf.py, not in the wheel: `dcp.load` of the whole model into memory,
   `Llama3StateDictAdapter.to_hf`, safetensors shards), then `shardkit convert hf-to-mcore HF OUT --tp 2 --pp 2
   --no-verify --quiet`;

each step as a subprocess whose process tree's RSS is polled (scripts/bench_convert.run_measured). The page cache is
dropped before each timed step where possible (root), else the source is read once untimed. Needs torchtitan (and
triton) importable for step 3's adapter.

    .venv/bin/python scripts/bench_torchtitan.py --size 1 --repeats 2
    .venv/bin/python scripts/bench_torchtitan.py --model deepseek_v3 --size 1 --hidden 2048 --repeats 2

--model deepseek_v3 synthesises the checkpoint from torchtitan's own DeepSeek-V3 builder (MLA, routed experts stacked
[E, F, D], a shared expert, expert bias; its state_dict's names and shapes on the meta device), the two hops use its
DeepSeekV3StateDictAdapter.to_hf, and both routes write --tp 2 --ep 2. Measured 2026-12-06 on the shared 2-core host
(load ~9, page cache dropped before each route), 1.05 GB bf16 (4 layers, dim 2048, 16 experts of 1024): one hop 10.9 /
11.0 s wall, 5.4-6.2 CPU-s, peak anon RSS 0.22-0.25 GB; two hops 16.7 / 22.9 s (to HF 10.0-12.2 s, hf-to-mcore
6.7-10.8 s), 13.9-14.0 CPU-s, 1.43-1.44 GB anon: 1.5x the wall, 5.9x the memory. (Warm, --workers 1: 2.7 s of the one
hop's are checkpoint.config importing transformers for the YaRN defaults.)
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench_convert import GB, Cache, hf_config, run_measured, shape_for, shardkit_bin  # noqa: E402

# the second half of both two-hop scripts: the model's HF state dict (`hf`, all in memory) saved as 2 GB shards with
# their index and the config.json (`c`) beside them, as torchtitan's convert_to_hf.py writes them
SAVE_HF = """
shard, size, index, n = {}, 0, {}, 0
def flush():
    global shard, size, n
    if shard:
        name = f"model-{n:05d}.safetensors"
        save_file(shard, f"{out}/{name}", metadata={"format": "pt"})
        index.update({k: name for k in shard})
        shard, size, n = {}, 0, n + 1
for k, v in hf.items():
    shard[k] = v.contiguous()
    size += v.numel() * v.element_size()
    if size >= 2 << 30:
        flush()
flush()
json.dump({"metadata": {}, "weight_map": index}, open(out + "/model.safetensors.index.json", "w"))
json.dump(c, open(out + "/config.json", "w"))
"""

TO_HF = """
import json, sys, torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torchtitan.models.llama3 import _build_llama3_layers, Llama3Model
from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter
src, out = sys.argv[1], sys.argv[2]
c = json.load(open(src + "/config.json"))
dim, vocab, nh = c["hidden_size"], c["vocab_size"], c["num_attention_heads"]
cfg = Llama3Model.Config(dim=dim, vocab_size=vocab, tok_embeddings=Embedding.Config(num_embeddings=vocab,
    embedding_dim=dim), norm=RMSNorm.Config(normalized_shape=dim), lm_head=Linear.Config(in_features=dim,
    out_features=vocab), layers=_build_llama3_layers(n_layers=c["num_hidden_layers"], dim=dim, n_heads=nh,
    n_kv_heads=c["num_key_value_heads"], hidden_dim=c["intermediate_size"], rope=ComplexRoPE.Config(
    dim=dim // nh, max_seq_len=c["max_position_embeddings"], theta=c["rope_theta"]), attn_backend="flex"))
md = dcp.FileSystemReader(src).read_metadata()
sd = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype) for k, v in md.state_dict_metadata.items()}
dcp.load(sd, checkpoint_id=src)  # the whole model in memory, as convert_to_hf.py does
hf = Llama3StateDictAdapter(cfg, None).to_hf(sd)
del sd
""" + SAVE_HF



# DeepSeek-V3 (--model deepseek_v3): torchtitan's own model config, built alike by the synthesis and the to-HF route
DSV3_CFG = """
import json, sys
import torch
from torchtitan.models.deepseek_v3 import DeepSeekV3Model, _build_dsv3_layers
from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
def dsv3(dim, n_layers, vocab=32000):
    layers = _build_dsv3_layers(
        n_layers=n_layers, n_dense_layers=1, dim=dim, n_heads=16, q_lora_rank=512, kv_lora_rank=256,
        qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, mscale=1.0, dense_hidden_dim=4 * dim,
        moe_hidden_dim=dim // 2, num_experts=16, num_shared_experts=1, router_top_k=4, router_score_func="sigmoid",
        router_num_expert_groups=4, router_num_limited_groups=2, router_route_scale=2.5, router_route_norm=True,
        attn_backend="flex", moe_comm_backend="standard", non_blocking_capacity_factor=None,
        rope=ComplexRoPE.Config(dim=32, max_seq_len=4096, theta=10000.0, scaling="yarn", rope_factor=4.0,
                                beta_fast=32.0, beta_slow=1.0, original_seq_len=1024))
    return DeepSeekV3Model.Config(vocab_size=vocab, dim=dim, layers=layers,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim),
        norm=RMSNorm.Config(normalized_shape=dim), lm_head=Linear.Config(in_features=dim, out_features=vocab))
"""

SYNTH_DSV3 = DSV3_CFG + """
import math
import ml_dtypes
import numpy as np
from convert.torchtitan import _dcp_writer, hf_config_of_deepseek
DCPWriter = _dcp_writer()[0]
step, size, dim = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
def nbytes(n):
    with torch.device("meta"):
        return sum(t.numel() * 2 for t in dsv3(dim, n).build().state_dict().values())
per_layer = nbytes(3) - nbytes(2)
n = max(2, round((size * 1e9 - nbytes(2)) / per_layer) + 2)
cfg = dsv3(dim, n)
with torch.device("meta"):
    sd = cfg.build().state_dict()
rng = np.random.default_rng(0)
w = DCPWriter(step)
with w.rank_file(0) as f:  # one tensor in memory at a time
    for name, t in sd.items():
        dims = tuple(t.shape)
        a = (rng.standard_normal(math.prod(dims), dtype=np.float32) * 0.02).astype(ml_dtypes.bfloat16).reshape(dims)
        w.declare_tensor(name, dims, "bfloat16", [((0,) * len(dims), dims)])
        f.add_tensor(name, (0,) * len(dims), a)
w.write_metadata(step)
hf = hf_config_of_deepseek(cfg, 0, "bfloat16")
json.dump(hf, open(step + "/config.json", "w"))
json.dump({"layers": n, "dim": dim}, open(step + "/../bench.json", "w"))  # the to-HF route's builder arguments
print(f"DeepSeek-V3 (torchtitan's builder): {n} layers (1 dense), dim {dim}, 16 routed experts + 1 shared of "
      f"{dim // 2}, MLA q_lora 512 kv_lora 256, vocab 32000")
"""

TO_HF_DSV3 = DSV3_CFG + """
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torchtitan.models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter
src, out = sys.argv[1], sys.argv[2]
c = json.load(open(src + "/config.json"))
b = json.load(open(src + "/../bench.json"))
cfg = dsv3(b["dim"], b["layers"])
md = dcp.FileSystemReader(src).read_metadata()
sd = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype) for k, v in md.state_dict_metadata.items()}
dcp.load(sd, checkpoint_id=src)  # the whole model in memory, as convert_to_hf.py does
hf = DeepSeekV3StateDictAdapter(cfg, None).to_hf(sd)
del sd
""" + SAVE_HF


def tt_name(hf: str) -> str:
    from convert.torchtitan import NAMES_03, _template

    tmpl, layer = _template(hf)
    return NAMES_03[tmpl] if layer is None else NAMES_03[tmpl].format(layer)


def synthesize(step: Path, shape, seed: int = 0) -> int:
    """A bf16 torchtitan step directory of `shape` (bench_convert.Shape), one tensor in memory at a time."""
    import ml_dtypes

    from convert.torchtitan import _dcp_writer

    DCPWriter = _dcp_writer()[0]

    step.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    w = DCPWriter(step)
    with w.rank_file(0) as f:
        for name, dims in shape.tensors():
            a = (rng.standard_normal(math.prod(dims), dtype=np.float32) * 0.02).astype(ml_dtypes.bfloat16)
            a = a.reshape(dims)
            t = tt_name(name)
            w.declare_tensor(t, dims, "bfloat16", [((0,) * len(dims), dims)])
            f.add_tensor(t, (0,) * len(dims), a)
    w.write_metadata(str(step))
    cfg = hf_config(shape)
    cfg["rope_scaling"] = None
    (step / "config.json").write_text(json.dumps(cfg))
    return sum((step / n).stat().st_size for n in os.listdir(step))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=float, default=1.0, help="model size in GB (bf16)")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--poll", type=float, default=0.05)
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--model", choices=["llama3", "deepseek_v3"], default="llama3",
                    help="deepseek_v3: torchtitan's own builder (MLA, 16 routed + 1 shared expert) at --hidden")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-torchtitan-", dir=args.workdir))
    dsv3 = args.model == "deepseek_v3"
    try:
        step = work / "tt" / "step-1"
        if dsv3:
            step.mkdir(parents=True)
            r = subprocess.run([sys.executable, "-c", SYNTH_DSV3, str(step), str(args.size), str(args.hidden)],
                               capture_output=True, text=True, check=True)
            describe = r.stdout.strip().splitlines()[-1]
            nbytes = sum((step / n).stat().st_size for n in os.listdir(step))
        else:
            shape = shape_for(args.size, args.hidden, None, 2)
            describe = shape.describe()
            nbytes = synthesize(step, shape)
        print(f"model: {describe}", flush=True)
        print(f"torchtitan step-1: {nbytes / GB:.2f} GB", flush=True)
        cache = Cache.detect(force_warm=False)
        print(f"page cache: {cache.describe()}", flush=True)
        sk, rows = shardkit_bin(), []
        layout = ["--tp", "2", "--ep", "2"] if dsv3 else ["--tp", "2", "--pp", "2"]
        for rep in range(args.repeats):
            for route in ("one hop", "two hops"):
                out, hf = work / "out", work / "hf"
                shutil.rmtree(out, ignore_errors=True)
                shutil.rmtree(hf, ignore_errors=True)
                cache.before_step()
                if route == "one hop":
                    runs = [run_measured(route, [sk, "convert", "torchtitan-to-mcore", str(step), str(out), *layout,
                                                 "--quiet"], args.poll, work / "log")]
                else:
                    hf.mkdir()
                    runs = [run_measured("to HF", [sys.executable, "-c", TO_HF_DSV3 if dsv3 else TO_HF, str(step),
                                                   str(hf)], args.poll, work / "log"),
                            run_measured("hf-to-mcore", [sk, "convert", "hf-to-mcore", str(hf), str(out), *layout,
                                                         "--no-verify", "--quiet"], args.poll, work / "log")]
                row = {"route": route, "repeat": rep, "wall_s": sum(r.wall_s for r in runs),
                       "cpu_s": sum(r.cpu_s for r in runs), "peak_rss": max(r.peak_tree_rss for r in runs),
                       "peak_anon": max(r.peak_tree_anon for r in runs),
                       "steps": {r.label: round(r.wall_s, 2) for r in runs}}
                rows.append(row)
                print(f"{route:9s} rep {rep}: wall {row['wall_s']:.1f} s, CPU {row['cpu_s']:.1f} s, peak RSS "
                      f"{row['peak_rss'] / GB:.2f} GB (anon {row['peak_anon'] / GB:.2f} GB) {row['steps']}",
                      flush=True)
        for route in ("one hop", "two hops"):
            rs = [r for r in rows if r["route"] == route]
            rows.append({"route": route, "summary": True, "wall_s": min(r["wall_s"] for r in rs),
                         "peak_anon": max(r["peak_anon"] for r in rs)})
        one, two = rows[-2], rows[-1]
        print(f"two hops / one hop: wall {two['wall_s'] / one['wall_s']:.2f}x (best of {args.repeats}), peak anon "
              f"RSS {two['peak_anon'] / max(1, one['peak_anon']):.1f}x", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps({"model": describe, "rows": rows}, indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
