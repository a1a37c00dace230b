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
