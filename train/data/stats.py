"""The token-statistics sidecar `<prefix>.shardkit.json` beside a dataset's `.idx`: its `.bin`'s smallest and largest
token id, what the cache is valid for (the `.bin`'s size, mtime, inode and ctime, and a digest of the record), and
the tokenizer that made the tokens when known. Written by IndexedWriter.commit (preprocess-data, write_indexed) and
cached by token_stats on a dataset's first read."""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from checkpoint.safety import sha256_file

from .errors import DataError

if TYPE_CHECKING:
    from .indexed import IndexedDataset

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
            files[name] = sha256_file(f)
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
