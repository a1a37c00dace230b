"""`continue-pretrain --engine megatron-core` (issue 40): megatron-core's own training machinery on shardkit's
checkpoints, data, flags and logs.

    shardkit's model config -> TransformerConfig (here, once: `transformer_config`) -> GPTModel per model chunk (TE
    or local layer spec: `layer_spec`) -> weights read by region through the sharding table (each rank its own)
    -> megatron-core's DistributedDataParallel (--overlap-grad-reduce / --overlap-param-gather) -> its
    DistributedOptimizer (Adam with shardkit's optimizer flags) -> per iteration get_forward_backward_func()'s
    schedule (no pipelining, 1F1B or interleaved 1F1B) over shardkit's micro-batches, its grad norm and clipping, its
    OptimizerParamScheduler
    -> saves through shardkit's native save path (train/checkpointing.py): the weights from the parameters, the
    distributed optimizer's fp32 params and moments gathered back into shardkit's canonical tensors per region.

The trainer is train/loop.py's Trainer with the model, the step and the optimizer state replaced: the data pipeline,
the scheduler checks on resume, the NaN stop (before the optimizer step), exit signals, the log lines and the save path
are the native engine's own. megatron-core's parameter names are shardkit's canonical names (checkpoint/megatron.py:
the local spec's separate norms map to their TE names), so the sharding table gives every parameter its regions.

What this engine covers: Llama-family models (no sliding window or linear biases other than QKV's), their MoE
(Mixtral, Qwen3-MoE: megatron-core's router, load-balancing loss, alltoall / allgather dispatchers and SequentialMLP,
whose per-expert weights are read from and saved into shardkit's stacked expert tensors) and DeepSeek-V2 / V2-Lite / V3:
megatron-core's MLASelfAttention (MLATransformerConfig from the model config, q_lora or one q projection, plain or YaRN
RoPE) with a core attention the local spec lacks (`MLACoreAttention`: megatron-core's local DotProductAttention takes
no k_channels / v_channels; TE's TEDotProductAttention where Transformer Engine is installed), shared experts, dense
first layers (per-layer tensors), softmax or group-limited sigmoid routing with the expert bias megatron-core updates
in finalize_model_grads (`train.engines.coverage` names the routers it computes otherwise than HF, refused), and
megatron-core's MTP block (its layers the decoder's last layer spec, on the last pipeline stage with its copy of the
embedding; the loss by --mtp-loss-scaling-factor; its logs as native's), TP (+ SP), PP (1F1B, interleaved
with --vpp; even and uneven splits by Megatron-LM's split flags), DP with the distributed optimizer, fp32 and bf16,
native checkpoints (load: weights, and the optimizer state when resuming; save: native format, or torch_dist through
the same save path; torch_dist loads too, Megatron-LM's own included, read by region as the native engine reads them).
Packed documents (--reset-position-ids, --reset-attention-mask, --eod-mask-loss) as the native engine takes them
(with MLA not --reset-position-ids, with MTP not --reset-attention-mask: `check_packing`).
Expert parallelism (--expert-model-parallel-size, --expert-tensor-parallel-size) on megatron-core's expert groups,
checked against shardkit's coordinates. Context parallelism (--context-parallel-size, --cp-comm-type): megatron-core's
CP groups and TransformerConfig fields, its RoPE sliced per CP rank by itself, gradients reduced and the distributed
optimizer sharded over DP x CP (a save gathers a parameter's state to its DP rank's CP rank 0), each rank's zigzag
share of the micro-batch and its loss weights by the native engine's prepare_micro_batch (megatron-core's
get_batch_on_this_cp_rank, tested against it); the core attention Transformer Engine's TEDotProductAttention with
--cp-comm-type where TE is installed (wired in, not run: no GPU here), else shardkit's ContextParallelAttention (the
native engine's ring / all-gather attention, train/parallel/context.py) for GQA and MLA; packed documents as the
native engine takes them (with TE's attention not --reset-attention-mask), not with MTP layers or, without TE,
recompute (`check_context_parallel`).
Transformer Engine (`layer_spec`; wired in, never run: TE is installed neither here nor on the lent GPU machine):
megatron-core's TE layer spec by default on CUDA where TE is installed (--transformer-impl local keeps the local spec;
asking for TE without it, or on the CPU, is one line): TE's fused layer-norm linears, TENorm (the final, MoE
pre-router, Qwen3's q/k and MTP's norms; they take SP, so the local spec's RMSNorm / LatentNorm / HeadNorm stand-ins are
not applied there), TEDotProductAttention, SequentialMLP of TE linears (no grouped GEMM), MLA's TELinear down
projections and its latent norms fused into linear_q_up_proj / linear_kv_up_proj (qk_layernorm on: `te_spec_fields`,
which refuses an rms_norm_eps other than DeepSeek's 1e-6 there). Its parameter names are the canonical ones (tested
with megatron-core's own spec functions and stand-in TE classes). FP8 (--fp8-format, --fp8-recipe delayed |
tensorwise | blockwise, --fp8-margin, --fp8-amax-history-len, --fp8-amax-compute-algo, --no-fp8-wgrad,
--first-last-layers-bf16 with --num-layers-at-start/end-in-bf16) as TransformerConfig's fields (`fp8_fields`, equal
to what Megatron-LM's parser gives): megatron-core builds TE's recipe and enters its fp8 autocast itself, with its TP x
CP x DP amax reduction. Refused in one line: FP8 without TE's spec (megatron-core's FP8 is TE's: it would silently
run in bf16), --first-last-layers-bf16 with delayed scaling (megatron-core refuses it), --no-fp8-wgrad with another
recipe (megatron-core applies it through DelayedScaling only), more bf16 layers at an end than a pipeline stage holds,
--reset-attention-mask with TE's attention. The delayed-scaling state of its TE linears (`FP8State`: fp8_meta's amax
histories and scales, no pickle, no `_extra_state`) is saved and resumed in the native engine's JSON form and global
names (train/te.py modules_state / load_modules_state), so an FP8 run resumes on either engine.
Refused in one line: recompute on the CPU.
On the CPU (gloo) megatron-core needs a few CUDA stand-ins: they are applied only under the explicit test switch
SHARDKIT_MEGATRON_CORE_CPU=1 (`cpu_stand_ins`); without it --engine megatron-core on the CPU is refused.

Importing megatron-core registers some 26 classes as torch.load safe globals (its megatron/core/safe_globals.py);
`import_megatron` puts torch's allowlist back as it was, so shardkit's `weights_only=True` reads keep their checks.
"""
from __future__ import annotations

import contextlib
import functools
import math
import os
import re

import torch
import torch.distributed as dist

from checkpoint.errors import ConfigError, FormatError
from checkpoint.megatron import canonical_candidates
from checkpoint.sharding import OPTIMIZER_STATES, local_shape, optimizer_key, owner
from checkpoint.families import family_of, model_specs
from train import checkpointing as ckpt_io
from train.loop import Trainer, check_layout_for_model, check_save_format, open_load, run_layout
from train.dropout import seed_process_rngs
from train.engines.cpu_shims import cuda_as_cpu
from train.model import canonical_name
from train.parallel.context import attention_state, ltor_masks_and_position_ids, packing_from, prepare_micro_batch
from train.te import te_available

CPU_SWITCH = "SHARDKIT_MEGATRON_CORE_CPU"  # "1": run megatron-core on the CPU with CUDA stand-ins (tests only)
OVERLAP_DESTS = ("overlap_grad_reduce", "overlap_param_gather")


class NotCovered(Exception):
    """A run this engine does not cover (yet): refused in one line when asked for by name, the native engine when
    megatron-core was only the default."""

    def as_config_error(self) -> ConfigError:
        return ConfigError(f"--engine megatron-core: {self}")


# -- megatron-core, imported without touching torch's pickle allowlist -------------------------------------------------

@contextlib.contextmanager
def keep_pickle_allowlist():
    """torch.serialization's safe globals as they were before the block (megatron-core adds its own at import)."""
    before = list(torch.serialization.get_safe_globals())
    try:
        yield
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(before)


def import_megatron() -> None:
    """Import every megatron-core module this engine uses, the allowlist kept as it was."""
    import warnings

    with keep_pickle_allowlist(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed" (the CPU): said once below
        import megatron.core  # noqa: F401
        import megatron.core.distributed  # noqa: F401
        import megatron.core.models.gpt  # noqa: F401
        import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401
        import megatron.core.optimizer  # noqa: F401
        import megatron.core.optimizer.clip_grads  # noqa: F401
        import megatron.core.optimizer_param_scheduler  # noqa: F401
        import megatron.core.parallel_state  # noqa: F401
        import megatron.core.pipeline_parallel  # noqa: F401
        import megatron.core.pipeline_parallel.schedules  # noqa: F401
        import megatron.core.tensor_parallel  # noqa: F401
        import megatron.core.transformer.moe.moe_utils as moe_utils
        import megatron.core.transformer.transformer_config  # noqa: F401
        from megatron.core.transformer.module import Float16Module  # noqa: F401
    if not hasattr(moe_utils, "te_general_gemm"):  # 0.16 without Transformer Engine: its router's fallback GEMM
        moe_utils.te_general_gemm = None  # (the name is otherwise undefined there: a NameError in every MoE forward)


def cpu_stand_ins() -> None:
    """megatron-core on the CPU (tests on gloo; DESIGN.md's recipe, as tests/megatron_oracle.py applies it): the
    current device is the CPU, synchronize does nothing, the CUDA RNG tracker's fork is a null context, tensors report
    `torch.cuda.*` types (the distributed optimizer and its clipping refuse others), `.cuda()` is the identity,
    `device="cuda"` factory calls land on the CPU and streams are synchronous stand-ins. No arithmetic changes.
    Process-wide: only under CPU_SWITCH."""
    from megatron.core import tensor_parallel

    if getattr(torch, "_shardkit_mcore_cpu", False):
        return
    torch._shardkit_mcore_cpu = True
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    # the alltoall token dispatcher's side stream for its device-to-host copies: on the CPU every copy is done when
    # it returns, so a stream and its events only need to exist
    torch.cuda.Stream = _HostStream
    main_stream = _HostStream()
    torch.cuda.current_stream = lambda *a, **k: main_stream
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    # ...and its split sizes, which it moves to the host as numpy arrays (what all_to_all_single takes): on the CPU
    # they are host tensors already, which megatron-core leaves as they are
    from megatron.core.transformer.moe import token_dispatcher

    def to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
        return tensor.numpy() if as_numpy and torch.is_tensor(tensor) else tensor

    token_dispatcher.maybe_move_tensor_to_cpu = to_host

    cuda_as_cpu()


class _HostEvent:
    """An event of _HostStream: always complete."""

    def synchronize(self) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True


class _HostStream:
    """A CUDA stream stand-in on the CPU (cpu_stand_ins): work is synchronous, so waiting and recording are no-ops."""

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None) -> _HostEvent:
        return event or _HostEvent()

    def synchronize(self) -> None:
        pass


