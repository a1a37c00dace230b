"""What the megatron-core engine takes and refuses: NotCovered (one line naming the flag, or the native engine where
megatron-core was only the default), the flags (its layer spec and FP8 where they run), the model, packed documents and
context parallelism; checked before any process group exists (`shardkit launch` asks the same)."""
from __future__ import annotations

import os

import torch

from checkpoint.errors import ConfigError
from train.te import te_available


class NotCovered(Exception):
    """A run this engine does not cover (yet): refused in one line when asked for by name, the native engine when
    megatron-core was only the default."""

    def as_config_error(self) -> ConfigError:
        return ConfigError(f"--engine megatron-core: {self}")


def check_flags(cfg, on_cpu: bool, have_te: bool | None = None) -> None:
    """The flags this engine cannot honour (yet): NotCovered naming the flag, before anything is read or created.
    `have_te`: Transformer Engine installed where it runs (None: on this machine, as looked up)."""
    r = cfg.run
    where = "megatron-core cannot run it on the CPU" if on_cpu else "not in the megatron-core engine yet (issue 40)"
    if on_cpu and os.environ.get(CPU_SWITCH) != "1":
        raise NotCovered("megatron-core's engine runs on CUDA; on the CPU it runs only as a test of itself on gloo "
                         f"({CPU_SWITCH}=1); use --engine native here")
    have_te = te_available() if have_te is None else have_te
    layer_spec(r.transformer_impl, cfg.fp8, on_cpu, have_te)  # TE's layer spec and FP8: where they run
    if on_cpu and r.recompute_granularity:  # its checkpoint function saves and restores the CUDA RNG state
        raise NotCovered(f"--recompute-granularity {r.recompute_granularity}: {where} (its recompute restores the "
                         "CUDA RNG state); drop it or use --engine native")


def layer_spec(requested: str | None, fp8, on_cpu: bool, have_te: bool) -> str:
    """--transformer-impl on this engine: megatron-core's Transformer Engine layer spec ("transformer_engine") by
    default on CUDA where TE is installed, its local spec otherwise (train/te.py resolve_impl: the native engine's
    rule and lines). FP8 is TE's in megatron-core, so FP8 needs the TE spec; on a GPU what megatron-core refuses or
    would drop is train.engines.coverage.fp8_not_covered's line. NotCovered naming the flag."""
    from train.engines.coverage import fp8_not_covered
    from train.te import resolve_impl

    if on_cpu:
        if requested == "transformer_engine":
            raise NotCovered("--transformer-impl transformer_engine (TE's layer spec): megatron-core cannot run it on "
                             "the CPU; use --transformer-impl local or --engine native")
        if fp8.enabled:
            raise NotCovered(f"--fp8-format {fp8.fp8_format}: megatron-core cannot run it on the CPU (its FP8 is "
                             "Transformer Engine's); use --engine native")
        return "local"
    try:
        impl = resolve_impl(requested, torch.device("cuda"), have_te)
    except ConfigError as e:
        raise NotCovered(str(e)) from None
    why = fp8_not_covered(fp8, impl == "transformer_engine", have_te)  # the rule `shardkit plan` asks too
    if why:
        raise NotCovered(why)
    return impl


def check_model(m) -> None:
    """A Llama-family model, dense or with Mixtral's MoE (train.engines.coverage, which `plan` asks too)."""
    from train.engines.coverage import model_not_covered

    why = model_not_covered(m)
    if why:
        raise NotCovered(why)


def check_packing(m, packing, te_attention: bool) -> None:
    """Packed documents with multi-latent attention or MTP: megatron-core's MLA takes its RoPE positions as 0..s-1
    (reset positions reach it only as THD packed_seq_params, not wired here), TE's core attention its own causal mask
    (the per-document mask reaches it the same way; the engine's own core attention takes the mask as given), and its
    MTP block shifts the targets within documents only by packed_seq_params too (the native engine does, as
    megatron-core's packed path). Reset positions alone reach no RoPE of megatron-core's (GPTModel's takes 0..s-1):
    with --reset-attention-mask they change nothing (RoPE is relative, and a token attends within its document)."""
    if packing.reset_position_ids and not packing.reset_attention_mask and not m.multi_latent_attention:
        raise NotCovered("--reset-position-ids without --reset-attention-mask: megatron-core's RoPE takes positions "
                         "0..s-1 (reset positions need its packed_seq_params, not wired in yet: issue 40); add "
                         "--reset-attention-mask (within a document RoPE's relative positions are the same) or use "
                         "--engine native")
    if m.mtp_num_layers and packing.reset_attention_mask:
        raise NotCovered("--reset-attention-mask with MTP layers: megatron-core shifts their targets within documents "
                         "only through packed_seq_params (not wired in yet: issue 40); use --engine native")
    if te_attention and packing.reset_attention_mask:
        raise NotCovered("--reset-attention-mask: Transformer Engine's core attention (TEDotProductAttention: its "
                         "layer spec's, and multi-latent attention's where TE is installed) takes its own causal mask "
                         "(per-document masks need packed_seq_params, not wired in yet: issue 40); use "
                         "--transformer-impl local or --engine native")
    if not m.multi_latent_attention:
        return
    if packing.reset_position_ids:
        raise NotCovered("--reset-position-ids: megatron-core's multi-latent attention takes positions 0..s-1 (reset "
                         "positions need its packed_seq_params, not wired in yet: issue 40); use --engine native")


def check_context_parallel(m, packing, cp: int, te_attention: bool, recompute: str | None) -> None:
    """What context parallelism on this engine does not take (yet): MTP layers (megatron-core's MTP loss under CP is
    each rank's mean over its own tokens, which depends on the CP size), with Transformer Engine's attention
    per-document masks (TE takes its own causal mask: they need THD packed_seq_params, not wired in), and with the
    engine's own CP attention recompute (megatron-core re-runs the forward in the backward, after the micro-batch's
    attention layout is gone)."""
    if cp == 1:
        return
    flag = f"--context-parallel-size {cp}"
    if m.mtp_num_layers:
        raise NotCovered(f"{flag} with MTP layers: megatron-core divides each CP rank's MTP loss by that rank's own "
                         "token count, the native engine by the whole micro-batch's (train/moe.py); use --engine "
                         "native")
    if te_attention and packing.reset_attention_mask:
        raise NotCovered(f"{flag} with --reset-attention-mask: Transformer Engine's context-parallel attention takes "
                         "its own causal mask (per-document masks need packed_seq_params, not wired in yet: issue 40); "
                         "use --engine native")
    if not te_attention and recompute:
        raise NotCovered(f"{flag} with --recompute-granularity {recompute}: shardkit's context-parallel attention "
                         "(Transformer Engine is absent) is not re-entrant under megatron-core's recompute; drop it or "
                         "use --engine native")


CPU_SWITCH = "SHARDKIT_MEGATRON_CORE_CPU"  # "1": run megatron-core on the CPU with CUDA stand-ins (tests only)
