"""A torch_dist checkpoint seen through a model config and the sharding table: every canonical tensor (and optimizer
state) matched to its stored key, shapes checked against the config, and `TorchDistSource`, which reads it in place
by region as a native Checkpoint is read. `verify`, `inspect`, the torch_dist import (convert/torch_dist_io.py) and the
trainer's `--load` of a torch_dist checkpoint (checkpoint/torch_dist_load.py) all read through it. Here too what
`inspect` shows of one (describe_torch_dist) and `verify`'s integrity check (verify_torch_dist: keys, shapes and rank
shards against the model config and the sharding table, every item read), the torch_dist twins of checkpoint/reader.py's
describe and Checkpoint.verify."""
from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np

from . import store
from .config import ModelConfig
from .errors import FormatError, ShardkitError
from .layout import Layout
from .manifest import Manifest, TensorEntry
from .megatron import SKIPPED_PREFIXES, arg, shard_owners, source_keys
from .megatron_bridge import flat_buffers, flat_layout_proved
from .reader import ManifestView, read_padded, vocab_padding
from .sharding import OPTIMIZER_STATES, Rule, TensorSpec, split_optimizer_key
from .torch_dist import TorchDistCheckpoint

if TYPE_CHECKING:
    import torch


def import_optimizer_states(td: TorchDistCheckpoint) -> list[str]:
    """The optimizer states a torch_dist checkpoint holds in model space (optimizer.state.<state>.<key>)."""
    states = []
    for st in OPTIMIZER_STATES:
        spellings = ("param", "fp32_param") if st == "fp32_param" else (st,)
        if any(k.startswith(tuple(f"optimizer.state.{sp}." for sp in spellings)) for k in td.tensors):
            states.append(st)
    return states


def match_keys(td: TorchDistCheckpoint, specs: list[TensorSpec]) -> tuple[dict[str, str], list[str], list[str]]:
    """Every canonical tensor of `specs` matched to its torch_dist key: (canonical -> key, canonical names with no
    key, stored tensor keys no spec claims; optimizer objects, RNG state and the like are not counted as either)."""
    keys, missing = {}, []
    for s in specs:
        k = next((k for k in source_keys(s.name) if k in td.tensors), None)
        if k is None:
            missing.append(s.name)
        else:
            keys[s.name] = k
    used = set(keys.values())
    unexpected = sorted(k for k in td.tensors if k not in used and not k.startswith(SKIPPED_PREFIXES))
    return keys, missing, unexpected


def shape_problems(td: TorchDistCheckpoint, cfg: ModelConfig, specs: list[TensorSpec], keys: dict[str, str],
                   origin: str = "the model config") -> list[str]:
    """One line per stored tensor whose global shape the model config does not imply: a layer count, a vocabulary
    (at least the true vocab; exactly the args' padded_vocab_size where they have one), or any other shape."""
    padded = arg(td.args, "padded_vocab_size")
    padded = padded if isinstance(padded, int) and not isinstance(padded, bool) else None
    out = []
    for s in specs:
        k = keys.get(s.name)
        if k is None:
            continue
        got, want = tuple(td.tensors[k].shape), tuple(s.shape)
        if s.rule is Rule.VOCAB and got[1:] == want[1:] and len(got) == len(want):
            model = split_optimizer_key(s.name) is None
            if got[0] < cfg.vocab_size:
                out.append(f"{td.path}: tensor {k} has {got[0]} rows, fewer than the vocab_size={cfg.vocab_size} of "
                           f"{origin}")
            elif model and padded is not None and got[0] != padded:
                out.append(f"{td.path}: tensor {k} has {got[0]} rows, but {td.args_source} args say "
                           f"padded_vocab_size={padded}")
        elif got != want:
            e = int(s.per_layer)  # the expert axis of the experts' and the router's tensors
            experts = s.expert or ".mlp.router." in s.name
            if experts and len(got) == len(want) and got[:e] + got[e + 1:] == want[:e] + want[e + 1:]:
                out.append(f"{td.path}: tensor {k} stacks {got[e]} experts (global shape {list(got)}), but {origin} "
                           f"says num_moe_experts={cfg.num_moe_experts}")
            elif s.per_layer and len(got) == len(want) and got[1:] == want[1:]:
                out.append(f"{td.path}: tensor {k} stacks {got[0]} layers (global shape {list(got)}), but {origin} "
                           f"says num_layers={cfg.num_layers}")
            else:
                out.append(f"{td.path}: tensor {k} has global shape {list(got)}, but {origin} implies {list(want)}")
    return out


