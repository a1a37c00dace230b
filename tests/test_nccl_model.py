"""The trainer under NCCL's point-to-point rules (tests/nccl_model.py): no hang, and the same numbers.

1. The model itself (threads): the exchanges the trainer used before issue 32 hang under it (a stand-alone isend to a
   neighbour followed by an irecv from it, on both sides: 1F1B's send_forward_recv_backward against the next stage's
   send_backward_recv_forward, and the CP ring's send-next / receive-previous at CP 2 and 3), while the same messages
   posted as one batch per exchange (train/parallel/p2p.py) go through; a mismatched pair is caught.
2. The schedules as data (`pipeline.comm_plan`): every rank's batches, executed together under the rules, complete and
   match message for message, for 1F1B at pp 2-8 and any micro-batch count, interleaved at pp 2-8 x vpp 2-5, and
   forward-only evaluation.
3. The real pipeline code (StageStep over a real model, threads) hangs under the model when its exchanges are posted as
   before (stand-alone isend, then irecv) and completes when batched: the kept regression test for the old code.
4. Real `continue-pretrain` runs, ranks forked as torchrun starts them, under the model over gloo, for every layout the
   issue names (PP 2 and 4 1F1B, PP 2 x VPP 2, PP 4 x VPP 2, ring CP 2, 3 and 4, CP 2 x PP 2, TP 2 x PP 2,
   EP 2 x PP 2): each completes, the model carried its point-to-point traffic (counted), and losses and saved weights
   are bitwise those of the same run without the model. The whole suite's multi-rank runs go through the model too
   (tests/fault_zygote.py).

Before this change (main at 7c64a70, run with this file and the model) the multi-rank runs of section 4 stopped at
their first point-to-point exchange: at `--pp 2` with "Deadlock: NCCL model: rank 0 waited 10 s for an isend on
group 0 (send (1, 48, 64) to rank 1): its send (1, 48, 64) to rank 1 waits for rank 1 to post the matching receive";
at `--pp 2 --vpp 2`, `--pp 4 --vpp 2`, `--cp 2`, `--cp 3` and `--cp 2 --pp 2` first on rule 5 (the pipeline's and the
CP ring's groups were first used by a point-to-point operation), and with that rule off with the same Deadlock (the
interleaved schedule's blocking receive behind its own pending send on the activation group; the ring's send to the
next rank ahead of its receive from the previous one on the CP group).
"""
from __future__ import annotations

import collections
import json
import threading
from pathlib import Path

import pytest
import torch

from tests.nccl_model import Deadlock, Mismatch, NcclModel, ThreadTransport


def _threads(n: int, fn, timeout: float = 60.0) -> dict:
    """Run fn(model, rank) on n threads under one thread-mode model, which also stands in for torch.distributed in
    train/parallel/p2p.py until every thread has returned; {rank: result or exception}."""
    from train.parallel import p2p

    local = threading.local()
    model = NcclModel(ThreadTransport(), lambda: local.rank, timeout=timeout)
    out: dict = {}
    saved, p2p.dist = p2p.dist, model.module()
    try:
        _run_threads(n, fn, model, local, out, timeout)
    finally:
        p2p.dist = saved
    return out


def _run_threads(n: int, fn, model, local, out: dict, timeout: float) -> None:

    def body(r: int) -> None:
        local.rank = r
        try:
            out[r] = fn(model, r)
        except Exception as e:  # noqa: BLE001 - returned to the test
            out[r] = e

    ts = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout * 3)
    assert not any(t.is_alive() for t in ts), "a thread never returned"


# -- 1. the model ---------------------------------------------------------------------------------------------------

def _old_pair_exchange(model, r):
    """pipeline._p2p before issue 32: isend to the neighbour, then irecv from it, stand-alone, then wait."""
    peer = 1 - r
    buf = torch.empty(64)
    reqs = [model.isend(torch.full((64,), float(r)), peer), model.irecv(buf, peer)]
    for q in reqs:
        q.wait()
    return buf


def _old_ring_exchange(cp):
    def fn(model, r):
        """context._exchange before issue 32: isend to the next rank, irecv from the previous one (tags ignored)."""
        buf = torch.empty(64)
        reqs = [model.isend(torch.full((64,), float(r)), (r + 1) % cp, group="cp", tag=71),
                model.irecv(buf, (r - 1) % cp, group="cp", tag=71)]
        for q in reqs:
            q.wait()
        return buf
    return fn


