"""Hostile and malformed inputs (issue 8), one table: each row damages a copy of a good input, runs one real CLI
command (convert, reshard, continue-pretrain, inspect, verify), and expects exactly one `shardkit: error:` line naming
the culprit and a non-zero exit. Pickle payloads would `touch` a marker file if anything unpickled them: the marker
must never appear. Rows run in-process (shardkit.cli.main) to keep the file fast.
"""
from __future__ import annotations

import io
import json
import os
import pickle
import shutil
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from checkpoint.manifest import _digest
from shardkit.cli import main
from tests.test_user_files import run

TINY = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=96, vocab_size=300)
TENSOR = "decoder.layers.mlp.linear_fc2.weight"
TENSOR_HF = "model.layers.0.mlp.down_proj.weight"
ITER = "iter_0000000"


class Payload:
    """Unpickling this runs `touch <marker>`: the side effect the tests look for."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> dict[str, Path]:
    """One of each good input: an HF model, a native checkpoint, a torch_dist checkpoint, a token corpus."""
    from shardkit.demo import build_tiny_llama
    from train.data.indexed import write_indexed

    root = tmp_path_factory.mktemp("hostile")
    hf = build_tiny_llama(root / "hf", **TINY)
    assert main(["convert", "hf-to-mcore", str(hf), str(root / "ck"), "--quiet"]) == 0
    assert main(["convert", "hf-to-mcore", str(hf), str(root / "td"), "--format", "torch_dist", "--quiet"]) == 0
    rng = np.random.default_rng(0)
    write_indexed(root / "data", [rng.integers(3, 200, size=40) for _ in range(64)], np.uint16)
    return {"hf": hf, "ck": root / "ck", "td": root / "td", "data": root / "data"}


class Case:
    def __init__(self, tmp: Path, good: dict[str, Path]):
        self.tmp, self.good = tmp, good
        self.marker = tmp / "PWNED"
        self.out = tmp / "out"

    def copy(self, key: str) -> Path:
        return Path(shutil.copytree(self.good[key], self.tmp / key, symlinks=True))

    # -- editing helpers ----------------------------------------------------------------------------------------
    def manifest(self, ck: Path, edit: Callable[[dict], None]) -> None:
        """Edit the manifest and recompute its digest (an attacker can; the digest is no signature)."""
        p = ck / ITER / "manifest.json"
        m = json.loads(p.read_text())
        m.pop("digest")
        edit(m)
        m["digest"] = "sha256:" + _digest(m)
        p.write_text(json.dumps(m))

    def hf_config(self, hf: Path, **changes) -> None:
        p = hf / "config.json"
        c = json.loads(p.read_text())
        c.update(changes)
        p.write_text(json.dumps(c))

    def safetensors_header(self, hf: Path, edit: Callable[[dict], None]) -> None:
        """Rewrite model.safetensors with an edited header (data bytes unchanged)."""
        p = hf / "model.safetensors"
        data = p.read_bytes()
        n = int.from_bytes(data[:8], "little")
        header = json.loads(data[8:8 + n])
        edit(header)
        raw = json.dumps(header).encode()
        p.write_bytes(len(raw).to_bytes(8, "little") + raw + data[8 + n:])

    def dcp_metadata(self, td: Path, edit: Callable) -> None:
        from checkpoint.torch_dist_pickle import load_dcp_metadata

        p = td / ITER / ".metadata"
        md = load_dcp_metadata(p)
        edit(md)
        p.write_bytes(pickle.dumps(md))

    def legacy(self, state: object) -> Path:
        """A Megatron-LM legacy checkpoint root whose one rank file is `state` (torch.save)."""
        import torch

        root = self.tmp / "legacy"
        (root / "iter_0000001" / "mp_rank_00").mkdir(parents=True)
        (root / "latest_checkpointed_iteration.txt").write_text("1")
        f = root / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt"
        if isinstance(state, bytes):
            f.write_bytes(state)
        else:
            torch.save(state, f)
        return root


# -- the table: (id, build(case) -> argv, words the error line must contain) --------------------------------------

def _convert(c: Case, hf: Path, *extra) -> list:
    return ["convert", "hf-to-mcore", hf, c.out, "--quiet", *extra]


def _reshard_td(c: Case, td: Path) -> list:
    return ["reshard", td, c.out, "--hf-config", c.good["hf"], "--quiet"]


def _train(c: Case, load: Path, *extra) -> list:
    return ["continue-pretrain", "--load", load, "--data-path", c.good["data"], "--save", c.out,
            "--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "1", *extra]


def _bin_weights(c: Case) -> list:
    hf = c.copy("hf")
    (hf / "model.safetensors").unlink()
    with open(hf / "pytorch_model.bin", "wb") as f:
        pickle.dump(Payload(c.marker), f)
    return _convert(c, hf)


def _legacy_payload(c: Case) -> list:
    import argparse

    root = c.legacy({"args": argparse.Namespace(), "model": {"x": Payload(c.marker)}, "iteration": 1})
    return ["convert", "megatron-to-mcore", root, c.out, "--hf-config", c.good["hf"], "--quiet"]


def _legacy_empty(c: Case) -> list:
    root = c.legacy(b"")
    return ["convert", "megatron-to-mcore", root, c.out, "--hf-config", c.good["hf"], "--quiet"]


def _common_payload(c: Case) -> list:
    import torch

    td = c.copy("td")
    torch.save({"iteration": 0, "args": Payload(c.marker)}, td / ITER / "common.pt")
    return _reshard_td(c, td)


def _metadata_payload(c: Case) -> list:
    td = c.copy("td")
    (td / ITER / ".metadata").write_bytes(pickle.dumps(Payload(c.marker)))
    return _reshard_td(c, td)


def _dcp_path(rel: str) -> Callable[[Case], list]:
    def build(c: Case) -> list:
        td = c.copy("td")
        (c.tmp / "x.distcp").write_bytes(b"\0" * 64)

        def edit(md) -> None:
            for info in md.storage_data.values():
                info.relative_path = rel
        c.dcp_metadata(td, edit)
        return _reshard_td(c, td)
    return build


def _dcp_symlink(c: Case) -> list:
    td = c.copy("td")
    it = td / ITER
    victim = sorted(it.glob("*.distcp"))[0]
    outside = c.tmp / "outside.distcp"
    shutil.move(victim, outside)
    victim.symlink_to(outside)
    return _reshard_td(c, td)


def _dcp_missing_file(c: Case) -> list:
    td = c.copy("td")
    sorted((td / ITER).glob("*.distcp"))[0].unlink()
    return _reshard_td(c, td)


def _dcp_truncated(c: Case) -> list:
    td = c.copy("td")
    f = sorted((td / ITER).glob("*.distcp"))[0]
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    return _reshard_td(c, td)


def _index(weight_map_file: str) -> Callable[[Case], list]:
    def build(c: Case) -> list:
        hf = c.copy("hf")
        from safetensors import safe_open

        with safe_open(str(hf / "model.safetensors"), "np") as f:
            names = list(f.keys())
        (hf / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {}, "weight_map": {n: weight_map_file for n in names}}))
        return _convert(c, hf)
    return build


def _index_symlink(c: Case) -> list:
    hf = c.copy("hf")
    outside = c.tmp / "elsewhere.safetensors"
    shutil.move(hf / "model.safetensors", outside)
    (hf / "shard.safetensors").symlink_to(outside)
    from safetensors import safe_open

    with safe_open(str(outside), "np") as f:
        names = list(f.keys())
    (hf / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: "shard.safetensors" for n in names}}))
    return _convert(c, hf)


def _manifest_edit(edit: Callable[[dict], None], cmd: str = "verify") -> Callable[[Case], list]:
    def build(c: Case) -> list:
        ck = c.copy("ck")
        c.manifest(ck, edit)
        return {"verify": ["verify", ck, "--quiet"], "inspect": ["inspect", ck, "--json"],
                "reshard": ["reshard", ck, c.out, "--tp", "2", "--quiet"],
                "train": _train(c, ck)}[cmd]
    return build


def _rename_tensor(new: str) -> Callable[[dict], None]:
    def edit(m: dict) -> None:
        m["tensors"][new] = m["tensors"].pop(TENSOR)
    return edit


def _set_entry(key: str, value) -> Callable[[dict], None]:
    def edit(m: dict) -> None:
        m["tensors"][TENSOR][key] = value
    return edit


def _set(path: tuple, value) -> Callable[[dict], None]:
    def edit(m: dict) -> None:
        d = m
        for k in path[:-1]:
            d = d[k]
        d[path[-1]] = value
    return edit


def _latest(text: str | None, cmd: str) -> Callable[[Case], list]:
    def build(c: Case) -> list:
        ck = c.copy("ck")
        if text is None:
            (ck / "latest").unlink()
            shutil.rmtree(ck / ITER)
        else:
            (ck / "latest").write_text(text)
        return {"verify": ["verify", ck, "--quiet"], "inspect": ["inspect", ck], "train": _train(c, ck),
                "reshard": ["reshard", ck, c.out, "--quiet"]}[cmd]
    return build


def _array_symlink(c: Case) -> list:
    ck = c.copy("ck")
    arr = ck / ITER / "model" / TENSOR
    outside = c.tmp / "outside-array"
    shutil.move(arr, outside)
    arr.symlink_to(outside)
    return ["verify", ck, "--quiet"]


def _zarr_json(edit: Callable[[dict], None] | None, cmd: str = "verify") -> Callable[[Case], list]:
    def build(c: Case) -> list:
        ck = c.copy("ck")
        p = ck / ITER / "model" / TENSOR / "zarr.json"
        if edit is None:
            p.write_text("")
        else:
            z = json.loads(p.read_text())
            edit(z)
            p.write_text(json.dumps(z))
        return ["verify", ck, "--quiet"] if cmd == "verify" else ["reshard", ck, c.out, "--tp", "2", "--quiet"]
    return build


def _hf(edit: Callable[[Case, Path], None]) -> Callable[[Case], list]:
    def build(c: Case) -> list:
        hf = c.copy("hf")
        edit(c, hf)
        return _convert(c, hf)
    return build


def _empty_data(c: Case) -> list:
    (c.tmp / "empty.bin").write_bytes(b"")
    (c.tmp / "empty.idx").write_bytes(b"")
    argv = _train(c, c.good["ck"])
    argv[argv.index("--data-path") + 1] = c.tmp / "empty"
    return argv


def _train_state(c: Case) -> list:
    ck = c.copy("ck")
    (ck / ITER / "train_state.json").write_text("{not json")
    return _train(c, ck)


def _shift(delta: int) -> Callable[[dict], None]:
    def edit(h: dict) -> None:
        b, e = h[TENSOR_HF]["data_offsets"]
        h[TENSOR_HF]["data_offsets"] = [b + delta, e + delta]
    return edit


def _trailing(c: Case, hf: Path) -> None:
    with open(hf / "model.safetensors", "ab") as f:
        f.write(b"\0" * 16)


ST_DAMAGE: dict[str, tuple[Callable[[Case, Path], None], tuple[str, ...]]] = {
    "overlap": (lambda c, hf: c.safetensors_header(hf, _shift(-128)), ("model.safetensors", TENSOR_HF, "overlaps")),
    "gap": (lambda c, hf: c.safetensors_header(hf, _shift(128)), ("model.safetensors", TENSOR_HF, "gap")),
    "reversed": (lambda c, hf: c.safetensors_header(hf, lambda h: h[TENSOR_HF].update(
        data_offsets=h[TENSOR_HF]["data_offsets"][::-1])), ("model.safetensors", TENSOR_HF, "offsets")),
    "past-end": (lambda c, hf: c.safetensors_header(hf, lambda h: h["model.norm.weight"].update(
        data_offsets=[h["model.norm.weight"]["data_offsets"][0], 10**9])), ("model.safetensors", "model.norm.weight")),
    "trailing-bytes": (_trailing, ("model.safetensors", "no tensor covers")),
    "float-offset": (lambda c, hf: c.safetensors_header(hf, lambda h: h[TENSOR_HF].update(
        data_offsets=[float(x) for x in h[TENSOR_HF]["data_offsets"]])), ("model.safetensors", TENSOR_HF)),
    "metadata-not-strings": (lambda c, hf: c.safetensors_header(hf, lambda h: h.update(__metadata__={"format": 1})),
                             ("model.safetensors", "__metadata__")),
}


CASES: list[tuple[str, Callable[[Case], list], tuple[str, ...]]] = [
    # HF sources (convert hf-to-mcore)
    ("hf-config-empty", _hf(lambda c, hf: (hf / "config.json").write_text("")), ("config.json", "JSON")),
    ("hf-vocab-1e12", _hf(lambda c, hf: c.hf_config(hf, vocab_size=10**12)), ("vocab_size", "limit")),
    ("hf-negative-hidden", _hf(lambda c, hf: c.hf_config(hf, hidden_size=-64)), ("hidden_size",)),
    ("hf-layers-string", _hf(lambda c, hf: c.hf_config(hf, num_hidden_layers="2")), ("num_hidden_layers",)),
    ("hf-safetensors-empty", _hf(lambda c, hf: (hf / "model.safetensors").write_bytes(b"")),
     ("model.safetensors",)),
    ("hf-safetensors-int64", _hf(lambda c, hf: c.safetensors_header(
        hf, lambda h: h[TENSOR_HF].update(dtype="I64"))), ("model.safetensors", "dtype")),
    ("hf-absurd-shape", _hf(lambda c, hf: c.safetensors_header(
        hf, lambda h: h[TENSOR_HF].update(shape=[10**12, 64]))), ("model.safetensors", TENSOR_HF)),
    # byte ranges the safetensors library itself refuses (test_safetensors_library_refuses_them_too)
    *[(f"hf-st-{k}", _hf(lambda c, hf, e=e: e(c, hf)), w) for k, (e, w) in ST_DAMAGE.items()],
    ("hf-index-traversal", _index("../outside.safetensors"), ("model.safetensors.index.json", "outside")),
    ("hf-index-absolute", _index("/etc/passwd"), ("model.safetensors.index.json", "/etc/passwd")),
    ("hf-index-symlink-out", _index_symlink, ("symlink", "outside")),
    ("hf-index-empty", _hf(lambda c, hf: (hf / "model.safetensors.index.json").write_text("")),
     ("model.safetensors.index.json",)),
    ("hf-pickle-bin-only", _bin_weights, ("pickle", "safetensors")),
    # Megatron legacy .pt (convert megatron-to-mcore)
    ("legacy-pickle-payload", _legacy_payload, ("model_optim_rng.pt", "refusing", "system")),
    ("legacy-empty-file", _legacy_empty, ("model_optim_rng.pt",)),
    # torch_dist (reshard a torch_dist source)
    ("td-common-pt-payload", _common_payload, ("common.pt", "refusing", "system")),
    ("td-metadata-payload", _metadata_payload, (".metadata", "refusing", "system")),
    ("td-metadata-empty", lambda c: (lambda td: ((td / ITER / ".metadata").write_bytes(b""), _reshard_td(c, td))[1])(
        c.copy("td")), (".metadata",)),
    ("td-item-traversal", _dcp_path("../x.distcp"), ("../x.distcp", "refusing")),
    ("td-item-absolute", _dcp_path("/etc/passwd"), ("/etc/passwd", "refusing")),
    ("td-item-symlink-out", _dcp_symlink, ("symlink", "outside")),
    ("td-missing-shard-file", _dcp_missing_file, ("distcp", "missing")),
    ("td-truncated-shard-file", _dcp_truncated, ("distcp", "truncated")),
    # native checkpoints: manifest (digest recomputed), latest, arrays
    ("manifest-name-traversal", _manifest_edit(_rename_tensor("../../evil")), ("'../../evil'",)),
    ("manifest-name-absolute", _manifest_edit(_rename_tensor("/etc/passwd"), "inspect"), ("'/etc/passwd'",)),
    ("manifest-vocab-1e12", _manifest_edit(_set(("model", "vocab_size"), 10**12), "train"), ("vocab_size",)),
    ("manifest-shape-1e15", _manifest_edit(_set_entry("shape", [2, 64, 10**15]), "reshard"), (TENSOR, "shape")),
    ("manifest-dtype-int64", _manifest_edit(_set_entry("dtype", "int64"), "inspect"), (TENSOR, "int64")),
    ("manifest-chunk-zero", _manifest_edit(_set_entry("chunk", [1, 0, 96])), (TENSOR, "chunk")),
    ("manifest-tp-1e9", _manifest_edit(_set(("layout", "tp"), 10**9), "reshard"), ("manifest.json", "tp")),
    ("manifest-version-99", _manifest_edit(_set(("format_version",), 99)), ("format_version",)),
    ("manifest-empty", lambda c: (lambda ck: ((ck / ITER / "manifest.json").write_text(""),
                                              ["inspect", ck])[1])(c.copy("ck")), ("manifest.json", "JSON")),
    ("latest-nowhere-train", _latest("iter_0000042\n", "train"), ("latest", "iter_0000042")),
    ("latest-traversal", _latest("../../etc\n", "reshard"), ("latest", "../../etc")),
    ("latest-empty", _latest("", "inspect"), ("latest",)),
    ("no-checkpoint-left", _latest(None, "verify"), ("not a shardkit checkpoint",)),
    ("array-symlink-out", _array_symlink, (TENSOR, "symlink", "outside")),
    ("array-dtype-changed", _zarr_json(lambda z: z.update(data_type="int32")), (TENSOR, "int32")),
    ("array-zarr-json-empty", _zarr_json(None, "reshard"), (TENSOR,)),
    ("train-state-garbage", _train_state, ("train_state.json",)),
    ("train-data-empty", _empty_data, ("empty",)),
]


@pytest.mark.parametrize("build,words", [(b, w) for _, b, w in CASES], ids=[i for i, _, _ in CASES])
def test_hostile_input(good, tmp_path, capsys, build, words):
    c = Case(tmp_path, good)
    argv = [str(a) for a in build(c)]
    capsys.readouterr()
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err
    assert rc not in (0, None), err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("shardkit: error:"), err
    for w in words:
        assert w in lines[0], f"{w!r} not named in: {lines[0]}"
    assert not c.marker.exists(), "a pickle payload ran"
    if c.out.exists():  # nothing that looks like a complete checkpoint
        assert not (c.out / "latest").exists() and not list(c.out.glob("iter_*/manifest.json"))


def test_table_size():
    assert len(CASES) >= 30


def test_remote_code_and_te_extra_state_never_run(good, tmp_path, capsys):
    """Inputs that convert fine but carry code: an `auto_map` naming a configuration module beside config.json (never
    imported: trust_remote_code is never passed), and a Transformer Engine `_extra_state` holding a pickled payload
    as bytes in a legacy rank file (skipped as data, never unpickled)."""
    import argparse

    c = Case(tmp_path, good)
    hf = c.copy("hf")
    (hf / "configuration_evil.py").write_text(f"open({str(c.marker)!r}, 'w').close()\n")
    c.hf_config(hf, auto_map={"AutoConfig": "configuration_evil.EvilConfig"})
    assert main([str(a) for a in _convert(c, hf)]) == 0
    assert main(["verify", str(c.out), "--against", str(hf), "--quiet"]) == 0
    assert not c.marker.exists()
    blob = io.BytesIO(pickle.dumps(Payload(c.marker)))
    root = c.legacy({"args": argparse.Namespace(), "iteration": 1,
                     "model": {"decoder.layers.0.self_attention.linear_qkv._extra_state": blob}})
    capsys.readouterr()
    rc = main(["convert", "megatron-to-mcore", str(root), str(tmp_path / "out2"), "--hf-config", str(good["hf"]),
               "--quiet"])
    err = capsys.readouterr().err
    assert rc != 0 and len(err.strip().splitlines()) == 1  # the weights are missing: an error, but no payload ran
    assert not c.marker.exists()


# -- pointer files that would hang or exhaust memory (issue 14) ---------------------------------------------------

_POINTER_RUNNER = r"""
import json, os, sys
from shardkit.cli import main
import io, contextlib
results = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as e:
            rc = e.code
    results.append([rc, err.getvalue()])
