"""reshard: rewrite a native checkpoint for another parallel layout, offline, with bounded memory.

Arrays are global, so resharding is re-chunking: every destination chunk reads exactly the source box it covers
(tensorstore fetches only the source chunks that box touches). Vocab padding is recomputed for the destination TP
by the one rule (checkpoint.sharding.vocab_fill, as hf-to-mcore pads: the last real row repeated), so reshard(convert(hf, A), B) equals convert(hf, B) byte for
byte, and the true vocabulary never changes.

A training checkpoint's optimizer state (`optimizer.state.<state>.<name>`, fp32, same specs as the weights) moves the
same way; `dtype` casts model weights only. New vocab padding rows of `fp32_param` repeat the last real row like the
weight; those of `exp_avg` / `exp_avg_sq` are zeros (no update history). `train_state.json` is copied verbatim.
"""
from __future__ import annotations

import multiprocessing as mp
import re
import shutil
import time
from pathlib import Path

from checkpoint import store
from checkpoint.commit import IterationWriter
from checkpoint.config import ModelConfig
from checkpoint.errors import LayoutError, ShardkitError
from checkpoint.layout import Layout, PipelineSplit
from checkpoint.manifest import TRAIN_STATE, Manifest, TensorEntry
from checkpoint.reader import Checkpoint, ReadPlan, read_padded, vocab_padding
from checkpoint.safety import check_output
from checkpoint.sharding import Rule, check_fp8_layout, split_optimizer_key
from checkpoint.families import model_specs

from .hf_to_mcore import VERSION
from . import distributed
from .writer import ChunkSink, Task, write_chunks

LAYOUT_FLAGS = ("tp", "pp", "vpp", "ep", "etp")


