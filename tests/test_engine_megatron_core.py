"""`continue-pretrain --engine megatron-core` (issue 40, first slice): megatron-core's GPTModel (local spec), DDP,
distributed optimizer, pipeline schedules and OptimizerParamScheduler, loaded from and saving to shardkit's native
checkpoints, equal the native engine on the same checkpoint and data.

megatron-core runs on the CPU here through the engine's explicit test switch (SHARDKIT_MEGATRON_CORE_CPU=1: its CUDA
stand-ins, train/engines/megatron_core/runtime.py `cpu_stand_ins`); every multi-rank run is forked by tests/launcher.py and
runs under tests/nccl_model.py (NCCL's point-to-point rules on gloo), megatron-core's own pipeline exchanges included.
The reference is the native engine on one process (itself equal to its TP/PP/DP layouts, tests/test_train.py)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.launcher import REPO, launch

# never imported here (importorskip would: megatron-core registers pickle safe globals in the test process, which
# tests/test_bad_input.py's allowlist tests must run without); the engine runs in the ranks it starts
pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core not installed")

SWITCH = "SHARDKIT_MEGATRON_CORE_CPU"
ITERS = 5
# fp32, no dropout (each engine draws its own masks), clipping exercised (the norms are ~6)
FLAGS = ["--train-iters", str(ITERS), "--micro-batch-size", "2", "--global-batch-size", "4", "--seq-length", "32",
         "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "1", "--clip-grad",
         "1.0", "--attention-dropout", "0", "--hidden-dropout", "0"]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """The tiny Llama (vocab 1000: TP padding to 1024, llama3 RoPE scaling), converted, and the pattern corpus."""
    from tests.corpus import tiny_llama_setup

    return tiny_llama_setup(tmp_path_factory.mktemp("engine_mcore"))


def train(work: Path, name: str, nproc: int, engine: str, *flags: str, load: Path | None = None,
          data: Path | None = None) -> list[dict]:
    """One run; its metrics rows (the save and log under work/name)."""
    out = work / name
    env = {SWITCH: "1"} if engine == "megatron-core" else {}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        launch(nproc, "--load", str(load or work / "ck"), "--data-path", str(data or work / "data"), "--save", str(out),
               "--log-dir", str(out), "--engine", engine, *FLAGS, *flags)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def tensors(save: Path) -> dict:
    from checkpoint.iterations import resolve_iteration
    from checkpoint.reader import Checkpoint

    return Checkpoint(resolve_iteration(save)).state_dict(optimizer=True)


def assert_same_tensors(ours: Path, ref: Path, tol: float = 1e-5) -> float:
    """Every saved tensor (weights, fp32 params, both moments) within `tol` of the reference's, relative to the
    tensor's largest value; returns the largest such difference."""
    a, b = tensors(ours), tensors(ref)
    assert sorted(a) == sorted(b)
    assert any(k.startswith("optimizer") or "exp_avg" in k for k in a), sorted(a)[:5]
    worst = 0.0
    for k in b:
        x, y = a[k].double().numpy(), b[k].double().numpy()
        if x.shape != y.shape and ("word_embeddings" in k or "output_layer" in k):  # another TP pads the vocab more
            assert x.shape[1:] == y.shape[1:], k
            x, y = x[:min(len(x), len(y))], y[:min(len(x), len(y))]  # the padding rows repeat a true row
        assert x.shape == y.shape, k
        d = float(np.abs(x - y).max() / max(np.abs(y).max(), 1e-30))
        assert d <= tol, (k, d)
        worst = max(worst, d)
    return worst


def assert_same_rows(rows: list[dict], ref: list[dict]) -> None:
    assert [r["iteration"] for r in rows] == [r["iteration"] for r in ref]
    np.testing.assert_allclose([r["loss"] for r in rows], [r["loss"] for r in ref], rtol=1e-5, atol=0)
    np.testing.assert_allclose([r["grad_norm"] for r in rows], [r["grad_norm"] for r in ref], rtol=1e-5, atol=0)
    np.testing.assert_allclose([r["lr"] for r in rows], [r["lr"] for r in ref], rtol=1e-12, atol=0)


@pytest.fixture(scope="module")
def native(work):
    """The reference: the native engine on one process, 5 iterations, a save after the 3rd and at the end."""
    return train(work, "native", 1, "native", "--save-interval", "3")


