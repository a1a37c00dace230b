"""Issue 41 part 2: checkpoints of the newest Megatron releases (../shared/fixtures/megatron-newest, README there).

megatron-core >= 0.17 writes no common.pt (the common state is the DCP item `common_state/shard_0_1`); Megatron-Bridge
0.6 describes its model in `run_config.yaml` and its state in `train_state.pt`; Megatron-LM 0.19's training save holds
its distributed optimizer as `dp_reshardable` flat buffers. Each fixture inspects and verifies, and exports to HF
bitwise equal to its source (every tensor); the Megatron-LM train save reshards to TP 2 and still exports to its
source, and `continue-pretrain --load` of it runs one iteration (its optimizer refused in one line naming
--no-load-optim, then resumed with the weights only).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

FIX = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures" / "megatron-newest"
if not FIX.is_dir():
    pytest.skip(f"{FIX} is absent (the fixtures of issue 41: Megatron-Core 0.19.2 / Megatron-Bridge 0.6.2 saves)",
                allow_module_level=True)

from tests.test_megatron_write_newest import cli  # noqa: E402  (shardkit's CLI in-process: rc, stdout, stderr)

CORE, BRIDGE, TRAIN = "llama-megatron-core-0.19.2", "llama-megatron-bridge-0.6.2", "llama-plain-megatron-lm-0.19.2-train"
SOURCE = {CORE: "llama-hf", BRIDGE: "llama-hf", TRAIN: "llama-plain-hf"}




def hf_tensors(d: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    out: dict[str, np.ndarray] = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def same_as_source(out: Path, source: str) -> None:
    got, want = hf_tensors(out), hf_tensors(FIX / source)
    assert sorted(got) == sorted(want)
    for k, w in want.items():
        g = got[k]
        assert g.dtype == w.dtype and g.shape == w.shape, k
        assert g.tobytes() == w.tobytes(), k


@pytest.mark.parametrize("name", [CORE, BRIDGE, TRAIN])
def test_inspect_and_verify(name):
    rc, out, err = cli("inspect", FIX / name)
    assert rc == 0, err
    out = out.replace("\n", "")  # rich wraps long lines
    if name in (BRIDGE, TRAIN):  # described by the checkpoint itself: run_config.yaml / the common state's args
        assert "model: unknown" not in out and "layout: tp=1 pp=1" in out, out
        assert ("run_config.yaml" if name == BRIDGE else "item common_state/shard_0_1") in out, out
    assert "common.pt is missing" not in out, out
    rc, out, err = cli("verify", FIX / name, *(["--hf-config", FIX / SOURCE[name]] if name == CORE else []))
    assert rc == 0, out + err
    assert "keys and global shapes match the model config" in out, out


def test_common_state_item_read_from_dcp():
    """No common.pt: the iteration, args and optimizer entries come from the item, its CRC-32s checked."""
    from checkpoint.torch_dist import COMMON_ITEM, read_torch_dist

    td = read_torch_dist(FIX / TRAIN)
    assert not (td.path / "common.pt").exists() and (COMMON_ITEM, None) in td._checked
    assert td.iteration == 7 and td.args.padded_vocab_size == 1024 and td.args.num_layers == 4
    assert td.common["optimizer"] == {"param_state_sharding_type": "dp_reshardable"}
    bridge = read_torch_dist(FIX / BRIDGE)
    assert bridge.args.padded_vocab_size == 1000 and bridge.args.make_vocab_size_divisible_by == 1
    assert bridge.train_state["step"] == 0 and bridge.train_state["consumed_train_samples"] == 0


def test_common_state_item_damage_is_refused(tmp_path):
    """A flipped byte inside the common-state item fails its zip CRC, as any item's would."""
    import shutil

    from checkpoint.errors import FormatError
    from checkpoint.torch_dist import COMMON_ITEM, read_torch_dist

    src = read_torch_dist(FIX / CORE)
    info = src._storage[(COMMON_ITEM, None)]
    dst = tmp_path / "it"
    shutil.copytree(src.path, dst)
    f = dst / info.relative_path
    f.chmod(0o644)
    data = bytearray(f.read_bytes())
    at = int(info.offset) + 200  # inside data.pkl
    data[at] ^= 0x01
    f.write_bytes(bytes(data))
    with pytest.raises(FormatError, match="CRC-32"):
        read_torch_dist(dst)


