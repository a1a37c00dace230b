"""Megatron-LM torch_dist interop, checked against megatron-core itself (CPU, in a subprocess).

- our export loads into megatron-core's own GPTModel with dist_checkpointing.load (dense GQA LLaMA; Mixtral-style MoE
  with the local spec's key naming), every tensor equals the native one, and its logits equal HF transformers';
- a checkpoint megatron-core saved itself converts to native and then to HF, and HF's logits equal megatron's;
- damaged or hostile checkpoints are refused with one line naming the file, and no pickle payload ever runs.
"""
from __future__ import annotations

import argparse
import importlib.util
import io
import json
import os
import pickle
import shutil
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch

from checkpoint import torch_dist as tdmod
from checkpoint import torch_dist_pickle as tdpickle
from checkpoint import torch_dist_write as tdwrite
from checkpoint.config import ModelConfig
from checkpoint.errors import FormatError, ShardkitError
from checkpoint.layout import Layout
from checkpoint.megatron import chunk_rank, extra_state_objects, stored_key
from checkpoint.reader import Checkpoint
from checkpoint.sharding import regions
from checkpoint.families import model_specs
from checkpoint.torch_dist import read_torch_dist
from checkpoint.torch_dist_pickle import load_dcp_metadata
from convert.hf_to_mcore import convert_hf_to_mcore
from convert.mcore_to_hf import convert_mcore_to_hf
from convert.torch_dist_io import torch_dist_to_native, via_native, write_torch_dist

# megatron-core runs only in the oracle subprocess: importing it here would also register its safe globals in this
# process and make the weights-only loads under test more permissive than in real use
if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
    pytest.skip("megatron-core is not installed", allow_module_level=True)
ORACLE = Path(__file__).with_name("megatron_oracle.py")
TOL = 1e-4
SEQ = 16


def megatron_model(cfg: ModelConfig, padded_vocab: int) -> dict:
    m = dict(num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
             num_query_groups=cfg.num_query_groups, kv_channels=cfg.kv_channels, ffn_hidden_size=cfg.ffn_hidden_size,
             add_bias_linear=cfg.add_proj_bias, add_qkv_bias=cfg.add_qkv_bias, layernorm_epsilon=cfg.norm_epsilon,
             padded_vocab_size=padded_vocab, max_sequence_length=cfg.max_position_embeddings,
             rotary_base=cfg.rotary_base, tied=cfg.tie_word_embeddings)
    if cfg.is_moe:
        m.update(num_moe_experts=cfg.num_moe_experts, moe_router_topk=cfg.moe_router_topk,
                 moe_ffn_hidden_size=cfg.moe_ffn_hidden_size)
    return m


@torch.no_grad()
def hf_logits(hf_dir: Path, ids: torch.Tensor) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32,
                                                              attn_implementation="sdpa")
    return model.eval()(input_ids=ids, use_cache=False).logits.float()


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """Build the sources, write our exports, and run every megatron-core job in one subprocess."""
    from shardkit.demo import build_tiny_llama
    from tests.moe_models import build as build_moe

    w = tmp_path_factory.mktemp("torch_dist")
    torch.manual_seed(0)
    jobs, out = [], {"dir": w}

    # dense LLaMA with GQA (8 heads, 2 groups), no RoPE scaling; native at tp=2 pp=2 -> torch_dist (TE naming)
    llama = build_tiny_llama(w / "llama", dtype=torch.float32, rope_scaling=None, rope_theta=10000.0)
    nat = convert_hf_to_mcore(llama, w / "llama_nat", Layout(tp=2, pp=2), quiet=True)
    td = write_torch_dist(nat, w / "llama_td", quiet=True)
    out["llama"] = dict(hf=llama, nat=nat, td=td)

    # Mixtral-style MoE, native at tp=2 ep=2 -> torch_dist with the local spec's key naming
    mixtral = build_moe("mixtral", w / "mixtral")
    nat_m = convert_hf_to_mcore(mixtral, w / "mixtral_nat", Layout(tp=2, ep=2), quiet=True)
    td_m = write_torch_dist(nat_m, w / "mixtral_td", key_naming="local", quiet=True)
    out["mixtral"] = dict(hf=mixtral, nat=nat_m, td=td_m)

    for kind in ("llama", "mixtral"):
        d = out[kind]
        ck = Checkpoint(d["nat"])
        d["cfg"] = ck.config
        ids = torch.randint(0, ck.config.vocab_size, (2, SEQ))
        torch.save(ids, w / f"{kind}_ids.pt")
        d["ids"] = ids
        jobs.append({"mode": "load", "ckpt": str(d["td"]), "input_ids": str(w / f"{kind}_ids.pt"),
                     "out": str(w / f"{kind}_meg.pt"), "args_config": True,
                     "model": megatron_model(ck.config, ck.tensors["embedding.word_embeddings.weight"].shape[0])})

    # megatron-core saves its own randomly initialised dense GQA model
    cfg = ModelConfig(model_type="llama", num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                      num_query_groups=2, kv_channels=16, vocab_size=300, max_position_embeddings=64,
                      norm_epsilon=1e-5, rotary_base=10000.0)
    ids = torch.randint(0, cfg.vocab_size, (2, SEQ))
    torch.save(ids, w / "saved_ids.pt")
    out["saved"] = dict(cfg=cfg, ids=ids, root=w / "meg_saved")
    jobs.append({"mode": "save", "root": str(w / "meg_saved"), "iteration": 3, "seed": 1,
                 "input_ids": str(w / "saved_ids.pt"), "out": str(w / "saved_meg.pt"),
                 "model": megatron_model(cfg, cfg.padded_vocab_size(1))})

    (w / "jobs.json").write_text(json.dumps(jobs))
    r = subprocess.run([sys.executable, str(ORACLE), "torch_dist", str(w / "jobs.json")], capture_output=True,
                       text=True, timeout=300, cwd=str(w))
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-4000:])
    for kind in ("llama", "mixtral", "saved"):
        out[kind]["meg"] = torch.load(w / f"{kind}_meg.pt")
    return out


