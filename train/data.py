"""Training data: Megatron's indexed dataset (`.bin`/`.idx`), its GPT sample order, blends, splits and micro-batches.

Everything here reproduces megatron-core's algorithms (GPTDataset, BlendedDataset, BlendedMegatronDatasetBuilder,
Megatron-LM's MegatronPretrainingSampler) so that a run that switches between Megatron-LM and shardkit sees the same
samples in the same order for the same seed, sequence length, blend, split and sample count. The order is rebuilt with
numpy on every rank (no index cache files), deterministically, in well under a second for corpora of millions of
documents.

File format (`.idx`, little-endian): magic `MMIDIDX\\0\\0`, `<Q` version 1, `<B` dtype code, `<Q` sequence count,
`<Q` document count, int32 sequence lengths, int64 sequence byte pointers into `.bin`, int64 document indices (the
sequence index at which each document starts, then the total). `.bin` is the concatenated tokens.
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import re
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Protocol, Sequence

import numpy as np

from checkpoint.errors import ShardkitError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_BYTES = len(MAGIC) + 8 + 1 + 8 + 8  # 34
DTYPE_CODES: dict[int, type] = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
                                7: np.float32, 8: np.uint16}
_CODE_OF = {np.dtype(t): c for c, t in DTYPE_CODES.items()}
ORDER_VERSION = 1  # bump when anything that changes the sample order changes; part of every fingerprint
BLEND_SURPLUS = 0.005  # megatron-core's mid_level_dataset_surplus default
SPLIT_NAMES = ("train", "valid", "test")


class DataError(ShardkitError):
    """A data file, prefix, blend or split cannot be used; the message names the file or flag."""


def token_dtype(vocab_size: int) -> np.dtype:
    """Megatron's choice (DType.optimal_dtype): uint16 below 65,500 tokens, else int32."""
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


# -- writing ----------------------------------------------------------------------------------------------------------

