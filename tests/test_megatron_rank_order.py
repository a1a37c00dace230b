"""checkpoint.megatron's rank order against megatron-core's own RankGenerator (parallel_state), which
initialize_model_parallel uses to build every group: the dense generator (tp-cp-dp-pp) and the expert one
(etp-ep-edp-pp) over the same ranks. The trainer's groups (RunLayout) and the torch_dist writer's rank of each
chunk are built from these helpers.
"""
from __future__ import annotations

import importlib.util
import itertools
import json
import subprocess
import sys

import pytest

from checkpoint.layout import Layout
from checkpoint.megatron import DENSE_ORDER, EXPERT_ORDER, rank_of, rank_sizes, span, world_size
from checkpoint.run_layout import RunLayout
from train.parallel.groups import _expert_groups

# megatron-core runs in a subprocess only: importing it here would register its pickle safe globals in this process
if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
    pytest.skip("megatron-core is not installed", allow_module_level=True)

# (tp, cp, dp, pp, ep): EP inside DP x CP, as the trainer requires
CASES = [(1, 1, 4, 1, 2), (2, 1, 2, 2, 2), (2, 2, 2, 1, 4), (1, 2, 3, 2, 3), (4, 1, 2, 3, 1), (2, 2, 1, 2, 1)]
ORACLE = """
import json, sys
from megatron.core.parallel_state import RankGenerator
out = []
for tp, cp, dp, pp, ep in json.loads(sys.argv[1]):
    dense = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
    expert = RankGenerator(tp=tp, ep=ep, dp=dp * cp // ep, pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    out.append({"dense": {t: dense.get_ranks(t) for t in ("tp", "cp", "dp", "pp", "dp-cp", "tp-pp")},
                "expert": {t: expert.get_ranks(t) for t in ("tp", "ep", "dp", "pp")}})
print("ORACLE " + json.dumps(out))
"""


def groups(sizes: dict[str, int], order: tuple[str, ...], vary: tuple[str, ...]) -> list[list[int]]:
    """Every group whose members differ in the `vary` dimensions (first in order fastest), as Megatron lists them."""
    fixed = [d for d in order if d not in vary]
    out = []
    for at in itertools.product(*(range(sizes[d]) for d in reversed(fixed))):
        base = dict(zip(reversed(fixed), at))
        members = []
        for inner in itertools.product(*(range(sizes[d]) for d in reversed(vary))):
            members.append(rank_of(sizes, order, **base, **dict(zip(reversed(vary), inner))))
        out.append(sorted(members))
    return sorted(out)


@pytest.fixture(scope="module")
def megatron():
    r = subprocess.run([sys.executable, "-c", ORACLE, json.dumps(CASES)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("ORACLE ")][-1]
    return json.loads(line[len("ORACLE "):])


@pytest.mark.parametrize("case", range(len(CASES)))
def test_groups_match_megatron_rank_generator(megatron, case):
    tp, cp, dp, pp, ep = CASES[case]
    want = {k: sorted(sorted(g) for g in v) for k, v in megatron[case]["dense"].items()}
    dims = RunLayout(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep)
    s = dims.sizes
    for token, vary in {"tp": ("tp",), "cp": ("cp",), "dp": ("dp",), "pp": ("pp",), "dp-cp": ("cp", "dp"),
                        "tp-pp": ("tp", "pp")}.items():
        assert groups(s, DENSE_ORDER, vary) == want[token], token
    ew = {k: sorted(sorted(g) for g in v) for k, v in megatron[case]["expert"].items()}
    es = dims.expert_sizes
    for token, dim in {"tp": "etp", "ep": "ep", "dp": "edp", "pp": "pp"}.items():
        assert groups(es, EXPERT_ORDER, (dim,)) == ew[token], token
    built = list(_expert_groups(dims))  # what build_groups makes the trainer's ep / edp process groups from
    assert sorted(sorted(g) for ep_groups, _ in built for g in ep_groups) == ew["ep"]
    assert sorted(sorted(g) for _, edp_groups in built for g in edp_groups) == ew["dp"]
    for r in range(dims.world):  # the trainer's coordinates are the same order
        c = dims.coords(r)
        assert dims.rank(**c) == r
        e, edp = dims.expert_coords(r)
        assert next(g for g in ew["ep"] if r in g).index(r) == e  # groups list their ranks in increasing order
        assert next(g for g in ew["dp"] if r in g).index(r) == edp


def test_spans_and_smallest_world():
    s = {"tp": 2, "cp": 3, "dp": 4, "pp": 5}
    assert [span(d, s) for d in DENSE_ORDER] == [2, 6, 24, 120]
    layout = Layout(tp=2, pp=3, ep=4)  # expert grid ETP x EP = 8 needs DP 4 under TP 2
    assert rank_sizes(layout) == {"tp": 2, "cp": 1, "dp": 4, "pp": 3} and world_size(layout) == 24
    assert rank_sizes(layout, expert=True) == {"etp": 2, "ep": 4, "edp": 1, "pp": 3}
    with pytest.raises(ValueError, match="not in the rank order"):
        span("ep", s)
