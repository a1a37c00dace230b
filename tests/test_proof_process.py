"""`convert hf-to-mcore`'s default proof in a process started at launch (convert/proof_process.py, issue 42): the
same result as the proof run in process (every row, MTP depths included), a child that dies or fails is one
`shardkit: error:` line and nothing committed, and the child never outlives the command (SIGTERM, SIGKILL, Ctrl-C)."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

from convert.hf_to_mcore import convert_hf_to_mcore, prove, verify_conversion
from convert.proof_process import ProofProcess
from checkpoint.errors import ShardkitError
from checkpoint.layout import Layout
from tests.test_streaming_parity import _hf_dir

REPO = Path(__file__).resolve().parent.parent


def _timeless(x):
    """A result without its timings (seconds), which no two runs share."""
    if isinstance(x, dict):
        return {k: _timeless(v) for k, v in x.items() if k != "seconds"}
    if isinstance(x, (list, tuple)):
        return [_timeless(v) for v in x]
    return x


def test_result_and_report_equal_to_the_in_process_proof(tmp_path, capsys):
    """DeepSeek-V3 with an MTP layer, streamed: every row (each layer, expert counts, the MTP depth, the head) the
    same whether the proof runs here or in its process; so is the verdict line said from it."""
    hf_dir, _ = _hf_dir(tmp_path, "deepseek_v3")
    process = ProofProcess(hf_dir)  # importing while this converts and proves, as in the command
    path = convert_hf_to_mcore(hf_dir, tmp_path / "ck", Layout(), quiet=True)
    here = prove(path, hf_dir, quiet=True)
    there = process.prove(path, quiet=True, memory_budget=None, asked=True, allow_nonfinite=False)
    assert here["mode"] == "streaming" and here["ok"] and len(here["mtp_max_abs_diff"]) == 1, here
    assert _timeless(there) == _timeless(here)
    lines = []
    for result in (here, there):  # the verdict line is said from the result alone
        capsys.readouterr()
        child = SimpleNamespace(send=lambda *_, **__: None, ready=lambda: True, result=lambda: result)
        assert verify_conversion(path, hf_dir, quiet=True, process=child) == 0
        lines.append(re.sub(r" in [0-9.]+ s;", "", capsys.readouterr().out.strip()))  # (its time differs)
    assert lines[0] == lines[1] and lines[0].startswith("verify: logits vs") and "OK" in lines[0], lines
    assert " compared: embedding, decoder layers 0-2, head, MTP layer 0; not compared: " in lines[0], lines
    assert lines[0].endswith(" routed experts (no test token selected them; --all-experts runs every one)"), lines


def _committed(out: Path) -> list:
    return [p.name for p in out.glob("*")] if out.exists() else []


def _cli(hf_dir, out, *extra) -> subprocess.Popen:
    """The command as users run it (a process that has not imported transformers: the proof gets its own)."""
    # (Ctrl-C as a terminal delivers it: a suite started in the background by a shell without job control inherits
    # SIGINT ignored, and Python then never raises KeyboardInterrupt)
    return subprocess.Popen([sys.executable, "-m", "shardkit", "convert", "hf-to-mcore", str(hf_dir), str(out),
                             "--quiet", *extra], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


@pytest.mark.parametrize("how", ["killed", "fails"])
def test_a_proof_process_that_dies_or_fails_is_one_line_and_commits_nothing(tmp_path, how):
    """killed: the child is SIGKILLed as soon as it is seen (an out-of-memory kill, a crash); fails: its proof
    raises (a memory budget below the streamed comparison's smallest piece). Either way one error line, exit 1, and
    no iteration or pointer left that looks proven."""
    hf_dir, _ = _hf_dir(tmp_path, "llama_gqa")
    out = tmp_path / "ck"
    p = _cli(hf_dir, out, *(["--memory-budget", "1KB"] if how == "fails" else []))
    try:
        child = _proof_child(psutil.Process(p.pid))
        if how == "killed":
            child.kill()
        stdout, stderr = p.communicate(timeout=120)
    finally:
        _stop(p)
    err = stderr.strip().splitlines()
    assert p.returncode == 1 and len(err) == 1 and err[0].startswith("shardkit: error:"), err
    assert "nothing was committed" in err[0] and "verify:" not in stdout, (err, stdout)
    assert ("killed by SIGKILL" in err[0]) if how == "killed" else ("memory" in err[0]), err
    assert not (out / "latest").exists() and not list(out.glob("iter_*")), _committed(out)


def test_ctrl_c_during_the_proof_commits_nothing(tmp_path, monkeypatch, capsys):
    """Ctrl-C once the conversion is written, while its proof runs: the one interrupted line, exit 130, and the
    iteration withdrawn as for a failed proof or a proof process that died (it was left committed: `verify OUT`
    passed on a conversion never proven, and the rerun the line asks for was refused, the output not empty)."""
    import convert.hf_to_mcore as h2m
    from shardkit.cli import main

    hf_dir, _ = _hf_dir(tmp_path, "llama_gqa")
    out = tmp_path / "ck"

    def interrupted(*_, **__):
        raise KeyboardInterrupt

    monkeypatch.setattr(h2m, "prove", interrupted)  # (this process imported transformers: the proof runs in it)
    argv = ["convert", "hf-to-mcore", str(hf_dir), str(out), "--quiet"]
    capsys.readouterr()
    assert main(argv) == 130
    captured = capsys.readouterr()
    assert captured.out.startswith("wrote ") and "verify:" not in captured.out, captured.out
    assert captured.err.strip().splitlines() == ["shardkit: interrupted; rerun the same command to resume"]
    assert not (out / "latest").exists() and not list(out.glob("iter_*")), _committed(out)
    monkeypatch.undo()
    assert main(argv) == 0  # the rerun it asks for


def _stop(p: subprocess.Popen) -> None:
    if p.poll() is None:
        p.kill()
        p.wait()


def _proof_child(parent: psutil.Process, timeout: float = 60) -> psutil.Process:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for c in parent.children():
            try:
                if "convert.proof_process" in " ".join(c.cmdline()):
                    return c
            except psutil.NoSuchProcess:
                pass
        time.sleep(0.02)
    raise AssertionError("no proof process started")


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGKILL", "SIGINT"])
def test_the_proof_process_never_outlives_the_command(tmp_path, sig):
    """The command stopped while its proof process runs (SIGINT: Ctrl-C, sent to the process group as a terminal
    does): the child is gone right after, and Ctrl-C says one line, no traceback from either process."""
    hf_dir, _ = _hf_dir(tmp_path, "llama_gqa")
    p = _cli(hf_dir, tmp_path / "ck")
    try:
        child = _proof_child(psutil.Process(p.pid))
        if sig == "SIGINT":
            os.killpg(p.pid, signal.SIGINT)
        else:
            p.send_signal(getattr(signal, sig))
        out, err = p.communicate(timeout=60)
        gone, alive = psutil.wait_procs([child], timeout=10)
        assert not alive, f"the proof process {child.pid} outlived its command ({sig})"
        if sig == "SIGINT":  # (130, or killed by SIGINT: an interrupt that landed in a compiled module's init can
            # leave CPython's own "unhandled interrupt" flag set, and it then exits by SIGINT, as a shell expects too)
            assert p.returncode in (130, -signal.SIGINT) and "Traceback" not in err, err
            assert err.strip().splitlines() == ["shardkit: interrupted; rerun the same command to resume"], err
        else:
            assert p.returncode == -getattr(signal, sig)
    finally:
        _stop(p)


def test_the_converting_process_imports_neither_torch_nor_transformers(tmp_path):
    """With its default proof, a same-dtype conversion's own process stays as light as with --no-verify (the proof's
    imports, ~4 CPU-s, are the proof process's): before, a thread imported them beside the conversion."""
    hf_dir, _ = _hf_dir(tmp_path, "llama_gqa")
    code = ("import sys; from shardkit.cli import main; "
            f"rc = main(['convert', 'hf-to-mcore', {str(hf_dir)!r}, {str(tmp_path / 'ck')!r}, '--quiet']); "
            "print(rc, [m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')][:3])")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    lines = res.stdout.strip().splitlines()
    assert res.returncode == 0 and lines[-1] == "0 []", (res.stdout, res.stderr)
    assert any(ln.startswith("verify: logits vs") and "OK" in ln for ln in lines), res.stdout


def test_a_chunk_changed_after_the_commit_is_caught_beside_the_proofs_process(tmp_path):
    """The proof's process reads our chunks without their checksums while the command checks every chunk's; a bit
    flipped in a weight after the commit (the lowest of one bf16 element: within the logits' tolerance, so the
    comparison alone passes it) is one error naming the tensor, and the iteration is withdrawn."""
    hf_dir, _ = _hf_dir(tmp_path, "llama_gqa")
    process = ProofProcess(hf_dir)
    try:
        path = convert_hf_to_mcore(hf_dir, tmp_path / "ck", Layout(), quiet=True)
        chunk = next((path / "model" / "decoder.layers.mlp.linear_fc2.weight" / "c").rglob("*"))
        while chunk.is_dir():
            chunk = next(chunk.iterdir())
        raw = bytearray(chunk.read_bytes())
        raw[0] ^= 1  # (the trailer, the last 4 bytes, still holds the original bytes' CRC32C)
        chunk.write_bytes(bytes(raw))
        assert prove(path, hf_dir, quiet=True, checksums=False)["ok"]  # what the child alone would find
        with pytest.raises(ShardkitError, match=r"linear_fc2.*(?i:digest mismatch).*nothing was committed"):
            verify_conversion(path, hf_dir, quiet=True, process=process, withdraw=True)
        assert not path.exists()
    finally:
        process.close()


def test_a_skipped_proof_stops_the_chunk_check(tmp_path, monkeypatch, capsys):
    """Where the proof's process skips (nothing compared: --allow-nonfinite), the command's check of the chunks
    stops at once: at 671B it would read every chunk for nothing."""
    hf_dir, _ = _hf_dir(tmp_path, "llama_gqa")
    path = convert_hf_to_mcore(hf_dir, tmp_path / "ck", Layout(), quiet=True)
    from checkpoint import chunkio

    mapped = []
    real = chunkio.map_chunk
    monkeypatch.setattr(chunkio, "map_chunk", lambda *a, **k: mapped.append(a[0]) or real(*a, **k))
    child = SimpleNamespace(send=lambda *_, **__: None, ready=lambda: True, close=lambda: None,
                            result=lambda: {"skipped": "--allow-nonfinite", "instead": "..."})
    assert verify_conversion(path, hf_dir, quiet=True, process=child, allow_nonfinite=True, asked=False) == 0
    assert "verify: skipped" in capsys.readouterr().out
    assert len(mapped) == 1, mapped


@pytest.mark.parametrize("env, rank", [({}, None), ({"RANK": "0"}, 0), ({"RANK": "3", "SLURM_PROCID": "0"}, 3),
                                       ({"SLURM_PROCID": "2"}, 2), ({"RANK": "x"}, None)])
def test_only_rank_0_starts_the_proof_early(env, rank):
    """The proof's process is started as soon as the command line is parsed, before any rendezvous: by the process
    its launcher made rank 0 (torchrun's RANK, else SLURM's SLURM_PROCID), or the only one; a malformed rank starts
    it too and is refused by the rendezvous (the child is then stopped on the way out)."""
    from checkpoint.rendezvous import launcher_rank

    assert launcher_rank(env) == rank
