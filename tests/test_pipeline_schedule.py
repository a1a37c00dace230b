"""The interleaved 1F1B schedule (--vpp) as data: every micro-batch and chunk once each way, no deadlock when sends
never block and receives do, and messages between two ranks on one channel received in the order they were sent
(what NCCL, which has no tags, needs)."""
from __future__ import annotations

import pytest

from checkpoint.errors import ConfigError
from train.parallel.interleaved import schedule


def _vstage(pp: int, rank: int, chunk: int) -> int:
    return chunk * pp + rank


@pytest.mark.parametrize("pp,vpp,n", [(2, 2, 2), (2, 2, 4), (2, 3, 6), (4, 2, 4), (4, 2, 8), (3, 4, 9), (4, 3, 12)])
def test_interleaved_schedule_is_complete_ordered_and_deadlock_free(pp, vpp, n):
    plans = [schedule(pp, vpp, r, n) for r in range(pp)]
    last = pp * vpp - 1
    for r, plan in enumerate(plans):
        fwd = [(o.chunk, o.micro_batch) for o in plan if o.forward]
        bwd = [(o.chunk, o.micro_batch) for o in plan if not o.forward]
        everything = sorted((c, m) for c in range(vpp) for m in range(n))
        assert sorted(fwd) == everything and sorted(bwd) == everything
        seen = set()
        for o in plan:  # a backward never comes before its own forward
            assert o.forward or (o.chunk, o.micro_batch) in seen
            seen.add((o.chunk, o.micro_batch))
    # execute: a rank may run its next op once what it receives has been sent (sends never block)
    done: set[tuple[bool, int, int]] = set()  # (forward, virtual stage, micro-batch)
    pos = [0] * pp
    sent: dict[tuple[str, int, int], list] = {}  # (channel, src, dst) -> messages in send order
    recv_order: dict[tuple[str, int, int], list] = {}
    while any(pos[r] < len(plans[r]) for r in range(pp)):
        progressed = False
        for r in range(pp):
            if pos[r] == len(plans[r]):
                continue
            o = plans[r][pos[r]]
            s = _vstage(pp, r, o.chunk)
            if o.forward:
                need = None if s == 0 else (True, s - 1, o.micro_batch)
            else:
                need = None if s == last else (False, s + 1, o.micro_batch)
            if need is not None and need not in done:
                continue
            if need is not None:  # this rank receives the message now
                channel = "act" if o.forward else "grad"
                src = (r - 1) % pp if o.forward else (r + 1) % pp
                recv_order.setdefault((channel, src, r), []).append(need)
            done.add((o.forward, s, o.micro_batch))
            if o.forward and s != last:
                sent.setdefault(("act", r, (r + 1) % pp), []).append((True, s, o.micro_batch))
            if not o.forward and s != 0:
                sent.setdefault(("grad", r, (r - 1) % pp), []).append((False, s, o.micro_batch))
            pos[r] += 1
            progressed = True
        assert progressed, f"deadlock at {pos}"
    assert sent == recv_order  # per channel and pair of ranks: received in the order sent


def test_interleaved_schedule_bounds_in_flight_activations():
    """Megatron's warm-up: rank r runs (pp - r - 1) * 2 + (vpp - 1) * pp forwards before its first backward."""
    pp, vpp, n = 4, 2, 8
    for r in range(pp):
        plan = schedule(pp, vpp, r, n)
        first_b = next(i for i, o in enumerate(plan) if not o.forward)
        assert first_b == (pp - r - 1) * 2 + (vpp - 1) * pp + 1


def test_interleaved_schedule_needs_micro_batches_multiple_of_pp():
    with pytest.raises(ConfigError, match="multiple of --pp 2"):
        schedule(2, 2, 0, 3)


# -- the real schedules on stages of unequal size ----------------------------------------------------------------------
# pipeline.forward_backward (1F1B) and InterleavedPipeline.forward_backward (--vpp) run as they run in the trainer, one
# thread per pipeline rank, each on a real StageStep over a real GPTModel cut by parallelize.apply_pipeline_split for
# an uneven split (model chunks of different sizes, chunks and whole ranks with no decoder layer, as Megatron's layout
# strings allow). torch.distributed's point-to-point calls are replaced by tests/nccl_model.py on threads (NCCL's rules:
# no buffering, a send completes only once the matching receive has been posted, one stream per rank and group, no
# tags). A rank that waits for ever is a deadlock (the model raises after a timeout). Every (chunk, micro-batch) forward runs exactly once
# (counted), and the gradients equal one process's (a backward missed or run twice would change them).

import threading  # noqa: E402

import torch  # noqa: E402

from checkpoint.layout import Layout, PipelineSplit  # noqa: E402


def _tiny_cfg(layers: int):
    from checkpoint.config import ModelConfig

    return ModelConfig(model_type="llama", num_layers=layers, hidden_size=16, ffn_hidden_size=32,
                       num_attention_heads=2, num_query_groups=1, kv_channels=8, vocab_size=64,
                       max_position_embeddings=32, norm_epsilon=1e-5, rotary_base=1e4, params_dtype="float64")


