"""HF config.json <-> ModelConfig on the real hub configs in shared/hf-configs (sizes as published)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import transformers

from checkpoint.config import ModelConfig
from checkpoint.families import supported_model_types
from checkpoint.errors import ConfigError

HUB = Path(__file__).resolve().parents[2] / "shared" / "hf-configs"
ALL_HUB_FILES = sorted(HUB.glob("*.json")) if HUB.is_dir() else []
# the families shardkit reads; the others in shared/hf-configs (Qwen3, Qwen3-MoE until their issue) are refused
HUB_FILES = [p for p in ALL_HUB_FILES if json.loads(p.read_text()).get("model_type") in supported_model_types()]
UNSUPPORTED_HUB = [p for p in ALL_HUB_FILES if p not in HUB_FILES]
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


# -- typed fields: a string is never a number or a boolean, a wrong range is never converted ----------------------

@pytest.mark.parametrize("patch,match", [
    ({"tie_word_embeddings": "false"}, 'tie_word_embeddings="false" is a string; expected true or false'),
    ({"attention_bias": 1}, "attention_bias=1 is an integer; expected true or false"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 0}}, r"rope_scaling.factor=0 is out of range; expected a "
                                                              r"number > 0"),
    ({"rope_scaling": {"rope_type": "linear", "factor": "8"}}, 'rope_scaling.factor="8" is a string'),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "beta_fast": "32"}}, "rope_scaling.beta_fast"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "needs 'high_freq_factor'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
                       "original_max_position_embeddings": 8192}}, "must exceed low_freq_factor"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}}, "partial_rotary_factor"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": -1.0}}, "rope_theta=-1.0 is out of range"),
    ({"rope_theta": "10000"}, 'rope_theta="10000" is a string'),
    ({"rope_theta": float("inf")}, "rope_theta=inf is not a finite number"),
    ({"rms_norm_eps": 0}, "rms_norm_eps=0 is out of range; expected a number > 0"),
    ({"rms_norm_eps": None}, "rms_norm_eps=null"),
    ({"hidden_size": 64.0}, "hidden_size=64.0 is a float; expected an integer"),
    ({"hidden_size": "64"}, 'hidden_size="64" is a string'),
    ({"num_key_value_heads": True}, "num_key_value_heads=true is a boolean"),
    ({"intermediate_size": 0}, "intermediate_size=0 is out of range; expected an integer >= 1"),
    ({"hidden_act": ["silu"]}, "hidden_act"),
    ({"head_dim": "16"}, 'head_dim="16" is a string'),
    ({"head_dim": 0}, "head_dim=0 is out of range; expected an integer >= 1"),
])
def test_field_types_and_ranges(patch, match):
    base = dict(model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, vocab_size=100)
    with pytest.raises(ConfigError, match=match) as e:
        ModelConfig.from_hf({**base, **patch}, source="m/config.json")
    assert str(e.value).startswith("m/config.json: ") and "\n" not in str(e.value)


def test_deepseek_fields_are_typed():
    src = json.loads((HUB / "deepseek-ai--DeepSeek-V3.json").read_text()) if HUB_FILES else None
    if src is None:
        pytest.skip("shared/hf-configs not present")
    for key, bad in (("n_routed_experts", "256"), ("norm_topk_prob", "true"), ("routed_scaling_factor", 0),
                     ("qk_head_dim", 100), ("num_nextn_predict_layers", -1), ("n_group", 0.5)):
        with pytest.raises(ConfigError, match=key):
            ModelConfig.from_hf({**src, key: bad})


# -- property: mutated real hub configs are either refused in one line or read exactly as transformers reads them --

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from checkpoint.config import _FIELD_TYPES, _ROPE_KEYS  # noqa: E402

SMALL = {"hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 96, "num_hidden_layers": 3,
         "vocab_size": 256, "head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2, "n_routed_experts": 8,
         "moe_intermediate_size": 32, "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16,
         "qk_rope_head_dim": 8, "v_head_dim": 16, "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1,
         "n_shared_experts": 1, "max_window_layers": 2}


def _shrunk(path: Path) -> dict:
    """The hub config with every field kept and the sizes made tiny (kv heads keep their MHA/GQA character)."""
    src = json.loads(path.read_text())
    out = {k: (SMALL[k] if k in SMALL and src[k] is not None else v) for k, v in src.items()}
    if src.get("num_key_value_heads") is not None:
        out["num_key_value_heads"] = 4 if src["num_key_value_heads"] == src["num_attention_heads"] else 2
    if "qk_head_dim" in src:
        out["qk_head_dim"] = out["qk_nope_head_dim"] + out["qk_rope_head_dim"]
    return out


MUTANTS = [lambda v: str(v), lambda v: json.dumps(v), lambda v: "false", lambda v: "true", lambda v: 0,
           lambda v: -1, lambda v: 1, lambda v: 2, lambda v: None, lambda v: True, lambda v: False, lambda v: 0.0,
           lambda v: 0.5, lambda v: float("nan"), lambda v: float("inf"), lambda v: [v], lambda v: {"x": v},
           lambda v: float(v) if isinstance(v, int) and not isinstance(v, bool) else v,
           lambda v: int(v) if isinstance(v, float) and v == v and abs(v) < 1e18 else v,
           lambda v: v * 2 if isinstance(v, (int, float)) and not isinstance(v, bool) else v]


@st.composite
def mutated_configs(draw):
    src = _shrunk(draw(st.sampled_from(HUB_FILES)))
    for _ in range(draw(st.integers(1, 3))):
        rope_keys = [k for k in ("rope_scaling", "rope_parameters") if isinstance(src.get(k), dict)]
        targets = [k for k in src if k in _FIELD_TYPES] + [(r, k) for r in rope_keys for k in _ROPE_KEYS
                                                            if k in src[r]]
        target = draw(st.sampled_from(targets))
        holder, key = (src[target[0]], target[1]) if isinstance(target, tuple) else (src, target)
        if draw(st.integers(0, 9)) == 0:
            del holder[key]
        else:
            holder[key] = draw(st.sampled_from(MUTANTS))(holder[key])
    return src


def _transformers_reading(src: dict):
    """transformers' config object for src. Its strict fields refuse a JSON integer where they want a float
    (`"routed_scaling_factor": 1`); JSON does not tell 1 from 1.0, so those are retried as floats."""
    import copy

    from huggingface_hub.errors import StrictDataclassFieldValidationError

    src = copy.deepcopy(src)
    for _ in range(8):
        try:
            return transformers.AutoConfig.for_model(**copy.deepcopy(src))
        except StrictDataclassFieldValidationError as e:
            field = re.search(r"for field '(\w+)'", str(e))
            if "expected float, got int" not in str(e) or not field or not isinstance(src.get(field[1]), int):
                raise
            src[field[1]] = float(src[field[1]])
    raise AssertionError("too many retries")


def _agrees_with_transformers(cfg: ModelConfig, src: dict) -> None:
    import copy

    hf = _transformers_reading(src)
    heads = hf.num_attention_heads
    assert (cfg.num_layers, cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_attention_heads, cfg.vocab_size) == \
        (hf.num_hidden_layers, hf.hidden_size, hf.intermediate_size, heads, hf.vocab_size)
    assert cfg.num_query_groups == (hf.num_key_value_heads or heads)
    assert cfg.max_position_embeddings == hf.max_position_embeddings
    assert cfg.norm_epsilon == hf.rms_norm_eps and cfg.tie_word_embeddings is bool(hf.tie_word_embeddings)
    assert hf.hidden_act == "silu"
    rp = dict(hf.rope_parameters)
    assert cfg.rotary_base == rp.pop("rope_theta")
    rp = {k: v for k, v in rp.items() if k != "type" and v is not None}
    if rp.get("rope_type", "default") == "default":
        assert cfg.rope_scaling is None
    else:  # transformers fills yarn's original length from max_position_embeddings; our model reads it the same way
        ours = dict(cfg.rope_scaling)
        if ours["rope_type"] == "yarn":
            ours.setdefault("original_max_position_embeddings", cfg.max_position_embeddings)
        assert ours == rp
    mt = cfg.model_type
    if mt.startswith("deepseek"):
        assert (cfg.num_moe_experts, cfg.moe_router_topk, cfg.moe_ffn_hidden_size) == \
            (hf.n_routed_experts, hf.num_experts_per_tok, hf.moe_intermediate_size)
        assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim) == \
            (hf.q_lora_rank, hf.kv_lora_rank, hf.qk_nope_head_dim, hf.qk_rope_head_dim, hf.v_head_dim)
        assert cfg.moe_layer_freq == [int(i >= (hf.first_k_dense_replace or 0)) for i in range(cfg.num_layers)]
        assert (cfg.moe_shared_expert_intermediate_size or 0) == (hf.n_shared_experts or 0) * hf.moe_intermediate_size
        assert cfg.moe_router_norm_topk == bool(hf.norm_topk_prob)
        assert cfg.moe_router_topk_scaling_factor == (hf.routed_scaling_factor or 1.0)
        return
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    assert cfg.kv_channels == head_dim
    bias = bool(getattr(hf, "attention_bias", False))
    assert (cfg.add_qkv_bias, cfg.add_proj_bias) == ((mt == "qwen2") or bias, bias)
    assert cfg.add_mlp_bias == bool(getattr(hf, "mlp_bias", False))
    if mt in ("mistral", "mixtral"):
        assert cfg.sliding_window == hf.sliding_window
    if mt == "mixtral":
        assert (cfg.num_moe_experts, cfg.moe_router_topk) == (hf.num_local_experts, hf.num_experts_per_tok)


@pytest.mark.skipif(not HUB_FILES, reason="shared/hf-configs not present")
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated_configs())
def test_mutated_hub_configs_are_refused_or_read_as_transformers_reads_them(src):
    import copy

    try:
        cfg = ModelConfig.from_hf(copy.deepcopy(src), source="x/config.json")
    except ConfigError as e:
        msg = str(e)
        assert msg.startswith("x/config.json: ") and "\n" not in msg and len(msg) < 400
        return
    _agrees_with_transformers(cfg, src)


@pytest.mark.skipif(not HUB_FILES, reason="shared/hf-configs not present")
@pytest.mark.parametrize("path", HUB_FILES, ids=lambda p: p.stem)
def test_shrunk_hub_configs_read_as_transformers_reads_them(path):
    """The unmutated starting points of the property test are accepted (so the property is not vacuous)."""
    src = _shrunk(path)
    _agrees_with_transformers(ModelConfig.from_hf(dict(src)), src)


@pytest.mark.parametrize("path", UNSUPPORTED_HUB, ids=lambda p: p.stem)
def test_unsupported_hub_configs_are_one_line(path):
    """A real hub config of a family shardkit does not read yet: one line naming the model_type, never a guess."""
    src = json.loads(path.read_text())
    with pytest.raises(ConfigError, match=f"unsupported model_type {src['model_type']!r}") as e:
        ModelConfig.from_hf(src, source=str(path))
    assert "\n" not in str(e.value)


_LLAMA2 = [p for p in HUB_FILES if p.stem == "meta-llama--Llama-2-7b-hf"]


@pytest.mark.skipif(not _LLAMA2, reason="shared/hf-configs not present")
@pytest.mark.parametrize("patch", [
    {"rope_scaling": {"rope_type": "linear", "factor": 2.0, "rope_theta": 500000.0}},  # theta only in rope_scaling
], ids=["theta-in-rope-scaling"])
def test_what_transformers_accepts_is_read_as_it_reads_it(patch):
    """A spelling transformers reads without complaint (found by review): accepted, and read as it reads it."""
    src = _shrunk(_LLAMA2[0])
    src.pop("rope_theta", None)
    src.update(patch)
    _agrees_with_transformers(ModelConfig.from_hf(json.loads(json.dumps(src))), src)
