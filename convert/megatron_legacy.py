"""Megatron-LM legacy `--ckpt-format torch` checkpoints -> native shardkit checkpoints, with bounded memory.

    <root>/latest_checkpointed_iteration.txt            "N" or "release"
    <root>/iter_000000N/mp_rank_TT/model_optim_rng.pt              pp == 1 and ep == 1
    <root>/iter_000000N/mp_rank_TT_PPP/model_optim_rng.pt          pp > 1 (or ep > 1 with pp == 1: mp_rank_TT_EEE)
    <root>/iter_000000N/mp_rank_TT_PPP_EEE/model_optim_rng.pt      pp > 1 and ep > 1

(Megatron-LM's `get_checkpoint_name`: the pipeline rank is added when pp > 1, the expert rank when ep > 1; release
checkpoints made with the distributed optimizer name the model file `model_rng.pt`.) Each file holds the rank's local
megatron-core `GPTModel.state_dict()` under `model` (`model0`, `model1`, ... per virtual pipeline stage), with layer
indices local to the stage and expert indices local to the expert rank, plus `args`, `iteration`, RNG, optimizer and
scheduler state that are not model weights and are not converted. Uneven pipeline stages are read as Megatron-LM
writes them: the same files, each stage holding its own number of layers; the args' split flags
(--decoder-first/last-pipeline-num-layers, --account-for-*-in-pipeline-split, --pipeline-model-parallel-layout) say
which, and the converted checkpoint keeps that split.

Every file is loaded with `torch.load(weights_only=True, mmap=True)` under a short explicit allowlist (see
`SAFE_GLOBALS`); anything else in the pickle is refused with one line naming the file, and nothing is executed. Tensor
bytes stay memory-mapped: a worker holds one rank file at a time and writes one storage chunk at a time.

The destination uses the source's own layout, so every rank's local tensor is a whole number of storage chunks: each
chunk is written once, from the rank that Megatron itself would save it from (TP rank 0 for replicated tensors,
expert rank 0 for dense tensors), after every file has been checked for missing, unexpected and misshapen keys. The
other ranks' copies (replicated norms and routers, dense weights on expert ranks > 0, the tied output layer on the
last pipeline stage) are then compared bit for bit with what was written; any difference is an error and nothing is
committed.

What is not specific to this format (tracker file, iteration names, local <-> TE key naming, reading Megatron-LM args
into a model config and checking them against one) comes from checkpoint.megatron.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

import torch

from checkpoint import store
from checkpoint.commit import IterationWriter
from checkpoint.config import ModelConfig
from checkpoint.errors import FormatError, LayoutError, ShardkitError
from checkpoint.layout import Layout, PipelineSplit, RankCoord
from checkpoint.manifest import Manifest, TensorEntry, tensor_path
from checkpoint.megatron import (CHECKPOINT_VERSION, RELEASE, TRACKER, arg, canonical_candidates, check_args,
                                 config_from_megatron_args, int_arg, iter_dirname, iteration_of, with_args_vocab)
from checkpoint.progress import progress_bar
from checkpoint.safe_load import SAFE_GLOBALS, MegatronObject, load_torch  # noqa: F401 - re-exported
from checkpoint.sharding import TensorSpec, local_shape, regions
from checkpoint.families import model_specs

from .hf_to_mcore import VERSION
from .writer import WORKER_MIN_BYTES, ChunkSink, Task, Workers, chunk_tasks, create_arrays

MODEL_FILES = ("model_optim_rng.pt", "model_rng.pt")
BATCH_BYTES = 256 << 20  # a write job covers at most this much of one rank file (progress, parallelism, resume)

_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")
_MODEL_CHUNK = re.compile(r"^model(\d*)$")


# -- safe loading: checkpoint.safe_load (one allowlisted loader) ---------------------------------------------

def load_rank_file(path: str | Path) -> dict:
    """One legacy rank file as plain data (tensors memory-mapped). Raises FormatError naming the file for anything
    that is not plain data under the allowlist, or not a torch.save file."""
    from checkpoint.safety import regular_file

    path = Path(path)
    if not regular_file(path, missing_ok=True):  # a FIFO or a device: one line naming it, never a hang
        raise FormatError(f"{path}: missing")
    obj = load_torch(path, mmap=zipfile.is_zipfile(path))  # the zip format maps; the pre-1.6 format is read whole
    if not isinstance(obj, dict):
        raise FormatError(f"{path}: holds a {type(obj).__name__}, not a Megatron checkpoint dict")
    return obj


def model_chunks(state: dict, label: str) -> list[str]:
    """The state-dict entries holding model weights: ["model"], or ["model0", "model1", ...] with virtual stages."""
    keys = [k for k in state if isinstance(k, str) and _MODEL_CHUNK.match(k)]
    if keys == ["model"]:
        return keys
    numbered = sorted((k for k in keys if k != "model"), key=lambda k: int(k[5:]))
    if "model" in keys or not numbered or numbered != [f"model{i}" for i in range(len(numbered))]:
        raise FormatError(f"{label}: expected a 'model' entry (or model0, model1, ... with virtual pipeline stages), "
                          f"found {sorted(keys) or 'none'}")
    return numbered


# -- discovery ------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RankFile:
    tp: int
    pp: int
    ep: int
    path: Path

    @property
    def coord(self) -> RankCoord:
        # the expert tensor-parallel rank equals the TP rank: only etp == tp is supported (see open_legacy)
        return RankCoord(tp=self.tp, pp=self.pp, ep=self.ep, etp=self.tp)

    @property
    def label(self) -> str:
        return str(self.path)

    @property
    def short(self) -> str:
        return f"{self.path.parent.name}/{self.path.name}"


@dataclass
class LegacySource:
    root: Path
    iter_dir: Path
    iteration: int
    layout: Layout
    files: list[RankFile]
    args: argparse.Namespace | None
    cfg: ModelConfig  # the caller's config, with Megatron's vocab divisor when args give one
    checkpoint_version: float | None

    def fingerprint(self) -> list:
        out = []
        for f in self.files:
            st = f.path.stat()
            out.append([f.label, st.st_size, st.st_mtime_ns])
        return out


def _find_iteration(src: Path) -> tuple[Path, int | None]:
    if not src.is_dir():
        raise FormatError(f"{src}: no such checkpoint directory")
    if any(_RANK_DIR.match(p.name) for p in src.iterdir()):  # an iteration directory itself
        it = iteration_of(src.name)
        return src, it if it is not None else (0 if src.name == RELEASE else None)
    from checkpoint.safety import read_pointer

    tracker = src / TRACKER
    text = read_pointer(src, TRACKER)  # a regular file of <= 4 KiB, or an error
    if text is None:
        raise FormatError(f"{src}: not a Megatron-LM torch checkpoint: no {TRACKER} and no mp_rank_* directories")
    text = text.strip()
    if text == RELEASE:
        name, iteration = RELEASE, 0
    else:
        try:
            iteration = int(text)
        except ValueError:
            raise FormatError(f"{tracker}: holds {text[:40]!r}, not an iteration number or 'release'") from None
        if iteration < 0:
            raise FormatError(f"{tracker}: negative iteration {iteration}")
        name = iter_dirname(iteration)
    d = src / name
    if not d.is_dir():
        raise FormatError(f"{tracker}: names iteration {text!r}, but {d} is missing")
    return d, iteration


def _dir_name(arity: int, tp: int, pp: int, ep: int, second_is_ep: bool) -> str:
    if arity == 1:
        return f"mp_rank_{tp:02d}"
    if arity == 2:
        return f"mp_rank_{tp:02d}_{ep if second_is_ep else pp:03d}"
    return f"mp_rank_{tp:02d}_{pp:03d}_{ep:03d}"


def is_legacy_checkpoint(path: str | Path) -> bool:
    """Whether `path` looks like a Megatron-LM `--ckpt-format torch` checkpoint (root or iteration directory): for
    a CLI that picks the reader by looking (torch_dist iterations have metadata.json and .distcp files instead)."""
    try:
        d, _ = _find_iteration(Path(path))
    except FormatError:
        return False
    return any(_RANK_DIR.match(p.name) and p.is_dir() for p in d.iterdir())


def read_legacy_args(src_root: str | Path) -> argparse.Namespace:
    """The Megatron-LM `args` saved in the first rank file (for config_from_megatron_args)."""
    d, _ = _find_iteration(Path(src_root))
    for rank0 in [p for p in d.iterdir() if re.match(r"^mp_rank_00(_000){0,2}$", p.name) and p.is_dir()][:1]:
        for name in MODEL_FILES:
            if os.path.lexists(rank0 / name):  # a FIFO there is named by load_rank_file, never "missing"
                args = load_rank_file(rank0 / name).get("args")
                if not isinstance(args, argparse.Namespace):
                    raise FormatError(f"{rank0 / name}: holds no Megatron-LM args; pass the model config "
                                      "(e.g. --hf-config)")
                return args
    raise FormatError(f"{d}: no mp_rank_00* directory with {' or '.join(MODEL_FILES)}")


def open_legacy(src_root: str | Path, cfg: ModelConfig) -> LegacySource:
    """Find the iteration and its rank files, work out the layout (tp, pp, ep from the directory names and args;
    vpp from the model chunks) and check it against `cfg`."""
    root = Path(src_root)
    iter_dir, iteration = _find_iteration(root)
    found: dict[tuple[int, ...], Path] = {}
    for p in iter_dir.iterdir():
        m = _RANK_DIR.match(p.name)
        if m and p.is_dir():
            found[tuple(int(g) for g in m.groups() if g is not None)] = p
    arities = {len(k) for k in found}
    if not found:
        raise FormatError(f"{iter_dir}: no mp_rank_* directories; not a Megatron-LM torch checkpoint")
    if len(arities) > 1:
        names = ", ".join(sorted(p.name for p in found.values())[:4])
        raise FormatError(f"{iter_dir}: rank directories mix naming schemes ({names})")
    arity = arities.pop()

    def model_file(d: Path) -> Path:
        for name in MODEL_FILES:
            if os.path.lexists(d / name):  # what is there is checked where it is read (a FIFO: one line)
                return d / name
        raise FormatError(f"{d}: no {' or '.join(MODEL_FILES)}")

    first_dir = found.get(min(found))
    if min(found) != (0,) * arity:
        raise FormatError(f"{iter_dir}: missing rank directory {'mp_rank_00' + '_000' * (arity - 1)}")
    first = model_file(first_dir)
    label0 = str(first)
    state = load_rank_file(first)
    args = state.get("args")
    if args is not None and not isinstance(args, argparse.Namespace):
        raise FormatError(f"{label0}: 'args' is a {type(args).__name__}, not an argparse.Namespace")
    version = state.get("checkpoint_version")
    vpp = len(model_chunks(state, label0))
    if iteration is None:
        it = state.get("iteration")
        iteration = it if isinstance(it, int) and not isinstance(it, bool) and it >= 0 else 0

    # which dimension a two-part name carries: Megatron adds the pipeline rank when pp > 1, the expert rank when ep > 1
    pp_a, ep_a = int_arg(args, "pipeline_model_parallel_size", label0), int_arg(args, "expert_model_parallel_size",
                                                                               label0)
    second_is_ep = False
    if arity == 2:
        if pp_a is not None or ep_a is not None:
            second_is_ep = (ep_a or 1) > 1 and (pp_a or 1) == 1
        elif cfg.is_moe and (0, 1) in found:  # no args: expert ranks all hold the embedding, later stages do not
            peek = load_rank_file(model_file(found[(0, 1)]))
            chunks = model_chunks(peek, str(found[(0, 1)]))
            sd = peek[chunks[0]]
            second_is_ep = isinstance(sd, Mapping) and "embedding.word_embeddings.weight" in sd
            del peek, sd
    detected = [max(k[i] for k in found) + 1 for i in range(arity)]
    tp = detected[0]
    pp = detected[1] if arity == 3 or (arity == 2 and not second_is_ep) else 1
    ep = detected[2] if arity == 3 else (detected[1] if arity == 2 and second_is_ep else 1)
    tp_a = int_arg(args, "tensor_model_parallel_size", label0)
    want = {"tensor_model_parallel_size": (tp_a, tp), "pipeline_model_parallel_size": (pp_a, pp),
            "expert_model_parallel_size": (ep_a, ep)}
    for name, (a, d) in want.items():
        if a is not None and a < d:
            raise FormatError(f"{iter_dir}: rank directories go up to {name.split('_')[0]} rank {d - 1}, but "
                              f"{label0} args say {name}={a}")
    tp, pp, ep = tp_a or tp, pp_a or pp, ep_a or ep
    if arity == 1 and (pp > 1 or ep > 1) or arity == 2 and pp > 1 and ep > 1:
        raise FormatError(f"{iter_dir}: directory names {first_dir.name}... do not carry the pipeline/expert rank, but "
                          f"{label0} args say pp={pp}, ep={ep}")

    def dir_key(t: int, p: int, e: int) -> tuple[int, ...]:
        return (t,) if arity == 1 else ((t, e if second_is_ep else p) if arity == 2 else (t, p, e))

    files = []
    for t, p, e in itertools.product(range(tp), range(pp), range(ep)):
        d = found.get(dir_key(t, p, e))
        if d is None:
            raise FormatError(f"{iter_dir}: missing rank directory {_dir_name(arity, t, p, e, second_is_ep)} "
                              f"(tp={tp}, pp={pp}, ep={ep}; found {len(found)} of {tp * pp * ep})")
        files.append(RankFile(t, p, e, model_file(d)))
    extra = sorted(found[k].name for k in set(found) - {dir_key(f.tp, f.pp, f.ep) for f in files})
    if extra:
        raise FormatError(f"{iter_dir}: unexpected rank directory {extra[0]} for tp={tp}, pp={pp}, ep={ep}")

    vpp_a = int_arg(args, "virtual_pipeline_model_parallel_size", label0)
    if vpp_a is not None and vpp_a != vpp:
        raise FormatError(f"{label0}: args say virtual_pipeline_model_parallel_size={vpp_a}, but the file holds "
                          f"{vpp} model chunk(s)")
    etp = int_arg(args, "expert_tensor_parallel_size", label0)
    if cfg.is_moe and etp is not None and etp != tp:
        raise LayoutError(f"{label0}: expert_tensor_parallel_size={etp} differs from tensor_model_parallel_size={tp}; "
                          "legacy rank files do not say which expert-TP rank they hold, so only etp == tp is "
                          "supported (convert from --ckpt-format torch_dist instead)")
    # uneven pipeline stages: Megatron-LM saves them like any others (each stage's own layers, numbered from 0 in its
    # file); where they sit comes from the split flags in the args (no args: the even split)
    try:
        split = PipelineSplit.from_args(args)
    except LayoutError as e:
        raise LayoutError(f"{label0}: the args' pipeline split: {e}") from None
    for name, ours in (("num_layers_in_first_pipeline_stage", "first"), ("num_layers_in_last_pipeline_stage", "last")):
        if arg(args, name) is not None and arg(args, name) != getattr(split or PipelineSplit(), ours):
            raise FormatError(f"{label0}: args.{name}={arg(args, name)!r} disagrees with "
                              f"args.decoder_{ours}_pipeline_num_layers={getattr(split or PipelineSplit(), ours)!r}")
    if version is not None and (not isinstance(version, (int, float)) or version < CHECKPOINT_VERSION):
        raise FormatError(f"{label0}: checkpoint_version {version!r}: only megatron-core checkpoints (version "
                          f"{CHECKPOINT_VERSION}, QKV grouped by query group) are supported")
    cfg = with_args_vocab(cfg, args, tp, label0)
    check_args(args, cfg, label0)
    layout = Layout(tp=tp, pp=pp, vpp=vpp, ep=ep, split=split)
    try:
        layout.check(cfg)
    except LayoutError as e:
        flags = "".join(" " + f for f in split.flags()) if split else ""
        raise LayoutError(f"{iter_dir}: the checkpoint's layout (tp={tp}, pp={pp}, vpp={vpp}, ep={ep}{flags}) does "
                          f"not fit the model config: {e}") from None
    return LegacySource(root, iter_dir, iteration, layout, files, args, cfg, version)


# -- module keys -> canonical tensors ----------------------------------------------------------------------------------

_LAYER_KEY = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_MTP_KEY = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")
_SEQ_EXPERT = re.compile(r"^(.*)mlp\.experts\.local_experts\.(\d+)\.(.+)$")  # SequentialMLP
_TE_EXPERT = re.compile(r"^(.*)mlp\.experts\.(linear_fc[12]\.(?:weight|bias))(\d+)$")  # TEGroupedMLP
_EXPERTS = "mlp.experts.experts."


def _expert(rest: str) -> tuple[str, int | None]:
    m = _SEQ_EXPERT.match(rest)
    if m:
        return m.group(1) + _EXPERTS + m.group(3), int(m.group(2))
    m = _TE_EXPERT.match(rest)
    if m:
        return m.group(1) + _EXPERTS + m.group(2), int(m.group(3))
    return rest, None


def resolve_key(key: str, layer_start: int, cfg: ModelConfig, names: set[str]) -> tuple[str, tuple[int, ...]] | None:
    """(canonical name, index into the rank's local lead axes) of one module state-dict key, or None when the key is
    not a tensor of this model. Layer indices in `key` are local to the model chunk starting at global layer
    `layer_start`; expert indices are local to the expert rank."""
    m = _LAYER_KEY.match(key)
    if m:
        j, rest = int(m.group(1)), m.group(2)
        rest, e = _expert(rest)
        if cfg.heterogeneous:
            base, lead = f"decoder.layers.{layer_start + j}.", ()
        else:
            base, lead = "decoder.layers.", (j,)
    else:
        m = _MTP_KEY.match(key)
        if m:
            rest = m.group(2).replace("mtp_model_layer.", "transformer_layer.")
            rest, e = _expert(rest)
            base, lead = f"mtp.layers.{m.group(1)}.", ()
        else:
            return (key, ()) if key in names and not key.startswith(("decoder.layers.", "mtp.")) else None
    if e is not None:
        lead += (e,)
    for name in (base + c for c in canonical_candidates(rest)):  # the local spec's separate norms: TE names
        if name in names:
            return name, lead
    return None


def _display_key(spec: TensorSpec, lead: tuple[int, ...], layer_start: int) -> str:
    """A module state-dict key for an expected (tensor, lead index) slot, for messages (canonical TE naming)."""
    name = spec.name
    rest_lead = list(lead)
    if spec.per_layer:
        j = rest_lead.pop(0)
        name = f"decoder.layers.{j}." + name[len("decoder.layers."):]
    elif spec.layer is not None:
        name = f"decoder.layers.{spec.layer - layer_start}." + name[len(f"decoder.layers.{spec.layer}."):]
    if spec.expert:
        e = rest_lead.pop(0)
        name = name.replace(_EXPERTS, f"mlp.experts.local_experts.{e}.")
    return name


@dataclass(frozen=True)
class Piece:
    """One storage chunk of a canonical tensor and where it lies in one rank file."""

    chunk: str  # "model" / "model0", ...
    key: str  # module state-dict key
    task: Task  # canonical tensor and the chunk's global box (lead axes of size 1)
    local: tuple[slice, ...]  # the chunk's box in the file tensor
    write: bool  # written from this file; otherwise a copy checked against what was written


def _lead_boxes(r, spec: TensorSpec, lead: tuple[int, ...]) -> list[tuple[int, int]] | None:
    boxes = []
    for a in range(spec.lead):
        i = lead[a]
        if not r.local_offset[a] <= i < r.local_offset[a] + r.shape[a]:
            return None
        g = r.global_offset[a] + i - r.local_offset[a]
        boxes.append((g, g + 1))
    return boxes


def _chunk_pieces(spec: TensorSpec, entry: TensorEntry, r, lead: tuple[int, ...], chunk_key: str, key: str,
                  write: bool) -> list[Piece]:
    boxes = _lead_boxes(r, spec, lead)
    if boxes is None:
        return []
    nl = spec.lead
    ranges = []
    for a in range(nl, len(spec.shape)):
        lo, n, c = r.global_offset[a], r.shape[a], entry.chunk[a]
        if lo % c or n % c:  # the destination layout is the source's, so regions are whole chunks
            raise ShardkitError(f"internal: tensor {spec.name}: region {lo}+{n} on axis {a} is not whole chunks of {c}")
        ranges.append(range(lo, lo + n, c))
    out = []
    for offs in itertools.product(*ranges):
        box, local = list(boxes), []
        for k, o in enumerate(offs):
            a = nl + k
            c = entry.chunk[a]
            box.append((o, o + c))
            lo = r.local_offset[a] + o - r.global_offset[a]
            local.append(slice(lo, lo + c))
        out.append(Piece(chunk_key, key, Task(spec.name, tuple(b[0] for b in boxes), tuple(box)), tuple(local), write))
    return out


def plan_rank_file(state: dict, rf: RankFile, cfg: ModelConfig, layout: Layout, specs: dict[str, TensorSpec],
                   entries: dict[str, TensorEntry]) -> list[Piece]:
    """Map every model tensor of one rank file to the storage chunks it holds. Entries of canonical tensors seen for
    the first time are added to `entries` (dtype from the file). Raises FormatError naming the file and the keys for
    missing, unexpected, duplicate or misshapen tensors, or a dtype that differs between ranks."""
    label = rf.label
    chunks = model_chunks(state, label)
    if len(chunks) != layout.vpp:
        raise FormatError(f"{label}: holds {len(chunks)} model chunk(s) ({', '.join(chunks)}), but the checkpoint "
                          f"has {layout.vpp} virtual pipeline stage(s)")
    L = cfg.num_layers
    names = set(specs)
    coord = rf.coord
    pieces: list[Piece] = []
    for v, ck in enumerate(chunks):
        sd = state[ck]
        if not isinstance(sd, Mapping):
            raise FormatError(f"{label}: '{ck}' is a {type(sd).__name__}, not a module state dict")
        if any(isinstance(k, str) and k.startswith("language_model.") for k in sd):
            raise FormatError(f"{label}: '{ck}' holds a legacy Megatron-LM model (language_model.* keys), not a "
                              "megatron-core GPTModel; only megatron-core models are supported")
        start = layout.layer_range(L, rf.pp, v)[0]
        last_chunk = rf.pp == layout.pp - 1 and v == layout.vpp - 1
        first_chunk = rf.pp == 0 and v == 0
        expected: dict[tuple[str, tuple[int, ...]], str] = {}
        regs: dict[str, list] = {}
        for spec in specs.values():
            rs = [r for r in regions(spec, layout, coord, L) if r.vstage == v]
            if not rs:
                continue
            regs[spec.name] = rs
            for r in rs:
                for lead in itertools.product(*[range(r.local_offset[a], r.local_offset[a] + r.shape[a])
                                                for a in range(spec.lead)]):
                    expected.setdefault((spec.name, lead), _display_key(spec, lead, start))
        seen: dict[tuple[str, tuple[int, ...]], str] = {}
        unexpected: list[str] = []
        for key, value in sd.items():
            if not isinstance(key, str):
                unexpected.append(repr(key))
                continue
            if key.endswith("_extra_state"):  # Transformer Engine / FP8 metadata: not weights
                continue
            tied = False
            res = resolve_key(key, start, cfg, names)
            if res is None and key == "output_layer.weight" and cfg.tie_word_embeddings and last_chunk \
                    and not first_chunk:
                # tied embeddings with pipeline stages: the last stage keeps its own copy of the word embeddings
                res, tied = ("embedding.word_embeddings.weight", ()), True
            if res is None or (not tied and res not in expected):
                unexpected.append(key)
                continue
            name, lead = res
            slot = (name, lead, tied)
            if slot in seen:
                raise FormatError(f"{label}: '{ck}': keys {seen[slot]} and {key} hold the same tensor ({name})")
            seen[slot] = key
            spec = specs[name]
            if not isinstance(value, torch.Tensor):
                raise FormatError(f"{label}: '{ck}': {key} is a {type(value).__name__}, not a tensor")
            want = local_shape(spec, layout)[spec.lead:]
            if tuple(value.shape) != tuple(want):
                raise FormatError(f"{label}: '{ck}': {key} has shape {list(value.shape)}, but the model config and "
                                  f"layout (tp={layout.tp}, pp={layout.pp}, ep={layout.ep}) imply {list(want)}")
            try:
                dt = store.dtype_name(value.dtype)
            except ShardkitError:
                raise FormatError(f"{label}: '{ck}': {key} has dtype {value.dtype}, not a supported float type") \
                    from None
            entry = entries.get(name)
            if entry is None:
                entry = entries[name] = TensorEntry.of(spec, layout, dt)
            elif entry.dtype != dt:
                raise FormatError(f"{label}: '{ck}': {key} is {dt}, but other ranks hold {name} as {entry.dtype}")
            if tied:
                src = RankCoord(tp=coord.tp, pp=0, ep=coord.ep, etp=coord.etp)
                for r in regions(spec, layout, src, L):
                    pieces += _chunk_pieces(spec, entry, r, lead, ck, key, write=False)
                continue
            for r in regs[name]:
                write = r.primary and (spec.expert or coord.ep == 0)
                pieces += _chunk_pieces(spec, entry, r, lead, ck, key, write)
        missing = [shown for slot, shown in expected.items() if (*slot, False) not in seen]
        if missing or unexpected:
            parts = []
            if missing:
                parts.append(f"{len(missing)} key(s) the model config needs are missing, e.g. {', '.join(missing[:3])}")
            if unexpected:
                hint = ""
                if "output_layer.weight" in unexpected and cfg.tie_word_embeddings:
                    hint = " (the model config ties the embeddings; was the model trained untied?)"
                elif any(".experts.weight1" in k or ".experts.weight2" in k for k in unexpected):
                    hint = " (legacy GroupedMLP expert weights are not supported; use SequentialMLP or TEGroupedMLP)"
                parts.append(f"{len(unexpected)} key(s) are not part of the model config, e.g. "
                             f"{', '.join(unexpected[:3])}{hint}; refusing to drop them silently")
            raise FormatError(f"{label}: '{ck}': " + "; ".join(parts))
    return pieces


# -- worker side ----------------------------------------------------------------------------------------------------

class _Worker:
    """Writes (or checks) the chunks of rank files, one file held at a time (convert.writer.Workers)."""

    def __init__(self, cfg_dict: dict, layout_dict: dict, out_dir: str, entries: dict[str, dict]) -> None:
        torch.set_num_threads(1)
        self.cfg = ModelConfig.from_dict(cfg_dict)
        self.layout = Layout.from_dict(layout_dict)
        self.entries = {n: TensorEntry(**e) for n, e in entries.items()}
        self.specs = {s.name: s for s in model_specs(self.cfg, self.layout)}
        self.out = Path(out_dir)
        self.sink = ChunkSink(out_dir, {n: e.dtype for n, e in self.entries.items()})
        self.cache: tuple | None = None
        self.arrays: dict = {}
        self.ctx = store.context()

    def _open(self, rf: RankFile) -> tuple[dict, dict[str, Piece]]:
        """The rank file and its pieces by chunk id; one file is held at a time."""
        if self.cache is not None and self.cache[0] == rf:
            return self.cache[1], self.cache[2]
        self.cache = None
        state = load_rank_file(rf.path)
        pieces = plan_rank_file(state, rf, self.cfg, self.layout, self.specs, dict(self.entries))
        by_id: dict[str, Piece] = {}
        for p in pieces:
            by_id.setdefault(p.task.id + ("" if p.write else "|copy"), p)
        self.cache = (rf, state, by_id)
        return state, by_id

    def __call__(self, job: tuple, report: Callable | None = None) -> tuple[str, list[tuple[str, int]]]:
        """Write (or check) some chunks of one rank file. Returns the written chunk ids, or reports each one as soon
        as it is durable when run in-process (`report`)."""
        kind, rf, ids, writers = job
        state, by_id = self._open(rf)
        done = []
        if kind == "write":
            for i in ids:
                result = self.sink.write(by_id[i].task, _value(state, by_id[i]))
                if report is not None:
                    report((kind, [result]))
                else:
                    done.append(result)
            return kind, done
        for i in ids:  # a copy: compare bit for bit with the chunk written from its owner's file
            p = by_id[i + "|copy"]
            name = p.task.name
            arr = self.arrays.get(name)
            if arr is None:
                arr = self.arrays[name] = store.open_existing(self.out / tensor_path(name), self.ctx, name)
            stored = store.read(arr, p.task.index, name)
            value = _value(state, p).to(stored.dtype)
            if not _same_bits(value, stored):
                box = ", ".join(f"{a}:{b}" for a, b in p.task.box)
                raise FormatError(f"{rf.label}: '{p.chunk}': {p.key} differs from the copy in {writers.get(i, '?')} "
                                  f"(tensor {name}[{box}]); Megatron keeps these copies identical, so the checkpoint "
                                  "is inconsistent")
        return kind, done


def _value(state: dict, p: Piece) -> torch.Tensor:
    t = state[p.chunk][p.key][p.local]
    return t.reshape((1,) * len(p.task.lead) + tuple(t.shape))


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))


def _run_rounds(rounds: list[list[tuple]], args: tuple, nworkers: int, on_result: Callable) -> None:
    """Every chunk is written (first round) before any copy is compared with it (second round)."""
    with Workers(_Worker, args, nworkers) as pool:
        for jobs in rounds:
            if pool.local is not None:
                for job in jobs:
                    on_result(pool.local(job, on_result))
            else:
                for result in pool.run(jobs):
                    on_result(result)


# -- main side ------------------------------------------------------------------------------------------------------

def _jsonable(d: dict) -> dict:
    return json.loads(json.dumps(d, default=str))


def legacy_to_native(src_root: str | Path, out: str | Path, cfg: ModelConfig, *, overwrite: bool = False,
                     quiet: bool = False, workers: int | None = None, hf_dir: str | Path | None = None) -> Path:
    """Convert the model weights of a Megatron-LM `--ckpt-format torch` checkpoint (a root with
    latest_checkpointed_iteration.txt, or one iter_N / release directory) into a native checkpoint `<out>/iter_N` with
    the same layout. `cfg` describes the model (ModelConfig.from_hf_dir, or config_from_megatron_args); `hf_dir`
    optionally supplies tokenizer files to carry along. Returns the iteration directory."""
    from checkpoint.safety import check_output

    check_output(out, [("SRC", src_root), ("--hf-config", hf_dir)])
    src = open_legacy(src_root, cfg)
    cfg, layout = src.cfg, src.layout
    dest = Path(out).resolve()
    if dest in (src.root.resolve(), src.iter_dir.resolve()) or src.iter_dir.resolve() in dest.parents:
        raise ShardkitError(f"{out}: the destination is the legacy checkpoint itself; write the native checkpoint "
                            "elsewhere")
    specs = {s.name: s for s in model_specs(cfg, layout)}
    entries: dict[str, TensorEntry] = {}
    plans: dict[RankFile, list[Piece]] = {}
    writers: dict[str, str] = {}
    for rf in src.files:  # validate every file before anything is written; tensor bytes are not read here
        state = load_rank_file(rf.path)
        pieces = plan_rank_file(state, rf, cfg, layout, specs, entries)
        del state
        plans[rf] = pieces
        for p in pieces:
            if p.write:
                if p.task.id in writers:
                    raise ShardkitError(f"internal: chunk {p.task.id} written from {writers[p.task.id]} and {rf.label}")
                writers[p.task.id] = rf.short
    tasks = chunk_tasks({n: entries[n] for n in specs if n in entries})
    uncovered = [t.id for t in tasks if t.id not in writers]
    if set(entries) != set(specs) or uncovered:
        example = (uncovered or sorted(set(specs) - set(entries)))[0]
        raise ShardkitError(f"internal: chunks without a source rank, e.g. {example}")
    entries = {n: entries[n] for n in specs}
    nbytes = {t.id: t.nbytes(entries[t.name]) for t in tasks}
    from checkpoint.hf_source import content_fingerprint

    # the resume record: each rank file's identity and sampled content too (issue 34: size and mtime alone let a
    # rewritten rank file resume the chunks of the old one)
    job = {"tool": VERSION, "command": "megatron-to-mcore", "source": str(src.iter_dir.resolve()),
           "files": [[*f, content_fingerprint(rf.path)] for f, rf in zip(src.fingerprint(), src.files)],
           "layout": layout.to_dict(), "model": _jsonable(cfg.to_dict())}
    started = time.time()
    with IterationWriter(out, src.iteration, job, overwrite=overwrite) as w:
        create_arrays(w, entries)
        write_jobs, check_jobs = [], []
        for rf, pieces in plans.items():
            batch, size = [], 0
            for p in pieces:
                if p.write and not w.is_done(p.task.id):
                    batch.append(p.task.id)
                    size += nbytes[p.task.id]
                    if size >= BATCH_BYTES:
                        write_jobs.append(("write", rf, batch, {}))
                        batch, size = [], 0
            if batch:
                write_jobs.append(("write", rf, batch, {}))
            copies = [p.task.id for p in pieces if not p.write]
            if copies:
                check_jobs.append(("check", rf, copies, {i: writers[i] for i in copies}))
        total = sum(nbytes.values())
        left = sum(nbytes[i] for _, _, ids, _ in write_jobs for i in ids)
        if left < total and not quiet:
            print(f"resuming: {len(tasks) - sum(len(j[2]) for j in write_jobs)} of {len(tasks)} chunks already "
                  "written", file=sys.stderr)
        nworkers = workers or max(1, min(os.cpu_count() or 1, left // WORKER_MIN_BYTES))
        nworkers = max(1, min(nworkers, max(len(write_jobs), len(check_jobs), 1)))
        init_args = (cfg.to_dict(), layout.to_dict(), str(w.partial), {n: vars(e) for n, e in entries.items()})
        with progress_bar("megatron-to-mcore", total=total, items=len(tasks), disable=quiet) as bar:
            bar.advance(total - left, len(tasks) - sum(len(j[2]) for j in write_jobs))

            def on_result(result: tuple[str, list[tuple[str, int]]]) -> None:
                for task_id, n in result[1]:
                    w.mark_done(task_id)
                    bar.advance(n, 1)

            _run_rounds([write_jobs, check_jobs], init_args, nworkers, on_result)
        if hf_dir is not None:
            from checkpoint.hf_source import copy_assets

            copy_assets(hf_dir, w.path("hf"))
        manifest = Manifest(
            iteration=src.iteration, model=cfg, layout=layout, tensors=entries,
            provenance={"tool": f"shardkit {VERSION}", "command": "convert megatron-to-mcore",
                        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                        "source": {"kind": "megatron_legacy", "path": str(src.iter_dir.resolve()),
                                   "iteration": src.iteration, "checkpoint_version": src.checkpoint_version,
                                   "layout": layout.to_dict(), "files": src.fingerprint()},
                        "seconds": round(time.time() - started, 3)})
        return w.commit(manifest)


__all__ = ["legacy_to_native", "config_from_megatron_args", "read_legacy_args", "is_legacy_checkpoint",
           "load_rank_file", "open_legacy", "plan_rank_file", "resolve_key", "SAFE_GLOBALS"]
