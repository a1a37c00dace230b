"""megatron-core on CPU as the test oracle (recipe in DESIGN.md). Run as a script in a subprocess (importing
megatron-core in a test process would register its pickle safe globals and weaken the allowlist checks):

    python tests/megatron_oracle.py TOPIC jobs.json

jobs.json is a list of jobs; each job's result goes to its "out" file (torch.save for .pt, else JSON). "model" is
TransformerConfig fields plus padded_vocab_size, max_sequence_length, rotary_base, tied (and, for legacy, the true
vocab_size). The topics, one section each below:

  names       {"model"}: the sharded-state-dict keys and global shapes of megatron-core's own GPTModel.
  data        {"blend": [...--data-path words...], "split", "seed", "seq_length", "sizes": [train, valid, test],
              "cache": DIR}: BlendedMegatronDatasetBuilder(GPTDataset)'s samples and indices per split.
  schedule    {"args", "resume"}: OptimizerParamScheduler driven as Megatron-LM drives it, LR and WD per iteration.
  legacy      {"root", "iteration", "seed", "model", "input_ids"}: a Megatron-LM `--ckpt-format torch` checkpoint of
              a random GPTModel, its logits and state dict.
  torch_dist  {"mode": "load", "ckpt", "model", "input_ids"} or {"mode": "save", "root", "iteration", "model", "seed",
              "input_ids"}: dist_checkpointing load/save of GPTModel, its tensors and logits.
  optimizer   {"mode": "save", "root", "iteration", "seed", "steps", "model"} or {"mode": "load", "ckpt", "model"}:
              DistributedDataParallel + DistributedOptimizer trained and saved, or loaded, with the optimizer state.
  train       {"ckpt", "model", "data", "train"}: a training run as Megatron-LM's pretrain_gpt.py does it; with
              "save": {"root", "at"} also Megatron-LM's torch_dist training save (optimizer state included) after
              iteration "at", with "final_tensors" the weights after the last iteration.
  regions     {"model", "tp", "pp", "vpp", "ep"}: per rank and model chunk, the ShardedTensors (key, global shape,
              offset, shape) of GPTModel built for that stage (uneven splits, layout strings, MLA + MoE + MTP).
  legacy_stages {"root", "iteration", "seed", "model", "pp", "vpp"}: a `--ckpt-format torch` checkpoint of a
              pipeline with (uneven) stages, one rank file per stage, and its global tensors.
  mtp         {"model" (with mtp_num_layers), "seed", "input_ids", "labels"} and for packed documents "cu_seqlens"
              and "loss_mask": GPTModel with multi-token prediction, one training forward and backward: main and
              per-depth MTP logits, the MTP block's output, the MTP losses, the loss and every gradient.
  grouped_experts {"model", "ckpt"}: the MoE GPTModel with the local spec's grouped-GEMM experts (GroupedMLP), built
              and loaded (no forward: no grouped_gemm kernels on CPU): its sharded keys, its weight1/weight2 per rank.
  mixed       {"topic": "train" | "optimizer" | "grouped_experts", ...that topic's job}: several kinds in one process.
  mtp_roll    {"input_ids", "labels", "loss_mask", "depths"} under `torchrun --nproc-per-node CP`: megatron-core's
              roll_tensor over the context-parallel group (every rank), each rank holding its zigzag part; per rank
              and depth the shifted ids, labels, loss mask and the mask's local sum (num_tokens).

A job's "ep" (> 1: the model's expert_model_parallel_size too) runs every job of the file at that expert parallelism
under `torchrun --nproc-per-node EP` (TP = PP = 1, DP = EP: megatron-core's MoE layer, DDP with its expert buffers
and expert-data-parallel groups, the ChainedOptimizer of a dense and an expert DistributedOptimizer, each rank saving
and loading its own shards); rank 0 writes each result, global tensors assembled from every rank's shards.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import random
import signal
import sys

import numpy as np
import torch
import torch.nn.functional as F

# -- megatron-core on the CPU ----------------------------------------------------------------------------------------


def init_megatron_cpu(port_span: int = 1000, ep: int = 1) -> None:
    """megatron-core on the CPU: the shims, a gloo group of one (or torchrun's ranks, when it launched this), model
    parallel 1 x 1 with expert parallelism `ep` (data parallel over the rest), no CUDA RNG tracker (every topic, and
    scripts/bench_train.py, starts here)."""
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # torchrun's ranks (env://)
        torch.distributed.init_process_group("gloo")
    else:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % port_span))
        torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state, tensor_parallel
    import megatron.core.transformer.moe.moe_utils as moe_utils

    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=ep)
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    moe_utils.te_general_gemm = None  # megatron-core 0.16 raises a NameError there without TE


def cuda_as_cpu() -> None:
    """The distributed optimizer's CUDA on the CPU (`Tensor.type()` as `torch.cuda.*`, `.cuda()` the identity,
    `device="cuda"` factories on the CPU): the engine's own stand-in (train/engines/cpu_shims.py), one copy."""
    from train.engines.cpu_shims import cuda_as_cpu as stand_in

    stand_in()


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


# -- the model -------------------------------------------------------------------------------------------------------

MODEL_EXTRA = ("padded_vocab_size", "max_sequence_length", "rotary_base", "tied", "vocab_size")


