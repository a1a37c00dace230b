"""The Transformer Engine backend (`--transformer-impl transformer_engine`): the decoder layers of a stage rebuilt from
TE modules, with TE doing the tensor-parallel / sequence-parallel / context-parallel communication and FP8.

    self_attention.linear_qkv   te.LayerNormLinear(RMSNorm, parallel_mode="column")  layer_norm_weight, weight, bias
    self_attention.core_attention  te.DotProductAttention(GQA, causal, bshd; CP group when --cp > 1; packed
                                documents: thd with cu_seqlens, see below)
    self_attention.linear_proj  te.Linear(parallel_mode="row")                        weight, bias
    mlp.linear_fc1              te.LayerNormLinear(RMSNorm, column)                   layer_norm_weight, weight, bias
    mlp.linear_fc2              te.Linear(row)                                        weight, bias

TE's LayerNormLinear calls its norm `layer_norm_weight`, which is already the canonical name, so the modules sit at the
canonical attribute paths and every parameter keeps its canonical name and local shape: loading and saving go
through the sharding table unchanged. Only dense LLaMA-family layers (no MLA, no MoE, no sliding window) have a TE
form here; the others are a ConfigError. TE works in [s, b, h] (its sequence-parallel collectives act on dim 0): a
layer transposes on entry and exit, a free view at micro-batch size 1.

FP8 runs through `te.autocast(enabled, recipe, amax_reduction_group)` (TE >= 2.9; `fp8_autocast` before), entered
for each micro-batch's forward, with DelayedScaling / Float8CurrentScaling / Float8BlockScaling from --fp8-recipe and
the amax reduction over the stage's TP x CP x DP ranks (as Megatron). TE keeps its scaling state in each module's
`fp8_meta` and pickles it into `_extra_state`; shardkit never stores that pickle: the amax histories and scales are
read from `fp8_meta` and written in the same JSON form and names as the local backend's (`train/fp8.py`), so the
state is resumable, without pickle, and even across backends.

Packed documents (--reset-attention-mask): a micro-batch's document ids reach the layers through the stage's
context.AttentionState (`TEBackend.wrap` hands it to every TE attention; full-layer recompute restores it), and
attention then goes through TE's THD path: the [b, s] tokens flattened to t = b*s, one segment per (row, document),
`cu_seqlens_q = cu_seqlens_kv` from context.varlen_pack (as flash-attn's varlen call), `max_seqlen_q/kv` from the
data, `attn_mask_type="padding_causal"` (causal within each segment; TE's documented option 2 for unpadded
variable-length sequences). --reset-position-ids and --eod-mask-loss need nothing here (RoPE positions and loss
weights come from outside the layers). With --context-parallel-size > 1 packed documents are refused
(`packed_cp_refusal`): TE's THD context parallelism splits every document into 2 x cp chunks, shardkit's zigzag
splits the packed sequence, so the two disagree about which tokens a rank holds.

Transformer Engine needs a CUDA GPU and a source build; it is imported only when this backend is asked for. What
runs without it (and is tested on CPU): `resolve_impl`, `recipe_spec`, the `fp8_meta` <-> checkpoint conversion, and
the layers' calls into TE (bshd and thd) against a stand-in module with TE's documented semantics
(tests/test_flag_backend.py); TE's own kernels are not run there.
"""
from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from checkpoint.config import ModelConfig
from checkpoint.errors import ConfigError
from train.fp8 import STATE_VERSION, FP8Config, _b64, _unb64, bf16_layers
from train.model import apply_rope
from train.parallel.groups import Groups
from train.parallel.tensor import local_config

INSTALL = ("pip install --no-build-isolation 'transformer-engine[pytorch]' (needs CUDA torch, nvcc and cuDNN), "
           "or use --transformer-impl local")
# TE's fp8_meta index of each tensor of a one-GEMM module (FP8FwdTensors.GEMM1_INPUT/WEIGHT, FP8BwdTensors.GRAD_OUTPUT1)
TE_SLOTS = {"input": ("scaling_fwd", 0), "weight": ("scaling_fwd", 1), "grad_output": ("scaling_bwd", 0)}