UNEVEN = [  # (layers, pp, vpp, split): chunk sizes in the comments (chunk c = vstage * pp + rank)
    (10, 4, 1, PipelineSplit(first=2, last=2)),  # 2 | 3 | 3 | 2
    (6, 3, 1, PipelineSplit(layout="Ett||ttttL")),  # 2 | 0 | 4: a rank with no decoder layer (no parameter at all)
    (5, 2, 1, PipelineSplit(layout="E|tttttL")),  # 0 | 5: the first stage only embeds
    (8, 2, 2, PipelineSplit(layout="Et|ttt||ttttL")),  # 1 | 3 | 0 | 4: an empty model chunk in the middle
    (6, 4, 2, PipelineSplit(layout="E|t|tt||t|t|t|L")),  # 0 1 2 0 1 1 1 0
    (12, 4, 2, PipelineSplit(first=2, last=2)),  # 1 2 2 1 | 1 2 2 1
    (7, 3, 1, PipelineSplit(embedding=True, loss=True)),  # 2 | 3 | 2
]


@pytest.mark.parametrize("layers,pp,vpp,split", UNEVEN)
def test_schedules_on_uneven_stages(layers, pp, vpp, split):
    from checkpoint.run_layout import RunLayout
    from train.model import GPTModel
    from train.parallel import interleaved, pipeline
    from train.parallel.groups import Groups
    from train.parallelize import apply_pipeline_split

    dims = RunLayout(pp=pp, vpp=vpp, split=split)
    counts = dims.model_parallel.chunk_layers(layers)
    assert len(set(counts)) > 1
    cfg = _tiny_cfg(layers)
    torch.manual_seed(0)
    ref = GPTModel(cfg, 64).double()
    n = 2 * pp  # micro-batches: a multiple of pp (the interleaved schedule needs one)
    g = torch.Generator().manual_seed(1)
    mbs = [(torch.randint(0, 64, (2, 8), generator=g), torch.randint(0, 64, (2, 8), generator=g)) for _ in range(n)]
    # one process: the mean of the micro-batch losses, as the pipeline's last stage scales them
    total = sum(ref.token_losses(ref.decoder(ref.embed(ids), *ref.rope(ids, None, torch.float64)), lab).mean()
                for ids, lab in mbs)
    (total / n).backward()
    want = {k: p.grad for k, p in ref.named_parameters()}

    from tests.nccl_model import NcclModel, ThreadTransport
    from train.parallel import p2p

    local = threading.local()
    wire = NcclModel(ThreadTransport(), lambda: local.rank, timeout=20.0)
    forwards: list[tuple[int, int]] = []  # (virtual stage, micro-batch)
    results, errors, stages = {}, {}, {}
    for r in range(pp):
        m = GPTModel(cfg, 64).double()
        m.load_state_dict(ref.state_dict())
        m.zero_grad(set_to_none=True)
        grp = Groups(dims, r, 0, 0, 0, r, pp_ranks=list(range(pp)))
        apply_pipeline_split(m, cfg, grp)
        step = pipeline.StageStep(m, grp)
        inner = step.__call__

        def counted(inp, ids, labels, extras=None, chunk=0, _inner=inner, _r=r):
            forwards.append((chunk * pp + _r, next(i for i, mb in enumerate(mbs) if mb[0] is ids)))
            return _inner(inp, ids, labels, extras, chunk)
        stages[r] = (m, grp, counted)

    def run(r):
        local.rank = r
        m, grp, counted = stages[r]

        class Step:
            model, groups = m, grp

            def __call__(self, *a, **k):
                return counted(*a, **k)
        try:
            if vpp == 1:
                results[r] = pipeline.forward_backward(Step(), mbs, (2, 8, 16), torch.float64)
            else:
                ip = interleaved.InterleavedPipeline.__new__(interleaved.InterleavedPipeline)
                ip.step, ip.g, ip.device = Step(), grp, torch.device("cpu")
                ip.pp, ip.vpp, ip.rank = pp, vpp, r
                results[r] = ip.forward_backward(mbs, (2, 8, 16), torch.float64)
        except Exception as e:  # noqa: BLE001 - reported below
            errors[r] = e

    saved = p2p.dist
    p2p.dist = wire.module()
    try:
        threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(pp)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        p2p.dist = saved
    assert not errors, errors
    assert not any(t.is_alive() for t in threads), "deadlock"
    assert sorted(forwards) == sorted((s, i) for s in range(pp * vpp) for i in range(n))
    assert float(results[pp - 1]) == pytest.approx(float(total.detach()), rel=1e-12)
    got = {}
    for r in range(pp):
        for k, p in stages[r][0].named_parameters():
            if k.startswith("embedding.") and r != 0:
                continue  # a tied copy would be all-reduced by the trainer; none here (untied, no MTP)
            assert k not in got, k
            got[k] = p.grad
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-10, atol=1e-12, msg=k)
