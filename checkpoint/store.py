"""Tensorstore zarr3 arrays: one per canonical tensor, crc32c on every chunk, missing chunks are errors.

Also the torch <-> numpy bridge for bf16/fp8 through ml_dtypes views (no copies), and `count_nonfinite`, the NaN/Inf
count (a bit test on the exponents) that a narrowing cast, the readers and the writers share. torch is imported only
when a torch tensor or dtype is asked for: a same-dtype conversion moves numpy views end to end and never pays the
~1.4 s (CPU) of importing torch.
"""
from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import ml_dtypes
import numpy as np
import tensorstore as ts

from .errors import CorruptionError, FormatError
from .faults import fault_point

if TYPE_CHECKING:
    import torch

# dtype name (torch's, without the prefix) -> (numpy dtype, same-width integer numpy view for torch<->numpy or None)
NP_DTYPES: dict[str, tuple[np.dtype, type | None]] = {
    "float32": (np.dtype(np.float32), None),
    "float16": (np.dtype(np.float16), None),
    "bfloat16": (np.dtype(ml_dtypes.bfloat16), np.int16),
    "float8_e4m3fn": (np.dtype(ml_dtypes.float8_e4m3fn), np.uint8),
    "float8_e5m2": (np.dtype(ml_dtypes.float8_e5m2), np.uint8),
}
DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "half": "float16", "float": "float32"}


def dtype_name(d: "torch.dtype | np.dtype | str") -> str:
    """Canonical dtype name for a torch or numpy dtype or a user string (bf16, fp16, fp32...)."""
    if isinstance(d, np.dtype):
        for name, (nd, _) in NP_DTYPES.items():
            if nd == d:
                return name
        raise FormatError(f"dtype {d} is not supported; supported: {', '.join(NP_DTYPES)}")
    if not isinstance(d, str):  # a torch.dtype: str(torch.bfloat16) == "torch.bfloat16"
        name = str(d).removeprefix("torch.")
        if name in NP_DTYPES:
            return name
        raise FormatError(f"dtype {d} is not supported; supported: {', '.join(NP_DTYPES)}")
    name = DTYPE_ALIASES.get(d, d)
    if name not in NP_DTYPES:
        raise FormatError(f"unknown dtype {d!r}; use one of bf16, fp16, fp32")
    return name


def numpy_dtype(name: str) -> np.dtype:
    return NP_DTYPES[dtype_name(name)][0]


def itemsize(name: str) -> int:
    return numpy_dtype(name).itemsize


def torch_dtype(name: str) -> "torch.dtype":
    import torch

    return getattr(torch, dtype_name(name))


def to_numpy(t: "torch.Tensor | np.ndarray") -> np.ndarray:
    """A numpy view of a CPU tensor (bf16/fp8 through ml_dtypes); numpy arrays pass through."""
    if isinstance(t, np.ndarray):
        return t
    nd, view = NP_DTYPES[dtype_name(t.dtype)]
    t = t.detach().cpu().contiguous()  # (a no-op for CPU tensors)
    if view is None:
        return t.numpy()
    import torch

    return t.view({np.int16: torch.int16, np.uint8: torch.uint8}[view]).numpy().view(nd)


def from_numpy(a: np.ndarray) -> "torch.Tensor":
    """A torch view of a numpy array (a read-only one, e.g. a view of a memory-mapped file, stays unwritten: torch's
    warning about it is silenced here)."""
    import warnings

    import torch

    name = dtype_name(a.dtype)
    view = NP_DTYPES[name][1]
    a = np.ascontiguousarray(a)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        if view is None:
            return torch.from_numpy(a)
        return torch.from_numpy(a.view(view)).view(torch_dtype(name))


def cast(a: "torch.Tensor | np.ndarray", dtype: str, tensor: str | None = None) -> "torch.Tensor | np.ndarray":
    """`a` in `dtype`: as it is when it already is (no copy, no torch import); otherwise through torch's `.to`, so
    every cast rounds exactly as torch does (the same bytes whichever type came in). A cast that would turn finite
    values into inf/NaN (beyond float16's 65504, float8's range, bfloat16's top) is refused: FormatError naming
    `tensor`, the count and the largest magnitude (issue 34; a bit test on the exponents, a few ms per 100 MB)."""
    name = dtype_name(dtype)
    if isinstance(a, np.ndarray):
        if a.dtype == NP_DTYPES[name][0]:
            return a
        a = from_numpy(a)
    out = a.to(torch_dtype(name))
    if name in _NARROW and a.is_floating_point() and a.dtype != out.dtype:
        made = count_nonfinite(to_numpy(out.detach().cpu()))
        if made:
            had = count_nonfinite(to_numpy(a.detach().cpu()))
            if made > had:
                import torch

                finite = a.detach()[torch.isfinite(a.detach())]
                top = float(finite.abs().max()) if finite.numel() else float("nan")
                raise FormatError(f"tensor {tensor or '(unnamed)'}: {made - had:,} finite value(s) (|x| up to "
                                  f"{top:.6g}) lie beyond {name}'s range (max {float(torch.finfo(out.dtype).max):.6g})"
                                  f" and would become inf/NaN; refusing the cast to {name} (keep a wider --dtype, "
                                  "e.g. bf16)")
    return out


