"""Atomic, resumable writing of one checkpoint iteration.

    <root>/iter_0000000.partial/   work in progress: job.json (what is being written), done.log (finished tasks;
                                   rank N > 0 of a multi-rank conversion: done.rank<N>.log, see RankWriter)
    <root>/iter_0000000/           appears only by rename, after every array and the manifest are durable
    <root>/latest                  replaced last (tmp + fsync + rename)

A crash at any moment leaves the previous `latest` loadable and never a directory that looks complete; rerunning the
same job resumes from done.log, a different job discards the stale partial directory. Every writer of an output
root (native, torch_dist, HF export, training saves sync or async) goes through the same three pieces here:
`output_lock` (one writer per root), `replace_dir` (a durable directory put in place atomically, replacing an old
one) and `write_file_atomic` (small files, `latest` last). Which iteration a reader takes is checkpoint/iterations.py
(`resolve_iteration`).
"""
from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import os
import re
import shutil
from pathlib import Path
from typing import Iterator

from .chunkio import fsync_path, record_chunk_crcs
from .errors import ShardkitError, WriteError
from .faults import fault_point
from .iterations import LATEST, PARTIAL_SUFFIX
from .manifest import MANIFEST, Manifest, iter_dirname, valid_iter_dirname

LOCK = ".shardkit.lock"
_TRACKER = "latest_checkpointed_iteration.txt"  # Megatron's pointer (checkpoint.megatron.TRACKER)
DONE_LOG = "done.log"  # finished tasks of a partial iteration (one process, or rank 0); others: RANK_LOG
RANK_LOG = "done.rank{}.log"


