"""What the megatron-core engine builds (issue 40), without torch: asked by the engine itself
(train/engines/megatron_core.py check_model) and by `shardkit plan`, which models the engine a layout runs on."""
from __future__ import annotations


def model_not_covered(m) -> str | None:
    """Why the megatron-core engine cannot build model config `m` (None: it can): a Llama-family model, dense or with
    Mixtral's MoE (softmax top-k routing, no shared expert), what its local spec builds with the same names and
    numbers. No torch import: `shardkit plan` asks it for the engine it models."""
    if m.is_moe:
        moe = ("shared experts" if m.moe_shared_expert_intermediate_size else
               "an expert bias (aux-loss-free balancing)" if m.moe_router_enable_expert_bias else
               "group-limited routing" if m.moe_router_num_groups else
               f"{m.moe_router_score_function} router scores" if m.moe_router_score_function != "softmax" else
               "a top-k scaling factor" if m.moe_router_topk_scaling_factor else None)
        if moe:
            return (f"{m.model_type} has {moe}: the megatron-core engine builds Mixtral's MoE in this slice "
                    "(issue 40); use --engine native")
    what = ("multi-latent attention" if m.multi_latent_attention else
            "multi-token prediction" if m.mtp_num_layers else "a heterogeneous layer stack" if m.heterogeneous else
            "sliding-window attention" if m.sliding_window else
            "biases on the output projection / MLP" if m.add_proj_bias or m.add_mlp_bias else None)
    if what:
        return (f"{m.model_type} has {what}: the megatron-core engine builds Llama-family models (and "
                "Mixtral) in this slice (issue 40); use --engine native")
    rope = (m.rope_scaling or {}).get("rope_type", "default")
    if rope not in ("default", "llama3", "linear"):
        return f"RoPE scaling {rope!r}: not in the megatron-core engine yet (issue 40); use --engine native"
    return None
