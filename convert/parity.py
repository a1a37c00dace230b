"""Logit parity: our canonical-layout GPTModel against the HF model it was converted from.

The strongest check a conversion can get: if the canonical tensors (fused QKV per query group, [gate; up], padded
vocab) were assembled wrongly, the logits differ. Both models run in fp32 on the same random tokens.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from torch import Tensor

from checkpoint.config import ModelConfig
from checkpoint.errors import ShardkitError
from train.model import GPTModel

# HF's SDPA path runs the same kernels in the same order as GPTModel (bitwise equal on CPU); eager differs by ~1e-6.
HF_ATTN_IMPLEMENTATION = "sdpa"


def load_quietly(build: Callable[[], Any], hf_dir: str | Path) -> Any:
    """Run `build` (a transformers load) without HF's loading bars and load report (e.g. DeepSeek-V3's MTP layers,
    which transformers does not load): our own output is the report, and a wrong or missing weight shows as a logit
    difference. A model transformers cannot load is one line."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    verbosity = transformers.utils.logging.get_verbosity()
    transformers.utils.logging.set_verbosity_error()
    try:
        return build()
    except (OSError, ValueError, RuntimeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ShardkitError(f"--against {hf_dir}: transformers cannot load it ({first})") from None
    finally:
        transformers.utils.logging.set_verbosity(verbosity)


class exact_fp32:
    """The comparison's arithmetic is IEEE fp32 whatever the process was set to: torch's float32 matmul precision is
    "highest" for its duration (restored after); "high"/"medium" let oneDNN run fp32 matmuls as TF32 or bf16 (on
    CPUs with AMX, ~2e-3 relative: every layer would differ by that much, a false "not ok", or an error of that size
    hidden). Then a canary matmul against float64 proves it (an environment such as ONEDNN_DEFAULT_FPMATH_MODE can
    lower it beneath torch's setting): one line if this process cannot do fp32 matmuls exactly enough to judge 1e-4."""

    def __enter__(self) -> "exact_fp32":
        self.prev = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("highest")
        g = torch.Generator().manual_seed(0)
        x, w = torch.randn(64, 1024, generator=g), torch.randn(256, 1024, generator=g)
        exact = x.double() @ w.double().T
        err = ((torch.nn.functional.linear(x, w).double() - exact).abs().max() / exact.abs().max()).item()
        if not err < 1e-5:
            self.__exit__()
            raise ShardkitError(f"fp32 matmuls in this process are not exact fp32 (relative error {err:.1e} on a "
                                "canary, ~1e-7 expected: a reduced-precision math mode such as "
                                "ONEDNN_DEFAULT_FPMATH_MODE is set); unset it to compare logits")
        return self

    def __exit__(self, *exc) -> None:
        torch.set_float32_matmul_precision(self.prev)


class unchanged_files:
    """Both sides' files stay what they were while they are compared: each file's identity, size and mtime are
    taken before and checked after (a file rewritten underneath, e.g. another job writing into the same directory,
    would make the numbers those of no one checkpoint). One line naming the first file that changed."""

    def __init__(self, *dirs: Path) -> None:
        self.dirs = [Path(d) for d in dirs]

    def _stats(self) -> dict[Path, tuple]:
        import os

        out = {}
        for d in self.dirs:
            for root, _, names in os.walk(d):
                for n in names:
                    p = Path(root) / n
                    try:
                        st = p.stat()
                    except OSError:
                        continue
                    out[p] = (st.st_ino, st.st_size, st.st_mtime_ns)
        return out

    def __enter__(self) -> "unchanged_files":
        self.before = self._stats()
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is not None:
            return
        after = self._stats()
        for p, st in self.before.items():
            if after.get(p) != st:
                how = "removed" if p not in after else "rewritten"
                raise ShardkitError(f"{p} changed while it was being compared ({how}); the numbers would be of no "
                                    "one checkpoint: rerun when nothing writes there")


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


def logit_parity(cfg: ModelConfig, tensors: Mapping[str, Tensor], hf_dir: str | Path, *, batch: int = 2,
                 seq_len: int = 32, seed: int = 0) -> dict:
    """Max and mean |logits_ours - logits_hf| on seeded random token ids (< cfg.vocab_size), fp32, no grad."""
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


def rows_differ(hf_rows: Tensor, ours: Tensor) -> Tensor:
    """Per row: does our stored row differ bit for bit from HF's row cast to our dtype (the conversion's cast)?"""
    h = hf_rows.to(ours.dtype).contiguous()
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[ours.element_size()]
    return (h.view(ints) != ours.contiguous().view(ints)).reshape(len(ours), -1).any(dim=1)


def compare_rows(name: str, hf_name: str, vocab: int, read_ours: Callable[[int, int], list],
                 read_hf: Callable[[int, int], Tensor], block: int | None = None) -> dict:
    """Every row [0, vocab) of our `name` against HF's `hf_name`, bit for bit after casting HF's to our dtype, in
    blocks of `block` rows (`read_ours(a, b)`: [(lo, hi, rows)] per storage chunk; `read_hf(a, b)`: rows a..b):
    {"tensor", "rows", "rows_differ", "first_row_differ", "max_abs_diff"}."""
    block = block or vocab
    n, first, worst = 0, None, 0.0
    with torch.no_grad():
        for a in range(0, vocab, block):
            b = min(a + block, vocab)
            theirs = read_hf(a, b)
            for lo, hi, mine in read_ours(a, b):
                bad = rows_differ(theirs[lo - a:hi - a], mine)
                k = int(bad.sum())
                if k:
                    n += k
                    first = lo + int(bad.nonzero()[0]) if first is None else first
                    worst = max(worst, (theirs[lo - a:hi - a].float() - mine.float()).abs().max().item())
            theirs = mine = None  # (streamed: one block of each side held at a time)
    return {"tensor": name, "hf_tensor": hf_name, "rows": vocab, "rows_differ": n, "first_row_differ": first,
            "max_abs_diff": worst}


def weights_verdict(out: dict) -> str | None:
    """The line naming a weight compared directly that differs (None when all are equal)."""
    e = out.get("embedding")
    if e and e["rows_differ"]:
        return (f"{e['tensor']}: {e['rows_differ']} of {e['rows']} row(s) differ from HF's {e['hf_tensor']} (first: "
                f"row {e['first_row_differ']}, |diff| up to {e['max_abs_diff']:.3e})")
    b = out.get("router_bias")
    if b and b["differ"]:
        return (f"decoder.layers.mlp.router.expert_bias: {len(b['differ'])} of {b['layers']} MoE layer(s) differ from "
                f"HF's gate.e_score_correction_bias (first: layer {b['differ'][0]})")
    return None


def against_hf(ck, hf_dir: str | Path, *, seq_len: int = 32, tolerance: float = 1e-4, streaming: bool = False,
               memory_budget: int | None = None, all_experts: bool = False,
               progress: Callable[[int], None] | None = None) -> dict:
    """`verify --against`: the whole-model comparison, or the streaming one (convert/streaming.py) when asked, when
    both fp32 models would not fit in `memory_budget` (default: streaming.DEFAULT_BUDGET, 1 GiB), for a model with MTP
    layers (the whole mode cannot compare them), with `all_experts`, or
    for a quantized (block-FP8) HF source, which transformers cannot load on the CPU.
    The HF config is checked first in both modes: a field that changes the math differing is one line.

    Verdict: the end-to-end logits within `tolerance` (as ever) and, in streaming mode, every per-layer number (each
    layer, expert, head and MTP depth on HF's own input) within it too."""
    import time

    from .streaming import HFWeights, check_same_math, choose_mode, hf_config, quantized_source, stream_parity

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
            out = {**logit_parity(ck.config, ck.state_dict(dequantize=True), hf_dir, seq_len=seq_len),
                   "mode": "whole"}
    out["memory"] = memory
    out["tolerance"] = tolerance
    out["weights_differ"] = weights_verdict(out)
    out["ok"] = (out["max_abs_diff"] <= tolerance and out.get("layers_ok", True)  # False for a NaN difference
                 and out["weights_differ"] is None)
    out["seconds"] = round(time.perf_counter() - started, 3)
    return out
