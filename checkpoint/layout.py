"""The model-parallel layout a checkpoint is sharded for (TP x PP x VPP, EP x ETP) and the checks that it fits a model.
Pure functions, no process groups. A whole training run's layout (adding CP and DP) is checkpoint.run_layout.RunLayout,
whose `model_parallel` is this one."""
from __future__ import annotations

import functools
import re
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Iterator

from .errors import LayoutError

if TYPE_CHECKING:  # a layout is checked against a model config; the config reader (through the families) sits above
    from .config import ModelConfig

MAX_PARALLEL = 1 << 16  # no parallel dimension is larger (a manifest or a flag saying so is refused)


@dataclass(frozen=True)
class RankCoord:
    """A rank's coordinates in the dimensions that split tensors. Dense tensors use (tp, pp); expert tensors use
    (ep, etp, pp): Megatron lays the expert groups over the same ranks, so one physical rank has both."""

    tp: int = 0
    pp: int = 0
    ep: int = 0
    etp: int = 0


@dataclass(frozen=True)
class PipelineSplit:
    """How decoder layers are spread over pipeline stages when not evenly: Megatron's flags, resolved by megatron-core's
    rules (`get_num_layers_to_build`, `get_transformer_layer_offset`, `PipelineParallelLayerLayout`; tests check them
    against megatron-core itself). One form is set:

      first / last   --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers: those stages hold that
                     many layers, the middle stages share the rest evenly; with --vpp each stage's layers are split
                     evenly over its model chunks
      embedding /    --account-for-embedding-in-pipeline-split / --account-for-loss-in-pipeline-split: the embedding
      loss           (loss) counts as one layer when splitting evenly, so the first (last) model chunk holds one
                     decoder layer less
      layout         --pipeline-model-parallel-layout, e.g. "Et*3|(tt|)*29,m|L": one |-separated stage per model
                     chunk in chunk order (chunk c = vstage * pp + pp_rank), E embedding, t decoder layer, m MTP layer,
                     L loss, (...)*n and x*n repeat, commas are cosmetic
    """

    first: int | None = None
    last: int | None = None
    embedding: bool = False
    loss: bool = False
    layout: str | None = None

    def __post_init__(self) -> None:
        for flag, v in (("--decoder-first-pipeline-num-layers", self.first),
                        ("--decoder-last-pipeline-num-layers", self.last)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
                raise LayoutError(f"{flag} must be a positive integer, got {v!r}")
        uneven = self.first is not None or self.last is not None
        if self.layout is not None and (uneven or self.embedding or self.loss):
            raise LayoutError("--pipeline-model-parallel-layout cannot be combined with the other pipeline split flags "
                              "(--decoder-first/last-pipeline-num-layers, --account-for-embedding/loss-in-pipeline-"
                              "split)")
        if uneven and (self.embedding or self.loss):
            raise LayoutError("--decoder-first/last-pipeline-num-layers cannot be combined with "
                              "--account-for-embedding-in-pipeline-split or --account-for-loss-in-pipeline-split "
                              "(megatron-core refuses the same)")
        if self.layout is not None:
            parse_pipeline_layout(self.layout)  # a bad character is named before anything is read

    def flags(self) -> list[str]:
        """The command-line flags that give this split (Megatron-LM's names)."""
        out = []
        if self.first is not None:
            out += ["--decoder-first-pipeline-num-layers", str(self.first)]
        if self.last is not None:
            out += ["--decoder-last-pipeline-num-layers", str(self.last)]
        if self.embedding:
            out.append("--account-for-embedding-in-pipeline-split")
        if self.loss:
            out.append("--account-for-loss-in-pipeline-split")
        if self.layout is not None:
            out += ["--pipeline-model-parallel-layout", self.layout]
        return out

    def as_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v not in (None, False)}

    @classmethod
    def from_dict(cls, d: dict | None) -> "PipelineSplit | None":
        if not d:
            return None
        unknown = set(d) - {"first", "last", "embedding", "loss", "layout"}
        if unknown:
            raise LayoutError(f"pipeline_split: unknown field(s) {sorted(unknown)}")
        return cls(first=d.get("first"), last=d.get("last"), embedding=bool(d.get("embedding", False)),
                   loss=bool(d.get("loss", False)), layout=d.get("layout"))

    @classmethod
    def from_args(cls, args) -> "PipelineSplit | None":
        """From parsed flags or Megatron-LM args (decoder_first_pipeline_num_layers, ...,
        pipeline_model_parallel_layout); None when none is given (the even split)."""
        layout = getattr(args, "pipeline_model_parallel_layout", None)
        split = cls(first=getattr(args, "decoder_first_pipeline_num_layers", None),
                    last=getattr(args, "decoder_last_pipeline_num_layers", None),
                    embedding=bool(getattr(args, "account_for_embedding_in_pipeline_split", False)),
                    loss=bool(getattr(args, "account_for_loss_in_pipeline_split", False)),
                    layout=None if layout is None else str(layout))  # megatron-core's object: repr is its string
        return None if split == cls() else split


