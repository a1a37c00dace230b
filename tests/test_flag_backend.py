"""Issue 32: the trainer never silently drops a flag (docs/TRAINING_FLAGS.md has the whole table).

Two parts:

- the Transformer Engine backend's packed-document path (--reset-attention-mask): TE's THD format with cu_seqlens,
  checked on the CPU against a stand-in `transformer_engine` module with TE's documented semantics (bshd: causal per
  row; thd: tokens flattened, one causal segment per cu_seqlens range, int32 cu_seqlens, padding mask types only),
  as tests/test_context_parallel.py checks flash-attn's calls. It checks how train/te.py calls TE (layouts,
  cu_seqlens, max_seqlen, the layout reaching every layer, full recompute), not TE's kernels, which never run here.
- one test per refusal: a flag that would have no effect in this run is one `shardkit: error:` line naming it, a
  non-zero exit, before any iteration runs (no `iteration` line, nothing saved).
"""
from __future__ import annotations

import copy
import itertools
import math
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from checkpoint.errors import ConfigError

EOD = 2


# -- a stand-in for transformer_engine.pytorch ------------------------------------------------------------------------

def _fake_te() -> dict[str, types.ModuleType]:
    """transformer_engine's modules as train/te.py uses them, in plain torch, with TE's documented semantics:
    LayerNormLinear (RMSNorm then linear, parameters layer_norm_weight / weight / bias), Linear, and
    DotProductAttention(query [b, s, H, d] bshd or [t, H, d] thd; GQA: query head h reads KV head h // (H / G);
    output [b, s, H*d] or [t, H*d]). Every attention call is recorded in `calls`."""
    from train.model import rms_norm

    calls: list[dict] = []

    def params(n_out: int, n_in: int, bias: bool, dtype, device):
        w = nn.Parameter(torch.randn(n_out, n_in, dtype=dtype, device=device) * 0.02)
        return w, (nn.Parameter(torch.zeros(n_out, dtype=dtype, device=device)) if bias else None)

    class LayerNormLinear(nn.Module):
        def __init__(self, in_features, out_features, eps=1e-5, bias=True, normalization="LayerNorm",
                     parallel_mode=None, tp_group=None, tp_size=1, sequence_parallel=False, params_dtype=None,
                     device=None):
            super().__init__()
            assert normalization == "RMSNorm" and tp_size == 1
            self.layer_norm_weight = nn.Parameter(torch.ones(in_features, dtype=params_dtype, device=device))
            self.weight, self.bias = params(out_features, in_features, bias, params_dtype, device)
            self.eps = eps

        def forward(self, x):  # [s, b, h]
            return F.linear(rms_norm(x, self.layer_norm_weight, self.eps), self.weight, self.bias)

    class Linear(nn.Module):
        def __init__(self, in_features, out_features, bias=True, parallel_mode=None, tp_group=None, tp_size=1,
                     sequence_parallel=False, params_dtype=None, device=None):
            super().__init__()
            self.weight, self.bias = params(out_features, in_features, bias, params_dtype, device)

        def forward(self, x):
            return F.linear(x, self.weight, self.bias)

    def one(q, k, v, causal, scale):  # [sq, H, d], [sk, G, d]; causal aligned top-left (TE's "causal")
        H, G = q.shape[1], k.shape[1]
        k, v = k.repeat_interleave(H // G, 1), v.repeat_interleave(H // G, 1)
        mask = None
        if causal:
            mask = torch.arange(k.shape[0])[None, :] <= torch.arange(q.shape[0])[:, None]
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                             attn_mask=mask, scale=scale)
        return out.transpose(0, 1).reshape(q.shape[0], -1)

    class DotProductAttention(nn.Module):
        def __init__(self, num_attention_heads, kv_channels, num_gqa_groups=None, attention_dropout=0.0,
                     qkv_format="sbhd", attn_mask_type="causal", tp_group=None, tp_size=1, sequence_parallel=False,
                     softmax_scale=None):
            super().__init__()
            self.qkv_format, self.attn_mask_type = qkv_format, attn_mask_type
            self.scale = softmax_scale or 1.0 / math.sqrt(kv_channels)

        def forward(self, query_layer, key_layer, value_layer, attention_mask=None, qkv_format=None,
                    cu_seqlens_q=None, cu_seqlens_kv=None, max_seqlen_q=None, max_seqlen_kv=None,
                    attn_mask_type=None, checkpoint_core_attention=False):
            fmt, mask_type = qkv_format or self.qkv_format, attn_mask_type or self.attn_mask_type
            q, k, v = query_layer, key_layer, value_layer
            calls.append({"format": fmt, "mask": mask_type, "cu_q": cu_seqlens_q, "cu_kv": cu_seqlens_kv,
                          "max_q": max_seqlen_q, "max_kv": max_seqlen_kv, "recompute": checkpoint_core_attention})
            if fmt == "bshd":
                assert mask_type == "causal" and cu_seqlens_q is None and q.dim() == 4
                return torch.stack([one(q[b], k[b], v[b], True, self.scale) for b in range(q.shape[0])])
            assert fmt == "thd" and q.dim() == 3, fmt
            assert mask_type in ("padding", "padding_causal", "padding_causal_bottom_right"), mask_type
            cq, ck = cu_seqlens_q.tolist(), cu_seqlens_kv.tolist()
            for cu, mx, t in ((cu_seqlens_q, max_seqlen_q, q.shape[0]), (cu_seqlens_kv, max_seqlen_kv, k.shape[0])):
                lens = [b - a for a, b in itertools.pairwise(cu.tolist())]
                assert cu.dtype == torch.int32 and cu.dim() == 1 and cu[0] == 0 and cu[-1] == t
                assert min(lens) > 0 and isinstance(mx, int) and mx == max(lens)
            return torch.cat([one(q[a:b], k[c:d], v[c:d], "causal" in mask_type, self.scale)
                              for (a, b), (c, d) in zip(itertools.pairwise(cq), itertools.pairwise(ck))])

    pt = types.ModuleType("transformer_engine.pytorch")
    pt.LayerNormLinear, pt.Linear, pt.DotProductAttention, pt.__version__ = (LayerNormLinear, Linear,
                                                                             DotProductAttention, "stand-in")
    pt.calls = calls
    recipe = types.ModuleType("transformer_engine.common.recipe")
    common = types.ModuleType("transformer_engine.common")
    common.recipe = recipe
    root = types.ModuleType("transformer_engine")
    root.pytorch, root.common = pt, common
    return {"transformer_engine": root, "transformer_engine.pytorch": pt, "transformer_engine.common": common,
            "transformer_engine.common.recipe": recipe}


