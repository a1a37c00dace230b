"""Collectives as autograd functions (Megatron's mappings): each forward collective has its adjoint in backward.

    copy_to_tp        forward: identity           backward: all-reduce     (input of a column-parallel linear)
    reduce_from_tp    forward: all-reduce         backward: identity       (output of a row-parallel linear)
    gather_seq        forward: all-gather (seq)   backward: reduce-scatter (sequence parallel: column input)
    reduce_scatter_seq forward: reduce-scatter    backward: all-gather     (sequence parallel: row output)
    split_seq         forward: keep own chunk     backward: all-gather

gloo has no reduce-scatter; there it is an all-reduce followed by taking this rank's chunk (same numbers).
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
    n = _size(group)
    if n == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _reduce_scatter(x: Tensor, group, dim: int) -> Tensor:
    n = _size(group)
    if n == 1:
        return x
    if x.shape[dim] % n:
        raise ValueError(f"reduce-scatter: dim {dim} of size {x.shape[dim]} is not divisible by {n}")
    rank = dist.get_rank(group)
    if dist.get_backend(group) == "nccl":
        parts = list(x.contiguous().chunk(n, dim=dim))
        out = torch.empty_like(parts[rank])
        dist.reduce_scatter(out, [p.contiguous() for p in parts], group=group)
        return out
    x = x.contiguous().clone()
    dist.all_reduce(x, group=group)
    return x.chunk(n, dim=dim)[rank].contiguous()


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


def gather_seq(x: Tensor, group) -> Tensor:
    return x if _size(group) == 1 else _GatherSeq.apply(x, group)


def reduce_scatter_seq(x: Tensor, group) -> Tensor:
    return x if _size(group) == 1 else _ReduceScatterSeq.apply(x, group)


def split_seq(x: Tensor, group) -> Tensor:
    return x if _size(group) == 1 else _SplitSeq.apply(x, group)