print(json.dumps(results))
"""


def _run_cases(cases: list[tuple[str, list]], timeout: float) -> list:
    """Every case's argv in one subprocess under a timeout and an 8 GiB address-space cap: [(rc, stderr)]."""
    import resource
    import subprocess
    import sys

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))

    res = subprocess.run([sys.executable, "-c", _POINTER_RUNNER, json.dumps([a for _, a in cases])],
                         capture_output=True, text=True, timeout=timeout, preexec_fn=limit,
                         cwd=Path(__file__).resolve().parent.parent)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_pointer_files_are_bounded(good, tmp_path):
    """`latest` / Megatron's tracker as a symlink to /dev/zero, a FIFO, or a 5 MB file: one line naming it, no hang,
    no memory blow-up (all cases in one subprocess under a timeout and an address-space limit)."""
    cases = []
    for kind in ("dev-zero", "fifo", "huge"):
        for fmt, name in (("ck", "latest"), ("td", "latest_checkpointed_iteration.txt")):
            root = Path(shutil.copytree(good[fmt], tmp_path / f"{fmt}-{kind}", symlinks=True))
            p = root / name
            p.unlink()
            if kind == "dev-zero":
                p.symlink_to("/dev/zero")
            elif kind == "fifo":
                os.mkfifo(p)
            else:
                p.write_bytes(b"1" * (5 << 20))
            argv = ["inspect", str(root)] if fmt == "ck" else ["reshard", str(root), str(tmp_path / f"o-{kind}"),
                                                                "--hf-config", str(good["hf"]), "--quiet"]
            cases.append((str(p), argv))
    legacy = tmp_path / "legacy-fifo"
    (legacy / "iter_0000001").mkdir(parents=True)
    os.mkfifo(legacy / "latest_checkpointed_iteration.txt")
    cases.append((str(legacy / "latest_checkpointed_iteration.txt"),
                  ["convert", "megatron-to-mcore", str(legacy), str(tmp_path / "o-legacy"), "--hf-config",
                   str(good["hf"]), "--quiet"]))

    results = _run_cases(cases, 180)
    assert len(results) == len(cases) == 7
    for (path, argv), (rc, err) in zip(cases, results):
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert rc == 1 and len(lines) == 1 and lines[0].startswith("shardkit: error:"), (argv, err)
        assert path in lines[0], lines[0]


