"""Context parallelism on gloo (fp32): ring (p2p) and all-gather attention equal full causal attention on the gathered
sequence, outputs and q/k/v gradients, with and without packed-document masks; continue-pretrain at CP=2, CP=4 and
CP=2 x TP=2 gives the losses and final weights of CP=1, with and without packed documents."""
from __future__ import annotations

import itertools
import os
import traceback
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from checkpoint.errors import ConfigError
from checkpoint.reader import Checkpoint
from tests import test_train
from tests.test_train import COMMON, launch, losses, real_rows
from train.parallel.context import (
    AttentionLayout,
    Packing,
    Ring,
    all_gather_attention,
    block_mask,
    check_sequence,
    ltor_masks_and_position_ids,
    prepare_micro_batch,
    ring_attention,
    varlen_pack,
    zigzag_index,
    zigzag_order,
    zigzag_split,
)

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


def test_ring_blocks_are_balanced():
    """Zigzag: besides the causal diagonal step, every ring step is one full c x 2c block on every rank."""
    from train.parallel.context import ring_block

    cp, c = 4, 4
    for rank in range(cp):
        for src in range(cp):
            qr, kr, mask = ring_block(AttentionLayout(2 * cp * c, cp, rank), rank, src, None, torch.device("cpu"))
            rows, cols = qr.stop - qr.start, kr.stop - kr.start
            assert (rows, cols) == ((2 * c, 2 * c) if src == rank else (2 * c, c) if src < rank else (c, 2 * c))
            assert (mask is None) == (src != rank)


@pytest.mark.parametrize("window", [None, 3, 9])
def test_ring_skips_are_decided_on_the_host(monkeypatch, window):
    """Issue 32's host-sync budget: which ring blocks the documents or the window mask entirely is known without
    reading the device (no bool() of a tensor in ring_block for a layout from prepare_micro_batch), and the blocks
    kept and skipped are exactly those whose mask attends somewhere (what reading the device decided before)."""
    from train.parallel.context import block_mask, ring_block

    cp, S = 4, 64
    g = torch.Generator().manual_seed(3)
    sample = torch.randint(3, 9, (2, S + 1), generator=g)
    sample[0, 5], sample[0, 40], sample[1, 20], sample[1, 21] = 2, 2, 2, 2  # EOD: documents
    pk = Packing(2, reset_position_ids=True, reset_attention_mask=True)
    for rank in range(cp):
        _, _, ex = prepare_micro_batch(sample, cp, rank, pk)
        lay = ex.layout
        assert lay.masked is not None
        want = {}
        for src in range(cp):  # the device-side decision, as before
            blk = ring_block(AttentionLayout(S, cp, rank, lay.docs), rank, src, window, torch.device("cpu"))
            want[src] = blk is not None
        with monkeypatch.context() as m:
            def no_sync(self):
                raise AssertionError("ring_block read the device")
            m.setattr(torch.Tensor, "__bool__", no_sync)
            got = {src: ring_block(lay, rank, src, window, torch.device("cpu")) is not None for src in range(cp)}
        # a block the window and the documents mask only together may still be computed (all-masked blocks add
        # nothing); every block that attends is kept, and every one masked by either alone is skipped
        for src in range(cp):
            assert got[src] or not want[src], (rank, src)
            q, k = ring_block(AttentionLayout(S, cp, rank), rank, src, None, torch.device("cpu"))[:2]
            qp, kp = zigzag_index(S, cp, rank)[q], zigzag_index(S, cp, src)[k]
            docs_alone = block_mask(qp, kp, lay.docs[:, qp], lay.docs[:, kp], None, causal=src == rank)
            window_alone = None if window is None else block_mask(qp, kp, None, None, window, causal=src == rank)
            if (docs_alone is not None and not docs_alone.any()) or (window_alone is not None and
                                                                      not window_alone.any()):
                assert not got[src], (rank, src)
    assert lay.varlen() is lay.varlen()  # one pack per micro-batch, not one per layer


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
    # a micro-batch (so every CP rank's share) with no token left in the loss: weights 0, never 0/0 (Megatron-LM #1764)
    _, _, ex = prepare_micro_batch(torch.full((1, 17), 2), 2, 0, pk)
    assert torch.equal(ex.loss_weight, torch.zeros(1, 8))


