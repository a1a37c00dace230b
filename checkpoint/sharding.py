"""The one sharding table: canonical tensors, their global shapes and partition rules, and the regions a rank owns.

Canonical names are Megatron-Core's sharded-state-dict keys (TE naming, homogeneous stack: the layer index is dropped
and a leading layer axis is prepended). The converter, the trainer and every reader go through `regions()`; nobody
else computes a slice.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from .config import ModelConfig
from .layout import Layout


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
    shape: tuple[int, ...]  # global shape; leading axis = layers when per_layer
    rule: Rule
    per_layer: bool

    @property
    def tp_axis(self) -> int | None:
        """Axis of the global array that TP splits (None when replicated)."""
        if self.rule is Rule.REPLICATED:
            return None
        return _AXIS[self.rule] + (1 if self.per_layer else 0)


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


# -- the table ---------------------------------------------------------------------------------------------------------

def model_specs(cfg: ModelConfig, layout: Layout) -> list[TensorSpec]:
    """Every canonical tensor of `cfg` as stored for `layout` (vocab padding depends on layout.tp)."""
    L, h, F = cfg.num_layers, cfg.hidden_size, cfg.ffn_hidden_size
    vocab = cfg.padded_vocab_size(layout.tp)
    attn_out = cfg.num_attention_heads * cfg.kv_channels
    specs = [TensorSpec("embedding.word_embeddings.weight", (vocab, h), Rule.VOCAB, False)]

    def layer(name: str, shape: tuple[int, ...], rule: Rule) -> None:
        specs.append(TensorSpec(f"decoder.layers.{name}", (L, *shape), rule, True))

    layer("self_attention.linear_qkv.layer_norm_weight", (h,), Rule.REPLICATED)
    layer("self_attention.linear_qkv.weight", (cfg.qkv_rows, h), Rule.QKV)
    if cfg.add_qkv_bias:
        layer("self_attention.linear_qkv.bias", (cfg.qkv_rows,), Rule.QKV)
    layer("self_attention.linear_proj.weight", (h, attn_out), Rule.ROW)
    if cfg.add_proj_bias:
        layer("self_attention.linear_proj.bias", (h,), Rule.REPLICATED)
    layer("mlp.linear_fc1.layer_norm_weight", (h,), Rule.REPLICATED)
    layer("mlp.linear_fc1.weight", (2 * F, h), Rule.GATE_UP)
    if cfg.add_mlp_bias:
        layer("mlp.linear_fc1.bias", (2 * F,), Rule.GATE_UP)
    layer("mlp.linear_fc2.weight", (h, F), Rule.ROW)
    if cfg.add_mlp_bias:
        layer("mlp.linear_fc2.bias", (h,), Rule.REPLICATED)
    specs.append(TensorSpec("decoder.final_layernorm.weight", (h,), Rule.REPLICATED, False))
    if not cfg.tie_word_embeddings:
        specs.append(TensorSpec("output_layer.weight", (vocab, h), Rule.VOCAB, False))
    return specs


# -- layout math (pure) ------------------------------------------------------------------------------------------------

def local_shape(spec: TensorSpec, layout: Layout) -> tuple[int, ...]:
    """Shape of one rank's local tensor for one model chunk."""
    shape = list(spec.shape)
    if spec.per_layer:
        shape[0] //= layout.pp * layout.vpp
    if spec.tp_axis is not None:
        shape[spec.tp_axis] //= layout.tp
    return tuple(shape)


CHUNK_MAX_BYTES = 128 << 20


def chunk_shape(spec: TensorSpec, layout: Layout, itemsize: int = 2,
                max_bytes: int = CHUNK_MAX_BYTES) -> tuple[int, ...]:
    """Storage chunk: one layer of the saving layout's local shard (a [gate; up] shard is two chunks), split further
    along its rows into equal parts when larger than `max_bytes`. Every rank of the saving layout still reads whole
    chunks, and no reader or writer ever holds more than one chunk per task, whatever the model size."""
    shape = list(local_shape(spec, layout))
    if spec.per_layer:
        shape[0] = 1
    if spec.rule is Rule.GATE_UP:
        shape[spec.tp_axis] //= 2
    ax = spec.tp_axis if spec.tp_axis is not None else (1 if spec.per_layer else 0)
    if ax < len(shape):
        rest = itemsize
        for i, s in enumerate(shape):
            if i != ax:
                rest *= s
        n = shape[ax]
        shape[ax] = max((d for d in range(1, n + 1) if n % d == 0 and d * rest <= max_bytes), default=1)
    return tuple(shape)


def regions(spec: TensorSpec, layout: Layout, tp_rank: int, pp_rank: int) -> list[Region]:
    """The boxes of `spec`'s global array owned by rank (tp_rank, pp_rank), for each of its model chunks."""
    loc = local_shape(spec, layout)
    ax = spec.tp_axis
    out: list[Region] = []
    vstages = range(layout.vpp) if spec.per_layer else [0]
    for v in vstages:
        if not spec.per_layer and pp_rank != owner_pp_rank(spec, layout):
            continue
        g_off = [0] * len(spec.shape)
        if spec.per_layer:
            g_off[0] = layout.layer_range(spec.shape[0], pp_rank, v)[0]
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


def owner_pp_rank(spec: TensorSpec, layout: Layout) -> int:
    """Pipeline rank that holds a non-layer tensor: embedding on the first stage, final norm and output on the last."""
    if spec.per_layer:
        raise ValueError(f"{spec.name} is per-layer: every pipeline rank owns some of it")
    return 0 if spec.name.startswith("embedding.") else layout.pp - 1


def chunk_grid(spec: TensorSpec, layout: Layout) -> tuple[int, ...]:
    """Number of chunks along each axis."""
    return tuple(s // c for s, c in zip(spec.shape, chunk_shape(spec, layout)))
