"""Tensor parallelism with sequence parallelism, applied to the plain model from outside (Megatron-LM's scheme).

Each TP rank builds the model from `local_config` (its share of heads, query groups, ffn and vocabulary, the sharding
table's local shapes) and holds exactly the local shards the table assigns it, so loading is `Checkpoint.read_local`.
Then `apply_tensor_parallel` hooks on:

- column-parallel linears (linear_qkv, linear_fc1) get `copy_to_tp` (or, with sequence parallelism, the all-gather
  of the sequence, fused with the matmul so that only the local slice is kept for backward) between their fused
  norm and the matmul;
- row-parallel linears (linear_proj, linear_fc2) get an all-reduce (or a reduce-scatter of the sequence) on their
  output;
- the embedding becomes vocab-parallel (each rank looks up its rows, the partial results are summed), the output
  head gets the copy (all-gather) on its input, and the model's `cross_entropy` is a vocab-parallel cross-entropy
  that never gathers the logits (this rank's first row from the table's region of the embedding).

With sequence parallelism the residual stream between those points is split along the sequence, so the norms see
a slice of the tokens: their gradients are partial and are all-reduced over TP (which parameters: the sharding
table's `tp_grad`, applied by `mark_partial_grads`, never a name suffix).

MoE and multi-latent attention (megatron-core's layouts; MoE at TP > 1 requires sequence parallelism, as Megatron):

- multi-latent attention splits whole heads: linear_q_proj / linear_q_up_proj and linear_kv_up_proj are column-
  parallel (the copy / all-gather after their latent norms), linear_proj row-parallel; linear_q_down_proj,
  linear_kv_down_proj and the latent norms are replicated and run on the sequence slice (partial gradients, summed
  over TP), and the shared RoPE key k_pe is gathered like the up-projections' inputs;
- an MoE layer runs on the sequence slice: the router is replicated and routes this rank's tokens (partial
  gradient), the shared experts are a column/row-parallel MLP, and the routed experts (split by the expert TP size)
  move tokens over the EP and expert-TP groups themselves (train/parallel/expert.py);
- an MTP depth's eh_proj is column-parallel with its output gathered along the hidden axis and split along the
  sequence again (megatron-core's MultiTokenPredictionLayer); its enorm/hnorm see the slice.
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
from checkpoint.layout import Layout, RankCoord
from checkpoint.sharding import local_shape, regions
from checkpoint.families import model_specs
from train.model import GPTModel, canonical_name, token_cross_entropy

from . import comm

EMBEDDING = "embedding.word_embeddings.weight"


def local_config(cfg: ModelConfig, layout: Layout) -> ModelConfig:
    """The model one TP rank builds: its share of heads, query groups, ffn (dense, shared-expert and, by the expert
    TP size, routed-expert) and vocabulary rows (`vocab_size` = the padded vocabulary's rows it holds), read from the
    sharding table's local shapes. The RoPE tables come from the global HF config, which is kept."""
    tp = layout.tp
    if tp > 1 and cfg.add_proj_bias:
        raise LayoutError(f"--tp {tp}: row-parallel biases (attention output / MLP down projection) are not "
                          "supported by the trainer; use --tp 1")
    specs = model_specs(cfg, layout)

    def local(suffix: str, axis: int) -> int | None:
        """The local size on `axis` of the first table tensor named `...suffix` (None: the model has none)."""
        spec = next((s for s in specs if s.name.endswith(suffix)), None)
        return None if spec is None else local_shape(spec, layout)[axis]

    vocab = local(EMBEDDING, 0)
    changes: dict = {"vocab_size": vocab}
    if cfg.is_moe:  # routed experts split by the expert TP size, shared experts by TP
        changes["moe_ffn_hidden_size"] = local("mlp.experts.experts.linear_fc2.weight", -1)
        if cfg.moe_shared_expert_intermediate_size:
            changes["moe_shared_expert_intermediate_size"] = local("mlp.shared_experts.linear_fc2.weight", -1)
    if tp == 1:
        return dataclasses.replace(cfg, **changes)
    dense_ffn = local(".mlp.linear_fc2.weight", -1)
    if dense_ffn is not None:
        changes["ffn_hidden_size"] = dense_ffn
    if cfg.multi_latent_attention:  # whole heads per rank; the latent down-projections are replicated
        heads = local("self_attention.linear_proj.weight", -1) // cfg.v_head_dim
        changes.update(num_attention_heads=heads, num_query_groups=cfg.num_query_groups // tp)
    else:
        groups = local("self_attention.linear_qkv.weight", -2) // ((cfg.heads_per_group + 2) * cfg.kv_channels)
        changes.update(num_attention_heads=groups * cfg.heads_per_group, num_query_groups=groups)
    return dataclasses.replace(cfg, **changes)


def vocab_start(cfg: ModelConfig, layout: Layout, tp_rank: int) -> int:
    """The first vocabulary row a TP rank holds (its region of the embedding, as the first stage stores it)."""
    spec = next(s for s in model_specs(cfg, layout) if s.name == EMBEDDING)
    return regions(spec, layout, RankCoord(tp=tp_rank, pp=0))[0].global_offset[0]


def _entry(group, sp: bool):
    return partial(comm.gather_seq if sp else comm.copy_to_tp, group=group)


def _exit_hook(group, sp: bool):
    fn = comm.reduce_scatter_seq if sp else comm.reduce_from_tp

    def hook(_module, _inputs, out):
        return fn(out, group)

    return hook


def resize_mtp_projections(model: GPTModel, cfg: ModelConfig, layout: Layout) -> None:
    """On the meta device, before materialising: each MTP depth's eh_proj becomes this TP rank's column shard (its
    local shape from the table; local_config cannot express it, the hidden size stays whole)."""
    if model.mtp is None or layout.tp == 1:
        return
    spec = next(s for s in model_specs(cfg, layout) if s.name.endswith("eh_proj.weight"))
    out, inp = local_shape(spec, layout)
    for layer in model.mtp.layers:
        layer.eh_proj = nn.Linear(inp, out, bias=False)


def _column_input(linear: nn.Module, group, sp: bool) -> None:
    """A NormLinear's collective between its norm and its matmul: the copy, or with sequence parallelism the
    all-gather, fused with the matmul so that backward keeps the local slice, not the gathered input
    (comm.gathered_linear; FP8's NormLinear keeps `parallel_input`)."""
    linear.parallel_input = _entry(group, sp)
    if sp:
        linear.parallel_linear = partial(comm.gathered_linear, group=group)


def _pre_hook(group, sp: bool):
    fn = _entry(group, sp)

    def hook(_module, args):
        return (fn(args[0]), *args[1:])

    return hook


def _layer_tensor_parallel(layer: nn.Module, group, sp: bool) -> list[nn.Parameter]:
    """Hook the collectives onto one transformer layer (which replicated parameters see only this rank's slice of the
    sequence, and so get partial gradients, the sharding table says: `mark_partial_grads`)."""
    from train.model import MLASelfAttention, MoELayer

    att, mlp = layer.self_attention, layer.mlp
    if isinstance(att, MLASelfAttention):
        # megatron-core's MLA: the latent down-projections (and their norms) are replicated and run on the
        # sequence slice; the up-projections are column-parallel (whole heads), the shared RoPE key is gathered
        if att.q_lora:
            _column_input(att.linear_q_up_proj, group, sp)
        else:
            att.linear_q_proj.register_forward_pre_hook(_pre_hook(group, sp))
        _column_input(att.linear_kv_up_proj, group, sp)
        att.parallel_k_pe = _entry(group, sp)
    else:
        _column_input(att.linear_qkv, group, sp)
    att.linear_proj.register_forward_hook(_exit_hook(group, sp))
    if isinstance(mlp, MoELayer):
        # the router is replicated and routes this rank's tokens; the routed experts exchange tokens with the EP and
        # expert-TP groups themselves (train/parallel/expert.py); shared experts are a column/row-parallel MLP
        if mlp.shared_experts is not None:
            mlp.shared_experts.linear_fc1.register_forward_pre_hook(_pre_hook(group, sp))
            mlp.shared_experts.linear_fc2.register_forward_hook(_exit_hook(group, sp))
    else:
        _column_input(mlp.linear_fc1, group, sp)
        mlp.linear_fc2.register_forward_hook(_exit_hook(group, sp))


class _GatherLastDim(torch.autograd.Function):
    """Forward: all-gather along the last axis; backward: keep this rank's part (megatron-core's
    gather_from_tensor_model_parallel_region)."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        return comm._all_gather(x, group, -1)

    @staticmethod
    def backward(ctx, g: Tensor):
        return g.chunk(dist.get_world_size(ctx.group), dim=-1)[dist.get_rank(ctx.group)].contiguous(), None


def _mtp_projection_hooks(group, sp: bool):
    """eh_proj of an MTP depth (megatron-core's MultiTokenPredictionLayer): a column-parallel linear whose input is
    gathered (copied), whose output is gathered along the hidden axis and then split along the sequence again."""
    def post(_module, _inputs, out):
        out = _GatherLastDim.apply(out, group)
        return comm.split_seq(out, group) if sp else out

    return _pre_hook(group, sp), post


def apply_tensor_parallel(model: GPTModel, cfg: ModelConfig, layout: Layout, tp_rank: int, group,
                          sequence_parallel: bool) -> None:
    """Make a model built from `local_config` this TP rank's: its loss counts the real vocabulary (`cfg` is the
    global config; the padding rows are excluded at tp 1 too), and with tp > 1 the collectives are hooked onto the
    linears and the output head and the embedding becomes vocab-parallel."""
    start = vocab_start(cfg, layout, tp_rank)
    model.cross_entropy = partial(vocab_parallel_cross_entropy, vocab_start=start, vocab_size=cfg.vocab_size,
                                  group=group)
    if group is None or dist.get_world_size(group) == 1:
        return
    for layer in model.decoder.layers.values():
        _layer_tensor_parallel(layer, group, sequence_parallel)
    for mtp in [] if model.mtp is None else model.mtp.layers:
        _layer_tensor_parallel(mtp.transformer_layer, group, sequence_parallel)
        pre, post = _mtp_projection_hooks(group, sequence_parallel)
        mtp.eh_proj.register_forward_pre_hook(pre)
        mtp.eh_proj.register_forward_hook(post)
    model.head_input = _entry(group, sequence_parallel)
    if model.embedding is not None:
        model.embedding = VocabParallelEmbedding(model.embedding.word_embeddings, start, group, sequence_parallel)


def mark_partial_grads(model: nn.Module, cfg: ModelConfig, layout: Layout, sequence_parallel: bool) -> None:
    """Mark the parameters whose gradient is partial over TP (`tp_partial_grad`; train/optim.py sums them over the
    TP group) from the sharding table's `tp_grad` (checkpoint/sharding.py), never from name suffixes: "always", or
    "sp" under sequence parallelism. Run last among the model's transformations (Transformer Engine's modules are
    new parameters); a parameter with no canonical tensor is an error, as in the parameter table."""
    if layout.tp == 1:
        return
    specs = {s.name: s for s in model_specs(cfg, layout)}
    for name, p in model.named_parameters():
        cname, _ = canonical_name(name, not cfg.heterogeneous)
        if cname not in specs:
            raise LayoutError(f"parameter {name}: no canonical tensor {cname} in the sharding table")
        mode = specs[cname].tp_grad
        p.tp_partial_grad = mode == "always" or (mode == "sp" and sequence_parallel)  # type: ignore[attr-defined]


class VocabParallelEmbedding(nn.Module):
    """Vocab-parallel embedding lookup over this rank's rows (the model's `word_embeddings`, same parameter name):
    ids outside them contribute zeros; partial sums are reduced (and, with sequence parallelism, scattered along
    the sequence)."""

    def __init__(self, word_embeddings: nn.Embedding, vocab_start: int, group, sequence_parallel: bool) -> None:
        super().__init__()
        self.word_embeddings = word_embeddings
        self.vocab_start, self.group, self.sequence_parallel = vocab_start, group, sequence_parallel

    def forward(self, ids: Tensor) -> Tensor:
        weight = self.word_embeddings.weight
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return comm.reduce_scatter_seq(out, self.group)
        return comm.reduce_from_tp(out, self.group)


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
        return token_cross_entropy(logits[..., : vocab_size - vocab_start], target)
    return _VocabParallelCrossEntropy.apply(logits, target, vocab_start, vocab_size, group)