# -- our export, loaded by megatron-core ------------------------------------------------------------------------------

@pytest.mark.parametrize("kind,naming", [("llama", "te"), ("mixtral", "local")])
def test_megatron_loads_our_export(work, kind, naming):
    d = work[kind]
    ck = Checkpoint(d["nat"])
    meg = d["meg"]["tensors"]
    assert set(meg) == {stored_key(n, naming) for n in ck.tensors}
    # shardkit's own files sit beside Megatron's in what megatron-core just loaded
    assert (d["td"] / "shardkit.json").is_file() and (d["td"] / "hf" / "config.json").is_file()
    for name in ck.tensors:
        got, want = meg[stored_key(name, naming)], ck.read(name)
        assert got.shape == want.shape and torch.equal(got, want), name  # padding rows included
    if kind == "mixtral":
        assert "decoder.layers.mlp.linear_fc1.layer_norm_weight" in meg  # the local spec's name for pre-MLP norm
    vocab = d["cfg"].vocab_size
    ours = d["meg"]["logits"][..., :vocab]
    ref = hf_logits(d["hf"], d["ids"])
    assert ours.shape == ref.shape and ref.std() > 0.1
    diff = (ours - ref).abs().max().item()
    print(f"{kind}: megatron-core (our torch_dist) vs HF: max |diff| = {diff:.3g}")
    assert diff <= TOL


@pytest.mark.parametrize("kind", ["llama", "mixtral"])
def test_megatron_bridge_style_reader_takes_our_args(work, kind):
    """common.pt's args are Megatron-LM's whole namespace: a TransformerConfig builds from them the way
    Megatron-Bridge's reader builds one (every field the namespace has; it failed on a missing
    heterogeneous_layers_config_path), with a real AttnBackend enum, and it describes our model."""
    got, cfg = work[kind]["meg"]["args_config"], work[kind]["cfg"]
    assert "error" not in got, got
    assert got["attention_backend_is_enum"]
    ck = Checkpoint(work[kind]["nat"])
    want = dict(num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
                kv_channels=cfg.kv_channels, layernorm_epsilon=cfg.norm_epsilon, normalization="RMSNorm",
                gated_linear_unit=True, add_bias_linear=False, add_qkv_bias=False, num_moe_experts=cfg.num_moe_experts,
                num_query_groups=cfg.num_query_groups, tensor_model_parallel_size=ck.layout.tp,
                pipeline_model_parallel_size=ck.layout.pp, expert_model_parallel_size=ck.layout.ep)
    if cfg.is_moe:
        want["moe_router_topk"] = cfg.moe_router_topk
    else:
        want["ffn_hidden_size"] = cfg.ffn_hidden_size
    assert {k: got[k] for k in want} == want


def test_export_layout_on_disk(work):
    """Megatron-LM's files; one item per stored chunk in its owner's rank file; Megatron args in common.pt."""
    d = work["llama"]
    root = d["td"].parent
    assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == "0"
    assert json.loads((d["td"] / "metadata.json").read_text()) == tdmod.BACKEND
    assert sorted(p.name for p in d["td"].glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(4)]  # tp2 x pp2
    assert not list(root.glob(".*partial*"))
    td = read_torch_dist(root)
    assert td.notes == [] and td.iteration == 0
    a = td.args
    assert (a.num_layers, a.num_query_groups, a.tensor_model_parallel_size, a.pipeline_model_parallel_size,
            a.padded_vocab_size, a.swiglu, a.normalization) == (4, 2, 2, 2, 1024, True, "RMSNorm")
    ck = Checkpoint(d["nat"])
    md = load_dcp_metadata(d["td"] / ".metadata")
    for name, e in ck.tensors.items():
        m = md.state_dict_metadata[name]
        assert list(m.size) == e.shape and m.properties.dtype == torch.float32
    assert "decoder.layers.mlp.linear_fc2._extra_state/shard_3_4" in md.state_dict_metadata
    specs = {s.name: s for s in model_specs(ck.config, ck.layout)}
    for idx, info in md.storage_data.items():  # each chunk sits in the file of the rank that owns it
        if idx.offset is not None:
            size = dict((tuple(c.offsets), tuple(c.sizes)) for c in md.state_dict_metadata[idx.fqn].chunks)
            box = tuple((o, o + n) for o, n in zip(idx.offset, size[tuple(idx.offset)]))
            rank = chunk_rank(specs[idx.fqn], ck.layout, box, ck.config.num_layers)
            assert info.relative_path == f"__{rank}_0.distcp", idx
    # plain PyTorch DCP reads it too (any box: here the whole embedding, stored as two TP chunks)
    import torch.distributed.checkpoint as dcp

    emb = torch.empty(ck.tensors["embedding.word_embeddings.weight"].shape)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed ... uninitialized, assuming ... a single process"
        dcp.load({"embedding.word_embeddings.weight": emb}, checkpoint_id=str(d["td"]), no_dist=True)
    assert torch.equal(emb, ck.read("embedding.word_embeddings.weight"))