def te_available() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def check_installed() -> None:
    if not te_available():
        raise ConfigError(f"--transformer-impl transformer_engine: Transformer Engine is not installed; {INSTALL}")


def packed_cp_refusal(cp: int, default: bool = False) -> str:
    """The one line refusing packed documents under TE's context parallelism (see the module docstring)."""
    how = " (Transformer Engine is chosen by default where installed)" if default else ""
    return (f"--reset-attention-mask with --context-parallel-size {cp} and --transformer-impl transformer_engine{how}: "
            "TE's THD context parallelism splits each document over the CP ranks, shardkit's zigzag splits the packed "
            "sequence; use --transformer-impl local (its ring / all-gather attention keeps documents apart under CP)")


def unsupported(cfg: ModelConfig, fp8: FP8Config, recompute: str | None) -> str | None:
    """Why this run has no TE form here (None: it has one): train.engines.coverage.te_form_not_covered, torch-free,
    which `shardkit plan` asks too."""
    from train.engines.coverage import te_form_not_covered

    return te_form_not_covered(cfg, fp8, recompute)


def resolve_impl(requested: str | None, device: torch.device, have_te: bool | None = None,
                 why_not: str | None = None) -> str:
    """--transformer-impl: the explicit choice (checked), or by default TE where it is installed, a GPU is used and
    the run has a TE form (`why_not` is None, see `unsupported`)."""
    have_te = te_available() if have_te is None else have_te
    if requested is None:
        return "transformer_engine" if have_te and device.type == "cuda" and why_not is None else "local"
    if requested == "transformer_engine":
        if not have_te:
            raise ConfigError(f"--transformer-impl transformer_engine: Transformer Engine is not installed; {INSTALL}")
        if device.type != "cuda":
            raise ConfigError("--transformer-impl transformer_engine needs a CUDA GPU (this run is on "
                              f"{device.type}); use --transformer-impl local")
        if why_not is not None:
            raise ConfigError(f"--transformer-impl transformer_engine: {why_not}")
    return requested


def recipe_spec(c: FP8Config) -> tuple[str, dict[str, Any]]:
    """(class name in transformer_engine.common.recipe, keyword arguments) for --fp8-* ; Format given by name."""
    fmt = {"hybrid": "HYBRID", "e4m3": "E4M3"}[c.fp8_format]
    if c.fp8_recipe == "delayed":
        kw: dict[str, Any] = {"margin": c.fp8_margin, "fp8_format": fmt, "amax_history_len": c.fp8_amax_history_len,
                              "amax_compute_algo": c.fp8_amax_compute_algo}
        if not c.fp8_wgrad:
            kw["override_linear_precision"] = (False, False, True)
        return "DelayedScaling", kw
    if not c.fp8_wgrad:
        raise ConfigError(f"--no-fp8-wgrad with --transformer-impl transformer_engine works with --fp8-recipe delayed "
                          f"only (got {c.fp8_recipe})")
    if c.fp8_recipe == "tensorwise":
        return "Float8CurrentScaling", {"fp8_format": fmt}
    if c.fp8_recipe == "blockwise":
        return "Float8BlockScaling", {"fp8_format": fmt}
    raise ConfigError(f"--fp8-recipe {c.fp8_recipe!r}: no Transformer Engine recipe")


def build_recipe(c: FP8Config, recipe_module) -> Any:
    name, kw = recipe_spec(c)
    kw = dict(kw, fp8_format=getattr(recipe_module.Format, kw["fp8_format"]))
    return getattr(recipe_module, name)(**kw)


def autocast_factory(te, enabled: bool, recipe, group) -> Callable[[], contextlib.AbstractContextManager]:
    """te.autocast (TE >= 2.9) or fp8_autocast (older), with the amax reduction group."""
    if hasattr(te, "autocast"):
        return lambda: te.autocast(enabled=enabled, recipe=recipe, amax_reduction_group=group)
    return lambda: te.fp8_autocast(enabled=enabled, fp8_recipe=recipe, fp8_group=group)


# -- FP8 scaling state: TE's fp8_meta <-> shardkit's JSON form (no pickle) -------------------------------------------

