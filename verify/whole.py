"""Logit parity: our canonical-layout GPTModel against the HF model it was converted from.

The strongest check a conversion can get: if the canonical tensors (fused QKV per query group, [gate; up], padded
vocab) were assembled wrongly, the logits differ. Both models run in fp32 on the same random tokens.
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping

import torch
from torch import Tensor

from checkpoint.config import ModelConfig
from checkpoint.errors import ShardkitError
from train.model import GPTModel

from .common import HF_ATTN_IMPLEMENTATION, as_stored, compare_rows, load_quietly


def logit_parity(cfg: ModelConfig, tensors: Mapping[str, Tensor], hf_dir: str | Path, *, batch: int = 2,
                 seq_len: int = 32, seed: int = 0, stored: torch.dtype | None = None) -> dict:
    """Max and mean |logits_ours - logits_hf| on seeded random token ids (< cfg.vocab_size), fp32, no grad. `stored`:
    the checkpoint's dtype (verify.common.stored_dtype): HF's weights are rounded to it first, as the conversion
    rounded them."""
    import transformers

    if seq_len < 1 or batch < 1:
        raise ShardkitError(f"--seq-length {seq_len}: the logit comparison needs at least one token per sequence")
    theirs = ModelConfig.from_hf_dir(hf_dir)  # one line if it is not an HF model directory
    if theirs.model_type != cfg.model_type:
        raise ShardkitError(f"--against {hf_dir}: a {theirs.model_type} model, but the checkpoint is {cfg.model_type}")
    padded_vocab = tensors["embedding.word_embeddings.weight"].shape[0]
    # Build on the meta device: every parameter is overwritten by load_canonical, so skip the random init.
    with torch.device("meta"):
        ours = GPTModel(cfg, padded_vocab)
    ours = ours.to_empty(device="cpu").float()
    ours.load_canonical(tensors)  # copy_ upcasts bf16/fp16 sources exactly
    ours.eval()

    hf = load_quietly(lambda: transformers.AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float32, attn_implementation=HF_ATTN_IMPLEMENTATION, trust_remote_code=False), hf_dir)
    hf.eval()
    if stored is not None:
        with torch.no_grad():
            for t in hf.state_dict().values():  # the weights and persistent buffers the HF files hold, in place
                t.copy_(as_stored(t, stored))

    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, cfg.vocab_size, (batch, seq_len), generator=generator)
    from train.model import Router

    routed: dict[int, set] = {}  # the routed experts the test tokens select, per MoE layer
    for i, m in enumerate(x for x in ours.modules() if isinstance(x, Router)):
        m.register_forward_hook(lambda _m, _a, o, i=i: routed.setdefault(i, set()).update(o[1].unique().tolist()))
    with torch.no_grad():
        ours_logits = ours(input_ids)
        hf_logits = hf(input_ids=input_ids, use_cache=False).logits.float()
    if ours_logits.shape != hf_logits.shape:
        raise ValueError(f"logit shapes differ: ours {tuple(ours_logits.shape)}, HF {tuple(hf_logits.shape)}")
    diff = (ours_logits - hf_logits).abs()
    # issue 34: the logits exercise only the embedding rows of the test tokens: every row is compared directly
    emb = tensors["embedding.word_embeddings.weight"]
    embedding = compare_rows("embedding.word_embeddings.weight", "model.embed_tokens.weight", cfg.vocab_size,
                             lambda a, b: [(a, b, emb[a:b])],
                             lambda a, b: hf.get_input_embeddings().weight[a:b])
    not_compared = []
    biases = _router_biases(ours, hf)  # DeepSeek-V3's expert_bias only selects experts: compared directly
    if routed:
        total = cfg.num_moe_experts * len(routed)
        hit = sum(len(v) for v in routed.values())
        if hit < total:
            not_compared.append(f"{total - hit} of {total} routed experts (no test token selected them; "
                                "--streaming --all-experts runs every one)")
    if biases and biases.get("unmatched"):
        not_compared.append(f"the router expert_bias of {biases['layers']} MoE layer(s) (HF's could not be paired)")
    if cfg.mtp_num_layers:
        not_compared.append(f"{cfg.mtp_num_layers} MTP layer(s) (transformers' forward has none; --streaming "
                            "compares them)")
    return {
        "max_abs_diff": diff.max().item(),
        "mean_abs_diff": diff.mean().item(),
        "batch": batch,
        "seq_len": seq_len,
        "dtype": "float32",
        "embedding": embedding,
        "router_bias": biases,
        "not_compared": not_compared,
    }


def _router_biases(ours, hf) -> dict | None:
    """Every decoder MoE layer's router expert_bias (DeepSeek-V3's e_score_correction_bias) against HF's, bit for bit:
    the bias only decides which experts are selected, so one that changes no test token's selection would pass the
    logits (issue 34). None where the model has none; {"layers", "differ": [layer, ...]}."""
    from train.model import Router

    mine = [(int(name.split(".")[2]), m.expert_bias) for name, m in ours.named_modules()
            if isinstance(m, Router) and m.expert_bias is not None and name.startswith("decoder.layers.")]
    theirs = [m.e_score_correction_bias for m in hf.modules() if isinstance(
        getattr(m, "e_score_correction_bias", None), torch.Tensor)]
    if not mine:
        return None
    if len(mine) != len(theirs):
        return {"layers": len(mine), "differ": [], "unmatched": True}
    differ = [i for (i, a), b in zip(mine, theirs)
              if a.shape != b.shape or not torch.equal(a.detach().float(), b.detach().float())]
    return {"layers": len(mine), "differ": differ}
