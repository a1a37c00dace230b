"""FP8 training in plain PyTorch (the local backend): the decoder's linear layers compute their GEMMs on FP8 operands.

Applied from outside, like torchtitan's `convert_to_float8_training`: `Float8Training.convert(model)` replaces every
`nn.Linear` / `NormLinear` of the decoder layers (attention and MLP projections, DeepSeek's shared experts) by an FP8
module that holds the *same* Parameter objects under the same attribute names, so parameter names and shapes stay
canonical and loading/saving through the sharding table is unchanged. The embedding, the output layer, the router and
the stacked expert weights stay in the model dtype (as in Megatron/Transformer Engine).

Formats (`--fp8-format`, alias `--fp8`): `hybrid` = e4m3 for the forward operands (activations, weights) and e5m2
for the gradients; `e4m3` = e4m3 everywhere. Recipes (`--fp8-recipe`):

- `delayed`    one fp32 scale per tensor, taken from an amax history (Transformer Engine's DelayedScaling): each
               step records the amax of every quantized tensor (the max over the step's micro-batches), all-reduces
               them (MAX) over the amax-reduction group, then, as TE's `amax_and_scale_update` kernel,
                   amax  = max(history) (`--fp8-amax-compute-algo max`) or history[0] (`most_recent`)
                   scale = fp8_max * 2^-margin / amax   (kept when amax is 0 or not finite)
                   history = roll(history, -1); history[0] = 0
               TE updates after every micro-batch; here the update is once per optimizer step, so it does not depend
               on the pipeline schedule (identical to TE with one micro-batch per step).
- `tensorwise` one scale per tensor from the tensor itself (current scaling: scale = fp8_max / amax).
- `blockwise`  DeepSeek-V3 / TE Float8BlockScaling: activations and gradients in 1x128 tiles along the contraction
               axis, weights in 128x128 blocks, power-of-2 scales (TE's default); each GEMM operand is quantized from
               the high-precision tensor in the direction its GEMM contracts over (columnwise for the weight gradient).

Forward y = x W^T uses q(x), q(W); dgrad = q(g) q(W); wgrad = q(g)^T q(x) (in high precision with
`--no-fp8-wgrad`). Per-tensor GEMMs run through `torch._scaled_mm` on GPUs that have FP8 tensor cores (SM89+) when the
dimensions are multiples of 16; elsewhere (CPU, blockwise) they are emulated exactly: the FP8 values are multiplied in
fp32 and scaled afterwards (per-tensor), or dequantized with their power-of-2 block scales (exact) and multiplied in
fp32 (blockwise), so the FP8 numerics are the same code on every machine.

Delayed scaling's state (amax histories and scales) is keyed by module name (global layer index) and role
(input / weight / grad_output), so it is independent of the parallel layout; `state_dict` / `load_state_dict` turn it
into JSON-safe data (base64 of little-endian float32, no pickle) that the trainer stores in train_state.json.
"""
from __future__ import annotations

import base64
import os
import warnings
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from checkpoint.errors import ConfigError
from train.model import NormLinear, rms_norm

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}
FORMATS = {"hybrid": (E4M3, E5M2), "e4m3": (E4M3, E4M3)}  # (forward operands, gradients)
RECIPES = ("delayed", "tensorwise", "blockwise")
AMAX_ALGOS = ("max", "most_recent")
ROLES = ("input", "weight", "grad_output")
BLOCK = 128
STATE_VERSION = 1


@dataclass(frozen=True)
class FP8Config:
    """Megatron-LM's FP8 flags (the field names are the flags' dests). fp8_format None: FP8 off."""

    fp8_format: str | None = None  # --fp8-format / --fp8: hybrid | e4m3
    fp8_recipe: str = "delayed"  # --fp8-recipe: delayed | tensorwise | blockwise
    fp8_margin: int = 0
    fp8_amax_history_len: int = 1  # Megatron's defaults (TE's own DelayedScaling defaults are 1024 / max)
    fp8_amax_compute_algo: str = "most_recent"
    fp8_wgrad: bool = True  # --no-fp8-wgrad: weight gradients in high precision
    first_last_layers_bf16: bool = False  # --first-last-layers-bf16 / --fp8-first-last-bf16
    num_layers_at_start_in_bf16: int = 1
    num_layers_at_end_in_bf16: int = 1

    @property
    def enabled(self) -> bool:
        return self.fp8_format is not None