def meta_to_state(module_name: str, fwd: tuple[Tensor, Tensor], bwd: tuple[Tensor, Tensor]) -> dict[str, dict]:
    """One TE one-GEMM module's DelayedScaling state -> {'<module>.<role>': {amax_history, scale}} in train/fp8.py's
    format. fwd/bwd = (amax_history [H, n], scale [n]) of fp8_meta['scaling_fwd'] / ['scaling_bwd']."""
    out = {}
    for role, (which, idx) in TE_SLOTS.items():
        hist, scale = fwd if which == "scaling_fwd" else bwd
        h = hist.detach().float().cpu().numpy()[:, idx]
        s = scale.detach().float().cpu().numpy()[idx: idx + 1]
        out[f"{module_name}.{role}"] = {"amax_history": _b64(h), "scale": _b64(s)}
    return out


@torch.no_grad()
def state_to_meta(module_name: str, tensors: dict, fwd: tuple[Tensor, Tensor], bwd: tuple[Tensor, Tensor],
                  where: str) -> None:
    """The inverse: copy a module's saved histories and scales into TE's fp8_meta tensors (in place)."""
    for role, (which, idx) in TE_SLOTS.items():
        name = f"{module_name}.{role}"
        if name not in tensors:
            raise ConfigError(f"{where}: no FP8 delayed-scaling state for {name}; train with the same FP8 flags")
        hist_t, scale_t = fwd if which == "scaling_fwd" else bwd
        hist, scale = _unb64(tensors[name]["amax_history"]), _unb64(tensors[name]["scale"])
        if hist.shape[0] != hist_t.shape[0]:
            raise ConfigError(f"{where}: {name} has an amax history of {hist.shape[0]} steps, this run "
                              f"--fp8-amax-history-len {hist_t.shape[0]}; use the checkpoint's length")
        hist_t[:, idx] = torch.from_numpy(np.array(hist)).to(hist_t.device)
        scale_t[idx] = float(scale[0])


def fp8_meta_tensors(module) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]] | None:
    """A TE module's delayed-scaling tensors ((amax_history, scale) forward, backward), or None before TE set them
    up (at the module's first FP8 forward, or init_fp8_metadata under autocast)."""
    meta = getattr(module, "fp8_meta", None) or {}
    f, b = meta.get("scaling_fwd"), meta.get("scaling_bwd")
    if f is None or b is None:
        return None
    return (f.amax_history, f.scale), (b.amax_history, b.scale)


def modules_state(c: FP8Config, modules) -> dict | None:
    """The delayed-scaling state of TE one-GEMM modules [(global module name, module)] in train/fp8.py's checkpoint
    form (None without delayed scaling); modules TE has not set up yet are left out."""
    if not (c.enabled and c.fp8_recipe == "delayed"):
        return None
    tensors = {}
    for name, mod in modules:
        meta = fp8_meta_tensors(mod)
        if meta is not None:
            tensors.update(meta_to_state(name, *meta))
    return {"version": STATE_VERSION, "recipe": "delayed", "format": c.fp8_format,
            "amax_history_len": c.fp8_amax_history_len, "tensors": tensors}


def load_modules_state(c: FP8Config, modules, sd: dict, where: str, autocast: Callable) -> None:
    """The inverse, strict: every module's state must be in `sd`; a module TE has not set up yet is set up first
    (init_fp8_metadata under `autocast()`, the run's FP8 context, so that TE builds fp8_meta for its recipe)."""
    if not (c.enabled and c.fp8_recipe == "delayed"):
        return
    if sd.get("version") != STATE_VERSION:
        raise ConfigError(f"{where}: FP8 state version {sd.get('version')!r}, this shardkit reads {STATE_VERSION}")
    for name, mod in modules:
        if fp8_meta_tensors(mod) is None:
            with autocast():
                mod.init_fp8_metadata()
        meta = fp8_meta_tensors(mod)
        if meta is None:
            raise ConfigError(f"{where}: Transformer Engine did not set up FP8 state for {name}")
        state_to_meta(name, sd["tensors"], *meta, where)


