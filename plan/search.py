"""Enumerate the parallel layouts of N GPUs, check each against the model, estimate memory and step time, rank.

Model-parallel constraints are checkpoint.layout.Layout.check's (heads % tp, KV groups % tp, ffn % tp, experts % ep,
layers per model chunk: even, or for layers that do not divide the stages an uneven split with lighter first and
last stages, `uneven_split`); the planner adds what only a training run has: seq % 2cp (zigzag context parallelism), the
global batch divisible by micro batch x dp, the expert layout fitting the ranks of a stage, TP inside a node.
A layout that breaks one is still estimated (layers dealt out unevenly) so the table can say what it would cost.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

from checkpoint.config import ModelConfig
from checkpoint.errors import LayoutError
from checkpoint.layout import Layout, PipelineSplit
from checkpoint.run_layout import RunLayout

from .memory import RECOMPUTE, MemoryEstimate, TrainSettings, estimate_memory, stage_layers
from .perf import Hardware, step_time
from .units import PlanError


@dataclass
class Candidate:
    layout: RunLayout
    settings: TrainSettings
    memory: MemoryEstimate
    perf: dict
    violations: list[str] = field(default_factory=list)
    fits: bool = False
    reason: str = ""  # why it does not fit / is invalid, one line
    num_layers: int = 0  # the model's decoder layers
    free: float = 0.0  # GPU memory left at the heaviest stage (negative: short by that much)
    headroom: int = 0  # the reserve "fits" keeps free (allocator fragmentation, the estimate's error)
    unusual: list[str] = field(default_factory=list)  # why a Megatron user would not expect this layout
    why: str = ""  # an unusual layout ranked first: what it wins by, against the fastest usual one
    engine_note: str = ""  # why this layout is the native engine's where megatron-core was the default

    @property
    def valid(self) -> bool:
        return not self.violations

    @property
    def stage_layers(self) -> list[int]:
        """Decoder layers held by each pipeline rank (all its model chunks)."""
        lay = self.layout
        return [len(x) for x in stage_layers(self.num_layers, lay.pp, lay.vpp, lay.split)]

    def to_dict(self) -> dict:
        return {"layout": self.layout.to_dict(), "label": self.layout.label(), "recompute": self.settings.recompute,
                "engine": self.settings.engine, "transformer_impl": self.settings.transformer_impl,
                "kernels": self.settings.layer_kernels, "engine_note": self.engine_note,
                "distributed_optimizer": self.settings.distributed_optimizer, "valid": self.valid,
                "micro_batch_size": self.settings.micro_batch_size, "violations": self.violations,
                "fits": self.fits, "reason": self.reason, "free_bytes": self.free, "headroom_bytes": self.headroom,
                "unusual": self.unusual, "why": self.why, "memory": self.memory.to_dict(),
                "stage_layers": self.stage_layers, "perf": self.perf}


def parse_layout(text: str, flag: str = "--layout") -> RunLayout:
    """A layout as `plan` prints it or as flags: 'tp=8,pp=8,dp=16,first=15,last=15' or the table's label 'tp8 pp8
    dp16 first15 last15' (keys tp pp vpp cp ep etp dp, missing ones 1; first / last: Megatron's
    --decoder-first/last-pipeline-num-layers; embedding-in-split / loss-in-split: --account-for-embedding/loss-in-
    pipeline-split; layout=STRING: --pipeline-model-parallel-layout, whose commas are its own)."""
    out: dict[str, int] = {}
    split: dict = {}
    items: list[str] = []
    for word in text.split():
        items += [word] if word.startswith("layout=") else [x for x in word.split(",") if x]
    for item in items:
        if item.startswith("layout="):
            key, value = "layout", item[len("layout="):]
        elif item in ("embedding-in-split", "loss-in-split"):
            key, value = item.split("-")[0], True
        else:
            m = re.fullmatch(r"(tp|pp|vpp|cp|ep|etp|dp|first|last)=?([0-9]+)", item)
            if not m:
                raise LayoutError(f"{flag}: cannot parse {item!r} in {text!r}; write e.g. tp=4,pp=4,dp=4 or the "
                                  "label plan prints (tp8 pp8 dp16 first15 last15); keys: tp pp vpp cp ep etp dp, "
                                  "first last (uneven pipeline), layout=STRING")
            key, value = m.group(1), int(m.group(2))
        if key in out or key in split:
            raise LayoutError(f"{flag}: {key} given twice in {text!r}")
        (split if key in ("first", "last", "embedding", "loss", "layout") else out)[key] = value
    if not out and not split:
        raise LayoutError(f"{flag}: empty layout; write e.g. tp=4,pp=4,dp=4")
    return RunLayout(**out, split=PipelineSplit(**split) if split else None)


def layout_arg(lay: RunLayout) -> str:
    """The layout as launch's --layout takes it (tp=8,pp=8,dp=16,first=15,last=15): what `plan` tells to run."""
    parts = [f"tp={lay.tp}", f"pp={lay.pp}"] + [f"{k}={getattr(lay, k)}" for k in ("vpp", "cp", "ep")
                                                  if getattr(lay, k) > 1]
    if lay.etp is not None and lay.etp != lay.tp:
        parts.append(f"etp={lay.etp}")
    parts.append(f"dp={lay.dp}")
    if lay.split is not None:
        d = lay.split.as_dict()
        parts += [f"{k}={d[k]}" for k in ("first", "last") if k in d]
        parts += [f"{k}-in-split" for k in ("embedding", "loss") if d.get(k)]
        if "layout" in d:
            return ",".join(parts) + " layout=" + d["layout"]
    return ",".join(parts)


