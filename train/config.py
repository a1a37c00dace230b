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
    verify_integrity: bool = False  # torch_dist saves: integrity.json (Megatron-LM 0.19's --verify-integrity)
    hf_config: str = ""  # a torch_dist --load without shardkit.json: the HF directory describing the model
    vocab_size: int | None = None  # ... or the true vocab size its Megatron-LM args lack


@dataclass(frozen=True)
class RunConfig:
    bf16: bool = False
    transformer_impl: str | None = None  # local | transformer_engine; None: TE where installed (and a GPU)
    engine: str | None = None  # megatron-core | native; None: megatron-core on CUDA where installed (train/engines)
    recompute_granularity: str | None = None
    # megatron-core's full-recompute units (train/parallel/parallelize.py recompute_groups); None: every layer
    recompute_method: str | None = None  # uniform | block
    recompute_num_layers: int | None = None
    # Megatron-LM's defaults (issue 41; before it shardkit had no dropout): train/dropout.py
    attention_dropout: float = 0.1
    hidden_dropout: float = 0.1
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
    # the other Megatron-LM flags given (issue 41): (flag, Megatron dest, value), sorted out by `megatron_flags`
    megatron: tuple = ()


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

    @property
    def megatron(self) -> tuple:
        return self.run.megatron


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
    a("--verify-integrity", action="store_true", default=None,
      help="--save-format torch_dist: write integrity.json with each save (SHA-256 of every file, as Megatron-LM "
           "0.19's --verify-integrity save; its --verify-integrity load checks it); one more read of each save")
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
    a("--weight-decay", type=float, help="weight decay of the decaying parameters (default 0.01, Megatron's)")
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
    a("--engine", choices=["megatron-core", "native"],
      help="training engine: megatron-core's (GPTModel, DDP, distributed optimizer, schedules; the default on CUDA "
           "where installed) or shardkit's native one (the default on the CPU); issue 40")
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
    a("--recompute-method", choices=["uniform", "block"],
      help="--recompute-granularity full: uniform = checkpoint runs of --recompute-num-layers layers; block = "
           "checkpoint only the first --recompute-num-layers layers of each pipeline chunk (megatron-core's)")
    a("--recompute-num-layers", type=int, help="with --recompute-method (megatron-core's meaning)")
    a("--attention-dropout", type=float, help="dropout on the attention probabilities (Megatron's default 0.1)")
    a("--hidden-dropout", type=float, help="dropout on the embedding output and on the attention and MLP outputs "
                                           "before each residual add (Megatron's default 0.1)")
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
    add_megatron_arguments(p)
    return actions


MEGATRON_DEST = "mlm__"  # argparse dest prefix of the Megatron-LM flags shardkit has no field for


def add_megatron_arguments(p: argparse.ArgumentParser) -> None:
    """Every other Megatron-LM flag (checkpoint/megatron_lm_args.py OPTIONS, generated from Megatron-LM's parser),
    parsed as Megatron parses it and kept for `megatron_flags` to check, note or refuse: never argparse's
    "unrecognized arguments" for a Megatron-LM flag. Hidden from --help (docs/TRAINING_FLAGS.md lists them)."""
    from checkpoint.megatron_lm_args import OPTIONS

    types = {"int": int, "float": float, "str": str}
    for opt, (dest, nargs, typ, const) in OPTIONS.items():
        if opt in p._option_string_actions:
            continue
        kw = dict(dest=MEGATRON_DEST + opt.lstrip("-").replace("-", "_"), default=None, help=argparse.SUPPRESS)
        if nargs == 0:
            p.add_argument(opt, action="store_const", const=const, **kw)
        else:
            p.add_argument(opt, nargs=nargs, type=types[typ], **kw)


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
    megatron = []
    for key in [k for k in given if k.startswith(MEGATRON_DEST)]:
        flag, dest, v = _megatron_given(key, given.pop(key))
        try:  # a Megatron-LM alias of a shardkit flag (--persistent-save-interval, --disable-fp8-wgrad)
            _field_of(dest)
        except KeyError:
            megatron.append((flag, dest, v))
        else:
            given.setdefault(dest, v)
    if any(d == "recompute_activations" for _, d, _ in megatron) and "recompute_granularity" not in given:
        given["recompute_granularity"] = "selective"  # Megatron-LM's validate_args: the older spelling of selective
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
        values["run"]["megatron"] = tuple(sorted(megatron, key=lambda e: e[0]))
        return TrainConfig(**{s: cls(**values[s]) for s, cls in _SECTIONS.items()})
    except TypeError as e:
        raise ConfigError(f"continue-pretrain: {e}") from None


