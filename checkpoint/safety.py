"""Path checks, in one place.

- `safe_path`: a file name taken from an input (a manifest's tensor, `latest`, a DCP storage entry, an HF index
  shard) must stay inside the directory it is relative to. Refused: non-strings, empty names, absolute paths, `..` or
  `.` components, NUL bytes, backslashes, and a symlink on the way whose target leaves the base directory (a symlink
  inside it is fine; in an HF hub cache snapshot, `models--org--name/snapshots/<rev>/`, "inside" is the whole
  `models--org--name` folder, whose `blobs/` the snapshot's files link to). Nothing is created or opened.
- `check_output`: an output that is, contains or lies inside one of the command's inputs is refused before anything
  is written (every writing command calls it).
- `read_pointer`: `latest` / Megatron's tracker must be a small regular file inside the root (never a FIFO, a device
  or a link out); read with a 4 KiB cap.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path, PurePosixPath
from typing import Iterable

from .errors import FormatError, ShardkitError

POINTER_MAX = 4096  # bytes: `latest` holds "iter_0000100\n", the tracker "100\n"
HUB_PREFIXES = ("models--", "datasets--", "spaces--")


def link_root(base: str | Path) -> str:
    """The directory a symlink below `base` may resolve into: `base` itself (resolved), or, when `base` is an HF hub
    cache snapshot (`.../models--org--name/snapshots/<rev>`), the `models--org--name` folder."""
    real = Path(os.path.realpath(base))
    if real.parent.name == "snapshots" and real.parent.parent.name.startswith(HUB_PREFIXES):
        return str(real.parent.parent)
    return str(real)


def _inside(path: str, root: str) -> bool:
    return os.path.commonpath([root, path]) == root


def safe_path(base: str | Path, rel: object, what: str) -> Path:
    """`base / rel` after checking that `rel` names something inside `base`; FormatError naming `what` otherwise."""
    base = Path(base)
    if not isinstance(rel, str) or not rel or "\x00" in rel or "\\" in rel:
        raise FormatError(f"{what}: {rel!r} is not a file name; refusing it")
    parts = PurePosixPath(rel).parts
    if PurePosixPath(rel).is_absolute() or any(p in ("..", ".") for p in parts) or rel.startswith("~"):
        raise FormatError(f"{what}: {rel!r} leaves {base} (absolute path or '..'); refusing it")
    root = link_root(base)
    cur = base
    for part in parts:
        cur = cur / part
        if cur.is_symlink():
            target = os.path.realpath(cur)
            if not _inside(target, root):
                raise FormatError(f"{what}: {cur} is a symlink to {target}, outside {root}; refusing it")
    return base / rel


def read_pointer(root: str | Path, name: str) -> str | None:
    """The text of the pointer file `<root>/<name>` (`latest`, `latest_checkpointed_iteration.txt`), None when there
    is none. It must be a regular file inside the root of at most POINTER_MAX bytes: a FIFO, a device, a directory, a
    link that leaves the root (to /dev/zero, say) or a huge file is a FormatError naming it. Never blocks: opened
    non-blocking and checked with fstat before one bounded read."""
    path = Path(root) / name
    if not os.path.lexists(path):
        return None
    if path.is_symlink() and not _inside(os.path.realpath(path), os.path.realpath(root)):
        raise FormatError(f"{path}: is a symlink to {os.path.realpath(path)}, outside {root}; it must be a small "
                          "regular file naming an iteration")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    except OSError as e:
        raise FormatError(f"{path}: unreadable ({e.strerror or e}); it should name an iteration") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FormatError(f"{path}: is not a regular file (a FIFO, device or directory); it must be a small "
                              "file naming an iteration")
        if st.st_size > POINTER_MAX:
            raise FormatError(f"{path}: holds {st.st_size:,} bytes, more than a pointer file's {POINTER_MAX}; it "
                              "must only name an iteration")
        data = os.read(fd, POINTER_MAX + 1)
    except OSError as e:
        raise FormatError(f"{path}: unreadable ({e.strerror or e}); it should name an iteration") from None
    finally:
        os.close(fd)
    if len(data) > POINTER_MAX:  # grew since fstat
        raise FormatError(f"{path}: more than {POINTER_MAX} bytes; it must only name an iteration")
    try:
        return data.decode()
    except UnicodeDecodeError:
        raise FormatError(f"{path}: not text; it should name an iteration") from None


def _identities(path: str) -> list[tuple[int, int] | None]:
    """(st_dev, st_ino) of `path`, then of each of its ancestors, nearest first; None for one that does not exist."""
    out, cur = [], path
    while True:
        try:
            st = os.stat(cur)
            out.append((st.st_dev, st.st_ino))
        except OSError:
            out.append(None)
        parent = os.path.dirname(cur)
        if parent == cur:
            return out
        cur = parent


def check_output(out: str | Path, inputs: Iterable[tuple[str, str | Path | None]], flag: str = "output",
                 same_ok: Iterable[str | Path] = ()) -> None:
    """Refuse, before anything is written, an output that is, contains or lies inside an input (paths resolved,
    symlinks followed; an output that does not exist yet is resolved through its nearest existing parent).

    `inputs`: (what, path) pairs, e.g. ("HF_DIR", "/models/llama"); None paths are skipped. Name a data file itself,
    not its directory, where only the file is read: an output beside it is then fine. `same_ok`: inputs the output
    may equal, or be an entry of (continue-pretrain resuming into its --load root, or --load ROOT/iter_N --save ROOT:
    the save writes new iteration directories beside the loaded one)."""
    o = os.path.realpath(out)
    same = {os.path.realpath(p) for p in same_ok}
    o_chain = _identities(o)
    for what, p in inputs:
        if p is None or str(p) == "":
            continue
        i = os.path.realpath(p)
        i_chain = _identities(i)
        # by path, and by (device, inode) for what exists: the same directory reached through a bind mount or a
        # hard link is the same directory
        oid, iid = o_chain[0], i_chain[0]
        if o == i or (oid is not None and oid == iid):
            if i in same:
                continue
            rel = "is"
        elif _inside(o, i) or (iid is not None and iid in o_chain[1:]):
            rel = "lies inside"
        elif _inside(i, o) or (oid is not None and oid in i_chain[1:]):
            if i in same and os.path.dirname(i) == o:  # --load ROOT/iter_N --save ROOT: resuming into the root
                continue
            rel = "contains"
        else:
            continue
        raise ShardkitError(f"{flag} {out}: {rel} the input {what} {p}; writing there could destroy it: choose an "
                            "output outside every input")
