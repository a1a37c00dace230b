"""A run's process groups, built explicitly from its RunLayout (no module-level globals).

The ranks are numbered as checkpoint.run_layout describes (Megatron's order: dense tp-cp-dp-pp, experts etp-ep-edp-pp
over the same ranks). Everything that needs a group takes a `Groups` object.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch.distributed as dist

from checkpoint.errors import LayoutError
from checkpoint.layout import RankCoord
from checkpoint.megatron import EXPERT_ORDER, rank_of
from checkpoint.run_layout import RunLayout


@dataclass
class Groups:
    """This rank's coordinates and the groups it belongs to (None where the dimension has size 1)."""

    dims: RunLayout
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


def build_groups(dims: RunLayout) -> Groups:
    """Create every group on every rank (torch.distributed requires all ranks to take part in each new_group)."""
    rank = dist.get_rank()
    if dist.get_world_size() != dims.world:
        raise LayoutError(f"world size {dist.get_world_size()} != tp*cp*dp*pp = {dims.world}")
    c = dims.coords(rank)
    g = Groups(dims, rank, c["tp"], c["cp"], c["dp"], c["pp"])

    def each(vary: str, fixed: list[str]):
        sizes = dims.sizes
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


def _expert_groups(dims: RunLayout):
    """Per (etp, pp) position: its EP groups and its expert-data-parallel groups (global ranks, by index), in Megatron's
    expert rank order."""
    es = dims.expert_sizes
    for pp in range(dims.pp):
        for etp in range(dims.expert_tp):
            def rank(e: int, k: int) -> int:
                return rank_of(es, EXPERT_ORDER, etp=etp, ep=e, edp=k, pp=pp)
            yield ([[rank(e, k) for e in range(dims.ep)] for k in range(dims.edp)],
                   [[rank(e, k) for k in range(dims.edp)] for e in range(dims.ep)])
