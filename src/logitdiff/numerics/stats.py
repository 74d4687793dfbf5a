"""Can two candidates be told apart on this workload? Paired statistics over items.

Candidates of one ladder are scored on the *same* items, so their per-item values are
paired: an item that is hard for Q4 is usually hard for Q3 too. Resampling items jointly
(the same bootstrap draw for both candidates) removes that shared item difficulty from the
comparison, which makes the paired test much sharper than comparing two separate CIs.

Everything here is pure numpy on per-item arrays (item mean KL, item top-1 disagreement
rate); the callers get those from tokens.parquet grouped by item_id or from
``report["items"]``. No I/O.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numpy as np

from .summarize import item_bootstrap_ci

Z95 = 1.959963984540054  # two-sided 95 % normal quantile


def _paired(values_a, values_b) -> np.ndarray:
    a = np.asarray(values_a, dtype=np.float64).ravel()
    b = np.asarray(values_b, dtype=np.float64).ravel()
    if a.shape != b.shape:
        raise ValueError(f"paired values need the same items: {a.size} vs {b.size}")
    d = b - a
    # An item missing in either candidate (NaN) carries no paired information.
    return d[np.isfinite(d)]


def paired_bootstrap(values_a, values_b, n_boot: int = 2000, seed: int = 0, level: float = 0.95) -> dict:
    """Bootstrap of mean(b) - mean(a) over items, resampling items jointly.

    Returns ``diff`` (observed mean of b - a over items), ``ci`` ([lo, hi] percentile
    interval at ``level``), ``p_two_sided`` (bootstrap p-value of "no difference",
    ``(2·min(#d*≤0, #d*≥0) + 1) / (n_boot + 1)`` capped at 1, so it is never exactly 0),
    ``separable`` (the CI excludes 0), ``n_items`` and ``sd`` (std of the paired
    differences, ddof=1).
    """
    d = _paired(values_a, values_b)
    n = int(d.size)
    if n == 0:
        return {"diff": None, "ci": [None, None], "p_two_sided": None, "separable": False, "n_items": 0, "sd": None}
    diff = float(d.mean())
    sd = float(d.std(ddof=1)) if n > 1 else 0.0
    if n == 1 or n_boot <= 0:
        # One item (no spread to resample) or --bootstrap 0: no interval and no p-value, not a
        # zero-width interval that reads as a certain figure.
        return {"diff": diff, "ci": [None, None], "p_two_sided": None, "separable": False, "n_items": n, "sd": sd}
    lo, hi, boot = item_bootstrap_ci(d, np.ones(n), n_boot=n_boot, seed=seed, alpha=1.0 - level)
    k = min(int((boot <= 0).sum()), int((boot >= 0).sum()))
    p = min(1.0, (2 * k + 1) / (n_boot + 1))
    return {"diff": diff, "ci": [lo, hi], "p_two_sided": p, "separable": bool(lo > 0 or hi < 0), "n_items": n, "sd": sd}


def items_needed(values_a, values_b, z: float = Z95) -> float | None:
    """Items that would likely make the 95 % CI of the paired difference exclude 0.

    From the observed paired std and mean difference, n ≈ (z·sd / |diff|)² (a normal
    approximation: the CI half-width z·sd/√n shrinks below |diff|). ``None`` when fewer than
    two items were observed, ``math.inf`` when the observed difference is exactly 0.
    """
    d = _paired(values_a, values_b)
    if d.size < 2:
        return None
    diff = float(d.mean())
    if diff == 0.0:
        return math.inf
    sd = float(d.std(ddof=1))
    return float(max(2, math.ceil((z * sd / abs(diff)) ** 2)))


def adjacent_pairs(
    item_ids: Sequence[str],
    item_kl: Mapping[str, Sequence[float]],
    item_top1: Mapping[str, Sequence[float]] | None = None,
    *,
    n_boot: int = 2000,
    seed: int = 0,
) -> list[dict]:
    """Paired comparisons of neighbours in the candidates' order by mean item KL.

    ``item_kl[name]`` (and ``item_top1[name]``, per-item top-1 disagreement rates) are
    arrays aligned with ``item_ids``; NaN marks an item a candidate lacks. Candidates are
    sorted by the mean of their item mean KL (ascending) and each neighbour pair (a, b)
    gets ``kl`` (and ``top1``): :func:`paired_bootstrap` of b - a plus ``items_needed``.
    Neighbours are what a reader asks about ("is Q4_K_M really worse than IQ4_XS?"); every
    further pair is separated at least as clearly when the neighbours are.
    """
    names = list(item_kl)
    n = len(item_ids)
    for name in names:
        if len(item_kl[name]) != n or (item_top1 is not None and name in item_top1 and len(item_top1[name]) != n):
            raise ValueError(f"{name}: per-item arrays must align with the {n} item ids")
    order = sorted(names, key=lambda k: (float(np.nanmean(np.asarray(item_kl[k], dtype=np.float64))), k))
    out = []
    for a, b in zip(order[:-1], order[1:]):
        row: dict[str, Any] = {"a": a, "b": b, "metric_basis": "per-item means, items resampled jointly"}
        kl = paired_bootstrap(item_kl[a], item_kl[b], n_boot=n_boot, seed=seed)
        kl["items_needed"] = items_needed(item_kl[a], item_kl[b])
        kl["mean_a"] = float(np.nanmean(np.asarray(item_kl[a], dtype=np.float64)))
        kl["mean_b"] = float(np.nanmean(np.asarray(item_kl[b], dtype=np.float64)))
        row["kl"] = kl
        if item_top1 is not None and a in item_top1 and b in item_top1:
            t = paired_bootstrap(item_top1[a], item_top1[b], n_boot=n_boot, seed=seed)
            t["items_needed"] = items_needed(item_top1[a], item_top1[b])
            row["top1"] = t
        out.append(row)
    return out


def per_item_values(item_id, values, item_order: Sequence[str]) -> np.ndarray:
    """Mean of ``values`` per item, aligned with ``item_order`` (NaN for an absent item).

    ``item_id`` is the per-position item column (tokens.parquet's ``item_id``)."""
    ids = np.asarray(item_id).astype(str)
    v = np.asarray(values, dtype=np.float64)
    uniq, inv = np.unique(ids, return_inverse=True)
    sums = np.bincount(inv, weights=v, minlength=uniq.size)
    cnt = np.bincount(inv, minlength=uniq.size)
    means = dict(zip(uniq.tolist(), (sums / np.maximum(cnt, 1)).tolist()))
    return np.array([means.get(str(i), np.nan) for i in item_order], dtype=np.float64)
