"""DeepSeek-V2 / V3 on `continue-pretrain --engine megatron-core` (issue 40): megatron-core's MLASelfAttention (local
spec; the engine's own MLA core attention, since megatron-core's local DotProductAttention takes no MLA head sizes),
its MoE layers with shared experts after a dense first layer, group-limited sigmoid routing with an expert bias
(V3, updated by megatron-core's finalize_model_grads) or softmax routing (V2-Lite, no q_lora), loaded from and saved
to shardkit's native checkpoints, with V3's multi-token-prediction layer (megatron-core's MTP block on the last
pipeline stage, its loss weighed by --mtp-loss-scaling-factor), equal the native engine on the same checkpoint and
data over 5 steps.

The tiny models are tests/moe_models.py's, with 2 layers (dense, MoE) and, for V3, 2 expert groups of which 1 is
chosen (megatron-core scores a group by its best topk / group_topk experts: HF's best 2 for V3) and one MTP layer.
Runs as tests/test_engine_megatron_core.py's (the test switch SHARDKIT_MEGATRON_CORE_CPU=1, ranks forked by
tests/launcher.py under NCCL's point-to-point rules)."""
from __future__ import annotations

import importlib.util
import json
import os

import numpy as np
import pytest

from tests.launcher import launch
from tests.test_engine_megatron_core import FLAGS, SWITCH, assert_same_rows, assert_same_tensors, tensors, train

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core not installed")

# kind -> (tests/moe_models.py builder, overrides, MoE flags): V3 with the sequence-level aux loss, a fast expert
# bias update (its effect is in the saved expert_bias and the routing of later steps) and the MTP loss at 0.3,
# V2-Lite with the aux loss
MODELS = {
    "deepseek_v3": ("deepseek_v3", dict(num_hidden_layers=2, n_group=2, topk_group=1),
                    ["--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "0.01",
                     "--moe-router-bias-update-rate", "0.01", "--mtp-loss-scaling-factor", "0.3"]),
    "deepseek_v2_lite": ("deepseek_v2_lite", dict(num_hidden_layers=2), ["--moe-aux-loss-coeff", "0.01"]),
}
SP = ("--tp", "2", "--sequence-parallel")  # megatron-core's MoE layers need sequence parallelism under TP
# PP 2: one layer per stage, the MTP layer on the last stage with megatron-core's copy of the embedding there
CASES = {"deepseek_v3-1rank": 1, "deepseek_v3-tp2-sp": 2, "deepseek_v3-ep2": 2, "deepseek_v3-pp2": 2,
         "deepseek_v2_lite-1rank": 1, "deepseek_v2_lite-tp2-sp": 2}
LAYOUT = {"1rank": (), "tp2-sp": SP, "ep2": ("--expert-model-parallel-size", "2"), "pp2": ("--pp", "2")}


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """Both tiny models converted, the pattern corpus, and each model's native reference run."""
    from shardkit.cli import main as cli
    from tests import moe_models
    from tests.corpus import write_pattern_corpus

    root = tmp_path_factory.mktemp("engine_mcore_deepseek")
    write_pattern_corpus(root / "data")
    for kind, (builder, over, flags) in MODELS.items():
        moe_models.build(builder, root / kind / "hf", **over)
        assert cli(["convert", "hf-to-mcore", str(root / kind / "hf"), str(root / kind / "ck"), "--quiet",
                    "--no-verify"]) == 0
        train(root, f"{kind}-native", 1, "native", *flags, "--save-interval", "3", load=root / kind / "ck",
              data=root / "data")
    return root


def rows_of(work, name: str) -> list[dict]:
    return [json.loads(line) for line in (work / name / "metrics.jsonl").read_text().splitlines()]


def run_case(work, case: str) -> str:
    kind, layout = case.split("-", 1)
    name = f"{kind}-mcore-{layout}"
    if not (work / name / "metrics.jsonl").exists():
        train(work, name, CASES[case], "megatron-core", *MODELS[kind][2], *LAYOUT[layout],
              load=work / kind / "ck", data=work / "data")
    return name


