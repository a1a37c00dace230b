"""megatron-core trains as Megatron-LM's pretrain_gpt.py would, on CPU, as the oracle for `shardkit continue-pretrain`.
Run as a script in a subprocess (importing megatron-core changes torch's pickle safe globals):

    python tests/megatron_train_oracle.py jobs.json

jobs.json: a list of jobs, each {"ckpt": torch_dist ITER_DIR, "model": {...} (the fields of
tests/megatron_torch_dist_oracle.build), "data": {"blend": [...--data-path words...], "split": "969,30,1",
"seed": 1234, "seq_length": 32, "cache": DIR}, "train": {"train_iters", "micro_batch_size", "global_batch_size",
"lr", "min_lr", "lr_warmup_init", "lr_warmup_iters", "lr_decay_iters" (null: train_iters), "lr_decay_style",
"weight_decay", "clip_grad", "adam_beta1", "adam_beta2", "adam_eps", "use_distributed_optimizer"}, "out": JSON}

Every piece is megatron-core's own: GPTModel (local spec) loaded from the checkpoint with dist_checkpointing,
BlendedMegatronDatasetBuilder(GPTDataset), DistributedDataParallel, get_megatron_optimizer with Megatron-LM's standard
config overrides (no weight decay for biases and 1-D parameters), OptimizerParamScheduler built as Megatron-LM's
training.py get_optimizer_param_scheduler builds it, and get_forward_backward_func()'s schedule with pretrain_gpt.py's
forward_step/loss_func. Each iteration is Megatron-LM's train_step: zero_grad_buffer, optimizer.zero_grad, forward and
backward over the micro-batches (loss sum / tokens / micro-batches, finalize_model_grads), optimizer.step() (clipping
inside), then opt_param_scheduler.step(increment=micro-batches x micro batch x DP).

`out` gets, per iteration: "loss" (Megatron-LM's reported lm loss: sum of token losses / tokens over the global
batch), "grad_norm" (before clipping, as optimizer.step() returns it), "lr" and "wd" (each param group's values the
step was taken with, i.e. before the scheduler advanced; Megatron-LM's log line shows the value after), "tokens" (each
micro-batch's [mbs, seq + 1] token ids: the sample's tokens followed by its last label).

The CPU shims are the other oracles' (tests/megatron_torch_dist_oracle.init_megatron_cpu, and
tests/megatron_optimizer_oracle.cuda_as_cpu for the optimizer's device="cuda" scalars and the CUDA-type assertion in
its gradient clipping); no arithmetic is changed.
"""
from __future__ import annotations

import functools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.megatron_data_oracle import _Tokenizer  # noqa: E402
from tests.megatron_optimizer_oracle import run_jobs  # noqa: E402
from tests.megatron_torch_dist_oracle import build  # noqa: E402


def train_dataset(data: dict, train_samples: int):
    """Megatron-LM's train split: BlendedMegatronDatasetBuilder(GPTDataset). The run evaluates nothing; the valid and
    test splits are built at their natural size (None: one epoch; a size of 0 never terminates in GPTDataset's epoch
    count), which does not change the train split."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.utils import get_blend_from_list

    cfg = GPTDatasetConfig(random_seed=data["seed"], sequence_length=data["seq_length"],
                           blend=get_blend_from_list(data["blend"]), split=data["split"], path_to_cache=data["cache"],
                           tokenizer=_Tokenizer(), reset_position_ids=False, reset_attention_mask=False,
                           eod_mask_loss=False, mmap_bin_files=True, create_attention_mask=True)
    train, _, _ = BlendedMegatronDatasetBuilder(GPTDataset, [train_samples, None, None], lambda: True, cfg).build()
    return train


def micro_batches(dataset, micro_batch_size: int, seen: list):
    """Megatron-LM's MegatronPretrainingSampler at DP 1 from consumed samples 0 (consecutive indices, micro_batch_size
    at a time, the last partial batch dropped) and the DataLoader's default collate. Each batch's token ids are
    appended to `seen`."""
    for start in range(0, len(dataset) - micro_batch_size + 1, micro_batch_size):
        batch = torch.utils.data.default_collate([dataset[i] for i in range(start, start + micro_batch_size)])
        seen.append(torch.cat([batch["tokens"], batch["labels"][:, -1:]], dim=1).tolist())
        yield batch


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """pretrain_gpt.py's loss_func: the micro-batch's summed token loss, its token count, and the report."""
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


def forward_step(data_iterator, model):
    """pretrain_gpt.py's forward_step for a batch from the dataset (get_batch at TP 1 / CP 1)."""
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
    return output, functools.partial(loss_func, batch["loss_mask"])


