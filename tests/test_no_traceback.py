"""The grep-able guarantee (issue 14): no Python traceback reaches a user.

- Every subcommand's `--help` (walked from the real argparse parser, continue-pretrain's flags included) exits 0.
- A table of bad invocations, a few for every subcommand (wrong types, missing files, bad flags, hostile values),
  each exits non-zero with exactly one stderr line, `shardkit: error: ...`, and no "Traceback".
- The defects that once printed a traceback or a misleading line, each as its own row.

Rows run in-process through shardkit.cli.main (fast); a handful run as subprocesses of the real `shardkit` entry
point, so the console script's own exit status and stderr are checked too.
"""
from __future__ import annotations

import argparse
import json
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from shardkit.cli import build_parser, main

TINY = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=96, vocab_size=300)
SHARDKIT = Path(sys.executable).with_name("shardkit")  # the console script of this environment


# -- fixtures -----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def w(tmp_path_factory) -> dict[str, Path]:
    """Good inputs and the damaged copies the table needs, built once."""
    from safetensors.torch import load_file

    from shardkit.demo import build_tiny_llama
    from train.data.indexed import write_indexed

    root = tmp_path_factory.mktemp("notb")
    hf = build_tiny_llama(root / "hf", **TINY)
    ck = root / "ck"
    assert main(["convert", "hf-to-mcore", str(hf), str(ck), "--quiet"]) == 0
    rng = np.random.default_rng(0)
    write_indexed(root / "data", [rng.integers(3, 200, size=40) for _ in range(16)], np.uint16)
    (root / "afile").write_text("a regular file\n")
    (root / "run").mkdir()
    (root / "run" / "metrics.jsonl").write_text(
        "".join(json.dumps({"iteration": i, "loss": 5.0 - i / 10, "lr": 1e-3}) + "\n" for i in range(1, 5)))
    (root / "surrogate.jsonl").write_text('{"text": "fine"}\n{"text": "bad \\ud800 here"}\n')
    (root / "lr_fast.toml").write_text('lr = "fast"\n')
    (root / "iters_float.toml").write_text("train_iters = 2.5\n")
    # an HF directory whose index lists only some of the tensors its shard holds
    partial = root / "hf_partial_index"
    partial.mkdir()
    for f in hf.iterdir():
        if f.is_file():
            (partial / f.name).write_bytes(f.read_bytes())
    names = sorted(load_file(str(hf / "model.safetensors")))
    (partial / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: "model.safetensors" for n in names[1:]}}))
    return {"root": root, "hf": hf, "ck": ck, "data": root / "data", "file": root / "afile", "run": root / "run",
            "partial": partial}


def assert_one_line_error(rc: int, err: str, *words: str) -> str:
    assert "Traceback" not in err, err
    assert rc not in (0, None), err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, f"expected one stderr line, got:\n{err}"
    assert lines[0].startswith("shardkit: error: "), lines[0]
    for word in words:
        assert word in lines[0], f"{word!r} not in: {lines[0]}"
    return lines[0]


def run_inproc(argv: list, capsys) -> tuple[int, str]:
    capsys.readouterr()
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as e:  # argparse: --help (0) and bad flags (2)
        rc = e.code
    return rc, capsys.readouterr().err


def run_real(argv: list) -> tuple[int, str, str]:
    r = subprocess.run([str(SHARDKIT), *[str(a) for a in argv]], capture_output=True, text=True, timeout=180)
    return r.returncode, r.stdout, r.stderr


# -- every --help ---------------------------------------------------------------------------------------------------

def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out = [path]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out += _commands(sub, path + (name,))
    return out


COMMANDS = _commands(build_parser())


def test_every_subcommand_is_walked():
    names = {" ".join(c) for c in COMMANDS}
    for expected in ("convert hf-to-mcore", "convert mcore-to-hf", "convert megatron-to-mcore", "reshard", "inspect",
                     "verify", "continue-pretrain", "preprocess-data", "plot", "demo", "plan", "launch"):
        assert expected in names, names


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: " ".join(c) or "shardkit")
def test_help(cmd, capsys):
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main([*cmd, "--help"])
    out, err = capsys.readouterr()
    assert e.value.code == 0 and "Traceback" not in err and err.strip() == ""
    assert out.startswith("usage: shardkit")


def test_help_through_the_real_entry_point():
    for cmd in ([], ["continue-pretrain"], ["convert", "hf-to-mcore"]):
        rc, out, err = run_real([*cmd, "--help"])
        assert rc == 0 and "Traceback" not in err and out.startswith("usage: shardkit"), err


# -- bad invocations ----------------------------------------------------------------------------------------------

