"""Training checkpoints in the native format: every rank reads and writes only its own regions, through the sharding
table, so a checkpoint saved at one layout loads at any other (after `shardkit reshard`, or directly: reading is by
region, not by file).

Saving is parallel and atomic: rank 0 opens `<root>/iter_N.partial` (checkpoint.commit.IterationWriter) and creates
every array chunked exactly as the converters chunk (chunk_shape: inside one rank's region, so a chunk never has two
writers); each parameter's owner (the DP rank whose optimizer shard holds it; TP rank 0 for TP-replicated tensors)
writes the weight's and its optimizer state's chunk files with the converters' writer (chunkio.ChunkWriter); after a
barrier rank 0 writes train_state.json and the manifest and renames the directory into place, `latest` last. With
--async-save this rank's chunks are copied first, and the writing, the waiting and the commit run in a background
thread on a process group of their own.
"""
from __future__ import annotations

import base64
import itertools
import json
import random
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from checkpoint import chunkio, store
from checkpoint.commit import PARTIAL_SUFFIX, IterationWriter
from checkpoint.config import ModelConfig
from checkpoint.errors import FormatError, WriteError
from checkpoint.faults import fault_point
from checkpoint.layout import Layout, RankCoord
from checkpoint.manifest import MANIFEST, Manifest, TensorEntry, iter_dirname, tensor_path
from checkpoint.reader import Checkpoint, entry_nbytes
from checkpoint.sharding import (OPTIMIZER_STATES, TensorSpec, local_shape, optimizer_key, optimizer_specs, owner,
                                 regions)
from checkpoint.families import model_specs
from train.model import canonical_name
from train.optim import DistributedOptimizer
from train.parallel.groups import Groups

TRAIN_STATE = "train_state.json"


@dataclass(frozen=True)
class LocalParam:
    """A parameter of this rank and where it sits in its canonical tensor."""

    name: str  # the module's parameter name (global layer index inside)
    param: nn.Parameter
    spec: TensorSpec
    index: int | None  # position on the stacked layer axis of this rank's local tensor (None: not stacked)
    tied_copy: bool = False  # the last stage's copy of a tied embedding: read, never written
    vstage: int = 0  # the model chunk (--vpp) whose local tensor holds it
    expert: int | None = None  # one local expert of a stacked expert tensor (megatron-core's per-expert weights)

    def of(self, local: torch.Tensor) -> torch.Tensor:
        """This parameter's part of its model chunk's local tensor."""
        t = local if self.index is None else local[self.index]
        return t if self.expert is None else t[self.expert]


def param_table(model: nn.Module, cfg: ModelConfig, layout: Layout, groups: Groups) -> list[LocalParam]:
    specs = {s.name: s for s in model_specs(cfg, layout)}
    stacked = not cfg.heterogeneous
    chunk_start = {}  # global layer -> (model chunk, its first layer) on this pipeline rank
    for v in range(layout.vpp):
        start, stop = layout.layer_range(cfg.num_layers, groups.pp_rank, v)
        chunk_start.update({i: (v, start) for i in range(start, stop)})
    out = []
    for name, p in model.named_parameters():
        cname, layer = canonical_name(name, stacked)
        if cname not in specs:
            raise FormatError(f"parameter {name}: no canonical tensor {cname} in the sharding table")
        spec = specs[cname]
        want = local_shape(spec, layout)[1 if layer is not None else 0:]  # a stacked layer: one layer of it
        if tuple(p.shape) != want:
            raise FormatError(f"parameter {name}: local shape {list(p.shape)}, but the sharding table gives "
                              f"{cname} the local shape {list(want)} at tp={layout.tp} pp={layout.pp} ep={layout.ep}")
        tied_copy = spec.stage == "first" and not groups.first_stage
        if layer is not None:
            v, start = chunk_start[layer]
            out.append(LocalParam(name, p, spec, layer - start, tied_copy, v))
        else:
            out.append(LocalParam(name, p, spec, None, tied_copy, owner(spec, layout, cfg.num_layers)[1]))
    return out


