"""hf-to-mcore and reshard across ranks (issue 20): torchrun, or ranks started by hand with torchrun's environment
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) as SLURM's srun starts them, on gloo on this machine.

1, 2 and 3 ranks write byte-identical checkpoints; a rank killed (SIGKILL) or frozen (SIGSTOP) at a named site makes
the others stop with one line naming it, leaves a complete checkpoint that verifies or none (never a `latest` that
lies), and a rerun with another number of ranks resumes and ends bitwise equal to one process. Bad input: ranks with
different arguments, a world size that does not match the ranks started, an output directory the ranks do not share,
and a second job into the same root. The same across ranks into and from Megatron's torch_dist: each rank writes its
share of the `.distcp` rank files, rank 0 the metadata, and a rerun keeps the rank files recorded durable.
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


def launch(n: int, argv: list, out: Path, via_torchrun: bool) -> str:
    """`n` ranks of `argv`, through torchrun itself or started by hand: every rank succeeds and (by hand, where each
    rank's output is seen) rank 0 alone speaks, its `wrote` line naming `out`'s iteration. Rank 0's stderr."""
    if via_torchrun:
        r = torchrun(n, argv)
        assert r.returncode == 0, r.stderr[-3000:]
        return r.stderr
    res = ranks(n, argv)
    ok(res)
    assert all(not x["out"] and not x["err"] for x in res[1:]), res[1:]
    # rank 0 says what was written, then (a conversion that proves itself) its verdict
    _, wrote, after = res[0]["out"].strip().partition(f"wrote {out / 'iter_0000000'}")
    assert wrote and all(ln.startswith("verify: logits") and ": OK in " in ln for ln in after.strip().splitlines()), \
        res[0]["out"]
    return res[0]["err"]


def _shares(err: str, n: int, what: str) -> list[int]:
    """The pieces each of `n` ranks wrote, from rank 0's `... N ranks wrote a + b + c <what>` line."""
    line = next(ln for ln in err.splitlines() if f"{n} ranks wrote" in ln and f" {what}" in ln)
    return [int(c) for c in line.split("wrote ")[1].split(f" {what}")[0].split(" + ")]


def same_as_one_process(out: Path, want: dict, what: str) -> None:
    """`out` is clean (no partial, lock or temporary names) and its iteration holds the files `want` (td_files of one
    process's output, torch_dist or native)."""
    assert_clean(out)
    got = td_files(out / "iter_0000000")
    assert sorted(got) == sorted(want)
    assert [k for k in want if got[k] != want[k]] == [], f"{what} differ from one process"


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
        return ["reshard", _native_source(root), out, *flags]
    return ["convert", "hf-to-mcore", root / kind, out, *flags, "--no-verify"]  # the bytes are compared here


def _native_source(root: Path) -> Path:
    """The tiny Llama as a native tp1 pp1 checkpoint (one process), the source of the reshard cases."""
    src = root / "reshard-src"
    return _one_process(src, ["convert", "hf-to-mcore", root / "llama", src, "--no-verify"])


def _one_process(ref: Path, argv: list) -> Path:
    """`ref` written once by one process running `argv` (the reference every rank count is compared with)."""
    if not ref.exists():
        r = one(argv + ["--quiet"])
        assert r.returncode == 0, r.stderr
    return ref


def _reference(root: Path, case: str) -> dict[str, bytes]:
    ref = root / f"ref-{case}"
    return files_of(_one_process(ref, _argv(root, case, ref)) / "iter_0000000")


@pytest.mark.parametrize("case", list(CASES))
def test_ranks_byte_identical(models, case):
    """1 (the plain command), 2 and 3 ranks write the same bytes; every rank writes a share. The 2-rank run of the
    dense model goes through torchrun itself."""
    want = _reference(models, case)
    for n in (2, 3):
        out = models / f"{case}-{n}"
        argv = _argv(models, case, out)
        dense = case == "llama-tp2pp2"  # its 3-rank run also measures the write rate and prints the estimate first
        if dense and n == 3:  # ... and proves it across ranks: rank 0 verifies once every rank's share is in
            argv = [a for a in argv if a != "--no-verify"] + ["--estimate-above", "0"]
        err0 = launch(n, argv, out, dense and n == 2)
        if dense and n == 3:
            assert f"on 1 node(s), {n} rank(s); durable write rate measured per node" in err0, err0
        counts = _shares(err0, n, "chunks")
        assert len(counts) == n and all(c > 0 for c in counts) and sum(counts) == len(
            [k for k in want if "/c/" in k]), err0
        same_as_one_process(out, want, f"{case}: {n} ranks")


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


# -- torch_dist across ranks ---------------------------------------------------------------------------------------

TD_CASES = {  # name: (argv after the source, source: an HF kind, "td" (one process's torch_dist export), "native")
    "llama-tp2pp2-td": (["--tp", "2", "--pp", "2"], "llama"),
    "mixtral-ep2-td": (["--ep", "2"], "mixtral"),
    "reshard-td-to-td": (["--tp", "1", "--pp", "2"], "td"),  # import across ranks, then export across ranks
    "reshard-td-to-native": (["--tp", "4", "--pp", "2"], "td"),
    "reshard-native-to-td": (["--tp", "4", "--pp", "2"], "native"),
}


def _td_argv(root: Path, case: str, out: Path) -> list:
    flags, kind = TD_CASES[case]
    to = [] if case.endswith("-to-native") else ["--format", "torch_dist"]
    if kind == "td":
        return ["reshard", _td_reference(root, "llama-tp2pp2-td")[0], out, *flags, *to]
    if kind == "native":
        return ["reshard", _native_source(root), out, *flags, *to]
    return ["convert", "hf-to-mcore", root / kind, out, *flags, *to, "--no-verify"]


def td_files(it: Path) -> dict:
    """Every file of a torch_dist iteration (or, for a native one, files_of): DCP's .metadata as its objects without
    the run's own storage_meta (a fresh save id), shardkit.json without its provenance (time, staging path) and
    digest, integrity.json without those two files' SHA-256s. Everything else byte for byte."""
    import json

    from checkpoint.torch_dist_pickle import load_dcp_metadata

    if (it / "manifest.json").is_file():
        return files_of(it)
    out: dict = {}
    for p in sorted(it.rglob("*")):
        if p.is_file():
            rel = str(p.relative_to(it))
            out[rel] = p.read_bytes()
            if rel == ".metadata":
                out[rel] = md = load_dcp_metadata(p)
                md.storage_meta = None
            elif rel == "shardkit.json":
                out[rel] = {k: v for k, v in json.loads(out[rel]).items() if k not in ("provenance", "digest")}
            elif rel == "integrity.json":  # every file named; the digests but those of the two files above
                d = json.loads(out[rel])
                out[rel] = (d["algorithm"], sorted(d["files"]), {k: v for k, v in d["files"].items()
                                                                 if k not in (".metadata", "shardkit.json")})
    return out


def _td_reference(root: Path, case: str) -> tuple[Path, dict]:
    ref = root / f"ref-{case}"
    return _one_process(ref, _td_argv(root, case, ref)), td_files(ref / "iter_0000000")


TD_RUNS = [("llama-tp2pp2-td", 2), ("llama-tp2pp2-td", 3), ("reshard-td-to-td", 3), ("mixtral-ep2-td", 3),
           ("reshard-td-to-native", 2), ("reshard-native-to-td", 3)]


@pytest.mark.parametrize("case,n", TD_RUNS, ids=[f"{c}-{n}" for c, n in TD_RUNS])
def test_torch_dist_ranks_byte_identical(models, case, n):
    """`--format torch_dist` and torch_dist sources across 2 and 3 ranks: the same files as one process (the rank
    files, common.pt, hf/ byte for byte; DCP's metadata object for object); every rank writes a share of the rank
    files, the staging copy of a torch_dist -> torch_dist reshard is gone after."""
    _, want = _td_reference(models, case)
    out = models / f"{case}-{n}"
    argv = _td_argv(models, case, out)
    dense = case == "llama-tp2pp2-td"  # its 3-rank run also measures the write rate and prints the estimate first
    estimate = (dense and n == 3) or case == "reshard-td-to-native"  # (the import too)
    err0 = launch(n, argv + (["--estimate-above", "0"] if estimate else []), out, dense and n == 2)
    if estimate:
        assert f"on 1 node(s), {n} rank(s); durable write rate measured per node" in err0, err0
    if "--format" in argv:
        counts = _shares(err0, n, "rank files")
        assert len(counts) == n and sum(counts) == len([k for k in want if k.endswith(".distcp")]), err0
        if dense:
            assert all(counts), counts
    assert not list(models.glob(f".{out.name}.native-*"))  # no staging copy left
    same_as_one_process(out, want, f"{case}: {n} ranks")


def test_torch_dist_rank_killed_then_resumed(models):
    """A rank killed before its log says that its rank files are durable: the others stop naming it, nothing is
    committed (no tracker file, no iteration directory); one process resumes (the files the others recorded are
    kept) and ends equal to an uninterrupted run."""
    from checkpoint.megatron import TRACKER

    _, want = _td_reference(models, "llama-tp2pp2-td")
    out = models / "fault-td"
    argv = _td_argv(models, "llama-tp2pp2-td", out) + ["--distributed-timeout-minutes", TIMEOUT]
    res = ranks(3, argv, env={"SHARDKIT_FAULT_AT": "chunk.unrecorded:1@1"})
    assert res[1]["rc"] == -signal.SIGKILL, res[1]
    for r in (0, 2):
        assert res[r]["rc"] == 1 and "Traceback" not in res[r]["err"], res[r]
        (line,) = error_lines(res[r]["err"])
        assert "rank 1 " in line and "nothing was committed" in line, line
    assert not (out / TRACKER).exists() and not (out / "iter_0000000").exists(), sorted(os.listdir(out))
    r = one(argv)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming: 2 of 4 rank files already written" in r.stderr, r.stderr
    same_as_one_process(out, want, "the resumed run")


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
    same_as_one_process(out, want, f"{site}, rerun with {rerun or 'no'} ranks")


# -- bad input ---------------------------------------------------------------------------------------------------

def test_ranks_with_other_arguments(models, tmp_path):
    out = tmp_path / "out"
    argv = ["convert", "hf-to-mcore", models / "llama", out, "--tp", "2", "--quiet", "--no-verify"]
    res = ranks(2, argv, per_rank_argv={1: argv[:-3] + ["1", "--quiet", "--no-verify"]})
    for x in res:
        assert x["rc"] == 1 and "Traceback" not in x["err"], x
        (line,) = error_lines(x["err"])
        assert "rank 1 was started with other arguments than rank 0: --tp is 1 on rank 1, 2 on rank 0" in line, line
    assert not out.exists()


def test_world_size_mismatch(models, tmp_path):
    """Two ranks of a world of three: each stops after the timeout, saying how many joined; a rank outside its
    world, or a WORLD_SIZE that contradicts SLURM's task count, stops at once."""
    out = tmp_path / "out"
    argv = ["convert", "hf-to-mcore", models / "llama", out, "--quiet", "--no-verify", "--distributed-timeout-minutes",
            "0.05"]
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
    argv = ["convert", "hf-to-mcore", models / "llama", "out", "--tp", "2", "--quiet", "--no-verify"]
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
        res = ranks(2, ["convert", "hf-to-mcore", models / "llama", out, "--quiet", "--overwrite", "--no-verify"])
    finally:
        holder.kill()
        holder.wait()
    (line0,) = error_lines(res[0]["err"])
    assert res[0]["rc"] == 1 and "another shardkit process is writing here" in line0, line0
    (line1,) = error_lines(res[1]["err"])
    assert res[1]["rc"] == 1 and "rank 0 failed" in line1 and "another shardkit process" in line1, line1
    assert sorted(p.name for p in out.iterdir()) == [LOCK]


# -- the HF export (mcore-to-hf) across ranks ------------------------------------------------------------------------

HF_SHARD = "40KB"  # the tiny Llama's export in 6 safetensors shards


def hf_files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file()}


