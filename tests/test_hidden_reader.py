"""What a hidden-state reader does besides the head product (storekinds/hidden.py,
hidden.py): the output head's sha256 is checked once per version of the file, not once per
reader -- and a head whose bytes changed in any way is still refused."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from logitdiff import hidden as Hs
from logitdiff.builtin import WORKLOAD
from logitdiff.capture import capture_reference
from logitdiff.errors import LogitdiffError
from logitdiff.sources import filecache as fc
from logitdiff.sources import open_source
from logitdiff.store import RunReader
from logitdiff.workload import read_workload


@pytest.fixture(scope="module")
def hid(tmp_path_factory):
    root = tmp_path_factory.mktemp("hidr")
    return capture_reference(open_source("builtin:tiny"), read_workload(WORKLOAD)[:2], root / "hid", store="hidden")


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
    r = RunReader(path)
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
