"""Writing a native checkpoint chunk by chunk, shared by hf-to-mcore, reshard, torch_dist import and
megatron-to-mcore.

A producer supplies a worker class (built from picklable arguments; called with one task, it computes one storage
chunk and writes it through its ChunkSink); this module plans the chunks, creates the arrays, skips chunks a previous
run finished, runs the tasks through `Workers` (the one worker pool: in-process, or in spawned worker processes -
fork after tensorstore's threads start can hang), records each finished chunk for resume, and shows progress.
"""
from __future__ import annotations

import collections
import itertools
import multiprocessing as mp
import os
import sys
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

import numpy as np

from checkpoint import chunkio, store
from checkpoint.commit import IterationWriter
from checkpoint.errors import FormatError, WriteError
from checkpoint.faults import fault_point
from checkpoint.malloc import tune_malloc
from checkpoint.manifest import TensorEntry, tensor_path
from checkpoint.progress import progress_bar

if TYPE_CHECKING:
    import torch

WORKER_MIN_BYTES = 64 << 20  # spawning a worker costs seconds (it imports torch): one per this much work
# In-process runs keep up to this many bytes of chunk values handed to writer threads but not yet written (their
# buffers are ours until then) while the next chunk is read and assembled...
INFLIGHT_BYTES = 128 << 20
# ... and up to this many bytes written (in the page cache, no memory of ours) but not yet fsynced. A chunk is
# recorded as done only once durable. WRITE_THREADS write and fsync chunks concurrently, so the filesystem commits
# many small files' fsyncs together (a 64-expert MoE has thousands of chunks) and the disk never waits for us.
SYNC_BACKLOG_BYTES = 512 << 20
WRITE_THREADS = 16


@dataclass(frozen=True)
class Task:
    name: str
    lead: tuple[int, ...]  # layer (and expert) index of a stacked tensor's chunk
    box: tuple[tuple[int, int], ...]  # [start, stop) per axis of the global array

    @property
    def id(self) -> str:
        return f"{self.name}|" + ",".join(f"{a}:{b}" for a, b in self.box)

    @property
    def index(self) -> tuple[slice, ...]:
        return tuple(slice(a, b) for a, b in self.box)

    def nbytes(self, entry: TensorEntry) -> int:
        n = 1
        for a, b in self.box:
            n *= b - a
        return n * store.itemsize(entry.dtype)


def chunk_tasks(entries: dict[str, TensorEntry]) -> list[Task]:
    """One task per storage chunk of every tensor."""
    tasks = []
    for name, e in entries.items():
        for offs in itertools.product(*[range(0, s, c) for s, c in zip(e.shape, e.chunk)]):
            box = tuple((o, o + c) for o, c in zip(offs, e.chunk))
            tasks.append(Task(name, tuple(a for a, _ in box[:e.lead]), box))
    return tasks


def refuse_nonfinite(name: str, box, value) -> None:
    """A chunk about to be written holds NaN/Inf (a checkpoint that holds them, resharded or exported): one line
    naming the tensor and the chunk, nothing committed (issue 34). A bit test on the exponents: a few ms per 100 MB."""
    bad = store.count_nonfinite(value if isinstance(value, np.ndarray) else store.to_numpy(value.detach().cpu()))
    if bad:
        at = ", ".join(f"{a}:{b}" for a, b in box)
        raise FormatError(f"tensor {name} [{at}]: {bad:,} non-finite value(s) (NaN/Inf); refusing to write them "
                          "(a checkpoint that holds them cannot be trained or exported as it is: resume from an "
                          "earlier iteration)")