# casts that can overflow: a finite source value beyond the target's largest becomes inf (or NaN for float8_e4m3fn)
_NARROW = {"float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"}


# dtype -> (unsigned view, exponent mask, the masked value of NaN/Inf): a value is not finite when all its exponent
# bits are set (float8_e4m3fn has no Inf and one NaN pattern per sign, S.1111.111).
_NONFINITE_BITS = {"float64": (np.uint64, 0x7FF0000000000000, 0x7FF0000000000000),
                   "float32": (np.uint32, 0x7F800000, 0x7F800000), "bfloat16": (np.uint16, 0x7F80, 0x7F80),
                   "float16": (np.uint16, 0x7C00, 0x7C00), "float8_e4m3fn": (np.uint8, 0x7F, 0x7F),
                   "float8_e5m2": (np.uint8, 0x7C, 0x7C)}
_NONFINITE_BLOCK = 1 << 17  # elements: the scratch block stays in L2
_SCRATCH = threading.local()  # one scratch block per thread and width, reused by every call


def count_nonfinite(a: np.ndarray) -> int:
    """How many NaN/Inf values `a` holds (0 for integer dtypes). A value is NaN/Inf exactly when its bits without the
    sign are at least those of +Inf (the exponent all ones), so each block of 128 Ki elements costs one AND into a
    reused scratch block and one max (the count itself runs only for a block that holds one): ~0.2 ns per bf16
    element and no memory beyond the scratch block (issue 42: was an AND, an equality array and a count per block,
    twice the time, with a new 3 MB of temporaries per call)."""
    bits = _NONFINITE_BITS.get(np.dtype(a.dtype).name)
    if bits is None:
        return 0 if np.dtype(a.dtype).kind in "biu" else int(np.count_nonzero(~np.isfinite(a)))
    utype, _, value = bits
    if a.ndim == 0 or a.size == 0:
        return int(a.size and count_nonfinite(a.reshape(1)))
    if not a.flags.c_contiguous:  # a column slice: one block of rows at a time, never a copy of the whole
        rows = max(1, _NONFINITE_BLOCK // max(1, a[0].size))
        return sum(count_nonfinite(np.ascontiguousarray(a[i:i + rows])) for i in range(0, a.shape[0], rows))
    flat = a.reshape(-1).view(utype)
    key = np.dtype(utype).name
    buf = getattr(_SCRATCH, key, None)
    if buf is None:
        buf = np.empty(_NONFINITE_BLOCK, utype)
        setattr(_SCRATCH, key, buf)
    absmask = utype(np.iinfo(utype).max >> 1)
    n = 0
    for i in range(0, flat.size, _NONFINITE_BLOCK):
        part = flat[i:i + _NONFINITE_BLOCK]
        out = buf[:part.size]
        np.bitwise_and(part, absmask, out=out)
        if out.max() >= value:
            n += int(np.count_nonzero(out >= value))
    return n


_CODECS = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]
TENSOR_ATTR = "shardkit_tensor"


def array_spec(path: str | Path, shape: Sequence[int] | None = None, dtype: str | None = None,
               chunk: Sequence[int] | None = None) -> dict:
    spec: dict = {
        "driver": "zarr3",
        # resolved: tensorstore's file driver refuses a path with a `..` component ("Invalid file path"), and the
        # OS, not a lexical rule, decides what `link/..` is
        "kvstore": {"driver": "file", "path": os.path.realpath(path)},
        # a chunk that is absent must be an error, not a silent tensor of zeros
        "fill_missing_data_reads": False,
    }
    if shape is not None:
        spec["metadata"] = {
            "shape": list(shape),
            "data_type": dtype_name(dtype),
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunk)}},
            "codecs": _CODECS,
            "fill_value": 0,
            # the array's own name (its directory, `model/<name>`): two arrays swapped on disk are found out on open
            "attributes": {TENSOR_ATTR: Path(path).name},
        }
        spec["store_data_equal_to_fill_value"] = True
    return spec


