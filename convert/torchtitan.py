"""torchtitan DCP checkpoints <-> native shardkit checkpoints (Llama 3, DeepSeek-V3), streaming, bounded in memory.

torchtitan saves `<folder>/step-N/` with DCP's `.metadata` and `__<rank>_0.distcp` files; the model's entries are its
own state-dict names (flattened to the top level of the DCP state dict, as its CheckpointManager saves them):

    tok_embeddings.weight, norm.weight, lm_head.weight (0.3; `output.weight` before),
    layers.N.attention.qkv_linear.wq|wk|wv.weight (0.3; `layers.N.attention.wq|wk|wv.weight` before),
    layers.N.attention.wo.weight, layers.N.feed_forward.w1|w2|w3.weight, layers.N.attention_norm|ffn_norm.weight

A full training checkpoint adds optimizer, lr_scheduler, dataloader and train_state entries. With `optimizer`, the
AdamW moments (`optimizer.state.<param>.exp_avg|exp_avg_sq|step`; 0.3 keys the attention's by the fused
`qkv_linear.wqkv` parameter; DeepSeek-V3's routed experts by the stacked parameter) become the native optimizer state,
and train_state (step, ntokens_seen), lr_scheduler (last_epoch) and the AdamW param_groups (plain values, read by
torch.load(weights_only=True)) are carried in train_state.json; the dataloader's state is left, and a note says so.
mcore-to-torchtitan --optimizer writes that full checkpoint back (torchtitan's CheckpointManager loads it with
exclude_from_loading = ["dataloader"]).

torchtitan is also `reshard`'s source (a DCP folder under torchtitan's names: is_torchtitan / reshard_torchtitan) and
`verify --against-torchtitan`'s reference (verify_against_torchtitan: every weight through the same mapping).

Q/K rows. torchtitan applies RoPE to adjacent pairs (its ComplexRoPE: `view_as_complex` of (x[2i], x[2i+1])), so
its wq/wk rows are in Meta's interleaved layout; HF (and Megatron-Core's default, non-interleaved RoPE, which our
layout follows) rotate the two halves of each head. Its own HF adapter (Llama3StateDictAdapter._permute) moves row
2i+a of a head to row a*head_dim/2 + i; `hf_row_source` is that permutation, applied to the rows a chunk reads.

The model's tensors are presented under their HF names (TorchtitanSource, read through checkpoint.torch_dist's DCP
reader: `.metadata` by its restricted unpickler - DCP's own FileSystemReader.read_metadata is a bare pickle.load -,
items as numpy views of the mapped `.distcp` files), so the llama family's one mapping table, hf_to_mcore's plan and
chunk worker and the one write/commit path do the rest; mcore-to-torchtitan runs mcore_to_hf's export plan and
writes DCP items with checkpoint.torch_dist_write.DCPWriter, one tensor at a time.

The model config: a torchtitan flavour read from torchtitan's own registry (`--model-flavor 8B`, model
`--model-name llama3`; or torchtitan's job config TOML, its [model] name and flavor), or an HF config.json
(`--hf-config`).
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from checkpoint.config import ModelConfig
from checkpoint.errors import ConfigError, FormatError, ShardkitError
from checkpoint.layout import Layout

STEP_RE = re.compile(r"^step-(\d+)$")

# HF name template -> torchtitan name template, per torchtitan generation ({} = layer)
_SHARED = {  # Llama 3's and DeepSeek-V3's alike
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.layers.{}.self_attn.o_proj.weight": "layers.{}.attention.wo.weight",
    "model.layers.{}.mlp.gate_proj.weight": "layers.{}.feed_forward.w1.weight",
    "model.layers.{}.mlp.up_proj.weight": "layers.{}.feed_forward.w3.weight",
    "model.layers.{}.mlp.down_proj.weight": "layers.{}.feed_forward.w2.weight",
    "model.layers.{}.input_layernorm.weight": "layers.{}.attention_norm.weight",
    "model.layers.{}.post_attention_layernorm.weight": "layers.{}.ffn_norm.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
}
NAMES_03 = {
    **_SHARED,
    "model.layers.{}.self_attn.q_proj.weight": "layers.{}.attention.qkv_linear.wq.weight",
    "model.layers.{}.self_attn.k_proj.weight": "layers.{}.attention.qkv_linear.wk.weight",
    "model.layers.{}.self_attn.v_proj.weight": "layers.{}.attention.qkv_linear.wv.weight",
}
NAMES_02 = {**{k: v.replace("attention.qkv_linear.", "attention.") for k, v in NAMES_03.items()},
            "lm_head.weight": "output.weight"}
GENERATIONS = {"0.3": NAMES_03, "0.1-0.2": NAMES_02}
# DeepSeek-V3 (torchtitan 0.3, its DeepSeekV3StateDictAdapter's names): MLA, routed experts stacked in one tensor per
# layer (w1_EFD / w3_EFD [E, F, D], w2_EDF [E, D, F]: HF expert e's gate/up/down is [e]), MTP layer i as
# `mtp_layers.i.` (HF `model.layers.{num_layers + i}.`); no RoPE row permutation (both keep DeepSeek's layout)
NAMES_DSV3 = {
    **_SHARED,
    "model.layers.{}.self_attn.q_proj.weight": "layers.{}.attention.wq.weight",
    "model.layers.{}.self_attn.q_a_proj.weight": "layers.{}.attention.wq_a.weight",
    "model.layers.{}.self_attn.q_a_layernorm.weight": "layers.{}.attention.q_norm.weight",
    "model.layers.{}.self_attn.q_b_proj.weight": "layers.{}.attention.wq_b.weight",
    "model.layers.{}.self_attn.kv_a_proj_with_mqa.weight": "layers.{}.attention.wkv_a.weight",
    "model.layers.{}.self_attn.kv_a_layernorm.weight": "layers.{}.attention.kv_norm.weight",
    "model.layers.{}.self_attn.kv_b_proj.weight": "layers.{}.attention.wkv_b.weight",
    "model.layers.{}.mlp.gate.weight": "layers.{}.moe.router.gate.weight",
    "model.layers.{}.mlp.gate.e_score_correction_bias": "layers.{}.moe.expert_bias_E",
    "model.layers.{}.mlp.shared_experts.gate_proj.weight": "layers.{}.moe.shared_experts.w1.weight",
    "model.layers.{}.mlp.shared_experts.up_proj.weight": "layers.{}.moe.shared_experts.w3.weight",
    "model.layers.{}.mlp.shared_experts.down_proj.weight": "layers.{}.moe.shared_experts.w2.weight",
    "model.layers.{}.enorm.weight": "layers.{}.enorm.weight",
    "model.layers.{}.hnorm.weight": "layers.{}.hnorm.weight",
    "model.layers.{}.eh_proj.weight": "layers.{}.eh_proj.weight",
    "model.layers.{}.shared_head.norm.weight": "layers.{}.mtp_norm.weight",
}
DSV3_EXPERTS = {"layers.{}.moe.routed_experts.inner_experts.w1_EFD": "gate_proj",
                "layers.{}.moe.routed_experts.inner_experts.w3_EFD": "up_proj",
                "layers.{}.moe.routed_experts.inner_experts.w2_EDF": "down_proj"}
# top-level entries of a full training checkpoint that are not model weights (CheckpointManager's states)
TRAINING_PREFIXES = ("optimizer", "lr_scheduler", "dataloader", "train_state")
ROPE_PERMUTED = ("q_proj", "k_proj")  # HF tensors whose rows torchtitan keeps in the interleaved RoPE layout


def _template(name: str) -> tuple[str, int | None]:
    m = re.search(r"\.(\d+)\.", name)
    return (name, None) if m is None else (name[:m.start()] + ".{}." + name[m.end():], int(m.group(1)))


def hf_row_source(head_dim: int) -> np.ndarray:
    """For each HF (half-split) row of one head, the torchtitan (interleaved) row it comes from."""
    j = np.arange(head_dim)
    half = head_dim // 2
    return 2 * (j % half) + j // half


# -- the model config -------------------------------------------------------------------------------------------------

def _registry_config(name: str, flavor: str):
    """torchtitan's own model config of a flavour (0.3: `<name>_configs[flavor](attn_backend=...)`; before:
    `<name>_args[flavor]`)."""
    import importlib

    try:
        mod = importlib.import_module(f"torchtitan.models.{name}")
    except Exception as e:  # noqa: BLE001 - not installed, or its GPU-only imports (triton) missing
        raise ConfigError(f"--model-flavor {flavor}: torchtitan's model registry is not importable here "
                          f"(torchtitan.models.{name}: {type(e).__name__}: {e}); pass --hf-config HF_DIR (a "
                          "config.json describing the model) instead") from None
    configs = getattr(mod, f"{name.replace('_', '')}_configs", None)  # llama3_configs, deepseekv3_configs
    if configs is not None:
        if flavor not in configs:
            raise ConfigError(f"--model-flavor {flavor}: torchtitan's {name} has no such flavour; it has "
                              f"{', '.join(configs)}")
        if name == "deepseek_v3":  # (the MoE token exchange does not change the weights)
            return configs[flavor](attn_backend="flex", moe_comm_backend="standard")
        return configs[flavor](attn_backend="flex")
    args = getattr(mod, f"{name}_args", None)
    if args is None or flavor not in args:
        raise ConfigError(f"--model-flavor {flavor}: torchtitan's {name} has no such flavour"
                          + (f"; it has {', '.join(args)}" if args else ""))
    return args[flavor]


def _rope_scaling(rope) -> dict | None:
    scaling = getattr(rope, "scaling", None)
    if scaling in (None, "none"):
        return None
    if scaling != "llama":
        raise ConfigError(f"torchtitan RoPE scaling {scaling!r} has no HF/Megatron counterpart here (llama only)")
    return {"rope_type": "llama3", "factor": float(rope.scaling_factor),
            "low_freq_factor": float(rope.low_freq_factor), "high_freq_factor": float(rope.high_freq_factor),
            "original_max_position_embeddings": int(rope.original_max_position_embeddings)}


def hf_config_of(tt_cfg, dtype: str = "float32") -> dict:
    """The HF LlamaConfig dict of a torchtitan Llama 3 model config (0.3's Llama3Model.Config, or the older
    TransformerModelArgs)."""
    if hasattr(tt_cfg, "layers"):  # 0.3
        layer = tt_cfg.layers[0]
        attn = layer.attention
        n_heads = attn.n_heads
        n_kv = attn.n_kv_heads or n_heads
        head_dim = attn.head_dim or tt_cfg.dim // n_heads
        rope = attn.rope
        ffn, eps = layer.feed_forward.w1.out_features, layer.attention_norm.eps
        layers, theta, max_seq = len(tt_cfg.layers), rope.theta, rope.max_seq_len
        scaling, tied = _rope_scaling(rope), bool(getattr(tt_cfg, "enable_weight_tying", False))
    else:  # 0.1/0.2 TransformerModelArgs
        n_heads = tt_cfg.n_heads
        n_kv = tt_cfg.n_kv_heads or n_heads
        head_dim = tt_cfg.dim // n_heads
        ffn = int(2 * 4 * tt_cfg.dim / 3)
        if tt_cfg.ffn_dim_multiplier is not None:
            ffn = int(tt_cfg.ffn_dim_multiplier * ffn)
        ffn = tt_cfg.multiple_of * ((ffn + tt_cfg.multiple_of - 1) // tt_cfg.multiple_of)
        eps, layers, theta, max_seq = tt_cfg.norm_eps, tt_cfg.n_layers, tt_cfg.rope_theta, tt_cfg.max_seq_len
        scaling = None
        if getattr(tt_cfg, "rope_scaling_args", None) is not None:
            r = tt_cfg.rope_scaling_args
            scaling = {"rope_type": "llama3", "factor": float(r.scaling_factor),
                       "low_freq_factor": float(r.low_freq_factor), "high_freq_factor": float(r.high_freq_factor),
                       "original_max_position_embeddings": int(r.original_max_position_embeddings)}
        tied = bool(getattr(tt_cfg, "enable_weight_tying", False))
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": int(tt_cfg.dim),
            "intermediate_size": int(ffn), "num_hidden_layers": int(layers), "num_attention_heads": int(n_heads),
            "num_key_value_heads": int(n_kv), "head_dim": int(head_dim), "vocab_size": int(tt_cfg.vocab_size),
            "max_position_embeddings": int(max_seq), "rms_norm_eps": float(eps), "rope_theta": float(theta),
            "rope_scaling": scaling, "tie_word_embeddings": tied, "hidden_act": "silu", "torch_dtype": dtype}


def hf_config_of_deepseek(tt_cfg, mtp_layers: int = 0, dtype: str = "float32") -> dict:
    """The HF DeepseekV3Config dict of torchtitan's DeepSeekV3Model.Config (MLA, MoE with sigmoid routing and
    expert bias, YaRN RoPE; `mtp_layers`: the MTP layers the checkpoint holds)."""
    moe_layers = [layer for layer in tt_cfg.layers if layer.moe is not None]
    dense = [layer for layer in tt_cfg.layers if layer.moe is None]
    attn, moe = tt_cfg.layers[0].attention, moe_layers[0].moe
    router, rope = moe.router, attn.rope
    moe_ffn = moe.routed_experts.inner_experts.hidden_dim
    shared = moe.shared_experts.w1.out_features // moe_ffn if moe.shared_experts is not None else 0
    if router.score_func != "sigmoid":
        raise ConfigError(f"torchtitan DeepSeek-V3 router score_func {router.score_func!r}: HF/Megatron's "
                          "DeepSeek-V3 routes with sigmoid (noaux_tc) only")
    if rope.scaling != "yarn":
        raise ConfigError(f"torchtitan DeepSeek-V3 RoPE scaling {rope.scaling!r}: only yarn has an HF counterpart")
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": int(tt_cfg.vocab_size),
        "hidden_size": int(tt_cfg.dim), "num_hidden_layers": len(tt_cfg.layers),
        "intermediate_size": int(dense[0].feed_forward.w1.out_features if dense else moe_ffn),
        "moe_intermediate_size": int(moe_ffn), "num_attention_heads": int(attn.n_heads),
        "num_key_value_heads": int(attn.n_heads), "n_shared_experts": int(shared),
        "n_routed_experts": int(router.num_experts), "num_experts_per_tok": int(router.top_k),
        "first_k_dense_replace": len(dense), "n_group": int(router.num_expert_groups or 1),
        "topk_group": int(router.num_limited_groups or 1), "routed_scaling_factor": float(router.route_scale),
        "norm_topk_prob": bool(router.route_norm), "topk_method": "noaux_tc", "scoring_func": "sigmoid",
        "q_lora_rank": int(attn.q_lora_rank) or None, "kv_lora_rank": int(attn.kv_lora_rank),
        "qk_nope_head_dim": int(attn.qk_nope_head_dim), "qk_rope_head_dim": int(attn.qk_rope_head_dim),
        "v_head_dim": int(attn.v_head_dim), "num_nextn_predict_layers": int(mtp_layers),
        "max_position_embeddings": int(rope.max_seq_len), "rms_norm_eps": float(tt_cfg.layers[0].attention_norm.eps),
        "rope_theta": float(rope.theta),
        "rope_scaling": {"type": "yarn", "factor": float(rope.rope_factor), "beta_fast": float(rope.beta_fast),
                         "beta_slow": float(rope.beta_slow), "original_max_position_embeddings":
                         int(rope.original_seq_len), "mscale": float(attn.mscale),
                         "mscale_all_dim": float(attn.mscale)},
        "tie_word_embeddings": bool(getattr(tt_cfg, "enable_weight_tying", False)), "torch_dtype": dtype}


def read_job_config(path: str | Path) -> tuple[str, str]:
    """(model name, flavor) from torchtitan's job config TOML ([model] name and flavor)."""
    import tomllib

    from checkpoint.safety import read_input

    try:
        job = tomllib.loads(read_input(Path(path), limit=4 << 20))
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"--job-config {path}: cannot read it as TOML ({e})") from None
    model = job.get("model")
    name = model.get("name") if isinstance(model, dict) else None
    flavor = model.get("flavor") if isinstance(model, dict) else None
    if not isinstance(name, str) or not isinstance(flavor, str):
        raise ConfigError(f"--job-config {path}: no [model] name and flavor (torchtitan's job config names the "
                          "model there)")
    return name, flavor


