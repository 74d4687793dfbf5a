"""Full chunks streamed to their files block by block, with O_DIRECT on a disk file system and
through the page cache on a memory one (tmpfs) or where a write refuses O_DIRECT; the header
page written last. Every path must give the same arrays (np.load, RunReader) as the rows
given; a failed or killed write leaves nothing a reader or a resume could take for a chunk;
chunks of the other kinds are fsynced once, by the syncer."""

import errno
import json
import mmap
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from _runs import finish_resumed

import logitdiff.store.files as outputs
from logitdiff.store import RunItem, RunReader, RunWriter
from logitdiff.store.kinds.rows import NPY_DATA_OFFSET, f32_to_bf16, npy_header_page

SRC = Path(__file__).resolve().parents[1] / "src"


def _odirect_works(where: Path) -> bool:
    """Whether the file system under ``where`` takes an aligned O_DIRECT write."""
    p = where / ".odirect-probe"
    try:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
        try:
            os.write(fd, mmap.mmap(-1, 4096))
        finally:
            os.close(fd)
        return True
    except OSError:
        return False
    finally:
        p.unlink(missing_ok=True)


@pytest.fixture
def modes(monkeypatch):
    """(file name, direct) of every DirectFile finished, in order."""
    seen: list[tuple[str, bool]] = []
    real = outputs.DirectFile.finish

    def finish(self):
        real(self)
        seen.append((self.path.name, self.direct))

    monkeypatch.setattr(outputs.DirectFile, "finish", finish)
    return seen


def _rows(rng, n: int, V: int, dtype: str) -> np.ndarray:
    x = rng.normal(0, 4, (n, V))
    if dtype == "bfloat16":
        return f32_to_bf16(x.astype(np.float32))
    return x.astype(dtype)


def _write(path, V, dtype, items, chunk_rows, block):
    w = RunWriter(path, source={"spec": "test:direct"}, vocab_size=V, tokenizer_hash="sha256:t", dtype=dtype,
                  chunk_rows=chunk_rows)
    for it, lg in items:
        w.begin_item(it)
        for a in range(0, len(lg), block):
            w.add_rows(lg[a : a + block])
        w.end_item()
    w.finish()


def _items(V, dtype, sizes, seed=0):
    rng = np.random.default_rng(seed)
    return [(RunItem(id=f"i{k}", prompt_ids=[1], teacher_ids=rng.integers(0, V, n).tolist(), positions=list(range(n))),
             _rows(rng, n, V, dtype)) for k, n in enumerate(sizes)]


def _check_run(path: Path, items, V: int, dtype: str) -> None:
    """RunReader gives the rows back bit for bit; every chunk file is a plain .npy whose rows
    start at NPY_DATA_OFFSET and whose size is exactly header + rows (the padding cut)."""
    r = RunReader(path)
    assert [g.id for g in r.items()] == [it.id for it, _ in items]
    for g, (_, lg) in zip(r.items(), items):
        got = r.logits(g)  # bf16 rows widened to float32 (exact): back to their bits
        np.testing.assert_array_equal(f32_to_bf16(got) if dtype == "bfloat16" else got, lg)
    allrows = np.concatenate([lg for _, lg in items])
    m = json.loads((path / "manifest.json").read_text())
    at = 0
    for c in m["chunks"]:
        f = path / "chunks" / c["data"]
        a = np.load(f)
        mm = np.load(f, mmap_mode="r")
        assert a.shape == (c["rows"], V) and mm.offset == NPY_DATA_OFFSET
        np.testing.assert_array_equal(a, allrows[at : at + c["rows"]])
        assert f.stat().st_size == NPY_DATA_OFFSET + a.nbytes
        at += c["rows"]
    assert at == len(allrows)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "float64"])
