"""Native shardkit checkpoints <-> Megatron-LM `--ckpt-format torch_dist` checkpoints, with bounded memory.

write_torch_dist: every stored chunk of the native checkpoint becomes one DCP item in the `.distcp` file of the
Megatron rank that owns it (TP fastest, then the expert ranks, then PP; replicated tensors once, by TP rank 0), plus
the `_extra_state` objects megatron-core's GPTModel asks for on load (None: no FP8 state), `common.pt` (iteration,
checkpoint_version, Megatron-LM's whole `args` namespace) and `metadata.json`, and shardkit's own description beside
them (shardkit.json: model config with the true vocab, layout, dtype, provenance; hf/: config.json and tokenizer
files), so the export reads back with no flags. Keys and global shapes are GPTModel.sharded_state_dict()'s
(= the canonical names, Transformer Engine spec); `key_naming="local"` renames the few keys megatron-core's local
spec names differently. Peak memory: one chunk per writer process, plus the metadata. Given another layout (or
dtype), it writes the destination's chunks straight from the source boxes (vocab padding recomputed): reshard and
export in one pass. A training checkpoint's optimizer state goes under megatron-core's distributed-optimizer keys
(`optimizer.state.{param,exp_avg,exp_avg_sq}.<key>`, sharding type `fully_reshardable`) and train_state.json into
common.pt. No torch import on this path unless a dtype is cast: checkpoint.torch_dist writes torch.save's and DCP's
bytes itself. convert_hf_to_torch_dist (`convert hf-to-mcore --format torch_dist`) writes the same items straight
from the HF shards through hf_to_mcore's chunk worker (stream_torch_dist: no native copy in between); the result is
byte for byte the export of the native conversion.

torch_dist_to_native: every destination chunk is gathered from the stored items that overlap it (one item in memory
at a time, large ones memory-mapped), so any torch_dist checkpoint - Megatron's own per-rank shards included - converts
to any native layout, the items read as numpy views of the mapped files (TorchDistCheckpoint.read_numpy: no
torch.load, no copy where a chunk is one item). Model-space optimizer state
(`optimizer.state.{param|fp32_param,exp_avg,exp_avg_sq}.<key>`, as megatron-core's distributed optimizer saves it with
`fully_reshardable` or `fully_sharded_model_space`) becomes the native optimizer entries; other optimizer objects, RNG
state and `_extra_state` objects are skipped.

Reading one in place (TorchDistSource, `inspect`'s describe_torch_dist, `verify`'s verify_torch_dist) is
checkpoint/torch_dist_view.py.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from checkpoint import store
from checkpoint.commit import LATEST, LOCK, PARTIAL_SUFFIX, IterationWriter, check_output_root, refuse_foreign
from checkpoint.config import ModelConfig
from checkpoint.errors import FormatError, ShardkitError, WriteError
from checkpoint.faults import fault_point
from checkpoint.layout import Layout
from checkpoint.manifest import MANIFEST, TRAIN_STATE, Manifest, TensorEntry, valid_iter_dirname
from checkpoint.megatron import (DEFAULT_MEGATRON_VERSION, KEY_NAMINGS, TRACKER, TRAIN_STATE_KEY, chunk_rank,
                                 check_megatron_version, extra_state_objects, layout_from_args, megatron_common,
                                 stored_key)
from checkpoint.progress import progress_bar
from checkpoint.reader import Checkpoint, ReadPlan, entry_nbytes, read_padded, vocab_padding
from checkpoint.safety import check_output, check_target, is_side_file_name, side_files
from checkpoint.sharding import TensorSpec, split_optimizer_key
from checkpoint.megatron_bridge import write_run_config
from checkpoint.torch_dist import HF_SUBDIR, TorchDistCheckpoint, read_torch_dist
from checkpoint.torch_dist_sidecar import write_sidecar
from checkpoint.torch_dist_write import DCPWriter, RankFile, close_all, none_object_bytes, write_common, write_integrity
from checkpoint.torch_dist_view import (TorchDistSource, import_optimizer_states, match_keys, plan_import,
                                        shape_problems)

from . import distributed
from .hf_to_mcore import VERSION
from .reshard import plan_reshard
from .writer import ChunkSink, Task, Workers, chunk_tasks, refuse_nonfinite, run_in_process, write_chunks

# -- native -> torch_dist ---------------------------------------------------------------------------------------------

def _write_rank(args: tuple, advance: Callable[[int], None] | None = None) -> tuple[dict, int]:
    """Write rank files: their tensor chunks (read one at a time from the native checkpoint, vocab padding and dtype
    of the destination applied) and objects. Several files are written together, their items in the order of the
    source's chunks, so that a source chunk feeding several ranks (a higher TP) is read once (ReadPlan)."""
    ckpt_path, tmp_dir, files, key_naming, pads, dtypes = args
    if "torch" in sys.modules:  # (casts only: the items are written without torch)
        sys.modules["torch"].set_num_threads(1)
    from .reshard import SOURCE_CACHE_BYTES

    ck = Checkpoint(ckpt_path, cache_bytes=SOURCE_CACHE_BYTES)
    w = DCPWriter(Path(tmp_dir))
    nbytes = 0
    order = sorted(((name, box), i) for i, (_, items, _) in enumerate(files) for name, box in items)
    merged = [item for item, _ in order]
    with contextlib.ExitStack() as stack:
        out = [stack.enter_context(w.rank_file(rank, part)) for (rank, part), _, _ in files]
        for ((name, box), i), value in zip(order, _prefetched(ck, merged, pads, w.in_flight.wait_room)):
            value = store.cast(value, dtypes[name], name)
            refuse_nonfinite(name, box, value)  # (issue 34: a checkpoint holding NaN/Inf is not exported)
            n = out[i].add_tensor(stored_key(name, key_naming), tuple(a for a, _ in box), value)
            del value  # the writer thread holds it until written: not this frame while the next one is read
            nbytes += n
            if advance:
                advance(n)
        blob = none_object_bytes()
        for f, (_, _, objects) in zip(out, files):
            for key in objects:
                f.add_bytes(key, blob)
        close_all(out)
    return w.storage_data, nbytes


