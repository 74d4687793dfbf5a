"""Candidate names a reader can tell apart in a narrow column.

Real model names are long and differ at the end (``Qwen3-30B-A3B-Instruct-2507-UD-Q4_K_XL``
against ``…-UD-Q2_K_XL``); a column cut to its width shows only the shared start. Tables
and pages show :func:`distinct_names` instead: the prefix every name shares is folded to
``…`` (at a separator, so a word is never cut), and the full name stays in report.json and
on hover. Two different names never render alike: where folding would make two equal (or a
name empty), that name is shown whole.
"""

from __future__ import annotations

import os
from typing import Sequence

ELLIPSIS = "…"
# not "_": it is inside quant type names (Q4_K_M), which must stay whole
_SEPARATORS = "-./: "


def _common_prefix_at_separator(names: Sequence[str]) -> int:
    """Length of the longest prefix all names share that ends just after a separator."""
    prefix = os.path.commonprefix(list(names))
    cut = max((prefix.rfind(s) for s in _SEPARATORS), default=-1)
    return cut + 1 if cut >= 0 else 0


def distinct_names(names: Sequence[str], *, min_fold: int = 6) -> list[str]:
    """``names`` with their shared start folded to ``…``; unchanged when there is one name,
    when the shared start is shorter than ``min_fold`` characters (folding would save
    nothing), or when folding would make two names alike."""
    names = list(names)
    if len(set(names)) < 2:
        return names
    k = _common_prefix_at_separator(names)
    if k < min_fold:
        return names
    short = [ELLIPSIS + n[k:] if n[k:] else n for n in names]
    seen: dict[str, int] = {}
    for s in short:
        seen[s] = seen.get(s, 0) + 1
    # a name equal to the shared prefix itself, or two that fold alike: shown whole
    return [s if seen[s] == 1 and s != ELLIPSIS else n for s, n in zip(short, names)]
