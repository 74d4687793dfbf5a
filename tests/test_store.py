"""RUN files: round trips in every dtype, atomic chunks, resume, streaming reads, bad files."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from _runs import finish_resumed

from logitdiff.errors import LogitdiffError
from logitdiff.store import RunItem, RunReader, RunWriter, bf16_to_f32, f32_to_bf16


def _items(n_items=5, V=50, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n_items):
        T = int(rng.integers(1, 9))
        teacher = rng.integers(0, V, T).tolist()
        out.append((RunItem(id=f"i{i}", prompt_ids=[1, 2, i], teacher_ids=teacher, positions=list(range(T)), tags=["a" if i % 2 else "b"]),
                    rng.normal(0, 2, (T, V)).astype(np.float32)))
    return out


def _writer(path, V=50, **kw):
    return RunWriter(path, source={"spec": "test:x"}, vocab_size=V, tokenizer_hash="sha256:t", **kw)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
def test_full_round_trip(tmp_path, dtype):
    data = _items()
    w = _writer(tmp_path / "run", dtype=dtype, chunk_rows=7)
    for it, lg in data:
        w.add(it, logits=lg)
    w.finish()
    r = RunReader(tmp_path / "run")
    assert r.manifest["status"] == "complete"
    assert len(r.manifest["chunks"]) > 1  # several chunks were written
    got = r.items()
    assert [g.id for g in got] == [it.id for it, _ in data]
    for g, (it, lg) in zip(got, data):
        assert g.teacher_ids == it.teacher_ids and g.positions == it.positions and g.tags == it.tags
        back = np.asarray(r.logits(g), dtype=np.float64)
        if dtype == "bfloat16":
            np.testing.assert_array_equal(back, bf16_to_f32(f32_to_bf16(lg)))
        elif dtype == "float16":
            np.testing.assert_array_equal(back, lg.astype(np.float16))
        else:
            np.testing.assert_array_equal(back, lg)


def test_bf16_rounding_matches_torch():
    torch = pytest.importorskip("torch")
    x = np.random.default_rng(1).normal(0, 100, 10000).astype(np.float32)
    ours = bf16_to_f32(f32_to_bf16(x))
    theirs = torch.from_numpy(x).to(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(ours, theirs)


def test_full_logits_are_memory_mapped(tmp_path):
    w = _writer(tmp_path / "run")
    for it, lg in _items():
        w.add(it, logits=lg)
    w.finish()
    r = RunReader(tmp_path / "run")
    arr = r.logits(r.items()[0])
    assert isinstance(arr.base, np.memmap) or isinstance(arr, np.memmap)


def test_topk_round_trip(tmp_path):
    w = _writer(tmp_path / "run", store="topk:4")
    rng = np.random.default_rng(0)
    it = RunItem(id="a", prompt_ids=[1], teacher_ids=[3, 4], positions=[0, 1])
    tk = {"ids": rng.integers(0, 50, (2, 4)), "logprobs": -rng.random((2, 4)), "logsumexp": np.zeros(2), "tail_mass": np.ones(2) * 0.1, "entropy": np.ones(2)}
    w.add(it, stored=tk)
    w.finish()
    r = RunReader(tmp_path / "run")
    got = r.topk(r.items()[0])
    for k in tk:
        np.testing.assert_array_equal(got[k], tk[k])
    with pytest.raises(LogitdiffError, match="top-4"):
        r.logits(r.items()[0])


def test_partial_run_refused_then_resumed(tmp_path):
    data = _items(6)
    w = _writer(tmp_path / "run", chunk_rows=1)
    for it, lg in data[:3]:
        w.add(it, logits=lg)
    w.flush()
    # Not finished: marked partial.
    with pytest.raises(LogitdiffError, match="partial"):
        RunReader(tmp_path / "run")
    assert len(RunReader(tmp_path / "run", allow_partial=True).items()) == 3
    del w  # abandoned, never finished: a crash (a live writer would refuse a second one)
    w2 = _writer(tmp_path / "run", chunk_rows=1, resume=True)
    done = w2.done_ids()
    assert done == {"i0", "i1", "i2"}
    finish_resumed(w2, data)


def test_killed_writer_leaves_only_whole_chunks(tmp_path):
    """A real process killed mid-capture: what is on disk reads back and resumes."""
    code = textwrap.dedent(
        f"""
        import os, numpy as np
        from logitdiff.store import RunItem, RunWriter
        w = RunWriter({str(tmp_path / 'run')!r}, source={{'spec': 't'}}, vocab_size=50, tokenizer_hash='h', chunk_rows=1)
        rng = np.random.default_rng(0)
        for i in range(1000):
            w.add(RunItem(id=f'i{{i}}', prompt_ids=[1], teacher_ids=[2], positions=[0]), logits=rng.normal(size=(1, 50)).astype(np.float32))
            if i == 2:
                w.flush()  # chunks 0-2 durable; 3-4 go to the writer thread and race the kill
            if i == 4:
                os.kill(os.getpid(), 9)
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True)
    assert proc.returncode != 0
    r = RunReader(tmp_path / "run", allow_partial=True)
    assert r.is_partial
    ids = [it.id for it in r.items()]
    assert ids == [f"i{k}" for k in range(len(ids))] and 3 <= len(ids) <= 5
    for it in r.items():
        assert r.logits(it).shape == (1, 50)
    # A chunk being written by the writer thread when the kill came leaves at most its
    # temporary file, which no manifest lists; resuming removes it and completes the run.
    assert len([p for p in (tmp_path / "run" / "chunks").iterdir() if ".tmp" in p.name]) <= 1
    w = RunWriter(tmp_path / "run", source={"spec": "t"}, vocab_size=50, tokenizer_hash="h", chunk_rows=1, resume=True)
    have = w.done_ids()
    rng = np.random.default_rng(1)
    for i in range(len(have), 8):
        w.add(RunItem(id=f"i{i}", prompt_ids=[1], teacher_ids=[2], positions=[0]), logits=rng.normal(size=(1, 50)).astype(np.float32))
    w.finish()
    done = RunReader(tmp_path / "run")
    assert [it.id for it in done.items()] == [f"i{k}" for k in range(8)]
    assert not [p.name for p in (tmp_path / "run" / "chunks").iterdir() if ".tmp" in p.name]


