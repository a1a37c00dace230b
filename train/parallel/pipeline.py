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
import torch.distributed as dist
from torch import Tensor, nn

from train.model import GPTModel

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


def _p2p(sends: list[tuple[Tensor, int]], recvs: list[tuple[tuple[int, ...], torch.dtype, int]],
         device: torch.device | None = None) -> list[Tensor]:
    """Post all sends and receives, then wait: a stage that sends forward while its neighbour sends backward can
    never deadlock."""
    reqs, out = [], []
    for t, dst in sends:
        reqs.append(dist.isend(t.contiguous(), dst))
    for shape, dtype, src in recvs:
        buf = torch.empty(shape, dtype=dtype, device=device)
        reqs.append(dist.irecv(buf, src))
        out.append(buf)
    for r in reqs:
        r.wait()
    return out


def forward_backward(step: StageStep, micro_batches: list[tuple[Tensor, Tensor]], act_shape: tuple[int, ...],
                     act_dtype: torch.dtype) -> Tensor:
    """Run forward and backward over `micro_batches` ((ids, labels) pairs, the same on every stage of a pipeline) in
    the 1F1B order; gradients accumulate into the parameters. Returns the summed (unscaled) loss of the
    micro-batches on the last stage, 0 elsewhere. Each micro-batch loss is divided by their count before backward."""
    g = step.groups
    n = len(micro_batches)
    pp, rank = g.dims.pp, g.pp_rank
    first, last = g.first_stage, g.last_stage
    device = micro_batches[0][0].device  # not a parameter's: a stage of an uneven split may hold none
    total = torch.zeros((), dtype=torch.float32, device=device)

    def recv_forward() -> Tensor | None:
        if first:
            return None
        (t,) = _p2p([], [(act_shape, act_dtype, g.prev_rank)], device)
        return t.requires_grad_()

    def fwd(inp: Tensor | None, i: int) -> Tensor:
        nonlocal total
        out = step(inp, *micro_batches[i])
        if last:
            total = total + out.detach().float()
            out = out / n
        return out

    def bwd(inp: Tensor | None, out: Tensor, grad: Tensor | None) -> Tensor | None:
        torch.autograd.backward(out, grad_tensors=None if last else grad)
        return None if inp is None else inp.grad

    warmup = min(pp - rank - 1, n)
    remaining = n - warmup
    saved: list[tuple[Tensor | None, Tensor]] = []
    for i in range(warmup):
        inp = recv_forward()
        out = fwd(inp, i)
        _p2p([(out.detach(), g.next_rank)], [])
        saved.append((inp, out))
    inp = recv_forward() if remaining else None
    for i in range(remaining):
        out = fwd(inp, warmup + i)
        if last:
            grad = None
        else:
            (grad,) = _p2p([(out.detach(), g.next_rank)], [(act_shape, act_dtype, g.next_rank)], device)
        saved.append((inp, out))
        inp0, out0 = saved.pop(0)
        grad_in = bwd(inp0, out0, grad)
        if i == remaining - 1:
            inp = None
            if not first:
                _p2p([(grad_in, g.prev_rank)], [])
        elif first:
            inp = None
        else:
            (inp,) = _p2p([(grad_in, g.prev_rank)], [(act_shape, act_dtype, g.prev_rank)], device)
            inp.requires_grad_()
    for _ in range(warmup):
        inp0, out0 = saved.pop(0)
        (grad,) = _p2p([], [(act_shape, act_dtype, g.next_rank)], device)
        grad_in = bwd(inp0, out0, grad)
        if not first:
            _p2p([(grad_in, g.prev_rank)], [])
    return total


@torch.no_grad()
def forward_only(step: StageStep, micro_batches: list[tuple[Tensor, Tensor]], act_shape: tuple[int, ...],
                 act_dtype: torch.dtype) -> Tensor:
    """Evaluation: forward through the pipeline, micro-batch by micro-batch; the summed loss on the last stage."""
    g = step.groups
    device = micro_batches[0][0].device
    total = torch.zeros((), dtype=torch.float64, device=device)
    for mb in micro_batches:
        inp = None if g.first_stage else _p2p([], [(act_shape, act_dtype, g.prev_rank)], device)[0]
        out = step(inp, *mb)
        if g.last_stage:
            total += out.double()
        else:
            _p2p([(out, g.next_rank)], [])
    return total
