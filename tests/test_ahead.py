"""capture/ahead.py: a source's blocks made on a worker thread one step ahead of the caller.

What the live compare relies on: the same items in the same order; never more than
``depth`` finished items waiting (memory); the worker's exception raised in the caller; the
worker joined and the source's generator closed (its ``finally`` run on the worker) when
the caller stops early, so the source is never used from two threads at once; and the two
sides really overlap (the reason it exists)."""

from __future__ import annotations

import threading
import time

import pytest

from logitdiff.capture.ahead import ahead


def test_same_items_in_order():
    assert list(ahead(iter(range(1000)))) == list(range(1000))
    assert list(ahead([])) == []
    assert list(ahead(range(7), depth=3)) == list(range(7))


def test_depth_bounds_the_items_made_ahead():
    made = []
    held_at_take = []

    def source():
        for i in range(40):
            made.append(i)
            yield i

    for depth in (1, 2, 5):
        made.clear()
        held_at_take.clear()
        for i in ahead(source(), depth=depth):
            if i == 0:  # the caller is the slow side: let the worker run as far ahead as it may
                deadline = time.monotonic() + 10
                while len(made) < depth + 2 and time.monotonic() < deadline:
                    time.sleep(0.001)
                time.sleep(0.05)  # and a little longer: it must stop there
            held_at_take.append(len(made) - 1 - i)
        # made but not yet handed out: at most depth waiting in the queue + the one being made
        assert max(held_at_take) <= depth + 1
        assert held_at_take[0] == depth + 1  # and it does run that far ahead (not timing: it waited for it)


def test_exception_on_the_worker_is_raised_in_the_caller_after_the_items_before_it():
    def source():
        yield 1
        yield 2
        raise KeyError("bad row")

    got = []
    with pytest.raises(KeyError, match="bad row"):
        for x in ahead(source()):
            got.append(x)
    assert got == [1, 2]


def test_stopping_early_joins_the_worker_and_closes_the_source_on_it():
    closed_on = []
    state = {"in_use": 0, "overlap": False}

    def source():
        try:
            for i in range(10_000):
                state["in_use"] += 1
                time.sleep(0.001)
                state["in_use"] -= 1
                yield i
        finally:
            closed_on.append(threading.current_thread().name)

    gen = ahead(source(), name="test-ahead")
    for i in gen:
        if i == 3:
            break
    gen.close()
    assert closed_on == ["test-ahead"]  # the source's finally ran, on the worker, before close() returned
    assert not [t for t in threading.enumerate() if t.name == "test-ahead"]


def test_an_error_in_the_caller_also_joins_the_worker():
    def source():
        yield from range(100)

    with pytest.raises(ZeroDivisionError):
        for x in ahead(source(), name="test-ahead-2"):
            if x == 5:
                raise ZeroDivisionError("the caller failed")
    assert not [t for t in threading.enumerate() if t.name == "test-ahead-2"]


def test_an_interrupt_waits_for_the_item_in_the_making_then_closes_the_source():
    """Ctrl-C in the caller: the worker finishes the forward pass it is in, the source's
    generator is closed on it, and only then does the interrupt propagate (a model closed
    under a decode in flight would crash the process)."""
    events = []

    def source():
        try:
            for i in range(1000):
                events.append(("begin", i))
                time.sleep(0.01)
                events.append(("end", i))
                yield i
        finally:
            events.append(("closed", None))

    with pytest.raises(KeyboardInterrupt):
        for i in ahead(source(), name="test-ahead-3"):
            if i == 2:
                raise KeyboardInterrupt
    assert events[-1] == ("closed", None)
    begun = [i for kind, i in events if kind == "begin"]
    ended = [i for kind, i in events if kind == "end"]
    assert begun == ended  # no item was left half made
    assert not [t for t in threading.enumerate() if t.name == "test-ahead-3"]


def test_the_next_item_is_made_while_the_caller_holds_this_one():
    """The reason it exists: while the caller works on item i, the worker is already making
    item i + 1 (a decode beside the metrics). Checked by events, not by timing: the caller
    waits, holding item i, for the worker to start item i + 1; run one after the other, that
    never happens."""
    started = [threading.Event() for _ in range(6)]

    def source():
        for i in range(6):
            started[i].set()
            yield i

    for i in ahead(source()):
        if i + 1 < 6:
            assert started[i + 1].wait(timeout=10), f"item {i + 1} was not begun while the caller held item {i}"
    # and without it, nothing runs ahead (the check can fail)
    started = [threading.Event() for _ in range(6)]
    for i in source():
        if i + 1 < 6:
            assert not started[i + 1].is_set()


def test_depth_must_be_positive():
    with pytest.raises(ValueError):
        list(ahead([1], depth=0))


def test_a_small_process_wide_thread_stack_means_no_worker():
    """threading.stack_size() is process-wide; where something set it small (a test's hostile
    control once set 64 KiB, and a llama.cpp decode on such a worker crashed the suite), the
    items are made on the caller's thread: same items, no worker started."""
    before = threading.stack_size(64 << 10)
    try:
        names = []

        def source():
            for i in range(3):
                names.append(threading.current_thread().name)
                yield i

        assert list(ahead(source(), name="test-ahead-small")) == [0, 1, 2]
        assert names == [threading.current_thread().name] * 3
    finally:
        threading.stack_size(before)
    names.clear()
    assert list(ahead(source(), name="test-ahead-big")) == [0, 1, 2]
    assert names == ["test-ahead-big"] * 3