class ChunkSink:
    """Worker-side: open arrays once, write whole chunks (chunkio's direct writer where the array's codecs are ours,
    else tensorstore), turn write failures into WriteError."""

    def __init__(self, out_dir: str | Path, dtypes: dict[str, str], allow_nonfinite: bool = False):
        self.out, self.dtypes = Path(out_dir), dtypes
        self.allow_nonfinite = allow_nonfinite  # else a chunk holding NaN/Inf is refused (refuse_nonfinite)
        self.recorder: _Recorder | None = None  # in-process under write_chunks: writes are pipelined and recorded
        self.ctx = store.context()
        self.arrays: dict = {}
        self.chunks: dict[str, list[int] | None] = {}  # chunk shape of arrays chunkio writes, None: tensorstore
        # writes not yet durable, oldest first: (task, nbytes, bytes of ours it holds (tensorstore), durable future)
        self._pending: collections.deque = collections.deque()
        self._pending_bytes = self._held_bytes = 0
        self._writer: chunkio.ChunkWriter | None = None

    def write(self, task: Task, value: "torch.Tensor | np.ndarray") -> tuple[str, int]:
        """Write one chunk. In a worker process it is durable on return (the parent records it). In-process
        (write_chunks set `recorder`) it returns once a writer thread (or tensorstore) holds `value`, and the
        recorder marks the chunk done when its write is durable (memory and backlog bounded, see INFLIGHT_BYTES).

        `value` is handed over: producers pass fresh tensors or read-only views of their sources and never modify
        them afterwards, so tensorstore encodes it where it lies instead of copying it first."""
        arr = self.arrays.get(task.name)
        if arr is None:
            arr = self.arrays[task.name] = store.open_existing(self.out / tensor_path(task.name), self.ctx, task.name)
            md = store.metadata(arr)
            self.chunks[task.name] = md["chunk_grid"]["configuration"]["chunk_shape"] if chunkio.supports(md) else None
        value = store.cast(value, self.dtypes[task.name], task.name)
        if not self.allow_nonfinite:
            refuse_nonfinite(task.name, task.box, value)
        nbytes = value.nbytes if isinstance(value, np.ndarray) else value.numel() * value.element_size()
        rec = self.recorder
        chunk = self.chunks[task.name]
        if chunk is not None and list(value.shape) == chunk and all(a % c == 0 for (a, _), c in zip(task.box, chunk)):
            fault_point("store.write")
            path = self.out / tensor_path(task.name) / chunkio.chunk_path(Path(), [a // c for (a, _), c in
                                                                                    zip(task.box, chunk)])
            data = chunkio.contiguous(store.to_numpy(value))
            del value
            if rec is None:
                chunkio.write_durable(path, data, task.name)
                return task.id, nbytes
            if self._writer is None:  # bounded memory: submit waits while the threads hold INFLIGHT_BYTES of ours
                self._writer = chunkio.ChunkWriter(WRITE_THREADS, INFLIGHT_BYTES)
            # the chunk's bytes show on the progress bar when written; it is counted done (recorded) once durable
            done, held = self._writer.submit(path, data, task.name, lambda: rec.bar.advance(nbytes, 1)), 0
            del data
        else:
            try:
                fut = store.write(arr, task.index, value, immutable=True)
                if rec is None:
                    fut.result()
                    return task.id, nbytes
                fut.copy.result()  # `value` is taken (referenced until its write completes)
            except ValueError as e:
                raise self._error(task, e) from None
            done, held = fut.commit, nbytes
        self._pending.append((task, nbytes, held, done))
        self._pending_bytes += nbytes
        self._held_bytes += held
        if self._over_budget():
            self._retire(rec)
        return task.id, nbytes

    def _over_budget(self) -> bool:
        return self._held_bytes > INFLIGHT_BYTES or self._pending_bytes > SYNC_BACKLOG_BYTES

    def flush(self, rec: "_Recorder", raise_errors: bool = True) -> None:
        """Wait for every write in flight and record it (also after a failed one: nothing may still be writing when
        the caller removes the partial output), then raise the first failure unless `raise_errors` is off (after a
        failure elsewhere)."""
        first: WriteError | None = None
        while self._pending:
            try:
                self._retire(rec, everything=True)
            except WriteError as e:
                first = first or e
        if first is not None and raise_errors:
            raise first

    def _retire(self, rec: "_Recorder", everything: bool = False) -> None:
        """Wait for the oldest writes until within budget (or for all), take along the following ones that
        have already finished, and record them together: one fsync of the resume log per batch, not per chunk."""
        done: list[tuple[str, int]] = []
        try:
            while self._pending and (everything or self._over_budget() or self._pending[0][3].done()):
                task, nbytes, held, commit = self._pending.popleft()
                self._pending_bytes -= nbytes
                self._held_bytes -= held
                try:
                    commit.result()
                except ValueError as e:
                    raise self._error(task, e) from None
                done.append((task.id, held))  # bytes not yet on the bar: chunkio's writes showed theirs when written
        finally:
            rec.durable(done)

    def _error(self, task: Task, e: Exception) -> WriteError:
        return WriteError(f"tensor {task.name}: writing {self.out / tensor_path(task.name)} failed: "
                          f"{store.short_error(e)}; check free space and permissions")


class _Recorder:
    def __init__(self, w: IterationWriter, bar):
        self.w, self.bar = w, bar

    def durable(self, chunks: list[tuple[str, int]]) -> None:
        """Record chunks whose writes are durable: (task id, bytes the progress bar has not been shown yet; 0 for
        chunkio's writes, which showed their bytes and chunk when written)."""
        if chunks:
            fault_point("chunk.unrecorded")
            try:
                self.w.mark_done_many([task_id for task_id, _ in chunks])
            except OSError as e:  # e.g. the disk filled up: a WriteError, so flush still waits for the writes in flight
                raise WriteError(f"{self.w.partial}: recording finished chunks in its resume log failed "
                                 f"({e.strerror or e})") from None
            self.bar.advance(sum(n for _, n in chunks), sum(1 for _, n in chunks if n))
            for _ in chunks:
                fault_point("chunk")