def test_existing_run_not_overwritten(tmp_path):
    w = _writer(tmp_path / "run")
    w.finish()
    with pytest.raises(LogitdiffError, match="already holds a run"):
        _writer(tmp_path / "run")


def test_resume_refuses_other_tokenizer(tmp_path):
    _writer(tmp_path / "run").flush()
    with pytest.raises(LogitdiffError, match="tokenizer_hash"):
        RunWriter(tmp_path / "run", source={}, vocab_size=50, tokenizer_hash="other", resume=True)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nan_logits_refused_at_write(tmp_path, bad):
    w = _writer(tmp_path / "run")
    lg = np.zeros((3, 50), np.float32)
    lg[1, 7] = bad
    with pytest.raises(LogitdiffError, match="item 'x'.*position 1"):
        w.add(RunItem(id="x", prompt_ids=[], teacher_ids=[1, 2, 3], positions=[0, 1, 2]), logits=lg)


def test_truncated_chunk_detected(tmp_path):
    w = _writer(tmp_path / "run")
    for it, lg in _items():
        w.add(it, logits=lg)
    w.finish()
    chunk = next((tmp_path / "run" / "chunks").glob("*.npy"))
    data = chunk.read_bytes()
    chunk.write_bytes(data[: len(data) // 2])
    r = RunReader(tmp_path / "run")
    with pytest.raises(LogitdiffError, match="chunk"):
        r.logits(r.items()[0])


def test_foreign_directory(tmp_path):
    with pytest.raises(LogitdiffError, match="manifest.json"):
        RunReader(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"schema": "other/9"}))
    with pytest.raises(LogitdiffError, match="schema"):
        RunReader(tmp_path)


RESUME_AND_HOLD = textwrap.dedent(
    """
    import sys, numpy as np
    from logitdiff.store import RunItem, RunWriter
    w = RunWriter(sys.argv[1], source={'spec': 'test:x'}, vocab_size=50, tokenizer_hash='sha256:t', chunk_rows=1, resume=True)
    rng = np.random.default_rng(7)
    for i in range(len(w.done_ids()), 6):  # chunks of its own
        w.add(RunItem(id=f'i{i}', prompt_ids=[1], teacher_ids=[2], positions=[0]), logits=rng.normal(size=(1, 50)).astype(np.float32))
    w.flush()  # on disk and listed: the second writer below finds a still state
    print('held', flush=True)
    sys.stdin.readline()
    w.finish()
    """
)


