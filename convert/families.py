"""model_type -> the module holding its HF mapping table. Adding a family = adding a module and a line here."""
from __future__ import annotations

from types import ModuleType

from checkpoint.config import SUPPORTED_MODEL_TYPES, ModelConfig
from checkpoint.errors import ConfigError

from . import deepseek, llama, mixtral

_FAMILIES: dict[str, ModuleType] = {mt: mod for mod in (llama, mixtral, deepseek) for mt in mod.MODEL_TYPES}


def for_config(cfg: ModelConfig) -> ModuleType:
    try:
        return _FAMILIES[cfg.model_type]
    except KeyError:
        raise ConfigError(f"model_type {cfg.model_type!r} has no converter; supported: "
                          f"{', '.join(SUPPORTED_MODEL_TYPES)}") from None


def tensor_maps(cfg: ModelConfig, layout, fp8: dict | None = None) -> list:
    """The family's table, plus the block-scale maps of kept-FP8 weights (`<name>_scale_inv`, rows in blocks)."""
    from checkpoint.sharding import SCALE_SUFFIX

    from .mapping import Segment, TensorMap

    maps = for_config(cfg).tensor_maps(cfg, layout)
    if not fp8:
        return maps
    br = fp8["block"][0]
    kept = set(fp8["tensors"])
    scales = []
    for tm in maps:
        if tm.canonical in kept:
            segs = tuple(Segment(s.hf_name + SCALE_SUFFIX, s.hf_start // br, s.start // br, -(-s.stop // br))
                         for s in tm.segments)
            scales.append(TensorMap(tm.canonical + SCALE_SUFFIX, tm.lead, segs, -(-tm.rows // br)))
    return maps + scales
