"""continue-pretrain's engines (issue 40): `native` (train/loop.py's Trainer: shardkit's own parallel engine in plain
torch) and `megatron-core` (train/engines/megatron_core/: megatron-core's GPTModel, DDP, distributed optimizer and
pipeline schedules, fed from and saving to shardkit's checkpoints). `--engine` picks one; by default megatron-core on
CUDA where it is installed and the run is one it covers, native otherwise (always on the CPU): `default_engine`
(train/engines/choice.py, which train/config.py asks too). `main` is the trainer's entry on each rank, above both
engines."""
from __future__ import annotations

from typing import TYPE_CHECKING

from .choice import default_engine

if TYPE_CHECKING:
    from train.config import TrainConfig


def make_trainer(cfg, log=print):
    """The Trainer of the engine `cfg.run.engine` names (None: the default). A default megatron-core choice that the
    run's flags or model fall outside of goes to the native engine, with a note saying why; an explicit
    `--engine megatron-core` is refused in one line instead."""
    from train.loop import Trainer

    engine = getattr(cfg.run, "engine", None)
    chosen = engine or default_engine()
    if chosen == "native":
        return Trainer(cfg)
    from train.engines.megatron_core.checks import NotCovered
    from train.engines.megatron_core.trainer import MegatronCoreTrainer

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


def main(cfg: TrainConfig, log=print) -> list[dict]:
    """Run on this process (one rank of the job); returns the metrics history on every rank."""
    from train.loop import init_distributed, shutdown_distributed

    init_distributed(cfg.run.distributed_timeout_minutes)
    trainer = None
    try:
        trainer = make_trainer(cfg)  # --engine native | megatron-core (issue 40)
        return trainer.run(log)
    finally:
        trainer = None  # its process groups go with it (shutdown_distributed)
        shutdown_distributed()
