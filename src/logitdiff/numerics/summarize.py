"""Summaries: percentiles, item-bootstrap confidence intervals, grouping.

Tokens of one item are correlated (a drifted item drifts for many positions), so every
confidence interval resamples *items* with replacement and recomputes the pooled
per-position mean: mean* = sum(item sums drawn) / sum(item counts drawn).
"""

from __future__ import annotations

from typing import Iterable, Sequence, cast

import numpy as np

from ..contracts import GroupStats, Stats

PERCENTILES = (("p50", 50.0), ("p90", 90.0), ("p95", 95.0), ("p99", 99.0), ("p99_9", 99.9))
DEFAULT_RANGES = (0, 1, 8, 32, 128, 512)
# Item-bootstrap resamples behind every 95 % confidence interval of a report.
DEFAULT_BOOTSTRAP = 1000
DIVERGENCES = ("kl_nats", "kl_rev_nats", "jsd_nats")


def describe(values: np.ndarray, ci95: Sequence[float | None] = (None, None)) -> Stats:
    """n, mean, p50, p90, p95, p99, p99.9 and max of a 1-D array (NaN ignored), and the
    given CI of the mean."""
    v = np.asarray(values, dtype=np.float64)
    v = v[~np.isnan(v)]
    q: dict[str, float | None] = dict.fromkeys([name for name, _ in PERCENTILES])
    if v.size:
        q.update(zip([name for name, _ in PERCENTILES], map(float, np.percentile(v, [p for _, p in PERCENTILES]))))
    return {"n": int(v.size), "mean": float(v.mean()) if v.size else None, "p50": q["p50"], "p90": q["p90"],
            "p95": q["p95"], "p99": q["p99"], "p99_9": q["p99_9"], "max": float(v.max()) if v.size else None,
            "ci95": list(ci95)}


def resample_items(item_sums: np.ndarray, item_counts: np.ndarray, *, n_boot: int, seed: int) -> np.ndarray:
    """The item bootstrap every CI of logitdiff uses: ``n_boot`` resamples of the items with
    replacement (numpy ``default_rng(seed)``), each giving the pooled mean
    sum(drawn item sums) / sum(drawn item counts). Per-item values (a paired difference, an
    item's correctness) are sums with counts of 1: the plain mean over drawn items."""
    sums = np.asarray(item_sums, dtype=np.float64)
    counts = np.asarray(item_counts, dtype=np.float64)
    n = sums.size
    draws = np.random.default_rng(seed).integers(0, n, size=(n_boot, n))
    return sums[draws].sum(1) / counts[draws].sum(1)


def item_bootstrap_ci(item_sums: np.ndarray, item_counts: np.ndarray, *, n_boot: int, seed: int,
                      alpha: float = 0.05) -> tuple[float, float, np.ndarray]:
    """The one item-bootstrap interval: :func:`resample_items`, then the percentile interval
    that leaves ``alpha / 2`` of the resampled means on each side. Returns ``(lo, hi, means)``
    (the means for a caller's own p-value)."""
    means = resample_items(item_sums, item_counts, n_boot=n_boot, seed=seed)
    lo, hi = np.quantile(means, [alpha / 2.0, 1.0 - alpha / 2.0])
    return float(lo), float(hi), means


def bootstrap_mean_ci(
    values: np.ndarray,
    item_index: np.ndarray,
    *,
    n_boot: int = DEFAULT_BOOTSTRAP,
    seed: int = 0,
    level: float = 0.95,
) -> tuple[float | None, float | None]:
    """Percentile CI of the pooled mean, resampling items. ``item_index`` maps rows to items."""
    v = np.asarray(values, dtype=np.float64)
    ok = ~np.isnan(v)
    v, idx = v[ok], np.asarray(item_index)[ok]
    if v.size == 0:
        return None, None
    _, inv = np.unique(idx, return_inverse=True)
    n_items = int(inv.max()) + 1
    sums = np.bincount(inv, weights=v, minlength=n_items)
    counts = np.bincount(inv, minlength=n_items).astype(np.float64)
    if n_items == 1 or n_boot <= 0:
        # No interval: one item has no spread to resample, and --bootstrap 0 asks for none. A
        # zero-width [mean, mean] would read as a measured, perfectly certain figure.
        return None, None
    lo, hi, _ = item_bootstrap_ci(sums, counts, n_boot=n_boot, seed=seed, alpha=1.0 - level)
    return lo, hi


