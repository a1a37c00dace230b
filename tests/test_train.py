"""continue-pretrain on gloo: parallel layouts equal one process, resume is exact, a resharded resume continues the
run, and the result exports to HF. Every run is a real `shardkit continue-pretrain`, its ranks forked as torchrun
starts them (tests/launcher.py); the data-parallel case goes through torchrun itself."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from checkpoint.reader import Checkpoint
from tests.launcher import launch  # noqa: F401 - the trainer tests' launcher (imported from here by others)

COMMON = ["--seq-length", "32", "--micro-batch-size", "1", "--global-batch-size", "4", "--lr", "1e-3",
          "--lr-warmup-iters", "1", "--min-lr", "1e-4", "--clip-grad", "1.0", "--seed", "7",
          "--attention-dropout", "0", "--hidden-dropout", "0"]


def losses(save: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (save / "metrics.jsonl").read_text().splitlines()]


def real_rows(ck: Checkpoint) -> dict[str, torch.Tensor]:
    """Weights and optimizer state without the vocab padding rows (which depend on TP)."""
    vocab = ck.config.vocab_size
    out = {}
    for name, t in ck.state_dict().items():
        out[name] = t[:vocab] if ck.entry(name).rule == "vocab" else t
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from tests.corpus import tiny_llama_setup

    return tiny_llama_setup(tmp_path_factory.mktemp("train"))


@pytest.fixture(scope="module")
def baseline(setup):
    out = setup / "base"
    launch(1, "--load", str(setup / "ck"), "--data-path", str(setup / "data"), "--save", str(out),
           "--train-iters", "5", *COMMON)
    return out


@pytest.mark.parametrize("nproc,layout", [(2, ["--tp", "2", "--sequence-parallel"]), (2, ["--pp", "2"]),
                                          (2, ["--pp", "2", "--vpp", "2"]), (2, []), (4, ["--tp", "2", "--pp", "2"]),
                                          (2, ["--pp", "2", "--decoder-first-pipeline-num-layers", "1"]),
                                          # uneven and interleaved, the last model chunk holds only the loss
                                          (2, ["--pp", "2", "--vpp", "2", "--pipeline-model-parallel-layout",
                                               "Et|t|tt|L"])],
                         ids=["tp2-sp", "pp2", "pp2-vpp2", "dp2", "tp2pp2", "pp2-first1", "pp2-vpp2-layout"])
def test_layouts_equal_one_process(setup, baseline, nproc, layout):
    out = setup / ("run-" + "-".join(layout).replace("--", "") + f"-n{nproc}")
    # data parallel through real torchrun (every other launch forks ranks as torchrun starts them: tests/launcher.py)
    launch(nproc, "--load", str(setup / "ck"), "--data-path", str(setup / "data"), "--save", str(out),
           "--train-iters", "5", *COMMON, *layout, real=not layout)
    want, got = losses(baseline), losses(out)
    assert len(got) == 5
    np.testing.assert_allclose(got, want, rtol=1e-5)
    a, b = real_rows(Checkpoint(baseline / "iter_0000005")), real_rows(Checkpoint(out / "iter_0000005"))
    assert set(a) == set(b)
    for name in a:  # relative error of each tensor, ||a - b|| / ||a||
        assert (a[name] - b[name]).norm().item() <= 1e-5 * a[name].norm().item(), name
    # the weights moved
    src = real_rows(Checkpoint(setup / "ck" / "iter_0000000"))
    assert not torch.equal(src["decoder.layers.mlp.linear_fc1.weight"], b["decoder.layers.mlp.linear_fc1.weight"])


def test_exact_resume(setup):
    straight, split = setup / "straight", setup / "split"
    args = ["--load", str(setup / "ck"), "--data-path", str(setup / "data"), "--train-iters", "6", *COMMON]
    launch(2, *args, "--save", str(straight), "--pp", "2")
    # the split run saves in the background (--async-save) after every iteration: the same bytes as a blocking save
    launch(2, *args, "--save", str(split), "--pp", "2", "--exit-interval", "3", "--async-save", "--save-interval", "1")
    assert (split / "latest").read_text().strip() == "iter_0000003"
    assert sorted(p.name for p in split.glob("iter_*")) == ["iter_0000001", "iter_0000002", "iter_0000003"]
    launch(2, "--load", str(split), "--data-path", str(setup / "data"), "--train-iters", "6", *COMMON[:],
           "--save", str(split), "--pp", "2", "--async-save")
    assert losses(split) == losses(straight)  # bitwise: 3 before the save, 3 after
    rec = json.loads((split / "metrics.jsonl").read_text().splitlines()[-1])
    assert rec["iteration"] == 6 and rec["tokens_per_s"] > 0 and rec["mem_gib"] > 0
    assert rec["tflops_per_device_megatron"] < rec["tflops_per_device_torchtitan"]
    a, b = Checkpoint(straight / "iter_0000006"), Checkpoint(split / "iter_0000006")
    for name in a.tensors:
        assert torch.equal(a.read(name), b.read(name)), name
    state = json.loads((split / "iter_0000006" / "train_state.json").read_text())
    assert state["iteration"] == 6 and state["consumed_samples"] == 24


@pytest.fixture(scope="module")
def straight6(setup):
    """The one-process run of 6 iterations that the resharded resumes follow."""
    out = setup / "rs-straight"
    launch(1, "--load", str(setup / "ck"), "--data-path", str(setup / "data"), "--train-iters", "6", *COMMON,
           "--save", str(out))
    return out


def test_resharded_resume(setup, straight6):
    from shardkit.cli import main as cli

    straight, first = straight6, setup / "rs-first"
    args = ["--data-path", str(setup / "data"), "--train-iters", "6", *COMMON]
    launch(2, "--load", str(setup / "ck"), *args, "--save", str(first), "--tp", "2", "--exit-interval", "3")
    moved = setup / "rs-moved"
    assert cli(["reshard", str(first), str(moved), "--tp", "1", "--pp", "2", "--quiet"]) == 0
    launch(2, "--load", str(moved), *args, "--save", str(moved), "--pp", "2")
    got = losses(first) + losses(moved)
    np.testing.assert_allclose(got, losses(straight), rtol=1e-5)


def test_uneven_pipeline_resumes_after_reshard(setup, straight6):
    """Trained at PP 4 with uneven stages (0 | 2 | 1 | 1 decoder layers: the first stage only embeds), then resharded
    to an even PP 2 (`shardkit reshard`, weights and optimizer state) and resumed there: the losses follow the
    straight one-process run and so do the final weights, and the checkpoints record their splits."""
    from checkpoint.layout import PipelineSplit
    from shardkit.cli import main as cli

    straight, first = straight6, setup / "up-first"
    args = ["--data-path", str(setup / "data"), "--train-iters", "6", *COMMON]
    launch(4, "--load", str(setup / "ck"), *args, "--save", str(first), "--pp", "4",
           "--pipeline-model-parallel-layout", "E|tt|t|tL", "--exit-interval", "3")
    ck = Checkpoint(first / "iter_0000003")
    assert ck.manifest.layout.split == PipelineSplit(layout="E|tt|t|tL")
    moved = setup / "up-moved"
    assert cli(["reshard", str(first), str(moved), "--pp", "2", "--quiet"]) == 0
    assert Checkpoint(moved / "iter_0000003").manifest.layout.split is None
    launch(2, "--load", str(moved), *args, "--save", str(moved), "--pp", "2")
    np.testing.assert_allclose(losses(first) + losses(moved), losses(straight), rtol=1e-5)
    a, b = real_rows(Checkpoint(straight / "iter_0000006")), real_rows(Checkpoint(moved / "iter_0000006"))
    assert set(a) == set(b)
    for name in a:
        assert (a[name] - b[name]).norm().item() <= 1e-5 * a[name].norm().item(), name


def test_bad_inputs(setup, tmp_path):
    base = ["--load", str(setup / "ck"), "--data-path", str(setup / "data"), "--train-iters", "2", *COMMON]
    cases = [
        (["--tp", "2"], "world size 1 is not divisible by --tp 2"),
        (["--micro-batch-size", "2", "--global-batch-size", "3"], "--global-batch-size 3 is not divisible"),
        (["--num-layers", "7"], "--num-layers 7 disagrees with the checkpoint"),
    ]
    for extra, msg in cases:
        r = launch(1, *base, *extra, check=False)
        assert r.returncode != 0 and msg in r.stderr, (extra, r.stderr[-2000:])
    r = launch(1, "--load", str(setup / "ck"), "--data-path", str(tmp_path / "nope"), "--train-iters", "2", *COMMON,
               check=False)
    assert r.returncode != 0 and "nope" in r.stderr
    # all ranks exit non-zero (no hang) when the error is found on every rank
    r = launch(2, *base, "--global-batch-size", "3", check=False)
    assert r.returncode != 0 and "not divisible" in r.stderr


@pytest.mark.parametrize("nproc,extra", [(1, ["--recompute-granularity", "full"]),
                                         (2, ["--pp", "2", "--recompute-granularity", "selective"])],
                         ids=["full-1proc", "selective-pp2"])
def test_recompute_changes_nothing(setup, baseline, nproc, extra):
    """Activation recompute re-runs the same kernels on the same inputs: the same losses and weights as without."""
    out = setup / ("recompute-" + extra[-1])
    launch(nproc, "--load", str(setup / "ck"), "--data-path", str(setup / "data"), "--save", str(out),
           "--train-iters", "5", *COMMON, *extra)
    np.testing.assert_allclose(losses(out), losses(baseline), rtol=1e-6)
    a, b = real_rows(Checkpoint(baseline / "iter_0000005")), real_rows(Checkpoint(out / "iter_0000005"))
    for name in a:
        assert (a[name] - b[name]).norm().item() <= 1e-6 * a[name].norm().item(), name


def test_bf16_mixed_precision(setup, baseline):
    """--bf16: bf16 weights and activations, fp32 main params, gradients and moments. The losses follow the fp32
    run within bf16 rounding, the checkpoint holds bf16 weights and fp32 optimizer state, and DP=2 agrees with one
    process (gradients are reduced in fp32)."""
    one, two = setup / "bf16-1", setup / "bf16-dp2"
    args = ["--load", str(setup / "ck"), "--data-path", str(setup / "data"), "--train-iters", "5", *COMMON, "--bf16"]
    launch(1, *args, "--save", str(one))
    launch(2, *args, "--save", str(two))
    np.testing.assert_allclose(losses(one), losses(baseline), rtol=2e-2)
    np.testing.assert_allclose(losses(two), losses(one), rtol=1e-2)
    ck = Checkpoint(one / "iter_0000005")
    w = "decoder.layers.mlp.linear_fc1.weight"
    assert ck.read(w).dtype == torch.bfloat16
    assert ck.read("optimizer.state.fp32_param." + w).dtype == torch.float32
    # the bf16 weights are the fp32 main params rounded
    assert torch.equal(ck.read(w), ck.read("optimizer.state.fp32_param." + w).to(torch.bfloat16))
