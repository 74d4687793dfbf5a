"""RunWriter's durability order: chunk files are written by the writer thread without a
blocking fsync; the syncer fsyncs them and only then lists the chunk in the manifest (at most
``SYNC_LAG`` chunks behind); a failed chunk stops the listing; resume removes what was
written but never listed."""

import json
import resource
import signal
import threading
import time
from contextlib import contextmanager

import numpy as np
import pytest
from _runs import finish_resumed

import logitdiff.store as store
from logitdiff.errors import LogitdiffError
from logitdiff.store import SYNC_LAG, RunItem, RunReader, RunWriter

V = 64


def _item(i: int, n: int = 3) -> tuple[RunItem, np.ndarray]:
    rng = np.random.default_rng(i)
    return (RunItem(id=f"i{i}", prompt_ids=[1, 2], teacher_ids=rng.integers(0, V, n).tolist(), positions=list(range(n))),
            rng.normal(0, 3, (n, V)).astype(np.float32))


def _writer(path, chunk_rows=3, **kw) -> RunWriter:
    return RunWriter(path, source={"spec": "test:sync"}, vocab_size=V, tokenizer_hash="sha256:t", chunk_rows=chunk_rows,
                     vocab=[f"t{k}" for k in range(V)], tokens=[f"t{k}" for k in range(V)], **kw)


@pytest.mark.parametrize("store_text", ["full", "topk:5"])
def test_manifest_lists_a_chunk_only_after_its_files_are_fsynced(tmp_path, monkeypatch, store_text):
    events: list[tuple] = []
    real_fsync, real_manifest = store.fsync_path, RunWriter._write_manifest

    def fsync_path(path):
        real_fsync(path)
        events.append(("fsync", path.name))

    def write_manifest(self):
        events.append(("manifest", [c["index"] for c in self.manifest["chunks"]]))
        real_manifest(self)

    monkeypatch.setattr(store, "fsync_path", fsync_path)
    monkeypatch.setattr(RunWriter, "_write_manifest", write_manifest)
    w = _writer(tmp_path / "run", store=store_text)
    data = [_item(i) for i in range(7)]
    for it, lg in data:
        w.add(it, logits=lg)
    w.finish()
    listed: set[int] = set()
    synced: set[str] = set()
    for kind, what in events:
        if kind == "fsync":
            synced.add(what)
            continue
        for k in set(what) - listed:  # a chunk listed for the first time: its two files fsynced before,
            entry = json.loads((tmp_path / "run" / "manifest.json").read_text())["chunks"][k]
            assert {entry["data"], entry["items"], "chunks"} <= synced, (k, sorted(synced))  # and the renames naming them
        synced.discard("chunks")  # the directory again for the next chunk
        assert what == list(range(len(what))) and listed <= set(what)  # 0, 1, ... in order, none dropped
        listed = set(what)
    assert listed == set(range(len(json.loads((tmp_path / "run" / "manifest.json").read_text())["chunks"]))) and len(listed) >= 7
    r = RunReader(tmp_path / "run")
    assert [it.id for it in r.items()] == [f"i{k}" for k in range(7)]
    assert r.vocab() == [f"t{k}" for k in range(V)] and r.tokens() == [f"t{k}" for k in range(V)]
    if store_text == "full":
        for it, (_, lg) in zip(r.items(), data):
            np.testing.assert_array_equal(r.logits(it), lg)


def test_syncer_lag_is_bounded(tmp_path, monkeypatch):
    """With the disk stuck (fsync blocked), the producer stops after SYNC_LAG written chunks
    plus the one the writer holds; released, everything is listed."""
    gate = threading.Event()
    real_fsync = store.fsync_path

    def fsync_path(path):
        gate.wait(30)
        real_fsync(path)

    monkeypatch.setattr(store, "fsync_path", fsync_path)
    w = _writer(tmp_path / "run")
    n = SYNC_LAG + 4
    done = threading.Event()

    def produce():
        for i in range(n):
            w.add(*_item(i))  # one chunk per item (chunk_rows=3)
        done.set()

    t = threading.Thread(target=produce)
    t.start()
    time.sleep(1.0)
    written = [p for p in (tmp_path / "run" / "chunks").glob("*.logits.npy")]
    assert not done.is_set()
    assert len(written) <= SYNC_LAG + 1
    assert json.loads((tmp_path / "run" / "manifest.json").read_text())["chunks"] == []
    gate.set()
    t.join(30)
    assert done.is_set()
    w.finish()
    assert [it.id for it in RunReader(tmp_path / "run").items()] == [f"i{k}" for k in range(n)]


