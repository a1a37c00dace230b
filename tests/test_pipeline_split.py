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


def _planner_cases() -> list:
    """The splits `plan` proposes (flags, and layout strings for --vpp), which megatron-core must accept as such."""
    from plan.search import uneven_split

    out = []
    for layers, pp, vpp, mtp in ((126, 8, 1, 0), (61, 16, 1, 1), (61, 16, 2, 1), (61, 8, 2, 1), (61, 8, 4, 1),
                                 (61, 32, 1, 1), (5, 4, 1, 1), (80, 3, 1, 0), (61, 2, 1, 1)):
        split = uneven_split(layers, pp, vpp, mtp)
        assert split is not None, (layers, pp, vpp, mtp)
        out.append((layers, pp, vpp, split.as_dict(), mtp))
    assert sum("layout" in c[3] for c in out) >= 4
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
    cases = CASES + _planner_cases() + _random_cases(60)
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
    assert cli(["convert", "hf-to-mcore", hf, str(root / "d"), "--quiet", "--no-verify"]) == 0
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
    (["--pp", "4", "--decoder-first-pipeline-num-layers", "3"], ["7 layers", "the 2 middle and the last stage"]),
    (["--pp", "2", "--decoder-first-pipeline-num-layers", "3", "--vpp", "2"], ["--vpp 2"]),
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


def test_plan_splits_layers_that_do_not_divide(tmp_path):
    """plan: Llama-3.1-405B (126 layers) at TP 8 PP 8 CP 2 gets the field's 15 | 16 x 6 | 15 split (Megatron's
    --decoder-first/last-pipeline-num-layers), valid, with every stage's memory and the heaviest stage named in the
    table, the JSON and the chart; DeepSeek-V3 (61 layers + MTP) at PP 16 gets lighter first and last stages (3 | 4 x 14
    | 2 + MTP + loss), and with --vpp a --pipeline-model-parallel-layout string; the stage layers are the checkpoint
    layout's own ranges."""
    from plan.memory import stage_layers
    from plan.search import uneven_split

    assert uneven_split(126, 8) == PipelineSplit(first=15, last=15)
    assert uneven_split(61, 16, 1, 1) == PipelineSplit(first=3, last=2)  # DeepSeek-V3's own recipe
    ds_vpp = uneven_split(61, 16, 2, 1)
    assert ds_vpp.layout is not None
    counts = Layout(pp=16, vpp=2, split=ds_vpp).chunk_layers(61, 1)
    assert counts[0] == 1 and counts[-1] == 0 and set(counts[1:-1]) == {2}  # E + 1 | 2 x 30 | MTP + loss
    assert uneven_split(32, 8) is None  # even
    assert uneven_split(40, 16) is None  # the first and last stages would have to be heavier than the middle
    split = PipelineSplit(first=15, last=15)
    assert [len(x) for x in stage_layers(126, 8, 1, split)] == [15] + [16] * 6 + [15]
    # the field runs this layout as Megatron-LM with Transformer Engine's fused kernels (issue 40: plan models the
    # engine; CP 2 runs on the native engine here, whose eager layer keeps more activations)
    args = ["plan", "--model", "llama3.1-405b", "--gpus", "128", "--layout", "tp=8,pp=8,cp=2,dp=1",
            "--use-distributed-optimizer", "--recompute", "full", "--kernels", "fused"]
    r = _cli(*args, "--json")
    assert r.returncode == 0, r.stderr
    req = json.loads(r.stdout)["requested"]
    assert req and all(c["valid"] for c in req), req
    assert req[0]["layout"]["pipeline_split"] == {"first": 15, "last": 15}
    assert "first15 last15" in req[0]["label"]
    assert req[0]["stage_layers"] == [15] + [16] * 6 + [15]
    stages, heavy = req[0]["memory"]["stages"], req[0]["memory"]["pp_rank"]
    assert len(stages) == 8 and stages[heavy] == max(stages) == req[0]["memory"]["total"]
    assert req[0]["fits"]  # the field's layout fits 80 GiB with full recompute and the distributed optimizer
    r = _cli(*args, "--plot", str(tmp_path / "plan.png"))
    assert r.returncode == 0, r.stderr
    text = " ".join(x.strip() for x in r.stdout.splitlines())  # the detail lines are wrapped at 120 columns
    line = text[text.index("per stage") - 40:]
    line = line[:line.index(" GiB)") + 5]
    assert "tp8 pp8 cp2 dp1 first15 last15 [full]" in line and f"heaviest: stage {heavy}" in line
    assert f"*{heavy}: " in line and line.count("|") == 7
    assert (tmp_path / "plan.png").stat().st_size > 10_000


