"""Expert parallelism: each EP rank holds E/EP experts, and tokens travel to their experts by all-to-all.

Applied to the plain model from outside, like tensor parallelism: `apply_expert_parallel` replaces each MoE layer's
`mlp.experts` (the dropless loop over all E experts in train/model.py) with `ExpertParallelExperts`, which holds this
rank's experts only, under the same parameter names (`mlp.experts.experts.linear_fc1.weight`, now [E/EP, 2F, h]).
Its shard is the one the sharding table gives the rank (RankCoord.ep), so loading and saving stay `read_local` and
region writes. At EP = 1 nothing is replaced.

Dispatch (Megatron's alltoall token dispatcher, dropless, variable split sizes):
  1. every (token, top-k slot) pair is sorted by its expert: pairs for one EP rank are then contiguous;
  2. the per-expert counts are exchanged (an all-to-all of E integers), so every rank knows what it receives;
  3. the token rows go out with `all_to_all_single` (in_splits: rows per destination, out_splits: rows per source);
  4. the received rows, grouped by source rank then local expert, are regrouped by local expert and run through
     their experts (two grouped GEMMs for all local experts, `torch._grouped_mm`, or a loop where it is refused);
  5. the outputs go back by the inverse all-to-all, are weighted by the router and summed per token.
The all-to-all is an autograd function whose backward is the all-to-all with the splits swapped.

Expert tensor parallelism (ETP > 1: each expert's ffn split over the expert-TP group, the table's etp coordinate):
after step 3 the received rows are all-gathered over the expert-TP group (variable sizes), every rank runs all of
them through its ffn slice, and the partial outputs are reduce-scattered back before step 5, as Megatron's alltoall
dispatcher does with tp_size > 1. Each rank routes its own tokens (its sequence-parallel slice under TP), and the
groups are Megatron's (checkpoint.run_layout: etp-ep-edp-pp over the TP x CP x DP ranks of a stage), so ETP may differ
from TP (DeepSeek-V3's recipe: TP 2, ETP 1).

`--moe-token-dispatcher-type allgather` (Megatron's MoEAllGatherTokenDispatcher) swaps in `AllGatherExperts`: the
tokens, router weights and routing of the expert TP x EP group are all-gathered, each rank runs the tokens routed to
its experts, and the partial outputs are reduce-scattered back.

Host reads (issue 32): every dispatcher reads ONE tensor of counts to the host per MoE layer per forward (the splits of
the all-to-alls, the expert-TP sizes and the rows of each local expert together, as megatron-core reads its
tokens-per-expert once per layer); counts are taken with scatter_add, not bincount (whose CUDA kernel reads the input's
max back), and nothing else waits for the device. The forward that activation recompute re-runs in the backward pass
takes the counts its first run read (`HostCounts`). At EP 1 the trainer's `LocalExperts` replaces the model's loop over
the experts (one data-dependent `torch.where` per expert) with the same loop over one sort.
"""
from __future__ import annotations

import collections
import dataclasses
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from checkpoint.config import ModelConfig
from checkpoint.layout import Layout, RankCoord
from checkpoint.sharding import regions
from checkpoint.families import model_specs
from train.model import Experts, GroupedMLP, MoELayer

from . import comm


def _size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


class CommTimer:
    """Seconds spent in the all-to-alls (forward and backward; waiting for slower peers included)."""

    def __init__(self) -> None:
        self.seconds = 0.0


def _all_to_all_single(x: Tensor, out_splits: list[int], in_splits: list[int], group, timer: CommTimer | None
                       ) -> Tensor:
    t0 = time.perf_counter()
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    if timer is not None:
        timer.seconds += time.perf_counter() - t0
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, out_splits: list[int], in_splits: list[int], group, timer) -> Tensor:
        ctx.splits, ctx.group, ctx.timer = (out_splits, in_splits), group, timer
        return _all_to_all_single(x, out_splits, in_splits, group, timer)

    @staticmethod
    def backward(ctx, g: Tensor):
        out_splits, in_splits = ctx.splits
        return _all_to_all_single(g, in_splits, out_splits, ctx.group, ctx.timer), None, None, None, None


