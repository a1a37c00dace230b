"""megatron-core on CPU as the torch_dist oracle (recipe in DESIGN.md). Run as a script in a subprocess with a JSON
file listing jobs; each job writes a .pt file with what it saw:

    {"mode": "load", "ckpt": ITER_DIR, "model": {...}, "input_ids": PT, "out": PT}
        build megatron-core's own GPTModel (local spec), dist_checkpointing.load() the checkpoint into it, and save
        its tensors (gathered back to global tensors by sharded key from its own sharded_state_dict) and its logits.
    {"mode": "save", "root": DIR, "iteration": N, "model": {...}, "seed": S, "input_ids": PT, "out": PT}
        build a randomly initialised GPTModel, save it with dist_checkpointing.save() as Megatron-LM lays it out
        (<root>/iter_N + latest_checkpointed_iteration.txt, common.pt with iteration/args), and save its logits.

"model": TransformerConfig fields plus padded_vocab_size, max_sequence_length, rotary_base, tied.

    python tests/megatron_torch_dist_oracle.py jobs.json
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

import torch
import torch.nn.functional as F


def shims() -> None:
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None


def init_megatron_cpu(port_span: int = 1000) -> None:
    """megatron-core on the CPU in this one process: the shims, a gloo group of one, model parallel 1 x 1, no CUDA
    RNG tracker (every oracle, and scripts/bench_train.py, starts here)."""
    shims()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % port_span))
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state, tensor_parallel
    import megatron.core.transformer.moe.moe_utils as moe_utils

    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    moe_utils.te_general_gemm = None  # megatron-core 0.16 raises a NameError there without TE


def build(model_cfg: dict):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = dict(model_cfg)
    vocab, seq = cfg.pop("padded_vocab_size"), cfg.pop("max_sequence_length")
    base, tied = cfg.pop("rotary_base"), cfg.pop("tied")
    experts = cfg.get("num_moe_experts")
    tc = TransformerConfig(gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm",
                           use_cpu_initialization=True, params_dtype=torch.float32, hidden_dropout=0.0,
                           attention_dropout=0.0, bias_activation_fusion=False, bias_dropout_fusion=False,
                           masked_softmax_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
                           moe_token_dispatcher_type="allgather", **cfg)
    spec = get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=False, normalization="RMSNorm")
    model = GPTModel(tc, spec, vocab_size=vocab, max_sequence_length=seq, position_embedding_type="rope",
                     rotary_base=base, share_embeddings_and_output_weights=tied)
    return model.eval()


def global_tensors(model) -> dict[str, torch.Tensor]:
    """The model's tensors as global tensors by sharded key, assembled from its own sharded_state_dict()."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    out: dict[str, torch.Tensor] = {}
    for v in model.sharded_state_dict().values():
        if isinstance(v, ShardedTensorFactory):
            built = v.build()
            items = built.values() if isinstance(built, dict) else (built if isinstance(built, list) else [built])
        else:
            items = [v]
        for t in items:
            if not isinstance(t, ShardedTensor):
                continue
            g = out.setdefault(t.key, torch.full(t.global_shape, float("nan"), dtype=t.data.dtype))
            data = t.data.detach().reshape((1,) * t.prepend_axis_num + tuple(t.local_shape))
            g[tuple(slice(o, o + s) for o, s in zip(t.global_offset, data.shape))] = data
    return out


@torch.no_grad()
def logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    b, s = input_ids.shape
    position_ids = torch.arange(s)[None, :].expand(b, -1)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None]
    return model(input_ids, position_ids, mask).float()


@torch.no_grad()
def randomize(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=g)
        p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.08 * noise)


def run(job: dict) -> None:
    from megatron.core import dist_checkpointing

    model = build(job["model"])
    ids = torch.load(job["input_ids"])
    if job["mode"] == "load":
        # as Megatron-LM does: the model's sharded state dict under "model", common.pt's entries merged around it
        state = dist_checkpointing.load({"model": model.sharded_state_dict()}, job["ckpt"])
        model.load_state_dict(state["model"], strict=True)
        torch.save({"tensors": global_tensors(model), "logits": logits(model, ids)}, job["out"])
    elif job["mode"] == "save":
        randomize(model, job["seed"])
        it = job["iteration"]
        d = os.path.join(job["root"], f"iter_{it:07d}")
        os.makedirs(d)
        m = job["model"]
        args = argparse.Namespace(num_layers=m["num_layers"], hidden_size=m["hidden_size"],
                                  tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                                  padded_vocab_size=m["padded_vocab_size"], params_dtype=torch.float32)
        dist_checkpointing.save({"model": model.sharded_state_dict(), "iteration": it, "checkpoint_version": 3.0,
                                 "args": args}, d)
        with open(os.path.join(job["root"], "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(it))
        torch.save({"tensors": global_tensors(model), "logits": logits(model, ids)}, job["out"])
    else:
        raise ValueError(job["mode"])


if __name__ == "__main__":
    init_megatron_cpu()
    torch.manual_seed(0)
    with open(sys.argv[1]) as f:
        jobs = json.load(f)
    for job in jobs:
        run(job)
        print(f"ORACLE done {job['mode']} -> {job['out']}", flush=True)
    torch.distributed.destroy_process_group()