def build(m: dict, grouped: bool = False):
    """megatron-core's GPTModel (local spec) for a "model" dict, in eval mode; `grouped`: its MoE experts as the
    local spec's legacy grouped-GEMM GroupedMLP (see grouped_experts) instead of SequentialMLP."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    tc_fields = {k: v for k, v in m.items() if k not in MODEL_EXTRA}
    experts = tc_fields.get("num_moe_experts")
    tc = TransformerConfig(gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm",
                           use_cpu_initialization=True, params_dtype=torch.float32, hidden_dropout=0.0,
                           attention_dropout=0.0, bias_activation_fusion=False, bias_dropout_fusion=False,
                           masked_softmax_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
                           moe_token_dispatcher_type="allgather", **tc_fields)
    # (megatron-core 0.19 has no legacy grouped GEMM and no such keyword: only named where it is used)
    spec = get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=grouped, normalization="RMSNorm",
                                    qk_layernorm=bool(tc_fields.get("qk_layernorm")),
                                    **({"moe_use_legacy_grouped_gemm": True} if grouped else {}))
    model = GPTModel(tc, spec, vocab_size=m["padded_vocab_size"], max_sequence_length=m["max_sequence_length"],
                     position_embedding_type="rope", rotary_base=m["rotary_base"],
                     share_embeddings_and_output_weights=m["tied"])
    return model.eval()


@torch.no_grad()
def randomize(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=g)
        p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.08 * noise)


@torch.no_grad()
def logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    b, s = input_ids.shape
    position_ids = torch.arange(s)[None, :].expand(b, -1)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None]
    return model(input_ids, position_ids, mask).float()


def sharded_tensors(sharded: dict) -> list:
    """The ShardedTensors of a (nested) sharded state dict, factories (e.g. linear_fc1's [gate; up] split) built."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    items = []
    for v in nested_values(sharded):
        if isinstance(v, ShardedTensorFactory):
            built = v.build()
            items += list(nested_values(built)) if isinstance(built, (dict, list)) else [built]
        else:
            items.append(v)
    return [t for t in items if isinstance(t, ShardedTensor)]


def gather(sharded: dict) -> dict[str, torch.Tensor]:
    """Global tensors by key, assembled from the ShardedTensors of a (nested) sharded state dict."""
    out: dict[str, torch.Tensor] = {}
    for t in sharded_tensors(sharded):
        g = out.setdefault(t.key, torch.full(t.global_shape, float("nan"), dtype=t.data.dtype))
        data = t.data.detach().reshape((1,) * t.prepend_axis_num + tuple(t.local_shape))
        g[tuple(slice(o, o + s) for o, s in zip(t.global_offset, data.shape))] = data
    return out


def across_ranks(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """gather()'s global tensors completed from every rank's (each fills what it holds, e.g. its experts under EP)."""
    if torch.distributed.get_world_size() == 1:
        return tensors
    every: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, tensors)
    out = {}
    for k in tensors:
        t = every[0][k].clone()
        for other in every[1:]:
            t = torch.where(torch.isnan(t), other[k], t)
        out[k] = t
    return out


def global_tensors(model) -> dict[str, torch.Tensor]:
    """The model's tensors as global tensors by sharded key, from its own sharded_state_dict() (every rank's)."""
    return across_ranks(gather(model.sharded_state_dict()))


def megatron_lm_args(m: dict) -> argparse.Namespace:
    """The few Megatron-LM args a torch_dist checkpoint's common.pt carries here."""
    return argparse.Namespace(num_layers=m["num_layers"], hidden_size=m["hidden_size"], tensor_model_parallel_size=1,
                              pipeline_model_parallel_size=1, padded_vocab_size=m["padded_vocab_size"],
                              params_dtype=torch.float32)


def write_latest(root: str, iteration: int) -> None:
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(iteration))


# -- names -----------------------------------------------------------------------------------------------------------

def names(job: dict) -> dict[str, list[int]]:
    return {t.key: list(t.global_shape) for t in sharded_tensors(build(job["model"]).sharded_state_dict())}


def grouped_experts(job: dict) -> dict:
    """{"model", "ckpt"}: the MoE GPTModel with the local spec's grouped-GEMM experts (GroupedMLP: every local
    expert's fc1 in one `weight1` [hidden, experts x 2 ffn], fc2 in `weight2` [experts x ffn, hidden]); the
    grouped_gemm kernels are not installed on CPU, so it is built and loaded (dist_checkpointing.load of "ckpt") but
    runs no forward. Result: "names" (its sharded keys and global shapes) and, per rank, each layer's weight1 and
    weight2 as loaded ("weights": [{"L.weight1": ..., "L.weight2": ...} for each rank])."""
    from megatron.core import dist_checkpointing
    from megatron.core.transformer.moe import grouped_gemm_util

    grouped_gemm_util.assert_grouped_gemm_is_available = lambda: None  # built and loaded only, never run
    model = build(job["model"], grouped=True)
    out = {"names": {t.key: list(t.global_shape) for t in sharded_tensors(model.sharded_state_dict())}}
    state = dist_checkpointing.load({"model": model.sharded_state_dict()}, job["ckpt"])
    model.load_state_dict(state["model"], strict=True)
    mine = {f"{i}.{w}": getattr(layer.mlp.experts, w).detach().clone()
            for i, layer in enumerate(model.decoder.layers) for w in ("weight1", "weight2")}
    every: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, mine)
    out["weights"] = every
    return out


# -- data ------------------------------------------------------------------------------------------------------------

class _Tokenizer:
    """The few attributes GPTDatasetConfig and GPTDataset read (no tokenization happens when reading .bin files)."""

    vocab_size = None
    eod = 2
    pad = -1
    unique_identifiers = {"class": "oracle"}


def dataset_config(data: dict, **more):
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
    from megatron.core.datasets.utils import get_blend_from_list

    return GPTDatasetConfig(random_seed=data["seed"], sequence_length=data["seq_length"],
                            blend=get_blend_from_list(data["blend"]), split=data["split"], path_to_cache=data["cache"],
                            tokenizer=_Tokenizer(), reset_position_ids=False, reset_attention_mask=False,
                            eod_mask_loss=False, mmap_bin_files=True, **more)


def data(job: dict) -> list:
    """For each split, every sample's tokens (int lists) in order, and for plain GPTDatasets the document/sample/
    shuffle indices; None for a split that was not built."""
    from megatron.core.datasets.blended_dataset import BlendedDataset
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset

    out = []
    for ds in BlendedMegatronDatasetBuilder(GPTDataset, job["sizes"], lambda: True, dataset_config(job)).build():
        if ds is None:
            out.append(None)
            continue
        entry: dict = {}
        if isinstance(ds, BlendedDataset):
            samples = [ds.datasets[int(d)]._query_document_sample_shuffle_indices(int(s))[0].tolist()
                       for d, s in zip(ds.dataset_index, ds.dataset_sample_index)]
            entry["dataset_index"] = ds.dataset_index.tolist()
        else:
            samples = [ds._query_document_sample_shuffle_indices(i)[0].tolist() for i in range(len(ds))]
            entry.update(document_index=ds.document_index.tolist(), sample_index=ds.sample_index.tolist(),
                         shuffle_index=ds.shuffle_index.tolist())
        entry["samples"] = samples
        out.append(entry)
    return out


# -- schedule --------------------------------------------------------------------------------------------------------
# "args": Megatron-LM argument names -> values; "resume": null or {"after": K, "args": {...}, "mode": "default" |
# "override" | "use_checkpoint"}. The scheduler's arguments come from "args" as Megatron-LM's arguments.py (start/end
# weight decay for the constant style) and training.py `get_optimizer_param_scheduler` (steps in samples: iterations x
# global batch, or the --*-samples values) derive them, over a torch.optim.SGD on one tensor. Per iteration the LR and
# weight decay that the optimizer step applies are recorded (param group 0, wd_mult 1), then the scheduler advances by
# the global batch, as Megatron-LM's train_step does. With "resume", after K iterations the state_dict goes through
# JSON, a scheduler is built from the resume args (with --override-opt_param-scheduler or
# --use-checkpoint-opt_param-scheduler per "mode"), load_state_dict runs (an AssertionError there is recorded as
# "refused") and the run goes on to the resume args' length. Result: {"iters": N, "lr": [...], "wd": [...],
# "refused": str | null, "resumed": {"lr": [...], "wd": [...]}, "state_dict": {...} (with "resume": the state saved
# after K iterations)}.

