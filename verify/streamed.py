"""Streaming logit parity: `verify --against` for checkpoints too big to build whole, a bounded piece in memory at a time.

transformers runs its own forward over a model built on the meta device; a forward pre-hook fills each piece (one
decoder layer without its MLP's big parts, the final norm) from the HF safetensors through transformers' own loader
(`convert_and_load_state_dict_in_model`, so its key renaming and expert fusing apply, not ours) and a forward hook
frees it again. Sub-layer pieces, so that the memory stays under `--memory-budget` whatever the width:

- routed experts are loaded, applied and freed one at a time, and only those the test tokens select (with
  `all_experts`, every expert also runs on a few synthetic rows): a one-expert copy of transformers' experts module
  takes each expert's tensors and its tokens in turn; router and shared experts are loaded whole;
- a dense MLP too wide for the budget runs as a sum of narrower copies of transformers' own MLP module, each holding a
  contiguous range of the intermediate rows (the ranges are those `checkpoint.sharding.regions` gives a virtual
  tensor-parallel split, so our side reads exactly its storage chunks);
- the embedding is read (and compared bit for bit) in row blocks, the output head runs in vocabulary blocks.

When HF's decoder layer i has run, ours runs on the same weights, read from the checkpoint's chunks for that layer
only, on two inputs at once (so each of our experts and MLP pieces is read once): HF's input of the layer (the
per-layer number: each layer compared on the HF hidden state, so a wrong layer is named instead of drifting into the
next) and our own chain (whose final logits are the end-to-end number, the same computation as the whole-model mode).
Each expert is also compared alone on the rows HF gave it, so a wrong expert is named. DeepSeek-V3's MTP layers run
after the decoder: transformers has no MTP forward, so the HF side composes transformers' own modules (its RMSNorm, a
Linear for eh_proj, its decoder layer for index L + j, built and loaded by transformers) the way DeepSeek defines the
depth: eh_proj([enorm(embedding of the next token); hnorm(hidden)]), the layer, shared_head.norm, shared_head.head,
with `hidden` what megatron-core feeds it: the final-normed decoder output, then the previous depth's shared_head.norm
output.
Everything runs in fp32 on the CPU. A thread reads both checkpoints' next pieces into the page cache ahead of the
walk (verify/hf_weights.py `Readahead`), so the disk works while the current piece computes.
"""
from __future__ import annotations

import copy
import re
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from checkpoint import chunkio, store
from checkpoint.config import ModelConfig
from checkpoint.errors import ShardkitError
from checkpoint.layout import Layout, RankCoord
from checkpoint.reader import Checkpoint
from checkpoint.sharding import SCALE_SUFFIX, Rule, TensorSpec, regions, split_optimizer_key
from train.model import MLP, GPTModel, RotaryEmbedding, canonical_name

from .common import HF_ATTN_IMPLEMENTATION, _memcmp, compare_rows, load_quietly, stored_dtype
from .budget import available_memory, piece_plan
from .hf_weights import (LAYER_KEY, READAHEAD_WINDOW, CastPool, HFWeights, Range, Readahead, Walk,
                         fp8_settings, free_piece, is_fp8_source)

_EXPERT = re.compile(r"\.experts\.(\d+)\.")
_MTP_OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.", "embed_tokens.")  # an MTP layer's pieces outside its block
SYNTHETIC_ROWS = 4  # rows driven through an expert no test token selected (--all-experts)
# rows of the copy of an experts module whose loading by transformers tells where it puts an expert's tensors (a
# multiple of DeepSeek's 128 x 128 FP8 blocks, so that the rows read are whole blocks)
PROBE_ROWS = 128


class _HFSide:
    """transformers' model on the meta device, filled piece by piece from the safetensors."""

    def __init__(self, hf_dir: Path, weights: HFWeights, num_layers: int, mtp_layers: int,
                 pool: CastPool | None = None) -> None:
        import transformers
        from transformers.conversion_mapping import get_model_conversion_mapping

        self.transformers = transformers
        self.config = transformers.AutoConfig.from_pretrained(hf_dir)
        self.config._attn_implementation = HF_ATTN_IMPLEMENTATION
        if hasattr(self.config, "quantization_config"):  # HFWeights hands out dequantized weights
            del self.config.quantization_config
        with torch.device("meta"):
            self.model = transformers.AutoModelForCausalLM.from_config(self.config, dtype=torch.float32)
        inner = self.model.model
        # RoPE's inverse frequencies are computed at construction: rebuild that (small) module for real
        inner.rotary_emb = type(inner.rotary_emb)(config=self.config)
        self.weights = weights
        self.pool = pool if pool is not None else CastPool(None)
        self.mapping = get_model_conversion_mapping(self.model)
        self.keys = weights.layer_keys()
        self.num_layers, self.mtp_layers = num_layers, mtp_layers
        self.tied = bool(getattr(self.config, "tie_word_embeddings", False))
        # where transformers' loader puts an expert's tensors in its fused parameters: learned on the run's first
        # expert (_learn_expert_rule); None: not yet, {}: not a plain tiling (every expert goes through the loader)
        self.expert_rule: dict | None = None

    def load(self, module: nn.Module, keys: list[str], model: nn.Module | None = None, mapping=None,
             rename=None, inspect: Callable[[dict[str, Tensor]], None] | None = None,
             given: dict[str, Tensor] | None = None) -> None:
        """Materialise `module` (a part of `model`, default the whole meta model) and fill it with `keys` (their
        values `given`, else read) through transformers' own loader; `inspect(tensors it was given, by their
        (renamed) keys, fp32)` runs after it."""
        from transformers.core_model_loading import convert_and_load_state_dict_in_model
        from transformers.modeling_utils import LoadStateDictConfig

        module.to_empty(device="cpu")
        # cast into pooled fp32 buffers here: the loader's own cast to fp32 is then a no-op and its parameters are
        # these buffers (exact either way); a buffer the loader did not keep (a fused or renamed copy) goes back
        sd = {(rename(k) if rename else k): self.pool.cast(given[k] if given else self.weights.get(k)) for k in keys}
        self.weights.release()  # cast copies: the files' mapped pages leave this process's RSS before the piece runs
        target = self.model if model is None else model
        mapping = self.mapping if mapping is None else mapping
        info, _ = convert_and_load_state_dict_in_model(
            target, sd, LoadStateDictConfig(weight_mapping=mapping, dtype=torch.float32))
        if inspect is not None:
            inspect(sd)
        kept = {p.untyped_storage().data_ptr() for p in module.parameters()}  # a split's views count too
        for t in sd.values():
            if t.untyped_storage().data_ptr() not in kept:
                self.pool.give(t)
        del sd
        prefixes = self._prefixes(module, target)
        missing = {k for k in info.missing_keys if any(k.startswith(p) for p in prefixes)}
        if missing:
            raise ShardkitError(f"--against {self.weights.hf_dir}: HF weights missing for {sorted(missing)[0]}")

    @staticmethod
    def _prefixes(module: nn.Module, model: nn.Module) -> list[str]:
        return [name + "." for name, m in model.named_modules() if m is module]

    def head_key(self) -> str:
        return "model.embed_tokens.weight" if self.tied else "lm_head.weight"

    # -- routed experts, one at a time -------------------------------------------------------------------------
    def mini(self, ffn: tuple[int, int] | None = None) -> nn.Module:
        """A one-layer, one-expert meta copy of the model whose layer 0 is an MoE layer: each routed expert of any
        layer is loaded into its experts module in turn. With `ffn` = (the experts' intermediate size, r): a copy
        whose experts are r rows wide (the probe of `_StreamedHFExperts._probe`), None where no config field holds
        that size; its mapping is `self._mini_mapping` either way (the same module classes)."""
        name = "_mini" if ffn is None else f"_mini_{ffn[1]}"
        if not hasattr(self, name):
            from transformers.conversion_mapping import get_model_conversion_mapping

            c = copy.deepcopy(self.config)
            c.num_hidden_layers = 1
            for attr in ("num_local_experts", "n_routed_experts", "num_experts"):
                if hasattr(c, attr):
                    setattr(c, attr, 1)
            for attr, v in (("first_k_dense_replace", 0), ("num_experts_per_tok", 1), ("n_group", 1),
                            ("topk_group", 1)):
                if hasattr(c, attr):
                    setattr(c, attr, v)
            if ffn is not None:
                sized = [a for a in ("moe_intermediate_size", "intermediate_size") if getattr(c, a, None) == ffn[0]]
                if not sized:
                    setattr(self, name, None)
                    return None
                for attr in sized:
                    setattr(c, attr, ffn[1])
            with torch.device("meta"):
                model = self.transformers.AutoModelForCausalLM.from_config(c, dtype=torch.float32)
            setattr(self, name, model)
            if ffn is None:
                self._mini_mapping = get_model_conversion_mapping(model)
        return getattr(self, name)

    # -- a dense MLP in pieces ---------------------------------------------------------------------------------
    def mlp_piece(self, mlp: nn.Module, rows: int) -> nn.Module:
        """transformers' own MLP module of `mlp`'s class, `rows` intermediate rows wide (on the CPU, uninitialised)."""
        c = copy.copy(self.config)
        c.intermediate_size = rows
        with torch.device("meta"):
            piece = type(mlp)(c)
        self.pool.materialise(piece)
        return piece

    # -- DeepSeek-V3's MTP layers ------------------------------------------------------------------------------
    def mtp_model(self) -> nn.Module:
        """A meta copy of the model with the MTP layers' indices as decoder layers, for transformers' own layer
        module (index L + j) and its loader."""
        if not hasattr(self, "_mtp"):
            from transformers.conversion_mapping import get_model_conversion_mapping

            c = copy.deepcopy(self.config)
            c.num_hidden_layers = self.num_layers + self.mtp_layers
            with torch.device("meta"):
                self._mtp = self.transformers.AutoModelForCausalLM.from_config(c, dtype=torch.float32)
            self._mtp_mapping = get_model_conversion_mapping(self._mtp)
        return self._mtp


