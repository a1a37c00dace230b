"""The native engine's memory where it was cheap to fix (issue 40).

Sequence parallelism keeps the local slice for backward: the column-parallel
linears' gather is fused with the matmul (train/parallel/comm.py gathered_linear, megatron-core's
LinearWithGradAccumulationAndAsyncCommunication), so backward re-gathers instead of keeping the gathered input.

Two ranks on gloo: gathered_linear against gather_seq followed by F.linear, the same inputs: outputs and gradients
bitwise equal, and the bytes autograd keeps (saved-tensor hooks, exact) smaller by the gathered input less its
local slice.

The NaN check of the gradient buffer: two reductions, no byte-per-element temporary.
"""
from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import torch


def _saved_bytes(fn) -> tuple[torch.Tensor, int]:
    seen: dict[int, int] = {}

    def pack(t):
        seen[id(t)] = t.numel() * t.element_size()  # each tensor once (a parameter saved twice is one buffer)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


def _worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist
    import torch.nn.functional as F

    from train.parallel import comm

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    group = dist.group.WORLD
    torch.manual_seed(0)
    b, s, h, o = 2, 8, 16, 24  # the local slice: s tokens of [b, world * s, h]
    w = torch.randn(o, h, requires_grad=True)
    bias = torch.randn(o, requires_grad=True)
    x = torch.randn(b, world * s, h).chunk(world, dim=1)[rank].contiguous().requires_grad_()
    g = torch.randn(b, world * s, o)
    res = {}
    for name, fn in (("fused", lambda: comm.gathered_linear(x * 1.0, w, bias, group)),
                     ("plain", lambda: F.linear(comm.gather_seq(x * 1.0, group), w, bias))):
        x.grad = w.grad = bias.grad = None
        y, saved = _saved_bytes(fn)
        y.backward(g)
        res[name] = {"saved": saved, "y": y.detach().tolist(), "gx": x.grad.tolist(), "gw": w.grad.tolist(),
                     "gb": bias.grad.tolist()}
    res["gathered_input_bytes"] = b * world * s * h * 4
    res["local_bytes"] = b * s * h * 4
    Path(out, f"{rank}.json").write_text(json.dumps(res))
    dist.destroy_process_group()
    from tests.launcher import exit_worker

    exit_worker()


def test_gathered_linear_keeps_the_local_slice(tmp_path):
    import torch.multiprocessing as mp

    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    mp.start_processes(_worker, args=(2, port, str(tmp_path)), nprocs=2, start_method="spawn")
    for rank in range(2):
        r = json.loads((tmp_path / f"{rank}.json").read_text())
        for k in ("y", "gx", "gw", "gb"):
            assert r["fused"][k] == r["plain"][k], k  # bitwise: the same arithmetic
        # the plain path keeps the gathered input; the fused one only this rank's slice of it
        assert r["plain"]["saved"] - r["fused"]["saved"] == r["gathered_input_bytes"] - r["local_bytes"], r


def test_nan_check_without_a_buffer_sized_temporary():
    """not_all_finite flags NaN, +inf and -inf anywhere and nothing else, via max and min only."""
    from train.loop import not_all_finite

    t = torch.randn(4096)
    assert not bool(not_all_finite(t)) and not bool(not_all_finite(torch.empty(0)))
    for bad in (float("nan"), float("inf"), -float("inf")):
        for where in (0, 1234, 4095):
            u = t.clone()
            u[where] = bad
            assert bool(not_all_finite(u)), (bad, where)