def context(io_concurrency: int = 16, cache_bytes: int = 0) -> ts.Context:
    """`cache_bytes` > 0 keeps that many bytes of decoded chunks, for readers that read one chunk in several slices."""
    spec: dict = {"file_io_concurrency": {"limit": io_concurrency}, "data_copy_concurrency": {"limit": 2}}
    if cache_bytes:
        spec["cache_pool"] = {"total_bytes_limit": cache_bytes}
    return ts.Context(spec)


def create(path: str | Path, shape: Sequence[int], dtype: str, chunk: Sequence[int],
           ctx: ts.Context | None = None) -> ts.TensorStore:
    """Create (or reopen, when resuming) an array whose metadata must equal what we ask for."""
    spec = array_spec(path, shape, dtype, chunk)
    return ts.open(spec, create=True, open=True, context=ctx or context()).result()


JSON_MAX_DEPTH = 64  # zarr.json nests 5 deep; tensorstore's parser recurses per level and overflows the C stack
ZARR_JSON_MAX = 16 << 20


def check_json_depth(path: Path, what: str, limit: int = JSON_MAX_DEPTH) -> None:
    """Refuse a JSON file nested deeper than `limit` (or larger than ZARR_JSON_MAX) before a C++ parser sees it
    (issue 34: a zarr.json of 100,000 nested arrays crashed the process in tensorstore): one FormatError naming it.
    Strings are skipped; depth is counted with numpy over the bytes (no recursion)."""
    import re

    try:
        if not path.is_file():
            return  # (missing: tensorstore's own error names it)
        if path.stat().st_size > ZARR_JSON_MAX:
            raise FormatError(f"{what}: {path}: {path.stat().st_size:,} bytes, more than a zarr.json's "
                              f"{ZARR_JSON_MAX:,}; refusing it")
        data = re.sub(rb'"(?:[^"\\]|\\.)*"', b"", path.read_bytes())
    except OSError:
        return
    a = np.frombuffer(data, np.uint8)
    step = ((a == 0x5B) | (a == 0x7B)).astype(np.int32) - ((a == 0x5D) | (a == 0x7D)).astype(np.int32)
    if a.size and int(np.cumsum(step).max()) > limit:
        raise FormatError(f"{what}: {path}: JSON nested more than {limit} levels deep; refusing to parse it")


def open_existing(path: str | Path, ctx: ts.Context | None = None, name: str | None = None) -> ts.TensorStore:
    from .safety import regular_file

    # tensorstore would block forever reading a FIFO there: refused first, naming it
    if os.path.lexists(Path(path) / "zarr.json"):
        regular_file(Path(path) / "zarr.json", f"tensor {name or path}")
    check_json_depth(Path(path) / "zarr.json", f"tensor {name or path}")
    try:
        return ts.open(array_spec(path), open=True, context=ctx or context()).result()
    except ValueError as e:
        raise CorruptionError(f"tensor {name or path}: cannot open its array at {path}: {short_error(e)}") from None


def metadata(arr: ts.TensorStore) -> dict:
    return arr.spec().to_json()["metadata"]


def write(arr: ts.TensorStore, index: tuple[slice, ...], value: "torch.Tensor | np.ndarray",
          immutable: bool = False) -> ts.WriteFutures:
    """Start writing `value` at `index` (align with chunks: partial chunks are read-modify-write).

    `immutable`: the caller never modifies `value` (nor what it views) again, so tensorstore may encode it in place
    instead of first copying it into its own buffer: one full pass over the bytes (and the page faults of a fresh
    buffer) less per chunk."""
    fault_point("store.write")
    return arr[index].write(to_numpy(value), can_reference_source_data_indefinitely=immutable)


def read(arr: ts.TensorStore, index: tuple[slice, ...] | None = None, name: str = "?") -> "torch.Tensor":
    view = arr if index is None else arr[index]
    try:
        return from_numpy(view.read().result())
    except ValueError as e:
        raise CorruptionError(f"tensor {name}: {short_error(e)}") from None


def short_error(e: Exception) -> str:
    """The first line of a tensorstore error, without its source locations."""
    msg = str(e).splitlines()[0] if str(e) else type(e).__name__
    return msg.split(" [source locations=")[0]
