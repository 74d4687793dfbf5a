"""A compact reference (bounded rows) against full candidate rows: each divergence with a
proven interval that contains the exact full-vocabulary value (``method.bounds``
"compact-bounded"; docs/bounds.md). The arithmetic is logitdiff.store.compact's."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar

import numpy as np

from ...numerics import metrics as M
from ...numerics.bounds import METHOD_COMPACT
from ...contracts import MethodKind
from ...errors import LogitdiffError
from ...store import RunReader, aligned_blocks
from ...store.kinds import RowsForm, cut_rows
from .base import ComparisonMethod, form_of, joined, owner, paired, tops_columns

COMPACT_DESCRIPTION = (
    "KL(P_ref || P_cand), reverse KL and Jensen-Shannon divergence between a compact reference "
    "(exact top entries, a quantised band, exact mass of the rest) and a full candidate: each "
    "figure comes with a proven interval [*_lower_nats, *_upper_nats] that contains the exact "
    "full-vocabulary value (docs/bounds.md); the figure itself is the divergence at the placement "
    "of the unstored mass closest to the candidate (the interval's lower end). Top-1, margin, teacher-token p and entropy of "
    "the reference are exact."
)
# float64 bytes per sub-batch of a compact comparison in numpy (where the compiled kernel
# is not built; it takes a whole block in one call, its scratch O(V) per thread): small
# enough that its ~15 [n, V] temporaries come from the heap's free lists rather than a
# fresh mmap each (SmolLM2, V = 49,152: 1.5 s of system time per compare at 8 MiB, 0.04 s
# at 2 MiB, same user time; bench/RESULTS.md); at least one row
COMPACT_SUB_BYTES = 2 << 20


class _Rows:
    """A compact block (dict of row arrays) as `aligned_blocks` cuts it: its length is its
    row count, a slice is those rows (views)."""

    __slots__ = ("block",)

    def __init__(self, block: dict[str, np.ndarray]) -> None:
        self.block = block

    def __len__(self) -> int:
        return int(self.block["max_logit"].shape[0])

    def __getitem__(self, sl: slice) -> dict[str, np.ndarray]:
        return cut_rows(self.block, sl.start, sl.stop)


class CompactBounded(ComparisonMethod):
    """Bounded reference rows against full candidate rows."""

    kind: ClassVar[str] = MethodKind.COMPACT
    bounds: ClassVar[str] = METHOD_COMPACT

    @classmethod
    def fits(cls, ref: Any, cand: Any) -> bool:
        return form_of(ref) is RowsForm.BOUNDED and form_of(cand) is RowsForm.FULL

    def __init__(self, ref: Any, cand: Any, items_r: Any, items_c: Any, *, top_logprobs: int, overlap_k: int, **kw: Any) -> None:
        super().__init__(ref, cand, items_r, items_c, top_logprobs=top_logprobs, overlap_k=overlap_k, **kw)
        # the reference's top-K and overlap come from its exact entries
        exact = ref.kind.top_entries or self.V
        self.top_k = min(top_logprobs, exact, self.V)
        self.overlap_k = min(overlap_k, exact, self.V)

    def blocks(self, rows: int) -> Iterator[tuple[Any, Any]]:
        # the compact reference and the full candidate, streamed in the same row blocks; the
        # candidate as stored (bf16 bits stay uint16: the compiled kernel reads them in place).
        # Two runs: views of both, cut where an item or a chunk ends (as the full comparison
        # does; re-cutting into exact blocks copied ~30 MB per 222 SmolLM2 rows, 40 ms).
        ref, cand = self.ref, self.cand
        if isinstance(ref, RunReader) and isinstance(cand, RunReader):
            pieces = (_Rows(ref.compact_rows(it)) for it in self.items_r)  # an item's rows: views of its chunk
            return aligned_blocks(pieces, cand.row_pieces(self.items_c), rows)
        return paired(ref.row_blocks(self.items_r, rows), cand.row_blocks(self.items_c, rows, raw=True))

    def rows_in(self, ref_block: Any, cand_block: Any) -> int:
        return len(cand_block)

    def columns(self, ref_block: Any, cand_block: Any, next_tokens: np.ndarray, row0: int) -> dict[str, np.ndarray]:
        """One block: with the compiled kernel, one call (``threads`` rows at a time; default:
        the metrics' `default_threads`, as the full-vocabulary kernel uses); without it, numpy
        in sub-batches of ``COMPACT_SUB_BYTES`` of float64 rows, ``threads`` of them at a time
        (numpy releases the GIL in its array work)."""
        from concurrent.futures import ThreadPoolExecutor

        from ...store import compact as C
        from ...numerics import kernel

        zc = np.asarray(cand_block)
        top_k, overlap_k = self.top_k, int(self.overlap_k or 0)
        threads = self.threads or M.default_threads()

        def one(a: int, step: int, threads: int) -> dict[str, np.ndarray]:
            sl = slice(a, a + step)
            try:
                cols = C.compare_rows(C.rows_of(ref_block, sl), zc[sl], next_tokens[sl], top_k=top_k, overlap_k=overlap_k,
                                      eps=self.eps, threads=threads)
            except M.NonFiniteLogits as e:
                it, row = owner(self.items_c, row0 + a + e.row)
                raise LogitdiffError(f"{self.cand.path}: item {it.id!r} has NaN/inf logits at output position {it.positions[row]}") from None
            ir, lr, ic, lc = cols.pop("_tops")
            return {**cols, **tops_columns(ir, lr, ic, lc)}

        if kernel.available() and zc.dtype in (np.float32, np.uint16, np.float16):
            zc = np.ascontiguousarray(zc)  # read in place (a copy only of a strided block)
            return one(0, zc.shape[0], threads)
        step = max(1, COMPACT_SUB_BYTES // (zc.shape[1] * 8))
        starts = range(0, zc.shape[0], step)
        workers = max(1, min(len(starts), threads))
        with ThreadPoolExecutor(workers) as pool:
            parts = list(pool.map(lambda a: one(a, step, 1), starts))  # in order
        return joined(parts) if parts else {}

    def description(self) -> str:
        return COMPACT_DESCRIPTION
