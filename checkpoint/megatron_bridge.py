"""Megatron-Bridge (0.6) torch_dist checkpoints: what describes the model and the run beside the DCP files.

    <root>/iter_000000N/run_config.yaml    the ConfigContainer as YAML; `model:` is the model provider's config
                                           (megatron-core TransformerConfig field names)
    <root>/iter_000000N/train_state.pt     torch.save of {step, consumed_train_samples, ...} (0-d tensors)

The YAML is read with `yaml.safe_load` only (plain data; the `_target_` entries stay strings, nothing is imported or
called), bounded in size; train_state.pt with `torch.load(weights_only=True)` (checkpoint.safe_load). The model
config becomes a Megatron-LM args namespace (the names Megatron-LM's parse_args uses), so the readers that take a
model and a layout from Megatron-LM args (config_from_megatron_args, layout_from_args, check_args) take a Bridge
checkpoint's too. Megatron-Bridge does not pad the vocabulary unless `should_pad_vocab`: the args then say
make_vocab_size_divisible_by=1 and padded_vocab_size=vocab_size (the stored rows).
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from .errors import FormatError
from .safety import read_input, regular_file

RUN_CONFIG = "run_config.yaml"
TRAIN_STATE = "train_state.pt"
RUN_CONFIG_MAX = 4 << 20  # bytes: Bridge writes ~20 KB; a larger one is damage or hostile
TRAIN_STATE_MAX = 1 << 20

# provider field -> Megatron-LM argument, where the names differ
_RENAMED = {"num_moe_experts": "num_experts", "seq_len_interpolation_factor": "rotary_seq_len_interpolation_factor",
            "rope_scaling": "use_rope_scaling", "layernorm_epsilon": "norm_epsilon"}
_SCALAR = (str, int, float, bool, type(None))


def _target(v: Any) -> str | None:
    """A `{_target_: 'torch.float32', _call_: false}` entry as its dotted name (a plain string; nothing imported)."""
    return v.get("_target_") if isinstance(v, dict) and isinstance(v.get("_target_"), str) else None


def load_run_config(iter_dir: Path) -> tuple[argparse.Namespace | None, str | None]:
    """(Megatron-LM args made from run_config.yaml's `model:`, None), or (None, None) without a run_config.yaml, or
    (None, note) where it cannot be used. FormatError for a file that is not one (too large, not YAML)."""
    p = Path(iter_dir) / RUN_CONFIG
    if not regular_file(p, missing_ok=True):
        return None, None
    try:
        import yaml
    except ImportError:
        return None, f"{p} not read: PyYAML is not installed (pip install pyyaml)"
    text = read_input(p, limit=RUN_CONFIG_MAX)
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise FormatError(f"{p}: not valid YAML ({str(e).splitlines()[0][:160]})") from None
    except RecursionError:
        raise FormatError(f"{p}: nested too deeply") from None
    model = doc.get("model") if isinstance(doc, dict) else None
    if not isinstance(model, dict):
        return None, f"{p} holds no `model:` mapping (not a Megatron-Bridge run config)"
    ns: dict[str, Any] = {}
    for k, v in model.items():
        if not isinstance(k, str) or k.startswith("_"):
            continue
        if isinstance(v, _SCALAR) or isinstance(v, list) and all(isinstance(x, _SCALAR) for x in v):
            ns[_RENAMED.get(k, k)] = v
    ns["layernorm_epsilon"] = ns.get("norm_epsilon")
    ns["max_position_embeddings"] = model.get("max_position_embeddings") or model.get("seq_length")
    act = _target(model.get("activation_func"))
    glu = bool(model.get("gated_linear_unit"))
    # a GLU of another activation (or none): swiglu=False, which config_from_megatron_args refuses, naming it
    ns["swiglu"] = glu and act in ("torch.nn.functional.silu", "torch.nn.functional.silu_")
    share = model.get("share_embeddings_and_output_weights")
    ns["untie_embeddings_and_output_weights"] = not share if isinstance(share, bool) else None
    groups = model.get("num_query_groups")
    ns["group_query_attention"] = groups is not None and groups != model.get("num_attention_heads")
    dtype = _target(model.get("params_dtype"))
    ns["params_dtype"] = dtype
    vocab = model.get("vocab_size")
    if not model.get("should_pad_vocab", False) and isinstance(vocab, int):
        ns["make_vocab_size_divisible_by"] = 1
        ns["padded_vocab_size"] = vocab
    ns["megatron_bridge_run_config"] = str(p)
    return argparse.Namespace(**ns), None


BRIDGE_CONFIG_CONTAINER = "megatron.bridge.training.config.ConfigContainer"
BRIDGE_GPT_PROVIDER = "megatron.bridge.models.gpt_provider.GPTModelProvider"


def bridge_run_config(cfg: Any, layout: Any, dtype: str) -> str | None:
    """run_config.yaml for a torch_dist checkpoint shardkit writes, so that Megatron-Bridge 0.6 (`load_megatron_model`,
    AutoBridge's `load_megatron_model` / `export_ckpt`) builds its model from it: for a Megatron-LM checkpoint (args
    only) Bridge needs a `model_type` those entry points never pass. `model:` is GPTModelProvider's config (the
    inverse of load_run_config), its other fields at their defaults; the true vocabulary with `should_pad_vocab`
    where the stored rows are padded (Bridge then pads as Megatron-LM does). The layer spec is megatron-core's local
    one, which reads either key naming (TE's names mapped) and runs where `export_ckpt` does, on the CPU (Bridge's
    default spec is always Transformer Engine's). None for a model GPTModelProvider does not describe (MoE, MLA,
    MTP, RoPE scaling other than llama3's): no run_config.yaml."""
    if cfg.is_moe or cfg.multi_latent_attention or cfg.mtp_num_layers:
        return None
    import yaml

    rope = cfg.rope_scaling or {}
    if rope and rope.get("rope_type") != "llama3":
        return None  # (linear / yarn scaling: no GPTModelProvider field says it)
    padded = cfg.padded_vocab_size(layout.tp)
    fn = {"_target_": "torch.nn.functional.silu", "_call_": False}
    torch_dtype = {"_target_": f"torch.{dtype}", "_call_": False}
    model = {
        "_target_": BRIDGE_GPT_PROVIDER, "num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
        "ffn_hidden_size": cfg.ffn_hidden_size, "num_attention_heads": cfg.num_attention_heads,
        "num_query_groups": cfg.num_query_groups, "kv_channels": cfg.kv_channels, "vocab_size": cfg.vocab_size,
        "should_pad_vocab": padded != cfg.vocab_size, "make_vocab_size_divisible_by": cfg.make_vocab_size_divisible_by,
        "seq_length": cfg.max_position_embeddings, "normalization": "RMSNorm", "layernorm_epsilon": cfg.norm_epsilon,
        "gated_linear_unit": True, "activation_func": fn, "add_bias_linear": bool(cfg.add_proj_bias),
        "add_qkv_bias": bool(cfg.add_qkv_bias), "position_embedding_type": "rope", "rotary_base": cfg.rotary_base,
        "rotary_percent": 1.0, "rotary_interleaved": bool(cfg.rotary_interleaved),
        "rope_scaling": bool(rope), "rope_scaling_factor": float(rope.get("factor", 1.0)) if rope else 1.0,
        "share_embeddings_and_output_weights": bool(cfg.tie_word_embeddings), "hidden_dropout": 0.0,
        "attention_dropout": 0.0, "params_dtype": torch_dtype, "pipeline_dtype": dict(torch_dtype),
        "bf16": dtype == "bfloat16", "fp16": dtype == "float16",
        "tensor_model_parallel_size": layout.tp, "pipeline_model_parallel_size": layout.pp,
        "transformer_layer_spec": {"_target_": "megatron.bridge.models.gpt_provider.local_layer_spec", "_call_": False},
        # kernels the local spec on the CPU has not (apex, TE); speed only, never the numbers
        **{k: False for k in ("gradient_accumulation_fusion", "apply_rope_fusion", "bias_activation_fusion",
                              "bias_dropout_fusion", "masked_softmax_fusion", "persist_layer_norm")}}
    doc = {"_target_": BRIDGE_CONFIG_CONTAINER, "model": model}
    return yaml.safe_dump(doc, sort_keys=False)


def write_run_config(directory: Path, cfg: Any, layout: Any, dtype: str) -> None:
    """run_config.yaml (bridge_run_config) into an iteration directory being written, where the model has one."""
    text = bridge_run_config(cfg, layout, dtype)
    if text is not None:
        from .commit import write_file_atomic

        write_file_atomic(Path(directory) / RUN_CONFIG, text)


def load_train_state(iter_dir: Path) -> dict | None:
    """train_state.pt as plain ints / floats / bools (torch.load(weights_only=True), 0-d tensors unwrapped), or None
    without one."""
    from .safe_load import load_torch

    p = Path(iter_dir) / TRAIN_STATE
    if not regular_file(p, missing_ok=True):
        return None
    if p.stat().st_size > TRAIN_STATE_MAX:
        raise FormatError(f"{p}: {p.stat().st_size:,} bytes, more than a train state's {TRAIN_STATE_MAX:,}; refusing "
                          "to read it")
    obj = load_torch(p)
    if not isinstance(obj, dict):
        raise FormatError(f"{p}: holds a {type(obj).__name__}, not Megatron-Bridge's train state dict")
    out = {}
    for k, v in obj.items():
        if hasattr(v, "numel") and v.numel() == 1:
            v = v.item()
        if isinstance(v, (int, float, bool)):
            out[str(k)] = v
    return out


# -- Megatron-LM's `dp_reshardable` distributed-optimizer state (flat buffers) ---------------------------------------
#
# Megatron-LM >= 0.17 saves its distributed optimizer by default as the DP ranks' flat buffers
# `optimizer.distributed.dp_group_idx_<g>.gbuf_idx_<b>.dtype_(<param>, <grad>).bucket_idx_<k>.{param,exp_avg,exp_avg_sq}`
# plus `per_bucket_numel`. Within a bucket the parameters lie in the reverse of model.parameters() order, each one
# starting at a multiple of 64 elements (megatron-core's _ParamAndGradBuffer with the distributed optimizer); the gaps
# are padding (uninitialised memory: NaN/Inf there is not damage). flat_layout rebuilds that layout for the one form
# shardkit can check (TP 1, PP 1, one buffer, one bucket, a dense model of the local / TE layer spec) and proves it
# against the stored `param` buffer (the fp32 main parameters must equal the weights where the model is fp32).

FLAT_PREFIX = "optimizer.distributed."
_FLAT_ALIGN = 64


def flat_buffers(td) -> dict[str, list[str]]:
    """{state: [key, ...]} of the dp_reshardable flat buffers a torch_dist checkpoint holds ({} if none)."""
    out = {}
    for k in td.tensors:
        if k.startswith(FLAT_PREFIX) and ".bucket_idx_" in k:
            out.setdefault(k.rsplit(".", 1)[-1], []).append(k)
    return out


def flat_layout(td, layers: int) -> list[tuple[str, int | None, int, int]] | None:
    """[(model key, layer index or None, start, numel)] of the flat buffer's parameters, in buffer order; None where
    the checkpoint is not the one form rebuilt here."""
    bufs = flat_buffers(td)
    if not bufs or any(len(v) != 1 for v in bufs.values()):
        return None
    per_layer = ["decoder.layers.self_attention.linear_qkv.layer_norm_weight",
                 "decoder.layers.self_attention.linear_proj.weight", "decoder.layers.self_attention.linear_qkv.weight",
                 "decoder.layers.mlp.linear_fc1.layer_norm_weight", "decoder.layers.mlp.linear_fc1.weight",
                 "decoder.layers.mlp.linear_fc2.weight"]
    order: list[tuple[str, int | None]] = [("embedding.word_embeddings.weight", None)]
    for i in range(layers):
        order += [(k, i) for k in per_layer]
    order += [("decoder.final_layernorm.weight", None)]
    if "output_layer.weight" in td.tensors:
        order.append(("output_layer.weight", None))
    out, pos = [], 0
    for key, layer in reversed(order):
        t = td.tensors.get(key)
        if t is None or (layer is not None and (not t.shape or t.shape[0] != layers)):
            return None
        shape = t.shape[1:] if layer is not None else t.shape
        n = 1
        for s in shape:
            n *= s
        pos = -(-pos // _FLAT_ALIGN) * _FLAT_ALIGN
        out.append((key, layer, pos, n))
        pos += n
    size = td.tensors[next(iter(bufs.values()))[0]].shape
    if len(size) != 1 or not pos <= size[0] < pos + 2 * _FLAT_ALIGN * 64:
        return None
    return out


def flat_layout_proved(td, layers: int) -> list[tuple[str, int | None, int, int]] | None:
    """flat_layout, kept only where the stored fp32 `param` buffer equals every weight at its place (bitwise; the
    weights must be fp32 for this proof)."""
    import numpy as np

    lay = flat_layout(td, layers)
    bufs = flat_buffers(td)
    if lay is None or "param" not in bufs:
        return None
    buf = td.read_numpy(bufs["param"][0])
    for key, layer, start, n in lay:
        if layer is None:
            w = td.read_numpy(key)
        else:  # that layer's rows only (not the whole stacked tensor once per layer)
            w = td.read_numpy(key, ((layer, layer + 1),) + tuple((0, s) for s in td.tensors[key].shape[1:]))[0]
        if w.dtype != buf.dtype or not np.array_equal(np.ascontiguousarray(w).reshape(-1).view(np.uint32),
                                                      buf[start:start + n].view(np.uint32)):
            return None
    return lay
