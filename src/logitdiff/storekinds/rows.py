"""Full-logit rows as stores keep them: the logits dtypes a RUN records, bf16 bits, the
NaN/inf scan and the one ``.npy`` writer of stacked row blocks (pure numerics plus that writer)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ..outputs import atomic_file

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


def write_npy_rows(f, blocks: list[np.ndarray], dtype: str, after_block=None) -> None:
    """The ``.npy`` bytes of the row blocks stacked, into the open binary file ``f``, block
    by block straight from each block's buffer; ``after_block(f)`` is called after each."""
    n = sum(b.shape[0] for b in blocks)
    cols = blocks[0].shape[1] if blocks else 0
    out_dtype = np.dtype(np.uint16) if dtype == "bfloat16" else np.dtype(DTYPES[dtype])
    np.lib.format.write_array_header_1_0(f, {"descr": np.lib.format.dtype_to_descr(out_dtype), "fortran_order": False, "shape": (n, cols)})
    for b in blocks:
        if dtype == "bfloat16":
            b = b if b.dtype == np.uint16 else f32_to_bf16(b)
        f.write(np.ascontiguousarray(b, dtype=out_dtype).data)
        if after_block is not None:
            after_block(f)


def nonfinite_row(rows: np.ndarray, dtype: str | None) -> int | None:
    """First row holding NaN/inf, or None. bf16 bits (uint16): exponent all ones."""
    if not rows.size:
        return None
    if rows.dtype == np.uint16 and dtype != "bfloat16":
        raise ValueError("uint16 rows are bf16 bits: only for dtype='bfloat16'")
    from ..kernel import first_nonfinite

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
    ``raw``; other dtypes as stored."""
    if dtype == "bfloat16" and not raw:
        return bf16_to_f32(np.asarray(rows))
    return rows
