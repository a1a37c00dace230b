"""Megatron-LM `--ckpt-format torch_dist` checkpoints (PyTorch DCP underneath), read and written without Megatron.

    <root>/latest_checkpointed_iteration.txt     "N" (or "release")
    <root>/iter_000000N/metadata.json            {"sharded_backend": "torch_dist", ...}
    <root>/iter_000000N/common.pt                torch.save of the non-sharded state (iteration, args, ...)
    <root>/iter_000000N/.metadata                pickled torch.distributed.checkpoint.metadata.Metadata
    <root>/iter_000000N/__<rank>_<k>.distcp      items: each a torch.save(tensor) blob at an offset
    <root>/iter_000000N/shardkit.json            (shardkit's exports) model config incl. the true vocab, layout,
                                                 dtype, provenance: read back with no flags
    <root>/iter_000000N/hf/                      (shardkit's exports) config.json + tokenizer / generation files

Reading never runs pickle code it does not know: `.metadata` goes through an unpickler that resolves only DCP's own
metadata classes (anything else is refused, naming the file and the global); items and `common.pt` go through
checkpoint.safe_load (`torch.load(weights_only=True)` under its short allowlist). File names in
the metadata are checked before any file is opened (plain names inside the iteration directory), and every item's
byte range must lie inside its file.

Writing is the inverse with bounded memory: `DCPWriter` appends one item at a time to the file of the rank that owns
it and keeps only the small metadata in memory. The export (convert/torch_dist_io.py) writes them into an
`IterationWriter`'s partial directory and commits it like every other writer (checkpoint/commit.py), the tracker file
last.
"""
from __future__ import annotations

import argparse
import functools
import io
import json
import os
import pickle
import pickletools
import re
import sys
import tempfile
import uuid
import zipfile
from bisect import bisect_left, bisect_right
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import product
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import torch
from torch.distributed.checkpoint import filesystem as _dcp_fs
from torch.distributed.checkpoint import metadata as _dcp_md
from torch.distributed.checkpoint import planner as _dcp_planner

from . import chunkio, store
from .commit import write_file_atomic
from .config import ModelConfig
from .errors import ConfigError, FormatError, LayoutError
from .layout import Layout
from .megatron import (CHECKPOINT_VERSION, KEY_NAMINGS, RELEASE, TRACKER, MegatronEnum, arg, check_args,
                       config_from_megatron_args, hf_model_type_of, iter_dirname, iteration_of, layout_from_args,
                       missing_model_args, with_args_vocab)
from .safe_load import MegatronObject, load_torch
from .safety import read_pointer, safe_path

METADATA_JSON = "metadata.json"
DCP_METADATA = ".metadata"
COMMON_PT = "common.pt"
BACKEND = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
           "common_backend_version": 1}
DCP_VERSION = "1.0.0"
# shardkit's own files beside Megatron's in an iteration it exported (Megatron-LM and megatron-core read only the
# files they name): the model config, layout, dtype and provenance, and the HF config.json + tokenizer files.
SIDECAR = "shardkit.json"
SIDECAR_FORMAT = "shardkit-torch_dist"
SIDECAR_VERSION = 1
SIDECAR_MAX = 16 << 20  # bytes; a larger shardkit.json is damage or hostile
HF_SUBDIR = "hf"
# Items larger than this are spooled to a temporary file and memory-mapped instead of read into memory.
ITEM_MMAP_BYTES = 256 << 20
_FILE_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")


# -- safe unpickling --------------------------------------------------------------------------------------------------

class _MCoreMetadata(_dcp_md.Metadata):
    """Stand-in for megatron-core's pickled `MCoreMetadata` (a DCP Metadata with `mcore_data`): data only."""


class _MCoreSavePlan(_dcp_planner.SavePlan):
    """Stand-in for megatron-core's pickled `MCoreSavePlan`: data only."""


def _layout(name: str) -> torch.layout:
    layouts = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}
    if not isinstance(name, str) or name not in layouts:
        raise pickle.UnpicklingError(f"unknown torch layout {name!r}")
    return layouts[name]


