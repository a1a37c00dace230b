"""A rank that dies or hangs must not leave the others waiting, nor leave them with a page of traceback.

Every collective runs under `--distributed-timeout-minutes` (gloo/NCCL raise when a peer stops answering; a dead peer
is noticed at once by gloo, which sees its connection reset). `peer_failure` turns such a collective error into one
line saying what happened and where the job can resume from.
"""
from __future__ import annotations

import datetime
import os
import traceback
from pathlib import Path

from checkpoint.errors import ShardkitError


def _in_collective(e: BaseException) -> bool:
    """Raised from inside torch.distributed (a collective, a barrier, the rendezvous store)?"""
    try:
        import torch.distributed as dist

        if isinstance(e, getattr(dist, "DistError", ())):
            return True
    except ImportError:
        return False
    frames = traceback.extract_tb(e.__traceback__)
    return any(f"torch{os.sep}distributed{os.sep}" in f.filename for f in frames)


def peer_failure(e: BaseException, save: str | Path | None) -> ShardkitError | None:
    """One-line error for a failed collective (another rank died or stopped answering); None for anything else."""
    if not isinstance(e, RuntimeError) or not _in_collective(e):
        return None
    rank = os.environ.get("RANK", "0")
    detail = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
    detail = detail.split("] ", 1)[-1][:160]  # drop the C++ source location
    resume = ""
    if save:
        from checkpoint.storage import last_complete, shown  # (--save on object storage: the store's, by URL)

        try:
            resume = f"; rerun to resume from {last_complete(save)}"
        except ShardkitError:
            resume = f"; no complete checkpoint in {shown(save)} yet"
    return ShardkitError(f"rank {rank}: lost contact with another rank ({detail}): a rank died or stopped answering "
                         f"within --distributed-timeout-minutes; stopping this one{resume}")


def bound_every_group(timeout: datetime.timedelta) -> None:
    """Make `timeout` (--distributed-timeout-minutes) bound the collectives of every process group created from now on.

    torch.distributed gives each `new_group` its own default (30 minutes), not the timeout passed to
    init_process_group, and the trainer's TP/PP/DP/CP/EP groups are all `new_group`s: without this a hung rank kept
    the others in an all-reduce for half an hour whatever the flag said."""
    import torch.distributed.distributed_c10d as c10d

    c10d.default_pg_timeout = timeout
    if isinstance(getattr(c10d, "default_pg_nccl_timeout", None), datetime.timedelta):
        c10d.default_pg_nccl_timeout = timeout
