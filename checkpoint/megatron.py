"""What shardkit knows about Megatron-LM / megatron-core conventions, in one place.

- Constants of a Megatron checkpoint root: the tracker file, `checkpoint_version`, the `iter_NNNNNNN` directory names.
- Key naming both ways: megatron-core's local layer spec vs its Transformer Engine spec (whose names are shardkit's
  canonical names), for module state dicts (legacy `--ckpt-format torch` rank files) and for sharded state dicts
  (`--ckpt-format torch_dist`).
- Megatron-LM arguments both ways: the `argparse.Namespace` written into a checkpoint (`megatron_args`: Megatron-LM's
  whole namespace, from the argument list and defaults in megatron_lm_args.py, generated data), and the model config
  and layout read back from one (`config_from_megatron_args`, `layout_from_args`, `check_args`, `missing_model_args`).
- Rank order: Megatron's default `tp-cp-ep-dp-pp` numbering (dense groups tp-cp-dp-pp, expert groups etp-ep-edp-pp),
  which the trainer's process groups, the torch_dist writer and the planner's link model all use.

It lives in `checkpoint`, not `convert`: checkpoint/torch_dist.py needs its constants, and `checkpoint` imports neither
`convert` nor `train` (DESIGN.md), while `convert`, `train` and `plan` can all import it from here.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import functools
import itertools
import re
import signal
from typing import Any, Mapping, Sequence


from . import megatron_lm_args as _mlm
from . import store
from .config import ModelConfig
from .errors import ConfigError, FormatError, ShardkitError
from .layout import Layout, PipelineSplit
from .sharding import Region, TensorSpec, regions, split_optimizer_key

# -- constants --------------------------------------------------------------------------------------------------------

TRACKER = "latest_checkpointed_iteration.txt"  # "N" or "release", in the checkpoint root
CHECKPOINT_VERSION = 3.0  # Megatron-LM's checkpoint_version for megatron-core models: QKV grouped by query group
RELEASE = "release"  # the iteration directory (and tracker text) of a release checkpoint
ITER_DIR = re.compile(r"^iter_(\d{7})$")


def iter_dirname(iteration: int) -> str:
    """Megatron-LM's iteration directory name (the native format uses the same)."""
    return f"iter_{iteration:07d}"


def iteration_of(name: str) -> int | None:
    """The iteration of an `iter_NNNNNNN` directory name, else None."""
    m = ITER_DIR.match(name)
    return int(m.group(1)) if m else None


# -- key naming: local spec <-> Transformer Engine spec ----------------------------------------------------------------

# The norms megatron-core's TE spec fuses into the following linear (`<linear>.layer_norm_weight`) are separate modules
# in its local spec. Per layer-relative key: (TE spec = canonical name, local spec's module state-dict key, local spec's
# sharded-state-dict key). The local spec's `sharded_state_dict_keys_map` (gpt_layer_specs.get_gpt_layer_local_spec:
# "input_layernorm." -> "self_attention.linear_qkv.layer_norm_", "pre_mlp_layernorm." -> "mlp.linear_fc1.layer_norm_")
# gives most of them their TE names back in torch_dist; it also renames an MoE layer's pre-MLP norm, which the TE spec
# keeps as `pre_mlp_layernorm`.
LOCAL_NAMES: tuple[tuple[str, str, str], ...] = (
    ("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight",
     "self_attention.linear_qkv.layer_norm_weight"),
    ("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"),
    ("pre_mlp_layernorm.weight", "pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"),  # an MoE layer
    ("self_attention.linear_q_up_proj.layer_norm_weight", "self_attention.q_layernorm.weight",
     "self_attention.q_layernorm.weight"),
    ("self_attention.linear_kv_up_proj.layer_norm_weight", "self_attention.kv_layernorm.weight",
     "self_attention.kv_layernorm.weight"),
)
KEY_NAMINGS = ("te", "local")


def _with_suffix(name: str, old: str, new: str) -> str | None:
    if name == old or name.endswith("." + old):
        return name[: len(name) - len(old)] + new
    return None


def canonical_candidates(key: str) -> list[str]:
    """Canonical names a module state-dict key may stand for: itself (TE spec), then its TE name if it is one of the
    local spec's separate norms (which one applies depends on the layer: an MoE layer keeps `pre_mlp_layernorm`)."""
    out = [key]
    for te, local, _ in LOCAL_NAMES:
        if te != local:
            renamed = _with_suffix(key, local, te)
            if renamed is not None:
                out.append(renamed)
    return out


def sharded_key(name: str, key_naming: str = "te") -> str:
    """The sharded-state-dict (torch_dist) key of canonical tensor `name` under a layer spec's naming."""
    if key_naming == "local":
        for te, _, local in LOCAL_NAMES:
            if te != local:
                renamed = _with_suffix(name, te, local)
                if renamed is not None:
                    return renamed
    return name


# -- Megatron-LM args: written -----------------------------------------------------------------------------------------

# Every argument Megatron-LM's parser defines with its default, for the release we test with (generated data: see
# checkpoint/megatron_lm_args.py and scripts/megatron_lm_args.py, which record the tag and commit).
MEGATRON_LM_SOURCE: dict = _mlm.SOURCE


