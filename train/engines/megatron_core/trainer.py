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
`import_megatron` puts torch's allowlist back as it was, so shardkit's `weights_only=True` reads keep their checks."""
from __future__ import annotations

import contextlib
import functools
import math
import re

import torch
import torch.distributed as dist

from checkpoint.errors import ConfigError, FormatError
from checkpoint.megatron import canonical_candidates
from checkpoint.sharding import OPTIMIZER_STATES, local_shape, optimizer_key, owner
from checkpoint.families import model_specs
from train import checkpointing as ckpt_io
from train.loop import Trainer, check_layout_for_model, check_save_format, open_load, run_layout
from train.dropout import seed_process_rngs
from train.model import canonical_name
from train.parallel.context import attention_state, ltor_masks_and_position_ids, packing_from, prepare_micro_batch
from train.te import te_available

from .checks import NotCovered, check_context_parallel, check_flags, check_model, check_packing, layer_spec
from .config import fp8_fields, fp8_line, te_spec_fields, transformer_config
from .modules import ContextParallelAttention, RMSNorm, local_spec_layer
from .runtime import cpu_stand_ins, import_megatron, keep_pickle_allowlist
from .state import Backend, FP8State, SavedState, distributed_parts, expert_biases


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
        self.backend = Backend(
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


OVERLAP_DESTS = ("overlap_grad_reduce", "overlap_param_gather")