@pytest.mark.parametrize("kind", list(ST_DAMAGE))
def test_safetensors_library_refuses_them_too(good, tmp_path, kind):
    """The safetensors damage rows above are exactly files the safetensors library itself refuses (its Rust core's
    offset and coverage checks), so refusing them never turns away a file transformers would load."""
    from safetensors import SafetensorError, safe_open

    c = Case(tmp_path, good)
    hf = c.copy("hf")
    ST_DAMAGE[kind][0](c, hf)
    with pytest.raises(SafetensorError):
        with safe_open(str(hf / "model.safetensors"), "np") as f:
            for k in f.keys():
                f.get_tensor(k)


# -- issue 34 (c): a resumed conversion never takes chunks of a source that changed; a failed proof commits nothing --

def _interrupted(c: Case, hf: Path, out: Path, monkeypatch, after: int = 5) -> None:
    """Start converting `hf` into `out` and stop it after `after` chunks (as a kill would), leaving its partial."""
    from convert import hf_to_mcore

    real = hf_to_mcore._Worker.__call__
    calls = {"n": 0}

    def flaky(self, task):
        calls["n"] += 1
        if calls["n"] == after:
            raise KeyboardInterrupt
        return real(self, task)

    monkeypatch.setattr(hf_to_mcore._Worker, "__call__", flaky)
    assert main(["convert", "hf-to-mcore", str(hf), str(out), "--quiet", "--no-verify", "--workers", "1"]) != 0
    monkeypatch.setattr(hf_to_mcore._Worker, "__call__", real)
    assert list(out.glob("*.partial")) and not (out / "latest").exists()


