"""Resume habits are Megatron-LM's, with real `shardkit continue-pretrain` runs (one process, CPU):

- the LR/WD scheduler state is in train_state.json (OptimizerParamScheduler.state_dict's keys); a command line whose
  schedule differs from it is refused by default, one line naming the field, both values and the two flags;
- raising --train-iters to continue a finished run: with --override-opt_param-scheduler (the command line's
  schedule) or --use-checkpoint-opt_param-scheduler (the checkpoint's) the continued run IS the straight run.

"The same run" here: the straight run is started from the same converted model with the final --train-iters (4) and
every other flag equal, --lr-decay-iters 4 in both (so the LR of every iteration is the same; the weight decay is
constant, so the weight-decay horizon, which follows --train-iters, changes nothing), and the dataset built for 8 or
16 samples is one epoch of the same shuffled data either way (asserted below), so the first run's 8 samples are the
straight run's first 8. Then the losses, and the LR logged for each iteration, are bitwise equal.
"""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from tests.test_train import COMMON, launch, losses, setup  # noqa: F401  (setup: the module's fixture)
from train.optim import SchedulerConfig, applied_at


def _run(setup, *args, check=True):  # noqa: F811
    return launch(1, "--data-path", str(setup / "data"), *COMMON, *args, check=check)


def lrs(save) -> list[float]:
    return [json.loads(line)["lr"] for line in (save / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(setup):  # noqa: F811
    straight, first = setup / "rs-straight4", setup / "rs-first2"
    _run(setup, "--load", str(setup / "ck"), "--save", str(straight), "--train-iters", "4", "--lr-decay-iters", "4")
    _run(setup, "--load", str(setup / "ck"), "--save", str(first), "--train-iters", "2", "--lr-decay-iters", "4")
    return straight, first


def test_one_epoch_either_way(setup):  # noqa: F811
    """The premise of "the same run": the dataset for 8 and for 16 samples starts with the same samples."""
    from train.data.order import DataConfig, build_datasets

    dc = DataConfig(paths=(str(setup / "data"),), seq_length=32, seed=7)
    small, _ = build_datasets(dc, 8, 0)
    big, _ = build_datasets(dc, 16, 0)
    assert small.num_epochs == big.num_epochs == 1
    assert all(np.array_equal(small[i], big[i]) for i in range(8))


def test_schedule_logged_is_megatrons(runs):
    straight, first = runs
    state = json.loads((first / "iter_0000002" / "train_state.json").read_text())
    assert state["scheduler"] == {"max_lr": 1e-3, "min_lr": 1e-4, "lr_warmup_steps": 4, "lr_decay_steps": 16,
                                  "lr_decay_style": "linear", "num_steps": 8, "start_wd": 0.01, "end_wd": 0.01,
                                  "wd_incr_steps": 8, "wd_incr_style": "constant"}
    s = SchedulerConfig(max_lr=1e-3, min_lr=1e-4, lr_warmup_steps=4, lr_decay_steps=16)  # the flags of COMMON
    want = [applied_at(k, 4, s)[0] for k in (1, 2, 3, 4)]
    assert want[0] == 0.0 and want[1] == 1e-3  # step(0): warmup from 0, the peak at the end of the warmup
    assert lrs(straight) == want  # the LR applied to each iteration (Megatron's log line shows the next one)


def test_raised_train_iters_refused_by_default(setup, runs):  # noqa: F811
    _, first = runs
    r = _run(setup, "--load", str(first), "--train-iters", "4", "--lr-decay-iters", "4", check=False)
    err = r.stderr.strip().splitlines()
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert ("wd_incr_steps 16 samples from --train-iters/--train-samples differs from 8 samples in "
            f"{first / 'iter_0000002' / 'train_state.json'}") in err[-1]
    assert "--override-opt_param-scheduler" in err[-1] and "--use-checkpoint-opt_param-scheduler" in err[-1]


@pytest.mark.parametrize("mode", ["override", "use-checkpoint", "no-scheduler-state"])
def test_raised_train_iters_continues_the_straight_run(setup, runs, mode):  # noqa: F811
    straight, first = runs
    out = setup / f"rs-continued-{mode}"
    shutil.copytree(first, out)
    extra = {"override": ["--override-opt_param-scheduler"],
             # the checkpoint's schedule wins over a command line that says otherwise
             "use-checkpoint": ["--use-checkpoint-opt-param-scheduler", "--lr", "5e-3", "--lr-warmup-iters", "0"],
             "no-scheduler-state": []}[mode]
    if mode == "no-scheduler-state":  # what an older shardkit saved instead of the scheduler's state
        ts = out / "iter_0000002" / "train_state.json"
        state = json.loads(ts.read_text())
        state["scheduler"] = {"lr": 1e-3, "min_lr": 1e-4, "warmup_iters": 1, "decay_iters": 4, "style": "cosine",
                              "wsd_decay_iters": 0}
        ts.write_text(json.dumps(state))
    r = _run(setup, "--load", str(out), "--save", str(out), "--train-iters", "4", "--lr-decay-iters", "4", *extra)
    assert losses(out) == losses(straight)  # bitwise: 2 iterations before the save, 2 after
    assert lrs(out) == lrs(straight)
    state = json.loads((out / "iter_0000004" / "train_state.json").read_text())
    assert state["iteration"] == 4 and state["consumed_samples"] == 16 and state["scheduler"]["num_steps"] == 16
    # the process RNGs (seeded as Megatron-LM's _set_random_seed, restored on resume) as the straight run's
    assert state["rng"] == json.loads((straight / "iter_0000004" / "train_state.json").read_text())["rng"]
    if mode == "use-checkpoint":
        assert "max_lr 0.001 from" in r.stdout and "(the command line's 0.005 ignored)" in r.stdout
        assert state["scheduler"]["wd_incr_steps"] == 8  # the checkpoint's
    if mode == "no-scheduler-state":
        assert "holds no LR/WD scheduler state" in r.stdout


def test_changed_data_still_refused(setup, runs):  # noqa: F811
    _, first = runs
    r = _run(setup, "--load", str(first), "--train-iters", "4", "--lr-decay-iters", "4",
             "--override-opt_param-scheduler", "--split", "90,10,0", check=False)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "the dataset differs" in r.stderr and "--override-data-state" in r.stderr
