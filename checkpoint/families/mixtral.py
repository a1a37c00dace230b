"""Mixtral: LLaMA attention (Mistral's sliding-window field), a softmax top-k router and stacked experts.

HF on disk: `block_sparse_moe.gate.weight` (router), `block_sparse_moe.experts.{e}.w1/w3/w2` (gate/up/down)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from ..errors import ConfigError
from ..sharding import Rule
from .llama import Mistral, attention, read_attention, sliding_window
from .table import Table

if TYPE_CHECKING:
    from ..config import ModelConfig


def refuse_beyond_softmax_topk(get, refuse, name: str) -> None:
    """Megatron-LM MoE args a plain softmax top-k router over routed experts cannot express (Mixtral, Qwen3-MoE)."""
    refuse(bool(get("moe_shared_expert_intermediate_size")), "moe_shared_expert_intermediate_size",
           f"{name} has no shared experts")
    refuse(get("moe_router_score_function", "softmax") != "softmax", "moe_router_score_function",
           f"{name} routes with softmax")
    refuse(get("moe_router_topk_scaling_factor") not in (None, 1, 1.0), "moe_router_topk_scaling_factor",
           f"{name} does not scale routing weights")
    refuse(bool(get("moe_router_num_groups")), "moe_router_num_groups", f"{name} routes without groups")
    refuse(bool(get("moe_router_enable_expert_bias")), "moe_router_enable_expert_bias", f"{name} has no expert bias")


class Mixtral(Mistral):
    model_type, architecture = "mixtral", "MixtralForCausalLM"
    fields = frozenset({"sliding_window", "num_local_experts", "num_experts_per_tok"})
    router_fp32 = False  # transformers' Mixtral routes in the activations' dtype
    megatron_rank = 2

    def read_config(self, hf: dict, source: str, integer: Callable[..., int], common: dict) -> dict:
        moe = dict(num_moe_experts=integer("num_local_experts"), moe_router_topk=integer("num_experts_per_tok"),
                   moe_ffn_hidden_size=common["ffn_hidden_size"], moe_layer_freq=[1] * common["num_layers"],
                   moe_router_score_function="softmax", moe_router_norm_topk=True,
                   moe_aux_loss_coeff=float(hf.get("router_aux_loss_coef") or 0.0))
        if moe["moe_router_topk"] > moe["num_moe_experts"]:
            raise ConfigError(f"{source}: num_experts_per_tok exceeds num_local_experts")
        return dict(**read_attention(hf, source, integer, common), **sliding_window(hf, integer), **moe)

    def write_config(self, cfg: ModelConfig, out: dict, src: dict) -> None:
        out.update(num_local_experts=cfg.num_moe_experts, num_experts_per_tok=cfg.moe_router_topk)
        super().write_config(cfg, out, src)

    def layer(self, t: Table, cfg: ModelConfig, moe: bool) -> None:
        h, m = cfg.hidden_size, "block_sparse_moe."
        attention(t, cfg)
        t.add("pre_mlp_layernorm.weight", (h,), Rule.REPLICATED, "post_attention_layernorm.weight")
        t.add("mlp.router.weight", (cfg.num_moe_experts, h), Rule.REPLICATED, m + "gate.weight")
        t.experts(cfg, lambda e: (f"{m}experts.{e}.w1.weight", f"{m}experts.{e}.w3.weight",
                                  f"{m}experts.{e}.w2.weight"))

    def megatron_match(self, get) -> bool:
        return bool(get("num_experts") or get("num_moe_experts"))

    def megatron_ffn(self, integer) -> int:
        return integer("moe_ffn_hidden_size", "ffn_hidden_size")

    def megatron_to_hf(self, get, refuse, integer, hf: dict) -> None:
        experts = get("num_experts") or get("num_moe_experts")
        if not experts:
            raise ConfigError("Megatron args: hf_model_type 'mixtral' but num_experts is not set")
        super().megatron_to_hf(get, refuse, integer, hf)
        freq = get("moe_layer_freq", 1)
        refuse(not (freq == 1 or (isinstance(freq, (list, tuple)) and set(freq) == {1})), "moe_layer_freq",
               "Mixtral has an MoE MLP in every layer")
        refuse_beyond_softmax_topk(get, refuse, "Mixtral")
        refuse(bool(get("moe_router_pre_softmax")), "moe_router_pre_softmax",
               "Mixtral renormalises the top-k probabilities")
        hf.update(num_local_experts=experts, num_experts_per_tok=integer("moe_router_topk"),
                  router_aux_loss_coef=float(get("moe_aux_loss_coeff", 0.0)))


MIXTRAL = Mixtral()
