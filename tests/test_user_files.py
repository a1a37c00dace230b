"""Files shardkit did not write are never touched (issue 14).

- A tree of user files (data/, train.sh, README, eval_results/, nested, plus a file named like a shard that no index
  of ours listed) inside each command's output survives every `--overwrite`, byte for byte.
- An output that is, lies inside or contains an input is refused with one line before anything is written, for
  every writing command.
"""
from __future__ import annotations

import hashlib
import json
import os
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
    from train.data.indexed import write_indexed

    root = tmp_path_factory.mktemp("user-files")
    hf = build_tiny_llama(root / "hf", **TINY)
    (hf / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 64}))
    assert main(["convert", "hf-to-mcore", str(hf), str(root / "ck"), "--quiet", "--no-verify"]) == 0
    assert main(["convert", "hf-to-mcore", str(hf), str(root / "td"), "--format", "torch_dist", "--quiet",
                 "--no-verify"]) == 0
    rng = np.random.default_rng(0)
    (root / "data").mkdir()
    write_indexed(root / "data" / "corpus", [rng.integers(3, 200, size=40) for _ in range(32)], np.uint16)
    from shardkit.demo import save_tiny_tokenizer

    save_tiny_tokenizer(root / "tok", 1000)
    (root / "in.jsonl").write_text("".join(json.dumps({"text": "the model shard tensor"}) + "\n" for _ in range(8)))
    (root / "run").mkdir()
    (root / "run" / "metrics.jsonl").write_text("".join(json.dumps({"iteration": i, "loss": 3.0 - i / 10,
                                                                    "lr": 1e-4}) + "\n" for i in range(1, 6)))
    return {"hf": hf, "ck": root / "ck", "td": root / "td", "data": root / "data" / "corpus", "root": root,
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
                              "--load", g["ck"], "--data-path", g["data"], "--save", out / "run", "--seq-length",
                              "64"],
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


# -- what is in the way and not ours is refused, even with --overwrite (never replaced) -----------------------------

# (writer id, argv(good, out), its pointer): every checkpoint writer goes through checkpoint.commit.IterationWriter
POINTER_WRITERS = {
    "hf-to-mcore": (lambda g, o: ["convert", "hf-to-mcore", g["hf"], o, "--quiet", "--no-verify", "--overwrite"],
                    "latest"),
    "hf-to-mcore-torch_dist": (lambda g, o: ["convert", "hf-to-mcore", g["hf"], o, "--format", "torch_dist",
                                             "--quiet", "--no-verify", "--overwrite"],
                               "latest_checkpointed_iteration.txt"),
    "reshard": (lambda g, o: ["reshard", g["ck"], o, "--tp", "2", "--quiet", "--overwrite"], "latest"),
    "reshard-torch_dist": (lambda g, o: ["reshard", g["ck"], o, "--format", "torch_dist", "--quiet", "--overwrite"],
                           "latest_checkpointed_iteration.txt"),
}


def _in_our_iteration(g, out, build, pointer):
    """A file of the user's inside the iteration an earlier run of the same command wrote."""
    rc, err = run(build(g, out), g["capsys"])
    assert rc == 0, err
    (out / "iter_0000000" / "important.txt").write_text("x\n")
    return "important.txt"


def _deep_in_our_iteration(g, out, build, pointer):
    rc, err = run(build(g, out), g["capsys"])
    assert rc == 0, err
    arr = next((out / "iter_0000000" / "model").iterdir()) if (out / "iter_0000000" / "model").is_dir() else None
    (arr or out / "iter_0000000" / "hf").joinpath("mine.txt").write_text("x\n")
    return "mine.txt"


def _users_iteration_dir(g, out, build, pointer):
    (out / "iter_0000000").mkdir()
    (out / "iter_0000000" / "important.txt").write_text("x\n")
    return "iter_0000000"


def _users_pointer(g, out, build, pointer):
    (out / pointer).write_text("my notes\n")
    return pointer


def _pointer_to_nothing(g, out, build, pointer):  # the pointer's form, but no iteration of that name is here
    (out / pointer).write_text("iter_0000007\n" if pointer == "latest" else "7\n")
    return pointer


def _pointer_of_another_tool(g, out, build, pointer):  # over our own output: a pointer we would not write
    rc, err = run(build(g, out), g["capsys"])
    assert rc == 0, err
    (out / pointer).write_text("global_step100")
    return pointer