def summarize_group(
    metrics: dict[str, np.ndarray],
    item_index: np.ndarray,
    *,
    n_boot: int = DEFAULT_BOOTSTRAP,
    seed: int = 0,
    fields: Sequence[str] = DIVERGENCES,
) -> GroupStats:
    """Stats of each divergence plus the top-1 disagreement rate, each mean with its CI."""
    out: GroupStats = {"n": int(len(item_index)), "n_items": int(len(np.unique(item_index)))}
    for f in fields:
        if f not in metrics:
            continue
        d = describe(metrics[f], bootstrap_mean_ci(metrics[f], item_index, n_boot=n_boot, seed=seed))
        cast("dict[str, Stats]", out)[f] = d  # f: one of GroupStats' divergence keys (DIVERGENCES)
    if "top1_match" in metrics:
        mism = (~np.asarray(metrics["top1_match"], dtype=bool)).astype(np.float64)
        rate = float(mism.mean()) if mism.size else None
        out["top1_disagreement"] = {
            "rate": rate,
            "mismatches": int(mism.sum()),
            "ci95": list(bootstrap_mean_ci(mism, item_index, n_boot=n_boot, seed=seed)),
        }
    if "nll_ref" in metrics and np.isfinite(metrics["nll_ref"]).any():
        out["nll_ref_mean"] = float(np.nanmean(metrics["nll_ref"]))
    if "nll_cand" in metrics and np.isfinite(metrics["nll_cand"]).any():
        out["nll_cand_mean"] = float(np.nanmean(metrics["nll_cand"]))
    if "nll_ref_mean" in out and "nll_cand_mean" in out:
        out["ppl_ref"] = float(np.exp(out["nll_ref_mean"]))
        out["ppl_cand"] = float(np.exp(out["nll_cand_mean"]))
        out["ppl_ratio"] = float(np.exp(out["nll_cand_mean"] - out["nll_ref_mean"]))
    return out


def range_labels(edges: Sequence[int]) -> list[str]:
    """``[a,b)`` per pair of edges and ``[last,inf)``: the ``group`` of report.json ranges."""
    e = list(edges)
    return [f"[{a},{b})" for a, b in zip(e[:-1], e[1:])] + [f"[{e[-1]},inf)"]


def range_label(pos: int, edges: Sequence[int]) -> str:
    """The range_labels label of output position ``pos`` ("n/a" before the first edge)."""
    if not len(edges):
        return "n/a"
    labels = range_labels(edges)
    for label, a, b in zip(labels, edges, list(edges[1:]) + [None]):
        if pos >= a and (b is None or pos < b):
            return label
    return "n/a"


def format_ranges(edges: Sequence[int]) -> str:
    """The ``--ranges`` text of ``edges`` (parse_ranges' inverse): ``0,1,8,32,128,512``."""
    return ",".join(str(int(e)) for e in edges)


def parse_ranges(text: str) -> tuple[int, ...]:
    try:
        edges = tuple(int(x) for x in text.split(",") if x.strip() != "")
    except ValueError:
        raise ValueError(f"--ranges {text!r}: expected comma-separated integers like 0,1,8,32") from None
    if not edges or edges[0] != 0 or any(b <= a for a, b in zip(edges, edges[1:])):
        raise ValueError(f"--ranges {text!r}: edges must start at 0 and increase")
    return edges


def by_groups(
    metrics: dict[str, np.ndarray],
    item_index: np.ndarray,
    groups: Iterable[tuple[str, np.ndarray]],
    **kw,
) -> list[GroupStats]:
    """Summaries of the rows selected by each boolean mask, labelled."""
    out: list[GroupStats] = []
    for label, mask in groups:
        mask = np.asarray(mask, dtype=bool)
        if not mask.any():
            out.append({"group": label, "n": 0, "n_items": 0})
            continue
        sub = {k: np.asarray(v)[mask] for k, v in metrics.items()}
        out.append({"group": label, **summarize_group(sub, np.asarray(item_index)[mask], **kw)})
    return out


def range_masks(positions: np.ndarray, edges: Sequence[int]):
    pos = np.asarray(positions)
    labels = range_labels(edges)
    bounds = list(edges) + [np.iinfo(np.int64).max]
    for lab, a, b in zip(labels, bounds[:-1], bounds[1:]):
        yield lab, (pos >= a) & (pos < b)
