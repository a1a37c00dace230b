"""Megatron-LM legacy `--ckpt-format torch` checkpoints -> native, checked against megatron-core itself.

- megatron-core (CPU, in a subprocess) builds a dense GQA LLaMA and a Mixtral-style MoE model, saves each as
  Megatron-LM's `save_checkpoint` does at tp = pp = 1 (args with Megatron's enums, RNG, optimizer, scheduler and rerun
  state in the same file), and records its logits and state dict;
- the tests split those state dicts into other legacy layouts with their own implementation of Megatron's rules (QKV
  chunks by query group, fc1 as [gate_i; up_i], row splits on dim 1, vocab chunks on dim 0, layers renumbered per
  pipeline stage and model chunk, experts renumbered per expert rank, Megatron's directory names), in both the
  local-spec and the Transformer Engine key naming;
- every conversion is exported to HF and HF transformers' logits must equal megatron-core's own;
- hostile or damaged checkpoints are refused with one line naming the file, and no pickle payload ever runs.
"""
from __future__ import annotations

import importlib.util

import argparse
import io
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
from itertools import product
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from checkpoint.config import ModelConfig
from checkpoint.errors import ConfigError, FormatError, LayoutError, ShardkitError
from checkpoint.megatron import config_from_megatron_args
from checkpoint.reader import Checkpoint
from convert.mcore_to_hf import convert_mcore_to_hf
from convert.megatron_legacy import is_legacy_checkpoint, legacy_to_native, load_rank_file, read_legacy_args

ORACLE = Path(__file__).with_name("megatron_oracle.py")
TOL = 1e-4
SEQ = 16
VOCAB, PADDED = 1000, 1024  # 1024 = Megatron's padding of 1000 at tp 1, 2 and 4 (multiples of 128 * tp)
ROPE_BASE = 50000.0

DENSE = dict(num_layers=4, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_query_groups=2,
             kv_channels=16, layernorm_epsilon=1e-5)
MOE = dict(num_layers=2, hidden_size=64, ffn_hidden_size=32, num_attention_heads=4, num_query_groups=2,
           kv_channels=16, layernorm_epsilon=1e-5, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32)


def hf_config(kind: str):
    m = DENSE if kind == "dense" else MOE
    common = dict(vocab_size=VOCAB, hidden_size=m["hidden_size"], num_hidden_layers=m["num_layers"],
                  num_attention_heads=m["num_attention_heads"], num_key_value_heads=m["num_query_groups"],
                  head_dim=m["kv_channels"], max_position_embeddings=64, rms_norm_eps=m["layernorm_epsilon"],
                  rope_theta=ROPE_BASE, tie_word_embeddings=False)
    if kind == "dense":
        return transformers.LlamaConfig(intermediate_size=m["ffn_hidden_size"], **common)
    return transformers.MixtralConfig(intermediate_size=m["moe_ffn_hidden_size"], num_local_experts=4,
                                      num_experts_per_tok=2, **common)


def model_config(kind: str) -> ModelConfig:
    return ModelConfig.from_hf(hf_config(kind).to_dict())


@pytest.fixture(autouse=True)
def _only_our_allowlist(monkeypatch):
    """Loading must not depend on globals someone else registered in this process (megatron-core registers its own
    classes when imported): start every test with torch's user allowlist empty."""
    import torch._weights_only_unpickler as wu

    monkeypatch.setattr(wu, "_marked_safe_globals_set", set())


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        pytest.skip("megatron-core is the oracle")  # never imported here: it widens the pickle allowlist
    w = tmp_path_factory.mktemp("legacy")
    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB, (2, SEQ))
    torch.save(ids, w / "ids.pt")
    jobs, out = [], {"dir": w, "ids": ids}
    for kind, m, seed in (("dense", DENSE, 1), ("moe", MOE, 2)):
        model = dict(m, padded_vocab_size=PADDED, max_sequence_length=64, rotary_base=ROPE_BASE, tied=False,
                     vocab_size=VOCAB, add_bias_linear=False)
        jobs.append({"root": str(w / f"{kind}_meg"), "iteration": 100, "seed": seed, "model": model,
                     "input_ids": str(w / "ids.pt"), "out": str(w / f"{kind}_out.pt")})
    (w / "jobs.json").write_text(json.dumps(jobs))
    t = time.time()
    r = subprocess.run([sys.executable, str(ORACLE), "legacy", str(w / "jobs.json")], capture_output=True, text=True,
                       timeout=300, cwd=str(w))
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-4000:])
    print(f"megatron-core oracle: {time.time() - t:.1f}s")
    for kind in ("dense", "moe"):
        res = torch.load(w / f"{kind}_out.pt")
        out[kind] = dict(root=w / f"{kind}_meg", logits=res["logits"], sd=res["state_dict"])
    return out