@pytest.fixture
def fake_te(monkeypatch):
    mods = _fake_te()
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    return mods["transformer_engine.pytorch"]


def _tiny_cfg():
    from transformers import LlamaConfig

    from checkpoint.config import ModelConfig

    return ModelConfig.from_hf(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2,
                                           max_position_embeddings=64).to_dict())


def _groups():
    """One rank's Groups as the stage code reads them (no process group needed at world size 1)."""
    from checkpoint.run_layout import RunLayout

    return types.SimpleNamespace(dims=RunLayout.from_world(1, 1, 1), tp=None, cp=None, tp_rank=0, dp_rank=0,
                                 pp_rank=0, cp_rank=0, first_stage=True, last_stage=True)


def _packed_sample(b: int, s: int, seed: int = 5) -> torch.Tensor:
    """[b, s+1] tokens with EODs: row 0 several documents (one ends the row's first token), row 1 none."""
    gen = torch.Generator().manual_seed(seed)
    t = torch.randint(3, 64, (b, s + 1), generator=gen)
    t[0, [0, 5, 6, 13, 22]] = EOD
    return t


def _stages(recompute: str | None):
    """The same random tiny Llama twice: the plain model with packed-document attention (the reference) and its TE
    form on the stand-in, with the reference's weights; both with --recompute-granularity `recompute`."""
    from train.fp8 import FP8Config
    from train.model import GPTModel
    from train.parallel.context import Packing, apply_context_parallel
    from train.parallelize import apply_recompute
    from train.parallel.pipeline import StageStep
    from train.te import TEBackend

    cfg, groups = _tiny_cfg(), _groups()
    packing = Packing(EOD, reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True)
    torch.manual_seed(0)
    ref = GPTModel(cfg, cfg.vocab_size)
    te_model = copy.deepcopy(ref)
    steps = []
    for model in (ref, te_model):
        state, _ = apply_context_parallel(model, groups, "p2p", packing, recompute == "selective",
                                          torch.device("cpu"), torch.float32)
        apply_recompute(model, recompute, state)
        steps.append(StageStep(model, groups, state))
    backend = TEBackend.build(te_model, cfg, groups, FP8Config(), False, recompute)
    te_model.load_state_dict(ref.state_dict())  # the canonical names: the same parameters
    return steps[0], backend.wrap(steps[1]), backend, packing