SCHEDULE_DEFAULTS = {"train_iters": None, "train_samples": None, "lr_warmup_iters": 0, "lr_warmup_samples": 0,
                     "lr_warmup_fraction": None, "lr_warmup_init": 0.0, "lr_decay_iters": None,
                     "lr_decay_samples": None, "lr_decay_style": "linear", "lr_wsd_decay_style": "exponential",
                     "lr_wsd_decay_iters": None, "lr_wsd_decay_samples": None, "min_lr": 0.0,
                     "start_weight_decay": None, "end_weight_decay": None, "weight_decay_incr_style": "constant",
                     "weight_decay": 0.01}


def scheduler(optimizer, given: dict, mode: str = "default"):
    """OptimizerParamScheduler as Megatron-LM's arguments.py and training.py get_optimizer_param_scheduler build it
    from its arguments; with its iterations and global batch."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    a = dict(SCHEDULE_DEFAULTS, **given)
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


def _step_schedule(sched, optimizer, gbs: int, start: int, stop: int, out: dict) -> None:
    for _ in range(start, stop):
        group = optimizer.param_groups[0]
        out["lr"].append(group["lr"])
        out["wd"].append(group["weight_decay"])
        sched.step(increment=gbs)


def schedule(case: dict) -> dict:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.0)
    sched, iters, gbs = scheduler(optimizer, case["args"])
    res = {"iters": iters, "lr": [], "wd": [], "refused": None, "resumed": None}
    resume = case.get("resume")
    _step_schedule(sched, optimizer, gbs, 0, resume["after"] if resume else iters, res)
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
            _step_schedule(new, optimizer, new_gbs, resume["after"], new_iters, res["resumed"])
    return res


# -- legacy ----------------------------------------------------------------------------------------------------------
# The model (tp = pp = 1), randomised, saved the way Megatron-LM's `save_checkpoint` does with `--ckpt-format torch`:
# <root>/iter_N/mp_rank_00/model_optim_rng.pt holding the module state dict under "model", the run's `args` (an
# argparse.Namespace with Megatron's own enums in it, as Megatron-LM's arguments have them), iteration,
# checkpoint_version, RNG state (numpy and torch), optimizer, scheduler and rerun-state-machine state, and
# latest_checkpointed_iteration.txt. Result: its logits on `input_ids` and its state dict as plain tensors (for the
# tests to split into other layouts with their own implementation of the partition rules).

def legacy_args(m: dict, iteration: int) -> argparse.Namespace:
    """The argparse.Namespace Megatron-LM saves (the fields that describe the model and the run), with the enum
    values Megatron-LM's own argument parsing puts there."""
    from megatron.core.enums import ModelType
    from megatron.core.transformer.enums import AttnBackend

    experts = m.get("num_moe_experts")
    return argparse.Namespace(
        num_layers=m["num_layers"], hidden_size=m["hidden_size"], ffn_hidden_size=m["ffn_hidden_size"],
        num_attention_heads=m["num_attention_heads"], num_query_groups=m["num_query_groups"],
        group_query_attention=m["num_query_groups"] != m["num_attention_heads"], kv_channels=m["kv_channels"],
        max_position_embeddings=m["max_sequence_length"], seq_length=m["max_sequence_length"],
        position_embedding_type="rope", rotary_base=int(m["rotary_base"]), rotary_percent=1.0,
        rotary_interleaved=False, use_rope_scaling=False, rope_scaling_factor=8.0,
        rotary_seq_len_interpolation_factor=None, normalization="RMSNorm", norm_epsilon=m["layernorm_epsilon"],
        swiglu=True, apply_layernorm_1p=False, qk_layernorm=False, untie_embeddings_and_output_weights=not m["tied"],
        add_bias_linear=False, add_qkv_bias=False, padded_vocab_size=m["padded_vocab_size"], vocab_size=None,
        make_vocab_size_divisible_by=128, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None, expert_model_parallel_size=1, expert_tensor_parallel_size=1,
        num_experts=experts, moe_router_topk=m.get("moe_router_topk", 2),
        moe_ffn_hidden_size=m.get("moe_ffn_hidden_size"),
        moe_layer_freq=1, moe_router_score_function="softmax", moe_router_pre_softmax=False,
        moe_router_topk_scaling_factor=None, moe_router_num_groups=None, moe_router_enable_expert_bias=False,
        moe_shared_expert_intermediate_size=None, moe_aux_loss_coeff=0.0, moe_grouped_gemm=False,
        multi_latent_attention=False, mtp_num_layers=None, window_size=None,
        params_dtype=torch.float32, bf16=False, fp16=False, transformer_impl="local", ckpt_format="torch",
        model_type=ModelType.encoder_or_decoder, attention_backend=AttnBackend.auto, exit_signal=signal.SIGTERM,
        iteration=iteration, consumed_train_samples=iteration * 8, lr=3e-4, seed=1234,
    )


def save_legacy(model, m: dict, root: str, iteration: int) -> None:
    from megatron.core.rerun_state_machine import RerunMode, RerunState

    model_sd = model.state_dict()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # populate exp_avg / exp_avg_sq (zero grads keep the weights as they are)
    opt.zero_grad(set_to_none=True)
    assert all(torch.equal(model_sd[k], v) for k, v in model.state_dict().items() if isinstance(v, torch.Tensor))
    state = {
        "args": legacy_args(m, iteration),
        "checkpoint_version": 3.0,
        "iteration": iteration,
        "model": model_sd,
        "optimizer": {"optimizer": opt.state_dict(), "grad_scaler": None},
        "opt_param_scheduler": {"max_lr": 3e-4, "min_lr": 3e-5, "lr_warmup_steps": 10, "num_steps": iteration * 8,
                                "lr_decay_steps": 1000, "lr_decay_style": "cosine"},
        "rng_state": [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
                       "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": torch.get_rng_state(),
                       "rng_tracker_states": {"model-parallel-rng": torch.get_rng_state()}}],
        "rerun_state_machine": {"mode": RerunMode.DISABLED, "state": RerunState.NOT_RUNNING_YET,
                                "current_iteration": iteration},
        "num_floating_point_operations_so_far": 1.5e12,
    }
    d = os.path.join(root, f"iter_{iteration:07d}", "mp_rank_00")
    os.makedirs(d)
    torch.save(state, os.path.join(d, "model_optim_rng.pt"))
    write_latest(root, iteration)


