"""A model family added the way any family is added: this one module (tests/test_family_registry.py).

Llama's layer with a per-head RMSNorm of the queries and keys before RoPE (megatron-core's `qk_layernorm`), under a
model_type of its own. Its HF side is transformers' Qwen3 layer registered under that model_type through transformers'
own Auto registration, so the proof runs against transformers' forward. shardkit finds the module through
$SHARDKIT_FAMILIES (checkpoint.families.load_plugins)."""
from __future__ import annotations

import transformers

from checkpoint.errors import ConfigError
from checkpoint.families import register
from checkpoint.families.llama import Llama, read_attention

MODEL_TYPE = "toy_qknorm"


class ToyConfig(transformers.Qwen3Config):
    model_type = MODEL_TYPE


class ToyForCausalLM(transformers.Qwen3ForCausalLM):
    config_class = ToyConfig


if MODEL_TYPE not in transformers.CONFIG_MAPPING:
    transformers.AutoConfig.register(MODEL_TYPE, ToyConfig)
    transformers.AutoModelForCausalLM.register(ToyConfig, ToyForCausalLM)


class ToyQKNorm(Llama):
    model_type, architecture = MODEL_TYPE, "ToyForCausalLM"
    fields = frozenset({"attention_bias", "use_sliding_window", "sliding_window", "max_window_layers", "layer_types"})
    from_megatron = False

    def read_config(self, hf, source, integer, common):
        if hf.get("use_sliding_window") or any(t != "full_attention" for t in hf.get("layer_types") or []):
            raise ConfigError(f"{source}: sliding-window layers are not supported for {MODEL_TYPE}")
        bias = bool(hf.get("attention_bias", False))
        return dict(**read_attention(hf, source, integer, common), add_qkv_bias=bias, add_proj_bias=bias,
                    qk_layernorm=True)

    def write_config(self, cfg, out, src):
        if "attention_bias" in src or cfg.add_proj_bias:
            out["attention_bias"] = cfg.add_proj_bias


register(ToyQKNorm())
