"""continue-pretrain: the training loop. Launched by torchrun (or SLURM through scripts/), or as one process.

    set up process groups -> load the checkpoint's model config -> build this rank's stage -> load its regions
    -> per iteration: 1F1B over the micro-batches, reduce gradients, clip, AdamW step, log
    -> save (weights + optimizer state + train_state.json) every --save-interval and at the end
"""
from __future__ import annotations

import datetime
import gc
import math
import os
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from checkpoint.storage import last_complete, shown
from checkpoint.manifest import iter_dirname
from checkpoint.config import ModelConfig
from checkpoint.errors import ConfigError, ShardkitError
from checkpoint.megatron import is_scheduler_state
from checkpoint.rendezvous import rendezvous_env
from checkpoint.layout import PipelineSplit
from checkpoint.run_layout import RunLayout
from checkpoint.sharding import Rule
from train import checkpointing as ckpt_io
from train import moe
from train.config import TrainConfig, check_for_model, default_changes, megatron_flags, run_length, validate
from train.data.errors import DataError
from train.data.order import DataConfig, build_datasets, check_vocab
from train.data.sampler import micro_batches
from train.dropout import seed_process_rngs
from train.failures import bound_every_group
from train.signals import ExitSignals
from train.metrics import (MetricsLogger, check_wandb, flops_per_step, format_line, memory_stats, peak_flops,
                           throughput)
from train.optim import DistributedOptimizer, ParamScheduler
from train.parallel.context import packing_from, prepare_micro_batch
from train.parallel.groups import Groups, build_groups, new_group
from train.parallel.interleaved import InterleavedPipeline
from train.parallelize import check_parallel, parallelize
from train.parallel.pipeline import StageStep, forward_backward, forward_only


def init_distributed(timeout_minutes: float) -> None:
    """torchrun / SLURM env (RANK, WORLD_SIZE, MASTER_ADDR/PORT) or a single process; gloo on CPU, NCCL on GPU."""
    import torch._dynamo  # noqa: F401 - imported after init_process_group it keeps the default group alive in C++
    # until the interpreter's shutdown, whose gloo worker threads then abort the process (see shutdown_distributed)

    timeout = datetime.timedelta(minutes=timeout_minutes)
    bound_every_group(timeout)  # the TP/PP/DP/... groups too, not only the default one
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    rendezvous_env(os.environ, "continue-pretrain")
    if "RANK" in os.environ:
        dist.init_process_group(backend, timeout=timeout)
    else:
        store = dist.FileStore(tempfile.mktemp(prefix="shardkit-store-"), 1)
        dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    import train.report

    # kept past destroy_process_group: an error is said by one rank of the job (train/report.py)
    train.report.STORE = dist.distributed_c10d._get_default_store() if "RANK" in os.environ else None


