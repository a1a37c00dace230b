"""NCCL's point-to-point rules, modelled over gloo (real ranks) or over threads (one process), for the tests.

gloo buffers a send and matches messages by tag, so code that would hang on GPUs runs on it. This model takes
torch.distributed's point-to-point calls (`isend`, `irecv`, `send`, `recv`, `P2POp`, `batch_isend_irecv`) and gives
them NCCL's rules (train/parallel/p2p.py says what the trainer relies on):

1. one stream per (rank, process group): the entries a rank posts on a group run one after the other, in posting
   order (a stand-alone isend/irecv is one entry, a `batch_isend_irecv` is one entry holding all its operations).
   This is stricter than NCCL's lazily created per-pair communicators and as strict as a group whose communicator
   PyTorch initialised eagerly (which then carries its point-to-point traffic too);
2. rendezvous: a send completes only after the peer's matching receive has been posted (reached the head of the
   peer's stream); nothing is buffered;
3. no tags: a pair's messages in one direction on one group match in posting order; a receive whose size or dtype
   differs from the send it matches is an error (on NCCL: corruption or a hang);
4. the operations of one entry progress together; the entry completes when all of them have;
5. (over gloo) the first use of a group is a collective of all its ranks, never a point-to-point batch
   (`batch_isend_irecv`'s note: otherwise the behaviour is undefined).

A wait that does not complete within `timeout` seconds raises `Deadlock`, naming what the stream was waiting for.
Each entry runs as this protocol on a transport: for each receive, post the data receive, then send the peer a token
(element count, dtype); for each send, wait for the peer's token, check it, then send the data; wait for all data.
The transport is gloo on a separate process group (tokens and data on tags per group) or in-memory mailboxes.

Used by tests/test_pipeline_schedule.py (threads, real StageSteps) and, through tests/fault_zygote.py, by every
multi-rank trainer run the tests fork (SHARDKIT_TEST_NCCL_MODEL=0 turns it off; tests/test_nccl_model.py compares
runs with and without it bitwise).
"""
from __future__ import annotations

import collections
import inspect
import queue
import threading
import types
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.uint8,
          torch.int8, torch.bool, torch.int16]


class Deadlock(RuntimeError):
    """A wait that NCCL would never complete."""


class Mismatch(RuntimeError):
    """A send matched with a receive of another size or dtype (no tags on NCCL: posting order decides)."""


@dataclass
class P2POp:
    op: Callable
    tensor: torch.Tensor
    peer: int | None = None
    group: Any = None
    tag: int = 0
    group_peer: int | None = None


@dataclass
class Entry:
    ops: list[tuple[str, torch.Tensor, int]]  # ("send" | "recv", tensor, global peer rank)
    group: Any
    rank: int
    what: str = ""
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


class Work:
    def __init__(self, model: "NcclModel", entry: Entry) -> None:
        self.model, self.entry = model, entry

    def wait(self, timeout: Any = None) -> bool:
        if not self.entry.done.wait(self.model.timeout):
            raise Deadlock(f"NCCL model: rank {self.entry.rank} waited {self.model.timeout:g} s for {self.entry.what}: "
                           f"{self.model.blocked_on(self.entry)}")
        if self.entry.error is not None:
            raise self.entry.error
        return True

    def is_completed(self) -> bool:
        return self.entry.done.is_set()