def _cases(w: dict[str, Path]) -> list[tuple[str, list, tuple[str, ...]]]:
    hf, ck, root, f = w["hf"], w["ck"], w["root"], w["file"]
    out, missing = root / "out", root / "nowhere"
    h2m = ["convert", "hf-to-mcore", hf, out, "--quiet"]
    m2h = ["convert", "mcore-to-hf", ck, out, "--quiet"]
    pre = ["preprocess-data", "--tokenizer", hf, "--output-prefix", out / "d", "--quiet"]
    train = ["continue-pretrain", "--load", ck, "--data-path", w["data"], "--train-iters", "1"]
    lay = ["launch", "--layout", "tp=2,pp=1,dp=4", "--nodes", "1", "--dry-run", "--"]
    plan = ["plan", "--model", hf, "--gpus", "4"]
    return [
        ("no command", [], ("required: cmd",)),
        ("unknown command", ["bogus"], ("invalid choice: 'bogus'",)),
        ("convert without direction", ["convert"], ("convert",)),
        ("h2m missing positionals", ["convert", "hf-to-mcore"], ("required",)),
        ("h2m missing source", ["convert", "hf-to-mcore", missing, out], (str(missing),)),
        ("h2m --tp not an int", [*h2m, "--tp", "x"], ("--tp", "'x'")),
        ("h2m --tp 0", [*h2m, "--tp", "0"], ("--tp",)),
        ("h2m --tp 4 vs 2 kv heads", [*h2m, "--tp", "4"], ("num_key_value_heads=2",)),
        ("h2m --workers 0", [*h2m, "--workers", "0"], ("--workers", "at least 1")),
        ("h2m --workers -3", [*h2m, "--workers", "-3"], ("--workers",)),
        ("h2m --workers many", [*h2m, "--workers", "many"], ("--workers", "'many'")),
        ("h2m --dtype int7", [*h2m, "--dtype", "int7"], ("--dtype", "int7")),
        ("h2m --format zip", [*h2m, "--format", "zip"], ("--format", "zip")),
        ("h2m unknown flag", [*h2m, "--frobnicate"], ("--frobnicate",)),
        ("h2m partial index.json", ["convert", "hf-to-mcore", w["partial"], out, "--quiet"],
         ("does not list", "model.safetensors.index.json")),
        ("m2h --max-shard-size 0", [*m2h, "--max-shard-size", "0"], ("--max-shard-size", "at least one byte")),
        ("m2h --max-shard-size -1GB", [*m2h, "--max-shard-size", "-1GB"], ("--max-shard-size",)),
        ("m2h --max-shard-size infGB", [*m2h, "--max-shard-size", "infGB"], ("--max-shard-size",)),
        ("m2h --max-shard-size lots", [*m2h, "--max-shard-size", "lots"], ("--max-shard-size", "'lots'")),
        ("m2h missing checkpoint", ["convert", "mcore-to-hf", missing, out], (str(missing),)),
        ("megatron-to-mcore missing", ["convert", "megatron-to-mcore", missing, out, "--from-args"],
         (str(missing),)),
        ("megatron-to-mcore no config", ["convert", "megatron-to-mcore", missing, out], ("--hf-config",)),
        ("reshard --tp -1", ["reshard", ck, out, "--tp", "-1"], ("--tp",)),
        ("reshard --workers 0", ["reshard", ck, out, "--workers", "0"], ("--workers",)),
        ("reshard missing", ["reshard", missing, out], (str(missing),)),
        ("inspect missing", ["inspect", missing], (str(missing),)),
        ("inspect an HF dir", ["inspect", hf], ("not a shardkit checkpoint",)),
        ("verify --tolerance abc", ["verify", ck, "--tolerance", "abc"], ("--tolerance",)),
        ("verify --tolerance nan", ["verify", ck, "--tolerance", "nan"], ("--tolerance",)),
        ("verify --against missing", ["verify", ck, "--quiet", "--against", missing], (str(missing),)),
        ("verify --seq-length 0", ["verify", ck, "--quiet", "--against", hf, "--seq-length", "0"],
         ("--seq-length 0",)),
        ("preprocess missing input", [*pre, "--input", missing], (str(missing),)),
        ("preprocess lone surrogate", [*pre, "--input", root / "surrogate.jsonl"],
         ("surrogate.jsonl line 2", "lone surrogate", "\\ud800")),
        ("preprocess --workers 0", [*pre, "--input", root / "surrogate.jsonl", "--workers", "0"], ("--workers",)),
        ("preprocess no --input", pre, ("--input",)),
        ("plot missing run", ["plot", missing], (str(missing),)),
        ("plot under a regular file", ["plot", w["run"], "-o", f / "x.png"], (str(f), "not a directory")),
        ("plan unknown preset", ["plan", "--model", "nope", "--gpus", "8"], ("'nope'", "preset")),
        ("plan --gpus 0", ["plan", "--model", "llama3-8b", "--gpus", "0"], ("--gpus",)),
        ("plan --gpu-memory lots", [*plan, "--gpu-memory", "lots"], ("--gpu-memory", "'lots'")),
        ("plan --plot under a file", [*plan, "--plot", f / "p.png"], ("--plot",)),
        ("launch bad layout", ["launch", "--layout", "garbage", "--nodes", "1"], ("--layout", "garbage")),
        ("launch batch 63 on dp 4", [*lay, "--load", ck, "--data-path", "x", "--global-batch-size", "63"],
         ("--global-batch-size 63", "data-parallel size 4")),
        ("launch unknown trainer flag", [*lay, "--load", ck, "--frobnicate"], ("--frobnicate",)),
        ("train --lr fast", [*train, "--lr", "fast"], ("--lr", "'fast'")),
        ("train --config lr = 'fast'", [*train, "--config", root / "lr_fast.toml"],
         ("lr_fast.toml", "lr = 'fast'", "expected a number")),
        ("train --config train_iters = 2.5", [*train, "--config", root / "iters_float.toml"],
         ("train_iters = 2.5", "expected an integer")),
        ("train --config missing", [*train, "--config", missing], (str(missing),)),
        ("train --load missing", ["continue-pretrain", "--load", missing, "--data-path", w["data"]],
         (str(missing),)),
        # issue 34: values that parse but mean nothing, and values that would run for hours or exhaust memory
        ("verify --tolerance inf", ["verify", ck, "--quiet", "--against", hf, "--tolerance", "inf"],
         ("--tolerance inf", "finite")),
        ("verify --tolerance -1e-9", ["verify", ck, "--tolerance", "-1e-9"], ("--tolerance",)),
        ("verify --seq-length 1e8", ["verify", ck, "--quiet", "--against", hf, "--seq-length", "100000000"],
         ("--seq-length 100000000",)),
        ("verify --seq-length 9000", ["verify", ck, "--quiet", "--against", hf, "--seq-length", "9000"],
         ("--seq-length 9000",)),
        *[(f"train {flag} {v}", [*train, flag, v], (flag,)) for flag, v in (
            ("--lr", "nan"), ("--lr", "inf"), ("--min-lr", "-inf"), ("--adam-eps", "nan"), ("--adam-eps", "0"),
            ("--adam-beta1", "-0.1"), ("--adam-beta2", "nan"), ("--adam-beta2", "1"), ("--clip-grad", "nan"),
            ("--clip-grad", "-1"), ("--weight-decay", "inf"), ("--distributed-timeout-minutes", "nan"),
            ("--distributed-timeout-minutes", "inf"), ("--distributed-timeout-minutes", "-5"),
            ("--distributed-timeout-minutes", "0"), ("--distributed-timeout-minutes", "1e12"),
            ("--lr-warmup-fraction", "1.5"), ("--hidden-dropout", "1"), ("--attention-dropout", "nan"),
            ("--moe-router-bias-update-rate", "-1e-3"))],
        *[(f"plan {flag} {v}", ["plan", "--model", "llama3-8b", "--gpus", "8", flag, v], (flag,)) for flag, v in (
            ("--network-bandwidth", "inf"), ("--nvlink-bandwidth", "inf"), ("--peak-tflops", "inf"))],
        ("reshard --distributed-timeout-minutes nan", ["reshard", ck, out, "--distributed-timeout-minutes", "nan"],
         ("--distributed-timeout-minutes",)),
        ("h2m --distributed-timeout-minutes -1", [*h2m, "--distributed-timeout-minutes", "-1"],
         ("--distributed-timeout-minutes",)),
        ("plan --gpus 2**40", ["plan", "--model", "llama3-8b", "--gpus", "1099511627776"], ("--gpus",)),
        ("plan --gpus 2**20+8", ["plan", "--model", "llama3-8b", "--gpus", str((1 << 20) + 8)], ("--gpus",)),
        ("plan --gpus-per-node 1e6", ["plan", "--model", "llama3-8b", "--gpus", "8", "--gpus-per-node", "1000000"],
         ("--gpus-per-node",)),
        *[(f"h2m layout {lay}", [*h2m, "--pp", "2", "--pipeline-model-parallel-layout", lay],
           ("--pipeline-model-parallel-layout",)) for lay in (
            "(t)*999999999999", "Et|(t*99999)*99999|L", "Et|t*" + "9" * 60 + "|L", "(Et|)*1048577")],
    ]


