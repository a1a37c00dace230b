"""Multi-token prediction against megatron-core itself (CPU, in a subprocess: tests/megatron_oracle.py `mtp`).

megatron-core's GPTModel with MTP (local spec, as pretrain_gpt.py builds it) gets random weights and runs one training
step's forward and backward; our GPTModel, loaded with the same tensors by their sharded keys, must give the same main
logits, the same hidden states into the MTP block (megatron-core feeds depth 0 the decoder's final-normed output and
each next depth the previous depth's final_layernorm output), the same logits at every depth, the same per-depth MTP
losses and, through the trainer's own StageStep and MTP loss, the same gradient for every parameter. Dense (depth 1
and 2) and MoE (depth 2) models; fp32. Packed documents (depth 2): megatron-core with packed_seq_params at the EOD
boundaries and pretrain_gpt.py's loss mask against the trainer with --reset-attention-mask --eod-mask-loss (the ids,
labels and loss mask of each depth shifted within each document, its last tokens masked). Context parallelism:
megatron-core's roll_tensor over 3 CP ranks (torchrun, `mtp_roll`) against the trainer's shift of the whole
micro-batch, split zigzag.
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
# packed documents: one row of 16 tokens, EOD at 4, 5 (a document of one token) and 11, the last document unended
EOD, DOC_ENDS, DOCS_SEQ = 1, (4, 5, 11), 16


def _packed_sample() -> torch.Tensor:
    """[1, DOCS_SEQ + 1] tokens: random ids >= 2 with EOD at DOC_ENDS (input positions)."""
    sample = torch.randint(2, VOCAB, (1, DOCS_SEQ + 1), generator=torch.Generator().manual_seed(5))
    sample[0, list(DOC_ENDS)] = EOD
    return sample


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
    sample = _packed_sample()
    torch.save(sample[:, :-1].clone(), w / "docs-ids.pt")
    torch.save(sample[:, 1:].clone(), w / "docs-labels.pt")
    torch.save((sample[:, :-1] != EOD).float(), w / "docs-mask.pt")  # --eod-mask-loss
    jobs.append({"model": _megatron_model(_config(2, False)), "seed": 21, "input_ids": str(w / "docs-ids.pt"),
                 "labels": str(w / "docs-labels.pt"), "loss_mask": str(w / "docs-mask.pt"),
                 "cu_seqlens": [0, *(e + 1 for e in DOC_ENDS), DOCS_SEQ], "out": str(w / "docs.pt")})
    (w / "jobs.json").write_text(json.dumps(jobs))
    r = subprocess.run([sys.executable, str(ORACLE), "mtp", str(w / "jobs.json")], capture_output=True, text=True,
                       timeout=600, cwd=str(w))
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-4000:])
    return {"ids": ids, "labels": labels, **{name: torch.load(w / f"{name}.pt") for name in (*CASES, "docs")}}


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
    _equals_megatron(meg, trained, moe_state, loss)


def _equals_megatron(meg: dict, trained, moe_state, loss) -> None:
    """The loss, every gradient (after loss.backward()) and the per-depth MTP losses equal megatron-core's."""
    assert loss.item() == pytest.approx(meg["loss"].item(), rel=TOL)
    loss.backward()
    for name, g in _canonical_grads(trained).items():
        want = meg["grads"][sharded_key(name, "local")]
        assert (g - want).norm() <= TOL * want.norm(), name
    torch.testing.assert_close(moe_state.mtp.float(), meg["mtp_losses"], rtol=TOL, atol=0)