@pytest.mark.parametrize("stage", [4096, 3 * 4096, None])  # None: the default 16 MiB
@pytest.mark.parametrize("fs", ["disk", "tmpfs"])
def test_chunks_read_back_as_given_on_every_write_path(tmp_path, monkeypatch, modes, dtype, stage, fs):
    if fs == "tmpfs":
        if not Path("/dev/shm").is_dir():
            pytest.skip("no /dev/shm")
        import tempfile

        tmp_path = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="ld-direct-"))
    if stage is not None:
        monkeypatch.setattr(outputs, "DIRECT_STAGE_BYTES", stage)
    try:
        V = 1001  # a row is not a multiple of the page or of the staging buffer
        items = _items(V, dtype, [5, 1, 17, 9, 3])
        _write(tmp_path / "run", V, dtype, items, chunk_rows=12, block=4)
        _check_run(tmp_path / "run", items, V, dtype)
        files = [name for name, _ in modes]
        assert files == [f".{k:06d}.logits.npy.tmp{os.getpid()}" for k in range(len(files))] and len(files) >= 3
        want_direct = fs == "disk" and outputs.direct_io_pays(tmp_path) and _odirect_works(tmp_path)
        assert {d for _, d in modes} == {want_direct}
        assert not [p for p in (tmp_path / "run" / "chunks").iterdir() if p.name.startswith(".")]
    finally:
        if fs == "tmpfs":
            import shutil

            shutil.rmtree(tmp_path, ignore_errors=True)


def test_memory_file_systems_are_written_through_the_page_cache(tmp_path):
    if Path("/dev/shm").is_dir() and os.path.exists("/proc/self/mountinfo"):
        assert outputs.direct_io_pays("/dev/shm") is False
    if _odirect_works(tmp_path):  # a disk (ext4 here; CI's /tmp may be a tmpfs: then False is right)
        assert outputs.direct_io_pays(tmp_path) is outputs.direct_io_pays(Path(tmp_path).parent)


def test_a_write_the_file_system_refuses_goes_through_the_page_cache(tmp_path, modes):
    """A real refusal: O_DIRECT from memory that is not aligned (a staging buffer one byte into
    a page) fails with EINVAL on a disk file system; the writer clears O_DIRECT and writes the
    same bytes buffered, the rows as given."""
    if not _odirect_works(tmp_path):
        pytest.skip("no O_DIRECT under the test's temporary directory")
    raw = mmap.mmap(-1, 5 * 4096)
    stage = memoryview(raw)[1 : 1 + 4 * 4096]
    rng = np.random.default_rng(3)
    blocks = [rng.normal(0, 1, (n, 1001)).astype(np.float32) for n in (3, 7, 2)]
    with outputs.atomic_file_direct(tmp_path / "x.npy", stage) as f:
        assert f.direct
        f.write(bytes(NPY_DATA_OFFSET))
        for b in blocks:
            f.write(b.data)
        f.head = npy_header_page(12, 1001, "float32")
    assert modes == [(f".x.npy.tmp{os.getpid()}", False)]
    np.testing.assert_array_equal(np.load(tmp_path / "x.npy"), np.concatenate(blocks))


