"""The parallel dimensions of a run and their process groups, built explicitly (no module-level globals).

Ranks are laid out as Megatron does by default (checkpoint.megatron.DENSE_ORDER, tp-cp-dp-pp, tp fastest):
    rank = tp + TP * (cp + CP * (dp + DP * pp))
so a tensor-parallel group is a block of consecutive ranks (one node with TP <= 8) and pipeline stages are furthest
apart. Everything that needs a group takes a `Groups` object.

Expert parallelism re-lays the DP x CP ranks of a (tp, pp) position, as Megatron's expert rank generator does
(checkpoint.megatron.EXPERT_ORDER etp-ep-edp-pp, expert TP = TP): with j = cp + CP * dp, the rank's EP index is j % EP
and its expert-data-parallel index j // EP, so an EP group is EP consecutive DP x CP ranks and the expert-data-parallel
group (size DP * CP / EP) holds the replicas of one expert shard.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch.distributed as dist

from checkpoint.errors import LayoutError
from checkpoint.layout import Layout, RankCoord
from checkpoint.megatron import DENSE_ORDER, EXPERT_ORDER, coords_of, rank_of


@dataclass(frozen=True)
class ParallelDims:
    """TP x CP x DP x PP; DP is what is left of the world size."""

    tp: int
    pp: int
    dp: int
    cp: int = 1
    vpp: int = 1
    ep: int = 1  # expert parallel, laid over DP x CP (see the module docstring)

    @classmethod
    def from_world(cls, world: int, tp: int, pp: int, cp: int = 1, vpp: int = 1, ep: int = 1) -> "ParallelDims":
        mp = tp * pp * cp
        if world % mp:
            raise LayoutError(f"world size {world} is not divisible by --tp {tp} x --pp {pp} x --cp {cp} = {mp}")
        dp = world // mp
        if ep < 1 or (dp * cp) % ep:
            raise LayoutError(f"--expert-model-parallel-size {ep} must divide data-parallel x context-parallel size "
                              f"{dp} x {cp} = {dp * cp} (EP groups are formed inside DP x CP); use more ranks or a "
                              "smaller --ep")
        return cls(tp=tp, pp=pp, dp=dp, cp=cp, vpp=vpp, ep=ep)

    @property
    def edp(self) -> int:
        """Expert-data-parallel size: the replicas of one expert shard."""
        return self.dp * self.cp // self.ep

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def sizes(self) -> dict[str, int]:
        """The dimensions of Megatron's dense rank order (tp-cp-dp-pp)."""
        return {"tp": self.tp, "cp": self.cp, "dp": self.dp, "pp": self.pp}

    @property
    def expert_sizes(self) -> dict[str, int]:
        """The dimensions of Megatron's expert rank order (etp-ep-edp-pp, expert TP = TP) over the same ranks."""
        return {"etp": self.tp, "ep": self.ep, "edp": self.edp, "pp": self.pp}

    def coords(self, rank: int) -> dict[str, int]:
        return coords_of(rank, self.sizes, DENSE_ORDER)

    def rank(self, tp: int = 0, cp: int = 0, dp: int = 0, pp: int = 0) -> int:
        return rank_of(self.sizes, DENSE_ORDER, tp=tp, cp=cp, dp=dp, pp=pp)

    def layout(self) -> Layout:
        """The model-parallel layout (what the checkpoint's sharding table sees)."""
        return Layout(tp=self.tp, pp=self.pp, vpp=self.vpp, ep=self.ep)

    def expert_coords(self, rank: int) -> tuple[int, int]:
        """(ep index, expert-data-parallel index) of a rank."""
        c = coords_of(rank, self.expert_sizes, EXPERT_ORDER)
        return c["ep"], c["edp"]


