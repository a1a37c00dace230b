"""What shardkit prints: one progress bar for long work (bytes with rate and ETA, and items), quiet when not wanted;
and the strict JSON of every `--json` output."""
from __future__ import annotations

import contextlib
import json
import math
import sys
import threading
from typing import Iterator

from rich.console import Console
from rich.progress import BarColumn, Progress, ProgressColumn, TaskProgressColumn, TextColumn, TimeRemainingColumn
from rich.text import Text

MiB, GiB = 1 << 20, 1 << 30


def _size_unit(total: float) -> tuple[int, str]:
    """One binary unit for the whole bar (sizes and rate), chosen from the total: MiB, or GiB from 10 GiB up."""
    return (GiB, "GiB") if total >= 10 * GiB else (MiB, "MiB")


class _BytesColumn(ProgressColumn):
    """`256.0/610.0 MiB`: done and total in the bar's one unit."""

    def render(self, task) -> Text:
        div, unit = _size_unit(task.total or 0)
        return Text(f"{task.completed / div:,.1f}/{(task.total or 0) / div:,.1f} {unit}", style="progress.download")


class _RateColumn(ProgressColumn):
    """`85.3 MiB/s`, in the unit of the sizes (never MiB next to MB/s); `?` until two updates have been timed."""

    def render(self, task) -> Text:
        div, unit = _size_unit(task.total or 0)
        speed = task.finished_speed or task.speed
        return Text("?" if speed is None else f"{speed / div:,.1f} {unit}/s", style="progress.data.speed")


class _Bar:
    """Thread-safe: writer threads report bytes as they are written, the recorder reports items as they become
    durable."""

    def __init__(self, progress: Progress | None, task, items: int, unit: str):
        self._p, self._t = progress, task
        self._items, self._done, self._unit = items, 0, unit
        self._lock = threading.Lock()

    def advance(self, nbytes: int, items: int = 0) -> None:
        if self._p is None:
            return
        with self._lock:
            self._done += items
            fields = {"items": f"{self._unit} {self._done:,}/{self._items:,}"} if self._items else {}
            self._p.update(self._t, advance=nbytes, **fields)


@contextlib.contextmanager
def progress_bar(label: str, total: int, items: int, disable: bool = False, unit: str = "chunks") -> Iterator[_Bar]:
    """One line on stderr: the bytes (bar, percentage, done/total, rate, ETA, all in one binary unit) and how many
    of the `items` (`unit`: chunks, tensors, lines) are done. Drawn only on a terminal: piped or captured stderr gets
    nothing (no stray lines in logs)."""
    if disable:
        yield _Bar(None, None, 0, unit)
        return
    console = Console(file=sys.stderr)
    if not console.is_terminal:
        yield _Bar(None, None, 0, unit)
        return
    with Progress(TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(), _BytesColumn(), _RateColumn(),
                  TimeRemainingColumn(), TextColumn("{task.fields[items]}"), console=console,
                  speed_estimate_period=10.0) as p:
        t = p.add_task(label, total=total, items=f"{unit} 0/{items:,}" if items else "")
        yield _Bar(p, t, items, unit)


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


def _console():
    """inspect's console: the terminal's width, or, piped or captured, wide enough that no row is wrapped at 80
    columns (each tensor stays one line for grep and scripts)."""
    from rich.console import Console

    con = Console()
    return con if con.is_terminal else Console(width=240, soft_wrap=True)


def layout_text(lay: dict, num_layers: int | None, ep: bool = False) -> str:
    """A manifest's (or Megatron args') layout for people: tp, pp, vpp, ep and etp where they apply, and an uneven
    pipeline split as Megatron's flags with the decoder layers of each stage (issue 37: it was in --json only)."""
    from .layout import Layout

    text = f"tp={lay['tp']} pp={lay['pp']} vpp={lay.get('vpp', 1)}"
    if ep or lay.get("ep", 1) > 1:
        text += f" ep={lay.get('ep', 1)}"
    if lay.get("etp") is not None and lay.get("etp") != lay["tp"]:
        text += f" etp={lay['etp']}"
    split = lay.get("pipeline_split")
    if split:
        try:
            layout = Layout.from_dict(lay)
            text += f"  pipeline split: {' '.join(layout.split.flags())}"
            if num_layers:
                counts = layout.chunk_layers(num_layers)
                stages = [sum(counts[v * layout.pp + r] for v in range(layout.vpp)) for r in range(layout.pp)]
                text += f" (decoder layers per stage: {' | '.join(map(str, stages))})"
        except Exception as e:  # noqa: BLE001 - shown as it is stored, with why it does not resolve
            text += f"  pipeline split: {split} ({e})"
    return text


