"""Which proof mode, within what memory (verify/streamed.py's pieces, verify/whole.py's whole model): the fp32 size
of every piece from the manifest's shapes, the plan of pieces that keeps the streamed proof under --memory-budget, and
the choice between the whole-model and the streamed comparison."""
from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any

from checkpoint.errors import ShardkitError
from checkpoint.reader import Checkpoint
from checkpoint.sharding import SCALE_SUFFIX, split_optimizer_key
from train.model import canonical_name

from .hf_weights import FP32


def piece_groups(ck: Checkpoint) -> dict:
    """fp32 element counts per piece, from the manifest's shapes: per layer (decoder index or 'mtp.j') the part held
    whole (attention, norms, router, shared experts: 'rest'), its dense MLP ('mlp', with the MLP tensors' names) and
    one routed expert ('expert'); and the largest storage chunk of the embedding/head ('vocab_chunk')."""
    cfg = ck.config
    out: dict[Any, dict] = {}
    vocab_chunk = 0
    for name, e in ck.tensors.items():
        if split_optimizer_key(name) is not None or name.endswith(SCALE_SUFFIX):
            continue
        n = math.prod(e.shape)
        m = re.match(r"(decoder|mtp)\.layers\.(\d+)\.(.*)$", name)
        if name.startswith(("embedding.", "output_layer.")):
            vocab_chunk = max(vocab_chunk, math.prod(e.chunk))
            continue
        if m:
            key: Any = int(m.group(2)) if m.group(1) == "decoder" else f"mtp.{m.group(2)}"
            keys, rest = [key], m.group(3)
        elif name.startswith("decoder.layers."):  # stacked on the layer axis
            keys, rest, n = list(range(cfg.num_layers)), name[len("decoder.layers."):], n // cfg.num_layers
        else:  # final norm
            continue
        rest = rest.removeprefix("transformer_layer.")
        for k in keys:
            g = out.setdefault(k, {"rest": 0, "mlp": 0, "expert": 0})
            if e.expert:
                g["expert"] += n // cfg.num_moe_experts
            elif re.match(r"mlp\.linear_fc[12]\.", rest):
                g["mlp"] += n
            else:
                g["rest"] += n
    return {"layers": out, "vocab_chunk": vocab_chunk}


