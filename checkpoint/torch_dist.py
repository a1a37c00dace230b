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

Writing is the inverse with bounded memory, and needs no torch: `DCPWriter` appends one item at a time to the file
of the rank that owns it (torch.save's exact bytes, written from numpy values by the file's writer thread) and keeps
only the small metadata in memory; `.metadata` and common.pt are pickled from stand-ins that name DCP's and torch's
classes (see "writing" below). The export (convert/torch_dist_io.py) writes them into an `IterationWriter`'s partial
directory and commits it like every other writer (checkpoint/commit.py), the tracker file last.
"""
from __future__ import annotations

import argparse
import copyreg
import functools
import io
import json
import mmap
import os
import pathlib
import pickle
import pickletools
import re
import struct
import sys
import tempfile
import threading
import uuid
import zipfile
import zlib
from bisect import bisect_left, bisect_right
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import product
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable

import numpy as np

from . import chunkio, store
from .commit import done_logs, write_file_atomic
from .config import ModelConfig
from .errors import ConfigError, FormatError, LayoutError, WriteError
from .layout import Layout
from .megatron import (CHECKPOINT_VERSION, DEFAULT_MEGATRON_VERSION, KEY_NAMINGS, RELEASE, TRACKER, MegatronEnum,
                       TorchDtype, arg, check_args, check_megatron_version, config_from_megatron_args,
                       hf_model_type_of, iter_dirname, iteration_of, layout_from_args, missing_model_args,
                       with_args_vocab)
from .megatron_bridge import RUN_CONFIG, load_run_config, load_train_state
from .safety import open_input, read_input, read_pointer, regular_file, safe_path

if TYPE_CHECKING:
    import torch

METADATA_JSON = "metadata.json"
DCP_METADATA = ".metadata"
COMMON_PT = "common.pt"
COMMON_ITEM = "common_state/shard_0_1"  # megatron-core >= 0.17: the common state as a DCP bytes item (no common.pt)
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
# the largest iteration number taken from a checkpoint (common.pt, the tracker): 10^10 steps is centuries of training;
# beyond it the number is damage, never a directory name (issue 34: 10**30 was used as one)
MAX_ITERATION = 10**10


# -- safe unpickling --------------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _allowed() -> dict[tuple[str, str], Any]:
    """The globals a DCP `.metadata` may name (torch is imported here, on the first read: writing needs none of it)."""
    import torch
    from torch.distributed.checkpoint import filesystem as dcp_fs
    from torch.distributed.checkpoint import metadata as dcp_md
    from torch.distributed.checkpoint import planner as dcp_planner

    class _MCoreMetadata(dcp_md.Metadata):
        """Stand-in for megatron-core's pickled `MCoreMetadata` (a DCP Metadata with `mcore_data`): data only."""

    class _MCoreSavePlan(dcp_planner.SavePlan):
        """Stand-in for megatron-core's pickled `MCoreSavePlan`: data only."""

    layouts = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}

    def _layout(name: str) -> torch.layout:
        if not isinstance(name, str) or name not in layouts:
            raise pickle.UnpicklingError(f"unknown torch layout {name!r}")
        return layouts[name]

    md, planner = "torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner"
    return {
        **{(md, n): getattr(dcp_md, n) for n in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                                 "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                                                 "StorageMeta", "_MEM_FORMAT_ENCODING")},
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): dcp_fs._StorageInfo,
        # megatron-core keeps its save plans in the metadata (`all_local_plans`) to reuse them: data classes too
        **{(planner, n): getattr(dcp_planner, n) for n in ("SavePlan", "WriteItem", "WriteItemType",
                                                           "TensorWriteData", "LoadPlan", "ReadItem", "LoadItemType")},
        ("megatron.core.dist_checkpointing.strategies.torch", "MCoreMetadata"): _MCoreMetadata,
        ("megatron.core.dist_checkpointing.strategies.torch", "MCoreSavePlan"): _MCoreSavePlan,
        ("torch", "Size"): torch.Size,
        ("torch.serialization", "_get_layout"): _layout,
        ("collections", "OrderedDict"): OrderedDict,
        **_PATHS,
    }