def test_a_head_write_refused_under_o_direct_goes_through_the_page_cache(tmp_path, monkeypatch):
    """Simulated (a file system that takes whole staging buffers under O_DIRECT but refuses a
    4 KiB write is not at hand): a file of exactly one staging buffer leaves nothing staged at
    finish, so the header page is the first small write; EINVAL there clears O_DIRECT."""
    if not _odirect_works(tmp_path):
        pytest.skip("no O_DIRECT under the test's temporary directory")
    stage = outputs.direct_stage(4 * 4096)
    real_pwrite = os.pwrite
    refused = []

    def pwrite(fd, data, offset):
        if not refused and os.O_DIRECT & fcntl_flags(fd):
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    rows = np.random.default_rng(5).normal(0, 1, (4 * 4096 - NPY_DATA_OFFSET) // 4).astype(np.float32)
    with outputs.atomic_file_direct(tmp_path / "x.npy", stage) as f:
        f.write(bytes(NPY_DATA_OFFSET))
        f.write(rows.data)  # fills the staging buffer exactly: written, nothing left staged
        f.head = npy_header_page(1, rows.size, "float32")
    assert refused == [0]
    np.testing.assert_array_equal(np.load(tmp_path / "x.npy"), rows[None, :])


def fcntl_flags(fd: int) -> int:
    import fcntl

    return fcntl.fcntl(fd, fcntl.F_GETFL)


def test_o_direct_refused_at_open_goes_through_the_page_cache(tmp_path, monkeypatch, modes):
    """Simulated (no file system of this kernel refuses O_DIRECT at open: tmpfs accepts it
    since Linux 6.6): open(O_DIRECT) failing with EINVAL, as on older tmpfs or some FUSE."""
    real_open = os.open

    def refusing_open(path, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a)

    monkeypatch.setattr(os, "open", refusing_open)
    V = 333
    items = _items(V, "float32", [4, 6])
    _write(tmp_path / "run", V, "float32", items, chunk_rows=5, block=3)
    monkeypatch.setattr(os, "open", real_open)
    _check_run(tmp_path / "run", items, V, "float32")
    assert modes and {d for _, d in modes} == {False}


KILLED_WRITER = textwrap.dedent("""
    import sys, numpy as np
    import logitdiff.store.files as outputs
    from logitdiff.store import RunItem, RunWriter
    outputs.DIRECT_STAGE_BYTES = 4096  # rows reach the file as they come, not at the chunk's end
    V, path = int(sys.argv[1]), sys.argv[2]
    w = RunWriter(path, source={"spec": "test:direct"}, vocab_size=V, tokenizer_hash="sha256:t", chunk_rows=10)
    rng = np.random.default_rng(7)
    for k in range(3):  # chunk 0: i0, i1 (16 rows, lists both); chunk 1: i2 and i3's first row, open
        w.begin_item(RunItem(id=f"i{k}", prompt_ids=[1], teacher_ids=[1] * 8, positions=list(range(8))))
        w.add_rows(rng.normal(0, 1, (8, V)).astype(np.float32))
        w.end_item()
    w.begin_item(RunItem(id="i3", prompt_ids=[1], teacher_ids=[1] * 5, positions=list(range(5))))
    w.add_rows(rng.normal(0, 1, (1, V)).astype(np.float32))
    w._drain_writes()
    w._drain_syncs()
    print("ready", flush=True)
    sys.stdin.read()  # killed here, mid-chunk
""")


def test_a_capture_killed_mid_chunk_resumes_cleanly(tmp_path):
    """SIGKILL while a chunk's file is open with rows in it (a real process, a real kill):
    the manifest lists only whole chunks, and a resume removes the half-written temporary and
    continues from the listed items, reading back as if never killed."""
    V = 777
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    p = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(V), str(run)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, env=env)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == b"ready"
        temps = [f for f in (run / "chunks").iterdir() if f.name.startswith(".")]
        assert len(temps) == 1 and temps[0].name.startswith(".000001.logits.npy.tmp")
        assert temps[0].stat().st_size >= NPY_DATA_OFFSET + 8 * V * 4 - 4096  # rows in it, no header yet
        os.kill(p.pid, signal.SIGKILL)
    finally:
        p.wait(30)
    m = json.loads((run / "manifest.json").read_text())
    assert m["status"] == "partial" and [c["index"] for c in m["chunks"]] == [0]
    rng = np.random.default_rng(7)
    data = [(RunItem(id=f"i{k}", prompt_ids=[1], teacher_ids=[1] * 8, positions=list(range(8))),
             rng.normal(0, 1, (8, V)).astype(np.float32)) for k in range(3)]
    w = RunWriter(run, source={"spec": "test:direct"}, vocab_size=V, tokenizer_hash="sha256:t", chunk_rows=10, resume=True)
    assert sorted(f.name for f in (run / "chunks").iterdir()) == ["000000.items.jsonl", "000000.logits.npy"]
    assert w.done_ids() == {"i0", "i1"}  # i2 ends in chunk 1, never listed
    finish_resumed(w, data)


