"""HF <-> Megatron-Core mapping for the LLaMA family (Llama 2/3.x, Mistral, Qwen2): one table, both directions."""
from __future__ import annotations

from checkpoint.config import ModelConfig
from checkpoint.layout import Layout
from checkpoint.sharding import model_specs

from .mapping import TensorMap, concat, grouped_qkv, single

MODEL_TYPES = ("llama", "mistral", "qwen2")


def tensor_maps(cfg: ModelConfig, layout: Layout) -> list[TensorMap]:
    """Every canonical tensor (per layer for stacked ones) as row blocks of HF tensors."""
    padded = cfg.padded_vocab_size(layout.tp)
    h, F = cfg.hidden_size, cfg.ffn_hidden_size
    specs = {s.name for s in model_specs(cfg, layout)}
    maps = [single("embedding.word_embeddings.weight", None, "model.embed_tokens.weight", cfg.vocab_size, padded)]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."

        def qkv(kind: str) -> TensorMap:
            return grouped_qkv(f"decoder.layers.self_attention.linear_qkv.{kind}", i, p + f"self_attn.q_proj.{kind}",
                               p + f"self_attn.k_proj.{kind}", p + f"self_attn.v_proj.{kind}", cfg.num_query_groups,
                               cfg.heads_per_group, cfg.kv_channels)

        maps += [
            single("decoder.layers.self_attention.linear_qkv.layer_norm_weight", i, p + "input_layernorm.weight", h),
            qkv("weight"),
            single("decoder.layers.self_attention.linear_proj.weight", i, p + "self_attn.o_proj.weight", h),
            single("decoder.layers.mlp.linear_fc1.layer_norm_weight", i, p + "post_attention_layernorm.weight", h),
            concat("decoder.layers.mlp.linear_fc1.weight", i,
                   [(p + "mlp.gate_proj.weight", F), (p + "mlp.up_proj.weight", F)]),
            single("decoder.layers.mlp.linear_fc2.weight", i, p + "mlp.down_proj.weight", h),
        ]
        if cfg.add_qkv_bias:
            maps.append(qkv("bias"))
        if cfg.add_proj_bias:
            maps.append(single("decoder.layers.self_attention.linear_proj.bias", i, p + "self_attn.o_proj.bias", h))
        if cfg.add_mlp_bias:
            maps.append(concat("decoder.layers.mlp.linear_fc1.bias", i,
                               [(p + "mlp.gate_proj.bias", F), (p + "mlp.up_proj.bias", F)]))
            maps.append(single("decoder.layers.mlp.linear_fc2.bias", i, p + "mlp.down_proj.bias", h))
    maps.append(single("decoder.final_layernorm.weight", None, "model.norm.weight", h))
    if not cfg.tie_word_embeddings:
        maps.append(single("output_layer.weight", None, "lm_head.weight", cfg.vocab_size, padded))
    missing = {m.canonical for m in maps} ^ specs
    assert not missing, f"mapping and sharding table disagree on {sorted(missing)}"
    return maps


# HF tensors that carry no weights of their own and may be present: tied checkpoints sometimes still save lm_head,
# and old checkpoints save rotary caches.
IGNORABLE_SUFFIXES = ("rotary_emb.inv_freq",)


def ignorable(cfg: ModelConfig, hf_name: str) -> bool:
    if hf_name.endswith(IGNORABLE_SUFFIXES):
        return True
    return cfg.tie_word_embeddings and hf_name == "lm_head.weight"