class ThreadTransport:
    """In-memory mailboxes between threads of one process (ranks are threads: `NcclModel.local.rank`)."""

    def __init__(self) -> None:
        self.cv = threading.Condition()
        self.boxes: dict[tuple, collections.deque] = collections.defaultdict(collections.deque)

    def put(self, key: tuple, item: Any) -> None:
        with self.cv:
            self.boxes[key].append(item)
            self.cv.notify_all()

    def take(self, key: tuple, timeout: float) -> Any:
        with self.cv:
            if not self.cv.wait_for(lambda: self.boxes[key], timeout):
                return None
            return self.boxes[key].popleft()

    def send_token(self, me: int, peer: int, gid: int, token: tuple) -> Callable[[float], bool]:
        self.put(("token", me, peer, gid), token)
        return lambda timeout: True

    def recv_token(self, me: int, peer: int, gid: int, timeout: float) -> tuple | None:
        return self.take(("token", peer, me, gid), timeout)

    def recv_data(self, me: int, buf: torch.Tensor, peer: int, gid: int) -> Callable[[float], bool]:
        def wait(timeout: float) -> bool:
            t = self.take(("data", peer, me, gid), timeout)
            if t is None:
                return False
            buf.copy_(t)
            return True
        return wait

    def send_data(self, me: int, t: torch.Tensor, peer: int, gid: int) -> Callable[[float], bool]:
        self.put(("data", me, peer, gid), t.detach().clone())
        return lambda timeout: True


class GlooTransport:
    """Tokens and data over a gloo group of all ranks kept for the model, on tags per (group, kind)."""

    def __init__(self, orig: dict, shadow: Any) -> None:
        self.orig, self.shadow = orig, shadow

    def _tag(self, gid: int, kind: int) -> int:
        return 4242 + 2 * gid + kind

    def send_token(self, me: int, peer: int, gid: int, token: tuple) -> Callable[[float], bool]:
        t = torch.tensor(token, dtype=torch.int64)  # never blocks the entry's own sends: waited for at its end
        w = self.orig["isend"](t, peer, group=self.shadow, tag=self._tag(gid, 0))
        return lambda timeout, _keep=t: _wait(w, timeout)

    def recv_token(self, me: int, peer: int, gid: int, timeout: float) -> tuple | None:
        buf = torch.empty(2, dtype=torch.int64)
        w = self.orig["irecv"](buf, peer, group=self.shadow, tag=self._tag(gid, 0))
        if not _wait(w, timeout):
            return None
        return tuple(int(v) for v in buf)

    def recv_data(self, me: int, buf: torch.Tensor, peer: int, gid: int) -> Callable[[float], bool]:
        staging = buf if buf.is_contiguous() else torch.empty_like(buf, memory_format=torch.contiguous_format)
        w = self.orig["irecv"](staging, peer, group=self.shadow, tag=self._tag(gid, 1))

        def wait(timeout: float) -> bool:
            if not _wait(w, timeout):
                return False
            if staging is not buf:
                buf.copy_(staging)
            return True
        return wait

    def send_data(self, me: int, t: torch.Tensor, peer: int, gid: int) -> Callable[[float], bool]:
        t = t.detach().contiguous()
        w = self.orig["isend"](t, peer, group=self.shadow, tag=self._tag(gid, 1))
        return lambda timeout: _wait(w, timeout)


def _wait(work: Any, timeout: float) -> bool:
    import datetime

    try:
        work.wait(datetime.timedelta(seconds=timeout))
        return True
    except RuntimeError as e:  # gloo: "Timed out waiting ..."
        if "imed out" in str(e) or "imeout" in str(e):
            return False
        raise