def test_chunk_rank_matches_regions():
    """Each chunk goes to the file of the rank whose shard holds it (tp fastest, then ep, then pp)."""
    cfg = ModelConfig.from_hf(dict(model_type="mixtral", vocab_size=300, hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                   num_local_experts=4, num_experts_per_tok=2))
    layout = Layout(tp=2, pp=2, ep=2, etp=1)
    stage = 2  # lcm(tp=2, etp*ep=2)
    for spec in model_specs(cfg, layout):
        for coord in layout.ranks(spec.expert):
            want = stage * coord.pp + (coord.etp + layout.expert_tp * coord.ep if spec.expert else coord.tp)
            for reg in regions(spec, layout, coord, cfg.num_layers):
                if reg.primary:
                    box = tuple((o, o + s) for o, s in zip(reg.global_offset, reg.shape))
                    assert chunk_rank(spec, layout, box, cfg.num_layers) == want, (spec.name, coord)
    qkv = next(s for s in model_specs(cfg, layout) if s.name.endswith("linear_qkv.weight"))
    objs = extra_state_objects(qkv, layout, cfg.num_layers)
    assert [k for k, _ in objs] == [f"decoder.layers.self_attention.linear_qkv._extra_state/shard_{i}_4"
                                    for i in range(4)]
    assert [r for _, r in objs] == [0, 0, 2, 2]


# -- megatron-core's own checkpoint -> native -> HF ---------------------------------------------------------------------

def test_megatron_saved_checkpoint_to_native_to_hf(work):
    d = work["saved"]
    cfg, w = d["cfg"], work["dir"]
    td = read_torch_dist(d["root"])
    assert td.iteration == 3 and td.args.num_layers == 2 and td.notes == []  # common.pt with a Namespace
    assert any(k.endswith("_extra_state/shard_0_2") for k in td.objects)
    nat = torch_dist_to_native(d["root"], w / "saved_nat", cfg, Layout(tp=2, pp=2), quiet=True)
    assert nat.name == "iter_0000003"
    ck = Checkpoint(nat)
    assert ck.tensors["embedding.word_embeddings.weight"].shape == [512, 64]  # re-padded for tp=2 (was 384)
    meg = d["meg"]["tensors"]
    for name in ck.tensors:
        got, want = ck.read(name), meg[name]
        if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            got, want = got[: cfg.vocab_size], want[: cfg.vocab_size]
        assert torch.equal(got, want), name
    hf = convert_mcore_to_hf(nat, w / "saved_hf", quiet=True)
    ref = d["meg"]["logits"][..., : cfg.vocab_size]
    ours = hf_logits(hf, d["ids"])
    diff = (ours - ref).abs().max().item()
    print(f"megatron-core saved -> native -> HF: max |diff| = {diff:.3g}")
    assert ref.std() > 0.1 and diff <= TOL


def test_import_accepts_local_naming_and_checks_keys(work, tmp_path):
    d = work["mixtral"]
    cfg = d["cfg"]
    nat = torch_dist_to_native(d["td"].parent, tmp_path / "nat", cfg, Layout(ep=4), quiet=True)
    src, back = Checkpoint(d["nat"]), Checkpoint(nat)
    for name in src.tensors:
        a, b = src.read(name), back.read(name)
        if a.shape != b.shape:  # vocab padding differs between tp=2 and tp=1
            a, b = a[: cfg.vocab_size], b[: cfg.vocab_size]
        assert torch.equal(a, b), name
    dense = work["llama"]["cfg"]
    with pytest.raises(FormatError, match="missing"):
        torch_dist_to_native(d["td"].parent, tmp_path / "bad", dense, Layout(), quiet=True)


def test_large_items_are_memory_mapped(work, monkeypatch):
    monkeypatch.setattr(tdmod, "ITEM_MMAP_BYTES", 0)
    td = read_torch_dist(work["llama"]["td"].parent)
    ck = Checkpoint(work["llama"]["nat"])
    name = "decoder.layers.mlp.linear_fc1.weight"
    assert torch.equal(td.read(name), ck.read(name))


# -- refusals ---------------------------------------------------------------------------------------------------------

@pytest.fixture
def td_copy(work, tmp_path):
    root = tmp_path / "td"
    shutil.copytree(work["llama"]["td"].parent, root)
    return root / "iter_0000000"


def _one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg and isinstance(e.value, ShardkitError)
    return msg


def test_missing_metadata_refused(td_copy):
    (td_copy / ".metadata").unlink()
    with pytest.raises(FormatError) as e:
        read_torch_dist(td_copy.parent)
    assert ".metadata" in _one_line(e)


def test_missing_distcp_refused(td_copy, tmp_path, work):
    (td_copy / "__2_0.distcp").unlink()
    with pytest.raises(FormatError) as e:
        torch_dist_to_native(td_copy.parent, tmp_path / "nat", work["llama"]["cfg"], quiet=True)
    assert "__2_0.distcp" in _one_line(e) and "missing" in str(e.value)
    assert not (tmp_path / "nat").exists()


def test_truncated_item_refused(td_copy):
    f = td_copy / "__3_0.distcp"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(FormatError) as e:
        read_torch_dist(td_copy)
    assert "__3_0.distcp" in _one_line(e) and "truncated" in str(e.value)


def test_corrupt_item_refused(td_copy):
    f = td_copy / "__0_0.distcp"
    raw = bytearray(f.read_bytes())
    raw[10:400] = b"\0" * 390  # inside the first item's zip headers
    f.write_bytes(bytes(raw))
    td = read_torch_dist(td_copy)
    with pytest.raises(FormatError) as e:
        for name in td.tensors:
            td.read(name)
    assert "__0_0.distcp" in _one_line(e)


class _Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_common_pt_with_code_refused(td_copy, tmp_path):
    marker = tmp_path / "MARKER"
    torch.save({"iteration": 0, "args": _Payload(marker)}, td_copy / "common.pt")
    with pytest.raises(FormatError) as e:
        read_torch_dist(td_copy.parent)
    msg = _one_line(e)
    assert "common.pt" in msg and "system" in msg
    # the torch-free reader refuses it itself (the same line), before torch's reader is asked
    with pytest.raises(FormatError) as e2:
        tdpickle._load_common_light(td_copy / "common.pt")
    assert _one_line(e2) == msg and "refusing to unpickle" in msg
    assert not marker.exists()


