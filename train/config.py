"""continue-pretrain's configuration: one dataclass per concern, filled from Megatron-LM's flag names, a TOML file
with the same keys (flag names with underscores, e.g. `tensor_model_parallel_size = 2` or `lr = 3e-4`), and the
command line, which wins over the file."""
from __future__ import annotations

import argparse
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path

from checkpoint.errors import ConfigError

from .fp8 import FP8Config, validate_config as validate_fp8
from .optim import OptimizerConfig


@dataclass(frozen=True)
class ParallelConfig:
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    sequence_parallel: bool = False
    cp: int = 1  # context parallel (zigzag chunks, train/parallel/context.py)
    cp_comm_type: str = "p2p"  # p2p (ring attention) | all_gather (K/V)
    ep: int = 1  # expert parallel, inside data parallel x context parallel (train/parallel/expert.py)
    etp: int | None = None  # expert tensor parallel: only = tp (Megatron's default) is implemented


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
    train_iters: int = 100
    lr_warmup_iters: int = 0
    lr_decay_iters: int | None = None
    lr_decay_style: str = "cosine"
    lr_wsd_decay_iters: int = 0
    exit_interval: int = 0  # stop (saving first) after an iteration divisible by this; the schedule is unchanged


@dataclass(frozen=True)
class CheckpointConfig:
    load: str = ""
    save: str = ""
    save_interval: int = 0  # 0: save at the end only
    no_load_optim: bool = False
    no_load_rng: bool = False
    async_save: bool = False
    skip_verify: bool = False  # skip Checkpoint.check of --load (chunks are still checksummed as read)


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
    distributed_timeout_minutes: float = 10.0
    # checks against the checkpoint's model config (Megatron passes the architecture as flags; ours come from it)
    num_layers: int | None = None
    hidden_size: int | None = None
    num_attention_heads: int | None = None
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
            "virtual_pipeline_model_parallel_size": ("parallel", "vpp"), "fp8": ("fp8", "fp8_format")}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Megatron-LM's flag names (short aliases where users know them). Defaults are None so that a TOML value is
    only overridden by flags actually given."""
    a = p.add_argument
    a("--config", help="TOML file with the same keys as the flags (underscores); flags win")
    a("--load", help="checkpoint to start from: a converted model (weights only) or a training checkpoint")
    a("--save", help="directory for training checkpoints")
    a("--data-path", "--data", dest="data_path", nargs="+", help="dataset prefixes, optionally weighted: 0.3 A 0.7 B")
    a("--split", help="train,valid,test proportions (default 969,30,1)")
    a("--tensor-model-parallel-size", "--tp", dest="tensor_model_parallel_size", type=int)
    a("--pipeline-model-parallel-size", "--pp", dest="pipeline_model_parallel_size", type=int)
    a("--virtual-pipeline-model-parallel-size", "--vpp", dest="virtual_pipeline_model_parallel_size", type=int)
    a("--sequence-parallel", action="store_true", default=None)
    a("--context-parallel-size", "--cp", dest="context_parallel_size", type=int,
      help="split each sequence over N ranks (zigzag: 2N chunks, --seq-length divisible by 2N)")
    a("--cp-comm-type", choices=["p2p", "all_gather"], help="context parallel attention: K/V round a ring with "
                                                            "point-to-point sends (default) or all-gathered")
    a("--expert-model-parallel-size", "--ep", dest="expert_model_parallel_size", type=int,
      help="split the experts over N ranks of data parallel x context parallel (tokens move by all-to-all)")
    a("--expert-tensor-parallel-size", "--etp", dest="expert_tensor_parallel_size", type=int,
      help="tensor parallelism inside the experts: must equal --tp (the default)")
    a("--moe-router-load-balancing-type", choices=["aux_loss", "seq_aux_loss", "none"])
    a("--moe-aux-loss-coeff", type=float, help="load-balancing loss weight (default: the checkpoint's config)")
    a("--moe-router-bias-update-rate", type=float,
      help="DeepSeek-V3 aux-loss-free balancing: expert bias step per iteration (default 1e-3; 0 freezes it)")
    a("--mtp-loss-scaling-factor", type=float, help="weight of the MTP loss, averaged over depths (default 0.1)")
    a("--moe-router-dtype", choices=["fp32", "fp64"], help="dtype of the router logits and scores")
    a("--moe-token-dispatcher-type", choices=["alltoall", "allgather", "flex"],
      help="only alltoall (dropless) is implemented")
    a("--micro-batch-size", type=int)
    a("--global-batch-size", type=int)
    a("--seq-length", type=int)
    a("--reset-position-ids", action="store_true", default=None, help="packed documents: positions restart after EOD")
    a("--reset-attention-mask", action="store_true", default=None,
      help="packed documents: attention does not cross an EOD token")
    a("--eod-mask-loss", action="store_true", default=None, help="no loss at positions whose input is EOD")
    a("--eod-token-id", type=int, help="end-of-document token (default: the checkpoint's eos_token_id)")
    a("--train-iters", type=int)
    a("--lr", type=float)
    a("--min-lr", type=float)
    a("--lr-warmup-iters", type=int)
    a("--lr-decay-iters", type=int)
    a("--lr-decay-style", choices=["cosine", "linear", "constant", "wsd"])
    a("--lr-wsd-decay-iters", type=int)
    a("--weight-decay", type=float)
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
    a("--tensorboard-dir", "--log-dir", dest="log_dir",
      help="where metrics.jsonl and TensorBoard events go (default: the --save directory)")
    a("--peak-tflops", type=float, help="peak FLOP/s per device for MFU (default: known devices)")
    a("--distributed-timeout-minutes", type=float)
    a("--num-layers", type=int, help="check: must equal the checkpoint's")
    a("--hidden-size", type=int, help="check: must equal the checkpoint's")
    a("--num-attention-heads", type=int, help="check: must equal the checkpoint's")
    a("--check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad", action="store_true", default=None,
      help="stop before the optimizer step when a loss or the grad norm is NaN/inf on any rank (the default)")
    a("--no-check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad", action="store_false",
      default=None, help="train on through non-finite losses and grad norms (checkpoints still refuse NaN weights)")
    a("--wandb-project", help="Weights & Biases project: log the same metrics there (needs wandb; offline "
                              "without a network)")
    a("--wandb-exp-name", help="W&B run name")
    a("--wandb-save-dir", help="W&B files directory (default: <save>/wandb)")


def _field_of(key: str) -> tuple[str, str]:
    if key in _RENAMES:
        return _RENAMES[key]
    for sec, cls in _SECTIONS.items():
        if key in {f.name for f in fields(cls)}:
            return sec, key
    raise KeyError(key)


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
            values[sec][name] = v
    for key, v in vars(ns).items():
        if v is None or key in ("config", "command", "func"):
            continue
        try:
            sec, name = _field_of(key)
        except KeyError:
            continue
        values[sec][name] = v
    if "data_path" in values["data"]:
        values["data"]["data_path"] = tuple(str(x) for x in values["data"]["data_path"])
    try:
        return TrainConfig(**{s: cls(**values[s]) for s, cls in _SECTIONS.items()})
    except TypeError as e:
        raise ConfigError(f"continue-pretrain: {e}") from None


def validate(cfg: TrainConfig) -> None:
    """Errors that need no checkpoint and no process group."""
    d, s, c = cfg.data, cfg.schedule, cfg.checkpoint
    if not c.load:
        raise ConfigError("continue-pretrain: --load is required (a converted model or a training checkpoint)")
    if not d.data_path:
        raise ConfigError("continue-pretrain: --data-path is required (prefixes of .bin/.idx files)")
    for flag, v in (("--micro-batch-size", d.micro_batch_size), ("--global-batch-size", d.global_batch_size),
                    ("--seq-length", d.seq_length), ("--train-iters", s.train_iters)):
        if v < 1:
            raise ConfigError(f"continue-pretrain: {flag} must be >= 1, got {v}")
    if cfg.optimizer.lr < 0 or cfg.optimizer.min_lr < 0:
        raise ConfigError("continue-pretrain: --lr and --min-lr must be >= 0")
    from .parallel.context import COMM_TYPES, check_sequence

    check_sequence(d.seq_length, cfg.parallel.cp, cfg.parallel.tp, cfg.parallel.sequence_parallel)
    if cfg.parallel.cp_comm_type not in COMM_TYPES:
        raise ConfigError(f"--cp-comm-type {cfg.parallel.cp_comm_type!r}: expected one of {', '.join(COMM_TYPES)}")
    if cfg.run.transformer_impl not in (None, "local", "transformer_engine"):
        raise ConfigError(f"--transformer-impl {cfg.run.transformer_impl!r}: expected local or transformer_engine")
    if cfg.run.transformer_impl == "transformer_engine":
        from .te import check_installed

        check_installed()  # before any process group or checkpoint: one line naming the flag and the install
    validate_fp8(cfg.fp8)
    validate_moe(cfg)


def validate_moe(cfg: TrainConfig) -> None:
    m = cfg.moe
    if cfg.parallel.ep < 1:
        raise ConfigError(f"continue-pretrain: --expert-model-parallel-size must be >= 1, got {cfg.parallel.ep}")
    if cfg.parallel.etp is not None and cfg.parallel.etp != cfg.parallel.tp:
        raise ConfigError(f"--expert-tensor-parallel-size {cfg.parallel.etp}: the trainer splits experts like the "
                          f"dense layers (expert TP = --tp {cfg.parallel.tp}); drop the flag or set it to "
                          f"{cfg.parallel.tp}")
    if m.moe_token_dispatcher_type != "alltoall":
        raise ConfigError(f"--moe-token-dispatcher-type {m.moe_token_dispatcher_type}: only alltoall (dropless) is "
                          "implemented; use --moe-token-dispatcher-type alltoall")
    if m.moe_router_load_balancing_type not in ("aux_loss", "seq_aux_loss", "none"):
        raise ConfigError(f"--moe-router-load-balancing-type {m.moe_router_load_balancing_type!r}: expected aux_loss, "
                          "seq_aux_loss or none")
    if m.moe_router_dtype not in (None, "fp32", "fp64"):
        raise ConfigError(f"--moe-router-dtype {m.moe_router_dtype!r}: expected fp32 or fp64")
    for flag, v in (("--moe-aux-loss-coeff", m.moe_aux_loss_coeff), ("--moe-router-bias-update-rate",
                    m.moe_router_bias_update_rate), ("--mtp-loss-scaling-factor", m.mtp_loss_scaling_factor)):
        if v is not None and v < 0:
            raise ConfigError(f"continue-pretrain: {flag} must be >= 0, got {v}")