def _batched_ring(cp):
    def fn(model, r):
        from train.parallel import p2p

        (buf,) = p2p.exchange([(torch.full((64,), float(r)), (r + 1) % cp)], [(torch.empty(64), (r - 1) % cp)], "cp")
        return buf
    return fn


@pytest.mark.parametrize("case", ["1f1b-pair", "ring-cp2", "ring-cp3"])
def test_old_exchanges_hang_under_the_model(case):
    n, fn = (2, _old_pair_exchange) if case == "1f1b-pair" else (int(case[-1]), _old_ring_exchange(int(case[-1])))
    out = _threads(n, fn, timeout=1.0)
    assert all(isinstance(v, Deadlock) for v in out.values()), out
    assert "waits for rank" in str(out[0]) or "stream had not reached it" in str(out[0])


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_batched_ring_exchange_completes(cp):
    out = _threads(cp, _batched_ring(cp))
    for r in range(cp):
        assert torch.equal(out[r], torch.full((64,), float((r - 1) % cp))), out[r]


def test_mismatched_pair_is_caught():
    def fn(model, r):
        if r == 0:
            model.isend(torch.zeros(8), 1).wait()
        else:
            model.irecv(torch.empty(9), 0).wait()
    out = _threads(2, fn, timeout=5.0)
    assert isinstance(out[0], Mismatch) and "8 x torch.float32" in str(out[0]), out


def test_messages_match_in_posting_order_not_by_tag():
    def fn(model, r):
        if r == 0:
            a, b = model.isend(torch.ones(4), 1, tag=2), model.isend(torch.full((4,), 2.0), 1, tag=1)
            a.wait(), b.wait()
            return None
        x, y = torch.empty(4), torch.empty(4)
        p, q = model.irecv(x, 0, tag=1), model.irecv(y, 0, tag=2)
        p.wait(), q.wait()
        return x, y
    out = _threads(2, fn)
    assert torch.equal(out[1][0], torch.ones(4)) and torch.equal(out[1][1], torch.full((4,), 2.0))


def test_group_creation_order_is_checked_across_ranks(monkeypatch):
    """build_groups ends with check_group_order: a rank that created its groups in another order is one line."""
    from checkpoint.errors import LayoutError
    from train.parallel import groups

    def world(other):
        def all_gather_object(out, obj):
            out[0] = obj
            saved = groups.CREATED[:]
            groups.CREATED[:] = other
            try:
                out[1] = (len(groups.CREATED), groups.hashlib.sha256(repr(groups.CREATED).encode()).hexdigest())
            finally:
                groups.CREATED[:] = saved
        monkeypatch.setattr(groups.dist, "is_initialized", lambda: True)
        monkeypatch.setattr(groups.dist, "get_world_size", lambda group=None: 2)
        monkeypatch.setattr(groups.dist, "all_gather_object", all_gather_object)

    monkeypatch.setattr(groups, "CREATED", [((0, 1), ()), ((2, 3), ())])
    world([((0, 1), ()), ((2, 3), ())])
    groups.check_group_order()  # the same order: nothing to say
    world([((2, 3), ()), ((0, 1), ())])
    with pytest.raises(LayoutError, match="rank 1 created 2 groups in another order than rank 0"):
        groups.check_group_order()


# -- 2. the schedules as data ---------------------------------------------------------------------------------------

def _execute(plans: list[list]) -> str | None:
    """Every rank posts its plan's batches one at a time and waits for each; a pair's messages in one direction match
    in posting order; a batch completes when all its operations have matched with operations of the peers' current
    batches. None when all complete with every message matched to itself, else what went wrong."""
    sendq, recvq = collections.defaultdict(list), collections.defaultdict(list)
    for r, plan in enumerate(plans):
        for i, step in enumerate(plan):
            for m in step.sends:
                sendq[(r, m.peer)].append((i, (m.kind, m.stage, m.micro_batch)))
            for m in step.recvs:
                recvq[(m.peer, r)].append((i, (m.kind, m.stage, m.micro_batch)))
    if set(sendq) != set(recvq):
        return f"pairs that only send or only receive: {set(sendq) ^ set(recvq)}"
    for k in sendq:
        if [m for _, m in sendq[k]] != [m for _, m in recvq[k]]:
            return f"pair {k}: messages received in another order than sent"
    pos, head = [0] * len(plans), dict.fromkeys(sendq, 0)
    left = [[len(s.sends) + len(s.recvs) for s in plan] for plan in plans]
    while True:
        moved = False
        for (src, dst), h in head.items():
            while h < len(sendq[(src, dst)]):
                (bs, _), (br, _) = sendq[(src, dst)][h], recvq[(src, dst)][h]
                if pos[src] != bs or pos[dst] != br:
                    break
                left[src][bs] -= 1
                left[dst][br] -= 1
                h += 1
                moved = True
            head[(src, dst)] = h
        for r, plan in enumerate(plans):
            while pos[r] < len(plan) and left[r][pos[r]] == 0:
                pos[r] += 1
                moved = True
        if all(pos[r] == len(p) for r, p in enumerate(plans)):
            return None
        if not moved:
            return f"deadlock: ranks stopped at batches {pos}"


