"""Our canonical names and global shapes against megatron-core's own GPTModel.sharded_state_dict() (CPU, local spec).

The one documented difference: megatron-core's *local* spec renames an MoE layer's pre-MLP norm through its key map to
`mlp.linear_fc1.layer_norm_weight`, while the Transformer Engine spec that real runs use keeps
`pre_mlp_layernorm.weight`; shardkit uses TE naming (docs/FORMAT.md), so keys are translated before comparing with
checkpoint.megatron.sharded_key(name, "local"), the table the torch_dist writer's `--key-naming local` uses.
"""
from __future__ import annotations

import importlib.util

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from checkpoint.config import ModelConfig
from checkpoint.layout import Layout
from checkpoint.megatron import sharded_key
from checkpoint.families import model_specs

# megatron-core runs only in the oracle subprocess: importing it here would register its pickle safe globals in
# this process and weaken the allowlist checks of other tests.
if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
    pytest.skip("megatron-core is not installed", allow_module_level=True)
ORACLE = Path(__file__).with_name("megatron_oracle.py")


def oracle(cfg: ModelConfig, layout: Layout) -> dict[str, list[int]]:
    mc = dict(num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
              num_query_groups=cfg.num_query_groups, kv_channels=cfg.kv_channels, ffn_hidden_size=cfg.ffn_hidden_size,
              add_bias_linear=cfg.add_proj_bias, add_qkv_bias=cfg.add_qkv_bias,
              padded_vocab_size=cfg.padded_vocab_size(layout.tp), max_sequence_length=64,
              rotary_base=cfg.rotary_base, tied=cfg.tie_word_embeddings)
    if cfg.is_moe:
        mc.update(num_moe_experts=cfg.num_moe_experts, moe_router_topk=cfg.moe_router_topk,
                  moe_ffn_hidden_size=cfg.moe_ffn_hidden_size)
    with tempfile.TemporaryDirectory() as d:
        jobs, out = Path(d) / "jobs.json", Path(d) / "out.json"
        jobs.write_text(json.dumps([{"model": mc, "out": str(out)}]))
        r = subprocess.run([sys.executable, str(ORACLE), "names", str(jobs)], capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(out.read_text())


def ours(cfg: ModelConfig, layout: Layout) -> dict[str, list[int]]:
    out = {}
    for s in model_specs(cfg, layout):
        out[sharded_key(s.name, "local")] = list(s.shape)
    return out


def test_dense_llama_gqa_names_and_shapes():
    cfg = ModelConfig(model_type="llama", num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                      num_query_groups=2, kv_channels=16, vocab_size=300, max_position_embeddings=64,
                      norm_epsilon=1e-5, rotary_base=1e4)
    assert ours(cfg, Layout()) == oracle(cfg, Layout())


def test_mixtral_style_names_and_shapes():
    cfg = ModelConfig.from_hf(dict(model_type="mixtral", vocab_size=300, hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   num_local_experts=4, num_experts_per_tok=2))
    got, want = ours(cfg, Layout()), oracle(cfg, Layout())
    assert got == want
    assert want["decoder.layers.mlp.experts.experts.linear_fc1.weight"] == [2, 4, 192, 64]