def _coord(lp: LocalParam, groups: Groups) -> RankCoord:
    # the tied embedding's copy on the last stage reads the first stage's regions
    return RankCoord(tp=groups.tp_rank, pp=0) if lp.tied_copy else groups.coord


def _by_tensor(table: list[LocalParam]) -> dict[str, list[LocalParam]]:
    out: dict[str, list[LocalParam]] = {}
    for lp in table:
        out.setdefault(lp.spec.name, []).append(lp)
    return out


def _local(ck: Checkpoint, key: str, layout: Layout, coord: RankCoord) -> dict[int, torch.Tensor]:
    """This rank's local tensors of `key`, by model chunk."""
    return ck.read_local(key, layout, coord)


@torch.no_grad()
def load_model(ck: Checkpoint, table: list[LocalParam], layout: Layout, groups: Groups) -> None:
    for cname, lps in _by_tensor(table).items():
        local = _local(ck, cname, layout, _coord(lps[0], groups))
        for lp in lps:
            lp.param.copy_(lp.of(local[lp.vstage]))


def load_optimizer(ck: Checkpoint, table: list[LocalParam], opt: DistributedOptimizer, layout: Layout,
                   groups: Groups, step: int) -> None:
    """Owned parameters' fp32 main copies and moments from the checkpoint's optimizer state."""
    missing = [s for s in OPTIMIZER_STATES if s not in ck.optimizer_states]
    if missing:
        raise FormatError(f"{ck.path}: optimizer state {missing} missing; cannot resume the optimizer "
                          "(pass --no-load-optim to start it fresh)")
    index = {n: i for i, n in enumerate(opt.names)}
    by_t = _by_tensor([lp for lp in table if lp.name in index and opt.is_mine(index[lp.name])])
    for cname, lps in by_t.items():
        coord = _coord(lps[0], groups)
        states = {s: _local(ck, optimizer_key(s, cname), layout, coord) for s in OPTIMIZER_STATES}
        for lp in lps:
            vals = {s: lp.of(t[lp.vstage]) for s, t in states.items()}
            opt.load_state(index[lp.name], vals, step)


def _entries(cfg: ModelConfig, layout: Layout, dtypes: dict[str, str]) -> dict[str, TensorEntry]:
    """Every array of a training checkpoint, chunked as the converters chunk (chunk_shape: one layer of a rank's
    shard, split under 128 MiB), so ranks never share a chunk; optimizer state in fp32."""
    specs = model_specs(cfg, layout)
    out = {s.name: TensorEntry.of(s, layout, dtypes[s.name]) for s in specs}
    out.update({s.name: TensorEntry.of(s, layout, "float32") for s in optimizer_specs(specs)})
    return out


