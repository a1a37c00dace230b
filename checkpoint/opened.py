"""One way in to a checkpoint of either format: `format_of(path)`, the one place that tells them apart, tells a shardkit
native checkpoint (a root with `latest`, or an iteration with manifest.json) from a Megatron-LM torch_dist one (a
root with `latest_checkpointed_iteration.txt`, or an iteration directory with metadata.json / DCP's .metadata), and
`open_checkpoint(path)` returns one interface over both: the model config (and where it came from), the layout, the
iteration, the canonical tensors (`tensors`: name -> entry with its global shape and dtype) and a read of any region
of one by canonical name, and whether optimizer state is there. `reader` is what reads the canonical tensors: a
native `Checkpoint`, or `TorchDistSource` reading a torch_dist checkpoint in place by region (no staging copy).

A torch_dist checkpoint's model config comes from `hf_config` (an HF config directory), else its own shardkit.json,
else its Megatron-LM args with `vocab_size`; it is read when first asked for (`config`, `reader`, `tensors`), so a
checkpoint nothing describes can still be opened and shown (`inspect`): ConfigError says what is missing.

`open_for_training(path, ...)` is the trainer's `--load` (both engines): the same two formats, read as the trainer
reads them (config, path, layout, optimizer states, train state, hf_dir, read_local at any layout): a native
`Checkpoint`, or a torch_dist one in place (checkpoint/torch_dist_load.py)."""
from __future__ import annotations

import os
from abc import ABC, abstractmethod
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

from .config import ModelConfig
from .layout import Layout
from .manifest import TensorEntry

if TYPE_CHECKING:
    import torch

    from .reader import Checkpoint, ManifestView
    from .torch_dist import TorchDistCheckpoint
    from .torch_dist_load import TorchDistLoad


def is_torch_dist(path: str | Path) -> bool:
    """A Megatron torch_dist checkpoint: a root with latest_checkpointed_iteration.txt, or an iteration directory
    with metadata.json / DCP's .metadata (a shardkit native one has `latest` / manifest.json)."""
    from .megatron import TRACKER

    p = Path(path)
    return os.path.lexists(p / TRACKER) or (p / "metadata.json").is_file() or (p / ".metadata").is_file()


class OpenedCheckpoint(ABC):
    """What every consumer reads of a checkpoint, whatever its format (see the module docstring)."""

    format: str
    path: Path  # the iteration directory

    @property
    def config(self) -> ModelConfig:
        return self.reader.config

    @property
    def layout(self) -> Layout:
        return self.reader.layout

    @property
    def tensors(self) -> dict[str, TensorEntry]:
        """Canonical name -> entry (global shape, dtype, chunking at the stored layout)."""
        return self.reader.tensors

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> "torch.Tensor":
        """A region of canonical tensor `name` (all of it without `index`), vocab padding as the stored layout's."""
        return self.reader.read(name, index)

    def nbytes(self) -> int:
        return self.reader.nbytes()

    @property
    @abstractmethod
    def reader(self) -> "ManifestView":
        ...

    @property
    @abstractmethod
    def iteration(self) -> int | str:
        ...

    @property
    @abstractmethod
    def has_optimizer(self) -> bool:
        ...

    @property
    @abstractmethod
    def config_origin(self) -> str:
        ...

    @property
    def notes(self) -> list[str]:
        """What the reader noticed and worked around (a torch_dist checkpoint's unreadable common.pt and the like)."""
        return []

    @classmethod
    @abstractmethod
    def for_training(cls, path: str | Path, hf_config: str | None, vocab_size: int | None, *, load_optim: bool,
                     check: bool) -> "Checkpoint | TorchDistLoad":
        """The checkpoint at `path` as the trainer reads it (see open_for_training)."""