def model_config(src: str | Path | None = None, *, flavor: str | None = None, name: str = "llama3",
                 job_config: str | None = None, hf_config: str | None = None, dtype: str = "float32") -> ModelConfig:
    """The model config of a torchtitan checkpoint, from exactly one of --model-flavor, --job-config, --hf-config
    (or the config.json mcore-to-torchtitan writes beside the step's files)."""
    given = [f for f, v in (("--model-flavor", flavor), ("--job-config", job_config), ("--hf-config", hf_config))
             if v is not None]
    if not given and src is not None and (resolve_step(src) / "config.json").is_file():
        hf_config = str(resolve_step(src))  # written by mcore-to-torchtitan
        given = ["config.json"]
    if len(given) != 1:
        raise ConfigError("a torchtitan checkpoint does not describe its model: pass one of --model-flavor FLAVOR "
                          "(a torchtitan flavour, e.g. 8B), --job-config TOML (torchtitan's job config) or "
                          "--hf-config HF_DIR" + (f" (got {' and '.join(given)})" if given else ""))
    if hf_config is not None:
        return ModelConfig.from_hf_dir(hf_config)
    if job_config is not None:
        name, flavor = read_job_config(job_config)
    if name not in ("llama3", "deepseek_v3"):
        raise ConfigError(f"torchtitan model {name!r}: its flavours are not read (llama3's and deepseek_v3's are); "
                          "pass --hf-config HF_DIR (a config.json describing the model)")
    tt_cfg = _registry_config(name, flavor)
    if name == "deepseek_v3":  # how many MTP layers the run trained is the checkpoint's, not the flavour's
        mtp = 0
        if src is not None:
            from checkpoint.torch_dist import TorchDistCheckpoint

            keys = TorchDistCheckpoint(resolve_step(src), megatron=False).tensors
            mtp = len({k.split(".")[1] for k in keys if k.startswith("mtp_layers.")})
        hf = hf_config_of_deepseek(tt_cfg, mtp, dtype)
        eps = tt_cfg.layers[0].attention.kv_norm.eps
        if eps != 1e-6:  # torchtitan 0.3 builds every RMSNorm with its default 1e-5, the MLA latent norms too
            print(f"shardkit: note: torchtitan's deepseek_v3 {flavor} normalises the MLA latents (q_norm, kv_norm) "
                  f"with eps {eps:g}; DeepSeek-V3, HF and shardkit use 1e-6 there: the weights convert exactly, a "
                  "forward differs slightly (5.6e-5 in a tiny test model's logits)", file=sys.stderr)
    else:
        hf = hf_config_of(tt_cfg, dtype)
    return ModelConfig.from_hf(hf, source=f"torchtitan {name} flavour {flavor}")


