"""`shardkit verify`, one entry for both formats: the checkpoint opened (checkpoint/opened.py), every stored byte
re-read (a native checkpoint's chunks with their checksums; a torch_dist one's items, with its keys and global shapes
against the model config and the sharding table), non-finite values counted, and with `against` the logits compared
with the HF model's (verify/against.py; a torch_dist checkpoint read in place, no staging copy). One printer
(verify/report.py) and one verdict for both."""
from __future__ import annotations

import sys
from pathlib import Path

from checkpoint.errors import ShardkitError
from checkpoint.opened import NativeCheckpoint, OpenedCheckpoint, TorchDistOpened, open_checkpoint
from checkpoint.progress import json_text, progress_bar

from .report import error_line, print_report


def integrity(ck: OpenedCheckpoint, show_progress: bool = True) -> dict:
    """Every stored byte re-read: the result dict `verify --json` prints (its fields are each format's own)."""
    if isinstance(ck, TorchDistOpened):
        from checkpoint.torch_dist_view import verify_torch_dist

        cfg, origin = ck.config, ck.config_origin  # the model config first: one line where nothing gives it
        total = sum(t.dtype.itemsize * _numel(t.shape) for t in ck.td.tensors.values())
        with progress_bar("verify", total=total, items=0, disable=not show_progress) as bar:
            return verify_torch_dist(ck.td, cfg, origin, progress=lambda n: bar.advance(n))
    assert isinstance(ck, NativeCheckpoint), type(ck)
    with progress_bar("verify", total=ck.nbytes(), items=0, disable=not show_progress) as bar:
        result = ck.ckpt.verify(progress=lambda n: bar.advance(n))
    return {"path": str(ck.path), "chunks_ok": True, **result}


def compare(ck: OpenedCheckpoint, against: str | Path, *, seq_length: int, tolerance: float, streaming: bool,
            memory_budget: int | None, all_experts: bool, show_progress: bool = True) -> dict:
    """The logits of `ck` (as its reader reads it) against the HF model at `against` (verify/against.py)."""
    from .against import against_hf

    if Path(against).is_dir():  # the conversion's own reading of the weights, in both modes: a FIFO, a link
        from checkpoint.hf_source import weight_files  # out, model.safetensors beside another index are one line

        weight_files(against)
    source = ck.reader
    # streaming: bytes read from both sides (each about once) and layers done
    with progress_bar("compare", total=2 * source.nbytes(), items=source.config.num_layers, unit="layers",
                      disable=not show_progress) as bar:
        return against_hf(source, against, seq_len=seq_length, tolerance=tolerance, streaming=streaming,
                          memory_budget=memory_budget, all_experts=all_experts,
                          progress=lambda nbytes: bar.advance(nbytes, items=1))


def verify_checkpoint(path: str | Path, *, against: str | None = None, hf_config: str | None = None,
                      vocab_size: int | None = None, seq_length: int = 32, tolerance: float = 1e-4,
                      streaming: bool = False, memory_budget: int | None = None, all_experts: bool = False,
                      quiet: bool = False, as_json: bool = False) -> int:
    """`verify`: the report on stdout (or the result as JSON), one `shardkit: error:` line on stderr and exit
    status 1 where the checkpoint fails, else 0. With `as_json` a checkpoint too damaged to report on (a
    ShardkitError: its line on stderr as ever) still prints a JSON object, {"path", "ok": false, "error"}: a script
    reading stdout gets a verdict either way."""
    show = not (quiet or as_json)
    try:
        ck = open_checkpoint(path, hf_config, vocab_size)
        result = integrity(ck, show)
        keys_ok = result.get("keys_ok", True)  # (torch_dist) the logits need every tensor where the model has it
        ok = keys_ok and not result["nonfinite"]
        if against and keys_ok:
            result["parity"] = compare(ck, against, seq_length=seq_length, tolerance=tolerance, streaming=streaming,
                                       memory_budget=memory_budget, all_experts=all_experts, show_progress=show)
            ok = ok and result["parity"]["ok"]
    except ShardkitError as e:
        if as_json:
            print(json_text({"path": str(path), "ok": False, "error": str(e)}))
        raise
    result["ok"] = ok
    if as_json:
        print(json_text(result))
    else:
        print_report(result, against)
    line = error_line(result, against, tolerance)
    if line is not None:
        print(f"shardkit: error: {line}", file=sys.stderr)
        return 1
    return 0


def _numel(shape) -> int:
    n = 1
    for x in shape:
        n *= x
    return n
