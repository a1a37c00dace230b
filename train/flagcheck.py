"""Flag values that parse but mean nothing (issue 34): NaN, inf, negative or out-of-range numbers for flags whose
meaning needs a finite value in a range. argparse's `type=float` takes "nan" and "inf"; each is one line here naming
the flag, before anything is loaded or launched.

check_train_values: every float of the trainer's configuration (flags and --config TOML alike) is finite, and the
ones with a range are inside it (--lr, --min-lr >= 0; --adam-beta1/2 in [0, 1); --adam-eps > 0; --clip-grad >= 0,
0 disabling clipping as in Megatron; --weight-decay >= 0; --distributed-timeout-minutes in (0, a year]; ...).
check_timeout_minutes and check_tolerance: the same for the CLI's own flags (the converters' timeout, verify's
--tolerance). check_train_outputs: continue-pretrain's --save and --tensorboard-dir against --load and the data files
(data_files: what the trainer reads of --data-path). `shardkit continue-pretrain` (shardkit/cli.py) and `shardkit
launch` (plan/launch.py, on the command line it writes) run both checks: they live with the trainer, below both.
"""
from __future__ import annotations

import dataclasses
import math
import os

from checkpoint.errors import ConfigError, ShardkitError

MAX_TIMEOUT_MINUTES = 365 * 24 * 60  # a collective that may wait longer than a year waits forever: refused


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_timeout_minutes(value, flag: str = "--distributed-timeout-minutes") -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_TIMEOUT_MINUTES:
        raise ConfigError(f"{flag} {value}: expected minutes > 0 and at most {MAX_TIMEOUT_MINUTES:,} (a year)")


def check_tolerance(value, flag: str = "--tolerance") -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value >= 0):
        raise ConfigError(f"{flag} {value}: expected a finite number >= 0 (inf would pass any model)")


# field -> (lowest, highest, lowest allowed itself, highest allowed itself), for the fields that have a range
_RANGES = {
    "lr": (0.0, math.inf, True, False), "min_lr": (0.0, math.inf, True, False),
    "adam_beta1": (0.0, 1.0, True, False), "adam_beta2": (0.0, 1.0, True, False),
    "adam_eps": (0.0, math.inf, False, False), "clip_grad": (0.0, math.inf, True, False),
    "weight_decay": (0.0, math.inf, True, False), "start_weight_decay": (0.0, math.inf, True, False),
    "end_weight_decay": (0.0, math.inf, True, False), "lr_warmup_init": (0.0, math.inf, True, False),
    "lr_warmup_fraction": (0.0, 1.0, True, True), "peak_tflops": (0.0, math.inf, False, False),
    "init_method_std": (0.0, math.inf, True, False), "moe_aux_loss_coeff": (0.0, math.inf, True, False),
    "mtp_loss_scaling_factor": (0.0, math.inf, True, False),
    "moe_router_bias_update_rate": (0.0, math.inf, True, False),
    "attention_dropout": (0.0, 1.0, True, False), "hidden_dropout": (0.0, 1.0, True, False),
}


def check_train_values(cfg) -> None:
    """Every float field of the trainer's config (a dataclass of section dataclasses) finite and in its range."""
    for section in dataclasses.fields(cfg):
        obj = getattr(cfg, section.name)
        if not dataclasses.is_dataclass(obj):
            continue
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            if f.name == "distributed_timeout_minutes":
                check_timeout_minutes(v)
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                continue
            if not math.isfinite(v):
                raise ConfigError(f"{_flag(f.name)} {v}: expected a finite number")
            r = _RANGES.get(f.name)
            if r is None:
                continue
            lo, hi, lo_ok, hi_ok = r
            if v < lo or (v == lo and not lo_ok) or v > hi or (v == hi and not hi_ok):
                what = (f"{'[' if lo_ok else '('}{lo:g}, {'inf' if hi == math.inf else f'{hi:g}'}"
                        f"{']' if hi_ok else ')'}")
                raise ConfigError(f"{_flag(f.name)} {v:g}: expected a value in {what}")


def data_files(prefixes) -> list[tuple[str, str]]:
    """The files of --data-path prefixes (weights skipped): what the trainer reads of them."""
    out = []
    for p in prefixes or ():
        try:
            float(p)
            continue
        except ValueError:
            pass
        out += [("--data-path", f"{p}{ext}") for ext in (".bin", ".idx")]
    return out


def check_train_outputs(cfg) -> None:
    """continue-pretrain: --save (and --tensorboard-dir) against --load and the data files. --save equal to --load
    (or --load ROOT/iter_N --save ROOT) is resuming into the same root, which is allowed: a save writes new iteration
    directories beside the loaded one. A --save inside a data directory is fine; one that is or contains a data
    file is not."""
    from checkpoint.safety import check_output, inside_iteration, refuse_url

    load = cfg.checkpoint.load
    for flag, value in (("--load", load), ("--save", cfg.checkpoint.save), ("--tensorboard-dir", cfg.run.log_dir),
                        *(("--data-path", p) for p in cfg.data.data_path or ())):
        refuse_url(value, flag)  # a --config file's values too, not only the command line's
    inputs = [("--load", load)] + data_files(cfg.data.data_path)
    for flag, out in (("--save", cfg.checkpoint.save), ("--tensorboard-dir", cfg.run.log_dir)):
        if out:
            check_output(out, inputs, flag, same_ok=[load] if load else [])
    save = cfg.checkpoint.save
    it = inside_iteration(save) if save else None
    if it is not None:  # a save writes iterations beside each other in a root, never inside a committed one
        raise ShardkitError(f"--save {save}: {'is' if it == os.path.realpath(save) else 'lies inside'} the "
                            f"checkpoint iteration {it}; --save takes a checkpoint root (where iter_* and latest "
                            "go), e.g. its parent")