def all_to_all(x: Tensor, out_splits: list[int], in_splits: list[int], group, timer: CommTimer | None = None
               ) -> Tensor:
    """Rows of x [sum(in_splits), ...] go to the group's ranks in order, in_splits[r] rows to rank r; returns the
    sum(out_splits) rows received, out_splits[r] from rank r. Differentiable (backward: the splits swapped)."""
    if _size(group) == 1:
        return x
    return _AllToAll.apply(x, out_splits, in_splits, group, timer)


def exchange_counts(counts: Tensor, group, timer: CommTimer | None = None) -> Tensor:
    """counts [E] (rows this rank sends to each expert, experts in EP-rank blocks) -> [EP, E/EP]: row r holds what
    rank r sends to each of this rank's experts."""
    ep = _size(group)
    n = counts.numel() // ep
    return _all_to_all_single(counts, [n] * ep, [n] * ep, group, timer).view(ep, -1)


def expert_counts(indices: Tensor, n: int) -> Tensor:
    """How many of `indices` (int64, any shape) hold each value 0..n-1, as int64 [n], on their device: bincount's
    numbers without its CUDA kernel's read of the input's max to the host."""
    flat = indices.reshape(-1)
    return torch.zeros(n, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


def _recomputing() -> bool:
    """Inside a backward pass: activation recompute is re-running a forward (train.moe keeps its statistics alike)."""
    return torch._C._current_graph_task_id() != -1


def _checkpointed() -> bool:
    """Saved-tensor hooks are on: this forward runs under activation checkpointing (torch.utils.checkpoint's
    non-reentrant mode packs through them), so the backward pass will re-run it. Where torch lacks the query: True
    (HostCounts.clear then bounds what is kept)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is None or top(False) is not None


class HostCounts:
    """A dispatcher's one host read per forward. The counts of a checkpointed forward are kept until the backward
    pass's recompute of that forward (per module, in the order of the forwards: 1F1B and the interleaved schedule run
    each chunk's backward passes in their forwards' order) takes them back instead of reading the device again;
    `clear` at the start of each step (train.moe.MoETraining does) drops those of a step that raised."""

    def __init__(self) -> None:
        self.pending: collections.deque[list[int]] = collections.deque()

    def read(self, counts: Tensor) -> list[int]:
        if _recomputing() and self.pending:
            return self.pending.popleft()
        out = counts.tolist()  # the one device-to-host read
        if torch.is_grad_enabled() and not _recomputing() and _checkpointed():
            self.pending.append(out)
        return out

    def clear(self) -> None:
        self.pending.clear()


class LocalExperts(nn.Module):
    """EP 1 (every expert on this rank): model.Experts' dropless loop over the experts in index order, each expert's
    (token, slot) pairs in token order, the same operations in the same order (so the same numbers), but the pairs come
    from one stable sort of the routing and one host read of the per-expert counts instead of a data-dependent
    `torch.where` per expert. Holds the model's own GroupedMLP (the same parameters and names)."""

    def __init__(self, experts: Experts) -> None:
        super().__init__()
        self.num_experts = experts.num_experts
        self.experts = experts.experts
        self.host_counts = HostCounts()

    def forward(self, x: Tensor, weights: Tensor, indices: Tensor) -> Tensor:
        k = indices.shape[1]
        order = torch.argsort(indices.reshape(-1), stable=True)  # (token, slot) pairs by expert, then token order
        token, slot = order // k, order % k
        counts = self.host_counts.read(expert_counts(indices, self.num_experts))
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            t, s = token[start:start + n], slot[start:start + n]
            start += n
            y = self.experts(x.index_select(0, t), e) * weights[t, s, None]
            out.index_add_(0, t, y.to(out.dtype))
        return out


