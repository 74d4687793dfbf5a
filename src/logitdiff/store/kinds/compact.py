"""``--store compact[:exact=E,band=B,bits=8|16]``: a reference kept as exact top entries,
a quantised band and the exact mass of the rest (the arrays and their encoding are
logitdiff.store.compact's); a reader gets bounded rows, compared with proven intervals."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from .. import compact as C
from ...errors import LogitdiffError
from ..files import atomic_write_bytes_unsynced
from .base import Block, BlockPlace, RowsForm, StoreKind


class CompactStore(StoreKind):
    name: ClassVar[str] = C.STORE_PREFIX
    usage: ClassVar[str] = "compact[:exact=E,band=B,bits=8|16]"
    summary: ClassVar[str] = ("a reference kept as exact top entries, a quantised band and exact tail mass: candidates "
                              "compare against it with proven KL bounds")
    reads_as: ClassVar[RowsForm] = RowsForm.BOUNDED
    chunk_suffix: ClassVar[str] = C.CHUNK_SUFFIX
    keeps_dtype: ClassVar[bool] = False  # log-probabilities and codes, whatever the source's logits were
    # a reader reads the next chunk ahead in its worker thread (RunReader._chunk / prefetch): a
    # chunk's inflate and checks are the work, done on the core that a compare's
    # single-threaded stretches (token and item checks, Python between blocks) leave idle
    decodes: ClassVar[bool] = True

    def __init__(self, text: str, vocab_size: int | None = None, dtype: str | None = None, *,
                 spec: C.CompactSpec | None = None) -> None:
        super().__init__(text, vocab_size, dtype)
        self.spec = spec or C.parse_spec(text)

    @classmethod
    def parse(cls, text: str, vocab_size: int | None = None, dtype: str | None = None) -> CompactStore:
        return cls(text, vocab_size, dtype, spec=C.parse_spec(text))

    @property
    def top_entries(self) -> int | None:
        return self.spec.exact

    def describe(self) -> str:
        return f"a compact reference ({self.text})"

    @property
    def row_bytes(self) -> int:
        # exact ids + logits, band ids + codes (compact.encode), before compression
        return 12 * self.spec.exact + 10 * self.spec.band

    def encode(self, rows: np.ndarray, place: BlockPlace, hidden: np.ndarray | None = None) -> Block:
        return C.encode(rows, place.next_tokens(rows.shape[0]), self.spec)

    def check_block(self, block: Block, place: BlockPlace) -> tuple[Block, int]:
        if not isinstance(block, dict) or "max_logit" not in block:
            raise LogitdiffError(f"{place.where}: compact run: pass compact rows (compact.encode)")
        rows = {key: np.asarray(v) for key, v in block.items()}
        n = rows["max_logit"].shape[0]
        if n > place.n_left:
            raise LogitdiffError(f"{place.where}: {n} compact rows given, {place.n_left} left")
        return rows, n

    def save_chunk(self, path: Path, blocks: list[Block]) -> None:
        if not blocks:  # a chunk that only closes items whose rows ended in earlier chunks
            blocks = [C.encode(np.zeros((0, int(self.vocab_size or 0)), np.float32), np.zeros(0, np.int64), self.spec)]
        atomic_write_bytes_unsynced(path, C.save_chunk(path, blocks))  # fsynced by RunWriter before it lists the chunk

    def chunk_bound(self, rows: int) -> int:
        # row_bytes (ids as int64, which the stored gaps never exceed, float32 logits, 16-bit
        # codes) and the float64 row figures
        return max(0, int(rows)) * (self.row_bytes + 8 * len(C.ROW_FIELDS))

    def load_chunk(self, path: Path, label: Any, max_bytes: int | None = None) -> Block:
        data = C.load_chunk(path, max_bytes)
        C.check_rows(data, int(self.vocab_size or 0), str(path), label)
        return data

    def rows_in(self, block: Block) -> int:
        return int(block["max_logit"].shape[0])