# -- reading torchtitan DCP -------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Info:
    file: str
    dtype: str
    shape: tuple[int, ...]


def resolve_step(path: str | Path) -> Path:
    """A `step-N` directory, or a checkpoint folder holding step-N directories (the highest N is taken)."""
    p = Path(path)
    if not p.is_dir():
        raise FormatError(f"{p}: no such torchtitan checkpoint directory")
    if (p / ".metadata").exists():
        return p
    steps = sorted((int(m.group(1)), x) for x in p.iterdir() if (m := STEP_RE.match(x.name)) and x.is_dir()
                   and (x / ".metadata").exists())
    if not steps:
        raise FormatError(f"{p}: not a torchtitan checkpoint: no .metadata and no complete step-N directory in it")
    return steps[-1][1]


MOMENTS = ("exp_avg", "exp_avg_sq")  # torchtitan's AdamW state per parameter (besides `step`)
OBJECT_MAX = 1 << 20  # bytes of one train_state / lr_scheduler / param_groups entry read (plain values)
_NOT_PLAIN = object()


def _plain(v):
    """A JSON value of a torch.load'ed entry (tuples as lists), or _NOT_PLAIN."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (tuple, list)):
        items = [_plain(x) for x in v]
        return _NOT_PLAIN if any(x is _NOT_PLAIN for x in items) else items
    return _NOT_PLAIN


def moment_name(state: str, hf_name: str) -> str:
    """TorchtitanSource's name of an Adam moment of an HF tensor (the native optimizer key's form)."""
    return f"optimizer.state.{state}.{hf_name}"


class TorchtitanSource:
    """A torchtitan step directory's model tensors under their HF names (hf_to_mcore's HFSource interface): reads
    return numpy rows, Q/K rows permuted to the half-split RoPE layout. With `optimizer`, its AdamW moments too
    (`moment_name(state, hf_name)`, in `moments`): per parameter, and for 0.3's fused `qkv_linear.wqkv` (rows per
    KV group [q heads of the group; k; v], as FusedQKVLinear splits it on save) the rows of q_proj/k_proj/v_proj."""

    fp8_block = None

    def __init__(self, path: str | Path, cfg: ModelConfig, quiet: bool = True, optimizer: bool = False):
        from checkpoint import store
        from checkpoint.torch_dist import TorchDistCheckpoint
        from checkpoint.torch_dist_pickle import _dtype_str

        self.dir = resolve_step(path)
        self.td = TorchDistCheckpoint(self.dir, megatron=False)
        self.cfg = cfg
        names = set(self.td.tensors)
        deepseek = cfg.model_type in ("deepseek_v3", "deepseek_v2")
        gen = "deepseek_v3" if deepseek else max(
            GENERATIONS, key=lambda g: len(names & {t.format(0) for t in GENERATIONS[g].values()}))
        self.generation, table = gen, NAMES_DSV3 if deepseek else GENERATIONS[gen]
        back = {tt: hf for hf, tt in table.items()}
        self.tt_name: dict[str, tuple[str, object]] = {}  # HF (or moment) name -> (torchtitan name, row rule)
        self.tensors: dict[str, _Info] = {}
        self.moments: dict[str, _Info] = {}
        skipped = [n for n in list(names) + self.td.objects if n.split(".")[0] in TRAINING_PREFIXES]
        for n, t in self.td.tensors.items():
            if n in skipped:
                continue
            dtype = _dtype_str(t.dtype)
            store.numpy_dtype(dtype)
            file = self.td.item_file(n, t.chunks[0][0])
            for hf, rule in self._hf_names(n, back, deepseek, tuple(t.shape)):
                self.tt_name[hf] = (n, rule)
                self.tensors[hf] = _Info(file, dtype, tuple(t.shape[1:]) if rule and rule[0] == "expert"
                                         else tuple(t.shape))
        self.steps: set[float] = set()
        self.carried: dict = {}  # with `optimizer`: torchtitan's train_state, lr_scheduler and param_groups entries
        if optimizer:
            self._find_moments(names)
            self.carried = self._training_entries()
            carried = {f"train_state.{k}" for k in self.carried.get("train_state", {})} | {
                f"lr_scheduler.{k}" for k in self.carried.get("lr_scheduler", {})} | {
                f"optimizer.param_groups.{fqn}.{k}" for g in self.carried.get("param_groups", [])
                for fqn in g["params"] for k in g if k != "params"}
            skipped = [n for n in skipped if not (n.startswith("optimizer.state.")
                                                  and n.rsplit(".", 1)[-1] in (*MOMENTS, "step")) and n not in carried]
        self.skipped = sorted(skipped)
        if skipped and not quiet:
            left = sorted({n.split(".")[0] if not n.startswith("optimizer.") else ".".join(n.split(".")[:2])
                           for n in skipped})
            print(f"shardkit: note: {self.dir}: {len(skipped)} training-state entries ({', '.join(left)}) are not "
                  "converted; the model weights are" + (" (--optimizer converts the AdamW moments, train_state, "
                                                         "lr_scheduler and param_groups)" if not optimizer else
                                                         ", with the AdamW moments, train_state, lr_scheduler and "
                                                         "param_groups"), file=sys.stderr)

    def _hf_names(self, n: str, back: dict, deepseek: bool, shape: tuple) -> list[tuple[str, object]]:
        """The HF name(s) of torchtitan tensor `n` with their row rules; an unknown one keeps its own name (plan()
        then names it as not mapped)."""
        if deepseek and n.startswith("mtp_layers."):  # MTP layer i = HF layer num_layers + i
            m = re.match(r"^mtp_layers\.(\d+)\.(.*)$", n)
            n = f"layers.{self.cfg.num_layers + int(m.group(1))}.{m.group(2)}"
        tmpl, layer = _template(n)
        if deepseek and tmpl in DSV3_EXPERTS:
            return [(f"model.layers.{layer}.mlp.experts.{e}.{DSV3_EXPERTS[tmpl]}.weight", ("expert", e))
                    for e in range(shape[0])]
        hf = back.get(tmpl)
        if hf is None:
            return [(n, None)]
        hf = hf if layer is None else hf.format(layer)
        return [(hf, "rope" if not deepseek and hf.split(".")[-2] in ROPE_PERMUTED else None)]

    def _find_moments(self, names: set[str]) -> None:
        """The AdamW moments of every model tensor (the parameter's own, its share of the fused wqkv, or its expert
        of a stacked DeepSeek-V3 tensor), checked for presence and shape; their common step. DeepSeek-V3's expert
        bias is a buffer in torchtitan (no gradient, no moments): its moments are zeros, as our trainer keeps them."""
        from checkpoint.torch_dist_pickle import _dtype_str

        fused = re.compile(r"^model\.layers\.(\d+)\.self_attn\.([qkv])_proj\.weight$")
        for hf, (tt, rule) in list(self.tt_name.items()):
            if tt.endswith(".moe.expert_bias_E"):
                for state in MOMENTS:
                    self.tt_name[moment_name(state, hf)] = (tt, ("zero",))
                    self.moments[moment_name(state, hf)] = _Info("", "float32", self.tensors[hf].shape)
                continue
            m = fused.match(hf) if self.generation == "0.3" else None
            param = f"layers.{m.group(1)}.attention.qkv_linear.wqkv.weight" if m else tt
            want = ((self.cfg.num_attention_heads + 2 * self.cfg.num_query_groups) * self.cfg.kv_channels,
                    self.cfg.hidden_size) if m else tuple(self.td.tensors[tt].shape)
            for state in MOMENTS:
                key = f"optimizer.state.{param}.{state}"
                t = self.td.tensors.get(key)
                if t is None:
                    raise FormatError(f"{self.dir}: --optimizer: no {key} (the AdamW moment of {tt}); is this a full "
                                      "training checkpoint of torchtitan's AdamW?")
                if tuple(t.shape) != tuple(want):
                    raise FormatError(f"{self.dir}: {key} has shape {list(t.shape)}, expected {list(want)}")
                name = moment_name(state, hf)
                self.tt_name[name] = (key, ("qkv", m.group(2)) if m else rule)
                self.moments[name] = _Info(self.td.item_file(key, t.chunks[0][0]), _dtype_str(t.dtype),
                                           self.tensors[hf].shape)
            step = self.td.tensors.get(f"optimizer.state.{param}.step")
            if step is not None:
                self.steps.add(float(np.asarray(self.td.read_numpy(step.name)).reshape(-1)[0]))
        if len(self.steps) > 1:
            raise FormatError(f"{self.dir}: the AdamW states hold different steps {sorted(self.steps)}")

    def _object(self, name: str):
        """A bytes entry of the step (a torch.save of plain data), read by torch.load(weights_only=True) after its
        zip CRC-32s are checked."""
        import io

        from checkpoint.safe_load import load_torch

        info = self.td._storage[(name, None)]
        if int(info.length) > OBJECT_MAX:
            raise FormatError(f"{self.dir}: entry {name} is {int(info.length):,} bytes, more than a training-state "
                              f"value's {OBJECT_MAX:,}; refusing to read it")
        self.td.check_item(name, None)
        with open(self.dir / info.relative_path, "rb") as f:
            f.seek(int(info.offset))
            return load_torch(io.BytesIO(f.read(int(info.length))), what=f"{self.dir}: entry {name}")

    def _training_entries(self) -> dict:
        """torchtitan's train_state (step, ntokens_seen), lr_scheduler (last_epoch) and AdamW param_groups (per
        parameter, grouped where equal), as plain JSON values for train_state.json; what is not plain data (a tensor
        lr, say) stays behind and is counted as not converted."""
        objects = set(self.td.objects)
        out: dict = {}
        for prefix in ("train_state", "lr_scheduler"):
            entries = {}
            for n in sorted(o for o in objects if o.startswith(prefix + ".")):
                v = _plain(self._object(n))
                if v is not _NOT_PLAIN:
                    entries[n[len(prefix) + 1:]] = v
            if entries:
                out[prefix] = entries
        per_param: dict[str, dict] = {}
        for n in sorted(o for o in objects if o.startswith("optimizer.param_groups.")):
            fqn, _, key = n[len("optimizer.param_groups."):].rpartition(".")
            v = _plain(self._object(n))
            if v is not _NOT_PLAIN:
                per_param.setdefault(fqn, {})[key] = v
        groups: list[dict] = []
        for fqn, values in per_param.items():
            g = next((g for g in groups if {k: v for k, v in g.items() if k != "params"} == values), None)
            if g is None:
                groups.append(g := {**values, "params": []})
            g["params"].append(fqn)
        if groups:
            out["param_groups"] = groups
        return out

    def _source_rows(self, rule, rows: np.ndarray) -> np.ndarray:
        hd = self.cfg.kv_channels
        perm = hf_row_source(hd)
        if rule == "rope":
            return (rows // hd) * hd + perm[rows % hd]
        _, part = rule  # the fused wqkv: per KV group [hpk q heads; k; v]
        hpk = self.cfg.heads_per_group
        group = (hpk + 2) * hd
        if part == "q":
            head = rows // hd
            return (head // hpk) * group + (head % hpk) * hd + perm[rows % hd]
        if part == "k":
            return (rows // hd) * group + hpk * hd + perm[rows % hd]
        return (rows // hd) * group + (hpk + 1) * hd + rows % hd

    def read(self, name: str, start: int, stop: int, cols: slice | None = None) -> np.ndarray:
        tt, rule = self.tt_name[name]
        nrows, *ncols = (self.tensors.get(name) or self.moments[name]).shape
        stop = min(stop, nrows)  # (as numpy slices: callers may ask past the end)
        cbox = ((cols.start or 0, ncols[0] if cols.stop is None else cols.stop),) if cols is not None else \
            tuple((0, c) for c in ncols)
        if rule is None:
            return self.td.read_numpy(tt, ((start, stop), *cbox))
        if rule[0] == "zero":  # DeepSeek-V3's expert bias: a buffer, no moments
            return np.zeros((stop - start, *(b - a for a, b in cbox)), np.float32)
        if rule[0] == "expert":
            return self.td.read_numpy(tt, ((rule[1], rule[1] + 1), (start, stop), *cbox))[0]
        src = self._source_rows(rule, np.arange(start, stop))
        lo, hi = int(src.min()), int(src.max()) + 1
        return self.td.read_numpy(tt, ((lo, hi), *cbox))[src - lo]

    def willneed(self, name: str, start: int, stop: int) -> None:
        pass

    def check_fp8(self, block) -> set:
        return set()

    def fingerprint(self) -> list[dict]:
        return [{"name": n, "size": s} for n, s in self.td.files().items()] + [
            {"name": ".metadata", "size": (self.dir / ".metadata").stat().st_size}]

    def resume_fingerprint(self) -> list[dict]:
        return [{**f, "mtime_ns": (self.dir / f["name"]).stat().st_mtime_ns} for f in self.fingerprint()]

    def close(self) -> None:
        self.td._array = self.td._cache = None


class _LazyTT:
    """The worker's source: opened on first use (hf_to_mcore._LazySource's interface)."""

    def __init__(self, path: str, cfg: ModelConfig, optimizer: bool):
        self.path, self.cfg, self.optimizer, self.src = path, cfg, optimizer, None

    def source(self) -> TorchtitanSource:
        if self.src is None:
            self.src = TorchtitanSource(self.path, self.cfg, optimizer=self.optimizer)
        return self.src

    def read(self, name, start, stop, cols=None):
        return self.source().read(name, start, stop, cols)

    def release(self, limit: int = 0) -> None:
        if self.src is not None:
            self.src.close()

    close = release


def _worker_class():
    from .hf_to_mcore import _Worker

    class _TTWorker(_Worker):
        def __init__(self, src_dir: str, cfg_dict: dict, layout_dict: dict, out_dir: str, dtypes: dict,
                     allow_nonfinite: bool = False, optimizer: bool = False) -> None:
            super().__init__(src_dir, cfg_dict, layout_dict, out_dir, dtypes, None, allow_nonfinite)
            self.src = _LazyTT(src_dir, ModelConfig.from_dict(cfg_dict), optimizer)
            if optimizer:
                self.maps.update({(tm.canonical, tm.lead): tm for tm in optimizer_maps(self.maps.values())})

    return _TTWorker


def _make_worker(*args):
    return _worker_class()(*args)


def optimizer_maps(maps) -> list:
    """The native optimizer entries of model maps: fp32_param from the weights, the Adam moments from
    TorchtitanSource's moment names, rows as the weight's."""
    from checkpoint.sharding import OPTIMIZER_STATES, optimizer_key

    out = []
    for tm in maps:
        for state in OPTIMIZER_STATES:
            segs = tuple(s if state == "fp32_param" else dataclasses.replace(s, hf_name=moment_name(state, s.hf_name))
                         for s in tm.segments)
            out.append(dataclasses.replace(tm, canonical=optimizer_key(state, tm.canonical), segments=segs))
    return out


def convert_torchtitan_to_mcore(src: str | Path, out: str | Path, layout: Layout, cfg: ModelConfig,
                                dtype: str | None = None, workers: int | None = None, overwrite: bool = False,
                                quiet: bool = False, allow_nonfinite: bool = False, optimizer: bool = False,
                                global_batch_size: int | None = None) -> Path:
    """Convert a torchtitan step directory (or the newest step-N under a checkpoint folder) and commit
    `<out>/iter_<N>`; returns the iteration directory. With `optimizer` (a full training checkpoint of torchtitan's
    AdamW), a training checkpoint: the fp32 weights and Adam moments as the native optimizer state, and
    train_state.json (iteration, optimizer step, consumed samples = N x `global_batch_size`, which torchtitan does not
    count in samples)."""
    from checkpoint import store
    from checkpoint.manifest import Manifest
    from checkpoint.safety import check_output
    from checkpoint.sharding import OPTIMIZER_STATES

    from . import distributed
    from .hf_to_mcore import VERSION, _jsonable, plan
    from .writer import write_chunks

    step = resolve_step(src)
    out = Path(out)
    check_output(out, [("SRC", step)])
    if not (cfg.model_type == "llama" and not cfg.is_moe or cfg.model_type == "deepseek_v3"):
        raise ConfigError(f"model_type {cfg.model_type!r}: torchtitan conversion supports Llama 3 and DeepSeek-V3")
    layout.check(cfg)
    dtype = store.dtype_name(dtype) if dtype else None
    if optimizer and not global_batch_size:
        raise ConfigError("--optimizer needs --global-batch-size N (the run's samples per step: the trainer resumes "
                          "at N x step consumed samples)")
    source = TorchtitanSource(step, cfg, quiet=quiet, optimizer=optimizer)
    entries, _, _ = plan(cfg, layout, source, dtype, quiet=quiet)
    m = STEP_RE.match(step.name)
    iteration = int(m.group(1)) if m else 0
    if optimizer:
        from checkpoint.manifest import TensorEntry
        from checkpoint.sharding import optimizer_specs
        from checkpoint.families import model_specs

        entries.update({s.name: TensorEntry.of(s, layout, "float32")
                        for s in optimizer_specs(model_specs(cfg, layout))})
    job = {"tool": VERSION, "source": str(step.resolve()), "files": source.resume_fingerprint(),
           "layout": layout.to_dict(), "dtype": dtype, "model": _jsonable(cfg.to_dict()), "optimizer": optimizer}
    started = time.time()
    with distributed.open_writer(out, iteration, job, overwrite, None) as w:
        args = (str(step), cfg.to_dict(), layout.to_dict(), str(w.partial), {n: e.dtype for n, e in entries.items()},
                allow_nonfinite, optimizer)
        write_chunks(w, entries, "torchtitan-to-mcore", _make_worker, args, workers, quiet)
        if source.resume_fingerprint() != job["files"]:
            raise FormatError(f"{step}: changed while it was being converted; nothing was committed")
        if optimizer:
            from checkpoint.manifest import TRAIN_STATE

            steps = int(source.steps.pop()) if source.steps else iteration
            state = {"iteration": iteration, "consumed_samples": iteration * global_batch_size,
                     "optimizer_steps": steps}
            if source.carried:  # mcore-to-torchtitan --optimizer writes them back
                state["torchtitan"] = source.carried
            (w.partial / TRAIN_STATE).write_text(json.dumps(state, indent=1) + "\n")
        manifest = Manifest(
            iteration=iteration, model=cfg, layout=layout, tensors=entries, fp8=None,
            optimizer=list(OPTIMIZER_STATES) if optimizer else None,
            training={"iteration": iteration, "consumed_samples": iteration * global_batch_size} if optimizer else None,
            provenance={"tool": f"shardkit {VERSION}", "command": "convert torchtitan-to-mcore",
                        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                        "source": {"kind": "torchtitan", "generation": source.generation, "path": str(step.resolve()),
                                   "files": source.fingerprint(),
                                   "not_converted": {p: sum(n.split(".")[0] == p for n in source.skipped)
                                                     for p in TRAINING_PREFIXES}},
                        "seconds": round(time.time() - started, 3)})
        return w.commit(manifest)


# -- writing torchtitan DCP -------------------------------------------------------------------------------------------

def _tt_item(hf_name: str, table: dict, cfg: ModelConfig) -> tuple[str, int | None]:
    """torchtitan's name of an HF tensor, and the expert index where it is one expert of a stacked tensor."""
    m = re.match(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$", hf_name)
    if m:
        stacked = {v: k for k, v in DSV3_EXPERTS.items()}[f"{m.group(3)}_proj"]
        name, expert = stacked.format(m.group(1)), int(m.group(2))
    else:
        tmpl, layer = _template(hf_name)
        name, expert = (table[tmpl] if layer is None else table[tmpl].format(layer)), None
    layer_m = re.match(r"^layers\.(\d+)\.(.*)$", name)
    if layer_m and int(layer_m.group(1)) >= cfg.num_layers:  # an MTP layer
        name = f"mtp_layers.{int(layer_m.group(1)) - cfg.num_layers}.{layer_m.group(2)}"
    return name, expert


def _dcp_writer():
    """DCPWriter and torch_save_bytes (checkpoint/torch_dist_write.py)."""
    from checkpoint.torch_dist_write import DCPWriter, torch_save_bytes

    return DCPWriter, torch_save_bytes


def export_plans(ckpt, dtype: str | None) -> list:
    """mcore_to_hf's export plans (HF names, blocks of canonical rows) of the tensors a torchtitan model holds: no
    copies of the embedding and head for DeepSeek-V3's MTP layers (torchtitan's share them); a tied model's head as
    the embedding's alias, last (torchtitan keeps both keys)."""
    from .mcore_to_hf import plan_export

    cfg = ckpt.config
    plans = plan_export(ckpt, dtype)
    if cfg.model_type == "deepseek_v3":
        copies = {f"model.layers.{cfg.num_layers + i}.{n}" for i in range(cfg.mtp_num_layers)
                  for n in ("embed_tokens.weight", "shared_head.head.weight")}
        plans = [p for p in plans if p.name not in copies]
    if cfg.tie_word_embeddings:
        emb = next(p for p in plans if p.name == "model.embed_tokens.weight")
        plans.append(dataclasses.replace(emb, name="lm_head.weight"))
    return plans


def _adamw_defaults() -> dict:
    """The keys and defaults of the installed torch's AdamW param group (what a torchtitan optimizer's flat state
    dict names per parameter), with torchtitan's default implementation (fused) and the `initial_lr` its LambdaLR
    adds."""
    import torch

    g = dict(torch.optim.AdamW([torch.zeros(1, requires_grad=True)]).param_groups[0])
    g.pop("params")
    g.pop("param_names", None)
    return {**g, "fused": True, "foreach": False, "initial_lr": g["lr"]}


# torchtitan's default_adamw (components/optimizer/optimizer.py): for a checkpoint that records no AdamW settings
TORCHTITAN_ADAMW = {"lr": 8e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


class _TrainingState:
    """What mcore-to-torchtitan --optimizer writes besides the tensors: per parameter the AdamW param group, the
    lr_scheduler and train_state entries, from the checkpoint's train_state.json (torchtitan's own entries where
    torchtitan-to-mcore carried them; else continue-pretrain's AdamW settings and Megatron param groups; else
    torchtitan's default_adamw values, said in a note)."""

    def __init__(self, ckpt, notes: list[str]):
        from checkpoint.manifest import TRAIN_STATE
        from checkpoint.safety import read_input, regular_file

        path = ckpt.path / TRAIN_STATE
        state: dict = {}
        if regular_file(path, missing_ok=True):
            try:
                state = json.loads(read_input(path))
            except (OSError, ValueError, RecursionError) as e:
                raise FormatError(f"{path}: unreadable training state ({e})") from None
        if not isinstance(state, dict):
            raise FormatError(f"{path}: not a JSON object")
        it = int(state.get("iteration", ckpt.manifest.iteration))
        self.steps = float(state.get("optimizer_steps", it))
        tt = state.get("torchtitan") if isinstance(state.get("torchtitan"), dict) else {}
        self.carried = {}
        for g in tt.get("param_groups", []):
            values = {k: tuple(v) if isinstance(v, list) else v for k, v in g.items() if k != "params"}
            self.carried.update({fqn: values for fqn in g["params"]})
        self.lr_scheduler = tt.get("lr_scheduler") or {"last_epoch": it}
        self.train_state = tt.get("train_state")
        if self.train_state is None:
            args = state.get("args") if isinstance(state.get("args"), dict) else {}
            seq = args.get("data.seq_length", args.get("seq_length"))  # continue-pretrain's flattened run config
            self.train_state = {"step": it, "ntokens_seen": int(state.get("consumed_samples", 0)) * int(seq or 0)}
            if not seq:
                notes.append(f"{path}: no sequence length recorded: torchtitan's train_state.ntokens_seen (logged "
                             "only) is 0")
        self.defaults = _adamw_defaults()
        opt = state.get("optimizer") if isinstance(state.get("optimizer"), dict) else None
        self.megatron = [g for g in (opt or {}).get("param_groups", []) if isinstance(g, dict)]
        self.max_lr = (opt or {}).get("lr")
        if not self.carried and not self.megatron:
            notes.append(f"{ckpt.path}: no AdamW settings recorded: param_groups hold torchtitan's default_adamw "
                         f"values (lr {TORCHTITAN_ADAMW['lr']}, betas {TORCHTITAN_ADAMW['betas']}, eps "
                         f"{TORCHTITAN_ADAMW['eps']}, weight_decay {TORCHTITAN_ADAMW['weight_decay']}), which "
                         "torchtitan loads over its job's")

    def param_group(self, fqn: str, ndim: int, expert: bool) -> dict:
        if self.carried:
            if fqn not in self.carried:
                raise FormatError(f"train_state.json's torchtitan param_groups name no {fqn}")
            return self.carried[fqn]
        if self.megatron:  # Megatron's groups: weights decayed (wd_mult 1), 1-D parameters not; experts apart
            cands = [g for g in self.megatron if bool(g.get("is_expert_parallel")) == expert] or self.megatron
            g = next((g for g in cands if (g.get("wd_mult", 1.0) == 0.0) == (ndim == 1)), cands[0])
            return {**self.defaults, "lr": float(g["lr"]), "betas": tuple(g["betas"]), "eps": float(g["eps"]),
                    "weight_decay": float(g["weight_decay"]),
                    "initial_lr": float(self.max_lr if self.max_lr is not None else g["lr"])}
        return {**self.defaults, **TORCHTITAN_ADAMW, "initial_lr": TORCHTITAN_ADAMW["lr"]}


def _qkv_fused(parts: dict, cfg: ModelConfig):
    """torchtitan 0.3's fused wqkv rows (per KV group: its q heads, its k head, its v head) from q/k/v rows (already
    in torchtitan's interleaved RoPE layout)."""
    import torch

    hd, hpk = cfg.kv_channels, cfg.heads_per_group
    q, k, v = (parts[x] for x in "qkv")
    groups = []
    for g in range(cfg.num_query_groups):
        groups += [q[g * hpk * hd:(g + 1) * hpk * hd], k[g * hd:(g + 1) * hd], v[g * hd:(g + 1) * hd]]
    return torch.cat(groups)


def convert_mcore_to_torchtitan(ckpt_path: str | Path, out: str | Path, dtype: str | None = None,
                                generation: str = "0.3", step: int | None = None, overwrite: bool = False,
                                quiet: bool = False, optimizer: bool = False) -> Path:
    """Write `<out>/step-<N>/` (N: the checkpoint's iteration unless `step`): a model-only DCP checkpoint under
    torchtitan's names, which its CheckpointManager (initial_load_model_only) and `dcp.load` read. One tensor in
    memory at a time; the directory is written under a temporary name and renamed into place when complete.

    With `optimizer` (a native training checkpoint), torchtitan's full training checkpoint: the fp32 master weights
    (fp32_param) as the model, the AdamW moments as `optimizer.state.<param>.exp_avg|exp_avg_sq|step` (0.3's fused
    wqkv assembled per layer; DeepSeek-V3's routed experts stacked, one chunk per expert; its expert bias is a buffer
    in torchtitan and has none), `optimizer.param_groups.<param>.*`, `lr_scheduler.last_epoch` and
    `train_state.step|ntokens_seen` (see _TrainingState); torchtitan's data-loader state has no counterpart and is
    not written (a note says so: its CheckpointManager then loads with exclude_from_loading = ["dataloader"])."""
    import torch

    from checkpoint import store
    from checkpoint.progress import progress_bar
    from checkpoint.reader import Checkpoint
    from checkpoint.safety import check_output
    from checkpoint.sharding import OPTIMIZER_STATES, optimizer_key
    DCPWriter, torch_save_bytes = _dcp_writer()

    from .mcore_to_hf import _read_block

    ckpt = Checkpoint(ckpt_path)
    cfg = ckpt.config
    deepseek = cfg.model_type == "deepseek_v3"
    if not deepseek and (cfg.model_type != "llama" or cfg.is_moe or cfg.add_qkv_bias or cfg.add_proj_bias
                         or cfg.add_mlp_bias):
        raise ConfigError(f"{ckpt.path}: model_type {cfg.model_type!r}"
                          + (" with biases" if cfg.model_type == "llama" else "")
                          + ": torchtitan has no such model; bias-free llama and deepseek_v3 convert")
    if generation not in GENERATIONS:
        raise ConfigError(f"--torchtitan-names {generation!r}: one of {', '.join(GENERATIONS)}")
    table = NAMES_DSV3 if deepseek else GENERATIONS[generation]
    dtype = store.dtype_name(dtype) if dtype else None
    notes: list[str] = []
    training = None
    if optimizer:
        if list(ckpt.manifest.optimizer or []) != list(OPTIMIZER_STATES):
            raise ShardkitError(f"{ckpt.path}: --optimizer: this checkpoint holds no AdamW state (fp32_param, "
                                "exp_avg, exp_avg_sq); convert it without --optimizer (model only)")
        if dtype is not None:
            raise ConfigError("--optimizer with --dtype: a training checkpoint's weights are its fp32 master weights "
                              "(fp32_param), written as they are; drop --dtype")
        training = _TrainingState(ckpt, notes)
        dtype = "float32"
    out = Path(out)
    check_output(out, [("CKPT", ckpt.path)])
    step = ckpt.manifest.iteration if step is None else step
    final = out / f"step-{step}"
    if final.exists() and not overwrite:
        raise ShardkitError(f"{final}: exists; pass --overwrite to replace it")
    plans = export_plans(ckpt, dtype)
    tied_head = plans[-1] if cfg.tie_word_embeddings else None
    fused = optimizer and not deepseek and generation == "0.3"  # 0.3's optimizer keys the attention by wqkv
    qkv_re = re.compile(r"^model\.layers\.(\d+)\.self_attn\.([qkv])_proj\.weight$")
    tmp = out / f".step-{step}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        w = DCPWriter(tmp)
        total = sum(p.nbytes for p in plans) * (3 if optimizer else 1)
        items = [(p, *_tt_item(p.name, table, cfg)) for p in plans]
        stacked: dict[str, list] = {}  # routed experts: one DCP tensor per layer, one chunk per expert
        for p, name, e in items:
            if e is not None:
                stacked.setdefault(name, []).append((e, p.shape))
        keys = [""] + ([f"optimizer.state.{{}}.{m}" for m in MOMENTS] if optimizer else [])
        for name, chunks in stacked.items():
            shape = chunks[0][1]
            for key in keys:
                w.declare_tensor(key.format(name) if key else name, (len(chunks), *shape),
                                 "float32" if key else next(p.dtype for p, n, _ in items if n == name),
                                 [((e, *(0,) * len(shape)), (1, *shape)) for e, _ in sorted(chunks)])
        params: dict[str, tuple[int, bool]] = {}  # torchtitan parameter -> (ndim, expert): its step, param group
        pending_qkv: dict[str, dict] = {}  # fused wqkv parameter -> {state: {q|k|v: rows}}

        def read(p, state: str):
            value = torch.cat([_read_block(ckpt, dataclasses.replace(tm, canonical=optimizer_key(state, tm.canonical))
                                           if state else tm, seg.start, seg.stop) for tm, seg in p.blocks])
            return store.cast(value, "float32" if state else p.dtype, p.name)

        def put(f, name: str, expert, value) -> None:
            if expert is not None:
                f.add_tensor(name, (expert, *(0,) * value.ndim), value[None])
            else:
                w.declare_tensor(name, value.shape, str(value.dtype), [((0,) * value.ndim, tuple(value.shape))])
                f.add_tensor(name, (0,) * value.ndim, value)

        with progress_bar("mcore-to-torchtitan", total=total, items=len(plans), disable=quiet) as bar:
            with w.rank_file(0) as f:
                for p, name, expert in items:
                    proj = p.name.split(".")[-2]
                    rows = None
                    if proj in ROPE_PERMUTED and not deepseek:  # half-split -> torchtitan's interleaved rows
                        hd = cfg.kv_channels
                        r = np.arange(p.shape[0])
                        rows = torch.from_numpy((r // hd) * hd + np.argsort(hf_row_source(hd))[r % hd])
                    states = ("fp32_param" if optimizer else "",) + (MOMENTS if optimizer and p is not tied_head
                                                                     else ())
                    for state in states:
                        value = read(p, state)
                        if rows is not None:
                            value = value[rows]
                        if state in MOMENTS and name.endswith(".moe.expert_bias_E"):
                            if value.count_nonzero():  # a buffer in torchtitan: nothing holds its moments there
                                raise FormatError(f"{ckpt.path}: {optimizer_key(state, p.name)} is not zero, and "
                                                  "torchtitan keeps no AdamW state for the expert bias (a buffer)")
                            continue
                        m = qkv_re.match(p.name) if fused and state in MOMENTS else None
                        if m:  # collected until the layer's q, k and v are in, then written as wqkv
                            param = f"layers.{m.group(1)}.attention.qkv_linear.wqkv.weight"
                            parts = pending_qkv.setdefault(param, {}).setdefault(state, {})
                            parts[m.group(2)] = value
                            params[param] = (2, False)
                            if len(parts) == 3:
                                put(f, f"optimizer.state.{param}.{state}", None, _qkv_fused(parts, cfg))
                                del pending_qkv[param][state]
                            continue
                        put(f, f"optimizer.state.{name}.{state}" if state in MOMENTS else name, expert, value)
                        if state in MOMENTS:
                            params[name] = (value.ndim + (expert is not None), expert is not None)
                    bar.advance(p.nbytes * len(states), 1)
                if optimizer:
                    left = [k for k, v in pending_qkv.items() if v]
                    if left:
                        raise FormatError(f"{ckpt.path}: {left[0]}: the q, k and v moments of the layer are not all "
                                          "there")
                    for param, (ndim, expert) in sorted(params.items()):
                        key = f"optimizer.state.{param}.step"
                        w.declare_tensor(key, (), "float32", [((), ())])
                        f.add_tensor(key, (), torch.tensor(training.steps, dtype=torch.float32))
                        for k, v in training.param_group(param, ndim, expert).items():
                            w.declare_object(f"optimizer.param_groups.{param}.{k}")
                            f.add_bytes(f"optimizer.param_groups.{param}.{k}", torch_save_bytes(v))
                    for prefix, entries in (("lr_scheduler", training.lr_scheduler),
                                            ("train_state", training.train_state)):
                        for k, v in entries.items():
                            w.declare_object(f"{prefix}.{k}")
                            f.add_bytes(f"{prefix}.{k}", torch_save_bytes(v))
        # the model config beside (torchtitan reads only the files .metadata names): read back with no flags
        (tmp / "config.json").write_text(json.dumps(cfg.to_hf(dtype), indent=1))
        w.write_metadata(str(final))
    except BaseException:  # nothing half-written is left (the temporary directory is ours)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if optimizer:
        notes.append(f"{final}: no dataloader entry (torchtitan's data-loader state has no counterpart in a shardkit "
                     "checkpoint): resume it with checkpoint.exclude_from_loading = [\"dataloader\"]")
    for n in notes:
        print(f"shardkit: note: {n}", file=sys.stderr)
    if final.exists():  # --overwrite: our files replace those of the same name (.metadata last); any other file
        # stays, an older save's extra rank files too (shardkit did not write them; DCP reads only what .metadata names)
        ours = sorted(os.listdir(tmp), key=lambda n: n == ".metadata")
        for name in ours:
            os.replace(tmp / name, final / name)
        tmp.rmdir()
    else:
        os.replace(tmp, final)
    fd = os.open(out, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return final


# -- torchtitan as reshard's source and verify's reference ------------------------------------------------------------

def is_torchtitan(path: str | Path) -> bool:
    """A torchtitan DCP checkpoint (a step-N directory, or its folder): DCP `.metadata` under torchtitan's model names
    (`tok_embeddings.weight`), not Megatron's torch_dist (latest_checkpointed_iteration.txt, metadata.json, its own
    names)."""
    p = Path(path)
    if not p.is_dir() or os.path.lexists(p / "latest_checkpointed_iteration.txt") or (p / "metadata.json").exists():
        return False
    try:
        step = resolve_step(p)
    except FormatError:
        return False
    from checkpoint.torch_dist import TorchDistCheckpoint

    return "tok_embeddings.weight" in TorchDistCheckpoint(step, megatron=False).tensors


def reshard_torchtitan(args, out: str | Path) -> Path:
    """`shardkit reshard TT_DIR DST [--tp ..]`: a torchtitan DCP folder straight into the Megatron layout asked for
    (torchtitan-to-mcore's streaming conversion; flags not given are 1, torchtitan's folder having no Megatron
    layout). The model: --hf-config, or the config.json mcore-to-torchtitan writes beside its files."""
    from checkpoint.layout import Layout, PipelineSplit

    if getattr(args, "group", None) is not None:
        raise ShardkitError("reshard of a torchtitan checkpoint runs in one process; drop --ranks")
    given = {k: getattr(args, k) for k in ("tp", "pp", "vpp", "ep", "etp") if getattr(args, k, None) is not None}
    layout = Layout(**given, split=PipelineSplit.from_args(args))
    hf_config = getattr(args, "hf_config", None)
    if hf_config is None and not (resolve_step(args.src) / "config.json").is_file():
        raise ConfigError(f"{args.src}: a torchtitan checkpoint does not describe its model: pass --hf-config HF_DIR "
                          "(or convert torchtitan-to-mcore, which also reads --model-flavor / --job-config)")
    cfg = model_config(args.src, hf_config=hf_config)
    if not args.quiet:
        print(f"torchtitan {resolve_step(args.src)} -> tp={layout.tp} pp={layout.pp} vpp={layout.vpp} "
              f"ep={layout.ep} etp={layout.expert_tp}", flush=True)
    return convert_torchtitan_to_mcore(args.src, out, layout, cfg, dtype=args.dtype, workers=args.workers,
                                       overwrite=args.overwrite, quiet=args.quiet)


def verify_against_torchtitan(ckpt_path: str | Path, tt_dir: str | Path, as_json: bool = False,
                              quiet: bool = False) -> int:
    """`shardkit verify CKPT --against-torchtitan DIR`: every model tensor of the native checkpoint against the
    torchtitan checkpoint's (a step-N directory, or the newest under a folder), through the one name/row mapping
    (Q/K RoPE rows, stacked experts, MTP layers, the fused wqkv's split), block by block (64 MiB of rows at a time
    from each side). Equal means the same values (a dtype difference is named); any difference, a tensor missing on
    either side or a torchtitan model entry with no counterpart is a failure: exit 1, one line each. Weights only."""
    import torch

    from checkpoint import store
    from checkpoint.reader import Checkpoint

    from .mcore_to_hf import BLOCK_BYTES, _read_block

    ckpt = Checkpoint(ckpt_path)
    cfg = ckpt.config
    src = TorchtitanSource(tt_dir, cfg, quiet=True)
    plans = export_plans(ckpt, None)
    problems: list[str] = []
    dtypes: set[str] = set()
    checked = 0
    for p in plans:
        if p.name not in src.tensors:
            problems.append(f"{p.name}: not in {src.dir}")
            continue
        info = src.tensors[p.name]
        if tuple(info.shape) != tuple(p.shape):
            problems.append(f"{p.name}: shape {list(p.shape)} here, {list(info.shape)} in {src.dir}")
            continue
        if info.dtype != p.dtype:
            dtypes.add(f"{p.name} ({p.dtype} here, {info.dtype} in torchtitan)")
        rows = max(1, BLOCK_BYTES // max(1, p.nbytes // max(1, p.shape[0])))
        worst, row = 0.0, 0
        for tm, seg in p.blocks:
            for a in range(seg.start, seg.stop, rows):
                b = min(seg.stop, a + rows)
                mine = _read_block(ckpt, tm, a, b).to(torch.float64)
                theirs = store.from_numpy(np.array(src.read(p.name, row + a - seg.start, row + b - seg.start))
                                          ).to(torch.float64)
                worst = max(worst, float((mine - theirs).abs().max()) if mine.numel() else 0.0)
            row += seg.stop - seg.start
        if worst != 0.0:
            problems.append(f"{p.name}: differs, max |diff| {worst:.3g}")
        checked += 1
    mapped = {p.name for p in plans}
    problems += [f"{src.tt_name[n][0]}: in {src.dir}, not in {ckpt.path}" for n in sorted(src.tensors)
                 if n not in mapped]
    src.close()
    report = {"checkpoint": str(ckpt.path), "torchtitan": str(src.dir), "tensors": checked, "ok": not problems,
              "problems": problems, "dtype_differs": sorted(dtypes)}
    if as_json:
        print(json.dumps(report, indent=1))
    else:
        for line in problems:
            print(f"FAIL {line}")
        if dtypes and not quiet:
            print(f"note: {len(dtypes)} tensors differ in dtype only (values equal): {sorted(dtypes)[0]}, ...")
        print(f"{'OK' if not problems else 'FAILED'}: {checked} tensors of {ckpt.path} against torchtitan {src.dir}"
              + ("" if not problems else f"; {len(problems)} problems"))
    return 0 if not problems else 1
