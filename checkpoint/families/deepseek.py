"""DeepSeek-V2, V2-Lite and V3: multi-latent attention, routed + shared experts with the V3 router bias, leading
dense layers, and multi-token-prediction (MTP) layers.

HF keeps MTP layer i at `model.layers.{num_hidden_layers + i}`, with its own copies of the embedding and the output
head; Megatron shares those with the main model, so on import the copies must equal the main tensors (checked, never
dropped silently) and on export they are written back from the shared ones."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from ..errors import ConfigError
from ..sharding import Rule
from .base import Family
from .llama import dense_mlp
from .table import Table

if TYPE_CHECKING:
    from ..config import ModelConfig

# DeepSeek routers: HF topk_method -> (score function, group-limited, expert bias)
TOPK_METHODS = {"greedy": ("softmax", False, False), "group_limited_greedy": ("softmax", True, False),
                "noaux_tc": ("sigmoid", True, True)}


class DeepseekV2(Family):
    model_type, architecture = "deepseek_v2", "DeepseekV2ForCausalLM"
    fields = frozenset({
        "attention_bias", "mlp_bias", "first_k_dense_replace", "moe_layer_freq", "n_routed_experts",
        "n_shared_experts", "moe_intermediate_size", "num_experts_per_tok", "n_group", "topk_group", "topk_method",
        "norm_topk_prob", "routed_scaling_factor", "scoring_func", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
        "qk_rope_head_dim", "v_head_dim", "qk_head_dim", "num_nextn_predict_layers", "quantization_config",
        "rope_interleave"})

    def read_config(self, hf: dict, source: str, integer: Callable[..., int], common: dict) -> dict:
        """MoE + multi-latent attention + MTP fields (MLA sizes its heads itself: qk_*_head_dim, v_head_dim)."""
        if hf.get("attention_bias") or hf.get("mlp_bias"):
            raise ConfigError(f"{source}: attention_bias / mlp_bias are not supported for {self.model_type}")
        hidden, heads = common["hidden_size"], common["num_attention_heads"]
        if self.model_type == "deepseek_v2" and hidden % heads:  # transformers' V2 config refuses it (V3's does not)
            raise ConfigError(f"{source}: hidden_size {hidden} is not divisible by num_attention_heads {heads}")
        mt = self.model_type
        method = hf.get("topk_method") or ("noaux_tc" if mt == "deepseek_v3" else "greedy")
        if method not in TOPK_METHODS or (mt == "deepseek_v3" and method != "noaux_tc"):
            raise ConfigError(f"{source}: router topk_method {method!r} is not supported for {mt}; supported: "
                              f"{'noaux_tc' if mt == 'deepseek_v3' else ', '.join(TOPK_METHODS)}")
        score, grouped, bias = TOPK_METHODS[method]
        scoring = hf.get("scoring_func", score)
        if scoring != score:
            raise ConfigError(f"{source}: scoring_func {scoring!r} does not match topk_method {method!r} (expects {score!r})")
        experts = integer("n_routed_experts")
        topk = integer("num_experts_per_tok")
        first_dense = hf.get("first_k_dense_replace") or 0
        freq = hf.get("moe_layer_freq", 1)
        if not isinstance(first_dense, int) or first_dense < 0:
            raise ConfigError(f"{source}: first_k_dense_replace must be a non-negative integer, got {first_dense!r}")
        if freq != 1:  # transformers ignores it; DeepSeek's own code skips layers: refuse rather than guess
            raise ConfigError(f"{source}: moe_layer_freq={freq!r} is not supported (only 1)")
        if mt == "deepseek_v2" and hf.get("norm_topk_prob"):
            # transformers' V2 router never renormalises, DeepSeek's renormalises instead of scaling: ambiguous
            raise ConfigError(f"{source}: norm_topk_prob=true is not supported for deepseek_v2")
        if mt == "deepseek_v2" and hf.get("rope_interleave") is False:
            raise ConfigError(f"{source}: rope_interleave=false is not supported for deepseek_v2 (always interleaved)")
        n_group, topk_group = hf.get("n_group") or 1, hf.get("topk_group") or 1
        if grouped and (experts % n_group or topk_group > n_group):
            raise ConfigError(f"{source}: n_group={n_group} must divide n_routed_experts={experts} and be >= "
                              f"topk_group={topk_group}")
        qk = hf.get("qk_head_dim")
        if qk is not None and qk != hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"]:
            raise ConfigError(f"{source}: qk_head_dim={qk} is not qk_nope_head_dim + qk_rope_head_dim = "
                              f"{hf['qk_nope_head_dim'] + hf['qk_rope_head_dim']}")
        shared = hf.get("n_shared_experts") or 0
        moe_ffn = integer("moe_intermediate_size")
        q_lora = hf.get("q_lora_rank")
        quant = hf.get("quantization_config")
        if quant is not None:
            blocks = quant.get("weight_block_size") if isinstance(quant, dict) else None
            if not isinstance(quant, dict) or quant.get("quant_method") != "fp8" or quant.get("fmt", "e4m3") != "e4m3" \
                    or not (isinstance(blocks, list) and len(blocks) == 2 and all(isinstance(b, int) and b > 0
                                                                                  for b in blocks)):
                raise ConfigError(f"{source}: quantization_config {quant!r} is not supported (only fp8 e4m3 with "
                                  "weight_block_size [r, c])")
        return dict(
            num_query_groups=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            kv_channels=integer("v_head_dim"),
            num_moe_experts=experts, moe_router_topk=topk, moe_ffn_hidden_size=moe_ffn,
            moe_shared_expert_intermediate_size=shared * moe_ffn if shared else None,
            moe_layer_freq=[int(i >= first_dense and i % freq == 0) for i in range(common["num_layers"])],
            moe_router_score_function=score, moe_router_norm_topk=bool(hf.get("norm_topk_prob", False)),
            moe_router_topk_scaling_factor=float(hf.get("routed_scaling_factor") or 1.0),
            moe_router_num_groups=n_group if grouped else None, moe_router_group_topk=topk_group if grouped else None,
            moe_router_enable_expert_bias=bias,
            moe_aux_loss_coeff=float(hf.get("aux_loss_alpha") or 0.0),
            multi_latent_attention=True,
            q_lora_rank=integer("q_lora_rank", q_lora) if q_lora is not None else None,
            kv_lora_rank=integer("kv_lora_rank"), qk_head_dim=integer("qk_nope_head_dim"),
            qk_pos_emb_head_dim=integer("qk_rope_head_dim"), v_head_dim=integer("v_head_dim"),
            rotary_interleaved=mt == "deepseek_v2" or bool(hf.get("rope_interleave", True)),
            mtp_num_layers=hf.get("num_nextn_predict_layers") or 0,
        )

    def write_config(self, cfg: ModelConfig, out: dict, src: dict) -> None:
        freq = cfg.moe_layer_freq
        method = {"sigmoid": "noaux_tc"}.get(cfg.moe_router_score_function,
                                             "group_limited_greedy" if cfg.moe_router_num_groups else "greedy")
        out.update(
            n_routed_experts=cfg.num_moe_experts, num_experts_per_tok=cfg.moe_router_topk,
            moe_intermediate_size=cfg.moe_ffn_hidden_size,
            n_shared_experts=(cfg.moe_shared_expert_intermediate_size or 0) // cfg.moe_ffn_hidden_size,
            first_k_dense_replace=freq.index(1) if 1 in freq else len(freq),
            norm_topk_prob=cfg.moe_router_norm_topk, routed_scaling_factor=cfg.moe_router_topk_scaling_factor,
            n_group=cfg.moe_router_num_groups or src.get("n_group", 1),
            topk_group=cfg.moe_router_group_topk or src.get("topk_group", 1),
            q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_head_dim,
            qk_rope_head_dim=cfg.qk_pos_emb_head_dim, v_head_dim=cfg.v_head_dim)
        if "topk_method" in src or self.model_type == "deepseek_v2":
            out["topk_method"] = method
        if "scoring_func" in src:
            out["scoring_func"] = cfg.moe_router_score_function
        if cfg.mtp_num_layers or "num_nextn_predict_layers" in src:
            out["num_nextn_predict_layers"] = cfg.mtp_num_layers

    # -- the tensor table -------------------------------------------------------------------------------------------
    def layer(self, t: Table, cfg: ModelConfig, moe: bool) -> None:
        attention(t, cfg)
        (moe_mlp if moe else dense_mlp)(t, cfg)

    def mtp_layer(self, t: Table, cfg: ModelConfig, i: int) -> None:
        h = cfg.hidden_size
        t.add("enorm.weight", (h,), Rule.REPLICATED, "enorm.weight")
        t.add("hnorm.weight", (h,), Rule.REPLICATED, "hnorm.weight")
        t.add("eh_proj.weight", (h, 2 * h), Rule.COLUMN, "eh_proj.weight")
        t.add("final_layernorm.weight", (h,), Rule.REPLICATED, "shared_head.norm.weight")
        self.layer(t.sub(t.cprefix + "transformer_layer.", t.hprefix, t.lead), cfg, cfg.is_moe)

    def rotary_interleaved(self, cfg: ModelConfig) -> bool:
        """HF V2 always rotates interleaved pairs (as complex numbers); V3 does when rope_interleave (its default)."""
        return self.model_type == "deepseek_v2" or cfg.rotary_interleaved

    def shared_copies(self, cfg: ModelConfig) -> dict[str, str]:
        """MTP layers' embedding and output head."""
        out = {}
        for i in range(cfg.mtp_num_layers):
            p = self.hf_layer.format(i=cfg.num_layers + i)
            out[p + "embed_tokens.weight"] = self.hf_embedding
            out[p + "shared_head.head.weight"] = self.hf_output
        return out


