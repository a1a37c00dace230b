"""Files shardkit did not write are never touched (issue 14).

- A tree of user files (data/, train.sh, README, eval_results/, nested, plus a file named like a shard that no index
  of ours listed) inside each command's output survives every `--overwrite`, byte for byte.
- An output that is, lies inside or contains an input is refused with one line before anything is written, for
  every writing command.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from shardkit.cli import main

TINY = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=96, vocab_size=300)
USER_FILES = {
    "train.sh": b"#!/bin/sh\ntorchrun ...\n",
    "README": b"my notes\n",
    "data/corpus.jsonl": b'{"text": "hello"}\n',
    "data/nested/deep/x.bin": bytes(range(256)) * 4,
    "eval_results/mmlu.json": b'{"acc": 0.5}\n',
    "model-00007-of-00009.safetensors": b"not ours: no index of ours named it",
    "iter_notes.txt": b"an iteration-looking name that is not one\n",
}


def tree(root: Path) -> dict[str, str]:
    """Every file and directory under `root` -> sha256 of its bytes ('dir' for directories)."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        out[rel] = "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def plant(root: Path) -> dict[str, str]:
    for rel, data in USER_FILES.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return {k: v for k, v in tree(root).items() if k.split("/")[0] in {r.split("/")[0] for r in USER_FILES}}


def run(argv, capsys) -> tuple[int, list[str]]:
    capsys.readouterr()
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err
    return rc, [ln for ln in err.splitlines() if ln.strip()]


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> dict[str, Path]:
    from shardkit.demo import build_tiny_llama
    from train.data import write_indexed

    root = tmp_path_factory.mktemp("user-files")
    hf = build_tiny_llama(root / "hf", **TINY)
    (hf / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 64}))
    assert main(["convert", "hf-to-mcore", str(hf), str(root / "ck"), "--quiet", "--no-verify"]) == 0
    rng = np.random.default_rng(0)
    (root / "data").mkdir()
    write_indexed(root / "data" / "corpus", [rng.integers(3, 200, size=40) for _ in range(32)], np.uint16)
    from shardkit.demo import save_tiny_tokenizer

    save_tiny_tokenizer(root / "tok", 1000)
    (root / "in.jsonl").write_text("".join(json.dumps({"text": "the model shard tensor"}) + "\n" for _ in range(8)))
    (root / "run").mkdir()
    (root / "run" / "metrics.jsonl").write_text("".join(json.dumps({"iteration": i, "loss": 3.0 - i / 10,
                                                                    "lr": 1e-4}) + "\n" for i in range(1, 6)))
    return {"hf": hf, "ck": root / "ck", "data": root / "data" / "corpus", "root": root,
            "legacy": _legacy_from(root / "ck", root / "legacy"), "tok": root / "tok", "jsonl": root / "in.jsonl",
            "run": root / "run"}


