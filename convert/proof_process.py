"""`convert hf-to-mcore`'s default proof in a process of its own, started at launch (issue 42).

The proof needs torch, transformers and the model type's modeling module: ~3 CPU-s of imports, more than a 1.5 GB
model's conversion. In a thread of the converting process they shared its GIL; here they run in a fresh interpreter
(started by exec, never forked from a process that imported torch) on another core while the command checks its
arguments and the conversion writes: it is started as soon as the command line is parsed (shardkit.cli.main), and
told the HF directory once that is resolved (one JSON line on the child's stdin). Once the conversion has committed,
the parent sends the iteration's path (a second line); the child runs convert.hf_to_mcore.prove, the code the
in-process proof runs, and sends its result back as JSON on a pipe of its own, while the parent checks every chunk's
checksum (the child's reads skip that; verify_conversion); the parent says the verdict, so the report is the same.

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
import select
import signal
import subprocess
import sys
from pathlib import Path

from checkpoint.errors import ShardkitError

_OPEN: list["ProofProcess"] = []  # killed at exit, whichever way the command ends


class ProofProcess:
    """The proof's process for a conversion: started now, importing; `source` names the HF directory (its modeling
    module is imported next), `send` the committed iteration, `result` is the proof's result."""

    def __init__(self, hf_dir: str | Path | None = None) -> None:
        root = Path(__file__).resolve().parent.parent  # the same code tree as this process, whatever the cwd
        read, write = os.pipe()
        code = f"import sys; sys.path[0] = {str(root)!r}; from convert.proof_process import main; main()"
        try:
            self.proc = subprocess.Popen([sys.executable, "-c", code, str(os.getpid()), str(write)],
                                         stdin=subprocess.PIPE, pass_fds=(write,), start_new_session=True)
        except OSError:
            os.close(read)
            raise
        finally:
            os.close(write)
        self.results = os.fdopen(read, "rb")
        self.hf_dir: str | None = None
        _OPEN.append(self)
        if hf_dir is not None:
            self.source(hf_dir)

    def _say(self, message: dict) -> None:
        try:
            self.proc.stdin.write((json.dumps(message) + "\n").encode())
            self.proc.stdin.flush()
        except OSError:  # it is gone already: said by `result`, from its exit status
            pass

    def source(self, hf_dir: str | Path) -> None:
        """The HF directory the conversion reads (once its argument is resolved): the child imports its model
        type's modeling module next."""
        self.hf_dir = str(hf_dir)
        self._say({"hf_dir": self.hf_dir})

    def send(self, path: str | Path, **kwargs) -> None:
        """Start convert.hf_to_mcore.prove(path, hf_dir, **kwargs) in the child; `result` waits for it."""
        self._say({"path": str(path), **kwargs})
        try:
            self.proc.stdin.close()
        except OSError:
            pass

    def result(self) -> dict:
        """The result of what `send` started; its ShardkitError raised here, and one for a child that died or
        failed without a result."""
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

    def ready(self) -> bool:
        """The result (or the child's end) can be read without waiting."""
        return bool(select.select([self.results], [], [], 0)[0])

    def prove(self, path: str | Path, **kwargs) -> dict:
        """convert.hf_to_mcore.prove(path, hf_dir, **kwargs), run in the child (`send`, then `result`)."""
        self.send(path, **kwargs)
        return self.result()

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


def waiting() -> ProofProcess | None:
    """The proof process this command started at launch and has not told its HF directory yet (ProofProcess.source)."""
    return next((p for p in _OPEN if p.hf_dir is None), None)


def start(hf_dir: str | Path | None = None) -> ProofProcess | None:
    """The proof process for a conversion, started now (`hf_dir`: or named later, ProofProcess.source); None where
    this process has imported transformers already (a library caller, the tests): there the proof has no imports
    left to hide and runs in process; so it does where no process can be started (no interpreter path, out of
    processes or memory)."""
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


def _preload() -> None:
    """Import what every proof runs: torch, transformers and our side. Any error is left for the proof to say."""
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401

        import verify.against  # noqa: F401
        from checkpoint import opened  # noqa: F401
    except Exception:  # noqa: BLE001 - the proof imports again and says what is wrong
        pass


def _preload_model(hf_dir: str) -> None:
    """Import the modeling module of HF_DIR's model type, and transformers' checkpoint key mapping of that type
    (built and cached on first use: ~1 CPU-s of regular expressions). Nothing is read but a small regular
    config.json; any error is left for the proof to say."""
    try:
        import importlib
        import stat

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
    """The child: argv = parent pid, result fd; on stdin the HF directory, then one request (either missing: the
    command ended before, there is nothing to prove)."""
    parent, fd = int(sys.argv[1]), int(sys.argv[2])
    _die_with(parent)
    from checkpoint.malloc import tune_malloc

    tune_malloc()  # the allocator the command's own process runs with (shardkit.cli.main): the same memory bound
    with os.fdopen(fd, "w") as results:
        _preload()  # (not niced: measured no clear gain, and a niced import still running at the commit would hold
                    # up the proof: scripts/BENCH.md)
        line = sys.stdin.readline()
        if not line:
            return
        hf_dir = json.loads(line)["hf_dir"]
        _preload_model(hf_dir)
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