class RMSNorm:
    """The local spec's norm (torch.nn.RMSNorm, as megatron-core's WrappedTorchNorm builds it) that also runs under
    sequence parallelism: WrappedTorchNorm refuses it (megatron-core leaves SP norms to TE's TENorm or Apex), though
    the arithmetic is per token; its weight is marked `sequence_parallel` as TENorm's is, so finalize_model_grads
    sums its gradient over the TP group."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_):
        norm = torch.nn.RMSNorm(normalized_shape=hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = bool(config.sequence_parallel)
        return norm


class LatentNorm:
    """Multi-latent attention's q / kv latent norms (q_layernorm, kv_layernorm: DeepSeek's q_a_layernorm and
    kv_a_layernorm, eps 1e-6 whatever rms_norm_eps says, as transformers and the native model take them). Under
    sequence parallelism each rank normalises its slice of the sequence: the weight is marked `sequence_parallel` so
    that finalize_model_grads sums its gradient over TP (TENorm's rule); the config's qk_layernorm stays off, so that
    megatron-core does not also sum `q_layernorm` by its name when every TP rank saw the whole sequence."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_):
        from train.model import LATENT_NORM_EPS

        norm = torch.nn.RMSNorm(normalized_shape=hidden_size, eps=LATENT_NORM_EPS)
        for p in norm.parameters():
            p.sequence_parallel = bool(config.sequence_parallel)
        return norm


class MLACoreAttention(torch.nn.Module):
    """Multi-latent attention's core attention where Transformer Engine is absent. megatron-core's local
    DotProductAttention sizes every head by kv_channels and takes no `k_channels` / `v_channels`, which MLASelfAttention
    passes (query and key heads of qk_head_dim + qk_pos_emb_head_dim, value heads of v_head_dim), so its local MLA spec
    does not build without TE. This is DotProductAttention's arithmetic on those heads: scores q k^T times
    MLASelfAttention's softmax_scale (1/sqrt(k_channels) times DeepSeek's YaRN mscale squared), masked where
    `attention_mask` is True (causal, and per document with --reset-attention-mask), softmax in fp32, dropout under
    megatron-core's RNG tracker as DotProductAttention draws it, times v; this TP rank's heads, [s, b, np * v]."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 k_channels: int | None = None, v_channels: int | None = None, cp_comm_type=None,
                 pg_collection=None) -> None:
        super().__init__()
        from megatron.core import parallel_state as ps

        if config.context_parallel_size != 1:
            raise ValueError("MLACoreAttention: context parallelism is TE's (TEDotProductAttention)")
        tp = pg_collection.tp.size() if pg_collection is not None else ps.get_tensor_model_parallel_world_size()
        self.config = config
        self.heads = config.num_attention_heads // tp
        # megatron-core's Attention base class first builds one without the head sizes (MLA then builds its own)
        self.k_channels, self.v_channels = k_channels or config.kv_channels, v_channels or config.kv_channels
        self.softmax_scale = self.k_channels ** -0.5 if softmax_scale is None else softmax_scale
        self.dropout = torch.nn.Dropout(config.attention_dropout if attention_dropout is None else attention_dropout)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        from megatron.core import tensor_parallel

        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("MLACoreAttention: packed_seq_params / attention_bias are TE's")
        s, b = query.shape[:2]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, np, s, d]
        scores = torch.matmul(q, k.transpose(-2, -1)) * self.softmax_scale
        if attention_mask is None:
            attention_mask = torch.triu(torch.ones(s, k.shape[2], dtype=torch.bool, device=q.device), diagonal=1)
        scores = scores.float().masked_fill(attention_mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        if self.dropout.p and self.training:
            if self.config.sequence_parallel:
                probs = self.dropout(probs)
            else:
                with tensor_parallel.get_cuda_rng_tracker().fork():
                    probs = self.dropout(probs)
        out = torch.matmul(probs, v)  # [b, np, s, v]
        return out.permute(2, 0, 1, 3).reshape(s, b, self.heads * self.v_channels)


def mla_submodules(attn, te: bool) -> None:
    """The engine's pieces in a local-spec MLASelfAttention's submodules: the core attention (TE's
    TEDotProductAttention where Transformer Engine is installed: it takes MLA's head sizes; MLACoreAttention
    otherwise), the latent norms (LatentNorm) and, for the down projections, megatron-core's own duplicated linear
    (post_training.modelopt.layers.Linear, what its MLA takes instead of TE's duplicated TELinear): each TP rank holds
    the whole weight, as shardkit's table and TE's spec have it (the local spec's ColumnParallelLinear would split its
    output dimension over TP)."""
    import megatron.core.transformer.multi_latent_attention as mla
    from megatron.core.post_training.modelopt.layers import Linear

    if mla.Linear is None:  # megatron-core imports it there only with Transformer Engine
        mla.Linear = Linear
    if te:
        from megatron.core.extensions.transformer_engine import TEDotProductAttention

        attn.core_attention = TEDotProductAttention
    else:
        attn.core_attention = MLACoreAttention
        for name in ("TELinear", "TEColumnParallelLinear"):  # 0.16 without TE: MagicMock placeholders, which
            if not isinstance(getattr(mla, name), (type, type(None))):  # MLA's isinstance checks refuse
                setattr(mla, name, type(f"No{name}", (), {}))
    attn.q_layernorm = attn.kv_layernorm = LatentNorm
    attn.linear_q_down_proj = attn.linear_kv_down_proj = mla.Linear


def local_spec_layer(layer, m, te_attention: bool) -> None:
    """The engine's pieces in one layer of megatron-core's local spec: its two norms (RMSNorm: they take sequence
    parallelism), multi-latent attention's (`mla_submodules`) or the q/k head norms (HeadNorm). Not on TE's spec,
    whose TENorm / fused layer-norm linears take SP and name their weights canonically (`te_spec_fields`)."""
    layer.submodules.input_layernorm = layer.submodules.pre_mlp_layernorm = RMSNorm
    attn = layer.submodules.self_attention.submodules
    if m.multi_latent_attention:
        mla_submodules(attn, te_attention)
    elif m.qk_layernorm:
        attn.q_layernorm = attn.k_layernorm = HeadNorm


class HeadNorm:
    """The q/k layernorm (TransformerConfig.qk_layernorm: RMSNorm over each head), also under sequence parallelism
    (WrappedTorchNorm refuses SP there too): never marked sequence-parallel, as attention normalises this rank's heads
    over the whole sequence; finalize_model_grads sums its gradient over TP by its name whatever the flags."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_):
        return torch.nn.RMSNorm(normalized_shape=hidden_size, eps=eps)


class ContextParallelAttention(torch.nn.Module):
    """The core attention under context parallelism where Transformer Engine is absent: megatron-core's local
    DotProductAttention asserts context_parallel_size == 1 (its CP is TE's TEDotProductAttention), so this runs the
    native engine's CP attention (train/parallel/context.py AttentionState.attend: ring (p2p) or all-gathered K/V over
    Megatron's zigzag split, documents masked from global positions) on megatron-core's q / k / v of this rank's two
    chunks: [s, b, np, d] queries, [s, b, ng, d] keys and [s, b, ng, dv] values (one K/V head per query group, as the
    local spec hands them: GQA; MLA's heads of k_channels / v_channels) -> [s, b, np * dv]. The scale is
    DotProductAttention's (1/sqrt(k_channels), or the softmax_scale given, MLA's). The micro-batch's AttentionLayout is
    the one the engine's forward_step holds in `state` around the model's forward (state.use)."""

    state = None  # the run's AttentionState (train.parallel.context.attention_state): `bound` sets it

    @classmethod
    def bound(cls, state) -> type:
        return type(cls.__name__, (cls,), {"state": state})

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 k_channels: int | None = None, v_channels: int | None = None, cp_comm_type=None,
                 pg_collection=None) -> None:
        super().__init__()
        if self.state is None or config.context_parallel_size != self.state.cp:
            raise ValueError("ContextParallelAttention: built without the run's context-parallel state")
        k_channels = k_channels or config.kv_channels
        self.softmax_scale = k_channels ** -0.5 if softmax_scale is None else softmax_scale

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("ContextParallelAttention: packed_seq_params / attention_bias are TE's")
        layout = self.state.current
        if layout is None:
            raise RuntimeError("ContextParallelAttention called outside the engine's forward_step (no layout)")
        s, b = query.shape[:2]
        q, k, v = (t.permute(1, 2, 0, 3).contiguous() for t in (query, key, value))  # [b, heads, s, d]
        out = self.state.attend(q, k, v, q.shape[1] // k.shape[1], self.softmax_scale, None, layout)
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)


# -- what the engine covers ----------------------------------------------------------------------------------------------

def check_flags(cfg, on_cpu: bool) -> None:
    """The flags this engine cannot honour (yet): NotCovered naming the flag, before anything is read or created."""
    r = cfg.run
    where = "megatron-core cannot run it on the CPU" if on_cpu else "not in the megatron-core engine yet (issue 40)"
    if on_cpu and os.environ.get(CPU_SWITCH) != "1":
        raise NotCovered("megatron-core's engine runs on CUDA; on the CPU it runs only as a test of itself on gloo "
                         f"({CPU_SWITCH}=1); use --engine native here")
    layer_spec(r.transformer_impl, cfg.fp8, on_cpu, te_available())  # TE's layer spec and FP8: where they run
    if on_cpu and r.recompute_granularity:  # its checkpoint function saves and restores the CUDA RNG state
        raise NotCovered(f"--recompute-granularity {r.recompute_granularity}: {where} (its recompute restores the "
                         "CUDA RNG state); drop it or use --engine native")


def layer_spec(requested: str | None, fp8, on_cpu: bool, have_te: bool) -> str:
    """--transformer-impl on this engine: megatron-core's Transformer Engine layer spec ("transformer_engine") by
    default on CUDA where TE is installed, its local spec otherwise (train/te.py resolve_impl: the native engine's
    rule and lines). FP8 is TE's in megatron-core (its TE modules under fp8_utils.get_fp8_context, a null context
    without TE: FP8 would silently be bf16), so FP8 needs the TE spec; what megatron-core refuses or would drop is
    one line here. NotCovered naming the flag."""
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
    if not fp8.enabled:
        return impl
    if impl != "transformer_engine":
        why = ("Transformer Engine is not installed" if not have_te else "--transformer-impl local")
        raise NotCovered(f"--fp8-format {fp8.fp8_format}: megatron-core's FP8 runs in Transformer Engine's modules "
                         f"only ({why}: every GEMM would stay in high precision); use its TE layer spec or --engine "
                         "native")
    if fp8.first_last_layers_bf16 and fp8.fp8_recipe == "delayed":
        raise NotCovered("--first-last-layers-bf16 with --fp8-recipe delayed: megatron-core refuses it (its delayed "
                         "scaling reduces amaxes once per FP8 region); use --fp8-recipe tensorwise or blockwise, or "
                         "--engine native")
    if not fp8.fp8_wgrad and fp8.fp8_recipe != "delayed":
        raise NotCovered(f"--no-fp8-wgrad with --fp8-recipe {fp8.fp8_recipe}: megatron-core applies it through its "
                         "DelayedScaling recipe only (the weight gradients would stay FP8); use --fp8-recipe delayed")
    return impl


def fp8_fields(fp8, num_layers: int, pp: int) -> dict:
    """TransformerConfig's FP8 fields from shardkit's FP8Config (train/fp8.py: Megatron-LM's flags, whose dests are
    megatron-core's field names but --fp8-format's, `fp8`); megatron-core builds TE's recipe from them
    (fp8_utils.get_fp8_recipe) and enters te.fp8_autocast itself, with its TP x CP x DP amax reduction group. The
    bf16 layers as the native engine counts them (train.fp8.bf16_layers: global layer numbers), within megatron-core's
    bound of one pipeline stage's layers per end."""
    if fp8 is None or not fp8.enabled:
        return {}
    from train.fp8 import bf16_layers

    bf16_layers(fp8, num_layers)  # none left in FP8: refused as the native engine refuses it
    if fp8.first_last_layers_bf16:
        for flag, n in (("--num-layers-at-start-in-bf16", fp8.num_layers_at_start_in_bf16),
                        ("--num-layers-at-end-in-bf16", fp8.num_layers_at_end_in_bf16)):
            if n > num_layers // pp:
                raise NotCovered(f"{flag} {n}: megatron-core keeps at most one pipeline stage's layers "
                                 f"({num_layers // pp} at --pp {pp}) in bf16 at each end; lower it or use --engine "
                                 "native")
    return {"fp8": fp8.fp8_format, "fp8_recipe": fp8.fp8_recipe, "fp8_margin": fp8.fp8_margin,
            "fp8_amax_history_len": fp8.fp8_amax_history_len, "fp8_amax_compute_algo": fp8.fp8_amax_compute_algo,
            "fp8_wgrad": fp8.fp8_wgrad, "first_last_layers_bf16": fp8.first_last_layers_bf16,
            "num_layers_at_start_in_bf16": fp8.num_layers_at_start_in_bf16,
            "num_layers_at_end_in_bf16": fp8.num_layers_at_end_in_bf16}


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


class MoELogs:
    """The native engine's MoE and MTP log rows (train/moe.py MoETraining: load_balancing_loss or
    seq_load_balancing_loss, moe_load_imbalance per layer and MTP depth ("mtp0", ...), moe_max_load_imbalance,
    mtp_loss and mtp_depth_losses) from megatron-core's own values: the load-balancing loss its routers save to its
    layer-wise tracker (moe_utils.save_to_aux_losses_tracker: the loss over its coefficient, per layer and MTP depth,
    summed over the micro-batches), the tokens per expert from each router's routing map (a forward hook; megatron-core
    counts them only for an expert bias), each MTP depth's mean cross-entropy from MTPLossLoggingHelper's tracker.
    Reduced as the native engine does: one all-reduce of the flat statistics over the world, the tokens of each
    micro-batch seen once (sequence parallel: each TP rank routes its slice), the losses averaged over DP and the
    micro-batches (and over TP ranks, which compute the same MTP losses), the load-balancing loss then over the MoE
    layers. A forward that autograd re-runs in the backward (recompute) is counted once: the tracker is put back as it
    was."""

    NAMES = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss"}

    def __init__(self, chunks, m, load_balancing_type: str, aux_loss_coeff: float, mtp_loss_scaling_factor: float,
                 device, tp: int = 1, token_repeat: int = 1) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        self.token_repeat = token_repeat  # TP ranks without sequence parallelism route the same tokens
        self.tp = tp
        self.L, self.D, self.E = m.num_layers, m.mtp_num_layers, m.num_moe_experts or 1
        # the slots of the MoE layers: decoder layer i is slot i, MTP depth j slot L + j (megatron-core's router
        # layer_number - 1), as the native engine's
        self.moe_layers = [i for i in range(self.L) if m.is_moe_layer(i)] + list(range(self.L, self.L + self.D))
        self.name = self.NAMES.get(load_balancing_type) if aux_loss_coeff > 0 else None
        self.mtp_logged = bool(self.D and mtp_loss_scaling_factor)
        self.counts = torch.zeros(self.L + self.D, self.E, dtype=torch.float64, device=device)
        self.micro_batches = 1
        for chunk in chunks:
            for router in (mod for mod in chunk.modules() if isinstance(mod, TopKRouter)):
                router.register_forward_pre_hook(self._before)
                router.register_forward_hook(self._after)

    @staticmethod
    def _tracker() -> dict:
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        return get_moe_layer_wise_logging_tracker()

    def _before(self, router, args) -> None:
        router._shardkit_saved = None
        if torch.is_grad_enabled() and torch._C._current_graph_task_id() != -1:  # a recompute in the backward
            router._shardkit_saved = {k: v["values"].clone() for k, v in self._tracker().items()}

    def _after(self, router, args, out) -> None:
        if not torch.is_grad_enabled():  # evaluation
            return
        if router._shardkit_saved is not None:  # the real forward counted this micro-batch already
            for k, v in router._shardkit_saved.items():
                self._tracker()[k]["values"].copy_(v)
            return
        routing_map = out[1]
        self.counts[router.layer_number - 1] += routing_map.sum(0).double()

    def start_step(self, num_micro: int) -> None:
        from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker
        from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

        self.counts.zero_()
        clear_aux_losses_tracker()
        if "values" in MTPLossLoggingHelper.tracker:
            MTPLossLoggingHelper.clean_loss_in_tracker()
        self.micro_batches = num_micro

    @torch.no_grad()
    def reduce_stats(self, dp: int) -> torch.Tensor:
        """On the device: per slot the tokens routed, max / mean load, the load-balancing loss over the MoE layers,
        and the MTP losses (mean, then per depth) (one all-reduce; read to the host with the step's other values)."""
        from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

        n = self.L + self.D
        zeros = torch.zeros(n, dtype=torch.float64, device=self.counts.device)
        tracked = self._tracker().get(self.name) if self.name else None
        aux = tracked["values"].to(self.counts) if tracked is not None else zeros
        mtp = MTPLossLoggingHelper.tracker.get("values") if self.D else None
        mtp = mtp.to(self.counts) if mtp is not None else zeros[:self.D]  # this rank's (0 off the last stage)
        flat = torch.cat([self.counts.reshape(-1), aux, mtp])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flat)
        counts = flat[:self.counts.numel()].view_as(self.counts) / self.token_repeat
        aux = flat[self.counts.numel():self.counts.numel() + n] / (self.token_repeat * dp * self.micro_batches)
        mtp = flat[self.counts.numel() + n:] / (self.tp * dp * self.micro_batches)
        idx = torch.tensor(self.moe_layers, dtype=torch.long, device=flat.device)
        return torch.cat([counts.sum(1), counts.amax(1) / counts.mean(1), aux[idx].mean().reshape(1),
                          mtp.mean().reshape(1) if self.D else mtp, mtp])

    def finish_step(self, host: list[float]) -> dict:
        n = self.L + self.D
        sums, ratio, aux = host[:n], host[n:2 * n], host[2 * n]
        moe = [i for i in range(n) if sums[i] > 0]
        out: dict = {}
        if moe:
            out["moe_load_imbalance"] = {(str(i) if i < self.L else f"mtp{i - self.L}"): round(ratio[i], 4)
                                         for i in moe}
            out["moe_max_load_imbalance"] = max(out["moe_load_imbalance"].values())
            if self.name:
                out[self.name] = aux
        if self.mtp_logged:
            out["mtp_loss"] = host[2 * n + 1]
            out["mtp_depth_losses"] = host[2 * n + 2:2 * n + 2 + self.D]
        return out


