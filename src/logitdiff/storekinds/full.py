"""``--store full``: every row's logits as the source gave them (float32, float16, float64,
or bf16 as its uint16 bits), one ``.npy`` per chunk, read back memory-mapped.

A chunk file is written whole or not at all (temporary + rename) but not fsynced here: at
V = 248,320 a chunk is 64 MiB, and a blocking fsync per chunk kept the writer (and through
it the capture) waiting on the disk. ``RunWriter`` fsyncs it before the manifest lists the
chunk; writeback is started after each block, so that fsync mostly finds the data written."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from .. import validate
from ..errors import LogitdiffError
from ..outputs import atomic_file_unsynced, start_writeback
from .base import Block, BlockPlace, RowsForm, StoreKind, check_full_rows
from .rows import DTYPES, f32_to_bf16, full_values


class FullStore(StoreKind):
    name: ClassVar[str] = "full"
    usage: ClassVar[str] = "full"
    summary: ClassVar[str] = "native-dtype logits"
    reads_as: ClassVar[RowsForm] = RowsForm.FULL
    chunk_suffix: ClassVar[str] = "logits.npy"

    def describe(self) -> str:
        return "full logits"

    @property
    def row_bytes(self) -> int:
        return int(self.vocab_size or 0) * np.dtype(DTYPES[self.dtype or "float32"]).itemsize

    def encode(self, rows: np.ndarray, place: BlockPlace, hidden: np.ndarray | None = None) -> Block:
        return rows

    def check_block(self, block: Block, place: BlockPlace) -> tuple[Block, int]:
        rows = check_full_rows(block, place, int(self.vocab_size or 0), self.dtype)
        return rows, int(rows.shape[0])

    def save_chunk(self, path: Path, blocks: list[Block]) -> None:
        """Not durable on return: ``RunWriter`` fsyncs ``path`` before it lists the chunk."""
        save_npy_rows_unsynced(path, blocks or [np.zeros((0, int(self.vocab_size or 0)), dtype=np.float32)],
                               self.dtype or "float32")

    def load_chunk(self, path: Path, label: Any) -> Block:
        data = np.load(path, mmap_mode="r", allow_pickle=False)
        if data.ndim != 2 or data.shape[1] != self.vocab_size:
            raise LogitdiffError(f"{path}: logits shape {data.shape}, expected (*, {self.vocab_size})")
        validate.rows_dtype(data, DTYPES.get(self.dtype or "float32", np.float32), str(path), name=self.dtype or "float32")
        return data

    def values(self, rows: Block, raw: bool = False) -> Block:
        return full_values(rows, self.dtype, raw)


def save_npy_rows_unsynced(path: Path, blocks: list[np.ndarray], dtype: str) -> None:
    """One ``.npy`` of the row blocks stacked, written block by block straight from each
    block's buffer (no concatenated copy), renamed into place when whole; writeback of each
    block is started as soon as it is written, the fsync is the caller's. ``dtype``
    ``"bfloat16"`` stores bf16 bits."""
    n = sum(b.shape[0] for b in blocks)
    cols = blocks[0].shape[1] if blocks else 0
    out_dtype = np.dtype(np.uint16) if dtype == "bfloat16" else np.dtype(DTYPES[dtype])
    with atomic_file_unsynced(path) as f:
        np.lib.format.write_array_header_1_0(f, {"descr": np.lib.format.dtype_to_descr(out_dtype), "fortran_order": False,
                                                 "shape": (n, cols)})
        for b in blocks:
            if dtype == "bfloat16":
                b = b if b.dtype == np.uint16 else f32_to_bf16(b)
            f.write(np.ascontiguousarray(b, dtype=out_dtype).data)
            f.flush()
            start_writeback(f.fileno())
