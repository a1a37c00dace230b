"""The command line as a user runs it: convert, inspect, verify --against, export, and the demo."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from checkpoint.reader import Checkpoint
from shardkit.cli import main
from shardkit.demo import build_tiny_llama

SMALL = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=96, vocab_size=300)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    hf = build_tiny_llama(d / "hf", **SMALL)
    assert main(["convert", "hf-to-mcore", str(hf), str(d / "ck"), "--tensor-model-parallel-size", "2",
                 "--pipeline-model-parallel-size", "2", "--quiet"]) == 0
    return hf, d / "ck"


def test_inspect_json(converted, capsys):
    _, ck = converted
    assert main(["inspect", str(ck), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["layout"] == {"tp": 2, "pp": 2, "vpp": 1, "ep": 1, "etp": None}
    assert d["vocab"] == {"size": 300, "padded_size": 512, "divisible_by": 128}
    rows = {r["name"]: r for r in d["tensors"]}
    qkv = rows["decoder.layers.self_attention.linear_qkv.weight"]
    assert qkv["shape"] == [2, (8 + 2 * 2) * 8, 64] and qkv["chunk"] == [1, 48, 64] and qkv["dtype"] == "bfloat16"
    assert d["total_bytes"] == sum(r["bytes"] for r in d["tensors"]) == Checkpoint(ck).nbytes()
    assert {"tokenizer.json", "generation_config.json"} <= set(d["hf_files"])
    assert d["provenance"]["source"]["files"][0]["name"] == "model.safetensors"


def test_inspect_table(converted, capsys):
    _, ck = converted
    assert main(["inspect", str(ck)]) == 0
    out = capsys.readouterr().out
    assert "tp=2 pp=2" in out and "gate_up" in out and "total" in out


def test_verify_against_hf_json(converted, capsys):
    hf, ck = converted
    assert main(["verify", str(ck), "--against", str(hf), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["chunks_ok"] and d["chunks"] > 0
    assert d["parity"]["ok"] and d["parity"]["max_abs_diff"] <= 1e-4


def test_verify_against_other_model_fails(converted, tmp_path, capsys):
    _, ck = converted
    other = build_tiny_llama(tmp_path / "other", seed=1, **SMALL)
    assert main(["verify", str(ck), "--against", str(other)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "logits differ" in err[0]


def test_console_script_round_trip(converted, tmp_path):
    """The installed entry point, as a subprocess: export back and load with transformers."""
    _, ck = converted
    out = tmp_path / "back"
    r = subprocess.run([sys.executable, "-m", "shardkit", "convert", "mcore-to-hf", str(ck), str(out), "--quiet"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    import transformers

    m = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert m.config.vocab_size == 300 and m.model.embed_tokens.weight.shape[0] == 300


def test_demo_runs_and_continues_pretraining(tmp_path):
    """The demo end to end, and issue 5's "from HF" check: the converted tiny Llama trains 20 steps on the bundled
    corpus, the loss falls, the trained checkpoint exports to HF, and transformers loads the export and finds it
    better than the untrained model on the corpus."""
    from transformers import AutoModelForCausalLM

    from train.data.indexed import IndexedDataset
    from train.metrics import read_metrics

    work = tmp_path / "demo"
    r = subprocess.run([sys.executable, "-m", "shardkit", "demo", "--out", str(work)], capture_output=True, text=True,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "bitwise equal" in r.stdout and "reshard" in r.stdout
    losses = [m["loss"] for m in read_metrics(work / "trained")]
    assert len(losses) == 20 and max(losses[-3:]) < losses[0] - 0.5, losses
    ds = IndexedDataset(work / "corpus")
    ids = torch.from_numpy(np.concatenate([ds[i] for i in range(4)])[:512].astype(np.int64)).view(4, 128)

    def loss(path):
        model = AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32)
        with torch.no_grad():
            return model(ids, labels=ids).loss.item()

    assert loss(work / "hf-trained") < loss(work / "hf") - 0.5