# DCP's StorageMeta.checkpoint_id is the path the saver passed (torch >= 2.4: a pathlib path, e.g. torchtitan's
# `step-N`): read as pure paths (parsing only, no filesystem access)
_PATHS = {("pathlib", n): getattr(pathlib, "Pure" + n.removeprefix("Pure"))
          for n in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")}


def _dcp_md():
    from torch.distributed.checkpoint import metadata

    return metadata


def _dcp_fs():
    from torch.distributed.checkpoint import filesystem

    return filesystem


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only DCP metadata classes, torch.Size, torch dtypes and layouts; every other global is refused."""

    def __init__(self, f, source: str):
        super().__init__(f)
        self.source = source

    def find_class(self, module: str, name: str):
        import torch

        obj = _allowed().get((module, name))
        if obj is not None:
            return obj
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise FormatError(f"{self.source}: refusing to unpickle {module}.{name}: not a DCP metadata class (the file "
                          "is damaged or was not written by torch.distributed.checkpoint)")

    def persistent_load(self, pid):
        raise FormatError(f"{self.source}: unexpected persistent id in DCP metadata")


def load_dcp_metadata(path: Path) -> Any:
    """Parse a DCP `.metadata` file without running anything but DCP's own data classes."""
    if os.path.lexists(path):
        regular_file(path, ".metadata")  # a FIFO or a device there: one line, never a read that blocks
    try:
        with os.fdopen(open_input(path), "rb") as f:
            md = _MetadataUnpickler(f, str(path)).load()
    except FormatError:
        if os.path.lexists(path):
            raise
        raise FormatError(f"{path}: missing; {path.parent} is not a complete torch_dist checkpoint (DCP writes "
                          ".metadata last)") from None
    except FileNotFoundError:
        raise FormatError(f"{path}: missing; {path.parent} is not a complete torch_dist checkpoint (DCP writes "
                          ".metadata last)") from None
    except Exception as e:  # truncated or garbage bytes
        raise FormatError(f"{path}: cannot parse DCP metadata ({type(e).__name__}: {e})") from None
    if not isinstance(md, _dcp_md().Metadata):
        raise FormatError(f"{path}: holds a {type(md).__name__}, not DCP Metadata")
    return md


# torch's dtypes by name (str(dtype) without "torch."), with their sizes in bytes (torch.dtype.itemsize): the ones a
# `.metadata` or common.pt can name and the torch-free readers below take (any other name: torch's own reader decides)
_TORCH_DTYPES = {"bool": 1, "uint8": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8, "uint16": 2, "uint32": 4,
                 "uint64": 8, "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "complex32": 4, "complex64": 8,
                 "complex128": 16, "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
                 "float8_e8m0fnu": 1}


class _Dtype(TorchDtype):
    """A torch dtype named by a pickle (the global torch.<name>), read without importing torch: equal to torch's dtype
    of that name (checkpoint.megatron.TorchDtype: their str() agree), with its `itemsize`; `torch_dtype()` gives the
    real one (importing torch) where torch needs it. Written back into a pickle it is torch's global again."""

    __slots__ = ()

    def __init__(self, name: str) -> None:  # (any torch dtype, not only those the native format stores)
        if name not in _TORCH_DTYPES:
            raise pickle.UnpicklingError(f"torch.{name}")
        self.name = name

    @property
    def itemsize(self) -> int:
        return _TORCH_DTYPES[self.name]


def torch_dtype(dtype) -> "torch.dtype":
    """torch's dtype for a dtype read from a torch_dist checkpoint (a torch.dtype, or the torch-free stand-in)."""
    if isinstance(dtype, TorchDtype):
        import torch

        return getattr(torch, dtype.name)
    return dtype


class _Light:
    """Plain stand-ins of DCP's metadata classes, for reading `.metadata` without importing
    torch.distributed.checkpoint (a second and a half of CPU: it imports torch.distributed.tensor): each takes the
    state pickle gives it (a dict, or TensorProperties' tuple) and nothing else."""

    class _Data:
        _fields: tuple[str, ...] = ()

        def __setstate__(self, state):
            if isinstance(state, tuple) and len(state) == 2 and state[0] is None and isinstance(state[1], dict):
                state = state[1]  # (no __dict__ state, slots): dataclasses with slots
            if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
                raise pickle.UnpicklingError(f"{type(self).__name__}: unexpected state {type(state).__name__}")
            self.__dict__.update(state)

        def __getattr__(self, name):  # a field the pickle did not carry: the dataclass default (None)
            if name.startswith("__") or name not in type(self)._fields:
                raise AttributeError(name)
            return None

    class Metadata(_Data):
        _fields = ("state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version", "mcore_data")

    class TensorStorageMetadata(_Data):
        _fields = ("properties", "size", "chunks")

    class BytesStorageMetadata(_Data):
        pass

    class ChunkStorageMetadata(_Data):
        _fields = ("offsets", "sizes")

    class TensorProperties(_Data):
        _fields = ("dtype", "layout", "requires_grad", "memory_format", "pin_memory")

        def __setstate__(self, state):
            if not isinstance(state, tuple) or len(state) != 5:
                raise pickle.UnpicklingError("TensorProperties: unexpected state")
            self.dtype, self.layout, self.requires_grad, self.memory_format, self.pin_memory = state

    class MetadataIndex(_Data):
        _fields = ("fqn", "offset", "index")

        def __hash__(self):
            return hash((self.fqn, self.offset))

        def __eq__(self, other):
            return isinstance(other, _Light.MetadataIndex) and (self.fqn, self.offset) == (other.fqn, other.offset)

    class _StorageInfo(_Data):
        _fields = ("relative_path", "offset", "length", "transform_descriptors")

    class StorageMeta(_Data):
        _fields = ("checkpoint_id", "save_id", "load_id", "modules")

    class Plan(_Data):  # megatron-core's saved plans (all_local_plans): carried, never used
        _fields = ()

        def __setstate__(self, state):
            self.state = state

    @staticmethod
    def value(*args):  # enums (called with their value), torch.Size (called with a tuple), _get_layout
        return args[0] if len(args) == 1 else args


class _LightUnpickler(pickle.Unpickler):
    """`.metadata` into _Light's stand-ins: the globals _allowed() lists, and nothing else (anything else: None, and
    the metadata is read by _MetadataUnpickler, which refuses or takes it)."""

    _MD = "torch.distributed.checkpoint.metadata"
    _PLANNER = "torch.distributed.checkpoint.planner"

    def find_class(self, module: str, name: str):
        if module == self._MD and name in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                           "ChunkStorageMetadata", "TensorProperties", "MetadataIndex", "StorageMeta"):
            return getattr(_Light, name)
        if (module, name) == ("megatron.core.dist_checkpointing.strategies.torch", "MCoreMetadata"):
            return _Light.Metadata
        if (module, name) == ("torch.distributed.checkpoint.filesystem", "_StorageInfo"):
            return _Light._StorageInfo
        if (module, name) in ((self._MD, "_MEM_FORMAT_ENCODING"), ("torch", "Size"),
                              ("torch.serialization", "_get_layout")):
            return _Light.value
        if module == self._PLANNER and name in ("WriteItemType", "LoadItemType"):
            return _Light.value
        if (module == self._PLANNER and name in ("SavePlan", "WriteItem", "TensorWriteData", "LoadPlan", "ReadItem")
                or (module, name) == ("megatron.core.dist_checkpointing.strategies.torch", "MCoreSavePlan")):
            return _Light.Plan
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        if (module, name) in _PATHS:
            return _PATHS[(module, name)]
        if module == "torch" and name in _TORCH_DTYPES:
            return _Dtype(name)  # (no torch import: the reader of the import path stays torch-free)
        raise pickle.UnpicklingError(f"{module}.{name}")

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("persistent id")


