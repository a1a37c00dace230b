"""shardkit.json, shardkit's own file beside Megatron's in a torch_dist iteration it exported: the model config (with
the true vocab), layout, dtype, provenance and each item's data CRC, under a digest; written by the exporters, read
back (checked) by checkpoint/torch_dist.py so that no flags are needed."""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path

from . import store
from .commit import write_file_atomic
from .config import ModelConfig
from .errors import ConfigError, FormatError, LayoutError
from .layout import Layout
from .megatron import KEY_NAMINGS
from .safety import read_input, safe_path, sha256_file
from .torch_dist_pickle import DCP_METADATA, _load_metadata_light

# shardkit's own files beside Megatron's in an iteration it exported (Megatron-LM and megatron-core read only the
# files they name): the model config, layout, dtype and provenance, and the HF config.json + tokenizer files.
SIDECAR = "shardkit.json"
SIDECAR_FORMAT = "shardkit-torch_dist"
SIDECAR_VERSION = 1
SIDECAR_MAX = 16 << 20  # bytes; a larger shardkit.json is damage or hostile


# -- shardkit.json ----------------------------------------------------------------------------------------------------

def _digest(body: dict) -> str:
    import hashlib

    return "sha256:" + hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def write_sidecar(directory: Path, *, iteration: int, model: ModelConfig, layout: Layout, dtype: str,
                  key_naming: str, optimizer: list[str] | None, provenance: dict) -> None:
    """shardkit.json: what shardkit needs to read the export back with no flags (docs/FORMAT.md)."""
    body = {"format": SIDECAR_FORMAT, "format_version": SIDECAR_VERSION, "iteration": iteration,
            "model": model.to_dict(), "layout": layout.to_dict(),
            "vocab": {"size": model.vocab_size, "padded_size": model.padded_vocab_size(layout.tp),
                      "divisible_by": model.make_vocab_size_divisible_by},
            "dtype": dtype, "key_naming": key_naming, "optimizer": list(optimizer) if optimizer else None,
            "provenance": provenance}
    items = _item_data_crcs(Path(directory))
    if items:
        body["items"] = items
    files = {n: _file_digest(Path(directory) / n) for n in SIDECAR_FILES if (Path(directory) / n).is_file()}
    if files:  # common.pt's pickled args have no checksum of their own that any reader checks
        body["files"] = files
    body["digest"] = _digest(body)
    write_file_atomic(Path(directory) / SIDECAR, json.dumps(body, indent=1) + "\n")


SIDECAR_FILES = ("common.pt",)  # small files beside the items whose SHA-256 shardkit.json records (`files`)


def _file_digest(path: Path) -> str:
    return "sha256:" + sha256_file(path)  # (a regular file only: a FIFO there is one line naming it)


def check_files(iter_dir: Path, sidecar: dict | None) -> None:
    """Each file shardkit.json's `files` records (common.pt) still has the SHA-256 recorded there: a flipped byte in
    common.pt's pickled args (its layernorm_epsilon, say) read as a valid checkpoint of another model. FormatError
    naming the file."""
    for name, want in ((sidecar or {}).get("files") or {}).items():
        path = Path(iter_dir) / name
        got = _file_digest(path)  # (missing or unreadable: one FormatError naming it)
        if got != want:
            raise FormatError(f"{path}: its SHA-256 is not the one {SIDECAR} recorded ({got[7:19]}..., recorded "
                              f"{want[7:19]}...): the file was changed after the save; the checkpoint is damaged")


def item_key(name: str, offsets) -> str:
    """An item's name in shardkit.json's `items`: the DCP key and its global offsets (`key@0,128,0`)."""
    return name if offsets is None else f"{name}@{','.join(str(int(o)) for o in offsets)}"


def _item_data_crcs(directory: Path) -> dict[str, int]:
    """The CRC-32 of every tensor item's data record (data/0), as its own zip directory records it, by item_key:
    written into shardkit.json once `.metadata` and the rank files are in `directory`, so that a reader finds an
    item whose storage entry was swapped with another of the same shape and dtype (each passes its own CRCs; only
    this record says which bytes belong to which key). One read of each item's last KiB; {} where `.metadata` is
    not there or not plain."""
    md = _load_metadata_light(directory / DCP_METADATA)
    if md is None or not isinstance(getattr(md, "storage_data", None), dict):
        return {}
    out: dict[str, int] = {}
    fds: dict[str, int] = {}
    try:
        for idx, info in md.storage_data.items():
            if idx.offset is None:  # a bytes object: no tensor data
                continue
            rel = info.relative_path
            if rel not in fds:
                fds[rel] = os.open(directory / rel, os.O_RDONLY)
            n = min(int(info.length), 4096)
            tail = os.pread(fds[rel], n, int(info.offset) + int(info.length) - n)
            crc = _recorded_crc(tail, int(info.length), "data/0")
            if crc is not None:
                out[item_key(idx.fqn, idx.offset)] = crc
    except OSError:
        return {}
    finally:
        for fd in fds.values():
            os.close(fd)
    return out


