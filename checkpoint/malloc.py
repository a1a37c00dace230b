"""Process-wide allocator tuning for code that allocates and frees many multi-MiB chunk buffers (numpy only)."""
from __future__ import annotations


def tune_malloc(mmap_threshold: int = 1 << 20) -> None:
    """Serve every allocation of `mmap_threshold` bytes or more with its own mmap, returned to the OS on free.
    glibc otherwise raises its threshold (up to 32 MiB) after the first large free, and the 4-32 MiB chunk buffers
    then come from heap arenas that fragment and stay resident: peak RSS grew with the number of layers.

    numpy's large arrays are not madvised for transparent huge pages (NUMPY_MADVISE_HUGEPAGE=0, set at run time):
    where the kernel defragments madvised memory at the fault (THP `defrag` = madvise, a common default) the first
    touch of each fresh buffer waited on compaction against a page cache full of checkpoint files; a 1.5 GB proof's
    reads of our chunks 0.26 -> 0.10 s (scripts/BENCH.md). The buffers are short-lived and pooled: huge pages bought
    nothing measurable back."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").mallopt(-3, mmap_threshold)  # -3 = M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass  # not glibc: nothing to tune
    import numpy as np

    core = getattr(np, "_core", None) or np.core  # (numpy 2 / 1)
    madvise = getattr(core.multiarray, "_set_madvise_hugepage", None)
    if madvise is not None:
        madvise(False)
