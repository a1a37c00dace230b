"""Megatron-LM `--ckpt-format torch_dist` checkpoints (PyTorch DCP underneath), read and written without Megatron.

    <root>/latest_checkpointed_iteration.txt     "N" (or "release")
    <root>/iter_000000N/metadata.json            {"sharded_backend": "torch_dist", ...}
    <root>/iter_000000N/common.pt                torch.save of the non-sharded state (iteration, args, ...); in
                                                 megatron-core >= 0.17's layout (--megatron-version 0.19) the DCP
                                                 item common_state/shard_0_1 instead
    <root>/iter_000000N/.metadata                pickled torch.distributed.checkpoint.metadata.Metadata
    <root>/iter_000000N/__<rank>_<k>.distcp      items: each a torch.save(tensor) blob at an offset
    <root>/iter_000000N/shardkit.json            (shardkit's exports) model config incl. the true vocab, layout,
                                                 dtype, provenance: read back with no flags
    <root>/iter_000000N/hf/                      (shardkit's exports) config.json + tokenizer / generation files
    <root>/iter_000000N/run_config.yaml          (shardkit's exports, dense models) the model for Megatron-Bridge
    <root>/iter_000000N/integrity.json           (shardkit's exports) every file's SHA-256, megatron-core 0.19's
                                                 verify_integrity manifest

Reading never runs pickle code it does not know: `.metadata` goes through an unpickler that resolves only DCP's own
metadata classes (anything else is refused, naming the file and the global); items and `common.pt` go through
checkpoint.safe_load (`torch.load(weights_only=True)` under its short allowlist). File names in
the metadata are checked before any file is opened (plain names inside the iteration directory), and every item's
byte range must lie inside its file. Neither needs torch where the files hold plain data (the import path imports
no torch): `.metadata` is read into plain stand-ins of DCP's classes (_Light), common.pt's data.pkl by an unpickler
that resolves safe_load's allowlist and nothing else (_CommonUnpickler); torch dtypes come back as _Dtype (equal to
torch's). A pickle that names anything else is refused as before, or read by torch's own reader where that is benign
(a tensor in common.pt, an unusual metadata class).

Item values are read either with torch.load (read_item, read) or, for the import, as numpy views of the mapped
`.distcp` file (item_array, read_numpy): the item's zip archive parsed and its data.pkl unpickled under a one-tensor
allowlist (torch's tensor rebuild of one storage, nothing else; any other item goes to torch.load).

Here: reading. The safe unpickling is checkpoint/torch_dist_pickle.py, shardkit.json checkpoint/torch_dist_sidecar.py,
and writing (the inverse, with bounded memory and no torch) checkpoint/torch_dist_write.py.
"""

from __future__ import annotations

import argparse
import io
import json
import mmap
import os
import pickle
import re
import struct
import tempfile
import zlib
from bisect import bisect_left, bisect_right
from collections import OrderedDict
from dataclasses import dataclass, field
from itertools import product
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from . import store
from .config import ModelConfig
from .errors import ConfigError, FormatError
from .layout import Layout
from .megatron import (RELEASE, TRACKER, TorchDtype, arg, check_args, config_from_megatron_args, hf_model_type_of,
                       iter_dirname, iteration_of, layout_from_args, missing_model_args, with_args_vocab)
from .megatron_bridge import RUN_CONFIG, load_run_config, load_train_state
from .safety import read_input, read_pointer, regular_file, safe_path
from .torch_dist_pickle import (COMMON_MAX, DCP_METADATA, _CRC32, _STORAGE_TYPES, _Dtype, _Light, _dcp_fs, _dcp_md,
                                _dtype_str, _load_metadata_light, load_common, load_dcp_metadata, torch_dtype)
from .torch_dist_sidecar import SIDECAR, check_files, item_key, load_sidecar

if TYPE_CHECKING:
    import torch

METADATA_JSON = "metadata.json"
COMMON_PT = "common.pt"
COMMON_ITEM = "common_state/shard_0_1"  # megatron-core >= 0.17: the common state as a DCP bytes item (no common.pt)
BACKEND = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
           "common_backend_version": 1}