def _load_metadata_light(path: Path) -> "_Light.Metadata | None":
    """DCP's `.metadata` read into plain stand-ins (no torch.distributed import), or None where that does not work
    (a missing, damaged or unusual file: load_dcp_metadata then reads it, or says why not)."""
    try:
        with os.fdopen(open_input(path), "rb") as f:  # never blocks: a FIFO is refused
            md = _LightUnpickler(f).load()
    except Exception:  # noqa: BLE001 - the full reader decides and names the problem
        return None
    return md if isinstance(md, _Light.Metadata) else None



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


def _src(path: Path, data: bytes | None):
    """What the common-state readers open: the file, or a fresh stream over an item's bytes (common state inside DCP)."""
    return path if data is None else io.BytesIO(data)


def _torch_save_pickle(path: Path, data: bytes | None = None) -> bytes:
    """The data.pkl record of a torch.save zip file (read as bytes, never unpickled)."""
    with zipfile.ZipFile(_src(path, data)) as z:
        names = [n for n in z.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
        if not names:
            raise FormatError(f"{path}: not a torch.save archive (no data.pkl)")
        return z.read(names[0])


class _TorchDecides(Exception):
    """common.pt is not plain data the torch-free reader takes (a tensor, a legacy archive, a global outside its
    allowlist that is still benign): torch.load(weights_only=True) reads it, or refuses it."""


class _MegatronClass(_TorchDecides):
    """common.pt names a Megatron class outside safe_load's allowlist (and nothing that could run code): torch's reader
    would refuse it too, so it is ignored with a note without asking torch."""


_UNREAD = object()


def _ignored_note(path: Path, why: str) -> str:
    return (f"{path.name} ignored: it holds Megatron objects shardkit does not unpickle ({why[:120]}); iteration and "
            "args are taken from elsewhere")


@functools.lru_cache(maxsize=None)
def _common_globals() -> dict[tuple[str, str], Any]:
    """What the torch-free common.pt reader resolves: safe_load's allowlist (argparse.Namespace, Megatron's enums and
    configs as inert stand-ins, numpy's RNG state, paths, signals) and OrderedDict; torch's dtypes are _Dtype."""
    from .safe_load import allowed_globals

    out = {tuple(name.rsplit(".", 1)): obj for name, obj in allowed_globals().items()}
    out[("collections", "OrderedDict")] = OrderedDict
    return out


class _CommonUnpickler(pickle.Unpickler):
    """common.pt's data.pkl, plain data only, without torch: the globals _common_globals() names and torch's dtypes
    (as _Dtype); a persistent id (a tensor's storage) or any other global raises _TorchDecides (nothing is built)."""

    def find_class(self, module: str, name: str):
        obj = _common_globals().get((module, name))
        if obj is not None:
            return obj
        if module == "torch" and name in _TORCH_DTYPES:
            return _Dtype(name)
        raise _TorchDecides(f"{module}.{name}")

    def persistent_load(self, pid):
        raise _TorchDecides("a tensor")


def _load_common_light(path: Path, data: bytes | None = None) -> Any:
    """common.pt read without torch: its zip archive's data.pkl (checked by its crc32) unpickled by _CommonUnpickler.
    The result equals torch.load(weights_only=True)'s under safe_load's allowlist, torch dtypes as _Dtype (equal to
    torch's; tests/test_torch_dist.py compares them). FormatError (the same line the full reader gives) when the
    pickle references a global that could run code; _TorchDecides where torch's reader must decide."""
    try:
        with zipfile.ZipFile(_src(path, data)) as z:
            names = z.namelist()
            pkl = [n for n in names if n.endswith("/data.pkl") or n == "data.pkl"]
            if len(pkl) != 1 or any(n.split("/", 1)[-1].startswith("data/") for n in names):
                raise _TorchDecides("not a plain-data archive")
            data = z.read(pkl[0])
    except (zipfile.BadZipFile, OSError, KeyError, ValueError, EOFError, RuntimeError) as e:
        raise _TorchDecides(str(e)) from None  # (damage, a legacy archive: torch's reader says what is wrong)
    try:
        return _CommonUnpickler(io.BytesIO(data)).load()
    except _TorchDecides as e:
        bad = [g for g in _pickle_globals(data) if not _BENIGN_GLOBALS.match(g)]
        if bad:
            raise FormatError(f"{path}: refusing to unpickle: it references {bad[0].replace(' ', '.')}, which is not "
                              "plain data (a pickle that would run code); the file was not loaded") from None
        if str(e).startswith("megatron."):
            raise _MegatronClass(str(e)) from None
        raise
    except Exception as e:  # noqa: BLE001 - a malformed pickle: torch's reader names the problem
        raise _TorchDecides(f"{type(e).__name__}: {e}") from None


COMMON_MAX = 256 << 20  # bytes: common.pt's records, uncompressed (Megatron's hold args and small states: KBs to MBs)


def _check_common_size(path: Path, data: bytes | None = None) -> None:
    """Bound what reading common.pt can cost before anything is read (issue 34: a 3 MB deflate-compressed record
    inflated to 6.3 GB): the file itself, and its zip records' declared uncompressed sizes (both readers, zipfile's
    and torch's, stop at the declared size or fail)."""
    size = path.stat().st_size if data is None else len(data)
    if size > COMMON_MAX:
        raise FormatError(f"{path}: {size:,} bytes, more than a common.pt's {COMMON_MAX:,}; refusing to read it")
    try:
        with zipfile.ZipFile(_src(path, data)) as z:
            infos = z.infolist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError):
        return  # not a zip archive (a legacy torch.save, damage): the readers below say what it is
    total = sum(max(0, i.file_size) for i in infos)
    if total > COMMON_MAX:
        big = max(infos, key=lambda i: i.file_size)
        raise FormatError(f"{path}: its records would inflate to {total:,} bytes (record {big.filename}: "
                          f"{big.file_size:,} from {big.compress_size:,}), more than a common.pt's {COMMON_MAX:,}; "
                          "refusing to read it")


