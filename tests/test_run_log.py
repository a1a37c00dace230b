"""The run says what it is doing (issue 15): one start-up block (model, layout, precision, attention, data, tokens per
step, load and save), `loaded checkpoint ...`, `saved checkpoint iteration N in S s` per save (for --async-save once
the background commit finished) and a final line naming the last complete checkpoint. Content only, not timing."""
from __future__ import annotations

import re

import pytest

from tests.test_train import launch, setup  # noqa: F401  (the module fixture: tiny LLaMA + corpus)

FLAGS = ["--seq-length", "32", "--micro-batch-size", "1", "--global-batch-size", "4", "--lr", "1e-3", "--seed", "7",
         "--train-iters", "4", "--save-interval", "1",
         "--attention-dropout", "0", "--hidden-dropout", "0"]


def _block(stdout: str) -> list[str]:
    return [ln for ln in stdout.splitlines() if not ln.startswith("iteration ")]


def test_start_up_block_and_checkpoint_lines(setup, tmp_path):  # noqa: F811
    save, data, ck = tmp_path / "run", setup / "data", setup / "ck"
    first = launch(1, "--load", str(ck), "--data-path", "0.25", str(data), "0.75", str(data), "--save", str(save),
                   *FLAGS, "--exit-interval", "2", "--bf16")
    lines = _block(first.stdout)
    start = lines.index(next(ln for ln in lines if ln.startswith("model: ")))
    got = lines[start:start + 11]
    assert got[0] == ("model: llama, 961,664 parameters, 4 layers, hidden 128, ffn 352, 8 heads / 2 query groups, "
                      "vocab 1000 (padded 1024 for TP 1)"), got[0]
    assert got[1] == ("layout: TP 1, PP 1, VPP 1, DP 1, CP 1, EP 1, SP off (1 rank, CPU); recompute: none (no "
                      "--recompute-granularity)")
    assert got[2].startswith("precision: bf16 (fp32 main weights, grads and optimizer state); FP8 off; backend "), got
    assert got[3].startswith("attention: "), got
    assert re.fullmatch(r"data: 2 prefixes, \d+ train samples of 32 tokens \(seed 7, split 969,30,1\)", got[4]), got
    assert re.fullmatch(rf"  {re.escape(str(data))}: weight 0\.25, \d+ samples, 1 epoch of \d+ documents", got[5])
    assert re.fullmatch(rf"  {re.escape(str(data))}: weight 0\.75, \d+ samples, 1 epoch of \d+ documents", got[6])
    assert got[7] == "tokens per step: 128 (global batch 4 x seq length 32; micro batch 1, 4 micro-batches per DP rank)"
    assert got[8] == f"load: {ck / 'iter_0000000'}"
    assert got[9] == f"save: {save} (every iteration and at the end)"
    assert got[10] == (f"loaded checkpoint {ck / 'iter_0000000'} at iteration 0 (consumed samples 0, optimizer state: "
                       "no; weights only)")
    for it in (1, 2):
        assert sum(bool(re.fullmatch(rf"saved checkpoint iteration {it} in \d+\.\d\d s: "
                                     rf"{re.escape(str(save / f'iter_000000{it}'))}", ln)) for ln in lines) == 1
    assert lines[-1] == f"done at iteration 2: last complete checkpoint {save / 'iter_0000002'}"

    # resumed, saving in the background: the loaded line carries the training state
    second = launch(1, "--load", str(save), "--data-path", "0.25", str(data), "0.75", str(data), "--save", str(save),
                    *FLAGS, "--bf16", "--async-save")
    lines = _block(second.stdout)
    assert (f"loaded checkpoint {save / 'iter_0000002'} at iteration 2 (consumed samples 8, optimizer state: yes)"
            in lines), lines
    assert f"save: {save} (every iteration and at the end, async)" in lines
    for it in (3, 4):
        assert sum(bool(re.fullmatch(rf"saved checkpoint iteration {it} in \d+\.\d\d s \(async\): "
                                     rf"{re.escape(str(save / f'iter_000000{it}'))}", ln)) for ln in lines) == 1, lines
    assert lines[-1] == f"done at iteration 4: last complete checkpoint {save / 'iter_0000004'}"
    assert second.stdout.count("model: llama") == 1  # one block


def _parsers(parser, path=()):
    import argparse

    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, path + (name,))


def test_every_flag_help_shows_its_default():
    """`--help` of every subcommand names each flag's default; the trainer's show the dataclass defaults, not the
    None that argparse holds so that a --config TOML value is not overridden."""
    from shardkit.cli import build_parser

    seen = 0
    for path, parser in _parsers(build_parser()):
        text = parser.format_help()  # first: continue-pretrain's flags are added when it is first used
        for action in parser._actions:
            if not action.option_strings or action.dest == "help" or action.help == "==SUPPRESS==":
                continue  # (hidden: continue-pretrain's other Megatron-LM flags, docs/TRAINING_FLAGS.md)
            seen += 1
            helptext = parser._get_formatter()._expand_help(action) if action.help else ""
            assert "default" in helptext.lower(), (path, action.option_strings, helptext)
        assert "Traceback" not in text
    assert seen > 150
    cpt = build_parser()._subparsers._group_actions[0].choices["continue-pretrain"]
    cpt.format_help()
    helps = {a.option_strings[0]: cpt._get_formatter()._expand_help(a) for a in cpt._actions if a.option_strings}
    assert helps["--tensor-model-parallel-size"] == "(default: 1)"
    assert helps["--seq-length"] == "(default: 1024)" and helps["--global-batch-size"] == "(default: 8)"
    assert helps["--no-check-for-nan-in-loss-and-grad"].endswith("(default: off)")
    assert helps["--sequence-parallel"] == "(default: off)" and helps["--save"].endswith("(default: none)")


