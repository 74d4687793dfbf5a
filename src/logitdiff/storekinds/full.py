"""``--store full``: every row's logits as the source gave them (float32, float16, float64,
or bf16 as its uint16 bits), one ``.npy`` per chunk, read back memory-mapped."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from .. import validate
from ..errors import LogitdiffError
from .base import Block, BlockPlace, RowsForm, StoreKind, check_full_rows
from .rows import DTYPES, atomic_save_npy_rows, full_values


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
        atomic_save_npy_rows(path, blocks or [np.zeros((0, int(self.vocab_size or 0)), dtype=np.float32)],
                             self.dtype or "float32")

    def load_chunk(self, path: Path, label: Any) -> Block:
        data = np.load(path, mmap_mode="r", allow_pickle=False)
        if data.ndim != 2 or data.shape[1] != self.vocab_size:
            raise LogitdiffError(f"{path}: logits shape {data.shape}, expected (*, {self.vocab_size})")
        validate.rows_dtype(data, DTYPES.get(self.dtype or "float32", np.float32), str(path), name=self.dtype or "float32")
        return data

    def values(self, rows: Block, raw: bool = False) -> Block:
        return full_values(rows, self.dtype, raw)
