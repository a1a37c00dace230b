"""One way in to a checkpoint of either format: `open_checkpoint(path)` tells a shardkit native checkpoint (a root with
`latest`, or an iteration with manifest.json) from a Megatron-LM torch_dist one (a root with
`latest_checkpointed_iteration.txt`, or an iteration directory with metadata.json / DCP's .metadata) and returns one
interface over both: the model config (and where it came from), the layout, the iteration, the canonical tensors
(`tensors`: name -> entry with its global shape and dtype) and a read of any region of one by canonical name, and
whether optimizer state is there. `reader` is what reads the canonical tensors: a native `Checkpoint`, or
`TorchDistSource` reading a torch_dist checkpoint in place by region (no staging copy).

A torch_dist checkpoint's model config comes from `hf_config` (an HF config directory), else its own shardkit.json,
else its Megatron-LM args with `vocab_size`; it is read when first asked for (`config`, `reader`, `tensors`), so a
checkpoint nothing describes can still be opened and shown (`inspect`): ConfigError says what is missing."""
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


class NativeCheckpoint(OpenedCheckpoint):
    """A shardkit native checkpoint (checkpoint/reader.py Checkpoint, resolved through `latest` from a root)."""

    format = "native"

    def __init__(self, path: str | Path, check: bool = False) -> None:
        from .reader import Checkpoint

        self.ckpt: Checkpoint = Checkpoint(path, check=check)
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

        return TorchDistSource(self.td, self.config, self.td.layout, self.config_origin)

    @property
    def iteration(self) -> int | str:
        return self.td.iteration

    @property
    def has_optimizer(self) -> bool:
        from .torch_dist_view import import_optimizer_states

        return bool(import_optimizer_states(self.td))


def open_checkpoint(path: str | Path, hf_config: str | None = None, vocab_size: int | None = None,
                    check: bool = False) -> NativeCheckpoint | TorchDistOpened:
    """The checkpoint at `path` (a root or one iteration) of either format. `hf_config` / `vocab_size`: what
    describes a torch_dist checkpoint's model where it does not itself (a native one's manifest always does: they
    are refused for it by the commands that take them). `check`: a native checkpoint's manifest against its arrays
    now (Checkpoint.check)."""
    if is_torch_dist(path):
        return TorchDistOpened(path, hf_config, vocab_size)
    return NativeCheckpoint(path, check=check)