def test_every_schedule_is_deadlock_free_under_nccl_rules():
    from train.parallel.interleaved import units
    from train.parallel.pipeline import comm_plan, forward_units, one_f_one_b

    checked = 0
    for pp in range(2, 9):
        for n in range(1, 3 * pp + 2):
            assert _execute([comm_plan(one_f_one_b(pp, r, n), pp, 1, r) for r in range(pp)]) is None, (pp, n)
            assert _execute([comm_plan(forward_units(1, n), pp, 1, r) for r in range(pp)]) is None, (pp, n)
            checked += 2
        for vpp in range(2, 6):
            for n in range(pp, 4 * pp + 1, pp):
                assert _execute([comm_plan(units(pp, vpp, r, n), pp, vpp, r) for r in range(pp)]) is None, (pp, vpp, n)
                assert _execute([comm_plan(forward_units(vpp, n), pp, vpp, r) for r in range(pp)]) is None
                checked += 2
    assert checked == 448


def test_unbatched_schedules_deadlock_in_the_same_check():
    """The checker is not vacuous: the interleaved schedule with one batch after each op (no steady-state pairs)
    deadlocks in it."""
    from train.parallel.interleaved import schedule
    from train.parallel.pipeline import comm_plan

    plans = [comm_plan([[o] for o in schedule(2, 2, r, 4)], 2, 2, r) for r in range(2)]
    assert _execute(plans).startswith("deadlock")


# -- 3. the real pipeline code on threads, old exchanges vs batched --------------------------------------------------

def _old_style_exchange(sends, recvs, group):
    """How pipeline._p2p posted an exchange before issue 32: each send, then each receive, stand-alone."""
    from train.parallel import p2p

    reqs = [p2p.dist.isend(t.contiguous(), peer, group=group) for t, peer in sends]
    reqs += [p2p.dist.irecv(buf, peer, group=group) for buf, peer in recvs]
    for q in reqs:
        q.wait()
    return [buf for buf, _ in recvs]


@pytest.mark.parametrize("vpp", [1, 2])
@pytest.mark.parametrize("old", [True, False], ids=["old-exchange-hangs", "batched"])
def test_real_pipeline_on_threads(monkeypatch, vpp, old):
    from checkpoint.run_layout import RunLayout
    from tests.test_pipeline_schedule import _tiny_cfg
    from train.model import GPTModel
    from train.parallel import interleaved, p2p, pipeline
    from train.parallel.groups import Groups
    from train.parallelize import apply_pipeline_split

    pp, layers, n = 2, 4, 4
    dims = RunLayout(pp=pp, vpp=vpp)
    cfg = _tiny_cfg(layers)
    torch.manual_seed(0)
    ref = GPTModel(cfg, 64).double()
    g = torch.Generator().manual_seed(1)
    mbs = [(torch.randint(0, 64, (2, 8), generator=g), torch.randint(0, 64, (2, 8), generator=g)) for _ in range(n)]
    stages = []
    for r in range(pp):
        m = GPTModel(cfg, 64).double()
        m.load_state_dict(ref.state_dict())
        grp = Groups(dims, r, 0, 0, 0, r, pp_ranks=list(range(pp)))
        apply_pipeline_split(m, cfg, grp)
        stages.append(pipeline.StageStep(m, grp))
    if old:
        monkeypatch.setattr(p2p, "exchange", _old_style_exchange)

    def fn(model, r):
        if vpp == 1:
            return pipeline.forward_backward(stages[r], mbs, (2, 8, 16), torch.float64)
        return interleaved.InterleavedPipeline(stages[r], stages[r].groups, n, torch.device("cpu")).forward_backward(
            mbs, (2, 8, 16), torch.float64)

    out = _threads(pp, fn, timeout=3.0 if old else 60.0)
    if old:
        assert any(isinstance(v, Deadlock) for v in out.values()), out
    else:
        assert not any(isinstance(v, Exception) for v in out.values()), out
        want = sum(ref.token_losses(ref.decoder(ref.embed(i), *ref.rope(i, None, torch.float64)), lab).mean()
                   for i, lab in mbs)
        assert float(out[pp - 1]) == pytest.approx(float(want.detach()), rel=1e-12)