_PROCESS_WORKER: list = []  # in a spawned worker process only: the worker its initialiser built


def _start_process(make: Callable, args: tuple) -> None:
    tune_malloc()
    _PROCESS_WORKER.append(make(*args))


def _call_process_worker(task):
    return _PROCESS_WORKER[0](task)


class Workers:
    """The one worker pool of the converters: `make(*args)` builds a worker (a callable, one task -> one result) in
    this process (`processes` <= 1; `local` is it) or in each of `processes` spawned processes (`local` is None).
    Every worker's state lives in its object; a spawned process keeps only its one worker. Use as a context
    manager; an in-process worker's `close()`, where it has one, runs at the end."""

    def __init__(self, make: Callable, args: tuple, processes: int):
        self.make, self.args, self.processes = make, args, processes
        self.local = None
        self._pool: ProcessPoolExecutor | None = None

    def __enter__(self) -> "Workers":
        if self.processes <= 1:
            # a worker pins its process to one torch thread (its casts run beside other workers); in this process
            # that is undone at the end, or what runs after (convert's verify: fp32 GEMMs) would run on one core
            self._threads = (sys.modules["torch"].get_num_threads() if "torch" in sys.modules else None,
                             os.environ.get("OMP_NUM_THREADS"))
            self.local = self.make(*self.args)
        else:
            self._pool = ProcessPoolExecutor(self.processes, mp_context=mp.get_context("spawn"),
                                             initializer=_start_process, initargs=(self.make, self.args))
        return self

    def run(self, tasks: list) -> Iterator:
        """The tasks' results: in order in-process, as they complete in worker processes (a failure cancels the
        rest and is raised)."""
        if self.local is not None:
            for t in tasks:
                yield self.local(t)
            return
        futures = [self._pool.submit(_call_process_worker, t) for t in tasks]
        try:
            for f in as_completed(futures):
                yield f.result()
        except BaseException:
            for f in futures:
                f.cancel()
            raise

    def __exit__(self, *exc) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        elif self.local is not None:
            try:
                if hasattr(self.local, "close"):
                    self.local.close()
            finally:
                threads, omp = self._threads
                if threads is None and "torch" in sys.modules and omp is None:  # imported under the worker's pin
                    threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
                if threads is not None and "torch" in sys.modules:
                    sys.modules["torch"].set_num_threads(threads)
                if omp is None:
                    os.environ.pop("OMP_NUM_THREADS", None)
                else:
                    os.environ["OMP_NUM_THREADS"] = omp


def source_region(task: Task) -> tuple:
    """The source region a chunk reads, for sharing chunks among ranks (convert.distributed.share): a stacked
    tensor's layer (and expert) and the rows of the chunk's first split axis. Chunks that differ only in later axes
    (a row-parallel weight's column halves) read the same rows of the same source tensor, so they stay together."""
    return task.name, task.lead, task.box[len(task.lead)] if len(task.box) > len(task.lead) else ()


def create_arrays(w, entries: dict[str, TensorEntry]) -> None:
    """Create every tensor's array in the partial output of `w` (its chunks are written after)."""
    ctx = store.context()
    for name, e in entries.items():
        try:
            store.create(w.path(tensor_path(name)), e.shape, e.dtype, e.chunk, ctx)
        except ValueError as err:
            raise WriteError(f"tensor {name}: cannot create {w.path(tensor_path(name))}: "
                             f"{store.short_error(err)}") from None


