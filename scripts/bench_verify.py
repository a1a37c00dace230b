#!/usr/bin/env python3
"""Benchmark streaming `verify --against` (issue 18) on wide checkpoints synthesised locally.

Two models, from the real hub configs in /work/shared/hf-configs (or the repo's copy of them), only the depth cut:

- llama: Meta-Llama-3-70B's width (hidden 8192, ffn 28672, 64 heads / 8 KV, vocab 128256), --llama-layers layers
  (default 4: ~10 GB bf16);
- deepseek_v3: DeepSeek-V3's width (hidden 7168, MLA q_lora 1536 / kv_lora 512 / rope 64 / nope 128 / v 128, 128 heads,
  --experts routed experts (default 256) x ffn 2048, one shared expert, sigmoid group-limited top-8 with expert bias,
  yarn RoPE), 2 layers: one dense (ffn 18432), one MoE; bf16 (no FP8, no MTP).

For each: write random bf16 weights (std 0.02, norms ~1; save_pretrained's layout: shards + index, config.json), convert
(`shardkit convert hf-to-mcore`, timed and RSS-polled: the conversion's own time), time `cat` of both checkpoints'
files to /dev/null (the baseline: reading both once), then time the streaming parity alone (what `convert --verify`
adds; `shardkit verify` also re-reads every chunk for its checksums first) in a subprocess whose process tree's RSS
is polled (and whose minor page faults are counted: fresh memory the kernel zeroes). The page cache is dropped
before each timed step when this runs as root with a writable /proc/sys/vm/drop_caches; otherwise the mode is said.
Everything lives under --workdir, removed model by model.

    .venv/bin/python scripts/bench_verify.py --json /tmp/bv.json --markdown /tmp/bv.md
    .venv/bin/python scripts/bench_verify.py --tiny   # seconds: the smoke test's dims
"""
from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO))

from bench_convert import dir_bytes, machine_facts, run_dir, run_measured, try_drop_caches, write_shards  # noqa: E402

GB = 1e9
CONFIGS = Path("/work/shared/hf-configs")


def _config(name: str) -> dict:
    return json.loads((CONFIGS / name).read_text())


def llama_model(layers: int, tiny: bool) -> tuple[dict, list[tuple[str, tuple[int, ...]]]]:
    cfg = _config("meta-llama--Meta-Llama-3-70B.json")
    cfg["num_hidden_layers"] = layers
    if tiny:
        cfg.update(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, vocab_size=1000)
    h, F_, nh, kv = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = h // nh
    out = [("model.embed_tokens.weight", (cfg["vocab_size"], h))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (h,)), (p + "self_attn.q_proj.weight", (nh * hd, h)),
                (p + "self_attn.k_proj.weight", (kv * hd, h)), (p + "self_attn.v_proj.weight", (kv * hd, h)),
                (p + "self_attn.o_proj.weight", (h, nh * hd)), (p + "post_attention_layernorm.weight", (h,)),
                (p + "mlp.gate_proj.weight", (F_, h)), (p + "mlp.up_proj.weight", (F_, h)),
                (p + "mlp.down_proj.weight", (h, F_))]
    out += [("model.norm.weight", (h,)), ("lm_head.weight", (cfg["vocab_size"], h))]
    return cfg, out