def validate(cfg: TrainConfig, te_on_nodes: bool = False) -> None:
    """Errors that need no checkpoint and no process group. `te_on_nodes`: Transformer Engine is taken to be installed
    where the job runs (`shardkit launch`: the GPU cluster `shardkit plan` models), not looked for on this machine."""
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
    check_dropout_recompute(cfg)
    megatron_flags(cfg)  # the other Megatron-LM flags: a refused one is one line here
    if cfg.run.transformer_impl == "transformer_engine":
        from .te import check_installed, packed_cp_refusal, recipe_spec

        if cfg.parallel.cp > 1 and d.reset_attention_mask:
            raise ConfigError(packed_cp_refusal(cfg.parallel.cp))
        if cfg.fp8.enabled:
            recipe_spec(cfg.fp8)  # a recipe TE has no form of: refused here, not after loading
            # te.unsupported says the same after loading; megatron-core's engine recomputes under its FP8 context
            if cfg.run.recompute_granularity == "full" and not _on_megatron_core(cfg):
                raise ConfigError("--transformer-impl transformer_engine: --recompute-granularity full with FP8: the "
                                  "recomputed forward would run outside te.autocast; use --recompute-granularity "
                                  "selective")
        if not te_on_nodes:
            check_installed()  # before any process group or checkpoint: one line naming the flag and the install
    validate_moe(cfg)
    run_length(cfg)  # --train-iters/--train-samples and the LR/WD schedule flags


def check_dropout_recompute(cfg: TrainConfig) -> None:
    """--attention-dropout / --hidden-dropout and megatron-core's --recompute-method / --recompute-num-layers."""
    r = cfg.run
    for flag, v in (("--attention-dropout", r.attention_dropout), ("--hidden-dropout", r.hidden_dropout)):
        if not 0 <= v < 1:
            raise ConfigError(f"{flag} {v}: a dropout probability is in [0, 1)")
    if r.attention_dropout and (cfg.parallel.cp > 1 or cfg.data.reset_attention_mask):
        why = (f"--context-parallel-size {cfg.parallel.cp}" if cfg.parallel.cp > 1 else "--reset-attention-mask")
        raise ConfigError(f"--attention-dropout {r.attention_dropout} with {why}: that attention (ring / all-gather "
                          "/ per-document) applies no dropout to its probabilities here; use --attention-dropout 0")
    if r.attention_dropout and r.transformer_impl == "transformer_engine" and not _on_megatron_core(cfg):
        # (megatron-core's engine: its TEDotProductAttention applies --attention-dropout itself)
        raise ConfigError(f"--attention-dropout {r.attention_dropout} with --transformer-impl transformer_engine: "
                          "TE's DotProductAttention is built without dropout here; use --attention-dropout 0 or "
                          "--transformer-impl local")
    if r.recompute_method is not None or r.recompute_num_layers is not None:
        flag = (f"--recompute-method {r.recompute_method}" if r.recompute_method is not None
                else f"--recompute-num-layers {r.recompute_num_layers}")
        if r.recompute_granularity != "full":
            raise ConfigError(f"{flag}: applies to --recompute-granularity full (megatron-core: selective "
                              "recompute takes no method or layer count); add it or drop the flag")
        if r.recompute_method not in ("uniform", "block"):
            raise ConfigError(f"--recompute-num-layers {r.recompute_num_layers}: needs --recompute-method uniform or "
                              "block (megatron-core requires both with --recompute-granularity full)")
        if r.recompute_num_layers is None:
            raise ConfigError(f"--recompute-method {r.recompute_method}: needs --recompute-num-layers N "
                              "(megatron-core requires both with --recompute-granularity full)")
        if r.recompute_num_layers < 1 and not (r.recompute_method == "block" and r.recompute_num_layers == 0):
            raise ConfigError(f"--recompute-num-layers {r.recompute_num_layers}: must be >= 1")


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
                         ("--save-format", c.save_format != "native"), ("--verify-integrity", c.verify_integrity)):
            if on:
                raise ConfigError(f"{flag}: nothing is saved without --save; add --save DIR or drop the flag")
    if c.verify_integrity and c.save_format != "torch_dist":  # Megatron-LM asserts the same
        raise ConfigError("--verify-integrity: integrity.json is written with --save-format torch_dist only (the "
                          "native format checksums every chunk itself); add --save-format torch_dist or drop it")
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
        from .data.order import split_matrix

        if split_matrix(d.split)[1] is None:
            raise ConfigError(f"--eval-interval {r.eval_interval}: --split {d.split} leaves no validation data; give "
                              "the validation share a weight (e.g. --split 969,30,1)")


