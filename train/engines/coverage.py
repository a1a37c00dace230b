"""What the megatron-core engine builds (issue 40), and what has a Transformer Engine form on the native engine, without
torch: asked by the engines themselves (train/engines/megatron_core/checks.py check_model and layer_spec, train/te.py
unsupported) and by `shardkit plan`, which models the engine and layer spec a layout runs on."""
from __future__ import annotations

from checkpoint.config import LATENT_NORM_EPS


def model_not_covered(m) -> str | None:
    """Why the megatron-core engine cannot build model config `m` (None: it can): a Llama-family model, dense or with
    MoE (Mixtral, Qwen3-MoE), or DeepSeek-V2/V3 (multi-latent attention, shared experts, dense first layers,
    group-limited softmax / sigmoid routing with an expert bias): what its local spec builds with the same names and
    numbers. No torch import: `shardkit plan` asks it for the engine it models."""
    why = router_not_covered(m) if m.is_moe else None
    if why:
        return f"{m.model_type} has {why}: megatron-core's router computes other weights (issue 40); use --engine native"
    what = ("sliding-window attention" if m.sliding_window else
            "biases on the output projection / MLP" if m.add_proj_bias or m.add_mlp_bias else None)
    if what:
        return (f"{m.model_type} has {what}: the megatron-core engine builds Llama-family models, their MoE and "
                "DeepSeek's multi-latent attention in this slice (issue 40); use --engine native")
    rope = (m.rope_scaling or {}).get("rope_type", "default")
    if m.multi_latent_attention:  # megatron-core's MLA: plain or YaRN RoPE, over interleaved pairs
        if rope not in ("default", "yarn"):
            return (f"RoPE scaling {rope!r} with multi-latent attention: megatron-core's MLA has plain and YaRN RoPE "
                    "only; use --engine native")
        if not m.rotary_interleaved:
            return (f"{m.model_type} with rope_interleave=false: megatron-core's multi-latent attention always rotates "
                    "interleaved pairs; use --engine native")
    elif rope not in ("default", "llama3", "linear"):
        return f"RoPE scaling {rope!r}: not in the megatron-core engine yet (issue 40); use --engine native"
    return None


def router_not_covered(m) -> str | None:
    """What of model `m`'s router megatron-core's TopKRouter (moe_utils.topk_routing_with_score_function) would compute
    otherwise than transformers / the native engine (None: the same): its sigmoid weights are always renormalised over
    the top k, and a group scores the sum of its best topk / group_topk experts (DeepSeek-V3 sums its best 2 sigmoid
    scores, DeepSeek-V2 takes its best softmax score)."""
    sigmoid = m.moe_router_score_function == "sigmoid"
    if sigmoid and not m.moe_router_norm_topk and m.moe_router_topk > 1:
        return "sigmoid router weights that are not renormalised (norm_topk_prob false)"
    if m.moe_router_num_groups:
        per_group = m.moe_router_topk // m.moe_router_group_topk
        want = 2 if sigmoid else 1
        if per_group != want:
            return (f"group-limited routing with num_experts_per_tok {m.moe_router_topk} / topk_group "
                    f"{m.moe_router_group_topk} = {per_group} experts scored per group (HF scores "
                    f"{'the sum of the best 2' if sigmoid else 'the best'})")
    return None


def fp8_not_covered(fp8, te_spec: bool, have_te: bool) -> str | None:
    """Why the megatron-core engine on a GPU would not run FP8 flags `fp8` (None: it would, or FP8 is off): any object
    with train.fp8.FP8Config's fp8_format (None: off), fp8_recipe, fp8_wgrad and first_last_layers_bf16, on TE's layer
    spec (`te_spec`) or not. megatron-core's FP8 is TE's (its TE modules under fp8_utils.get_fp8_context, a null
    context without TE: FP8 would silently be bf16), so FP8 needs the TE spec; what megatron-core refuses or would
    drop is one line. The engine's rule (checks.layer_spec) and `shardkit plan`'s (which models a GPU with TE)."""
    if fp8.fp8_format is None:
        return None
    if not te_spec:
        why = "Transformer Engine is not installed" if not have_te else "--transformer-impl local"
        return (f"--fp8-format {fp8.fp8_format}: megatron-core's FP8 runs in Transformer Engine's modules only ({why}: "
                "every GEMM would stay in high precision); use its TE layer spec or --engine native")
    if fp8.first_last_layers_bf16 and fp8.fp8_recipe == "delayed":
        return ("--first-last-layers-bf16 with --fp8-recipe delayed: megatron-core refuses it (its delayed scaling "
                "reduces amaxes once per FP8 region); use --fp8-recipe tensorwise or blockwise, or --engine native")
    if not fp8.fp8_wgrad and fp8.fp8_recipe != "delayed":
        return (f"--no-fp8-wgrad with --fp8-recipe {fp8.fp8_recipe}: megatron-core applies it through its "
                "DelayedScaling recipe only (the weight gradients would stay FP8); use --fp8-recipe delayed")
    return None


def te_spec_not_covered(multi_latent_attention: bool, norm_epsilon: float) -> str | None:
    """Why megatron-core's Transformer Engine layer spec would not build a model with these fields (None: it would):
    multi-latent attention's latent norms are fused into linear_q_up_proj / linear_kv_up_proj there at the config's
    epsilon (rms_norm_eps), while DeepSeek's take LATENT_NORM_EPS. The engine's rule (config.te_spec_fields) and
    `shardkit plan`'s for FP8 (TE's layer spec only)."""
    if multi_latent_attention and norm_epsilon != LATENT_NORM_EPS:
        return (f"rms_norm_eps {norm_epsilon} with multi-latent attention on Transformer Engine's layer spec: its "
                f"latent norms (fused into linear_q_up_proj / linear_kv_up_proj) take the config's epsilon, DeepSeek's "
                f"take {LATENT_NORM_EPS}; use --transformer-impl local")
    return None


def te_form_not_covered(m, fp8, recompute: str | None) -> str | None:
    """Why the native engine's Transformer Engine backend has no form of this run (None: it has one): model config
    `m`, FP8 flags `fp8` (any object with train.fp8.FP8Config's fp8_format, None: off) and --recompute-granularity.
    Only dense Llama-family layers are rebuilt from TE modules (train/te.py), and a full recompute would run the FP8
    forward outside te.autocast. train.te.unsupported (the engine's rule: by default the local backend then) and
    `shardkit plan`'s."""
    if m.multi_latent_attention or m.is_moe or m.sliding_window is not None or m.qk_layernorm:
        return (f"{m.model_type} (MoE / multi-latent attention / sliding window / QK norm) has no TE form here; use "
                "--transformer-impl local")
    if fp8.fp8_format is not None and recompute == "full":
        return ("--recompute-granularity full with FP8: the recomputed forward would run outside te.autocast; use "
                "--recompute-granularity selective")
    return None
