"""HF hub cache snapshots (what `huggingface_hub.snapshot_download()` leaves on every machine) are accepted as HF
directories: `models--org--name/snapshots/<rev>/` whose files are symlinks to `../../blobs/<hash>`, given as a path or
as a repo id looked up in the cache (no network: the layout is built by hand in a temporary HF_HOME). Links that
leave the `models--org--name` folder are still refused.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from shardkit.cli import main

TINY = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=96, vocab_size=300)
REPO = "tiny-org/tiny-llama"
REV = "0123456789abcdef0123456789abcdef01234567"


def _tokenizer_files(d: Path) -> None:
    (d / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 256}))
    (d / "special_tokens_map.json").write_text(json.dumps({"eos_token": "</s>"}))


@pytest.fixture(scope="module")
def hub(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(HF_HOME, the snapshot directory, the plain model directory it was built from)."""
    from shardkit.demo import build_tiny_llama

    root = tmp_path_factory.mktemp("hub")
    plain = build_tiny_llama(root / "plain", **TINY)
    _tokenizer_files(plain)
    home = root / "hf_home"
    model = home / "hub" / f"models--{REPO.replace('/', '--')}"
    snap = model / "snapshots" / REV
    (model / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    (model / "refs").mkdir()
    (model / "refs" / "main").write_text(REV)
    for f in sorted(plain.iterdir()):
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, model / "blobs" / digest)
        (snap / f.name).symlink_to(Path("..") / ".." / "blobs" / digest)
    return home, snap, plain


def _run(argv, capsys) -> tuple[int, str]:
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    return rc, capsys.readouterr().err


def _same_checkpoint(a: Path, b: Path) -> None:
    """The same arrays, byte for byte (manifests differ only in provenance)."""
    fa = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file() and "model" in p.parts)
    fb = sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file() and "model" in p.parts)
    assert fa == fb and fa
    for rel in fa:
        assert (a / rel).read_bytes() == (b / rel).read_bytes(), rel


def test_snapshot_dir_converts(hub, tmp_path, capsys, monkeypatch):
    home, snap, plain = hub
    monkeypatch.setenv("HF_HOME", str(home))
    rc, err = _run(["convert", "hf-to-mcore", snap, tmp_path / "a", "--quiet"], capsys)
    assert rc == 0, err
    assert main(["convert", "hf-to-mcore", str(plain), str(tmp_path / "b"), "--quiet"]) == 0
    _same_checkpoint(tmp_path / "a", tmp_path / "b")
    # the tokenizer files, symlinks into blobs/, are carried like regular files
    carried = sorted(p.name for p in (tmp_path / "a" / "iter_0000000" / "hf").iterdir())
    assert "tokenizer_config.json" in carried and "special_tokens_map.json" in carried


def test_repo_id_from_the_cache(hub, tmp_path, capsys, monkeypatch):
    home, _snap, plain = hub
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(home / "hub"))
    rc, err = _run(["convert", "hf-to-mcore", REPO, tmp_path / "a", "--quiet"], capsys)
    assert rc == 0, err
    assert main(["convert", "hf-to-mcore", str(plain), str(tmp_path / "b"), "--quiet"]) == 0
    _same_checkpoint(tmp_path / "a", tmp_path / "b")


def test_repo_id_for_verify_against(hub, tmp_path, capsys, monkeypatch):
    """`verify --against org/name` reads the same cached snapshot (logits of our model vs transformers' own)."""
    home, _snap, plain = hub
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(home / "hub"))
    assert main(["convert", "hf-to-mcore", str(plain), str(tmp_path / "ck"), "--quiet"]) == 0
    rc, err = _run(["verify", tmp_path / "ck", "--against", REPO, "--quiet"], capsys)
    assert rc == 0, err


def test_repo_id_not_cached_is_one_line(hub, tmp_path, capsys, monkeypatch):
    home, _snap, _plain = hub
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(home / "hub"))
    rc, err = _run(["convert", "hf-to-mcore", "tiny-org/not-there", tmp_path / "a", "--quiet"], capsys)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 1 and len(lines) == 1, err
    assert "tiny-org/not-there" in lines[0] and "hub cache" in lines[0] and "--download" in lines[0]
    assert not (tmp_path / "a").exists()


def _copy_snapshot(hub, tmp: Path) -> Path:
    home, snap, _ = hub
    model = snap.parent.parent
    dest = tmp / "hub" / model.name
    shutil.copytree(model, dest, symlinks=True)
    return dest / "snapshots" / REV


@pytest.mark.parametrize("victim", ["model.safetensors", "tokenizer_config.json"])
def test_links_leaving_the_model_folder_are_refused(hub, tmp_path, capsys, victim):
    snap = _copy_snapshot(hub, tmp_path)
    outside = tmp_path / f"outside-{victim}"
    shutil.copyfile(snap / victim, outside)
    (snap / victim).unlink()
    (snap / victim).symlink_to(outside)
    rc, err = _run(["convert", "hf-to-mcore", snap, tmp_path / "out", "--quiet"], capsys)
    if victim == "model.safetensors":
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert rc == 1 and len(lines) == 1, err
        assert "symlink" in lines[0] and "outside" in lines[0] and victim in lines[0]
        assert not (tmp_path / "out").exists()
    else:  # a tokenizer file linked out is not carried (it is not ours to copy); the conversion itself is fine
        assert rc == 0, err
        hf = tmp_path / "out" / "iter_0000000" / "hf"
        assert not (hf / victim).exists() and (hf / "special_tokens_map.json").exists()


def test_blob_link_to_a_sibling_model_is_refused(hub, tmp_path, capsys):
    """`../../blobs/` of one model folder is inside it; `../../../models--other--x/blobs/` is not."""
    snap = _copy_snapshot(hub, tmp_path)
    model = snap.parent.parent
    other = model.parent / "models--other--x" / "blobs"
    other.mkdir(parents=True)
    target = other / "w"
    shutil.copyfile(snap / "model.safetensors", target)
    (snap / "model.safetensors").unlink()
    (snap / "model.safetensors").symlink_to(os.path.relpath(target, snap))
    rc, err = _run(["convert", "hf-to-mcore", snap, tmp_path / "out", "--quiet"], capsys)
    assert rc == 1 and "outside" in err and err.count("\n") == 1, err