_MD = "torch.distributed.checkpoint.metadata"
_PLANNER = "torch.distributed.checkpoint.planner"
_ALLOWED: dict[tuple[str, str], Any] = {
    **{(_MD, n): getattr(_dcp_md, n) for n in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                               "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                                               "StorageMeta", "_MEM_FORMAT_ENCODING")},
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _dcp_fs._StorageInfo,
    # megatron-core keeps its save plans in the metadata (`all_local_plans`) to reuse them: data classes too
    **{(_PLANNER, n): getattr(_dcp_planner, n) for n in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData",
                                                         "LoadPlan", "ReadItem", "LoadItemType")},
    ("megatron.core.dist_checkpointing.strategies.torch", "MCoreMetadata"): _MCoreMetadata,
    ("megatron.core.dist_checkpointing.strategies.torch", "MCoreSavePlan"): _MCoreSavePlan,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): _layout,
    ("collections", "OrderedDict"): OrderedDict,
}


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only DCP metadata classes, torch.Size, torch dtypes and layouts; every other global is refused."""

    def __init__(self, f, source: str):
        super().__init__(f)
        self.source = source

    def find_class(self, module: str, name: str):
        obj = _ALLOWED.get((module, name))
        if obj is not None:
            return obj
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise FormatError(f"{self.source}: refusing to unpickle {module}.{name}: not a DCP metadata class (the file "
                          "is damaged or was not written by torch.distributed.checkpoint)")

    def persistent_load(self, pid):
        raise FormatError(f"{self.source}: unexpected persistent id in DCP metadata")


def load_dcp_metadata(path: Path) -> _dcp_md.Metadata:
    """Parse a DCP `.metadata` file without running anything but DCP's own data classes."""
    try:
        with open(path, "rb") as f:
            md = _MetadataUnpickler(f, str(path)).load()
    except FormatError:
        raise
    except FileNotFoundError:
        raise FormatError(f"{path}: missing; {path.parent} is not a complete torch_dist checkpoint (DCP writes "
                          ".metadata last)") from None
    except Exception as e:  # truncated or garbage bytes
        raise FormatError(f"{path}: cannot parse DCP metadata ({type(e).__name__}: {e})") from None
    if not isinstance(md, _dcp_md.Metadata):
        raise FormatError(f"{path}: holds a {type(md).__name__}, not DCP Metadata")
    return md


# Globals a Megatron-LM common.pt legitimately references besides plain data (megatron-core's own enums and configs,
# numpy RNG state, paths). When the weights-only load fails on these, common.pt is ignored with a note (it is never
# unpickled); a pickle referencing any other global (os.system, builtins.eval, ...) is refused as hostile.
_BENIGN_GLOBALS = re.compile(
    r"^(megatron\.[\w.]+ \w+"
    r"|argparse Namespace|types SimpleNamespace|pathlib (Posix|Windows|PurePosix|PureWindows)?Path|signal Signals"
    r"|io BytesIO|collections OrderedDict|builtins (set|frozenset|slice|complex|bytearray)|_codecs encode"
    r"|numpy(\._core|\.core)?(\.multiarray)? (_reconstruct|scalar|ndarray|dtype)|numpy\.dtypes \w+DType"
    r"|torch\._utils _rebuild_\w+|torch\._tensor _rebuild_from_type(_v2)?|torch\.serialization _get_layout"
    r"|torch\.nn\.parameter Parameter|torch (Size|device|\w*Storage|u?int\d*|float\w*|bfloat16|half|bool"
    r"|complex\w*))$")


def _pickle_globals(data: bytes) -> list[str]:
    """The globals a pickle references ("module name"), found by scanning its opcodes: nothing is executed."""
    out: list[str] = []
    recent: list = []  # strings pushed (directly or from the memo), for STACK_GLOBAL
    memo: dict = {}
    top = None
    try:
        for op, arg, _ in pickletools.genops(data):
            name = op.name
            if name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE", "BINUNICODE8", "SHORT_BINSTRING", "BINSTRING",
                        "STRING"):
                recent.append(arg)
                top = arg
                continue
            if name in ("MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT"):
                memo[len(memo) if name == "MEMOIZE" else arg] = top
                continue
            if name in ("GET", "BINGET", "LONG_BINGET"):
                top = memo.get(arg)
                recent.append(top)
                continue
            top = None
            if name == "GLOBAL":
                out.append(str(arg).replace("\n", " "))
            elif name == "INST":
                out.append(str(arg))
            elif name == "STACK_GLOBAL":
                mod, attr = (recent[-2], recent[-1]) if len(recent) >= 2 else (None, None)
                out.append(f"{mod} {attr}" if isinstance(mod, str) and isinstance(attr, str) else "<unknown global>")
    except Exception:
        out.append("<unparseable pickle>")
    return out


