"""The LR / weight-decay schedule is megatron-core's OptimizerParamScheduler to the last step: for every decay style,
warmup form and weight-decay style, the values continue-pretrain applies (flags -> train.config.run_length ->
train.optim.ParamScheduler) equal, as floats, those megatron-core's own scheduler gives when driven as Megatron-LM
drives it (tests/megatron_oracle.py schedule, in a subprocess), at every iteration, and across a resume
(state_dict / load_state_dict with the default check, --override-opt_param-scheduler and
--use-checkpoint-opt_param-scheduler). Also: the flag errors Megatron's arguments.py has, one line each."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from checkpoint.errors import ConfigError
from checkpoint.megatron import is_scheduler_state
from train.config import add_arguments, from_namespace, run_length
from train.optim import ParamScheduler, applied_at

BASE = {"global_batch_size": 4, "lr": 1e-3, "min_lr": 1e-4, "weight_decay": 0.05}


def case(**kw) -> dict:
    return dict(BASE, **kw)


# name -> Megatron-LM arguments (their flags are the same names with hyphens)
STRAIGHT = {
    "linear-warmup-iters": case(train_iters=20, lr_warmup_iters=3, lr_decay_style="linear"),
    "cosine-warmup-iters": case(train_iters=20, lr_warmup_iters=3, lr_decay_style="cosine"),
    "constant-warmup-iters": case(train_iters=12, lr_warmup_iters=3, lr_decay_style="constant"),
    "isr-warmup-iters": case(train_iters=20, lr_warmup_iters=3, lr_decay_style="inverse-square-root"),
    "isr-no-warmup": case(train_iters=12, lr_decay_style="inverse-square-root"),
    "cosine-no-warmup-min-lr-0": case(train_iters=9, lr_decay_style="cosine", min_lr=0.0),
    "cosine-decay-shorter-than-run": case(train_iters=20, lr_warmup_iters=2, lr_decay_iters=12,
                                          lr_decay_style="cosine"),
    "linear-decay-longer-than-run": case(train_iters=12, lr_warmup_iters=2, lr_decay_iters=30),
    **{f"wsd-{w}": case(train_iters=20, lr_warmup_iters=2, lr_decay_style="WSD", lr_wsd_decay_style=w,
                        lr_wsd_decay_iters=7) for w in ("exponential", "linear", "cosine", "minus_sqrt")},
    "wsd-samples": case(train_samples=70, lr_warmup_samples=6, lr_decay_style="WSD", lr_wsd_decay_style="cosine",
                        lr_wsd_decay_samples=21),
    "cosine-warmup-samples": case(train_samples=70, lr_warmup_samples=10, lr_decay_samples=50,
                                  lr_decay_style="cosine"),
    "linear-warmup-fraction-iters": case(train_iters=20, lr_warmup_fraction=0.15, lr_decay_iters=18),
    "cosine-warmup-fraction-samples": case(train_samples=66, lr_warmup_fraction=0.1, lr_decay_style="cosine"),
    "cosine-warmup-init": case(train_iters=16, lr_warmup_iters=4, lr_warmup_init=2e-4, lr_decay_style="cosine"),
    "wd-linear": case(train_iters=15, lr_warmup_iters=2, lr_decay_style="cosine", weight_decay_incr_style="linear",
                      start_weight_decay=0.01, end_weight_decay=0.1),
    "wd-cosine": case(train_iters=15, lr_warmup_iters=2, weight_decay_incr_style="cosine", start_weight_decay=0.0,
                      end_weight_decay=0.2),
    "wd-cosine-samples": case(train_samples=61, lr_warmup_samples=8, weight_decay_incr_style="cosine",
                              start_weight_decay=0.02, end_weight_decay=0.3),
}

COS = case(train_iters=16, lr_warmup_iters=3, lr_decay_style="cosine", weight_decay_incr_style="linear",
           start_weight_decay=0.01, end_weight_decay=0.1)
RESUME = {  # name -> (first run, iterations before the save, resumed run's arguments, mode, refused)
    "same-flags": (COS, 7, COS, "default", False),
    "min-lr-changed": (COS, 7, dict(COS, min_lr=0.0), "default", True),
    "warmup-changed": (COS, 7, dict(COS, lr_warmup_iters=0), "default", True),
    "wd-changed": (COS, 7, dict(COS, end_weight_decay=0.2), "default", True),
    "raised-train-iters": (COS, 7, dict(COS, train_iters=24), "default", True),
    "override": (COS, 7, dict(COS, train_iters=24, lr=2e-3, lr_decay_style="linear", end_weight_decay=0.2),
                 "override", False),
    "use-checkpoint": (COS, 7, dict(COS, train_iters=24, lr=2e-3, min_lr=0.0, lr_warmup_iters=1,
                                    lr_decay_style="linear", start_weight_decay=0.05, end_weight_decay=0.4,
                                    weight_decay_incr_style="cosine"), "use_checkpoint", False),
    "wsd-samples-override": (STRAIGHT["wsd-samples"], 9, dict(STRAIGHT["wsd-samples"], train_samples=90,
                                                               lr_wsd_decay_samples=30), "override", False),
    "fraction-use-checkpoint": (STRAIGHT["linear-warmup-fraction-iters"], 5,
                                dict(STRAIGHT["linear-warmup-fraction-iters"], lr_warmup_fraction=0.3),
                                "use_checkpoint", False),
}


def flags(args: dict) -> list[str]:
    out = []
    for k, v in args.items():
        out += [f"--{k.replace('_', '-')}", str(v)]
    return out


def config(args: dict, *extra: str):
    p = argparse.ArgumentParser()
    add_arguments(p)
    return from_namespace(p.parse_args(["--load", "ck", "--data-path", "d", *flags(args), *extra]))


def ours(args: dict, stop: int | None = None, sched: ParamScheduler | None = None, start: int = 0) -> dict:
    rl = run_length(config(args))
    sched = sched or ParamScheduler(rl.scheduler)
    out = {"iters": rl.train_iters, "lr": [], "wd": [], "sched": sched}
    for _ in range(start, rl.train_iters if stop is None else stop):
        out["lr"].append(sched.lr)
        out["wd"].append(sched.wd)
        sched.step(args["global_batch_size"])
    return out


@pytest.fixture(scope="module")
def megatron(tmp_path_factory):
    d = tmp_path_factory.mktemp("schedule")
    cases = [{"args": a, "resume": None} for a in STRAIGHT.values()]
    cases += [{"args": a, "resume": {"after": k, "args": b, "mode": mode}} for a, k, b, mode, _ in RESUME.values()]
    for i, case in enumerate(cases):
        case["out"] = str(d / f"out{i}.json")
    (d / "cases.json").write_text(json.dumps(cases))
    oracle = Path(__file__).with_name("megatron_oracle.py")
    r = subprocess.run([sys.executable, str(oracle), "schedule", str(d / "cases.json")], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    res = [json.loads(Path(case["out"]).read_text()) for case in cases]
    return dict(zip(list(STRAIGHT) + list(RESUME), res))


@pytest.mark.parametrize("name", list(STRAIGHT))
def test_straight_run_equals_megatron(megatron, name):
    args, want = STRAIGHT[name], megatron[name]
    got = ours(args)
    assert got["iters"] == want["iters"]
    assert got["lr"] == want["lr"]  # exact: the same float operations
    assert got["wd"] == want["wd"]
    s = run_length(config(args)).scheduler
    for k in range(1, got["iters"] + 1):  # the pure function of the iteration agrees with the stepped scheduler
        assert applied_at(k, args["global_batch_size"], s) == (got["lr"][k - 1], got["wd"][k - 1])
    if args.get("lr_warmup_iters") or args.get("lr_warmup_samples") or args.get("lr_warmup_fraction"):
        assert got["lr"][0] == args.get("lr_warmup_init", 0.0)  # step(0): the first iteration takes the init LR
    assert len(set(got["lr"])) > 2  # the schedule moves


@pytest.mark.parametrize("name", list(RESUME))
def test_resume_equals_megatron(megatron, name):
    first, after, second, mode, refused = RESUME[name]
    want = megatron[name]
    got = ours(first, stop=after)
    assert got["lr"] == want["lr"] and got["wd"] == want["wd"]
    sd = json.loads(json.dumps(got["sched"].state_dict()))
    assert sd == want["state_dict"] and is_scheduler_state(sd)  # Megatron's keys and values (torch_dist export)
    extra = {"override": ["--override-opt_param-scheduler"],
             "use_checkpoint": ["--use-checkpoint-opt-param-scheduler"]}.get(mode, [])
    new = ParamScheduler(run_length(config(second, *extra)).scheduler)
    c = config(second, *extra).schedule
    if refused:
        assert want["refused"] is not None  # megatron-core refuses too
        with pytest.raises(ConfigError) as e:
            new.load_state_dict(sd, override=c.override_opt_param_scheduler,
                                use_checkpoint=c.use_checkpoint_opt_param_scheduler, source="ck/train_state.json")
        msg = str(e.value)
        assert "\n" not in msg and "--override-opt_param-scheduler" in msg and "--use-checkpoint-opt_param-scheduler" \
            in msg and "ck/train_state.json" in msg
        return
    assert want["refused"] is None, want["refused"]
    notes = new.load_state_dict(sd, override=c.override_opt_param_scheduler,
                                use_checkpoint=c.use_checkpoint_opt_param_scheduler, source="ck/train_state.json",
                                num_steps=after * first["global_batch_size"] if mode == "override" else None)
    if mode != "default":
        assert notes
    cont = ours(second, sched=new, start=after)
    assert cont["lr"] == want["resumed"]["lr"]
    assert cont["wd"] == want["resumed"]["wd"]
    assert len(cont["lr"]) == cont["iters"] - after > 0


def test_refusal_names_field_values_and_flags():
    first = ours(COS, stop=5)["sched"]
    new = ParamScheduler(run_length(config(dict(COS, min_lr=3e-5))).scheduler)
    with pytest.raises(ConfigError, match=r"min_lr 3e-05 from --min-lr differs from 0.0001 in ck/x.json; pass "
                                          r"--override-opt_param-scheduler .* or --use-checkpoint-opt_param-scheduler"):
        new.load_state_dict(first.state_dict(), source="ck/x.json")


@pytest.mark.parametrize("extra,msg", [
    (["--train-iters", "5", "--train-samples", "20"], "--train-iters and --train-samples: give one"),
    (["--train-iters", "5", "--lr-warmup-samples", "4"], "--lr-warmup-samples 4: sample-based"),
    (["--train-iters", "5", "--lr-decay-samples", "4"], "--lr-decay-samples 4: sample-based"),
    (["--train-samples", "20", "--lr-warmup-iters", "1"], "--lr-warmup-iters 1: iteration-based"),
    (["--train-samples", "20", "--lr-decay-iters", "3"], "--lr-decay-iters 3: iteration-based"),
    (["--train-iters", "5", "--lr-warmup-iters", "1", "--lr-warmup-fraction", "0.1"],
     "--lr-warmup-fraction 0.1 and --lr-warmup-iters 1: give one"),
    (["--train-samples", "2"], "--train-samples 2: fewer than one --global-batch-size"),
    (["--train-iters", "5", "--lr-warmup-iters", "5"], "must be shorter than the decay"),
    (["--train-iters", "5", "--lr-decay-style", "WSD"], "--lr-decay-style WSD needs --lr-wsd-decay-iters"),
    (["--train-iters", "5", "--start-weight-decay", "0.1"], "--start-weight-decay 0.1: needs --weight-decay-incr"),
    (["--train-iters", "5", "--weight-decay-incr-style", "linear", "--start-weight-decay", "0.1"],
     "--weight-decay-incr-style linear needs --end-weight-decay"),
    (["--train-iters", "5", "--weight-decay-incr-style", "linear", "--start-weight-decay", "0.2",
      "--end-weight-decay", "0.1"], "--end-weight-decay 0.1 is below --start-weight-decay 0.2"),
    (["--min-lr", "0.01"], "--min-lr 0.01 exceeds --lr"),
    (["--lr-warmup-init", "0.01", "--lr-warmup-iters", "2"], "--lr-warmup-init 0.01 exceeds --lr"),
    (["--override-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler"], "give at most one"),
])
def test_flag_errors(extra, msg):
    p = argparse.ArgumentParser()
    add_arguments(p)
    cfg = from_namespace(p.parse_args(["--load", "ck", "--data-path", "d", "--global-batch-size", "4", "--lr", "1e-3",
                                       *extra]))
    with pytest.raises(ConfigError, match=msg.replace("(", r"\(")) as e:
        run_length(cfg)
    assert "\n" not in str(e.value)


def test_defaults_and_spellings():
    rl = run_length(config({"global_batch_size": 4}))
    assert rl.train_iters == 100 and rl.train_samples == 400
    s = rl.scheduler
    assert (s.lr_decay_style, s.lr_decay_steps, s.lr_warmup_steps, s.init_lr) == ("linear", 400, 0, 0.0)
    # Megatron-LM's --weight-decay default 0.01 (issue 41)
    assert (s.start_wd, s.end_wd, s.wd_incr_steps, s.wd_incr_style) == (0.01, 0.01, 400, "constant")
    assert run_length(config({"global_batch_size": 4, "lr_decay_style": "wsd", "lr_wsd_decay_iters": 3})) \
        .scheduler.lr_decay_style == "WSD"
    rl = run_length(config({"global_batch_size": 8, "train_samples": 100, "lr_warmup_fraction": 0.25}))
    assert rl.train_iters == 12 and rl.train_samples == 100 and rl.scheduler.lr_warmup_steps == 25.0
