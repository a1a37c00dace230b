"""Issue 41, part 1: every Megatron-LM flag is known to `continue-pretrain` (train/config.py; the flag list is
checkpoint/megatron_lm_args.py OPTIONS, generated from Megatron-LM core_v0.16.1's parser).

Megatron-LM's own example command lines (examples/llama/train_llama3_8b_h100_fp8.sh, examples/mixtral/
train_mixtral_8x7b_distributed.sh at core_v0.16.1; DeepSeek-V3 from examples/megatron_fsdp/sbatch_mfsdp_deepseek_v3.sh,
its PRETRAIN_ARGS) with the shapes scaled to the repo's tiny test models parse and run one iteration, every flag
accounted for: honoured (a flag of shardkit's own), checked against the checkpoint's model (silent when they agree),
noted (one `note:` line at start-up) or refused (one `shardkit: error:` line, tested flag by flag here). Dropout
(Megatron's default 0.1) changes the numbers, repeats itself for the same seed, survives recompute and resume, and
keeps tensor-parallel replicas identical; --no-load-optim restarts the LR schedule as Megatron-LM's load_checkpoint.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from checkpoint.errors import ConfigError
from tests.launcher import launch

NODROP = ["--attention-dropout", "0", "--hidden-dropout", "0"]


# -- the examples ------------------------------------------------------------------------------------------------------
# Each flag of the script, in its order, with the shapes of the tiny model (tests/corpus.py tiny_llama_setup,
# tests/moe_models.py) and run lengths of one or two iterations; `{ck}`, `{data}`, `{out}` are filled in.

LLAMA3_8B_FP8 = """
--use-mcore-models --num-layers 4 --hidden-size 128 --ffn-hidden-size 352 --num-attention-heads 8
--group-query-attention --num-query-groups 2 --kv-channels 16 --seq-length 32 --max-position-embeddings 256
--position-embedding-type rope --rotary-base 500000 --rotary-percent 1.0 --attention-dropout 0.0 --hidden-dropout 0.0
--swiglu --init-method-std 0.0134 --attention-backend fused --apply-layernorm-1p --untie-embeddings-and-output-weights
--disable-bias-linear
--micro-batch-size 1 --global-batch-size 4 --train-samples 4 --lr-decay-samples 4 --lr-warmup-samples 2
--lr 0.00015 --min-lr 0.00001 --decoupled-lr 5.0e-4 --decoupled-min-lr 4.5e-5 --lr-decay-style cosine --clip-grad 1.0
--weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --bf16 --grad-reduce-in-bf16 --cross-entropy-loss-fusion
--calculate-per-token-loss --manual-gc --empty-unused-memory-level 1 --exit-duration-in-mins 235
--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
--fp8-format hybrid --fp8-amax-history-len 4 --fp8-amax-compute-algo max --fp8-param-gather
--tensor-model-parallel-size 1 --context-parallel-size 1 --sequence-parallel
--mock-data --tokenizer-type NullTokenizer --vocab-size 1000 --data-cache-path {out}/cache --tiktoken-pattern v2
--data-path {data} --tokenizer-type HuggingFaceTokenizer --tokenizer-model {ck}
--split 99,1,0 --no-create-attention-mask-in-dataloader --no-mmap-bin-files --num-workers 1
--log-interval 1 --eval-iters 1 --eval-interval 1 --save-interval 1000 --log-throughput --profile
--profile-step-start 4 --profile-step-end 6 --ckpt-format torch_dist --distributed-timeout-minutes 60
--save {out} --load {ck} --tensorboard-dir {out}/tb
"""

MIXTRAL_8X7B = """
--use-mcore-models --disable-bias-linear --seq-length 32 --max-position-embeddings 128 --num-layers 2 --hidden-size 64
--ffn-hidden-size 96 --num-attention-heads 4 --init-method-std 0.01 --attention-dropout 0.0 --hidden-dropout 0.0
--normalization RMSNorm --position-embedding-type rope --swiglu --untie-embeddings-and-output-weights
--group-query-attention --num-query-groups 4 --no-masked-softmax-fusion --no-position-embedding --rotary-base 1000000
--num-experts 4 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2
--moe-grouped-gemm --moe-token-dispatcher-type alltoall --overlap-param-gather --overlap-grad-reduce
--tokenizer-type Llama2Tokenizer --tokenizer-model {ck} --data-path {data} --split 90,8,2
--micro-batch-size 1 --global-batch-size 4 --lr 1e-4 --train-iters 2 --lr-decay-iters 2 --lr-decay-style cosine
--min-lr 1.0e-5 --weight-decay 0.1 --lr-warmup-iters 1 --clip-grad 1.0 --bf16
--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --expert-model-parallel-size 1
--use-distributed-optimizer --sequence-parallel
--log-interval 1 --save-interval 10000 --eval-interval 1 --eval-iters 1 --save {out} --load {ck}
--tensorboard-dir {out}/tensorboard --no-load-optim --no-load-rng
"""

DEEPSEEK_V3 = """
--distributed-timeout-minutes 60 --tensor-model-parallel-size 1 --expert-model-parallel-size 1
--expert-tensor-parallel-size 1 --context-parallel-size 1 --use-distributed-optimizer --overlap-grad-reduce
--overlap-param-gather --use-mcore-models --sequence-parallel --use-flash-attn --disable-bias-linear
--micro-batch-size 1 --global-batch-size 4 --train-samples 4 --exit-duration-in-mins 220
--no-check-for-nan-in-loss-and-grad --manual-gc --manual-gc-interval 10 --recompute-granularity selective
--recompute-modules mlp moe mla_up_proj layernorm --transformer-impl transformer_engine --seq-length 32
--data-cache-path {out}/cache --tokenizer-type HuggingFaceTokenizer --tokenizer-model {ck} --data-path {data}
--split 99,1,0 --no-mmap-bin-files --no-create-attention-mask-in-dataloader --num-workers 6 --num-layers 3
--hidden-size 64 --ffn-hidden-size 96 --num-attention-heads 4 --kv-channels 128 --max-position-embeddings 128
--position-embedding-type rope --rotary-base 10000 --make-vocab-size-divisible-by 128 --normalization RMSNorm
--norm-epsilon 1e-5 --swiglu --untie-embeddings-and-output-weights --multi-latent-attention --attention-dropout 0.0
--hidden-dropout 0.0 --clip-grad 1.0 --weight-decay 0.1 --qk-layernorm --lr-decay-samples 4 --lr-warmup-samples 2
--lr-warmup-init 3.9e-7 --lr 3.9e-6 --min-lr 3.9e-7 --lr-decay-style cosine --adam-beta1 0.9 --adam-beta2 0.95
--num-experts 8 --moe-layer-freq [0]*1+[1]*2 --moe-ffn-hidden-size 32 --moe-shared-expert-intermediate-size 32
--moe-router-load-balancing-type seq_aux_loss --moe-router-topk 2 --moe-token-dispatcher-type flex
--moe-flex-dispatcher-backend hybridep --moe-router-pre-softmax --moe-grouped-gemm --moe-aux-loss-coeff 1e-4
--moe-router-group-topk 2 --moe-router-num-groups 4 --moe-router-topk-scaling-factor 2.5
--moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-router-bias-update-rate 1e-3
--moe-router-dtype fp32 --moe-permute-fusion --moe-router-force-load-balancing --q-lora-rank 48 --kv-lora-rank 32
--qk-head-dim 16 --qk-pos-emb-head-dim 8 --v-head-dim 16 --rotary-scaling-factor 4 --mscale 1.0 --mscale-all-dim 1.0
--mtp-num-layers 1 --mtp-loss-scaling-factor 0.1 --eval-iters 1 --eval-interval 1 --auto-detect-ckpt-format
--load {ck} --save {out} --save-interval 100 --dist-ckpt-strictness log_all --init-method-std 0.02
--log-timers-to-tensorboard --log-memory-to-tensorboard --log-num-zeros-in-grad --log-params-norm
--log-validation-ppl-to-tensorboard --log-throughput --log-interval 1 --logging-level 40
--tensorboard-dir {out}/tensorboard --bf16 --enable-experimental --wandb-project your_own_wandb_project
--wandb-exp-name DeepSeek-V3-TP1EP1
"""


def _tensorboard() -> bool:
    from train.metrics import tensorboard_missing

    return not tensorboard_missing()


def _wandb() -> bool:
    import importlib.util

    return importlib.util.find_spec("wandb") is not None


# flag -> a fragment of its one refusal line (shardkit's own refusals included: TE / tensorboard / wandb where absent)
REFUSED = {
    "llama3": {"--apply-layernorm-1p": "--apply-layernorm-1p disagrees with the checkpoint (llama: "
                                       "layernorm_zero_centered_gamma no)",
               "--decoupled-lr": "separate learning rate for the embedding and output layer is not implemented",
               "--decoupled-min-lr": "separate learning rate for the embedding and output layer",
               "--exit-duration-in-mins": "not implemented; stop by iterations (--exit-interval)",
               "--overlap-grad-reduce": "native engine does not overlap this communication",
               "--overlap-param-gather": "native engine does not overlap this communication",
               "--mock-data": "shardkit trains on real data only",
               "--profile": "shardkit starts no profiler", "--profile-step-start": "shardkit starts no profiler",
               "--profile-step-end": "shardkit starts no profiler",
               **({} if _tensorboard() else {"--tensorboard-dir": "TensorBoard cannot be written"})},
    "mixtral": {"--overlap-grad-reduce": "native engine does not overlap this communication",
                "--overlap-param-gather": "native engine does not overlap this communication",
                **({} if _tensorboard() else {"--tensorboard-dir": "TensorBoard cannot be written"})},
    "deepseek_v3": {"--overlap-grad-reduce": "native engine does not overlap this communication",
                    "--overlap-param-gather": "native engine does not overlap this communication",
                    "--exit-duration-in-mins": "not implemented",
                    "--recompute-modules": "shardkit's selective recompute covers core_attn only",
                    "--transformer-impl": "--transformer-impl transformer_engine:",
                    "--moe-token-dispatcher-type": "flex dispatcher needs DeepEP",
                    "--moe-flex-dispatcher-backend": "the flex dispatcher (DeepEP / HybridEP) is GPU-only",
                    "--moe-router-force-load-balancing": "a benchmarking mode (random routing)",
                    **({} if _tensorboard() else {"--tensorboard-dir": "TensorBoard cannot be written"}),
                    **({} if _wandb() else {"--wandb-project": "wandb is not installed",
                                            "--wandb-exp-name": "W&B logs only with --wandb-project"})},
}
EXAMPLES = {"llama3": ("llama", LLAMA3_8B_FP8), "mixtral": ("mixtral", MIXTRAL_8X7B),
            "deepseek_v3": ("deepseek_v3", DEEPSEEK_V3)}


def groups(text: str, **fill) -> list[list[str]]:
    """The command line as [flag, values...] groups."""
    out: list[list[str]] = []
    for tok in text.format(**fill).split():
        if tok.startswith("--"):
            out.append([tok])
        else:
            out[-1].append(tok)
    return out


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    from shardkit.cli import main as cli
    from tests import moe_models
    from tests.corpus import tiny_llama_setup

    root = tiny_llama_setup(tmp_path_factory.mktemp("megatron_flags"))
    for kind in ("mixtral", "deepseek_v3"):
        moe_models.build(kind, root / f"{kind}-hf")
        assert cli(["convert", "hf-to-mcore", str(root / f"{kind}-hf"), str(root / f"{kind}-ck"), "--quiet",
                    "--no-verify"]) == 0
    return root


def ck_of(root: Path, kind: str) -> Path:
    return root / ("ck" if kind == "llama" else f"{kind}-ck")


def parser():
    from shardkit.cli import build_parser

    return build_parser()


def config_errors(argv: list[str], model_ck: Path | None = None):
    """What continue-pretrain says about `argv` before anything trains: its ConfigError (validate, then the checks
    against the checkpoint's model) or None."""
    from checkpoint.reader import Checkpoint
    from train.config import check_for_model, from_namespace, validate
    from train.metrics import MetricsError

    cfg = from_namespace(parser().parse_args(["continue-pretrain", *argv]))
    try:
        validate(cfg)
        if cfg.run.wandb_project:
            from train.metrics import check_wandb

            check_wandb(cfg.run.wandb_project)
        if model_ck is not None:
            check_for_model(cfg, Checkpoint(model_ck).config)  # resolved through `latest`
    except (ConfigError, MetricsError) as e:
        return str(e)
    return None


def _shardkit_flags() -> set[str]:
    from train.config import MEGATRON_DEST

    p = parser()
    p._subparsers._group_actions[0].choices["continue-pretrain"].format_help()
    sub = p._subparsers._group_actions[0].choices["continue-pretrain"]
    return {o for a in sub._actions if not a.dest.startswith(MEGATRON_DEST) for o in a.option_strings}


# -- every flag of each example ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(EXAMPLES))
def test_every_example_flag_is_a_megatron_lm_flag(root, name):
    """The scripts are Megatron-LM's: each flag is in its parser (core_v0.16.1) or one shardkit adds with the same
    name (none here is shardkit-only)."""
    from checkpoint.megatron_lm_args import OPTIONS

    kind, text = EXAMPLES[name]
    for g in groups(text, ck="ck", data="data", out="out"):
        assert g[0] in OPTIONS, g[0]


@pytest.mark.parametrize("name,flag", [(n, f) for n in REFUSED for f in REFUSED[n]])
def test_example_refusals_one_line_each(root, name, flag):
    """Each refused flag of the examples, alone on a minimal command line: one line that names it and says why."""
    kind, text = EXAMPLES[name]
    ck = ck_of(root, kind)
    g = next(g for g in groups(text, ck=ck, data=root / "data", out=root / "x") if g[0] == flag)
    extra = ["--wandb-project", "p"] if flag == "--wandb-exp-name" and _wandb() else []
    base = ["--load", str(ck), "--data-path", str(root / "data"), *NODROP, *extra]
    if flag == "--wandb-exp-name":  # its refusal is for a missing project; the project's own is tested beside it
        base = ["--load", str(ck), "--data-path", str(root / "data"), *NODROP]
    err = config_errors(base + g, ck)
    assert err is not None and REFUSED[name][flag] in err, err
    assert "\n" not in err and flag in err


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_example_runs_one_iteration_every_flag_accounted_for(root, name):
    """The example without its refused flags trains (1-2 iterations); every other flag is honoured (shardkit's own),
    checked (a shape flag that agrees: silent), or noted in one `note:` line naming it."""
    from train.config import MEGATRON_NOTES, _checkpoint_values_keys

    kind, text = EXAMPLES[name]
    ck, out = ck_of(root, kind), root / f"out-{name}"
    gs = groups(text, ck=ck, data=root / "data", out=out)
    kept = [g for g in gs if g[0] not in REFUSED[name]]
    r = launch(1, *[t for g in kept for t in g])
    log = r.stdout + r.stderr
    from checkpoint.megatron_lm_args import OPTIONS

    own, checks = _shardkit_flags(), set(_checkpoint_values_keys())
    accounted = {}
    for g in kept:
        flag = g[0]
        dest = OPTIONS[flag][0]
        if flag in own:
            accounted[flag] = "honoured"
        elif dest in checks:
            accounted[flag] = "checked"
            assert f"{flag} " not in "".join(ln for ln in log.splitlines() if "disagrees" in ln)
        else:
            assert f"note: {flag}" in log, (flag, log[-3000:])
            accounted[flag] = "noted"
            if dest in MEGATRON_NOTES:
                assert MEGATRON_NOTES[dest] in log
    assert len(accounted) + len(REFUSED[name]) == len({g[0] for g in gs})
    assert "iteration 1/" in log and "done at iteration" in log, log[-3000:]
    # the defaults line does not appear: each example gives dropout and weight decay itself
    assert "defaults: Megatron-LM's" not in log


def test_every_sorted_dest_is_megatron_lms_and_aliases_reach_shardkits_flags(root):
    from checkpoint.megatron_lm_args import OPTIONS
    from train.config import MEGATRON_NOTES, MEGATRON_REFUSALS, _checkpoint_values_keys, from_namespace

    dests = {v[0] for v in OPTIONS.values()}
    for table in (MEGATRON_NOTES, MEGATRON_REFUSALS, _checkpoint_values_keys()):
        assert set(table) <= dests, set(table) - dests
    cfg = from_namespace(parser().parse_args(["continue-pretrain", "--persistent-save-interval", "5",
                                              "--disable-fp8-wgrad"]))
    assert cfg.checkpoint.save_interval == 5 and cfg.fp8.fp8_wgrad is False and cfg.megatron == ()


def test_recompute_activations_is_selective_and_llama3_rope_scaling_agrees(root):
    from train.config import from_namespace, megatron_flags

    cfg = from_namespace(parser().parse_args(["continue-pretrain", "--recompute-activations"]))
    assert cfg.run.recompute_granularity == "selective"
    assert any(n.startswith("note: --recompute-activations: Megatron-LM's older spelling") for n in megatron_flags(cfg))
    ck = ck_of(root, "llama")  # Llama 3.1-style scaling in the tiny Llama: Megatron-LM's --use-rope-scaling
    assert config_errors(["--load", str(ck), "--data-path", str(root / "data"), *NODROP, "--use-rope-scaling",
                          "--rope-scaling-factor", "8"], ck) is None


# -- refusals and mismatches, one test each --------------------------------------------------------------------------

SHAPE_MISMATCH = [  # (model, flag group, the checkpoint's value as the line shows it)
    ("llama", ["--ffn-hidden-size", "353"], "ffn_hidden_size 352"),
    ("llama", ["--group-query-attention", "--num-query-groups", "8"], "num_query_groups 2"),
    ("llama", ["--kv-channels", "32"], "kv_channels 16"),
    ("llama", ["--normalization", "LayerNorm"], "normalization RMSNorm"),
    ("llama", ["--position-embedding-type", "learned_absolute"], "position_embedding_type rope"),
    ("llama", ["--rotary-base", "10000"], "rotary_base 500000.0"),
    ("llama", ["--rotary-percent", "0.5"], "rotary_percent 1.0"),
    ("llama", ["--max-position-embeddings", "4096"], "max_position_embeddings 256"),
    ("llama", ["--norm-epsilon", "1e-05"], "layernorm_epsilon 1e-06"),
    ("llama", ["--make-vocab-size-divisible-by", "64"], "make_vocab_size_divisible_by 128"),
    ("llama", ["--add-qkv-bias"], "add_qkv_bias no"),
    ("llama", ["--multi-latent-attention"], "multi_latent_attention no"),
    ("llama", ["--moe-router-topk", "2"], "moe_router_topk none"),
    ("llama", ["--rotary-interleaved"], "rotary_interleaved no"),
    ("mixtral", ["--moe-router-topk", "1"], "moe_router_topk 2"),
    ("mixtral", ["--moe-ffn-hidden-size", "64"], "moe_ffn_hidden_size 96"),
    ("mixtral", ["--moe-router-pre-softmax"], "moe_router_pre_softmax no"),
    ("mixtral", ["--moe-layer-freq", "2"], "moe_layer_freq 1 1"),
    ("deepseek_v3", ["--q-lora-rank", "64"], "q_lora_rank 48"),
    ("deepseek_v3", ["--kv-lora-rank", "64"], "kv_lora_rank 32"),
    ("deepseek_v3", ["--qk-head-dim", "32"], "qk_head_dim 16"),
    ("deepseek_v3", ["--v-head-dim", "32"], "v_head_dim 16"),
    ("deepseek_v3", ["--moe-layer-freq", "[1]*3"], "moe_layer_freq 0 1 1"),
    ("deepseek_v3", ["--moe-router-score-function", "softmax"], "moe_router_score_function sigmoid"),
    ("deepseek_v3", ["--moe-router-topk-scaling-factor", "1.0"], "moe_router_topk_scaling_factor 2.5"),
    ("deepseek_v3", ["--mtp-num-layers", "2"], "mtp_num_layers 1"),
    ("deepseek_v3", ["--rotary-scaling-factor", "40.0"], "rotary_scaling_factor 4.0"),
    ("deepseek_v3", ["--moe-shared-expert-intermediate-size", "64"], "moe_shared_expert_intermediate_size 32"),
    ("deepseek_v3", ["--mscale", "2.0"], "mscale 1.0"),
    ("deepseek_v3", ["--mscale-all-dim", "0.5"], "mscale_all_dim 1.0"),
    ("deepseek_v3", ["--moe-router-num-groups", "8"], "moe_router_num_groups 4"),
    ("deepseek_v3", ["--moe-router-group-topk", "1"], "moe_router_group_topk 2"),
    ("deepseek_v3", ["--qk-pos-emb-head-dim", "16"], "qk_pos_emb_head_dim 8"),
    ("mixtral", ["--moe-router-enable-expert-bias"], "moe_router_enable_expert_bias no"),
    ("mixtral", ["--use-rope-scaling"], "use_rope_scaling no"),
    ("llama", ["--qk-layernorm"], "qk_layernorm no"),
    ("llama", ["--rope-scaling-factor", "32.0"], "rope_scaling_factor 8.0"),
]


@pytest.mark.parametrize("kind,flags,theirs", SHAPE_MISMATCH, ids=[f"{k}{f[-2] if len(f) > 1 else ''}{f[-1]}"
                                                                   for k, f, _ in SHAPE_MISMATCH])
def test_shape_mismatch_one_line(root, kind, flags, theirs):
    ck = ck_of(root, kind)
    err = config_errors(["--load", str(ck), "--data-path", str(root / "data"), *NODROP, *flags], ck)
    shown = " ".join(f for f in flags if f != "--group-query-attention")
    assert err == (f"{shown} disagrees with the checkpoint ({kind}: {theirs}); drop the flag or load the right "
                   "checkpoint"), err


def test_group_query_attention_alone_means_one_group(root):
    ck = ck_of(root, "llama")
    err = config_errors(["--load", str(ck), "--data-path", str(root / "data"), *NODROP, "--group-query-attention"], ck)
    assert err == ("--group-query-attention (with Megatron-LM's default --num-query-groups 1) disagrees with the "
                   "checkpoint (llama: num_query_groups 2); add --num-query-groups 2, or load the right checkpoint")


def test_other_flags_at_megatron_default_are_noted(root):
    from train.config import from_namespace, megatron_flags

    cfg = from_namespace(parser().parse_args(["continue-pretrain", "--softmax-type", "vanilla",
                                              "--no-persist-layer-norm", "--recompute-modules", "core_attn"]))
    notes = megatron_flags(cfg)
    assert "note: --recompute-modules core_attn: what shardkit's selective recompute covers (Megatron-LM's " \
        "default)" in notes
    assert "note: --softmax-type vanilla: Megatron-LM's default value, nothing to do" in notes
    assert any(n.startswith("note: --no-persist-layer-norm: a kernel / fusion choice") for n in notes)


def test_shape_flags_that_agree_are_silent(root):
    ck = ck_of(root, "deepseek_v3")
    agree = ["--moe-layer-freq", "[0]+[1]*2", "--moe-router-num-groups", "4", "--moe-router-group-topk", "2",
             "--mscale-all-dim", "1.0", "--moe-router-enable-expert-bias", "--qk-layernorm", "--kv-channels", "999",
             "--moe-router-pre-softmax"]  # kv-channels: unused by MLA; pre-softmax: unused with sigmoid scores
    assert config_errors(["--load", str(ck), "--data-path", str(root / "data"), *NODROP, *agree], ck) is None


REFUSALS = [  # one per refusal line added for Megatron-LM's flags (the examples' are above)
    (["--fp16"], "--fp16: fp16 training with loss scaling is not implemented; use --bf16"),
    (["--finetune"], "--finetune: use a weights-only --load"),
    (["--moe-layer-recompute"], "--moe-layer-recompute: use --recompute-granularity full"),
    (["--use-pytorch-profiler"], "--use-pytorch-profiler: shardkit starts no profiler"),
    (["--profile-ranks", "1"], "--profile-ranks 1: shardkit starts no profiler"),
    (["--hybrid-context-parallel"], "--hybrid-context-parallel: a Megatron-LM flag (hybrid_context_parallel) that "
                                    "shardkit's trainer does not implement; drop it"),
    (["--calculate-per-token-loss", "--eod-mask-loss"], "--calculate-per-token-loss with --eod-mask-loss"),
    (["--attention-dropout", "1.0"], "--attention-dropout 1.0: a dropout probability is in [0, 1)"),
    (["--hidden-dropout", "-0.1"], "--hidden-dropout -0.1: a dropout probability is in [0, 1)"),
    (["--attention-dropout", "0.1", "--cp", "2"], "--attention-dropout 0.1 with --context-parallel-size 2"),
    (["--attention-dropout", "0.1", "--reset-attention-mask"], "--attention-dropout 0.1 with --reset-attention-mask"),
    (["--recompute-method", "uniform"], "--recompute-method uniform: applies to --recompute-granularity full"),
    (["--recompute-granularity", "full", "--recompute-method", "block"],
     "--recompute-method block: needs --recompute-num-layers N"),
    (["--recompute-granularity", "full", "--recompute-num-layers", "1"],
     "--recompute-num-layers 1: needs --recompute-method uniform or block"),
    (["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "5"],
     "--recompute-num-layers 5: more than the 4 decoder layers per pipeline rank"),
]


@pytest.mark.parametrize("flags,line", REFUSALS, ids=[" ".join(f) for f, _ in REFUSALS])
def test_refusal_one_line(root, flags, line):
    ck = ck_of(root, "llama")
    base = ["--load", str(ck), "--data-path", str(root / "data")]
    if "--attention-dropout" not in flags and "--hidden-dropout" not in flags:
        base += NODROP
    err = config_errors(base + flags, ck)
    assert err is not None and err.startswith(line) and "\n" not in err, err


def test_cli_lines_megatron_flag_refused_unknown_flag_an_error(root):
    """Through the command line: a refused Megatron-LM flag and an unknown flag are each one `shardkit: error:` line
    (exit 2 / 1), never argparse's list of unrecognized Megatron-LM arguments."""
    base = ["--load", str(root / "ck"), "--data-path", str(root / "data"), "--train-iters", "1"]
    r = launch(1, *base, "--fp16", "--swiglu", check=False)
    err = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode != 0 and err[-1].startswith("shardkit: error: --fp16: fp16 training"), r.stderr[-2000:]
    assert "unrecognized" not in r.stderr
    r = launch(1, *base, "--no-such-flag", "--swiglu", "--use-flash-attn", check=False)
    err = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(err) == 1, r.stderr
    assert err[0].startswith("shardkit: error: ") and "unrecognized arguments: --no-such-flag (see" in err[0], err


def test_vocab_size_is_a_check_on_a_shardkit_checkpoint(root):
    r = launch(1, "--load", str(root / "ck"), "--data-path", str(root / "data"), "--train-iters", "1",
               "--vocab-size", "999", *NODROP, check=False)
    assert r.returncode != 0 and "--vocab-size 999 disagrees with the checkpoint" in r.stderr, r.stderr[-2000:]


# -- dropout, recompute, --no-load-optim (end to end) ---------------------------------------------------------------

TRAIN = ["--seq-length", "32", "--micro-batch-size", "1", "--global-batch-size", "4", "--lr", "1e-3",
         "--lr-warmup-iters", "1", "--min-lr", "1e-4", "--seed", "7"]


def losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def run(root: Path, name: str, *flags: str, iters: int = 3, load: Path | None = None) -> Path:
    out = root / name
    if not (out / "metrics.jsonl").exists():
        r = launch(1, "--load", str(load or root / "ck"), "--data-path", str(root / "data"), "--save", str(out),
                   "--train-iters", str(iters), *TRAIN, *flags)
        (out / "log.txt").write_text(r.stdout + r.stderr)
    return out


def test_dropout_default_changes_numbers_and_repeats(root):
    default = run(root, "drop-default")  # Megatron's defaults: 0.1 / 0.1, weight decay 0.01
    again = run(root, "drop-default-again")
    off = run(root, "drop-off", *NODROP)
    assert losses(default) == losses(again)  # the same seed, the same masks
    assert losses(default)[0] != losses(off)[0]
    log = (default / "log.txt").read_text()
    assert ("defaults: Megatron-LM's, which differ from earlier shardkit releases: --attention-dropout 0.1, "
            "--hidden-dropout 0.1 (no dropout before); --weight-decay 0.01 (0.1 before)") in log
    assert "| wd 0.01 |" in log
    seeded = run(root, "drop-seed8", "--seed", "8")
    assert losses(seeded)[0] != losses(default)[0]
    attn_only = run(root, "drop-attn", "--hidden-dropout", "0")
    assert losses(attn_only)[0] not in (losses(off)[0], losses(default)[0])


@pytest.mark.parametrize("flags", [["--recompute-granularity", "full"], ["--recompute-granularity", "selective"],
                                   ["--recompute-granularity", "full", "--recompute-method", "uniform",
                                    "--recompute-num-layers", "2"],
                                   ["--recompute-granularity", "full", "--recompute-method", "block",
                                    "--recompute-num-layers", "1"]],
                         ids=["full", "selective", "uniform2", "block1"])
def test_recompute_replays_dropout_masks(root, flags):
    """A recomputed forward draws the masks of its original forward (the streams replayed through checkpoint's
    context_fn): the same losses and gradient norms as without recompute."""
    base, rec = run(root, "drop-default"), run(root, "rec-" + "-".join(flags[1:]), *flags)
    rows = [[json.loads(ln)[k] for ln in (d / "metrics.jsonl").read_text().splitlines()] for d in (base, rec)
            for k in ("loss", "grad_norm")]
    assert rows[0] == rows[2] and rows[1] == rows[3]


def test_recompute_units_as_megatron_core():
    from train.parallelize import recompute_groups

    assert recompute_groups([0, 1, 2, 3, 4], "uniform", 2) == [[0, 1], [2, 3], [4]]
    assert recompute_groups([4, 5, 6], "block", 2) == [[4], [5]]
    assert recompute_groups([4, 5, 6], None, None) == [[4], [5], [6]]


def test_resume_with_dropout_is_exact(root):
    whole = run(root, "drop-default")
    first = run(root, "drop-resume", "--exit-interval", "2")
    assert len(losses(first)) == 2
    r = launch(1, "--load", str(first), "--data-path", str(root / "data"), "--save", str(first), "--train-iters", "3",
               *TRAIN)
    assert losses(first) == losses(whole), r.stdout[-2000:]


def test_no_load_optim_restarts_the_schedule(root):
    """Megatron-LM's load_checkpoint loads the scheduler with the optimizer: with --no-load-optim the iteration and
    data position are kept and the LR schedule starts again from its first step."""
    first = run(root, "sched-first", *NODROP, "--exit-interval", "2", iters=4)
    r = launch(1, "--load", str(first), "--data-path", str(root / "data"), "--save", str(root / "sched-restart"),
               "--train-iters", "4", "--no-load-optim", *TRAIN, *NODROP)
    rows = [json.loads(ln) for ln in (root / "sched-restart" / "metrics.jsonl").read_text().splitlines()]
    fresh = [json.loads(ln) for ln in (first / "metrics.jsonl").read_text().splitlines()]
    assert [row["iteration"] for row in rows] == [3, 4]
    assert [row["lr"] for row in rows] == [fresh[0]["lr"], fresh[1]["lr"]]  # warmup again, not the decayed LR
    assert "--no-load-optim: the LR/WD schedule restarts from its first step" in r.stdout + r.stderr


def test_dropout_streams_as_megatron_core():
    """Which stream each site draws from (megatron-core 0.16: TransformerLayer's bias-dropout-add outside any fork,
    DotProductAttention forks without sequence parallelism, the embedding forks with it)."""
    from train.dropout import DropoutRNG

    cpu = torch.device("cpu")
    r0, r1 = (DropoutRNG(7, 0, tp, False, cpu) for tp in (0, 1))
    draw = lambda g: torch.rand(4, generator=g)  # noqa: E731
    assert torch.equal(draw(r0.residual()), draw(r1.residual()))  # replicated activations: one mask
    assert torch.equal(draw(r0.embedding()), draw(r1.embedding()))
    assert not torch.equal(draw(r0.attention()), draw(r1.attention()))  # heads split over TP: a stream per rank
    s0, s1 = (DropoutRNG(7, 0, tp, True, cpu) for tp in (0, 1))
    assert not torch.equal(draw(s0.embedding()), draw(s1.embedding()))  # sequence-parallel slice: per rank
    p1 = DropoutRNG(7, 1, 0, False, cpu)  # another pipeline stage: seed + 100 (Megatron-LM's _set_random_seed)
    assert not torch.equal(draw(DropoutRNG(7, 0, 0, False, cpu).residual()), draw(p1.residual()))
    assert p1.seeds == (107, 107 + 2718)


# -- tensor parallelism: replicas stay identical ---------------------------------------------------------------------

def _tp_worker(rank: int, world: int, port: int, argv: list[str], out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    import torch.distributed as dist

    from checkpoint.sharding import Rule
    from train.config import from_namespace
    from train.loop import Trainer, init_distributed, shutdown_distributed

    init_distributed(5)
    cfg = from_namespace(parser().parse_args(["continue-pretrain", *argv]))
    t = Trainer(cfg)
    hist = t.run(log=lambda *a, **k: None)
    diffs = {}
    for lp in t.table:
        if lp.spec.rule is Rule.REPLICATED:
            mine = lp.param.detach().float().contiguous()
            other = [torch.empty_like(mine) for _ in range(world)]
            dist.all_gather(other, mine)
            diffs[lp.name] = max(float((o - mine).abs().max()) for o in other)
    if rank == 0:
        Path(out).write_text(json.dumps({"diffs": diffs, "losses": [h["loss"] for h in hist]}))
    del t, lp
    shutdown_distributed()


EXIT_PROBE = """
import os, sys
from shardkit.cli import main
from train import loop

def runloops():
    return sum(open(f"/proc/self/task/{t}/comm").read().strip() == "pt_gloo_runloop" for t in os.listdir("/proc/self/task"))

counts, shutdown = [], loop.shutdown_distributed
def probe():
    counts.append(runloops())
    shutdown()
    counts.append(runloops())
loop.shutdown_distributed = probe
rc = main(sys.argv[1:])
print("gloo worker threads", counts)
sys.exit(rc)
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads thread names from /proc")
def test_training_exit_joins_the_groups_threads(root, tmp_path):
    """`continue-pretrain` in a fresh interpreter: when it returns, no gloo worker thread is left to drop a collective's
    tensors during the interpreter's shutdown (that aborted successful runs, exit 134, "terminate called without an
    active exception": torch._dynamo imported after init_process_group kept the default group alive)."""
    r = subprocess.run([sys.executable, "-c", EXIT_PROBE, "continue-pretrain", "--load", str(root / "ck"),
                        "--data-path", str(root / "data"), "--train-iters", "2", *TRAIN],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert r.returncode == 0, r.stderr[-3000:]
    before, after = json.loads(r.stdout.rsplit("gloo worker threads", 1)[1])
    assert before > 0 and after == 0, (before, after)


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_tp2_dropout_keeps_replicas_identical(root, sp, tmp_path):
    """TP 2 with dropout 0.1 / 0.1 for 3 steps: every replicated weight (norms) is bitwise the same on both TP ranks
    (the residual and embedding masks agree where activations are replicated), and the losses differ from the run
    without dropout."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "result.json"
    argv = ["--load", str(root / "ck"), "--data-path", str(root / "data"), "--train-iters", "3", "--tp", "2",
            "--log-interval", "1", *TRAIN, *(["--sequence-parallel"] if sp else [])]
    mp.start_processes(_tp_worker, args=(2, port, argv, str(out)), nprocs=2, start_method="spawn")
    res = json.loads(out.read_text())
    assert res["diffs"] and all(v == 0.0 for v in res["diffs"].values()), res["diffs"]
    off = run(root, "drop-off", *NODROP)
    assert res["losses"][0] != losses(off)[0]
