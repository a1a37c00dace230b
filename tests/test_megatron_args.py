"""Megatron-LM's whole argument namespace in torch_dist common.pt (issue 17).

The list of arguments and their defaults was extracted once from Megatron-LM's megatron/training/arguments.py of the
megatron-core release we test with (scripts/megatron_lm_args.py -> checkpoint/megatron_lm_args.py, the tag and
commit recorded there). The namespace shardkit writes has every one of them, Megatron-LM's default wherever the model
does not decide the value, and the values that describe the model agree with the model config and the sharding table;
enums are written as Megatron pickles them and read back without unpickling anything outside the allowlist.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import signal

import pytest

from checkpoint import megatron_lm_args as fixture
from checkpoint.config import ModelConfig
from checkpoint.layout import Layout
from checkpoint.megatron import (NEWEST_ARGS, MegatronEnum, config_from_megatron_args, layout_from_args,
                                 megatron_args, megatron_lm_defaults, model_args)
from checkpoint.families import model_specs

LLAMA = dict(model_type="llama", vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6,
             rope_theta=500000.0, torch_dtype="bfloat16",
             rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 64})
MIXTRAL = dict(model_type="mixtral", vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
               max_position_embeddings=128)
DERIVED = {"params_dtype", "data_parallel_size", "virtual_pipeline_model_parallel_size", "use_dist_ckpt",
           "consumed_train_samples", "skipped_train_samples", "consumed_valid_samples", "norm_epsilon",
           "disable_bias_linear", "apply_layernorm_1p"}
# (validate_args / the trainer derive the first ones; Megatron-LM's load_args_from_checkpoint still reads the older
# names apply_layernorm_1p and disable_bias_linear, and our own readers norm_epsilon: all beyond the parser's)


def test_fixture_is_for_the_installed_megatron_core():
    src = fixture.SOURCE
    assert src["megatron_core"] == importlib.metadata.version("megatron-core")
    assert src["ref"] == f"core_v{src['megatron_core']}" and len(src["commit"]) == 40
    assert src["file"] == "megatron/training/arguments.py" and src["arguments"] == len(fixture.DEFAULTS)
    # the attribute Megatron-Bridge's reader failed on, and a few every reader touches
    for name in ("heterogeneous_layers_config_path", "attention_backend", "no_persist_layer_norm", "cp_comm_type",
                 "decoder_first_pipeline_num_layers", "fp8_param_gather", "rank", "world_size"):
        assert name in fixture.DEFAULTS, name


@pytest.mark.parametrize("hf,layout", [(LLAMA, Layout(tp=2, pp=2)), (LLAMA, Layout(tp=1, pp=2, vpp=2)),
                                       (MIXTRAL, Layout(tp=2, ep=2))])
def test_namespace_has_every_argument(hf, layout):
    cfg = ModelConfig.from_hf(hf)
    a = vars(megatron_args(cfg, layout))
    defaults = megatron_lm_defaults()
    assert set(defaults) <= set(a)
    assert set(a) - set(defaults) <= DERIVED | set(NEWEST_ARGS)  # (0.19's moe_flex_dispatcher_num_sms)
    decided = model_args(cfg, layout)
    layout_decided = {"world_size", "no_save_optim", "no_save_rng", "data_parallel_random_init",
                      "num_layers_per_virtual_pipeline_stage", *NEWEST_ARGS}
    assert all(a[k] == v for k, v in NEWEST_ARGS.items())  # what megatron-core 0.19 / Megatron-Bridge 0.6 need
    for name, default in defaults.items():
        if name not in decided and name not in DERIVED | layout_decided:
            assert a[name] == default, name  # Megatron-LM's default where the model does not decide
    assert isinstance(a["attention_backend"], MegatronEnum) and a["attention_backend"].member == "auto"
    assert a["exit_signal"] is signal.SIGTERM


@pytest.mark.parametrize("hf,layout", [(LLAMA, Layout(tp=2, pp=2)), (MIXTRAL, Layout(tp=2, ep=2))])
def test_model_values_agree_with_config_and_sharding_table(hf, layout):
    cfg = ModelConfig.from_hf(hf)
    a = megatron_args(cfg, layout)
    specs = {s.name: s for s in model_specs(cfg, layout)}
    assert a.padded_vocab_size == specs["embedding.word_embeddings.weight"].shape[0]
    assert a.vocab_size == cfg.vocab_size and a.make_vocab_size_divisible_by == cfg.make_vocab_size_divisible_by
    qkv = specs["decoder.layers.self_attention.linear_qkv.weight"]
    assert qkv.shape == (a.num_layers, (a.num_attention_heads + 2 * a.num_query_groups) * a.kv_channels,
                         a.hidden_size)
    assert a.group_query_attention is True and a.layernorm_epsilon == cfg.norm_epsilon
    assert a.untie_embeddings_and_output_weights == ("output_layer.weight" in specs)
    assert layout_from_args(a) == layout
    assert a.world_size == a.tensor_model_parallel_size * a.pipeline_model_parallel_size * a.data_parallel_size
    if cfg.is_moe:
        fc1 = specs["decoder.layers.mlp.experts.experts.linear_fc1.weight"]
        assert fc1.shape[:3] == (a.num_layers, a.num_experts, 2 * a.moe_ffn_hidden_size)
        assert a.moe_router_topk == cfg.moe_router_topk and a.moe_layer_freq == [1] * cfg.num_layers
    else:
        fc1 = specs["decoder.layers.mlp.linear_fc1.weight"]
        assert fc1.shape == (a.num_layers, 2 * a.ffn_hidden_size, a.hidden_size)
        assert a.num_experts is None and a.use_rope_scaling and a.rope_scaling_factor == 8.0
    # the args alone describe the model again (the true vocab included)
    back = config_from_megatron_args(a, "mixtral" if cfg.is_moe else "llama")
    skip = {"hf_config", "rope_scaling", "moe_aux_loss_coeff", "max_position_embeddings"}
    assert {k: v for k, v in dataclasses.asdict(back).items() if k not in skip} == \
        {k: v for k, v in dataclasses.asdict(cfg).items() if k not in skip}


def test_enums_pickle_as_megatron_does_and_read_back_inert(tmp_path):
    from checkpoint.torch_dist_pickle import _pickle_globals, _torch_save_pickle, load_common
    from checkpoint.torch_dist_write import write_common

    cfg = ModelConfig.from_hf(LLAMA)
    write_common(tmp_path, {"iteration": 0, "args": megatron_args(cfg, Layout())})
    globs = set(_pickle_globals(_torch_save_pickle(tmp_path / "common.pt")))
    assert "megatron.core.transformer.enums AttnBackend" in globs and "signal Signals" in globs
    assert not any("checkpoint" in g or "shardkit" in g for g in globs)
    common, note = load_common(tmp_path / "common.pt")  # allowlisted: the enum becomes an inert stand-in
    assert note is None and isinstance(common["args"], argparse.Namespace)
    assert common["args"].attention_backend.qualname == "megatron.core.transformer.enums.AttnBackend"
    assert common["args"].attention_backend.args == (5,)
    write_common(tmp_path, common)  # and writes back the same way
    assert set(_pickle_globals(_torch_save_pickle(tmp_path / "common.pt"))) == globs


def test_deepseek_v3_args():
    """MLA, shared experts, a dense first layer, yarn RoPE and MTP by Megatron's names; the MLA arguments of a dense
    model keep Megatron-LM's defaults."""
    from tests.moe_models import BASE, CONFIGS

    cls, kw = CONFIGS["deepseek_v3"]
    cfg = ModelConfig.from_hf(cls(**{**BASE, **kw}).to_dict())
    a = megatron_args(cfg, Layout(ep=2))
    assert a.multi_latent_attention and (a.q_lora_rank, a.kv_lora_rank, a.qk_head_dim, a.qk_pos_emb_head_dim,
                                         a.v_head_dim) == (48, 32, 16, 8, 16)
    assert (a.rope_type, a.rotary_scaling_factor, a.mscale, a.mscale_all_dim) == ("yarn", 4.0, 1.0, 1.0)
    assert a.moe_layer_freq == [0, 1, 1] and a.num_experts == 8 and a.moe_shared_expert_intermediate_size == 32
    assert a.moe_router_num_groups == 4 and a.moe_router_group_topk == 2 and a.moe_router_enable_expert_bias
    assert a.moe_router_score_function == "sigmoid" and a.mtp_num_layers == 1 and a.expert_model_parallel_size == 2
    dense = megatron_args(ModelConfig.from_hf(LLAMA), Layout())
    defaults = megatron_lm_defaults()
    for name in ("multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "v_head_dim", "rope_type",
                 "num_experts", "moe_layer_freq", "moe_router_score_function", "mtp_num_layers"):
        assert getattr(dense, name) == defaults[name], name
