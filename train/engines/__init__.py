"""continue-pretrain's engines (issue 40): `native` (train/loop.py's Trainer: shardkit's own parallel engine in plain
torch) and `megatron-core` (train/engines/megatron_core.py: megatron-core's GPTModel, DDP, distributed optimizer and
pipeline schedules, fed from and saving to shardkit's checkpoints). `--engine` picks one; by default megatron-core on
CUDA where it is installed and the run is one it covers, native otherwise (always on the CPU)."""
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


def make_trainer(cfg, log=print):
    """The Trainer of the engine `cfg.run.engine` names (None: the default). A default megatron-core choice that the
    run's flags or model fall outside of goes to the native engine, with a note saying why; an explicit
    `--engine megatron-core` is refused in one line instead."""
    from train.loop import Trainer

    engine = getattr(cfg.run, "engine", None)
    chosen = engine or default_engine()
    if chosen == "native":
        return Trainer(cfg)
    from train.engines.megatron_core import MegatronCoreTrainer, NotCovered

    try:
        return MegatronCoreTrainer(cfg)
    except NotCovered as e:
        if engine:  # asked for by name: refused
            raise e.as_config_error() from None
        from dataclasses import replace

        trainer = Trainer(replace(cfg, run=replace(cfg.run, engine="native")))  # e.g. --overlap-* refused there
        trainer.notes.append(f"note: engine native (the megatron-core engine, the default on CUDA, does not cover "
                             f"this run: {e})")
        return trainer