FOREIGN_IN_THE_WAY = {"file-in-our-iteration": _in_our_iteration, "file-deep-in-our-iteration": _deep_in_our_iteration,
                      "users-iteration-dir": _users_iteration_dir, "users-pointer": _users_pointer,
                      "pointer-naming-nothing": _pointer_to_nothing, "another-tools-pointer": _pointer_of_another_tool}


@pytest.mark.parametrize("case", list(FOREIGN_IN_THE_WAY))
@pytest.mark.parametrize("writer", list(POINTER_WRITERS))
def test_overwrite_never_replaces_what_shardkit_did_not_write(good, tmp_path, capsys, writer, case):
    """--overwrite replaces only what shardkit wrote: a file of the user's in the iteration directory the write
    replaces (at its top or deep in an array), a directory of that name that is not a shardkit iteration, a pointer
    (`latest` / Megatron's tracker) of the user's or naming no iteration here -- one line naming it, non-zero exit,
    the whole output tree unchanged; once it is moved away, the same --overwrite replaces shardkit's own output."""
    build, pointer = POINTER_WRITERS[writer]
    out = tmp_path / "out"
    out.mkdir()
    name = FOREIGN_IN_THE_WAY[case]({**good, "capsys": capsys}, out, build, pointer)
    before = tree(out)
    rc, err = run(build(good, out), capsys)
    assert rc == 1 and len(err) == 1 and err[0].startswith("shardkit: error:") and name in err[0], err
    assert "Traceback" not in "".join(err)
    assert tree(out) == before
    bad = next(p for p in [*out.rglob(name), out / name] if p.exists())
    if bad.is_dir():
        import shutil

        shutil.rmtree(bad)
    else:
        bad.unlink()
    rc, err = run(build(good, out), capsys)
    assert rc == 0, err


def test_export_leaves_a_checkpoints_files_in_out_alone(good, tmp_path, capsys):
    """mcore-to-hf --overwrite into a directory that also holds a checkpoint root's names (an iteration with a file
    of the user's, `latest`, Megatron's tracker, of the user's): the export writes only its own names, twice."""
    out = tmp_path / "out"
    (out / "iter_0000000").mkdir(parents=True)
    (out / "iter_0000000" / "important.txt").write_text("x\n")
    (out / "latest").write_text("my notes\n")
    (out / "latest_checkpointed_iteration.txt").write_text("7\n")
    before = tree(out)
    for _ in range(2):
        rc, err = run(["convert", "mcore-to-hf", good["ck"], out, "--quiet", "--overwrite"], capsys)
        assert rc == 0, err
        after = tree(out)
        assert {k: after.get(k) for k in before} == before


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
    # issue 34: a write never goes into the very iteration it loaded (only the root beside it is resumed into)
    ("train-save-is-loaded-iteration", "ck", lambda g, t: _train(g, g["ck"] / "iter_0000000",
                                                                 load=g["ck"] / "iter_0000000"), "is the input"),
    ("train-save-is-loaded-iteration-via-link", "ck", lambda g, t: _train(
        g, _link(t / "it", g["ck"] / "iter_0000000"), load=g["ck"] / "iter_0000000"), "is the input"),
    ("train-tensorboard-is-loaded-iteration", "ck", lambda g, t: [
        *_train(g, t / "run", load=g["ck"] / "iter_0000000"), "--tensorboard-dir", g["ck"] / "iter_0000000"],
     "is the input"),
    ("train-tensorboard-inside-loaded-root", "ck", lambda g, t: [
        *_train(g, t / "run"), "--tensorboard-dir", g["ck"] / "iter_0000000" / "tb"], "lies inside"),
    ("train-save-is-loaded-torch_dist-iteration", "td", lambda g, t: _train(g, g["td"] / "iter_0000000",
                                                                            load=g["td"] / "iter_0000000"),
     "is the input"),
    ("train-log-dir-inside-loaded-torch_dist-iteration", "td", lambda g, t: [
        *_train(g, t / "run", load=g["td"]), "--tensorboard-dir", g["td"] / "iter_0000000" / "tb"], "lies inside"),
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


# -- issue 34: `launch --out` never writes through a link or over a script it did not write ---------------------------

LAUNCH = ["launch", "--layout", "tp=1,pp=1,dp=8", "--nodes", "1"]


