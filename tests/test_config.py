"""HF config.json <-> ModelConfig on the real hub configs in shared/hf-configs (sizes as published)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers

from checkpoint.config import ModelConfig
from checkpoint.errors import ConfigError

HUB = Path(__file__).resolve().parents[2] / "shared" / "hf-configs"
HUB_FILES = sorted(HUB.glob("*.json")) if HUB.is_dir() else []
LLAMA_FAMILY = [p for p in HUB_FILES if json.loads(p.read_text()).get("model_type") in ("llama", "mistral", "qwen2")]


@pytest.mark.skipif(not LLAMA_FAMILY, reason="shared/hf-configs not present")
@pytest.mark.parametrize("path", LLAMA_FAMILY, ids=lambda p: p.stem)
def test_hub_config_round_trips_exactly(path):
    src = json.loads(path.read_text())
    cfg = ModelConfig.from_hf(src, source=str(path))
    assert cfg.to_hf() == src
    # and through the manifest's serialisation
    assert ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))).to_hf() == src


@pytest.mark.skipif(not LLAMA_FAMILY, reason="shared/hf-configs not present")
@pytest.mark.parametrize("path", LLAMA_FAMILY, ids=lambda p: p.stem)
def test_hub_config_semantics_agree_with_transformers(path):
    """Our reading of each field equals transformers' own config class reading of it."""
    src = json.loads(path.read_text())
    cfg = ModelConfig.from_hf(src)
    hf = transformers.AutoConfig.for_model(**src)
    assert cfg.num_layers == hf.num_hidden_layers
    assert cfg.num_query_groups == (hf.num_key_value_heads or hf.num_attention_heads)
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    assert cfg.kv_channels == head_dim
    rp = dict(hf.rope_parameters)
    assert cfg.rotary_base == rp.pop("rope_theta")
    if rp.get("rope_type", "default") == "default":
        assert cfg.rope_scaling is None
    else:
        assert {k: v for k, v in cfg.rope_scaling.items() if k != "type"} == {k: v for k, v in rp.items() if k != "type"}
    assert cfg.tie_word_embeddings == hf.tie_word_embeddings


def test_published_shapes():
    by = {p.stem: ModelConfig.from_hf(json.loads(p.read_text())) for p in LLAMA_FAMILY}
    if not by:
        pytest.skip("shared/hf-configs not present")
    l31 = by["meta-llama--Llama-3.1-8B"]
    assert (l31.num_layers, l31.hidden_size, l31.num_query_groups, l31.kv_channels) == (32, 4096, 8, 128)
    assert l31.rope_scaling["rope_type"] == "llama3" and l31.rotary_base == 500000.0
    l2 = by["meta-llama--Llama-2-7b-hf"]
    assert l2.rotary_base == 10000.0 and l2.rope_scaling is None and l2.num_query_groups == 32
    q = by["Qwen--Qwen2.5-7B"]
    assert q.add_qkv_bias and not q.add_proj_bias and q.sliding_window is None
    assert by["meta-llama--Llama-3.2-1B"].tie_word_embeddings
    assert by["mistralai--Mistral-7B-v0.1"].sliding_window == 4096


def test_rope_spellings_are_equivalent():
    base = dict(model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, vocab_size=100)
    a = ModelConfig.from_hf({**base, "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}})
    b = ModelConfig.from_hf({**base, "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}})
    assert (a.rotary_base, a.rope_scaling) == (b.rotary_base, b.rope_scaling) == (5e5, {"rope_type": "linear",
                                                                                        "factor": 2.0})
    # each writes back in its own style
    assert a.to_hf()["rope_scaling"] == {"type": "linear", "factor": 2.0}
    assert b.to_hf()["rope_parameters"] == {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}
    assert ModelConfig.from_hf({**base, "rope_scaling": None}).rotary_base == 10000.0


@pytest.mark.parametrize("patch,match", [
    ({"model_type": "gpt2"}, "supported: llama, mistral, qwen2"),
    ({"foo_bar": 1}, "foo_bar"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "longrope"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"vocab_size": 10**12}, "vocab_size"),
    ({"num_hidden_layers": -1}, "num_hidden_layers"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"rope_scaling": {"rope_type": "linear"}}, "factor"),
])
def test_unsupported_fields_are_errors(patch, match):
    base = dict(model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, vocab_size=100)
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_hf({**base, **patch})


def test_auto_map_is_carried_as_data():
    # hub configs (DeepSeek) point auto_map at remote code: it is kept as data and written back, never executed
    src = dict(model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               vocab_size=100, auto_map={"AutoModelForCausalLM": "evil.Model"})
    assert ModelConfig.from_hf(src).to_hf()["auto_map"] == src["auto_map"]
