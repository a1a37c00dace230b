"""A torch_dist checkpoint seen through a model config and the sharding table: every canonical tensor (and optimizer
state) matched to its stored key, shapes checked against the config, and `TorchDistSource`, which reads it in place
by region as a native Checkpoint is read. `verify`, `inspect`, the torch_dist import (convert/torch_dist_io.py) and the
trainer's `--load` of a torch_dist checkpoint (checkpoint/torch_dist_load.py) all read through it."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from . import store
from .config import ModelConfig
from .errors import FormatError
from .layout import Layout
from .manifest import Manifest, TensorEntry
from .megatron import SKIPPED_PREFIXES, arg, source_keys
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


class TorchDistSource(ManifestView):
    """A torch_dist checkpoint read through a model config and the sharding table as a native Checkpoint is (config,
    layout, manifest and tensor entries at the saving layout, `read` of whole tensors or boxes, `state_dict`): what
    `verify --against` reads, straight from the items (one item in memory at a time, large ones memory-mapped), no
    staging copy."""

    def __init__(self, td: TorchDistCheckpoint, cfg: ModelConfig, layout: Layout | None = None,
                 origin: str = "the model config", hf_config: str | Path | None = None):
        self.td, self.path, self.hf_config = td, td.path, hf_config
        layout = layout or td.layout or Layout()
        entries, self.keys = plan_import(td, cfg, layout, None, None, origin)
        self.manifest = Manifest(td.iteration, cfg, layout, entries)
        self.vocab = vocab_padding(cfg, layout, None)

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        from checkpoint.reader import _box

        box = tuple(_box(self.entry(name).shape, index, name))
        key = self.keys[name]
        return read_padded(lambda idx: self.td.read(key, tuple((x.start, x.stop) for x in idx)), name, box,
                           self.vocab.get(name))

    def state_dict(self, dequantize: bool = False, optimizer: bool = False) -> dict[str, torch.Tensor]:
        return {name: self.read(name) for name in self.tensors}

    def hf_dir(self) -> Path | None:
        """Tokenizer / config files: --hf-config, else the hf/ of a shardkit save (None for Megatron-LM's own)."""
        return Path(self.hf_config) if self.hf_config else self.td.hf_dir()
