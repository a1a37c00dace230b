"""megatron-core on CPU as a test oracle (recipe in DESIGN.md). Run as a script in a subprocess: it prints the
sharded-state-dict keys and global shapes of megatron-core's own GPTModel for a config given as JSON.

    python tests/megatron_oracle.py '{"num_layers": 2, ..., "num_moe_experts": 4}'
"""
from __future__ import annotations

import contextlib
import json
import os
import sys

import torch
import torch.nn.functional as F


def shims() -> None:
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None


def sharded_keys(cfg: dict) -> dict[str, list[int]]:
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    import megatron.core.transformer.moe.moe_utils as moe_utils

    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    moe_utils.te_general_gemm = None  # megatron-core 0.16 raises a NameError there without TE
    vocab, seq, tied = cfg.pop("padded_vocab_size"), cfg.pop("max_sequence_length"), cfg.pop("tied")
    experts = cfg.get("num_moe_experts")
    tc = TransformerConfig(gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm",
                           use_cpu_initialization=True, params_dtype=torch.float32,
                           moe_token_dispatcher_type="allgather", **cfg)
    spec = get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=False, normalization="RMSNorm")
    model = GPTModel(tc, spec, vocab_size=vocab, max_sequence_length=seq, position_embedding_type="rope",
                     share_embeddings_and_output_weights=tied)
    out: dict[str, list[int]] = {}
    for v in model.sharded_state_dict().values():
        if isinstance(v, ShardedTensorFactory):
            built = v.build()
            items = built.values() if isinstance(built, dict) else (built if isinstance(built, list) else [built])
        else:
            items = [v]
        for t in items:
            if isinstance(t, ShardedTensor):
                out[t.key] = list(t.global_shape)
    return out


if __name__ == "__main__":
    shims()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    print("ORACLE " + json.dumps(sharded_keys(json.loads(sys.argv[1]))))