def _hf_reference(root: Path, source: str = "native") -> tuple[Path, dict]:
    """The source (the tiny Llama as a native checkpoint, as _native_source makes it, or one process's torch_dist
    export of it) and one process's HF export of it, both made in this process (no interpreter to start)."""
    from shardkit.cli import main

    if source == "native":
        src = root / "reshard-src"
        if not src.exists():
            assert main(["convert", "hf-to-mcore", str(root / "llama"), str(src), "--quiet", "--no-verify"]) == 0
    else:
        src = _td_reference(root, "llama-tp2pp2-td")[0]
    ref = root / f"ref-hf-{source}"
    if not ref.exists():
        assert main(["convert", "mcore-to-hf", str(src), str(ref), "--max-shard-size", HF_SHARD, "--quiet"]) == 0
    want = hf_files(ref)
    assert len([n for n in want if n.endswith(".safetensors")]) == 6, sorted(want)
    return src, want


def hf_launch(n: int, argv: list, out: Path) -> tuple[list[int], str]:
    """`n` hand-started ranks of an HF export: every rank succeeds, rank 0 alone speaks; the shards each wrote, and
    rank 0's stderr."""
    res = ranks(n, argv)
    ok(res)
    assert all(not x["out"] and not x["err"] for x in res[1:]), res[1:]
    assert res[0]["out"].strip() == f"wrote {out}", res[0]["out"]
    return _shares(res[0]["err"], n, "shards"), res[0]["err"]


