"""Bad input through the real CLI: every failure is one `shardkit: error:` line naming the culprit, a non-zero exit,
and nothing left behind that looks like a complete checkpoint.

A few cases run `python -m shardkit` in a subprocess (real exit status and stderr, and RLIMIT_FSIZE for a write
failure); the rest call `shardkit.cli.main` in-process to keep the file fast.
"""
from __future__ import annotations

import ctypes
import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from shardkit.cli import main

TINY = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=96, vocab_size=300)  # 8 heads, 2 KV heads
CHUNK_TENSOR = "decoder.layers.mlp.linear_fc2.weight"  # one chunk per layer: c/0/0/0 and c/1/0/0


# -- fixtures -----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory) -> Path:
    from shardkit.demo import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "hf", **TINY)


@pytest.fixture
def hf(tiny_hf, tmp_path) -> Path:
    """A private copy of the tiny HF model, free to damage."""
    return Path(shutil.copytree(tiny_hf, tmp_path / "hf"))


@pytest.fixture
def out(tmp_path) -> Path:
    return tmp_path / "out"


@pytest.fixture(scope="module")
def tiny_ckpt(tiny_hf, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ckpt") / "out"
    assert main(["convert", "hf-to-mcore", str(tiny_hf), str(root), "--quiet"]) == 0
    return root


@pytest.fixture
def ckpt(tiny_ckpt, tmp_path) -> Path:
    """A private copy of a good converted checkpoint, free to damage."""
    return Path(shutil.copytree(tiny_ckpt, tmp_path / "ckpt"))


# -- helpers ------------------------------------------------------------------------------------------------------

def run_inproc(argv: list[str], capsys) -> tuple[int, str]:
    capsys.readouterr()
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as e:  # argparse
        rc = e.code
    return rc, capsys.readouterr().err


def run_sub(argv: list[str], **kw) -> tuple[int, str]:
    r = subprocess.run([sys.executable, "-m", "shardkit", *[str(a) for a in argv]], capture_output=True, text=True,
                       timeout=120, **kw)
    return r.returncode, r.stderr


def assert_one_line_error(rc: int, stderr: str, *names: str) -> str:
    assert rc != 0, stderr
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, f"expected exactly one stderr line, got:\n{stderr}"
    line = lines[0]
    assert line.startswith("shardkit: error:"), line
    for name in names:
        assert name in line, f"{name!r} not named in: {line}"
    return line


def assert_nothing_complete(root: Path) -> None:
    """No `latest` and no iteration directory without the .partial suffix."""
    if not root.is_dir():
        return
    assert not (root / "latest").exists(), sorted(os.listdir(root))
    complete = [p.name for p in root.glob("iter_*") if not p.name.endswith(".partial")]
    assert complete == [], complete


def edit_config(hf: Path, **changes) -> dict:
    p = hf / "config.json"
    cfg = json.loads(p.read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    p.write_text(json.dumps(cfg, indent=1))
    return cfg


def convert_argv(hf: Path, out: Path, *extra: str) -> list[str]:
    return ["convert", "hf-to-mcore", str(hf), str(out), "--quiet", *extra]


# -- 1..9: bad sources and bad flags --------------------------------------------------------------------------------

def test_missing_config_json(hf, out):
    (hf / "config.json").unlink()
    rc, err = run_sub(convert_argv(hf, out))
    assert_one_line_error(rc, err, str(hf / "config.json"))
    assert_nothing_complete(out)


def test_unsupported_model_type(hf, out, capsys):
    edit_config(hf, model_type="gpt2")
    rc, err = run_inproc(convert_argv(hf, out), capsys)
    line = assert_one_line_error(rc, err, "config.json", "'gpt2'")
    for supported in ("llama", "mistral", "qwen2"):
        assert supported in line
    assert_nothing_complete(out)


def test_index_names_missing_shard(hf, out, capsys):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(hf / "model.safetensors"))
    (hf / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    weight_map = {}
    for fname, part in shards.items():
        save_file({n: tensors[n] for n in part}, str(hf / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    (hf / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (hf / "model-00002-of-00002.safetensors").unlink()
    rc, err = run_inproc(convert_argv(hf, out), capsys)
    assert_one_line_error(rc, err, "model.safetensors.index.json", "model-00002-of-00002.safetensors")
    assert_nothing_complete(out)


@pytest.mark.parametrize("damage", ["header_json", "header_length"])
def test_corrupt_safetensors_header(hf, out, capsys, damage):
    p = hf / "model.safetensors"
    data = bytearray(p.read_bytes())
    if damage == "header_json":
        data[8:72] = b"\x00garbage{{{" + b"#" * 53  # same length: the 8-byte header length still fits the file
    else:
        data[0:8] = b"\xff" * 8
    p.write_bytes(bytes(data))
    rc, err = run_inproc(convert_argv(hf, out), capsys)
    line = assert_one_line_error(rc, err, str(p))
    assert "corrupt" in line
    assert_nothing_complete(out)


def test_config_disagrees_with_tensor_shapes(hf, out, capsys):
    edit_config(hf, intermediate_size=128)  # the stored MLP weights are 96 wide
    rc, err = run_inproc(convert_argv(hf, out), capsys)
    line = assert_one_line_error(rc, err, "model.safetensors", "mlp.")
    assert "[96, 64]" in line and "[128, 64]" in line
    assert_nothing_complete(out)


def test_tensor_with_wrong_shape(hf, out, capsys):
    import torch
    from safetensors.torch import load_file, save_file

    bad = "model.layers.1.self_attn.o_proj.weight"
    tensors = load_file(str(hf / "model.safetensors"))
    tensors[bad] = torch.zeros(64, 56, dtype=tensors[bad].dtype)
    save_file(tensors, str(hf / "model.safetensors"), metadata={"format": "pt"})
    rc, err = run_inproc(convert_argv(hf, out), capsys)
    line = assert_one_line_error(rc, err, bad, "model.safetensors")
    assert "[64, 56]" in line
    assert_nothing_complete(out)


def test_tp_does_not_divide_kv_heads(hf, out, capsys):
    rc, err = run_inproc(convert_argv(hf, out, "--tp", "4"), capsys)  # 8 heads (divisible), 2 KV heads (not)
    assert_one_line_error(rc, err, "--tp 4", "num_key_value_heads=2")
    assert_nothing_complete(out)


def test_pp_exceeds_layers(hf, out, capsys):
    rc, err = run_inproc(convert_argv(hf, out, "--pp", "4"), capsys)
    assert_one_line_error(rc, err, "--pp 4", "num_hidden_layers=2")
    assert_nothing_complete(out)


def test_non_empty_output_needs_overwrite(hf, out, capsys):
    out.mkdir()
    (out / "unrelated.txt").write_text("keep out")
    rc, err = run_inproc(convert_argv(hf, out), capsys)
    assert_one_line_error(rc, err, str(out), "--overwrite", "unrelated.txt")
    assert_nothing_complete(out)
    # and --overwrite then succeeds
    rc, err = run_inproc(convert_argv(hf, out, "--overwrite"), capsys)
    assert rc == 0, err
    assert (out / "latest").read_text().strip() == "iter_0000000"
    assert (out / "iter_0000000" / "manifest.json").is_file()
    assert not (out / "iter_0000000.partial").exists()


@pytest.mark.parametrize("budget", ["lots", "0"])
def test_a_bad_memory_budget_is_refused_before_writing(hf, out, capsys, budget):
    """convert's --memory-budget (the proof's) that does not parse: one line before anything is written (was found
    by the proof only, after the whole conversion, which it then withdrew)."""
    rc, err = run_inproc(convert_argv(hf, out, "--memory-budget", budget), capsys)
    line = assert_one_line_error(rc, err, "--memory-budget", repr(budget))
    assert "nothing was committed" not in line, line
    assert not out.exists() or not any(out.iterdir()), sorted(os.listdir(out))


def test_unknown_dtype(hf, out, capsys):
    rc, err = run_inproc(convert_argv(hf, out, "--dtype", "fp7"), capsys)
    assert_one_line_error(rc, err, "--dtype", "fp7")
    assert not out.exists()


# -- 10: write failures ---------------------------------------------------------------------------------------------

PR_CAPBSET_DROP, CAP_DAC_OVERRIDE = 24, 1  # <linux/prctl.h>, <linux/capability.h>


def _limit_file_size(nbytes: int):
    def preexec() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))
    return preexec


def test_write_failure_file_size_limit(hf, out):
    # Tests run as root, where a read-only directory does not stop writes; a file size limit does. Python ignores
    # SIGXFSZ, so the over-long chunk write fails with EFBIG. No --quiet: the progress bar must not add stderr lines.
    rc, err = run_sub(["convert", "hf-to-mcore", hf, out], preexec_fn=_limit_file_size(20000))
    line = assert_one_line_error(rc, err, str(out))
    assert "tensor " in line
    assert_nothing_complete(out)
    assert list(out.glob("iter_*")) == [], "a failed write must remove its .partial directory"


def test_write_failure_output_below_a_file(hf, tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    out = blocker / "sub"
    rc, err = run_inproc(convert_argv(hf, out), capsys)
    assert_one_line_error(rc, err, str(out))
    assert blocker.read_text() == "not a directory"


def test_write_failure_output_is_a_file(hf, tmp_path, capsys):
    out = tmp_path / "a_file"
    out.write_text("not a directory")
    rc, err = run_inproc(convert_argv(hf, out), capsys)
    assert_one_line_error(rc, err, str(out))
    assert out.read_text() == "not a directory"


def _without_dac_override() -> None:
    """preexec_fn: root loses CAP_DAC_OVERRIDE (dropped from the bounding set, so exec does not give it back), so
    a directory without write permission refuses its writes as it refuses everyone else's."""
    if os.geteuid() == 0:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_CAPBSET_DROP, CAP_DAC_OVERRIDE, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP, CAP_DAC_OVERRIDE)")


def test_write_failure_read_only_output_dir(hf, out):
    out.mkdir()
    out.chmod(0o555)
    try:
        rc, err = run_sub(convert_argv(hf, out), preexec_fn=_without_dac_override)
        assert_one_line_error(rc, err, str(out))
        assert list(out.iterdir()) == []
    finally:
        out.chmod(0o755)


# -- config fields ----------------------------------------------------------------------------------------------

def test_unknown_config_field(hf, out, capsys):
    edit_config(hf, foo_bar=1)
    rc, err = run_inproc(convert_argv(hf, out), capsys)
    assert_one_line_error(rc, err, "config.json", "foo_bar")
    assert_nothing_complete(out)


def test_unsupported_rope_scaling_type(hf, out, capsys):
    edit_config(hf, rope_parameters=None, rope_theta=10000.0,
                rope_scaling={"type": "longrope", "factor": 4.0, "short_factor": [1.0] * 4, "long_factor": [2.0] * 4,
                              "original_max_position_embeddings": 64})
    rc, err = run_inproc(convert_argv(hf, out), capsys)
    assert_one_line_error(rc, err, "config.json", "longrope")
    assert_nothing_complete(out)


# -- reading checkpoints --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cmd", ["inspect", "verify"])
def test_not_a_checkpoint(tiny_hf, capsys, cmd):
    rc, err = run_inproc([cmd, tiny_hf], capsys)
    line = assert_one_line_error(rc, err, str(tiny_hf))
    assert "not a shardkit checkpoint" in line


@pytest.mark.parametrize("cmd", ["inspect", "verify"])
def test_missing_checkpoint_path(tmp_path, capsys, cmd):
    missing = tmp_path / "nowhere"
    rc, err = run_inproc([cmd, missing], capsys)
    assert_one_line_error(rc, err, str(missing))


@pytest.mark.parametrize("cmd", ["inspect", "verify"])
def test_latest_points_to_missing_iteration(ckpt, capsys, cmd):
    (ckpt / "latest").write_text("iter_0000042\n")
    rc, err = run_inproc([cmd, ckpt], capsys)
    assert_one_line_error(rc, err, str(ckpt / "latest"), "iter_0000042")


def _chunk_files(ckpt: Path, tensor: str) -> list[Path]:
    c = ckpt / "iter_0000000" / "model" / tensor / "c"
    files = sorted(p for p in c.rglob("*") if p.is_file())
    assert len(files) >= 2, files
    return files


def _chunk_index(ckpt: Path, tensor: str, chunk_file: Path) -> str:
    rel = chunk_file.relative_to(ckpt / "iter_0000000" / "model" / tensor / "c")
    return "(" + ", ".join(rel.parts) + ")"


def test_verify_good_checkpoint_passes(ckpt, capsys):
    rc, err = run_inproc(["verify", ckpt, "--quiet"], capsys)
    assert rc == 0, err


def test_verify_missing_chunk(ckpt):
    victim = _chunk_files(ckpt, CHUNK_TENSOR)[-1]
    victim.unlink()
    rc, err = run_sub(["verify", ckpt])  # no --quiet: the progress bar must not add stderr lines
    line = assert_one_line_error(rc, err, f"tensor {CHUNK_TENSOR}", _chunk_index(ckpt, CHUNK_TENSOR, victim))
    assert "missing" in line


def test_verify_flipped_byte(ckpt, capsys):
    victim = _chunk_files(ckpt, CHUNK_TENSOR)[0]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    rc, err = run_inproc(["verify", ckpt, "--quiet"], capsys)
    assert_one_line_error(rc, err, f"tensor {CHUNK_TENSOR}", _chunk_index(ckpt, CHUNK_TENSOR, victim))


@pytest.mark.parametrize("mode", ["whole", "streaming"])
def test_verify_against_a_truncated_source(ckpt, hf, capsys, mode):
    """verify --against an HF directory whose safetensors file was cut short: one line naming the file, in both
    modes (was the safetensors library's traceback: 'incomplete metadata, file not fully covered')."""
    p = hf / "model.safetensors"
    os.truncate(p, p.stat().st_size // 2)
    rc, err = run_inproc(["verify", ckpt, "--against", hf, "--quiet", *(["--streaming"] if mode == "streaming" else [])],
                         capsys)
    line = assert_one_line_error(rc, err, str(p))
    assert "truncated" in line


def test_megatron_is_not_imported_by_the_test_process():
    """megatron-core registers pickle safe globals when imported; the allowlist tests must run without them."""
    import sys

    assert "megatron.core" not in sys.modules


# -- nothing dropped, nothing non-finite: tied heads, NaN weights, strict --json (issue 14) -------------------------

def _edit_tensors(hf: Path, **changes) -> None:
    """Rewrite model.safetensors with some tensors replaced (numpy arrays) or added."""
    from safetensors.torch import load_file, save_file

    path = hf / "model.safetensors"
    tensors = load_file(str(path))
    tensors.update(changes)
    save_file(tensors, str(path), metadata={"format": "pt"})


def _tied_with_head(hf: Path, differ: bool) -> None:
    from safetensors.torch import load_file

    emb = load_file(str(hf / "model.safetensors"))["model.embed_tokens.weight"]
    head = emb.clone()
    if differ:
        head[3, 5] += 1.0
    edit_config(hf, tie_word_embeddings=True)
    _edit_tensors(hf, **{"lm_head.weight": head})


def test_tied_config_with_a_different_lm_head_is_an_error(hf, out, capsys):
    _tied_with_head(hf, differ=True)
    rc, err = run_inproc(convert_argv(hf, out), capsys)
    line = assert_one_line_error(rc, err, "lm_head.weight", "model.embed_tokens.weight", "tie_word_embeddings")
    assert "differs" in line
    assert_nothing_complete(out)


def test_tied_config_with_an_equal_lm_head_converts_with_a_note(hf, out, capsys):
    _tied_with_head(hf, differ=False)
    capsys.readouterr()
    assert main(["convert", "hf-to-mcore", str(hf), str(out)]) == 0
    err = capsys.readouterr().err
    assert "note: lm_head.weight is an exact copy of model.embed_tokens.weight" in err


def test_string_false_is_not_true(hf, out, capsys):
    """`"tie_word_embeddings": "false"` once read as true and dropped the real lm_head."""
    edit_config(hf, tie_word_embeddings="false")
    rc, err = run_inproc(convert_argv(hf, out), capsys)
    assert_one_line_error(rc, err, str(hf / "config.json"), 'tie_word_embeddings="false"', "true or false")


def test_rope_factor_zero_is_refused(hf, out, capsys):
    cfg = json.loads((hf / "config.json").read_text())
    key = "rope_parameters" if "rope_parameters" in cfg else "rope_scaling"  # what transformers 5 / 4 save
    edit_config(hf, **{key: {**cfg[key], "factor": 0}})
    rc, err = run_inproc(convert_argv(hf, out), capsys)
    assert_one_line_error(rc, err, f"{key}.factor=0", "> 0")


def _poisoned(hf: Path) -> str:
    from safetensors.torch import load_file

    name = "model.layers.1.mlp.down_proj.weight"
    t = load_file(str(hf / "model.safetensors"))[name].clone()
    t[7, 3] = float("nan")
    t[9, 0] = float("inf")
    _edit_tensors(hf, **{name: t})
    return name


def test_nonfinite_source_weights_are_refused_then_allowed_and_counted(hf, out, capsys):
    name = _poisoned(hf)
    rc, err = run_inproc(convert_argv(hf, out), capsys)
    line = assert_one_line_error(rc, err, name, "non-finite", "row 7", "--allow-nonfinite")
    assert_nothing_complete(out)
    assert main(convert_argv(hf, out, "--allow-nonfinite")) == 0
    # verify counts them per tensor and fails; --json stays strict JSON
    rc, err = run_inproc(["verify", out, "--quiet"], capsys)
    assert_one_line_error(rc, err, "decoder.layers.mlp.linear_fc2.weight", "non-finite", "(2)")
    capsys.readouterr()
    rc = main(["verify", str(out), "--json"])
    text = capsys.readouterr().out
    d = json.loads(text, parse_constant=lambda c: pytest.fail(f"bare {c} in --json output"))
    assert rc == 1 and d["ok"] is False and d["nonfinite"] == {"decoder.layers.mlp.linear_fc2.weight": 2}


def test_json_outputs_are_strict(ckpt, capsys):
    """inspect/verify/plan --json never print bare NaN/Infinity, even when a value is not finite."""
    from checkpoint.progress import json_text

    assert json.loads(json_text({"a": float("nan"), "b": [float("inf"), 1.5]})) == {"a": None, "b": [None, 1.5]}
    for argv in (["inspect", ckpt, "--json"], ["verify", ckpt, "--json"],
                 ["plan", "--model", "llama3-8b", "--gpus", "8", "--json", "--top", "2"]):
        capsys.readouterr()
        assert main([str(a) for a in argv]) == 0
        json.loads(capsys.readouterr().out, parse_constant=lambda c: pytest.fail(f"bare {c} in {argv[0]} --json"))


# -- torch_dist checkpoints (issue 17): missing or short .distcp, items vs args, args vs the HF config given ----------

@pytest.fixture(scope="module")
def tiny_td(tiny_hf, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("td") / "td"
    assert main(["convert", "hf-to-mcore", str(tiny_hf), str(root), "--format", "torch_dist", "--quiet"]) == 0
    return root


@pytest.fixture
def td(tiny_td, tmp_path) -> Path:
    """A private copy of a good torch_dist export, free to damage."""
    return Path(shutil.copytree(tiny_td, tmp_path / "td"))


def _td_args(root: Path, strip_description: bool = False, **changes) -> None:
    """Edit the Megatron-LM args in common.pt (and drop shardkit's own description, as Megatron-LM writes none)."""
    from checkpoint.torch_dist_pickle import load_common
    from checkpoint.torch_dist_write import write_common

    it = root / "iter_0000000"
    common, _ = load_common(it / "common.pt")
    for k, v in changes.items():
        setattr(common["args"], k, v)
    write_common(it, common)
    if strip_description:
        (it / "shardkit.json").unlink()
        shutil.rmtree(it / "hf")
    else:
        drop_common_record(it)


def drop_common_record(it: Path) -> None:
    """common.pt as another tool wrote it: shardkit.json's record of our common.pt's SHA-256 dropped (else an edit
    of it is damage, said before whatever the test is about)."""
    from checkpoint.torch_dist_sidecar import _digest

    side = json.loads((it / "shardkit.json").read_text())
    del side["files"], side["digest"]
    (it / "shardkit.json").write_text(json.dumps({**side, "digest": _digest(side)}))


TD_READERS = [lambda td, out: ["reshard", td, out, "--quiet"],
              lambda td, out: ["convert", "mcore-to-hf", td, out, "--quiet"],
              lambda td, out: ["verify", td, "--quiet"],
              lambda td, out: ["inspect", td]]


@pytest.mark.parametrize("reader", range(len(TD_READERS)))
def test_torch_dist_metadata_names_a_missing_distcp(td, out, capsys, reader):
    (td / "iter_0000000" / "__0_0.distcp").unlink()
    rc, err = run_inproc(TD_READERS[reader](td, out), capsys)
    assert_one_line_error(rc, err, "__0_0.distcp", "missing")
    assert not out.exists()


@pytest.mark.parametrize("reader", range(len(TD_READERS)))
def test_torch_dist_metadata_names_a_short_distcp(td, out, capsys, reader):
    f = td / "iter_0000000" / "__0_0.distcp"
    size = f.stat().st_size
    f.write_bytes(f.read_bytes()[:-10])
    rc, err = run_inproc(TD_READERS[reader](td, out), capsys)
    line = assert_one_line_error(rc, err, "__0_0.distcp", "truncated", f"the file has {size - 10}")
    assert f"{size})" in line  # the bytes the item needs: both values
    assert not out.exists()


@pytest.mark.parametrize("change,words", [
    (dict(num_layers=4), ("decoder.layers.", "stacks 2 layers", "num_layers=4")),
    (dict(padded_vocab_size=512, make_vocab_size_divisible_by=256),
     ("embedding.word_embeddings.weight", "384 rows", "padded_vocab_size=512")),
    (dict(hidden_size=128), ("embedding.word_embeddings.weight", "[384, 64]", "[384, 128]")),
])
@pytest.mark.parametrize("cmd", ["reshard", "verify"])
def test_torch_dist_items_disagree_with_args(td, out, capsys, change, words, cmd):
    """A Megatron-written checkpoint (no shardkit.json) whose items disagree with its args: the key, both values."""
    _td_args(td, strip_description=True, **change)
    argv = ["reshard", td, out, "--quiet"] if cmd == "reshard" else ["verify", td, "--quiet"]
    rc, err = run_inproc(argv, capsys)
    assert_one_line_error(rc, err, *words)
    assert not out.exists()


@pytest.mark.parametrize("change,words", [
    (dict(num_attention_heads=4), ("common.pt", "num_attention_heads=4", "has 8")),
    (dict(num_layers=3), ("common.pt", "num_layers=3", "has 2")),
    (dict(vocab_size=256), ("common.pt", "vocab_size=256", "vocab_size=300")),
    (dict(rotary_base=10000.0), ("common.pt", "rotary_base=10000.0", "has 500000.0")),
])
@pytest.mark.parametrize("cmd", ["reshard", "mcore-to-hf", "verify", "inspect"])
def test_torch_dist_args_contradict_the_hf_config_given(td, tiny_hf, out, capsys, change, words, cmd):
    _td_args(td, **change)
    argv = {"reshard": ["reshard", td, out], "mcore-to-hf": ["convert", "mcore-to-hf", td, out],
            "verify": ["verify", td], "inspect": ["inspect", td]}[cmd] + ["--hf-config", tiny_hf]
    rc, err = run_inproc(argv + (["--quiet"] if cmd != "inspect" else []), capsys)
    assert_one_line_error(rc, err, *words, "--hf-config")
    assert not out.exists()


def test_torch_dist_without_any_model_description(td, out, capsys):
    """No shardkit.json and no args: the line says so and names --hf-config; args without the true vocab name it and
    both flags."""
    _td_args(td, strip_description=True, vocab_size=None)
    rc, err = run_inproc(["reshard", td, out, "--quiet"], capsys)
    assert_one_line_error(rc, err, "common.pt", "lack vocab_size", "padded_vocab_size=384", "--vocab-size N",
                          "--hf-config HF_DIR")
    assert main(["reshard", str(td), str(out), "--vocab-size", "300", "--quiet"]) == 0
    from checkpoint.torch_dist_pickle import load_common
    from checkpoint.torch_dist_write import write_common

    it = td / "iter_0000000"
    common, _ = load_common(it / "common.pt")
    del common["args"]
    write_common(it, common)
    (it / "run_config.yaml").unlink()  # (our export's description for Megatron-Bridge: the model again)
    rc, err = run_inproc(["verify", td, "--vocab-size", "300", "--quiet"], capsys)
    assert_one_line_error(rc, err, "shardkit.json", "no usable Megatron args", "--hf-config")
    rc, err = run_inproc(["reshard", td, out.with_name("o2"), "--vocab-size", "-3", "--quiet"], capsys)
    assert_one_line_error(rc, err, "--vocab-size")


def test_torch_dist_damaged_description_is_refused(td, out, capsys):
    p = td / "iter_0000000" / "shardkit.json"
    d = json.loads(p.read_text())
    d["model"]["num_layers"] = 3
    p.write_text(json.dumps(d))
    rc, err = run_inproc(["reshard", td, out, "--quiet"], capsys)
    assert_one_line_error(rc, err, "shardkit.json", "digest")
    p.write_text("{")
    rc, err = run_inproc(["inspect", td], capsys)
    assert_one_line_error(rc, err, "shardkit.json", "JSON")
    assert not out.exists()
