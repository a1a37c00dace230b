"""The tensor table: every tensor of a model declared once, with all that consumers need.

A family declares one layer (and its MTP layer) through a `Table`: each entry gives the canonical name (Megatron-Core's
sharded-state-dict key, TE naming), the global shape, the partition rule, the HF rows it is made of, its gradient over
TP and its role (an expert tensor, a stage of its own). The table is then read two ways, never written twice:

- `specs`: the sharding table (checkpoint.sharding.TensorSpec), one entry per stacked tensor (layers on a leading
  axis, experts after it), which the converter, the trainer and every reader slice through `sharding.regions`;
- `maps`: the HF side (checkpoint.families.mapping.TensorMap), one entry per layer (and expert), as row blocks of HF
  tensors, which hf-to-mcore and mcore-to-hf read in both directions.

`model_table` adds what every decoder-only model shares: embedding, decoder layers (a homogeneous stack, or per-layer
keys when dense and MoE layers mix), final norm, output layer, MTP layers.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from ..sharding import Rule, TensorSpec
from .mapping import TensorMap, concat, grouped_qkv, single

if TYPE_CHECKING:
    from ..config import ModelConfig
    from ..layout import Layout
    from .base import Family

# what an entry's HF side may be: one HF tensor (its rows are the canonical rows), [(HF tensor, rows), ...] stacked
# along the rows, or a function of (canonical name, lead) building the map (fused QKV)
HFRows = "str | list[tuple[str, int]] | Callable[[str, tuple[int, ...]], TensorMap]"


class Table:
    """One layer's (or the model skeleton's) declarations, read as specs or as maps.

    `cprefix` / `hprefix`: the canonical and HF name prefixes of this layer; `lead`: the leading indices of its maps
    ((layer,) in a stack, () for per-layer keys and tensors outside the stack); `stack`: the spec's leading layer axis
    ((L,) for the stacked pass, () otherwise); `spec_kw`: TensorSpec fields shared by the layer (stage, layer)."""

    def __init__(self, mode: str, cprefix: str = "", hprefix: str = "", lead: tuple[int, ...] = (),
                 stack: tuple[int, ...] = (), **spec_kw) -> None:
        assert mode in ("specs", "maps")
        self.mode, self.cprefix, self.hprefix, self.lead, self.stack = mode, cprefix, hprefix, lead, stack
        self.spec_kw = spec_kw
        self.specs: list[TensorSpec] = []
        self.maps: list[TensorMap] = []

    def add(self, name: str, shape: tuple[int, ...], rule: Rule, hf: HFRows, *, tp_grad: str | None = "auto",
            true_rows: int | None = None) -> None:
        """A tensor of this layer: canonical `cprefix + name`, global `shape` (without the layer axis), made of the HF
        rows `hf` (names relative to `hprefix`). `true_rows`: a vocab tensor's real rows (the rest is padding)."""
        cname = self.cprefix + name
        if self.mode == "specs":
            self.specs.append(TensorSpec(cname, (*self.stack, *shape), rule, bool(self.stack), tp_grad=tp_grad,
                                         **self.spec_kw))
        elif callable(hf):
            self.maps.append(hf(cname, self.lead))
        elif isinstance(hf, str):
            self.maps.append(single(cname, self.lead, self.hprefix + hf, true_rows or shape[0],
                                    shape[0] if true_rows else None))
        else:
            self.maps.append(concat(cname, self.lead, [(self.hprefix + n, rows) for n, rows in hf]))

    # -- the shapes Megatron fuses ---------------------------------------------------------------------------------
    def qkv(self, name: str, cfg: ModelConfig, q: str, k: str, v: str, rows_of: str = "weight") -> None:
        """Megatron's fused QKV (`name` = `...linear_qkv.weight` / `.bias`): per query group [its q heads; k; v]."""
        h = self.hprefix
        shape = (cfg.qkv_rows, cfg.hidden_size) if rows_of == "weight" else (cfg.qkv_rows,)
        self.add(name, shape, Rule.QKV, lambda c, lead: grouped_qkv(
            c, lead, h + q, h + k, h + v, cfg.num_query_groups, cfg.heads_per_group, cfg.kv_channels))

    def gated_mlp(self, name: str, ffn: int, hidden: int, gate: str, up: str, down: str) -> None:
        """`<name>.linear_fc1.weight` = [gate; up] (column split per half) and `<name>.linear_fc2.weight` = down."""
        self.add(f"{name}.linear_fc1.weight", (2 * ffn, hidden), Rule.GATE_UP, [(gate, ffn), (up, ffn)])
        self.add(f"{name}.linear_fc2.weight", (hidden, ffn), Rule.ROW, down)

    def experts(self, cfg: ModelConfig, names: Callable[[int], tuple[str, str, str]]) -> None:
        """Routed experts stacked on the expert axis (split by EP, then by the expert TP size): `names(e)` gives the
        HF (gate, up, down) of expert e."""
        E, F, h = cfg.num_moe_experts, cfg.moe_ffn_hidden_size, cfg.hidden_size
        fc1, fc2 = "mlp.experts.experts.linear_fc1.weight", "mlp.experts.experts.linear_fc2.weight"
        if self.mode == "specs":
            for name, shape, rule in ((fc1, (E, 2 * F, h), Rule.GATE_UP), (fc2, (E, h, F), Rule.ROW)):
                self.specs.append(TensorSpec(self.cprefix + name, (*self.stack, *shape), rule, bool(self.stack),
                                             expert=True, **self.spec_kw))
            return
        for e in range(E):  # each expert's maps: a gated MLP at lead (..., e)
            self.sub(self.cprefix, self.hprefix, (*self.lead, e)).gated_mlp("mlp.experts.experts", F, h, *names(e))

    def sub(self, cprefix: str, hprefix: str, lead: tuple[int, ...], stack: tuple[int, ...] = (), **spec_kw
            ) -> "Table":
        """A table for one layer below this one, collected into this one's lists."""
        t = Table(self.mode, cprefix, hprefix, lead, stack, **{**self.spec_kw, **spec_kw})
        t.specs, t.maps = self.specs, self.maps
        return t