_LAYOUT_CHARS = "ELtm"
LAYOUT_MAX_CHARS = 1 << 20  # an unrolled layout string (layers and stage separators) longer than this is refused


def parse_pipeline_layout(text: str) -> list[str]:
    """--pipeline-model-parallel-layout -> one string of layer characters per model chunk, by megatron-core's
    `PipelineParallelLayerLayout.parse_str_to_list` rules (commas dropped, "(...)*n" then "x*n" unrolled)."""
    s = text.replace(",", "")
    for pattern in (r"\(([^)]+)\)\*(\d+)", r"(.)\*(\d+)"):
        grown = [len(s)]

        def unroll(m: re.Match) -> str:  # bounded before anything is built (issue 34: `(t)*999999999999`)
            digits = m.group(2)
            n = int(digits) if len(digits) <= 9 else LAYOUT_MAX_CHARS + 1
            grown[0] += len(m.group(1)) * (n - 1) - len(digits) - 1
            if grown[0] > LAYOUT_MAX_CHARS:
                raise LayoutError(f"--pipeline-model-parallel-layout {text[:80]!r}: the repeat {m.group(0)[:40]!r} "
                                  f"unrolls to more than {LAYOUT_MAX_CHARS:,} layers and stages; no model has that "
                                  "many")
            return m.group(1) * n

        s = re.sub(pattern, unroll, s)
    stages = s.split("|")
    for stage in stages:
        bad = sorted(set(stage) - set(_LAYOUT_CHARS))
        if bad:
            raise LayoutError(f"--pipeline-model-parallel-layout {text!r}: invalid layer character {bad[0]!r} "
                              f"(known: E embedding, L loss, t decoder layer, m MTP layer)")
    return stages


def _other_stages(n: int, split: PipelineSplit) -> str:
    """The stages that share the layers the first/last flags leave, named as what they are (issue 34: at --pp 2
    with only --decoder-first-pipeline-num-layers, the one left is the last stage, not "1 middle stage(s)")."""
    if split.first is not None and split.last is not None:
        return "no middle stage" if n == 0 else f"the {n} middle stage{'s' if n > 1 else ''}"
    end = "last" if split.first is not None else "first"
    if n <= 1:
        return f"the {end} stage" if n == 1 else f"no {end} stage"
    return f"the {n - 1} middle and the {end} stage" if end == "last" else f"the {end} and the {n - 1} middle stages"


