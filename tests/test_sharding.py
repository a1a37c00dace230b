"""Property tests of the sharding table over random models and layouts (hypothesis).

For every tensor: the primary regions of all ranks tile the global array exactly once; each rank's regions tile its
local tensor exactly once; every region is a union of whole storage chunks (so a rank of the saving layout reads
exactly its bytes).
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpoint.config import ModelConfig
from checkpoint.errors import LayoutError
from checkpoint.layout import Layout, PipelineSplit, RankCoord
from checkpoint.sharding import Rule, chunk_shape, local_shape, regions
from checkpoint.families import model_specs


@st.composite
def model_and_layout(draw):
    tp = draw(st.sampled_from([1, 2, 4]))
    pp = draw(st.sampled_from([1, 2, 3]))
    vpp = draw(st.sampled_from([1, 2]))
    ep = draw(st.sampled_from([1, 2, 4]))
    etp = draw(st.sampled_from([None, 1, 2]))
    groups = tp * draw(st.integers(1, 2))
    hpg = draw(st.integers(1, 3))
    head_dim = draw(st.sampled_from([2, 4, 6]))
    uneven = pp > 1 and draw(st.booleans())  # a --pipeline-model-parallel-layout: any layers per model chunk
    layers = draw(st.integers(1, 7)) if uneven else pp * vpp * draw(st.integers(1, 2))
    kind = draw(st.sampled_from(["dense", "moe", "mla_moe"]))
    moe = {}
    if kind != "dense":
        freq = draw(st.lists(st.sampled_from([0, 1]), min_size=layers, max_size=layers))
        moe = dict(num_moe_experts=ep * draw(st.integers(1, 3)), moe_ffn_hidden_size=2 * draw(st.integers(1, 3)),
                   moe_layer_freq=freq if kind == "mla_moe" else [1] * layers,
                   moe_shared_expert_intermediate_size=draw(st.sampled_from([None, tp * 2])) if kind == "mla_moe"
                   else None, moe_router_enable_expert_bias=draw(st.booleans()) and kind == "mla_moe")
    else:
        ep, etp = 1, None
    if kind == "mla_moe":
        moe.update(multi_latent_attention=True, q_lora_rank=draw(st.sampled_from([None, 6])), kv_lora_rank=4,
                   qk_head_dim=2, qk_pos_emb_head_dim=2, v_head_dim=draw(st.sampled_from([2, 4])),
                   mtp_num_layers=draw(st.integers(0, 1)))
    cfg = ModelConfig(  # each kind as the family that has it: Llama, Mixtral, DeepSeek-V3
        model_type={"dense": "llama", "moe": "mixtral", "mla_moe": "deepseek_v3"}[kind], num_layers=layers, hidden_size=draw(st.sampled_from([4, 8, 12])),
        ffn_hidden_size=tp * draw(st.integers(1, 3)), num_attention_heads=groups * hpg,
        num_query_groups=groups * hpg if kind == "mla_moe" else groups,
        kv_channels=head_dim, vocab_size=draw(st.integers(1, 40)), max_position_embeddings=64, norm_epsilon=1e-5,
        rotary_base=10000.0, tie_word_embeddings=draw(st.booleans()), add_qkv_bias=draw(st.booleans()) and kind == "dense",
        add_proj_bias=draw(st.booleans()) and kind == "dense", add_mlp_bias=draw(st.booleans()) and kind == "dense",
        make_vocab_size_divisible_by=draw(st.sampled_from([1, 4, 128])), **moe)
    if cfg.is_moe and etp is not None and cfg.moe_ffn_hidden_size % etp:
        etp = 1
    if cfg.is_moe and etp is None and cfg.moe_ffn_hidden_size % tp:
        etp = 1
    split = None
    if uneven:
        cuts = sorted(draw(st.lists(st.integers(0, layers), min_size=pp * vpp - 1, max_size=pp * vpp - 1)))
        counts = [b - a for a, b in zip([0, *cuts], [*cuts, layers])]
        stages = ["t" * n for n in counts]
        stages[0] = "E" + stages[0]
        stages[-1] += "m" * (cfg.mtp_num_layers or 0) + "L"
        split = PipelineSplit(layout="|".join(stages))
    return cfg, Layout(tp=tp, pp=pp, vpp=vpp, ep=ep, etp=etp, split=split)


@settings(max_examples=150, deadline=None)
@given(model_and_layout(), st.sampled_from([1, 2, 4]), st.sampled_from([16, 64, 1 << 20]))
def test_regions_tile_every_tensor_exactly_once(ml, itemsize, max_bytes):
    cfg, layout = ml
    layout.check(cfg)
    for spec in model_specs(cfg, layout):
        cover = np.zeros(spec.shape, dtype=np.int32)
        chunk = chunk_shape(spec, layout, itemsize, max_bytes)
        assert all(s % c == 0 for s, c in zip(spec.shape, chunk)), (spec.name, chunk)
        for coord in layout.ranks(expert=spec.expert):
            local_cover = {v: np.zeros(local_shape(spec, layout, coord.pp, v), dtype=np.int32)
                           for v in range(layout.vpp)}
            rs = regions(spec, layout, coord, cfg.num_layers)
            for r in rs:
                if r.primary:
                    cover[r.global_slices()] += 1
                local_cover[r.vstage][r.local_slices()] += 1
                # regions are unions of whole chunks
                assert all(o % c == 0 and s % c == 0 for o, s, c in zip(r.global_offset, r.shape, chunk)), \
                    (spec.name, r, chunk)
            owned = {r.vstage for r in rs}
            for v in owned:
                assert (local_cover[v] == 1).all(), (spec.name, coord, v)
        assert (cover == 1).all(), spec.name


def test_rules_match_megatron_reference():
    """The table's rules, checked against the layout facts in the reference notes."""
    cfg = ModelConfig(model_type="llama", num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                      num_query_groups=2, kv_channels=16, vocab_size=300, max_position_embeddings=64,
                      norm_epsilon=1e-5, rotary_base=1e4)
    specs = {s.name: s for s in model_specs(cfg, Layout(tp=2))}
    # megatron-core 0.16 (local spec, 2 layers, GQA 4:2, ffn 128, h 64): qkv (2,128,64), proj (2,64,64),
    # fc1 (2,256,64) stored as [gate; up] halves, fc2 (2,64,128)
    assert specs["decoder.layers.self_attention.linear_qkv.weight"].shape == (2, 128, 64)
    assert specs["decoder.layers.self_attention.linear_proj.weight"].shape == (2, 64, 64)
    assert specs["decoder.layers.mlp.linear_fc1.weight"].shape == (2, 256, 64)
    assert specs["decoder.layers.mlp.linear_fc2.weight"].shape == (2, 64, 128)
    assert specs["embedding.word_embeddings.weight"].shape == (512, 64)  # 300 padded to a multiple of 128*tp
    fc1 = specs["decoder.layers.mlp.linear_fc1.weight"]
    assert fc1.rule is Rule.GATE_UP
    r = regions(fc1, Layout(tp=2), RankCoord(tp=1))
    assert [(x.global_offset, x.local_offset) for x in r] == [((0, 64, 0), (0, 0, 0)), ((0, 192, 0), (0, 64, 0))]


