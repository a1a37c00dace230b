"""continue-pretrain's configuration: one dataclass per concern, filled from Megatron-LM's flag names, a TOML file
with the same keys (flag names with underscores, e.g. `tensor_model_parallel_size = 2` or `lr = 3e-4`), and the
command line, which wins over the file."""
from __future__ import annotations

import argparse
import tomllib
from dataclasses import MISSING, dataclass, fields
from pathlib import Path

from checkpoint.errors import ConfigError

from .fp8 import FP8Config, validate_config as validate_fp8
from .optim import LR_DECAY_STYLES, WD_INCR_STYLES, WSD_DECAY_STYLES, OptimizerConfig, SchedulerConfig


@dataclass(frozen=True)
class ParallelConfig:
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    sequence_parallel: bool = False
    cp: int = 1  # context parallel (zigzag chunks, train/parallel/context.py)
    cp_comm_type: str = "p2p"  # p2p (ring attention) | all_gather (K/V)
    ep: int = 1  # expert parallel, inside data parallel x context parallel (train/parallel/expert.py)
    etp: int | None = None  # expert tensor parallel; None = tp (Megatron's default)
    # uneven pipeline stages (checkpoint.layout.PipelineSplit; Megatron's names)
    decoder_first_pipeline_num_layers: int | None = None
    decoder_last_pipeline_num_layers: int | None = None
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False
    pipeline_model_parallel_layout: str | None = None


@dataclass(frozen=True)
class MoEArgs:
    """MoE training (Megatron's names and defaults; train/moe.py). moe_aux_loss_coeff None: the checkpoint's value
    (HF router_aux_loss_coef / aux_loss_alpha)."""

    moe_router_load_balancing_type: str = "aux_loss"
    moe_aux_loss_coeff: float | None = None
    moe_router_bias_update_rate: float = 1e-3
    mtp_loss_scaling_factor: float = 0.1
    moe_router_dtype: str | None = None
    moe_token_dispatcher_type: str = "alltoall"




@dataclass(frozen=True)
class DataArgs:
    data_path: tuple[str, ...] = ()
    split: str = "969,30,1"
    seq_length: int = 1024
    micro_batch_size: int = 1
    global_batch_size: int = 8
    seed: int = 1234
    override_data_state: bool = False
    # packed documents (Megatron's get_ltor_masks_and_position_ids); EOD id from the checkpoint's eos_token_id
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False
    eod_token_id: int | None = None


@dataclass(frozen=True)
class ScheduleConfig:
    """Run length and the LR / weight-decay schedule, Megatron-LM's flags and defaults (train/optim.py has the
    schedule itself; `run_length` turns these into its steps, counted in samples)."""

    train_iters: int | None = None  # neither this nor train_samples: 100 iterations
    train_samples: int | None = None  # sample-based training: train_samples // global_batch iterations
    lr_warmup_iters: int = 0
    lr_warmup_samples: int = 0
    lr_warmup_fraction: float | None = None  # of the decay steps
    lr_warmup_init: float = 0.0
    lr_decay_iters: int | None = None  # default train_iters
    lr_decay_samples: int | None = None  # default train_samples
    lr_decay_style: str = "linear"  # constant | linear | cosine | inverse-square-root | WSD
    lr_wsd_decay_style: str = "exponential"  # exponential | linear | cosine | minus_sqrt
    lr_wsd_decay_iters: int | None = None
    lr_wsd_decay_samples: int | None = None
    start_weight_decay: float | None = None  # with --weight-decay-incr-style linear|cosine (constant: --weight-decay)
    end_weight_decay: float | None = None
    weight_decay_incr_style: str = "constant"  # constant | linear | cosine
    # on resume: take the command line's schedule / the checkpoint's (default: refuse a difference)
    override_opt_param_scheduler: bool = False
    use_checkpoint_opt_param_scheduler: bool = False
    exit_interval: int = 0  # stop (saving first) after an iteration divisible by this; the schedule is unchanged
    # Megatron's --exit-signal-handler / --exit-signal: on that signal (and SIGTERM) save, then exit cleanly
    exit_signal_handler: bool = False
    exit_signal: str = "SIGTERM"


@dataclass(frozen=True)
class CheckpointConfig:
    load: str = ""
    save: str = ""
    save_interval: int = 0  # 0: save at the end only
    no_load_optim: bool = False
    no_load_rng: bool = False
    async_save: bool = False
    skip_verify: bool = False  # skip Checkpoint.check of --load (chunks are still checksummed as read)
    save_format: str = "native"  # native | torch_dist (Megatron-LM's --ckpt-format torch_dist, optimizer included)
    key_naming: str = "te"  # torch_dist keys: te (Megatron-LM's default spec) | local (megatron-core's local spec)
    hf_config: str = ""  # a torch_dist --load without shardkit.json: the HF directory describing the model
    vocab_size: int | None = None  # ... or the true vocab size its Megatron-LM args lack