def legacy(job: dict) -> dict:
    m = job["model"]
    model = build(m)
    randomize(model, job["seed"])
    out_logits = logits(model, torch.load(job["input_ids"]))
    save_legacy(model, m, job["root"], job["iteration"])
    plain = {k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    return {"logits": out_logits, "state_dict": plain}


# -- torch_dist ------------------------------------------------------------------------------------------------------
# load: dist_checkpointing.load() the checkpoint into the model; save: a randomly initialised model saved with
# dist_checkpointing.save() as Megatron-LM lays it out (<root>/iter_N + latest_checkpointed_iteration.txt, common.pt
# with iteration/args). Result: the model's tensors (global, by sharded key) and its logits.

def args_transformer_config(args: argparse.Namespace) -> dict:
    """A TransformerConfig built from a checkpoint's Megatron-LM args the way Megatron-Bridge's reader does
    (mlm_compat/arguments.py `_transformer_config_from_args`, after Megatron-LM's `core_transformer_config_from_args`:
    every TransformerConfig field the namespace has, then its fix-ups), which fails on a namespace missing any
    attribute it reads. `apply_rope_fusion` is turned off: it needs Transformer Engine, which this CPU has not."""
    import dataclasses

    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnBackend

    kw = {f.name: getattr(args, f.name) for f in dataclasses.fields(TransformerConfig) if hasattr(args, f.name)}
    kw.update(persist_layer_norm=not args.no_persist_layer_norm, deallocate_pipeline_outputs=True,
              pipeline_dtype=args.params_dtype, batch_p2p_comm=not args.overlap_p2p_comm,
              num_moe_experts=args.num_experts, rotary_interleaved=args.rotary_interleaved,
              num_layers_in_first_pipeline_stage=args.decoder_first_pipeline_num_layers,
              num_layers_in_last_pipeline_stage=args.decoder_last_pipeline_num_layers, fp8_param=args.fp8_param_gather,
              config_logger_dir=args.config_logger_dir, apply_rope_fusion=False,
              num_query_groups=args.num_query_groups if args.group_query_attention else None)
    if args.swiglu:
        kw.update(activation_func=F.silu, gated_linear_unit=True, bias_activation_fusion=args.bias_swiglu_fusion)
    if args.rope_type is None:
        kw.pop("rope_type", None)
    if len(args.cp_comm_type) == 1:
        kw["cp_comm_type"] = args.cp_comm_type[0]
    if args.heterogeneous_layers_config_path is not None or args.multi_latent_attention:
        raise ValueError("not a plain TransformerConfig")
    tc = TransformerConfig(**kw)
    return {"attention_backend_is_enum": isinstance(args.attention_backend, AttnBackend),
            **{k: getattr(tc, k) for k in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                                           "num_query_groups", "kv_channels", "layernorm_epsilon", "normalization",
                                           "gated_linear_unit", "add_bias_linear", "add_qkv_bias",
                                           "num_moe_experts", "moe_router_topk", "tensor_model_parallel_size",
                                           "pipeline_model_parallel_size", "expert_model_parallel_size")}}


def torch_dist(job: dict) -> dict:
    from megatron.core import dist_checkpointing

    model = build(job["model"])
    ids = torch.load(job["input_ids"])
    extra = {}
    if job["mode"] == "load":
        # as Megatron-LM does: the model's sharded state dict under "model", common.pt's entries merged around it
        state = dist_checkpointing.load({"model": model.sharded_state_dict()}, job["ckpt"])
        model.load_state_dict(state["model"], strict=True)
        if job.get("args_config"):  # read common.pt's args as Megatron-Bridge's reader does
            try:
                extra["args_config"] = args_transformer_config(dist_checkpointing.load_common_state_dict(
                    job["ckpt"])["args"])
            except Exception as e:  # recorded: the test names it
                extra["args_config"] = {"error": f"{type(e).__name__}: {e}"}
    elif job["mode"] == "save":
        randomize(model, job["seed"])
        it = job["iteration"]
        d = os.path.join(job["root"], f"iter_{it:07d}")
        os.makedirs(d)
        dist_checkpointing.save({"model": model.sharded_state_dict(), "iteration": it, "checkpoint_version": 3.0,
                                 "args": megatron_lm_args(job["model"])}, d)
        write_latest(job["root"], it)
    else:
        raise ValueError(job["mode"])
    return {"tensors": global_tensors(model), "logits": logits(model, ids), **extra}


# -- optimizer -------------------------------------------------------------------------------------------------------
# save: train K steps with DistributedDataParallel + DistributedOptimizer, save torch_dist WITH the optimizer state
# (<root>/iter_N + latest_checkpointed_iteration.txt); load: the same model, DDP and optimizer load a torch_dist
# checkpoint with its optimizer state the way Megatron-LM does (dist_checkpointing.load, then model/optimizer
# load_state_dict), and one more step must run. Result: {"tensors": model tensors by key, "optimizer": {state: {key:
# global tensor}}, "fs_model_space_error": str, "param_groups": [...]}: the optimizer state as megatron-core's own
# sharded state dict holds it. The `fully_sharded_model_space` sharding type cannot be saved by megatron-core 0.16 at
# all (it raises "ShardedTensor.flattened_range is not supported."), so the checkpoint uses `fully_reshardable`, the
# model-space format 0.16 saves and loads.

# Megatron-LM's (training/checkpointing.py _build_sharded_state_dict_metadata): a MoE model's chained optimizer (dense +
# expert) keeps the same `optimizer.state.<state>.<key>` names, without a `chained_N.` prefix
OPTIMIZER_META = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True}


def _ddp_and_optimizer(job: dict):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    model = build(job["model"]).train()
    randomize(model, job.get("seed", 0))
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
        use_distributed_optimizer=True, grad_reduce_in_fp32=True, overlap_grad_reduce=False), model)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.01, bf16=False,
                                                 params_dtype=torch.float32, use_distributed_optimizer=True), [ddp])
    return model, ddp, opt


def _random_steps(job: dict, ddp, opt, steps: int, seed: int) -> None:
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


def _optimizer_state(model, opt) -> dict:
    optimizer = {}
    sharded = opt.sharded_state_dict(model.sharded_state_dict(metadata=OPTIMIZER_META), metadata=OPTIMIZER_META)
    for key, t in across_ranks(gather(sharded)).items():
        _, _, state, *rest = key.split(".", 3)
        optimizer.setdefault(state, {})[rest[0]] = t
    return optimizer


def optimizer(job: dict) -> dict:
    from megatron.core import dist_checkpointing

    model, ddp, opt = _ddp_and_optimizer(job)
    if job["mode"] == "load":
        # torch's Adam (no Apex/TE here) has no state before its first step, and megatron-core's state_dict() needs
        # one: take a throwaway step first; everything it changed is overwritten by the load below
        _random_steps(job, ddp, opt, 1, 99)
        # as Megatron-LM's load_checkpoint: the sharded state dicts built with the checkpoint's own content metadata
        # (sharding type, chained_optim_avoid_prefix, ...)
        meta = dist_checkpointing.load_content_metadata(job["ckpt"]) or OPTIMIZER_META
        model_sd = model.sharded_state_dict(metadata=meta)
        opt_sd = opt.sharded_state_dict(model_sd, is_loading=True, metadata=meta)
        state = dist_checkpointing.load({"model": model_sd, "optimizer": opt_sd}, job["ckpt"])
        model.load_state_dict(state["model"], strict=True)
        opt.load_state_dict(state["optimizer"])
        loaded = state["optimizer"]  # a MoE model's ChainedOptimizer: {0: dense, 1: expert}
        parts = [loaded[k] for k in sorted(loaded)] if 0 in loaded else [loaded]
        out = {"tensors": global_tensors(model), "optimizer": _optimizer_state(model, opt),
               "param_groups": [g for part in parts for g in part["optimizer"]["param_groups"]]}
        _random_steps(job, ddp, opt, 1, 0)  # the restored state trains on
        return out
    _random_steps(job, ddp, opt, job["steps"], job["seed"])
    fs_error = ""
    try:  # megatron-core 0.16 cannot build this (deprecated) sharding type; record what it says
        opt.sharded_state_dict(model.sharded_state_dict(),
                               metadata={"distrib_optim_sharding_type": "fully_sharded_model_space"})
    except Exception as e:  # noqa: BLE001 - recorded for the report
        fs_error = f"{type(e).__name__}: {e}"
    it = job["iteration"]
    d = os.path.join(job["root"], f"iter_{it:07d}")
    os.makedirs(d)
    model_sd = model.sharded_state_dict(metadata=OPTIMIZER_META)  # Megatron-LM saves the unwrapped model's keys
    opt_sd = opt.sharded_state_dict(model_sd, metadata=OPTIMIZER_META)
    dist_checkpointing.save({"model": model_sd, "optimizer": opt_sd, "iteration": it, "checkpoint_version": 3.0,
                             "args": megatron_lm_args(job["model"]),
                             "opt_param_scheduler": {"num_steps": job["steps"]}}, d, content_metadata=OPTIMIZER_META)
    write_latest(job["root"], it)
    return {"tensors": global_tensors(model), "optimizer": _optimizer_state(model, opt),
            "fs_model_space_error": fs_error}