def _recorded_crc(tail: bytes, length: int, record: str) -> int | None:
    """The CRC-32 the zip directory in `tail` (the last bytes of an archive of `length` bytes) records for the record
    whose name ends with `record`; None where the directory is not inside `tail`."""
    try:
        if len(tail) < 22 or tail[-22:-18] != b"PK\x05\x06":
            return None
        n, cd_size, cd_off = struct.unpack_from("<HII", tail, len(tail) - 12)
        if cd_off == 0xFFFFFFFF or n == 0xFFFF:
            z = len(tail) - 22 - 20 - 56
            if z < 0 or tail[z:z + 4] != b"PK\x06\x06":
                return None
            n, cd_size, cd_off = struct.unpack_from("<QQQ", tail, z + 32)
        pos = cd_off - (length - len(tail))
        if pos < 0:
            return None
        for _ in range(n):
            if tail[pos:pos + 4] != b"PK\x01\x02":
                return None
            crc, = struct.unpack_from("<I", tail, pos + 16)
            nlen, xlen, clen = struct.unpack_from("<HHH", tail, pos + 28)
            if tail[pos + 46:pos + 46 + nlen].decode("utf-8", "replace").endswith(record):
                return crc
            pos += 46 + nlen + xlen + clen
    except (struct.error, ValueError):
        return None
    return None


def load_sidecar(iter_dir: Path) -> dict | None:
    """The shardkit.json of an iteration (None when there is none), checked: a regular file of bounded size, strict
    JSON, our format and version, the digest, a bounded model config and a layout that fits it, the vocab and key
    naming consistent. `model` and `layout` come back as ModelConfig and Layout."""
    p = Path(iter_dir) / SIDECAR
    if not os.path.lexists(p):
        return None
    safe_path(iter_dir, SIDECAR, f"{iter_dir}: {SIDECAR}")
    if not p.is_file():
        raise FormatError(f"{p}: not a regular file")
    size = p.stat().st_size
    if size > SIDECAR_MAX:
        raise FormatError(f"{p}: {size:,} bytes, more than a {SIDECAR}'s {SIDECAR_MAX:,}; refusing it")
    try:
        d = json.loads(read_input(p, limit=SIDECAR_MAX, text=False))
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise FormatError(f"{p}: not valid JSON ({e}); the checkpoint is damaged") from None
    if not isinstance(d, dict) or d.get("format") != SIDECAR_FORMAT or d.get("format_version") != SIDECAR_VERSION:
        got = (d.get("format"), d.get("format_version")) if isinstance(d, dict) else type(d).__name__
        raise FormatError(f"{p}: format {got!r} is not {SIDECAR_FORMAT!r} version {SIDECAR_VERSION}")
    digest = d.pop("digest", None)
    if digest != _digest(d):
        raise FormatError(f"{p}: digest mismatch; the file was edited or damaged")
    try:
        model = ModelConfig.from_dict(d["model"])
        layout = Layout.from_dict(d["layout"])
        layout.check(model)
        vocab = d["vocab"]
        want = {"size": model.vocab_size, "padded_size": model.padded_vocab_size(layout.tp),
                "divisible_by": model.make_vocab_size_divisible_by}
        if vocab != want:
            raise FormatError(f"vocab {vocab} disagrees with the model config ({want})")
        if d["key_naming"] not in KEY_NAMINGS or not isinstance(d["dtype"], str) or d["dtype"] not in store.NP_DTYPES:
            raise FormatError(f"key_naming {d['key_naming']!r} / dtype {d['dtype']!r} unknown")
        if not isinstance(d.get("provenance"), dict):
            raise FormatError("provenance is not an object")
        items = d.get("items", {})
        if not isinstance(items, dict) or not all(isinstance(k, str) and isinstance(v, int) and not isinstance(
                v, bool) and 0 <= v < 1 << 32 for k, v in items.items()):
            raise FormatError("items is not an object of CRC-32s")
        files = d.get("files", {})
        if not isinstance(files, dict) or not all(k in SIDECAR_FILES and isinstance(v, str) and v.startswith(
                "sha256:") and len(v) == 71 for k, v in files.items()):
            raise FormatError("files is not an object of SHA-256 digests of " + ", ".join(SIDECAR_FILES))
    except (FormatError, ConfigError, LayoutError) as e:
        raise FormatError(f"{p}: {str(e).removeprefix('manifest: ')}") from None
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise FormatError(f"{p}: malformed ({type(e).__name__}: {e})") from None
    return {**d, "model": model, "layout": layout}