def check_for_model(cfg: TrainConfig, m) -> None:
    """The flags that depend on the checkpoint's model (`m`, a checkpoint.config.ModelConfig), before anything is
    built: MoE / MTP flags on a model without experts / MTP layers, and packed documents under context parallelism
    on a Transformer Engine chosen by default (an explicit --transformer-impl is checked in `validate`)."""
    mo, r = cfg.moe, cfg.run
    check_megatron_shape(cfg, m)
    if r.recompute_num_layers is not None:
        per_rank = m.num_layers // cfg.parallel.pp
        if r.recompute_num_layers > per_rank:
            raise ConfigError(f"--recompute-num-layers {r.recompute_num_layers}: more than the {per_rank} decoder "
                              f"layers per pipeline rank ({m.num_layers} layers, --pp {cfg.parallel.pp}); "
                              "megatron-core requires 1..layers per rank")
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



# -- Megatron-LM's other flags (issue 41) -----------------------------------------------------------------------------
# Each Megatron-LM flag is honoured (a field above), checked against the checkpoint's model (`MEGATRON_CHECKS`), noted
# as implied or irrelevant to a resumed run (`MEGATRON_NOTES`, one line each at start-up) or refused in one line
# (`MEGATRON_REFUSALS`, or the generic line); a flag given with Megatron-LM's default value changes nothing and is
# noted as such. docs/TRAINING_FLAGS.md has the table.

_KERNEL = "a kernel / fusion choice of Megatron's CUDA path: the same math; shardkit picks its own kernels"
_LOGS = ("a Megatron-LM log series shardkit does not write (metrics.jsonl / TensorBoard / W&B get loss, LR, weight "
         "decay, grad norm, throughput, memory)")