@contextmanager
def file_size_limit(nbytes: int):
    """A real write failure: RLIMIT_FSIZE makes any write past ``nbytes`` of a file fail with
    EFBIG (SIGXFSZ ignored), as a full disk fails a write with ENOSPC."""
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, old[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old)
        signal.signal(signal.SIGXFSZ, old_handler)


@pytest.mark.parametrize("store_text", ["full", "topk:5"])
def test_failed_chunk_stops_listing_then_resume_clears_unlisted(tmp_path, store_text):
    # chunk 0: the rows of i0 and i1 (6 rows, ~5.6 KB full, ~2 KB top-K), both end there;
    # chunk 1: the 60 rows of i2 (~15 KB full, ~5 KB top-K): past the limit
    data = [_item(0), _item(1), _item(2, 60), _item(3), _item(4)]
    limit = 8192 if store_text == "full" else 4096
    w = _writer(tmp_path / "run", chunk_rows=4, store=store_text)
    with file_size_limit(limit), pytest.raises(LogitdiffError, match=r"000001\.[a-z.]+: cannot write \(File too large\)|earlier"):
        for it, lg in data:
            w.add(it, logits=lg)
        w.finish()
    try:
        w.close()
    except LogitdiffError:
        pass
    m = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert m["status"] == "partial" and [c["index"] for c in m["chunks"]] == [0]
    # the failed chunk's temporary is gone and nothing after it was written
    suffix = m["chunks"][0]["data"].split(".", 1)[1]
    assert sorted(p.name for p in (tmp_path / "run" / "chunks").iterdir()) == ["000000.items.jsonl", f"000000.{suffix}"]
    again = _writer(tmp_path / "run", chunk_rows=4, resume=True, store=store_text)
    assert again.done_ids() == {"i0", "i1"}
    if store_text == "full":
        finish_resumed(again, data)
    else:
        again.finish()
        assert [it.id for it in RunReader(tmp_path / "run").items()] == ["i0", "i1"]


def test_writer_queue_is_bounded_by_chunk_bytes_and_forgets_done_tasks(tmp_path):
    """With the writer thread held, the producer queues blocks up to chunk_bytes and then
    waits (memory bounded by a chunk, whatever the block size); released, finished tasks are
    dropped from the queue as the producer goes on (no queue growing with the output)."""
    row = V * 4
    w = _writer(tmp_path / "run", chunk_rows=10**6, chunk_bytes=8 * row)
    gate = threading.Event()
    w._send(0, gate.wait, 30)  # the writer thread is busy until the gate opens
    it, lg = _item(0, 40)
    w.begin_item(it)
    sent = threading.Event()
    progress: list[int] = []

    def produce():
        for r in range(39):  # one-row blocks
            w.add_rows(lg[r : r + 1])
            progress.append(r)
        sent.set()

    t = threading.Thread(target=produce)
    t.start()
    time.sleep(0.5)
    assert not sent.is_set() and len(progress) == 8  # 8 rows of bytes queued, the 9th waits
    assert w._queued == 8 * row
    gate.set()
    t.join(30)
    assert sent.is_set()
    w._pending[-1][0].result()
    w.add_rows(lg[39:])  # within the item: the 39 tasks done are forgotten here
    assert len(w._pending) == 1 and w._queued == row
    w.end_item()
    w.add(*_item(1, 1))
    w.finish()
    assert [x.id for x in RunReader(tmp_path / "run").items()] == ["i0", "i1"]
    np.testing.assert_array_equal(RunReader(tmp_path / "run").logits(RunReader(tmp_path / "run").items()[0]), lg)


# --------------------------------------------------------------------------------------
# resume drops the rows of the item a kill interrupted
# --------------------------------------------------------------------------------------

ORPHAN_STORES = ["full", "topk:5", "compact:exact=8,band=8", "hidden"]


