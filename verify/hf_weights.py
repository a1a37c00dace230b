"""The HF side's weights for the streamed proof (verify/streamed.py): an HF model directory's safetensors read
lazily by key and row/column range (`HFWeights`, block-FP8 dequantized as DeepSeek's reference), a thread reading the
walk's next pieces into the page cache ahead of it (`Readahead`), and the pool that casts and frees a piece's
weights (`CastPool`)."""
from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor, nn

from checkpoint.errors import ShardkitError
from checkpoint.hf_source import weight_files
from checkpoint.safety import read_input
from checkpoint.sharding import SCALE_SUFFIX

from .common import as_stored


LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.")
FP32 = 4


class HFWeights:
    """Lazy access to an HF model directory's safetensors: key -> tensor (or a row/column range of a 2-D tensor),
    reading only that. Block-FP8 weights (DeepSeek-V3's hub format: e4m3 + `weight_scale_inv` per block) come back
    dequantized as DeepSeek's reference `weight_dequant` does: fp32(weight) * the scale of its block, cast to the model's
    dtype. `reads` counts every read per (key, rows, cols), so a test can prove no tensor is read twice."""

    def __init__(self, hf_dir: Path, fp8_block: tuple[int, int] = (128, 128),
                 dtype: torch.dtype = torch.bfloat16, stored: torch.dtype | None = None) -> None:
        # `stored`: the checkpoint's dtype (verify.common.stored_dtype): every tensor comes back as the conversion
        # stored it (cast to it; FP8 dequantized straight into it, as the conversion dequantizes)
        self.fp8_block, self.dtype, self.stored = fp8_block, stored or dtype, stored
        files, wm = weight_files(hf_dir)  # the conversion's own choice and checks (links, FIFOs, both kinds)
        if wm is not None:
            self.file_of = {k: hf_dir / f for k, f in wm.items()}
        else:
            single = hf_dir / files[0]
            with safe_open(str(single), "pt") as f:
                self.file_of = {k: single for k in f.keys()}
        self._open: dict[Path, Any] = {}
        self._headers: dict[Path, tuple[int, dict]] = {}
        self.hf_dir = hf_dir
        self.bytes_read = 0
        self.reads: dict[tuple, int] = {}

    def _file(self, key: str):
        path = self.file_of.get(key)
        if path is None:
            raise ShardkitError(f"--against {self.hf_dir}: the HF weights have no tensor {key}")
        if path not in self._open:
            self._open[path] = safe_open(str(path), "pt")
        return self._open[path]

    def has(self, key: str) -> bool:
        return key in self.file_of

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._file(key).get_slice(key).get_shape())

    def get(self, key: str, rows: slice | None = None, cols: slice | None = None) -> Tensor:
        """Tensor `key` (or its rows / columns) as the conversion stored it (`stored`)."""
        return as_stored(self._read(key, rows, cols), self.stored)

    def _read(self, key: str, rows: slice | None = None, cols: slice | None = None) -> Tensor:
        f = self._file(key)
        if rows is None and cols is None:
            t = f.get_tensor(key)
        else:
            sl = f.get_slice(key)
            ndim = len(sl.get_shape())
            t = sl[rows or slice(None)] if ndim == 1 else sl[rows or slice(None), cols or slice(None)]
        tag = (key, None if rows is None else (rows.start, rows.stop), None if cols is None else (cols.start, cols.stop))
        self.reads[tag] = self.reads.get(tag, 0) + 1
        self.bytes_read += t.numel() * t.element_size()
        if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            scale = key + SCALE_SUFFIX
            if scale not in self.file_of:
                raise ShardkitError(f"--against {self.hf_dir}: {key} is FP8 but there is no {scale}")
            br, bc = self.fp8_block
            full = self.shape(key)
            r0 = 0 if rows is None else rows.start
            c0 = 0 if cols is None else cols.start
            if r0 % br or c0 % bc:
                raise ShardkitError(f"--against {self.hf_dir}: {key}: a read at ({r0}, {c0}) is not aligned to its "
                                    f"{br}x{bc} FP8 blocks")
            s = self._read(scale, None if rows is None else slice(r0 // br, -(-(r0 + t.shape[0]) // br)),
                         None if cols is None else slice(c0 // bc, -(-(c0 + t.shape[1]) // bc)))
            want = (-(-full[0] // br), -(-full[1] // bc)) if rows is None and cols is None else \
                (-(-t.shape[0] // br), -(-t.shape[1] // bc))
            if tuple(s.shape) != want:
                raise ShardkitError(f"--against {self.hf_dir}: {scale} has shape {tuple(s.shape)}, expected "
                                    f"{want} for {key} {tuple(t.shape)} in {br}x{bc} blocks")
            r, c = t.shape
            t = (t.float() * s.repeat_interleave(br, 0).repeat_interleave(bc, 1)[:r, :c]).to(self.dtype)
        return t

    def byte_range(self, key: str, rows: slice | None = None) -> tuple[Path, int, int] | None:
        """(file, offset, length) of a tensor's bytes (or of a row range of it) in its safetensors file, from the
        file's header (8-byte little-endian length, then JSON with each tensor's `data_offsets` after the header):
        for read-ahead hints only, never to read values."""
        path = self.file_of.get(key)
        if path is None:  # not there: nothing to read ahead (reading it is one line where it is needed)
            return None
        if path not in self._headers:
            with open(path, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                self._headers[path] = (8 + n, json.loads(f.read(n)))
        base, header = self._headers[path]
        if not isinstance(header.get(key), dict) or len(header[key].get("data_offsets") or ()) != 2:
            return None
        a, b = header[key]["data_offsets"]
        if rows is not None and header[key]["shape"]:
            row = (b - a) // max(1, header[key]["shape"][0])
            a, b = a + rows.start * row, a + rows.stop * row
        return path, base + a, b - a

    def release(self) -> None:
        """Close the files (their mapped pages leave this process's RSS); reopened on the next read."""
        self._open.clear()

    def layer_keys(self) -> dict[int | None, list[str]]:
        """Keys by decoder layer (None: outside the layers)."""
        out: dict[int | None, list[str]] = {}
        for k in self.file_of:
            if k.endswith(SCALE_SUFFIX):  # read with its weight
                continue
            m = LAYER_KEY.match(k)
            out.setdefault(int(m.group(1)) if m else None, []).append(k)
        return out


def fp8_settings(hf_dir: Path) -> tuple[tuple[int, int], torch.dtype]:
    """(block, dtype) of a block-FP8 source's dequantization: its quantization_config's weight_block_size and the
    dtype config.json names (DeepSeek-V3: 128x128, bfloat16)."""
    raw = json.loads(read_input(hf_dir / "config.json"))  # a FIFO there: one line naming it, never a hang
    block = tuple((raw.get("quantization_config") or {}).get("weight_block_size") or (128, 128))
    name = raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"
    return block, getattr(torch, name, torch.bfloat16) if isinstance(name, str) else torch.bfloat16


def is_fp8_source(hf_dir: Path) -> bool:
    raw = json.loads(read_input(hf_dir / "config.json"))  # a FIFO there: one line naming it, never a hang
    return bool(raw.get("quantization_config"))


def quantized_source(hf_dir: Path) -> bool:
    """The HF directory's weights are quantized (DeepSeek-V3's block FP8): transformers cannot load them on the CPU,
    so only the streamed comparison (which dequantizes them itself) can run. False where there is no readable
    config.json (the comparison then says what is wrong, in one line)."""
    try:
        return is_fp8_source(Path(hf_dir))
    except (OSError, ValueError, AttributeError):
        return False


Range = tuple[Path, int, int]  # (file, offset, length); length 0: to the end
READAHEAD_WINDOW = 8 << 30  # bytes read ahead of the walk at most (and at most a quarter of the available memory)


class Readahead:
    """Read-ahead of the bytes the walk will read next into the page cache, from a thread of its own (`_read_ahead`):
    the kernel reads them while this process computes (or imports transformers), so the reads of both checkpoints
    overlap the arithmetic instead of adding to it (the parity reads both checkpoints nearly whole: at 70B width,
    page cache dropped, waiting for the disk was a third of its time). Nothing is read into this process (no RSS),
    the values are still read and checksummed where they are used, and a read-ahead that fails is dropped.
    `walk(steps)` gives a walk over steps (each a list of byte ranges) in the order they will be read."""

    PIECE = 64 << 20
    FADVISE_PIECE = 512 << 10

    def __init__(self, window: int) -> None:
        import queue
        import threading

        self.window = window
        try:
            self._null: int | None = os.open(os.devnull, os.O_WRONLY)
        except OSError:
            self._null = None
        self._q: queue.Queue = queue.Queue()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="shardkit-readahead", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None or self._closed:
                if self._null is not None:
                    os.close(self._null)
                    self._null = None
                return
            path, offset, length = item
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                continue
            try:
                end = offset + length if length else os.fstat(fd).st_size
                off = offset
                while off < end and not self._closed:
                    off += self._read_ahead(fd, off, min(self.PIECE, end - off))
            except OSError:
                pass
            finally:
                os.close(fd)

    def _read_ahead(self, fd: int, off: int, n: int) -> int:
        """Bring [off, off + n) of a file into the page cache: sendfile to /dev/null (the kernel reads it, nothing is
        copied into this process, the GIL is released for the whole piece), else posix_fadvise WILLNEED (one call
        reads at most the device's readahead size, so it goes in smaller pieces: a thread that must take the GIL
        back every half MiB runs at a fraction of the disk's speed while the main thread runs Python)."""
        if self._null is not None:
            try:
                got = os.sendfile(self._null, fd, off, n)
                if got > 0:
                    return got
            except OSError:
                pass
            os.close(self._null)
            self._null = None
        for o in range(off, off + n, self.FADVISE_PIECE):
            os.posix_fadvise(fd, o, min(self.FADVISE_PIECE, off + n - o), os.POSIX_FADV_WILLNEED)
        return n

    def put(self, r: Range) -> None:
        self._q.put(r)

    def walk(self, steps: list[list[Range]]) -> "Walk":
        return Walk(self, steps)

    def close(self) -> None:
        self._closed = True
        self._q.put(None)


class Walk:
    """Steps read in order; `at(n)` (the reader is at step n) hints step n and those after it within the window
    (at least the next), so the page cache holds what is read next rather than evicting it for what comes later."""

    def __init__(self, ahead: Readahead, steps: list[list[Range | None]]) -> None:
        self.ahead, self.steps = ahead, [[r for r in step if r is not None] for step in steps]
        self.sizes = [sum(length for _, _, length in step) for step in self.steps]
        self.next = 0  # the first step not hinted yet

    def at(self, n: int) -> None:
        while self.next < len(self.steps) and (self.next <= n + 1 or
                                               sum(self.sizes[n + 1:self.next + 1]) <= self.ahead.window):
            for r in self.steps[self.next]:
                self.ahead.put(r)
            self.next += 1


class CastPool:
    """fp32 buffers reused across tensors, pieces, layers and both sides for the bf16 -> fp32 casts of the weights.

    A fresh fp32 tensor per weight (GBs per layer at 70B width) costs mostly the kernel's zeroing of its new pages
    (minor page faults; the allocator maps and unmaps every large block), not the conversion itself. A cast or a
    module's parameters take a buffer from here, the smallest idle one holding at least their element count (and at
    most twice it), as `buf[:n].view(shape)` (a layer's shapes recur in every layer and on both sides, and HF's layer
    and ours never live at once; an attention's buffer serves an MLP piece of about its size) and give it back when
    freed. The values are the same (`copy_`
    casts exactly as `.float()` and transformers' loader do); only where they live changes. The pool keeps idle
    buffers only while they and the ones lent out stay within `cap` bytes, dropping the least recently given first,
    so it adds no memory beyond `cap` to what the pieces themselves hold."""

    MIN = 1 << 18  # elements: smaller tensors are not worth it

    def __init__(self, cap: int | None) -> None:
        self.cap = cap
        self.idle: list[Tensor] = []  # free buffers (flat), least recently given first
        self.lent: dict[int, Tensor] = {}  # data_ptr -> the buffer lent out
        self.idle_bytes = self.lent_bytes = 0

    def _fits(self, extra: int) -> bool:
        return self.cap is None or self.idle_bytes + self.lent_bytes + extra <= self.cap

    def take(self, shape) -> Tensor:
        """An uninitialised fp32 tensor of `shape` (a pooled buffer when it is large)."""
        n = math.prod(shape)
        if n < self.MIN:
            return torch.empty(shape)
        fit = [i for i, b in enumerate(self.idle) if n <= b.numel() <= 2 * n]
        if fit:
            buf = self.idle.pop(min(fit, key=lambda i: self.idle[i].numel()))
            self.idle_bytes -= buf.numel() * FP32
        else:
            while self.idle and not self._fits(n * FP32):  # make room: drop the least recently given
                self.idle_bytes -= self.idle.pop(0).numel() * FP32
            buf = torch.empty(n)
        self.lent[buf.data_ptr()] = buf
        self.lent_bytes += buf.numel() * FP32
        return buf[:n].view(shape)

    def cast(self, t: Tensor) -> Tensor:
        """`t.float()`, into a pooled buffer."""
        if t.dtype == torch.float32 or t.numel() < self.MIN or not t.is_floating_point():
            return t.float()
        out = self.take(t.shape)
        out.copy_(t)
        return out

    def give(self, t: Tensor) -> None:
        """Give back the buffer `t` was taken as (no-op for any other tensor). `t` must not be used afterwards."""
        buf = self.lent.pop(t.data_ptr(), None)
        if buf is None:
            return
        self.lent_bytes -= buf.numel() * FP32
        while self.idle and not self._fits(buf.numel() * FP32):
            self.idle_bytes -= self.idle.pop(0).numel() * FP32
        if self._fits(buf.numel() * FP32):
            self.idle.append(buf)
            self.idle_bytes += buf.numel() * FP32

    def materialise(self, module: nn.Module) -> None:
        """`module.to_empty(device="cpu")` with its large parameters in pooled buffers."""
        module.to_empty(device="cpu")
        for sub in module.modules():
            for name, p in list(sub._parameters.items()):
                if p is not None and p.numel() >= self.MIN and p.dtype == torch.float32:
                    sub._parameters[name] = nn.Parameter(self.take(p.shape), requires_grad=p.requires_grad)

    def free(self, module: nn.Module) -> None:
        """Give back `module`'s parameters' buffers and return it to the meta device."""
        for p in module.parameters():
            self.give(p)
        module.to_empty(device="meta")

    def clear(self) -> None:
        """Drop the idle buffers."""
        self.idle.clear()
        self.idle_bytes = 0


def free_piece(module: nn.Module, pool: CastPool | None = None) -> None:
    if pool is not None:
        pool.free(module)
    else:
        module.to_empty(device="meta")
