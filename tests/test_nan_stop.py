"""Training never commits a non-finite state (issue 14): with --check-for-nan-in-loss-and-grad (the default, as in
Megatron-LM) a NaN/inf loss or grad norm on any rank stops the run before that optimizer step, with one line naming
the iteration, the ranks and the checkpoint to resume from; `latest` stays on the last finite checkpoint. With the
check off, the save path still refuses to commit NaN weights.

`--lr 1e8 --clip-grad 0` on the tiny LLaMA: iteration 1 is finite (grad norm ~5), the update it applies makes
iteration 2's gradients NaN."""
from __future__ import annotations

import math
import re

import torch

from checkpoint.reader import Checkpoint
from tests.test_train import launch, setup  # noqa: F401  (the module fixture: tiny LLaMA + corpus)

HUGE_LR = ["--seq-length", "32", "--micro-batch-size", "1", "--global-batch-size", "4", "--lr", "1e8",
           "--clip-grad", "0", "--seed", "7", "--train-iters", "4", "--save-interval", "1",
           "--attention-dropout", "0", "--hidden-dropout", "0"]


def _errors(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("shardkit: error:")]


def _assert_stopped_after_first(save, r, ranks: str) -> None:
    assert r.returncode != 0, r.stdout[-2000:]
    errs = _errors(r.stderr)
    assert errs and len(set(errs)) == 1, r.stderr[-4000:]  # one line (the same on every rank)
    line = errs[0]
    assert line.startswith("shardkit: error: iteration 2: grad norm nan"), line
    assert f"non-finite gradients on {ranks}" in line and "stopped before its optimizer step" in line, line
    assert "lower --lr" in line and f"resume from the last checkpoint {save / 'iter_0000001'}" in line, line
    # nothing saved after the last finite iteration; latest still points at it
    assert sorted(p.name for p in save.glob("iter_*")) == ["iter_0000001"], list(save.iterdir())
    assert (save / "latest").read_text().strip() == "iter_0000001"
    ck = Checkpoint(save / "iter_0000001")
    assert all(bool(torch.isfinite(t).all()) for t in ck.state_dict().values())


def test_nan_stops_one_process(setup, tmp_path):  # noqa: F811
    save = tmp_path / "run"
    r = launch(1, "--load", str(setup / "ck"), "--data-path", str(setup / "data"), "--save", str(save), *HUGE_LR,
               check=False)
    assert "Traceback" not in r.stderr, r.stderr[-4000:]
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr[-4000:]
    _assert_stopped_after_first(save, r, "rank 0")
    assert re.search(r"^iteration 1/4 .*grad norm 5\.", r.stdout, re.M), r.stdout  # a real, finite first step


def test_nan_stops_tensor_parallel(setup, tmp_path):  # noqa: F811
    save = tmp_path / "run"
    r = launch(2, "--load", str(setup / "ck"), "--data-path", str(setup / "data"), "--save", str(save), *HUGE_LR,
               "--tp", "2", check=False)
    _assert_stopped_after_first(save, r, "ranks 0, 1")


def test_check_off_still_never_saves_nan_weights(setup, tmp_path):  # noqa: F811
    """--no-check-for-nan-in-loss-and-grad applies the NaN step; the next save is refused, naming a tensor."""
    save = tmp_path / "run"
    r = launch(1, "--load", str(setup / "ck"), "--data-path", str(setup / "data"), "--save", str(save), *HUGE_LR,
               "--no-check-for-nan-in-loss-and-grad", check=False)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr[-4000:]
    errs = _errors(r.stderr)
    assert len(errs) == 1, r.stderr[-4000:]
    assert re.match(r"shardkit: error: iteration 2: \d+ non-finite values \([\w. ]+: \d+ on rank 0\); "
                    "checkpoint not saved", errs[0]), errs[0]
    assert re.search(r"^iteration 2/4 .*grad norm nan", r.stdout, re.M), r.stdout  # it did train on
    assert sorted(p.name for p in save.glob("iter_*")) == ["iter_0000001"]
    assert (save / "latest").read_text().strip() == "iter_0000001"


def test_loss_and_grad_flags_name_the_check(tmp_path):
    """The decision itself, on one rank without a process group: a NaN loss, an inf grad norm, and the check off."""
    from types import SimpleNamespace

    import pytest

    from train.loop import NonFiniteError, Trainer

    def trainer(check: bool, grads: torch.Tensor):
        t = Trainer.__new__(Trainer)
        t.cfg = SimpleNamespace(run=SimpleNamespace(check_for_nan_in_loss_and_grad=check),
                                checkpoint=SimpleNamespace(save=str(tmp_path / "none")))
        t.dims = SimpleNamespace(world=1, dp=1, tp=1, cp=1)
        t.groups = SimpleNamespace(rank=0)
        t.opt = SimpleNamespace(buffer=grads)
        t.num_micro, t.iteration, t.pending_save, t.src = 2, 6, None, tmp_path / "ck"
        return t

    finite = torch.ones(4)
    with pytest.raises(NonFiniteError, match=r"^iteration 7: loss nan on rank 0; stopped before its optimizer step.* "
                                             r"restart from .*ck \(no checkpoint in .*none yet\)"):
        trainer(True, finite)._loss_checked(torch.tensor(float("nan")), 1.0)
    with pytest.raises(NonFiniteError, match=r"^iteration 7: grad norm inf \(non-finite gradients on rank 0\);"):
        trainer(True, torch.tensor([1.0, float("inf")]))._loss_checked(torch.tensor(3.0), float("inf"))
    assert trainer(True, finite)._loss_checked(torch.tensor(3.0), 1.0) == 1.5  # mean over the 2 micro-batches
    assert math.isnan(trainer(False, finite)._loss_checked(torch.tensor(float("nan")), float("nan")))  # trains on
