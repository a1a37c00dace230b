"""Start `shardkit` commands for the tests: one rank, or several as torchrun starts them, forked from one process that
imported torch and shardkit once (tests/fault_zygote.py), instead of a new interpreter per rank plus torchrun's agent.

Importing torch, transformers and shardkit costs each new interpreter ~3 CPU-s; the trainer tests start several
hundred ranks, so forking an interpreter that has only imported them (no thread started yet) takes minutes off the
suite. The children get what torchrun gives its workers: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK,
MASTER_ADDR/PORT and a run id, with the caller's environment at the time of the call; like torchrun's agent, once a
rank has failed the others get a grace period (GRACE_S) to print their own lines and are then killed; the exit status
is the rank's own for one rank and 1 if any rank failed for several (torchrun's). Real torchrun keeps its own tests
(tests/test_train.py::test_real_torchrun, the SLURM scripts, tests/test_scale_out.py); SHARDKIT_TEST_TORCHRUN=1 runs
every launch through it.
"""
from __future__ import annotations

import atexit
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
GRACE_S = 15.0  # after the first rank fails, the others' time to report before they are killed
BASE_ENV = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}  # read once, at interpreter start: the server's


class ForkServer:
    """The fork server: one process that imported everything once and forks the children of each request."""

    def __init__(self, logdir: Path | None = None, env: dict | None = None):
        env = dict(os.environ, **BASE_ENV, PYTHONPATH=str(REPO), **(env or {}))
        env.pop("SHARDKIT_FAULT_AT", None)
        self.proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "fault_zygote.py")], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env, cwd=REPO)
        self.logdir = Path(logdir or tempfile.mkdtemp(prefix="shardkit-forks-"))
        self.n = 0
        self.lock = threading.Lock()

    def request(self, req: dict):
        with self.lock:
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        assert line, "the fork server died"
        return json.loads(line)

    def log(self, tag: str) -> Path:
        self.n += 1
        return self.logdir / f"{self.n}-{tag}.log"

    def run(self, argv: list, fault: str | None = None, kill_after: float | None = None,
            fsize: int | None = None) -> dict:
        """One command; its stdout and stderr together in out["log"]."""
        log = self.log("trial")
        out = self.request({"argv": [str(a) for a in argv], "env": {"SHARDKIT_FAULT_AT": fault} if fault else {},
                            "kill_after": kill_after, "log": str(log), "fsize": fsize})
        out["log"] = log.read_text() if log.exists() else ""
        return out

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)


_server: ForkServer | None = None


def server() -> ForkServer:
    """The session's fork server, started on first use."""
    global _server
    if _server is None or _server.proc.poll() is not None:
        _server = ForkServer()
        atexit.register(_server.close)
    return _server


def exit_worker() -> None:
    """The end of a worker that torch.multiprocessing spawned, after its work succeeded: exit now, without the
    interpreter's shutdown, in which a gloo worker thread still dropping a finished collective's tensors aborts the
    process (torch's ProcessGroupGloo; the trainer's own exit avoids it with train.loop.shutdown_distributed)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(nproc: int, argv: list, timeout: float = 600) -> subprocess.CompletedProcess:
    """`shardkit ARGV` as `nproc` ranks (one plain process for 1), forked from the fork server; stdout and stderr are
    each the ranks' own, in rank order."""
    argv = [str(a) for a in argv]
    cmd = ["shardkit", *argv] if nproc == 1 else ["torchrun(forked)", "--nproc-per-node", str(nproc), "-m", "shardkit",
                                                  *argv]
    env = dict(os.environ, **BASE_ENV)
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
              "TORCHELASTIC_RUN_ID"):
        env.pop(k, None)
    srv = server()
    port = free_port()
    ranks = []
    for r in range(nproc):
        rank_env = dict(env)
        if nproc > 1:
            rank_env.update(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                            GROUP_RANK="0", ROLE_RANK=str(r), ROLE_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1",
                            MASTER_PORT=str(port), TORCHELASTIC_RUN_ID=f"forked-{port}")
        ranks.append({"argv": argv, "env": rank_env, "replace_env": True, "cwd": os.getcwd(),
                      "log": str(srv.log(f"rank{r}-out")), "err": str(srv.log(f"rank{r}-err"))})
    results = srv.request({"group": ranks, "kill_after": timeout, "kill_rest_after_failure": GRACE_S})
    out = "".join(Path(r["log"]).read_text() for r in ranks)
    err = "".join(Path(r["err"]).read_text() for r in ranks)
    for r in ranks:
        for p in (r["log"], r["err"]):
            Path(p).unlink(missing_ok=True)
    codes = [r["rc"] if r["rc"] is not None else -(r["signal"] or 9) for r in results]
    if any(r["seconds"] >= timeout for r in results):
        raise subprocess.TimeoutExpired(cmd, timeout, out, err)
    rc = codes[0] if nproc == 1 else int(any(codes))
    return subprocess.CompletedProcess(cmd, rc, out, err)


def run_torchrun(nproc: int, argv: list, timeout: float = 600) -> subprocess.CompletedProcess:
    """The same through a new interpreter per rank: `python -m shardkit` for one, real torchrun for several."""
    argv = [str(a) for a in argv]
    if nproc == 1:
        cmd = [sys.executable, "-m", "shardkit", *argv]
    else:
        cmd = [str(VENV_BIN / "torchrun"), "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
               "--master-port", str(free_port()), "-m", "shardkit", *argv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=dict(os.environ, **BASE_ENV))


def launch(nproc: int, *args: str, check: bool = True, real: bool = False) -> subprocess.CompletedProcess:
    """`shardkit continue-pretrain ARGS` on `nproc` ranks (gloo); raises with the output on failure when `check`."""
    argv = ["continue-pretrain", *args]
    torchrun = real or os.environ.get("SHARDKIT_TEST_TORCHRUN") == "1"
    r = run_torchrun(nproc, argv) if torchrun else run_ranks(nproc, argv)
    if check and r.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, r.args))} failed ({r.returncode}):\n{r.stdout[-3000:]}\n"
                             f"{r.stderr[-6000:]}")
    return r
