"""Qwen3 (dense) and Qwen3-MoE: LLaMA's layer with a per-head RMSNorm of the queries and keys before RoPE
(megatron-core's `qk_layernorm`); Qwen3-MoE routes each token to the top-k of its experts by softmax, renormalising
the k weights when `norm_topk_prob` (no shared expert, no router bias), with dense MLP layers where `mlp_only_layers`
or `decoder_sparse_step` say.

HF on disk, layer i under `model.layers.{i}.`: `self_attn.{q,k,v,o}_proj` (+ biases with attention_bias),
`self_attn.{q,k}_norm` (one weight of head_dim each), and for an MoE layer `mlp.gate` (router) and
`mlp.experts.{e}.{gate,up,down}_proj`."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from ..errors import ConfigError
from ..sharding import Rule
from .llama import Llama, attention, dense_mlp, read_attention
from .mixtral import refuse_beyond_softmax_topk
from .table import Table

if TYPE_CHECKING:
    from ..config import ModelConfig


def _no_sliding_window(hf: dict, source: str, model_type: str) -> None:
    if hf.get("use_sliding_window") or any(t != "full_attention" for t in hf.get("layer_types") or []):
        raise ConfigError(f"{source}: use_sliding_window / sliding-window layer_types are not supported for "
                          f"{model_type}")


class Qwen3(Llama):
    model_type, architecture = "qwen3", "Qwen3ForCausalLM"
    fields = frozenset({"attention_bias", "use_sliding_window", "sliding_window", "max_window_layers", "layer_types"})
    qk_layernorm = True
    megatron_rank = 3

    def read_config(self, hf: dict, source: str, integer: Callable[..., int], common: dict) -> dict:
        _no_sliding_window(hf, source, self.model_type)
        bias = bool(hf.get("attention_bias", False))  # q, k, v and o
        return dict(**read_attention(hf, source, integer, common), add_qkv_bias=bias, add_proj_bias=bias,
                    qk_layernorm=True)

    def write_config(self, cfg: ModelConfig, out: dict, src: dict) -> None:
        if "attention_bias" in src or cfg.add_proj_bias:
            out["attention_bias"] = cfg.add_proj_bias

    def megatron_match(self, get) -> bool:
        return bool(get("qk_layernorm")) and not (get("num_experts") or get("num_moe_experts"))

    def megatron_to_hf(self, get, refuse, integer, hf: dict) -> None:
        self.refuse_attention_args(get, refuse)
        hf.update(intermediate_size=integer("ffn_hidden_size"), attention_bias=False)

    def refuse_attention_args(self, get, refuse) -> None:
        refuse(not get("qk_layernorm"), "qk_layernorm", f"{self.model_type} normalises queries and keys")
        # Megatron's add_bias_linear puts biases on every linear layer, Qwen3's attention_bias on attention only
        refuse(bool(get("add_bias_linear")), "add_bias_linear", f"{self.model_type} has no MLP biases")
        refuse(bool(get("add_qkv_bias")), "add_qkv_bias",
               f"{self.model_type}'s attention biases come with its HF config.json (attention_bias)")


class Qwen3Moe(Qwen3):
    model_type, architecture = "qwen3_moe", "Qwen3MoeForCausalLM"
    fields = Qwen3.fields | {"num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
                             "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers"}
    router_fp32 = False  # transformers' Qwen3-MoE router computes its logits in the activations' dtype
    megatron_rank = 4

    def read_config(self, hf: dict, source: str, integer: Callable[..., int], common: dict) -> dict:
        a, b = hf.get("num_experts"), hf.get("num_local_experts")  # transformers 5 writes the second
        if a is not None and b is not None and a != b:
            raise ConfigError(f"{source}: num_experts={a} and num_local_experts={b} disagree")
        experts = integer("num_experts", a if a is not None else b)
        topk = integer("num_experts_per_tok")
        if topk > experts:
            raise ConfigError(f"{source}: num_experts_per_tok {topk} exceeds num_experts {experts}")
        layers = common["num_layers"]
        step = hf.get("decoder_sparse_step", 1)
        dense = hf.get("mlp_only_layers") or []
        if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < layers for i in dense):
            raise ConfigError(f"{source}: mlp_only_layers={dense!r} must list layer indices below {layers}")
        freq = [int(i not in dense and (i + 1) % step == 0) for i in range(layers)]
        if not any(freq):
            raise ConfigError(f"{source}: no layer has experts (decoder_sparse_step={step}, mlp_only_layers)")
        return dict(**super().read_config(hf, source, integer, common),
                    num_moe_experts=experts, moe_router_topk=topk,
                    moe_ffn_hidden_size=integer("moe_intermediate_size"), moe_layer_freq=freq,
                    moe_router_score_function="softmax", moe_router_norm_topk=bool(hf.get("norm_topk_prob", False)),
                    moe_aux_loss_coeff=float(hf.get("router_aux_loss_coef") or 0.0))

    def write_config(self, cfg: ModelConfig, out: dict, src: dict) -> None:
        super().write_config(cfg, out, src)
        key = "num_local_experts" if "num_local_experts" in src and "num_experts" not in src else "num_experts"
        out.update({key: cfg.num_moe_experts}, num_experts_per_tok=cfg.moe_router_topk,
                   moe_intermediate_size=cfg.moe_ffn_hidden_size, norm_topk_prob=cfg.moe_router_norm_topk)
        step = src.get("decoder_sparse_step", 1)
        dense = [i for i, f in enumerate(cfg.moe_layer_freq) if not f]
        if not all(f == int((i + 1) % step == 0) for i, f in enumerate(cfg.moe_layer_freq) if i not in dense):
            step = 1
        out.update(decoder_sparse_step=step, mlp_only_layers=[i for i in dense if (i + 1) % step == 0])

    def layer(self, t: Table, cfg: ModelConfig, moe: bool) -> None:
        attention(t, cfg)
        if not moe:
            dense_mlp(t, cfg)
            return
        h = cfg.hidden_size
        t.add("pre_mlp_layernorm.weight", (h,), Rule.REPLICATED, "post_attention_layernorm.weight")
        t.add("mlp.router.weight", (cfg.num_moe_experts, h), Rule.REPLICATED, "mlp.gate.weight")
        t.experts(cfg, lambda e: (f"mlp.experts.{e}.gate_proj.weight", f"mlp.experts.{e}.up_proj.weight",
                                  f"mlp.experts.{e}.down_proj.weight"))

    def megatron_match(self, get) -> bool:
        return bool(get("qk_layernorm")) and bool(get("num_experts") or get("num_moe_experts"))

    def megatron_to_hf(self, get, refuse, integer, hf: dict) -> None:
        self.refuse_attention_args(get, refuse)
        refuse_beyond_softmax_topk(get, refuse, "Qwen3-MoE")
        layers = integer("num_layers")
        freq = get("moe_layer_freq", 1)
        if isinstance(freq, int):
            freq = [int(i % freq == 0) for i in range(layers)]
        refuse(not (isinstance(freq, (list, tuple)) and len(freq) == layers), "moe_layer_freq",
               f"expected one entry per layer ({layers})")
        hf.update(num_experts=get("num_experts") or get("num_moe_experts"),
                  num_experts_per_tok=integer("moe_router_topk"),
                  moe_intermediate_size=integer("moe_ffn_hidden_size", "ffn_hidden_size"),
                  intermediate_size=get("ffn_hidden_size") or integer("moe_ffn_hidden_size"),
                  # pre-softmax: softmax over all experts, top-k kept as they are; else softmax over the top-k
                  norm_topk_prob=not get("moe_router_pre_softmax"), decoder_sparse_step=1,
                  mlp_only_layers=[i for i, f in enumerate(freq) if not f], attention_bias=False,
                  router_aux_loss_coef=float(get("moe_aux_loss_coeff", 0.0)))


QWEN3, QWEN3_MOE = Qwen3(), Qwen3Moe()
