"""Context parallelism on the megatron-core engine (issue 40): `--context-parallel-size N` with megatron-core's CP
pieces (its process groups, TransformerConfig.context_parallel_size, RoPE sliced per CP rank, gradients reduced and
the distributed optimizer sharded over DP x CP) and, Transformer Engine being absent here, shardkit's own CP attention
(train/parallel/context.py's ring and all-gather, the native engine's) as megatron-core's core attention.

Each megatron-core run starts from the same native checkpoint as the native engine's run at the same layout and equals
it over 5 steps: losses, grad norms, LRs, and every saved weight, fp32 param and Adam moment within 1e-5. megatron-core
runs on the CPU through the engine's test switch (tests/test_engine_megatron_core.py's helpers). What each CP rank
reads is megatron-core's own split: prepare_micro_batch against megatron-core's get_batch_on_this_cp_rank (the 0.16
engine's and, where the oracle environment exists, 0.19's), run in a subprocess (the test process never imports
megatron-core)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.launcher import REPO
from tests.test_engine_megatron_core import (  # noqa: F401  (work: the module's fixture)
    FLAGS, SWITCH, assert_same_rows, assert_same_tensors, train, work)

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core not installed")

ORACLE312 = REPO / ".venv-oracle312" / "bin" / "python"

# layouts (processes, flags) run by both engines
LAYOUTS = {
    "cp2": (2, ("--context-parallel-size", "2")),
    "cp2-allgather": (2, ("--context-parallel-size", "2", "--cp-comm-type", "all_gather")),
    # and an evaluation after the last step (its loss summed over TP x CP, as the training loss)
    "cp2-tp2-sp": (4, ("--context-parallel-size", "2", "--tp", "2", "--sequence-parallel", "--eval-interval", "5",
                       "--eval-iters", "1")),
    "cp2-dp2": (4, ("--context-parallel-size", "2")),
    "cp2-pp2": (4, ("--context-parallel-size", "2", "--pp", "2")),  # megatron-core's 1F1B exchanges of s / cp tokens
}


def run(work: Path, engine: str, layout: str, *extra: str, load: Path | None = None, data: Path | None = None,
        tag: str = "") -> list[dict]:
    """One engine's run at `layout` (a save after the 3rd iteration and at the end), or its rows where it ran
    already (in this module's directory)."""
    name = f"cp-{'mcore' if engine == 'megatron-core' else engine}-{layout}{tag}"
    if (work / name / "iter_0000005").is_dir():
        return [json.loads(line) for line in (work / name / "metrics.jsonl").read_text().splitlines()]
    nproc, flags = LAYOUTS[layout]
    return train(work, name, nproc, engine, "--save-interval", "3", *flags, *extra, load=load, data=data)


def both(work: Path, layout: str, *extra: str, load: Path | None = None, data: Path | None = None,
         tag: str = "") -> tuple[list, list]:
    """The native engine's and megatron-core's runs at `layout` from the same checkpoint."""
    return (run(work, "native", layout, *extra, load=load, data=data, tag=tag),
            run(work, "megatron-core", layout, *extra, load=load, data=data, tag=tag))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_context_parallel_equals_native(work, layout):
    """megatron-core at CP 2 (ring and all-gather attention; with TP 2 + SP, and an evaluation; with DP 2, its
    optimizer sharded over DP x CP = 4; with PP 2) equals the native engine at the same layout: losses, grad norms, LRs, saved
    weights and moments."""
    ref, rows = both(work, layout)
    assert len(rows) == 5 and max(r["grad_norm"] for r in rows) > 1.0  # clipping was exercised
    assert_same_rows(rows, ref)
    if "--eval-iters" in LAYOUTS[layout][1]:
        assert rows[-1]["valid_loss"] > 0
        np.testing.assert_allclose(rows[-1]["valid_loss"], ref[-1]["valid_loss"], rtol=1e-5, atol=0)
    worst = assert_same_tensors(work / f"cp-mcore-{layout}", work / f"cp-native-{layout}")
    print(f"{layout}: largest relative difference of a saved tensor {worst:.2e}")


def test_save_resumes_on_native(work):
    """megatron-core's CP 2 x DP 2 save after iteration 3 (its optimizer sharded over DP x CP = 4 ranks, gathered to
    each DP rank's CP rank 0) resumed by the native engine on one process continues as the native engine's CP 2 x DP 2
    straight run: iterations 4 and 5 and the final weights and moments."""
    ref = run(work, "native", "cp2-dp2")
    run(work, "megatron-core", "cp2-dp2")
    rows = train(work, "cp-resume-native", 1, "native", load=work / "cp-mcore-cp2-dp2" / "iter_0000003")
    assert_same_rows(rows, ref[3:])
    assert_same_tensors(work / "cp-resume-native", work / "cp-native-cp2-dp2")


def test_native_save_resumes_on_megatron_core(work):
    """The other way: the native engine's CP 2 save after iteration 3 loaded into megatron-core's distributed
    optimizer at CP 2 x DP 2 (each rank its range of DP x CP) continues as the native straight run."""
    ref = run(work, "native", "cp2")
    rows = train(work, "cp-resume-mcore", 4, "megatron-core", "--context-parallel-size", "2",
                 load=work / "cp-native-cp2" / "iter_0000003")
    assert_same_rows(rows, ref[3:])
    assert_same_tensors(work / "cp-resume-mcore", work / "cp-native-cp2")


PACKED = ["--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss", "--eod-token-id", "2"]


@pytest.mark.parametrize("layout", ["cp2", "cp2-allgather"])
def test_packed_documents_equal_native(work, layout):
    """Packed documents under CP (Megatron's three flags; documents crossing the zigzag chunks and the ranks): the
    ring's blocks and the all-gathered prefixes masked per document from global positions, the loss over the
    EOD-masked tokens of the whole micro-batch; megatron-core equals the native engine at the same layout."""
    from tests.corpus import write_packed_corpus

    data = work / "cp-packed-data"
    if not data.exists():
        write_packed_corpus(data, eod=2, lengths=(5, 14))
    ref, rows = both(work, layout, *PACKED, data=data, tag="-packed")
    assert_same_rows(rows, ref)
    assert_same_tensors(work / f"cp-mcore-{layout}-packed", work / f"cp-native-{layout}-packed")


# megatron-core's split of a micro-batch for each CP rank, in a subprocess of the given interpreter: its
# get_batch_on_this_cp_rank (0.16: (batch, cp_group); 0.19: (batch, is_hybrid_cp, cp_group)) and its RoPE's
# get_pos_emb_on_this_cp_rank, on a stand-in CP group (size and rank: what both read of it)
SPLIT = """
import inspect, sys, torch
import torch.distributed as dist
sys.path.insert(0, sys.argv[3])
from train.engines.cpu_shims import cuda_as_cpu
cuda_as_cpu()  # get_pos_emb_on_this_cp_rank's index goes through pinned memory and .cuda()
from megatron.core import utils as mu
from megatron.core.models.common.embeddings.rope_utils import get_pos_emb_on_this_cp_rank

class Group:
    def __init__(self, size, rank):
        self._size, self._rank = size, rank
    def size(self):
        return self._size
    def rank(self):
        return self._rank

world_size, rank = dist.get_world_size, dist.get_rank
dist.get_world_size = lambda group=None: group.size() if isinstance(group, Group) else world_size(group)
dist.get_rank = lambda group=None: group.rank() if isinstance(group, Group) else rank(group)
dist.is_initialized = lambda: True
whole = torch.load(sys.argv[1])
hybrid = "is_hybrid_cp" in inspect.signature(mu.get_batch_on_this_cp_rank).parameters
out = {}
for cp in (2, 3):
    for r in range(cp):
        g = Group(cp, r)
        batch = {k: None if v is None else v.clone() for k, v in whole.items()}
        out[cp, r] = (mu.get_batch_on_this_cp_rank(batch, False, cp_group=g) if hybrid
                      else mu.get_batch_on_this_cp_rank(batch, cp_group=g))
        emb = torch.arange(whole["tokens"].shape[1], dtype=torch.float32)[:, None, None, None]
        out[cp, r]["rope_positions"] = get_pos_emb_on_this_cp_rank(emb, 0, g).reshape(-1)
torch.save(out, sys.argv[2])
"""


@pytest.mark.parametrize("oracle", ["engine", "0.19"])
def test_cp_split_is_megatron_cores(tmp_path, oracle):
    """What each CP rank reads (prepare_micro_batch: tokens, labels, RoPE positions, loss weights) is megatron-core's
    get_batch_on_this_cp_rank of the whole micro-batch (the engine's megatron-core, and 0.19's in the oracle
    environment), at CP 2 and 3, with packed documents (reset positions, EOD-masked loss); and megatron-core's RoPE
    slices the whole length's positions for a CP rank as the split gives them."""
    import torch

    from train.parallel.context import Packing, ltor_masks_and_position_ids, prepare_micro_batch, zigzag_index

    python = sys.executable if oracle == "engine" else ORACLE312
    if not Path(python).exists():
        pytest.skip(f"{python}: the oracle environment is not built (scripts/oracle_env.sh)")
    sample = (torch.arange(2 * 25).view(2, 25) * 7) % 11  # token 2 is EOD: documents of varying length
    packing = Packing(2, True, True, True)
    positions, loss_mask, _ = ltor_masks_and_position_ids(sample[:, :-1], packing)
    whole = {"tokens": sample[:, :-1], "labels": sample[:, 1:], "loss_mask": loss_mask, "position_ids": positions,
             "attention_mask": None}
    torch.save(whole, tmp_path / "whole.pt")
    r = subprocess.run([str(python), "-c", SPLIT, str(tmp_path / "whole.pt"), str(tmp_path / "split.pt"), str(REPO)],
                       capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=""))
    assert r.returncode == 0, r.stderr[-3000:]
    theirs = torch.load(tmp_path / "split.pt")
    assert sorted(theirs) == [(2, 0), (2, 1), (3, 0), (3, 1), (3, 2)]
    for (cp, rank), t in theirs.items():
        tokens, labels, extras = prepare_micro_batch(sample, cp, rank, packing)
        assert torch.equal(tokens, t["tokens"]) and torch.equal(labels, t["labels"])
        assert torch.equal(extras.position_ids, t["position_ids"])
        assert torch.equal(extras.loss_weight, t["loss_mask"] * (cp / loss_mask.sum()))
        assert torch.equal(t["rope_positions"].long(), zigzag_index(24, cp, rank))
        assert t["attention_mask"] is None