def test_common_pt_with_megatron_objects_is_ignored_with_a_note(td_copy):
    """A real Megatron-LM common.pt references megatron-core classes (enums, configs): not loaded, not fatal."""
    mod = types.ModuleType("megatron.shardkit_test_fake")

    class AttnBackend:
        pass

    AttnBackend.__module__ = mod.__name__
    AttnBackend.__qualname__ = "AttnBackend"
    mod.AttnBackend = AttnBackend
    sys.modules[mod.__name__] = mod
    try:
        torch.save({"iteration": 7, "args": argparse.Namespace(attention_backend=AttnBackend())},
                   td_copy / "common.pt")
    finally:
        del sys.modules[mod.__name__]
    (td_copy / "run_config.yaml").unlink()  # (else the args would come from our export's Megatron-Bridge file)
    (td_copy / "shardkit.json").unlink()  # (Megatron-LM writes none; ours records our common.pt's SHA-256)
    td = read_torch_dist(td_copy)
    assert td.common is None and td.args is None and td.iteration == 0  # from the directory name
    assert len(td.notes) == 1 and "common.pt ignored" in td.notes[0]


def test_common_pt_changed_after_the_save_is_damage(td_copy, capsys):
    """shardkit.json records common.pt's SHA-256: a flipped byte in its pickled args (a layernorm_epsilon of another
    model, still a valid pickle) is one line naming the file, in the reader and in `shardkit verify` (whose --json
    still prints a verdict for a script: it printed nothing)."""
    from shardkit.cli import main

    raw = bytearray((td_copy / "common.pt").read_bytes())
    at = raw.find(b"layernorm_epsilon")
    assert at > 0
    raw[at + 2] ^= 1  # the field's name: the args now name another field, the pickle still loads
    (td_copy / "common.pt").write_bytes(bytes(raw))
    with pytest.raises(FormatError) as e:
        read_torch_dist(td_copy.parent)
    msg = _one_line(e)
    assert msg.startswith(f"{td_copy / 'common.pt'}: its SHA-256 is not the one shardkit.json recorded"), msg
    assert main(["verify", str(td_copy.parent)]) == 1
    capsys.readouterr()
    assert main(["verify", str(td_copy.parent), "--json"]) == 1
    out, err = capsys.readouterr()
    got = json.loads(out)
    assert got["ok"] is False and got["error"] == msg and err.strip() == f"shardkit: error: {msg}", (got, err)


def _plain(x):
    """A value unpickled from common.pt as comparable plain data (Namespaces, Megatron stand-ins, dtypes by name)."""
    import numpy as np

    from checkpoint.megatron import TorchDtype
    from checkpoint.safe_load import MegatronObject

    if isinstance(x, argparse.Namespace):
        return ("Namespace", _plain(vars(x)))
    if isinstance(x, MegatronObject):
        return (x.qualname, _plain(vars(x)))
    if isinstance(x, (torch.dtype, TorchDtype)):
        return ("dtype", str(x))
    if isinstance(x, np.ndarray):
        return ("ndarray", str(x.dtype), x.tolist())
    if isinstance(x, dict):
        return (type(x).__name__, {k: _plain(v) for k, v in x.items()})
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, [_plain(v) for v in x])
    return (type(x).__name__, x)


def test_torch_free_readers_equal_torchs(work, monkeypatch):
    """`.metadata` and common.pt are read without torch (plain stand-ins, torch dtypes by name) into what torch's own
    readers give (DCP's classes; torch.load(weights_only=True) under safe_load's allowlist): the same tensors, chunks,
    dtypes, storage entries and common.pt, for our exports (Megatron-LM's whole namespace: enums, signal, dtype) and
    for what megatron-core saved itself."""
    from checkpoint.safe_load import load_torch

    roots = [work["llama"]["td"], work["mixtral"]["td"], work["saved"]["root"]]
    light = [read_torch_dist(r) for r in roots]
    direct = [tdpickle._load_common_light(td.path / "common.pt") for td in light]  # (raises where torch must decide)

    def torch_decides(path):
        raise tdpickle._TorchDecides("test")

    monkeypatch.setattr(tdmod, "_load_metadata_light", lambda path: None)
    monkeypatch.setattr(tdpickle, "_load_common_light", torch_decides)
    for root, a, common in zip(roots, light, direct):
        b = read_torch_dist(root)
        assert all(isinstance(t.dtype, tdpickle._Dtype) for t in a.tensors.values()), root  # read without torch
        assert all(isinstance(t.dtype, torch.dtype) for t in b.tensors.values()), root
        assert {n: (t.shape, str(t.dtype), t.dtype.itemsize, t.chunks) for n, t in a.tensors.items()} == \
            {n: (t.shape, str(t.dtype), t.dtype.itemsize, t.chunks) for n, t in b.tensors.items()}
        assert all(a.tensors[n].dtype == t.dtype for n, t in b.tensors.items())
        assert a.objects == b.objects
        assert {k: (i.relative_path, i.offset, i.length) for k, i in a._storage.items()} == \
            {k: (i.relative_path, i.offset, i.length) for k, i in b._storage.items()}
        assert a.common is not None and isinstance(a.args, argparse.Namespace), root
        assert _plain(common) == _plain(a.common) == _plain(b.common) == _plain(load_torch(a.path / "common.pt"))
        assert a.layout == b.layout
        if a.sidecar is not None:  # (megatron-core's own save carries too few args to describe the model)
            assert a.model_config() == b.model_config()


