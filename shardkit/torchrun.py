"""`python -m shardkit.torchrun [torchrun's arguments]`: torchrun (torch.distributed.run: the same arguments, agent,
rendezvous and worker handling) whose failure ends in one line instead of torchrun's traceback (issue 37).

Stock torchrun turns any rank's non-zero exit into its own ChildFailedError, raised out of its main: a Python traceback
of torchrun's agent and a block per failed rank, whatever the rank said and whatever its exit status was (nothing a rank
can do changes that; its error file only changes what the block shows). Here the same agent runs, and its failure is
read instead of raised:

- a rank that said its error (continue-pretrain's one-line errors, said once per job: train/report.py, which marks its
  error file) ends the job with nothing more;
- any other failure (a Python traceback, a signal, a rank killed) is one line naming the first rank that failed, its
  exit status or signal, its host and pid, and how many other ranks stopped, its own output being above.

The agent's per-failure log lines ("failed (exitcode: ...)", "Sending process ... closing signal") are left out, the
summary saying the same; its other logs stay. The exit status is the first failed rank's (128 + N for signal N), where
torchrun exits 1. `shardkit launch`'s torchrun.sh starts its ranks through this module."""
from __future__ import annotations

import logging
import signal
import sys

from train.report import MARK

_AGENT_LOGGER = "torch.distributed.elastic.multiprocessing.api"
_SAID_BY_SUMMARY = ("failed (exitcode", "Sending process")


class _QuietFailures(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_SAID_BY_SUMMARY)


def _said(failure) -> bool:
    data = getattr(failure, "error_file_data", None)
    return isinstance(data, dict) and bool(data.get(MARK))


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def summary(failures: dict) -> tuple[str | None, int]:
    """(the line to write, or None where a rank said it; the exit status) for torchrun's failures {rank: failure}."""
    # timestamps are whole seconds: within one, a rank that exited on its own comes before one the agent stopped
    first_rank = min(failures, key=lambda r: (failures[r].timestamp, failures[r].exitcode < 0, r))
    first = failures[first_rank]
    code = first.exitcode
    status = 128 + (-code) if code < 0 else (code if 0 < code < 256 else 1)
    if _said(first):
        return None, status
    how = f"was stopped by {_signal_name(code)}" if code < 0 else f"exited with status {code}"
    others = len(failures) - 1
    more = f"; {others} other rank{'s' if others > 1 else ''} failed or stopped after it" if others else ""
    import socket

    return (f"torchrun: rank {first_rank} (local rank {first.local_rank}, pid {first.pid} on {socket.gethostname()}) "
            f"{how}{more}; its output is above"), status


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    logging.getLogger(_AGENT_LOGGER).addFilter(_QuietFailures())
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        run(args)
    except ChildFailedError as e:
        line, status = summary(e.failures)
        if line:
            sys.stderr.write(line + "\n")
        return status
    except SignalException as e:  # the agent itself was told to stop (scancel, Ctrl-C): its ranks were stopped
        sys.stderr.write(f"torchrun: stopped by {e.sigval.name}; its ranks were stopped with it\n")
        return 128 + int(e.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