def load_common(path: Path, data: bytes | None = None) -> tuple[dict | None, str | None]:
    """common.pt as (dict, None), or (None, note) when it cannot be loaded as plain data but references only benign
    Megatron data classes. Raises FormatError naming the file when it references anything that could run code.
    Plain data is read without torch (_load_common_light); torch.load(weights_only=True) reads the rest. With `data`
    (megatron-core >= 0.17: the common state is the DCP item `common_state/shard_0_1`, its bytes already CRC-checked)
    the same readers, under the same bounds, read those bytes; `path` then only labels them."""
    from .safe_load import load_torch

    if data is None and not regular_file(path, missing_ok=True):  # a FIFO or device: one line naming it
        return None, f"{path.name} is missing"
    _check_common_size(path, data)
    try:
        obj = _load_common_light(path) if data is None else _load_common_light(path, data)  # (a 1-arg stub in tests)
    except _MegatronClass as m:  # what torch's reader would refuse the same way (the note below), without torch
        return None, _ignored_note(path, f"refusing to unpickle {m}: not plain data (a pickle that could run code); "
                                         "the file was not loaded")
    except _TorchDecides:
        obj = _UNREAD
    try:
        if obj is _UNREAD:
            obj = load_torch(_src(path, data), what=None if data is None else str(path))
    except FormatError as e:
        try:
            globs = _pickle_globals(_torch_save_pickle(path, data))
        except (zipfile.BadZipFile, OSError, KeyError, FormatError) as z:
            raise FormatError(f"{path}: not a readable torch.save file ({type(z).__name__}: {z})") from None
        bad = [g for g in globs if not _BENIGN_GLOBALS.match(g)]
        if bad:
            raise FormatError(f"{path}: refusing to unpickle: it references {bad[0].replace(' ', '.')}, which is not "
                              "plain data (a pickle that would run code); the file was not loaded") from None
        return None, _ignored_note(path, str(e).split(": ", 1)[-1])
    if data is not None and isinstance(obj, list) and len(obj) == 1:  # megatron-core's common_state item: [dict]
        obj = obj[0]
    if not isinstance(obj, dict):
        return None, f"{path.name} ignored: it holds a {type(obj).__name__}, not a dict"
    return obj, None


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


# -- writing: torch.save's and DCP's bytes, without torch ---------------------------------------------------------
#
# An item of a `.distcp` file is what `torch.save(tensor, f)` writes: a zip archive (stored, not compressed) of the
# records archive/data.pkl (a protocol-2 pickle: torch._utils._rebuild_tensor_v2 of a persistent storage id),
# .format_version, .storage_alignment, byteorder, data/0 (the raw bytes, 64-byte aligned), version and
# .data/serialization_id, laid out as PyTorch's stream writer (miniz) lays them out. Those bytes are written here
# directly from the numpy values (no torch import, no copy of the data; one crc32 pass, which the zip needs), equal
# byte for byte to torch.save's (tests/test_torch_dist.py compares them, for every dtype the format stores). The
# `.metadata` pickle and common.pt are written the same way: stand-ins that pickle as DCP's and torch's own classes
# (by their import paths), read back by torch itself. Items of 4 GiB and more (zip64 records), dtypes outside the
# table and tensors inside common.pt fall back to torch.save itself.

_ALIGN = 64  # torch.save's storage alignment (.storage_alignment)
_ZIP32 = (1 << 32) - (1 << 20)  # beyond this the stream writer switches to zip64 records: torch.save writes those
# PyTorch's serialization id begins with a hash of the set of record names (c10::hash of each name, combined in the
# order of an std::unordered_set): a constant per record set, taken from torch.save's output and checked against it
# in tests/test_torch_dist.py (test_item_bytes_equal_torch_save).
_NAME_HASH = {True: 15728199511854643026,  # a tensor: data.pkl, .format_version, .storage_alignment, byteorder,
                                           # data/0, version
              False: 2908468677762923104}  # no storage (common.pt, a None object): the same without data/0
# the dtypes whose tensors torch.save writes as _rebuild_tensor_v2 of a typed storage (FP8 takes another form, which
# torch_dist exports never hold: torch.save writes it)
_STORAGE_TYPES = {"bfloat16": "BFloat16Storage", "float16": "HalfStorage", "float32": "FloatStorage"}
_MASK64 = (1 << 64) - 1
# The zip's CRC-32 of every byte is most of what an export costs beyond the native copy: zlib's runs at ~2.5-3.4 GB/s
# here (0.3-0.4 CPU-s per GB), ISA-L's (the `isal` package, where installed) at ~11 GB/s; the same values (the CRC-32
# the zip format defines; the item bytes are identical either way). It runs on the rank files' writer threads (zlib
# releases the GIL on large buffers), so it costs CPU time more than wall time (scripts/BENCH.md, issue 17).
try:
    from isal.isal_zlib import crc32 as _CRC32
except ImportError:  # (an optional dependency)
    _CRC32 = zlib.crc32


def _hash_combine(seed: int, value: int) -> int:
    """c10::hash_combine on 64-bit size_t."""
    return (seed ^ ((value + 0x9E3779B9 + (seed << 6) + (seed >> 2)) & _MASK64)) & _MASK64