# -- train -----------------------------------------------------------------------------------------------------------
# "ckpt": torch_dist ITER_DIR; "data": {"blend", "split", "seed", "seq_length", "cache"}; "train": {"train_iters",
# "micro_batch_size", "global_batch_size", "lr", "min_lr", "lr_warmup_init", "lr_warmup_iters", "lr_decay_iters" (null:
# train_iters), "lr_decay_style", "weight_decay", "clip_grad", "adam_beta1", "adam_beta2", "adam_eps",
# "use_distributed_optimizer"}.
# Every piece is megatron-core's own: GPTModel loaded from the checkpoint with dist_checkpointing,
# BlendedMegatronDatasetBuilder(GPTDataset), DistributedDataParallel, get_megatron_optimizer with Megatron-LM's
# standard config overrides (no weight decay for biases and 1-D parameters), OptimizerParamScheduler built as
# Megatron-LM's training.py get_optimizer_param_scheduler builds it, and get_forward_backward_func()'s schedule with
# pretrain_gpt.py's forward_step/loss_func. Each iteration is Megatron-LM's train_step: zero_grad_buffer,
# optimizer.zero_grad, forward and backward over the micro-batches (loss sum / tokens / micro-batches,
# finalize_model_grads), optimizer.step() (clipping inside), then opt_param_scheduler.step(increment=micro-batches x
# micro batch x DP).
# Result, per iteration: "loss" (Megatron-LM's reported lm loss: sum of token losses / tokens over the global batch),
# "grad_norm" (before clipping, as optimizer.step() returns it), "lr" and "wd" (each param group's values the step was
# taken with, i.e. before the scheduler advanced; Megatron-LM's log line shows the value after), "tokens" (each
# micro-batch's [mbs, seq + 1] token ids: the sample's tokens followed by its last label).

def train_dataset(data: dict, train_samples: int):
    """Megatron-LM's train split: BlendedMegatronDatasetBuilder(GPTDataset). The run evaluates nothing; the valid and
    test splits are built at their natural size (None: one epoch; a size of 0 never terminates in GPTDataset's epoch
    count), which does not change the train split."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset

    cfg = dataset_config(data, create_attention_mask=True)
    train, _, _ = BlendedMegatronDatasetBuilder(GPTDataset, [train_samples, None, None], lambda: True, cfg).build()
    return train


def micro_batches(dataset, micro_batch_size: int, seen: list, dp: int = 1, dp_rank: int = 0):
    """Megatron-LM's MegatronPretrainingSampler from consumed samples 0 (consecutive indices, micro_batch_size x dp at
    a time, of which DP rank r takes the r-th micro_batch_size; the last partial batch dropped) and the DataLoader's
    default collate. Each batch's token ids are appended to `seen`."""
    step = micro_batch_size * dp
    for start in range(dp_rank * micro_batch_size, len(dataset) - step + 1 + dp_rank * micro_batch_size, step):
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


def train(job: dict) -> dict:
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
    opt = get_megatron_optimizer(ocfg, [ddp], config_overrides=get_standard_config_overrides(ocfg))
    sched = optimizer_param_scheduler(opt, t)
    config = model.config  # what Megatron-LM's train() sets on the model config before the loop
    config.grad_scale_func = opt.scale_loss
    config.finalize_model_grads_func = finalize_model_grads
    forward_backward = get_forward_backward_func()

    from megatron.core import parallel_state

    mbs, gbs = t["micro_batch_size"], t["global_batch_size"]
    dp = parallel_state.get_data_parallel_world_size()  # TP = PP = 1: every rank is a DP rank (EP inside DP)
    num_micro = gbs // (mbs * dp)
    seen: list = []
    batches = micro_batches(train_dataset(job["data"], t["train_iters"] * gbs), mbs, seen, dp,
                            parallel_state.get_data_parallel_rank())
    out = {"loss": [], "grad_norm": [], "lr": [], "wd": [], "tokens": [], "params": [], "num_micro": num_micro}
    for _ in range(t["train_iters"]):
        first = len(seen)
        ddp.zero_grad_buffer()
        opt.zero_grad()
        losses_reduced = forward_backward(forward_step_func=forward_step, data_iterator=batches, model=[ddp],
                                          num_microbatches=num_micro, seq_length=job["data"]["seq_length"],
                                          micro_batch_size=mbs, decoder_seq_length=None, forward_only=False)
        groups = opt.param_groups
        out["lr"].append([g["lr"] for g in groups])
        out["wd"].append([g["weight_decay"] for g in groups])
        out["params"].append([len(g["params"]) for g in groups])
        ok, grad_norm, _ = opt.step()
        if not ok:
            raise RuntimeError("megatron-core's optimizer skipped a step (fp32: it never should)")
        sched.step(increment=num_micro * mbs * dp)
        val = torch.vstack([x["lm loss"].view(-1) for x in losses_reduced]).sum(dim=0)
        torch.distributed.all_reduce(val, group=parallel_state.get_data_parallel_group())  # Megatron-LM's report
        out["loss"].append(float(val[0] / val[1]))
        out["grad_norm"].append(float(grad_norm))
        out["tokens"].append(seen[first:])
        if job.get("save") and len(out["loss"]) == job["save"]["at"]:
            save_training(job, model, opt, sched, len(out["loss"]), len(out["loss"]) * gbs)
    if job.get("final_tensors"):  # the weights and the optimizer state after the last iteration (a .pt "out")
        out["tensors"] = global_tensors(model)
        out["optimizer"] = _optimizer_state(model, opt)
    return out


