"""mcore-to-hf: stream a checkpoint back to HF sharded safetensors, config.json and tokenizer files. The source is
opened through checkpoint.opened: a shardkit native checkpoint, or a Megatron torch_dist one read in place by region
(TorchDistSource; no staging copy, on every rank alike).

The same mapping table as hf-to-mcore, read backwards: each HF tensor is the concatenation, in HF row order, of
canonical row blocks; vocab padding rows are never part of a block, so they are never exported. Tensors are written
into safetensors files block by block (the safetensors library writes whole dicts only, so the small framing is done
here: 8-byte header length, JSON header, raw little-endian bytes), which keeps memory bounded by one block.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from checkpoint import store
from checkpoint.commit import fsync_path, fsync_tree, output_lock, replace_dir, space_note, space_related
from checkpoint.errors import ShardkitError, WriteError
from checkpoint.faults import fault_point
from checkpoint.hf_source import INDEX, SINGLE
from checkpoint.progress import progress_bar
from checkpoint.reader import ManifestView
from checkpoint.safety import check_target, copy_side_files

from checkpoint import families
from checkpoint.sharding import SCALE_SUFFIX

from .writer import refuse_nonfinite
from checkpoint.families.mapping import Segment, TensorMap, hf_sources

_ST_NAMES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float8_e4m3fn": "F8_E4M3",
             "float8_e5m2": "F8_E5M2"}
BLOCK_BYTES = 64 << 20
EXPORT_CACHE_BYTES = 320 << 20  # > 2 of the largest chunks (CHUNK_MAX_BYTES)


@dataclass
class HFTensorPlan:
    name: str
    dtype: str
    shape: tuple[int, ...]
    blocks: list[tuple[TensorMap, Segment]]
    fp8_block: tuple[int, int] | None = None  # re-quantize to e4m3 with one scale per block
    dequant_block: tuple[int, int] | None = None  # stored as kept FP8: dequantize with its block scales

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * store.torch_dtype(self.dtype).itemsize + (4 * self.scale_shape[0] * self.scale_shape[1]
                                                             if self.fp8_block else 0)

    @property
    def scale_shape(self) -> tuple[int, int]:
        br, bc = self.fp8_block
        return -(-self.shape[0] // br), -(-self.shape[1] // bc)

    def header(self, off: int) -> dict:
        if not self.fp8_block:
            return {self.name: {"dtype": _ST_NAMES[self.dtype], "shape": list(self.shape),
                                "data_offsets": [off, off + self.nbytes]}}
        wbytes = self.shape[0] * self.shape[1]
        return {self.name: {"dtype": "F8_E4M3", "shape": list(self.shape), "data_offsets": [off, off + wbytes]},
                self.name + SCALE_SUFFIX: {"dtype": "F32", "shape": list(self.scale_shape),
                                           "data_offsets": [off + wbytes, off + self.nbytes]}}


def plan_export(ckpt: ManifestView, dtype: str | None, quantize_fp8: bool = False) -> list[HFTensorPlan]:
    """Every HF tensor as blocks of canonical rows; MTP's shared copies (DeepSeek) point at the shared tensor.
    A checkpoint that kept FP8 weights exports them as they are (with their scales) unless a --dtype is asked for,
    which dequantizes them."""
    cfg = ckpt.config
    fam = families.family_of(cfg.model_type)
    kept = ckpt.manifest.fp8
    dequant = bool(kept) and dtype is not None
    sources = hf_sources(families.tensor_maps(cfg, ckpt.layout, None if dequant else kept))
    for copy, main in fam.shared_copies(cfg).items():
        if main in sources:
            sources[copy] = sources[main]
    quant = _fp8_selector(ckpt) if quantize_fp8 and not kept else (lambda name: None)
    kept_names = set(kept["tensors"]) if dequant else set()
    plans = []
    for hf_name, blocks in sources.items():
        e = ckpt.entry(blocks[0][0].canonical)
        rows = sum(seg.stop - seg.start for _, seg in blocks)
        cols = e.shape[e.lead + 1:]
        block = quant(hf_name)
        deq = tuple(kept["block"]) if blocks[0][0].canonical in kept_names else None
        plans.append(HFTensorPlan(hf_name, "float8_e4m3fn" if block else dtype or e.dtype, (rows, *cols), blocks,
                                  block, deq))
    return plans


def _fp8_selector(ckpt: ManifestView):
    """The HF weights that were block-FP8 in the source (provenance templates) -> their block size."""
    fp8 = ckpt.manifest.provenance.get("fp8")
    if not fp8:
        raise ShardkitError(f"{ckpt.path}: --quantize-fp8: the source of this checkpoint was not block-FP8, so there "
                            "is no block scheme to re-create")
    pattern = re.compile("^(" + "|".join(re.escape(t).replace(r"\{\}", r"\d+") for t in fp8["tensors"]) + ")$")
    block = tuple(fp8["block"])
    return lambda name: block if pattern.match(name) else None


def quantize_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Block FP8 (DeepSeek-V3's scheme): scale = amax(|block|) / 448, q = e4m3(w / scale); returns (q, scale)."""
    br, bc = block
    r, c = w.shape
    w32 = w.float()
    pad = torch.nn.functional.pad(w32.abs(), (0, -c % bc, 0, -r % br))
    amax = pad.reshape(pad.shape[0] // br, br, pad.shape[1] // bc, bc).amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    full = scale.repeat_interleave(br, 0).repeat_interleave(bc, 1)[:r, :c]
    return (w32 / full).to(torch.float8_e4m3fn), scale


def parse_size(s: str | int) -> int:
    """'5GB' -> 5e9, '500MiB' -> 500 * 2**20, a bare number is bytes; anything else, or not > 0, is an error."""
    import re

    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30,
             "TIB": 2**40, "B": 1, "": 1}
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([KMGT]I?B|B)?\s*", str(s), re.IGNORECASE)
    if m is None:
        raise ShardkitError(f"--max-shard-size: cannot parse {s!r} (e.g. 5GB, 500MB)")
    n = int(float(m.group(1)) * units[(m.group(2) or "").upper()])
    if n < 1:
        raise ShardkitError(f"--max-shard-size: {s!r} must be at least one byte")
    return n


