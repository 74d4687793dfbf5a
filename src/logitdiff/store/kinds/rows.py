"""Full-logit rows as stores keep them: the logits dtypes a RUN records, bf16 bits, the
NaN/inf scan and the one ``.npy`` writer of stacked row blocks (pure numerics plus that writer)."""

from __future__ import annotations

import struct
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np

from ..files import DIRECT_ALIGN, atomic_file, atomic_file_direct

# settings.dtype of a RUN -> the numpy dtype of its stored rows (bf16 as its uint16 bits)
DTYPES: dict[str, Any] = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16, "float64": np.float64}


def bf16_to_f32(u16: np.ndarray) -> np.ndarray:
    """bf16 bits (uint16) -> float32 (exact)."""
    return (u16.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even float32 -> bfloat16 bits (what torch does)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounding = ((u >> 16) & 1) + 0x7FFF
    return ((u + rounding) >> 16).astype(np.uint16)


def atomic_save_npy_rows(path: Path, blocks: list[np.ndarray], dtype: str) -> None:
    """One ``.npy`` of the row blocks stacked, written block by block (no concatenated
    copy in memory), then fsynced and renamed into place. ``dtype`` ``"bfloat16"`` stores bf16 bits."""
    with atomic_file(path) as f:
        write_npy_rows(f, blocks, dtype)


def stored_dtype(dtype: str) -> np.dtype:
    """The numpy dtype of a ``.npy`` of rows in the RUN dtype ``dtype`` (bf16: uint16 bits)."""
    return np.dtype(np.uint16) if dtype == "bfloat16" else np.dtype(DTYPES[dtype])


def stored_block(b: np.ndarray, dtype: str) -> np.ndarray:
    """A block of rows as its ``.npy`` holds them: C-contiguous, in the stored dtype (bf16 from
    float rounded to nearest even; a block already in that form is not copied)."""
    if dtype == "bfloat16" and b.dtype != np.uint16:
        b = f32_to_bf16(b)
    return np.ascontiguousarray(b, dtype=stored_dtype(dtype))


# Where the rows of a streamed chunk file (RowsFile) start: the .npy header is padded to one
# page (npy 1.0 allows up to 65,535 header bytes; np.load and its memory map take any
# length), so the rows can be written before their count is known and the header after them.
NPY_DATA_OFFSET = DIRECT_ALIGN


def npy_header_page(n: int, cols: int, dtype: str) -> bytes:
    """The npy 1.0 header of ``n`` x ``cols`` rows padded with spaces to NPY_DATA_OFFSET bytes."""
    text = repr({"descr": np.lib.format.dtype_to_descr(stored_dtype(dtype)), "fortran_order": False, "shape": (n, cols)})
    room = NPY_DATA_OFFSET - 10  # magic (6), version (2), header length (2)
    body = text.encode("latin1").ljust(room - 1) + b"\n"
    if len(body) != room:
        raise ValueError(f"npy header of shape {(n, cols)} longer than {room} bytes")
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", room) + body


class RowsFile:
    """One ``.npy`` of rows written block by block as the blocks come (``append``), its
    header (the row count) written last over the first page (``close``): the rows reach the
    disk while later rows are computed, and no block is held after it is written. Written
    with O_DIRECT through ``stage`` when ``direct`` and the file system allows it
    (outputs.atomic_file_direct), through the page cache otherwise;
    whole under ``path`` after ``close``, nothing there after ``abort``; not yet durable."""

    def __init__(self, path: Path, cols: int, dtype: str, stage, direct: bool = True):
        self.cols, self.dtype, self.rows = int(cols), dtype, 0
        self._files = ExitStack()
        self._f = self._files.enter_context(atomic_file_direct(path, stage, direct))
        self._f.write(bytes(NPY_DATA_OFFSET))  # the header's page, filled in by close()

    def append(self, block: np.ndarray) -> None:
        b = stored_block(block, self.dtype)
        if b.ndim != 2 or b.shape[1] != self.cols:
            raise ValueError(f"rows of shape {b.shape} for a file of {self.cols} columns")
        self._f.write(b.data)
        self.rows += int(b.shape[0])

    def close(self) -> None:
        self._f.head = npy_header_page(self.rows, self.cols, self.dtype)
        self._files.close()

    def abort(self) -> None:
        """Remove the temporary (after a failed append, or a writer closed mid-chunk)."""
        self._files.__exit__(RuntimeError, RuntimeError("chunk abandoned"), None)


def write_npy_rows(f, blocks: list[np.ndarray], dtype: str) -> None:
    """The ``.npy`` bytes of the row blocks stacked, into the open binary file ``f``, block
    by block straight from each block's buffer."""
    n = sum(b.shape[0] for b in blocks)
    cols = blocks[0].shape[1] if blocks else 0
    out_dtype = stored_dtype(dtype)
    np.lib.format.write_array_header_1_0(f, {"descr": np.lib.format.dtype_to_descr(out_dtype), "fortran_order": False, "shape": (n, cols)})
    for b in blocks:
        f.write(stored_block(b, dtype).data)


def nonfinite_row(rows: np.ndarray, dtype: str | None) -> int | None:
    """First row holding NaN/inf, or None. bf16 bits (uint16): exponent all ones."""
    if not rows.size:
        return None
    if rows.dtype == np.uint16 and dtype != "bfloat16":
        raise ValueError("uint16 rows are bf16 bits: only for dtype='bfloat16'")
    from ...numerics.kernel import first_nonfinite

    got = first_nonfinite(rows)  # the compiled scan: one read, no temporaries (-1: not built)
    if got != -1:
        return got
    if rows.dtype == np.uint16:
        bad = (rows & 0x7F80) == 0x7F80
        return int(np.nonzero(bad.any(1))[0][0]) if bad.any() else None
    # max and min propagate NaN and expose +-inf without a full boolean temporary; only a
    # bad array pays for locating the row.
    if np.isfinite(rows.max()) and np.isfinite(rows.min()):
        return None
    return int(np.nonzero(~np.isfinite(rows).all(1))[0][0])


def full_values(rows: Any, dtype: str | None, raw: bool = False) -> Any:
    """Full rows as a reader hands them out: bf16 bits widened to float32 (exact) unless
    ``raw``; other dtypes as stored; rows already float32 (a decoding kind's rows decoded to
    float32, RunReader.decode_to_float32) as they are."""
    if dtype == "bfloat16" and not raw and np.asarray(rows).dtype == np.uint16:
        return bf16_to_f32(np.asarray(rows))
    return rows
