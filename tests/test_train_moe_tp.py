"""Tensor parallelism for MoE and multi-latent attention (issue 19): tiny Mixtral and DeepSeek-V3 trained at the layouts
Megatron's recipes use (TP 2 with sequence parallelism, TP 2 x EP 2, expert TP 1 under TP 2, with PP 2, the allgather
token dispatcher) give the numbers of one process over 5 steps: losses, gradient norms, the MoE logs and every saved
tensor (weights and optimizer state).

Each model's one-process run is shared by its layouts. DeepSeek-V3 has MTP, shared experts, a dense first layer,
group-limited sigmoid routing with expert bias and seq_aux_loss; it runs with q_lora (q down/up projections) and
without it (one q projection). Every run is a real `shardkit continue-pretrain` (torchrun on gloo). Multi-latent
attention's TP code is the same at every layout; the cases spread the expert layouts over the models. A DeepSeek-V3 run
saved at TP 2 x EP 2 x ETP 1 resumes at TP 1 x EP 4 after `shardkit reshard` and follows the one-process run; its
export matches transformers. `plan` charges what the trainer's stage builder allocates at these layouts.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from checkpoint.reader import Checkpoint
from tests import moe_models
from tests.test_train import launch, real_rows
from tests.test_train_moe import FLAGS

# two sequences per micro-batch: the sequence-level aux loss and the SP slices see batch-major tokens of two sequences
COMMON = ["--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "3e-3",
          "--lr-warmup-iters", "1", "--min-lr", "3e-4", "--clip-grad", "1.0", "--seed", "7", "--train-iters", "5",
          "--attention-dropout", "0", "--hidden-dropout", "0"]
SP = ["--tp", "2", "--sequence-parallel"]
# model -> (HF builder kind, overrides, flags of test_train_moe); DeepSeek-V3 with 2 layers (dense, MoE) + 1 MTP layer
MODELS = {"mixtral": ("mixtral", {}, FLAGS["mixtral"]),
          "deepseek_v3": ("deepseek_v3", {"num_hidden_layers": 2}, FLAGS["deepseek_v3"]),
          "deepseek_v3_no_q_lora": ("deepseek_v3", {"num_hidden_layers": 2, "q_lora_rank": None},
                                    FLAGS["deepseek_v3"])}
# (model, layout name, processes, flags). ETP = TP (Megatron's default) unless --etp says otherwise:
#   tp2-sp              the routed experts' ffn split over the 2 TP ranks (EP 1): rows gathered over expert TP
#   tp2-ep2             EP groups of 2 inside DP 2, each expert's ffn split over its TP pair
#   tp2-pp2-ep2-etp1    two pipeline stages, whole experts: each stage's EP group is its TP pair (DeepSeek-V3
#                       recipe's shape: TP 2, PP, EP over TP x DP, ETP 1)
#   tp2-etp1            whole experts on both TP ranks (EP 1): their expert-data-parallel group is the TP pair
#   tp2-ep2-allgather   Megatron's allgather dispatcher over the expert TP x EP group (all 4 ranks)
CASES = [("mixtral", "tp2-sp", 2, SP),
         ("mixtral", "tp2-pp2-ep2-etp1", 4, [*SP, "--pp", "2", "--ep", "2", "--etp", "1"]),
         ("mixtral", "tp2-ep2-allgather", 4, [*SP, "--ep", "2", "--moe-token-dispatcher-type", "allgather"]),
         ("deepseek_v3", "tp2-ep2", 4, [*SP, "--ep", "2"]), ("deepseek_v3", "tp2-etp1", 2, [*SP, "--etp", "1"]),
         ("deepseek_v3_no_q_lora", "tp2-sp", 2, SP)]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    from shardkit.cli import main as cli
    from tests.corpus import write_pattern_corpus

    root = tmp_path_factory.mktemp("train_moe_tp")
    for name, (kind, overrides, _) in MODELS.items():
        moe_models.build(kind, root / f"{name}-hf", **overrides)
        assert cli(["convert", "hf-to-mcore", str(root / f"{name}-hf"), str(root / f"{name}-ck"), "--quiet", "--no-verify"]) == 0
    write_pattern_corpus(root / "data")
    return root


def _train(root: Path, model: str, name: str, nproc: int, layout: list[str]) -> Path:
    out = root / f"{model}-{name}"
    if not (out / "latest").exists():
        launch(nproc, "--load", str(root / f"{model}-ck"), "--data-path", str(root / "data"), "--save", str(out),
               *COMMON, *MODELS[model][2], *layout)
    return out


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("model,name,nproc,layout", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_tensor_parallel_moe_equals_one_process(root, model, name, nproc, layout):
    base = _train(root, model, "one-process", 1, [])
    ref = _records(base)
    assert len(ref) == 5
    run = _train(root, model, name, nproc, layout)
    got = _records(run)
    np.testing.assert_allclose([r["loss"] for r in got], [r["loss"] for r in ref], rtol=1e-5)
    np.testing.assert_allclose([r["grad_norm"] for r in got], [r["grad_norm"] for r in ref], rtol=1e-5)
    for r, w in zip(got, ref):  # the MoE logs: global sums over the TP ranks' sequence slices too
        assert r["moe_load_imbalance"] == w["moe_load_imbalance"]
        for key in ("load_balancing_loss", "seq_load_balancing_loss", "mtp_loss"):
            assert (key in r) == (key in w)
            if key in w:
                assert r[key] == pytest.approx(w[key], rel=1e-5), key
    # every weight and optimizer state after 5 steps (expert shards, replicated router and latent projections, MTP),
    # within 1e-5 relative: only summation orders differ (TP partial sums, token dispatch)
    a = real_rows(Checkpoint(base / "iter_0000005"))
    ck = Checkpoint(run / "iter_0000005")
    b = real_rows(ck)
    assert set(a) == set(b)
    for t in a:
        assert (a[t] - b[t]).norm().item() <= 1e-5 * a[t].norm().item(), t
    lay = ck.manifest.layout
    want_ep = int(layout[layout.index("--ep") + 1]) if "--ep" in layout else 1
    want_etp = int(layout[layout.index("--etp") + 1]) if "--etp" in layout else 2
    assert (lay.tp, lay.ep, lay.expert_tp) == (2, want_ep, want_etp)


def test_moe_at_tp_without_sequence_parallel_is_one_line(root):
    """Megatron requires sequence parallelism for MoE under TP: without it, the job says so in one line (the first
    rank to reach it; train/report.py: said once per job, issue 37) and every rank exits non-zero before any weight is
    read (no traceback of ours)."""
    r = launch(2, "--load", str(root / "mixtral-ck"), "--data-path", str(root / "data"), *COMMON, "--tp", "2",
               check=False)
    lines = [line for line in r.stderr.splitlines() if line.startswith("shardkit: error:")]
    assert r.returncode != 0 and len(lines) == 1, r.stderr[-3000:]
    assert "--tp 2 with an MoE model (mixtral) needs --sequence-parallel" in lines[0]
    assert "Traceback" not in r.stderr
    assert "[rank0]: Traceback" not in r.stderr and "[rank1]: Traceback" not in r.stderr


# (tp, cp, dp, pp, ep, etp): expert TP other than TP, as DeepSeek-V3's recipe (TP 2, ETP 1) and wider
ETP_CASES = [(2, 1, 2, 2, 2, 1), (2, 1, 1, 1, 1, 1), (4, 1, 2, 1, 4, 2), (2, 2, 2, 1, 8, 1), (2, 1, 3, 2, 3, 1),
             (1, 1, 4, 1, 2, 2)]
ETP_ORACLE = """
import json, sys
from megatron.core.parallel_state import RankGenerator
out = []
for tp, cp, dp, pp, ep, etp in json.loads(sys.argv[1]):
    # initialize_model_parallel's expert generator: expert-data-parallel size = world / (etp x ep x pp)
    expert = RankGenerator(tp=etp, ep=ep, dp=tp * cp * dp // (etp * ep), pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    out.append({t: expert.get_ranks(t) for t in ("tp", "ep", "tp-ep", "dp")})
print("ORACLE " + json.dumps(out))
"""


def test_expert_groups_with_etp_match_megatron():
    """The trainer's expert groups (expert TP, EP, expert TP x EP for the allgather dispatcher, expert DP) and each
    rank's coordinates in them, for ETP != TP, against megatron-core's own RankGenerator (run in a subprocess)."""
    import importlib.util
    import subprocess
    import sys

    from checkpoint.megatron import EXPERT_ORDER, coords_of
    from checkpoint.run_layout import RunLayout
    from train.parallel.groups import _expert_groups, _expert_tp_ep_groups, _expert_tp_groups

    assert importlib.util.find_spec("megatron.core") is not None  # a test dependency (pyproject's test extra)
    r = subprocess.run([sys.executable, "-c", ETP_ORACLE, json.dumps(ETP_CASES)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    oracle = json.loads([ln for ln in r.stdout.splitlines() if ln.startswith("ORACLE ")][-1][len("ORACLE "):])
    for (tp, cp, dp, pp, ep, etp), want in zip(ETP_CASES, oracle):
        dims = RunLayout.from_world(tp * cp * dp * pp, tp, pp, cp=cp, ep=ep, etp=etp)
        want = {k: sorted(sorted(g) for g in v) for k, v in want.items()}
        built = list(_expert_groups(dims))
        got = {"tp": sorted(sorted(g) for g in _expert_tp_groups(dims)),
               "ep": sorted(sorted(g) for ep_groups, _ in built for g in ep_groups),
               "tp-ep": sorted(sorted(g) for g in _expert_tp_ep_groups(dims)),
               "dp": sorted(sorted(g) for _, edp_groups in built for g in edp_groups)}
        assert got == want, (tp, cp, dp, pp, ep, etp)
        for rank in range(dims.world):  # a rank's index in each group is its coordinate (groups list ranks in order)
            c = coords_of(rank, dims.expert_sizes, EXPERT_ORDER)
            for dim, token in (("etp", "tp"), ("ep", "ep"), ("edp", "dp")):
                assert next(g for g in want[token] if rank in g).index(rank) == c[dim]


@pytest.mark.parametrize("model", list(MODELS))
def test_plan_charges_what_the_trainer_allocates(root, model):
    """`plan`'s parameter and gradient bytes per rank equal what the trainer's own stage builder
    (train.parallelize on the meta device, its real process groups on torch's fake backend) allocates on
    every rank, for MoE and MLA at TP, EP, ETP != TP and PP (the last stage keeps a copy of the embedding for MTP)."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from checkpoint.run_layout import RunLayout
    from plan.memory import param_bytes_per_rank
    from train.config import ParallelConfig
    from train.parallel.groups import build_groups
    from train.parallelize import parallelize

    cfg = Checkpoint(root / f"{model}-ck" / "iter_0000000").config
    # TP 4 with whole experts over all 4 ranks (EP 4 x ETP 1), expert TP wider than TP (TP 1, EP 2 x ETP 2)
    for tp, pp, dp, ep, etp in [(2, 1, 1, 1, None), (2, 1, 2, 2, None), (2, 2, 1, 2, 1), (2, 1, 1, 1, 1),
                                (2, 2, 2, 2, None), (4, 1, 1, 4, 1), (1, 1, 4, 2, 2)]:
        dims = RunLayout.from_world(tp * pp * dp, tp, pp, ep=ep, etp=etp)
        for rank in range(dims.world):
            dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=dims.world)
            try:
                groups = build_groups(dims)
                stage = parallelize(cfg, groups, torch.device("meta"), torch.bfloat16,
                                    ParallelConfig(tp=tp, pp=pp, ep=ep, etp=etp, sequence_parallel=True)).model
            finally:
                dist.destroy_process_group()
            n = sum(p.numel() for p in stage.parameters())
            est = param_bytes_per_rank(cfg, dims, dtype="bfloat16", pp_rank=groups.pp_rank)
            assert (est["weights"], est["grads"]) == (2 * n, 4 * n), (tp, pp, dp, ep, etp, rank)


# (name, processes and flags of the first 3 steps, reshard target, processes and flags of the last 2): DeepSeek-V3's
# recipe layout (TP 2 + SP, EP 2, whole experts) moved to TP 1 x EP 4 (DP 4: one sequence per micro-batch, the same
# global batch), and its 2-rank sibling, expert TP 1 under TP 2 moved to TP 1 x EP 2
RESHARD_CASES = [("tp2-ep2-etp1-to-tp1-ep4", 4, [*SP, "--ep", "2", "--etp", "1"], ["--tp", "1", "--ep", "4"],
                  4, ["--ep", "4", "--micro-batch-size", "1"]),
                 ("tp2-etp1-to-tp1-ep2", 2, [*SP, "--etp", "1"], ["--tp", "1", "--ep", "2"], 2, ["--ep", "2"])]


@pytest.mark.parametrize("name,n1,first_layout,target,n2,second_layout", RESHARD_CASES,
                         ids=[c[0] for c in RESHARD_CASES])
def test_resumes_after_reshard_to_another_expert_layout(root, tmp_path, name, n1, first_layout, target, n2,
                                                         second_layout):
    """DeepSeek-V3 (MLA with q_lora, shared expert, dense first layer, expert bias, MTP) trained 3 steps with TP 2 + SP
    and expert TP 1, saved, `shardkit reshard` to TP 1 x EP (weights and optimizer state), resumed there for the last
    2 steps: losses, gradient norms and every weight and optimizer state after step 5 follow the one-process run within
    1e-5; the resumed run's checkpoint exported with `convert mcore-to-hf` gives transformers' own logits."""
    from verify.whole import logit_parity
    from shardkit.cli import main as cli

    model = "deepseek_v3"
    base = _train(root, model, "one-process", 1, [])
    args = ["--data-path", str(root / "data"), *COMMON, *MODELS[model][2]]
    first, moved = tmp_path / "first", tmp_path / "moved"
    launch(n1, "--load", str(root / f"{model}-ck"), *args, "--save", str(first), *first_layout, "--exit-interval", "3")
    assert (first / "latest").read_text().strip() == "iter_0000003"
    assert cli(["reshard", str(first), str(moved), *target, "--quiet"]) == 0
    ck3 = Checkpoint(moved / "iter_0000003")
    assert (ck3.manifest.layout.tp, ck3.manifest.layout.ep, ck3.manifest.layout.expert_tp) == (1, n2, 1)
    launch(n2, "--load", str(moved), *args, "--save", str(moved), *second_layout)
    got, ref = _records(first) + _records(moved), _records(base)
    assert [r["iteration"] for r in got] == [1, 2, 3, 4, 5]
    np.testing.assert_allclose([r["loss"] for r in got], [r["loss"] for r in ref], rtol=1e-5)
    np.testing.assert_allclose([r["grad_norm"] for r in got], [r["grad_norm"] for r in ref], rtol=1e-5)
    for r, w in zip(got, ref):
        assert r["mtp_loss"] == pytest.approx(w["mtp_loss"], rel=1e-5)
        assert r["seq_load_balancing_loss"] == pytest.approx(w["seq_load_balancing_loss"], rel=1e-5)
    # every weight and optimizer state (fp32 main params and both moments; the vocab padding rows left out)
    a, ck = Checkpoint(base / "iter_0000005"), Checkpoint(moved / "iter_0000005")
    assert set(a.tensors) == set(ck.tensors)
    assert sum(n.startswith("optimizer.") for n in a.tensors) == 3 * sum(not n.startswith("optimizer.")
                                                                         for n in a.tensors)
    vocab = a.config.vocab_size
    for t in a.tensors:
        x, y = a.read(t), ck.read(t)
        if a.entry(t).rule == "vocab":
            x, y = x[:vocab], y[:vocab]
        assert (x - y).norm().item() <= 1e-5 * x.norm().item(), t
    assert cli(["convert", "mcore-to-hf", str(moved), str(tmp_path / "hf"), "--quiet"]) == 0
    parity = logit_parity(ck.config, ck.state_dict(), tmp_path / "hf")
    assert parity["max_abs_diff"] < 1e-4, parity
