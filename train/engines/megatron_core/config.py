"""megatron-core's TransformerConfig from shardkit's model config, once (`transformer_config`): the shapes, the MoE, MLA
and pipeline-split fields, the TE spec's and the FP8 recipe's fields."""
from __future__ import annotations

import torch

from checkpoint.families import family_of

from .checks import NotCovered


def fp8_fields(fp8, num_layers: int, pp: int) -> dict:
    """TransformerConfig's FP8 fields from shardkit's FP8Config (train/fp8.py: Megatron-LM's flags, whose dests are
    megatron-core's field names but --fp8-format's, `fp8`); megatron-core builds TE's recipe from them
    (fp8_utils.get_fp8_recipe) and enters te.fp8_autocast itself, with its TP x CP x DP amax reduction group. The
    bf16 layers as the native engine counts them (train.fp8.bf16_layers: global layer numbers), within megatron-core's
    bound of one pipeline stage's layers per end."""
    if fp8 is None or not fp8.enabled:
        return {}
    from train.fp8 import bf16_layers

    bf16_layers(fp8, num_layers)  # none left in FP8: refused as the native engine refuses it
    if fp8.first_last_layers_bf16:
        for flag, n in (("--num-layers-at-start-in-bf16", fp8.num_layers_at_start_in_bf16),
                        ("--num-layers-at-end-in-bf16", fp8.num_layers_at_end_in_bf16)):
            if n > num_layers // pp:
                raise NotCovered(f"{flag} {n}: megatron-core keeps at most one pipeline stage's layers "
                                 f"({num_layers // pp} at --pp {pp}) in bf16 at each end; lower it or use --engine "
                                 "native")
    return {"fp8": fp8.fp8_format, "fp8_recipe": fp8.fp8_recipe, "fp8_margin": fp8.fp8_margin,
            "fp8_amax_history_len": fp8.fp8_amax_history_len, "fp8_amax_compute_algo": fp8.fp8_amax_compute_algo,
            "fp8_wgrad": fp8.fp8_wgrad, "first_last_layers_bf16": fp8.first_last_layers_bf16,
            "num_layers_at_start_in_bf16": fp8.num_layers_at_start_in_bf16,
            "num_layers_at_end_in_bf16": fp8.num_layers_at_end_in_bf16}


def moe_fields(m, dims, moe_args) -> dict:
    """TransformerConfig's MoE fields: the model's (checkpoint.megatron.model_args, Megatron-LM's names) and the run's
    (--moe-router-load-balancing-type, --moe-aux-loss-coeff or the checkpoint's, --moe-router-dtype,
    --moe-token-dispatcher-type); dropless, experts as the local spec's SequentialMLP (one weight per expert)."""
    if not m.is_moe:
        return {}
    import dataclasses

    from megatron.core.transformer.transformer_config import TransformerConfig

    from checkpoint.megatron import model_args
    from train.moe import settings_of

    known = {f.name for f in dataclasses.fields(TransformerConfig)}
    a = model_args(m, dims.model_parallel)
    out = {k: v for k, v in a.items() if k.startswith("moe_") and k in known}
    s = settings_of(moe_args, m)
    # the router's logits in fp32 where the model's family computes them there (DeepSeek), as the native engine
    router_dtype = s.router_dtype or ("fp32" if family_of(m.model_type).router_fp32 else None)
    out.update(num_moe_experts=a["num_experts"], moe_router_load_balancing_type=s.load_balancing_type,
               moe_aux_loss_coeff=s.aux_loss_coeff, moe_router_dtype=router_dtype, moe_grouped_gemm=False,
               moe_router_bias_update_rate=s.bias_update_rate,
               moe_token_dispatcher_type=moe_args.moe_token_dispatcher_type, moe_permute_fusion=False,
               moe_router_fusion=False, expert_model_parallel_size=dims.ep,
               expert_tensor_parallel_size=dims.expert_tp)
    return out


def mla_fields(m, dims) -> dict:
    """MLATransformerConfig's multi-latent attention fields: the model's (checkpoint.megatron.model_args, Megatron-LM's
    names: q_lora_rank (None: one q projection), kv_lora_rank, the head sizes, rope_type and YaRN's factor / mscale /
    mscale_all_dim) and the YaRN fields Megatron-LM has no flag for, from the checkpoint's rope_scaling
    (original_max_position_embeddings, beta_fast, beta_slow: MLATransformerConfig's defaults are DeepSeek-V3's, not
    necessarily this model's). megatron-core's MLA rotates interleaved pairs itself (rotary_interleaved stays off),
    and its latent norms are the engine's LatentNorm (qk_layernorm stays off: see LatentNorm)."""
    if not m.multi_latent_attention:
        return {}
    from checkpoint.megatron import model_args

    a = model_args(m, dims.model_parallel)
    names = ("multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
             "v_head_dim", "rope_type", "rotary_scaling_factor", "mscale", "mscale_all_dim")
    out = {k: a[k] for k in names if k in a}
    out.update(rotary_interleaved=False, qk_layernorm=False, rotary_base=m.rotary_base)
    if out["rope_type"] == "yarn":
        rope = m.rope_scaling
        out.update(original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
                   beta_fast=float(rope.get("beta_fast", 32.0)), beta_slow=float(rope.get("beta_slow", 1.0)))
    else:  # MLATransformerConfig's default factor (40) would still scale its softmax through mscale_all_dim
        out.update(rotary_scaling_factor=1.0)
    return out


