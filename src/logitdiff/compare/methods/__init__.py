"""Comparison methods as objects: one class per method, chosen from what the two runs give
a reader (store.kinds.RowsForm) by the first entry of ``METHODS`` that fits the pair;
``compare_runs`` (compare/__init__.py) asks the chosen method for its columns, block by block."""

from __future__ import annotations

from typing import Any

from ...errors import LogitdiffError
from ...store.kinds import RowsForm
from .base import ComparisonMethod, form_of, owner, run_dtype, tops_columns
from .compact import CompactBounded
from .exact import Exact, LlamaCppBounded
from .topk import TopKBounded

# the methods, most specific first: the first that fits a pair of runs compares them
METHODS: list[type[ComparisonMethod]] = [CompactBounded, TopKBounded, LlamaCppBounded, Exact]

__all__ = ["METHODS", "ComparisonMethod", "form_of", "owner", "run_dtype", "select_method", "tops_columns"]


def select_method(ref: Any, cand: Any) -> type[ComparisonMethod]:
    """The method for what the two runs hold: full/full exact (bounded for an imported
    llama.cpp base), bounded reference/full candidate bounded, top-K on either side
    approximate with bounds; any other pair refused with a one-line error."""
    for method in METHODS:
        if method.fits(ref, cand):
            return method
    if form_of(cand) is RowsForm.BOUNDED:
        raise LogitdiffError(f"{cand.path}: a {getattr(cand, 'store', '')} store is a reference store (it gives {RowsForm.BOUNDED}); "
                             "capture the candidate with --store full")
    raise LogitdiffError(f"{ref.path} gives {form_of(ref)} ({getattr(ref, 'store', '')}) and {cand.path} gives {form_of(cand)}"
                         f"{f' (top-{cand.kind.k})' if cand.kind.k else ''}: no bounded method for that pair; "
                         "capture the candidate with --store full")