def deepseek_model(experts: int, tiny: bool, dense: int = 1) -> tuple[dict, list[tuple[str, tuple[int, ...]]]]:
    """`dense` dense layers (ffn 18432) then one MoE layer (--deepseek-dense 0: the MoE layer alone, to fit a small
    disk: at this width the embedding and head alone are 3.7 GB, one routed expert 88 MB)."""
    cfg = _config("deepseek-ai--DeepSeek-V3.json")
    for k in ("quantization_config", "auto_map"):
        cfg.pop(k, None)
    cfg.update(num_hidden_layers=dense + 1, first_k_dense_replace=dense, num_nextn_predict_layers=0,
               n_routed_experts=experts)
    if tiny:
        cfg.update(hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_attention_heads=4,
                   num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                   v_head_dim=16, vocab_size=1000, n_group=4, topk_group=2, num_experts_per_tok=2)
        cfg["rope_scaling"] = {**cfg["rope_scaling"], "original_max_position_embeddings": 32}
    h, nh = cfg["hidden_size"], cfg["num_attention_heads"]
    qk = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    E, Fe, S = cfg["n_routed_experts"], cfg["moe_intermediate_size"], cfg["moe_intermediate_size"] * cfg["n_shared_experts"]
    out = [("model.embed_tokens.weight", (cfg["vocab_size"], h))]
    for i in range(dense + 1):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (h,)),
                (p + "self_attn.q_a_proj.weight", (cfg["q_lora_rank"], h)),
                (p + "self_attn.q_a_layernorm.weight", (cfg["q_lora_rank"],)),
                (p + "self_attn.q_b_proj.weight", (nh * qk, cfg["q_lora_rank"])),
                (p + "self_attn.kv_a_proj_with_mqa.weight", (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"], h)),
                (p + "self_attn.kv_a_layernorm.weight", (cfg["kv_lora_rank"],)),
                (p + "self_attn.kv_b_proj.weight", (nh * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"]),
                                                    cfg["kv_lora_rank"])),
                (p + "self_attn.o_proj.weight", (h, nh * cfg["v_head_dim"])),
                (p + "post_attention_layernorm.weight", (h,))]
        if i < dense:
            F_ = cfg["intermediate_size"]
            out += [(p + "mlp.gate_proj.weight", (F_, h)), (p + "mlp.up_proj.weight", (F_, h)),
                    (p + "mlp.down_proj.weight", (h, F_))]
        else:
            out += [(p + "mlp.gate.weight", (E, h)), (p + "mlp.gate.e_score_correction_bias", (E,))]
            for e in range(E):
                q = f"{p}mlp.experts.{e}."
                out += [(q + "gate_proj.weight", (Fe, h)), (q + "up_proj.weight", (Fe, h)),
                        (q + "down_proj.weight", (h, Fe))]
            out += [(p + "mlp.shared_experts.gate_proj.weight", (S, h)), (p + "mlp.shared_experts.up_proj.weight", (S, h)),
                    (p + "mlp.shared_experts.down_proj.weight", (h, S))]
    out += [("model.norm.weight", (h,)), ("lm_head.weight", (cfg["vocab_size"], h))]
    return cfg, out


def nbytes(tensors) -> int:
    return sum(2 * math.prod(s) for _, s in tensors)


def synthesize(out: Path, cfg: dict, tensors, shard_bytes: int = 2 << 30, seed: int = 0) -> None:
    """Random bf16 safetensors shards (one shard in memory at a time) + index + config.json; std 0.02, norms 1 + 0.1 N,
    DeepSeek's expert bias 0.5 N in fp32 (as the hub stores it)."""
    import torch

    g = torch.Generator().manual_seed(seed)

    def make(name: str, shape: tuple[int, ...]):
        if name.endswith("e_score_correction_bias"):
            return 0.5 * torch.randn(shape, generator=g)
        if len(shape) == 1:
            return (1 + 0.1 * torch.randn(shape, generator=g)).to(torch.bfloat16)
        return torch.randn(shape, generator=g, dtype=torch.bfloat16).mul_(0.02)

    write_shards(out, tensors, shard_bytes, make)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))


def files(*dirs: Path) -> list[str]:
    return [str(f) for d in dirs for f in sorted(d.rglob("*")) if f.is_file() and not f.is_symlink()]


# the parity alone, with the budget given raised to the least streaming needs where that is larger (DeepSeek-V3's MoE
# layer holds its attention, router and shared expert at once: 1.86 GB by the 2x-fp32 rule)
PARITY = ("import json, sys; from checkpoint.reader import Checkpoint; from verify.against import against_hf; "
          "from verify.budget import memory_needs; ck = Checkpoint(sys.argv[1]); "
          "b = max(int(sys.argv[3]), memory_needs(ck)['streaming'] // 100_000_000 * 100_000_000 + 100_000_000); "
          "r = against_hf(ck, sys.argv[2], streaming=True, memory_budget=b, "
          "seq_len=int(sys.argv[4]), all_experts=sys.argv[6] == '1'); open(sys.argv[5], 'w').write(json.dumps(r))")


def cp_sync(src: Path, dst: Path, drop: bool) -> tuple[float, float]:
    """The baseline of the default command's rows: `cp -r` of the HF directory, then `sync` (cp leaves its bytes
    dirty in the page cache; the converter makes everything durable), page cache dropped first; the copy removed."""
    if drop:
        try_drop_caches()
    t0 = time.perf_counter()
    subprocess.run(["cp", "-r", str(src), str(dst)], check=True)
    cp_s = time.perf_counter() - t0
    subprocess.run(["sync"], check=True)
    sync_s = time.perf_counter() - t0 - cp_s
    shutil.rmtree(dst)
    return cp_s, sync_s


