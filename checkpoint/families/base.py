"""What a model family is: one object per HF `model_type`, holding everything shardkit knows about it.

A family module defines a `Family` subclass and an instance per model_type it reads; the registry
(checkpoint/families/__init__.py) is the only place that lists them. Nothing outside checkpoint/families tests a
`model_type`: the config reader, the converters, the Megatron module, the trainer and verify ask the family.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from ..config import ModelConfig
    from .table import Table

# HF tensors that carry no weights of their own and may be present: old checkpoints save rotary caches (computed from
# the config). A tied checkpoint's saved lm_head is not ignorable: hf_to_mcore checks it equals the embedding.
ROTARY_CACHE = ("rotary_emb.inv_freq",)


class Family:
    """One HF model_type. Subclasses set the class attributes and override the methods their model needs."""

    model_type: str = ""
    architecture: str = ""  # the HF architecture written into an exported config.json without a source one
    # config.json fields this family interprets beyond the ones every family reads (checkpoint.config.COMMON_FIELDS)
    fields: frozenset[str] = frozenset()
    # HF names of the tensors outside the decoder layers, and of decoder layer i's prefix
    hf_embedding = "model.embed_tokens.weight"
    hf_final_norm = "model.norm.weight"
    hf_output = "lm_head.weight"
    hf_layer = "model.layers.{i}."
    # RMSNorm of each query and key head (Megatron's --qk-layernorm): Megatron-LM args with it are this family's
    qk_layernorm: bool = False
    # an MoE router computes its logits in fp32 (DeepSeek keeps its gate there); False: in the activations' dtype,
    # as transformers' Mixtral does
    router_fp32: bool = True
    # Megatron-LM args (checkpoint.megatron.config_from_megatron_args) can describe this family, and `convert
    # megatron-to-mcore --model-type` offers it; `megatron_match` says which args it is (highest rank wins)
    from_megatron: bool = False
    megatron_rank: int = 0

    # -- config.json ------------------------------------------------------------------------------------------------
    def read_config(self, hf: dict, source: str, integer: Callable[..., int], common: dict) -> dict:
        """The ModelConfig fields beyond `common` (the ones every family reads) from config.json `hf` (transformers'
        defaults already filled in). ConfigError naming `source` and the field on anything unsupported."""
        raise NotImplementedError

    def write_config(self, cfg: ModelConfig, out: dict, src: dict) -> None:
        """The family's fields of an exported config.json, written into `out` (the source's own dict `src`, common
        fields already rewritten), in the source's style."""

    # -- the tensor table -------------------------------------------------------------------------------------------
    def layer(self, t: Table, cfg: ModelConfig, moe: bool) -> None:
        """Declare one decoder layer's tensors (`moe`: its MLP is a mixture of experts)."""
        raise NotImplementedError

    def mtp_layer(self, t: Table, cfg: ModelConfig, i: int) -> None:
        """Declare multi-token-prediction layer i's tensors (families with MTP only)."""
        raise NotImplementedError(f"{self.model_type} has no MTP layers")

    def shared_copies(self, cfg: ModelConfig) -> dict[str, str]:
        """HF tensors that duplicate another HF tensor Megatron shares (checked equal on import, written back on
        export): HF name of the copy -> HF name of the main tensor."""
        return {}

    def ignorable(self, cfg: ModelConfig, hf_name: str) -> bool:
        """An HF tensor that may be present and carries nothing (never a weight dropped silently)."""
        return hf_name.endswith(ROTARY_CACHE)

    def rotary_interleaved(self, cfg: ModelConfig) -> bool:
        """RoPE rotates interleaved pairs (as complex numbers) rather than the two halves."""
        return cfg.rotary_interleaved

    # -- Megatron-LM args -------------------------------------------------------------------------------------------
    def megatron_match(self, get: Callable[..., Any]) -> bool:
        """These Megatron-LM args (get(name) reads one) describe a model of this family."""
        return False

    def megatron_to_hf(self, get: Callable[..., Any], refuse: Callable[[bool, str, str], None],
                       integer: Callable[..., int], hf: dict) -> None:
        """Fill the family's config.json fields of `hf` from Megatron-LM args; `refuse(cond, arg, why)` for args the
        family cannot express."""
