"""A checkpoint root's iterations, as every reader sees them: the names the commit path gives them (`latest`, the
commit point; `iter_N.partial`, a write in progress), which iterations are committed (`complete_iterations`) and
which one a reader takes (`resolve_iteration`). Below checkpoint/commit.py (which writes them) and
checkpoint/storage.py (which publishes the one `latest` names): both ask here."""
from __future__ import annotations

from pathlib import Path

from .errors import FormatError
from .manifest import MANIFEST, valid_iter_dirname

LATEST = "latest"
PARTIAL_SUFFIX = ".partial"


def complete_iterations(root: Path) -> list[Path]:
    """The committed iteration directories of a root, oldest first (only `replace_dir` creates `iter_NNNNNNN`, after
    everything in it was durable; `.partial` and `.old` names never count)."""
    if not root.is_dir():
        return []
    out = [p for p in root.iterdir() if valid_iter_dirname(p.name) and (p / MANIFEST).is_file()]
    return sorted(out, key=lambda p: p.name)


def resolve_iteration(path: str | Path) -> Path:
    """An iteration directory from a checkpoint root or an iteration directory itself.

    `latest` is the commit point and wins (a user may roll it back on purpose). Where a crash left no `latest` yet
    (the first save died between its rename and `latest`), the newest complete iteration is taken; where it left
    `latest` naming an iteration that is still under its `.old` name (a crash inside `replace_dir`'s fallback), that
    one. A `latest` that names something else, or nothing, is an error: it is never guessed around."""
    from .safety import read_pointer, regular_file, safe_path

    p = Path(path)
    if not p.exists():
        raise FormatError(f"{p}: no such checkpoint")
    if regular_file(p / MANIFEST, missing_ok=True):  # a FIFO or device there: one line naming it
        return p
    latest = p / LATEST
    text = read_pointer(p, LATEST) if p.is_dir() else None  # a regular file of <= 4 KiB, or an error
    if text is not None:
        name = text.strip()
        if not valid_iter_dirname(name):
            raise FormatError(f"{latest}: names {name[:80]!r}, not an iteration directory (iter_NNNNNNN)")
        it = safe_path(p, name, str(latest))
        if not regular_file(it / MANIFEST, missing_ok=True):
            old = p / f".{name}.old"
            if (old / MANIFEST).is_file() and not old.is_symlink():
                return old
            raise FormatError(f"{latest}: points to {name}, which is missing or incomplete")
        return it
    done = complete_iterations(p)
    if done:
        return safe_path(p, done[-1].name, str(p))
    partial = sorted(x.name for x in p.glob(f"iter_*{PARTIAL_SUFFIX}")) if p.is_dir() else []
    hint = f" (only an interrupted write, {partial[-1]}: rerun the same command to resume it)" if partial else ""
    raise FormatError(f"{p}: not a shardkit checkpoint: no {LATEST} and no {MANIFEST}{hint}")