class _ZipParts:
    """The byte pieces of one torch.save archive, as PyTorch's PyTorchStreamWriter writes them: each record's local
    header (data descriptor flag, no timestamps, an "FB" extra field padding the data to 64 bytes), its data, its data
    descriptor; then the serialization id, the central directory, zip64 end records and the end record."""

    def __init__(self, crc32: Callable = _CRC32) -> None:
        self.crc32 = crc32
        self.parts: list = []
        self.pos = 0
        self.central: list[bytes] = []
        self.crcs = 0  # hash_combine of every record's crc32, in write order

    def record(self, name: str, data, nbytes: int | None = None) -> None:
        full = f"archive/{name}".encode()
        start = self.pos + 30 + len(full) + 4
        pad = -start % _ALIGN
        extra = b"FB" + struct.pack("<H", pad) + b"Z" * pad
        n = len(data) if nbytes is None else nbytes
        crc = self.crc32(data)
        self.central.append(struct.pack("<4sHHHHHHIIIHHHHHII", b"PK\x01\x02", 0, 0, 0x0808, 0, 0, 0, crc, n, n,
                                        len(full), 0, 0, 0, 0, 0, self.pos) + full)
        head = struct.pack("<4sHHHHHIIIHH", b"PK\x03\x04", 0, 0x0808, 0, 0, 0, 0, 0, 0, len(full), len(extra))
        tail = struct.pack("<4sIII", b"PK\x07\x08", crc, n, n)
        self.parts += [head + full + extra, data, tail]
        self.pos += 30 + len(full) + len(extra) + n + len(tail)
        self.crcs = _hash_combine(self.crcs, crc)

    def finish(self, has_storage: bool) -> list:
        self.record("version", b"3\n")
        self.record(".data/serialization_id", f"{_NAME_HASH[has_storage]:020d}{self.crcs:020d}".encode())
        cd = b"".join(self.central)
        n, cd_off, eocd64 = len(self.central), self.pos, self.pos + len(cd)
        self.parts.append(cd + struct.pack("<4sQHHIIQQQQ", b"PK\x06\x06", 44, 0x031E, 0x2D, 0, 0, n, n, len(cd), cd_off)
                          + struct.pack("<4sIQI", b"PK\x06\x07", 0, eocd64, 1)
                          + struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, n, n, len(cd), cd_off, 0))
        return self.parts


def _archive(pickled: bytes, storage=None, nbytes: int = 0, crc32: Callable = _CRC32) -> list:
    z = _ZipParts(crc32)
    z.record("data.pkl", pickled)
    z.record(".format_version", b"1")
    z.record(".storage_alignment", str(_ALIGN).encode())
    z.record("byteorder", sys.byteorder.encode())
    if storage is not None:
        z.record("data/0", storage, nbytes)
    return z.finish(storage is not None)


class _GlobalRef:
    """Base of the stand-in classes the pickles here write as a global by name (`_pickle_as`: module.Class). An
    instance pickles as an instance of that class (NEWOBJ, then BUILD with `_state` unless it is None), as pickle
    writes a dataclass instance."""

    _pickle_as = ""

    def __reduce_ex__(self, protocol):
        state = self.__dict__.get("_state")
        return (copyreg.__newobj__, (type(self),)) if state is None else (copyreg.__newobj__, (type(self),), state)


@functools.lru_cache(maxsize=None)
def _global_ref(path: str) -> type:
    return type(path.rsplit(".", 1)[-1], (_GlobalRef,), {"_pickle_as": path})


def _instance(path: str, state: dict | tuple | None = None) -> _GlobalRef:
    obj = object.__new__(_global_ref(path))
    obj.__dict__["_state"] = state
    return obj


class _Call:
    """Pickles as a call of the global `fn` (a _GlobalRef class) with `args`."""

    __slots__ = ("fn", "args")

    def __init__(self, fn: type, args: tuple):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


class _Storage:
    """The storage of an item: pickled as torch.save's persistent id ('storage', <Type>Storage, '0', 'cpu', numel)."""

    __slots__ = ("type", "numel")

    def __init__(self, dtype: str, numel: int):
        self.type, self.numel = _global_ref(f"torch.{_STORAGE_TYPES[dtype]}"), numel


class _NeedsTorch(Exception):
    """A value only torch can pickle (a tensor in common.pt): written by torch.save instead."""


class _ArgsPickler(pickle._Pickler):
    """The pickler for the files written here (torch.save's data.pkl with protocol 2, and DCP's `.metadata`): a Megatron
    enum member in the args (checkpoint.megatron.MegatronEnum, or safe_load's inert stand-in of one read from another
    checkpoint) is written as pickle writes the real member (GLOBAL <module> <Class>, called with its value) without
    importing Megatron, a torch dtype by name (checkpoint.megatron.TorchDtype) as the global torch.<name> without
    importing torch, the stand-ins above as the classes they name; everything else as pickle does. The pure-Python
    pickler, for its save_global hook: these pickles are small."""

    standalone = False  # True: writing torch.save's data.pkl here (tensors need torch.save), else inside torch.save

    def persistent_id(self, obj):
        if type(obj) is _Storage:
            return ("storage", obj.type, "0", "cpu", obj.numel)
        return None

    def reducer_override(self, obj):
        if isinstance(obj, MegatronEnum):
            return _global_ref(obj.path), (obj.value,)
        if isinstance(obj, TorchDtype):
            return obj.name  # -> save_global
        safe_load = sys.modules.get(f"{__package__}.safe_load")  # its stand-ins exist only once it is imported
        if safe_load is not None and isinstance(obj, safe_load.MegatronObject):
            if set(vars(obj)) != {"args"} or len(obj.args) != 1:
                raise FormatError(f"cannot write {obj!r} back into common.pt: shardkit keeps only its data")
            return _global_ref(obj.qualname), obj.args
        # (no Tensor yet while another thread is still importing torch, e.g. the conversion's proof preloading it:
        # then no tensor exists to be pickled either)
        tensor = getattr(sys.modules.get("torch"), "Tensor", None)
        if self.standalone and tensor is not None and isinstance(obj, tensor):
            raise _NeedsTorch  # only torch.save writes its storage records
        return NotImplemented

    def save_global(self, obj, name=None):
        if isinstance(obj, type) and issubclass(obj, _GlobalRef):
            module, qual = obj._pickle_as.rsplit(".", 1)
        elif isinstance(obj, TorchDtype):
            module, qual = "torch", obj.name
        else:
            return super().save_global(obj, name)
        self.write(pickle.GLOBAL + module.encode("utf-8") + b"\n" + qual.encode("utf-8") + b"\n")
        self.memoize(obj)


