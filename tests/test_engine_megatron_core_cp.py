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
    "cp2-tp2-sp": (4, ("--context-parallel-size", "2", "--tp", "2", "--sequence-parallel")),
    "cp2-dp2": (4, ("--context-parallel-size", "2")),
}


def both(work: Path, layout: str, *extra: str, load: Path | None = None, data: Path | None = None,
         tag: str = "") -> tuple[list, list]:
    """The native engine's and megatron-core's runs at `layout` from the same checkpoint (a save after the 3rd
    iteration and at the end)."""
    nproc, flags = LAYOUTS[layout]
    ref = train(work, f"cp-native-{layout}{tag}", nproc, "native", "--save-interval", "3", *flags, *extra, load=load,
                data=data)
    rows = train(work, f"cp-mcore-{layout}{tag}", nproc, "megatron-core", "--save-interval", "3", *flags, *extra,
                 load=load, data=data)
    return ref, rows


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_context_parallel_equals_native(work, layout):
    """megatron-core at CP 2 (ring and all-gather attention; with TP 2 + SP; with DP 2, its optimizer sharded over
    DP x CP = 4) equals the native engine at the same layout: losses, grad norms, LRs, saved weights and moments."""
    ref, rows = both(work, layout)
    assert len(rows) == 5 and max(r["grad_norm"] for r in rows) > 1.0  # clipping was exercised
    assert_same_rows(rows, ref)
    worst = assert_same_tensors(work / f"cp-mcore-{layout}", work / f"cp-native-{layout}")
    print(f"{layout}: largest relative difference of a saved tensor {worst:.2e}")


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


def test_mixtral_context_parallel_equals_native(work, mixtral_ck):
    """Mixtral's MoE layers at CP 2 (each CP rank routes its own chunks' tokens; megatron-core's load-balancing loss
    counts them over its tp_cp group and scales its gradient by cp, as the native engine's) equal the native engine
    at CP 2: losses, grad norms, the MoE log rows, every saved weight and moment."""
    from tests.test_engine_megatron_core import MOE, assert_same_moe_rows

    ref, rows = both(work, "cp2", *MOE, load=mixtral_ck, tag="-mixtral")
    assert_same_rows(rows, ref)
    assert_same_moe_rows(rows, ref)
    assert_same_tensors(work / "cp-mcore-cp2-mixtral", work / "cp-native-cp2-mixtral")


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
