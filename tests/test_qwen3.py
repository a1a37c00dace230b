"""Qwen3 and Qwen3-MoE (issue 36), added through the family registry (checkpoint/families/qwen3.py): their hub
configs read and written back, conversions at TP/PP/EP proven against transformers' own forward (whole and
streamed, experts streamed), exported back bitwise, and Megatron-LM's args for them (--qk-layernorm, top-k with or
without pre-softmax, dense layers) round-tripped."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from checkpoint.config import ModelConfig
from checkpoint.layout import Layout
from checkpoint.megatron import config_from_megatron_args, hf_model_type_of, model_args
from shardkit.cli import main as cli

HUB = Path(__file__).resolve().parents[2] / "shared" / "hf-configs"


def build(kind: str, path: Path, **over) -> Path:
    import transformers

    kw = dict(vocab_size=200, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=24, max_position_embeddings=128, rope_theta=1e6)
    if kind == "qwen3_moe":
        kw.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                  mlp_only_layers=[1])
    kw.update(over)
    cls = transformers.Qwen3MoeForCausalLM if kind == "qwen3_moe" else transformers.Qwen3ForCausalLM
    conf = (transformers.Qwen3MoeConfig if kind == "qwen3_moe" else transformers.Qwen3Config)(**kw)
    torch.manual_seed(0)
    model = cls(conf)
    with torch.no_grad():  # HF initialises norms to 1: randomise them so a wrong mapping cannot hide
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
    model.save_pretrained(str(path))
    return path


@pytest.mark.parametrize("name", ["Qwen--Qwen3-8B", "Qwen--Qwen3-30B-A3B"])
def test_hub_configs(name):
    path = HUB / f"{name}.json"
    if not path.exists():
        pytest.skip(f"{path} is not beside the checkout")
    hf = json.loads(path.read_text())
    cfg = ModelConfig.from_hf(hf, source=str(path))
    assert cfg.qk_layernorm and cfg.kv_channels == 128
    if cfg.is_moe:
        assert (cfg.num_moe_experts, cfg.moe_router_topk, cfg.moe_ffn_hidden_size) == (128, 8, 768)
        assert cfg.moe_router_norm_topk and cfg.moe_shared_expert_intermediate_size is None
        assert cfg.moe_layer_freq == [1] * 48
    assert cfg.to_hf() == {**hf, "torch_dtype": "bfloat16"}  # written back in the source's own style


@pytest.mark.parametrize("kind,layout", [("qwen3", ["--tp", "2", "--pp", "3"]),
                                         ("qwen3_moe", ["--tp", "2", "--ep", "2", "--etp", "1"])],
                         ids=["qwen3-tp2pp3", "qwen3_moe-tp2ep2"])
def test_convert_prove_and_export_bitwise(kind, layout, tmp_path):
    from safetensors.torch import load_file

    hf = build(kind, tmp_path / "hf")
    ck = tmp_path / "ck"
    assert cli(["convert", "hf-to-mcore", str(hf), str(ck), *layout, "--quiet"]) == 0  # the whole-model proof
    assert cli(["verify", str(ck), "--against", str(hf), "--memory-budget", "512KB", "--all-experts"]) == 0
    assert cli(["convert", "mcore-to-hf", str(ck), str(tmp_path / "back"), "--quiet"]) == 0
    a = {k: v for f in sorted(hf.glob("*.safetensors")) for k, v in load_file(f).items()}
    b = {k: v for f in sorted((tmp_path / "back").glob("*.safetensors")) for k, v in load_file(f).items()}
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    src, back = (json.loads((d / "config.json").read_text()) for d in (hf, tmp_path / "back"))
    assert back == src
    # resharded to one rank, then exported: the same bytes again
    assert cli(["reshard", str(ck), str(tmp_path / "one"), "--tp", "1", "--pp", "1", "--ep", "1", "--quiet"]) == 0
    assert cli(["convert", "mcore-to-hf", str(tmp_path / "one"), str(tmp_path / "back1"), "--quiet"]) == 0
    c = {k: v for f in sorted((tmp_path / "back1").glob("*.safetensors")) for k, v in load_file(f).items()}
    assert set(c) == set(a) and all(torch.equal(a[k], c[k]) for k in a)


def test_a_wrong_qk_norm_is_caught(tmp_path):
    """The proof sees the q/k norms: one swapped pair of HF tensors fails it."""
    from safetensors.torch import load_file, save_file

    hf = build("qwen3", tmp_path / "hf")
    f = next(hf.glob("*.safetensors"))
    sd = load_file(f)
    sd["model.layers.0.self_attn.q_norm.weight"], sd["model.layers.0.self_attn.k_norm.weight"] = \
        sd["model.layers.0.self_attn.k_norm.weight"], sd["model.layers.0.self_attn.q_norm.weight"]
    ck = tmp_path / "ck"
    assert cli(["convert", "hf-to-mcore", str(hf), str(ck), "--quiet", "--no-verify"]) == 0
    save_file(sd, str(f), metadata={"format": "pt"})  # the HF side changed under the converted checkpoint
    assert cli(["verify", str(ck), "--against", str(hf)]) != 0


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe"])
def test_megatron_args_round_trip(kind, tmp_path):
    hf = build(kind, tmp_path / "hf")
    cfg = ModelConfig.from_hf_dir(hf)
    args = argparse.Namespace(**model_args(cfg, Layout()))
    assert args.qk_layernorm
    assert hf_model_type_of(args) == kind
    back = config_from_megatron_args(args, vocab_size=cfg.vocab_size)
    same = ("model_type", "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
            "qk_layernorm", "num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_layer_freq",
            "moe_router_norm_topk", "moe_router_score_function", "rotary_base")
    assert {k: getattr(back, k) for k in same} == {k: getattr(cfg, k) for k in same}
    if kind == "qwen3_moe":
        assert args.moe_router_topk == 2 and not args.moe_router_pre_softmax
        assert not args.moe_shared_expert_intermediate_size
    bad = argparse.Namespace(**{**vars(args), "add_qkv_bias": True})
    with pytest.raises(Exception, match="add_qkv_bias"):
        config_from_megatron_args(bad, vocab_size=cfg.vocab_size)


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory):
    from tests.corpus import write_pattern_corpus

    root = tmp_path_factory.mktemp("qwen3_moe_train")
    build("qwen3_moe", root / "hf")
    assert cli(["convert", "hf-to-mcore", str(root / "hf"), str(root / "ck"), "--quiet", "--no-verify"]) == 0
    write_pattern_corpus(root / "data")
    return root


@pytest.mark.parametrize("layout", [["--ep", "2"], ["--tp", "2", "--sequence-parallel"],
                                    ["--ep", "2", "--moe-token-dispatcher-type", "allgather"],
                                    ["--pp", "2", "--decoder-first-pipeline-num-layers", "1"],
                                    ["--cp", "2"]], ids=["ep2", "tp2-sp", "ep2-allgather", "pp2-first1", "cp2"])
def test_qwen3_moe_training_equals_one_process(moe_run, layout):
    """Routed experts split over EP (or over TP with SP, q/k norms and router summed over TP), a dense layer between
    MoE layers: the losses and every trained tensor of one process within 1e-5."""
    import numpy as np

    from checkpoint.reader import Checkpoint
    from tests.test_train import COMMON, launch, losses, real_rows

    args = ["--load", str(moe_run / "ck"), "--data-path", str(moe_run / "data"), "--train-iters", "4", *COMMON,
            "--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "0.01"]
    one = moe_run / "one"
    if not (one / "latest").exists():
        launch(1, *args, "--save", str(one))
    out = moe_run / "-".join(layout).replace("--", "")
    launch(2, *args, "--save", str(out), *layout)
    np.testing.assert_allclose(losses(out), losses(one), rtol=1e-5)
    a, b = real_rows(Checkpoint(one / "iter_0000004")), real_rows(Checkpoint(out / "iter_0000004"))
    assert set(a) == set(b)
    for name in a:
        assert (a[name] - b[name]).norm().item() <= 1e-5 * a[name].norm().item(), name
    src = Checkpoint(moe_run / "ck" / "iter_0000000").state_dict()
    for name in ("decoder.layers.0.self_attention.q_layernorm.weight", "decoder.layers.2.mlp.router.weight",
                 "decoder.layers.1.mlp.linear_fc1.weight"):
        assert not torch.equal(src[name], b[name]), name  # trained


# -- plan presets and a DeepSeek-V3-architecture model of other sizes ------------------------------------------------

QWEN3_PRESETS = {"qwen3-8b": "Qwen--Qwen3-8B.json", "qwen3-30b-a3b": "Qwen--Qwen3-30B-A3B.json",
                 "qwen3-32b": None, "qwen3-235b-a22b": None}
# Kimi-K2's published shape (moonshotai/Kimi-K2-Base config.json) written as a DeepSeek-V3 config: 384 experts in one
# group, one dense layer, 61 layers, no MTP layer
KIMI_K2 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 163840, "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 64,
    "num_key_value_heads": 64, "n_shared_experts": 1, "n_routed_experts": 384, "routed_scaling_factor": 2.827,
    "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
    "topk_method": "noaux_tc", "n_group": 1, "topk_group": 1, "num_experts_per_tok": 8, "moe_layer_freq": 1,
    "first_k_dense_replace": 1, "norm_topk_prob": True, "scoring_func": "sigmoid", "num_nextn_predict_layers": 0,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-06, "rope_theta": 50000.0, "tie_word_embeddings": False,
    "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "attention_bias": False, "mlp_bias": False, "rope_interleave": True, "torch_dtype": "bfloat16"}


@pytest.mark.parametrize("name", sorted(QWEN3_PRESETS))
def test_qwen3_presets_plan(name, tmp_path):
    from checkpoint import presets

    hub = QWEN3_PRESETS[name]
    if hub and (HUB / hub).exists():
        assert presets.hf_config(name) == json.loads((HUB / hub).read_text())
    cfg = presets.model_config(name)
    assert cfg == presets.model_config(name, fill_defaults=False) and cfg.qk_layernorm
    shapes = {"qwen3-8b": (36, 4096, None), "qwen3-32b": (64, 5120, None), "qwen3-30b-a3b": (48, 2048, 128),
              "qwen3-235b-a22b": (94, 4096, 128)}
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_moe_experts) == shapes[name]
    assert cli(["plan", "--model", name, "--gpus", "64", "--top", "1"]) == 0


def test_kimi_k2_shape_plans(tmp_path):
    """`plan` from Kimi-K2's config.json alone (a DeepSeek-V3 model of other sizes)."""
    (tmp_path / "kimi").mkdir()
    (tmp_path / "kimi" / "config.json").write_text(json.dumps(KIMI_K2))
    assert cli(["plan", "--model", str(tmp_path / "kimi"), "--gpus", "512", "--top", "1"]) == 0


