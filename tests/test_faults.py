"""kill -9 at named and at random points of conversions, reshards and training saves (issue 8).

Every trial is a real `shardkit` command (CLI main) in a process forked from tests/fault_zygote.py, killed with
SIGKILL either at a named site (SHARDKIT_FAULT_AT, checkpoint/faults.py) or after a seeded random delay. After each
kill: whatever `latest` (or the newest complete iteration) names loads and verifies, nothing that is not complete
looks like a checkpoint, and the same command rerun produces output bitwise equal to an uninterrupted run. The
numbers of trials and outcomes are printed (`-s`) for docs/reliability.md's table.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from checkpoint.commit import LOCK
from checkpoint.iterations import LATEST, PARTIAL_SUFFIX, complete_iterations, resolve_iteration
from checkpoint.manifest import MANIFEST
from checkpoint.reader import Checkpoint
from tests.launcher import ForkServer, server

TINY = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=96, vocab_size=300)
SEED = 8


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    from shardkit.demo import build_tiny_llama

    root = tmp_path_factory.mktemp("faults")
    build_tiny_llama(root / "hf", **TINY)
    return root, server()  # the session's fork server (tests/launcher.py)


def killed(r: dict) -> bool:
    return r["signal"] == signal.SIGKILL


def files_of(iter_dir: Path) -> dict[str, bytes]:
    """Every file of an iteration, the manifest without its run-dependent provenance (time, seconds) and digest."""
    out = {}
    for p in sorted(iter_dir.rglob("*")):
        if p.is_file():
            rel = str(p.relative_to(iter_dir))
            data = p.read_bytes()
            if rel == MANIFEST:
                m = json.loads(data)
                m.pop("digest")
                m["provenance"].pop("created", None)
                m["provenance"].pop("seconds", None)
                data = json.dumps(m, sort_keys=True).encode()
            out[rel] = data
    return out


def assert_consistent(root: Path, must_load: bool) -> int | None:
    """After a kill: what the root resolves to loads and verifies (required when a complete checkpoint existed
    before); no directory named like an iteration lacks its manifest. Returns the iteration it resolved to."""
    if not root.exists():
        assert not must_load
        return None
    for p in root.iterdir():
        if p.name.startswith("iter_") and not p.name.endswith(PARTIAL_SUFFIX):
            assert (p / MANIFEST).is_file(), f"{p} looks like an iteration but is not complete"
    if not (root / LATEST).exists() and not complete_iterations(root):
        assert not must_load, f"{root}: the previous checkpoint is gone: {sorted(os.listdir(root))}"
        return None
    ck = Checkpoint(root)
    ck.verify()
    return ck.manifest.iteration


def assert_clean(root: Path, lock_may_stay: bool = False) -> None:
    """After a successful run: no temporary or leftover names, no lock (but for a run killed between its commit and
    the lock's release: the kernel releases the flock, its empty file stays until the next writer)."""
    names = sorted(os.listdir(root))
    left = [n for n in names if n.endswith((PARTIAL_SUFFIX, ".old", ".tmp")) or (n == LOCK and not lock_may_stay)]
    assert left == [], names


class Tally:
    def __init__(self, kind: str):
        self.kind, self.trials, self.killed, self.loaded_after, self.equal_after = kind, 0, 0, 0, 0

    def report(self) -> str:
        equal = f", rerun bitwise equal {self.equal_after}" if self.equal_after else ""
        return (f"{self.kind}: {self.trials} trials, {self.killed} killed mid-write, a complete checkpoint present "
                f"(loaded + verified) after {self.loaded_after}{equal}")


def _kill_and_rerun(z: ForkServer, argv: list, out: Path, want: dict[str, bytes], iteration_dir: str, fault: str | None,
                    delay: float | None, existing: bool, tally: Tally) -> None:
    r = z.run(argv, fault=fault, kill_after=delay)
    tally.trials += 1
    if fault is not None:  # a named site must be reached, or the trial proves nothing
        assert killed(r), f"{fault}: the site was not reached (rc={r['rc']}):\n{r['log'][-2000:]}"
    else:
        assert killed(r) or r["rc"] == 0, r
    tally.killed += killed(r)
    if assert_consistent(out, must_load=existing) is not None:
        tally.loaded_after += 1
    # a kill that lands after the commit (latest written, the process still exiting) finds a finished run: compared
    # as it is (its rerun, like any rerun after success, is refused without --overwrite); any earlier one is rerun
    committed = not existing and (out / LATEST).exists()
    if killed(r) and not committed:  # rerun the same command
        r2 = z.run(argv)
        assert r2["rc"] == 0, r2["log"][-3000:]
    assert_clean(out, lock_may_stay=committed and killed(r))
    got = files_of(out / iteration_dir)
    assert sorted(got) == sorted(want)
    bad = [k for k in want if got[k] != want[k]]
    assert bad == [], f"after {fault or f'a kill at {delay:.3f}s'}, the rerun differs in {bad[:5]}"
    tally.equal_after += 1


def _run_plan(z, plan: list, prefix: Path, make_argv, other: Path, want: dict[str, bytes], tally: Tally) -> None:
    """Each (fault, delay, over) trial of `plan` in a fresh output `<prefix>-<i>` (a copy of `other`, written with
    --overwrite, when `over`): killed, checked, rerun and compared with `want`."""
    for i, (fault, delay, over) in enumerate(plan):
        out = Path(f"{prefix}-{i}")
        argv = make_argv(out)
        if over:
            shutil.copytree(other, out)
            argv.append("--overwrite")
        _kill_and_rerun(z, argv, out, want, "iter_0000000", fault, delay, over, tally)
        shutil.rmtree(out)


# -- conversions ------------------------------------------------------------------------------------------------

CONVERT_SITES_FRESH = ["chunk:1", "chunk:5", "chunk:11", "chunk:16", "atomic.tmp:1", "atomic.tmp:2",
                       "commit.begin:1", "commit.rename:1", "commit.latest:1", "atomic.tmp:3"]
CONVERT_SITES_OVER = ["chunk:2", "commit.rename:1", "commit.swapped:1", "commit.latest:1", "atomic.tmp:3"]


def test_kill_conversion(work):
    root, z = work
    hf = root / "hf"
    ref = root / "convert-ref"
    r = z.run(["convert", "hf-to-mcore", hf, ref, "--quiet", "--no-verify"])
    assert r["rc"] == 0, r["log"]
    want = files_of(ref / "iter_0000000")
    clean_seconds = r["seconds"]
    other = root / "convert-tp2"  # an older checkpoint (another layout) to convert over with --overwrite
    assert z.run(["convert", "hf-to-mcore", hf, other, "--tp", "2", "--quiet", "--no-verify"])["rc"] == 0
    rng = random.Random(SEED)
    tally = Tally("convert")
    plan = [(s, None, False) for s in CONVERT_SITES_FRESH] + [(s, None, True) for s in CONVERT_SITES_OVER]
    plan += [(None, rng.uniform(0.02, 1.2 * clean_seconds), i % 2 == 1) for i in range(10)]
    _run_plan(z, plan, root / "convert", lambda out: ["convert", "hf-to-mcore", hf, out, "--quiet", "--no-verify"],
              other, want,
              tally)
    print("\n" + tally.report())
    assert tally.trials == 25 and tally.killed >= 20


# -- reshards ---------------------------------------------------------------------------------------------------

RESHARD_SITES_FRESH = ["chunk:1", "chunk:9", "chunk:20", "atomic.tmp:2", "commit.begin:1", "commit.rename:1",
                       "commit.latest:1"]
RESHARD_SITES_OVER = ["chunk:3", "commit.swapped:1", "commit.latest:1"]


def test_kill_reshard(work):
    root, z = work
    src = root / "reshard-src"
    assert z.run(["convert", "hf-to-mcore", root / "hf", src, "--quiet", "--no-verify"])["rc"] == 0
    ref = root / "reshard-ref"
    r = z.run(["reshard", src, ref, "--tp", "2", "--pp", "2", "--quiet"])
    assert r["rc"] == 0, r["log"]
    want = files_of(ref / "iter_0000000")
    other = root / "reshard-pp2"
    assert z.run(["reshard", src, other, "--pp", "2", "--quiet"])["rc"] == 0
    rng = random.Random(SEED + 1)
    tally = Tally("reshard")
    plan = [(s, None, False) for s in RESHARD_SITES_FRESH] + [(s, None, True) for s in RESHARD_SITES_OVER]
    plan += [(None, rng.uniform(0.02, 1.2 * r["seconds"]), i % 2 == 1) for i in range(5)]
    _run_plan(z, plan, root / "reshard", lambda out: ["reshard", src, out, "--tp", "2", "--pp", "2", "--quiet"],
              other, want, tally)
    print("\n" + tally.report())
    assert tally.trials == 15 and tally.killed >= 12


# -- training saves ---------------------------------------------------------------------------------------------

TRAIN = ["--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "2", "--lr", "1e-3",
         "--lr-warmup-iters", "1", "--train-iters", "40", "--seed", "3",
         "--attention-dropout", "0", "--hidden-dropout", "0"]
# the n-th save of a run (each run saves every iteration until killed)
TRAIN_SITES = ["commit.begin:1", "atomic.tmp:2", "commit.rename:1", "atomic.tmp:3", "commit.latest:2",
               "commit.swapped:1"]


@pytest.fixture(scope="module")
def trainable(work) -> tuple[Path, Path]:
    """A float32 tiny checkpoint and a token corpus for the training trials: (checkpoint root, data prefix)."""
    import torch

    from shardkit.demo import build_tiny_llama
    from train.data.indexed import write_indexed

    root, z = work
    build_tiny_llama(root / "thf", dtype=torch.float32, **TINY)
    assert z.run(["convert", "hf-to-mcore", root / "thf", root / "tck", "--quiet", "--no-verify"])["rc"] == 0
    rng = np.random.default_rng(SEED)
    write_indexed(root / "tdata", [rng.integers(3, 200, size=int(rng.integers(20, 60))) for _ in range(100)],
                  np.uint16)
    return root / "tck", root / "tdata"


def test_kill_training_save(work, trainable):
    """A chain of `continue-pretrain` runs on one save root, each killed during one of its saves (synchronous ones at
    named sites, `--async-save` ones at random sites and counts); each resumes from what the previous left.
    `latest` (or, before the first `latest`, the newest complete iteration) always loads and verifies, and a resumed
    run starts exactly there."""
    root, z = work
    tck, data = trainable
    save = root / "tsave"
    rnd = random.Random(SEED + 2)
    tally = Tally("training save")
    # named sites with synchronous saves, then kills at random points of --async-save saves (the commit runs on a
    # background thread through the same IterationWriter): a random site, at a random count within the run's first
    # three saves, so the kill always lands whatever the machine's speed (a random *time* could outlast a short run)
    random_sites = [f"store.write:{rnd.randint(1, 30)}", f"atomic.tmp:{rnd.randint(1, 6)}",
                    f"commit.begin:{rnd.randint(1, 3)}", f"commit.latest:{rnd.randint(1, 3)}"]
    plan = [(s, None, False) for s in TRAIN_SITES] + [(s, None, True) for s in random_sites]
    last = None
    for fault, delay, background in plan:
        load = save if save.exists() and (complete_iterations(save) or (save / LATEST).exists()) else tck
        start = 0 if load != save else Checkpoint(save).manifest.iteration
        argv = ["continue-pretrain", "--load", load, "--data-path", data, "--save", save, *TRAIN,
                "--save-interval", "1", "--log-interval", "0", *(["--async-save"] if background else [])]
        if fault == "commit.swapped:1":  # a save of an iteration that exists already (left by a kill after its rename)
            assert last is not None and (save / f"iter_{start + 1:07d}").is_dir(), sorted(os.listdir(save))
        r = z.run(argv, fault=fault, kill_after=delay)
        tally.trials += 1
        assert killed(r), f"{fault or delay}: the run was not killed (rc={r['rc']}):\n{r['log'][-3000:]}"
        tally.killed += 1
        it = assert_consistent(save, must_load=last is not None)
        if it is not None:
            tally.loaded_after += 1
            assert last is None or it >= last, (it, last)
            assert resolve_iteration(save).name == f"iter_{it:07d}"
            last = it
    # the last resume: it starts where `latest` says and runs to the end
    start = Checkpoint(save).manifest.iteration
    r = z.run(["continue-pretrain", "--load", save, "--data-path", data, "--save", save, *TRAIN,
               "--save-interval", "0", "--log-interval", "1"])
    assert r["rc"] == 0, r["log"][-3000:]
    assert Checkpoint(save).manifest.iteration == 40
    logged = [json.loads(ln)["iteration"] for ln in (save / "metrics.jsonl").read_text().splitlines()]
    assert logged[0] == start + 1, (logged[:3], start)
    assert_clean(save)
    print("\n" + tally.report())
    assert tally.trials >= 10


# -- disk full --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cmd", ["convert", "reshard"])
def test_disk_full(work, cmd):
    """RLIMIT_FSIZE makes chunk writes fail (EFBIG) partway: a one-line error naming the file and the bytes needed;
    the previous checkpoint in the same root (same iteration, another layout) is untouched and still verifies; no
    temporary data is left."""
    root, z = work
    hf = root / "hf"
    src = root / f"full-src-{cmd}"
    assert z.run(["convert", "hf-to-mcore", hf, src, "--quiet", "--no-verify"])["rc"] == 0
    out = root / f"full-{cmd}"
    first = ["convert", "hf-to-mcore", hf, out, "--tp", "2", "--quiet", "--no-verify"] if cmd == "convert" else \
        ["reshard", src, out, "--tp", "2", "--quiet"]
    assert z.run(first)["rc"] == 0
    before = files_of(out / "iter_0000000")
    again = ["convert", "hf-to-mcore", hf, out, "--quiet", "--no-verify", "--overwrite"] if cmd == "convert" else \
        ["reshard", src, out, "--pp", "2", "--quiet", "--overwrite"]
    r = z.run(again, fsize=20000)
    assert r["rc"] == 1, r
    lines = [ln for ln in r["log"].splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("shardkit: error:"), r["log"]
    assert str(out) in lines[0] and "bytes" in lines[0] and "needs" in lines[0], lines[0]
    assert "File too large" in lines[0] or "EFBIG" in lines[0] or "too large" in lines[0].lower(), lines[0]
    assert files_of(out / "iter_0000000") == before
    Checkpoint(out).verify()
    assert_clean(out)


def test_disk_full_training_save(work, trainable):
    """A training save that hits RLIMIT_FSIZE: one line naming the file and the bytes the save needs; the previous
    checkpoint (iteration 1 of the same root) is untouched and `latest` still names it; the partial iteration is
    removed."""
    root, z = work
    tck, data = trainable
    save = root / "full-train"
    common = ["--data-path", data, "--save", save, *TRAIN, "--log-interval", "0"]
    assert z.run(["continue-pretrain", "--load", tck, *common, "--exit-interval", "1"])["rc"] == 0
    before = files_of(save / "iter_0000001")
    r = z.run(["continue-pretrain", "--load", save, *common, "--save-interval", "2"], fsize=3000)
    assert r["rc"] == 1, r["log"][-3000:]
    log = r["log"].splitlines()  # what follows the run's start-up block (it ends with the `loaded checkpoint` line)
    start = next((i + 1 for i, ln in enumerate(log) if ln.startswith("loaded checkpoint ")), 0)
    lines = [ln for ln in log[start:] if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("shardkit: error: checkpoint save failed"), r["log"][-3000:]
    assert "File too large" in lines[0] and "needs" in lines[0] and "bytes" in lines[0], lines[0]
    assert (save / "latest").read_text().strip() == "iter_0000001"
    assert files_of(save / "iter_0000001") == before
    Checkpoint(save).verify()
    assert sorted(p.name for p in save.iterdir() if p.name.startswith("iter_")) == ["iter_0000001"]


# -- a rank dies ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("site", ["collective:10@1", "store.write:100@1", "collective:10@1!stop"],
                         ids=["mid-step", "mid-save", "hung-mid-step"])
def test_rank_dies(work, trainable, site):
    """Two ranks (data parallel) forked as torchrun would start them, without torchrun's agent (which would kill the
    survivor for us): rank 1 is killed inside a step's all-reduce, or while writing its part of a later save. Rank 0
    must exit by itself, non-zero, with one line saying a rank was lost and where to resume from (gloo sees the reset
    at once); the last complete checkpoint loads and verifies. A rank that hangs instead (SIGSTOP: alive, silent) is
    given up on after --distributed-timeout-minutes (0.1 here)."""
    import socket

    root, z = work
    tck, data = trainable
    hang = site.endswith("!stop")
    save = root / f"rank-dies-{site.split(':')[0]}{'-hang' if hang else ''}"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = ["continue-pretrain", "--load", tck, "--data-path", data, "--save", save, *TRAIN, "--save-interval", "1",
            "--log-interval", "0", "--distributed-timeout-minutes", "0.1" if hang else "1"]
    argv[argv.index("--global-batch-size") + 1] = "4"
    ranks = [{"argv": [str(a) for a in argv], "log": str(save.with_name(save.name + f"-rank{r}.log")),
              "env": {"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                      "MASTER_PORT": str(port), "SHARDKIT_FAULT_AT": site}} for r in range(2)]
    # 300 s: a hang fails the test instead of waiting forever; a frozen rank 1 is killed once rank 0 has ended
    r0, r1 = z.request({"group": ranks, "kill_after": 300, "kill_rest_after_first": hang})
    err0 = Path(ranks[0]["log"]).read_text()
    assert killed(r1), Path(ranks[1]["log"]).read_text()[-2000:]
    assert r0["rc"] not in (0, None) and not killed(r0), f"rank 0 did not stop by itself: {r0}\n{err0[-3000:]}"
    lines = [ln for ln in err0.splitlines() if ln.strip() and not ln.startswith("attention:")]
    assert lines and lines[-1].startswith("shardkit: error: rank 0: lost contact with another rank"), err0[-3000:]
    assert not any("Traceback" in ln for ln in lines), err0[-3000:]
    if site.startswith("store.write"):  # a rank writes fewer than 100 regions per save: an earlier save completed
        ck = Checkpoint(save)
        ck.verify()
        assert ck.manifest.iteration >= 1 and f"resume from {ck.path}" in lines[-1], lines[-1]


# -- one writer per root; the non-atomic fallback of replace_dir --------------------------------------------------

@pytest.mark.parametrize("fmt", ["native", "torch_dist", "hf"])
def test_one_writer_per_root(work, tmp_path, capsys, fmt):
    """While another process holds an output's lock, a second writer refuses with one line and touches nothing."""
    from shardkit.cli import main

    root, _ = work
    out = tmp_path / "out"
    out.mkdir()
    lock_dir, lock_name = (tmp_path, ".out.shardkit.lock") if fmt == "hf" else (out, LOCK)
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'w'); "
                               "fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); time.sleep(600)",
                               str(lock_dir / lock_name)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        if fmt == "hf":
            ck = root / "convert-ref"  # from test_kill_conversion; made here when run alone
            if not ck.exists():
                assert main(["convert", "hf-to-mcore", str(root / "hf"), str(ck), "--quiet", "--no-verify"]) == 0
            argv = ["convert", "mcore-to-hf", str(ck), str(out), "--quiet", "--overwrite"]
        else:
            argv = ["convert", "hf-to-mcore", str(root / "hf"), str(out), "--quiet", "--no-verify", "--format", fmt,
                    "--overwrite"]
        capsys.readouterr()
        rc = main(argv)
        err = capsys.readouterr().err
        assert rc == 1 and err.startswith("shardkit: error:") and "another shardkit process" in err, err
        assert len(err.strip().splitlines()) == 1, err
        assert sorted(p.name for p in out.iterdir()) == ([] if fmt == "hf" else [LOCK])
    finally:
        holder.kill()
        holder.wait()


def test_replace_dir_fallback_recovers(work, tmp_path, monkeypatch):
    """Where the kernel cannot exchange directories, replacing an iteration renames the old one to `.iter_N.old`
    first. A crash right then (simulated: the state is built by hand) leaves `latest` naming a missing iteration: a
    reader takes the `.old` one, and the next writer puts it back before it starts."""
    import checkpoint.commit as commit
    from shardkit.cli import main

    root, _ = work
    monkeypatch.setattr(commit, "_exchange", lambda a, b: False)
    out = tmp_path / "ck"
    assert main(["convert", "hf-to-mcore", str(root / "hf"), str(out), "--quiet", "--no-verify", "--tp", "2"]) == 0
    before = files_of(out / "iter_0000000")
    # fallback
    assert main(["convert", "hf-to-mcore", str(root / "hf"), str(out), "--quiet", "--no-verify", "--overwrite"]) == 0
    assert_clean(out)
    want = files_of(out / "iter_0000000")
    assert want != before
    (out / "iter_0000000").rename(out / ".iter_0000000.old")  # the crash window of the fallback
    ck = Checkpoint(out)
    ck.verify()
    assert ck.path.name == ".iter_0000000.old"
    commit.recover_root(out)
    assert (out / "iter_0000000").is_dir() and not (out / ".iter_0000000.old").exists()
    assert files_of(out / "iter_0000000") == want
