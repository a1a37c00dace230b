"""A plain-PyTorch decoder-only transformer: the LLaMA family (Llama 2/3/3.1/3.2, Mistral, Qwen2), Mixtral (MoE) and
DeepSeek-V2/V2-Lite/V3 (multi-latent attention, routed + shared experts, multi-token prediction).

The parameters live in Megatron-Core's canonical layout, so a checkpoint written by the converter loads with no
reshuffling, and a parameter's name is its canonical name with the layer index in it (checkpoint.families.model_specs
is the reference for every name and shape):

    embedding.word_embeddings.weight                         [padded_vocab, h]
    decoder.layers.{i}.self_attention.linear_qkv.layer_norm_weight   input RMSNorm, fused into the QKV linear
    decoder.layers.{i}.self_attention.linear_qkv.weight/bias [(nh + 2*ng)*hd, h], per query group [q_g; k_g; v_g]
    decoder.layers.{i}.self_attention.linear_proj.weight/bias [h, nh*hd]
    decoder.layers.{i}.mlp.linear_fc1.layer_norm_weight      post-attention RMSNorm, fused into fc1
    decoder.layers.{i}.mlp.linear_fc1.weight/bias            [2*ffn, h] = [gate; up]
    decoder.layers.{i}.mlp.linear_fc2.weight/bias            [h, ffn]
    decoder.final_layernorm.weight
    output_layer.weight                                      [padded_vocab, h] (absent when embeddings are tied)

  MoE layers (cfg.is_moe_layer(i)): the post-attention norm is a separate module, then router and experts
    decoder.layers.{i}.pre_mlp_layernorm.weight
    decoder.layers.{i}.mlp.router.weight [E, h]  (+ mlp.router.expert_bias [E], DeepSeek-V3)
    decoder.layers.{i}.mlp.experts.experts.linear_fc1.weight [E, 2F, h] ([gate; up] per expert), linear_fc2 [E, h, F]
    decoder.layers.{i}.mlp.shared_experts.linear_fc1.weight [2S, h], linear_fc2.weight [h, S]  (DeepSeek)
  Multi-latent attention (DeepSeek): a separate input norm, then
    decoder.layers.{i}.input_layernorm.weight
    self_attention.linear_q_down_proj.weight [q_lora, h], linear_q_up_proj.layer_norm_weight / .weight
        [nh*(nope+rope), q_lora]   (or self_attention.linear_q_proj.weight [nh*(nope+rope), h] without q_lora)
    self_attention.linear_kv_down_proj.weight [kv_lora + rope, h] = [compressed kv; shared k_pe]
    self_attention.linear_kv_up_proj.layer_norm_weight [kv_lora] / .weight [nh*(nope+v), kv_lora], per head [k; v]
    self_attention.linear_proj.weight [h, nh*v]
  Multi-token prediction (DeepSeek-V3): mtp.layers.{j}.enorm / hnorm / eh_proj [h, 2h] / final_layernorm and a
    full transformer layer mtp.layers.{j}.transformer_layer.… (MoE in an MoE model; not used by forward(), see
    `mtp_forward`: as in megatron-core, MTP reads the final-normed decoder output).

Canonical tensors (``checkpoint.families.model_specs``) drop the ``{i}`` and stack the layers on a leading axis;
a stack that mixes dense and MoE layers (DeepSeek's first_k_dense_replace) keeps the per-layer keys instead.
`GPTModel.load_canonical` / `GPTModel.canonical_state_dict` convert between the two forms.

The math follows HF transformers (the oracle in tests/test_model_parity*.py): RMSNorm in fp32, rotate-half RoPE (or
DeepSeek's interleaved pairs) with the frequency tables taken from transformers' own functions, SwiGLU, causal SDPA
(with Mistral's sliding window), dropless top-k routing with each family's router exactly as HF computes it.
One forward, in pieces that a pipeline stage also composes (train/parallel/pipeline.py): `embed`, `rope`, the
decoder's layers (`TransformerBlock.forward` runs all of them or a given chunk), `token_losses` (final norm, `logits`,
`cross_entropy`) and `mtp_forward`. No parallelism here: train/parallel/parallelize.py applies it from outside
(torchtitan's habit). Tensor parallelism builds the model from a per-rank config (`local_config`: its share of heads,
groups, ffn and vocabulary rows), hooks collectives onto the linears (`NormLinear.parallel_input` and
`GPTModel.head_input` are the hook points a forward hook cannot reach), swaps in a vocab-parallel embedding and sets
`cross_entropy` to the vocab-parallel loss; pipeline parallelism deletes the layers a stage does not own from
`TransformerBlock.layers`, a ModuleDict keyed by the global layer index so that parameter names stay global.
"""
from __future__ import annotations

import math
from typing import Any, Iterable, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from checkpoint.config import LATENT_NORM_EPS, ModelConfig
from checkpoint.families import family_of