@pytest.mark.parametrize("recompute", [None, "full", "selective"])
def test_te_packed_documents_go_through_thd(fake_te, recompute):
    """--reset-attention-mask (with --reset-position-ids and --eod-mask-loss) on the TE backend: every layer's
    attention is one THD call with the micro-batch's document boundaries as cu_seqlens (rows x documents), and the
    loss and every gradient equal the plain backend's packed-document attention; also under full-layer recompute,
    whose backward re-runs the layers outside the micro-batch's forward."""
    from train.parallel.context import prepare_micro_batch

    ref_step, te_step, backend, packing = _stages(recompute)
    sample = _packed_sample(2, 32)
    ids, labels, extras = prepare_micro_batch(sample, 1, 0, packing)
    want = ref_step(None, ids, labels, extras)
    want.backward()
    fake_te.calls.clear()
    got = te_step(None, ids, labels, extras)
    got.backward()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    ref_grads = dict(ref_step.model.named_parameters())
    for name, p in te_step.model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name].grad, atol=1e-5, rtol=1e-4, msg=name)
    # row 0: documents [0], [1..5], [6], [7..13], [14..22], [23..31]; row 1: one document of 32 tokens
    cu = [0, 1, 6, 7, 14, 23, 32, 64]
    forward_calls = 2 * (2 if recompute == "full" else 1)  # full recompute re-runs each layer's forward
    assert len(fake_te.calls) == forward_calls
    for c in fake_te.calls:
        assert c["format"] == "thd" and c["mask"] == "padding_causal"
        assert c["cu_q"].tolist() == cu and c["cu_kv"].tolist() == cu and c["max_q"] == c["max_kv"] == 32
        assert c["recompute"] == (recompute == "selective")
    assert "thd with cu_seqlens for packed documents" in backend.describe()


def test_te_without_documents_stays_bshd_and_masks_matter(fake_te):
    """No packed documents: the bshd causal call as before. And the check above can fail: the same micro-batch
    attended to as one causal sequence per row (the documents dropped) gives another loss."""
    from train.parallel.context import Packing, prepare_micro_batch

    ref_step, te_step, _, packing = _stages(None)
    sample = _packed_sample(2, 32)
    ids, labels, extras = prepare_micro_batch(sample, 1, 0, packing)
    want = ref_step(None, ids, labels, extras)
    plain = prepare_micro_batch(sample, 1, 0, Packing(EOD, reset_position_ids=True, eod_mask_loss=True))
    fake_te.calls.clear()
    got = te_step(None, *plain)
    assert [c["format"] for c in fake_te.calls] == ["bshd", "bshd"]
    assert abs(float(got.detach()) - float(want.detach())) > 10 * 1e-5  # 10x the tolerance the THD path meets


