"""`verify --against` (and the converters' default proof): the HF directory checked, the mode chosen (whole model,
verify/whole.py, or streamed within a memory budget, verify/streamed.py), the comparison run in exact fp32 on files
that stay unchanged, and the verdict."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from checkpoint.config import ModelConfig
from checkpoint.errors import ShardkitError

from .common import exact_fp32, stored_dtype, unchanged_files, weights_verdict
from .budget import choose_mode
from .hf_weights import HFWeights, quantized_source
from .streamed import check_same_math, hf_config, stream_parity
from .whole import logit_parity


# test tokens per sequence beyond which verify --against refuses (a few thousand say what a hundred say; the logits of
# 2 x 10^8 tokens would need terabytes): at most the model's own context, and this
MAX_SEQ_LEN = 8192


def check_seq_len(cfg: ModelConfig, seq_len) -> None:
    """--seq-length of verify --against: a whole number from 1 to the smaller of MAX_SEQ_LEN and the model's
    max_position_embeddings (issue 34: 100000000 was accepted and ran out of memory with a traceback)."""
    top = min(MAX_SEQ_LEN, max(32, getattr(cfg, "max_position_embeddings", None) or MAX_SEQ_LEN))
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or not 1 <= seq_len <= top:
        raise ShardkitError(f"--seq-length {seq_len}: the logit comparison takes 1 to {top} tokens per sequence "
                            f"(the model's context is {getattr(cfg, 'max_position_embeddings', '?')}, at most "
                            f"{MAX_SEQ_LEN} are compared)")


def against_hf(ck, hf_dir: str | Path, *, seq_len: int = 32, tolerance: float = 1e-4, streaming: bool = False,
               memory_budget: int | None = None, all_experts: bool = False,
               progress: Callable[[int], None] | None = None) -> dict:
    """`verify --against`: the whole-model comparison, or the streaming one (verify/streamed.py) when asked, when
    both fp32 models would not fit in `memory_budget` (default: verify/budget.py DEFAULT_BUDGET, 1 GiB), for a model
    with MTP layers (the whole mode cannot compare them), with `all_experts`, or
    for a quantized (block-FP8) HF source, which transformers cannot load on the CPU.
    The HF config is checked first in both modes: a field that changes the math differing is one line.

    Verdict: the end-to-end logits within `tolerance` (as ever) and, in streaming mode, every per-layer number (each
    layer, expert, head and MTP depth on HF's own input) within it too."""
    import time

    started = time.perf_counter()
    hf_dir = Path(hf_dir)
    check_seq_len(ck.config, seq_len)
    if hf_dir.is_dir() and not any(os.path.lexists(hf_dir / n) for n in ("model.safetensors",
                                                                          "model.safetensors.index.json")):
        # both modes read safetensors only (transformers would unpickle a pytorch_model.bin in the whole mode)
        pickles = sorted(p.name for pat in ("*.bin", "*.pth") for p in hf_dir.glob(pat))
        raise ShardkitError(f"--against {hf_dir}: " + (
            f"only pickle weights ({', '.join(pickles[:3])}) found; shardkit reads safetensors only (re-save with "
            "save_pretrained(safe_serialization=True))" if pickles else
            "no model.safetensors or model.safetensors.index.json"))
    ModelConfig.from_hf_dir(hf_dir)  # config.json through its one checked reader first (unreadable, nested: one line)
    from checkpoint.hf_source import HFSource

    # every safetensors header checked as the conversion checks it, before either mode opens a file with the
    # safetensors library (a truncated or corrupt file was its traceback: one line naming the file and the tensor)
    HFSource(hf_dir).close()
    mode, memory = choose_mode(ck, streaming or all_experts or quantized_source(hf_dir), memory_budget)
    # streamed, the config is checked once the disk has started reading ahead (stream_parity), before any layer
    if mode == "whole" and (hf_dir / "config.json").is_file() and (
            (hf_dir / "model.safetensors").is_file() or (hf_dir / "model.safetensors.index.json").is_file()):
        check_same_math(ck.config, hf_config(hf_dir, HFWeights(hf_dir)), hf_dir)
    with exact_fp32(), unchanged_files(hf_dir, ck.path):
        if mode == "streaming":
            out = stream_parity(ck, hf_dir, seq_len=seq_len, tolerance=tolerance, all_experts=all_experts,
                                memory_budget=memory["budget"], progress=progress)
        else:
            out = {**logit_parity(ck.config, ck.state_dict(dequantize=True), hf_dir, seq_len=seq_len,
                                  stored=stored_dtype(ck)), "mode": "whole"}
    out["memory"] = memory
    out["tolerance"] = tolerance
    out["weights_differ"] = weights_verdict(out)
    out["ok"] = (out["max_abs_diff"] <= tolerance and out.get("layers_ok", True)  # False for a NaN difference
                 and out["weights_differ"] is None)
    out["seconds"] = round(time.perf_counter() - started, 3)
    return out
