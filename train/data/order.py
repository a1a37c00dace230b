"""The GPT sample order: megatron-core's GPTDataset, BlendedDataset and BlendedMegatronDatasetBuilder (blends,
splits), and the check of every dataset's token ids against the model's vocabulary.

This reproduces megatron-core's algorithms so that a run that switches between Megatron-LM and shardkit sees the same
samples in the same order for the same seed, sequence length, blend, split and sample count (with sampler.py's
micro-batches). The order is rebuilt with numpy on every rank (no index cache files), deterministically, in well under
a second for corpora of millions of documents.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np

from .errors import DataError
from .indexed import IndexedDataset
from .stats import sidecar_path, token_stats

ORDER_VERSION = 1  # bump when anything that changes the sample order changes; part of every fingerprint
BLEND_SURPLUS = 0.005  # megatron-core's mid_level_dataset_surplus default
SPLIT_NAMES = ("train", "valid", "test")


# -- the vocabulary check ---------------------------------------------------------------------------------------------

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


