"""hf-to-mcore and reshard across ranks: `torchrun --nnodes N --nproc-per-node K -m shardkit convert ...`, or one
SLURM task per rank. (The HF export, mcore-to-hf, shares out whole safetensors shards with the same group, hand-shakes
and end: see convert/mcore_to_hf.py.)

    every rank   rendezvous (torch.distributed's env://, gloo, --distributed-timeout-minutes), compare a digest of the
                 parsed command, plan and validate as one process would
    rank 0       takes the output's lock, creates or resumes `<iter>.partial` (job.json), creates the arrays
    every rank   reads what every earlier run recorded (done.log, done.rank<N>.log: any number of ranks), checks that
                 all ranks see the same, takes its share of the chunks left (balanced by bytes; chunks that read the
                 same source region stay together), writes and fsyncs them, records them in its own log
    rank 0       once every rank reported success: checks that every chunk any rank recorded is there (a directory
                 that is not shared between nodes is named), writes the manifest and commits (checkpoint.commit)

The ranks coordinate through the rendezvous store (a key per rank and step) and gloo. Every rank keeps a heartbeat
in the store; a rank waiting for others gives up on one whose heartbeat stood still for --distributed-timeout-minutes
(it died or hangs) and stops with one line naming it; a rank that failed says why in the store, and the others stop at
once, naming it. Nothing is committed then, and a rerun with any number of ranks (one too) resumes from what every
rank recorded, ending bitwise equal to a single-process run. Progress is shown by rank 0 alone, for all ranks.
"""
from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
import re
import threading
import time
from typing import Callable, Sequence

from checkpoint.errors import ShardkitError
from checkpoint.faults import fault_point
from checkpoint.rendezvous import rank_and_world

DEFAULT_TIMEOUT_MINUTES = 10.0
NOTHING_COMMITTED = "nothing was committed; rerun (any number of ranks) to resume"  # how a stop ends, until a commit


class RankLost(ShardkitError):
    """Another rank died, hangs or failed: this one stops (nothing is committed). `lost`: the rank that died or
    hangs, where this one found out itself (then the others are told: they stop naming it too)."""

    def __init__(self, message: str, lost: int | None = None):
        super().__init__(message)
        self.lost = lost


def _store_error(e: BaseException) -> bool:
    """An error of the rendezvous store or a collective (torch raises RuntimeError subclasses: DistError, ...)."""
    return isinstance(e, (RuntimeError, ConnectionError, TimeoutError))