@dataclass(frozen=True)
class RunConfig:
    bf16: bool = False
    transformer_impl: str | None = None  # local | transformer_engine; None: TE where installed (and a GPU)
    recompute_granularity: str | None = None
    log_interval: int = 1
    eval_interval: int = 0
    eval_iters: int = 0
    peak_tflops: float | None = None
    log_dir: str = ""  # metrics.jsonl and TensorBoard; default: the --save directory
    tensorboard: bool = False  # set by --tensorboard-dir (TOML tensorboard_dir): TensorBoard events asked for
    distributed_timeout_minutes: float = 10.0
    # checks against the checkpoint's model config (Megatron passes the architecture as flags; ours come from it)
    num_layers: int | None = None
    hidden_size: int | None = None
    num_attention_heads: int | None = None
    num_experts: int | None = None  # routed experts per MoE layer (a dense checkpoint has none)
    # Megatron's --check-for-nan-in-loss-and-grad (on by default): a non-finite loss or grad norm stops the run
    check_for_nan_in_loss_and_grad: bool = True
    # Megatron-LM's Weights & Biases flags (train/metrics.py); no project: no W&B
    wandb_project: str = ""
    wandb_exp_name: str = ""
    wandb_save_dir: str = ""


@dataclass(frozen=True)
class TrainConfig:
    parallel: ParallelConfig
    data: DataArgs
    optimizer: OptimizerConfig
    schedule: ScheduleConfig
    checkpoint: CheckpointConfig
    run: RunConfig
    fp8: FP8Config = FP8Config()
    moe: MoEArgs = MoEArgs()


_SECTIONS = {"parallel": ParallelConfig, "data": DataArgs, "optimizer": OptimizerConfig, "schedule": ScheduleConfig,
             "checkpoint": CheckpointConfig, "run": RunConfig, "fp8": FP8Config,
             "moe": MoEArgs}
# Megatron flag dest -> (section, field) where the names differ
_RENAMES = {"expert_model_parallel_size": ("parallel", "ep"), "expert_tensor_parallel_size": ("parallel", "etp"),
            "tensor_model_parallel_size": ("parallel", "tp"),
            "context_parallel_size": ("parallel", "cp"), "pipeline_model_parallel_size": ("parallel", "pp"),
            "virtual_pipeline_model_parallel_size": ("parallel", "vpp"), "fp8": ("fp8", "fp8_format"),
            "tensorboard_dir": ("run", "log_dir")}  # --tensorboard-dir: also sets run.tensorboard (from_namespace)


