"""Interleaved pipeline parallelism (`--vpp N`): Megatron's interleaved 1F1B schedule.

Each pipeline rank holds N model chunks; chunk v of rank r is virtual stage v*pp + r, so a micro-batch goes around
the pipeline N times and the bubble shrinks by N. The order of work on each rank is Megatron's (warm-up forwards,
steady one-forward-one-backward, cool-down backwards), listed by `schedule` as pure data and then executed:

    forward k  -> micro-batch group k // (pp*N), chunk (k % (pp*N)) // pp, micro-batch (k // (pp*N))*pp + k % pp
    backward k -> the same, chunk counted from the last

Communication is Megatron-Core's batched one (`pipeline.comm_plan`): after each warm-up forward one batch sends its
output and receives the next unit's input; in the steady state a forward and a backward form one unit, followed by
one batch that sends both results and receives both inputs of the next unit (send_forward_backward_recv_forward_
backward); the cool-down backwards like the warm-up. Everything travels on the pipeline group, in an order that
tests/test_pipeline_schedule.py proves deadlock-free under NCCL's rules (train/parallel/p2p.py) for pp 2-8, vpp 1-5.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor

from checkpoint.errors import ConfigError

from .groups import Groups
from .pipeline import Op, forward_units, run


def _warmup(pp: int, vpp: int, pp_rank: int, num_micro: int) -> int:
    total = num_micro * vpp
    return total if num_micro == pp else min(total, (pp - pp_rank - 1) * 2 + (vpp - 1) * pp)


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

    warmup = _warmup(pp, vpp, pp_rank, num_micro)
    out = [op(k, True) for k in range(warmup)]
    for i in range(total - warmup):
        out += [op(warmup + i, True), op(i, False)]
    out += [op(k, False) for k in range(total - warmup, total)]
    return out


def units(pp: int, vpp: int, pp_rank: int, num_micro: int) -> list[list[Op]]:
    """`schedule` as the units its batches go between: warm-up forwards one by one, the steady state's forward and
    backward together, the cool-down backwards one by one."""
    ops = schedule(pp, vpp, pp_rank, num_micro)
    warmup = _warmup(pp, vpp, pp_rank, num_micro)
    steady = len(ops) // 2 - warmup  # forward-backward pairs
    mid = range(warmup, warmup + 2 * steady, 2)
    return [[o] for o in ops[:warmup]] + [ops[i:i + 2] for i in mid] + [[o] for o in ops[warmup + 2 * steady:]]


class InterleavedPipeline:
    """Runs StageStep chunks in the interleaved order; the same (ids, labels, ...) micro-batches on every stage."""

    def __init__(self, step: Any, groups: Groups, num_micro: int, device: torch.device) -> None:
        self.step, self.g, self.device = step, groups, device
        self.pp, self.vpp, self.rank = groups.dims.pp, groups.dims.vpp, groups.pp_rank
        schedule(self.pp, self.vpp, self.rank, num_micro)  # the flags' error now, not at the first step

    def forward_backward(self, micro_batches: Sequence[tuple], act_shape: tuple[int, ...],
                         act_dtype: torch.dtype) -> Tensor:
        """Forward and backward over the micro-batches; gradients accumulate into the parameters. Returns the summed
        (unscaled) micro-batch loss on the rank holding the last chunk, 0 elsewhere."""
        return run(self.step, units(self.pp, self.vpp, self.rank, len(micro_batches)), micro_batches, act_shape,
                   act_dtype, self.device)

    @torch.no_grad()
    def forward_only(self, micro_batches: Sequence[tuple], act_shape: tuple[int, ...],
                     act_dtype: torch.dtype) -> Tensor:
        """Evaluation: each micro-batch goes around the pipeline vpp times; the summed loss on the last chunk's rank."""
        return run(self.step, forward_units(self.vpp, len(micro_batches)), micro_batches, act_shape, act_dtype,
                   self.device)