@pytest.mark.parametrize("store_text", ["topk:4", "full"])
def test_chunk_files_are_fsynced_once_by_name(tmp_path, monkeypatch, store_text):
    """The syncer's fsync (by the chunk's final name) orders the manifest; the writer fsyncs no
    chunk file (before, topk/compact/hidden chunks were fsynced twice: once as temporaries)."""
    synced: list[str] = []
    real = os.fsync

    def fsync(fd):
        synced.append(os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))
        return real(fd)

    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("no /proc/self/fd")
    monkeypatch.setattr(os, "fsync", fsync)
    V = 50
    items = _items(V, "float32", [3, 4, 5, 2])
    w = RunWriter(tmp_path / "run", source={"spec": "test:direct"}, vocab_size=V, tokenizer_hash="sha256:t",
                  store=store_text, chunk_rows=4)
    for it, lg in items:
        w.add(it, logits=lg)
    w.finish()
    m = json.loads((tmp_path / "run" / "manifest.json").read_text())
    for c in m["chunks"]:
        assert synced.count(c["data"]) == 1 and synced.count(c["items"]) == 1, (c, synced)
    assert not [s for s in synced if ".tmp" in s and ("topk" in s or "logits" in s or "items" in s)], synced
    assert len(m["chunks"]) >= 3


def test_a_writer_closed_mid_chunk_leaves_no_temporary(tmp_path):
    """A capture that fails between blocks closes its writer (capture._close_quietly): the
    chunk being filled, its rows already in a temporary file, is removed; listed chunks stay."""
    V = 300
    items = _items(V, "float32", [6, 5])
    w = RunWriter(tmp_path / "run", source={"spec": "test:direct"}, vocab_size=V, tokenizer_hash="sha256:t", chunk_rows=4)
    w.add(*items[0])  # chunk 0 closed (6 rows)
    w.begin_item(items[1][0])
    w.add_rows(items[1][1][:3])  # chunk 1 open, 3 rows in its file
    w._drain_writes()
    assert [p.name for p in (tmp_path / "run" / "chunks").iterdir() if p.name.startswith(".000001.logits.npy.tmp")]
    w.close()
    assert sorted(p.name for p in (tmp_path / "run" / "chunks").iterdir()) == ["000000.items.jsonl", "000000.logits.npy"]
    assert [c["index"] for c in json.loads((tmp_path / "run" / "manifest.json").read_text())["chunks"]] == [0]


@pytest.mark.parametrize("end", ["finish", "close"])
def test_the_staging_buffer_is_freed_when_the_writer_is_done(tmp_path, monkeypatch, end):
    """The 16 MiB O_DIRECT staging buffer goes at finish() or close(), not when the writer
    object does (a caller keeping the RunWriter kept 16 MiB): no reference to it is left
    once the writer is done, while the writer itself still lives."""
    import gc
    import weakref

    import logitdiff.store.kinds.full as full

    made = []
    real = full.direct_stage

    def stage(*a, **k):
        buf = real(*a, **k)
        made.append(weakref.ref(buf))
        return buf

    monkeypatch.setattr(full, "direct_stage", stage)
    monkeypatch.setattr(full, "direct_io_pays", lambda where: True)  # a tmpfs /tmp too: the buffer is made
    rng = np.random.default_rng(3)
    w = RunWriter(tmp_path / "run", source={"spec": "test:direct"}, vocab_size=300, tokenizer_hash="sha256:t", chunk_rows=8)
    for k in range(3):
        w.add(RunItem(id=f"i{k}", prompt_ids=[1], teacher_ids=[1] * 6, positions=list(range(6))),
              logits=rng.normal(0, 1, (6, 300)).astype(np.float32))
    w.flush()
    gc.collect()
    assert len(made) == 1 and made[0]() is not None  # one buffer, reused across the chunks
    getattr(w, end)()
    gc.collect()
    assert made[0]() is None, gc.get_referrers(made[0]())
    assert len(RunReader(tmp_path / "run", allow_partial=True).items()) == 3


def _anon_huge_bytes(address: int) -> int | None:
    """AnonHugePages of the mapping holding ``address`` (/proc/self/smaps), None without it."""
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return None
    inside = False
    for line in lines:
        head = line.split(maxsplit=1)[0] if line.strip() else ""
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1]) * 1024
    return None


