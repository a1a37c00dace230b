"""A process started once that forks one child per fault-injection trial (tests/test_faults.py).

Importing torch, tensorstore and shardkit costs ~1-2 s of CPU per process; forking a process that has only imported
them (no tensorstore or torch threads started yet) costs milliseconds, so dozens of kill -9 trials stay cheap.

Protocol, one JSON object per line: the parent writes {"argv": [...], "env": {...}, "kill_after": seconds | null,
"log": path}; the child runs `shardkit.cli.main(argv)` with `env` added (SHARDKIT_FAULT_AT kills it at a named site),
its stdout and stderr going to `log` (stderr to `err` where given; `replace_env`: `env` is the whole environment;
`cwd`: its working directory); if `kill_after` is set and the child is still running then, it gets SIGKILL;
a child of a multi-rank job (WORLD_SIZE > 1) runs under tests/nccl_model.py (NCCL's point-to-point rules on gloo)
unless SHARDKIT_TEST_NCCL_MODEL=0; `fsize` sets RLIMIT_FSIZE in the child (Python ignores SIGXFSZ, so a write past
it fails with EFBIG: a full disk).
The answer is {"rc": exit status | null, "signal": signal number | null, "seconds": wall time}. {"group": [req, ...]}
forks all its children at once (the ranks of one job) and answers with the list of their results; with
"kill_rest_after_first" the others are killed once the first has ended; with "kill_rest_after_failure": S, S seconds
after the first child that failed (torchrun's agent stops the survivors the same way).
"""
from __future__ import annotations

import json
import os
import resource
import signal
import sys
import time

# what the trials run, imported before any fork (importing starts no threads)
import checkpoint.reader  # noqa: F401
import convert.hf_to_mcore  # noqa: F401
import convert.reshard  # noqa: F401
import shardkit.cli
import torch._dynamo  # noqa: F401 - the model's first initialiser imports it (seconds)
import train.config  # noqa: F401
import train.loop  # noqa: F401
import transformers

import tests.nccl_model

transformers.CONFIG_MAPPING["llama"]  # the model builds its RoPE tables from a transformers config (lazy import)


def run_child(req: dict) -> None:
    """In the forked child: never returns."""
    try:
        if req.get("fsize"):  # a full disk, as far as this process can tell: writes past it fail with EFBIG
            resource.setrlimit(resource.RLIMIT_FSIZE, (req["fsize"], req["fsize"]))
        if req.get("replace_env"):
            os.environ.clear()
        os.environ.update(req.get("env") or {})
        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and os.environ.get("SHARDKIT_TEST_NCCL_MODEL", "1") != "0":
            # every multi-rank run the tests fork runs under NCCL's point-to-point rules
            tests.nccl_model.install(float(os.environ.get("SHARDKIT_TEST_NCCL_MODEL_TIMEOUT", "60")))
        if req.get("cwd"):
            os.chdir(req["cwd"])
        null = os.open(os.devnull, os.O_RDONLY)  # never the server's request pipe
        os.dup2(null, 0)
        fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(os.open(req["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) if req.get("err") else fd, 2)
        sys.argv = ["shardkit", *req["argv"]]
        rc = shardkit.cli.main(req["argv"])
        tests.nccl_model.report()
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
    except BaseException as e:  # noqa: BLE001 - report anything as a failed trial
        print(f"zygote child: {type(e).__name__}: {e}", file=sys.stderr)
        rc = 99
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc or 0)


def _status(status: int, started: float) -> dict:
    return {"rc": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
            "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
            "seconds": round(time.monotonic() - started, 4)}


def main() -> None:
    for line in sys.stdin:
        req = json.loads(line)
        group = req.get("group") or [req]  # several children at once (the ranks of one job)
        started = time.monotonic()
        pids = []
        for one in group:
            pid = os.fork()
            if pid == 0:
                run_child(one)
            pids.append(pid)
        deadline = None if req.get("kill_after") is None else started + float(req["kill_after"])
        results: dict[int, dict] = {}
        failed_at = None
        while len(results) < len(pids):
            for pid in pids:
                if pid in results:
                    continue
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    results[pid] = _status(status, started)
            if req.get("kill_rest_after_first") and pids[0] in results:  # the first has ended: stop the others
                deadline = time.monotonic()
            grace = req.get("kill_rest_after_failure")
            if grace is not None and any(r["rc"] != 0 for r in results.values()):
                failed_at = failed_at or time.monotonic()
                deadline = min(deadline or float("inf"), failed_at + float(grace))
            if deadline is not None and time.monotonic() >= deadline:
                for pid in pids:
                    if pid not in results:
                        os.kill(pid, signal.SIGKILL)
                        results[pid] = _status(os.waitpid(pid, 0)[1], started)
            time.sleep(0.002 if time.monotonic() - started < 2 else 0.02)  # short commands answer at once
        out = [results[pid] for pid in pids]
        sys.stdout.write(json.dumps(out if req.get("group") else out[0]) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