# -- the TE layers --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Parallel:
    tp_group: Any
    tp_size: int
    sequence_parallel: bool
    cp_group: Any
    cp_ranks: list[int] | None
    cp_comm_type: str


def _sbh(x: Tensor) -> Tensor:
    """[b, s, h] -> [s, b, h] as TE's modules take it (flattened to 2-D inside, so contiguous; free at b = 1)."""
    return x.transpose(0, 1).contiguous()


class TESelfAttention(nn.Module):
    """GQA self-attention over the canonical fused QKV (per query group [q heads; k; v]) with TE modules. TE takes the
    global sizes (`cfg`) and splits them itself; this rank's heads and query groups are those of `local` (local_config:
    the sharding table's local shapes)."""

    def __init__(self, te, cfg: ModelConfig, local: ModelConfig, par: _Parallel, dtype: torch.dtype,
                 device: torch.device, selective_recompute: bool) -> None:
        super().__init__()
        h, tp = cfg.hidden_size, par.tp_size
        self.heads, self.groups = local.num_attention_heads, local.num_query_groups
        self.heads_per_group, self.head_dim = cfg.heads_per_group, cfg.kv_channels
        common = dict(tp_group=par.tp_group, tp_size=tp, sequence_parallel=par.sequence_parallel, params_dtype=dtype,
                      device=device)
        self.linear_qkv = te.LayerNormLinear(h, cfg.qkv_rows, eps=cfg.norm_epsilon, bias=cfg.add_qkv_bias,
                                             normalization="RMSNorm", parallel_mode="column", **common)
        self.core_attention = te.DotProductAttention(
            cfg.num_attention_heads, cfg.kv_channels, num_gqa_groups=cfg.num_query_groups, attention_dropout=0.0,
            qkv_format="bshd", attn_mask_type="causal", tp_group=par.tp_group, tp_size=tp,
            sequence_parallel=par.sequence_parallel)
        if par.cp_group is not None:
            self.core_attention.set_context_parallel_group(par.cp_group, par.cp_ranks, torch.cuda.Stream(),
                                                           par.cp_comm_type)
        self.linear_proj = te.Linear(cfg.num_attention_heads * cfg.kv_channels, h, bias=cfg.add_proj_bias,
                                     parallel_mode="row", **common)
        self.selective_recompute = selective_recompute
        self.cp = 1 if par.cp_group is None else len(par.cp_ranks)
        # where the micro-batch's attention layout is read (TEBackend.wrap sets it; _UNWRAPPED: never run unwrapped,
        # so a packed micro-batch can never be attended to as one causal sequence by mistake)
        self.layouts: Any = _UNWRAPPED

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        qkv = self.linear_qkv(_sbh(x)).transpose(0, 1)  # [b, s, rows]: TE works in [s, b, h]
        b, s, _ = qkv.shape
        qkv = qkv.reshape(b, s, self.groups, self.heads_per_group + 2, self.head_dim)
        q = qkv[:, :, :, : self.heads_per_group].reshape(b, s, self.heads, self.head_dim)
        k, v = qkv[:, :, :, -2], qkv[:, :, :, -1]
        q = apply_rope(q.transpose(1, 2), cos, sin).transpose(1, 2).contiguous()
        k = apply_rope(k.transpose(1, 2), cos, sin).transpose(1, 2).contiguous()
        docs = self._docs()
        if docs is None:
            out = self.core_attention(q, k, v.contiguous(), checkpoint_core_attention=self.selective_recompute)
        else:
            out = thd_attention(self.core_attention, q, k, v.contiguous(), docs, self.selective_recompute,
                                self.layouts.current.varlen())
        return self.linear_proj(_sbh(out.reshape(b, s, -1))).transpose(0, 1)

    def _docs(self) -> Tensor | None:
        """Document ids [b, s] of the micro-batch being run (None: one causal sequence per row)."""
        if self.layouts is _UNWRAPPED:
            raise RuntimeError("TE attention run outside TEBackend.wrap: packed-document masks would be lost")
        layout = None if self.layouts is None else self.layouts.current
        docs = None if layout is None else layout.docs
        if docs is not None and self.cp > 1:  # refused before step 1 (train.config); never attended to wrongly
            raise ConfigError(packed_cp_refusal(self.cp))
        return docs


