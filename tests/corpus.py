"""The tiny training corpus the trainer tests share: documents from a small vocabulary with a repeated pattern, so a
few steps visibly learn (loss falls) and every test that trains sees the same tokens."""
from __future__ import annotations

from pathlib import Path

import numpy as np


def write_pattern_corpus(prefix: Path, *, docs: int = 400, seed: int = 0) -> Path:
    """Write `prefix`.bin/.idx (Megatron's indexed format, uint16) and return `prefix`."""
    from train.data.indexed import write_indexed

    rng = np.random.default_rng(seed)
    write_indexed(prefix, [np.tile(rng.integers(3, 60, size=int(rng.integers(3, 9))), 12)[: int(rng.integers(30, 120))]
                           for _ in range(docs)], np.uint16)
    return prefix


def write_packed_corpus(prefix: Path, eod: int, lengths: tuple[int, int], *, docs: int = 600, seed: int = 1) -> Path:
    """Short documents (repeated random patterns, `lengths` = [low, high) tokens before the EOD), each ended by `eod`:
    a short sample packs several, and documents cross sample (and CP chunk) boundaries."""
    from train.data.indexed import write_indexed

    rng = np.random.default_rng(seed)
    out = [np.append(np.tile(rng.integers(3, 60, size=int(rng.integers(2, 5))), 6)[: int(rng.integers(*lengths))], eod)
           for _ in range(docs)]
    write_indexed(prefix, out, np.uint16)
    return prefix


def tiny_llama_setup(root: Path) -> Path:
    """What the trainer tests start from, under `root`: the demo's tiny Llama in fp32 (hf/), converted (ck/), and the
    pattern corpus (data)."""
    import torch

    from shardkit.cli import main as cli
    from shardkit.demo import build_tiny_llama

    build_tiny_llama(root / "hf", dtype=torch.float32)
    assert cli(["convert", "hf-to-mcore", str(root / "hf"), str(root / "ck"), "--quiet", "--no-verify"]) == 0
    write_pattern_corpus(root / "data")
    return root
