"""Megatron's indexed dataset: `<prefix>.bin` (the concatenated tokens) and `<prefix>.idx`, written (IndexedWriter,
write_indexed) and read (IndexedDataset, memory-mapped) as megatron-core's indexed_dataset does.

File format (`.idx`, little-endian): magic `MMIDIDX\\0\\0`, `<Q` version 1, `<B` dtype code, `<Q` sequence count,
`<Q` document count, int32 sequence lengths, int64 sequence byte pointers into `.bin`, int64 document indices (the
sequence index at which each document starts, then the total). `.bin` is the concatenated tokens.
"""
from __future__ import annotations

import functools
import hashlib
import os
import struct
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from .errors import DataError
from .stats import _mkstemp_umask, _read_sidecar, sidecar_path, write_token_stats

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_BYTES = len(MAGIC) + 8 + 1 + 8 + 8  # 34
DTYPE_CODES: dict[int, type] = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
                                7: np.float32, 8: np.uint16}
_CODE_OF = {np.dtype(t): c for c, t in DTYPE_CODES.items()}


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

