"""Every parallelism and numeric technique the trainer uses, applied to the plain model (train/model.py) in one
place and one fixed order (torchtitan's `parallelize_llama` shape). `parallelize` is the entry point. It composes the
parallelism of train/parallel/ (which imports nothing of the trainer) with the trainer's own techniques (precision,
dropout, MoE training) and its run configuration, so it lives here, beside them:

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
    6. dropout            --attention-dropout / --hidden-dropout where megatron-core applies them, with its TP RNG
                          streams (train/dropout.py); before recompute, whose recomputed forwards replay the streams
    7. recompute          full: decoder layers' forwards under activation checkpointing (--recompute-method uniform:
                          chunks of --recompute-num-layers layers; block: the first N layers of each chunk; default:
                          each layer); selective: the plain core attention (context parallelism's attention recomputes
                          its own)
    8. precision          Transformer Engine rebuilds the decoder's attention and MLP (same parameter names) or local
                          FP8 swaps the linears; after the attention/recompute steps, whose modules TE replaces, and
                          before the parameters are registered in the sharding table, since TE makes new ones
    9. MoE training       router hooks (load-balancing losses, expert-bias updates, MTP loss, load statistics) on the
                          modules that will run; after the dtype cast, as it keeps the expert bias in fp32
   10. gradient marks     which replicated parameters' gradients are partial over TP (summed there by the optimizer),
                          from the sharding table's `tp_grad`; last, since TE's modules are new parameters
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch
from torch.utils.checkpoint import checkpoint

from checkpoint.config import ModelConfig
from checkpoint.errors import ConfigError
from train import moe as moe_mod
from train import precision
from train.config import MoEArgs, ParallelConfig, RunConfig
from train.dropout import DropoutRNG
from train.fp8 import FP8Config
from train.model import GPTModel

from train.parallel.context import AttentionState, Packing, apply_context_parallel
from train.parallel.expert import apply_expert_parallel
from train.parallel.groups import Groups
from train.parallel.tensor import apply_tensor_parallel, local_config, mark_partial_grads, resize_mtp_projections


NO_DROPOUT = RunConfig(attention_dropout=0.0, hidden_dropout=0.0)


@dataclass
class Parallelized:
    """What the trainer runs: this rank's model and the state the techniques keep."""

    model: GPTModel
    attention: AttentionState | None  # installed attention (None: the model's plain SDPA)
    attention_line: str  # one line saying what attention runs
    backend: precision.Backend  # local / TE, FP8
    moe: moe_mod.MoETraining | None  # None for a dense model
    dropout: DropoutRNG | None = None  # the dropout streams (None without dropout); the trainer sets iteration_of


def parallelize(model_cfg: ModelConfig, groups: Groups, device: torch.device, dtype: torch.dtype,
                parallel: ParallelConfig, run: RunConfig = NO_DROPOUT, fp8: FP8Config = FP8Config(),
                moe: MoEArgs = MoEArgs(), packing: Packing = Packing(), seed: int = 1234) -> Parallelized:
    """This rank's model, uninitialised (every parameter is then loaded from a checkpoint), with every technique
    of the run applied in the order of the module docstring. Without `run` (parity checks, benchmarks, memory
    plans) the model has no dropout; the trainer passes its RunConfig (Megatron's dropout defaults)."""
    layout = groups.dims.model_parallel
    local = check_parallel(model_cfg, groups.dims, parallel)
    sp = parallel.sequence_parallel and groups.dims.tp > 1
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
    rng = apply_dropout(model, run, groups, sp, attention, line, device, seed)
    apply_recompute(model, run.recompute_granularity, attention, run.recompute_method, run.recompute_num_layers, rng)
    backend = precision.setup(model, model_cfg, groups, run, fp8, parallel.cp_comm_type, sp)
    if run.attention_dropout and backend.impl == "transformer_engine":
        raise ConfigError(f"--attention-dropout {run.attention_dropout} with --transformer-impl transformer_engine: "
                          "TE's DotProductAttention is built without dropout here; use --attention-dropout 0 or "
                          "--transformer-impl local")
    moe_state = moe_mod.setup(moe, model_cfg, model, groups, sp)
    mark_partial_grads(model, model_cfg, layout, sp)  # last: TE's modules are new parameters
    return Parallelized(model, attention, line, backend, moe_state, rng)


def check_parallel(model_cfg: ModelConfig, dims, parallel: ParallelConfig) -> ModelConfig:
    """The run's layout (a checkpoint.run_layout.RunLayout) against the model, before anything is built: the layout's
    own checks (heads, KV groups, ffn, experts, the pipeline split), MoE under TP needing sequence parallelism, and
    what one TP rank builds (`local_config`, returned). No process group needed (`shardkit launch` runs it too)."""
    layout = dims.model_parallel
    layout.check(model_cfg)
    if model_cfg.is_moe and dims.tp > 1 and not parallel.sequence_parallel:  # Megatron asserts the same
        raise ConfigError(f"--tp {dims.tp} with an MoE model ({model_cfg.model_type}) needs "
                          "--sequence-parallel (megatron-core's MoE layers take the sequence-parallel slice)")
    return local_config(model_cfg, layout)


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


