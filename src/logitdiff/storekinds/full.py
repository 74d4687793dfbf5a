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
from .rows import DTYPES, full_values, write_npy_rows


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
    """:func:`rows.atomic_save_npy_rows` without its fsync: renamed into place when whole;
    writeback of each block is started as soon as it is written, the fsync is the caller's."""
    with atomic_file_unsynced(path) as f:
        write_npy_rows(f, blocks, dtype, after_block=_start_writeback)


def _start_writeback(f) -> None:
    f.flush()
    start_writeback(f.fileno())
