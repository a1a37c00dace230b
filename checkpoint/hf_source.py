"""Lazy, validated access to an HF checkpoint's safetensors (single file or sharded with an index).

Only headers are read up front; tensors are read as row/column slices on demand, as numpy views of the memory-mapped
file (the header gives every tensor's byte range, checked against the file size), so memory stays bounded by what
one task asks for, whatever the model size, and nothing is copied before the writer encodes it.
"""
from __future__ import annotations

import hashlib
import json
import mmap
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import store
from .errors import FormatError
from .safety import (SIDE_FILE_PATTERNS, copy_side_files, open_input, read_input, regular_file, safe_path,
                               side_files)
from .sharding import SCALE_SUFFIX  # DeepSeek-V3: `<weight>_scale_inv`, one fp32 scale per block

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# tokenizer / generation files carried under <iter>/hf/ and exported back
ASSET_PATTERNS = SIDE_FILE_PATTERNS  # the tokenizer / generation files carried (checkpoint.safety: one allowlist)
_ST_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn",
              "F8_E5M2": "float8_e5m2"}
_MAX_HEADER = 100 * 1024 * 1024


@dataclass(frozen=True)
class HFTensorInfo:
    file: str
    dtype: str
    shape: tuple[int, ...]
    offset: int = 0  # of the tensor's first byte in the file

    @property
    def row_bytes(self) -> int:
        """Bytes of one row (the first axis) of the tensor: row r starts at `offset + r * row_bytes`."""
        row = store.itemsize(self.dtype)
        for s in self.shape[1:]:
            row *= s
        return row


def read_header(path: Path) -> tuple[dict, bytes]:
    """The safetensors JSON header of `path` (validated) and its raw bytes (for provenance hashing)."""
    try:
        with os.fdopen(open_input(path), "rb") as f:  # a FIFO or device: refused, never a blocking read
            head = f.read(8)
            if len(head) != 8:
                raise FormatError(f"{path}: corrupt safetensors file (shorter than its 8-byte header length)")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER or n + 8 > os.fstat(f.fileno()).st_size:
                raise FormatError(f"{path}: corrupt safetensors header (claims {n} bytes)")
            raw = f.read(n)
    except OSError as e:
        raise FormatError(f"{path}: cannot read ({e.strerror})") from None
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("not an object")
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise FormatError(f"{path}: corrupt safetensors header ({e})") from None
    return header, raw


def _size(x: object) -> int:
    """A shape entry or data offset: a non-negative JSON integer (safetensors reads them as usize)."""
    if not isinstance(x, int) or isinstance(x, bool) or x < 0:
        raise ValueError(f"{x!r} is not a non-negative integer")
    return x


def _check_spans(path: Path, spans: list[tuple[int, int, str]], data_len: int) -> None:
    """What the safetensors library itself checks (`Metadata::validate` and the buffer check of its Rust core):
    sorted by offsets, the tensors' byte ranges follow each other from byte 0 with no gap and no overlap, and the
    last one ends exactly at the end of the file. A file that breaks this is refused by safe_open too; here it is
    one line naming the file and the tensor."""
    start = 0
    for begin, end, name in sorted(spans):
        if begin != start:
            how = "overlaps the tensor before it" if begin < start else f"leaves a gap of {begin - start} bytes"
            raise FormatError(f"{path}: tensor {name}: data offsets {begin}..{end} {how} (the data so far ends at "
                              f"{start}); corrupt safetensors file (the safetensors library refuses it too)")
        start = end
    if start != data_len:
        last = max(spans)[2] if spans else None
        raise FormatError(f"{path}: the tensors' data end at byte {start:,} of {data_len:,}"
                          f"{f' (last tensor {last})' if last else ''}: bytes no tensor covers; corrupt safetensors "
                          "file (the safetensors library refuses it too)")


