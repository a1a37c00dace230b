"""Tensor parallelism with sequence parallelism, applied to the plain model from outside (Megatron-LM's scheme).

Each TP rank builds the model from `local_config` (its share of heads, query groups and ffn) and holds exactly the
local shards the sharding table assigns it, so loading is `Checkpoint.read_local`. Then:

- column-parallel linears (linear_qkv, linear_fc1) get `copy_to_tp` (or, with sequence parallelism, the all-gather
  of the sequence) between their fused norm and the matmul;
- row-parallel linears (linear_proj, linear_fc2) get an all-reduce (or a reduce-scatter of the sequence) on their
  output;
- the embedding is vocab-parallel (each rank looks up its rows, the partial results are summed) and the loss is a
  vocab-parallel cross-entropy that never gathers the logits.

With sequence parallelism the residual stream between those points is split along the sequence, so the norms see
a slice of the tokens: their gradients are partial and are all-reduced over TP (params marked `sequence_parallel`).
"""
from __future__ import annotations

import dataclasses
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from checkpoint.config import ModelConfig
from checkpoint.errors import LayoutError

from . import comm


def local_config(cfg: ModelConfig, tp: int, padded_vocab: int) -> ModelConfig:
    """The model one TP rank builds: heads, query groups, ffn and the padded vocab divided by tp. The RoPE tables
    come from the global HF config, which is kept."""
    if tp == 1:
        return dataclasses.replace(cfg, vocab_size=padded_vocab)
    if cfg.is_moe or cfg.multi_latent_attention or cfg.mtp_num_layers:
        raise LayoutError(f"--tp {tp}: the trainer runs tensor parallelism on dense LLaMA-family models only so far; "
                          f"{cfg.model_type} (MoE / multi-latent attention / MTP) trains at --tp 1 (split its "
                          "experts with --expert-model-parallel-size instead)")
    if cfg.add_proj_bias:
        raise LayoutError(f"--tp {tp}: row-parallel biases (attention output / MLP down projection) are not "
                          "supported by the trainer; use --tp 1")
    return dataclasses.replace(cfg, num_attention_heads=cfg.num_attention_heads // tp,
                               num_query_groups=cfg.num_query_groups // tp,
                               ffn_hidden_size=cfg.ffn_hidden_size // tp, vocab_size=padded_vocab // tp)


def _entry(group, sp: bool):
    return partial(comm.gather_seq if sp else comm.copy_to_tp, group=group)


def _exit_hook(group, sp: bool):
    fn = comm.reduce_scatter_seq if sp else comm.reduce_from_tp

    def hook(_module, _inputs, out):
        return fn(out, group)

    return hook


def apply_tensor_parallel(model: nn.Module, group, sequence_parallel: bool) -> None:
    """Hook the TP collectives onto a model built from `local_config` (no-op for a group of one)."""
    if group is None or dist.get_world_size(group) == 1:
        return
    for layer in model.decoder.layers.values():
        att, mlp = layer.self_attention, layer.mlp
        att.linear_qkv.parallel_input = _entry(group, sequence_parallel)
        att.linear_proj.register_forward_hook(_exit_hook(group, sequence_parallel))
        mlp.linear_fc1.parallel_input = _entry(group, sequence_parallel)
        mlp.linear_fc2.register_forward_hook(_exit_hook(group, sequence_parallel))
    if sequence_parallel:
        for name, p in model.named_parameters():
            if name.endswith("layer_norm_weight") or name.endswith("layernorm.weight"):
                p.sequence_parallel = True  # type: ignore[attr-defined]


def embed(model: nn.Module, ids: Tensor, group, vocab_start: int, sequence_parallel: bool) -> Tensor:
    """Vocab-parallel embedding lookup: ids outside this rank's rows contribute zeros; partial sums are reduced
    (and, with sequence parallelism, scattered along the sequence)."""
    weight = model.embedding.word_embeddings.weight
    if group is None or dist.get_world_size(group) == 1:
        return F.embedding(ids, weight)
    local = ids - vocab_start
    outside = (local < 0) | (local >= weight.shape[0])
    out = F.embedding(local.masked_fill(outside, 0), weight)
    out = out.masked_fill(outside.unsqueeze(-1), 0.0)
    return comm.reduce_scatter_seq(out, group) if sequence_parallel else comm.reduce_from_tp(out, group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy over logits split by vocab across the group: max, sum of exp and the target logit are
    all-reduced; the softmax never leaves its rank. Columns at or past `vocab_size` (padding) are excluded."""

    @staticmethod
    def forward(ctx, logits: Tensor, target: Tensor, vocab_start: int, vocab_size: int, group) -> Tensor:
        logits = logits.float()
        n_local = logits.shape[-1]
        cols = torch.arange(vocab_start, vocab_start + n_local, device=logits.device)
        logits = logits.masked_fill(cols >= vocab_size, float("-inf"))
        m = logits.max(dim=-1).values
        comm.all_reduce(m, group, dist.ReduceOp.MAX)
        shifted = logits - m.unsqueeze(-1)
        local_t = target - vocab_start
        inside = (local_t >= 0) & (local_t < n_local)
        idx = local_t.clamp(0, n_local - 1).unsqueeze(-1)
        picked = shifted.gather(-1, idx).squeeze(-1).masked_fill(~inside, 0.0)
        comm.all_reduce(picked, group)
        exp = shifted.exp()
        total = exp.sum(dim=-1)
        comm.all_reduce(total, group)
        loss = total.log() - picked
        ctx.save_for_backward(exp.div_(total.unsqueeze(-1)), idx, inside)
        return loss

    @staticmethod
    def backward(ctx, g: Tensor):
        softmax, idx, inside = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, idx, -inside.to(grad.dtype).unsqueeze(-1))
        return grad * g.unsqueeze(-1), None, None, None, None


def vocab_parallel_cross_entropy(logits: Tensor, target: Tensor, vocab_start: int, vocab_size: int,
                                 group) -> Tensor:
    """Per-token losses [...] for logits [..., local vocab] (fp32 math). A group of one holds the whole vocabulary:
    torch's fused log-softmax cross-entropy over the unpadded columns (the same values within float rounding, about
    half the time of the three-collective form, which needs its intermediates only to combine ranks)."""
    if group is None or dist.get_world_size(group) == 1:
        true = logits[..., : vocab_size - vocab_start].float()
        return F.cross_entropy(true.reshape(-1, true.shape[-1]), target.reshape(-1), reduction="none"
                               ).view(target.shape)
    return _VocabParallelCrossEntropy.apply(logits, target, vocab_start, vocab_size, group)


def head_loss(model: nn.Module, hidden: Tensor, labels: Tensor, group, vocab_start: int, vocab_size: int,
              sequence_parallel: bool) -> Tensor:
    """Mean token loss of the output head on the final-normed hidden states (tied embeddings use the embedding)."""
    return head_losses(model, hidden, labels, group, vocab_start, vocab_size, sequence_parallel).mean()


def head_losses(model: nn.Module, hidden: Tensor, labels: Tensor, group, vocab_start: int, vocab_size: int,
                sequence_parallel: bool) -> Tensor:
    """Per-token losses [b, s] of the output head (for loss masks and context parallelism's weights)."""
    if group is not None and dist.get_world_size(group) > 1:
        hidden = comm.gather_seq(hidden, group) if sequence_parallel else comm.copy_to_tp(hidden, group)
    weight = model.output_layer.weight if model.output_layer is not None else model.embedding.word_embeddings.weight
    logits = F.linear(hidden, weight)
    return vocab_parallel_cross_entropy(logits, labels, vocab_start, vocab_size, group)