def _launch(g, out: Path, *extra) -> list:
    return [*LAUNCH, "--out", out, *extra, "--", "--load", g["ck"], "--data-path", g["data"], "--save", out / "run",
            "--seq-length", "64"]  # the tiny model's positions: launch checks the job against --load's model


def _user_script(out: Path, t: Path, name: str) -> Path | None:
    (out / name).write_text("#!/bin/sh\n# my own launcher\nsrun my_train.sh\n")
    return None


def _edited(out: Path, t: Path, name: str) -> Path | None:
    """Our own script, edited by the user afterwards: it is theirs now."""
    from plan.launch import stamped

    (out / name).write_text(stamped("#!/bin/sh\necho ours\n").replace("echo ours", "echo edited"))
    return None


def _link_out(out: Path, t: Path, name: str) -> Path:
    victim = t / "victim.sh"
    victim.write_text("precious\n")
    victim.chmod(0o600)
    (out / name).symlink_to(victim)
    return victim


def _dangling(out: Path, t: Path, name: str) -> Path:
    (out / name).symlink_to(t / "elsewhere" / "created.sh")
    return t / "elsewhere"


def _fifo(out: Path, t: Path, name: str) -> None:
    os.mkfifo(out / name)


def _dir(out: Path, t: Path, name: str) -> None:
    (out / name).mkdir()
    (out / name / "keep").write_text("x")


def _ltree(root: Path) -> dict[str, str]:
    """tree() without following anything: links by target, FIFOs by kind."""
    import stat

    out = {}
    for p in sorted(root.rglob("*")):
        st = os.lstat(p)
        out[str(p.relative_to(root))] = (f"link:{os.readlink(p)}" if stat.S_ISLNK(st.st_mode) else "fifo"
                                         if stat.S_ISFIFO(st.st_mode) else "dir" if stat.S_ISDIR(st.st_mode) else
                                         hashlib.sha256(p.read_bytes()).hexdigest() + oct(st.st_mode))
    return out


# (id, planted by, at name, extra flags, word the one line must hold)
LAUNCH_REFUSED = [
    ("user-torchrun.sh", _user_script, "torchrun.sh", (), "did not write"),
    ("user-job.sbatch", _user_script, "job.sbatch", (), "did not write"),
    ("edited-torchrun.sh", _edited, "torchrun.sh", (), "edited"),
    ("symlink-torchrun.sh-overwrite", _link_out, "torchrun.sh", ("--overwrite",), "symlink"),
    ("symlink-job.sbatch", _link_out, "job.sbatch", (), "symlink"),
    ("dangling-symlink-job.sbatch-overwrite", _dangling, "job.sbatch", ("--overwrite",), "symlink"),
    ("fifo-job.sbatch-overwrite", _fifo, "job.sbatch", ("--overwrite",), "FIFO"),
    ("dir-torchrun.sh-overwrite", _dir, "torchrun.sh", ("--overwrite",), "directory"),
]


@pytest.mark.parametrize("plant_at,name,extra,word", [c[1:] for c in LAUNCH_REFUSED],
                         ids=[c[0] for c in LAUNCH_REFUSED])
def test_launch_never_replaces_what_it_did_not_write(good, tmp_path, capsys, plant_at, name, extra, word):
    """Refused with one line before anything is written: neither script appears, every file in --out and the file a
    link points to stay byte for byte (and mode for mode)."""
    out = tmp_path / "out"
    out.mkdir()
    plant(out)
    victim = plant_at(out, tmp_path, name)
    before = _ltree(out)
    victim_before = (victim.read_bytes(), victim.stat().st_mode) if victim is not None and victim.is_file() else None
    rc, err = run(_launch(good, out, *extra), capsys)
    assert rc == 1 and len(err) == 1 and err[0].startswith("shardkit: error:"), err
    assert name in err[0] and word in err[0], err[0]
    assert _ltree(out) == before
    other = "job.sbatch" if name == "torchrun.sh" else "torchrun.sh"
    assert not (out / other).exists(), "a script was written before the refusal"
    if victim_before is not None:
        assert (victim.read_bytes(), victim.stat().st_mode) == victim_before
    elif victim is not None:
        assert not victim.exists(), "the dangling link was followed"


