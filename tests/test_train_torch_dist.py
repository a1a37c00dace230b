"""continue-pretrain from and to Megatron-LM's torch_dist (issue 17, "Train from it and back"), with megatron-core
itself on CPU as the oracle (tests/megatron_oracle.py):

- megatron-core trains a tiny Llama K steps the way Megatron-LM does (test_megatron_train_parity's run), saves model +
  distributed-optimizer state + scheduler in torch_dist, and trains one more step; `continue-pretrain --load` of that
  save takes the same step: the same LR, loss, weights and Adam moments (1e-5), at the saving layout and resharded on
  load to TP 2 (2 ranks, saved in torch_dist in the background: each rank writes its own items);
- megatron-core's GPTModel and distributed optimizer load shardkit's torch_dist training saves (dist_checkpointing.load
  + load_state_dict) with every weight and moment bitwise equal to the native save of the same run (and to what
  shardkit reads of the 2-rank save); `continue-pretrain --load` of a torch_dist save goes on bitwise as the run did;
- a partial optimizer state, Megatron-LM's args without the model, a contradicting model flag: one line;
- MoE with expert parallelism (tiny Mixtral, megatron-core's MoE layer at EP 2 on 2 gloo ranks, its ChainedOptimizer
  of a dense and an expert distributed optimizer): `continue-pretrain --load` of its save takes its next step (1e-5)
  at EP 2, resharded to EP 1, and at TP 2 x EP 2 with expert TP 1 (expert data parallel 2); our EP 2 torch_dist save
  loads into its MoE GPTModel and optimizers bitwise; its grouped-GEMM experts read the same keys; expert tensors
  that do not match the model config: one line.
"""
from __future__ import annotations

import importlib.util
import json
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
    pytest.skip("megatron-core is not installed", allow_module_level=True)

from checkpoint.megatron import sharded_key  # noqa: E402
from checkpoint.reader import Checkpoint  # noqa: E402
from checkpoint.sharding import OPTIMIZER_STATES, optimizer_key  # noqa: E402
from checkpoint.families import model_specs
from tests.test_torch_dist import megatron_model  # noqa: E402
from tests.launcher import free_port, launch  # noqa: E402

ORACLE = Path(__file__).with_name("megatron_oracle.py")
K, MBS, GBS, SEQ, SEED, SPLIT = 3, 2, 4, 32, 1234, "969,30,1"  # megatron-core saves after K, trains K + 1
OPTIM = dict(lr=1e-3, min_lr=1e-4, weight_decay=0.1, clip_grad=0.5, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8)
SCHED = dict(lr_warmup_iters=2, lr_decay_style="cosine")
MEGATRON_STATE = {"fp32_param": "param", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}


def flags(iters: int) -> list[str]:
    out = ["--train-iters", str(iters), "--micro-batch-size", str(MBS), "--global-batch-size", str(GBS),
           "--seq-length", str(SEQ), "--seed", str(SEED), "--split", SPLIT,
           "--lr-warmup-iters", str(SCHED["lr_warmup_iters"]), "--lr-decay-style", SCHED["lr_decay_style"],
           "--attention-dropout", "0", "--hidden-dropout", "0"]
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
    assert cli(["convert", "hf-to-mcore", str(hf), str(w / "ck"), "--quiet", "--no-verify"]) == 0
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
    from checkpoint.torch_dist_load import TorchDistLoad

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
    from checkpoint.torch_dist_load import TorchDistLoad

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
    from checkpoint.torch_dist_load import TorchDistLoad

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
    from checkpoint.torch_dist_pickle import load_dcp_metadata
    from checkpoint.torch_dist_load import TorchDistLoad

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


# -- MoE with expert parallelism (Mixtral-like, megatron-core's local spec: SequentialMLP) --------------------------
# megatron-core runs at EP 2 (torchrun, 2 gloo ranks: DP 2 for the dense parameters, expert-data-parallel 1, its
# ChainedOptimizer of a dense and an expert DistributedOptimizer). Its torch_dist expert keys are
# `decoder.layers.mlp.experts.experts.linear_fc{1,2}.weight` with a [layer, expert] prefix: SequentialMLP, GroupedMLP
# and TEGroupedMLP all give that one key unless `singleton_local_shards` (Megatron-LM writes False), so the local and
# the grouped specs' checkpoints read alike. The vocabulary is 256 (no padding rows): Megatron's loss runs over the
# padded vocabulary, shardkit's over the true one.

