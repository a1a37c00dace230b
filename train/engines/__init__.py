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


def model_not_covered(m) -> str | None:
    """Why the megatron-core engine cannot build model config `m` (None: it can): a Llama-family model, dense or with
    Mixtral's MoE (softmax top-k routing, no shared expert), what its local spec builds with the same names and
    numbers. No torch import: `shardkit plan` asks it for the engine it models."""
    if m.is_moe:
        moe = ("shared experts" if m.moe_shared_expert_intermediate_size else
               "an expert bias (aux-loss-free balancing)" if m.moe_router_enable_expert_bias else
               "group-limited routing" if m.moe_router_num_groups else
               f"{m.moe_router_score_function} router scores" if m.moe_router_score_function != "softmax" else
               "a top-k scaling factor" if m.moe_router_topk_scaling_factor else None)
        if moe:
            return (f"{m.model_type} has {moe}: the megatron-core engine builds Mixtral's MoE in this slice "
                    "(issue 40); use --engine native")
    what = ("multi-latent attention" if m.multi_latent_attention else
            "multi-token prediction" if m.mtp_num_layers else "a heterogeneous layer stack" if m.heterogeneous else
            "sliding-window attention" if m.sliding_window else
            "biases on the output projection / MLP" if m.add_proj_bias or m.add_mlp_bias else None)
    if what:
        return (f"{m.model_type} has {what}: the megatron-core engine builds Llama-family models (and "
                "Mixtral) in this slice (issue 40); use --engine native")
    rope = (m.rope_scaling or {}).get("rope_type", "default")
    if rope not in ("default", "llama3", "linear"):
        return f"RoPE scaling {rope!r}: not in the megatron-core engine yet (issue 40); use --engine native"
    return None


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
