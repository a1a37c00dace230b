"""GPTModel against HF transformers' own forward for the MoE / multi-latent-attention families: Mixtral,
DeepSeek-V2 (Lite and full) and DeepSeek-V3, on tiny random fp32 models.

The HF model is saved and its canonical tensors are assembled from the saved file by the converter's own mapping
table (transformers 5 fuses experts in memory but writes per-expert tensors, which is what the mappings read), so
these tests also check the mixtral/deepseek tables. Every parameter is randomised, norms included, and so is
DeepSeek-V3's `e_score_correction_bias` (a buffer in HF): with a zero bias, a bias added to the wrong scores (or not
at all) would go unnoticed.
"""
from __future__ import annotations

import pytest
import torch
import transformers
from safetensors.torch import load_file

from checkpoint.config import ModelConfig
from checkpoint.layout import Layout
from checkpoint.families import model_specs
from checkpoint import families
from checkpoint.families.mapping import dict_reader, stack_canonical
from verify.whole import logit_parity
from train.model import GPTModel

TOL = 1e-4
VOCAB = 300
BASE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=4, max_position_embeddings=64, rms_norm_eps=1e-6)
MLA = dict(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12)
# yarn as the DeepSeek hub configs write it, scaled down: factor * original_max_position_embeddings = 64 positions
YARN_V3 = {"type": "yarn", "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1,
           "original_max_position_embeddings": 16}
YARN_V2 = {"type": "yarn", "factor": 4.0, "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1,
           "original_max_position_embeddings": 16}
# mscale != mscale_all_dim: the cos/sin tables carry an attention factor != 1 as well
YARN_UNEQUAL = dict(YARN_V3, mscale=1.0, mscale_all_dim=0.5)

# name -> (model_type, overrides of BASE, sequence length)
CASES = {
    "mixtral_top2_of_4": ("mixtral", dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=2,
                                          num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=2), 32),
    "mixtral_top2_of_8": ("mixtral", dict(num_local_experts=8, num_experts_per_tok=2, num_hidden_layers=2), 32),
    # V2-Lite: plain q projection, softmax greedy top-k without renormalisation, shared experts, a first dense layer
    "deepseek_v2_lite": ("deepseek_v2", dict(**MLA, q_lora_rank=None, n_routed_experts=8, num_experts_per_tok=3,
                                             moe_intermediate_size=16, n_shared_experts=2, first_k_dense_replace=1,
                                             topk_method="greedy", norm_topk_prob=False, routed_scaling_factor=1.5),
                         32),
    # V2: q_lora, group-limited greedy, every layer MoE (a stacked, homogeneous MoE stack), yarn as on the hub
    "deepseek_v2_group_limited": ("deepseek_v2", dict(**MLA, q_lora_rank=24, n_routed_experts=8, num_experts_per_tok=3,
                                                      moe_intermediate_size=16, n_shared_experts=1,
                                                      first_k_dense_replace=0, topk_method="group_limited_greedy",
                                                      n_group=4, topk_group=2, norm_topk_prob=False,
                                                      routed_scaling_factor=16.0, rope_scaling=YARN_V2), 48),
    # V3: sigmoid router with expert bias and groups, renormalised, scaled; yarn; interleaved RoPE (its default)
    "deepseek_v3": ("deepseek_v3", dict(**MLA, q_lora_rank=24, n_routed_experts=8, num_experts_per_tok=3,
                                        moe_intermediate_size=16, n_shared_experts=1, first_k_dense_replace=1,
                                        n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
                                        num_nextn_predict_layers=0, rope_scaling=YARN_V3), 48),
    "deepseek_v3_rotate_half": ("deepseek_v3", dict(**MLA, q_lora_rank=24, n_routed_experts=8, num_experts_per_tok=2,
                                                    moe_intermediate_size=16, n_shared_experts=1,
                                                    first_k_dense_replace=1, n_group=2, topk_group=1,
                                                    norm_topk_prob=True, routed_scaling_factor=2.5,
                                                    num_nextn_predict_layers=0, rope_interleave=False,
                                                    rope_scaling=YARN_UNEQUAL), 48),
}


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@torch.no_grad()
def randomize(model: torch.nn.Module) -> None:
    """Random values everywhere; norm weights around 1 so activations keep a useful scale; V3's router bias about as
    large as the spread of the sigmoid scores, so that it changes which experts are selected."""
    for name, p in model.named_parameters():
        if "norm" in name:
            p.copy_(1.0 + 0.1 * torch.randn_like(p))
        else:
            torch.nn.init.normal_(p, std=0.1)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.1 * torch.randn_like(b))