CASE_IDS = [c[0] for c in _cases({k: Path("/x") for k in ("hf", "ck", "root", "file", "run", "data", "partial")})]


@pytest.mark.parametrize("case", CASE_IDS)
def test_bad_invocation_is_one_line(case, w, capsys):
    _, argv, words = next(c for c in _cases(w) if c[0] == case)
    rc, err = run_inproc(argv, capsys)
    assert_one_line_error(rc, err, *words)


def test_the_table_is_a_few_dozen():
    assert len(CASE_IDS) >= 40


@pytest.mark.parametrize("case", ["h2m --workers 0", "plot under a regular file", "m2h --max-shard-size infGB"])
def test_bad_invocation_through_the_real_entry_point(case, w):
    _, argv, words = next(c for c in _cases(w) if c[0] == case)
    rc, _, err = run_real(argv)
    assert_one_line_error(rc, err, *words)


# -- the defects that printed a traceback or a misleading line ----------------------------------------------------

def test_duplicate_dcp_chunks_are_named_not_called_incomplete(w, tmp_path, capsys):
    from checkpoint.torch_dist_pickle import load_dcp_metadata

    td = tmp_path / "td"
    assert main(["convert", "hf-to-mcore", str(w["hf"]), str(td), "--format", "torch_dist", "--quiet"]) == 0
    it = next(p for p in td.iterdir() if p.is_dir() and p.name.startswith("iter_"))
    md = load_dcp_metadata(it / ".metadata")
    name = next(n for n, m in md.state_dict_metadata.items() if hasattr(m, "chunks") and m.chunks)
    md.state_dict_metadata[name].chunks.append(md.state_dict_metadata[name].chunks[0])
    (it / ".metadata").write_bytes(pickle.dumps(md))
    rc, err = run_inproc(["reshard", td, tmp_path / "out", "--hf-config", w["hf"], "--quiet"], capsys)
    line = assert_one_line_error(rc, err, name, "stored twice")
    assert "incomplete" not in line