def _same_header_other_weights(hf: Path, how: str) -> None:
    """Rewrite model.safetensors with the same header (names, dtypes, shapes, offsets) and other weights."""
    p = hf / "model.safetensors"
    data = bytearray(p.read_bytes())
    n = 8 + int.from_bytes(data[:8], "little")
    st = os.stat(p)
    if how == "reversed-body":  # every weight other: the data region reversed (a swapped shard, in effect)
        data[n:] = np.frombuffer(bytes(data[n:]), np.uint16)[::-1].tobytes()  # (bf16 values, in reverse order)
    elif how == "one-block-times-kept":  # one 4 KiB block somewhere changed, the file's times put back
        mid = n + (len(data) - n) // 2
        data[mid:mid + 4096] = bytes(4096)
    else:  # "new-inode": a copy of other weights moved into place (rename over the old file)
        data[n:n + 256] = bytes(256)
    if how == "new-inode":
        tmp = hf / ".new.safetensors"
        tmp.write_bytes(bytes(data))
        os.replace(tmp, p)
    else:
        with open(p, "r+b") as f:
            f.write(bytes(data))
    if how == "one-block-times-kept":
        os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.mark.parametrize("how", ["reversed-body", "one-block-times-kept", "new-inode"])
def test_resume_after_the_source_changed_converts_afresh(good, tmp_path, capsys, monkeypatch, how):
    fmt = "native"
    c = Case(tmp_path, good)
    hf = c.copy("hf")
    out = tmp_path / "out"
    _interrupted(c, hf, out, monkeypatch)
    _same_header_other_weights(hf, how)
    capsys.readouterr()
    # the default proof compares with the changed source: it passes only if nothing of the old one was resumed
    assert main(["convert", "hf-to-mcore", str(hf), str(out), "--quiet", "--format", fmt]) == 0, \
        capsys.readouterr().err
    assert main(["verify", str(out), "--against", str(hf), "--quiet"]) == 0
    fresh = tmp_path / "fresh"
    assert main(["convert", "hf-to-mcore", str(hf), str(fresh), "--quiet", "--no-verify", "--format", fmt]) == 0
    from checkpoint.reader import Checkpoint

    a, b = Checkpoint(out), Checkpoint(fresh)
    for name in a.tensors:
        assert np.array_equal(a.read_numpy(name), b.read_numpy(name)), name


def test_resume_of_an_unchanged_source_still_resumes(good, tmp_path, monkeypatch):
    from convert import hf_to_mcore

    c = Case(tmp_path, good)
    hf = c.copy("hf")
    out = tmp_path / "out"
    _interrupted(c, hf, out, monkeypatch, after=6)
    done = (next(out.glob("*.partial")) / "done.log").read_text().split()
    assert len(done) == 5
    calls = {"n": 0}
    real = hf_to_mcore._Worker.__call__
    monkeypatch.setattr(hf_to_mcore._Worker, "__call__", lambda self, t: (calls.__setitem__("n", calls["n"] + 1),
                                                                          real(self, t))[1])
    assert main(["convert", "hf-to-mcore", str(hf), str(out), "--quiet", "--no-verify", "--workers", "1"]) == 0
    assert calls["n"] == 17 - 5  # 17 chunks in all: the 5 durable ones were not redone


@pytest.mark.parametrize("fmt", ["native", "torch_dist"])
def test_source_changed_during_conversion_commits_nothing(good, tmp_path, capsys, monkeypatch, fmt):
    from convert import hf_to_mcore

    c = Case(tmp_path, good)
    hf = c.copy("hf")
    real = hf_to_mcore._Worker.__call__
    calls = {"n": 0}

    def touching(self, task):
        calls["n"] += 1
        if calls["n"] == 3:  # another job rewrites the source in place while it is read
            with open(hf / "model.safetensors", "r+b") as f:
                f.seek(-4, 2)
                f.write(b"\0\0\0\0")
        return real(self, task)

    monkeypatch.setattr(hf_to_mcore._Worker, "__call__", touching)
    capsys.readouterr()
    rc = main(["convert", "hf-to-mcore", str(hf), str(c.out), "--quiet", "--no-verify", "--workers", "1",
               "--format", fmt])
    err = capsys.readouterr().err
    assert rc == 1 and len(err.strip().splitlines()) == 1, err
    assert "model.safetensors" in err and "changed while" in err
    assert not (c.out / "latest").exists() and not (c.out / ITER).exists()
    assert not (c.out / "latest_checkpointed_iteration.txt").exists()


@pytest.mark.parametrize("fmt", ["native", "torch_dist"])
@pytest.mark.parametrize("failure", ["differs", "cannot-compare"])
def test_failed_default_proof_commits_nothing(good, tmp_path, capsys, monkeypatch, fmt, failure):
    from checkpoint.errors import ShardkitError
    from verify import against

    real = against.against_hf

    def failing(*a, **k):
        if failure == "cannot-compare":
            raise ShardkitError("--against: transformers cannot load it (planted)")
        out = real(*a, **k)
        out.update(ok=False, max_abs_diff=1.0)
        return out

    monkeypatch.setattr(against, "against_hf", failing)
    c = Case(tmp_path, good)
    capsys.readouterr()
    rc = main(["convert", "hf-to-mcore", str(good["hf"]), str(c.out), "--quiet", "--format", fmt])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert rc == 1 and len(lines) == 1 and "nothing was committed" in lines[0], err
    assert not (c.out / "latest").exists() and not (c.out / "latest_checkpointed_iteration.txt").exists()
    assert not list(c.out.glob("iter_*"))
    monkeypatch.setattr(against, "against_hf", real)
    assert main(["convert", "hf-to-mcore", str(good["hf"]), str(c.out), "--quiet", "--format", fmt]) == 0