EP, MOE_AUX = 2, 0.01


def moe_flags(iters: int) -> list[str]:
    return [*flags(iters), "--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", str(MOE_AUX)]


def moe_oracle(work: Path, jobs: list[dict]) -> None:
    """megatron-core's jobs (topic mixed) at EP ranks under torchrun (its optimizer loads build their sharded state
    dicts with the checkpoint's content metadata, as Megatron-LM's load_checkpoint does)."""
    (work / "moe.json").write_text(json.dumps(jobs))
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(EP),
                        "--monitor-interval", "0.1", "--master-port", str(free_port()), str(ORACLE), "mixed",
                        str(work / "moe.json")], capture_output=True, text=True, timeout=300, cwd=str(work))
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-4000:])


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """A tiny Mixtral (4 experts, top-2; HF, native, torch_dist with local-spec keys) and a corpus; shardkit's own run
    of it at EP 2 (2 ranks) for 2 iterations saved in torch_dist; then one megatron-core process pair (EP 2) that
    loads the converted model into its grouped-GEMM experts, loads our training save into its MoE GPTModel and
    distributed optimizer, and trains K + 1 iterations from the converted model, saving model + optimizer in
    torch_dist after K (meg/iter_000000K)."""
    from shardkit.cli import main as cli
    from tests import moe_models
    from tests.corpus import write_pattern_corpus

    from convert.torch_dist_io import write_torch_dist

    w = tmp_path_factory.mktemp("train_torch_dist_moe")
    moe_models.build("mixtral", w / "hf", vocab_size=256)
    assert cli(["convert", "hf-to-mcore", str(w / "hf"), str(w / "ck"), "--quiet", "--no-verify"]) == 0
    write_torch_dist(w / "ck", w / "td", key_naming="local", quiet=True)
    write_pattern_corpus(w / "corpus")
    launch(EP, "--load", str(w / "ck"), "--data-path", str(w / "corpus"), "--save", str(w / "ours-td"), "--ep",
           str(EP), "--save-format", "torch_dist", "--key-naming", "local", *moe_flags(K + 1), "--exit-interval", "2")
    # the same run saved natively, then exported by `reshard --format torch_dist` (its common.pt from train_state)
    launch(EP, "--load", str(w / "ck"), "--data-path", str(w / "corpus"), "--save", str(w / "ours-native"), "--ep",
           str(EP), *moe_flags(K + 1), "--exit-interval", "2")
    assert cli(["reshard", str(w / "ours-native"), str(w / "exported"), "--format", "torch_dist", "--key-naming",
                "local", "--quiet"]) == 0
    ck = Checkpoint(w / "ck")
    model = dict(megatron_model(ck.config, ck.tensors["embedding.word_embeddings.weight"].shape[0]),
                 moe_aux_loss_coeff=MOE_AUX, expert_model_parallel_size=EP)
    moe_oracle(w, [{"topic": "grouped_experts", "ep": EP, "ckpt": str(w / "td" / "iter_0000000"),
                    "out": str(w / "grouped.pt"), "model": model},
                   {"topic": "optimizer", "ep": EP, "mode": "load", "ckpt": str(w / "ours-td" / "iter_0000002"),
                    "out": str(w / "loaded.pt"), "model": model},
                   {"topic": "optimizer", "ep": EP, "mode": "load", "ckpt": str(w / "exported" / "iter_0000002"),
                    "out": str(w / "loaded-export.pt"), "model": model},
                   {"topic": "train", "ep": EP, "ckpt": str(w / "td" / "iter_0000000"), "out": str(w / "meg.pt"),
                    "model": model, "data": {"blend": [str(w / "corpus")], "split": SPLIT, "seed": SEED,
                                             "seq_length": SEQ, "cache": str(w / "cache")},
                    "train": dict(OPTIM, **SCHED, train_iters=K + 1, micro_batch_size=MBS, global_batch_size=GBS,
                                  lr_warmup_init=0.0, lr_decay_iters=None, use_distributed_optimizer=True),
                    "save": {"root": str(w / "meg"), "at": K}, "final_tensors": True}])
    return w


