"""Multi-token prediction against megatron-core itself (CPU, in a subprocess: tests/megatron_oracle.py `mtp`).

megatron-core's GPTModel with MTP (local spec, as pretrain_gpt.py builds it) gets random weights and runs one training
step's forward and backward; our GPTModel, loaded with the same tensors by their sharded keys, must give the same main
logits, the same hidden states into the MTP block (megatron-core feeds depth 0 the decoder's final-normed output and
each next depth the previous depth's final_layernorm output), the same logits at every depth, the same per-depth MTP
losses and, through the trainer's own StageStep and MTP loss, the same gradient for every parameter. Dense (depth 1
and 2) and MoE (depth 2) models; fp32.
"""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from checkpoint.config import ModelConfig
from checkpoint.megatron import sharded_key
from checkpoint.run_layout import RunLayout
from train.model import GPTModel
from train.moe import MoESettings, MoETraining, mtp_depth_losses
from train.parallel.groups import Groups
from train.parallel.pipeline import StageStep

if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
    pytest.skip("megatron-core is not installed", allow_module_level=True)
ORACLE = Path(__file__).with_name("megatron_oracle.py")
TOL = 1e-5
SCALE = 0.3  # mtp_loss_scaling_factor (Megatron's default is 0.1: any value must do)
VOCAB, SEQ, BATCH = 128, 12, 2  # a vocabulary that needs no padding: megatron-core's loss runs over every row


def _config(depths: int, moe: bool) -> ModelConfig:
    extra = dict(model_type="mixtral", num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48,
                 moe_layer_freq=[1, 1]) if moe else dict(model_type="llama")
    return ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2,
                       kv_channels=8, vocab_size=VOCAB, max_position_embeddings=64, norm_epsilon=1e-5,
                       rotary_base=10000.0, mtp_num_layers=depths, **extra)


def _megatron_model(cfg: ModelConfig) -> dict:
    m = dict(num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
             num_query_groups=cfg.num_query_groups, kv_channels=cfg.kv_channels, ffn_hidden_size=cfg.ffn_hidden_size,
             add_bias_linear=False, layernorm_epsilon=cfg.norm_epsilon, padded_vocab_size=cfg.padded_vocab_size(1),
             max_sequence_length=cfg.max_position_embeddings, rotary_base=cfg.rotary_base, tied=False,
             mtp_num_layers=cfg.mtp_num_layers, mtp_loss_scaling_factor=SCALE)
    if cfg.is_moe:
        m.update(num_moe_experts=cfg.num_moe_experts, moe_router_topk=cfg.moe_router_topk,
                 moe_ffn_hidden_size=cfg.moe_ffn_hidden_size, moe_router_load_balancing_type="none")
    return m


CASES = {"dense-1": (1, False), "dense-2": (2, False), "moe-2": (2, True)}


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    """Every case's megatron-core run, in one subprocess."""
    w = tmp_path_factory.mktemp("mtp")
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    torch.save(ids, w / "ids.pt")
    torch.save(labels, w / "labels.pt")
    jobs = [{"model": _megatron_model(_config(*case)), "seed": 11 + i, "input_ids": str(w / "ids.pt"),
             "labels": str(w / "labels.pt"), "out": str(w / f"{name}.pt")}
            for i, (name, case) in enumerate(CASES.items())]
    (w / "jobs.json").write_text(json.dumps(jobs))
    r = subprocess.run([sys.executable, str(ORACLE), "mtp", str(w / "jobs.json")], capture_output=True, text=True,
                       timeout=600, cwd=str(w))
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-4000:])
    return {"ids": ids, "labels": labels, **{name: torch.load(w / f"{name}.pt") for name in CASES}}


def _ours(cfg: ModelConfig, tensors: dict) -> GPTModel:
    """Our model with megatron-core's tensors, looked up by the sharded key of each canonical name (local spec)."""
    model = GPTModel(cfg, cfg.padded_vocab_size(1))
    model.load_canonical({name: tensors[sharded_key(name, "local")] for name in model.canonical_state_dict()})
    return model


@pytest.mark.parametrize("case", list(CASES))
def test_mtp_matches_megatron_core(oracle, case):
    depths, moe = CASES[case]
    cfg, meg = _config(depths, moe), oracle[case]
    ids, labels = oracle["ids"], oracle["labels"]
    assert len(meg["mtp_logits"]) == depths and len(meg["block"]) == depths + 1

    model = _ours(cfg, meg["tensors"])
    with torch.no_grad():
        logits, hidden = model(ids, return_hidden=True)
        assert (logits - meg["logits"]).abs().max() <= TOL
        # what the MTP block reads: the decoder's final-normed output (the main head's input)
        assert (hidden - meg["block"][0]).abs().max() <= TOL
        mtp_logits = model.mtp_forward(hidden, ids)
        for d in range(depths):
            assert (mtp_logits[d] - meg["mtp_logits"][d]).abs().max() <= TOL, f"MTP depth {d + 1}"
        losses = mtp_depth_losses(mtp_logits, labels)
        torch.testing.assert_close(torch.stack(losses), meg["mtp_losses"], rtol=TOL, atol=0)

    # the trainer's path: StageStep's loss with the MTP loss attached (train.moe), one micro-batch
    trained = _ours(cfg, meg["tensors"])
    moe_state = MoETraining(trained, cfg, MoESettings(load_balancing_type="none", mtp_loss_scaling_factor=SCALE))
    moe_state.start_step(num_micro=1)
    loss = StageStep(trained, Groups(RunLayout(), 0, 0, 0, 0, 0), moe=moe_state)(None, ids, labels)
    assert loss.item() == pytest.approx(meg["loss"].item(), rel=TOL)
    loss.backward()
    for name, g in _canonical_grads(trained).items():
        want = meg["grads"][sharded_key(name, "local")]
        assert (g - want).norm() <= TOL * want.norm(), name
    torch.testing.assert_close(moe_state.mtp.float(), meg["mtp_losses"], rtol=TOL, atol=0)


def _canonical_grads(model: GPTModel) -> dict:
    """Each canonical tensor's gradient (stacked over layers like the tensor)."""
    saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.grad)
        out = model.canonical_state_dict()
        for n, p in model.named_parameters():
            p.copy_(saved[n])
    return out
