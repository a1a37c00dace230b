"""Writing torch_dist checkpoints without torch, with bounded memory: `DCPWriter` appends one item at a time to the
file of the rank that owns it (torch.save's exact bytes, written from numpy values by the file's writer thread) and
keeps only the small metadata in memory; `.metadata` and common.pt are pickled from stand-ins that name DCP's and
torch's classes; integrity.json (megatron-core 0.19's verify_integrity manifest). The export
(convert/torch_dist_io.py) and the trainer's save (train/torch_dist_ckpt.py) write through these into an
`IterationWriter`'s partial directory, committed like every other writer (checkpoint/commit.py)."""
from __future__ import annotations

import copyreg
import functools
import io
import json
import os
import pickle
import struct
import sys
import threading
import uuid
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable

import numpy as np

from . import chunkio, store
from .commit import done_logs, write_file_atomic
from .errors import FormatError, WriteError
from .megatron import DEFAULT_MEGATRON_VERSION, MegatronEnum, TorchDtype, check_megatron_version
from .safety import sha256_file
from .torch_dist import BACKEND, COMMON_ITEM, COMMON_PT, DCP_VERSION, METADATA_JSON
from .torch_dist_pickle import DCP_METADATA, _CRC32, _STORAGE_TYPES, _dcp_fs, _dcp_md, _dtype_str

if TYPE_CHECKING:
    import torch


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
_MASK64 = (1 << 64) - 1


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
                n += chunkio.write_blocks(self.f.write, p)
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
        digests = list(pool.map(lambda n: sha256_file(directory / n), names))
    write_file_atomic(directory / INTEGRITY, json.dumps({"algorithm": "sha256", "files": dict(zip(names, digests))},
                                                        indent=2))