@dataclass
class Groups:
    """This rank's coordinates and the groups it belongs to (None where the dimension has size 1)."""

    dims: ParallelDims
    rank: int
    tp_rank: int
    cp_rank: int
    dp_rank: int
    pp_rank: int
    tp: dist.ProcessGroup | None = None
    dp: dist.ProcessGroup | None = None
    cp: dist.ProcessGroup | None = None  # context parallel: the ranks that split one sequence
    dp_cp: dist.ProcessGroup | None = None  # DP x CP: gradients are reduced over it
    pp: dist.ProcessGroup | None = None
    embedding: dist.ProcessGroup | None = None  # first and last pipeline stage (tied embeddings)
    pp_ranks: list[int] = field(default_factory=list)  # global ranks of this rank's pipeline, by stage
    ep_rank: int = 0
    edp_rank: int = 0
    ep: dist.ProcessGroup | None = None  # expert parallel: the ranks that exchange tokens
    edp: dist.ProcessGroup | None = None  # expert data parallel: the replicas of this rank's expert shard
    edp_ranks: list[int] = field(default_factory=list)  # global ranks of the edp group, by edp index

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.dims.pp - 1

    @property
    def coord(self) -> RankCoord:
        """Shard coordinates in the sharding table (expert TP = TP, as Megatron's default)."""
        return RankCoord(tp=self.tp_rank, pp=self.pp_rank, ep=self.ep_rank, etp=self.tp_rank)

    @property
    def next_rank(self) -> int:
        return self.pp_ranks[self.pp_rank + 1]

    @property
    def prev_rank(self) -> int:
        return self.pp_ranks[self.pp_rank - 1]


def build_groups(dims: ParallelDims) -> Groups:
    """Create every group on every rank (torch.distributed requires all ranks to take part in each new_group)."""
    rank = dist.get_rank()
    if dist.get_world_size() != dims.world:
        raise LayoutError(f"world size {dist.get_world_size()} != tp*cp*dp*pp = {dims.world}")
    c = dims.coords(rank)
    g = Groups(dims, rank, c["tp"], c["cp"], c["dp"], c["pp"])

    def each(vary: str, fixed: list[str]):
        sizes = {"tp": dims.tp, "cp": dims.cp, "dp": dims.dp, "pp": dims.pp}
        for combo in itertools.product(*(range(sizes[f]) for f in fixed)):
            at = dict(zip(fixed, combo))
            yield [dims.rank(**{**at, vary: i}) for i in range(sizes[vary])]

    for vary, attr in (("tp", "tp"), ("dp", "dp"), ("pp", "pp")):
        fixed = [d for d in ("tp", "cp", "dp", "pp") if d != vary]
        for ranks in each(vary, fixed):
            grp = dist.new_group(ranks) if len(ranks) > 1 else None
            if rank in ranks:
                setattr(g, attr, grp)
                if vary == "pp":
                    g.pp_ranks = ranks
    for ranks in each("cp", ["tp", "dp", "pp"]):
        grp = dist.new_group(ranks) if len(ranks) > 1 else None
        if rank in ranks:
            g.cp = grp
    for tp, pp in itertools.product(range(dims.tp), range(dims.pp)):
        ranks = [dims.rank(tp=tp, cp=c, dp=d, pp=pp) for d in range(dims.dp) for c in range(dims.cp)]
        grp = dist.new_group(ranks) if len(ranks) > 1 else None
        if rank in ranks:
            g.dp_cp = grp
    for ranks in each("pp", ["tp", "cp", "dp"]):
        emb = sorted({ranks[0], ranks[-1]})
        grp = dist.new_group(emb) if len(emb) > 1 else None
        if rank in emb:
            g.embedding = grp
    g.ep_rank, g.edp_rank = dims.expert_coords(rank)
    for ep_groups, edp_groups in _expert_groups(dims):
        for ranks in ep_groups:
            grp = dist.new_group(ranks) if len(ranks) > 1 else None
            if rank in ranks:
                g.ep = grp
        for ranks in edp_groups:
            grp = dist.new_group(ranks) if len(ranks) > 1 else None
            if rank in ranks:
                g.edp, g.edp_ranks = grp, ranks
    return g


def _expert_groups(dims: ParallelDims):
    """Per (tp, pp) position: its EP groups and its expert-data-parallel groups (global ranks, by index), in Megatron's
    expert rank order."""
    es = dims.expert_sizes
    for pp in range(dims.pp):
        for tp in range(dims.tp):
            def rank(e: int, k: int) -> int:
                return rank_of(es, EXPERT_ORDER, etp=tp, ep=e, edp=k, pp=pp)
            yield ([[rank(e, k) for e in range(dims.ep)] for k in range(dims.edp)],
                   [[rank(e, k) for k in range(dims.edp)] for e in range(dims.ep)])