_LOADER = "a Megatron-LM data-loader knob; shardkit reads the .bin/.idx files in process"
_TOKENIZER = "the data is pre-tokenized (.bin/.idx); the tokenizer files travel in the checkpoint's hf/"
_INIT = "every weight comes from --load; nothing is initialised"
MEGATRON_NOTES = {
    "use_distributed_optimizer": "implied: shardkit always shards the optimizer state over data parallel (its "
                                 "distributed optimizer)",
    "deprecated_use_mcore_models": "implied: shardkit's model is megatron-core's GPTModel (same modules and keys)",
    "init_method_std": _INIT, "use_cpu_initialization": _INIT, "perform_initialization": _INIT,
    "init_model_with_meta_device": _INIT,
    "tokenizer_type": _TOKENIZER, "tokenizer_model": _TOKENIZER, "vocab_file": _TOKENIZER, "merge_file": _TOKENIZER,
    "tiktoken_pattern": _TOKENIZER,
    "masked_softmax_fusion": _KERNEL, "bias_gelu_fusion": _KERNEL, "bias_swiglu_fusion": _KERNEL,
    "bias_dropout_fusion": _KERNEL, "apply_rope_fusion": _KERNEL, "gradient_accumulation_fusion": _KERNEL,
    "cross_entropy_loss_fusion": _KERNEL, "cross_entropy_fusion_impl": _KERNEL, "moe_permute_fusion": _KERNEL,
    "moe_grouped_gemm": _KERNEL, "no_persist_layer_norm": _KERNEL, "attention_backend": _KERNEL,
    "attention_softmax_in_fp32": "softmax runs in fp32 here always (SDPA / the unfused dropout attention)",
    "moe_shared_expert_overlap": _KERNEL, "async_tensor_model_parallel_allreduce": _KERNEL,
    "use_flash_attn": "flash-attn runs where it is installed on CUDA (SDPA otherwise), with or without the flag",
    "log_throughput": "the log line always shows throughput (tokens/s; TFLOP/s and MFU where the peak is known)",
    "log_params_norm": _LOGS, "log_num_zeros_in_grad": _LOGS, "log_timers_to_tensorboard": _LOGS,
    "log_memory_to_tensorboard": _LOGS, "log_validation_ppl_to_tensorboard": _LOGS, "log_progress": _LOGS,
    "log_world_size_to_tensorboard": _LOGS, "logging_level": _LOGS, "timing_log_level": _LOGS,
    "log_loss_scale_to_tensorboard": _LOGS, "tensorboard_log_interval": _LOGS, "tensorboard_queue_size": _LOGS,
    "manual_gc": "memory housekeeping of Megatron-LM's loop; no effect on the numbers",
    "manual_gc_interval": "memory housekeeping of Megatron-LM's loop; no effect on the numbers",
    "empty_unused_memory_level": "memory housekeeping of Megatron-LM's loop; no effect on the numbers",
    "num_workers": _LOADER, "data_cache_path": _LOADER, "mmap_bin_files": _LOADER,
    "create_attention_mask_in_dataloader": "attention masks are built per micro-batch (causal, or per document)",
    "auto_detect_ckpt_format": "implied: shardkit detects the --load format (native or torch_dist) always",
    "dist_ckpt_strictness": "shardkit loads strictly: every tensor present, shapes and names as the model's",
    "enable_experimental": "shardkit has no experimental code paths to enable",
    "fp8_param_gather": "FP8 weights are cast for each GEMM; there is no parameter all-gather to run in FP8",
    "grad_reduce_in_bf16": "gradients are reduced in fp32 here (Megatron's bf16 reduction trades precision for "
                           "bandwidth)",
    "distributed_backend": "NCCL on CUDA, gloo on the CPU, chosen by the device",
    "ckpt_fully_parallel_save": "every rank writes its own chunks always",
    "ckpt_fully_parallel_load": "every rank reads its own regions always",
}
_NATIVE = ("shardkit's native engine does not overlap this communication with compute; the megatron-core engine "
           "(--engine megatron-core, issue 40) honours it; drop the flag (the numbers are the same without it)")
