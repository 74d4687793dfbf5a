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
    from ..store.compact import log_softmax

    specs = [C.parse_spec(x) for x in compact_specs]
    from . import check_floor_value, check_same_tokens, pair_items
    from .methods import form_of, owner
    from ..store.kinds import RowsForm

    not_full = next((r for r in (ref, cand) if form_of(r) is not RowsForm.FULL), None)
    if not_full is not None:
        raise LogitdiffError(f"topk-error needs two full-logit runs ({not_full.path} stores {not_full.kind.describe()})")
    check_same_tokens(ref, cand)
    items_r, items_c, _ = pair_items(ref, cand)
    V = ref.vocab_size
    check_floor_value(logprob_floor, V)
    logprob_min = np.inf
    ks = [k for k in ks]
    over = [k for k in ks if k > V]
    if over:
        raise LogitdiffError(f"--top-k {over[0]} exceeds the vocabulary size {V}")
    kmax = max(ks)
    if max_batch_rows is None:
        max_batch_rows = rows_per_block(V, chunk_bytes)
    exact, top1 = [], []
    exact_rev, exact_jsd = [], []
    bnd: dict = {k: {d: ([], []) for d in Bd.DIVERGENCES} for k in ks}
    cbnd: dict = {sp.text: {d: ([], [], []) for d in Bd.DIVERGENCES} for sp in specs}
    approx: dict[int, list] = {k: [] for k in ks}
    approx_top1: dict[int, list] = {k: [] for k in ks}
    top_mass: dict[int, list] = {k: [] for k in ks}
    next_all = np.concatenate([it.next_tokens for it in items_r]) if items_r else np.zeros(0, np.int64)
    a0 = 0
    for zr, zc in zip(ref.row_blocks(items_r, max_batch_rows), cand.row_blocks(items_c, max_batch_rows)):
        # float32, as the compact store keeps them (compact.encode): the exact value and the
        # intervals are then of the same numbers (a float64 run's rows would differ from
        # their stored float32 copy by ~1e-9 nats, outside the coverage tolerance)
        zr, zc = np.asarray(zr, np.float32), np.asarray(zc, np.float32)
        # exact metrics and each side's top-kmax from one pass; every prefix is the top-k
        m = M.full_vocab(zr, zc, k=min(10, V), top_k_out=kmax)
        for run, items, z, side in ((ref, items_r, zr, "ref"), (cand, items_c, zc, "cand")):
            lmin = _min_logprob(z, m[f"topk_ids_{side}"], m[f"topk_logprobs_{side}"])
            logprob_min = min(logprob_min, float(lmin.min()) if lmin.size else np.inf)
            if logprob_floor is not None and (lmin < logprob_floor).any():
                r = int(np.argmax(lmin < logprob_floor))
                it, row = owner(items, a0 + r)
                raise LogitdiffError(f"{run.path}: item {it.id!r} position {it.positions[row]}: log-probability "
                                     f"{float(lmin[r]):.4f} is below --logprob-floor {logprob_floor}")
        exact.append(m["kl_nats"])
        exact_rev.append(m["kl_rev_nats"])
        exact_jsd.append(m["jsd_nats"])
        top1.append(m["top1_match"])
        ir, lr, ic, lc = m["topk_ids_ref"], m["topk_logprobs_ref"], m["topk_ids_cand"], m["topk_logprobs_cand"]
        for k in ks:
            t = M.topk(ir[:, :k], lr[:, :k], ic[:, :k], lc[:, :k], V, eps=eps)
            approx[k].append(t["kl_nats"])
            ivs = Bd.topk_vs_topk(ir[:, :k], lr[:, :k], ic[:, :k], lc[:, :k], V, floor_logp_ref=logprob_floor,
                                  floor_logp_cand=logprob_floor)
            for d in Bd.DIVERGENCES:
                bnd[k][d][0].append(ivs[d].lower)
                bnd[k][d][1].append(ivs[d].upper)
            approx_top1[k].append(t["top1_match"])
            top_mass[k].append(t["reference_top_mass"])
        if specs:
            # ~32 MiB of float64 rows at a time (the bounds hold a few [rows, V] arrays)
            step = max(1, (32 << 20) // (V * 8))
            y = next_all[a0 : a0 + zr.shape[0]]
            for a in range(0, zr.shape[0], step):
                lq = log_softmax(zc[a:a + step])
                for sp in specs:
                    ivs = Bd.compact_vs_full(C.decode(C.encode(zr[a:a + step], y[a:a + step], sp)), lq)
                    for d in Bd.DIVERGENCES:
                        for j, arr in enumerate((ivs[d].lower, ivs[d].upper, ivs[d].estimate)):
                            cbnd[sp.text][d][j].append(arr)
        a0 += zr.shape[0]
    ex = np.concatenate(exact) if exact else np.zeros(0)
    t1 = np.concatenate(top1) if top1 else np.zeros(0, bool)
    if ex.size == 0:
        raise LogitdiffError(f"{ref.path} and {cand.path}: no positions to compare")

    def stats(x):
        return {"mean": float(x.mean()), "p95": float(np.percentile(x, 95)), "max": float(x.max())}

    exact_of = {"kl": ex, "kl_rev": np.concatenate(exact_rev), "jsd": np.concatenate(exact_jsd)}

    def check(d, lower, upper, est=None):
        x = exact_of[d]
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

    out_rows = []
    for k in ks:
        approx_k = np.concatenate(approx[k])
        err = approx_k - ex
        nz = ex > 1e-12
        rel = np.abs(err[nz]) / ex[nz] if nz.any() else np.zeros(0)
        s = stats(approx_k)
        out_rows.append({
            "k": k,
            "approx_mean": s["mean"],
            "approx_p95": s["p95"],
            "approx_max": s["max"],
            "mean_abs_err": float(np.abs(err).mean()),
            "max_abs_err": float(np.abs(err).max()),
            "mean_signed_err": float(err.mean()),
            "rel_err_of_mean": float(abs(approx_k.mean() - ex.mean()) / ex.mean()) if ex.mean() > 0 else 0.0,
            "median_rel_err": float(np.median(rel)) if rel.size else 0.0,
            "top1_agreement": float(np.concatenate(approx_top1[k]).mean()),
            "ref_top_mass_mean": float(np.concatenate(top_mass[k]).mean()),
            "bounds": {d: check(d, np.concatenate(bnd[k][d][0]), np.concatenate(bnd[k][d][1])) for d in Bd.DIVERGENCES},
        })
    compact_rows = []
    for sp in specs:
        b = cbnd[sp.text]
        compact_rows.append({"store": sp.text, "bounds": {
            d: check(d, np.concatenate(b[d][0]), np.concatenate(b[d][1]), np.concatenate(b[d][2])) for d in Bd.DIVERGENCES}})
    return {
        "reference": str(ref.path),
        "candidate": str(cand.path),
        "n": int(ex.size),
        "items": len(items_r),
        "vocab_size": int(V),
        "epsilon": eps,
        "method": "seed top-K approximation (metrics.topk) vs exact full-vocabulary KL (metrics.full_vocab), nats",
        "exact": {**stats(ex), "top1_agreement": float(t1.mean()), "kl_rev_mean": float(exact_of["kl_rev"].mean()),
                  "jsd_mean": float(exact_of["jsd"].mean()), "logprob_min": logprob_min},
        "logprob_floor": logprob_floor,
        "rows": out_rows,
        "compact": compact_rows,
        "bounds_method": "proven intervals of docs/bounds.md checked against the exact values; coverage must be 1.0",
    }