@pytest.mark.parametrize("name", [CORE, BRIDGE, TRAIN])
def test_mcore_to_hf_bitwise(name, tmp_path):
    more = ["--hf-config", FIX / SOURCE[name]] if name == CORE else []  # the bare save: no model description used
    rc, out, err = cli("convert", "mcore-to-hf", FIX / name, tmp_path / "hf", *more)
    assert rc == 0, out + err
    same_as_source(tmp_path / "hf", SOURCE[name])
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["vocab_size"] == 1000 and cfg["num_key_value_heads"] == 2 and cfg["head_dim"] == 32


def test_bridge_needs_no_hf_config_and_has_no_padding(tmp_path):
    from checkpoint.torch_dist import read_torch_dist

    td = read_torch_dist(FIX / BRIDGE)
    cfg, origin = td.model_config()
    assert origin.endswith("run_config.yaml args") and cfg.vocab_size == 1000 and cfg.padded_vocab_size(1) == 1000
    assert cfg.num_query_groups == 2 and cfg.ffn_hidden_size == 200 and not cfg.tie_word_embeddings


def test_reshard_train_save_to_tp2_then_export(tmp_path):
    rc, out, err = cli("reshard", FIX / TRAIN, tmp_path / "tp2", "--tp", "2")
    assert rc == 0, out + err
    assert "tp=1 pp=1 vpp=1 -> tp=2 pp=1 vpp=1" in out, out
    rc, out, err = cli("convert", "mcore-to-hf", tmp_path / "tp2", tmp_path / "hf")
    assert rc == 0, out + err
    same_as_source(tmp_path / "hf", SOURCE[TRAIN])


def test_continue_pretrain_from_train_save(tmp_path):
    """The dp_reshardable optimizer resumes (its bucket layout rebuilt and proved), one iteration runs; with
    --no-load-optim the weights alone."""
    from tests.corpus import write_pattern_corpus
    from tests.launcher import launch

    corpus = write_pattern_corpus(tmp_path / "corpus")
    common = ["--load", str(FIX / TRAIN), "--data-path", str(corpus), "--train-iters", "8", "--micro-batch-size", "2",
              "--global-batch-size", "2", "--seq-length", "32", "--use-checkpoint-opt_param-scheduler"]
    r = launch(1, *common, "--save", str(tmp_path / "out"))
    assert "at iteration 7" in r.stdout and "optimizer state: yes" in r.stdout and "iteration 8/8" in r.stdout, \
        r.stdout[-2000:]
    assert (tmp_path / "out" / "iter_0000008").is_dir()
    r = launch(1, *common, "--no-load-optim", "--save", str(tmp_path / "fresh"))
    assert "optimizer state: no" in r.stdout and "iteration 8/8" in r.stdout, r.stdout[-2000:]