def save_training(job: dict, model, opt, sched, iteration: int, consumed: int) -> None:
    """Megatron-LM's training save in torch_dist at `iteration` (job "save": {"root", "at"}): the model, the
    distributed optimizer's state (fully_reshardable) and common.pt's iteration, args (with the consumed samples),
    the scheduler's state_dict and the optimizer's param groups, then the tracker file."""
    from megatron.core import dist_checkpointing

    d = os.path.join(job["save"]["root"], f"iter_{iteration:07d}")
    os.makedirs(d, exist_ok=True)  # every rank
    args = megatron_lm_args(job["model"])
    args.consumed_train_samples = consumed
    args.expert_model_parallel_size = job.get("ep", 1)
    model_sd = model.sharded_state_dict(metadata=OPTIMIZER_META)
    opt_sd = opt.sharded_state_dict(model_sd, metadata=OPTIMIZER_META)
    dist_checkpointing.save({"model": model_sd, "optimizer": opt_sd, "iteration": iteration,
                             "checkpoint_version": 3.0, "args": args, "opt_param_scheduler": sched.state_dict()}, d,
                            content_metadata=OPTIMIZER_META)
    if torch.distributed.get_rank() == 0:
        write_latest(job["save"]["root"], iteration)


# -- main ------------------------------------------------------------------------------------------------------------

def pipeline_split(job: dict) -> dict:
    """megatron-core's decoder layers per model chunk for an (uneven) pipeline split: for each pipeline rank and
    virtual stage, get_num_layers_to_build and get_transformer_layer_offset (or, for a layout string, the
    PipelineParallelLayerLayout's own counts and offsets), in chunk order c = vstage * pp + pp_rank; or the reason
    TransformerConfig refuses the split."""
    from megatron.core import parallel_state
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    pp, vpp = job["pp"], job["vpp"]
    try:
        cfg = TransformerConfig(num_layers=job["num_layers"], hidden_size=64, num_attention_heads=4,
                                pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32,
                                virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
                                num_layers_in_first_pipeline_stage=job.get("first"),
                                num_layers_in_last_pipeline_stage=job.get("last"),
                                account_for_embedding_in_pipeline_split=job.get("embedding", False),
                                account_for_loss_in_pipeline_split=job.get("loss", False),
                                pipeline_model_parallel_layout=job.get("layout"),
                                mtp_num_layers=job.get("mtp") or None)
        parallel_state.set_virtual_pipeline_model_parallel_world_size(vpp if vpp > 1 else None)
        counts, offsets = [], []
        for c in range(pp * vpp):
            rank, v = c % pp, c // pp
            vs = v if vpp > 1 else None
            lay = cfg.pipeline_model_parallel_layout
            if lay is not None:
                counts.append(lay.get_num_layers_to_build(LayerType.decoder, vp_stage=vs, pp_rank=rank))
                offsets.append(lay.get_layer_offset(LayerType.decoder, vp_stage=vs, pp_rank=rank))
            else:
                counts.append(get_num_layers_to_build(cfg, vp_stage=vs, pp_rank=rank))
                offsets.append(get_transformer_layer_offset(cfg, vp_stage=vs, pp_rank=rank))
        return {"ok": True, "counts": counts, "offsets": offsets}
    except (AssertionError, ValueError) as e:
        return {"ok": False, "error": str(e)}
    finally:
        parallel_state.set_virtual_pipeline_model_parallel_world_size(None)


# -- regions ---------------------------------------------------------------------------------------------------------
# {"model": TransformerConfig fields (MLA fields make it an MLATransformerConfig) + padded_vocab_size,
# max_sequence_length, tied; "tp", "pp", "vpp", "ep"}: megatron-core's own GPTModel built for every pipeline rank,
# virtual stage, TP rank and EP rank the way Megatron-LM's pretrain_gpt.py model_provider builds it (the decoder block
# spec sliced for that stage by get_gpt_decoder_block_spec, the MTP block spec by get_gpt_mtp_block_spec, pre/post
# process on the first/last model chunk), each from a parallel state faked for that rank: the process groups the model
# reads (tp, pp, ep, expt_tp, tp_ep) are stand-ins with that rank and size, and parallel_state's MPU overrides say the
# same. Nothing communicates while a model is built or asked for its sharded_state_dict(), so one process does them
# all. Result: one entry per (pp_rank, vstage, tp, ep): the ShardedTensors as [key, global_shape, global_offset,
# shape (prepended axes as 1), primary (replica_id all 0)]. MLA's local spec needs Transformer Engine for two things
# that hold no parameters: its core attention (a parameterless stand-in here) and an isinstance check against TE's
# TELinear (a class nothing is an instance of).

class _FakeGroup:
    """A process group as model construction and sharded_state_dict() read it: its size and this rank's place."""

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


class _NoCoreAttention(torch.nn.Module):
    """MLA's core attention without Transformer Engine: no parameters, never run (only the state dict is asked)."""

    def __init__(self, *a, **k) -> None:
        super().__init__()


_REAL_GROUPS = None


def _fake_groups(tp: int, pp: int, ep: int, tp_rank: int, pp_rank: int, ep_rank: int):
    """The process groups of one rank as stand-ins (see _FakeGroup), also what ProcessGroupCollection's default
    (use_mpu_process_groups) gives to modules built without them; parallel_state's MPU overrides say the same."""
    global _REAL_GROUPS
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    ps.set_tensor_model_parallel_world_size(tp)
    ps.set_tensor_model_parallel_rank(tp_rank)
    ps.set_expert_model_parallel_world_size(ep)
    ps.set_expert_model_parallel_rank(ep_rank)
    ps.set_expert_tensor_parallel_world_size(tp)
    ps.set_expert_tensor_parallel_rank(tp_rank)
    if _REAL_GROUPS is None:
        _REAL_GROUPS = ProcessGroupCollection.use_mpu_process_groups
    groups = _REAL_GROUPS()
    groups.tp, groups.pp = _FakeGroup(tp, tp_rank), _FakeGroup(pp, pp_rank)
    groups.ep, groups.expt_tp = _FakeGroup(ep, ep_rank), _FakeGroup(tp, tp_rank)
    groups.tp_ep = _FakeGroup(tp * ep, ep_rank * tp + tp_rank)
    groups.embd = groups.pos_embd = None  # nothing to all-reduce at build time
    ProcessGroupCollection.use_mpu_process_groups = classmethod(lambda cls, *a, **k: groups)
    return groups


def _reset_parallel_state() -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    if _REAL_GROUPS is not None:
        ProcessGroupCollection.use_mpu_process_groups = _REAL_GROUPS
    for setter in ("pipeline_model_parallel_world_size", "pipeline_model_parallel_rank",
                   "virtual_pipeline_model_parallel_world_size", "tensor_model_parallel_world_size",
                   "tensor_model_parallel_rank", "expert_model_parallel_world_size", "expert_model_parallel_rank",
                   "expert_tensor_parallel_world_size", "expert_tensor_parallel_rank"):
        getattr(ps, "set_" + setter)(None)