class NcclModel:
    def __init__(self, transport: Any, rank_of: Callable[[], int], timeout: float = 60.0,
                 group_id: Callable[[Any], int] | None = None) -> None:
        self.transport, self.rank_of, self.timeout = transport, rank_of, timeout
        self.group_id = group_id or self._thread_group_id
        self._gids: dict[Any, int] = {}
        self.lock = threading.Lock()
        self.streams: dict[tuple[int, int], queue.Queue] = {}
        self.failed: dict[tuple[int, int], BaseException] = {}
        self.waiting: dict[tuple[int, int], str] = {}
        self.first_use: Callable[[Any, int], None] | None = None  # the gloo mode's rule 5
        self.entries = 0  # posted (for the tests)
        self.batches = 0

    def _thread_group_id(self, group: Any) -> int:
        with self.lock:
            return self._gids.setdefault(group, len(self._gids))

    # -- torch.distributed's point-to-point API ------------------------------------------------------------------
    def isend(self, tensor, dst=None, group=None, tag=0, group_dst=None):
        return Work(self, self._post([("send", tensor, dst)], group, "an isend"))

    def irecv(self, tensor, src=None, group=None, tag=0, group_src=None):
        return Work(self, self._post([("recv", tensor, src)], group, "an irecv"))

    def send(self, tensor, dst=None, group=None, tag=0, group_dst=None):
        self.isend(tensor, dst, group).wait()

    def recv(self, tensor, src=None, group=None, tag=0, group_src=None):
        self.irecv(tensor, src, group).wait()
        return src

    def batch_isend_irecv(self, p2p_op_list):
        groups = {id(p.group) for p in p2p_op_list}
        if len(groups) != 1:
            raise ValueError("batch_isend_irecv: all operations of a batch must use one group (NCCL)")
        ops = []
        for p in p2p_op_list:
            name = getattr(p.op, "__name__", "")
            if name not in ("isend", "irecv"):
                raise ValueError(f"batch_isend_irecv: op must be isend or irecv, got {p.op!r}")
            ops.append(("send" if name == "isend" else "recv", p.tensor, p.peer))
        self.batches += 1
        e = self._post(ops, p2p_op_list[0].group, f"a batch of {len(ops)}")
        return [Work(self, e) for _ in ops]

    def module(self) -> types.SimpleNamespace:
        """A stand-in for torch.distributed's point-to-point functions (thread mode)."""
        return types.SimpleNamespace(isend=self.isend, irecv=self.irecv, send=self.send, recv=self.recv,
                                     P2POp=P2POp, batch_isend_irecv=self.batch_isend_irecv)

    # -- the streams ----------------------------------------------------------------------------------------------
    def _post(self, ops: list, group: Any, what: str) -> Entry:
        rank, gid = self.rank_of(), self.group_id(group)
        if self.first_use is not None:
            self.first_use(group, gid)
        desc = ", ".join(f"{k} {tuple(t.shape)} {'to' if k == 'send' else 'from'} rank {p}" for k, t, p in ops)
        e = Entry(ops, group, rank, f"{what} on group {gid} ({desc})")
        key = (rank, gid)
        with self.lock:
            self.entries += 1
            q = self.streams.get(key)
            if q is None:
                q = self.streams[key] = queue.Queue()
                threading.Thread(target=self._stream, args=(key, q), daemon=True,
                                 name=f"nccl-model-{rank}-{gid}").start()
        q.put(e)
        return e

    def blocked_on(self, e: Entry) -> str:
        key = (e.rank, self.group_id(e.group))
        return self.waiting.get(key, "its stream had not reached it (an earlier entry on the same group is blocked)")

    def _stream(self, key: tuple[int, int], q: queue.Queue) -> None:
        rank, gid = key
        while True:
            e = q.get()
            if key in self.failed:
                e.error = self.failed[key]
                e.done.set()
                continue
            try:
                self._execute(rank, gid, e)
            except BaseException as err:  # noqa: BLE001 - handed to the waiter; the stream stays failed (a hang)
                self.failed[key] = err
                e.error = err
            e.done.set()

    def _execute(self, rank: int, gid: int, e: Entry) -> None:
        t = self.transport
        waits = []
        for kind, buf, peer in e.ops:
            if kind == "recv":
                waits.append((t.recv_data(rank, buf, peer, gid), f"the data of its receive from rank {peer}"))
                waits.append((t.send_token(rank, peer, gid, (buf.numel(), DTYPES.index(buf.dtype))),
                              f"its receive's token to rank {peer}"))
        for kind, x, peer in e.ops:
            if kind != "send":
                continue
            self.waiting[(rank, gid)] = (f"its send {tuple(x.shape)} to rank {peer} waits for rank {peer} to post the "
                                         "matching receive (a send does not complete before it)")
            tok = t.recv_token(rank, peer, gid, self.timeout)
            if tok is None:
                raise Deadlock(f"NCCL model: rank {rank}, {e.what}: {self.waiting[(rank, gid)]}; none came in "
                               f"{self.timeout:g} s")
            if tok != (x.numel(), DTYPES.index(x.dtype)):
                raise Mismatch(f"NCCL model: rank {rank} sends {x.numel()} x {x.dtype} to rank {peer}, whose matching "
                               f"receive (posting order, no tags) is {tok[0]} x {DTYPES[tok[1]]}")
            waits.append((t.send_data(rank, x, peer, gid), f"its send to rank {peer}"))
        for w, what in waits:
            self.waiting[(rank, gid)] = f"{what} ({e.what})"
            if not w(self.timeout):
                raise Deadlock(f"NCCL model: rank {rank} waited {self.timeout:g} s for {what} ({e.what})")
        self.waiting.pop((rank, gid), None)


