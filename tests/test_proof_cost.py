"""The default proof's shortcuts (issue 42) give the numbers the full computation gives: a head block whose stored
bits equal ours, on one finite input, is not multiplied (its differences are zero by construction) but a block that
differs, or holds a NaN, is; an expert's row sets run as one product (equal sets shared); equal embedding blocks
found by one memcmp, a differing row still named."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from verify import streamed
from verify.common import rows_differ
from verify.hf_weights import HFWeights
from verify.streamed import _expert_mlp, _expert_mlp_sets, _head_logits


def _hf_head(tmp_path, head):
    save_file({"lm_head.weight": head}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return HFWeights(tmp_path)


def _counting_linear(monkeypatch):
    calls, real = [], F.linear

    def linear(x, w, *a):
        calls.append(tuple(w.shape))
        return real(x, w, *a)

    monkeypatch.setattr(streamed.F, "linear", linear)
    return calls


def _full(x, head):
    return F.linear(x, head.float())


@pytest.mark.parametrize("plant", [None, "ours", "nan", "input"])
def test_head_block_skipped_only_where_one_product_serves_all(tmp_path, monkeypatch, plant):
    g = torch.Generator().manual_seed(0)
    vocab, h, block = 96, 16, 32
    head = torch.randn(vocab, h, generator=g).to(torch.bfloat16)
    if plant == "nan":
        head[70, 3] = float("nan")
    ours = head.clone()
    if plant == "ours":
        ours[40, 5] += 1  # the second block differs
    x = torch.randn(2, 3, h, generator=g)
    x_chain = x.clone()
    if plant == "input":
        x_chain[0, 0, 0] += 1e-3  # our chain has drifted: its product is its own
    weights = _hf_head(tmp_path, head)
    calls = _counting_linear(monkeypatch)
    hf_out, our_out = _head_logits(weights, [(x, "lm_head.weight")],
                                   lambda a, b: [(a, b, ours[a:b])], [x_chain, x], vocab, block)
    products = len(calls)
    theirs = _full(x, head)
    want_chain, want_on_hf = _full(x_chain, ours), _full(x, ours)
    for got, want in ((our_out[0] - hf_out[0], want_chain - theirs), (our_out[1] - hf_out[0], want_on_hf - theirs)):
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.allclose(got.nan_to_num(), want.nan_to_num(), atol=1e-6)
    blocks = vocab // block
    computed = {None: 0, "ours": 1, "nan": 1, "input": blocks}[plant]
    assert products >= computed and (plant is not None or products == 0)
    if plant == "ours":  # the differing block: HF's product and ours, each from its own side's weights
        assert (our_out[0] - hf_out[0])[..., 32:64].abs().max() > 1e-2
        assert (our_out[0] - hf_out[0])[..., :32].abs().max() == 0
    if plant == "nan":
        assert hf_out[0][..., 64:].isnan().any()


def test_expert_row_sets_share_equal_sets_and_match_separate_products():
    g = torch.Generator().manual_seed(1)
    h, f = 24, 40
    w1, w2 = torch.randn(2 * f, h, generator=g), torch.randn(h, f, generator=g)
    a, b = torch.randn(5, h, generator=g), torch.randn(3, h, generator=g)
    ys = _expert_mlp_sets([a, b, a.clone()], w1, w2)
    assert torch.equal(ys[0], ys[2])  # an equal set shares its result
    for x, y in zip((a, b), ys):
        assert torch.allclose(y, _expert_mlp(x, w1, w2), rtol=1e-6, atol=1e-6)
    assert torch.equal(_expert_mlp_sets([a], w1, w2)[0], _expert_mlp(a, w1, w2))
    assert _expert_mlp_sets([], w1, w2) == []


def test_rows_differ_equal_blocks_and_one_planted_row():
    g = torch.Generator().manual_seed(2)
    theirs = torch.randn(50, 8, generator=g).to(torch.bfloat16)
    ours = theirs.clone()
    assert not rows_differ(theirs, ours).any()
    ours[17, 2] = -ours[17, 2] if ours[17, 2] != 0 else 1
    assert rows_differ(theirs, ours).nonzero().flatten().tolist() == [17]
    assert rows_differ(theirs.float(), ours).nonzero().flatten().tolist() == [17]  # HF's rows cast to ours first
