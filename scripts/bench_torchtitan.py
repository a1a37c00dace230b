#!/usr/bin/env python3
"""Benchmark `shardkit convert torchtitan-to-mcore` (one hop) against the two-hop route through HF (issue 39).

1. synthesises a Llama-3-shaped bf16 torchtitan checkpoint (`step-1/`: DCP `.metadata` + `__0_0.distcp`, torchtitan
   0.3's names, written one tensor at a time by checkpoint.torch_dist.DCPWriter) with its config.json beside;
2. one hop: `shardkit convert torchtitan-to-mcore step-1 OUT --tp 2 --pp 2 --quiet`;
3. two hops, the route a torchtitan user has today: torchtitan's own conversion recipe (its repository's
   scripts/checkpoint_conversion/convert_to_hf.py, not in the wheel: `dcp.load` of the whole model into memory,
   `Llama3StateDictAdapter.to_hf`, safetensors shards), then `shardkit convert hf-to-mcore HF OUT --tp 2 --pp 2
   --no-verify --quiet`;

each step as a subprocess whose process tree's RSS is polled (scripts/bench_convert.run_measured). The page cache is
dropped before each timed step where possible (root), else the source is read once untimed. Needs torchtitan (and
triton) importable for step 3's adapter.

    .venv/bin/python scripts/bench_torchtitan.py --size 1 --repeats 2
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



def tt_name(hf: str) -> str:
    from convert.torchtitan import NAMES_03, _template

    tmpl, layer = _template(hf)
    return NAMES_03[tmpl] if layer is None else NAMES_03[tmpl].format(layer)


def synthesize(step: Path, shape, seed: int = 0) -> int:
    """A bf16 torchtitan step directory of `shape` (bench_convert.Shape), one tensor in memory at a time."""
    import ml_dtypes

    from checkpoint.torch_dist import DCPWriter

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
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-torchtitan-", dir=args.workdir))
    try:
        shape = shape_for(args.size, args.hidden, None, 2)
        print(f"model: {shape.describe()}", flush=True)
        step = work / "tt" / "step-1"
        nbytes = synthesize(step, shape)
        print(f"torchtitan step-1: {nbytes / GB:.2f} GB", flush=True)
        cache = Cache.detect(force_warm=False)
        print(f"page cache: {cache.describe()}", flush=True)
        sk, rows = shardkit_bin(), []
        for rep in range(args.repeats):
            for route in ("one hop", "two hops"):
                out, hf = work / "out", work / "hf"
                shutil.rmtree(out, ignore_errors=True)
                shutil.rmtree(hf, ignore_errors=True)
                cache.before_step()
                if route == "one hop":
                    runs = [run_measured(route, [sk, "convert", "torchtitan-to-mcore", str(step), str(out), "--tp",
                                                 "2", "--pp", "2", "--quiet"], args.poll, work / "log")]
                else:
                    hf.mkdir()
                    runs = [run_measured("to HF", [sys.executable, "-c", TO_HF, str(step), str(hf)], args.poll,
                                         work / "log"),
                            run_measured("hf-to-mcore", [sk, "convert", "hf-to-mcore", str(hf), str(out), "--tp",
                                                         "2", "--pp", "2", "--no-verify", "--quiet"], args.poll,
                                         work / "log")]
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
            Path(args.json).write_text(json.dumps({"shape": shape.describe(), "rows": rows}, indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
