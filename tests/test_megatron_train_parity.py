"""`shardkit continue-pretrain` trains as Megatron-LM would: the same run through megatron-core's own pieces
(tests/megatron_oracle.py train: GPTModel from our torch_dist export, BlendedMegatronDatasetBuilder(GPTDataset), DDP,
the distributed optimizer, OptimizerParamScheduler, Megatron-LM's train_step) sees the same token ids in every
micro-batch, takes the same LR and reaches the same loss every iteration (gradient accumulation, weight decay,
clipping, fp32)."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
    pytest.skip("megatron-core is not installed", allow_module_level=True)

from checkpoint.reader import Checkpoint  # noqa: E402
from tests.test_torch_dist import megatron_model  # noqa: E402
from tests.test_train import launch  # noqa: E402

ORACLE = Path(__file__).with_name("megatron_oracle.py")
ITERS, MBS, GBS, SEQ, SEED, SPLIT = 10, 2, 4, 32, 1234, "969,30,1"  # 2 micro-batches per step at DP 1
OPTIM = dict(lr=1e-3, min_lr=1e-4, weight_decay=0.1, clip_grad=0.5, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8)
SCHEDULES = {"constant": dict(lr_warmup_iters=0, lr_decay_style="constant"),
             "cosine-warmup": dict(lr_warmup_iters=3, lr_decay_style="cosine")}


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A tiny Llama as HF, converted to our format and exported to torch_dist (local-spec keys), and a corpus."""
    from shardkit.cli import main as cli
    from shardkit.demo import build_tiny_llama
    from train.data.indexed import write_indexed

    w = tmp_path_factory.mktemp("megatron_train")
    hf = build_tiny_llama(w / "hf", dtype=torch.float32, vocab_size=256, hidden_size=64, intermediate_size=128,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=64, rope_theta=10000.0, rope_scaling=None)
    assert cli(["convert", "hf-to-mcore", str(hf), str(w / "ck"), "--quiet", "--no-verify"]) == 0
    assert cli(["convert", "hf-to-mcore", str(hf), str(w / "td"), "--format", "torch_dist", "--key-naming", "local",
                "--quiet"]) == 0
    rng = np.random.default_rng(0)  # documents with a repeated pattern, so the loss moves
    docs = [np.tile(rng.integers(3, 250, size=int(rng.integers(3, 9))), 12)[: int(rng.integers(20, 90))]
            for _ in range(200)]
    write_indexed(w / "corpus", docs, np.uint16)
    return w


def ours(work: Path, name: str, sched: dict) -> tuple[list[dict], list[list]]:
    """Our run's metrics.jsonl rows, and the micro-batches our data pipeline gives it (train/data/, the trainer's
    own dataset and sampler code with the same flags)."""
    from train.data.order import DataConfig, build_datasets
    from train.data.sampler import micro_batches

    out = work / f"ours-{name}"
    flags = ["--load", str(work / "ck"), "--data-path", str(work / "corpus"), "--log-dir", str(out),
             "--train-iters", str(ITERS), "--micro-batch-size", str(MBS), "--global-batch-size", str(GBS),
             "--seq-length", str(SEQ), "--seed", str(SEED), "--split", SPLIT,
             "--lr-warmup-iters", str(sched["lr_warmup_iters"]), "--lr-decay-style", sched["lr_decay_style"],
             "--attention-dropout", "0", "--hidden-dropout", "0"]
    for k, v in OPTIM.items():
        flags += ["--" + k.replace("_", "-"), str(v)]
    launch(1, *flags)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    ds, _ = build_datasets(DataConfig(paths=(str(work / "corpus"),), seq_length=SEQ, seed=SEED, split=SPLIT),
                           ITERS * GBS, 0)
    it = micro_batches(ds, 0, MBS, 0, 1)
    batches = [next(it).tolist() for _ in range(ITERS * GBS // MBS)]
    return rows, batches


@pytest.fixture(scope="module")
def theirs(work) -> dict[str, dict]:
    """Every schedule's megatron-core run, in one oracle subprocess."""
    ck = Checkpoint(work / "ck" / "iter_0000000")
    model = megatron_model(ck.config, ck.tensors["embedding.word_embeddings.weight"].shape[0])
    # each schedule with the distributed optimizer (Megatron-LM's --use-distributed-optimizer), and cosine+warmup
    # with the plain one too
    runs = [(name, True) for name in SCHEDULES] + [("cosine-warmup", False)]
    jobs = [{"ckpt": str(work / "td" / "iter_0000000"), "out": str(work / f"theirs-{name}-{dist}.json"),
             "model": model, "data": {"blend": [str(work / "corpus")], "split": SPLIT, "seed": SEED,
                                      "seq_length": SEQ, "cache": str(work / f"cache-{name}-{dist}")},
             "train": dict(OPTIM, **SCHEDULES[name], train_iters=ITERS, micro_batch_size=MBS, global_batch_size=GBS,
                           lr_warmup_init=0.0, lr_decay_iters=None, use_distributed_optimizer=dist)}
            for name, dist in runs]
    (work / "jobs.json").write_text(json.dumps(jobs))
    r = subprocess.run([sys.executable, str(ORACLE), "train", str(work / "jobs.json")], capture_output=True, text=True,
                       timeout=300, cwd=str(work))
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-4000:])
    return {(name if dist else f"{name} plain"): json.loads(Path(job["out"]).read_text())
            for (name, dist), job in zip(runs, jobs)}


