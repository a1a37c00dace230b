"""Optimizer state in checkpoints: the manifest records it, verify covers it, reshard moves it like the weights
(bitwise), torch_dist carries it both ways, and megatron-core's own distributed-optimizer checkpoints map onto it."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from checkpoint import store
from checkpoint.commit import IterationWriter
from checkpoint.errors import CorruptionError, FormatError
from checkpoint.layout import Layout, RankCoord
from checkpoint.manifest import TRAIN_STATE, Manifest, TensorEntry, tensor_path
from checkpoint.reader import Checkpoint
from checkpoint.sharding import OPTIMIZER_STATES, Rule, optimizer_key, optimizer_specs, split_optimizer_key
from checkpoint.families import model_specs
from convert.hf_to_mcore import convert_hf_to_mcore
from convert.reshard import reshard
from shardkit.demo import build_tiny_llama

TRAIN_STATE_DOC = {"iteration": 7, "consumed_samples": 224, "optimizer": {"step": 7, "param_groups": [
    {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1, "wd_mult": 1.0, "lr_mult": 1.0,
     "is_expert_parallel": False, "is_decoupled_lr": False}]}, "scheduler": {  # OptimizerParamScheduler.state_dict()
    "max_lr": 3e-4, "lr_warmup_steps": 32, "num_steps": 224, "lr_decay_style": "cosine", "lr_decay_steps": 3200,
    "min_lr": 3e-5, "start_wd": 0.1, "end_wd": 0.1, "wd_incr_style": "constant", "wd_incr_steps": 3200},
    "rng": {"seed": 1234}, "data": {"fingerprint": "sha256:00"}}


def _dp_chunk(e: TensorEntry) -> list[int]:
    """A trainer-style chunk for an optimizer array: one layer (and expert) of the whole tensor, its first own axis
    split in two (as a sharded optimizer over 2 data-parallel ranks would write it): not the converter's chunk."""
    chunk = list(e.shape)
    for i in range(e.lead):
        chunk[i] = 1
    ax = e.lead
    if ax < len(chunk) and chunk[ax] % 2 == 0:
        chunk[ax] //= 2
    return chunk


def add_optimizer_state(src: Path, out: Path, seed: int = 0, iteration: int | None = None,
                        train_state: dict = TRAIN_STATE_DOC) -> Path:
    """A training checkpoint built from a converted one: the same weights, fp32_param = weight.float(), exp_avg and
    exp_avg_sq random (exp_avg_sq >= 0), the trainer's chunking, and a train_state.json."""
    ck = Checkpoint(src)
    m = ck.manifest
    it = m.iteration if iteration is None else iteration
    g = torch.Generator().manual_seed(seed)
    entries = dict(m.tensors)
    with IterationWriter(out, it, {"test": "optimizer", "seed": seed}) as w:
        for name, e in m.tensors.items():
            value = ck.read(name)
            store.create(w.path(tensor_path(name)), e.shape, e.dtype, e.chunk).write(store.to_numpy(value)).result()
            for state in OPTIMIZER_STATES:
                key = optimizer_key(state, name)
                if state == "fp32_param":
                    v = value.float()
                else:
                    v = torch.randn(value.shape, generator=g)
                    v = v.abs() * 1e-4 if state == "exp_avg_sq" else v * 1e-3
                oe = TensorEntry(e.shape, "float32", _dp_chunk(e), e.rule, e.per_layer, e.expert)
                store.create(w.path(tensor_path(key)), oe.shape, oe.dtype, oe.chunk).write(store.to_numpy(v)).result()
                entries[key] = oe
        (w.path(TRAIN_STATE)).write_text(json.dumps(train_state))
        if ck.hf_dir().is_dir():
            import shutil

            shutil.copytree(ck.hf_dir(), w.path("hf"))
        return w.commit(Manifest(it, m.model, m.layout, entries, provenance=m.provenance,
                                 optimizer=list(OPTIMIZER_STATES)))


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("opt")
    hf = build_tiny_llama(tmp / "hf", dtype=torch.bfloat16, num_hidden_layers=4, hidden_size=64, intermediate_size=96,
                          vocab_size=300, num_key_value_heads=4)
    convert_hf_to_mcore(hf, tmp / "w", Layout(), quiet=True)
    return add_optimizer_state(tmp / "w", tmp / "t", seed=1, iteration=7)