def test_launch_overwrite_replaces_a_users_script_and_reruns_replace_its_own(good, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    before = plant(out)
    (out / "torchrun.sh").write_text("#!/bin/sh\nmine\n")
    rc, err = run(_launch(good, out, "--overwrite"), capsys)
    assert rc == 0, err
    from plan.launch import _ours

    assert _ours(out / "torchrun.sh") and _ours(out / "job.sbatch")
    assert (out / "torchrun.sh").stat().st_mode & 0o111
    rc, err = run(_launch(good, out), capsys)  # our own, unedited: replaced without --overwrite
    assert rc == 0, err
    after = tree(out)
    assert {k: after.get(k) for k in before} == before
    assert not [p for p in out.iterdir() if p.name.startswith(".")], "a temporary file was left behind"


# -- issue 34: a checkpoint's hf/ side files are untrusted input --------------------------------------------------------

def _poison_hf(hf: Path, secret: Path) -> None:
    """Everything an attacker (or a careless copy) can put into a checkpoint's hf/ beside the real tokenizer files."""
    (hf / "config.json").write_text(json.dumps({"architectures": ["EvilForCausalLM"], "hidden_size": 1}))
    (hf / "model.safetensors").write_bytes(b"\0" * 64)
    (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "model-00001-of-00002."
                                                                                     "safetensors"}}))
    (hf / "model-00001-of-00002.safetensors").write_bytes(b"\0" * 64)
    (hf / "train.sh").write_text("rm -rf ~\n")
    (hf / "README").write_text("from the checkpoint\n")
    (hf / "vocab.txt").symlink_to(secret)  # an allowlisted name, linked out
    os.mkfifo(hf / "merges.txt")  # an allowlisted name, not a regular file
    (hf / "tokenizer.model").mkdir()  # an allowlisted name, a directory
    (hf / "special_tokens_map.json").write_text(json.dumps({"eos_token": "</s>"}))  # a real side file: carried


SIDE_OK = {"tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json"}


def _poisoned_ck(good, tmp: Path) -> tuple[Path, Path]:
    import shutil

    secret = tmp / "secret.txt"
    secret.write_text("s3cret\n")
    ck = Path(shutil.copytree(good["ck"], tmp / "ck"))
    _poison_hf(ck / "iter_0000000" / "hf", secret)
    return ck, secret


def _clean_export(good, tmp: Path, capsys) -> Path:
    rc, err = run(["convert", "mcore-to-hf", good["ck"], tmp / "clean", "--quiet"], capsys)
    assert rc == 0, err
    return tmp / "clean"


def _assert_clean_export(out: Path, clean: Path) -> None:
    for name in ("config.json", "model.safetensors"):
        assert (out / name).read_bytes() == (clean / name).read_bytes(), f"{name} is not the export's own"
    names = {p.name for p in out.iterdir()}
    assert not names & {"model.safetensors.index.json", "model-00001-of-00002.safetensors", "vocab.txt",
                        "merges.txt", "tokenizer.model"}, names
    assert "special_tokens_map.json" in names and "tokenizer_config.json" in names
    assert "s3cret" not in "".join(p.read_text(errors="replace") for p in out.iterdir() if p.is_file()
                                   and p.suffix != ".safetensors")


def test_export_carries_only_known_side_files_never_over_its_own(good, tmp_path, capsys):
    """mcore-to-hf of a checkpoint whose hf/ holds a config.json, weights, an index, a shard, a train.sh, a link out
    at vocab.txt, a FIFO at merges.txt and a directory at tokenizer.model: the export's own config.json and weights
    are written (byte-equal to a clean export's, and the model loads), only known tokenizer / generation files that
    are regular files come along, and nothing blocks."""
    ck, _ = _poisoned_ck(good, tmp_path)
    clean = _clean_export(good, tmp_path, capsys)
    rc, err = run(["convert", "mcore-to-hf", ck, tmp_path / "out", "--quiet"], capsys)
    assert rc == 0, err
    _assert_clean_export(tmp_path / "out", clean)
    assert not (tmp_path / "out" / "train.sh").exists() and not (tmp_path / "out" / "README").exists()
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tmp_path / "out")