def compare(work: Path, meg: dict, name: str, run: tuple[list[dict], list[list]] | None = None) -> list[dict]:
    """Asserts what both runs must share; returns our metrics rows."""
    rows, batches = run or ours(work, name, SCHEDULES[name])
    assert meg["num_micro"] == GBS // MBS >= 2
    # the same token ids in every micro-batch, in order
    assert [b for step in meg["tokens"] for b in step] == batches
    assert len(rows) == ITERS and [r["iteration"] for r in rows] == list(range(1, ITERS + 1))
    # two param groups (decayed weights; biases and norms without decay), as megatron-core's standard overrides
    assert all(len(p) == 2 for p in meg["params"]) and sorted(meg["wd"][0]) == [0.0, OPTIM["weight_decay"]]
    # clipping was exercised: some step's norm exceeded --clip-grad
    assert max(meg["grad_norm"]) > OPTIM["clip_grad"]
    applied = [lrs[0] for lrs in meg["lr"]]
    assert all(len(set(lrs)) == 1 for lrs in meg["lr"])
    np.testing.assert_allclose([r["lr"] for r in rows], applied, rtol=1e-12, atol=0)
    np.testing.assert_allclose([r["grad_norm"] for r in rows], meg["grad_norm"], rtol=1e-5)
    np.testing.assert_allclose([r["loss"] for r in rows], meg["loss"], rtol=1e-5, atol=0)
    return rows


def test_constant_lr_matches_megatron(work, theirs):
    rows = compare(work, theirs["constant"], "constant")
    assert len({r["lr"] for r in rows}) == 1


def test_cosine_warmup_matches_megatron(work, theirs):
    meg = theirs["cosine-warmup"]
    run = ours(work, "cosine-warmup", SCHEDULES["cosine-warmup"])
    rows = compare(work, meg, "cosine-warmup", run)
    compare(work, theirs["cosine-warmup plain"], "cosine-warmup", run)  # megatron-core's non-distributed optimizer
    lrs = [r["lr"] for r in rows]
    # Megatron's warmup: --lr-warmup-init (0) at the first iteration, the peak after lr_warmup_iters, then cosine
    # down towards --min-lr
    assert lrs[0] == 0.0 and lrs[3] == pytest.approx(OPTIM["lr"]) and OPTIM["min_lr"] < lrs[-1] < lrs[4]
    # the weight decay each step was taken with (constant: --start/--end-weight-decay default to --weight-decay)
    assert [r["weight_decay"] for r in rows] == [max(wd) for wd in meg["wd"]]
