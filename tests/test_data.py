"""train/data/: Megatron .bin/.idx files, preprocess-data, the GPT sample order (against megatron-core itself, in a
subprocess), blends, splits, resuming micro-batches, and the errors bad data gives."""
from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from shardkit.cli import main as cli
from shardkit.demo import save_tiny_tokenizer
from train.data.errors import DataError
from train.data.indexed import IndexedDataset, token_dtype, write_indexed
from train.data.order import DataConfig, GPTDataset, build_blending_indices, build_datasets, split_matrix
from train.data.preprocess import bundled_corpus, preprocess_jsonl, save_corpus_tokenizer
from train.data.sampler import micro_batches

ORACLE = Path(__file__).with_name("megatron_oracle.py")


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tok")
    save_tiny_tokenizer(d, 1000)
    return d


def random_docs(seed: int, n: int, vocab: int, max_len: int, min_len: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=rng.integers(min_len, max_len + 1)) for _ in range(n)]


# -- files -------------------------------------------------------------------------------------------------------------

def hand_built_idx(lengths: list[int], doc_starts: list[int], code: int, itemsize: int) -> bytes:
    """An .idx laid out byte by byte as Megatron's _IndexWriter writes it (independent of train/data/indexed.py)."""
    out = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code)
    out += struct.pack("<Q", len(lengths)) + struct.pack("<Q", len(doc_starts))
    out += b"".join(struct.pack("<i", n) for n in lengths)
    ptr = 0
    for n in lengths:
        out += struct.pack("<q", ptr)
        ptr += n * itemsize
    out += b"".join(struct.pack("<q", d) for d in doc_starts)
    return out


def test_hand_built_megatron_file_reads_and_our_writer_writes_the_same_bytes(tmp_path):
    # three documents: the first split into two sequences (Megatron's --split-sentences), then an empty document
    seqs = [[5, 6, 7], [8], [9, 10, 11, 12]]
    lengths, doc_starts = [3, 1, 4], [0, 2, 2, 3]
    (tmp_path / "ref.idx").write_bytes(hand_built_idx(lengths, doc_starts, code=8, itemsize=2))
    (tmp_path / "ref.bin").write_bytes(b"".join(struct.pack("<H", t) for s in seqs for t in s))
    ds = IndexedDataset(tmp_path / "ref")
    assert ds.dtype == np.uint16 and len(ds) == 3 and ds.num_documents == 3 and ds.num_tokens == 8
    assert [ds[i].tolist() for i in range(3)] == seqs
    assert ds.document_indices.tolist() == doc_starts
    assert ds.get(2, offset=1, length=2).tolist() == [10, 11]

    # one sequence per document (preprocess-data without sentence splitting), empty document included, int32
    docs = [np.array([1, 2, 3]), np.array([], dtype=np.int64), np.array([70000, 4])]
    write_indexed(tmp_path / "ours", docs, np.int32)
    ref = hand_built_idx([3, 2], [0, 1, 1, 2], code=4, itemsize=4)
    assert (tmp_path / "ours.idx").read_bytes() == ref
    assert (tmp_path / "ours.bin").read_bytes() == np.array([1, 2, 3, 70000, 4], dtype="<i4").tobytes()
    assert not list(tmp_path.glob(".*tmp"))  # temporary files renamed away


def test_token_dtype_follows_megatron():
    assert token_dtype(1000) == np.uint16 and token_dtype(65499) == np.uint16
    assert token_dtype(65500) == np.int32 and token_dtype(128256) == np.int32