# -- 4. real runs over gloo, with and without the model --------------------------------------------------------------

COMMON = ["--seq-length", "48", "--micro-batch-size", "1", "--global-batch-size", "8", "--lr", "1e-3",
          "--lr-warmup-iters", "1", "--min-lr", "1e-4", "--clip-grad", "1.0", "--seed", "7", "--train-iters", "3",
          "--save-interval", "3",
          "--attention-dropout", "0", "--hidden-dropout", "0"]
LAYOUTS = {  # name: (model, ranks, flags)
    "pp2": ("llama", 2, ["--pp", "2"]),
    "pp4": ("llama", 4, ["--pp", "4"]),
    "pp2-vpp2": ("llama", 2, ["--pp", "2", "--vpp", "2"]),
    "pp4-vpp2": ("llama", 4, ["--pp", "4", "--vpp", "2"]),
    "cp2": ("llama", 2, ["--cp", "2"]),
    "cp3": ("llama", 3, ["--cp", "3"]),
    "cp4": ("llama", 4, ["--cp", "4"]),
    "cp2-pp2": ("llama", 4, ["--cp", "2", "--pp", "2"]),
    "tp2-pp2": ("llama", 4, ["--tp", "2", "--pp", "2", "--sequence-parallel"]),
    "ep2-pp2": ("mixtral", 4, ["--ep", "2", "--pp", "2", "--moe-router-load-balancing-type", "aux_loss",
                               "--moe-aux-loss-coeff", "0.01"]),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from shardkit.cli import main as cli
    from shardkit.demo import build_tiny_llama
    from tests import moe_models
    from tests.corpus import write_pattern_corpus

    root = tmp_path_factory.mktemp("nccl_model")
    build_tiny_llama(root / "llama-hf", dtype=torch.float32, num_hidden_layers=8, hidden_size=64,
                     intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
    moe_models.build("mixtral", root / "mixtral-hf")
    for kind in ("llama", "mixtral"):
        assert cli(["convert", "hf-to-mcore", str(root / f"{kind}-hf"), str(root / f"{kind}-ck"), "--quiet",
                    "--no-verify"]) == 0
    write_pattern_corpus(root / "data")
    return root


def _arrays(save: Path) -> dict[str, torch.Tensor]:
    from checkpoint.reader import Checkpoint

    return Checkpoint(save / "iter_0000003").state_dict()


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_training_under_the_model_equals_the_unconstrained_run(monkeypatch, models, name):
    from tests.launcher import launch
    from tests.test_train import losses

    kind, nproc, flags = LAYOUTS[name]
    runs = {}
    for modelled in (True, False):
        out = models / f"{name}-{'model' if modelled else 'plain'}"
        log = models / f"{name}.model.jsonl"
        monkeypatch.setenv("SHARDKIT_TEST_NCCL_MODEL", "1" if modelled else "0")
        monkeypatch.setenv("SHARDKIT_TEST_NCCL_MODEL_LOG", str(log))
        launch(nproc, "--load", str(models / f"{kind}-ck"), "--data-path", str(models / "data"), "--save", str(out),
               *COMMON, *flags)
        runs[modelled] = out
    counts = [json.loads(line) for line in log.read_text().splitlines()]
    assert sorted(c["rank"] for c in counts) == list(range(nproc))  # only the modelled run reports
    assert all(c["batches"] > 0 for c in counts), counts  # every rank's exchanges went through the model
    assert losses(runs[True]) == losses(runs[False]) and len(losses(runs[True])) == 3
    a, b = _arrays(runs[True]), _arrays(runs[False])
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