@pytest.mark.parametrize("case", list(CASES))
def test_deepseek_equals_native(work, case):
    """Losses, grad norms, LRs, the MoE and MTP log rows, and every saved weight (the expert biases and the MTP
    layer included) and optimizer moment after 5 steps equal the native engine's."""
    kind = case.split("-")[0]
    rows, ref = rows_of(work, run_case(work, case)), rows_of(work, f"{kind}-native")
    assert len(rows) == 5 and max(r["grad_norm"] for r in rows) > 1.0  # clipping was exercised
    assert_same_rows(rows, ref)
    key = "seq_load_balancing_loss" if kind == "deepseek_v3" else "load_balancing_loss"
    mtp = kind == "deepseek_v3"
    for r, n in zip(rows, ref):  # layer 0 dense, layer 1 and V3's MTP layer MoE
        assert n[key] > 0 and set(n["moe_load_imbalance"]) == ({"1", "mtp0"} if mtp else {"1"}), n
        np.testing.assert_allclose(r[key], n[key], rtol=1e-5, atol=0)
        assert r["moe_load_imbalance"] == n["moe_load_imbalance"]
        assert ("mtp_loss" in r) == mtp and ("mtp_loss" in n) == mtp
        if mtp:
            np.testing.assert_allclose([r["mtp_loss"], *r["mtp_depth_losses"]],
                                       [n["mtp_loss"], *n["mtp_depth_losses"]], rtol=1e-5, atol=0)
    assert_same_tensors(work / run_case(work, case), work / f"{kind}-native")
    if kind == "deepseek_v3":  # the expert bias moved (5 updates of +-0.01 each) and megatron-core's moves equal
        start = tensors(work / kind / "ck")["decoder.layers.1.mlp.router.expert_bias"]
        saved = tensors(work / run_case(work, case))["decoder.layers.1.mlp.router.expert_bias"]
        assert (saved - start).abs().max() > 0.02


def test_native_save_resumes_on_megatron_core(work):
    """The native DeepSeek-V3 save after iteration 3 (per-layer tensors of the dense + MoE stack, the expert bias as
    updated so far, the MTP layer, fp32 params and moments) loaded into megatron-core at PP 2 continues as the native
    run: the embedding's copy on the last stage (MTP's) takes the first stage's optimizer state too."""
    kind = "deepseek_v3"
    rows = train(work, f"{kind}-resume-mcore", 2, "megatron-core", *MODELS[kind][2], *LAYOUT["pp2"],
                 load=work / f"{kind}-native" / "iter_0000003", data=work / "data")
    assert_same_rows(rows, rows_of(work, f"{kind}-native")[3:])
    assert_same_tensors(work / f"{kind}-resume-mcore", work / f"{kind}-native")


def test_deepseek_save_exports_to_hf(work, tmp_path):
    """megatron-core's TP 2 + SP save of DeepSeek-V3 through `convert mcore-to-hf` (the expert bias as
    e_score_correction_bias, the MTP layer as model.layers.2 with its copies of the embedding and head): transformers'
    forward of the export equals the checkpoint's (`verify`), and the export converted back gives the save's weights
    bit for bit."""
    from shardkit.cli import main as cli

    src = work / run_case(work, "deepseek_v3-tp2-sp")
    assert cli(["convert", "mcore-to-hf", str(src), str(tmp_path / "hf"), "--quiet"]) == 0
    assert cli(["verify", str(src), "--against", str(tmp_path / "hf")]) == 0
    assert cli(["convert", "hf-to-mcore", str(tmp_path / "hf"), str(tmp_path / "back"), "--quiet", "--no-verify"]) == 0
    saved, back = tensors(src), tensors(tmp_path / "back")
    weights = [k for k in saved if not k.startswith("optimizer")]
    assert "decoder.layers.1.mlp.router.expert_bias" in weights and sorted(weights) == sorted(back)
    for k in weights:
        a, b = saved[k], back[k]
        if "word_embeddings" in k or "output_layer" in k:  # the export holds the true vocabulary (300 rows), the
            a, b = a[:300], b[:300]  # TP 2 save pads it to 512 rows, the re-import to 384
        assert a.dtype == b.dtype and a.equal(b), k


