"""`shardkit preprocess-data`: a JSONL file tokenized into Megatron's `.bin`/`.idx` (what Megatron-LM's
tools/preprocess_data.py writes), in worker processes when asked; the small corpus shipped with shardkit and a BPE
tokenizer trained on it."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from .errors import DataError
from .indexed import IndexedWriter, token_dtype
from .stats import sidecar_path, tokenizer_record

_WORKER_STATE: dict = {}


def load_tokenizer(tokenizer_dir: str | os.PathLike):
    """transformers' AutoTokenizer from a local directory only; remote code is never run."""
    path = Path(tokenizer_dir)
    if not path.is_dir():
        raise DataError(f"--tokenizer {path}: not a directory (give a local HF tokenizer/model directory)")
    from checkpoint.safety import is_side_file_name, regular_file

    for name in ("config.json", *sorted(os.listdir(path))):  # what the loader opens: a FIFO there is one line, no hang
        if (name == "config.json" or is_side_file_name(name)) and os.path.lexists(path / name):
            regular_file(path / name, "--tokenizer", missing_ok=True)
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError, KeyError, TypeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(f"--tokenizer {path}: cannot load a tokenizer ({first})") from None
    tok.model_max_length = 1 << 62  # documents are longer than the model context; no truncation, no warning
    return tok


def _init_worker(tokenizer_dir: str, add_special_tokens: bool, eod: int | None) -> None:
    _WORKER_STATE.update(tok=load_tokenizer(tokenizer_dir), special=add_special_tokens, eod=eod)


def _encode_batch(batch: dict[str, list]) -> dict[str, list[np.ndarray]]:
    """Megatron's Encoder.encode: a document's sentences (a string or a list of strings) tokenized and
    concatenated; the end-of-document token appended to non-empty documents when asked."""
    tok, special, eod = _WORKER_STATE["tok"], _WORKER_STATE["special"], _WORKER_STATE["eod"]
    out: dict[str, list[np.ndarray]] = {}
    for key, docs in batch.items():
        flat = [s for d in docs for s in (d if isinstance(d, list) else [d])]
        ids = tok(flat, add_special_tokens=special)["input_ids"] if flat else []
        encoded, k = [], 0
        for d in docs:
            n = len(d) if isinstance(d, list) else 1
            toks = [t for seq in ids[k:k + n] for t in seq]
            k += n
            if toks and eod is not None:
                toks.append(eod)
            encoded.append(np.asarray(toks, dtype=np.int64))
        out[key] = encoded
    return out


def _check_surrogates(path: Path, lineno: int, key: str, v: "str | list[str]") -> None:
    """A lone surrogate (`"\\ud800"`) is valid JSON but not text: no tokenizer can encode it."""
    for text in [v] if isinstance(v, str) else v:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise DataError(f"{path} line {lineno}: {key!r} holds a lone surrogate \\u{ord(text[e.start]):04x} "
                            "(an unpaired \\uD800-\\uDFFF escape), which is not text") from None


def _read_jsonl(path: Path, keys: Sequence[str], batch_docs: int) -> Iterator[tuple[dict[str, list], int, int]]:
    """Batches of {key: [text or list of texts]} with the bytes and lines they came from; errors name the line."""
    batch: dict[str, list] = {k: [] for k in keys}
    nbytes = nlines = 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            nbytes += len(raw)
            nlines += 1
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
                raise DataError(f"{path} line {lineno}: not valid JSON ({e})") from None
            if not isinstance(obj, dict):
                raise DataError(f"{path} line {lineno}: expected a JSON object, got {type(obj).__name__}")
            for k in keys:
                if k not in obj:
                    raise DataError(f"{path} line {lineno}: no key {k!r} (--json-keys {' '.join(keys)})")
                v = obj[k]
                if not (isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v))):
                    raise DataError(f"{path} line {lineno}: {k!r} must be a string or a list of strings, "
                                    f"got {type(v).__name__}")
                if b"\\ud" in raw.lower():  # a \uD800-\uDFFF escape: only a surrogate pair makes a character
                    _check_surrogates(path, lineno, k, v)
                batch[k].append(v)
            if len(batch[keys[0]]) >= batch_docs:
                yield batch, nbytes, nlines
                batch, nbytes, nlines = {k: [] for k in keys}, 0, 0
    if batch[keys[0]] or nbytes:
        yield batch, nbytes, nlines


def _ordered(pool, batches: Iterator[tuple[dict, int, int]], depth: int) -> Iterator[tuple[dict, int, int]]:
    """Encode batches in the pool, at most `depth` in flight, results in input order (reading stays in this
    process, so a bad line raises here)."""
    import collections

    pending: collections.deque = collections.deque()
    for b, nb, nl in batches:
        pending.append((pool.submit(_encode_batch, b), nb, nl))
        if len(pending) >= depth:
            r, nb0, nl0 = pending.popleft()
            yield r.result(), nb0, nl0
    while pending:
        r, nb0, nl0 = pending.popleft()
        yield r.result(), nb0, nl0


def output_prefixes(output_prefix: str | os.PathLike, json_keys: Sequence[str]) -> dict[str, Path]:
    """One key -> `<prefix>.bin/.idx`; several -> Megatron's `<prefix>_<key>_document.bin/.idx` per key."""
    if len(json_keys) == 1:
        return {json_keys[0]: Path(output_prefix)}
    return {k: Path(f"{output_prefix}_{k}_document") for k in json_keys}