def _orphan_case(store_text):
    """The writer's keyword arguments for the kind, and items i0 (6 rows), i1 (12), i2 (5)
    with their rows as add_rows keyword arguments (the hidden store: bf16 logits that are a
    random head's output, with their hidden states)."""
    if store_text != "hidden":
        return {"store": store_text}, [(it, {"logits": lg}) for it, lg in (_item(0, 6), _item(1, 12), _item(2, 5))]
    from logitdiff.store import hidden as Hs

    rng = np.random.default_rng(5)
    head = Hs.round_bits(rng.normal(0, 1, (V, 16)))
    data = []
    for k, n in enumerate((6, 12, 5)):
        h = Hs.round_bits(rng.normal(0, 1, (n, 16)))
        data.append((_item(k, n)[0], {"logits": Hs.round_bits(Hs._bits_to_f64(h) @ Hs._bits_to_f64(head).T), "hidden": h}))
    return {"store": "hidden", "dtype": "bfloat16", "head": head}, data


def _write_until_killed_mid_item(run, kw, data) -> None:
    """i0 (6 rows) ends in chunk 1; i1 (12 rows) then fills the rest of chunk 1 and chunks
    2-4 before the kill: 5 chunks listed, i1 in none (chunk_rows 4, blocks of one row)."""
    w = _writer(run, chunk_rows=4, **kw)
    for it, rows in data[:2]:
        w.begin_item(it)
        for r in range(len(it.positions) if it.id == "i0" else 11):
            w.add_rows(**{k: v[r : r + 1] for k, v in rows.items()})
        if it.id == "i0":
            w.end_item()
    w.flush()  # chunks 0-4 durable and listed, i1 unfinished
    m = json.loads((run / "manifest.json").read_text())
    assert [c["rows"] for c in m["chunks"]] == [4, 4, 4, 4, 1] and m["n_items"] == 1
    del w  # killed


def _rows_of(r: RunReader) -> list:
    out = []
    for b in r.row_blocks(r.items(), 1000):
        out.extend(sorted(b.items()) if isinstance(b, dict) else [("rows", b)])
    return out


def _assert_only_listed_rows(run) -> None:
    """Every row of every listed chunk belongs to a listed item; no file in chunks/ is unlisted."""
    m = json.loads((run / "manifest.json").read_text())
    assert sum(c["rows"] for c in m["chunks"]) == m["n_positions"]
    names = {c[k] for c in m["chunks"] for k in ("items", "data")}
    assert sorted(p.name for p in (run / "chunks").iterdir()) == sorted(names)


@pytest.mark.parametrize("store_text", ORPHAN_STORES)
def test_resume_drops_the_rows_of_the_killed_item(tmp_path, store_text):
    """A kill in the middle of a long item left its first rows in listed chunks no item
    lists (a chunk's worth or more per kill). Resume drops the chunks holding only those and
    cuts the one they start in; the finished run holds only listed rows, read back as a run
    written without the kill, for every store kind."""
    kw, data = _orphan_case(store_text)
    clean = _writer(tmp_path / "clean", chunk_rows=4, **kw)
    for it, rows in data:
        clean.add(it, **rows)
    clean.finish()
    run = tmp_path / "run"
    _write_until_killed_mid_item(run, kw, data)
    w = _writer(run, chunk_rows=4, resume=True, **kw)
    m = json.loads((run / "manifest.json").read_text())
    assert [c["rows"] for c in m["chunks"]] == [4, 2] and m["chunks"][1]["data"].startswith("000001.cut2.")
    _assert_only_listed_rows(run)
    part = RunReader(run, allow_partial=True)
    assert [it.id for it in part.items()] == ["i0"]
    assert w.done_ids() == {"i0"}
    for it, rows in data[1:]:
        w.add(it, **rows)
    w.finish()
    _assert_only_listed_rows(run)
    a, b = RunReader(tmp_path / "clean"), RunReader(run)
    assert [it.id for it in b.items()] == ["i0", "i1", "i2"]
    for (ka, xa), (kb, xb) in zip(_rows_of(a), _rows_of(b), strict=True):
        assert ka == kb
        np.testing.assert_array_equal(xa, xb)


class _Crash(BaseException):
    pass


