"""hf-to-mcore and reshard across ranks (issue 20): torchrun, or ranks started by hand with torchrun's environment
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) as SLURM's srun starts them, on gloo on this machine.

1, 2 and 3 ranks write byte-identical checkpoints; a rank killed (SIGKILL) or frozen (SIGSTOP) at a named site makes
the others stop with one line naming it, leaves a complete checkpoint that verifies or none (never a `latest` that
lies), and a rerun with another number of ranks resumes and ends bitwise equal to one process. Bad input: ranks with
different arguments, a world size that does not match the ranks started, an output directory the ranks do not share,
and a second job into the same root.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from checkpoint.commit import LATEST, LOCK
from tests.test_faults import assert_clean, assert_consistent, files_of

REPO = Path(__file__).resolve().parents[1]
TIMEOUT = "0.1"  # --distributed-timeout-minutes where a rank is killed or frozen: 6 s without a sign of life


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(extra: dict | None = None) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=str(REPO))
    for k in ("SHARDKIT_FAULT_AT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID",
              "SLURM_NTASKS", "SLURM_LOCALID"):
        env.pop(k, None)
    env.update(extra or {})
    return env


def one(argv: list) -> subprocess.CompletedProcess:
    """The plain single-process command."""
    return subprocess.run([sys.executable, "-m", "shardkit", *map(str, argv)], env=_env(), cwd=REPO,
                          capture_output=True, text=True, timeout=300)


def ranks(n: int, argv: list, world: int | None = None, env: dict | None = None, cwds: list | None = None,
          frozen: int | None = None, per_rank_argv: dict | None = None) -> list[dict]:
    """`n` ranks started by hand as torchrun would start them (no agent that would end the survivors for us);
    their exit status and output. A `frozen` rank (SIGSTOP) is killed once the others have ended."""
    port = _port()
    procs = []
    for r in range(n):
        e = _env({"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(world or n), "MASTER_ADDR": "127.0.0.1",
                  "MASTER_PORT": str(port), **(env or {})})
        args = (per_rank_argv or {}).get(r, argv)
        procs.append(subprocess.Popen([sys.executable, "-m", "shardkit", *map(str, args)], env=e,
                                      cwd=cwds[r] if cwds else REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    out: list[dict | None] = [None] * n
    try:
        for r in [r for r in range(n) if r != frozen] + ([frozen] if frozen is not None else []):
            if r == frozen:
                procs[r].kill()
            o, e = procs[r].communicate(timeout=240)
            out[r] = {"rc": procs[r].returncode, "out": o, "err": e}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


def torchrun(n: int, argv: list) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("torchrun")
    return subprocess.run([str(exe), "--standalone", "--nproc-per-node", str(n), "-m", "shardkit", *map(str, argv)],
                          env=_env(), cwd=REPO, capture_output=True, text=True, timeout=300)


def error_lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith("shardkit: error:")]


def ok(results: list[dict]) -> None:
    for r, res in enumerate(results):
        assert res["rc"] == 0, f"rank {r}: rc={res['rc']}\n{res['err'][-3000:]}"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny Llama (4 KV heads: TP up to 4), a tiny Mixtral, a tiny DeepSeek-V3 in block FP8 (sizes straddling the
    128x128 blocks) like the hub checkpoint."""
    import torch

    from shardkit.demo import build_tiny_llama
    from tests.moe_models import build, quantize_fp8

    root = tmp_path_factory.mktemp("scale-out")
    build_tiny_llama(root / "llama", num_hidden_layers=2, hidden_size=64, intermediate_size=96, vocab_size=300,
                     num_attention_heads=8, num_key_value_heads=4)
    build("mixtral", root / "mixtral")
    build("deepseek_v3", root / "deepseek", dtype=torch.bfloat16, hidden_size=256, intermediate_size=384,
          moe_intermediate_size=160, q_lora_rank=192, kv_lora_rank=144)
    quantize_fp8(root / "deepseek")
    return root


