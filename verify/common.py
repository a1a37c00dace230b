"""What both verify comparisons share: transformers' loading (quiet, one line when it cannot), exact fp32 arithmetic,
files unchanged while compared, and the bit-for-bit comparison of rows (the embedding) with its verdict line."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor

from checkpoint.errors import ShardkitError

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


def _libc_memcmp():
    import ctypes
    import ctypes.util

    f = ctypes.CDLL(ctypes.util.find_library("c")).memcmp
    f.restype, f.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    return f


def stored_dtype(ck) -> torch.dtype | None:
    """The one floating dtype checkpoint `ck` stores its weights in (None where they are in several, or none): the
    conversion's --dtype, or the source's own. HF's side of the proof is rounded to it before its fp32 forward, as
    the conversion rounded the source (an fp32 model stored in bf16 is compared with HF's weights in bf16, not its
    fp32 ones: the comparison proves the conversion, not the precision asked for). Optimizer state and kept block-FP8
    weights with their scales are left out."""
    from checkpoint import store
    from checkpoint.sharding import SCALE_SUFFIX, split_optimizer_key

    kept = set((getattr(ck.manifest, "fp8", None) or {}).get("tensors", ()))
    dtypes = {e.dtype for n, e in ck.tensors.items()
              if n not in kept and not n.endswith(SCALE_SUFFIX) and split_optimizer_key(n) is None}
    if len(dtypes) != 1:
        return None
    dt = store.torch_dtype(dtypes.pop())
    return dt if dt.is_floating_point else None


def as_stored(t: Tensor, dtype: torch.dtype | None) -> Tensor:
    """HF's tensor `t` as the conversion stored it: cast to the checkpoint's `dtype` (stored_dtype; None: as it is).
    Any later cast to fp32 is exact, so the fp32 forward sees the stored values."""
    return t if dtype is None or not t.is_floating_point() or t.dtype == dtype else t.to(dtype)


_memcmp = _libc_memcmp()  # bytes compared in place (a mapped chunk's view too), the GIL released (ctypes)


def rows_differ(hf_rows: Tensor, ours: Tensor) -> Tensor:
    """Per row: does our stored row differ bit for bit from HF's row cast to our dtype (the conversion's cast)?
    Equal blocks (the usual case) are found by one memcmp, with no per-element temporaries (at a 1.5 GB model's
    embedding the element-wise comparison was a tenth of the proof); only a block that differs is compared row by
    row."""
    h = hf_rows.to(ours.dtype).contiguous()
    o = ours.contiguous()
    n = o.numel() * o.element_size()
    if h.shape == o.shape and (n == 0 or _memcmp(h.data_ptr(), o.data_ptr(), n) == 0):
        return torch.zeros(len(ours), dtype=torch.bool)
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
