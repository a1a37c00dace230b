"""Step time and MFU from a simple, stated compute/communication model.

Compute: model FLOPs per token = 6 x (GEMM parameters active per token, output layer included) plus causal attention
3 x s x heads x (d_qk + d_v) per layer (Megatron's convention: causal-halved; torchtitan's does not halve), spread
evenly over all GPUs, run at `compute_efficiency` x peak (FP8 doubles the peak of the GEMMs, not of attention).
Recompute adds its forward passes: core attention (selective) or the whole layer forward (full).

GEMM efficiency follows the rows of a micro-batch's GEMMs, M = micro batch x sequence / cp tokens (sequence
parallelism gathers the full sequence of the CP rank before each column-parallel GEMM): M / (M + 384) of the large-GEMM
rate (H100 BF16 cuBLAS at h = 8192 runs ~57% of its 16k-row rate at 512 rows, ~76% at 1024, ~91% at 4096),
normalised to the reference micro-batch of 4096 tokens that `compute_efficiency` is calibrated on (Megatron-Core's
published MFU: seq 4096, micro batch 1). So micro batch 4 or 8 runs its GEMMs a few percent faster than 1, and CP 8 at
seq 4096 (512 tokens per rank) much slower. Each micro-batch also costs a fixed `LAYER_OVERHEAD_S` per layer forward
and backward (kernel launches, the schedule's bookkeeping), which fewer, larger micro-batches pay less often.

Pipeline: compute x (1 + (pp - 1) / (vpp x m)), the 1F1B/interleaved bubble: larger micro-batches mean fewer of them
(m = global batch / (micro batch x dp)) and a larger bubble, the other side of the trade.

Communication, per micro-batch, ring algorithms at the bandwidth of the link the group spans (NVLink when every
member sits in one node under Megatron's rank order tp-cp-ep-dp-pp, else the network, per GPU):
- TP with sequence parallelism: 4 all-gathers/reduce-scatters per layer forward, 4 backward (+4 under full
  recompute), of (tp - 1)/tp x the layer input; on the critical path.
- CP (ring attention): (cp - 1) K/V blocks forward, twice that backward; overlapped with the attention compute, only
  the excess counts; attention under CP runs at 90% (published zigzag ring-attention figure).
- EP: an all-to-all dispatch and combine per MoE layer, forward and backward, of (ep - 1)/ep x the routed tokens.
- PP: one activation and one gradient per model chunk and micro-batch; not overlapped.
- DP (and CP) gradients, by engine (issue 40). megatron-core: reduce-scatter (distributed optimizer) or all-reduce,
  and the parameter all-gather; with --overlap-grad-reduce the reduce-scatter runs during the last micro-batch's
  backward, with --overlap-param-gather the all-gather during the first one's forward, only the excess counting;
  without them both wait. native: one all-reduce of the whole fp32 gradient buffer after the backward and the
  owners' broadcast of the new weights (an all-gather's volume), neither overlapped.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from checkpoint.config import ModelConfig
from checkpoint.layout import Layout
from checkpoint.megatron import DENSE_ORDER, EXPERT_ORDER, span
from checkpoint.run_layout import RunLayout
from checkpoint.sharding import Rule
from checkpoint.families import model_specs

from .memory import DTYPE_BYTES, TrainSettings, param_bytes_per_rank, stage_layers, total_params


CP_ATTENTION_EFFICIENCY = 0.9
GEMM_HALF_ROWS = 384  # GEMM rows at which the rate is half the large-GEMM rate (M / (M + 384))
REFERENCE_ROWS = 4096  # the micro-batch `compute_efficiency` is calibrated on (seq 4096, micro batch 1, cp 1)
LAYER_OVERHEAD_S = 60e-6  # per decoder layer and micro-batch, forward + backward: launches, schedule bookkeeping


def gemm_efficiency(rows: int) -> float:
    """The GEMM rate at `rows` rows relative to the reference micro-batch's (1.0 at 4096 rows)."""
    def g(m: float) -> float:
        return m / (m + GEMM_HALF_ROWS)
    return g(max(1, rows)) / g(REFERENCE_ROWS)


