"""What every comparison method implements: ``compare_runs`` (compare.py) pairs the items of
two runs, picks the method from what the two runs give a reader (store.kinds.RowsForm) and
asks it, block of rows after block of rows, for its per-position columns. A method never
writes; its columns are arrays with one entry per row of the block."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

import numpy as np

from ...store import rows_per_block
from ...store.kinds import RowsForm

TOP_SHOWN = 5  # top tokens kept per side for the token view of reports


def paired(a: Iterator[Any], b: Iterator[Any]) -> Iterator[tuple[Any, Any]]:
    """``zip(a, b)`` that closes both streams when it is closed or ends: a live candidate's
    stream owns a worker thread (capture/ahead.py), joined on close (compare_runs closes
    the stream it reads, whatever happens)."""
    try:
        yield from zip(a, b)
    finally:
        for s in (a, b):
            close = getattr(s, "close", None)
            if close is not None:
                close()


def form_of(run: Any) -> RowsForm:
    """What a run (RunReader, a live candidate: any reader with ``row_blocks`` and a store
    ``kind``) gives a reader: its store kind's form."""
    return run.kind.reads_as


def run_dtype(run: Any) -> str:
    """What a run's distributions are, in words: the logits dtype (stored, or of the source
    for a top-K store), with the GGUF file type when there is one; served top-K logprobs
    say so; "unknown" when the run does not tell (imports)."""
    settings = run.manifest.get("settings") or {}
    ident = (run.manifest.get("source") or {}).get("identity") or {}
    d = settings.get("dtype") or settings.get("source_dtype") or ident.get("logits_dtype") or ident.get("dtype")
    if not d:
        return "unknown"
    return f"{d} logits of GGUF {ident['file_type']}" if ident.get("file_type") else str(d)


def owner(items: Sequence[Any], row: int) -> tuple[Any, int]:
    """The item holding global row ``row`` of a row stream over ``items``, and its index."""
    for it in items:
        if row < len(it.positions):
            return it, row
        row -= len(it.positions)
    raise IndexError(row)


def tops_columns(ids_r: np.ndarray, lp_r: np.ndarray, ids_c: np.ndarray, lp_c: np.ndarray) -> dict[str, np.ndarray]:
    """Each side's winner probability and its top-5 (ids, probabilities), descending.

    Flips are read from these: the reference's winner and how sure it was, the
    candidate's winner and how sure *it* was."""
    return {
        "p_top1_ref": np.exp(np.asarray(lp_r[:, 0], dtype=np.float64)),
        "p_top1_cand": np.exp(np.asarray(lp_c[:, 0], dtype=np.float64)),
        "top5_ref_ids": np.asarray(ids_r[:, :TOP_SHOWN], dtype=np.int64),
        "top5_ref_p": np.exp(np.asarray(lp_r[:, :TOP_SHOWN], dtype=np.float64)),
        "top5_cand_ids": np.asarray(ids_c[:, :TOP_SHOWN], dtype=np.int64),
        "top5_cand_p": np.exp(np.asarray(lp_c[:, :TOP_SHOWN], dtype=np.float64)),
    }


def joined(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Columns of consecutive sub-blocks as one block's columns (keys in first-seen order)."""
    if len(parts) == 1:
        return parts[0]
    keys = list(dict.fromkeys(k for p in parts for k in p))
    return {k: np.concatenate([p[k] for p in parts]) for k in keys}


class ComparisonMethod(ABC):
    """One way of comparing a reference with a candidate, chosen from the pair of forms
    their runs give a reader. Bound to the two runs and their paired items; ``top_k`` is K
    of the top-K fields (``method.top_logprobs``) and ``overlap_k`` the K of the top-K
    overlap (None where the method has no such figure)."""

    kind: ClassVar[str]  # method.kind of the report (contracts.MethodKind)
    bounds: ClassVar[str]  # method.bounds of the report (bounds.METHOD_*)
    takes_floor: ClassVar[bool] = False  # a stated --logprob-floor gives it finite upper bounds

    @classmethod
    @abstractmethod
    def fits(cls, ref: Any, cand: Any) -> bool:
        """Whether the method compares this pair of runs (the first in METHODS that fits is used)."""

    def __init__(self, ref: Any, cand: Any, items_r: Sequence[Any], items_c: Sequence[Any], *, top_logprobs: int,
                 overlap_k: int, eps: float, device: Any = None, threads: int | None = None,
                 logprob_floor: float | None = None) -> None:
        self.ref, self.cand = ref, cand
        self.items_r, self.items_c = items_r, items_c
        self.V = int(ref.vocab_size)
        self.eps = eps
        self.device = device
        self.threads = threads
        self.logprob_floor = logprob_floor
        self.top_k = min(top_logprobs, self.V)
        self.overlap_k: int | None = min(overlap_k, self.V)

    def batch_rows(self, chunk_bytes: int | None) -> int:
        """Rows per block when the caller sets none: a chunk of float32 full rows."""
        return rows_per_block(self.V, chunk_bytes)

    @abstractmethod
    def blocks(self, rows: int) -> Iterator[tuple[Any, Any]]:
        """(reference block, candidate block) pairs over the paired items' rows, in order,
        at most ``rows`` rows each."""

    @abstractmethod
    def rows_in(self, ref_block: Any, cand_block: Any) -> int:
        """Rows of one pair of blocks."""

    @abstractmethod
    def columns(self, ref_block: Any, cand_block: Any, next_tokens: np.ndarray, row0: int) -> dict[str, np.ndarray]:
        """The per-position columns of one pair of blocks (``next_tokens``: the teacher
        tokens its rows predict; ``row0``: its first row in the whole stream, for errors)."""

    @abstractmethod
    def description(self) -> str:
        """``method.description`` of the report."""