class MegatronEnum:
    """A member of one of Megatron's enums in the args we write (e.g. `attention_backend=AttnBackend.auto`). Written
    into common.pt the way pickle writes the real member (its class by import path, called with the value: what
    Megatron-LM's own checkpoints hold, so readers that build a TransformerConfig from the args get a real enum) without
    importing Megatron (checkpoint.torch_dist.write_common); read back through checkpoint.safe_load it is the inert
    stand-in of that class."""

    __slots__ = ("path", "member", "value")

    def __init__(self, path: str, member: str, value: Any) -> None:
        self.path, self.member, self.value = path, member, value

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, MegatronEnum):
            return NotImplemented
        return (self.path, self.member, self.value) == (other.path, other.member, other.value)

    def __hash__(self) -> int:
        return hash((self.path, self.member, self.value))

    def __repr__(self) -> str:
        return f"<{self.path.rsplit('.', 1)[-1]}.{self.member}: {self.value!r}>"


class TorchDtype:
    """A torch dtype in the args we write (`params_dtype`), by name: written into common.pt as pickle writes the real
    `torch.<name>` (a global) without importing torch (checkpoint.torch_dist.write_common), so an export stays
    torch-free; read back it is the real dtype. Equal to the torch dtype of that name (their str() agree)."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = store.dtype_name(name)

    def __eq__(self, other: object) -> bool:
        return str(self) == str(other) if isinstance(other, TorchDtype) or type(other).__name__ == "dtype" \
            else NotImplemented

    def __hash__(self) -> int:
        return hash(str(self))

    def __str__(self) -> str:
        return f"torch.{self.name}"

    __repr__ = __str__


def megatron_lm_defaults() -> dict[str, Any]:
    """A fresh copy of Megatron-LM's argument defaults (every argument its parser defines; enums as MegatronEnum,
    `exit_signal` as the signal.Signals member it is)."""
    out: dict[str, Any] = {}
    for name, v in _mlm.DEFAULTS.items():
        if isinstance(v, dict):
            v = signal.Signals(v["value"]) if v["enum"] == "signal.Signals" else MegatronEnum(v["enum"], v["member"],
                                                                                               v["value"])
        elif isinstance(v, list):
            v = list(v)
        out[name] = v
    return out


def model_args(cfg: ModelConfig, layout: Layout, key_naming: str = "te", dtype: str | None = None) -> dict[str, Any]:
    """The Megatron-LM arguments this model and layout decide, by Megatron's names (the rest keep their defaults).
    MoE and MLA arguments are set only for models that have them."""
    dtype = dtype or cfg.params_dtype
    moe = cfg.is_moe
    bias = bool(cfg.add_proj_bias or cfg.add_mlp_bias)
    rope = cfg.rope_scaling or {}
    rope_type = rope.get("rope_type")
    a = dict(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.ffn_hidden_size,
        num_attention_heads=cfg.num_attention_heads, num_query_groups=cfg.num_query_groups,
        group_query_attention=cfg.num_query_groups != cfg.num_attention_heads, kv_channels=cfg.kv_channels,
        max_position_embeddings=cfg.max_position_embeddings, padded_vocab_size=cfg.padded_vocab_size(layout.tp),
        # the true vocabulary (Megatron-LM: "size of vocab before EOD or padding"), so the args alone describe it
        vocab_size=cfg.vocab_size, make_vocab_size_divisible_by=cfg.make_vocab_size_divisible_by,
        position_embedding_type="rope", use_rotary_position_embeddings=True, rotary_base=cfg.rotary_base,
        rotary_percent=1.0, rotary_interleaved=cfg.rotary_interleaved,
        normalization="RMSNorm", layernorm_epsilon=cfg.norm_epsilon, norm_epsilon=cfg.norm_epsilon, swiglu=True,
        apply_layernorm_1p=False, untie_embeddings_and_output_weights=not cfg.tie_word_embeddings,
        add_bias_linear=bias, disable_bias_linear=not bias, add_qkv_bias=cfg.add_qkv_bias,
        attention_dropout=0.0, hidden_dropout=0.0,
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        expert_model_parallel_size=layout.ep, expert_tensor_parallel_size=layout.expert_tp,
        mtp_num_layers=cfg.mtp_num_layers or None,
        bf16=dtype == "bfloat16", fp16=dtype == "float16",
        transformer_impl="transformer_engine" if key_naming == "te" else "local", ckpt_format="torch_dist",
    )
    if cfg.qk_layernorm:  # Megatron's default is off: set only when on (args pickled into every torch_dist save)
        a["qk_layernorm"] = True
    if rope_type == "llama3":
        a.update(use_rope_scaling=True, rope_scaling_factor=float(rope.get("factor", 8.0)))
    elif rope_type == "linear":  # positions divided by the factor
        a.update(rotary_seq_len_interpolation_factor=float(rope["factor"]))
    if moe:
        a.update(
            num_experts=cfg.num_moe_experts, moe_router_topk=cfg.moe_router_topk,
            moe_ffn_hidden_size=cfg.moe_ffn_hidden_size,
            moe_shared_expert_intermediate_size=cfg.moe_shared_expert_intermediate_size,
            moe_layer_freq=list(cfg.moe_layer_freq), moe_router_score_function=cfg.moe_router_score_function,
            moe_router_pre_softmax=cfg.moe_router_score_function == "softmax" and not cfg.moe_router_norm_topk,
            moe_router_topk_scaling_factor=cfg.moe_router_topk_scaling_factor,
            moe_router_num_groups=cfg.moe_router_num_groups, moe_router_group_topk=cfg.moe_router_group_topk,
            moe_router_enable_expert_bias=cfg.moe_router_enable_expert_bias, moe_aux_loss_coeff=cfg.moe_aux_loss_coeff,
            moe_grouped_gemm=False)
    if cfg.multi_latent_attention:
        a.update(multi_latent_attention=True, q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank,
                 qk_head_dim=cfg.qk_head_dim, qk_pos_emb_head_dim=cfg.qk_pos_emb_head_dim, v_head_dim=cfg.v_head_dim)
        if rope_type == "yarn":
            a.update(rope_type="yarn", rotary_scaling_factor=float(rope.get("factor", 1.0)),
                     mscale=float(rope.get("mscale", 1.0)), mscale_all_dim=float(rope.get("mscale_all_dim", 0.0)))
        else:
            a.update(rope_type="rope")
    return a


def split_args(split: PipelineSplit | None) -> dict:
    """Megatron-LM's arguments for an uneven pipeline split (their defaults when even)."""
    split = split or PipelineSplit()
    return dict(decoder_first_pipeline_num_layers=split.first, decoder_last_pipeline_num_layers=split.last,
                account_for_embedding_in_pipeline_split=split.embedding,
                account_for_loss_in_pipeline_split=split.loss, pipeline_model_parallel_layout=split.layout)


