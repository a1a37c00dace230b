"""Tiny Mixtral / DeepSeek-V2 / V3 checkpoints in the real HF on-disk format, for conversion tests.

transformers builds and saves the models; what it does not save is added the way the hub checkpoints have it:
DeepSeek-V3's MTP layer (`model.layers.{N}.*`, with copies of the embedding and head) and, on request, block-FP8
weights with `weight_scale_inv` (quantized here with an independent implementation of DeepSeek's scheme).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file, save_file

BASE = dict(vocab_size=300, hidden_size=64, num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
            rms_norm_eps=1e-5)
DSV3_YARN = {"type": "yarn", "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1,
             "original_max_position_embeddings": 32}
CONFIGS = {
    "mixtral": (transformers.MixtralConfig, dict(intermediate_size=96, num_hidden_layers=2, num_local_experts=4,
                                                 num_experts_per_tok=2)),
    # V2-Lite style: no q_lora, softmax greedy routing, shared experts, first layer dense
    "deepseek_v2_lite": (transformers.DeepseekV2Config, dict(
        intermediate_size=96, num_hidden_layers=3, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        n_shared_experts=2, first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, norm_topk_prob=False, routed_scaling_factor=1.5, topk_method="greedy")),
    "deepseek_v3": (transformers.DeepseekV3Config, dict(
        intermediate_size=96, num_hidden_layers=3, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
        num_nextn_predict_layers=1, rope_scaling=DSV3_YARN)),
}


def build(kind: str, path: Path, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> Path:
    cls, kw = CONFIGS[kind]
    cfg = cls(**{**BASE, **kw, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.08 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(0.5 * torch.randn_like(b))
    model.to(dtype).save_pretrained(str(path))
    mtp = getattr(cfg, "num_nextn_predict_layers", 0) or 0
    if mtp:
        add_mtp_layers(path, cfg.num_hidden_layers, mtp)
    return Path(path)


def _rewrite(path: Path, fn) -> None:
    f = path / "model.safetensors"
    sd = fn(load_file(str(f)))
    save_file(sd, str(f), metadata={"format": "pt"})


def add_mtp_layers(path: Path, num_layers: int, n: int) -> None:
    """DeepSeek-V3's hub layout for MTP layer i: `model.layers.{L+i}` = a full MoE layer (random here) plus enorm,
    hnorm, eh_proj, shared_head.norm, and copies of the embedding and the output head."""
    def add(sd):
        g = torch.Generator().manual_seed(1234)
        last = f"model.layers.{num_layers - 1}."
        h = sd["model.norm.weight"].shape[0]
        dt = sd["model.norm.weight"].dtype
        for i in range(n):
            p = f"model.layers.{num_layers + i}."
            for k in [k for k in sd if k.startswith(last)]:
                t = sd[k]
                sd[p + k[len(last):]] = (0.08 * torch.randn(t.shape, generator=g)).to(t.dtype)
            sd[p + "enorm.weight"] = (1 + 0.1 * torch.randn(h, generator=g)).to(dt)
            sd[p + "hnorm.weight"] = (1 + 0.1 * torch.randn(h, generator=g)).to(dt)
            sd[p + "eh_proj.weight"] = (0.08 * torch.randn(h, 2 * h, generator=g)).to(dt)
            sd[p + "shared_head.norm.weight"] = (1 + 0.1 * torch.randn(h, generator=g)).to(dt)
            sd[p + "embed_tokens.weight"] = sd["model.embed_tokens.weight"].clone()
            sd[p + "shared_head.head.weight"] = sd["lm_head.weight"].clone()
        return sd
    _rewrite(path, add)


FP8_WEIGHT = re.compile(r"model\.layers\.\d+\.(self_attn\.(q_a|q_b|q|kv_a|kv_b|o)_proj(_with_mqa)?|"
                        r"mlp\.(experts\.\d+\.|shared_experts\.)?(gate|up|down)_proj)\.weight$")


def reference_dequant(q: torch.Tensor, s: torch.Tensor, block=(128, 128)) -> torch.Tensor:
    """DeepSeek's weight_dequant: fp32(q) * scale of its block (then the caller casts)."""
    br, bc = block
    return q.float() * s.repeat_interleave(br, 0).repeat_interleave(bc, 1)[: q.shape[0], : q.shape[1]]


def quantize_fp8(path: Path, block=(128, 128)) -> dict[str, torch.Tensor]:
    """Turn the linear weights of the decoder layers into e4m3 + weight_scale_inv (per block amax/448), as the
    DeepSeek-V3 hub checkpoint stores them, and add quantization_config. Returns the original weights."""
    originals = {}
    br, bc = block

    def q(sd):
        for k in [k for k in sd if FP8_WEIGHT.match(k)]:
            w = sd[k].float()
            originals[k] = sd[k]
            r, c = w.shape
            s = torch.zeros(-(-r // br), -(-c // bc))
            qw = torch.empty(r, c, dtype=torch.float8_e4m3fn)
            for i in range(s.shape[0]):
                for j in range(s.shape[1]):
                    blk = w[i * br:(i + 1) * br, j * bc:(j + 1) * bc]
                    s[i, j] = blk.abs().max().clamp(min=1e-12) / 448.0
                    qw[i * br:(i + 1) * br, j * bc:(j + 1) * bc] = (blk / s[i, j]).to(torch.float8_e4m3fn)
            sd[k] = qw
            sd[k + "_scale_inv"] = s
        return sd

    _rewrite(path, q)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                  "weight_block_size": list(block)}
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return originals


def hf_tensors(d: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out = {}
    for f in sorted(Path(d).glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out