def _fake_flash_attn():
    """flash-attn's documented semantics in plain torch (q [b, s, heads, d]; causal aligned bottom-right; window_size
    (left, right); GQA: query head h reads KV head h // (H / Hk); varlen segments from cu_seqlens). It checks how
    context.py calls flash-attn (layouts, cu_seqlens, key selection), not the CUDA kernel, which is not run here."""
    import types

    def one(q, k, v, causal, scale, window):  # [sq, H, d], [sk, Hk, d]
        sq, sk, H, Hk = q.shape[0], k.shape[0], q.shape[1], k.shape[1]
        k, v = k.repeat_interleave(H // Hk, 1), v.repeat_interleave(H // Hk, 1)
        i = torch.arange(sq)[:, None] + (sk - sq)
        j = torch.arange(sk)[None, :]
        mask = torch.ones(sq, sk, dtype=torch.bool)
        if causal:
            mask &= j <= i
        if window[0] >= 0:
            mask &= i - j <= window[0]
        if window[1] >= 0:
            mask &= j - i <= window[1]
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
                                             scale=scale)
        return out.transpose(0, 1)

    def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1)):
        return torch.stack([one(q[b], k[b], v[b], causal, softmax_scale, window_size) for b in range(q.shape[0])])

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                               softmax_scale=None, causal=False, window_size=(-1, -1)):
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        assert cu_seqlens_q.dtype == torch.int32 and max_seqlen_q == max(b - a for a, b in itertools.pairwise(cq))
        return torch.cat([one(q[a:b], k[c:d], v[c:d], causal, softmax_scale, window_size)
                          for (a, b), (c, d) in zip(itertools.pairwise(cq), itertools.pairwise(ck))])

    mod = types.ModuleType("flash_attn")
    mod.flash_attn_func, mod.flash_attn_varlen_func, mod.__version__ = flash_attn_func, flash_attn_varlen_func, "fake"
    return mod


@pytest.mark.parametrize("packed,window,sq", [(False, None, 16), (True, None, 16), (True, None, 4), (False, 5, 4),
                                              (True, 6, 8)])
def test_flash_attn_calls(monkeypatch, packed, window, sq):
    """The flash-attn path (dense and varlen, a query chunk ending the key prefix as in CP's all-gather) gives what
    the SDPA path gives, with a stand-in flash_attn module."""
    from train.parallel.context import prefix_attention, select_backend

    monkeypatch.setitem(__import__("sys").modules, "flash_attn", _fake_flash_attn())
    assert select_backend(torch.device("cpu"), torch.bfloat16)[0] == "sdpa"  # never on CPU
    gen = torch.Generator().manual_seed(3)
    b, G, hpg, sk, d = 2, 2, 3, 16, 8
    q = torch.randn(b, G * hpg, sq, d, generator=gen)
    k, v = torch.randn(b, G, sk, d, generator=gen), torch.randn(b, G, sk, d, generator=gen)
    docs = _docs(b, sk, gen) if packed else None
    docs_q = None if docs is None else docs[:, sk - sq:]
    want = prefix_attention(q, k, v, hpg, 0.3, window, docs_q, docs, "sdpa")
    got = prefix_attention(q, k, v, hpg, 0.3, window, docs_q, docs, "flash")
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


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


