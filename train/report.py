"""continue-pretrain's one-line errors said once per job, not once per rank (issue 37).

A bad flag value or a checkpoint that does not match the flags is found alike on every rank at start-up; each rank
writing its own `shardkit: error: ...` line gave N copies of it. `report_error` elects the first rank to reach a given
line through the job's key-value store (one `add` on a key named after the line, the launch attempt and the job):
that rank writes it, the others stay silent, and a line only some ranks find (a file missing on one node, "lost
contact" naming its rank) is still written once per distinct line. The store is torchrun's agent store (it lives as
long as the job, whichever rank died first), else the rendezvous store `train.loop.init_distributed` kept; without one
(one SLURM task per rank failing before the rendezvous) every rank writes its line, as before.

Under torchrun each failing rank also writes TORCHELASTIC_ERROR_FILE (torch.distributed.elastic's error file, the one
`@record` writes), so torchrun's failure summary names the error instead of "To enable traceback see ...", marked as
already said: `python -m shardkit.torchrun` (shardkit/torchrun.py) then ends in no further line and no traceback.

No torch import here: argparse's errors (shardkit/cli.py) are reported before the trainer is imported."""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import sys
import time

STORE = None  # set by train.loop.init_distributed: the rendezvous store, kept after the process groups are destroyed
STORE_TIMEOUT_S = 10.0  # connecting to torchrun's agent store (node 0); one that does not answer: every rank says it
HOLD_S = 3.0  # rank 0 hosting the rendezvous store waits at most this long for the other ranks to have reported
MARK = "shardkit_reported"  # in the error file: the line was written by a rank (shardkit/torchrun.py says no more)


def several_ranks(env=os.environ) -> bool:
    """A rank of a job of several (torchrun's or SLURM's environment)?"""
    world = (env.get("WORLD_SIZE") or env.get("SLURM_NTASKS")) if "RANK" in env or "SLURM_PROCID" in env else None
    return bool(world and world.isdigit() and int(world) > 1)


def _store():
    """The job's store: kept from the rendezvous, else a client of torchrun's agent store; None without either."""
    if STORE is not None:
        return STORE
    env = os.environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or not env.get("MASTER_ADDR") \
            or not env.get("MASTER_PORT", "").isdigit():
        return None
    import torch.distributed as dist

    return dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False,
                         timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S))


def _job() -> str:
    env = os.environ
    return f"{env.get('TORCHELASTIC_RUN_ID', '')}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def first_to_say(line: str) -> bool:
    """True on the one rank of the job that is first to say `line` (every process that is not a rank of several)."""
    if not several_ranks():
        return True
    key = "shardkit/said/" + hashlib.sha1(f"{_job()}\0{line}".encode()).hexdigest()
    try:
        store = _store()
        if store is None:
            return True
        first = store.add(key, 1) == 1
        store.add("shardkit/reported/" + _job(), 1)  # what rank 0 waits for before its store goes (hold_store)
        return first
    except Exception:  # noqa: BLE001 - no store to agree through: say it (N copies rather than none)
        return True


def hold_store() -> None:
    """Without torchrun's agent store the rendezvous store lives in rank 0's process: rank 0 stays until every rank
    has reported (or HOLD_S), so that no other rank's `add` meets a store already gone (it would then say the line
    too, after a c10 warning and stack)."""
    env = os.environ
    if STORE is None or env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" or env.get("RANK") != "0" \
            or not several_ranks():
        return
    world = int(env.get("WORLD_SIZE", "1"))
    deadline = time.monotonic() + HOLD_S
    try:
        while STORE.add("shardkit/reported/" + _job(), 0) < world and time.monotonic() < deadline:
            time.sleep(0.02)
    except Exception:  # noqa: BLE001 - the store is gone already: nothing to hold
        pass


def write_error_file(line: str) -> None:
    """torch.distributed.elastic's error file for this rank (TORCHELASTIC_ERROR_FILE, set by torchrun's agent): the
    line as the failure's message, read by torchrun's summary, with MARK for shardkit/torchrun.py."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}},
            MARK: True}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        pass  # the summary then says what torchrun says without it


def report_error(line: str) -> None:
    """Write `line` (one line, `shardkit: error: ...`) to stderr if this rank is the first of the job to say it; the
    error file either way."""
    line = line.rstrip("\n")
    if first_to_say(line):
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    write_error_file(line)
    hold_store()