@pytest.fixture(scope="module")
def mixtral_ck(work):
    """A tiny Mixtral (4 experts, top-2), converted."""
    from shardkit.cli import main as cli
    from tests import moe_models

    root = work / "cp-mixtral"
    if not (root / "ck").exists():
        moe_models.build("mixtral", root / "hf")
        assert cli(["convert", "hf-to-mcore", str(root / "hf"), str(root / "ck"), "--quiet", "--no-verify"]) == 0
    return root / "ck"


@pytest.mark.parametrize("ep", ["ep1", "ep2"])
def test_mixtral_context_parallel_equals_native(work, mixtral_ck, ep):
    """Mixtral's MoE layers at CP 2 (each CP rank routes its own chunks' tokens; megatron-core's load-balancing loss
    counts them over its tp_cp group and scales its gradient by cp, as the native engine's), and with EP 2 inside
    DP x CP (the experts' optimizer state over their expert-data-parallel group), equal the native engine at the same
    layout: losses, grad norms, the MoE log rows, every saved weight and moment."""
    from tests.test_engine_megatron_core import MOE, assert_same_moe_rows

    extra = ("--expert-model-parallel-size", "2") if ep == "ep2" else ()
    ref, rows = both(work, "cp2", *MOE, *extra, load=mixtral_ck, tag=f"-mixtral-{ep}")
    assert_same_rows(rows, ref)
    assert_same_moe_rows(rows, ref)
    assert_same_tensors(work / f"cp-mcore-cp2-mixtral-{ep}", work / f"cp-native-cp2-mixtral-{ep}")