def te_spec_fields(m, te: bool) -> dict:
    """TransformerConfig's fields for megatron-core's Transformer Engine layer spec. Its norms are TE's (TENorm, and
    the norms fused into the following linear as TELayerNormColumnParallelLinear's `layer_norm_weight`: shardkit's
    canonical names), which run under sequence parallelism, so the local spec's stand-ins (RMSNorm, LatentNorm,
    HeadNorm) are not applied there. Multi-latent attention's latent norms are fused into linear_q_up_proj /
    linear_kv_up_proj only with qk_layernorm on (IdentityOp otherwise: the norms would be dropped), at the config's
    layernorm_epsilon: DeepSeek's latent norms take 1e-6 (LATENT_NORM_EPS) whatever rms_norm_eps says, so another
    rms_norm_eps is refused there."""
    if not (te and m.multi_latent_attention):
        return {}
    from train.engines.coverage import te_spec_not_covered  # the rule `shardkit plan` asks too

    why = te_spec_not_covered(m.multi_latent_attention, m.norm_epsilon)
    if why:
        raise NotCovered(why)
    return {"qk_layernorm": True}


def transformer_config(m, dims, run, *, sp: bool, dtype: torch.dtype, on_cpu: bool, moe_args=None, te=False,
                       fp8=None, cp_comm_type: str | None = None):
    """megatron-core's TransformerConfig (MLATransformerConfig for multi-latent attention) for shardkit's model config
    `m` at this run's layout: the one place the engine's shapes come from (never from flags retyped by the user)."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    cls = MLATransformerConfig if m.multi_latent_attention else TransformerConfig
    fields = dict(rotary_interleaved=m.rotary_interleaved, qk_layernorm=m.qk_layernorm)
    fields.update(mla_fields(m, dims))
    fields.update(te_spec_fields(m, te))
    fields.update(fp8_fields(fp8, m.num_layers, dims.pp))
    if m.mtp_num_layers:  # megatron-core's MTP block, its loss weighed as --mtp-loss-scaling-factor says
        from train.moe import settings_of

        fields.update(mtp_num_layers=m.mtp_num_layers,
                      mtp_loss_scaling_factor=settings_of(moe_args, m).mtp_loss_scaling_factor)
    return cls(
        num_layers=m.num_layers, hidden_size=m.hidden_size, ffn_hidden_size=m.ffn_hidden_size,
        num_attention_heads=m.num_attention_heads, num_query_groups=m.num_query_groups, kv_channels=m.kv_channels,
        layernorm_epsilon=m.norm_epsilon, normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=m.add_qkv_bias, **fields,
        hidden_dropout=run.hidden_dropout, attention_dropout=run.attention_dropout,
        tensor_model_parallel_size=dims.tp, pipeline_model_parallel_size=dims.pp,
        virtual_pipeline_model_parallel_size=dims.vpp if dims.vpp > 1 else None, sequence_parallel=sp,
        context_parallel_size=dims.cp, cp_comm_type=cp_comm_type if dims.cp > 1 else None,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16,
        attention_softmax_in_fp32=True, use_cpu_initialization=on_cpu,
        # initialised (then overwritten by the checkpoint): megatron-core sets its tensor-parallel attributes there
        perform_initialization=True,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False, apply_rope_fusion=False,
        persist_layer_norm=False, gradient_accumulation_fusion=False, deallocate_pipeline_outputs=True,
        recompute_granularity=run.recompute_granularity, recompute_method=run.recompute_method,
        recompute_num_layers=run.recompute_num_layers, **pipeline_split_fields(dims.split),
        **moe_fields(m, dims, moe_args))


def pipeline_split_fields(split) -> dict:
    """An uneven pipeline split (checkpoint.layout.PipelineSplit: Megatron-LM's flags) as TransformerConfig's fields;
    megatron-core then builds each stage's layers by its own rules, which the engine's parameter table checks against
    shardkit's layout layer by layer."""
    if split is None:
        return {}
    return {"num_layers_in_first_pipeline_stage": split.first, "num_layers_in_last_pipeline_stage": split.last,
            "account_for_embedding_in_pipeline_split": split.embedding,
            "account_for_loss_in_pipeline_split": split.loss, "pipeline_model_parallel_layout": split.layout}


def fp8_line(fp8) -> str:
    """The startup line's FP8 part on TE's spec: the recipe megatron-core builds (fp8_utils.get_fp8_recipe)."""
    if not fp8.enabled:
        return ""
    recipe = {"delayed": "DelayedScaling", "tensorwise": "Float8CurrentScaling",
              "blockwise": "Float8BlockScaling"}[fp8.fp8_recipe]
    kept = (f", decoder layers {fp8.num_layers_at_start_in_bf16} first / {fp8.num_layers_at_end_in_bf16} last in "
            "bf16" if fp8.first_last_layers_bf16 else "")
    return f"; FP8 {fp8.fp8_format} via TE's {recipe} under megatron-core's fp8 context{kept}"