def divisors(n: int) -> list[int]:
    """n's divisors, ascending: O(sqrt(n)) (issue 34: the linear scan ran for hours at --gpus 2**40)."""
    small, large, d = [], [], 1
    while d * d <= n:
        if n % d == 0:
            small.append(d)
            if d * d != n:
                large.append(n // d)
        d += 1
    return small + large[::-1]


MAX_GPUS = 1 << 20  # --gpus beyond this (no cluster has a million GPUs) is refused before any search
MAX_GPUS_PER_NODE = 1024


def check_gpus(gpus: int, gpus_per_node: int) -> None:
    if gpus < 1 or gpus_per_node < 1:
        raise PlanError(f"--gpus {gpus} and --gpus-per-node {gpus_per_node} must be positive")
    if gpus > MAX_GPUS or gpus_per_node > MAX_GPUS_PER_NODE:
        raise PlanError(f"--gpus {gpus} / --gpus-per-node {gpus_per_node}: at most {MAX_GPUS:,} GPUs and "
                        f"{MAX_GPUS_PER_NODE} per node are planned")
    if gpus > gpus_per_node and gpus % gpus_per_node:
        raise PlanError(f"--gpus {gpus} is not a multiple of --gpus-per-node {gpus_per_node}: nodes are used whole")


def violations(cfg: ModelConfig, layout: RunLayout, s: TrainSettings, gpus: int, gpus_per_node: int) -> list[str]:
    """Every constraint the layout breaks, each named (empty = valid)."""
    out = []
    if layout.world != gpus:
        out.append(f"tp x pp x cp x dp = {layout.world} != --gpus {gpus}")
    if layout.tp > gpus_per_node:
        out.append(f"tp {layout.tp} > --gpus-per-node {gpus_per_node}: TP must stay inside a node")
    try:
        layout.model_parallel.check(cfg)
    except LayoutError as e:
        out.append(str(e))
    if layout.cp > 1 and s.seq_length % (2 * layout.cp):
        out.append(f"--seq-length {s.seq_length} is not divisible by 2 x cp = {2 * layout.cp} (zigzag context "
                   "parallelism splits each sequence into 2 x cp chunks)")
    if s.global_batch_size % (s.micro_batch_size * layout.dp):
        out.append(f"--global-batch-size {s.global_batch_size} is not divisible by micro batch x dp = "
                   f"{s.micro_batch_size} x {layout.dp}")
    if cfg.is_moe and (layout.tp * layout.cp * layout.dp) % (layout.expert_tp * layout.ep):
        out.append(f"etp x ep = {layout.expert_tp} x {layout.ep} does not divide the {layout.tp * layout.cp * layout.dp}"
                   " ranks of a pipeline stage (tp x cp x dp)")
    if layout.vpp > 1 and layout.pp == 1:
        out.append("--vpp > 1 needs --pp > 1")
    return out


def unusual(cfg: ModelConfig, layout: RunLayout, s: TrainSettings) -> list[str]:
    """What a Megatron user would not expect in this layout (empty: a layout of the field's recipes). Context
    parallelism that leaves a CP rank fewer than 4096 tokens (the recipes use CP 2 at 8k, more only for long
    context), an MoE model without expert parallelism, pipeline stages of fewer than 4 decoder layers."""
    out = []
    if layout.cp > 1 and s.seq_length // layout.cp < 4096:
        out.append(f"context parallelism {layout.cp} at --seq-length {s.seq_length} ({s.seq_length // layout.cp} "
                   "tokens per CP rank; the field uses CP for long sequences)")
    if cfg.is_moe and layout.ep == 1 and layout.tp * layout.cp * layout.dp > 1:
        out.append("no expert parallelism for an MoE model (the field splits the experts: EP)")
    per_stage = cfg.num_layers / layout.pp
    if layout.pp > 1 and per_stage < 4:
        out.append(f"{layout.pp} pipeline stages of {per_stage:.1f} decoder layers (the field keeps 4 or more per "
                   "stage)")
    return out


def megatron_core_gap(cfg: ModelConfig, layout: RunLayout, s: TrainSettings) -> str | None:
    """Why continue-pretrain's megatron-core engine would not run this layout (None: it would): the model
    (train.engines.coverage.model_not_covered), context parallelism with MTP layers (train.engines.megatron_core
    check_context_parallel), FP8 flags it refuses on a GPU with Transformer Engine (the engine's own rule:
    train.engines.coverage.fp8_not_covered, on TE's layer spec, its default there and FP8's only one, or on the local
    spec asked for by --transformer-impl local), TE's layer spec (FP8's, or asked for by name) for a model that spec
    does not build (te_spec_not_covered: multi-latent attention with rms_norm_eps other than 1e-6), an interleaved
    schedule whose micro-batches per DP rank are not a multiple of PP (megatron-core runs them in groups of PP)."""
    from train.engines.coverage import fp8_not_covered, model_not_covered, te_spec_not_covered

    why = model_not_covered(cfg)
    if why:
        return why.removesuffix("; use --engine native")
    if layout.cp > 1 and cfg.mtp_num_layers:
        return "context parallelism with MTP layers (megatron-core divides each CP rank's MTP loss by its own tokens)"
    why = fp8_not_covered(s, te_spec=s.transformer_impl != "local", have_te=True)
    if why:
        return why.removesuffix(", or --engine native")
    te_spec = s.fp8 or s.transformer_impl == "transformer_engine"  # else the default falls back to local: layer_spec
    why = te_spec_not_covered(cfg.multi_latent_attention, cfg.norm_epsilon) if te_spec else None
    if why:  # FP8 needs TE's layer spec: the local one is no way out there
        return why.removesuffix("; use --transformer-impl local") if s.fp8 else why
    m = s.microbatches(layout.dp)
    if layout.vpp > 1 and m % layout.pp:
        return (f"its interleaved schedule runs micro-batches in groups of pp {layout.pp}, and each DP rank has {m} "
                "per step")
    return None


def layer_spec(cfg: ModelConfig, s: TrainSettings) -> tuple[str, str | None]:
    """The layer spec (continue-pretrain's --transformer-impl) a launch of `s` runs on its engine, on a GPU with
    Transformer Engine as plan models the cluster, and why TE's spec is not built for this model and run (None: it
    is): `s.transformer_impl` where given, else TE's spec where the engine builds it (train/te.py resolve_impl), else
    local. The engines' rules: megatron-core's TE spec refuses multi-latent attention with rms_norm_eps other than 1e-6
    (te_spec_not_covered; with FP8, which needs TE's spec, that is megatron_core_gap's refusal, not local), the native
    engine's TE backend has dense Llama-family layers only and no FP8 with full recompute (te_form_not_covered). Not
    modeled: the runs plan's flags cannot express, which the native engine also keeps off TE's spec (attention dropout:
    plan's launch writes 0; packed documents under CP: plan models none), and a cluster without TE."""
    from train.engines.coverage import te_form_not_covered, te_spec_not_covered

    if s.engine == "megatron-core":
        why = None if s.fp8 else te_spec_not_covered(cfg.multi_latent_attention, cfg.norm_epsilon)
    else:
        why = te_form_not_covered(cfg, s, s.recompute)
    return s.transformer_impl or ("local" if why else "transformer_engine"), why


def evaluate(cfg: ModelConfig, layout: RunLayout, s: TrainSettings, hw: Hardware, gpus: int,
             gpu_memory: int, headroom: int = 0, engine_fallback: bool = False) -> Candidate:
    """One layout's memory and step time, its broken constraints, and whether it fits: its heaviest stage plus the
    `headroom` reserve within `gpu_memory`. With the engine's own kernels (`s.kernels` None), a layout the
    megatron-core engine would not run is the native engine's with `engine_fallback` (continue-pretrain's default:
    megatron-core where it covers the run), else invalid. The candidate's settings name the layer spec it models
    (`layer_spec`): TE's asked for where the native engine has no TE form of the run is invalid too."""
    # the engine as shardkit builds it (kernels None); given kernels model Megatron-LM's (fused: with TE), which runs
    # what shardkit's megatron-core engine does not yet
    gap = megatron_core_gap(cfg, layout, s) if s.engine == "megatron-core" and s.kernels is None else None
    if gap and engine_fallback:
        s = replace(s, engine="native")
    impl, te_why = layer_spec(cfg, s)
    refused = bool(te_why) and impl == "transformer_engine" and s.engine == "native" and s.kernels is None
    s = replace(s, transformer_impl=impl)
    mem = estimate_memory(cfg, layout, s)
    perf = step_time(cfg, layout, s, hw)
    bad = violations(cfg, layout, s, gpus, hw.gpus_per_node)
    if gap and not engine_fallback:
        bad.append(f"--engine megatron-core: {gap}")
    if refused:
        bad.append(f"--transformer-impl transformer_engine: {te_why}")
    c = Candidate(layout, s, mem, perf, bad, num_layers=cfg.num_layers, free=gpu_memory - mem.total,
                  headroom=headroom, unusual=unusual(cfg, layout, s))
    c.engine_note = f"the native engine (megatron-core's does not run it: {gap})" if gap and engine_fallback else ""
    c.fits = not bad and mem.total + headroom <= gpu_memory
    if bad:
        c.reason = "; ".join(bad)
    elif not c.fits:
        over = "" if mem.total > gpu_memory else f" + {headroom / 2**30:.1f} GiB headroom"
        c.reason = (f"needs {mem.total / 2**30:.1f} GiB{over} > {gpu_memory / 2**30:.1f} GiB (heaviest: stage "
                    f"{mem.pp_rank})")
        if not s.distributed_optimizer:
            sharded = mem.total - mem.optimizer + mem.optimizer_sharded
            if sharded + headroom <= gpu_memory:
                c.reason += f"; fits with --optimizer-sharding ({sharded / 2**30:.1f} GiB)"
    return c


def uneven_split(num_layers: int, pp: int, vpp: int = 1, mtp_layers: int = 0) -> PipelineSplit | None:
    """The split the field uses when the layers do not divide the model chunks (Llama-3.1-405B at PP 8: 15 | 16 x 6 |
    15; DeepSeek-V3 at PP 16: 3 | 4 x 14 | 2 + MTP + loss): even middle chunks, lighter first and last chunks
    (`balanced_counts`). Given by Megatron's --decoder-first/last-pipeline-num-layers where those can say it, else
    (with --vpp) as a --pipeline-model-parallel-layout string. None when the layers divide evenly (or pp is 1) or no
    such split exists; the older lighter-first/last flag search remains the fallback."""
    if pp < 2 or num_layers % (pp * vpp) == 0:
        return None
    counts = balanced_counts(num_layers, pp * vpp, mtp_layers)
    if counts is not None:
        split = _as_flags(counts, num_layers, pp, vpp)
        if split is None:
            split = PipelineSplit(layout=layout_string(counts, mtp_layers))
        if Layout(pp=pp, vpp=vpp, split=split).chunk_layers(num_layers, mtp_layers) == tuple(counts):
            return split
    share = num_layers // pp
    forms = ([dict(first=f, last=f) for f in range(share, 0, -1)] + [dict(first=f) for f in range(share, 0, -1)]
             + [dict(last=f) for f in range(share, 0, -1)])
    for form in forms:
        split = PipelineSplit(**form)
        try:
            Layout(pp=pp, vpp=vpp, split=split).chunk_layers(num_layers)
        except LayoutError:
            continue
        return split
    return None


def balanced_counts(num_layers: int, chunks: int, mtp_layers: int = 0) -> list[int] | None:
    """Decoder layers per model chunk, the field's way: every middle chunk the same m layers, the first and last
    chunks at most m (they also hold the embedding, and the loss and MTP layers, each counted as one layer as
    --account-for-embedding/loss-in-pipeline-split count them), m and the first/last counts chosen so that the
    heaviest chunk carries the fewest of these units (ties: the lighter last chunk). None when no such split exists
    (e.g. 40 layers over 16 chunks: the first and last would need more than the middle)."""
    if chunks < 2:
        return None
    middle = chunks - 2
    best = None
    for m in range(num_layers // middle if middle else 0, -1, -1):
        rest = num_layers - middle * m
        for first in range(min(m, rest) if middle else rest, -1, -1):
            last = rest - first
            if last < 0 or (middle and last > m):
                continue
            key = (max(m, first + 1, last + 1 + mtp_layers), last)
            if best is None or key < best[0]:
                best = (key, [first] + [m] * middle + [last])
    return None if best is None else best[1]


def _as_flags(counts: list[int], num_layers: int, pp: int, vpp: int) -> PipelineSplit | None:
    """The same counts by --decoder-first/last-pipeline-num-layers, when those flags can say it (each stage's chunks
    equal, the middle stages equal)."""
    stages = [[counts[v * pp + r] for v in range(vpp)] for r in range(pp)]
    if any(len(set(st)) != 1 for st in stages) or len({st[0] for st in stages[1:-1]}) > 1:
        return None
    first, last = sum(stages[0]), sum(stages[-1])
    mid = sum(stages[1]) if pp > 2 else None
    try:
        split = PipelineSplit(first=None if first == mid else first, last=None if last == mid else last)
        ok = split != PipelineSplit() and Layout(pp=pp, vpp=vpp, split=split).chunk_layers(num_layers) == tuple(counts)
    except LayoutError:  # a stage without decoder layers: only a layout string says that
        return None
    return split if ok else None


def layout_string(counts: list[int], mtp_layers: int = 0) -> str:
    """A --pipeline-model-parallel-layout string for decoder layers per model chunk: E in the first chunk, MTP and L
    in the last, runs of equal middle chunks written once (DeepSeek-V3 at PP 8 VPP 2: "Et*3|(t*4|)*14t*2mL")."""
    def enc(n: int) -> str:
        return "t" * n if n < 2 else f"t*{n}"

    last = enc(counts[-1]) + "m" * mtp_layers + "L"
    out, mid, i = ["E" + enc(counts[0]) + "|"], counts[1:-1], 0
    while i < len(mid):
        j = i
        while j < len(mid) and mid[j] == mid[i]:
            j += 1
        out.append(f"({enc(mid[i])}|)*{j - i}" if j - i > 1 else enc(mid[i]) + "|")
        i = j
    return "".join(out) + last


def enumerate_layouts(cfg: ModelConfig, gpus: int, gpus_per_node: int, seq_length: int,
                      max_vpp: int = 8, max_cp: int | None = None) -> list[RunLayout]:
    """TP dividing the node, then PP, CP, DP over the rest; VPP for pp > 1; EP (and ETP in {1, tp}) for MoE.
    Combinations that break a model constraint are kept (and named later); those that cannot be built at all are
    not generated."""
    out = []
    for tp in divisors(min(gpus, gpus_per_node)):
        if gpus % tp:
            continue
        for pp in divisors(gpus // tp):
            if pp > cfg.num_layers:
                continue
            for cp in divisors(gpus // (tp * pp)):
                if cp > 1 and (cp * 2 > seq_length or (max_cp is not None and cp > max_cp)):
                    continue
                dp = gpus // (tp * pp * cp)
                vpps = [1] if pp == 1 else [v for v in divisors(max(1, cfg.num_layers // pp)) if v <= max_vpp]
                eps = [1] if not cfg.is_moe else [e for e in divisors(tp * cp * dp) if e <= cfg.num_moe_experts]
                for vpp in vpps:
                    for ep in eps:
                        for etp in ([None, 1] if cfg.is_moe and tp > 1 else [None]):
                            if cfg.is_moe and (tp * cp * dp) % ((tp if etp is None else etp) * ep):
                                continue
                            out.append(RunLayout(tp=tp, pp=pp, vpp=vpp, cp=cp, ep=ep, etp=etp, dp=dp,
                                                 split=uneven_split(cfg.num_layers, pp, vpp,
                                                                    cfg.mtp_num_layers)))
    return out


PREFER_WITHIN = 0.05  # a usual layout this close to the fastest estimate ranks first


def plan(cfg: ModelConfig, gpus: int, gpu_memory: int, s: TrainSettings, hw: Hardware,
         recompute: list[str] | None = None, layouts: list[RunLayout] | None = None,
         max_cp: int | None = None, headroom: int = 0, micro_batch_sizes: list[int] | None = None,
         prefer_within: float = PREFER_WITHIN, engine_fallback: bool = False) -> list[Candidate]:
    """All candidates, ranked (`rank`). `recompute` lists the recompute modes to try (default: the one in `s`),
    `micro_batch_sizes` the micro-batch sizes (default: the one in `s`; when several are tried, those that do not
    divide a layout's batch are left out for it); a layout fits with `headroom` bytes to spare."""
    check_gpus(gpus, hw.gpus_per_node)
    modes = recompute or [s.recompute]
    for r in modes:
        if r not in RECOMPUTE:
            raise PlanError(f"--recompute must be one of {', '.join(RECOMPUTE)} or auto, got {r!r}")
    sizes = micro_batch_sizes or [s.micro_batch_size]
    if layouts is None:
        layouts = enumerate_layouts(cfg, gpus, hw.gpus_per_node, s.seq_length, max_cp=max_cp)
    cands = [evaluate(cfg, lay, replace(s, recompute=r, micro_batch_size=mbs), hw, gpus, gpu_memory, headroom,
                      engine_fallback)
             for lay in layouts for mbs in sizes for r in modes
             if len(sizes) == 1 or s.global_batch_size % (mbs * lay.dp) == 0]
    return rank(cands, prefer_within)


_WINS = {"compute_s": "compute (GEMM efficiency {:.0%} vs {:.0%})", "bubble_s": "pipeline bubble",
         "tp_comm_s": "TP communication", "cp_comm_s": "CP communication", "ep_comm_s": "EP all-to-all",
         "pp_comm_s": "PP sends", "dp_comm_s": "DP gradient traffic", "overhead_s": "per-micro-batch overhead"}


def why_first(c: Candidate, usual: Candidate | None) -> str:
    """Why an unusual layout ranks ahead of the usual ones: how much faster the estimate makes it than the fastest
    usual layout, the components it wins by, and what is unusual about it."""
    what = "; ".join(c.unusual)
    if usual is None:
        return f"{c.layout.label()} is unusual ({what}), and no usual layout fits"
    gain = usual.perf["step_s"] / c.perf["step_s"] - 1
    deltas = sorted(((usual.perf[k] - c.perf[k], k) for k in _WINS), reverse=True)
    parts = []
    for d, k in deltas[:2]:
        if d <= 0:
            break
        name = _WINS[k].format(c.perf["gemm_efficiency"], usual.perf["gemm_efficiency"])
        parts.append(f"{name} {usual.perf[k]:.2f} -> {c.perf[k]:.2f} s")
    return (f"{c.layout.label()} [{c.settings.recompute}] ranks ahead of the usual layouts although it is unusual "
            f"({what}): the estimate makes it {gain:.1%} faster than the fastest usual layout, {usual.layout.label()} "
            f"[{usual.settings.recompute}] ({', '.join(parts) or 'in total'} per step); the model does not charge "
            "everything that makes the field avoid it")


def rank(cands: list[Candidate], prefer_within: float = 0.0) -> list[Candidate]:
    """Fitting layouts first, by step time, except that a usual layout (`unusual` finds nothing) within
    `prefer_within` of the fastest estimate goes before the unusual ones (the estimate is not that exact, and the
    field's layouts are the tested ones); then valid ones that do not fit, by memory; then invalid ones. An unusual
    layout still first gets `why`."""
    def key(c: Candidate):
        group = 0 if c.fits else (1 if c.valid else 2)
        return (group, c.perf["step_s"] if group == 0 else c.memory.total, c.layout.label())
    ordered = sorted(cands, key=key)
    fitting = [c for c in ordered if c.fits]
    if not fitting:
        return ordered
    best = fitting[0].perf["step_s"]
    near = [c for c in fitting if not c.unusual and c.perf["step_s"] <= best * (1 + prefer_within)]
    ids = {id(c) for c in near}
    head = near + [c for c in fitting if id(c) not in ids]
    first_usual = next((c for c in head if not c.unusual), None)
    for c in head:
        if not c.unusual:
            break
        c.why = why_first(c, first_usual)
    return head + ordered[len(fitting):]