def add_arguments(p: argparse.ArgumentParser) -> list[argparse.Action]:
    """Add continue-pretrain's flags to `p` and return them: Megatron-LM's flag names (short aliases where users know
    them). Defaults are None so that a TOML value is only overridden by flags actually given (`flag_default` has the
    real one)."""
    actions = []

    def a(*names, **kwargs):
        actions.append(p.add_argument(*names, **kwargs))

    a("--config", help="TOML file with the same keys as the flags (underscores); flags win")
    a("--load", help="checkpoint to start from: a converted model (weights only) or a training checkpoint")
    a("--save", help="directory for training checkpoints")
    a("--save-format", "--ckpt-format", dest="save_format", choices=["native", "torch_dist"],
      help="native (default) or torch_dist: Megatron-LM's --ckpt-format torch_dist with the distributed optimizer's "
           "state, which Megatron-LM resumes (shardkit reads it back too)")
    a("--key-naming", choices=["te", "local"],
      help="torch_dist keys of --save-format torch_dist: te (Transformer Engine spec, Megatron-LM's default) or local")
    a("--hf-config", metavar="HF_DIR", help="a torch_dist --load Megatron-LM wrote (no shardkit.json): the HF "
                                           "directory whose config.json describes the model")
    a("--vocab-size", type=int, metavar="N", help="a torch_dist --load Megatron-LM wrote: the true vocabulary size "
                                                  "(its args hold only the padded one)")
    a("--data-path", "--data", dest="data_path", nargs="+", help="dataset prefixes, optionally weighted: 0.3 A 0.7 B")
    a("--split", help="train,valid,test proportions (default 969,30,1)")
    a("--tensor-model-parallel-size", "--tp", dest="tensor_model_parallel_size", type=int)
    a("--pipeline-model-parallel-size", "--pp", dest="pipeline_model_parallel_size", type=int)
    a("--virtual-pipeline-model-parallel-size", "--vpp", dest="virtual_pipeline_model_parallel_size", type=int)
    a("--decoder-first-pipeline-num-layers", type=int, help="uneven pipeline: decoder layers on the first stage "
                                                             "(the middle stages share the rest evenly)")
    a("--decoder-last-pipeline-num-layers", type=int, help="uneven pipeline: decoder layers on the last stage")
    a("--account-for-embedding-in-pipeline-split", action="store_true", default=None,
      help="count the embedding as one layer when splitting the pipeline")
    a("--account-for-loss-in-pipeline-split", action="store_true", default=None,
      help="count the loss as one layer when splitting the pipeline")
    a("--pipeline-model-parallel-layout", help='layers per stage in chunk order, e.g. "Ettt|tttt|tttL" '
                                               "(megatron-core's PipelineParallelLayerLayout)")
    a("--sequence-parallel", action="store_true", default=None)
    a("--context-parallel-size", "--cp", dest="context_parallel_size", type=int,
      help="split each sequence over N ranks (zigzag: 2N chunks, --seq-length divisible by 2N)")
    a("--cp-comm-type", choices=["p2p", "all_gather"], help="context parallel attention: K/V round a ring with "
                                                            "point-to-point sends (default) or all-gathered")
    a("--expert-model-parallel-size", "--ep", dest="expert_model_parallel_size", type=int,
      help="split the experts over N ranks of data parallel x context parallel (tokens move by all-to-all)")
    a("--expert-tensor-parallel-size", "--etp", dest="expert_tensor_parallel_size", type=int,
      help="tensor parallelism inside the experts (default: --tp; e.g. 1 under --tp 2, DeepSeek-V3's recipe)")
    a("--moe-router-load-balancing-type", choices=["aux_loss", "seq_aux_loss", "none"])
    a("--moe-aux-loss-coeff", type=float, help="load-balancing loss weight (default: the checkpoint's config)")
    a("--moe-router-bias-update-rate", type=float,
      help="DeepSeek-V3 aux-loss-free balancing: expert bias step per iteration (default 1e-3; 0 freezes it)")
    a("--mtp-loss-scaling-factor", type=float, help="weight of the MTP loss, averaged over depths (default 0.1)")
    a("--moe-router-dtype", choices=["fp32", "fp64"], help="dtype of the router logits and scores")
    a("--moe-token-dispatcher-type", choices=["alltoall", "allgather", "flex"],
      help="alltoall (default) or allgather, both dropless; flex needs DeepEP (GPU only)")
    a("--micro-batch-size", type=int)
    a("--global-batch-size", type=int)
    a("--seq-length", type=int)
    a("--reset-position-ids", action="store_true", default=None, help="packed documents: positions restart after EOD")
    a("--reset-attention-mask", action="store_true", default=None,
      help="packed documents: attention does not cross an EOD token")
    a("--eod-mask-loss", action="store_true", default=None, help="no loss at positions whose input is EOD")
    a("--eod-token-id", type=int, help="end-of-document token (default: the checkpoint's eos_token_id)")
    a("--train-iters", type=int, help="iterations to train in all, counting those of the checkpoint (default 100)")
    a("--train-samples", type=int, help="samples to train in all, instead of --train-iters (iterations = "
                                        "samples // --global-batch-size; warmup and decay then in samples)")
    a("--lr", type=float, help="peak learning rate (default 3e-4)")
    a("--min-lr", type=float, help="learning rate at the end of the decay (default 0)")
    a("--lr-warmup-iters", type=int, help="linear warmup from --lr-warmup-init over N iterations (default 0)")
    a("--lr-warmup-samples", type=int, help="warmup over N samples (with --train-samples)")
    a("--lr-warmup-fraction", type=float, help="warmup over this fraction of the decay steps")
    a("--lr-warmup-init", type=float, help="learning rate of the first iteration (default 0)")
    a("--lr-decay-iters", type=int, help="iterations over which the LR decays (default --train-iters)")
    a("--lr-decay-samples", type=int, help="samples over which the LR decays (default --train-samples)")
    a("--lr-decay-style", type=_decay_style, choices=list(LR_DECAY_STYLES), help="default linear (Megatron's)")
    a("--lr-wsd-decay-style", choices=list(WSD_DECAY_STYLES), help="WSD: the annealing phase (default exponential)")
    a("--lr-wsd-decay-iters", type=int, help="WSD: iterations of the annealing phase at the end of the decay")
    a("--lr-wsd-decay-samples", type=int, help="WSD: samples of the annealing phase (with --train-samples)")
    a("--weight-decay", type=float, help="weight decay of the decaying parameters (default 0.1)")
    a("--start-weight-decay", type=float, help="with --weight-decay-incr-style linear|cosine: at the start")
    a("--end-weight-decay", type=float, help="with --weight-decay-incr-style linear|cosine: at the end")
    a("--weight-decay-incr-style", choices=list(WD_INCR_STYLES), help="default constant (--weight-decay)")
    a("--override-opt_param-scheduler", "--override-opt-param-scheduler", dest="override_opt_param_scheduler",
      action="store_true", default=None, help="on resume, take the command line's LR/WD schedule instead of "
                                              "refusing one that differs from the checkpoint's")
    a("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler",
      dest="use_checkpoint_opt_param_scheduler", action="store_true", default=None,
      help="on resume, take the checkpoint's LR/WD schedule and ignore the command line's")
    a("--clip-grad", type=float)
    a("--adam-beta1", type=float)
    a("--adam-beta2", type=float)
    a("--adam-eps", type=float)
    a("--bf16", action="store_true", default=None)
    a("--transformer-impl", choices=["local", "transformer_engine"],
      help="model backend: plain PyTorch, or Transformer Engine (GPU; default where it is installed)")
    a("--fp8-format", "--fp8", dest="fp8_format", choices=["hybrid", "e4m3"],
      help="FP8 GEMMs in the decoder's linears: hybrid = e4m3 forward, e5m2 gradients; e4m3 everywhere")
    a("--fp8-recipe", choices=["delayed", "tensorwise", "blockwise"],
      help="per-tensor scales from an amax history (default), per-tensor current scaling, or 1x128/128x128 blocks")
    a("--fp8-margin", type=int, help="delayed scaling: scale = fp8_max / amax / 2^margin")
    a("--fp8-amax-history-len", type=int, help="delayed scaling: steps of amax history per tensor (default 1)")
    a("--fp8-amax-compute-algo", choices=["most_recent", "max"], help="delayed scaling: amax from the history")
    a("--no-fp8-wgrad", dest="fp8_wgrad", action="store_false", default=None,
      help="weight-gradient GEMMs in high precision")
    a("--first-last-layers-bf16", "--fp8-first-last-bf16", dest="first_last_layers_bf16", action="store_true",
      default=None, help="keep the first and last decoder layers out of FP8")
    a("--num-layers-at-start-in-bf16", type=int, help="with --first-last-layers-bf16 (default 1)")
    a("--num-layers-at-end-in-bf16", type=int, help="with --first-last-layers-bf16 (default 1)")
    a("--recompute-granularity", choices=["full", "selective"])
    a("--save-interval", type=int)
    a("--exit-interval", type=int, help="stop after an iteration divisible by N (saving first); the run resumes "
                                        "later with the same schedule and data order")
    a("--exit-signal-handler", action="store_true", default=None,
      help="on --exit-signal (and SIGTERM): finish the iteration, save (or finish the async save), exit cleanly")
    a("--exit-signal", type=_signal_name, help="the signal --exit-signal-handler waits for (Megatron's names: "
                                               "SIGTERM, the default, SIGUSR1, ...)")
    a("--eval-interval", type=int)
    a("--eval-iters", type=int)
    a("--log-interval", type=int)
    a("--seed", type=int)
    a("--no-load-optim", action="store_true", default=None)
    a("--no-load-rng", action="store_true", default=None)
    a("--override-data-state", action="store_true", default=None,
      help="accept a dataset that differs from the one recorded in the checkpoint")
    a("--async-save", action="store_true", default=None,
      help="write checkpoints in the background while training goes on (at most one in flight)")
    a("--skip-verify", action="store_true", default=None,
      help="do not check the --load checkpoint (manifest, array metadata, every chunk present) before training; "
           "chunks are still checksummed as they are read")
    a("--tensorboard-dir", dest="tensorboard_dir",
      help="TensorBoard events (and metrics.jsonl) go here; needs tensorboard (pip install tensorboard)")
    a("--log-dir", dest="log_dir", help="where metrics.jsonl goes, and TensorBoard events when tensorboard is "
                                        "installed (default: the --save directory)")
    a("--peak-tflops", type=float, help="peak FLOP/s per device for MFU (default: known devices)")
    a("--distributed-timeout-minutes", type=float)
    a("--num-layers", type=int, help="check: must equal the checkpoint's")
    a("--hidden-size", type=int, help="check: must equal the checkpoint's")
    a("--num-attention-heads", type=int, help="check: must equal the checkpoint's")
    a("--num-experts", type=int, help="check: must equal the checkpoint's routed experts per MoE layer")
    a("--check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad", action="store_true", default=None,
      help="stop before the optimizer step when a loss or the grad norm is NaN/inf on any rank (the default)")
    a("--no-check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad", action="store_false",
      default=None, help="train on through non-finite losses and grad norms (checkpoints still refuse NaN weights)")
    a("--wandb-project", help="Weights & Biases project: log the same metrics there (needs wandb; offline "
                              "without a network)")
    a("--wandb-exp-name", help="W&B run name")
    a("--wandb-save-dir", help="W&B files directory (default: <save>/wandb)")
    return actions


