"""`shardkit continue-pretrain` with the trainer's float32 turned into float64: do two layouts differ by rounding
or by a defect? (issue 23). Rounding shrinks by ~1e9 from fp32 to float64 (unit roundoff 2^-24 -> 2^-53); a wrong
reduction group, a scale applied twice or a different token order does not shrink at all.

    torchrun --nproc-per-node 4 scripts/train_float64.py continue-pretrain --load CK --ep 4 ...   (as the CLI)
    python scripts/train_float64.py compare RUN_A/iter_0000005 RUN_B/iter_0000005

`compare` prints, for the weights and each optimizer state, the largest ||a - b|| / ||a|| over tensors (vocab padding
rows left out) and the tensor it is in. Measured with it (Mixtral, the test_train_moe runs, seed 7, LR 3e-3 at
iteration 1): EP 1 vs EP 2 x CP 2 x DP 2 after 5 steps 1.4e-5 in fp32, 1.1e-14 here.

How: before the trainer is imported, torch's default dtype, `torch.float32` / `torch.float` and `Tensor.float()` map
to float64, and the checkpoint store gets a float64 dtype, so weights, gradients, AdamW's moments and the checkpoints
written are float64 (a float32 starting checkpoint is exact in float64). A diagnostic only: shardkit's own commands do
not read the float64 checkpoints it writes (this script's `compare` and its resumed runs do).
"""
from __future__ import annotations

import sys

import numpy as np
import torch

torch.set_default_dtype(torch.float64)
torch.float32 = torch.float64
torch.float = torch.float64
torch.Tensor.float = lambda self, memory_format=torch.preserve_format: self.to(torch.float64)

from checkpoint import store  # noqa: E402

store.NP_DTYPES["float64"] = (np.dtype(np.float64), None)

from train import checkpointing  # noqa: E402

_entry = checkpointing.TensorEntry  # the optimizer moments' entries are declared "float32": written as float64


def _float64_entry(shape, dtype, *args, **kwargs):
    return _entry(shape, "float64" if dtype == "float32" else dtype, *args, **kwargs)


checkpointing.TensorEntry = _float64_entry


def compare(a_dir: str, b_dir: str) -> int:
    from checkpoint.reader import Checkpoint

    a, b = Checkpoint(a_dir), Checkpoint(b_dir)
    vocab = a.config.vocab_size
    worst: dict[str, tuple[float, str]] = {}
    for name in a.tensors:
        x, y = (c.read_numpy(name).astype(np.float64) for c in (a, b))
        if a.entry(name).rule == "vocab":
            x, y = x[:vocab], y[:vocab]
        norm = np.linalg.norm(x)
        if norm == 0:
            continue
        kind = name.split(".")[2] if name.startswith("optimizer.state.") else "weights"
        worst[kind] = max(worst.get(kind, (0.0, "")), (float(np.linalg.norm(x - y) / norm), name))
    for kind, (rel, name) in sorted(worst.items()):
        print(f"{kind}: max relative difference {rel:.3e} ({name})")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["compare"] and len(sys.argv) == 4:
        sys.exit(compare(sys.argv[2], sys.argv[3]))
    from shardkit.cli import main

    sys.exit(main(sys.argv[1:]))
