"""Smoke test of scripts/bench_train.py: a tiny config, two timed steps; the JSON has all three implementations,
trained from the same weights (equal first-step losses). Never asserts speed."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def test_bench_train_tiny(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    mine = tmp_path / "work" / "hf" / "mine.txt"  # a user's file where older versions put (and removed) the weights
    mine.parent.mkdir(parents=True)
    mine.write_text("not the benchmark's")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(REPO / "scripts" / "bench_train.py"), "--hidden", "64", "--layers", "2", "--heads", "4",
           "--kv-heads", "2", "--ffn", "128", "--vocab", "256", "--seq", "32", "--mbs", "2", "--steps", "2",
           "--warmup", "1", "--threads", "1", "--workdir", str(tmp_path / "work"), "--json", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    res = json.loads(out.read_text())
    assert set(res["results"]) == {"ours", "hf", "megatron"}
    for name, r in res["results"].items():
        assert "error" not in r, (name, r.get("error"))
        assert len(r["seconds"]) == 2 and r["tokens_per_second"] > 0, name
        assert r["peak_rss_process"] > 0 and r["params"] == res["results"]["ours"]["params"], name
        assert all(math.isfinite(x) for x in r["losses"]), name
    # same weights and batch: the first losses agree (fp32; different kernels round differently)
    assert res["loss_check"]["max_rel_diff"] < 1e-4, res["loss_check"]
    assert set(res["ratios"]) == {"ours/hf", "ours/megatron"}
    assert res["flops_per_step"]["megatron"] > 0
    assert "| ours |" in proc.stdout
    assert mine.read_text() == "not the benchmark's"


def test_bench_workdirs_leave_users_files(tmp_path: Path) -> None:
    """Every benchmark's --workdir: the run works in a fresh directory of its own inside it (removed whole) or in a
    marked directory of inputs it made itself; a same-named directory it did not make is refused, never emptied."""
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        from bench_convert import BENCH_MARK, reuse_dir, run_dir
    finally:
        sys.path.remove(str(REPO / "scripts"))
    user = tmp_path / "w"
    (user / "hf").mkdir(parents=True)
    (user / "hf" / "mine.txt").write_text("x")
    a, b = run_dir(user, "run-"), run_dir(user, "run-")
    assert a != b and a.parent == user == b.parent and not any(a.iterdir())
    kept = reuse_dir(user, "bench-train")
    assert (kept / BENCH_MARK).is_file() and reuse_dir(user, "bench-train") == kept
    with pytest.raises(SystemExit, match="hf exists and was not made by shardkit's benchmarks"):
        reuse_dir(user, "hf")
    assert (user / "hf" / "mine.txt").read_text() == "x" and sorted(p.name for p in (user / "hf").iterdir()) == ["mine.txt"]
    fresh = run_dir(tmp_path / "new" / "deep", "run-")  # a --workdir that does not exist yet is made
    assert fresh.parent == tmp_path / "new" / "deep"


def test_bench_train_torchrun_layouts(tmp_path: Path) -> None:
    """--launch torchrun: the real trainer at CP=1 and CP=2 on gloo; tokens/s read from its metrics.jsonl, the
    collectives timed inside the ranks (none at one rank), and both layouts train the same losses."""
    out = tmp_path / "layouts.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(REPO / "scripts" / "bench_train.py"), "--launch", "torchrun", "--hidden", "64",
           "--layers", "2", "--heads", "4", "--kv-heads", "2", "--ffn", "128", "--vocab", "256", "--seq", "32",
           "--mbs", "2", "--steps", "2", "--warmup", "1", "--threads", "2", "--repeats", "1", "--layout", "tp=1",
           "--layout", "cp=2", "--workdir", str(tmp_path / "work"), "--json", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    res = json.loads(out.read_text())
    one, two = res["layouts"]["tp1 pp1 dp1"], res["layouts"]["tp1 pp1 cp2 dp1"]
    for p in (one, two):
        assert "error" not in p and len(p["runs"]) == 1 and p["tokens_per_second"] > 0, p
    assert one["comm_share_rank0"] == 0.0 and two["comm_share_rank0"] > 0.0
    assert sorted(two["runs"][0]["comm_share_by_rank"]) == ["0", "1"]
    a, b = one["runs"][0]["losses"], two["runs"][0]["losses"]
    assert len(a) == len(b) == 3 and all(abs(x - y) <= 1e-5 * abs(x) for x, y in zip(a, b)), (a, b)


def test_bench_train_sizes_and_layouts(monkeypatch) -> None:
    """--size names a model and batch that the flags override; --layout is the run's RunLayout, DP defaulting to EP."""
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    import bench_train

    spec = bench_train.spec_from(bench_train.parse_args(["--size", "25m", "--layers", "2"]))
    assert (spec.hidden, spec.layers, spec.vocab, spec.mbs, spec.seq) == (512, 2, 4096, 4, 256)
    assert bench_train.spec_from(bench_train.parse_args([])) == bench_train.Spec()
    lay = bench_train.parse_layout("ep=2")
    assert (lay.ep, lay.dp, lay.world) == (2, 2, 2)
    assert bench_train.parse_layout("tp=2,dp=1").label() == "tp2 pp1 dp1"