def _hf_experts_module(layer: nn.Module) -> tuple[nn.Module, str] | None:
    mlp = getattr(layer, "mlp", None)
    experts = getattr(mlp, "experts", None)
    return (experts, "mlp.experts") if experts is not None and hasattr(mlp, "gate") else None


class _StreamedHFExperts(nn.Module):
    """Stands in for transformers' experts module of one layer: the same call, each hit expert run by transformers'
    own experts module (of the one-expert copy) with that expert's tensors, in expert order as transformers runs
    them. Each expert is read once; its rows and its (unweighted) output are kept to compare ours with, and with
    `all_experts` every expert no token selected runs on a few synthetic rows too."""

    def __init__(self, side: _HFSide, layer: int, expert_keys: dict[int, list[str]], num_experts: int,
                 all_experts: bool, ahead: Readahead | None = None) -> None:
        super().__init__()
        self.side, self.layer, self.expert_keys, self.ahead = side, layer, expert_keys, ahead
        self.num_experts, self.all_experts = num_experts, all_experts
        self.inputs: dict[int, Tensor] = {}  # expert -> the rows it saw
        self.outputs: dict[int, Tensor] = {}  # expert -> its unweighted output on them
        self.selected: set[int] = set()

    def _run(self, e: int, rows: Tensor) -> Tensor:
        mini = self.side.mini()
        one = _hf_experts_module(mini.model.layers[0])[0]
        pat = re.compile(rf"^model\.layers\.{self.layer}\.(.*)\.experts\.{e}\.")
        self._check_complete(e)
        keys, side = self.expert_keys[e], self.side
        tails = {_expert_tail(k): k for k in keys}
        def rename(k: str) -> str:  # to the one-expert copy's layer 0, expert 0
            return pat.sub(r"model.layers.0.\1.experts.0.", k)

        if side.expert_rule is None:  # the run's first expert: learn the rule on a few of its rows where it can
            side.expert_rule = self._probe(keys, rename) or None
        if side.expert_rule and set(tails) == {t for blocks in side.expert_rule.values() for t, _, _ in blocks}:
            _load_by_rule(one, side.expert_rule, tails, side)
        else:
            learned: dict = {}  # the run's first expert: where transformers' loader put each of its tensors
            side.load(one, keys, model=mini, mapping=side._mini_mapping, rename=rename,
                      inspect=None if side.expert_rule is not None else
                      lambda sd: learned.update(rule=_learn_expert_rule(one, sd)))
            if side.expert_rule is None:
                side.expert_rule = learned.get("rule") or {}
        # unit weights: the module's `y * w` is then y exactly, and the caller applies the routing weight itself
        y = one(rows, torch.zeros(rows.shape[0], 1, dtype=torch.long), torch.ones(rows.shape[0], 1, dtype=rows.dtype))
        free_piece(one, self.side.pool)
        self.side.weights.release()
        return y

    def _probe(self, keys: list[str], rename: Callable[[str], str]) -> dict | None:
        """The expert rule (`_learn_expert_rule`) learned from transformers' loader filling a copy of the experts
        module PROBE_ROWS intermediate rows wide with the first PROBE_ROWS rows (columns of the down projection) of
        the tensors `keys` (one expert's), then scaled to the full width and checked to tile the full-size
        parameters; None where the tensors are not plain 2-D matrices of one intermediate size beside the hidden size
        (then the rule is learned at full size, from the first expert the loader fills)."""
        side, r = self.side, PROBE_ROWS
        shapes = {k: tuple(side.weights.shape(k)) for k in keys}
        hidden = getattr(side.config, "hidden_size", None)
        if not shapes or any(len(s) != 2 for s in shapes.values()):
            return None
        widths = {d for s in shapes.values() for d in s} - {hidden}
        if len(widths) != 1 or min(widths) <= r or any(s[0] == s[1] for s in shapes.values()):
            return None
        ffn = widths.pop()
        probe = side.mini((ffn, r))
        if probe is None:
            return None
        one = _hf_experts_module(probe.model.layers[0])[0]
        given = {k: side.weights.get(k, rows=slice(0, r) if s[0] == ffn else None,
                                     cols=slice(0, r) if s[1] == ffn else None) for k, s in shapes.items()}
        learned: dict = {}
        side.load(one, keys, model=probe, mapping=side._mini_mapping, given=given, rename=rename,
                  inspect=lambda sd: learned.update(rule=_learn_expert_rule(one, sd)))
        small = {_expert_tail(k): tuple(t.shape) for k, t in given.items()}
        del given
        free_piece(one, side.pool)
        side.weights.release()
        rule = learned.get("rule")
        if not rule:
            return None
        full = {_expert_tail(k): s for k, s in shapes.items()}
        params = dict(_hf_experts_module(side.mini().model.layers[0])[0].named_parameters(recurse=False))
        # (one dim per parameter: _learn_expert_rule checked that) offsets in units of each tensor's size there
        scaled = {name: [(t, d, off // small[t][d] * full[t][d]) for t, d, off in blocks]
                  for name, blocks in rule.items()}
        if not all(_tiles(blocks, full, tuple(params[name].shape[1:])) for name, blocks in scaled.items()):
            return None
        return scaled

    def _check_complete(self, e: int) -> None:
        """Expert e has every tensor the layer's other experts have: else one line naming the HF tensor missing."""
        tails = {}
        for keys in self.expert_keys.values():
            for k in keys:
                head, tail = re.split(r"\.experts\.\d+\.", k, maxsplit=1)
                tails[tail] = head
        have = {re.split(r"\.experts\.\d+\.", k, maxsplit=1)[1] for k in self.expert_keys.get(e, [])}
        for tail in sorted(set(tails) - have):
            raise ShardkitError(f"--against {self.side.weights.hf_dir}: HF weights missing for "
                                f"{tails[tail]}.experts.{e}.{tail}")

    def forward(self, hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        out = torch.zeros_like(hidden)
        hit = torch.unique(top_k_index).tolist()
        rest = [e for e in range(self.num_experts) if e not in hit] if self.all_experts else []
        at = _expert_walk(self.ahead, lambda e: _hf_ranges(self.side.weights, self.expert_keys.get(e, [])), hit + rest)
        for k, e in enumerate(hit):
            at(k)
            token, slot = torch.where(top_k_index == e)
            rows = self.inputs[e] = hidden.index_select(0, token)
            y = self.outputs[e] = self._run(e, rows)
            out.index_add_(0, token, (y * top_k_weights[token, slot, None]).to(out.dtype))
        self.selected = set(hit)
        if self.all_experts:
            synthetic = hidden[:SYNTHETIC_ROWS]
            for k, e in enumerate(rest, start=len(hit)):
                at(k)
                if e not in self.selected:
                    self.inputs[e] = synthetic
                    self.outputs[e] = self._run(e, synthetic)
        return out


def _expert_tail(key: str) -> str:
    """An HF expert tensor's name after `.experts.<e>.` (`w1.weight`, `gate_proj.weight`)."""
    return re.split(r"\.experts\.\d+\.", key, maxsplit=1)[1]


def _learn_expert_rule(one: nn.Module, sources: dict[str, Tensor]) -> dict | None:
    """Where transformers' own loader put each of one expert's HF tensors (`sources`: what it was given, fp32, by
    key) in its fused expert parameters (e.g. Mixtral's gate_up_proj[0] = [w1; w3], down_proj[0] = w2), found by
    bitwise comparison with the parameters it just filled: {parameter: [(HF tensor tail, dim, offset)]}, or None where
    the parameters are not exactly a tiling of the tensors as they are (transposed, interleaved, a bias the tensors
    do not give, two tensors equal: ambiguous). The loader does the same for every expert of every layer (its rules
    are per key pattern), so the other experts are then cast straight into those places (`_load_by_rule`): at
    Mixtral-8x7B width the loader's stack and concat copied each expert twice more into fresh memory, a third of the
    proof's time (issue 42)."""
    params = dict(one.named_parameters(recurse=False))
    if not params or any(p.shape[0] != 1 for p in params.values()):
        return None
    rule: dict[str, list[tuple[str, int, int]]] = {name: [] for name in params}
    sizes: dict[str, tuple[int, ...]] = {}
    for key, src in sources.items():
        tail = _expert_tail(key)
        sizes[tail] = tuple(src.shape)
        found: dict = {}
        for name, p in params.items():
            p0 = p.detach()[0]
            if src.dim() != p0.dim():
                continue
            for d in range(p0.dim()):
                n = src.shape[d]
                if any(src.shape[i] != p0.shape[i] for i in range(p0.dim()) if i != d) or p0.shape[d] % n:
                    continue
                for off in range(0, p0.shape[d], n):
                    if torch.equal(p0.narrow(d, off, n), src):  # (a region found along two dims counts once)
                        region = tuple((off, off + n) if i == d else (0, p0.shape[i]) for i in range(p0.dim()))
                        found[(name, region)] = (d, off)
        if len(found) != 1:
            return None
        (name, _), (d, off) = next(iter(found.items()))
        rule[name].append((tail, d, off))
    if not all(_tiles(blocks, sizes, tuple(params[name].shape[1:])) for name, blocks in rule.items()):
        return None
    return rule


def _tiles(blocks: list[tuple[str, int, int]], sizes: dict[str, tuple[int, ...]], shape: tuple[int, ...]) -> bool:
    """True when `blocks` ((tensor tail, dim, offset)) exactly tile a parameter of `shape` (one expert's): all along
    one dim, the tensors (of `sizes`) of one size there and the parameter's size elsewhere, at offsets 0, n, 2n..."""
    dims = {d for _, d, _ in blocks}
    if len(dims) != 1:
        return False
    d = dims.pop()
    size = sizes[blocks[0][0]][d]
    return (all(sizes[t][i] == (size if i == d else shape[i]) for t, _, _ in blocks for i in range(len(shape)))
            and sorted(off for _, _, off in blocks) == list(range(0, shape[d], size)))


def _load_by_rule(one: nn.Module, rule: dict, tails: dict[str, str], side: "_HFSide") -> None:
    """Fill one expert's fused parameters straight from its HF tensors where `_learn_expert_rule` found transformers'
    loader puts them: each cast once into its place in a pooled buffer (`copy_` casts as the loader does)."""
    side.pool.materialise(one)
    params = dict(one.named_parameters(recurse=False))
    with torch.no_grad():
        for name, blocks in rule.items():
            p0 = params[name][0]
            for tail, d, off in blocks:
                src = side.weights.get(tails[tail])
                p0.narrow(d, off, src.shape[d]).copy_(src)
                del src
    side.weights.release()


class _ChunkedHFMLP(nn.Module):
    """Stands in for transformers' dense MLP of one layer: the sum over intermediate-row ranges of transformers' own
    MLP module holding that range (gate/up rows, down columns; a down bias in the first piece only)."""

    def __init__(self, side: _HFSide, layer: int, mlp: nn.Module, ranges: list[tuple[int, int]],
                 prefix: str) -> None:
        super().__init__()
        self.side, self.layer, self.ranges, self.prefix = side, layer, ranges, prefix
        self.template = [mlp]  # not a submodule: no parameters of its own here

    def forward(self, x: Tensor) -> Tensor:
        w, p = self.side.weights, self.prefix
        out = None
        for n, (a, b) in enumerate(self.ranges):
            piece = self.side.mlp_piece(self.template[0], b - a)
            sd = {"gate_proj.weight": w.get(p + "gate_proj.weight", rows=slice(a, b)),
                  "up_proj.weight": w.get(p + "up_proj.weight", rows=slice(a, b)),
                  "down_proj.weight": w.get(p + "down_proj.weight", cols=slice(a, b))}
            if piece.gate_proj.bias is not None:
                sd["gate_proj.bias"] = w.get(p + "gate_proj.bias", rows=slice(a, b))
                sd["up_proj.bias"] = w.get(p + "up_proj.bias", rows=slice(a, b))
                sd["down_proj.bias"] = (w.get(p + "down_proj.bias") if n == 0 else
                                        torch.zeros(piece.down_proj.bias.shape))
            piece.load_state_dict(sd, strict=True)  # copied into the fp32 parameters, cast on the way
            del sd
            w.release()
            y = piece(x)
            out = y if out is None else out + y
            free_piece(piece, self.side.pool)
            del piece
        return out


class _Gathered(nn.Module):
    """An embedding of only the rows `ids` (sorted, unique): the same lookup as the whole table for those ids."""

    def __init__(self, ids: Tensor, rows: Tensor) -> None:
        super().__init__()
        self.ids, self.rows = ids, rows

    def forward(self, input_ids: Tensor) -> Tensor:
        return F.embedding(torch.searchsorted(self.ids, input_ids), self.rows)


class _DeferredHead(nn.Module):
    """Stands in for HF's lm_head (a bias-free Linear): keeps its input; the logits are computed afterwards in
    vocabulary blocks, F.linear exactly as nn.Linear does, once the MTP layers' head inputs are known too."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab, self.input = vocab, None

    def forward(self, x: Tensor) -> Tensor:
        self.input = x
        return x.new_zeros(*x.shape[:-1], self.vocab)


# -- our side --------------------------------------------------------------------------------------------------------

def _expert_mlp(x: Tensor, w1: Tensor, w2: Tensor) -> Tensor:
    """train.model.GroupedMLP.forward for one expert's [gate; up] and down weights (the same operations)."""
    gate, up = F.linear(x, w1).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w2)


def _expert_mlp_sets(sets: list[Tensor], w1: Tensor, w2: Tensor) -> list[Tensor]:
    """`_expert_mlp(x, w1, w2)` for each x of `sets`, one product per weight for all of them: a set equal value for
    value to an earlier one shares its result (the same operations on the same values), the distinct ones run as
    one stack of rows (each output row depends only on its own input row)."""
    first = [next(m for m in range(n + 1) if m == n or (sets[m].shape == x.shape and torch.equal(sets[m], x)))
             for n, x in enumerate(sets)]
    distinct = [n for n in range(len(sets)) if first[n] == n]
    if len(distinct) == 1:
        ys = {distinct[0]: _expert_mlp(sets[distinct[0]], w1, w2)}
    elif distinct:
        y = _expert_mlp(torch.cat([sets[n] for n in distinct]), w1, w2)
        ys, at = {}, 0
        for n in distinct:
            ys[n], at = y[at:at + len(sets[n])], at + len(sets[n])
    else:
        ys = {}
    return [ys[first[n]] for n in range(len(sets))]


class _OurSide:
    """Our model on the meta device; one piece at a time filled from the checkpoint's chunks."""

    def __init__(self, ck: Checkpoint, plan: dict, pool: CastPool | None = None) -> None:
        self.ck, self.cfg, self.plan = ck, ck.config, plan
        self.pool = pool if pool is not None else CastPool(None)
        padded = ck.entry("embedding.word_embeddings.weight").shape[0]
        with torch.device("meta"):
            self.model = GPTModel(self.cfg, padded)
        self.model.rotary_pos_emb = RotaryEmbedding(self.cfg)
        self.stacked = not self.cfg.heterogeneous
        self.ahead: Readahead | None = None  # read-ahead of the routed experts, once routed
        self._tensors_of: dict[tuple, list] = {}
        self.bytes_read = 0
        self.reads: dict[tuple, int] = {}

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> Tensor:
        if name not in self.ck.tensors:
            raise ShardkitError(f"{self.ck.path}: the checkpoint has no tensor {name}")
        # read-only where it is a view of a mapped chunk (no copy): every caller only reads it (copy_, float, index);
        # a torch_dist checkpoint read in place (TorchDistSource) gives the box from its items
        t = store.from_numpy(self.ck.read_numpy(name, index)) if hasattr(self.ck, "read_numpy") else \
            self.ck.read(name, index)
        tag = (name, None if index is None else tuple((s.start, s.stop) for s in index))
        self.reads[tag] = self.reads.get(tag, 0) + 1
        self.bytes_read += t.numel() * t.element_size()
        return t

    def fill(self, prefix: str, module: nn.Module) -> None:
        """Materialise `module` (the model's `prefix`) with its tensors read from the checkpoint."""
        self.pool.materialise(module)
        with torch.no_grad():
            for name, p in module.named_parameters():
                cname, index = canonical_name(prefix + name, self.stacked)
                p.copy_(self.read(cname, (slice(index, index + 1),))[0] if index is not None else self.read(cname))

    def _fill_region(self, p: Tensor, prefix: str, name: str, n: int, r: int) -> None:
        """Piece r of n of a dense MLP tensor: the boxes `checkpoint.sharding.regions` gives rank r of a virtual
        tensor-parallel split into n, placed where that rank's local tensor holds them."""
        cname, index = canonical_name(prefix + name, self.stacked)
        spec = self._spec(cname)
        for reg in regions(spec, Layout(tp=n), RankCoord(tp=r)):
            box, local = list(reg.global_slices()), list(reg.local_slices())
            if index is not None:  # the stacked layer axis: this layer only
                box[0] = slice(index, index + 1)
                local = local[1:]
            t = self.read(cname, tuple(box))
            p[tuple(local)] = t[0] if index is not None else t

    def _spec(self, name: str) -> TensorSpec:
        e = self.ck.entry(name)
        return TensorSpec(name, tuple(e.shape), Rule(e.rule), e.per_layer)

    def mlp_ranges(self, prefix: str, n: int) -> list[tuple[int, int]]:
        """The intermediate rows [a, b) of each of the n pieces (the columns of linear_fc2 rank r's box)."""
        cname, _ = canonical_name(prefix + "mlp.linear_fc2.weight", self.stacked)
        spec = self._spec(cname)
        out = []
        for r in range(n):
            (reg,) = regions(spec, Layout(tp=n), RankCoord(tp=r))
            ax = len(spec.shape) - 1
            out.append((reg.global_offset[ax], reg.global_offset[ax] + reg.shape[ax]))
        return out

    def layer(self, prefix: str, mine: nn.Module, streams: list[Tensor], cos: Tensor, sin: Tensor, *,
              pieces: int = 1, hf_experts: _StreamedHFExperts | None = None, report: dict | None = None
              ) -> list[Tensor]:
        """train.model.TransformerLayer.forward on each of `streams`, the same operations in the same order, the
        layer's weights read once for all of them: attention, then the MLP whole, in `pieces` (dense), or expert by
        expert (MoE; each expert also compared on the rows HF gave it, into `report`). Streams equal value for value
        (our chain while it has not drifted from HF's hidden state; torch.equal) are one stream: the same operations
        on the same values give the same numbers, so it runs once."""
        if len(streams) > 1 and all(s.shape == streams[0].shape and torch.equal(s, streams[0]) for s in streams[1:]):
            ys = self.layer(prefix, mine, streams[:1], cos, sin, pieces=pieces, hf_experts=hf_experts, report=report)
            return ys * len(streams)
        self.fill(prefix + "input_layernorm.", mine.input_layernorm)
        self.fill(prefix + "self_attention.", mine.self_attention)
        self.fill(prefix + "pre_mlp_layernorm.", mine.pre_mlp_layernorm)
        with torch.no_grad():
            mids = [x + mine.self_attention(mine.input_layernorm(x), cos, sin) for x in streams]
            us = [mine.pre_mlp_layernorm(m) for m in mids]
        for m in (mine.input_layernorm, mine.self_attention, mine.pre_mlp_layernorm):
            free_piece(m, self.pool)
        mlp = mine.mlp
        with torch.no_grad():
            if hasattr(mlp, "router"):
                ys = self._moe(prefix + "mlp.", mlp, us, hf_experts, report)
            elif pieces == 1:
                self.fill(prefix + "mlp.", mlp)
                ys = [mlp(u) for u in us]
                free_piece(mlp, self.pool)
            else:
                ys = [None] * len(us)
                cfg = self.cfg
                whole: dict[str, Tensor] = {}
                for r in range(pieces):
                    with torch.device("meta"):
                        piece = MLP(cfg.hidden_size, cfg.ffn_hidden_size // pieces, cfg.add_mlp_bias, cfg.norm_epsilon)
                    self.pool.materialise(piece)
                    for name, p in piece.named_parameters():
                        if name == "linear_fc2.bias" and r > 0:  # added once, by the first piece
                            p.zero_()
                        elif name in ("linear_fc1.layer_norm_weight", "linear_fc2.bias"):  # whole, read once
                            if name not in whole:
                                cname, index = canonical_name(prefix + "mlp." + name, self.stacked)
                                whole[name] = (self.read(cname, (slice(index, index + 1),))[0] if index is not None
                                               else self.read(cname))
                            p.copy_(whole[name])
                        else:
                            self._fill_region(p, prefix + "mlp.", name, pieces, r)
                    ys = [piece(u) if y is None else y + piece(u) for u, y in zip(us, ys)]
                    free_piece(piece, self.pool)
                    del piece
        return [m + y for m, y in zip(mids, ys)]

    def _moe(self, prefix: str, moe: nn.Module, us: list[Tensor], hf_experts: _StreamedHFExperts | None,
             report: dict | None) -> list[Tensor]:
        """train.model.MoELayer.forward + Experts.forward on each stream, each expert read once."""
        self.fill(prefix + "router.", moe.router)
        routes = []
        for u in us:
            tokens = u.reshape(-1, u.shape[-1])
            weights, indices = moe.router(tokens)
            routes.append((tokens, weights, indices, torch.zeros_like(tokens)))
        free_piece(moe.router, self.pool)
        wanted = set()
        for _, _, indices, _ in routes:
            wanted.update(torch.unique(indices).tolist())
        theirs = hf_experts.outputs if hf_experts is not None else {}
        wanted.update(theirs)
        worst = (None, 0.0)
        w1_name, i1 = canonical_name(prefix + "experts.experts.linear_fc1.weight", self.stacked)
        w2_name, i2 = canonical_name(prefix + "experts.experts.linear_fc2.weight", self.stacked)
        lead = () if i1 is None else (slice(i1, i1 + 1),)
        order = sorted(wanted)
        at = _expert_walk(self.ahead, lambda e: self.files(self.layer_of(prefix), expert=e), order)
        for k, e in enumerate(order):
            at(k)
            box = lead + (slice(e, e + 1),)
            w1, w2 = self.expert_weight(w1_name, box), self.expert_weight(w2_name, box)
            hits = []  # (route, token, slot) of the streams that routed rows here
            for route in routes:
                token, slot = torch.where(route[2] == e)
                if token.numel():
                    hits.append((route, token, slot))
            # every row set this expert runs on (each stream's routed rows, HF's rows of it), in one product per
            # weight: at Mixtral-8x7B width an expert's fp32 weights are 0.7 GB, and with a few dozen rows each
            # product's time is the pass over them. Row sets equal value for value are one set.
            sets = [tokens.index_select(0, token) for (tokens, _, _, _), token, _ in hits]
            if e in theirs:
                sets.append(hf_experts.inputs[e])
            ys = _expert_mlp_sets(sets, w1, w2)
            for ((_, weights, _, out), token, slot), y in zip(hits, ys):
                out.index_add_(0, token, (y * weights[token, slot, None]).to(out.dtype))
            if e in theirs:
                d = (ys[-1] - theirs[e]).abs().max().item()
                if worst[0] is None or not d <= worst[1]:
                    worst = (e, d)
            self.pool.give(w1)
            self.pool.give(w2)
            del w1, w2
        if report is not None:
            report["experts_loaded"] = len(wanted)
            report["worst_expert"] = worst
        ys = [out.view(u.shape) for u, (_, _, _, out) in zip(us, routes)]
        if moe.shared_experts is not None:
            self.fill(prefix + "shared_experts.", moe.shared_experts)
            ys = [y + moe.shared_experts(u) for u, y in zip(us, ys)]
            free_piece(moe.shared_experts, self.pool)
        return ys

    def expert_weight(self, name: str, box: tuple[slice, ...]) -> Tensor:
        """One routed expert's 2-D weight (`box` selects it) in fp32, in a pooled buffer: cast straight from the views
        of its storage chunks where the checkpoint has chunk files (a weight split over several chunks, by TP or
        ETP, was first copied whole in its own dtype, then cast), else read whole and cast."""
        shape = tuple(self.read_shape(name)[-2:])
        if not hasattr(self.ck, "read_numpy"):  # a torch_dist checkpoint read in place
            return self.pool.cast(self.read(name, box)).reshape(shape)
        chunk = self.ck.entry(name).chunk[-2:]
        w = self.pool.take(shape)
        for r0 in range(0, shape[0], chunk[0]):
            r1 = min(r0 + chunk[0], shape[0])
            for c0 in range(0, shape[1], chunk[1]):
                c1 = min(c0 + chunk[1], shape[1])
                t = self.read(name, box + (slice(r0, r1), slice(c0, c1)))  # within one chunk: a view of it
                w[r0:r1, c0:c1].copy_(t.reshape(r1 - r0, c1 - c0))
        return w

    def files(self, layer: int | str, expert: int | None = None) -> list[Range]:
        """The chunk files of decoder layer `layer` (or MTP layer 'mtp.j') without its routed experts, or of one
        routed expert of it, as read-ahead ranges."""
        if not hasattr(self.ck, "chunk_files"):  # a torch_dist checkpoint read in place: no chunk files
            return []
        lead = (slice(expert, expert + 1),) if expert is not None else ()
        return [r for name, box in self._layer_tensors(layer, expert is not None)
                for r in self.chunk_ranges(name, box + lead)]

    def _layer_tensors(self, layer: int | str, experts: bool) -> list[tuple[str, tuple[slice, ...]]]:
        """(name, box of the layer) of the tensors of one layer, its routed experts' or the rest: found once per
        layer (every routed expert's read-ahead asks again)."""
        key = (layer, experts)
        if key not in self._tensors_of:
            out = []
            for name, e in self.ck.tensors.items():
                if split_optimizer_key(name) is not None or e.expert != experts:
                    continue
                if isinstance(layer, int) and name.startswith(f"decoder.layers.{layer}.") or \
                        isinstance(layer, str) and name.startswith(f"mtp.layers.{layer.split('.')[1]}."):
                    out.append((name, ()))
                elif isinstance(layer, int) and e.per_layer and re.match(r"decoder\.layers\.[^\d]", name):
                    out.append((name, (slice(layer, layer + 1),)))
            self._tensors_of[key] = out
        return self._tensors_of[key]

    @staticmethod
    def layer_of(prefix: str) -> int | str:
        """'decoder.layers.3.mlp.' -> 3, 'mtp.layers.0.transformer_layer.mlp.' -> 'mtp.0'."""
        m = re.match(r"(decoder|mtp)\.layers\.(\d+)\.", prefix)
        return int(m.group(2)) if m.group(1) == "decoder" else f"mtp.{m.group(2)}"

    def chunk_ranges(self, name: str, box: tuple[slice, ...]) -> list[Range]:
        if not hasattr(self.ck, "chunk_files"):
            return []
        size = self.ck.chunk_nbytes(name) + chunkio.TRAILER
        return [(f, 0, size) for f in self.ck.chunk_files(name, box)]

    def read_shape(self, name: str) -> list[int]:
        return self.ck.entry(name).shape

    def read_rows(self, name: str, a: int, b: int) -> list[tuple[int, int, Tensor]]:
        """Rows [a, b) of a 2-D tensor, one read per storage chunk of rows they touch (views of the mapped chunks:
        no copy), as (lo, hi, rows lo..hi)."""
        step = self.ck.entry(name).chunk[0]
        out, lo = [], a
        while lo < b:
            hi = min(b, (lo // step + 1) * step)
            out.append((lo, hi, self.read(name, (slice(lo, hi), slice(None)))))
            lo = hi
        return out

    def head_name(self) -> str:
        return "embedding.word_embeddings.weight" if self.cfg.tie_word_embeddings else "output_layer.weight"


# -- the comparison ----------------------------------------------------------------------------------------------------

def stream_parity(ck: Checkpoint, hf_dir: str | Path, *, batch: int = 2, seq_len: int = 32, seed: int = 0,
                  tolerance: float = 1e-4, all_experts: bool = False, memory_budget: int | None = None,
                  progress: Callable[[int], None] | None = None) -> dict:
    """Per-layer and end-to-end |ours - HF| with a bounded piece of either model in memory at a time (see the module
    doc). `memory_budget` (bytes) sizes the pieces (None: whole layers, blocks of one storage chunk)."""
    started = time.perf_counter()
    hf_dir = Path(hf_dir)
    cfg: ModelConfig = ck.config
    if seq_len < 1 or batch < 1:
        raise ShardkitError(f"--seq-length {seq_len}: the logit comparison needs at least one token per sequence")
    if ck.manifest.fp8:
        why = ("and transformers cannot load this block-FP8 HF source on the CPU for the whole-model one"
               if is_fp8_source(hf_dir) else "the whole-model one does, without --streaming and within the budget")
        raise ShardkitError(f"{ck.path}: kept block-FP8 weights: the streamed comparison does not read them yet; {why}")
    weights = HFWeights(hf_dir, *fp8_settings(hf_dir), stored=stored_dtype(ck))  # HF's values as ck stores them
    plan = piece_plan(ck, memory_budget, fp8_block=fp8_settings(hf_dir)[0] if is_fp8_source(hf_dir) else None)
    # fp32 buffers reused: idle + lent within half the budget (the 2x-fp32 rule's share of one piece's values)
    pool = CastPool(None if memory_budget is None else memory_budget // 2)
    ours = _OurSide(ck, plan, pool)
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, cfg.vocab_size, (batch, seq_len), generator=generator)
    next_ids = []  # MTP depth d reads the token d + 1 ahead (zero fill), as GPTModel.mtp_forward
    ids = input_ids
    for _ in range(cfg.mtp_num_layers):
        ids = F.pad(ids[:, 1:], (0, 1))
        next_ids.append(ids)
    needed = torch.unique(torch.cat([input_ids.flatten()] + [n.flatten() for n in next_ids]))
    # the disk starts on the embedding and the first layers now, while the config is checked and transformers is
    # imported (seconds); a hint for a tensor the HF side turns out not to have is never read
    ahead = ours.ahead = Readahead(min(READAHEAD_WINDOW, available_memory() // 4))
    try:
        walk = ahead.walk(_read_steps(weights, ours, cfg, plan["head_rows"]))
        walk.at(0)
        check_same_math(cfg, hf_config(hf_dir, weights), hf_dir)  # before any layer runs
        hf = load_quietly(lambda: _HFSide(hf_dir, weights, cfg.num_layers, cfg.mtp_num_layers, pool), hf_dir)
        return _stream(cfg, hf, ours, weights, plan, pool, ahead, walk, started, input_ids, next_ids, needed,
                       tolerance=tolerance, all_experts=all_experts, progress=progress)
    finally:
        ahead.close()


def _read_steps(hf: HFWeights, ours: _OurSide, cfg: ModelConfig, head_rows: int) -> list[list[Range]]:
    """The walk's reads in order, as read-ahead ranges: every embedding row (both sides), each decoder layer
    without its routed experts (the last with the final norm), each MTP layer, each head block (HF's head tensors
    and ours)."""
    by_layer = hf.layer_keys()

    def layer(step: int | str, hf_index: int) -> list[Range]:
        keys = [k for k in by_layer.get(hf_index, []) if not (_EXPERT.search(k) and ".shared_expert" not in k)]
        return _hf_ranges(hf, keys) + ours.files(step)

    emb = "embedding.word_embeddings.weight"
    step = ours.ck.entry(emb).chunk[0]
    steps = [[hf.byte_range("model.embed_tokens.weight", rows=slice(0, cfg.vocab_size))]  # every row (issue 34)
             + [r for k in range(-(-cfg.vocab_size // step))
                for r in ours.chunk_ranges(emb, (slice(k * step, (k + 1) * step),))]]
    steps += [layer(i, i) for i in range(cfg.num_layers)]
    # the final norm (read right after the last layer, before any MTP layer) goes with it
    steps[-1] += [hf.byte_range("model.norm.weight")] + ours.chunk_ranges("decoder.final_layernorm.weight", ())
    steps += [layer(f"mtp.{j}", cfg.num_layers + j) for j in range(cfg.mtp_num_layers)]
    head_keys = ["model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"]
    head_keys += [k for j in range(cfg.mtp_num_layers)
                  if hf.has(k := f"model.layers.{cfg.num_layers + j}.shared_head.head.weight")]
    for a in range(0, cfg.vocab_size, head_rows):
        rows = slice(a, min(a + head_rows, cfg.vocab_size))
        steps.append([hf.byte_range(k, rows=rows) for k in head_keys] + ours.chunk_ranges(ours.head_name(), (rows,)))
    return steps


def _expert_walk(ahead: Readahead | None, ranges: Callable[[int], list[Range]], order: list[int]):
    """`at(k)` for a walk over routed experts in `order` (None: no read-ahead)."""
    if ahead is None:
        return lambda k: None
    return ahead.walk([ranges(e) for e in order]).at


def _hf_ranges(w: HFWeights, keys: list[str]) -> list[Range | None]:
    """HF tensors' byte ranges, with their FP8 block scales where they have them."""
    return [w.byte_range(k) for k in keys + [k + SCALE_SUFFIX for k in keys if w.has(k + SCALE_SUFFIX)]]


def _stream(cfg: ModelConfig, hf: _HFSide, ours: _OurSide, weights: HFWeights, plan: dict, pool: CastPool,
            ahead: Readahead, walk: Walk, started: float, input_ids: Tensor, next_ids: list[Tensor],
            needed: Tensor, *,
            tolerance: float, all_experts: bool, progress: Callable[[int], None] | None) -> dict:
    """stream_parity's walk: the embedding (read-ahead step 0), the decoder layers (1..L) and MTP layers, the head
    blocks, each side a piece at a time."""
    batch, seq_len = input_ids.shape
    inner, keys = hf.model.model, hf.keys
    layers: list[dict] = []
    cos, sin = ours.model.rope(input_ids, None, torch.float32)
    state: dict[str, Any] = {"reported": 0}

    def report_progress() -> None:
        if progress:
            total = ours.bytes_read + weights.bytes_read
            progress(total - state["reported"])
            state["reported"] = total

    # embedding: every row compared bit for bit (issue 34: the test tokens select only a few), a block at a time,
    # each side's rows read once; the rows of the test tokens kept for the forward
    emb, hf_emb = "embedding.word_embeddings.weight", "model.embed_tokens.weight"
    hf_rows = torch.empty(len(needed), cfg.hidden_size)
    my_rows = torch.empty(len(needed), cfg.hidden_size)

    def read_hf(a: int, b: int) -> Tensor:
        if a:
            weights.release()  # the previous block's files
        theirs = weights.get(hf_emb, rows=slice(a, b))
        sel = ((needed >= a) & (needed < b)).nonzero().flatten()
        hf_rows[sel] = theirs[needed[sel] - a].float()
        return theirs

    def read_ours(a: int, b: int) -> list[tuple[int, int, Tensor]]:
        rows = ours.read_rows(emb, a, b)
        for lo, hi, mine in rows:
            s = ((needed >= lo) & (needed < hi)).nonzero().flatten()
            my_rows[s] = mine[needed[s] - lo].float()
        return rows

    embedding = compare_rows(emb, hf_emb, cfg.vocab_size, read_ours, read_hf, block=plan["head_rows"])
    weights.release()
    hf_embed = _Gathered(needed, hf_rows)
    our_embed = _Gathered(needed, my_rows)
    inner.embed_tokens = hf_embed
    layers.append({"layer": "embedding", "max_abs_diff": (our_embed.rows - hf_rows).abs().max().item()})
    state["chain"] = our_embed(input_ids)

    standins: dict[int, _StreamedHFExperts] = {}
    hf_biases: list[tuple[int, Tensor]] = []  # HF's router score-correction bias of each MoE layer, as loaded
    for i, layer in enumerate(inner.layers):
        lk = keys.get(i, [])
        routed = _hf_experts_module(layer)
        prefix = f"decoder.layers.{i}."
        pieces = plan["mlp_pieces"].get(i, 1)
        skip: set[str] = set()
        if routed is not None:
            expert_keys = _expert_keys(lk)
            layer.mlp.experts = standins[i] = _StreamedHFExperts(hf, i, expert_keys, cfg.num_moe_experts,
                                                                 all_experts, ahead)
            skip = {k for ks in expert_keys.values() for k in ks}
        elif pieces > 1:
            mp = f"model.layers.{i}.mlp."
            layer.mlp = _ChunkedHFMLP(hf, i, layer.mlp, ours.mlp_ranges(prefix, pieces), mp)
            skip = {k for k in lk if k.startswith(mp)}
        rest = [k for k in lk if k not in skip]

        def pre(m, args, kwargs, rest=rest, i=i):
            walk.at(1 + i)
            state["layer_kwargs"] = {k: v for k, v in kwargs.items() if k != "hidden_states"}
            hf.load(m, rest)  # the stand-ins hold no tensors: they read their own

        def post(m, args, kwargs, out, i=i, prefix=prefix, pieces=pieces):
            h_in = args[0] if args else kwargs["hidden_states"]
            h_out = out[0] if isinstance(out, tuple) else out
            hb = getattr(getattr(getattr(m, "mlp", None), "gate", None), "e_score_correction_bias", None)
            if isinstance(hb, torch.Tensor) and not hb.is_meta:  # (issue 34: compared directly after the walk)
                hf_biases.append((i, hb.detach().float().clone()))
            free_piece(m, pool)
            weights.release()
            mine = ours.model.decoder.layers[str(i)]
            rep: dict = {}
            on_hf, state["chain"] = ours.layer(prefix, mine, [h_in, state["chain"]], cos, sin, pieces=pieces,
                                               hf_experts=standins.get(i), report=rep)
            state["last_hf"] = h_out
            layers.append(_row(i, on_hf, h_out, rep, standins.get(i), cfg, tolerance, pieces))
            if i in standins:  # the rows it kept are not needed any more
                standins[i].inputs, standins[i].outputs = {}, {}
            report_progress()

        layer.register_forward_pre_hook(pre, with_kwargs=True)
        layer.register_forward_hook(post, with_kwargs=True)
        attn = getattr(layer, "self_attn", None)
        if attn is not None and (routed is not None or pieces > 1):  # free attention before the MLP's pieces
            attn.register_forward_hook(lambda m, a, o: free_piece(m, pool))

    def norm_pre(m, args):
        hf.load(m, ["model.norm.weight"])

    inner.norm.register_forward_pre_hook(norm_pre)
    inner.norm.register_forward_hook(lambda m, a, o: free_piece(m))
    head = hf.model.lm_head = _DeferredHead(cfg.vocab_size)

    with torch.no_grad():
        hf.model(input_ids=input_ids, use_cache=False)
        hf_heads = [(head.input, hf.head_key())]
        final = ours.model.decoder.final_layernorm
        ours.fill("decoder.final_layernorm.", final)
        our_heads = [final(state["chain"]), final(state["last_hf"])]  # end to end; the head on HF's hidden
        free_piece(final)
        mtp_rows = _mtp(hf, ours, weights, cfg, state, next_ids, hf_embed, our_embed, cos, sin, tolerance,
                        all_experts, hf_heads, our_heads,
                        hint=lambda j: walk.at(1 + cfg.num_layers + j), ahead=ahead)
        report_progress()
        pool.clear()  # the layers' shapes: not the head's
        hf_logits, our_logits = _head_logits(
            weights, hf_heads, lambda a, b: ours.read_rows(ours.head_name(), a, b), our_heads,
            cfg.vocab_size, plan["head_rows"], pool,
            hint=lambda k: walk.at(1 + cfg.num_layers + cfg.mtp_num_layers + k))
        pool.clear()
        report_progress()
    if our_logits[0].shape != hf_logits[0].shape:
        raise ShardkitError(f"logit shapes differ: ours {tuple(our_logits[0].shape)}, HF {tuple(hf_logits[0].shape)}")
    diff = (our_logits[0] - hf_logits[0]).abs()
    layers.append({"layer": "head", "max_abs_diff": (our_logits[1] - hf_logits[0]).abs().max().item()})
    mtp_end = []
    for j, row in enumerate(mtp_rows):
        row["logits_max_abs_diff"] = (our_logits[3 + 2 * j] - hf_logits[1 + j]).abs().max().item()
        mtp_end.append((our_logits[2 + 2 * j] - hf_logits[1 + j]).abs().max().item())
        layers.append(row)
    first = next((r for r in layers if _beyond(r, tolerance)), None)
    moe = [r for r in layers if "experts" in r]
    out = {"max_abs_diff": diff.max().item(), "mean_abs_diff": diff.mean().item(), "batch": batch,
           "seq_len": seq_len, "dtype": "float32", "mode": "streaming", "layers": layers,
           "first_layer_beyond_tolerance": None if first is None else first["layer"],
           "first_expert_beyond_tolerance": None if first is None else first.get("expert"),
           "layers_ok": first is None, "all_experts": all_experts,
           "experts_exercised": sum(r["experts_exercised"] for r in moe),
           "experts_total": sum(r["experts"] for r in moe),
           "bytes_read": {"ours": ours.bytes_read, "hf": weights.bytes_read},
           "max_reads_of_one_tensor": {"ours": max(ours.reads.values(), default=0),
                                       "hf": max(weights.reads.values(), default=0)},
           "pieces": {"mlp": {str(k): v for k, v in plan["mlp_pieces"].items() if v > 1},
                      "head_rows": plan["head_rows"]},
           "seconds": round(time.perf_counter() - started, 3)}
    if mtp_end:
        out["mtp_max_abs_diff"] = mtp_end
    out["embedding"] = embedding
    out["not_compared"] = ([f"{out['experts_total'] - out['experts_exercised']} of {out['experts_total']} routed "
                            "experts (no test token selected them; --all-experts runs every one)"]
                           if out["experts_exercised"] < out["experts_total"] else [])
    if cfg.moe_router_enable_expert_bias:  # it only selects experts: compared bit for bit, not through the logits
        out["router_bias"] = _compare_biases(ours, hf_biases)
        if not hf_biases:
            out["not_compared"].append("the router expert_bias of every MoE layer (HF's model holds none)")
    state.clear()
    return out


def _compare_biases(ours: "_OurSide", hf_biases: list[tuple[int, Tensor]]) -> dict:
    """Each MoE layer's router expert_bias against HF's e_score_correction_bias, bit for bit (read outside the
    walk's read counts: a few floats per layer)."""
    differ = []
    for i, hb in hf_biases:
        cname, index = canonical_name(f"decoder.layers.{i}.mlp.router.expert_bias", ours.stacked)
        box = None if index is None else (slice(index, index + 1),)
        t = store.from_numpy(ours.ck.read_numpy(cname, box)) if hasattr(ours.ck, "read_numpy") else \
            ours.ck.read(cname, box)
        t = t[0] if index is not None else t
        if t.shape != hb.shape or not torch.equal(t.float(), hb):
            differ.append(i)
    return {"layers": len(hf_biases), "differ": differ}


def _row(i, on_hf: Tensor, h_out: Tensor, rep: dict, standin, cfg: ModelConfig, tolerance: float, pieces: int) -> dict:
    row: dict[str, Any] = {"layer": i, "max_abs_diff": (on_hf - h_out).abs().max().item()}
    if pieces > 1:
        row["mlp_pieces"] = pieces
    if standin is not None:
        row["experts"] = cfg.num_moe_experts
        row["experts_selected"] = len(standin.selected)
        row["experts_exercised"] = len(standin.outputs)
        row["experts_loaded_ours"] = rep.get("experts_loaded", 0)
        e, d = rep.get("worst_expert", (None, 0.0))
        row["expert_max_abs_diff"] = d
        if e is not None and not d <= tolerance:
            row["expert"] = e
    return row


def _beyond(row: dict, tolerance: float) -> bool:
    return any(k in row and not row[k] <= tolerance
               for k in ("max_abs_diff", "expert_max_abs_diff", "eh_proj_max_abs_diff", "logits_max_abs_diff"))


def _expert_keys(keys: list[str]) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for k in keys:
        m = _EXPERT.search(k)
        if m and ".shared_expert" not in k:
            out.setdefault(int(m.group(1)), []).append(k)
    return out


def _same_bits(a: Tensor, b: Tensor) -> bool:
    """`a` and `b` hold the same bytes: dtype, shape and every bit (memcmp, the GIL released; a mapped chunk's view
    compared in place). Equal bits cast to equal fp32 values, so their products with one input are one number."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.contiguous(), b.contiguous()
    n = a.numel() * a.element_size()
    return n == 0 or _memcmp(a.data_ptr(), b.data_ptr(), n) == 0


def _head_logits(weights: HFWeights, hf_heads: list[tuple[Tensor, str]],
                 read_ours: Callable[[int, int], list[tuple[int, int, Tensor]]],
                 our_inputs: list[Tensor], vocab: int, block: int, pool: CastPool | None = None,
                 hint: Callable[[int], None] | None = None) -> tuple[list[Tensor], list[Tensor]]:
    """HF's head(s) and ours on their inputs, in row blocks [a, a + block) of each head tensor (one block: exactly
    the whole), F.linear as nn.Linear; every head tensor read once per side, block by block.

    Each distinct product is computed once per block. Our block is compared with HF's bit for bit as read (the fp32
    cast is exact: equal stored bits are equal fp32 weights); where they are equal, our products are HF's weights'
    products. Inputs equal value for value (ours on HF's hidden state is usually HF's own head input; our end-to-end
    chain is too while it has not drifted) share one product. F.linear of equal operands is one number, so every
    logit (and difference) is what the separate products give; a block or input that differs is computed on its own,
    from its own side's values.

    Where a block has one product only (one head tensor, ours equal to it bit for bit, every input equal value for
    value and finite, the block's weights finite), every output of it is that one product: the block's logits are
    not computed (each output holds zeros there) since every difference between them is exactly zero, and only
    differences are used. That is the usual case of a correct conversion, whose head was then a large share of the
    proof's time (a 1.5 GB Llama-shaped model: its fp32 head block and product, a third of the arithmetic)."""
    pool = pool if pool is not None else CastPool(None)
    keys = list(dict.fromkeys(key for _, key in hf_heads))
    for key in keys:
        rows = weights.shape(key)[0]
        if rows < vocab:
            raise ShardkitError(f"--against {weights.hf_dir}: {key} has {rows} rows, the vocabulary {vocab}")
    inputs = [x for x, _ in hf_heads] + list(our_inputs)
    first = [next(m for m in range(n + 1) if m == n or (inputs[m].shape == x.shape and torch.equal(inputs[m], x)))
             for n, x in enumerate(inputs)]  # the first input equal to each
    hf_out = [x.new_empty(*x.shape[:-1], vocab) for x, _ in hf_heads]
    our_out = [x.new_empty(*x.shape[:-1], vocab) for x in our_inputs]
    H = len(hf_heads)
    one_input = all(f == 0 for f in first) and bool(torch.isfinite(inputs[0]).all())
    for a in range(0, vocab, block):
        b = min(a + block, vocab)
        if hint is not None:  # the walk is at head block a // block: read-ahead of what follows
            hint(a // block)
        mine = read_ours(a, b)  # (lo, hi, rows lo..hi) per storage chunk
        products: dict[tuple[str, int], Tensor] = {}

        def put(out: Tensor, wid: str, n: int, w: Tensor) -> None:
            k = (wid, first[n])
            if k not in products:
                products[k] = F.linear(inputs[n], w)
            out[..., a:b] = products[k]

        matched = None  # the HF head whose block equals ours
        for key in keys:
            whole = a == 0 and b == vocab and weights.shape(key)[0] == vocab
            theirs = weights.get(key) if whole else weights.get(key, rows=slice(a, b))
            weights.release()  # a copy: the file's mapped pages can go
            if matched is None and all(_same_bits(theirs[lo - a:hi - a], t) for lo, hi, t in mine):
                matched, mine = key, None  # our views (mapped pages of our chunks) are not needed any more
                if one_input and len(keys) == 1 and not store.count_nonfinite(store.to_numpy(theirs)):
                    for out in hf_out + our_out:  # one product: every difference in this block is zero
                        out[..., a:b] = 0
                    del theirs
                    continue
            w = pool.cast(theirs)  # the blocks' buffer reused block to block
            del theirs
            for n, (_, k) in enumerate(hf_heads):
                if k == key:
                    put(hf_out[n], key, n, w)
            if matched == key:
                for m, out in enumerate(our_out):
                    put(out, key, H + m, w)
            pool.give(w)
            del w
        if matched is None:
            w = pool.take((b - a, inputs[0].shape[-1]))
            for lo, hi, t in mine:
                w[lo - a:hi - a] = t
            for m, out in enumerate(our_out):
                put(out, "ours", H + m, w)
            pool.give(w)
            del w
        del mine
        products.clear()
    return hf_out, our_out


def _mtp(hf: _HFSide, ours: _OurSide, weights: HFWeights, cfg: ModelConfig, state: dict, next_ids: list[Tensor],
         hf_embed: _Gathered, our_embed: _Gathered, cos: Tensor, sin: Tensor, tolerance: float, all_experts: bool,
         hf_heads: list, our_heads: list, hint: Callable[[int], None] | None = None,
         ahead: Readahead | None = None) -> list[dict]:
    """DeepSeek-V3's MTP depths, each on HF's hidden state (and ours on our chain); appends each depth's head inputs
    (HF's, ours end to end, ours on HF's hidden) for the blocked head pass. Returns one row per depth. Both sides
    read what megatron-core's MTP block reads (GPTModel.mtp_forward): the decoder's final-normed output for the first
    depth, each depth's output after its final norm (HF: shared_head.norm) for the next."""
    rows = []
    if not cfg.mtp_num_layers:
        return rows
    L, h = cfg.num_layers, cfg.hidden_size
    model = hf.mtp_model()
    norm_cls = type(hf.model.model.norm)
    hf_prev, our_prev = hf_heads[0][0], our_heads[0]  # the final-normed decoder outputs, HF's and ours end to end
    for j in range(cfg.mtp_num_layers):
        if hint is not None:
            hint(j)  # the walk is at depth j: read-ahead of what follows
        p = f"model.layers.{L + j}."
        keys = hf.keys.get(L + j, [])
        if not keys:
            raise ShardkitError(f"--against {weights.hf_dir}: HF weights missing for MTP layer {j} ({p}enorm.weight)")
        layer = model.model.layers[L + j]
        routed = _hf_experts_module(layer)
        expert_keys = _expert_keys(keys) if routed is not None else {}
        standin = None
        if routed is not None:
            layer.mlp.experts = standin = _StreamedHFExperts(hf, L + j, expert_keys, cfg.num_moe_experts,
                                                             all_experts, ahead)
        flat = {k for ks in expert_keys.values() for k in ks}
        block = [k for k in keys if k not in flat and not k[len(p):].startswith(_MTP_OWN)]
        with torch.device("meta"):
            enorm, hnorm, snorm = (norm_cls(h, eps=cfg.norm_epsilon) for _ in range(3))
            eh_proj = nn.Linear(2 * h, h, bias=False)
        for mod, key in ((enorm, "enorm.weight"), (hnorm, "hnorm.weight"), (snorm, "shared_head.norm.weight"),
                         (eh_proj, "eh_proj.weight")):
            mod.to_empty(device="cpu")
            mod.weight.copy_(weights.get(p + key).float())
        emb = hf_embed(next_ids[j])
        x_hf = eh_proj(torch.cat((enorm(emb), hnorm(hf_prev)), dim=-1))
        hf.load(layer, block, model=model, mapping=hf._mtp_mapping)
        out = layer(x_hf, **state["layer_kwargs"])
        y_hf = out[0] if isinstance(out, tuple) else out
        free_piece(layer, hf.pool)
        weights.release()
        head_key = p + "shared_head.head.weight"
        hf_out = snorm(y_hf)
        hf_heads.append((hf_out, head_key if weights.has(head_key) else
                         ("model.embed_tokens.weight" if hf.tied else "lm_head.weight")))
        # ours
        mine = ours.model.mtp.layers[j]
        q = f"mtp.layers.{j}."
        for name in ("enorm", "hnorm", "eh_proj", "final_layernorm"):
            ours.fill(q + name + ".", getattr(mine, name))
        our_emb = our_embed(next_ids[j])
        x_on_hf = mine.eh_proj(torch.cat((mine.enorm(our_emb), mine.hnorm(hf_prev)), dim=-1))
        x_chain = mine.eh_proj(torch.cat((mine.enorm(our_emb), mine.hnorm(our_prev)), dim=-1))
        rep: dict = {}
        on_hf, chain = ours.layer(q + "transformer_layer.", mine.transformer_layer, [x_hf, x_chain], cos, sin,
                                  hf_experts=standin, report=rep)
        row = _row(f"mtp.{j}", on_hf, y_hf, rep, standin, cfg, tolerance, 1)
        row["eh_proj_max_abs_diff"] = (x_on_hf - x_hf).abs().max().item()
        rows.append(row)
        our_out = mine.final_layernorm(chain)
        our_heads.extend([our_out, mine.final_layernorm(on_hf)])
        for name in ("enorm", "hnorm", "eh_proj", "final_layernorm"):
            free_piece(getattr(mine, name), ours.pool)
        hf_prev, our_prev = hf_out, our_out
    return rows


def hf_config(hf_dir: Path, weights: HFWeights) -> ModelConfig:
    """The HF model's config as we read it, its MTP layers counted as the weights have them (transformers saves a
    DeepSeek-V3 claiming one MTP layer without its weights; the conversion drops it the same way)."""
    theirs = ModelConfig.from_hf_dir(hf_dir)
    if theirs.mtp_num_layers:
        present = {int(m.group(1)) for k in weights.file_of if (m := LAYER_KEY.match(k))}
        have = sum(1 for j in range(theirs.mtp_num_layers) if theirs.num_layers + j in present)
        if have != theirs.mtp_num_layers:
            theirs = replace(theirs, mtp_num_layers=have)
    return theirs


# fields that do not change the forward's math (the comparison runs in fp32 from either side's stored values)
_NOT_MATH = {"params_dtype", "make_vocab_size_divisible_by", "moe_aux_loss_coeff", "hf_config"}


def check_same_math(ours: ModelConfig, theirs: ModelConfig, hf_dir: Path) -> None:
    """One line naming the first field (that changes the math) whose value differs, before any layer runs."""
    import dataclasses

    if theirs.model_type != ours.model_type:
        raise ShardkitError(f"--against {hf_dir}: a {theirs.model_type} model, but the checkpoint is {ours.model_type}")
    for f in dataclasses.fields(ModelConfig):
        if f.name in _NOT_MATH:
            continue
        a, b = getattr(ours, f.name, None), getattr(theirs, f.name, None)
        if a != b:
            raise ShardkitError(f"--against {hf_dir}: {f.name} is {b!r} there but {a!r} in the checkpoint; "
                                "compare against the model it was converted from")
