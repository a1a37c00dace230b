"""A plain-PyTorch decoder-only transformer for the LLaMA family (Llama 2/3/3.1/3.2, Mistral, Qwen2).

The parameters live in Megatron-Core's canonical layout, so a checkpoint written by the converter loads with no
reshuffling, and a parameter's name is its canonical name with the layer index in it:

    embedding.word_embeddings.weight                         [padded_vocab, h]
    decoder.layers.{i}.self_attention.linear_qkv.layer_norm_weight   input RMSNorm, fused into the QKV linear
    decoder.layers.{i}.self_attention.linear_qkv.weight/bias [(nh + 2*ng)*hd, h], per query group [q_g; k_g; v_g]
    decoder.layers.{i}.self_attention.linear_proj.weight/bias [h, nh*hd]
    decoder.layers.{i}.mlp.linear_fc1.layer_norm_weight      post-attention RMSNorm, fused into fc1
    decoder.layers.{i}.mlp.linear_fc1.weight/bias            [2*ffn, h] = [gate; up]
    decoder.layers.{i}.mlp.linear_fc2.weight/bias            [h, ffn]
    decoder.final_layernorm.weight
    output_layer.weight                                      [padded_vocab, h] (absent when embeddings are tied)

Canonical tensors (``checkpoint.sharding.model_specs``) drop the ``{i}`` and stack the layers on a leading axis;
`GPTModel.load_canonical` / `GPTModel.canonical_state_dict` convert between the two forms.

The math follows HF transformers (the oracle in tests/test_model_parity.py): RMSNorm in fp32, rotate-half RoPE with
the frequency tables taken from transformers' own functions, SwiGLU, causal SDPA (with Mistral's sliding window).
No parallelism here: tensor/pipeline parallelism replace the four linears of `SelfAttention` and `MLP` and split
`TransformerBlock.layers`, so those are kept as plain, separate modules.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from checkpoint.config import ModelConfig

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

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(rms_norm(x, self.layer_norm_weight, self.eps), self.weight, self.bias)


def linear(in_features: int, out_features: int, bias: bool) -> nn.Linear:
    layer = nn.Linear(in_features, out_features, bias=bias)
    nn.init.normal_(layer.weight, std=INIT_STD)
    if bias:
        nn.init.zeros_(layer.bias)
    return layer


# -- rotary position embedding -----------------------------------------------------------------------------------------

def rotate_half(x: Tensor) -> Tensor:
    """[x1, x2] -> [-x2, x1] on the last axis: the rotate-half RoPE form HF's q/k weights are stored in."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: [b, heads, s, d]; cos/sin: [b, s, d]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


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

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_groups = cfg.num_query_groups
        self.heads_per_group = cfg.heads_per_group
        self.head_dim = cfg.kv_channels
        self.sliding_window = cfg.sliding_window
        self.linear_qkv = NormLinear(cfg.hidden_size, cfg.qkv_rows, cfg.add_qkv_bias, cfg.norm_epsilon)
        self.linear_proj = linear(cfg.num_attention_heads * cfg.kv_channels, cfg.hidden_size, cfg.add_proj_bias)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        b, s, _ = x.shape
        qkv = self.linear_qkv(x).view(b, s, self.num_groups, self.heads_per_group + 2, self.head_dim)
        q = qkv[:, :, :, : self.heads_per_group].reshape(b, s, self.num_heads, self.head_dim)
        k, v = qkv[:, :, :, -2], qkv[:, :, :, -1]  # [b, s, ng, hd]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, heads, s, hd]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # GQA: each KV head serves heads_per_group consecutive query heads
        k = k.repeat_interleave(self.heads_per_group, dim=1)
        v = v.repeat_interleave(self.heads_per_group, dim=1)
        mask = self._sliding_window_mask(s, x.device)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        return self.linear_proj(out.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim))

    def _sliding_window_mask(self, s: int, device: torch.device) -> Tensor | None:
        """Mistral's window, as HF's `sliding_window_causal_mask_function`: query i sees key j iff
        0 <= i - j < sliding_window (indices are token positions in the sequence). None: plain causal suffices."""
        if self.sliding_window is None or s <= self.sliding_window:
            return None
        i = torch.arange(s, device=device)[:, None]
        j = torch.arange(s, device=device)[None, :]
        return (j <= i) & (i - j < self.sliding_window)


