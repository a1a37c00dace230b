"""megatron-core on CPU as the oracle for Megatron-LM's legacy `--ckpt-format torch` checkpoints (recipe in DESIGN.md).
Run as a script in a subprocess with a JSON file listing jobs:

    {"root": DIR, "iteration": N, "seed": S, "model": {...}, "input_ids": PT, "out": PT}

Each job builds megatron-core's own GPTModel (local spec, one process: tp = pp = 1), randomises it, and
- saves it the way Megatron-LM's `save_checkpoint` does with `--ckpt-format torch`: <root>/iter_N/mp_rank_00/
  model_optim_rng.pt holding the module state dict under "model", the run's `args` (an argparse.Namespace with
  Megatron's own enums in it, as Megatron-LM's arguments have them), iteration, checkpoint_version, RNG state (numpy
  and torch), optimizer, scheduler and rerun-state-machine state, and latest_checkpointed_iteration.txt;
- writes `out`: its logits on `input_ids` and its state dict as plain tensors (for the tests to split into other
  layouts with their own implementation of the partition rules).

"model": TransformerConfig fields plus padded_vocab_size, max_sequence_length, rotary_base, tied, vocab_size (true).

    python tests/megatron_legacy_oracle.py jobs.json
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.megatron_torch_dist_oracle import init_megatron_cpu  # noqa: E402

EXTRA = ("padded_vocab_size", "max_sequence_length", "rotary_base", "tied", "vocab_size")


def build(m: dict):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    tc_fields = {k: v for k, v in m.items() if k not in EXTRA}
    experts = tc_fields.get("num_moe_experts")
    tc = TransformerConfig(gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm",
                           use_cpu_initialization=True, params_dtype=torch.float32, hidden_dropout=0.0,
                           attention_dropout=0.0, bias_activation_fusion=False, bias_dropout_fusion=False,
                           masked_softmax_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
                           add_bias_linear=False, moe_token_dispatcher_type="allgather", **tc_fields)
    spec = get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=False, normalization="RMSNorm")
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


def megatron_args(m: dict, iteration: int) -> argparse.Namespace:
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
        "args": megatron_args(m, iteration),
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
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(iteration))


def run(job: dict) -> None:
    m = job["model"]
    model = build(m)
    randomize(model, job["seed"])
    ids = torch.load(job["input_ids"])
    out_logits = logits(model, ids)
    save_legacy(model, m, job["root"], job["iteration"])
    plain = {k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    torch.save({"logits": out_logits, "state_dict": plain}, job["out"])


if __name__ == "__main__":
    init_megatron_cpu()
    torch.manual_seed(0)
    np.random.seed(0)
    with open(sys.argv[1]) as f:
        jobs = json.load(f)
    for job in jobs:
        run(job)
        print(f"ORACLE done -> {job['out']}", flush=True)
    torch.distributed.destroy_process_group()
