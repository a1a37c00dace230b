"""Mixed-precision AdamW with the optimizer state sharded over data parallelism (ZeRO-1), and the LR schedule.

Sharding is by whole parameters: each local parameter (one layer's shard of a canonical tensor) is owned by one DP
rank, chosen by a deterministic greedy balance of bytes. The owner keeps the fp32 main copy and AdamW's moments and
updates it; the new value is broadcast to the other DP ranks. Because a parameter's optimizer state lives whole on one
rank, saving it in the canonical (reshardable) form is a plain write of that parameter's region, with no gather.

Gradients accumulate in fp32 (`main_grad`, views into one flat buffer per rank) through post-accumulate hooks (a
parameter's first gradient of a step is copied in, later ones added: the buffer is never cleared as a whole), are
averaged over DP in one all-reduce, summed over TP for sequence-parallel norm weights, and over the first/last
pipeline stages for tied embeddings; then the global norm is clipped across every group, counting each element once.

The LR / weight-decay schedule is megatron-core's OptimizerParamScheduler (lr_at, wd_at, ParamScheduler): counted in
samples, built with step(0), advanced by the global batch after each optimizer step.
"""
from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from checkpoint.errors import ConfigError
from train.parallel import comm
from train.parallel.groups import Groups


@dataclass(frozen=True)
class OptimizerConfig:
    lr: float = 3e-4
    min_lr: float = 0.0
    weight_decay: float = 0.01  # Megatron-LM's default (0.1 before issue 41)
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0


LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")
WD_INCR_STYLES = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class SchedulerConfig:
    """megatron-core's OptimizerParamScheduler arguments. Steps count samples (Megatron-LM's
    get_optimizer_param_scheduler: iterations x global batch, or the --*-samples flags as given); the scheduler
    advances by the global batch after each optimizer step."""

    max_lr: float
    min_lr: float
    lr_warmup_steps: float  # a float with --lr-warmup-fraction (fraction x lr_decay_steps), as in Megatron
    lr_decay_steps: int
    lr_decay_style: str = "linear"
    init_lr: float = 0.0  # --lr-warmup-init
    start_wd: float = 0.1
    end_wd: float = 0.1
    wd_incr_steps: int = 1
    wd_incr_style: str = "constant"
    wsd_decay_steps: int | None = None
    lr_wsd_decay_style: str = "exponential"


def lr_at(num_steps: float, s: SchedulerConfig) -> float:
    """The learning rate megatron-core's OptimizerParamScheduler.get_lr gives after `num_steps` samples (same
    operations in the same order, so the same float). The LR applied to iteration k (1-based) of a run is
    lr_at((k - 1) * global_batch, s)."""
    max_lr, min_lr = float(s.max_lr), s.min_lr
    if s.lr_warmup_steps > 0 and num_steps <= s.lr_warmup_steps:
        return s.init_lr + ((max_lr - s.init_lr) * float(num_steps) / float(s.lr_warmup_steps))
    if s.lr_decay_style == "constant":
        return max_lr
    if num_steps > s.lr_decay_steps:
        return min_lr
    if s.lr_decay_style == "inverse-square-root":
        warmup_steps = max(s.lr_warmup_steps, 1)
        steps = max(num_steps, 1)
        return max(min_lr, max_lr * warmup_steps ** 0.5 / (steps ** 0.5))
    decay_ratio = float(num_steps - s.lr_warmup_steps) / float(s.lr_decay_steps - s.lr_warmup_steps)
    delta_lr = max_lr - min_lr
    if s.lr_decay_style == "linear":
        coeff = 1.0 - decay_ratio
    elif s.lr_decay_style == "cosine":
        coeff = 0.5 * (math.cos(math.pi * decay_ratio) + 1.0)
    elif s.lr_decay_style == "WSD":
        anneal_start = s.lr_decay_steps - s.wsd_decay_steps
        if num_steps <= anneal_start:
            coeff = 1.0
        else:
            ratio = float(num_steps - anneal_start) / float(s.wsd_decay_steps)
            if s.lr_wsd_decay_style == "linear":
                coeff = 1.0 - ratio
            elif s.lr_wsd_decay_style == "cosine":
                coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
            elif s.lr_wsd_decay_style == "exponential":
                coeff = (2.0 * math.pow(0.5, ratio)) - 1.0
            elif s.lr_wsd_decay_style == "minus_sqrt":
                coeff = 1.0 - math.sqrt(ratio)
            else:
                raise ValueError(f"--lr-wsd-decay-style {s.lr_wsd_decay_style!r}: expected one of "
                                 f"{', '.join(WSD_DECAY_STYLES)}")
    else:
        raise ValueError(f"--lr-decay-style {s.lr_decay_style!r}: expected one of {', '.join(LR_DECAY_STYLES)}")
    return min_lr + coeff * delta_lr


