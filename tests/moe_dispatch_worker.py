"""A worker of tests/test_train_moe.py::test_all_to_all_dispatch_equals_the_loop (spawned: keep imports light)."""
from __future__ import annotations

import datetime
from pathlib import Path

import torch
import torch.distributed as dist

from checkpoint.config import ModelConfig


def _case(rank: int, world: int, idle: bool, grouped_mm: bool, kind: str = "alltoall-ep") -> bool:
    """kind: alltoall-ep (E/world experts per rank), alltoall-etp (every expert, its ffn split over the ranks: expert
    TP), allgather-ep (Megatron's allgather dispatcher over the EP ranks), allgather-etp (over the expert-TP ranks)."""
    from checkpoint.layout import Layout, RankCoord
    from checkpoint.sharding import regions
    from checkpoint.families import model_specs
    from train.model import Experts
    from train.parallel.expert import AllGatherExperts, ExpertParallelExperts

    cfg = ModelConfig(model_type="mixtral", num_layers=1, hidden_size=16, num_attention_heads=2, num_query_groups=2,
                      kv_channels=8, ffn_hidden_size=8, vocab_size=32, max_position_embeddings=8, norm_epsilon=1e-5,
                      rotary_base=10000.0, num_moe_experts=4, moe_ffn_hidden_size=8, moe_router_topk=2,
                      moe_layer_freq=[1])
    torch.manual_seed(0)
    full = Experts(cfg)  # the same weights on every rank
    dispatcher, split = kind.split("-")
    layout = Layout(ep=world) if split == "ep" else Layout(tp=world)
    ep_rank, etp_rank = (rank, 0) if split == "ep" else (0, rank)
    world_group = dist.group.WORLD
    if dispatcher == "alltoall":
        ep = (ExpertParallelExperts(cfg, layout, world_group, ep_rank) if split == "ep"
              else ExpertParallelExperts(cfg, layout, None, 0, world_group, etp_rank))
    else:
        ep = AllGatherExperts(cfg, layout, world_group, ep_rank, None, etp_rank)
    ep.grouped_mm = grouped_mm and ep.grouped_mm  # the grouped GEMMs where torch has them, and the loop
    if split == "ep":
        assert (ep.first, ep.num_local) == (rank * 4 // world, 4 // world)  # the table's block of E / EP experts
    # this rank's shard of each expert weight, by the sharding table's regions (gate/up halves for fc1)
    boxes = {}
    for spec in model_specs(cfg, layout):
        if spec.expert:
            name = spec.name.split(".")[-2]
            boxes[name] = regions(spec, layout, RankCoord(ep=ep_rank, etp=etp_rank), 1)
    with torch.no_grad():
        for name, regs in boxes.items():
            for r in regs:  # stacked over the one layer: drop the layer axis
                getattr(ep.experts, name).weight[r.local_slices()[1:]] = \
                    getattr(full.experts, name).weight[r.global_slices()[1:]]
    g = torch.Generator().manual_seed(10 + rank)
    x = torch.randn(6, 16, generator=g, requires_grad=True)
    weights = torch.rand(6, 2, generator=g, requires_grad=True)
    # idle: every token of every rank goes to rank 0's experts, so rank 1 receives nothing
    indices = (torch.tensor([[0, 1]] * 6) if idle
               else torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(6)]))
    y = ep(x, weights, indices)
    y.pow(2).sum().backward()
    x2 = x.detach().clone().requires_grad_()
    w2 = weights.detach().clone().requires_grad_()
    y2 = full(x2, w2, indices)
    y2.pow(2).sum().backward()
    ok = all(torch.allclose(a, b, atol=1e-6) for a, b in ((y, y2), (x.grad, x2.grad), (weights.grad, w2.grad)))
    # this rank's expert shard gets the gradient of both ranks' tokens; the plain loop saw only its own
    for name, regs in boxes.items():
        w = getattr(ep.experts, name).weight
        got = torch.zeros_like(w) if w.grad is None else w.grad  # idle: no gradient
        total = getattr(full.experts, name).weight.grad.clone()
        dist.all_reduce(total)
        for r in regs:
            ok = ok and torch.allclose(got[r.local_slices()[1:]], total[r.global_slices()[1:]], atol=1e-5)
    return ok


def run(rank: int, world: int, store_path: str, out_dir: str) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))  # a dispatch that hangs fails instead
    try:
        result = ", ".join(f"{name} {'ok' if _case(rank, world, idle, gmm, kind) else 'mismatch'}"
                           for name, idle, gmm, kind in (
                               ("spread", False, True, "alltoall-ep"), ("idle-rank", True, True, "alltoall-ep"),
                               ("spread-loop", False, False, "alltoall-ep"), ("etp", False, True, "alltoall-etp"),
                               ("etp-idle", True, True, "alltoall-etp"), ("allgather", False, True, "allgather-ep"),
                               ("allgather-idle", True, True, "allgather-ep"),
                               ("allgather-etp", False, True, "allgather-etp")))
        Path(out_dir, str(rank)).write_text(result)
    finally:
        dist.destroy_process_group()
    from tests.launcher import exit_worker

    exit_worker()
