"""The sharding table's entries (canonical tensors, their global shapes and partition rules) and the regions a rank
owns. The entries of a model are its family's tensor table (checkpoint.families.model_specs).

Canonical names are Megatron-Core's sharded-state-dict keys with Transformer Engine naming. A homogeneous stack drops
the layer index and prepends a layer axis (`decoder.layers.mlp.linear_fc1.weight`, shape [L, ...]); a stack that mixes
dense and MoE layers (DeepSeek's first dense layers) uses per-layer keys `decoder.layers.{i}.…`, as megatron-core does.
Expert tensors carry an expert axis right after the layer axis. The converter, the trainer and every reader go through
`regions()`; nobody else computes a slice.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum
from typing import TypeVar

import numpy as np

from .layout import Layout, RankCoord

_Array = TypeVar("_Array")  # a numpy array or a torch tensor


class Rule(str, Enum):
    REPLICATED = "replicated"  # every TP rank holds the whole tensor
    COLUMN = "column"          # split along the output axis
    ROW = "row"                # split along the input axis
    VOCAB = "vocab"            # column split of a vocab-padded axis
    QKV = "qkv"                # column split; whole query groups per rank (the fused layout guarantees this)
    GATE_UP = "gate_up"        # column split of [gate; up]: rank i holds [gate_i; up_i]


_AXIS = {Rule.COLUMN: 0, Rule.VOCAB: 0, Rule.QKV: 0, Rule.GATE_UP: 0, Rule.ROW: 1}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]  # global shape; leading axis = layers when per_layer, then experts when expert
    rule: Rule
    per_layer: bool  # stacked: leading layer axis, split by PP/VPP
    expert: bool = False  # expert axis (after the layer axis), split by EP; its TP split uses the expert TP size
    layer: int | None = None  # per-layer key of a heterogeneous stack: the global layer it belongs to
    stage: str | None = None  # "first" / "last": the pipeline stage of a tensor outside the decoder layers
    # a replicated tensor's gradient over TP: "sp" = partial under sequence parallelism (it sees this rank's slice of
    # the sequence: norms, routers, MLA's down-projections), summed over TP then; "always" = partial whatever the
    # flags (it sees this rank's heads only: megatron-core's q/k layernorms); None = whole on every rank. "auto":
    # "sp" for REPLICATED tensors, None otherwise
    tp_grad: str | None = "auto"

    def __post_init__(self) -> None:
        if self.tp_grad == "auto":
            object.__setattr__(self, "tp_grad", "sp" if self.rule is Rule.REPLICATED else None)
        if self.tp_grad not in ("sp", "always", None):
            raise ValueError(f"{self.name}: tp_grad {self.tp_grad!r}")

    @property
    def lead(self) -> int:
        """Number of leading layer/expert axes before the tensor's own axes."""
        return int(self.per_layer) + int(self.expert)

    @property
    def tp_axis(self) -> int | None:
        """Axis of the global array that TP (or expert TP) splits (None when replicated)."""
        if self.rule is Rule.REPLICATED:
            return None
        return _AXIS[self.rule] + self.lead


@dataclass(frozen=True)
class Region:
    """A box of the global array and where it sits in a rank's local tensor of model chunk `vstage`."""

    global_offset: tuple[int, ...]
    shape: tuple[int, ...]
    local_offset: tuple[int, ...]
    vstage: int
    primary: bool  # False for TP replicas of replicated tensors (Megatron replica_id != 0)

    def global_slices(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + s) for o, s in zip(self.global_offset, self.shape))

    def local_slices(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + s) for o, s in zip(self.local_offset, self.shape))


SCALE_SUFFIX = "_scale_inv"


