"""Point-to-point exchanges, safe under NCCL's rules by construction.

NCCL (unlike gloo, which buffers) gives point-to-point operations these rules, and the trainer is written to them:

- a send completes only once the peer has posted the matching receive (no buffering of 8-64 MB activations);
- the operations of one process group run in the order a rank posts them (one stream per communicator), and a pair's
  messages in one direction are matched in posting order (NCCL has no tags);
- the operations posted together through `batch_isend_irecv` run as one group: its sends and receives progress
  together, so a rank that sends to a neighbour while receiving from it cannot wait on itself;
- the first use of a communicator must be a call in which all its ranks take part (`batch_isend_irecv`'s note), so
  every group that carries point-to-point traffic is initialised by one collective first (`init_p2p_group`).

Every exchange here is therefore one `batch_isend_irecv` (Megatron-Core's default, `batch_p2p_comm`), and the callers
(the pipeline schedules in `pipeline.py`, the CP ring in `context.py`) post them in an order that is deadlock-free
under those rules: tests/nccl_model.py models the rules on gloo and on threads, and the tests run every schedule
through it (and show that the previous stand-alone isend-then-irecv exchanges hang under it).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass
class Pending:
    """A posted exchange: `wait()` returns the receive buffers, in the order they were asked for."""

    works: list = field(default_factory=list)
    buffers: list[Tensor] = field(default_factory=list)
    keep: list[Tensor] = field(default_factory=list)  # the send tensors, alive until the sends complete

    def wait(self) -> list[Tensor]:
        for w in self.works:
            w.wait()
        self.works, self.keep = [], []
        return self.buffers


def post(sends: list[tuple[Tensor, int]], recvs: list[tuple[Tensor, int]], group: Any) -> Pending:
    """Post `sends` ((tensor, global peer rank)) and `recvs` ((buffer, global peer rank)) as ONE batch on `group`.
    Several messages to one peer in one direction are matched in list order on both sides."""
    sends = [(t.contiguous(), peer) for t, peer in sends]
    ops = ([dist.P2POp(dist.isend, t, peer, group) for t, peer in sends]
           + [dist.P2POp(dist.irecv, buf, peer, group) for buf, peer in recvs])
    works = dist.batch_isend_irecv(ops) if ops else []
    return Pending(list(works), [buf for buf, _ in recvs], [t for t, _ in sends])


def exchange(sends: list[tuple[Tensor, int]], recvs: list[tuple[Tensor, int]], group: Any) -> list[Tensor]:
    """`post` and wait: the receive buffers."""
    return post(sends, recvs, group).wait()


def init_p2p_group(group: Any, device: torch.device) -> None:
    """One collective on a group that will carry point-to-point batches, so that its communicator exists before
    the first batch (which may involve only some of its ranks). Collective: every rank of the group calls it."""
    if group is not None:
        dist.all_reduce(torch.zeros(1, device=device), group=group)
