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

from logitdiff.store import compact as C
from logitdiff.store import npzinflate
from logitdiff.compare import compare_runs
from logitdiff.errors import LogitdiffError
from logitdiff.store import RunReader

needs_libdeflate = pytest.mark.skipif(not npzinflate.available(), reason="libdeflate not on this system")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cread")
    rng = np.random.default_rng(3)
    ref = {f"i{k}": rng.normal(0, 3, (7 + 3 * k, 400)).astype(np.float32) for k in range(5)}
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

    def load(path, max_bytes=None):
        where.append(threading.current_thread().name)
        return real(path, max_bytes)

    monkeypatch.setattr(C, "load_chunk", load)
    ahead = compare_runs(RunReader(comp), RunReader(cand)).columns
    n = len(_chunks(comp))
    assert n >= 3 and len(where) == n and all(w.startswith("logitdiff-decode") for w in where), where
    where.clear()
    inline = compare_runs(RunReader(comp, read_ahead=False), RunReader(cand)).columns
    assert where == [threading.current_thread().name] * n
    assert ahead.keys() == inline.keys()
    for k in ahead:
        np.testing.assert_array_equal(np.asarray(ahead[k]), np.asarray(inline[k]), err_msg=k)


@pytest.mark.parametrize("ties", [False, True])
def test_kernel_at_a_large_rest(ties):
    """A rest of ~20,000 entries (the rest's fill threshold from the kernel's capacity
    histogram; a sampled-rank variant was tried and reverted, bench/RESULTS.md): random rows
    and quantised ones (thousands of entries on one value, the threshold inside a tie) agree
    with numpy and cover scipy."""
    from scipy.special import log_softmax
    from test_bounds_compact_kernel import check, raw_of

    from logitdiff.numerics import bounds as B
    from logitdiff.numerics import kernel

    if not kernel.available():
        pytest.skip("compiled kernel not built")
    rng = np.random.default_rng(21 + ties)
    z = rng.normal(0, 2.5, (5, 20000)) + 6 * (rng.random((5, 20000)) < 0.005)
    zc = z + rng.normal(0, 0.4, z.shape)
    if ties:
        z, zc = np.round(z * 2) / 2, np.round(zc * 2) / 2
    spec = C.CompactSpec(32, 256)
    for dtype in ("float32", "bfloat16"):
        check(z, zc, dtype, spec, f"V=20000 ties={ties}")
        # tighter than check's allowance, against the numpy code (a sort, no kernel): the
        # same threshold (a value at a rank is one number) leaves only summation order
        # between the two upper bounds
        block = C.encode(np.asarray(z, np.float32), np.zeros(5, np.int64), spec)
        raw, zf = raw_of(zc, dtype)
        fused = C.compare_rows(block, raw, np.zeros(5, np.int64), top_k=8, overlap_k=4, threads=2)
        ref = B.compact_vs_full(C.decode(block), log_softmax(zf.astype(np.float64), 1), compiled=False)
        for col, div in (("kl_upper_nats", "kl"), ("kl_rev_upper_nats", "kl_rev"), ("jsd_upper_nats", "jsd")):
            np.testing.assert_allclose(fused[col], ref[div].upper, rtol=1e-11, atol=0, err_msg=col)


def test_stable_top_is_the_stable_argsort():
    """compact._stable_top (a partition, then a sort of k entries per row) equals the stable
    whole-row argsort it replaces, on tie-heavy rows and at every k."""
    rng = np.random.default_rng(4)
    for trial in range(300):
        n, E = int(rng.integers(1, 12)), int(rng.integers(2, 70))
        k = int(rng.integers(1, E + 2))
        lp = np.round(rng.normal(0, rng.choice([0.5, 3.0]), (n, E)), int(rng.integers(0, 3)))
        np.testing.assert_array_equal(C._stable_top(lp, k), np.argsort(-lp, axis=1, kind="stable")[:, :k], err_msg=str(trial))


def _npz(members: dict[str, bytes], method=zipfile.ZIP_DEFLATED) -> bytearray:
    b = io.BytesIO()
    with zipfile.ZipFile(b, "w", method) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return bytearray(b.getvalue())


def _npy(arr=None, header: bytes | None = None) -> bytes:
    f = io.BytesIO()
    np.save(f, np.zeros(4) if arr is None else arr)
    raw = f.getvalue()
    if header is None:
        return raw
    body = header.ljust(118) + b"\n"  # a version 1.0 header of the same length: 128 bytes with the preamble
    return raw[:8] + len(body).to_bytes(2, "little") + body + raw[10 + int.from_bytes(raw[8:10], "little"):]


def _central(d: bytearray) -> int:
    e = d.rfind(b"PK\x05\x06")
    return int.from_bytes(d[e + 16 : e + 20], "little")