def test_te_attention_never_runs_unwrapped_or_under_cp(fake_te):
    """Without TEBackend.wrap a TE layer cannot know the micro-batch's documents: it refuses to run rather than
    attend across them; packed documents with CP > 1 are a ConfigError even if they got past the start-up checks."""
    from train.parallel.context import prepare_micro_batch
    from train.te import TESelfAttention

    _, te_step, _, packing = _stages(None)
    layers = [layer.self_attention for layer in te_step.model.decoder.layers.values()]
    assert all(isinstance(a, TESelfAttention) for a in layers)
    ids, labels, extras = prepare_micro_batch(_packed_sample(1, 32), 1, 0, packing)
    layers[0].cp = 2
    with pytest.raises(ConfigError, match="--reset-attention-mask with --context-parallel-size 2"):
        te_step(None, ids, labels, extras)
    layers[0].cp = 1
    from train import te as te_mod

    layers[0].layouts = te_mod._UNWRAPPED
    with pytest.raises(RuntimeError, match="outside TEBackend.wrap"):
        te_step(None, ids, labels, extras)


def test_te_chosen_by_default_refuses_packed_documents_under_cp(monkeypatch):
    """Where TE would be chosen by default (installed, a GPU), --reset-attention-mask with --cp 2 is refused before
    anything is built, naming --transformer-impl local; the local choice (no GPU) passes."""
    import argparse

    from train import te as te_mod
    from train.config import add_arguments, check_for_model, from_namespace

    p = argparse.ArgumentParser()
    add_arguments(p)
    cfg = from_namespace(p.parse_args(["--load", "ck", "--data-path", "d", "--cp", "2", "--reset-attention-mask"]))
    m = _tiny_cfg()
    monkeypatch.setattr(te_mod, "te_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ConfigError, match=r"chosen by default.*use --transformer-impl local"):
        check_for_model(cfg, m)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    check_for_model(cfg, m)


# -- refusals through the CLI ------------------------------------------------------------------------------------------

COMMON = ["--seq-length", "32", "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "2",
          "--lr", "1e-3", "--log-interval", "1",
          "--attention-dropout", "0", "--hidden-dropout", "0"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    from tests.corpus import tiny_llama_setup

    return tiny_llama_setup(tmp_path_factory.mktemp("flag-llama"))


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory) -> Path:
    from shardkit.cli import main as cli
    from tests.corpus import write_pattern_corpus
    from tests.moe_models import build

    root = tmp_path_factory.mktemp("flag-mixtral")
    build("mixtral", root / "hf")
    assert cli(["convert", "hf-to-mcore", str(root / "hf"), str(root / "ck"), "--quiet", "--no-verify"]) == 0
    write_pattern_corpus(root / "data")
    return root


def refused(root: Path, tmp_path: Path, capsys, *flags: str, names: tuple[str, ...] = ()) -> str:
    """Run continue-pretrain in this process with `flags`; it must stop with one `shardkit: error:` line naming
    `names` (the first flag by default), exit non-zero, print no iteration and save nothing."""
    from shardkit.cli import main as cli

    save = tmp_path / "save"
    argv = ["continue-pretrain", "--load", str(root / "ck"), "--data-path", str(root / "data"), *COMMON, *flags]
    if "--no-save" not in flags:
        argv += ["--save", str(save)]
    else:
        argv.remove("--no-save")
    capsys.readouterr()
    try:
        rc = cli(argv)
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc not in (0, None) and len(lines) == 1, (rc, err)
    assert lines[0].startswith("shardkit: error:"), lines[0]
    for name in names or (flags[0],):
        assert name in lines[0], (name, lines[0])
    assert "iteration 1" not in out and not save.exists(), out
    return lines[0]


MOE_ON_DENSE = [("--moe-router-load-balancing-type", "seq_aux_loss"), ("--moe-aux-loss-coeff", "0.01"),
                ("--moe-router-bias-update-rate", "0.01"), ("--moe-router-dtype", "fp32"),
                ("--moe-token-dispatcher-type", "allgather")]


@pytest.mark.parametrize("flag,value", MOE_ON_DENSE, ids=[f for f, _ in MOE_ON_DENSE])
def test_moe_flag_on_dense_model(llama, tmp_path, capsys, flag, value):
    refused(llama, tmp_path, capsys, flag, value, names=(flag, "dense model"))


def test_num_experts_on_dense_model(llama, tmp_path, capsys):
    refused(llama, tmp_path, capsys, "--num-experts", "8", names=("--num-experts 8", "no routed experts"))


def test_num_experts_disagrees(mixtral, tmp_path, capsys):
    refused(mixtral, tmp_path, capsys, "--num-experts", "8", names=("--num-experts 8", "4 routed experts"))


def test_mtp_loss_scaling_factor_without_mtp(llama, tmp_path, capsys):
    refused(llama, tmp_path, capsys, "--mtp-loss-scaling-factor", "0.3", names=("--mtp-loss-scaling-factor", "no multi-token"))


def test_expert_bias_rate_without_expert_bias(mixtral, tmp_path, capsys):
    refused(mixtral, tmp_path, capsys, "--moe-router-bias-update-rate", "0.01", names=("--moe-router-bias-update-rate",
                                                                                       "no expert bias"))


def test_aux_loss_coeff_without_aux_loss(mixtral, tmp_path, capsys):
    refused(mixtral, tmp_path, capsys, "--moe-aux-loss-coeff", "0.01", "--moe-router-load-balancing-type", "none",
            names=("--moe-aux-loss-coeff", "none"))


@pytest.mark.parametrize("flag", ["--num-layers-at-start-in-bf16", "--num-layers-at-end-in-bf16"])
@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "no-fp8"])
def test_bf16_layer_counts_without_first_last_layers_bf16(llama, tmp_path, capsys, flag, fp8):
    line = refused(llama, tmp_path, capsys, flag, "2", *(["--fp8", "hybrid"] if fp8 else []))
    assert ("--first-last-layers-bf16" in line) if fp8 else ("needs FP8" in line)


