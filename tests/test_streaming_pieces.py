"""verify --against, streamed in sub-layer pieces (issue 18, second part): routed experts one at a time and each read
once, --all-experts, MTP layers, dense MLPs and the head cut to fit --memory-budget with the same numbers, a planted
error named at its layer and expert, bad input in one line, `convert hf-to-mcore --verify`, and a smoke run of
scripts/bench_verify.py at tiny dims."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from verify.against import against_hf
from verify.budget import memory_needs, piece_groups
from verify.report import compared
from verify.streamed import stream_parity
from tests import moe_models
from tests.test_model_parity import CASES, make_hf
from tests.test_streaming_parity import _cli, _convert, _hf_dir, _plant, whole_layer_diffs

REPO = Path(__file__).resolve().parent.parent


def _bump_row(t):
    t[0] += 0.5
    return t


@pytest.mark.parametrize("case", ["mixtral", "deepseek_v3"])
def test_each_expert_read_once_and_only_selected_ones(tmp_path, case):
    hf_dir, seq = _hf_dir(tmp_path, case)
    ck = _convert(tmp_path, hf_dir, ep=2)
    s = stream_parity(ck, hf_dir, seq_len=seq)
    assert s["max_abs_diff"] <= 1e-4 and s["layers_ok"]
    # no tensor (nor box of one) read twice, on either side
    assert s["max_reads_of_one_tensor"] == {"ours": 1, "hf": 1}, s["max_reads_of_one_tensor"]
    for r in s["layers"]:
        if "experts" in r:  # what was loaded is what the tokens selected (HF) / the union with ours
            assert r["experts_exercised"] == r["experts_selected"] <= r["experts_loaded_ours"] <= r["experts"]
    assert 0 < s["experts_exercised"] <= s["experts_total"]


def test_all_experts_finds_an_error_no_token_selects(tmp_path):
    hf_dir, seq = _hf_dir(tmp_path, "mixtral")
    ck = _convert(tmp_path, hf_dir)
    # few tokens, so that some expert of some layer is selected by none of them
    s = stream_parity(ck, hf_dir, batch=1, seq_len=1)
    layer_row = next(r for r in s["layers"] if "experts" in r and r["experts_selected"] < r["experts"])
    layer = layer_row["layer"]
    a = stream_parity(ck, hf_dir, batch=1, seq_len=1, all_experts=True)
    assert all(r["experts_exercised"] == r["experts"] for r in a["layers"] if "experts" in r)
    assert a["experts_exercised"] == a["experts_total"] and a["ok"] if "ok" in a else a["layers_ok"]
    assert a["max_reads_of_one_tensor"] == {"ours": 1, "hf": 1}
    unselected = next(e for e in range(layer_row["experts"])
                      if e not in _selected(ck, hf_dir, layer))
    _plant(hf_dir, f"model.layers.{layer}.block_sparse_moe.experts.{unselected}.w1.weight", _bump_row)
    plain = stream_parity(ck, hf_dir, batch=1, seq_len=1)
    assert plain["layers_ok"] and plain["max_abs_diff"] <= 1e-4  # the tokens never reach it
    found = stream_parity(ck, hf_dir, batch=1, seq_len=1, all_experts=True)
    assert found["first_layer_beyond_tolerance"] == layer
    assert found["first_expert_beyond_tolerance"] == unselected
    r = subprocess.run([sys.executable, "-m", "shardkit", "verify", str(ck.path), "--against", str(hf_dir),
                        "--all-experts", "--seq-length", "1", "--quiet"], capture_output=True, text=True)
    err = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(err) == 1 and f"layer {layer} (expert {unselected})" in err[0], r.stderr


def _selected(ck, hf_dir, layer):
    """The experts HF's router picks at `layer` for the 1-token test input (from a plain streaming run's stand-in)."""
    import verify.streamed as st

    seen = {}
    orig = st._StreamedHFExperts.forward

    def spy(self, hidden, idx, w):
        seen.setdefault(self.layer, set()).update(idx.flatten().tolist())
        return orig(self, hidden, idx, w)

    st._StreamedHFExperts.forward = spy
    try:
        stream_parity(ck, hf_dir, batch=1, seq_len=1)
    finally:
        st._StreamedHFExperts.forward = orig
    return seen[layer]


def test_mtp_layer_compared_and_a_planted_error_named(tmp_path):
    hf_dir, seq = _hf_dir(tmp_path, "deepseek_v3")
    ck = _convert(tmp_path, hf_dir, ep=2)
    assert ck.config.mtp_num_layers == 1
    s = stream_parity(ck, hf_dir, seq_len=seq)
    mtp = [r for r in s["layers"] if r["layer"] == "mtp.0"]
    assert mtp and s["layers_ok"], s["layers"]
    (row,) = mtp
    assert row["max_abs_diff"] <= 1e-5 and row["eh_proj_max_abs_diff"] <= 1e-5 and row["logits_max_abs_diff"] <= 1e-4
    assert row["experts_exercised"] > 0 and s["mtp_max_abs_diff"][0] <= 1e-4
    L = ck.config.num_layers
    # every row compared is named, in `convert`'s line and `verify`'s report alike (issue 42)
    assert compared(s) == f"embedding, decoder layers 0-{L - 1}, head, MTP layer 0"
    assert compared({**s, "layers": [{"layer": n} for n in ("embedding", 0, 2, 3, "head", "mtp.0", "mtp.1")]}) == \
        "embedding, decoder layer 0, decoder layers 2-3, head, MTP layer 0, MTP layer 1"
    _plant(hf_dir, f"model.layers.{L}.eh_proj.weight", _bump_row)
    bad = stream_parity(ck, hf_dir, seq_len=seq)
    assert bad["first_layer_beyond_tolerance"] == "mtp.0" and bad["max_abs_diff"] <= 1e-4  # main logits still fine
    from verify.report import first_beyond

    assert first_beyond(bad) == "MTP layer 0"  # as the compared list names it (the error line said 'layer mtp.0')
    assert not against_hf(ck, hf_dir, seq_len=seq, streaming=True)["ok"]


def test_report_names_an_mtp_row_beyond_the_tolerance(tmp_path, capsys):
    """verify's report on an MTP layer that fails on its eh_proj input (its transformer layer on HF's input equal):
    the row is named with the number that fails it, and the worst |diff| is that number (was a FAIL with a worst
    |diff| of 0 and no row named, while the error line named layer mtp.0)."""
    from verify.report import print_report

    hf_dir, seq = _hf_dir(tmp_path, "deepseek_v3")
    ck = _convert(tmp_path, hf_dir)
    L = ck.config.num_layers
    _plant(hf_dir, f"model.layers.{L}.eh_proj.weight", _bump_row)
    p = against_hf(ck, hf_dir, seq_len=seq, streaming=True)
    (row,) = [r for r in p["layers"] if r["layer"] == "mtp.0"]
    assert not p["ok"] and row["max_abs_diff"] <= 1e-4 < row["eh_proj_max_abs_diff"], row
    capsys.readouterr()
    print_report({"path": "ck", "tensors": 1, "chunks": 1, "bytes": 1, "nonfinite": {}, "parity": p, "ok": False},
                 str(hf_dir))
    out = capsys.readouterr().out
    assert f"  MTP layer 0: |diff| {row['max_abs_diff']:.3e}, eh_proj {row['eh_proj_max_abs_diff']:.3e} beyond the " \
           "tolerance" in out, out
    worst = max(row["eh_proj_max_abs_diff"], row.get("logits_max_abs_diff", 0))
    assert f"worst |diff| {worst:.3e}" in out, out


def test_deepseek_expert_error_named_at_layer_and_expert(tmp_path):
    hf_dir, seq = _hf_dir(tmp_path, "deepseek_v2_lite")
    ck = _convert(tmp_path, hf_dir, ep=2)
    a = stream_parity(ck, hf_dir, seq_len=seq, all_experts=True)
    assert a["layers_ok"]
    _plant(hf_dir, "model.layers.2.mlp.experts.5.down_proj.weight", _bump_row)
    s = stream_parity(ck, hf_dir, seq_len=seq, all_experts=True)
    assert s["first_layer_beyond_tolerance"] == 2 and s["first_expert_beyond_tolerance"] == 5, s["layers"]
    assert all(r["max_abs_diff"] <= 1e-4 for r in s["layers"] if r["layer"] in ("embedding", 0, 1))


@pytest.mark.parametrize("case", ["llama_bias", "qwen2", "llama_tied"])
def test_pieces_within_a_small_budget_give_the_same_numbers(tmp_path, case):
    """A budget below one layer: the dense MLPs run in pieces and the head in vocabulary blocks (tp=2: vocab padded),
    per-layer numbers as the whole-model reference and the same verdict."""
    hf_dir, seq = _hf_dir(tmp_path, case)
    ck = _convert(tmp_path, hf_dir, tp=2)
    g = piece_groups(ck)["layers"][0]
    # the attention or half the MLP fit, not the whole layer
    budget = max(memory_needs(ck)["streaming"], 2 * 4 * max(g["rest"], g["mlp"] // 2))
    assert budget < 2 * 4 * (g["rest"] + g["mlp"])
    s = stream_parity(ck, hf_dir, seq_len=seq, memory_budget=budget)
    assert s["pieces"]["mlp"] and s["pieces"]["head_rows"] < ck.config.vocab_size, s["pieces"]
    per_layer = [r["max_abs_diff"] for r in s["layers"] if isinstance(r["layer"], int)]
    assert per_layer == pytest.approx(whole_layer_diffs(ck, hf_dir, seq), abs=1e-6)
    assert s["layers_ok"] and s["max_abs_diff"] <= 1e-4
    assert s["max_reads_of_one_tensor"]["ours"] == (2 if case == "llama_tied" else 1)  # tied: embedding, then head


def test_planted_head_row_gives_the_whole_mode_numbers(tmp_path):
    """The head in vocabulary blocks, one row of HF's lm_head wrong in its last block: the blocks whose stored bits
    equal ours share one product per input, that block is computed from each side's own weights, and the numbers are
    the whole-model mode's; the head row is the first beyond the tolerance, every layer within it."""
    from verify.whole import logit_parity

    hf_dir, seq = _hf_dir(tmp_path, "llama_gqa")
    ck = _convert(tmp_path, hf_dir, tp=2)
    vocab = ck.config.vocab_size

    def bump(t):
        t[vocab - 1] += 0.5
        return t

    _plant(hf_dir, "lm_head.weight", bump)
    budget = memory_needs(ck)["streaming"]
    s = stream_parity(ck, hf_dir, seq_len=seq, memory_budget=budget)
    assert s["pieces"]["head_rows"] < vocab - 1, s["pieces"]  # the wrong row is not in the first block
    whole = logit_parity(ck.config, ck.state_dict(), hf_dir, seq_len=seq)
    assert s["max_abs_diff"] == pytest.approx(whole["max_abs_diff"], rel=1e-6) and s["max_abs_diff"] > 1e-2
    head = next(r for r in s["layers"] if r["layer"] == "head")
    assert head["max_abs_diff"] == pytest.approx(whole["max_abs_diff"], rel=1e-6)
    assert s["first_layer_beyond_tolerance"] == "head" and not s["layers_ok"]
    assert all(r["max_abs_diff"] <= 1e-4 for r in s["layers"] if r["layer"] != "head")