@pytest.fixture(scope="module")
def deepseek_ck(work):
    """Tiny DeepSeek-V2-Lite (multi-latent attention, 2 layers: one dense, one MoE) and V3 (with an MTP layer),
    converted."""
    from shardkit.cli import main as cli
    from tests import moe_models

    out = {}
    for kind, over in (("deepseek_v2_lite", dict(num_hidden_layers=2)),
                       ("deepseek_v3", dict(num_hidden_layers=2, n_group=2, topk_group=1))):
        root = work / f"cp-{kind}"
        if not (root / "ck").exists():
            moe_models.build(kind, root / "hf", **over)
            assert cli(["convert", "hf-to-mcore", str(root / "hf"), str(root / "ck"), "--quiet", "--no-verify"]) == 0
        out[kind] = root / "ck"
    return out


def test_mla_context_parallel_equals_native(work, deepseek_ck):
    """Multi-latent attention at CP 2: q / k heads of qk_head_dim + qk_pos_emb_head_dim and v heads of v_head_dim
    through shardkit's ring, megatron-core's YaRN RoPE sliced per CP rank; DeepSeek-V2-Lite equals the native engine
    at CP 2 (losses, grad norms, weights, moments)."""
    ref, rows = both(work, "cp2", "--moe-aux-loss-coeff", "0.01", load=deepseek_ck["deepseek_v2_lite"], tag="-mla")
    assert_same_rows(rows, ref)
    assert_same_tensors(work / "cp-mcore-cp2-mla", work / "cp-native-cp2-mla")


