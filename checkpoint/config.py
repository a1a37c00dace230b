"""The model config: one dataclass, translated from and to HF ``config.json``.

``config.json`` is read as data (``auto_map`` / remote code is never executed). Every field is either understood,
passed through because it cannot change the numbers (token ids, ``use_cache``...), or an error: a field we do not know
could change the math, so it is never dropped silently.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ConfigError
from .families import family_of

# Multi-latent attention's two latent norms (q_a_layernorm, kv_a_layernorm) are built with RMSNorm's default eps in
# both DeepSeek's reference code and HF, whatever rms_norm_eps says (train.model builds them so).
LATENT_NORM_EPS = 1e-6

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")

# Fields that are part of PretrainedConfig's generic surface or tokenizer/generation bookkeeping: they never change the
# forward pass, so they are carried through unchanged.
_PASSTHROUGH = {
    "architectures", "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
    "torch_dtype", "dtype", "transformers_version", "_name_or_path", "initializer_range", "use_cache",
    "pretraining_tp", "attention_dropout", "tokenizer_class", "output_attentions", "output_hidden_states",
    "return_dict", "id2label", "label2id", "problem_type", "chunk_size_feed_forward", "is_encoder_decoder",
    "torchscript", "use_return_dict", "prefix", "task_specific_params", "finetuning_task", "max_length",
    "_attn_implementation_autoset", "model_type",
    # read as data, never executed: shardkit never passes trust_remote_code
    "auto_map",
    # training-time knobs of the source that do not change the forward pass
    "output_router_logits", "router_jitter_noise", "ep_size", "seq_aux", "aux_loss_alpha", "router_aux_loss_coef",
}
# Fields every family interprets; a family adds its own (checkpoint/families: Family.fields); anything outside these
# and _PASSTHROUGH is refused.
COMMON_FIELDS = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "hidden_act", "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_scaling",
    "rope_parameters", "tie_word_embeddings", "head_dim",
})

# Refuse absurd sizes before anything is allocated (a corrupt or hostile config.json, manifest or Megatron args):
# ModelConfig field -> (the HF config.json name, the largest value accepted). Every ModelConfig checks these on
# construction, whatever it was built from; from_hf names the HF field.
BOUNDS: dict[str, tuple[str, int]] = {
    "vocab_size": ("vocab_size", 1 << 24), "hidden_size": ("hidden_size", 1 << 17),
    "ffn_hidden_size": ("intermediate_size", 1 << 20), "num_layers": ("num_hidden_layers", 1 << 12),
    "num_attention_heads": ("num_attention_heads", 1 << 12), "num_query_groups": ("num_key_value_heads", 1 << 12),
    "kv_channels": ("head_dim", 1 << 12), "max_position_embeddings": ("max_position_embeddings", 1 << 26),
    "num_moe_experts": ("num_local_experts", 1 << 14), "moe_ffn_hidden_size": ("moe_intermediate_size", 1 << 20),
    "moe_shared_expert_intermediate_size": ("moe_intermediate_size", 1 << 22),
    "moe_router_topk": ("num_experts_per_tok", 1 << 14), "kv_lora_rank": ("kv_lora_rank", 1 << 16),
    "q_lora_rank": ("q_lora_rank", 1 << 16), "qk_head_dim": ("qk_nope_head_dim", 1 << 12),
    "qk_pos_emb_head_dim": ("qk_rope_head_dim", 1 << 12), "v_head_dim": ("v_head_dim", 1 << 12),
    "mtp_num_layers": ("num_nextn_predict_layers", 64), "make_vocab_size_divisible_by": ("", 1 << 16),
    "sliding_window": ("sliding_window", 1 << 26),
}
_LIMITS = {hf: limit for hf, limit in BOUNDS.values() if hf} | {"n_routed_experts": 1 << 14, "num_experts": 1 << 14}
_OPTIONAL = {"num_moe_experts", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size", "kv_lora_rank",
             "q_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "sliding_window"}


# What each config.json field the converter reads must be: (kind, lowest value, null allowed). Kinds: "int", "num"
# (int or float), "bool", "str", "dict", "list". JSON strings are never numbers or booleans ("false" is not false), a
# float is never a size (64.0 is not 64), a bool is never a number. ">0" as the lowest value means strictly positive.
_FIELD_TYPES: dict[str, tuple[str, Any, bool]] = {
    "model_type": ("str", None, False),
    "vocab_size": ("int", 1, False), "hidden_size": ("int", 1, False), "intermediate_size": ("int", 1, False),
    "num_hidden_layers": ("int", 1, False), "num_attention_heads": ("int", 1, False),
    "num_key_value_heads": ("int", 1, False),  # null: Llama reads heads, Mistral refuses it: refused
    "head_dim": ("int", 1, True),
    "max_position_embeddings": ("int", 1, False), "hidden_act": ("str", None, True),
    "rms_norm_eps": ("num", ">0", False), "rope_theta": ("num", ">0", False),
    "rope_scaling": ("dict", None, True), "rope_parameters": ("dict", None, True),
    "tie_word_embeddings": ("bool", None, False), "attention_bias": ("bool", None, False),
    "mlp_bias": ("bool", None, False), "sliding_window": ("int", 1, True), "use_sliding_window": ("bool", None, False),
    "max_window_layers": ("int", 0, False), "use_mrope": ("bool", None, False), "layer_types": ("list", None, True),
    "num_local_experts": ("int", 1, False), "num_experts_per_tok": ("int", 1, False),
    "num_experts": ("int", 1, False), "decoder_sparse_step": ("int", 1, False), "mlp_only_layers": ("list", None, True),
    "router_aux_loss_coef": ("num", 0, False), "aux_loss_alpha": ("num", 0, False),
    "dtype": ("str", None, True), "torch_dtype": ("str", None, True),
    # DeepSeek
    "first_k_dense_replace": ("int", 0, False), "moe_layer_freq": ("int", 1, True),
    "n_routed_experts": ("int", 1, False),
    "n_shared_experts": ("int", 0, False), "moe_intermediate_size": ("int", 1, False), "n_group": ("int", 1, True),
    "topk_group": ("int", 1, True), "topk_method": ("str", None, True), "norm_topk_prob": ("bool", None, False),
    "routed_scaling_factor": ("num", ">0", False), "scoring_func": ("str", None, True), "q_lora_rank": ("int", 1, True),
    "kv_lora_rank": ("int", 1, False), "qk_nope_head_dim": ("int", 1, False), "qk_rope_head_dim": ("int", 1, False),
    "v_head_dim": ("int", 1, False), "qk_head_dim": ("int", 1, True), "num_nextn_predict_layers": ("int", 0, True),
    "quantization_config": ("dict", None, True), "rope_interleave": ("bool", None, False),
}
# RoPE parameters (inside rope_scaling / rope_parameters) per rope type, as transformers' rope functions read them
_ROPE_KEYS: dict[str, tuple[str, Any]] = {
    "rope_type": ("str", None), "type": ("str", None), "rope_theta": ("num", ">0"), "factor": ("num", ">0"),
    "original_max_position_embeddings": ("int", 1), "low_freq_factor": ("num", ">0"),
    "high_freq_factor": ("num", ">0"), "attention_factor": ("num", ">0"), "beta_fast": ("num", ">0"),
    "beta_slow": ("num", ">0"), "mscale": ("num", 0), "mscale_all_dim": ("num", 0), "truncate": ("bool", None),
}
_ROPE_ALLOWED = {
    "default": set(), "linear": {"factor"}, "dynamic": {"factor", "original_max_position_embeddings"},
    "yarn": {"factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow", "mscale",
             "mscale_all_dim", "truncate"},
    "llama3": {"factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"},
}
_ROPE_REQUIRED = {"linear": {"factor"}, "dynamic": {"factor"}, "yarn": {"factor"},
                  "llama3": {"factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"}}
_KIND_WORDS = {"int": "an integer", "num": "a number", "bool": "true or false", "str": "a string", "dict": "an object",
               "list": "a list"}


def _json_kind(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, int):
        return "an integer"
    if isinstance(v, float):
        return "a float" if math.isfinite(v) else "not a finite number"
    if isinstance(v, str):
        return "a string"
    return "a list" if isinstance(v, list) else "an object" if isinstance(v, dict) else type(v).__name__


def _show(v: Any) -> str:
    try:
        s = json.dumps(v, allow_nan=False)
    except (TypeError, ValueError):
        s = repr(v)
    return s if len(s) <= 60 else s[:57] + "..."


def check_value(source: str, name: str, v: Any, kind: str, low: Any = None, nullable: bool = False) -> None:
    """Raise ConfigError (one line: file, field, value, what was expected) unless v is of `kind` and >= low."""
    if v is None and nullable:
        return
    ok = {"int": isinstance(v, int) and not isinstance(v, bool),
          "num": isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
          "bool": isinstance(v, bool), "str": isinstance(v, str), "dict": isinstance(v, dict),
          "list": isinstance(v, list)}[kind]
    expected = _KIND_WORDS[kind] + (" or null" if nullable else "")
    if ok and low is not None:
        ok = v > 0 if low == ">0" else v >= low
        expected = f"{_KIND_WORDS[kind]} {'> 0' if low == '>0' else f'>= {low}'}" + (" or null" if nullable else "")
        if not ok:
            raise ConfigError(f"{source}: {name}={_show(v)} is out of range; expected {expected}")
    if not ok:
        raise ConfigError(f"{source}: {name}={_show(v)} is {_json_kind(v)}; expected {expected}")


def _check_fields(hf: dict, source: str) -> None:
    for key, (kind, low, nullable) in _FIELD_TYPES.items():
        if key in hf:
            check_value(source, key, hf[key], kind, low, nullable)
    for key in ("rope_scaling", "rope_parameters"):
        for name, v in (hf.get(key) or {}).items():
            if name in _ROPE_KEYS:
                check_value(source, f"{key}.{name}", v, *_ROPE_KEYS[name])
    if hf.get("layer_types") is not None and not all(isinstance(t, str) for t in hf["layer_types"]):
        raise ConfigError(f"{source}: layer_types={_show(hf['layer_types'])} must be a list of strings")


@dataclass(frozen=True)
class ModelConfig:
    """Megatron-Core's view of a decoder-only transformer (names follow TransformerConfig where one exists)."""

    model_type: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    vocab_size: int
    max_position_embeddings: int
    norm_epsilon: float
    rotary_base: float
    rope_scaling: dict | None = None  # HF rope parameters without rope_theta, e.g. {"rope_type": "llama3", ...}
    tie_word_embeddings: bool = False
    add_qkv_bias: bool = False
    add_proj_bias: bool = False
    add_mlp_bias: bool = False
    sliding_window: int | None = None
    # RMSNorm of each query and key head before RoPE (Qwen3; Megatron's --qk-layernorm)
    qk_layernorm: bool = False
    # MoE (Megatron TransformerConfig names). moe_layer_freq: one entry per layer, 1 = MoE, 0 = dense MLP.
    num_moe_experts: int | None = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int | None = None
    moe_shared_expert_intermediate_size: int | None = None
    moe_layer_freq: list | None = None
    moe_router_score_function: str = "softmax"  # "softmax" | "sigmoid"
    moe_router_norm_topk: bool = True  # renormalise the top-k weights to sum to 1
    moe_router_topk_scaling_factor: float | None = None
    moe_router_num_groups: int | None = None
    moe_router_group_topk: int | None = None
    moe_router_enable_expert_bias: bool = False
    moe_aux_loss_coeff: float = 0.0
    # multi-latent attention (DeepSeek). q_lora_rank None = plain q projection (V2-Lite).
    multi_latent_attention: bool = False
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_head_dim: int | None = None
    qk_pos_emb_head_dim: int | None = None
    v_head_dim: int | None = None
    rotary_interleaved: bool = False
    # multi-token prediction layers (DeepSeek-V3), stored after the decoder layers on the HF side
    mtp_num_layers: int = 0
    params_dtype: str = "float32"  # torch dtype name of the source weights
    make_vocab_size_divisible_by: int = 128
    hf_config: dict = field(default_factory=dict, compare=False, repr=False)  # the source config.json, verbatim

    def __post_init__(self) -> None:
        """Bounds before anything is sized from this config: a 10^12-row embedding is refused, not attempted."""
        for name, (hf_name, limit) in BOUNDS.items():
            v = getattr(self, name)
            if v is None and name in _OPTIONAL:
                continue
            low = 0 if name == "mtp_num_layers" else 1
            if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= limit:
                alias = f" ({hf_name})" if hf_name and hf_name != name else ""
                raise ConfigError(f"model config: {name}{alias}={v!r} is not an integer in [{low}, {limit}]; "
                                  "refusing to size a model from it")
        if self.num_moe_experts and self.moe_layer_freq is not None and len(self.moe_layer_freq) != self.num_layers:
            raise ConfigError(f"model config: moe_layer_freq has {len(self.moe_layer_freq)} entries for "
                              f"{self.num_layers} layers")

    # -- derived sizes ---------------------------------------------------------------------------------------------
    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups

    @property
    def is_moe(self) -> bool:
        return bool(self.num_moe_experts)

    def is_moe_layer(self, layer: int) -> bool:
        return self.is_moe and bool(self.moe_layer_freq[layer])

    @property
    def heterogeneous(self) -> bool:
        """Megatron stores a stack with both dense and MoE layers under per-layer keys (`decoder.layers.{i}.`)."""
        return self.is_moe and len(set(self.moe_layer_freq)) > 1

    @property
    def q_head_dim(self) -> int:
        return self.qk_head_dim + self.qk_pos_emb_head_dim

    @property
    def qkv_rows(self) -> int:
        return (self.num_attention_heads + 2 * self.num_query_groups) * self.kv_channels

    def padded_vocab_size(self, tp: int) -> int:
        """Megatron's rule: pad to a multiple of make_vocab_size_divisible_by * tp."""
        m = self.make_vocab_size_divisible_by * tp
        return int(math.ceil(self.vocab_size / m) * m)

    # -- (de)serialisation for the manifest ----------------------------------------------------------------------
    def to_dict(self) -> dict:
        """The manifest's model config. Fields added after the format's first release are written only when they
        differ from their default, so a checkpoint that does not use a feature reads the same in a shardkit that
        predates it (and keeps its bytes)."""
        d = dataclasses.asdict(self)
        for name in _LATER_FIELDS:
            if d[name] == _DEFAULTS[name]:
                del d[name]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ConfigError(f"manifest model config: unknown field(s) {sorted(unknown)}")
        return cls(**d)

    # -- HF translation ------------------------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, hf: dict, source: str = "config.json") -> "ModelConfig":
        """Translate an HF config dict. Raises ConfigError naming the field on anything unsupported."""
        mt = hf.get("model_type")
        fam = family_of(mt, source)
        allowed = COMMON_FIELDS | fam.fields | _PASSTHROUGH
        unknown = sorted(k for k in hf if k not in allowed)
        if unknown:
            raise ConfigError(f"{source}: unsupported field(s) {unknown} for model_type {mt!r}; "
                              "shardkit refuses fields it cannot honour rather than dropping them")
        _check_fields(hf, source)
        verbatim = dict(hf)
        hf = _with_hf_defaults(hf, mt, COMMON_FIELDS | fam.fields)

        def req(key: str) -> Any:
            if key not in hf or hf[key] is None:
                raise ConfigError(f"{source}: missing required field {key!r}")
            return hf[key]

        def integer(key: str, value: Any = None) -> int:
            v = req(key) if value is None else value
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ConfigError(f"{source}: {key} must be a positive integer, got {v!r}")
            if key in _LIMITS and v > _LIMITS[key]:
                raise ConfigError(f"{source}: {key}={v} exceeds the limit {_LIMITS[key]}; refusing to allocate it")
            return v

        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"{source}: hidden_act {act!r} is not supported (only 'silu', SwiGLU)")
        hidden = integer("hidden_size")
        heads = integer("num_attention_heads")
        layers = integer("num_hidden_layers")
        theta, scaling = _read_rope(hf, source)
        eps = hf.get("rms_norm_eps", 1e-6)
        if not isinstance(eps, (int, float)) or not (0 < eps < 1):
            raise ConfigError(f"{source}: rms_norm_eps must be in (0, 1), got {eps!r}")
        dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
        if dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"{source}: dtype {dtype!r} is not supported (float32, bfloat16, float16)")
        common = dict(
            model_type=mt, num_layers=layers, hidden_size=hidden, ffn_hidden_size=integer("intermediate_size"),
            num_attention_heads=heads, vocab_size=integer("vocab_size"),
            max_position_embeddings=integer("max_position_embeddings", hf.get("max_position_embeddings") or
                                             _hf_default(mt, "max_position_embeddings")),
            norm_epsilon=float(eps), rotary_base=theta, rope_scaling=scaling,
            # transformers' default for all these families is untied
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            params_dtype=dtype, hf_config=verbatim)
        return cls(**common, **fam.read_config(hf, source, integer, common))

    @classmethod
    def from_hf_dir(cls, hf_dir: str | Path) -> "ModelConfig":
        from .safety import regular_file, safe_path

        path = Path(hf_dir) / "config.json"
        if not regular_file(path, missing_ok=True):  # a FIFO or a device: one line naming it, never a hang
            raise ConfigError(f"{path}: missing config.json; is {hf_dir} a HuggingFace model directory?")
        # a link may resolve inside the model folder (a hub snapshot: inside its models--org--name), never into
        # another repository's blobs or elsewhere (issue 34): the config must be this model's
        safe_path(hf_dir, "config.json", f"{hf_dir}: config.json")
        return cls.from_hf_file(path)

    @classmethod
    def from_hf_file(cls, path: str | Path) -> "ModelConfig":
        """An HF config.json file by itself (`shardkit plan --model config.json`: a model's config without its
        weights). A FIFO, device or a file over 64 MiB is one line naming it."""
        from .safety import read_input

        try:
            data = json.loads(read_input(path, limit=64 << 20))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        except RecursionError:
            raise ConfigError(f"{path}: JSON nested too deeply") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a JSON object")
        return cls.from_hf(data, source=str(path))

    def to_hf(self, dtype: str | None = None, quantized: bool = False) -> dict:
        """The HF config.json: the source's own dict with every interpreted field rewritten from this config, in the
        style the source used (``rope_scaling`` vs ``rope_parameters``, ``torch_dtype`` vs ``dtype``)."""
        fam = family_of(self.model_type)
        src = dict(self.hf_config)
        out = dict(src) if src else {"architectures": [fam.architecture]}
        out.update({
            "model_type": self.model_type,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.ffn_hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_query_groups,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.norm_epsilon,
            "hidden_act": "silu",
            "tie_word_embeddings": self.tie_word_embeddings,
        })
        if not self.multi_latent_attention and (src.get("head_dim") is not None or
                                                self.kv_channels * self.num_attention_heads != self.hidden_size):
            out["head_dim"] = self.kv_channels
        fam.write_config(self, out, src)
        # RoPE, in the source's style
        if "rope_parameters" in src:
            params = _rope_in_source_style(self.rope_scaling or {"rope_type": "default"}, src["rope_parameters"])
            out["rope_parameters"] = {**params, "rope_theta": self.rotary_base}
        else:
            if "rope_theta" in src or self.rotary_base != 10000.0 or not src:
                out["rope_theta"] = self.rotary_base
            if self.rope_scaling is not None or "rope_scaling" in src:
                out["rope_scaling"] = _rope_in_source_style(self.rope_scaling, src.get("rope_scaling"))
        if not quantized:  # the weights are written dequantized: a quantization_config would mislead loaders
            out.pop("quantization_config", None)
        dkey = "dtype" if "dtype" in src and "torch_dtype" not in src else "torch_dtype"
        out[dkey] = dtype or self.params_dtype
        return out

    def hf_transformers_config(self):
        """A transformers config object for this model (used for RoPE tables and the HF oracle)."""
        import transformers

        d = self.to_hf()
        cls = transformers.CONFIG_MAPPING[self.model_type]
        return cls.from_dict(d)