def test_metadata_with_code_refused(td_copy, tmp_path):
    marker = tmp_path / "MARKER"
    (td_copy / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(FormatError) as e:
        read_torch_dist(td_copy)
    assert ".metadata" in _one_line(e) and "system" in str(e.value)
    assert not marker.exists()


def test_storage_path_outside_checkpoint_refused(td_copy, tmp_path):
    md = load_dcp_metadata(td_copy / ".metadata")
    idx = next(iter(md.storage_data))
    md.storage_data[idx].relative_path = "../../outside.distcp"
    buf = io.BytesIO()
    pickle.dump(md, buf)
    (td_copy / ".metadata").write_bytes(buf.getvalue())
    with pytest.raises(FormatError) as e:
        read_torch_dist(td_copy)
    assert "outside.distcp" in _one_line(e) and "refusing" in str(e.value)


def test_via_native_staging(work, tmp_path):
    """`--format torch_dist`: a native checkpoint staged next to the output, exported, then removed."""
    d = work["llama"]
    td = via_native(lambda staging: convert_hf_to_mcore(d["hf"], staging, Layout(tp=2), quiet=True),
                    tmp_path / "out", quiet=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert sorted(p.name for p in td.parent.iterdir()) == ["iter_0000000", "latest_checkpointed_iteration.txt"]
    a, b = read_torch_dist(td), read_torch_dist(d["td"])
    for name in a.tensors:
        assert torch.equal(a.read(name), b.read(name)), name
    with pytest.raises(ShardkitError, match="not empty"):
        via_native(lambda staging: pytest.fail("must not run"), tmp_path / "out", quiet=True)


def test_export_refuses_non_empty_output(work, tmp_path):
    (tmp_path / "junk").write_text("x")
    with pytest.raises(ShardkitError, match="not empty"):
        write_torch_dist(work["llama"]["nat"], tmp_path, quiet=True)
    with pytest.raises(ShardkitError, match="key-naming"):
        write_torch_dist(work["llama"]["nat"], tmp_path / "x", key_naming="apex", quiet=True)


# -- self-describing exports; Megatron-LM's own checkpoints; inspect and verify ----------------------------------------

def _run(argv: list, capsys) -> tuple[int, str, str]:
    from shardkit.cli import main

    capsys.readouterr()
    rc = main([str(a) for a in argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def _one_error_line(err: str, *words: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("shardkit: error: "), err
    assert "Traceback" not in err
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


def _same_native(a: Path, b: Path) -> None:
    x, y = Checkpoint(a), Checkpoint(b)
    assert x.config.to_dict() == y.config.to_dict() and x.layout == y.layout and set(x.tensors) == set(y.tensors)
    for name in x.tensors:
        assert x.tensors[name].dtype == y.tensors[name].dtype
        assert torch.equal(x.read(name), y.read(name)), name
    assert sorted(p.name for p in x.hf_dir().iterdir()) == sorted(p.name for p in y.hf_dir().iterdir())
    for p in x.hf_dir().iterdir():
        assert p.read_bytes() == (y.hf_dir() / p.name).read_bytes(), p.name


@pytest.mark.parametrize("kind", ["llama", "mixtral"])
def test_export_reads_back_with_no_flags(work, kind, tmp_path, capsys, monkeypatch):
    """shardkit.json and hf/ make our export self-describing: reshard and mcore-to-hf take it with no --hf-config,
    and the round trip native -> torch_dist -> native is the checkpoint it came from, config and bytes. mcore-to-hf
    reads the torch_dist checkpoint in place (checkpoint.opened): no staging import, nothing written beside its
    output, and the HF files are the native checkpoint's export bit for bit."""
    d = work[kind]
    td = read_torch_dist(d["td"])
    ck = Checkpoint(d["nat"])
    cfg, origin = td.model_config()
    assert cfg.to_dict() == ck.config.to_dict() and origin.endswith("shardkit.json")  # hf_config included
    assert td.sidecar["layout"] == ck.layout and td.sidecar["vocab"]["size"] == ck.config.vocab_size
    assert td.sidecar["provenance"]["source"]["provenance"] == ck.manifest.provenance
    assert json.loads((d["td"] / "hf" / "config.json").read_text()) == ck.config.to_hf(dtype="float32")
    assert {p.name for p in ck.hf_dir().iterdir()} <= {p.name for p in (d["td"] / "hf").iterdir()}
    rc, _, err = _run(["reshard", d["td"].parent, tmp_path / "back", "--quiet"], capsys)
    assert rc == 0, err
    _same_native(tmp_path / "back", d["nat"])
    import convert.torch_dist_io as tdio

    def staging_import(*args, **kwargs):
        raise AssertionError("mcore-to-hf imported the torch_dist checkpoint into a staging copy")

    monkeypatch.setattr(tdio, "torch_dist_to_native", staging_import)
    (tmp_path / "td_out").mkdir()
    rc, _, err = _run(["convert", "mcore-to-hf", d["td"].parent, tmp_path / "td_out" / "hf", "--quiet"], capsys)
    assert rc == 0, err
    assert os.listdir(tmp_path / "td_out") == ["hf"]  # no staging directory, no lock or work directory left
    (tmp_path / "td_out" / "hf").rename(tmp_path / "hf_td")
    assert convert_mcore_to_hf(d["nat"], tmp_path / "hf_nat", quiet=True)
    names = sorted(p.name for p in (tmp_path / "hf_nat").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "hf_td").iterdir())
    for n in names:
        assert (tmp_path / "hf_nat" / n).read_bytes() == (tmp_path / "hf_td" / n).read_bytes(), n


def _with_args(root: Path, dst: Path, **args) -> Path:
    """A copy of a torch_dist checkpoint whose common.pt carries `args` as its Megatron-LM namespace."""
    shutil.copytree(root, dst)
    it = tdmod.resolve_torch_dist(dst)
    common, _ = tdpickle.load_common(it / "common.pt")
    common["args"] = argparse.Namespace(**args)
    tdwrite.write_common(it, common)
    return dst


MEG_ARGS = dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
                group_query_attention=True, kv_channels=16, max_position_embeddings=64, padded_vocab_size=384,
                make_vocab_size_divisible_by=128, normalization="RMSNorm", swiglu=True, add_bias_linear=False,
                add_qkv_bias=False, untie_embeddings_and_output_weights=True, position_embedding_type="rope",
                rotary_base=10000, layernorm_epsilon=1e-5, tensor_model_parallel_size=1,
                pipeline_model_parallel_size=1, params_dtype=torch.float32)


def test_megatron_written_checkpoint_names_what_is_missing(work, tmp_path, capsys):
    """Megatron-LM's args hold the padded vocabulary only: the error names exactly the missing fields and both ways
    to supply them; --vocab-size then is enough, and gives what the HF config would."""
    d = work["saved"]
    # megatron_oracle's common.pt: a few args only
    rc, _, err = _run(["reshard", d["root"], tmp_path / "x", "--quiet"], capsys)
    line = _one_error_line(err, "common.pt", "num_attention_heads", "ffn_hidden_size", "max_position_embeddings",
                           "vocab_size", "padded_vocab_size=384", "--hf-config", "--vocab-size")
    assert "num_layers" not in line and not (tmp_path / "x").exists()
    # a full Megatron-LM namespace without the true vocabulary
    full = _with_args(d["root"], tmp_path / "meg", **MEG_ARGS)
    for cmd in (["reshard", full, tmp_path / "y", "--quiet"], ["verify", full, "--quiet"],
                ["convert", "mcore-to-hf", full, tmp_path / "z", "--quiet"]):
        rc, _, err = _run(cmd, capsys)
        assert rc == 1
        line = _one_error_line(err, "lack vocab_size", "padded_vocab_size=384", "--vocab-size N", "--hf-config")
    assert not (tmp_path / "y").exists() and not (tmp_path / "z").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left
    rc, _, err = _run(["reshard", full, tmp_path / "y", "--vocab-size", "300", "--quiet"], capsys)
    assert rc == 0, err
    ref = torch_dist_to_native(d["root"], tmp_path / "ref", d["cfg"], quiet=True)
    got, want = Checkpoint(tmp_path / "y"), Checkpoint(ref)
    assert got.config.vocab_size == 300 and got.layout == Layout()
    for name in want.tensors:
        assert torch.equal(got.read(name), want.read(name)), name
    # inspect shows it without a model config, naming what is missing; with --vocab-size, the model
    rc, out, err = _run(["inspect", full, "--json"], capsys)
    assert rc == 0, err
    info = json.loads(out)
    assert info["model"] is None and "vocab_size" in info["model_unknown"] and info["layout"]["tp"] == 1
    rc, out, err = _run(["verify", full, "--vocab-size", "300", "--json", "--quiet"], capsys)
    assert rc == 0, err
    v = json.loads(out)
    assert v["ok"] and v["keys_ok"] and v["model_from"].endswith("args with --vocab-size 300")


@pytest.mark.parametrize("kind", ["llama", "mixtral"])
def test_inspect_torch_dist(work, kind, capsys):
    d = work[kind]
    td = read_torch_dist(d["td"])
    rc, out, err = _run(["inspect", d["td"].parent, "--json"], capsys)
    assert rc == 0, err
    info = json.loads(out)
    ck = Checkpoint(d["nat"])
    assert info["layout"] == ck.layout.to_dict() and info["model"]["num_layers"] == ck.config.num_layers
    assert info["optimizer"]["present"] is False and info["shardkit"] is True and "config.json" in info["hf_files"]
    rows = {r["name"]: r for r in info["tensors"]}
    assert set(rows) == set(td.tensors)
    md = load_dcp_metadata(d["td"] / ".metadata")
    for name, r in rows.items():
        m = md.state_dict_metadata[name]
        assert r["shape"] == list(m.size) and r["shards"] == len(m.chunks)
        files = {md.storage_data[i].relative_path for i in md.storage_data if i.fqn == name}
        assert r["files"] == sorted(files)
    assert sorted(info["files"]) == sorted(p.name for p in d["td"].glob("*.distcp"))
    rc, out, err = _run(["inspect", d["td"].parent], capsys)
    assert rc == 0 and "optimizer state: none" in out and "shardkit.json" in out


@pytest.mark.parametrize("kind", ["llama", "mixtral"])
def test_verify_torch_dist(work, kind, capsys):
    d = work[kind]
    rc, out, err = _run(["verify", d["td"].parent, "--against", d["hf"], "--json", "--quiet"], capsys)
    assert rc == 0, err
    v = json.loads(out)
    td = read_torch_dist(d["td"])
    assert v["ok"] and v["keys_ok"] and v["missing"] == [] and v["unexpected"] == [] and v["problems"] == []
    assert v["items"] == sum(len(t.chunks) for t in td.tensors.values()) and v["nonfinite"] == {}
    assert v["parity"]["ok"] and v["parity"]["max_abs_diff"] <= TOL


def test_verify_reports_missing_extra_and_nonfinite(work, tmp_path, capsys):
    """A key renamed in .metadata is reported missing (its canonical name) and unexpected (the new key); a NaN in
    an item is counted: non-zero exit, one error line each time."""
    root = tmp_path / "td"
    shutil.copytree(work["llama"]["td"].parent, root)
    it = root / "iter_0000000"
    md = load_dcp_metadata(it / ".metadata")
    name = "decoder.final_layernorm.weight"
    md.state_dict_metadata["decoder.final_norm.weight"] = md.state_dict_metadata.pop(name)
    for idx in list(md.storage_data):
        if idx.fqn == name:
            md.storage_data[type(idx)("decoder.final_norm.weight", idx.offset)] = md.storage_data.pop(idx)
    (it / ".metadata").write_bytes(pickle.dumps(md))
    rc, out, err = _run(["verify", root, "--json", "--quiet"], capsys)
    v = json.loads(out)
    assert rc == 1 and v["missing"] == [name] and v["unexpected"] == ["decoder.final_norm.weight"]
    _one_error_line(err, "missing", name, "decoder.final_norm.weight")
    # NaN: rewrite one item in place with the same size
    shutil.rmtree(root)
    shutil.copytree(work["llama"]["td"].parent, root)
    md = load_dcp_metadata(it / ".metadata")
    idx = next(i for i in md.storage_data if i.fqn == name)
    info = md.storage_data[idx]
    buf = io.BytesIO()
    torch.save(torch.full(read_torch_dist(root).tensors[name].shape, float("nan")), buf)
    assert len(buf.getvalue()) == info.length
    raw = bytearray((it / info.relative_path).read_bytes())
    raw[info.offset:info.offset + info.length] = buf.getvalue()
    (it / info.relative_path).write_bytes(bytes(raw))
    # (shardkit.json records each item's data CRC, so the rewritten item reads as another's bytes (issue 34): its
    # record rewritten too, as a writer of that item would)
    from checkpoint.torch_dist import _item_crc_problem
    from checkpoint.torch_dist_sidecar import SIDECAR, _digest, item_key

    found: dict = {}
    assert _item_crc_problem(buf.getvalue(), 0, info.length, found) is None
    side = json.loads((it / SIDECAR).read_text())
    side.pop("digest")
    side["items"][item_key(name, idx.offset)] = next(c for r, c in found.items() if r.endswith("data/0"))
    side["digest"] = _digest(side)
    (it / SIDECAR).write_text(json.dumps(side))
    rc, out, err = _run(["verify", root, "--quiet"], capsys)
    n = read_torch_dist(root).tensors[name].shape[0]
    assert rc == 1 and f"{name}: {n:,} non-finite" in out
    _one_error_line(err, "non-finite", name)


# -- the bytes shardkit writes itself (torch.save's and DCP's, without torch) -----------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_item_bytes_equal_torch_save(dtype):
    """An item is what torch.save writes for the tensor, byte for byte (zip layout, alignment, crc32s, serialization
    id), written from a numpy value without torch; so are the storage-less archives (an empty object, common.pt)."""
    from checkpoint import store
    from checkpoint.megatron import megatron_args

    g = torch.Generator().manual_seed(0)
    for shape in [(), (5,), (3, 7), (2, 3, 4), (1, 65, 3)]:
        t = torch.randn(shape, generator=g).to(dtype)
        buf = io.BytesIO()
        torch.save(t, buf)
        ours = b"".join(bytes(p) for p in tdwrite.tensor_item(store.to_numpy(t)))
        assert ours == buf.getvalue(), shape
    buf = io.BytesIO()
    torch.save([None], buf)
    assert tdwrite.none_object_bytes() == buf.getvalue()
    cfg = ModelConfig(model_type="llama", num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                      num_query_groups=2, kv_channels=16, vocab_size=300, max_position_embeddings=64,
                      norm_epsilon=1e-5, rotary_base=10000.0)
    args = megatron_args(cfg, Layout(tp=2), "te", store.dtype_name(dtype))
    common = {"iteration": 7, "checkpoint_version": 3.0, "args": args}
    real = argparse.Namespace(**{**vars(args), "params_dtype": dtype})  # what Megatron-LM's own args hold
    buf = io.BytesIO()
    torch.save({**common, "args": real}, buf, pickle_module=tdwrite._ARGS_PICKLE)
    assert tdwrite.torch_save_bytes(common) == buf.getvalue()
    # a tensor inside plain data goes through torch.save itself
    buf = io.BytesIO()
    torch.save({"t": torch.ones(2)}, buf, pickle_module=tdwrite._ARGS_PICKLE)
    assert tdwrite.torch_save_bytes({"t": torch.ones(2)}) == buf.getvalue()


def test_hand_written_checkpoint_reads_with_torch_dcp(tmp_path):
    """A DCP checkpoint written by shardkit's writer alone (numpy values, one a column block that is not contiguous,
    and a torch tensor; two rank files; an object) is read by torch's own reader: FileSystemReader's metadata equals
    the Metadata DCP's classes build, dcp.load fills a state dict with the values, and each item's byte range is a
    file torch.load reads."""
    import ml_dtypes
    import numpy as np
    import torch.distributed.checkpoint as dcp

    rng = np.random.default_rng(0)
    a = rng.standard_normal((6, 4)).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((3,)).astype(np.float32)
    c = torch.randn(2, 2, 5).to(torch.float16)
    w = tdwrite.DCPWriter(tmp_path)
    w.declare_tensor("a", a.shape, "bfloat16", [((0, 0), (6, 2)), ((0, 2), (6, 2))])
    w.declare_tensor("b", b.shape, torch.float32, [((0,), (3,))])
    w.declare_tensor("c", c.shape, torch.float16, [((0, 0, 0), (1, 2, 5)), ((1, 0, 0), (1, 2, 5))])
    w.declare_object("obj")
    with w.rank_file(0) as f0, w.rank_file(1) as f1:
        f0.add_tensor("a", (0, 0), a[:, :2])
        f1.add_tensor("a", (0, 2), a[:, 2:])
        f0.add_tensor("b", (0,), b)
        f0.add_tensor("c", (0, 0, 0), c[:1])
        f1.add_tensor("c", (1, 0, 0), c[1:])
        f1.add_bytes("obj", tdwrite.none_object_bytes())
    w.write_metadata("ckpt-id")
    md = dcp.FileSystemReader(str(tmp_path)).read_metadata()
    md.storage_meta.load_id = None  # the reader's own
    assert md == w.metadata("ckpt-id", save_id=md.storage_meta.save_id)
    state = {"a": torch.zeros(6, 4, dtype=torch.bfloat16), "b": torch.zeros(3), "c": torch.zeros_like(c),
             "obj": "placeholder"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed ... uninitialized, assuming ... a single process"
        dcp.load(state, checkpoint_id=str(tmp_path), no_dist=True)
    assert torch.equal(state["a"].view(torch.int16), torch.from_numpy(a.view(np.int16)))
    assert torch.equal(state["b"], torch.from_numpy(b)) and torch.equal(state["c"], c)
    assert state["obj"] == [None]
    for (name, off), (rel, start, length) in w.storage_data.items():
        raw = (tmp_path / rel).read_bytes()[start:start + length]
        item = torch.load(io.BytesIO(raw), weights_only=True)
        if name == "c":
            assert torch.equal(item, c[off[0]:off[0] + 1])


def test_hf_to_torch_dist_streams_the_export(work, tmp_path):
    """convert hf-to-mcore --format torch_dist writes straight into the rank files (no native copy between), and
    what it writes is the export of the native conversion: the same .distcp and common.pt bytes, the same DCP
    metadata, the same hf/ files; neither that nor the export of a native checkpoint imports torch, nor the import of
    the export back to native (whose chunk files are the native conversion's, byte for byte)."""
    d = work["llama"]
    code = ("import sys; from pathlib import Path; from checkpoint.layout import Layout; "
            "from convert.torch_dist_io import convert_hf_to_torch_dist, write_torch_dist; "
            f"convert_hf_to_torch_dist({str(d['hf'])!r}, {str(tmp_path / 'stream')!r}, Layout(tp=2, pp=2), "
            "quiet=True); "
            f"write_torch_dist({str(d['nat'])!r}, {str(tmp_path / 'export')!r}, quiet=True); "
            "assert 'torch' not in sys.modules, 'torch was imported'; "
            "from convert.torch_dist_io import torch_dist_to_native; "
            f"torch_dist_to_native({str(tmp_path / 'export')!r}, {str(tmp_path / 'imported')!r}, quiet=True); "
            "assert 'torch' not in sys.modules, 'the import imported torch'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=str(Path(__file__).resolve().parents[1]))
    assert r.returncode == 0, r.stderr[-2000:]
    for out in ("stream", "export"):
        it = tmp_path / out / "iter_0000000"
        assert not list((tmp_path / out).glob(".*")), out  # nothing staged beside it
        files = sorted(p.name for p in it.glob("*.distcp")) + ["common.pt"]
        assert files == [f"__{r}_0.distcp" for r in range(4)] + ["common.pt"]
        for f in files:
            assert (it / f).read_bytes() == (d["td"] / f).read_bytes(), (out, f)
        a, b = load_dcp_metadata(it / ".metadata"), load_dcp_metadata(d["td"] / ".metadata")
        a.storage_meta = b.storage_meta = None
        assert a == b
        for f in (d["td"] / "hf").iterdir():
            assert (it / "hf" / f.name).read_bytes() == f.read_bytes(), f.name
    nat, back = d["nat"] / "model", tmp_path / "imported" / "iter_0000000" / "model"
    files = sorted(p.relative_to(nat) for p in nat.rglob("*") if p.is_file())
    assert files and files == sorted(p.relative_to(back) for p in back.rglob("*") if p.is_file())
    assert all((nat / f).read_bytes() == (back / f).read_bytes() for f in files)
    # and it reads back with no flags, as every export does
    td = read_torch_dist(tmp_path / "stream")
    assert td.sidecar["provenance"]["source"]["kind"] == "hf"
    assert td.model_config()[0] == Checkpoint(d["nat"]).config


def test_items_read_as_mapped_arrays(work, td_copy):
    """The import reads items as numpy views of the memory-mapped `.distcp` files (item_array: the archive parsed,
    data.pkl through a one-tensor allowlist) instead of torch.load: the same values as torch.load, for our export and
    for what megatron-core saved; an item whose pickle is not the plain tensor form goes to torch.load, which
    refuses it as before."""
    import numpy as np

    from checkpoint import store

    for root in (work["llama"]["td"], work["saved"]["root"]):
        td = read_torch_dist(root)
        for name, t in td.tensors.items():
            for off, _ in t.chunks:
                a = td.item_array(name, off)
                assert not a.flags.writeable and not a.flags.owndata, (name, off)  # a view of the mapping
                b = store.to_numpy(td.read_item(name, off))
                assert a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8)), (name, off)
    # a pickle naming another global: not the fast path's; torch.load's allowlist refuses it
    td = read_torch_dist(td_copy)
    name, t = next(iter(td.tensors.items()))
    info = td._storage[(name, t.chunks[0][0])]
    raw = bytearray((td_copy / info.relative_path).read_bytes())
    item = raw[info.offset:info.offset + info.length]
    at = item.index(b"torch._utils\n_rebuild_tensor_v2")
    raw[info.offset + at:info.offset + at + 12] = b"os\nsystem\n\n\n\n\n"[:12]
    (td_copy / info.relative_path).write_bytes(bytes(raw))
    with pytest.raises(FormatError) as e:
        read_torch_dist(td_copy).item_array(name, t.chunks[0][0])
    assert info.relative_path in _one_line(e)