def validate_config(c: FP8Config) -> None:
    """Bad combinations, as one-line ConfigErrors naming the flag (no model or process group needed)."""
    if c.fp8_format is None:
        given = [flag for flag, on in (
            ("--fp8-recipe", c.fp8_recipe != "delayed"), ("--fp8-margin", c.fp8_margin != 0),
            ("--fp8-amax-history-len", c.fp8_amax_history_len != 1),
            ("--fp8-amax-compute-algo", c.fp8_amax_compute_algo != "most_recent"),
            ("--no-fp8-wgrad", not c.fp8_wgrad), ("--first-last-layers-bf16", c.first_last_layers_bf16),
            ("--num-layers-at-start-in-bf16", c.num_layers_at_start_in_bf16 != 1),
            ("--num-layers-at-end-in-bf16", c.num_layers_at_end_in_bf16 != 1)) if on]
        if given:
            raise ConfigError(f"{given[0]} needs FP8: add --fp8-format hybrid|e4m3 (alias --fp8)")
        return
    if not c.first_last_layers_bf16:
        for flag, n in (("--num-layers-at-start-in-bf16", c.num_layers_at_start_in_bf16),
                        ("--num-layers-at-end-in-bf16", c.num_layers_at_end_in_bf16)):
            if n != 1:
                raise ConfigError(f"{flag} {n}: applies with --first-last-layers-bf16 only (without it every decoder "
                                  "layer runs in FP8); add --first-last-layers-bf16 or drop the flag")
    if c.fp8_format not in FORMATS:
        raise ConfigError(f"--fp8-format {c.fp8_format!r}: expected one of {sorted(FORMATS)}")
    if c.fp8_recipe not in RECIPES:
        raise ConfigError(f"--fp8-recipe {c.fp8_recipe!r}: expected one of {list(RECIPES)} (mxfp8 needs Blackwell "
                          "GPUs and Transformer Engine)")
    if c.fp8_amax_compute_algo not in AMAX_ALGOS:
        raise ConfigError(f"--fp8-amax-compute-algo {c.fp8_amax_compute_algo!r}: expected one of {list(AMAX_ALGOS)}")
    if c.fp8_amax_history_len < 1:
        raise ConfigError(f"--fp8-amax-history-len must be >= 1, got {c.fp8_amax_history_len}")
    if c.fp8_recipe != "delayed":
        for flag, on in (("--fp8-amax-history-len", c.fp8_amax_history_len != 1),
                         ("--fp8-amax-compute-algo", c.fp8_amax_compute_algo != "most_recent")):
            if on:
                raise ConfigError(f"{flag} applies to --fp8-recipe delayed only (got --fp8-recipe {c.fp8_recipe})")
    if c.fp8_recipe == "tensorwise" and c.fp8_margin:
        raise ConfigError("--fp8-margin applies to --fp8-recipe delayed only; tensorwise (current) scaling takes each "
                          "tensor's own amax without a margin, in both backends")
    if c.fp8_recipe == "blockwise" and c.fp8_margin:
        raise ConfigError("--fp8-margin applies to per-tensor scaling; --fp8-recipe blockwise uses power-of-2 "
                          "block scales without a margin")
    if c.num_layers_at_start_in_bf16 < 0 or c.num_layers_at_end_in_bf16 < 0:
        raise ConfigError("--num-layers-at-start-in-bf16 / --num-layers-at-end-in-bf16 must be >= 0")


def bf16_layers(c: FP8Config, num_layers: int) -> set[int]:
    """Global indices of the decoder layers kept in high precision (`--first-last-layers-bf16`)."""
    if not c.first_last_layers_bf16:
        return set()
    start, end = c.num_layers_at_start_in_bf16, c.num_layers_at_end_in_bf16
    if start + end >= num_layers:
        raise ConfigError(f"--num-layers-at-start-in-bf16 {start} + --num-layers-at-end-in-bf16 {end} leave none of "
                          f"the model's {num_layers} layers in FP8; lower them or drop --first-last-layers-bf16")
    return set(range(start)) | set(range(num_layers - end, num_layers))