_UNWRAPPED = object()


def thd_attention(core: Callable, q: Tensor, k: Tensor, v: Tensor, docs: Tensor, recompute: bool,
                  pack=None) -> Tensor:
    """Packed-document attention through TE's THD format: q [b, s, H, d], k/v [b, s, G, d], docs [b, s] document ids
    (non-decreasing along a row) -> [b, s, H*dv]. Each (row, document) is one segment of the flattened t = b*s tokens,
    causal inside it (`padding_causal`); cu_seqlens int32 as TE documents them (no padding between segments, so the
    `_padded` variants equal them and are left to TE)."""
    from train.parallel.context import varlen_pack

    b, s = q.shape[:2]
    if tuple(docs.shape) != (b, s):
        raise RuntimeError(f"packed documents: document ids {tuple(docs.shape)} for a micro-batch of {(b, s)} tokens")
    if pack is None:  # self-attention: the key segments are the query segments (the layout's cached pack)
        pack = varlen_pack(docs, docs)
    out = core(q.reshape(b * s, *q.shape[2:]), k.reshape(b * s, *k.shape[2:]), v.reshape(b * s, *v.shape[2:]),
               qkv_format="thd", attn_mask_type="padding_causal", cu_seqlens_q=pack.cu_q, cu_seqlens_kv=pack.cu_k,
               max_seqlen_q=pack.max_q, max_seqlen_kv=pack.max_k, checkpoint_core_attention=recompute)
    return out.reshape(b, s, -1)