def megatron_args(cfg: ModelConfig, layout: Layout, key_naming: str = "te", dtype: str | None = None
                  ) -> argparse.Namespace:
    """The complete Megatron-LM argument namespace for this model and layout: every argument Megatron-LM's parser
    defines, at its default unless the model or layout decides it (model_args), plus the attributes Megatron-LM's
    validate_args() and trainer derive that readers look for (params_dtype, data_parallel_size,
    virtual_pipeline_model_parallel_size, use_dist_ckpt, consumed samples). Readers that expect a Megatron-LM checkpoint
    (Megatron-Bridge builds its TransformerConfig from every field the namespace has) find every attribute."""
    dtype = dtype or cfg.params_dtype
    a = megatron_lm_defaults()
    a.update(model_args(cfg, layout, key_naming, dtype))
    a.update(
        virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp > 1 else None,
        num_layers_per_virtual_pipeline_stage=(layout.chunk_layers(cfg.num_layers)[0]
                                               if layout.vpp > 1 and layout.split is None else None),
        **split_args(layout.split),
        world_size=world_size(layout), data_parallel_size=rank_sizes(layout)["dp"],
        params_dtype=TorchDtype(dtype), use_dist_ckpt=True, data_parallel_random_init=False,
        consumed_train_samples=0, skipped_train_samples=0, consumed_valid_samples=0,
        # no RNG state is written, nor optimizer state for a weights-only checkpoint (megatron_common clears
        # no_save_optim when there is): Megatron-LM must not try to restore them
        no_save_optim=True, no_save_rng=True,
        **NEWEST_ARGS,
    )
    return argparse.Namespace(**a)


# What makes the 0.16.1 namespace valid for megatron-core 0.17-0.19 and Megatron-Bridge 0.6 as well (the fields their
# readers turn into a TransformerConfig / tokenizer), each as Megatron-LM 0.19.2's own training save writes it:
# - the per-backend MoE SM counts are deprecated in 0.19: set (0.16's defaults 20 and 16) they are routed into
#   moe_flex_dispatcher_num_sms and, differing, raise "Conflicting deprecated SM-count knobs"; None is each backend's
#   default in both lines;
# - a tokenizer that needs no files and whose size is args.vocab_size (the true vocabulary): what Megatron-LM's
#   readers (and Bridge's MLM path) build the tokenizer from, and pad to padded_vocab_size again.
NEWEST_ARGS = {"moe_deepep_num_sms": None, "moe_hybridep_num_sms": None, "moe_flex_dispatcher_num_sms": None,
               "tokenizer_type": "NullTokenizer"}

# The common-state layout of a torch_dist checkpoint, by the megatron-core line that writes it (`--megatron-version`):
# "0.16" keeps it in common.pt, which megatron-core 0.13-0.16 need and 0.17-0.19 and Megatron-Bridge 0.6 still load
# (0.19: "load_common is deprecated"), so it is the default: the one file every line reads. "0.19" writes it as
# megatron-core >= 0.17 does, the DCP item `common_state/shard_0_1` (no common.pt), which 0.16 cannot load.
MEGATRON_VERSIONS = ("0.16", "0.19")
DEFAULT_MEGATRON_VERSION = "0.16"


def check_megatron_version(version: str) -> str:
    if version not in MEGATRON_VERSIONS:
        raise ShardkitError(f"--megatron-version {version!r}: use 0.16 (common.pt: megatron-core 0.13-0.19 and "
                            "Megatron-Bridge 0.6 load it; the default) or 0.19 (the common state inside the DCP "
                            "files, as megatron-core >= 0.17 writes it; 0.16 cannot load it)")
    return version


