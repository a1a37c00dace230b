"""Micro-batches for one data-parallel rank, in Megatron-LM's MegatronPretrainingSampler order."""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

import numpy as np

from .errors import DataError

if TYPE_CHECKING:
    import torch

    from .order import Dataset


def micro_batches(dataset: Dataset, consumed_samples: int, micro_batch_size: int, dp_rank: int,
                  dp_size: int) -> Iterator["torch.Tensor"]:
    """int64 [mbs, seq+1] batches for one DP rank, in order from consumed_samples.

    Each step of mbs*dp consecutive samples gives rank r the slice [r*mbs, (r+1)*mbs); a partial last step is
    dropped. Resuming at consumed_samples=k therefore yields exactly what an uninterrupted run sees after k samples,
    whatever the DP size was before.
    """
    total = len(dataset)
    if micro_batch_size < 1 or dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise DataError(f"micro_batches: micro batch size {micro_batch_size}, DP rank {dp_rank} of {dp_size}: "
                        "need mbs >= 1 and 0 <= rank < size")
    if not 0 <= consumed_samples < total:
        raise DataError(f"consumed samples {consumed_samples}: the dataset holds {total} samples; it was built for "
                        "fewer samples than the run needs (raise --train-iters before building, or "
                        "--override-data-state)")
    return _iterate(dataset, consumed_samples, micro_batch_size, dp_rank, dp_size)


def _iterate(dataset: Dataset, consumed: int, mbs: int, rank: int, dp: int) -> Iterator["torch.Tensor"]:
    import torch

    step = mbs * dp
    for start in range(consumed, len(dataset) - step + 1, step):
        lo = start + rank * mbs
        yield torch.from_numpy(np.stack([dataset[i] for i in range(lo, lo + mbs)]))