class IndexedWriter:
    """Streams documents into `<prefix>.bin`/`.idx` under temporary names; `commit()` renames both into place.

    One document = one sequence (empty documents have none), as Megatron's preprocess_data writes without
    --split-sentences. Use as a context manager: leaving it on an exception removes the temporary files.
    """

    def __init__(self, prefix: str | os.PathLike, dtype: np.dtype | type):
        self.prefix = Path(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in _CODE_OF:
            raise DataError(f"{self.prefix}: token dtype {self.dtype} has no Megatron dtype code")
        self._info = np.iinfo(self.dtype) if self.dtype.kind in "iu" else None
        side = sidecar_path(f"{self.prefix}.bin")
        if side.exists() and _read_sidecar(side) is None:  # refused before anything is written
            raise DataError(f"{side}: exists and is not a shardkit token-statistics file; not replaced (move it, or "
                            "choose another --output-prefix)")
        self.prefix.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd, self._tmp_bin = _mkstemp_umask(self.prefix, ".bin.tmp")
        except OSError as e:
            raise DataError(f"{self.prefix}.bin: cannot write ({e.strerror})") from None
        self._bin = os.fdopen(fd, "wb")
        self._lengths: list[int] = []
        self._doc_starts: list[int] = [0]
        self.tokens = 0
        self.min_token: int | None = None
        self.max_token: int | None = None

    def add(self, tokens: np.ndarray | Sequence[int]) -> None:
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise DataError(f"{self.prefix}: a document must be a 1-D token array, got shape {arr.shape}")
        if arr.size:
            if self._info is not None and (arr.min() < self._info.min or arr.max() > self._info.max):
                raise DataError(f"{self.prefix}: token id {int(arr.max())} does not fit {self.dtype} "
                                f"(use int32 for vocabularies of 65,500 or more)")
            if arr.size > np.iinfo(np.int32).max:
                raise DataError(f"{self.prefix}: a document of {arr.size} tokens exceeds int32 sequence lengths")
            self._bin.write(np.ascontiguousarray(arr, dtype=self.dtype).tobytes())
            lo, hi = int(arr.min()), int(arr.max())
            self.min_token = lo if self.min_token is None else min(self.min_token, lo)
            self.max_token = hi if self.max_token is None else max(self.max_token, hi)
            self._lengths.append(int(arr.size))
            self.tokens += int(arr.size)
        self._doc_starts.append(len(self._lengths))

    def commit(self, tokenizer: dict | None = None) -> Path:
        """fsync and rename: `.bin` first, then `.idx`, so a present `.idx` always describes a complete `.bin`;
        then the sidecar `<prefix>.shardkit.json` (token id range, and `tokenizer`: which tokenizer made them).
        Files get the process umask's permissions, as any file the user writes."""
        lengths = np.asarray(self._lengths, dtype=np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        if len(lengths) > 1:
            np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        tmp_idx = None
        try:
            self._bin.flush()
            os.fsync(self._bin.fileno())
            self._bin.close()
            fd, tmp_idx = _mkstemp_umask(self.prefix, ".idx.tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(MAGIC + struct.pack("<Q", VERSION) + struct.pack("<B", _CODE_OF[self.dtype]))
                f.write(struct.pack("<Q", len(lengths)) + struct.pack("<Q", len(self._doc_starts)))
                f.write(lengths.tobytes())
                f.write(pointers.tobytes())
                f.write(np.asarray(self._doc_starts, dtype=np.int64).tobytes())
                f.flush()
                os.fsync(f.fileno())
            os.replace(self._tmp_bin, f"{self.prefix}.bin")
            os.replace(tmp_idx, f"{self.prefix}.idx")
        except OSError as e:
            self.abort()
            if tmp_idx:
                Path(tmp_idx).unlink(missing_ok=True)
            raise DataError(f"{self.prefix}.idx: cannot write ({e.strerror})") from None
        bin_path = Path(f"{self.prefix}.bin")
        write_token_stats(bin_path, self.min_token, self.max_token, tokenizer, strict=True)
        return self.prefix

    def abort(self) -> None:
        if not self._bin.closed:
            self._bin.close()
        Path(self._tmp_bin).unlink(missing_ok=True)

    def __enter__(self) -> "IndexedWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()


def write_indexed(prefix: str | os.PathLike, docs: Iterable[np.ndarray], dtype: np.dtype | type) -> Path:
    """Write `docs` (one 1-D token array per document) as Megatron's `<prefix>.bin`/`.idx`, atomically."""
    with IndexedWriter(prefix, dtype) as w:
        for d in docs:
            w.add(d)
        return w.commit()


# -- preprocess-data: JSONL -> .bin/.idx ------------------------------------------------------------------------------

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


# -- reading ----------------------------------------------------------------------------------------------------------

class IndexedDataset:
    """Read-only, memory-mapped view of `<prefix>.bin`/`.idx`; every inconsistency is a one-line DataError."""

    def __init__(self, prefix: str | os.PathLike):
        self.prefix = str(prefix)
        idx, bin_ = Path(f"{self.prefix}.idx"), Path(f"{self.prefix}.bin")
        from checkpoint.safety import regular_file

        for p in (idx, bin_):
            if not regular_file(p, f"data prefix {self.prefix}", missing_ok=True):  # a FIFO: one line, no hang
                raise DataError(f"data prefix {self.prefix}: {p} does not exist"
                                + (" (pass the prefix without .bin/.idx)" if self.prefix.endswith((".bin", ".idx"))
                                   else ""))
        self.idx_path, self.bin_path = idx, bin_
        size = idx.stat().st_size
        with open(idx, "rb") as f:
            head = f.read(HEADER_BYTES)
        if len(head) < HEADER_BYTES:
            raise DataError(f"{idx}: truncated header ({size} bytes, need {HEADER_BYTES})")
        if head[:9] != MAGIC:
            raise DataError(f"{idx}: not a Megatron indexed dataset (magic {head[:9]!r}, expected {MAGIC!r})")
        version, = struct.unpack_from("<Q", head, 9)
        if version != VERSION:
            raise DataError(f"{idx}: unsupported .idx version {version} (expected {VERSION})")
        code = head[17]
        if code not in DTYPE_CODES:
            raise DataError(f"{idx}: unknown token dtype code {code} (known: {sorted(DTYPE_CODES)})")
        self.dtype = np.dtype(DTYPE_CODES[code])
        n_seq, n_doc = struct.unpack_from("<QQ", head, 18)
        expected = HEADER_BYTES + 12 * n_seq + 8 * n_doc
        if n_seq and size == expected + n_seq:
            raise DataError(f"{idx}: has per-sequence modes (a multimodal dataset); only text datasets are supported")
        if size != expected:
            raise DataError(f"{idx}: {size} bytes, but its header ({n_seq} sequences, {n_doc} documents) "
                            f"needs {expected}: truncated or corrupt")
        mm = np.memmap(idx, dtype=np.uint8, mode="r")
        self.sequence_lengths = np.frombuffer(mm, np.int32, n_seq, HEADER_BYTES)
        self.sequence_pointers = np.frombuffer(mm, np.int64, n_seq, HEADER_BYTES + 4 * n_seq)
        self.document_indices = np.frombuffer(mm, np.int64, n_doc, HEADER_BYTES + 12 * n_seq)
        self._check(idx, bin_, n_seq)
        bin_size = bin_.stat().st_size
        self._tokens = (np.memmap(bin_, dtype=self.dtype, mode="r") if bin_size else np.empty(0, self.dtype))

    def _check(self, idx: Path, bin_: Path, n_seq: int) -> None:
        lengths, pointers, docs = self.sequence_lengths, self.sequence_pointers, self.document_indices
        if n_seq and lengths.min() < 0:
            raise DataError(f"{idx}: negative sequence length at sequence {int(np.argmin(lengths))}")
        if len(docs) == 0 or docs[0] != 0 or docs[-1] != n_seq or (len(docs) > 1 and np.any(np.diff(docs) < 0)):
            raise DataError(f"{idx}: document indices must rise from 0 to the sequence count {n_seq}")
        bin_size = bin_.stat().st_size
        if bin_size % self.dtype.itemsize:
            raise DataError(f"{bin_}: {bin_size} bytes is not a whole number of {self.dtype} tokens")
        if n_seq:
            ends = pointers + lengths.astype(np.int64) * self.dtype.itemsize
            bad = np.flatnonzero((pointers < 0) | (ends > bin_size) | (pointers % self.dtype.itemsize != 0))
            if bad.size:
                i = int(bad[0])
                raise DataError(f"{bin_}: {bin_size} bytes, but {idx} places sequence {i} at bytes "
                                f"[{int(pointers[i])}, {int(ends[i])}): truncated or mismatched .bin/.idx")

    def __len__(self) -> int:
        """Number of sequences (Megatron's GPT "documents")."""
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens of sequence `i` from `offset` (a view into the memory-mapped .bin)."""
        start = int(self.sequence_pointers[i]) // self.dtype.itemsize + offset
        n = int(self.sequence_lengths[i]) - offset if length is None else length
        return self._tokens[start:start + n]

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)

    def digest(self) -> str:
        """sha256 of the .idx bytes plus the .bin size: changes whenever the documents or their lengths do."""
        st = self.idx_path.stat()
        return _file_digest(str(self.idx_path.resolve()), st.st_size, st.st_mtime_ns) + \
            f":{self.bin_path.stat().st_size}"


@functools.lru_cache(maxsize=64)
def _file_digest(path: str, size: int, mtime_ns: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# -- the token-statistics sidecar and the vocabulary check ------------------------------------------------------------

SIDECAR_SUFFIX = ".shardkit.json"  # <prefix>.shardkit.json beside <prefix>.idx
SIDECAR_FORMAT = "shardkit-token-stats"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
                    "added_tokens.json", "vocab.json", "merges.txt", "vocab.txt", "spiece.model",
                    "sentencepiece.bpe.model", "tiktoken.model")


def _umask() -> int:
    try:  # Linux: read without changing it (os.umask would, for a moment, for every thread)
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    old = os.umask(0o022)
    os.umask(old)
    return old


def _mkstemp_umask(prefix: Path, suffix: str) -> tuple[int, str]:
    """mkstemp beside `prefix` (0600), then the mode a plain open() would have given: 0666 & ~umask."""
    fd, name = tempfile.mkstemp(prefix=f".{prefix.name}.", suffix=suffix, dir=prefix.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())
    except OSError:
        os.close(fd)
        Path(name).unlink(missing_ok=True)
        raise
    return fd, name


def sidecar_path(bin_path: str | os.PathLike) -> Path:
    p = Path(bin_path)
    return p.with_name(p.name[: -len(".bin")] + SIDECAR_SUFFIX) if p.name.endswith(".bin") else \
        p.with_name(p.name + SIDECAR_SUFFIX)


def tokenizer_record(tokenizer_dir: str | os.PathLike, tok) -> dict:
    """Which tokenizer made a dataset: its directory, name, vocabulary size (with added tokens) and the sha256 of each
    of its files."""
    path = Path(tokenizer_dir)
    names = set(_TOKENIZER_FILES) | set(getattr(tok, "vocab_files_names", {}).values())
    files = {}
    for name in sorted(names):
        f = path / name
        if f.is_file():
            h = hashlib.sha256()
            with open(f, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    h.update(block)
            files[name] = h.hexdigest()
    return {"path": str(path.resolve()), "name": getattr(tok, "name_or_path", None) or path.name,
            "class": type(tok).__name__, "vocab_size": len(tok), "files_sha256": files}


def write_token_stats(bin_path: Path, lo: int | None, hi: int | None, tokenizer: dict | None,
                      strict: bool = False) -> bool:
    """Write `<prefix>.shardkit.json` atomically: the .bin's size and mtime (what the cache is valid for), its
    smallest and largest token id and, when known, the tokenizer record. Never replaces a file that is not a
    shardkit sidecar. `strict`: a write error is a DataError (preprocess-data); else it is only a missed cache."""
    out = sidecar_path(bin_path)
    try:
        if out.exists() and _read_sidecar(out) is None:
            if strict:
                raise DataError(f"{out}: exists and is not a shardkit token-statistics file; not replaced")
            return False
        st = bin_path.stat()
        rec = {"format": SIDECAR_FORMAT, "version": 1, "bin": bin_path.name, "bin_size": st.st_size,
               "bin_mtime_ns": st.st_mtime_ns, **_bin_identity(st), "min_token_id": lo, "max_token_id": hi}
        if tokenizer is not None:
            rec["tokenizer"] = tokenizer
        rec["digest"] = _sidecar_digest(rec)
        fd, tmp = _mkstemp_umask(out, ".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(rec, indent=1) + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, out)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return True
    except OSError as e:
        if strict:
            raise DataError(f"{out}: cannot write ({e.strerror})") from None
        return False  # a read-only data directory: the range is computed again next time


def _bin_identity(st: os.stat_result) -> dict:
    """What else must hold for a sidecar to describe its .bin (issue 34): the same file (inode) not rewritten since
    (ctime_ns: `touch` cannot set it back, a copy or rename over the .bin changes it)."""
    return {"bin_ino": st.st_ino, "bin_ctime_ns": st.st_ctime_ns}


def _sidecar_digest(rec: dict) -> str:
    """sha256 of the record without its digest: a hand edit (a lowered max_token_id) that did not recompute it is
    seen, and the record is recomputed from the tokens instead of trusted."""
    body = {k: v for k, v in rec.items() if k != "digest"}
    return "sha256:" + hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _read_sidecar(path: Path) -> dict | None:
    try:
        if not path.is_file() or path.stat().st_size > 1 << 20:
            return None
        rec = json.loads(path.read_text())
    except (OSError, ValueError, UnicodeDecodeError, RecursionError):
        return None
    return rec if isinstance(rec, dict) and rec.get("format") == SIDECAR_FORMAT else None


def token_stats(ds: IndexedDataset, chunk_tokens: int = 1 << 26) -> dict:
    """{min_token_id, max_token_id, tokenizer} of a dataset's .bin: from its sidecar when that was written for this
    .bin (same size and mtime), else a memory-mapped pass over the tokens (in chunks: bounded memory), cached in a
    new sidecar (atomically; skipped when the directory is read-only)."""
    st = ds.bin_path.stat()
    rec = _read_sidecar(sidecar_path(ds.bin_path))
    same_bin = rec is not None and rec.get("bin_size") == st.st_size and rec.get("bin_mtime_ns") == st.st_mtime_ns
    if same_bin and all(rec.get(k) == v for k, v in _bin_identity(st).items()) \
            and rec.get("digest") == _sidecar_digest(rec) \
            and all(isinstance(rec.get(k), (int, type(None))) and not isinstance(rec.get(k), bool)
                    for k in ("min_token_id", "max_token_id")):
        return rec
    # stale (another .bin, or a copy of it), edited (the digest), or written before these checks: recomputed from the
    # tokens; its tokenizer record (a hint in check_vocab's line) is kept unless the record was edited
    keep_tokenizer = same_bin and rec.get("digest", _sidecar_digest(rec)) == _sidecar_digest(rec) \
        and isinstance(rec.get("tokenizer"), dict)
    lo = hi = None
    tokens = ds._tokens
    for start in range(0, len(tokens), chunk_tokens):
        part = tokens[start:start + chunk_tokens]
        a, b = int(part.min()), int(part.max())
        lo, hi = (a, b) if lo is None else (min(lo, a), max(hi, b))
    tokenizer = rec["tokenizer"] if keep_tokenizer else None  # a changed .bin: the old record no longer says who
    write_token_stats(ds.bin_path, lo, hi, tokenizer)
    return {"min_token_id": lo, "max_token_id": hi, "tokenizer": tokenizer}


# .bin (real path) -> (the model's vocabulary, the model), from check_vocab: GPTDataset checks every sample it reads
# against it (issue 34: a stale or edited sidecar's range let ids past the vocabulary through, to an IndexError deep
# in the embedding); a vectorized min/max of seq_length + 1 ids per sample costs nothing beside the step
_VOCAB: dict[str, tuple[int, str]] = {}


def _check_sample(indexed: "IndexedDataset", sample: np.ndarray, i: int) -> np.ndarray:
    key = indexed.__dict__.get("_real_bin")
    if key is None:  # (resolved once per dataset, not per sample)
        key = indexed.__dict__["_real_bin"] = os.path.realpath(indexed.bin_path)
    limit = _VOCAB.get(key)
    if limit is not None and sample.size:
        lo, hi = int(sample.min()), int(sample.max())
        if lo < 0 or hi >= limit[0]:
            bad = lo if lo < 0 else hi
            raise DataError(f"{indexed.bin_path}: token id {bad} in sample {i} is outside the model's vocabulary of "
                            f"{limit[0]} tokens ({limit[1]}); {sidecar_path(indexed.bin_path).name} said otherwise "
                            "(stale or edited): tokenize the data with the model's tokenizer")
    return sample


def check_vocab(paths: Sequence[str], vocab_size: int, model: str) -> None:
    """Every dataset's token ids must lie in [0, vocab_size) of the model (its true vocabulary, not the TP padding):
    one DataError naming the file, the largest id and the vocabulary, and the tokenizer that made the file when its
    sidecar records one that is larger than the model's."""
    prefixes, _ = parse_blend(paths)
    for p in dict.fromkeys(prefixes):
        ds = IndexedDataset(p)
        _VOCAB[os.path.realpath(ds.bin_path)] = (vocab_size, model)  # every sample read is checked too
        if ds.num_tokens == 0:
            continue
        s = token_stats(ds)
        lo, hi = s.get("min_token_id"), s.get("max_token_id")
        if hi is None or (0 <= lo and hi < vocab_size):
            continue
        tok = s.get("tokenizer") if isinstance(s.get("tokenizer"), dict) else None
        mismatch = ""
        if tok and isinstance(tok.get("vocab_size"), int) and tok["vocab_size"] > vocab_size:
            mismatch = (f"; tokenizer mismatch: it was made by {tok.get('name') or tok.get('path')} "
                        f"(vocab size {tok['vocab_size']}), not the model's tokenizer")
        if lo < 0:
            raise DataError(f"{ds.bin_path}: token id {lo} is negative (the model's vocabulary is {vocab_size} "
                            f"tokens, {model}){mismatch}")
        raise DataError(f"{ds.bin_path}: largest token id {hi} is beyond the model's vocabulary of {vocab_size} "
                        f"tokens ({model}){mismatch}; tokenize the data with the model's tokenizer")


# -- the GPT sample order (megatron-core GPTDataset) -------------------------------------------------------------------

def num_epochs_needed(tokens_per_epoch: int, seq_length: int, num_samples: int | None) -> int:
    """Fewest epochs whose tokens cover num_samples samples of seq_length (+1 extra token)."""
    if num_samples is None:
        return 1
    need = num_samples * seq_length + 1
    return max(1, -(-need // tokens_per_epoch))


def build_document_index(documents: np.ndarray, num_epochs: int, rng: np.random.RandomState,
                         separate_final_epoch: bool) -> np.ndarray:
    """Documents tiled over the epochs and shuffled (the last epoch shuffled on its own when separate)."""
    if not separate_final_epoch or num_epochs == 1:
        index = np.tile(np.asarray(documents, dtype=np.int32), num_epochs)
        rng.shuffle(index)
        return index
    first = build_document_index(documents, num_epochs - 1, rng, False)
    last = build_document_index(documents, 1, rng, False)
    return np.concatenate((first, last))


def build_sample_index(sizes: np.ndarray, document_index: np.ndarray, seq_length: int, num_epochs: int,
                       tokens_per_epoch: int) -> np.ndarray:
    """[num_samples+1, 2] (position in document_index, token offset) where each sample starts.

    Sample i covers tokens [i*seq, i*seq + seq + 1) of the documents concatenated in document_index order, so
    consecutive samples share one token; the partial last sample is dropped. Vectorised equivalent of megatron-core's
    helpers.cpp build_sample_idx (a start that falls on the end of a document stays on its last token, as there).
    """
    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    lengths = sizes[document_index].astype(np.int64)
    ends = np.cumsum(lengths)
    starts = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    pos = np.searchsorted(ends, starts, side="right")
    out = np.empty((num_samples + 1, 2), dtype=np.int64)
    out[:, 0] = pos
    out[:, 1] = starts - (ends[pos] - lengths[pos])
    out[0] = (0, 0)
    dtype = np.int32 if max(len(document_index), int(sizes.max(initial=0))) <= np.iinfo(np.int32).max else np.int64
    return out.astype(dtype)


def build_shuffle_index(num_samples: int, total_size: int, rng: np.random.RandomState) -> np.ndarray:
    """A permutation of [0, num_samples) followed by a separate permutation of [num_samples, total_size)."""
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


class Dataset(Protocol):
    fingerprint: str  # everything that decides the samples, the size included
    identity: str  # the same without the size (files, blend, split, seed, seq length)

    def __len__(self) -> int: ...

    def __getitem__(self, i: int) -> np.ndarray: ...


class GPTDataset:
    """Samples of seq_length+1 tokens from the sequences `indices` of one indexed dataset, in Megatron's order."""

    def __init__(self, indexed: IndexedDataset, indices: np.ndarray, num_samples: int | None, seq_length: int,
                 seed: int, split: str = "train"):
        self.indexed, self.seq_length, self.num_samples, self.seed = indexed, seq_length, num_samples, seed
        self.indices = np.asarray(indices, dtype=np.int32)
        what = f"data prefix {indexed.prefix} ({split} split, {len(self.indices)} of {len(indexed)} documents)"
        tokens_per_epoch = int(indexed.sequence_lengths[self.indices].sum(dtype=np.int64))
        if tokens_per_epoch == 0:
            raise DataError(f"{what}: no tokens")
        if tokens_per_epoch < seq_length + 1:
            raise DataError(f"{what}: {tokens_per_epoch} tokens, fewer than one sample of --seq-length {seq_length} "
                            "+ 1; use a shorter --seq-length or more data")
        epochs = num_epochs_needed(tokens_per_epoch, seq_length, num_samples)
        separate_final_epoch = False
        if epochs > 1:
            sans_final = ((epochs - 1) * tokens_per_epoch - 1) // seq_length
            per_epoch = (tokens_per_epoch - 1) // seq_length
            separate_final_epoch = (num_samples - sans_final) < int(0.80 * per_epoch)
        rng = np.random.RandomState(seed)
        self.document_index = build_document_index(self.indices, epochs, rng, separate_final_epoch)
        self.sample_index = build_sample_index(indexed.sequence_lengths, self.document_index, seq_length, epochs,
                                               tokens_per_epoch)
        n = self.sample_index.shape[0] - 1
        self.shuffle_index = build_shuffle_index(sans_final if separate_final_epoch else n, n, rng)
        self.num_epochs = epochs
        beg, end = (int(self.indices[0]), int(self.indices[-1]) + 1) if len(self.indices) else (0, 0)
        what_data = {"kind": "gpt", "order_version": ORDER_VERSION, "data": indexed.digest(),
                     "documents": [beg, end, len(self.indices)], "seq_length": seq_length, "seed": seed, "split": split}
        self.fingerprint = _digest(dict(what_data, num_samples=num_samples))
        # the same without the size: what must not change when a run continues with more --train-iters/-samples
        self.identity = _digest(what_data)

    def __len__(self) -> int:
        return self.shuffle_index.shape[0]

    def __getitem__(self, i: int) -> np.ndarray:
        """int64 tokens [seq_length + 1] of sample i (after the shuffle)."""
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range [0, {len(self)})")
        j = int(self.shuffle_index[i])
        (d0, o0), (d1, o1) = self.sample_index[j], self.sample_index[j + 1]
        docs = self.document_index
        if d0 == d1:
            return _check_sample(self.indexed, self.indexed.get(int(docs[d0]), int(o0), int(o1 - o0 + 1))
                                 .astype(np.int64), i)
        parts = [self.indexed.get(int(docs[d0]), int(o0))]
        parts += [self.indexed.get(int(docs[k])) for k in range(d0 + 1, d1)]
        parts.append(self.indexed.get(int(docs[d1]), 0, int(o1) + 1))
        return _check_sample(self.indexed, np.concatenate(parts).astype(np.int64), i)


def build_blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset id, sample within that dataset) for each blended sample: greedily the dataset furthest behind its
    weight, ties to the lowest id (megatron-core helpers.cpp build_blending_indices, same double arithmetic)."""
    w = [float(x) for x in weights]
    counts = [0] * len(w)
    chosen = [0] * size
    rest = range(1, len(w))
    for i in range(size):  # plain Python lists: ~0.5 us per sample, twice as fast as numpy element access
        x = float(i) if i else 1.0
        best, best_err = 0, w[0] * x - counts[0]
        for d in rest:
            err = w[d] * x - counts[d]
            if err > best_err:
                best, best_err = d, err
        chosen[i] = best
        counts[best] += 1
    dataset_index = np.asarray(chosen, dtype=np.int16)
    sample_index = np.empty(size, dtype=np.int64)
    for d in range(len(w)):  # each dataset's samples are taken in order 0, 1, 2, ...
        mask = dataset_index == d
        sample_index[mask] = np.arange(int(mask.sum()))
    return dataset_index, sample_index


def normalize(weights: Sequence[float]) -> list[float]:
    w = np.asarray(weights, dtype=np.float64)
    return (w / w.sum()).tolist()


class BlendedDataset:
    """`size` samples drawn from several GPTDatasets in proportion to `weights` (megatron-core BlendedDataset)."""

    def __init__(self, datasets: list[GPTDataset], weights: Sequence[float], size: int, split: str = "train"):
        self.datasets, self.weights, self.size = datasets, normalize(weights), size
        self.dataset_index, self.dataset_sample_index = build_blending_indices(self.weights, size)
        counts = np.bincount(self.dataset_index, minlength=len(datasets))
        for d, (ds, n) in enumerate(zip(datasets, counts)):
            if n > len(ds):
                raise DataError(f"{split} blend draws {n} samples from data prefix {ds.indexed.prefix}, which has "
                                f"only {len(ds)}: raise its share of the data or lower its weight")
        self.fingerprint = _digest({"kind": "blend", "order_version": ORDER_VERSION, "weights": self.weights,
                                    "size": size, "datasets": [ds.fingerprint for ds in datasets]})
        self.identity = _digest({"kind": "blend", "order_version": ORDER_VERSION, "weights": self.weights,
                                 "datasets": [ds.identity for ds in datasets]})

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < self.size:
            raise IndexError(f"sample {i} out of range [0, {self.size})")
        return self.datasets[int(self.dataset_index[i])][int(self.dataset_sample_index[i])]


# -- configuration: blend, split, build --------------------------------------------------------------------------------

@dataclass(frozen=True)
class DataConfig:
    """What determines the samples: `paths` is Megatron's --data-path (prefixes, or weight prefix pairs)."""

    paths: tuple[str, ...]
    seq_length: int
    seed: int = 1234
    split: str = "969,30,1"


def parse_blend(paths: Sequence[str]) -> tuple[list[str], list[float] | None]:
    """Megatron's --data-path: `A B C` (unweighted) or `0.3 A 0.7 B` (weights, normalised later)."""
    paths = [str(p) for p in paths]
    if not paths:
        raise DataError("--data-path: no data prefix given")
    if len(paths) % 2 == 0:
        try:
            weights = [float(paths[i]) for i in range(0, len(paths), 2)]
        except ValueError:
            weights = None
        if weights is not None:
            prefixes = [paths[i + 1].strip() for i in range(0, len(paths), 2)]
            bad = [(w, p) for w, p in zip(weights, prefixes) if not (w > 0 and math.isfinite(w))]
            if bad:
                raise DataError(f"--data-path: weight {bad[0][0]} of {bad[0][1]} must be a positive number")
            return prefixes, weights
    numeric = [p for p in paths if _is_number(p)]
    if numeric:
        raise DataError(f"--data-path: {' '.join(paths)}: give either prefixes or weight/prefix pairs "
                        f"('{numeric[0]}' looks like a weight)")
    return [p.strip() for p in paths], None


def _is_number(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False


def split_matrix(split: str) -> list[tuple[float, float] | None]:
    """`--split 969,30,1` -> [(0, .969), (.969, .999), (.999, 1.0)]; an empty share is None."""
    parts = re.split(r"[,/\s]+", split.strip())
    if not 1 <= len(parts) <= 3 or not all(re.fullmatch(r"[0-9]*\.?[0-9]+", p) for p in parts):
        raise DataError(f"--split {split!r}: expected up to three non-negative numbers, e.g. 969,30,1")
    vec = [float(p) for p in parts] + [0.0] * (3 - len(parts))
    if sum(vec) <= 0:
        raise DataError(f"--split {split!r}: the shares add up to zero")
    vec = normalize(vec)
    bounds = [0.0]
    for v in vec:
        bounds.append(bounds[-1] + v)
    return [(a, b) if b > a else None for a, b in zip(bounds[:-1], bounds[1:])]


def split_indices(num_sequences: int, bookend: tuple[float, float]) -> np.ndarray:
    beg = int(round(bookend[0] * float(num_sequences)))
    end = int(round(bookend[1] * float(num_sequences)))
    return np.arange(beg, end, dtype=np.int32)


def build_datasets(cfg: DataConfig, train_samples: int, valid_samples: int) -> tuple[Dataset, Dataset | None]:
    """The train dataset (at least train_samples long) and the valid one (None when not asked for or split to 0).

    Same construction as megatron-core's BlendedMegatronDatasetBuilder: one prefix -> a GPTDataset; weighted
    prefixes -> GPTDatasets of ceil(ceil(n*w)*1.005) samples blended to sum(ceil(n*w)); unweighted prefixes -> one
    epoch each, blended by their sizes.
    """
    if cfg.seq_length < 1:
        raise DataError(f"--seq-length {cfg.seq_length}: must be positive")
    if train_samples < 1:
        raise DataError(f"train samples {train_samples}: must be positive (--train-iters x --global-batch-size)")
    prefixes, weights = parse_blend(cfg.paths)
    bookends = split_matrix(cfg.split)
    indexed = {p: IndexedDataset(p) for p in dict.fromkeys(prefixes)}
    for p, ds in indexed.items():
        if ds.num_tokens == 0:
            raise DataError(f"data prefix {p}: empty dataset ({len(ds)} sequences, 0 tokens)")
    if bookends[0] is None:
        raise DataError(f"--split {cfg.split}: the train share is zero")
    train = _build_split(cfg, prefixes, weights, indexed, 0, bookends[0], train_samples)
    valid = None
    if valid_samples > 0 and bookends[1] is not None:
        valid = _build_split(cfg, prefixes, weights, indexed, 1, bookends[1], valid_samples)
    return train, valid


def _build_split(cfg: DataConfig, prefixes: list[str], weights: list[float] | None,
                 indexed: dict[str, IndexedDataset], split: int, bookend: tuple[float, float],
                 size: int) -> Dataset:
    name = SPLIT_NAMES[split]

    def gpt(prefix: str, n: int | None) -> GPTDataset:
        idx = split_indices(len(indexed[prefix]), bookend)
        if len(idx) == 0:
            raise DataError(f"data prefix {prefix}: --split {cfg.split} leaves the {name} split no documents "
                            f"(of {len(indexed[prefix])}); give it a larger share or more documents")
        return GPTDataset(indexed[prefix], idx, n, cfg.seq_length, cfg.seed, name)

    if len(prefixes) == 1 and weights is None:
        return gpt(prefixes[0], size)
    if weights is not None:
        w = normalize(weights)
        target = [int(math.ceil(size * x)) for x in w]
        buffered = [int(math.ceil(math.ceil(size * x) * (1 + BLEND_SURPLUS))) for x in w]
        return BlendedDataset([gpt(p, n) for p, n in zip(prefixes, buffered)], w, sum(target), name)
    mids = [gpt(p, None) for p in prefixes]
    lengths = [len(m) for m in mids]
    if sum(lengths) < size:  # Megatron would build the short blend and run out mid-training
        raise DataError(f"--data-path without weights uses each prefix once: its {name} split holds {sum(lengths)} "
                        f"samples of --seq-length {cfg.seq_length}, the run needs {size}; give weights "
                        "(`0.5 A 0.5 B`, which repeat data as needed), more data or fewer iterations")
    return BlendedDataset(mids, lengths, size, name)


def _digest(obj: dict) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:32]


# -- micro-batches (Megatron-LM MegatronPretrainingSampler) ------------------------------------------------------------

def micro_batches(dataset: Dataset, consumed_samples: int, micro_batch_size: int, dp_rank: int,
                  dp_size: int) -> Iterator["torch.Tensor"]:
    """int64 [mbs, seq+1] batches for one DP rank, in order from consumed_samples.

    Each step of mbs*dp consecutive samples gives rank r the slice [r*mbs, (r+1)*mbs); a partial last step is
    dropped. Resuming at consumed_samples=k therefore yields exactly what an uninterrupted run sees after k samples,
    whatever the DP size was before.
    """
    total = len(dataset)
    if micro_batch_size < 1 or dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise DataError(f"micro_batches: micro batch size {micro_batch_size}, DP rank {dp_rank} of {dp_size}: "
                        "need mbs >= 1 and 0 <= rank < size")
    if not 0 <= consumed_samples < total:
        raise DataError(f"consumed samples {consumed_samples}: the dataset holds {total} samples; it was built for "
                        "fewer samples than the run needs (raise --train-iters before building, or "
                        "--override-data-state)")
    return _iterate(dataset, consumed_samples, micro_batch_size, dp_rank, dp_size)


def _iterate(dataset: Dataset, consumed: int, mbs: int, rank: int, dp: int) -> Iterator["torch.Tensor"]:
    import torch

    step = mbs * dp
    for start in range(consumed, len(dataset) - step + 1, step):
        lo = start + rank * mbs
        yield torch.from_numpy(np.stack([dataset[i] for i in range(lo, lo + mbs)]))


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