def attention(t: Table, cfg: ModelConfig) -> None:
    """Multi-latent attention: low-rank q (or a plain q projection: V2-Lite), a shared kv latent with its RoPE head."""
    h, nh = cfg.hidden_size, cfg.num_attention_heads
    c, a = "self_attention.", "self_attn."
    t.add("input_layernorm.weight", (h,), Rule.REPLICATED, "input_layernorm.weight")
    if cfg.q_lora_rank:
        t.add(c + "linear_q_down_proj.weight", (cfg.q_lora_rank, h), Rule.REPLICATED, a + "q_a_proj.weight")
        t.add(c + "linear_q_up_proj.layer_norm_weight", (cfg.q_lora_rank,), Rule.REPLICATED,
              a + "q_a_layernorm.weight")
        t.add(c + "linear_q_up_proj.weight", (nh * cfg.q_head_dim, cfg.q_lora_rank), Rule.COLUMN,
              a + "q_b_proj.weight")
    else:
        t.add(c + "linear_q_proj.weight", (nh * cfg.q_head_dim, h), Rule.COLUMN, a + "q_proj.weight")
    t.add(c + "linear_kv_down_proj.weight", (cfg.kv_lora_rank + cfg.qk_pos_emb_head_dim, h), Rule.REPLICATED,
          a + "kv_a_proj_with_mqa.weight")
    t.add(c + "linear_kv_up_proj.layer_norm_weight", (cfg.kv_lora_rank,), Rule.REPLICATED,
          a + "kv_a_layernorm.weight")
    t.add(c + "linear_kv_up_proj.weight", (nh * (cfg.qk_head_dim + cfg.v_head_dim), cfg.kv_lora_rank), Rule.COLUMN,
          a + "kv_b_proj.weight")
    t.add(c + "linear_proj.weight", (h, nh * cfg.v_head_dim), Rule.ROW, a + "o_proj.weight")


def moe_mlp(t: Table, cfg: ModelConfig) -> None:
    h, E, m = cfg.hidden_size, cfg.num_moe_experts, "mlp."
    t.add("pre_mlp_layernorm.weight", (h,), Rule.REPLICATED, "post_attention_layernorm.weight")
    t.add("mlp.router.weight", (E, h), Rule.REPLICATED, m + "gate.weight")
    if cfg.moe_router_enable_expert_bias:
        t.add("mlp.router.expert_bias", (E,), Rule.REPLICATED, m + "gate.e_score_correction_bias")
    t.experts(cfg, lambda e: (f"{m}experts.{e}.gate_proj.weight", f"{m}experts.{e}.up_proj.weight",
                              f"{m}experts.{e}.down_proj.weight"))
    S = cfg.moe_shared_expert_intermediate_size
    if S:
        s = m + "shared_experts."
        t.gated_mlp("mlp.shared_experts", S, h, s + "gate_proj.weight", s + "up_proj.weight", s + "down_proj.weight")


class DeepseekV3(DeepseekV2):
    model_type, architecture = "deepseek_v3", "DeepseekV3ForCausalLM"


DEEPSEEK_V2, DEEPSEEK_V3 = DeepseekV2(), DeepseekV3()