def _boxes(entry: TensorEntry, lp: LocalParam, value: torch.Tensor, layout: Layout, groups: Groups,
           num_layers: int) -> Iterator[tuple[list[int], tuple[int, ...], torch.Tensor]]:
    """The chunks of `entry` this rank writes for one parameter (chunk grid position, global offsets, value: a view
    of `value`): the primary regions of its model chunk, cut on the entry's chunk grid. The native save writes each
    as a chunk file, the torch_dist save (train/torch_dist_ckpt.py) as one DCP item."""
    if lp.expert is not None:  # a chunk holds a layer's local experts together: save them stacked
        raise ValueError(f"{lp.name}: one expert of {lp.spec.name} cannot be saved alone; stack the layer's experts")
    for r in regions(lp.spec, layout, groups.coord, num_layers):
        if not r.primary or r.vstage != lp.vstage:
            continue
        gs, ls = list(r.global_slices()), list(r.local_slices())
        if lp.index is not None:  # one layer of a stacked tensor
            gs[0] = slice(gs[0].start + lp.index, gs[0].start + lp.index + 1)
            part = value[tuple(ls[1:])].unsqueeze(0)
        else:
            part = value[tuple(ls)]
        for offs in itertools.product(*[range(g.start, g.stop, c) for g, c in zip(gs, entry.chunk)]):
            grid = [o // c for o, c in zip(offs, entry.chunk)]
            view = part[tuple(slice(o - g.start, o - g.start + c) for o, g, c in zip(offs, gs, entry.chunk))]
            yield grid, tuple(offs), view.detach()


def _chunks(partial: Path, key: str, entry: TensorEntry, lp: LocalParam, value: torch.Tensor, layout: Layout,
            groups: Groups, num_layers: int) -> Iterator[tuple[Path, torch.Tensor]]:
    """The chunk files of `key` this rank writes for one parameter, with their values (views of `value`)."""
    for grid, _, view in _boxes(entry, lp, value, layout, groups, num_layers):
        yield partial / tensor_path(key) / chunkio.chunk_path(Path(), grid), view


def saved_values(table: list[LocalParam], opt: DistributedOptimizer,
                 groups: Groups) -> Iterator[tuple[LocalParam, dict[str, torch.Tensor]]]:
    """What this rank saves: each parameter it owns (the DP rank whose optimizer shard holds it; TP rank 0 for
    TP-replicated tensors; CP rank 0), with its values by array key: the weight and its optimizer state."""
    index = {n: i for i, n in enumerate(opt.names)}
    for lp in table:
        if lp.tied_copy:
            continue
        i = index.get(lp.name)
        mine = opt.is_mine(i) if i is not None else groups.dp_rank == 0
        # CP ranks hold the same weights: one of them writes (an expert shard has one owner in its
        # expert-data-parallel group, which spans DP x CP)
        mine = mine and (groups.cp_rank == 0 or (i is not None and opt.expert[i]))
        if not mine:
            continue
        values = {lp.spec.name: lp.param}
        if i is not None:
            values.update({optimizer_key(s, lp.spec.name): t for s, t in opt.state_of(i).items()})
        else:  # not trained (e.g. DeepSeek's expert bias): its fp32 copy, zero moments
            values.update({optimizer_key("fp32_param", lp.spec.name): lp.param.float(),
                           optimizer_key("exp_avg", lp.spec.name): torch.zeros_like(lp.param, dtype=torch.float32),
                           optimizer_key("exp_avg_sq", lp.spec.name):
                               torch.zeros_like(lp.param, dtype=torch.float32)})
        yield lp, values


def gather_dtypes(table: list[LocalParam]) -> dict[str, str]:
    """Every canonical tensor's dtype name (every rank knows its own tensors'; the model dtype is uniform)."""
    dtype = {lp.spec.name: store.dtype_name(lp.param.dtype) for lp in table}
    if dist.get_world_size() > 1:
        names = [None] * dist.get_world_size()
        dist.all_gather_object(names, dtype)
        for d in names:
            dtype.update(d)
    return dtype


def rng_state() -> dict:
    """Python, numpy and torch RNG states as JSON (no pickle: lists and base64 of the torch state bytes)."""
    py = random.getstate()
    np_state = np.random.get_state()
    return {"python": [py[0], list(py[1]), py[2]],
            "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
            "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}


def set_rng_state(state: dict) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), n[2], n[3], n[4]))
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["torch"])), dtype=torch.uint8))


class AsyncSave:
    """A save whose bytes are still being written and committed by a background thread (`--async-save`).

    Training may go on at once: this rank's chunks were copied before this object existed. `wait()` joins the thread and raises its error; the next save and the end of training call it, so at
    most one save is in flight and a run never ends before its last checkpoint is committed."""

    def __init__(self, finish: Callable[[], Path | None]) -> None:
        self._result: list = [None, None]

        def target() -> None:
            try:
                self._result[0] = finish()
            except BaseException as e:  # re-raised in wait(), on the training thread
                self._result[1] = e

        self._thread = threading.Thread(target=target, name="shardkit-async-save", daemon=True)
        self._thread.start()

    def wait(self) -> Path | None:
        self._thread.join()
        if self._result[1] is not None:
            raise self._result[1]
        return self._result[0]


