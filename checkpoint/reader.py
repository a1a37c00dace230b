"""Open a checkpoint, read tensors or slices of them, and verify every chunk."""
from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch

from . import store
from .commit import resolve_iteration
from .config import ModelConfig
from .errors import CorruptionError, FormatError
from .layout import Layout, RankCoord
from .manifest import TRAIN_STATE, Manifest, TensorEntry, tensor_path
from .sharding import SCALE_SUFFIX, Rule, TensorSpec, local_shape, regions, split_optimizer_key


class Checkpoint:
    """A complete checkpoint iteration (resolved through `latest` when given a root)."""

    def __init__(self, path: str | Path, cache_bytes: int = 0):
        self.path = resolve_iteration(path)
        self.manifest = Manifest.load(self.path)
        self._ctx = store.context(cache_bytes=cache_bytes)
        self._arrays: dict = {}

    @property
    def config(self) -> ModelConfig:
        return self.manifest.model

    @property
    def layout(self) -> Layout:
        return self.manifest.layout

    @property
    def tensors(self) -> dict[str, TensorEntry]:
        return self.manifest.tensors

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
        return p if p.is_file() else None

    def spec(self, name: str) -> TensorSpec:
        e = self.entry(name)
        return TensorSpec(name, tuple(e.shape), Rule(e.rule), e.per_layer)

    def entry(self, name: str) -> TensorEntry:
        if name not in self.tensors:
            raise FormatError(f"{self.path}: no tensor {name!r} in the manifest")
        return self.tensors[name]

    def array(self, name: str):
        if name not in self._arrays:
            self.entry(name)
            self._arrays[name] = store.open_existing(self.path / tensor_path(name), self._ctx, name)
        return self._arrays[name]

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """A tensor, or a box of it, from disk (only the chunks it touches are read)."""
        return store.read(self.array(name), index, name)

    def read_local(self, name: str, layout: Layout, coord: RankCoord) -> dict[int, torch.Tensor]:
        """One rank's local tensors of `name` (per model chunk) for any target layout, read through the sharding
        table. Vocab tensors follow the target's padding: rows past the stored ones read as zeros, stored padding
        rows past the target's are not read."""
        layout.check(self.config)
        target = {s.name: s for s in Manifest(0, self.config, layout, {}, fp8=self.manifest.fp8,
                                              optimizer=self.manifest.optimizer).specs()}.get(name)
        if target is None:
            raise FormatError(f"{self.path}: no tensor {name!r} in the sharding table of this checkpoint")
        stored_rows = self.entry(name).shape[0]
        out: dict[int, torch.Tensor] = {}
        for r in regions(target, layout, coord, self.config.num_layers):
            if r.vstage not in out:
                out[r.vstage] = torch.zeros(local_shape(target, layout), dtype=store.torch_dtype(self.entry(name).dtype))
            gs, ls = list(r.global_slices()), list(r.local_slices())
            if target.rule is Rule.VOCAB and gs[0].stop > stored_rows:
                keep = max(0, stored_rows - gs[0].start)
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
        return self.path / "hf"

    # -- verify -------------------------------------------------------------------------------------------------
    def verify(self, progress: Callable[[int], None] | None = None) -> dict:
        """Re-read every chunk (crc32c checked by the codec, missing chunks are errors) and check each array's
        metadata against the manifest. Raises CorruptionError naming the tensor and the chunk."""
        expected = {s.name: s for s in self.manifest.specs()}
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
                json.loads(ts_path.read_text())
            except (ValueError, UnicodeDecodeError) as err:
                raise CorruptionError(f"{ts_path}: not valid JSON ({err})") from None
        total_bytes, chunks = 0, 0
        for name, e in self.tensors.items():
            spec = expected[name]
            if list(spec.shape) != e.shape or spec.rule.value != e.rule or spec.per_layer != e.per_layer:
                raise FormatError(f"tensor {name}: manifest shape/rule {e.shape}/{e.rule} disagree with the model "
                                  f"config ({list(spec.shape)}/{spec.rule.value})")
            arr = self.array(name)
            md = store.metadata(arr)
            got = (md["shape"], md["data_type"], md["chunk_grid"]["configuration"]["chunk_shape"])
            if got != (e.shape, e.dtype, e.chunk):
                raise CorruptionError(f"tensor {name}: array metadata (shape, dtype, chunk) {got} disagree with the "
                                      f"manifest {(e.shape, e.dtype, e.chunk)}")
            if not any(c.get("name") == "crc32c" for c in md.get("codecs", [])):
                raise CorruptionError(f"tensor {name}: array has no crc32c codec; its values cannot be checked")
            for idx in _chunk_boxes(e.shape, e.chunk):
                try:
                    t = store.read(arr, idx, name)
                except CorruptionError as err:
                    chunk = tuple(s.start // c for s, c in zip(idx, e.chunk))
                    raise CorruptionError(f"tensor {name} chunk {chunk}: {str(err).split(': ', 1)[-1]}") from None
                nbytes = t.numel() * t.element_size()
                total_bytes += nbytes
                chunks += 1
                if progress:
                    progress(nbytes)
        return {"tensors": len(self.tensors), "chunks": chunks, "bytes": total_bytes}

    def nbytes(self) -> int:
        return sum(entry_nbytes(e) for e in self.tensors.values())


def entry_nbytes(e: TensorEntry) -> int:
    n = 1
    for s in e.shape:
        n *= s
    return n * store.torch_dtype(e.dtype).itemsize


def _chunk_boxes(shape: list[int], chunk: list[int]) -> Iterator[tuple[slice, ...]]:
    """Boxes of whole chunks, several layers' worth at a time is not needed: one chunk each, in order."""
    ranges = [range(0, s, c) for s, c in zip(shape, chunk)]
    for offs in itertools.product(*ranges):
        yield tuple(slice(o, min(o + c, s)) for o, c, s in zip(offs, chunk, shape))


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
        "total_params": sum(r["bytes"] // store.torch_dtype(r["dtype"]).itemsize for r in rows),
        "optimizer": {"states": m.optimizer, "bytes": optim_bytes} if m.optimizer else None,
        "train_state": TRAIN_STATE if ckpt.train_state_path() else None,
        "hf_files": HFAssets.list(ckpt.path),
        "provenance": m.provenance,
    }


def dumps(d: dict) -> str:
    return json.dumps(d, indent=1)
