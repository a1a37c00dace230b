"""continue-pretrain from and to Megatron-LM's torch_dist (issue 17, "Train from it and back"), with megatron-core
itself on CPU as the oracle (tests/megatron_oracle.py):

- megatron-core trains a tiny Llama K steps the way Megatron-LM does (test_megatron_train_parity's run), saves model +
  distributed-optimizer state + scheduler in torch_dist, and trains one more step; `continue-pretrain --load` of that
  save takes the same step: the same LR, loss, weights and Adam moments (1e-5), at the saving layout and resharded on
  load to TP 2 (2 ranks, saved in torch_dist in the background: each rank writes its own items);
- megatron-core's GPTModel and distributed optimizer load shardkit's torch_dist training saves (dist_checkpointing.load
  + load_state_dict) with every weight and moment bitwise equal to the native save of the same run (and to what
  shardkit reads of the 2-rank save); `continue-pretrain --load` of a torch_dist save goes on bitwise as the run did;
- a partial optimizer state, Megatron-LM's args without the model, a contradicting model flag: one line.
"""
from __future__ import annotations

import importlib.util
import json
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
    pytest.skip("megatron-core is not installed", allow_module_level=True)

from checkpoint.megatron import sharded_key  # noqa: E402
from checkpoint.reader import Checkpoint  # noqa: E402
from checkpoint.sharding import OPTIMIZER_STATES, model_specs, optimizer_key  # noqa: E402
from tests.test_torch_dist import megatron_model  # noqa: E402
from tests.test_train import launch  # noqa: E402

ORACLE = Path(__file__).with_name("megatron_oracle.py")
K, MBS, GBS, SEQ, SEED, SPLIT = 3, 2, 4, 32, 1234, "969,30,1"  # megatron-core saves after K, trains K + 1
OPTIM = dict(lr=1e-3, min_lr=1e-4, weight_decay=0.1, clip_grad=0.5, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8)
SCHED = dict(lr_warmup_iters=2, lr_decay_style="cosine")
MEGATRON_STATE = {"fp32_param": "param", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}


def flags(iters: int) -> list[str]:
    out = ["--train-iters", str(iters), "--micro-batch-size", str(MBS), "--global-batch-size", str(GBS),
           "--seq-length", str(SEQ), "--seed", str(SEED), "--split", SPLIT,
           "--lr-warmup-iters", str(SCHED["lr_warmup_iters"]), "--lr-decay-style", SCHED["lr_decay_style"]]
    for k, v in OPTIM.items():
        out += ["--" + k.replace("_", "-"), str(v)]
    return out


