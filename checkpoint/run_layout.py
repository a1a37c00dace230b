"""The layout of a whole training run: the checkpoint's model-parallel Layout plus context and data parallel, and where
each rank sits in it. One type for the trainer's process groups, the planner and the benchmarks.

Ranks are numbered in Megatron's default order (checkpoint.megatron): dense groups tp-cp-dp-pp, TP fastest, so a TP
group is a block of consecutive ranks (one node with TP <= 8) and pipeline stages are furthest apart; the expert groups
etp-ep-edp-pp re-lay the same TP x CP x DP ranks of each stage as ETP x EP x expert-DP. With ETP = TP (Megatron's
default), j = cp + CP * dp gives a rank's EP index j % EP and its expert-DP index j // EP.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass

from .errors import LayoutError
from .layout import Layout, PipelineSplit
from .megatron import DENSE_ORDER, EXPERT_ORDER, coords_of, rank_of


@dataclass(frozen=True)
class RunLayout:
    """TP x CP x DP x PP ranks, VPP model chunks per pipeline rank, the expert grid ETP x EP over each stage."""

    tp: int = 1
    pp: int = 1
    vpp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int | None = None  # expert tensor parallel; None = tp
    dp: int = 1
    split: PipelineSplit | None = None  # uneven pipeline stages (None: even)

    def __post_init__(self) -> None:
        for k in ("tp", "pp", "vpp", "cp", "ep", "dp"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise LayoutError(f"layout: {k} must be a positive integer, got {v!r}")

    @classmethod
    def from_world(cls, world: int, tp: int, pp: int, cp: int = 1, vpp: int = 1, ep: int = 1,
                   etp: int | None = None, split: PipelineSplit | None = None) -> "RunLayout":
        """The layout of `world` ranks: DP is what is left, and the expert grid must fit the ranks of a stage."""
        mp = tp * pp * cp
        if world % mp:
            raise LayoutError(f"world size {world} is not divisible by --tp {tp} x --pp {pp} x --cp {cp} = {mp}")
        lay = cls(tp=tp, pp=pp, vpp=vpp, cp=cp, ep=ep, etp=etp, dp=world // mp, split=split)
        stage = tp * cp * lay.dp
        if stage % (lay.expert_tp * ep) == 0:
            return lay
        if lay.expert_tp == tp and tp > 1 and stage % ep == 0:  # issue 37: the fix is ETP 1, not more ranks
            raise LayoutError(f"--expert-model-parallel-size {ep} with --tp {tp}: the experts are split by TP too "
                              f"(--expert-tensor-parallel-size defaults to --tp), leaving EP the data-parallel x "
                              f"context-parallel size {lay.dp} x {cp} = {lay.dp * cp}; add --expert-tensor-parallel-size "
                              f"1 to lay EP over all tp x cp x dp = {stage} ranks of a stage (DeepSeek-V3's and "
                              "Mixtral's recipes), or use more ranks")
        if lay.expert_tp == tp:
            raise LayoutError(f"--expert-model-parallel-size {ep} must divide data-parallel x context-parallel size "
                              f"{lay.dp} x {cp} = {lay.dp * cp} (EP groups are formed inside DP x CP); use more ranks "
                              "or a smaller --ep")
        raise LayoutError(f"--expert-model-parallel-size {ep} x --expert-tensor-parallel-size {etp} must divide the "
                          f"tp x cp x dp = {stage} ranks of a pipeline stage; use more ranks or a smaller --ep")

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def edp(self) -> int:
        """Expert-data-parallel size: the replicas of one expert shard (at least 1, so that a layout whose expert grid
        does not fit a stage, which the planner names, still gets an estimate)."""
        return max(1, self.tp * self.cp * self.dp // (self.expert_tp * self.ep))

    @property
    def model_parallel(self) -> Layout:
        """The model-parallel layout: what the checkpoint's sharding table and manifest see."""
        return Layout(tp=self.tp, pp=self.pp, vpp=self.vpp, ep=self.ep, etp=self.etp, split=self.split)

    @property
    def sizes(self) -> dict[str, int]:
        """The dimensions of Megatron's dense rank order (tp-cp-dp-pp)."""
        return {"tp": self.tp, "cp": self.cp, "dp": self.dp, "pp": self.pp}

    @property
    def expert_sizes(self) -> dict[str, int]:
        """The dimensions of Megatron's expert rank order (etp-ep-edp-pp) over the same ranks."""
        return {"etp": self.expert_tp, "ep": self.ep, "edp": self.edp, "pp": self.pp}

    def coords(self, rank: int) -> dict[str, int]:
        return coords_of(rank, self.sizes, DENSE_ORDER)

    def rank(self, tp: int = 0, cp: int = 0, dp: int = 0, pp: int = 0) -> int:
        return rank_of(self.sizes, DENSE_ORDER, tp=tp, cp=cp, dp=dp, pp=pp)

    def expert_coords(self, rank: int) -> tuple[int, int]:
        """(ep index, expert-data-parallel index) of a rank."""
        c = coords_of(rank, self.expert_sizes, EXPERT_ORDER)
        return c["ep"], c["edp"]

    def label(self) -> str:
        parts = [f"tp{self.tp}", f"pp{self.pp}"]
        if self.vpp > 1:
            parts.append(f"vpp{self.vpp}")
        if self.cp > 1:
            parts.append(f"cp{self.cp}")
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        if self.etp is not None and self.etp != self.tp:
            parts.append(f"etp{self.etp}")
        parts.append(f"dp{self.dp}")
        if self.split is not None:  # Megatron's flag names, shortened: first15 last15 / layout=...
            d = self.split.as_dict()
            parts += [f"{k}{d[k]}" for k in ("first", "last") if k in d]
            parts += [f"{k}-in-split" for k in ("embedding", "loss") if d.get(k)]
            if "layout" in d:
                parts.append(f"layout={d['layout']}")
        return " ".join(parts)

    def to_dict(self) -> dict:
        d = {**asdict(self), "etp": self.expert_tp, "world": self.world}
        d.pop("split")
        if self.split is not None:
            d["pipeline_split"] = self.split.as_dict()
        return d

    @classmethod
    def parse(cls, text: str, flag: str = "--layout") -> "RunLayout":
        """'tp=4,pp=4,dp=4' (any of tp pp vpp cp ep etp dp; missing ones are 1)."""
        out: dict[str, int] = {}
        for item in filter(None, re.split(r"[,\s]+", text.strip())):
            m = re.fullmatch(r"(tp|pp|vpp|cp|ep|etp|dp)=([0-9]+)", item)
            if not m:
                raise LayoutError(f"{flag}: cannot parse {item!r} in {text!r}; write e.g. tp=4,pp=4,dp=4 "
                                  "(keys: tp pp vpp cp ep etp dp)")
            if m.group(1) in out:
                raise LayoutError(f"{flag}: {m.group(1)} given twice in {text!r}")
            out[m.group(1)] = int(m.group(2))
        if not out:
            raise LayoutError(f"{flag}: empty layout; write e.g. tp=4,pp=4,dp=4")
        return cls(**out)
