"""Rows written to the disk from where the head wrote them (issue 24): a transformers source on
the CPU puts each block of its 16-bit head rows into a page-aligned pooled buffer
(rowpool.RowPool), and the O_DIRECT writer hands such a block to the device without its
staging copy where the memory, the length and the file offset allow (outputs.DirectFile).
The bytes must be the same as through the staging buffer, for every mix of aligned and
unaligned writes and for a refusal mid-file; the pooled rows the same bits as the head's own
output; a buffer is used again only once nothing views it."""

from __future__ import annotations

import errno
import gc
import mmap
import os
import weakref

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from _models import make_random_llama  # noqa: E402
from test_store_direct import _odirect_works  # noqa: E402

import logitdiff.store.files as outputs  # noqa: E402
from logitdiff.store.rowpool import RowPool  # noqa: E402
from logitdiff.sources import open_source  # noqa: E402


@pytest.fixture
def disk(tmp_path):
    if not _odirect_works(tmp_path) or not outputs.direct_io_pays(tmp_path):
        pytest.skip("no O_DIRECT under the test's temporary directory")
    return tmp_path


@pytest.fixture
def writes(monkeypatch):
    """(address, length, O_DIRECT?) of every os.write, in order."""
    import fcntl

    seen: list[tuple[int, int, bool]] = []
    real = os.write

    def write(fd, data):
        a = np.frombuffer(memoryview(data).cast("B"), np.uint8)
        seen.append((a.ctypes.data, a.size, bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)))
        return real(fd, data)

    monkeypatch.setattr(os, "write", write)
    return seen


# --------------------------------------------------------------------------------------
# the pool
# --------------------------------------------------------------------------------------


def test_a_pooled_buffer_is_used_again_only_once_nothing_views_it():
    pool = RowPool(3, 1000, np.uint16, keep=2)
    a = pool.take(3)
    at = a.ctypes.data
    assert at % outputs.DIRECT_ALIGN == 0 and a.shape == (3, 1000) and a.dtype == np.uint16
    view = a[1:]  # a view keeps the buffer
    del a
    gc.collect()
    b = pool.take(2)
    assert b.ctypes.data != at and pool.idle() == 0
    del view
    gc.collect()
    assert pool.idle() == 1
    c = pool.take(1)
    assert c.ctypes.data == at and c.shape == (1, 1000)
    t = torch.from_numpy(c.view(np.int16))  # a tensor over it keeps it too
    del c
    gc.collect()
    assert pool.idle() == 0
    del t, b
    gc.collect()
    assert pool.idle() == 2
    more = [pool.take(3) for _ in range(4)]
    del more
    gc.collect()
    assert pool.idle() == 2  # at most `keep` idle buffers are held
    with pytest.raises(ValueError, match="4 rows from a pool of 3-row buffers"):
        pool.take(4)


# --------------------------------------------------------------------------------------
# the writer: from the caller's memory where alignment allows, the same bytes always
# --------------------------------------------------------------------------------------


def test_aligned_blocks_go_to_the_device_from_the_callers_memory(disk, writes):
    """A header page, then page-aligned blocks whose size is a multiple of 512 bytes (bf16 rows
    of 1,280 tokens): at least the first block's bytes are written from the block itself (with
    the file system's reported 512-byte alignment, every block), and the file is the bytes
    given. Before: every byte went through the staging buffer."""
    pool = RowPool(120, 1280, np.uint16)
    rng = np.random.default_rng(1)
    blocks = []
    for n in (120, 120, 110, 120):  # 110 rows: 275 KiB, a multiple of 512 bytes but not of a page
        b = pool.take(n)
        b[...] = rng.integers(0, 65535, b.shape, dtype=np.uint16)
        blocks.append(b)
    with outputs.atomic_file_direct(disk / "x.bin", outputs.direct_stage()) as f:
        f.write(bytes(outputs.DIRECT_ALIGN))
        for b in blocks:
            f.write(b.data)
        f.head = b"H" * outputs.DIRECT_ALIGN
    from_caller = [b for b in blocks if any(a == b.ctypes.data and d for a, _, d in writes)]
    assert from_caller and from_caller[0] is blocks[0]
    if outputs.dio_alignment(os.open(disk / "x.bin", os.O_RDONLY)) == (512, 512):  # ext4 here
        assert len(from_caller) == len(blocks)
    want = b"H" * outputs.DIRECT_ALIGN + b"".join(b.tobytes() for b in blocks)
    assert (disk / "x.bin").read_bytes() == want


