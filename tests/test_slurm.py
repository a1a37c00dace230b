"""`shardkit launch` against a real SLURM: the scripts it writes are submitted, unchanged, with `sbatch --wait` to a
one-node cluster this module starts on this machine (tests/slurm_cluster.py: munged, slurmctld, slurmd, state in a
temporary directory). A 2-task TP 2 continue-pretrain on gloo equals the same run under the rendered torchrun script
(losses and every tensor bitwise); SIGUSR1 makes the job save and exit cleanly; a job cancelled (scancel) in the middle
of a save is resubmitted and resumes from the last complete checkpoint; a task started without the rendezvous
variables says which are missing. Without slurm-wlm and munge (scripts/install_slurm.sh) the SLURM tests skip, saying
why; launch's bad-input checks run everywhere."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from checkpoint.reader import Checkpoint
from tests.slurm_cluster import SlurmCluster, missing
from tests.launcher import free_port

COMMON = ["--seq-length", "32", "--micro-batch-size", "1", "--global-batch-size", "4", "--lr", "1e-3",
          "--lr-warmup-iters", "1", "--min-lr", "1e-4", "--clip-grad", "1.0", "--seed", "7", "--train-iters", "4", "--save-interval", "1",
          "--attention-dropout", "0", "--hidden-dropout", "0"]
JOB_TIMEOUT = 240



@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    why = missing()
    if why:
        pytest.skip(why)
    c = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        c.start()
    except Exception as e:  # noqa: BLE001 -- say what the daemons said
        c.stop()
        pytest.fail(f"the one-node SLURM did not start: {e}")
    print(f"one-node SLURM up in {c.start_seconds:.2f} s")
    yield c
    c.stop()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from tests.corpus import tiny_llama_setup

    return tiny_llama_setup(tmp_path_factory.mktemp("slurm-train"))


def launch(setup: Path, name: str, *flags: str, trainer: tuple[str, ...] = ()) -> Path:
    """`shardkit launch` for TP 2 on one node of 2 "GPUs" into setup/name; returns the directory of the scripts."""
    from shardkit.cli import main as cli

    out = setup / name
    assert cli(["launch", "--layout", "tp=2,dp=1", "--nodes", "1", "--gpus-per-node", "2", "--slurm",
                "--partition", "debug", "--time", "10", "--signal", "USR1@60", "--master-port", str(free_port()),
                "--out", str(out), *flags, "--", "--load", str(setup / "ck"), "--data-path", str(setup / "data"),
                "--save", str(setup / name / "save"), *COMMON, *trainer]) == 0
    return out


# the rendered scripts find their Python on PATH when they run (issue 37): the test's venv, as a user's activated one
ACTIVATED = {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}


def job_log(out: Path, job: int) -> str:
    p = out / "logs" / f"shardkit-pretrain-{job}.out"
    return p.read_text() if p.exists() else ""  # SLURM creates it when the job starts


def losses(save: Path) -> dict[int, float]:
    """iteration -> loss, the last value logged for each (a resumed run appends to metrics.jsonl)."""
    rows = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    return {r["iteration"]: r["loss"] for r in rows}


def assert_bitwise(a: Path, b: Path) -> None:
    sa, sb = Checkpoint(a).state_dict(), Checkpoint(b).state_dict()
    assert set(sa) == set(sb)
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


def sbatch(cluster: SlurmCluster, out: Path, **env: str) -> tuple[int, int, str]:
    t0 = time.monotonic()
    job, rc = cluster.sbatch(out / "job.sbatch", timeout=JOB_TIMEOUT, **{**ACTIVATED, **env})
    print(f"job {job} ({out.name}): exit {rc} in {time.monotonic() - t0:.1f} s")
    return job, rc, job_log(out, job)


@pytest.fixture(scope="module")
def straight(setup):
    """The run under the rendered torchrun script (plain torchrun, 2 ranks), no SLURM."""
    out = launch(setup, "torchrun")
    t0 = time.monotonic()
    r = subprocess.run(["bash", str(out / "torchrun.sh")], capture_output=True, text=True, timeout=JOB_TIMEOUT,
                       env=dict(os.environ, PYTHONWARNINGS="ignore", **ACTIVATED))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    print(f"torchrun run: {time.monotonic() - t0:.1f} s")
    return out / "save"


def test_sbatch_equals_torchrun(cluster, setup, straight):
    out = launch(setup, "sbatch")
    script = (out / "job.sbatch").read_text()
    for line in ("#SBATCH --ntasks-per-node=2", "#SBATCH --gpus-per-node=2", "#SBATCH --partition=debug",
                 "#SBATCH --time=10", "#SBATCH --signal=USR1@60", "#SBATCH --exclusive"):
        assert line in script.splitlines()
    job, rc, log = sbatch(cluster, out)
    assert rc == 0, log
    assert "layout: TP 2, PP 1, VPP 1, DP 1" in log and "(2 ranks, CPU)" in log
    assert log.count("done at iteration 4") == 1  # rank 0 logs; two tasks ran (else no TP 2)
    want, got = losses(straight), losses(out / "save")
    assert sorted(got) == [1, 2, 3, 4] and got == want  # the same floats
    assert_bitwise(straight / "iter_0000004", out / "save" / "iter_0000004")


def _stopped_rank(save: Path, timeout: float = JOB_TIMEOUT) -> None:
    """Wait until a trainer of this run froze itself (SHARDKIT_FAULT_AT=...!stop: SIGSTOP inside a save)."""
    import psutil

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        for p in psutil.process_iter(["cmdline", "status"]):
            try:
                if p.info["status"] == psutil.STATUS_STOPPED and str(save) in " ".join(p.info["cmdline"] or []):
                    return
            except psutil.Error:
                continue
        time.sleep(0.2)
    raise AssertionError(f"no trainer of {save} stopped within {timeout} s")


def _wait_for(ok, timeout: float = JOB_TIMEOUT) -> None:
    end = time.monotonic() + timeout
    while not ok():
        if time.monotonic() > end:
            raise AssertionError(f"not there after {timeout} s")
        time.sleep(0.2)


def _submit_async(cluster: SlurmCluster, out: Path, **env: str) -> subprocess.Popen:
    """`sbatch --wait` in the background (the test signals the job meanwhile); killed at the test's end if left."""
    return subprocess.Popen(["sbatch", "--parsable", "--wait", str(out / "job.sbatch")],
                            env=cluster.env(**{**ACTIVATED, **env}),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _job_id(p: subprocess.Popen, cluster: SlurmCluster, out: Path) -> int:
    """The job id of an `sbatch --wait` still running: the newest job of this script in squeue (its stdout comes at
    the end; an earlier job of the same script may still be listed as completed)."""
    end = time.monotonic() + 30
    while time.monotonic() < end:
        rows = cluster.run("squeue", "-h", "-t", "PENDING,RUNNING", "-o", "%i %o", check=False).stdout.splitlines()
        ids = [int(r.split()[0]) for r in rows if r.strip() and str(out / "job.sbatch") in r]
        if ids:
            return max(ids)
        time.sleep(0.2)
    raise AssertionError(f"{out / 'job.sbatch'} not in squeue")


def test_requeue_scancel_mid_save_resumes_and_usr1_saves(cluster, setup, straight):
    """--requeue: the same job.sbatch, resubmitted, resumes from `latest` in --save.
    1. Cancelled (scancel) while rank 0 is inside the save of iteration 2 (every array written, no manifest yet) and
       held there (SHARDKIT_FAULT_AT=...!hang: a filesystem that stopped answering): the trainer catches scancel's
       SIGTERM but cannot finish the save, SLURM's SIGKILL follows after KillWait, the job fails, `latest` stays
       iter_0000001 and iteration 2 is left incomplete.
    2. Resubmitted: resumes from iteration 1. SIGUSR1 (what --signal=USR1@N sends before the time limit) comes while
       rank 0 is inside the save of iteration 2: that save completes, iteration 3 runs, every rank stops there, saves
       it and the job exits 0; iterations 1-3 equal the straight torchrun run (losses, and iteration 3 bitwise)."""
    out = launch(setup, "requeue", "--requeue")
    save = out / "save"
    assert "#SBATCH --requeue" in (out / "job.sbatch").read_text()
    assert (f'if [[ -e {save}/latest || -e {save}/latest_checkpointed_iteration.txt ]]; then SHARDKIT_LOAD={save}; fi'
            in (out / "torchrun.sh").read_text())

    procs: list[subprocess.Popen] = []
    try:
        t0 = time.monotonic()
        p = _submit_async(cluster, out, SHARDKIT_FAULT_AT="commit.begin:2@0!hang")
        procs.append(p)
        job = _job_id(p, cluster, out)
        _wait_for(lambda: "SHARDKIT_FAULT_AT: commit.begin:2 hangs here (rank 0)" in job_log(out, job))
        cluster.run("scancel", str(job))
        p.communicate(timeout=JOB_TIMEOUT)
        print(f"job {job} (scancel mid-save): exit {p.returncode} in {time.monotonic() - t0:.1f} s")
        log = job_log(out, job)
        assert p.returncode != 0
        assert f"loaded checkpoint {setup / 'ck' / 'iter_0000000'} at iteration 0" in log
        assert (save / "latest").read_text().strip() == "iter_0000001"
        assert not (save / "iter_0000002").exists() and (save / "iter_0000002.partial").is_dir()

        t0 = time.monotonic()
        p = _submit_async(cluster, out, SHARDKIT_FAULT_AT="commit.begin:1@0!stop")
        procs.append(p)
        job = _job_id(p, cluster, out)
        _stopped_rank(save)
        cluster.run("scancel", "--signal=USR1", str(job))
        time.sleep(0.5)  # pending on the stopped rank before it continues
        cluster.run("scancel", "--signal=CONT", str(job))
        p.communicate(timeout=JOB_TIMEOUT)
        print(f"job {job} (resume, SIGUSR1): exit {p.returncode} in {time.monotonic() - t0:.1f} s")
        log = job_log(out, job)
        assert p.returncode == 0, log
        assert f"loaded checkpoint {save / 'iter_0000001'} at iteration 1" in log
        assert "SIGUSR1 received (--exit-signal-handler): stopping after iteration 3, saved" in log
        assert "Traceback" not in log
        assert (save / "latest").read_text().strip() == "iter_0000003"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    want, got = losses(straight), losses(save)
    assert sorted(got) == [1, 2, 3] and got == {i: want[i] for i in (1, 2, 3)}
    assert_bitwise(straight / "iter_0000003", save / "iter_0000003")


def test_task_without_rendezvous_variables(cluster, setup):
    """Two srun tasks of continue-pretrain without MASTER_ADDR/MASTER_PORT: each says so in one line, exit != 0."""
    script = setup / "bare.sbatch"
    script.write_text(f"#!/usr/bin/env bash\n#SBATCH --ntasks=2\n#SBATCH --output={setup}/bare-%j.out\n"
                      f"unset MASTER_ADDR MASTER_PORT\nsrun {sys.executable} -m shardkit continue-pretrain --load "
                      f"{setup / 'ck'} --data-path {setup / 'data'} --tp 2 {' '.join(COMMON)}\n")
    job, rc = cluster.sbatch(script, timeout=JOB_TIMEOUT)
    log = (setup / f"bare-{job}.out").read_text()
    assert rc != 0
    lines = [ln for ln in log.splitlines() if "shardkit: error:" in ln]
    assert len(lines) == 2 and "Traceback" not in log, log
    for ln in lines:
        assert "(a SLURM task (SLURM_PROCID)) starts without MASTER_ADDR, MASTER_PORT" in ln


def test_rendezvous_variables_named_without_slurm(setup):
    """The same check with SLURM's variables set by hand (runs where SLURM is not installed)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    cmd = [sys.executable, "-m", "shardkit", "continue-pretrain", "--load", str(setup / "ck"), "--data-path",
           str(setup / "data"), *COMMON]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                       env=dict(env, SLURM_PROCID="1", SLURM_NTASKS="2", SLURM_LOCALID="1"))
    assert r.returncode != 0 and r.stderr.count("\n") == 1, r.stderr
    assert "rank 1 (a SLURM task (SLURM_PROCID)) starts without MASTER_ADDR, MASTER_PORT" in r.stderr
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                       env=dict(env, SLURM_PROCID="0", SLURM_NTASKS="2"))
    assert r.returncode != 0 and r.stderr.count("\n") == 1, r.stderr
    assert "SLURM task 0 starts without SLURM_LOCALID" in r.stderr


# -- launch: what sbatch would refuse, refused before submitting ------------------------------------------------------
# the SLURM flags' own checks: --load is not opened (tests/test_launch.py checks the layout against checkpoints)
LAY = ["launch", "--layout", "tp=2,dp=2", "--nodes", "1", "--gpus-per-node", "4", "--dry-run", "--skip-load-check"]
TRAIN = ["--", "--load", "ck", "--save", "out", "--data", "d"]


@pytest.mark.parametrize("argv,needle", [
    (["launch", "--layout", "tp=2,dp=4", "--nodes", "1", "--gpus-per-node", "4", "--dry-run"],
     "uses tp x pp x cp x dp = 8 GPUs, one SLURM task each, more than --nodes 1 x --gpus-per-node 4 = 4"),
    ([*LAY, "--time", "25 hours"], "--time '25 hours': not a SLURM time limit"),
    ([*LAY, "--time", "1:2:3:4"], "--time '1:2:3:4': not a SLURM time limit"),
    ([*LAY, "--time", "2-"], "--time '2-': not a SLURM time limit"),
    ([*LAY, "--partition", "gpu queue"], "--partition 'gpu queue': not a SLURM partition name"),
    ([*LAY, "--partition", "gpu,"], "--partition 'gpu,': not a SLURM partition name"),
    ([*LAY, "--account", "a;b"], "--account 'a;b': not a SLURM account name"),
    ([*LAY, "--qos", ""], "--qos '': not a SLURM qos name"),
    ([*LAY, "--time", "5", "--signal", "USR1@300"], "--signal USR1@300: 300 s before the end is not inside --time 5"),
    ([*LAY, "--signal", "FOO@30"], "--signal 'FOO@30': expected SIGNAL@SECONDS"),
    ([*LAY, "--sbatch", "partition=gpu"], "--sbatch --partition=gpu: launch writes --partition itself; use "
                                          "--partition"),
    ([*LAY, "--sbatch=--ntasks=16"], "--sbatch --ntasks=16: launch writes --ntasks itself; use --layout"),
    ([*LAY, "--requeue", "--", "--load", "ck", "--data", "d"], "--requeue: the continue-pretrain arguments after `--` "
                                                               "need --load and --save"),
    ([*LAY, *TRAIN, "--exit-signal", "SIGUSR2"], "--exit-signal SIGUSR2 after `--` is not --signal USR1@300's SIGUSR1"),
    ([*LAY, *TRAIN, "--exit-signal", "SIGFOO"], "argument --exit-signal: 'SIGFOO': not a signal that can be caught"),
])
def test_launch_bad_input(argv, needle, capsys):
    from shardkit.cli import main

    assert main(argv) != 0
    err = capsys.readouterr().err
    assert err.startswith("shardkit: error: ") and needle in err and err.count("\n") == 1, err


@pytest.mark.parametrize("t,secs", [("30", 1800), ("30:15", 1815), ("4:00:00", 14400), ("2-0", 172800),
                                    ("1-2:3", 93780), ("1-02:03:04", 93784), ("UNLIMITED", None)])
def test_launch_time_formats(t, secs, capsys):
    from plan.launch import time_seconds
    from shardkit.cli import main

    assert time_seconds(t) == secs
    assert main([*LAY, "--time", t, "--signal", "none", *TRAIN]) == 0
    text = capsys.readouterr().out
    assert f"#SBATCH --time={t}\n" in text and "--signal" not in text and "--exit-signal" not in text


def test_launch_cluster_flags(capsys):
    from shardkit.cli import main

    assert main([*LAY, "--partition", "gpu,gpu-low", "--account", "llm", "--qos", "high", "--no-exclusive",
                 "--requeue", "--time", "2-00:00:00", "--signal", "USR1@600", "--sbatch", "constraint=h100",
                 "--", "--load", "ck", "--save", "run 1", "--data", "d"]) == 0
    text = capsys.readouterr().out
    for line in ("#SBATCH --partition=gpu,gpu-low", "#SBATCH --account=llm", "#SBATCH --qos=high",
                 "#SBATCH --requeue", "#SBATCH --open-mode=append", "#SBATCH --signal=USR1@600",
                 "#SBATCH --constraint=h100", "#SBATCH --ntasks-per-node=4", "    --exit-signal-handler \\",
                 "    --exit-signal SIGUSR1 \\", "    --load \"$SHARDKIT_LOAD\" \\", "SHARDKIT_LOAD=ck",
                 "if [[ -e 'run 1'/latest || -e 'run 1'/latest_checkpointed_iteration.txt ]]; then "
                 "SHARDKIT_LOAD='run 1'; fi"):
        assert line in text.splitlines(), line
    assert "--exclusive" not in text
