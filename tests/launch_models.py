"""Tiny checkpoints shaped like the models `plan` and `launch` are used for: each preset's hub config.json
(checkpoint/presets.py holds them verbatim) with every width shrunk and the layer count kept, so that the layout the
planner picks for the real model can be checked by the trainer's own start-up checks against a checkpoint of that
depth (heads and KV groups divisible by every TP up to 8, experts as many as the real model's)."""
from __future__ import annotations

import shlex
from pathlib import Path

TINY = dict(hidden_size=64, intermediate_size=64, num_attention_heads=16, num_key_value_heads=8, vocab_size=512,
            bos_token_id=1, eos_token_id=2, head_dim=4)


def tiny_like(preset: str, root: Path, **overrides) -> Path:
    """`root`/ck: a native checkpoint of `preset`'s architecture at the preset's depth, tiny widths (fp32, converted
    without the proof: the launch tests read its model config and layout only)."""
    import torch
    import transformers

    from checkpoint import presets
    from shardkit.cli import main as cli

    hf = presets.hf_config(preset)
    hf.update(TINY)
    if hf.get("num_local_experts"):
        hf["intermediate_size"] = 32
    hf.update(overrides)
    hf.pop("torch_dtype", None)
    hf.pop("transformers_version", None)
    cfg = transformers.AutoConfig.for_model(**hf)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(str(root / "hf"))
    assert cli(["convert", "hf-to-mcore", str(root / "hf"), str(root / "ck"), "--quiet", "--no-verify"]) == 0
    return root / "ck"


def data(root: Path) -> Path:
    """A small pre-tokenized corpus (.bin/.idx) the checks can name as --data-path."""
    from tests.corpus import write_pattern_corpus

    return write_pattern_corpus(root / "data", docs=20)


def continue_pretrain_args(script: str) -> list[str]:
    """The continue-pretrain arguments of a rendered torchrun.sh: the lines after `-m shardkit continue-pretrain`,
    read as bash would (continuation lines joined, quoting undone)."""
    head, sep, rest = script.partition("-m shardkit continue-pretrain \\\n")
    assert sep, "no continue-pretrain command in the script"
    body = []
    for line in rest.splitlines():
        if line.startswith("#"):  # launch's stamp line
            break
        body.append(line.rstrip("\\").strip())
    return shlex.split(" ".join(body))


def trainer_accepts(args: list[str], world: int) -> tuple:
    """Run what `shardkit continue-pretrain ARGS` checks at start-up on `world` ranks, up to building the model, with
    the CLI's own parser (not launch's): the flag checks (on GPU nodes with Transformer Engine, as plan models them),
    the layout at that world size, --load's model against the layout. Returns (the trainer config, its RunLayout);
    raises the trainer's error otherwise."""
    from dataclasses import replace

    from shardkit.cli import build_parser
    from train.flagcheck import check_train_outputs, check_train_values
    from train.config import from_namespace, validate
    from train.loop import check_layout_for_model, open_load, run_layout

    ns = build_parser().parse_args(["continue-pretrain", *args])
    cfg = from_namespace(ns)
    check_train_values(cfg)
    check_train_outputs(cfg)
    validate(cfg, te_on_nodes=True)
    dims = run_layout(cfg, world=world)
    ck, src, _, _ = open_load(replace(cfg.checkpoint, skip_verify=False), cfg.data.global_batch_size)
    check_layout_for_model(cfg, dims, ck.config, src)
    return cfg, dims