# -- the tests' own implementation of Megatron's partition rules ----------------------------------------------------

def tp_piece(rest: str, t: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    if rest.endswith("linear_qkv.weight"):  # rows grouped by query group: whole groups per rank
        return t.chunk(tp, 0)[rank]
    if rest.endswith("linear_fc1.weight"):  # [gate; up] -> [gate_i; up_i]
        gate, up = t.chunk(2, 0)
        return torch.cat([gate.chunk(tp, 0)[rank], up.chunk(tp, 0)[rank]])
    if rest.endswith(("linear_proj.weight", "linear_fc2.weight")):  # row parallel
        return t.chunk(tp, 1)[rank]
    return t  # norms, router: replicated


def te_name(rest: str, moe: bool) -> str:
    if rest == "input_layernorm.weight":
        return "self_attention.linear_qkv.layer_norm_weight"
    if rest == "pre_mlp_layernorm.weight" and not moe:
        return "mlp.linear_fc1.layer_norm_weight"
    m = re.match(r"mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12]\.weight)$", rest)
    if m:  # TEGroupedMLP
        return f"mlp.experts.{m.group(2)}{m.group(1)}"
    return rest


def split_legacy(sd: dict, layers: int, tp: int = 1, pp: int = 1, vpp: int = 1, ep: int = 1, experts: int = 0,
                 naming: str = "local") -> dict[tuple[int, int, int], list[dict]]:
    """(tp, pp, ep) -> the module state dict of each model chunk, as that Megatron rank would hold it."""
    n = layers // (pp * vpp)
    out = {}
    for t, p, e in product(range(tp), range(pp), range(ep)):
        chunks = []
        for v in range(vpp):
            c = v * pp + p  # Megatron's interleaving: chunk v of pipeline rank p
            local: dict = {}
            for key, val in sd.items():
                m = re.match(r"decoder\.layers\.(\d+)\.(.+)$", key)
                if m:
                    g, rest = int(m.group(1)), m.group(2)
                    if g // n != c:
                        continue
                    me = re.match(r"mlp\.experts\.local_experts\.(\d+)\.(.+)$", rest)
                    if me:
                        ge, per = int(me.group(1)), experts // ep
                        if ge // per != e:
                            continue
                        rest = f"mlp.experts.local_experts.{ge % per}.{me.group(2)}"
                    piece = tp_piece(rest, val, tp, t)
                    name = te_name(rest, bool(experts)) if naming == "te" else rest
                    local[f"decoder.layers.{g - c * n}.{name}"] = piece.clone()
                elif key == "embedding.word_embeddings.weight":
                    if c == 0:
                        local[key] = val.chunk(tp, 0)[t].clone()
                elif key == "decoder.final_layernorm.weight":
                    if c == pp * vpp - 1:
                        local[key] = val.clone()
                elif key == "output_layer.weight":
                    if c == pp * vpp - 1:
                        local[key] = val.chunk(tp, 0)[t].clone()
                else:
                    raise AssertionError(key)
            for j in range(n):  # extra states as Megatron has them: None (local), BytesIO (older TE), uint8 (newer TE)
                local[f"decoder.layers.{j}.self_attention.linear_qkv._extra_state"] = \
                    io.BytesIO(b"te fp8 meta") if naming == "te" else None
                local[f"decoder.layers.{j}.self_attention.linear_proj._extra_state"] = \
                    torch.tensor([7, 8, 9], dtype=torch.uint8) if naming == "te" else None
            chunks.append(local)
        out[(t, p, e)] = chunks
    return out


def rank_dir(t: int, p: int, e: int, pp: int, ep: int) -> str:
    """Megatron-LM's get_checkpoint_name: pipeline rank when pp > 1, expert rank when ep > 1."""
    return f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "") + (f"_{e:03d}" if ep > 1 else "")