@pytest.mark.parametrize("align", [(512, 512), (4096, 4096), (8, 512)])
def test_every_mix_of_aligned_and_unaligned_writes_reads_back(disk, monkeypatch, align):
    """Writes of random sizes (tiny, under and over a page, larger than the staging buffer)
    from memory at offsets 0, 8, 64, 512, 1024 and 4096 bytes into a page, under each
    alignment a file system may report; the staging buffer small so that it fills and
    wraps. The file holds the bytes in order."""
    monkeypatch.setattr(outputs, "dio_alignment", lambda fd: align)
    monkeypatch.setattr(outputs, "DIRECT_FROM_CALLER_MIN", 1024)
    rng = np.random.default_rng(sum(align))
    raw = mmap.mmap(-1, 8 << 20)
    base = np.frombuffer(raw, np.uint8)
    base[:] = rng.integers(0, 255, base.size, dtype=np.uint8)
    want = []
    with outputs.atomic_file_direct(disk / "m.bin", outputs.direct_stage(64 << 10)) as f:
        f.write(bytes(outputs.DIRECT_ALIGN))
        want.append(bytes(outputs.DIRECT_ALIGN))
        for _ in range(60):
            at = int(rng.choice([0, 8, 64, 512, 1024, 4096])) + 4096 * int(rng.integers(0, 100))
            n = int(rng.choice([1, 100, 1000, 1536, 4096, 5000, 40960, 70000, 200000]))
            piece = base[at : at + n]
            f.write(piece.data)
            want.append(piece.tobytes())
        f.head = b"\x01" * outputs.DIRECT_ALIGN
    want[0] = b"\x01" * outputs.DIRECT_ALIGN
    assert (disk / "m.bin").read_bytes() == b"".join(want)


def test_a_write_from_the_callers_memory_refused_goes_through_the_page_cache(disk, monkeypatch):
    """EINVAL on the first write straight from a caller's block (a file system that reports an
    alignment it then refuses; simulated): O_DIRECT is cleared and the same bytes follow
    through the page cache, in order."""
    pool = RowPool(128, 1280, np.uint16)
    blocks = [pool.take(128) for _ in range(3)]  # 320 KiB each: over DIRECT_FROM_CALLER_MIN
    for k, b in enumerate(blocks):
        b[...] = k + 1
    real = os.write
    refused = []

    def write(fd, data):
        a = np.frombuffer(memoryview(data).cast("B"), np.uint8)
        if not refused and a.ctypes.data == blocks[1].ctypes.data:
            refused.append(fd)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, data)

    monkeypatch.setattr(os, "write", write)
    with outputs.atomic_file_direct(disk / "r.bin", outputs.direct_stage()) as f:
        f.write(bytes(outputs.DIRECT_ALIGN))
        for b in blocks:
            f.write(b.data)
        f.head = b"h" * outputs.DIRECT_ALIGN
        assert refused and not f.direct
    assert (disk / "r.bin").read_bytes() == b"h" * outputs.DIRECT_ALIGN + b"".join(b.tobytes() for b in blocks)


# --------------------------------------------------------------------------------------
# the source: pooled rows are the head's own output
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory):
    return make_random_llama(tmp_path_factory.mktemp("pool") / "bf16", dtype="bfloat16")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_pooled_head_rows_are_the_heads_own_output(tmp_path, dtype):
    """Bits and dtype as the head's own output hands them out (bf16 as uint16 bits, float16
    as float16), for blocks of several sizes; float32 rows are not pooled."""
    from logitdiff.sources.hf import _host_array

    d = make_random_llama(tmp_path / dtype, dtype=dtype, layers=1)
    src = open_source(f"hf:{d},batch=3")
    assert src.logits_dtype == dtype
    w = src.lm_head.weight
    torch.manual_seed(3)
    with torch.inference_mode():
        for n in (1, 5, 64):
            hb = (torch.randn(n, w.shape[1]) * 4).to(w.dtype)
            pool = src._row_pool(n)
            assert pool is not None
            pooled = src._head_pooled(hb, pool)
            own = _host_array(src._stored(src._head(hb)))
            assert pooled is not None and pooled.ctypes.data % outputs.DIRECT_ALIGN == 0
            assert pooled.dtype == own.dtype
            np.testing.assert_array_equal(pooled.view(np.uint16), own.view(np.uint16))
        assert src._head_pooled(hb[:31], src._row_pool(64)) is None  # under half a buffer: the head's own output
    assert open_source(f"hf:{d},batch=3,dtype=float32")._row_pool(64) is None  # float32 rows: not pooled