def model_table(fam: Family, cfg: ModelConfig, layout: Layout, mode: str) -> Table:
    """Every tensor of the model, as `mode` ("specs": one per stacked tensor; "maps": one per layer and expert)."""
    h, L = cfg.hidden_size, cfg.num_layers
    vocab = cfg.padded_vocab_size(layout.tp)
    t = Table(mode)
    t.sub("", "", (), stage="first").add("embedding.word_embeddings.weight", (vocab, h), Rule.VOCAB,
                                         fam.hf_embedding, true_rows=cfg.vocab_size)
    if mode == "specs" and not cfg.heterogeneous:  # one stacked entry per tensor
        fam.layer(t.sub("decoder.layers.", "", (), (L,)), cfg, cfg.is_moe)
    else:
        for i in range(L):
            cprefix, lead = (f"decoder.layers.{i}.", ()) if cfg.heterogeneous else ("decoder.layers.", (i,))
            fam.layer(t.sub(cprefix, fam.hf_layer.format(i=i), lead, **({"layer": i} if cfg.heterogeneous else {})),
                      cfg, cfg.is_moe_layer(i))
    last = t.sub("", "", (), stage="last")
    last.add("decoder.final_layernorm.weight", (h,), Rule.REPLICATED, fam.hf_final_norm)
    if not cfg.tie_word_embeddings:
        last.add("output_layer.weight", (vocab, h), Rule.VOCAB, fam.hf_output, true_rows=cfg.vocab_size)
    for i in range(cfg.mtp_num_layers):
        fam.mtp_layer(t.sub(f"mtp.layers.{i}.", fam.hf_layer.format(i=L + i), (), stage="last"), cfg, i)
    return t