def write_legacy(root: Path, parts: dict, tp: int, pp: int, ep: int, vpp: int, kind: str, iteration: int = 7,
                 with_args: bool = True, edit=None, tied: bool = False) -> Path:
    m = DENSE if kind == "dense" else MOE
    args = argparse.Namespace(
        num_layers=m["num_layers"], hidden_size=m["hidden_size"], num_attention_heads=m["num_attention_heads"],
        num_query_groups=m["num_query_groups"], group_query_attention=True, kv_channels=m["kv_channels"],
        untie_embeddings_and_output_weights=not tied, padded_vocab_size=PADDED, make_vocab_size_divisible_by=128,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None, num_experts=m.get("num_moe_experts"),
        params_dtype=torch.float32) if with_args else None
    it_dir = root / f"iter_{iteration:07d}"
    for (t, p, e), chunks in parts.items():
        state = {"args": args, "checkpoint_version": 3.0, "iteration": iteration,
                 "rng_state": [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
                                "torch_rng_state": torch.get_rng_state()}]}
        if vpp == 1:
            state["model"] = chunks[0]
        else:
            state.update({f"model{v}": c for v, c in enumerate(chunks)})
        if edit is not None:
            edit((t, p, e), state)
        d = it_dir / rank_dir(t, p, e, pp, ep)
        d.mkdir(parents=True)
        torch.save(state, d / "model_optim_rng.pt")
    (root / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return root


@torch.no_grad()
def hf_logits(hf_dir: Path, ids: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32,
                                                              attn_implementation="sdpa")
    return model.eval()(input_ids=ids, use_cache=False).logits.float()


def check_against_megatron(nat: Path, ref: dict, ids: torch.Tensor, tmp: Path, label: str) -> float:
    hf = convert_mcore_to_hf(nat, tmp / f"{label}_hf", quiet=True)
    ours = hf_logits(hf, ids)
    meg = ref["logits"][..., :VOCAB]
    assert ours.shape == meg.shape and meg.std() > 0.1
    diff = (ours - meg).abs().max().item()
    print(f"{label}: HF (from legacy) vs megatron-core logits: max |diff| = {diff:.3g}")
    assert diff <= TOL, label
    return diff


# -- megatron-core's own checkpoints ------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_megatron_own_checkpoint(oracle, tmp_path, kind):
    ref = oracle[kind]
    cfg = model_config(kind)
    t = time.time()
    nat = legacy_to_native(ref["root"], tmp_path / "nat", cfg, quiet=True, workers=1)
    print(f"{kind}: legacy -> native {time.time() - t:.2f}s")
    ck = Checkpoint(nat)
    assert nat.name == "iter_0000100" and ck.manifest.iteration == 100
    assert ck.manifest.vocab == {"size": VOCAB, "padded_size": PADDED, "divisible_by": 128}
    assert ck.layout.to_dict() == {"tp": 1, "pp": 1, "vpp": 1, "ep": 1, "etp": None}
    assert ck.manifest.provenance["source"]["kind"] == "megatron_legacy"
    ck.verify()
    # the padding rows come as Megatron had them
    emb = ck.read("embedding.word_embeddings.weight")
    assert torch.equal(emb, ref["sd"]["embedding.word_embeddings.weight"])
    check_against_megatron(nat, ref, oracle["ids"], tmp_path, f"{kind} tp1")


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_config_from_megatron_args(oracle, kind):
    state = load_rank_file(oracle[kind]["root"] / "iter_0000100" / "mp_rank_00" / "model_optim_rng.pt")
    args = state["args"]
    assert is_legacy_checkpoint(oracle[kind]["root"]) and not is_legacy_checkpoint(oracle["dir"])
    assert vars(read_legacy_args(oracle[kind]["root"])).keys() == vars(args).keys()
    assert type(args.model_type).__name__ == "ModelType" and args.model_type.args == (1,)  # inert stand-in
    assert isinstance(state["rng_state"][0]["np_rng_state"][1], np.ndarray)
    with pytest.raises(ConfigError, match="vocab_size"):
        config_from_megatron_args(args)
    got = config_from_megatron_args(args, vocab_size=VOCAB)
    want = model_config(kind)
    skip = {"hf_config", "moe_aux_loss_coeff"}
    assert {k: v for k, v in got.to_dict().items() if k not in skip} == \
        {k: v for k, v in want.to_dict().items() if k not in skip}
    assert got.model_type == ("llama" if kind == "dense" else "mixtral")
    qk = argparse.Namespace(**{**vars(args), "qk_layernorm": True})  # QK norms: Qwen3's args (issue 36)
    got_qk = config_from_megatron_args(qk, vocab_size=VOCAB)
    assert got_qk.model_type == ("qwen3" if kind == "dense" else "qwen3_moe") and got_qk.qk_layernorm
    with pytest.raises(ConfigError, match="qk_layernorm"):  # a family without them, named, refuses them
        config_from_megatron_args(qk, "mistral", vocab_size=VOCAB)
    with pytest.raises(ConfigError, match="padded_vocab_size"):
        config_from_megatron_args(args, vocab_size=2000)


# -- other layouts, split by the tests -----------------------------------------------------------------------------

LAYOUTS = {
    # name: (kind, tp, pp, vpp, ep, naming, with_args)
    "dense_tp2_pp2_te": ("dense", 2, 2, 1, 1, "te", True),
    "dense_pp2_vpp2_noargs": ("dense", 1, 2, 2, 1, "local", False),
    "moe_tp2_ep2": ("moe", 2, 1, 1, 2, "local", True),  # mp_rank_TT_EEE: the second number is the expert rank
    "moe_pp2_ep2_te": ("moe", 1, 2, 1, 2, "te", True),
    "moe_ep2_noargs": ("moe", 1, 1, 1, 2, "local", False),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_split_layouts(oracle, tmp_path, name):
    kind, tp, pp, vpp, ep, naming, with_args = LAYOUTS[name]
    ref = oracle[kind]
    m = DENSE if kind == "dense" else MOE
    parts = split_legacy(ref["sd"], m["num_layers"], tp, pp, vpp, ep, m.get("num_moe_experts", 0), naming)
    root = write_legacy(tmp_path / "legacy", parts, tp, pp, ep, vpp, kind, with_args=with_args)
    t = time.time()
    nat = legacy_to_native(root, tmp_path / "nat", model_config(kind), quiet=True, workers=1)
    print(f"{name}: legacy -> native {time.time() - t:.2f}s")
    ck = Checkpoint(nat)
    assert ck.layout.to_dict() == {"tp": tp, "pp": pp, "vpp": vpp, "ep": ep, "etp": None}
    assert ck.manifest.iteration == 7
    ck.verify()
    check_against_megatron(nat, ref, oracle["ids"], tmp_path, name)


def test_parallel_workers(oracle, tmp_path):
    """Spawned workers write the same bytes as the in-process path."""
    ref = oracle["dense"]
    parts = split_legacy(ref["sd"], DENSE["num_layers"], 2, 2)
    root = write_legacy(tmp_path / "legacy", parts, 2, 2, 1, 1, "dense")
    cfg = model_config("dense")
    a = Checkpoint(legacy_to_native(root, tmp_path / "a", cfg, quiet=True, workers=1)).state_dict()
    b = Checkpoint(legacy_to_native(root, tmp_path / "b", cfg, quiet=True, workers=2)).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_resume_after_interruption(oracle, tmp_path, monkeypatch):
    """An interrupted conversion leaves no iteration; rerunning it writes only the chunks that were not done."""
    from convert import writer

    parts = split_legacy(oracle["dense"]["sd"], DENSE["num_layers"], 2, 2)
    root = write_legacy(tmp_path / "legacy", parts, 2, 2, 1, 1, "dense")
    cfg = model_config("dense")
    real, calls = writer.ChunkSink.write, []

    def failing(self, task, value):
        if len(calls) == 10:
            raise RuntimeError("simulated crash")
        calls.append(task.id)
        return real(self, task, value)

    monkeypatch.setattr(writer.ChunkSink, "write", failing)
    with pytest.raises(RuntimeError, match="simulated crash"):
        legacy_to_native(root, tmp_path / "out", cfg, quiet=True, workers=1)
    assert not (tmp_path / "out" / "iter_0000007").exists() and (tmp_path / "out" / "iter_0000007.partial").is_dir()
    second = []

    def counting(self, task, value):
        second.append(task.id)
        return real(self, task, value)

    monkeypatch.setattr(writer.ChunkSink, "write", counting)
    nat = legacy_to_native(root, tmp_path / "out", cfg, quiet=True, workers=1)
    total = sum(1 for _ in Checkpoint(nat).tensors)  # at least one chunk per tensor
    assert second and not set(second) & set(calls) and len(second) + len(calls) >= total
    a = Checkpoint(nat).state_dict()
    b = Checkpoint(legacy_to_native(root, tmp_path / "fresh", cfg, quiet=True, workers=1)).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


# -- bad input ------------------------------------------------------------------------------------------------------

class _RunsCode:
    def __init__(self, cmd: str):
        self.cmd = cmd

    def __reduce__(self):
        return os.system, (self.cmd,)


class _Popen:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return subprocess.Popen, (["touch", str(self.marker)],)


@pytest.mark.parametrize("payload", ["os.system", "subprocess.Popen"])
def test_pickle_payload_refused(tmp_path, payload):
    marker = tmp_path / "MARKER"
    evil = _RunsCode(f"touch {marker}") if payload == "os.system" else _Popen(marker)
    d = tmp_path / "legacy" / "iter_0000001" / "mp_rank_00"
    d.mkdir(parents=True)
    torch.save({"model": {}, "args": evil, "iteration": 1, "checkpoint_version": 3.0}, d / "model_optim_rng.pt")
    (tmp_path / "legacy" / "latest_checkpointed_iteration.txt").write_text("1")
    with pytest.raises(FormatError) as e:
        legacy_to_native(tmp_path / "legacy", tmp_path / "out", model_config("dense"), quiet=True)
    msg = str(e.value)
    print(msg)
    assert "\n" not in msg and "mp_rank_00/model_optim_rng.pt" in msg and "refusing to unpickle" in msg
    assert ("system" in msg) if payload == "os.system" else ("subprocess.Popen" in msg)
    time.sleep(0.2)
    assert not marker.exists()
    assert not (tmp_path / "out").exists()


def _dense_tp2_pp2(oracle, tmp_path, edit=None, **kw) -> Path:
    parts = split_legacy(oracle["dense"]["sd"], DENSE["num_layers"], 2, 2, **kw)
    return write_legacy(tmp_path / "legacy", parts, 2, 2, 1, 1, "dense", edit=edit)


def _refused(root: Path, tmp_path: Path, exc=FormatError, cfg: ModelConfig | None = None) -> str:
    with pytest.raises(exc) as e:
        legacy_to_native(root, tmp_path / "out", cfg or model_config("dense"), quiet=True, workers=1)
    msg = str(e.value)
    print(msg)
    assert "\n" not in msg
    return msg


def test_missing_rank_directory(oracle, tmp_path):
    root = _dense_tp2_pp2(oracle, tmp_path)
    shutil.rmtree(root / "iter_0000007" / "mp_rank_01_000")
    msg = _refused(root, tmp_path)
    assert "missing rank directory mp_rank_01_000" in msg
    assert not (tmp_path / "out").exists()


def test_wrong_shape(oracle, tmp_path):
    key = "decoder.layers.1.mlp.linear_fc1.weight"

    def edit(rank, state):
        if rank == (1, 1, 0):
            state["model"][key] = state["model"][key][:-2].clone()

    msg = _refused(_dense_tp2_pp2(oracle, tmp_path, edit), tmp_path)
    assert "mp_rank_01_001/model_optim_rng.pt" in msg and key in msg and "[94, 64]" in msg and "[96, 64]" in msg


def test_missing_and_unexpected_keys(oracle, tmp_path):
    def drop(rank, state):
        if rank == (0, 1, 0):
            del state["model"]["decoder.layers.0.self_attention.linear_proj.weight"]

    msg = _refused(_dense_tp2_pp2(oracle, tmp_path / "a", drop), tmp_path / "a")
    assert "mp_rank_00_001" in msg and "missing" in msg and "decoder.layers.0.self_attention.linear_proj.weight" in msg

    def add(rank, state):
        if rank == (0, 0, 0):
            state["model"]["decoder.layers.0.self_attention.q_layernorm.weight"] = torch.ones(16)

    msg = _refused(_dense_tp2_pp2(oracle, tmp_path / "b", add), tmp_path / "b")
    assert "not part of the model config" in msg and "decoder.layers.0.self_attention.q_layernorm.weight" in msg


def test_replicas_must_agree(oracle, tmp_path):
    key = "decoder.layers.0.pre_mlp_layernorm.weight"

    def edit(rank, state):
        if rank == (1, 0, 0):
            state["model"][key] = state["model"][key] + 1e-3

    msg = _refused(_dense_tp2_pp2(oracle, tmp_path, edit), tmp_path)
    assert "mp_rank_01_000/model_optim_rng.pt" in msg and key in msg and "mp_rank_00_000" in msg
    assert not (tmp_path / "out" / "iter_0000007").exists()  # nothing committed


def test_config_and_layout_mismatch(oracle, tmp_path):
    root = _dense_tp2_pp2(oracle, tmp_path)
    cfg = model_config("dense")
    import dataclasses

    msg = _refused(root, tmp_path, ConfigError, dataclasses.replace(cfg, num_layers=8))
    assert "num_layers=4" in msg
    msg = _refused(root, tmp_path, ConfigError, dataclasses.replace(cfg, vocab_size=2000))
    assert "padded_vocab_size=1024" in msg
    msg = _refused(root, tmp_path, LayoutError, dataclasses.replace(cfg, ffn_hidden_size=97))
    assert "tp=2" in msg and "intermediate_size=97" in msg


def test_tied_embeddings_copy_on_last_stage(oracle, tmp_path):
    """Tied embeddings with pipeline stages: the last stage's output_layer.weight is Megatron's copy of the word
    embeddings; it is not a tensor of its own, and it must equal the first stage's."""
    import dataclasses

    sd = dict(oracle["dense"]["sd"])
    sd["output_layer.weight"] = sd["embedding.word_embeddings.weight"]
    cfg = dataclasses.replace(model_config("dense"), tie_word_embeddings=True)
    parts = split_legacy(sd, DENSE["num_layers"], 2, 2)
    assert "output_layer.weight" in parts[(1, 1, 0)][0]
    root = write_legacy(tmp_path / "ok", parts, 2, 2, 1, 1, "dense", tied=True)
    ck = Checkpoint(legacy_to_native(root, tmp_path / "out", cfg, quiet=True, workers=1))
    assert "output_layer.weight" not in ck.tensors
    assert torch.equal(ck.read("embedding.word_embeddings.weight"), sd["embedding.word_embeddings.weight"])

    def edit(rank, state):
        if rank == (0, 1, 0):
            state["model"]["output_layer.weight"] = state["model"]["output_layer.weight"] * 2

    root = write_legacy(tmp_path / "bad", split_legacy(sd, DENSE["num_layers"], 2, 2), 2, 2, 1, 1, "dense",
                        tied=True, edit=edit)
    msg = _refused(root, tmp_path / "bad_out", cfg=cfg)
    assert "mp_rank_00_001/model_optim_rng.pt" in msg and "output_layer.weight" in msg and "mp_rank_00_000" in msg


def test_resolve_keys_of_other_families():
    """Key naming the megatron-core CPU oracle cannot produce (TE grouped experts, MLA norms of the local spec,
    per-layer keys of a dense+MoE stack, MTP layers)."""
    from convert.megatron_legacy import resolve_key
    from checkpoint.layout import Layout
    from checkpoint.families import model_specs
    from tests.moe_models import BASE, CONFIGS

    cls, kw = CONFIGS["deepseek_v3"]
    cfg = ModelConfig.from_hf(cls(**{**BASE, **kw}).to_dict())
    names = {s.name for s in model_specs(cfg, Layout())}
    # chunk starting at global layer 1 (first MoE layer): local layer 0 = global layer 1
    assert resolve_key("decoder.layers.0.mlp.experts.linear_fc1.weight3", 1, cfg, names) == \
        ("decoder.layers.1.mlp.experts.experts.linear_fc1.weight", (3,))
    assert resolve_key("decoder.layers.1.mlp.experts.local_experts.2.linear_fc2.weight", 1, cfg, names) == \
        ("decoder.layers.2.mlp.experts.experts.linear_fc2.weight", (2,))
    assert resolve_key("decoder.layers.0.self_attention.q_layernorm.weight", 0, cfg, names) == \
        ("decoder.layers.0.self_attention.linear_q_up_proj.layer_norm_weight", ())
    assert resolve_key("decoder.layers.0.pre_mlp_layernorm.weight", 0, cfg, names) == \
        ("decoder.layers.0.mlp.linear_fc1.layer_norm_weight", ())  # layer 0 is dense
    assert resolve_key("decoder.layers.0.pre_mlp_layernorm.weight", 1, cfg, names) == \
        ("decoder.layers.1.pre_mlp_layernorm.weight", ())  # layer 1 is MoE
    assert resolve_key("mtp.layers.0.mtp_model_layer.mlp.experts.local_experts.0.linear_fc1.weight", 0, cfg, names) \
        == ("mtp.layers.0.transformer_layer.mlp.experts.experts.linear_fc1.weight", (0,))
    assert resolve_key("mtp.layers.0.enorm.weight", 0, cfg, names) == ("mtp.layers.0.enorm.weight", ())
    assert resolve_key("decoder.layers.0.mlp.experts.weight1", 0, cfg, names) is None
    assert resolve_key("decoder.final_layernorm.weight", 0, cfg, names) == ("decoder.final_layernorm.weight", ())


def test_release_and_iteration_directory(oracle, tmp_path):
    """`release` checkpoints (iteration 0), an iteration directory given directly, tokenizer files carried along."""
    parts = split_legacy(oracle["dense"]["sd"], DENSE["num_layers"])
    root = write_legacy(tmp_path / "legacy", parts, 1, 1, 1, 1, "dense")
    os.rename(root / "iter_0000007", root / "release")
    (root / "latest_checkpointed_iteration.txt").write_text("release\n")
    hf = tmp_path / "tok"
    hf.mkdir()
    (hf / "tokenizer.json").write_text("{}")
    cfg = model_config("dense")
    nat = legacy_to_native(root, tmp_path / "a", cfg, quiet=True, workers=1, hf_dir=hf)
    assert nat.name == "iter_0000000" and (nat / "hf" / "tokenizer.json").is_file()
    os.rename(root / "release", root / "iter_0000042")
    nat = legacy_to_native(root / "iter_0000042", tmp_path / "b", cfg, quiet=True, workers=1)
    assert nat.name == "iter_0000042"
    (root / "latest_checkpointed_iteration.txt").write_text("42")
    with pytest.raises(ShardkitError, match="is the input SRC"):  # safety.check_output, before anything is read
        legacy_to_native(root, root, cfg, quiet=True, overwrite=True)
    (root / "latest_checkpointed_iteration.txt").write_text("12x")
    with pytest.raises(FormatError, match="latest_checkpointed_iteration.txt"):
        legacy_to_native(root, tmp_path / "c", cfg, quiet=True)
