"""`convert hf-to-mcore`'s default proof in a process of its own, started at launch (issue 42).

The proof needs torch, transformers and the model type's modeling module: ~3.7 CPU-s of imports at a 1.5 GB model,
as much as the comparison itself. In a thread of the converting process they shared its GIL; here they run in a
fresh interpreter (started by exec, never forked from a process that imported torch) on another core while the
conversion writes. Once the conversion has committed, the parent sends the iteration's path (one JSON line on the
child's stdin); the child runs convert.hf_to_mcore.prove, the code the in-process proof runs, and sends its result
back as JSON on a pipe of its own; the parent says the verdict (verify_conversion), so the report is the same.

The child never outlives the parent: the kernel kills it when the parent dies (PR_SET_PDEATHSIG: SIGTERM, SIGKILL or
a crash of the parent), the parent kills it on every way out (shardkit.cli.main's close_all, at exit), and it runs in
a session of its own, so a terminal's Ctrl-C reaches the parent only (the one line said is the parent's). A child
that fails or dies is one ShardkitError in the parent, which withdraws the commit (verify_conversion's `withdraw`): no
checkpoint is left looking proven.
"""
from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from checkpoint.errors import ShardkitError

_OPEN: list["ProofProcess"] = []  # killed at exit, whichever way the command ends


class ProofProcess:
    """The proof's process for the conversion of `hf_dir`: started now, importing; `prove` runs the proof there."""

    def __init__(self, hf_dir: str | Path) -> None:
        root = Path(__file__).resolve().parent.parent  # the same code tree as this process, whatever the cwd
        read, write = os.pipe()
        code = f"import sys; sys.path[0] = {str(root)!r}; from convert.proof_process import main; main()"
        try:
            self.proc = subprocess.Popen([sys.executable, "-c", code, str(os.getpid()), str(write), str(hf_dir)],
                                         stdin=subprocess.PIPE, pass_fds=(write,), start_new_session=True)
        except OSError:
            os.close(read)
            raise
        finally:
            os.close(write)
        self.results = os.fdopen(read, "rb")
        _OPEN.append(self)

    def prove(self, path: str | Path, **kwargs) -> dict:
        """convert.hf_to_mcore.prove(path, hf_dir, **kwargs), run in the child; its ShardkitError raised here, and
        one for a child that died or failed without a result."""
        try:
            self.proc.stdin.write((json.dumps({"path": str(path), **kwargs}) + "\n").encode())
            self.proc.stdin.close()
        except OSError:  # it is gone already: said below, from its exit status
            pass
        try:
            data = self.results.read()
        except BaseException:  # Ctrl-C while it computes
            self.close()
            raise
        self.close(kill=bool(data))  # a result read: its exit is of no interest; none: its exit status says why
        if data:
            out = json.loads(data)
            if "error" in out:
                raise ShardkitError(out["error"])
            return out["result"]
        rc = self.proc.returncode
        how = (f"was killed by {signal.Signals(-rc).name}" + (" (out of memory?)" if -rc == signal.SIGKILL else "")
               if rc is not None and rc < 0 else f"exited with status {rc} without a result")
        raise ShardkitError(f"the proof's process (pid {self.proc.pid}) {how}: the conversion was not proven")

    def close(self, kill: bool = True) -> None:
        """Stop the child (if still running) and reap it."""
        if self in _OPEN:
            _OPEN.remove(self)
        if kill and self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.results.close()
        if self.proc.stdin and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except OSError:
                pass


@atexit.register
def close_all() -> None:
    """Stop every proof process this process started (shardkit.cli.main's way out; at exit too)."""
    while _OPEN:
        _OPEN[-1].close()


def start(hf_dir: str | Path) -> ProofProcess | None:
    """The proof process for converting `hf_dir`, started now; None where this process has imported transformers
    already (a library caller, the tests): there the proof has no imports left to hide and runs in process; so it
    does where no process can be started (no interpreter path, out of processes or memory)."""
    if "transformers" in sys.modules or not sys.executable:
        return None
    try:
        return ProofProcess(hf_dir)
    except OSError:
        return None


# -- the child -------------------------------------------------------------------------------------------------------

def _die_with(parent: int) -> None:
    """SIGKILL this process when its parent dies (Linux); gone already, exit now."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(0)


def _preload(hf_dir: str) -> None:
    """Import what the proof runs: torch, transformers, the modeling module of HF_DIR's model type and our side; and
    transformers' checkpoint key mapping of that type (built and cached on first use: ~1 CPU-s of regular
    expressions). Nothing is read but a small regular config.json; any error is left for the proof to say."""
    try:
        import importlib
        import stat

        import torch  # noqa: F401
        import transformers  # noqa: F401

        import verify.against  # noqa: F401
        from checkpoint import opened  # noqa: F401

        cfg = Path(hf_dir) / "config.json"
        st = os.stat(cfg)
        if stat.S_ISREG(st.st_mode) and st.st_size < (1 << 20):
            mt = json.loads(cfg.read_text()).get("model_type")
            if isinstance(mt, str) and mt.isidentifier():
                importlib.import_module(f"transformers.models.{mt}.modeling_{mt}")
                from transformers.conversion_mapping import get_checkpoint_conversion_mapping

                get_checkpoint_conversion_mapping(mt)
    except Exception:  # noqa: BLE001 - the proof imports again and says what is wrong
        pass


def main() -> None:
    """The child: argv = parent pid, result fd, HF_DIR; one request on stdin (none: the conversion did not commit)."""
    parent, fd, hf_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    _die_with(parent)
    from checkpoint.malloc import tune_malloc

    tune_malloc()  # the allocator the command's own process runs with (shardkit.cli.main): the same memory bound
    with os.fdopen(fd, "w") as results:
        _preload(hf_dir)  # (not niced: measured no clear gain, and a niced import still running at the commit
                          # would hold up the proof: scripts/BENCH.md)
        line = sys.stdin.readline()
        if not line:
            return
        request = json.loads(line)
        from convert.hf_to_mcore import prove

        try:
            out = {"result": prove(request.pop("path"), hf_dir, **request)}
        except ShardkitError as e:
            out = {"error": str(e)}
        except Exception as e:  # noqa: BLE001 - a fault of ours: one line in the parent, not a traceback here
            out = {"error": f"the proof failed: {type(e).__name__}: {e}"}
        results.write(json.dumps(out))
