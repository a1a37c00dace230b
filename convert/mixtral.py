"""HF <-> Megatron-Core mapping for Mixtral: LLaMA attention, a softmax top-k router and stacked experts.

HF on disk: `block_sparse_moe.gate.weight` (router), `block_sparse_moe.experts.{e}.w1/w3/w2` (gate/up/down)."""
from __future__ import annotations

from checkpoint.config import ModelConfig
from checkpoint.layout import Layout

from . import llama
from .mapping import TensorMap, model_maps, routed_experts, single

MODEL_TYPES = ("mixtral",)


def layer_maps(cfg: ModelConfig, cprefix: str, hprefix: str, lead: tuple[int, ...], moe: bool) -> list[TensorMap]:
    h, m = cfg.hidden_size, hprefix + "block_sparse_moe."
    maps = llama.attention_maps(cfg, cprefix, hprefix, lead)
    maps.append(single(f"{cprefix}pre_mlp_layernorm.weight", lead, hprefix + "post_attention_layernorm.weight", h))
    maps.append(single(f"{cprefix}mlp.router.weight", lead, m + "gate.weight", cfg.num_moe_experts))
    maps += routed_experts(cfg, cprefix, lead, lambda e: (f"{m}experts.{e}.w1.weight", f"{m}experts.{e}.w3.weight",
                                                          f"{m}experts.{e}.w2.weight"))
    return maps


def tensor_maps(cfg: ModelConfig, layout: Layout) -> list[TensorMap]:
    return model_maps(cfg, layout, layer_maps)


ignorable = llama.ignorable
