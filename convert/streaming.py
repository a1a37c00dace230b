"""Streaming logit parity: `verify --against` for checkpoints too big to build whole, one layer in memory at a time.

transformers runs its own forward over a model built on the meta device; a forward pre-hook fills each piece (the
embedding, one decoder layer without its routed experts, the final norm, the head) from the HF safetensors through
transformers' own loader (`convert_and_load_state_dict_in_model`, so its key renaming and expert fusing apply, not
ours) and a forward hook frees it again. Routed experts are loaded one at a time, and only those the test tokens
select: a one-expert copy of transformers' experts module takes each expert's tensors and its tokens in turn.

When HF's decoder layer i has run, ours runs twice on the same weights, read from the checkpoint's chunks for that
layer only: once on HF's input of the layer (the per-layer number: each layer compared on the HF hidden state, so a
wrong layer is named instead of drifting into the next) and once on our own chain (whose final logits are the
end-to-end number, the same computation as the whole-model mode). Everything runs in fp32 on the CPU.
"""
from __future__ import annotations

import copy
import json
import math
import os
import re
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import safe_open
from torch import Tensor, nn

from checkpoint.config import ModelConfig
from checkpoint.errors import ShardkitError
from checkpoint.reader import Checkpoint
from checkpoint.sharding import SCALE_SUFFIX, split_optimizer_key
from train.model import GPTModel, RotaryEmbedding, canonical_name

from .parity import HF_ATTN_IMPLEMENTATION, load_quietly

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.experts\.(\d+)\.")


