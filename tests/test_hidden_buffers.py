"""A hidden-state reader decodes each chunk into a reused buffer (storekinds/hidden.py,
`HiddenStore._free_buffer`): rows a caller still holds must never change when a later
chunk is decoded, whatever the caller keeps -- one block, a block straddling chunks, every
piece of the run at once -- and a streaming compare must cycle between two buffers."""

from __future__ import annotations

import numpy as np
import pytest

from logitdiff.builtin import WORKLOAD
from logitdiff.capture import capture_candidate, capture_reference
from logitdiff.compare import compare_runs
from logitdiff.sources import open_source
from logitdiff.store import RunReader, aligned_blocks
from logitdiff.store.kinds import hidden as HS
from logitdiff.workload import read_workload

V = 4096  # builtin:tiny
CHUNK_ROWS = 8  # 64 KiB chunks of bf16 rows: every item runs over several chunks


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hbuf")
    items = read_workload(WORKLOAD)[:6]
    src = open_source("builtin:tiny")
    full = capture_reference(src, items, root / "full")
    hid = capture_reference(src, items, root / "hid", store="hidden", chunk_bytes=CHUNK_ROWS * V * 2)
    cand = capture_candidate(open_source("builtin:tiny,dtype=float32"), RunReader(full), root / "cand")
    return full, hid, cand


def _rows(r: RunReader) -> np.ndarray:
    return np.concatenate([np.asarray(p) for p in r.row_pieces(r.items())])


def test_the_run_has_many_small_chunks(runs):
    full, hid, _ = runs
    h = RunReader(hid)
    sizes = [c["rows"] for c in h.manifest["chunks"]]
    assert max(sizes) <= CHUNK_ROWS and len(sizes) >= 10
    # some item spans three chunks or more: holding its pieces holds three decoded chunks
    assert max(len(list(h._spans(it))) for it in h.items()) >= 3


def test_pieces_held_all_at_once_keep_their_rows(runs):
    full, hid, _ = runs
    want = _rows(RunReader(full))
    h = RunReader(hid)
    held = list(h.row_pieces(h.items()))  # every chunk's rows alive at once
    np.testing.assert_array_equal(np.concatenate(held), want)
    # and an item's logits, which list the item's pieces (one per chunk it spans)
    f = RunReader(full)
    for it_h, it_f in zip(h.items(), f.items()):
        np.testing.assert_array_equal(h.logits(it_h), f.logits(it_f))


@pytest.mark.parametrize("rows", [3, CHUNK_ROWS, CHUNK_ROWS + 3, 3 * CHUNK_ROWS + 1])
def test_reblocked_blocks_straddling_chunks_keep_their_rows(runs, rows):
    full, hid, _ = runs
    f, h = RunReader(full), RunReader(hid)
    streamed = [(np.asarray(a).copy(), np.asarray(b).copy())
                for a, b in zip(f.row_blocks(f.items(), rows, raw=True), h.row_blocks(h.items(), rows, raw=True))]
    assert len(streamed) > 1
    for a, b in streamed:
        np.testing.assert_array_equal(a, b)
    # the same blocks kept (not copied) until the end
    kept = list(h.row_blocks(h.items(), rows, raw=True))
    np.testing.assert_array_equal(np.concatenate(kept), np.concatenate([a for a, _ in streamed]))


@pytest.mark.parametrize("max_batch_rows", [5, CHUNK_ROWS + 3, None])
def test_compare_against_hidden_equals_compare_against_full(runs, max_batch_rows):
    full, hid, cand = runs
    a = compare_runs(RunReader(full), RunReader(cand), max_batch_rows=max_batch_rows)
    hr = RunReader(hid)
    b = compare_runs(hr, RunReader(cand), max_batch_rows=max_batch_rows)
    assert hr._float32  # a float32 candidate: the reference decoded straight to float32
    assert a.method == b.method
    n = 0
    for k, v in a.columns.items():
        if isinstance(v, np.ndarray) and v.dtype.kind in "fiub":
            np.testing.assert_array_equal(v, b.columns[k], err_msg=k)
            n += 1
    assert n > 5 and a.columns["kl_nats"].mean() > 0


