"""Which engine continue-pretrain runs by default (train/engines/__init__.py `make_trainer` has the fallback): a leaf
that imports nothing of the trainer, so the trainer's config (train/config.py), the engines and scripts ask it without
an import cycle."""
from __future__ import annotations

import importlib.util

ENGINES = ("megatron-core", "native")


def megatron_core_installed() -> bool:
    """megatron-core importable, without importing it (an import registers its pickle safe globals)."""
    try:
        return importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None
    except (ImportError, ValueError):
        return False


def default_engine() -> str:
    import torch

    return "megatron-core" if torch.cuda.is_available() and megatron_core_installed() else "native"