def apply_dropout(model: GPTModel, run: RunConfig, groups: Groups, sp: bool, attention: AttentionState | None,
                  line: str, device: torch.device, seed: int) -> DropoutRNG | None:
    """--attention-dropout / --hidden-dropout (Megatron's defaults 0.1; train/dropout.py): the embedding dropout and
    the bias-dropout-adds read hidden_dropout, the plain core attention attention_dropout. None when both are 0.
    Attention dropout needs the plain attention (config.check_dropout refuses the others before this)."""
    if not (run.attention_dropout or run.hidden_dropout) or device.type == "meta":
        return None
    if run.attention_dropout and attention is not None:
        raise ConfigError(f"--attention-dropout {run.attention_dropout}: the installed attention ({line}) applies no "
                          "dropout to its probabilities; attention dropout runs in the plain local attention only "
                          "(no context parallelism, packed documents or flash-attn): use --attention-dropout 0")
    rng = DropoutRNG(seed, groups.pp_rank, groups.tp_rank, sp, device)
    for mod in model.modules():
        if hasattr(mod, "hidden_dropout") and isinstance(mod, torch.nn.Module):
            mod.hidden_dropout, mod.dropout_rng = run.hidden_dropout, rng
        if hasattr(mod, "attention_dropout"):
            mod.attention_dropout, mod.dropout_rng = run.attention_dropout, rng
    return rng


def recompute_groups(keys: list[int], method: str | None, num: int | None) -> list[list[int]]:
    """The checkpointed units of one model chunk (its layers' global indices, in order) under --recompute-granularity
    full, as megatron-core's TransformerBlock: uniform, consecutive runs of `num` layers, each run one checkpoint;
    block, the first `num` layers one by one, the rest not checkpointed; no method (shardkit's default before
    --recompute-method): every layer, one by one."""
    if method == "uniform" and num and num > 1:
        return [keys[i:i + num] for i in range(0, len(keys), num)]
    if method == "block":
        return [[k] for k in keys[:num]]
    return [[k] for k in keys]


def apply_recompute(model: GPTModel, granularity: str | None, attention: AttentionState | None,
                    method: str | None = None, num_layers: int | None = None, rng: DropoutRNG | None = None) -> None:
    """--recompute-granularity full: decoder layers' forwards are checkpointed (a recomputed layer sees its own
    micro-batch's attention layout, also under 1F1B, and draws the dropout masks of its forward); which ones and in
    what units: `recompute_groups` per model chunk (a pipeline rank's consecutive layer range); selective: the plain
    core attention is (an installed `attention` was built to recompute its own)."""
    ctx = [f for f in (None if attention is None else attention.recompute_context,
                       None if rng is None else rng.recompute_context) if f is not None]
    ckpt = {} if not ctx else {"context_fn": ctx[0] if len(ctx) == 1 else _both(ctx)}
    if granularity == "full":
        layers = model.decoder.layers
        for chunk in _chunks(sorted(int(k) for k in layers.keys())):
            for unit in recompute_groups(chunk, method, num_layers):
                if len(unit) == 1:
                    layers[str(unit[0])].forward = _recomputed(layers[str(unit[0])].forward, ckpt)
                else:
                    _recompute_unit([layers[str(k)] for k in unit], ckpt)
    elif granularity == "selective" and attention is None:
        for layer in model.decoder.layers.values():
            att = layer.self_attention
            att.core_attention = _recomputed(att.core_attention, ckpt)


def _chunks(keys: list[int]) -> list[list[int]]:
    """Consecutive runs of layer indices (a pipeline rank's model chunks under --vpp)."""
    out: list[list[int]] = []
    for k in keys:
        if out and out[-1][-1] == k - 1:
            out[-1].append(k)
        else:
            out.append([k])
    return out


def _recompute_unit(layers: list, ckpt: dict) -> None:
    """Several consecutive layers as one checkpoint (megatron-core's uniform method): the first layer's call runs
    them all under one checkpoint and hands the result on; the others pass their input through. Layers are always
    called in order within a chunk (TransformerBlock.forward, the pipeline's chunk forward)."""
    forwards = [layer.forward for layer in layers]

    def run_all(x, cos, sin):
        for f in forwards:
            x = f(x, cos, sin)
        return x

    def first(x, cos, sin):
        return checkpoint(run_all, x, cos, sin, use_reentrant=False, **ckpt)

    layers[0].forward = first
    for layer in layers[1:]:
        layer.forward = lambda x, cos, sin: x


def _both(fns: list[Callable]) -> Callable:
    def context_fn():
        pairs = [f() for f in fns]

        @contextlib.contextmanager
        def enter(ms):
            with contextlib.ExitStack() as stack:
                for m in ms:
                    stack.enter_context(m)
                yield

        return enter([p[0] for p in pairs]), enter([p[1] for p in pairs])

    return context_fn


def _recomputed(fn: Callable, kwargs: dict) -> Callable:
    def run(*args):
        return checkpoint(fn, *args, use_reentrant=False, **kwargs)

    return run