FAKE_WANDB = '''"""A test double for wandb: records init/log/finish calls as JSON lines in $FAKE_WANDB_LOG."""
import json
import os


def _record(call, **kw):
    with open(os.environ["FAKE_WANDB_LOG"], "a") as f:
        f.write(json.dumps({"call": call, **kw}) + "\\n")


class _Run:
    def log(self, data, step=None):
        _record("log", data=data, step=step)

    def finish(self):
        _record("finish")


def init(**kw):
    _record("init", **{k: v for k, v in kw.items() if k != "config"}, config_keys=sorted(kw.get("config") or {}))
    return _Run()
'''


def _run_cli(args, env_extra):
    import os
    import subprocess
    import sys

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **env_extra)
    env.pop("WANDB_MODE", None)
    return subprocess.run([sys.executable, "-m", "shardkit", "continue-pretrain", *args], capture_output=True,
                          text=True, timeout=600, env=env)


def test_wandb_gets_the_same_metrics(setup, tmp_path):  # noqa: F811
    """wandb is not a dependency (and not installed here): a fake module on PYTHONPATH records what the trainer
    sends; it must be what metrics.jsonl holds, step for step."""
    import json
    import os

    from train.metrics import _online

    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "wandb.py").write_text(FAKE_WANDB)
    calls_file, save = tmp_path / "calls.jsonl", tmp_path / "run"
    r = _run_cli(["--load", str(setup / "ck"), "--data-path", str(setup / "data"), "--save", str(save), "--seq-length",
                  "32", "--global-batch-size", "4", "--train-iters", "3", "--wandb-project", "proj",
                  "--wandb-exp-name", "exp1"],
                 {"PYTHONPATH": os.pathsep.join([str(fake), os.environ.get("PYTHONPATH", "")]),
                  "FAKE_WANDB_LOG": str(calls_file)})
    assert r.returncode == 0, r.stderr[-3000:]
    calls = [json.loads(ln) for ln in calls_file.read_text().splitlines()]
    init, logs, finish = calls[0], calls[1:-1], calls[-1]
    assert init["call"] == "init" and init["project"] == "proj" and init["name"] == "exp1"
    assert init["dir"] == str(save / "wandb") and (save / "wandb").is_dir()  # Megatron's default: <save>/wandb
    assert init["mode"] == ("online" if _online() else "offline")
    assert "optimizer.lr" in init["config_keys"] and "run.wandb_project" in init["config_keys"]
    assert finish == {"call": "finish"}
    jsonl = [json.loads(ln) for ln in (save / "metrics.jsonl").read_text().splitlines()]
    assert [c["step"] for c in logs] == [rec["iteration"] for rec in jsonl] == [1, 2, 3]
    for c, rec in zip(logs, jsonl):
        want = {k: v for k, v in rec.items() if k not in ("iteration", "time") and isinstance(v, (int, float))
                and not isinstance(v, bool)}
        assert c["data"] == want and {"loss", "lr", "grad_norm"} <= set(want)


def test_wandb_flag_without_wandb_is_one_line(setup, tmp_path):  # noqa: F811
    import importlib.util

    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    r = _run_cli(["--load", str(setup / "ck"), "--data-path", str(setup / "data"), "--seq-length", "32",
                  "--global-batch-size", "4", "--train-iters", "1", "--wandb-project", "proj"], {})
    assert r.returncode == 1 and "iteration 1" not in r.stdout
    assert r.stderr.strip() == ("shardkit: error: --wandb-project proj: wandb is not installed (pip install wandb, "
                                "or drop the flag)"), r.stderr[-2000:]


def test_start_up_block_names_recompute_and_emulated_fp8(setup, tmp_path):  # noqa: F811
    """Issue 37: the block says which recompute runs (--recompute-granularity and megatron-core's method) and that
    FP8 on the CPU is emulated (its numerics, not its speed)."""
    r = launch(1, "--load", str(setup / "ck"), "--data-path", str(setup / "data"), *FLAGS[:10],
               "--attention-dropout", "0", "--hidden-dropout", "0", "--train-iters", "1", "--fp8-format", "hybrid", "--recompute-granularity", "full",
               "--recompute-method", "uniform", "--recompute-num-layers", "2")
    lines = _block(r.stdout)
    layout = next(ln for ln in lines if ln.startswith("layout: "))
    assert layout.endswith("(1 rank, CPU); recompute: full (--recompute-granularity full: runs of 2 layers)"), layout
    precision = next(ln for ln in lines if ln.startswith("precision: "))
    assert ("FP8 hybrid, delayed recipe (emulated on the CPU: the FP8 values multiplied in fp32, FP8's numerics, not "
            "its speed)") in precision, precision
