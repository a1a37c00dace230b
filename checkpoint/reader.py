"""Open a checkpoint, read tensors or slices of them, and verify every chunk."""
from __future__ import annotations

import collections
import itertools
import json
import threading
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, TypeVar

import numpy as np

from . import chunkio, store
from .iterations import resolve_iteration
from .config import ModelConfig
from .errors import CorruptionError, FormatError, ShardkitError
from .layout import Layout, RankCoord
from .manifest import MANIFEST, TRAIN_STATE, Manifest, TensorEntry, tensor_path
from .safety import read_input, regular_file, safe_path
from .sharding import (SCALE_SUFFIX, Rule, TensorSpec, local_shape, optimizer_specs, regions, vocab_fill,
                       split_optimizer_key)
from .families import model_specs

if TYPE_CHECKING:  # torch is imported where tensors are made: a reshard or export moves numpy views end to end
    import torch


class ManifestView:
    """What every reader of a checkpoint through a manifest offers: its model config, layout, tensor entries, the
    entry of one tensor and the bytes of all (a native Checkpoint, and a torch_dist checkpoint read in place)."""

    path: Path
    manifest: Manifest

    @property
    def config(self) -> ModelConfig:
        return self.manifest.model

    @property
    def layout(self) -> Layout:
        return self.manifest.layout

    @property
    def tensors(self) -> dict[str, TensorEntry]:
        return self.manifest.tensors

    def entry(self, name: str) -> TensorEntry:
        if name not in self.tensors:
            raise FormatError(f"{self.path}: no tensor {name!r} in the manifest")
        return self.tensors[name]

    def nbytes(self) -> int:
        return sum(entry_nbytes(e) for e in self.tensors.values())