def test_export_overwrite_never_replaces_a_users_file_from_side_files(good, tmp_path, capsys):
    ck, _ = _poisoned_ck(good, tmp_path)
    clean = _clean_export(good, tmp_path, capsys)
    out = tmp_path / "out"
    out.mkdir()
    before = plant(out)  # holds train.sh and README, which the checkpoint's hf/ also holds
    for _ in range(2):
        rc, err = run(["convert", "mcore-to-hf", ck, out, "--quiet", "--overwrite"], capsys)
        assert rc == 0, err
        after = tree(out)
        assert {k: after.get(k) for k in before} == before
        _assert_clean_export(out, clean)


@pytest.mark.parametrize("fmt", ["native", "torch_dist"])
def test_reshard_carries_only_known_side_files(good, tmp_path, capsys, fmt):
    """reshard (to either format) carries hf/ through the same allowlist: what it writes holds no config.json of the
    source's hf/ (a torch_dist export writes its own), no weights, scripts, links or FIFOs; and the result's export
    is clean."""
    ck, _ = _poisoned_ck(good, tmp_path)
    rc, err = run(["reshard", ck, tmp_path / "rs", "--tp", "2", "--format", fmt, "--quiet"], capsys)
    assert rc == 0, err
    hf = tmp_path / "rs" / "iter_0000000" / "hf"
    names = {p.name for p in hf.iterdir()}
    assert names == SIDE_OK | ({"config.json"} if fmt == "torch_dist" else set()), names
    assert all(p.is_file() and not p.is_symlink() for p in hf.iterdir())
    if fmt == "torch_dist":
        assert "EvilForCausalLM" not in (hf / "config.json").read_text()
    clean = _clean_export(good, tmp_path, capsys)
    rc, err = run(["convert", "mcore-to-hf", tmp_path / "rs", tmp_path / "out", "--quiet"], capsys)
    assert rc == 0, err
    _assert_clean_export(tmp_path / "out", clean)


def test_torch_dist_export_side_files_are_untrusted_too(good, tmp_path, capsys):
    """A torch_dist checkpoint's hf/ poisoned the same way: its export (through the staging import) is clean."""
    import shutil

    secret = tmp_path / "secret.txt"
    secret.write_text("s3cret\n")
    td = Path(shutil.copytree(good["td"], tmp_path / "td"))
    hf = td / "iter_0000000" / "hf"
    (hf / "config.json").unlink()  # the poisoned one replaces it; the model comes from the export's shardkit.json
    _poison_hf(hf, secret)
    clean = _clean_export(good, tmp_path, capsys)
    rc, err = run(["convert", "mcore-to-hf", td, tmp_path / "out", "--quiet"], capsys)
    assert rc == 0, err
    _assert_clean_export(tmp_path / "out", clean)


def test_training_save_carries_only_known_side_files(good, tmp_path, capsys):
    ck, _ = _poisoned_ck(good, tmp_path)
    rc, err = run([*_train(good, tmp_path / "run", load=ck), "--lr", "1e-4"], capsys)
    assert rc == 0, err
    saved = sorted((tmp_path / "run").glob("iter_*/hf"))
    assert saved and {p.name for p in saved[-1].iterdir()} == SIDE_OK


def _victim_dir(t: Path) -> Path:
    v = t / "victim_dir"
    v.mkdir()
    (v / "keep.txt").write_text("precious\n")
    return v


def _victim_file(t: Path) -> Path:
    v = t / "victim.txt"
    v.write_text("precious\n")
    return v