@dataclass(frozen=True)
class Hardware:
    """Defaults: H100/H200 SXM, 8 GPUs per node on NVLink 4, one 400 Gb/s NIC per GPU."""

    peak_tflops: float = 989.0  # dense BF16; FP8 is 2x
    nvlink_gbps: float = 450.0  # GB/s per GPU per direction inside a node
    network_gbps: float = 50.0  # GB/s per GPU across nodes (400 Gb/s)
    # fraction of peak the GEMM/attention kernels reach; 0.52 puts the model on Megatron-Core's published H100 BF16
    # figures (7B TP2: 47% MFU, 70B TP8 PP2: 42%; see tests/test_plan.py)
    compute_efficiency: float = 0.52
    gpus_per_node: int = 8

    def to_dict(self) -> dict:
        return asdict(self)


_CACHE: dict[tuple, dict] = {}


def flops_per_token(cfg: ModelConfig, seq_length: int, padded_vocab: int) -> dict[str, float]:
    key = (repr(cfg), seq_length, padded_vocab)
    if key not in _CACHE:
        _CACHE[key] = _flops_per_token(cfg, seq_length, padded_vocab)
    return _CACHE[key]


def _flops_per_token(cfg: ModelConfig, seq_length: int, padded_vocab: int) -> dict[str, float]:
    """Training FLOPs per token (forward + backward), Megatron's convention: GEMMs 6 x active GEMM parameters
    (norm weights, router biases and the embedding lookup are not GEMMs), attention causal-halved."""
    p = total_params(cfg)
    h = cfg.hidden_size
    norms = _norm_params(cfg)
    embed = cfg.vocab_size * h  # the lookup; the output layer is a GEMM (tied or not)
    # a tied matrix is counted once: as the output GEMM (its lookup is free); the output GEMM runs on the padded vocab
    gemm = p["active"] - norms - (0 if cfg.tie_word_embeddings else embed) + (padded_vocab - cfg.vocab_size) * h
    if cfg.multi_latent_attention:
        d = cfg.q_head_dim + cfg.v_head_dim
    else:
        d = 2 * cfg.kv_channels
    layers = cfg.num_layers + cfg.mtp_num_layers
    attn = 3 * seq_length * cfg.num_attention_heads * d * layers
    return {"gemm": 6.0 * gemm, "attention": float(attn), "layer_forward": 2.0 * (gemm - padded_vocab * h),
            "attention_forward": attn / 3.0}


def _norm_params(cfg: ModelConfig) -> int:
    """Non-GEMM elementwise parameters (RMSNorm weights, expert biases)."""
    n = 0
    for spec in model_specs(cfg, Layout()):
        if spec.rule is Rule.REPLICATED and len(spec.shape) - spec.lead == 1:
            n += math.prod(spec.shape)
    return n


def _bandwidth(span: int, hw: Hardware) -> float:
    return (hw.nvlink_gbps if span <= hw.gpus_per_node else hw.network_gbps) * 1e9


def _ring(volume: float, n: int, span: int, hw: Hardware) -> float:
    """Seconds for a ring all-gather or reduce-scatter of `volume` bytes (the full buffer) over n ranks."""
    return 0.0 if n <= 1 else volume * (n - 1) / n / _bandwidth(span, hw)


