"""chunkio reads and writes exactly tensorstore's zarr3 `bytes` + `crc32c` chunk files (both directions, bitwise),
finds damage, and its buffer pool and read plan never hand out or drop memory that is still in use."""
from __future__ import annotations

import gc
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpoint import chunkio, store
from checkpoint.errors import CorruptionError, WriteError
from checkpoint.layout import Layout
from checkpoint.reader import Checkpoint, ReadPlan
from convert.hf_to_mcore import convert_hf_to_mcore
from shardkit.demo import build_tiny_llama

CASES = [  # shape, chunk (edge chunks that stick out of the array are stored whole, as zarr3 does), dtype
    ((6, 10), (4, 4), "bfloat16"),
    ((3, 8, 5), (1, 3, 5), "float32"),
    ((17,), (8,), "float16"),
]


def _values(shape, dtype: str, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.standard_normal(shape).astype(np.float32).astype(store.numpy_dtype(dtype))


def _grid(shape, chunk):
    return np.ndindex(*[-(-s // c) for s, c in zip(shape, chunk)])


def _chunk_values(full: np.ndarray, grid, chunk) -> np.ndarray:
    """The chunk at `grid` as zarr3 stores it: full chunk shape, the part outside the array the fill value (0)."""
    out = np.zeros(chunk, full.dtype)
    src = tuple(slice(g * c, min((g + 1) * c, s)) for g, c, s in zip(grid, chunk, full.shape))
    out[tuple(slice(0, x.stop - x.start) for x in src)] = full[src]
    return out


@pytest.mark.parametrize("shape,chunk,dtype", CASES)
def test_tensorstore_reads_what_chunkio_writes(tmp_path, shape, chunk, dtype):
    full = _values(shape, dtype)
    arr = store.create(tmp_path / "a", shape, dtype, chunk)
    assert chunkio.supports(store.metadata(arr))
    for g in _grid(shape, chunk):
        chunkio.write_durable(chunkio.chunk_path(tmp_path / "a", g), _chunk_values(full, g, chunk), "a")
    back = store.open_existing(tmp_path / "a").read().result()
    assert back.dtype == full.dtype and back.tobytes() == full.tobytes()


@pytest.mark.parametrize("shape,chunk,dtype", CASES)
def test_chunkio_reads_what_tensorstore_writes(tmp_path, shape, chunk, dtype):
    full = _values(shape, dtype, seed=1)
    arr = store.create(tmp_path / "a", shape, dtype, chunk)
    store.write(arr, tuple(slice(0, s) for s in shape), full).result()
    for g in _grid(shape, chunk):
        got = chunkio.map_chunk(chunkio.chunk_path(tmp_path / "a", g), chunk, store.numpy_dtype(dtype))
        assert not got.flags.writeable
        assert got.tobytes() == _chunk_values(full, g, chunk).tobytes(), g


def test_damage_is_named(tmp_path):
    arr = store.create(tmp_path / "a", (4, 4), "float32", (2, 4))
    store.write(arr, (slice(0, 4), slice(0, 4)), _values((4, 4), "float32")).result()
    path = chunkio.chunk_path(tmp_path / "a", (1, 0))
    good = path.read_bytes()
    path.write_bytes(good[:5] + bytes([good[5] ^ 1]) + good[6:])
    with pytest.raises(CorruptionError, match="Digest mismatch"):
        chunkio.map_chunk(path, (2, 4), np.float32)
    path.write_bytes(good[:-1])
    with pytest.raises(CorruptionError, match=f"{path} holds 35 bytes, expected 36"):
        chunkio.map_chunk(path, (2, 4), np.float32)
    path.unlink()
    with pytest.raises(CorruptionError, match="missing"):
        chunkio.map_chunk(path, (2, 4), np.float32)
    # a torn write from a crash is simply rewritten by the next run (no temporary name to clean up)
    path.write_bytes(good[:7])
    chunkio.write_durable(path, np.frombuffer(good[:-4], np.float32).reshape(2, 4).copy(), "a")
    assert path.read_bytes() == good and sorted(p.name for p in path.parent.iterdir()) == ["0"]


def test_other_codecs_go_through_tensorstore(tmp_path):
    spec = store.array_spec(tmp_path / "a", (4,), "float32", (2,))
    spec["metadata"]["codecs"] = [{"name": "bytes", "configuration": {"endian": "little"}}]
    import tensorstore as ts

    arr = ts.open(spec, create=True).result()
    assert not chunkio.supports(store.metadata(arr))
    assert chunkio.supports(store.metadata(store.create(tmp_path / "b", (4,), "float32", (2,))))


def test_write_error_names_the_tensor_and_file(tmp_path):
    blocker = tmp_path / "c"
    blocker.write_text("a file where the chunk directory should be")
    with pytest.raises(WriteError, match=r"tensor t: writing .*c/0 failed"):
        chunkio.write_durable(chunkio.chunk_path(tmp_path, (0,)), np.zeros(4, np.float32), "t")


def test_pool_reuses_only_buffers_nothing_refers_to():
    pool = chunkio.BufferPool()
    a = pool.empty((1024, 1024), np.float32)
    view = a[3:5]
    first = id(a.base)
    del a
    b = pool.empty((1024, 1024), np.float32)
    assert id(b.base) != first  # a view of the first buffer is still alive
    del view
    gc.collect()
    c = pool.empty((1024, 512), np.float32)  # half the size: fits in the free buffer
    assert id(c.base) == first
    assert pool.empty((4,), np.float32).base is None  # small arrays are plain numpy allocations


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("chunkio")
    hf = build_tiny_llama(root / "hf", num_hidden_layers=2, hidden_size=64, intermediate_size=96, vocab_size=300)
    convert_hf_to_mcore(hf, root / "ck", Layout(tp=2), quiet=True)  # chunks = tp2 shards: boxes cross them
    return root / "ck"


BOX_TENSORS = ["decoder.layers.mlp.linear_fc2.weight", "decoder.layers.self_attention.linear_qkv.weight",
               "embedding.word_embeddings.weight", "decoder.final_layernorm.weight"]


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_boxes_equal_tensorstore(tiny, data):
    """Any box (inside one chunk or across several) reads the same bytes as tensorstore's own read of it."""
    ck = Checkpoint(tiny, cache_bytes=1 << 20)
    name = data.draw(st.sampled_from(BOX_TENSORS))
    shape = ck.entry(name).shape
    index = []
    for n in shape:
        lo = data.draw(st.integers(0, n - 1))
        index.append(slice(lo, data.draw(st.integers(lo + 1, n))))
    index = tuple(index)
    want = ck.array(name)[index].read().result()
    got = ck.read_numpy(name, index)
    assert got.shape == want.shape and got.tobytes() == want.tobytes()
    t = ck.read(name, index)  # a torch tensor of its own (writable, not a view of the mapped chunk)
    t.zero_()
    assert ck.read_numpy(name, index).tobytes() == want.tobytes()


def _wait_for(cond, seconds: float = 10.0) -> bool:
    end = time.monotonic() + seconds
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


def test_read_plan_reads_ahead_within_budget_and_drops_chunks_after_their_last_box(tiny):
    ck = Checkpoint(tiny, cache_bytes=64 << 20)
    name = "decoder.layers.mlp.linear_fc1.weight"  # [2, 192, 64], chunks of one layer's tp shard [1, 48, 64]
    first, second = (name, (0, 0, 0)), (name, (1, 0, 0))
    boxes = [(name, (slice(0, 1), slice(0, 24))), (name, (slice(0, 1), slice(24, 48))),
             (name, (slice(1, 2), slice(0, 48)))]
    plan = ReadPlan(ck, boxes, ahead_bytes=ck.chunk_nbytes(name))  # one chunk ahead at most
    try:
        assert _wait_for(lambda: first in ck._cache)
        time.sleep(0.2)
        assert second not in ck._cache  # over the budget until the first chunk is done with
        ck.read_numpy(*boxes[0])
        plan.done(*boxes[0])
        assert first in ck._cache and second not in ck._cache  # the second box still needs the first chunk
        ck.read_numpy(*boxes[1])
        plan.done(*boxes[1])
        assert first not in ck._cache
        assert _wait_for(lambda: second in ck._cache)
        ck.read_numpy(*boxes[2])
        plan.done(*boxes[2])
        assert list(ck._cache) == []
    finally:
        plan.close()
    quiet = ReadPlan(ck, boxes)  # no read-ahead: chunks are still dropped after their last box
    ck.read_numpy(*boxes[2])
    quiet.done(*boxes[2])
    assert list(ck._cache) == []


def test_a_chunk_is_checksummed_and_written_a_block_at_a_time(tmp_path, monkeypatch):
    """One large write from a memory-mapped source costs the kernel several times the same bytes in blocks (issue 42:
    the conversion's system time): every write is at most WRITE_BLOCK, and the file is the bytes + their crc32c."""
    monkeypatch.setattr(chunkio, "WRITE_BLOCK", 1 << 16)
    sizes = []
    real = chunkio.os.write
    monkeypatch.setattr(chunkio.os, "write", lambda fd, data: sizes.append(len(data)) or real(fd, data))
    data = _values((300, 257), "bfloat16", seed=3)  # 154,200 bytes: two whole blocks and a part
    path = tmp_path / "a" / "c" / "0"
    chunkio.write_durable(path, data, "a")
    assert max(sizes) <= 1 << 16 and len(sizes) == 4  # three blocks and the trailer
    raw = path.read_bytes()
    assert raw[:-4] == data.tobytes() and int.from_bytes(raw[-4:], "little") == chunkio.crc(data.tobytes())
    got = chunkio.map_chunk(path, data.shape, data.dtype)
    assert got.tobytes() == data.tobytes()