def test_packed_documents_equal_native(work):
    """Packed documents with multi-latent attention (--reset-attention-mask, --eod-mask-loss): the engine's MLA core
    attention takes the per-document causal mask, megatron-core's loss the EOD-masked tokens; V2-Lite at TP 2 + SP
    equals the native engine's run on the same data, which differs from an unpacked run."""
    from tests.corpus import write_packed_corpus

    data, kind = work / "packed-data", "deepseek_v2_lite"
    write_packed_corpus(data, eod=2, lengths=(5, 14))
    packed = ["--reset-attention-mask", "--eod-mask-loss", "--eod-token-id", "2", *MODELS[kind][2]]
    ref = train(work, f"{kind}-packed-native", 1, "native", *packed, load=work / kind / "ck", data=data)
    rows = train(work, f"{kind}-packed-mcore", 2, "megatron-core", *packed, *SP, load=work / kind / "ck", data=data)
    assert_same_rows(rows, ref)
    assert_same_tensors(work / f"{kind}-packed-mcore", work / f"{kind}-packed-native")
    plain = train(work, f"{kind}-unpacked-native", 1, "native", *MODELS[kind][2], load=work / kind / "ck", data=data)
    assert abs(plain[0]["loss"] - rows[0]["loss"]) > 1e-3  # the flags changed what was computed


@pytest.mark.parametrize("kind,flag,says", [
    ("deepseek_v2_lite", "--reset-position-ids", "--reset-position-ids: megatron-core's multi-latent attention takes "
                                                 "positions 0..s-1"),
    ("deepseek_v3", "--reset-attention-mask", "--reset-attention-mask with MTP layers: megatron-core shifts their "
                                              "targets within documents only through packed_seq_params")],
    ids=["mla-reset-position-ids", "mtp-reset-attention-mask"])
def test_packing_refused_in_one_line(work, kind, flag, says):
    """What megatron-core computes for packed documents only through packed_seq_params (not wired in): MLA's RoPE
    positions, the MTP targets' shift within documents. One error line each, never silently dropped."""
    os.environ[SWITCH] = "1"
    try:
        r = launch(1, "--load", str(work / kind / "ck"), "--data-path", str(work / "data"), "--engine",
                   "megatron-core", *FLAGS, flag, "--eod-token-id", "2", check=False)
    finally:
        os.environ.pop(SWITCH, None)
    errors = [line for line in (r.stdout + r.stderr).splitlines() if line.startswith("shardkit: error:")]
    assert r.returncode != 0 and len(errors) == 1, (r.stdout[-2000:], r.stderr[-2000:])
    assert errors[0].startswith(f"shardkit: error: --engine megatron-core: {says}"), errors[0]


def test_router_coverage():
    """The routers megatron-core's TopKRouter computes as transformers does are covered; the others are named:
    sigmoid weights not renormalised (megatron-core always renormalises them), and group scores over another number
    of experts than HF's (V3: the sum of the best 2; V2: the best one)."""
    from checkpoint.config import ModelConfig
    from train.engines.coverage import model_not_covered

    v3 = dict(model_type="deepseek_v3", num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4,
              num_query_groups=4, kv_channels=16, vocab_size=300, max_position_embeddings=128, norm_epsilon=1e-6,
              rotary_base=10000.0, num_moe_experts=8, moe_router_topk=8,
              moe_ffn_hidden_size=32, moe_layer_freq=[0, 1], moe_router_score_function="sigmoid",
              moe_router_norm_topk=True, moe_router_num_groups=8, moe_router_group_topk=4,
              moe_router_enable_expert_bias=True, moe_shared_expert_intermediate_size=32,
              multi_latent_attention=True, q_lora_rank=48, kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=8,
              v_head_dim=16, rotary_interleaved=True)
    assert model_not_covered(ModelConfig(**v3)) is None  # DeepSeek-V3's own router: 8 of 8 groups x 4, top 8
    assert "group-limited routing with num_experts_per_tok 2 / topk_group 2 = 1 experts scored per group" in \
        model_not_covered(ModelConfig(**{**v3, "moe_router_topk": 2, "moe_router_group_topk": 2}))
    assert "not renormalised" in model_not_covered(ModelConfig(**{**v3, "moe_router_norm_topk": False}))
    v2 = {**v3, "model_type": "deepseek_v2", "moe_router_score_function": "softmax", "moe_router_norm_topk": False,
          "moe_router_enable_expert_bias": False, "moe_router_topk": 6, "moe_router_group_topk": 3}
    assert "the best)" in model_not_covered(ModelConfig(**v2))  # DeepSeek-V2's group_limited_greedy: 6 / 3 = 2
    assert model_not_covered(ModelConfig(**{**v2, "moe_router_topk": 3})) is None
    assert "rope_interleave=false" in model_not_covered(ModelConfig(**{**v3, "rotary_interleaved": False}))
    assert model_not_covered(ModelConfig(**{**v3, "mtp_num_layers": 1})) is None
