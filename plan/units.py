"""Byte-size strings for flags (``80GB``, ``141GiB``, ``2.5TB``) and the planner's error type."""
from __future__ import annotations

import re

from checkpoint.errors import ShardkitError


class PlanError(ShardkitError):
    """A planning or launch request cannot be honoured (bad flag value, impossible GPU count)."""


GiB = 1 << 30
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str, flag: str = "--gpu-memory") -> int:
    """'80GB' -> 80e9 (SI), '80GiB' -> 80 * 2**30 (IEC), a bare number is bytes. Anything else: PlanError naming the
    flag. An "80 GB" H100 has 80 GiB of HBM: write 80GiB to plan against all of it."""
    m = _SIZE.match(str(text))
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS:
        raise PlanError(f"{flag}: cannot parse {text!r} as a memory size; write e.g. 80GB, 80GiB, 141GB or 2TB")
    value = float(m.group(1)) * _UNITS[unit]
    if value <= 0:
        raise PlanError(f"{flag}: {text!r} must be positive")
    return int(value)


def gib(n: float) -> str:
    return f"{n / GiB:.1f}"