def plan_import(td: TorchDistCheckpoint, cfg: ModelConfig, layout: Layout, dtype: str | None,
                optimizer: list[str] | None = None, origin: str = "the model config"
                ) -> tuple[dict[str, TensorEntry], dict[str, str]]:
    """Match every canonical tensor (and, with `optimizer`, its optimizer state) to its torch_dist key and check
    shapes (`origin` names where `cfg` came from, for the messages). Returns (entries, canonical -> key). Optimizer
    state is stored as fp32 whatever `dtype` says."""
    specs = Manifest(0, cfg, layout, {}, optimizer=optimizer).specs()
    keys, missing, unexpected = match_keys(td, specs)
    if missing:
        what = "optimizer state" if all(split_optimizer_key(n) for n in missing) else "tensor(s) the model config needs"
        extra = (f", and it holds {len(unexpected)} tensor(s) the model config has no place for, e.g. "
                 f"{', '.join(unexpected[:2])}" if unexpected else "")
        raise FormatError(f"{td.path}: {len(missing)} {what} are missing, e.g. "
                          f"{', '.join(missing[:3])}{extra}; is the model config ({origin}) right for this checkpoint?")
    if unexpected:
        raise FormatError(f"{td.path}: {len(unexpected)} tensor(s) are not part of the model config ({origin}), e.g. "
                          f"{', '.join(unexpected[:3])}; refusing to drop them silently")
    problems = shape_problems(td, cfg, specs, keys, origin)
    if problems:
        more = f" ({len(problems) - 1} more tensors disagree)" if len(problems) > 1 else ""
        raise FormatError(problems[0] + more)
    entries = {}
    for s in specs:
        src = td.tensors[keys[s.name]]
        dt = "float32" if split_optimizer_key(s.name) else dtype or store.dtype_name(src.dtype)
        entries[s.name] = TensorEntry.of(s, layout, dt)
    return entries, keys


def read_layout(td: TorchDistCheckpoint, cfg: ModelConfig) -> Layout:
    """The layout a torch_dist checkpoint is read at: the saving one from its Megatron-LM args where that fits the
    model, else tp=pp=1 (no args, or args whose layout does not fit the model, e.g. --hf-config's)."""
    layout = td.layout or Layout()
    try:
        layout.check(cfg)
    except ShardkitError:
        return Layout()
    return layout


class TorchDistSource(ManifestView):
    """A torch_dist checkpoint read through a model config and the sharding table as a native Checkpoint is (config,
    layout, manifest and tensor entries at the saving layout, `read` of whole tensors or boxes, `state_dict`): what
    `verify --against` reads, straight from the items (one item in memory at a time, large ones memory-mapped), no
    staging copy."""

    def __init__(self, td: TorchDistCheckpoint, cfg: ModelConfig, layout: Layout | None = None,
                 origin: str = "the model config", hf_config: str | Path | None = None):
        self.td, self.path, self.hf_config = td, td.path, hf_config
        layout = layout or read_layout(td, cfg)
        entries, self.keys = plan_import(td, cfg, layout, None, None, origin)
        self.manifest = Manifest(td.iteration, cfg, layout, entries)
        self.vocab = vocab_padding(cfg, layout, None)

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        from checkpoint.reader import _box

        box = tuple(_box(self.entry(name).shape, index, name))
        key = self.keys[name]
        t = read_padded(lambda idx: self._stored(key, tuple((x.start, x.stop) for x in idx)), name, box,
                        self.vocab.get(name))
        if isinstance(t, np.ndarray):
            t = store.from_numpy(t if t.flags.writeable else t.copy())  # not a view of the file's mapping
        return t

    def _stored(self, key: str, box: tuple[tuple[int, int], ...]) -> np.ndarray | torch.Tensor:
        """A box of stored tensor `key`: its items' data memory-mapped, no torch.load (a box inside one item is a
        view of it; an export cuts each item into several boxes)."""
        return self.td.read_numpy(key, box)

    def state_dict(self, dequantize: bool = False, optimizer: bool = False) -> dict[str, torch.Tensor]:
        return {name: self.read(name) for name in self.tensors}

    def hf_dir(self) -> Path | None:
        """Tokenizer / config files: --hf-config, else the hf/ of a shardkit save (None for Megatron-LM's own)."""
        return Path(self.hf_config) if self.hf_config else self.td.hf_dir()