class NativeCheckpoint(OpenedCheckpoint):
    """A shardkit native checkpoint (checkpoint/reader.py Checkpoint, resolved through `latest` from a root)."""

    format = "native"

    def __init__(self, path: str | Path, check: bool = False, cache_bytes: int = 0) -> None:
        from .reader import Checkpoint

        self.ckpt: Checkpoint = Checkpoint(path, cache_bytes=cache_bytes, check=check)
        self.path = self.ckpt.path

    @property
    def reader(self) -> "Checkpoint":
        return self.ckpt

    @property
    def iteration(self) -> int:
        return self.ckpt.manifest.iteration

    @property
    def has_optimizer(self) -> bool:
        return self.ckpt.has_optimizer

    @property
    def config_origin(self) -> str:
        return f"{self.path}/manifest.json"

    @classmethod
    def for_training(cls, path: str | Path, hf_config: str | None, vocab_size: int | None, *, load_optim: bool,
                     check: bool) -> "Checkpoint":
        """Verified (`check`: the manifest against its arrays); its manifest describes the model, so --hf-config is
        refused (before anything is read) and --vocab-size, Megatron's flag, is a check."""
        from .errors import ConfigError
        from .reader import Checkpoint

        if hf_config:
            raise ConfigError(f"--hf-config: only for a torch_dist --load without shardkit.json; {path} is a "
                              "shardkit checkpoint, whose manifest describes the model (drop the flag)")
        ck = Checkpoint(path, check=check)  # resolved through `latest` from a root
        if vocab_size is not None and vocab_size != ck.config.vocab_size:
            raise ConfigError(f"--vocab-size {vocab_size} disagrees with the checkpoint {ck.path} (vocab size "
                              f"{ck.config.vocab_size}); drop the flag or load the right checkpoint")
        return ck


class TorchDistOpened(OpenedCheckpoint):
    """A Megatron-LM torch_dist checkpoint (checkpoint/torch_dist.py), read in place through the sharding table."""

    format = "torch_dist"

    def __init__(self, path: str | Path, hf_config: str | None = None, vocab_size: int | None = None) -> None:
        from .torch_dist import read_torch_dist

        self.td: TorchDistCheckpoint = read_torch_dist(path)
        self.path = self.td.path
        self.hf_config, self.vocab_size = hf_config, vocab_size

    @cached_property
    def _model(self) -> tuple[ModelConfig, str]:
        return self.td.model_config(self.hf_config, self.vocab_size)

    @property
    def config(self) -> ModelConfig:
        return self._model[0]

    @property
    def config_origin(self) -> str:
        return self._model[1]

    @property
    def layout(self) -> Layout:
        """The saving layout from the checkpoint's Megatron args (tp=pp=1 where they have none)."""
        return self.td.layout or Layout()

    @cached_property
    def reader(self) -> "ManifestView":
        from .torch_dist_view import TorchDistSource

        return TorchDistSource(self.td, self.config, None, self.config_origin, self.hf_config)

    @property
    def iteration(self) -> int | str:
        return self.td.iteration

    @property
    def has_optimizer(self) -> bool:
        from .torch_dist_view import import_optimizer_states

        return bool(import_optimizer_states(self.td))

    @property
    def notes(self) -> list[str]:
        return self.td.notes

    @classmethod
    def for_training(cls, path: str | Path, hf_config: str | None, vocab_size: int | None, *, load_optim: bool,
                     check: bool) -> "TorchDistLoad":
        """Read in place by region at any layout, the optimizer state matched with `load_optim` (its items' bytes are
        checked as they are read, whatever `check` says)."""
        from .torch_dist_load import TorchDistLoad

        return TorchDistLoad(path, hf_config or None, vocab_size, load_optim=load_optim)


def format_of(path: str | Path) -> type[NativeCheckpoint] | type[TorchDistOpened]:
    """The one place that tells the formats apart."""
    return TorchDistOpened if is_torch_dist(path) else NativeCheckpoint


def open_checkpoint(path: str | Path, hf_config: str | None = None, vocab_size: int | None = None,
                    check: bool = False, cache_bytes: int = 0) -> NativeCheckpoint | TorchDistOpened:
    """The checkpoint at `path` (a root or one iteration) of either format. `hf_config` / `vocab_size`: what
    describes a torch_dist checkpoint's model where it does not itself (a native one's manifest always does: they
    are refused for it by the commands that take them). `check`: a native checkpoint's manifest against its arrays
    now (Checkpoint.check); `cache_bytes`: its decoded chunks kept (Checkpoint's cache, for readers that cut one
    chunk into several boxes)."""
    if format_of(path) is TorchDistOpened:
        return TorchDistOpened(path, hf_config, vocab_size)
    return NativeCheckpoint(path, check=check, cache_bytes=cache_bytes)


def open_for_training(path: str | Path, hf_config: str | None, vocab_size: int | None, *, load_optim: bool = True,
                      check: bool = True) -> "Checkpoint | TorchDistLoad":
    """The trainer's --load, either format: what it reads (config, path, layout, optimizer_states, hf_dir(),
    read_local at any layout, train_state(global_batch_size) and where that comes from, train_state_source)."""
    return format_of(path).for_training(path, hf_config, vocab_size, load_optim=load_optim, check=check)