CASES = {  # name: (argv after the source, source kind)
    "llama-tp2pp2": (["--tp", "2", "--pp", "2"], "llama"),
    "mixtral-ep2": (["--ep", "2"], "mixtral"),
    "deepseek-v3-fp8-ep2": (["--ep", "2"], "deepseek"),  # FP8 dequantized in the same pass
    "reshard-tp4pp2": (["--tp", "4", "--pp", "2"], "reshard"),
}


def _argv(root: Path, case: str, out: Path) -> list:
    flags, kind = CASES[case]
    if kind == "reshard":
        src = root / "reshard-src"
        if not src.exists():
            r = one(["convert", "hf-to-mcore", root / "llama", src, "--quiet"])
            assert r.returncode == 0, r.stderr
        return ["reshard", src, out, *flags]
    return ["convert", "hf-to-mcore", root / kind, out, *flags]


def _reference(root: Path, case: str) -> dict[str, bytes]:
    ref = root / f"ref-{case}"
    if not ref.exists():
        r = one(_argv(root, case, ref) + ["--quiet"])
        assert r.returncode == 0, r.stderr
    return files_of(ref / "iter_0000000")


@pytest.mark.parametrize("case", list(CASES))
def test_ranks_byte_identical(models, case):
    """1 (the plain command), 2 and 3 ranks write the same bytes; every rank writes a share. The 2-rank run of the
    dense model goes through torchrun itself."""
    want = _reference(models, case)
    for n in (2, 3):
        out = models / f"{case}-{n}"
        argv = _argv(models, case, out)
        if n == 2 and case == "llama-tp2pp2":
            r = torchrun(2, argv)
            assert r.returncode == 0, r.stderr[-3000:]
            err0 = r.stderr
        else:  # the 3-rank dense run also measures the write rate and prints the estimate first
            res = ranks(n, argv + (["--estimate-above", "0"] if case == "llama-tp2pp2" else []))
            ok(res)
            err0 = res[0]["err"]
            if case == "llama-tp2pp2":
                assert f"on 1 node(s), {n} rank(s); durable write rate measured per node" in err0, err0
            assert all(not x["out"] and not x["err"] for x in res[1:]), res[1:]  # rank 0 alone speaks
            assert res[0]["out"].strip().endswith(f"wrote {out / 'iter_0000000'}"), res[0]["out"]
        shares = next(ln for ln in err0.splitlines() if f"{n} ranks wrote" in ln)
        counts = [int(c) for c in shares.split("wrote ")[1].split(" chunks")[0].split(" + ")]
        assert len(counts) == n and all(c > 0 for c in counts) and sum(counts) == len(
            [k for k in want if "/c/" in k]), shares
        assert_clean(out)
        got = files_of(out / "iter_0000000")
        assert sorted(got) == sorted(want)
        assert [k for k in want if got[k] != want[k]] == [], f"{case}: {n} ranks differ from one process"


def test_slurm_tasks(models, tmp_path_factory):
    """scripts/convert.sbatch, submitted unchanged to a one-node SLURM (tests/slurm_cluster.py) with two tasks: each
    task is one rank (SLURM_PROCID / SLURM_NTASKS), and the output is byte-identical to one process's."""
    from tests.slurm_cluster import SlurmCluster, missing

    why = missing()
    if why:
        pytest.skip(why)
    want = _reference(models, "mixtral-ep2")
    work = tmp_path_factory.mktemp("slurm-convert")
    cluster = SlurmCluster(work / "cluster")
    try:
        cluster.start()
        out = work / "out"
        log = work / "job.out"
        r = subprocess.run(["sbatch", "--parsable", "--wait", "--ntasks", "2", "--output", str(log),
                            str(REPO / "scripts" / "convert.sbatch"), *map(str, _argv(models, "mixtral-ep2", out))],
                           env=cluster.env(**_env({"SHARDKIT": f"{sys.executable} -m shardkit",
                                                   "MASTER_PORT": str(_port())})),
                           capture_output=True, text=True, timeout=300, cwd=REPO)
        text = log.read_text() if log.exists() else ""
        assert r.returncode == 0, r.stderr + text[-3000:] + cluster.log_tail()
    finally:
        cluster.stop()
    assert "2 ranks wrote" in text and text.count(f"wrote {out / 'iter_0000000'}") == 1, text
    got = files_of(out / "iter_0000000")
    assert sorted(got) == sorted(want) and [k for k in want if got[k] != want[k]] == []