def test_fp8_margin_with_tensorwise(llama, tmp_path, capsys):
    refused(llama, tmp_path, capsys, "--fp8-margin", "1", "--fp8", "hybrid", "--fp8-recipe", "tensorwise",
            names=("--fp8-margin", "delayed only"))


def test_tensorboard_dir_without_tensorboard(llama, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as where tensorboard is not installed
    tb = tmp_path / "tb"
    refused(llama, tmp_path, capsys, "--tensorboard-dir", str(tb), names=("--tensorboard-dir", "pip install tensorboard",
                                                                          f"--log-dir {tb}"))
    assert not tb.exists()


def test_tensorboard_dir_and_log_dir_differ(llama, tmp_path, capsys):
    refused(llama, tmp_path, capsys, "--tensorboard-dir", str(tmp_path / "a"), "--log-dir", str(tmp_path / "b"),
            names=("--tensorboard-dir", "--log-dir"))


def test_eod_token_id_without_packing(llama, tmp_path, capsys):
    refused(llama, tmp_path, capsys, "--eod-token-id", "2", names=("--eod-token-id", "--reset-attention-mask"))


@pytest.mark.parametrize("flags", [["--save-interval", "1"], ["--async-save"], ["--save-format", "torch_dist"]],
                         ids=["save-interval", "async-save", "save-format"])
def test_save_flags_without_save(llama, tmp_path, capsys, flags):
    refused(llama, tmp_path, capsys, *flags, "--no-save", names=(flags[0], "without --save"))


def test_exit_signal_without_handler(llama, tmp_path, capsys):
    refused(llama, tmp_path, capsys, "--exit-signal", "SIGUSR1", names=("--exit-signal SIGUSR1",
                                                                        "--exit-signal-handler"))


@pytest.mark.parametrize("flag", ["--wandb-exp-name", "--wandb-save-dir"])
def test_wandb_flags_without_project(llama, tmp_path, capsys, flag):
    refused(llama, tmp_path, capsys, flag, str(tmp_path / "w"), names=(flag, "--wandb-project"))


def test_cp_comm_type_without_cp(llama, tmp_path, capsys):
    refused(llama, tmp_path, capsys, "--cp-comm-type", "all_gather", names=("--cp-comm-type", "--context-parallel-size"))


@pytest.mark.parametrize("flags,names", [
    (["--eval-interval", "1"], ("--eval-interval", "--eval-iters")),
    (["--eval-iters", "1"], ("--eval-iters", "--eval-interval")),
    (["--eval-interval", "1", "--eval-iters", "1", "--split", "100,0,0"], ("--eval-interval", "--split 100,0,0")),
], ids=["interval-alone", "iters-alone", "no-valid-split"])
def test_evaluation_flags_that_evaluate_nothing(llama, tmp_path, capsys, flags, names):
    refused(llama, tmp_path, capsys, *flags, names=names)


def test_lr_warmup_init_without_warmup(llama, tmp_path, capsys):
    refused(llama, tmp_path, capsys, "--lr-warmup-init", "1e-4", names=("--lr-warmup-init", "--lr-warmup-iters"))


@pytest.mark.parametrize("flags", [["--lr-wsd-decay-style", "linear"], ["--lr-wsd-decay-iters", "1"]],
                         ids=["style", "iters"])
def test_wsd_flags_without_wsd(llama, tmp_path, capsys, flags):
    refused(llama, tmp_path, capsys, *flags, names=(flags[0], "--lr-decay-style WSD"))


def test_te_packed_documents_under_cp_refused_at_start(llama, tmp_path, capsys):
    """Explicit TE with --reset-attention-mask and --cp 2: refused before the install check (so here too, without
    TE), naming both flags and the backend to use instead."""
    refused(llama, tmp_path, capsys, "--transformer-impl", "transformer_engine", "--cp", "2", "--reset-attention-mask",
            names=("--reset-attention-mask", "--context-parallel-size 2", "--transformer-impl local"))


def test_te_recipe_without_te_form_refused_at_start(llama, tmp_path, capsys):
    refused(llama, tmp_path, capsys, "--transformer-impl", "transformer_engine", "--fp8", "hybrid", "--fp8-recipe",
            "tensorwise", "--no-fp8-wgrad", names=("--no-fp8-wgrad", "--fp8-recipe delayed only"))


def test_vpp_without_pipeline(llama, tmp_path, capsys):
    """--vpp 2 at --pp 1 used to get past start-up and die at step 1 with a lost-rank message."""
    refused(llama, tmp_path, capsys, "--vpp", "2", names=("--virtual-pipeline-model-parallel-size 2",
                                                          "--pipeline-model-parallel-size > 1"))


@pytest.mark.parametrize("flags", [["--log-dir", "LOGS"], ["--tensorboard-dir", "LOGS"], ["--wandb-project", "p"],
                                   ["--peak-tflops", "100"]], ids=["log-dir", "tensorboard-dir", "wandb", "peak"])
def test_logging_flags_with_log_interval_zero(llama, tmp_path, capsys, flags):
    flags = [str(tmp_path / "logs") if f == "LOGS" else f for f in flags]
    refused(llama, tmp_path, capsys, *flags, "--log-interval", "0", names=(flags[0], "--log-interval 0"))


def test_te_full_recompute_with_fp8_refused_at_start(llama, tmp_path, capsys):
    refused(llama, tmp_path, capsys, "--transformer-impl", "transformer_engine", "--fp8", "hybrid",
            "--recompute-granularity", "full", names=("--recompute-granularity full with FP8", "selective"))
