"""Direct I/O of the native format's chunk files, without tensorstore's codec pipeline.

Our arrays use exactly one codec chain, zarr3 `bytes` (little endian) + `crc32c`, so a chunk file is the chunk's raw
little-endian bytes followed by the 4-byte little-endian CRC32C of those bytes, at `c/<i>/<j>/...` under the array
(zarr3's default chunk key encoding). Reading it is a memory map of the page cache and a hardware CRC (the `crc32c`
package, ~15 GB/s, GIL released); tensorstore's generic path costs ~2.4 CPU-s/GB for the same bytes (decode,
checksum, copies into freshly faulted buffers), which made reshard CPU-bound. Writing is the mirror image: the bytes,
checksummed and written a block at a time (WRITE_BLOCK), and the trailer (the buffer is free again when it returns),
then fsync of the file and of its
directory entry; writers record a chunk as done only after that, so it survives a crash.

Tensorstore still creates and opens the arrays (their metadata), and remains the path for any array whose metadata
is not exactly ours (`supports`), for partial-chunk writes, and where the `crc32c` package is missing.
"""
from __future__ import annotations

import mmap
import os
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from .errors import CorruptionError, WriteError

try:  # hardware CRC32C (SSE4.2 / ARMv8), releases the GIL
    from crc32c import crc32c as _crc32c
except ImportError:  # pragma: no cover - a dependency; without it every read and write goes through tensorstore
    _crc32c = None

AVAILABLE = _crc32c is not None
CODECS = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]
TRAILER = 4  # bytes of the crc32c codec's checksum after the data
# A chunk is checksummed and written this many bytes at a time: each block is still in the CPU's cache when the kernel
# copies it (one pass over memory, not two), and the kernel copies a block of a memory-mapped source (faulted in by
# the checksum) far faster than one `write` of a whole mapped chunk, which it copies page by page, faulting
# (measured, 400 MB from the page cache: 0.1 vs 0.36-1.2 system CPU-s; the 1.5 GB conversion: 1.2-4.5 -> 0.6 sys-s).
WRITE_BLOCK = 1 << 20