def preprocess_jsonl(input_path: str | os.PathLike, tokenizer_dir: str | os.PathLike, output_prefix: str | os.PathLike,
                     json_keys: Sequence[str] = ("text",), append_eod: bool = False, workers: int = 1,
                     add_special_tokens: bool = False, quiet: bool = False, batch_docs: int = 256) -> dict:
    """Tokenize a JSONL file into Megatron's indexed dataset (what Megatron-LM's tools/preprocess_data.py writes).

    Tokens are what `tokenizer(text, add_special_tokens=...)` gives (no BOS/EOS by default, like megatron-core's
    HuggingFace tokenizer `text_to_ids`); `append_eod` adds the tokenizer's EOS after each document. uint16 tokens
    when the vocabulary (with added tokens) is below 65,500, else int32. The outputs appear only when complete.
    """
    import time

    from checkpoint.progress import progress_bar

    from checkpoint.safety import regular_file

    src = Path(input_path)
    if not regular_file(src, "--input", missing_ok=True):  # a FIFO or device: one line naming it, never a hang
        raise DataError(f"--input {src}: no such file")
    keys = list(dict.fromkeys(json_keys))
    if not keys:
        raise DataError("--json-keys: give at least one key")
    if workers < 1:
        raise DataError(f"--workers {workers}: must be at least 1")
    tok = load_tokenizer(tokenizer_dir)
    eod = None
    if append_eod:
        eod = tok.eos_token_id
        if eod is None:
            raise DataError(f"--append-eod: the tokenizer in {tokenizer_dir} has no eos_token")
    dtype = token_dtype(len(tok))
    prefixes = output_prefixes(output_prefix, keys)
    t0 = time.perf_counter()
    with open(src, "rb") as f:
        total_lines = sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 24), b""))
    total_bytes = src.stat().st_size
    writers = {k: IndexedWriter(p, dtype) for k, p in prefixes.items()}
    pool = None
    try:
        batches = _read_jsonl(src, keys, batch_docs)
        if workers > 1:
            import multiprocessing as mp
            from concurrent.futures import ProcessPoolExecutor

            # spawn (tensorstore/tokenizer threads make fork unsafe); a worker that dies breaks the pool loudly
            pool = ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"), initializer=_init_worker,
                                       initargs=(str(tokenizer_dir), add_special_tokens, eod))
            results = _ordered(pool, batches, 2 * workers)
        else:
            _WORKER_STATE.update(tok=tok, special=add_special_tokens, eod=eod)
            results = ((_encode_batch(b), nb, nl) for b, nb, nl in batches)
        docs = 0
        with progress_bar("tokenize", total=total_bytes, items=total_lines, disable=quiet, unit="lines") as bar:
            for enc, nb, nl in results:
                for k, arrays in enc.items():
                    for a in arrays:
                        writers[k].add(a)
                docs += len(enc[keys[0]])
                bar.advance(nb, nl)
        record = tokenizer_record(tokenizer_dir, tok)
        for w in writers.values():
            w.commit(tokenizer=record)
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    finally:
        _WORKER_STATE.clear()
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
    seconds = time.perf_counter() - t0
    return {"input": str(src), "outputs": [str(p) for p in prefixes.values()], "documents": docs,
            "tokens": {k: w.tokens for k, w in writers.items()}, "dtype": dtype.name, "bytes": total_bytes,
            "tokenizer": record, "sidecars": [str(sidecar_path(f"{p}.bin")) for p in prefixes.values()],
            "seconds": seconds, "mb_per_s": total_bytes / 1e6 / max(seconds, 1e-9)}



def preprocess_main(args) -> int:
    """`shardkit preprocess-data`: run preprocess_jsonl from parsed CLI flags and print one summary line."""
    r = preprocess_jsonl(args.input, args.tokenizer, args.output_prefix, json_keys=args.json_keys,
                         append_eod=args.append_eod, workers=args.workers,
                         add_special_tokens=args.add_special_tokens, quiet=args.quiet)
    toks = ", ".join(f"{k}: {n:,}" for k, n in r["tokens"].items())
    print(f"wrote {' '.join(p + '.bin/.idx' for p in r['outputs'])}: {r['documents']:,} documents, {toks} tokens "
          f"({r['dtype']}), {r['bytes'] / 1e6:.1f} MB in {r['seconds']:.1f}s ({r['mb_per_s']:.1f} MB/s); tokenizer "
          f"{r['tokenizer']['path']} (vocab size {r['tokenizer']['vocab_size']}) recorded in "
          f"{' '.join(r['sidecars'])}")
    return 0


def bundled_corpus() -> Path:
    """The small public-domain JSONL corpus shipped with shardkit (shardkit/data/kjv.jsonl; see its README)."""
    from importlib.resources import files

    return Path(str(files("shardkit") / "data" / "kjv.jsonl"))


def save_corpus_tokenizer(path: str | os.PathLike, vocab_size: int, corpus: str | os.PathLike | None = None,
                          json_key: str = "text") -> Path:
    """Train a byte-level BPE tokenizer of exactly `vocab_size` entries on a JSONL corpus (default: the bundled one)
    and save it in HF format, so a tiny model (e.g. the demo's, vocab 1000) trains on real words instead of <unk>.
    Ids 0/1/2 are <unk>/<s>/</s>, as the demo's model config expects."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    src = Path(corpus) if corpus is not None else bundled_corpus()
    texts = []
    for batch, _, _ in _read_jsonl(src, [json_key], 1024):
        texts += [" ".join(t) if isinstance(t, list) else t for t in batch[json_key]]
    specials = ["<unk>", "<s>", "</s>"]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(specials) + len(alphabet):
        raise DataError(f"vocab size {vocab_size}: a byte-level BPE needs at least {len(specials) + len(alphabet)}")
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                                       initial_alphabet=alphabet, show_progress=False))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(str(path))
    return Path(path)