def save(root: Path, iteration: int, cfg: ModelConfig, layout: Layout, table: list[LocalParam],
         opt: DistributedOptimizer, groups: Groups, train_state: dict, assets_from: Path | None,
         provenance: dict, async_group: Any = None) -> Path | AsyncSave | None:
    """Write one training checkpoint with all ranks; returns the committed iteration dir on rank 0.

    With `async_group` (a process group used by nothing else, so that a background thread may run collectives on it
    while training uses the others) only the array creation and the copy of this rank's chunks happen here; writing
    them, the error exchange and the commit run in the background (`AsyncSave`)."""
    root = Path(root)
    entries = _entries(cfg, layout, gather_dtypes(table))
    from checkpoint.storage import mirrored

    loc = mirrored(root)
    if loc is not None:  # --save s3://... / gs://...: straight to the store, every rank its own chunk objects
        return _save_to_store(loc, iteration, cfg, layout, table, opt, groups, train_state, assets_from, provenance,
                              async_group, entries, root)

    def create_arrays(writer: IterationWriter) -> None:
        ctx = store.context()
        for name, e in entries.items():
            store.create(writer.path(tensor_path(name)), e.shape, e.dtype, e.chunk, ctx)

    writer = open_on_rank0(root, iteration, "train-save", entries, groups, prepare=create_arrays)
    err: list = [None]
    partial = root / f"{iter_dirname(iteration)}{PARTIAL_SUFFIX}"
    jobs: list[tuple[str, Path, torch.Tensor]] = []  # (array key, chunk file, value) this rank writes
    try:
        for lp, values in saved_values(table, opt, groups):
            for key, value in values.items():
                jobs += [(key, path, v) for path, v in _chunks(partial, key, entries[key], lp, value, layout, groups,
                                                                cfg.num_layers)]
        if async_group is not None:  # training goes on at once and changes the parameters: write copies
            jobs = [(key, path, v.to("cpu", copy=True)) for key, path, v in jobs]
        err = [None]
    except Exception as e:
        err = [f"rank {groups.rank}: {type(e).__name__}: {e}"]
    store_state = dict(train_state, optimizer_steps=opt.steps)

    def finish() -> Path | None:
        if not err[0]:
            try:
                _write_chunks(jobs)
            except Exception as e:
                err[0] = f"rank {groups.rank}: {type(e).__name__}: {e}"
        jobs.clear()  # the copies of an async save
        try:
            _gather_errors(err, async_group)
        except Exception:
            if writer is not None:
                writer.__exit__(*sys.exc_info())
            raise
        def commit() -> Path:
            (writer.partial / TRAIN_STATE).write_text(json.dumps(store_state, indent=1) + "\n")
            if assets_from is not None and assets_from.is_dir():  # known side-file names only, never links
                from checkpoint.safety import copy_side_files

                copy_side_files(assets_from, writer.partial / "hf")
            manifest = Manifest(iteration, cfg, layout, entries, provenance=provenance,
                                training={"iteration": iteration,
                                          "consumed_samples": train_state.get("consumed_samples")},
                                optimizer=list(OPTIMIZER_STATES))
            return writer.commit(manifest)

        return commit_on_rank0(writer, groups, async_group, commit)

    return finish() if async_group is None else AsyncSave(finish)