def test_plan_stage_panel_marks_the_heaviest_stage():
    """The chart's per-stage panel: one bar per pipeline stage, the heaviest (the one that decides "fits") in red."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from checkpoint.run_layout import RunLayout
    from plan.commands import resolve_model
    from plan.memory import TrainSettings
    from plan.perf import Hardware
    from plan.report import stage_panel
    from plan.search import plan, uneven_split

    _, cfg = resolve_model("deepseek-v3")
    lay = RunLayout(tp=2, pp=16, cp=4, ep=8, etp=1, dp=8, split=uneven_split(cfg.num_layers, 16, 1, 1))
    (c,) = plan(cfg, 1024, 80 << 30, TrainSettings(seq_length=4096, micro_batch_size=1, global_batch_size=1024,
                                                    distributed_optimizer=True), Hardware(), layouts=[lay])
    assert c.valid and c.stage_layers == [3] + [4] * 14 + [2]
    fig, ax = plt.subplots()
    try:
        bars = stage_panel(ax, c, 80 << 30)
        heights = [b.get_height() for b in bars]
        red = [i for i, b in enumerate(bars) if b.get_facecolor() == matplotlib.colors.to_rgba("tab:red")]
        assert len(bars) == 16 and red == [c.memory.pp_rank] and heights[red[0]] == max(heights)
        assert [t.get_text() for t in ax.texts] == [f"heaviest: stage {c.memory.pp_rank}, {max(heights):.1f} GiB"]
    finally:
        plt.close(fig)


# -- per-rank regions against megatron-core's own GPTModel.sharded_state_dict() ----------------------------------------

def _megatron_model(cfg, layout: Layout) -> dict:
    """The oracle's "model" dict (TransformerConfig fields) for our config at `layout`, the split by Megatron's
    names."""
    split = layout.split or PipelineSplit()
    m = dict(num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
             ffn_hidden_size=cfg.ffn_hidden_size, add_bias_linear=False, tensor_model_parallel_size=layout.tp,
             num_layers_in_first_pipeline_stage=split.first, num_layers_in_last_pipeline_stage=split.last,
             account_for_embedding_in_pipeline_split=split.embedding,
             account_for_loss_in_pipeline_split=split.loss, pipeline_model_parallel_layout=split.layout,
             padded_vocab_size=cfg.padded_vocab_size(layout.tp), max_sequence_length=64, rotary_base=cfg.rotary_base,
             tied=cfg.tie_word_embeddings)
    if cfg.multi_latent_attention:
        m.update(multi_latent_attention=True, q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank,
                 qk_head_dim=cfg.qk_head_dim, qk_pos_emb_head_dim=cfg.qk_pos_emb_head_dim, v_head_dim=cfg.v_head_dim,
                 qk_layernorm=True, rope_type="rope")
    else:
        m.update(num_query_groups=cfg.num_query_groups, kv_channels=cfg.kv_channels)
    if cfg.is_moe:
        m.update(num_moe_experts=cfg.num_moe_experts, moe_ffn_hidden_size=cfg.moe_ffn_hidden_size,
                 moe_shared_expert_intermediate_size=cfg.moe_shared_expert_intermediate_size,
                 moe_layer_freq=list(cfg.moe_layer_freq), moe_router_topk=cfg.moe_router_topk,
                 moe_router_score_function=cfg.moe_router_score_function,
                 moe_router_enable_expert_bias=cfg.moe_router_enable_expert_bias,
                 expert_model_parallel_size=layout.ep)
    if cfg.mtp_num_layers:
        m["mtp_num_layers"] = cfg.mtp_num_layers
    return m


def _our_boxes(cfg, layout: Layout, coord) -> set:
    """Our sharding table's regions of every tensor for one rank and model chunk, cut into one box per layer and
    expert (megatron-core's ShardedTensors are per layer and per expert), as (vstage, key, global shape, offset,
    shape, primary)."""
    import itertools

    from checkpoint.sharding import regions
    from checkpoint.families import model_specs

    out = set()
    for s in model_specs(cfg, layout):
        for r in regions(s, layout, coord, cfg.num_layers):
            lead = s.lead
            for idx in itertools.product(*(range(o, o + n) for o, n in zip(r.global_offset[:lead], r.shape[:lead]))):
                out.add((r.vstage, s.name, tuple(s.shape), (*idx, *r.global_offset[lead:]),
                         (1,) * lead + tuple(r.shape[lead:]), r.primary))
    return out


def _deepseek_cfg(layers: int):
    from checkpoint.config import ModelConfig
    from tests.moe_models import BASE, CONFIGS

    cls, kw = CONFIGS["deepseek_v3"]
    return ModelConfig.from_hf(cls(**{**BASE, **kw, "num_hidden_layers": layers}).to_dict())


def _llama_cfg(layers: int):
    from checkpoint.config import ModelConfig

    return ModelConfig(model_type="llama", num_layers=layers, hidden_size=64, ffn_hidden_size=128,
                       num_attention_heads=4, num_query_groups=2, kv_channels=16, vocab_size=300,
                       max_position_embeddings=64, norm_epsilon=1e-5, rotary_base=1e4)


REGION_CASES = {  # name: (model, layout); tp 1 for MLA: the local spec splits q/kv down-projections, TE's does not
    "llama_first_last": ("llama", 10, Layout(tp=2, pp=4, split=PipelineSplit(first=2, last=2))),
    "llama_vpp_first_last": ("llama", 12, Layout(tp=2, pp=4, vpp=2, split=PipelineSplit(first=2, last=2))),
    "llama_embedding_loss": ("llama", 10, Layout(pp=4, split=PipelineSplit(embedding=True, loss=True))),
    "llama_layout_vpp": ("llama", 10, Layout(tp=2, pp=2, vpp=2, split=PipelineSplit(layout="Et|tttt|ttt|ttL"))),
    "deepseek_first": ("deepseek", 4, Layout(pp=2, ep=2, split=PipelineSplit(first=1))),
    # vstage 1 of rank 1 holds MTP and loss and no decoder layer, as DeepSeek-V3's own recipe ends
    "deepseek_layout_vpp": ("deepseek", 4, Layout(pp=2, vpp=2, ep=2, split=PipelineSplit(layout="Et|tt|t|mL"))),
}


@pytest.fixture(scope="module")
def megatron_regions(tmp_path_factory):
    """One oracle run for every case above."""
    d = tmp_path_factory.mktemp("regions")
    jobs = []
    for name, (model, layers, layout) in REGION_CASES.items():
        cfg = (_llama_cfg if model == "llama" else _deepseek_cfg)(layers)
        jobs.append({"model": _megatron_model(cfg, layout), "tp": layout.tp, "pp": layout.pp, "vpp": layout.vpp,
                     "ep": layout.ep, "out": str(d / f"{name}.json")})
    (d / "jobs.json").write_text(json.dumps(jobs))
    r = subprocess.run([sys.executable, str(ORACLE), "regions", str(d / "jobs.json")], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return {name: json.loads((d / f"{name}.json").read_text()) for name in REGION_CASES}


@pytest.mark.parametrize("case", list(REGION_CASES))
def test_regions_equal_megatron_core(megatron_regions, case):
    """For every pipeline rank, model chunk, TP rank and EP rank: the keys, global shapes and each piece's (global
    offset, local shape) of megatron-core's GPTModel built for that stage (its own decoder/MTP block specs, uneven
    split flags or layout string) equal our sharding table's regions() for that rank. Keys go through the local
    spec's names (checkpoint.megatron.canonical_candidates). Two documented differences, both only in which rank
    holds a tensor (global keys, shapes and offsets, and so the torch_dist bytes, are the same): with MTP layers
    megatron-core keeps a tied copy of the embedding on the MTP stage (a replica, replica_id != 0; shardkit stores no
    replicas), and puts decoder.final_layernorm in the model chunk of the last decoder layer
    (TransformerBlock.has_final_layernorm_in_this_stage), where shardkit keeps it with the loss in the last chunk:
    they differ when the last chunk holds no decoder layer ("...|mL")."""
    from checkpoint.layout import RankCoord
    from checkpoint.megatron import canonical_candidates
    from checkpoint.families import model_specs

    model, layers, layout = REGION_CASES[case]
    cfg = (_llama_cfg if model == "llama" else _deepseek_cfg)(layers)
    names = {s.name for s in model_specs(cfg, layout)}
    ranks = megatron_regions[case]
    assert len(ranks) == layout.pp * layout.vpp * layout.tp * layout.ep
    last_chunk = (layout.pp - 1, layout.vpp - 1)
    want: dict[tuple, set] = {}
    replicas, final_norm_at = [], set()
    for entry in ranks:
        at = (entry["pp"], entry["vstage"], entry["tp"], entry["ep"])
        want.setdefault(at, set())
        for key, shape, offset, local, primary in entry["boxes"]:
            name = next((c for c in canonical_candidates(key) if c in names), key)
            box = (name, tuple(shape), tuple(offset), tuple(local), primary)
            if cfg.mtp_num_layers and name == "embedding.word_embeddings.weight" and not primary:
                replicas.append(at[:2])
                continue
            if cfg.mtp_num_layers and name == "decoder.final_layernorm.weight":
                final_norm_at.add(at[:2])
                at_last = (*last_chunk, *at[2:])
                want.setdefault(at_last, set()).add(box)
                continue
            want[at].add(box)
    if cfg.mtp_num_layers:
        assert set(replicas) == {last_chunk}
        assert final_norm_at == {layout.chunk_of_layer(cfg.num_layers - 1, cfg.num_layers)}
    counts = layout.chunk_layers(cfg.num_layers, cfg.mtp_num_layers)
    assert len(set(counts)) > 1  # the split is uneven
    with_layers = set()
    for (pp, v, tp, ep), boxes in want.items():
        got = {b[1:] for b in _our_boxes(cfg, layout, RankCoord(tp=tp, pp=pp, ep=ep, etp=tp)) if b[0] == v}
        assert got == boxes, (case, pp, v, tp, ep, sorted(got ^ boxes)[:6])
        if any(b[0].startswith("decoder.layers") for b in boxes):
            with_layers.add((pp, v))
    assert with_layers == {(c % layout.pp, c // layout.pp) for c, n in enumerate(counts) if n}


# -- Megatron-LM legacy (`--ckpt-format torch`) checkpoints with uneven stages ----------------------------------------

LEGACY_CASES = {  # name: (layers, pp, vpp, split)
    "first_last": (10, 4, 1, PipelineSplit(first=2, last=2)),
    "layout_vpp_empty_chunk": (6, 2, 2, PipelineSplit(layout="Ett|ttt||tL")),  # 2 | 3 | 0 | 1
}


@pytest.mark.parametrize("case", list(LEGACY_CASES))
def test_legacy_uneven_stages_convert(tmp_path, case):
    """Megatron-LM writes uneven stages in its legacy format like any others (each rank file holds its stage's
    GPTModel state_dict(), layers numbered from 0, the split in the args), so they are read, not refused: a
    checkpoint written that way by megatron-core's own per-stage models converts to a native checkpoint with the same
    split whose tensors equal, bit for bit, megatron-core's own global tensors (its sharded_state_dict() offsets)."""
    from checkpoint.config import ModelConfig
    from checkpoint.megatron import canonical_candidates
    from checkpoint.reader import Checkpoint
    from checkpoint.families import model_specs
    from convert.megatron_legacy import legacy_to_native

    layers, pp, vpp, split = LEGACY_CASES[case]
    cfg = ModelConfig(model_type="llama", num_layers=layers, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4,
                      num_query_groups=2, kv_channels=16, vocab_size=1000, max_position_embeddings=64,
                      norm_epsilon=1e-5, rotary_base=5e4)
    layout = Layout(pp=pp, vpp=vpp, split=split)
    m = dict(_megatron_model(cfg, layout), layernorm_epsilon=1e-5, num_query_groups=2, kv_channels=16,
             vocab_size=1000, rotary_base=50000.0)
    job = {"root": str(tmp_path / "meg"), "iteration": 5, "seed": 3, "model": m, "pp": pp, "vpp": vpp,
           "out": str(tmp_path / "out.pt")}
    (tmp_path / "jobs.json").write_text(json.dumps([job]))
    r = subprocess.run([sys.executable, str(ORACLE), "legacy_stages", str(tmp_path / "jobs.json")],
                       capture_output=True, text=True, timeout=600, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    truth = torch.load(tmp_path / "out.pt")["tensors"]
    nat = legacy_to_native(tmp_path / "meg", tmp_path / "nat", cfg, quiet=True, workers=1)
    ck = Checkpoint(nat)
    assert ck.layout == layout and ck.manifest.layout.split == split
    ck.verify()
    names = {s.name for s in model_specs(cfg, layout)}
    got = ck.state_dict()
    want = {next(c for c in canonical_candidates(k) if c in names): t for k, t in truth.items()}
    assert got.keys() == want.keys()
    for k in want:
        assert not torch.isnan(want[k]).any(), k  # megatron-core's stages cover every layer
        assert torch.equal(got[k], want[k]), k


def test_idle_ranks():
    """A pipeline rank with no decoder layer, embedding or loss (Megatron's layout strings allow one) is named."""
    assert Layout(pp=3, split=PipelineSplit(layout="Ett||ttL")).idle_ranks(4) == [1]
    assert Layout(pp=4, split=PipelineSplit(layout="E|tttt||L")).idle_ranks(4) == [2]
    assert Layout(pp=2, vpp=2, split=PipelineSplit(layout="Ett||tt|L")).idle_ranks(4) == []  # rank 1 holds layers
    assert Layout(pp=4, split=PipelineSplit(first=2, last=2)).idle_ranks(10) == []


def test_trainer_refuses_an_idle_stage(llama10, tmp_path):
    """continue-pretrain with a layout string that leaves a pipeline rank with nothing to run: one line on every rank,
    before any weight is loaded, nothing saved."""
    from shardkit.cli import main as cli
    from tests.corpus import write_pattern_corpus
    from tests.test_train import launch

    ck = tmp_path / "ck"
    assert cli(["convert", "hf-to-mcore", str(llama10 / "hf"), str(ck), "--quiet", "--no-verify"]) == 0
    data = write_pattern_corpus(tmp_path / "data")
    r = launch(3, "--load", str(ck), "--data-path", str(data), "--train-iters", "1", "--seq-length", "32",
               "--micro-batch-size", "1", "--global-batch-size", "1", "--pp", "3",
               "--pipeline-model-parallel-layout", "Ettttt||tttttL", "--save", str(tmp_path / "out"), check=False)
    err = r.stderr.splitlines()
    # the only traceback is torchrun's own report that a child exited non-zero, none from a rank
    assert r.returncode != 0 and all("bin/torchrun" in err[i + 1] for i, ln in enumerate(err[:-1])
                                     if "Traceback" in ln), r.stderr[-3000:]
    lines = [ln for ln in err if "pipeline rank(s) 1" in ln]
    assert lines and all("--pipeline-model-parallel-layout Ettttt||tttttL" in ln for ln in lines), r.stderr[-3000:]
    assert not (tmp_path / "out").exists()