def test_content_fingerprint_sees_any_sampled_block_and_costs_little(tmp_path):
    """Every sampled block changes the hash; identity fields follow a rename; the cost per file is a few reads."""
    import time

    from checkpoint.hf_source import SAMPLE_BYTES, SAMPLES, content_fingerprint

    p = tmp_path / "x.safetensors"
    p.write_bytes(os.urandom(SAMPLES * SAMPLE_BYTES * 3 + 123))
    base = content_fingerprint(p)
    step = (p.stat().st_size - SAMPLE_BYTES) // (SAMPLES - 1)
    for k in (0, SAMPLES // 2, SAMPLES - 1):
        st = os.stat(p)
        with open(p, "r+b") as f:
            f.seek(k * step + 7)
            b = f.read(1)
            f.seek(k * step + 7)
            f.write(bytes([b[0] ^ 1]))
        os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
        got = content_fingerprint(p)
        assert got["sampled_sha256"] != base["sampled_sha256"] and got["ctime_ns"] >= base["ctime_ns"]
        with open(p, "r+b") as f:  # put it back
            f.seek(k * step + 7)
            f.write(b)
    big = tmp_path / "big"
    with open(big, "wb") as f:
        f.truncate(1 << 30)  # sparse 1 GiB
    t = time.perf_counter()
    content_fingerprint(big)
    assert time.perf_counter() - t < 0.5  # SAMPLES reads, never the whole file


# -- issue 34: non-regular inputs, links out of a root, ambiguous weights --------------------------------------------

def _fifo_at(root: Path, rel: str) -> Path:
    p = root / rel
    p.unlink()
    os.mkfifo(p)
    return p


def _dev_at(root: Path, rel: str) -> Path:
    p = root / rel
    p.unlink()
    p.symlink_to("/dev/zero")
    return p


def _first_chunk(ck: Path) -> str:
    base = ck / ITER / "model" / TENSOR / "c"
    return str(next(p for p in sorted(base.rglob("*")) if p.is_file()).relative_to(ck))


def _fifo_cases(tmp: Path, good: dict[str, Path]) -> list[tuple[str, list[str]]]:
    """(the path that must be named, argv) per case: a FIFO (or a link to a character device) where a reader expects
    a regular file, in every kind of input."""
    cases = []

    def copy(key: str, name: str) -> Path:
        return Path(shutil.copytree(good[key], tmp / name, symlinks=True))

    out = str(tmp / "never")
    hf_argv = lambda hf: ["convert", "hf-to-mcore", str(hf), out, "--quiet", "--no-verify"]  # noqa: E731
    for rel, make in (("config.json", _fifo_at), ("model.safetensors", _fifo_at), ("config.json", _dev_at)):
        hf = copy("hf", f"hf-{make.__name__}-{rel}")
        cases.append((str(make(hf, rel)), hf_argv(hf)))
    # a sharded HF directory whose index is a FIFO, and one whose named shard is
    for target in ("model.safetensors.index.json", "model-00001-of-00001.safetensors"):
        hf = copy("hf", f"hf-index-{target}")
        shutil.move(hf / "model.safetensors", hf / "model-00001-of-00001.safetensors")
        from safetensors import safe_open

        with safe_open(str(hf / "model-00001-of-00001.safetensors"), "np") as f:
            names = list(f.keys())
        (hf / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {}, "weight_map": {n: "model-00001-of-00001.safetensors" for n in names}}))
        cases.append((str(_fifo_at(hf, target)), hf_argv(hf)))
    # verify --against an HF directory whose config.json is a FIFO, or (whole mode) whose weights are
    hf = copy("hf", "hf-against")
    cases.append((str(_fifo_at(hf, "config.json")), ["verify", str(good["ck"]), "--against", str(hf), "--quiet"]))
    hf = copy("hf", "hf-against-weights")
    cases.append((str(_fifo_at(hf, "model.safetensors")), ["verify", str(good["ck"]), "--against", str(hf),
                                                            "--quiet"]))
    hf = copy("hf", "hf-plan")  # plan --model DIR
    cases.append((str(_fifo_at(hf, "config.json")), ["plan", "--model", str(hf), "--gpus", "8"]))
    # native checkpoints: manifest, an array's zarr.json, a chunk file, train_state.json
    for rel, argv in ((f"{ITER}/manifest.json", ["inspect"]), (f"{ITER}/model/{TENSOR}/zarr.json", ["verify"]),
                      (None, ["verify"]), (f"{ITER}/train_state.json", ["verify"])):
        ck = copy("ck", f"ck-{len(cases)}")
        if rel is not None and not (ck / rel).exists():
            (ck / rel).write_text("{}")
        p = _fifo_at(ck, rel or _first_chunk(ck))
        cases.append((str(p), [*argv, str(ck), *(["--quiet"] if argv == ["verify"] else [])]))
    # torch_dist: .metadata, metadata.json, common.pt, a .distcp item file
    for rel in (".metadata", "metadata.json", "common.pt", "__0_0.distcp"):
        td = copy("td", f"td-{rel}")
        p = _fifo_at(td / ITER, rel)
        cases.append((str(p), ["reshard", str(td), out, "--hf-config", str(good["hf"]), "--quiet"]))
    td = copy("td", "td-sidecar")  # shardkit's own sidecar of a torch_dist export
    cases.append((str(_fifo_at(td / ITER, "shardkit.json")), ["inspect", str(td)]))
    hf = copy("hf", "hf-config-flag")  # --hf-config naming a directory whose config.json is a FIFO
    cases.append((str(_fifo_at(hf, "config.json")), ["reshard", str(good["td"]), out, "--hf-config", str(hf),
                                                     "--quiet"]))
    ck = copy("ck", "ck-export")  # a chunk read by an export that skips the up-front check
    cases.append((str(_fifo_at(ck, _first_chunk(ck))), ["convert", "mcore-to-hf", str(ck), out, "--skip-verify",
                                                        "--quiet"]))
    data = tmp / "data-fifo"  # a training corpus whose .idx is a FIFO
    for ext in (".bin", ".idx"):
        shutil.copy(f"{good['data']}{ext}", f"{data}{ext}")
    cases.append((str(_fifo_at(tmp, "data-fifo.idx")), [
        "continue-pretrain", "--load", str(good["ck"]), "--data-path", str(data), "--save", out, "--seq-length", "16",
        "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "1"]))
    os.mkfifo(tmp / "in.jsonl")  # preprocess-data --input
    cases.append((str(tmp / "in.jsonl"), ["preprocess-data", "--input", str(tmp / "in.jsonl"), "--tokenizer",
                                          str(good["hf"]), "--output-prefix", f"{out}/d", "--quiet"]))
    ck = copy("ck", "ck-train-state")  # a training resume reading train_state.json
    (ck / ITER / "train_state.json").write_text("{}")
    cases.append((str(_fifo_at(ck, f"{ITER}/train_state.json")), [
        "continue-pretrain", "--load", str(ck), "--data-path", str(good["data"]), "--save", out, "--seq-length", "16",
        "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "1"]))
    os.mkfifo(tmp / "cfg.toml")  # continue-pretrain's --config, directly and through launch
    cases.append((str(tmp / "cfg.toml"), ["continue-pretrain", "--config", str(tmp / "cfg.toml"), "--load",
                                          str(good["ck"]), "--data-path", str(good["data"]), "--train-iters", "1"]))
    cases.append((str(tmp / "cfg.toml"), ["launch", "--layout", "tp=1,pp=1,dp=8", "--nodes", "1", "--dry-run", "--",
                                          "--config", str(tmp / "cfg.toml"), "--load", str(good["ck"]), "--save",
                                          out]))
    (tmp / "run").mkdir()  # plot's metrics.jsonl
    os.mkfifo(tmp / "run" / "metrics.jsonl")
    cases.append((str(tmp / "run" / "metrics.jsonl"), ["plot", str(tmp / "run"), "-o", f"{out}.png"]))
    (tmp / "in-ok.jsonl").write_text('{"text": "hello"}\n')  # preprocess-data --tokenizer: its tokenizer.json
    tok = copy("hf", "hf-tokenizer")
    cases.append((str(_fifo_at(tok, "tokenizer.json")), ["preprocess-data", "--input", str(tmp / "in-ok.jsonl"),
                                                         "--tokenizer", str(tok), "--output-prefix", f"{out}/t",
                                                         "--quiet"]))
    legacy = tmp / "legacy-rank-fifo"  # a Megatron-LM legacy rank file
    (legacy / "iter_0000001" / "mp_rank_00").mkdir(parents=True)
    (legacy / "latest_checkpointed_iteration.txt").write_text("1")
    os.mkfifo(legacy / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt")
    cases.append((str(legacy / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt"), [
        "convert", "megatron-to-mcore", str(legacy), out, "--hf-config", str(good["hf"]), "--quiet"]))
    return cases


def test_fifos_and_devices_as_inputs_never_block(good, tmp_path):
    """A FIFO where any reader expects a regular file (HF config.json, weights, index and shard; a native manifest,
    zarr.json, chunk, train_state.json; torch_dist .metadata, metadata.json, common.pt, a .distcp file), or a link to
    /dev/zero as config.json: one line naming it, non-zero exit, no hang (one subprocess under a timeout and an
    address-space cap), nothing written."""
    cases = _fifo_cases(tmp_path, good)
    results = _run_cases(cases, 300)
    assert len(results) == len(cases) >= 16
    for (path, argv), (rc, err) in zip(cases, results):
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert rc == 1 and len(lines) == 1 and lines[0].startswith("shardkit: error:"), (argv, err)
        assert path in lines[0] or Path(path).name in lines[0], (path, lines[0])
        assert "missing" not in lines[0] or "regular" in lines[0], lines[0]  # a FIFO is not "missing"
    assert not (tmp_path / "never").exists()


def _td_iteration_linked_out(c: Case) -> Path:
    """A torch_dist root whose iteration directory is a symlink to another checkpoint's iteration."""
    victim = c.copy("td")
    root = c.tmp / "linked"
    root.mkdir()
    shutil.copy(victim / "latest_checkpointed_iteration.txt", root)
    (root / ITER).symlink_to(victim / ITER)
    return root


def _hash_tree(root: Path) -> dict[str, str]:
    import hashlib

    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(root.rglob("*"))}


LINKED_OUT: list[tuple[str, Callable[[Case], tuple[list, Path]], tuple[str, ...]]] = [
    # readers: a torch_dist iteration linked out of its root is refused (as the native reader refuses it)
    ("td-iter-link-inspect", lambda c: (["inspect", _td_iteration_linked_out(c)], c.tmp / "td"),
     ("symlink", "outside")),
    ("td-iter-link-verify", lambda c: (["verify", _td_iteration_linked_out(c), "--hf-config", c.good["hf"],
                                        "--quiet"], c.tmp / "td"), ("symlink", "outside")),
    # reshard through it over the very iteration it links to: the source was destroyed before issue 34
    ("td-iter-link-reshard-onto-target", lambda c: (["reshard", _td_iteration_linked_out(c), c.tmp / "td",
                                                     "--format", "torch_dist", "--overwrite", "--hf-config",
                                                     c.good["hf"], "--quiet"], c.tmp / "td"), ("symlink", "outside")),
    ("td-iter-link-export", lambda c: (["convert", "mcore-to-hf", _td_iteration_linked_out(c), c.out,
                                        "--hf-config", c.good["hf"], "--quiet"], c.tmp / "td"),
     ("symlink", "outside")),
    # writers: an iteration (or its .partial) in the output that is a link elsewhere is never written through
    ("dst-iter-link-native", lambda c: _dst_linked(c, "ck", ITER, ["reshard", c.good["ck"], c.out, "--tp", "2",
                                                                   "--overwrite", "--quiet"]), ("symlink", ITER)),
    ("dst-iter-link-torch_dist", lambda c: _dst_linked(c, "td", ITER, [
        "convert", "hf-to-mcore", c.good["hf"], c.out, "--format", "torch_dist", "--overwrite", "--quiet"]),
     ("symlink", ITER)),
    ("dst-partial-link", lambda c: _dst_linked(c, "ck", ITER + ".partial", [
        "convert", "hf-to-mcore", c.good["hf"], c.out, "--overwrite", "--quiet", "--no-verify"]),
     ("symlink", ".partial")),
    # a checkpoint's hf/ (its side files) linked out of the iteration: refused by the source check, nothing carried
    ("ck-hf-link-out-reshard", lambda c: (["reshard", _hf_linked_out(c), c.out, "--tp", "2", "--quiet"],
                                          c.tmp / "outside_hf"), ("hf", "symlink", "outside")),
    ("ck-hf-link-out-export", lambda c: (["convert", "mcore-to-hf", _hf_linked_out(c), c.out, "--quiet"],
                                         c.tmp / "outside_hf"), ("hf", "symlink", "outside")),
    # a native write into a root holding a torch_dist checkpoint: its tracker would still win every read
    ("native-over-torch_dist-root", lambda c: (["reshard", c.good["ck"], c.copy("td"), "--overwrite", "--quiet"],
                                               c.tmp / "td"), ("latest_checkpointed_iteration.txt", "torch_dist")),
]


def _hf_linked_out(c: Case) -> Path:
    ck = c.copy("ck")
    shutil.move(ck / ITER / "hf", c.tmp / "outside_hf")
    (ck / ITER / "hf").symlink_to(c.tmp / "outside_hf")
    return ck


def _dst_linked(c: Case, key: str, name: str, argv: list) -> tuple[list, Path]:
    """An output root whose `name` entry is a symlink to a copy of a good checkpoint's iteration (the victim)."""
    victim = c.copy(key)
    c.out.mkdir()
    if (victim / "latest").exists() or key == "ck":
        (c.out / "latest").write_text(ITER + "\n")
    else:
        (c.out / "latest_checkpointed_iteration.txt").write_text("0\n")
    (c.out / name).symlink_to(victim / ITER)
    return argv, victim


@pytest.mark.parametrize("build,words", [(b, w) for _, b, w in LINKED_OUT], ids=[i for i, _, _ in LINKED_OUT])
def test_links_out_of_a_root_are_never_followed(good, tmp_path, capsys, build, words):
    c = Case(tmp_path, good)
    argv, victim = build(c)
    before = _hash_tree(victim)
    rc, lines = run(argv, capsys)  # tests/test_user_files.py's: the exit status and stderr's non-blank lines
    err = "\n".join(lines)
    assert rc == 1 and len(lines) == 1 and lines[0].startswith("shardkit: error:"), err
    for w in words:
        assert w in lines[0], f"{w!r} not named in: {lines[0]}"
    assert _hash_tree(victim) == before, "the linked-to checkpoint changed"


def _both_weights(c: Case) -> Path:
    """An HF directory with model.safetensors AND an index naming two other shards holding different weights."""
    from safetensors.torch import load_file, save_file

    hf = c.copy("hf")
    sd = load_file(str(hf / "model.safetensors"))
    names = sorted(sd)
    halves = (names[: len(names) // 2], names[len(names) // 2:])
    wm = {}
    for i, part in enumerate(halves):
        shard = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({n: sd[n] * 2 for n in part}, str(hf / shard), metadata={"format": "pt"})
        wm.update({n: shard for n in part})
    (hf / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    return hf


BOTH: list[tuple[str, Callable[[Case], list]]] = [
    ("convert", lambda c: _convert(c, _both_weights(c))),
    ("convert-torch_dist", lambda c: _convert(c, _both_weights(c), "--format", "torch_dist")),
    ("verify-whole", lambda c: ["verify", c.good["ck"], "--against", _both_weights(c), "--quiet"]),
    ("verify-streaming", lambda c: ["verify", c.good["ck"], "--against", _both_weights(c), "--streaming",
                                    "--quiet"]),
    ("single-is-a-dangling-link", lambda c: (lambda hf: ((hf / "model.safetensors").unlink(),
                                                          (hf / "model.safetensors").symlink_to(c.tmp / "gone"),
                                                          _convert(c, hf))[-1])(_both_weights(c))),
]


@pytest.mark.parametrize("build", [b for _, b in BOTH], ids=[i for i, _ in BOTH])
def test_single_file_and_sharded_index_together_are_refused(good, tmp_path, capsys, build):
    """transformers loads model.safetensors and ignores the index then; converting or verifying the index's shards
    would be another model: one line naming both, in every reader (conversion and both verify modes)."""
    c = Case(tmp_path, good)
    argv = [str(a) for a in build(c)]
    capsys.readouterr()
    rc = main(argv)
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert rc == 1 and len(lines) == 1, lines
    assert "model.safetensors" in lines[0] and "model.safetensors.index.json" in lines[0], lines[0]
    assert not c.out.exists()


def test_an_index_naming_only_model_safetensors_is_not_ambiguous(good, tmp_path, capsys):
    """The same file twice (an index whose only shard is model.safetensors) is one set of weights: converted."""
    from safetensors import safe_open

    c = Case(tmp_path, good)
    hf = c.copy("hf")
    with safe_open(str(hf / "model.safetensors"), "np") as f:
        names = list(f.keys())
    (hf / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: "model.safetensors" for n in names}}))
    assert main([str(a) for a in _convert(c, hf, "--no-verify")]) == 0


# -- issue 34 (e): bounded parsing: JSON nested past the recursion limit, a deflate bomb of a common.pt, pickle-only
# weights in the whole-model verify: one line naming the file ------------------------------------------------------

DEEP = "[" * 100000 + "]" * 100000  # json's C scanner recurses once per level: past Python's limit
DEEP_OBJ = '{"a":' * 100000 + "1" + "}" * 100000


def _deep(c: Case, key: str, rel: str, argv: Callable[[Case, Path], list], text: str = DEEP) -> list:
    root = c.copy(key)
    p = root / rel
    p.unlink(missing_ok=True)
    p.write_text(text)
    return argv(c, root)


NESTED: list[tuple[str, str, str, Callable[[Case, Path], list], str, str]] = [
    # (id, input, file, command, text, the name the line must carry)
    ("manifest", "ck", f"{ITER}/manifest.json", lambda c, r: ["verify", r, "--quiet"], DEEP, "manifest.json"),
    ("manifest-object", "ck", f"{ITER}/manifest.json", lambda c, r: ["inspect", r], DEEP_OBJ, "manifest.json"),
    ("zarr-json", "ck", f"{ITER}/model/{TENSOR}/zarr.json", lambda c, r: ["verify", r, "--quiet"], DEEP, TENSOR),
    ("td-metadata-json", "td", f"{ITER}/metadata.json", lambda c, r: _reshard_td(c, r), DEEP, "metadata.json"),
    ("td-sidecar", "td", f"{ITER}/shardkit.json", lambda c, r: ["inspect", r], DEEP_OBJ, "shardkit.json"),
    ("hf-config", "hf", "config.json", lambda c, r: _convert(c, r), DEEP_OBJ, "config.json"),
    ("hf-index", "hf", "model.safetensors.index.json", lambda c, r: _convert(c, r), DEEP, "index.json"),
    ("verify-against-config", "hf", "config.json",
     lambda c, r: ["verify", c.good["ck"], "--against", r, "--quiet"], DEEP_OBJ, "config.json"),
]


@pytest.mark.parametrize("case", [n[0] for n in NESTED])
def test_deeply_nested_json_is_one_line(good, tmp_path, capsys, case):
    _, key, rel, argv, text, name = next(n for n in NESTED if n[0] == case)
    c = Case(tmp_path, good)
    args = [str(a) for a in _deep(c, key, rel, argv, text)]
    capsys.readouterr()
    rc = main(args)
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc not in (0, None) and len(lines) == 1 and lines[0].startswith("shardkit: error:"), err
    assert name in lines[0], lines[0]
    assert "Traceback" not in err and "RecursionError" not in err


def test_deeply_nested_safetensors_header_and_jsonl(good, tmp_path, capsys):
    c = Case(tmp_path, good)
    hf = c.copy("hf")
    raw = DEEP.encode()
    (hf / "model.safetensors").write_bytes(len(raw).to_bytes(8, "little") + raw)
    capsys.readouterr()
    assert main([str(a) for a in _convert(c, hf)]) == 1
    line = capsys.readouterr().err.strip()
    assert line.startswith("shardkit: error:") and "model.safetensors" in line and "\n" not in line, line
    (tmp_path / "deep.jsonl").write_text('{"text": "fine"}\n' + DEEP_OBJ.replace('"a"', '"text"') + "\n")
    rc = main(["preprocess-data", "--input", str(tmp_path / "deep.jsonl"), "--tokenizer", str(good["hf"]),
               "--output-prefix", str(tmp_path / "d"), "--quiet"])
    line = capsys.readouterr().err.strip()
    assert rc == 1 and "deep.jsonl line 2" in line and "\n" not in line, line


def _bomb(path: Path, inflated: int) -> None:
    """A common.pt whose data.pkl record is `inflated` zero bytes, deflated (a few KB per MB)."""
    import zipfile

    path.unlink()
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        with z.open("archive/data.pkl", "w", force_zip64=True) as f:
            block = bytes(1 << 20)
            for _ in range(inflated >> 20):
                f.write(block)


@pytest.mark.parametrize("cmd", ["inspect", "reshard", "verify"])
def test_compressed_common_pt_is_bounded_before_reading(good, tmp_path, capsys, monkeypatch, cmd):
    from checkpoint import torch_dist_pickle

    monkeypatch.setattr(torch_dist_pickle, "COMMON_MAX", 4 << 20)  # (the real bound is 256 MiB: the same code path)
    c = Case(tmp_path, good)
    td = c.copy("td")
    _bomb(td / ITER / "common.pt", 8 << 20)
    assert (td / ITER / "common.pt").stat().st_size < 64 << 10
    argv = {"inspect": ["inspect", td], "reshard": _reshard_td(c, td), "verify": ["verify", td, "--quiet"]}[cmd]
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    line = capsys.readouterr().err.strip()
    assert rc == 1 and "common.pt" in line and "inflate" in line and "\n" not in line, line


def test_common_pt_bound_holds_without_a_patch(good, tmp_path):
    """The real bound, on a real 300 MiB bomb (300 KB on disk): refused from its directory alone."""
    from checkpoint.errors import FormatError
    from checkpoint.torch_dist_pickle import COMMON_MAX, _check_common_size

    p = tmp_path / "common.pt"
    p.write_bytes(b"")
    _bomb(p, COMMON_MAX + (44 << 20))
    assert p.stat().st_size < 1 << 20
    with pytest.raises(FormatError, match="inflate"):
        _check_common_size(p)


@pytest.mark.parametrize("streaming", [False, True])
def test_pickle_only_hf_dir_in_verify_is_one_line(good, tmp_path, capsys, streaming):
    import torch
    from safetensors.torch import load_file

    c = Case(tmp_path, good)
    hf = c.copy("hf")
    torch.save(load_file(str(hf / "model.safetensors")), hf / "pytorch_model.bin")
    (hf / "model.safetensors").unlink()
    capsys.readouterr()
    rc = main(["verify", str(good["ck"]), "--against", str(hf), "--quiet", *(["--streaming"] if streaming else [])])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert rc == 1 and len(lines) == 1 and "pytorch_model.bin" in lines[0] or "pickle" in lines[0], err
    assert "safetensors" in lines[0]


# -- issue 34 (f): a data sidecar is checked against the data it describes, and every sample read is checked too --

def _data_beyond_vocab(c: Case) -> Path:
    """A corpus whose largest token id (450) is beyond the tiny model's vocabulary (300), with its sidecar."""
    from train.data.indexed import IndexedDataset, write_indexed
    from train.data.stats import token_stats

    rng = np.random.default_rng(1)
    docs = [rng.integers(3, 200, size=40) for _ in range(64)]
    docs[5][7] = 450
    prefix = c.tmp / "beyond"
    write_indexed(prefix, docs, np.uint16)
    token_stats(IndexedDataset(prefix))  # the sidecar, as a first run caches it
    return prefix


def _edit_sidecar(prefix: Path, redigest: bool, **changes) -> None:
    from train.data.stats import _sidecar_digest, sidecar_path

    p = sidecar_path(str(prefix) + ".bin")
    rec = json.loads(p.read_text())
    rec.update(changes)
    if redigest:
        rec["digest"] = _sidecar_digest(rec)
    p.write_text(json.dumps(rec))


SIDECAR_EDITS = {
    "lowered-max": dict(redigest=False, max_token_id=100),
    "lowered-max-no-digest": dict(redigest=False, max_token_id=100, digest=None),
    "lowered-max-old-format": dict(redigest=False, max_token_id=100, bin_ino=None, bin_ctime_ns=None),
    "max-as-bool": dict(redigest=True, max_token_id=True),
    "forged-digest": dict(redigest=True, max_token_id=100),  # an editor who recomputes it: each sample is checked
    "stale-identity": dict(redigest=True, max_token_id=100, bin_ino=1),
}


@pytest.mark.parametrize("edit", list(SIDECAR_EDITS))
def test_edited_data_sidecar_is_not_trusted(good, tmp_path, capsys, edit):
    c = Case(tmp_path, good)
    prefix = _data_beyond_vocab(c)
    _edit_sidecar(prefix, **SIDECAR_EDITS[edit])
    argv = _train(c, good["ck"])
    argv[argv.index("--data-path") + 1] = prefix
    argv[argv.index("--train-iters") + 1] = "40"  # (every sample is read: the bad one is among them)
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip() and "shardkit: error:" in ln]
    assert rc not in (0, None) and lines and "Traceback" not in err and "IndexError" not in err, err
    assert "beyond.bin" in lines[0] and "450" in lines[0] and "vocabulary of 300" in lines[0], lines[0]
    assert not list(c.out.glob("iter_*/manifest.json"))


def test_sidecar_of_an_unchanged_bin_is_still_used(good, tmp_path, monkeypatch):
    """The cache still works (no pass over the tokens) where the sidecar matches its .bin; a copy of the .bin (new
    inode) is recomputed once and cached again."""
    from train.data import indexed, stats

    c = Case(tmp_path, good)
    prefix = _data_beyond_vocab(c)
    passes = {"n": 0}
    real = stats.write_token_stats
    monkeypatch.setattr(stats, "write_token_stats", lambda *a, **k: (passes.__setitem__("n", passes["n"] + 1),
                                                                     real(*a, **k))[1])
    assert stats.token_stats(indexed.IndexedDataset(prefix))["max_token_id"] == 450 and passes["n"] == 0
    copy = tmp_path / "copy"
    shutil.copy2(str(prefix) + ".bin", str(copy) + ".bin")
    shutil.copy2(str(prefix) + ".idx", str(copy) + ".idx")
    shutil.copy2(stats.sidecar_path(str(prefix) + ".bin"), stats.sidecar_path(str(copy) + ".bin"))
    assert stats.token_stats(indexed.IndexedDataset(copy))["max_token_id"] == 450 and passes["n"] == 1
    assert stats.token_stats(indexed.IndexedDataset(copy))["max_token_id"] == 450 and passes["n"] == 1


def _hub_snapshot(root: Path, repo: str, hf: Path) -> Path:
    """An HF hub cache repo as huggingface_hub lays it out: snapshots/<rev>/<name> -> ../../blobs/<hash>."""
    import hashlib

    base = root / f"models--{repo.replace('/', '--')}"
    snap = base / "snapshots" / ("0" * 40)
    (base / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in hf.iterdir():
        if f.is_file():
            data = f.read_bytes()
            blob = base / "blobs" / hashlib.sha256(data).hexdigest()
            blob.write_bytes(data)
            (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    return snap


@pytest.mark.parametrize("target", ["other-repo-blob", "outside-cache"])
@pytest.mark.parametrize("cmd", ["convert", "verify-against"])
def test_hub_config_linking_out_of_its_repo_is_refused(good, tmp_path, capsys, target, cmd):
    hub = tmp_path / "hub"
    mine = _hub_snapshot(hub, "org/mine", good["hf"])
    other = _hub_snapshot(hub, "org/other", good["hf"])
    cfg = json.loads((good["hf"] / "config.json").read_text())
    cfg["rms_norm_eps"] = 0.5  # another model's config (the same shapes)
    if target == "other-repo-blob":
        dest = os.path.realpath(other / "config.json")
        os.chmod(dest, 0o644)
        Path(dest).write_text(json.dumps(cfg))
    else:
        dest = tmp_path / "elsewhere.json"
        dest.write_text(json.dumps(cfg))
    (mine / "config.json").unlink()
    (mine / "config.json").symlink_to(os.path.relpath(dest, mine))
    out = tmp_path / "out"
    argv = (["convert", "hf-to-mcore", str(mine), str(out), "--quiet"] if cmd == "convert"
            else ["verify", str(good["ck"]), "--against", str(mine), "--quiet"])
    capsys.readouterr()
    rc = main(argv)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert rc == 1 and len(lines) == 1 and "config.json" in lines[0] and "symlink" in lines[0], err
    assert not (out / "latest").exists()


def test_hub_config_linking_into_its_own_blobs_is_read(good, tmp_path, capsys):
    mine = _hub_snapshot(tmp_path / "hub", "org/mine", good["hf"])
    assert main(["convert", "hf-to-mcore", str(mine), str(tmp_path / "out"), "--quiet", "--no-verify"]) == 0


def test_torch_dist_import_resumed_after_a_distcp_changed_converts_afresh(good, tmp_path, monkeypatch):
    """reshard of a torch_dist source, interrupted; then one .distcp is replaced by another model's (the same layout:
    .metadata unchanged, every item's CRC valid): the rerun converts afresh, equal to a fresh import."""
    from checkpoint.reader import Checkpoint
    from convert import torch_dist_io
    from shardkit.demo import build_tiny_llama

    c = Case(tmp_path, good)
    td = c.copy("td")
    other_hf = build_tiny_llama(tmp_path / "other-hf", seed=7, **TINY)
    other = tmp_path / "other-td"
    assert main(["convert", "hf-to-mcore", str(other_hf), str(other), "--format", "torch_dist", "--quiet",
                 "--no-verify"]) == 0
    real = torch_dist_io._ImportWorker.__call__
    calls = {"n": 0}

    def flaky(self, task):
        calls["n"] += 1
        if calls["n"] == 6:
            raise KeyboardInterrupt
        return real(self, task)

    monkeypatch.setattr(torch_dist_io._ImportWorker, "__call__", flaky)
    out = tmp_path / "out"
    assert main(["reshard", str(td), str(out), "--quiet", "--workers", "1"]) != 0
    monkeypatch.setattr(torch_dist_io._ImportWorker, "__call__", real)
    assert list(out.glob("*.partial"))
    swapped = [*sorted((td / ITER).glob("*.distcp")), td / ITER / "shardkit.json"]
    for f in swapped:  # every rank file of the other model (and its item record), .metadata and common.pt kept
        shutil.copyfile(other / ITER / f.name, f)
    assert main(["reshard", str(td), str(out), "--quiet", "--workers", "1"]) == 0
    fresh = tmp_path / "fresh"
    assert main(["reshard", str(td), str(fresh), "--quiet"]) == 0
    a, b = Checkpoint(out), Checkpoint(fresh)
    for name in a.tensors:
        assert np.array_equal(a.read_numpy(name), b.read_numpy(name)), name