def oracle(work: Path, topic: str, jobs: list[dict]) -> None:
    (work / f"{topic}.json").write_text(json.dumps(jobs))
    r = subprocess.run([sys.executable, str(ORACLE), topic, str(work / f"{topic}.json")], capture_output=True,
                       text=True, timeout=300, cwd=str(work))
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-4000:])


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A tiny Llama (HF, native, torch_dist with local-spec keys), a corpus, and megatron-core's run: K iterations,
    its torch_dist training save (meg/iter_000000K), one more iteration."""
    from shardkit.cli import main as cli
    from shardkit.demo import build_tiny_llama
    from tests.corpus import write_pattern_corpus

    w = tmp_path_factory.mktemp("train_torch_dist")
    hf = build_tiny_llama(w / "hf", dtype=torch.float32, vocab_size=256, hidden_size=64, intermediate_size=128,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=64, rope_theta=10000.0, rope_scaling=None)
    assert cli(["convert", "hf-to-mcore", str(hf), str(w / "ck"), "--quiet"]) == 0
    from convert.torch_dist_io import write_torch_dist

    write_torch_dist(w / "ck", w / "td", key_naming="local", quiet=True)  # megatron-core's starting weights
    write_pattern_corpus(w / "corpus")
    ck = Checkpoint(w / "ck")
    model = megatron_model(ck.config, ck.tensors["embedding.word_embeddings.weight"].shape[0])
    oracle(w, "train", [{"ckpt": str(w / "td" / "iter_0000000"), "out": str(w / "meg.pt"), "model": model,
                         "data": {"blend": [str(w / "corpus")], "split": SPLIT, "seed": SEED, "seq_length": SEQ,
                                  "cache": str(w / "cache")},
                         "train": dict(OPTIM, **SCHED, train_iters=K + 1, micro_batch_size=MBS,
                                       global_batch_size=GBS, lr_warmup_init=0.0, lr_decay_iters=None,
                                       use_distributed_optimizer=True),
                         "save": {"root": str(w / "meg"), "at": K}, "final_tensors": True}])
    (w / "model.json").write_text(json.dumps(model))
    return w


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def continued(work) -> dict[int, Path]:
    """`continue-pretrain --load` of megatron-core's save (iteration K) for its last iteration: at TP 1 (the saving
    layout) saved native, and resharded on load to TP 2 (2 ranks) saved in torch_dist, in the background
    (--async-save), with megatron-core's local-spec keys."""
    out = {}
    for tp, more in ((1, []), (2, ["--save-format", "torch_dist", "--key-naming", "local", "--async-save"])):
        out[tp] = work / f"ours-tp{tp}"
        r = launch(tp, "--load", str(work / "meg"), "--hf-config", str(work / "hf"), "--data-path",
                   str(work / "corpus"), "--save", str(out[tp]), "--tp", str(tp), *flags(K + 1), *more)
        assert f"at iteration {K} (consumed samples {K * GBS}, optimizer state: yes)" in r.stdout
    return out


@pytest.mark.parametrize("tp", [1, 2])
def test_continue_megatron_core_training(work, continued, tp):
    """megatron-core's own torch_dist save at iteration K (TP 1, its distributed optimizer): our next step equals
    its next step (LR, loss, grad norm, weights, Adam moments), at TP 1 and resharded on load to TP 2 (whose
    torch_dist save shardkit reads back without flags)."""
    from train.torch_dist_ckpt import TorchDistLoad

    meg = torch.load(work / "meg.pt", weights_only=True)
    out = continued[tp]
    (row,) = rows(out)
    assert row["iteration"] == K + 1
    assert row["lr"] == pytest.approx(meg["lr"][K][0], rel=1e-12)
    assert row["loss"] == pytest.approx(meg["loss"][K], rel=1e-5)
    assert row["grad_norm"] == pytest.approx(meg["grad_norm"][K], rel=1e-5)
    ck = Checkpoint(out) if tp == 1 else TorchDistLoad(out)
    assert ck.manifest.iteration == K + 1 and ck.layout.tp == tp and ck.optimizer_states == list(OPTIMIZER_STATES)
    vocab = ck.config.vocab_size
    for s in model_specs(ck.config, ck.layout):
        key = sharded_key(s.name, "local")
        rows_ = slice(0, vocab) if s.rule.value == "vocab" else slice(None)
        torch.testing.assert_close(ck.read(s.name)[rows_], meg["tensors"][key][rows_], rtol=1e-5, atol=1e-6,
                                   msg=s.name)
        for st in OPTIMIZER_STATES:
            torch.testing.assert_close(ck.read(optimizer_key(st, s.name))[rows_],
                                       meg["optimizer"][MEGATRON_STATE[st]][key][rows_], rtol=1e-5, atol=1e-9,
                                       msg=f"{st} {s.name}")


@pytest.fixture(scope="module")
def ours(work):
    """The same shardkit run from the converted model: native, saved after every iteration up to 3; torch_dist,
    stopped and saved after 2 (of K + 1 iterations)."""
    for fmt, more in (("native", ["--save-interval", "1", "--exit-interval", "3"]),
                      ("torch_dist", ["--exit-interval", "2"])):
        launch(1, "--load", str(work / "ck"), "--data-path", str(work / "corpus"), "--save", str(work / f"s-{fmt}"),
               "--save-format", fmt, "--key-naming", "local", *flags(K + 1), *more)
    return work / "s-native", work / "s-torch_dist"