MEGATRON_REFUSALS = {
    "fp16": "fp16 training with loss scaling is not implemented; use --bf16 (or fp32, the default)",
    "overlap_grad_reduce": _NATIVE, "overlap_param_gather": _NATIVE,
    "decoupled_lr": "a separate learning rate for the embedding and output layer is not implemented; drop it (the "
                    "whole model then trains at --lr)",
    "decoupled_min_lr": "a separate learning rate for the embedding and output layer is not implemented",
    "mock_data": "shardkit trains on real data only; give --data-path PREFIX (pre-tokenized .bin/.idx)",
    "exit_duration_in_mins": "not implemented; stop by iterations (--exit-interval) or by a signal "
                             "(--exit-signal-handler, e.g. SLURM's --signal)",
    "profile": "shardkit starts no profiler; run the command under nsys or torch.profiler instead",
    "profile_step_start": "shardkit starts no profiler", "profile_step_end": "shardkit starts no profiler",
    "profile_ranks": "shardkit starts no profiler", "use_pytorch_profiler": "shardkit starts no profiler",
    "moe_router_force_load_balancing": "a benchmarking mode (random routing) that changes what is trained",
    "recompute_modules": "shardkit's selective recompute covers core_attn only (Megatron's default); use "
                         "--recompute-granularity full for more",
    "moe_layer_recompute": "use --recompute-granularity full (whole layers) or selective (core attention)",
    "finetune": "use a weights-only --load (a converted model starts at iteration 0), or --no-load-optim "
                "--no-load-rng to keep the iteration",
    "moe_flex_dispatcher_backend": "the flex dispatcher (DeepEP / HybridEP) is GPU-only and not used; use "
                                   "--moe-token-dispatcher-type alltoall or allgather",
}


def _megatron_given(key: str, value) -> tuple[str, str, object]:
    from checkpoint.megatron_lm_args import OPTIONS

    flag = "--" + key[len(MEGATRON_DEST):].replace("_", "-")
    if flag not in OPTIONS:  # an option spelled with underscores (--override-opt_param-scheduler style)
        flag = next(o for o in OPTIONS if o.lstrip("-").replace("-", "_") == key[len(MEGATRON_DEST):])
    return flag, OPTIONS[flag][0], value


def _show(v) -> str:
    return " ".join(map(str, v)) if isinstance(v, list) else str(v)


def _moe_layer_freq(v, num_layers: int) -> list[int] | None:
    """Megatron-LM's --moe-layer-freq: an int k (every k-th layer, from layer 0) or a list expression such as
    "[0]*3+[1]*58" (read here without eval: terms `[a, b, ...]` or `[a, ...]*n` joined by +). None: unreadable."""
    import re

    text = _show(v).replace(" ", "")
    if re.fullmatch(r"\d+", text):
        k = int(text)
        return [1 if k and i % k == 0 else 0 for i in range(num_layers)]
    out: list[int] = []
    for term in text.split("+"):
        m = re.fullmatch(r"\[([\d,]*)\](?:\*(\d+))?", term)
        if not m:
            return None
        items = [int(x) for x in m.group(1).split(",") if x]
        out += items * int(m.group(2) or 1)
    return out


def _checkpoint_values(m) -> dict:
    """Megatron dest -> the checkpoint model's value (checkpoint.config.ModelConfig), for the checks."""
    rs = m.rope_scaling or {}
    rope_type = rs.get("rope_type", rs.get("type"))
    freq = m.moe_layer_freq if m.moe_layer_freq is not None else [1] * m.num_layers
    return {
        "ffn_hidden_size": m.ffn_hidden_size, "num_query_groups": m.num_query_groups,
        "kv_channels": m.kv_channels, "swiglu": True, "normalization": "RMSNorm", "position_embedding_type": "rope",
        "add_position_embedding": False, "rotary_base": m.rotary_base, "rotary_percent": 1.0,
        "rotary_interleaved": m.rotary_interleaved,
        "untie_embeddings_and_output_weights": not m.tie_word_embeddings,
        "add_bias_linear": bool(m.add_proj_bias or m.add_mlp_bias), "add_qkv_bias": m.add_qkv_bias,
        "max_position_embeddings": m.max_position_embeddings, "layernorm_epsilon": m.norm_epsilon,
        "layernorm_zero_centered_gamma": False,
        "make_vocab_size_divisible_by": m.make_vocab_size_divisible_by,
        "use_rope_scaling": rope_type == "llama3", "rope_scaling_factor": rs.get("factor", 8.0),
        "rotary_scaling_factor": rs.get("factor", 1.0), "mscale": rs.get("mscale", 1.0),
        "mscale_all_dim": rs.get("mscale_all_dim", 0.0),
        "multi_latent_attention": m.multi_latent_attention, "qk_layernorm": m.multi_latent_attention,
        "q_lora_rank": m.q_lora_rank, "kv_lora_rank": m.kv_lora_rank, "qk_head_dim": m.qk_head_dim,
        "qk_pos_emb_head_dim": m.qk_pos_emb_head_dim, "v_head_dim": m.v_head_dim,
        "moe_router_topk": m.moe_router_topk if m.is_moe else None,
        "moe_ffn_hidden_size": (m.moe_ffn_hidden_size or m.ffn_hidden_size) if m.is_moe else None,
        "moe_shared_expert_intermediate_size": m.moe_shared_expert_intermediate_size,
        "moe_layer_freq": freq if m.is_moe else None,
        "moe_router_score_function": m.moe_router_score_function if m.is_moe else None,
        "moe_router_topk_scaling_factor": m.moe_router_topk_scaling_factor,
        "moe_router_num_groups": m.moe_router_num_groups, "moe_router_group_topk": m.moe_router_group_topk,
        "moe_router_enable_expert_bias": m.moe_router_enable_expert_bias,
        "moe_router_pre_softmax": (m.moe_router_score_function == "softmax" and not m.moe_router_norm_topk)
        if m.is_moe else None,
        "mtp_num_layers": m.mtp_num_layers, "group_query_attention": m.num_query_groups < m.num_attention_heads,
    }