def moe_fields(m, dims, moe_args) -> dict:
    """TransformerConfig's MoE fields: the model's (checkpoint.megatron.model_args, Megatron-LM's names) and the run's
    (--moe-router-load-balancing-type, --moe-aux-loss-coeff or the checkpoint's, --moe-router-dtype,
    --moe-token-dispatcher-type); dropless, experts as the local spec's SequentialMLP (one weight per expert)."""
    if not m.is_moe:
        return {}
    import dataclasses

    from megatron.core.transformer.transformer_config import TransformerConfig

    from checkpoint.megatron import model_args
    from train.moe import settings_of

    known = {f.name for f in dataclasses.fields(TransformerConfig)}
    a = model_args(m, dims.model_parallel)
    out = {k: v for k, v in a.items() if k.startswith("moe_") and k in known}
    s = settings_of(moe_args, m)
    # the router's logits in fp32 where the model's family computes them there (DeepSeek), as the native engine
    router_dtype = s.router_dtype or ("fp32" if family_of(m.model_type).router_fp32 else None)
    out.update(num_moe_experts=a["num_experts"], moe_router_load_balancing_type=s.load_balancing_type,
               moe_aux_loss_coeff=s.aux_loss_coeff, moe_router_dtype=router_dtype, moe_grouped_gemm=False,
               moe_router_bias_update_rate=s.bias_update_rate,
               moe_token_dispatcher_type=moe_args.moe_token_dispatcher_type, moe_permute_fusion=False,
               moe_router_fusion=False, expert_model_parallel_size=dims.ep,
               expert_tensor_parallel_size=dims.expert_tp)
    return out


