"""megatron-core's distributed optimizer on the CPU, for the tests on gloo (DESIGN.md's recipe): one copy, used by the
megatron-core engine under its test switch and by tests/megatron_oracle.py. Imports torch only."""
from __future__ import annotations

import functools

import torch


def cuda_as_cpu() -> None:
    """The distributed optimizer's CUDA on the CPU: `Tensor.type()` reporting `torch.cuda.*Tensor` (it refuses other
    parameter types, and so does its gradient clipping), `Tensor.cuda()` as identity and `device="cuda"` factory
    calls placed on the CPU, page-locked host memory asked of them (`pin_memory=True`: CUDA's) a plain host tensor.
    No arithmetic changes. Process-wide."""
    def on_cpu(fn):
        @functools.wraps(fn)
        def wrapped(*a, **k):
            if str(k.get("device", "")).startswith("cuda"):
                k["device"] = "cpu"
            if k.get("pin_memory"):
                k["pin_memory"] = False
            return fn(*a, **k)
        return wrapped

    for name in ("tensor", "zeros", "empty", "ones", "full", "arange", "zeros_like", "empty_like"):
        setattr(torch, name, on_cpu(getattr(torch, name)))
    orig_type = torch.Tensor.type

    def tensor_type(self, *a, **k):
        if a or k:
            return orig_type(self, *a, **k)
        t = orig_type(self)
        return t if t.startswith("torch.cuda.") else t.replace("torch.", "torch.cuda.", 1)

    torch.Tensor.type = tensor_type
    torch.Tensor.cuda = lambda self, *a, **k: self
