"""Per-GPU memory of a training run at a parallel layout: weights, gradients, optimizer state, activations,
communication buffers. Every number is a formula over the model config; the assumptions are written next to it.

Parameters come from the one sharding table (``checkpoint.sharding``): a rank holds exactly the local shards the
table gives it, so the estimate is the trainer's byte count, not an approximation of it.

Activations follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", Table 2)
term by term, written for the modern layer instead of GPT-3's: RMSNorm inputs, linear inputs, the core-attention
inputs Q, K, V (whatever their widths: GQA, MLA), SwiGLU's fc1 output and fc2 input, no dropout masks (none of these
models has dropout), flash attention (no s^2 score matrix; one fp32 log-sum-exp per head and token) unless
``flash_attention=False``. With sequence parallelism (always on when tp > 1, as in Megatron) every term is divided by
tp. The paper's 34*s*b*h for GPT-3's layer is the same list: 4sbh of LayerNorm inputs, 2sbh QKV input, 6sbh Q/K/V,
2sbh projection input, 2sbh MLP input, 16sbh GeLU input and output, 2sbh of dropout masks (here: no dropout, SwiGLU's
[gate; up] and output, GQA's narrower K/V).

``kernels="eager"`` (TrainSettings) counts what plain PyTorch autograd keeps instead, as shardkit's own trainer does on
CPU: equal to the bytes measured with saved_tensors_hooks (tests/test_plan.py), ~1.3x the fused list.

The engine and its layer spec (issue 40; ``engine``: continue-pretrain's --engine, ``transformer_impl``: its
--transformer-impl). `shardkit plan` models the layer its launch command will run (``kernels=None``: the spec's list)
and pins that spec on the command. On a GPU with Transformer Engine, the cluster plan models, both engines build TE's
layer spec by default (train/te.py resolve_impl), and its layer keeps the fused list (``kernels="fused"``, Korthikanti
et al.'s: what TE's spec and flash attention keep, Megatron-LM with TE), on either engine: extrapolated, not measured
here (no TE on this machine). Where the engine does not build TE's spec for the model or run (plan.search.layer_spec:
on megatron-core multi-latent attention with rms_norm_eps other than 1e-6; on native MoE, multi-latent attention,
sliding windows, QK norm, FP8 with full recompute) the default is the local spec, as with --transformer-impl local,
and its layer keeps the engine's own list:
- ``megatron-core``: its local spec, ``kernels="local"``: torch.nn.RMSNorm keeps its input and the normalised value in
  fp32 (8h + 4 per norm), the unfused DotProductAttention keeps Q, K and V expanded to every query head and the fp32
  softmax with its bf16 copy (6as, the s^2 term), RoPE's cos/sin are made per layer (8d per token, not split over
  TP), the GLU keeps silu(gate) and a copy of `up` besides [gate; up] and the product (10F); selective recompute keeps
  the fused QKV output (K and V are views of it), Q and K after RoPE instead of the expanded Q/K/V and the softmax.
  Measured by scripts/bench_activations.py with saved-tensor hooks (exactly, at a tiny width; tests/test_plan.py);
  under context parallelism its core attention on a GPU is TE's TEDotProductAttention, whose Q, K, V and log-sum-exp
  the fused list counts (extrapolated, not measured). Its FP8 runs on TE's spec only. Its distributed optimizer splits
  the Adam state as one flat buffer over DP x CP; --overlap-grad-reduce / --overlap-param-gather overlap the DP
  traffic with the last micro-batch's backward / the first one's forward, in place in its contiguous param and grad
  buffers (no extra buffer; each bucket is padded to a multiple of lcm(DP, 128) elements, < 1 MiB).
- ``native``: its local backend, ``kernels="eager"`` (measured: above); its optimizer gives whole parameters to DP
  ranks (greedy by size, over DP only: CP ranks each hold the state of what their DP rank owns), the heaviest rank is
  counted; its gradients are all-reduced in one piece after the backward and the owners broadcast the new weights,
  not overlapped.
MoE and multi-latent attention layers in the eager and local lists are the fused list with the engine's norm and GLU
kept as in the dense layer: extrapolated, not measured.

Recompute (Megatron's --recompute-granularity): ``selective`` recomputes the core attention, dropping its s^2 or
log-sum-exp term; ``full`` keeps only each layer's input (2 bytes per token and hidden unit) plus one layer's full
activations while it is recomputed.

Pipeline: stage r holds the activations of its in-flight micro-batches: min(pp - r, m) under 1F1B, and
min(m*vpp, 2*(pp - r - 1) + (vpp - 1)*pp + 1) model chunks under the interleaved schedule (Megatron's warm-up count
plus the one in progress), m = global batch / (micro batch * dp). The first stage is usually the largest; the last
stage adds the logits of one micro-batch. The estimate is the largest stage.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from checkpoint.config import ModelConfig
from checkpoint.errors import LayoutError
from checkpoint.layout import Layout, PipelineSplit
from checkpoint.run_layout import RunLayout
from checkpoint.sharding import local_shape
from checkpoint.families import model_specs

from .units import GiB, PlanError

DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}
RECOMPUTE = ("none", "selective", "full")
KERNELS = ("fused", "eager", "local")
ENGINES = ("megatron-core", "native")
FP8_RECIPES = ("delayed", "tensorwise", "blockwise")  # train/fp8.py RECIPES (that module imports torch)
ENGINE_KERNELS = {"megatron-core": "local", "native": "eager"}  # what each engine's layer keeps on the local spec
TRANSFORMER_IMPLS = ("transformer_engine", "local")  # continue-pretrain's --transformer-impl


@dataclass(frozen=True)
class TrainSettings:
    """What besides the layout decides memory: sequence, batch, precision, recompute, optimizer sharding."""

    seq_length: int = 4096
    micro_batch_size: int = 1
    global_batch_size: int = 1024
    recompute: str = "none"  # none | selective | full
    # Megatron --use-distributed-optimizer (ZeRO-1 over DP x CP): on, as continue-pretrain always shards its optimizer
    distributed_optimizer: bool = True
    fp8: bool = False  # FP8 GEMMs (Transformer Engine): linear inputs saved in 1 byte, an FP8 copy of the weights
    # Megatron's --fp8-recipe, --no-fp8-wgrad (False), --first-last-layers-bf16: the engine's refusals, not the estimate
    fp8_recipe: str = "delayed"
    fp8_wgrad: bool = True
    first_last_layers_bf16: bool = False
    params_dtype: str = "bfloat16"
    grad_dtype: str = "float32"  # Megatron's main-grad buffer (accumulate and reduce in fp32)
    flash_attention: bool = True
    # fused (Megatron-LM with TE / flash) | eager (the native engine's plain autograd) | local (megatron-core's local
    # spec) | None: the layer spec's (transformer_impl: `layer_kernels`)
    kernels: str | None = "fused"
    # continue-pretrain's --transformer-impl: transformer_engine (TE's layer spec) | local | None: the launch's default,
    # TE's spec where the engine builds it for this model and run, else local (plan.search.layer_spec decides it)
    transformer_impl: str | None = None
    reserved_bytes: int = 2 * GiB  # CUDA context, NCCL communicators, cuBLAS workspaces, allocator slack
    engine: str = "megatron-core"  # continue-pretrain's --engine: its optimizer, DP traffic (and kernels when None)
    overlap_grad_reduce: bool = True  # megatron-core's --overlap-grad-reduce (the native engine has none)
    overlap_param_gather: bool = True  # megatron-core's --overlap-param-gather (with the distributed optimizer)

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise PlanError(f"--engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.kernels is not None and self.kernels not in KERNELS:
            raise PlanError(f"kernels must be one of {', '.join(KERNELS)}, got {self.kernels!r}")
        if self.transformer_impl is not None and self.transformer_impl not in TRANSFORMER_IMPLS:
            raise PlanError(f"--transformer-impl must be one of {', '.join(TRANSFORMER_IMPLS)}, got "
                            f"{self.transformer_impl!r}")
        if self.engine == "native":  # no overlap there (it refuses the flags)
            object.__setattr__(self, "overlap_grad_reduce", False)
            object.__setattr__(self, "overlap_param_gather", False)
        if self.fp8_recipe not in FP8_RECIPES:
            raise PlanError(f"--fp8-recipe must be one of {', '.join(FP8_RECIPES)}, got {self.fp8_recipe!r}")
        if not self.fp8 and (self.fp8_recipe != "delayed" or not self.fp8_wgrad or self.first_last_layers_bf16):
            raise PlanError("--fp8-recipe / --no-fp8-wgrad / --first-last-layers-bf16 need --fp8")
        if self.recompute not in RECOMPUTE:
            raise PlanError(f"--recompute must be one of {', '.join(RECOMPUTE)}, got {self.recompute!r}")
        for k in ("seq_length", "micro_batch_size", "global_batch_size"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise PlanError(f"--{k.replace('_', '-')} must be a positive integer, got {v!r}")
        for k in ("params_dtype", "grad_dtype"):
            if getattr(self, k) not in DTYPE_BYTES:
                raise PlanError(f"{k}: unknown dtype {getattr(self, k)!r}; one of {', '.join(DTYPE_BYTES)}")

    @property
    def fp8_format(self) -> str | None:
        """--fp8-format as plan's launch command writes it (None: FP8 off): with the fields above, the FP8 flags as
        train.fp8.FP8Config names them (train.engines.coverage.fp8_not_covered reads them)."""
        return "hybrid" if self.fp8 else None

    @property
    def layer_kernels(self) -> str:
        """What one layer keeps: `kernels`, else the layer spec's: TE's (transformer_engine, or None: the default on a
        GPU with TE) keeps the fused list on either engine, the local one the engine's own (ENGINE_KERNELS)."""
        if self.kernels is not None:
            return self.kernels
        return ENGINE_KERNELS[self.engine] if self.transformer_impl == "local" else "fused"

    def microbatches(self, dp: int) -> int:
        """Micro-batches per pipeline per step (at least 1 even when the batch does not divide: that is flagged)."""
        return max(1, self.global_batch_size // (self.micro_batch_size * dp))


# -- parameters: the sharding table ------------------------------------------------------------------------------------

def stage_layers(num_layers: int, pp: int, vpp: int = 1, split: PipelineSplit | None = None) -> list[list[int]]:
    """Global layer indices held by each pipeline rank (Megatron's interleaving: chunk c = v*pp + r), from the
    checkpoint layout's own layer ranges (even, or the uneven `split`). A layout that does not fit the model is dealt
    out with the larger chunks first, so an invalid layout still gets an estimate."""
    chunks = pp * vpp
    try:
        lay = Layout(pp=pp, vpp=vpp, split=split)
        return [[i for v in range(vpp) for i in range(*lay.layer_range(num_layers, r, v))] for r in range(pp)]
    except LayoutError:
        pass
    base, extra = divmod(num_layers, chunks)
    sizes = [base + (c < extra) for c in range(chunks)]
    starts = [sum(sizes[:c]) for c in range(chunks)]
    return [[i for v in range(vpp) for i in range(starts[v * pp + r], starts[v * pp + r] + sizes[v * pp + r])]
            for r in range(pp)]


@dataclass(frozen=True)
class _ParamTable:
    """Elements one rank holds, split into dense and expert parts: per decoder layer, and outside the layers."""

    layer_dense: tuple[int, ...]
    layer_expert: tuple[int, ...]
    first: int  # embedding (first stage)
    last_dense: int  # final norm, output layer, MTP dense parts (last stage)
    last_expert: int  # MTP routed experts (last stage)


_TABLES: dict[tuple, _ParamTable] = {}


def _param_table(cfg: ModelConfig, tp: int, ep: int, etp: int | None) -> _ParamTable:
    """Local element counts from the sharding table at pp=1 (per-layer = the stacked shard over the layer axis).
    Cached: the planner asks for the same (model, tp, ep, etp) for many pp/cp/dp."""
    key = (repr(cfg), tp, ep, etp)
    if key not in _TABLES:
        _TABLES[key] = _param_table_uncached(cfg, tp, ep, etp)
    return _TABLES[key]


def _param_table_uncached(cfg: ModelConfig, tp: int, ep: int, etp: int | None) -> _ParamTable:
    lay = Layout(tp=tp, pp=1, vpp=1, ep=ep, etp=etp)
    L = cfg.num_layers
    dense, expert = [0] * L, [0] * L
    first = last_dense = last_expert = 0
    for spec in model_specs(cfg, lay):
        n = math.prod(local_shape(spec, lay))
        if spec.per_layer:
            for i in range(L):
                (expert if spec.expert else dense)[i] += n // L
        elif spec.layer is not None:
            (expert if spec.expert else dense)[spec.layer] += n
        elif spec.stage == "first":
            first += n
        elif spec.expert:
            last_expert += n
        else:
            last_dense += n
    return _ParamTable(tuple(dense), tuple(expert), first, last_dense, last_expert)


def param_counts_per_stage(cfg: ModelConfig, layout: RunLayout) -> list[dict[str, int]]:
    """Elements held by one rank of each pipeline stage: {"dense": ..., "expert": ...} (dense = replicated over
    DP x CP, expert = replicated over the expert-DP group). Every TP/EP rank of a stage holds the same count: the
    sharding table's regions, plus the last stage's copy of the embedding when pp > 1 (tied, or read by MTP layers)."""
    t = _param_table(cfg, layout.tp, layout.ep, layout.etp)
    out = []
    for r, layers in enumerate(stage_layers(cfg.num_layers, layout.pp, layout.vpp, layout.split)):
        d = sum(t.layer_dense[i] for i in layers)
        e = sum(t.layer_expert[i] for i in layers)
        if r == 0:
            d += t.first
        if r == layout.pp - 1:
            d += t.last_dense
            e += t.last_expert
            if (cfg.tie_word_embeddings or cfg.mtp_num_layers) and layout.pp > 1:
                # Megatron (and our trainer) keep a copy of the embedding on the last stage: the tied head, and the
                # MTP layers' input embedding (megatron-core's GPTModel builds it where mtp_process)
                d += t.first
        out.append({"dense": d, "expert": e})
    return out


_TENSORS: dict[tuple, tuple] = {}


def _tensor_sizes(cfg: ModelConfig, tp: int, ep: int, etp: int | None) -> tuple:
    """(per decoder layer: [(elements, expert?)] in the model's order, first-stage tensors, last-stage tensors): one
    rank's local tensors, each a parameter of its own as the native engine holds them."""
    key = (repr(cfg), tp, ep, etp)
    if key not in _TENSORS:
        lay = Layout(tp=tp, pp=1, vpp=1, ep=ep, etp=etp)
        L = cfg.num_layers
        layers: list[list] = [[] for _ in range(L)]
        first, last = [], []
        for spec in model_specs(cfg, lay):
            n = math.prod(local_shape(spec, lay))
            if spec.per_layer:
                for i in range(L):
                    layers[i].append((n // L, spec.expert))
            elif spec.layer is not None:
                layers[spec.layer].append((n, spec.expert))
            else:
                (first if spec.stage == "first" else last).append((n, spec.expert))
        _TENSORS[key] = (layers, first, last)
    return _TENSORS[key]


def _greedy_max(sizes: list[int], ranks: int) -> int:
    """The heaviest rank's elements when `sizes` are dealt whole, in order, each to the least-loaded rank (the native
    engine's train.optim.owners)."""
    import heapq

    if not sizes:
        return 0
    heap = [(0, r) for r in range(ranks)]
    for n in sizes:
        load, r = heapq.heappop(heap)
        heapq.heappush(heap, (load + n, r))
    return max(load for load, _ in heap)


def native_optimizer_elements(cfg: ModelConfig, layout: RunLayout, pp_rank: int) -> int:
    """Optimizer elements on the heaviest rank of stage `pp_rank` under the native engine's ZeRO-1: each local
    parameter owned whole by one DP rank (dense) or expert-DP rank (experts), greedily by size; CP ranks are not
    part of it (each holds what its DP rank owns)."""
    layers, first, last = _tensor_sizes(cfg, layout.tp, layout.ep, layout.etp)
    held = [x for i in stage_layers(cfg.num_layers, layout.pp, layout.vpp, layout.split)[pp_rank] for x in layers[i]]
    if pp_rank == 0:
        held = first + held
    if pp_rank == layout.pp - 1:
        held = held + last
        if (cfg.tie_word_embeddings or cfg.mtp_num_layers) and layout.pp > 1:
            held = held + first
    dense = [n for n, e in held if not e]
    expert = [n for n, e in held if e]
    return _greedy_max(dense, layout.dp) + _greedy_max(expert, layout.edp)


def _shard(n: int, parts: int) -> int:
    """Elements of one rank when a flat buffer of n is cut into `parts` equal pieces (the last padded)."""
    return -(-n // parts)


def param_bytes_per_rank(cfg: ModelConfig, layout: RunLayout, distributed_optimizer: bool = False,
                         dtype: str = "bfloat16", *, grad_dtype: str = "float32", pp_rank: int | None = None,
                         main_params: bool | None = None) -> dict:
    """Bytes of parameters, gradients and Adam state on one rank of pipeline stage `pp_rank` (default: the stage
    with the most parameters).

    weights: `dtype`; grads: `grad_dtype` (Megatron's fp32 main-grad buffer); optimizer: fp32 main params (none when
    the weights are already fp32, Megatron's rule; `main_params=True` keeps a copy anyway), exp_avg and exp_avg_sq.
    With the distributed optimizer the optimizer state of dense parameters is split over DP x CP and that of expert
    parameters over the expert-DP group, each as a flat buffer cut into equal pieces (Megatron; an optimizer that
    hands whole tensors to DP ranks holds the same total over the DP group, unevenly)."""
    stages = param_counts_per_stage(cfg, layout)
    r = max(range(len(stages)), key=lambda i: stages[i]["dense"] + stages[i]["expert"]) if pp_rank is None \
        else pp_rank
    return {"pp_rank": r, **_bytes(stages[r]["dense"], stages[r]["expert"], layout, distributed_optimizer, dtype,
                                   grad_dtype, main_params)}


def _bytes(dense: int, expert: int, layout: RunLayout, distributed_optimizer: bool, dtype: str,
           grad_dtype: str, main_params: bool | None = None, owned: int | None = None) -> dict:
    """`owned`: the optimizer's elements where they are not an even split (the native engine's whole tensors)."""
    if dtype not in DTYPE_BYTES or grad_dtype not in DTYPE_BYTES:
        raise PlanError(f"unknown dtype {dtype!r} / {grad_dtype!r}; one of {', '.join(DTYPE_BYTES)}")
    n = dense + expert
    w, g = DTYPE_BYTES[dtype], DTYPE_BYTES[grad_dtype]
    main = 4 if (main_params if main_params is not None else w != 4) else 0
    if owned is not None and distributed_optimizer:
        opt_elems = owned
    elif distributed_optimizer:
        opt_elems = _shard(dense, layout.dp * layout.cp) + (_shard(expert, layout.edp) if expert else 0)
    else:
        opt_elems = n
    return {
        "params": n, "dense_params": dense, "expert_params": expert, "optimizer_params": opt_elems,
        "weights": n * w, "grads": n * g,
        "main_params": opt_elems * main, "exp_avg": opt_elems * 4, "exp_avg_sq": opt_elems * 4,
        "optimizer": opt_elems * (main + 8),
    }


def total_params(cfg: ModelConfig) -> dict[str, int]:
    """Whole-model parameter counts (true vocab): total, and active per token (top-k of the routed experts)."""
    t = _param_table(cfg, 1, 1, 1)
    vocab_pad = cfg.padded_vocab_size(1) - cfg.vocab_size
    pad = vocab_pad * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    total = sum(t.layer_dense) + sum(t.layer_expert) + t.first + t.last_dense + t.last_expert - pad
    active = total
    if cfg.is_moe:
        routed = sum(t.layer_expert) + t.last_expert
        active = total - routed + routed * cfg.moe_router_topk // cfg.num_moe_experts
    return {"total": total, "active": active}


# -- activations: Korthikanti et al., term by term ---------------------------------------------------------------------

def layer_activation_terms(cfg: ModelConfig, moe: bool, s: TrainSettings, layout: RunLayout) -> dict[str, float]:
    """Bytes one rank stores for one layer and one micro-batch with no recompute, by term. Tokens per rank:
    T = seq/cp * micro_batch; every term is divided by tp (sequence parallel)."""
    T = s.seq_length // layout.cp * s.micro_batch_size
    t = layout.tp
    a = DTYPE_BYTES[s.params_dtype]  # activations in the training dtype (bf16: 2)
    lin = 1 if s.fp8 else a  # linear-layer inputs are kept in FP8 by Transformer Engine
    h = cfg.hidden_size
    nh = cfg.num_attention_heads
    terms: dict[str, float] = {}
    if cfg.multi_latent_attention:
        terms["attn_norm_in"] = a * h
        terms["attn_down_in"] = lin * h
        if cfg.q_lora_rank:
            terms["q_latent"] = (a + lin) * cfg.q_lora_rank  # q norm input + q_up input
        terms["kv_latent"] = (a + lin) * cfg.kv_lora_rank  # kv norm input + kv_up input
        terms["qkv"] = a * nh * (2 * cfg.q_head_dim + cfg.v_head_dim)
        v_width = nh * cfg.v_head_dim
    else:
        terms["attn_norm_in"] = a * h
        terms["qkv_in"] = lin * h
        terms["qkv"] = a * (nh + 2 * cfg.num_query_groups) * cfg.kv_channels
        v_width = nh * cfg.kv_channels
    if s.flash_attention:
        terms["core_attn"] = 4 * nh  # fp32 log-sum-exp per head
    else:
        terms["core_attn"] = a * nh * s.seq_length  # softmax output [nh, s/cp, s] per query token (no dropout)
    terms["proj_in"] = lin * v_width
    terms["mlp_norm_in"] = a * h
    if moe:
        k, F, E = cfg.moe_router_topk, cfg.moe_ffn_hidden_size, cfg.num_moe_experts
        g = layout.expert_tp  # tokens are gathered over the expert-TP group before the experts
        terms["router_in"] = lin * h
        terms["router_probs"] = 4 * E  # fp32 scores
        terms["expert_in"] = lin * h * k * g  # permuted tokens, k copies
        terms["expert_fc1_out"] = a * 2 * F * k  # [gate; up] per routed copy (F/etp wide, etp x the tokens)
        terms["expert_fc2_in"] = lin * F * k
        terms["expert_out"] = a * h * k * g  # kept for the gradient of the routing weights
        S = cfg.moe_shared_expert_intermediate_size
        if S:
            terms["shared_fc1_out"] = a * 2 * S
            terms["shared_fc2_in"] = lin * S
    else:
        F = cfg.ffn_hidden_size
        terms["fc1_in"] = lin * h
        terms["fc1_out"] = a * 2 * F  # SwiGLU input [gate; up]
        terms["fc2_in"] = lin * F  # SwiGLU output
    kernels = s.layer_kernels
    if kernels == "eager":
        _eager(terms, cfg, moe, a)
    elif kernels == "local":
        _local(terms, cfg, moe, a, s, t, layout.cp)
    return {k: v * T / t for k, v in terms.items()}


def _glu_copies(terms: dict[str, float], cfg: ModelConfig, moe: bool, a: int, copies: int) -> None:
    """`copies` more tensors of the GLU's width per token (silu(gate); megatron-core's local GLU also a copy of up)."""
    if moe:
        terms["expert_glu_extra"] = copies * a * cfg.moe_ffn_hidden_size * cfg.moe_router_topk
        if cfg.moe_shared_expert_intermediate_size:
            terms["shared_glu_extra"] = copies * a * cfg.moe_shared_expert_intermediate_size
    else:
        terms["silu_out" if copies == 1 else "glu_extra"] = copies * a * cfg.ffn_hidden_size


def _eager(terms: dict[str, float], cfg: ModelConfig, moe: bool, a: int) -> None:
    """What plain PyTorch autograd keeps beyond the fused kernels' list (the native engine, train/model.py):
    RMSNorm keeps its fp32 input (the upcast copy, or the input itself in fp32), the normalised value before the
    weight and the fp32 rsqrt; SwiGLU keeps silu(gate) besides gate, up and the product. Q, K and V are kept at
    their own widths, as the fused list counts them (GQA inside SDPA: K and V are not expanded to every query head).
    Measured for dense GQA layers (equal to the byte); MoE and MLA layers: the same norms and SwiGLU on the fused
    list, extrapolated."""
    h = cfg.hidden_size
    for norm in ("attn_norm_in", "mlp_norm_in"):
        terms[norm] = 4 * h + a * h + 4
    _glu_copies(terms, cfg, moe, a, 1)


def _local(terms: dict[str, float], cfg: ModelConfig, moe: bool, a: int, s: TrainSettings, t: int,
           cp: int = 1) -> None:
    """What megatron-core's local layer spec keeps (its engine's build; scripts/bench_activations.py, exact at a tiny
    width): torch.nn.RMSNorm's fp32 input and normalised value and its rsqrt (8h + 4 per norm); the unfused
    DotProductAttention's Q, K and V expanded to every query head (3 a nh d), its fp32 softmax and the copy in the
    training dtype the V matmul reads ((4 + a) nh s per query token); RoPE's cos and sin for Q and K made per layer
    (4 a d per token, the whole sequence on every TP rank); the GLU's silu(gate) and copy of up besides [gate; up]
    and the product. Selective recompute (the core attention checkpointed) keeps the fused QKV output instead (K and
    V are views of it) and Q and K after RoPE. MoE and MLA layers: the fused list with these norms and GLU,
    extrapolated. Under context parallelism the engine's core attention on a GPU is Transformer Engine's
    TEDotProductAttention: Q, K, V at their widths and the log-sum-exp as the fused list keeps them (extrapolated:
    never measured, no TE here)."""
    h, nh = cfg.hidden_size, cfg.num_attention_heads
    for norm in ("attn_norm_in", "mlp_norm_in"):
        terms[norm] = 8 * h + 4
    _glu_copies(terms, cfg, moe, a, 2)
    if cfg.multi_latent_attention:
        return
    d, g = cfg.kv_channels, cfg.num_query_groups
    terms["rope"] = 4 * a * d * t  # not split over TP: x t against the common / t
    if cp > 1:  # TE's core attention (the fused list's Q, K, V and core_attn)
        return
    if s.recompute == "selective":
        terms.pop("core_attn")
        terms["qkv"] = a * (nh + 2 * g) * d  # the QKV output, kept whole by the K and V views
        terms["q_rope"] = a * nh * d
        terms["k_rope"] = a * g * d
    else:
        terms["qkv"] = 3 * a * nh * d  # Q, K^T and V expanded to every query head
        terms["core_attn"] = (4 + (a if a != 4 else 0)) * nh * s.seq_length  # fp32 softmax and its copy


def layer_activation_bytes(cfg: ModelConfig, moe: bool, s: TrainSettings, layout: RunLayout) -> float:
    """Bytes stored per layer and micro-batch under the chosen recompute (what stays resident in the pipeline)."""
    terms = layer_activation_terms(cfg, moe, s, layout)
    if s.recompute == "none":
        return sum(terms.values())
    if s.recompute == "selective":
        return sum(v for k, v in terms.items() if k != "core_attn")
    T = s.seq_length // layout.cp * s.micro_batch_size
    return DTYPE_BYTES[s.params_dtype] * cfg.hidden_size * T / layout.tp  # full: the layer's input only


def in_flight(layout: RunLayout, microbatches: int, pp_rank: int) -> int:
    """Model chunks whose activations pipeline rank `pp_rank` holds at its peak (1F1B / interleaved warm-up + 1)."""
    pp, v = layout.pp, layout.vpp
    if v == 1:
        return min(pp - pp_rank, microbatches)
    return min(microbatches * v, 2 * (pp - pp_rank - 1) + (v - 1) * pp + 1)


def stage_activation_bytes(cfg: ModelConfig, s: TrainSettings, layout: RunLayout, pp_rank: int,
                           layers: list[int] | None = None) -> dict[str, float]:
    """Activations of one pipeline stage at its peak: the layers' stored activations times the chunks in flight, the
    recompute working set (full recompute), token ids on the first stage, logits (and MTP) on the last."""
    if layers is None:
        layers = stage_layers(cfg.num_layers, layout.pp, layout.vpp, layout.split)[pp_rank]
    m = s.microbatches(layout.dp)
    chunks = in_flight(layout, m, pp_rank)
    per_chunk = len(layers) / layout.vpp  # layers per model chunk
    kinds = {moe: layer_activation_bytes(cfg, moe, s, layout) for moe in {cfg.is_moe_layer(i) for i in layers}}
    mean = sum(kinds[cfg.is_moe_layer(i)] for i in layers) / len(layers) if layers else 0.0
    out = {"layers": mean * per_chunk * chunks}
    T = s.seq_length // layout.cp * s.micro_batch_size
    if s.recompute == "full" and layers:
        out["recompute_working_set"] = max(sum(layer_activation_terms(cfg, moe, s, layout).values()) for moe in kinds)
    if pp_rank == 0:
        out["token_ids"] = 8 * T * min(layout.pp, m)  # int64 ids of the micro-batches in flight (replicated)
    if pp_rank == layout.pp - 1:
        vocab = cfg.padded_vocab_size(layout.tp)
        h = cfg.hidden_size
        # final norm input + output-layer input (bf16) + the fp32 softmax of vocab-parallel cross entropy, one micro-batch
        a = DTYPE_BYTES[s.params_dtype]
        out["logits"] = (2 * a * h + 4 * vocab) * T / layout.tp
        if cfg.mtp_num_layers:
            mtp = sum(layer_activation_terms(cfg, cfg.is_moe, s, layout).values()) + (6 * a * h + 4 * vocab) * T \
                / layout.tp  # enorm, hnorm inputs, eh_proj input [2h], own logits
            out["mtp"] = mtp * cfg.mtp_num_layers
    return out


def comm_buffer_bytes(cfg: ModelConfig, s: TrainSettings, layout: RunLayout) -> dict[str, float]:
    """Transient communication buffers: the sequence-parallel all-gather of one layer input (full sequence), the
    pipeline send/recv buffers (activation and gradient, each way), the MoE all-to-all send/recv buffers."""
    T = s.seq_length // layout.cp * s.micro_batch_size
    h = cfg.hidden_size
    a = DTYPE_BYTES[s.params_dtype]
    out: dict[str, float] = {}
    if layout.tp > 1:
        out["tp_all_gather"] = a * T * h
    if layout.pp > 1:
        out["pp_p2p"] = 4 * a * T * h / layout.tp
    if cfg.is_moe:
        out["ep_all_to_all"] = 2 * a * h * cfg.moe_router_topk * T * layout.expert_tp / layout.tp
    return out


# -- the whole breakdown ----------------------------------------------------------------------------------------------

@dataclass
class MemoryEstimate:
    """Per-GPU bytes on the largest pipeline stage, by component (``stages`` has every stage's total)."""

    weights: int
    grads: int
    optimizer: int
    optimizer_unsharded: int  # the same state without the distributed optimizer
    optimizer_sharded: int  # ... and with it
    activations: float
    comm_buffers: float
    fp8_weights: int
    reserved: int
    pp_rank: int
    activation_terms: dict = field(default_factory=dict)
    stages: list = field(default_factory=list)

    @property
    def total(self) -> float:
        return (self.weights + self.grads + self.optimizer + self.activations + self.comm_buffers + self.fp8_weights
                + self.reserved)

    def breakdown(self) -> dict[str, float]:
        return {"weights": self.weights, "grads": self.grads, "optimizer": self.optimizer,
                "activations": self.activations, "comm_buffers": self.comm_buffers, "fp8_weights": self.fp8_weights,
                "reserved": self.reserved}

    def to_dict(self) -> dict:
        return {**self.breakdown(), "total": self.total, "pp_rank": self.pp_rank,
                "optimizer_unsharded": self.optimizer_unsharded, "optimizer_sharded": self.optimizer_sharded,
                "activation_terms": self.activation_terms, "stages": self.stages}


def estimate_memory(cfg: ModelConfig, layout: RunLayout, s: TrainSettings) -> MemoryEstimate:
    """Every stage's memory; the estimate is the stage with the largest total."""
    best: MemoryEstimate | None = None
    totals = []
    layers_by_stage = stage_layers(cfg.num_layers, layout.pp, layout.vpp, layout.split)
    comm = comm_buffer_bytes(cfg, s, layout)
    counts = param_counts_per_stage(cfg, layout)
    for r in range(layout.pp):
        args = (counts[r]["dense"], counts[r]["expert"], layout)
        # the native engine's ZeRO-1 deals whole tensors over DP (its heaviest rank); megatron-core's splits a flat
        # buffer evenly over DP x CP
        owned = native_optimizer_elements(cfg, layout, r) if s.engine == "native" else None
        p = _bytes(*args, s.distributed_optimizer, s.params_dtype, s.grad_dtype, owned=owned)
        alt = _bytes(*args, not s.distributed_optimizer, s.params_dtype, s.grad_dtype, owned=owned)
        acts = stage_activation_bytes(cfg, s, layout, r, layers_by_stage[r])
        e = MemoryEstimate(
            weights=p["weights"], grads=p["grads"], optimizer=p["optimizer"],
            optimizer_unsharded=alt["optimizer"] if s.distributed_optimizer else p["optimizer"],
            optimizer_sharded=p["optimizer"] if s.distributed_optimizer else alt["optimizer"],
            activations=sum(acts.values()), comm_buffers=sum(comm.values()),
            fp8_weights=p["params"] if s.fp8 else 0, reserved=s.reserved_bytes, pp_rank=r,
            activation_terms=acts)
        totals.append(e.total)
        if best is None or e.total > best.total:
            best = e
    best.stages = totals
    return best