def test_mtp_refused_in_one_line(work, deepseek_ck):
    """MTP layers under CP: megatron-core divides each CP rank's MTP loss by that rank's own token count, the native
    engine by the whole micro-batch's (train/moe.py): one error line naming the flag, before any iteration."""
    from tests.launcher import launch

    os.environ[SWITCH] = "1"
    try:
        r = launch(2, "--load", str(deepseek_ck["deepseek_v3"]), "--data-path", str(work / "data"), "--engine",
                   "megatron-core", *FLAGS, "--context-parallel-size", "2", check=False)
    finally:
        os.environ.pop(SWITCH, None)
    errors = [line for line in (r.stdout + r.stderr).splitlines() if line.startswith("shardkit: error:")]
    assert r.returncode != 0 and len(set(errors)) == 1, (r.stdout[-2000:], r.stderr[-2000:])
    assert errors[0].startswith("shardkit: error: --engine megatron-core: --context-parallel-size 2 with MTP layers")
    assert "iteration 1" not in r.stdout


def test_launch_refuses_mtp_under_cp(work, deepseek_ck, capsys):
    """`shardkit launch --engine megatron-core` at CP 2 with an MTP model: the engine's one line before any script
    is written (the trainer would refuse it at start-up on the GPUs); at CP 1 the same model launches."""
    from shardkit.cli import main

    train_args = ["--", "--load", str(deepseek_ck["deepseek_v3"]), "--data-path", str(work / "data"),
                  "--global-batch-size", "4", "--micro-batch-size", "2", "--seq-length", "32", "--attention-dropout",
                  "0"]
    launch = ["launch", "--nodes", "1", "--gpus-per-node", "2", "--engine", "megatron-core", "--dry-run"]
    assert main([*launch, "--layout", "tp=1,cp=2,dp=1", *train_args]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--engine megatron-core: --context-parallel-size 2 with MTP layers" in err, err
    assert main([*launch, "--layout", "tp=1,dp=2", *train_args]) == 0