# (id, plant(good, out_dir, tmp) -> victim, argv(good, out_dir), the one line's word or None where the command succeeds)
NAMED_OUTPUT_LINKS = [
    ("plot -o", lambda g, o, t: _link(o / "m.png", _victim_file(t)),
     lambda g, o: ["plot", g["run"] / "metrics.jsonl", "-o", o / "m.png"], "symlink"),
    ("plot -o temporary name", lambda g, o, t: _link(o / ".m.png.tmp", _victim_file(t)),
     lambda g, o: ["plot", g["run"] / "metrics.jsonl", "-o", o / "m.png"], "symlink"),
    ("plan --plot", lambda g, o, t: _link(o / "p.png", _victim_file(t)),
     lambda g, o: ["plan", "--model", "llama3-8b", "--gpus", "8", "--top", "2", "--plot", o / "p.png"], "symlink"),
    ("mcore-to-hf work dir beside a new OUT", lambda g, o, t: _link(o / ".hf.partial", _victim_dir(t)),
     lambda g, o: ["convert", "mcore-to-hf", g["ck"], o / "hf", "--quiet"], "symlink"),
    ("mcore-to-hf work dir inside OUT", lambda g, o, t: _link((o / "hf").mkdir() or o / "hf" / ".shardkit-export"
                                                              ".partial", _victim_dir(t)),
     lambda g, o: ["convert", "mcore-to-hf", g["ck"], o / "hf", "--quiet", "--overwrite"], "symlink"),
    ("output lock, dangling", lambda g, o, t: _link(o / ".shardkit.lock", t / "nowhere" / "created"),
     lambda g, o: ["convert", "hf-to-mcore", g["hf"], o, "--quiet", "--no-verify", "--overwrite"], "symlink"),
    ("export's lock beside OUT", lambda g, o, t: _link(o / ".hf.shardkit.lock", _victim_file(t)),
     lambda g, o: ["convert", "mcore-to-hf", g["ck"], o / "hf", "--quiet"], "symlink"),
    # names the export replaces in OUT: a link there is replaced itself, never written through (the export works)
    ("mcore-to-hf --overwrite over a config.json link", lambda g, o, t: _link((o / "hf").mkdir() or o / "hf" /
                                                                               "config.json", _victim_file(t)),
     lambda g, o: ["convert", "mcore-to-hf", g["ck"], o / "hf", "--quiet", "--overwrite"], None),
    ("training metrics.jsonl", lambda g, o, t: _link(o / "metrics.jsonl", _victim_file(t)),
     lambda g, o: [*_train(g, o), "--lr", "1e-4"], "symlink"),
    # a pointer's temporary name is ours: a link planted there is removed, never written through (the write works)
    ("latest's temporary name", lambda g, o, t: _link(o / ".latest.tmp", _victim_file(t)),
     lambda g, o: ["convert", "hf-to-mcore", g["hf"], o, "--quiet", "--no-verify", "--overwrite"], None),
]


@pytest.mark.parametrize("plant_link,build,word", [c[1:] for c in NAMED_OUTPUT_LINKS],
                         ids=[c[0] for c in NAMED_OUTPUT_LINKS])
def test_named_outputs_are_never_written_through_a_link(good, tmp_path, capsys, plant_link, build, word):
    out = tmp_path / "out"
    out.mkdir()
    link = plant_link(good, out, tmp_path)
    victim = Path(os.readlink(link))

    def state():
        return tree(victim) if victim.is_dir() else victim.read_bytes() if victim.exists() else None

    before = state()
    rc, err = run(build(good, out), capsys)
    if word is None:
        assert rc == 0, err
    else:
        assert rc == 1 and len(err) == 1 and word in err[0] and link.name in err[0], err
    assert state() == before, "written through the link"


# (id, input key whose tree must stay untouched, argv builder, words): outputs inside a committed iteration
INTO_AN_ITERATION = [
    ("train-save-is-another-checkpoints-iteration", "td",
     lambda g, t: _train(g, g["td"] / "iter_0000000"), ("--save", "is the checkpoint iteration")),
    ("train-save-inside-an-iteration", "ck",
     lambda g, t: _train(g, g["ck"] / "iter_0000000" / "model" / "run", load=g["td"]), ("--save", "lies inside")),
    ("h2m-out-inside-an-iteration", "ck",
     lambda g, t: _h2m(g["hf"], g["ck"] / "iter_0000000" / "ck"), ("lies inside the checkpoint iteration",)),
    ("reshard-dst-is-an-iteration-of-another-root", "td",
     lambda g, t: ["reshard", g["ck"], g["td"] / "iter_0000000", "--tp", "2", "--overwrite", "--quiet"],
     ("is the checkpoint iteration",)),
]


@pytest.mark.parametrize("key,build,words", [c[1:] for c in INTO_AN_ITERATION], ids=[c[0] for c in INTO_AN_ITERATION])
def test_outputs_inside_a_committed_iteration_are_refused(good, tmp_path, capsys, key, build, words):
    """A write that would put iterations (or a pointer) into a committed checkpoint iteration -- any, not only the
    one loaded -- is refused with one line before anything is written."""
    before = tree(good[key])
    rc, err = run(build(good, tmp_path), capsys)
    assert rc == 1 and len(err) == 1 and err[0].startswith("shardkit: error:"), err
    assert all(w in err[0] for w in words), err[0]
    assert tree(good[key]) == before
