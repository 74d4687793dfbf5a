"""How wrong is a top-K comparison? Two full-logit RUNs give the exact full-vocabulary KL;
:func:`topk_error` sets it next to the seed's top-K approximation at several K and checks
the proven intervals (docs/bounds.md) of top-K/top-K and compact-reference comparisons
against it (``logitdiff topk-error``).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..numerics import metrics as M
from ..errors import LogitdiffError
from ..store import RunReader, rows_per_block


def parse_ks(text: str) -> list[int]:
    try:
        ks = sorted({int(x) for x in str(text).split(",") if x.strip()})
    except ValueError:
        raise LogitdiffError(f"--top-k {text!r}: expected comma-separated integers, e.g. 8,20,64,256") from None
    if not ks or ks[0] < 1:
        raise LogitdiffError(f"--top-k {text!r}: every K must be >= 1")
    return ks


# Coverage check tolerance, nats: the exact value (metrics.full_vocab, difference form) and
# the bounds are float64 computations whose rounding is < ~1e-13 + 1e-13 x value for logits
# of magnitude <= 100 (docs/bounds.md, "Rounding"); 1e-12 leaves a 10x margin.
COVERAGE_TOL = 1e-12


def _covered(lower, upper, exact) -> np.ndarray:
    tol = COVERAGE_TOL * (1.0 + exact)
    return (lower <= exact + tol) & (exact <= upper + tol)


def _min_logprob(z: np.ndarray, top_ids: np.ndarray, top_logprobs: np.ndarray) -> np.ndarray:
    """Each row's smallest log-probability from the metrics' own pass: ln p_min = (z_min -
    z_top) + ln p_top (the top entry's normalised log-probability), so the only extra work
    is one float32 min over the rows, not another logsumexp."""
    rows = np.arange(len(z))
    z_top = z[rows, top_ids[:, 0]].astype(np.float64)
    return (z.min(1).astype(np.float64) - z_top) + top_logprobs[:, 0]


def topk_error(ref: RunReader, cand: RunReader, ks: Sequence[int], *, eps: float = 1e-12, max_batch_rows: int | None = None,
               compact_specs: Sequence[str] = (), chunk_bytes: int | None = None, logprob_floor: float | None = None) -> dict:
    """Exact KL(P_ref || P_cand) vs the seed's top-K approximation at each K.

    Both runs must hold full logits. Rows stream through in blocks that cross item
    boundaries (``max_batch_rows``, default a chunk of float32 rows); each side's top-kmax is
    taken per block, so memory is a few blocks plus per-position scalars. Returns ``{"n",
    "vocab_size", "exact": {...}, "rows": [{"k", "approx_mean", "approx_p95", "approx_max",
    "mean_abs_err", "max_abs_err", "rel_err_of_mean", "median_rel_err", "top1_agreement", ...,
    "bounds": {...}}], "compact": [...]}``. Every row also checks the proven intervals of
    docs/bounds.md against the exact values: per K the top-K/top-K intervals (forward KL,
    reverse KL, JSD), per compact store spec (``compact_specs``) the compact-reference
    intervals; ``coverage`` must be 1.0. ``logprob_floor``: a stated floor (nats) on every
    log-probability of both runs, checked here against their full rows, which gives the
    top-K/top-K forward and reverse KL finite upper bounds (compare --logprob-floor);
    ``exact["logprob_min"]`` is the lowest log-probability of either run, the tightest true
    floor.
    """
    from ..numerics import bounds as Bd
    from ..store import compact as C

    specs = [C.parse_spec(x) for x in compact_specs]
    ks = list(ks)
    items_r, items_c, V = _paired(ref, cand, ks, logprob_floor)
    if max_batch_rows is None:
        max_batch_rows = rows_per_block(V, chunk_bytes)
    col = _Columns(ks, [sp.text for sp in specs])
    next_all = np.concatenate([it.next_tokens for it in items_r]) if items_r else np.zeros(0, np.int64)
    a0 = 0
    for zr, zc in zip(ref.row_blocks(items_r, max_batch_rows), cand.row_blocks(items_c, max_batch_rows)):
        # float32, as the compact store keeps them (compact.encode): the exact value and the
        # intervals are then of the same numbers (a float64 run's rows would differ from
        # their stored float32 copy by ~1e-9 nats, outside the coverage tolerance)
        zr, zc = np.asarray(zr, np.float32), np.asarray(zc, np.float32)
        # exact metrics and each side's top-kmax from one pass; every prefix is the top-k
        m = M.full_vocab(zr, zc, k=min(10, V), top_k_out=max(ks))
        for run, items, z, side in ((ref, items_r, zr, "ref"), (cand, items_c, zc, "cand")):
            col.logprob_min = min(col.logprob_min, _checked_floor(run, items, z, m, side, a0, logprob_floor))
        col.add_exact(m)
        col.add_topk(m, ks, V, eps, logprob_floor)
        if specs:
            col.add_compact(zr, zc, next_all[a0 : a0 + zr.shape[0]], specs, V)
        a0 += zr.shape[0]
    ex = np.concatenate(col.exact["kl"]) if col.exact["kl"] else np.zeros(0)
    if ex.size == 0:
        raise LogitdiffError(f"{ref.path} and {cand.path}: no positions to compare")
    t1 = np.concatenate(col.top1)
    exact_of = {d: np.concatenate(col.exact[d]) for d in ("kl", "kl_rev", "jsd")}
    compact_rows = []
    for sp in specs:
        b = col.compact[sp.text]
        compact_rows.append({"store": sp.text, "bounds": {
            d: _check_bounds(exact_of[d], np.concatenate(b[d][0]), np.concatenate(b[d][1]), np.concatenate(b[d][2]))
            for d in Bd.DIVERGENCES}})
    return {
        "reference": str(ref.path),
        "candidate": str(cand.path),
        "n": int(ex.size),
        "items": len(items_r),
        "vocab_size": int(V),
        "epsilon": eps,
        "method": "seed top-K approximation (metrics.topk) vs exact full-vocabulary KL (metrics.full_vocab), nats",
        "exact": {**_stats(ex), "top1_agreement": float(t1.mean()), "kl_rev_mean": float(exact_of["kl_rev"].mean()),
                  "jsd_mean": float(exact_of["jsd"].mean()), "logprob_min": col.logprob_min},
        "logprob_floor": logprob_floor,
        "rows": [_k_row(k, col, exact_of) for k in ks],
        "compact": compact_rows,
        "bounds_method": "proven intervals of docs/bounds.md checked against the exact values; coverage must be 1.0",
    }


def _paired(ref: RunReader, cand: RunReader, ks: Sequence[int], logprob_floor: float | None) -> tuple[list, list, int]:
    """Both runs' paired items and the vocabulary size, after the checks: two full-logit
    runs of the same tokens, a valid floor, every K within the vocabulary."""
    from . import check_floor_value, check_same_tokens, pair_items
    from .methods import form_of
    from ..store.kinds import RowsForm

    not_full = next((r for r in (ref, cand) if form_of(r) is not RowsForm.FULL), None)
    if not_full is not None:
        raise LogitdiffError(f"topk-error needs two full-logit runs ({not_full.path} stores {not_full.kind.describe()})")
    check_same_tokens(ref, cand)
    items_r, items_c, _ = pair_items(ref, cand)
    V = ref.vocab_size
    check_floor_value(logprob_floor, V)
    over = [k for k in ks if k > V]
    if over:
        raise LogitdiffError(f"--top-k {over[0]} exceeds the vocabulary size {V}")
    return items_r, items_c, V


def _checked_floor(run: RunReader, items, z: np.ndarray, m: dict, side: str, a0: int, logprob_floor: float | None) -> float:
    """The block's lowest log-probability of one side (inf for an empty block); one line
    naming the item and position of a row below the stated floor."""
    from .methods import owner

    lmin = _min_logprob(z, m[f"topk_ids_{side}"], m[f"topk_logprobs_{side}"])
    if logprob_floor is not None and (lmin < logprob_floor).any():
        r = int(np.argmax(lmin < logprob_floor))
        it, row = owner(items, a0 + r)
        raise LogitdiffError(f"{run.path}: item {it.id!r} position {it.positions[row]}: log-probability "
                             f"{float(lmin[r]):.4f} is below --logprob-floor {logprob_floor}")
    return float(lmin.min()) if lmin.size else np.inf


class _Columns:
    """The per-position figures gathered block by block: exact divergences and top-1, per K
    the approximation, its intervals, top-1 and the reference's top mass, per compact store
    its intervals and estimate."""

    def __init__(self, ks: Sequence[int], compact_specs: Sequence[str]):
        from ..numerics import bounds as Bd

        self.logprob_min = np.inf
        self.exact: dict[str, list] = {"kl": [], "kl_rev": [], "jsd": []}
        self.top1: list = []
        self.bounds: dict = {k: {d: ([], []) for d in Bd.DIVERGENCES} for k in ks}
        self.compact: dict = {sp: {d: ([], [], []) for d in Bd.DIVERGENCES} for sp in compact_specs}
        self.approx: dict[int, list] = {k: [] for k in ks}
        self.approx_top1: dict[int, list] = {k: [] for k in ks}
        self.top_mass: dict[int, list] = {k: [] for k in ks}

    def add_exact(self, m: dict) -> None:
        self.exact["kl"].append(m["kl_nats"])
        self.exact["kl_rev"].append(m["kl_rev_nats"])
        self.exact["jsd"].append(m["jsd_nats"])
        self.top1.append(m["top1_match"])

    def add_topk(self, m: dict, ks: Sequence[int], V: int, eps: float, logprob_floor: float | None) -> None:
        from ..numerics import bounds as Bd

        ir, lr, ic, lc = m["topk_ids_ref"], m["topk_logprobs_ref"], m["topk_ids_cand"], m["topk_logprobs_cand"]
        for k in ks:
            t = M.topk(ir[:, :k], lr[:, :k], ic[:, :k], lc[:, :k], V, eps=eps)
            self.approx[k].append(t["kl_nats"])
            ivs = Bd.topk_vs_topk(ir[:, :k], lr[:, :k], ic[:, :k], lc[:, :k], V, floor_logp_ref=logprob_floor,
                                  floor_logp_cand=logprob_floor)
            for d in Bd.DIVERGENCES:
                self.bounds[k][d][0].append(ivs[d].lower)
                self.bounds[k][d][1].append(ivs[d].upper)
            self.approx_top1[k].append(t["top1_match"])
            self.top_mass[k].append(t["reference_top_mass"])

    def add_compact(self, zr: np.ndarray, zc: np.ndarray, y: np.ndarray, specs: Sequence, V: int) -> None:
        from ..numerics import bounds as Bd
        from ..store import compact as C
        from ..store.compact import log_softmax

        # ~32 MiB of float64 rows at a time (the bounds hold a few [rows, V] arrays)
        step = max(1, (32 << 20) // (V * 8))
        for a in range(0, zr.shape[0], step):
            lq = log_softmax(zc[a:a + step])
            for sp in specs:
                ivs = Bd.compact_vs_full(C.decode(C.encode(zr[a:a + step], y[a:a + step], sp)), lq)
                for d in Bd.DIVERGENCES:
                    for j, arr in enumerate((ivs[d].lower, ivs[d].upper, ivs[d].estimate)):
                        self.compact[sp.text][d][j].append(arr)


def _stats(x: np.ndarray) -> dict:
    return {"mean": float(x.mean()), "p95": float(np.percentile(x, 95)), "max": float(x.max())}


def _check_bounds(x: np.ndarray, lower: np.ndarray, upper: np.ndarray, est: np.ndarray | None = None) -> dict:
    """One interval's check against the exact values ``x``: coverage, mean bounds, width."""
    width = upper - lower
    r = {
        "coverage": float(_covered(lower, upper, x).mean()),
        "lower_mean": float(lower.mean()),
        "upper_mean": float(upper.mean()),  # inf: no finite upper bound (docs/bounds.md)
        "mean_width": float(width.mean()),
        "width_over_exact_mean": float(width.mean() / x.mean()) if x.mean() > 0 else None,
    }
    if est is not None:
        r["estimate_mean"] = float(est.mean())
        r["estimate_rel_err_of_mean"] = float(abs(est.mean() - x.mean()) / x.mean()) if x.mean() > 0 else 0.0
    return r


def _k_row(k: int, col: _Columns, exact_of: dict[str, np.ndarray]) -> dict:
    """The row of one K: the approximation against the exact KL, and its intervals checked."""
    from ..numerics import bounds as Bd

    ex = exact_of["kl"]
    approx_k = np.concatenate(col.approx[k])
    err = approx_k - ex
    nz = ex > 1e-12
    rel = np.abs(err[nz]) / ex[nz] if nz.any() else np.zeros(0)
    s = _stats(approx_k)
    return {
        "k": k,
        "approx_mean": s["mean"],
        "approx_p95": s["p95"],
        "approx_max": s["max"],
        "mean_abs_err": float(np.abs(err).mean()),
        "max_abs_err": float(np.abs(err).max()),
        "mean_signed_err": float(err.mean()),
        "rel_err_of_mean": float(abs(approx_k.mean() - ex.mean()) / ex.mean()) if ex.mean() > 0 else 0.0,
        "median_rel_err": float(np.median(rel)) if rel.size else 0.0,
        "top1_agreement": float(np.concatenate(col.approx_top1[k]).mean()),
        "ref_top_mass_mean": float(np.concatenate(col.top_mass[k]).mean()),
        "bounds": {d: _check_bounds(exact_of[d], np.concatenate(col.bounds[k][d][0]), np.concatenate(col.bounds[k][d][1]))
                   for d in Bd.DIVERGENCES},
    }