_LATER_FIELDS = ("qk_layernorm",)
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
_MOE_FIELDS = ("num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
               "moe_layer_freq", "moe_router_score_function", "moe_router_norm_topk", "moe_router_topk_scaling_factor",
               "moe_router_num_groups", "moe_router_group_topk", "moe_router_enable_expert_bias", "moe_aux_loss_coeff")
_MLA_FIELDS = ("multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
               "v_head_dim")


def applicable_fields(model: dict) -> dict:
    """The ModelConfig fields (a to_dict()) that apply to this model, for people to read: no MoE fields for a dense
    model, no multi-latent-attention fields without it, optional features only when on (`inspect`)."""
    out = {}
    for k, v in model.items():
        if k == "hf_config" or (k in _MOE_FIELDS and not model.get("num_moe_experts")) or \
                (k in _MLA_FIELDS and not model.get("multi_latent_attention")):
            continue
        if k in ("rope_scaling", "sliding_window", "q_lora_rank", "moe_router_num_groups", "moe_router_group_topk",
                 "moe_shared_expert_intermediate_size", "moe_router_topk_scaling_factor") and v is None:
            continue
        if k in ("rotary_interleaved", "moe_router_enable_expert_bias", "multi_latent_attention", "qk_layernorm") \
                and not v:
            continue
        if k == "mtp_num_layers" and not v:
            continue
        out[k] = v
    return out


