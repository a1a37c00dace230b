"""A worker of tests/test_train_moe.py::test_all_to_all_dispatch_equals_the_loop (spawned: keep imports light)."""
from __future__ import annotations

import datetime
from pathlib import Path

import torch
import torch.distributed as dist

from checkpoint.config import ModelConfig


def _case(rank: int, world: int, idle: bool, grouped_mm: bool) -> bool:
    from train.model import Experts
    from train.parallel.expert import ExpertParallelExperts

    cfg = ModelConfig(model_type="mixtral", num_layers=1, hidden_size=16, num_attention_heads=2, num_query_groups=2,
                      kv_channels=8, ffn_hidden_size=8, vocab_size=32, max_position_embeddings=8, norm_epsilon=1e-5,
                      rotary_base=10000.0, num_moe_experts=4, moe_ffn_hidden_size=8, moe_router_topk=2,
                      moe_layer_freq=[1])
    torch.manual_seed(0)
    full = Experts(cfg)  # the same weights on every rank
    ep = ExpertParallelExperts(cfg, dist.group.WORLD, world, rank)
    ep.grouped_mm = grouped_mm and ep.grouped_mm  # the grouped GEMMs where torch has them, and the loop
    mine = slice(ep.first, ep.first + ep.num_local)
    assert mine == slice(rank * 4 // world, (rank + 1) * 4 // world)  # the table's block of E / EP experts
    with torch.no_grad():
        for name in ("linear_fc1", "linear_fc2"):
            getattr(ep.experts, name).weight.copy_(getattr(full.experts, name).weight[mine])
    g = torch.Generator().manual_seed(10 + rank)
    x = torch.randn(6, 16, generator=g, requires_grad=True)
    weights = torch.rand(6, 2, generator=g)
    # idle: every token of every rank goes to rank 0's experts, so rank 1 receives nothing
    indices = (torch.tensor([[0, 1]] * 6) if idle
               else torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(6)]))
    y = ep(x, weights, indices)
    y.pow(2).sum().backward()
    x2 = x.detach().clone().requires_grad_()
    y2 = full(x2, weights, indices)
    y2.pow(2).sum().backward()
    ok = torch.allclose(y, y2, atol=1e-6) and torch.allclose(x.grad, x2.grad, atol=1e-6)
    # this rank's expert shard gets the gradient of both ranks' tokens; the plain loop saw only its own
    grads = torch.cat([(torch.zeros_like(w) if w.grad is None else w.grad).reshape(-1)  # idle: no gradient
                       for w in (ep.experts.linear_fc1.weight, ep.experts.linear_fc2.weight)])
    ref = []
    for w in (full.experts.linear_fc1.weight, full.experts.linear_fc2.weight):
        total = w.grad.clone()
        dist.all_reduce(total)
        ref.append(total[mine].reshape(-1))
    ref = torch.cat(ref)
    return ok and torch.allclose(grads, ref, atol=1e-5)


def run(rank: int, world: int, store_path: str, out_dir: str) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))  # a dispatch that hangs fails instead
    try:
        result = ", ".join(f"{name} {'ok' if _case(rank, world, idle, gmm) else 'mismatch'}"
                           for name, idle, gmm in (("spread", False, True), ("idle-rank", True, True),
                                                   ("spread-loop", False, False)))
        Path(out_dir, str(rank)).write_text(result)
    finally:
        dist.destroy_process_group()
