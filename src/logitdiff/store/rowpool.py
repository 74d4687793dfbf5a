"""Page-aligned row buffers that are used again once every view of them is gone.

A transformers source on the CPU writes each block of the output head's 16-bit rows into one
of these (``torch.mm(..., out=)``) instead of a fresh tensor, for two reasons (issue 24):

* a fresh ~33 MB tensor per block at V = 248,320 is mapped, faulted and zeroed by the kernel
  every time (glibc returns blocks that large to the system); a buffer used again is not;
* the buffer starts on a page (a huge page where THP allows, ``outputs.direct_stage``), so
  the full store's O_DIRECT writer can hand the rows to the device from where the head wrote
  them, without the staging copy (``outputs.DirectFile.write``).

A buffer goes back to the pool when the last array viewing it is collected (a
``weakref.finalize`` on the array handed out; the writer thread usually drops it once the
rows are on the disk). A caller that keeps its rows keeps its buffer: the pool then makes
another. At most ``keep`` free buffers are held; more are let go. Memory: the blocks in
flight (the writer's queue is bounded by a chunk) plus ``keep`` idle ones."""

from __future__ import annotations

import threading
import weakref

import numpy as np


class RowPool:
    """Buffers of ``rows`` x ``cols`` values of ``dtype`` (C order), page-aligned."""

    def __init__(self, rows: int, cols: int, dtype=np.uint16, keep: int = 4):
        self.rows, self.cols, self.dtype, self.keep = int(rows), int(cols), np.dtype(dtype), int(keep)
        self._free: list = []
        self._lock = threading.Lock()

    def take(self, n: int) -> np.ndarray:
        """An array ``[n, cols]`` (n <= rows) over a buffer of its own; its values are whatever
        the buffer held (the caller overwrites them)."""
        if not 0 < n <= self.rows:
            raise ValueError(f"{n} rows from a pool of {self.rows}-row buffers")
        with self._lock:
            buf = self._free.pop() if self._free else None
        if buf is None:
            from .files import DIRECT_ALIGN, direct_stage

            need = self.rows * self.cols * self.dtype.itemsize
            buf = direct_stage(-(-need // DIRECT_ALIGN) * DIRECT_ALIGN)
        # every view of the rows (slices, reshapes, a tensor from them) has this array as its
        # base (numpy points a view of a view at the array that holds the buffer): the buffer
        # is free once it goes
        flat = np.frombuffer(buf, self.dtype, count=n * self.cols)
        weakref.finalize(flat, self._give_back, buf)
        return flat.reshape(n, self.cols)

    def _give_back(self, buf) -> None:
        with self._lock:
            if len(self._free) < self.keep:
                self._free.append(buf)

    def idle(self) -> int:
        """Free buffers held now."""
        with self._lock:
            return len(self._free)