def print_description(d: dict, console=None) -> None:
    """`shardkit inspect`: header, layout, the model fields that apply, and the tensor table. Tensor names are
    never cut: the other columns wrap, and when even that cannot fit (an 80-column terminal, MTP names of 80
    characters) each tensor gets its own line with its details below it."""
    from rich.markup import escape
    from rich.table import Table

    from .config import applicable_fields

    con = console or _console()
    lay = d["layout"]
    con.print(f"[bold]{escape(str(d['path']))}[/]  {d['format']}  iteration {d['iteration']}")
    con.print(escape(f"layout: {layout_text(lay, d['model'].get('num_layers'))}   vocab: {d['vocab']['size']} "
                     f"(padded {d['vocab']['padded_size']})"))
    con.print("model: " + escape(", ".join(f"{k}={v}" for k, v in applicable_fields(d["model"]).items())))
    rows = [(r["name"], str(tuple(r["shape"])), r["dtype"], str(tuple(r["chunk"])), r["rule"], f"{r['bytes']:,}")
            for r in d["tensors"]]
    total = ("total", f"{d['total_params']:,} params", "", "", "", f"{d['total_bytes']:,}")
    widths = [max(len(r[i]) for r in rows + [total]) for i in range(6)]
    # a 6-column table has 7 rules and 2 spaces of padding per cell; the names, dtypes, rules and byte counts are
    # never broken, the shapes wrap at their commas (9 columns each at least)
    if widths[0] + widths[2] + widths[4] + widths[5] + 2 * 9 + 7 + 12 <= con.width:
        t = Table(show_lines=False)
        t.add_column("tensor", no_wrap=True, min_width=widths[0])
        for col in ("global shape", "dtype", "chunk", "rule", "bytes"):
            t.add_column(col, justify="right" if col == "bytes" else "left",
                         no_wrap=col not in ("global shape", "chunk"))
        for r in rows:
            t.add_row(*r)
        t.add_row(*(f"[bold]{c}[/]" if c else c for c in total))
        con.print(t)
    else:
        for name, shape, dtype, chunk, rule, nbytes in rows:
            con.print(name, style="bold", soft_wrap=True)
            con.print(f"    shape {shape}  {dtype}  chunk {chunk}  {rule}  {nbytes} bytes")
        con.print(f"[bold]total[/]: {total[1]}, {total[5]} bytes")
    if d["hf_files"]:
        con.print("hf files: " + escape(", ".join(d["hf_files"])))


def _files_text(files: list[str], most: int = 3) -> str:
    shown = [f.removesuffix(".distcp") for f in files[:most]]
    return ", ".join(shown) + (f" +{len(files) - most}" if len(files) > most else "")


def print_torch_dist_description(d: dict, console=None) -> None:
    """`shardkit inspect` of a torch_dist checkpoint: header, layout (from the Megatron args), the model config where
    something describes it, the tensor table of DCP's metadata (key, global shape, dtype, shards, rank files, bytes),
    the optimizer state, objects and shardkit's own files."""
    from rich.markup import escape
    from rich.table import Table

    from .config import applicable_fields

    con = console or _console()
    con.print(f"[bold]{escape(str(d['path']))}[/]  {d['format']}  iteration {d['iteration']}")
    lay = d["layout"]
    if lay:
        con.print(escape(f"layout: {layout_text(lay, (d['model'] or {}).get('num_layers'), ep=True)} "
                         f"(from {d['layout_from']})"))
    else:
        con.print("layout: unknown (common.pt holds no usable Megatron args)")
    if d["model"] is not None:
        v = d["vocab"]
        con.print(f"vocab: {v['size']} (padded {v['padded_size']})")
        con.print(escape(f"model (from {d['model_from']}): "
                         + ", ".join(f"{k}={x}" for k, x in applicable_fields(d["model"]).items())))
    else:
        con.print(escape(f"model: unknown ({d['model_unknown']})"))
    rows = [(r["name"], str(tuple(r["shape"])), r["dtype"], str(r["shards"]), _files_text(r["files"]),
             f"{r['bytes']:,}") for r in d["tensors"]]
    total = ("total", f"{d['total_params']:,} params", "", "", f"{len(d['files'])} files", f"{d['total_bytes']:,}")
    widths = [max(len(r[i]) for r in rows + [total]) for i in range(6)]
    if widths[0] + widths[2] + widths[3] + widths[5] + 2 * 9 + 12 + 7 + 12 <= con.width:
        t = Table(show_lines=False)
        t.add_column("key", no_wrap=True, min_width=widths[0])
        for col in ("global shape", "dtype", "shards", "files", "bytes"):
            t.add_column(col, justify="right" if col in ("shards", "bytes") else "left",
                         no_wrap=col not in ("global shape", "files"))
        for r in rows:
            t.add_row(*(escape(c) for c in r))
        t.add_row(*(f"[bold]{c}[/]" if c else c for c in total))
        con.print(t)
    else:
        for name, shape, dtype, shards, files, nbytes in rows:
            con.print(escape(name), style="bold", soft_wrap=True)
            con.print(escape(f"    shape {shape}  {dtype}  {shards} shards in {files}  {nbytes} bytes"))
        con.print(f"[bold]total[/]: {total[1]}, {total[5]} bytes in {total[4]}")
    o = d["optimizer"]
    if o["present"]:
        con.print(escape(f"optimizer state: {', '.join(o['states']) or 'other'} ({o['tensors']} tensors, "
                         f"{o['bytes']:,} bytes" + (f", {o['sharding_type']}" if o["sharding_type"] else "") + ")"))
    else:
        con.print("optimizer state: none (weights only)")
    con.print(f"objects: {d['objects']}")
    if d["hf_files"]:
        con.print("hf files: " + escape(", ".join(d["hf_files"])))
    for note in d["notes"]:
        con.print(escape(f"note: {note}"))