def _is_megatron_default(dest: str, value) -> bool:
    from checkpoint.megatron_lm_args import DEFAULTS

    d = DEFAULTS.get(dest, object())
    if isinstance(d, dict) and "member" in d:
        return str(value) in (d["member"], str(d["value"]))
    return value == d or (isinstance(d, (int, float)) and not isinstance(d, bool)
                          and isinstance(value, (int, float)) and float(value) == float(d))


def megatron_flags(cfg: TrainConfig) -> list[str]:
    """The Megatron-LM flags without a shardkit field, before any checkpoint is read: the first refused one is a
    one-line ConfigError; the others give their one-line notes (returned; the trainer logs them). The checks
    against the model (`MEGATRON_CHECKS` dests) come in `check_megatron_shape`."""
    notes = []
    given = {d for _, d, _ in cfg.megatron}
    checks = set(_checkpoint_values_keys())
    for flag, dest, value in cfg.megatron:
        shown = flag if value is True or value is False else f"{flag} {_show(value)}"
        if dest in checks:
            continue
        if dest == "calculate_per_token_loss":
            if cfg.data.eod_mask_loss:
                raise ConfigError(f"{flag} with --eod-mask-loss: shardkit averages the loss per micro-batch; with "
                                  "masked tokens the per-token average differs; drop one of the two")
            notes.append(f"note: {shown}: every micro-batch has --seq-length unmasked tokens here, so the per-token "
                         "average equals the per-micro-batch average")
            continue
        if dest == "recompute_modules" and value == ["core_attn"]:
            notes.append(f"note: {shown}: what shardkit's selective recompute covers (Megatron-LM's default)")
            continue
        if dest == "recompute_activations":
            notes.append(f"note: {shown}: Megatron-LM's older spelling of --recompute-granularity selective "
                         "(honoured)")
            continue
        if dest in MEGATRON_NOTES:
            notes.append(f"note: {shown}: {MEGATRON_NOTES[dest]}")
            continue
        if dest in ("overlap_grad_reduce", "overlap_param_gather") and _on_megatron_core(cfg):  # issue 40
            notes.append(f"note: {shown}: honoured by megatron-core's DistributedDataParallel (--engine megatron-core)")
            continue
        if _is_megatron_default(dest, value):  # e.g. --profile-ranks 0: nothing asked beyond the default
            notes.append(f"note: {shown}: Megatron-LM's default value, nothing to do")
            continue
        if dest in MEGATRON_REFUSALS:
            raise ConfigError(f"{shown}: {MEGATRON_REFUSALS[dest]}")
        raise ConfigError(f"{shown}: a Megatron-LM flag ({dest}) that shardkit's trainer does not implement; drop it "
                          "(docs/TRAINING_FLAGS.md lists each flag: honoured, checked, noted or refused)")
    if "num_query_groups" in given and "group_query_attention" not in given:
        notes.append("note: --num-query-groups without --group-query-attention: Megatron-LM would build multi-head "
                     "attention; the checkpoint's query groups are used")
    return notes


