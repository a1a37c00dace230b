"""The modules the engine puts into megatron-core's local layer spec where megatron-core's own do not fit: its RMSNorm
for the norms (sequence parallel where needed), DeepSeek's latent norms, Qwen3's per-head norms, multi-latent
attention's core attention and down projections where Transformer Engine is absent, and shardkit's context-parallel
attention (train/parallel/context.py) as the core attention under CP without TE."""
from __future__ import annotations

import torch


class RMSNorm:
    """The local spec's norm (torch.nn.RMSNorm, as megatron-core's WrappedTorchNorm builds it) that also runs under
    sequence parallelism: WrappedTorchNorm refuses it (megatron-core leaves SP norms to TE's TENorm or Apex), though
    the arithmetic is per token; its weight is marked `sequence_parallel` as TENorm's is, so finalize_model_grads
    sums its gradient over the TP group."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_):
        norm = torch.nn.RMSNorm(normalized_shape=hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = bool(config.sequence_parallel)
        return norm


class LatentNorm:
    """Multi-latent attention's q / kv latent norms (q_layernorm, kv_layernorm: DeepSeek's q_a_layernorm and
    kv_a_layernorm, eps 1e-6 whatever rms_norm_eps says, as transformers and the native model take them). Under
    sequence parallelism each rank normalises its slice of the sequence: the weight is marked `sequence_parallel` so
    that finalize_model_grads sums its gradient over TP (TENorm's rule); the config's qk_layernorm stays off, so that
    megatron-core does not also sum `q_layernorm` by its name when every TP rank saw the whole sequence."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_):
        from train.model import LATENT_NORM_EPS

        norm = torch.nn.RMSNorm(normalized_shape=hidden_size, eps=LATENT_NORM_EPS)
        for p in norm.parameters():
            p.sequence_parallel = bool(config.sequence_parallel)
        return norm


class MLACoreAttention(torch.nn.Module):
    """Multi-latent attention's core attention where Transformer Engine is absent. megatron-core's local
    DotProductAttention sizes every head by kv_channels and takes no `k_channels` / `v_channels`, which MLASelfAttention
    passes (query and key heads of qk_head_dim + qk_pos_emb_head_dim, value heads of v_head_dim), so its local MLA spec
    does not build without TE. This is DotProductAttention's arithmetic on those heads: scores q k^T times
    MLASelfAttention's softmax_scale (1/sqrt(k_channels) times DeepSeek's YaRN mscale squared), masked where
    `attention_mask` is True (causal, and per document with --reset-attention-mask), softmax in fp32, dropout under
    megatron-core's RNG tracker as DotProductAttention draws it, times v; this TP rank's heads, [s, b, np * v]."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 k_channels: int | None = None, v_channels: int | None = None, cp_comm_type=None,
                 pg_collection=None) -> None:
        super().__init__()
        from megatron.core import parallel_state as ps

        if config.context_parallel_size != 1:
            raise ValueError("MLACoreAttention: context parallelism is TE's (TEDotProductAttention)")
        tp = pg_collection.tp.size() if pg_collection is not None else ps.get_tensor_model_parallel_world_size()
        self.config = config
        self.heads = config.num_attention_heads // tp
        # megatron-core's Attention base class first builds one without the head sizes (MLA then builds its own)
        self.k_channels, self.v_channels = k_channels or config.kv_channels, v_channels or config.kv_channels
        self.softmax_scale = self.k_channels ** -0.5 if softmax_scale is None else softmax_scale
        self.dropout = torch.nn.Dropout(config.attention_dropout if attention_dropout is None else attention_dropout)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        from megatron.core import tensor_parallel

        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("MLACoreAttention: packed_seq_params / attention_bias are TE's")
        s, b = query.shape[:2]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, np, s, d]
        scores = torch.matmul(q, k.transpose(-2, -1)) * self.softmax_scale
        if attention_mask is None:
            attention_mask = torch.triu(torch.ones(s, k.shape[2], dtype=torch.bool, device=q.device), diagonal=1)
        scores = scores.float().masked_fill(attention_mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        if self.dropout.p and self.training:
            if self.config.sequence_parallel:
                probs = self.dropout(probs)
            else:
                with tensor_parallel.get_cuda_rng_tracker().fork():
                    probs = self.dropout(probs)
        out = torch.matmul(probs, v)  # [b, np, s, v]
        return out.permute(2, 0, 1, 3).reshape(s, b, self.heads * self.v_channels)


def mla_submodules(attn, te: bool) -> None:
    """The engine's pieces in a local-spec MLASelfAttention's submodules: the core attention (TE's
    TEDotProductAttention where Transformer Engine is installed: it takes MLA's head sizes; MLACoreAttention
    otherwise), the latent norms (LatentNorm) and, for the down projections, megatron-core's own duplicated linear
    (post_training.modelopt.layers.Linear, what its MLA takes instead of TE's duplicated TELinear): each TP rank holds
    the whole weight, as shardkit's table and TE's spec have it (the local spec's ColumnParallelLinear would split its
    output dimension over TP)."""
    import megatron.core.transformer.multi_latent_attention as mla
    from megatron.core.post_training.modelopt.layers import Linear

    if mla.Linear is None:  # megatron-core imports it there only with Transformer Engine
        mla.Linear = Linear
    if te:
        from megatron.core.extensions.transformer_engine import TEDotProductAttention

        attn.core_attention = TEDotProductAttention
    else:
        attn.core_attention = MLACoreAttention
        for name in ("TELinear", "TEColumnParallelLinear"):  # 0.16 without TE: MagicMock placeholders, which
            if not isinstance(getattr(mla, name), (type, type(None))):  # MLA's isinstance checks refuse
                setattr(mla, name, type(f"No{name}", (), {}))
    attn.q_layernorm = attn.kv_layernorm = LatentNorm
    attn.linear_q_down_proj = attn.linear_kv_down_proj = mla.Linear


def local_spec_layer(layer, m, te_attention: bool) -> None:
    """The engine's pieces in one layer of megatron-core's local spec: its two norms (RMSNorm: they take sequence
    parallelism), multi-latent attention's (`mla_submodules`) or the q/k head norms (HeadNorm). Not on TE's spec,
    whose TENorm / fused layer-norm linears take SP and name their weights canonically (`te_spec_fields`)."""
    layer.submodules.input_layernorm = layer.submodules.pre_mlp_layernorm = RMSNorm
    attn = layer.submodules.self_attention.submodules
    if m.multi_latent_attention:
        mla_submodules(attn, te_attention)
    elif m.qk_layernorm:
        attn.q_layernorm = attn.k_layernorm = HeadNorm


class HeadNorm:
    """The q/k layernorm (TransformerConfig.qk_layernorm: RMSNorm over each head), also under sequence parallelism
    (WrappedTorchNorm refuses SP there too): never marked sequence-parallel, as attention normalises this rank's heads
    over the whole sequence; finalize_model_grads sums its gradient over TP by its name whatever the flags."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_):
        return torch.nn.RMSNorm(normalized_shape=hidden_size, eps=eps)


class ContextParallelAttention(torch.nn.Module):
    """The core attention under context parallelism where Transformer Engine is absent: megatron-core's local
    DotProductAttention asserts context_parallel_size == 1 (its CP is TE's TEDotProductAttention), so this runs the
    native engine's CP attention (train/parallel/context.py AttentionState.attend: ring (p2p) or all-gathered K/V over
    Megatron's zigzag split, documents masked from global positions) on megatron-core's q / k / v of this rank's two
    chunks: [s, b, np, d] queries, [s, b, ng, d] keys and [s, b, ng, dv] values (one K/V head per query group, as the
    local spec hands them: GQA; MLA's heads of k_channels / v_channels) -> [s, b, np * dv]. The scale is
    DotProductAttention's (1/sqrt(k_channels), or the softmax_scale given, MLA's). The micro-batch's AttentionLayout is
    the one the engine's forward_step holds in `state` around the model's forward (state.use)."""

    state = None  # the run's AttentionState (train.parallel.context.attention_state): `bound` sets it

    @classmethod
    def bound(cls, state) -> type:
        return type(cls.__name__, (cls,), {"state": state})

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 k_channels: int | None = None, v_channels: int | None = None, cp_comm_type=None,
                 pg_collection=None) -> None:
        super().__init__()
        if self.state is None or config.context_parallel_size != self.state.cp:
            raise ValueError("ContextParallelAttention: built without the run's context-parallel state")
        k_channels = k_channels or config.kv_channels
        self.softmax_scale = k_channels ** -0.5 if softmax_scale is None else softmax_scale

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("ContextParallelAttention: packed_seq_params / attention_bias are TE's")
        layout = self.state.current
        if layout is None:
            raise RuntimeError("ContextParallelAttention called outside the engine's forward_step (no layout)")
        s, b = query.shape[:2]
        q, k, v = (t.permute(1, 2, 0, 3).contiguous() for t in (query, key, value))  # [b, heads, s, d]
        out = self.state.attend(q, k, v, q.shape[1] // k.shape[1], self.softmax_scale, None, layout)
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)
