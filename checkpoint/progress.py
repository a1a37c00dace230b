"""What shardkit prints: one progress bar for long work (items, bytes, rate and ETA, rich), quiet when not wanted;
and the strict JSON of every `--json` output."""
from __future__ import annotations

import contextlib
import json
import math
import sys
from typing import Iterator

from rich.console import Console
from rich.progress import (BarColumn, DownloadColumn, MofNCompleteColumn, Progress, TaskProgressColumn, TextColumn,
                           TimeRemainingColumn, TransferSpeedColumn)


class _Bar:
    def __init__(self, progress: Progress | None, task, items_task):
        self._p, self._t, self._i = progress, task, items_task

    def advance(self, nbytes: int, items: int = 0) -> None:
        if self._p is not None:
            self._p.update(self._t, advance=nbytes)
            if items:
                self._p.update(self._i, advance=items)


@contextlib.contextmanager
def progress_bar(label: str, total: int, items: int, disable: bool = False) -> Iterator[_Bar]:
    """Bytes with rate and ETA on one line, items (tensors/chunks) on the next. Drawn on stderr."""
    if disable:
        yield _Bar(None, None, None)
        return
    console = Console(file=sys.stderr)
    with Progress(TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(), DownloadColumn(binary_units=True),
                  TransferSpeedColumn(), TimeRemainingColumn(), MofNCompleteColumn(), console=console,
                  transient=not console.is_terminal) as p:
        t = p.add_task(f"{label} bytes", total=total)
        i = p.add_task(f"{label} chunks", total=items)
        yield _Bar(p, t, i)


def _finite(obj):
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def json_text(obj, indent: int | None = 1) -> str:
    """Strict JSON (RFC 8259) for `--json` outputs: a NaN or infinite float is written as null, never as the bare
    NaN / Infinity that Python's json module emits and other parsers refuse."""
    return json.dumps(_finite(obj), indent=indent, allow_nan=False)
