"""checkpoint.opened.open_checkpoint: one interface over a native and a torch_dist checkpoint of the same model (model
config, layout, iteration, canonical tensors, a region read by canonical name, optimizer state), each found from its
root or its iteration directory."""
from __future__ import annotations

import pytest
import torch

from checkpoint.errors import ConfigError
from checkpoint.opened import NativeCheckpoint, TorchDistOpened, is_torch_dist, open_checkpoint
from shardkit.cli import main
from shardkit.demo import build_tiny_llama


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    work = tmp_path_factory.mktemp("opened")
    hf = build_tiny_llama(work / "hf")
    for fmt in ("native", "torch_dist"):
        assert main(["convert", "hf-to-mcore", str(hf), str(work / fmt), "--tp", "2", "--pp", "2", "--format", fmt,
                     "--quiet", "--no-verify"]) == 0
    return work


def test_both_formats_open_as_one_interface(both):
    native, td = open_checkpoint(both / "native"), open_checkpoint(both / "torch_dist")
    assert isinstance(native, NativeCheckpoint) and isinstance(td, TorchDistOpened)
    assert (native.format, td.format) == ("native", "torch_dist")
    assert native.config == td.config and native.iteration == td.iteration == 0
    assert (native.layout.tp, native.layout.pp) == (td.layout.tp, td.layout.pp) == (2, 2)
    assert not native.has_optimizer and not td.has_optimizer
    assert {n: list(e.shape) for n, e in native.tensors.items()} == {n: list(e.shape) for n, e in td.tensors.items()}
    assert td.config_origin and native.config_origin.endswith("manifest.json")
    for name, e in native.tensors.items():  # every tensor, whole and one region, bit for bit
        assert torch.equal(native.read(name), td.read(name)), name
        box = tuple(slice(s // 3, s // 3 + max(1, s // 2)) for s in e.shape)
        assert torch.equal(native.read(name, box), td.read(name, box)), name
    # an iteration directory opens as its root does
    assert open_checkpoint(native.path).path == native.path and open_checkpoint(td.path).path == td.path


def test_format_is_told_from_the_files(both, tmp_path):
    assert is_torch_dist(both / "torch_dist") and is_torch_dist(open_checkpoint(both / "torch_dist").path)
    assert not is_torch_dist(both / "native") and not is_torch_dist(tmp_path)


def test_a_torch_dist_model_config_is_read_when_asked(both):
    """A torch_dist checkpoint opens whatever describes its model (inspect shows one nothing describes); the model
    config is read when first asked for: one given that contradicts it is then one ConfigError."""
    ck = open_checkpoint(both / "torch_dist", vocab_size=7)
    assert ck.format == "torch_dist" and ck.iteration == 0 and ck.layout.tp == 2
    with pytest.raises(ConfigError, match="--vocab-size 7 contradicts"):
        ck.config
    with pytest.raises(ConfigError, match="--vocab-size 7 contradicts"):
        ck.read("decoder.final_layernorm.weight")


def test_the_trainers_load_opens_either_format(both, tmp_path):
    """open_for_training, the trainer's --load (both engines): a native checkpoint as its verified Checkpoint, a
    torch_dist one read in place (TorchDistLoad), the same model, the same local regions at another layout, and each
    its train state and where it comes from."""
    from checkpoint.layout import Layout, RankCoord
    from checkpoint.opened import open_for_training
    from checkpoint.reader import Checkpoint
    from checkpoint.torch_dist_load import TorchDistLoad

    native = open_for_training(both / "native", None, None)
    td = open_for_training(both / "torch_dist", None, 1000, load_optim=False)  # --vocab-size: the model's own
    assert isinstance(native, Checkpoint) and isinstance(td, TorchDistLoad)
    assert native.config == td.config and native.optimizer_states == td.optimizer_states == []
    assert native.train_state(8) == (None, []) and td.train_state(8) == (None, [])  # iteration 0: a converted model
    assert native.train_state_source == str(native.path / "train_state.json")
    assert td.train_state_source == str(td.path / "common.pt")
    layout, coord = Layout(tp=1, pp=2), RankCoord(tp=0, pp=1)
    for name in native.tensors:
        a, b = native.read_local(name, layout, coord), td.read_local(name, layout, coord)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name


def test_the_trainers_load_refuses_flags_a_native_checkpoint_answers(both, tmp_path):
    """A native --load: --hf-config refused before anything is read (a manifest describes the model), --vocab-size
    Megatron's check against it."""
    from checkpoint.opened import open_for_training

    with pytest.raises(ConfigError, match="--hf-config: only for a torch_dist --load without shardkit.json; "):
        open_for_training(tmp_path / "nothing-here", str(both / "hf"), None)
    with pytest.raises(ConfigError, match=r"--vocab-size 7 disagrees with the checkpoint .*iter_0000000 \(vocab size "):
        open_for_training(both / "native", None, 7)
