"""Data is checked against the model (issue 14): token ids at or beyond the checkpoint's true vocabulary stop
continue-pretrain before step 1 with one line naming the file, the largest id and the vocabulary, at TP 1 (which
died in the embedding with a traceback) and at TP 2 (where an id in the vocab padding trained silently). The id range
is cached beside the .idx (`<prefix>.shardkit.json`, valid for the .bin's size and mtime); preprocess-data writes its
files with the process umask and records the tokenizer that made them, so a mismatch is named."""
from __future__ import annotations

import hashlib
import json
import os
import stat

import numpy as np
import pytest

from tests.test_train import launch, setup  # noqa: F401  (the module fixture: tiny LLaMA, vocab 1000, + corpus)
from train.data.errors import DataError
from train.data.indexed import IndexedDataset, write_indexed
from train.data.order import check_vocab
from train.data.preprocess import bundled_corpus, preprocess_jsonl, save_corpus_tokenizer
from train.data.stats import sidecar_path, token_stats

RUN = ["--train-iters", "2", "--seq-length", "32", "--micro-batch-size", "1", "--global-batch-size", "4",
       "--attention-dropout", "0", "--hidden-dropout", "0"]


def _corpus_with(tmp_path, bad_id: int):
    rng = np.random.default_rng(0)
    docs = [np.tile(rng.integers(3, 60, size=5), 12)[:60] for _ in range(100)]
    docs[37] = docs[37].copy()
    docs[37][5] = bad_id
    return write_indexed(tmp_path / "oov", docs, np.uint16)


@pytest.mark.parametrize("nproc,extra,bad_id", [(1, [], 1000), (2, ["--tp", "2"], 1010)], ids=["tp1", "tp2"])
def test_out_of_vocab_ids_stop_before_step_one(setup, tmp_path, nproc, extra, bad_id):  # noqa: F811
    """1000 = the first id past the vocabulary; 1010 lies in TP 2's padding (padded vocab 1024)."""
    prefix = _corpus_with(tmp_path, bad_id)
    sidecar_path(f"{prefix}.bin").unlink()  # as a corpus written by Megatron's tools: no sidecar yet
    r = launch(nproc, "--load", str(setup / "ck"), "--data-path", str(prefix), *RUN, *extra, check=False)
    assert r.returncode != 0
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("shardkit: error:")]
    expected = (f"shardkit: error: {prefix}.bin: largest token id {bad_id} is beyond the model's vocabulary of 1000 "
                f"tokens (checkpoint {setup / 'ck' / 'iter_0000000'})")
    # every rank raises it (torchrun may stop a rank before it prints once another has failed: at least one line)
    assert 1 <= len(lines) <= nproc and all(ln.startswith(expected) for ln in lines), r.stderr[-3000:]
    if nproc == 1:
        assert r.stderr.strip() == lines[0]  # one line, no traceback
    assert "iteration 1" not in r.stdout
    assert json.loads(sidecar_path(f"{prefix}.bin").read_text())["max_token_id"] == bad_id  # cached for next time


def test_token_range_cache_follows_the_bin(tmp_path):
    prefix = write_indexed(tmp_path / "d", [np.array([5, 7, 9]), np.array([4, 900])], np.uint16)
    side = sidecar_path(f"{prefix}.bin")
    rec = json.loads(side.read_text())
    assert (rec["min_token_id"], rec["max_token_id"]) == (4, 900)
    ds = IndexedDataset(prefix)
    rec["max_token_id"] = 12345  # an edited cache is not believed (issue 34: its digest no longer matches) ...
    side.write_text(json.dumps(rec))
    assert token_stats(ds)["max_token_id"] == 900
    from train.data.stats import _sidecar_digest

    rec = json.loads(side.read_text())
    rec["max_token_id"] = 12345
    rec["digest"] = _sidecar_digest(rec)
    side.write_text(json.dumps(rec))
    assert token_stats(ds)["max_token_id"] == 12345  # ... a consistent cache for this very .bin is (a sample read
    # past the vocabulary is still refused: tests/test_hostile.py::test_edited_data_sidecar_is_not_trusted)
    st = os.stat(f"{prefix}.bin")
    os.utime(f"{prefix}.bin", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # ... one for another .bin is not
    assert token_stats(ds)["max_token_id"] == 900
    assert json.loads(side.read_text())["max_token_id"] == 900  # and is rewritten
    side.write_text("user notes\n")  # not ours: never replaced, the range still computed
    assert token_stats(ds)["max_token_id"] == 900 and side.read_text() == "user notes\n"
    with pytest.raises(DataError, match=r"d\.bin: largest token id 900 is beyond the model's vocabulary of 900 "):
        check_vocab([str(prefix)], 900, "checkpoint X")
    check_vocab([str(prefix)], 901, "checkpoint X")


@pytest.fixture(scope="module")
def big_tokenizer(tmp_path_factory):
    """A 600-entry BPE on the first 300 lines of the bundled corpus (its ids reach well past 400)."""
    d = tmp_path_factory.mktemp("tok600")
    lines = bundled_corpus().read_text().splitlines()[:300]
    (d / "corpus.jsonl").write_text("\n".join(lines) + "\n")
    save_corpus_tokenizer(d / "tok", 600, corpus=d / "corpus.jsonl")
    return d


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_preprocess_umask_and_tokenizer_record(big_tokenizer, tmp_path, umask):
    old = os.umask(umask)
    try:
        preprocess_jsonl(big_tokenizer / "corpus.jsonl", big_tokenizer / "tok", tmp_path / "c", quiet=True)
    finally:
        os.umask(old)
    for f in ("c.bin", "c.idx", "c.shardkit.json"):  # what open() gives under this umask (was 0600 always)
        assert stat.S_IMODE((tmp_path / f).stat().st_mode) == 0o666 & ~umask, f
    rec = json.loads((tmp_path / "c.shardkit.json").read_text())
    tok = rec["tokenizer"]
    assert tok["path"] == str((big_tokenizer / "tok").resolve()) and tok["vocab_size"] == 600
    want = hashlib.sha256((big_tokenizer / "tok" / "tokenizer.json").read_bytes()).hexdigest()
    assert tok["files_sha256"]["tokenizer.json"] == want
    assert rec["max_token_id"] == int(np.max(np.fromfile(tmp_path / "c.bin", dtype=np.uint16)))


def test_tokenizer_mismatch_is_named(big_tokenizer, tmp_path):
    preprocess_jsonl(big_tokenizer / "corpus.jsonl", big_tokenizer / "tok", tmp_path / "c", quiet=True)
    hi = json.loads((tmp_path / "c.shardkit.json").read_text())["max_token_id"]
    assert hi >= 400
    with pytest.raises(DataError, match=rf"c\.bin: largest token id {hi} is beyond the model's vocabulary of 400 "
                                        rf"tokens \(checkpoint M\); tokenizer mismatch: it was made by .*tok "
                                        r"\(vocab size 600\), not the model's tokenizer"):
        check_vocab([str(tmp_path / "c")], 400, "checkpoint M")
    check_vocab(["1", str(tmp_path / "c")], 600, "checkpoint M")  # a weighted blend is checked the same way


def test_a_foreign_sidecar_is_refused_before_writing(tmp_path):
    (tmp_path / "d.shardkit.json").write_text("my notes\n")
    with pytest.raises(DataError, match=r"d\.shardkit\.json: exists and is not a shardkit token-statistics file"):
        write_indexed(tmp_path / "d", [np.array([1, 2, 3])], np.uint16)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.shardkit.json"]
    assert (tmp_path / "d.shardkit.json").read_text() == "my notes\n"