def _legacy_from(ck: Path, root: Path) -> Path:
    """A Megatron-LM `--ckpt-format torch` root at tp = pp = 1 holding the native checkpoint's weights (per-layer
    keys, TE naming), for megatron-to-mcore."""
    import argparse

    import torch

    from checkpoint.reader import Checkpoint

    sd = {}
    for name, t in Checkpoint(ck).state_dict().items():
        if name.startswith("decoder.layers."):
            sd.update({name.replace("decoder.layers.", f"decoder.layers.{i}.", 1): t[i].clone()
                       for i in range(t.shape[0])})
        else:
            sd[name] = t.clone()
    (root / "iter_0000001" / "mp_rank_00").mkdir(parents=True)
    (root / "latest_checkpointed_iteration.txt").write_text("1")
    torch.save({"args": argparse.Namespace(tensor_model_parallel_size=1, pipeline_model_parallel_size=1),
                "model": sd, "iteration": 1, "checkpoint_version": 3.0},
               root / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt")
    return root


# -- --overwrite keeps the user's files --------------------------------------------------------------------------

WRITERS = {
    "hf-to-mcore": lambda g, out: ["convert", "hf-to-mcore", g["hf"], out, "--quiet", "--no-verify", "--overwrite"],
    "hf-to-mcore-torch_dist": lambda g, out: ["convert", "hf-to-mcore", g["hf"], out, "--format", "torch_dist",
                                              "--quiet", "--overwrite"],
    "reshard": lambda g, out: ["reshard", g["ck"], out, "--tp", "2", "--quiet", "--overwrite"],
    "reshard-torch_dist": lambda g, out: ["reshard", g["ck"], out, "--format", "torch_dist", "--quiet",
                                          "--overwrite"],
    "mcore-to-hf": lambda g, out: ["convert", "mcore-to-hf", g["ck"], out, "--quiet", "--overwrite"],
    "megatron-to-mcore": lambda g, out: ["convert", "megatron-to-mcore", g["legacy"], out, "--hf-config", g["hf"],
                                         "--quiet", "--overwrite"],
    # commands that write named files into a directory: everything else there stays
    "preprocess-data": lambda g, out: ["preprocess-data", "--input", g["jsonl"], "--tokenizer", g["tok"],
                                       "--output-prefix", out / "corpus", "--quiet"],
    "plot": lambda g, out: ["plot", g["run"] / "metrics.jsonl", "-o", out / "metrics.png"],
    "plan-plot": lambda g, out: ["plan", "--model", "llama3-8b", "--gpus", "8", "--top", "2", "--plot",
                                 out / "plan.png"],
    "launch": lambda g, out: ["launch", "--layout", "tp=1,pp=1,dp=8", "--nodes", "1", "--out", out, "--",
                              "--load", g["ck"], "--data-path", g["data"], "--save", out / "run"],
}


@pytest.mark.parametrize("cmd", list(WRITERS))
def test_user_files_survive_overwrite(good, tmp_path, capsys, cmd):
    out = tmp_path / "out"
    out.mkdir()
    before = plant(out)
    for attempt in range(2):  # into the user's directory, then over our own earlier output
        rc, err = run(WRITERS[cmd](good, out), capsys)
        assert rc == 0, err
        after = tree(out)
        assert {k: after.get(k) for k in before} == before, f"attempt {attempt}: user files changed"


def test_mcore_to_hf_replaces_only_its_own_shards(good, tmp_path, capsys):
    """A sharded export, then a single-file one over it: the earlier shards (listed in the earlier index, named
    model-XXXXX-of-YYYYY) and index go; the user's files, including a shard-named file no index listed, stay; the
    result loads in transformers."""
    out = tmp_path / "hf"
    out.mkdir()
    before = plant(out)
    rc, err = run(["convert", "mcore-to-hf", good["ck"], out, "--quiet", "--overwrite", "--max-shard-size", "40KB"],
                  capsys)
    assert rc == 0, err
    old = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    old_shards = set(old.values())
    assert len(old_shards) > 1 and all((out / s).exists() for s in old_shards)
    rc, err = run(["convert", "mcore-to-hf", good["ck"], out, "--quiet", "--overwrite"], capsys)
    assert rc == 0, err
    after = tree(out)
    assert {k: after.get(k) for k in before} == before
    assert not (out / "model.safetensors.index.json").exists()
    assert not any((out / s).exists() for s in old_shards)
    assert (out / "model.safetensors").exists() and (out / "tokenizer_config.json").exists()
    assert not (out / ".shardkit-export.partial").exists()
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(out)


def test_mcore_to_hf_without_overwrite_refuses_a_non_empty_dir(good, tmp_path, capsys):
    out = tmp_path / "hf"
    out.mkdir()
    before = plant(out)
    rc, err = run(["convert", "mcore-to-hf", good["ck"], out, "--quiet"], capsys)
    assert rc == 1 and len(err) == 1 and "--overwrite" in err[0], err
    assert tree(out) == before


def test_training_save_keeps_user_files(good, tmp_path, capsys):
    save = tmp_path / "run"
    save.mkdir()
    before = plant(save)
    rc, err = run(["continue-pretrain", "--load", good["ck"], "--data-path", good["data"], "--save", save,
                   "--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "1",
                   "--lr", "1e-4"], capsys)
    assert rc == 0, err
    after = tree(save)
    assert {k: after.get(k) for k in before} == before
    assert (save / "latest").exists()


# -- an output that is, contains or lies inside an input is refused ----------------------------------------------

def _h2m(src, out, *x):
    return ["convert", "hf-to-mcore", src, out, "--quiet", "--no-verify", "--overwrite", *x]


def _train(g, save, load=None, data=None):
    return ["continue-pretrain", "--load", load or g["ck"], "--data-path", data or g["data"], "--save", save,
            "--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "1"]


def _hardlink(link: Path, target: Path) -> Path:
    """Another name of the same file: found by (device, inode), as a bind mount of a directory would be."""
    link.hardlink_to(target)
    return link


def _link(link: Path, target: Path) -> Path:
    link.symlink_to(target)
    return link


# (id, input key whose tree must stay untouched, argv builder(inputs, tmp) -> argv, word the line must contain)
REFUSED = [
    ("h2m-out-is-src", "hf", lambda g, t: _h2m(g["hf"], g["hf"]), "is the input"),
    ("h2m-out-inside-src", "hf", lambda g, t: _h2m(g["hf"], g["hf"] / "ck"), "lies inside"),
    ("h2m-out-contains-src", "root", lambda g, t: _h2m(g["hf"], g["root"]), "contains"),
    ("h2m-out-symlink-to-src", "hf", lambda g, t: _h2m(g["hf"], _link(t / "link", g["hf"])), "is the input"),
    ("m2h-out-symlink-into-src", "ck", lambda g, t: ["convert", "mcore-to-hf", g["ck"],
                                                     _link(t / "link", g["ck"] / "iter_0000000") / "x",
                                                     "--overwrite", "--quiet"], "lies inside"),
    ("h2m-torch_dist-inside-src", "hf", lambda g, t: _h2m(g["hf"], g["hf"] / "td", "--format", "torch_dist"),
     "lies inside"),
    ("m2h-out-is-src", "ck", lambda g, t: ["convert", "mcore-to-hf", g["ck"], g["ck"], "--overwrite", "--quiet"],
     "is the input"),
    ("m2h-out-inside-src", "ck", lambda g, t: ["convert", "mcore-to-hf", g["ck"], g["ck"] / "iter_0000000" / "hf",
                                               "--overwrite", "--quiet"], "lies inside"),
    ("m2h-out-contains-src", "root", lambda g, t: ["convert", "mcore-to-hf", g["ck"], g["root"], "--overwrite",
                                                   "--quiet"], "contains"),
    ("reshard-dst-is-src", "ck", lambda g, t: ["reshard", g["ck"], g["ck"], "--tp", "2", "--overwrite", "--quiet"],
     "is the input"),
    ("reshard-dst-inside-src", "ck", lambda g, t: ["reshard", g["ck"], g["ck"] / "tp2", "--tp", "2", "--quiet"],
     "lies inside"),
    ("reshard-dst-contains-src", "root", lambda g, t: ["reshard", g["ck"], g["root"], "--overwrite", "--quiet"],
     "contains"),
    ("reshard-torch_dist-is-src", "ck", lambda g, t: ["reshard", g["ck"], g["ck"], "--format", "torch_dist",
                                                      "--overwrite", "--quiet"], "is the input"),
    ("m2m-out-is-src", "ck", lambda g, t: ["convert", "megatron-to-mcore", g["ck"], g["ck"], "--hf-config", g["hf"],
                                           "--overwrite", "--quiet"], "is the input"),
    ("m2m-out-inside-hf-config", "hf", lambda g, t: ["convert", "megatron-to-mcore", g["ck"], g["hf"] / "x",
                                                     "--hf-config", g["hf"], "--quiet"], "lies inside"),
    ("preprocess-prefix-in-tokenizer", "hf", lambda g, t: ["preprocess-data", "--input", t / "in.jsonl",
                                                           "--tokenizer", g["hf"], "--output-prefix", g["hf"] / "tok",
                                                           "--quiet"], "lies inside"),
    ("preprocess-prefix-is-input", "root", lambda g, t: ["preprocess-data", "--input", g["data"].with_suffix(".bin"),
                                                         "--tokenizer", g["hf"], "--output-prefix", g["data"],
                                                         "--quiet"], "is the input"),
    ("train-save-inside-load", "ck", lambda g, t: _train(g, g["ck"] / "iter_0000000" / "run"), "lies inside"),
    ("train-save-contains-load", "root", lambda g, t: _train(g, g["root"]), "contains"),
    ("train-save-holds-data", "root", lambda g, t: _train(g, g["data"].parent), "contains"),
    ("train-save-is-data-file", "root", lambda g, t: _train(g, g["data"].with_suffix(".bin")), "is the input"),
    ("plot-output-is-metrics", "root", lambda g, t: ["plot", t / "m.jsonl", "-o", t / "m.jsonl"], "is the input"),
    ("plot-output-hard-link-of-metrics", "root", lambda g, t: ["plot", t / "m.jsonl", "-o",
                                                               _hardlink(t / "h.png", t / "m.jsonl")], "is the input"),
    ("plan-plot-inside-model", "hf", lambda g, t: ["plan", "--model", g["hf"], "--gpus", "8", "--plot",
                                                   g["hf"] / "plan.png"], "lies inside"),
    ("launch-out-is-load", "ck", lambda g, t: ["launch", "--layout", "tp=1,pp=1,dp=8", "--nodes", "1", "--out",
                                               g["ck"], "--", "--load", g["ck"], "--data-path", g["data"],
                                               "--save", t / "run"], "is the input"),
]


@pytest.mark.parametrize("key,build,word", [(k, b, w) for _, k, b, w in REFUSED], ids=[i for i, *_ in REFUSED])
def test_output_overlapping_an_input_is_refused(good, tmp_path, capsys, key, build, word):
    (tmp_path / "in.jsonl").write_text('{"text": "hi"}\n')
    (tmp_path / "m.jsonl").write_text(json.dumps({"iteration": 1, "loss": 2.0, "lr": 1e-4}) + "\n")
    argv = build(good, tmp_path)  # (may plant a symlink in tmp_path)
    watched = [good[key], tmp_path]
    before = [tree(w) for w in watched]
    rc, err = run(argv, capsys)
    assert rc not in (0, None) and len(err) == 1 and err[0].startswith("shardkit: error:"), err
    assert word in err[0] and "input" in err[0], err[0]
    assert [tree(w) for w in watched] == before, "something was written"


def test_resume_into_the_load_root_is_allowed(good, tmp_path, capsys):
    """--save == --load (Megatron's usual resume) and --load ROOT/iter_N --save ROOT pass the check."""
    from checkpoint.safety import check_output

    ck = good["ck"]
    check_output(ck, [("--load", ck)], "--save", same_ok=[ck])
    check_output(ck, [("--load", ck / "iter_0000000")], "--save", same_ok=[ck / "iter_0000000"])
    check_output(good["data"].parent / "run", [("--data-path", f"{good['data']}.bin")], "--save")  # beside the data


def test_table_counts():
    assert len(REFUSED) >= 20 and len(WRITERS) >= 10


def test_mcore_to_hf_refuses_a_dangling_symlink_and_a_users_shard_name(good, tmp_path, capsys):
    """OUT a symlink to nothing: one line, nothing created beside it. A `model-XXXXX-of-YYYYY.safetensors` that no
    earlier index listed but that the new export would write: the user's, refused before anything moves in."""
    link = tmp_path / "dangling"
    link.symlink_to(tmp_path / "nowhere")
    rc, err = run(["convert", "mcore-to-hf", good["ck"], link, "--quiet"], capsys)
    assert rc == 1 and len(err) == 1 and "symlink to nothing" in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling"]
    out = tmp_path / "hf"
    out.mkdir()
    rc, err = run(["convert", "mcore-to-hf", good["ck"], out, "--quiet", "--max-shard-size", "40KB"], capsys)
    assert rc == 0, err
    shards = sorted(set(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"].values()))
    (out / "model.safetensors.index.json").unlink()  # now no index lists them: they read as the user's files
    before = tree(out)
    rc, err = run(["convert", "mcore-to-hf", good["ck"], out, "--quiet", "--overwrite", "--max-shard-size", "40KB"],
                  capsys)
    assert rc == 1 and len(err) == 1 and shards[0] in err[0] and "move it away" in err[0], err
    assert tree(out) == before