DCP_VERSION = "1.0.0"
HF_SUBDIR = "hf"
# Items larger than this are spooled to a temporary file and memory-mapped instead of read into memory.
ITEM_MMAP_BYTES = 256 << 20
_FILE_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")
# the largest iteration number taken from a checkpoint (common.pt, the tracker): 10^10 steps is centuries of training;
# beyond it the number is damage, never a directory name (issue 34: 10**30 was used as one)
MAX_ITERATION = 10**10


# -- reading ----------------------------------------------------------------------------------------------------------

@dataclass
class TDTensor:
    """One tensor of a torch_dist checkpoint: global shape, dtype and its stored chunks (offsets, sizes). The dtype is
    torch's, or _Dtype where `.metadata` was read without torch (equal to torch's, with its itemsize; torch_dtype()
    gives torch's own)."""

    name: str
    shape: tuple[int, ...]
    dtype: "torch.dtype | TorchDtype"
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


def _key_str(key: tuple) -> str:
    name, off = key
    return name if off is None else f"{name} at {list(off)}"


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
    """A parsed torch_dist iteration: tensors (name -> TDTensor), bytes objects, common.pt, item reads. With
    `megatron=False`, a plain DCP directory (`.metadata` and `.distcp` files only, e.g. torchtitan's `step-N`): its
    tensors and items, no Megatron files looked for."""

    def __init__(self, path: str | Path, megatron: bool = True):
        self.path = resolve_torch_dist(path) if megatron else Path(path)
        self.notes: list[str] = []
        if megatron:
            self._check_backend()
        md = _load_metadata_light(self.path / DCP_METADATA)  # torch's DCP classes are only needed when it fails
        if md is None:
            md = load_dcp_metadata(self.path / DCP_METADATA)
        self.tensors: dict[str, TDTensor] = {}
        self.objects: list[str] = []
        self._storage: dict[tuple[str, tuple[int, ...] | None], Any] = {}  # -> DCP's _StorageInfo
        self._files: dict[str, int] = {}
        try:
            self._validate(md)
        except (TypeError, ValueError, AttributeError) as e:
            raise FormatError(f"{self.path / DCP_METADATA}: malformed DCP metadata ({type(e).__name__}: {e})") from None
        self.sidecar: dict | None = load_sidecar(self.path) if megatron else None
        self._cache: tuple | None = None
        self._array: tuple | None = None  # item_array's last item
        self._checked: set = set()  # items whose bytes passed their CRC-32s (check_item)
        self.spool_dir: Path | None = None  # where items > ITEM_MMAP_BYTES are copied to be memory-mapped
        if not megatron:
            return
        self.common_source = self.path / COMMON_PT
        if COMMON_ITEM in self.objects and not os.path.lexists(self.path / COMMON_PT):
            self.common, note = self._load_common_item()
        else:
            self.common, note = load_common(self.path / COMMON_PT)
        if note:
            self.notes.append(note)
        # common.pt as shardkit saved it, where shardkit.json records it (after the checked unpickler has read it:
        # code in it is refused by that first, in its words)
        check_files(self.path, self.sidecar)
        # Megatron-Bridge: the model from run_config.yaml, iteration and consumed samples from train_state.pt
        self.args_source = self.common_source
        self.bridge_args, note = (None, None) if self._common_args() is not None else load_run_config(self.path)
        self.train_state = load_train_state(self.path) if self.bridge_args is not None else None
        if note:
            self.notes.append(note)
        if self.bridge_args is not None:
            self.args_source = self.path / RUN_CONFIG
            consumed = (self.train_state or {}).get("consumed_train_samples")
            if isinstance(consumed, int) and not isinstance(consumed, bool):
                self.bridge_args.consumed_train_samples = consumed

    def _common_args(self) -> argparse.Namespace | None:
        a = (self.common or {}).get("args")
        return a if isinstance(a, argparse.Namespace) else None

    def _load_common_item(self) -> tuple[dict | None, str | None]:
        """megatron-core >= 0.17 writes no common.pt: the common state is the DCP bytes item `common_state/shard_0_1`
        (a torch.save archive of [dict]). Its bytes are bounded (COMMON_MAX) and checked against their zip CRC-32s
        (check_item, as every item) before load_common's restricted readers see them."""
        info = self._storage[(COMMON_ITEM, None)]
        label = self.path / info.relative_path
        self.common_source = Path(f"{label} item {COMMON_ITEM}")
        if int(info.length) > COMMON_MAX:
            raise FormatError(f"{label}: item {COMMON_ITEM} is {int(info.length):,} bytes, more than a common "
                              f"state's {COMMON_MAX:,}; refusing to read it")
        self.check_item(COMMON_ITEM, None)
        with open(label, "rb") as f:
            f.seek(int(info.offset))
            data = f.read(int(info.length))
        if len(data) != int(info.length):
            raise FormatError(f"{label}: item {COMMON_ITEM}: short read; the checkpoint is damaged")
        return load_common(self.common_source, data)

    # -- basic facts ----------------------------------------------------------------------------------------------
    @property
    def iteration(self) -> int:
        it = (self.common or {}).get("iteration")
        if it is None and self.train_state is not None:
            it = self.train_state.get("step")
        if isinstance(it, int) and not isinstance(it, bool) and it > MAX_ITERATION:
            raise FormatError(f"{self.common_source}: iteration {str(it)[:40]} is beyond any run's "
                              f"({MAX_ITERATION:,}); the file is damaged, not a name to write")
        if isinstance(it, int) and not isinstance(it, bool) and it >= 0:
            return it
        it = iteration_of(self.path.name)
        return 0 if it is None else it

    @property
    def args(self) -> argparse.Namespace | None:
        """Megatron-LM's args from the common state, else those made from a Megatron-Bridge run_config.yaml."""
        return self._common_args() or self.bridge_args

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
        common = self.args_source
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
        if not regular_file(p, missing_ok=True):
            raise FormatError(f"{p}: missing; {self.path} is not a Megatron torch_dist checkpoint")
        try:
            d = json.loads(read_input(p, limit=1 << 20))
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            raise FormatError(f"{p}: not valid JSON ({e})") from None
        if not isinstance(d, dict) or d.get("sharded_backend") != "torch_dist":
            got = d.get("sharded_backend") if isinstance(d, dict) else d
            raise FormatError(f"{p}: sharded_backend {got!r} is not 'torch_dist'; only torch_dist is supported")

    def _validate(self, md: Any) -> None:
        dcp_md, dcp_fs = (_Light, _Light) if isinstance(md, _Light.Metadata) else (_dcp_md(), _dcp_fs())
        src = self.path / DCP_METADATA
        sdm = md.state_dict_metadata
        if not isinstance(sdm, dict):
            raise FormatError(f"{src}: state_dict_metadata is not a dict")
        for name, m in sdm.items():
            if not isinstance(name, str):
                raise FormatError(f"{src}: key {name!r} is not a string")
            if isinstance(m, dcp_md.BytesStorageMetadata):
                self.objects.append(name)
                continue
            if not isinstance(m, dcp_md.TensorStorageMetadata):
                raise FormatError(f"{src}: {name}: unexpected metadata type {type(m).__name__}")
            shape = tuple(int(s) for s in m.size)
            dtype = getattr(m.properties, "dtype", None)
            if not (isinstance(dtype, _Dtype) or type(dtype).__name__ == "dtype" and type(dtype).__module__ == "torch"
                    ) or any(s < 0 for s in shape):
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
            if not isinstance(idx, dcp_md.MetadataIndex) or not isinstance(info, dcp_fs._StorageInfo):
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
                if not regular_file(p, f"item {idx.fqn}", missing_ok=True):
                    raise FormatError(f"{p}: missing (item {idx.fqn} is stored there); the checkpoint is incomplete")
                sizes[rel] = p.stat().st_size
            off, length = int(info.offset), int(info.length)
            if off < 0 or length <= 0 or off + length > sizes[rel]:
                raise FormatError(f"{self.path / rel}: item {idx.fqn} needs bytes [{off}, {off + length}) but the file "
                                  f"has {sizes[rel]}; the file is truncated")
            key = (idx.fqn, None if idx.offset is None else tuple(int(x) for x in idx.offset))
            self._storage[key] = info
        self._files = sizes
        spans: dict[str, list] = {}
        for key, info in self._storage.items():
            start = int(info.offset)
            spans.setdefault(info.relative_path, []).append((start, start + int(info.length), key))
        for rel, items in spans.items():  # every item its own bytes: two entries on one range (aliased, swapped in
            items.sort(key=lambda x: (x[0], x[1]))  # for another) or overlapping ranges are damage, not a format
            for (a0, a1, ka), (b0, b1, kb) in zip(items, items[1:]):
                if b0 < a1:
                    what = "point at the same bytes" if (a0, a1) == (b0, b1) else "overlap"
                    raise FormatError(f"{self.path / rel}: items {_key_str(ka)} and {_key_str(kb)} {what} (bytes "
                                      f"[{b0}, {min(a1, b1)}) of both; aliased storage entries in {src}); the "
                                      "checkpoint is damaged")
        for name, t in self.tensors.items():
            for off, _ in t.chunks:
                if (name, off) not in self._storage:
                    raise FormatError(f"{src}: tensor {name} chunk at {list(off)} has no storage entry")

    # -- items ----------------------------------------------------------------------------------------------------
    def _locate(self, key: tuple[str, tuple[int, ...]]):
        """(tensor, the chunk's shape, its storage entry) of one stored chunk (name, offsets)."""
        t = self.tensors[key[0]]
        return t, t.chunk_size(key[1]), self._storage[key]

    def _box(self, name: str, box) -> tuple[TDTensor, tuple[tuple[int, int], ...]]:
        """The tensor and a checked box ([start, stop) per axis, the whole tensor when None) inside it."""
        if name not in self.tensors:
            raise FormatError(f"{self.path}: no tensor {name!r}")
        t = self.tensors[name]
        box = tuple((0, s) for s in t.shape) if box is None else tuple(box)
        if len(box) != len(t.shape) or any(not 0 <= a <= b <= s for (a, b), s in zip(box, t.shape)):
            raise ValueError(f"tensor {name}: box {list(box)} is not inside its shape {list(t.shape)}")
        return t, box

    def check_item(self, name: str, offsets: tuple[int, ...] | None) -> None:
        """The item's bytes against the CRC-32s its own zip records carry (once per item and reader; every read of an
        item, whatever the path - verify, export, reshard, training load - checks it first): FormatError naming the
        file, the tensor and the record that fails."""
        key = (name, offsets)
        if key in self._checked:
            return
        info = self._storage[key]
        path = self.path / info.relative_path
        base = info.offset - info.offset % mmap.ALLOCATIONGRANULARITY
        found: dict[str, int] = {}
        try:
            with open(path, "rb") as f:
                with mmap.mmap(f.fileno(), info.offset + info.length - base, access=mmap.ACCESS_READ,
                               offset=base) as mm:
                    why = _item_crc_problem(mm, info.offset - base, info.length, found)
        except (OSError, ValueError) as e:
            why = f"cannot be read ({type(e).__name__}: {e})"
        want = ((self.sidecar or {}).get("items") or {}).get(item_key(name, offsets))
        got = next((c for r, c in found.items() if r.endswith("data/0")), None)
        if why is None and want is not None and got is not None and want != got:
            owner = next((k for k, v in self.sidecar["items"].items() if v == got), None)
            why = (f"its data is not the one {SIDECAR} recorded for this key (CRC-32 {got:08x}, recorded {want:08x}"
                   + (f"; those are the bytes of {owner}" if owner else "") + "): storage entries in "
                   f"{DCP_METADATA} swapped or edited")
        if why is not None:
            at = "" if offsets is None else f" at {list(offsets)}"
            raise FormatError(f"{path}: item {name}{at} (bytes {info.offset}+{info.length}): {why}; the checkpoint "
                              "is damaged") from None
        self._checked.add(key)

    def read_item(self, name: str, offsets: tuple[int, ...]) -> torch.Tensor:
        """One stored chunk of a tensor, loaded with torch.load(weights_only=True) (memory-mapped when large), its
        bytes checked first (check_item)."""
        import torch

        from .safe_load import load_torch

        key = (name, offsets)
        if self._cache is not None and self._cache[0] == key:
            return self._cache[1]
        self._cache = None
        t, size, info = self._locate(key)
        self.check_item(name, offsets)
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

    # -- items as numpy, without torch.load ------------------------------------------------------------------------
    def read_numpy(self, name: str, box: tuple[tuple[int, int], ...] | None = None) -> np.ndarray:
        """read() as a numpy array: each item's data memory-mapped from its `.distcp` file (a read-only view of the
        mapping, no copy, where the box is one whole item) once its torch.save archive checks out (item_array);
        an item that does not (another archive layout, another pickle) is read by read_item (torch.load)."""
        t, box = self._box(name, box)
        parts = t.overlapping(box)
        out, covered = None, 0
        for off, size in parts:
            inter = _intersect((off, size), box)
            item = self.item_array(name, off)
            src = tuple(slice(lo - o, hi - o) for (lo, hi), o in zip(inter, off))
            if len(parts) == 1 and inter == box:
                return item[src]
            if out is None:
                out = np.empty([b - a for a, b in box], dtype=item.dtype)
            out[tuple(slice(lo - a, hi - a) for (lo, hi), (a, _) in zip(inter, box))] = item[src]
            covered += _volume(inter)
        if out is None or covered != out.size:
            raise FormatError(f"{self.path}: tensor {name}: stored chunks cover {covered} of the "
                              f"{_volume(box)} elements of box {list(box)}")
        return out

    def item_array(self, name: str, offsets: tuple[int, ...]) -> np.ndarray:
        """One stored chunk as a read-only numpy view of its `.distcp` file's mapping: the item's zip archive parsed
        (stored records, data.pkl and data/0 only), data.pkl unpickled by _ItemUnpickler (torch's tensor rebuild of
        one storage, nothing else: anything else goes to read_item's torch.load), the tensor checked against the
        metadata (dtype, shape, contiguous, inside the archive)."""
        key = (name, offsets)
        if self._array is not None and self._array[0] == key:
            return self._array[1]
        self._array = None
        t, size, info = self._locate(key)
        self.check_item(name, offsets)
        dtype = _dtype_str(t.dtype)
        view = None
        if dtype in _STORAGE_TYPES:
            # the item's own mapping (from the page it starts in): its pages leave our RSS with the last view of it
            base = info.offset - info.offset % mmap.ALLOCATIONGRANULARITY
            with open(self.path / info.relative_path, "rb") as f:
                mm = mmap.mmap(f.fileno(), info.offset + info.length - base, access=mmap.ACCESS_READ, offset=base)
            view = _item_view(mm, info.offset - base, info.length, dtype, size)
        if view is None:
            view = store.to_numpy(self.read_item(name, offsets))
        self._array = (key, view)
        return view

    def read(self, name: str, box: tuple[tuple[int, int], ...] | None = None) -> torch.Tensor:
        """A box ([start, stop) per axis) of a tensor, gathered from the stored chunks that overlap it."""
        import torch

        t, box = self._box(name, box)
        out = torch.empty([b - a for a, b in box], dtype=torch_dtype(t.dtype))
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