def _save_to_store(loc, iteration: int, cfg: ModelConfig, layout: Layout, table: list[LocalParam],
                   opt: DistributedOptimizer, groups: Groups, train_state: dict, assets_from: Path | None,
                   provenance: dict, async_group: Any, entries: dict[str, TensorEntry],
                   root: Path) -> Path | AsyncSave | None:
    """`save` to object storage (checkpoint/storage.py), with no local copy and no shared filesystem: rank 0 first
    clears an earlier write of this iteration from the store (`storage.unpublish`); every rank then puts its own
    chunk objects (the chunks the local save writes as files, the same bytes); once all have, their crc32c
    gathered, rank 0 puts the arrays' zarr.json, train_state.json and hf/, then manifest.json, then `latest`
    (conditional). A rank that fails or is killed leaves an iteration without manifest.json: `latest` still names
    the previous checkpoint. With `async_group` the uploads and the commit run in the background (`AsyncSave`)."""
    import tempfile

    from checkpoint import storage

    name = iter_dirname(iteration)
    err: list = [None]
    generation: list = [None]
    if groups.rank == 0:
        try:
            generation[0] = storage.unpublish(storage.ObjectStore(loc), name)
        except Exception as e:
            err = [f"{type(e).__name__}: {e}"]
    _broadcast_error(err)
    jobs: list[tuple[str, str, int, torch.Tensor]] = []  # (object key, array key, chunk index, value) of this rank
    try:
        for lp, values in saved_values(table, opt, groups):
            for key, value in values.items():
                e = entries[key]
                for grid, _, view in _boxes(e, lp, value, layout, groups, cfg.num_layers):
                    rel = chunkio.chunk_path(Path(name) / tensor_path(key), grid).as_posix()
                    jobs.append((rel, key, chunkio.grid_index(grid, e.shape, e.chunk), view))
        if async_group is not None:  # training goes on at once and changes the parameters: write copies
            jobs = [(rel, key, i, v.to("cpu", copy=True)) for rel, key, i, v in jobs]
    except Exception as e:
        err = [f"rank {groups.rank}: {type(e).__name__}: {e}"]
    store_state = dict(train_state, optimizer_steps=opt.steps)

    def commit(crcs: dict[tuple[str, int], int]) -> str:
        with tempfile.TemporaryDirectory(prefix="shardkit-save-") as tmp:
            it = Path(tmp) / name
            ctx = store.context()
            for key, e in entries.items():
                store.create(it / tensor_path(key), e.shape, e.dtype, e.chunk, ctx)
                n = int(np.prod(chunkio.grid_shape(e.shape, e.chunk)))
                missing = [i for i in range(n) if (key, i) not in crcs]
                if missing:
                    at = chunkio.grid_position(missing[0], e.shape, e.chunk)
                    raise WriteError(f"tensor {key}: no rank wrote its chunk {list(at)} ({len(missing)} of {n} missing)")
                e.crc32c = [crcs[key, i] for i in range(n)]
            (it / TRAIN_STATE).write_text(json.dumps(store_state, indent=1) + "\n")
            if assets_from is not None and assets_from.is_dir():  # known side-file names only, never links
                from checkpoint.safety import copy_side_files

                copy_side_files(assets_from, it / "hf")
            manifest = Manifest(iteration, cfg, layout, entries, provenance=provenance,
                                training={"iteration": iteration,
                                          "consumed_samples": train_state.get("consumed_samples")},
                                optimizer=list(OPTIMIZER_STATES))
            return storage.publish_save(loc, it, manifest.to_json(), generation[0])

    def finish() -> Path | None:
        mine: list = []
        if not err[0]:
            try:
                crcs = storage.put_chunks(loc, [(rel, v) for rel, _, _, v in jobs])
                mine = [(key, i, c) for (_, key, i, _), c in zip(jobs, crcs)]
            except Exception as e:
                err[0] = f"rank {groups.rank}: {type(e).__name__}: {e}"
        jobs.clear()  # the copies of an async save
        got = from_every_rank((err[0], mine), async_group)
        bad = [e for e, _ in got if e]
        if bad:
            raise WriteError(f"checkpoint save failed: {bad[0]}; {loc.url}/{name} has no {MANIFEST} (never taken as a "
                             "checkpoint), latest is unchanged")
        done = [None]
        if groups.rank == 0:
            try:
                commit({(key, i): c for _, part in got for key, i, c in part})
            except Exception as e:
                done = [f"{type(e).__name__}: {e}"]
        if dist.get_world_size() > 1:
            dist.broadcast_object_list(done, src=0, group=async_group)
        if done[0]:
            raise WriteError(f"checkpoint save failed on rank 0: {done[0]}")
        return root / name if groups.rank == 0 else None

    return finish() if async_group is None else AsyncSave(finish)


