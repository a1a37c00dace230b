"""The tiny training corpus the trainer tests share: documents from a small vocabulary with a repeated pattern, so a
few steps visibly learn (loss falls) and every test that trains sees the same tokens."""
from __future__ import annotations

from pathlib import Path

import numpy as np


def write_pattern_corpus(prefix: Path, *, docs: int = 400, seed: int = 0) -> Path:
    """Write `prefix`.bin/.idx (Megatron's indexed format, uint16) and return `prefix`."""
    from train.data import write_indexed

    rng = np.random.default_rng(seed)
    write_indexed(prefix, [np.tile(rng.integers(3, 60, size=int(rng.integers(3, 9))), 12)[: int(rng.integers(30, 120))]
                           for _ in range(docs)], np.uint16)
    return prefix
