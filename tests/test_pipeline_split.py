"""Uneven pipeline stages (checkpoint.layout.PipelineSplit, issue 22): Megatron's flags give the layers of each model
chunk by megatron-core's own rules (checked against megatron-core in a subprocess), checkpoints convert and reshard
between even and uneven layouts bitwise, and bad splits are one line before anything is read."""
from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from checkpoint.errors import LayoutError
from checkpoint.layout import Layout, PipelineSplit

ORACLE = Path(__file__).with_name("megatron_oracle.py")

# (num_layers, pp, vpp, split fields, mtp layers): valid and invalid splits, Megatron's recipes among them
CASES = [
    (10, 4, 1, dict(first=2, last=2), 0),
    (12, 4, 2, dict(first=2, last=2), 0),
    (126, 8, 1, dict(first=15, last=15), 0),  # Llama-3.1-405B at PP 8: 15 | 16 x 6 | 15
    (61, 16, 1, dict(first=1), 0),
    (61, 16, 1, dict(layout="Et*3|(tttt|)*13,tttt|ttmL"), 1),  # DeepSeek-V3 at PP 16, lighter first and last stages
    (61, 8, 2, dict(layout="Et*3|(tttt|)*14,tt|mL"), 1),
    (10, 4, 1, dict(embedding=True, loss=True), 0),
    (14, 4, 2, dict(embedding=True, loss=True), 0),
    (7, 4, 1, dict(embedding=True), 0),
    (4, 2, 2, dict(layout="Et|t|tt|L"), 0),
    (4, 2, 1, dict(first=1), 0),
    (4, 2, 1, dict(last=3), 0),
    # refused by megatron-core
    (10, 4, 1, dict(first=3), 0),  # 7 middle layers over 3 stages
    (10, 4, 2, dict(first=3, last=3), 0),  # 3 not divisible by vpp 2
    (10, 2, 1, dict(first=4), 0),  # the last stage takes the other 6
    (10, 2, 1, dict(first=4, last=4), 0),  # 2 layers left, no middle stage
    (10, 4, 1, dict(embedding=True), 0),  # 11 over 4
    (4, 2, 1, dict(layout="Et|tt|L"), 0),  # 3 stages at pp 2
    (4, 2, 1, dict(layout="Ett|tL"), 0),  # 3 decoder layers for 4
    (4, 2, 1, dict(layout="tEt|ttL"), 0),  # embedding not first
    (4, 2, 1, dict(layout="Ett|ttLL"), 0),  # two losses
]


def _random_cases(n: int, seed: int = 0) -> list:
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        pp, vpp = rng.choice([2, 3, 4, 8]), rng.choice([1, 1, 2])
        layers = rng.randint(pp * vpp, 40)
        form = rng.choice(["first", "last", "both", "embedding", "loss", "layout"])
        if form == "layout":
            cuts = sorted(rng.randint(0, layers) for _ in range(pp * vpp - 1))
            counts = [b - a for a, b in zip([0, *cuts], [*cuts, layers])]
            stages = ["t" * c for c in counts]
            stages[0], stages[-1] = "E" + stages[0], stages[-1] + "L"
            split = dict(layout="|".join(stages))
        elif form in ("embedding", "loss"):
            split = {form: True}
        else:
            split = {k: rng.randint(1, 6) * vpp for k in (["first", "last"] if form == "both" else [form])}
        out.append((layers, pp, vpp, split, 0))
    return out


