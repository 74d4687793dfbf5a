"""``--store full``: every row's logits as the source gave them (float32, float16, float64,
or bf16 as its uint16 bits), one ``.npy`` per chunk, read back memory-mapped.

A chunk file is written whole or not at all (temporary + rename) but not fsynced here: at
V = 248,320 a chunk is 64 MiB, and a blocking fsync per chunk kept the writer (and through
it the capture) waiting on the disk. ``RunWriter`` fsyncs it before the manifest lists the
chunk. The rows are written with O_DIRECT through one staging buffer per run: the kernel
neither copies them into the page cache nor writes them back later, work that ran on the
cores the model's forward needs (bench/RESULTS.md, issue 24 "O_DIRECT"); on a memory file
system (tmpfs: nothing to spare) or one that refuses O_DIRECT they go through the page
cache, writeback started per block."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from .. import validate
from ...errors import LogitdiffError
from ..files import direct_io_pays, direct_stage
from .base import Block, BlockPlace, ChunkFile, RowsForm, StoreKind, check_full_rows
from .rows import DTYPES, RowsFile, full_values


class FullStore(StoreKind):
    name: ClassVar[str] = "full"
    usage: ClassVar[str] = "full"
    summary: ClassVar[str] = "native-dtype logits"
    reads_as: ClassVar[RowsForm] = RowsForm.FULL
    chunk_suffix: ClassVar[str] = "logits.npy"
    lossless: ClassVar[bool] = True

    def __init__(self, text: str, vocab_size: int | None = None, dtype: str | None = None) -> None:
        super().__init__(text, vocab_size, dtype)
        self._stage: Any = None  # the writer's O_DIRECT staging buffer (made on the first chunk)
        self._direct: dict[Path, bool] = {}  # directory -> whether O_DIRECT spares a copy there

    @classmethod
    def as_given(cls, top_k: int, vocab_size: int | None, dtype: str | None) -> StoreKind | None:
        return None if top_k else cls(cls.name, vocab_size, dtype)

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
        f = self.open_chunk(path)
        try:
            for b in blocks:
                f.append(b)
        except BaseException:
            f.abort()
            raise
        f.close()

    def open_chunk(self, path: Path) -> ChunkFile:
        """Rows streamed to ``path`` as they come (rows.RowsFile), O_DIRECT where allowed.
        One chunk at a time (the writer thread's): the staging buffer is the kind's."""
        where = Path(path).parent
        if where not in self._direct:
            self._direct[where] = direct_io_pays(where)
        if self._direct[where] and self._stage is None:
            self._stage = direct_stage()
        return RowsFile(path, int(self.vocab_size or 0), self.dtype or "float32", self._stage, self._direct[where])

    def stop_writing(self) -> None:
        self._stage = None  # 16 MiB, not kept for as long as the writer object lives

    def load_chunk(self, path: Path, label: Any, max_bytes: int | None = None) -> Block:
        # memory-mapped: nothing is allocated for its rows, whatever the file says (the shape
        # is checked below, the row count by the reader)
        data = np.load(path, mmap_mode="r", allow_pickle=False)
        if data.ndim != 2 or data.shape[1] != self.vocab_size:
            raise LogitdiffError(f"{path}: logits shape {data.shape}, expected (*, {self.vocab_size})")
        validate.rows_dtype(data, DTYPES.get(self.dtype or "float32", np.float32), str(path), name=self.dtype or "float32")
        return data

    def values(self, rows: Block, raw: bool = False) -> Block:
        return full_values(rows, self.dtype, raw)

