"""mcore-to-hf: stream a shardkit checkpoint back to HF sharded safetensors, config.json and tokenizer files.

The same mapping table as hf-to-mcore, read backwards: each HF tensor is the concatenation, in HF row order, of
canonical row blocks; vocab padding rows are never part of a block, so they are never exported. Tensors are written
into safetensors files block by block (the safetensors library writes whole dicts only, so the small framing is done
here: 8-byte header length, JSON header, raw little-endian bytes), which keeps memory bounded by one block.
"""
from __future__ import annotations

import json
import os
import shutil
import struct
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from checkpoint import store
from checkpoint.commit import fsync_path
from checkpoint.errors import ShardkitError, WriteError
from checkpoint.progress import progress_bar
from checkpoint.reader import Checkpoint

from . import families
from .hf_source import INDEX
from .mapping import Segment, TensorMap, hf_sources

_ST_NAMES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float8_e4m3fn": "F8_E4M3",
             "float8_e5m2": "F8_E5M2"}
BLOCK_BYTES = 64 << 20


@dataclass
class HFTensorPlan:
    name: str
    dtype: str
    shape: tuple[int, ...]
    blocks: list[tuple[TensorMap, Segment]]

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * store.torch_dtype(self.dtype).itemsize


def plan_export(ckpt: Checkpoint, dtype: str | None) -> list[HFTensorPlan]:
    cfg = ckpt.config
    maps = families.for_config(cfg).tensor_maps(cfg, ckpt.layout)
    plans = []
    for hf_name, blocks in hf_sources(maps).items():
        tm0 = blocks[0][0]
        e = ckpt.entry(tm0.canonical)
        rows = sum(seg.stop - seg.start for _, seg in blocks)
        cols = e.shape[2 if e.per_layer else 1:]
        plans.append(HFTensorPlan(hf_name, dtype or e.dtype, (rows, *cols), blocks))
    return plans


def parse_size(s: str | int) -> int:
    if isinstance(s, int):
        return s
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "B": 1}
    t = s.strip().upper()
    for u in sorted(units, key=len, reverse=True):
        if t.endswith(u):
            try:
                return int(float(t[: -len(u)]) * units[u])
            except ValueError:
                break
    try:
        return int(t)
    except ValueError:
        raise ShardkitError(f"--max-shard-size: cannot parse {s!r} (e.g. 5GB, 500MB)") from None


def _shards(plans: list[HFTensorPlan], max_bytes: int) -> list[list[HFTensorPlan]]:
    shards: list[list[HFTensorPlan]] = [[]]
    size = 0
    for p in plans:
        if shards[-1] and size + p.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(p)
        size += p.nbytes
    return shards


def _read_block(ckpt: Checkpoint, tm: TensorMap, start: int, stop: int) -> torch.Tensor:
    e = ckpt.entry(tm.canonical)
    if e.per_layer:
        return ckpt.read(tm.canonical, (slice(tm.layer, tm.layer + 1), slice(start, stop)))[0]
    return ckpt.read(tm.canonical, (slice(start, stop),))


def _write_shard(ckpt: Checkpoint, path: Path, plans: list[HFTensorPlan], bar) -> None:
    header, off = {}, 0
    for p in plans:
        header[p.name] = {"dtype": _ST_NAMES[p.dtype], "shape": list(p.shape), "data_offsets": [off, off + p.nbytes]}
        off += p.nbytes
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for p in plans:
            td = store.torch_dtype(p.dtype)
            row_bytes = max(1, p.nbytes // max(1, p.shape[0]))
            step = max(1, BLOCK_BYTES // row_bytes)
            for tm, seg in p.blocks:
                for a in range(seg.start, seg.stop, step):
                    b = min(seg.stop, a + step)
                    t = _read_block(ckpt, tm, a, b).to(td).contiguous()
                    f.write(store.to_numpy(t).tobytes())
                    bar.advance(t.numel() * t.element_size())
            bar.advance(0, 1)
        f.flush()
        os.fsync(f.fileno())


def convert_mcore_to_hf(ckpt_path: str | Path, out: str | Path, dtype: str | None = None,
                        max_shard_size: str | int = "5GB", overwrite: bool = False, quiet: bool = False) -> Path:
    ckpt = Checkpoint(ckpt_path)
    out = Path(out)
    dtype = store.dtype_name(dtype) if dtype else None
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise ShardkitError(f"{out}: output exists and is not empty; pass --overwrite to replace it")
    plans = plan_export(ckpt, dtype)
    shards = _shards(plans, parse_size(max_shard_size))
    tmp = out.with_name(f".{out.name}.partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        weight_map, total = {}, sum(p.nbytes for p in plans)
        n = len(shards)
        with progress_bar("mcore-to-hf", total=total, items=len(plans), disable=quiet) as bar:
            for i, shard in enumerate(shards):
                fname = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
                _write_shard(ckpt, tmp / fname, shard, bar)
                weight_map.update({p.name: fname for p in shard})
        if n > 1:
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        cfg_out = ckpt.config.to_hf(dtype=dtype or _dominant_dtype(plans))
        (tmp / "config.json").write_text(json.dumps(cfg_out, indent=2) + "\n")
        for asset in sorted(ckpt.hf_dir().glob("*")) if ckpt.hf_dir().is_dir() else []:
            if asset.is_file() and not asset.is_symlink():
                shutil.copyfile(asset, tmp / asset.name)
        for p in tmp.iterdir():
            fsync_path(p)
        fsync_path(tmp)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise WriteError(f"{out}: export failed while writing ({e.strerror or e}); nothing was left behind") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        old = out.with_name(f".{out.name}.old-{int(time.time())}")
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out)
    fsync_path(out.parent)
    return out


def _dominant_dtype(plans: list[HFTensorPlan]) -> str:
    by: dict[str, int] = {}
    for p in plans:
        by[p.dtype] = by.get(p.dtype, 0) + p.nbytes
    return max(by, key=by.get)
