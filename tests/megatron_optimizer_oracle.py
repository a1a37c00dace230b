"""megatron-core on CPU trains a few steps with its DistributedDataParallel + DistributedOptimizer and saves a torch_dist
checkpoint WITH the optimizer state, as Megatron-LM lays it out. Run as a script in a subprocess:

    python tests/megatron_optimizer_oracle.py job.json
    job: {"root": DIR, "iteration": N, "seed": S, "steps": K, "model": {...}, "out": PT}

`out` gets {"tensors": model tensors by key, "optimizer": {state: {key: global tensor}}, "fs_model_space_error": str}:
the optimizer state as megatron-core's own sharded state dict holds it (gathered to global tensors by key).

Beyond the CPU recipe in DESIGN.md, the distributed optimizer needs: `Tensor.type()` reporting `torch.cuda.*Tensor`
(it refuses other parameter types), `Tensor.cuda()` as identity and `device="cuda"` factory calls placed on the CPU
(its overflow buffer and its gather for `fully_reshardable`). The `fully_sharded_model_space` sharding type cannot be
saved by megatron-core 0.16 at all (it raises "ShardedTensor.flattened_range is not supported."), so the checkpoint
uses `fully_reshardable`, the model-space format 0.16 saves and loads.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.megatron_torch_dist_oracle import build, global_tensors, randomize, shims  # noqa: E402


def cuda_as_cpu() -> None:
    def on_cpu(fn):
        @functools.wraps(fn)
        def wrapped(*a, **k):
            if str(k.get("device", "")).startswith("cuda"):
                k["device"] = "cpu"
            return fn(*a, **k)
        return wrapped

    for name in ("tensor", "zeros", "empty", "ones", "full", "arange", "zeros_like", "empty_like"):
        setattr(torch, name, on_cpu(getattr(torch, name)))
    orig_type = torch.Tensor.type

    def tensor_type(self, *a, **k):
        if a or k:
            return orig_type(self, *a, **k)
        t = orig_type(self)
        return t if t.startswith("torch.cuda.") else t.replace("torch.", "torch.cuda.", 1)

    torch.Tensor.type = tensor_type
    torch.Tensor.cuda = lambda self, *a, **k: self


def gather(sharded: dict) -> dict[str, torch.Tensor]:
    """Global tensors by key from the ShardedTensors of a (nested) sharded state dict."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    out: dict[str, torch.Tensor] = {}
    items = []
    for v in nested_values(sharded):
        if isinstance(v, ShardedTensorFactory):  # e.g. linear_fc1's [gate; up] split
            built = v.build()
            items += list(nested_values(built)) if isinstance(built, (dict, list)) else [built]
        else:
            items.append(v)
    for t in items:
        if isinstance(t, ShardedTensor):
            g = out.setdefault(t.key, torch.full(t.global_shape, float("nan"), dtype=t.data.dtype))
            data = t.data.detach().reshape((1,) * t.prepend_axis_num + tuple(t.local_shape))
            g[tuple(slice(o, o + s) for o, s in zip(t.global_offset, data.shape))] = data
    return out


def run(job: dict) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    model = build(job["model"]).train()
    randomize(model, job["seed"])
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
        use_distributed_optimizer=True, grad_reduce_in_fp32=True, overlap_grad_reduce=False), model)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.01, bf16=False,
                                                 params_dtype=torch.float32, use_distributed_optimizer=True), [ddp])
    g = torch.Generator().manual_seed(job["seed"])
    vocab = job["model"]["padded_vocab_size"]
    for _ in range(job["steps"]):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        ids = torch.randint(0, vocab, (2, 16), generator=g)
        pos = torch.arange(16)[None].expand(2, -1)
        mask = torch.triu(torch.ones(16, 16, dtype=torch.bool), 1)[None, None]
        ddp(ids, pos, mask, labels=ids).float().mean().backward()
        ddp.finish_grad_sync()
        ok, _, _ = opt.step()
        assert ok
    fs_error = ""
    try:  # megatron-core 0.16 cannot build this (deprecated) sharding type; record what it says
        opt.sharded_state_dict(model.sharded_state_dict(),
                               metadata={"distrib_optim_sharding_type": "fully_sharded_model_space"})
    except Exception as e:  # noqa: BLE001 - recorded for the report
        fs_error = f"{type(e).__name__}: {e}"
    it = job["iteration"]
    d = os.path.join(job["root"], f"iter_{it:07d}")
    os.makedirs(d)
    meta = {"distrib_optim_sharding_type": "fully_reshardable"}
    model_sd = model.sharded_state_dict(metadata=meta)  # Megatron-LM saves the unwrapped model's keys
    opt_sd = opt.sharded_state_dict(model_sd, metadata=meta)
    optimizer = {}
    for key, t in gather(opt_sd).items():
        _, _, state, *rest = key.split(".", 3)
        optimizer.setdefault(state, {})[rest[0]] = t
    m = job["model"]
    args = argparse.Namespace(num_layers=m["num_layers"], hidden_size=m["hidden_size"],
                              tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                              padded_vocab_size=m["padded_vocab_size"], params_dtype=torch.float32)
    dist_checkpointing.save({"model": model_sd, "optimizer": opt_sd, "iteration": it, "checkpoint_version": 3.0,
                             "args": args, "opt_param_scheduler": {"num_steps": job["steps"]}}, d,
                            content_metadata=meta)
    with open(os.path.join(job["root"], "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(it))
    torch.save({"tensors": global_tensors(model), "optimizer": optimizer, "fs_model_space_error": fs_error},
               job["out"])


def main() -> None:
    shims()
    cuda_as_cpu()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state, tensor_parallel

    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    torch.manual_seed(0)
    with open(sys.argv[1]) as f:
        job = json.load(f)
    run(job)
    print(f"ORACLE done -> {job['out']}", flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":  # its save spawns processes
    main()