class ExpertParallelExperts(nn.Module):
    """This rank's experts (E/EP of them, each with its expert-TP share of the ffn) and the all-to-all dispatch, over
    the EP group and the expert-TP group (same call signature as model.Experts)."""

    def __init__(self, cfg: ModelConfig, layout: Layout, group, ep_rank: int, etp_group=None, etp_rank: int = 0
                 ) -> None:
        super().__init__()
        self.num_experts = cfg.num_moe_experts
        # the global experts [first, first + num_local) this rank holds and its share of their ffn: its box in the
        # table (one pipeline stage: every stage's expert tensors split alike)
        lay = Layout(tp=layout.tp, ep=layout.ep, etp=layout.etp)
        fc2 = next(s for s in model_specs(cfg, lay) if s.expert and s.name.endswith("linear_fc2.weight"))
        box = regions(fc2, lay, RankCoord(ep=ep_rank, etp=etp_rank), cfg.num_layers)[0]
        axis = int(fc2.per_layer)
        self.first, self.num_local = box.global_offset[axis], box.shape[axis]
        self.group, self.etp_group = group, etp_group
        self.experts = GroupedMLP(dataclasses.replace(cfg, num_moe_experts=self.num_local,
                                                      moe_ffn_hidden_size=box.shape[-1]))
        self.timer = CommTimer()
        self.host_counts = HostCounts()
        self.grouped_mm = hasattr(torch, "_grouped_mm")  # private API: used while it works, else the loop

    def forward(self, x: Tensor, weights: Tensor, indices: Tensor) -> Tensor:
        k, ep, nl, etp = indices.shape[1], _size(self.group), self.num_local, _size(self.etp_group)
        flat = indices.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert, hence by EP rank
        token = order // k
        counts = expert_counts(flat, self.num_experts)
        recv_counts = exchange_counts(counts, self.group, self.timer) if ep > 1 else counts.view(1, nl)  # [ep, nl]
        row_counts = recv_counts
        if etp > 1:
            # expert TP (Megatron's dispatcher with tp_size > 1): the expert-TP ranks hold other slices of the same
            # experts' ffn, so each gathers the rows the others received (all-gather of variable sizes), runs all of
            # them through its slice, and the partial outputs are summed back to the rank that received each row
            # (reduce-scatter); both as all-to-alls, whose backward is the adjoint collective. The counts of every
            # expert-TP rank first, so that one host read below carries them all
            n = recv_counts.numel()
            row_counts = _all_to_all_single(recv_counts.reshape(-1).repeat(etp), [n] * etp, [n] * etp,
                                            self.etp_group, self.timer).view(etp * ep, nl)
        # the one host read: rows to each EP rank, rows from each, and rows per (expert-TP source, EP source, local
        # expert)
        host = self.host_counts.read(torch.cat([counts.view(ep, nl).sum(1), recv_counts.sum(1),
                                                row_counts.reshape(-1)]))
        in_splits, out_splits, rc = host[:ep], host[ep:2 * ep], host[2 * ep:]
        recv = all_to_all(x.index_select(0, token), out_splits, in_splits, self.group, self.timer)
        rows = recv
        if etp > 1:
            sizes = [sum(rc[j * ep * nl:(j + 1) * ep * nl]) for j in range(etp)]
            mine = recv.shape[0]
            rows = all_to_all(recv.repeat(etp, 1), sizes, [mine] * etp, self.etp_group, self.timer)
        # rows: by (expert-TP source,) EP source rank, then local expert; regroup by local expert
        local = torch.repeat_interleave(torch.arange(nl, device=x.device).repeat(row_counts.shape[0]),
                                        row_counts.reshape(-1), output_size=sum(rc))
        perm = torch.argsort(local, stable=True)
        grouped = rows.index_select(0, perm)
        # with no rows for any local expert, the (empty) received rows themselves go back: the return all-to-all must
        # stay in the autograd graph on every rank, or the peers' backward all-to-all waits for this rank forever
        per_expert = [sum(rc[e::nl]) for e in range(nl)]
        y = self._run_experts(grouped, per_expert) if grouped.shape[0] else grouped
        y = y.index_select(0, torch.argsort(perm))  # back to the received order
        if etp > 1:
            y = all_to_all(y, [mine] * etp, sizes, self.etp_group, self.timer).view(etp, mine, x.shape[-1]).sum(0)
        back = all_to_all(y, in_splits, out_splits, self.group, self.timer)  # [T*k, h] in `order`
        back = back * weights.reshape(-1)[order].unsqueeze(-1)
        return torch.zeros_like(x).index_add_(0, token, back.to(x.dtype))

    def _run_experts(self, rows: Tensor, counts: list[int]) -> Tensor:
        """rows grouped by local expert (counts[e] for expert e) through their experts: two grouped GEMMs for all of
        them when torch has them for these shapes and dtype, else one expert at a time (same numbers)."""
        if self.grouped_mm:
            try:
                return grouped_swiglu(self.experts, rows, counts)
            except torch.OutOfMemoryError:
                raise
            except RuntimeError as e:  # e.g. alignment or dtype the kernel does not take: loop from now on
                self.grouped_mm = False
                warnings.warn(f"expert GEMMs: torch._grouped_mm refused ({str(e).splitlines()[0]}); running the "
                              "local experts one at a time", stacklevel=2)
        return torch.cat([self.experts(r, e) for e, r in enumerate(rows.split(counts)) if r.shape[0]])


