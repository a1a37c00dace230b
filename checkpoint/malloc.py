"""Process-wide allocator tuning for code that allocates and frees many multi-MiB chunk buffers (no heavy imports)."""
from __future__ import annotations


def tune_malloc(mmap_threshold: int = 1 << 20) -> None:
    """Serve every allocation of `mmap_threshold` bytes or more with its own mmap, returned to the OS on free.
    glibc otherwise raises its threshold (up to 32 MiB) after the first large free, and the 4-32 MiB chunk buffers
    then come from heap arenas that fragment and stay resident: peak RSS grew with the number of layers."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").mallopt(-3, mmap_threshold)  # -3 = M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass  # not glibc: nothing to tune