def bench(name: str, cfg: dict, tensors, work: Path, args, drop: bool) -> dict:
    hf, ck = work / f"{name}-hf", work / f"{name}-ck"
    for d in (hf, ck):
        shutil.rmtree(d, ignore_errors=True)
    t0 = time.perf_counter()
    synthesize(hf, cfg, tensors)
    synth_s = time.perf_counter() - t0
    print(f"[{name}] synthesised {dir_bytes(hf) / GB:.2f} GB in {synth_s:.0f} s", flush=True)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    py = sys.executable
    cp_s, sync_s = cp_sync(hf, work / f"{name}-cp", drop)
    print(f"[{name}] cp -r {cp_s:.1f} s + sync {sync_s:.1f} s", flush=True)
    if drop:
        try_drop_caches()
    conv = run_measured(f"{name} convert", [py, "-m", "shardkit", "convert", "hf-to-mcore", str(hf), str(ck),
                                            "--quiet", "--no-verify"], args.poll, work / f"{name}-convert.log", env=env)
    print(f"[{name}] convert {conv.wall_s:.1f} s, peak RSS {conv.peak_tree_rss / 2**20:.0f} MiB", flush=True)
    row = {"model": name, "hf_gb": round(dir_bytes(hf) / GB, 2), "ck_gb": round(dir_bytes(ck) / GB, 2),
           "layers": cfg["num_hidden_layers"], "experts": cfg.get("n_routed_experts", 0),
           "cp_s": round(cp_s, 2), "cp_sync_s": round(cp_s + sync_s, 2),
           "convert_s": round(conv.wall_s, 2), "convert_cpu_s": round(conv.cpu_s, 1),
           "convert_peak_rss_mb": round(conv.peak_tree_rss / 2**20),
           "convert_peak_anon_mb": round(conv.peak_tree_anon / 2**20),
           "convert_vs_cp_sync": round(conv.wall_s / max(cp_s + sync_s, 1e-9), 2), "synth_s": round(synth_s, 1)}
    if not args.skip_parity:
        row.update(parity_alone(name, hf, ck, work, args, drop, env, conv))
    if args.convert_verify:  # what `convert --verify` adds, as a user runs it (page cache as the conversion left it)
        if drop:
            try_drop_caches()
        shutil.rmtree(ck, ignore_errors=True)  # room for the second conversion (compared already)
        ck2 = work / f"{name}-ck-verified"
        flags = [] if args.default_command else ["--verify", "--memory-budget", str(row["budget"])]
        cv = run_measured(f"{name} convert --verify", [py, "-m", "shardkit", "convert", "hf-to-mcore", str(hf),
                                                        str(ck2), "--quiet", *flags],
                          args.poll, work / f"{name}-convert-verify.log", env=env)
        line = next((ln for ln in (work / f"{name}-convert-verify.log").read_text().splitlines()
                     if ln.startswith("verify:")), "")
        added = float(line.rsplit(" in ", 1)[1].split()[0]) if " in " in line else float("nan")
        row.update(convert_verify_s=round(cv.wall_s, 2), verify_added_s=added,
                   added_ratio_vs_convert=round(added / max(conv.wall_s, 1e-9), 2),
                   convert_verify_cpu_s=round(cv.cpu_s, 1),
                   convert_verify_peak_rss_mb=round(cv.peak_tree_rss / 2**20),
                   convert_verify_peak_anon_mb=round(cv.peak_tree_anon / 2**20),
                   convert_verify_peak_file_mb=round((cv.peak_tree_rss - cv.peak_tree_anon) / 2**20),
                   convert_verify_vs_cp_sync=round(cv.wall_s / max(cp_s + sync_s, 1e-9), 2),
                   convert_verify_vs_convert=round(cv.wall_s / max(conv.wall_s, 1e-9), 2),
                   convert_verify_ok=cv.rc == 0, verify_line=line)
        row.setdefault("ok", cv.rc == 0)
        print(f"[{name}] convert --verify {cv.wall_s:.1f} s, of which the verify {added:.1f} s "
              f"({added / max(conv.wall_s, 1e-9):.2f}x the conversion), peak RSS {cv.peak_tree_rss / 2**20:.0f} MiB "
              f"(anon {cv.peak_tree_anon / 2**20:.0f}), CPU {cv.cpu_s:.1f} s", flush=True)
        shutil.rmtree(ck2, ignore_errors=True)
    if not args.keep:
        shutil.rmtree(hf, ignore_errors=True)
        shutil.rmtree(ck, ignore_errors=True)
    return row