def test_llama3_vocab_padding():
    cfg = ModelConfig(model_type="llama", num_layers=1, hidden_size=8, ffn_hidden_size=8, num_attention_heads=8,
                      num_query_groups=8, kv_channels=1, vocab_size=128256, max_position_embeddings=8,
                      norm_epsilon=1e-5, rotary_base=1e4)
    assert cfg.padded_vocab_size(1) == 128256
    assert cfg.padded_vocab_size(8) == 129024  # the reference notes' figure


@pytest.mark.parametrize("layout,match", [
    (Layout(tp=4), "num_key_value_heads=2"),
    (Layout(pp=3), "not divisible by --pp 3"),
    (Layout(pp=8), "exceed num_hidden_layers=4"),
    (Layout(pp=2, vpp=4), "exceed num_hidden_layers=4"),
])
def test_layout_errors_name_flag_and_field(layout, match):
    cfg = ModelConfig(model_type="llama", num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=8,
                      num_query_groups=2, kv_channels=8, vocab_size=300, max_position_embeddings=64,
                      norm_epsilon=1e-5, rotary_base=1e4)
    with pytest.raises(LayoutError, match=match):
        layout.check(cfg)


def test_interleaved_layer_assignment():
    # Megatron: chunk c = vstage * pp + pp_rank; 8 layers, pp 2, vpp 2 -> rank 0 holds layers 0-1 and 4-5
    lay = Layout(pp=2, vpp=2)
    assert [lay.layer_range(8, 0, v) for v in range(2)] == [(0, 2), (4, 6)]
    assert [lay.layer_range(8, 1, v) for v in range(2)] == [(2, 4), (6, 8)]