def _on_megatron_core(cfg: TrainConfig) -> bool:
    from train.engines.choice import default_engine

    return (cfg.run.engine or default_engine()) == "megatron-core"


def _checkpoint_values_keys() -> list[str]:
    from checkpoint.config import ModelConfig

    m = ModelConfig(model_type="llama", num_layers=1, hidden_size=8, ffn_hidden_size=8, num_attention_heads=1,
                    num_query_groups=1, kv_channels=8, vocab_size=8, max_position_embeddings=8, norm_epsilon=1e-5,
                    rotary_base=1e4)
    return list(_checkpoint_values(m))


def check_megatron_shape(cfg: TrainConfig, m) -> list[str]:
    """Megatron-LM's model-shape flags against the checkpoint's model: agreement is silent (a line for the record
    is returned), a mismatch one ConfigError line naming the flag, its value and the checkpoint's."""
    have = _checkpoint_values(m)
    given = {d: v for _, d, v in cfg.megatron}
    checked = []
    for flag, dest, value in cfg.megatron:
        if dest not in have:
            continue
        want = have[dest]
        v = value
        if dest == "moe_layer_freq":
            v = _moe_layer_freq(value, m.num_layers)
        elif dest == "num_query_groups" and "group_query_attention" not in given:
            continue  # Megatron-LM ignores it without --group-query-attention (noted by megatron_flags)
        elif dest == "group_query_attention":  # a switch: the groups are --num-query-groups (Megatron's default 1)
            if "num_query_groups" in given:
                continue
            v, want = 1, m.num_query_groups
            if v != want:
                raise ConfigError(f"{flag} (with Megatron-LM's default --num-query-groups 1) disagrees with the "
                                  f"checkpoint ({m.model_type}: num_query_groups {want}); add --num-query-groups "
                                  f"{want}, or load the right checkpoint")
            checked.append(flag)
            continue
        elif dest == "kv_channels" and m.multi_latent_attention:
            continue  # megatron-core's MLA sizes heads by --qk-head-dim / --v-head-dim, not --kv-channels
        elif dest == "moe_router_pre_softmax" and m.is_moe and m.moe_router_score_function == "sigmoid":
            continue  # megatron-core reads it for softmax scores only
        if isinstance(want, float) or isinstance(v, float):
            same = want is not None and v is not None and float(v) == float(want)
        else:
            same = v == want
        shown = flag if value is True or value is False else f"{flag} {_show(value)}"
        if not same:
            theirs = "none" if want is None else (_show(want) if not isinstance(want, bool) else
                                                  ("yes" if want else "no"))
            raise ConfigError(f"{shown} disagrees with the checkpoint ({m.model_type}: {dest} {theirs}); drop the "
                              "flag or load the right checkpoint")
        checked.append(flag)
    return checked


def default_changes(cfg: TrainConfig) -> str | None:
    """The one start-up line naming each Megatron-LM default in effect that differs from shardkit's behaviour before
    issue 41 (none when every such flag was given another value)."""
    r, o = cfg.run, cfg.optimizer
    parts = []
    if r.attention_dropout == 0.1:
        parts.append("--attention-dropout 0.1")
    if r.hidden_dropout == 0.1:
        parts.append("--hidden-dropout 0.1")
    if parts:
        parts = [", ".join(parts) + " (no dropout before)"]
    if o.weight_decay == 0.01:
        parts.append("--weight-decay 0.01 (0.1 before)")
    if not parts:
        return None
    return ("defaults: Megatron-LM's, which differ from earlier shardkit releases: " + "; ".join(parts)
            + "; pass the old values to keep the old behaviour")