from .dropout import attention_with_dropout, dropout

INIT_STD = 0.02  # Megatron's default init_method_std


# -- building blocks ---------------------------------------------------------------------------------------------------

def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm exactly as HF computes it: statistics in fp32, cast back to the input dtype, then scaled."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


class NormLinear(nn.Module):
    """RMSNorm followed by a linear layer, holding both parameters (Transformer Engine's LayerNormLinear): that is
    why Megatron names the norm weights ``linear_qkv.layer_norm_weight`` and ``linear_fc1.layer_norm_weight``."""

    def __init__(self, in_features: int, out_features: int, bias: bool, eps: float) -> None:
        super().__init__()
        self.layer_norm_weight = nn.Parameter(torch.ones(in_features))
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.eps = eps
        nn.init.normal_(self.weight, std=INIT_STD)

    @staticmethod
    def parallel_input(x: Tensor) -> Tensor:
        """Applied to the normed input before the linear; tensor parallelism sets it to its copy/all-gather."""
        return x

    parallel_linear = None  # sequence parallelism: the gather and the linear in one (comm.gathered_linear)

    def forward(self, x: Tensor) -> Tensor:
        x = rms_norm(x, self.layer_norm_weight, self.eps)
        if self.parallel_linear is not None:
            return self.parallel_linear(x, self.weight, self.bias)
        return F.linear(self.parallel_input(x), self.weight, self.bias)


def linear(in_features: int, out_features: int, bias: bool) -> nn.Linear:
    layer = nn.Linear(in_features, out_features, bias=bias)
    nn.init.normal_(layer.weight, std=INIT_STD)
    if bias:
        nn.init.zeros_(layer.bias)
    return layer


class _SwiGLU(torch.autograd.Function):
    """silu(gate) * up of x = [gate; up] (last axis) as one autograd node. The same kernels as the two-op form, so
    the same values and gradients to the bit; the backward writes the gradients of both halves straight into one
    tensor instead of concatenating them (chunk's backward), one full copy of the fc1 output's gradient less per
    layer. Keeps what autograd keeps for the two-op form: x (gate and up are views of it) and silu(gate)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        gate, up = x.chunk(2, dim=-1)
        act = F.silu(gate)
        ctx.save_for_backward(x, act)
        return act * up

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        x, act = ctx.saved_tensors
        gate, up = x.chunk(2, dim=-1)
        grad_x = torch.empty_like(x, memory_format=torch.contiguous_format)
        grad_gate, grad_up = grad_x.chunk(2, dim=-1)
        torch.mul(grad, act, out=grad_up)  # d(act * up)/d(up), as MulBackward0
        torch.ops.aten.silu_backward.grad_input(grad * up, gate, grad_input=grad_gate)  # as SiluBackward0
        return grad_x


def swiglu(x: Tensor) -> Tensor:
    """silu(gate) * up for x = [gate; up] on the last axis (a dense MLP's fc1 output)."""
    return _SwiGLU.apply(x)


def token_cross_entropy(logits: Tensor, target: Tensor) -> Tensor:
    """Per-token cross-entropy [...] of logits [..., vocab] (fp32 math)."""
    logits = logits.float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="none"
                           ).view(target.shape)


def gqa_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, is_causal: bool = False,
                  scale: float | None = None) -> Tensor:
    """SDPA of query heads q [b, H, sq, d] over grouped K/V [b, G, sk, d*] (H = G * hpg, group-major: KV head g
    serves query heads g*hpg .. (g+1)*hpg - 1, HF's order). GQA runs inside SDPA (`enable_gqa`, as HF's SDPA path
    does) wherever its kernel takes it: on the CPU always, on CUDA in fp16/bf16 without a mask (flash); elsewhere
    SDPA would fall back to its math kernel, so K/V are expanded to every query head first. Same forward values
    either way; the K/V gradients sum over a group's query heads in another order."""
    hpg = q.shape[1] // k.shape[1]
    if hpg > 1 and not (q.device.type == "cpu" or (mask is None and q.dtype in (torch.float16, torch.bfloat16))):
        k, v = k.repeat_interleave(hpg, dim=1), v.repeat_interleave(hpg, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                          enable_gqa=q.shape[1] != k.shape[1])


# -- rotary position embedding -----------------------------------------------------------------------------------------