# -- inspect and verify of a torch_dist checkpoint, read in place ------------------------------------------------

def _rows(td: TorchDistCheckpoint, names: list[str]) -> list[dict]:
    rows = []
    for name in names:
        t = td.tensors[name]
        files = sorted({td.item_file(name, off) for off, _ in t.chunks})
        rows.append({"name": name, "shape": list(t.shape), "dtype": store.dtype_name(t.dtype), "shards": len(t.chunks),
                     "files": files, "bytes": math.prod(t.shape) * t.dtype.itemsize})
    return rows


def describe_torch_dist(td: TorchDistCheckpoint, cfg: ModelConfig | None = None, origin: str | None = None,
                        why_unknown: str | None = None) -> dict:
    """What `inspect` shows of a torch_dist checkpoint (`--json` prints it): the layout from the Megatron args, the
    model config where something describes it (`origin`; else `why_unknown`), every tensor of DCP's metadata (key,
    global shape, dtype, how many shards, which rank files), the optimizer state (present or not), the objects,
    common.pt's entries and shardkit's own files."""
    optim = sorted(k for k in td.tensors if k.startswith("optimizer."))
    model = [k for k in td.tensors if not k.startswith("optimizer.")]
    rows, optim_rows = _rows(td, model), _rows(td, optim)
    layout = td.layout
    content = (td.common or {}).get("content_metadata")
    d = {
        "path": str(td.path),
        "format": "torch_dist (Megatron-LM)",
        "iteration": td.iteration,
        "layout": layout.to_dict() if layout else None,
        "layout_from": f"{td.args_source} args" if layout else None,
        "model_from": origin,
        "model": {k: v for k, v in cfg.to_dict().items() if k != "hf_config"} if cfg else None,
        "model_unknown": why_unknown if cfg is None else None,
        "vocab": ({"size": cfg.vocab_size, "padded_size": arg(td.args, "padded_vocab_size",
                                                               cfg.padded_vocab_size((layout or Layout()).tp)),
                   "divisible_by": cfg.make_vocab_size_divisible_by} if cfg else None),
        "tensors": rows,
        "total_bytes": sum(r["bytes"] for r in rows),
        "total_params": sum(math.prod(r["shape"]) for r in rows),
        "optimizer": {"present": bool(optim), "states": import_optimizer_states(td), "tensors": len(optim_rows),
                      "bytes": sum(r["bytes"] for r in optim_rows),
                      "sharding_type": (content or {}).get("distrib_optim_sharding_type")
                      if isinstance(content, dict) else None},
        "objects": len(td.objects),
        "files": td.files(),
        "common": sorted(map(str, td.common)) if td.common else None,
        "shardkit": bool(td.sidecar),
        "hf_files": sorted(p.name for p in td.hf_dir().iterdir() if p.is_file()) if td.hf_dir() else [],
        "provenance": td.sidecar["provenance"] if td.sidecar else None,
        "notes": td.notes,
    }
    return d