LAYOUTS = {"1rank": (1, ()), "tp2-sp": (2, ("--tp", "2", "--sequence-parallel")),
           "pp2": (2, ("--pp", "2")), "pp2-vpp2": (2, ("--pp", "2", "--vpp", "2")),
           "dp2-overlap": (2, ("--overlap-grad-reduce", "--overlap-param-gather")),
           # uneven: megatron-core builds 1 + 3 layers from Megatron-LM's flag (its parameter table checks each layer)
           "pp2-first1": (2, ("--pp", "2", "--decoder-first-pipeline-num-layers", "1")),
           "pp2-vpp2-layout": (2, ("--pp", "2", "--vpp", "2", "--pipeline-model-parallel-layout", "Et|t|t|tL"))}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_megatron_core_equals_native(work, native, layout, tmp_path):
    """Losses, grad norms, LRs and the saved weights and optimizer moments after 5 steps equal the native engine's;
    the multi-rank runs' point-to-point traffic went through the NCCL model (megatron-core's own exchanges at PP)."""
    nproc, flags = LAYOUTS[layout]
    log = tmp_path / "nccl.jsonl"
    os.environ["SHARDKIT_TEST_NCCL_MODEL_LOG"] = str(log)
    try:
        rows = train(work, f"mcore-{layout}", nproc, "megatron-core", "--save-interval", "3", *flags)
    finally:
        os.environ.pop("SHARDKIT_TEST_NCCL_MODEL_LOG", None)
    assert len(rows) == ITERS and max(r["grad_norm"] for r in rows) > 1.0  # clipping was exercised
    assert_same_rows(rows, native)
    worst = assert_same_tensors(work / f"mcore-{layout}", work / "native")
    print(f"{layout}: largest relative difference of a saved tensor {worst:.2e}")
    if nproc > 1:
        counts = [json.loads(line) for line in log.read_text().splitlines()]
        assert len(counts) == nproc  # every rank ran under the model
        if "--pp" in flags:
            assert all(c["batches"] > 0 for c in counts), counts  # megatron-core's batched p2p, under NCCL's rules


PACKED = ["--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss", "--eod-token-id", "2"]


@pytest.mark.parametrize("layout", ["1rank", "tp2-sp"])
def test_packed_documents_equal_native(work, layout):
    """Packed documents (Megatron's three flags): short documents ended by EOD, several per sample and crossing sample
    boundaries; megatron-core's attention takes the per-document causal mask, its RoPE the reset positions and its
    loss the EOD-masked tokens, and equals the native engine's run on the same data."""
    from tests.corpus import write_packed_corpus

    data = work / "packed-data"
    if not (work / "packed-native" / "metrics.jsonl").exists():  # the reference, shared by the layouts
        write_packed_corpus(data, eod=2, lengths=(5, 14))
        train(work, "packed-native", 1, "native", *PACKED, data=data)
    ref = [json.loads(line) for line in (work / "packed-native" / "metrics.jsonl").read_text().splitlines()]
    nproc, flags = LAYOUTS[layout]
    rows = train(work, f"packed-mcore-{layout}", nproc, "megatron-core", *PACKED, *flags, data=data)
    assert_same_rows(rows, ref)
    assert_same_tensors(work / f"packed-mcore-{layout}", work / "packed-native")
    if nproc == 1:
        plain = train(work, "unpacked-mcore", 1, "megatron-core", data=data)
        assert abs(plain[0]["loss"] - rows[0]["loss"]) > 1e-3  # the flags changed what was computed


@pytest.fixture(scope="module")
def mixtral(work):
    """A tiny Mixtral (4 experts, top-2), converted, with the native engine's reference run (aux loss 0.01)."""
    from shardkit.cli import main as cli
    from tests import moe_models

    root = work / "mixtral"
    moe_models.build("mixtral", root / "hf")
    assert cli(["convert", "hf-to-mcore", str(root / "hf"), str(root / "ck"), "--quiet", "--no-verify"]) == 0
    train(work, "mixtral-native", 1, "native", *MOE, load=root / "ck")
    return root


MOE = ["--moe-aux-loss-coeff", "0.01"]
MOE_LAYOUTS = {"1rank": (1, ()), "1rank-allgather": (1, ("--moe-token-dispatcher-type", "allgather")),
               "tp2-sp": (2, ("--tp", "2", "--sequence-parallel")),
               "ep2": (2, ("--expert-model-parallel-size", "2")),
               "tp2-sp-etp1-ep2": (2, ("--tp", "2", "--sequence-parallel", "--expert-tensor-parallel-size", "1",
                                       "--expert-model-parallel-size", "2"))}