def test_kimi_k2_shape_is_config_only(tmp_path):
    """A DeepSeek-V3 model with Kimi-K2's sizes reads from its config.json alone (it plans: the slow case above); a
    tiny one of the same
    routing structure (one expert group, one dense layer, no MTP) converts at EP 2, is proven against transformers,
    reshards to EP 4 and exports back bitwise, with no code of its own."""
    from safetensors.torch import load_file

    from tests import moe_models

    cfg = ModelConfig.from_hf(KIMI_K2)
    assert (cfg.num_moe_experts, cfg.moe_router_num_groups, cfg.moe_router_group_topk) == (384, 1, 1)
    assert cfg.moe_layer_freq == [0] + [1] * 60 and cfg.mtp_num_layers == 0
    hf = moe_models.build("deepseek_v3", tmp_path / "hf", n_routed_experts=12, n_group=1, topk_group=1,
                          num_nextn_predict_layers=0, num_experts_per_tok=4, routed_scaling_factor=2.827)
    assert cli(["convert", "hf-to-mcore", str(hf), str(tmp_path / "ck"), "--ep", "2", "--quiet"]) == 0
    assert cli(["reshard", str(tmp_path / "ck"), str(tmp_path / "ep4"), "--ep", "4", "--quiet"]) == 0
    assert cli(["convert", "mcore-to-hf", str(tmp_path / "ep4"), str(tmp_path / "back"), "--quiet"]) == 0
    a = {k: v for f in sorted(hf.glob("*.safetensors")) for k, v in load_file(f).items()}
    b = {k: v for f in sorted((tmp_path / "back").glob("*.safetensors")) for k, v in load_file(f).items()}
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_qwen3_fp8_emulated_tracks_bf16(tmp_path):
    """FP8 (hybrid, tensorwise scaling; emulated on the CPU) on Qwen3's layer: 20 steps within test_fp8's tolerance
    of the bf16 run at every step, different from it (FP8 ran), and learning (a slow case: test_fp8.py's recipes run
    the same emulation on Llama's layer; Qwen3 adds only the q/k norms, which stay out of FP8 as norms do)."""
    import numpy as np

    from tests.corpus import write_pattern_corpus
    from tests.test_fp8 import COMMON as FP8_COMMON, LOSS_TOL
    from tests.test_train import losses

    hf = build("qwen3", tmp_path / "hf", vocab_size=1000, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               head_dim=16)
    assert cli(["convert", "hf-to-mcore", str(hf), str(tmp_path / "ck"), "--quiet", "--no-verify"]) == 0
    write_pattern_corpus(tmp_path / "data")
    args = ["continue-pretrain", "--load", str(tmp_path / "ck"), "--data-path", str(tmp_path / "data"),
            "--train-iters", "20", *FP8_COMMON]
    assert cli([*args, "--save", str(tmp_path / "bf16")]) == 0
    assert cli([*args, "--save", str(tmp_path / "fp8"), "--fp8", "hybrid", "--fp8-recipe", "tensorwise"]) == 0
    base, got = np.array(losses(tmp_path / "bf16")), np.array(losses(tmp_path / "fp8"))
    assert len(got) == 20 and base[0] - base[-1] > 0.3  # it learns (from ln 1000 = 6.9)
    diff = np.abs(got - base)
    assert 0 < diff.max() <= LOSS_TOL, diff
