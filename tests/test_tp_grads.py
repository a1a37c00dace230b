"""Which parameters' gradients are summed over TP comes from the sharding table's `tp_grad` (checkpoint/sharding.py),
not from name suffixes (issue 35): under sequence parallelism every replicated trained tensor (norms, routers, MLA's
down-projections and latent norms, MTP's norms), none without it, and a tensor declared "always" (megatron-core's
q/k layernorms, which see only this rank's heads) in both cases."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from checkpoint.config import ModelConfig
from checkpoint.layout import Layout
from checkpoint.sharding import Rule
from checkpoint.families import model_specs
from train.model import GPTModel, canonical_name
from train.parallel import tensor
from tests import moe_models


def _model(kind: str, tmp_path) -> tuple[ModelConfig, GPTModel, Layout]:
    import json

    path = moe_models.build(kind, tmp_path / kind) if kind != "llama" else None
    if kind == "llama":
        import transformers

        hf = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2).to_dict()
    else:
        hf = json.loads((path / "config.json").read_text())
    cfg = ModelConfig.from_hf(hf)
    layout = Layout(tp=2)
    with torch.device("meta"):
        model = GPTModel(tensor.local_config(cfg, layout), cfg.padded_vocab_size(2))
    return cfg, model, layout


@pytest.mark.parametrize("kind", ["llama", "mixtral", "deepseek_v3"])
def test_partial_grads_follow_the_table(kind, tmp_path):
    cfg, model, layout = _model(kind, tmp_path)
    specs = {s.name: s for s in model_specs(cfg, layout)}
    replicated = {n for n, p in model.named_parameters()
                  if specs[canonical_name(n, not cfg.heterogeneous)[0]].rule is Rule.REPLICATED}
    assert any("layernorm" in n or "layer_norm" in n for n in replicated)
    tensor.mark_partial_grads(model, cfg, layout, sequence_parallel=True)
    assert {n for n, p in model.named_parameters() if p.tp_partial_grad} == replicated
    tensor.mark_partial_grads(model, cfg, layout, sequence_parallel=False)
    assert not any(p.tp_partial_grad for p in model.parameters())


def test_always_is_summed_without_sequence_parallelism(tmp_path, monkeypatch):
    """A replicated tensor declared "always" (as q/k layernorms are) is summed over TP with or without SP; the rest
    only under SP: nothing depends on the parameter's name."""
    cfg, model, layout = _model("llama", tmp_path)
    target = "decoder.layers.self_attention.linear_qkv.layer_norm_weight"
    real = model_specs

    def specs(c, lay):
        return [dataclasses.replace(s, tp_grad="always") if s.name == target else s for s in real(c, lay)]

    monkeypatch.setattr(tensor, "model_specs", specs)
    tensor.mark_partial_grads(model, cfg, layout, sequence_parallel=False)
    marked = {n for n, p in model.named_parameters() if p.tp_partial_grad}
    assert marked == {n for n in dict(model.named_parameters()) if n.endswith("linear_qkv.layer_norm_weight")}
