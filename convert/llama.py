"""HF <-> Megatron-Core mapping for the LLaMA family (Llama 2/3.x, Mistral, Qwen2): one table, both directions.
Mixtral reuses its attention."""
from __future__ import annotations

from checkpoint.config import ModelConfig
from checkpoint.layout import Layout

from .mapping import TensorMap, concat, gated_mlp, grouped_qkv, model_maps, single

MODEL_TYPES = ("llama", "mistral", "qwen2")


def attention_maps(cfg: ModelConfig, cprefix: str, hprefix: str, lead: tuple[int, ...]) -> list[TensorMap]:
    """Input norm fused into linear_qkv (TE naming), QKV grouped per query group, linear_proj."""
    h = cfg.hidden_size
    a = hprefix + "self_attn."

    def qkv(kind: str) -> TensorMap:
        return grouped_qkv(f"{cprefix}self_attention.linear_qkv.{kind}", lead, a + f"q_proj.{kind}",
                           a + f"k_proj.{kind}", a + f"v_proj.{kind}", cfg.num_query_groups, cfg.heads_per_group,
                           cfg.kv_channels)

    maps = [single(f"{cprefix}self_attention.linear_qkv.layer_norm_weight", lead, hprefix + "input_layernorm.weight",
                   h),
            qkv("weight"),
            single(f"{cprefix}self_attention.linear_proj.weight", lead, a + "o_proj.weight", h)]
    if cfg.add_qkv_bias:
        maps.append(qkv("bias"))
    if cfg.add_proj_bias:
        maps.append(single(f"{cprefix}self_attention.linear_proj.bias", lead, a + "o_proj.bias", h))
    return maps


def dense_mlp_maps(cfg: ModelConfig, cprefix: str, hprefix: str, lead: tuple[int, ...]) -> list[TensorMap]:
    """Post-attention norm fused into linear_fc1, fc1 = [gate; up], fc2 = down."""
    h, F = cfg.hidden_size, cfg.ffn_hidden_size
    m = hprefix + "mlp."
    maps = [single(f"{cprefix}mlp.linear_fc1.layer_norm_weight", lead, hprefix + "post_attention_layernorm.weight", h)]
    maps += gated_mlp(f"{cprefix}mlp", lead, m + "gate_proj.weight", m + "up_proj.weight", m + "down_proj.weight", F, h)
    if cfg.add_mlp_bias:
        maps.append(concat(f"{cprefix}mlp.linear_fc1.bias", lead, [(m + "gate_proj.bias", F), (m + "up_proj.bias", F)]))
        maps.append(single(f"{cprefix}mlp.linear_fc2.bias", lead, m + "down_proj.bias", h))
    return maps


def layer_maps(cfg: ModelConfig, cprefix: str, hprefix: str, lead: tuple[int, ...], moe: bool) -> list[TensorMap]:
    return attention_maps(cfg, cprefix, hprefix, lead) + dense_mlp_maps(cfg, cprefix, hprefix, lead)


def tensor_maps(cfg: ModelConfig, layout: Layout) -> list[TensorMap]:
    """Every canonical tensor (per layer for stacked ones) as row blocks of HF tensors."""
    return model_maps(cfg, layout, layer_maps)


# HF tensors that carry no weights of their own and may be present: old checkpoints save rotary caches (computed from
# the config). A tied checkpoint's saved lm_head is not ignorable: hf_to_mcore checks it equals the embedding.
IGNORABLE_SUFFIXES = ("rotary_emb.inv_freq",)


def ignorable(cfg: ModelConfig, hf_name: str) -> bool:
    return hf_name.endswith(IGNORABLE_SUFFIXES)