def megatron_common(cfg: ModelConfig, layout: Layout, key_naming: str, dtype: str | None, iteration: int, *,
                    optimizer: bool = False, param_groups: list[dict] | None = None, scheduler: Any = None,
                    consumed_samples: int | None = None, train_state: str | None = None,
                    training_args: Mapping[str, Any] | None = None) -> dict:
    """Megatron-LM's common state of a torch_dist checkpoint (common.pt, or megatron-core >= 0.17's common-state
    item): iteration, checkpoint_version, the whole args namespace (megatron_args, with `training_args` set on it and
    the consumed samples), content_metadata; with optimizer state its `optimizer` entry (the param groups where known)
    and `opt_param_scheduler` where `scheduler` is in Megatron's own form; `train_state` (shardkit's
    train_state.json, its text) rides along verbatim. The one builder for the export and the trainer's save."""
    args = megatron_args(cfg, layout, key_naming, dtype)
    for k, v in (training_args or {}).items():
        setattr(args, k, v)
    common: dict = {"iteration": iteration, "checkpoint_version": CHECKPOINT_VERSION,
                    "num_floating_point_operations_so_far": 0,
                    "content_metadata": megatron_content_metadata(optimizer)}
    if train_state is not None:
        common[TRAIN_STATE_KEY] = train_state
    if optimizer:
        args.no_save_optim = None  # Megatron-LM restores the optimizer state from this checkpoint
        common["optimizer"] = (megatron_optimizer_common(param_groups) if param_groups is not None
                               else {"param_state_sharding_type": MEGATRON_OPTIM_SHARDING})  # no groups known
    if is_scheduler_state(scheduler):  # an older shardkit's own form
        common["opt_param_scheduler"] = scheduler  # is not Megatron's and would break its load: left out
    if isinstance(consumed_samples, int) and not isinstance(consumed_samples, bool):
        args.consumed_train_samples = consumed_samples
    common["args"] = args
    return common


# -- Megatron-LM args: read --------------------------------------------------------------------------------------------

def arg(args: Any, name: str, default: Any = None) -> Any:
    """`args.<name>`, or `default` when the args (or the attribute) are missing or None."""
    v = getattr(args, name, None) if args is not None else None
    return default if v is None else v