def test_our_torch_dist_save_loads_into_megatron_core(work, ours, continued):
    """megatron-core's GPTModel and distributed optimizer load our torch_dist training saves (and train on): every
    weight, main parameter and moment bitwise equal to the native save of the same run (1 rank), and to what shardkit
    reads of a 2-rank save (TP 2, each rank wrote its own items); the param groups' step is ours."""
    from checkpoint.torch_dist import TorchDistCheckpoint
    from shardkit.cli import main as cli
    from train.torch_dist_ckpt import TorchDistLoad

    native, td_root = ours
    td = TorchDistCheckpoint(td_root)
    assert (td_root / "latest_checkpointed_iteration.txt").read_text() == "2\n"
    assert td.args.consumed_train_samples == 2 * GBS and td.common["opt_param_scheduler"]["num_steps"] == 2 * GBS
    assert td.args.no_save_optim is None and td.args.use_distributed_optimizer and td.args.train_iters == K + 1
    two = TorchDistCheckpoint(continued[2])
    assert sorted(two.files()) == ["__0_0.distcp", "__1_0.distcp"] and two.args.tensor_model_parallel_size == 2
    # shardkit reads them back without flags: verify checks every key, shape and rank shard, optimizer state included
    for root in (td_root, continued[2]):
        assert cli(["verify", str(root), "--json", "--quiet"]) == 0
    model = json.loads((work / "model.json").read_text())
    oracle(work, "optimizer", [{"mode": "load", "ckpt": str(t.path), "out": str(work / f"loaded-{i}.pt"),
                                "model": model} for i, t in enumerate((td, two))])
    wants = ((Checkpoint(native / "iter_0000002"), 2), (TorchDistLoad(continued[2]), K + 1))
    for i, (want, step) in enumerate(wants):
        loaded = torch.load(work / f"loaded-{i}.pt", weights_only=True)
        for s in model_specs(want.config, want.layout):
            key = sharded_key(s.name, "local")
            assert torch.equal(loaded["tensors"][key], want.read(s.name)), s.name
            for st in OPTIMIZER_STATES:
                theirs = loaded["optimizer"][MEGATRON_STATE[st]][key]
                assert torch.equal(theirs, want.read(optimizer_key(st, s.name))), (st, s.name)
        assert [g["wd_mult"] for g in loaded["param_groups"]] == [1.0, 0.0]
        assert all(g["step"] == step for g in loaded["param_groups"])


def test_resume_from_our_torch_dist_equals_native(work, ours):
    """`continue-pretrain --load` of our torch_dist save (iteration 2) continues bitwise as the run that went on
    (native saves; an exact resume of those is test_train's): the same loss, grad norm and LR at iteration 3 and the
    same weights and optimizer state after it (train_state.json rides in common.pt: RNG, scheduler, data position)."""
    native, td_root = ours
    out = work / "resumed"
    launch(1, "--load", str(td_root), "--data-path", str(work / "corpus"), "--save", str(out), *flags(K + 1),
           "--exit-interval", "3")
    (got,) = rows(out)
    want = rows(native)[2]
    assert got["iteration"] == want["iteration"] == 3
    assert (got["loss"], got["grad_norm"], got["lr"]) == (want["loss"], want["grad_norm"], want["lr"])
    x, y = Checkpoint(native / "iter_0000003"), Checkpoint(out)
    assert sorted(x.tensors) == sorted(y.tensors) and y.manifest.iteration == 3
    for name in x.tensors:
        assert torch.equal(x.read(name), y.read(name)), name
    # what each rank of another layout reads of the torch_dist save is what it reads of the native one
    from checkpoint.layout import Layout, RankCoord
    from train.torch_dist_ckpt import TorchDistLoad

    a, b = TorchDistLoad(td_root), Checkpoint(native / "iter_0000002")
    for layout, coord in ((Layout(tp=2), RankCoord(tp=1)), (Layout(pp=2), RankCoord(pp=1))):
        for name in b.tensors:
            mine, theirs = a.read_local(name, layout, coord), b.read_local(name, layout, coord)
            assert mine.keys() == theirs.keys() and all(torch.equal(mine[v], theirs[v]) for v in mine), name