def test_library_writers_of_one_run_are_one_at_a_time(tmp_path):
    """Two real processes open RunWriter(resume=True) on one partial RUN, as library callers
    (no CLI): the second is refused at once naming the first's pid and touches nothing (a
    second resume would remove the first's chunks not yet listed), the first finishes a
    complete run, and then the lock is free again. A constructor that fails lets go of it too."""
    from logitdiff.store.files import lock_path

    run = tmp_path / "run"
    w = _writer(run, chunk_rows=1)
    w.add(RunItem(id="i0", prompt_ids=[1], teacher_ids=[2], positions=[0]), logits=np.zeros((1, 50), np.float32))
    w.close()  # partial: one chunk listed; the lock let go
    assert not lock_path(run).exists()
    first = subprocess.Popen([sys.executable, "-c", RESUME_AND_HOLD, str(run)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert first.stdout.readline().strip() == "held"
        files = sorted(p.name for p in (run / "chunks").iterdir())
        for kw in ({"resume": True}, {"overwrite": True}):
            with pytest.raises(LogitdiffError, match=f"another logitdiff process \\(pid {first.pid}\\) is writing it"):
                _writer(run, chunk_rows=1, **kw)
            assert sorted(p.name for p in (run / "chunks").iterdir()) == files
    finally:
        first.stdin.write("\n")
        first.stdin.close()
    assert first.wait(timeout=120) == 0
    r = RunReader(run)
    assert [it.id for it in r.items()] == [f"i{k}" for k in range(6)] and r.manifest["status"] == "complete"
    assert not lock_path(run).exists()
    with pytest.raises(LogitdiffError, match="tokenizer_hash"):
        RunWriter(run, source={"spec": "test:x"}, vocab_size=50, tokenizer_hash="other", resume=True)
    probe = subprocess.run([sys.executable, "-c", "import sys; from logitdiff.store.files import locked\nwith locked(sys.argv[1]): pass",
                            str(run)], capture_output=True, text=True)
    assert probe.returncode == 0, probe.stderr  # the failed constructor holds nothing


def test_a_second_thread_is_refused_and_the_holding_thread_reenters(tmp_path):
    """In one process: another thread's writer of the same RUN is refused like another
    process's; the holding thread itself re-enters (outputs.writing holds the lock and the
    RunWriter it opens takes it again); after finish() the other thread may write."""
    import threading

    from logitdiff.store.files import locked

    run = tmp_path / "run"
    w = _writer(run)
    with locked(run):  # the holder takes it again: no error
        pass

    def other(kw, out):
        try:
            _writer(run, **kw).finish()
            out.append("ok")
        except LogitdiffError as e:
            out.append(str(e))

    got: list[str] = []
    t = threading.Thread(target=other, args=({"overwrite": True}, got))
    t.start()
    t.join()
    assert "another thread of this logitdiff process" in got[0], got
    w.finish()
    t = threading.Thread(target=other, args=({"overwrite": True}, got))
    t.start()
    t.join()
    assert got[1] == "ok" and RunReader(run).manifest["status"] == "complete"


def test_a_second_live_writer_in_the_holding_thread_is_refused_an_abandoned_one_is_not(tmp_path):
    """The RUN's lock is re-entrant per thread (outputs.writing's nested writer), so the
    thread holding a live RunWriter could open a second on the same RUN (both writing chunk
    files of the same indices, the second removing the first's unlisted ones): refused, for a
    fresh start, --overwrite and --resume alike, also on the path `writing` yields. A writer
    closed, finished, or abandoned without close (a crash: garbage, no longer referenced)
    blocks nothing: resume in the same process goes on."""
    import gc

    from logitdiff.store.files import Kind, writing

    run = tmp_path / "run"
    data = _items(4)
    w = _writer(run, chunk_rows=1)
    w.add(*data[0])
    w.flush()
    before = (run / "manifest.json").read_bytes()
    for kw in ({}, {"resume": True}, {"overwrite": True}, {"resume": True, "overwrite": True}):
        with pytest.raises(LogitdiffError, match=r"run: a RunWriter of this run is open in this thread; finish\(\) or close\(\) it"):
            _writer(run, chunk_rows=1, **kw)
        with pytest.raises(LogitdiffError, match="open in this thread"):  # the same RUN by another spelling
            _writer(tmp_path / "." / "run", chunk_rows=1, **kw)
    assert (run / "manifest.json").read_bytes() == before  # the refusals touched nothing
    w.add(*data[1])  # the first writer is unharmed
    w.flush()
    del w  # abandoned without close: a crash, as the resume tests simulate it
    gc.collect()
    w = _writer(run, chunk_rows=1, resume=True)
    assert w.done_ids() == {"i0", "i1"}
    w.close()  # closed: the next one is let in
    w = _writer(run, chunk_rows=1, resume=True)
    finish_resumed(w, data)
    assert [it.id for it in RunReader(run).items()] == ["i0", "i1", "i2", "i3"]
    # abandoned in a reference cycle: found by the collector, not counted either
    w = _writer(run, overwrite=True)
    w.cycle = w
    del w
    _writer(run, overwrite=True).finish()
    # the writer `writing` opens on the path it yields: one, then refused
    with writing(tmp_path / "new", Kind.RUN) as p:
        first = _writer(p)
        with pytest.raises(LogitdiffError, match="open in this thread"):
            _writer(p, overwrite=True)
        first.add(*data[0])
        first.finish()
    assert [it.id for it in RunReader(tmp_path / "new").items()] == ["i0"]


@pytest.mark.parametrize("store_text", ["full", "topk:4"])
def test_an_item_ending_on_a_chunk_boundary_writes_no_empty_chunk(tmp_path, store_text):
    """An item whose last rows fill a chunk is listed in that chunk (given whole, or in
    blocks whose last one fills it); before, the chunk closed at the rows and the item went
    into a chunk of its own with no rows. A RUN written that way (older versions) still reads
    back and resumes."""
    from logitdiff.store.kinds import store_kind

    rng = np.random.default_rng(3)
    data = [(RunItem(id=f"i{k}", prompt_ids=[1], teacher_ids=[1] * n, positions=list(range(n))),
             rng.normal(0, 2, (n, 50)).astype(np.float32)) for k, n in enumerate([4, 8, 2, 2, 4])]
    w = _writer(tmp_path / "run", chunk_rows=4, store=store_text)
    for k, (it, lg) in enumerate(data):
        if k % 2:  # in blocks of one row
            w.begin_item(it)
            for r in range(len(lg)):
                w.add_rows(lg[r : r + 1])
            w.end_item()
        else:
            w.add(it, logits=lg)
    w.finish()
    m = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert [(c["rows"], c["n_items"]) for c in m["chunks"]] == [(4, 1), (4, 0), (4, 1), (4, 2), (4, 1)]
    r = RunReader(tmp_path / "run")
    want = [(it.id, lg) for it, lg in data]
    assert [(it.id, it.chunk, it.row) for it in r.items()] == [("i0", 0, 0), ("i1", 1, 0), ("i2", 3, 0), ("i3", 3, 2), ("i4", 4, 0)]

    # the older layout: i0 listed in a chunk 1 of no rows after chunk 0 (the rest renumbered)
    old = tmp_path / "old"
    w = _writer(old, chunk_rows=4, store=store_text)
    w.add(*data[0])
    w.flush()
    w.close()
    m = json.loads((old / "manifest.json").read_text())
    c0 = m["chunks"][0]
    items0 = (old / "chunks" / c0["items"]).read_text()
    (old / "chunks" / c0["items"]).write_text("")
    (old / "chunks" / "000001.items.jsonl").write_text(items0.replace('"row": 0', '"row": 0, "chunk": 0'))
    kind = store_kind(store_text, 50, "float32")
    kind.save_chunk(old / "chunks" / f"000001.{kind.chunk_suffix}", [])
    m["chunks"] = [{**c0, "n_items": 0}, {"index": 1, "items": "000001.items.jsonl", "rows": 0, "n_items": 1,
                                          "data": f"000001.{kind.chunk_suffix}"}]
    (old / "manifest.json").write_text(json.dumps(m))
    part = RunReader(old, allow_partial=True)
    assert [(it.id, it.chunk, it.row) for it in part.items()] == [("i0", 0, 0)]
    w = _writer(old, chunk_rows=4, store=store_text, resume=True)
    assert w.done_ids() == {"i0"}
    for it, lg in data[1:]:
        w.add(it, logits=lg)
    w.finish()
    a, b = RunReader(tmp_path / "run"), RunReader(old)
    assert [it.id for it in b.items()] == [i for i, _ in want]
    for x, y in zip(a.items(), b.items()):
        if store_text == "full":
            np.testing.assert_array_equal(a.logits(x), b.logits(y))
        else:
            for k, v in a.topk(x).items():
                np.testing.assert_array_equal(v, b.topk(y)[k])


@pytest.mark.parametrize("how", ["reserved", "writing"])
@pytest.mark.parametrize("fails", [False, True])
def test_a_directory_another_writer_removed_on_letting_go_is_made_again(tmp_path, monkeypatch, how, fails):
    """Writer A fails and removes the empty directories it made for --out just after writer
    B found them there (B's _make_parents) and before B took the lock: B makes them again
    and writes (before: "cannot write there (No such file or directory)", a line about no
    fault of B's). When B fails in turn, what it made (again) is removed too, while it still
    holds the lock."""
    import logitdiff.store.files as outputs
    from logitdiff.store.files import Kind, reserved, writing

    out = tmp_path / "a" / "b" / "run"
    real = outputs._make_parents
    calls = []

    def a_lets_go_between(o):
        made = real(o)
        if not calls:  # A, letting go, removes the directories (empty) at this moment
            (tmp_path / "a" / "b").rmdir()
            (tmp_path / "a").rmdir()
        calls.append(o)
        return made

    monkeypatch.setattr(outputs, "_make_parents", a_lets_go_between)
    removed_holding = []
    real_remove = outputs._remove_empty

    def remove_empty(dirs):
        if dirs:  # B's own removal: still holding the lock, before a third writer may take it
            removed_holding.append(outputs.held_key(out) in outputs._HELD)
        real_remove(dirs)

    monkeypatch.setattr(outputs, "_remove_empty", remove_empty)

    def write():
        if how == "reserved":
            with reserved(out, Kind.RUN), writing(out, Kind.RUN) as p:
                w = _writer(p)
                if fails:
                    w.close()
                    raise KeyboardInterrupt
                w.finish()
        else:
            with writing(out, Kind.RUN) as p:
                w = _writer(p)
                if fails:
                    w.close()
                    raise KeyboardInterrupt
                w.finish()

    if fails:
        with pytest.raises(KeyboardInterrupt):
            write()
        assert sorted(os.listdir(tmp_path)) == []
        assert removed_holding == [True]
    else:
        write()
        assert RunReader(out).manifest["status"] == "complete"
        assert sorted(os.listdir(out.parent)) == ["run"]
    assert len(calls) >= 2  # made again


@pytest.mark.parametrize("n", [0, 1, 8191, 8192, 8193, 20_000])
def test_side_files_are_json_dumps_bytes_whatever_the_slicing(n):
    """vocab.json / tokens.json are encoded a slice at a time (the writer thread lets go of the GIL
    between slices); the bytes are those of one json.dumps of the whole list, at every boundary
    (empty, one item, a slice exactly, one past it) with escapes, non-ASCII, lone surrogates and
    None (a token with no string)."""
    import json

    from logitdiff.store import JSON_SLICE, json_list_bytes

    assert JSON_SLICE == 8192  # the boundaries above are around it
    pool = ['a', 'x"y', "tab\there", "é", "\u2028", "\\", "\ud800", None, "<|im_end|>", ""]
    items = [pool[i % len(pool)] + (str(i) if pool[i % len(pool)] is not None else "") if pool[i % len(pool)] is not None
             else None for i in range(n)]
    got = json_list_bytes(items)
    assert got == (json.dumps(items, indent=None, default=str) + "\n").encode()
    assert json.loads(got) == items