def _pickled(obj, protocol: int = 2) -> bytes:
    buf = io.BytesIO()
    p = _ArgsPickler(buf, protocol=protocol)
    p.standalone = True
    p.dump(obj)
    return buf.getvalue()


def tensor_item(value: np.ndarray, crc32: Callable = _CRC32) -> list | None:
    """The bytes torch.save writes for a tensor of `value`'s dtype, shape and data, as pieces to write in order (the
    data piece is a view of `value`), or None where only torch.save can write it (a dtype outside the format's, an item
    of 4 GiB or more). (`crc32` lambda _: 0 gives the right lengths at no cost.)"""
    try:
        dtype = store.dtype_name(value.dtype)
    except FormatError:
        return None
    if dtype not in _STORAGE_TYPES or value.nbytes >= _ZIP32 or value.size == 0:
        return None
    value = chunkio.contiguous(value)
    shape = tuple(int(s) for s in value.shape)
    stride, n = [], 1
    for s in reversed(shape):
        stride.append(n)
        n *= max(s, 1)
    rebuild = _Call(_global_ref("torch._utils._rebuild_tensor_v2"),
                    (_Storage(dtype, value.size), 0, shape, tuple(reversed(stride)), False, OrderedDict()))
    data = memoryview(value.reshape(-1).view(np.uint8))
    return _archive(_pickled(rebuild), data, value.nbytes, crc32)


def torch_save_bytes(obj) -> bytes:
    """torch.save(obj)'s bytes for plain data (no tensors; Megatron enums and torch dtypes by name, see _ArgsPickler),
    without torch; with a tensor inside, torch.save's own (torch is then imported anyway)."""
    try:
        return b"".join(bytes(p) for p in _archive(_pickled(obj)))
    except _NeedsTorch:
        import torch

        buf = io.BytesIO()
        torch.save(obj, buf, pickle_module=_ARGS_PICKLE)
        return buf.getvalue()


def _dtype_str(dtype) -> str:
    """A torch dtype's name without the prefix, from a torch.dtype or a name (bf16, bfloat16, torch.bfloat16, ...)."""
    name = str(dtype).removeprefix("torch.")
    return store.DTYPE_ALIASES.get(name, name)


def _size(dims) -> _Call:
    return _Call(_global_ref("torch.Size"), (tuple(int(d) for d in dims),))


class DCPWriter:
    """Append items to `__<rank>_<part>.distcp` files and build DCP's Metadata. Each file is written whole through
    one `RankFile` (one file open at a time per process). Nothing here imports torch: the declarations and storage
    entries are plain tuples (`metadata()` builds DCP's own objects from them, importing torch, for callers that
    want them), and `.metadata` is pickled from stand-ins of DCP's classes."""

    # bytes of values handed to the rank files' writer threads, not yet written (as convert.writer.INFLIGHT_BYTES)
    IN_FLIGHT = 128 << 20

    def __init__(self, directory: Path):
        self.dir = Path(directory)
        self.in_flight = _InFlight(self.IN_FLIGHT)
        # name -> (global shape, dtype name, [(offsets, sizes)]) for a tensor, None for a bytes object
        self.state_dict_metadata: dict[str, tuple | None] = {}
        # (name, offsets or None) -> (file name, offset, length)
        self.storage_data: dict[tuple, tuple[str, int, int]] = {}

    def declare_tensor(self, name: str, shape: Iterable[int], dtype: "torch.dtype | str",
                       chunks: Iterable[tuple[tuple[int, ...], tuple[int, ...]]]) -> None:
        self.state_dict_metadata[name] = (tuple(int(s) for s in shape), _dtype_str(dtype),
                                          [(tuple(int(x) for x in o), tuple(int(x) for x in s)) for o, s in chunks])

    def declare_object(self, name: str) -> None:
        self.state_dict_metadata[name] = None

    def rank_file(self, rank: int, part: int = 0) -> "RankFile":
        return RankFile(self, f"__{rank}_{part}.distcp")

    def metadata(self, checkpoint_id: str, save_id: str | None = None) -> "Any":
        """DCP's Metadata object of what was declared and written (imports torch)."""
        import torch

        md, fs = _dcp_md(), _dcp_fs()
        sdm = {}
        for name, d in self.state_dict_metadata.items():
            if d is None:
                sdm[name] = md.BytesStorageMetadata()
                continue
            shape, dtype, chunks = d
            sdm[name] = md.TensorStorageMetadata(
                properties=md.TensorProperties(dtype=getattr(torch, dtype)), size=torch.Size(shape),
                chunks=[md.ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s in chunks])
        storage = {md.MetadataIndex(fqn, None if off is None else torch.Size(off)): fs._StorageInfo(*info)
                   for (fqn, off), info in self.storage_data.items()}
        return md.Metadata(state_dict_metadata=sdm, planner_data=None, storage_data=storage,
                           storage_meta=md.StorageMeta(checkpoint_id=checkpoint_id, save_id=save_id or
                                                       str(uuid.uuid4())),
                           version=DCP_VERSION)

    def metadata_bytes(self, checkpoint_id: str, save_id: str | None = None) -> bytes:
        """`.metadata`: what pickle.dump of metadata() writes, pickled from stand-ins without torch."""
        md = "torch.distributed.checkpoint.metadata."
        layout = _Call(_global_ref("torch.serialization._get_layout"), ("torch.strided",))
        contiguous = _Call(_global_ref(md + "_MEM_FORMAT_ENCODING"), (0,))
        sdm = {}
        for name, d in self.state_dict_metadata.items():
            if d is None:
                sdm[name] = _instance(md + "BytesStorageMetadata")
                continue
            shape, dtype, chunks = d
            props = _instance(md + "TensorProperties", (_global_ref(f"torch.{dtype}"), layout, False, contiguous,
                                                        False))
            sdm[name] = _instance(md + "TensorStorageMetadata", {
                "properties": props, "size": _size(shape),
                "chunks": [_instance(md + "ChunkStorageMetadata", {"offsets": _size(o), "sizes": _size(s)})
                           for o, s in chunks]})
        storage = {}
        for (fqn, off), (rel, start, length) in self.storage_data.items():
            idx = _instance(md + "MetadataIndex", {"fqn": fqn, "index": None,
                                                   "offset": None if off is None else _size(off)})
            storage[idx] = _instance("torch.distributed.checkpoint.filesystem._StorageInfo",
                                     {"relative_path": rel, "offset": start, "length": length})
        meta = _instance(md + "StorageMeta", {"checkpoint_id": checkpoint_id, "save_id": save_id or str(uuid.uuid4()),
                                              "load_id": None, "modules": []})
        return _pickled(_instance(md + "Metadata", {"state_dict_metadata": sdm, "planner_data": None,
                                                    "storage_data": storage, "storage_meta": meta,
                                                    "version": DCP_VERSION}), protocol=pickle.DEFAULT_PROTOCOL)

    def write_metadata(self, checkpoint_id: str) -> None:
        write_file_atomic(self.dir / DCP_METADATA, self.metadata_bytes(checkpoint_id))