def wd_at(num_steps: float, s: SchedulerConfig) -> float:
    """The weight decay megatron-core's OptimizerParamScheduler.get_wd gives after `num_steps` samples (applied to
    the parameters that decay; biases and 1-D parameters get 0, Megatron's wd_mult)."""
    if num_steps > s.wd_incr_steps:
        return s.end_wd
    if s.wd_incr_style == "constant":
        return s.end_wd
    incr_ratio = float(num_steps) / float(s.wd_incr_steps)
    if s.wd_incr_style == "linear":
        coeff = incr_ratio
    elif s.wd_incr_style == "cosine":
        coeff = 0.5 * (math.cos(math.pi * (1 - incr_ratio)) + 1.0)
    else:
        raise ValueError(f"--weight-decay-incr-style {s.wd_incr_style!r}: expected one of {', '.join(WD_INCR_STYLES)}")
    return s.start_wd + coeff * (s.end_wd - s.start_wd)


def applied_at(iteration: int, global_batch: int, s: SchedulerConfig) -> tuple[float, float]:
    """(lr, weight decay) applied to the optimizer step of `iteration` (1-based) of a run that started at
    iteration 1 with this schedule: the scheduler's values after (iteration - 1) x global_batch samples."""
    n = (iteration - 1) * global_batch
    return lr_at(n, s), wd_at(n, s)


# Megatron's OptimizerParamScheduler.state_dict keys (= SchedulerConfig fields) checked on load, in its order, and the
# flags that set them (with num_steps: checkpoint.megatron.MEGATRON_SCHEDULER_KEYS, is_scheduler_state)
SCHEDULER_STATE = (
    ("max_lr", "--lr"),
    ("min_lr", "--min-lr"),
    ("lr_warmup_steps", "--lr-warmup-iters/-samples/-fraction"),
    ("lr_decay_steps", "--lr-decay-iters/-samples (default --train-iters/-samples)"),
    ("lr_decay_style", "--lr-decay-style"),
    ("start_wd", "--start-weight-decay (constant: --weight-decay)"),
    ("end_wd", "--end-weight-decay (constant: --weight-decay)"),
    ("wd_incr_steps", "--train-iters/--train-samples"),
    ("wd_incr_style", "--weight-decay-incr-style"),
)
OVERRIDE_FLAG = "--override-opt_param-scheduler"
USE_CHECKPOINT_FLAG = "--use-checkpoint-opt_param-scheduler"