def make_hf(model_type: str, overrides: dict):
    hf_config = transformers.CONFIG_MAPPING[model_type](**{**BASE, **overrides})
    hf = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation="sdpa", dtype=torch.float32)
    randomize(hf)
    return hf.eval()


def saved_canonical(hf, path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Save the HF model, then read its config and assemble the canonical tensors from the saved file."""
    hf.save_pretrained(path)
    cfg = ModelConfig.from_hf_dir(path)
    state = load_file(path / "model.safetensors")
    return cfg, stack_canonical(families.tensor_maps(cfg, Layout()), dict_reader(state))


def ours_from(cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> GPTModel:
    model = GPTModel(cfg, tensors["embedding.word_embeddings.weight"].shape[0])
    model.load_canonical(tensors)
    return model.eval()


@torch.no_grad()
def max_diff(ours: GPTModel, hf, input_ids: torch.Tensor) -> float:
    a = ours(input_ids)
    b = hf(input_ids=input_ids, use_cache=False).logits
    assert a.shape == b.shape == (*input_ids.shape, VOCAB)
    assert a.std() > 0.1, "logits too small for the comparison to mean anything"
    return (a - b).abs().max().item()


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_hf(case: str, tmp_path) -> None:
    model_type, overrides, seq_len = CASES[case]
    hf = make_hf(model_type, overrides)
    cfg, tensors = saved_canonical(hf, tmp_path)
    assert cfg.is_moe and tensors["embedding.word_embeddings.weight"].shape[0] == 384  # padded: exercised
    ours = ours_from(cfg, tensors)
    diff = max_diff(ours, hf, torch.randint(0, VOCAB, (2, seq_len)))
    print(f"{case}: max |diff| = {diff:.3g}")
    assert diff <= TOL


def test_stack_shapes_follow_the_config(tmp_path) -> None:
    """Guard the cases above: Mixtral stacks experts under the layer axis, DeepSeek with a first dense layer uses
    per-layer keys (heterogeneous), V2 without dense layers stacks MLA + MoE layers."""
    _, mixtral = saved_canonical(make_hf(*CASES["mixtral_top2_of_8"][:2]), tmp_path / "m")
    assert mixtral["decoder.layers.mlp.experts.experts.linear_fc1.weight"].shape == (2, 8, 96, 32)
    cfg, v3 = saved_canonical(make_hf(*CASES["deepseek_v3"][:2]), tmp_path / "v3")
    assert cfg.heterogeneous and cfg.moe_layer_freq == [0, 1, 1]
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in v3
    assert v3["decoder.layers.2.mlp.router.expert_bias"].abs().min() > 0
    cfg, v2 = saved_canonical(make_hf(*CASES["deepseek_v2_group_limited"][:2]), tmp_path / "v2")
    assert not cfg.heterogeneous
    assert v2["decoder.layers.self_attention.linear_kv_up_proj.weight"].shape == (3, 4 * (8 + 12), 16)


def test_v3_expert_bias_changes_the_routing(tmp_path) -> None:
    """The router bias must matter in the V3 case, else the test above would not check that it is applied."""
    model_type, overrides, seq_len = CASES["deepseek_v3"]
    cfg, tensors = saved_canonical(make_hf(model_type, overrides), tmp_path)
    unbiased = {k: (torch.zeros_like(v) if k.endswith("expert_bias") else v) for k, v in tensors.items()}
    ids = torch.randint(0, VOCAB, (2, seq_len))
    with torch.no_grad():
        assert (ours_from(cfg, tensors)(ids) - ours_from(cfg, unbiased)(ids)).abs().max() > 1e-3


def test_logit_parity_deepseek_v3(tmp_path) -> None:
    model_type, overrides, seq_len = CASES["deepseek_v3"]
    cfg, tensors = saved_canonical(make_hf(model_type, overrides), tmp_path)
    result = logit_parity(cfg, tensors, tmp_path, batch=2, seq_len=seq_len, seed=1)
    print(f"logit_parity deepseek_v3: {result}")
    assert 0 <= result["mean_abs_diff"] <= result["max_abs_diff"] <= TOL


def test_logit_parity_detects_swapped_experts(tmp_path) -> None:
    model_type, overrides, _ = CASES["mixtral_top2_of_4"]
    cfg, tensors = saved_canonical(make_hf(model_type, overrides), tmp_path)
    name = "decoder.layers.mlp.experts.experts.linear_fc2.weight"
    bad = dict(tensors, **{name: tensors[name][:, [1, 0, 2, 3]]})
    assert logit_parity(cfg, bad, tmp_path)["max_abs_diff"] > 1e-2


def random_canonical(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    return {s.name: torch.randn(s.shape) for s in model_specs(cfg, Layout())}


def test_canonical_round_trip_bitwise_with_mtp() -> None:
    overrides = dict(CASES["deepseek_v3"][1], num_nextn_predict_layers=1)
    cfg = ModelConfig.from_hf(transformers.DeepseekV3Config(**{**BASE, **overrides}).to_dict())
    assert cfg.mtp_num_layers == 1 and cfg.heterogeneous
    tensors = random_canonical(cfg)
    assert "mtp.layers.0.transformer_layer.mlp.experts.experts.linear_fc1.weight" in tensors
    model = GPTModel(cfg, tensors["embedding.word_embeddings.weight"].shape[0])
    model.load_canonical(tensors)
    back = model.canonical_state_dict()
    assert list(back) == [s.name for s in model_specs(cfg, Layout())]
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name


@pytest.mark.parametrize("case", ["mixtral_top2_of_4", "deepseek_v2_lite", "deepseek_v2_group_limited"])
def test_parameter_names_match_model_specs(case: str) -> None:
    model_type, overrides, _ = CASES[case]
    cfg = ModelConfig.from_hf(transformers.CONFIG_MAPPING[model_type](**{**BASE, **overrides}).to_dict())
    model = GPTModel(cfg, cfg.padded_vocab_size(1))
    shapes = [(name, tuple(t.shape)) for name, t in model.canonical_state_dict().items()]
    assert shapes == [(s.name, s.shape) for s in model_specs(cfg, Layout())]


def test_mtp_forward_shapes_and_gradients() -> None:
    overrides = dict(CASES["deepseek_v3"][1], num_nextn_predict_layers=1)
    cfg = ModelConfig.from_hf(transformers.DeepseekV3Config(**{**BASE, **overrides}).to_dict())
    model = GPTModel(cfg, cfg.padded_vocab_size(1))
    ids = torch.randint(0, VOCAB, (2, 12))
    logits, hidden = model(ids, return_hidden=True)
    (mtp_logits,) = model.mtp_forward(hidden, ids)
    assert logits.shape == mtp_logits.shape == (2, 12, VOCAB)
    mtp_logits.sum().backward()
    assert model.mtp.layers[0].eh_proj.weight.grad.abs().sum() > 0
    assert model.decoder.layers['0'].input_layernorm.weight.grad is not None  # through `hidden` into the decoder