def test_a_capture_with_pooled_rows_stores_the_same_bytes(bf16_model, disk, monkeypatch):
    """The whole capture (full store, O_DIRECT) with the pool and with it turned off: the same
    rows, chunk for chunk, and the pooled blocks did go to the device from their buffers (the
    threshold lowered to this small vocabulary's 40 KB blocks)."""
    from logitdiff.capture import capture_candidate, capture_reference
    from logitdiff.store import RunReader
    from logitdiff.workload import Item

    tmp_path = disk
    monkeypatch.setattr(outputs, "DIRECT_FROM_CALLER_MIN", 16 << 10)
    from_caller = []
    real = outputs.DirectFile._write_from_caller

    def counted(self, mv, src):
        done = real(self, mv, src)
        from_caller.append(done)
        return done

    monkeypatch.setattr(outputs.DirectFile, "_write_from_caller", counted)
    src = open_source(f"hf:{bf16_model},batch=3")
    items = [Item(id=f"i{k}", prompt=f"Item {k}: the quick brown fox") for k in range(4)]
    ref = RunReader(capture_reference(src, items, tmp_path / "ref", max_tokens=40, store="topk:1"))
    kw = dict(chunk_bytes=40 * src.vocab_size * 4)  # blocks of 40 rows: several per item, several chunks
    from_caller.clear()
    a = RunReader(capture_candidate(src, ref, tmp_path / "pooled", **kw))
    # at least each chunk's first block (after the header page, on an offset boundary whatever
    # alignment the file system reports); with 512 bytes reported, every pooled block
    assert sum(d > 0 for d in from_caller) >= 2
    monkeypatch.setattr(type(src), "_row_pool", lambda self, block: None)
    b = RunReader(capture_candidate(src, ref, tmp_path / "plain", **kw))
    assert len(list((tmp_path / "pooled" / "chunks").glob("*.npy"))) >= 2
    assert [x.id for x in a.items()] == [x.id for x in b.items()] == [it.id for it in items]
    for x, y in zip(a.items(), b.items()):
        np.testing.assert_array_equal(a.logits(x), b.logits(y))
    for p in sorted((tmp_path / "pooled" / "chunks").glob("*.npy")):
        assert p.read_bytes() == (tmp_path / "plain" / "chunks" / p.name).read_bytes()


def test_a_scoring_call_holds_no_buffer_once_its_blocks_are_gone(bf16_model):
    """One pool per score_blocks call, on nothing that outlives it: with the call's blocks
    dropped, no pooled buffer is alive (a source opened for a whole ladder holds none)."""
    from logitdiff.store import rowpool

    made = []
    real = rowpool.RowPool.__init__

    def init(self, *a, **k):
        real(self, *a, **k)
        made.append(weakref.ref(self))

    src = open_source(f"hf:{bf16_model},batch=3")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rowpool.RowPool, "__init__", init)
        pairs = [([1, 2, 3], list(range(4, 40))), ([5, 6], list(range(7, 30)))]
        blocks = list(src.score_blocks(pairs, chunk_bytes=8 * src.vocab_size * 4))
        assert len(blocks) >= 4 and made and made[0]() is not None
        assert sum(b.rows.ctypes.data % 4096 == 0 for b in blocks) >= 4  # the full blocks (8 rows) are pooled
        del blocks
        gc.collect()
        assert all(r() is None for r in made)


def test_pool_buffers_are_sized_by_the_rows_a_call_scores(bf16_model):
    """A chunk size far above the rows scored maps no memory for rows that never come (a
    1 TiB chunk for a few positions: the buffers' size was 1 TiB / 4V rows), and a block under
    half a buffer (a short item beside a long one) is not pooled: no buffer pinned for a few
    rows the writer's queue does not count."""
    from logitdiff.store import rowpool

    made = []
    real = rowpool.RowPool.__init__

    def init(self, *a, **k):
        real(self, *a, **k)
        made.append(self)

    src = open_source(f"hf:{bf16_model},batch=3")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rowpool.RowPool, "__init__", init)
        few = list(src.score_blocks([([1, 2, 3], [4, 5]), ([6], [7])], chunk_bytes=1 << 40))
        assert [b.rows.shape[0] for b in few] == [2, 1] and made[-1].rows == 2
        mixed = list(src.score_blocks([([1, 2], list(range(3, 43))), ([5, 6], [7, 8, 9])], chunk_bytes=16 * src.vocab_size * 4))
        assert made[-1].rows == 16
        pooled = [b.rows.ctypes.data % outputs.DIRECT_ALIGN == 0 and b.rows.shape[0] > 8 for b in mixed]
        assert [b.rows.shape[0] for b in mixed] == [16, 16, 8, 3] and pooled == [True, True, False, False]
