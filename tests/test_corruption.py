"""Damage on disk is found by every command that reads a checkpoint, and named (issue 8): a flipped byte, a truncated
chunk, a deleted chunk, an edited manifest (with and without its digest recomputed) and two swapped arrays, against
verify, reshard and continue-pretrain (with and without --skip-verify: chunks are checksummed as they are read either
way) and mcore-to-hf. Each is one `shardkit: error:` line naming the tensor (and the chunk, where the damage is in one),
a non-zero exit, and no output that looks complete: nothing loads silently wrong.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from checkpoint.manifest import _digest
from shardkit.cli import main

TINY = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=96, vocab_size=300)
ITER = "iter_0000000"
TENSOR = "decoder.layers.mlp.linear_fc2.weight"  # [2, 64, 96], one chunk per layer
CHUNK_FILE = "c/1/0/0"
SWAP = ("decoder.layers.self_attention.linear_qkv.layer_norm_weight", "decoder.layers.mlp.linear_fc1.layer_norm_weight")


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> dict[str, Path]:
    from shardkit.demo import build_tiny_llama
    from train.data.indexed import write_indexed

    root = tmp_path_factory.mktemp("corrupt")
    hf = build_tiny_llama(root / "hf", **TINY)
    assert main(["convert", "hf-to-mcore", str(hf), str(root / "ck"), "--quiet"]) == 0
    rng = np.random.default_rng(0)
    write_indexed(root / "data", [rng.integers(3, 200, size=40) for _ in range(64)], np.uint16)
    return {"hf": hf, "ck": root / "ck", "data": root / "data"}


def _chunk(ck: Path) -> Path:
    return ck / ITER / "model" / TENSOR / CHUNK_FILE


def flip(ck: Path) -> None:
    p = _chunk(ck)
    b = bytearray(p.read_bytes())
    b[len(b) // 3] ^= 0x10
    p.write_bytes(bytes(b))


def truncate(ck: Path) -> None:
    p = _chunk(ck)
    p.write_bytes(p.read_bytes()[: p.stat().st_size - 100])


def delete(ck: Path) -> None:
    _chunk(ck).unlink()


def edit_manifest(ck: Path) -> None:
    """Change one value, leave the digest as it was."""
    p = ck / ITER / "manifest.json"
    m = json.loads(p.read_text())
    m["model"]["norm_epsilon"] *= 10
    p.write_text(json.dumps(m))


def edit_manifest_redigested(ck: Path) -> None:
    """Swap the tensor's last two axes in the manifest and recompute the digest (a careful editor)."""
    p = ck / ITER / "manifest.json"
    m = json.loads(p.read_text())
    m.pop("digest")
    e = m["tensors"][TENSOR]
    e["shape"] = [e["shape"][0], e["shape"][2], e["shape"][1]]
    e["chunk"] = [e["chunk"][0], e["chunk"][2], e["chunk"][1]]
    m["digest"] = "sha256:" + _digest(m)
    p.write_text(json.dumps(m))


def swap(ck: Path) -> None:
    a, b = (ck / ITER / "model" / n for n in SWAP)
    tmp = a.with_name("tmp")
    a.rename(tmp)
    b.rename(a)
    tmp.rename(b)


def swap_chunks(ck: Path) -> None:
    """Two chunk files of one array exchanged: each passes its own crc32c, only the manifest's per-chunk crcs tell."""
    d = ck / ITER / "model" / TENSOR / "c"
    a, b = d / "0" / "0" / "0", d / "1" / "0" / "0"
    tmp = a.with_name("tmp")
    a.rename(tmp)
    b.rename(a)
    tmp.rename(b)


