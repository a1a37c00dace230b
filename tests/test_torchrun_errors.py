"""continue-pretrain's bad-input errors under torchrun (issue 37): one line for the job, not one per rank, and no
torchrun traceback through `python -m shardkit.torchrun` (what `shardkit launch`'s torchrun.sh runs); under stock
torchrun the failure summary names the error (the rank's error file) instead of "To enable traceback see"."""
from __future__ import annotations

import datetime
import os
import subprocess
import sys
import types

import pytest

from tests.launcher import BASE_ENV, REPO, VENV_BIN, free_port

COMMON = ["--seq-length", "32", "--micro-batch-size", "1", "--global-batch-size", "4", "--lr", "1e-3",
          "--train-iters", "2"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from tests.corpus import tiny_llama_setup

    return tiny_llama_setup(tmp_path_factory.mktemp("torchrun-errors"))


def _torchrun(launcher: list, root, *args: str) -> subprocess.CompletedProcess:
    cmd = [*launcher, "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           "-m", "shardkit", "continue-pretrain", *COMMON, *args]
    env = dict(os.environ, **BASE_ENV, PYTHONPATH=str(REPO))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_ERROR_FILE"):
        env.pop(k, None)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=root)


SHARDKIT_TORCHRUN = [sys.executable, "-m", "shardkit.torchrun"]
LR_NAN = "shardkit: error: --lr nan: expected a finite number"


def _lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.strip()]


def test_bad_flag_is_one_line_under_torchrun(tmp_path):
    """Found by both ranks before any rendezvous (--lr nan): said once, by the first rank, through torchrun's agent
    store; `python -m shardkit.torchrun` adds nothing (no traceback, no summary); torchrun's status 1."""
    r = _torchrun(SHARDKIT_TORCHRUN, tmp_path, "--load", str(tmp_path / "ck"), "--data-path", str(tmp_path / "data"),
                  "--lr", "nan")
    assert r.returncode == 1 and _lines(r.stderr) == [LR_NAN], r.stderr[-3000:]


def test_checkpoint_mismatch_is_one_line_under_torchrun(setup):
    """Found by both ranks after the rendezvous (the checkpoint has 4 layers): said once through the rendezvous store
    kept past the process groups."""
    r = _torchrun(SHARDKIT_TORCHRUN, setup, "--load", str(setup / "ck"), "--data-path", str(setup / "data"),
                  "--num-layers", "7")
    msg = f"shardkit: error: --num-layers 7 disagrees with the checkpoint {setup / 'ck' / 'iter_0000000'} (4)"
    assert r.returncode == 1, r.stderr[-3000:]
    assert len(_lines(r.stderr)) == 1 and _lines(r.stderr)[0].startswith(msg), r.stderr[-3000:]


def test_bad_flag_under_stock_torchrun(tmp_path):
    """Stock torchrun: the line once from the ranks; torchrun still prints its own traceback (any non-zero exit of a
    rank is its ChildFailedError), but its summary names the error as each rank's failure (the error file)."""
    r = _torchrun([str(VENV_BIN / "torchrun")], tmp_path, "--load", str(tmp_path / "ck"), "--data-path",
                  str(tmp_path / "data"), "--lr", "nan")
    assert r.returncode == 1
    assert [ln for ln in r.stderr.splitlines() if ln.startswith("shardkit: error:")] == [LR_NAN], r.stderr[-3000:]
    assert "To enable traceback" not in r.stderr and f"traceback : {LR_NAN}" in r.stderr, r.stderr[-3000:]


def test_argparse_error_is_one_line_under_torchrun(tmp_path):
    r = _torchrun(SHARDKIT_TORCHRUN, tmp_path, "--tp", "x")
    assert r.returncode == 2
    lines = _lines(r.stderr)
    assert len(lines) == 1 and "--tp: invalid int value: 'x'" in lines[0], r.stderr[-3000:]


def test_said_once_per_line_through_the_agent_store(monkeypatch):
    """train.report's election on a real TCPStore standing in for torchrun's agent store: the first of the ranks to
    say a line says it; another line, or another launch attempt, is said again; no store: every rank says it."""
    import torch.distributed as dist

    import train.report as report

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=10),
                           wait_for_workers=False)
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(server.port),
           "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": "job", "TORCHELASTIC_RESTART_COUNT": "0"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(report, "STORE", None)
    assert report.first_to_say("shardkit: error: x")
    assert not report.first_to_say("shardkit: error: x")
    assert report.first_to_say("shardkit: error: y")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert report.first_to_say("shardkit: error: x")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))  # nothing listens: say it (after the connect timeout)
    monkeypatch.setattr(report, "STORE_TIMEOUT_S", 0.5)
    assert report.first_to_say("shardkit: error: z")
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE")
    assert report.first_to_say("shardkit: error: x")


def test_summary_of_failures():
    """shardkit.torchrun's last line: nothing where a rank said its error; otherwise the first failure, with the
    others counted; the status is the first failed rank's (128 + N for signal N)."""
    from shardkit.torchrun import summary
    from train.report import MARK

    def failure(t, code, said=False, pid=10):
        return types.SimpleNamespace(timestamp=t, exitcode=code, local_rank=0, pid=pid,
                                     error_file_data={MARK: True} if said else {"message": "<NONE>"})

    assert summary({0: failure(5, 1, said=True), 1: failure(4, 1, said=True)}) == (None, 1)
    line, status = summary({0: failure(5, 1), 1: failure(4, -11, pid=42), 2: failure(6, -15)})
    assert status == 128 + 11
    assert line.startswith("torchrun: rank 1 (local rank 0, pid 42 on ") and "stopped by SIGSEGV" in line
    assert "2 other ranks failed or stopped after it" in line
    line, status = summary({3: failure(1, 7)})
    assert status == 7 and "rank 3" in line and "exited with status 7" in line and "other" not in line
