"""train/metrics.py: FLOPs under both MFU conventions (checked by hand), parameter counts against the sharding table,
peak FLOP/s lookup, the JSONL logger and `shardkit plot`."""
from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest

from checkpoint.config import ModelConfig
from checkpoint.layout import Layout
from checkpoint.families import model_specs
from shardkit.cli import main as cli
from train.metrics import (MetricsError, MetricsLogger, flops_per_step, format_line, peak_flops, peak_flops_for_name,
                           plot_metrics, read_metrics, throughput)


def llama(**kw) -> ModelConfig:
    base = dict(model_type="llama", num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                num_query_groups=2, kv_channels=16, vocab_size=100, max_position_embeddings=64, norm_epsilon=1e-5,
                rotary_base=10000.0, make_vocab_size_divisible_by=1)
    base.update(kw)
    return ModelConfig(**base)


def test_dense_flops_by_hand():
    f = flops_per_step(llama(), seq_length=32, tokens=64)
    # per layer: qkv (4 + 2*2 heads) * 16 rows x 64 = 8192, proj 64 x 64 = 4096, gated MLP 3 * 64 * 128 = 24576
    # N = 2 layers * 36864 + output layer 64 * 100 = 80128 (the input embedding is a lookup: not counted)
    assert f["gemm_params_active"] == 80128
    # attention scores, full square, per token: 6 * L * s * heads * (d_qk + d_v) = 6 * 2 * 32 * 4 * 32 = 49152
    assert f["flops_per_token_torchtitan"] == 6 * 80128 + 49152 == 529920
    assert f["flops_per_token_megatron"] == 6 * 80128 + 49152 // 2 == 505344
    assert f["megatron"] == 64 * 505344 and f["torchtitan"] == 64 * 529920
    # Megatron-LM's own closed form (training.py num_floating_point_operations, causal coefficient 0.5):
    # 12 * T * L * h^2 * ((1 + g/a + s/h * 0.5) + ffn/h * 1.5) + 6 * T * h * V
    T, L, h, a, g, s, ffn, V = 64, 2, 64, 4, 2, 32, 128, 100
    megatron_lm = 12 * T * L * h * h * ((1 + g / a + s / h * 0.5) + ffn / h * 1.5) + 6 * T * h * V
    assert f["megatron"] == pytest.approx(megatron_lm, rel=1e-12)
    # the reference notes' form: 6*N*T + 6*L*(nh*dh)*s*T
    assert f["megatron"] == 6 * 80128 * 64 + 6 * 2 * (4 * 16) * 32 * 64


def test_moe_counts_active_experts_only():
    cfg = llama(model_type="mixtral", num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=32,
                moe_layer_freq=[1, 1])
    f = flops_per_step(cfg, seq_length=16, tokens=16)
    attn = 8192 + 4096
    router, expert = 64 * 8, 3 * 64 * 32
    assert f["gemm_params_active"] == 2 * (attn + router + 2 * expert) + 6400
    assert f["gemm_params_total"] == 2 * (attn + router + 8 * expert) + 6400