def test_keys_and_specs():
    assert OPTIMIZER_STATES == ("fp32_param", "exp_avg", "exp_avg_sq")
    name = "decoder.layers.self_attention.linear_qkv.weight"
    assert optimizer_key("exp_avg", name) == "optimizer.state.exp_avg." + name
    assert split_optimizer_key(optimizer_key("fp32_param", name)) == ("fp32_param", name)
    assert split_optimizer_key(name) is None
    with pytest.raises(ValueError):
        optimizer_key("momentum", name)
    assert tensor_path(optimizer_key("exp_avg", name)) == "optim/optimizer.state.exp_avg." + name
    from checkpoint.config import ModelConfig  # noqa: F401 (the specs only need a config from a converted ckpt)


def test_manifest_records_optimizer(trained):
    ck = Checkpoint(trained)
    assert ck.has_optimizer and ck.optimizer_states == list(OPTIMIZER_STATES)
    base = model_specs(ck.config, ck.layout)
    specs = ck.manifest.specs()
    assert specs[: len(base)] == base and specs[len(base):] == optimizer_specs(base)
    assert len(ck.tensors) == 4 * len(base)
    for s in optimizer_specs(base):
        e = ck.tensors[s.name]
        assert e.dtype == "float32" and e.shape == list(s.shape) and e.rule == s.rule.value
    text = (ck.path / "manifest.json").read_text()
    d = json.loads(text)
    assert d["optimizer"] == list(OPTIMIZER_STATES)
    # the field is covered by the digest
    edited = text.replace('"optimizer": [\n  "fp32_param",\n', '"optimizer": [\n')
    assert edited != text
    with pytest.raises(FormatError, match="digest mismatch"):
        Manifest.from_json(edited)
    # old manifests without the field still load, as weights-only checkpoints
    w = Checkpoint(trained.parent.parent / "w")
    assert not w.has_optimizer and "optimizer" not in json.loads((w.path / "manifest.json").read_text())
    assert ck.verify()["tensors"] == len(ck.tensors)
    # model consumers see the model: state_dict() and inspect leave the optimizer arrays out (inspect summarises them)
    assert sorted(ck.state_dict()) == sorted(s.name for s in base)
    assert len(ck.state_dict(optimizer=True)) == 4 * len(base)
    from checkpoint.reader import describe

    d = describe(ck)
    assert len(d["tensors"]) == len(base) and d["optimizer"]["states"] == list(OPTIMIZER_STATES)
    assert d["optimizer"]["bytes"] == 3 * 2 * d["total_bytes"] and d["train_state"] == TRAIN_STATE  # bf16 -> fp32