def _signal_name(v: str) -> str:
    """--exit-signal: a signal name as Megatron takes it (signal.Signals member: SIGTERM, SIGUSR1); USR1 is accepted."""
    import signal

    name = v.upper() if v.upper().startswith("SIG") else "SIG" + v.upper()
    if name not in signal.Signals.__members__ or name in ("SIGKILL", "SIGSTOP"):
        raise argparse.ArgumentTypeError(f"{v!r}: not a signal that can be caught (SIGTERM, SIGUSR1, SIGUSR2, ...)")
    return name


def _decay_style(v: str) -> str:
    """--lr-decay-style: Megatron spells it WSD; wsd (shardkit's earlier spelling) means the same."""
    return "WSD" if v == "wsd" else v


@dataclass(frozen=True)
class RunLength:
    """How long the run is and its schedule, as Megatron-LM's get_optimizer_param_scheduler derives them."""

    train_iters: int
    train_samples: int  # samples the train dataset is built for (Megatron: --train-samples or iters x batch)
    scheduler: SchedulerConfig


_UNIT = {"iters": ("iteration", "--train-iters"), "samples": ("sample", "--train-samples")}


def _refuse_other_unit(s, run: str) -> None:
    """The run counts in `run` ("iters" or "samples"), as Megatron's arguments.py asserts: a schedule flag in the other
    unit, or --lr-warmup-fraction beside an explicit warmup, is a ConfigError naming the flag."""
    other = "samples" if run == "iters" else "iters"
    for stem, unset in (("lr_decay", None), ("lr_warmup", 0), ("lr_wsd_decay", None)):
        v = getattr(s, f"{stem}_{other}")
        if v != unset:
            flag = "--" + f"{stem}_{other}".replace("_", "-")
            raise ConfigError(f"{flag} {v}: {_UNIT[other][0]}-based, but the run is {_UNIT[run][0]}-based "
                              f"({_UNIT[run][1]}); use {flag.replace(other, run)} or {_UNIT[other][1]}")
    warm = getattr(s, f"lr_warmup_{run}")
    if s.lr_warmup_fraction is not None and warm != 0:
        raise ConfigError(f"--lr-warmup-fraction {s.lr_warmup_fraction} and --lr-warmup-{run} {warm}: give one")


