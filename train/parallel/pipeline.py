"""Pipeline parallelism: each stage builds only its layers, and micro-batches run in Megatron's 1F1B order.

A stage is the plain GPTModel with the parts it does not own removed: other stages' layers (the layer dict is keyed
by global index, so names stay global), the embedding (kept on the last stage too when the embeddings are tied or
the MTP layers, which live on the last stage, need it: its gradient is then all-reduced between the first and last
stage), the final norm and the output layer. The model is built on the meta device and materialised after pruning
(and after expert parallelism swapped in the rank's experts), so a rank never allocates another rank's weights.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from checkpoint.config import ModelConfig
from train.model import GPTModel

from .expert import apply_expert_parallel
from .groups import Groups
from .tensor import apply_tensor_parallel, embed, head_loss, head_losses, local_config


def build_stage(cfg: ModelConfig, groups: Groups, dtype: torch.dtype, device: torch.device,
                sequence_parallel: bool, recompute: str | None = None) -> GPTModel:
    """This rank's part of the model, uninitialised (every parameter is then loaded from a checkpoint)."""
    dims = groups.dims
    layout = dims.model_parallel
    layout.check(cfg)
    padded = cfg.padded_vocab_size(dims.tp)
    with torch.device("meta"):
        model = GPTModel(local_config(cfg, dims.tp, padded), padded // dims.tp)
    mine = set().union(*(range(*layout.layer_range(cfg.num_layers, groups.pp_rank, v)) for v in range(dims.vpp)))
    for key in list(model.decoder.layers.keys()):
        if int(key) not in mine:  # (with --vpp the rank's chunks: layers of several ranges)
            del model.decoder.layers[key]
    tied_last = (cfg.tie_word_embeddings or cfg.mtp_num_layers > 0) and groups.last_stage
    if not groups.first_stage and not tied_last:
        model.embedding = None
    if not groups.last_stage:
        model.decoder.final_layernorm = None
        model.output_layer = None
        model.mtp = None
    with torch.device("meta"):
        apply_expert_parallel(model, cfg, groups.ep, groups.ep_rank)
    model = model.to_empty(device=device).to(dtype)
    apply_tensor_parallel(model, groups.tp, sequence_parallel)
    if recompute == "selective":
        for layer in model.decoder.layers.values():
            att = layer.self_attention
            att.core_attention = _recomputed(att.core_attention)
    return model


def _recomputed(fn: Callable) -> Callable:
    def run(*args):
        return checkpoint(fn, *args, use_reentrant=False)

    return run


@dataclass
class StageStep:
    """How one stage runs a micro-batch: (input ids or received activations, labels) -> activations or loss."""

    model: GPTModel
    groups: Groups
    cfg: ModelConfig
    sequence_parallel: bool
    recompute: str | None = None
    attention: Any = None  # context.AttentionState when attention was replaced (CP, packed documents, flash-attn)
    moe: Any = None  # train.moe.MoETraining of an MoE model: adds the MTP loss on the last stage

    def _chunk_layers(self, chunk: int | None) -> list:
        layers = self.model.decoder.layers
        if chunk is None:
            return list(layers.values())
        start, stop = self.groups.dims.model_parallel.layer_range(self.cfg.num_layers, self.groups.pp_rank, chunk)
        return [layers[str(i)] for i in range(start, stop)]

    @property
    def vocab_start(self) -> int:
        return self.groups.tp_rank * (self.cfg.padded_vocab_size(self.groups.dims.tp) // self.groups.dims.tp)

    def __call__(self, inp: Tensor, ids: Tensor, labels: Tensor, extras: Any = None, chunk: int | None = None
                 ) -> Tensor:
        """`extras` (context.MicroBatchExtras): RoPE positions, per-token loss weights and the attention layout of a
        CP-split or packed micro-batch; without it positions are 0..s-1 and the loss is the token mean. `chunk`:
        run only that model chunk of an interleaved pipeline (--vpp); None runs every layer of the stage."""
        m, g = self.model, self.groups
        dtype = next(m.parameters()).dtype
        layers = self._chunk_layers(chunk)
        first = g.first_stage and not chunk
        last = g.last_stage and (chunk is None or chunk == g.dims.vpp - 1)
        if first:
            h = embed(m, ids, g.tp, self.vocab_start, self.sequence_parallel)
        else:
            h = inp
        b, s = ids.shape
        pos = torch.arange(s, device=ids.device)[None, :].expand(b, s) if extras is None else extras.position_ids
        cos, sin = m.rotary_pos_emb(pos, dtype)
        att = self.attention
        # a recomputed layer must see its own micro-batch's attention layout, also under 1F1B
        ckpt = {} if att is None else {"context_fn": att.recompute_context}
        with contextlib.nullcontext() if att is None or extras is None else att.use(extras.layout):
            for layer in layers:
                if self.recompute == "full":
                    h = checkpoint(layer, h, cos, sin, use_reentrant=False, **ckpt)
                else:
                    h = layer(h, cos, sin)
        if not last:
            return h
        hidden, h = h, m.decoder.final_layernorm(h)
        if extras is None:
            loss = head_loss(m, h, labels, g.tp, self.vocab_start, self.cfg.vocab_size, self.sequence_parallel)
        else:
            losses = head_losses(m, h, labels, g.tp, self.vocab_start, self.cfg.vocab_size, self.sequence_parallel)
            loss = (losses * extras.loss_weight).sum()
        if self.moe is not None and m.mtp is not None:
            loss = self.moe.add_mtp_loss(m, loss, hidden, ids, labels)
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
    device = next(step.model.parameters()).device
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
    device = next(step.model.parameters()).device
    total = torch.zeros((), dtype=torch.float64, device=device)
    for mb in micro_batches:
        inp = None if g.first_stage else _p2p([], [(act_shape, act_dtype, g.prev_rank)], device)[0]
        out = step(inp, *mb)
        if g.last_stage:
            total += out.double()
        else:
            _p2p([(out, g.next_rank)], [])
    return total