def _ours(layers, pp, vpp, split, mtp):
    try:
        lay = Layout(pp=pp, vpp=vpp, split=PipelineSplit(**split))
        counts = list(lay.chunk_layers(layers, mtp))
        offsets = [lay.layer_range(layers, c % pp, c // pp)[0] for c in range(pp * vpp)]
        return {"ok": True, "counts": counts, "offsets": offsets}
    except LayoutError as e:
        return {"ok": False, "error": str(e)}


def test_split_equals_megatron_core(tmp_path):
    """Decoder layers and layer offsets of every model chunk equal megatron-core's get_num_layers_to_build /
    get_transformer_layer_offset / PipelineParallelLayerLayout, and what megatron-core refuses is refused."""
    cases = CASES + _random_cases(60)
    jobs = []
    for i, (layers, pp, vpp, split, mtp) in enumerate(cases):
        split = {k: v for k, v in split.items() if v is not None}
        jobs.append({"num_layers": layers, "pp": pp, "vpp": vpp, "mtp": mtp, "out": str(tmp_path / f"{i}.json"),
                     **split})
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    r = subprocess.run([sys.executable, str(ORACLE), "pipeline_split", str(tmp_path / "jobs.json")],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    refused = 0
    for job, (layers, pp, vpp, split, mtp) in zip(jobs, cases):
        want = json.loads(Path(job["out"]).read_text())
        got = _ours(layers, pp, vpp, {k: v for k, v in split.items() if v is not None}, mtp)
        assert got["ok"] == want["ok"], (job, got, want)
        if want["ok"]:
            assert (got["counts"], got["offsets"]) == (want["counts"], want["offsets"]), (job, got, want)
        else:
            refused += 1
    assert refused >= 8  # the refused cases above are refused by both


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardkit", *args], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def llama10(tmp_path_factory):
    from shardkit.demo import build_tiny_llama

    root = tmp_path_factory.mktemp("split")
    build_tiny_llama(root / "hf", dtype=torch.float32, num_hidden_layers=10)
    return root


def test_uneven_convert_reshard_round_trip(llama10):
    """A 10-layer Llama at PP 4 with first 2 / last 2, resharded to PP 3 uneven (a layout string) and to PP 1: bitwise
    equal to a direct conversion; each uneven checkpoint's logits equal HF's; the manifest records the split; the
    torch_dist export of the uneven checkpoint holds the same global tensors as the even one's."""
    from checkpoint.reader import Checkpoint
    from shardkit.cli import main as cli

    root = llama10
    hf = str(root / "hf")
    assert cli(["convert", "hf-to-mcore", hf, str(root / "a"), "--pp", "4", "--decoder-first-pipeline-num-layers",
                "2", "--decoder-last-pipeline-num-layers", "2", "--quiet"]) == 0
    assert cli(["reshard", str(root / "a"), str(root / "b"), "--pp", "3", "--pipeline-model-parallel-layout",
                "Ettt|tttt|tttL", "--quiet"]) == 0
    assert cli(["reshard", str(root / "b"), str(root / "c"), "--pp", "1", "--quiet"]) == 0
    assert cli(["convert", "hf-to-mcore", hf, str(root / "d"), "--quiet"]) == 0
    a, b = Checkpoint(root / "a"), Checkpoint(root / "b")
    assert a.manifest.layout.split == PipelineSplit(first=2, last=2)
    assert b.manifest.layout.split == PipelineSplit(layout="Ettt|tttt|tttL")
    assert [a.manifest.layout.layer_range(10, p, 0) for p in range(4)] == [(0, 2), (2, 5), (5, 8), (8, 10)]
    c, d = Checkpoint(root / "c").state_dict(), Checkpoint(root / "d").state_dict()
    assert c.keys() == d.keys() and all(torch.equal(c[k], d[k]) for k in c)
    assert Checkpoint(root / "c").manifest.layout.split is None  # a new --pp without split flags is even
    for ck in ("a", "b"):
        r = _cli("verify", str(root / ck), "--against", hf, "--json")
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["parity"]["ok"]
    # torch_dist: the same global tensors whatever the split (keys and offsets are global)
    assert cli(["reshard", str(root / "a"), str(root / "a_td"), "--format", "torch_dist", "--quiet"]) == 0
    assert cli(["reshard", str(root / "a_td"), str(root / "a_back"), "--pp", "1", "--quiet"]) == 0
    back = Checkpoint(root / "a_back").state_dict()
    assert back.keys() == d.keys() and all(torch.equal(back[k], d[k]) for k in d)


@pytest.mark.parametrize("flags,words", [
    (["--pp", "4", "--decoder-first-pipeline-num-layers", "3"], ["7 layers", "3 middle"]),
    (["--pp", "4", "--vpp", "2", "--decoder-first-pipeline-num-layers", "3", "--decoder-last-pipeline-num-layers",
      "3"], ["--decoder-first-pipeline-num-layers 3", "--vpp 2"]),
    (["--pp", "2", "--decoder-first-pipeline-num-layers", "11"], ["--decoder-first/last-pipeline-num-layers"]),
    (["--pp", "2", "--pipeline-model-parallel-layout", "Ettt|tttt|tttL"], ["3 stages", "--pp 2"]),
    (["--pp", "2", "--pipeline-model-parallel-layout", "Ettttt|ttttL"], ["9 decoder layers", "num_hidden_layers=10"]),
    (["--pp", "2", "--pipeline-model-parallel-layout", "Etttttx|tttttL"], ["invalid layer character 'x'"]),
    (["--pp", "2", "--pipeline-model-parallel-layout", "Ettttt|tttttL", "--decoder-first-pipeline-num-layers", "5"],
     ["cannot be combined"]),
    (["--pp", "3"], ["not divisible", "--decoder-first-pipeline-num-layers"]),
    (["--decoder-first-pipeline-num-layers", "5"], ["needs --pp > 1"]),
    (["--pp", "2", "--decoder-first-pipeline-num-layers", "0"], ["must be a positive integer"]),
])
def test_bad_split_is_one_line(llama10, tmp_path, flags, words):
    out = tmp_path / "out"
    r = _cli("convert", "hf-to-mcore", str(llama10 / "hf"), str(out), *flags)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert all(w in lines[0] for w in words), lines[0]
    assert not out.exists()


def test_plan_splits_layers_that_do_not_divide():
    """plan: Llama-3.1-405B (126 layers) at TP 8 PP 8 CP 2 gets Megatron's first 15 / last 15 split, valid, with its
    per-stage memory (the heaviest stage named); the stage layers are the checkpoint layout's own ranges."""
    from plan.memory import stage_layers
    from plan.search import uneven_split

    assert uneven_split(126, 8) == PipelineSplit(first=15, last=15)
    assert uneven_split(61, 16) == PipelineSplit(first=1)  # DeepSeek-V3 at PP 16: a lighter first stage
    assert uneven_split(32, 8) is None  # even
    split = PipelineSplit(first=15, last=15)
    assert [len(x) for x in stage_layers(126, 8, 1, split)] == [15] + [16] * 6 + [15]
    r = _cli("plan", "--model", "llama3.1-405b", "--gpus", "128", "--layout", "tp=8,pp=8,cp=2,dp=1",
             "--optimizer-sharding", "--json")
    assert r.returncode == 0, r.stderr
    req = json.loads(r.stdout)["requested"]
    assert req and all(c["valid"] for c in req), req
    assert req[0]["layout"]["pipeline_split"] == {"first": 15, "last": 15}
    assert "first15 last15" in req[0]["label"]
