"""Pipeline parallelism: a stage runs its part of the model's one forward, and micro-batches run in Megatron's 1F1B
order.

A stage is the plain GPTModel with the parts it does not own removed (`parallelize.apply_pipeline_split`); `StageStep`
composes the model's own pieces (embed, rope, the decoder's layers of one model chunk, token losses, MTP), so the
trainer runs the same code as `GPTModel.forward`. Tensor parallelism lives in those pieces (installed by
`apply_tensor_parallel`), recompute in the layers (`apply_recompute`).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from train.model import GPTModel

from . import p2p
from .groups import Groups


@dataclass
class StageStep:
    """How one stage runs a micro-batch: (input ids or received activations, labels) -> activations or loss."""

    model: GPTModel
    groups: Groups
    attention: Any = None  # context.AttentionState when attention was replaced (CP, packed documents, flash-attn)
    moe: Any = None  # train.moe.MoETraining of an MoE model: adds the MTP loss on the last stage
    chunks: list[list[nn.Module]] = field(init=False)  # the layers of each model chunk, in order

    def __post_init__(self) -> None:
        g, layers = self.groups, self.model.decoder.layers
        layout, n = g.dims.model_parallel, self.model.cfg.num_layers
        self.chunks = [[layers[str(i)] for i in range(*layout.layer_range(n, g.pp_rank, v))]
                       for v in range(g.dims.vpp)]

    def __call__(self, inp: Tensor | None, ids: Tensor, labels: Tensor, extras: Any = None, chunk: int = 0
                 ) -> Tensor:
        """`extras` (context.MicroBatchExtras): RoPE positions, per-token loss weights and the attention layout of a
        CP-split or packed micro-batch; without it positions are 0..s-1 and the loss is the token mean. `chunk`: the
        model chunk to run (0..vpp-1 of an interleaved pipeline, --vpp; 0 without one). The first chunk of the first
        stage embeds `ids`, the others take `inp`; the last chunk of the last stage returns the loss."""
        m, g = self.model, self.groups
        first = g.first_stage and chunk == 0
        last = g.last_stage and chunk == g.dims.vpp - 1
        h = m.embed(ids) if first else inp
        p = next(m.parameters(), None)  # a stage of an uneven split may hold none ("Ett||ttL"): the activations'
        cos, sin = m.rope(ids, None if extras is None else extras.position_ids, h.dtype if p is None else p.dtype)
        att = self.attention
        with contextlib.nullcontext() if att is None or extras is None else att.use(extras.layout):
            h = m.decoder(h, cos, sin, self.chunks[chunk])
        if not last:
            return h
        normed = m.decoder.final_layernorm(h)  # m.token_losses' norm, applied once: the head and MTP both read it
        losses = m.cross_entropy(m.logits(normed), labels)
        loss = losses.mean() if extras is None else (losses * extras.loss_weight).sum()
        if self.moe is not None and m.mtp is not None:  # the MTP layers attend over the same split and documents
            with contextlib.nullcontext() if att is None or extras is None else att.use(extras.layout):
                loss = self.moe.add_mtp_loss(m, loss, normed, ids, labels, extras)
        return loss


# -- schedules as data -------------------------------------------------------------------------------------------------
# A rank's work for one step is a list of units (one forward, one backward, or in the interleaved steady state a
# forward and a backward); after each unit ONE batch of point-to-point operations is posted and waited for: the sends
# of what the unit produced and the receives of what the next unit needs (Megatron-Core's batched schedules:
# send_forward_recv_backward / send_backward_recv_forward in 1F1B, send_forward_backward_recv_forward_backward in the
# interleaved steady state). `comm_plan` writes that down as data; tests/test_pipeline_schedule.py executes the plans
# of every rank under NCCL's rules (p2p.py) for many pp x vpp x micro-batch counts, and `run` executes the same plan.

@dataclass(frozen=True)
class Op:
    forward: bool
    chunk: int
    micro_batch: int


@dataclass(frozen=True)
class Msg:
    """One message between virtual stages: an activation ("act") from stage `stage` to stage + 1, or a gradient
    ("grad") from stage `stage` to stage - 1, of one micro-batch; `peer` is the pipeline rank at the other end."""

    kind: str
    stage: int
    micro_batch: int
    peer: int


@dataclass(frozen=True)
class Step:
    """Run `ops`, then post one batch: send `sends`, receive `recvs`, wait."""

    ops: tuple[Op, ...]
    sends: tuple[Msg, ...]
    recvs: tuple[Msg, ...]


def one_f_one_b(pp: int, rank: int, num_micro: int) -> list[list[Op]]:
    """Megatron's 1F1B as units: (pp - rank - 1) warm-up forwards, one forward and one backward per steady step,
    the remaining backwards."""
    warmup = min(pp - rank - 1, num_micro)
    ops = [Op(True, 0, i) for i in range(warmup)]
    for i in range(num_micro - warmup):
        ops += [Op(True, 0, warmup + i), Op(False, 0, i)]
    ops += [Op(False, 0, i) for i in range(num_micro - warmup, num_micro)]
    return [[o] for o in ops]


def forward_units(vpp: int, num_micro: int) -> list[list[Op]]:
    """Evaluation: each micro-batch through every model chunk of this rank, in order."""
    return [[Op(True, c, m)] for m in range(num_micro) for c in range(vpp)]


def comm_plan(units: list[list[Op]], pp: int, vpp: int, rank: int) -> list[Step]:
    """The batches this rank posts around its units (virtual stage of chunk c = c * pp + rank)."""
    last = pp * vpp - 1

    def needs(o: Op) -> list[Msg]:
        s = o.chunk * pp + rank
        if o.forward:
            return [] if s == 0 else [Msg("act", s - 1, o.micro_batch, (rank - 1) % pp)]
        return [] if s == last else [Msg("grad", s + 1, o.micro_batch, (rank + 1) % pp)]

    def sends(o: Op) -> list[Msg]:
        s = o.chunk * pp + rank
        if o.forward:
            return [] if s == last else [Msg("act", s, o.micro_batch, (rank + 1) % pp)]
        return [] if s == 0 else [Msg("grad", s, o.micro_batch, (rank - 1) % pp)]

    plan = [Step((), (), tuple(m for o in units[0] for m in needs(o)))] if units else []
    for unit, nxt in zip(units, [*units[1:], []]):
        plan.append(Step(tuple(unit), tuple(m for o in unit for m in sends(o)),
                         tuple(m for o in nxt for m in needs(o))))
    return plan


def run(step: StageStep, units: list[list[Op]], micro_batches, act_shape: tuple[int, ...], act_dtype: torch.dtype,
        device: torch.device | None = None) -> Tensor:
    """Execute this rank's units and their batches (`comm_plan`). Forward-only units (evaluation, under no_grad)
    return the summed float64 loss; otherwise gradients accumulate into the parameters, each micro-batch's loss is
    divided by the micro-batch count before backward, and the summed (unscaled) float32 loss is returned. The loss
    is on the rank holding the last virtual stage, 0 elsewhere."""
    g = step.groups
    pp, vpp, rank = g.dims.pp, g.dims.vpp, g.pp_rank
    n = len(micro_batches)
    device = micro_batches[0][0].device if device is None else device  # not a parameter's: a stage may hold none
    training = any(not o.forward for u in units for o in u)
    total = torch.zeros((), dtype=torch.float32 if training else torch.float64, device=device)
    last = pp * vpp - 1
    inbox: dict[tuple[str, int, int], Tensor] = {}  # (kind, from stage, micro-batch) -> received tensor
    outbox: dict[tuple[str, int, int], Tensor] = {}
    saved: dict[tuple[int, int], tuple[Tensor | None, Tensor]] = {}
    for s in comm_plan(units, pp, vpp, rank):
        for o in s.ops:
            stage = o.chunk * pp + rank
            if o.forward:
                inp = None if stage == 0 else inbox.pop(("act", stage - 1, o.micro_batch))
                if inp is not None and training:
                    inp.requires_grad_()
                out = step(inp, *micro_batches[o.micro_batch], chunk=o.chunk)
                if stage == last:
                    total = total + out.detach().to(total.dtype)
                    out = out / n
                else:
                    outbox[("act", stage, o.micro_batch)] = out.detach()
                if training:
                    saved[(o.chunk, o.micro_batch)] = (inp, out)
            else:
                inp, out = saved.pop((o.chunk, o.micro_batch))
                grad = None if stage == last else inbox.pop(("grad", stage + 1, o.micro_batch))
                torch.autograd.backward(out, grad_tensors=grad)
                if inp is not None:
                    outbox[("grad", stage, o.micro_batch)] = inp.grad
        if s.sends or s.recvs:
            got = p2p.exchange([(outbox.pop((m.kind, m.stage, m.micro_batch)), g.pp_ranks[m.peer]) for m in s.sends],
                               [(torch.empty(act_shape, dtype=act_dtype, device=device), g.pp_ranks[m.peer])
                                for m in s.recvs], g.pp)
            for m, t in zip(s.recvs, got):
                inbox[(m.kind, m.stage, m.micro_batch)] = t
    assert not inbox and not outbox and not saved, "pipeline schedule left messages or activations behind"
    return total


def forward_backward(step: StageStep, micro_batches: list[tuple[Tensor, Tensor]], act_shape: tuple[int, ...],
                     act_dtype: torch.dtype) -> Tensor:
    """Forward and backward over `micro_batches` ((ids, labels[, extras]), the same on every stage of a pipeline)
    in the 1F1B order; gradients accumulate into the parameters. Returns the summed (unscaled) loss of the
    micro-batches on the last stage, 0 elsewhere. Each micro-batch loss is divided by their count before backward."""
    g = step.groups
    return run(step, one_f_one_b(g.dims.pp, g.pp_rank, len(micro_batches)), micro_batches, act_shape, act_dtype)


@torch.no_grad()
def forward_only(step: StageStep, micro_batches: list[tuple[Tensor, Tensor]], act_shape: tuple[int, ...],
                 act_dtype: torch.dtype) -> Tensor:
    """Evaluation: forward through the pipeline, micro-batch by micro-batch; the summed loss on the last stage."""
    return run(step, forward_units(step.groups.dims.vpp, len(micro_batches)), micro_batches, act_shape, act_dtype)
