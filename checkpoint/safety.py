"""The one check for a file name taken from an input (a manifest's tensor, `latest`, a DCP storage entry, an HF index
shard): it must stay inside the directory it is relative to.

Refused: non-strings, empty names, absolute paths, `..` or `.` components, NUL bytes, backslashes, and a symlink on
the way whose target leaves the base directory (a symlink inside it is fine). Nothing is created or opened.
"""
from __future__ import annotations

import os
from pathlib import Path, PurePosixPath

from .errors import FormatError


def safe_path(base: str | Path, rel: object, what: str) -> Path:
    """`base / rel` after checking that `rel` names something inside `base`; FormatError naming `what` otherwise."""
    base = Path(base)
    if not isinstance(rel, str) or not rel or "\x00" in rel or "\\" in rel:
        raise FormatError(f"{what}: {rel!r} is not a file name; refusing it")
    parts = PurePosixPath(rel).parts
    if PurePosixPath(rel).is_absolute() or any(p in ("..", ".") for p in parts) or rel.startswith("~"):
        raise FormatError(f"{what}: {rel!r} leaves {base} (absolute path or '..'); refusing it")
    root = os.path.realpath(base)
    cur = base
    for part in parts:
        cur = cur / part
        if cur.is_symlink():
            target = os.path.realpath(cur)
            if os.path.commonpath([root, target]) != root:
                raise FormatError(f"{what}: {cur} is a symlink to {target}, outside {base}; refusing it")
    return base / rel