class _RankWriter:
    """A worker process's rank files (convert.writer.Workers): _write_rank of one job, with its item count."""

    def __call__(self, job: tuple) -> tuple[dict, int, int]:
        return (*_write_rank(job), sum(len(items) for _, items, _ in job[2]))


def _prefetched(ck: Checkpoint, items: list, pads: dict, room: Callable[[int], None] | None = None
                ) -> Iterator[np.ndarray]:
    """The items' values in order (numpy views of the source's chunks where a box lies in one), the chunks read
    ahead on a helper thread (ReadPlan) while the current one is being written. A value that must be gathered into a
    buffer of its own (a box across chunks, or vocab padding) is made only once `room(its bytes)` returns (the rank
    files' writers have room for it: DCPWriter.in_flight), so a gathered value never waits beside a full pipeline."""
    from .reshard import READ_AHEAD_BYTES

    index = [tuple(slice(a, b) for a, b in box) for _, box in items]
    plan = ReadPlan(ck, [(name, idx) for (name, _), idx in zip(items, index)], READ_AHEAD_BYTES)
    try:
        for k, (name, box) in enumerate(items):
            e = ck.entry(name)
            if room is not None and (len(ck.chunks_of(name, index[k])) > 1
                                     or any(b > s for (_, b), s in zip(box, e.shape))):
                room(math.prod(b - a for a, b in box) * store.itemsize(e.dtype))
            value = read_padded(functools.partial(ck.read_numpy, name), name, box, pads.get(name))
            plan.done(name, index[k])
            yield value
            del value  # its chunk's buffer goes back to the pool once written
    finally:
        plan.close()


# Rank files are written together, each by its own thread (checkpoint.torch_dist_write.RankFile): a layout with fewer ranks
# than this splits each rank's items over several files (`__<rank>_<k>.distcp`, as megatron-core's own writer does
# with its thread count), so the crc32s and writes of a small layout run in parallel too.
MIN_FILES = 4


