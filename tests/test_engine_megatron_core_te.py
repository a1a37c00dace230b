"""Issue 40: Transformer Engine's layer spec and FP8 recipes on `--engine megatron-core`, as far as they run without
Transformer Engine (not installed here, nor on the lent GPU machine).

What runs here: the spec choice per device / --transformer-impl / TE installed (`layer_spec`, te_available and the
CUDA flag faked, no TE module built); TransformerConfig's FP8 fields (`fp8_fields`) against what Megatron-LM's own
argument parser (megatron/training/arguments.py, whose FP8 flags megatron-core's TransformerConfig declares) gives for
the same flags, and megatron-core's TransformerConfig validating them; the parameter names of megatron-core's TE spec
(its own get_gpt_decoder_block_spec / get_gpt_mtp_block_spec with use_transformer_engine=True, the TE classes replaced
by stand-ins holding TE's parameter names and local shapes) through the engine's parameter table for Llama, Mixtral,
Qwen3, DeepSeek-V2-Lite and DeepSeek-V3 with MTP, equal to the local spec's; the FP8 delayed-scaling state of
megatron-core's TE linears (stand-ins carrying TE's fp8_meta) saved and loaded in the native engine's JSON form and
names; the refusals. What does not run here: TE's kernels, FP8 GEMMs, megatron-core's fp8 context, the whole TE
path on a GPU (scripts/gpu_check.py part (d) records it as skipped where TE is absent)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from checkpoint.errors import ConfigError
from tests.launcher import REPO

ORACLE = REPO / ".venv-oracle312" / "bin" / "python"
needs_megatron = pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core not installed")


def fp8cfg(*flags: str):
    """shardkit's FP8Config for Megatron-LM's FP8 flags (train/config.py's parser)."""
    import argparse

    from train.config import add_arguments, from_namespace

    p = argparse.ArgumentParser()
    add_arguments(p)
    return from_namespace(p.parse_args(["--load", "ck", "--data-path", "d", *flags])).fp8


# -- the spec choice and the refusals ----------------------------------------------------------------------------

@pytest.mark.parametrize("requested,on_cpu,have_te,want", [
    (None, False, True, "transformer_engine"),  # the default on CUDA with TE
    (None, False, False, "local"),
    ("local", False, True, "local"),
    ("transformer_engine", False, True, "transformer_engine"),
    (None, True, True, "local"),  # the CPU: the local spec whatever is installed
    ("local", True, False, "local"),
])
def test_spec_choice(requested, on_cpu, have_te, want):
    from train.engines.megatron_core.checks import layer_spec

    assert layer_spec(requested, fp8cfg(), on_cpu, have_te) == want
    if want == "transformer_engine":  # FP8 then runs in TE's modules
        assert layer_spec(requested, fp8cfg("--fp8-format", "hybrid"), on_cpu, have_te) == want


@pytest.mark.parametrize("requested,on_cpu,have_te,flags,says", [
    ("transformer_engine", True, True, (), "TE's layer spec): megatron-core cannot run it on the CPU"),
    ("transformer_engine", False, False, (), "Transformer Engine is not installed"),
    (None, True, True, ("--fp8-format", "hybrid"), "--fp8-format hybrid: megatron-core cannot run it on the CPU"),
    (None, False, False, ("--fp8-format", "e4m3"), "FP8 runs in Transformer Engine's modules only (Transformer "
                                                   "Engine is not installed"),
    ("local", False, True, ("--fp8-format", "hybrid"), "only (--transformer-impl local"),
    (None, False, True, ("--fp8-format", "hybrid", "--first-last-layers-bf16"),
     "--first-last-layers-bf16 with --fp8-recipe delayed: megatron-core refuses it"),
    (None, False, True, ("--fp8-format", "hybrid", "--fp8-recipe", "blockwise", "--no-fp8-wgrad"),
     "--no-fp8-wgrad with --fp8-recipe blockwise"),
])
def test_refusals(requested, on_cpu, have_te, flags, says):
    from train.engines.megatron_core.checks import NotCovered, layer_spec

    with pytest.raises(NotCovered) as e:
        layer_spec(requested, fp8cfg(*flags), on_cpu, have_te)
    line = e.value.as_config_error().args[0]
    assert says in line and "\n" not in line and line.startswith("--engine megatron-core: ")


def test_refused_at_start_on_cuda_without_te(monkeypatch):
    """check_flags (the engine's first step) with a CUDA device and no TE: FP8 is one line before anything runs."""
    import train.engines.megatron_core.checks as mc

    monkeypatch.setattr(mc, "te_available", lambda: False)
    cfg = SimpleNamespace(parallel=SimpleNamespace(cp=1), fp8=fp8cfg("--fp8-format", "hybrid"),
                          run=SimpleNamespace(transformer_impl=None, recompute_granularity=None))
    with pytest.raises(mc.NotCovered, match="Transformer Engine is not installed"):
        mc.check_flags(cfg, on_cpu=False)
    monkeypatch.setattr(mc, "te_available", lambda: True)
    mc.check_flags(cfg, on_cpu=False)  # with TE: taken


@pytest.mark.parametrize("flags,native_says", [
    (("--attention-dropout", "0.1"), "TE's DotProductAttention is built without dropout here"),
    (("--attention-dropout", "0", "--fp8-format", "hybrid", "--recompute-granularity", "full"),
     "--recompute-granularity full with FP8"),
])
def test_native_te_refusals_not_on_megatron_core(flags, native_says):
    """The native TE backend's own limits (no attention dropout; full recompute outside te.autocast) are not the
    megatron-core engine's (its TEDotProductAttention applies dropout; it recomputes under its FP8 context): with
    --engine megatron-core the run gets past them (here to the TE install check, TE being absent)."""
    import argparse

    from train.config import add_arguments, from_namespace, validate

    p = argparse.ArgumentParser()
    add_arguments(p)
    for engine, says in (("native", native_says), ("megatron-core", "Transformer Engine is not installed")):
        cfg = from_namespace(p.parse_args(["--load", "ck", "--data-path", "d", "--train-iters", "2", "--engine",
                                           engine, "--transformer-impl", "transformer_engine", *flags]))
        with pytest.raises(ConfigError, match=says):
            validate(cfg)


def test_bf16_layer_bounds():
    """The bf16 ends as megatron-core bounds them (one stage's layers each) and as the native engine (some FP8)."""
    from train.engines.megatron_core.checks import NotCovered
    from train.engines.megatron_core.config import fp8_fields

    c = fp8cfg("--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--first-last-layers-bf16",
               "--num-layers-at-start-in-bf16", "3")
    assert fp8_fields(c, 8, 2)["num_layers_at_start_in_bf16"] == 3
    with pytest.raises(NotCovered, match="--num-layers-at-start-in-bf16 3: megatron-core keeps at most one pipeline "
                                         "stage's layers \\(2 at --pp 4\\)"):
        fp8_fields(c, 8, 4)
    with pytest.raises(ConfigError, match="leave none of the model's 4 layers in FP8"):
        fp8_fields(c, 4, 1)
    assert fp8_fields(fp8cfg(), 8, 1) == {} and fp8_fields(None, 8, 1) == {}


# -- TransformerConfig's FP8 fields against Megatron-LM's own parser -----------------------------------------------

FP8_FLAGS = [
    ["--fp8-format", "hybrid"],
    ["--fp8-format", "e4m3", "--fp8-margin", "2", "--fp8-amax-history-len", "16", "--fp8-amax-compute-algo", "max",
     "--no-fp8-wgrad"],
    ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--first-last-layers-bf16",
     "--num-layers-at-start-in-bf16", "2", "--num-layers-at-end-in-bf16", "0"],
    ["--fp8-format", "e4m3", "--fp8-recipe", "blockwise"],
]
MLM_FP8 = """
import argparse, json, sys, warnings
warnings.simplefilter("ignore")
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training import arguments
names = json.loads(sys.argv[1])
out = []
for argv in json.loads(sys.argv[2]):
    p = argparse.ArgumentParser(allow_abbrev=False)
    arguments._add_network_size_args(p)  # TransformerConfig's own flags (its fields' argparse metadata)
    args, rest = p.parse_known_args(argv)
    assert not rest, rest
    got = {n: getattr(args, n) for n in names}
    tc = TransformerConfig(num_layers=4, hidden_size=64, num_attention_heads=4, pipeline_model_parallel_size=2,
                           pipeline_dtype=__import__("torch").float32, **got)  # megatron-core 0.19's validation
    assert all(getattr(tc, k) == v for k, v in got.items()), got
    out.append(got)
print(json.dumps(out))
"""