def write_chunks(w, entries: dict[str, TensorEntry], label: str, make: Callable, args: tuple | Callable,
                 workers: int | None = None, quiet: bool = False, group=None,
                 region: Callable[[Task], tuple] = source_region, estimate_above: int | None = None,
                 order: Callable[[Task], tuple] | None = None) -> None:
    """Create every array under `w`, then run each chunk not already done through a worker `make(*args)` (see
    Workers; its `sink` is its ChunkSink). In-process, a worker's `prefetch(next_task)` (a read-ahead hint, run on a
    helper thread), where it has one, is called before each task runs, so the next chunk's source is read while this
    one is encoded and written. `args` may be a function of the tasks this process runs, returning the tuple.

    With `group` (convert.distributed.Group: one rank of several), `w` is rank 0's IterationWriter or another rank's
    RankWriter: rank 0 creates the arrays, every rank takes its share of the chunks left (grouped by `region`, the
    source region a chunk reads), writes and records them, and returns once every rank has; rank 0 then checks that
    every chunk any rank recorded is there. Rank 0 alone shows progress, for all ranks.

    A job with at least `estimate_above` bytes left (default convert.distributed.ESTIMATE_ABOVE) first measures the
    output's durable write rate on every rank and prints the expected time (convert.distributed.estimate).

    `order` (a sort key of a task; the same on every rank) sets the order the chunks run in: e.g. the position of
    the source bytes a chunk reads, so that a cold source is read front to back."""
    tasks = chunk_tasks(entries)
    if order is not None:
        tasks.sort(key=order)
    lead = group is None or group.rank == 0
    todo = [t for t in tasks if not w.is_done(t.id)]
    total = sum(t.nbytes(entries[t.name]) for t in tasks)
    left = sum(t.nbytes(entries[t.name]) for t in todo)
    if lead:
        from .distributed import clear_probes

        clear_probes(w.partial)
        w.reserve(total, left)  # refuse a write the filesystem cannot hold before anything is written
        create_arrays(w, entries)
    resumed = len(tasks) - len(todo)
    if group is not None:  # rank 0 has taken the lock, prepared the partial output and created the arrays
        from .distributed import join_output

        join_output(group, w, lambda: [t.id for t in tasks if not w.is_done(t.id)], len(tasks))
        todo = [t for t in tasks if not w.is_done(t.id)]
        resumed = len(tasks) - len(todo)
    from .distributed import ESTIMATE_ABOVE, announce_estimate, share

    left_all = sum(t.nbytes(entries[t.name]) for t in todo)  # the same on every rank
    if left_all and left_all >= (ESTIMATE_ABOVE if estimate_above is None else estimate_above):
        announce_estimate(w, left_all, group, quiet)
    if group is not None:
        todo = share(todo, lambda t: t.nbytes(entries[t.name]), region, group.rank, group.world)
    if resumed and lead and not quiet:
        print(f"resuming: {resumed} of {len(tasks)} chunks already written", file=sys.stderr)
    if callable(args):
        args = args(todo)
    # One process with pipelined writes keeps the disk busy; every spawned worker first spends seconds of CPU
    # importing torch and maps the sources again, so more only pay off for CPU-heavy chunks: opt in with --workers.
    # (never more processes than CPUs: each imports torch and maps the sources, so extra ones only cost memory)
    nworkers = max(1, min(workers or 1, len(todo) or 1, os.cpu_count() or 1))
    with progress_bar(label, total=total, items=len(tasks), disable=quiet or not lead) as shown:
        bar = shown if group is None else group.progress(shown)
        if lead:
            bar.advance(total - left, resumed)
        _run_tasks(w, todo, make, args, nworkers, bar)
        if group is not None:
            from .distributed import report_done

            reports = report_done(group, w)
    if group is not None:
        from .distributed import check_recorded

        if lead:
            check_recorded(group, w, reports, tasks, entries)
            if not quiet:
                print(f"{label}: {group.world} ranks wrote {' + '.join(str(len(r)) for r in reports)} chunks"
                      + (f" ({resumed} already written)" if resumed else ""), file=sys.stderr)


def _run_tasks(w, todo: list[Task], make: Callable, args: tuple, nworkers: int, bar) -> None:
    with Workers(make, args, nworkers) as pool:
        worker = pool.local
        if worker is None:
            for task_id, nbytes in pool.run(todo):
                fault_point("chunk.unrecorded")
                w.mark_done(task_id)
                bar.advance(nbytes, 1)
                fault_point("chunk")
            return
        rec = worker.sink.recorder = _Recorder(w, bar)  # chunks are recorded as their writes become durable
        ok = False
        try:
            run_in_process(worker, todo)
            ok = True
        finally:
            worker.sink.recorder = None
            worker.sink.flush(rec, raise_errors=ok)  # also when interrupted: what is in flight gets recorded


def run_in_process(worker, tasks: list[Task]) -> None:
    """Run `tasks` in order through an in-process worker; where it has `prefetch(next_task)` (a read-ahead hint), that
    runs on a helper thread before each task, so the next chunk's source is read while this one is written."""
    prefetch = getattr(worker, "prefetch", None)
    hints = ThreadPoolExecutor(1, thread_name_prefix="shardkit-prefetch") if prefetch else None
    try:
        if hints is not None and tasks:
            hints.submit(prefetch, tasks[0])
        for i, task in enumerate(tasks):
            if hints is not None and i + 1 < len(tasks):
                hints.submit(prefetch, tasks[i + 1])
            worker(task)
    finally:
        if hints is not None:
            hints.shutdown(wait=True, cancel_futures=True)
