"""torch_dist's pickles read without running pickle code shardkit does not know: DCP's `.metadata` through an
unpickler that resolves only DCP's own metadata classes (into plain stand-ins, _Light, where torch is not needed),
common.pt's data.pkl through one that resolves checkpoint.safe_load's allowlist and nothing else (torch dtypes by
name, _Dtype), size bounds before anything is inflated, and the storage and dtype names torch's pickles use. A pickle
that names anything else is refused (one line naming the file and the global), or read by torch's own reader where
that is benign. checkpoint/torch_dist.py reads the checkpoint through these."""
from __future__ import annotations

import functools
import io
import os
import pathlib
import pickle
import pickletools
import re
import zipfile
import zlib
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import store
from .errors import FormatError
from .megatron import TorchDtype
from .safety import open_input, regular_file

if TYPE_CHECKING:
    import torch

DCP_METADATA = ".metadata"


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


# the dtypes whose tensors torch.save writes as _rebuild_tensor_v2 of a typed storage (FP8 takes another form, which
# torch_dist exports never hold: torch.save writes it)
_STORAGE_TYPES = {"bfloat16": "BFloat16Storage", "float16": "HalfStorage", "float32": "FloatStorage"}


def _dtype_str(dtype) -> str:
    """A torch dtype's name without the prefix, from a torch.dtype or a name (bf16, bfloat16, torch.bfloat16, ...)."""
    name = str(dtype).removeprefix("torch.")
    return store.DTYPE_ALIASES.get(name, name)


# The zip's CRC-32 of every byte is most of what an export costs beyond the native copy: zlib's runs at ~2.5-3.4 GB/s
# here (0.3-0.4 CPU-s per GB), ISA-L's (the `isal` package, where installed) at ~11 GB/s; the same values (the CRC-32
# the zip format defines; the item bytes are identical either way). It runs on the rank files' writer threads (zlib
# releases the GIL on large buffers), so it costs CPU time more than wall time (scripts/BENCH.md, issue 17).
try:
    from isal.isal_zlib import crc32 as _CRC32
except ImportError:  # (an optional dependency)
    _CRC32 = zlib.crc32