@functools.lru_cache(maxsize=256)  # every region of every tensor asks: resolve (and parse) a split once
def _split_counts(split: PipelineSplit, num_layers: int, pp: int, vpp: int, mtp_layers: int | None
                  ) -> tuple[int, ...]:
    """Decoder layers per model chunk (chunk c = vstage * pp + pp_rank), by megatron-core's rules and checks
    (`mtp_layers` None: a caller that only places decoder layers; a layout string's m are not checked then)."""
    if split.layout is not None:
        stages = parse_pipeline_layout(split.layout)
        flag = f"--pipeline-model-parallel-layout {split.layout!r}"
        if len(stages) % pp:
            raise LayoutError(f"{flag}: {len(stages)} stages are not divisible by --pp {pp}")
        if len(stages) // pp != vpp:
            raise LayoutError(f"{flag}: {len(stages)} stages at --pp {pp} mean --vpp {len(stages) // pp}, "
                              f"but --vpp is {vpp}")
        flat = "".join(stages)
        if not flat or flat[0] != "E" or flat.count("E") != 1:
            raise LayoutError(f"{flag}: the embedding (E) must come first, exactly once")
        if flat[-1] != "L" or flat.count("L") != 1:
            raise LayoutError(f"{flag}: the loss (L) must come last, exactly once")
        if flat.count("t") != num_layers:
            raise LayoutError(f"{flag}: {flat.count('t')} decoder layers (t), but num_hidden_layers={num_layers}")
        if mtp_layers is None:
            mtp_layers = flat.count("m")
        if flat.count("m") != mtp_layers:
            raise LayoutError(f"{flag}: {flat.count('m')} MTP layers (m), but the model has {mtp_layers}")
        if "m" in flat and "t" in flat[flat.index("m"):]:
            raise LayoutError(f"{flag}: decoder layers (t) must come before the MTP layers (m)")
        if mtp_layers and stages[-1].count("m") != mtp_layers:
            raise LayoutError(f"{flag}: shardkit runs the MTP layers with the loss: put all {mtp_layers} (m) in the "
                              "last stage")
        return tuple(st.count("t") for st in stages)
    if split.first is not None or split.last is not None:
        rest, middle = num_layers, pp
        for flag, n in (("--decoder-first-pipeline-num-layers", split.first),
                        ("--decoder-last-pipeline-num-layers", split.last)):
            if n is None:
                continue
            if n % vpp:
                raise LayoutError(f"{flag} {n} is not divisible by --vpp {vpp} (each model chunk of that stage "
                                  "holds the same number of layers)")
            rest -= n
            middle -= 1
        others = _other_stages(max(middle, 0), split)
        if rest < 0 or bool(rest) != bool(middle):
            raise LayoutError(f"--decoder-first/last-pipeline-num-layers ({split.first}, {split.last}) leave {rest} "
                              f"layers of num_hidden_layers={num_layers} for {others} at --pp {pp}")
        if middle and rest % middle:
            raise LayoutError(f"the {rest} layers left for {others} after "
                              f"--decoder-first/last-pipeline-num-layers are not divisible by {middle}")
        if middle and (rest // middle) % vpp:
            raise LayoutError(f"the {rest // middle} layers of each of {others} are not divisible by --vpp {vpp}")
        per_stage = [rest // middle if middle else 0] * pp
        if split.first is not None:
            per_stage[0] = split.first
        if split.last is not None:
            per_stage[-1] = split.last
        return tuple(per_stage[c % pp] // vpp for c in range(pp * vpp))
    total = num_layers + int(split.embedding) + int(split.loss)
    if total % pp:
        raise LayoutError(f"num_hidden_layers={num_layers} + {total - num_layers} (embedding/loss counted by "
                          f"--account-for-*-in-pipeline-split) = {total} is not divisible by --pp {pp}")
    if (total // pp) % vpp:
        raise LayoutError(f"{total // pp} layers per pipeline stage (embedding/loss counted) are not divisible by "
                          f"--vpp {vpp}")
    counts = [total // pp // vpp] * (pp * vpp)
    if split.embedding:
        counts[0] -= 1
    if split.loss:
        counts[-1] -= 1
    if min(counts) < 0:
        raise LayoutError("not enough layers in the first/last model chunk for the embedding/loss to count as one")
    return tuple(counts)


@dataclass(frozen=True)
class Layout:
    """Model-parallel layout. Data parallel replicas hold identical shards and do not appear here."""

    tp: int = 1
    pp: int = 1
    vpp: int = 1  # virtual pipeline stages (model chunks) per pipeline rank
    ep: int = 1  # expert parallel: splits the expert axis
    etp: int | None = None  # expert tensor parallel; None = same as tp (Megatron's default)
    split: PipelineSplit | None = None  # uneven pipeline stages; None: every model chunk holds as many layers

    def __post_init__(self) -> None:
        for flag, v in (("--tp", self.tp), ("--pp", self.pp), ("--vpp", self.vpp), ("--ep", self.ep),
                        ("--etp", self.etp if self.etp is not None else 1)):
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_PARALLEL:
                raise LayoutError(f"{flag} must be a positive integer up to {MAX_PARALLEL}, got {v!r}")

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def model_parallel_size(self) -> int:
        return self.tp * self.pp

    def ranks(self, expert: bool = False) -> Iterator[RankCoord]:
        """The distinct shard coordinates: (tp, pp) for dense tensors, (ep, etp, pp) for expert tensors."""
        for pp in range(self.pp):
            if expert:
                for ep in range(self.ep):
                    for etp in range(self.expert_tp):
                        yield RankCoord(pp=pp, ep=ep, etp=etp)
            else:
                for tp in range(self.tp):
                    yield RankCoord(tp=tp, pp=pp)

    def check(self, cfg: ModelConfig) -> None:
        """Raise LayoutError naming the flag and the model field when the layout cannot hold the model."""
        tp = self.tp
        if cfg.num_attention_heads % tp:
            raise LayoutError(f"--tp {tp} does not divide num_attention_heads={cfg.num_attention_heads}")
        if cfg.num_query_groups % tp:
            raise LayoutError(f"--tp {tp} does not divide the KV heads (num_key_value_heads={cfg.num_query_groups}); "
                              "Megatron gives each TP rank whole query groups")
        has_dense_mlp = not cfg.is_moe or 0 in cfg.moe_layer_freq
        if has_dense_mlp and cfg.ffn_hidden_size % tp:
            raise LayoutError(f"--tp {tp} does not divide intermediate_size={cfg.ffn_hidden_size}")
        if cfg.is_moe:
            if cfg.num_moe_experts % self.ep:
                raise LayoutError(f"--ep {self.ep} does not divide the number of experts ({cfg.num_moe_experts})")
            if cfg.moe_ffn_hidden_size % self.expert_tp:
                raise LayoutError(f"--etp {self.expert_tp} does not divide the expert ffn size "
                                  f"({cfg.moe_ffn_hidden_size})")
            shared = cfg.moe_shared_expert_intermediate_size
            if shared and shared % tp:
                raise LayoutError(f"--tp {tp} does not divide the shared-expert ffn size ({shared})")
        elif self.ep > 1 or self.etp not in (None, 1):
            raise LayoutError(f"--ep/--etp apply to MoE models only; {cfg.model_type} has no experts")
        self.chunk_layers(cfg.num_layers, cfg.mtp_num_layers or 0)  # raises for a split that does not fit

    def chunk_layers(self, num_layers: int, mtp_layers: int | None = None) -> tuple[int, ...]:
        """Decoder layers of each model chunk in chunk order (chunk c = vstage * pp + pp_rank), or a LayoutError
        naming the flags when they do not fit the model (`mtp_layers` given: a layout string's m are checked too)."""
        stages = self.pp * self.vpp
        if self.split is None:
            if stages > num_layers:
                raise LayoutError(f"--pp {self.pp} x --vpp {self.vpp} = {stages} pipeline stages exceed "
                                  f"num_hidden_layers={num_layers}")
            if num_layers % stages:
                raise LayoutError(f"num_hidden_layers={num_layers} is not divisible by --pp {self.pp} x --vpp "
                                  f"{self.vpp} = {stages}; give an uneven split (--decoder-first-pipeline-num-layers, "
                                  "--decoder-last-pipeline-num-layers or --pipeline-model-parallel-layout)")
            return (num_layers // stages,) * stages
        if self.pp == 1:
            raise LayoutError(f"{' '.join(self.split.flags())}: an uneven pipeline split needs --pp > 1")
        return _split_counts(self.split, num_layers, self.pp, self.vpp, mtp_layers)

    def layer_count(self, num_layers: int, pp_rank: int, vstage: int) -> int:
        """Decoder layers of model chunk `vstage` on pipeline rank `pp_rank`."""
        start, stop = self.layer_range(num_layers, pp_rank, vstage)
        return stop - start

    def layer_range(self, num_layers: int, pp_rank: int, vstage: int) -> tuple[int, int]:
        """Global layers [start, stop) of model chunk `vstage` on pipeline rank `pp_rank` (Megatron's interleaving:
        chunk c = vstage * pp + pp_rank holds the layers after those of chunks 0..c-1)."""
        counts = self.chunk_layers(num_layers)
        c = vstage * self.pp + pp_rank
        start = sum(counts[:c])
        return start, start + counts[c]

    def idle_ranks(self, num_layers: int) -> list[int]:
        """Pipeline ranks that hold nothing to train: no decoder layer in any of their model chunks, and neither the
        embedding (first rank) nor the loss (last rank). Megatron's layout strings allow them ("Ett||ttL")."""
        counts = self.chunk_layers(num_layers)
        return [r for r in range(1, self.pp - 1) if not any(counts[v * self.pp + r] for v in range(self.vpp))]

    def chunk_of_layer(self, layer: int, num_layers: int) -> tuple[int, int]:
        """(pp_rank, vstage) of the model chunk holding global decoder layer `layer`."""
        start = 0
        for c, n in enumerate(self.chunk_layers(num_layers)):
            if start <= layer < start + n:
                return c % self.pp, c // self.pp
            start += n
        raise ValueError(f"layer {layer} outside 0..{num_layers - 1}")

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in ("tp", "pp", "vpp", "ep", "etp")}
        if self.split is not None:  # only then: an even layout's manifest stays as it was
            d["pipeline_split"] = self.split.as_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Layout":
        etp = d.get("etp")
        return cls(tp=int(d["tp"]), pp=int(d["pp"]), vpp=int(d.get("vpp", 1)), ep=int(d.get("ep", 1)),
                   etp=None if etp is None else int(etp), split=PipelineSplit.from_dict(d.get("pipeline_split")))
