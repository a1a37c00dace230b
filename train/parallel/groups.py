"""A run's process groups, built explicitly from its RunLayout (no module-level globals).

The ranks are numbered as checkpoint.run_layout describes (Megatron's order: dense tp-cp-dp-pp, experts etp-ep-edp-pp
over the same ranks). Everything that needs a group takes a `Groups` object.
"""
from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from checkpoint.errors import LayoutError
from checkpoint.layout import RankCoord
from checkpoint.megatron import EXPERT_ORDER, coords_of, rank_of
from checkpoint.run_layout import RunLayout

from . import p2p


CREATED: list[tuple] = []  # every process group this process created through `new_group`, in order


def new_group(ranks: list[int] | None = None, **kw):
    """torch.distributed.new_group, recorded: NCCL (and torch.distributed) need every rank to create every group in
    the same order, which `check_group_order` proves across ranks."""
    CREATED.append((tuple(ranks) if ranks is not None else None, tuple(sorted(kw.items()))))
    return dist.new_group(ranks, **kw)


def check_group_order() -> None:
    """Collective over the world: every rank has created the same groups in the same order, else one line naming
    the first rank that differs from rank 0."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    digest = (len(CREATED), hashlib.sha256(repr(CREATED).encode()).hexdigest())
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, digest)
    for r, d in enumerate(every):
        if d != every[0]:
            raise LayoutError(f"process groups: rank {r} created {d[0]} groups in another order than rank 0 "
                              f"({every[0][0]}); every rank must create every group in the same order (NCCL hangs "
                              "otherwise)")


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
    tp_cp: dist.ProcessGroup | None = None  # TP x CP: the ranks holding parts of one sequence (sequence parallel)
    ep_rank: int = 0
    edp_rank: int = 0
    etp_rank: int = 0  # expert tensor parallel index (= tp_rank when ETP = TP, Megatron's default)
    ep: dist.ProcessGroup | None = None  # expert parallel: the ranks that exchange tokens
    etp: dist.ProcessGroup | None = None  # expert tensor parallel: the ranks splitting one expert shard's ffn
    etp_ep: dist.ProcessGroup | None = None  # expert TP x EP: the ranks that together hold every expert once
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
        """Shard coordinates in the sharding table (dense tensors: tp; expert tensors: ep and expert tp)."""
        return RankCoord(tp=self.tp_rank, pp=self.pp_rank, ep=self.ep_rank, etp=self.etp_rank)

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
            grp = new_group(ranks) if len(ranks) > 1 else None
            if rank in ranks:
                setattr(g, attr, grp)
                if vary == "pp":
                    g.pp_ranks = ranks
    for ranks in each("cp", ["tp", "dp", "pp"]):
        grp = new_group(ranks) if len(ranks) > 1 else None
        if rank in ranks:
            g.cp = grp
    for tp, pp in itertools.product(range(dims.tp), range(dims.pp)):
        ranks = [dims.rank(tp=tp, cp=c, dp=d, pp=pp) for d in range(dims.dp) for c in range(dims.cp)]
        grp = new_group(ranks) if len(ranks) > 1 else None
        if rank in ranks:
            g.dp_cp = grp
    for dp, pp in itertools.product(range(dims.dp), range(dims.pp)):
        ranks = [dims.rank(tp=t, cp=c, dp=dp, pp=pp) for c in range(dims.cp) for t in range(dims.tp)]
        if dims.cp == 1 or dims.tp == 1:  # the same ranks as the TP (CP) group: no second group
            if rank in ranks:
                g.tp_cp = g.tp if dims.cp == 1 else g.cp
            continue
        grp = new_group(ranks)
        if rank in ranks:
            g.tp_cp = grp
    for ranks in each("pp", ["tp", "cp", "dp"]):
        emb = sorted({ranks[0], ranks[-1]})
        grp = new_group(emb) if len(emb) > 1 else None
        if rank in emb:
            g.embedding = grp
    g.ep_rank, g.edp_rank = dims.expert_coords(rank)
    g.etp_rank = coords_of(rank, dims.expert_sizes, EXPERT_ORDER)["etp"]
    for ranks in _expert_tp_groups(dims):
        if dims.expert_tp == dims.tp:  # Megatron's default: the expert TP groups are the TP groups
            g.etp = g.tp
            break
        grp = new_group(ranks) if len(ranks) > 1 else None
        if rank in ranks:
            g.etp = grp
    for ranks in _expert_tp_ep_groups(dims):
        if dims.ep == 1 or dims.expert_tp == 1:  # the same ranks as the expert TP (EP) groups
            g.etp_ep = g.etp if dims.ep == 1 else None  # set from the EP groups below
            break
        grp = new_group(ranks)
        if rank in ranks:
            g.etp_ep = grp
    for ep_groups, edp_groups in _expert_groups(dims):
        for ranks in ep_groups:
            grp = new_group(ranks) if len(ranks) > 1 else None
            if rank in ranks:
                g.ep = grp
                if dims.expert_tp == 1:
                    g.etp_ep = grp
        for ranks in edp_groups:
            grp = new_group(ranks) if len(ranks) > 1 else None
            if rank in ranks:
                g.edp, g.edp_ranks = grp, ranks
    check_group_order()
    # the groups that carry point-to-point batches get their communicator from a collective of all their ranks
    # first (train/parallel/p2p.py); every rank takes part in each, in the same order
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    p2p.init_p2p_group(g.pp, device)
    p2p.init_p2p_group(g.cp, device)
    return g


def _expert_tp_groups(dims: RunLayout):
    """The expert-tensor-parallel groups (global ranks, by etp index): the etp-fastest blocks of the expert order."""
    es = dims.expert_sizes
    for pp, edp, ep in itertools.product(range(dims.pp), range(dims.edp), range(dims.ep)):
        yield [rank_of(es, EXPERT_ORDER, etp=t, ep=ep, edp=edp, pp=pp) for t in range(dims.expert_tp)]


def _expert_tp_ep_groups(dims: RunLayout):
    """The expert TP x EP groups (Megatron's expert-tensor-and-model-parallel groups): etp x ep consecutive ranks of
    the expert order."""
    es = dims.expert_sizes
    for pp, edp in itertools.product(range(dims.pp), range(dims.edp)):
        yield [rank_of(es, EXPERT_ORDER, etp=t, ep=e, edp=edp, pp=pp) for e in range(dims.ep)
               for t in range(dims.expert_tp)]


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
