"""HF <-> Megatron-Core mapping for DeepSeek-V2, V2-Lite and V3: multi-latent attention, routed + shared experts with
the V3 router bias, leading dense layers, and multi-token-prediction (MTP) layers.

HF keeps MTP layer i at `model.layers.{num_hidden_layers + i}`, with its own copies of the embedding and the output
head; Megatron shares those with the main model, so on import the copies must equal the main tensors (checked, never
dropped silently) and on export they are written back from the shared ones."""
from __future__ import annotations

from checkpoint.config import ModelConfig
from checkpoint.layout import Layout

from . import llama
from .mapping import TensorMap, gated_mlp, model_maps, routed_experts, single

MODEL_TYPES = ("deepseek_v2", "deepseek_v3")


def attention_maps(cfg: ModelConfig, cprefix: str, hprefix: str, lead: tuple[int, ...]) -> list[TensorMap]:
    c, a = cprefix + "self_attention.", hprefix + "self_attn."
    nh = cfg.num_attention_heads
    maps = [single(cprefix + "input_layernorm.weight", lead, hprefix + "input_layernorm.weight", cfg.hidden_size)]
    if cfg.q_lora_rank:
        maps += [single(c + "linear_q_down_proj.weight", lead, a + "q_a_proj.weight", cfg.q_lora_rank),
                 single(c + "linear_q_up_proj.layer_norm_weight", lead, a + "q_a_layernorm.weight", cfg.q_lora_rank),
                 single(c + "linear_q_up_proj.weight", lead, a + "q_b_proj.weight", nh * cfg.q_head_dim)]
    else:
        maps.append(single(c + "linear_q_proj.weight", lead, a + "q_proj.weight", nh * cfg.q_head_dim))
    maps += [
        single(c + "linear_kv_down_proj.weight", lead, a + "kv_a_proj_with_mqa.weight",
               cfg.kv_lora_rank + cfg.qk_pos_emb_head_dim),
        single(c + "linear_kv_up_proj.layer_norm_weight", lead, a + "kv_a_layernorm.weight", cfg.kv_lora_rank),
        single(c + "linear_kv_up_proj.weight", lead, a + "kv_b_proj.weight", nh * (cfg.qk_head_dim + cfg.v_head_dim)),
        single(c + "linear_proj.weight", lead, a + "o_proj.weight", cfg.hidden_size),
    ]
    return maps


def moe_maps(cfg: ModelConfig, cprefix: str, hprefix: str, lead: tuple[int, ...]) -> list[TensorMap]:
    h, m = cfg.hidden_size, hprefix + "mlp."
    maps = [single(cprefix + "pre_mlp_layernorm.weight", lead, hprefix + "post_attention_layernorm.weight", h),
            single(cprefix + "mlp.router.weight", lead, m + "gate.weight", cfg.num_moe_experts)]
    if cfg.moe_router_enable_expert_bias:
        maps.append(single(cprefix + "mlp.router.expert_bias", lead, m + "gate.e_score_correction_bias",
                           cfg.num_moe_experts))
    maps += routed_experts(cfg, cprefix, lead, lambda e: (f"{m}experts.{e}.gate_proj.weight",
                                                          f"{m}experts.{e}.up_proj.weight",
                                                          f"{m}experts.{e}.down_proj.weight"))
    if cfg.moe_shared_expert_intermediate_size:
        s = m + "shared_experts."
        maps += gated_mlp(cprefix + "mlp.shared_experts", lead, s + "gate_proj.weight", s + "up_proj.weight",
                          s + "down_proj.weight", cfg.moe_shared_expert_intermediate_size, h)
    return maps


def layer_maps(cfg: ModelConfig, cprefix: str, hprefix: str, lead: tuple[int, ...], moe: bool) -> list[TensorMap]:
    mlp = moe_maps if moe else llama.dense_mlp_maps
    return attention_maps(cfg, cprefix, hprefix, lead) + mlp(cfg, cprefix, hprefix, lead)


def mtp_maps(cfg: ModelConfig, i: int) -> list[TensorMap]:
    h = cfg.hidden_size
    c, p = f"mtp.layers.{i}.", f"model.layers.{cfg.num_layers + i}."
    return [single(c + "enorm.weight", (), p + "enorm.weight", h),
            single(c + "hnorm.weight", (), p + "hnorm.weight", h),
            single(c + "eh_proj.weight", (), p + "eh_proj.weight", h),
            single(c + "final_layernorm.weight", (), p + "shared_head.norm.weight", h),
            *layer_maps(cfg, c + "transformer_layer.", p, (), cfg.is_moe)]


def tensor_maps(cfg: ModelConfig, layout: Layout) -> list[TensorMap]:
    return model_maps(cfg, layout, layer_maps, mtp_maps)


def shared_copies(cfg: ModelConfig) -> dict[str, str]:
    """HF tensors that duplicate a main-model tensor: MTP layers' embedding and output head."""
    out = {}
    for i in range(cfg.mtp_num_layers):
        p = f"model.layers.{cfg.num_layers + i}."
        out[p + "embed_tokens.weight"] = "model.embed_tokens.weight"
        out[p + "shared_head.head.weight"] = "lm_head.weight"
    return out


ignorable = llama.ignorable