class _GatherTokens(torch.autograd.Function):
    """Forward: the group's tokens and router weights, all-gathered along the rows (rank order); backward: their
    gradients reduce-scattered, always both and in this order on every rank."""

    @staticmethod
    def forward(ctx, x: Tensor, weights: Tensor, group, timer: CommTimer) -> tuple[Tensor, Tensor]:
        ctx.group, ctx.timer = group, timer
        t0 = time.perf_counter()
        out = comm._all_gather(x, group, 0), comm._all_gather(weights, group, 0)
        timer.seconds += time.perf_counter() - t0
        ctx.like = [torch.empty_like(t, device="meta") for t in out]  # shapes of an unused output's zero gradient
        return out

    @staticmethod
    def backward(ctx, gx: Tensor | None, gw: Tensor | None):
        t0 = time.perf_counter()
        out = [comm._reduce_scatter(torch.zeros(like.shape, dtype=like.dtype) if g is None else g, ctx.group, 0)
               for g, like in zip((gx, gw), ctx.like)]
        ctx.timer.seconds += time.perf_counter() - t0
        return out[0], out[1], None, None


class _ReduceScatterTokens(torch.autograd.Function):
    """Forward: partial outputs of the group's tokens summed, each rank keeping its own rows; backward: all-gather."""

    @staticmethod
    def forward(ctx, y: Tensor, group, timer: CommTimer) -> Tensor:
        ctx.group, ctx.timer = group, timer
        t0 = time.perf_counter()
        out = comm._reduce_scatter(y, group, 0)
        timer.seconds += time.perf_counter() - t0
        return out

    @staticmethod
    def backward(ctx, g: Tensor):
        t0 = time.perf_counter()
        out = comm._all_gather(g.contiguous(), ctx.group, 0)
        ctx.timer.seconds += time.perf_counter() - t0
        return out, None, None