def test_preprocess_round_trip_token_for_token(tmp_path, tok_dir):
    from transformers import AutoTokenizer

    docs = [{"text": "the model shard tensor pipeline"}, {"text": ""}, {"text": ["a layer", "token train the"]},
            {"text": "checkpoint w0 w1 w997 unknownword"}, {"text": "a " * 300}]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(d) + "\n" for d in docs) + "\n")
    assert cli(["preprocess-data", "--input", str(src), "--tokenizer", str(tok_dir), "--output-prefix",
                str(tmp_path / "out"), "--append-eod", "--quiet"]) == 0
    ds = IndexedDataset(tmp_path / "out")
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    expect = []
    for d in docs:
        parts = d["text"] if isinstance(d["text"], list) else [d["text"]]
        ids = [t for p in parts for t in tok(p, add_special_tokens=False)["input_ids"]]
        expect.append(ids + [tok.eos_token_id] if ids else [])
    assert ds.dtype == np.uint16
    assert ds.document_indices.tolist() == [0, 1, 1, 2, 3, 4]  # the empty document has no sequence
    assert [ds[i].tolist() for i in range(len(ds))] == [e for e in expect if e]
    assert ds[0].tolist() == [3, 5, 7, 8, 9, 2]  # the, model, shard, tensor, pipeline, </s> (save_tiny_tokenizer)

    # several keys -> Megatron's per-key files, the same bytes for the same key (--workers N > 1 runs the same
    # _encode_batch in spawned processes; not run here: each one imports transformers, ~8 s on this CI)
    src2 = tmp_path / "two.jsonl"
    src2.write_text("".join(json.dumps({"text": d["text"], "title": "the shard"}) + "\n" for d in docs))
    r = preprocess_jsonl(src2, tok_dir, tmp_path / "k", json_keys=("text", "title"), append_eod=True, quiet=True,
                         batch_docs=2)
    assert r["documents"] == len(docs) and r["tokens"]["title"] == 3 * len(docs)
    assert (tmp_path / "k_text_document.bin").read_bytes() == (tmp_path / "out.bin").read_bytes()
    assert (tmp_path / "k_text_document.idx").read_bytes() == (tmp_path / "out.idx").read_bytes()
    assert IndexedDataset(tmp_path / "k_title_document")[0].tolist() == [3, 7, 2]


def test_preprocess_large_vocab_writes_int32(tmp_path):
    tok = tmp_path / "tok"
    save_tiny_tokenizer(tok, 65600)
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"text": "w65580 the w0"}) + "\n")
    preprocess_jsonl(src, tok, tmp_path / "big", quiet=True)
    ds = IndexedDataset(tmp_path / "big")
    assert ds.dtype == np.int32 and ds[0].tolist() == [65580 + 13, 3, 13]  # w<i> is id 13 + i


def test_bundled_corpus_preprocesses_and_trains_samples(tmp_path, tok_dir):
    r = preprocess_jsonl(bundled_corpus(), tok_dir, tmp_path / "kjv", append_eod=True, quiet=True)
    assert r["documents"] == 101 and r["tokens"]["text"] > 50_000
    train, valid = build_datasets(DataConfig((str(tmp_path / "kjv"),), seq_length=128), 64, 8)
    assert len(train) >= 64 and len(valid) >= 8 and train[0].shape == (129,) and train[0].dtype == np.int64


