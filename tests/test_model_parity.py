"""GPTModel (canonical Megatron layout) against HF transformers' own forward, on tiny random models.

Every parameter, norms and biases included, is randomised: HF initialises norms to 1 and biases to 0, which would
hide a misplaced norm or a bias in the wrong QKV rows. vocab_size=300 is not a multiple of 128, so the canonical
embedding/output carry padding rows that must never reach the logits.
"""
from __future__ import annotations

import re

import pytest
import torch
import transformers

from checkpoint.config import ModelConfig
from checkpoint.layout import Layout
from checkpoint.families import model_specs
from checkpoint.families import tensor_maps
from checkpoint.families.mapping import dict_reader, stack_canonical
from verify.whole import logit_parity
from train.model import GPTModel

TOL = 1e-4
VOCAB = 300
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
            num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16, "rope_theta": 10000.0}

# name -> (config class, overrides of BASE, sequence length)
CASES = {
    "llama_gqa": (transformers.LlamaConfig, {}, 32),
    "llama_mha": (transformers.LlamaConfig, dict(num_attention_heads=4, num_key_value_heads=4), 32),
    "llama_tied": (transformers.LlamaConfig, dict(tie_word_embeddings=True), 32),
    "llama_head_dim": (transformers.LlamaConfig, dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32), 32),
    "llama_rope_llama3": (transformers.LlamaConfig, dict(rope_parameters=LLAMA3), 48),
    "llama_rope_linear": (transformers.LlamaConfig,
                          dict(rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 500.0}), 32),
    # max_position_embeddings=16 < seq 40: HF's dynamic_rope_update rescales the base
    "llama_rope_dynamic": (transformers.LlamaConfig,
                           dict(max_position_embeddings=16,
                                rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1000.0}), 40),
    "llama_rope_yarn": (transformers.LlamaConfig,
                        dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                              "original_max_position_embeddings": 16}), 48),
    "llama_bias": (transformers.LlamaConfig, dict(attention_bias=True, mlp_bias=True), 32),
    "mistral_sliding_window": (transformers.MistralConfig, dict(sliding_window=8), 32),
    "qwen2": (transformers.Qwen2Config, {}, 32),
}


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@torch.no_grad()
def randomize(model: torch.nn.Module) -> None:
    """Random values everywhere; norm weights around 1 so activations keep a useful scale."""
    for name, p in model.named_parameters():
        if "norm" in name:
            p.copy_(1.0 + 0.2 * torch.randn_like(p))
        else:
            torch.nn.init.normal_(p, std=0.08)


def make_hf(config_cls, overrides: dict):
    hf_config = config_cls(**{**BASE, **overrides})
    hf = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation="sdpa", dtype=torch.float32)
    randomize(hf)
    return hf.eval()


def canonical(hf) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    cfg = ModelConfig.from_hf(hf.config.to_dict())
    return cfg, stack_canonical(tensor_maps(cfg, Layout()), dict_reader(hf.state_dict()))