def open_on_rank0(root: Path, iteration: int, kind: str, entries: dict[str, TensorEntry], groups: Groups,
                  pointer: tuple[str, str] | None = None,
                  prepare: Callable[[IterationWriter], None] | None = None) -> IterationWriter | None:
    """The start of every training save (native or torch_dist): rank 0 opens `<root>/iter_N.partial`, reserves the
    entries' bytes (refused before anything is written) and runs `prepare`; an error there removes what was started
    and reaches every rank as one WriteError instead of leaving them at the barrier. Returns the writer on rank 0."""
    writer = None
    err: list = [None]
    if groups.rank == 0:
        try:
            writer = IterationWriter(root, iteration, {"kind": kind, "nonce": time.time_ns()}, overwrite=True,
                                     pointer=pointer).__enter__()
            writer.reserve(sum(entry_nbytes(e) for e in entries.values()))
            if prepare is not None:
                prepare(writer)
        except Exception as e:
            if writer is not None:  # remove what was started (the writer's error names the path and the bytes)
                try:
                    writer.__exit__(type(e), e, e.__traceback__)
                except Exception as e2:
                    e = e2
                writer = None
            err = [f"{type(e).__name__}: {e}"]
    _broadcast_error(err)
    return writer


def commit_on_rank0(writer: IterationWriter | None, groups: Groups, async_group: Any,
                    commit: Callable[[], Path]) -> Path | None:
    """The end of every training save (native or torch_dist), once all ranks' chunks are durable: rank 0 writes the
    iteration's own files and commits (`commit`); on any error it removes the partial iteration (the writer's error
    names the path and the bytes) and raises. Every rank waits for it. Returns the committed directory on rank 0."""
    out = None
    if groups.rank == 0:
        try:
            out = commit()
        except BaseException:
            writer.__exit__(*sys.exc_info())
            raise
        writer.__exit__(None, None, None)
    if dist.get_world_size() > 1:
        dist.barrier(group=async_group)
    return out


def _write_chunks(jobs: list[tuple[str, Path, torch.Tensor]]) -> None:
    """Write this rank's chunk files with the converters' writer (chunkio.ChunkWriter); every one is durable on
    return. WriteError naming the tensor and the file on a failure."""
    writer = chunkio.ChunkWriter()
    futures = []
    try:
        for key, path, value in jobs:
            fault_point("store.write")
            futures.append(writer.submit(path, store.to_numpy(value), key))
    finally:
        writer.close()
    for f in futures:
        f.result()


def _broadcast_error(err: list) -> None:
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(err, src=0)
    if err[0]:
        raise WriteError(f"checkpoint save failed on rank 0: {err[0]}")


def from_every_rank(item: Any, group: Any = None) -> list:
    """Every rank's `item` in rank order (this rank's alone in one process): a save's errors and what each rank wrote."""
    if dist.get_world_size() <= 1:
        return [item]
    got = [None] * dist.get_world_size()
    dist.all_gather_object(got, item, group=group)
    return got


def _gather_errors(err: list, group: Any = None) -> None:
    bad = [e for e in from_every_rank(err[0], group) if e]
    if bad:
        raise WriteError(f"checkpoint save failed: {bad[0]}")
