"""The one way shardkit unpickles anything: `torch.load(weights_only=True)` under a short explicit allowlist.

Used for Megatron-LM legacy rank files (`model_optim_rng.pt`), torch_dist `common.pt` and DCP tensor items. PyTorch's
weights-only unpickler builds tensors, storages, dtypes and plain containers and refuses every other global; the
allowlist below adds only inert data classes, each for a named reason. A pickle that references anything else
(`os.system`, `builtins.eval`, a Megatron class not listed) is refused with one line naming the file and the global;
nothing in it runs. Transformer Engine `_extra_state` (an `io.BytesIO` of pickled bytes in older TE versions) is
allowed as the BytesIO only: its bytes are never unpickled.

torch is imported only by load_torch: a common.pt of plain data is read by checkpoint.torch_dist's torch-free
unpickler, which resolves exactly this allowlist (allowed_globals) and torch's dtypes by name.
"""
from __future__ import annotations

import argparse
import io
import pathlib
import pickle
import re
import signal
import types
from pathlib import Path
from typing import IO, Any, Callable

import numpy as np

from .errors import FormatError


class MegatronObject:
    """Inert stand-in for a Megatron class that a checkpoint names outside the model weights (enums in `args`, the
    rerun state machine, the optimizer config). Its pickled value / state is kept as data; Megatron's code is never
    imported or run, and nothing of it is converted."""

    qualname = "?"

    def __init__(self, *args: Any):  # enum members unpickle as Class(value)
        self.args = args

    def __repr__(self) -> str:
        shown = self.args if self.args else vars(self)
        return f"<{self.qualname} {shown!r}>"


def _stub(path: str) -> tuple[type, str]:
    cls = type(path.rsplit(".", 1)[1], (MegatronObject,), {"qualname": path, "__module__": __name__})
    return cls, path


def _numpy_reconstruct() -> Callable:
    core = getattr(np, "_core", None)  # numpy 2 (numpy.core is a deprecated alias there)
    return (core if core is not None else np.core).multiarray._reconstruct


_reconstruct = _numpy_reconstruct()

# The allowlist, on top of torch's own weights-only set (tensors, storages, dtypes, OrderedDict, set, ...). It follows
# what Megatron-LM itself registers for its checkpoints (megatron/core/safe_globals.py), item by item:
SAFE_GLOBALS: list = [
    # `args`: the argparse.Namespace of the run's command line (plain attributes)
    argparse.Namespace,
    # `rng_state[i]["np_rng_state"]` = numpy.random.get_state(): a uint32 ndarray, rebuilt by numpy's array
    # reconstructor and dtype (the dtype class name appears in numpy >= 1.25 pickles). Array construction only.
    (_reconstruct, "numpy.core.multiarray._reconstruct"),
    (_reconstruct, "numpy._core.multiarray._reconstruct"),
    np.ndarray,
    np.dtype,
    (type(np.dtype(np.uint32)), "numpy.dtypes.UInt32DType"),
    # `_extra_state` of Transformer Engine modules saved by older TE versions: an io.BytesIO of bytes (skipped)
    io.BytesIO,
    # plain value classes Megatron-LM's args can hold: --exit-signal (signal.Signals enum), paths, SimpleNamespace
    signal.Signals,
    (pathlib.PosixPath, "pathlib.PosixPath"),
    (pathlib.PosixPath, "pathlib._local.PosixPath"),
    types.SimpleNamespace,
    # Megatron's own classes in args / rerun_state_machine / optimizer state: inert stand-ins (MegatronObject)
    *(_stub(p) for p in (
        "megatron.core.enums.ModelType", "megatron.core.transformer.enums.ModelType",
        "megatron.core.transformer.enums.AttnBackend", "megatron.core.transformer.enums.CudaGraphScope",
        "megatron.core.enums.Fp8Recipe", "megatron.core.enums.Fp4Recipe",
        "megatron.core.rerun_state_machine.RerunMode", "megatron.core.rerun_state_machine.RerunState",
        "megatron.core.rerun_state_machine.RerunDiagnostic",
        "megatron.core.optimizer.OptimizerConfig", "megatron.core.optimizer.optimizer_config.OptimizerConfig")),
]


def allowed_globals() -> dict[str, Any]:
    """SAFE_GLOBALS by the name a pickle gives each ("module.qualname"), as torch's weights-only unpickler resolves
    them (a plain class by its own module and qualname, a (value, name) pair by that name): for the torch-free
    readers of plain data (checkpoint.torch_dist's common.pt reader), which allow exactly these and nothing more."""
    out: dict[str, Any] = {}
    for g in SAFE_GLOBALS:
        obj, name = g if isinstance(g, tuple) else (g, f"{g.__module__}.{g.__qualname__}")
        out[name] = obj
    return out


_GLOBAL_RE = re.compile(r"GLOBAL ([\w.]+)")
_WO_DETAIL = re.compile(r"WeightsUnpickler error: ([^\n]+)")


def _py3_name(path: str) -> str:
    """A pickled global as Python 3 resolves it (torch.save writes protocol 2, with Python 2 module names)."""
    import _compat_pickle

    module, _, name = path.rpartition(".")
    if (module, name) in _compat_pickle.NAME_MAPPING:
        module, name = _compat_pickle.NAME_MAPPING[(module, name)]
    else:
        module = _compat_pickle.IMPORT_MAPPING.get(module, module)
    return f"{module}.{name}"


def load_torch(src: str | Path | IO[bytes], mmap: bool = False, what: str | None = None) -> Any:
    """`torch.load(src, weights_only=True)` under SAFE_GLOBALS, on the CPU. FormatError naming `what` (default: the
    path) when the pickle references anything outside the allowlist, or is not a readable torch.save stream."""
    import torch

    label = what or str(src)
    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            return torch.load(src, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        text = str(e)
        m = _GLOBAL_RE.search(text)
        if m:
            raise FormatError(f"{label}: refusing to unpickle {_py3_name(m.group(1))}: not plain data (a pickle that "
                              "could run code); the file was not loaded") from None
        d = _WO_DETAIL.search(text)
        detail = (d.group(1) if d else (text.strip().splitlines() or ["?"])[0])[:200]
        raise FormatError(f"{label}: refusing to unpickle it: {detail}; the file was not loaded") from None
    except Exception as e:  # not a torch.save file, truncated, unreadable (the weights-only unpickler runs no code)
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise FormatError(f"{label}: not a readable torch.save file ({type(e).__name__}: {first})") from None