def test_corpus_tokenizer_covers_the_bundled_corpus(tmp_path):
    """A 1000-entry BPE (the demo model's vocab) trained on the corpus: no <unk>, exact decode, eos = 2."""
    from transformers import AutoTokenizer

    save_corpus_tokenizer(tmp_path / "bpe", 1000)
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "bpe"))
    assert len(tok) == 1000 and (tok.unk_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    preprocess_jsonl(bundled_corpus(), tmp_path / "bpe", tmp_path / "kjv", append_eod=True, quiet=True)
    ds = IndexedDataset(tmp_path / "kjv")
    first = json.loads(bundled_corpus().read_text().splitlines()[0])["text"]
    assert tok.decode(ds[0][:-1]) == first and ds[0][-1] == 2
    assert all(not np.any(ds[i] == 0) for i in range(len(ds)))


# -- the sample order --------------------------------------------------------------------------------------------------

def test_sample_order_equals_megatron_core(tmp_path):
    """megatron-core's BlendedMegatronDatasetBuilder + GPTDataset (its compiled helpers) in a subprocess: every sample
    of the train and valid splits, and the document/sample/shuffle indices, equal ours."""
    write_indexed(tmp_path / "a", random_docs(0, 600, 1000, 60, 1), np.uint16)
    write_indexed(tmp_path / "b", random_docs(1, 150, 70000, 30, 0), np.int32)  # empty sequences included
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    jobs = [
        # two epochs; the final one large enough to join the global shuffle
        dict(blend=[a], split="969,30,1", seed=1234, seq_length=16, sizes=[2000, 30, 5]),
        # two epochs with a small final one: shuffled separately (separate_final_epoch)
        dict(blend=[a], split="969,30,1", seed=5, seq_length=16, sizes=[1200, 30, 5]),
        dict(blend=["0.3", a, "0.7", b], split="90,10,0", seed=7, seq_length=8, sizes=[500, 40, 0]),
        dict(blend=[a, b], split="90,10,0", seed=7, seq_length=8, sizes=[500, 40, 0]),
    ]
    for i, j in enumerate(jobs):
        j["cache"] = str(tmp_path / f"cache{i}")  # megatron-core caches indices; never share between jobs
        j["out"] = str(tmp_path / f"out{i}.json")
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    r = subprocess.run([sys.executable, str(ORACLE), "data", str(tmp_path / "jobs.json")], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    ref = [json.loads(Path(j["out"]).read_text()) for j in jobs]
    separate = False
    for job, res in zip(jobs, ref):
        train, valid = build_datasets(DataConfig(tuple(job["blend"]), job["seq_length"], job["seed"], job["split"]),
                                      job["sizes"][0], job["sizes"][1])
        for ds, want in zip((train, valid), res[:2]):
            assert [ds[i].tolist() for i in range(len(ds))] == want["samples"], job
            if "shuffle_index" in want:
                assert ds.document_index.tolist() == want["document_index"]
                assert ds.sample_index.tolist() == want["sample_index"]
                assert ds.shuffle_index.tolist() == want["shuffle_index"]
                separate |= ds.num_epochs > 1 and len(ds.document_index) == 2 * len(ds.indices) and \
                    sorted(ds.document_index[len(ds.indices):].tolist()) == ds.indices.tolist()
            else:
                assert ds.dataset_index.tolist() == want["dataset_index"]
    assert separate


def test_sample_boundaries_by_hand(tmp_path):
    """Documents [0..4], [10..12], [20..25] in one epoch, seq 4: sample k is tokens [4k, 4k+5) of the shuffled
    documents laid end to end (consecutive samples share a token, samples cross documents)."""
    write_indexed(tmp_path / "d", [np.arange(0, 5), np.arange(10, 13), np.arange(20, 26)], np.uint16)
    ds = GPTDataset(IndexedDataset(tmp_path / "d"), np.arange(3), None, 4, seed=0)
    order = [int(d) for d in ds.document_index]
    stream = np.concatenate([IndexedDataset(tmp_path / "d")[d] for d in order])
    assert len(ds) == (14 - 1) // 4 == 3
    by_position = sorted((ds[i].tolist() for i in range(3)), key=lambda s: stream.tolist().index(s[0]))
    assert by_position == [stream[k * 4:k * 4 + 5].tolist() for k in range(3)]
    lengths = IndexedDataset(tmp_path / "d").sequence_lengths[ds.document_index[ds.sample_index[:, 0]]]
    assert np.all(ds.sample_index[:, 1] < lengths)  # a start is always inside its document


def test_blend_follows_weights_and_is_deterministic(tmp_path):
    write_indexed(tmp_path / "x", random_docs(2, 300, 500, 40, 1), np.uint16)
    write_indexed(tmp_path / "y", random_docs(3, 300, 500, 40, 1), np.uint16)
    x, y = str(tmp_path / "x"), str(tmp_path / "y")
    cfg = DataConfig(("0.25", x, "0.75", y), seq_length=8, seed=3, split="100,0,0")
    train, valid = build_datasets(cfg, 400, 10)
    assert valid is None  # the split gives valid nothing
    assert len(train) == 400 and np.bincount(train.dataset_index).tolist() == [100, 300]
    # every prefix of the blend stays within one sample of its weight (the greedy rule)
    counts = np.cumsum(np.eye(2)[train.dataset_index], axis=0)
    n = np.arange(1, 401)[:, None]
    assert np.all(np.abs(counts - n * np.array([0.25, 0.75])) <= 1.0)
    again, _ = build_datasets(cfg, 400, 10)
    assert all(np.array_equal(train[i], again[i]) for i in range(0, 400, 7)) and again.fingerprint == train.fingerprint
    # the same blend drawn from the member datasets
    i = int(np.flatnonzero(train.dataset_index == 1)[5])
    assert np.array_equal(train[i], train.datasets[1][5])
    # weights, seed, seq length, split, sample count and data content all enter the fingerprint
    fps = {train.fingerprint}
    for other in (DataConfig(("0.5", x, "0.5", y), 8, 3, "100,0,0"), DataConfig(cfg.paths, 8, 4, "100,0,0"),
                  DataConfig(cfg.paths, 9, 3, "100,0,0"), DataConfig(cfg.paths, 8, 3, "99,1,0")):
        fps.add(build_datasets(other, 400, 0)[0].fingerprint)
    fps.add(build_datasets(cfg, 401, 0)[0].fingerprint)
    write_indexed(tmp_path / "y", random_docs(4, 300, 500, 40, 1), np.uint16)
    fps.add(build_datasets(cfg, 400, 0)[0].fingerprint)
    assert len(fps) == 7


def test_blending_indices_match_the_greedy_rule():
    di, si = build_blending_indices([0.5, 0.3, 0.2], 10)
    # by hand: at step i pick the largest w*max(i,1) - count, ties to the lowest id
    assert di.tolist() == [0, 1, 2, 0, 1, 0, 2, 0, 1, 0]
    assert si.tolist() == [0, 0, 0, 1, 1, 2, 1, 3, 2, 4]


def test_split_matrix():
    m = split_matrix("969,30,1")
    assert np.allclose(m, [(0, .969), (.969, .999), (.999, 1.0)])
    assert split_matrix("100,0,0")[1:] == [None, None]
    assert split_matrix("969 30 1") == split_matrix("969,30,1")  # Megatron also takes spaces
    m = split_matrix("9,1")
    assert np.allclose(m[:2], [(0, .9), (.9, 1.0)]) and m[2] is None


# -- resuming micro-batches --------------------------------------------------------------------------------------------

def test_micro_batches_resume_exactly_at_consumed_samples(tmp_path):
    write_indexed(tmp_path / "r", random_docs(5, 200, 1000, 50, 1), np.uint16)
    ds, _ = build_datasets(DataConfig((str(tmp_path / "r"),), seq_length=8, seed=11, split="1"), 96, 0)
    mbs, dp, steps = 2, 2, 8

    def run(consumed: int, n_steps: int, dp: int) -> list[np.ndarray]:
        """The global batch stream of n_steps steps: per step, DP ranks' micro-batches in rank order."""
        its = [micro_batches(ds, consumed, mbs, r, dp) for r in range(dp)]
        return [np.concatenate([next(it).numpy() for it in its]) for _ in range(n_steps)]

    straight = run(0, steps, dp)
    assert all(b.shape == (mbs * dp, 9) and b.dtype == np.int64 for b in straight)
    assert np.array_equal(np.concatenate(straight), np.stack([ds[i] for i in range(steps * mbs * dp)]))
    resumed = run(3 * mbs * dp, steps - 3, dp)
    assert all(np.array_equal(a, b) for a, b in zip(straight[3:], resumed))
    # a resume at another DP size continues the same global sample stream (2 micro-batches of dp=1 = 1 of dp=2)
    single = run(3 * mbs * dp, 2 * (steps - 3), 1)
    assert np.array_equal(np.concatenate(single), np.concatenate(resumed))
    # the partial last step is dropped
    assert sum(1 for _ in micro_batches(ds, 0, 5, 0, 2)) == len(ds) // 10


# -- bad input ---------------------------------------------------------------------------------------------------------

@pytest.fixture()
def good(tmp_path) -> Path:
    write_indexed(tmp_path / "g", random_docs(6, 20, 1000, 30, 5), np.uint16)
    return tmp_path / "g"


def _corrupt_idx(p: Path, at: int, data: bytes) -> None:
    b = bytearray((p.parent / f"{p.name}.idx").read_bytes())
    b[at:at + len(data)] = data
    (p.parent / f"{p.name}.idx").write_bytes(bytes(b))


@pytest.mark.parametrize("damage, message", [
    (lambda p: (p.parent / f"{p.name}.bin").unlink(), "g.bin does not exist"),
    (lambda p: _corrupt_idx(p, 0, b"XXXXXXXXX"), "not a Megatron indexed dataset"),
    (lambda p: _corrupt_idx(p, 9, struct.pack("<Q", 2)), "unsupported .idx version 2"),
    (lambda p: _corrupt_idx(p, 17, bytes([9])), "unknown token dtype code 9"),
    (lambda p: (p.parent / f"{p.name}.idx").write_bytes((p.parent / f"{p.name}.idx").read_bytes()[:-8]),
     "truncated or corrupt"),
    (lambda p: (p.parent / f"{p.name}.idx").write_bytes(b"MMIDIDX"), "truncated header"),
    (lambda p: (p.parent / f"{p.name}.bin").write_bytes((p.parent / f"{p.name}.bin").read_bytes()[:-4]),
     "truncated or mismatched .bin/.idx"),
    (lambda p: (p.parent / f"{p.name}.bin").write_bytes((p.parent / f"{p.name}.bin").read_bytes()[:-1]),
     "not a whole number of uint16 tokens"),
])
def test_damaged_files_name_the_file(good, damage, message):
    damage(good)
    with pytest.raises(DataError, match=message) as e:
        IndexedDataset(good)
    assert str(good) in str(e.value) and "\n" not in str(e.value)


def test_bad_data_configs(tmp_path, good):
    g = str(good)
    cases = [
        (DataConfig((str(tmp_path / "missing"),), 8), "data prefix .*missing: .*missing.idx does not exist"),
        (DataConfig((g,), 4096), "fewer than one sample of --seq-length 4096"),
        (DataConfig((g,), 8, split="1,x"), "--split '1,x'"),
        (DataConfig((g,), 8, split="0,0,0"), "add up to zero"),
        (DataConfig((g,), 8, split="0,1,0"), "train share is zero"),
        (DataConfig(("0.5", g, "-1", g), 8), "weight -1.0 of .* must be a positive number"),
        (DataConfig(("0.5", g, g), 8), "give either prefixes or weight/prefix pairs"),
        (DataConfig((g,), 8, split="99,1,0"), "leaves the valid split no documents"),
        (DataConfig((g,), 0), "--seq-length 0"),
        (DataConfig((g, g), 8, split="1"), "without weights uses each prefix once: its train split holds"),
    ]
    for cfg, message in cases:
        with pytest.raises(DataError, match=message):
            build_datasets(cfg, 10 if len(cfg.paths) == 1 else 10_000, 5)
    write_indexed(tmp_path / "empty", [np.array([], dtype=np.int64)] * 3, np.uint16)
    with pytest.raises(DataError, match="empty.*empty dataset"):
        build_datasets(DataConfig((str(tmp_path / "empty"),), 8), 10, 0)
    ds, _ = build_datasets(DataConfig((g,), 8), 10, 0)
    with pytest.raises(DataError, match=f"consumed samples {len(ds)}: the dataset holds {len(ds)}"):
        micro_batches(ds, len(ds), 1, 0, 1)
    with pytest.raises(DataError, match="DP rank 2 of 2"):
        micro_batches(ds, 0, 1, 2, 2)
    with pytest.raises(DataError, match="does not fit uint16"):
        write_indexed(tmp_path / "w", [np.array([70000])], np.uint16)
    assert not (tmp_path / "w.bin").exists() and not list(tmp_path.glob(".w.*"))


def test_preprocess_bad_input_names_the_line(tmp_path, tok_dir, capsys):
    src = tmp_path / "bad.jsonl"
    out = str(tmp_path / "o")
    for body, message in [('{"text": "a"}\n{"text": 3}\n', "bad.jsonl line 2: 'text' must be a string"),
                          ('{"text": "a"}\n{oops\n', "bad.jsonl line 2: not valid JSON"),
                          ('{"body": "a"}\n', "bad.jsonl line 1: no key 'text'"),
                          ('[1, 2]\n', "bad.jsonl line 1: expected a JSON object")]:
        src.write_text(body)
        assert cli(["preprocess-data", "--input", str(src), "--tokenizer", str(tok_dir), "--output-prefix", out,
                    "--quiet"]) == 1
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1
        assert not list(tmp_path.glob("o.*")) and not list(tmp_path.glob(".o.*"))  # nothing half-written left
    with pytest.raises(DataError, match="--tokenizer .*nodir: not a directory"):
        preprocess_jsonl(src, tmp_path / "nodir", out)
    (tmp_path / "notok").mkdir()
    with pytest.raises(DataError, match="--tokenizer .*notok: cannot load a tokenizer"):
        preprocess_jsonl(src, tmp_path / "notok", out)
    with pytest.raises(DataError, match="--input .*nofile.jsonl: no such file"):
        preprocess_jsonl(tmp_path / "nofile.jsonl", tok_dir, out)