DAMAGES = {  # damage -> words the error must contain
    "flipped-byte": (flip, (f"tensor {TENSOR} chunk (1, 0, 0)", "Digest mismatch")),
    "truncated-chunk": (truncate, (f"tensor {TENSOR} chunk (1, 0, 0)",)),
    "deleted-chunk": (delete, (f"tensor {TENSOR} chunk (1, 0, 0)",)),
    "edited-manifest": (edit_manifest, ("manifest.json", "digest mismatch")),
    "edited-manifest-redigested": (edit_manifest_redigested, (f"tensor {TENSOR}",)),
    "swapped-arrays": (swap, ("arrays swapped",)),
    "swapped-chunks": (swap_chunks, (f"tensor {TENSOR} chunk (0, 0, 0)", "holds the bytes of chunk (1, 0, 0)",
                                     "swapped")),
}
COMMANDS = ["verify", "reshard", "reshard-skip-verify", "mcore-to-hf", "continue-pretrain",
            "continue-pretrain-skip-verify"]


def argv_for(cmd: str, ck: Path, out: Path, good: dict[str, Path]) -> list[str]:
    return [str(a) for a in {
        "verify": ["verify", ck, "--quiet"],
        "reshard": ["reshard", ck, out, "--tp", "2", "--quiet"],
        "reshard-skip-verify": ["reshard", ck, out, "--tp", "2", "--quiet", "--skip-verify"],
        "mcore-to-hf": ["convert", "mcore-to-hf", ck, out, "--quiet"],
        "continue-pretrain": ["continue-pretrain", "--load", ck, "--data-path", good["data"], "--save", out,
                              "--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "2",
                              "--train-iters", "1"],
        "continue-pretrain-skip-verify": ["continue-pretrain", "--load", ck, "--data-path", good["data"], "--save",
                                          out, "--seq-length", "16", "--micro-batch-size", "1",
                                          "--global-batch-size", "2", "--train-iters", "1", "--skip-verify"],
    }[cmd]]


@pytest.mark.parametrize("cmd", COMMANDS)
@pytest.mark.parametrize("damage", list(DAMAGES))
def test_damage_is_named(good, tmp_path, capsys, damage, cmd):
    ck = Path(shutil.copytree(good["ck"], tmp_path / "ck"))
    fn, words = DAMAGES[damage]
    fn(ck)
    out = tmp_path / "out"
    capsys.readouterr()
    rc = main(argv_for(cmd, ck, out, good))
    err = capsys.readouterr().err
    assert rc == 1, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("shardkit: error:"), err
    if damage == "swapped-arrays":  # whichever of the two is opened first is named
        assert any(f"tensor {n}" in lines[0] for n in SWAP), lines[0]
    for w in words:
        assert w in lines[0], f"{w!r} not in: {lines[0]}"
    if out.exists():
        assert not (out / "latest").exists() and not list(out.glob("iter_*/manifest.json"))
        assert not (out / "config.json").exists()


def _strip_chunk_crcs(ck: Path) -> None:
    """The manifest as a shardkit before per-chunk crcs wrote it (digest recomputed over it)."""
    p = ck / ITER / "manifest.json"
    m = json.loads(p.read_text())
    m.pop("digest")
    for e in m["tensors"].values():
        del e["crc32c"]
    m["digest"] = "sha256:" + _digest(m)
    p.write_text(json.dumps(m))