def fsync_path(path: Path) -> None:
    """fsync a file or directory by path (the low-level I/O of every writer; checkpoint/commit.py uses it too)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class BufferPool:
    """Reusable buffers for values that must be gathered (a column block of a chunk, a box across chunks). A fresh
    multi-MiB buffer costs a page fault and a zeroed page per 4 KiB (the allocator maps large buffers anew each time):
    zeroing was a fifth of reshard's CPU when every chunk was decoded into one. A buffer handed out comes back
    by itself once nothing refers to it any more (no view of it alive: reference counts), so readers, caches and
    writes in flight never return buffers explicitly. At most `keep_bytes` of idle buffers are kept."""

    def __init__(self, keep_bytes: int = 384 << 20):
        self.keep_bytes = keep_bytes
        self._lock = threading.Lock()
        self._lent: list[np.ndarray] = []  # flat uint8 buffers handed out
        self._idle: list[np.ndarray] = []

    def empty(self, shape: Sequence[int], dtype: np.dtype) -> np.ndarray:
        """An uninitialised C-contiguous array of `shape` and `dtype` (like np.empty), in a reused buffer if one of a
        fitting size (up to four times as large) is idle."""
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if nbytes < (1 << 20):
            return np.empty(shape, dtype)
        with self._lock:
            self._collect()
            fit = [b for b in self._idle if nbytes <= b.nbytes <= 4 * nbytes]
            if fit:
                raw = min(fit, key=lambda b: b.nbytes)
                self._idle = [b for b in self._idle if b is not raw]
            else:
                raw = np.empty(nbytes, np.uint8)
            self._lent.append(raw)
        return raw[:nbytes].view(dtype).reshape(shape)

    def clear(self) -> None:
        """Drop the idle buffers (work that follows has no use for them: e.g. convert's verify after the writes)."""
        with self._lock:
            self._collect()
            self._idle.clear()

    def _collect(self) -> None:
        """Move lent buffers nothing else refers to back to the idle list; drop the largest idle ones over the cap."""
        for i in reversed(range(len(self._lent))):
            if sys.getrefcount(self._lent[i]) <= _FREE_REFS:
                self._idle.append(self._lent.pop(i))
        self._idle.sort(key=lambda b: b.nbytes)
        while self._idle and sum(b.nbytes for b in self._idle) > self.keep_bytes:
            self._idle.pop()


def contiguous(a: np.ndarray) -> np.ndarray:
    """`a` when C-contiguous, else its values gathered into a pooled buffer (a column block of a chunk)."""
    if a.flags.c_contiguous:
        return a
    out = POOL.empty(a.shape, a.dtype)
    np.copyto(out, a)
    return out


_FREE_REFS = 2  # sys.getrefcount(self._lent[i]) of a buffer only the pool's list refers to (the list, the argument)
POOL = BufferPool()


def crc(data: np.ndarray | bytes | memoryview) -> int:
    return _crc32c(data)


def supports(md: dict) -> bool:
    """True when an array's zarr3 metadata is exactly the layout this module reads and writes."""
    enc = md.get("chunk_key_encoding") or {"name": "default"}
    sep = (enc.get("configuration") or {}).get("separator", "/")
    return (AVAILABLE and md.get("codecs") == CODECS and enc.get("name") == "default" and sep == "/"
            and (md.get("chunk_grid") or {}).get("name") == "regular")


def chunk_path(array_dir: Path, grid: Sequence[int]) -> Path:
    """The file of the chunk at grid position `grid` (zarr3 default encoding: `c/0/3/1`)."""
    return array_dir.joinpath("c", *(str(i) for i in grid))


class ChunkMoved(CorruptionError):
    """A chunk file whose bytes pass their own crc32c but are not the bytes the manifest records for its position
    (two chunk files swapped, or one copied over another). `stored` is the crc32c the file carries."""

    def __init__(self, msg: str, stored: int):
        super().__init__(msg)
        self.stored = stored


def grid_shape(shape: Sequence[int], chunk: Sequence[int]) -> tuple[int, ...]:
    """Chunks per axis of an array (edge chunks included)."""
    return tuple(-(-s // c) for s, c in zip(shape, chunk))


def grid_index(grid: Sequence[int], shape: Sequence[int], chunk: Sequence[int]) -> int:
    """The position of chunk `grid` in C order over the chunk grid: its place in a manifest's `crc32c` list."""
    flat = 0
    for g, n in zip(grid, grid_shape(shape, chunk)):
        flat = flat * n + g
    return flat


def grid_position(flat: int, shape: Sequence[int], chunk: Sequence[int]) -> tuple[int, ...]:
    """Inverse of grid_index."""
    out = []
    for n in reversed(grid_shape(shape, chunk)):
        flat, g = divmod(flat, n)
        out.append(g)
    return tuple(reversed(out))


def _open_chunk(path: Path) -> int:
    """A chunk file's descriptor for reading; CorruptionError naming the file when it is gone or cannot be opened."""
    import stat

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO there never blocks the open
    except FileNotFoundError:
        raise CorruptionError(f"missing (its file {path} is gone); the checkpoint is damaged") from None
    except OSError as e:
        raise CorruptionError(f"cannot open {path} ({e.strerror or e})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CorruptionError(f"{path} is not a regular file (a FIFO or device?); the checkpoint is damaged")
    os.set_blocking(fd, True)
    return fd


def read_trailer(path: Path) -> int:
    """The crc32c a chunk file carries (its last 4 bytes, little endian): what its writer computed over its bytes.
    CorruptionError when the file is missing or shorter than the trailer."""
    fd = _open_chunk(path)
    try:
        size = os.fstat(fd).st_size
        if size < TRAILER:
            raise CorruptionError(f"{path} holds {size} bytes, less than its crc32c trailer; the checkpoint is damaged")
        return int.from_bytes(os.pread(fd, TRAILER, size - TRAILER), "little")
    finally:
        os.close(fd)


def chunk_crcs(array_dir: Path, shape: Sequence[int], chunk: Sequence[int]) -> list[int]:
    """The crc32c of every chunk of an array, in C order over its chunk grid, from the chunk files' trailers (the
    values their writer computed, chunkio or tensorstore alike: both write the zarr3 crc32c codec's trailer).
    Recorded in the manifest so that a chunk file in the wrong place is found (`ChunkMoved`)."""
    import itertools

    return [read_trailer(chunk_path(array_dir, g)) for g in itertools.product(*(range(n) for n in
                                                                                 grid_shape(shape, chunk)))]


def record_chunk_crcs(manifest, iter_dir: Path) -> None:
    """Fill every manifest entry's `crc32c` (the chunk crcs, C order) from the chunk files below `iter_dir`, before
    the manifest is written: one 4-byte read per chunk. Arrays of another codec chain (not ours) get none."""
    import json

    from .manifest import tensor_path

    for name, e in manifest.tensors.items():
        adir = Path(iter_dir) / tensor_path(name)
        try:
            md = json.loads((adir / "zarr.json").read_text())
        except (OSError, ValueError, RecursionError):
            md = {}
        if md.get("codecs") != CODECS:
            e.crc32c = None
            continue
        try:
            e.crc32c = chunk_crcs(adir, e.shape, e.chunk)
        except CorruptionError as err:
            raise CorruptionError(f"tensor {name}: {err} (while recording its chunk checksums)") from None


def map_chunk(path: Path, shape: Sequence[int], dtype: np.dtype, expect: int | None = None,
              checksum: bool = True) -> np.ndarray:
    """The chunk file at `path` as a read-only array memory-mapped from the page cache (no copy into a buffer of
    ours: reshard then copies each byte once, into the destination file), after checking its size and CRC32C.
    CorruptionError (without the tensor's name; the caller adds it) when the file is missing, of the wrong size or
    fails its checksum; ChunkMoved when `expect` (the manifest's crc32c for this position) is given and the file
    carries another. `checksum` False: the bytes are not checksummed here (a caller that checks every chunk of the
    checkpoint itself, alongside: convert's proof); size and position still are. The mapping lives as long as any
    view of the array does."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    fd = _open_chunk(path)
    try:
        size = os.fstat(fd).st_size
        if size != nbytes + TRAILER:
            raise CorruptionError(f"{path} holds {size:,} bytes, expected {nbytes + TRAILER:,} (truncated or "
                                  "overwritten); the checkpoint is damaged")
        mm = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    mm.madvise(mmap.MADV_WILLNEED)  # read ahead the whole chunk now, not page by page as the checksum touches it
    raw = np.frombuffer(mm, np.uint8, size)
    stored = int.from_bytes(raw[nbytes:].tobytes(), "little")
    computed = crc(raw[:nbytes]) if checksum else stored
    if stored != computed:
        raise CorruptionError(f"{path}: Digest mismatch (crc32c stored {stored:#010x}, computed {computed:#010x}); "
                              "the checkpoint is damaged")
    if expect is not None and stored != expect:
        raise ChunkMoved(f"{path}: holds a chunk with crc32c {stored:#010x}, but the manifest records {expect:#010x} "
                         "at this position", stored)
    return raw[:nbytes].view(dtype).reshape(shape)


def write_chunk(path: Path, data: np.ndarray, label: str) -> int:
    """Write one whole chunk file (`data` contiguous, the chunk's full shape): its bytes and the CRC32C trailer, into
    the page cache, a block at a time (WRITE_BLOCK). Returns the still open file descriptor for `sync_chunk`, which makes it durable:
    writers record a chunk as done only after that, and a chunk not recorded is rewritten by the next run, so a file
    torn by a crash never reaches a committed checkpoint (hence no temporary name). `data` may be reused as soon as
    this returns. WriteError naming `label` (the tensor) and the file on any failure (disk full, EFBIG, permissions)."""
    raw = data.reshape(-1).view(np.uint8)
    try:
        _makedirs_durable(path.parent)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    except OSError as e:
        raise _write_error(label, path, e) from None
    try:
        value = 0
        for at in range(0, raw.nbytes, WRITE_BLOCK):  # crc then write each block while it is in the CPU's cache
            block = raw[at:at + WRITE_BLOCK]
            value = _crc32c(block, value)
            _write_all(fd, memoryview(block))
        _write_all(fd, value.to_bytes(TRAILER, "little"))
    except OSError as e:
        os.close(fd)
        raise _write_error(label, path, e) from None
    return fd


def _write_all(fd: int, data: memoryview | bytes) -> None:
    """os.write until all of `data` is out (a short write goes on with the rest)."""
    while data:
        data = data[os.write(fd, data):]


def write_blocks(write: Callable[[memoryview], int], data) -> int:
    """Pass `data` (bytes or a contiguous array) to `write` (a file's write) WRITE_BLOCK bytes at a time; the bytes
    written. One large write from a memory-mapped source is several times slower in the kernel than the same bytes
    in blocks (see WRITE_BLOCK)."""
    view = memoryview(data).cast("B")
    n = 0
    for at in range(0, len(view), WRITE_BLOCK):
        n += write(view[at:at + WRITE_BLOCK])
    return n


def sync_chunk(path: Path, fd: int, label: str) -> None:
    """Make a chunk written by `write_chunk` durable: fsync its file (and close it) and its directory entry."""
    try:
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        fsync_path(path.parent)
    except OSError as e:
        raise _write_error(label, path, e) from None


class ChunkWriter:
    """The one writer of chunk files (conversions, reshard, training saves): `threads` threads write and fsync whole
    chunks concurrently, so the filesystem commits many small files' fsyncs together and the disk never waits for
    us. At most `inflight_bytes` of values handed over and not yet written are held (`submit` waits); a submit's
    future completes once its chunk is durable."""

    def __init__(self, threads: int = 16, inflight_bytes: int = 128 << 20):
        self.inflight_bytes = inflight_bytes
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="shardkit-write")
        self._unwritten = 0  # bytes of values handed to the threads, not yet written
        self._cv = threading.Condition()

    def submit(self, path: Path, data: np.ndarray, label: str,
               on_written: Callable[[], None] | None = None) -> Future:
        """Write `data` (contiguous, the chunk's full shape; handed over: never modified afterwards) as the chunk
        file `path`; `on_written()` runs once its bytes are in the page cache, before the fsync."""
        nbytes = data.nbytes
        with self._cv:
            while self._unwritten and self._unwritten + nbytes > self.inflight_bytes:
                self._cv.wait()
            self._unwritten += nbytes
        return self._pool.submit(self._write_then_sync, path, [data], label, nbytes, on_written)

    def _write_then_sync(self, path: Path, holder: list, label: str, nbytes: int,
                         on_written: Callable[[], None] | None) -> None:
        """The chunk's buffer is released as soon as its bytes are written (the holder list is the only reference)."""
        try:
            fd = write_chunk(path, holder.pop(), label)
        finally:
            with self._cv:
                self._unwritten -= nbytes
                self._cv.notify_all()
        if on_written is not None:
            on_written()
        sync_chunk(path, fd, label)

    def close(self) -> None:
        """Wait for every write in flight."""
        self._pool.shutdown(wait=True)


def write_durable(path: Path, data: np.ndarray, label: str) -> None:
    sync_chunk(path, write_chunk(path, data, label), label)


def _write_error(label: str, path: Path, e: OSError) -> WriteError:
    return WriteError(f"tensor {label}: writing {path} failed ({e.strerror or e}); check free space and permissions")


def _makedirs_durable(d: Path) -> None:
    """mkdir -p, fsyncing the parent of every directory it creates (a chunk whose directory entry is lost in a crash
    is lost too)."""
    if d.is_dir():
        return
    _makedirs_durable(d.parent)
    try:
        d.mkdir()
    except FileExistsError:  # another writer thread made it
        return
    fsync_path(d.parent)