class Checkpoint(ManifestView):
    """A complete checkpoint iteration (resolved through `latest` when given a root)."""

    def __init__(self, path: str | Path, cache_bytes: int = 0, check: bool = False):
        """`cache_bytes` > 0 keeps that many bytes of decoded chunks (least recently used out first), for readers that
        read one chunk in several boxes (a higher TP splits it). `check`: run `check()` now (commands that load a
        checkpoint to write another do, unless --skip-verify)."""
        self.path = resolve_iteration(path)
        self.manifest = Manifest.load(self.path)
        self._ctx = store.context(cache_bytes=cache_bytes)
        self._arrays: dict = {}
        self._direct: dict[str, bool] = {}  # array read by chunkio (exactly our codecs), else by tensorstore
        self.cache_bytes, self._cached = cache_bytes, 0
        self._cache: OrderedDict[tuple, np.ndarray] = OrderedDict()
        self._loading: dict[tuple, Future] = {}  # chunks being read (by a prefetch thread): wait, do not read twice
        self._lock = threading.Lock()
        self.checksums = True  # False: chunks are read without their CRC32C (checked by someone else: chunkio.map_chunk)
        if check:
            self.check()

    @property
    def has_optimizer(self) -> bool:
        """True for a training checkpoint carrying optimizer state (optimizer.state.<state>.<name> arrays)."""
        return bool(self.manifest.optimizer)

    @property
    def optimizer_states(self) -> list[str]:
        return list(self.manifest.optimizer or [])

    def train_state_path(self) -> Path | None:
        """The trainer's train_state.json in this iteration, if any (shardkit carries it, never interprets it)."""
        p = self.path / TRAIN_STATE
        return p if regular_file(p, missing_ok=True) else None

    @property
    def train_state_source(self) -> str:
        return str(self.path / TRAIN_STATE)

    def train_state(self, global_batch_size: int | None = None) -> tuple[dict | None, list[str]]:
        """The trainer's state at this checkpoint (its train_state.json; None without one) and no notes to log: what
        the trainer resumes from (a torch_dist one's: checkpoint.torch_dist_load.TorchDistLoad.train_state)."""
        p = self.train_state_path()  # a FIFO or a device: one line naming it, never a hang or "none"
        if p is None:
            return None, []
        try:
            return json.loads(read_input(p)), []
        except (OSError, ValueError, RecursionError) as e:
            raise FormatError(f"{p}: unreadable training state ({e})") from None

    def spec(self, name: str) -> TensorSpec:
        e = self.entry(name)
        return TensorSpec(name, tuple(e.shape), Rule(e.rule), e.per_layer)


    def array(self, name: str):
        """The tensorstore array of a manifest tensor, opened once; its metadata (shape, dtype, chunk, crc32c codec,
        own name) is checked against the manifest on open, so a swapped or rewritten array never loads."""
        if name not in self._arrays:
            e = self.entry(name)
            path = safe_path(self.path, tensor_path(name), f"{self.path / MANIFEST}: tensor {name}")
            arr = store.open_existing(path, self._ctx, name)
            md = store.metadata(arr)
            check_array(name, e, md)
            self._direct[name] = chunkio.supports(md)
            self._arrays[name] = arr
        return self._arrays[name]

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """A tensor, or a box of it, from disk (only the chunks it touches are read), in memory of its own. A chunk
        that fails its checksum or is missing raises CorruptionError naming the tensor and the chunk."""
        self.array(name)
        if self._direct[name]:
            a = self.read_numpy(name, index)
            if not a.flags.writeable:  # a view of a memory-mapped chunk: callers may modify their tensor
                a = a.copy()
            return store.from_numpy(a)
        return self._read_tensorstore(name, index)

    def read_numpy(self, name: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
        """`read` as a numpy array that may be a read-only view of a cached chunk (no copy when the box lies in one
        chunk): for writers that only pass the values on."""
        self.array(name)
        if not self._direct[name]:
            return store.to_numpy(self._read_tensorstore(name, index))
        e = self.entry(name)
        box = _box(e.shape, index, name)
        ranges = _grid_ranges(box, e.chunk)
        if all(len(r) == 1 for r in ranges):
            grid = tuple(r[0] for r in ranges)
            return self._chunk(name, grid)[tuple(slice(lo - g * c, hi - g * c)
                                                 for (lo, hi), g, c in zip(box, grid, e.chunk))]
        out = chunkio.POOL.empty([hi - lo for lo, hi in box], store.numpy_dtype(e.dtype))
        for grid in itertools.product(*ranges):
            src, dst = [], []
            for (lo, hi), g, c in zip(box, grid, e.chunk):
                a, b = max(lo, g * c), min(hi, (g + 1) * c)
                src.append(slice(a - g * c, b - g * c))
                dst.append(slice(a - lo, b - lo))
            out[tuple(dst)] = self._chunk(name, grid)[tuple(src)]
        return out

    def chunk_files(self, name: str, index: tuple[slice, ...] | None = None) -> list[Path]:
        """The chunk files a box of `name` reads (chunkio-read arrays only; none for others): for read-ahead hints."""
        self.array(name)
        if not self._direct[name]:
            return []
        base = self.path / tensor_path(name)
        return [base / chunkio.chunk_path(Path(), g) for _, g in self.chunks_of(name, index)]

    def prefetch(self, name: str, grid: tuple[int, ...]) -> None:
        """Read one chunk into the cache: a read-ahead hint (ReadPlan's thread). Errors surface when the job reads
        the box itself, naming it."""
        try:
            self.array(name)
            if self._direct[name] and self.cache_bytes:
                self._chunk(name, grid)
        except ShardkitError:
            return

    def chunk_nbytes(self, name: str) -> int:
        e = self.entry(name)
        return int(np.prod(e.chunk, dtype=np.int64)) * store.itemsize(e.dtype)

    def chunks_of(self, name: str, index: tuple[slice, ...] | None = None) -> list[tuple[str, tuple[int, ...]]]:
        """The chunks (name, grid position) a box touches."""
        e = self.entry(name)
        return [(name, g) for g in itertools.product(*_grid_ranges(_box(e.shape, index, name), e.chunk))]

    def release(self, keys: list[tuple[str, tuple[int, ...]]]) -> None:
        """Drop chunks from the cache that the caller will not read again (their buffers return to the pool once
        no view of them is alive), so the cache holds what is still needed rather than what was read last."""
        with self._lock:
            for key in keys:
                buf = self._cache.pop(key, None)
                if buf is not None:
                    self._cached -= buf.nbytes

    def _chunk(self, name: str, grid: tuple[int, ...]) -> np.ndarray:
        """One whole chunk (its full chunk shape, read-only), from the cache or read and checksummed by chunkio."""
        key = (name, grid)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
            pending = self._loading.get(key)
            if pending is None:
                self._loading[key] = mine = Future()
        if pending is not None:
            return pending.result()
        e = self.entry(name)
        try:
            try:
                expect = e.crc32c[chunkio.grid_index(grid, e.shape, e.chunk)] if e.crc32c else None
                buf = chunkio.map_chunk(self.path / tensor_path(name) / chunkio.chunk_path(Path(), grid), e.chunk,
                                        store.numpy_dtype(e.dtype), expect, checksum=self.checksums)
            except chunkio.ChunkMoved as err:
                raise moved_chunk_error(name, e, tuple(grid), err.stored) from None
            except CorruptionError as err:
                raise CorruptionError(f"tensor {name} chunk {tuple(grid)}: {err}") from None
        except BaseException as err:
            with self._lock:
                del self._loading[key]
            mine.set_exception(err)
            raise
        with self._lock:
            del self._loading[key]
            if self.cache_bytes:
                self._cache[key] = buf
                self._cached += buf.nbytes
                while self._cached > self.cache_bytes and len(self._cache) > 1:
                    self._cached -= self._cache.popitem(last=False)[1].nbytes
        mine.set_result(buf)
        return buf

    def _read_tensorstore(self, name: str, index: tuple[slice, ...] | None) -> torch.Tensor:
        arr = self.array(name)
        try:
            return store.read(arr, index, name)
        except CorruptionError as err:
            e = self.entry(name)
            for idx in _chunk_boxes(e.shape, e.chunk, index):  # the error path only: find the chunk that fails
                try:
                    store.read(arr, idx, name)
                except CorruptionError as one:
                    raise _chunk_error(name, idx, e.chunk, one) from None
            raise err from None

    def check(self) -> dict:
        """What can be checked without reading the data: the manifest agrees with the model config, no stray
        arrays, every array's metadata matches the manifest, and every chunk file exists. Loads run it before
        writing anything (unless --skip-verify); `verify` runs it and then reads every chunk."""
        expected = {s.name: s for s in self.manifest.specs()}
        self.hf_dir()  # hf/ linked out of the iteration: refused here, before anything is written from it
        if set(expected) != set(self.tensors):
            missing, extra = sorted(set(expected) - set(self.tensors)), sorted(set(self.tensors) - set(expected))
            raise FormatError(f"{self.path}: manifest tensors disagree with the model config "
                              f"(missing {missing}, unexpected {extra})")
        for sub in ("model", "optim"):
            d = self.path / sub
            on_disk = {f"{sub}/{p.name}" for p in d.iterdir()} if d.is_dir() else set()
            stray = sorted(p.split("/", 1)[1] for p in on_disk - {tensor_path(n) for n in self.tensors})
            if stray:
                raise FormatError(f"{d}: arrays not in the manifest: {stray[:3]}")
        ts_path = self.train_state_path()
        if ts_path is not None:
            try:
                json.loads(read_input(ts_path))
            except (ValueError, UnicodeDecodeError, RecursionError) as err:
                raise CorruptionError(f"{ts_path}: not valid JSON ({err})") from None
        chunks = 0
        for name, e in self.tensors.items():
            spec = expected[name]
            if list(spec.shape) != e.shape or spec.rule.value != e.rule or spec.per_layer != e.per_layer:
                raise FormatError(f"tensor {name}: manifest shape/rule {e.shape}/{e.rule} disagree with the model "
                                  f"config ({list(spec.shape)}/{spec.rule.value})")
            self.array(name)
            base = self.path / tensor_path(name) / "c"
            for flat, idx in enumerate(_chunk_boxes(e.shape, e.chunk)):
                key = [str(s.start // c) for s, c in zip(idx, e.chunk)]
                if not regular_file(base.joinpath(*key), f"tensor {name}", missing_ok=True):
                    raise CorruptionError(f"tensor {name} chunk {_chunk_label(idx, e.chunk)}: missing (its file "
                                          f"{base.joinpath(*key)} is gone); the checkpoint is damaged")
                if e.crc32c:  # 4 bytes per chunk: the file in this position is the one the manifest recorded
                    try:
                        stored = chunkio.read_trailer(base.joinpath(*key))
                    except CorruptionError as err:
                        raise _chunk_error(name, idx, e.chunk, err) from None
                    if stored != e.crc32c[flat]:
                        raise moved_chunk_error(name, e, tuple(int(k) for k in key), stored)
                chunks += 1
        return {"tensors": len(self.tensors), "chunks": chunks}

    def read_local(self, name: str, layout: Layout, coord: RankCoord) -> dict[int, torch.Tensor]:
        """One rank's local tensors of `name` (per model chunk) for any target layout, read through the sharding
        table. Vocab tensors follow the target's padding: stored rows read as stored, rows past them are
        `vocab_fill`'s (the last real row repeated; zeros for Adam moments), stored rows past the target's are not
        read."""
        layout.check(self.config)
        target = {s.name: s for s in Manifest(0, self.config, layout, {}, fp8=self.manifest.fp8,
                                              optimizer=self.manifest.optimizer).specs()}.get(name)
        if target is None:
            raise FormatError(f"{self.path}: no tensor {name!r} in the sharding table of this checkpoint")
        stored_rows = self.entry(name).shape[0]
        import torch

        out: dict[int, torch.Tensor] = {}
        for r in regions(target, layout, coord, self.config.num_layers):
            if r.vstage not in out:
                out[r.vstage] = torch.zeros(local_shape(target, layout, coord.pp, r.vstage), dtype=store.torch_dtype(self.entry(name).dtype))
            gs, ls = list(r.global_slices()), list(r.local_slices())
            if target.rule is Rule.VOCAB and gs[0].stop > stored_rows:
                keep = max(0, stored_rows - gs[0].start)
                real = self.config.vocab_size
                fill = slice(ls[0].start + keep, ls[0].stop)
                last = self.read(name, (slice(real - 1, real), *gs[1:]))
                out[r.vstage][(fill, *ls[1:])] = vocab_fill(name, last, fill.stop - fill.start)
                gs[0] = slice(gs[0].start, gs[0].start + keep)
                ls[0] = slice(ls[0].start, ls[0].start + keep)
                if keep == 0:
                    continue
            out[r.vstage][tuple(ls)] = self.read(name, tuple(gs))
        return out

    def state_dict(self, dequantize: bool = False, optimizer: bool = False) -> dict[str, torch.Tensor]:
        """Every canonical tensor, whole (for small models: verify --against, tests). With `dequantize`, kept-FP8
        weights come back as fp32(weight) * block scale, in the model's dtype, and the scales are left out. Optimizer
        state (a training checkpoint's optimizer.state.* arrays) only with `optimizer`."""
        out = {name: self.read(name) for name in self.tensors if optimizer or split_optimizer_key(name) is None}
        if dequantize and self.manifest.fp8:
            br, bc = self.manifest.fp8["block"]
            dtype = store.torch_dtype(self.config.params_dtype)
            for name in self.manifest.fp8["tensors"]:
                w, s = out[name].float(), out.pop(name + SCALE_SUFFIX)
                r, c = w.shape[-2:]
                full = s.repeat_interleave(br, -2).repeat_interleave(bc, -1)[..., :r, :c]
                out[name] = (w * full).to(dtype)
        return out

    def hf_dir(self) -> Path:
        """`hf/` (tokenizer and generation files), checked to stay inside the iteration (a link out is refused)."""
        return safe_path(self.path, "hf", f"{self.path}: hf")

    # -- verify -------------------------------------------------------------------------------------------------
    def verify(self, progress: Callable[[int], None] | None = None, count_nonfinite: bool = True) -> dict:
        """`check`, then re-read every chunk (crc32c checked by the codec, missing chunks are errors) and count its
        NaN/Inf values (`count_nonfinite` False: not counted, {} reported). Raises CorruptionError naming the tensor
        and the chunk."""
        self.check()
        total_bytes, chunks = 0, 0
        nonfinite: dict[str, int] = {}
        for name, e in self.tensors.items():
            arr = self.array(name)
            for idx in _chunk_boxes(e.shape, e.chunk):
                if self._direct[name]:
                    value = self._chunk(name, tuple(s.start // c for s, c in zip(idx, e.chunk)))
                    # the chunk file holds the whole chunk shape: count only what lies inside the array
                    value = value[tuple(slice(0, s.stop - s.start) for s in idx)]
                else:
                    try:
                        value = store.to_numpy(store.read(arr, idx, name))
                    except CorruptionError as err:
                        raise _chunk_error(name, idx, e.chunk, err) from None
                nbytes = value.nbytes
                bad = store.count_nonfinite(value) if count_nonfinite else 0
                if bad:
                    nonfinite[name] = nonfinite.get(name, 0) + bad
                del value
                total_bytes += nbytes
                chunks += 1
                if progress:
                    progress(nbytes)
        # chunk positions are checked against the manifest's crc32c lists; manifests from before they were recorded
        # have none (the chunks' own checksums still hold, a swap inside one array would not be seen)
        positions = all(e.crc32c is not None for e in self.tensors.values())
        return {"tensors": len(self.tensors), "chunks": chunks, "bytes": total_bytes, "nonfinite": nonfinite,
                "chunk_positions_checked": positions}



class ReadPlan:
    """The boxes a job will read from a checkpoint, in order. A read-ahead thread (with `ahead_bytes`) reads the
    chunks in the order they will first be needed, staying at most `ahead_bytes` ahead of what the job has finished
    with, so the disk streams while the job writes (a one-box hint overlapped nothing when a box was one of several
    cut from the same chunk). Each chunk leaves the cache right after the last box that needs it, so the cache holds
    what is still to come, not what was read last. A process that runs only some of the boxes (a spawned worker)
    must not read ahead (it would read other workers' chunks) and never counts a chunk down to zero: plain LRU."""

    def __init__(self, ck: Checkpoint, boxes: Iterable[tuple[str, tuple[slice, ...]]], ahead_bytes: int = 0):
        self.ck = ck
        keys = [ck.chunks_of(name, index) for name, index in boxes]
        self.readers = collections.Counter(k for ks in keys for k in ks)
        self._order = list(dict.fromkeys(k for ks in keys for k in ks))  # first use first
        self._ahead, self._outstanding, self._read_ahead = ahead_bytes, 0, set()
        self._cv = threading.Condition()
        self._stop = False
        self._thread = None
        if ahead_bytes and ck.cache_bytes:
            self._thread = threading.Thread(target=self._run, name="shardkit-read-ahead", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        for key in self._order:
            n = self.ck.chunk_nbytes(key[0])
            with self._cv:
                while not self._stop and self._outstanding and self._outstanding + n > self._ahead:
                    self._cv.wait()
                if self._stop:
                    return
                if self.readers[key] <= 0:  # the job got there first
                    continue
                self._outstanding += n
                self._read_ahead.add(key)
            self.ck.prefetch(*key)  # a damaged chunk is reported when the job reads it
            with self._cv:
                if self.readers[key] <= 0 and key in self._read_ahead:  # finished with while being read: drop it
                    self._read_ahead.discard(key)
                    self._outstanding -= n
                    self.ck.release([key])

    def done(self, name: str, index: tuple[slice, ...]) -> None:
        """The job has finished with this box: chunks no later box needs leave the cache."""
        keys = self.ck.chunks_of(name, index)
        with self._cv:
            self.readers.subtract(keys)
            gone = [k for k in keys if self.readers[k] <= 0]
            for k in gone:
                if k in self._read_ahead:
                    self._read_ahead.discard(k)
                    self._outstanding -= self.ck.chunk_nbytes(k[0])
            self._cv.notify_all()
        self.ck.release(gone)

    def close(self) -> None:
        """Stop reading ahead (also when the job failed half-way)."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join()


Array = TypeVar("Array", "torch.Tensor", np.ndarray)


def read_padded(read: Callable[[tuple[slice, ...]], Array], name: str, box: tuple[tuple[int, int], ...],
                true_rows: int | None) -> Array:
    """A box of tensor `name` at a layout with other vocab padding, from `read(index)` of the source tensor (torch
    tensors or numpy arrays): rows from `true_rows` (the true vocabulary; None: not a vocab tensor) on are
    `vocab_fill`'s, whatever the source stores there."""
    (a, b), *_ = box
    index = tuple(slice(x, y) for x, y in box)
    if true_rows is None or b <= true_rows:
        return read(index)
    cols = index[1:]
    parts = [read((slice(a, true_rows), *cols))] if a < true_rows else []
    parts.append(vocab_fill(name, read((slice(true_rows - 1, true_rows), *cols)), b - max(a, true_rows)))
    if len(parts) == 1:
        return parts[0]
    if isinstance(parts[0], np.ndarray):
        return np.concatenate(parts)
    import torch

    return torch.cat(parts)


def vocab_padding(cfg: ModelConfig, layout: Layout, optimizer: list[str] | None) -> dict[str, int]:
    """Vocab tensors of the destination (and their optimizer state): name -> true rows (read_padded fills the rest)."""
    base = [s for s in model_specs(cfg, layout) if s.rule is Rule.VOCAB]
    return {s.name: cfg.vocab_size for s in [*base, *optimizer_specs(base, optimizer or ())]}


def entry_nbytes(e: TensorEntry) -> int:
    n = 1
    for s in e.shape:
        n *= s
    return n * store.itemsize(e.dtype)


def _box(shape: list[int], index: tuple[slice, ...] | None, name: str) -> list[tuple[int, int]]:
    """[start, stop) per axis of a box given as unit-step slices (missing trailing axes: whole)."""
    index = tuple(index or ())
    if len(index) > len(shape):
        raise FormatError(f"tensor {name}: index {index} has more axes than its shape {shape}")
    out = []
    for s, n in zip(index + (slice(None),) * (len(shape) - len(index)), shape):
        lo, hi, step = s.indices(n)
        if step != 1:
            raise FormatError(f"tensor {name}: strided reads are not supported ({s})")
        out.append((lo, max(lo, hi)))
    return out


def _grid_ranges(box: list[tuple[int, int]], chunk: list[int]) -> list[range]:
    """Per axis, the chunk grid positions a box touches."""
    return [range(lo // c, -(-hi // c)) for (lo, hi), c in zip(box, chunk)]


def _chunk_boxes(shape: list[int], chunk: list[int], within: tuple[slice, ...] | None = None
                 ) -> Iterator[tuple[slice, ...]]:
    """Boxes of whole chunks, in order (only those touching `within`, when given)."""
    within = tuple(within or ()) + tuple(slice(0, s) for s in shape[len(within or ()):])
    ranges = []
    for s, c, w in zip(shape, chunk, within):
        lo, hi, _ = w.indices(s)
        ranges.append(range(lo - lo % c, hi, c))
    for offs in itertools.product(*ranges):
        yield tuple(slice(o, min(o + c, s)) for o, c, s in zip(offs, chunk, shape))


def moved_chunk_error(name: str, e: TensorEntry, grid: tuple[int, ...], stored: int) -> CorruptionError:
    """A chunk file whose own crc32c holds but is not the one the manifest records at `grid`: name where its bytes
    belong when the manifest knows (two chunks swapped, or one copied over another)."""
    belongs = [chunkio.grid_position(i, e.shape, e.chunk) for i, c in enumerate(e.crc32c) if c == stored]
    where = (f"holds the bytes of chunk {belongs[0]}" + (" (swapped or copied over each other)"
                                                       if belongs[0] != grid else "")
             if belongs else "holds bytes the manifest records for no chunk of this tensor")
    return CorruptionError(f"tensor {name} chunk {grid}: {where} (crc32c {stored:#010x}, the manifest records "
                           f"{e.crc32c[chunkio.grid_index(grid, e.shape, e.chunk)]:#010x} here); the checkpoint is "
                           "damaged")


def _chunk_label(idx: tuple[slice, ...], chunk: list[int]) -> str:
    return str(tuple(s.start // c for s, c in zip(idx, chunk)))


def _chunk_error(name: str, idx: tuple[slice, ...], chunk: list[int], err: CorruptionError) -> CorruptionError:
    return CorruptionError(f"tensor {name} chunk {_chunk_label(idx, chunk)}: {str(err).split(': ', 1)[-1]}")


def check_array(name: str, e: TensorEntry, md: dict) -> None:
    """An opened array's metadata against its manifest entry: CorruptionError naming the tensor on any difference."""
    got = (md["shape"], md["data_type"], md["chunk_grid"]["configuration"]["chunk_shape"])
    if got != (e.shape, e.dtype, e.chunk):
        raise CorruptionError(f"tensor {name}: array metadata (shape, dtype, chunk) {got} disagree with the "
                              f"manifest {(e.shape, e.dtype, e.chunk)}")
    if not any(c.get("name") == "crc32c" for c in md.get("codecs", [])):
        raise CorruptionError(f"tensor {name}: array has no crc32c codec; its values cannot be checked")
    stored = (md.get("attributes") or {}).get(store.TENSOR_ATTR)
    if stored is not None and stored != name:  # arrays written before the attribute existed have none
        raise CorruptionError(f"tensor {name}: its array holds tensor {stored} (arrays swapped or copied over each "
                              "other); the checkpoint is damaged")


@dataclass
class HFAssets:
    """Tokenizer and generation files copied from the source into `<iter>/hf/`."""

    files: list[str]

    @staticmethod
    def list(iter_dir: Path) -> list[str]:
        d = Path(iter_dir) / "hf"
        return sorted(p.name for p in d.iterdir() if p.is_file()) if d.is_dir() else []


def describe(ckpt: Checkpoint) -> dict:
    """What `inspect --json` prints."""
    m = ckpt.manifest
    rows, optim_bytes = [], 0
    for name, e in m.tensors.items():
        if split_optimizer_key(name) is not None:  # summarised below, not listed (3 per model tensor)
            optim_bytes += entry_nbytes(e)
            continue
        rows.append({"name": name, "shape": e.shape, "dtype": e.dtype, "chunk": e.chunk, "rule": e.rule,
                     "bytes": entry_nbytes(e)})
    return {
        "path": str(ckpt.path),
        "iteration": m.iteration,
        "format": f"{m.format} v{m.format_version}",
        "layout": m.layout.to_dict(),
        "vocab": m.vocab,
        "model": {k: v for k, v in m.model.to_dict().items() if k != "hf_config"},
        "tensors": rows,
        "total_bytes": sum(r["bytes"] for r in rows),
        "total_params": sum(r["bytes"] // store.itemsize(r["dtype"]) for r in rows),
        "optimizer": {"states": m.optimizer, "bytes": optim_bytes} if m.optimizer else None,
        "train_state": TRAIN_STATE if ckpt.train_state_path() else None,
        "hf_files": HFAssets.list(ckpt.path),
        "provenance": m.provenance,
    }


def dumps(d: dict) -> str:
    from .progress import json_text

    return json_text(d)