@pytest.mark.parametrize("layout", list(MOE_LAYOUTS))
def test_mixtral_equals_native(work, mixtral, layout):
    """Mixtral's MoE layers on megatron-core (its router, load-balancing loss, token dispatcher and SequentialMLP;
    the per-expert weights loaded from and saved into shardkit's stacked expert tensors) equal the native engine:
    losses, grad norms (the aux loss's gradient included), and every saved weight and optimizer moment."""
    ref = [json.loads(line) for line in (work / "mixtral-native" / "metrics.jsonl").read_text().splitlines()]
    nproc, flags = MOE_LAYOUTS[layout]
    rows = train(work, f"mixtral-mcore-{layout}", nproc, "megatron-core", *MOE, *flags, load=mixtral / "ck")
    assert_same_rows(rows, ref)
    assert_same_moe_rows(rows, ref)
    assert_same_tensors(work / f"mixtral-mcore-{layout}", work / "mixtral-native")


def assert_same_moe_rows(rows: list[dict], ref: list[dict]) -> None:
    """The native engine's MoE log rows, on megatron-core from its own tracked load-balancing loss and its routers'
    routing maps: the loss (over its coefficient) and each layer's max / mean tokens per expert."""
    for r, n in zip(rows, ref):
        assert n["load_balancing_loss"] > 0 and set(n["moe_load_imbalance"]) == {"0", "1"}, n
        np.testing.assert_allclose(r["load_balancing_loss"], n["load_balancing_loss"], rtol=1e-5, atol=0)
        assert r["moe_load_imbalance"] == n["moe_load_imbalance"], (r["iteration"], r["moe_load_imbalance"])
        assert r["moe_max_load_imbalance"] == n["moe_max_load_imbalance"]


def test_megatron_core_save_reshards_exports_and_verifies(work, native, tmp_path):
    """The TP 2 + SP save of the megatron-core engine through shardkit's other commands: `reshard` to TP 1 x PP 2,
    `convert mcore-to-hf`, and `verify` of both against the export (logits equal)."""
    from shardkit.cli import main as cli

    src = work / "mcore-tp2-sp"
    if not src.is_dir():
        train(work, "mcore-tp2-sp", 2, "megatron-core", "--tp", "2", "--sequence-parallel")
    assert cli(["reshard", str(src), str(tmp_path / "rs"), "--tp", "1", "--pp", "2"]) == 0
    assert cli(["convert", "mcore-to-hf", str(src), str(tmp_path / "hf"), "--quiet"]) == 0
    for ck in (src, tmp_path / "rs"):
        assert cli(["verify", str(ck), "--against", str(tmp_path / "hf")]) == 0


def test_megatron_core_save_resumes_on_native(work, native):
    """megatron-core's save after iteration 3 (its distributed-optimizer state gathered into shardkit's canonical
    tensors) resumed by the native engine gives the native straight run's iterations 4 and 5 and its final state."""
    src = work / "mcore-1rank"
    if not (src / "iter_0000003").is_dir():
        train(work, "mcore-1rank", 1, "megatron-core", "--save-interval", "3")
    rows = train(work, "resume-native", 1, "native", load=src / "iter_0000003")
    assert_same_rows(rows, native[3:])
    assert_same_tensors(work / "resume-native", work / "native")


def test_native_save_resumes_on_megatron_core(work, native):
    """The other way: the native save after iteration 3 (fp32 params and moments) loaded into megatron-core's
    distributed optimizer, at TP 2 + SP, continues as the native straight run."""
    rows = train(work, "resume-mcore", 2, "megatron-core", "--tp", "2", "--sequence-parallel",
                 load=work / "native" / "iter_0000003")
    assert_same_rows(rows, native[3:])
    assert_same_tensors(work / "resume-mcore", work / "native")


def test_megatron_core_save_resumes_on_megatron_core_at_another_layout(work, native):
    """megatron-core's own save (one rank) resumed by megatron-core at PP 2: the optimizer state back into its
    distributed optimizer through the sharding table, the schedule's position from train_state.json."""
    src = work / "mcore-1rank"
    if not (src / "iter_0000003").is_dir():
        train(work, "mcore-1rank", 1, "megatron-core", "--save-interval", "3")
    rows = train(work, "resume-mcore-pp2", 2, "megatron-core", "--pp", "2", load=src / "iter_0000003")
    assert_same_rows(rows, native[3:])
    assert_same_tensors(work / "resume-mcore-pp2", work / "native")


