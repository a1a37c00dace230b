"""`shardkit demo`: the whole pipeline on a tiny LLaMA built locally (no hub access needed).

HF model (random weights, save_pretrained, a BPE tokenizer trained on the bundled corpus) -> convert tp=2 pp=2 ->
inspect -> verify (checksums + logits against HF transformers) -> reshard to tp=1 pp=1 -> export back to HF -> reload
with transformers and compare every tensor bitwise -> tokenize the bundled corpus (preprocess-data) -> continue
pretraining the converted model for a few steps -> export the trained checkpoint to HF -> verify its logits against
transformers' forward of the export.
"""
from __future__ import annotations

import shlex
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

TRAIN_ITERS = 20
DEMO_WORDS = ["the", "a", "model", "checkpoint", "shard", "tensor", "pipeline", "layer", "token", "train"]


def save_tiny_tokenizer(path: str | Path, vocab_size: int) -> None:
    """A word-level tokenizer with `vocab_size` entries, written in the real HF on-disk format."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    words = specials + DEMO_WORDS + [f"w{i}" for i in range(vocab_size - len(specials) - len(DEMO_WORDS))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(str(path))


def build_tiny_llama(path: str | Path, seed: int = 0, dtype: torch.dtype = torch.bfloat16, **overrides) -> Path:
    """A Llama-3-shaped model (GQA 8:2, llama3 RoPE scaling, untied) small enough to run anywhere."""
    from transformers import LlamaConfig, LlamaForCausalLM

    kw = dict(vocab_size=1000, hidden_size=128, intermediate_size=352, num_hidden_layers=4, num_attention_heads=8,
              num_key_value_heads=2, max_position_embeddings=256, rope_theta=500000.0, bos_token_id=1,
              eos_token_id=2, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    kw.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**kw))
    with torch.no_grad():  # HF initialises norms to 1: randomise them so a wrong mapping cannot hide
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
    model.to(dtype).save_pretrained(str(path))
    save_tiny_tokenizer(path, kw["vocab_size"])
    return Path(path)


def run_demo(cli: Callable[[list[str]], int], out: str | None = None, keep: bool = False) -> int:
    """The whole pipeline on a tiny LLaMA, each step through `cli` (shardkit.cli.main, which passes itself: the demo
    runs the real commands, and imports nothing of the CLI)."""
    from rich.console import Console
    from rich.table import Table
    from safetensors import safe_open

    from train.data.preprocess import bundled_corpus, save_corpus_tokenizer
    from train.metrics import read_metrics

    con = Console()
    work = Path(out) if out else Path(tempfile.mkdtemp(prefix="shardkit-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    hf, ckpt, resharded, back = work / "hf", work / "mcore", work / "mcore-tp1", work / "hf-export"
    corpus, trained, trained_hf = work / "corpus", work / "trained", work / "hf-trained"
    rows = []

    def step(label: str, argv: list[str]) -> None:
        # the command on a line of its own, never cut to the width of the rule ("…"): it can be copied and rerun
        con.rule(f"[bold]{label}[/]")
        con.print(f"$ shardkit {shlex.join(argv)}", soft_wrap=True, markup=False, highlight=False)
        t = time.time()
        rc = cli(argv)
        rows.append((label, "ok" if rc == 0 else f"FAILED ({rc})", f"{time.time() - t:.1f}s"))
        if rc != 0:
            raise SystemExit(rc)

    try:
        t = time.time()
        build_tiny_llama(hf)
        save_corpus_tokenizer(hf, 1000)  # real words for the training steps (ids 0/1/2 stay <unk>/<s>/</s>)
        rows.append(("build tiny HF LLaMA", "ok", f"{time.time() - t:.1f}s"))
        step("convert", ["convert", "hf-to-mcore", str(hf), str(ckpt), "--tp", "2", "--pp", "2", "--overwrite"])
        step("inspect", ["inspect", str(ckpt)])
        step("verify", ["verify", str(ckpt), "--against", str(hf)])
        step("reshard", ["reshard", str(ckpt), str(resharded), "--tp", "1", "--pp", "1", "--overwrite"])
        step("export", ["convert", "mcore-to-hf", str(resharded), str(back), "--overwrite"])
        # the exported model loads in transformers and equals the source bit for bit
        t = time.time()
        from transformers import AutoModelForCausalLM

        AutoModelForCausalLM.from_pretrained(str(back))
        with safe_open(str(hf / "model.safetensors"), "pt") as a, safe_open(str(back / "model.safetensors"), "pt") as b:
            names = sorted(a.keys())
            same = names == sorted(b.keys()) and all(torch.equal(a.get_tensor(n), b.get_tensor(n)) for n in names)
        rows.append(("HF -> tp2pp2 -> tp1pp1 -> HF", f"bitwise equal ({len(names)} tensors)" if same else "DIFFERS",
                     f"{time.time() - t:.1f}s"))
        step("preprocess-data", ["preprocess-data", "--input", str(bundled_corpus()), "--tokenizer", str(hf),
                                 "--output-prefix", str(corpus), "--append-eod", "--quiet"])
        step("continue-pretrain", ["continue-pretrain", "--load", str(ckpt), "--data-path", str(corpus),
                                   "--save", str(trained), "--train-iters", str(TRAIN_ITERS), "--seq-length", "128",
                                   "--micro-batch-size", "4", "--global-batch-size", "8", "--lr", "3e-3",
                                   "--min-lr", "3e-4", "--lr-warmup-iters", "2", "--log-interval", "1",
                                   "--attention-dropout", "0", "--hidden-dropout", "0"])
        losses = [r["loss"] for r in read_metrics(trained)]
        rows.append((f"loss over {TRAIN_ITERS} steps", f"{losses[0]:.3f} -> {losses[-1]:.3f}", ""))
        step("export trained", ["convert", "mcore-to-hf", str(trained), str(trained_hf), "--overwrite"])
        step("verify trained", ["verify", str(trained), "--against", str(trained_hf)])
        table = Table(title="shardkit demo")
        for col in ("step", "result", "time"):
            table.add_column(col)
        for r in rows:
            table.add_row(*r)
        con.print(table)
        con.print(f"work directory: {work}" + ("" if keep or out else " (removed)"))
        return 0 if same and losses[-1] < losses[0] else 1
    finally:
        if not keep and not out:
            shutil.rmtree(work, ignore_errors=True)
