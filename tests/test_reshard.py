"""reshard: chains of layouts are lossless, vocab padding follows TP and never leaks, equals a direct conversion."""
from __future__ import annotations

import pytest
import torch

from checkpoint.errors import LayoutError
from checkpoint.layout import Layout
from checkpoint.reader import Checkpoint
from convert.hf_to_mcore import convert_hf_to_mcore
from convert.mcore_to_hf import convert_mcore_to_hf
from convert.reshard import reshard
from shardkit.cli import main
from shardkit.demo import build_tiny_llama
from tests.moe_models import build, hf_tensors


def same_checkpoints(a, b) -> None:
    a, b = Checkpoint(a), Checkpoint(b)
    assert a.layout == b.layout and sorted(a.tensors) == sorted(b.tensors)
    for name in a.tensors:
        assert a.tensors[name] == b.tensors[name], name
        assert torch.equal(a.read(name), b.read(name)), name
    for f in sorted((a.path / "model").rglob("*")):
        if f.is_file():  # byte for byte, chunk files and zarr.json
            assert f.read_bytes() == (b.path / "model" / f.relative_to(a.path / "model")).read_bytes(), f


def test_dense_chain_is_lossless(tmp_path):
    hf = build_tiny_llama(tmp_path / "hf", num_hidden_layers=4, hidden_size=64, intermediate_size=96, vocab_size=300,
                          num_key_value_heads=4)
    convert_hf_to_mcore(hf, tmp_path / "a", Layout(), quiet=True)
    reshard(tmp_path / "a", tmp_path / "b", Layout(tp=4, pp=2), quiet=True)
    b = Checkpoint(tmp_path / "b")
    assert b.layout == Layout(tp=4, pp=2) and b.manifest.vocab["padded_size"] == 512
    assert b.tensors["embedding.word_embeddings.weight"].chunk == [128, 64]
    reshard(tmp_path / "b", tmp_path / "c", Layout(tp=2, pp=1, vpp=1), workers=2, quiet=True)
    assert Checkpoint(tmp_path / "a").manifest.vocab["padded_size"] == 384
    assert Checkpoint(tmp_path / "c").manifest.vocab["padded_size"] == 512
    back = convert_mcore_to_hf(tmp_path / "c", tmp_path / "back", quiet=True)
    x, y = hf_tensors(hf), hf_tensors(back)
    assert sorted(x) == sorted(y)
    for k in x:
        assert torch.equal(x[k], y[k]), k
    assert y["model.embed_tokens.weight"].shape[0] == 300
    # resharding equals converting straight to that layout, byte for byte
    convert_hf_to_mcore(hf, tmp_path / "direct", Layout(tp=4, pp=2), quiet=True)
    same_checkpoints(tmp_path / "b", tmp_path / "direct")
    assert (tmp_path / "c" / "iter_0000000" / "hf" / "tokenizer.json").is_file()


def test_moe_chain_with_ep(tmp_path):
    hf = build("deepseek_v3", tmp_path / "hf")
    convert_hf_to_mcore(hf, tmp_path / "a", Layout(ep=1), quiet=True)
    assert main(["reshard", str(tmp_path / "a"), str(tmp_path / "b"), "--tp", "2", "--ep", "4", "--pp", "3",
                 "--quiet"]) == 0
    reshard(tmp_path / "b", tmp_path / "c", Layout(tp=1, ep=2, etp=1), quiet=True)
    back = convert_mcore_to_hf(tmp_path / "c", tmp_path / "back", quiet=True)
    x, y = hf_tensors(hf), hf_tensors(back)
    assert sorted(x) == sorted(y)
    for k in x:
        assert torch.equal(x[k], y[k]), k
    convert_hf_to_mcore(hf, tmp_path / "direct", Layout(tp=2, ep=4, pp=3), quiet=True)
    same_checkpoints(tmp_path / "b", tmp_path / "direct")


def test_reshard_dtype_cast(tmp_path):
    hf = build_tiny_llama(tmp_path / "hf", dtype=torch.float32, num_hidden_layers=2, hidden_size=64,
                          intermediate_size=96, vocab_size=300)
    convert_hf_to_mcore(hf, tmp_path / "a", Layout(), quiet=True)
    reshard(tmp_path / "a", tmp_path / "b", Layout(tp=2), dtype="bf16", quiet=True)
    a, b = Checkpoint(tmp_path / "a"), Checkpoint(tmp_path / "b")
    for name in a.tensors:
        assert b.tensors[name].dtype == "bfloat16"
        x, y = a.read(name), b.read(name)
        assert torch.equal(x[: y.shape[0]].to(torch.bfloat16)[:300], y[:300]), name


@pytest.mark.parametrize("layout,match", [
    (Layout(tp=4), "num_key_value_heads=2"),
    (Layout(pp=3), "not divisible by --pp 3"),
    (Layout(tp=8), "num_attention_heads=4"),
])
def test_impossible_layouts_name_the_constraint(tmp_path, layout, match):
    hf = build_tiny_llama(tmp_path / "hf", num_hidden_layers=4, hidden_size=64, intermediate_size=96, vocab_size=300,
                          num_attention_heads=4, num_key_value_heads=2)
    convert_hf_to_mcore(hf, tmp_path / "a", Layout(), quiet=True)
    with pytest.raises(LayoutError, match=match):
        reshard(tmp_path / "a", tmp_path / "b", layout, quiet=True)
    assert not (tmp_path / "b" / "latest").exists()


def test_experts_not_divisible(tmp_path):
    hf = build("mixtral", tmp_path / "hf")
    convert_hf_to_mcore(hf, tmp_path / "a", Layout(), quiet=True)
    r = main(["reshard", str(tmp_path / "a"), str(tmp_path / "b"), "--ep", "3", "--quiet"])
    assert r == 1 and not (tmp_path / "b" / "latest").exists()


def test_every_pair_of_formats(tmp_path):
    """native -> torch_dist -> torch_dist -> native -> HF through the CLI: bitwise, padding never leaks."""
    hf = build_tiny_llama(tmp_path / "hf", num_hidden_layers=2, hidden_size=64, intermediate_size=96, vocab_size=300,
                          num_key_value_heads=4)
    td1, td2, nat, back = (str(tmp_path / x) for x in ("td1", "td2", "nat", "back"))
    assert main(["convert", "hf-to-mcore", str(hf), td1, "--tp", "2", "--format", "torch_dist", "--quiet"]) == 0
    assert (tmp_path / "td1" / "latest_checkpointed_iteration.txt").is_file()
    assert main(["reshard", td1, td2, "--tp", "4", "--pp", "2", "--format", "torch_dist", "--hf-config", str(hf),
                 "--quiet"]) == 0
    assert main(["reshard", td2, nat, "--tp", "1", "--hf-config", str(hf), "--quiet"]) == 0
    assert Checkpoint(nat).layout == Layout(tp=1)
    assert main(["convert", "mcore-to-hf", td2, back, "--hf-config", str(hf), "--quiet"]) == 0
    x, y = hf_tensors(hf), hf_tensors(back)
    assert sorted(x) == sorted(y)
    for k in x:
        assert torch.equal(x[k], y[k]), k
    # a torch_dist source without a model description is a one-line error naming the flag
    assert main(["reshard", td1, str(tmp_path / "x"), "--quiet"]) == 1
    assert not (tmp_path / "x" / "latest").exists()