class TEMLP(nn.Module):
    """SwiGLU with the post-attention RMSNorm fused into linear_fc1 ([gate; up] per TP shard)."""

    def __init__(self, te, cfg: ModelConfig, par: _Parallel, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        common = dict(tp_group=par.tp_group, tp_size=par.tp_size, sequence_parallel=par.sequence_parallel,
                      params_dtype=dtype, device=device)
        self.linear_fc1 = te.LayerNormLinear(cfg.hidden_size, 2 * cfg.ffn_hidden_size, eps=cfg.norm_epsilon,
                                             bias=cfg.add_mlp_bias, normalization="RMSNorm", parallel_mode="column",
                                             **common)
        self.linear_fc2 = te.Linear(cfg.ffn_hidden_size, cfg.hidden_size, bias=cfg.add_mlp_bias, parallel_mode="row",
                                    **common)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.linear_fc1(_sbh(x)).chunk(2, dim=-1)
        return self.linear_fc2(torch.nn.functional.silu(gate) * up).transpose(0, 1)


class _HighPrecision:
    """A module's forward run with FP8 off (--first-last-layers-bf16); set as the instance's `forward`, so the module,
    its parameters and their names stay as they are."""

    def __init__(self, fn: Callable, off: Callable) -> None:
        self._fn, self._off = fn, off

    def __call__(self, *args):
        with self._off():
            return self._fn(*args)


class _AutocastStep:
    """A StageStep whose forward runs under TE's autocast (one context per micro-batch, as Megatron)."""

    def __init__(self, step, ctx: Callable) -> None:
        self._step, self._ctx = step, ctx

    def __getattr__(self, name: str):
        return getattr(self._step, name)

    def __call__(self, *args, **kwargs):  # kwargs: the model chunk of an interleaved pipeline
        with self._ctx():
            return self._step(*args, **kwargs)


class TEBackend:
    """The TE form of one stage: layers rebuilt, the FP8 recipe and autocast, the scaling state's conversion."""

    def __init__(self, te, model: nn.Module, fp8: FP8Config, recipe, group, keep: set[int]) -> None:
        self.te, self.model, self.fp8cfg, self.recipe, self.group, self.keep = te, model, fp8, recipe, group, keep
        self.autocast = autocast_factory(te, fp8.enabled, recipe, group)
        self.fp8_off = autocast_factory(te, False, None, None)

    @classmethod
    def build(cls, model: nn.Module, cfg: ModelConfig, groups: Groups, fp8: FP8Config, sequence_parallel: bool,
              recompute: str | None, cp_comm_type: str = "p2p") -> TEBackend:
        why_not = unsupported(cfg, fp8, recompute)
        if why_not is not None:
            raise ConfigError(f"--transformer-impl transformer_engine: {why_not}")
        try:
            import transformer_engine.common.recipe as te_recipe
            import transformer_engine.pytorch as te
        except Exception as e:  # a broken install (no GPU driver, ABI mismatch) fails here
            raise ConfigError(f"--transformer-impl transformer_engine: importing Transformer Engine failed "
                              f"({type(e).__name__}: {e}); {INSTALL}") from None
        dims = groups.dims
        cp_group = getattr(groups, "cp", None)
        cp_ranks = ([dims.rank(tp=groups.tp_rank, cp=i, dp=groups.dp_rank, pp=groups.pp_rank) for i in range(dims.cp)]
                    if cp_group is not None else None)
        par = _Parallel(groups.tp, dims.tp, sequence_parallel, cp_group, cp_ranks, cp_comm_type)
        ref = next(model.parameters())
        dtype, device = ref.dtype, ref.device
        keep = bf16_layers(fp8, cfg.num_layers) if fp8.enabled else set()
        recipe, group = None, None
        if fp8.enabled:
            recipe = build_recipe(fp8, te_recipe)
            if dims.world > 1:
                from train.fp8 import amax_reduction_group

                group = amax_reduction_group(dims, groups.pp_rank)
        backend = cls(te, model, fp8, recipe, group, keep)
        local = local_config(cfg, dims.model_parallel)
        for key, layer in model.decoder.layers.items():
            att = TESelfAttention(te, cfg, local, par, dtype, device, recompute == "selective")
            mlp = TEMLP(te, cfg, par, dtype, device)
            layer.self_attention, layer.mlp = att, mlp
            if int(key) in keep:  # FP8 off inside this layer, its names unchanged
                att.forward = _HighPrecision(TESelfAttention.forward.__get__(att), backend.fp8_off)
                mlp.forward = _HighPrecision(TEMLP.forward.__get__(mlp), backend.fp8_off)
        return backend

    def wrap(self, step):
        """The stage's micro-batch step for this backend: every TE attention reads the micro-batch's layout (packed
        documents) from the step's AttentionState; with FP8 each forward runs under te.autocast."""
        layouts = getattr(step, "attention", None)  # context.AttentionState, or None (no packed documents, no CP)
        for layer in self.model.decoder.layers.values():
            if isinstance(layer.self_attention, TESelfAttention):
                layer.self_attention.layouts = layouts
        return _AutocastStep(step, self.autocast) if self.fp8cfg.enabled else step

    def _linears(self):
        for key, layer in self.model.decoder.layers.items():
            if int(key) in self.keep:
                continue
            for part, names in (("self_attention", ("linear_qkv", "linear_proj")),
                                ("mlp", ("linear_fc1", "linear_fc2"))):
                for n in names:
                    yield f"decoder.layers.{key}.{part}.{n}", getattr(getattr(layer, part), n)

    def state_dict(self) -> dict | None:
        return modules_state(self.fp8cfg, self._linears())

    def gather_state(self, groups: Groups) -> dict | None:
        from train.fp8 import gather_state

        return gather_state(self, groups)  # same merge by name over pipeline stages

    def load_state_dict(self, sd: dict, where: str) -> None:
        load_modules_state(self.fp8cfg, self._linears(), sd, where, self.autocast)

    def describe(self) -> str:
        te_version = getattr(self.te, "__version__", "?")
        att = "attention in TE DotProductAttention (thd with cu_seqlens for packed documents)"
        if not self.fp8cfg.enabled:
            return f"backend transformer_engine {te_version} (bf16/fp32); {att}"
        name, _ = recipe_spec(self.fp8cfg)
        return (f"backend transformer_engine {te_version}; FP8 {self.fp8cfg.fp8_format} via {name}"
                + (f"; decoder layers {sorted(self.keep)} in high precision" if self.keep else "") + f"; {att}")