def _parts(per_rank: dict, workers: int = 1) -> int:
    """Files per rank: enough for MIN_FILES files (and one per worker process) in all."""
    return max(-(-MIN_FILES // len(per_rank)), -(-workers // len(per_rank)))


def _split_files(per_rank: dict[int, tuple[list, list]], entries: dict[str, TensorEntry], parts: int
                 ) -> list[tuple[tuple[int, int], list, list]]:
    """Each rank's items in up to `parts` files of similar size (so one rank's shard can be written in parallel);
    which item goes where depends only on the items, not on their order."""
    out = []
    order = {name: i for i, name in enumerate(entries)}
    for rank, (items, objs) in sorted(per_rank.items()):
        n = max(1, min(parts, len(items)))
        bins: list[list] = [[] for _ in range(n)]
        sizes = [0] * n
        for name, box in sorted(items, key=lambda it: (-Task(it[0], (), it[1]).nbytes(entries[it[0]]), it)):
            i = sizes.index(min(sizes))
            bins[i].append((name, box))
            sizes[i] += Task(name, (), box).nbytes(entries[name])
        for k, b in enumerate(bins):
            b.sort(key=lambda it: (order[it[0]], it[1]))
            out.append(((rank, k), b, objs if k == 0 else []))
    return out


def _plan_items(specs: dict[str, TensorSpec], entries: dict[str, TensorEntry], tasks: list[Task], layout: Layout,
                key_naming: str, num_layers: int) -> tuple[dict[int, tuple[list, list]], list[tuple], int]:
    """Which rank file every item goes to: (rank -> ([(canonical name, box)], [object keys]), the declarations of
    DCP's metadata (tensor: key, global shape, dtype, chunks; object: key), total bytes of the tensor items)."""
    per_rank: dict[int, tuple[list, list]] = {}
    chunks: dict[str, list] = {n: [] for n in entries}
    total = 0
    for t in tasks:
        r = chunk_rank(specs[t.name], layout, t.box, num_layers)
        per_rank.setdefault(r, ([], []))[0].append((t.name, t.box))
        chunks[t.name].append((tuple(a for a, _ in t.box), tuple(b - a for a, b in t.box)))
        total += t.nbytes(entries[t.name])
    declared: list[tuple] = []
    for name, spec in specs.items():
        declared.append((stored_key(name, key_naming), spec.shape, entries[name].dtype, chunks[name]))
        if split_optimizer_key(name) is None:
            for key, r in extra_state_objects(spec, layout, num_layers):
                declared.append((key,))
                per_rank.setdefault(r, ([], []))[1].append(key)
    return per_rank, declared, total


def _declare(w: DCPWriter, declared: list[tuple]) -> None:
    for d in declared:
        if len(d) > 1:
            w.declare_tensor(*d)
        else:
            w.declare_object(d[0])


def write_torch_dist(ckpt: Checkpoint | str | Path, out_root: str | Path, *, key_naming: str = "te",
                     overwrite: bool = False, quiet: bool = False, workers: int | None = None,
                     layout: Layout | None = None, dtype: str | None = None, skip_verify: bool = False,
                     group=None, estimate_above: int | None = None,
                     megatron_version: str = DEFAULT_MEGATRON_VERSION, integrity: bool = False) -> Path:
    """Write `<out_root>/iter_N` (N = the native checkpoint's iteration) as a Megatron-LM torch_dist checkpoint and
    point `latest_checkpointed_iteration.txt` at it; returns the iteration directory.

    At the checkpoint's own layout each stored chunk becomes one item; for another `layout` (or `dtype`, which casts
    model weights only) the items are the destination's chunks, read from the source boxes they cover with the vocab
    padding recomputed, in one pass. Optimizer state goes under megatron-core's distributed-optimizer keys, and
    train_state.json into common.pt (see _common). No torch import unless a dtype is cast (checkpoint.torch_dist
    writes torch.save's and DCP's bytes itself). With `group` (one rank of several, convert.distributed) this rank
    writes its share of the rank files and rank 0 commits (_write_files); the source is checked by rank 0 alone."""
    check_output(out_root, [("source", ckpt.path if isinstance(ckpt, Checkpoint) else ckpt)])
    check_megatron_version(megatron_version)
    ck = ckpt if isinstance(ckpt, Checkpoint) else Checkpoint(ckpt, check=not skip_verify and distributed.leads(group))
    _check_key_naming(key_naming)
    if ck.manifest.fp8:
        raise ShardkitError(f"{ck.path}: keeps block-FP8 weights with separate scales, which torch_dist has no key "
                            "for; dequantize first (convert hf-to-mcore without --keep-fp8)")
    cfg, optim = ck.config, ck.manifest.optimizer
    src_specs = Manifest(0, cfg, ck.layout, {}, optimizer=optim).specs()
    if {s.name for s in src_specs} != set(ck.tensors):
        names = {s.name for s in src_specs}
        missing, extra = sorted(names - set(ck.tensors)), sorted(set(ck.tensors) - names)
        raise FormatError(f"{ck.path}: tensors disagree with the model config (missing {missing[:3]}, unexpected "
                          f"{extra[:3]})")
    dtype = store.dtype_name(dtype) if dtype else None
    if layout is None or (layout == ck.layout and dtype is None):
        layout, entries, pads = ck.layout, ck.tensors, {}  # the stored chunks as they are
    else:
        entries = plan_reshard(ck, layout, dtype)
        pads = vocab_padding(cfg, layout, optim)
    specs = {s.name: s for s in Manifest(0, cfg, layout, {}, optimizer=optim).specs()}
    tasks = chunk_tasks(entries)
    dtypes = {n: e.dtype for n, e in entries.items()}
    per_rank, declared, total = _plan_items(specs, entries, tasks, layout, key_naming, cfg.num_layers)
    m = ck.manifest
    ts_path = ck.train_state_path()
    common = _common(cfg, layout, key_naming, dtype, m.iteration, optim, ts_path.read_text() if ts_path else None,
                     ts_path)
    provenance = {"tool": f"shardkit {VERSION}", "command": "torch_dist export",
                  "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                  "source": {"kind": "shardkit", "path": str(ck.path.resolve()), "iteration": m.iteration,
                             "layout": ck.layout.to_dict(), "provenance": m.provenance}}

    iteration = m.iteration
    # One process with reads prefetched keeps the disk busy; each spawned worker first spends seconds importing
    # torch, which only pays off with idle cores: opt in with --workers (as for the native writers).
    nworkers = max(1, workers or 1)
    files = _split_files(per_rank, entries, _parts(per_rank, nworkers))
    job = {"kind": "torch_dist-export", "tool": VERSION, "source": str(ck.path.resolve()),
           "source_manifest": hashlib.sha256(m.to_json().encode()).hexdigest(), "layout": layout.to_dict(),
           "dtype": dtype, "key_naming": key_naming, "files": len(files)}
    path = None
    # resumable (the rank files recorded durable are kept), committed like every other write (checkpoint.commit)
    with distributed.open_writer(out_root, iteration, job, overwrite, group, pointer=(TRACKER, f"{iteration}\n")) as w:
        def write(mine: list, bar) -> dict:
            n = min(nworkers, len(mine))
            if n == 1:  # every file at once, in the source's chunk order
                return _write_rank((str(ck.path), str(w.partial), mine, key_naming, pads, dtypes),
                                   advance=lambda k: bar.advance(k, 1))[0]
            storage: dict = {}
            jobs = [(str(ck.path), str(w.partial), [f], key_naming, pads, dtypes) for f in mine]
            with Workers(_RankWriter, (), n) as pool:
                for part, nbytes, items in pool.run(jobs):
                    storage.update(part)
                    bar.advance(nbytes, items)
            return storage

        storage = _write_files(w, files, entries, write, group=group, label="torch_dist", quiet=quiet,
                               estimate_above=estimate_above)
        if distributed.leads(group):
            w_meta = DCPWriter(w.partial)
            _declare(w_meta, declared)
            w_meta.storage_data.update(storage)
            assets = side_files(ck.hf_dir())  # known tokenizer / generation names only, never links
            _finish(w, w_meta, common, cfg, layout, entries, key_naming, iteration, optim, provenance, assets,
                    megatron_version, integrity)
            path = w.commit(None)
    return distributed.finish(group, path, out_root)


# -- the rank files across processes and runs --------------------------------------------------------------------------

FILE_DONE = "distcp:"  # a resume-log line: `distcp:<file>=<its items' storage entries as JSON>`, once it is durable


def _file_name(f: tuple) -> str:
    (rank, part), _, _ = f
    return f"__{rank}_{part}.distcp"


def _file_line(name: str, storage: dict) -> str:
    """The resume-log line of a durable rank file: its items' DCP storage entries (key, offsets; start, length)."""
    items = sorted(([key, None if off is None else list(off), start, length]
                    for (key, off), (rel, start, length) in storage.items() if rel == name), key=lambda it: it[2])
    return f"{FILE_DONE}{name}={json.dumps(items, separators=(',', ':'))}"


def _recorded_files(lines) -> dict[str, dict]:
    """The rank files that resume-log lines record as durable: file -> its storage entries ((key, offsets) -> (file,
    start, length)), as DCPWriter.storage_data has them. A line torn by a crash records nothing (its JSON is cut)."""
    out: dict[str, dict] = {}
    for ln in lines:
        if not ln.startswith(FILE_DONE):
            continue
        name, _, body = ln[len(FILE_DONE):].partition("=")
        try:
            out[name] = {(key, None if off is None else tuple(off)): (name, int(start), int(length))
                         for key, off, start, length in json.loads(body)}
        except (ValueError, TypeError, RecursionError):
            continue
    return out


def _write_files(w, files: list[tuple], entries: dict[str, TensorEntry], write: Callable[[list, object], dict], *,
                 group, label: str, quiet: bool, estimate_above: int | None = None) -> dict:
    """Write the rank files `files` (_split_files) that no earlier run recorded: `write(mine, bar)` writes the files
    `mine` whole (each item shown on `bar`) and returns their storage entries; each file is then recorded in this
    process's resume log with its entries (FILE_DONE). A file is the unit (an item's offset depends on the items
    before it): a rerun keeps the recorded files and writes the others again, whatever the number of ranks.

    With `group` (one rank of several, convert.distributed) every rank writes its share of the files left (balanced
    by bytes, the same on every rank), fsyncs and records them; rank 0 learns every rank's entries from their reports
    (and the logs of earlier runs, never by reading the files), checks that every file is there with its recorded
    length (a directory the nodes do not share is named), and returns every file's entries for DCP's .metadata.
    The other ranks return {}. A job with at least `estimate_above` bytes left prints the expected time first
    (convert.distributed.announce_estimate, as write_chunks does)."""
    lead = distributed.leads(group)
    names = [_file_name(f) for f in files]
    size = {n: sum(Task(k, (), box).nbytes(entries[k]) for k, box in items) for n, (_, items, _) in zip(names, files)}
    count = {n: len(items) for n, (_, items, _) in zip(names, files)}
    total = sum(size.values())
    if lead:
        recorded = _recorded_files(w.done)
        distributed.clear_probes(w.partial)
        w.reserve(total, sum(size[n] for n in names if n not in recorded))  # before anything is written
    if group is not None:  # rank 0 has taken the lock and prepared the partial output
        distributed.join_output(group, w, lambda: [n for n in names if n not in _recorded_files(w.done)], len(names),
                                "rank files")
    recorded = _recorded_files(w.done)
    todo = [f for n, f in zip(names, files) if n not in recorded]
    mine = todo if group is None else distributed.share(todo, lambda f: size[_file_name(f)], _file_name, group.rank,
                                                        group.world)
    left = sum(size[_file_name(f)] for f in todo)  # the same on every rank
    if left and left >= (distributed.ESTIMATE_ABOVE if estimate_above is None else estimate_above):
        distributed.announce_estimate(w, left, group, quiet)
    resumed = len(files) - len(todo)
    if resumed and lead and not quiet:
        print(f"resuming: {resumed} of {len(files)} rank files already written", file=sys.stderr)
    reports: list[list[str]] = []
    with progress_bar(label, total=total, items=sum(count.values()), disable=quiet or not lead) as shown:
        bar = shown if group is None else group.progress(shown)
        if lead:
            bar.advance(sum(size[n] for n in recorded), sum(count[n] for n in recorded))
        if mine:
            storage = write(mine, bar)  # every file written is durable (RankFile.close fsyncs it)
            lines = [_file_line(_file_name(f), storage) for f in mine]
            fault_point("chunk.unrecorded")
            try:
                w.mark_done_many(lines)
            except OSError as e:
                raise WriteError(f"{w.partial}: recording finished rank files in its resume log failed "
                                 f"({e.strerror or e})") from None
            for _ in lines:
                fault_point("chunk")
        if group is not None:
            reports = distributed.report_done(group, w, "rank files")
    if not lead:
        return {}
    found = {n: "an earlier run" for n in recorded}
    every = dict(recorded)
    for r, lines in enumerate(reports or [list(w.written)]):
        for n, st in _recorded_files(lines).items():
            every[n] = st
            found[n] = f"rank {r}" if group is not None else "this process"
    missing = [n for n in names if n not in every]
    if missing:
        raise WriteError(f"{w.partial}: {len(missing)} rank file(s) no rank recorded as written (e.g. {missing[0]}); "
                         "nothing was committed; rerun to write them")
    storage: dict = {}
    for n in names:
        end = max((start + length for _, start, length in every[n].values()), default=0)
        path = w.partial / n
        if not path.is_file() or path.stat().st_size != end:
            raise WriteError(f"{path}: {found[n]} recorded this rank file as written ({end:,} bytes), but rank 0 does "
                             f"not find it so in {w.partial}: the output directory must be on a filesystem every "
                             "node shares; nothing was committed")
        storage.update(every[n])
    if group is not None and not quiet:
        wrote = [len(_recorded_files(lines)) for lines in reports]
        print(f"{label}: {group.world} ranks wrote {' + '.join(map(str, wrote))} rank files"
              + (f" ({resumed} already written)" if resumed else ""), file=sys.stderr)
    return storage


def _check_key_naming(key_naming: str) -> None:
    if key_naming not in KEY_NAMINGS:
        raise ShardkitError(f"--key-naming {key_naming!r}: use 'te' (Transformer Engine spec, Megatron-LM's default) "
                            "or 'local' (megatron-core's local spec)")


def _finish(w: IterationWriter, meta: DCPWriter, common: dict, cfg: ModelConfig, layout: Layout,
            entries: dict[str, TensorEntry], key_naming: str, iteration: int, optimizer: list[str] | None,
            provenance: dict, assets: list[Path], megatron_version: str = DEFAULT_MEGATRON_VERSION,
            integrity: bool = False) -> None:
    """Everything of an export but the items: Megatron's common state (in the layout of `megatron_version`) and
    metadata.json, DCP's .metadata, shardkit's description, and last, with `integrity` (--verify-integrity, as
    Megatron-LM's save), integrity.json over all of them (one more read of every file: off by default, as
    Megatron's)."""
    write_common(w.partial, common, meta, megatron_version)
    meta.write_metadata(str(w.final))
    _write_description(w.partial, cfg, layout, entries, key_naming, iteration, optimizer, provenance, assets)
    if integrity:
        write_integrity(w.partial)


class _DCPSink:
    """A ChunkSink's place in a converter's worker (convert.writer): each chunk it is handed becomes one DCP item,
    appended to a file of the Megatron rank that owns it (files open together, items in task order)."""

    def __init__(self, files: list[RankFile], owner: dict[tuple, tuple[int, str]], dtypes: dict[str, str],
                 advance: Callable[[int], None]):
        self.files, self.owner, self.dtypes, self.advance = files, owner, dtypes, advance

    def write(self, task: Task, value) -> tuple[str, int]:
        i, key = self.owner[(task.name, task.box)]
        n = self.files[i].add_tensor(key, tuple(a for a, _ in task.box),
                                     store.cast(value, self.dtypes[task.name], task.name))
        self.advance(n)
        return task.id, n


def stream_torch_dist(out_root: str | Path, *, cfg: ModelConfig, layout: Layout, entries: dict[str, TensorEntry],
                      make: Callable, args: Callable[[Path], tuple], key_naming: str, overwrite: bool, quiet: bool,
                      provenance: dict, assets: list[Path], job: dict, label: str = "torch_dist",
                      group=None, estimate_above: int | None = None,
                      before_commit: Callable[[], None] | None = None,
                      megatron_version: str = DEFAULT_MEGATRON_VERSION, integrity: bool = False) -> Path:
    """`--format torch_dist` for a converter with no native checkpoint in between: its worker (`make(*args)`, a
    convert.writer worker, `args` a function of the partial output directory; called with a Task, it computes the
    chunk and hands it to its `sink`) writes every chunk of `entries` (the native layout's chunks, one DCP item each,
    as write_torch_dist makes of a native checkpoint) straight into the rank files; then .metadata, common.pt and
    shardkit's files, committed like every export. One process, the next chunk's source read ahead (the worker's
    `prefetch`) while this one is written. The items equal those of an export of the native checkpoint the converter
    would have written (same files, same order, same bytes). `job` identifies the conversion (job.json): a rerun of
    the same one keeps the rank files recorded durable. With `group` (one rank of several) this rank writes its share
    of the rank files, reading only the source regions their chunks need, and rank 0 commits (_write_files)."""
    _check_key_naming(key_naming)
    check_megatron_version(megatron_version)
    specs = {s.name: s for s in Manifest(0, cfg, layout, {}).specs()}
    tasks = sorted(chunk_tasks(entries), key=lambda t: (t.name, t.box))  # write_torch_dist's order: the same files
    per_rank, declared, total = _plan_items(specs, entries, tasks, layout, key_naming, cfg.num_layers)
    parts = _split_files(per_rank, entries, _parts(per_rank))
    common = _common(cfg, layout, key_naming, None, 0, None, None, None)
    dtypes = {n: e.dtype for n, e in entries.items()}
    job = {**job, "key_naming": key_naming, "files": len(parts)}
    path = None
    with distributed.open_writer(out_root, 0, job, overwrite, group, pointer=(TRACKER, "0\n")) as w:
        def write(mine: list, bar) -> dict:
            local = DCPWriter(w.partial)
            owner = {(name, box): (i, stored_key(name, key_naming)) for i, (_, items, _) in enumerate(mine)
                     for name, box in items}
            with contextlib.ExitStack() as stack, Workers(make, args(w.partial), 1) as pool:
                files = [stack.enter_context(local.rank_file(rank, part)) for (rank, part), _, _ in mine]
                pool.local.sink = _DCPSink(files, owner, dtypes, lambda n: bar.advance(n, 1))
                run_in_process(pool.local, [t for t in tasks if (t.name, t.box) in owner])
                blob = none_object_bytes()
                for f, (_, _, objects) in zip(files, mine):
                    for key in objects:
                        f.add_bytes(key, blob)
                close_all(files)
            return local.storage_data

        storage = _write_files(w, parts, entries, write, group=group, label=label, quiet=quiet,
                               estimate_above=estimate_above)
        if distributed.leads(group):
            meta = DCPWriter(w.partial)
            _declare(meta, declared)
            meta.storage_data.update(storage)
            if before_commit is not None:  # e.g. the source is still the one the conversion read (issue 34)
                before_commit()
            _finish(w, meta, common, cfg, layout, entries, key_naming, 0, None, provenance, assets, megatron_version,
                    integrity)
            path = w.commit(None)
    return distributed.finish(group, path, out_root)


def convert_hf_to_torch_dist(hf_dir: str | Path, out: str | Path, layout: Layout, *, dtype: str | None = None,
                             key_naming: str = "te", overwrite: bool = False, quiet: bool = False,
                             allow_nonfinite: bool = False, group=None, estimate_above: int | None = None,
                             megatron_version: str = DEFAULT_MEGATRON_VERSION, integrity: bool = False,
                             make_vocab_size_divisible_by: int | None = None) -> Path:
    """`convert hf-to-mcore --format torch_dist`: HF safetensors straight into a torch_dist `<out>/iter_0000000`
    (hf_to_mcore's plan and chunk worker, stream_torch_dist's rank files; no native checkpoint in between). The items
    are the chunks the native conversion writes, so the result equals the export of that conversion. With `group`
    (one rank of several, convert.distributed) this rank writes its share of the rank files and rank 0 commits."""
    from checkpoint.hf_source import HFSource, find_assets
    from .hf_to_mcore import _jsonable, _without_absent_mtp, _Worker, plan, source_unchanged

    hf_dir = Path(hf_dir)
    check_output(out, [("HF_DIR", hf_dir)])  # never over, inside or around the source
    _check_key_naming(key_naming)
    cfg = ModelConfig.from_hf_dir(hf_dir)
    n = make_vocab_size_divisible_by
    if n is not None:  # Megatron-LM's --make-vocab-size-divisible-by (the model config's, recorded in the args)
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 1 << 16:
            raise ShardkitError(f"--make-vocab-size-divisible-by {n!r}: expected a whole number from 1 to 65536")
        cfg = dataclasses.replace(cfg, make_vocab_size_divisible_by=n)
    layout.check(cfg)
    dtype = store.dtype_name(dtype) if dtype else None
    src = HFSource(hf_dir)
    cfg = _without_absent_mtp(cfg, src, quiet)
    entries, _, _ = plan(cfg, layout, src, dtype, quiet=quiet)
    dtypes = {n: e.dtype for n, e in entries.items()}
    provenance = {"tool": f"shardkit {VERSION}", "command": "convert hf-to-mcore --format torch_dist",
                  "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                  "source": {"kind": "hf", "path": str(hf_dir.resolve()), "files": src.fingerprint()}}
    job = {"kind": "hf-to-torch_dist", "tool": VERSION, "source": str(hf_dir.resolve()),
           "files": src.resume_fingerprint(),
           "layout": layout.to_dict(), "dtype": dtype, "model": _jsonable(cfg.to_dict())}
    return stream_torch_dist(out, cfg=cfg, layout=layout, entries=entries, make=_Worker,
                             args=lambda partial: (str(hf_dir), cfg.to_dict(), layout.to_dict(), str(partial), dtypes,
                                                   None, allow_nonfinite),
                             key_naming=key_naming, overwrite=overwrite, quiet=quiet, provenance=provenance,
                             assets=find_assets(hf_dir), job=job, label="hf-to-torch_dist", group=group,
                             before_commit=lambda: source_unchanged(src, job["files"]),
                             estimate_above=estimate_above, megatron_version=megatron_version, integrity=integrity)


def _write_description(directory: Path, cfg: ModelConfig, layout: Layout, entries: dict[str, TensorEntry],
                       key_naming: str, iteration: int, optimizer: list[str] | None, provenance: dict,
                       assets: list[Path]) -> None:
    """shardkit's own files beside Megatron's (which Megatron-LM and megatron-core never read): shardkit.json (the
    model config with the true vocab, layout, dtype, provenance) and hf/ (config.json for the weights' dtype, the
    tokenizer and generation files `assets`), so every shardkit command reads the export back with no flags."""
    weights: dict[str, int] = {}
    for name, e in entries.items():
        if split_optimizer_key(name) is None:
            weights[e.dtype] = weights.get(e.dtype, 0) + entry_nbytes(e)
    dtype = max(weights, key=weights.get)
    write_sidecar(directory, iteration=iteration, model=cfg, layout=layout, dtype=dtype, key_naming=key_naming,
                  optimizer=optimizer, provenance=provenance)
    write_run_config(directory, cfg, layout, dtype)  # for Megatron-Bridge
    hf = directory / HF_SUBDIR
    hf.mkdir(exist_ok=True)
    for asset in assets:  # from side_files / find_assets: allowlisted names, regular files
        if asset.name != "config.json" and is_side_file_name(asset.name):
            check_target(hf / asset.name, "side file", ours=True)
            shutil.copyfile(asset, hf / asset.name)
    (hf / "config.json").write_text(json.dumps(cfg.to_hf(dtype=dtype), indent=2) + "\n")


def _common(cfg: ModelConfig, layout: Layout, key_naming: str, dtype: str | None, iteration: int,
            optimizer: list[str] | None, train_state: str | None, train_state_path: Path | None = None) -> dict:
    """Megatron's common state of an export (checkpoint.megatron.megatron_common): with optimizer state, Megatron's own
    entries are filled from train_state.json (`train_state`, its text) where it has them (`optimizer.param_groups`
    (+ `optimizer.step`), `scheduler`, `consumed_samples`), and the file itself rides along verbatim."""
    state = None
    if train_state is not None:
        try:
            state = json.loads(train_state)
        except (ValueError, RecursionError):
            raise FormatError(f"{train_state_path or 'train_state.json'}: not valid JSON; the checkpoint is "
                              "damaged") from None
    groups = sched = consumed = None
    if isinstance(state, dict):
        opt = state.get("optimizer")
        if optimizer and isinstance(opt, dict) and isinstance(opt.get("param_groups"), list):
            groups = [dict(g) for g in opt["param_groups"] if isinstance(g, dict)]
            step = opt.get("step")
            for g in groups:
                g.pop("params", None)
                if step is not None:
                    g.setdefault("step", step)
        sched, consumed = state.get("scheduler"), state.get("consumed_samples")
    return megatron_common(cfg, layout, key_naming, dtype, iteration, optimizer=bool(optimizer), param_groups=groups,
                           scheduler=sched, consumed_samples=consumed, train_state=train_state)


def _ours(staging: Path) -> bool:
    """`staging` holds only what a native write leaves: `latest`, its lock, iteration directories (committed ones
    with their manifest, `.partial` ones) and nothing else, so removing it touches no file shardkit did not write."""
    for p in staging.iterdir():
        if p.name in (LATEST, LOCK, f".{LATEST}.tmp") and p.is_file() and not p.is_symlink():
            continue
        name = p.name
        for prefix, suffix in (("", PARTIAL_SUFFIX), (".", ".old")):  # a write in progress, a commit's old copy
            if name.startswith(prefix) and name.endswith(suffix):
                name = name[len(prefix):-len(suffix)]
                break
        if not (valid_iter_dirname(name) and p.is_dir() and not p.is_symlink()
                and (p.name != name or (p / MANIFEST).is_file())):
            return False
    return True


def staged_across_ranks(out: Path, group, produce: Callable[[Path], Path], consume: Callable[[Path], Path]) -> Path:
    """A two-step job across ranks through a native staging checkpoint every rank names alike (`.<out>.native-
    staging` beside `out`; a failed job leaves it for the rerun to resume): `produce(staging)` writes it (its share on
    each rank), then `consume(native)` reads it. Rank 0 removes one that an earlier run committed (its second step
    failed after) and, at the end, this run's; a directory of that name holding anything a native write does not
    leave is refused (one line), never removed."""
    staging = out.parent / f".{out.name}.native-staging"
    if group.rank == 0:
        out.parent.mkdir(parents=True, exist_ok=True)
        if staging.exists() and (not staging.is_dir() or staging.is_symlink() or not _ours(staging)):
            raise ShardkitError(f"{staging}: holds files shardkit's staging checkpoint does not; it is this job's "
                                "staging directory: move it away and rerun")
        if (staging / LATEST).exists():
            shutil.rmtree(staging)
    native = produce(staging)
    group.next_phase()
    path = consume(native)
    if group.rank == 0 and staging.is_dir() and _ours(staging):  # every rank has finished (they all heard of the second step's end)
        shutil.rmtree(staging, ignore_errors=True)
    return path


def via_native(produce: Callable[[Path], Path], out: str | Path, *, key_naming: str = "te", overwrite: bool = False,
               quiet: bool = False, workers: int | None = None, group=None,
               megatron_version: str = DEFAULT_MEGATRON_VERSION, integrity: bool = False) -> Path:
    """`--format torch_dist` for a command that writes a native checkpoint: `produce(staging_root)` writes it into a
    staging directory next to `out` (same filesystem; needs the model's size in free space once more), which is
    exported to `out` and then removed. Returns the torch_dist iteration directory.

    With `group` (one rank of several) both writes run across the ranks (`produce` writes its share: it is given
    the group too), in a staging directory every rank names alike (`.<out>.native-staging`); a failed job leaves it
    for the rerun to resume, a staging checkpoint already committed by an earlier run is written afresh."""
    out = Path(out)
    if key_naming not in KEY_NAMINGS:
        raise ShardkitError(f"--key-naming {key_naming!r}: use 'te' or 'local'")
    check_megatron_version(megatron_version)
    check_output_root(out, overwrite)  # fail before the expensive part
    refuse_foreign(out, TRACKER)  # (a tracker of the user's; the iteration itself is checked when it is written)
    if group is not None:
        return staged_across_ranks(out, group, produce, lambda native: write_torch_dist(
            native, out, key_naming=key_naming, overwrite=overwrite, quiet=quiet, workers=workers, group=group,
            megatron_version=megatron_version, integrity=integrity))
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.native-", dir=out.parent))
    try:
        native = produce(staging)
        return write_torch_dist(native, out, key_naming=key_naming, overwrite=overwrite, quiet=quiet, workers=workers,
                                megatron_version=megatron_version, integrity=integrity)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


# -- torch_dist -> native ---------------------------------------------------------------------------------------------

class _ImportWorker:
    """Writes native chunks gathered from a torch_dist checkpoint's items (convert.writer.Workers)."""

    def __init__(self, td_path: str, keys: dict[str, str], vocab: dict[str, int], out_dir: str,
                 dtypes: dict[str, str]) -> None:
        if "torch" in sys.modules:  # (no torch import: items are read as numpy views, torch.load only as a fallback)
            sys.modules["torch"].set_num_threads(1)
        self.td = TorchDistCheckpoint(td_path)
        self.td.spool_dir = Path(out_dir)  # large items are memory-mapped from a copy on the output's disk
        self.keys, self.vocab, self.sink = keys, vocab, ChunkSink(out_dir, dtypes)

    def __call__(self, task: Task) -> tuple[str, int]:
        key = self.keys[task.name]
        # numpy views of the memory-mapped items (no torch.load, no copy where a chunk is one item)
        value = read_padded(lambda idx: self.td.read_numpy(key, tuple((s.start, s.stop) for s in idx)), task.name,
                            task.box, self.vocab.get(task.name))
        return self.sink.write(task, value)


def torch_dist_to_native(path: str | Path, out: str | Path, cfg: ModelConfig | None = None,
                         layout: Layout | None = None, *, dtype: str | None = None, hf_dir: str | Path | None = None,
                         workers: int | None = None, overwrite: bool = False, quiet: bool = False,
                         vocab_size: int | None = None, group=None, estimate_above: int | None = None) -> Path:
    """Convert the model weights of a torch_dist checkpoint into a native checkpoint `<out>/iter_N` for `layout`
    (default: the layout in its Megatron-LM args, else tp=pp=1). `cfg` describes the model (e.g.
    ModelConfig.from_hf_dir); None: the checkpoint's own description (TorchDistCheckpoint.model_config: `hf_dir`,
    else a shardkit export's shardkit.json, else its Megatron args with `vocab_size`). Tokenizer files come from
    `hf_dir`, else from a shardkit export's own hf/. With `group` (one rank of several, convert.distributed) this rank
    writes its share of the chunks, reading only the items they overlap, and rank 0 commits. A job with at least
    `estimate_above` bytes prints the expected time first (convert.writer.write_chunks)."""
    check_output(out, [("source", path), ("--hf-config", hf_dir)])
    td = read_torch_dist(path)
    origin = "the model config"
    if cfg is None:
        cfg, origin = td.model_config(hf_dir, vocab_size)
    if not quiet and distributed.leads(group):
        for note in td.notes:
            print(f"shardkit: note: {note}", file=sys.stderr)
    layout = layout or layout_from_args(td.args) or Layout()
    try:
        layout.check(cfg)
    except ShardkitError:
        if layout == layout_from_args(td.args):  # the source's layout does not fit as a default: fall back
            layout = Layout()
            layout.check(cfg)
        else:
            raise
    dtype = store.dtype_name(dtype) if dtype else None
    optimizer = import_optimizer_states(td) or None
    entries, keys = plan_import(td, cfg, layout, dtype, optimizer, origin)
    vocab = vocab_padding(cfg, layout, optimizer)
    from checkpoint.hf_source import content_fingerprint

    md = td.path / ".metadata"
    st = md.stat()
    # the resume record covers every file the chunks come from (issue 34: a .distcp rewritten under an unchanged
    # .metadata resumed the old chunks): identity and sampled content, as convert hf-to-mcore's
    job = {"tool": VERSION, "source": str(td.path.resolve()), "metadata": [st.st_size, st.st_mtime_ns],
           "files": {name: content_fingerprint(td.path / name) for name in [".metadata", *td.files()]},
           "layout": layout.to_dict(), "dtype": dtype, "model": json.loads(json.dumps(cfg.to_dict()))}
    started = time.time()
    iteration = td.iteration
    assets = hf_dir if hf_dir is not None else td.hf_dir()
    path = None
    with distributed.open_writer(out, iteration, job, overwrite, group) as w:
        args = (str(td.path), keys, vocab, str(w.partial), {n: e.dtype for n, e in entries.items()})
        write_chunks(w, entries, "torch_dist-to-mcore", _ImportWorker, args, workers, quiet, group=group,
                     estimate_above=estimate_above)
        if not distributed.leads(group):
            return distributed.finish(group, None, out)
        if assets is not None:
            from checkpoint.hf_source import copy_assets

            copy_assets(assets, w.path("hf"))  # tokenizer / generation files (config.json is the manifest's)
        carried = (td.common or {}).get(TRAIN_STATE_KEY)
        if isinstance(carried, str):  # written by shardkit's export: back verbatim
            w.path(TRAIN_STATE).write_text(carried)
        source = {"kind": "torch_dist", "path": str(td.path.resolve()), "iteration": iteration, "notes": td.notes,
                  "model_from": origin}
        if td.sidecar is not None:
            source["shardkit"] = td.sidecar["provenance"]
        manifest = Manifest(
            iteration=iteration, model=cfg, layout=layout, tensors=entries, optimizer=optimizer,
            provenance={"tool": f"shardkit {VERSION}", "command": "convert torch-dist-to-mcore",
                        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                        "source": source, "seconds": round(time.time() - started, 3)})
        path = w.commit(manifest)
    return distributed.finish(group, path, out)


__all__ = ["write_torch_dist", "via_native", "torch_dist_to_native", "read_torch_dist", "stored_key",
           "match_keys", "shape_problems", "plan_import", "TorchDistSource", "chunk_rank", "extra_state_objects"]
