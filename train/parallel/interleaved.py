"""Interleaved pipeline parallelism (`--vpp N`): Megatron's interleaved 1F1B schedule.

Each pipeline rank holds N model chunks; chunk v of rank r is virtual stage v*pp + r, so a micro-batch goes around
the pipeline N times and the bubble shrinks by N. The order of work on each rank is Megatron's (warm-up forwards,
steady one-forward-one-backward, cool-down backwards), listed by `schedule` as pure data and then executed:

    forward k  -> micro-batch group k // (pp*N), chunk (k % (pp*N)) // pp, micro-batch (k // (pp*N))*pp + k % pp
    backward k -> the same, chunk counted from the last

Activations travel on one process group and gradients on another (both spanning this rank's pipeline), so a pair
of ranks that exchange both (pp = 2, or the wrap-around from the last rank to the first) can never match a gradient
with an activation receive: within one group and direction, messages are sent and received in the same order.
Sends are non-blocking and only waited for at the end; receives block just before the work that needs them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from checkpoint.errors import ConfigError

from .groups import Groups


@dataclass(frozen=True)
class Op:
    forward: bool
    chunk: int
    micro_batch: int


def schedule(pp: int, vpp: int, pp_rank: int, num_micro: int) -> list[Op]:
    """This rank's ordered work for one step (Megatron's interleaved 1F1B; all forwards first when num_micro == pp)."""
    if num_micro % pp:
        raise ConfigError(f"--vpp {vpp}: the interleaved schedule needs the micro-batches per step ({num_micro} = "
                          f"global batch / (micro batch x data parallel)) to be a multiple of --pp {pp}")
    total = num_micro * vpp

    def op(k: int, forward: bool) -> Op:
        group, within = divmod(k, pp * vpp)
        chunk = within // pp
        return Op(forward, chunk if forward else vpp - 1 - chunk, group * pp + within % pp)

    warmup = total if num_micro == pp else min(total, (pp - pp_rank - 1) * 2 + (vpp - 1) * pp)
    out = [op(k, True) for k in range(warmup)]
    for i in range(total - warmup):
        out += [op(warmup + i, True), op(i, False)]
    out += [op(k, False) for k in range(total - warmup, total)]
    return out


def channels(groups: Groups) -> tuple[Any, Any]:
    """(activation group, gradient group) of this rank's pipeline. Collective: every rank calls it, in step."""
    dims = groups.dims
    mine: tuple[Any, Any] = (None, None)
    for tp in range(dims.tp):
        for cp in range(dims.cp):
            for dp in range(dims.dp):
                ranks = [dims.rank(tp, cp, dp, p) for p in range(dims.pp)]
                pair = (dist.new_group(ranks), dist.new_group(ranks))
                if groups.rank in ranks:
                    mine = pair
    return mine


def _send(t: Tensor, dst: int, group: Any) -> tuple[Any, Tensor]:
    """A non-blocking send and the buffer it reads (kept alive until the send is waited for)."""
    t = t.contiguous()
    return dist.isend(t, dst, group=group), t


class InterleavedPipeline:
    """Runs StageStep chunks in the interleaved order; the same (ids, labels, ...) micro-batches on every stage."""

    def __init__(self, step: Any, groups: Groups, num_micro: int, device: torch.device) -> None:
        self.step, self.g, self.device = step, groups, device
        self.pp, self.vpp, self.rank = groups.dims.pp, groups.dims.vpp, groups.pp_rank
        schedule(self.pp, self.vpp, self.rank, num_micro)  # the flags' error now, not at the first step
        self.act_group, self.grad_group = channels(groups)

    # virtual stage s = chunk * pp + rank; neighbours wrap from the last rank to the first
    def _is_first(self, chunk: int) -> bool:
        return chunk == 0 and self.rank == 0

    def _is_last(self, chunk: int) -> bool:
        return chunk == self.vpp - 1 and self.rank == self.pp - 1

    def _next(self) -> int:
        return self.g.pp_ranks[(self.rank + 1) % self.pp]

    def _prev(self) -> int:
        return self.g.pp_ranks[(self.rank - 1) % self.pp]

    def _recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int, group: Any, device) -> Tensor:
        buf = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(buf, src, group=group)
        return buf

    def forward_backward(self, micro_batches: Sequence[tuple], act_shape: tuple[int, ...],
                         act_dtype: torch.dtype) -> Tensor:
        """Forward and backward over the micro-batches; gradients accumulate into the parameters. Returns the summed
        (unscaled) micro-batch loss on the rank holding the last chunk, 0 elsewhere."""
        n = len(micro_batches)
        device = self.device
        total = torch.zeros((), dtype=torch.float32, device=device)
        saved: dict[tuple[int, int], tuple[Tensor | None, Tensor]] = {}
        pending = []
        for op in schedule(self.pp, self.vpp, self.rank, n):
            key = (op.chunk, op.micro_batch)
            if op.forward:
                inp = None
                if not self._is_first(op.chunk):
                    inp = self._recv(act_shape, act_dtype, self._prev(), self.act_group, device).requires_grad_()
                out = self.step(inp, *micro_batches[op.micro_batch], chunk=op.chunk)
                if self._is_last(op.chunk):
                    total = total + out.detach().float()
                    out = out / n
                else:
                    pending.append(_send(out.detach(), self._next(), self.act_group))
                saved[key] = (inp, out)
            else:
                inp, out = saved.pop(key)
                if self._is_last(op.chunk):
                    torch.autograd.backward(out)
                else:
                    grad = self._recv(act_shape, act_dtype, self._next(), self.grad_group, device)
                    torch.autograd.backward(out, grad_tensors=grad)
                if inp is not None:
                    pending.append(_send(inp.grad, self._prev(), self.grad_group))
        for w, _ in pending:
            w.wait()
        return total

    @torch.no_grad()
    def forward_only(self, micro_batches: Sequence[tuple], act_shape: tuple[int, ...],
                     act_dtype: torch.dtype) -> Tensor:
        """Evaluation: each micro-batch goes around the pipeline vpp times; the summed loss on the last chunk's rank."""
        device = self.device
        total = torch.zeros((), dtype=torch.float64, device=device)
        pending = []
        for mb in micro_batches:
            for chunk in range(self.vpp):
                inp = None if self._is_first(chunk) else self._recv(act_shape, act_dtype, self._prev(),
                                                                     self.act_group, device)
                out = self.step(inp, *mb, chunk=chunk)
                if self._is_last(chunk):
                    total += out.double()
                else:
                    pending.append(_send(out, self._next(), self.act_group))
        for w, _ in pending:
            w.wait()
        return total