class Group:
    """This process's place among the ranks of one conversion, and the few ways they talk: `exchange` (gloo
    all_gather of a small object), `publish` / `wait` (a key per rank in the store, waited for while the ranks
    waited on show signs of life), `fail` (tell the others why this rank stops)."""

    def __init__(self, command: str, rank: int, world: int, timeout_minutes: float):
        import torch.distributed as dist

        self.command, self.rank, self.world = command, rank, world
        # how a stop ends, for its one line; finish() tells of a commit that may have happened
        self.outcome = NOTHING_COMMITTED
        self.timeout = datetime.timedelta(minutes=timeout_minutes)
        self.seconds = self.timeout.total_seconds()
        self.host = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        run = f"{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        self.prefix = f"shardkit/{run}/"
        try:
            base, _, _ = next(dist.rendezvous("env://", rank, world, timeout=self.timeout))
        except (RuntimeError, ValueError) as e:
            raise RankLost(self._rendezvous_failed(e)) from None
        self._base = base
        self.store = dist.PrefixStore(self.prefix, base)
        self._join()
        try:
            dist.init_process_group("gloo", store=dist.PrefixStore("pg", self.store), rank=rank, world_size=world,
                                    timeout=self.timeout)
        except RuntimeError as e:  # e.g. gloo picked a network interface the other nodes cannot reach
            raise RankLost(f"rank {self.rank}: gloo could not connect the ranks ({_short(e)}); where the nodes have "
                           "several networks, set GLOO_SOCKET_IFNAME to one they share; nothing was written") from None
        self._dist = dist
        # the heartbeat thread talks to the store through a client of its own (a client is not shared across threads)
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        self._beat_store = dist.PrefixStore(self.prefix, dist.TCPStore(host, port, world, is_master=False,
                                                                        timeout=self.timeout))
        self._progress = [0, 0]  # bytes, items this rank did (reported to rank 0)
        self.phase = 0  # the write of the job the steps belong to (next_phase)
        self._bar = None  # rank 0: the bar the others' progress is added to
        self._seen: dict[int, tuple[int, int]] = {}
        self._lock = threading.Lock()
        self._collecting = threading.Lock()
        self._stop = threading.Event()
        self._beats: dict[int, tuple[int, float]] = {}
        self._interval = max(0.05, min(1.0, self.seconds / 20))
        self._thread = threading.Thread(target=self._beat, name="shardkit-heartbeat", daemon=True)
        self._thread.start()

    # -- set-up ---------------------------------------------------------------------------------------------------
    def _rendezvous_failed(self, e: BaseException) -> str:
        text = str(e)
        m = re.search(r"(\d+)/(\d+) clients joined", text)
        if m:
            return (f"rank {self.rank}: only {m.group(1)} of WORLD_SIZE={self.world} ranks joined the rendezvous at "
                    f"{self.host} within --distributed-timeout-minutes ({self.seconds:g} s): the world size does not "
                    "match the ranks started; nothing was written")
        detail = next((ln.strip() for ln in text.splitlines() if ln.strip()), type(e).__name__).split("] ", 1)[-1]
        return (f"rank {self.rank}: the rendezvous at {self.host} failed ({detail[:160]}); nothing was written")

    def _join(self) -> None:
        """Every rank counts itself in; a world that never fills up (fewer ranks than WORLD_SIZE) or overflows (two
        processes with one rank number, more than WORLD_SIZE) is one line, not a wait without end."""
        try:
            self.store.set(f"rank/{self.rank}", str(os.getpid()))
            n = self.store.add("joined", 1)
            if n == self.world:
                self.store.set("all-joined", "1")
            self.store.wait(["all-joined"], self.timeout)
            n = self.store.add("joined", 0)
        except Exception as e:  # noqa: BLE001 - the store's timeout or a lost rank 0
            if not _store_error(e):
                raise
            try:
                n = self.store.add("joined", 0)
            except Exception:  # noqa: BLE001
                raise RankLost(self._rendezvous_failed(e)) from None
            raise RankLost(f"rank {self.rank}: only {n} of WORLD_SIZE={self.world} ranks joined the rendezvous at "
                           f"{self.host} within --distributed-timeout-minutes ({self.seconds:g} s): the world size "
                           "does not match the ranks started; nothing was written") from None
        if n > self.world:
            raise RankLost(f"rank {self.rank}: {n} processes joined the rendezvous at {self.host} for WORLD_SIZE="
                           f"{self.world} ranks (two with one rank number?): the world size does not match the ranks "
                           "started; nothing was written")

    # -- heartbeat and progress -------------------------------------------------------------------------------------
    def _beat(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._beat_store.add(f"beat/{self.rank}", 1)
                if self.rank:
                    with self._lock:
                        done = list(self._progress)
                    self._beat_store.set(f"progress/{self.rank}", f"{done[0]} {done[1]}")
                elif self._bar is not None:
                    self._collect_progress(self._beat_store)
            except Exception:  # noqa: BLE001 - the store is gone (rank 0 died): the main thread will find out
                return

    def _collect_progress(self, store) -> None:
        with self._collecting:
            bar = self._bar
            for r in range(1, self.world):
                key = f"progress/{r}"
                if bar is None or not store.check([key]):
                    continue
                b, n = map(int, store.get(key).decode().split())
                ob, on = self._seen.get(r, (0, 0))
                if (b, n) != (ob, on):
                    self._seen[r] = (b, n)
                    bar.advance(b - ob, n - on)

    def progress(self, bar):
        """What this rank's writer shows its progress on: rank 0's own bar (the others' progress is added to it as
        they report it), or a counter reported to rank 0 (the other ranks draw nothing)."""
        if self.rank == 0:
            self._bar = bar
            return bar
        return _Counter(self)

    def stop_progress(self) -> None:
        """Rank 0: add what the others reported last, then stop adding to the bar (it is about to close)."""
        if self.rank == 0 and self._bar is not None:
            with contextlib.suppress(Exception):
                self._collect_progress(self.store)
            with self._collecting:
                self._bar = None

    # -- talking --------------------------------------------------------------------------------------------------
    def next_phase(self) -> None:
        """The job's next write (a torch_dist source staged as a native checkpoint, then exported): its steps are
        keys of their own, not the first write's."""
        self.phase += 1
        self.outcome = NOTHING_COMMITTED

    def _step(self, step: str) -> str:
        return f"{step}#{self.phase}" if self.phase and step != "exit" else step

    def publish(self, step: str, value: dict | None = None) -> None:
        """Tell every rank this one reached `step` (with `value`); the progress so far goes first."""
        if self.rank:
            with self._lock:
                done = list(self._progress)
            self._guard(lambda: self.store.set(f"progress/{self.rank}", f"{done[0]} {done[1]}"))
        step = self._step(step)
        self._guard(lambda: self.store.set(f"{step}/{self.rank}", json.dumps(value or {})))
        self._guard(lambda: self.store.add(f"{step}/count", 1))

    def fail(self, e: BaseException) -> None:
        """Tell the others why this rank stops, so they stop at once naming the rank at fault: this one (its error),
        or the one it found dead or hung (best effort: the store may be gone)."""
        if isinstance(e, RankLost):
            if e.lost is None:
                return
            key, value = f"lost/{self.rank}", str(e.lost)
        else:
            key, value = f"failed/{self.rank}", (str(e) if isinstance(e, ShardkitError) else
                                                 f"{type(e).__name__}: {e}")[:2000]
        with contextlib.suppress(Exception):
            self.store.set(key, value)
            self.store.add("failures", 1)

    def wait(self, step: str, ranks: Sequence[int] | None = None, what: str = "", others: bool = True
             ) -> dict[int, dict]:
        """The values `ranks` (default: all) published for `step`, once all did. Stops (RankLost, one line) when
        (`others`) a rank failed or was found lost, or when one that is watched showed no sign of life (heartbeat)
        for the timeout: rank 0 watches the ranks it waits for, the others watch rank 0 (which tells them of any
        other it finds lost), so the store's load does not grow with the square of the ranks."""
        ranks = list(range(self.world)) if ranks is None else list(ranks)
        everyone = len(ranks) == self.world
        step = self._step(step)
        out: dict[int, dict] = {}
        watched = 0.0
        while True:
            if not everyone or int(self._guard(lambda: self.store.add(f"{step}/count", 0))) >= len(ranks):
                for r in ranks:
                    if r not in out and self._guard(lambda: self.store.check([f"{step}/{r}"])):
                        out[r] = json.loads(self._guard(lambda: self.store.get(f"{step}/{r}")).decode())
            if len(out) == len(ranks):
                return out
            if others and int(self._guard(lambda: self.store.add("failures", 0))):
                self._check_others(what)
            now = time.monotonic()
            if now - watched >= self._interval:
                watched = now
                if self.rank == 0:
                    if everyone:  # which ranks have not published yet
                        for r in ranks:
                            if r not in out and self._guard(lambda: self.store.check([f"{step}/{r}"])):
                                out[r] = json.loads(self._guard(lambda: self.store.get(f"{step}/{r}")).decode())
                    for r in ranks:
                        if r not in out and r != self.rank:
                            self._check_alive(r, what)
                else:
                    self._check_alive(0, what)
            time.sleep(min(0.1, self._interval))

    def stop_if_failed(self, what: str = "") -> None:
        """Between pieces of this rank's own work: stop at once (naming it) when another rank failed or was found
        lost, rather than at the next wait."""
        if int(self._guard(lambda: self.store.add("failures", 0))):
            self._check_others(what)

    def exchange(self, obj, what: str = "", to_rank0: bool = False) -> list:
        """gloo all_gather of a picklable object: every rank's, in rank order (`to_rank0`: a gather, only rank 0
        gets them; the others get [])."""
        out = [None] * self.world
        try:
            if to_rank0:
                self._dist.gather_object(obj, out if self.rank == 0 else None, dst=0)
                out = out if self.rank == 0 else []
            else:
                self._dist.all_gather_object(out, obj)
        except Exception as e:  # noqa: BLE001 - a rank died (connection reset) or hangs (gloo's timeout)
            if not _store_error(e):
                raise
            time.sleep(min(1.0, self._interval * 2))  # a rank that failed says so in the store just before it exits
            try:
                failures = int(self.store.add("failures", 0))
            except Exception:  # noqa: BLE001 - the store is gone too: named below
                failures = 0
            if failures:
                self._check_others(what)
            stale = self._stale_ranks()
            if stale:
                raise RankLost(self._lost_text(stale[0], what, _short(e)), lost=stale[0]) from None
            raise RankLost(f"rank {self.rank}: lost contact with another rank{what} ({_short(e)}): it died or stopped "
                           f"answering; {self.outcome}") from None
        return out

    def _check_others(self, what: str) -> None:
        """Stop when another rank failed (naming it and its error) or found one lost (naming that one)."""
        for r in range(self.world):
            if r != self.rank and self._guard(lambda: self.store.check([f"failed/{r}"])):
                msg = self._guard(lambda: self.store.get(f"failed/{r}")).decode()
                raise RankLost(f"rank {self.rank}: stopping{what}: rank {r} failed ({msg}); {self.outcome}")
        for r in range(self.world):
            if r != self.rank and self._guard(lambda: self.store.check([f"lost/{r}"])):
                lost = int(self._guard(lambda: self.store.get(f"lost/{r}")).decode())
                raise RankLost(self._lost_text(lost, what, f"rank {r} found no sign of life from it for "
                                                           f"--distributed-timeout-minutes ({self.seconds:g} s)"))

    def _lost_text(self, lost: int, what: str, how: str) -> str:
        return f"rank {self.rank}: rank {lost} died or stopped answering{what} ({how}); {self.outcome}"

    def _check_alive(self, r: int, what: str) -> None:
        beat = int(self._guard(lambda: self.store.add(f"beat/{r}", 0)))
        now = time.monotonic()
        last = self._beats.get(r)
        if last is None or last[0] != beat:
            self._beats[r] = (beat, now)
        elif now - last[1] > self.seconds:
            raise RankLost(self._lost_text(r, what, "no sign of life for --distributed-timeout-minutes "
                                                    f"({self.seconds:g} s)"), lost=r)

    def _stale_ranks(self) -> list[int]:
        """Ranks whose heartbeat does not move over a few beats (after a collective failed)."""
        try:
            first = {r: int(self.store.add(f"beat/{r}", 0)) for r in range(self.world) if r != self.rank}
            time.sleep(self._interval * 3)
            return [r for r, b in first.items() if int(self.store.add(f"beat/{r}", 0)) == b]
        except Exception:  # noqa: BLE001 - the store died with rank 0
            return [0] if self.rank else []

    def _guard(self, fn: Callable):
        """A store operation; the store failing (it lives in rank 0, or torchrun's agent) is one line."""
        try:
            return fn()
        except Exception as e:  # noqa: BLE001
            if not _store_error(e):
                raise
            raise RankLost(f"rank {self.rank}: lost the rendezvous store at {self.host} ({_short(e)}): rank 0 (or "
                           f"torchrun's agent) died or stopped answering; {self.outcome}") from None

    def close(self, error: BaseException | None = None) -> None:
        """Leave the group. Rank 0 may hold the store the others read (not under torchrun, whose agent holds it):
        it first waits until every rank not found lost has left too, so each learns why the job stops."""
        with contextlib.suppress(Exception):
            self.store.set(f"exit/{self.rank}", "1")
        if self.rank == 0 and error is not None:
            lost = {getattr(error, "lost", None)}
            with contextlib.suppress(Exception):
                lost |= {int(self.store.get(f"lost/{r}").decode()) for r in range(self.world)
                         if self.store.check([f"lost/{r}"])}
            with contextlib.suppress(Exception):
                self.wait("exit", [r for r in range(1, self.world) if r not in lost], others=False)
        self._stop.set()
        self._thread.join(timeout=5)
        with contextlib.suppress(Exception):
            self._dist.destroy_process_group()


class _Counter:
    """A non-zero rank's progress: bytes and chunks, reported to rank 0 by the heartbeat."""

    def __init__(self, group: Group):
        self.g = group

    def advance(self, nbytes: int, items: int = 0) -> None:
        with self.g._lock:
            self.g._progress[0] += nbytes
            self.g._progress[1] += items


def _short(e: BaseException) -> str:
    text = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
    return text.split("] ", 1)[-1][:160]


# -- the job's start ---------------------------------------------------------------------------------------------

def start(command: str, argv: dict, timeout_minutes: float | None) -> Group | None:
    """The group of this rank when the process was started as one rank of several (torchrun, or SLURM tasks), after
    the rendezvous and a comparison of every rank's parsed command; None for a single process (or a world of one)."""
    found = rank_and_world(os.environ, command)
    if found is None or found[1] == 1:
        return None
    g = Group(command, *found, timeout_minutes or DEFAULT_TIMEOUT_MINUTES)
    try:
        same_arguments(g, argv)
    except BaseException:
        g.close()
        raise
    return g


def same_arguments(g: Group, argv: dict) -> None:
    """Every rank must run the same command: a digest of the parsed arguments, compared on all ranks; a difference
    is one line naming the rank and the first argument that differs."""
    text = json.dumps(argv, sort_keys=True, default=str)
    mine = (hashlib.sha256(text.encode()).hexdigest(), argv)
    every = g.exchange(mine, " while comparing the ranks' arguments")
    for r, (digest, theirs) in enumerate(every):
        if digest == every[0][0]:
            continue
        keys = sorted(set(theirs) | set(every[0][1]))
        k = next((k for k in keys if theirs.get(k) != every[0][1].get(k)), "?")
        flag = "--" + k.replace("_", "-")
        raise ShardkitError(f"rank {r} was started with other arguments than rank 0: {flag} is "
                            f"{theirs.get(k)!r} on rank {r}, {every[0][1].get(k)!r} on rank 0; start every rank with "
                            "the same command; nothing was written")


# -- the chunks' share ---------------------------------------------------------------------------------------------

def share(tasks: list, nbytes: Callable, key: Callable, rank: int, world: int) -> list:
    """This rank's tasks: consecutive runs of tasks with the same `key` (they read the same source region) stay on one
    rank; the runs, in order, are dealt out so that every rank gets about the same bytes (a run goes to the rank
    whose byte range holds its middle). The same on every rank for the same `tasks`; deterministic."""
    runs: list[tuple[int, list]] = []
    last = object()
    for t in tasks:
        k = key(t)
        if not runs or k != last:
            runs.append((0, []))
        size, members = runs[-1]
        members.append(t)
        runs[-1] = (size + nbytes(t), members)
        last = k
    total = sum(s for s, _ in runs) or 1
    mine, before = [], 0
    for size, members in runs:
        owner = min(world - 1, int((before + size / 2) * world // total))
        if owner == rank:
            mine += members
        before += size
    return mine


def join_output(g: Group, w, left: Callable[[], list[str]], total: int, what: str = "chunks") -> None:
    """Every rank, once its writer is open: rank 0 has prepared the partial output (lock, job.json, arrays) and says
    so; the others wait for that, then attach to it (RankWriter.attach: the directory is shared and this job's) and
    read what every earlier run recorded. Then all compare what is left (`left()`: the ids of the `total` not
    recorded yet): the ranks of a directory that is not one shared directory disagree (one line, nothing
    committed)."""
    if g.rank == 0:
        g.publish("setup")
    else:
        g.wait("setup", [0], " while rank 0 prepared the output")
        w.attach()
    ids = left()
    mine = (hashlib.sha256("\n".join(ids).encode()).hexdigest(), total - len(ids))
    digests = g.exchange(mine, f" while comparing the finished {what}")
    for r, (digest, n) in enumerate(digests):
        if digest != digests[0][0]:
            from checkpoint.errors import WriteError

            raise WriteError(f"{w.partial}: rank {r} finds {n} finished {what} there, rank 0 {digests[0][1]}: the "
                             "output directory must be one directory every node shares; nothing was committed")


def report_done(g: Group, w, what: str = "chunks") -> list[list[str]]:
    """Every rank, once its share is durable and recorded: tell the others, wait until every rank did (or stop naming
    the one that died, hangs or failed), stop adding to rank 0's bar; rank 0 gets what each rank recorded (their
    logs' new lines, in rank order), the others []."""
    fault_point("rank.done")  # every piece of this rank's share is durable and recorded; not yet reported
    g.publish("done", {what: len(w.written)})
    g.wait("done", what=f" while the ranks wrote their {what}")
    g.stop_progress()
    return g.exchange(list(w.written), f" while the ranks reported their {what}", to_rank0=True)


def check_recorded(g: Group, w, reports: list[list[str]], tasks: list, entries: dict) -> None:
    """Rank 0, before the commit: every task is recorded by some rank (now or in an earlier run), and every chunk
    another rank recorded is there as rank 0 sees the output (a directory that is not shared between the nodes
    is not)."""
    from pathlib import Path

    from checkpoint import chunkio
    from checkpoint.errors import WriteError
    from checkpoint.manifest import tensor_path

    chunked: dict[str, list[int] | None] = {}
    for r, ids in enumerate(reports):
        if r == g.rank:
            continue
        for task_id in ids:
            name, _, box = task_id.partition("|")
            if name not in chunked:
                try:
                    md = json.loads((w.path(tensor_path(name)) / "zarr.json").read_text())
                except (OSError, ValueError):
                    md = {}
                chunked[name] = md["chunk_grid"]["configuration"]["chunk_shape"] if chunkio.supports(md) else None
            chunk = chunked[name]
            if chunk is None:
                continue
            starts = [int(b.split(":")[0]) for b in box.split(",")]
            path = chunkio.chunk_path(Path(w.path(tensor_path(name))), [a // c for a, c in zip(starts, chunk)])
            if not path.is_file():
                raise WriteError(f"{path}: rank {r} recorded this chunk (tensor {name}) as written, but rank 0 does "
                                 f"not find it in {w.partial}: the output directory must be on a filesystem every "
                                 "node shares; nothing was committed")
    done = set(w.done).union(*map(set, reports))
    missing = [t for t in tasks if t.id not in done]
    if missing:
        raise WriteError(f"{w.partial}: {len(missing)} chunk(s) no rank recorded as written (e.g. tensor "
                         f"{missing[0].name} {missing[0].id.partition('|')[2]}); nothing was committed; rerun to "
                         "write them")


# -- the writer of each rank, and the end --------------------------------------------------------------------------

def open_writer(out, iteration: int, job: dict, overwrite: bool, group: Group | None,
                pointer: tuple[str, str] | None = None):
    """The writer of this process: the one IterationWriter (a single process, or rank 0, which owns the output:
    lock, `.partial`, commit; `pointer`: what the commit writes last, see IterationWriter), or another rank's
    RankWriter on the partial output rank 0 prepares."""
    from checkpoint.commit import IterationWriter, RankWriter

    if group is None or group.rank == 0:
        return IterationWriter(out, iteration, job, overwrite=overwrite, pointer=pointer)
    return RankWriter(out, iteration, job, group.rank)


def leads(group: Group | None) -> bool:
    """Does this process write the manifest and commit (a single process, or rank 0)?"""
    return group is None or group.rank == 0


def finish(group: Group | None, path, out, outcome: str | None = None):
    """After the commit (rank 0) or this rank's part (the others): the committed iteration's path on every rank,
    once rank 0 says it committed. Rank 0 waits for the others to have heard it (the store may live in its process),
    but a rank lost after its part was reported no longer matters: the checkpoint is complete. `outcome`: what a
    rank that stops while rank 0 commits says of the output (default: a native/torch_dist checkpoint's words)."""
    from pathlib import Path

    if group is None:
        return path
    if group.rank == 0:
        fault_point("rank.committed")
        group.publish("commit", {"path": str(path)})
        with contextlib.suppress(RankLost):
            group.wait("bye", range(1, group.world), " after the commit")
        return path
    group.outcome = outcome or (f"{out} holds the complete new checkpoint (`latest` names it; `shardkit verify "
                                f"{out}`) or, not committed, none of it (rerun, any number of ranks, to resume)")
    got = group.wait("commit", [0], " while rank 0 committed")[0]
    group.publish("bye")
    return Path(got["path"])


# -- the estimate before a large job ---------------------------------------------------------------------------------

ESTIMATE_ABOVE = 64 << 30  # jobs with at least this many bytes left print an estimate first (--estimate-above)
PROBE_BYTES = 64 << 20  # what each rank (or the one process) writes and fsyncs to measure the output's write rate


def clear_probes(partial) -> None:
    """Rank 0 (or the one process), before any rank probes: what a probe killed mid-write left (it would be
    committed with the iteration otherwise)."""
    from pathlib import Path

    for p in Path(partial).glob(".probe.*"):
        p.unlink(missing_ok=True)


def probe_write(directory, nbytes: int, rank: int) -> float:
    """Bytes per second of a durable write into `directory`: `nbytes` of incompressible bytes written, fsynced and
    removed. Every rank of a node probes at the same time, so their rates add up to the node's."""
    import numpy as np
    from pathlib import Path

    data = np.random.default_rng(rank).bytes(max(1, nbytes))
    path = Path(directory) / f".probe.{rank}"
    t = time.perf_counter()
    try:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    finally:
        seconds = time.perf_counter() - t
        path.unlink(missing_ok=True)
    return len(data) / max(seconds, 1e-9)


def estimate(left: int, rates: list[tuple[str, float]]) -> tuple[float, str]:
    """Seconds the job should take and the line that says so: `left` bytes shared evenly by the ranks, whose
    (host, measured durable write rate) are `rates`; a node's rate is the sum of its ranks' (they probed together)
    and the slowest node decides. Reading the sources overlaps the writes; the progress bar shows the real rate."""
    nodes: dict[str, list[float]] = {}
    for host, rate in rates:
        nodes.setdefault(host, []).append(rate)
    world = len(rates)
    per_node = {h: (len(r) * left / world, sum(r)) for h, r in nodes.items()}
    slowest = max(per_node, key=lambda h: per_node[h][0] / per_node[h][1])
    seconds = per_node[slowest][0] / per_node[slowest][1]
    node_rates = sorted(rate for _, rate in per_node.values())
    span = (f"{node_rates[0] / 1e9:.2f} GB/s" if len(node_rates) == 1 or node_rates[0] == node_rates[-1] else
            f"{node_rates[0] / 1e9:.2f}-{node_rates[-1] / 1e9:.2f} GB/s (slowest: {slowest})")
    when = f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min" if seconds < 7200 else \
        f"{seconds / 3600:.1f} h"
    size = f"{left / 1e9:,.2f} GB" if left >= 1e9 else f"{left / 1e6:,.2f} MB"
    return seconds, (f"estimate: {size} to write on {len(nodes)} node(s), {world} rank(s); durable write rate "
                     f"measured per node {span}: about {when}")


def announce_estimate(w, left: int, group: Group | None, quiet: bool) -> None:
    """Before a job with `left` bytes to write: every rank measures its write rate into the output (together, so a
    node's ranks share its bandwidth as they will), rank 0 prints the estimate."""
    import socket

    world = 1 if group is None else group.world
    rank = 0 if group is None else group.rank
    rate = probe_write(w.partial, min(PROBE_BYTES, max(1, left // world)), rank)
    mine = (socket.gethostname(), rate)
    rates = [mine] if group is None else group.exchange(mine, " while measuring the write rate", to_rank0=True)
    if rank == 0 and not quiet:
        import sys

        print(estimate(left, rates)[1], file=sys.stderr, flush=True)
