"""Collectives as autograd functions (Megatron's mappings): each forward collective has its adjoint in backward.

    copy_to_tp        forward: identity           backward: all-reduce     (input of a column-parallel linear)
    reduce_from_tp    forward: all-reduce         backward: identity       (output of a row-parallel linear)
    gather_seq        forward: all-gather (seq)   backward: reduce-scatter (sequence parallel: column input)
    reduce_scatter_seq forward: reduce-scatter    backward: all-gather     (sequence parallel: row output)
    split_seq         forward: keep own chunk     backward: all-gather
    gathered_linear   gather_seq then a linear, saving the local shard, not the gathered input, for backward (which
                      gathers it again): megatron-core's LinearWithGradAccumulationAndAsyncCommunication with
                      sequence parallelism; the same arithmetic as gather_seq followed by F.linear

Gathers and reduce-scatters go into preallocated tensors (all_gather_into_tensor, reduce_scatter_tensor), on gloo
and NCCL alike.
All sequence collectives work on dim 1 of [batch, seq, hidden].
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from checkpoint.faults import fault_point

SEQ_DIM = 1


def _size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def all_reduce(x: Tensor, group, op=dist.ReduceOp.SUM) -> Tensor:
    if _size(group) > 1:
        fault_point("collective")  # tests kill a rank here (SHARDKIT_FAULT_AT=collective:N@RANK)
        dist.all_reduce(x, op=op, group=group)
    return x


def _all_gather(x: Tensor, group, dim: int) -> Tensor:
    """Concatenate every rank's x along `dim`, in rank order: one all_gather_into_tensor into a preallocated
    [n, *x.shape] buffer (NCCL's native form; no list of parts and no torch.cat), then a view, or one copy when
    `dim` is not the leading one (a view when the dims before it are 1, e.g. [1, s, h] at micro-batch size 1)."""
    n = _size(group)
    if n == 1:
        return x
    dim %= x.dim()
    out = torch.empty((n * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)  # gloo's shape rule
    dist.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out.view(n, *x.shape).movedim(0, dim).flatten(dim, dim + 1)


def _reduce_scatter(x: Tensor, group, dim: int) -> Tensor:
    """Sum x over the group and keep this rank's 1/n slice along `dim`: one reduce_scatter_tensor from x laid out
    as [n, ...] (a view when the dims before `dim` are 1) into a preallocated output."""
    n = _size(group)
    if n == 1:
        return x
    dim %= x.dim()
    if x.shape[dim] % n:
        raise ValueError(f"reduce-scatter: dim {dim} of size {x.shape[dim]} is not divisible by {n}")
    parts = x.unflatten(dim, (n, x.shape[dim] // n)).movedim(dim, 0).contiguous()
    out = torch.empty(parts.shape[1:], dtype=x.dtype, device=x.device)
    dist.reduce_scatter_tensor(out, parts.flatten(0, 1), group=group)  # [n * out.shape[0], ...]: gloo's shape rule
    return out


def _split(x: Tensor, group, dim: int) -> Tensor:
    n = _size(group)
    if n == 1:
        return x
    return x.chunk(n, dim=dim)[dist.get_rank(group)].contiguous()


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        return all_reduce(g.contiguous().clone(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x.contiguous().clone(), group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather(x, group, SEQ_DIM)

    @staticmethod
    def backward(ctx, g):
        return _reduce_scatter(g, ctx.group, SEQ_DIM), None


class _ReduceScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter(x, group, SEQ_DIM)

    @staticmethod
    def backward(ctx, g):
        return _all_gather(g, ctx.group, SEQ_DIM), None


class _SplitSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, group, SEQ_DIM)

    @staticmethod
    def backward(ctx, g):
        return _all_gather(g, ctx.group, SEQ_DIM), None


def copy_to_tp(x: Tensor, group) -> Tensor:
    return x if _size(group) == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x: Tensor, group) -> Tensor:
    return x if _size(group) == 1 else _ReduceFromTP.apply(x, group)


class _GatheredLinear(torch.autograd.Function):
    """F.linear(all-gather(x) along the sequence, weight, bias), keeping x (this rank's 1/TP of the sequence) for
    backward instead of the gathered input: the column-parallel linears' saved activations shrink by TP."""

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.save_for_backward(x, weight)
        return torch.nn.functional.linear(_all_gather(x, group, SEQ_DIM), weight, bias)

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        total = _all_gather(x, ctx.group, SEQ_DIM)  # gathered again
        g2, t2 = g.reshape(-1, g.shape[-1]), total.reshape(-1, total.shape[-1])
        grad_weight = g2.t().mm(t2) if ctx.needs_input_grad[1] else None
        grad_bias = g2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        grad_x = _reduce_scatter(g.matmul(weight), ctx.group, SEQ_DIM)
        return grad_x, grad_weight, grad_bias, None


def gathered_linear(x: Tensor, weight: Tensor, bias: Tensor | None, group) -> Tensor:
    """gather_seq(x) then F.linear, saving only x for backward (see _GatheredLinear)."""
    if _size(group) == 1:
        return torch.nn.functional.linear(x, weight, bias)
    return _GatheredLinear.apply(x, weight, bias, group)


def gather_seq(x: Tensor, group) -> Tensor:
    return x if _size(group) == 1 else _GatherSeq.apply(x, group)


def reduce_scatter_seq(x: Tensor, group) -> Tensor:
    return x if _size(group) == 1 else _ReduceScatterSeq.apply(x, group)


def split_seq(x: Tensor, group) -> Tensor:
    return x if _size(group) == 1 else _SplitSeq.apply(x, group)