def test_read_local_optimizer_key(trained):
    ck = Checkpoint(trained)
    name = "decoder.layers.mlp.linear_fc1.weight"
    key = optimizer_key("exp_avg", name)
    layout = Layout(tp=2, pp=2)
    full = ck.read(key)
    for tp in range(2):
        got = ck.read_local(key, layout, RankCoord(tp=tp, pp=1))[0]
        F = full.shape[1] // 2
        want = torch.cat([full[2:4, tp * F // 2:(tp + 1) * F // 2], full[2:4, F + tp * F // 2:F + (tp + 1) * F // 2]], 1)
        assert torch.equal(got, want)
    emb = ck.read_local(optimizer_key("fp32_param", "embedding.word_embeddings.weight"), Layout(tp=4), RankCoord(tp=3))
    assert emb[0].shape == (128, 64) and emb[0].dtype == torch.float32


def test_verify_detects_damaged_optimizer_chunk(trained, tmp_path):
    import shutil

    dst = tmp_path / "t"
    shutil.copytree(trained.parent, dst)
    ck = Checkpoint(dst)
    arr_dir = ck.path / tensor_path(optimizer_key("exp_avg_sq", "decoder.final_layernorm.weight"))
    chunk = next(p for p in sorted((arr_dir / "c").rglob("*")) if p.is_file())
    data = bytearray(chunk.read_bytes())
    data[3] ^= 0xFF
    chunk.write_bytes(bytes(data))
    with pytest.raises(CorruptionError, match="exp_avg_sq.decoder.final_layernorm.weight"):
        Checkpoint(dst).verify()


def test_reshard_chain_bitwise_with_optimizer(trained, tmp_path):
    src = Checkpoint(trained)
    reshard(trained, tmp_path / "b", Layout(tp=2, pp=2), dtype="fp32", quiet=True)
    b = Checkpoint(tmp_path / "b")
    assert b.has_optimizer and b.manifest.vocab["padded_size"] == 512
    emb = "embedding.word_embeddings.weight"
    assert b.tensors[emb].dtype == "float32"  # --dtype applies to weights
    assert all(b.tensors[k].dtype == "float32" for k in b.tensors if split_optimizer_key(k))
    # new padding rows: fp32_param repeats the last real row, the moments are zeros
    fp = b.read(optimizer_key("fp32_param", emb))
    assert torch.equal(fp[300:], fp[299:300].expand(212, -1))
    for st in ("exp_avg", "exp_avg_sq"):
        assert not b.read(optimizer_key(st, emb))[300:].any()
    assert json.loads((b.path / TRAIN_STATE).read_text()) == TRAIN_STATE_DOC
    b.verify()
    reshard(tmp_path / "b", tmp_path / "c", Layout(), dtype="bf16", workers=2, quiet=True)
    c = Checkpoint(tmp_path / "c")
    assert sorted(c.tensors) == sorted(src.tensors) and c.manifest.optimizer == src.manifest.optimizer
    for name, e in src.tensors.items():
        x, y = src.read(name), c.read(name)
        assert c.tensors[name].dtype == e.dtype
        if e.rule == Rule.VOCAB.value:
            x, y = x[:300], y[:300]
        assert torch.equal(x, y), name
    assert (c.path / TRAIN_STATE).read_bytes() == (src.path / TRAIN_STATE).read_bytes()


def test_torch_dist_round_trip_with_optimizer(trained, tmp_path):
    from checkpoint.torch_dist import TorchDistCheckpoint
    from checkpoint.megatron import TRAIN_STATE_KEY
    from convert.torch_dist_io import torch_dist_to_native, write_torch_dist

    src = Checkpoint(trained)
    # export at another layout in one pass (reshard + export), then back at the source's layout
    td_dir = write_torch_dist(src, tmp_path / "td", layout=Layout(tp=2, pp=2), quiet=True)
    td = TorchDistCheckpoint(td_dir)
    emb = "embedding.word_embeddings.weight"
    for st in ("param", "exp_avg", "exp_avg_sq"):
        t = td.tensors[f"optimizer.state.{st}.{emb}"]
        assert t.shape == (512, 64) and t.dtype == torch.float32 and len(t.chunks) == 2
    assert td.tensors[emb].dtype == torch.bfloat16
    assert json.loads(td.common[TRAIN_STATE_KEY]) == TRAIN_STATE_DOC
    assert td.common["content_metadata"]["distrib_optim_sharding_type"] == "fully_reshardable"
    assert td.common["optimizer"]["optimizer"]["param_groups"][0]["step"] == 7
    assert td.common["opt_param_scheduler"] == TRAIN_STATE_DOC["scheduler"]
    assert td.args.consumed_train_samples == 224 and td.args.tensor_model_parallel_size == 2
    assert not td.read(f"optimizer.state.exp_avg.{emb}", ((300, 512), (0, 64))).any()
    back = Checkpoint(torch_dist_to_native(td_dir.parent, tmp_path / "back", src.config, Layout(), quiet=True))
    assert back.manifest.optimizer == list(OPTIMIZER_STATES) and sorted(back.tensors) == sorted(src.tensors)
    for name, e in src.tensors.items():
        assert back.tensors[name].dtype == e.dtype
        x, y = src.read(name), back.read(name)
        if e.rule == Rule.VOCAB.value:
            x, y = x[:300], y[:300]
        assert torch.equal(x, y), name
    assert (back.path / TRAIN_STATE).read_bytes() == (src.path / TRAIN_STATE).read_bytes()
    back.verify()


def _megatron_groups(step: int) -> dict:
    """train_state.json's optimizer entry with the param groups megatron-core's optimizer has for a GPTModel (decayed
    and not decayed), so that Megatron can match them on load."""
    base = {"lr_mult": 1.0, "is_expert_parallel": False, "is_decoupled_lr": False, "default_config": True,
            "lr": 1e-3, "max_lr": 1e-3, "min_lr": None, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01,
            "amsgrad": False, "maximize": False, "foreach": None, "capturable": False, "differentiable": False,
            "fused": None, "decoupled_weight_decay": True}
    return {"step": step, "param_groups": [dict(base, wd_mult=1.0), dict(base, wd_mult=0.0)]}


def test_torch_dist_leaves_out_a_scheduler_megatron_cannot_load(trained, tmp_path):
    """An older shardkit's train_state.json held its own scheduler form ({num_steps, max_lr}): copied into common.pt
    as `opt_param_scheduler` it would break Megatron-LM's OptimizerParamScheduler.load_state_dict, so it is left out
    (the whole train_state.json still rides along)."""
    from checkpoint.torch_dist import TorchDistCheckpoint
    from checkpoint.megatron import TRAIN_STATE_KEY
    from convert.torch_dist_io import write_torch_dist

    old = dict(TRAIN_STATE_DOC, scheduler={"num_steps": 7, "max_lr": 3e-4})
    src = add_optimizer_state(Checkpoint(trained).path.parent.parent / "w", tmp_path / "t", seed=1, iteration=7,
                              train_state=old)
    td = TorchDistCheckpoint(write_torch_dist(src, tmp_path / "td", quiet=True))
    assert "opt_param_scheduler" not in td.common
    assert json.loads(td.common[TRAIN_STATE_KEY])["scheduler"] == old["scheduler"]


def test_megatron_distributed_optimizer_both_ways(tmp_path, capsys):
    """megatron-core on CPU (subprocess), with its DistributedDataParallel + DistributedOptimizer:
    (1) trains 2 steps and saves torch_dist with its optimizer state; we map it onto native optimizer entries at
        another layout: values equal megatron's;
    (2) loads our export of a native training checkpoint, optimizer state included, as Megatron-LM does (and trains
        one more step): every optimizer tensor equals ours, the param groups and step come from train_state.json."""
    import importlib.util
    import subprocess
    import sys

    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        pytest.skip("megatron-core is not installed")
    from checkpoint.config import ModelConfig
    from convert.torch_dist_io import torch_dist_to_native, write_torch_dist
    from tests.test_torch_dist import megatron_model

    hf = build_tiny_llama(tmp_path / "hf", dtype=torch.float32, num_hidden_layers=2, hidden_size=64,
                          intermediate_size=96, vocab_size=300, num_key_value_heads=2, rope_scaling=None,
                          rope_theta=10000.0)
    cfg = ModelConfig.from_hf_dir(hf)
    model = megatron_model(cfg, cfg.padded_vocab_size(1))
    convert_hf_to_mcore(hf, tmp_path / "w", Layout(), quiet=True)
    ours = add_optimizer_state(tmp_path / "w", tmp_path / "t", seed=5, iteration=7,
                               train_state=dict(TRAIN_STATE_DOC, optimizer=_megatron_groups(7)))
    export = write_torch_dist(ours, tmp_path / "td", quiet=True)
    jobs = [{"mode": "save", "root": str(tmp_path / "meg"), "iteration": 2, "seed": 3, "steps": 2,
             "out": str(tmp_path / "meg.pt"), "model": model},
            {"mode": "load", "ckpt": str(export), "out": str(tmp_path / "loaded.pt"), "model": model}]
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    oracle = Path(__file__).with_name("megatron_oracle.py")
    r = subprocess.run([sys.executable, str(oracle), "optimizer", str(tmp_path / "jobs.json")], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    spellings = {"fp32_param": "param", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}

    # (1) megatron-core's checkpoint -> native at tp=2
    meg = torch.load(tmp_path / "meg.pt", weights_only=True)
    assert "flattened_range is not supported" in meg["fs_model_space_error"]  # why fully_reshardable is used
    ck = Checkpoint(torch_dist_to_native(tmp_path / "meg", tmp_path / "nat", cfg, Layout(tp=2), quiet=True))
    assert ck.has_optimizer and ck.manifest.iteration == 2 and ck.manifest.vocab["padded_size"] == 512
    for s in model_specs(cfg, ck.layout):
        rows = slice(0, cfg.vocab_size) if s.rule is Rule.VOCAB else slice(None)
        w = meg["tensors"][s.name][rows]
        assert torch.equal(ck.read(s.name)[rows], w), s.name
        for st, meg_st in spellings.items():
            want = meg["optimizer"][meg_st][s.name][rows]
            assert torch.equal(ck.read(optimizer_key(st, s.name))[rows], want), (st, s.name)
        # fp32 training: the main parameters are the weights
        assert torch.equal(ck.read(optimizer_key("fp32_param", s.name))[rows], w)
    assert ck.read(optimizer_key("exp_avg_sq", "decoder.layers.mlp.linear_fc1.weight")).abs().sum() > 0
    ck.verify()
    # inspect and verify read it in place: the optimizer state is there, every item lies in one rank's shard
    from shardkit.cli import main

    for root, hf_flag in ((tmp_path / "meg", ["--hf-config", str(hf)]), (export.parent, [])):
        capsys.readouterr()
        assert main(["inspect", str(root), "--json", *hf_flag]) == 0
        info = json.loads(capsys.readouterr().out)
        assert info["optimizer"]["present"] and info["optimizer"]["states"] == list(OPTIMIZER_STATES)
        assert info["optimizer"]["sharding_type"] == "fully_reshardable"
        assert main(["verify", str(root), "--json", "--quiet", *hf_flag]) == 0
        v = json.loads(capsys.readouterr().out)
        assert v["ok"] and v["problems"] == [] and v["optimizer"] == list(OPTIMIZER_STATES)

    # (2) our export -> megatron-core's distributed optimizer
    loaded = torch.load(tmp_path / "loaded.pt", weights_only=True)
    src = Checkpoint(ours)
    for s in model_specs(cfg, src.layout):
        assert torch.equal(loaded["tensors"][s.name], src.read(s.name)), s.name
        for st, meg_st in spellings.items():
            assert torch.equal(loaded["optimizer"][meg_st][s.name], src.read(optimizer_key(st, s.name))), (st, s.name)
    assert [g["wd_mult"] for g in loaded["param_groups"]] == [1.0, 0.0]
    assert all(g["step"] == 7 for g in loaded["param_groups"])


def test_bad_optimizer_field(trained, tmp_path):
    """An unknown or repeated optimizer state in a (correctly digested) manifest is refused naming the file; a
    manifest that lists optimizer state but lacks some of its arrays fails verify naming them."""
    import shutil

    from checkpoint.manifest import _digest

    text = (Path(trained) / "manifest.json").read_text()
    for bad in (["momentum"], ["exp_avg", "exp_avg"], "exp_avg"):
        d = json.loads(text)
        d.pop("digest")
        d["optimizer"] = bad
        d["digest"] = "sha256:" + _digest(d)
        with pytest.raises(FormatError, match=r"src\.json: optimizer states"):
            Manifest.from_json(json.dumps(d), source="src.json")
    copy = tmp_path / "iter"
    shutil.copytree(trained, copy)
    m = Manifest.from_json(text)
    m.tensors = {k: v for k, v in m.tensors.items() if not k.startswith("optimizer.state.exp_avg_sq.")}
    (copy / "manifest.json").write_text(m.to_json())
    with pytest.raises(FormatError, match=r"missing \['optimizer\.state\.exp_avg_sq\."):
        Checkpoint(copy).verify()


def test_moe_optimizer_state_reshards_with_experts(tmp_path):
    """Expert tensors' optimizer state follows the expert axis (EP) and expert TP like the weights: a Mixtral-style
    training checkpoint goes tp1ep1 -> tp2ep4pp2 -> tp1ep2etp1 and every entry comes back bitwise."""
    from tests.moe_models import build

    hf = build("mixtral", tmp_path / "hf")
    convert_hf_to_mcore(hf, tmp_path / "w", Layout(), quiet=True)
    src = Checkpoint(add_optimizer_state(tmp_path / "w", tmp_path / "t", seed=2))
    key = optimizer_key("exp_avg", "decoder.layers.mlp.experts.experts.linear_fc1.weight")
    assert src.tensors[key].expert and src.tensors[key].shape[1] == 4
    reshard(src.path, tmp_path / "b", Layout(tp=2, ep=4, pp=2), quiet=True)
    b = Checkpoint(tmp_path / "b")
    assert b.tensors[key].chunk[:2] == [1, 1] and b.tensors[key].expert
    b_local = b.read_local(key, b.layout, RankCoord(pp=1, ep=3, etp=1))[0]
    full = src.read(key)
    F = full.shape[2] // 2
    assert torch.equal(b_local, torch.cat([full[1:2, 3:4, F // 2:F], full[1:2, 3:4, F + F // 2:]], 2))
    reshard(tmp_path / "b", tmp_path / "c", Layout(tp=1, ep=2, etp=1), quiet=True)
    c = Checkpoint(tmp_path / "c")
    for name, e in src.tensors.items():
        x, y = src.read(name), c.read(name)
        if e.rule == Rule.VOCAB.value:
            x, y = x[:src.config.vocab_size], y[:src.config.vocab_size]
        assert torch.equal(x, y), name
