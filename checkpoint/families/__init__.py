"""The model families shardkit reads, and the one registry every other package asks.

Adding a family is one module here (a `Family` subclass: its config.json fields, its tensor table with HF names, its
Megatron-LM args; see base.py) and one `register` line below; docs/architecture.md has the checklist. The config
reader, the sharding table, the converters, the Megatron module, the trainer and verify read the family through
`family_of`; no `model_type` is tested anywhere else.
"""
from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING

from ..errors import ConfigError
from .base import Family
from .table import model_table

if TYPE_CHECKING:
    from ..config import ModelConfig
    from ..layout import Layout
    from ..sharding import TensorSpec
    from .mapping import TensorMap

_REGISTRY: dict[str, Family] = {}
_IMPORTED: set[str] = set()
PLUGINS_ENV = "SHARDKIT_FAMILIES"


def register(family: Family) -> Family:
    """Make `family` readable by every command (a test registers its own to prove adding one is this one call)."""
    if not family.model_type or not family.architecture:
        raise ValueError(f"{type(family).__name__}: a family needs its model_type and architecture")
    _REGISTRY[family.model_type] = family
    return family


def unregister(model_type: str) -> None:
    _REGISTRY.pop(model_type, None)


def load_plugins() -> None:
    """Families defined outside shardkit: the modules named in $SHARDKIT_FAMILIES (comma-separated, importable from
    the Python path), each registering its families when imported. Read when a model_type is not (yet) known, so a
    process that imported shardkit before the variable was set (a forked rank) still finds them."""
    for name in (n.strip() for n in os.environ.get(PLUGINS_ENV, "").split(",")):
        if name and name not in _IMPORTED:
            _IMPORTED.add(name)
            try:
                importlib.import_module(name)
            except ImportError as e:
                raise ConfigError(f"${PLUGINS_ENV}: cannot import family module {name!r} ({e})") from None


def supported_model_types() -> tuple[str, ...]:
    load_plugins()
    return tuple(_REGISTRY)


def family_of(model_type: str, source: str = "model config") -> Family:
    """The family of an HF model_type; ConfigError naming `source` and the supported ones otherwise."""
    if isinstance(model_type, str) and model_type not in _REGISTRY:
        load_plugins()
    fam = _REGISTRY.get(model_type) if isinstance(model_type, str) else None
    if fam is None:
        raise ConfigError(f"{source}: unsupported model_type {model_type!r}; supported: "
                          f"{', '.join(supported_model_types())}")
    return fam


def megatron_family(get) -> Family:
    """The family Megatron-LM args (`get(name)` reads one) describe: the highest-ranked family that claims them."""
    claims = [f for f in _REGISTRY.values() if f.from_megatron and f.megatron_match(get)]
    return max(claims, key=lambda f: f.megatron_rank)


def megatron_model_types() -> tuple[str, ...]:
    """The model types `config_from_megatron_args` can build (`convert megatron-to-mcore --model-type`)."""
    return tuple(mt for mt, f in _REGISTRY.items() if f.from_megatron)


# -- the tensor table, projected ---------------------------------------------------------------------------------------

def model_specs(cfg: ModelConfig, layout: Layout) -> list[TensorSpec]:
    """Every canonical tensor of `cfg` as stored for `layout` (vocab padding depends on layout.tp): the sharding
    table's entries, one per stacked tensor."""
    return model_table(family_of(cfg.model_type), cfg, layout, "specs").specs


def tensor_maps(cfg: ModelConfig, layout: Layout, fp8: dict | None = None) -> list[TensorMap]:
    """Every canonical tensor (per layer and expert for stacked ones) as row blocks of HF tensors, plus the
    block-scale maps of kept-FP8 weights (`<name>_scale_inv`, rows in blocks)."""
    from ..sharding import SCALE_SUFFIX
    from .mapping import Segment, TensorMap

    maps = model_table(family_of(cfg.model_type), cfg, layout, "maps").maps
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


# -- the families -------------------------------------------------------------------------------------------------------
# the order is the order `supported` lists them in messages
from .deepseek import DEEPSEEK_V2, DEEPSEEK_V3  # noqa: E402
from .llama import LLAMA, MISTRAL, QWEN2  # noqa: E402
from .mixtral import MIXTRAL  # noqa: E402
from .qwen3 import QWEN3, QWEN3_MOE  # noqa: E402

for _family in (LLAMA, MISTRAL, QWEN2, QWEN3, MIXTRAL, QWEN3_MOE, DEEPSEEK_V2, DEEPSEEK_V3):
    register(_family)