def keep_layout(source: Layout | None, cfg: ModelConfig, tp: int | None = None, pp: int | None = None,
                vpp: int | None = None, ep: int | None = None, etp: int | None = None,
                split: PipelineSplit | None = None) -> Layout:
    """The layout `reshard SRC DST [--tp N] ...` writes: each flag not given (None) keeps the source's value, as
    Megatron users think ("change TP to 4"). --etp not given follows the destination's --tp (Megatron's
    --expert-tensor-parallel-size defaults to the TP size) where the source's expert TP followed its TP (etp == tp,
    or a dense model); an expert TP the source set apart from its TP (tp2 etp1) is kept. A kept --vpp that no
    longer fits a new --pp, or any kept value the model refuses at the new layout, is a LayoutError naming the
    flags. `source` None (a torch_dist source without Megatron args): flags not given are 1."""
    given = {"tp": tp, "pp": pp, "vpp": vpp, "ep": ep, "etp": etp}
    src = source or Layout()
    new_tp = src.tp if tp is None else tp
    if etp is None and source is not None and new_tp != src.tp:
        tied = src.etp is None or src.etp == src.tp or not cfg.is_moe
        etp = None if tied else src.etp
    elif etp is None:
        etp = src.etp
    new_pp, new_vpp = src.pp if pp is None else pp, src.vpp if vpp is None else vpp
    if split is None and (new_pp, new_vpp) == (src.pp, src.vpp):  # an uneven split is kept while the stages are
        split = src.split
    layout = Layout(tp=new_tp, pp=new_pp, vpp=new_vpp, ep=src.ep if ep is None else ep, etp=etp, split=split)
    if source is None:
        layout.check(cfg)
        return layout
    n = cfg.num_layers
    if vpp is None and pp not in (None, src.pp) and layout.vpp > 1:  # the source's virtual stages, for a new --pp
        fits = [v for v in range(1, n // layout.pp + 1) if n % (layout.pp * v) == 0] if layout.pp > 1 else [1]
        stages = layout.pp * layout.vpp
        why = ("--vpp > 1 needs --pp > 1 (virtual stages interleave the pipeline ranks)" if layout.pp == 1 else
               f"{stages} pipeline stages exceed num_hidden_layers={n}" if stages > n else
               f"num_hidden_layers={n} is not divisible by {stages} pipeline stages" if n % stages else None)
        if why and fits:
            raise LayoutError(f"--pp {layout.pp} with the source's --vpp {layout.vpp} (kept: --vpp not given): {why}; "
                              f"pass --vpp N (for --pp {layout.pp}: {', '.join(map(str, fits))})")
    try:
        layout.check(cfg)
    except LayoutError as e:
        named = set(re.findall(r"--(tp|pp|vpp|ep|etp)\b", str(e)))
        notes = [f"--{f} {getattr(layout, f)} kept from the source" for f in LAYOUT_FLAGS[:4]
                 if f in named and given[f] is None]
        if "etp" in named and given["etp"] is None and cfg.is_moe:
            notes.append("--etp not given follows --tp, as Megatron's --expert-tensor-parallel-size does"
                         if layout.etp is None else f"--etp {layout.etp} kept from the source")
        if not notes:
            raise
        raise LayoutError(f"{e} ({'; '.join(notes)}: pass the flag to change it)") from None
    return layout


def layout_text(layout: Layout, moe: bool) -> str:
    """tp=4 pp=2 vpp=1 (and ep, etp for a MoE model), as the reshard command prints it."""
    text = f"tp={layout.tp} pp={layout.pp} vpp={layout.vpp}"
    if layout.split is not None:
        text += f" ({' '.join(layout.split.flags())})"
    return f"{text} ep={layout.ep} etp={layout.expert_tp}" if moe else text


def layout_change(source: Layout | None, layout: Layout, cfg: ModelConfig, given: dict[str, int | None],
                  unknown: str = "") -> str:
    """The line `reshard` prints before it starts: source layout -> destination layout, and which flags were kept."""
    moe = cfg.is_moe
    if source is None:
        return f"reshard: layout unknown ({unknown}) -> {layout_text(layout, moe)} (flags not given: 1)"
    flags = LAYOUT_FLAGS if moe else LAYOUT_FLAGS[:3]
    kept = [f for f in flags if given.get(f) is None and (f != "etp" or layout.expert_tp == source.expert_tp)]
    notes = [f"kept from the source: {', '.join(kept)}"] if kept else []
    if moe and given.get("etp") is None and "etp" not in kept:
        notes.append("etp follows tp")
    return (f"reshard: {layout_text(source, moe)} -> {layout_text(layout, moe)}"
            + (f" ({'; '.join(notes)})" if notes else ""))


def plan_reshard(ck: Checkpoint, layout: Layout, dtype: str | None) -> dict[str, TensorEntry]:
    cfg, fp8 = ck.config, ck.manifest.fp8
    layout.check(cfg)
    check_fp8_layout(model_specs(cfg, layout), fp8, layout)
    kept = set(fp8["tensors"]) if fp8 else set()
    entries = {}
    for spec in Manifest(ck.manifest.iteration, cfg, layout, {}, fp8=fp8, optimizer=ck.manifest.optimizer).specs():
        src = ck.entry(spec.name)
        if spec.rule is not Rule.VOCAB and list(spec.shape) != src.shape:
            raise ShardkitError(f"tensor {spec.name}: source shape {src.shape} disagrees with the model config "
                                f"({list(spec.shape)}); the source checkpoint is inconsistent")
        fp8_part = spec.name in kept or spec.name.removesuffix("_scale_inv") in kept
        keep = fp8_part or split_optimizer_key(spec.name) is not None  # optimizer state stays as stored (fp32)
        entries[spec.name] = TensorEntry.of(spec, layout, src.dtype if keep else dtype or src.dtype)
    return entries


# -- worker side ----------------------------------------------------------------------------------------------------
SOURCE_CACHE_BYTES = 512 << 20  # > READ_AHEAD_BYTES + the chunks in use (chunks are at most 128 MiB)
READ_AHEAD_BYTES = 256 << 20


class _Worker:
    """Writes destination chunks read from the source's boxes (convert.writer.Workers)."""

    def __init__(self, src_dir: str, out_dir: str, dtypes: dict[str, str], vocab: dict[str, int],
                 tasks: list[Task]) -> None:
        # A destination chunk is often a part of a source chunk (a higher TP splits it): keep source chunks until
        # their last destination chunk is written, so each is read and checksummed once; read ahead in-process only.
        self.src = Checkpoint(src_dir, cache_bytes=SOURCE_CACHE_BYTES)
        ahead = READ_AHEAD_BYTES if mp.parent_process() is None else 0
        self.plan = ReadPlan(self.src, [(t.name, t.index) for t in tasks], ahead)
        self.sink, self.vocab = ChunkSink(out_dir, dtypes), vocab

    def __call__(self, task: Task) -> tuple[str, int]:
        # numpy views of the cached source chunks, handed to the sink as they are (no copy where a box is contiguous)
        value = read_padded(lambda idx: self.src.read_numpy(task.name, idx), task.name, task.box,
                            self.vocab.get(task.name))
        self.plan.done(task.name, task.index)
        return self.sink.write(task, value)

    def close(self) -> None:
        self.plan.close()  # stop its read-ahead


# -- main side ------------------------------------------------------------------------------------------------------

def reshard(src_path: str | Path, out: str | Path, layout: Layout, dtype: str | None = None,
            workers: int | None = None, overwrite: bool = False, quiet: bool = False, skip_verify: bool = False,
            group=None, estimate_above: int | None = None) -> Path:
    """Write `<out>/iter_N` (N = the source's iteration) for `layout`; returns the iteration directory. The source is
    checked first (Checkpoint.check; by rank 0 alone with `group`, one rank of several) unless `skip_verify`; every
    chunk read is checksummed either way."""
    check_output(out, [("SRC", src_path)], "DST")  # never over, inside or around the source
    ck = Checkpoint(src_path, check=not skip_verify and distributed.leads(group))
    out = Path(out)
    if out.resolve() == ck.path.parent.resolve():
        raise ShardkitError(f"{out}: the destination is the source's own root; write the resharded checkpoint "
                            "elsewhere")
    dtype = store.dtype_name(dtype) if dtype else None
    entries = plan_reshard(ck, layout, dtype)
    vocab = vocab_padding(ck.config, layout, ck.manifest.optimizer)
    digest = ck.manifest.to_json()
    job = {"tool": VERSION, "source": str(ck.path.resolve()), "source_manifest": digest, "layout": layout.to_dict(),
           "dtype": dtype}
    started = time.time()
    path = None
    with distributed.open_writer(out, ck.manifest.iteration, job, overwrite, group) as w:
        dtypes = {n: e.dtype for n, e in entries.items()}
        write_chunks(w, entries, "reshard", _Worker, lambda todo: (str(ck.path), str(w.partial), dtypes, vocab, todo),
                     workers, quiet, group=group, region=lambda t: source_chunk(ck, t), estimate_above=estimate_above)
        if distributed.leads(group):
            path = _commit(w, ck, layout, entries, started)
    return distributed.finish(group, path, out)


def source_chunk(ck: Checkpoint, task: Task) -> tuple:
    """The source chunk where a destination chunk starts: destination chunks that split one source chunk (a higher
    TP) stay on one rank (convert.distributed.share), so it is read and checksummed once."""
    chunk = ck.entry(task.name).chunk
    return task.name, tuple(a // c for (a, _), c in zip(task.box, chunk))


def _commit(w: IterationWriter, ck: Checkpoint, layout: Layout, entries: dict[str, TensorEntry],
            started: float) -> Path:
    """The carried files, the manifest and the commit, by the one process that commits."""
    if ck.hf_dir().is_dir():  # the side files only (checkpoint.safety): never links, FIFOs or unknown names
        from checkpoint.safety import copy_side_files

        copy_side_files(ck.hf_dir(), w.path("hf"))
    if ck.train_state_path() is not None:  # carried verbatim; committed (fsynced, renamed) with the rest
        shutil.copyfile(ck.train_state_path(), w.path(TRAIN_STATE))
    m = ck.manifest
    manifest = Manifest(
        iteration=m.iteration, model=m.model, layout=layout, tensors=entries, fp8=m.fp8, training=m.training,
        optimizer=m.optimizer,
        provenance={**m.provenance, "tool": f"shardkit {VERSION}", "command": "reshard",
                    "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "seconds": round(time.time() - started, 3),
                    "resharded_from": {"path": str(ck.path.resolve()), "layout": m.layout.to_dict(),
                                       "source": m.provenance.get("source")}})
    return w.commit(manifest)