def test_manifest_records_chunk_crcs(good):
    """One crc32c per chunk, C order over the chunk grid, equal to each chunk file's own trailer."""
    import itertools

    m = json.loads((good["ck"] / ITER / "manifest.json").read_text())
    for name, e in m["tensors"].items():
        grid = [-(-s // c) for s, c in zip(e["shape"], e["chunk"])]
        files = [good["ck"] / ITER / "model" / name / "c" / "/".join(map(str, g))
                 for g in itertools.product(*(range(n) for n in grid))]
        assert e["crc32c"] == [int.from_bytes(f.read_bytes()[-4:], "little") for f in files], name


def test_manifest_without_chunk_crcs_still_reads(good, tmp_path, capsys):
    ck = Path(shutil.copytree(good["ck"], tmp_path / "ck"))
    _strip_chunk_crcs(ck)
    capsys.readouterr()
    assert main(["verify", str(ck), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "no per-chunk crc32c" in out
    assert main(["reshard", str(ck), str(tmp_path / "r"), "--tp", "2", "--quiet"]) == 0
    capsys.readouterr()
    assert main(["verify", str(tmp_path / "r"), "--quiet"]) == 0  # the rewrite records them
    assert "no per-chunk crc32c" not in capsys.readouterr().out


def test_training_save_records_chunk_crcs(good, tmp_path, capsys):
    """The trainer's checkpoints (written through tensorstore) carry the crcs too: a swap in one is found."""
    save = tmp_path / "run"
    assert main(argv_for("continue-pretrain", good["ck"], save, good)) == 0
    it = sorted(save.glob("iter_*"))[-1]
    m = json.loads((it / "manifest.json").read_text())
    assert all(e.get("crc32c") for e in m["tensors"].values())
    assert any(n.startswith("optimizer.") for n in m["tensors"])
    d = it / "model" / TENSOR / "c"
    a, b = d / "0" / "0" / "0", d / "1" / "0" / "0"
    tmp = a.with_name("tmp")
    a.rename(tmp), b.rename(a), tmp.rename(b)
    capsys.readouterr()
    assert main(["verify", str(save), "--quiet"]) == 1
    line = capsys.readouterr().err.strip()
    assert f"tensor {TENSOR} chunk (0, 0, 0)" in line and "chunk (1, 0, 0)" in line, line


# -- torch_dist items (issue 34): each item's zip records carry a CRC-32, checked on every read path; storage entries
# that alias or overlap one another are refused before anything is read ------------------------------------------

TD_ITEM = (TENSOR, (1, 0, 0))


@pytest.fixture(scope="module")
def td(good, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("corrupt-td") / "td"
    assert main(["convert", "hf-to-mcore", str(good["hf"]), str(out), "--format", "torch_dist", "--quiet",
                 "--no-verify"]) == 0
    return out


def _td_storage(td: Path) -> dict:
    from checkpoint.torch_dist import TorchDistCheckpoint

    return TorchDistCheckpoint(td)._storage


def _td_flip(where: str) -> Callable[[Path], None]:
    """One byte of an item changed: in its tensor data (data/0), in its pickle, or in the recorded CRC itself."""
    def damage(td: Path) -> None:
        info = _td_storage(td)[TD_ITEM]
        p = td / ITER / info.relative_path
        b = bytearray(p.read_bytes())
        item = bytes(b[info.offset:info.offset + info.length])
        at = {"data": len(item) // 2, "pickle": item.index(b"_rebuild_tensor_v2") + 3,
              "last-byte": item.rindex(b"archive/data/0") - 46 + 16}[where]  # (the data/0 record's crc32 field)
        b[info.offset + at] ^= 0x01
        p.write_bytes(bytes(b))
    return damage


def _td_entries(edit: Callable[[dict], None]) -> Callable[[Path], None]:
    def damage(td: Path) -> None:
        from checkpoint.torch_dist_pickle import load_dcp_metadata
        import pickle

        p = td / ITER / ".metadata"
        md = load_dcp_metadata(p)
        edit({(k.fqn, None if k.offset is None else tuple(k.offset)): v for k, v in md.storage_data.items()})
        p.write_bytes(pickle.dumps(md))
    return damage


def _alias(s: dict) -> None:  # chunk 0 points at chunk 1's bytes (both pass their CRCs)
    a, b = s[(TENSOR, (0, 0, 0))], s[TD_ITEM]
    a.relative_path, a.offset, a.length = b.relative_path, b.offset, b.length


def _overlap(s: dict) -> None:  # chunk 0 starts inside the previous item of its file
    a = s[(TENSOR, (0, 0, 0))]
    a.offset -= 64
    a.length += 64


def _tail_cut(s: dict) -> None:  # an item's range shortened: its zip directory is outside it
    s[TD_ITEM].length -= 30


def _swap_kinds(s: dict) -> None:  # two tensors of other shapes exchange their entries
    a, b = s[(TENSOR, (0, 0, 0))], s[("decoder.final_layernorm.weight", (0,))]
    (a.relative_path, a.offset, a.length), (b.relative_path, b.offset, b.length) = (
        (b.relative_path, b.offset, b.length), (a.relative_path, a.offset, a.length))


def _swap_same_shape(s: dict) -> None:  # two chunks of one tensor exchange their entries: each passes its own CRCs
    a, b = s[(TENSOR, (0, 0, 0))], s[TD_ITEM]
    (a.relative_path, a.offset, a.length), (b.relative_path, b.offset, b.length) = (
        (b.relative_path, b.offset, b.length), (a.relative_path, a.offset, a.length))


TD_DAMAGES = {  # damage -> words the error line must contain
    "td-flipped-data": (_td_flip("data"), (TENSOR, "[1, 0, 0]", "data/0", "CRC-32", ".distcp")),
    "td-flipped-pickle": (_td_flip("pickle"), (TENSOR, "[1, 0, 0]", "data.pkl", "CRC-32")),
    "td-flipped-recorded-crc": (_td_flip("last-byte"), (TENSOR, "[1, 0, 0]", "CRC-32")),
    "td-aliased-entries": (_td_entries(_alias), (TENSOR, "same bytes", ".distcp")),
    "td-overlapping-entries": (_td_entries(_overlap), (TENSOR, "overlap", ".distcp")),
    "td-entry-cut-short": (_td_entries(_tail_cut), (TENSOR, "[1, 0, 0]", ".distcp")),
    "td-swapped-shapes": (_td_entries(_swap_kinds), (".distcp",)),
    "td-swapped-same-shape": (_td_entries(_swap_same_shape), (TENSOR, "shardkit.json", "swapped", "the bytes of")),
}
TD_COMMANDS = ["verify", "verify-against", "reshard", "reshard-torch_dist", "mcore-to-hf"]


def td_argv(cmd: str, td: Path, out: Path, good: dict[str, Path]) -> list[str]:
    return [str(a) for a in {
        "verify": ["verify", td, "--quiet"],
        "verify-against": ["verify", td, "--against", good["hf"], "--quiet"],
        "reshard": ["reshard", td, out, "--tp", "2", "--quiet"],
        "reshard-torch_dist": ["reshard", td, out, "--tp", "2", "--format", "torch_dist", "--quiet"],
        "mcore-to-hf": ["convert", "mcore-to-hf", td, out, "--quiet"],
        "continue-pretrain": argv_for("continue-pretrain", td, out, good),
    }[cmd]]


def _one_line(rc, err: str, words) -> str:
    assert rc == 1, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("shardkit: error:"), err
    for w in words:
        assert w in lines[0], f"{w!r} not in: {lines[0]}"
    return lines[0]


@pytest.mark.parametrize("cmd", TD_COMMANDS)
@pytest.mark.parametrize("damage", list(TD_DAMAGES))
def test_torch_dist_damage_is_named(good, td, tmp_path, capsys, damage, cmd):
    src = Path(shutil.copytree(td, tmp_path / "td"))
    fn, words = TD_DAMAGES[damage]
    fn(src)
    out = tmp_path / "out"
    capsys.readouterr()
    rc = main(td_argv(cmd, src, out, good))
    _one_line(rc, capsys.readouterr().err, words)
    if out.exists():
        assert not (out / "latest").exists() and not (out / "latest_checkpointed_iteration.txt").exists()
        assert not list(out.glob("iter_*/manifest.json")) and not (out / "config.json").exists()


def test_torch_dist_damage_stops_training_load(good, td, tmp_path, capsys):
    src = Path(shutil.copytree(td, tmp_path / "td"))
    _td_flip("data")(src)
    capsys.readouterr()
    rc = main(td_argv("continue-pretrain", src, tmp_path / "out", good))
    _one_line(rc, capsys.readouterr().err, (TENSOR, "CRC-32"))
    assert not list((tmp_path / "out").glob("iter_*"))


def test_every_item_crc_is_checked_once_per_reader(td, monkeypatch):
    """The check is one pass per item and reader (not per box read), and every item of a clean export passes."""
    from checkpoint import torch_dist

    calls = []
    real = torch_dist._item_crc_problem
    monkeypatch.setattr(torch_dist, "_item_crc_problem", lambda *a: calls.append(a[1:]) or real(*a))
    ck = torch_dist.TorchDistCheckpoint(td)
    for name, t in ck.tensors.items():
        ck.read_numpy(name)
        ck.read(name)
    assert len(calls) == sum(len(t.chunks) for t in ck.tensors.values())


def test_item_crc_checker_on_unseen_archives(tmp_path):
    """torch.save's own archives (an fp32, a bf16, a non-contiguous view): clean ones pass; any one byte changed in
    any record's data fails; a deflate-compressed record is refused unread (torch.save never compresses: a record
    that inflates to its declared size could be a bomb)."""
    import io
    import zipfile

    import torch

    from checkpoint.torch_dist import _item_crc_problem

    for value in (torch.arange(12, dtype=torch.float32).reshape(3, 4), torch.ones(5, dtype=torch.bfloat16),
                  torch.arange(20.0).reshape(4, 5)[:, 1:3]):
        buf = io.BytesIO()
        torch.save(value, buf)
        raw = buf.getvalue()
        assert _item_crc_problem(raw, 0, len(raw)) is None
        with zipfile.ZipFile(io.BytesIO(raw)) as z:
            for info in z.infolist():
                if info.file_size == 0:
                    continue
                start = info.header_offset + 30 + len(info.filename.encode()) + len(
                    raw[info.header_offset + 30 + len(info.filename.encode()):][:0]) + int.from_bytes(
                    raw[info.header_offset + 28:info.header_offset + 30], "little")
                bad = bytearray(raw)
                bad[start + info.file_size - 1] ^= 0x80
                why = _item_crc_problem(bytes(bad), 0, len(bad))
                assert why is not None and "CRC-32" in why and info.filename in why, (info.filename, why)
        framed = b"x" * 100 + raw + b"y" * 50  # an item inside a bigger file
        assert _item_crc_problem(framed, 100, len(raw)) is None
        assert _item_crc_problem(framed, 100, len(raw) - 1) is not None
    z = io.BytesIO()
    with zipfile.ZipFile(z, "w", zipfile.ZIP_DEFLATED) as f:
        f.writestr("archive/data.pkl", b"a" * 100000)
    raw = z.getvalue()
    assert "compressed" in _item_crc_problem(raw, 0, len(raw))
    assert "not a torch.save zip archive" in _item_crc_problem(b"\0" * 64, 0, 64)


# -- verify --against proves every embedding row (issue 34): the test tokens select a few rows; the rest are compared
# with HF's bit for bit after the cast, in both modes, and the report lists what was neither exercised nor compared --

def _test_token_rows(vocab: int, batch: int = 2, seq: int = 32) -> set[int]:
    import torch

    return set(torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0)).flatten().tolist())


def _hf_with_row(good: dict[str, Path], dst: Path, row: int, scale: float = 1.0 + 2 ** -6) -> Path:
    """A copy of the HF model whose embedding row `row` is rewritten (a valid file: only the values differ)."""
    from safetensors.torch import load_file, save_file

    hf = Path(shutil.copytree(good["hf"], dst))
    d = load_file(str(hf / "model.safetensors"))
    d["model.embed_tokens.weight"] = d["model.embed_tokens.weight"].clone()
    d["model.embed_tokens.weight"][row] *= scale
    save_file(d, str(hf / "model.safetensors"), metadata={"format": "pt"})
    return hf


@pytest.mark.parametrize("mode", ["whole", "streaming", "streaming-small-blocks"])
@pytest.mark.parametrize("which", ["first-unused-row", "last-row"])
def test_against_compares_every_embedding_row(good, td, tmp_path, capsys, mode, which):
    vocab = TINY["vocab_size"]
    used = _test_token_rows(vocab)
    row = min(set(range(vocab)) - used) if which == "first-unused-row" else vocab - 1
    hf = _hf_with_row(good, tmp_path / "hf", row)
    extra = {"whole": [], "streaming": ["--streaming"],
             "streaming-small-blocks": ["--streaming", "--memory-budget", "300KiB"]}[mode]
    for ck in (good["ck"], td):
        capsys.readouterr()
        rc = main(["verify", str(ck), "--against", str(hf), "--quiet", *extra])
        cap = capsys.readouterr()
        line = _one_line(rc, cap.err, ("embedding.word_embeddings.weight", f"row {row}", "1 of 300"))
        assert "Traceback" not in cap.err, line
        assert "differ" in cap.out
    capsys.readouterr()
    assert main(["verify", str(good["ck"]), "--against", str(good["hf"]), "--quiet", *extra]) == 0
    assert "all 300 rows compared" in capsys.readouterr().out


def test_against_reports_what_was_not_exercised(good):
    """The report names parameters neither exercised nor compared: routed experts no test token selected (whole mode
    and streaming without --all-experts), MTP layers in whole mode; a dense model has none."""
    from checkpoint.reader import Checkpoint
    from verify.against import against_hf

    p = against_hf(Checkpoint(good["ck"]), good["hf"])
    assert p["ok"] and p["not_compared"] == [] and p["embedding"]["rows"] == TINY["vocab_size"]
    assert p["embedding"]["rows_differ"] == 0
    s = against_hf(Checkpoint(good["ck"]), good["hf"], streaming=True)
    assert s["ok"] and s["not_compared"] == [] and s["embedding"]["rows_differ"] == 0


def test_against_lists_unselected_experts_and_mtp(tmp_path):
    """A tiny DeepSeek-V3 (MoE + MTP) at one test token: the whole-mode report lists the routed experts the token did
    not select and the MTP layer; streamed without --all-experts it lists the experts; with it, nothing."""
    from checkpoint.reader import Checkpoint
    from verify.against import against_hf
    from tests.moe_models import build

    hf = build("deepseek_v3", tmp_path / "hf")
    assert main(["convert", "hf-to-mcore", str(hf), str(tmp_path / "ck"), "--quiet", "--no-verify"]) == 0
    ck = Checkpoint(tmp_path / "ck")
    whole = against_hf(ck, hf, seq_len=1)
    assert whole["ok"], whole
    assert any("routed experts" in w for w in whole["not_compared"]), whole["not_compared"]
    if whole["mode"] == "whole":  # (a model with MTP layers may always be streamed, which compares them)
        assert any("MTP" in w for w in whole["not_compared"]), whole["not_compared"]
    assert whole["router_bias"] == {"layers": 2, "differ": []}, whole.get("router_bias")
    streamed = against_hf(ck, hf, seq_len=1, streaming=True)
    assert [w for w in streamed["not_compared"] if "routed experts" in w] and streamed["ok"]
    every = against_hf(ck, hf, seq_len=1, all_experts=True)
    assert every["not_compared"] == [] and every["ok"]


# -- values a dtype cannot hold (issue 34 (d)): a cast that would turn finite values into inf is refused, and a
# checkpoint holding NaN/Inf is neither resharded nor exported: one line naming the tensor, nothing committed ------

BIG = "model.layers.1.mlp.down_proj.weight"  # -> decoder.layers.mlp.linear_fc2.weight


@pytest.fixture(scope="module")
def odd(good, tmp_path_factory) -> dict[str, Path]:
    """HF copies with one value beyond fp16's range (bf16 holds it), one beyond bf16's (an fp32 model), one inf; and
    checkpoints converted from them (the inf one with --allow-nonfinite)."""
    import torch
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("odd")
    out = {}
    for kind, value, dtype in (("big16", 70000.0, None), ("neg16", -1e6, None), ("big32", 3.4e38, torch.float32),
                               ("inf", float("inf"), None)):
        hf = Path(shutil.copytree(good["hf"], root / f"hf-{kind}"))
        d = load_file(str(hf / "model.safetensors"))
        d = {k: (v.to(dtype) if dtype else v).clone() for k, v in d.items()}
        d[BIG][3, 4] = value
        save_file(d, str(hf / "model.safetensors"), metadata={"format": "pt"})
        if dtype is not None:
            cfg = json.loads((hf / "config.json").read_text())
            cfg["torch_dtype"] = cfg["dtype"] = "float32"
            (hf / "config.json").write_text(json.dumps(cfg))
        out[f"hf-{kind}"] = hf
        ck = root / f"ck-{kind}"
        assert main(["convert", "hf-to-mcore", str(hf), str(ck), "--quiet", "--no-verify",
                     *(["--allow-nonfinite"] if kind == "inf" else [])]) == 0
        out[f"ck-{kind}"] = ck
    td = root / "td-inf"
    assert main(["convert", "hf-to-mcore", str(out["hf-inf"]), str(td), "--quiet", "--no-verify", "--format",
                 "torch_dist", "--allow-nonfinite"]) == 0
    out["td-inf"] = td
    return out


def _nothing_at(out: Path) -> None:
    if out.exists():
        assert not (out / "latest").exists() and not (out / "latest_checkpointed_iteration.txt").exists()
        assert not [p for p in out.glob("iter_*") if not p.name.endswith(".partial")]  # (a partial: never loaded)
        assert not list(out.glob("*.safetensors")) and not (out / "config.json").exists()


OVERFLOW_CASES = {  # id -> (source key, argv after the source and OUT, dtype named)
    "h2m-fp16": ("hf-big16", ["convert", "hf-to-mcore"], ["--dtype", "fp16"], "float16"),
    "h2m-fp16-negative": ("hf-neg16", ["convert", "hf-to-mcore"], ["--dtype", "fp16"], "float16"),
    "h2m-fp16-torch_dist": ("hf-big16", ["convert", "hf-to-mcore"], ["--dtype", "fp16", "--format", "torch_dist"],
                            "float16"),
    "h2m-bf16-from-fp32-max": ("hf-big32", ["convert", "hf-to-mcore"], ["--dtype", "bf16"], "bfloat16"),
    "reshard-fp16": ("ck-big16", ["reshard"], ["--dtype", "fp16", "--tp", "2"], "float16"),
    "reshard-fp16-torch_dist": ("ck-big16", ["reshard"], ["--dtype", "fp16", "--format", "torch_dist"], "float16"),
    "m2h-fp16": ("ck-big16", ["convert", "mcore-to-hf"], ["--dtype", "fp16"], "float16"),
    "m2h-bf16-from-fp32": ("ck-big32", ["convert", "mcore-to-hf"], ["--dtype", "bf16"], "bfloat16"),
}


@pytest.mark.parametrize("case", list(OVERFLOW_CASES))
def test_cast_beyond_the_dtype_range_is_refused(odd, tmp_path, capsys, case):
    src, cmd, extra, dtype = OVERFLOW_CASES[case]
    out = tmp_path / "out"
    capsys.readouterr()
    rc = main([*cmd, str(odd[src]), str(out), "--quiet", *extra])
    line = _one_line(rc, capsys.readouterr().err, ("linear_fc2" if not cmd[-1] == "mcore-to-hf" else BIG,
                                                    "beyond", dtype))
    assert "Traceback" not in line
    _nothing_at(out)


def test_values_inside_the_range_still_cast(odd, tmp_path, capsys):
    """bf16 holds 70000 and fp32 holds 3.4e38: no refusal where the target holds the values."""
    assert main(["reshard", str(odd["ck-big16"]), str(tmp_path / "a"), "--dtype", "fp32", "--quiet"]) == 0
    assert main(["convert", "mcore-to-hf", str(odd["ck-big32"]), str(tmp_path / "b"), "--quiet"]) == 0
    assert main(["convert", "hf-to-mcore", str(odd["hf-big16"]), str(tmp_path / "c"), "--quiet", "--no-verify"]) == 0


INF_CASES = {
    "reshard": ["reshard", "{ck}", "{out}", "--tp", "2"],
    "reshard-same-layout": ["reshard", "{ck}", "{out}"],
    "reshard-to-torch_dist": ["reshard", "{ck}", "{out}", "--format", "torch_dist"],
    "mcore-to-hf": ["convert", "mcore-to-hf", "{ck}", "{out}"],
    "td-reshard": ["reshard", "{td}", "{out}"],
    "td-mcore-to-hf": ["convert", "mcore-to-hf", "{td}", "{out}"],
}


@pytest.mark.parametrize("case", list(INF_CASES))
def test_checkpoint_holding_inf_is_not_resharded_or_exported(odd, tmp_path, capsys, case):
    out = tmp_path / "out"
    argv = [a.format(ck=odd["ck-inf"], td=odd["td-inf"], out=out) for a in INF_CASES[case]]
    capsys.readouterr()
    rc = main([*argv, "--quiet"])
    _one_line(rc, capsys.readouterr().err, ("linear_fc2", "non-finite"))  # (an export names the HF tensor too)
    _nothing_at(out)


def test_item_crcs_recorded_in_the_sidecar(td, tmp_path, capsys):
    """shardkit.json records every tensor item's data CRC-32 (its own zip record's), under the digest; a sidecar
    without them (an older export) still reads, without the swap check."""
    from checkpoint.torch_dist import TorchDistCheckpoint
    from checkpoint.torch_dist_sidecar import SIDECAR, _digest, item_key

    ck = TorchDistCheckpoint(td)
    items = ck.sidecar["items"]
    assert len(items) == sum(len(t.chunks) for t in ck.tensors.values())
    for name, t in ck.tensors.items():
        for off, _ in t.chunks:
            found: dict = {}
            info = ck._storage[(name, off)]
            data = (td / ITER / info.relative_path).read_bytes()
            from checkpoint.torch_dist import _item_crc_problem

            assert _item_crc_problem(data, info.offset, info.length, found) is None
            assert items[item_key(name, off)] == next(c for r, c in found.items() if r.endswith("data/0"))
    old = Path(shutil.copytree(td, tmp_path / "old"))
    p = old / ITER / SIDECAR
    d = json.loads(p.read_text())
    d.pop("digest")
    d.pop("items")
    d["digest"] = _digest(d)
    p.write_text(json.dumps(d))
    _td_entries(_swap_same_shape)(old)
    capsys.readouterr()
    assert main(["verify", str(old), "--quiet"]) == 0  # (not detectable without the record: as Megatron's own)


def test_router_bias_that_changes_no_selection_is_still_found(tmp_path, capsys):
    """DeepSeek-V3's expert_bias only decides which experts are selected: a change small enough to leave every test
    token's selection as it was passes the logits, and is found by the whole mode's direct comparison (the
    streamed report lists it as not compared)."""
    from safetensors.torch import load_file, save_file

    from checkpoint.reader import Checkpoint
    from verify.against import against_hf
    from tests.moe_models import build

    hf = build("deepseek_v3", tmp_path / "hf")
    assert main(["convert", "hf-to-mcore", str(hf), str(tmp_path / "ck"), "--quiet", "--no-verify"]) == 0
    d = load_file(str(hf / "model.safetensors"))
    key = "model.layers.2.mlp.gate.e_score_correction_bias"
    d[key] = d[key].clone()
    d[key][3] += 2 ** -20  # far below any score gap between the test tokens' choices
    save_file(d, str(hf / "model.safetensors"), metadata={"format": "pt"})
    ck = Checkpoint(tmp_path / "ck")
    for streaming in (False, True):  # (a model with MTP layers is compared streamed either way)
        p = against_hf(ck, hf, seq_len=4, streaming=streaming)
        assert p["max_abs_diff"] <= 1e-4 and p.get("layers_ok", True) and not p["ok"], p
        assert "expert_bias" in p["weights_differ"] and "(first: layer 2)" in p["weights_differ"], p["weights_differ"]
    capsys.readouterr()
    rc = main(["verify", str(tmp_path / "ck"), "--against", str(hf), "--seq-length", "4", "--quiet"])
    line = capsys.readouterr().err.strip()
    assert rc == 1 and "expert_bias" in line and "\n" not in line, line