# -- over gloo, in a real rank ---------------------------------------------------------------------------------------

COLLECTIVES = ("all_reduce", "barrier", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
               "reduce_scatter", "all_to_all_single", "all_to_all", "all_gather_object", "broadcast_object_list",
               "reduce", "gather", "scatter", "monitored_barrier")


def install(timeout: float = 60.0) -> None:
    """Replace torch.distributed's point-to-point calls by the model in this process (before init_process_group):
    the model's own gloo group is created right after the default one, every later group gets an id in creation
    order (the same on every rank), and rule 5 is checked."""
    import torch.distributed as dist

    orig = {n: getattr(dist, n) for n in ("isend", "irecv", "send", "recv", "init_process_group", "new_group",
                                          *COLLECTIVES)}
    gids: dict[int, int] = {}
    used_collectively: set[int] = {0}  # the default group: init_process_group's own rendezvous
    state: dict[str, Any] = {}

    def group_id(group: Any) -> int:
        if group is None or group is dist.group.WORLD:
            return 0
        gid = gids.get(id(group))
        if gid is None:
            raise RuntimeError("NCCL model: a process group created before the model was installed")
        return gid

    def first_use(group: Any, gid: int) -> None:
        if gid not in used_collectively:
            raise RuntimeError(f"NCCL model: the first use of process group {gid} is a point-to-point operation; NCCL "
                               "needs a collective of all its ranks first (batch_isend_irecv's note)")

    model = NcclModel(None, lambda: dist.get_rank(), timeout, group_id)
    model.first_use = first_use

    def init_process_group(*a, **k):
        out = orig["init_process_group"](*a, **k)
        shadow = orig["new_group"](backend="gloo")
        model.transport = GlooTransport(orig, shadow)
        state["shadow"] = shadow
        return out

    def new_group(*a, **k):
        g = orig["new_group"](*a, **k)
        gids[id(g)] = len(gids) + 1
        return g

    def collective(name: str):
        fn = orig[name]
        sig = inspect.signature(fn)

        def wrapped(*a, **k):
            group = sig.bind_partial(*a, **k).arguments.get("group")
            try:
                used_collectively.add(group_id(group))
            except RuntimeError:
                pass
            return fn(*a, **k)
        wrapped.__name__ = name
        return wrapped

    dist.init_process_group = init_process_group
    dist.new_group = new_group
    for n in COLLECTIVES:
        setattr(dist, n, collective(n))
    dist.isend, dist.irecv, dist.send, dist.recv = model.isend, model.irecv, model.send, model.recv
    dist.P2POp, dist.batch_isend_irecv = P2POp, model.batch_isend_irecv
    dist._shardkit_nccl_model = model


def report() -> None:
    """Where SHARDKIT_TEST_NCCL_MODEL_LOG names a file and the model is installed: append this rank's counts (one JSON
    line: rank, entries and batches posted), so a test can tell the model carried the run's point-to-point traffic."""
    import json
    import os

    import torch.distributed as dist

    model = getattr(dist, "_shardkit_nccl_model", None)
    path = os.environ.get("SHARDKIT_TEST_NCCL_MODEL_LOG")
    if model is None or not path:
        return
    with open(path, "a") as f:
        f.write(json.dumps({"rank": int(os.environ.get("RANK", "0")), "entries": model.entries,
                            "batches": model.batches}) + "\n")