def fp8_scale_specs(specs: list[TensorSpec], fp8: dict | None) -> list[TensorSpec]:
    """Block-FP8 weights kept as FP8 (`--keep-fp8`): each listed weight gets `<name>_scale_inv`, one fp32 scale per
    [br, bc] block, with the weight's own partition rule in block units (so a rank's scales sit beside its weights)."""
    if not fp8:
        return []
    br, bc = fp8["block"]
    by = {s.name: s for s in specs}
    out = []
    for name in fp8["tensors"]:
        w = by[name]
        r, c = w.shape[w.lead:]
        out.append(TensorSpec(name + SCALE_SUFFIX, (*w.shape[:w.lead], -(-r // br), -(-c // bc)), w.rule, w.per_layer,
                              w.expert, w.layer, w.stage))
    return out


# Optimizer state of a training checkpoint: one fp32 array per state and model tensor, with the model tensor's global
# shape and partition rule, so it reshards like the weights. Keys are megatron-core's distributed-optimizer
# model-space keys (`optimizer.state.<state>.<model key>`, DistributedOptimizer.sharded_param_state_fs_model_space).
OPTIMIZER_STATES = ("fp32_param", "exp_avg", "exp_avg_sq")
OPTIMIZER_PREFIX = "optimizer.state."


def optimizer_key(state: str, name: str) -> str:
    """The key of optimizer state `state` (one of OPTIMIZER_STATES) of model tensor `name`."""
    if state not in OPTIMIZER_STATES:
        raise ValueError(f"unknown optimizer state {state!r}; expected one of {OPTIMIZER_STATES}")
    return f"{OPTIMIZER_PREFIX}{state}.{name}"


def split_optimizer_key(key: str) -> tuple[str, str] | None:
    """(state, model tensor name) of an optimizer key; None for a model tensor."""
    if not key.startswith(OPTIMIZER_PREFIX):
        return None
    state, _, name = key[len(OPTIMIZER_PREFIX):].partition(".")
    return (state, name) if state in OPTIMIZER_STATES and name else None


def vocab_fill(name: str, last_row: _Array, rows: int) -> _Array:
    """The one vocab-padding rule (docs/FORMAT.md): the `rows` padding rows of vocab tensor `name` (or of its
    optimizer state) after its last real row `last_row` (shape [1, ...], numpy or torch) are that row repeated, as
    Megatron's converter pads; the Adam moments' (exp_avg, exp_avg_sq: no update history) are zeros. A broadcast
    view, not a copy."""
    shape = (rows, *last_row.shape[1:])
    moment = (split_optimizer_key(name) or ("fp32_param",))[0] != "fp32_param"
    if isinstance(last_row, np.ndarray):
        return np.broadcast_to(np.zeros_like(last_row) if moment else last_row, shape)
    import torch

    return (torch.zeros_like(last_row) if moment else last_row).expand(*shape)


def optimizer_specs(specs: list[TensorSpec], states: tuple[str, ...] | list[str] = OPTIMIZER_STATES
                    ) -> list[TensorSpec]:
    """The optimizer-state tensors of `specs` (model tensors): the same specs renamed, state by state."""
    return [replace(s, name=optimizer_key(st, s.name)) for st in states for s in specs]


def check_fp8_layout(specs: list[TensorSpec], fp8: dict | None, layout: Layout) -> None:
    """Kept FP8 weights must split on block boundaries, so every rank holds whole blocks and their scales."""
    if not fp8:
        return
    from .errors import LayoutError

    br, bc = fp8["block"]
    by = {s.name: s for s in specs}
    for name in fp8["tensors"]:
        w = by[name]
        if w.tp_axis is None:
            continue
        parts = _tp_size(w, layout) * (2 if w.rule is Rule.GATE_UP else 1)
        if parts == 1:
            continue
        n = w.shape[w.tp_axis] // parts
        b = br if w.tp_axis == w.lead else bc
        if n % b:
            raise LayoutError(f"--keep-fp8: {name} splits into {n}-wide pieces at this layout (tp/etp "
                              f"{_tp_size(w, layout)}), not a multiple of the {b}-wide FP8 block; use a smaller tp or "
                              "dequantize (--dtype bf16 without --keep-fp8)")


# -- layout math (pure) ------------------------------------------------------------------------------------------------

def _tp_size(spec: TensorSpec, layout: Layout) -> int:
    return layout.expert_tp if spec.expert else layout.tp


def local_shape(spec: TensorSpec, layout: Layout, pp_rank: int = 0, vstage: int = 0) -> tuple[int, ...]:
    """Shape of one rank's local tensor for model chunk `vstage` of pipeline rank `pp_rank` (a stacked tensor's layer
    count differs between chunks only with an uneven pipeline split)."""
    shape = list(spec.shape)
    if spec.per_layer:
        shape[0] = layout.layer_count(spec.shape[0], pp_rank, vstage)
    if spec.expert:
        shape[int(spec.per_layer)] //= layout.ep
    if spec.tp_axis is not None:
        shape[spec.tp_axis] //= _tp_size(spec, layout)
    return tuple(shape)


CHUNK_MAX_BYTES = 128 << 20


def chunk_shape(spec: TensorSpec, layout: Layout, itemsize: int = 2,
                max_bytes: int = CHUNK_MAX_BYTES) -> tuple[int, ...]:
    """Storage chunk: one layer (and one expert) of the saving layout's local shard (a [gate; up] shard is two
    chunks), split further along its rows into equal parts when larger than `max_bytes`. Every rank of the saving
    layout still reads whole chunks, and no reader or writer ever holds more than one chunk per task, whatever the
    model size."""
    shape = list(local_shape(spec, layout))
    for i in range(spec.lead):
        shape[i] = 1
    if spec.rule is Rule.GATE_UP:
        shape[spec.tp_axis] //= 2
    ax = spec.tp_axis if spec.tp_axis is not None else spec.lead
    if ax < len(shape):
        rest = itemsize
        for i, s in enumerate(shape):
            if i != ax:
                rest *= s
        n = shape[ax]
        shape[ax] = max((d for d in range(1, n + 1) if n % d == 0 and d * rest <= max_bytes), default=1)
    return tuple(shape)


def owner(spec: TensorSpec, layout: Layout, num_layers: int | None = None) -> tuple[int, int] | None:
    """(pp_rank, vstage) holding a tensor that is not stacked; None for stacked tensors (every stage holds some).
    Per-layer keys of a heterogeneous stack need the model's `num_layers` to place their layer."""
    if spec.per_layer:
        return None
    if spec.layer is not None:
        if num_layers is None:
            raise ValueError(f"{spec.name}: owner of a per-layer key needs num_layers")
        return layout.chunk_of_layer(spec.layer, num_layers)
    if spec.stage == "first":
        return 0, 0
    return layout.pp - 1, layout.vpp - 1


def regions(spec: TensorSpec, layout: Layout, coord: RankCoord, num_layers: int | None = None) -> list[Region]:
    """The boxes of `spec`'s global array owned by the rank at `coord`, for each of its model chunks.

    Dense tensors read coord.tp; expert tensors read coord.ep and coord.etp (see RankCoord)."""
    if spec.per_layer:
        vstages = list(range(layout.vpp))
    else:
        pp_rank, vstage = owner(spec, layout, num_layers)
        if coord.pp != pp_rank:
            return []
        vstages = [vstage]
    ax = spec.tp_axis
    tp_rank = coord.etp if spec.expert else coord.tp
    out: list[Region] = []
    for v in vstages:
        loc = local_shape(spec, layout, coord.pp, v)
        if spec.per_layer and not loc[0]:  # an empty model chunk (an uneven split may leave one)
            continue
        g_off = [0] * len(spec.shape)
        if spec.per_layer:
            g_off[0] = layout.layer_range(spec.shape[0], coord.pp, v)[0]
        if spec.expert:
            g_off[int(spec.per_layer)] = coord.ep * loc[int(spec.per_layer)]
        if ax is None:
            out.append(Region(tuple(g_off), loc, (0,) * len(loc), v, primary=(tp_rank == 0)))
        elif spec.rule is Rule.GATE_UP:
            half = loc[ax] // 2
            full = spec.shape[ax] // 2
            for part in range(2):  # gate half, then up half
                go = list(g_off)
                go[ax] = part * full + tp_rank * half
                lo = [0] * len(loc)
                lo[ax] = part * half
                sh = list(loc)
                sh[ax] = half
                out.append(Region(tuple(go), tuple(sh), tuple(lo), v, primary=True))
        else:
            go = list(g_off)
            go[ax] = tp_rank * loc[ax]
            out.append(Region(tuple(go), loc, (0,) * len(loc), v, primary=True))
    return out