def test_estimate():
    """The slowest node decides: a node's rate is the sum of its ranks' (they probed together), each rank has an
    even share of the bytes."""
    from convert.distributed import estimate

    seconds, line = estimate(4_000_000_000, [("a", 1e9), ("a", 1e9), ("b", 0.5e9), ("b", 0.5e9)])
    assert seconds == pytest.approx(2.0)
    assert line == ("estimate: 4.00 GB to write on 2 node(s), 4 rank(s); durable write rate measured per node "
                    "1.00-2.00 GB/s (slowest: b): about 2 s"), line
    seconds, line = estimate(1300 * 10**9, [("n", 0.5e9)] * 8)
    assert seconds == pytest.approx(325.0) and line.endswith("4.00 GB/s: about 5 min"), line


# -- faults ------------------------------------------------------------------------------------------------------

FAULTS = [  # (site, ranks killed in, the rank, frozen instead of killed, ranks of the rerun)
    ("chunk.unrecorded:1@1", 3, 1, False, 2),  # its first chunks are durable, its log does not say so yet
    ("rank.done:1@2", 3, 2, False, 1),  # its share is durable and recorded, not reported to rank 0
    ("commit.rename:1@0", 2, 0, False, 3),  # rank 0 commits: the iteration is durable under its temporary name
    ("chunk:1@1!stop", 2, 1, True, 1),  # hangs (alive, silent) after its first recorded chunks
    ("rank.committed:1@0", 2, 0, False, 0),  # rank 0 committed, the others not told: complete, nothing to rerun
]


@pytest.mark.parametrize("site,n,victim,frozen,rerun", FAULTS, ids=[f[0] for f in FAULTS])
def test_rank_killed_then_resumed(models, site, n, victim, frozen, rerun):
    want = _reference(models, "llama-tp2pp2")
    out = models / f"fault-{site.split(':')[0]}"
    argv = _argv(models, "llama-tp2pp2", out) + ["--distributed-timeout-minutes", TIMEOUT]
    res = ranks(n, argv, env={"SHARDKIT_FAULT_AT": site}, frozen=victim if frozen else None)
    assert res[victim]["rc"] == -signal.SIGKILL, res[victim]
    for r, x in enumerate(res):
        if r == victim:
            continue
        assert x["rc"] == 1, f"rank {r} did not stop by itself: {x}"
        lines = error_lines(x["err"])
        assert len(lines) == 1 and "Traceback" not in x["err"], x["err"][-3000:]
        committing = site.startswith(("commit.", "rank.committed"))  # rank 0 may have committed: says so
        said = "none of it" if committing else "nothing was committed"
        assert f"rank {victim} " in lines[0] and said in lines[0], lines[0]
    # a complete checkpoint that verifies, or none; never a `latest` naming something that is not there
    assert assert_consistent(out, must_load=not rerun) == (0 if not rerun else None)
    if not rerun:
        pass  # committed before rank 0 was killed: complete, compared below
    elif rerun == 1:
        r = one(argv)
        assert r.returncode == 0, r.stderr[-3000:]
        assert "resuming:" in r.stderr or site.startswith("commit."), r.stderr
    else:
        res = ranks(rerun, argv)
        ok(res)
        assert "resuming:" in res[0]["err"] or site.startswith("commit."), res[0]["err"]
    assert_clean(out)
    got = files_of(out / "iter_0000000")
    assert sorted(got) == sorted(want) and [k for k in want if got[k] != want[k]] == []