def test_torch_dist_save_resumes_on_native(work, native):
    """--save-format torch_dist through the same save path (train/torch_dist_ckpt.py, every rank its own DCP items):
    megatron-core's TP 2 + SP save after iteration 3 resumed by the native engine on one process, and by megatron-core
    at PP 2 (a torch_dist --load), continues as the straight run."""
    rows = train(work, "mcore-td", 2, "megatron-core", "--tp", "2", "--sequence-parallel", "--save-format",
                 "torch_dist", "--exit-interval", "3")
    assert_same_rows(rows, native[:3])
    assert (work / "mcore-td" / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    rows = train(work, "resume-td", 1, "native", load=work / "mcore-td")
    assert_same_rows(rows, native[3:])
    assert_same_tensors(work / "resume-td", work / "native")
    # and by megatron-core itself, at PP 2 (its torch_dist --load: by region, as the native engine reads it)
    rows = train(work, "resume-td-mcore", 2, "megatron-core", "--pp", "2", load=work / "mcore-td")
    assert_same_rows(rows, native[3:])
    assert_same_tensors(work / "resume-td-mcore", work / "native")


def test_nan_stops_before_the_step(work, tmp_path):
    """The native engine's NaN stop (tests/test_nan_stop.py's huge LR): iteration 2's gradients are NaN; the run
    stops before that optimizer step with the native engine's one line, `latest` stays on iteration 1."""
    os.environ[SWITCH] = "1"
    try:
        r = launch(1, "--load", str(work / "ck"), "--data-path", str(work / "data"), "--save", str(tmp_path / "s"),
                   "--engine", "megatron-core", "--seq-length", "32", "--micro-batch-size", "1",
                   "--global-batch-size", "4", "--lr", "1e8", "--clip-grad", "0", "--seed", "7", "--train-iters", "4",
                   "--save-interval", "1", "--attention-dropout", "0", "--hidden-dropout", "0", check=False)
    finally:
        os.environ.pop(SWITCH, None)
    errors = [line for line in r.stderr.splitlines() if line.startswith("shardkit: error:")]
    assert r.returncode != 0 and len(errors) == 1, (r.stdout[-2000:], r.stderr[-2000:])
    assert errors[0].startswith("shardkit: error: iteration 2: grad norm nan") and "stopped before" in errors[0]
    assert (tmp_path / "s" / "latest").read_text().strip() == "iter_0000001"


def test_bf16_follows_native(work):
    """--bf16 (megatron-core's Float16Module, fp32 main params in its distributed optimizer) at DP 2 follows the
    native engine's bf16 run within 1e-3 per step (the norms and the softmax round in other places)."""
    ref = train(work, "native-bf16", 1, "native", "--bf16")
    rows = train(work, "mcore-bf16", 2, "megatron-core", "--bf16")
    np.testing.assert_allclose([r["loss"] for r in rows], [r["loss"] for r in ref], rtol=1e-3)
    np.testing.assert_allclose([r["grad_norm"] for r in rows], [r["grad_norm"] for r in ref], rtol=1e-2)


def test_tied_embeddings_at_pp2(tmp_path):
    """Tied input/output embeddings: megatron-core's last-stage copy of the embedding (read from the first stage's
    regions, its gradient summed over the embedding group) at PP 2 against the native engine on one process. Losses
    and grad norms within 1e-5; the saved tensors within 1e-4 of the largest value: with the two uses of the weight
    summed in another order, Adam's update of elements whose gradient is near zero amplifies the rounding (largest
    seen: 6e-5 in one linear_fc2 weight; 1.4e-5 in the embedding)."""
    import torch

    from shardkit.cli import main as cli
    from shardkit.demo import build_tiny_llama
    from tests.corpus import write_pattern_corpus

    build_tiny_llama(tmp_path / "hf", dtype=torch.float32, tie_word_embeddings=True)
    assert cli(["convert", "hf-to-mcore", str(tmp_path / "hf"), str(tmp_path / "ck"), "--quiet", "--no-verify"]) == 0
    write_pattern_corpus(tmp_path / "data")
    ref = train(tmp_path, "native", 1, "native")
    rows = train(tmp_path, "mcore-pp2", 2, "megatron-core", "--pp", "2")
    assert_same_rows(rows, ref)
    assert_same_tensors(tmp_path / "mcore-pp2", tmp_path / "native", tol=1e-4)


def test_pickle_allowlist_kept(work, tmp_path):
    """A megatron-core run leaves torch.load's safe globals as they were (megatron-core registers ~26 classes when
    imported); a bare import would have changed them. In a subprocess: the test process never imports megatron-core."""
    code = f"""
import os, sys, torch
os.environ[{SWITCH!r}] = "1"
import torch._dynamo  # torch's own import registers its DTensor classes (the trainer imports it before init)
before = sorted(str(g) for g in torch.serialization.get_safe_globals())  # a set inside torch: compare sorted
from shardkit.cli import main
rc = main(["continue-pretrain", "--load", {str(work / "ck")!r}, "--data-path", {str(work / "data")!r},
           "--engine", "megatron-core", "--train-iters", "1", "--micro-batch-size", "2", "--global-batch-size", "2",
           "--seq-length", "16", "--attention-dropout", "0", "--hidden-dropout", "0"])
assert rc == 0, rc
assert "megatron.core" in sys.modules
after = sorted(str(g) for g in torch.serialization.get_safe_globals())
assert after == before, sorted(set(after) - set(before))
from megatron.core.safe_globals import register_safe_globals
register_safe_globals()  # what importing megatron-core does (megatron/core/__init__.py): registers its classes
assert len(torch.serialization.get_safe_globals()) > len(before)
print("ALLOWLIST KEPT", len(before))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300,
                       env=dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1"))
    assert r.returncode == 0 and "ALLOWLIST KEPT" in r.stdout, (r.stdout[-2000:], r.stderr[-6000:])


def test_default_engine_on_the_cpu_is_native():
    import torch

    from train.engines.choice import default_engine

    assert not torch.cuda.is_available() and default_engine() == "native"


@pytest.mark.parametrize("flags,switch,says", [
    ((), False, "megatron-core's engine runs on CUDA"),
    (("--fp8-format", "hybrid"), True, "--fp8-format hybrid: megatron-core cannot run it on the CPU"),
    (("--transformer-impl", "transformer_engine"), True, "TE's layer spec"),
    # GPTModel's RoPE takes 0..s-1 (with --reset-attention-mask the reset positions change nothing: relative RoPE)
    (("--reset-position-ids", "--eod-token-id", "2"), True, "--reset-position-ids without --reset-attention-mask"),
    # on 2 ranks (PP 2): the interleaved schedule's micro-batch groups
    (("--pp", "2", "--vpp", "2", "--global-batch-size", "2"), True, "in groups of --pp 2, but each DP rank has 1"),
])
def test_refused_in_one_line(work, flags, switch, says):
    """What megatron-core cannot do on a CPU (and the CPU itself without the test switch) is one error line, exit 1,
    before any iteration; the default engine on the CPU is the native one."""
    old = os.environ.pop(SWITCH, None)
    if switch:
        os.environ[SWITCH] = "1"
    try:
        r = launch(2 if "--pp" in flags else 1, "--load", str(work / "ck"), "--data-path", str(work / "data"),
                   "--engine", "megatron-core", *FLAGS, *flags, check=False)
    finally:
        os.environ.pop(SWITCH, None)
        if old is not None:
            os.environ[SWITCH] = old
    errors = [line for line in (r.stdout + r.stderr).splitlines() if line.startswith("shardkit: error:")]
    # one line (the same on every rank)
    assert r.returncode != 0 and len(set(errors)) == 1 and says in errors[0], (r.stdout[-2000:], r.stderr[-2000:])
    assert "--engine megatron-core" in errors[0] and "iteration 1" not in r.stdout


QWEN3 = {  # (kind, build overrides, layout flags): dense at TP 2 without SP (megatron-core sums the q/k norms'
    # gradients over TP then too), the MoE one at TP 2 with SP (megatron-core's MoE layers need SP under TP)
    "qwen3-tp2": ("qwen3", {"num_hidden_layers": 2}, ("--tp", "2")),
    "qwen3_moe-tp2-sp": ("qwen3_moe", {"num_hidden_layers": 2, "mlp_only_layers": []}, ("--tp", "2", "--sequence-parallel")),
}


@pytest.mark.parametrize("case", list(QWEN3))
def test_qwen3_equals_native(work, case):
    """Qwen3 / Qwen3-MoE on megatron-core (TransformerConfig.qk_layernorm: its local spec's per-head q/k layernorms)
    equal the native engine from the same converted checkpoint: losses, grad norms, every weight and moment."""
    from shardkit.cli import main as cli
    from tests.test_qwen3 import build

    kind, over, flags = QWEN3[case]
    root = work / kind
    if not (root / "ck").exists():
        build(kind, root / "hf", vocab_size=1000, **over)
        assert cli(["convert", "hf-to-mcore", str(root / "hf"), str(root / "ck"), "--quiet", "--no-verify"]) == 0
    moe = MOE if kind == "qwen3_moe" else []
    ref = train(work, f"{kind}-native", 1, "native", *moe, load=root / "ck")
    rows = train(work, f"{case}-mcore", 2, "megatron-core", *moe, *flags, load=root / "ck")
    assert_same_rows(rows, ref)
    if moe:
        assert_same_moe_rows(rows, ref)
    assert_same_tensors(work / f"{case}-mcore", work / f"{kind}-native")
