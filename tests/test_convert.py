"""hf-to-mcore / mcore-to-hf end to end, against HF transformers as the oracle.

- logits of the converted checkpoint (read back from disk) equal HF's own forward within 1e-4 in fp32;
- HF -> mcore -> HF is bitwise equal, config.json and tokenizer files included;
- each rank's local slices equal the Megatron rules of the reference notes, computed independently here;
- an interrupted conversion resumes and ends bitwise equal to an uninterrupted one.
"""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
import transformers
from safetensors import safe_open

from checkpoint.layout import Layout, RankCoord
from checkpoint.reader import Checkpoint
from convert import hf_to_mcore
from convert.hf_to_mcore import convert_hf_to_mcore
from convert.mcore_to_hf import convert_mcore_to_hf
from verify.whole import logit_parity
from shardkit.demo import save_tiny_tokenizer
from tests.test_model_parity import CASES, make_hf

TOL = 1e-4

# (case, tp, pp, vpp): every family/feature at least once, tp in {1, 2, 4}, pp in {1, 2}
LAYOUTS = [
    ("llama_gqa", 1, 1, 1), ("llama_gqa", 2, 1, 1), ("llama_gqa", 1, 2, 1), ("llama_gqa", 2, 2, 1),
    ("llama_mha", 4, 1, 1), ("llama_mha", 4, 2, 1),
    ("llama_tied", 2, 2, 1), ("llama_head_dim", 2, 1, 1), ("llama_rope_llama3", 2, 2, 1),
    ("llama_rope_linear", 1, 2, 1), ("llama_rope_dynamic", 2, 1, 1), ("llama_rope_yarn", 1, 1, 1),
    ("llama_bias", 2, 2, 1), ("mistral_sliding_window", 2, 2, 1), ("qwen2", 2, 2, 1), ("qwen2", 1, 1, 1),
]


def save_hf(tmp_path, case: str, dtype=torch.float32, **extra):
    cls, overrides, _ = CASES[case]
    hf = make_hf(cls, {**overrides, **extra})
    d = tmp_path / f"hf-{case}"
    hf.to(dtype).save_pretrained(d)
    return hf, d


@pytest.mark.parametrize("case,tp,pp,vpp", LAYOUTS, ids=lambda x: str(x))
def test_logit_parity_after_conversion(tmp_path, case, tp, pp, vpp):
    _, hf_dir = save_hf(tmp_path, case)
    out = convert_hf_to_mcore(hf_dir, tmp_path / "ck", Layout(tp=tp, pp=pp, vpp=vpp), quiet=True)
    ckpt = Checkpoint(out.parent)
    ckpt.verify()
    seq = CASES[case][2]
    r = logit_parity(ckpt.config, ckpt.state_dict(), hf_dir, seq_len=seq)
    assert r["max_abs_diff"] <= TOL, r


def test_four_way_tp_with_gqa(tmp_path):
    """GQA 8 heads / 4 KV groups at tp=4 (each rank one query group) and vpp=2."""
    _, hf_dir = save_hf(tmp_path, "llama_gqa", num_key_value_heads=4, num_hidden_layers=4)
    out = convert_hf_to_mcore(hf_dir, tmp_path / "ck", Layout(tp=4, pp=1, vpp=2), quiet=True)
    ckpt = Checkpoint(out)
    r = logit_parity(ckpt.config, ckpt.state_dict(), hf_dir)
    assert r["max_abs_diff"] <= TOL, r


@pytest.mark.parametrize("case,dtype,tp,pp", [("llama_gqa", torch.bfloat16, 2, 2), ("qwen2", torch.float32, 2, 1),
                                              ("llama_tied", torch.float16, 1, 2), ("llama_bias", torch.bfloat16, 2, 1)])