def mla_fields(m, dims) -> dict:
    """MLATransformerConfig's multi-latent attention fields: the model's (checkpoint.megatron.model_args, Megatron-LM's
    names: q_lora_rank (None: one q projection), kv_lora_rank, the head sizes, rope_type and YaRN's factor / mscale /
    mscale_all_dim) and the YaRN fields Megatron-LM has no flag for, from the checkpoint's rope_scaling
    (original_max_position_embeddings, beta_fast, beta_slow: MLATransformerConfig's defaults are DeepSeek-V3's, not
    necessarily this model's). megatron-core's MLA rotates interleaved pairs itself (rotary_interleaved stays off),
    and its latent norms are the engine's LatentNorm (qk_layernorm stays off: see LatentNorm)."""
    if not m.multi_latent_attention:
        return {}
    from checkpoint.megatron import model_args

    a = model_args(m, dims.model_parallel)
    names = ("multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
             "v_head_dim", "rope_type", "rotary_scaling_factor", "mscale", "mscale_all_dim")
    out = {k: a[k] for k in names if k in a}
    out.update(rotary_interleaved=False, qk_layernorm=False, rotary_base=m.rotary_base)
    if out["rope_type"] == "yarn":
        rope = m.rope_scaling
        out.update(original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
                   beta_fast=float(rope.get("beta_fast", 32.0)), beta_slow=float(rope.get("beta_slow", 1.0)))
    else:  # MLATransformerConfig's default factor (40) would still scale its softmax through mscale_all_dim
        out.update(rotary_scaling_factor=1.0)
    return out


def te_spec_fields(m, te: bool) -> dict:
    """TransformerConfig's fields for megatron-core's Transformer Engine layer spec. Its norms are TE's (TENorm, and
    the norms fused into the following linear as TELayerNormColumnParallelLinear's `layer_norm_weight`: shardkit's
    canonical names), which run under sequence parallelism, so the local spec's stand-ins (RMSNorm, LatentNorm,
    HeadNorm) are not applied there. Multi-latent attention's latent norms are fused into linear_q_up_proj /
    linear_kv_up_proj only with qk_layernorm on (IdentityOp otherwise: the norms would be dropped), at the config's
    layernorm_epsilon: DeepSeek's latent norms take 1e-6 (LATENT_NORM_EPS) whatever rms_norm_eps says, so another
    rms_norm_eps is refused there."""
    if not (te and m.multi_latent_attention):
        return {}
    from train.model import LATENT_NORM_EPS

    if m.norm_epsilon != LATENT_NORM_EPS:
        raise NotCovered(f"rms_norm_eps {m.norm_epsilon} with multi-latent attention on Transformer Engine's layer "
                         f"spec: its latent norms (fused into linear_q_up_proj / linear_kv_up_proj) take the config's "
                         f"epsilon, DeepSeek's take {LATENT_NORM_EPS}; use --transformer-impl local")
    return {"qk_layernorm": True}


