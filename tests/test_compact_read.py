"""Reading a compact reference fast (issue 28 item 3): chunk members inflated by libdeflate
where the system has it (npzinflate; the same arrays as np.load, damage refused alike), and
the next chunk read ahead in the reader's worker thread (CompactStore.decodes), with the
same comparison either way."""

from __future__ import annotations

import io
import threading
import zipfile
import zlib

import numpy as np
import pytest
from test_bounds_store import make_run

from logitdiff import compact as C
from logitdiff import npzinflate
from logitdiff.compare import compare_runs
from logitdiff.errors import LogitdiffError
from logitdiff.store import RunReader

needs_libdeflate = pytest.mark.skipif(not npzinflate.available(), reason="libdeflate not on this system")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cread")
    rng = np.random.default_rng(3)
    ref = {f"i{k}": rng.normal(0, 3, (7 + k, 400)).astype(np.float32) for k in range(5)}
    teacher = {k: rng.integers(0, 400, v.shape[0]) for k, v in ref.items()}
    comp = make_run(root / "comp", ref, teacher, store="compact:exact=8,band=40")  # chunks of 16 rows: several
    cand = make_run(root / "cand", {k: v + rng.normal(0, 0.3, v.shape).astype(np.float32) for k, v in ref.items()}, teacher)
    return comp, cand


def _chunks(run):
    r = RunReader(run)
    return [r.path / "chunks" / c["data"] for c in r.manifest["chunks"]]


@needs_libdeflate
def test_libdeflate_members_equal_np_load(runs, tmp_path):
    """Every member of every chunk, and arrays of other dtypes, layouts and zip methods
    (Fortran order, a stored member, 0-d, empty), equal np.load's bit for bit."""
    comp, _ = runs
    for p in _chunks(comp):
        got = npzinflate.load(p)
        with np.load(p) as z:
            want = {k: z[k] for k in z.files}
        assert got.keys() == want.keys()
        for k in want:
            assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
            np.testing.assert_array_equal(got[k], want[k])
    rng = np.random.default_rng(0)
    arrays = {"f": np.asfortranarray(rng.normal(size=(5, 3))), "u16": rng.integers(0, 60000, (4, 9)).astype(np.uint16),
              "z": np.array(2.5), "e": np.zeros((0, 7), np.float32), "big": rng.integers(0, 9, 300_000).astype(np.int64)}
    for writer in (np.savez_compressed, np.savez):  # deflated members, stored members
        bio = io.BytesIO()
        writer(bio, **arrays)
        p = tmp_path / f"{writer.__name__}.npz"
        p.write_bytes(bio.getvalue())
        got = npzinflate.load(p, threads=3)
        for k, v in arrays.items():
            assert got[k].dtype == v.dtype and got[k].shape == v.shape
            np.testing.assert_array_equal(got[k], v)
        assert got["f"].flags.f_contiguous


@needs_libdeflate
@pytest.mark.parametrize("where", ["data", "crc"])
def test_damaged_member_is_refused_like_np_load(runs, tmp_path, where):
    """A flipped byte inside a deflated member (bad stream or CRC mismatch) or a CRC that no
    longer matches the bytes: a ValueError from npzinflate, a one-line LogitdiffError naming
    the chunk from the store; np.load refuses the same file."""
    comp, _ = runs
    src = _chunks(comp)[0]
    raw = bytearray(src.read_bytes())
    with zipfile.ZipFile(src) as zf:
        info = zf.getinfo("band_codes.npy")
    if where == "data":
        name_len, extra_len = np.frombuffer(bytes(raw[info.header_offset + 26 : info.header_offset + 30]), "<u2")
        raw[info.header_offset + 30 + int(name_len) + int(extra_len) + info.compress_size // 2] ^= 0x5A
    else:  # the central directory's CRC-32 of the member (offset 16 of its entry; its name at 46)
        at = raw.find(b"PK\x01\x02")
        while raw[at + 46 : at + 46 + len(info.filename)] != info.filename.encode():
            at = raw.find(b"PK\x01\x02", at + 4)
            assert at > 0
        raw[at + 16] ^= 0xFF
    bad = tmp_path / src.name
    bad.write_bytes(bytes(raw))
    with pytest.raises((ValueError, zipfile.BadZipFile)):
        npzinflate.load(bad)
    with pytest.raises((zlib.error, zipfile.BadZipFile)):
        with np.load(bad) as z:
            z["band_codes"]
    with pytest.raises(LogitdiffError) as ei:
        C.load_chunk(bad)
    assert "\n" not in str(ei.value) and str(bad) in str(ei.value)


def test_without_libdeflate_the_same_arrays(runs, monkeypatch, tmp_path):
    """Where npzinflate does not apply (no libdeflate), load_chunk reads with np.load: the
    same arrays; a member whose deflate stream is damaged is a one-line error there too
    (np.load raises zlib.error, which load_chunk did not catch)."""
    comp, _ = runs
    p = _chunks(comp)[0]
    fast = C.load_chunk(p)
    monkeypatch.setattr(npzinflate, "load", lambda *a, **k: None)
    slow = C.load_chunk(p)
    assert fast.keys() == slow.keys()
    for k in fast:
        np.testing.assert_array_equal(fast[k], slow[k])
    raw = bytearray(p.read_bytes())
    with zipfile.ZipFile(p) as zf:
        info = zf.getinfo("band_codes.npy")
    name_len, extra_len = np.frombuffer(bytes(raw[info.header_offset + 26 : info.header_offset + 30]), "<u2")
    start = info.header_offset + 30 + int(name_len) + int(extra_len)  # the member's deflate stream
    raw[start + 8 : start + 40] = b"\xff" * 32
    bad = tmp_path / p.name
    bad.write_bytes(bytes(raw))
    with pytest.raises(LogitdiffError) as ei:
        C.load_chunk(bad)
    assert "\n" not in str(ei.value) and str(bad) in str(ei.value)


def test_compact_chunks_are_read_ahead_with_the_same_comparison(runs, monkeypatch):
    """With read-ahead (the default) every chunk after the first asked for, and the first
    through compare_runs' prefetch, is loaded in the reader's worker thread; the columns are
    those of a reader that loads in the caller's thread (read_ahead=False), bit for bit."""
    comp, cand = runs
    where = []
    real = C.load_chunk

    def load(path):
        where.append(threading.current_thread().name)
        return real(path)

    monkeypatch.setattr(C, "load_chunk", load)
    ahead = compare_runs(RunReader(comp), RunReader(cand)).columns
    n = len(_chunks(comp))
    assert n >= 3 and len(where) == n and all(w.startswith("logitdiff-decode") for w in where), where
    where.clear()
    inline = compare_runs(RunReader(comp, read_ahead=False), RunReader(cand)).columns
    # the writer's last chunk closes items only: read ahead unasked above, never asked for here
    assert where == [threading.current_thread().name] * len(where) and len(where) >= n - 1
    assert ahead.keys() == inline.keys()
    for k in ahead:
        np.testing.assert_array_equal(np.asarray(ahead[k]), np.asarray(inline[k]), err_msg=k)
