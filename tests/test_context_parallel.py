"""Context parallelism on gloo (fp32): ring (p2p) and all-gather attention equal full causal attention on the gathered
sequence, outputs and q/k/v gradients, with and without packed-document masks; continue-pretrain at CP=2, CP=4 and
CP=2 x TP=2 gives the losses and final weights of CP=1, with and without packed documents."""
from __future__ import annotations

import os
from pathlib import Path
import tempfile
import traceback

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from checkpoint.errors import ConfigError
from checkpoint.reader import Checkpoint
from train.parallel.context import (AttentionLayout, Packing, Ring, all_gather_attention, block_mask,
                                    check_sequence, ltor_masks_and_position_ids, prepare_micro_batch, ring_attention,
                                    varlen_pack, zigzag_index, zigzag_order, zigzag_split)

# -- pure layout math --------------------------------------------------------------------------------------------------


def test_zigzag_layout():
    assert zigzag_index(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert zigzag_index(8, 2, 1).tolist() == [2, 3, 4, 5]
    every = torch.cat([zigzag_index(16, 4, r) for r in range(4)])
    assert sorted(every.tolist()) == list(range(16))
    # rank-ordered concatenation -> global order
    order = zigzag_order(4)
    chunks = every.view(8, 2)
    assert torch.equal(chunks[order].reshape(-1), torch.arange(16))
    with pytest.raises(ConfigError, match="--seq-length 30 is not divisible by 2 x cp = 4"):
        check_sequence(30, 2)
    with pytest.raises(ConfigError, match="not divisible by --tp 4"):
        check_sequence(20, 2, tp=4, sequence_parallel=True)
    check_sequence(32, 4, tp=2, sequence_parallel=True)


def test_ltor_masks_and_position_ids_as_megatron():
    """Against a transcription of Megatron-LM's get_ltor_masks_and_position_ids (dense mask, loops)."""
    eod = 2
    tokens = torch.tensor([[5, 2, 7, 8, 2, 9, 9, 4], [2, 3, 3, 3, 3, 2, 2, 6]])
    for rp, ra, em in [(True, True, True), (True, False, False), (False, True, False), (False, False, True)]:
        b, s = tokens.shape
        mask = torch.tril(torch.ones(b, s, s))
        loss = torch.ones(b, s)
        if em:
            loss[tokens == eod] = 0.0
        pos = torch.arange(s).unsqueeze(0).expand(b, s).clone()
        for i in range(b):
            eods = pos[i, tokens[i] == eod].clone()
            prev = 0
            for j in eods.tolist():
                if ra:
                    mask[i, j + 1:, : j + 1] = 0
                if rp:
                    pos[i, j + 1:] -= j + 1 - prev
                    prev = j + 1
        got_pos, got_loss, docs = ltor_masks_and_position_ids(tokens, Packing(eod, rp, ra, em))
        assert torch.equal(got_pos, pos) and torch.equal(got_loss, loss)
        idx = torch.arange(s)
        got_mask = block_mask(idx, idx, docs, docs, None)[:, 0] if docs is not None else torch.tril(torch.ones(s, s))
        assert torch.equal(got_mask.float().expand(b, s, s), mask), (rp, ra, em)


def test_varlen_pack_segments():
    """cu_seqlens for a query chunk that ends the key prefix: one segment per (row, document)."""
    docs_k = torch.tensor([[0, 0, 0, 1, 1, 1, 2, 2], [0, 0, 0, 0, 0, 0, 0, 0]])
    docs_q = docs_k[:, 4:]
    p = varlen_pack(docs_q, docs_k)
    assert p.cu_q.tolist() == [0, 2, 4, 8] and p.cu_k.tolist() == [0, 3, 5, 13]
    assert p.k_index.tolist() == [3, 4, 5, 6, 7] + list(range(8, 16))
    assert (p.max_q, p.max_k) == (4, 8)


def test_prepare_micro_batch_splits_together():
    sample = torch.arange(17).view(1, 17) % 5  # token 2 is EOD
    pk = Packing(2, True, True, True)
    ids, labels, ex = prepare_micro_batch(sample, 2, 1, pk)
    idx = zigzag_index(16, 2, 1)
    pos, loss, docs = ltor_masks_and_position_ids(sample[:, :-1], pk)
    assert torch.equal(ids, sample[:, :-1][:, idx]) and torch.equal(labels, sample[:, 1:][:, idx])
    assert torch.equal(ex.position_ids, pos[:, idx]) and torch.equal(ex.layout.docs, docs)
    torch.testing.assert_close(ex.loss_weight, loss[:, idx] * 2 / loss.sum())


# -- attention on spawned gloo ranks -----------------------------------------------------------------------------------

CASES = [  # (comm, hpg, d, dv, packed, window)
    ("p2p", 2, 8, 8, False, None), ("p2p", 2, 8, 8, True, None), ("p2p", 1, 8, 6, True, None),
    ("p2p", 2, 8, 8, True, 5), ("all_gather", 2, 8, 8, False, None), ("all_gather", 2, 8, 8, True, None),
    ("all_gather", 1, 8, 6, False, 7),
]


def _reference(q, k, v, hpg, scale, docs, window):
    S = q.shape[2]
    idx = torch.arange(S)
    mask = block_mask(idx, idx, docs, docs, window)
    return F.scaled_dot_product_attention(q, k.repeat_interleave(hpg, 1), v.repeat_interleave(hpg, 1),
                                          attn_mask=mask, scale=scale)


def _docs(b: int, S: int, gen: torch.Generator) -> torch.Tensor:
    """Random packed documents; row 0 has a document that ends exactly at a chunk boundary."""
    eod = torch.rand(b, S, generator=gen) < 0.15
    eod[0, S // 4 - 1] = True
    eod = eod.long()
    return torch.cumsum(eod, 1) - eod


def _attention_worker(rank: int, cp: int, init: str, out: str) -> None:
    try:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=cp)
        group = dist.new_group(list(range(cp)))
        ring = Ring(group, cp, rank, (rank + 1) % cp, (rank - 1) % cp)
        errs = []
        for i, (comm, hpg, d, dv, packed, window) in enumerate(CASES):
            gen = torch.Generator().manual_seed(100 + i)
            b, G, S = 2, 2, 8 * cp
            q = torch.randn(b, G * hpg, S, d, generator=gen, requires_grad=True)
            k = torch.randn(b, G, S, d, generator=gen, requires_grad=True)
            v = torch.randn(b, G, S, dv, generator=gen, requires_grad=True)
            gout = torch.randn(b, G * hpg, S, dv, generator=gen)
            docs = _docs(b, S, gen) if packed else None
            scale = 0.3
            ref = _reference(q, k, v, hpg, scale, docs, window)
            (ref * gout).sum().backward()
            split = lambda t: zigzag_split(t.detach(), cp, rank, dim=2)  # noqa: E731
            ql, kl, vl = (split(t).requires_grad_() for t in (q, k, v))
            layout = AttentionLayout(S, cp, rank, docs)
            if comm == "p2p":
                o = ring_attention(ql, kl, vl, hpg, scale, window, layout, ring)
            else:
                o = all_gather_attention(ql, kl, vl, hpg, scale, window, layout, group, "sdpa")
            (o * split(gout)).sum().backward()
            errs.append([float((o - split(ref)).abs().max().detach())] +
                        [float((a.grad - split(r.grad)).abs().max()) for a, r in ((ql, q), (kl, k), (vl, v))])
        torch.save(errs, f"{out}.{rank}")
        dist.destroy_process_group()
    except BaseException:
        with open(f"{out}.{rank}.err", "w") as f:
            f.write(traceback.format_exc())
        raise


@pytest.mark.parametrize("cp", [2, 4])
def test_attention_equals_full_causal(cp, tmp_path):
    out = str(tmp_path / "errs")
    init = f"file://{tempfile.mktemp(prefix='cp-store-', dir=tmp_path)}"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        mp.start_processes(_attention_worker, args=(cp, init, out), nprocs=cp, start_method="spawn")
    except Exception:
        errs = [open(p).read() for p in (f"{out}.{r}.err" for r in range(cp)) if os.path.exists(p)]
        raise AssertionError("\n".join(errs) or "worker failed")
    for r in range(cp):
        errs = np.array(torch.load(f"{out}.{r}"))
        for case, e in zip(CASES, errs):
            assert (e <= 1e-5).all(), (r, case, e.tolist())


# -- end to end: shardkit continue-pretrain ----------------------------------------------------------------------------

from tests.test_train import COMMON, baseline, launch, losses, real_rows, setup  # noqa: E402,F401  (shared fixtures)

PACKED = ["--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss"]
EOD = 2  # the tiny Llama's eos_token_id: what continue-pretrain takes as the end-of-document token


@pytest.fixture(scope="module")
def packed_data(setup):
    """Short documents, each ended by EOD, so a 33-token sample packs several."""
    from train.data import write_indexed

    rng = np.random.default_rng(1)
    docs = [np.append(np.tile(rng.integers(3, 60, size=int(rng.integers(2, 5))), 6)[: int(rng.integers(4, 16))], EOD)
            for _ in range(600)]
    write_indexed(setup / "data-docs", docs, np.uint16)
    return setup / "data-docs"


@pytest.fixture(scope="module")
def packed_baseline(setup, packed_data):
    out = setup / "base-docs"
    launch(1, "--load", str(setup / "ck"), "--data-path", str(packed_data), "--save", str(out), "--train-iters", "5",
           *COMMON, *PACKED)
    return out


def _same_run(want: Path, got: Path) -> None:
    np.testing.assert_allclose(losses(got), losses(want), rtol=1e-5)
    assert len(losses(got)) == 5
    a, b = real_rows(Checkpoint(want / "iter_0000005")), real_rows(Checkpoint(got / "iter_0000005"))
    assert set(a) == set(b)
    for name in a:  # weights and optimizer state, relative error of each tensor
        assert (a[name] - b[name]).norm().item() <= 1e-5 * a[name].norm().item(), name


@pytest.mark.parametrize("nproc,layout,packed", [
    (2, ["--cp", "2"], False),
    (4, ["--cp", "4", "--cp-comm-type", "all_gather"], False),
    (4, ["--cp", "2", "--tp", "2", "--sequence-parallel"], False),
    (2, ["--cp", "2", "--cp-comm-type", "all_gather"], True),
    (4, ["--cp", "4"], True),
    (4, ["--cp", "2", "--tp", "2", "--sequence-parallel"], True),
    (4, ["--cp", "2", "--pp", "2", "--recompute-granularity", "full"], True),
], ids=["cp2", "cp4-allgather", "cp2tp2-sp", "docs-cp2-allgather", "docs-cp4", "docs-cp2tp2-sp", "docs-cp2pp2-recompute"])
def test_cp_equals_one_process(request, setup, nproc, layout, packed):
    base = request.getfixturevalue("packed_baseline" if packed else "baseline")
    data = setup / ("data-docs" if packed else "data")
    out = setup / ("cp-" + request.node.callspec.id)
    launch(nproc, "--load", str(setup / "ck"), "--data-path", str(data), "--save", str(out), "--train-iters", "5",
           *COMMON, *layout, *(PACKED if packed else []))
    _same_run(base, out)


def test_packed_documents_change_the_run(setup, baseline, packed_baseline, packed_data):
    """The packed-document flags take effect (positions, masks and loss differ from plain causal training)."""
    out = setup / "docs-plain"
    launch(1, "--load", str(setup / "ck"), "--data-path", str(packed_data), "--save", str(out), "--train-iters", "1",
           *COMMON)
    assert abs(losses(out)[0] - losses(packed_baseline)[0]) > 1e-3


def test_cp_bad_sequence_length(setup):
    r = launch(2, "--load", str(setup / "ck"), "--data-path", str(setup / "data"), "--train-iters", "1", *COMMON,
               "--cp", "2", "--seq-length", "30", check=False)
    assert r.returncode != 0 and "--seq-length 30 is not divisible by 2 x cp = 4" in r.stderr, r.stderr[-2000:]