def assert_hf_clean(out: Path) -> None:
    from convert.mcore_to_hf import EXPORT_PARTIAL

    assert not out.with_name(f".{out.name}.partial").exists() and not (out / EXPORT_PARTIAL).exists()
    assert not out.with_name(f".{out.name}.shardkit.lock").exists()
    assert not list(out.parent.glob(f".{out.name}.native-*")), sorted(os.listdir(out.parent))


def test_hf_export_ranks_into_existing_output(models):
    """3 ranks export with --overwrite into a directory that holds a user's file: each rank writes a share of the
    shards, the files equal one process's byte for byte, the user's file stays, nothing temporary is left."""
    src, want = _hf_reference(models)
    out = models / "hf-3"
    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    counts, _ = hf_launch(3, ["convert", "mcore-to-hf", src, out, "--max-shard-size", HF_SHARD, "--overwrite"], out)
    assert len(counts) == 3 and all(counts) and sum(counts) == 6, counts
    got = hf_files(out)
    assert got.pop("notes.txt") == b"mine\n"
    assert sorted(got) == sorted(want) and [k for k in want if got[k] != want[k]] == []
    assert_hf_clean(out)


def test_hf_export_rank_killed_then_rerun(models):
    """Rank 1 of 2 killed (SIGKILL) once its first shard is durable: rank 0 stops naming it, removes the work
    directory and puts nothing in place (no OUT); a rerun with 3 ranks (measuring the write rate first) writes the
    export byte-identical to one process's."""
    src, want = _hf_reference(models)
    out = models / "hf-killed"
    argv = ["convert", "mcore-to-hf", src, out, "--max-shard-size", HF_SHARD, "--distributed-timeout-minutes",
            TIMEOUT]
    res = ranks(2, argv, env={"SHARDKIT_FAULT_AT": "hf.shard:1@1"})
    assert res[1]["rc"] == -signal.SIGKILL, res[1]
    assert res[0]["rc"] == 1 and "Traceback" not in res[0]["err"], res[0]
    (line,) = error_lines(res[0]["err"])
    assert "rank 1 died" in line and "nothing was put in place" in line, line
    assert not out.exists()
    assert_hf_clean(out)
    counts, err0 = hf_launch(3, argv[:-2] + ["--estimate-above", "0"], out)  # the default timeout: no false alarm
    assert len(counts) == 3 and sum(counts) == 6, counts
    assert "on 1 node(s), 3 rank(s); durable write rate measured per node" in err0, err0
    got = hf_files(out)
    assert sorted(got) == sorted(want) and [k for k in want if got[k] != want[k]] == []
    assert_hf_clean(out)


