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
    assert main(["reshard", td2, nat, "--tp", "1", "--pp", "1", "--hf-config", str(hf), "--quiet"]) == 0
    assert Checkpoint(nat).layout == Layout(tp=1)
    assert main(["convert", "mcore-to-hf", td2, back, "--hf-config", str(hf), "--quiet"]) == 0
    x, y = hf_tensors(hf), hf_tensors(back)
    assert sorted(x) == sorted(y)
    for k in x:
        assert torch.equal(x[k], y[k]), k
    # our torch_dist exports describe themselves: no --hf-config needed (tests/test_torch_dist.py checks the bytes)
    assert main(["reshard", td2, str(tmp_path / "x"), "--tp", "1", "--pp", "1", "--quiet"]) == 0
    assert Checkpoint(tmp_path / "x").config.to_dict() == Checkpoint(nat).config.to_dict()
    # one without (as Megatron-LM writes them, its args lacking the true vocab) is a one-line error naming the flags
    from checkpoint.torch_dist import read_torch_dist
    from checkpoint.torch_dist_pickle import load_common
    from checkpoint.torch_dist_write import write_common

    it = read_torch_dist(td1).path
    (it / "shardkit.json").unlink()
    common, _ = load_common(it / "common.pt")
    common["args"].vocab_size = None
    write_common(it, common)
    assert main(["reshard", td1, str(tmp_path / "y"), "--quiet"]) == 1
    assert not (tmp_path / "y" / "latest").exists()


# -- flags not given keep the source's layout ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """A 4-layer LLaMA (4 heads, 4 KV heads) and its checkpoints at tp2 pp2 and at pp2 vpp2."""
    root = tmp_path_factory.mktemp("keep")
    hf = build_tiny_llama(root / "hf", num_hidden_layers=4, hidden_size=64, intermediate_size=96, vocab_size=300,
                          num_key_value_heads=4)
    convert_hf_to_mcore(hf, root / "tp2pp2", Layout(tp=2, pp=2), quiet=True)
    convert_hf_to_mcore(hf, root / "pp2vpp2", Layout(pp=2, vpp=2), quiet=True)
    return root


def layout_lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith("reshard: ")]


def test_tp_alone_keeps_pp_and_prints_the_layout(dense, tmp_path, capsys):
    out = tmp_path / "tp4"
    assert main(["reshard", str(dense / "tp2pp2"), str(out), "--tp", "4"]) == 0
    assert Checkpoint(out).layout == Layout(tp=4, pp=2)
    out_text = capsys.readouterr().out
    assert layout_lines(out_text) == ["reshard: tp=2 pp=2 vpp=1 -> tp=4 pp=2 vpp=1 (kept from the source: pp, vpp)"]
    assert out_text.splitlines()[-1] == f"wrote {out / 'iter_0000000'}"  # the layout line came first
    convert_hf_to_mcore(dense / "hf", tmp_path / "direct", Layout(tp=4, pp=2), quiet=True)
    same_checkpoints(out, tmp_path / "direct")
    # --quiet: no layout line (nor a progress bar), only the result
    assert main(["reshard", str(dense / "tp2pp2"), str(tmp_path / "q"), "--tp", "4", "--quiet"]) == 0
    cap = capsys.readouterr()
    assert cap.err == "" and cap.out == f"wrote {tmp_path / 'q' / 'iter_0000000'}\n", cap


def test_pp_alone_keeps_tp_and_vpp(dense, tmp_path, capsys):
    assert main(["reshard", str(dense / "tp2pp2"), str(tmp_path / "pp1"), "--pp", "1"]) == 0
    assert Checkpoint(tmp_path / "pp1").layout == Layout(tp=2)
    assert layout_lines(capsys.readouterr().out) == [
        "reshard: tp=2 pp=2 vpp=1 -> tp=2 pp=1 vpp=1 (kept from the source: tp, vpp)"]
    # a kept vpp that still fits the new pp stays: 4 layers, pp2 vpp2 -> tp2 pp2 vpp2
    assert main(["reshard", str(dense / "pp2vpp2"), str(tmp_path / "tp2"), "--tp", "2", "--quiet"]) == 0
    assert Checkpoint(tmp_path / "tp2").layout == Layout(tp=2, pp=2, vpp=2)