def run_length(cfg: TrainConfig) -> RunLength:
    """--train-iters / --train-samples and the schedule flags -> iterations, dataset size and the scheduler's
    arguments in samples (Megatron-LM training.py get_optimizer_param_scheduler and arguments.py validate_args);
    bad combinations are ConfigErrors naming the flag."""
    s, o, gbs = cfg.schedule, cfg.optimizer, cfg.data.global_batch_size
    style = _decay_style(s.lr_decay_style)
    if s.train_iters is not None and s.train_samples is not None:
        raise ConfigError("--train-iters and --train-samples: give one (iteration-based or sample-based training)")
    if s.train_samples is None:  # iteration-based
        iters = 100 if s.train_iters is None else s.train_iters
        _refuse_other_unit(s, "iters")
        if iters < 1:
            raise ConfigError(f"continue-pretrain: --train-iters must be >= 1, got {iters}")
        decay_iters = iters if s.lr_decay_iters is None else s.lr_decay_iters
        decay_steps = decay_iters * gbs
        wd_steps = iters * gbs
        wsd_steps = None if s.lr_wsd_decay_iters is None else s.lr_wsd_decay_iters * gbs
        warmup = (s.lr_warmup_fraction * decay_steps if s.lr_warmup_fraction is not None
                  else s.lr_warmup_iters * gbs)
        samples, decay_flag, wsd_flag = iters * gbs, "--lr-decay-iters", "--lr-wsd-decay-iters"
    else:  # sample-based
        _refuse_other_unit(s, "samples")
        samples = s.train_samples
        iters = samples // gbs
        if iters < 1:
            raise ConfigError(f"--train-samples {samples}: fewer than one --global-batch-size ({gbs}), no iteration "
                              "to train")
        decay_steps = samples if s.lr_decay_samples is None else s.lr_decay_samples
        wd_steps = samples
        wsd_steps = s.lr_wsd_decay_samples
        warmup = s.lr_warmup_fraction * decay_steps if s.lr_warmup_fraction is not None else s.lr_warmup_samples
        decay_flag, wsd_flag = "--lr-decay-samples", "--lr-wsd-decay-samples"
    if style not in LR_DECAY_STYLES:
        raise ConfigError(f"--lr-decay-style {s.lr_decay_style!r}: expected one of {', '.join(LR_DECAY_STYLES)}")
    if s.lr_wsd_decay_style not in WSD_DECAY_STYLES:
        raise ConfigError(f"--lr-wsd-decay-style {s.lr_wsd_decay_style!r}: expected one of "
                          f"{', '.join(WSD_DECAY_STYLES)}")
    if s.weight_decay_incr_style not in WD_INCR_STYLES:
        raise ConfigError(f"--weight-decay-incr-style {s.weight_decay_incr_style!r}: expected one of "
                          f"{', '.join(WD_INCR_STYLES)}")
    if o.min_lr < 0 or o.lr < 0:
        raise ConfigError("continue-pretrain: --lr and --min-lr must be >= 0")
    if o.min_lr > o.lr:
        raise ConfigError(f"--min-lr {o.min_lr} exceeds --lr {o.lr}")
    if s.lr_warmup_init > o.lr:
        raise ConfigError(f"--lr-warmup-init {s.lr_warmup_init} exceeds --lr {o.lr}")
    if decay_steps <= 0:
        raise ConfigError(f"{decay_flag} {decay_steps if decay_flag.endswith('samples') else decay_steps // gbs}: "
                          "must be >= 1")
    if warmup < 0:
        raise ConfigError(f"the LR warmup ({warmup} samples) must be >= 0")
    if warmup >= decay_steps:
        raise ConfigError(f"the LR warmup ({warmup:g} samples) must be shorter than the decay ({decay_steps} samples, "
                          f"{decay_flag}); lower the warmup or raise {decay_flag}")
    if style == "WSD" and wsd_steps is None:
        raise ConfigError(f"--lr-decay-style WSD needs {wsd_flag} (the length of its annealing phase)")
    if style != "WSD":
        for flag, on in (("--lr-wsd-decay-style", s.lr_wsd_decay_style != "exponential"),
                         (wsd_flag, wsd_steps is not None)):
            if on:
                raise ConfigError(f"{flag}: applies to --lr-decay-style WSD only (this run decays {style}); use "
                                  "--lr-decay-style WSD or drop the flag")
    if s.lr_warmup_init != 0 and not warmup:
        raise ConfigError(f"--lr-warmup-init {s.lr_warmup_init}: the LR starts there only with a warmup; add "
                          "--lr-warmup-iters, --lr-warmup-samples or --lr-warmup-fraction, or drop the flag")
    if s.weight_decay_incr_style == "constant":
        for flag, v in (("--start-weight-decay", s.start_weight_decay), ("--end-weight-decay", s.end_weight_decay)):
            if v is not None:
                raise ConfigError(f"{flag} {v}: needs --weight-decay-incr-style linear or cosine (constant: "
                                  "--weight-decay)")
        start_wd = end_wd = o.weight_decay
    else:
        for flag, v in (("--start-weight-decay", s.start_weight_decay), ("--end-weight-decay", s.end_weight_decay)):
            if v is None:
                raise ConfigError(f"--weight-decay-incr-style {s.weight_decay_incr_style} needs {flag}")
        start_wd, end_wd = s.start_weight_decay, s.end_weight_decay
    if start_wd < 0:
        raise ConfigError(f"the weight decay must be >= 0, got {start_wd}")
    if end_wd < start_wd:
        raise ConfigError(f"--end-weight-decay {end_wd} is below --start-weight-decay {start_wd} (Megatron's "
                          "schedule only increases it)")
    if s.override_opt_param_scheduler and s.use_checkpoint_opt_param_scheduler:
        raise ConfigError("--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler: give at most one "
                          "(take the command line's schedule, or the checkpoint's)")
    sched = SchedulerConfig(max_lr=float(o.lr), min_lr=o.min_lr, lr_warmup_steps=warmup, lr_decay_steps=decay_steps,
                            lr_decay_style=style, init_lr=s.lr_warmup_init, start_wd=start_wd, end_wd=end_wd,
                            wd_incr_steps=wd_steps, wd_incr_style=s.weight_decay_incr_style,
                            wsd_decay_steps=wsd_steps, lr_wsd_decay_style=s.lr_wsd_decay_style)
    return RunLength(train_iters=iters, train_samples=samples, scheduler=sched)