def test_hf_export_torch_dist_source_ranks(models):
    """A torch_dist source across 2 ranks: every rank reads it in place (no staging copy) and writes its share of the
    shards; the export equals one process's, which is the native checkpoint's export bit for bit."""
    src, want = _hf_reference(models, "torch_dist")
    assert want == _hf_reference(models)[1]  # the same model from its native checkpoint
    out = models / "hf-from-td"
    before = set(os.listdir(models))
    counts, _ = hf_launch(2, ["convert", "mcore-to-hf", src, out, "--max-shard-size", HF_SHARD], out)
    assert len(counts) == 2 and sum(counts) == 6, counts
    got = hf_files(out)
    assert sorted(got) == sorted(want) and [k for k in want if got[k] != want[k]] == []
    assert_hf_clean(out)
    assert set(os.listdir(models)) - before == {out.name}


def test_hf_export_output_not_shared(models, tmp_path):
    """A relative output from two working directories (nodes that do not share the filesystem): rank 1 does not see
    the work directory rank 0 made; both stop with one line; nothing is put in place."""
    src, _ = _hf_reference(models)
    a, b = tmp_path / "node-a", tmp_path / "node-b"
    a.mkdir()
    b.mkdir()
    res = ranks(2, ["convert", "mcore-to-hf", src, "out", "--max-shard-size", HF_SHARD, "--quiet"], cwds=[a, b])
    (line1,) = error_lines(res[1]["err"])
    assert res[1]["rc"] == 1 and "rank 1 does not see it" in line1 and "every node shares" in line1, line1
    (line0,) = error_lines(res[0]["err"])
    assert res[0]["rc"] == 1 and "rank 1 failed" in line0 and "nothing was put in place" in line0, line0
    assert sorted(os.listdir(a)) == [] and sorted(os.listdir(b)) == []