class _Rebuilt:
    """What _ItemUnpickler makes of torch's _rebuild_tensor_v2 call: its arguments, nothing built."""

    __slots__ = ("args",)

    def __init__(self, *args):
        self.args = args


class _ItemUnpickler(pickle.Unpickler):
    """data.pkl of a tensor item as torch.save writes it: torch._utils._rebuild_tensor_v2 of the persistent storage
    ('storage', torch.<Type>Storage, '0', 'cpu', numel), an empty OrderedDict of hooks. Every other global or
    persistent id is refused (the item then goes to torch.load(weights_only=True), which decides); nothing is
    built but the arguments."""

    def find_class(self, module: str, name: str):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _Rebuilt
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        storages = {v: k for k, v in _STORAGE_TYPES.items()}
        if module == "torch" and name in storages:
            return ("storage-type", storages[name])
        raise pickle.UnpicklingError(f"{module}.{name}")

    def persistent_load(self, pid):
        if (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], tuple)
                and pid[2] == "0" and pid[3] == "cpu" and isinstance(pid[4], int)):
            return pid
        raise pickle.UnpicklingError(f"persistent id {pid!r}")


def _item_view(mm: mmap.mmap, start: int, length: int, dtype: str, size: tuple[int, ...]) -> np.ndarray | None:
    """The data of a torch.save archive at bytes [start, start + length) of `mm` as a numpy array of `dtype` and
    `size` (a view of the mapping), or None where the archive is not the plain one-tensor form (read_item decides)."""
    try:
        end = start + length
        if length < 22 or mm[end - 22:end - 18] != b"PK\x05\x06":
            return None
        n, cd_size, cd_off = struct.unpack_from("<HII", mm, end - 12)
        if cd_off == 0xFFFFFFFF or cd_size == 0xFFFFFFFF:
            if mm[end - 42:end - 38] != b"PK\x06\x07":
                return None
            (z64,) = struct.unpack_from("<Q", mm, end - 34)
            if mm[start + z64:start + z64 + 4] != b"PK\x06\x06":
                return None
            n, cd_size, cd_off = struct.unpack_from("<QQQ", mm, start + z64 + 32)
        records, pos = {}, start + cd_off
        for _ in range(n):
            if mm[pos:pos + 4] != b"PK\x01\x02":
                return None
            method, crc, csize, usize, nlen, xlen, clen = struct.unpack_from("<HxxxxIIIHHH", mm, pos + 10)
            (local,) = struct.unpack_from("<I", mm, pos + 42)
            rec = bytes(mm[pos + 46:pos + 46 + nlen]).decode("utf-8", "replace").split("/", 1)[-1]
            if method != 0 or csize != usize or 0xFFFFFFFF in (csize, local):
                return None
            records[rec] = (local, usize, crc)
            pos += 46 + nlen + xlen + clen
        if set(records) - {"data.pkl", "data/0", ".format_version", ".storage_alignment", "byteorder", "version",
                           ".data/serialization_id"} or "data/0" not in records or "data.pkl" not in records:
            return None
        begin = {}
        for rec in ("data.pkl", "data/0"):
            local, usize, crc = records[rec]
            h = start + local
            if mm[h:h + 4] != b"PK\x03\x04":
                return None
            nlen, xlen = struct.unpack_from("<HH", mm, h + 26)
            begin[rec] = h + 30 + nlen + xlen
            if begin[rec] + usize > end:
                return None
        pkl = mm[begin["data.pkl"]:begin["data.pkl"] + records["data.pkl"][1]]
        if zlib.crc32(pkl) != records["data.pkl"][2]:
            return None
        rebuilt = _ItemUnpickler(io.BytesIO(pkl)).load()
        if not isinstance(rebuilt, _Rebuilt) or len(rebuilt.args) != 6:
            return None
        pid, offset, shape, stride, grad, hooks = rebuilt.args
        numel = 1
        for s in size:
            numel *= s
        want_stride, k = [], 1
        for s in reversed(size):
            want_stride.append(k)
            k *= max(s, 1)
        if (pid[1] != ("storage-type", dtype) or offset != 0 or tuple(shape) != tuple(size) or grad is not False
                or hooks != OrderedDict() or tuple(stride) != tuple(reversed(want_stride)) or pid[4] < numel):
            return None
        nd = store.numpy_dtype(dtype)
        if numel * nd.itemsize > records["data/0"][1]:
            return None
        return np.frombuffer(mm, dtype=nd, count=numel, offset=begin["data/0"]).reshape(size)
    except (pickle.UnpicklingError, struct.error, ValueError, EOFError, TypeError, IndexError, AttributeError):
        return None


