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
    from train.data import write_indexed

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