class _InFlight:
    """Bytes handed to rank files' writer threads and not yet written (their values stay alive until then): `take`
    waits while more than `limit` are in flight (one item alone always goes)."""

    def __init__(self, limit: int):
        self.limit, self.held = limit, 0
        self.cond = threading.Condition()

    def take(self, n: int) -> None:
        with self.cond:
            while self.held and self.held + n > self.limit:
                self.cond.wait()
            self.held += n

    def wait_room(self, n: int) -> None:
        """Wait until `n` more bytes could be taken (a producer about to make a value of that size)."""
        with self.cond:
            while self.held and self.held + n > self.limit:
                self.cond.wait()

    def give(self, n: int) -> None:
        with self.cond:
            self.held -= n
            self.cond.notify_all()


class RankFile:
    """One `.distcp` file: items are appended; the storage entries go to the writer's metadata on close.

    An item's place in the file is fixed when it is added (its length does not depend on its data); its bytes are
    computed (the crc32 the zip records need) and written by the file's own writer thread, in order, while the caller
    reads the next one; memory is bounded by the writer's IN_FLIGHT bytes of values not yet written. Every SYNC_EVERY
    bytes an fsync of what is written so far starts on a helper thread, so the disk writes back while the rest is
    produced; close waits for every write and the last fsync (a write error is raised there, or by a later add)."""

    SYNC_EVERY = 128 << 20

    def __init__(self, writer: DCPWriter, name: str):
        self.writer, self.name = writer, name
        self.entries: dict = {}
        self.f = open(writer.dir / name, "wb")
        self.pos = 0
        self._unsynced = 0
        self._sync: Future | None = None
        self._syncer = ThreadPoolExecutor(1, thread_name_prefix="shardkit-sync")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="shardkit-distcp")
        self._pending: list[Future] = []

    def add_tensor(self, name: str, offsets: tuple[int, ...], value: "torch.Tensor | np.ndarray") -> int:
        """Append one tensor item (torch.save's bytes; written from numpy values without torch); its length."""
        arr = value if isinstance(value, np.ndarray) else None
        if arr is None:
            try:
                arr = store.to_numpy(value.detach().cpu())
            except (FormatError, KeyError):  # a dtype numpy has no view for: torch.save below
                arr = None
        if arr is not None:
            arr = chunkio.contiguous(arr)  # (gathered once, here, when it is not)
        layout = tensor_item(arr, crc32=lambda _: 0) if arr is not None else None  # the lengths only
        if layout is not None:
            length = sum(len(p) if isinstance(p, bytes) else p.nbytes for p in layout)
            self._submit(length, arr.nbytes, functools.partial(tensor_item, arr))
        else:
            import torch

            if isinstance(value, np.ndarray):
                value = store.from_numpy(chunkio.contiguous(value))
            value = value.detach().contiguous()
            if value.untyped_storage().nbytes() != value.numel() * value.element_size():
                value = value.clone()  # torch.save writes whole storages: never a view into a bigger one
            buf = io.BytesIO()
            torch.save(value, buf)
            data = buf.getvalue()
            length = len(data)
            self._submit(length, length, lambda: [data])
        self.entries[(name, tuple(int(o) for o in offsets))] = (self.name, self.pos - length, length)
        return length

    def add_bytes(self, name: str, data: bytes) -> int:
        data = bytes(data)
        self._submit(len(data), len(data), lambda: [data])
        self.entries[(name, None)] = (self.name, self.pos - len(data), len(data))
        return len(data)

    def _submit(self, length: int, held: int, parts: Callable[[], list]) -> None:
        for f in [f for f in self._pending if f.done()]:
            self._pending.remove(f)
            f.result()  # a failed write is raised here
        self.writer.in_flight.take(held)
        try:
            self._pending.append(self._writer.submit(self._write, parts, length, held))
        except BaseException:
            self.writer.in_flight.give(held)
            raise
        self.pos += length

    def _write(self, parts: Callable[[], list], length: int, held: int) -> None:
        try:
            n = 0
            for p in parts():
                n += self.f.write(p)
            if n != length:
                raise WriteError(f"{self.writer.dir / self.name}: wrote {n} bytes of an item of {length}")
        finally:
            self.writer.in_flight.give(held)
        self._unsynced += length
        if self._unsynced >= self.SYNC_EVERY and (self._sync is None or self._sync.done()):
            if self._sync is not None:
                self._sync.result()  # raise a failed background fsync here
            self.f.flush()
            self._sync, self._unsynced = self._syncer.submit(os.fsync, self.f.fileno()), 0

    def close(self) -> dict:
        if self.f.closed:  # (closed already, e.g. by close_all)
            return self.entries
        try:
            self._writer.shutdown(wait=True)
            for f in self._pending:
                f.result()
            if self._sync is not None:
                self._sync.result()
            self.f.flush()
            os.fsync(self.f.fileno())
        finally:
            self._writer.shutdown(wait=True, cancel_futures=True)
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
            self._writer.shutdown(wait=True, cancel_futures=True)  # nothing writes once the file is closed
            self._syncer.shutdown()  # waits for a background fsync: the file stays open until it is done
            self.f.close()


