"""Tensorstore zarr3 arrays: one per canonical tensor, crc32c on every chunk, missing chunks are errors.

Also the torch <-> numpy bridge for bf16/fp8 through ml_dtypes views (no copies).
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import ml_dtypes
import numpy as np
import tensorstore as ts
import torch

from .errors import CorruptionError, FormatError

# dtype name (torch's, without the prefix) -> (torch dtype, numpy dtype, same-width integer view for torch<->numpy)
DTYPES: dict[str, tuple[torch.dtype, np.dtype, torch.dtype | None]] = {
    "float32": (torch.float32, np.dtype(np.float32), None),
    "float16": (torch.float16, np.dtype(np.float16), None),
    "bfloat16": (torch.bfloat16, np.dtype(ml_dtypes.bfloat16), torch.int16),
    "float8_e4m3fn": (torch.float8_e4m3fn, np.dtype(ml_dtypes.float8_e4m3fn), torch.uint8),
    "float8_e5m2": (torch.float8_e5m2, np.dtype(ml_dtypes.float8_e5m2), torch.uint8),
}
DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "half": "float16", "float": "float32"}


def dtype_name(d: torch.dtype | str) -> str:
    """Canonical dtype name for a torch dtype or a user string (bf16, fp16, fp32...)."""
    if isinstance(d, torch.dtype):
        for name, (td, _, _) in DTYPES.items():
            if td == d:
                return name
        raise FormatError(f"dtype {d} is not supported; supported: {', '.join(DTYPES)}")
    name = DTYPE_ALIASES.get(d, d)
    if name not in DTYPES:
        raise FormatError(f"unknown dtype {d!r}; use one of bf16, fp16, fp32")
    return name


def torch_dtype(name: str) -> torch.dtype:
    return DTYPES[dtype_name(name)][0]


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor (bf16/fp8 through ml_dtypes)."""
    _, nd, view = DTYPES[dtype_name(t.dtype)]
    t = t.detach().contiguous()
    return (t.view(view).numpy() if view is not None else t.numpy()).view(nd)


def from_numpy(a: np.ndarray) -> torch.Tensor:
    for _, (td, nd, view) in DTYPES.items():
        if a.dtype == nd:
            a = np.ascontiguousarray(a)
            if view is None:
                return torch.from_numpy(a)
            int_np = {torch.int16: np.int16, torch.uint8: np.uint8}[view]
            return torch.from_numpy(a.view(int_np)).view(td)
    raise FormatError(f"array dtype {a.dtype} is not supported")


_CODECS = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]


def array_spec(path: str | Path, shape: Sequence[int] | None = None, dtype: str | None = None,
               chunk: Sequence[int] | None = None) -> dict:
    spec: dict = {
        "driver": "zarr3",
        "kvstore": {"driver": "file", "path": str(path)},
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


def open_existing(path: str | Path, ctx: ts.Context | None = None, name: str | None = None) -> ts.TensorStore:
    try:
        return ts.open(array_spec(path), open=True, context=ctx or context()).result()
    except ValueError as e:
        raise CorruptionError(f"tensor {name or path}: cannot open its array at {path}: {short_error(e)}") from None


def metadata(arr: ts.TensorStore) -> dict:
    return arr.spec().to_json()["metadata"]


def write(arr: ts.TensorStore, index: tuple[slice, ...], value: torch.Tensor) -> ts.WriteFutures:
    """Start writing `value` at `index` (align with chunks: partial chunks are read-modify-write)."""
    return arr[index].write(to_numpy(value))


def read(arr: ts.TensorStore, index: tuple[slice, ...] | None = None, name: str = "?") -> torch.Tensor:
    view = arr if index is None else arr[index]
    try:
        return from_numpy(view.read().result())
    except ValueError as e:
        raise CorruptionError(f"tensor {name}: {short_error(e)}") from None


def short_error(e: Exception) -> str:
    """The first line of a tensorstore error, without its source locations."""
    msg = str(e).splitlines()[0] if str(e) else type(e).__name__
    return msg.split(" [source locations=")[0]