class HFWeights:
    """Lazy access to an HF model directory's safetensors: key -> tensor, reading only that tensor. Block-FP8 weights
    (DeepSeek-V3's hub format: e4m3 + `weight_scale_inv` per block) come back dequantized as DeepSeek's reference
    `weight_dequant` does: fp32(weight) * the scale of its block, cast to the model's dtype."""

    def __init__(self, hf_dir: Path, fp8_block: tuple[int, int] = (128, 128),
                 dtype: torch.dtype = torch.bfloat16) -> None:
        self.fp8_block, self.dtype = fp8_block, dtype
        index = hf_dir / "model.safetensors.index.json"
        if index.is_file():
            files = json.loads(index.read_text())["weight_map"]
            self.file_of = {k: hf_dir / f for k, f in files.items()}
        else:
            single = hf_dir / "model.safetensors"
            if not single.is_file():
                raise ShardkitError(f"--against {hf_dir}: no model.safetensors or model.safetensors.index.json")
            with safe_open(str(single), "pt") as f:
                self.file_of = {k: single for k in f.keys()}
        self._open: dict[Path, Any] = {}
        self.hf_dir = hf_dir
        self.bytes_read = 0

    def get(self, key: str) -> Tensor:
        path = self.file_of.get(key)
        if path is None:
            raise ShardkitError(f"--against {self.hf_dir}: the HF weights have no tensor {key}")
        if path not in self._open:
            self._open[path] = safe_open(str(path), "pt")
        t = self._open[path].get_tensor(key)
        self.bytes_read += t.numel() * t.element_size()
        if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            scale = key + SCALE_SUFFIX
            if scale not in self.file_of:
                raise ShardkitError(f"--against {self.hf_dir}: {key} is FP8 but there is no {scale}")
            s = self.get(scale)
            br, bc = self.fp8_block
            r, c = t.shape
            if s.shape != (-(-r // br), -(-c // bc)):
                raise ShardkitError(f"--against {self.hf_dir}: {scale} has shape {tuple(s.shape)}, expected "
                                    f"{(-(-r // br), -(-c // bc))} for {key} {tuple(t.shape)} in {br}x{bc} blocks")
            t = (t.float() * s.repeat_interleave(br, 0).repeat_interleave(bc, 1)[:r, :c]).to(self.dtype)
        return t

    def layer_keys(self) -> dict[int | None, list[str]]:
        """Keys by decoder layer (None: outside the layers)."""
        out: dict[int | None, list[str]] = {}
        for k in self.file_of:
            if k.endswith(SCALE_SUFFIX):  # read with its weight
                continue
            m = _LAYER.match(k)
            out.setdefault(int(m.group(1)) if m else None, []).append(k)
        return out


def _fp8_settings(hf_dir: Path) -> tuple[tuple[int, int], torch.dtype]:
    """(block, dtype) of a block-FP8 source's dequantization: its quantization_config's weight_block_size and the
    dtype config.json names (DeepSeek-V3: 128x128, bfloat16)."""
    raw = json.loads((hf_dir / "config.json").read_text())
    block = tuple((raw.get("quantization_config") or {}).get("weight_block_size") or (128, 128))
    name = raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"
    return block, getattr(torch, name, torch.bfloat16) if isinstance(name, str) else torch.bfloat16


def _free(module: nn.Module) -> None:
    module.to_empty(device="meta")


class _HFSide:
    """transformers' model on the meta device, filled piece by piece from the safetensors."""

    def __init__(self, hf_dir: Path, weights: HFWeights, num_layers: int) -> None:
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
        self.mapping = get_model_conversion_mapping(self.model)
        self.keys = weights.layer_keys()
        self.num_layers = num_layers
        self.tied = bool(getattr(self.config, "tie_word_embeddings", False))

    def load(self, module: nn.Module, keys: list[str], model: nn.Module | None = None, rename=None) -> None:
        """Materialise `module` (a part of `model`, default the whole meta model) and fill it with `keys` through
        transformers' own loader."""
        from transformers.core_model_loading import convert_and_load_state_dict_in_model
        from transformers.modeling_utils import LoadStateDictConfig

        module.to_empty(device="cpu")
        sd = {(rename(k) if rename else k): self.weights.get(k) for k in keys}
        target = self.model if model is None else model
        mapping = self.mapping if model is None else self._mini_mapping
        info, _ = convert_and_load_state_dict_in_model(
            target, sd, LoadStateDictConfig(weight_mapping=mapping, dtype=torch.float32))
        prefixes = self._prefixes(module, target)
        missing = {k for k in info.missing_keys if any(k.startswith(p) for p in prefixes)}
        if missing:
            raise ShardkitError(f"--against {self.weights.hf_dir}: HF weights missing for {sorted(missing)[0]}")

    @staticmethod
    def _prefixes(module: nn.Module, model: nn.Module) -> list[str]:
        return [name + "." for name, m in model.named_modules() if m is module]

    # -- routed experts, one at a time -------------------------------------------------------------------------
    def mini(self) -> nn.Module:
        """A one-layer, one-expert meta copy of the model whose layer 0 is an MoE layer: each routed expert of any
        layer is loaded into its experts module in turn."""
        if not hasattr(self, "_mini"):
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
            with torch.device("meta"):
                self._mini = self.transformers.AutoModelForCausalLM.from_config(c, dtype=torch.float32)
            self._mini_mapping = get_model_conversion_mapping(self._mini)
        return self._mini


def _hf_experts_module(layer: nn.Module) -> tuple[nn.Module, str] | None:
    mlp = getattr(layer, "mlp", None)
    experts = getattr(mlp, "experts", None)
    return (experts, "mlp.experts") if experts is not None and hasattr(mlp, "gate") else None


class _StreamedHFExperts(nn.Module):
    """Stands in for transformers' experts module of one layer: the same call, each hit expert run by transformers'
    own experts module (of the one-expert copy) with that expert's tensors, in expert order as transformers runs
    them."""

    def __init__(self, side: _HFSide, layer: int, expert_keys: dict[int, list[str]], counter: dict) -> None:
        super().__init__()
        self.side, self.layer, self.expert_keys, self.counter = side, layer, expert_keys, counter
        self.inputs: dict[int, Tensor] = {}  # expert -> the rows it saw (to name a wrong expert afterwards)

    def _run(self, e: int, rows: Tensor, weights: Tensor) -> Tensor:
        mini = self.side.mini()
        one = _hf_experts_module(mini.model.layers[0])[0]
        pat = re.compile(rf"^model\.layers\.{self.layer}\.(.*)\.experts\.{e}\.")
        self.side.load(one, self.expert_keys[e], model=mini,
                       rename=lambda k: pat.sub(r"model.layers.0.\1.experts.0.", k))
        y = one(rows, torch.zeros(rows.shape[0], 1, dtype=torch.long), weights[:, None])
        _free(one)
        return y

    def run_one(self, e: int, rows: Tensor) -> Tensor:
        """Expert e alone on `rows`, unweighted."""
        return self._run(e, rows, torch.ones(rows.shape[0], dtype=rows.dtype))

    def forward(self, hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        out = torch.zeros_like(hidden)
        for e in torch.unique(top_k_index).tolist():
            token, slot = torch.where(top_k_index == e)
            rows = self.inputs[e] = hidden.index_select(0, token)
            out.index_add_(0, token, self._run(e, rows, top_k_weights[token, slot]).to(out.dtype))
            self.counter.setdefault(self.layer, set()).add(e)
        return out


class _OurSide:
    """Our model on the meta device; one decoder layer at a time filled from the checkpoint's chunks."""

    def __init__(self, ck: Checkpoint) -> None:
        self.ck, self.cfg = ck, ck.config
        padded = ck.entry("embedding.word_embeddings.weight").shape[0]
        with torch.device("meta"):
            self.model = GPTModel(self.cfg, padded)
        self.model.rotary_pos_emb = RotaryEmbedding(self.cfg)
        self.stacked = not self.cfg.heterogeneous
        self.bytes_read = 0
        self.expert_names: set[str] = set()

    def _read(self, name: str, index: tuple[slice, ...] | None = None) -> Tensor:
        t = self.ck.read(name, index)
        self.bytes_read += t.numel() * t.element_size()
        return t

    def fill(self, prefix: str, module: nn.Module, skip: Callable[[str], bool] = lambda n: False) -> None:
        """Materialise `module` (the model's `prefix`) with its tensors read from the checkpoint."""
        module.to_empty(device="cpu")
        with torch.no_grad():
            for name, p in module.named_parameters():
                if skip(name):
                    continue
                cname, index = canonical_name(prefix + name, self.stacked)
                if cname not in self.ck.tensors:
                    raise ShardkitError(f"{self.ck.path}: the checkpoint has no tensor {cname}")
                p.copy_(self._read(cname, None if index is None else (slice(index, index + 1),))[0]
                        if index is not None else self._read(cname))


class _StreamedOurExperts(nn.Module):
    """Stands in for our GroupedMLP: `forward(x, e)` reads expert e of this layer and runs a one-expert GroupedMLP."""

    def __init__(self, side: _OurSide, prefix: str, grouped: nn.Module) -> None:
        super().__init__()
        self.side, self.prefix = side, prefix
        with torch.device("meta"):
            self.one = type(grouped)(replace(side.cfg, num_moe_experts=1))

    def forward(self, x: Tensor, expert: int) -> Tensor:
        return self.run_one(expert, x)

    def run_one(self, expert: int, x: Tensor) -> Tensor:
        side = self.side
        self.one.to_empty(device="cpu")
        with torch.no_grad():
            for name, p in self.one.named_parameters():
                cname, index = canonical_name(self.prefix + name, side.stacked)
                box = ((slice(index, index + 1),) if index is not None else ()) + (slice(expert, expert + 1),)
                t = side._read(cname, box)
                p.copy_(t.reshape(p.shape))
        y = self.one(x, 0)
        _free(self.one)
        return y


def stream_parity(ck: Checkpoint, hf_dir: str | Path, *, batch: int = 2, seq_len: int = 32, seed: int = 0,
                  tolerance: float = 1e-4, progress: Callable[[int], None] | None = None) -> dict:
    """Per-layer and end-to-end |ours - HF| with one layer's weights in memory at a time (see the module doc)."""
    hf_dir = Path(hf_dir)
    cfg: ModelConfig = ck.config
    if seq_len < 1 or batch < 1:
        raise ShardkitError(f"--seq-length {seq_len}: the logit comparison needs at least one token per sequence")
    if ck.manifest.fp8:
        raise ShardkitError(f"{ck.path}: kept block-FP8 weights; streaming parity of them is not supported yet "
                            "(verify without --streaming)")
    theirs = ModelConfig.from_hf_dir(hf_dir)
    check_same_math(cfg, theirs, hf_dir)
    weights = HFWeights(hf_dir, *_fp8_settings(hf_dir))
    hf = load_quietly(lambda: _HFSide(hf_dir, weights, cfg.num_layers), hf_dir)
    ours = _OurSide(ck)
    inner = hf.model.model
    keys = hf.keys
    exercised: dict[int, set[int]] = {}
    layers: list[dict] = []
    routed_standins: dict[int, _StreamedHFExperts] = {}
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, cfg.vocab_size, (batch, seq_len), generator=generator)
    cos, sin = ours.model.rope(input_ids, None, torch.float32)
    state = {"chain": None}

    def filled(module: nn.Module, keys_: list[str]):
        def pre(m, args, kwargs=None):
            hf.load(m, keys_)
        return pre

    def freeing(m, args, out):
        _free(m)

    # embedding
    def embed_done(m, args, out):
        ours.fill("embedding.", ours.model.embedding)
        mine = ours.model.embed(input_ids)
        layers.append({"layer": "embedding", "max_abs_diff": (mine - out).abs().max().item()})
        state["chain"] = mine
        _free(ours.model.embedding)
        _free(m)

    inner.embed_tokens.register_forward_pre_hook(filled(inner.embed_tokens, ["model.embed_tokens.weight"]))
    inner.embed_tokens.register_forward_hook(embed_done)

    for i, layer in enumerate(inner.layers):
        lk = keys.get(i, [])
        routed = _hf_experts_module(layer)
        expert_keys: dict[int, list[str]] = {}
        if routed is not None:
            for k in lk:
                m = _EXPERT.search(k)
                if m and ".shared_expert" not in k:
                    expert_keys.setdefault(int(m.group(1)), []).append(k)
            layer.mlp.experts = routed_standins[i] = _StreamedHFExperts(hf, i, expert_keys, exercised)
        flat = {k for ks in expert_keys.values() for k in ks}
        rest = [k for k in lk if k not in flat]

        def pre(m, args, kwargs, rest=rest):
            hf.load(m, rest)  # the experts' stand-in holds no tensors: it reads its own

        def post(m, args, kwargs, out, i=i):
            h_in = args[0] if args else kwargs["hidden_states"]
            h_out = out[0] if isinstance(out, tuple) else out
            _free(m)
            prefix = f"decoder.layers.{i}."
            mine = ours.model.decoder.layers[str(i)]
            grouped = _our_grouped(mine)
            if grouped is not None:
                mine.mlp.experts.experts = _StreamedOurExperts(ours, prefix + "mlp.experts.experts.", grouped)
            ours.fill(prefix, mine, skip=lambda n: n.startswith("mlp.experts.experts."))
            with torch.no_grad():
                on_hf = mine(h_in, cos, sin)
                state["chain"] = mine(state["chain"], cos, sin)
            row = {"layer": i, "max_abs_diff": (on_hf - h_out).abs().max().item()}
            if grouped is not None:
                row["experts_exercised"] = len(exercised.get(i, ()))
                row["experts"] = cfg.num_moe_experts
                if not row["max_abs_diff"] <= tolerance:  # name the expert: each one alone on the rows it saw
                    theirs_, mine_ = routed_standins[i], mine.mlp.experts.experts
                    worst = max(((e, (mine_.run_one(e, x) - theirs_.run_one(e, x)).abs().max().item())
                                 for e, x in sorted(theirs_.inputs.items())), key=lambda t: t[1], default=None)
                    if worst is not None and worst[1] > tolerance:
                        row["expert"], row["expert_max_abs_diff"] = worst
            layers.append(row)
            mine.to_empty(device="meta")
            if progress:
                total = ours.bytes_read + weights.bytes_read
                progress(total - state.get("reported", 0))
                state["reported"] = total

        layer.register_forward_pre_hook(pre, with_kwargs=True)
        layer.register_forward_hook(post, with_kwargs=True)

    inner.norm.register_forward_pre_hook(filled(inner.norm, ["model.norm.weight"]))
    inner.norm.register_forward_hook(freeing)
    head_key = "model.embed_tokens.weight" if hf.tied else "lm_head.weight"
    lm_head = hf.model.lm_head

    def head_pre(m, args):
        m.to_empty(device="cpu")
        with torch.no_grad():
            m.weight.copy_(weights.get(head_key).float())

    lm_head.register_forward_pre_hook(head_pre)
    lm_head.register_forward_hook(freeing)

    with torch.no_grad():
        hf_logits = hf.model(input_ids=input_ids, use_cache=False).logits.float()
        ours.fill("decoder.final_layernorm.", ours.model.decoder.final_layernorm)
        head = "embedding." if ours.model.output_layer is None else "output_layer."
        head_module = ours.model.embedding if ours.model.output_layer is None else ours.model.output_layer
        ours.fill(head, head_module)
        ours_logits = ours.model.logits(ours.model.decoder.final_layernorm(state["chain"]))
    if ours_logits.shape != hf_logits.shape:
        raise ShardkitError(f"logit shapes differ: ours {tuple(ours_logits.shape)}, HF {tuple(hf_logits.shape)}")
    diff = (ours_logits - hf_logits).abs()
    first_bad = next((r["layer"] for r in layers if not r["max_abs_diff"] <= tolerance), None)
    return {"max_abs_diff": diff.max().item(), "mean_abs_diff": diff.mean().item(), "batch": batch,
            "seq_len": seq_len, "dtype": "float32", "mode": "streaming", "layers": layers,
            "first_layer_beyond_tolerance": first_bad,
            "bytes_read": {"ours": ours.bytes_read, "hf": weights.bytes_read}}


def _our_grouped(layer: nn.Module) -> nn.Module | None:
    experts = getattr(getattr(layer, "mlp", None), "experts", None)
    return getattr(experts, "experts", None)


_MATH_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
                "vocab_size", "norm_epsilon", "rotary_base", "tie_word_embeddings", "num_moe_experts",
                "moe_router_topk", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
                "multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
                "v_head_dim")


def check_same_math(ours: ModelConfig, theirs: ModelConfig, hf_dir: Path) -> None:
    """One line naming the first field (that changes the math) whose value differs, before any layer runs."""
    if theirs.model_type != ours.model_type:
        raise ShardkitError(f"--against {hf_dir}: a {theirs.model_type} model, but the checkpoint is {ours.model_type}")
    for f in _MATH_FIELDS:
        a, b = getattr(ours, f, None), getattr(theirs, f, None)
        if a != b:
            raise ShardkitError(f"--against {hf_dir}: {f} is {b!r} there but {a!r} in the checkpoint")


# -- which mode, within what memory ------------------------------------------------------------------------------

FP32 = 4


def memory_needs(ck: Checkpoint) -> dict[str, int]:
    """fp32 bytes: both whole models (whole mode), and what streaming holds at once, twice its largest piece (a
    layer without its routed experts, one expert, the embedding or the head), from the manifest's shapes."""
    num_layers = ck.config.num_layers
    per_layer: dict[int, int] = {}
    experts: dict[str, int] = {}  # one expert's fc1 + fc2, per layer key
    whole = other = 0
    for name, e in ck.tensors.items():
        if split_optimizer_key(name) is not None or name.endswith(SCALE_SUFFIX):
            continue
        n = math.prod(e.shape)
        whole += n
        m = re.match(r"decoder\.layers\.(\d+)\.", name)  # a per-layer key of a heterogeneous stack
        if e.expert:  # [(L,) E, out, in]
            key = m.group(1) if m else "stacked"
            experts[key] = experts.get(key, 0) + e.shape[-1] * e.shape[-2]
        elif m:
            per_layer[int(m.group(1))] = per_layer.get(int(m.group(1)), 0) + n
        elif name.startswith("decoder.layers."):  # stacked on the layer axis
            for i in range(num_layers):
                per_layer[i] = per_layer.get(i, 0) + n // num_layers
        else:
            other = max(other, n)
    piece = max([other, *experts.values(), *per_layer.values()])
    return {"whole": 2 * FP32 * whole, "streaming": 2 * FP32 * piece}


def available_memory() -> int:
    """MemAvailable of /proc/meminfo (the kernel's estimate of what can be allocated without swapping)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


DEFAULT_BUDGET_FRACTION = 0.5


def choose_mode(ck: Checkpoint, streaming: bool, budget: int | None) -> tuple[str, dict]:
    """'whole' or 'streaming': streaming when asked or when both whole fp32 models exceed the budget (default half of
    the available memory); a budget too small for streaming's largest piece is one line with the size needed."""
    need = memory_needs(ck)
    given = budget is not None
    budget = budget if given else int(available_memory() * DEFAULT_BUDGET_FRACTION)
    mode = "streaming" if streaming or need["whole"] > budget else "whole"
    if mode == "streaming" and need["streaming"] > budget:
        what = f"--memory-budget {budget:,} bytes" if given else f"half of the available memory ({budget:,} bytes)"
        raise ShardkitError(f"{what} is too small: streaming parity holds one layer (or one expert, or the "
                            f"embedding) of {ck.path} at a time, {need['streaming']:,} bytes in fp32")
    return mode, {**need, "budget": budget}