class AllGatherExperts(ExpertParallelExperts):
    """Megatron's allgather token dispatcher (MoEAllGatherTokenDispatcher): the tokens, router weights and routing of
    the expert TP x EP group are all-gathered, every rank runs the gathered tokens routed to its experts through its
    slice of them, and the partial outputs are reduce-scattered back to the ranks the tokens came from. Same experts
    and parameters as the all-to-all dispatcher (`group`: the expert TP x EP group)."""

    def forward(self, x: Tensor, weights: Tensor, indices: Tensor) -> Tensor:
        xs, ws = _GatherTokens.apply(x, weights, self.group, self.timer)
        with torch.no_grad():
            t0 = time.perf_counter()
            idx = comm._all_gather(indices, self.group, 0)
            self.timer.seconds += time.perf_counter() - t0
        nl, k = self.num_local, idx.shape[1]
        local = idx - self.first
        # (token, slot) pairs of the local experts grouped by expert (in token order within one), the others last
        key = torch.where((local >= 0) & (local < nl), local, nl).reshape(-1)
        order = torch.argsort(key, stable=True)
        counts = self.host_counts.read(expert_counts(key, nl + 1))[:nl]  # the one host read
        pairs = order[:sum(counts)]
        token, slot = pairs // k, pairs % k
        rows = xs.index_select(0, token)
        # no pair for any local expert: the (empty) rows still join the graph, so that the backward collectives run
        y = self._run_experts(rows, counts) if rows.shape[0] else rows
        y = y * ws[token, slot].unsqueeze(-1)
        out = torch.zeros_like(xs).index_add_(0, token, y.to(xs.dtype))
        return _ReduceScatterTokens.apply(out, self.group, self.timer)


def grouped_swiglu(mlp: GroupedMLP, rows: Tensor, counts: list[int]) -> Tensor:
    """SwiGLU experts over rows grouped by expert, as two grouped GEMMs (`torch._grouped_mm`: one kernel per GEMM for
    all experts on GPUs that have it, torchtitan's MoE path; on CPU the same numbers as the per-expert loop)."""
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)  # on the host: the counts are host numbers already
    if rows.device.type == "cuda":  # an asynchronous copy from pinned memory: no wait on the GPU per layer
        offs = offs.pin_memory().to(rows.device, non_blocking=True)
    gate, up = torch._grouped_mm(rows, mlp.linear_fc1.weight.transpose(1, 2), offs=offs).chunk(2, dim=-1)
    return torch._grouped_mm(F.silu(gate) * up, mlp.linear_fc2.weight.transpose(1, 2), offs=offs)


def moe_layers(model: nn.Module) -> list[tuple[str, MoELayer]]:
    """(name, module) of every MoE layer of a (stage) model: decoder layers and MTP layers."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, MoELayer)]


DISPATCHERS = ("alltoall", "allgather")


def apply_expert_parallel(model: nn.Module, cfg: ModelConfig, layout: Layout, group, ep_rank: int, etp_group=None,
                          etp_rank: int = 0, dispatcher: str = "alltoall", etp_ep_group=None) -> None:
    """Swap every MoE layer's experts for this rank's share (E/EP experts, the expert-TP slice of their ffn) with
    the all-to-all dispatch, or with `dispatcher` "allgather" the all-gather one over `etp_ep_group` (call on the meta
    device, before the model is materialised, so no rank allocates other ranks' experts). When neither group splits
    the experts, each layer keeps its experts (the same parameters) behind `LocalExperts`' loop (one host read)."""
    if dispatcher not in DISPATCHERS:
        raise ValueError(f"unknown token dispatcher {dispatcher!r}; expected one of {DISPATCHERS}")
    if _size(group) == 1 and _size(etp_group) == 1:
        for _, layer in moe_layers(model):
            if type(layer.experts) is Experts:
                layer.experts = LocalExperts(layer.experts)
        return
    for _, layer in moe_layers(model):
        if isinstance(layer.experts, Experts):
            layer.experts = (ExpertParallelExperts(cfg, layout, group, ep_rank, etp_group, etp_rank)
                             if dispatcher == "alltoall" else
                             AllGatherExperts(cfg, layout, etp_ep_group, ep_rank, None, etp_rank))