def close_all(files: Iterable[RankFile]) -> None:
    """Close rank files together: their last writes and fsyncs run concurrently (one after another, each close would
    wait for its own file's write-back alone); the first failure is raised once all are done."""
    files = list(files)
    if len(files) <= 1:
        for f in files:
            f.close()
        return
    with ThreadPoolExecutor(min(len(files), 16), thread_name_prefix="shardkit-close") as pool:
        done = [pool.submit(f.close) for f in files]
    for d in done:
        d.result()


def none_object_bytes() -> bytes:
    """The item megatron-core writes for a ShardedObject whose data is None (e.g. a linear layer's _extra_state
    without FP8): torch.save of the list of local objects."""
    return torch_save_bytes([None])


_ARGS_PICKLE = type(sys)("shardkit_common_pickle")
_ARGS_PICKLE.Pickler = _ArgsPickler


# megatron-core >= 0.17's metadata.json names no common backend (there is no common.pt)
BACKEND_NEWEST = {"sharded_backend": "torch_dist", "sharded_backend_version": 1}
INTEGRITY = "integrity.json"  # megatron-core 0.19's manifest for dist_checkpointing.load(verify_integrity=True)
_HASH_CHUNK = 1 << 20


def write_common(directory: Path, common: dict, meta: "DCPWriter | None" = None,
                 megatron_version: str = DEFAULT_MEGATRON_VERSION) -> None:
    """Megatron's common state and metadata.json in the layout of `megatron_version` (checkpoint.megatron: "0.16"
    common.pt; "0.19" the DCP item `common_state/shard_0_1`, torch.save of the one-element list of local objects as
    megatron-core >= 0.17 saves a ShardedObject, in a rank-0 file of its own and declared in `meta`, so it must come
    before `meta.write_metadata`)."""
    directory = Path(directory)
    check_megatron_version(megatron_version)
    if megatron_version == "0.16":
        write_file_atomic(directory / COMMON_PT, torch_save_bytes(common))
        backend = BACKEND
    else:
        if meta is None:
            raise ValueError("the common-state item needs the DCPWriter that writes .metadata")
        used = {info[0] for info in meta.storage_data.values()}
        part = next(k for k in range(len(used) + 1) if f"__0_{k}.distcp" not in used)
        with meta.rank_file(0, part) as f:
            f.add_bytes(COMMON_ITEM, torch_save_bytes([common]))
        meta.declare_object(COMMON_ITEM)
        backend = BACKEND_NEWEST
    write_file_atomic(directory / METADATA_JSON, json.dumps(backend))


def _sha256(path: Path) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_HASH_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def write_integrity(directory: Path) -> None:
    """integrity.json, as megatron-core 0.19's save_integrity_manifest writes it and its
    `dist_checkpointing.load(..., verify_integrity=True)` (Megatron-LM's --verify-integrity) checks it: the SHA-256 of
    every regular file directly in the iteration directory but itself, by name, sorted ({"algorithm": "sha256",
    "files": {...}}, indent 2). Written last: one more read of the checkpoint's files (as Megatron's own), in
    parallel. The writer's resume records (job.json, done logs: removed by the commit) are not part of it."""
    directory = Path(directory)
    transient = {INTEGRITY, "job.json", *(p.name for p in done_logs(directory))}  # the writer's, gone at commit
    names = sorted(e.name for e in os.scandir(directory) if e.is_file(follow_symlinks=False)
                   and e.name not in transient)
    with ThreadPoolExecutor(min(8, max(1, len(names))), thread_name_prefix="shardkit-sha256") as pool:
        digests = list(pool.map(lambda n: _sha256(directory / n), names))
    write_file_atomic(directory / INTEGRITY, json.dumps({"algorithm": "sha256", "files": dict(zip(names, digests))},
                                                        indent=2))


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
    body["digest"] = _digest(body)
    write_file_atomic(Path(directory) / SIDECAR, json.dumps(body, indent=1) + "\n")


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
    except (FormatError, ConfigError, LayoutError) as e:
        raise FormatError(f"{p}: {str(e).removeprefix('manifest: ')}") from None
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise FormatError(f"{p}: malformed ({type(e).__name__}: {e})") from None
    return {**d, "model": model, "layout": layout}


__all__ = ["TorchDistCheckpoint", "TDTensor", "read_torch_dist", "resolve_torch_dist", "load_dcp_metadata",
           "load_common", "DCPWriter", "RankFile", "close_all", "write_common", "write_integrity", "INTEGRITY", "write_sidecar", "load_sidecar", "SIDECAR",
           "HF_SUBDIR",
           "none_object_bytes", "BACKEND", "TRACKER", "CHECKPOINT_VERSION"]