def test_mtp_with_packed_documents_matches_megatron_core(oracle):
    """The trainer's packed micro-batch (prepare_micro_batch with --reset-attention-mask --eod-mask-loss, its installed
    document attention, StageStep): main and per-depth MTP logits, MTP losses, loss and every gradient equal
    megatron-core's with packed_seq_params; the shifted ids are 0 and the MTP weights 0 at each document's last
    tokens."""
    from train.moe import mtp_targets
    from train.parallel.context import Packing, apply_context_parallel, prepare_micro_batch

    cfg, meg = _config(2, False), oracle["docs"]
    packing = Packing(EOD, reset_attention_mask=True, eod_mask_loss=True)
    ids, labels, extras = prepare_micro_batch(_packed_sample(), 1, 0, packing)
    groups = Groups(RunLayout(), 0, 0, 0, 0, 0)
    t = mtp_targets(*extras.whole, extras.layout.docs, 2)
    # depth d reads nothing at the last d tokens of each document (documents 0..4, 5, 6..11, 12..15) and is not
    # weighed there nor where the token it predicts follows an EOD input (--eod-mask-loss, shifted with the labels)
    for d, (ends, masked) in enumerate((((4, 5, 11, 15), (3, 4, 5, 10, 11, 15)),
                                        ((3, 4, 5, 10, 11, 14, 15), (2, 3, 4, 5, 9, 10, 11, 14, 15)))):
        assert [i for i in range(DOCS_SEQ) if t.ids[d][0, i] == 0] == list(ends), d
        assert [i for i in range(DOCS_SEQ) if t.weights[d][0, i] == 0] == list(masked), d
        torch.testing.assert_close(t.weights[d].sum(), torch.tensor(1.0))

    model = _ours(cfg, meg["tensors"])
    attention, _ = apply_context_parallel(model, groups, "p2p", packing, False, torch.device("cpu"), torch.float32)
    assert attention is not None
    with torch.no_grad(), attention.use(extras.layout):
        logits, hidden = model(ids, return_hidden=True)
        assert (logits - meg["logits"]).abs().max() <= TOL
        mtp_logits = model.mtp_forward(hidden, ids, extras.position_ids, t.ids)
        for d in range(2):
            assert (mtp_logits[d] - meg["mtp_logits"][d]).abs().max() <= TOL, f"MTP depth {d + 1}"

    trained = _ours(cfg, meg["tensors"])
    attention, _ = apply_context_parallel(trained, groups, "p2p", packing, False, torch.device("cpu"), torch.float32)
    moe_state = MoETraining(trained, cfg, MoESettings(load_balancing_type="none", mtp_loss_scaling_factor=SCALE))
    moe_state.start_step(num_micro=1)
    loss = StageStep(trained, groups, attention, moe=moe_state)(None, ids, labels, extras)
    _equals_megatron(meg, trained, moe_state, loss)


def test_mtp_shift_across_cp_chunks_matches_megatron_core(tmp_path):
    """megatron-core's roll_tensor at CP 3 (first, middle and last CP rank trade boundary tokens by isend/irecv;
    chunks of 2 tokens and 3 depths, so a shifted token comes from two chunks away) gives every CP rank the ids,
    labels and loss mask that mtp_targets takes from the whole micro-batch. megatron-core divides each rank's sum by
    that rank's own count; the trainer by the whole micro-batch's, which is the sum of those counts."""
    from tests.launcher import free_port
    from train.moe import mtp_targets

    cp, S, depths = 3, 12, 3
    g = torch.Generator().manual_seed(9)
    whole = (torch.randint(2, VOCAB, (2, S), generator=g), torch.randint(2, VOCAB, (2, S), generator=g),
             (torch.rand(2, S, generator=g) > 0.25).float())
    for name, t in zip(("ids", "labels", "mask"), whole):
        torch.save(t, tmp_path / f"{name}.pt")
    job = {"input_ids": str(tmp_path / "ids.pt"), "labels": str(tmp_path / "labels.pt"),
           "loss_mask": str(tmp_path / "mask.pt"), "depths": depths, "out": str(tmp_path / "roll.pt")}
    (tmp_path / "jobs.json").write_text(json.dumps([job]))
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(cp), "--master-port",
                        str(free_port()), str(ORACLE), "mtp_roll", str(tmp_path / "jobs.json")],
                       capture_output=True, text=True, timeout=600, cwd=str(tmp_path))
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-4000:])
    meg = torch.load(tmp_path / "roll.pt")
    for rank in range(cp):
        ours = mtp_targets(*whole, None, depths, cp, rank)
        for d in range(depths):
            m = meg[rank][d]
            assert torch.equal(ours.ids[d], m["ids"]) and torch.equal(ours.labels[d], m["labels"]), (rank, d)
            count = sum(meg[q][d]["num_tokens"] for q in range(cp))
            torch.testing.assert_close(ours.weights[d], m["loss_mask"] / count, rtol=1e-7, atol=0)
    assert meg[0][0]["ids"][:, -1].eq(0).all()  # the sequence's end (rank 0's second chunk) reads 0


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