def parity_alone(name: str, hf: Path, ck: Path, work: Path, args, drop: bool, env: dict, conv) -> dict:
    """`cat` of both checkpoints (reading both once) and the streamed parity alone in its own process (and with
    --all-experts, every expert driven): their rows."""
    py = sys.executable
    if drop:
        try_drop_caches()
    fl = files(hf, ck)
    t0 = time.perf_counter()
    for i in range(0, len(fl), 500):
        subprocess.run(["cat", *fl[i:i + 500]], stdout=subprocess.DEVNULL, check=True)
    cat_s = time.perf_counter() - t0
    print(f"[{name}] cat of both {cat_s:.1f} s", flush=True)
    if drop:
        try_drop_caches()
    out_json = work / f"{name}-parity.json"
    faults = resource.getrusage(resource.RUSAGE_CHILDREN).ru_minflt
    ver = run_measured(f"{name} verify", [py, "-c", PARITY, str(ck), str(hf), str(args.budget), str(args.seq_length),
                                          str(out_json), "0"], args.poll, work / f"{name}-verify.log", env=env)
    faults = resource.getrusage(resource.RUSAGE_CHILDREN).ru_minflt - faults  # the parity's minor page faults
    p = json.loads(out_json.read_text())
    print(f"[{name}] streaming parity {ver.wall_s:.1f} s, peak RSS {ver.peak_tree_rss / 2**20:.0f} MiB, "
          f"max |diff| {p['max_abs_diff']:.3e}, ok {p['ok']}", flush=True)
    row = {"cat_s": round(cat_s, 2), "verify_s": round(ver.wall_s, 2),
           "verify_peak_rss_mb": round(ver.peak_tree_rss / 2**20),
           "verify_peak_anon_mb": round(ver.peak_tree_anon / 2**20),
           "verify_cpu_s": round(ver.cpu_s, 1), "verify_minor_faults": faults,
           "ratio_vs_cat": round(ver.wall_s / max(cat_s, 1e-9), 2),
           "ratio_vs_convert": round(ver.wall_s / max(conv.wall_s, 1e-9), 2),
           "cpu_ratio_vs_convert": round(ver.cpu_s / max(conv.cpu_s, 1e-9), 2), "ok": p["ok"],
           "max_abs_diff": p["max_abs_diff"], "worst_layer_diff": max(r["max_abs_diff"] for r in p["layers"]),
           "experts_exercised": p.get("experts_exercised"), "experts_total": p.get("experts_total"),
           "bytes_read_gb": round((p["bytes_read"]["ours"] + p["bytes_read"]["hf"]) / GB, 2),
           "max_reads_of_one_tensor": p["max_reads_of_one_tensor"], "pieces": p["pieces"],
           "budget": p["memory"]["budget"]}
    if args.all_experts and p.get("experts_total"):  # every routed expert driven (and so read) once
        if drop:
            try_drop_caches()
        all_json = work / f"{name}-parity-all.json"
        allx = run_measured(f"{name} verify --all-experts", [py, "-c", PARITY, str(ck), str(hf), str(args.budget),
                                                              str(args.seq_length), str(all_json), "1"],
                            args.poll, work / f"{name}-verify-all.log", env=env)
        a = json.loads(all_json.read_text())
        row.update(all_experts_s=round(allx.wall_s, 2), all_experts_peak_rss_mb=round(allx.peak_tree_rss / 2**20),
                   all_experts_ok=a["ok"], all_experts_exercised=a["experts_exercised"],
                   all_experts_bytes_read_gb=round((a["bytes_read"]["ours"] + a["bytes_read"]["hf"]) / GB, 2))
        print(f"[{name}] --all-experts parity {allx.wall_s:.1f} s, {a['experts_exercised']}/{a['experts_total']} "
              f"experts, peak RSS {allx.peak_tree_rss / 2**20:.0f} MiB, ok {a['ok']}", flush=True)
    return row