def _stage_model(m: dict, pp: int, vpp: int, rank: int, vstage, groups):
    """GPTModel of one model chunk, as pretrain_gpt.py's model_provider builds it (local spec), on `groups`."""
    import megatron.core.transformer.multi_latent_attention as mla
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_decoder_block_spec, get_gpt_decoder_layer_specs,
                                                          get_gpt_mtp_block_spec)
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    for name in ("TELinear", "TEColumnParallelLinear"):  # TE absent: a stand-in, or a class nothing is an instance of
        if not isinstance(getattr(mla, name), type):
            setattr(mla, name, type(f"No{name}", (), {}))
    fields = {k: v for k, v in m.items() if k not in MODEL_EXTRA}
    is_mla = bool(fields.get("multi_latent_attention"))
    cls = MLATransformerConfig if is_mla else TransformerConfig
    tc = cls(gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm", use_cpu_initialization=True,
             params_dtype=torch.float32, pipeline_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0,
             bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
             apply_rope_fusion=False, persist_layer_norm=False, moe_token_dispatcher_type="allgather",
             pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
             **fields)
    layer_specs = get_gpt_decoder_layer_specs(tc, False, "RMSNorm")
    block = get_gpt_decoder_block_spec(tc, use_transformer_engine=False, normalization="RMSNorm", vp_stage=vstage,
                                       pp_rank=rank)
    mtp = None
    if tc.mtp_num_layers:
        mtp = get_gpt_mtp_block_spec(tc, layer_specs[-1], use_transformer_engine=False, vp_stage=vstage, pp_rank=rank)
    if is_mla:
        for spec in [*block.layer_specs, layer_specs[-1]]:
            spec.submodules.self_attention.submodules.core_attention = _NoCoreAttention
    first = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vstage)
    last = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vstage)
    return GPTModel(tc, block, vocab_size=m["padded_vocab_size"], max_sequence_length=m["max_sequence_length"],
                    position_embedding_type="rope", rotary_base=m.get("rotary_base", 10000),
                    pre_process=first, post_process=last,
                    share_embeddings_and_output_weights=m["tied"], mtp_block_spec=mtp, vp_stage=vstage,
                    pg_collection=groups)


def regions(job: dict) -> list:
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

    tp, pp, vpp, ep = job["tp"], job["pp"], job["vpp"], job["ep"]
    torch.Tensor.cuda = lambda self, *a, **k: self  # the tied-embedding set-up moves a weight "to the GPU"
    out = []
    try:
        for rank in range(pp):
            for v in range(vpp):
                for t in range(tp):
                    for e in range(ep):
                        ps.set_pipeline_model_parallel_world_size(pp)
                        ps.set_pipeline_model_parallel_rank(rank)
                        ps.set_virtual_pipeline_model_parallel_world_size(vpp if vpp > 1 else None)
                        groups = _fake_groups(tp, pp, ep, t, rank, e)
                        model = _stage_model(job["model"], pp, vpp, rank, v if vpp > 1 else None, groups)
                        sd = model.sharded_state_dict(metadata=ensure_metadata_has_dp_cp_group(None))
                        boxes = [[st.key, list(st.global_shape), list(st.global_offset),
                                  [1] * st.prepend_axis_num + list(st.local_shape),
                                  all(i == 0 for i in (st.replica_id if isinstance(st.replica_id, tuple)
                                                       else (st.replica_id,)))]
                                 for st in sharded_tensors(sd)]
                        out.append({"pp": rank, "vstage": v, "tp": t, "ep": e, "boxes": boxes})
    finally:
        _reset_parallel_state()
    return out