class ParamScheduler:
    """megatron-core's OptimizerParamScheduler on a SchedulerConfig: `lr` and `wd` are what its step() writes into
    the optimizer's param groups, i.e. what the next optimizer step applies. Built with step(0) (LR = init_lr at the
    first iteration), advanced by the global batch after each optimizer step. state_dict/load_state_dict have
    Megatron's keys and checks (`_check_and_set`), in Megatron's order: on load, num_steps is applied (and lr/wd
    recomputed) after the LR fields are settled and before the weight-decay fields are, so with
    --use-checkpoint-opt_param-scheduler and a different weight-decay schedule on the command line the first resumed
    step takes the command line's weight decay, exactly as Megatron-LM does."""

    def __init__(self, cfg: SchedulerConfig) -> None:
        self.cfg = cfg
        self.num_steps = 0
        self.lr = self.wd = 0.0
        self.step(0)

    def step(self, increment: int) -> None:
        self.num_steps += increment
        self.lr = lr_at(self.num_steps, self.cfg)
        self.wd = wd_at(self.num_steps, self.cfg)

    def state_dict(self) -> dict:
        """Megatron's OptimizerParamScheduler.state_dict(): the same keys and values."""
        c = self.cfg
        return {"max_lr": float(c.max_lr), "lr_warmup_steps": c.lr_warmup_steps, "num_steps": self.num_steps,
                "lr_decay_style": c.lr_decay_style, "lr_decay_steps": c.lr_decay_steps, "min_lr": c.min_lr,
                "start_wd": c.start_wd, "end_wd": c.end_wd, "wd_incr_style": c.wd_incr_style,
                "wd_incr_steps": c.wd_incr_steps}

    def load_state_dict(self, sd: dict, override: bool = False, use_checkpoint: bool = False,
                        source: str = "the checkpoint", num_steps: int | None = None) -> list[str]:
        """Megatron's load_state_dict: by default every field must equal the command line's (else ConfigError, one
        line naming the field, both values and the two flags); `override` keeps the command line's,
        `use_checkpoint` takes the checkpoint's. `num_steps` (with override: the consumed samples, as Megatron-LM
        resynchronises them) replaces the checkpoint's step count. Returns the notes to log."""
        if override and use_checkpoint:
            raise ConfigError(f"{OVERRIDE_FLAG} and {USE_CHECKPOINT_FLAG}: give at most one")
        values = asdict(self.cfg)
        notes, differ = [], []

        def check_and_set(key: str, flag: str) -> None:
            mine, theirs = values[key], sd[key]
            if override or mine == theirs:
                return
            if use_checkpoint:
                notes.append(f"{key} {theirs!r} from {source} (the command line's {mine!r} ignored)")
                values[key] = theirs
                return
            unit = " samples" if key.endswith("_steps") else ""
            differ.append(f"{key} {mine!r}{unit} from {flag} differs from {theirs!r}{unit} in {source}")

        for key, flag in SCHEDULER_STATE[:5]:
            check_and_set(key, flag)
        self._fail(differ)
        # Megatron steps here, before the weight-decay fields are set: lr from the settled fields, wd from the
        # command line's
        self.cfg = SchedulerConfig(**values)
        self.num_steps = 0
        self.step(int(sd["num_steps"]) if num_steps is None else num_steps)
        for key, flag in SCHEDULER_STATE[5:]:
            check_and_set(key, flag)
        self._fail(differ)
        self.cfg = SchedulerConfig(**values)  # the next step() uses the settled weight-decay fields
        if override:
            notes.append(f"{OVERRIDE_FLAG}: the command line's schedule replaces the one in {source}")
        return notes

    @staticmethod
    def _fail(differ: list[str]) -> None:
        if differ:
            raise ConfigError(f"the LR/WD schedule differs from the checkpoint's: {'; '.join(differ)}; pass "
                              f"{OVERRIDE_FLAG} to take the command line or {USE_CHECKPOINT_FLAG} to take the "
                              "checkpoint's")


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
        # per parameter: main_grad holds this step's gradient (else stale: copy, not add, the first one in)
        self._filled = [False] * len(self.params)
        self._end_queued = False  # _fill_missing is queued to run when the current backward pass ends
        for i in dense_idx + expert_idx:  # expert gradients last: their own reduction group
            p, n = self.params[i], numel[i]
            p.main_grad = self.buffer[offset: offset + n].view_as(p)  # type: ignore[attr-defined]
            offset += n
            p.register_post_accumulate_grad_hook(functools.partial(self._accumulate, i))
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
        """Start a step. The buffer is not cleared (a 4-bytes-per-parameter write each step): each parameter's first
        gradient is copied into its main_grad, later ones added (0 + g is g), and when a backward pass ends, the
        parameters it gave no gradient (an expert no token reached) are zeroed."""
        self._filled = [False] * len(self._filled)
        self._end_queued = False  # a backward pass that raised never ran its queued callback
        for p in self.params:
            p.grad = None

    def _accumulate(self, j: int, p: Tensor) -> None:
        """Post-accumulate-grad hook of parameter j (p): move p.grad into p.main_grad."""
        if self._filled[j]:
            p.main_grad.add_(p.grad)  # type: ignore[attr-defined] - in fp32, without an fp32 copy of a bf16 grad
        else:
            p.main_grad.copy_(p.grad)  # type: ignore[attr-defined]
            self._filled[j] = True
        p.grad = None
        if not self._end_queued:
            self._end_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._fill_missing)

    def _fill_missing(self) -> None:
        """Zero the main_grad of every parameter that has had no gradient yet this step (at the end of a backward
        pass, and before the gradients are reduced, should no backward pass have run)."""
        self._end_queued = False
        for j, done in enumerate(self._filled):
            if not done:
                self.params[j].main_grad.zero_()  # type: ignore[attr-defined]
                self._filled[j] = True

    def reduce_grads(self, micro_batches_total: int | None = None) -> None:
        self._fill_missing()
        g = self.groups
        # context parallelism: each CP rank's loss is its share of the sequence times cp (context.prepare_micro_batch),
        # so averaging over DP x CP sums the CP shares and averages over DP
        if g.dims.dp * g.dims.cp > 1:
            comm.all_reduce(self.dense_buffer, g.dp_cp if g.dims.cp > 1 else g.dp)
            self.dense_buffer.div_(g.dims.dp * g.dims.cp)
        # (the expert-data-parallel group may also span TP ranks when the expert TP size is smaller than TP)
        if self.expert_buffer.numel() and (g.dims.edp > 1 or g.dims.dp * g.dims.cp > 1):
            comm.all_reduce(self.expert_buffer, g.edp)  # the same on every rank of the group (one pipeline stage)
            self.expert_buffer.div_(g.dims.dp * g.dims.cp)
        for p in self.params:
            if getattr(p, "tp_partial_grad", False):  # train/parallel/tensor.py mark_partial_grads
                comm.all_reduce(p.main_grad, g.tp)
        if self.tied_embeddings:
            for n, p in zip(self.names, self.params):
                if n == "embedding.word_embeddings.weight":
                    comm.all_reduce(p.main_grad, g.embedding)

    def clip(self) -> float:
        """Scale gradients so that their global L2 norm is at most clip_grad; returns the norm before clipping."""
        norm = math.sqrt(float(self.grad_norm_sq()))
        self.clip_to(norm)
        return norm

    def grad_norm_sq(self) -> Tensor:
        """The squared global L2 norm of the gradients, summed over every rank (each element counted once): a float64
        0-dim tensor on the device, not read to the host here (the trainer reads it with the step's other values)."""
        g = self.groups
        sq = torch.zeros((), dtype=torch.float64, device=self.buffer.device)
        for i, p in enumerate(self.params):
            if self.counted[i] and self.is_mine(i):
                sq += torch.linalg.vector_norm(p.main_grad).double() ** 2  # fp32 per tensor, as Megatron
        if dist.is_initialized() and g.dims.world > 1:
            dist.all_reduce(sq)
        return sq

    def clip_to(self, norm: float) -> None:
        """Scale the gradients by clip_grad / (norm + 1e-6) when `norm` (their global norm) exceeds clip_grad."""
        if self.cfg.clip_grad > 0 and norm > self.cfg.clip_grad:
            self.buffer.mul_(self.cfg.clip_grad / (norm + 1e-6))

    # -- update -------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, lr: float, weight_decay: float | None = None) -> None:
        """One AdamW step at `lr`; `weight_decay` (the scheduler's, None: --weight-decay) applies to the decaying
        group, the other (biases, 1-D parameters) stays at 0 (Megatron's wd_mult 0)."""
        wd = self.cfg.weight_decay if weight_decay is None else weight_decay
        for group, mult in zip(self.opt.param_groups, (1.0, 0.0)):
            group["lr"] = lr
            group["weight_decay"] = wd * mult
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