@pytest.mark.parametrize("flags,needles,fix", [
    (["--pp", "4"], ("--pp 4 with the source's --vpp 2", "8 pipeline stages exceed num_hidden_layers=4",
                     "for --pp 4: 1"), ["--vpp", "1"]),
    (["--pp", "1"], ("--pp 1 with the source's --vpp 2", "--vpp > 1 needs --pp > 1", "pass --vpp"), ["--vpp", "1"]),
    (["--vpp", "4"], ("--pp 2 x --vpp 4", "exceed num_hidden_layers=4", "--pp 2 kept from the source"),
     ["--pp", "1"]),
])
def test_a_kept_value_that_no_longer_fits_is_one_line(dense, tmp_path, capsys, flags, needles, fix):
    out = tmp_path / "out"
    assert main(["reshard", str(dense / "pp2vpp2"), str(out), *flags]) == 1
    cap = capsys.readouterr()
    lines = [ln for ln in cap.err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("shardkit: error: "), cap.err
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert not out.exists() and cap.out == ""
    # passing the flag it names fixes it
    assert main(["reshard", str(dense / "pp2vpp2"), str(out), *flags, *fix, "--quiet"]) == 0


@pytest.mark.parametrize("src_layout,flags,want,line", [
    # etp followed tp in the source (Megatron's default): it follows the new tp; ep is kept
    (Layout(ep=2), ["--tp", "2"], Layout(tp=2, ep=2),
     "tp=1 pp=1 vpp=1 ep=2 etp=1 -> tp=2 pp=1 vpp=1 ep=2 etp=2 (kept from the source: pp, vpp, ep; etp follows tp)"),
    # an expert TP set apart from TP is kept
    (Layout(tp=2, ep=2, etp=1), ["--tp", "4"], Layout(tp=4, ep=2, etp=1),
     "tp=2 pp=1 vpp=1 ep=2 etp=1 -> tp=4 pp=1 vpp=1 ep=2 etp=1 (kept from the source: pp, vpp, ep, etp)"),
], ids=["etp-follows-tp", "etp-set-apart-kept"])
def test_moe_keeps_ep_and_etp_follows_tp(tmp_path, capsys, src_layout, flags, want, line):
    hf = build("mixtral", tmp_path / "hf")
    convert_hf_to_mcore(hf, tmp_path / "a", src_layout, quiet=True)
    assert main(["reshard", str(tmp_path / "a"), str(tmp_path / "b"), *flags]) == 0
    assert Checkpoint(tmp_path / "b").layout == want
    assert layout_lines(capsys.readouterr().out) == [f"reshard: {line}"]
    convert_hf_to_mcore(hf, tmp_path / "direct", want, quiet=True)
    same_checkpoints(tmp_path / "b", tmp_path / "direct")


def test_torch_dist_source_keeps_its_layout(dense, tmp_path, capsys):
    """The source layout of a torch_dist checkpoint comes from its Megatron args; reshard --format torch_dist keeps
    what is not given too."""
    from checkpoint.megatron import layout_from_args
    from checkpoint.torch_dist import read_torch_dist

    hf, td, td4, nat = (str(x) for x in (dense / "hf", tmp_path / "td", tmp_path / "td4", tmp_path / "nat"))
    assert main(["reshard", str(dense / "tp2pp2"), td, "--format", "torch_dist", "--quiet"]) == 0
    assert layout_from_args(read_torch_dist(td).args) == Layout(tp=2, pp=2)  # no flags: the same layout
    capsys.readouterr()
    assert main(["reshard", td, td4, "--tp", "4", "--format", "torch_dist", "--hf-config", hf]) == 0
    assert layout_from_args(read_torch_dist(td4).args) == Layout(tp=4, pp=2)
    assert layout_lines(capsys.readouterr().out) == [
        "reshard: tp=2 pp=2 vpp=1 -> tp=4 pp=2 vpp=1 (kept from the source: pp, vpp)"]
    assert main(["reshard", td4, nat, "--pp", "1", "--hf-config", hf, "--quiet"]) == 0
    assert Checkpoint(nat).layout == Layout(tp=4)


def test_torch_dist_source_without_args(dense, tmp_path, capsys):
    """A torch_dist checkpoint whose common.pt has no Megatron args (as megatron-core's own dist_checkpointing.save
    writes) has no known layout: flags not given are 1, and the line says so."""
    from checkpoint.torch_dist import read_torch_dist
    from checkpoint.torch_dist_pickle import load_common
    from checkpoint.torch_dist_write import write_common
    from tests.test_bad_input import drop_common_record

    td = tmp_path / "td"
    assert main(["reshard", str(dense / "tp2pp2"), str(td), "--format", "torch_dist", "--quiet"]) == 0
    it = read_torch_dist(td).path
    common, _ = load_common(it / "common.pt")
    del common["args"]
    write_common(it, common)
    drop_common_record(it)
    (it / "run_config.yaml").unlink()  # (megatron-core's own save has none; ours describes the model for Bridge)
    capsys.readouterr()
    assert main(["reshard", str(td), str(tmp_path / "nat"), "--tp", "2", "--hf-config", str(dense / "hf")]) == 0
    assert Checkpoint(tmp_path / "nat").layout == Layout(tp=2)
    assert layout_lines(capsys.readouterr().out) == [
        f"reshard: layout unknown ({it / 'common.pt'} holds no usable Megatron args) -> tp=2 pp=1 vpp=1 "
        "(flags not given: 1)"]


def test_keep_layout_rules(dense, tmp_path):
    """The rules without writing anything: what etp does when tp changes, a pp the source had, the notes."""
    from checkpoint.config import ModelConfig
    from convert.reshard import keep_layout

    llama = Checkpoint(dense / "tp2pp2").config
    moe = ModelConfig.from_hf_dir(build("mixtral", tmp_path / "mixtral"))
    assert keep_layout(Layout(tp=2, pp=2), llama) == Layout(tp=2, pp=2)  # nothing given: the same layout
    assert keep_layout(Layout(tp=2, etp=2), moe, tp=4) == Layout(tp=4)  # etp == tp: follows the new tp
    assert keep_layout(Layout(tp=2, etp=2), moe) == Layout(tp=2, etp=2)  # tp not changed: etp as stored
    assert keep_layout(Layout(tp=2, etp=1), moe, tp=1) == Layout(tp=1, etp=1)
    assert keep_layout(Layout(tp=2, etp=1), llama, tp=4) == Layout(tp=4)  # a dense model has no expert TP to keep
    assert keep_layout(Layout(tp=2, etp=1), moe, etp=2) == Layout(tp=2, etp=2)
    assert keep_layout(Layout(pp=1, vpp=2), llama, pp=1) == Layout(vpp=2)  # the source's own pp: nothing to refit
    assert keep_layout(None, llama, tp=2) == Layout(tp=2)  # no source layout: 1
    with pytest.raises(LayoutError, match=r"^--ep/--etp apply to MoE models only; \S+ has no experts$"):
        keep_layout(Layout(tp=2), llama, ep=2)  # the flag given is the culprit: no note