def test_hf_export_rank0_checks_the_reported_shards(tmp_path):
    """Rank 0's check before it puts the export in place: a shard missing, or at another size than its rank
    reported (a work directory the nodes do not share), is one line naming the rank and the file."""
    from checkpoint.errors import WriteError
    from convert.mcore_to_hf import _check_reported

    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    (tmp_path / names[0]).write_bytes(b"x" * 10)
    (tmp_path / names[1]).write_bytes(b"x" * 7)
    _check_reported(None, tmp_path, names, [[f"{names[0]} 10"], [f"{names[1]} 7"]], quiet=True)
    with pytest.raises(WriteError, match=rf"{names[1]}: rank 1 wrote this shard \(8 bytes\), but rank 0 finds 7 "
                                         "bytes in .*every node shares"):
        _check_reported(None, tmp_path, names, [[f"{names[0]} 10"], [f"{names[1]} 8"]], quiet=True)
    (tmp_path / names[1]).unlink()
    with pytest.raises(WriteError, match=rf"{names[1]}: rank 1 wrote this shard \(7 bytes\), but rank 0 finds no "
                                         "such file"):
        _check_reported(None, tmp_path, names, [[f"{names[0]} 10"], [f"{names[1]} 7"]], quiet=True)
    with pytest.raises(WriteError, match=rf"1 shard\(s\) no rank reported as written \(e.g. {names[1]}\)"):
        _check_reported(None, tmp_path, names, [[f"{names[0]} 10"], []], quiet=True)


def test_shared_staging_refuses_a_directory_it_did_not_write(tmp_path):
    """The staging directory of a two-step job across ranks has a fixed name beside the output: one that holds a file
    a native write does not leave is refused in one line and left as it was; one an earlier run committed (a native
    checkpoint) is replaced, and this run's is removed at the end."""
    from checkpoint.errors import ShardkitError
    from convert.torch_dist_io import staged_across_ranks

    class Rank0:
        rank = 0

        def next_phase(self):
            pass

    out = tmp_path / "out"
    staging = tmp_path / ".out.native-staging"
    staging.mkdir()
    (staging / "notes.txt").write_text("mine")
    with pytest.raises(ShardkitError, match="native-staging: holds files shardkit's staging checkpoint does not"):
        staged_across_ranks(out, Rank0(), lambda s: s, lambda n: n)
    assert (staging / "notes.txt").read_text() == "mine"
    (staging / "notes.txt").unlink()
    (staging / "iter_0000000").mkdir()
    (staging / "iter_0000000" / "manifest.json").write_text("{}")
    (staging / "latest").write_text("iter_0000000\n")
    seen = []
    staged_across_ranks(out, Rank0(), lambda s: seen.append(s.exists()) or s, lambda n: n)
    assert seen == [False] and not staging.exists()  # the earlier run's committed staging went first, this one after
