"""The LLaMA family (Llama 2/3.x, Mistral, Qwen2): grouped-query attention with RoPE, RMSNorm, a SwiGLU MLP.

HF on disk, layer i under `model.layers.{i}.`: `input_layernorm`, `self_attn.{q,k,v,o}_proj` (+ q/k/v biases for
Qwen2, all biases with Llama's attention_bias), `post_attention_layernorm`, `mlp.{gate,up,down}_proj`. Megatron fuses
the input norm into linear_qkv and the post-attention norm into linear_fc1 (TE naming), Q/K/V per query group, and
[gate; up] into linear_fc1. Mixtral reuses the attention."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from ..errors import ConfigError
from ..sharding import Rule
from .base import Family
from .table import Table

if TYPE_CHECKING:
    from ..config import ModelConfig


def read_attention(hf: dict, source: str, integer: Callable[..., int], common: dict) -> dict:
    """Grouped-query attention's sizes: query groups and head dim (an explicit head_dim, else hidden / heads)."""
    hidden, heads = common["hidden_size"], common["num_attention_heads"]
    if hidden % heads:  # transformers' Llama-family config classes refuse it too, even with an explicit head_dim
        raise ConfigError(f"{source}: hidden_size {hidden} is not divisible by num_attention_heads {heads}")
    groups = integer("num_key_value_heads", hf.get("num_key_value_heads") or heads)
    head_dim = integer("head_dim", hf.get("head_dim") or hidden // heads)
    if heads % groups:
        raise ConfigError(f"{source}: num_attention_heads {heads} is not a multiple of num_key_value_heads {groups}")
    if head_dim % 2:
        raise ConfigError(f"{source}: head_dim {head_dim} must be even for rotary embeddings")
    return dict(num_query_groups=groups, kv_channels=head_dim)


def sliding_window(hf: dict, integer: Callable[..., int]) -> dict:
    window = hf.get("sliding_window")
    return dict(sliding_window=integer("sliding_window", window) if window is not None else None)


def attention(t: Table, cfg: ModelConfig) -> None:
    """Input norm fused into linear_qkv (TE naming), QKV grouped per query group, linear_proj."""
    h = cfg.hidden_size
    t.add("self_attention.linear_qkv.layer_norm_weight", (h,), Rule.REPLICATED, "input_layernorm.weight")
    t.qkv("self_attention.linear_qkv.weight", cfg, "self_attn.q_proj.weight", "self_attn.k_proj.weight",
          "self_attn.v_proj.weight")
    if cfg.add_qkv_bias:
        t.qkv("self_attention.linear_qkv.bias", cfg, "self_attn.q_proj.bias", "self_attn.k_proj.bias",
              "self_attn.v_proj.bias", rows_of="bias")
    if cfg.qk_layernorm:  # per head: each TP rank's norms see its own heads only, so their gradient is summed over TP
        t.add("self_attention.q_layernorm.weight", (cfg.kv_channels,), Rule.REPLICATED, "self_attn.q_norm.weight",
              tp_grad="always")
        t.add("self_attention.k_layernorm.weight", (cfg.kv_channels,), Rule.REPLICATED, "self_attn.k_norm.weight",
              tp_grad="always")
    t.add("self_attention.linear_proj.weight", (h, cfg.num_attention_heads * cfg.kv_channels), Rule.ROW,
          "self_attn.o_proj.weight")
    if cfg.add_proj_bias:
        t.add("self_attention.linear_proj.bias", (h,), Rule.REPLICATED, "self_attn.o_proj.bias")


def dense_mlp(t: Table, cfg: ModelConfig) -> None:
    """Post-attention norm fused into linear_fc1, fc1 = [gate; up], fc2 = down."""
    h, F = cfg.hidden_size, cfg.ffn_hidden_size
    t.add("mlp.linear_fc1.layer_norm_weight", (h,), Rule.REPLICATED, "post_attention_layernorm.weight")
    t.add("mlp.linear_fc1.weight", (2 * F, h), Rule.GATE_UP, [("mlp.gate_proj.weight", F), ("mlp.up_proj.weight", F)])
    if cfg.add_mlp_bias:
        t.add("mlp.linear_fc1.bias", (2 * F,), Rule.GATE_UP, [("mlp.gate_proj.bias", F), ("mlp.up_proj.bias", F)])
    t.add("mlp.linear_fc2.weight", (h, F), Rule.ROW, "mlp.down_proj.weight")
    if cfg.add_mlp_bias:
        t.add("mlp.linear_fc2.bias", (h,), Rule.REPLICATED, "mlp.down_proj.bias")


class Llama(Family):
    model_type, architecture = "llama", "LlamaForCausalLM"
    fields = frozenset({"attention_bias", "mlp_bias"})
    from_megatron, megatron_rank = True, 0  # what any dense RMSNorm/SwiGLU/RoPE args are, unless a rank above says

    def read_config(self, hf: dict, source: str, integer: Callable[..., int], common: dict) -> dict:
        bias = bool(hf.get("attention_bias", False))
        return dict(**read_attention(hf, source, integer, common), add_qkv_bias=bias, add_proj_bias=bias,
                    add_mlp_bias=bool(hf.get("mlp_bias", False)))

    def write_config(self, cfg: ModelConfig, out: dict, src: dict) -> None:
        for key, value in (("attention_bias", cfg.add_proj_bias), ("mlp_bias", cfg.add_mlp_bias)):
            if key in src or value:
                out[key] = value

    def layer(self, t: Table, cfg: ModelConfig, moe: bool) -> None:
        attention(t, cfg)
        dense_mlp(t, cfg)

    def megatron_match(self, get: Callable[..., Any]) -> bool:
        return True

    def megatron_to_hf(self, get, refuse, integer, hf: dict) -> None:
        refuse(bool(get("add_qkv_bias")) and not get("add_bias_linear"), "add_qkv_bias",
               "a QKV bias without output/MLP biases is Qwen2's layout; pass hf_model_type='qwen2'")
        bias = bool(get("add_bias_linear"))
        hf.update(attention_bias=bias, mlp_bias=bias, intermediate_size=integer("ffn_hidden_size"))


class Mistral(Llama):
    model_type, architecture = "mistral", "MistralForCausalLM"
    fields = frozenset({"sliding_window"})
    megatron_rank = -1  # never inferred from args (they look like Llama's); named with --model-type mistral

    def read_config(self, hf: dict, source: str, integer: Callable[..., int], common: dict) -> dict:
        return dict(**read_attention(hf, source, integer, common), **sliding_window(hf, integer))

    def write_config(self, cfg: ModelConfig, out: dict, src: dict) -> None:
        if "sliding_window" in src or cfg.sliding_window is not None:
            out["sliding_window"] = cfg.sliding_window

    def megatron_match(self, get) -> bool:
        return False

    def megatron_to_hf(self, get, refuse, integer, hf: dict) -> None:
        refuse(bool(get("add_qkv_bias")) and not get("add_bias_linear"), "add_qkv_bias",
               "a QKV bias without output/MLP biases is Qwen2's layout; pass hf_model_type='qwen2'")
        refuse(bool(get("add_bias_linear")), "add_bias_linear", f"{self.model_type} has no linear biases")
        # full attention, as Megatron ran it (an absent field means transformers' 4096)
        hf.update(intermediate_size=self.megatron_ffn(integer), sliding_window=None)

    def megatron_ffn(self, integer) -> int:
        return integer("ffn_hidden_size")


class Qwen2(Llama):
    model_type, architecture = "qwen2", "Qwen2ForCausalLM"
    fields = frozenset({"sliding_window", "use_sliding_window", "max_window_layers", "use_mrope", "layer_types"})
    megatron_rank = 1

    def read_config(self, hf: dict, source: str, integer: Callable[..., int], common: dict) -> dict:
        if hf.get("use_mrope"):
            raise ConfigError(f"{source}: use_mrope=true (multimodal RoPE) is not supported")
        if hf.get("use_sliding_window"):
            raise ConfigError(f"{source}: use_sliding_window=true is not supported for qwen2")
        lt = hf.get("layer_types")
        if lt and any(x != "full_attention" for x in lt):
            raise ConfigError(f"{source}: layer_types other than 'full_attention' are not supported")
        return dict(**read_attention(hf, source, integer, common), add_qkv_bias=True)

    def write_config(self, cfg: ModelConfig, out: dict, src: dict) -> None:
        pass

    def megatron_match(self, get) -> bool:
        return bool(get("add_qkv_bias")) and not get("add_bias_linear")

    def megatron_to_hf(self, get, refuse, integer, hf: dict) -> None:
        refuse(bool(get("add_bias_linear")), "add_bias_linear", "qwen2 has no output/MLP biases")
        refuse(not get("add_qkv_bias"), "add_qkv_bias", "qwen2 needs add_qkv_bias=True")
        hf["intermediate_size"] = integer("ffn_hidden_size")


LLAMA, MISTRAL, QWEN2 = Llama(), Mistral(), Qwen2()