@pytest.mark.parametrize("read_ahead", [False, True])
def test_a_streaming_compare_cycles_between_a_fixed_set_of_buffers(runs, read_ahead):
    """What the reuse is for: no fresh chunk-sized pages per chunk. A caller that drops each
    block before asking for the next (compare's loop) leaves the previous chunk unreferenced
    when the next is decoded (aligned_blocks drops its spent piece first): one buffer, or
    two when the reader decodes the next chunk ahead (the one compared, the one decoded; one
    when the worker thread only gets to run once the consumer has let the previous chunk go,
    which is up to the scheduler)."""
    full, hid, cand = runs
    want = 2 if read_ahead else 1

    def kept(reader, most):
        # without a worker the count is exact; with one it is at most ``most`` (at least one)
        n_kept = len(reader.kind._out_buffers)
        return n_kept == most if not read_ahead else 1 <= n_kept <= most

    f, h = RunReader(full), RunReader(hid, read_ahead=read_ahead)
    bases = set()
    n = 0
    for a, b in aligned_blocks(f.row_pieces(f.items()), h.row_pieces(h.items()), 5):
        bases.add(id(b.base))
        n += 1
        del a, b
    pool = h.kind._out_buffers
    assert n > 10 and kept(h, want) and bases == {id(x) for x in pool}  # > 6 chunks, <= 2 buffers
    h = RunReader(hid, read_ahead=read_ahead)
    compare_runs(h, RunReader(cand), max_batch_rows=CHUNK_ROWS + 3)
    assert kept(h, want)
    # a caller holding the previous block while asking for the next gets one more buffer
    h = RunReader(hid, read_ahead=read_ahead)
    for a, b in aligned_blocks(f.row_pieces(f.items()), h.row_pieces(h.items()), 5):
        pass
    assert kept(h, want + 1) and want + 1 <= HS.OUT_BUFFERS == 3


@pytest.mark.parametrize("hold", ["torch.from_numpy", "memoryview", "np.frombuffer", "ctypeslib.as_ctypes", "float16 view"])
def test_rows_held_without_the_array_keep_their_rows(runs, hold):
    """The reuse test reads the buffer's reference count: whatever a consumer keeps of a
    chunk's rows (a tensor sharing them, a buffer export, an array over that export, a ctypes
    array) holds a reference that reaches the buffer, so the buffer is not decoded into
    while those rows can be read. (A raw address, ``.ctypes.data``, holds nothing: it is no
    safer with any numpy array, whose memory goes back to the allocator once freed.)"""
    full, hid, _ = runs
    f, h = RunReader(full), RunReader(hid)
    want = [np.asarray(p).copy() for p in f.row_pieces(f.items())]

    def keep(a: np.ndarray):
        if hold == "torch.from_numpy":
            torch = pytest.importorskip("torch")
            return torch.from_numpy(a.view(np.int16))
        if hold == "memoryview":
            return memoryview(a)
        if hold == "np.frombuffer":
            return np.frombuffer(memoryview(a), np.uint16).reshape(a.shape)
        if hold == "ctypeslib.as_ctypes":
            return np.ctypeslib.as_ctypes(a)
        return a.view(np.float16)

    def back(k) -> np.ndarray:
        if hold == "torch.from_numpy":
            return k.numpy().view(np.uint16)
        if hold == "ctypeslib.as_ctypes":
            return np.ctypeslib.as_array(k).copy()
        return np.asarray(k).view(np.uint16)

    kept = []
    for p in h.row_pieces(h.items()):
        kept.append(keep(np.ascontiguousarray(p)))
        del p  # only the consumer's object refers to the rows now
    got = np.concatenate([back(k) for k in kept])
    np.testing.assert_array_equal(got, np.concatenate(want))


def test_rows_decoded_to_float32_are_the_full_runs_rows_widened(runs):
    """`RunReader.decode_to_float32`: every row the full run's bf16 row widened, exactly,
    held all at once (buffers of their own dtype) or streamed in blocks across chunks; asked
    for once rows were read, refused (the chunk decoded ahead would be the other form)."""
    full, hid, _ = runs
    want = _rows(RunReader(full))
    h = RunReader(hid)
    h.decode_to_float32()
    held = list(h.row_pieces(h.items()))
    assert all(p.dtype == np.float32 for p in held)
    np.testing.assert_array_equal(np.concatenate(held).view(np.uint32), want.astype(np.uint32) << 16)
    h = RunReader(hid)
    h.decode_to_float32()
    blocks = [b.copy() for b in h.row_blocks(h.items(), CHUNK_ROWS + 3)]  # values(): no second widening
    np.testing.assert_array_equal(np.concatenate(blocks).view(np.uint32), want.astype(np.uint32) << 16)
    f, h = RunReader(full), RunReader(hid)
    h.decode_to_float32()
    for it_h, it_f in zip(h.items(), f.items()):
        np.testing.assert_array_equal(h.logits(it_h), f.logits(it_f))
    h = RunReader(hid)
    next(iter(h.row_pieces(h.items())))
    assert not h.decode_to_float32() and next(iter(h.row_pieces(h.items()))).dtype == np.uint16
    assert not RunReader(full).decode_to_float32()  # a kind that does not decode: nothing to change