def _item_crc_problem(mm, start: int, length: int, found: dict | None = None) -> str | None:
    """Why the torch.save archive at bytes [start, start + length) of `mm` (a buffer: an mmap or bytes) fails its own
    checks, or None when it passes: a zip archive (torch.save's format; DCP writes every tensor item so) whose every
    record lies inside the item and matches the CRC-32 its central directory records (zlib.crc32 streams at GB/s: one
    pass over the bytes). Issue 34: torch.load does not check them, so a flipped byte would load as a silently wrong
    value."""
    end = start + length
    tail_from = max(start, end - (22 + 0xFFFF))
    eocd = bytes(mm[tail_from:end]).rfind(b"PK\x05\x06")
    if eocd < 0 or tail_from + eocd + 22 > end:
        return "not a torch.save zip archive (no end-of-archive record), so its bytes cannot be checked"
    eocd += tail_from
    n, cd_size, cd_off = struct.unpack_from("<HII", mm, eocd + 10)
    if 0xFFFF == n or 0xFFFFFFFF in (cd_size, cd_off):
        loc = eocd - 20
        if loc < start or mm[loc:loc + 4] != b"PK\x06\x07":
            return "its zip64 end locator is missing"
        (z64,) = struct.unpack_from("<Q", mm, loc + 8)
        if not start <= start + z64 <= end - 56 or mm[start + z64:start + z64 + 4] != b"PK\x06\x06":
            return "its zip64 end record lies outside the item"
        n, cd_size, cd_off = struct.unpack_from("<QQQ", mm, start + z64 + 32)
    pos = start + cd_off
    if not start <= pos <= end or pos + cd_size > end or n > length // 46 + 1:
        return f"its zip directory (offset {cd_off}, {n} records) lies outside the item"
    mv = memoryview(mm)
    try:
        for _ in range(n):
            if pos + 46 > end or mm[pos:pos + 4] != b"PK\x01\x02":
                return "its zip directory is damaged"
            method, crc, csize, usize, nlen, xlen, clen = struct.unpack_from("<HxxxxIIIHHH", mm, pos + 10)
            (local,) = struct.unpack_from("<I", mm, pos + 42)
            name = bytes(mm[pos + 46:pos + 46 + nlen]).decode("utf-8", "replace")
            extra = bytes(mm[pos + 46 + nlen:pos + 46 + nlen + xlen])
            if 0xFFFFFFFF in (csize, usize, local):  # zip64: the large values are in the extra field, in this order
                big = [f for f, v in (("u", usize), ("c", csize), ("l", local)) if v == 0xFFFFFFFF]
                i = 0
                while i + 4 <= len(extra):
                    hid, hlen = struct.unpack_from("<HH", extra, i)
                    if hid == 1:
                        vals = struct.unpack_from(f"<{len(big)}Q", extra, i + 4) if hlen >= 8 * len(big) else ()
                        got = dict(zip(big, vals))
                        usize, csize, local = got.get("u", usize), got.get("c", csize), got.get("l", local)
                        break
                    i += 4 + hlen
            h = start + local
            if h + 30 > end or mm[h:h + 4] != b"PK\x03\x04":
                return f"record {name}: its local header lies outside the item or is damaged"
            hn, hx = struct.unpack_from("<HH", mm, h + 26)
            begin = h + 30 + hn + hx
            if begin + csize > end:
                return f"record {name}: {csize} bytes at {begin - start} run past the item's {length}"
            if method == 0:
                if csize != usize:
                    return f"record {name}: stored with {csize} bytes for {usize}"
                got, k = 0, begin
                while k < begin + csize:
                    step = min(begin + csize - k, 64 << 20)
                    got = _CRC32(mv[k:k + step], got)
                    k += step
            else:  # torch.save stores every record; a deflated one could inflate to its declared size (a bomb)
                return (f"record {name} is compressed (method {method}); torch.save stores every record "
                        "uncompressed, so this item was not written by it")
            if got != crc:
                return (f"record {name} fails its CRC-32 (recorded {crc:08x}, computed {got:08x}): the bytes were "
                        "changed after they were written")
            if found is not None:
                found[name] = crc
            pos += 46 + nlen + xlen + clen
    except (struct.error, zlib.error, ValueError) as e:
        return f"its zip records are damaged ({type(e).__name__}: {e})"
    finally:
        mv.release()
    return None


def _load_spooled(f, length: int, directory: Path | None) -> torch.Tensor:
    """A large item: copy its bytes to a temporary file in blocks and memory-map it (bounded memory). `directory`
    should be on disk (a tmpfs /tmp would hold the copy in memory)."""
    from .safe_load import load_torch

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
        elif text.isdigit() and len(text) <= len(str(MAX_ITERATION)) and int(text) <= MAX_ITERATION:
            name = iter_dirname(int(text))
        else:
            raise FormatError(f"{tracker}: holds {text[:40]!r}, not an iteration number or 'release'")
        it = safe_path(p, name, str(tracker))  # a link out of the root is refused, as the native reader does
        if not it.is_dir():
            raise FormatError(f"{tracker}: points to {name}, which is missing")
        return it
    iters = sorted(x.name for x in p.iterdir() if x.is_dir() and iteration_of(x.name) is not None) if p.is_dir() else []
    hint = f" (found {', '.join(iters[-3:])}: pass one of them)" if iters else ""
    raise FormatError(f"{p}: not a torch_dist checkpoint: no {TRACKER}, no {DCP_METADATA}{hint}")


def read_torch_dist(path: str | Path) -> TorchDistCheckpoint:
    return TorchDistCheckpoint(path)