def step_time(cfg: ModelConfig, layout: RunLayout, s: TrainSettings, hw: Hardware) -> dict:
    """Seconds per optimizer step by component, tokens/s per GPU and MFU (Megatron's FLOP convention)."""
    tp, pp, v, cp, dp = layout.tp, layout.pp, layout.vpp, layout.cp, layout.dp
    m = s.microbatches(dp)
    tokens_step = m * dp * s.micro_batch_size * s.seq_length
    f = flops_per_token(cfg, s.seq_length, cfg.padded_vocab_size(tp))
    model_flops = (f["gemm"] + f["attention"]) * tokens_step
    rows = s.micro_batch_size * s.seq_length // cp  # the rows of a micro-batch's GEMMs on one rank
    gemm_eff = min(1.0, hw.compute_efficiency * gemm_efficiency(rows))
    gemm_peak = hw.peak_tflops * 1e12 * gemm_eff * (2 if s.fp8 else 1)
    # zigzag ring attention reaches ~90% of ideal fwd+bwd (ring-flash-attention README, 8xH800)
    attn_peak = hw.peak_tflops * 1e12 * hw.compute_efficiency * (CP_ATTENTION_EFFICIENCY if cp > 1 else 1.0)
    gemm_flops = f["gemm"] + (f["layer_forward"] if s.recompute == "full" else 0.0)
    attn_flops = f["attention"] + (f["attention_forward"] if s.recompute != "none" else 0.0)
    world = layout.world
    compute = tokens_step * (gemm_flops / gemm_peak + attn_flops / attn_peak) / world
    bubble = compute * (pp - 1) / (v * m)

    # how many consecutive ranks each group spans under Megatron's rank order (checkpoint.megatron)
    sizes, expert_sizes = layout.sizes, layout.expert_sizes
    T = s.seq_length // cp * s.micro_batch_size  # tokens per rank per micro-batch (before the TP split)
    h = cfg.hidden_size
    a = DTYPE_BYTES[s.params_dtype]
    layers_rank = max(len(x) for x in stage_layers(cfg.num_layers, pp, v, layout.split))
    passes = 12 if s.recompute == "full" else 8
    t_tp = m * layers_rank * passes * _ring(a * T * h, tp, span("tp", sizes, DENSE_ORDER), hw)
    # CP: K and V of this rank's tokens go round the ring; dK, dV come back in the backward
    if cfg.multi_latent_attention:
        kv_width = cfg.num_attention_heads * (cfg.q_head_dim + cfg.v_head_dim)
    else:
        kv_width = 2 * cfg.num_query_groups * cfg.kv_channels
    t_cp = 0.0
    if cp > 1:
        per_layer = 3 * (cp - 1) * a * T * kv_width / tp / _bandwidth(span("cp", sizes, DENSE_ORDER), hw)
        attn_layer = T * f["attention"] / (cfg.num_layers + cfg.mtp_num_layers) / (tp * attn_peak)
        t_cp = m * layers_rank * max(0.0, per_layer - attn_layer)
    t_ep = 0.0
    if cfg.is_moe and layout.ep > 1:
        moe_layers = max(sum(map(cfg.is_moe_layer, st)) for st in stage_layers(cfg.num_layers, pp, v, layout.split))
        vol = a * h * cfg.moe_router_topk * T * layout.expert_tp / tp
        t_ep = (m * moe_layers * 4 * vol * (layout.ep - 1) / layout.ep
                / _bandwidth(span("ep", expert_sizes, EXPERT_ORDER), hw))
    t_pp = 0.0
    if pp > 1:
        t_pp = 2 * m * v * a * T * h / tp / _bandwidth(span("pp", sizes, DENSE_ORDER), hw)
    # DP: gradients out, parameters back (distributed optimizer); all-reduce = both directions of grads
    p = param_bytes_per_rank(cfg, layout, dtype=s.params_dtype, grad_dtype=s.grad_dtype)
    g, w = DTYPE_BYTES[s.grad_dtype], DTYPE_BYTES[s.params_dtype]
    dp_span = span("dp", sizes, DENSE_ORDER)
    t_dp_grads = (_ring(p["dense_params"] * g, dp * cp, dp_span, hw) + _ring(p["expert_params"] * g, layout.edp,
                                                                             dp_span, hw))
    native = s.engine == "native"
    if native:  # all-reduce (both directions), then the owners' broadcast over DP (CP ranks own nothing)
        t_dp_grads *= 2
        t_dp_params = (_ring(p["dense_params"] * w, dp, dp_span, hw)
                       + _ring(p["expert_params"] * w, layout.edp, dp_span, hw))
    elif s.distributed_optimizer:
        t_dp_params = (_ring(p["dense_params"] * w, dp * cp, dp_span, hw)
                       + _ring(p["expert_params"] * w, layout.edp, dp_span, hw))
    else:
        t_dp_grads, t_dp_params = 2 * t_dp_grads, 0.0
    per_mb = compute / m
    hide_grads = per_mb * 2 / 3 if s.overlap_grad_reduce and not native else 0.0
    hide_params = per_mb / 3 if s.overlap_param_gather and not native else 0.0
    t_dp = max(0.0, t_dp_grads - hide_grads) + max(0.0, t_dp_params - hide_params)
    overhead = m * layers_rank * LAYER_OVERHEAD_S  # every micro-batch through every layer of the busiest rank
    total = compute + bubble + t_tp + t_cp + t_ep + t_pp + t_dp + overhead
    mfu = model_flops / (total * world * hw.peak_tflops * 1e12)
    return {"step_s": total, "compute_s": compute, "bubble_s": bubble, "tp_comm_s": t_tp, "cp_comm_s": t_cp,
            "ep_comm_s": t_ep, "pp_comm_s": t_pp, "dp_comm_s": t_dp, "overhead_s": overhead,
            "gemm_efficiency": gemm_eff, "microbatches": m, "tokens_per_step": tokens_step,
            "tokens_per_s_per_gpu": tokens_step / total / world, "model_flops_per_step": model_flops, "mfu": mfu}
