"""megatron-core's own OptimizerParamScheduler driven the way Megatron-LM drives it, on CPU (no process group). Run as
a script in a subprocess (importing megatron.core changes torch's safe globals):

    python tests/megatron_schedule_oracle.py cases.json out.json

Each case: {"args": {Megatron-LM argument names -> values}, "resume": null or {"after": K, "args": {...},
"mode": "default" | "override" | "use_checkpoint"}}. The scheduler's arguments come from "args" as Megatron-LM's
arguments.py (start/end weight decay for the constant style) and training.py `get_optimizer_param_scheduler` (steps in
samples: iterations x global batch, or the --*-samples values) derive them, over a torch.optim.SGD on one tensor.
Per iteration the LR and weight decay that the optimizer step applies are recorded (param group 0, wd_mult 1), then
the scheduler advances by the global batch, as Megatron-LM's train_step does. With "resume", after K iterations the
state_dict goes through JSON, a scheduler is built from the resume args (with --override-opt_param-scheduler or
--use-checkpoint-opt_param-scheduler per "mode"), load_state_dict runs (an AssertionError there is recorded as
"refused") and the run goes on to the resume args' length.

out.json: one {"iters": N, "lr": [...], "wd": [...], "refused": str | null, "resumed": {"lr": [...], "wd": [...]},
"state_dict": {...} (with "resume": the state saved after K iterations)} per case.
"""
from __future__ import annotations

import json
import sys

import torch

DEFAULTS = {"train_iters": None, "train_samples": None, "lr_warmup_iters": 0, "lr_warmup_samples": 0,
            "lr_warmup_fraction": None, "lr_warmup_init": 0.0, "lr_decay_iters": None, "lr_decay_samples": None,
            "lr_decay_style": "linear", "lr_wsd_decay_style": "exponential", "lr_wsd_decay_iters": None,
            "lr_wsd_decay_samples": None, "min_lr": 0.0, "start_weight_decay": None, "end_weight_decay": None,
            "weight_decay_incr_style": "constant", "weight_decay": 0.01}


def scheduler(optimizer, given: dict, mode: str = "default"):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    a = dict(DEFAULTS, **given)
    gbs = a["global_batch_size"]
    if a["weight_decay_incr_style"] == "constant":  # arguments.py validate_args
        assert a["start_weight_decay"] is None and a["end_weight_decay"] is None
        a["start_weight_decay"] = a["end_weight_decay"] = a["weight_decay"]
    if a["train_iters"]:  # training.py get_optimizer_param_scheduler
        if a["lr_decay_iters"] is None:
            a["lr_decay_iters"] = a["train_iters"]
        lr_decay_steps = a["lr_decay_iters"] * gbs
        wd_incr_steps = a["train_iters"] * gbs
        wsd_decay_steps = None
        if a["lr_wsd_decay_iters"] is not None:
            wsd_decay_steps = a["lr_wsd_decay_iters"] * gbs
        if a["lr_warmup_fraction"] is not None:
            lr_warmup_steps = a["lr_warmup_fraction"] * lr_decay_steps
        else:
            lr_warmup_steps = a["lr_warmup_iters"] * gbs
    else:
        a["train_iters"] = a["train_samples"] // gbs  # update_train_iters without batch-size rampup
        if a["lr_decay_samples"] is None:
            a["lr_decay_samples"] = a["train_samples"]
        lr_decay_steps = a["lr_decay_samples"]
        wd_incr_steps = a["train_samples"]
        wsd_decay_steps = a["lr_wsd_decay_samples"]
        if a["lr_warmup_fraction"] is not None:
            lr_warmup_steps = a["lr_warmup_fraction"] * lr_decay_steps
        else:
            lr_warmup_steps = a["lr_warmup_samples"]
    sched = OptimizerParamScheduler(
        optimizer, init_lr=a["lr_warmup_init"], max_lr=a["lr"], min_lr=a["min_lr"], lr_warmup_steps=lr_warmup_steps,
        lr_decay_steps=lr_decay_steps, lr_decay_style=a["lr_decay_style"], start_wd=a["start_weight_decay"],
        end_wd=a["end_weight_decay"], wd_incr_steps=wd_incr_steps, wd_incr_style=a["weight_decay_incr_style"],
        use_checkpoint_opt_param_scheduler=mode == "use_checkpoint", override_opt_param_scheduler=mode == "override",
        wsd_decay_steps=wsd_decay_steps, lr_wsd_decay_style=a["lr_wsd_decay_style"])
    return sched, a["train_iters"], gbs


def run(sched, optimizer, gbs: int, start: int, stop: int, out: dict) -> None:
    for _ in range(start, stop):
        group = optimizer.param_groups[0]
        out["lr"].append(group["lr"])
        out["wd"].append(group["weight_decay"])
        sched.step(increment=gbs)


def main() -> None:
    cases = json.loads(open(sys.argv[1]).read())
    results = []
    for case in cases:
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.0)
        sched, iters, gbs = scheduler(optimizer, case["args"])
        res = {"iters": iters, "lr": [], "wd": [], "refused": None, "resumed": None}
        resume = case.get("resume")
        run(sched, optimizer, gbs, 0, resume["after"] if resume else iters, res)
        if resume:
            sd = json.loads(json.dumps(sched.state_dict()))
            res["state_dict"] = sd
            optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.0)
            new, new_iters, new_gbs = scheduler(optimizer, resume["args"], resume["mode"])
            try:
                new.load_state_dict(sd)
            except AssertionError as e:
                res["refused"] = str(e)
            else:
                res["resumed"] = {"lr": [], "wd": []}
                run(new, optimizer, new_gbs, resume["after"], new_iters, res["resumed"])
        results.append(res)
    with open(sys.argv[2], "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