class HFSource:
    """The tensors of an HF model directory, by name, read lazily."""

    def __init__(self, hf_dir: str | Path):
        self.dir = Path(hf_dir)
        if not self.dir.is_dir():
            raise FormatError(f"{self.dir}: not a directory")
        self.files, weight_map = self._discover()
        self.tensors: dict[str, HFTensorInfo] = {}
        self.file_info: list[dict] = []
        for fname in self.files:
            path = self.dir / fname
            header, raw = read_header(path)
            size = path.stat().st_size
            self.file_info.append({"name": fname, "size": size,
                                   "header_sha256": hashlib.sha256(raw).hexdigest()})
            data_len = size - 8 - len(raw)
            meta_md = header.get("__metadata__")
            if meta_md is not None and not (isinstance(meta_md, dict) and
                                            all(isinstance(v, str) for v in meta_md.values())):
                raise FormatError(f"{path}: corrupt safetensors header (__metadata__ must map strings to strings)")
            spans: list[tuple[int, int, str]] = []
            for name, meta in header.items():
                if name == "__metadata__":
                    continue
                try:
                    dtype = _ST_DTYPES[meta["dtype"]]
                    shape = tuple(_size(x) for x in meta["shape"])
                    begin, end = (_size(x) for x in meta["data_offsets"])
                except KeyError as e:
                    raise FormatError(f"{path}: tensor {name}: unsupported dtype or malformed header entry ({e})") \
                        from None
                except (TypeError, ValueError) as e:
                    raise FormatError(f"{path}: tensor {name}: malformed header entry ({e})") from None
                n = 1
                for s in shape:
                    n *= s
                if not (0 <= begin <= end <= data_len) or end - begin != n * store.itemsize(dtype):
                    raise FormatError(f"{path}: tensor {name}: data offsets {begin}..{end} do not fit its shape "
                                      f"{list(shape)} / the file size (truncated or corrupt file)")
                if weight_map is not None and name not in weight_map:
                    raise FormatError(f"{path}: holds tensor {name}, which {INDEX} does not list (a partial or "
                                      "stale index: every tensor of every shard must be in its weight_map)")
                if weight_map is not None and weight_map[name] != fname:
                    raise FormatError(f"{path}: holds tensor {name} that {INDEX} places in {weight_map[name]!r}")
                self.tensors[name] = HFTensorInfo(fname, dtype, shape, 8 + len(raw) + begin)
                spans.append((begin, end, name))
            _check_spans(path, spans, data_len)
        if weight_map is not None:
            missing = sorted(set(weight_map) - set(self.tensors))
            if missing:
                raise FormatError(f"{self.dir / INDEX}: names {missing[0]!r} in {weight_map[missing[0]]}, which "
                                  f"does not hold it ({len(missing)} such tensor(s))")
        self._handles: dict[str, object] = {}
        self.fp8_block: tuple[int, int] | None = None

    def _discover(self) -> tuple[list[str], dict[str, str] | None]:
        return weight_files(self.dir)

    def read(self, name: str, start: int, stop: int, cols: slice | None = None) -> np.ndarray:
        """Rows [start, stop) (and columns `cols`) of tensor `name`; block-FP8 weights come back dequantized (fp32)."""
        if self.fp8_block is not None and name + SCALE_SUFFIX in self.tensors:
            return self._dequant(name, start, stop, cols)
        return self._raw(name, start, stop, cols)

    def _raw(self, name: str, start: int, stop: int, cols: slice | None = None) -> np.ndarray:
        """A read-only numpy view of the mapped file (a copy only where a tensor's bytes are not aligned to its
        element size, which safetensors' writer never produces)."""
        info = self.tensors[name]
        m = self._handles.get(info.file)
        if m is None:
            path = self.dir / info.file
            try:
                with open(path, "rb") as f:
                    m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except (OSError, ValueError) as e:
                raise FormatError(f"{path}: cannot map ({e})") from None
            self._handles[info.file] = m
        dt = store.numpy_dtype(info.dtype)
        row = info.row_bytes
        start, stop = max(0, start), min(stop, info.shape[0] if info.shape else 1)
        rows = max(0, stop - start)
        off = info.offset + start * row
        if off + rows * row > len(m):  # the header was checked against the size when opened: the file changed since
            raise FormatError(f"{self.dir / info.file}: tensor {name}: the file is shorter than its header says "
                              "(truncated or replaced during the conversion)")
        if off % dt.itemsize:
            a = np.frombuffer(m[off:off + rows * row], dtype=dt)
        else:
            a = np.frombuffer(m, dtype=dt, count=rows * row // dt.itemsize, offset=off)
        a = a.reshape((rows, *info.shape[1:]) if info.shape else ())
        if cols is None or len(info.shape) == 1:
            return a
        return a[:, cols]

    def willneed(self, name: str, start: int, stop: int) -> None:
        """Ask the kernel to start reading rows [start, stop) of `name` into the page cache, without waiting: the
        converter calls it for the next chunk while the current one is encoded and written, so a cold source is read
        while the disk writes. Uses no state of this object (safe from another thread); a hint, so errors are
        ignored (the read that follows reports them)."""
        info = self.tensors.get(name)
        if info is None or not hasattr(os, "posix_fadvise"):
            return
        row = info.row_bytes
        try:
            fd = os.open(self.dir / info.file, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, info.offset + start * row, max(0, stop - start) * row, os.POSIX_FADV_WILLNEED)
            finally:
                os.close(fd)
        except OSError:
            pass

    def close(self) -> None:
        """Drop the mappings. _raw() returns zero-copy views of them, and every page a read touched stays resident
        (and counted in this process's RSS) while a mapping lives: kept for a whole run, RSS grows to the size of the
        source. A mapping is unmapped once the last view of it is gone; the next read maps the file again."""
        self._handles.clear()

    def _dequant(self, name: str, start: int, stop: int, cols: slice | None) -> np.ndarray:
        """DeepSeek's reference dequantization on a slice: fp32(weight) * scale_inv of its 128x128 block, in fp32
        (the caller casts to the target dtype, as the reference kernel stores to the default dtype). Done in torch,
        so the result is the reference's bit for bit."""
        br, bc = self.fp8_block
        c0, c1 = (0, self.tensors[name].shape[1]) if cols is None else (cols.start or 0, cols.stop)
        w = store.from_numpy(self._raw(name, start, stop, None if cols is None else slice(c0, c1))).float()
        s = store.from_numpy(self._raw(name + SCALE_SUFFIX, start // br, -(-stop // br),
                                       slice(c0 // bc, -(-c1 // bc)))).float()
        s = s.repeat_interleave(br, 0).repeat_interleave(bc, 1)
        r0, q0 = start - (start // br) * br, c0 - (c0 // bc) * bc
        return (w * s[r0:r0 + (stop - start), q0:q0 + (c1 - c0)]).numpy()

    def check_fp8(self, block: tuple[int, int] | None) -> set[str]:
        """Validate block-FP8 weights and their scales; returns the names of the scale tensors (consumed here)."""
        self.fp8_block = block
        scales = {n for n in self.tensors if n.endswith(SCALE_SUFFIX)}
        fp8 = {n for n, i in self.tensors.items() if i.dtype.startswith("float8")}
        if block is None:
            if fp8 or scales:
                example = sorted(fp8 or scales)[0]
                raise FormatError(f"{self.dir}: tensor {example} is FP8 / a block scale, but config.json has no "
                                  "quantization_config")
            return set()
        br, bc = block
        for sname in sorted(scales):
            wname = sname[: -len(SCALE_SUFFIX)]
            w, sc = self.tensors.get(wname), self.tensors[sname]
            if w is None:
                raise FormatError(f"{self.dir}: scale tensor {sname} has no weight {wname}")
            if w.dtype != "float8_e4m3fn" or len(w.shape) != 2:
                raise FormatError(f"{self.dir / w.file}: {wname} has a block scale but is {w.dtype} "
                                  f"{list(w.shape)}, not a 2-D float8_e4m3fn weight")
            grid = (-(-w.shape[0] // br), -(-w.shape[1] // bc))
            if tuple(sc.shape) != grid:
                raise FormatError(f"{self.dir / sc.file}: scale tensor {sname} has block grid {list(sc.shape)}, but "
                                  f"weight {wname} {list(w.shape)} with {br}x{bc} blocks needs {list(grid)}")
        unscaled = sorted(n for n in fp8 if n + SCALE_SUFFIX not in scales)
        if unscaled:
            raise FormatError(f"{self.dir}: FP8 tensor {unscaled[0]} has no {SCALE_SUFFIX} block scale")
        return scales

    def fingerprint(self) -> list[dict]:
        return self.file_info

    def resume_fingerprint(self) -> list[dict]:
        """What a resumed conversion must find unchanged (issue 34): fingerprint() (names, sizes, header hashes) plus
        each file's identity and content (content_fingerprint). A changed source is converted afresh, never resumed
        from the chunks of the old one."""
        return [{**info, **content_fingerprint(self.dir / info["name"])} for info in self.file_info]


# bytes hashed per file by content_fingerprint: SAMPLES blocks of SAMPLE_BYTES spread evenly over the file (the first
# and last included); measured ~1 ms per warm file, ~30 ms per cold 5 GB shard (scripts/BENCH.md, issue 34)
SAMPLES = 64
SAMPLE_BYTES = 4096


def content_fingerprint(path: Path) -> dict:
    """A file's identity and a hash of its content, cheap enough to take at every start of a conversion: inode, size,
    mtime_ns and ctime_ns (a rewrite in place, a rename over it or a copy into its place changes one of them; ctime is
    not settable by `touch`), and the sha256 of SAMPLES evenly spread blocks (an edit that kept the file's times,
    e.g. on a filesystem that does not keep them, is still seen where it touches a sampled block). No st_dev: ranks on
    other nodes see the same shared file under other device numbers."""
    st = os.stat(path)
    h = hashlib.sha256()
    size = st.st_size
    span = SAMPLES * SAMPLE_BYTES
    with open(path, "rb") as f:
        if size <= span:
            h.update(f.read(span))
        else:
            step = (size - SAMPLE_BYTES) // (SAMPLES - 1)
            for k in range(SAMPLES):
                h.update(os.pread(f.fileno(), SAMPLE_BYTES, k * step))
    return {"inode": st.st_ino, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns,
            "sampled_sha256": h.hexdigest()}


def weight_files(hf_dir: str | Path) -> tuple[list[str], dict[str, str] | None]:
    """The safetensors files of an HF directory and its index's weight_map (None for a single file): the one reader
    of that choice (conversion, both verify modes). Every file is checked (a plain name inside the directory, a
    regular file: a FIFO or device is one line, never a hang). A directory holding both `model.safetensors` and an
    index naming other shards is refused: transformers loads `model.safetensors` then, and converting the index's
    shards would silently be another model than the one transformers loads."""
    d = Path(hf_dir)
    index, single = d / INDEX, d / SINGLE
    if regular_file(index, missing_ok=True):
        safe_path(d, INDEX, f"{d}: index")
        try:
            wm = json.loads(read_input(index))["weight_map"]
            if not isinstance(wm, dict):
                raise ValueError("weight_map is not an object")
        except (ValueError, KeyError, TypeError) as e:
            raise FormatError(f"{index}: malformed index ({e})") from None
        except RecursionError:
            raise FormatError(f"{index}: malformed index (JSON nested too deeply)") from None
        files = sorted(set(wm.values()), key=str)
        for f in files:
            if not isinstance(f, str) or "/" in f:
                raise FormatError(f"{index}: shard name {f!r} is not a plain file name")
            safe_path(d, f, f"{index}: shard")
            if not regular_file(d / f, f"{index}: shard", missing_ok=True):
                raise FormatError(f"{index}: names shard {f!r}, which is missing from {d}")
        if files != [SINGLE] and (os.path.lexists(single)):
            raise FormatError(f"{d}: holds both {SINGLE} and {INDEX} naming {len(files)} other shard(s); "
                              f"transformers would load {SINGLE} and ignore the index, so the two may be different "
                              "weights: remove the one that is not the model")
        return files, wm
    if regular_file(single, missing_ok=True):
        safe_path(d, SINGLE, f"{d}: weights")  # a link out of the model folder is refused
        return [SINGLE], None
    if any(d.glob("*.bin")) or any(d.glob("*.pth")):
        raise FormatError(f"{d}: only pickle weights (*.bin/*.pth) found; shardkit reads safetensors "
                          "only (re-save with save_pretrained(safe_serialization=True))")
    raise FormatError(f"{d}: no {SINGLE} and no {INDEX}")


def find_assets(hf_dir: str | Path) -> list[Path]:
    """Tokenizer / generation files of an HF directory: regular files, or symlinks to regular files that stay inside
    it (in an HF hub cache snapshot: inside its `models--org--name` folder, whose blobs the snapshot links to)."""
    return side_files(hf_dir)


_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
# what a conversion needs from a hub repo (never pickle weights, never code)
HUB_PATTERNS = ["*.safetensors", INDEX, "config.json", *ASSET_PATTERNS]


def resolve_hf_dir(value: str | Path, download: bool = False) -> Path:
    """An HF model directory: `value` itself when it exists, else a hub repo id (`org/name`) resolved through
    huggingface_hub's local cache (`snapshot_download(local_files_only=True)`, honouring HF_HOME / HF_HUB_CACHE), or
    downloaded (safetensors, config and tokenizer files only) when `download`. A path that is neither is returned
    as it is, for the reader's own error."""
    p = Path(value)
    text = str(value)
    if p.exists() or not _REPO_ID.match(text) or ".." in text:
        return p
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.utils import LocalEntryNotFoundError
    except ImportError:  # pragma: no cover - a dependency
        raise FormatError(f"{text}: no such directory (huggingface_hub is not installed to look it up as a hub "
                          "repo id)") from None
    try:
        return Path(snapshot_download(repo_id=text, local_files_only=not download, allow_patterns=HUB_PATTERNS))
    except LocalEntryNotFoundError:
        from huggingface_hub import constants

        raise FormatError(f"{text}: no such directory, and not in the local HF hub cache ({constants.HF_HUB_CACHE})"
                          + ("" if download else "; pass --download to fetch it from the hub")) from None
    except Exception as e:  # network, auth, unknown repo: huggingface_hub's own exception types
        msg = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise FormatError(f"{text}: hub download failed ({type(e).__name__}: {msg[:200]})") from None


def copy_assets(hf_dir: str | Path, dest: Path) -> None:
    """Carry the tokenizer / generation files under a checkpoint's `hf/`."""
    copy_side_files(hf_dir, dest, exclude=("config.json",))