def transformer_config(m, dims, run, *, sp: bool, dtype: torch.dtype, on_cpu: bool, moe_args=None, te=False,
                       fp8=None, cp_comm_type: str | None = None):
    """megatron-core's TransformerConfig (MLATransformerConfig for multi-latent attention) for shardkit's model config
    `m` at this run's layout: the one place the engine's shapes come from (never from flags retyped by the user)."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    cls = MLATransformerConfig if m.multi_latent_attention else TransformerConfig
    fields = dict(rotary_interleaved=m.rotary_interleaved, qk_layernorm=m.qk_layernorm)
    fields.update(mla_fields(m, dims))
    fields.update(te_spec_fields(m, te))
    fields.update(fp8_fields(fp8, m.num_layers, dims.pp))
    if m.mtp_num_layers:  # megatron-core's MTP block, its loss weighed as --mtp-loss-scaling-factor says
        from train.moe import settings_of

        fields.update(mtp_num_layers=m.mtp_num_layers,
                      mtp_loss_scaling_factor=settings_of(moe_args, m).mtp_loss_scaling_factor)
    return cls(
        num_layers=m.num_layers, hidden_size=m.hidden_size, ffn_hidden_size=m.ffn_hidden_size,
        num_attention_heads=m.num_attention_heads, num_query_groups=m.num_query_groups, kv_channels=m.kv_channels,
        layernorm_epsilon=m.norm_epsilon, normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=m.add_qkv_bias, **fields,
        hidden_dropout=run.hidden_dropout, attention_dropout=run.attention_dropout,
        tensor_model_parallel_size=dims.tp, pipeline_model_parallel_size=dims.pp,
        virtual_pipeline_model_parallel_size=dims.vpp if dims.vpp > 1 else None, sequence_parallel=sp,
        context_parallel_size=dims.cp, cp_comm_type=cp_comm_type if dims.cp > 1 else None,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16,
        attention_softmax_in_fp32=True, use_cpu_initialization=on_cpu,
        # initialised (then overwritten by the checkpoint): megatron-core sets its tensor-parallel attributes there
        perform_initialization=True,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False, apply_rope_fusion=False,
        persist_layer_norm=False, gradient_accumulation_fusion=False, deallocate_pipeline_outputs=True,
        recompute_granularity=run.recompute_granularity, recompute_method=run.recompute_method,
        recompute_num_layers=run.recompute_num_layers, **pipeline_split_fields(dims.split),
        **moe_fields(m, dims, moe_args))


def pipeline_split_fields(split) -> dict:
    """An uneven pipeline split (checkpoint.layout.PipelineSplit: Megatron-LM's flags) as TransformerConfig's fields;
    megatron-core then builds each stage's layers by its own rules, which the engine's parameter table checks against
    shardkit's layout layer by layer."""
    if split is None:
        return {}
    return {"num_layers_in_first_pipeline_stage": split.first, "num_layers_in_last_pipeline_stage": split.last,
            "account_for_embedding_in_pipeline_split": split.embedding,
            "account_for_loss_in_pipeline_split": split.loss, "pipeline_model_parallel_layout": split.layout}


def fp8_line(fp8) -> str:
    """The startup line's FP8 part on TE's spec: the recipe megatron-core builds (fp8_utils.get_fp8_recipe)."""
    if not fp8.enabled:
        return ""
    recipe = {"delayed": "DelayedScaling", "tensorwise": "Float8CurrentScaling",
              "blockwise": "Float8BlockScaling"}[fp8.fp8_recipe]
    kept = (f", decoder layers {fp8.num_layers_at_start_in_bf16} first / {fp8.num_layers_at_end_in_bf16} last in "
            "bf16" if fp8.first_last_layers_bf16 else "")
    return f"; FP8 {fp8.fp8_format} via TE's {recipe} under megatron-core's fp8 context{kept}"


def expert_biases(model) -> list:
    """The routers' expert_bias buffers (DeepSeek-V3's aux-loss-free balancing: megatron-core updates them in
    finalize_model_grads from the tokens each expert received, outside the optimizer), loaded and saved with the
    weights; kept in fp32 as megatron-core's router keeps them (Float16Module would have cast them to bf16)."""
    out = []
    for name, buf in model.named_buffers():
        if name.endswith(".router.expert_bias"):
            buf.data = buf.data.float()
            out.append((name, buf))
    return out


def distributed_parts(mopt) -> list:
    """The DistributedOptimizers of get_megatron_optimizer's result (a ChainedOptimizer of one, for a dense model)."""
    return list(getattr(mopt, "chained_optimizers", [mopt]))


# -- the optimizer state, as train/checkpointing.py's save reads it ------------------------------------------------------

class SavedState:
    """What shardkit's save path (ckpt_io.saved_values, the finiteness check, the param groups) asks of an optimizer:
    names, params, expert flags, the flags' config, the step count, which parameters this rank writes (round-robin
    over DP ranks, whole tensors; under CP the DP rank's CP rank 0, as ckpt_io.saved_values writes) and their fp32
    params and moments. `refresh()` collects them from megatron-core's distributed optimizer (each rank's flat ranges:
    its shards are over DP x CP, every CP rank holding the same weights) into shardkit's tensors, every rank taking
    part.
    megatron-core's per-expert weights are saved stacked by layer (a chunk of an expert tensor holds a layer's local
    experts together): `table` is the table a save writes, its stacks taken afresh by `refresh()`."""

    def __init__(self, table, mopt, cfg, groups, dp: int, expert: frozenset = frozenset()) -> None:
        self.entries = stacked_entries(table)  # (saved LocalParam, its megatron-core parameters' LocalParams)
        self.table = [lp for lp, _ in self.entries]
        trained = [k for k, (lp, _) in enumerate(self.entries) if not lp.tied_copy and lp.param.requires_grad]
        self._trained = trained
        self.names = [self.table[k].name for k in trained]
        self.params = [self.table[k].param for k in trained]
        self.expert = [self.table[k].spec.name in expert for k in trained]
        self.cfg, self.mopt, self.groups, self.dp = cfg, mopt, groups, dp
        # expert weights' optimizer state is sharded over their expert-data-parallel group (as native's)
        self.owner = [i % (groups.dims.edp if e else dp) for i, e in enumerate(self.expert)]
        self.steps = 0
        self._state: dict[int, dict[str, torch.Tensor]] = {}

    def is_mine(self, i: int | None) -> bool:
        g = self.groups
        if i is None:
            return False
        return self.owner[i] == g.edp_rank if self.expert[i] else (self.owner[i] == g.dp_rank and g.cp_rank == 0)

    def owned(self) -> list[int]:
        return [i for i in range(len(self.names)) if self.is_mine(i)]

    def state_of(self, i: int) -> dict[str, torch.Tensor]:
        return self._state[i]

    @torch.no_grad()
    def refresh(self) -> None:
        """Each parameter's fp32 param and moments, whole, on the DP rank that writes it (and only there): every DP
        rank puts its range of the distributed optimizer's shard into a zero buffer, one reduce per parameter to the
        owner (x + 0 = x: exact). What a rank keeps is 1/DP of its model-parallel shard's optimizer state, on the
        host; the transient buffer is one parameter's. Stacked entries take their members' weights afresh."""
        import dataclasses

        from megatron.core import parallel_state as ps

        g = self.groups
        dense = ps.get_data_parallel_group(with_context_parallel=True)  # the optimizer's shards: over DP x CP
        expert = ps.get_expert_data_parallel_group() if any(self.expert) else None
        ranks = {g: dist.get_process_group_ranks(g) for g in (dense, expert) if g is not None}
        parts = distributed_parts(self.mopt)
        self._state = {}
        for k, (lp, members) in enumerate(self.entries):
            if len(members) > 1 or members[0] is not lp:
                self.entries[k] = (dataclasses.replace(lp, param=torch.stack([m.param.detach() for m in members])),
                                   members)
        self.table = [lp for lp, _ in self.entries]
        self.params = [self.table[k].param for k in self._trained]
        for i, k in enumerate(self._trained):
            group = expert if self.expert[i] else dense
            # the owner's global rank: of the expert-data-parallel group (spanning DP x CP), or DP rank `owner` at
            # CP rank 0 beside this rank
            dst = (ranks[group][self.owner[i]] if self.expert[i]
                   else g.dims.rank(tp=g.tp_rank, cp=0, dp=self.owner[i], pp=g.pp_rank))
            states = []
            for m in self.entries[k][1]:
                p = m.param
                buf = torch.zeros(3, p.numel(), dtype=torch.float32, device=p.device)
                for part in parts:
                    if p in part.model_param_gbuf_map:  # this DP rank holds a range of it
                        r = part._get_model_param_range_map(p)["param"]
                        t = part._get_main_param_and_optimizer_states(p)
                        for j, key in enumerate(("param", "exp_avg", "exp_avg_sq")):
                            buf[j, r.start:r.end] = t[key].detach().reshape(-1)
                if len(ranks[group]) > 1:
                    dist.reduce(buf, dst=dst, group=group)
                states.append(buf.cpu().view(3, *p.shape))
            if self.is_mine(i):
                both = states[0] if len(states) == 1 else torch.stack(states, dim=1)
                self._state[i] = {s: both[j] for j, s in enumerate(OPTIMIZER_STATES)}


def stacked_entries(table) -> list:
    """The saved table of megatron-core's parameters: each its own entry, except one layer's local experts of one
    expert tensor, stacked in expert order into one entry (named as megatron-core's GroupedMLP would name it)."""
    import dataclasses

    out, stacks = [], {}
    for lp in table:
        if lp.expert is None:
            out.append((lp, [lp]))
            continue
        key = (lp.spec.name, lp.vstage, lp.index)
        if key not in stacks:
            stacks[key] = []
            name = re.sub(r"\.local_experts\.\d+\.", ".", lp.name)
            out.append((dataclasses.replace(lp, name=name, expert=None), stacks[key]))
        stacks[key].append(lp)
    for members in stacks.values():
        members.sort(key=lambda m: m.expert)
        if [m.expert for m in members] != list(range(len(members))):
            raise FormatError(f"{members[0].name}: local experts {[m.expert for m in members]} are not 0..n-1")
    return out


# -- the trainer -----------------------------------------------------------------------------------------------------------

class _Backend:
    """What the native loop asks of its backend: a description and the FP8 delayed-scaling state (FP8State; None
    without delayed scaling), saved into and resumed from train_state.json's "fp8" as the native engine's."""

    def __init__(self, line: str, fp8: FP8State | None = None) -> None:
        self.line, self.fp8 = line, fp8

    def describe(self) -> str:
        return self.line

    def state_dict(self, groups):
        return self.fp8.gather_state(groups) if self.fp8 is not None else None

    def load_state_dict(self, state, src) -> None:
        if self.fp8 is not None and state is not None:  # none saved: TE's initial state (scale 1), as native
            self.fp8.load_state_dict(state, str(src))


class FP8State:
    """megatron-core's TE linears' delayed-scaling state (each one-GEMM TE module's fp8_meta: amax histories and
    scales) in the native engine's JSON form and names (train/te.py modules_state / load_modules_state; train/fp8.py
    gather_state), so an FP8 run resumes on either engine: each module by its global canonical name
    (`fp8_module_name`). Loading sets a module up first under megatron-core's own FP8 context
    (fp8_utils.get_fp8_context: the recipe its forward uses)."""

    def __init__(self, fp8, modules: list, context, every_rank: bool) -> None:
        self.cfg, self.modules, self.context, self.every_rank = fp8, modules, context, every_rank

    @classmethod
    def of(cls, fp8, chunks, starts: list[int], expert_offset: int, config, every_rank: bool) -> FP8State | None:
        """The state of the model chunks' TE linears (None unless --fp8-recipe delayed), `starts` each chunk's first
        global layer, `expert_offset` this rank's first global expert."""
        if fp8 is None or not fp8.enabled or fp8.fp8_recipe != "delayed":
            return None
        modules = [(fp8_module_name(name, starts[v], expert_offset), mod)
                   for v, chunk in enumerate(chunks) for name, mod in chunk.named_modules() if is_te_linear(mod)]

        def context():
            from megatron.core.fp8_utils import get_fp8_context

            return get_fp8_context(config)

        return cls(fp8, modules, context, every_rank)

    def state_dict(self) -> dict | None:
        from train.te import modules_state

        return modules_state(self.cfg, self.modules)

    def gather_state(self, groups) -> dict | None:
        from train.fp8 import gather_state

        return gather_state(self, groups, self.every_rank)

    def load_state_dict(self, sd: dict, where: str) -> None:
        from train.te import load_modules_state

        saved = {k.rsplit(".", 1)[0] for k in sd.get("tensors", {})}
        missing = [name for name, _ in self.modules if name not in saved]
        if saved and missing:  # e.g. a native save: its FP8 leaves routed experts and MTP layers in high precision
            raise ConfigError(f"{where}: no FP8 delayed-scaling state for {len(missing)} of this run's "
                              f"{len(self.modules)} TE linears ({missing[0]}, ...): the checkpoint's FP8 run kept "
                              "them in high precision (the native engine does so for routed experts and MTP layers); "
                              "resume with --engine native, or with --fp8-recipe tensorwise (no state to resume)")
        load_modules_state(self.cfg, self.modules, sd, where, self.context)


def is_te_linear(module) -> bool:
    """A Transformer Engine one-GEMM module (te.Linear, te.LayerNormLinear: megatron-core's TELinear,
    TEColumnParallelLinear, TERowParallelLinear, TELayerNormColumnParallelLinear), which keeps delayed-scaling state
    in fp8_meta; TE's attention (no weight) and megatron-core's own modules are not."""
    return (hasattr(module, "fp8_meta") and callable(getattr(module, "init_fp8_metadata", None))
            and isinstance(getattr(module, "weight", None), torch.Tensor))


def fp8_module_name(name: str, start: int, expert_offset: int) -> str:
    """A module's global canonical name from its name in a model chunk: the decoder layer's global number (the
    chunk's first layer `start` plus the local one) and an expert's global index (SequentialMLP's local expert plus
    this rank's first, `expert_offset`); MTP's layers keep megatron-core's depth numbers."""
    hit = re.fullmatch(r"decoder\.layers\.(\d+)\.(.*)", name)
    if hit is None:
        return name
    rest = re.sub(r"(\.experts\.local_experts\.)(\d+)\.", lambda e: f"{e[1]}{int(e[2]) + expert_offset}.", hit[2])
    return f"decoder.layers.{start + int(hit[1])}.{rest}"


class MegatronCoreTrainer(Trainer):
    """train/loop.py's Trainer with megatron-core's model, DDP, optimizer, schedules and scheduler (see the module
    docstring). Construction refuses what it does not cover (NotCovered) before any process group is created."""

    engine = "megatron-core"

    def __init__(self, cfg) -> None:  # noqa: C901 - one linear set-up, in the native Trainer's order
        from train.config import default_changes, megatron_flags, validate
        from train.metrics import check_wandb, flops_per_step
        from train.parallel.groups import build_groups

        self.on_cpu = not torch.cuda.is_available()
        check_flags(cfg, self.on_cpu)  # first: what this engine refuses is said as its own line
        validate(cfg)
        if cfg.run.wandb_project:
            check_wandb(cfg.run.wandb_project)
        self.cfg = cfg
        p, d, c = cfg.parallel, cfg.data, cfg.checkpoint
        self.ck, self.src, self.state, load_notes = open_load(c, d.global_batch_size)  # as native (train/loop.py)
        self.model_cfg = m = self.ck.config
        check_model(m)
        # --overlap-grad-reduce / --overlap-param-gather: honoured here (megatron_flags notes them; native refuses)
        self.overlap = {dest: bool(v) for _, dest, v in cfg.run.megatron if dest in OVERLAP_DESTS}
        self.notes = [line for line in (default_changes(cfg), *megatron_flags(cfg)) if line] + load_notes
        # megatron-core's layer spec: its Transformer Engine spec where TE is installed (on CUDA), its local one else
        self.impl = layer_spec(cfg.run.transformer_impl, cfg.fp8, self.on_cpu, te_available())
        te_spec_fields(m, self.impl == "transformer_engine")  # their refusals before any group exists
        fp8_fields(cfg.fp8, m.num_layers, p.pp)
        dims = run_layout(cfg)
        micro = d.global_batch_size // (d.micro_batch_size * dims.dp)
        if dims.vpp > 1 and micro % dims.pp:  # megatron-core's interleaved schedule: groups of PP micro-batches
            raise NotCovered(f"--vpp {dims.vpp}: megatron-core's interleaved schedule runs the micro-batches in groups "
                             f"of --pp {dims.pp}, but each DP rank has {micro} per step (--global-batch-size "
                             f"{d.global_batch_size} / (--micro-batch-size {d.micro_batch_size} x DP {dims.dp})); "
                             f"make it a multiple of {dims.pp}")
        self.dims = dims
        check_layout_for_model(cfg, dims, m, self.src)  # the native engine's (and `shardkit launch`'s) checks
        check_save_format(c.save, c.save_format)
        self.groups = build_groups(dims)  # shardkit's coordinates and groups: the save path and the step's one read
        self.seed = seed_process_rngs(d.seed, self.groups.pp_rank)  # Megatron-LM's _set_random_seed
        self.layout = dims.model_parallel
        self.dtype = torch.bfloat16 if cfg.run.bf16 else torch.float32
        self.sp = p.sequence_parallel and dims.tp > 1
        self.device = (torch.device("cuda", torch.cuda.current_device()) if not self.on_cpu
                       else torch.device("cpu"))
        self.moe, self.interleaved = None, None
        # packed documents (--reset-position-ids / --reset-attention-mask / --eod-mask-loss): the native engine's rule
        self.packing = packing_from(d, m, self.ck.hf_dir())
        # TE's core attention: on TE's layer spec, and for multi-latent attention where TE is installed (on CUDA)
        self.te_attention = self.impl == "transformer_engine" or (m.multi_latent_attention and not self.on_cpu
                                                                   and te_available())
        check_packing(m, self.packing, self.te_attention)
        self._context_parallel()
        self._build_megatron()
        self.table = self._param_table()
        ckpt_io.load_model(self.ck, self.table, self.layout, self.groups)
        self._wrap_and_optimizer()
        expert = ({lp.spec.name for lp in self.table if lp.spec.expert}
                  if dims.ep > 1 or dims.expert_tp != dims.tp else frozenset())  # as the native engine's optimizer
        self.opt = SavedState(self.table, self.mopt, cfg.optimizer, self.groups, dims.dp, frozenset(expert))
        self.iteration, self.consumed = 0, 0
        if self.state is not None:
            self.iteration = int(self.state["iteration"])
            self.consumed = int(self.state["consumed_samples"])
            if not c.no_load_optim:
                self._load_optimizer(int(self.state.get("optimizer_steps", self.iteration)))
            if not c.no_load_rng and self.state.get("rng"):
                ckpt_io.set_rng_state(self.state["rng"])
            self.backend.load_state_dict(self.state.get("fp8"), self.src)  # FP8 scaling state (as native)
        self.num_micro = d.global_batch_size // (d.micro_batch_size * dims.dp)
        self._schedule()  # shardkit's scheduler: the checks on resume and the saved state (as native)
        self.msched = self._megatron_scheduler()
        self._data()
        self.flops = flops_per_step(m, d.seq_length, d.global_batch_size * d.seq_length)
        self.pending_save = None
        self.save_group = None
        self.peak_mem_gib = 0.0

    # -- megatron-core's pieces ----------------------------------------------------------------------------------
    def _context_parallel(self) -> None:
        """Context parallelism's core attention: Transformer Engine's TEDotProductAttention where it is installed (on
        CUDA; --cp-comm-type as TransformerConfig.cp_comm_type), else shardkit's (ContextParallelAttention on the
        native engine's AttentionState); `cp_state` holds the micro-batch's layout around each forward."""
        cp = self.dims.cp
        self.cp_te = cp > 1 and not self.on_cpu and te_available()
        self.cp_state, self.cp_line = None, None
        check_context_parallel(self.model_cfg, self.packing, cp, self.cp_te, self.cfg.run.recompute_granularity)
        if cp == 1:
            return
        if self.cp_te:
            self.cp_line = (f"Transformer Engine's TEDotProductAttention over cp={cp} (cp_comm_type "
                            f"{self.cfg.parallel.cp_comm_type})")
            return
        self.cp_state, line = attention_state(self.groups, self.cfg.parallel.cp_comm_type, self.packing, False,
                                              self.device, self.dtype)
        self.cp_line = "shardkit's ContextParallelAttention, " + line.removeprefix("attention: ")
        self.cp_attention = ContextParallelAttention.bound(self.cp_state)  # the core attention of every layer

    def _cp_core_attention(self, attn) -> None:
        """A layer's core attention under CP (`_context_parallel`)."""
        if self.cp_te:
            from megatron.core.extensions.transformer_engine import TEDotProductAttention

            attn.core_attention = TEDotProductAttention
        elif self.cp_state is not None:
            attn.core_attention = self.cp_attention

    def _build_megatron(self) -> None:
        import_megatron()
        from megatron.core import parallel_state as ps
        from megatron.core import tensor_parallel
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
        from megatron.core.transformer.module import Float16Module

        if self.on_cpu:
            cpu_stand_ins()
        dims, m = self.dims, self.model_cfg
        te = self.impl == "transformer_engine"  # megatron-core's TE layer spec (`layer_spec`)
        ps.initialize_model_parallel(tensor_model_parallel_size=dims.tp, pipeline_model_parallel_size=dims.pp,
                                     virtual_pipeline_model_parallel_size=dims.vpp if dims.vpp > 1 else None,
                                     context_parallel_size=dims.cp, expert_model_parallel_size=dims.ep,
                                     expert_tensor_parallel_size=dims.expert_tp)
        g = self.groups
        theirs = (ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
                  ps.get_data_parallel_rank(), ps.get_context_parallel_rank(), ps.get_expert_model_parallel_rank(),
                  ps.get_expert_tensor_parallel_rank(), ps.get_expert_data_parallel_rank())
        ours = (g.tp_rank, g.pp_rank, g.dp_rank, g.cp_rank, g.ep_rank, g.etp_rank, g.edp_rank)
        if theirs != ours:
            raise ConfigError(f"rank {g.rank}: megatron-core's coordinates (tp, pp, dp, cp, ep, etp, edp) {theirs} "
                              f"differ from shardkit's {ours}")
        # NCCL's rule: a communicator's first use is a collective of all its ranks (megatron-core's pipeline
        # exchanges are batched point-to-point on the pipeline group)
        groups = [ps.get_pipeline_model_parallel_group(), ps.get_tensor_model_parallel_group(),
                  ps.get_data_parallel_group()]
        if dims.cp > 1:  # TE's CP exchanges, and the gradients' reduction and optimizer shards over DP x CP
            groups += [ps.get_context_parallel_group(), ps.get_data_parallel_group(with_context_parallel=True)]
        if m.is_moe:  # the MoE layers' token exchanges and the expert gradients' reduction
            groups += [ps.get_expert_model_parallel_group(), ps.get_expert_tensor_parallel_group(),
                       ps.get_expert_data_parallel_group()]
        for group in groups:
            dist.all_reduce(torch.zeros(1, device=self.device), group=group)
        if not self.on_cpu:
            tensor_parallel.model_parallel_cuda_manual_seed(self.seed)  # seed + 100 x pp_rank, as Megatron-LM
        self.tconfig = tc = transformer_config(m, dims, self.cfg.run, sp=self.sp, dtype=self.dtype,
                                               on_cpu=self.on_cpu, moe_args=self.cfg.moe, te=te, fp8=self.cfg.fp8,
                                               cp_comm_type=self.cfg.parallel.cp_comm_type)
        self.padded_vocab = m.padded_vocab_size(dims.tp)
        chunks = []
        for v in range(dims.vpp):
            vs = v if dims.vpp > 1 else None
            spec = get_gpt_decoder_block_spec(tc, use_transformer_engine=te, normalization="RMSNorm", vp_stage=vs)
            if not te:  # the final norm (TE's spec: TENorm, which takes SP)
                spec.layer_norm = RMSNorm
            for layer in spec.layer_specs:
                attn = layer.submodules.self_attention.submodules
                if not te:
                    local_spec_layer(layer, m, self.te_attention)
                self._cp_core_attention(attn)
            mtp = None
            if m.mtp_num_layers:  # its layers are the decoder's last layer spec (as changed above) after norms and
                # eh_proj; on the last pipeline stage only (None elsewhere)
                mtp = get_gpt_mtp_block_spec(tc, spec, use_transformer_engine=te, vp_stage=vs)
                for layer in (mtp.layer_specs if mtp is not None and not te else ()):
                    layer.submodules.enorm = layer.submodules.hnorm = layer.submodules.layer_norm = RMSNorm
            with keep_pickle_allowlist():
                model = GPTModel(tc, spec, vocab_size=self.padded_vocab, max_sequence_length=m.max_position_embeddings,
                                 mtp_block_spec=mtp,
                                 pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vs),
                                 post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vs),
                                 share_embeddings_and_output_weights=m.tie_word_embeddings,
                                 position_embedding_type="rope", rotary_percent=1.0, rotary_base=int(m.rotary_base)
                                 if float(m.rotary_base).is_integer() else m.rotary_base, vp_stage=vs)
            if not self.on_cpu:
                model.cuda(torch.cuda.current_device())
            self._shardkit_rope(model)
            self._check_mla_rope(model)
            if getattr(model, "output_layer", None) is not None and self.padded_vocab > m.vocab_size:
                model.output_layer.register_forward_hook(self._mask_padded_vocab)
            chunks.append(model)
        self.chunks = chunks  # the GPTModels (their parameter names are the canonical ones)
        self.moe_logs = None
        if m.is_moe or m.mtp_num_layers:  # the native engine's MoE and MTP rows from megatron-core's values
            self.moe_logs = MoELogs(chunks, m, tc.moe_router_load_balancing_type, tc.moe_aux_loss_coeff,
                                    tc.mtp_loss_scaling_factor, self.device, tp=dims.tp,
                                    token_repeat=1 if self.sp else dims.tp)
        self.wrapped = [Float16Module(tc, c) if self.dtype == torch.bfloat16 else c for c in chunks]

    def _shardkit_rope(self, model) -> None:
        """RoPE's inverse frequencies as shardkit's model computes them (transformers' own function for the model's
        rope_type: Llama 3's scaling with the checkpoint's parameters, which megatron-core's fixed llama3 constants
        would not reproduce)."""
        from train.model import rope_init

        rope = getattr(model, "rotary_pos_emb", None)
        if rope is None:
            return
        rope_type = (self.model_cfg.rope_scaling or {}).get("rope_type", "default")
        inv_freq, scaling = rope_init(self.model_cfg.hf_transformers_config(), rope_type, torch.device("cpu"))
        if scaling != 1.0:
            raise NotCovered(f"RoPE {rope_type!r} scales attention by {scaling}: not in the megatron-core engine yet")
        rope.inv_freq = inv_freq.to(device=rope.inv_freq.device, dtype=rope.inv_freq.dtype)

    def _check_mla_rope(self, model) -> None:
        """Multi-latent attention's RoPE is megatron-core's own (each layer's RotaryEmbedding or YarnRotaryEmbedding,
        the YaRN mscale on cos and sin): its inverse frequencies and scaling checked against transformers' function
        for the model's rope_type (what the native engine computes), refused where they differ."""
        from train.model import rope_init

        layers = getattr(model.decoder, "layers", None) if self.model_cfg.multi_latent_attention else None
        if not layers:
            return
        rope = layers[0].self_attention.rotary_pos_emb
        out = rope.get_emb(2)  # the whole length's (its forward gives this CP rank's chunks)
        emb, mscale = out if isinstance(out, tuple) else (out, 1.0)
        theirs = emb[1].reshape(-1)[: emb.shape[-1] // 2].double().cpu()  # position 1: the inverse frequencies
        rope_type = (self.model_cfg.rope_scaling or {}).get("rope_type", "default")
        inv_freq, scaling = rope_init(self.model_cfg.hf_transformers_config(), rope_type, torch.device("cpu"))
        if not (torch.allclose(theirs, inv_freq.double(), rtol=1e-6, atol=0)
                and math.isclose(float(mscale), float(scaling), rel_tol=1e-6)):
            raise NotCovered(f"RoPE {rope_type!r} {self.model_cfg.rope_scaling or {}}: megatron-core's multi-latent "
                             "attention computes other frequencies or scaling than transformers; use --engine native")

    def _mask_padded_vocab(self, module, args, out):
        """The loss over the true vocabulary, as the native engine takes it: the output layer's TP padding columns
        get -inf logits (megatron-core would count them in its softmax)."""
        logits, bias = out
        local = logits.shape[-1]
        valid = self.model_cfg.vocab_size - self.groups.tp_rank * local
        if valid >= local:
            return out
        cols = torch.arange(local, device=logits.device) >= max(valid, 0)
        return logits.masked_fill(cols, float("-inf")), bias

    def _param_table(self) -> list:
        """shardkit's LocalParam table for megatron-core's parameters: canonical name (global layer number), spec,
        position in this rank's local stacked tensor and model chunk."""
        m, layout, g = self.model_cfg, self.layout, self.groups
        specs = {s.name: s for s in model_specs(m, layout)}
        prefix = "decoder.layers."
        experts = re.compile(r"(.*\.mlp\.experts)\.local_experts\.(\d+)\.(.*)")  # SequentialMLP's per-expert weights
        out = []
        for v, model in enumerate(self.chunks):
            start, stop = layout.layer_range(m.num_layers, g.pp_rank, v)
            built = len(model.decoder.layers)
            if built != stop - start:
                raise ConfigError(f"megatron-core built {built} decoder layers for pipeline rank {g.pp_rank} chunk {v}; "
                                  f"shardkit's layout gives it layers {start}..{stop - 1}")
            for name, p in [*model.named_parameters(), *expert_biases(model)]:
                tied_copy = False
                key = name
                if name == "output_layer.weight" and m.tie_word_embeddings:  # the last stage's copy of the embedding
                    key, tied_copy = "embedding.word_embeddings.weight", True
                local, expert = None, None
                if key.startswith(prefix):
                    local, rest = key[len(prefix):].split(".", 1)
                    local = int(local)
                    key = f"{prefix}{start + local}.{rest}"
                hit = experts.fullmatch(key)
                if hit:  # local expert e of this rank's stacked expert tensor (canonical: mlp.experts.experts.*)
                    key, expert = f"{hit[1]}.experts.{hit[3]}", int(hit[2])
                found = None
                for cand in canonical_candidates(key):
                    cname, layer = canonical_name(cand, not m.heterogeneous)
                    if cname in specs:
                        found = (cname, layer)
                        break
                if found is None:
                    raise FormatError(f"megatron-core parameter {name}: no canonical tensor for it in the sharding "
                                      "table")
                spec = specs[found[0]]
                # the embedding's copy on a later stage (the tied output layer's, or MTP's on the last stage, which
                # megatron-core keeps in step with the first stage's by its embedding group): read, never written
                tied_copy = tied_copy or (spec.stage == "first" and g.pp_rank != 0)
                want = local_shape(spec, layout)[(found[1] is not None) + (expert is not None):]
                if tuple(p.shape) != tuple(want):
                    raise FormatError(f"megatron-core parameter {name}: local shape {list(p.shape)}, the sharding "
                                      f"table gives {spec.name} {list(want)} at tp={layout.tp} pp={layout.pp}")
                stacked = found[1] is not None  # a heterogeneous stack (dense and MoE layers): per-layer tensors
                vstage = v if stacked else owner(spec, layout, m.num_layers)[1]
                out.append(ckpt_io.LocalParam(f"{v}/{name}", p, spec, local if stacked else None, tied_copy, vstage,
                                              expert))
        return out

    def _wrap_and_optimizer(self) -> None:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer, get_standard_config_overrides

        o = self.cfg.optimizer
        ddp_cfg = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=True, check_for_nan_in_grad=False,
            overlap_grad_reduce=self.overlap.get("overlap_grad_reduce", False),
            overlap_param_gather=self.overlap.get("overlap_param_gather", False))
        with keep_pickle_allowlist():
            self.ddp = [DistributedDataParallel(self.tconfig, ddp_cfg, c,
                                                disable_bucketing=v > 0) for v, c in enumerate(self.wrapped)]
            ocfg = OptimizerConfig(optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
                                   adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2, adam_eps=o.adam_eps,
                                   clip_grad=o.clip_grad, bf16=self.dtype == torch.bfloat16, fp16=False,
                                   params_dtype=torch.float32, use_distributed_optimizer=True)
            self.mopt = get_megatron_optimizer(ocfg, self.ddp, config_overrides=get_standard_config_overrides(ocfg))
        tc = self.tconfig
        tc.grad_scale_func = self.mopt.scale_loss
        tc.finalize_model_grads_func = finalize_model_grads
        if ddp_cfg.overlap_grad_reduce:  # as Megatron-LM's train() sets them
            tc.no_sync_func = [c.no_sync for c in self.ddp]
            tc.grad_sync_func = [c.start_grad_sync for c in self.ddp]
            if len(self.ddp) == 1:
                tc.no_sync_func, tc.grad_sync_func = tc.no_sync_func[0], tc.grad_sync_func[0]
        if ddp_cfg.overlap_param_gather:
            tc.param_sync_func = [c.start_param_sync for c in self.ddp]
            if len(self.ddp) == 1:
                tc.param_sync_func = tc.param_sync_func[0]
        self.ddp_cfg = ddp_cfg
        te = self.impl == "transformer_engine"
        spec = "Transformer Engine layer spec" if te else "local layer spec"
        self.backend = _Backend(
            f"engine: megatron-core (GPTModel, {spec}{fp8_line(self.cfg.fp8) if te else ''}; "
            f"DistributedDataParallel, overlap grad reduce {'on' if ddp_cfg.overlap_grad_reduce else 'off'}, param "
            f"gather {'on' if ddp_cfg.overlap_param_gather else 'off'}; distributed optimizer; "
            f"{'interleaved 1F1B' if self.dims.vpp > 1 else '1F1B' if self.dims.pp > 1 else 'no pipelining'})",
            FP8State.of(self.cfg.fp8, self.chunks, [self.layout.layer_range(self.model_cfg.num_layers,
                                                                            self.groups.pp_rank, v)[0]
                                                    for v in range(len(self.chunks))],
                        self.groups.ep_rank * (self.model_cfg.num_moe_experts or 0) // self.dims.ep, self.tconfig,
                        every_rank=self.dims.ep > 1))
        self.attention_line = (
            f"attention: megatron-core's MLASelfAttention ({spec.removesuffix(' layer spec')} spec) with "
            + ("Transformer Engine's TEDotProductAttention" if self.te_attention else
               "shardkit's MLACoreAttention (megatron-core's local DotProductAttention takes no MLA head sizes)")
            if self.model_cfg.multi_latent_attention else
            f"attention: megatron-core's {'TEDotProductAttention' if te else 'DotProductAttention'} "
            f"({spec.removesuffix(' layer spec')} spec)")
        if self.cp_line:  # context parallelism's core attention (`_context_parallel`)
            kind = "MLASelfAttention" if self.model_cfg.multi_latent_attention else "SelfAttention"
            self.attention_line = f"attention: megatron-core's {kind} with {self.cp_line}"

    def _megatron_scheduler(self):
        """megatron-core's OptimizerParamScheduler on shardkit's schedule (train/config.py run_length), at the
        position shardkit's scheduler holds (its state checked against the command line on resume)."""
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        s = self.scheduler.cfg
        sched = OptimizerParamScheduler(
            self.mopt, init_lr=s.init_lr, max_lr=s.max_lr, min_lr=s.min_lr, lr_warmup_steps=s.lr_warmup_steps,
            lr_decay_steps=s.lr_decay_steps, lr_decay_style=s.lr_decay_style, start_wd=s.start_wd, end_wd=s.end_wd,
            wd_incr_steps=s.wd_incr_steps, wd_incr_style=s.wd_incr_style, use_checkpoint_opt_param_scheduler=True,
            override_opt_param_scheduler=False, wsd_decay_steps=s.wsd_decay_steps,
            lr_wsd_decay_style=s.lr_wsd_decay_style)
        if self.scheduler.num_steps:
            sched.load_state_dict(self.scheduler.state_dict())
        return sched

    @torch.no_grad()
    def _load_optimizer(self, step: int) -> None:
        """The checkpoint's fp32 params and moments into the distributed optimizer: each rank reads its parameters'
        local tensors through the sharding table and keeps its DP range of each."""
        ck = self.ck
        missing = [s for s in OPTIMIZER_STATES if s not in ck.optimizer_states]
        if missing:
            raise FormatError(f"{ck.path}: optimizer state {missing} missing; cannot resume the optimizer "
                              "(pass --no-load-optim to start it fresh)")
        part_of = {}
        for part in distributed_parts(self.mopt):
            part_of.update({id(p): part for p in part.model_param_group_index_map})
        by_t = {}
        for lp in self.table:
            if id(lp.param) in part_of:  # a tied copy's state too, from the first stage's regions (ckpt_io._coord)
                by_t.setdefault(lp.spec.name, []).append(lp)
        for cname, lps in by_t.items():
            coord = ckpt_io._coord(lps[0], self.groups)
            states = {s: ck.read_local(optimizer_key(s, cname), self.layout, coord) for s in OPTIMIZER_STATES}
            for lp in lps:
                vals = {s: lp.of(t[lp.vstage]) for s, t in states.items()}
                mopt = part_of[id(lp.param)]
                r = mopt._get_model_param_range_map(lp.param)["param"]
                gi, go = mopt.model_param_group_index_map[lp.param]
                main = mopt.optimizer.param_groups[gi]["params"][go]
                main.copy_(vals["fp32_param"].reshape(-1)[r.start:r.end].to(main))
                mopt.optimizer.state[main] = {
                    "step": torch.tensor(float(step)),
                    "exp_avg": vals["exp_avg"].reshape(-1)[r.start:r.end].to(main).clone(),
                    "exp_avg_sq": vals["exp_avg_sq"].reshape(-1)[r.start:r.end].to(main).clone()}
        # the model's (bf16) weights stay the checkpoint's weights, as the native engine's load leaves them
        for mopt in distributed_parts(self.mopt):
            for group in mopt.optimizer.param_groups:
                group["step"] = step
        self.opt.steps = step

    # -- one iteration -------------------------------------------------------------------------------------------
    def _forward_backward(self, mbs: list, forward_only: bool):
        from megatron.core.pipeline_parallel import get_forward_backward_func

        d = self.cfg.data
        b, s = d.micro_batch_size, d.seq_length
        causal = torch.triu(torch.ones(s, s, dtype=torch.bool, device=self.device), diagonal=1)[None, None]

        def loss_func(loss_mask, output_tensor):
            """The micro-batch's loss over its counted tokens (an all-masked micro-batch gives 0, as native)."""
            losses = output_tensor.float()
            loss = (losses * loss_mask).sum()
            n = loss_mask.sum().clamp_min(1.0).to(torch.int)
            return loss, n, {"lm loss": torch.stack([loss.detach(), n.to(loss.dtype)])}

        def forward_step(data_iterator, model):
            """Positions, loss mask and documents from the host's copy of the micro-batch (the native engine's
            ltor_masks_and_position_ids), then to the device; megatron-core's mask is True where masked out (the
            local spec's attention takes it as given: causal, and across documents with --reset-attention-mask)."""
            sample = next(data_iterator)
            positions, loss_mask, docs = ltor_masks_and_position_ids(sample[:, :-1], self.packing)
            sample = sample.to(self.device)
            mask = causal
            if docs is not None:
                docs = docs.to(self.device)
                mask = causal | (docs[:, :, None] != docs[:, None, :])[:, None]
            # MTP's depths read the loss mask (shifted by megatron-core's roll_tensor); the main loss takes it below
            extra = {"loss_mask": loss_mask.to(self.device)} if self.model_cfg.mtp_num_layers else {}
            out = model(sample[:, :-1], positions.to(self.device), mask, labels=sample[:, 1:], **extra)
            return out, functools.partial(loss_func, loss_mask.to(self.device))

        def cp_loss_func(weight, output_tensor):
            """This CP rank's share of the micro-batch's mean loss, times cp (the native engine's loss weights: loss
            mask x cp / the tokens counted in the whole micro-batch), over one token: summed over the CP ranks by the
            step's read, averaged over DP x CP by megatron-core's DDP, it is the micro-batch's mean loss."""
            loss = (output_tensor.float() * weight).sum()
            one = torch.ones((), dtype=torch.int, device=loss.device)
            return loss, one, {"lm loss": torch.stack([loss.detach(), one.to(loss.dtype)])}

        def cp_forward_step(data_iterator, model):
            """Under CP: this rank's zigzag share of the micro-batch (the native engine's prepare_micro_batch: tokens,
            labels, loss weights and the attention layout, which shardkit's core attention reads while the forward
            runs); megatron-core's RoPE takes this rank's chunks' positions itself (it slices the whole length's)."""
            tokens, labels, extras = prepare_micro_batch(next(data_iterator), self.dims.cp, self.groups.cp_rank,
                                                         self.packing, self.device)
            with self.cp_state.use(extras.layout) if self.cp_state is not None else contextlib.nullcontext():
                out = model(tokens, extras.position_ids, None, labels=labels)
            return out, functools.partial(cp_loss_func, extras.loss_weight)

        iters = [iter(mbs) for _ in self.ddp]
        step = cp_forward_step if self.dims.cp > 1 else forward_step
        return get_forward_backward_func()(forward_step_func=step, data_iterator=iters, model=self.ddp,
                                           num_microbatches=self.num_micro, seq_length=s, micro_batch_size=b,
                                           decoder_seq_length=None, forward_only=forward_only)

    def _loss_sum(self, reduced: list) -> torch.Tensor:
        """Each micro-batch's mean token loss, summed (the native engine's loss_sum): nonzero on the last stage."""
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for x in reduced:
            v = x["lm loss"]
            total += v[0].double() / v[1].double()
        return total

    def train_step(self, batches) -> dict:
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        mbs = [next(batches) for _ in range(self.num_micro)]
        for c in self.ddp:
            c.zero_grad_buffer()
        self.mopt.zero_grad()
        if self.moe_logs is not None:
            self.moe_logs.start_step(self.num_micro)
        reduced = self._forward_backward(mbs, forward_only=False)
        found_inf = self.mopt.prepare_grads()  # gradients into the main params' .grad (fp32)
        norm = float(self.mopt.get_grad_norm())  # megatron-core's: each element once over TP, PP and DP
        moe_stats = self.moe_logs.reduce_stats(self.dims.dp) if self.moe_logs is not None else None
        # the step's one read: the loss, the NaN stop (before the optimizer step, on every rank), the peak memory
        loss, norm, moe_host = self._read_step(self._loss_sum(reduced), bool(found_inf) or not math.isfinite(norm),
                                               norm=norm, extra=moe_stats)
        o = self.cfg.optimizer
        if o.clip_grad > 0:  # each part of a ChainedOptimizer (dense and expert) by the one total norm, as its step()
            for part in distributed_parts(self.mopt):
                params = part.get_parameters()
                if params and not getattr(part, "is_stub_optimizer", False):
                    clip_grad_by_total_norm_fp32(params, o.clip_grad, norm,
                                                 part.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)
        lr, wd = self.scheduler.lr, self.scheduler.wd
        if not self.mopt.step_with_ready_grads():
            raise RuntimeError("megatron-core's optimizer refused its step")
        self.opt.steps += 1
        self.msched.step(increment=self.cfg.data.global_batch_size)
        self.scheduler.step(self.cfg.data.global_batch_size)
        out = {"loss": loss, "lr": lr, "weight_decay": wd, "grad_norm": norm}
        if self.moe_logs is not None:  # the native engine's MoE rows
            out.update(self.moe_logs.finish_step(moe_host))
        return out

    def _params_synced(self) -> None:
        """With --overlap-param-gather the updated parameters arrive with the next forward: gather them now."""
        if self.ddp_cfg.overlap_param_gather:
            for c in self.ddp:
                c.start_param_sync(force_sync=True)

    @torch.no_grad()
    def evaluate(self) -> float | None:
        if self.valid_ds is None or not self.cfg.run.eval_iters:
            return None
        from train.data.sampler import micro_batches

        self._params_synced()
        d = self.cfg.data
        it = micro_batches(self.valid_ds, 0, d.micro_batch_size, self.groups.dp_rank, self.dims.dp)
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for c in self.ddp:
            c.eval()
        try:
            for _ in range(self.cfg.run.eval_iters):
                total += self._loss_sum(self._forward_backward([next(it) for _ in range(self.num_micro)], True))
        finally:
            for c in self.ddp:
                c.train()
        t = total.reshape(1)
        if self.dims.world > 1:
            dist.all_reduce(t)
        return float(t) / (self.cfg.run.eval_iters * self.num_micro * self.dims.dp * self.dims.tp * self.dims.cp)

    def _saved_table(self) -> list:
        return self.opt.table  # megatron-core's per-expert weights stacked by layer (SavedState.refresh)

    def save(self) -> None:
        if not self.cfg.checkpoint.save:
            return
        self._params_synced()
        self.wait_for_save()
        self.opt.refresh()  # the distributed optimizer's state as shardkit's tensors (every DP rank takes part)
        super().save()