def _thp_mode() -> str | None:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    return text.split("[", 1)[1].split("]", 1)[0] if "[" in text else None


def _direct_round_trip(where: Path, stage) -> None:
    """Rows written through ``stage`` (O_DIRECT where the file system takes it) read back as given."""
    rows = np.random.default_rng(11).normal(0, 1, (9, 300_001)).astype(np.float32)  # 10.8 MB, not page-sized
    with outputs.atomic_file_direct(where / "x.npy", stage) as f:
        f.write(bytes(NPY_DATA_OFFSET))
        f.write(rows.data)
        f.head = npy_header_page(*rows.shape, "float32")
    np.testing.assert_array_equal(np.load(where / "x.npy"), rows)


def test_the_staging_buffer_lies_on_transparent_huge_pages(tmp_path):
    """The default staging buffer starts on a huge-page boundary and, where THP is "always" or
    "madvise", is backed by huge pages once touched (before: an ordinary shared mapping, on
    4 KiB pages whatever THP said); O_DIRECT writes from it read back as given."""
    stage = outputs.direct_stage()
    view = np.frombuffer(stage, np.uint8)
    assert len(view) == outputs.DIRECT_STAGE_BYTES and view.ctypes.data % outputs.HUGE_PAGE == 0
    view[:] = 7  # faulted in, as the writer's first chunk does
    mode = _thp_mode()
    if mode not in ("always", "madvise") or not hasattr(mmap, "MADV_HUGEPAGE"):
        pytest.skip(f"transparent huge pages {mode or 'not available'} here")
    huge = _anon_huge_bytes(view.ctypes.data)
    if huge is None:
        pytest.skip("no /proc/self/smaps")
    assert huge >= outputs.HUGE_PAGE, huge
    _direct_round_trip(tmp_path, stage)


@pytest.mark.parametrize("how", ["no MADV_HUGEPAGE", "advice refused"])
def test_a_staging_buffer_without_huge_pages_still_writes(tmp_path, monkeypatch, how):
    """No huge pages: the platform lacks the advice (the buffer is an ordinary mapping) or the
    kernel refuses it (a real EINVAL, from an advice value it does not know); the buffer is the
    size asked, page-aligned, and O_DIRECT writes from it read back as given."""
    if how == "no MADV_HUGEPAGE":
        monkeypatch.delattr(mmap, "MADV_HUGEPAGE", raising=False)
    else:
        monkeypatch.setattr(mmap, "MADV_HUGEPAGE", 0x7FFF, raising=False)
    stage = outputs.direct_stage(4 << 20)
    view = np.frombuffer(stage, np.uint8)
    assert len(view) == 4 << 20 and view.ctypes.data % outputs.DIRECT_ALIGN == 0
    _direct_round_trip(tmp_path, stage)


def test_a_direct_write_failing_mid_file_is_one_line_and_leaves_nothing(tmp_path):
    """A real failure of an O_DIRECT write of a full staging buffer (RLIMIT_FSIZE: EFBIG, as a
    full disk gives ENOSPC) reaches the caller as one line naming the file; the temporary is
    removed, and the same staging buffer then writes the next file whole."""
    if not _odirect_works(tmp_path):
        pytest.skip("no O_DIRECT under the test's temporary directory")
    from test_store_sync import file_size_limit

    from logitdiff.errors import LogitdiffError

    stage = outputs.direct_stage(4 * 4096)
    data = np.random.default_rng(12).integers(0, 255, 9 * 4096, dtype=np.uint8)
    with file_size_limit(3 * 4096), pytest.raises(LogitdiffError, match=r"x\.bin: cannot write \(File too large\)"):
        with outputs.atomic_file_direct(tmp_path / "x.bin", stage) as f:
            for at in range(0, len(data), 1000):
                f.write(data[at : at + 1000])
    assert list(tmp_path.iterdir()) == []
    with outputs.atomic_file_direct(tmp_path / "y.bin", stage) as f:
        f.write(data)
    assert (tmp_path / "y.bin").read_bytes() == data.tobytes()