def _shards(plans: list[HFTensorPlan], max_bytes: int) -> list[list[HFTensorPlan]]:
    shards: list[list[HFTensorPlan]] = [[]]
    size = 0
    for p in plans:
        if shards[-1] and size + p.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(p)
        size += p.nbytes
    return shards


def _read_block(ckpt: ManifestView, tm: TensorMap, start: int, stop: int) -> torch.Tensor:
    index = tuple(slice(i, i + 1) for i in tm.lead) + (slice(start, stop),)
    t = ckpt.read(tm.canonical, index)
    return t.reshape(t.shape[len(tm.lead):])


def _write_shard(ckpt: ManifestView, path: Path, plans: list[HFTensorPlan], bar) -> None:
    """One shard file; a write error names it (issue 34: a full disk named neither the file nor the bytes)."""
    try:
        _write_shard_file(ckpt, path, plans, bar)
    except OSError as e:
        if getattr(e, "filename", None) is None:
            raise OSError(e.errno, e.strerror or str(e), str(path)) from None
        raise


def _write_shard_file(ckpt: ManifestView, path: Path, plans: list[HFTensorPlan], bar) -> None:
    header, off = {}, 0
    for p in plans:
        header.update(p.header(off))
        off += p.nbytes
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for p in plans:
            row_bytes = max(1, p.nbytes // max(1, p.shape[0]))
            step = max(1, BLOCK_BYTES // row_bytes)
            align = (p.fp8_block or p.dequant_block or (1,))[0]
            step = max(align, step - step % align)  # whole FP8 row blocks
            if p.fp8_block:  # scales kept (they are small) and written after the weight
                scales = []
            for tm, seg in p.blocks:
                for a in range(seg.start, seg.stop, step):
                    b = min(seg.stop, a + step)
                    t = _read_block(ckpt, tm, a, b)
                    if p.dequant_block:
                        br, bc = p.dequant_block
                        sc = _read_block(ckpt, TensorMap(tm.canonical + SCALE_SUFFIX, tm.lead, (), 0), a // br,
                                         -(-b // br))
                        full = sc.repeat_interleave(br, 0).repeat_interleave(bc, 1)
                        t = t.float() * full[a - (a // br) * br:][: b - a, : t.shape[1]]
                    if p.fp8_block:
                        t, sc = quantize_blocks(t, p.fp8_block)
                        scales.append(sc)
                    else:
                        t = store.cast(t, p.dtype, p.name)  # (refuses finite values beyond the dtype's range)
                    refuse_nonfinite(f"{p.name} (from {tm.canonical})", ((a, b),), t)  # issue 34
                    f.write(store.to_numpy(t.contiguous()).tobytes())
                    bar.advance(t.numel() * t.element_size())
            if p.fp8_block:
                f.write(store.to_numpy(torch.cat(scales).contiguous()).tobytes())
            bar.advance(0, 1)
        f.flush()
        os.fsync(f.fileno())


EXPORT_PARTIAL = ".shardkit-export.partial"  # inside an existing OUT: the export's files before they are moved in
_SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
_INDEX_MAX = 100 << 20


def owned_names(out: Path) -> set[str]:
    """The files of an HF directory that an export into it replaces or removes: the names shardkit writes
    (model.safetensors, the index, config.json, generation_config.json) and the shards of an earlier export, i.e. the
    `model-XXXXX-of-YYYYY.safetensors` files its index lists. Everything else in OUT (the user's data, scripts, eval
    results, other weights) is never touched."""
    names = {SINGLE, INDEX, "config.json", "generation_config.json"}
    idx = out / INDEX
    try:
        if idx.is_file() and not idx.is_symlink() and idx.stat().st_size <= _INDEX_MAX:
            wm = json.loads(idx.read_text()).get("weight_map", {})
            names |= {v for v in wm.values() if isinstance(v, str) and _SHARD_RE.match(v)}
    except (OSError, ValueError, AttributeError, RecursionError):  # an unreadable old index: its shards stay
        pass
    return names


def convert_mcore_to_hf(ckpt_path: str | Path, out: str | Path, dtype: str | None = None,
                        max_shard_size: str | int = "5GB", overwrite: bool = False, quiet: bool = False,
                        quantize_fp8: bool = False, skip_verify: bool = False, group=None,
                        estimate_above: int | None = None, hf_config: str | None = None,
                        vocab_size: int | None = None) -> Path:
    """Export the checkpoint at `ckpt_path` (either format: checkpoint.opened; `hf_config` / `vocab_size` describe a
    torch_dist one's model where it does not itself) to `out`. A new or empty `out` is written beside it and put in
    place in one rename; into an existing one (`--overwrite`) the export's files are written under
    `out/.shardkit-export.partial/`, made durable, then moved in one by one (each rename atomic; the index and
    config.json last), and the shards of the previous export that the new one does not name are removed (`owned_names`):
    no other file in `out` is touched.

    With `group` (one rank of several, convert.distributed) the safetensors shards are shared out among the ranks
    (balanced by bytes, the same plan on every rank): rank 0 takes the output's lock and makes the work directory,
    every rank writes and fsyncs its shards into it and reports their names and sizes, and rank 0, once every rank
    reported, checks that each shard is there at its reported size (a directory the nodes do not share is named),
    writes the index, config.json and the tokenizer files and puts the export in place as one process does. A rank
    that fails stops every rank (one line naming it); the work directory is removed and nothing is put in place. A
    job with at least `estimate_above` bytes prints the expected time first (convert.distributed.announce_estimate)."""
    from checkpoint.opened import open_checkpoint
    from checkpoint.safety import check_output

    from . import distributed

    lead = distributed.leads(group)
    if group is not None:
        group.outcome = "nothing was put in place; rerun (any number of ranks)"
    out = Path(out)
    check_output(out, [("checkpoint", ckpt_path)])
    if lead:  # rank 0 decides what the output is; the others write where it says
        _check_target(out, overwrite)
    # blocks are row slices of chunks (a QKV chunk is sliced once per query group for each of q, k and v; a 125 MB
    # vocab chunk is read in 64 MB blocks): keep decoded chunks so each is read and checksummed once
    opened = open_checkpoint(ckpt_path, hf_config, vocab_size, check=not skip_verify and lead,
                             cache_bytes=EXPORT_CACHE_BYTES)
    if lead and not quiet:
        for note in opened.notes:
            print(f"shardkit: note: {note}", file=sys.stderr)
    ckpt = opened.reader
    dtype = store.dtype_name(dtype) if dtype else None
    plans = plan_export(ckpt, dtype, quantize_fp8)
    shards = _shards(plans, parse_size(max_shard_size))
    n = len(shards)
    names = [SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    total = sum(p.nbytes for p in plans)
    if not lead:
        return _write_share(group, ckpt, out, shards, names, total, len(plans), estimate_above)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise WriteError(f"{out.parent}: cannot create the output directory ({e.strerror or e})") from None
    with output_lock(out.parent, f".{out.name}.shardkit.lock"):  # one writer per output; rmtree(tmp) under it
        into = out.is_dir()
        tmp = out / EXPORT_PARTIAL if into else out.with_name(f".{out.name}.partial")
        check_target(tmp, "OUT", ours=True, kind="dir")  # our work directory's name: a link there is refused
        try:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
        except OSError as e:
            raise WriteError(f"{tmp}: cannot create the export's work directory ({e.strerror or e})") from None
        try:
            if group is not None:  # the others write into it from now on
                group.publish("setup", {"tmp": str(tmp)})
            _maybe_estimate(tmp, total, group, quiet, estimate_above)
            mine = _my_shards(shards, group)
            with progress_bar("mcore-to-hf", total=total, items=len(plans), disable=quiet, unit="tensors") as shown:
                bar = shown if group is None else group.progress(shown)
                written = _write_shards(ckpt, tmp, shards, names, mine, bar, group)
                reports = [written] if group is None else distributed.report_done(group, _Written(written), "shards")
            if group is not None:
                _check_reported(group, tmp, names, reports, quiet)
            weight_map = {p.name: names[i] for i, shard in enumerate(shards) for p in shard}
            if n > 1:
                index = {"metadata": {"total_size": total}, "weight_map": weight_map}
                (tmp / INDEX).write_text(json.dumps(index, indent=2) + "\n")
            quantized = quantize_fp8 or (bool(ckpt.manifest.fp8) and dtype is None)
            cfg_out = ckpt.config.to_hf(dtype=dtype or _dominant_dtype(plans), quantized=quantized)
            (tmp / "config.json").write_text(json.dumps(cfg_out, indent=2) + "\n")
            # the checkpoint's hf/ is untrusted input: only known tokenizer / generation names, never over the
            # export's own files (config.json, the weights, the index)
            copy_side_files(ckpt.hf_dir(), tmp, exclude={p.name for p in tmp.iterdir()})
            if into:
                _move_in(tmp, out)
            else:
                replace_dir(tmp, out)  # fsyncs every file and directory first
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            where = Path(e.filename).name if getattr(e, "filename", None) else None
            # the export's bytes and what is free, where space can be the cause
            note = space_note(out if into else out.parent, total) if space_related(e) else ""
            raise WriteError(f"{out}: export failed while writing{f' {where}' if where else ''} ({e.strerror or e})"
                             f"{note}; {'the files written so far were removed' if not into else 'rerun it'}") \
                from None
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return distributed.finish(group, out, out, _PUT_IN_PLACE.format(out=out))


_PUT_IN_PLACE = ("{out} holds the complete export, or (not put in place) the previous contents; rerun, any number "
                 "of ranks, to write it")  # what a rank may say once its shards are reported


def _check_target(out: Path, overwrite: bool) -> None:
    if out.is_symlink() and not out.exists():
        raise ShardkitError(f"{out}: is a symlink to nothing ({os.readlink(out)}); remove it or name another output")
    if out.exists() and not out.is_dir():
        raise ShardkitError(f"{out}: output exists and is not a directory")
    try:
        holds = out.is_dir() and any(p.name != EXPORT_PARTIAL for p in out.iterdir())
    except OSError as e:
        raise ShardkitError(f"{out}: cannot list the output directory ({e.strerror or e})") from None
    if holds and not overwrite:
        raise ShardkitError(f"{out}: output exists and is not empty; pass --overwrite to replace the model files in "
                            "it (other files stay as they are)")


class _Written:
    """What convert.distributed.report_done gathers from a rank: its shards, `name size` each."""

    def __init__(self, lines: list[str]):
        self.written = lines


def _my_shards(shards: list[list[HFTensorPlan]], group) -> list[int]:
    """The shards (indices) this process writes: all of them, or this rank's share (balanced by bytes, consecutive
    shards together; the same plan on every rank)."""
    from . import distributed

    every = list(range(len(shards)))
    if group is None:
        return every
    return distributed.share(every, lambda i: sum(p.nbytes for p in shards[i]), lambda i: i, group.rank,
                             group.world)


def _maybe_estimate(tmp: Path, total: int, group, quiet: bool, estimate_above: int | None) -> None:
    from . import distributed

    if total and total >= (distributed.ESTIMATE_ABOVE if estimate_above is None else estimate_above):
        distributed.announce_estimate(_Probe(tmp), total, group, quiet)


class _Probe:
    """Where announce_estimate measures the write rate: the export's work directory."""

    def __init__(self, tmp: Path):
        self.partial = tmp


def _write_shards(ckpt: ManifestView, tmp: Path, shards: list[list[HFTensorPlan]], names: list[str], mine: list[int],
                  bar, group) -> list[str]:
    """Write the shards `mine` into `tmp`, each fsynced; their `name size` lines. Across ranks, stop between shards
    once another rank has failed (naming it)."""
    lines = []
    for i in mine:
        if group is not None:
            group.stop_if_failed(" while the ranks wrote their shards")
        path = tmp / names[i]
        _write_shard(ckpt, path, shards[i], bar)
        lines.append(f"{names[i]} {path.stat().st_size}")
        fault_point("hf.shard")
    return lines


def _write_share(group, ckpt: ManifestView, out: Path, shards: list[list[HFTensorPlan]], names: list[str], total: int,
                 items: int, estimate_above: int | None) -> Path:
    """A rank other than 0: wait for rank 0's work directory, write this rank's shards into it, report them, and
    wait for rank 0 to put the export in place."""
    from . import distributed

    tmp = Path(group.wait("setup", [0], " while rank 0 prepared the export")[0]["tmp"])
    if not tmp.is_dir():
        raise WriteError(f"{tmp}: rank 0 created the export's work directory, but rank {group.rank} does not see it: "
                         f"the output directory must be on a filesystem every node shares; nothing was put in place")
    _maybe_estimate(tmp, total, group, True, estimate_above)
    mine = _my_shards(shards, group)
    with progress_bar("mcore-to-hf", total=total, items=items, disable=True) as shown:
        try:
            written = _write_shards(ckpt, tmp, shards, names, mine, group.progress(shown), group)
        except OSError as e:  # rank 0 removed the work directory: it (or another rank) stopped first
            group.stop_if_failed(" while the ranks wrote their shards")
            raise WriteError(f"{tmp}: rank {group.rank} could not write its shard ({e.strerror or e}); nothing was "
                             "put in place") from None
        distributed.report_done(group, _Written(written), "shards")
    return distributed.finish(group, out, out, _PUT_IN_PLACE.format(out=out))


def _check_reported(group, tmp: Path, names: list[str], reports: list[list[str]], quiet: bool) -> None:
    """Rank 0, once every rank reported: every shard was written by some rank and is in `tmp` at the size that rank
    reported (a work directory the nodes do not share is not)."""
    found: dict[str, tuple[int, int]] = {}
    for r, lines in enumerate(reports):
        for line in lines:
            name, _, size = line.rpartition(" ")
            found[name] = (r, int(size))
    missing = [n for n in names if n not in found]
    if missing:
        raise WriteError(f"{tmp}: {len(missing)} shard(s) no rank reported as written (e.g. {missing[0]}); nothing "
                         "was put in place")
    for name in names:
        r, size = found[name]
        path = tmp / name
        seen = path.stat().st_size if path.is_file() else None
        if seen != size:
            raise WriteError(f"{path}: rank {r} wrote this shard ({size:,} bytes), but rank 0 finds "
                             f"{'no such file' if seen is None else f'{seen:,} bytes'} in {tmp}: the output directory "
                             "must be on a filesystem every node shares; nothing was put in place")
    if not quiet:
        print(f"mcore-to-hf: {group.world} ranks wrote {' + '.join(str(len(x)) for x in reports)} shards",
              file=sys.stderr)


def _move_in(tmp: Path, out: Path) -> None:
    """Move the export's files from `tmp` into the existing `out` (durable first; weights, then tokenizer files,
    then config.json and the index), remove the previous export's shards that are not part of this one, then
    `tmp`."""
    fsync_tree(tmp)
    stale = owned_names(out)
    new = sorted(p.name for p in tmp.iterdir())
    last = [n for n in ("config.json", INDEX) if n in new]
    for name in new:
        dest = out / name
        if dest.is_dir() and not dest.is_symlink():
            raise ShardkitError(f"{dest}: is a directory; the export would replace it with its file {name}: move "
                                "it away first")
        if _SHARD_RE.match(name) and (dest.exists() or dest.is_symlink()) and name not in stale:
            raise ShardkitError(f"{dest}: a shard-named file that no index of an earlier export lists (the user's?); "
                                f"the export would replace it: move it away first")
    # the old index and config go first, so that a stop half-way leaves a directory that is visibly incomplete (no
    # index / config over a mix of shards), never one that loads; rerunning the export completes it
    for name in (INDEX, "config.json", SINGLE):
        if name in stale and (out / name).is_file():
            (out / name).unlink()
    fsync_path(out)
    for name in [n for n in new if n not in last] + last:
        os.replace(tmp / name, out / name)  # a symlink there is replaced itself, never followed
    for name in sorted(stale - set(new) - {"generation_config.json"}):
        p = out / name
        if p.is_file() or p.is_symlink():
            p.unlink()
    fsync_path(out)
    tmp.rmdir()


def _dominant_dtype(plans: list[HFTensorPlan]) -> str:
    by: dict[str, int] = {}
    for p in plans:
        if not p.fp8_block and not p.dtype.startswith("float8") and not p.name.endswith(SCALE_SUFFIX):
            by[p.dtype] = by.get(p.dtype, 0) + p.nbytes
    return max(by, key=by.get)