# -- bad input ---------------------------------------------------------------------------------------------------

def test_ranks_with_other_arguments(models, tmp_path):
    out = tmp_path / "out"
    argv = ["convert", "hf-to-mcore", models / "llama", out, "--tp", "2", "--quiet"]
    res = ranks(2, argv, per_rank_argv={1: argv[:-2] + ["1", "--quiet"]})
    for x in res:
        assert x["rc"] == 1 and "Traceback" not in x["err"], x
        (line,) = error_lines(x["err"])
        assert "rank 1 was started with other arguments than rank 0: --tp is 1 on rank 1, 2 on rank 0" in line, line
    assert not out.exists()


def test_world_size_mismatch(models, tmp_path):
    """Two ranks of a world of three: each stops after the timeout, saying how many joined; a rank outside its
    world, or a WORLD_SIZE that contradicts SLURM's task count, stops at once."""
    out = tmp_path / "out"
    argv = ["convert", "hf-to-mcore", models / "llama", out, "--quiet", "--distributed-timeout-minutes", "0.05"]
    res = ranks(2, argv, world=3)
    for r, x in enumerate(res):
        assert x["rc"] == 1 and "Traceback" not in x["err"], x
        (line,) = error_lines(x["err"])
        assert line.startswith(f"shardkit: error: rank {r}:") and "of WORLD_SIZE=3 ranks joined" in line, line
    assert not out.exists()
    cases = [({"RANK": "3", "WORLD_SIZE": "2"}, "rank 3 is outside the world of WORLD_SIZE=2 ranks"),
             ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "WORLD_SIZE": "4"},
              "rank 0 (a SLURM task (SLURM_PROCID)): WORLD_SIZE=4 but SLURM_NTASKS=2")]
    for env, want in cases:
        r = subprocess.run([sys.executable, "-m", "shardkit", *map(str, argv)], capture_output=True, text=True,
                           env=_env({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_port()), **env}), cwd=REPO,
                           timeout=120)
        assert r.returncode == 1 and want in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert not out.exists()


def test_output_not_shared(models, tmp_path):
    """A relative output path from two working directories: each rank has its own output directory, as on nodes that
    do not share the filesystem. Rank 1 does not find what rank 0 prepared; both stop; nothing is committed."""
    a, b = tmp_path / "node-a", tmp_path / "node-b"
    a.mkdir()
    b.mkdir()
    argv = ["convert", "hf-to-mcore", models / "llama", "out", "--tp", "2", "--quiet"]
    res = ranks(2, argv, cwds=[a, b])
    (line1,) = error_lines(res[1]["err"])
    assert res[1]["rc"] == 1 and "does not see it" in line1 and "every node shares" in line1, line1
    (line0,) = error_lines(res[0]["err"])
    assert res[0]["rc"] == 1 and "rank 1 failed" in line0 and "nothing was committed" in line0, line0
    assert not (a / "out" / LATEST).exists() and not (b / "out").exists()


def test_second_job_gets_the_lock_error(models, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'w'); "
                               "fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); time.sleep(600)",
                               str(out / LOCK)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        res = ranks(2, ["convert", "hf-to-mcore", models / "llama", out, "--quiet", "--overwrite"])
    finally:
        holder.kill()
        holder.wait()
    (line0,) = error_lines(res[0]["err"])
    assert res[0]["rc"] == 1 and "another shardkit process is writing here" in line0, line0
    (line1,) = error_lines(res[1]["err"])
    assert res[1]["rc"] == 1 and "rank 0 failed" in line1 and "another shardkit process" in line1, line1
    assert sorted(p.name for p in out.iterdir()) == [LOCK]