def test_plot_ticks_are_whole_iterations(w, tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from train.metrics import plot_metrics

    captured = {}
    real_close = plt.close

    def keep(fig=None):
        captured["fig"] = fig
        return real_close(fig)

    plt.close = keep
    try:
        plot_metrics(w["run"], tmp_path / "m.png")
    finally:
        plt.close = real_close
    ticks = [t for t in captured["fig"].axes[1].get_xticks() if 1 <= t <= 4]
    assert ticks and all(float(t).is_integer() for t in ticks), ticks


def test_plan_marks_invalid_layouts_and_small_step_times(w, tmp_path, capsys):
    from plan.report import number

    assert number(0.0031, 2) == "0.0031" and number(1.234, 2) == "1.23" and number(0, 2) == "0.00"
    capsys.readouterr()
    png = tmp_path / "plan.png"
    assert main(["plan", "--model", str(w["hf"]), "--gpus", "4", "--top", "2", "--layout", "tp=4,pp=1,dp=1",
                 "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert png.stat().st_size > 0
    assert " 0.00 s/step" not in out and "s/step" in out
    # the plot's labels: the requested tp=4 layout breaks the KV-head constraint and says so
    from plan.report import plot as plot_png

    import matplotlib.pyplot as plt

    labels = []
    real_close = plt.close
    plt.close = lambda fig=None: (labels.extend(t.get_text() for t in fig.axes[0].get_yticklabels()),
                                  real_close(fig))
    try:
        from plan.commands import resolve_model
        from checkpoint.run_layout import RunLayout
        from plan.memory import TrainSettings
        from plan.perf import Hardware
        from plan.search import plan as search

        _, cfg = resolve_model(str(w["hf"]))
        cands = search(cfg, 4, 80 << 30, TrainSettings(), Hardware(),
                       layouts=[RunLayout.parse("tp=4,pp=1,dp=1")])
        plot_png(cands, str(tmp_path / "p2.png"), 80 << 30, "t")
    finally:
        plt.close = real_close
    assert labels and all("INVALID" in t for t in labels), labels


# -- a full disk: one line, one free-space figure, nothing left behind ----------------------------------------------

def _enospc(*_a, **_k):
    import errno
    import os

    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _left_behind(out: Path) -> list[str]:
    return sorted(p.name for p in out.glob("iter_*")) if out.exists() else []


def test_enospc_at_start_leaves_no_empty_partial(w, tmp_path, capsys, monkeypatch):
    import checkpoint.commit as commit

    monkeypatch.setattr(commit, "write_file_atomic", _enospc)  # the job record, the first file written
    out = tmp_path / "out"
    rc, err = run_inproc(["convert", "hf-to-mcore", w["hf"], out, "--quiet"], capsys)
    assert_one_line_error(rc, err, "iter_0000000.partial", "No space left on device")
    assert _left_behind(out) == []


def test_not_enough_space_states_one_free_figure(w, tmp_path, capsys, monkeypatch):
    import collections
    import itertools

    import checkpoint.commit as commit

    usage = collections.namedtuple("usage", "total used free")
    frees = itertools.count(1000, 4096)  # every measurement differs, as on a busy disk
    monkeypatch.setattr(commit.shutil, "disk_usage", lambda p: usage(1 << 30, 0, next(frees)))
    out = tmp_path / "out"
    rc, err = run_inproc(["convert", "hf-to-mcore", w["hf"], out, "--quiet"], capsys)
    line = assert_one_line_error(rc, err, "not enough space", "bytes free")
    assert line.count("free") == 2 and line.count("bytes free") == 1, line  # "...bytes free; free space or..."
    assert _left_behind(out) == []


def test_enospc_mid_write_is_one_line_and_removes_the_partial(w, tmp_path, capsys, monkeypatch):
    import checkpoint.commit as commit

    monkeypatch.setattr(commit.IterationWriter, "mark_done_many", lambda self, ids: _enospc())
    out = tmp_path / "out"
    rc, err = run_inproc(["convert", "hf-to-mcore", w["hf"], out, "--quiet"], capsys)
    line = assert_one_line_error(rc, err, "No space left on device", "partial output was removed")
    assert line.count("bytes free") == 1, line
    assert _left_behind(out) == []


# -- output a person can read -------------------------------------------------------------------------------------

@pytest.mark.parametrize("width", [80, 120])
def test_inspect_shows_whole_tensor_names_and_only_fields_that_apply(w, width):
    import io

    from rich.console import Console

    from checkpoint.progress import print_description
    from checkpoint.reader import Checkpoint, describe

    d = describe(Checkpoint(w["ck"]))
    buf = io.StringIO()
    print_description(d, Console(file=buf, width=width, force_terminal=False))
    text = buf.getvalue()
    assert "…" not in text
    assert all(len(ln) <= width for ln in text.splitlines()), max(text.splitlines(), key=len)
    for r in d["tensors"]:
        assert any(r["name"] in ln for ln in text.splitlines()), r["name"]  # whole, on one line
    assert "moe_" not in text and "q_lora_rank" not in text and "mtp_num_layers" not in text  # a dense llama
    assert "num_query_groups=2" in text


def test_applicable_fields_keep_what_a_moe_model_uses():
    from checkpoint.config import ModelConfig, applicable_fields

    base = dict(model_type="mixtral", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=100, num_local_experts=4,
                num_experts_per_tok=2)
    fields = applicable_fields(ModelConfig.from_hf(base).to_dict())
    assert fields["num_moe_experts"] == 4 and fields["moe_router_topk"] == 2 and "q_lora_rank" not in fields


def test_progress_bar_units_are_one_family_and_items_are_named():
    import io

    from rich.console import Console
    from rich.progress import Progress

    from checkpoint.progress import _BytesColumn, _RateColumn

    p = Progress(console=Console(file=io.StringIO(), force_terminal=True))
    t = p.add_task("x", total=610 << 20)
    task = p.tasks[0]
    assert str(_RateColumn().render(task)) == "?"
    p.update(t, advance=10 << 20)
    task._progress.clear()  # two timed samples: 10 MiB, then 30 MiB one second later
    from rich.progress import ProgressSample

    task._progress.extend([ProgressSample(100.0, 10 << 20), ProgressSample(101.0, 20 << 20)])
    assert str(_BytesColumn().render(task)) == "10.0/610.0 MiB"
    assert str(_RateColumn().render(task)) == "20.0 MiB/s"
    p.stop()


def test_conversion_progress_moves_with_each_chunk_written(w, tmp_path, monkeypatch):
    """Bytes reach the bar as each chunk is written (not when a batch of them is fsynced), and the chunk count
    with them; the total adds up."""
    import contextlib

    import convert.writer as writer

    calls = []

    class Bar:
        def advance(self, nbytes, items=0):
            calls.append((nbytes, items))

    @contextlib.contextmanager
    def fake_bar(label, total, items, disable=False, unit="chunks"):
        calls.append(("total", total, items, unit))
        yield Bar()

    monkeypatch.setattr(writer, "progress_bar", fake_bar)
    assert main(["convert", "hf-to-mcore", str(w["hf"]), str(tmp_path / "o")]) == 0
    head, *steps = calls
    _, total, items, unit = head
    assert unit == "chunks" and items > 1
    per_chunk = [c for c in steps if c[0] > 0 and c[1] == 1]
    assert len(per_chunk) == items  # one update per chunk
    assert sum(c[0] for c in steps) == total and sum(c[1] for c in steps) == items


def test_stderr_stays_empty_and_transformers_load_report_does_not_leak(w, tmp_path):
    """Piped stderr (a log file, CI) gets no progress bar remnants or blank lines; `verify --against` a model
    directory holding a tensor transformers does not load (as DeepSeek-V3's MTP layers) prints no LOAD REPORT."""
    import shutil

    from safetensors.torch import load_file, save_file

    hf = Path(shutil.copytree(w["hf"], tmp_path / "hf"))
    tensors = load_file(str(hf / "model.safetensors"))
    tensors["model.layers.2.extra.weight"] = tensors["model.norm.weight"].clone()
    save_file(tensors, str(hf / "model.safetensors"), metadata={"format": "pt"})
    out = tmp_path / "ck"
    rc, stdout, err = run_real(["convert", "hf-to-mcore", w["hf"], out])
    assert rc == 0 and err == "", err
    rc, stdout, err = run_real(["verify", out, "--against", hf])
    assert rc == 0 and err == "", err
    assert "LOAD REPORT" not in stdout and "UNEXPECTED" not in stdout and "OK" in stdout


# -- issue 34: launch scripts take no shell text, paths are local and resolved ----------------------------------------

def _issue34_cases(w: dict[str, Path]) -> list[tuple[str, list, tuple[str, ...]]]:
    hf, ck, root = w["hf"], w["ck"], w["root"]
    out = root / "out34"
    lay = ["launch", "--layout", "tp=2,pp=1,dp=4", "--nodes", "1"]
    train = ["--", "--load", ck, "--save", root / "run34", "--data-path", w["data"]]
    return [
        # (f) shell injection through a rendered value: refused, naming the flag (dry run and real write alike)
        ("launch --master-addr $(...)", [*lay, "--dry-run", "--master-addr", "$(touch /tmp/pwned)", *train],
         ("--master-addr", "$(touch /tmp/pwned)")),
        ("launch --master-addr backticks", [*lay, "--out", out, "--master-addr", "`id`", *train], ("--master-addr",)),
        ("launch --master-addr with a space", [*lay, "--dry-run", "--master-addr", "host; reboot", *train],
         ("--master-addr",)),
        ("launch --master-port 70000", [*lay, "--dry-run", "--master-port", "70000", *train], ("--master-port",)),
        ("launch --out with a newline", [*lay, "--out", f"{out}\nrm -rf ~", *train], ("--out", "\\n")),
        ("launch --time with a newline", [*lay, "--dry-run", "--time", "1:00:00\n", *train], ("--time", "\\n")),
        ("launch --time with a newline inside", [*lay, "--dry-run", "--time", "1\n#SBATCH --x", *train],
         ("--time",)),
        ("launch --sbatch with a newline", [*lay, "--out", out, "--sbatch", "constraint=h100\necho hi", *train],
         ("--sbatch", "\\n")),
        ("launch --signal with a newline", [*lay, "--dry-run", "--signal", "USR1@300\n", *train], ("--signal",)),
        ("launch trainer arg with a newline", [*lay, "--dry-run", "--", "--load", ck, "--save", "a\nrm -rf ~",
                                               "--data-path", w["data"]], ("after `--`", "\\n")),
        # (h) object storage URLs: refused as such, never a local directory named "s3:"
        # (s3:// and gs:// checkpoint locations are object storage, issue 38: tests/test_object_storage.py)
        ("h2m OUT az://", ["convert", "hf-to-mcore", hf, "az://bucket/x", "--quiet"], ("az://bucket/x", "not supp")),
        ("reshard SRC msc://", ["reshard", "msc://bucket/ck", out, "--quiet"], ("msc://bucket/ck", "not supported")),
        ("m2h OUT https://", ["convert", "mcore-to-hf", ck, "https://host/x", "--quiet"], ("https://host/x",)),
        ("verify --against s3://", ["verify", ck, "--against", "s3://b/hf", "--quiet"], ("--against", "s3://b/hf")),
        ("reshard --hf-config=s3://", ["reshard", ck, out, "--hf-config=s3://b/hf"], ("--hf-config", "s3://b/hf")),
        ("train --load az://", ["continue-pretrain", "--load", "az://b/ck", "--data-path", w["data"]],
         ("--load", "az://b/ck")),
        ("train --data-path az://", ["continue-pretrain", "--load", ck, "--data-path", "az://c/data"],
         ("az://c/data",)),
        ("launch --load s3:// after --", [*lay, "--dry-run", "--", "--load", "s3://b/ck", "--save", out],
         ("--load", "s3://b/ck")),
    ]


ISSUE34_IDS = [c[0] for c in _issue34_cases({k: Path("/x") for k in ("hf", "ck", "root", "data")})]


@pytest.mark.parametrize("case", ISSUE34_IDS)
def test_issue34_bad_invocation_is_one_line(case, w, capsys):
    _, argv, words = next(c for c in _issue34_cases(w) if c[0] == case)
    rc, err = run_inproc(argv, capsys)
    assert_one_line_error(rc, err, *words)
    assert not (w["root"] / "out34").exists() and not Path("s3:").exists() and not Path("/tmp/pwned").exists()
    assert not any(Path(".").glob("*:")), "a directory named after a URL scheme was created"


def test_paths_with_dotdot_components_work(w, tmp_path, capsys, monkeypatch):
    """A native path with `..` components (relative or absolute) is resolved before tensorstore sees it: convert,
    verify, reshard and export all work, where tensorstore alone refuses "Invalid file path"."""
    (tmp_path / "a" / "b").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "a" / "b")
    import os

    hf = os.path.relpath(w["hf"])  # ../../../notb0/hf: the HF side with `..` components too
    assert hf.startswith("..")
    for argv in (["convert", "hf-to-mcore", hf, "../../a/../ck", "--quiet", "--no-verify"],
                 ["verify", "../b/../../ck", "--quiet"],
                 ["reshard", f"{tmp_path}/a/../ck", "../rs", "--tp", "2", "--quiet"],
                 ["inspect", "../../a/rs"],
                 ["convert", "mcore-to-hf", "../rs/.", "../../a/b/../hf", "--quiet"]):
        rc, err = run_inproc(argv, capsys)
        assert rc == 0 and err.strip() == "", (argv, err)
    assert (tmp_path / "ck" / "latest").is_file() and (tmp_path / "a" / "rs" / "latest").is_file()
    assert (tmp_path / "a" / "hf" / "model.safetensors").is_file()


def test_native_overwrite_into_a_torch_dist_root_is_refused(w, tmp_path, capsys):
    """Megatron's tracker would keep winning every read of that root: refused with one line, nothing changed."""
    import hashlib

    td = tmp_path / "td"
    assert main(["convert", "hf-to-mcore", str(w["hf"]), str(td), "--format", "torch_dist", "--quiet"]) == 0

    def snap() -> dict:
        return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "d" for p in td.rglob("*")}

    before = snap()
    for argv in (["reshard", w["ck"], td, "--overwrite", "--quiet"],
                 ["convert", "hf-to-mcore", w["hf"], td, "--overwrite", "--quiet", "--no-verify"]):
        rc, err = run_inproc(argv, capsys)
        assert_one_line_error(rc, err, "latest_checkpointed_iteration.txt", str(td))
        assert snap() == before and not (td / "latest").exists()


# -- issue 34 (g): a requeued job resumes from --save whatever format it saves in ---------------------------------------

@pytest.mark.parametrize("saved,resumes", [("latest", True), ("latest_checkpointed_iteration.txt", True),
                                           (None, False), ("iter_0000002", False)])
def test_requeue_resumes_a_native_or_torch_dist_save(tmp_path, saved, resumes):
    """The rendered resume block, run by bash: --save holding `latest` (native) or Megatron's tracker (torch_dist)
    is loaded; a --save holding neither (nothing saved yet, or an iteration without its pointer) loads --load."""
    from checkpoint.run_layout import RunLayout
    from plan.launch import LaunchSpec, render_scripts

    save, load = tmp_path / "my run", tmp_path / "ck"
    save.mkdir()
    if saved is not None:
        (save / saved).mkdir() if saved.startswith("iter_") else (save / saved).write_text("2\n")
    spec = LaunchSpec(RunLayout(tp=1, dp=1), 1, 1, ("--load", str(load), "--save", str(save)), requeue=True)
    text = render_scripts(spec)["torchrun.sh"]
    block = text[text.index("SHARDKIT_LOAD="):text.index("fi\n", text.index("SHARDKIT_LOAD=")) + 3]
    got = subprocess.run(["bash", "-c", block + 'printf %s "$SHARDKIT_LOAD"'], capture_output=True, text=True,
                         check=True).stdout
    assert got == str(save if resumes else load)


# -- issue 34 (g): small lines that named the wrong thing, or nothing -----------------------------------------------

class _FullDisk:
    """A shard file whose writes fail with ENOSPC after `after` bytes (a disk that fills mid-export)."""

    def __init__(self, f, after: int):
        self.f, self.left = f, after

    def write(self, b) -> int:
        import errno
        import os

        if len(b) > self.left:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.left -= len(b)
        return self.f.write(b)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


@pytest.mark.parametrize("after", [0, 4096])
@pytest.mark.parametrize("into", [False, True])
def test_full_disk_in_mcore_to_hf_names_the_file_and_the_bytes(w, tmp_path, capsys, monkeypatch, after, into):
    import builtins

    import convert.mcore_to_hf as m2h

    real_open = builtins.open

    def opening(path, mode="r", *a, **k):
        f = real_open(path, mode, *a, **k)
        return _FullDisk(f, after) if str(path).endswith(".safetensors") and "w" in mode else f

    monkeypatch.setattr(m2h, "open", opening, raising=False)
    out = tmp_path / "out"
    if into:
        out.mkdir()
        (out / "notes.txt").write_text("mine\n")
    rc, err = run_inproc(["convert", "mcore-to-hf", w["ck"], out, "--quiet", "--max-shard-size", "64KB",
                          *(["--overwrite"] if into else [])], capsys)
    line = assert_one_line_error(rc, err, str(out), "model-00001-of-", ".safetensors", "No space left on device",
                                 "bytes free")
    assert "it needs" in line and line.count("bytes free") == 1, line
    assert not list(out.glob("*.safetensors")) if out.exists() else True
    if into:
        assert (out / "notes.txt").read_text() == "mine\n"


@pytest.mark.parametrize("flags,words,never", [
    (["--pp", "2", "--decoder-first-pipeline-num-layers", "5"], ["the last stage", "--pp 2"], "middle"),
    (["--pp", "2", "--decoder-last-pipeline-num-layers", "5"], ["the first stage", "--pp 2"], "middle"),
    (["--pp", "2", "--decoder-first-pipeline-num-layers", "1", "--decoder-last-pipeline-num-layers", "2"],
     ["no middle stage"], "1 middle"),
])
def test_uneven_split_lines_name_the_stages_there_are(w, tmp_path, capsys, flags, words, never):
    rc, err = run_inproc(["convert", "hf-to-mcore", w["hf"], tmp_path / "out", "--quiet", *flags], capsys)
    line = assert_one_line_error(rc, err, *words)
    assert never not in line, line


@pytest.mark.parametrize("where", ["common.pt", "tracker"])
@pytest.mark.parametrize("cmd", ["inspect", "reshard", "mcore-to-hf"])
def test_huge_iteration_is_refused_not_used_as_a_name(w, tmp_path, capsys, where, cmd):
    from checkpoint.torch_dist_pickle import load_common
    from checkpoint.torch_dist_write import write_common

    td = tmp_path / "td"
    assert main(["reshard", str(w["ck"]), str(td), "--format", "torch_dist", "--quiet"]) == 0
    it = next(td.glob("iter_*"))
    if where == "common.pt":
        common, _ = load_common(it / "common.pt")
        common["iteration"] = 10**30
        write_common(it, common)
    else:
        (td / "latest_checkpointed_iteration.txt").write_text("9" * 40)
    out = tmp_path / "out"
    argv = {"inspect": ["inspect", td], "reshard": ["reshard", td, out, "--quiet"],
            "mcore-to-hf": ["convert", "mcore-to-hf", td, out, "--quiet"]}[cmd]
    rc, err = run_inproc(argv, capsys)
    assert_one_line_error(rc, err, "common.pt" if where == "common.pt" else "latest_checkpointed_iteration.txt")
    assert not (out.exists() and any("0" * 25 in p.name for p in out.iterdir()))


def test_urls_in_a_config_file_are_refused_too(w, tmp_path, capsys):
    """continue-pretrain's TOML --config values are paths like the flags: a URL there is the same one line."""
    for key, value, flag in (("load", "az://b/ck", "--load"), ("save", "msc://b/run", "--save"),
                             ("data_path", ["s3://b/data"], "--data-path")):
        cfg = tmp_path / f"{key}.toml"
        cfg.write_text(f"{key} = {json.dumps(value)}\n")
        argv = ["continue-pretrain", "--config", cfg, "--train-iters", "1"]
        argv += [] if key == "load" else ["--load", w["ck"]]
        argv += [] if key == "data_path" else ["--data-path", w["data"]]
        rc, err = run_inproc(argv, capsys)
        assert_one_line_error(rc, err, flag, value if isinstance(value, str) else value[0], "not supported")


@pytest.mark.parametrize("host", ["127.0.0.1", "node-01.cluster.local", "gpu_node01", "::1", "[fe80::1]"])
def test_launch_takes_real_rank0_addresses(host, tmp_path):
    """What --master-addr refuses is shell text, not real host names or addresses: rendered quoted, valid bash, and
    the address is what the script exports."""
    from checkpoint.run_layout import RunLayout
    from plan.launch import LaunchSpec, render_scripts

    spec = LaunchSpec(RunLayout(tp=1, dp=1), 1, 1, ("--load", "ck", "--save", "run"), master_addr=host)
    script = tmp_path / "torchrun.sh"
    script.write_text(render_scripts(spec)["torchrun.sh"])
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    block = text[text.index("MASTER_ADDR="):text.index("\n", text.index("MASTER_ADDR="))]
    got = subprocess.run(["bash", "-c", f"unset MASTER_ADDR; {block}; printf %s \"$MASTER_ADDR\""], capture_output=True,
                         text=True, check=True).stdout
    assert got == host


def test_a_write_error_not_about_space_does_not_blame_space(w, tmp_path, capsys, monkeypatch):
    """A failure with another cause (here: the path tensorstore refused before issue 34 resolved `..`) is one line
    with that cause, not a free-space note suggesting "a file size limit or quota"."""
    from checkpoint import store

    def refuse(path, *a, **k):
        raise ValueError(f'Error parsing object member "kvstore": Invalid file path: "{path}"')

    monkeypatch.setattr(store, "create", refuse)
    rc, err = run_inproc(["convert", "hf-to-mcore", w["hf"], tmp_path / "out", "--quiet", "--no-verify", "--workers",
                          "1"], capsys)
    line = assert_one_line_error(rc, err, "Invalid file path")
    assert "bytes free" not in line and "quota" not in line, line


_RESUME = "shardkit: interrupted; rerun the same command to resume"
# (argv, the interrupted line): a rerun is promised only where the command resumes (a writer's partial output, a
# training run's saves); a read-only command (inspect, verify, plan) says it was interrupted, nothing more
INTERRUPTED_LINES = {
    "inspect": (["inspect", "/nonexistent"], "shardkit: interrupted"),
    "verify": (["verify", "/nonexistent"], "shardkit: interrupted"),
    "verify-against": (["verify", "/nonexistent", "--against", "/nonexistent-hf"], "shardkit: interrupted"),
    "plan": (["plan", "--model", "llama3-8b", "--gpus", "8"], "shardkit: interrupted"),
    "convert": (["convert", "hf-to-mcore", "/nonexistent", "/nonexistent-out", "--no-verify"], _RESUME),
    "reshard": (["reshard", "/nonexistent", "/nonexistent-out"], _RESUME),
}


@pytest.mark.parametrize("cmd", list(INTERRUPTED_LINES))
@pytest.mark.parametrize("wrapped", ["plain", "import", "set_name"])
def test_ctrl_c_inside_an_import_is_one_line(monkeypatch, capsys, wrapped, cmd):
    """Ctrl-C while a command imports: a compiled module's init (tensorstore's pybind11) turns the interrupt into its
    ImportError, a class body's __set_name__ into a RuntimeError, each chaining it; every form is the one
    `interrupted` line and status 130, not a traceback (issue 42's proof process, started at parse time, made the
    window easy to hit). The line asks for a rerun only of a command that resumes: `shardkit verify` is read-only."""
    import shardkit.cli as cli

    def interrupted(*_a, **_k):
        if wrapped == "plain":
            raise KeyboardInterrupt
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as ki:
            if wrapped == "import":
                raise ImportError("initialization failed") from ki
            raise RuntimeError("Error calling __set_name__ on 'Field' instance")  # (implicitly chained)

    monkeypatch.setattr(cli, "_refuse_urls", interrupted)
    argv, line = INTERRUPTED_LINES[cmd]
    assert main(argv) == 130
    assert capsys.readouterr().err.splitlines() == [line]


def test_an_error_that_is_no_interrupt_still_raises(monkeypatch):
    """A fault of ours that is not an interrupt is not dressed up as one."""
    import shardkit.cli as cli

    monkeypatch.setattr(cli, "_refuse_urls", lambda *a, **k: (_ for _ in ()).throw(ImportError("no module x")))
    with pytest.raises(ImportError, match="no module x"):
        main(["inspect", "/nonexistent"])
