"""One progress bar for long work: items, bytes, rate and ETA (rich), quiet when not wanted."""
from __future__ import annotations

import contextlib
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