# -- scaling and quantization (pure functions) -------------------------------------------------------------------------

def scale_from_amax(amax: Tensor, dtype: torch.dtype, margin: int = 0, fallback: Tensor | float = 1.0,
                    power_2: bool = False) -> Tensor:
    """fp8_max * 2^-margin / amax in fp32; `fallback` where amax is 0 or not finite (TE keeps the old scale).
    power_2 rounds the scale down to a power of two (TE's block-scaling default), which makes dequantization exact."""
    amax = amax.float()
    scale = (FP8_MAX[dtype] * 2.0 ** -margin) / amax
    if power_2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    ok = torch.isfinite(amax) & (amax > 0) & torch.isfinite(scale)
    return torch.where(ok, scale, torch.as_tensor(fallback, dtype=torch.float32, device=amax.device))


def quantize(x: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """Saturating cast: x * scale clipped to the format's range, rounded to nearest by torch's cast."""
    m = FP8_MAX[dtype]
    return (x.float() * scale).clamp_(-m, m).to(dtype)


def amax_and_quantize(x: Tensor, scale: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Delayed scaling's one pass: the tensor's amax (recorded for later steps) and its cast with the given scale."""
    return quantize(x, scale, dtype), x.detach().abs().amax().float()


def current_quantize(x: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Current scaling: (FP8 data, scale) with the scale from this tensor's own amax."""
    scale = scale_from_amax(x.detach().abs().amax(), dtype)
    return quantize(x, scale, dtype), scale


_COMPILED: dict[str, object] = {}


def _on_device(name: str, fn):
    """`fn` for CUDA tensors compiled by torch.compile, so the amax, scaling, clipping and cast run as fused kernels
    (eager they are five passes over the tensor, which eat the FP8 GEMM's gain). The first failure (no Triton, an
    unsupported torch) switches back to eager for good, with a warning. SHARDKIT_FP8_COMPILE=0 turns it off."""
    def run(x: Tensor, *args):
        if not x.is_cuda or os.environ.get("SHARDKIT_FP8_COMPILE", "1") == "0" or _COMPILED.get(name) is False:
            return fn(x, *args)
        compiled = _COMPILED.get(name)
        if compiled is None:
            compiled = _COMPILED[name] = torch.compile(fn, dynamic=True)
        try:
            return compiled(x, *args)
        except Exception as e:  # noqa: BLE001 - any compile failure falls back to the same math, eager
            warnings.warn(f"FP8 quantization: torch.compile failed ({type(e).__name__}: {e}); running eager",
                          stacklevel=2)
            _COMPILED[name] = False
            return fn(x, *args)

    return run


_amax_and_quantize = _on_device("amax_and_quantize", amax_and_quantize)
_current_quantize = _on_device("current_quantize", current_quantize)


def dequantize(q: Tensor, scale_inv: Tensor) -> Tensor:
    return q.float() * scale_inv


def _pad_to(x: Tensor, rows: int, cols: int) -> Tensor:
    r, c = x.shape
    return F.pad(x, (0, (-c) % cols, 0, (-r) % rows))


def block_amax(x: Tensor, rows: int, cols: int) -> Tensor:
    """amax of each rows x cols block of a 2-D tensor (partial blocks at the edges) -> [ceil(R/rows), ceil(C/cols)]."""
    p = _pad_to(x.float().abs(), rows, cols)
    return p.view(p.shape[0] // rows, rows, p.shape[1] // cols, cols).amax(dim=(1, 3))


def expand_blocks(s: Tensor, rows: int, cols: int, shape: tuple[int, int]) -> Tensor:
    """Block values -> one per element of a tensor of `shape` (the inverse of the block grid)."""
    return s.repeat_interleave(rows, 0).repeat_interleave(cols, 1)[: shape[0], : shape[1]]


def quantize_blocks(x: Tensor, rows: int, cols: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Block-scaled FP8: (data of x's shape, scale_inv per block). Power-of-2 scales, so dequantization is exact."""
    scale = scale_from_amax(block_amax(x, rows, cols), dtype, power_2=True)
    q = quantize(x, expand_blocks(scale, rows, cols, tuple(x.shape)), dtype)
    return q, 1.0 / scale


def dequantize_blocks(q: Tensor, scale_inv: Tensor, rows: int, cols: int) -> Tensor:
    return q.float() * expand_blocks(scale_inv, rows, cols, tuple(q.shape))


def _scaled_mm_ok(a: Tensor, b: Tensor) -> bool:
    """torch._scaled_mm: CUDA with FP8 tensor cores (SM89+), every dimension a multiple of 16, not e5m2 x e5m2."""
    if not a.is_cuda or torch.cuda.get_device_capability(a.device) < (8, 9):
        return False
    if a.dtype == E5M2 and b.dtype == E5M2:
        return False
    return a.shape[0] % 16 == 0 and a.shape[1] % 16 == 0 and b.shape[0] % 16 == 0


def fp8_mm(a: Tensor, a_scale_inv: Tensor, b: Tensor, b_scale_inv: Tensor, out_dtype: torch.dtype,
           scaled_mm: bool | None = None) -> Tensor:
    """(a * a_scale_inv) @ (b * b_scale_inv)^T for per-tensor scaled FP8 a [M, K], b [N, K] (both row-major).
    On the GPU one `torch._scaled_mm`; elsewhere the FP8 values multiplied in fp32 (products of FP8 values are exact)
    and scaled afterwards, which is what the scaled GEMM computes. `scaled_mm` forces either path (tests run the
    GPU path's call on a CPU build that has `_scaled_mm`)."""
    if _scaled_mm_ok(a, b) if scaled_mm is None else scaled_mm:
        return torch._scaled_mm(a.contiguous(), b.contiguous().t(), scale_a=a_scale_inv.reshape(()).float(),
                                scale_b=b_scale_inv.reshape(()).float(), out_dtype=out_dtype)
    return ((a.float() @ b.float().t()) * (a_scale_inv * b_scale_inv)).to(out_dtype)


# -- delayed scaling state -------------------------------------------------------------------------------------------

class DelayedScalingState:
    """amax histories [H, N] and scales [N] of N quantized tensors (TE's `fp8_meta` of a whole model, one buffer),
    plus the amax seen in the current step. `names[i]` = '<module>.<role>'."""

    def __init__(self, names: list[str], dtypes: list[torch.dtype], history_len: int, algo: str, margin: int,
                 device: torch.device) -> None:
        n = len(names)
        self.names = names
        self.dtypes = dtypes
        self.algo, self.margin = algo, margin
        self.amax_history = torch.zeros(history_len, n, dtype=torch.float32, device=device)
        self.scale = torch.ones(n, dtype=torch.float32, device=device)
        self.step_amax = torch.zeros(n, dtype=torch.float32, device=device)
        self.fp8_max = torch.tensor([FP8_MAX[d] for d in dtypes], dtype=torch.float32, device=device)

    def record(self, slot: int, amax: Tensor) -> None:
        self.step_amax[slot] = torch.maximum(self.step_amax[slot], amax.float())

    @torch.no_grad()
    def update(self, group=None) -> None:
        """End of a step: reduce this step's amaxes (MAX over `group`), then TE's amax_and_scale_update."""
        amax = self.step_amax
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
        self.amax_history[0] = amax
        self.scale.copy_(delayed_scale(self.amax_history, self.scale, self.fp8_max, self.algo, self.margin))
        self.amax_history.copy_(roll_history(self.amax_history))
        self.step_amax.zero_()

    # -- checkpoint form ----------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """JSON-safe: per tensor name, its amax history and scale as base64 of little-endian float32."""
        hist = self.amax_history.detach().cpu().numpy().astype("<f4")
        scale = self.scale.detach().cpu().numpy().astype("<f4")
        return {n: {"amax_history": _b64(hist[:, i]), "scale": _b64(scale[i: i + 1])}
                for i, n in enumerate(self.names)}

    @torch.no_grad()
    def load_state_dict(self, tensors: dict, where: str) -> None:
        """Strict: every tensor of this model must be present with the same history length."""
        h = self.amax_history.shape[0]
        for i, n in enumerate(self.names):
            if n not in tensors:
                raise ConfigError(f"{where}: no FP8 delayed-scaling state for {n} (the checkpoint was trained with "
                                  "other FP8 layers); train with the same --fp8 / --first-last-layers-bf16 flags")
            hist, scale = _unb64(tensors[n]["amax_history"]), _unb64(tensors[n]["scale"])
            if hist.shape != (h,) or scale.shape != (1,):
                raise ConfigError(f"{where}: {n} has an amax history of {hist.shape[0]} steps, this run "
                                  f"--fp8-amax-history-len {h}; use the checkpoint's length")
            self.amax_history[:, i] = torch.from_numpy(hist.copy()).to(self.amax_history.device)
            self.scale[i] = float(scale[0])


def delayed_scale(history: Tensor, scale: Tensor, fp8_max: Tensor, algo: str, margin: int) -> Tensor:
    """TE's DelayedScaling update: amax from the history (max over it, or its slot 0 = the newest), then
    fp8_max * 2^-margin / amax, keeping the old scale where amax is 0 or not finite."""
    amax = history.amax(dim=0) if algo == "max" else history[0]
    new = (fp8_max * 2.0 ** -margin) / amax
    ok = torch.isfinite(amax) & (amax > 0)
    return torch.where(ok, new, scale)


def roll_history(history: Tensor) -> Tensor:
    """Slot 0 (this step's amax) moves to the end, the oldest entry is dropped, slot 0 is cleared for the next."""
    out = torch.roll(history, -1, dims=0)
    out[0] = 0
    return out


def _b64(a: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(a, dtype="<f4").tobytes()).decode()


def _unb64(s: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(s), dtype="<f4")


# -- the FP8 linear ------------------------------------------------------------------------------------------------

@dataclass
class Quantizer:
    """What one FP8 linear needs: the recipe, its three tensors' slots in the delayed-scaling state."""

    recipe: str
    fwd_dtype: torch.dtype
    bwd_dtype: torch.dtype
    wgrad: bool
    state: DelayedScalingState | None = None
    slot: int = 0  # input = slot, weight = slot + 1, grad_output = slot + 2
    scaled_mm: bool | None = None  # None: torch._scaled_mm where the GPU has FP8 tensor cores (see fp8_mm)

    def per_tensor(self, x: Tensor, role: int, dtype: torch.dtype, record: bool) -> tuple[Tensor, Tensor]:
        """(FP8 data, scale_inv) with one scale: the delayed one from the state, or the tensor's own."""
        if self.state is not None:
            scale = self.state.scale[self.slot + role].clone()  # own storage: one compiled kernel for all slots
            q, amax = _amax_and_quantize(x, scale, dtype)
            if record:
                self.state.record(self.slot + role, amax)
        else:
            q, scale = _current_quantize(x, dtype)
        return q, (1.0 / scale).reshape(())


class _FP8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, q: Quantizer, record: bool) -> Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        out_dtype = x.dtype
        if q.recipe == "blockwise":
            xq, xs = quantize_blocks(x2, 1, BLOCK, q.fwd_dtype)
            wq, ws = quantize_blocks(weight, BLOCK, BLOCK, q.fwd_dtype)
            y = (dequantize_blocks(xq, xs, 1, BLOCK) @ dequantize_blocks(wq, ws, BLOCK, BLOCK).t()).to(out_dtype)
            # the weight gradient contracts over tokens: x quantized in 128x1 tiles, from high precision
            saved_x = quantize_blocks(x2, BLOCK, 1, q.fwd_dtype) if q.wgrad else (x2, None)
        else:
            xq, xs = q.per_tensor(x2, 0, q.fwd_dtype, record)
            wq, ws = q.per_tensor(weight, 1, q.fwd_dtype, record)
            y = fp8_mm(xq, xs, wq, ws, out_dtype, q.scaled_mm)
            saved_x = (xq, xs) if q.wgrad else (x2, None)
        if bias is not None:
            y = y + bias
        ctx.q, ctx.record, ctx.shape, ctx.has_bias = q, record, shape, bias is not None
        ctx.x_dtype, ctx.w_dtype = x.dtype, weight.dtype
        ctx.save_for_backward(saved_x[0], saved_x[1], wq, ws)
        return y.view(*shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad: Tensor):
        q: Quantizer = ctx.q
        xs_data, xs_scale, wq, ws = ctx.saved_tensors
        g2 = grad.reshape(-1, grad.shape[-1])
        if q.recipe == "blockwise":
            gq, gs = quantize_blocks(g2, 1, BLOCK, q.bwd_dtype)
            w = dequantize_blocks(wq, ws, BLOCK, BLOCK)
            dx = (dequantize_blocks(gq, gs, 1, BLOCK) @ w).to(ctx.x_dtype)
            if q.wgrad:
                gc, gcs = quantize_blocks(g2, BLOCK, 1, q.bwd_dtype)
                dw = dequantize_blocks(gc, gcs, BLOCK, 1).t() @ dequantize_blocks(xs_data, xs_scale, BLOCK, 1)
            else:
                dw = g2.float().t() @ xs_data.float()
        else:
            gq, gs = q.per_tensor(g2, 2, q.bwd_dtype, ctx.record)
            dx = fp8_mm(gq, gs, wq.t().contiguous(), ws, ctx.x_dtype, q.scaled_mm)
            if q.wgrad:
                dw = fp8_mm(gq.t().contiguous(), gs, xs_data.t().contiguous(), xs_scale, torch.float32, q.scaled_mm)
            else:
                dw = g2.float().t() @ xs_data.float()
        db = g2.float().sum(0).to(ctx.w_dtype) if ctx.has_bias else None
        return dx.view(ctx.shape), dw.to(ctx.w_dtype), db, None, None


def fp8_linear(x: Tensor, weight: Tensor, bias: Tensor | None, q: Quantizer) -> Tensor:
    """F.linear with FP8 GEMMs. Amaxes are recorded only when gradients are on (evaluation leaves the state alone)."""
    return _FP8Linear.apply(x, weight, bias, q, torch.is_grad_enabled())


class FP8Linear(nn.Linear):
    """nn.Linear with FP8 GEMMs. `convert` turns a module into one in place (its class is swapped), so the
    parameters, their names and any hooks tensor parallelism put on it stay as they were."""

    fp8: Quantizer

    def forward(self, x: Tensor) -> Tensor:
        return fp8_linear(x, self.weight, self.bias, self.fp8)


class FP8NormLinear(NormLinear):
    """NormLinear (RMSNorm fused into the linear, `layer_norm_weight`) with FP8 GEMMs; the norm stays in high
    precision and tensor parallelism's `parallel_input` still sits between the two."""

    fp8: Quantizer

    def forward(self, x: Tensor) -> Tensor:
        x = self.parallel_input(rms_norm(x, self.layer_norm_weight, self.eps))
        return fp8_linear(x, self.weight, self.bias, self.fp8)


_FP8_CLASS = {nn.Linear: FP8Linear, NormLinear: FP8NormLinear}


# -- applying it to a model ------------------------------------------------------------------------------------------

def amax_reduction_group(dims, pp_rank: int):
    """Megatron/TE's amax reduction group: every rank of this pipeline stage (TP x CP x DP), so that sharded and
    data-parallel copies of a tensor share one scale. Created on every rank (torch.distributed requires it), in
    the same order (groups.new_group records it, check_group_order proves it)."""
    from train.parallel.groups import check_group_order, new_group

    mine = None
    for pp in range(dims.pp):
        ranks = [dims.rank(tp, cp, dp, pp) for dp in range(dims.dp) for cp in range(dims.cp) for tp in range(dims.tp)]
        grp = new_group(sorted(ranks)) if len(ranks) > 1 else None
        if pp == pp_rank:
            mine = grp
    check_group_order()
    return mine


class Float8Training:
    """The FP8 conversion of one model (stage) and its delayed-scaling state. `convert` the materialised model (before
    or after tensor parallelism hooked onto it), then call `step()` after each optimizer step's backward passes."""

    def __init__(self, cfg: FP8Config, num_layers: int, amax_group=None) -> None:
        validate_config(cfg)
        if not cfg.enabled:
            raise ValueError("Float8Training needs fp8_format")
        self.cfg = cfg
        self.keep = bf16_layers(cfg, num_layers)
        self.amax_group = amax_group
        self.fwd_dtype, self.bwd_dtype = FORMATS[cfg.fp8_format]
        self.state: DelayedScalingState | None = None
        self.converted: list[str] = []

    def _quantizer(self) -> Quantizer:
        return Quantizer(self.cfg.fp8_recipe, self.fwd_dtype, self.bwd_dtype, self.cfg.fp8_wgrad)

    def convert(self, model: nn.Module) -> None:
        """Swap the linears of the decoder layers not kept in bf16 for FP8 modules (same parameters, same names)."""
        layers = model.decoder.layers
        quantizers: list[Quantizer] = []
        names: list[str] = []
        for key, layer in layers.items():
            if int(key) in self.keep:
                continue
            for name, mod in list(layer.named_modules()):
                cls = _FP8_CLASS.get(type(mod))
                if cls is None:
                    continue
                q = self._quantizer()
                mod.__class__ = cls  # same object: parameters, names and hooks unchanged
                mod.fp8 = q
                full = f"decoder.layers.{key}.{name}"
                q.slot = 3 * len(quantizers)
                quantizers.append(q)
                names += [f"{full}.{role}" for role in ROLES]
                self.converted.append(full)
        if self.cfg.fp8_recipe == "delayed" and quantizers:
            device = next(model.parameters()).device
            dtypes = [self.fwd_dtype, self.fwd_dtype, self.bwd_dtype] * len(quantizers)
            self.state = DelayedScalingState(names, dtypes, self.cfg.fp8_amax_history_len,
                                             self.cfg.fp8_amax_compute_algo, self.cfg.fp8_margin, device)
            for q in quantizers:
                q.state = self.state

    def step(self) -> None:
        """After the step's forward/backward passes (delayed scaling: reduce amaxes, update scales)."""
        if self.state is not None:
            self.state.update(self.amax_group)

    def describe(self) -> str:
        kept = sorted(self.keep)
        return (f"FP8 {self.cfg.fp8_format} ({self.cfg.fp8_recipe} scaling) on {len(self.converted)} linear layers"
                + (f"; decoder layers {kept} in high precision" if kept else ""))

    # -- checkpoint -------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict | None:
        if self.state is None:
            return None
        return {"version": STATE_VERSION, "recipe": self.cfg.fp8_recipe, "format": self.cfg.fp8_format,
                "amax_history_len": self.cfg.fp8_amax_history_len, "tensors": self.state.state_dict()}

    def load_state_dict(self, sd: dict, where: str) -> None:
        if self.state is None:
            return
        if sd.get("version") != STATE_VERSION:
            raise ConfigError(f"{where}: FP8 state version {sd.get('version')!r}, this shardkit reads "
                              f"{STATE_VERSION}")
        self.state.load_state_dict(sd["tensors"], where)


def gather_state(fp8: Float8Training, groups, every_rank: bool = False) -> dict | None:
    """The delayed-scaling state of the whole model on every rank: each pipeline stage holds its own layers' (equal
    on all of the stage's ranks after the amax reduction), merged by name; `every_rank`: each rank's own modules
    (expert parallelism: each expert-parallel rank holds other experts)."""
    sd = fp8.state_dict()
    if not (dist.is_initialized() and (groups.dims.pp > 1 or every_rank)):
        return sd
    parts: list = [None] * dist.get_world_size()  # every rank takes part (a stage may have no FP8 layers)
    first = (groups.tp_rank, groups.cp_rank, groups.dp_rank) == (0, 0, 0)
    dist.all_gather_object(parts, sd if first or every_rank else None)
    parts = [p for p in parts if p is not None]
    if not parts:
        return None
    tensors: dict = {}
    for p in parts:
        tensors.update(p["tensors"])
    return dict(parts[0], tensors=tensors)


__all__ = [
    "DelayedScalingState",
    "FP8Config",
    "Float8Training",
    "amax_reduction_group",
    "bf16_layers",
    "block_amax",
    "delayed_scale",
    "dequantize",
    "dequantize_blocks",
    "fp8_linear",
    "fp8_mm",
    "gather_state",
    "quantize",
    "quantize_blocks",
    "roll_history",
    "scale_from_amax",
    "validate_config",
]