def shard_problems(td: TorchDistCheckpoint, cfg: ModelConfig, layout: Layout, specs: list[TensorSpec],
                   keys: dict[str, str]) -> list[str]:
    """One line per stored item that does not lie inside one rank's shard of `layout` (the args' layout) in the
    sharding table: then the args do not describe how the items were saved."""
    out = []
    for s in specs:
        k = keys.get(s.name)
        if k is None or tuple(td.tensors[k].shape) != tuple(s.shape):
            continue  # reported by shape_problems
        owners = shard_owners(s, layout, cfg.num_layers)
        for off, size in td.tensors[k].chunks:
            if not any(all(o <= a and a + n <= o + r for a, n, o, r in zip(off, size, reg.global_offset, reg.shape))
                       for reg, _ in owners):
                out.append(f"{td.path / td.item_file(k, off)}: item {k} at {list(off)} of size {list(size)} lies "
                           f"across the rank shards of tp={layout.tp} pp={layout.pp} vpp={layout.vpp} ep={layout.ep} "
                           f"etp={layout.expert_tp} (the layout in common.pt's args); the args do not describe how "
                           "it was saved")
                break
    return out


def _nonfinite(value: torch.Tensor) -> int:
    """NaN/Inf count of an item: the block-wise bit test for the dtypes the format stores, torch's own otherwise."""
    try:
        return store.count_nonfinite(store.to_numpy(value))
    except (FormatError, KeyError):
        import torch

        return int((~torch.isfinite(value)).sum()) if value.is_floating_point() else 0


def verify_torch_dist(td: TorchDistCheckpoint, cfg: ModelConfig, origin: str,
                      progress: Callable[[int], None] | None = None) -> dict:
    """`verify` of a torch_dist checkpoint: every key and global shape against the model config and the sharding
    table at the args' layout (missing and unexpected keys, shapes, layer counts, vocab rows, items that straddle
    rank shards), then every item read (torch.load(weights_only=True) of its bytes, its shape and dtype checked
    against the metadata) with its non-finite values counted. Problems are collected, not raised; only unreadable
    items raise (FormatError naming the file and the item)."""
    layout = td.layout or Layout()
    problems: list[str] = []
    try:
        layout.check(cfg)
    except ShardkitError as e:
        problems.append(f"{td.args_source}: the args' layout does not fit {origin}: {e}")
    optimizer = import_optimizer_states(td) or None
    specs = Manifest(0, cfg, layout, {}, optimizer=optimizer).specs()
    keys, missing, unexpected = match_keys(td, specs)
    problems += shape_problems(td, cfg, specs, keys, origin)
    if not problems:
        problems += shard_problems(td, cfg, layout, specs, keys)
    nonfinite: dict[str, int] = {}
    items = nbytes = 0
    # Megatron-LM's dp_reshardable flat buffers: their padding between parameters is uninitialised memory, so
    # non-finite values are counted over the parameters' ranges only, where the layout is rebuilt and proved
    flat = {k for ks in flat_buffers(td).values() for k in ks}
    spans = flat_layout_proved(td, cfg.num_layers) if flat else None
    for name, t in td.tensors.items():
        for off, _ in t.chunks:
            value = td.read_item(name, off)
            if name in flat and spans is not None:  # the parts of this chunk that hold parameters
                lo, hi = off[0], off[0] + value.shape[0]
                bad = sum(_nonfinite(value[max(s, lo) - lo:min(s + n, hi) - lo]) for _, _, s, n in spans
                          if max(s, lo) < min(s + n, hi))
            else:
                bad = _nonfinite(value)
            if bad:
                nonfinite[name] = nonfinite.get(name, 0) + bad
            n = value.numel() * value.element_size()
            del value
            items += 1
            nbytes += n
            if progress:
                progress(n)
    return {"path": str(td.path), "format": "torch_dist", "iteration": td.iteration, "layout": layout.to_dict(),
            "layout_from": f"{td.args_source} args" if td.layout else "none (tp=pp=1 assumed)",
            "model_from": origin, "tensors": len(td.tensors), "items": items, "objects": len(td.objects),
            "files": len(td.files()), "bytes": nbytes, "missing": missing, "unexpected": unexpected,
            "problems": problems, "nonfinite": nonfinite, "optimizer": optimizer,
            "keys_ok": not (missing or unexpected or problems)}