@pytest.mark.parametrize("name,nproc,ep", [pytest.param("ep2", EP, EP, id="ep2"), pytest.param("ep1", 1, 1, id="ep1"),
                                           pytest.param("tp2sp-ep2-etp1", 2 * EP, EP, id="tp2sp-ep2-etp1")])
def test_continue_megatron_core_moe_training(moe, name, nproc, ep):
    """megatron-core's MoE torch_dist save at iteration K (EP 2, its chained distributed optimizer; expert keys with
    the expert axis): our next step equals its next step (LR, loss, grad norm with the aux loss's gradient, every
    weight and Adam moment, experts and router included) at EP 2 (2 ranks, saved in torch_dist), resharded on load
    to EP 1 (1 rank, saved native), and at TP 2 x EP 2 with expert TP 1 on 4 ranks (DP 2; each expert shard in an
    expert-data-parallel group of 2, its optimizer state split over them; saved in torch_dist). The micro-batch stays
    2: Megatron's load-balancing loss is taken per micro-batch."""
    from checkpoint.torch_dist_load import TorchDistLoad

    out = moe / f"ours-{name}"
    more = ["--save-format", "torch_dist", "--key-naming", "local"] if ep > 1 else []
    if nproc > EP:
        more += ["--tp", "2", "--sequence-parallel", "--expert-tensor-parallel-size", "1"]
    r = launch(nproc, "--load", str(moe / "meg"), "--hf-config", str(moe / "hf"), "--data-path", str(moe / "corpus"),
               "--save", str(out), "--ep", str(ep), *moe_flags(K + 1), *more)
    assert f"at iteration {K} (consumed samples {K * GBS}, optimizer state: yes)" in r.stdout
    meg = torch.load(moe / "meg.pt", weights_only=True)
    (row,) = rows(out)
    assert row["iteration"] == K + 1
    assert row["lr"] == pytest.approx(meg["lr"][K][0], rel=1e-12)
    assert row["loss"] == pytest.approx(meg["loss"][K], rel=1e-5)
    assert row["grad_norm"] == pytest.approx(meg["grad_norm"][K], rel=1e-5)
    ck = TorchDistLoad(out) if ep > 1 else Checkpoint(out)
    assert ck.manifest.iteration == K + 1 and ck.layout.ep == ep and ck.optimizer_states == list(OPTIMIZER_STATES)
    names = [s.name for s in model_specs(ck.config, ck.layout)]
    assert "decoder.layers.mlp.experts.experts.linear_fc1.weight" in names
    for name in names:
        key = sharded_key(name, "local")
        torch.testing.assert_close(ck.read(name), meg["tensors"][key], rtol=1e-5, atol=1e-6, msg=name)
        for st in OPTIMIZER_STATES:
            torch.testing.assert_close(ck.read(optimizer_key(st, name)), meg["optimizer"][MEGATRON_STATE[st]][key],
                                       rtol=1e-5, atol=1e-9, msg=f"{st} {name}")
    # the Adam step count comes from megatron-core's ChainedOptimizer entry ({0: dense, 1: expert} param groups)
    meg_td = TorchDistLoad(moe / "meg", str(moe / "hf"))
    groups = meg_td.td.common["optimizer"]
    assert sorted(groups) == [0, 1] and groups[1]["optimizer"]["param_groups"][0]["is_expert_parallel"]
    assert meg_td.train_state(GBS)[0]["optimizer_steps"] == K


@pytest.mark.parametrize("saved,out", [("ours-td", "loaded.pt"), ("exported", "loaded-export.pt")],
                         ids=["train-save", "native-save-exported"])
