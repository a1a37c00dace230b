"""Declarative HF <-> canonical row maps (the HF side of a family's tensor table, checkpoint/families/table.py).

A canonical (per-layer) tensor is a stack of row blocks, each a row range of one HF tensor: QKV interleaves q/k/v
blocks per query group, fc1 is [gate; up], everything else is a single block. Vocab tensors add padding rows. Because
the map is data, the same table answers both directions and any slice: hf-to-mcore reads exactly the HF rows a chunk
needs, mcore-to-hf reads exactly the canonical rows an HF tensor needs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable

import numpy as np

from ..sharding import vocab_fill

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Segment:
    """Canonical rows [start, stop) come from HF tensor `hf_name` rows [hf_start, hf_start + stop - start)."""

    hf_name: str
    hf_start: int
    start: int
    stop: int

    def hf_row(self, row: int) -> int:
        """The HF tensor's row that canonical row `row` (in [start, stop]: stop gives the end) comes from."""
        return self.hf_start + row - self.start


@dataclass(frozen=True)
class TensorMap:
    """One canonical tensor, or one (layer[, expert]) slice of a stacked one (`lead` = its leading indices), as row
    blocks of HF tensors.

    Rows [pad_start, rows) are vocab padding: filled by the one rule (checkpoint.sharding.vocab_fill: the last real
    row repeated, as Megatron's converter does) and never exported."""

    canonical: str
    lead: tuple[int, ...]
    segments: tuple[Segment, ...]
    rows: int
    pad_start: int | None = None

    @property
    def hf_names(self) -> list[str]:
        return list(dict.fromkeys(s.hf_name for s in self.segments))


# Reads rows [start, stop) (and optionally columns) of an HF tensor, as a torch tensor or a numpy array.
HFReader = Callable[[str, int, int, "slice | None"], "torch.Tensor | np.ndarray"]


def assemble(tm: TensorMap, start: int, stop: int, read: HFReader, cols: slice | None = None
             ) -> "torch.Tensor | np.ndarray":
    """Canonical rows [start, stop) of `tm`, reading only the HF rows they need (numpy in, numpy out: the converter
    reads numpy views of the mapped files and never imports torch)."""
    parts = []
    real_stop = min(stop, tm.pad_start) if tm.pad_start is not None else stop
    for seg in tm.segments:
        a, b = max(start, seg.start), min(real_stop, seg.stop)
        if a < b:
            parts.append(read(seg.hf_name, seg.hf_row(a), seg.hf_row(b), cols))
    if tm.pad_start is not None and stop > tm.pad_start:
        last = tm.segments[-1]
        row = read(last.hf_name, last.hf_row(last.stop - 1), last.hf_row(last.stop), cols)
        parts.append(vocab_fill(tm.canonical, row, stop - max(start, tm.pad_start)))
    if len(parts) == 1:
        return parts[0]
    if isinstance(parts[0], np.ndarray):
        return np.concatenate(parts, axis=0)
    import torch

    return torch.cat(parts, dim=0)


def hf_sources(maps: Iterable[TensorMap]) -> dict[str, list[tuple[TensorMap, Segment]]]:
    """Invert the table: for each HF tensor, the canonical blocks that make it up, in HF row order."""
    out: dict[str, list[tuple[TensorMap, Segment]]] = {}
    for tm in maps:
        for seg in tm.segments:
            out.setdefault(seg.hf_name, []).append((tm, seg))
    for v in out.values():
        v.sort(key=lambda p: p[1].hf_start)
    return out


# -- building blocks for family tables -------------------------------------------------------------------------------

def single(canonical: str, lead: tuple[int, ...], hf_name: str, rows: int, pad_to: int | None = None) -> TensorMap:
    seg = Segment(hf_name, 0, 0, rows)
    if pad_to is not None and pad_to > rows:
        return TensorMap(canonical, lead, (seg,), pad_to, pad_start=rows)
    return TensorMap(canonical, lead, (seg,), rows)


def concat(canonical: str, lead: tuple[int, ...], parts: list[tuple[str, int]]) -> TensorMap:
    """[a; b; ...] along rows, e.g. fc1 = [gate; up]."""
    segs, off = [], 0
    for name, n in parts:
        segs.append(Segment(name, 0, off, off + n))
        off += n
    return TensorMap(canonical, lead, tuple(segs), off)


def grouped_qkv(canonical: str, lead: tuple[int, ...], q: str, k: str, v: str, groups: int, heads_per_group: int,
                head_dim: int) -> TensorMap:
    """Megatron's fused QKV: for each query group g, [q heads of g; k_g; v_g]."""
    segs, off = [], 0
    qn = heads_per_group * head_dim
    for g in range(groups):
        for name, hf_start, n in ((q, g * qn, qn), (k, g * head_dim, head_dim), (v, g * head_dim, head_dim)):
            segs.append(Segment(name, hf_start, off, off + n))
            off += n
    return TensorMap(canonical, lead, tuple(segs), off)


def stack_canonical(maps: Iterable[TensorMap], read: HFReader) -> "dict[str, torch.Tensor]":
    """Whole canonical tensors (stacked ones on their leading layer/expert axes) from an HF reader. In-memory: for
    tests and small models only; the converter streams chunk by chunk instead."""
    import torch

    per: dict[str, dict[tuple[int, ...], torch.Tensor]] = {}
    for tm in maps:
        per.setdefault(tm.canonical, {})[tm.lead] = assemble(tm, 0, tm.rows, read)
    out = {}
    for name, d in per.items():
        keys = sorted(d)
        dims = tuple(max(k[i] for k in keys) + 1 for i in range(len(keys[0])))
        t = torch.stack([d[k] for k in keys]) if dims else d[()]
        out[name] = t.reshape(*dims, *t.shape[1:]) if dims else t
    return out


def dict_reader(state: "dict[str, torch.Tensor]") -> HFReader:
    """An HFReader over an in-memory HF state dict."""
    def read(name: str, start: int, stop: int, cols: slice | None = None) -> torch.Tensor:
        t = state[name][start:stop]
        return t if cols is None else t[:, cols]
    return read