def flag_default(dest: str):
    """The default a flag really has (argparse's is None so that a TOML value is not overridden by it): its dataclass
    field's. KeyError for a dest that is no field."""
    sec, name = _field_of(dest)
    f = next(f for f in fields(_SECTIONS[sec]) if f.name == name)
    return f.default_factory() if f.default is MISSING and f.default_factory is not MISSING else f.default


def _field_of(key: str) -> tuple[str, str]:
    if key in _RENAMES:
        return _RENAMES[key]
    for sec, cls in _SECTIONS.items():
        if key in {f.name for f in fields(cls)}:
            return sec, key
    raise KeyError(key)


def _typed_toml_value(path: Path, key: str, v, cls, name: str):
    """A --config value must have its flag's type (`lr = "fast"` is an error, not a traceback later): TOML integers
    pass for floats, booleans never pass for numbers, lists of strings for tuples."""
    import types
    import typing

    hint = typing.get_type_hints(cls)[name]
    allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    for t in allowed:
        if t is type(None):
            continue
        if typing.get_origin(t) is tuple:
            if isinstance(v, list) and all(isinstance(x, str) for x in v):
                return tuple(v)
        elif t is bool:
            if isinstance(v, bool):
                return v
        elif not isinstance(v, bool) and (isinstance(v, t) or (t is float and isinstance(v, int))):
            return float(v) if t is float else v
    words = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}
    want = " or ".join(words.get(t, "a list of strings") for t in allowed if t is not type(None))
    raise ConfigError(f"--config {path}: {key} = {v!r} is a {type(v).__name__}; expected {want}")


def from_namespace(ns: argparse.Namespace) -> TrainConfig:
    values: dict[str, dict] = {s: {} for s in _SECTIONS}
    if ns.config:
        path = Path(ns.config)
        try:
            toml = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ConfigError(f"--config {path}: {e}") from None
        for key, v in toml.items():
            try:
                sec, name = _field_of(key.replace("-", "_"))
            except KeyError:
                raise ConfigError(f"--config {path}: unknown key {key!r}") from None
            values[sec][name] = _typed_toml_value(path, key, v, _SECTIONS[sec], name)
            if key.replace("-", "_") == "tensorboard_dir":
                values["run"]["tensorboard"] = True
    given = {k: v for k, v in vars(ns).items() if v is not None}
    tb, log = given.get("tensorboard_dir"), given.get("log_dir")
    if tb is not None and log is not None and str(tb) != str(log):
        raise ConfigError(f"--tensorboard-dir {tb} and --log-dir {log}: one directory holds metrics.jsonl and the "
                          "TensorBoard events; give one of the two")
    for key, v in given.items():
        if key in ("config", "command", "func"):
            continue
        try:
            sec, name = _field_of(key)
        except KeyError:
            continue
        values[sec][name] = v
        if key == "tensorboard_dir":
            values["run"]["tensorboard"] = True
    if "data_path" in values["data"]:
        values["data"]["data_path"] = tuple(str(x) for x in values["data"]["data_path"])
    try:
        return TrainConfig(**{s: cls(**values[s]) for s, cls in _SECTIONS.items()})
    except TypeError as e:
        raise ConfigError(f"continue-pretrain: {e}") from None