@needs_megatron
@pytest.mark.skipif(not ORACLE.exists(), reason="the megatron-core 0.19 / Megatron-LM oracle venv is absent")
def test_fp8_fields_match_megatron_lm():
    """For each set of flags, the engine's TransformerConfig FP8 fields equal what Megatron-LM's parser gives
    (core_transformer_config_from_args copies TransformerConfig's fields from the args by name), and megatron-core
    0.19's TransformerConfig accepts them in a 4-layer, PP 2 config."""
    from train.engines.megatron_core.config import fp8_fields

    ours = [fp8_fields(fp8cfg(*flags), 4, 2) for flags in FP8_FLAGS]
    names = sorted(ours[0])
    assert all(sorted(o) == names for o in ours)
    r = subprocess.run([str(ORACLE), "-c", MLM_FP8, json.dumps(names), json.dumps(FP8_FLAGS)], capture_output=True,
                       text=True, timeout=300, env=dict(os.environ, PYTHONPATH=""))
    assert r.returncode == 0, r.stderr[-3000:]
    theirs = json.loads(r.stdout.splitlines()[-1])
    assert ours == theirs


@needs_megatron
def test_fp8_fields_accepted_by_the_engines_megatron_core(tables):
    """The same fields through the engine's megatron-core (0.16 here: its TransformerConfig's validation), in the
    process that builds the spec tables."""
    from train.engines.megatron_core.config import fp8_fields

    assert tables["fp8_accepted"] == [fp8_fields(fp8cfg(*flags), 4, 2) for flags in FP8_FLAGS]


