"""What a hidden-state reader does besides the head product (storekinds/hidden.py,
hidden.py, store.RunReader): the output head's sha256 is checked once per version of the
file, not once per reader -- and a head whose bytes changed in any way is still refused;
chunks read in order are decoded one ahead in a worker thread -- and whatever order they are
read in, they are the full run's rows, a damaged chunk is named when (and only when) it is
read."""

from __future__ import annotations

import os
import shutil
import threading

import numpy as np
import pytest

from logitdiff.store import hidden as Hs
from logitdiff.builtin import WORKLOAD
from logitdiff.capture import capture_candidate, capture_reference
from logitdiff.errors import LogitdiffError
from logitdiff.store import filecache as fc
from logitdiff.sources import open_source
from logitdiff.store import RunReader
from logitdiff.workload import read_workload


V = 4096  # builtin:tiny
CHUNK_ROWS = 8


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    root = tmp_path_factory.mktemp("hidr")
    src = open_source("builtin:tiny")
    full = capture_reference(src, read_workload(WORKLOAD)[:2], root / "full")
    # teacher-forced on the full run's tokens (no second generation): 8-row chunks, ~12 of them
    hid = capture_candidate(src, RunReader(full), root / "hid", store="hidden", chunk_bytes=CHUNK_ROWS * V * 2)
    return full, hid


@pytest.fixture(scope="module")
def hid(both):
    return both[1]


@pytest.fixture()
def run(hid, tmp_path, monkeypatch):
    """A private copy of the run, a private cache, and a count of the head's hashings."""
    monkeypatch.setenv("LOGITDIFF_CACHE", str(tmp_path / "cache"))
    calls = []
    real = Hs.head_sha256

    def counted(head):
        calls.append(1)
        return real(head)

    monkeypatch.setattr(Hs, "head_sha256", counted)
    dst = tmp_path / "run"
    shutil.copytree(hid, dst)
    return dst, calls


def _first_rows(path) -> np.ndarray:
    # no decode ahead: nothing may read the head's memory map while a test rewrites the file
    # (a truncated mapped file is SIGBUS to whoever reads past its new end)
    r = RunReader(path, read_ahead=False)
    return np.asarray(next(iter(r.row_pieces(r.items()))))


def test_the_same_head_is_hashed_once_for_every_reader(run):
    path, calls = run
    rows = _first_rows(path)
    assert calls == [1]
    for _ in range(3):
        np.testing.assert_array_equal(_first_rows(path), rows)
    assert calls == [1]
    entries = list((path.parent / "cache" / "hidden-head-sha256").iterdir())
    assert len(entries) == 1 and entries[0].read_text() == RunReader(path).manifest["head"]["sha256"]


