"""A source's blocks made one step ahead, on a thread of their own.

A live comparison alternates two kinds of work: the source's forward pass for the next
block (llama.cpp's ``llama_decode`` or a torch forward: native code that releases the GIL)
and the metrics of the block in hand (numpy and the compiled kernel: native code too).
Run one after the other they add up; with the source's iterator advanced on a worker
thread while the caller computes, they overlap, so a forward pass that leaves cores idle
(``threads=1`` on a larger machine, a GPU) hides the metrics behind it. llama-perplexity
does the same with its KL worker threads.

Memory stays bounded: at most ``depth`` finished blocks wait in the queue, one is being
made and one is in the caller's hands. The source is used from the worker only, and the
worker is joined before :func:`ahead` returns (the caller stops early, raises, is
interrupted, or reaches the end), so the source is never used from two threads at once and
never closed under a forward pass in flight (on Ctrl-C the caller waits for that pass: an
in-process model's, seconds; served sources, which could hang, are never made ahead). An
exception on the worker is raised in the caller, where the block would have been.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")

_END = object()  # the worker's last message: the iterator is exhausted
# A model's forward pass needs a real thread stack (llama.cpp and torch crash on 64 KiB).
# threading.stack_size() is process-wide: where something set it below this, the items are
# made on the caller's thread instead (no worker, no overlap), never on a small stack.
MIN_STACK_BYTES = 4 << 20
_POLL_S = 0.2  # how often a blocked side looks at the stop flag (the caller stays interruptible)


class _Raised:
    def __init__(self, exc: BaseException):
        self.exc = exc


def ahead(blocks: Iterable[T], depth: int = 1, name: str = "logitdiff-ahead") -> Iterator[T]:
    """The items of ``blocks`` in order, each made on a worker thread while the caller uses
    the one before (at most ``depth`` waiting)."""
    if depth < 1:
        raise ValueError(f"depth {depth}: must be at least 1")
    if 0 < threading.stack_size() < MIN_STACK_BYTES:
        yield from blocks
        return
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(msg) -> bool:
        while not stop.is_set():
            try:
                q.put(msg, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def work() -> None:
        it = iter(blocks)
        try:
            while not stop.is_set():
                try:
                    item = next(it)
                except StopIteration:
                    put(_END)
                    return
                if not put(item):
                    return
                del item  # not held while the next is made
        except BaseException as e:  # noqa: BLE001 - handed to the caller, raised there
            put(_Raised(e))
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                close()  # the source's generator ends (its finally blocks run) on this thread

    worker = threading.Thread(target=work, name=name, daemon=True)
    worker.start()
    try:
        while True:
            try:
                msg = q.get(timeout=_POLL_S)
            except queue.Empty:
                if not worker.is_alive() and q.empty():
                    raise RuntimeError(f"{name}: the worker ended without a result") from None
                continue
            if msg is _END:
                return
            if isinstance(msg, _Raised):
                raise msg.exc
            yield msg
            del msg
    finally:
        stop.set()
        worker.join()