def _torch_save_pickle(path: Path) -> bytes:
    """The data.pkl record of a torch.save zip file (read as bytes, never unpickled)."""
    with zipfile.ZipFile(path) as z:
        names = [n for n in z.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
        if not names:
            raise FormatError(f"{path}: not a torch.save archive (no data.pkl)")
        return z.read(names[0])


def load_common(path: Path) -> tuple[dict | None, str | None]:
    """common.pt as (dict, None), or (None, note) when it cannot be loaded as plain data but references only benign
    Megatron data classes. Raises FormatError naming the file when it references anything that could run code."""
    if not path.is_file():
        return None, f"{path.name} is missing"
    try:
        obj = load_torch(path)
    except FormatError as e:
        try:
            globs = _pickle_globals(_torch_save_pickle(path))
        except (zipfile.BadZipFile, OSError, KeyError, FormatError) as z:
            raise FormatError(f"{path}: not a readable torch.save file ({type(z).__name__}: {z})") from None
        bad = [g for g in globs if not _BENIGN_GLOBALS.match(g)]
        if bad:
            raise FormatError(f"{path}: refusing to unpickle: it references {bad[0].replace(' ', '.')}, which is not "
                              "plain data (a pickle that would run code); the file was not loaded") from None
        return None, (f"{path.name} ignored: it holds Megatron objects shardkit does not unpickle "
                      f"({str(e).split(': ', 1)[-1][:120]}); iteration and args are taken from elsewhere")
    if not isinstance(obj, dict):
        return None, f"{path.name} ignored: it holds a {type(obj).__name__}, not a dict"
    return obj, None


# -- reading ----------------------------------------------------------------------------------------------------------

@dataclass
class TDTensor:
    """One tensor of a torch_dist checkpoint: global shape, dtype and its stored chunks (offsets, sizes)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    chunks: list[tuple[tuple[int, ...], tuple[int, ...]]]
    _grid: dict | None = field(default=None, repr=False)
    _bounds: list | None = field(default=None, repr=False)
    _sizes: dict | None = field(default=None, repr=False)

    def chunk_size(self, offsets: tuple[int, ...]) -> tuple[int, ...]:
        if self._sizes is None:
            self._sizes = dict(self.chunks)
        return self._sizes[offsets]

    def overlapping(self, box: tuple[tuple[int, int], ...]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """The chunks that intersect a box ([start, stop) per axis)."""
        if self._grid is None:
            self._index()
        if self._grid is False:
            return [c for c in self.chunks if _intersect(c, box) is not None]
        ranges = []
        for (a, b), bounds in zip(box, self._bounds):
            lo = max(0, bisect_right(bounds, a) - 1)
            hi = bisect_left(bounds, b)
            ranges.append(range(lo, max(lo, hi)))
        out = []
        for cell in product(*ranges):
            c = self._grid.get(cell)
            if c is not None and _intersect(c, box) is not None:
                out.append(c)
        return out

    def _index(self) -> None:
        """A cell index when the chunks form a regular grid (Megatron's always do); else linear search."""
        nd = len(self.shape)
        live = [(o, s) for o, s in self.chunks if all(s)]
        bounds = [sorted({0, self.shape[a]} | {o[a] for o, _ in live} | {o[a] + s[a] for o, s in live})
                  for a in range(nd)]
        grid = {}
        for o, s in live:
            cell = []
            for a in range(nd):
                i = bisect_left(bounds[a], o[a])
                if bisect_left(bounds[a], o[a] + s[a]) != i + 1:
                    self._grid = False
                    return
                cell.append(i)
            grid[tuple(cell)] = (o, s)
        self._grid, self._bounds = grid, bounds


def _intersect(chunk, box):
    (off, size) = chunk
    out = []
    for o, s, (a, b) in zip(off, size, box):
        lo, hi = max(o, a), min(o + s, b)
        if lo >= hi:
            return None
        out.append((lo, hi))
    return tuple(out)


def _volume(box) -> int:
    n = 1
    for a, b in box:
        n *= b - a
    return n


class TorchDistCheckpoint:
    """A parsed torch_dist iteration: tensors (name -> TDTensor), bytes objects, common.pt, item reads."""

    def __init__(self, path: str | Path):
        self.path = resolve_torch_dist(path)
        self.notes: list[str] = []
        self._check_backend()
        md = load_dcp_metadata(self.path / DCP_METADATA)
        self.tensors: dict[str, TDTensor] = {}
        self.objects: list[str] = []
        self._storage: dict[tuple[str, tuple[int, ...] | None], _dcp_fs._StorageInfo] = {}
        self._files: dict[str, int] = {}
        try:
            self._validate(md)
        except (TypeError, ValueError, AttributeError) as e:
            raise FormatError(f"{self.path / DCP_METADATA}: malformed DCP metadata ({type(e).__name__}: {e})") from None
        self.common, note = load_common(self.path / COMMON_PT)
        if note:
            self.notes.append(note)
        self.sidecar: dict | None = load_sidecar(self.path)
        self._cache: tuple | None = None
        self.spool_dir: Path | None = None  # where items > ITEM_MMAP_BYTES are copied to be memory-mapped

    # -- basic facts ----------------------------------------------------------------------------------------------
    @property
    def iteration(self) -> int:
        it = (self.common or {}).get("iteration")
        if isinstance(it, int) and not isinstance(it, bool) and it >= 0:
            return it
        it = iteration_of(self.path.name)
        return 0 if it is None else it

    @property
    def args(self) -> argparse.Namespace | None:
        a = (self.common or {}).get("args")
        return a if isinstance(a, argparse.Namespace) else None

    @property
    def layout(self) -> Layout | None:
        """The layout it was saved with: from the Megatron-LM args (None without usable args)."""
        return layout_from_args(self.args)

    def hf_dir(self) -> Path | None:
        """`hf/` of a shardkit export (config.json, tokenizer files), checked to stay inside the iteration; None
        when there is none."""
        p = safe_path(self.path, HF_SUBDIR, f"{self.path}: {HF_SUBDIR}")
        return p if p.is_dir() else None

    def item_file(self, name: str, offsets: tuple[int, ...]) -> str:
        """The `.distcp` file (name inside the iteration directory) that holds one stored chunk of a tensor."""
        return self._storage[(name, offsets)].relative_path

    def files(self) -> dict[str, int]:
        """Every storage file the metadata names, with its size in bytes."""
        return dict(sorted(self._files.items()))

    def model_config(self, hf_config: str | Path | None = None, vocab_size: int | None = None
                     ) -> tuple[ModelConfig, str]:
        """The model config this checkpoint holds, and where it came from: `hf_config` (an HF model directory) when
        given, else the shardkit.json of a shardkit export, else the Megatron-LM args in common.pt (with the true
        `vocab_size` when they hold only the padded one). Whatever the source, Megatron's args must agree with it
        (one line naming the argument and both values). ConfigError naming exactly what is missing, and how to
        supply it, when nothing describes the model."""
        args = self.args
        common = self.path / COMMON_PT
        if vocab_size is not None and (isinstance(vocab_size, bool) or not isinstance(vocab_size, int)
                                       or vocab_size < 1):
            raise ConfigError(f"--vocab-size {vocab_size!r}: expected a positive number of tokens")
        if hf_config is not None:
            cfg, origin = ModelConfig.from_hf_dir(hf_config), f"--hf-config {hf_config}"
        elif self.sidecar is not None:
            cfg, origin = self.sidecar["model"], str(self.path / SIDECAR)
        else:
            if args is None:
                why = next((n for n in self.notes if COMMON_PT in n), f"{common} holds no Megatron args")
                raise ConfigError(f"{self.path}: nothing describes the model: no {SIDECAR} (not exported by shardkit) "
                                  f"and no usable Megatron args ({why}); pass --hf-config HF_DIR (the HF model "
                                  "directory whose config.json describes it)")
            missing = missing_model_args(args, vocab_size)
            if missing:
                padded = arg(args, "padded_vocab_size")
                what = ", ".join(f"{m} (the true vocabulary size; they hold only padded_vocab_size={padded})"
                                 if m == "vocab_size" and padded is not None else m for m in missing)
                how = ("pass --vocab-size N (the true vocabulary size, e.g. the tokenizer's) or --hf-config HF_DIR "
                       "(the HF model directory whose config.json describes the model)" if missing == ["vocab_size"]
                       else "pass --hf-config HF_DIR (the HF model directory whose config.json describes the model); "
                            "--vocab-size N supplies only vocab_size")
                raise ConfigError(f"{common}: its Megatron-LM args lack {what}; {how}")
            cfg = config_from_megatron_args(args, hf_model_type_of(args), vocab_size=vocab_size)
            origin = f"{common} args" + (f" with --vocab-size {vocab_size}" if vocab_size is not None else "")
        if vocab_size is not None and vocab_size != cfg.vocab_size:
            raise ConfigError(f"--vocab-size {vocab_size} contradicts {origin}, which has vocab_size={cfg.vocab_size}")
        if args is not None:
            tp = (self.layout or Layout()).tp
            label = f"{common}"
            cfg = with_args_vocab(cfg, args, tp, label, origin)
            check_args(args, cfg, label, origin)
        return cfg, origin

    def _check_backend(self) -> None:
        p = self.path / METADATA_JSON
        if not p.is_file():
            raise FormatError(f"{p}: missing; {self.path} is not a Megatron torch_dist checkpoint")
        try:
            d = json.loads(p.read_text())
        except (ValueError, UnicodeDecodeError) as e:
            raise FormatError(f"{p}: not valid JSON ({e})") from None
        if not isinstance(d, dict) or d.get("sharded_backend") != "torch_dist":
            got = d.get("sharded_backend") if isinstance(d, dict) else d
            raise FormatError(f"{p}: sharded_backend {got!r} is not 'torch_dist'; only torch_dist is supported")

    def _validate(self, md: _dcp_md.Metadata) -> None:
        src = self.path / DCP_METADATA
        sdm = md.state_dict_metadata
        if not isinstance(sdm, dict):
            raise FormatError(f"{src}: state_dict_metadata is not a dict")
        for name, m in sdm.items():
            if not isinstance(name, str):
                raise FormatError(f"{src}: key {name!r} is not a string")
            if isinstance(m, _dcp_md.BytesStorageMetadata):
                self.objects.append(name)
                continue
            if not isinstance(m, _dcp_md.TensorStorageMetadata):
                raise FormatError(f"{src}: {name}: unexpected metadata type {type(m).__name__}")
            shape = tuple(int(s) for s in m.size)
            dtype = getattr(m.properties, "dtype", None)
            if not isinstance(dtype, torch.dtype) or any(s < 0 for s in shape):
                raise FormatError(f"{src}: {name}: bad size {shape} or dtype {dtype!r}")
            chunks, vol, seen = [], 0, set()
            for c in m.chunks:
                off, size = tuple(int(x) for x in c.offsets), tuple(int(x) for x in c.sizes)
                if len(off) != len(shape) or len(size) != len(shape) or any(
                        o < 0 or s < 0 or o + s > g for o, s, g in zip(off, size, shape)):
                    raise FormatError(f"{src}: {name}: chunk at {list(off)} of size {list(size)} lies outside the "
                                      f"tensor's shape {list(shape)}")
                if off in seen:
                    raise FormatError(f"{src}: {name}: the chunk at {list(off)} is stored twice (duplicate entries "
                                      "in .metadata)")
                seen.add(off)
                chunks.append((off, size))
                vol += _volume([(0, s) for s in size])
            if vol > _volume([(0, s) for s in shape]):
                raise FormatError(f"{src}: {name}: stored chunks overlap (they hold {vol} elements for a tensor of "
                                  f"{_volume([(0, s) for s in shape])}, shape {list(shape)})")
            if vol != _volume([(0, s) for s in shape]):
                raise FormatError(f"{src}: {name}: stored chunks cover {vol} elements of {list(shape)}; the checkpoint "
                                  "is incomplete")
            self.tensors[name] = TDTensor(name, shape, dtype, chunks)
        sd = md.storage_data
        if not isinstance(sd, dict):
            raise FormatError(f"{src}: storage_data is not a dict")
        sizes: dict[str, int] = {}
        for idx, info in sd.items():
            if not isinstance(idx, _dcp_md.MetadataIndex) or not isinstance(info, _dcp_fs._StorageInfo):
                raise FormatError(f"{src}: storage_data entry {idx!r} is malformed")
            rel = info.relative_path
            if not isinstance(rel, str) or not _FILE_RE.match(rel) or rel in (".", "..") or rel.startswith("."):
                raise FormatError(f"{src}: item {idx.fqn} points to {rel!r}, which is not a plain file name in the "
                                  "checkpoint directory; refusing it")
            if getattr(info, "transform_descriptors", None):
                raise FormatError(f"{src}: item {idx.fqn} is stored with transforms {info.transform_descriptors}; "
                                  "only plain torch.save items are supported")
            if rel not in sizes:
                p = safe_path(self.path, rel, f"{src}: item {idx.fqn}")
                if not p.is_file():
                    raise FormatError(f"{p}: missing (item {idx.fqn} is stored there); the checkpoint is incomplete")
                sizes[rel] = p.stat().st_size
            off, length = int(info.offset), int(info.length)
            if off < 0 or length <= 0 or off + length > sizes[rel]:
                raise FormatError(f"{self.path / rel}: item {idx.fqn} needs bytes [{off}, {off + length}) but the file "
                                  f"has {sizes[rel]}; the file is truncated")
            key = (idx.fqn, None if idx.offset is None else tuple(int(x) for x in idx.offset))
            self._storage[key] = info
        self._files = sizes
        for name, t in self.tensors.items():
            for off, _ in t.chunks:
                if (name, off) not in self._storage:
                    raise FormatError(f"{src}: tensor {name} chunk at {list(off)} has no storage entry")

    # -- items ----------------------------------------------------------------------------------------------------
    def read_item(self, name: str, offsets: tuple[int, ...]) -> torch.Tensor:
        """One stored chunk of a tensor, loaded with torch.load(weights_only=True) (memory-mapped when large)."""
        key = (name, offsets)
        if self._cache is not None and self._cache[0] == key:
            return self._cache[1]
        self._cache = None
        t = self.tensors[name]
        size = t.chunk_size(offsets)
        info = self._storage[key]
        path = self.path / info.relative_path
        try:
            with open(path, "rb") as f:
                f.seek(info.offset)
                if info.length > ITEM_MMAP_BYTES:
                    value = _load_spooled(f, info.length, self.spool_dir)
                else:
                    data = f.read(info.length)
                    if len(data) != info.length:
                        raise EOFError("short read")
                    value = load_torch(io.BytesIO(data), what=f"item {name}")
        except Exception as e:  # truncated / garbage bytes: torch raises RuntimeError, UnpicklingError, ...
            raise FormatError(f"{path}: item {name} at {list(offsets)} (bytes {info.offset}+{info.length}) cannot be "
                              f"loaded: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != size or value.dtype != t.dtype:
            got = (tuple(value.shape), value.dtype) if isinstance(value, torch.Tensor) else type(value).__name__
            raise FormatError(f"{path}: item {name} at {list(offsets)} holds {got}, expected {size} {t.dtype}")
        self._cache = (key, value)
        return value

    def read(self, name: str, box: tuple[tuple[int, int], ...] | None = None) -> torch.Tensor:
        """A box ([start, stop) per axis) of a tensor, gathered from the stored chunks that overlap it."""
        if name not in self.tensors:
            raise FormatError(f"{self.path}: no tensor {name!r}")
        t = self.tensors[name]
        box = tuple((0, s) for s in t.shape) if box is None else tuple(box)
        if len(box) != len(t.shape) or any(not 0 <= a <= b <= s for (a, b), s in zip(box, t.shape)):
            raise ValueError(f"tensor {name}: box {list(box)} is not inside its shape {list(t.shape)}")
        out = torch.empty([b - a for a, b in box], dtype=t.dtype)
        covered = 0
        for off, size in t.overlapping(box):
            inter = _intersect((off, size), box)
            item = self.read_item(name, off)
            src = tuple(slice(lo - o, hi - o) for (lo, hi), o in zip(inter, off))
            dst = tuple(slice(lo - a, hi - a) for (lo, hi), (a, _) in zip(inter, box))
            out[dst] = item[src]
            covered += _volume(inter)
        if covered != out.numel():
            raise FormatError(f"{self.path}: tensor {name}: stored chunks cover {covered} of the {out.numel()} "
                              f"elements of box {list(box)}")
        return out


def _load_spooled(f, length: int, directory: Path | None) -> torch.Tensor:
    """A large item: copy its bytes to a temporary file in blocks and memory-map it (bounded memory). `directory`
    should be on disk (a tmpfs /tmp would hold the copy in memory)."""
    with tempfile.NamedTemporaryFile(prefix=".shardkit-item-", suffix=".pt", dir=directory) as tmp:
        left = length
        while left:
            block = f.read(min(left, 64 << 20))
            if not block:
                raise EOFError("short read")
            tmp.write(block)
            left -= len(block)
        tmp.flush()
        # the mapping stays valid after the name is unlinked
        return load_torch(tmp.name, mmap=True, what="item")


def resolve_torch_dist(path: str | Path) -> Path:
    """An iteration directory from a Megatron checkpoint root (through latest_checkpointed_iteration.txt) or the
    iteration directory itself."""
    p = Path(path)
    if not p.exists():
        raise FormatError(f"{p}: no such checkpoint")
    if (p / DCP_METADATA).exists() or (p / METADATA_JSON).exists():
        return p
    tracker = p / TRACKER
    text = read_pointer(p, TRACKER) if p.is_dir() else None  # a regular file of <= 4 KiB, or an error
    if text is not None:
        text = text.strip()
        if text == RELEASE:
            name = RELEASE
        elif text.isdigit():
            name = iter_dirname(int(text))
        else:
            raise FormatError(f"{tracker}: holds {text[:40]!r}, not an iteration number or 'release'")
        it = p / name
        if not it.is_dir():
            raise FormatError(f"{tracker}: points to {name}, which is missing")
        return it
    iters = sorted(x.name for x in p.iterdir() if x.is_dir() and iteration_of(x.name) is not None) if p.is_dir() else []
    hint = f" (found {', '.join(iters[-3:])}: pass one of them)" if iters else ""
    raise FormatError(f"{p}: not a torch_dist checkpoint: no {TRACKER}, no {DCP_METADATA}{hint}")


def read_torch_dist(path: str | Path) -> TorchDistCheckpoint:
    return TorchDistCheckpoint(path)


# -- writing ----------------------------------------------------------------------------------------------------------

class DCPWriter:
    """Append items to `__<rank>_<part>.distcp` files and build DCP's Metadata. Each file is written whole through
    one `RankFile` (one file open at a time per process)."""

    def __init__(self, directory: Path):
        self.dir = Path(directory)
        self.state_dict_metadata: dict[str, Any] = {}
        self.storage_data: dict = {}

    def declare_tensor(self, name: str, shape: Iterable[int], dtype: torch.dtype,
                       chunks: Iterable[tuple[tuple[int, ...], tuple[int, ...]]]) -> None:
        self.state_dict_metadata[name] = _dcp_md.TensorStorageMetadata(
            properties=_dcp_md.TensorProperties(dtype=dtype), size=torch.Size(list(shape)),
            chunks=[_dcp_md.ChunkStorageMetadata(offsets=torch.Size(list(o)), sizes=torch.Size(list(s)))
                    for o, s in chunks])

    def declare_object(self, name: str) -> None:
        self.state_dict_metadata[name] = _dcp_md.BytesStorageMetadata()

    def rank_file(self, rank: int, part: int = 0) -> "RankFile":
        return RankFile(self, f"__{rank}_{part}.distcp")

    def metadata(self, checkpoint_id: str) -> _dcp_md.Metadata:
        return _dcp_md.Metadata(state_dict_metadata=self.state_dict_metadata, planner_data=None,
                                storage_data=self.storage_data,
                                storage_meta=_dcp_md.StorageMeta(checkpoint_id=checkpoint_id,
                                                                 save_id=str(uuid.uuid4())),
                                version=DCP_VERSION)

    def write_metadata(self, checkpoint_id: str) -> None:
        buf = io.BytesIO()
        pickle.dump(self.metadata(checkpoint_id), buf)
        write_file_atomic(self.dir / DCP_METADATA, buf.getvalue())


class RankFile:
    """One `.distcp` file: items are appended; the storage entries go to the writer's metadata on close.

    Every SYNC_EVERY bytes an fsync of what is written so far starts on a helper thread, so the disk writes back
    while the next items are read and serialised; the fsync at close then finds little left (it used to wait for the
    whole file at the end: a quarter of the export's time)."""

    SYNC_EVERY = 128 << 20

    def __init__(self, writer: DCPWriter, name: str):
        self.writer, self.name = writer, name
        self.entries: dict = {}
        self.f = open(writer.dir / name, "wb")
        self._unsynced = 0
        self._sync: Future | None = None
        self._syncer = ThreadPoolExecutor(1, thread_name_prefix="shardkit-sync")

    def add_tensor(self, name: str, offsets: tuple[int, ...], value: "torch.Tensor | np.ndarray") -> int:
        if isinstance(value, np.ndarray):  # a torch view of it (gathered first when not contiguous): no copy
            value = store.from_numpy(chunkio.contiguous(value))
        value = value.detach().contiguous()
        if value.untyped_storage().nbytes() != value.numel() * value.element_size():
            value = value.clone()  # torch.save writes whole storages: never a view into a bigger one
        start = self.f.tell()
        torch.save(value, self.f)
        length = self.f.tell() - start
        self.entries[_dcp_md.MetadataIndex(name, offsets)] = _dcp_fs._StorageInfo(self.name, start, length)
        self._unsynced += length
        if self._unsynced >= self.SYNC_EVERY and (self._sync is None or self._sync.done()):
            if self._sync is not None:
                self._sync.result()  # raise a failed background fsync here
            self.f.flush()
            self._sync, self._unsynced = self._syncer.submit(os.fsync, self.f.fileno()), 0
        return length

    def add_bytes(self, name: str, data: bytes) -> int:
        start = self.f.tell()
        self.f.write(data)
        self.entries[_dcp_md.MetadataIndex(name)] = _dcp_fs._StorageInfo(self.name, start, len(data))
        return len(data)

    def close(self) -> dict:
        try:
            if self._sync is not None:
                self._sync.result()
            self.f.flush()
            os.fsync(self.f.fileno())
        finally:
            self._syncer.shutdown()
            self.f.close()
        self.writer.storage_data.update(self.entries)
        return self.entries

    def __enter__(self) -> "RankFile":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self._syncer.shutdown()  # waits for a background fsync: the file stays open until it is done
            self.f.close()


def none_object_bytes() -> bytes:
    """The item megatron-core writes for a ShardedObject whose data is None (e.g. a linear layer's _extra_state
    without FP8): torch.save of the list of local objects."""
    buf = io.BytesIO()
    torch.save([None], buf)
    return buf.getvalue()


class _GlobalRef:
    """Base of the stand-in classes _ArgsPickler writes as a global by name (`_pickle_as`: module.Class)."""

    _pickle_as = ""


@functools.lru_cache(maxsize=None)
def _global_ref(path: str) -> type:
    return type(path.rsplit(".", 1)[-1], (_GlobalRef,), {"_pickle_as": path})


class _ArgsPickler(pickle._Pickler):
    """torch.save's pickler for common.pt: a Megatron enum member in the args (checkpoint.megatron.MegatronEnum, or
    safe_load's inert stand-in of one read from another checkpoint) is written as pickle writes the real member
    (GLOBAL <module> <Class>, called with its value) without importing Megatron; everything else as pickle does.
    The pure-Python pickler, for its save_global hook: common.pt is small."""

    def reducer_override(self, obj):
        if isinstance(obj, MegatronEnum):
            return _global_ref(obj.path), (obj.value,)
        if isinstance(obj, MegatronObject):
            if set(vars(obj)) != {"args"} or len(obj.args) != 1:
                raise FormatError(f"cannot write {obj!r} back into common.pt: shardkit keeps only its data")
            return _global_ref(obj.qualname), obj.args
        return NotImplemented

    def save_global(self, obj, name=None):
        if isinstance(obj, type) and issubclass(obj, _GlobalRef):
            module, qual = obj._pickle_as.rsplit(".", 1)
            self.write(pickle.GLOBAL + module.encode("utf-8") + b"\n" + qual.encode("utf-8") + b"\n")
            self.memoize(obj)
            return
        super().save_global(obj, name)


_ARGS_PICKLE = type(sys)("shardkit_common_pickle")
_ARGS_PICKLE.Pickler = _ArgsPickler


def write_common(directory: Path, common: dict) -> None:
    buf = io.BytesIO()
    torch.save(common, buf, pickle_module=_ARGS_PICKLE)
    write_file_atomic(Path(directory) / COMMON_PT, buf.getvalue())
    write_file_atomic(Path(directory) / METADATA_JSON, json.dumps(BACKEND))


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
    body["digest"] = _digest(body)
    write_file_atomic(Path(directory) / SIDECAR, json.dumps(body, indent=1) + "\n")


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
        d = json.loads(p.read_bytes())
    except (ValueError, UnicodeDecodeError) as e:
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
    except (FormatError, ConfigError, LayoutError) as e:
        raise FormatError(f"{p}: {str(e).removeprefix('manifest: ')}") from None
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise FormatError(f"{p}: malformed ({type(e).__name__}: {e})") from None
    return {**d, "model": model, "layout": layout}


__all__ = ["TorchDistCheckpoint", "TDTensor", "read_torch_dist", "resolve_torch_dist", "load_dcp_metadata",
           "load_common", "DCPWriter", "RankFile", "write_common", "write_sidecar", "load_sidecar", "SIDECAR",
           "HF_SUBDIR",
           "none_object_bytes", "BACKEND", "TRACKER", "CHECKPOINT_VERSION"]
