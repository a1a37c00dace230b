"""Deterministic crash points for the fault-injection tests.

`SHARDKIT_FAULT_AT=<site>:<n>[@<rank>][!stop][,...]` kills this process with SIGKILL (no cleanup, no `finally`, exactly
what kill -9 or a node loss does) the n-th time (1-based) it reaches `fault_point(<site>)`; with `@<rank>` only the
process whose RANK environment variable equals <rank>; with `!stop` it freezes instead (SIGSTOP: a hung rank, alive
but silent); with `!hang` it blocks there for good, says so on stderr, and still runs its signal handlers (a write to a
filesystem that stopped answering: the job's SIGTERM is caught, and only SLURM's SIGKILL after KillWait ends it).
Unset, as always outside the tests, a site costs one environment lookup.

Sites (where a crash is most likely to break an invariant):
    chunk           a chunk of a conversion / reshard / torch_dist import, or a torch_dist rank file of an export,
                    was recorded durable (writer.py, convert/torch_dist_io.py)
    chunk.unrecorded  chunks (rank files) are durable, the resume log does not record them yet
    rank.done       one rank of several wrote and recorded its share of the chunks (or rank files), not yet reported
    rank.committed  rank 0 committed a multi-rank conversion, the other ranks not yet told (convert/distributed.py)
    hf.shard        one safetensors shard of an HF export (mcore-to-hf) is durable in the export's work directory,
                    not yet reported to rank 0 (convert/mcore_to_hf.py)
    atomic.tmp      a small file's temporary copy is durable, not yet renamed over the old one (commit.py)
    commit.begin    every array is written; the manifest is not (commit.py)
    commit.rename   the new iteration is durable under its temporary name (commit.py)
    commit.swapped  the new iteration is in place; the old one (same iteration) not yet removed (commit.py)
    commit.latest   the new iteration is in place; `latest` still names the previous one (commit.py)
    storage.objects an iteration's objects are on the object store, its manifest.json is not (checkpoint/storage.py)
    storage.manifest  its manifest.json is on the store too; `latest` there still names the previous iteration
    store.write     an array region is handed to tensorstore (every writer, and every rank of a training save)
    collective      a rank enters an all-reduce (a training step: gradients, loss, norm)
"""
from __future__ import annotations

import os
import signal

ENV = "SHARDKIT_FAULT_AT"
_hits: dict[str, int] = {}


def fault_point(site: str) -> None:
    """Die here (SIGKILL) when SHARDKIT_FAULT_AT asks for this site at this count (and rank)."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    _hits[site] = n = _hits.get(site, 0) + 1
    for item in spec.split(","):
        item, _, mode = item.strip().partition("!")
        name, _, rest = item.partition(":")
        count, _, rank = rest.partition("@")
        if name == site and count.isdigit() and int(count) == n and (not rank or rank == os.environ.get("RANK")):
            if mode == "hang":
                import sys
                import time

                print(f"{ENV}: {site}:{n} hangs here (rank {os.environ.get('RANK', '0')})", file=sys.stderr,
                      flush=True)
                while True:
                    time.sleep(3600)
            os.kill(os.getpid(), signal.SIGSTOP if mode == "stop" else signal.SIGKILL)