def shutdown_distributed() -> None:
    """destroy_process_group, then a collection: every process group (held by nothing now, the caller has dropped its
    trainer) is destroyed and its worker threads joined while the interpreter is alive. A gloo worker thread that
    drops a finished collective's tensors during interpreter shutdown aborts the process ("terminate called without
    an active exception", exit 134) after a run that succeeded (torch's ProcessGroupGloo)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


def not_all_finite(t: torch.Tensor) -> torch.Tensor:
    """A device flag: `t` holds a NaN or an infinity. Two reductions (NaN propagates through max and min), no
    tensor-sized temporary (`~isfinite(t).all()` allocated a byte per element of the gradient buffer)."""
    if not t.numel():
        return torch.zeros((), dtype=torch.bool, device=t.device)
    return ~(torch.isfinite(t.amax()) & torch.isfinite(t.amin()))


def run_layout(cfg: TrainConfig, world: int | None = None) -> RunLayout:
    """The run's layout from the world size (default: the process group's; `shardkit launch` passes the job's) and
    the parallel flags; the global batch must split over DP."""
    p, d = cfg.parallel, cfg.data
    world = dist.get_world_size() if world is None else world
    dims = RunLayout.from_world(world, p.tp, p.pp, cp=p.cp, vpp=p.vpp, ep=p.ep, etp=p.etp,
                                split=PipelineSplit.from_args(p))
    if d.global_batch_size % (d.micro_batch_size * dims.dp):
        raise ConfigError(f"--global-batch-size {d.global_batch_size} is not divisible by --micro-batch-size "
                          f"{d.micro_batch_size} x data-parallel size {dims.dp}")
    return dims


def open_load(c, global_batch_size: int):
    """--load opened for training, by either engine: (checkpoint, its iteration directory, train state, notes).
    A torch_dist one (Megatron-LM's or shardkit's) is read in place, by region; a shardkit native one is verified,
    and --hf-config is refused for it and --vocab-size checked against its manifest (checkpoint.opened)."""
    from checkpoint.opened import open_for_training

    ck = open_for_training(c.load, c.hf_config, c.vocab_size, load_optim=not c.no_load_optim,
                           check=not c.skip_verify)
    state, notes = ck.train_state(global_batch_size)
    return ck, ck.path, state, notes


def check_save_format(save: str, save_format: str) -> None:
    """One format per --save directory: a root holding the other format's checkpoints (its pointer file) is refused
    before training, not left with two formats whose pointers disagree about the newest iteration."""
    from checkpoint.commit import LATEST
    from checkpoint.megatron import TRACKER

    if not save:
        return
    pointer, other = (LATEST, "native") if save_format == "torch_dist" else (TRACKER, "torch_dist")
    if os.path.lexists(Path(save) / pointer):
        raise ConfigError(f"--save {save} holds {other} checkpoints ({pointer}); a --save-format {save_format} save "
                          f"there would mix two formats in one directory: pass --save-format {other} to go on in its "
                          "format, or another --save")


def check_model_flags(cfg: TrainConfig, m: ModelConfig, source: Path) -> None:
    r = cfg.run
    for flag, given, have in (("--num-layers", r.num_layers, m.num_layers), ("--hidden-size", r.hidden_size,
                              m.hidden_size), ("--num-attention-heads", r.num_attention_heads,
                                               m.num_attention_heads)):
        if given is not None and given != have:
            raise ConfigError(f"{flag} {given} disagrees with the checkpoint {source} ({have}); drop the flag or "
                              "load the right checkpoint")
    if cfg.data.seq_length > m.max_position_embeddings:
        raise ConfigError(f"--seq-length {cfg.data.seq_length} exceeds the model's max_position_embeddings "
                          f"({m.max_position_embeddings}) in {source}")
    moe.check_mtp_sequence(cfg.data.seq_length, m, cfg.moe.mtp_loss_scaling_factor)
    check_for_model(cfg, m)  # MoE / MTP flags on a model without them, TE + packed docs under CP


def check_layout_for_model(cfg: TrainConfig, dims: RunLayout, m: ModelConfig, source: Path) -> None:
    """Everything the trainer refuses about this run's flags and layout for the model of its --load before it builds
    anything, with no process group: the model flags, the layout against the model (heads, KV groups, ffn and experts
    over TP/EP, the pipeline split against the layers: train/parallelize.py check_parallel), a pipeline rank
    with nothing to run, sequence parallelism against the sequence. `shardkit launch` runs it before writing a job."""
    check_model_flags(cfg, m, source)
    check_parallel(m, dims, cfg.parallel)
    layout = dims.model_parallel
    idle = layout.idle_ranks(m.num_layers)
    if idle:  # Megatron's layout strings allow a stage with nothing in it; shardkit's trainer does not run one
        raise ConfigError(f"{' '.join(layout.split.flags())}: pipeline rank(s) {', '.join(map(str, idle))} "
                          "would hold no decoder layer, embedding or loss; the trainer needs work on every stage")
    if cfg.parallel.sequence_parallel and dims.tp > 1 and cfg.data.seq_length % dims.tp:
        raise ConfigError(f"--sequence-parallel: --seq-length {cfg.data.seq_length} is not divisible by --tp "
                          f"{dims.tp}")


def recompute_text(r) -> str:
    """--recompute-granularity (and megatron-core's method and layer count) for the start-up block."""
    if r.recompute_granularity == "selective":
        return "selective (--recompute-granularity selective: the core attention)"
    if r.recompute_granularity == "full":
        what = ("every decoder layer" if r.recompute_method is None else
                f"runs of {r.recompute_num_layers} layers" if r.recompute_method == "uniform" else
                f"the first {r.recompute_num_layers} layers of each pipeline chunk")
        return f"full (--recompute-granularity full: {what})"
    return "none (no --recompute-granularity)"


class Trainer:
    def __init__(self, cfg: TrainConfig) -> None:
        validate(cfg)
        if cfg.run.wandb_project:  # before anything is loaded: a missing wandb is one line on every rank at once
            check_wandb(cfg.run.wandb_project)
        self.cfg = cfg
        p, d = cfg.parallel, cfg.data
        dims = run_layout(cfg)
        self.dims = dims
        self.groups: Groups = build_groups(dims)
        seed_process_rngs(d.seed, self.groups.pp_rank)  # as Megatron-LM; a resume restores the saved states
        self.layout = dims.model_parallel
        self.notes: list[str] = []  # logged by rank 0 at the start of run()
        self.notes += [line for line in (default_changes(cfg), *megatron_flags(cfg)) if line]  # issue 41
        c = cfg.checkpoint
        self.ck, self.src, self.state, notes = open_load(c, d.global_batch_size)
        self.notes += notes
        self.model_cfg = self.ck.config
        check_layout_for_model(cfg, dims, self.model_cfg, self.src)  # the checks `shardkit launch` runs too
        check_save_format(c.save, c.save_format)
        self.dtype = torch.bfloat16 if cfg.run.bf16 else torch.float32
        self.sp = p.sequence_parallel and dims.tp > 1
        self.device = (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
                       else torch.device("cpu"))
        self.packing = packing_from(d, self.model_cfg, self.ck.hf_dir())
        # PP split, EP, TP, CP, recompute, TE/FP8, MoE training: in one place and order (train/parallelize.py)
        par = parallelize(self.model_cfg, self.groups, self.device, self.dtype, p, cfg.run, cfg.fp8, cfg.moe,
                          self.packing, seed=d.seed)
        if par.dropout is not None:  # the dropout streams restart at each iteration (train/dropout.py)
            par.dropout.iteration_of = lambda: self.iteration
        self.model, self.backend, self.moe = par.model, par.backend, par.moe
        self.attention, self.attention_line = par.attention, par.attention_line
        self.table = ckpt_io.param_table(self.model, self.model_cfg, self.layout, self.groups)
        ckpt_io.load_model(self.ck, self.table, self.layout, self.groups)
        trainable = [(lp.name, lp.param) for lp in self.table if lp.param.requires_grad]
        replicated = {lp.name for lp in self.table if lp.spec.rule is Rule.REPLICATED}
        tied = {lp.name for lp in self.table if lp.tied_copy}
        # the MTP layers (last stage) read a copy of the embedding: tied to the first stage's like shared embeddings
        self.opt = DistributedOptimizer(trainable, self.groups, cfg.optimizer, replicated, tied,
                                        self.model_cfg.tie_word_embeddings or self.model_cfg.mtp_num_layers > 0,
                                        expert={lp.name for lp in self.table if lp.spec.expert}
                                        if dims.ep > 1 or dims.expert_tp != dims.tp else frozenset())
        self.iteration, self.consumed = 0, 0
        if self.state is not None:
            self.iteration = int(self.state["iteration"])
            self.consumed = int(self.state["consumed_samples"])
            if not cfg.checkpoint.no_load_optim:
                ckpt_io.load_optimizer(self.ck, self.table, self.opt, self.layout, self.groups,
                                       int(self.state.get("optimizer_steps", self.iteration)))
            if not cfg.checkpoint.no_load_rng and self.state.get("rng"):
                ckpt_io.set_rng_state(self.state["rng"])
            self.backend.load_state_dict(self.state.get("fp8"), self.src)  # FP8 scaling state (like Megatron's)
        self.num_micro = d.global_batch_size // (d.micro_batch_size * dims.dp)
        # Megatron's OptimizerParamScheduler (train/optim.py): in samples, built with step(0), advanced by the
        # global batch after each optimizer step; on resume checked against the checkpoint's (_load_scheduler)
        self._schedule()
        self._data()
        self.step = StageStep(self.model, self.groups, self.attention, self.moe)
        seq = d.seq_length // dims.cp  # a CP rank's tokens
        seq = seq // dims.tp if self.sp else seq
        self.act_shape = (d.micro_batch_size, seq, self.model_cfg.hidden_size)
        self.step = self.backend.wrap(self.step)  # TE: each micro-batch's forward under te.autocast
        self.interleaved = (InterleavedPipeline(self.step, self.groups, self.num_micro, self.device)
                            if dims.vpp > 1 else None)
        self.flops = flops_per_step(self.model_cfg, d.seq_length, d.global_batch_size * d.seq_length)
        self.pending_save: ckpt_io.AsyncSave | None = None
        self.save_group = None

    def _schedule(self) -> None:
        """The run's length and LR/WD scheduler, restored from the train state on resume (both engines)."""
        self.length = run_length(self.cfg)
        self.train_iters = self.length.train_iters
        self.scheduler = ParamScheduler(self.length.scheduler)
        if self.state is not None and not self.cfg.checkpoint.no_load_optim:
            self.notes += self._load_scheduler()
        elif self.state is not None:  # Megatron-LM's load_checkpoint: the scheduler comes with the optimizer
            self.notes.append(f"note: --no-load-optim: the LR/WD schedule restarts from its first step (as "
                              f"Megatron-LM's, which loads the scheduler with the optimizer); iteration "
                              f"{self.iteration} and the data position are kept")

    def _load_scheduler(self) -> list[str]:
        """Megatron-LM's resume: the scheduler state saved in train_state.json, checked against the command line's
        (default: refuse a difference; --override-opt_param-scheduler / --use-checkpoint-opt_param-scheduler). A
        checkpoint of an older shardkit has none: the command line's schedule, at the consumed samples."""
        s = self.cfg.schedule
        where = self.ck.train_state_source
        sd = self.state.get("scheduler")
        if not is_scheduler_state(sd):
            self.scheduler.step(self.consumed)
            return [f"note: {where} holds no LR/WD scheduler state (an older shardkit saved it): the command line's "
                    f"schedule is used from {self.consumed} consumed samples"]
        return self.scheduler.load_state_dict(sd, override=s.override_opt_param_scheduler,
                                              use_checkpoint=s.use_checkpoint_opt_param_scheduler, source=where,
                                              num_steps=self.consumed if s.override_opt_param_scheduler else None)

    def _data(self) -> None:
        """The train dataset built for this run's size (Megatron's GPTDataset/BlendedDataset for --train-iters x
        global batch or --train-samples): a run resumed with more iterations rebuilds it for the new size and goes
        on from the consumed samples, as Megatron-LM does. The data itself (files, blend, split, seed, seq length)
        must be the checkpoint's unless --override-data-state."""
        d = self.cfg.data
        dc = DataConfig(paths=d.data_path, seq_length=d.seq_length, seed=d.seed, split=d.split)
        # token ids against the checkpoint's true vocabulary (not its TP padding), before step 1: rank 0 reads the
        # id range (a pass over each .bin the first time, then its sidecar) and every rank raises what it found
        problem = [None]
        if self.groups.rank == 0:
            try:
                check_vocab(d.data_path, self.model_cfg.vocab_size, f"checkpoint {self.src}")
            except Exception as e:  # noqa: BLE001 -- whatever it is, every rank must leave the broadcast below
                problem = [str(e) if isinstance(e, DataError) else
                           f"{', '.join(d.data_path)}: reading the token ids failed ({type(e).__name__}: {e})"]
        if self.dims.world > 1:
            dist.broadcast_object_list(problem, src=0)
        if problem[0]:
            raise DataError(problem[0])
        evals = (self.train_iters // self.cfg.run.eval_interval + 1) * self.cfg.run.eval_iters \
            if self.cfg.run.eval_interval and self.cfg.run.eval_iters else 0
        self.train_ds, self.valid_ds = build_datasets(dc, self.length.train_samples, evals * d.global_batch_size)
        self.fingerprint = self.train_ds.fingerprint
        if self.state is not None and not d.override_data_state:
            old, new = self.state.get("data_identity"), self.train_ds.identity
            what = "data files, blend, split, seed or seq length changed"
            if old is None:  # saved before the size-free identity: the whole fingerprint, size included
                old, new, what = self.state.get("data_fingerprint"), self.fingerprint, what + " (or, since this " \
                    "checkpoint predates size-free data fingerprints, --train-iters/--train-samples)"
            if old is not None and old != new:
                raise ConfigError(f"the dataset differs from the one {self.src} was trained on (fingerprint "
                                  f"{old[:12]} vs {new[:12]}: {what}); pass --override-data-state to continue anyway")

    def _prepare(self, sample: torch.Tensor):
        """[mbs, seq+1] tokens -> (ids, labels, extras) for this CP rank (all CP ranks read the same samples)."""
        return prepare_micro_batch(sample, self.dims.cp, self.groups.cp_rank, self.packing, self.device)

    # -- one iteration ----------------------------------------------------------------------------------------------
    def train_step(self, batches) -> dict:
        mbs = [self._prepare(next(batches)) for _ in range(self.num_micro)]
        self.opt.zero_grad()
        if self.moe is not None:
            self.moe.start_step(self.num_micro)
        if self.interleaved is not None:
            loss_sum = self.interleaved.forward_backward(mbs, self.act_shape, self.dtype)
        else:
            loss_sum = forward_backward(self.step, mbs, self.act_shape, self.dtype)
        self.backend.after_backward()
        # as Megatron's DDP: this rank's own gradients, before the reduction spreads a NaN to its replicas (a flag on
        # the device, read with the step's other values)
        grads_bad = not_all_finite(self.opt.buffer) if self.cfg.run.check_for_nan_in_loss_and_grad else None
        self.opt.reduce_grads()
        norm_sq = self.opt.grad_norm_sq()
        moe_stats = self.moe.reduce_stats(self.dims.dp) if self.moe is not None else None
        # before the step: a non-finite state is never applied
        loss, norm, moe_host = self._read_step(loss_sum, grads_bad, norm_sq=norm_sq, extra=moe_stats)
        self.opt.clip_to(norm)
        # the values this step applies (Megatron-LM's log line prints them after the scheduler advanced)
        lr, wd = self.scheduler.lr, self.scheduler.wd
        self.opt.step(lr, wd)
        self.scheduler.step(self.cfg.data.global_batch_size)
        out = {"loss": loss, "lr": lr, "weight_decay": wd, "grad_norm": norm}
        if self.moe is not None:  # expert-bias update (all DP ranks' counts) and the MoE logs
            out.update(self.moe.finish_step(self.dims.dp, moe_host))
        return out

    def _loss_checked(self, loss_sum: torch.Tensor, norm: float, grads_bad: bool | None = None) -> float:
        """`_read_step`'s loss for a gradient norm already on the host."""
        return self._read_step(loss_sum, grads_bad, norm=norm)[0]

    def _read_step(self, loss_sum: torch.Tensor, grads_bad: torch.Tensor | bool | None = None, *,
                   norm: float | None = None, norm_sq: torch.Tensor | None = None,
                   extra: torch.Tensor | None = None) -> tuple[float, float, list[float] | None]:
        """(mean micro-batch loss over the global batch (summed on the last stages, averaged over DP), gradient norm,
        `extra` on the host). With --check-for-nan-in-loss-and-grad (the default, as Megatron) a loss or gradient
        that is not finite on any rank stops the run here, before the optimizer step, on every rank at once (one
        all-reduce carries the loss and a flag per rank: bit 1 = its loss, bit 2 = its gradients; `grads_bad`: those
        gradients checked before the reduction, else checked now, when the global norm is not finite).

        The step's one device-to-host read (issue 32; tests/test_host_syncs.py): the loss, the flags, the squared
        gradient norm (`norm_sq`, all-reduced, on the device; or `norm` given on the host), this rank's peak memory
        (max over ranks, for the log line: `peak_mem_gib`) and `extra` (the MoE statistics) come to the host
        together, in one float64 tensor."""
        world, check = self.dims.world, self.cfg.run.check_for_nan_in_loss_and_grad
        t = torch.zeros(1 + (world if check else 0), dtype=torch.float64, device=loss_sum.device)
        t[0] = loss_sum.detach().double().reshape(())
        if check:
            if grads_bad is None:  # say which ranks hold the non-finite gradients when the global norm is not finite
                not_finite = not_all_finite(self.opt.buffer)
                grads_bad = (not_finite & ~torch.isfinite(norm_sq) if norm is None
                             else not math.isfinite(norm) and not_finite)
            # bit 1: this rank's loss is not finite, bit 2: its gradients are not
            t[1 + self.groups.rank] = ((~torch.isfinite(loss_sum).all()).double()
                                       + 2 * (grads_bad.double() if isinstance(grads_bad, torch.Tensor)
                                              else float(bool(grads_bad))))
        # filled on the device (torch.tensor(list, device=...) is a host-to-device copy, which waits for the stream)
        mem = torch.full((1,), memory_stats(t.device)["mem_gib"], dtype=torch.float64, device=t.device)
        if world > 1:
            dist.all_reduce(t)  # only last-stage ranks contribute; each DP x TP replica once, CP ranks x cp each
            dist.all_reduce(mem, op=dist.ReduceOp.MAX)
        n = t.numel()
        parts = [t, *([] if norm is not None else [norm_sq.reshape(1).to(t)]), mem,
                 *([] if extra is None else [extra.to(t)])]
        host = torch.cat(parts).tolist()
        if norm is None:
            norm, host = math.sqrt(host[n]), host[:n] + host[n + 1:]
        self.peak_mem_gib = host[n]
        loss = host[0] / (self.num_micro * self.dims.dp * self.dims.tp * self.dims.cp)
        flags = [int(f) for f in host[1:n]]
        if check and (any(flags) or not math.isfinite(norm) or not math.isfinite(loss)):
            self._stop_non_finite(loss, norm, flags)
        return loss, norm, (None if extra is None else host[n + 1:])

    def _stop_non_finite(self, loss: float, norm: float, flags: list[int]) -> None:
        it = self.iteration + 1
        what = []
        loss_ranks = [r for r, f in enumerate(flags) if f & 1]
        grad_ranks = [r for r, f in enumerate(flags) if f & 2]
        if loss_ranks or not math.isfinite(loss):
            what.append(f"loss {loss}" + (f" on {_ranks(loss_ranks)}" if loss_ranks else ""))
        if grad_ranks or not math.isfinite(norm):
            what.append(f"grad norm {norm}" + (f" (non-finite gradients on {_ranks(grad_ranks)})" if grad_ranks
                                               else ""))
        self.wait_for_save()  # a checkpoint still committing in the background is of a finite state: keep it
        raise NonFiniteError(f"iteration {it}: {' and '.join(what)}; stopped before its optimizer step, nothing "
                             f"saved: lower --lr (or clip with --clip-grad) and "
                             f"{self._resume_hint()} (--no-check-for-nan-in-loss-and-grad trains on regardless)")

    def _resume_hint(self) -> str:
        save = self.cfg.checkpoint.save
        if save:
            try:
                return f"resume from the last checkpoint {last_complete(save)}"
            except ShardkitError:
                pass
        return f"restart from {self.src}" + (f" (no checkpoint in {save} yet)" if save else "")

    @torch.no_grad()
    def evaluate(self) -> float | None:
        if self.valid_ds is None or not self.cfg.run.eval_iters:
            return None
        d = self.cfg.data
        it = micro_batches(self.valid_ds, 0, d.micro_batch_size, self.groups.dp_rank, self.dims.dp)
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for _ in range(self.cfg.run.eval_iters):
            mbs = [self._prepare(next(it)) for _ in range(self.num_micro)]
            total += (self.interleaved.forward_only(mbs, self.act_shape, self.dtype) if self.interleaved is not None
                      else forward_only(self.step, mbs, self.act_shape, self.dtype))
        t = total.reshape(1)
        if self.dims.world > 1:
            dist.all_reduce(t)
        return float(t) / (self.cfg.run.eval_iters * self.num_micro * self.dims.dp * self.dims.tp * self.dims.cp)

    # -- checkpoints --------------------------------------------------------------------------------------------
    def _check_weights_finite(self) -> None:
        """Refuse to save weights or optimizer state that hold NaN/inf (whatever --check-for-nan-in-loss-and-grad
        says; an inf exp_avg_sq leaves the weight finite): every rank counts its own, one all-reduce, and the first
        bad tensor of each rank is named."""
        bad = [(lp.name, int((~torch.isfinite(lp.param.detach())).sum())) for lp in self.table
               if lp.param.is_floating_point()]
        bad += [(f"{state} of {self.opt.names[i]}", int((~torch.isfinite(v)).sum()))
                for i in self.opt.owned() for state, v in self.opt.state_of(i).items()]
        bad = [(n, c) for n, c in bad if c]
        t = torch.tensor([sum(c for _, c in bad)], dtype=torch.float64, device=self.device)
        if self.dims.world > 1:
            dist.all_reduce(t)
        if not float(t):
            return
        first = [bad[0] if bad else None]
        if self.dims.world > 1:
            first = [None] * self.dims.world
            dist.all_gather_object(first, bad[0] if bad else None)
        rank, (name, count) = next((r, x) for r, x in enumerate(first) if x is not None)
        raise NonFiniteError(f"iteration {self.iteration}: {int(float(t))} non-finite values ({name}: {count} "
                             f"on rank {rank}); checkpoint not saved: lower --lr (or clip with --clip-grad), keep "
                             f"--check-for-nan-in-loss-and-grad on and {self._resume_hint()}")

    def save(self) -> None:
        if not self.cfg.checkpoint.save:
            return
        self.wait_for_save()  # a background save of a finite state in flight is committed, whatever happens next
        self._check_weights_finite()  # before anything is written: `latest` stays on the last finite checkpoint
        state = {"iteration": self.iteration, "consumed_samples": self.consumed, "data_fingerprint": self.fingerprint,
                 "data_identity": self.train_ds.identity,
                 "rng": ckpt_io.rng_state(), "scheduler": self.scheduler.state_dict(),
                 # with megatron-core's param groups (lr, step, ...) for an export to torch_dist to carry (common.pt)
                 "optimizer": dict(asdict(self.cfg.optimizer), param_groups=self._megatron_param_groups()),
                 "args": {k: (list(v) if isinstance(v, tuple) else v) for k, v in _flat(self.cfg).items()},
                 "layout": {"tp": self.dims.tp, "pp": self.dims.pp, "dp": self.dims.dp, "cp": self.dims.cp,
                            "ep": self.dims.ep}}
        state["fp8"] = self.backend.state_dict(self.groups)  # delayed scaling's amax histories and scales
        self.wait_for_save()
        if self.cfg.checkpoint.async_save and self.save_group is None and self.dims.world > 1:
            self.save_group = new_group(backend="gloo")  # the background thread's own collectives
        t0 = time.perf_counter()
        c = self.cfg.checkpoint
        provenance = {"tool": "shardkit continue-pretrain", "source": str(self.src)}
        async_group = (self.save_group or dist.group.WORLD) if c.async_save else None
        if c.save_format == "torch_dist":  # Megatron-LM's --ckpt-format torch_dist, every rank its own items
            from train import torch_dist_ckpt

            groups = self._megatron_param_groups()
            out = torch_dist_ckpt.save(Path(c.save), self.iteration, self.model_cfg, self.layout, self._saved_table(),
                                       self.opt, self.groups, state, self.ck.hf_dir(), provenance, c.key_naming,
                                       groups, self._megatron_training_args(), async_group=async_group,
                                       integrity=c.verify_integrity)
        else:
            out = ckpt_io.save(Path(c.save), self.iteration, self.model_cfg, self.layout, self._saved_table(),
                               self.opt, self.groups, state, self.ck.hf_dir(), provenance, async_group=async_group)
        if isinstance(out, ckpt_io.AsyncSave):
            self.pending_save = _TimedSave(out, self.iteration, t0)
        else:
            self._log_saved(self.iteration, time.perf_counter() - t0)

    def _saved_table(self) -> list:
        """The parameters a save writes (the megatron-core engine stacks its per-expert weights by layer)."""
        return self.table

    def _megatron_param_groups(self) -> list[dict]:
        from train import torch_dist_ckpt

        o = self.cfg.optimizer
        return torch_dist_ckpt.megatron_param_groups(self.opt, self.scheduler.lr, self.scheduler.wd, o.lr, o.min_lr,
                                                     self.model_cfg.is_moe)

    def _megatron_training_args(self) -> dict:
        """The run's flags that Megatron-LM's args namespace names alike (data, schedule, optimizer; the flags keep
        Megatron-LM's names), and the run's sizes, for a torch_dist save's common.pt."""
        from checkpoint.megatron import megatron_lm_defaults

        known = megatron_lm_defaults()
        out = {k: (list(v) if isinstance(v, tuple) else v) for sec in ("data", "schedule", "optimizer")
               for k, v in asdict(getattr(self.cfg, sec)).items() if k in known and v is not None
               and k != "exit_signal"}
        d = self.dims
        out.update(train_iters=self.train_iters, world_size=d.world, data_parallel_size=d.dp,
                   context_parallel_size=d.cp, sequence_parallel=self.sp, use_distributed_optimizer=True,
                   bf16=self.cfg.run.bf16, seed=self.cfg.data.seed)
        return out

    def wait_for_save(self) -> None:
        """Join an async save still in flight (its error, if any, surfaces here)."""
        if self.pending_save is not None:
            pending, self.pending_save = self.pending_save, None
            pending.wait()
            self._poll_save(pending)

    def _poll_save(self, pending: "_TimedSave | None" = None) -> None:
        """--async-save: say `saved checkpoint ...` once the background commit has finished (checked after each
        iteration, without waiting; its error, if any, still surfaces in wait_for_save on every rank)."""
        p = pending or self.pending_save
        if p is not None and not p.logged and p.finished is not None and p.error is None:
            p.logged = True
            self._log_saved(p.iteration, p.finished - p.started, " (async)")

    def _log_saved(self, iteration: int, seconds: float, how: str = "") -> None:
        if self.groups.rank == 0:
            getattr(self, "log", print)(f"saved checkpoint iteration {iteration} in {seconds:.2f} s{how}: "
                     f"{shown(self.cfg.checkpoint.save, iter_dirname(iteration))}")

    # -- what the run says about itself (rank 0) --------------------------------------------------------------------
    def _device_line(self) -> str:
        if self.device.type != "cuda":
            return "CPU"
        return f"{torch.cuda.get_device_name(self.device)} per rank"

    def startup_block(self) -> list[str]:
        """One block at the start: model, layout, precision, attention, data, tokens per step, load and save."""
        m, dims, c, d = self.model_cfg, self.dims, self.cfg, self.cfg.data
        sizes = self.flops
        heads = f"{m.num_attention_heads} heads / {m.num_query_groups} query groups"
        if m.multi_latent_attention:
            heads = f"{m.num_attention_heads} heads (multi-latent attention, kv rank {m.kv_lora_rank})"
        model = (f"model: {m.model_type}, {sizes['params_total']:,} parameters, {m.num_layers} layers, hidden "
                 f"{m.hidden_size}, ffn {m.ffn_hidden_size}, {heads}, vocab {m.vocab_size} (padded "
                 f"{m.padded_vocab_size(dims.tp)} for TP {dims.tp})")
        if m.is_moe:
            model += (f", {m.num_moe_experts} experts top-{m.moe_router_topk} "
                      f"({sum(1 for i in range(m.num_layers) if m.is_moe_layer(i))} MoE layers)")
        if m.mtp_num_layers:
            model += f", {m.mtp_num_layers} MTP layer{'s' if m.mtp_num_layers > 1 else ''}"
        etp = f"ETP {dims.expert_tp}, " if dims.expert_tp != dims.tp else ""
        split = f", split {' '.join(dims.split.flags())}" if dims.split is not None else ""
        layout = (f"layout: TP {dims.tp}, PP {dims.pp}, VPP {dims.vpp}, DP {dims.dp}, CP {dims.cp}, EP {dims.ep}, "
                  f"{etp}SP {'on' if self.sp else 'off'}{split} ({dims.world} rank{'s' if dims.world > 1 else ''}, "
                  f"{self._device_line()}); recompute: {recompute_text(c.run)}")
        prec = "bf16 (fp32 main weights, grads and optimizer state)" if c.run.bf16 else "fp32"
        fp8 = (f"FP8 {c.fp8.fp8_format}, {c.fp8.fp8_recipe} recipe" if c.fp8.enabled else "FP8 off")
        if c.fp8.enabled and self.device.type != "cuda":  # issue 37: say that this is not FP8's speed
            fp8 += " (emulated on the CPU: the FP8 values multiplied in fp32, FP8's numerics, not its speed)"
        precision_line = f"precision: {prec}; {fp8}; {self.backend.describe()}"
        lines = [model, layout, precision_line, self.attention_line, *self._data_lines()]
        tokens = d.global_batch_size * d.seq_length
        lines.append(f"tokens per step: {tokens:,} (global batch {d.global_batch_size} x seq length {d.seq_length}; "
                     f"micro batch {d.micro_batch_size}, {self.num_micro} micro-batches per DP rank)")
        lines.append(f"load: {self.src}")
        if c.checkpoint.save:
            n = c.checkpoint.save_interval
            every = (("every iteration" if n == 1 else f"every {n} iterations") + " and at the end" if n
                     else "at the end")
            lines.append(f"save: {c.checkpoint.save} ({every}{', async' if c.checkpoint.async_save else ''})")
        else:
            lines.append("save: nothing (no --save)")
        return lines

    def _data_lines(self) -> list[str]:
        ds = self.train_ds
        parts = ds.datasets if hasattr(ds, "datasets") else [ds]
        weights = ds.weights if hasattr(ds, "datasets") else [1.0]
        out = [f"data: {len(parts)} prefix{'es' if len(parts) > 1 else ''}, {len(ds):,} train samples of "
               f"{self.cfg.data.seq_length} tokens (seed {self.cfg.data.seed}, split {self.cfg.data.split})"
               + (f", {len(self.valid_ds):,} valid samples" if self.valid_ds is not None else "")]
        for w, g in zip(weights, parts):
            out.append(f"  {g.indexed.prefix}: weight {w:.4g}, {len(g):,} samples, {g.num_epochs} epoch"
                       f"{'s' if g.num_epochs > 1 else ''} of {len(g.indices):,} documents")
        return out

    def loaded_line(self) -> str:
        if self.state is None:
            return (f"loaded checkpoint {self.src} at iteration 0 (consumed samples 0, optimizer state: no; "
                    "weights only)")
        optim = "no (--no-load-optim)" if self.cfg.checkpoint.no_load_optim else "yes"
        return (f"loaded checkpoint {self.src} at iteration {self.iteration} (consumed samples {self.consumed}, "
                f"optimizer state: {optim})")

    def final_line(self) -> str:
        save = self.cfg.checkpoint.save
        if not save:
            return f"done at iteration {self.iteration}: nothing saved (no --save)"
        try:
            if self.cfg.checkpoint.save_format == "torch_dist":
                from checkpoint.torch_dist import resolve_torch_dist

                last = resolve_torch_dist(save)
            else:
                last = last_complete(save)
        except ShardkitError:
            return f"done at iteration {self.iteration}: no complete checkpoint in {shown(save)}"
        return f"done at iteration {self.iteration}: last complete checkpoint {last}"

    def _wandb_config(self) -> dict | None:
        """Megatron-LM's W&B flags: files under --wandb-save-dir (default <save>/wandb), the run's flags as config."""
        r, save = self.cfg.run, self.cfg.checkpoint.save
        if not r.wandb_project:
            return None
        return {"project": r.wandb_project, "name": r.wandb_exp_name,
                "dir": r.wandb_save_dir or str(Path(save or ".") / "wandb"),
                "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in _flat(self.cfg).items()}}

    def _throughput(self, m: dict) -> None:
        """tokens/s, model TFLOP/s and MFU (Megatron's and torchtitan's conventions) for the step just timed, and the
        peak memory over all ranks (taken with the step's one host read, before its optimizer step: the optimizer
        state's first allocation shows from the next iteration on)."""
        peak = (self.cfg.run.peak_tflops * 1e12 if self.cfg.run.peak_tflops
                else peak_flops(self.device, "bf16"))
        m.update(throughput(self.flops, m["step_seconds"], self.dims.world, peak))
        m["mem_gib"] = self.peak_mem_gib

    # -- the loop -------------------------------------------------------------------------------------------------
    def run(self, log=print) -> list[dict]:
        c, d = self.cfg, self.cfg.data
        history = []
        batches = micro_batches(self.train_ds, self.consumed, d.micro_batch_size, self.groups.dp_rank, self.dims.dp)
        log_dir = c.run.log_dir or c.checkpoint.save
        wandb = self._wandb_config()
        logger = MetricsLogger(log_dir or None, self.groups.rank, wandb=wandb) if log_dir or wandb else None
        self.log = log
        if self.groups.rank == 0:
            for note in self.notes:  # resume: which LR/WD schedule is used
                log(note)
            for line in self.startup_block():  # the backend and attention lines are part of it
                log(line)
            log(self.loaded_line())
        if self.groups.rank == 0 and self.moe is not None:
            log(moe.describe(self.moe))
        sigs = ExitSignals(c.schedule.exit_signal).install() if c.schedule.exit_signal_handler else None
        try:
            while self.iteration < self.train_iters:
                t0 = time.perf_counter()
                m = self.train_step(batches)
                self.iteration += 1
                self.consumed += d.global_batch_size
                m.update(consumed_samples=self.consumed, step_seconds=time.perf_counter() - t0)
                logging = c.run.log_interval and self.iteration % c.run.log_interval == 0
                if logging:
                    self._throughput(m)
                if c.run.eval_interval and self.iteration % c.run.eval_interval == 0:
                    m["valid_loss"] = self.evaluate()
                history.append(dict(m, iteration=self.iteration))
                self._poll_save()
                if logging and self.groups.rank == 0:
                    if logger is not None:
                        logger.log(self.iteration, m, self.train_iters, echo=False)
                    log(format_line(self.iteration, m, self.train_iters))
                last = self.iteration == self.train_iters
                exiting = c.schedule.exit_interval and self.iteration % c.schedule.exit_interval == 0
                stop = sigs.received(self.dims.world, self.device) if sigs is not None else None
                if last or exiting or stop or (c.checkpoint.save_interval
                                               and self.iteration % c.checkpoint.save_interval == 0):
                    self.save()
                if stop and self.groups.rank == 0:
                    log(f"{stop} received (--exit-signal-handler): stopping after iteration {self.iteration}"
                        f"{', saved' if c.checkpoint.save else ', nothing saved (no --save)'}")
                if exiting or stop:
                    break
            self.wait_for_save()
            if self.groups.rank == 0:
                log(self.final_line())
        finally:
            if sigs is not None:
                sigs.release()
            if logger is not None:
                logger.close()
        return history


class _TimedSave:
    """An AsyncSave watched from a thread of our own, so the log can say when its background commit finished."""

    def __init__(self, save: "ckpt_io.AsyncSave", iteration: int, started: float) -> None:
        import threading

        self.iteration, self.started, self.logged = iteration, started, False
        self.finished: float | None = None
        self.error: BaseException | None = None

        def watch() -> None:
            try:
                save.wait()
            except BaseException as e:  # re-raised by wait(), on the training thread
                self.error = e
            self.finished = time.perf_counter()

        self._thread = threading.Thread(target=watch, name="shardkit-async-save-watch", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        self._thread.join()
        if self.error is not None:
            raise self.error


class NonFiniteError(ShardkitError):
    """A loss, grad norm or weight is NaN/inf: the run stops without applying or saving it."""


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _flat(cfg: TrainConfig) -> dict:
    out = {}
    for sec, v in asdict(cfg).items():
        for k, x in v.items():
            out[f"{sec}.{k}"] = x
    return out
