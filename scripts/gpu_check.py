#!/usr/bin/env python3
"""One short GPU check of the trainer (issue 5 and 6 goals), for a single H100/H200 and a 10-minute limit.

    (a) Transformer Engine backend vs local backend: the same losses, step by step, from the same converted
        checkpoint and corpus (bf16; and FP8 tensorwise, both backends) -- skipped when TE is not importable;
    (b) bf16 tokens/s and MFU (Megatron's and torchtitan's conventions, train/metrics.py) of a ~1B Llama
        (Llama-3.2-1B's shape) at seq 4096; goal: Megatron MFU >= 45%;
    (c) FP8 (local backend: tensorwise and delayed; TE too when installed) vs bf16 tokens/s and MFU at seq 8192;
        goal: FP8 >= 1.3x bf16 tokens/s;
    (d) the megatron-core engine (`--engine megatron-core`, issue 40) vs the native engine on (b)'s model and data:
        bf16 tokens/s, MFU and the losses step by step -- skipped when megatron-core is not importable
        (scripts/gpu_wheels.sh downloads its cp312 wheel into .gpu-wheels/, which scripts/gpu_check.sh installs);
        where Transformer Engine is importable too, megatron-core's TE layer spec in bf16 and with FP8 (delayed
        scaling) -- recorded as "skipped: no Transformer Engine" otherwise;
    (e) peak GPU memory (torch.cuda.max_memory_allocated, the trainer's mem_gib) of (b)'s and (d)'s runs against
        `shardkit plan`'s estimate of the same run (plan.memory.estimate_memory: 1 GPU, that sequence, micro and
        global batch 1, no recompute, that engine and layer spec; its reserved CUDA context / NCCL / workspace
        allowance left out, which max_memory_allocated does not see); goal: within 10%.

Every number comes from the real trainer: a random HF Llama is built locally from transformers' LlamaConfig (no hub),
saved, converted with `shardkit convert hf-to-mcore`, and trained for a few steps by `shardkit continue-pretrain` on a
generated .bin/.idx corpus; throughput is the median over the steps after the first `--skip` (warm-up) of the
trainer's own metrics.jsonl. Nothing is saved (no --save), so checkpoint writing is not timed. The summary goes to
`--out` (scripts/gpu_check.sh points it at $OUT/gpu_check.json). Each part runs on its own and records its error, so
one failure does not hide the others; parts that no longer fit in `--deadline-s` are skipped and say so.

`--cpu-smoke` runs the same code on the CPU with tiny sizes (tests/test_fp8.py runs it): everything except the GPU
numbers and TE (whose comparison then pits the local backend against itself, marked as such).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# Llama-3.2-1B's shape (1.24B parameters, tied embeddings); the (a) model is a small one of the same family
BIG = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
           num_key_value_heads=8, max_position_embeddings=8192, tie_word_embeddings=True, rope_theta=500000.0)
SMALL = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=16,
             num_key_value_heads=4, max_position_embeddings=8192, tie_word_embeddings=False)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False)
GOAL_MFU, GOAL_FP8_SPEEDUP, GOAL_MEMORY_VS_PLAN = 0.45, 1.3, 0.10


def build_checkpoint(work: Path, name: str, shape: dict, device: str, said: dict | None = None) -> Path:
    """Random HF Llama (bf16, seeded) -> save_pretrained -> shardkit convert hf-to-mcore (with its default proof on
    the machine's CPU: issue 33 (5), the image's smoke test); returns the checkpoint. `said` gets the conversion's
    wall time and its "wrote" and "verify:" lines."""
    import contextlib
    import io

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from shardkit.cli import main as cli

    hf, ck = work / f"{name}-hf", work / f"{name}-ck"
    torch.manual_seed(0)
    with torch.device(device):  # initialising 1B parameters is quick on the GPU
        model = LlamaForCausalLM(LlamaConfig(**shape, bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16"))
    model.to(torch.bfloat16).save_pretrained(str(hf))
    del model
    out, t = io.StringIO(), time.monotonic()
    with contextlib.redirect_stdout(out):
        rc = cli(["convert", "hf-to-mcore", str(hf), str(ck), "--quiet"])
    print(out.getvalue(), end="")
    if said is not None:
        said.update(seconds=round(time.monotonic() - t, 1), exit=rc,
                    lines=[ln for ln in out.getvalue().splitlines() if ln.startswith(("wrote", "verify:"))])
    if rc != 0:
        raise RuntimeError(f"convert hf-to-mcore {hf} failed")
    return ck


def plan_estimate(hf_dir: Path, seq: int, engine: str, impl: str) -> dict:
    """`shardkit plan`'s memory estimate (GiB) of the run `train` launches: one GPU, `seq` tokens, micro and global
    batch 1, no recompute, bf16 weights, the given engine and --transformer-impl."""
    from checkpoint.config import ModelConfig
    from checkpoint.run_layout import RunLayout
    from plan.memory import TrainSettings, estimate_memory

    s = TrainSettings(seq_length=seq, micro_batch_size=1, global_batch_size=1, recompute="none", kernels=None,
                      engine=engine, transformer_impl=impl)
    e = estimate_memory(ModelConfig.from_hf_dir(hf_dir), RunLayout(), s)
    gib = {k: getattr(e, k) / 2**30 for k in ("weights", "grads", "optimizer", "activations", "comm_buffers",
                                               "reserved", "total")}
    gib["without_reserved"] = gib["total"] - gib["reserved"]
    return {"engine": engine, "transformer_impl": impl, "kernels": s.layer_kernels, "gib": gib}


def build_corpus(work: Path, vocab: int, tokens: int) -> Path:
    import numpy as np

    from train.data.indexed import write_indexed

    work.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    docs, n = [], 0
    while n < tokens:
        d = rng.integers(3, vocab, size=int(rng.integers(512, 4096)))
        docs.append(d)
        n += d.size
    write_indexed(work / "corpus", docs, np.int32 if vocab >= 65500 else np.uint16)
    return work / "corpus"


def train(run_dir: Path, ck: Path, data: Path, seq: int, steps: int, extra: list[str], in_process: bool,
          timeout: float, env: dict | None = None) -> list[dict]:
    """`shardkit continue-pretrain` for `steps` steps (one sequence each); its metrics.jsonl rows."""
    args = ["continue-pretrain", "--load", str(ck), "--data-path", str(data), "--split", "100,0,0",
            "--seq-length", str(seq), "--micro-batch-size", "1", "--global-batch-size", "1",
            "--train-iters", str(steps), "--lr", "1e-5", "--lr-warmup-iters", "0", "--bf16", "--log-interval", "1",
            "--log-dir", str(run_dir), "--attention-dropout", "0", "--hidden-dropout", "0", *extra]
    if in_process:
        from shardkit.cli import main as cli

        if cli(args) != 0:
            raise RuntimeError(f"continue-pretrain {' '.join(extra)} failed")
    else:
        r = subprocess.run([sys.executable, "-m", "shardkit", *args], capture_output=True, text=True,
                           timeout=timeout, cwd=REPO, env={**os.environ, **(env or {})})
        if r.returncode != 0:
            raise RuntimeError(f"continue-pretrain {' '.join(extra)} failed ({r.returncode}): "
                               f"{(r.stderr or r.stdout)[-1500:]}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def summarise(rows: list[dict], skip: int) -> dict:
    """Median throughput over the steps after the warm-up, and the losses."""
    timed = rows[skip:] or rows
    out = {"steps": len(rows), "timed_steps": len(timed), "losses": [r["loss"] for r in rows]}
    for key in ("step_seconds", "tokens_per_s", "mfu_megatron", "mfu_torchtitan", "tflops_per_device_megatron",
                "mem_gib"):
        vals = [r[key] for r in timed if r.get(key) is not None]
        out[key] = statistics.median(vals) if vals else None
    return out


class Check:
    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        self.args = args
        self.t0 = time.monotonic()
        self.smoke = args.cpu_smoke
        self.device = "cpu" if self.smoke else "cuda"
        if not self.smoke and not torch.cuda.is_available():
            raise SystemExit("gpu_check: no CUDA device visible to torch (use --cpu-smoke to try it on the CPU)")
        self.work = Path(args.work or tempfile.mkdtemp(prefix="shardkit-gpu-check-"))
        self.work.mkdir(parents=True, exist_ok=True)
        from train.te import te_available

        self.te = te_available()
        self.summary: dict = {"mode": "cpu-smoke" if self.smoke else "gpu", "device": self._device_name(),
                              "torch": torch.__version__, "transformer_engine": self._te_version(),
                              "goals": {"bf16_mfu_megatron_seq4096": GOAL_MFU, "fp8_over_bf16_seq8192":
                                        GOAL_FP8_SPEEDUP, "memory_vs_plan_within": GOAL_MEMORY_VS_PLAN}}
        self.extra = ["--peak-tflops", "1"] if self.smoke else []  # CPU: a nominal peak so MFU is computed

    def _device_name(self) -> str:
        import torch

        return "cpu" if self.smoke else torch.cuda.get_device_name()

    def _te_version(self) -> str | None:
        if not self.te:
            return None
        try:
            import transformer_engine

            return getattr(transformer_engine, "__version__", "installed")
        except Exception as e:  # noqa: BLE001 - reported, not fatal
            return f"import failed: {type(e).__name__}: {e}"

    def left(self) -> float:
        return self.args.deadline_s - (time.monotonic() - self.t0)

    def part(self, key: str, fn) -> None:
        if self.left() < 30:
            self.summary[key] = {"skipped": f"out of time ({self.args.deadline_s:.0f} s budget)"}
            return
        t = time.monotonic()
        try:
            self.summary[key] = fn()
        except Exception as e:  # noqa: BLE001 - one part's failure is recorded, the others still run
            self.summary[key] = {"error": f"{type(e).__name__}: {e}"[-3000:]}
        self.summary[key]["wall_s"] = round(time.monotonic() - t, 1)
        self.write()

    def run(self, name: str, ck: Path, data: Path, seq: int, steps: int, extra: list[str],
            env: dict | None = None) -> dict:
        rows = train(self.work / name, ck, data, seq, steps, [*extra, *self.extra], self.smoke and env is None,
                     timeout=max(60.0, self.left()), env=env)
        return summarise(rows, self.args.skip if steps > self.args.skip else 0)

    def write(self) -> None:
        out = Path(self.args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(self.summary, indent=1) + "\n")

    # -- the parts --------------------------------------------------------------------------------------------
    def backends(self) -> dict:
        """(a) TE vs local: per-step losses from the same checkpoint and data."""
        if not self.te and not self.smoke:
            return {"skipped": "Transformer Engine is not importable (GPU_CHECK_INSTALL_TE=1 tries to install it)"}
        shape = TINY if self.smoke else SMALL
        seq = 64 if self.smoke else 2048
        ck = build_checkpoint(self.work, "small", shape, self.device)
        data = build_corpus(self.work / "small", shape["vocab_size"], 4 * (seq + 1) * 8)
        other = "transformer_engine" if self.te else "local"
        res: dict = {"compared": f"local vs {other}" + ("" if self.te else " (Transformer Engine not importable: "
                                                               "the comparison runs the local backend twice)")}
        for label, fp8 in (("bf16", []), ("fp8_tensorwise", ["--fp8", "hybrid", "--fp8-recipe", "tensorwise"])):
            a = self.run(f"a-local-{label}", ck, data, seq, 4, ["--transformer-impl", "local", *fp8])
            b = self.run(f"a-{'te' if self.te else 'local-again'}-{label}", ck, data, seq, 4,
                         ["--transformer-impl", other, *fp8])
            diff = max(abs(x - y) / abs(x) for x, y in zip(a["losses"], b["losses"], strict=True))
            res[label] = {"local": a["losses"], other: b["losses"], "max_rel_diff": diff,
                          "same_within_2e-2": diff <= 2e-2}
        return res

    def bf16_4096(self) -> dict:
        """(b) bf16 throughput and MFU of the ~1B model at seq 4096."""
        seq = 128 if self.smoke else 4096
        ck, data = self.big()
        r = self.run("b-bf16-4096", ck, data, seq, self.args.steps, ["--transformer-impl", "local"])
        r["seq_length"] = seq
        r["goal_met"] = None if self.smoke else (r["mfu_megatron"] is not None and r["mfu_megatron"] >= GOAL_MFU)
        return r

    def fp8_8192(self) -> dict:
        """(c) FP8 vs bf16 at seq 8192 (local backend; TE too where installed)."""
        seq = 256 if self.smoke else 8192
        ck, data = self.big()
        res: dict = {"seq_length": seq}
        runs = [("bf16", ["--transformer-impl", "local"]),
                ("fp8_tensorwise", ["--transformer-impl", "local", "--fp8", "hybrid", "--fp8-recipe", "tensorwise"]),
                ("fp8_delayed", ["--transformer-impl", "local", "--fp8", "hybrid", "--fp8-recipe", "delayed"])]
        if self.te:
            runs += [("te_bf16", ["--transformer-impl", "transformer_engine"]),
                     ("te_fp8_delayed", ["--transformer-impl", "transformer_engine", "--fp8", "hybrid",
                                         "--fp8-recipe", "delayed", "--fp8-amax-history-len", "1024",
                                         "--fp8-amax-compute-algo", "max"])]
        for label, extra in runs:
            if self.left() < 45:
                res[label] = {"skipped": "out of time"}
                continue
            try:
                res[label] = self.run(f"c-{label}-{seq}", ck, data, seq, self.args.steps, extra)
            except Exception as e:  # noqa: BLE001
                res[label] = {"error": f"{type(e).__name__}: {e}"[-3000:]}
        base = res["bf16"].get("tokens_per_s")
        for label, r in list(res.items()):
            if isinstance(r, dict) and r.get("tokens_per_s") and base and label != "bf16":
                r["speedup_over_bf16"] = r["tokens_per_s"] / base
        best = max((r.get("speedup_over_bf16", 0) for r in res.values() if isinstance(r, dict)), default=0)
        res["best_fp8_speedup"] = best
        res["goal_met"] = None if self.smoke else best >= GOAL_FP8_SPEEDUP  # CPU timings say nothing about GPUs
        return res

    def engines(self) -> dict:
        """(d) the megatron-core engine vs the native engine on (b)'s model, data and sequence length (the native
        numbers are (b)'s where it ran): tokens/s, MFU, and the per-step losses. megatron-core runs in its own
        process (on the CPU under its test switch, whose stand-ins are process-wide)."""
        from train.engines.choice import megatron_core_installed

        if not megatron_core_installed():
            return {"skipped": "megatron-core is not importable (scripts/gpu_wheels.sh downloads its cp312 wheel "
                               "into .gpu-wheels/, which scripts/gpu_check.sh installs)"}
        seq = 128 if self.smoke else 4096
        ck, data = self.big()
        native = self.summary.get("b_bf16_seq4096") or {}
        if not native.get("tokens_per_s"):
            native = self.run(f"d-native-{seq}", ck, data, seq, self.args.steps, ["--transformer-impl", "local"])
        mc = self.run(f"d-megatron-core-{seq}", ck, data, seq, self.args.steps,
                      ["--engine", "megatron-core", "--transformer-impl", "local"],
                      env={"SHARDKIT_MEGATRON_CORE_CPU": "1"} if self.smoke else {})
        keys = ("tokens_per_s", "mfu_megatron", "mfu_torchtitan", "mem_gib", "losses")
        res: dict = {"seq_length": seq, "native": {k: native.get(k) for k in keys},
                     "megatron_core": {k: mc.get(k) for k in keys}}
        if native.get("tokens_per_s") and mc.get("tokens_per_s"):
            res["megatron_core_over_native"] = mc["tokens_per_s"] / native["tokens_per_s"]
        pairs = list(zip(native.get("losses") or [], mc.get("losses") or []))
        res["max_rel_loss_diff"] = max((abs(a - b) / abs(a) for a, b in pairs), default=None)
        res["megatron_core_te"] = self.engine_te(ck, data, seq, keys, native.get("losses") or [])
        res["goal_met"] = None if self.smoke else (mc.get("mfu_megatron") or 0) >= GOAL_MFU
        return res

    def engine_te(self, ck: Path, data: Path, seq: int, keys: tuple, native_losses: list) -> dict:
        """(d) on megatron-core's Transformer Engine layer spec: bf16, and FP8 hybrid with delayed scaling (TE's
        recipe under megatron-core's own fp8 context); only where TE is importable on a GPU."""
        if self.smoke or not self.te:
            return {"skipped": "no Transformer Engine" if not self.te else "the CPU (TE needs a GPU)"}
        res: dict = {}
        runs = (("bf16", []), ("fp8_delayed", ["--fp8", "hybrid", "--fp8-recipe", "delayed",
                                               "--fp8-amax-history-len", "1024", "--fp8-amax-compute-algo", "max"]))
        for label, extra in runs:
            if self.left() < 45:
                res[label] = {"skipped": "out of time"}
                continue
            try:
                r = self.run(f"d-megatron-core-te-{label}-{seq}", ck, data, seq, self.args.steps,
                             ["--engine", "megatron-core", "--transformer-impl", "transformer_engine", *extra])
            except Exception as e:  # noqa: BLE001
                res[label] = {"error": f"{type(e).__name__}: {e}"[-3000:]}
                continue
            res[label] = {k: r.get(k) for k in keys}
            pairs = list(zip(native_losses, r.get("losses") or []))
            res[label]["max_rel_loss_diff_vs_native"] = max((abs(a - b) / abs(a) for a, b in pairs), default=None)
        return res

    def memory_vs_plan(self) -> dict:
        """(e) the measured peak of (b)'s native run and (d)'s megatron-core run (local layer spec, bf16, seq 4096)
        against plan's estimate of each; on the CPU (--cpu-smoke) mem_gib is the process's RSS: computed, no goal."""
        seq = 128 if self.smoke else 4096
        self.big()
        res: dict = {"seq_length": seq, "goal_within": GOAL_MEMORY_VS_PLAN}
        measured = {"native": (self.summary.get("b_bf16_seq4096") or {}).get("mem_gib"),
                    "megatron-core": ((self.summary.get("d_megatron_core_vs_native_seq4096") or {})
                                      .get("megatron_core") or {}).get("mem_gib")}
        for engine, mem in measured.items():
            est = plan_estimate(self.work / "big-hf", seq, engine, "local")
            row = {"measured_gib": mem, "plan": est}
            if mem:
                row["measured_over_plan"] = mem / est["gib"]["without_reserved"]
                row["goal_met"] = None if self.smoke else abs(row["measured_over_plan"] - 1) <= GOAL_MEMORY_VS_PLAN
            else:
                row["skipped"] = "its run did not report a peak (see its part)"
            res[engine] = row
        return res

    def big(self) -> tuple[Path, Path]:
        if not hasattr(self, "_big"):
            shape = TINY if self.smoke else BIG
            said = self.summary.setdefault("conversion", {})  # the image's convert + its proof (issue 33 (5))
            ck = build_checkpoint(self.work, "big", shape, self.device, said)
            seq = 256 if self.smoke else 8192
            data = build_corpus(self.work / "big", shape["vocab_size"], (seq + 1) * (self.args.steps + 2) * 2)
            self._big = (ck, data)
        return self._big


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on the CPU (what a test runs)")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "gpu_check.json"))
    p.add_argument("--work", default=None, help="work directory (default: a temporary one)")
    p.add_argument("--steps", type=int, default=10, help="training steps per throughput run (default 10)")
    p.add_argument("--skip", type=int, default=3, help="warm-up steps left out of the medians (default 3)")
    p.add_argument("--deadline-s", type=float, default=480, help="skip parts that would start after this")
    p.add_argument("--parts", default="a,b,c,d,e", help="which of a,b,c,d,e to run")
    args = p.parse_args(argv)
    if args.cpu_smoke:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.path.insert(0, str(REPO))
    check = Check(args)
    parts = set(args.parts.split(","))
    # the goals' numbers first; the backend comparison last (it needs TE, and builds a model of its own)
    if "b" in parts:
        check.part("b_bf16_seq4096", check.bf16_4096)
    if "d" in parts:  # after (b), whose native run it reuses
        check.part("d_megatron_core_vs_native_seq4096", check.engines)
    if "e" in parts:  # no GPU time: (b)'s and (d)'s peaks against plan's estimates
        check.part("e_memory_vs_plan_seq4096", check.memory_vs_plan)
    if "c" in parts:
        check.part("c_fp8_vs_bf16_seq8192", check.fp8_8192)
    if "a" in parts:
        check.part("a_te_vs_local", check.backends)
    check.summary["total_s"] = round(time.monotonic() - check.t0, 1)
    check.write()
    print(json.dumps(check.summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