@pytest.mark.parametrize("crash_at", ["save", "fsync", "manifest", "unlink"])
def test_a_crash_while_dropping_orphan_rows_loses_no_listed_row(tmp_path, monkeypatch, crash_at):
    """The cleanup killed at each of its steps (writing the cut copy, making it durable,
    listing it, removing what is no longer listed): the run still reads back every listed
    item whole, and the next resume finishes the cleanup and the run."""
    kw, pairs = _orphan_case("full")
    data = [(it, rows["logits"]) for it, rows in pairs]
    run = tmp_path / "run"
    _write_until_killed_mid_item(run, kw, pairs)
    calls = {"n": 0}

    def crash(real, *args, **kw):
        # unlink: once the manifest lists the cut chunk (before, atomic writes unlink temporaries)
        if crash_at == "unlink" and len(json.loads((run / "manifest.json").read_text())["chunks"]) != 2:
            return real(*args, **kw)
        calls["n"] += 1
        raise _Crash()

    from logitdiff.store.kinds.full import FullStore

    target = {"save": (FullStore, "save_chunk"), "fsync": (store, "fsync_path"),
              "manifest": (RunWriter, "_write_manifest"), "unlink": (type(run), "unlink")}[crash_at]
    real = getattr(*target)
    monkeypatch.setattr(*target, lambda *a, **k: crash(real, *a, **k))
    with pytest.raises(_Crash):
        _writer(run, chunk_rows=4, resume=True)
    monkeypatch.undo()
    assert calls["n"] == 1
    part = RunReader(run, allow_partial=True)
    assert [it.id for it in part.items()] == ["i0"]
    np.testing.assert_array_equal(part.logits(part.items()[0]), data[0][1])
    w = _writer(run, chunk_rows=4, resume=True)  # the lock was let go; the cleanup completes
    _assert_only_listed_rows(run)
    finish_resumed(w, data)
    _assert_only_listed_rows(run)


@pytest.mark.parametrize("store_text", ORPHAN_STORES)
def test_resume_cuts_a_chunk_to_no_rows_when_a_zero_position_item_ends_its_listing(tmp_path, store_text):
    """The last listed chunk's listed items cover none of its rows (a zero-position item
    listed there, then rows of the killed item): the cut keeps no row. The full store's
    empty block was a TypeError on every resume (found by review); now every kind resumes
    to a run read back as one written without the kill."""
    kw, data = _orphan_case(store_text)
    (i0, r0), (i1, r1) = data[0], data[1]
    z = RunItem(id="z", prompt_ids=[1], teacher_ids=[5], positions=[])
    first = {k: v[:4] for k, v in r0.items()}
    it0 = RunItem(id=i0.id, prompt_ids=i0.prompt_ids, teacher_ids=i0.teacher_ids[:4], positions=i0.positions[:4])
    clean = _writer(tmp_path / "clean", chunk_rows=4, **kw)
    clean.add(it0, **first)
    clean.begin_item(z)
    clean.end_item()
    clean.add(i1, **r1)
    clean.finish()
    run = tmp_path / "run"
    w = _writer(run, chunk_rows=4, **kw)
    w.add(it0, **first)  # fills chunk 0, which lists it
    w.begin_item(z)
    w.end_item()
    w.begin_item(i1)
    w.add_rows(**{k: v[:5] for k, v in r1.items()})
    w.flush()  # chunk 1 (z, then 4 of i1's rows) listed; i1 unfinished
    m = json.loads((run / "manifest.json").read_text())
    assert [(c["rows"] > 0, c["n_items"]) for c in m["chunks"]] == [(True, 1), (True, 1)]
    del w  # killed
    w = _writer(run, chunk_rows=4, resume=True, **kw)
    m = json.loads((run / "manifest.json").read_text())
    assert [c["rows"] for c in m["chunks"]] == [4, 0] and m["chunks"][1]["data"].startswith("000001.cut0.")
    _assert_only_listed_rows(run)
    assert w.done_ids() == {i0.id, "z"}
    w.add(i1, **r1)
    w.finish()
    _assert_only_listed_rows(run)
    a, b = RunReader(tmp_path / "clean"), RunReader(run)
    assert [it.id for it in b.items()] == [i0.id, "z", i1.id]
    for (ka, xa), (kb, xb) in zip(_rows_of(a), _rows_of(b), strict=True):
        assert ka == kb
        np.testing.assert_array_equal(xa, xb)
