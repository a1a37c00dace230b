"""Mixed-precision AdamW with the optimizer state sharded over data parallelism (ZeRO-1), and the LR schedule.

Sharding is by whole parameters: each local parameter (one layer's shard of a canonical tensor) is owned by one DP
rank, chosen by a deterministic greedy balance of bytes. The owner keeps the fp32 main copy and AdamW's moments and
updates it; the new value is broadcast to the other DP ranks. Because a parameter's optimizer state lives whole on one
rank, saving it in the canonical (reshardable) form is a plain write of that parameter's region, with no gather.

Gradients accumulate in fp32 (`main_grad`, views into one flat buffer per rank) through post-accumulate hooks, are
averaged over DP in one all-reduce, summed over TP for sequence-parallel norm weights, and over the first/last
pipeline stages for tied embeddings; then the global norm is clipped across every group, counting each element once.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from train.parallel import comm
from train.parallel.groups import Groups


@dataclass(frozen=True)
class OptimizerConfig:
    lr: float = 3e-4
    min_lr: float = 0.0
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0


@dataclass(frozen=True)
class SchedulerConfig:
    lr: float
    min_lr: float
    warmup_iters: int
    decay_iters: int  # iterations over which the lr decays (Megatron's --lr-decay-iters, default train_iters)
    style: str = "cosine"  # cosine | linear | constant | wsd
    wsd_decay_iters: int = 0  # wsd: length of the final decay phase (default 10% of decay_iters)


def lr_at(it: int, s: SchedulerConfig) -> float:
    """Learning rate for (0-based) iteration `it`: linear warmup to `lr`, then the chosen decay to `min_lr`
    (Megatron's OptimizerParamScheduler, warmup starting at lr * 1/warmup)."""
    if s.warmup_iters > 0 and it < s.warmup_iters:
        return s.lr * (it + 1) / s.warmup_iters
    if s.style == "constant":
        return s.lr
    if it >= s.decay_iters:
        return s.min_lr
    if s.style == "wsd":
        decay = s.wsd_decay_iters or max(1, s.decay_iters // 10)
        start = s.decay_iters - decay
        if it < start:
            return s.lr
        ratio = (it - start) / decay
        return s.min_lr + (s.lr - s.min_lr) * (1.0 - ratio)
    span = max(1, s.decay_iters - s.warmup_iters)
    ratio = (it - s.warmup_iters) / span
    if s.style == "linear":
        coeff = 1.0 - ratio
    elif s.style == "cosine":
        coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
    else:
        raise ValueError(f"--lr-decay-style {s.style!r}: expected cosine, linear, constant or wsd")
    return s.min_lr + coeff * (s.lr - s.min_lr)


def owners(sizes: list[int], dp: int) -> list[int]:
    """Greedy, deterministic assignment of parameters (by element count, in order) to DP ranks."""
    load = [0] * dp
    out = []
    for n in sizes:
        r = min(range(dp), key=lambda i: (load[i], i))
        out.append(r)
        load[r] += n
    return out


class DistributedOptimizer:
    """AdamW over fp32 main params, each owned by one DP rank. `counted[i]` says whether parameter i's gradient
    elements count toward the global norm on this rank (TP-replicated tensors count on TP rank 0 only, the tied
    embedding copy of the last stage does not count).

    Expert parameters (`expert`: names; expert parallelism) are different on each EP rank and replicated only over
    the expert-data-parallel group: their gradients (the tail of the flat buffer) are summed over that group and
    divided by the same DP x CP size as the rest (each expert already received the tokens of its whole EP group),
    and each is owned by one rank of that group, so every expert element counts once in the global norm."""

    def __init__(self, params: list[tuple[str, nn.Parameter]], groups: Groups, cfg: OptimizerConfig,
                 replicated: set[str], tied_copy: set[str], tied_embeddings: bool = False,
                 expert: frozenset[str] | set[str] = frozenset()) -> None:
        self.names = [n for n, _ in params]
        self.params = [p for _, p in params]
        self.groups = groups
        self.cfg = cfg
        self.tied_copy = tied_copy
        # first and last stage each hold the tied embedding; their gradients are summed (pp > 1 only)
        self.tied_embeddings = tied_embeddings and groups.dims.pp > 1 and (groups.first_stage or groups.last_stage)
        self.steps = 0  # optimizer steps taken (AdamW's bias-correction step), saved in train_state.json
        numel = [p.numel() for p in self.params]
        self.buffer = torch.zeros(sum(numel), dtype=torch.float32, device=self.params[0].device if self.params else None)
        self.expert = [n in expert for n in self.names]
        dense_idx = [i for i, e in enumerate(self.expert) if not e]
        expert_idx = [i for i, e in enumerate(self.expert) if e]
        offset = 0
        for i in dense_idx + expert_idx:  # expert gradients last: their own reduction group
            p, n = self.params[i], numel[i]
            p.main_grad = self.buffer[offset: offset + n].view_as(p)  # type: ignore[attr-defined]
            offset += n
            p.register_post_accumulate_grad_hook(_accumulate)
        n_dense = sum(numel[i] for i in dense_idx)
        self.dense_buffer, self.expert_buffer = self.buffer[:n_dense], self.buffer[n_dense:]
        self.owner = [0] * len(self.params)
        for idx, size in ((dense_idx, groups.dims.dp), (expert_idx, groups.dims.edp)):
            for i, o in zip(idx, owners([numel[i] for i in idx], size)):
                self.owner[i] = o
        # CP ranks hold the same parameters and, after the DP x CP reduction, the same gradients: CP rank 0 counts
        self.counted = [not (n in replicated and groups.tp_rank != 0) and n not in tied_copy and groups.cp_rank == 0
                        for n in self.names]
        for i in expert_idx:  # one owner in the expert-data-parallel group (which spans DP x CP)
            self.counted[i] = not (self.names[i] in replicated and groups.tp_rank != 0)
        mine = [i for i in range(len(self.params)) if self.is_mine(i)]
        # fp32 parameters are their own main copy (Megatron does the same for fp32 training): no second copy and no
        # copy back after the step; bf16 parameters get an fp32 main copy
        self.main = {i: _main_copy(self.params[i]) for i in mine}
        decay, no_decay = [], []
        for i in mine:
            (no_decay if self.params[i].ndim == 1 or self.names[i].endswith(".bias") else decay).append(self.main[i])
        self.opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps, fused=True)

    # -- gradients ----------------------------------------------------------------------------------------------
    def zero_grad(self) -> None:
        self.buffer.zero_()
        for p in self.params:
            p.grad = None

    def reduce_grads(self, micro_batches_total: int | None = None) -> None:
        g = self.groups
        # context parallelism: each CP rank's loss is its share of the sequence times cp (context.prepare_micro_batch),
        # so averaging over DP x CP sums the CP shares and averages over DP
        if g.dims.dp * g.dims.cp > 1:
            comm.all_reduce(self.dense_buffer, g.dp_cp if g.dims.cp > 1 else g.dp)
            self.dense_buffer.div_(g.dims.dp * g.dims.cp)
            if self.expert_buffer.numel():  # the same on every rank of the group (one pipeline stage)
                comm.all_reduce(self.expert_buffer, g.edp)
                self.expert_buffer.div_(g.dims.dp * g.dims.cp)
        for p in self.params:
            if getattr(p, "sequence_parallel", False):
                comm.all_reduce(p.main_grad, g.tp)
        if self.tied_embeddings:
            for n, p in zip(self.names, self.params):
                if n == "embedding.word_embeddings.weight":
                    comm.all_reduce(p.main_grad, g.embedding)

    def clip(self) -> float:
        """Scale gradients so that their global L2 norm is at most clip_grad; returns the norm before clipping."""
        g = self.groups
        sq = torch.zeros((), dtype=torch.float64, device=self.buffer.device)
        for i, p in enumerate(self.params):
            if self.counted[i] and self.is_mine(i):
                sq += torch.linalg.vector_norm(p.main_grad).double() ** 2  # fp32 per tensor, as Megatron
        if dist.is_initialized() and g.dims.world > 1:
            dist.all_reduce(sq)
        norm = math.sqrt(float(sq))
        if self.cfg.clip_grad > 0 and norm > self.cfg.clip_grad:
            self.buffer.mul_(self.cfg.clip_grad / (norm + 1e-6))
        return norm

    # -- update -------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, lr: float) -> None:
        for group in self.opt.param_groups:
            group["lr"] = lr
        for i, main in self.main.items():
            main.grad = self.params[i].main_grad
        self.opt.step()
        self.steps += 1
        for i, main in self.main.items():
            if main.data_ptr() != self.params[i].data_ptr():
                self.params[i].copy_(main)
            main.grad = None
        self._broadcast_from_owners()

    def _broadcast_from_owners(self) -> None:
        g = self.groups
        for r in range(g.dims.edp):
            idx = [i for i, o in enumerate(self.owner) if o == r and self.expert[i]]
            if idx and g.edp is not None:
                self._broadcast(idx, g.edp_ranks[r], g.edp, r != g.edp_rank)
        if g.dims.dp == 1:
            return
        for r in range(g.dims.dp):
            idx = [i for i, o in enumerate(self.owner) if o == r and not self.expert[i]]
            if not idx:
                continue
            flat = torch.cat([self.params[i].detach().reshape(-1) for i in idx])
            dist.broadcast(flat, src=g.dims.rank(tp=g.tp_rank, cp=g.cp_rank, dp=r, pp=g.pp_rank), group=g.dp)
            if r != g.dp_rank:
                off = 0
                for i in idx:
                    p = self.params[i]
                    p.data.copy_(flat[off: off + p.numel()].view_as(p))
                    off += p.numel()

    def _broadcast(self, idx: list[int], src: int, group, receive: bool) -> None:
        flat = torch.cat([self.params[i].detach().reshape(-1) for i in idx])
        dist.broadcast(flat, src=src, group=group)
        if receive:
            off = 0
            for i in idx:
                p = self.params[i]
                p.data.copy_(flat[off: off + p.numel()].view_as(p))
                off += p.numel()

    # -- state ----------------------------------------------------------------------------------------------------
    def is_mine(self, i: int) -> bool:
        """Whether this rank owns parameter i (holds its main copy and moments, writes it on save)."""
        g = self.groups
        return self.owner[i] == (g.edp_rank if self.expert[i] else g.dp_rank)

    def owned(self) -> list[int]:
        return sorted(self.main)

    def state_of(self, i: int) -> dict[str, Tensor]:
        """fp32_param / exp_avg / exp_avg_sq of an owned parameter (zeros before the first step)."""
        main = self.main[i]
        st = self.opt.state.get(main, {})
        zeros = torch.zeros_like(main)
        return {"fp32_param": main, "exp_avg": st.get("exp_avg", zeros), "exp_avg_sq": st.get("exp_avg_sq", zeros)}

    @torch.no_grad()
    def load_state(self, i: int, values: dict[str, Tensor], step: int) -> None:
        self.steps = step
        main = self.main[i]
        main.copy_(values["fp32_param"])
        if step > 0:
            moment = lambda t: t.to(device=main.device, dtype=torch.float32, copy=True)  # noqa: E731
            self.opt.state[main] = {"step": torch.tensor(float(step), device=main.device),  # fused AdamW
                                    "exp_avg": moment(values["exp_avg"]),
                                    "exp_avg_sq": moment(values["exp_avg_sq"])}



def _main_copy(p: Tensor) -> Tensor:
    """The fp32 tensor AdamW updates for parameter p: p's own storage when p is fp32, else an fp32 copy."""
    return p.detach() if p.dtype == torch.float32 else p.detach().float().clone()


def _accumulate(p: Tensor) -> None:
    p.main_grad.add_(p.grad.float())  # type: ignore[attr-defined]
    p.grad = None