def _mlp_options(ck: Checkpoint, layer: int, fp8_block: tuple[int, int] | None) -> list[int]:
    """Piece counts n for layer's dense MLP in the order preferred: n divides the intermediate size; first the counts
    whose pieces are whole storage chunks of linear_fc1 and linear_fc2 (fewest first), then finer ones; an FP8
    source is cut at whole blocks only."""
    cfg = ck.config
    F_ = cfg.ffn_hidden_size
    stacked = not cfg.heterogeneous
    name1, _ = canonical_name(f"decoder.layers.{layer}.mlp.linear_fc1.weight", stacked)
    name2, _ = canonical_name(f"decoder.layers.{layer}.mlp.linear_fc2.weight", stacked)
    g = math.lcm(ck.entry(name1).chunk[-2], ck.entry(name2).chunk[-1])
    if fp8_block:
        g = math.lcm(g, fp8_block[0], fp8_block[1])
    ns = [n for n in range(1, F_ + 1) if F_ % n == 0]
    if fp8_block:  # an FP8 source can only be sliced at whole blocks
        ns = [n for n in ns if n == 1 or (F_ // n) % math.lcm(*fp8_block) == 0]
    aligned = [n for n in ns if (F_ // n) % g == 0]
    # then finer cuts across storage chunks (a chunk straddling two pieces is read by both)
    return aligned + [n for n in ns if n > aligned[-1]] if aligned else ns


def piece_plan(ck: Checkpoint, budget: int | None, fp8_block: tuple[int, int] | None = None) -> dict:
    """How finely streaming cuts: dense MLP pieces per layer and head rows per block, so that twice a piece in fp32
    (its values and the read they come from) stays within `budget` (None: whole layers, the whole head)."""
    cfg = ck.config
    groups = piece_groups(ck)
    mlp_pieces: dict[Any, int] = {}
    for k, g in groups["layers"].items():
        if not isinstance(k, int) or not g["mlp"] or budget is None:
            continue
        if 2 * FP32 * (g["rest"] + g["mlp"]) <= budget:
            continue
        opts = _mlp_options(ck, k, fp8_block)
        mlp_pieces[k] = next((n for n in opts if 2 * FP32 * g["mlp"] // n <= budget), opts[-1])
    h = cfg.hidden_size
    if budget is None:
        head_rows = cfg.vocab_size
    else:
        step = ck.entry("embedding.word_embeddings.weight").chunk[0]
        if not cfg.tie_word_embeddings:
            step = math.lcm(step, ck.entry("output_layer.weight").chunk[0])
        # a head block holds its fp32 values and, while it is compared, both sides' reads of it (HF's a copy, ours
        # views of the mapped chunks): 3x fp32 per row, not the 2x of a layer's piece (measured at DeepSeek-V3 width:
        # the head block was the run's peak RSS, 1 GB of it file pages)
        head_rows = max(step, budget // (3 * FP32 * h) // step * step)
        head_rows = min(head_rows, cfg.vocab_size)
    return {"mlp_pieces": mlp_pieces, "head_rows": head_rows}


def memory_needs(ck: Checkpoint) -> dict[str, int]:
    """fp32 bytes: both whole models (whole mode), and the least streaming can hold at once: twice its largest
    piece that cannot be cut further (a layer's attention and norms, or its router and shared experts; one routed
    expert; a dense MLP's smallest piece; one storage chunk of the embedding or head), from the manifest's shapes."""
    whole = 0
    for name, e in ck.tensors.items():
        if split_optimizer_key(name) is not None or name.endswith(SCALE_SUFFIX):
            continue
        whole += math.prod(e.shape)
    groups = piece_groups(ck)
    piece, what = groups["vocab_chunk"], "one storage chunk of the embedding"
    for k, g in groups["layers"].items():
        label = f"layer {k}" if isinstance(k, int) else k.replace("mtp.", "MTP layer ")
        if g["rest"] > piece:
            piece, what = g["rest"], f"{label}'s attention and norms" + (" (+ router and shared experts)"
                                                                          if g["expert"] else "")
        if g["expert"] > piece:
            piece, what = g["expert"], f"one routed expert of {label}"
        if g["mlp"] and isinstance(k, int):
            least = g["mlp"] // _mlp_options(ck, k, None)[-1]
            if least > piece:
                piece, what = least, f"the smallest piece of {label}'s MLP"
    return {"whole": 2 * FP32 * whole, "streaming": 2 * FP32 * piece, "streaming_piece": what}


def available_memory() -> int:
    """MemAvailable of /proc/meminfo (the kernel's estimate of what can be allocated without swapping)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


# The default --memory-budget: a constant, not a share of the host (issue 42: half the available memory took 9.4 GB
# to prove a 1.5 GB model, more than loading it whole the peers' way, and bought no speed). Where one piece that
# streaming cannot cut further is larger (a very wide layer), the budget is that piece: the least the proof can hold.
DEFAULT_BUDGET = 1 << 30


def choose_mode(ck: Checkpoint, streaming: bool, budget: int | None) -> tuple[str, dict]:
    """'whole' or 'streaming'. Whole (both models in fp32, logits compared) only for a model whose two fp32 copies
    fit in the budget and that has nothing the logits do not reach (MTP layers: transformers' forward has none);
    streaming otherwise, or when asked. The default budget is DEFAULT_BUDGET, or streaming's largest piece where that
    is larger; a given budget too small for that piece is one line with the size needed."""
    need = memory_needs(ck)
    given = budget is not None
    budget = budget if given else max(DEFAULT_BUDGET, need["streaming"])
    beyond = getattr(ck.config, "mtp_num_layers", 0) or 0  # rows only the streamed comparison has
    mode = "streaming" if streaming or beyond or need["whole"] > budget else "whole"
    if mode == "streaming" and need["streaming"] > budget:
        raise ShardkitError(f"--memory-budget {budget:,} bytes is too small: streaming parity holds "
                            f"{need['streaming_piece']} of {ck.path} at once, {need['streaming']:,} bytes in fp32 (its "
                            "values and the read they come from)")
    return mode, {**need, "budget": budget}