@pytest.mark.parametrize("change", ["in_place_same_mtime", "replaced", "appended", "truncated", "touched"])
def test_a_head_changed_after_its_check_is_hashed_again_and_refused(run, change):
    path, calls = run
    _first_rows(path)
    head = path / Hs.HEAD_FILE
    st = head.stat()
    if change == "in_place_same_mtime":  # one byte flipped in place, the old mtime put back
        with open(head, "r+b") as f:
            f.seek(st.st_size - 1)
            b = f.read(1)
            f.seek(st.st_size - 1)
            f.write(bytes([b[0] ^ 1]))
        os.utime(head, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert head.stat().st_mtime_ns == st.st_mtime_ns and head.stat().st_size == st.st_size
    elif change == "replaced":  # another file of the same size put in its place
        data = bytearray(head.read_bytes())
        data[-2] ^= 1
        (path / "new.npy").write_bytes(bytes(data))
        os.replace(path / "new.npy", head)
    elif change == "appended":  # bytes past the array are not the head: hashed again, accepted
        with open(head, "ab") as f:
            f.write(b"\0" * 64)
        _first_rows(path)
        assert calls == [1, 1]
        return
    elif change == "truncated":
        with open(head, "r+b") as f:
            f.truncate(st.st_size - 2 * 256)  # one row of H = 256 fewer
    else:  # same bytes, new mtime: hashed again, still the recorded head
        os.utime(head, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
        _first_rows(path)
        assert calls == [1, 1]
        return
    with pytest.raises(LogitdiffError, match=r"head\.npy: (sha256 differs|output head is|unreadable)"):
        _first_rows(path)
    assert calls == ([1] if change == "truncated" else [1, 1])  # a wrong shape is refused before any hashing


def test_a_damaged_or_foreign_cache_entry_is_not_trusted_blindly(run):
    path, calls = run
    _first_rows(path)
    (entry,) = (path.parent / "cache" / "hidden-head-sha256").iterdir()
    entry.write_bytes(b"not a digest\xff")
    _first_rows(path)  # unreadable entry: hashed again
    assert calls == [1, 1]
    entry.write_text("0" * 64)  # an entry that is not the recorded digest refuses the head, as a changed file would
    with pytest.raises(LogitdiffError, match=r"sha256 differs"):
        _first_rows(path)


def test_cache_off_hashes_every_time(run, monkeypatch):
    path, calls = run
    monkeypatch.setenv("LOGITDIFF_CACHE", "off")
    _first_rows(path)
    _first_rows(path)
    assert calls == [1, 1]


def test_a_file_changed_while_it_is_read_is_not_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("LOGITDIFF_CACHE", str(tmp_path / "cache"))
    f = tmp_path / "f"
    f.write_bytes(b"a")
    seen = []

    def compute():
        seen.append(f.read_bytes())
        f.write_bytes(b"bb")  # changed under the reader
        return "x"

    assert fc.file_fact_cached(f, "t", compute) == "x"
    assert not (tmp_path / "cache" / "t").exists()
    assert fc.file_fact_cached(f, "t", lambda: "y") == "y"  # the new version: computed, then kept
    assert fc.file_fact_cached(f, "t", lambda: "z") == "y"


# --------------------------------------------------------------------------------------
# decoding ahead
# --------------------------------------------------------------------------------------


def _full_chunks(full, hid) -> list[np.ndarray]:
    """The full run's rows cut as the hidden run's chunks are."""
    f, h = RunReader(full), RunReader(hid)
    rows = np.concatenate([np.asarray(p) for p in f.row_pieces(f.items())])
    cuts = np.cumsum([c["rows"] for c in h.manifest["chunks"]])[:-1]
    return np.split(rows, cuts)


def test_a_head_replaced_between_its_map_and_its_check_cannot_lend_its_key(run, monkeypatch):
    """np.load maps head.npy; if the file is replaced before the cache is asked, the mapped
    (old) bytes' hash must not be stored under the new file's identity, which would make
    every later reader accept the new head unhashed."""
    path, calls = run
    head_path = path / Hs.HEAD_FILE
    sha = RunReader(path).manifest["head"]["sha256"]
    original = np.load(head_path).copy()
    changed = original.copy()
    changed[0, 0] ^= 1
    staged = path / "staged.npy"
    np.save(staged, changed)
    real_load = np.load

    def load_then_replace(p, *a, **k):
        out = real_load(p, *a, **k)
        if str(p) == str(head_path) and staged.exists():
            os.replace(staged, head_path)  # after the map, before the check
        return out

    monkeypatch.setattr(Hs.np, "load", load_then_replace)
    got = Hs.load_head(head_path, V, sha)  # the mapped bytes are the old file's: they match
    assert np.array_equal(got, original) and not staged.exists()
    monkeypatch.setattr(Hs.np, "load", real_load)
    with pytest.raises(LogitdiffError, match="sha256 differs"):
        Hs.load_head(head_path, V, sha)  # the new bytes, under their own identity: hashed and refused


def test_chunks_read_in_order_are_decoded_ahead_in_the_worker(both, monkeypatch):
    full, hid = both
    want = _full_chunks(full, hid)
    assert len(want) >= 10
    h = RunReader(hid)
    where = []
    real = type(h.kind).decode

    def decode(kind, block, device=None):
        where.append(threading.current_thread().name)
        return real(kind, block, device)

    monkeypatch.setattr(type(h.kind), "decode", decode)
    for k, w in enumerate(want):
        np.testing.assert_array_equal(h._chunk(k), w)
        assert h._ahead is None if k == len(want) - 1 else h._ahead[0] == k + 1
    assert where[0] == threading.current_thread().name  # the first: asked for, nothing ahead yet
    assert len(where) == len(want) and all(w.startswith("logitdiff-decode") for w in where[1:])
    off = RunReader(hid, read_ahead=False)
    where.clear()
    for k, w in enumerate(want):
        np.testing.assert_array_equal(off._chunk(k), w)
        assert off._ahead is None
    assert set(where) == {threading.current_thread().name}


@pytest.mark.parametrize("order", ["backwards", "skipping", "repeating", "interleaved_readers"])
def test_chunks_read_in_any_order_are_the_full_runs_rows(both, order):
    full, hid = both
    want = _full_chunks(full, hid)
    n = len(want)
    h = RunReader(hid)
    if order == "backwards":
        seq = [0, 1, 2] + list(range(n - 1, -1, -1))
    elif order == "skipping":
        seq = [0, 1, 3, 4, 6, 2, 3, n - 1, 0]
    elif order == "repeating":
        seq = [0, 0, 1, 1, 2, 1, 2, 3]
    else:
        seq = list(range(n))
    held = []
    g = RunReader(hid)
    for k in seq:
        got = h._chunk(k)
        held.append((k, got))  # every chunk kept alive: no buffer may be decoded into under it
        if order == "interleaved_readers":
            held.append((n - 1 - k, g._chunk(n - 1 - k)))
    for k, got in held:
        np.testing.assert_array_equal(got, want[k])


def test_a_damaged_chunk_is_named_when_it_is_read_not_when_it_is_decoded_ahead(both, tmp_path):
    full, hid = both
    run = tmp_path / "r"
    shutil.copytree(hid, run)
    chunks = RunReader(run).manifest["chunks"]
    bad = run / "chunks" / chunks[2]["data"]
    bad.write_bytes(bad.read_bytes()[:100])
    want = _full_chunks(full, hid)
    h = RunReader(run)
    np.testing.assert_array_equal(h._chunk(0), want[0])
    np.testing.assert_array_equal(h._chunk(1), want[1])  # chunk 2 is decoded ahead now, and fails there
    assert h._ahead is not None and h._ahead[0] == 2
    np.testing.assert_array_equal(h._chunk(5), want[5])  # out of order: the failed read-ahead is dropped
    with pytest.raises(LogitdiffError, match=r"000002\.hidden\.npz: unreadable hidden-state chunk"):
        RunReader(run)._chunk(2)
    h = RunReader(run)
    h._chunk(0)
    h._chunk(1)
    with pytest.raises(LogitdiffError, match=r"000002\.hidden\.npz: unreadable hidden-state chunk"):
        h._chunk(2)  # the worker's error, raised by the call that asks for the chunk


def test_prefetch_decodes_the_first_chunk_wanted_in_the_worker(both, monkeypatch):
    full, hid = both
    want = _full_chunks(full, hid)
    where = []
    kind_cls = type(RunReader(hid).kind)
    real = kind_cls.decode

    def decode(kind, block, device=None):
        where.append(threading.current_thread().name)
        return real(kind, block, device)

    monkeypatch.setattr(kind_cls, "decode", decode)
    h = RunReader(hid)
    h.prefetch()
    assert h._ahead[0] == 0
    got = [np.asarray(p).copy() for p in h.row_pieces(h.items())]
    np.testing.assert_array_equal(np.concatenate(got), np.concatenate(want))
    if h._ahead is not None:  # the last chunk (no rows: the writer's last, items-only) decoded ahead, unasked
        h._ahead[1].result()
    assert len(where) == len(want) and all(w.startswith("logitdiff-decode") for w in where)
    # from a later item: the chunk its rows start in
    h = RunReader(hid)
    later = h.items()[1:]
    h.prefetch(later)
    assert h._ahead[0] == later[0].chunk > 0
    np.testing.assert_array_equal(h._chunk(later[0].chunk), want[later[0].chunk])
    if h._ahead is not None:  # the next chunk read ahead in the worker: done before `where` is cleared below
        h._ahead[1].result()
    # no-ops: rows already read, read-ahead off
    h = RunReader(hid)
    h._chunk(3)
    h.prefetch()
    assert h._ahead is None
    off = RunReader(hid, read_ahead=False)
    off.prefetch()
    assert off._ahead is None
    where.clear()
    np.testing.assert_array_equal(off._chunk(0), want[0])
    assert where == [threading.current_thread().name]


def test_a_dropped_reader_leaves_no_thread_behind(both):
    """The worker lives as long as its reader: a long-lived process opening many readers does
    not collect threads (nor the decoded chunk a read-ahead holds)."""
    import gc
    import weakref

    _, hid = both
    h = RunReader(hid)
    h._chunk(0)
    h._chunk(1)  # chunk 2 is being decoded ahead
    (thread,) = h._pool._threads
    ahead = weakref.ref(h._ahead[1])
    del h
    gc.collect()
    thread.join(timeout=10)
    assert not thread.is_alive() and ahead() is None