def legacy_stages(job: dict) -> dict:
    """{"root", "iteration", "model", "pp", "vpp"} (tp = ep = 1): a Megatron-LM `--ckpt-format torch` checkpoint of
    a pipeline with (uneven) stages, written as Megatron-LM's save_checkpoint writes one: each pipeline rank's file
    mp_rank_00_PPP/model_optim_rng.pt holds the state_dict() of the GPTModel of each of its model chunks ("model", or
    "model0", "model1", ... with virtual stages; layer numbers local to the chunk, as megatron-core's TransformerBlock
    numbers its layers) and the run's args with the split by Megatron-LM's names. Every chunk's weights are random
    (its own seed). Result: the global tensors by sharded key, assembled from every chunk's own sharded_state_dict()
    (megatron-core's global layer offsets), the truth the conversion is checked against."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

    m, pp, vpp, it = job["model"], job["pp"], job["vpp"], job["iteration"]
    args = legacy_args(m, it)
    args.pipeline_model_parallel_size = pp
    args.virtual_pipeline_model_parallel_size = vpp if vpp > 1 else None
    args.decoder_first_pipeline_num_layers = m.get("num_layers_in_first_pipeline_stage")
    args.decoder_last_pipeline_num_layers = m.get("num_layers_in_last_pipeline_stage")
    args.account_for_embedding_in_pipeline_split = bool(m.get("account_for_embedding_in_pipeline_split"))
    args.account_for_loss_in_pipeline_split = bool(m.get("account_for_loss_in_pipeline_split"))
    args.pipeline_model_parallel_layout = m.get("pipeline_model_parallel_layout")
    torch.Tensor.cuda = lambda self, *a, **k: self
    sharded = {}
    try:
        for rank in range(pp):
            ps.set_pipeline_model_parallel_world_size(pp)
            ps.set_pipeline_model_parallel_rank(rank)
            ps.set_virtual_pipeline_model_parallel_world_size(vpp if vpp > 1 else None)
            state = {"args": args, "checkpoint_version": 3.0, "iteration": it}
            for v in range(vpp):
                groups = _fake_groups(1, pp, 1, 0, rank, 0)
                model = _stage_model(m, pp, vpp, rank, v if vpp > 1 else None, groups)
                randomize(model, job["seed"] + v * pp + rank)
                state["model" if vpp == 1 else f"model{v}"] = model.state_dict()
                sharded[f"{rank}.{v}"] = model.sharded_state_dict(metadata=ensure_metadata_has_dp_cp_group(None))
            d = os.path.join(job["root"], f"iter_{it:07d}", f"mp_rank_00_{rank:03d}")
            os.makedirs(d)
            torch.save(state, os.path.join(d, "model_optim_rng.pt"))
    finally:
        _reset_parallel_state()
    write_latest(job["root"], it)
    return {"tensors": gather(sharded)}


# -- mtp -------------------------------------------------------------------------------------------------------------
# GPTModel with multi-token prediction as pretrain_gpt.py's model_provider builds it (_stage_model with one stage: the
# MTP block spec from the decoder's last layer spec), random weights, one training forward on fixed ids and labels,
# the loss taken as pretrain_gpt.py's loss_func takes it (the token mean; the MTP loss rides on the hidden states through
# MTPLossAutoScaler, main_loss_backward_scale 1), then backward. Result: "tensors" (global, by sharded key), "logits"
# [b, s, v] (the main head), "mtp_logits" one [b, s, v] per depth and "block" the MTP block's output chunks [b, s, h]
# (chunk 0 what the block read: the decoder output; chunk d + 1 depth d's output), both captured by hooks (the output
# layer runs once per depth, then for the main head); "mtp_losses" MTPLossLoggingHelper's tracker (each depth's mean
# cross-entropy), "loss" and "grads" (global, by sharded key).
# Packed documents ("cu_seqlens", batch 1, "loss_mask" file): megatron-core's packed_seq_params with those boundaries
# (format "sbhd": RoPE over positions 0..s-1), so that roll_tensor shifts ids, labels and the loss mask within each
# document; the local DotProductAttention refuses packed_seq_params (TE's kernel takes them on GPUs), so it gets the
# same documents as a dense causal-within-document mask and the packed_seq_params are not handed to it.

def _attention_without_packed_params() -> None:
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    orig = DotProductAttention.forward
    if getattr(orig, "drops_packed", False):
        return

    def forward(self, *a, packed_seq_params=None, **k):
        return orig(self, *a, **k)

    forward.drops_packed = True
    DotProductAttention.forward = forward


def mtp(job: dict) -> dict:
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    model = _stage_model(job["model"], 1, 1, 0, None, ProcessGroupCollection.use_mpu_process_groups())
    randomize(model, job["seed"])
    tensors = global_tensors(model)
    heads, block = [], []  # copies: the vocab-parallel cross-entropy works on the logits in place
    model.output_layer.register_forward_hook(lambda mod, a, out: heads.append(out[0].detach().transpose(0, 1).clone()))
    model.mtp.register_forward_hook(lambda mod, a, out: block.append(out.detach().clone()))
    ids, labels = torch.load(job["input_ids"]), torch.load(job["labels"])
    b, s = ids.shape
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None]
    packed, loss_mask = None, None
    if job.get("cu_seqlens") is not None:
        from megatron.core.packed_seq_params import PackedSeqParams

        assert b == 1, "packed documents: one row (megatron-core's packed batches are THD)"
        cu = torch.tensor(job["cu_seqlens"], dtype=torch.int32)
        packed = PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=s,
                                 max_seqlen_kv=s)
        docs = torch.repeat_interleave(torch.arange(len(cu) - 1), (cu[1:] - cu[:-1]).long())
        mask = mask | (docs[:, None] != docs[None, :])[None, None]
        _attention_without_packed_params()
        loss_mask = torch.load(job["loss_mask"]).float()
    MTPLossLoggingHelper.tracker.clear()
    model.train()
    out = model(ids, torch.arange(s)[None, :].expand(b, -1), mask, labels=labels, loss_mask=loss_mask,
                packed_seq_params=packed).float()
    # pretrain_gpt.py's loss_func: the masked token mean
    loss = out.mean() if loss_mask is None else (out * loss_mask).sum() / loss_mask.sum()
    loss.backward()
    with torch.no_grad():  # the gradients in the parameters' place, so that the sharded keys name them
        for p in model.parameters():
            p.copy_(p.grad if p.grad is not None else torch.full_like(p, float("nan")))
    depths = job["model"]["mtp_num_layers"]
    return {"tensors": tensors, "logits": heads[-1], "mtp_logits": heads[:-1],
            "block": [c.transpose(0, 1) for c in torch.chunk(block[0], 1 + depths, dim=0)],
            "mtp_losses": MTPLossLoggingHelper.tracker["values"].clone(), "loss": loss.detach(),
            "grads": global_tensors(model)}


def mixed(job: dict) -> dict:
    """A job of another topic ("topic": "train", "optimizer" or "grouped_experts") under the distributed optimizer's
    shims, so that one oracle process (one megatron-core start-up, one torchrun for "ep" > 1) runs several kinds."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    if job["topic"] not in ("train", "optimizer", "grouped_experts"):
        raise ValueError(job["topic"])
    MoEAuxLossAutoScaler.main_loss_backward_scale = None  # a class attribute: the previous job's scale
    return TOPICS[job["topic"]][0](job)


# -- mtp_roll ---------------------------------------------------------------------------------------------------------
# What GPTModel._postprocess and MultiTokenPredictionLayer._get_embeddings do to the labels, loss mask and input ids of
# each depth under context parallelism: each rank takes its zigzag part (get_batch_on_this_cp_rank, as pretrain_gpt.py)
# of the whole batch and calls roll_tensor(shifts=-1, dims=-1, cp_group) once per depth, which trades the boundary
# tokens with the neighbouring CP ranks by isend/irecv. Every rank of this torchrun is one CP rank.

def mtp_roll(job: dict) -> list:
    from megatron.core.transformer.multi_token_prediction import roll_tensor
    from megatron.core.utils import get_batch_on_this_cp_rank

    group = torch.distributed.group.WORLD
    batch = get_batch_on_this_cp_rank({k: torch.load(job[k]) for k in ("input_ids", "labels", "loss_mask")},
                                      cp_group=group)
    ids, labels, mask = batch["input_ids"], batch["labels"], batch["loss_mask"].float()
    mine = []
    for _ in range(job["depths"]):
        ids, _ = roll_tensor(ids, shifts=-1, dims=-1, cp_group=group)
        labels, _ = roll_tensor(labels, shifts=-1, dims=-1, cp_group=group)
        mask, num_tokens = roll_tensor(mask, shifts=-1, dims=-1, cp_group=group)
        mine.append({"ids": ids.clone(), "labels": labels.clone(), "loss_mask": mask.clone(),
                     "num_tokens": float(num_tokens)})
    ranks = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(ranks, mine)
    return ranks


# topic: (its job, whether it needs the distributed optimizer's shims)
TOPICS = {"names": (names, False), "data": (data, False), "schedule": (schedule, False), "legacy": (legacy, False),
          "torch_dist": (torch_dist, False), "optimizer": (optimizer, True), "train": (train, True),
          "pipeline_split": (pipeline_split, False), "regions": (regions, False),
          "legacy_stages": (legacy_stages, False), "mtp": (mtp, False), "mtp_roll": (mtp_roll, False),
          "grouped_experts": (grouped_experts, False), "mixed": (mixed, True)}


def main() -> None:
    """megatron-core on CPU, seed 0, then the topic's job for each job of the JSON list in argv[2]; each result is
    written to its job's `out`."""
    run, distributed_optimizer = TOPICS[sys.argv[1]]
    if distributed_optimizer:
        cuda_as_cpu()
        tolerate_adam_step()
    with open(sys.argv[2]) as f:
        jobs = json.load(f)
    # "ep" > 1: run under torchrun, one process per rank (the regions topic's "ep" is the layout it builds each rank's
    # model for, one after another in this one process)
    init_megatron_cpu(ep=1 if sys.argv[1] == "regions" else max(job.get("ep", 1) for job in jobs))
    torch.manual_seed(0)
    np.random.seed(0)
    for job in jobs:
        result = run(job)
        if torch.distributed.get_rank() > 0:  # every rank took part; rank 0 writes the result
            continue
        if job["out"].endswith(".pt"):
            torch.save(result, job["out"])
        else:
            with open(job["out"], "w") as f:
                json.dump(result, f)
        print(f"ORACLE {sys.argv[1]} done -> {job['out']}", flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":  # dist_checkpointing may spawn processes
    main()