class MLP(nn.Module):
    """SwiGLU: fc2(silu(gate) * up), with linear_fc1 = [gate; up] (post-attention RMSNorm fused in)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.linear_fc1 = NormLinear(cfg.hidden_size, 2 * cfg.ffn_hidden_size, cfg.add_mlp_bias, cfg.norm_epsilon)
        self.linear_fc2 = linear(cfg.ffn_hidden_size, cfg.hidden_size, cfg.add_mlp_bias)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.linear_fc1(x).chunk(2, dim=-1)
        return self.linear_fc2(F.silu(gate) * up)


class TransformerLayer(nn.Module):
    """Pre-norm residual block (the norms live inside linear_qkv and linear_fc1)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attention = SelfAttention(cfg)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.self_attention(x, cos, sin)
        return x + self.mlp(x)


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(TransformerLayer(cfg) for _ in range(cfg.num_layers))
        self.final_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_epsilon)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.final_layernorm(x)


class Embedding(nn.Module):
    def __init__(self, padded_vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(padded_vocab_size, hidden_size)
        nn.init.normal_(self.word_embeddings.weight, std=INIT_STD)

    def forward(self, input_ids: Tensor) -> Tensor:
        return self.word_embeddings(input_ids)


# -- the model ---------------------------------------------------------------------------------------------------------

_LAYER_PREFIX = "decoder.layers."


def canonical_name(param_name: str) -> tuple[str, int | None]:
    """'decoder.layers.3.mlp.linear_fc2.weight' -> ('decoder.layers.mlp.linear_fc2.weight', 3); others unchanged."""
    if param_name.startswith(_LAYER_PREFIX):
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

    def forward(self, input_ids: Tensor, position_ids: Tensor | None = None) -> Tensor:
        """input_ids [b, s] -> logits [b, s, cfg.vocab_size].

        position_ids (default 0..s-1) only feed RoPE; attention is causal over token order, as in HF when no
        attention mask is given."""
        b, s = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(s, device=input_ids.device)[None, :]
        position_ids = position_ids.expand(b, s)
        x = self.embedding(input_ids)
        cos, sin = self.rotary_pos_emb(position_ids, x.dtype)
        x = self.decoder(x, cos, sin)
        weight = self.embedding.word_embeddings.weight if self.output_layer is None else self.output_layer.weight
        return F.linear(x, weight[: self.cfg.vocab_size])  # padding rows never become logits

    # -- canonical (stacked) form ---------------------------------------------------------------------------------

    def _canonical_params(self) -> dict[str, list[nn.Parameter]]:
        """Canonical name -> the parameters it stacks (one per layer for per-layer tensors, in layer order)."""
        out: dict[str, list[nn.Parameter]] = {}
        for name, p in self.named_parameters():  # layers come in order, so appending stacks them in order
            out.setdefault(canonical_name(name)[0], []).append(p)
        return out

    @staticmethod
    def _stacked_shape(cname: str, params: list[nn.Parameter]) -> tuple[int, ...]:
        shape = tuple(params[0].shape)
        return (len(params), *shape) if cname.startswith(_LAYER_PREFIX) else shape

    def canonical_state_dict(self) -> dict[str, Tensor]:
        """The parameters as canonical tensors (names as in model_specs; per-layer ones stacked on axis 0)."""
        out = {}
        for cname, params in self._canonical_params().items():
            if cname.startswith(_LAYER_PREFIX):
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
            if cname.startswith(_LAYER_PREFIX):
                for i, p in enumerate(ps):
                    p.copy_(t[i])
            else:
                ps[0].copy_(t)
