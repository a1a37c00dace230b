"""Megatron-LM's --exit-signal-handler: a signal asks the run to save and stop, at the same iteration on every rank.

As Megatron's DistributedSignalHandler (megatron/training/dist_signal_handler.py): the handler only records that the
signal came; after each iteration every rank learns whether any rank got one (one all-reduce of one number), so all
ranks save the same iteration and leave the loop together. Megatron catches --exit-signal only (default SIGTERM);
shardkit catches SIGTERM as well when --exit-signal is another one, because SLURM sends SIGTERM on scancel, on
preemption and at the time limit, while `--signal=USR1@N` (written by `shardkit launch`) sends SIGUSR1 N seconds ahead.
"""
from __future__ import annotations

import signal

import torch
import torch.distributed as dist

from checkpoint.errors import ConfigError


class ExitSignals:
    def __init__(self, name: str) -> None:
        name = name.upper() if name.upper().startswith("SIG") else "SIG" + name.upper()  # --config: usr1 too
        if name not in signal.Signals.__members__ or name in ("SIGKILL", "SIGSTOP"):
            raise ConfigError(f"--exit-signal {name!r}: not a signal that can be caught (SIGTERM, SIGUSR1, ...)")
        self.signals = [signal.Signals[name]] + ([signal.SIGTERM] if name != "SIGTERM" else [])
        self.got = 0  # the number of the first signal received here
        self._old: dict[signal.Signals, object] = {}

    def install(self) -> "ExitSignals":
        for s in self.signals:
            self._old[s] = signal.signal(s, self._handler)
        return self

    def _handler(self, signum, frame) -> None:
        self.got = self.got or signum

    def release(self) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)
        self._old.clear()

    def received(self, world: int, device: torch.device) -> str | None:
        """The signal any rank received (every rank gets the same answer), or None."""
        t = torch.tensor([self.got], dtype=torch.int64, device=device)
        if world > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return signal.Signals(int(t)).name if int(t) else None
