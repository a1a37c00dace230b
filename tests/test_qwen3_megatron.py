"""Qwen3 and Qwen3-MoE in Megatron's own format (issue 36): megatron-core 0.16's GPTModel with `qk_layernorm=True`
(its local spec: `self_attention.q_layernorm` / `k_layernorm`, RMSNorm over each head) loads our torch_dist export at
TP 2 (and TP 2 x EP 2 with its top-8-style softmax router over the top-k logits), holds every tensor of ours bit for
bit under its own keys, and its forward equals transformers' Qwen3 / Qwen3-MoE forward."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from checkpoint.layout import Layout
from checkpoint.megatron import stored_key
from checkpoint.reader import Checkpoint
from convert.hf_to_mcore import convert_hf_to_mcore
from convert.torch_dist_io import write_torch_dist
from tests.test_qwen3 import build

if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
    pytest.skip("megatron-core is not installed", allow_module_level=True)
ORACLE = Path(__file__).with_name("megatron_oracle.py")
SEQ = 16


def megatron_model(cfg, padded_vocab: int) -> dict:
    """megatron-core's TransformerConfig for our model config, by hand (the oracle's side of the comparison)."""
    m = dict(num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
             num_query_groups=cfg.num_query_groups, kv_channels=cfg.kv_channels, ffn_hidden_size=cfg.ffn_hidden_size,
             add_bias_linear=False, add_qkv_bias=False, layernorm_epsilon=cfg.norm_epsilon, qk_layernorm=True,
             padded_vocab_size=padded_vocab, max_sequence_length=cfg.max_position_embeddings,
             rotary_base=cfg.rotary_base, tied=cfg.tie_word_embeddings)
    if cfg.is_moe:  # softmax over the top-k logits = HF's softmax then renormalised top-k (norm_topk_prob)
        m.update(num_moe_experts=cfg.num_moe_experts, moe_router_topk=cfg.moe_router_topk,
                 moe_ffn_hidden_size=cfg.moe_ffn_hidden_size, moe_router_pre_softmax=False)
    return m


CASES = {"qwen3-tp2pp2-te": ("qwen3", Layout(tp=2, pp=2), "te"),
         "qwen3_moe-tp2ep2-local": ("qwen3_moe", Layout(tp=2, ep=2, etp=1), "local")}


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """Both exports loaded by megatron-core in one oracle process."""
    w = tmp_path_factory.mktemp("qwen3_megatron")
    out, jobs = {}, []
    for case, (kind, layout, naming) in CASES.items():
        d = w / case
        over = {"num_hidden_layers": 2, "mlp_only_layers": []} if kind == "qwen3_moe" else {"num_hidden_layers": 2}
        hf = build(kind, d / "hf", **over)
        nat = convert_hf_to_mcore(hf, d / "nat", layout, quiet=True)
        td = write_torch_dist(nat, d / "td", key_naming=naming, quiet=True)
        ck = Checkpoint(nat)
        torch.manual_seed(0)
        ids = torch.randint(0, ck.config.vocab_size, (2, SEQ))
        torch.save(ids, d / "ids.pt")
        jobs.append({"mode": "load", "ckpt": str(td), "input_ids": str(d / "ids.pt"), "out": str(d / "meg.pt"),
                     "model": megatron_model(ck.config, ck.tensors["embedding.word_embeddings.weight"].shape[0])})
        out[case] = dict(hf=hf, ck=ck, ids=ids, naming=naming, meg=d / "meg.pt")
    (w / "jobs.json").write_text(json.dumps(jobs))
    r = subprocess.run([sys.executable, str(ORACLE), "torch_dist", str(w / "jobs.json")], capture_output=True,
                       text=True, timeout=300, cwd=str(w))
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-4000:])
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_megatron_core_loads_our_qwen3(loaded, case):
    import transformers

    d = loaded[case]
    ck, naming, ids = d["ck"], d["naming"], d["ids"]
    meg = torch.load(d["meg"])
    assert set(meg["tensors"]) == {stored_key(n, naming) for n in ck.tensors}
    assert stored_key("decoder.layers.self_attention.q_layernorm.weight", naming) in meg["tensors"]
    for name in ck.tensors:
        got, want = meg["tensors"][stored_key(name, naming)], ck.read(name)
        assert got.shape == want.shape and torch.equal(got, want), name
    with torch.no_grad():
        ref = transformers.AutoModelForCausalLM.from_pretrained(str(d["hf"]), dtype=torch.float32).eval()(
            input_ids=ids, use_cache=False).logits.float()
    ours = meg["logits"][..., :ck.config.vocab_size]
    assert ours.shape == ref.shape and ref.std() > 0.1
    assert (ours - ref).abs().max().item() <= 1e-4