def optimizer_param_scheduler(optimizer, t: dict):
    """Megatron-LM training.py get_optimizer_param_scheduler, iteration-based (--train-iters), with its argument
    defaults: --start-weight-decay / --end-weight-decay = --weight-decay, --weight-decay-incr-style constant,
    --use-checkpoint-opt_param-scheduler and --override-opt_param-scheduler off."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    gbs = t["global_batch_size"]
    lr_decay_iters = t.get("lr_decay_iters") or t["train_iters"]
    lr_decay_steps = lr_decay_iters * gbs
    wd_incr_steps = t["train_iters"] * gbs
    lr_warmup_steps = t["lr_warmup_iters"] * gbs
    return OptimizerParamScheduler(
        optimizer, init_lr=t.get("lr_warmup_init", 0.0), max_lr=t["lr"], min_lr=t["min_lr"],
        lr_warmup_steps=lr_warmup_steps, lr_decay_steps=lr_decay_steps, lr_decay_style=t["lr_decay_style"],
        start_wd=t["weight_decay"], end_wd=t["weight_decay"], wd_incr_steps=wd_incr_steps,
        wd_incr_style="constant", use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=False,
        wsd_decay_steps=None, lr_wsd_decay_style=None)


def run(job: dict) -> dict:
    from megatron.core import dist_checkpointing
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer, get_standard_config_overrides
    from megatron.core.pipeline_parallel import get_forward_backward_func

    t = job["train"]
    model = build(job["model"]).train()
    # Megatron-LM loads into the unwrapped model; loading before the DDP wrap keeps the values DDP copies into its
    # contiguous buffers, and the optimizer (built after) starts from them (a weights-only checkpoint: fresh state)
    state = dist_checkpointing.load({"model": model.sharded_state_dict()}, job["ckpt"])
    model.load_state_dict(state["model"], strict=True)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
        use_distributed_optimizer=t["use_distributed_optimizer"], grad_reduce_in_fp32=True,
        overlap_grad_reduce=False), model)
    ocfg = OptimizerConfig(optimizer="adam", lr=t["lr"], min_lr=t["min_lr"], weight_decay=t["weight_decay"],
                           adam_beta1=t["adam_beta1"], adam_beta2=t["adam_beta2"], adam_eps=t["adam_eps"],
                           clip_grad=t["clip_grad"], bf16=False, fp16=False, params_dtype=torch.float32,
                           use_distributed_optimizer=t["use_distributed_optimizer"])
    optimizer = get_megatron_optimizer(ocfg, [ddp], config_overrides=get_standard_config_overrides(ocfg))
    scheduler = optimizer_param_scheduler(optimizer, t)
    config = model.config  # what Megatron-LM's train() sets on the model config before the loop
    config.grad_scale_func = optimizer.scale_loss
    config.finalize_model_grads_func = finalize_model_grads
    forward_backward = get_forward_backward_func()

    mbs, gbs, dp = t["micro_batch_size"], t["global_batch_size"], 1  # one process: DP 1
    num_micro = gbs // (mbs * dp)
    seen: list = []
    data = micro_batches(train_dataset(job["data"], t["train_iters"] * gbs), mbs, seen)
    out = {"loss": [], "grad_norm": [], "lr": [], "wd": [], "tokens": [], "params": [], "num_micro": num_micro}
    for _ in range(t["train_iters"]):
        first = len(seen)
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        losses_reduced = forward_backward(forward_step_func=forward_step, data_iterator=data, model=[ddp],
                                          num_microbatches=num_micro, seq_length=job["data"]["seq_length"],
                                          micro_batch_size=mbs, decoder_seq_length=None, forward_only=False)
        groups = optimizer.param_groups
        out["lr"].append([g["lr"] for g in groups])
        out["wd"].append([g["weight_decay"] for g in groups])
        out["params"].append([len(g["params"]) for g in groups])
        ok, grad_norm, _ = optimizer.step()
        if not ok:
            raise RuntimeError("megatron-core's optimizer skipped a step (fp32: it never should)")
        scheduler.step(increment=num_micro * mbs * dp)
        val = torch.vstack([x["lm loss"].view(-1) for x in losses_reduced]).sum(dim=0)
        out["loss"].append(float(val[0] / val[1]))
        out["grad_norm"].append(float(grad_norm))
        out["tokens"].append(seen[first:])
    return out


def _run_and_dump(job: dict) -> None:
    out = run(job)
    with open(job["out"], "w") as f:
        json.dump(out, f)


def main() -> None:
    run_jobs(_run_and_dump)


if __name__ == "__main__":  # dist_checkpointing may spawn processes
    main()