def _hostile(kind: str) -> bytearray:
    """One damaged or hostile .npz per class the review found (each a few hundred bytes)."""
    if kind == "stored_size":  # a stored member claiming 2 GiB from 1 byte: broadcast over 2 GiB before the CRC
        d = _npz({"a.npy": _npy()}, zipfile.ZIP_STORED)
        cd = _central(d)
        d[cd + 20 : cd + 28] = (1).to_bytes(4, "little") + (2 << 30).to_bytes(4, "little")
        return d
    if kind == "inflate_ratio":  # a deflated member claiming more than deflate can expand its bytes to
        d = _npz({"a.npy": _npy()})
        cd = _central(d)
        d[cd + 24 : cd + 28] = (3 << 30).to_bytes(4, "little")
        return d
    if kind == "overlap":  # two names in the directory for one member's bytes
        d = _npz({"a.npy": _npy(), "b.npy": _npy()})
        cd = _central(d)
        second = d.find(b"PK\x01\x02", cd + 4)
        d[second + 42 : second + 46] = d[cd + 42 : cd + 46]  # b's local header offset := a's
        return d
    if kind == "short_local_header":  # the directory points at a local header magic with nothing after it
        d = _npz({"a.npy": _npy()})
        at = len(d)
        d += b"PK\x03\x04ab"
        cd = _central(d)
        d[cd + 42 : cd + 46] = at.to_bytes(4, "little")
        return d
    headers = {"header_tokens": b"{'descr': '<f8', 'fortran_order': False, 'shape': (4,",
               "header_type": b"{'descr': '<f8', 'fortran_order': False, 'shape': (True,), }",
               "negative_dim": b"{'descr': '<f8', 'fortran_order': False, 'shape': (-1,), }"}
    return _npz({"a.npy": _npy(header=headers[kind])})


HOSTILE = ["stored_size", "inflate_ratio", "overlap", "short_local_header", "header_tokens", "header_type", "negative_dim"]


@needs_libdeflate
@pytest.mark.parametrize("kind", HOSTILE)
def test_hostile_members_are_refused_before_anything_large_is_made(tmp_path, kind):
    """Each class is a ValueError naming the member (a one-line LogitdiffError naming the file
    through compact.load_chunk), with no allocation beyond the file's own size: a 2 GiB claim
    from a few hundred bytes, one stream named twice, a header numpy's parser chokes on."""
    import resource

    p = tmp_path / "h.npz"
    p.write_bytes(bytes(_hostile(kind)))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(ValueError, match="member"):
        npzinflate.load(p)
    with pytest.raises(LogitdiffError, match=f"{p}: unreadable compact chunk"):
        C.load_chunk(p)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 256 << 10  # KiB: under 256 MiB


@pytest.mark.parametrize("kind", ["header_tokens", "header_type", "short_local_header"])
def test_hostile_members_are_one_line_errors_on_the_np_load_path_too(tmp_path, monkeypatch, kind):
    """Without libdeflate (np.load reads the file): numpy's header parser raised
    tokenize.TokenError / TypeError, and zipfile struct errors, past load_chunk's net."""
    monkeypatch.setattr(npzinflate, "load", lambda path, threads=4, **k: None)
    p = tmp_path / "h.npz"
    p.write_bytes(bytes(_hostile(kind)))
    with pytest.raises(LogitdiffError, match=f"{p}: unreadable compact chunk"):
        C.load_chunk(p)


@needs_libdeflate
@pytest.mark.parametrize("method", [zipfile.ZIP_DEFLATED, zipfile.ZIP_STORED])
def test_a_header_not_padded_to_the_dtype_gives_aligned_arrays(tmp_path, method):
    """np.save pads the .npy header to 64 bytes; another writer may not. A header whose length
    leaves the data at an odd offset still reads as np.load reads it, into aligned memory (the
    compiled readers take raw pointers)."""
    arr = np.arange(12, dtype=np.float64).reshape(3, 4) / 7
    body = repr({"descr": "<f8", "fortran_order": False, "shape": (3, 4)}).encode().ljust(70) + b"\n"  # 10 + 71 = 81
    raw = b"\x93NUMPY\x01\x00" + len(body).to_bytes(2, "little") + body + arr.tobytes()
    p = tmp_path / "u.npz"
    p.write_bytes(bytes(_npz({"a.npy": raw, "b.npy": _npy(np.arange(5, dtype=np.int32))}, method)))
    got = npzinflate.load(p)
    assert got is not None and got["a"].flags.aligned and got["a"].dtype == np.float64
    np.testing.assert_array_equal(got["a"], np.load(p)["a"])
    np.testing.assert_array_equal(got["a"], arr)
    np.testing.assert_array_equal(got["b"], np.arange(5, dtype=np.int32))
