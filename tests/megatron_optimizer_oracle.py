"""megatron-core on CPU trains a few steps with its DistributedDataParallel + DistributedOptimizer and saves a torch_dist
checkpoint WITH the optimizer state, as Megatron-LM lays it out. Run as a script in a subprocess:

    python tests/megatron_optimizer_oracle.py jobs.json
    {"mode": "save", "root": DIR, "iteration": N, "seed": S, "steps": K, "model": {...}, "out": PT}
        train K steps, save (<root>/iter_N + latest_checkpointed_iteration.txt)
    {"mode": "load", "ckpt": ITER_DIR, "model": {...}, "out": PT}
        build the same model, DDP and optimizer, load a torch_dist checkpoint with its optimizer state the way
        Megatron-LM does (dist_checkpointing.load, then model/optimizer load_state_dict), one more step must run

`out` gets {"tensors": model tensors by key, "optimizer": {state: {key: global tensor}}, "fs_model_space_error": str,
"param_groups": [...]}: the optimizer state as megatron-core's own sharded state dict holds it (gathered to global
tensors by key).

Beyond the CPU recipe in DESIGN.md, the distributed optimizer needs: `Tensor.type()` reporting `torch.cuda.*Tensor`
(it refuses other parameter types), `Tensor.cuda()` as identity and `device="cuda"` factory calls placed on the CPU
(its overflow buffer and its gather for `fully_reshardable`), and loading needs `tolerate_adam_step`. The `fully_sharded_model_space` sharding type cannot be
saved by megatron-core 0.16 at all (it raises "ShardedTensor.flattened_range is not supported."), so the checkpoint
uses `fully_reshardable`, the model-space format 0.16 saves and loads.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.megatron_torch_dist_oracle import build, global_tensors, init_megatron_cpu, randomize  # noqa: E402


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


def tolerate_adam_step() -> None:
    """megatron-core 0.16 restores `fully_reshardable` state by copying into every entry of the optimizer's per-param
    state, which with torch's own Adam (no Apex/TE, as on CPU) includes the `step` tensor it never saved (step comes
    from the param groups): a KeyError for any checkpoint, its own included. Leave `step` out of that copy."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    orig = DistributedOptimizer._set_main_param_and_optimizer_states

    def patched(self, model_param, tensors):
        group_index, group_order = self.model_param_group_index_map[model_param]
        state = self.optimizer.state[self.optimizer.param_groups[group_index]["params"][group_order]]
        step = state.pop("step", None)
        try:
            orig(self, model_param, tensors)
        finally:
            if step is not None:
                state["step"] = step

    DistributedOptimizer._set_main_param_and_optimizer_states = patched


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


def setup(job: dict):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    model = build(job["model"]).train()
    randomize(model, job.get("seed", 0))
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
        use_distributed_optimizer=True, grad_reduce_in_fp32=True, overlap_grad_reduce=False), model)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.01, bf16=False,
                                                 params_dtype=torch.float32, use_distributed_optimizer=True), [ddp])
    return model, ddp, opt


def train(job: dict, ddp, opt, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    vocab = job["model"]["padded_vocab_size"]
    for _ in range(steps):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        ids = torch.randint(0, vocab, (2, 16), generator=g)
        pos = torch.arange(16)[None].expand(2, -1)
        mask = torch.triu(torch.ones(16, 16, dtype=torch.bool), 1)[None, None]
        ddp(ids, pos, mask, labels=ids).float().mean().backward()
        ddp.finish_grad_sync()
        ok, _, _ = opt.step()
        assert ok


META = {"distrib_optim_sharding_type": "fully_reshardable"}


def optimizer_state(model, opt) -> dict:
    optimizer = {}
    for key, t in gather(opt.sharded_state_dict(model.sharded_state_dict(metadata=META), metadata=META)).items():
        _, _, state, *rest = key.split(".", 3)
        optimizer.setdefault(state, {})[rest[0]] = t
    return optimizer


def run(job: dict) -> None:
    from megatron.core import dist_checkpointing

    model, ddp, opt = setup(job)
    if job["mode"] == "load":
        # torch's Adam (no Apex/TE here) has no state before its first step, and megatron-core's state_dict() needs
        # one: take a throwaway step first; everything it changed is overwritten by the load below
        train(job, ddp, opt, 1, 99)
        model_sd = model.sharded_state_dict(metadata=META)
        opt_sd = opt.sharded_state_dict(model_sd, is_loading=True, metadata=META)
        state = dist_checkpointing.load({"model": model_sd, "optimizer": opt_sd}, job["ckpt"])
        model.load_state_dict(state["model"], strict=True)
        opt.load_state_dict(state["optimizer"])
        out = {"tensors": global_tensors(model), "optimizer": optimizer_state(model, opt),
               "param_groups": state["optimizer"]["optimizer"]["param_groups"]}
        train(job, ddp, opt, 1, 0)  # the restored state trains on
        torch.save(out, job["out"])
        return
    train(job, ddp, opt, job["steps"], job["seed"])
    fs_error = ""
    try:  # megatron-core 0.16 cannot build this (deprecated) sharding type; record what it says
        opt.sharded_state_dict(model.sharded_state_dict(),
                               metadata={"distrib_optim_sharding_type": "fully_sharded_model_space"})
    except Exception as e:  # noqa: BLE001 - recorded for the report
        fs_error = f"{type(e).__name__}: {e}"
    it = job["iteration"]
    d = os.path.join(job["root"], f"iter_{it:07d}")
    os.makedirs(d)
    model_sd = model.sharded_state_dict(metadata=META)  # Megatron-LM saves the unwrapped model's keys
    opt_sd = opt.sharded_state_dict(model_sd, metadata=META)
    m = job["model"]
    args = argparse.Namespace(num_layers=m["num_layers"], hidden_size=m["hidden_size"],
                              tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                              padded_vocab_size=m["padded_vocab_size"], params_dtype=torch.float32)
    dist_checkpointing.save({"model": model_sd, "optimizer": opt_sd, "iteration": it, "checkpoint_version": 3.0,
                             "args": args, "opt_param_scheduler": {"num_steps": job["steps"]}}, d,
                            content_metadata=META)
    with open(os.path.join(job["root"], "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(it))
    torch.save({"tensors": global_tensors(model), "optimizer": optimizer_state(model, opt),
                "fs_model_space_error": fs_error}, job["out"])


def run_jobs(run_one) -> None:
    """An oracle's main: megatron-core on CPU with the distributed optimizer's CUDA shims, seed 0, then `run_one` for
    each job of the JSON list in argv[1] (each writes its job's `out`)."""
    cuda_as_cpu()
    init_megatron_cpu()
    torch.manual_seed(0)
    with open(sys.argv[1]) as f:
        jobs = json.load(f)
    for job in jobs:
        run_one(job)
        print(f"ORACLE done {job.get('mode', 'run')} -> {job['out']}", flush=True)
    torch.distributed.destroy_process_group()


def main() -> None:
    tolerate_adam_step()
    run_jobs(run)


if __name__ == "__main__":  # its save spawns processes
    main()