# Sizes and structure-defining fields never take a default: a config.json without them is refused. Every other field
# the converter reads means, when absent, what transformers' config class makes of its absence (Mixtral's rope_theta
# is 1e6, DeepSeek-V3's routed_scaling_factor 2.5, Mistral's sliding_window 4096...), never a default of our own.
_NO_DEFAULT = {"model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "rope_scaling", "rope_parameters", "head_dim", "qk_head_dim", "layer_types",
               "dtype", "torch_dtype", "max_window_layers", "quantization_config", "n_routed_experts",
               "moe_intermediate_size", "num_local_experts", "num_experts", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
               "v_head_dim"}
_SIZES = ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size", "intermediate_size")


def _with_hf_defaults(hf: dict, model_type: str, fields: frozenset[str]) -> dict:
    """hf with transformers' reading of every absent field that the converter reads (only computed when one is)."""
    theta_missing = "rope_theta" not in hf and not any("rope_theta" in (hf.get(k) or {})
                                                       for k in ("rope_parameters", "rope_scaling"))
    wanted = [k for k in fields if k in _FIELD_TYPES and k not in _NO_DEFAULT and k not in hf
              and (k != "rope_theta" or theta_missing)]
    if not wanted:  # a complete config.json (what save_pretrained writes) never imports transformers (~2 s of CPU)
        return hf
    import transformers

    cls = transformers.CONFIG_MAPPING[model_type]
    try:  # sized like the source, so derived defaults (num_key_value_heads = heads) follow it
        ref = cls(**{k: hf[k] for k in _SIZES if k in hf})
    except Exception:  # noqa: BLE001 - transformers refuses the sizes: our own checks name the field
        ref = cls()
    out = dict(hf)
    for key in wanted:
        if key == "rope_theta":
            if theta_missing:
                out["rope_theta"] = (getattr(ref, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        elif hasattr(ref, key):
            out[key] = getattr(ref, key)
    return out


def _hf_default(model_type: str, key: str) -> Any:
    """transformers' own default for a field the config omits (so a missing field means what it means in HF)."""
    import transformers

    return getattr(transformers.CONFIG_MAPPING[model_type](), key)


def _read_rope(hf: dict, source: str) -> tuple[float, dict | None]:
    """Return (rope_theta, scaling-params-or-None) from rope_theta / rope_scaling / rope_parameters."""
    params = hf.get("rope_parameters")
    scaling = hf.get("rope_scaling")
    if params is not None and not isinstance(params, dict):
        raise ConfigError(f"{source}: rope_parameters must be an object")
    if scaling is not None and not isinstance(scaling, dict):
        raise ConfigError(f"{source}: rope_scaling must be an object or null")
    theta = hf.get("rope_theta")
    merged: dict = {}
    if params:
        merged.update(params)
        theta = merged.pop("rope_theta", theta)
    if scaling:
        merged.update(scaling)
        if merged.get("rope_theta") is not None:  # transformers 5 also keeps the theta inside the scaling dict
            inner = merged.pop("rope_theta")
            if theta is not None and inner != theta:
                raise ConfigError(f"{source}: rope_scaling.rope_theta={_show(inner)} differs from "
                                  f"rope_theta={_show(theta)}")
            theta = inner
    if "type" in merged:  # transformers-4 spelling
        t = merged.pop("type")
        merged.setdefault("rope_type", t)
    rope_type = merged.get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        raise ConfigError(f"{source}: rope type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
    if theta is None:
        theta = 10000.0
    check_value(source, "rope_theta", theta, "num", ">0")
    where = "rope_parameters" if params else "rope_scaling"
    merged = {k: v for k, v in merged.items() if v is not None}  # null = transformers' default, as HF reads it
    missing = sorted(_ROPE_REQUIRED.get(rope_type, set()) - set(merged))
    if missing:
        raise ConfigError(f"{source}: {where} of rope type {rope_type!r} needs {', '.join(map(repr, missing))}")
    extra = sorted(set(merged) - _ROPE_ALLOWED[rope_type] - {"rope_type"})
    if extra:  # a parameter we do not pass on could change the frequencies: refused, never dropped
        raise ConfigError(f"{source}: {where} field(s) {extra} are not supported for rope type {rope_type!r} "
                          f"(supported: {', '.join(sorted(_ROPE_ALLOWED[rope_type])) or 'none'})")
    if rope_type == "llama3" and merged["high_freq_factor"] <= merged["low_freq_factor"]:
        raise ConfigError(f"{source}: {where}.high_freq_factor={_show(merged['high_freq_factor'])} must exceed "
                          f"low_freq_factor={_show(merged['low_freq_factor'])}")
    return float(theta), (merged if rope_type != "default" else None)


def _rope_in_source_style(scaling: dict | None, src_scaling: dict | None) -> dict | None:
    """Write the scaling dict with the key the source used for its type (``type`` and/or ``rope_type``)."""
    if scaling is None:
        return None
    out = dict(scaling)
    rope_type = out.pop("rope_type")
    src_scaling = src_scaling or {}
    if "type" in src_scaling:
        out["type"] = rope_type
    if "rope_type" in src_scaling or "type" not in src_scaling:
        out["rope_type"] = rope_type
    return out