def test_bad_input_one_line_each(tmp_path):
    hf_dir, seq = _hf_dir(tmp_path, "mixtral")
    ck = _convert(tmp_path, hf_dir)
    other = tmp_path / "other"
    moe_models.build("mixtral", other, num_experts_per_tok=1)
    missing = tmp_path / "missing"
    moe_models.build("mixtral", missing)
    sd_path = missing / "model.safetensors"
    from safetensors.torch import load_file, save_file

    sd = load_file(str(sd_path))
    gone = "model.layers.1.block_sparse_moe.experts.3.w2.weight"
    del sd[gone]
    save_file(sd, str(sd_path), metadata={"format": "pt"})
    expert = 2 * 4 * piece_groups(ck)["layers"][0]["expert"]
    cases = [(["--against", str(other)], "moe_router_topk is 1 there but 2"),
             (["--against", str(other), "--streaming"], "moe_router_topk"),
             (["--against", str(missing), "--all-experts"], gone),
             (["--against", str(hf_dir), "--streaming", "--memory-budget", str(expert // 2)], "bytes in fp32")]
    for extra, needle in cases:
        r = _cli("verify", str(ck.path), "--seq-length", str(seq), "--quiet", *extra)
        err = r.stderr.strip().splitlines()
        assert r.returncode != 0 and len(err) == 1 and needle in err[0] and "Traceback" not in r.stderr, \
            (extra, r.stderr)


def test_convert_verifies_by_default(tmp_path, capsys):
    """`convert hf-to-mcore` proves what it wrote unless told not to (--no-verify), native and torch_dist (read in
    place); a difference is one error line and exit 1; where no logit comparison can be made (--allow-nonfinite)
    the default says so in one line and passes, an explicit --verify still runs. (In process: the CLI itself, also
    through a subprocess, is what test_convert's and the demo's runs exercise.)"""
    from shardkit.cli import main

    cls, overrides, seq = CASES["llama_gqa"]
    hf_dir = tmp_path / "hf"
    make_hf(cls, overrides).save_pretrained(hf_dir)

    def run(*argv):
        capsys.readouterr()
        rc = main(["convert", "hf-to-mcore", str(hf_dir), *map(str, argv), "--quiet"])
        out, err = capsys.readouterr()
        return rc, [ln for ln in out.splitlines() if ln.startswith("verify:")], err

    rc, verdict, err = run(tmp_path / "ck", "--tp", "2")
    assert rc == 0 and err == "" and len(verdict) == 1 and "OK" in verdict[0] and "whole" in verdict[0], verdict
    assert "; compared: the final logits (whole model)" in verdict[0], verdict  # the line says what it compared
    assert run(tmp_path / "ck2", "--no-verify")[:2] == (0, [])
    rc, verdict, _ = run(tmp_path / "td", "--format", "torch_dist", "--tp", "2")
    assert rc == 0 and len(verdict) == 1 and "OK" in verdict[0], verdict
    rc, verdict, _ = run(tmp_path / "ck4", "--allow-nonfinite")
    assert rc == 0 and verdict == [verdict[0]] and verdict[0].startswith("verify: skipped (--allow-nonfinite"), verdict
    rc, verdict, _ = run(tmp_path / "ck5", "--allow-nonfinite", "--verify")
    assert rc == 0 and len(verdict) == 1 and verdict[0].startswith("verify: logits"), verdict
    # against a model that differs (another seed, the same config): exit 1, one error line
    from convert.hf_to_mcore import verify_conversion

    other = tmp_path / "other"
    make_hf(cls, overrides).save_pretrained(other)  # the global generator has moved on: other weights
    capsys.readouterr()
    assert verify_conversion(tmp_path / "ck", other, quiet=True) == 1
    assert verify_conversion(tmp_path / "td", other, quiet=True) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all("is written but does not reproduce" in e for e in err), err


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_a_cast_conversion_is_proven_against_the_cast_source(tmp_path, capsys, dtype):
    """`convert --dtype bf16` (or fp16) of an fp32 model: the proof compares with HF's weights as the conversion
    stored them (rounded to that dtype), in both modes and formats, so it passes, exactly; a weight that differs beyond
    the rounding still fails it. (It compared with HF's fp32 weights: every cast conversion failed its default proof
    and was withdrawn.)"""
    import torch
    from safetensors.torch import load_file

    from checkpoint import opened
    from shardkit.cli import main

    cls, overrides, seq = CASES["llama_gqa"]
    hf_dir = tmp_path / "hf"
    make_hf(cls, overrides).save_pretrained(hf_dir)
    assert next(iter(load_file(str(hf_dir / "model.safetensors")).values())).dtype == torch.float32
    for fmt in ("native", "torch_dist"):
        out = tmp_path / fmt
        capsys.readouterr()
        assert main(["convert", "hf-to-mcore", str(hf_dir), str(out), "--dtype", dtype, "--format", fmt,
                     "--quiet"]) == 0, capsys.readouterr()
        line = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("verify:")]
        assert len(line) == 1 and ": OK in " in line[0], line
        ck = opened.open_checkpoint(out).reader
        for streaming in (False, True):
            r = against_hf(ck, hf_dir, seq_len=seq, streaming=streaming)
            assert r["ok"] and r["max_abs_diff"] == 0.0, (fmt, streaming, r["max_abs_diff"])
    _plant(hf_dir, "model.layers.1.mlp.down_proj.weight", _bump_row)
    for streaming in (False, True):
        r = against_hf(opened.open_checkpoint(tmp_path / "native").reader, hf_dir, seq_len=seq, streaming=streaming)
        assert not r["ok"], streaming
        assert not streaming or r["first_layer_beyond_tolerance"] == 1, r.get("first_layer_beyond_tolerance")


def test_streamed_verify_of_a_torch_dist_checkpoint(tmp_path):
    """verify --against --streaming reads a torch_dist checkpoint in place (its items), with the numbers of the
    native checkpoint of the same model."""
    from checkpoint.layout import Layout
    from checkpoint.torch_dist import read_torch_dist
    from checkpoint.torch_dist_view import TorchDistSource
    from convert.torch_dist_io import convert_hf_to_torch_dist

    hf_dir, seq = _hf_dir(tmp_path, "llama_bias")
    ck = _convert(tmp_path, hf_dir, tp=2)
    td_path = convert_hf_to_torch_dist(hf_dir, tmp_path / "td", Layout(tp=2), quiet=True)
    td = read_torch_dist(td_path)
    cfg, origin = td.model_config(None, None)
    src = TorchDistSource(td, cfg, td.layout, origin)
    a = stream_parity(src, hf_dir, seq_len=seq)
    b = stream_parity(ck, hf_dir, seq_len=seq)
    assert a["layers_ok"] and a["max_abs_diff"] <= 1e-4
    assert [r["max_abs_diff"] for r in a["layers"]] == [r["max_abs_diff"] for r in b["layers"]]


def test_bench_verify_smoke(tmp_path):
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "mine.txt").write_text("a file the benchmark did not write")
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_verify.py"), "--tiny", "--workdir",
                        str(tmp_path / "w"), "--json", str(tmp_path / "out.json")],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = json.loads((tmp_path / "out.json").read_text())["rows"]
    assert {row["model"] for row in rows} == {"llama", "deepseek_v3"}
    assert all(row["ok"] and row["verify_s"] > 0 and row["cat_s"] >= 0 for row in rows)
    assert (tmp_path / "w" / "mine.txt").is_file() and not any((tmp_path / "w").glob("run-*"))  # only its own run dir goes


def test_cast_pool_reuses_buffers_within_its_cap():
    """The fp32 buffers of the casts: the same values as .float(), a buffer given back serves the next tensor of a
    size it holds (not one under half its size), a module's parameters come from it and go back when freed, and the
    idle plus lent buffers never exceed the cap (beyond it they are dropped)."""
    import torch

    from verify.hf_weights import CastPool

    n = 4 * CastPool.MIN
    pool = CastPool(cap=4 * n * 4)
    src = torch.randn(2, n // 2).to(torch.bfloat16)
    a = pool.cast(src)
    assert a.dtype == torch.float32 and torch.equal(a, src.float())
    ptr = a.data_ptr()
    pool.give(a)
    b = pool.take((n // 2, 2))  # same count, another shape: the same buffer
    assert b.data_ptr() == ptr and b.shape == (n // 2, 2)
    pool.give(b)
    small = pool.take((n // 4,))  # under half its size: a fresh one
    assert small.data_ptr() != ptr
    c = pool.take((3 * n // 4,))  # smaller, over half: the idle buffer's head
    assert c.data_ptr() == ptr
    pool.give(c)
    lin = torch.nn.Linear(n // 4, 3, bias=False, device="meta")
    pool.materialise(lin)
    assert lin.weight.device.type == "cpu" and lin.weight.data_ptr() == ptr
    pool.free(lin)
    assert lin.weight.device.type == "meta" and pool.idle_bytes == n * 4
    big = [pool.take((n,)) for _ in range(4)]  # 1 idle reused + 3 fresh, and the small one lent: over the cap
    for t in big:
        pool.give(t)
    assert pool.idle_bytes + pool.lent_bytes <= pool.cap and pool.idle_bytes < 4 * n * 4
    pool.clear()
    assert pool.idle_bytes == 0 and not pool.idle


@pytest.mark.parametrize("case,layout,pieces", [("deepseek_v3", {"ep": 2}, False), ("llama_bias", {"tp": 2}, True)])
def test_readahead_names_every_byte_before_it_is_read(tmp_path, monkeypatch, case, layout, pieces):
    """The read-ahead hints (posix_fadvise WILLNEED from a thread of its own) cover every chunk file of ours and
    every byte range of HF's safetensors the walk reads, each hinted before it is read: embedding rows, layers, MTP
    layer, routed experts once routed (all of them with --all-experts), MLP pieces and head blocks."""
    import checkpoint.chunkio as chunkio
    import verify.hf_weights as hw

    hf_dir, seq = _hf_dir(tmp_path, case)
    ck = _convert(tmp_path, hf_dir, **layout)
    budget = None
    if pieces:
        g = piece_groups(ck)["layers"][0]
        budget = max(memory_needs(ck)["streaming"], 2 * 4 * max(g["rest"], g["mlp"] // 2))
    hinted: list = []
    late: list = []
    put = hw.Readahead.put
    monkeypatch.setattr(hw.Readahead, "put", lambda self, r: (hinted.append(r), put(self, r))[1])

    def covered(path, a, b):
        return any(Path(p) == Path(path) and o <= a and (b <= o + n if n else True) for p, o, n in hinted)

    map_chunk = chunkio.map_chunk

    def mapped(path, *args, **kw):
        if not covered(path, 0, 0):
            late.append(str(path))
        return map_chunk(path, *args, **kw)

    get = hw.HFWeights.get

    def read(self, key, rows=None, cols=None):
        path, a, n = self.byte_range(key, rows if cols is None else None)
        if not covered(path, a, a + n):
            late.append(key)
        return get(self, key, rows, cols)

    monkeypatch.setattr(chunkio, "map_chunk", mapped)
    monkeypatch.setattr(hw.HFWeights, "get", read)
    s = stream_parity(ck, hf_dir, seq_len=seq, memory_budget=budget, all_experts=case == "deepseek_v3")
    assert s["layers_ok"] and s["max_abs_diff"] <= 1e-4
    if pieces:
        assert s["pieces"]["mlp"] and s["pieces"]["head_rows"] < ck.config.vocab_size
    assert hinted and not late, late[:5]


def test_walk_hints_ahead_within_its_window():
    """A walk hints the step it is at and the next one always, further ones only while they fit the window."""
    import verify.hf_weights as hw

    class Rec(hw.Readahead):
        def __init__(self, window):
            self.window, self.got = window, []

        def put(self, r):
            self.got.append(r[0])

    ahead = Rec(window=250)
    w = ahead.walk([[(f"s{i}", 0, 100)] for i in range(6)])
    w.at(0)
    assert ahead.got == ["s0", "s1", "s2"]  # s1 + s2 = 200 <= 250 ahead of step 0; s3 would make 300
    w.at(1)
    assert ahead.got == ["s0", "s1", "s2", "s3"]
    w.at(5)
    assert ahead.got == [f"s{i}" for i in range(6)]
    tight = Rec(window=0)
    tight.walk([[(f"s{i}", 0, 100), None] for i in range(3)]).at(0)  # None: a tensor HF lacks (named where read)
    assert tight.got == ["s0", "s1"]  # the next step even when the window holds nothing


def test_comparison_is_exact_fp32_whatever_the_process_set(tmp_path, monkeypatch):
    """A process set to reduced-precision fp32 matmuls ("medium": bf16 on CPUs with AMX) still compares in exact
    fp32 (the setting is restored after); where the setting cannot be raised, one line says so."""
    import torch

    from checkpoint.errors import ShardkitError
    from verify.common import exact_fp32

    hf_dir, seq = _hf_dir(tmp_path, "llama_gqa")
    ck = _convert(tmp_path, hf_dir)
    torch.set_float32_matmul_precision("medium")
    try:
        r = against_hf(ck, hf_dir, seq_len=seq, streaming=True)
        assert torch.get_float32_matmul_precision() == "medium"
        assert r["ok"] and r["max_abs_diff"] <= 1e-5, r["max_abs_diff"]
        g = torch.Generator().manual_seed(1)
        x, w = torch.randn(64, 1024, generator=g), torch.randn(256, 1024, generator=g)
        if torch.equal(torch.nn.functional.linear(x, w), x @ w.T) and \
                ((x @ w.T).double() - x.double() @ w.double().T).abs().max() < 1e-3:
            pytest.skip("reduced-precision fp32 matmuls are exact on this CPU: nothing to refuse")
        monkeypatch.setattr(torch, "set_float32_matmul_precision", lambda p: None)  # cannot be raised
        with pytest.raises(ShardkitError, match="not exact fp32"), exact_fp32():
            pass
    finally:
        torch.backends.mkldnn.matmul.fp32_precision = "ieee"
        monkeypatch.undo()
        torch.set_float32_matmul_precision("highest")


def test_a_file_rewritten_during_the_comparison_is_named(tmp_path, monkeypatch):
    """Another writer rewriting the HF directory (or the checkpoint) while it is compared: one line naming the
    file, never a verdict."""
    import verify.hf_weights as hw
    from checkpoint.errors import ShardkitError

    hf_dir, seq = _hf_dir(tmp_path, "llama_gqa")
    ck = _convert(tmp_path, hf_dir)
    release = hw.HFWeights.release
    done = []

    def rewrite(self):
        if not done:
            done.append(1)
            (hf_dir / "config.json").write_text((hf_dir / "config.json").read_text())  # same bytes, rewritten
        return release(self)

    monkeypatch.setattr(hw.HFWeights, "release", rewrite)
    with pytest.raises(ShardkitError, match=r"config\.json changed while it was being compared"):
        against_hf(ck, hf_dir, seq_len=seq, streaming=True)



def test_an_in_process_conversion_leaves_torch_threads_as_they_were(tmp_path):
    """The in-process writer pins torch to one thread for its casts; the conversion undoes that, so the verify
    that follows (fp32 GEMMs) runs on every core it had."""
    import torch

    from checkpoint.layout import Layout
    from convert.hf_to_mcore import convert_hf_to_mcore

    hf_dir, _ = _hf_dir(tmp_path, "llama_gqa")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        convert_hf_to_mcore(hf_dir, tmp_path / "ck", Layout(), workers=1, quiet=True)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