def _attention_worker(rank: int, world: int, init: str, out: str) -> None:
    """cp=4 over all ranks and, at the same time, cp=2 over ranks {0, 1} and {2, 3}; under NCCL's point-to-point rules
    (tests/nccl_model.py), each ring's group first used by a collective as the trainer does (p2p.init_p2p_group)."""
    try:
        from tests.nccl_model import install
        from train.parallel.p2p import init_p2p_group

        install()
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        errs = {}
        for cp, group, members in ((4, dist.new_group(list(range(world))), list(range(world))),
                                   (2, pairs[rank // 2], [rank // 2 * 2, rank // 2 * 2 + 1])):
            init_p2p_group(group, None)
            r = members.index(rank)
            ring = Ring(group, cp, r, members[(r + 1) % cp], members[(r - 1) % cp])
            errs[cp] = [_case(cp, r, ring, group, i, *case) for i, case in enumerate(CASES)]
        torch.save(errs, f"{out}.{rank}")
        dist.destroy_process_group()
    except BaseException:
        with open(f"{out}.{rank}.err", "w") as f:
            f.write(traceback.format_exc())
        raise
    from tests.launcher import exit_worker

    exit_worker()


def _case(cp, rank, ring, group, i, comm, hpg, d, dv, packed, window) -> list[float]:
    """Max abs error of the output and of dq, dk, dv against full attention on the whole sequence."""
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
    def split(t: torch.Tensor) -> torch.Tensor:
        return zigzag_split(t.detach(), cp, rank, dim=2)

    ql, kl, vl = (split(t).requires_grad_() for t in (q, k, v))
    layout = AttentionLayout(S, cp, rank, docs)
    if comm == "p2p":
        o = ring_attention(ql, kl, vl, hpg, scale, window, layout, ring)
    else:
        o = all_gather_attention(ql, kl, vl, hpg, scale, window, layout, group, "sdpa")
    (o * split(gout)).sum().backward()
    return [float((o.detach() - split(ref)).abs().max())] + [
        float((a.grad - split(r.grad)).abs().max()) for a, r in ((ql, q), (kl, k), (vl, v))]


def test_attention_equals_full_causal(tmp_path):
    """cp=2 and cp=4, ring and all-gather, GQA, MLA-like head dims, packed documents, a sliding window: outputs and
    q/k/v gradients within 1e-5 of full causal attention on the gathered sequence."""
    out = str(tmp_path / "errs")
    init = f"file://{tmp_path / 'store'}"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        mp.start_processes(_attention_worker, args=(4, init, out), nprocs=4, start_method="spawn")
    except (mp.ProcessRaisedException, mp.ProcessExitedException):
        errs = [Path(p).read_text() for p in (f"{out}.{r}.err" for r in range(4)) if os.path.exists(p)]
        raise AssertionError("\n".join(errs) or "worker failed")
    for r in range(4):
        for cp, errs in torch.load(f"{out}.{r}").items():
            for case, e in zip(CASES, errs):
                assert max(e) <= 1e-5, (cp, r, case, e)


# -- end to end: shardkit continue-pretrain ----------------------------------------------------------------------------

# the trainer fixtures of tests/test_train.py: the tiny Llama, its checkpoint and corpus, the one-process run
setup, baseline = test_train.setup, test_train.baseline

PACKED = ["--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss"]
EOD = 2  # the tiny Llama's eos_token_id: what continue-pretrain takes as the end-of-document token


@pytest.fixture(scope="module")
def packed_data(setup):
    """Short documents, each ended by EOD, so a 33-token sample packs several."""
    from tests.corpus import write_packed_corpus

    return write_packed_corpus(setup / "data-docs", EOD, (4, 16))


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
    (4, ["--cp", "4"], True),
    (4, ["--cp", "2", "--tp", "2", "--sequence-parallel", "--cp-comm-type", "all_gather"], True),
    (4, ["--cp", "2", "--pp", "2", "--recompute-granularity", "full"], True),
], ids=["cp2", "cp4-allgather", "cp2tp2-sp", "docs-cp4", "docs-cp2tp2-sp-allgather", "docs-cp2pp2-recompute"])
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
           *COMMON, "--lr-warmup-iters", "0")  # a 1-iteration run cannot warm up for 1 iteration (Megatron's rule)
    assert abs(losses(out)[0] - losses(packed_baseline)[0]) > 1e-3


def test_cp_bad_sequence_length(setup):
    r = launch(1, "--load", str(setup / "ck"), "--data-path", str(setup / "data"), "--train-iters", "1", *COMMON,
               "--cp", "2", "--seq-length", "30", check=False)
    assert r.returncode != 0 and "--seq-length 30 is not divisible by 2 x cp = 4" in r.stderr, r.stderr[-2000:]