@pytest.mark.parametrize("cfg", [
    llama(add_qkv_bias=True, add_proj_bias=True, add_mlp_bias=True),
    llama(tie_word_embeddings=True),
    llama(model_type="mixtral", num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_layer_freq=[1, 1]),
    # DeepSeek-style: MLA with q LoRA, a dense first layer, shared experts, expert bias
    llama(model_type="deepseek_v3", num_layers=3, num_query_groups=4, multi_latent_attention=True, q_lora_rank=24,
          kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=8, num_moe_experts=4, moe_router_topk=2,
          moe_ffn_hidden_size=16, moe_shared_expert_intermediate_size=16, moe_layer_freq=[0, 1, 1],
          moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid"),
    llama(model_type="deepseek_v2", num_query_groups=4, multi_latent_attention=True, q_lora_rank=None,
          kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=8, num_moe_experts=4, moe_router_topk=1,
          moe_ffn_hidden_size=16, moe_layer_freq=[1, 1]),
], ids=["dense-bias", "tied", "moe", "mla-moe-v3", "mla-v2"])
def test_total_params_equal_the_sharding_table(cfg):
    """params_total counts every stored weight: it must equal the sum over the one sharding table."""
    table = sum(math.prod(s.shape) for s in model_specs(cfg, Layout()))
    assert flops_per_step(cfg, 8, 8)["params_total"] == table
    # a dense model: every GEMM weight is active, and the table's 2-D weights minus the embedding are those GEMMs
    if not cfg.is_moe and not cfg.tie_word_embeddings:
        gemm = sum(math.prod(s.shape) for s in model_specs(cfg, Layout())
                   if len(s.shape) - s.lead == 2 and s.name != "embedding.word_embeddings.weight")
        assert flops_per_step(cfg, 8, 8)["gemm_params_active"] == gemm


def test_mla_attention_uses_its_head_dims():
    cfg = llama(model_type="deepseek_v2", num_query_groups=4, multi_latent_attention=True, kv_lora_rank=16,
                qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=8, num_moe_experts=4, moe_router_topk=1,
                moe_ffn_hidden_size=16, moe_layer_freq=[1, 1])
    f = flops_per_step(cfg, seq_length=10, tokens=1)
    # d_qk = 8 + 4 (rope part), d_v = 8: full attention 6 * 2 * 10 * 4 * 20 = 9600 per token
    assert f["flops_per_token_torchtitan"] - f["flops_per_token_megatron"] == 4800


def test_peak_flops_lookup():
    assert peak_flops_for_name("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops_for_name("NVIDIA H200") == 989e12
    assert peak_flops_for_name("NVIDIA H20") == 148e12
    assert peak_flops_for_name("NVIDIA H100 PCIe") == 756e12
    assert peak_flops_for_name("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops_for_name("NVIDIA L40S") == 362e12 and peak_flops_for_name("NVIDIA L4") == 121e12
    assert peak_flops_for_name("NVIDIA H100 80GB HBM3", "fp8") == 2 * 989e12
    assert peak_flops_for_name("NVIDIA A100-SXM4-80GB", "fp8") is None
    assert peak_flops_for_name("Some Future GPU") is None
    assert peak_flops("cpu") is None


def test_throughput_and_mfu():
    f = flops_per_step(llama(), seq_length=32, tokens=64)
    t = throughput(f, step_seconds=0.5, world_size=2, peak=1e9)
    assert t["tokens_per_s"] == 128 and t["tokens_per_s_per_device"] == 64
    assert t["mfu_megatron"] == pytest.approx(64 * 505344 / 0.5 / 2 / 1e9)
    assert t["mfu_torchtitan"] == pytest.approx(64 * 529920 / 0.5 / 2 / 1e9)
    assert throughput(f, 0.5, 2, None)["mfu_megatron"] is None


def test_logger_writes_jsonl_on_the_writer_rank_only(tmp_path, capsys):
    import torch

    with MetricsLogger(tmp_path / "other", rank=1) as quiet:
        assert quiet.log(1, {"loss": 1.0}) is None
    assert not (tmp_path / "other").exists()
    with MetricsLogger(tmp_path / "run", rank=0) as log:
        line = log.log(1, {"loss": torch.tensor(2.5), "lr": 1e-3, "grad_norm": np.float32(0.75),
                           "tokens_per_s": 1234.0, "mfu_megatron": 0.41, "mfu_torchtitan": 0.45, "mem_gib": 1.5,
                           "consumed_samples": 8}, train_iters=10)
        log.log(2, {"loss": 2.25, "lr": 2e-3, "valid_loss": 2.4}, echo=False)
    assert capsys.readouterr().out.strip() == line
    assert line.startswith("iteration 1/10 | consumed samples 8")
    for part in ("lr 1.000e-03", "loss 2.500000", "grad norm 0.7500", "1,234 tokens/s",
                 "MFU 41.0% megatron / 45.0% torchtitan", "mem 1.50 GiB"):
        assert part in line
    recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in recs] == [1, 2] and recs[0]["loss"] == 2.5 and recs[0]["grad_norm"] == 0.75
    assert "valid loss 2.400000" in format_line(2, recs[1])


def test_read_metrics_after_resume_and_crash(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text("\n".join(json.dumps({"iteration": i, "loss": float(i)}) for i in (1, 2, 3)) + "\n"
                 + json.dumps({"iteration": 3, "loss": 30.0}) + "\n" + '{"iteration": 4, "lo')
    recs = read_metrics(tmp_path)
    assert [(r["iteration"], r["loss"]) for r in recs] == [(1, 1.0), (2, 2.0), (3, 30.0)]
    p.write_text('{"iteration": 1}\nnot json\n{"iteration": 2}\n')
    with pytest.raises(MetricsError, match="metrics.jsonl line 2: not valid JSON"):
        read_metrics(p)


def test_plot_writes_a_png(tmp_path, capsys):
    run = tmp_path / "run"
    with MetricsLogger(run, rank=0, tensorboard=False) as log:
        for i in range(1, 21):
            log.log(i, {"loss": 5.0 / i, "lr": 1e-3 * min(1.0, i / 5), **({"valid_loss": 5.5 / i} if i % 5 == 0
                                                                           else {})}, echo=False)
    assert cli(["plot", str(run)]) == 0
    png = run / "metrics.png"
    assert capsys.readouterr().out.strip() == f"wrote {png}"
    import matplotlib.image

    img = matplotlib.image.imread(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and img.shape[0] > 300 and img.shape[1] > 500
    assert img[..., :3].std() > 0.05  # curves drawn, not a blank canvas
    out = plot_metrics(run / "metrics.jsonl", tmp_path / "sub" / "x.png")
    assert out.is_file() and not list((tmp_path / "sub").glob(".*tmp"))
    assert cli(["plot", str(tmp_path / "nowhere")]) == 1
    err = capsys.readouterr().err.strip()
    assert "nowhere" in err and "no such metrics file" in err and len(err.splitlines()) == 1
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text(json.dumps({"iteration": 1, "tokens_per_s": 3}) + "\n")
    with pytest.raises(MetricsError, match="no 'loss' or 'lr' values"):
        plot_metrics(tmp_path / "empty")


def test_flops_reject_nonsense():
    with pytest.raises(ValueError):
        flops_per_step(replace(llama()), seq_length=0, tokens=1)