def test_a_reference_prefetched_by_the_caller_is_compared_as_it_was_decoded(runs):
    """A caller may prefetch before compare_runs (its first chunk already decoding in the
    16-bit form): the compare keeps that form, converts as against a full reference, and
    gives the same columns."""
    full, hid, cand = runs
    a = compare_runs(RunReader(full), RunReader(cand))
    hr = RunReader(hid)
    hr.prefetch()
    b = compare_runs(hr, RunReader(cand))
    assert not hr._float32
    for k, v in a.columns.items():
        if isinstance(v, np.ndarray) and v.dtype.kind in "fiub":
            np.testing.assert_array_equal(v, b.columns[k], err_msg=k)


def test_float32_decoding_only_where_the_compare_would_convert(runs):
    """compare_runs decodes the reference to float32 against float32 candidate rows only: a
    bf16 candidate is compared on the bits in place, as against the full reference."""
    from logitdiff.compare import decodes_to_float32

    full, hid, cand = runs
    assert decodes_to_float32(RunReader(hid), RunReader(cand))
    assert not decodes_to_float32(RunReader(hid), RunReader(full))  # bf16 both sides
    assert not decodes_to_float32(RunReader(full), RunReader(cand))  # nothing decoded
    a = compare_runs(RunReader(full), RunReader(full))
    hr = RunReader(hid)
    b = compare_runs(hr, RunReader(full))
    assert not hr._float32
    for k, v in a.columns.items():
        if isinstance(v, np.ndarray) and v.dtype.kind in "fiub":
            np.testing.assert_array_equal(v, b.columns[k], err_msg=k)


def test_float32_decode_without_the_compiled_kernel(runs, monkeypatch):
    """hidden.decode into a float32 buffer where the compiled decode is absent (or another
    device runs it): the portable product's bits, widened; exceptions included."""
    from logitdiff.store import hidden as Hs
    from logitdiff.numerics import kernel

    full, hid, _ = runs
    h = RunReader(hid, read_ahead=False)
    # the first chunk with stored exceptions (entries the head does not reproduce)
    index = next(i for i in range(len(h.manifest["chunks"])) if h._load_stored(i)["exc_row"].size)
    stored = h._load_stored(index)
    head = h.kind.head()
    bits = Hs.decode(stored, head).copy()
    compiled = Hs.decode(stored, head, out=np.full(bits.shape, np.nan, np.float32)).copy()
    monkeypatch.setattr(kernel, "hidden_decode", lambda *a, **k: None)
    portable = Hs.decode(stored, head, out=np.full(bits.shape, np.nan, np.float32))
    widened = (bits.astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_array_equal(compiled.view(np.uint32), widened.view(np.uint32))
    np.testing.assert_array_equal(portable.view(np.uint32), widened.view(np.uint32))
    first = sum(c["rows"] for c in h.manifest["chunks"][:index])
    np.testing.assert_array_equal(bits, _rows(RunReader(full))[first : first + len(bits)])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("compiled", [True, False])
def test_float32_decode_of_both_formats(dtype, compiled, monkeypatch):
    """hidden.decode into float32 for a bf16 and a float16 store, compiled or not: the 16-bit
    decode's values widened, stored exceptions included (here: every entry of one row)."""
    from logitdiff.store import hidden as Hs
    from logitdiff.numerics import kernel

    rng = np.random.default_rng(3)
    n, V, Hd = 5, 300, 24
    to16 = (lambda x: np.asarray(x, np.float16).view(np.uint16)) if dtype == "float16" else (
        lambda x: ((np.asarray(x, np.float32).view(np.uint32) + 0x8000) >> 16).astype(np.uint16))
    hid, head = to16(rng.normal(0, 1, (n, Hd))), to16(rng.normal(0, 0.2, (V, Hd)))
    with np.errstate(over="ignore", invalid="ignore"):
        logits = Hs.round_bits(Hs._bits_to_f64(hid, dtype) @ Hs._bits_to_f64(head, dtype).T, dtype)
    logits[2] ^= 1  # a row the head does not reproduce: all its entries become exceptions
    block = Hs.encode(logits, hid, head, Hs.head_norms(head, dtype), dtype)
    assert (block["exc_row"] == 2).sum() == V
    if not compiled:
        monkeypatch.setattr(kernel, "hidden_decode", lambda *a, **k: None)
    bits = Hs.decode(block, head, dtype).copy()
    np.testing.assert_array_equal(bits, logits)
    got = Hs.decode(block, head, dtype, out=np.full((n, V), np.nan, np.float32))
    want = bits.view(np.float16).astype(np.float32) if dtype == "float16" else (bits.astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