def write_file_atomic(path: Path, data: str | bytes) -> None:
    """tmp + fsync + rename + fsync(dir): readers see the old or the new file, never a torn one."""
    tmp = path.with_name(f".{path.name}.tmp")
    if os.path.islink(tmp):  # our temporary name: a link planted there is removed, never written through
        os.unlink(tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o666)
    with os.fdopen(fd, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
        f.flush()
        os.fsync(f.fileno())
    fault_point("atomic.tmp")
    os.replace(tmp, path)
    fsync_path(path.parent)


def fsync_tree(path: Path, threads: int = 16) -> None:
    """fsync every file and directory below `path` (tensorstore syncs its files; directories need it too).

    The fsyncs run concurrently: one after another, each waits for its own journal commit (~2-5 ms here, 17 s for
    the 3,400 files and directories of a 64-expert MoE checkpoint); in flight together, the filesystem commits them
    in groups (0.2-2.7 s). Every fsync still completes before this returns."""
    from concurrent.futures import ThreadPoolExecutor

    paths: list[Path] = []
    for dirpath, _dirnames, filenames in os.walk(path):
        paths += [Path(dirpath) / fn for fn in filenames]
        paths.append(Path(dirpath))
    with ThreadPoolExecutor(max(1, min(threads, len(paths)))) as pool:
        for _ in pool.map(fsync_path, paths):  # re-raises the first error
            pass


def _exchange(a: Path, b: Path) -> bool:
    """Swap two directory entries atomically (Linux renameat2 RENAME_EXCHANGE); False where the kernel, the C
    library or the filesystem cannot."""
    fn = getattr(_LIBC, "renameat2", None) if _LIBC is not None else None
    if fn is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (22, 38, 95):  # EINVAL, ENOSYS, EOPNOTSUPP: not supported here; fall back
        return False
    raise OSError(err, os.strerror(err), str(b))


try:
    _LIBC = ctypes.CDLL(None, use_errno=True)
except OSError:  # no C library to ask: the two-step fallback
    _LIBC = None


def replace_dir(tmp: Path, final: Path) -> None:
    """Put the directory `tmp` at `final` once every byte below it is durable, replacing an older `final`.

    A crash at any point leaves `final` whole: the old one or the new one. Where the kernel swaps directories
    atomically, the old one ends up under `tmp`'s name (a leftover every writer discards); elsewhere it is first
    renamed to `.<final>.old`, which `recover_root` (or a reader, see `resolve_iteration`) puts back after a crash
    in between."""
    fsync_tree(tmp)
    fault_point("commit.rename")
    if final.exists() and _exchange(tmp, final):
        fsync_path(final.parent)
        fault_point("commit.swapped")
        shutil.rmtree(tmp, ignore_errors=True)
        return
    old = final.parent / f".{final.name}.old"
    if final.exists():
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
        fault_point("commit.swapped")
    os.replace(tmp, final)
    fsync_path(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def recover_root(root: Path) -> None:
    """Undo what a crash inside `replace_dir`'s fallback or `write_file_atomic` left in an output root (called by
    writers, under the lock): an `.<name>.old` whose replacement never arrived goes back, any other is removed, and
    stale temporary pointer files go. Only names shardkit writes are touched (`.iter_NNNNNNN.old`, the
    temporary `latest` / Megatron tracker)."""
    if not root.is_dir():
        return
    for p in root.iterdir():
        name = p.name
        if name.startswith(".") and name.endswith(".old") and valid_iter_dirname(name[1:-4]) and p.is_dir() \
                and not p.is_symlink():
            final = root / name[1:-4]
            if final.exists():
                shutil.rmtree(p, ignore_errors=True)
            else:
                os.replace(p, final)
        elif name in (f".{LATEST}.tmp", ".latest_checkpointed_iteration.txt.tmp") and p.is_file():
            p.unlink(missing_ok=True)


@contextlib.contextmanager
def output_lock(root: Path, name: str = LOCK) -> Iterator[None]:
    """Hold an exclusive lock on `<root>/<name>` (flock: released by the kernel when the process dies, so a crash
    never leaves a stale lock); a second writer of the same root gets a one-line error instead of mixing files. The
    file is removed on release, while still locked; a writer that opened it just before checks it locked the file
    that is still there."""
    from .safety import check_target

    path = root / name
    check_target(path, "output lock", ours=True)  # a link there would have the lock file created elsewhere
    for _ in range(3):
        try:
            fd = os.open(path, os.O_CREAT | os.O_RDWR | getattr(os, "O_NOFOLLOW", 0), 0o644)
        except OSError as e:  # e.g. a read-only output directory
            raise WriteError(f"{root}: cannot write in the output directory ({e.strerror or e})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ShardkitError(f"{root}: another shardkit process is writing here (lock {name}); wait for it or "
                                "choose another output") from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # locked a file its previous holder had just removed: take the current one
    else:
        raise ShardkitError(f"{root}: the lock {name} keeps changing; another shardkit process is writing here")
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            path.unlink()
        os.close(fd)  # closing releases the lock


_SPACE_WORDS = ("no space", "space left", "file too large", "quota", "resource_exhausted", "enospc", "edquot", "efbig")


def space_related(exc: BaseException | None) -> bool:
    """Could this failure be about space (a full disk, a quota, a file size limit)? Only then does a write error
    carry the free-space note: an error with another cause (a path tensorstore refuses, a permission) is not blamed on
    space (issue 34)."""
    import errno

    if exc is None:
        return False
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return True
    return any(w in str(exc).lower() for w in _SPACE_WORDS)


def space_note(path: Path, needed: int | None) -> str:
    """`needed` bytes and what the filesystem of `path` has free, for a write error's message."""
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        return ""
    if needed and free >= needed:  # then "needs 9.99 MB, 10.37 MB free" would blame space wrongly
        return (f"; {free:,} bytes free on that filesystem, more than the {needed:,} it needs (a file size limit or "
                "quota, not a full disk?)")
    need = f"it needs {needed:,} bytes, " if needed else ""
    return f"; {need}{free:,} bytes free on that filesystem"


def check_output_root(root: Path, overwrite: bool, ignore: tuple[str, ...] | set[str] = ()) -> None:
    """Refuse an output root that is a file, or a non-empty directory (names in `ignore` aside) without
    `overwrite`."""
    root = Path(root)
    if root.exists() and not root.is_dir():
        raise ShardkitError(f"{root}: output path exists and is not a directory")
    if root.exists() and not overwrite:
        others = sorted(p.name for p in root.iterdir() if p.name not in ignore)
        if others:
            raise ShardkitError(f"{root}: output directory is not empty ({', '.join(others[:3])}"
                                f"{', ...' if len(others) > 3 else ''}); pass --overwrite to replace it")


# -- what shardkit wrote: the only things a write (with or without --overwrite) may replace ---------------------------

# an iteration directory's entries, native (checkpoint.manifest) and torch_dist (checkpoint.torch_dist); a partial one
# also holds its resume record
_NATIVE_NAMES = {MANIFEST, "model", "optim", "hf", "train_state.json"}
_TORCH_DIST_NAMES = {".metadata", "metadata.json", "common.pt", "shardkit.json", "run_config.yaml", "integrity.json",
                     "hf"}
_PARTIAL_NAMES = {"job.json", DONE_LOG}
_OURS_RE = re.compile(r"^(__\d+_\d+\.distcp|done\.rank\d+\.log)$")
# what a write killed half-way leaves in its partial directory: write_file_atomic's temporary names, a spooled item
_LEFTOVER_RE = re.compile(r"^(\..+\.tmp|\.shardkit-item-.*\.pt)$")
_POINTER_RE = {LATEST: re.compile(r"^\s*(iter_\d{7,}|release)\s*$"), _TRACKER: re.compile(r"^\s*(\d+|release)\s*$")}


def _foreign_below(d: Path, names: set[str], partial: bool = False) -> Path | None:
    """The first entry of the iteration directory `d` that no shardkit writer puts there; None when there is none.
    Below it: `model/` and `optim/` hold one array per tensor (`zarr.json`, chunks under `c/` named by their
    indices), `hf/` the carried config and tokenizer / generation files. Of a `partial` one (the write's own work
    directory, perhaps killed mid-write) only the names directly in it are checked."""
    from .safety import is_side_file_name

    for p in sorted(d.iterdir()):
        if p.is_symlink() or (p.name not in names and not _OURS_RE.match(p.name)
                              and not (partial and _LEFTOVER_RE.match(p.name))):
            return p
        if partial:
            continue
        if p.name in ("model", "optim") and p.is_dir():
            for arr in sorted(p.iterdir()):
                if arr.is_symlink() or not arr.is_dir():
                    return arr
                for top, dirs, files in os.walk(arr):
                    rel = Path(top).relative_to(arr).parts
                    for n in sorted(dirs + files):
                        ok = (n in ("zarr.json", "c") if not rel else n.isdigit()) and not (Path(top) / n).is_symlink()
                        if not ok or (not rel and (n == "c") != (Path(top) / n).is_dir()):
                            return Path(top) / n
        elif p.name == "hf" and p.is_dir():
            for f in sorted(p.iterdir()):
                if f.is_symlink() or not f.is_file() or not (is_side_file_name(f.name) or f.name == "config.json"):
                    return f
    return None


def _is_checkpoint_dir(d: Path) -> bool:
    """An iteration directory a pointer may name: a native one (its manifest) or a torch_dist one (DCP's files)."""
    return d.is_dir() and not d.is_symlink() and ((d / MANIFEST).is_file() or (
        (d / ".metadata").is_file() and (d / "metadata.json").is_file()))


def foreign_entry(path: Path, partial: bool = False) -> Path | None:
    """What, at or below the iteration directory `path` that a write is about to replace, shardkit did not write
    (None: nothing is there, or all of it is shardkit's). A committed iteration is ours by its own marker -- a native
    one's manifest.json, a torch_dist export's shardkit.json -- and holds only the names its writers put there; a
    `partial` one (an interrupted write: job.json, resume logs, arrays or rank files, perhaps no marker yet) only
    those names."""
    if not os.path.lexists(path):
        return None
    if path.is_symlink() or not path.is_dir():
        return path
    if partial:
        return _foreign_below(path, _NATIVE_NAMES | _TORCH_DIST_NAMES | _PARTIAL_NAMES, partial=True)
    if (path / MANIFEST).is_file() and not (path / MANIFEST).is_symlink():
        return _foreign_below(path, _NATIVE_NAMES)
    if (path / "shardkit.json").is_file() and not (path / "shardkit.json").is_symlink():
        return _foreign_below(path, _TORCH_DIST_NAMES)
    return path  # no marker of ours: another tool's iteration, or the user's directory


def pointer_is_ours(root: Path, name: str, writing: str | None = None) -> bool:
    """Is the pointer `<root>/<name>` (`latest`, Megatron's tracker) one a write may replace: absent, or a small
    regular file naming, in the pointer's own form, a checkpoint iteration in `root` (or `writing`, the iteration
    being written)? A file of the user's there (notes, another tool's `latest`) is not."""
    from .errors import FormatError
    from .megatron import RELEASE
    from .safety import read_pointer

    try:
        text = read_pointer(root, name)
    except FormatError:
        return False
    if text is None:
        return True
    m = _POINTER_RE[name].match(text) if name in _POINTER_RE else None
    if m is None:
        return False
    target = m.group(1) if m.group(1) == RELEASE or name == LATEST else iter_dirname(int(m.group(1)))
    return target == writing or _is_checkpoint_dir(root / target)


def refuse_foreign(root: Path, pointer: str, dirs: tuple[tuple[Path, bool], ...] = (), writing: str | None = None
                   ) -> None:
    """One line naming the first thing in the way of a write to `root` that shardkit did not write -- the pointer
    it replaces last, each iteration directory (`dirs`: (path, partial)) it replaces or removes -- before anything is
    touched, with or without --overwrite (which allows a non-empty root and replaces what shardkit wrote, never
    anything else)."""
    if not pointer_is_ours(root, pointer, writing):
        raise ShardkitError(f"{root / pointer}: exists and shardkit did not write it (it names no checkpoint "
                            "iteration here); not replacing it, even with --overwrite: move it away or choose "
                            "another output")
    for d, partial in dirs:
        bad = foreign_entry(d, partial)
        if bad is not None:
            what = "is not a checkpoint iteration shardkit wrote" if bad == d else \
                f"is in the iteration {d.name} and shardkit did not write it"
            raise ShardkitError(f"{bad}: {what}; not replacing it, even with --overwrite: move it away or choose "
                                "another output")


class IterationWriter:
    """Owns `<root>/<iter>.partial` for one job. Use as a context manager; call `commit(manifest)` at the end.

    `pointer` (file name, text) is what the commit writes last: `latest` naming the iteration by default; a
    torch_dist export's is Megatron's tracker file."""

    def __init__(self, root: str | Path, iteration: int, job: dict, overwrite: bool = False,
                 pointer: tuple[str, str] | None = None):
        self.root = Path(root)
        self.iteration = iteration
        self.name = iter_dirname(iteration)
        self.pointer = pointer or (LATEST, self.name + "\n")
        self.final = self.root / self.name
        self.partial = self.root / (self.name + PARTIAL_SUFFIX)
        self.job = job
        self.overwrite = overwrite
        self.needed: int | None = None  # bytes this write still needs (see reserve), for error messages
        self.done: set[str] = set()
        self.written: list[str] = []  # tasks this process recorded (a rank's report to rank 0, convert.distributed)
        self._stack = contextlib.ExitStack()
        self._log = None

    # -- set-up -------------------------------------------------------------------------------------------------
    def __enter__(self) -> "IterationWriter":
        self._check_root()
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # e.g. a path below a regular file, or no permission
            raise WriteError(f"{self.root}: cannot create the output directory ({e.strerror or e})") from None
        self._stack.enter_context(output_lock(self.root))
        created = False
        try:
            recover_root(self.root)
            job_file = self.partial / "job.json"
            if self.partial.exists():
                try:
                    same = json.loads(job_file.read_text()) == self.job
                except (OSError, ValueError, RecursionError):
                    same = False
                if same:
                    self.done = read_done(self.partial)
                else:
                    shutil.rmtree(self.partial)
            if not self.partial.exists():
                self.partial.mkdir()
                created = True
                write_file_atomic(job_file, json.dumps(self.job, sort_keys=True))
            self._log = open(self.partial / DONE_LOG, "a")
        except OSError as e:
            note = space_note(self.root, None)
            if created:  # nothing of it is worth resuming: no empty iter_*.partial is left behind (e.g. ENOSPC)
                shutil.rmtree(self.partial, ignore_errors=True)
            self._stack.close()
            raise WriteError(f"{self.partial}: cannot start writing ({e.strerror or e}){note}") from None
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._log:
            log, self._log = self._log, None
            try:
                log.close()  # flushes the resume log: fails too when the disk is full
            except OSError as e:
                exc = exc if exc is not None else e
        try:
            # On failure keep .partial (it is never mistaken for a checkpoint, and a rerun resumes from it) unless the
            # failure says the bytes themselves could not be written, or nobody will resume (no progress recorded: a
            # training save records none), then free the space.
            write_failed = isinstance(exc, (OSError, WriteError))
            # the free space as the write found it, before the partial output's space is given back (measured after,
            # a failed save read "needs 9.99 MB, 10.37 MB free"); reserve's refusal already says it, once
            noted = getattr(exc, "space_noted", False) or "bytes free" in str(exc)
            note = space_note(self.root, self.needed) if write_failed and not noted and space_related(exc) else ""
            if exc is not None and (write_failed or not self.done) and self.partial.exists():
                shutil.rmtree(self.partial, ignore_errors=True)
            if isinstance(exc, OSError):
                raise WriteError(f"{getattr(exc, 'filename', None) or self.partial}: writing the checkpoint failed "
                                 f"({exc.strerror or exc}){note}; the previous checkpoint is untouched and the "
                                 "partial output was removed") from None
            if isinstance(exc, WriteError) and not noted:
                raise WriteError(f"{exc}{note}; the previous checkpoint is untouched and the partial output was "
                                 "removed") from None
        finally:
            self._stack.close()

    def reserve(self, total: int, left: int | None = None) -> None:
        """Refuse up front a write the filesystem cannot hold: `left` (default `total`) more bytes are needed."""
        left = total if left is None else left
        self.needed = left
        try:
            free = shutil.disk_usage(self.root).free
        except OSError:
            return
        if left > free:
            err = WriteError(f"{self.root}: not enough space: writing this checkpoint needs {left:,} more bytes, "
                             f"{free:,} bytes free; free space or choose another output")
            err.space_noted = True  # __exit__ adds no second (re-measured) free-space figure
            raise err

    def _check_root(self) -> None:
        from .safety import check_target

        pointer = self.pointer[0]
        ours = {pointer, LOCK, self.partial.name, f".{pointer}.tmp", f".{self.name}.old"}
        if not (self.root / pointer).exists():  # our iteration, renamed into place by a run killed before `latest`
            ours.add(self.name)
        check_output_root(self.root, self.overwrite, ours)
        # the names this write replaces are never followed: an iteration directory (or its .partial) that is a
        # link elsewhere -- say into the source -- would have the commit write into, or remove, what it points to
        for p, kind in ((self.final, "dir"), (self.partial, "dir"), (self.root / pointer, "file")):
            check_target(p, "output", ours=True, kind=kind)
        from .safety import inside_iteration

        it = inside_iteration(self.root)
        if it is not None:  # writing iterations into a committed iteration would look like a checkpoint inside it
            raise ShardkitError(f"{self.root}: {'is' if it == os.path.realpath(self.root) else 'lies inside'} the "
                                f"checkpoint iteration {it}; an output is a checkpoint root: choose another directory")
        if pointer == LATEST and os.path.lexists(self.root / _TRACKER):
            raise ShardkitError(f"{self.root}: holds a Megatron torch_dist checkpoint ({_TRACKER}), which every "
                                "reader would still load instead of the native checkpoint written here; choose "
                                "another output directory (--overwrite replaces a checkpoint of the same format)")
        # --overwrite replaces what shardkit wrote, never a file of the user's in the way (issue 14)
        refuse_foreign(self.root, pointer, ((self.final, False), (self.partial, True),
                                            (self.root / f".{self.name}.old", False)), writing=self.name)

    # -- progress -----------------------------------------------------------------------------------------------
    def path(self, rel: str) -> Path:
        return self.partial / rel

    def is_done(self, task: str) -> bool:
        return task in self.done

    def mark_done(self, task: str) -> None:
        """Record a task whose data is already durable (tensorstore fsyncs its chunk files)."""
        self.mark_done_many([task])

    def mark_done_many(self, tasks: list[str]) -> None:
        """Record several durable tasks with one fsync of the log (thousands of small chunks: one fsync each cost
        seconds)."""
        if not tasks:
            return
        self._log.write("".join(t + "\n" for t in tasks))
        self._log.flush()
        os.fsync(self._log.fileno())
        self.done.update(tasks)
        self.written += tasks

    # -- commit -------------------------------------------------------------------------------------------------
    def commit(self, manifest: Manifest | None) -> Path:
        """Write the manifest (None: a torch_dist export, whose metadata is among its files), make everything
        durable, put the iteration in place, then write the pointer (`latest`) naming it."""
        self._log.close()
        self._log = None
        for f in ("job.json", *(p.name for p in done_logs(self.partial))):
            (self.partial / f).unlink(missing_ok=True)
        fault_point("commit.begin")
        if manifest is not None:

            record_chunk_crcs(manifest, self.partial)  # every chunk's crc32c, so a chunk in the wrong place is found
            write_file_atomic(self.partial / MANIFEST, manifest.to_json())
        replace_dir(self.partial, self.final)
        fault_point("commit.latest")
        write_file_atomic(self.root / self.pointer[0], self.pointer[1])
        # interrupted writes of other iterations (a killed training save) are never resumed once a newer write
        # committed here: free their space
        for p in self.root.glob(f"iter_*{PARTIAL_SUFFIX}"):
            if valid_iter_dirname(p.name[:-len(PARTIAL_SUFFIX)]) and foreign_entry(p, partial=True) is None:
                shutil.rmtree(p, ignore_errors=True)  # (a directory of the user's of such a name stays)
        from .storage import committed

        committed(self.root)  # a root staged for object storage (a training --save s3://...) publishes it
        return self.final


def done_logs(partial: Path) -> list[Path]:
    """The resume logs of a partial iteration: `done.log` (a single process, or rank 0 of several) and
    `done.rank<N>.log` (rank N > 0 of a multi-rank conversion, convert.distributed)."""
    return [p for p in (partial / DONE_LOG, *sorted(partial.glob(RANK_LOG.format("*")))) if p.is_file()]


def read_done(partial: Path) -> set[str]:
    """Every task any process (any number of ranks, any earlier run of the same job) recorded as durable. A line
    torn by a crash names no task (task ids are whole boxes), so it only makes that task run again."""
    done: set[str] = set()
    for log in done_logs(partial):
        done.update(ln for ln in log.read_text().splitlines() if ln)
    return done


class RankWriter:
    """Rank N > 0 of a multi-rank write: the partial iteration that rank 0's IterationWriter owns (rank 0 holds the
    lock, creates or discards `.partial`, writes job.json, creates the arrays and commits), seen from this rank. It
    records the chunks it makes durable in its own log, `done.rank<N>.log`, and never removes anything: a failure
    leaves what it finished for the rerun. `attach()` once rank 0 says the partial directory is ready."""

    def __init__(self, root: str | Path, iteration: int, job: dict, rank: int):
        self.root, self.iteration, self.job, self.rank = Path(root), iteration, job, rank
        self.name = iter_dirname(iteration)
        self.final = self.root / self.name
        self.partial = self.root / (self.name + PARTIAL_SUFFIX)
        self.done: set[str] = set()
        self.written: list[str] = []
        self.needed: int | None = None
        self._log = None

    def __enter__(self) -> "RankWriter":
        return self

    def attach(self) -> None:
        """Check that the partial directory rank 0 prepared is visible here (a directory that is not shared between
        the nodes is not) and is this job's, read what every rank recorded, and open this rank's log."""
        job_file = self.partial / "job.json"
        try:
            same = json.loads(job_file.read_text()) == self.job
        except FileNotFoundError:
            raise WriteError(f"{self.partial}: rank 0 prepared it, but rank {self.rank} does not see it (no "
                             f"{job_file.name}): the output directory must be on a filesystem every node shares") \
                from None
        except (OSError, ValueError, RecursionError) as e:
            raise WriteError(f"{job_file}: rank {self.rank} cannot read it ({getattr(e, 'strerror', None) or e})") \
                from None
        if not same:
            raise WriteError(f"{job_file}: rank {self.rank} sees another job's partial output than rank 0 prepared: "
                             "the output directory must be one directory every node shares")
        self.done = read_done(self.partial)
        try:
            self._log = open(self.partial / RANK_LOG.format(self.rank), "a")
        except OSError as e:
            raise WriteError(f"{self.partial}: rank {self.rank} cannot write there ({e.strerror or e})") from None

    def __exit__(self, *exc) -> None:
        if self._log is not None:
            log, self._log = self._log, None
            with contextlib.suppress(OSError):
                log.close()

    def reserve(self, total: int, left: int | None = None) -> None:
        """Rank 0 checked the space for the whole job."""

    path = IterationWriter.path
    is_done = IterationWriter.is_done
    mark_done = IterationWriter.mark_done
    mark_done_many = IterationWriter.mark_done_many
