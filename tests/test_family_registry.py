"""Adding a model family is one module plus tests (issue 35): tests/toy_family.py, named by $SHARDKIT_FAMILIES,
is registered, converted at TP 2 (native and torch_dist), verified against transformers' own forward (whole and
streamed), exported back bitwise, and trained at TP 2 without sequence parallelism with its per-head q/k norms
summed over TP (equal to one process within 1e-5); and nothing outside checkpoint/families tests a model_type."""
from __future__ import annotations

import ast
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from checkpoint import families
from checkpoint.config import ModelConfig
from checkpoint.reader import Checkpoint
from shardkit.cli import main as cli
from tests.corpus import write_pattern_corpus
from tests.launcher import launch
from tests.test_train import COMMON, losses, real_rows

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv(families.PLUGINS_ENV, "tests.toy_family")  # forked ranks inherit it (tests/launcher.py)
    import transformers

    from tests import toy_family

    root = tmp_path_factory.mktemp("toy")
    cfg = toy_family.ToyConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128)
    torch.manual_seed(0)
    model = toy_family.ToyForCausalLM(cfg)
    with torch.no_grad():  # HF initialises norms to 1: randomise them so a wrong mapping cannot hide
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
    model.save_pretrained(str(root / "hf"))
    assert isinstance(transformers.AutoConfig.from_pretrained(root / "hf"), toy_family.ToyConfig)
    write_pattern_corpus(root / "data")
    yield root
    mp.undo()
    families.unregister(toy_family.MODEL_TYPE)


def test_the_toy_family_is_registered_from_its_module(toy):
    cfg = ModelConfig.from_hf_dir(toy / "hf")
    assert cfg.model_type == "toy_qknorm" and cfg.qk_layernorm
    assert "toy_qknorm" in families.supported_model_types()
    specs = {s.name: s for s in families.model_specs(cfg, __import__("checkpoint.layout").layout.Layout(tp=2))}
    for norm in ("q_layernorm", "k_layernorm"):
        spec = specs[f"decoder.layers.self_attention.{norm}.weight"]
        assert spec.shape == (2, 16) and spec.tp_grad == "always"
    # the spec and the HF maps are one declaration: every canonical tensor has its HF rows
    maps = families.tensor_maps(cfg, __import__("checkpoint.layout").layout.Layout(tp=2))
    assert {m.canonical for m in maps} == set(specs)
    assert {"model.layers.0.self_attn.q_norm.weight", "model.layers.1.self_attn.k_norm.weight"} <= \
        {n for m in maps for n in m.hf_names}


def test_convert_verify_and_export_bitwise(toy, tmp_path):
    from safetensors.torch import load_file

    ck = tmp_path / "ck"
    # the default proof runs (whole model), then the streamed one
    assert cli(["convert", "hf-to-mcore", str(toy / "hf"), str(ck), "--tp", "2", "--quiet"]) == 0
    assert cli(["verify", str(ck), "--against", str(toy / "hf"), "--memory-budget", "256KB"]) == 0
    assert cli(["convert", "hf-to-mcore", str(toy / "hf"), str(tmp_path / "td"), "--tp", "2", "--format",
                "torch_dist", "--quiet", "--no-verify"]) == 0
    assert cli(["convert", "mcore-to-hf", str(ck), str(tmp_path / "back"), "--quiet"]) == 0
    a = {k: v for f in sorted((toy / "hf").glob("*.safetensors")) for k, v in load_file(f).items()}
    b = {k: v for f in sorted((tmp_path / "back").glob("*.safetensors")) for k, v in load_file(f).items()}
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((tmp_path / "back" / "config.json").read_text())["model_type"] == "toy_qknorm"


def test_tp2_without_sequence_parallel_keeps_qk_norms_in_sync(toy):
    """The q/k norms see only this rank's heads: summed over TP even without SP, else each rank's copy drifts and
    the saved one (TP rank 0's) differs from one process's."""
    ck = toy / "ck"
    if not ck.exists():
        assert cli(["convert", "hf-to-mcore", str(toy / "hf"), str(ck), "--quiet", "--no-verify"]) == 0
    args = ["--load", str(ck), "--data-path", str(toy / "data"), "--train-iters", "4", *COMMON]
    launch(1, *args, "--save", str(toy / "one"))
    launch(2, *args, "--save", str(toy / "tp2"), "--tp", "2")
    np.testing.assert_allclose(losses(toy / "tp2"), losses(toy / "one"), rtol=1e-5)
    a, b = real_rows(Checkpoint(toy / "one" / "iter_0000004")), real_rows(Checkpoint(toy / "tp2" / "iter_0000004"))
    src = Checkpoint(ck / "iter_0000000").state_dict()
    for name in a:
        assert (a[name] - b[name]).norm().item() <= 1e-5 * a[name].norm().item(), name
    for norm in ("q_layernorm", "k_layernorm"):
        name = f"decoder.layers.self_attention.{norm}.weight"
        assert not torch.equal(src[name], b[name])  # trained


def test_no_model_type_tests_outside_the_families():
    """`model_type == ...` / `in (...)` comparisons against a literal live only in checkpoint/families (the torchtitan
    bridge names the two models torchtitan has)."""
    allowed = {"checkpoint/families", "convert/torchtitan.py"}
    offenders = []
    for pkg in ("checkpoint", "convert", "verify", "train", "plan", "shardkit"):
        for path in (REPO / pkg).rglob("*.py"):
            rel = path.relative_to(REPO).as_posix()
            if any(rel.startswith(a) for a in allowed):
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Compare):
                    names = [n for n in [node.left, *node.comparators] if isinstance(n, ast.Attribute)
                             and n.attr == "model_type" or isinstance(n, ast.Name) and n.id == "model_type"]
                    consts = [n for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
                    if names and consts:
                        offenders.append(f"{rel}:{node.lineno}")
    assert not offenders, offenders