def test_dp_reshardable_state_as_model_space():
    """Every state of every parameter is its slice of the flat buffer (reverse registration order, starts at
    multiples of 64); the fp32 main parameters equal the weights bitwise; the Adam step comes from the param groups."""
    import torch

    from checkpoint.megatron_bridge import flat_buffers
    from checkpoint.torch_dist import read_torch_dist
    from checkpoint.torch_dist_load import TorchDistLoad

    load = TorchDistLoad(FIX / TRAIN)
    assert load.optimizer_states == ["fp32_param", "exp_avg", "exp_avg_sq"]
    td = read_torch_dist(FIX / TRAIN)
    bufs = {k: td.read(v[0]) for k, v in flat_buffers(td).items()}
    w = td.read("decoder.layers.self_attention.linear_qkv.weight")
    got = load.read("optimizer.state.fp32_param.decoder.layers.self_attention.linear_qkv.weight")
    assert torch.equal(got.view(torch.int32), w.view(torch.int32))
    # layer 3's qkv follows the output layer (98304), the final norm (96 -> 128), layer 3's fc2, fc1, pre-MLP norm
    start = 98304 + 128 + 19200 + 38400 + 128
    ea = load.read("optimizer.state.exp_avg.decoder.layers.self_attention.linear_qkv.weight")
    assert torch.equal(ea[3].reshape(-1), bufs["exp_avg"][start:start + 30720]) and ea.abs().sum() > 0
    state, _ = load.train_state(2)
    assert state["iteration"] == 7 and state["optimizer_steps"] == 1


def test_dp_reshardable_refused_where_not_rebuilt(tmp_path, monkeypatch):
    """Where the layout cannot be rebuilt and proved, one line naming --no-load-optim."""
    import checkpoint.megatron_bridge as mb
    from checkpoint.errors import FormatError
    from checkpoint.torch_dist_load import TorchDistLoad

    monkeypatch.setattr(mb, "flat_layout_proved", lambda td, layers: None)
    with pytest.raises(FormatError) as e:
        TorchDistLoad(FIX / TRAIN)
    msg = str(e.value)
    assert "dp_reshardable" in msg and "--no-load-optim" in msg and "\n" not in msg


def _bridge_copy(tmp_path: Path) -> Path:
    import shutil

    dst = tmp_path / "bridge"
    shutil.copytree(FIX / BRIDGE, dst)
    for p in dst.rglob("*"):
        p.chmod(0o755 if p.is_dir() else 0o644)
    dst.chmod(0o755)
    return dst / "iter_0000000"


def test_bridge_run_config_is_plain_yaml_only(tmp_path):
    """run_config.yaml goes through yaml.safe_load: a python tag is refused (nothing runs), a huge file is not read."""
    from checkpoint.errors import FormatError
    from checkpoint.torch_dist import read_torch_dist

    it = _bridge_copy(tmp_path)
    marker = tmp_path / "ran"
    (it / "run_config.yaml").write_text(f"model: !!python/object/apply:os.system ['touch {marker}']\n")
    with pytest.raises(FormatError, match="not valid YAML"):
        read_torch_dist(it)
    assert not marker.exists()
    (it / "run_config.yaml").write_text("model:\n  x: " + "a" * (5 << 20) + "\n")
    with pytest.raises(FormatError, match="more than"):
        read_torch_dist(it)


def test_bridge_train_state_is_weights_only(tmp_path):
    import pickle

    from checkpoint.errors import FormatError
    from checkpoint.torch_dist import read_torch_dist

    it = _bridge_copy(tmp_path)

    class Evil:
        def __reduce__(self):
            return (print, ("ran",))

    import torch

    with open(it / "train_state.pt", "wb") as f:
        torch.save({"step": Evil()}, f, pickle_module=pickle)
    with pytest.raises(FormatError, match="refusing to unpickle"):
        read_torch_dist(it)


def test_no_model_description_needs_hf_config(tmp_path):
    """A common state without args and no run_config.yaml (megatron-core's dist_checkpointing.save of the model
    alone): one line asking for --hf-config, and with it the export equals the source."""
    it = _bridge_copy(tmp_path)
    (it / "run_config.yaml").unlink()
    rc, out, err = cli("convert", "mcore-to-hf", it, tmp_path / "hf")
    assert rc != 0
    lines = [ln for ln in err.strip().splitlines() if ln]
    assert len(lines) == 1 and "--hf-config" in lines[0] and "holds no Megatron args" in lines[0], err
    rc, out, err = cli("convert", "mcore-to-hf", it, tmp_path / "hf", "--hf-config", FIX / "llama-hf")
    assert rc == 0, out + err
    same_as_source(tmp_path / "hf", "llama-hf")