def rotate_half(x: Tensor) -> Tensor:
    """[x1, x2] -> [-x2, x1] on the last axis: the rotate-half RoPE form HF's q/k weights are stored in."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: [b, heads, s, d]; cos/sin: [b, s, d]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


def apply_rope_interleaved(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """DeepSeek's RoPE: dims (x0, x1), (x2, x3), ... are the pairs rotated by one frequency each (HF V3's
    `apply_rotary_pos_emb_interleave`; HF V2 rotates the same pairs as complex numbers). The output is de-interleaved,
    [rotated evens; rotated odds]: a fixed permutation, harmless because q and k get the same one.
    x: [b, heads, s, d]; cos/sin: [b, s, d] as RotaryEmbedding makes them (both halves equal)."""
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half].unsqueeze(1), sin[..., :half].unsqueeze(1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rope_init(hf_config: Any, rope_type: str, device: torch.device, seq_len: Tensor | None = None
              ) -> tuple[Tensor, float]:
    """(inv_freq [head_dim/2], attention_scaling) from transformers' own RoPE functions, so that every scaling variant
    matches HF by construction rather than by re-derivation."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type == "default":
        # transformers keeps the plain 1/theta^(2i/d) formula on the model classes, not in ROPE_INIT_FUNCTIONS
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        inv_freq, scaling = LlamaRotaryEmbedding.compute_default_rope_parameters(hf_config)
        return inv_freq.to(device), scaling
    return ROPE_INIT_FUNCTIONS[rope_type](hf_config, device, seq_len=seq_len)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for the positions of a batch.

    The inverse frequencies and the attention scaling come from transformers' own functions for the model's
    ``rope_type`` (default, linear, dynamic, yarn, llama3), so every scaling variant matches HF by construction.
    The table is computed lazily on the device of the first batch and kept in fp32 (a plain attribute, not a buffer,
    so casting the model to bf16 does not round the frequencies)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.hf_config = cfg.hf_transformers_config()
        self.rope_type: str = (cfg.rope_scaling or {}).get("rope_type", "default")
        self.max_position_embeddings = cfg.max_position_embeddings
        self.inv_freq: Tensor | None = None
        self.attention_scaling: float = 1.0

    def _frequencies(self, position_ids: Tensor) -> tuple[Tensor, float]:
        device = position_ids.device
        if self.inv_freq is None or self.inv_freq.device != device:
            inv_freq, self.attention_scaling = rope_init(self.hf_config, self.rope_type, device)
            self.inv_freq = inv_freq.to(device=device, dtype=torch.float32)
        if self.rope_type == "dynamic":
            # Dynamic NTK rescales the base once the sequence outgrows max_position_embeddings, with
            # seq_len = max(position_ids) + 1, as HF's `dynamic_rope_update`. HF also caches: after a longer call it
            # keeps that call's frequencies for later calls that are shorter but still past max_position_embeddings.
            # Here they are recomputed per call (same function, same argument), so a call never depends on earlier
            # ones; identical to HF for a fresh model, for growing sequences (generation) and after resets.
            seq_len = torch.max(position_ids) + 1
            if seq_len > self.max_position_embeddings:
                inv_freq, scaling = rope_init(self.hf_config, self.rope_type, device, seq_len=seq_len)
                return inv_freq.to(device=device, dtype=torch.float32), scaling
        return self.inv_freq, self.attention_scaling

    def forward(self, position_ids: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """position_ids [b, s] -> (cos, sin), each [b, s, head_dim], computed in fp32 then cast to `dtype`."""
        inv_freq, scaling = self._frequencies(position_ids)
        freqs = position_ids[..., None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)


# -- the transformer layer -------------------------------------------------------------------------------------------

class SelfAttention(nn.Module):
    """Causal GQA self-attention over Megatron's fused QKV.

    linear_qkv's output rows are grouped per query group: [q heads of group g; k_g; v_g] for g = 0..ng-1. Query
    heads come out in HF order (group-major), and KV head g serves query heads g*hpg .. (g+1)*hpg - 1."""

    # --attention-dropout on the softmax probabilities (train/dropout.py; set by parallelize.apply_dropout)
    attention_dropout: float = 0.0
    dropout_rng = None

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_groups = cfg.num_query_groups
        self.heads_per_group = cfg.heads_per_group
        self.head_dim = cfg.kv_channels
        self.sliding_window = cfg.sliding_window
        self.linear_qkv = NormLinear(cfg.hidden_size, cfg.qkv_rows, cfg.add_qkv_bias, cfg.norm_epsilon)
        self.linear_proj = linear(cfg.num_attention_heads * cfg.kv_channels, cfg.hidden_size, cfg.add_proj_bias)
        # QK norm (Qwen3, megatron-core's qk_layernorm): each query and key head RMS-normalised before RoPE
        self.q_layernorm = RMSNorm(self.head_dim, cfg.norm_epsilon) if cfg.qk_layernorm else None
        self.k_layernorm = RMSNorm(self.head_dim, cfg.norm_epsilon) if cfg.qk_layernorm else None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        qkv = self.linear_qkv(x)
        b, s, _ = qkv.shape  # sequence parallelism: x holds a slice of the sequence, qkv all of it
        qkv = qkv.view(b, s, self.num_groups, self.heads_per_group + 2, self.head_dim)
        # one split (its backward is one cat) rather than three slices (each a zero-filled copy of qkv's gradient)
        q, k, v = torch.split(qkv, [self.heads_per_group, 1, 1], dim=3)
        q = q.reshape(b, s, self.num_heads, self.head_dim)
        # [b, s, ng, hd]; v is copied out of qkv so that what SDPA keeps for backward does not hold all of qkv alive
        k, v = k.squeeze(3), v.squeeze(3).contiguous()
        if self.q_layernorm is not None:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, heads, s, hd]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = self.core_attention(q, k, v, self._sliding_window_mask(s, x.device))
        return self.linear_proj(out.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim))

    def core_attention(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        """softmax(q k^T) v: the part selective recompute re-runs in the backward pass. q [b, nh, s, hd], k and v
        [b, ng, s, hd] (one head per query group)."""
        if self.attention_dropout and self.training and torch.is_grad_enabled():
            return attention_with_dropout(q, k, v, self.attention_dropout, self.dropout_rng.attention(), mask)
        return gqa_attention(q, k, v, mask, is_causal=mask is None)

    def _sliding_window_mask(self, s: int, device: torch.device) -> Tensor | None:
        """Mistral's window, as HF's `sliding_window_causal_mask_function`: query i sees key j iff
        0 <= i - j < sliding_window (indices are token positions in the sequence). None: plain causal suffices."""
        if self.sliding_window is None or s <= self.sliding_window:
            return None
        i = torch.arange(s, device=device)[:, None]
        j = torch.arange(s, device=device)[None, :]
        return (j <= i) & (i - j < self.sliding_window)


def mla_softmax_scale(cfg: ModelConfig) -> float:
    """1/sqrt(nope + rope head dim), times yarn's mscale(factor, mscale_all_dim)^2 when the RoPE is scaled and
    mscale_all_dim is set: HF's `yarn_apply_mscale` (the attention-logit part of yarn; the cos/sin part,
    mscale/mscale_all_dim, comes with the RoPE tables)."""
    scale = cfg.q_head_dim ** -0.5
    rope = cfg.rope_scaling or {}
    if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim"):
        factor = rope["factor"]
        mscale = 1.0 if factor <= 1 else 0.1 * rope["mscale_all_dim"] * math.log(factor) + 1.0
        scale = scale * mscale * mscale
    return scale


class MLASelfAttention(nn.Module):
    """DeepSeek's multi-latent attention (MLA).

    q = up(norm(down(x))) (or one q projection without q_lora), per head [q_nope; q_pe]. The KV down-projection gives
    [compressed kv; k_pe]: the compressed part is normed and up-projected to per-head [k_nope; v], k_pe is a single
    head shared by all heads. RoPE only touches q_pe and k_pe. The input norm is the layer's `input_layernorm`."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, nh = cfg.hidden_size, cfg.num_attention_heads
        self.num_heads = nh
        self.nope_dim, self.rope_dim, self.v_dim = cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        self.q_lora = bool(cfg.q_lora_rank)
        if self.q_lora:
            self.linear_q_down_proj = linear(h, cfg.q_lora_rank, False)
            self.linear_q_up_proj = NormLinear(cfg.q_lora_rank, nh * cfg.q_head_dim, False, LATENT_NORM_EPS)
        else:
            self.linear_q_proj = linear(h, nh * cfg.q_head_dim, False)
        self.linear_kv_down_proj = linear(h, cfg.kv_lora_rank + self.rope_dim, False)
        self.linear_kv_up_proj = NormLinear(cfg.kv_lora_rank, nh * (self.nope_dim + self.v_dim), False,
                                            LATENT_NORM_EPS)
        self.linear_proj = linear(nh * self.v_dim, h, False)
        # HF V2 always rotates interleaved pairs (as complex numbers); V3 does when rope_interleave (its default)
        self.rope = apply_rope_interleaved if family_of(cfg.model_type).rotary_interleaved(cfg) else apply_rope
        self.softmax_scale = mla_softmax_scale(cfg)

    @staticmethod
    def parallel_k_pe(k_pe: Tensor) -> Tensor:
        """Applied to the shared RoPE key (read by every local head); tensor parallelism sets it to its
        copy/all-gather, as the up-projections' `parallel_input`."""
        return k_pe

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        nh = self.num_heads
        q = self.linear_q_up_proj(self.linear_q_down_proj(x)) if self.q_lora else self.linear_q_proj(x)
        b, s, _ = q.shape  # sequence parallelism: x holds a slice of the sequence, q all of it
        q_nope, q_pe = q.view(b, s, nh, -1).transpose(1, 2).split([self.nope_dim, self.rope_dim], dim=-1)
        kv, k_pe = self.linear_kv_down_proj(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        k_pe = self.parallel_k_pe(k_pe)
        kv = self.linear_kv_up_proj(kv).view(b, s, nh, -1).transpose(1, 2)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)  # [b, nh, s, *]
        q_pe, k_pe = self.rope(q_pe, cos, sin), self.rope(k_pe.view(b, 1, s, self.rope_dim), cos, sin)
        q = torch.cat((q_nope, q_pe), dim=-1)
        k = torch.cat((k_nope, k_pe.expand(-1, nh, -1, -1)), dim=-1)
        out = self.core_attention(q, k, v, None)
        return self.linear_proj(out.transpose(1, 2).reshape(b, s, nh * self.v_dim))

    attention_dropout: float = 0.0  # as SelfAttention's
    dropout_rng = None

    def core_attention(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        if self.attention_dropout and self.training and torch.is_grad_enabled():
            return attention_with_dropout(q, k, v, self.attention_dropout, self.dropout_rng.attention(),
                                          scale=self.softmax_scale)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale)


# -- MLPs and mixture of experts ---------------------------------------------------------------------------------------

class MLP(nn.Module):
    """SwiGLU: fc2(silu(gate) * up), with linear_fc1 = [gate; up]. A dense layer's post-attention RMSNorm is fused
    into linear_fc1 (`norm_eps` given); DeepSeek's shared experts have none (they read the MoE layer's normed input)."""

    def __init__(self, hidden: int, ffn: int, bias: bool, norm_eps: float | None) -> None:
        super().__init__()
        self.linear_fc1 = (linear(hidden, 2 * ffn, bias) if norm_eps is None
                           else NormLinear(hidden, 2 * ffn, bias, norm_eps))
        self.linear_fc2 = linear(ffn, hidden, bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear_fc2(swiglu(self.linear_fc1(x)))


class Router(nn.Module):
    """Top-k router: (weights [T, k] fp32, expert indices [T, k]) for tokens [T, h]. One code path, configured per
    family exactly as HF computes it:

    Mixtral      softmax over all experts, top-k, renormalised (moe_router_norm_topk), no scaling
    DeepSeek-V2  softmax; top-k ("greedy"), or group-limited: a group scores its best expert and only the
                 moe_router_group_topk best groups compete; times routed_scaling_factor (HF's V2 router never
                 renormalises, and the hub configs say norm_topk_prob=false)
    DeepSeek-V3  sigmoid; experts are *selected* on score + expert_bias, a group scoring the sum of its two best;
                 the weights are the unbiased scores, renormalised, times routed_scaling_factor

    expert_bias is a parameter so that it loads and saves with the rest; it gets no gradient (DeepSeek-V3 updates it
    from the expert load, outside the optimizer).

    `on_route` is the hook point training uses (train/moe.py: load-balancing loss, tokens per expert); identity here.
    `logits_dtype` (None: the activations' dtype) is what Megatron's --moe-router-dtype sets."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_experts, self.topk = cfg.num_moe_experts, cfg.moe_router_topk
        self.weight = nn.Parameter(torch.empty(cfg.num_moe_experts, cfg.hidden_size))
        nn.init.normal_(self.weight, std=INIT_STD)
        self.expert_bias = (nn.Parameter(torch.zeros(cfg.num_moe_experts), requires_grad=False)
                            if cfg.moe_router_enable_expert_bias else None)
        self.score_function = cfg.moe_router_score_function
        self.norm_topk = cfg.moe_router_norm_topk
        self.scaling_factor = cfg.moe_router_topk_scaling_factor
        self.num_groups, self.group_topk = cfg.moe_router_num_groups, cfg.moe_router_group_topk
        # DeepSeek keeps its gate in fp32 and computes the logits there; Mixtral's are in the activations' dtype
        self.logits_dtype: torch.dtype | None = torch.float32 if family_of(cfg.model_type).router_fp32 else None

    @staticmethod
    def on_route(scores: Tensor, weights: Tensor, indices: Tensor) -> Tensor:
        """Called with the scores over all experts [T, E] and the routing; returns the weights to use."""
        return weights

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        if self.logits_dtype is not None:
            logits = F.linear(x.to(self.logits_dtype), self.weight.to(self.logits_dtype))
        else:
            logits = F.linear(x, self.weight).float()
        scores = logits.softmax(dim=-1) if self.score_function == "softmax" else logits.sigmoid()
        choice = scores if self.expert_bias is None else scores + self.expert_bias.to(scores.dtype)
        if self.num_groups:
            per_group = self.num_experts // self.num_groups
            grouped = choice.view(-1, self.num_groups, per_group)
            group_scores = (grouped.topk(2, dim=-1)[0].sum(dim=-1) if self.score_function == "sigmoid"
                            else grouped.max(dim=-1).values)
            best = torch.topk(group_scores, self.group_topk, dim=-1, sorted=False)[1]
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
            choice = choice.masked_fill(~keep.repeat_interleave(per_group, dim=1), float("-inf"))
        indices = torch.topk(choice, self.topk, dim=-1)[1]
        weights = scores.gather(1, indices)
        if self.norm_topk:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        if self.scaling_factor is not None:
            weights = weights * self.scaling_factor
        return self.on_route(scores, weights, indices), indices


class ExpertLinear(nn.Module):
    """The same linear layer for each of E experts, one [E, out, in] weight (no bias)."""

    def __init__(self, num_experts: int, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features))
        nn.init.normal_(self.weight, std=INIT_STD)


class GroupedMLP(nn.Module):
    """E SwiGLU experts with stacked weights: linear_fc1 [E, 2F, h] ([gate; up] per expert), linear_fc2 [E, h, F]."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        E, h, ffn = cfg.num_moe_experts, cfg.hidden_size, cfg.moe_ffn_hidden_size
        self.linear_fc1 = ExpertLinear(E, h, 2 * ffn)
        self.linear_fc2 = ExpertLinear(E, ffn, h)

    def forward(self, x: Tensor, expert: int) -> Tensor:
        gate, up = F.linear(x, self.linear_fc1.weight[expert]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.linear_fc2.weight[expert])


class Experts(nn.Module):
    """Dropless token dispatch: every token goes to each of its top-k experts (no capacity, nothing dropped), and the
    expert outputs come back weighted by the router. Experts are visited in index order, as HF does. Expert
    parallelism splits `experts` (the weights) on the expert axis and replaces this loop with an all-to-all."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_experts = cfg.num_moe_experts
        self.experts = GroupedMLP(cfg)

    def forward(self, x: Tensor, weights: Tensor, indices: Tensor) -> Tensor:
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            token, slot = torch.where(indices == e)
            if token.numel() == 0:
                continue
            y = self.experts(x.index_select(0, token), e) * weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out


class MoELayer(nn.Module):
    """Routed experts (+ DeepSeek's shared experts, a plain SwiGLU every token goes through)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.router = Router(cfg)
        self.experts = Experts(cfg)
        shared = cfg.moe_shared_expert_intermediate_size
        self.shared_experts = MLP(cfg.hidden_size, shared, False, None) if shared else None

    def forward(self, x: Tensor) -> Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        weights, indices = self.router(tokens)
        out = self.experts(tokens, weights, indices).view(x.shape)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


# -- the transformer layer -------------------------------------------------------------------------------------------

class TransformerLayer(nn.Module):
    """Pre-norm residual block: x + attention(norm(x)), then x + mlp(norm(x)).

    In the LLaMA-style layer both norms live inside linear_qkv and linear_fc1 (Transformer Engine's fused
    LayerNormLinear), so `input_layernorm` / `pre_mlp_layernorm` are identities there; multi-latent attention has
    its own input norm (two down-projections read it), and an MoE MLP its own pre-MLP norm (router, experts and shared
    experts all read it)."""

    def __init__(self, cfg: ModelConfig, moe: bool) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.norm_epsilon
        mla = cfg.multi_latent_attention
        self.input_layernorm = RMSNorm(h, eps) if mla else nn.Identity()
        self.self_attention = MLASelfAttention(cfg) if mla else SelfAttention(cfg)
        self.pre_mlp_layernorm = RMSNorm(h, eps) if moe else nn.Identity()
        self.mlp = MoELayer(cfg) if moe else MLP(h, cfg.ffn_hidden_size, cfg.add_mlp_bias, eps)

    # --hidden-dropout in megatron-core's bias-dropout-add after attention and after the MLP (train/dropout.py)
    hidden_dropout: float = 0.0
    dropout_rng = None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = self._dropout_add(x, self.self_attention(self.input_layernorm(x), cos, sin))
        return self._dropout_add(x, self.mlp(self.pre_mlp_layernorm(x)))

    def _dropout_add(self, residual: Tensor, out: Tensor) -> Tensor:
        if self.hidden_dropout and self.training and torch.is_grad_enabled():
            out = dropout(out, self.hidden_dropout, self.dropout_rng.residual())
        return residual + out


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        # keyed by the global layer index: a pipeline stage keeps its own layers and their global names
        self.layers = nn.ModuleDict({str(i): TransformerLayer(cfg, cfg.is_moe_layer(i)) for i in range(cfg.num_layers)})
        self.final_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_epsilon)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, layers: Iterable[nn.Module] | None = None) -> Tensor:
        """Run `layers` (default: all this model holds, in order; a pipeline chunk passes its own) on x. The final
        norm is not applied (the last stage applies it; its output feeds the head and MTP)."""
        for layer in self.layers.values() if layers is None else layers:
            x = layer(x, cos, sin)
        return x


class MTPLayer(nn.Module):
    """One DeepSeek-V3 multi-token-prediction depth (megatron-core's MultiTokenPredictionLayer): eh_proj([enorm(
    embedding of the next token); hnorm(hidden)]), a full transformer layer, then its own final norm, whose output both
    the shared output head and the next depth read."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.norm_epsilon
        self.enorm = RMSNorm(h, eps)
        self.hnorm = RMSNorm(h, eps)
        self.eh_proj = linear(2 * h, h, False)
        self.final_layernorm = RMSNorm(h, eps)
        self.transformer_layer = TransformerLayer(cfg, cfg.is_moe)

    def forward(self, hidden: Tensor, next_embedded: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """`hidden`: the previous depth's output (the decoder's final-normed output for the first depth) -> this
        depth's output, after final_layernorm (megatron-core's `_postprocess`): the head's and the next depth's input."""
        x = self.eh_proj(torch.cat((self.enorm(next_embedded), self.hnorm(hidden)), dim=-1))
        return self.final_layernorm(self.transformer_layer(x, cos, sin))


class MultiTokenPrediction(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MTPLayer(cfg) for _ in range(cfg.mtp_num_layers))


class Embedding(nn.Module):
    def __init__(self, padded_vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(padded_vocab_size, hidden_size)
        nn.init.normal_(self.word_embeddings.weight, std=INIT_STD)

    def forward(self, input_ids: Tensor) -> Tensor:
        return self.word_embeddings(input_ids)


# -- the model ---------------------------------------------------------------------------------------------------------

_LAYER_PREFIX = "decoder.layers."


def canonical_name(param_name: str, stacked: bool = True) -> tuple[str, int | None]:
    """'decoder.layers.3.mlp.linear_fc2.weight' -> ('decoder.layers.mlp.linear_fc2.weight', 3) when the decoder
    layers are stacked; everything else, and every name of a heterogeneous stack (`stacked=False`: per-layer keys),
    is its own canonical name: (name, None)."""
    if stacked and param_name.startswith(_LAYER_PREFIX):
        index, rest = param_name[len(_LAYER_PREFIX):].split(".", 1)
        return _LAYER_PREFIX + rest, int(index)
    return param_name, None


class GPTModel(nn.Module):
    """Decoder-only LM. `padded_vocab_size` >= cfg.vocab_size is the embedding/output row count (Megatron pads the
    vocab for TP); the padding rows are never used for logits."""

    def __init__(self, cfg: ModelConfig, padded_vocab_size: int) -> None:
        super().__init__()
        if padded_vocab_size < cfg.vocab_size:
            raise ValueError(f"padded_vocab_size {padded_vocab_size} < vocab_size {cfg.vocab_size}")
        self.cfg = cfg
        self.padded_vocab_size = padded_vocab_size
        self.embedding = Embedding(padded_vocab_size, cfg.hidden_size)
        self.rotary_pos_emb = RotaryEmbedding(cfg)
        self.decoder = TransformerBlock(cfg)
        self.output_layer = None if cfg.tie_word_embeddings else linear(cfg.hidden_size, padded_vocab_size, False)
        self.mtp = MultiTokenPrediction(cfg) if cfg.mtp_num_layers else None

    def forward(self, input_ids: Tensor, position_ids: Tensor | None = None, return_hidden: bool = False
                ) -> Tensor | tuple[Tensor, Tensor]:
        """input_ids [b, s] -> logits [b, s, cfg.vocab_size] (and, with return_hidden, the decoder's final-normed
        output: the head's input, and `mtp_forward`'s).

        position_ids (default 0..s-1) only feed RoPE; attention is causal over token order, as in HF when no
        attention mask is given. The MTP layers take no part (HF's forward ignores them too)."""
        x = self.embed(input_ids)
        hidden = self.decoder(x, *self.rope(input_ids, position_ids, x.dtype))
        normed = self.decoder.final_layernorm(hidden)
        logits = self.logits(normed)
        return (logits, normed) if return_hidden else logits

    hidden_dropout: float = 0.0  # megatron-core's embedding dropout (train/dropout.py)
    dropout_rng = None

    def embed(self, input_ids: Tensor) -> Tensor:
        """Token embeddings [b, s, h] (tensor parallelism swaps in a vocab-parallel embedding), after the embedding
        dropout (--hidden-dropout) in training."""
        x = self.embedding(input_ids)
        if self.hidden_dropout and self.training and torch.is_grad_enabled():
            x = dropout(x, self.hidden_dropout, self.dropout_rng.embedding())
        return x

    def rope(self, input_ids: Tensor, position_ids: Tensor | None, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """(cos, sin) [b, s, head_dim] for the batch's positions (default 0..s-1)."""
        b, s = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(s, device=input_ids.device)[None, :]
        return self.rotary_pos_emb(position_ids.expand(b, s), dtype)

    @staticmethod
    def head_input(x: Tensor) -> Tensor:
        """Applied to the final-normed hidden states before the output head; tensor parallelism sets it to its
        copy/all-gather."""
        return x

    def logits(self, x: Tensor) -> Tensor:
        """Output head on final-normed hidden states (tied embeddings use the embedding): one logit per vocabulary
        row up to cfg.vocab_size, so padding rows never become logits."""
        weight = self.embedding.word_embeddings.weight if self.output_layer is None else self.output_layer.weight
        return F.linear(self.head_input(x), weight[: self.cfg.vocab_size])

    def cross_entropy(self, logits: Tensor, labels: Tensor) -> Tensor:
        """Per-token losses (fp32) of `logits` for `labels`; tensor parallelism replaces it with the vocab-parallel
        loss over this rank's rows."""
        return token_cross_entropy(logits, labels)

    def token_losses(self, hidden: Tensor, labels: Tensor) -> Tensor:
        """Per-token losses [b, s] of the decoder's output `hidden` (before its final norm) for `labels`."""
        return self.cross_entropy(self.logits(self.decoder.final_layernorm(hidden)), labels)

    def mtp_forward(self, hidden: Tensor, input_ids: Tensor, position_ids: Tensor | None = None,
                    depth_ids: list[Tensor] | None = None) -> list[Tensor]:
        """DeepSeek-V3 multi-token prediction (for training): one logits tensor [b, s, vocab] per MTP depth.

        `hidden` is the decoder's output after its final norm (`forward(..., return_hidden=True)[1]`; the output
        head's input). Depth d (0-based) reads the previous depth's output after that depth's final_layernorm
        (`hidden` for d = 0) and the embedding of token t+d+1 at position t, and predicts token t+d+2: what
        megatron-core's MultiTokenPredictionBlock reads (its decoder applies the final norm before the block; each
        layer's `_postprocess` applies its final_layernorm before the next). Positions s-d-1.. see no real next token
        (the ids are shifted with zero fill, like Megatron's roll_tensor) and must be left out of the loss.

        `depth_ids`: the ids each depth embeds, already shifted (train.moe.mtp_targets: within documents, across the
        context-parallel chunks); None: `input_ids` shifted here, over the whole sequence."""
        if self.mtp is None:
            raise ValueError("this model has no MTP layers (cfg.mtp_num_layers == 0)")
        cos, sin = self.rope(input_ids, position_ids, hidden.dtype)
        out, ids = [], input_ids
        for d, layer in enumerate(self.mtp.layers):
            ids = F.pad(ids[:, 1:], (0, 1)) if depth_ids is None else depth_ids[d]  # token t+d+1 at position t
            hidden = layer(hidden, self.embed(ids), cos, sin)
            out.append(self.logits(hidden))
        return out

    # -- canonical (stacked) form ---------------------------------------------------------------------------------

    def _is_stacked(self, cname: str) -> bool:
        """Stacked on a leading layer axis: decoder-layer tensors of a homogeneous stack (a heterogeneous one, dense
        and MoE layers mixed, keeps per-layer keys; MTP layers always do)."""
        return not self.cfg.heterogeneous and cname.startswith(_LAYER_PREFIX)

    def _canonical_params(self) -> dict[str, list[nn.Parameter]]:
        """Canonical name -> the parameters it stacks (one per layer for per-layer tensors, in layer order)."""
        out: dict[str, list[nn.Parameter]] = {}
        stacked = not self.cfg.heterogeneous
        for name, p in self.named_parameters():  # layers come in order, so appending stacks them in order
            out.setdefault(canonical_name(name, stacked)[0], []).append(p)
        return out

    def _stacked_shape(self, cname: str, params: list[nn.Parameter]) -> tuple[int, ...]:
        shape = tuple(params[0].shape)
        return (len(params), *shape) if self._is_stacked(cname) else shape

    def canonical_state_dict(self) -> dict[str, Tensor]:
        """The parameters as canonical tensors (names as in model_specs; per-layer ones stacked on axis 0)."""
        out = {}
        for cname, params in self._canonical_params().items():
            if self._is_stacked(cname):
                out[cname] = torch.stack([p.detach() for p in params])
            else:
                out[cname] = params[0].detach().clone()
        return out

    @torch.no_grad()
    def load_canonical(self, tensors: Mapping[str, Tensor]) -> None:
        """Copy canonical tensors in (cast to the parameters' dtype and device). Everything is checked before
        anything is copied: missing or unexpected names and shape mismatches raise ValueError naming the tensor."""
        params = self._canonical_params()
        missing = sorted(set(params) - set(tensors))
        unexpected = sorted(set(tensors) - set(params))
        if missing or unexpected:
            raise ValueError(f"canonical tensors do not match the model: missing {missing}, unexpected {unexpected}")
        for cname, ps in params.items():
            want, got = self._stacked_shape(cname, ps), tuple(tensors[cname].shape)
            if got != want:
                raise ValueError(f"{cname}: expected shape {want}, got {got}")
        for cname, ps in params.items():
            t = tensors[cname]
            if self._is_stacked(cname):
                for i, p in enumerate(ps):
                    p.copy_(t[i])
            else:
                ps[0].copy_(t)