def test_round_trip_is_bitwise(tmp_path, case, dtype, tp, pp):
    _, hf_dir = save_hf(tmp_path, case, dtype)
    save_tiny_tokenizer(hf_dir, 300)
    convert_hf_to_mcore(hf_dir, tmp_path / "ck", Layout(tp=tp, pp=pp), quiet=True)
    back = convert_mcore_to_hf(tmp_path / "ck", tmp_path / "back", max_shard_size="40KB", quiet=True)
    index = json.loads((back / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # really sharded
    src = _tensors(hf_dir)
    got = {}
    for f in set(index["weight_map"].values()):
        with safe_open(str(back / f), "pt") as h:
            got.update({k: h.get_tensor(k) for k in h.keys()})
    assert sorted(got) == sorted(src)
    for k in src:
        assert got[k].dtype == src[k].dtype and torch.equal(got[k], src[k]), k
    assert got["model.embed_tokens.weight"].shape[0] == 300  # vocab padding never exported
    assert json.loads((back / "config.json").read_text()) == json.loads((hf_dir / "config.json").read_text())
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (back / f).read_bytes() == (hf_dir / f).read_bytes(), f
    transformers.AutoModelForCausalLM.from_pretrained(back)  # loads


def test_export_dtype_cast(tmp_path):
    _, hf_dir = save_hf(tmp_path, "llama_gqa")
    convert_hf_to_mcore(hf_dir, tmp_path / "ck", Layout(tp=2), dtype="bf16", quiet=True)
    assert {e.dtype for e in Checkpoint(tmp_path / "ck").tensors.values()} == {"bfloat16"}
    back = convert_mcore_to_hf(tmp_path / "ck", tmp_path / "back", dtype="fp32", quiet=True)
    cfg = json.loads((back / "config.json").read_text())
    assert cfg.get("dtype", cfg.get("torch_dtype")) == "float32"
    src, got = _tensors(hf_dir), _tensors(back)
    for k in src:
        assert torch.equal(got[k], src[k].to(torch.bfloat16).float()), k


def test_rank_slices_follow_megatron_rules(tmp_path):
    """Local shards read through the table equal the reference notes' formulas applied to the HF tensors."""
    hf, hf_dir = save_hf(tmp_path, "llama_bias", num_hidden_layers=4)
    tp, pp = 2, 2
    convert_hf_to_mcore(hf_dir, tmp_path / "ck", Layout(tp=tp, pp=pp), quiet=True)
    ckpt = Checkpoint(tmp_path / "ck")
    c = hf.config
    ng, nh = c.num_key_value_heads, c.num_attention_heads
    hd, h = c.hidden_size // nh, c.hidden_size
    sd = hf.state_dict()
    lay = Layout(tp=tp, pp=pp)
    for r in range(tp):
        for p in range(pp):
            qkv = ckpt.read_local("decoder.layers.self_attention.linear_qkv.weight", lay, RankCoord(tp=r, pp=p))[0]
            fc1 = ckpt.read_local("decoder.layers.mlp.linear_fc1.weight", lay, RankCoord(tp=r, pp=p))[0]
            fc1b = ckpt.read_local("decoder.layers.mlp.linear_fc1.bias", lay, RankCoord(tp=r, pp=p))[0]
            proj = ckpt.read_local("decoder.layers.self_attention.linear_proj.weight", lay, RankCoord(tp=r, pp=p))[0]
            fc2 = ckpt.read_local("decoder.layers.mlp.linear_fc2.weight", lay, RankCoord(tp=r, pp=p))[0]
            for j in range(2):  # two layers per stage
                i = p * 2 + j
                pre = f"model.layers.{i}."
                q, k, v = (sd[pre + f"self_attn.{x}_proj.weight"] for x in "qkv")
                fused = torch.cat([q.reshape(ng, nh // ng * hd, h), k.reshape(ng, hd, h), v.reshape(ng, hd, h)],
                                  dim=1).reshape(-1, h)
                assert torch.equal(qkv[j], fused.chunk(tp)[r])
                gate, up = sd[pre + "mlp.gate_proj.weight"], sd[pre + "mlp.up_proj.weight"]
                assert torch.equal(fc1[j], torch.cat([gate.chunk(tp)[r], up.chunk(tp)[r]]))
                gb, ub = sd[pre + "mlp.gate_proj.bias"], sd[pre + "mlp.up_proj.bias"]
                assert torch.equal(fc1b[j], torch.cat([gb.chunk(tp)[r], ub.chunk(tp)[r]]))
                assert torch.equal(proj[j], sd[pre + "self_attn.o_proj.weight"].chunk(tp, dim=1)[r])
                assert torch.equal(fc2[j], sd[pre + "mlp.down_proj.weight"].chunk(tp, dim=1)[r])
    # vocab: padded to 128*tp = 256 rows... 300 -> 512, rank 1 holds rows 256..511 (44 real rows then padding)
    emb = sd["model.embed_tokens.weight"]
    e1 = ckpt.read_local("embedding.word_embeddings.weight", lay, RankCoord(tp=1))[0]
    assert e1.shape == (256, h)
    assert torch.equal(e1[:44], emb[256:300])
    assert torch.equal(e1[44:], emb[-1:].expand(212, h))  # Megatron fills padding with the last row
    assert ckpt.read_local("embedding.word_embeddings.weight", lay, RankCoord(tp=1, pp=1)) == {}  # first stage only
    # read at another layout: tp=1 pads to 384 and sees the stored rows
    e_tp1 = ckpt.read_local("embedding.word_embeddings.weight", Layout(), RankCoord())[0]
    assert e_tp1.shape == (384, h) and torch.equal(e_tp1[:300], emb)


def test_interrupted_conversion_resumes_bitwise(tmp_path, monkeypatch):
    _, hf_dir = save_hf(tmp_path, "llama_gqa", torch.bfloat16, num_hidden_layers=4)
    ref = convert_hf_to_mcore(hf_dir, tmp_path / "ref", Layout(tp=2, pp=2), quiet=True)

    calls = {"n": 0}
    real = hf_to_mcore._Worker.__call__

    def flaky(self, task):
        calls["n"] += 1
        if calls["n"] == 20:
            raise KeyboardInterrupt  # as if killed mid-way
        return real(self, task)

    monkeypatch.setattr(hf_to_mcore._Worker, "__call__", flaky)
    with pytest.raises(KeyboardInterrupt):
        convert_hf_to_mcore(hf_dir, tmp_path / "out", Layout(tp=2, pp=2), workers=1, quiet=True)
    assert not (tmp_path / "out" / "latest").exists()
    assert not (tmp_path / "out" / "iter_0000000").exists()
    assert (tmp_path / "out" / "iter_0000000.partial").is_dir()

    calls["n"] = -10**9  # no more failures; count what the rerun does
    before = calls["n"]
    out = convert_hf_to_mcore(hf_dir, tmp_path / "out", Layout(tp=2, pp=2), workers=1, quiet=True)
    redone = calls["n"] - before
    total = len(hf_to_mcore.plan(Checkpoint(out).config, Layout(tp=2, pp=2), hf_to_mcore.HFSource(hf_dir), None)[1])
    assert redone == total - 19  # the 19 finished chunks were not redone
    a, b = Checkpoint(ref), Checkpoint(out)
    for name in a.tensors:
        assert torch.equal(a.read(name), b.read(name)), name
    for f in sorted((ref / "model").rglob("*")):
        if f.is_file():
            assert f.read_bytes() == (out / "model" / f.relative_to(ref / "model")).read_bytes(), f


def test_parallel_workers_equal_single_process(tmp_path):
    _, hf_dir = save_hf(tmp_path, "qwen2", torch.bfloat16)
    one = convert_hf_to_mcore(hf_dir, tmp_path / "one", Layout(tp=2, pp=2), workers=1, quiet=True)
    two = convert_hf_to_mcore(hf_dir, tmp_path / "two", Layout(tp=2, pp=2), workers=2, quiet=True)
    a, b = Checkpoint(one), Checkpoint(two)
    for name in a.tensors:
        assert torch.equal(a.read(name), b.read(name)), name


def test_overwrite_replaces_and_cleans(tmp_path):
    _, hf_dir = save_hf(tmp_path, "llama_gqa")
    convert_hf_to_mcore(hf_dir, tmp_path / "ck", Layout(tp=1), quiet=True)
    convert_hf_to_mcore(hf_dir, tmp_path / "ck", Layout(tp=2), overwrite=True, quiet=True)
    ck = Checkpoint(tmp_path / "ck")
    assert ck.layout.tp == 2
    assert sorted(p.name for p in (tmp_path / "ck").iterdir() if not p.name.startswith(".")) == \
        ["iter_0000000", "latest"]
    shutil.rmtree(tmp_path / "ck")


def _tensors(d) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def test_remote_code_is_never_executed(tmp_path):
    """A config whose auto_map points at a module that would leave a marker: convert, verify and export never run it."""
    _, hf_dir = save_hf(tmp_path, "llama_gqa")
    marker = tmp_path / "pwned"
    (hf_dir / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\nclass Model: pass\n")
    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg["auto_map"] = {"AutoConfig": "evil.Model", "AutoModelForCausalLM": "evil.Model"}
    (hf_dir / "config.json").write_text(json.dumps(cfg))
    out = convert_hf_to_mcore(hf_dir, tmp_path / "ck", Layout(tp=2), quiet=True)
    ckpt = Checkpoint(out)
    assert logit_parity(ckpt.config, ckpt.state_dict(), hf_dir)["max_abs_diff"] <= TOL
    back = convert_mcore_to_hf(tmp_path / "ck", tmp_path / "back", quiet=True)
    assert json.loads((back / "config.json").read_text())["auto_map"] == cfg["auto_map"]
    assert not marker.exists()


def test_same_dtype_conversion_never_imports_torch(tmp_path):
    """bf16 -> bf16 goes through numpy views of the mapped shards only: importing torch costs ~1.5 s of CPU per run
    (and per worker process), so a stray import on this path (the CLI's parser included) is a regression."""
    import subprocess
    import sys
    from pathlib import Path

    _, hf_dir = save_hf(tmp_path, "llama_gqa", torch.bfloat16)
    out = tmp_path / "ck"
    code = ("import sys; from shardkit.cli import main; "
            f"rc = main(['convert', 'hf-to-mcore', {str(hf_dir)!r}, {str(out)!r}, '--tp', '2', '--pp', '2', "
            "'--quiet', '--no-verify']); print(rc, [m for m in sys.modules if m == 'torch' or m.startswith('torch.')][:3])")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parent.parent)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().splitlines()[-1] == "0 []", res.stdout
    ref = convert_hf_to_mcore(hf_dir, tmp_path / "ref", Layout(tp=2, pp=2), quiet=True)
    for f in sorted((ref / "model").rglob("*")):
        if f.is_file():
            assert f.read_bytes() == (out / "iter_0000000" / "model" / f.relative_to(ref / "model")).read_bytes(), f


def test_cast_rounds_as_torch(tmp_path):
    """A dtype change goes through torch's own cast, so fp32 -> bf16 rounds exactly as `tensor.to(torch.bfloat16)`."""
    hf, hf_dir = save_hf(tmp_path, "llama_gqa", torch.float32)
    ck = Checkpoint(convert_hf_to_mcore(hf_dir, tmp_path / "ck", Layout(tp=2), dtype="bf16", quiet=True))
    emb = hf.model.embed_tokens.weight.detach()
    got = ck.read("embedding.word_embeddings.weight")[: emb.shape[0]]
    assert torch.equal(got.view(torch.int16), emb.to(torch.bfloat16).view(torch.int16))


def _safetensors_offsets(hf_dir) -> dict[str, tuple[str, int, int]]:
    """HF tensor -> (file, absolute byte offset of its data, bytes per row), from the safetensors headers."""
    import struct

    out = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        raw = f.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        for name, h in json.loads(raw[8:8 + n]).items():
            if name != "__metadata__":
                rows = h["shape"][0] if h["shape"] else 1
                out[name] = (f.name, 8 + n + h["data_offsets"][0], (h["data_offsets"][1] - h["data_offsets"][0]) // rows)
    return out


def test_source_is_read_front_to_back_and_scanned_once(tmp_path, monkeypatch):
    """Issue 42 (the conversion's own cost): chunks run in the order of the HF bytes they read (a cold source is read
    front to back, not one tensor name across all layers at a time), and every source byte is scanned for NaN/Inf
    once (the sink does not scan the chunk again)."""
    from checkpoint import store

    hf, _ = make_hf(*CASES["llama_gqa"][:2]), None
    hf_dir = tmp_path / "hf"
    hf.to(torch.bfloat16).save_pretrained(hf_dir, max_shard_size="40KB")
    where = _safetensors_offsets(hf_dir)
    assert len({f for f, _, _ in where.values()}) > 2
    chunks: list[list[tuple[str, int]]] = []
    real_call, real_read = hf_to_mcore._Worker.__call__, hf_to_mcore._LazySource.read

    def call(self, task):
        chunks.append([])
        return real_call(self, task)

    def read(self, name, start, stop, cols=None):
        f, off, row = where[name]
        chunks[-1].append((f, off + start * row))
        return real_read(self, name, start, stop, cols)

    scanned, depth = [], [0]
    real_count = store.count_nonfinite

    def count(a):  # (a column slice is scanned a block at a time by count_nonfinite calling itself: counted once)
        if not depth[0]:
            scanned.append(a.nbytes)
        depth[0] += 1
        try:
            return real_count(a)
        finally:
            depth[0] -= 1

    monkeypatch.setattr(hf_to_mcore._Worker, "__call__", call)
    monkeypatch.setattr(hf_to_mcore._LazySource, "read", read)
    monkeypatch.setattr(store, "count_nonfinite", count)
    monkeypatch.setattr(hf_to_mcore, "count_nonfinite", count)
    out = convert_hf_to_mcore(hf_dir, tmp_path / "ck", Layout(tp=2, pp=2), workers=1, quiet=True)
    firsts = [min(c) for c in chunks if c]
    assert firsts == sorted(firsts)
    stored = sum(int(np.prod(e.shape)) * store.itemsize(e.dtype) for e in Checkpoint(out).manifest.tensors.values())
    assert sum(scanned) == stored  # (the vocab padding included: its rows are written too)
