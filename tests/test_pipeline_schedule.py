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