def ours_from(cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> GPTModel:
    model = GPTModel(cfg, tensors["embedding.word_embeddings.weight"].shape[0])
    model.load_canonical(tensors)
    return model.eval()


@torch.no_grad()
def max_diff(ours: GPTModel, hf, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> float:
    a = ours(input_ids, position_ids=position_ids)
    b = hf(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits
    assert a.shape == b.shape == (*input_ids.shape, VOCAB)
    assert a.std() > 0.1, "logits too small for the comparison to mean anything"
    return (a - b).abs().max().item()


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_hf(case: str) -> None:
    config_cls, overrides, seq_len = CASES[case]
    hf = make_hf(config_cls, overrides)
    cfg, tensors = canonical(hf)
    assert tensors["embedding.word_embeddings.weight"].shape[0] == 384  # padded: exercised
    ours = ours_from(cfg, tensors)
    diff = max_diff(ours, hf, torch.randint(0, VOCAB, (2, seq_len)))
    print(f"{case}: max |diff| = {diff:.3g}")
    assert diff <= TOL


@pytest.mark.parametrize("case", ["llama_gqa", "llama_tied", "mistral_sliding_window"])
def test_trainer_stage_loss_matches_hf(case: str) -> None:
    """The trainer's own path (parallelize -> StageStep, one rank) is GPTModel's forward: its loss is HF's."""
    from checkpoint.run_layout import RunLayout
    from train.config import ParallelConfig
    from train.parallel.groups import Groups
    from train.parallelize import parallelize
    from train.parallel.pipeline import StageStep

    config_cls, overrides, seq_len = CASES[case]
    hf = make_hf(config_cls, overrides)
    cfg, tensors = canonical(hf)
    groups = Groups(RunLayout(), 0, 0, 0, 0, 0)
    model = parallelize(cfg, groups, torch.device("cpu"), torch.float32, ParallelConfig()).model
    model.load_canonical(tensors)
    ids, labels = torch.randint(0, VOCAB, (2, seq_len)), torch.randint(0, VOCAB, (2, seq_len))
    with torch.no_grad():
        ours = StageStep(model, groups)(None, ids, labels)
        ref = torch.nn.functional.cross_entropy(hf(input_ids=ids, use_cache=False).logits.flatten(0, 1),
                                                labels.flatten())
    assert abs(ours.item() - ref.item()) <= TOL


def test_dynamic_rope_short_long_short() -> None:
    """Dynamic NTK only kicks in past max_position_embeddings and resets for short sequences, as in HF."""
    config_cls, overrides, _ = CASES["llama_rope_dynamic"]
    hf = make_hf(config_cls, overrides)
    ours = ours_from(*canonical(hf))
    for seq_len in (12, 40, 12, 48):
        assert max_diff(ours, hf, torch.randint(0, VOCAB, (2, seq_len))) <= TOL, seq_len


def test_dynamic_rope_changes_logits_past_max_positions() -> None:
    """Guard that the dynamic case really exercises the rescaled base (else it would only test default RoPE)."""
    config_cls, overrides, _ = CASES["llama_rope_dynamic"]
    hf = make_hf(config_cls, overrides)
    cfg, tensors = canonical(hf)
    plain = ModelConfig.from_dict({**cfg.to_dict(), "rope_scaling": None, "hf_config": {}})
    dynamic, default = ours_from(cfg, tensors), ours_from(plain, tensors)
    short, long = torch.randint(0, VOCAB, (1, 16)), torch.randint(0, VOCAB, (1, 40))
    with torch.no_grad():
        assert torch.equal(dynamic(short), default(short))  # within max_position_embeddings: no scaling
        assert (dynamic(long) - default(long)).abs().max() > 1e-3


def test_position_ids_offset() -> None:
    config_cls, overrides, seq_len = CASES["llama_rope_llama3"]
    hf = make_hf(config_cls, overrides)
    ours = ours_from(*canonical(hf))
    ids = torch.randint(0, VOCAB, (2, seq_len))
    position_ids = torch.arange(7, 7 + seq_len)[None, :].expand(2, -1)
    assert max_diff(ours, hf, ids, position_ids) <= TOL


def test_canonical_round_trip_bitwise() -> None:
    hf = make_hf(transformers.LlamaConfig, dict(attention_bias=True, mlp_bias=True))
    cfg, tensors = canonical(hf)
    ours = ours_from(cfg, tensors)
    back = ours.canonical_state_dict()
    assert list(back) == [s.name for s in model_specs(cfg, Layout())]
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name


def test_parameter_names_match_model_specs() -> None:
    for case in ("llama_tied", "llama_bias", "qwen2"):
        config_cls, overrides, _ = CASES[case]
        cfg = ModelConfig.from_hf(config_cls(**{**BASE, **overrides}).to_dict())
        specs = model_specs(cfg, Layout())
        model = GPTModel(cfg, cfg.padded_vocab_size(1))
        shapes = {name: tuple(t.shape) for name, t in model.canonical_state_dict().items()}
        assert shapes == {s.name: s.shape for s in specs}, case


def test_wrong_shape_raises_naming_tensor() -> None:
    hf = make_hf(transformers.Qwen2Config, {})
    cfg, tensors = canonical(hf)
    model = GPTModel(cfg, 384)
    before = model.canonical_state_dict()
    name = "decoder.layers.self_attention.linear_qkv.bias"
    bad = dict(tensors, **{name: tensors[name][:, :-8]})
    with pytest.raises(ValueError, match=re.escape(name)):
        model.load_canonical(bad)
    # nothing was copied before the check failed
    after = model.canonical_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_missing_and_unexpected_tensors_raise() -> None:
    hf = make_hf(transformers.LlamaConfig, dict(tie_word_embeddings=True))
    cfg, tensors = canonical(hf)
    model = GPTModel(cfg, 384)
    extra = dict(tensors, **{"output_layer.weight": tensors["embedding.word_embeddings.weight"]})
    with pytest.raises(ValueError, match="output_layer.weight"):
        model.load_canonical(extra)
    missing = {k: v for k, v in tensors.items() if k != "decoder.final_layernorm.weight"}
    with pytest.raises(ValueError, match="decoder.final_layernorm.weight"):
        model.load_canonical(missing)


def test_padding_rows_never_reach_logits() -> None:
    hf = make_hf(transformers.LlamaConfig, {})
    cfg, tensors = canonical(hf)
    ours = ours_from(cfg, tensors)
    ids = torch.randint(0, VOCAB, (1, 8))
    with torch.no_grad():
        before = ours(ids)
        ours.output_layer.weight[VOCAB:] = 1e6
        ours.embedding.word_embeddings.weight[VOCAB:] = float("nan")
        assert torch.equal(ours(ids), before)


def test_logit_parity_from_saved_hf_dir(tmp_path) -> None:
    hf = make_hf(transformers.MistralConfig, dict(sliding_window=8))
    hf.save_pretrained(tmp_path)
    cfg = ModelConfig.from_hf_dir(tmp_path)
    tensors = stack_canonical(tensor_maps(cfg, Layout()), dict_reader(hf.state_dict()))
    result = logit_parity(cfg, tensors, tmp_path, batch=2, seq_len=24, seed=3)
    print(f"logit_parity: {result}")
    assert set(result) == {"max_abs_diff", "mean_abs_diff", "batch", "seq_len", "dtype", "embedding", "router_bias",
                           "not_compared"}  # issue 34: the weights compared directly, and what was not
    assert (result["batch"], result["seq_len"], result["dtype"]) == (2, 24, "float32")
    assert result["embedding"]["rows_differ"] == 0 and result["not_compared"] == []
    assert 0 <= result["mean_abs_diff"] <= result["max_abs_diff"] <= TOL


def test_logit_parity_detects_a_bad_conversion(tmp_path) -> None:
    hf = make_hf(transformers.LlamaConfig, {})
    hf.save_pretrained(tmp_path)
    cfg = ModelConfig.from_hf_dir(tmp_path)
    tensors = stack_canonical(tensor_maps(cfg, Layout()), dict_reader(hf.state_dict()))
    qkv = tensors["decoder.layers.self_attention.linear_qkv.weight"]
    hd = cfg.kv_channels
    kv = cfg.heads_per_group * hd  # swap k and v of query group 0 in layer 0: a plausible layout bug
    swapped = qkv.clone()
    swapped[0, kv:kv + hd], swapped[0, kv + hd:kv + 2 * hd] = qkv[0, kv + hd:kv + 2 * hd], qkv[0, kv:kv + hd]
    bad = dict(tensors, **{"decoder.layers.self_attention.linear_qkv.weight": swapped})
    assert logit_parity(cfg, bad, tmp_path)["max_abs_diff"] > 1e-2