def table(rows: list[dict]) -> str:
    cols = ["model", "layers", "experts", "hf_gb", "ck_gb", "cp_sync_s", "convert_s", "convert_vs_cp_sync",
            "convert_cpu_s", "convert_peak_rss_mb", "convert_peak_anon_mb"]
    cols += [c for c in ("cat_s", "verify_s", "ratio_vs_cat", "ratio_vs_convert", "verify_cpu_s",
                         "verify_minor_faults", "cpu_ratio_vs_convert", "verify_peak_rss_mb", "verify_peak_anon_mb",
                         "bytes_read_gb", "experts_exercised", "max_abs_diff", "worst_layer_diff",
                         "convert_verify_s", "convert_verify_vs_cp_sync", "convert_verify_vs_convert",
                         "convert_verify_cpu_s", "convert_verify_peak_rss_mb", "convert_verify_peak_anon_mb",
                         "convert_verify_peak_file_mb", "verify_added_s", "added_ratio_vs_convert", "all_experts_s",
                         "all_experts_exercised", "all_experts_peak_rss_mb", "ok") if any(c in r for r in rows)]
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        out.append("| " + " | ".join(f"{r[c]:.2e}" if isinstance(r.get(c), float) and "diff" in c else
                                     str(r.get(c, "")) for c in cols) + " |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="llama,deepseek_v3")
    ap.add_argument("--llama-layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--deepseek-dense", type=int, default=1,
                    help="dense layers before DeepSeek-V3's one MoE layer (default 1; 0: the MoE layer alone)")
    ap.add_argument("--skip-parity", action="store_true",
                    help="skip `cat` and the parity alone (with --convert-verify --default-command: the default "
                         "command's rows against cp -r + sync and the conversion alone, in less time and disk)")
    ap.add_argument("--memory-budget", default="1.5GB",
                    help="--memory-budget of the parity, raised to a model's least streaming needs (default 1.5GB)")
    ap.add_argument("--seq-length", type=int, default=32)
    ap.add_argument("--tiny", action="store_true", help="tiny dims (the smoke test)")
    ap.add_argument("--poll", type=float, default=0.05)
    ap.add_argument("--workdir", default="/tmp/shardkit-bench-verify")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--all-experts", action="store_true", help="MoE models: also time the parity with --all-experts")
    ap.add_argument("--convert-verify", action="store_true",
                    help="also time `convert hf-to-mcore --verify` and what its verify adds (its own 'in X s')")
    ap.add_argument("--default-command", action="store_true",
                    help="with --convert-verify: time the default command (`convert hf-to-mcore HF OUT`: its proof "
                         "with the default --memory-budget) instead of --verify --memory-budget BUDGET (issue 42)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--markdown", default=None)
    args = ap.parse_args(argv)
    if args.skip_parity and args.convert_verify and not args.default_command:
        ap.error("--skip-parity with --convert-verify needs --default-command (--verify's budget comes from the parity)")
    from plan.units import parse_bytes

    args.budget = parse_bytes("64MB" if args.tiny and args.memory_budget == "1.5GB" else args.memory_budget,
                              "--memory-budget")
    work = run_dir(args.workdir, "run-")  # a fresh directory inside --workdir: only it is removed at the end
    drop = try_drop_caches()
    notes = [f"page cache: {'dropped before every timed step' if drop else 'not dropped (no permission): warm/partial'}"]
    rows = []
    for name in args.models.split(","):
        if name == "llama":
            cfg, tensors = llama_model(2 if args.tiny else args.llama_layers, args.tiny)
        else:
            experts = 8 if args.tiny else args.experts
            cfg, tensors = deepseek_model(experts, args.tiny, args.deepseek_dense)
            free = shutil.disk_usage(work).free
            while experts > 8 and 2.1 * nbytes(tensors) > free - 1 * GB:  # HF + checkpoint (or cp's copy) + a margin
                experts //= 2
                cfg, tensors = deepseek_model(experts, args.tiny, args.deepseek_dense)
            if experts != (8 if args.tiny else args.experts):
                notes.append(f"deepseek_v3: {experts} routed experts instead of {args.experts}: "
                             f"{free / GB:.0f} GB free under {work}")
        free = shutil.disk_usage(work).free
        if not args.tiny and 2.1 * nbytes(tensors) > free - 1 * GB:
            raise SystemExit(f"{name}: needs ~{2.1 * nbytes(tensors) / GB:.0f} GB under {work}, {free / GB:.0f} free")
        rows.append(bench(name, cfg, tensors, work, args, drop))
    text = table(rows)
    print(text)
    for n in notes:
        print("note:", n)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "notes": notes, "argv": sys.argv}, indent=2))
    if args.markdown:
        Path(args.markdown).write_text(text + "\n\n" + "\n".join(f"- {n}" for n in notes) + "\n\n```\n"
                                       + machine_facts(work) + "\n```\n")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