def int_arg(args: Any, name: str, label: str) -> int | None:
    """A positive integer argument, or None when absent; FormatError naming `label` for anything else."""
    v = arg(args, name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise FormatError(f"{label}: args.{name}={v!r} is not a positive integer")
    return v


def layout_from_args(args: argparse.Namespace | None) -> Layout | None:
    """The layout a checkpoint was saved with, from its Megatron-LM args (None if absent or odd)."""
    if args is None:
        return None
    try:
        tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
        pp = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
        vpp = int(getattr(args, "virtual_pipeline_model_parallel_size", None) or 1)
        ep = int(getattr(args, "expert_model_parallel_size", 1) or 1)
        etp = getattr(args, "expert_tensor_parallel_size", None)
        etp = int(etp) if etp is not None and int(etp) != tp else None
        return Layout(tp=tp, pp=pp, vpp=vpp, ep=ep, etp=etp, split=PipelineSplit.from_args(args))
    except (TypeError, ValueError, ShardkitError):
        return None


def with_args_vocab(cfg: ModelConfig, args: Any, tp: int, label: str, origin: str = "the model config"
                    ) -> ModelConfig:
    """`cfg` with the args' make_vocab_size_divisible_by; ConfigError if the args' padded_vocab_size (or their true
    vocab_size, where they have one) disagrees. `origin` names where `cfg` came from, for the message."""
    div = arg(args, "make_vocab_size_divisible_by")
    if isinstance(div, int) and not isinstance(div, bool) and div > 0 and div != cfg.make_vocab_size_divisible_by:
        cfg = dataclasses.replace(cfg, make_vocab_size_divisible_by=div)
    true = arg(args, "vocab_size")
    if isinstance(true, int) and not isinstance(true, bool) and true != cfg.vocab_size:
        raise ConfigError(f"{label}: args say vocab_size={true}, but {origin} has vocab_size={cfg.vocab_size}; is it "
                          "the model config of this checkpoint?")
    padded = arg(args, "padded_vocab_size")
    if isinstance(padded, int) and padded != cfg.padded_vocab_size(tp):
        raise ConfigError(f"{label}: args say padded_vocab_size={padded}, but {origin}'s vocab_size "
                          f"{cfg.vocab_size} pads to {cfg.padded_vocab_size(tp)} at tp={tp} "
                          f"(make_vocab_size_divisible_by={cfg.make_vocab_size_divisible_by}); is it the model config "
                          "of this checkpoint?")
    return cfg


def check_args(args: Any, cfg: ModelConfig, label: str, origin: str = "the model config") -> None:
    """ConfigError naming `label`, the argument and both values where Megatron-LM args contradict the model config
    (`origin` names where it came from: --hf-config DIR, shardkit.json, ...)."""
    if args is None:
        return
    pairs: list[tuple[str, Any]] = [("num_layers", cfg.num_layers), ("hidden_size", cfg.hidden_size),
                                    ("num_attention_heads", cfg.num_attention_heads)]
    if not cfg.multi_latent_attention:
        pairs.append(("kv_channels", cfg.kv_channels))
        if arg(args, "group_query_attention"):
            pairs.append(("num_query_groups", cfg.num_query_groups))
    pairs.append(("num_experts", cfg.num_moe_experts))
    if cfg.is_moe:
        pairs.append(("moe_router_topk", cfg.moe_router_topk))
        if arg(args, "moe_ffn_hidden_size") is not None:
            pairs.append(("moe_ffn_hidden_size", cfg.moe_ffn_hidden_size))
    else:  # an MoE model's ffn_hidden_size is its dense layers' (which Megatron sets even where there are none)
        pairs.append(("ffn_hidden_size", cfg.ffn_hidden_size))
    untie = arg(args, "untie_embeddings_and_output_weights")
    if untie is not None and bool(untie) == cfg.tie_word_embeddings:
        raise ConfigError(f"{label}: args say untie_embeddings_and_output_weights={untie}, but {origin} has "
                          f"tie_word_embeddings={cfg.tie_word_embeddings}; is it the model config of this checkpoint?")
    for name, want in pairs:
        got = arg(args, name)
        if got is not None and got != want:
            raise ConfigError(f"{label}: args say {name}={got!r}, but {origin} has {want!r}; is it the model config "
                              "of this checkpoint?")
    floats = [("rotary_base", cfg.rotary_base),
              ("norm_epsilon" if arg(args, "norm_epsilon") is not None else "layernorm_epsilon", cfg.norm_epsilon)]
    for name, want in floats:
        got = arg(args, name)
        if isinstance(got, (int, float)) and not isinstance(got, bool) and not math.isclose(got, want, rel_tol=1e-6):
            raise ConfigError(f"{label}: args say {name}={got!r}, but {origin} has {want!r}; is it the model config "
                              "of this checkpoint?")


def hf_model_type_of(args: Any) -> str:
    """The HF family config_from_megatron_args should read Megatron-LM args as (each family says which args are its
    own: checkpoint/families; Mixtral's with experts, Qwen2's with a QKV bias alone, else Llama's)."""
    from .families import megatron_family

    return megatron_family(lambda name, default=None: arg(args, name, default)).model_type


def missing_model_args(args: Any, vocab_size: int | None = None) -> list[str]:
    """The arguments config_from_megatron_args needs that `args` lacks (absent or None), by Megatron's names; with
    "vocab_size" (the true vocabulary, which Megatron-LM's args rarely carry: they hold padded_vocab_size) unless
    `vocab_size` is given."""
    experts = arg(args, "num_experts") or arg(args, "num_moe_experts")
    need: list[tuple[str, ...]] = [("num_layers",), ("hidden_size",), ("num_attention_heads",),
                                   ("moe_ffn_hidden_size", "ffn_hidden_size") if experts else ("ffn_hidden_size",),
                                   ("max_position_embeddings", "seq_length")]
    if experts:
        need.append(("moe_router_topk",))
    if vocab_size is None:
        need.append(("vocab_size",))
    return [names[0] for names in need if all(arg(args, n) is None for n in names)]


# by the dtype's name (args.params_dtype is a torch.dtype): no torch import, so the converters stay torch-free
_DTYPES = {"torch.float32": "float32", "torch.bfloat16": "bfloat16", "torch.float16": "float16"}
MEGATRON_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def config_from_megatron_args(args: argparse.Namespace, hf_model_type: str = "llama", *,
                              vocab_size: int | None = None) -> ModelConfig:
    """The model config of a Megatron-LM run from its `args` (dense LLaMA / Mistral / Qwen2-style, or Mixtral-style
    MoE; `hf_model_type` "llama" becomes "mixtral" when the args have experts). Megatron's args usually carry only
    the padded vocabulary size: pass the true `vocab_size` (tokenizer / HF config) unless `args.vocab_size` is set.
    Raises ConfigError naming the argument for anything the HF families cannot express."""
    if not isinstance(args, argparse.Namespace):
        raise ConfigError(f"Megatron args must be an argparse.Namespace, got {type(args).__name__}")
    src = "Megatron args"

    def get(name: str, default: Any = None) -> Any:
        return arg(args, name, default)

    def refuse(cond: bool, name: str, why: str) -> None:
        if cond:
            raise ConfigError(f"{src}: {name}={get(name)!r}: {why}")

    from .families import family_of, megatron_family, megatron_model_types

    experts = get("num_experts") or get("num_moe_experts")
    if hf_model_type not in megatron_model_types():
        raise ConfigError(f"{src}: hf_model_type {hf_model_type!r} is not supported here "
                          f"({', '.join(megatron_model_types())}); for DeepSeek pass the model config from its HF "
                          "config.json")
    fam = family_of(hf_model_type, src)
    if (experts or get("qk_layernorm")) and hf_model_type == "llama":  # the default: the family the args describe
        fam = megatron_family(get)
    mt = fam.model_type
    refuse(bool(get("multi_latent_attention")), "multi_latent_attention",
           "pass the model config from the HF config.json (DeepSeek)")
    refuse(get("normalization", "LayerNorm") != "RMSNorm", "normalization", "only RMSNorm is supported")
    refuse(not get("swiglu", False), "swiglu", "only SwiGLU MLPs are supported")
    refuse(bool(get("apply_layernorm_1p")), "apply_layernorm_1p", "zero-centred norms are not supported")
    refuse(bool(get("qk_layernorm")) and not fam.qk_layernorm, "qk_layernorm", f"{mt} has no QK norms")
    refuse(get("position_embedding_type", "rope") != "rope", "position_embedding_type", "only rope is supported")
    refuse(get("rotary_percent", 1.0) != 1.0, "rotary_percent", "partial rotary embeddings are not supported")
    refuse(bool(get("rotary_interleaved")), "rotary_interleaved", "interleaved RoPE is not supported for " + mt)
    refuse(bool(get("mtp_num_layers")), "mtp_num_layers", "multi-token prediction is not supported for " + mt)
    refuse(get("window_size") is not None, "window_size", "sliding-window attention: pass the model config from "
                                                          "the HF config.json")

    def integer(name: str, *alts: str) -> int:
        for n in (name, *alts):
            v = get(n)
            if v is not None:
                if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                    raise ConfigError(f"{src}: {n}={v!r} is not a positive integer")
                return v
        raise ConfigError(f"{src}: missing {name}")

    layers, hidden, heads = integer("num_layers"), integer("hidden_size"), integer("num_attention_heads")
    groups = integer("num_query_groups") if get("group_query_attention") or (
        get("group_query_attention") is None and get("num_query_groups")) else heads
    head_dim = get("kv_channels") or (hidden // heads if hidden % heads == 0 else None)
    if head_dim is None:
        raise ConfigError(f"{src}: kv_channels is missing and hidden_size {hidden} is not divisible by "
                          f"num_attention_heads {heads}")
    vocab = vocab_size if vocab_size is not None else get("vocab_size")
    if vocab is None:
        raise ConfigError(f"{src}: the true vocabulary size is unknown (args hold only padded_vocab_size="
                          f"{get('padded_vocab_size')}); pass vocab_size (from the tokenizer or the HF config.json)")
    eps = get("norm_epsilon", get("layernorm_epsilon", 1e-5))
    dtype = _DTYPES.get(str(get("params_dtype"))) or ("bfloat16" if get("bf16") else "float16" if get("fp16") else "float32")
    hf: dict[str, Any] = dict(
        model_type=mt, vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=groups, head_dim=head_dim,
        max_position_embeddings=integer("max_position_embeddings", "seq_length"), rms_norm_eps=float(eps),
        rope_theta=float(get("rotary_base", 10000)), hidden_act="silu",
        tie_word_embeddings=not get("untie_embeddings_and_output_weights", False), torch_dtype=dtype)
    interp = get("rotary_seq_len_interpolation_factor")
    if get("use_rope_scaling") and interp:
        raise ConfigError(f"{src}: use_rope_scaling and rotary_seq_len_interpolation_factor are both set")
    if get("use_rope_scaling"):  # Megatron's llama3 scaling (RotaryEmbedding._apply_scaling defaults)
        hf["rope_scaling"] = {"rope_type": "llama3", "factor": float(get("rope_scaling_factor", 8.0)),
                              **MEGATRON_LLAMA3_ROPE}
    elif interp:  # positions divided by the factor = linear scaling
        hf["rope_scaling"] = {"rope_type": "linear", "factor": float(interp)}
    fam.megatron_to_hf(get, refuse, integer, hf)
    cfg = ModelConfig.from_hf(hf, source=src)
    div = get("make_vocab_size_divisible_by")
    if isinstance(div, int) and not isinstance(div, bool) and div > 0:
        cfg = dataclasses.replace(cfg, make_vocab_size_divisible_by=div)
    padded, tp = get("padded_vocab_size"), get("tensor_model_parallel_size", 1)
    if isinstance(padded, int) and isinstance(tp, int) and padded != cfg.padded_vocab_size(tp):
        raise ConfigError(f"{src}: vocab_size {vocab} pads to {cfg.padded_vocab_size(tp)} at tp={tp} "
                          f"(make_vocab_size_divisible_by={cfg.make_vocab_size_divisible_by}), but the args say "
                          f"padded_vocab_size={padded}; is vocab_size right?")
    return cfg


# -- rank order --------------------------------------------------------------------------------------------------------

# megatron-core's default order "tp-cp-ep-dp-pp" (parallel_state.initialize_model_parallel(order=...)), fastest first.
# Its two rank generators read it as: dense groups tp-cp-dp-pp (ep = 1), expert groups etp-ep-edp-pp (cp folded into
# the expert data-parallel size), over the same ranks.
RANK_ORDER = ("tp", "cp", "ep", "dp", "pp")
DENSE_ORDER = ("tp", "cp", "dp", "pp")
EXPERT_ORDER = ("etp", "ep", "edp", "pp")


def rank_of(sizes: Mapping[str, int], order: Sequence[str] = DENSE_ORDER, **coords: int) -> int:
    """The global rank at `coords` (missing ones 0), the first dimension of `order` fastest."""
    rank, stride = 0, 1
    for d in order:
        rank += coords.get(d, 0) * stride
        stride *= sizes[d]
    return rank


def coords_of(rank: int, sizes: Mapping[str, int], order: Sequence[str] = DENSE_ORDER) -> dict[str, int]:
    """The inverse of rank_of."""
    out = {}
    for d in order:
        rank, out[d] = divmod(rank, sizes[d])
    return out


def span(dim: str, sizes: Mapping[str, int], order: Sequence[str] = DENSE_ORDER) -> int:
    """How many consecutive ranks one group of `dim` spreads over: the product of the sizes up to and including
    `dim` (a TP group is TP consecutive ranks, a DP group reaches over TP x CP x DP, a PP group over the world)."""
    n = 1
    for d in order:
        n *= sizes[d]
        if d == dim:
            return n
    raise ValueError(f"{dim!r} is not in the rank order {order}")


def stage_size(layout: Layout) -> int:
    """Ranks per pipeline stage of the smallest world for `layout`: enough for TP x DP to hold the expert grid ETP x EP
    (the dense and expert orders number the same stage)."""
    return math.lcm(layout.tp, layout.expert_tp * layout.ep)


def rank_sizes(layout: Layout, expert: bool = False) -> dict[str, int]:
    """The sizes of the dense (or expert) order's dimensions in the smallest world that runs `layout` (no CP)."""
    stage = stage_size(layout)
    if expert:
        return {"etp": layout.expert_tp, "ep": layout.ep, "edp": stage // (layout.expert_tp * layout.ep),
                "pp": layout.pp}
    return {"tp": layout.tp, "cp": 1, "dp": stage // layout.tp, "pp": layout.pp}


def world_size(layout: Layout) -> int:
    """The smallest world size that runs `layout`."""
    return span("pp", rank_sizes(layout))


# -- torch_dist: keys of tensors and optimizer state, the common.pt entries, which rank writes what ------------------

SKIPPED_PREFIXES = ("optimizer.", "rng_state", "rerun_state_machine")


# megatron-core's distributed optimizer (`fully_reshardable`, the model-space format megatron-core 0.16 can load) names
# the fp32 main parameters `param`; its `fully_sharded_model_space` and the non-distributed mixed-precision optimizer
# name them `fp32_param`, as shardkit does. We write `param` and read either.
MEGATRON_OPTIM_STATE = {"fp32_param": "param", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
MEGATRON_OPTIM_SHARDING = "fully_reshardable"


def megatron_content_metadata(optimizer: bool) -> dict:
    """common.pt's `content_metadata`: what Megatron-LM's _build_sharded_state_dict_metadata records (megatron-core
    >= 0.14) and its loaders build their sharded state dicts from; without `chained_optim_avoid_prefix` a MoE model's
    ChainedOptimizer looks for `chained_N.` keys. The optimizer's sharding type where optimizer state is stored."""
    meta = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    if optimizer:
        meta["distrib_optim_sharding_type"] = MEGATRON_OPTIM_SHARDING
    return meta
TRAIN_STATE_KEY = "shardkit_train_state"  # common.pt: train_state.json carried verbatim as a string


def stored_key(name: str, key_naming: str) -> str:
    """The torch_dist key of canonical tensor `name` (or of its optimizer state) under a layer-spec naming."""
    opt = split_optimizer_key(name)
    if opt is not None:
        return f"optimizer.state.{MEGATRON_OPTIM_STATE[opt[0]]}.{stored_key(opt[1], key_naming)}"
    return sharded_key(name, key_naming)


def source_keys(name: str) -> list[str]:
    """torch_dist keys accepted for canonical tensor `name`: TE naming first, then the local spec's; for optimizer
    state, Megatron's `param` and `fp32_param` spellings of the fp32 main parameters.

    Experts need no second spelling: megatron-core's SequentialMLP (local spec: module keys
    `mlp.experts.local_experts.E.linear_fc1.weight`), its grouped-GEMM GroupedMLP (`mlp.experts.weight1`, every local
    expert in one tensor) and TEGroupedMLP (`mlp.experts.linear_fc1.weightE`) all save the one sharded key
    `decoder.layers.mlp.experts.experts.linear_fc1.weight` (linear_fc2 alike) with a [layer, expert] prefix, unless
    `singleton_local_shards` (Megatron-LM writes False); tests/test_train_torch_dist.py checks the first two against
    megatron-core. The per-expert module keys occur only in `--ckpt-format torch` rank files, which
    convert/megatron_legacy.py reads."""
    opt = split_optimizer_key(name)
    if opt is not None:
        state, model = opt
        spellings = ["param", "fp32_param"] if state == "fp32_param" else [state]
        return [f"optimizer.state.{sp}.{k}" for k in source_keys(model) for sp in spellings]
    keys = [name]
    local = stored_key(name, "local")
    if local != name:
        keys.append(local)
    return keys


# -- Megatron rank numbering ------------------------------------------------------------------------------------------

def chunk_rank(spec: TensorSpec, layout: Layout, box: tuple[tuple[int, int], ...], num_layers: int) -> int:
    """The (data-parallel rank 0) Megatron rank whose shard (its primary regions in the sharding table) holds the
    first element of a box of `spec` (a stored chunk, or a whole layer's box for its TP rank 0 object)."""
    for region, rank in shard_owners(spec, layout, num_layers):
        if all(o <= a < o + s for (a, _), o, s in zip(box, region.global_offset, region.shape)):
            return rank
    raise ShardkitError(f"internal: tensor {spec.name}: box {list(box)} starts in no rank's shard")


@functools.lru_cache(maxsize=64)
def shard_owners(spec: TensorSpec, layout: Layout, num_layers: int) -> list[tuple[Region, int]]:
    """Every primary region of `spec` with the Megatron rank that owns it (TP fastest, then EP, then PP)."""
    out = []
    for c in layout.ranks(expert=spec.expert):
        if spec.expert:
            rank = rank_of(rank_sizes(layout, expert=True), EXPERT_ORDER, etp=c.etp, ep=c.ep, pp=c.pp)
        else:
            rank = rank_of(rank_sizes(layout), DENSE_ORDER, tp=c.tp, pp=c.pp)
        out += [(r, rank) for r in regions(spec, layout, c, num_layers) if r.primary]
    return out


def extra_state_objects(spec: TensorSpec, layout: Layout, num_layers: int) -> list[tuple[str, int]]:
    """The `<module>._extra_state/shard_<offsets>_<shape>` objects megatron-core's GPTModel has for the linear layer
    whose weight is `spec` (one per layer, and per expert), with the rank that writes each (TP rank 0)."""
    if not spec.name.endswith(".weight"):
        return []
    module = spec.name[: -len("weight")]
    last = module.rstrip(".").rsplit(".", 1)[-1]
    if not (last.startswith("linear_") or last == "eh_proj"):
        return []
    axes = spec.shape[: spec.lead]
    if not axes:
        axes = (1,)  # megatron-core: an object outside any stack gets offset (0,) of shape (1,)
    out = []
    for idx in itertools.product(*[range(n) for n in axes]):
        key = f"{module}_extra_state/shard_{'.'.join(map(str, idx))}_{'.'.join(map(str, axes))}"
        box = [(i, i + 1) for i in idx] if spec.lead else []
        box += [(0, s) for s in spec.shape[spec.lead:]]
        out.append((key, chunk_rank(spec, layout, tuple(box), num_layers)))
    return out


def megatron_optimizer_common(param_groups: list[dict]) -> dict:
    """common.pt's `optimizer` entry: megatron-core's DistributedOptimizer state_dict() (its param groups; the state
    lives in the `optimizer.state.*` items), or, with expert groups, its ChainedOptimizer's {0: dense, 1: expert}
    (a MoE model gets a second distributed optimizer over the expert-data-parallel group)."""
    def one(groups: list[dict]) -> dict:
        return {"param_state_sharding_type": MEGATRON_OPTIM_SHARDING, "optimizer": {"param_groups": groups}}

    dense = [g for g in param_groups if not g.get("is_expert_parallel")]
    expert = [g for g in param_groups if g.get("is_expert_parallel")]
    return {0: one(dense), 1: one(expert)} if expert else one(dense)


def megatron_optimizer_groups(entry: Any) -> list | None:
    """The param groups of common.pt's `optimizer` entry, either form megatron_optimizer_common writes (None when
    there are none)."""
    if not isinstance(entry, dict):
        return None
    parts = [entry[k] for k in sorted(entry) if isinstance(k, int)] if 0 in entry else [entry]
    groups = [(p.get("optimizer") or {}).get("param_groups") if isinstance(p, dict) else None for p in parts]
    if any(not isinstance(g, list) for g in groups):
        return None
    return [g for gs in groups for g in gs]


# OptimizerParamScheduler.state_dict()'s keys (megatron-core 0.16): what Megatron-LM's load reads back
MEGATRON_SCHEDULER_KEYS = frozenset({"max_lr", "lr_warmup_steps", "num_steps", "lr_decay_style", "lr_decay_steps",
                                     "min_lr", "start_wd", "end_wd", "wd_incr_style", "wd_incr_steps"})


def is_scheduler_state(sd: object) -> bool:
    """Whether `sd` is an OptimizerParamScheduler.state_dict() (shardkit before this format saved another dict)."""
    return isinstance(sd, dict) and MEGATRON_SCHEDULER_KEYS <= set(sd)


__all__ = ["TRACKER", "CHECKPOINT_VERSION", "RELEASE", "iter_dirname", "iteration_of", "LOCAL_NAMES", "KEY_NAMINGS",
           "canonical_candidates", "sharded_key", "megatron_args", "arg", "int_arg", "layout_from_args",
           "with_args_vocab", "check_args", "config_from_megatron_args", "hf_model_type_of", "missing_model_args",
           "MEGATRON_LM_SOURCE", "MegatronEnum", "TorchDtype", "megatron_lm_defaults", "model_args",
           "MEGATRON_LLAMA3_ROPE", "RANK_ORDER",
           "DENSE_ORDER", "EXPERT_ORDER", "rank_of", "coords_of", "span", "stage_size", "rank_sizes", "world_size",
           "SKIPPED_PREFIXES", "MEGATRON_OPTIM_STATE", "MEGATRON_OPTIM_SHARDING", "TRAIN_STATE_KEY",
           "MEGATRON_SCHEDULER_KEYS", "is_scheduler_state", "megatron_content_metadata", "megatron_optimizer_common", "megatron_optimizer_groups", "stored_key", "source_keys", "chunk_rank", "shard_owners", "extra_state_objects"]