def test_bad_torch_dist_load_is_one_line(work, ours, tmp_path):
    """A torch_dist --load whose optimizer state lacks a state (every exp_avg_sq) or one tensor's state, Megatron-LM's
    own checkpoint without --hf-config / --vocab-size, a model flag that contradicts its args: one line naming the
    checkpoint and what is wrong, non-zero exit, no traceback."""
    import shutil

    from torch.distributed.checkpoint import metadata as dcp_md

    from checkpoint.errors import FormatError
    from checkpoint.torch_dist import load_dcp_metadata
    from train.torch_dist_ckpt import TorchDistLoad

    _, td_root = ours

    def without(dst: Path, drop) -> Path:
        shutil.copytree(td_root, dst)
        it = dst / "iter_0000002"
        md = load_dcp_metadata(it / ".metadata")
        keep = {k: v for k, v in md.state_dict_metadata.items() if not drop(k)}
        storage = {i: v for i, v in md.storage_data.items() if i.fqn in keep}
        (it / ".metadata").write_bytes(pickle.dumps(dcp_md.Metadata(state_dict_metadata=keep, planner_data=None,
                                                                    storage_data=storage)))
        return dst

    one = without(tmp_path / "one", lambda k: k == "optimizer.state.exp_avg.decoder.final_layernorm.weight")
    with pytest.raises(FormatError, match=r"partial optimizer state: 1 of \d+ optimizer tensors are missing, e\.g\. "
                                          r"optimizer\.state\.exp_avg\.decoder\.final_layernorm\.weight"):
        TorchDistLoad(one)
    TorchDistLoad(one, load_optim=False)  # --no-load-optim: the weights load
    every = without(tmp_path / "every", lambda k: k.startswith("optimizer.state.exp_avg_sq."))
    r = launch(1, "--load", str(every), "--data-path", str(work / "corpus"), *flags(K + 1), check=False)
    err = r.stderr.strip().splitlines()
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert len(err) == 1 and "partial optimizer state: no optimizer.state.exp_avg_sq tensors" in err[0] \
        and str(every / "iter_0000002") in err[0] and "--no-load-optim" in err[0], err
    # Megatron-LM's own args hold no true vocab size: reshard's line, naming both ways to give it
    from checkpoint.errors import ConfigError

    with pytest.raises(ConfigError, match=r"common\.pt: its Megatron-LM args lack .*vocab_size .*--hf-config HF_DIR"):
        TorchDistLoad(work / "meg")
    # a model flag that contradicts the checkpoint's args (the model config checked against them)
    from dataclasses import replace

    from train.config import CheckpointConfig, DataArgs, ParallelConfig, RunConfig, ScheduleConfig, TrainConfig
    from train.loop import check_model_flags
    from train.optim import OptimizerConfig

    meg = TorchDistLoad(work / "meg", str(work / "hf"))
    cfg = TrainConfig(ParallelConfig(), DataArgs(seq_length=SEQ), OptimizerConfig(), ScheduleConfig(),
                      CheckpointConfig(), RunConfig())
    check_model_flags(replace(cfg, run=replace(cfg.run, num_layers=2, hidden_size=64)), meg.config, meg.path)
    with pytest.raises(ConfigError, match=r"--num-layers 3 disagrees with the checkpoint .*iter_0000003 \(2\)"):
        check_model_flags(replace(cfg, run=replace(cfg.run, num_layers=3)), meg.config, meg.path)
    # one format per --save directory
    from train.loop import check_save_format

    native, _ = ours
    check_save_format(str(native), "native")
    check_save_format(str(td_root), "torch_dist")
    with pytest.raises(ConfigError, match=r"holds native checkpoints \(latest\).*pass --save-format native"):
        check_save_format(str(native), "torch_dist")
    with pytest.raises(ConfigError, match=r"holds torch_dist checkpoints \(latest_checkpointed_iteration\.txt\)"):
        check_save_format(str(td_root), "native")
