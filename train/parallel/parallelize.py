"""Every parallelism and numeric technique the trainer uses, applied to the plain model (train/model.py) in one
place and one fixed order (torchtitan's `parallelize_llama` shape). `parallelize` is the entry point:

    1. pipeline split     the model is built on the meta device from this TP rank's `local_config`, and the layers,
                          embedding and head of other stages are removed
    2. expert parallel    still on meta: each MoE layer keeps only this rank's experts (E/EP of them, the expert-TP
                          slice of their ffn), so no rank ever allocates another rank's weights; MTP projections
                          take their TP shard
    3. materialise        to_empty on the device, cast to the training dtype (every value then comes from the
                          checkpoint)
    4. tensor parallel    collectives on the linears and the output head, vocab-parallel embedding and loss (on the
                          real modules: the embedding module is swapped around its materialised weight)
    5. context parallel   core attention replaced (CP ring / all-gather, packed-document masks, flash-attn); before
                          recompute, which must know whether the installed attention recomputes itself
    6. recompute          full: each decoder layer's forward under activation checkpointing; selective: the plain
                          core attention (context parallelism's attention recomputes its own)
    7. precision          Transformer Engine rebuilds the decoder's attention and MLP (same parameter names) or local
                          FP8 swaps the linears; after the attention/recompute steps, whose modules TE replaces, and
                          before the parameters are registered in the sharding table, since TE makes new ones
    8. MoE training       router hooks (load-balancing losses, expert-bias updates, MTP loss, load statistics) on the
                          modules that will run; after the dtype cast, as it keeps the expert bias in fp32
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch.utils.checkpoint import checkpoint

from checkpoint.config import ModelConfig
from checkpoint.errors import ConfigError
from train import moe as moe_mod
from train import precision
from train.config import MoEArgs, ParallelConfig, RunConfig
from train.fp8 import FP8Config
from train.model import GPTModel

from .context import AttentionState, Packing, apply_context_parallel
from .expert import apply_expert_parallel
from .groups import Groups
from .tensor import apply_tensor_parallel, local_config, resize_mtp_projections


@dataclass
class Parallelized:
    """What the trainer runs: this rank's model and the state the techniques keep."""

    model: GPTModel
    attention: AttentionState | None  # installed attention (None: the model's plain SDPA)
    attention_line: str  # one line saying what attention runs
    backend: precision.Backend  # local / TE, FP8
    moe: moe_mod.MoETraining | None  # None for a dense model


def parallelize(model_cfg: ModelConfig, groups: Groups, device: torch.device, dtype: torch.dtype,
                parallel: ParallelConfig, run: RunConfig = RunConfig(), fp8: FP8Config = FP8Config(),
                moe: MoEArgs = MoEArgs(), packing: Packing = Packing()) -> Parallelized:
    """This rank's model, uninitialised (every parameter is then loaded from a checkpoint), with every technique
    of the run applied in the order of the module docstring."""
    layout = groups.dims.model_parallel
    layout.check(model_cfg)
    sp = parallel.sequence_parallel and groups.dims.tp > 1
    if model_cfg.is_moe and groups.dims.tp > 1 and not sp:  # Megatron asserts the same
        raise ConfigError(f"--tp {groups.dims.tp} with an MoE model ({model_cfg.model_type}) needs "
                          "--sequence-parallel (megatron-core's MoE layers take the sequence-parallel slice)")
    local = local_config(model_cfg, layout)
    with torch.device("meta"):
        model = GPTModel(local, local.vocab_size)
        apply_pipeline_split(model, model_cfg, groups)
        resize_mtp_projections(model, model_cfg, layout)
        apply_expert_parallel(model, model_cfg, layout, groups.ep, groups.ep_rank, groups.etp, groups.etp_rank,
                              moe.moe_token_dispatcher_type, groups.etp_ep)
    model = model.to_empty(device=device).to(dtype)
    apply_tensor_parallel(model, model_cfg, layout, groups.tp_rank, groups.tp, sp)
    attention, line = apply_context_parallel(model, groups, parallel.cp_comm_type, packing,
                                             run.recompute_granularity == "selective", device, dtype)
    apply_recompute(model, run.recompute_granularity, attention)
    backend = precision.setup(model, model_cfg, groups, run, fp8, parallel.cp_comm_type, sp)
    moe_state = moe_mod.setup(moe, model_cfg, model, groups, sp)
    return Parallelized(model, attention, line, backend, moe_state)


def apply_pipeline_split(model: GPTModel, cfg: ModelConfig, groups: Groups) -> None:
    """Remove what this pipeline rank does not own: other ranks' layers (with --vpp the rank holds several layer
    ranges, its model chunks), the embedding (kept on the last stage too when the embeddings are tied or the MTP
    layers, which live on the last stage, need it: its gradient is then all-reduced between the first and last
    stage), the final norm, the output layer and the MTP layers."""
    dims = groups.dims
    layout = dims.model_parallel
    mine = set().union(*(range(*layout.layer_range(cfg.num_layers, groups.pp_rank, v)) for v in range(dims.vpp)))
    for key in list(model.decoder.layers.keys()):
        if int(key) not in mine:
            del model.decoder.layers[key]
    tied_last = (cfg.tie_word_embeddings or cfg.mtp_num_layers > 0) and groups.last_stage
    if not groups.first_stage and not tied_last:
        model.embedding = None
    if not groups.last_stage:
        model.decoder.final_layernorm = None
        model.output_layer = None
        model.mtp = None


def apply_recompute(model: GPTModel, granularity: str | None, attention: AttentionState | None) -> None:
    """--recompute-granularity full: every decoder layer's forward is checkpointed (a recomputed layer sees its own
    micro-batch's attention layout, also under 1F1B); selective: the plain core attention is (an installed
    `attention` was built to recompute its own)."""
    if granularity == "full":
        ckpt = {} if attention is None else {"context_fn": attention.recompute_context}
        for layer in model.decoder.layers.values():
            layer.forward = _recomputed(layer.forward, ckpt)
    elif granularity == "selective" and attention is None:
        for layer in model.decoder.layers.values():
            att = layer.self_attention
            att.core_attention = _recomputed(att.core_attention, {})


def _recomputed(fn: Callable, kwargs: dict) -> Callable:
    def run(*args):
        return checkpoint(fn, *args, use_reentrant=False, **kwargs)

    return run