# -- the TE spec's parameter names through the engine's table --------------------------------------------------------

MODELS = {  # tests/moe_models.py kinds, or the tiny Llama / Qwen3 configs; overrides
    "llama": ("llama", {}),
    "qwen3": ("qwen3", {}),
    "mixtral": ("mixtral", {}),
    "deepseek_v2_lite": ("deepseek_v2_lite", {"rms_norm_eps": 1e-6}),
    "deepseek_v3": ("deepseek_v3", {"rms_norm_eps": 1e-6, "n_group": 2, "topk_group": 1}),
}


def model_config(kind: str, **over):
    """shardkit's ModelConfig of a tiny model of `kind`."""
    import transformers

    from checkpoint.config import ModelConfig
    from tests import moe_models

    if kind in moe_models.CONFIGS:
        cls, kw = moe_models.CONFIGS[kind]
        hf = cls(**{**moe_models.BASE, **kw, **over})
    else:
        base = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5)
        cls = transformers.Qwen3Config if kind == "qwen3" else transformers.LlamaConfig
        hf = cls(**base, **({"head_dim": 16} if kind == "qwen3" else {}), **over)
    return ModelConfig.from_hf(hf.to_dict())


def stand_in_te():
    """Classes standing in for megatron-core's TE wrappers (megatron/core/extensions/transformer_engine.py) with the
    parameter names TE's modules register and this TP rank's shapes: TELayerNormColumnParallelLinear (te
    LayerNormLinear: layer_norm_weight [in], weight [out / tp, in]), TEColumnParallelLinear / TERowParallelLinear
    (te Linear: weight [out / tp, in] / [out, in / tp]), TELinear (duplicated: the whole weight), TENorm (te RMSNorm:
    weight), TEDotProductAttention (no parameters). Only their construction is modelled; none runs."""
    from megatron.core import parallel_state as ps
    from torch import nn

    def tp_size(is_expert: bool) -> int:
        return (ps.get_expert_tensor_parallel_world_size() if is_expert else
                ps.get_tensor_model_parallel_world_size())

    class _Linear(nn.Module):
        split = "column"

        def __init__(self, input_size, output_size, *, config=None, bias=False, is_expert=False, parallel_mode=None,
                     **_):
            super().__init__()
            tp = 1 if parallel_mode == "duplicated" else tp_size(is_expert)
            out, inp = (output_size // tp, input_size) if self.split == "column" else (output_size, input_size // tp)
            self.weight = nn.Parameter(torch.zeros(out, inp))
            if bias:
                self.bias = nn.Parameter(torch.zeros(out))
            self.fp8_meta = {}

        def init_fp8_metadata(self):
            pass

    class TEColumnParallelLinear(_Linear):
        pass

    class TERowParallelLinear(_Linear):
        split = "row"

    class TELinear(_Linear):
        pass

    class TELayerNormColumnParallelLinear(_Linear):
        def __init__(self, input_size, output_size, **kw):
            super().__init__(input_size, output_size, **kw)
            self.layer_norm_weight = nn.Parameter(torch.ones(input_size))

    class TENorm(nn.Module):
        def __new__(cls, config, hidden_size, eps=1e-5, **_):
            norm = nn.Module()
            norm.weight = nn.Parameter(torch.ones(hidden_size))
            return norm

    class TEDotProductAttention(nn.Module):
        def __init__(self, *a, **k):
            super().__init__()

    return SimpleNamespace(TEColumnParallelLinear=TEColumnParallelLinear, TERowParallelLinear=TERowParallelLinear,
                           TELinear=TELinear, TELayerNormColumnParallelLinear=TELayerNormColumnParallelLinear,
                           TENorm=TENorm, TEDotProductAttention=TEDotProductAttention)


def install_stand_in_te(te) -> None:
    """megatron-core's spec functions without TE: its TESpecProvider's choices (extensions/
    transformer_engine_spec_provider.py: SequentialMLP of TE column/row linears without grouped GEMM, TENorm for the
    q/k norms) with the stand-in classes, where gpt_layer_specs, the MoE and MTP specs look them up."""
    import megatron.core.models.gpt.gpt_layer_specs as specs
    import megatron.core.models.gpt.moe_module_specs as moe_specs
    import megatron.core.transformer.multi_latent_attention as mla
    from megatron.core.models.backends import BackendSpecProvider
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP

    class Provider(BackendSpecProvider):
        def linear(self):
            return te.TELinear

        def column_parallel_linear(self):
            return te.TEColumnParallelLinear

        def row_parallel_linear(self):
            return te.TERowParallelLinear

        def fuse_layernorm_and_linear(self):
            return True

        def column_parallel_layer_norm_linear(self):
            return te.TELayerNormColumnParallelLinear

        def layer_norm(self, rms_norm: bool = False, for_qk: bool = False):
            return te.TENorm

        def core_attention(self):
            return te.TEDotProductAttention

        def grouped_mlp_modules(self, moe_use_grouped_gemm, moe_use_legacy_grouped_gemm):
            assert not moe_use_grouped_gemm
            return SequentialMLP, MLPSubmodules(linear_fc1=te.TEColumnParallelLinear,
                                                linear_fc2=te.TERowParallelLinear)

        def activation_func(self):
            return None

    for module in (specs, moe_specs):
        module.TESpecProvider = Provider
    specs.TENorm = te.TENorm
    specs.HAVE_TE = True
    mla.TELinear, mla.TEColumnParallelLinear = te.TELinear, te.TEColumnParallelLinear
    if getattr(mla, "Linear", None) is None:
        mla.Linear = te.TELinear


def spec_table(kind: str, te: bool) -> list[tuple[str, str, tuple]]:
    """(megatron-core parameter, canonical name, local shape) of a tiny `kind` built by the engine's
    _build_megatron pieces on megatron-core's TE spec (te) or local spec, through MegatronCoreTrainer._param_table."""
    import argparse

    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec

    from train.config import add_arguments, from_namespace
    from train.engines.megatron_core.config import transformer_config
    from train.engines.megatron_core.modules import RMSNorm, local_spec_layer
    from train.engines.megatron_core.trainer import MegatronCoreTrainer
    from train.loop import run_layout
    from train.parallel.groups import build_groups

    name, over = MODELS[kind]
    m = model_config(name, **over)
    p = argparse.ArgumentParser()
    add_arguments(p)
    cfg = from_namespace(p.parse_args(["--load", "ck", "--data-path", "d", "--micro-batch-size", "1",
                                       "--global-batch-size", "1"]))
    dims = run_layout(cfg, world=1)
    tc = transformer_config(m, dims, cfg.run, sp=False, dtype=torch.float32, on_cpu=True, moe_args=cfg.moe, te=te,
                               fp8=cfg.fp8)
    spec = get_gpt_decoder_block_spec(tc, use_transformer_engine=te, normalization="RMSNorm")
    if not te:
        spec.layer_norm = RMSNorm
        for layer in spec.layer_specs:
            local_spec_layer(layer, m, False)
    mtp = get_gpt_mtp_block_spec(tc, spec, use_transformer_engine=te) if m.mtp_num_layers else None
    for layer in (mtp.layer_specs if mtp is not None and not te else ()):
        layer.submodules.enorm = layer.submodules.hnorm = layer.submodules.layer_norm = RMSNorm
    model = GPTModel(tc, spec, vocab_size=m.padded_vocab_size(1), max_sequence_length=m.max_position_embeddings,
                     mtp_block_spec=mtp, share_embeddings_and_output_weights=m.tie_word_embeddings,
                     position_embedding_type="rope", rotary_base=int(m.rotary_base))
    assert ps.get_tensor_model_parallel_world_size() == 1
    trainer = SimpleNamespace(model_cfg=m, layout=dims.model_parallel, groups=build_groups(dims), chunks=[model])
    table = MegatronCoreTrainer._param_table(trainer)
    return [(lp.name.split("/", 1)[1], lp.spec.name, tuple(lp.param.shape)) for lp in table], model


def _names_main(kinds: list[str]) -> None:
    """In a process of its own (megatron-core registers pickle globals; the TE stand-ins patch its spec modules):
    each kind's TE-spec and local-spec tables, as JSON."""
    import contextlib
    import warnings

    warnings.simplefilter("ignore")
    from tests.megatron_oracle import init_megatron_cpu

    init_megatron_cpu()
    from train.engines.megatron_core.runtime import cpu_stand_ins, import_megatron

    import_megatron()
    cpu_stand_ins()  # the MoE dispatcher's stream, as the engine on the CPU

    local = {k: spec_table(k, te=False)[0] for k in kinds}
    install_stand_in_te(stand_in_te())
    out = {}
    for k in kinds:
        rows, model = spec_table(k, te=True)
        from train.engines.megatron_core.state import FP8State

        state = FP8State.of(fp8cfg("--fp8-format", "hybrid"), [model], [0], 0, model.config, every_rank=False)
        out[k] = {"te": rows, "local": local[k], "fp8_modules": sorted(n for n, _ in state.modules)}
    from megatron.core.transformer.transformer_config import TransformerConfig

    from train.engines.megatron_core.config import fp8_fields

    out["fp8_accepted"] = []
    for flags in FP8_FLAGS:
        f = fp8_fields(fp8cfg(*flags), 4, 2)
        tc = TransformerConfig(num_layers=4, hidden_size=64, num_attention_heads=4, pipeline_model_parallel_size=2,
                               pipeline_dtype=torch.float32, **f)
        out["fp8_accepted"].append({k: getattr(tc, k) for k in f})
    with contextlib.suppress(Exception):
        torch.distributed.destroy_process_group()
    print("TABLES " + json.dumps(out))


@pytest.fixture(scope="module")
def tables():
    r = subprocess.run([sys.executable, __file__, *MODELS], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1"), cwd=REPO)
    lines = [line for line in r.stdout.splitlines() if line.startswith("TABLES ")]
    assert r.returncode == 0 and lines, r.stderr[-4000:]
    return json.loads(lines[0].removeprefix("TABLES "))


@needs_megatron
@pytest.mark.parametrize("kind", list(MODELS))
def test_te_spec_names_map_to_canonical(tables, kind):
    """Every parameter megatron-core's TE spec builds maps to a canonical tensor of the sharding table with its
    local shape (the engine's _param_table: it raises otherwise), and the TE spec covers exactly the canonical tensors
    the local spec covers: TE's fused norms (linear_qkv / linear_fc1 / MLA's up projections' layer_norm_weight) are
    the local spec's separate norms (checkpoint.megatron's naming)."""
    t = tables[kind]
    te = {(c, tuple(s)) for _, c, s in t["te"]}
    assert te == {(c, tuple(s)) for _, c, s in t["local"]}
    names = {n for n, _, _ in t["te"]}
    fused = [n for n in names if n.endswith("layer_norm_weight")]
    if kind in ("llama", "qwen3"):  # both norms fused into the following linear
        assert any(".self_attention.linear_qkv.layer_norm_weight" in n for n in fused)
        assert any(".mlp.linear_fc1.layer_norm_weight" in n for n in fused)
    if kind == "qwen3":
        assert any(n.endswith("self_attention.q_layernorm.weight") for n in names)
    if kind == "mixtral":  # TENorm before the router; SequentialMLP's TE linears
        assert any(n.endswith("pre_mlp_layernorm.weight") for n in names)
        assert any(".mlp.experts.local_experts.3.linear_fc2.weight" in n for n in names)
    if kind.startswith("deepseek"):  # the latent norms fused into the up projections (qk_layernorm on TE's spec)
        assert any(n.endswith("self_attention.linear_kv_up_proj.layer_norm_weight") for n in names)
        assert any(n.endswith("input_layernorm.weight") for n in names)
    if kind == "deepseek_v3":
        assert any(n.endswith("self_attention.linear_q_up_proj.layer_norm_weight") for n in names)
        assert any(n.startswith("mtp.layers.0.") for n in names)
    # the modules whose FP8 delayed-scaling state is kept: every TE linear of the decoder (and MTP), by the names of
    # their weights; for a dense Llama exactly the native TE backend's (train/te.py TEBackend._linears)
    mods = t["fp8_modules"]
    assert mods == sorted({n.rsplit(".", 1)[0] for n in names if n.startswith(("decoder.", "mtp."))
                           and n.endswith(".weight") and ("linear_" in n.rsplit(".", 2)[-2] or "eh_proj" in n)})
    if kind == "llama":
        assert mods == sorted(f"decoder.layers.{i}.{part}.{n}" for i in range(2) for part, ns in (
            ("self_attention", ("linear_qkv", "linear_proj")), ("mlp", ("linear_fc1", "linear_fc2"))) for n in ns)


def test_packed_documents_with_te_attention_refused():
    """TE's core attention takes its own causal mask: per-document masks (--reset-attention-mask) are refused on TE's
    layer spec for every model (the local spec's attention takes the engine's mask as given)."""
    from train.engines.megatron_core.checks import NotCovered, check_packing

    docs = SimpleNamespace(reset_position_ids=False, reset_attention_mask=True)
    check_packing(model_config("llama"), docs, te_attention=False)
    with pytest.raises(NotCovered, match="--reset-attention-mask: Transformer Engine's core attention"):
        check_packing(model_config("llama"), docs, te_attention=True)


def test_latent_norm_epsilon_refused_on_te_spec():
    """DeepSeek's latent norms take 1e-6; TE's fused norms the config's epsilon: another rms_norm_eps is refused."""
    from train.engines.megatron_core.checks import NotCovered
    from train.engines.megatron_core.config import te_spec_fields

    assert te_spec_fields(model_config("deepseek_v3", rms_norm_eps=1e-6), True) == {"qk_layernorm": True}
    assert te_spec_fields(model_config("deepseek_v3", rms_norm_eps=1e-6), False) == {}
    assert te_spec_fields(model_config("llama"), True) == {}
    with pytest.raises(NotCovered, match="rms_norm_eps 1e-05 with multi-latent attention"):
        te_spec_fields(model_config("deepseek_v3"), True)


# -- the FP8 delayed-scaling state across engines ------------------------------------------------------------------

class FakeTELinear(torch.nn.Module):
    """A TE one-GEMM module as train/te.py reads it: fp8_meta's scaling_fwd / scaling_bwd (amax_history [H, n],
    scale [n]), set up by init_fp8_metadata (TE's initial state: zeros and ones)."""

    def __init__(self, history: int, set_up: bool = True) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(2, 2))
        self.history = history
        self.fp8_meta = {}
        if set_up:
            self.init_fp8_metadata()

    def init_fp8_metadata(self) -> None:
        self.fp8_meta["scaling_fwd"] = SimpleNamespace(amax_history=torch.zeros(self.history, 3), scale=torch.ones(3))
        self.fp8_meta["scaling_bwd"] = SimpleNamespace(amax_history=torch.zeros(self.history, 2), scale=torch.ones(2))


def fake_chunk(layers: int, experts: int, history: int, set_up: bool = True):
    """A model chunk with megatron-core's module names: decoder.layers.<local>.{self_attention.linear_qkv,
    linear_proj, mlp.linear_fc1 / fc2 or mlp.experts.local_experts.<e>.*}, a TE attention (no weight) and a
    non-TE output layer."""
    from torch import nn

    def lin():
        return FakeTELinear(history, set_up)

    chunk = nn.Module()
    chunk.decoder = nn.Module()
    chunk.decoder.layers = nn.ModuleList()
    for _ in range(layers):
        layer = nn.Module()
        layer.self_attention = nn.Module()
        layer.self_attention.linear_qkv, layer.self_attention.linear_proj = lin(), lin()
        layer.self_attention.core_attention = nn.Module()
        layer.self_attention.core_attention.fp8_meta = {}  # TE's attention: not a linear
        layer.mlp = nn.Module()
        if experts:
            layer.mlp.experts = nn.Module()
            layer.mlp.experts.local_experts = nn.ModuleList()
            for _ in range(experts):
                e = nn.Module()
                e.linear_fc1, e.linear_fc2 = lin(), lin()
                layer.mlp.experts.local_experts.append(e)
        else:
            layer.mlp.linear_fc1, layer.mlp.linear_fc2 = lin(), lin()
        chunk.decoder.layers.append(layer)
    chunk.output_layer = nn.Linear(2, 2)
    return chunk


def test_fp8_state_names_and_round_trip():
    """The engine's FP8 state (FP8State over megatron-core's TE linears) has the native engine's form and global
    names (decoder.layers.<global layer>..., experts by global index), loads back into modules TE has not set up yet
    (set up first under the run's FP8 context), and refuses a checkpoint missing a module or with another history
    length in one line."""
    from train.engines.megatron_core.state import Backend, FP8State
    from train.fp8 import ROLES, STATE_VERSION, DelayedScalingState

    fp8 = fp8cfg("--fp8-format", "hybrid", "--fp8-amax-history-len", "4")
    # PP stage 1 of 2 with 2 chunks (VPP): layers 1 and 3 here; EP rank 1 of 2 with 2 local experts (global 2, 3)
    chunks = [fake_chunk(1, 2, 4), fake_chunk(1, 2, 4)]
    entered = []
    state = FP8State.of(fp8, chunks, [1, 3], 2, config=None, every_rank=True)
    state.context = lambda: entered.append(1) or __import__("contextlib").nullcontext()
    g = torch.Generator().manual_seed(0)
    for _, mod in state.modules:
        for which in ("scaling_fwd", "scaling_bwd"):
            mod.fp8_meta[which].amax_history.copy_(torch.rand(mod.fp8_meta[which].amax_history.shape, generator=g))
            mod.fp8_meta[which].scale.copy_(torch.rand(mod.fp8_meta[which].scale.shape, generator=g) * 100)
    backend = Backend("line", state)
    sd = backend.state_dict(SimpleNamespace(dims=SimpleNamespace(pp=1)))  # one process: this rank's
    assert sd["version"] == STATE_VERSION and sd["recipe"] == "delayed" and sd["format"] == "hybrid"
    modules = sorted({k.rsplit(".", 1)[0] for k in sd["tensors"]})
    assert modules == sorted(
        [f"decoder.layers.{layer}.self_attention.{n}" for layer in (1, 3) for n in ("linear_qkv", "linear_proj")]
        + [f"decoder.layers.{layer}.mlp.experts.local_experts.{e}.{n}" for layer in (1, 3) for e in (2, 3)
           for n in ("linear_fc1", "linear_fc2")])
    assert {k.rsplit(".", 1)[1] for k in sd["tensors"]} == set(ROLES)
    json.dumps(sd)  # JSON as it is
    # the native engine's local FP8 state reads the same names and values (train/fp8.py DelayedScalingState)
    names = [f"decoder.layers.1.self_attention.linear_qkv.{r}" for r in ROLES]
    native = DelayedScalingState(names, [torch.float8_e4m3fn] * 3, 4, "most_recent", 0, torch.device("cpu"))
    native.load_state_dict(sd["tensors"], "ckpt")
    qkv = chunks[0].decoder.layers[0].self_attention.linear_qkv.fp8_meta
    assert torch.equal(native.amax_history[:, 0], qkv["scaling_fwd"].amax_history[:, 0])
    assert torch.equal(native.amax_history[:, 2], qkv["scaling_bwd"].amax_history[:, 0])
    assert float(native.scale[1]) == float(qkv["scaling_fwd"].scale[1])
    # ...and a fresh engine (modules not set up yet) loads it: every history and scale back
    fresh = [fake_chunk(1, 2, 4, set_up=False), fake_chunk(1, 2, 4, set_up=False)]
    state2 = FP8State.of(fp8, fresh, [1, 3], 2, config=None, every_rank=True)
    state2.context = state.context
    Backend("line", state2).load_state_dict(json.loads(json.dumps(sd)), Path("ck"))
    assert len(entered) == len(state2.modules)  # each set up under the run's FP8 context
    for (n1, a), (n2, b) in zip(state.modules, state2.modules):
        assert n1 == n2
        for which, slots in (("scaling_fwd", slice(0, 2)), ("scaling_bwd", slice(0, 1))):  # the saved roles
            assert torch.equal(a.fp8_meta[which].amax_history[:, slots], b.fp8_meta[which].amax_history[:, slots])
            assert torch.equal(a.fp8_meta[which].scale[slots], b.fp8_meta[which].scale[slots])
    # strict: a module missing, another history length
    missing = dict(sd, tensors={k: v for k, v in sd["tensors"].items() if ".layers.3." not in k})
    with pytest.raises(ConfigError, match=r"no FP8 delayed-scaling state for 6 of this run's 12 TE linears "
                                          r"\(decoder.layers.3.self_attention.linear_qkv, ...\): the checkpoint's FP8 "
                                          "run kept them in high precision"):
        state2.load_state_dict(missing, "ck")
    other = FP8State.of(fp8, [fake_chunk(1, 2, 8), fake_chunk(1, 2, 8)], [1, 3], 2, config=None, every_rank=True)
    with pytest.raises(ConfigError, match="amax history of 4 steps, this run --fp8-amax-history-len 8"):
        other.load_state_dict(sd, "ck")
    # no delayed scaling: nothing kept (as native)
    assert FP8State.of(fp8cfg("--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"), chunks, [1, 3], 2, None,
                       True) is None
    assert Backend("line").state_dict(None) is None


if __name__ == "__main__":
    _names_main(sys.argv[1:])