def validate(cfg: TrainConfig) -> None:
    """Errors that need no checkpoint and no process group."""
    d, c = cfg.data, cfg.checkpoint
    if cfg.schedule.exit_signal_handler:
        from .signals import ExitSignals

        ExitSignals(cfg.schedule.exit_signal)  # a --config exit_signal that names no signal: one line, at start
    if not c.load:
        raise ConfigError("continue-pretrain: --load is required (a converted model or a training checkpoint)")
    if not d.data_path:
        raise ConfigError("continue-pretrain: --data-path is required (prefixes of .bin/.idx files)")
    for flag, v, allowed in (("--save-format", c.save_format, ("native", "torch_dist")),
                             ("--key-naming", c.key_naming, ("te", "local"))):
        if v not in allowed:
            raise ConfigError(f"continue-pretrain: {flag} {v!r}: expected {' or '.join(allowed)}")
    for flag, v in (("--micro-batch-size", d.micro_batch_size), ("--global-batch-size", d.global_batch_size),
                    ("--seq-length", d.seq_length)):
        if v < 1:
            raise ConfigError(f"continue-pretrain: {flag} must be >= 1, got {v}")
    from .parallel.context import COMM_TYPES, check_sequence

    check_sequence(d.seq_length, cfg.parallel.cp, cfg.parallel.tp, cfg.parallel.sequence_parallel)
    if cfg.parallel.cp_comm_type not in COMM_TYPES:
        raise ConfigError(f"--cp-comm-type {cfg.parallel.cp_comm_type!r}: expected one of {', '.join(COMM_TYPES)}")
    if cfg.run.transformer_impl not in (None, "local", "transformer_engine"):
        raise ConfigError(f"--transformer-impl {cfg.run.transformer_impl!r}: expected local or transformer_engine")
    validate_fp8(cfg.fp8)
    check_flags_used(cfg)
    if cfg.run.transformer_impl == "transformer_engine":
        from .te import check_installed, packed_cp_refusal, recipe_spec

        if cfg.parallel.cp > 1 and d.reset_attention_mask:
            raise ConfigError(packed_cp_refusal(cfg.parallel.cp))
        if cfg.fp8.enabled:
            recipe_spec(cfg.fp8)  # a recipe TE has no form of: refused here, not after loading
            if cfg.run.recompute_granularity == "full":  # te.unsupported says the same after loading
                raise ConfigError("--transformer-impl transformer_engine: --recompute-granularity full with FP8: the "
                                  "recomputed forward would run outside te.autocast; use --recompute-granularity "
                                  "selective")
        check_installed()  # before any process group or checkpoint: one line naming the flag and the install
    validate_moe(cfg)
    run_length(cfg)  # --train-iters/--train-samples and the LR/WD schedule flags


def check_flags_used(cfg: TrainConfig) -> None:
    """Flags that would have no effect in this run (they need another flag, or a part the run does not have) are
    one-line ConfigErrors naming the flag and what to do, never silently dropped (issue 32; docs/TRAINING_FLAGS.md).
    A flag given with its default value cannot be told from one not given and does nothing either way."""
    d, c, r, s, p = cfg.data, cfg.checkpoint, cfg.run, cfg.schedule, cfg.parallel
    if d.eod_token_id is not None and not (d.reset_position_ids or d.reset_attention_mask or d.eod_mask_loss):
        raise ConfigError(f"--eod-token-id {d.eod_token_id}: used only by the packed-document flags; add "
                          "--reset-position-ids, --reset-attention-mask or --eod-mask-loss, or drop it")
    if not c.save:
        for flag, on in (("--save-interval", c.save_interval), ("--async-save", c.async_save),
                         ("--save-format", c.save_format != "native")):
            if on:
                raise ConfigError(f"{flag}: nothing is saved without --save; add --save DIR or drop the flag")
    if s.exit_signal != "SIGTERM" and not s.exit_signal_handler:
        raise ConfigError(f"--exit-signal {s.exit_signal}: only --exit-signal-handler waits for it; add "
                          "--exit-signal-handler or drop the flag")
    if not r.wandb_project:
        for flag, v in (("--wandb-exp-name", r.wandb_exp_name), ("--wandb-save-dir", r.wandb_save_dir)):
            if v:
                raise ConfigError(f"{flag} {v}: W&B logs only with --wandb-project; add --wandb-project NAME or "
                                  "drop the flag")
    if not r.log_interval:
        for flag, on in (("--tensorboard-dir", r.tensorboard), ("--log-dir", r.log_dir and not r.tensorboard),
                         ("--wandb-project", r.wandb_project), ("--peak-tflops", r.peak_tflops is not None)):
            if on:
                raise ConfigError(f"{flag}: --log-interval 0 logs no iteration, so it would get nothing; give "
                                  "--log-interval N (N >= 1) or drop the flag")
    if r.tensorboard:
        from .metrics import tensorboard_missing

        why = tensorboard_missing()
        if why:
            raise ConfigError(f"--tensorboard-dir {r.log_dir}: TensorBoard cannot be written ({why}); pip install "
                              f"tensorboard, or use --log-dir {r.log_dir} for metrics.jsonl alone")
    if p.vpp > 1 and p.pp == 1:
        raise ConfigError(f"--virtual-pipeline-model-parallel-size {p.vpp}: the interleaved schedule needs "
                          "--pipeline-model-parallel-size > 1 (Megatron asserts the same); add --pp N or drop --vpp")
    if p.cp_comm_type != "p2p" and p.cp == 1:
        raise ConfigError(f"--cp-comm-type {p.cp_comm_type}: applies to context parallelism; add "
                          "--context-parallel-size N (N > 1) or drop the flag")
    if r.eval_interval and not r.eval_iters:
        raise ConfigError(f"--eval-interval {r.eval_interval}: no evaluation without --eval-iters N (batches per "
                          "evaluation; Megatron's default 100 is 0 here)")
    if r.eval_iters and not r.eval_interval:
        raise ConfigError(f"--eval-iters {r.eval_iters}: no evaluation without --eval-interval N")
    if r.eval_interval and r.eval_iters:
        from .data import split_matrix

        if split_matrix(d.split)[1] is None:
            raise ConfigError(f"--eval-interval {r.eval_interval}: --split {d.split} leaves no validation data; give "
                              "the validation share a weight (e.g. --split 969,30,1)")