def test_our_moe_torch_dist_save_loads_into_megatron_core(moe, saved, out):
    """Our torch_dist save of a MoE run at EP 2 (each rank wrote its own experts), and the native save of the same run
    exported by `reshard --format torch_dist`, load into megatron-core's MoE GPTModel and its distributed optimizers at
    EP 2 (dist_checkpointing.load, then load_state_dict of its ChainedOptimizer, which trains on): every weight, main
    parameter and moment bitwise what shardkit reads of it; the param groups are megatron-core's (dense decayed / not
    decayed, expert decayed) with our step."""
    from checkpoint.torch_dist_load import TorchDistLoad

    want = TorchDistLoad(moe / saved)
    assert want.layout.ep == EP
    if saved == "ours-td":
        assert sorted(want.td.files()) == ["__0_0.distcp", "__1_0.distcp"]
    loaded = torch.load(moe / out, weights_only=True)
    for s in model_specs(want.config, want.layout):
        key = sharded_key(s.name, "local")
        assert torch.equal(loaded["tensors"][key], want.read(s.name)), s.name
        for st in OPTIMIZER_STATES:
            assert torch.equal(loaded["optimizer"][MEGATRON_STATE[st]][key], want.read(optimizer_key(st, s.name))), \
                (st, s.name)
    assert [(g["wd_mult"], g["is_expert_parallel"]) for g in loaded["param_groups"]] == \
        [(1.0, False), (0.0, False), (1.0, True)]
    assert all(g["step"] == 2 for g in loaded["param_groups"])


def test_bad_moe_torch_dist_load_is_one_line(moe, tmp_path):
    """A torch_dist --load whose expert tensors do not match the model config (8 experts given, 4 stored; a dense
    model's config for a MoE checkpoint): one line naming the checkpoint, the key and both values, no traceback."""
    hf = json.loads((moe / "hf" / "config.json").read_text())
    mixtral_only = ("num_local_experts", "num_experts_per_tok", "router_aux_loss_coef", "output_router_logits",
                    "router_jitter_noise", "sliding_window")
    dense = {k: v for k, v in hf.items() if k not in mixtral_only}
    for name, config in (("eight", dict(hf, num_local_experts=8)),
                         ("dense", dict(dense, model_type="llama", architectures=["LlamaForCausalLM"]))):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(config))
        r = launch(1, "--load", str(moe / "meg"), "--hf-config", str(d), "--data-path", str(moe / "corpus"),
                   *moe_flags(K + 1), check=False)
        err = r.stderr.strip().splitlines()
        assert r.returncode != 0 and "Traceback" not in r.stderr and len(err) == 1, r.stderr[-3000:]
        assert str(moe / "meg" / "iter_0000003") in err[0], err
        if name == "eight":
            assert re.search(r"tensor decoder\.layers\.mlp\.(router\.weight|experts\.experts\.linear_fc1\.weight) "
                             r"stacks 4 experts .*says num_moe_experts=8", err[0]), err
        else:
            assert re.search(r"tensor\(s\) the model config needs are missing, e\.g\. decoder\.layers\.mlp\."
                             r"linear_fc1\.weight.*no place for, e\.g\. decoder\.layers\.mlp\.experts\.experts\.",
                             err[0]), err


def test_grouped_expert_spec_reads_the_same_keys(moe):
    """megatron-core's grouped-GEMM experts (the local spec's GroupedMLP: every local expert in one weight1 / weight2)
    have the torch_dist keys and global shapes of its SequentialMLP (one `decoder.layers.mlp.experts.experts.linear_fc*`
    key with a [layer, expert] prefix), and loading our export puts each expert's weights where its grouped GEMM reads
    them (weight1.view(local experts, hidden, 2 ffn)[e] = fc1[layer, expert]^T), on each EP rank its own experts."""
    ck = Checkpoint(moe / "ck")
    meg = torch.load(moe / "meg.pt", weights_only=True)["tensors"]
    got = torch.load(moe / "grouped.pt", weights_only=True)
    assert got["names"] == {k: list(v.shape) for k, v in meg.items()}
    fc1 = ck.read("decoder.layers.mlp.experts.experts.linear_fc1.weight")
    fc2 = ck.read("decoder.layers.mlp.experts.experts.linear_fc2.weight")
    layers, experts, h = fc1.shape[0], fc1.shape[1], fc1.shape[-1]
    local = experts // EP
    assert len(got["weights"]) == EP
    for rank, weights in enumerate(got["weights"]):
        for layer in range(layers):
            w1 = weights[f"{layer}.weight1"].view(local, h, -1)
            w2 = weights[f"{layer}.weight2"].view(local, -1, h)
            for j in range(local):
                e = rank * local + j
                assert torch.equal(w1[j], fc1[layer, e].T) and torch.equal(w2[j], fc2[layer, e].T), (rank, layer, e)
