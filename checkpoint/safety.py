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
- `regular_file` / `read_input`: every input file a reader opens (a JSON file, `.metadata`, `zarr.json`, a chunk, a
  safetensors file) is checked, links resolved, to be a regular file first: a FIFO, device, socket or directory is
  one FormatError naming it, never a read that blocks forever. `read_input` reads it non-blocking, bounded.
- `check_target`: every name a writer is about to create or replace in a directory the user owns (`launch --out`'s
  scripts, an iteration directory, a pointer): a symlink or a non-regular file there is refused (never followed),
  and a regular file the writer did not write is refused without `--overwrite`.
- `refuse_url`: a path argument that is a URL (`s3://...`) and not a checkpoint location (checkpoint/storage.py) is
  refused, never taken as a relative directory named `s3:`. (Paths reach tensorstore resolved: checkpoint.store.array_spec.)
- `side_files` / `copy_side_files`: the tokenizer and generation files carried beside the weights (a checkpoint's
  `hf/`): untrusted input, only known names that are regular files, never over the writer's own files.
- `inside_iteration`: no write goes into a committed checkpoint iteration.
"""
from __future__ import annotations

import os
import re
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


def _is_iteration(path: str) -> bool:
    """A checkpoint iteration directory (native or torch_dist), not a root: what a write must never go into."""
    p = Path(path)
    return p.is_dir() and (re.fullmatch(r"iter_\d+|release", p.name) is not None or any(
        os.path.lexists(p / n) for n in ("manifest.json", ".metadata", "metadata.json")))


def inside_iteration(path: str | Path) -> str | None:
    """The checkpoint iteration directory (native or torch_dist) that `path` is or lies inside, resolved; None."""
    cur = os.path.realpath(path)
    while True:
        has = lambda n: os.path.lexists(os.path.join(cur, n))  # noqa: E731
        # a native iteration (its manifest and arrays, or its iter_N name) or a torch_dist one (DCP's two files); a
        # user's own manifest.json in a project directory does not make it one
        if os.path.isdir(cur) and ((has("manifest.json") and (has("model") or re.fullmatch(
                r"iter_\d+|release", os.path.basename(cur)))) or (has(".metadata") and has("metadata.json"))):
            return cur
        parent = os.path.dirname(cur)
        if parent == cur:
            return None
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
            if i in same and not _is_iteration(i):  # resuming into a root; never writing into a loaded iteration
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


# -- every input file: regular, never blocking ---------------------------------------------------------------------

JSON_MAX = 256 << 20  # bytes: the largest JSON input read whole (an index of a 10k-shard model is a few MB)
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def _kind(mode: int) -> str:
    return ("a FIFO" if stat.S_ISFIFO(mode) else "a directory" if stat.S_ISDIR(mode) else "a socket"
            if stat.S_ISSOCK(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a file")


def regular_file(path: str | Path, what: str | None = None, missing_ok: bool = False) -> bool:
    """Is `path` (links resolved) a regular file? False where nothing is there (a dangling link counts as nothing)
    and `missing_ok`; otherwise a FormatError naming it: missing, or a FIFO, device, socket or directory, which a
    reader must never open (a FIFO would block it forever)."""
    label = f"{what}: " if what and what != str(path) else ""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        if missing_ok:
            return False
        raise FormatError(f"{label}{path}: missing") from None
    except OSError as e:
        raise FormatError(f"{label}{path}: unreadable ({e.strerror or e})") from None
    if not stat.S_ISREG(st.st_mode):
        raise FormatError(f"{label}{path}: is {_kind(st.st_mode)}, not a regular file; refusing to read it")
    return True


def open_input(path: str | Path, what: str | None = None) -> int:
    """A read-only descriptor of the regular file `path`, opened non-blocking (a FIFO put there after a check can
    never block the open) and checked with fstat; the caller closes it."""
    label = f"{what}: " if what and what != str(path) else ""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    except FileNotFoundError:
        raise FormatError(f"{label}{path}: missing") from None
    except OSError as e:
        raise FormatError(f"{label}{path}: unreadable ({e.strerror or e})") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise FormatError(f"{label}{path}: is {_kind(st.st_mode)}, not a regular file; refusing to read it")
    os.set_blocking(fd, True)
    return fd


def sha256_file(path: str | Path, what: str | None = None) -> str:
    """The SHA-256 (hex) of the regular file `path`, read 1 MiB at a time (a FIFO or device: one FormatError naming
    it): integrity.json's digests and shardkit.json's record of common.pt."""
    import hashlib

    label = f"{what}: " if what and what != str(path) else ""
    fd = open_input(path, what)
    h = hashlib.sha256()
    try:
        with os.fdopen(os.dup(fd), "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    except OSError as e:
        raise FormatError(f"{label}{path}: unreadable ({e.strerror or e})") from None
    finally:
        os.close(fd)
    return h.hexdigest()


def read_input(path: str | Path, what: str | None = None, limit: int = JSON_MAX, text: bool = True) -> str | bytes:
    """The bytes (or UTF-8 text) of the regular input file `path`, at most `limit` bytes: a FIFO, device or
    directory, or a larger file, is one FormatError naming it."""
    label = f"{what}: " if what and what != str(path) else ""
    fd = open_input(path, what)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise FormatError(f"{label}{path}: {size:,} bytes, more than the {limit:,} such a file may hold; "
                              "refusing to read it")
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(limit + 1)
    except OSError as e:
        raise FormatError(f"{label}{path}: unreadable ({e.strerror or e})") from None
    finally:
        os.close(fd)
    if len(data) > limit:
        raise FormatError(f"{label}{path}: more than the {limit:,} bytes such a file may hold; refusing to read it")
    if not text:
        return data
    try:
        return data.decode()
    except UnicodeDecodeError as e:
        raise FormatError(f"{label}{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


# -- every output name: never through a link, never over what shardkit did not write -------------------------------

def check_target(path: str | Path, what: str, ours: bool = False, overwrite: bool = False,
                 kind: str = "file") -> bool:
    """Check the name `path` a writer is about to create or replace: True when something is there (to be replaced).
    Refused with one line: a symlink (never followed: a link at a script's name to a file elsewhere would have that
    file overwritten), or something not of `kind` ("file": a regular file; "dir": a directory), or -- without
    `overwrite` -- a file that is there and that the writer did not write (`ours`)."""
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):  # nothing there (the writer's own mkdir names a path below a file)
        return False
    except OSError as e:
        raise ShardkitError(f"{what} {path}: cannot be checked ({e.strerror or e})") from None
    if stat.S_ISLNK(st.st_mode):
        raise ShardkitError(f"{what} {path}: is a symlink (to {os.readlink(path)}); shardkit never writes through a "
                            "link: remove it or choose another output")
    want = stat.S_ISDIR if kind == "dir" else stat.S_ISREG
    if not want(st.st_mode):
        raise ShardkitError(f"{what} {path}: is {_kind(st.st_mode) if not stat.S_ISREG(st.st_mode) else 'a file'}, "
                            f"not a {'directory' if kind == 'dir' else 'regular file'} shardkit wrote; move it away "
                            "or choose another output")
    if not ours and not overwrite:
        raise ShardkitError(f"{what} {path}: exists and shardkit did not write it (or it was edited since); pass "
                            "--overwrite to replace it, or choose another output")
    return True


# -- path arguments ------------------------------------------------------------------------------------------------

def is_url(value: object) -> bool:
    return isinstance(value, str) and bool(_URL.match(value))


def refuse_url(value: object, flag: str) -> None:
    if is_url(value):
        scheme = str(value).split("://", 1)[0]
        raise ShardkitError(f"{flag + ' ' if flag else ''}{value}: a URL ({scheme}://) is not supported here; only "
                            "checkpoint locations take s3:// or gs:// (convert OUT / CKPT, reshard SRC / DST, inspect, "
                            "verify, continue-pretrain --load / --save); give a local path (a mounted filesystem works)")



# -- side files: tokenizer and generation files carried beside the weights --------------------------------------------

# The only files carried from an HF directory into a checkpoint's `hf/` and from there into an export: known tokenizer
# and generation file names. Side files are untrusted input: config.json, weights, indexes and anything else (a
# `train.sh`, a `model.safetensors`) are never carried, whatever the directory holds.
SIDE_FILE_PATTERNS = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "tokenizer.model.v[0-9]*",
                      "special_tokens_map.json", "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt",
                      "spiece.model", "sentencepiece.bpe.model", "generation_config.json", "chat_template.json",
                      "chat_template.jinja", "*.tiktoken", "preprocessor_config.json")


def is_side_file_name(name: str) -> bool:
    import fnmatch

    return "/" not in name and not name.startswith(".") and any(fnmatch.fnmatchcase(name, p)
                                                               for p in SIDE_FILE_PATTERNS)


def side_files(directory: str | Path | None, exclude: Iterable[str] = ()) -> list[Path]:
    """The side files of `directory` (none when it is absent): allowlisted names (SIDE_FILE_PATTERNS) that are
    regular files, or links to regular files that stay inside it (in an HF hub cache snapshot: inside its
    `models--org--name` folder). Anything else there -- other names, links out, FIFOs, devices, directories -- is
    left where it is, never read."""
    if directory is None or not os.path.isdir(directory):
        return []
    root, skip, out = link_root(directory), set(exclude), []
    for name in sorted(os.listdir(directory)):
        if name in skip or not is_side_file_name(name):
            continue
        p = Path(directory) / name
        try:
            st = os.stat(p)
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode) or (p.is_symlink() and not _inside(os.path.realpath(p), root)):
            continue
        out.append(p)
    return out


def copy_side_files(src: str | Path | None, dest: str | Path, exclude: Iterable[str] = ()) -> list[str]:
    """Copy the side files of `src` into the writer's own work directory `dest` (created); names in `exclude` (the
    writer's own files) are never copied, and nothing is written through a link. The names copied."""
    import shutil

    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    done = []
    for p in side_files(src, exclude):
        check_target(dest / p.name, "side file", ours=True)  # a link there is refused, never written through
        fd = open_input(p)  # regular, non-blocking open (checked again: it may have changed since the listing)
        with os.fdopen(fd, "rb") as fin, open(dest / p.name, "wb") as fout:
            shutil.copyfileobj(fin, fout, 1 << 20)
        done.append(p.name)
    return done
