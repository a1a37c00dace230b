"""verify --against in streaming mode (verify/streamed.py): one layer in memory at a time, the same verdict and the
same numbers as the whole-model mode, a planted error named at its layer (and expert), bad input in one line.

The reference per-layer numbers are computed here independently of the streaming code: transformers' whole model
loaded by from_pretrained, its decoder layers' inputs and outputs captured by hooks, and our whole GPTModel's layer i
run on HF's input of layer i."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from checkpoint.layout import Layout
from checkpoint.reader import Checkpoint
from convert.hf_to_mcore import convert_hf_to_mcore
from verify.against import against_hf
from verify.common import HF_ATTN_IMPLEMENTATION
from verify.whole import logit_parity
from verify.budget import choose_mode
from verify.streamed import stream_parity
from tests import moe_models
from tests.test_model_parity import CASES, make_hf
from train.model import GPTModel

DENSE = ["llama_gqa", "llama_tied", "llama_rope_yarn", "llama_bias", "mistral_sliding_window", "qwen2"]
MOE = ["mixtral", "deepseek_v2_lite", "deepseek_v3"]


def _hf_dir(tmp_path, case):
    d = tmp_path / f"hf-{case}"
    if case in MOE:
        moe_models.build(case, d)
        return d, 32
    cls, overrides, seq = CASES[case]
    make_hf(cls, overrides).save_pretrained(d)
    return d, seq


def _convert(tmp_path, hf_dir, **layout):
    return Checkpoint(convert_hf_to_mcore(hf_dir, tmp_path / "ck", Layout(**layout), quiet=True).parent)


def whole_layer_diffs(ck: Checkpoint, hf_dir, seq_len: int) -> list[float]:
    """Each of our layers on HF's input of that layer, with both models whole: max |ours - HF| per layer."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32,
                                                           attn_implementation=HF_ATTN_IMPLEMENTATION).eval()
    seen = []
    for layer in hf.model.layers:
        layer.register_forward_hook(
            lambda m, a, kw, out: seen.append((a[0] if a else kw["hidden_states"],
                                               out[0] if isinstance(out, tuple) else out)), with_kwargs=True)
    cfg = ck.config
    sd = ck.state_dict()
    with torch.device("meta"):
        ours = GPTModel(cfg, sd["embedding.word_embeddings.weight"].shape[0])
    ours = ours.to_empty(device="cpu").float()
    ours.load_canonical(sd)
    ids = torch.randint(0, cfg.vocab_size, (2, seq_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hf(input_ids=ids, use_cache=False)
        cos, sin = ours.rope(ids, None, torch.float32)
        return [(ours.decoder.layers[str(i)](h_in, cos, sin) - h_out).abs().max().item()
                for i, (h_in, h_out) in enumerate(seen)]


@pytest.mark.parametrize("case", DENSE + MOE)
def test_streaming_equals_whole(tmp_path, case):
    hf_dir, seq = _hf_dir(tmp_path, case)
    ck = _convert(tmp_path, hf_dir, **({"ep": 2} if case in MOE else {"tp": 2}))
    s = stream_parity(ck, hf_dir, seq_len=seq)
    whole = logit_parity(ck.config, ck.state_dict(), hf_dir, seq_len=seq)
    assert s["max_abs_diff"] == whole["max_abs_diff"] and s["max_abs_diff"] <= 1e-4, (s, whole)
    assert s["mean_abs_diff"] == pytest.approx(whole["mean_abs_diff"], rel=1e-6)
    per_layer = [r["max_abs_diff"] for r in s["layers"] if isinstance(r["layer"], int)]
    assert per_layer == pytest.approx(whole_layer_diffs(ck, hf_dir, seq), abs=1e-7)
    assert s["first_layer_beyond_tolerance"] is None
    if case in MOE:
        moe_rows = [r for r in s["layers"] if "experts" in r]
        assert moe_rows and all(0 < r["experts_exercised"] <= r["experts"] for r in moe_rows)


def _plant(hf_dir, key, fn):
    f = hf_dir / "model.safetensors"
    sd = load_file(str(f))
    sd[key] = fn(sd[key].clone())
    save_file(sd, str(f), metadata={"format": "pt"})


def test_planted_expert_error_is_named(tmp_path):
    hf_dir, seq = _hf_dir(tmp_path, "mixtral")
    ck = _convert(tmp_path, hf_dir)

    def bump(t):
        t[0] += 0.5
        return t

    _plant(hf_dir, "model.layers.1.block_sparse_moe.experts.2.w1.weight", bump)
    s = stream_parity(ck, hf_dir, seq_len=seq)
    assert s["first_layer_beyond_tolerance"] == 1
    row = s["layers"][2]
    assert row["layer"] == 1 and row["expert"] == 2 and row["expert_max_abs_diff"] > 1e-4, row
    assert s["layers"][1]["max_abs_diff"] <= 1e-4  # layer 0 is fine


@pytest.mark.parametrize("how", ["probe", "first_expert", "ambiguous"])
def test_experts_cast_straight_where_transformers_loader_puts_them(tmp_path, monkeypatch, how):
    """Issue 42: where transformers' loader puts an expert's tensors in its fused parameters is learned bitwise from
    the loader itself: on a copy of the experts module PROBE_ROWS rows wide filled with the first rows of the first
    expert ("probe"; the rule is then scaled to the full width), or, where the probe cannot run (here: the experts no
    wider than PROBE_ROWS), on the run's first expert at full size. Every other expert is then cast straight into
    those places. Where the tiling is ambiguous (w1 == w3) every expert goes through the loader. The per-expert and
    final numbers are the same every way, and equal the whole-model forward's."""
    from verify import streamed

    d = tmp_path / "hf-mixtral"
    moe_models.build("mixtral", d, **({"intermediate_size": 192} if how == "probe" else {}))
    hf_dir, seq = d, 32
    monkeypatch.setattr(streamed, "PROBE_ROWS", 32 if how == "probe" else 128)
    loads, direct = [], []
    real_load, real_direct = streamed._HFSide.load, streamed._load_by_rule
    monkeypatch.setattr(streamed._HFSide, "load", lambda self, module, keys, *a, **k: (
        loads.append((any(".experts." in key for key in keys), k.get("given") is not None)),
        real_load(self, module, keys, *a, **k))[1])
    monkeypatch.setattr(streamed, "_load_by_rule", lambda *a: (direct.append(1), real_direct(*a))[1])
    if how == "ambiguous":
        f = hf_dir / "model.safetensors"
        sd = load_file(str(f))
        for key in [k for k in sd if k.endswith(".w3.weight")]:
            sd[key] = sd[key.replace(".w3.", ".w1.")].clone()
        save_file(sd, str(f), metadata={"format": "pt"})
    ck = _convert(tmp_path, hf_dir)
    s = stream_parity(ck, hf_dir, seq_len=seq)
    full_loads = sum(1 for experts, probe in loads if experts and not probe)
    probes = sum(1 for experts, probe in loads if experts and probe)
    if how == "ambiguous":
        assert not direct and full_loads > 1
    elif how == "first_expert":
        assert (probes, full_loads) == (0, 1) and len(direct) >= 2  # the rest cast straight
    else:
        assert (probes, full_loads) == (1, 0) and len(direct) >= 2  # every expert cast straight
    whole = logit_parity(ck.config, ck.state_dict(), hf_dir, seq_len=seq)
    assert s["max_abs_diff"] == whole["max_abs_diff"] and s["max_abs_diff"] <= 1e-4
    assert all(r.get("expert_max_abs_diff", 0) <= 1e-4 for r in s["layers"])
    assert s["max_reads_of_one_tensor"] == {"ours": 1, "hf": 1}


def test_planted_qkv_group_error_is_named_via_cli(tmp_path):
    hf_dir, seq = _hf_dir(tmp_path, "llama_gqa")
    ck = _convert(tmp_path, hf_dir, tp=2)
    cfg = ck.config
    group = slice(cfg.kv_channels, 2 * cfg.kv_channels)  # the second KV head's rows of k_proj

    def bump(t):
        t[group] *= 1.5
        return t

    last = cfg.num_layers - 1
    _plant(hf_dir, f"model.layers.{last}.self_attn.k_proj.weight", bump)
    r = subprocess.run([sys.executable, "-m", "shardkit", "verify", str(ck.path), "--against", str(hf_dir),
                        "--streaming", "--seq-length", str(seq), "--json"], capture_output=True, text=True)
    assert r.returncode == 1, r.stderr
    out = json.loads(r.stdout)["parity"]
    assert out["mode"] == "streaming" and out["first_layer_beyond_tolerance"] == last
    assert f"layer {last} is the first to differ" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1



def test_one_report_for_both_formats(tmp_path, capsys):
    """verify prints one report and one verdict for a native and a torch_dist checkpoint of the same model, the
    streamed per-layer rows and the first layer beyond the tolerance included (the torch_dist one printed neither)."""
    from shardkit.cli import main

    hf_dir, seq = _hf_dir(tmp_path, "llama_gqa")
    native = _convert(tmp_path, hf_dir, tp=2)
    td = tmp_path / "td"
    assert main(["convert", "hf-to-mcore", str(hf_dir), str(td), "--tp", "2", "--format", "torch_dist", "--quiet",
                 "--no-verify"]) == 0
    cfg = native.config
    group = slice(cfg.kv_channels, 2 * cfg.kv_channels)
    last = cfg.num_layers - 1

    def bump(t):
        t[group] *= 1.5
        return t

    _plant(hf_dir, f"model.layers.{last}.self_attn.k_proj.weight", bump)
    capsys.readouterr()
    seen = {}
    for fmt, path in (("native", native.path), ("torch_dist", td)):
        rc = main(["verify", str(path), "--against", str(hf_dir), "--streaming", "--seq-length", str(seq), "--quiet"])
        out, err = capsys.readouterr()
        assert rc == 1, (fmt, err)
        seen[fmt] = (out[out.index("logits vs"):], err)
    assert seen["native"] == seen["torch_dist"]
    out, err = seen["torch_dist"]
    assert "streamed layer by layer" in out and f"  decoder layer {last}: |diff| " in out and "beyond the tolerance" in out
    assert err.startswith(f"shardkit: error: decoder layer {last} is the first to differ from {hf_dir}") and \
        len(err.strip().splitlines()) == 1, err


def test_mode_follows_the_memory_budget(tmp_path):
    hf_dir, seq = _hf_dir(tmp_path, "llama_gqa")
    ck = _convert(tmp_path, hf_dir)
    mode, memory = choose_mode(ck, False, None)
    assert mode == "whole" and memory["streaming"] < memory["whole"] <= memory["budget"]
    assert choose_mode(ck, False, memory["whole"] - 1)[0] == "streaming"
    assert choose_mode(ck, True, None)[0] == "streaming"
    r = against_hf(ck, hf_dir, seq_len=seq, memory_budget=memory["whole"] - 1)
    assert r["mode"] == "streaming" and r["ok"]
    with pytest.raises(Exception, match=f"{memory['streaming']:,} bytes in fp32"):
        choose_mode(ck, False, memory["streaming"] - 1)


def _cli(*argv):
    return subprocess.run([sys.executable, "-m", "shardkit", *argv], capture_output=True, text=True)


def test_bad_input_is_one_line(tmp_path):
    hf_dir, seq = _hf_dir(tmp_path, "llama_gqa")
    ck = _convert(tmp_path, hf_dir)
    # a model whose config differs (a field that changes the math)
    other = tmp_path / "other"
    cls, overrides, _ = CASES["llama_gqa"]
    make_hf(cls, {**overrides, "rms_norm_eps": 1e-3}).save_pretrained(other)
    # HF weights missing for a layer
    missing = tmp_path / "missing"
    missing.mkdir()
    for f in hf_dir.iterdir():
        (missing / f.name).write_bytes(f.read_bytes())
    sd = load_file(str(missing / "model.safetensors"))
    del sd["model.layers.1.mlp.down_proj.weight"]
    save_file(sd, str(missing / "model.safetensors"), metadata={"format": "pt"})
    cases = [(["--against", str(other), "--streaming"], "norm_epsilon"),
             (["--against", str(missing), "--streaming"], "model.layers.1.mlp.down_proj.weight"),
             (["--against", str(hf_dir), "--memory-budget", "1000"], "too small"),
             (["--against", str(hf_dir), "--memory-budget", "lots"], "--memory-budget")]
    for extra, needle in cases:
        r = _cli("verify", str(ck.path), "--seq-length", str(seq), *extra)
        assert r.returncode != 0, extra
        err = r.stderr.strip().splitlines()
        assert len(err) == 1 and needle in err[0] and "Traceback" not in r.stderr, (extra, r.stderr)


def test_default_budget_is_a_constant_not_the_host(tmp_path, monkeypatch):
    """Issue 42: the default --memory-budget is DEFAULT_BUDGET (or the one piece streaming cannot cut, where larger),
    whatever the host has: the mode and budget are the same with 1 TB or 1 GB available."""
    from verify import budget

    hf_dir, _ = _hf_dir(tmp_path, "llama_gqa")
    ck = _convert(tmp_path, hf_dir)
    seen = []
    for avail in (1 << 40, 1 << 30, 1 << 20):
        monkeypatch.setattr(budget, "available_memory", lambda a=avail: a)
        seen.append(choose_mode(ck, False, None))
    assert all(s == seen[0] for s in seen) and seen[0][1]["budget"] == budget.DEFAULT_BUDGET
    # a piece larger than the constant raises the default to that piece, never fails it
    monkeypatch.setattr(budget, "DEFAULT_BUDGET", 1024)
    mode, memory = choose_mode(ck, False, None)
    assert mode == "streaming" and memory["budget"] == memory["streaming"] > 1024


@pytest.mark.parametrize("case", ["llama_gqa", "mixtral", "deepseek_v3"])
def test_mode_never_skips_rows_the_model_has(tmp_path, case):
    """The whole mode compares logits only: a model with MTP layers always streams (which compares each MTP depth),
    with the default budget and with any budget; the report lists every row it compared."""
    hf_dir, seq = _hf_dir(tmp_path, case)
    ck = _convert(tmp_path, hf_dir)
    mtp = ck.config.mtp_num_layers or 0
    for budget in (None, 1 << 40):
        mode, _ = choose_mode(ck, False, budget)
        assert mode == ("streaming" if mtp else "whole"), (case, budget)
    if mtp:
        r = against_hf(ck, hf_dir, seq_len=seq)
        assert r["mode"] == "streaming" and r["ok"], r
        assert len(r["mtp_max_abs_diff"]) == mtp  # each MTP depth compared
        assert not any("MTP" in w for w in r["not_compared"]), r["not_compared"]
        assert [row["layer"] for row in r["layers"] if isinstance(row["layer"], int)] == list(
            range(ck.config.num_layers))  # every decoder layer is a row of the report


def test_block_fp8_source_dequantized_as_the_reference(tmp_path):
    """DeepSeek-V3's hub format (e4m3 + weight_scale_inv): streaming reads the FP8 directory itself, dequantizing as
    DeepSeek's weight_dequant does, and gives the whole mode's numbers on the reference-dequantized copy."""
    hf_dir = tmp_path / "fp8"
    moe_models.build("deepseek_v3", hf_dir)
    originals = moe_models.quantize_fp8(hf_dir)
    ck = _convert(tmp_path, hf_dir, ep=2)
    src = moe_models.hf_tensors(hf_dir)
    ref = tmp_path / "dequant"
    ref.mkdir()
    cfg = json.loads((hf_dir / "config.json").read_text())
    dtype = getattr(torch, cfg.get("torch_dtype") or cfg["dtype"])  # the dtype the model names (float32 here)
    tensors = {k: v for k, v in src.items() if not k.endswith("_scale_inv")}
    for k in originals:
        tensors[k] = moe_models.reference_dequant(src[k], src[k + "_scale_inv"]).to(dtype)
    save_file(tensors, str(ref / "model.safetensors"), metadata={"format": "pt"})
    del cfg["quantization_config"]
    (ref / "config.json").write_text(json.dumps(cfg))
    s = stream_parity(ck, hf_dir, seq_len=40)
    whole = logit_parity(ck.config, ck.state_dict(), ref, seq_len=40)
    assert s["max_abs_diff"] == whole["max_abs_diff"] <= 1e-4, (s, whole)