def check_for_model(cfg: TrainConfig, m) -> None:
    """The flags that depend on the checkpoint's model (`m`, a checkpoint.config.ModelConfig), before anything is
    built: MoE / MTP flags on a model without experts / MTP layers, and packed documents under context parallelism
    on a Transformer Engine chosen by default (an explicit --transformer-impl is checked in `validate`)."""
    mo, r = cfg.moe, cfg.run
    experts = m.num_moe_experts if m.is_moe else 0
    if r.num_experts is not None and r.num_experts != experts:
        raise ConfigError(f"--num-experts {r.num_experts} disagrees with the checkpoint ({m.model_type}: "
                          f"{experts or 'no'} routed experts); drop the flag or load the right checkpoint")
    moe_flags = (("--moe-router-load-balancing-type", mo.moe_router_load_balancing_type != "aux_loss"),
                 ("--moe-aux-loss-coeff", mo.moe_aux_loss_coeff is not None),
                 ("--moe-router-bias-update-rate", mo.moe_router_bias_update_rate != 1e-3),
                 ("--moe-router-dtype", mo.moe_router_dtype is not None),
                 ("--moe-token-dispatcher-type", mo.moe_token_dispatcher_type != "alltoall"))
    if not m.is_moe:
        for flag, on in moe_flags:
            if on:
                raise ConfigError(f"{flag}: {m.model_type} is a dense model (no experts); the MoE flags apply to "
                                  "MoE checkpoints (Mixtral, DeepSeek); drop the flag")
    else:
        if mo.moe_router_bias_update_rate != 1e-3 and not m.moe_router_enable_expert_bias:
            raise ConfigError(f"--moe-router-bias-update-rate {mo.moe_router_bias_update_rate}: {m.model_type}'s "
                              "router has no expert bias (DeepSeek-V3's aux-loss-free balancing); drop the flag")
        if mo.moe_aux_loss_coeff is not None and mo.moe_router_load_balancing_type == "none":
            raise ConfigError(f"--moe-aux-loss-coeff {mo.moe_aux_loss_coeff} with --moe-router-load-balancing-type "
                              "none: no load-balancing loss to weigh; pick aux_loss or seq_aux_loss, or drop the coeff")
    if not m.mtp_num_layers and mo.mtp_loss_scaling_factor != 0.1:
        raise ConfigError(f"--mtp-loss-scaling-factor {mo.mtp_loss_scaling_factor}: {m.model_type} has no "
                          "multi-token-prediction layers; drop the flag")
    if cfg.parallel.cp > 1 and cfg.data.reset_attention_mask and r.transformer_impl is None:
        import torch

        from .te import packed_cp_refusal, resolve_impl, unsupported

        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # as the trainer picks it
        why_not = unsupported(m, cfg.fp8, r.recompute_granularity)
        if resolve_impl(None, device, why_not=why_not) == "transformer_engine":
            raise ConfigError(packed_cp_refusal(cfg.parallel.cp, default=True))


def validate_moe(cfg: TrainConfig) -> None:
    m = cfg.moe
    if cfg.parallel.ep < 1:
        raise ConfigError(f"continue-pretrain: --expert-model-parallel-size must be >= 1, got {cfg.parallel.ep}")
    if cfg.parallel.etp is not None and cfg.parallel.etp < 1:
        raise ConfigError(f"continue-pretrain: --expert-tensor-parallel-size must be >= 1, got {cfg.parallel.etp}")
    if m.moe_token_dispatcher_type == "flex":
        raise ConfigError("--moe-token-dispatcher-type flex: megatron-core's flex dispatcher needs DeepEP (deep_ep) "
                          "or HybridEP, GPU-only libraries (NVSHMEM / NVLink) the trainer does not use; use alltoall "
                          "or allgather")
    if m.moe_token_dispatcher_type not in ("alltoall", "allgather"):
        raise ConfigError(f"--moe-token-dispatcher-type {m.moe_token_dispatcher_type!r}: expected alltoall or "
                          "allgather")
    if m.moe_router_load_balancing_type not in ("aux_loss", "seq_aux_loss", "none"):
        raise ConfigError(f"--moe-router-load-balancing-type {m.moe_router_load_balancing_type!r}: expected aux_loss, "
                          "seq_aux_loss or none")
    if m.moe_router_dtype not in (None, "fp32", "fp64"):
        raise ConfigError(f"--moe-router-dtype {m.moe_router_dtype!r}: expected fp32 or fp64")
    for flag, v in (("--moe-aux-loss-coeff", m.moe_aux_loss_coeff), ("--moe-router-bias-update-rate",
                    m.moe_router_bias_update_rate), ("--mtp-loss-scaling-factor", m.mtp_loss_scaling_factor)):
        if v is not None and v < 0:
            raise ConfigError(f"continue-pretrain: {flag} must be >= 0, got {v}")
