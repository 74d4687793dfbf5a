"""Proven intervals for divergences computed from partial information. Pure numerics.

Arrays in, arrays out, float64, vectorised over rows, no I/O. Derivations and proofs are
in ``docs/bounds.md``; the names below follow it.

One side of a position is known everywhere (``w``: its probabilities, as log-probabilities
``lw``); the other side (``x``) is known exactly on some entries and elsewhere only through
constraints: per entry a box ``lo <= x_i <= hi``, and the exact total mass ``M`` of a group
of entries. Every divergence we report is a sum of per-entry terms ``phi(x_i) = w_i g(x_i /
w_i)`` with ``g`` convex, so over a group

* the minimum is attained at ``x_i = clip(tau w_i, lo_i, hi_i)`` (KKT: ``g'(x/w)`` is the
  same on every unclipped entry); for *any* ``tau`` the Lagrange dual value
  ``sum phi(x_i) + g'(tau) (M - sum x_i)`` is a lower bound (weak duality), so the bisection
  that finds ``tau`` never has to be exact for the bound to hold;
* every feasible point lies under the chords of ``phi`` over the boxes (convexity); the
  chords are linear, so their maximum over ``{box, sum = M}`` is the fractional knapsack:
  fill the steepest chords first. That is an upper bound.

``TERMS`` maps (divergence, which side is unknown) to ``g``:

    forward KL  sum p ln(p/q)        unknown p: g(t) = t ln t      unknown q: g(t) = -ln t
    reverse KL  sum q ln(q/p)        unknown p: g(t) = -ln t       unknown q: g(t) = t ln t
    JSD         (KL(P||M)+KL(Q||M))/2    either: g(t) = (t ln(2t/(1+t)) + ln(2/(1+t))) / 2

``inf`` is a real answer: ``g(t) = -ln t`` with a box reaching ``x = 0`` has no finite upper
bound (the reason is returned next to it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

LN2 = math.log(2.0)

KL, KL_REV, JSD = "kl", "kl_rev", "jsd"
DIVERGENCES = (KL, KL_REV, JSD)
# per-entry term shapes
XLOGX, NEGLOG, JS = "xlogx", "neglog", "js"
# which side of a position is unknown
UNKNOWN_REF, UNKNOWN_CAND = "ref", "cand"
TERMS = {
    (KL, UNKNOWN_REF): XLOGX, (KL, UNKNOWN_CAND): NEGLOG,
    (KL_REV, UNKNOWN_REF): NEGLOG, (KL_REV, UNKNOWN_CAND): XLOGX,
    (JSD, UNKNOWN_REF): JS, (JSD, UNKNOWN_CAND): JS,
}

# Method names, recorded in reports next to every interval.
METHOD_EXACT = "exact"                # full/full: bounds coincide with the value
METHOD_COMPACT = "compact-bounded"    # compact reference vs full candidate
METHOD_TOPK = "topk-bounded"         # top-K on both sides: seed estimate + interval
METHOD_LLAMACPP = "llamacpp-base-bounded"  # imported llama.cpp uint16 base rows

# Bisection steps on ln(tau): the bracket is at most ~1500 nats wide (float64 exponents),
# 80 halvings leave < 1e-20 of it, far below where the dual value stops changing. The
# bound is valid at any step (weak duality); more steps only tighten it.
_BISECT_STEPS = 80
_NEG_INF = -np.inf
# ... and stop once ln(tau) is pinned to 1e-13: the dual value is flat at its maximum, so a
# relative error e in tau changes the bound by O(e^2).
_BISECT_TOL = 1e-13


@dataclass
class Interval:
    """Per-row bounds of one divergence: ``lower <= exact <= upper``; ``estimate`` is the
    midpoint (worst-case error width/2) unless the method defines another; ``reason``
    says why ``upper`` is inf where it is (empty otherwise)."""

    lower: np.ndarray
    upper: np.ndarray
    estimate: np.ndarray
    reason: str = ""

    @property
    def width(self) -> np.ndarray:
        return self.upper - self.lower


def _interval(lower, upper, reason: str = "") -> Interval:
    lower = np.maximum(np.asarray(lower, dtype=np.float64), 0.0)  # divergences are >= 0
    upper = np.maximum(np.asarray(upper, dtype=np.float64), lower)
    est = np.where(np.isfinite(upper), 0.5 * (lower + upper), lower)
    if not reason and not np.isfinite(upper).all():
        reason = "no finite upper bound from the stored information"
    return Interval(lower, upper, est, reason)


# --------------------------------------------------------------------------------------
# per-entry terms, in the log domain (lx = ln x, lw = ln w; ln 0 = -inf)
# --------------------------------------------------------------------------------------


def _phi(term: str, lx: np.ndarray, lw: np.ndarray) -> np.ndarray:
    """phi(x) = w g(x/w) for arrays of ln x, ln w (x = 0 allowed)."""
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        if term == XLOGX:  # x (ln x - ln w); 0 at x = 0 (0 * -inf is NaN, set to 0)
            out = np.subtract(lx, lw)
            out *= np.exp(lx)
            out[np.isnan(out)] = 0.0
            return out
        x, w = np.exp(lx), np.exp(lw)
        if term == NEGLOG:
            return np.where(x > 0, w * (lw - lx), np.where(w > 0, np.inf, 0.0))
        # 0.5 (x ln(x/m) + w ln(w/m)), m = (x + w)/2, with d = ln x - ln w: ln x - ln m =
        # ln2 - sp(-d) and ln w - ln m = ln2 - sp(d), sp(t) = ln(1 + e^t) = max(t, 0) +
        # ln(1 + e^-|t|): one exp and one log1p serve both halves (numpy's logaddexp took
        # ~90 % of a compact comparison at V = 262,144)
        d = np.subtract(lx, lw)
        t = np.abs(d)
        np.negative(t, out=t)
        np.exp(t, out=t)
        np.log1p(t, out=t)
        a = np.maximum(-d, 0.0)
        a += t
        np.subtract(LN2, a, out=a)
        a *= x
        np.maximum(d, 0.0, out=d)
        d += t
        np.subtract(LN2, d, out=d)
        d *= w
        a[~(x > 0)] = 0.0  # x = 0 (and NaN from 0 * inf) contributes 0
        d[~(w > 0)] = 0.0
        a += d
        a *= 0.5
        return a


def _dphi(term: str, ltau: np.ndarray) -> np.ndarray:
    """g'(tau): the multiplier of the sum constraint at ratio tau = x/w."""
    if term == XLOGX:
        return ltau + 1.0
    if term == NEGLOG:
        return -np.exp(-ltau)
    return 0.5 * (LN2 + ltau - np.logaddexp(ltau, 0.0))


def divergence_terms(term: str, lx, lw) -> np.ndarray:
    """Per-entry terms phi (exposed for tests and for the exact parts of a row)."""
    return _phi(term, np.asarray(lx, np.float64), np.asarray(lw, np.float64))


# --------------------------------------------------------------------------------------
# one group: sum_i phi(x_i) over {lo_i <= x_i <= hi_i, sum_i x_i = M}
# --------------------------------------------------------------------------------------


def _placement(lt, lw_v, llo, lhi, valid) -> tuple[np.ndarray, np.ndarray]:
    """ln x and x of the placement x_i = clip(tau w_i, lo_i, hi_i) (0 off the group)."""
    lx = np.clip(lt[:, None] + lw_v, llo, lhi)
    return lx, np.where(valid, np.exp(lx), 0.0)


def _bisect_ratio(lw_v, llo, lhi, mass, valid) -> np.ndarray:
    """ln tau per row with sum_i clip(tau w_i, lo_i, hi_i) = mass (to _BISECT_TOL in ln tau)."""
    with np.errstate(invalid="ignore"):
        r_lo = np.where(valid & (llo > _NEG_INF), llo - lw_v, np.inf).min(1)
        r_hi = np.where(valid, lhi - lw_v, -np.inf).max(1)
    # all entries at lo below a (or within e^-800 of it where some lo = 0), all at hi above b
    some_zero = (valid & (llo == _NEG_INF)).any(1)
    a = np.where(some_zero, np.minimum(r_lo, r_hi - 800.0), np.minimum(r_lo, r_hi)) - 1.0
    b = r_hi + 1.0
    a = np.where(np.isfinite(a), a, 0.0)
    b = np.where(np.isfinite(b), b, 1.0)
    for _ in range(_BISECT_STEPS):
        if (b - a).max() < _BISECT_TOL:
            break
        mid = 0.5 * (a + b)
        _, x = _placement(mid, lw_v, llo, lhi, valid)
        low = x.sum(1) < mass
        a = np.where(low, mid, a)
        b = np.where(low, b, mid)
    return 0.5 * (a + b)


def group_ratio(lw, llo, lhi, mass) -> np.ndarray:
    """ln tau of the placement that minimises every divergence of `TERMS` over one group of
    every entry (``lw``, ``llo``, ``lhi`` [N, n], ``mass`` [N], as `group_bounds` reads
    them): the same for all three, since each g is strictly convex and the KKT conditions
    say x/w equal on the unclipped entries whatever g is (docs/bounds.md, section 1)."""
    lw = np.asarray(lw, np.float64)
    llo = np.asarray(llo, np.float64)
    lhi = np.maximum(np.asarray(lhi, np.float64), llo)
    valid = np.isfinite(lw)
    lo = np.where(valid, np.exp(llo), 0.0)
    hi = np.where(valid, np.exp(lhi), 0.0)
    mass = np.clip(np.asarray(mass, np.float64), lo.sum(1), hi.sum(1))
    return _bisect_ratio(np.where(valid, lw, 0.0), llo, lhi, mass, valid)


def group_bounds(term: str, lw, llo, lhi, mass, valid=None, ltau=None) -> tuple[np.ndarray, np.ndarray]:
    """Lower and upper bound of ``sum_i phi(x_i)`` over a group, per row.

    ``lw``, ``llo``, ``lhi``: [N, n] ln w, ln lo, ln hi (``-inf`` for 0); ``mass``: [N];
    ``valid``: [N, n] bool, entries of the group (others ignored). Lower: the dual value
    at the bisected ratio (a valid bound at any ratio). Upper: chords + fractional knapsack.
    ``ltau``: [N] ln tau from `group_ratio` for the same group, when the caller shares it
    between divergences (the ratio depends on the group, not on ``term``).
    """
    lw = np.asarray(lw, np.float64)
    llo = np.asarray(llo, np.float64)
    lhi = np.maximum(np.asarray(lhi, np.float64), llo)
    n_rows, n = lw.shape
    if valid is None:
        valid = np.ones(lw.shape, bool)
    valid = np.asarray(valid, bool) & np.isfinite(lw)  # entries whose known side is 0 are absent
    lo = np.where(valid, np.exp(llo), 0.0)
    hi = np.where(valid, np.exp(lhi), 0.0)
    # The exact mass must lie in [sum lo, sum hi]; rounding of the stored figures can put it
    # a few ulps outside, which the clamp absorbs (documented in docs/bounds.md).
    mass = np.clip(np.asarray(mass, np.float64), lo.sum(1), hi.sum(1))
    lw_v = np.where(valid, lw, 0.0)
    if n == 0 or not valid.any():
        z = np.zeros(n_rows)
        return z, z.copy()

    # ---- lower: dual value at tau found by bisection on ln tau ----------------------
    lt = _bisect_ratio(lw_v, llo, lhi, mass, valid) if ltau is None else np.asarray(ltau, np.float64)
    lx, x = _placement(lt, lw_v, llo, lhi, valid)
    phi = np.where(valid, _phi(term, lx, lw_v), 0.0)
    lower = phi.sum(1) + _dphi(term, lt) * (mass - x.sum(1))

    # ---- upper: chords over the boxes, steepest first ---------------------------------
    phi_lo = np.where(valid, _phi(term, np.where(valid, llo, 0.0), lw_v), 0.0)
    phi_hi = np.where(valid, _phi(term, np.where(valid, lhi, 0.0), lw_v), 0.0)
    cap = hi - lo
    with np.errstate(invalid="ignore", divide="ignore"):
        slope = np.where(cap > 0, (phi_hi - phi_lo) / np.where(cap > 0, cap, 1.0), -np.inf)
    slope = np.where(valid & np.isfinite(phi_lo), slope, -np.inf)
    base = phi_lo.sum(1)  # inf when some box starts at 0 under -ln: no finite upper bound
    rest = np.maximum(mass - lo.sum(1), 0.0)
    order = np.argsort(-slope, axis=1, kind="stable")
    s_sorted = np.take_along_axis(slope, order, 1)
    c_sorted = np.take_along_axis(cap, order, 1)
    c_before = np.cumsum(c_sorted, 1) - c_sorted
    take = np.clip(rest[:, None] - c_before, 0.0, c_sorted)
    with np.errstate(invalid="ignore"):
        gain = np.where(take > 0, s_sorted * take, 0.0).sum(1)
    upper = np.where(np.isinf(base), np.inf, base + np.where(np.isfinite(base), gain, 0.0))
    return lower, upper


def sorted_group(lw, valid) -> tuple | None:
    """What `common_box_bounds` reads of a group, which depends on ``lw`` and ``valid``
    only: computed once and shared by the divergences of one comparison. None for an
    empty group."""
    lw = np.asarray(lw, np.float64)
    n_rows, n = lw.shape
    valid = np.asarray(valid, bool) & np.isfinite(lw)
    if n == 0 or not valid.any():
        return None
    cnt = valid.sum(1)
    # ascending w; invalid entries (-inf) first, skipped by an offset per row
    lws = np.where(valid, lw, -np.inf)
    lws.sort(axis=1)
    ws = np.exp(lws)
    csum = np.zeros((n_rows, n + 1))
    np.cumsum(ws, 1, out=csum[:, 1:])  # csum[:, j] = sum ws[:, :j]
    return lws, ws, csum, cnt


def common_box_bounds(term: str, lw, llo, lhi, mass, valid, sorted_: tuple | None = None) -> tuple[np.ndarray, np.ndarray]:
    """`group_bounds` for a group whose entries share one box ``[lo, hi]`` per row (the
    unstored entries of a compact reference: every one below the smallest stored value
    and above the row's minimum). ``llo``, ``lhi``, ``mass``: [N]; ``lw``, ``valid``:
    [N, n]. One sort per row replaces the per-step work of the general case: the chord
    slopes fall as w grows for every ``g`` here (docs/bounds.md), so the knapsack fills
    the smallest ``w`` first, and the mass at ratio tau is read from prefix sums.
    ``sorted_``: `sorted_group` of ``(lw, valid)``, when the caller shares it.
    """
    n_rows, n = np.shape(lw)
    prep = sorted_group(lw, valid) if sorted_ is None else sorted_
    if prep is None:
        z = np.zeros(n_rows)
        return z, z.copy()
    lws, ws, csum, cnt = prep
    llo = np.asarray(llo, np.float64)
    lhi = np.maximum(np.asarray(lhi, np.float64), llo)
    lo, hi = np.exp(llo), np.exp(lhi)
    mass = np.clip(np.asarray(mass, np.float64), cnt * lo, cnt * hi)
    start = n - cnt  # index of the first valid entry per row
    rows = np.arange(n_rows)

    def count_below(thr):
        """Per row: number of entries (valid or not) with ln w < thr (vectorised binary search)."""
        lo_i = np.zeros(n_rows, np.int64)
        hi_i = np.full(n_rows, n, np.int64)
        for _ in range(int(n).bit_length() + 1):
            mid = (lo_i + hi_i) // 2
            less = lws[rows, np.minimum(mid, n - 1)] < thr
            go = less & (mid < hi_i)
            lo_i = np.where(go, mid + 1, lo_i)
            hi_i = np.where(go, hi_i, mid)
        return np.maximum(lo_i, start)

    def mass_at(lt):
        # x = lo for tau w <= lo, tau w in between, hi for tau w >= hi
        j_lo = count_below(llo - lt)          # entries at lo: [start, j_lo)
        j_hi = count_below(lhi - lt)          # entries at hi: [j_hi, n)
        mid_w = csum[rows, j_hi] - csum[rows, j_lo]
        return (j_lo - start) * lo + np.exp(lt) * mid_w + (n - j_hi) * hi

    lw_min = np.where(np.isfinite(lws[rows, np.minimum(start, n - 1)]), lws[rows, np.minimum(start, n - 1)], 0.0)
    lw_max = lws[:, -1]
    a = np.where(np.isfinite(llo), llo - lw_max, lhi - lw_max - 800.0) - 1.0
    b = lhi - lw_min + 1.0
    for _ in range(_BISECT_STEPS):
        if (b - a).max() < _BISECT_TOL:
            break
        mid = 0.5 * (a + b)
        low = mass_at(mid) < mass
        a = np.where(low, mid, a)
        b = np.where(low, b, mid)
    lt = 0.5 * (a + b)
    vs = np.arange(n)[None, :] >= start[:, None]  # valid entries in sorted order
    lx = np.clip(lt[:, None] + np.where(vs, lws, 0.0), llo[:, None], lhi[:, None])
    x = np.where(vs, np.exp(lx), 0.0)
    phi = np.where(vs, _phi(term, lx, np.where(vs, lws, 0.0)), 0.0)
    lower = phi.sum(1) + _dphi(term, lt) * (mass - x.sum(1))

    # upper: hi on the smallest w first (ascending order of lws), lo on the others, and the
    # chord of the one partly filled entry
    cap = hi - lo
    rest = np.maximum(mass - cnt * lo, 0.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        n_full = np.where(cap > 0, np.floor(rest / np.where(cap > 0, cap, 1.0)), 0).astype(np.int64)
    n_full = np.minimum(n_full, cnt)
    part = np.where(cap > 0, rest - n_full * cap, 0.0)
    idx = np.arange(n)[None, :] - start[:, None]  # rank among the valid entries
    full = idx < n_full[:, None]
    lxu = np.where(full, lhi[:, None], llo[:, None])
    base = np.where(vs, _phi(term, lxu, np.where(vs, lws, 0.0)), 0.0).sum(1)
    j = np.minimum(start + n_full, n - 1)  # the partly filled entry
    lwj = lws[rows, j][:, None]
    pj_hi = _phi(term, lhi[:, None], lwj)[:, 0]
    pj_lo = _phi(term, llo[:, None], lwj)[:, 0]
    has_part = (start + n_full < n) & (part > 0)
    with np.errstate(invalid="ignore"):
        gain = np.where(has_part, (pj_hi - pj_lo) / np.where(cap > 0, cap, 1.0) * part, 0.0)
    upper = np.where(np.isinf(base), np.inf, base + np.where(np.isfinite(base), gain, 0.0))
    return lower, upper


# --------------------------------------------------------------------------------------
# a compact reference vs a full candidate
# --------------------------------------------------------------------------------------


@dataclass
class CompactRows:
    """What a compact reference stores per row (all log-probabilities in nats, float64).

    ``exact_ids``/``exact_logp`` [N, E]: entries known exactly; ``band_ids``/``band_lo``/
    ``band_hi`` [N, B]: entries known to lie in a box of log-probability; ``band_mass`` [N]:
    exact mass of the band; ``rest_mass`` [N]: exact mass of every other entry;
    ``rest_max``/``rest_min`` [N]: bounds on the log-probability of each of those entries
    (``rest_min`` may be -inf). Padding ids < 0 mark absent entries.
    """

    exact_ids: np.ndarray
    exact_logp: np.ndarray
    band_ids: np.ndarray
    band_lo: np.ndarray
    band_hi: np.ndarray
    band_mass: np.ndarray
    rest_mass: np.ndarray
    rest_max: np.ndarray
    rest_min: np.ndarray

    @property
    def n(self) -> int:
        return int(self.exact_ids.shape[0])


def compact_vs_full(ref: CompactRows, cand_logp, divergences=DIVERGENCES, *, compiled: bool = True,
                    cand_p=None, threads: int | None = None) -> dict[str, Interval]:
    """Intervals of each divergence between a compact reference (unknown side, ``ref``)
    and a candidate known on every entry (``cand_logp`` [N, V], normalised log-probs).
    ``estimate`` is the minimiser's value (= ``lower``; its error is at most the width).
    ``compiled``: the compiled kernel's version of the same sums where it is built
    (kernel.compact_bounds: no sort, the ratio solved exactly; equal to the numpy code
    below to float64 summation error); ``cand_p``: exp(cand_logp) when the caller has it;
    ``threads``: the kernel's worker threads (rows in parallel; default 1). A row of
    ``cand_logp`` holding NaN or +-inf is refused (`metrics.NonFiniteLogits`), as the full
    comparison refuses such logits: NaN has no divergence, and the groups below leave out
    entries whose candidate probability is 0, which would hide an infinite forward KL."""
    lq = np.asarray(cand_logp, np.float64)
    n_rows, V = lq.shape
    bad = ~np.isfinite(lq)
    if bad.any():
        from .metrics import NonFiniteLogits

        r = int(np.nonzero(bad.any(1))[0][0])
        raise NonFiniteLogits("candidate", r, float(lq[r][bad[r]][0]))
    if compiled and tuple(divergences) == DIVERGENCES:
        from . import kernel

        got = kernel.compact_bounds(lq, np.exp(lq) if cand_p is None else cand_p, ref, threads or 1)
        if got is not None:
            return _compact_intervals(*got)
    rows = np.arange(n_rows)[:, None]
    e_ok = ref.exact_ids >= 0
    b_ok = ref.band_ids >= 0
    e_ids = np.where(e_ok, ref.exact_ids, 0)
    b_ids = np.where(b_ok, ref.band_ids, 0)
    lq_e = lq[rows, e_ids]
    lq_b = lq[rows, b_ids]
    rest = np.ones((n_rows, V + 1), bool)  # column V absorbs padding ids
    rest[rows, np.where(e_ok, e_ids, V)] = False
    rest[rows, np.where(b_ok, b_ids, V)] = False
    rest = rest[:, :V]
    rest_sorted = sorted_group(lq, rest)  # the same for every divergence: sorted once
    # Rows whose stored entries are not sorted by probability still work: every box is
    # stated explicitly.
    out = {}
    for div in divergences:
        term = TERMS[(div, UNKNOWN_REF)]
        exact = np.where(e_ok, _phi(term, np.where(e_ok, ref.exact_logp, 0.0), lq_e), 0.0).sum(1)
        bl, bu = group_bounds(term, lq_b, ref.band_lo, ref.band_hi, ref.band_mass, b_ok)
        rl, ru = common_box_bounds(term, lq, ref.rest_min, ref.rest_max, ref.rest_mass, rest, sorted_=rest_sorted)
        lower, upper = exact + bl + rl, exact + bu + ru
        reason = ""
        if not np.isfinite(upper).all():
            reason = ("reverse KL: the reference's unstored entries have no lower bound on their "
                      "probability (store one: rest_min)") if div == KL_REV else "unbounded"
        out[div] = _compact_interval(div, lower, upper, reason)
    return out


def _compact_intervals(lower, upper) -> dict[str, Interval]:
    """The kernel's [3, n] sums -> the intervals compact_vs_full returns."""
    out = {}
    for t, div in enumerate(DIVERGENCES):
        reason = ""
        if not np.isfinite(upper[t]).all():
            reason = ("reverse KL: the reference's unstored entries have no lower bound on their "
                      "probability (store one: rest_min)") if div == KL_REV else "unbounded"
        out[div] = _compact_interval(div, lower[t], upper[t], reason)
    return out


def _compact_interval(div, lower, upper, reason) -> Interval:
    iv = _interval(lower, upper, reason)
    if div == JSD:
        iv = _interval(np.minimum(iv.lower, LN2), np.minimum(iv.upper, LN2), iv.reason)
    # The estimate is the divergence at the minimising placement (the unknown mass
    # spread like the candidate's, p ∝ q where the boxes allow): the lower bound. The
    # upper bound is set by adversarial placements (mass on the candidate's least
    # likely tokens) that real models do not make; measured on the bundled ladder
    # the minimiser is far closer to the exact value than the midpoint (bench/RESULTS.md).
    iv.estimate = iv.lower.copy()
    return iv


def full_information(cand_logp, ref_logp) -> CompactRows:
    """A CompactRows holding every entry exactly (tests: bounds must then have zero width)."""
    lp = np.asarray(ref_logp, np.float64)
    n, V = lp.shape
    e = np.zeros((n, 0))
    return CompactRows(
        exact_ids=np.broadcast_to(np.arange(V), (n, V)).copy(), exact_logp=lp,
        band_ids=e.astype(np.int64), band_lo=e, band_hi=e, band_mass=np.zeros(n),
        rest_mass=np.zeros(n), rest_max=np.full(n, _NEG_INF), rest_min=np.full(n, _NEG_INF),
    )


# --------------------------------------------------------------------------------------
# top-K on both sides
# --------------------------------------------------------------------------------------


def _two_point(div: str, p_a, q_a, p_b, q_b) -> np.ndarray:
    """The divergence between the two-block distributions (p_a, p_b) and (q_a, q_b)."""
    out: np.ndarray | float = 0.0
    for p, q in ((p_a, q_a), (p_b, q_b)):
        with np.errstate(divide="ignore", invalid="ignore"):
            lp = np.log(np.maximum(p, 0.0))
            lq = np.log(np.maximum(q, 0.0))
            if div == KL:
                t = np.where(p > 0, p * (lp - lq), 0.0)
            elif div == KL_REV:
                t = np.where(q > 0, q * (lq - lp), 0.0)
            else:
                lm = np.logaddexp(lp, lq) - LN2
                t = 0.5 * (np.where(p > 0, p * (lp - lm), 0.0) + np.where(q > 0, q * (lq - lm), 0.0))
        out = out + t
    return np.asarray(out)


# Row blocks of top-K work (metrics.TOPK_BLOCK_ENTRIES entries, declared beside the seed's
# estimate, which this module builds on): every temporary of topk_vs_topk and of the seed's
# estimate is one [rows, K] array of at most that many values (8 MiB of float64), so memory
# is bounded by one block at any K, up to K = V.
from .metrics import TOPK_BLOCK_ENTRIES, topk_row_blocks  # noqa: E402, F401 (TOPK_BLOCK_ENTRIES re-exported)


def topk_vs_topk(ref_ids, ref_logp, cand_ids, cand_logp, vocab_size: int, *, floor_logp_ref: float | None = None,
                 floor_logp_cand: float | None = None, divergences=DIVERGENCES) -> dict[str, Interval]:
    """Intervals from top-K lists on both sides (served models), per row.

    Lower (data processing): the shared ids as singletons, the reference-only ids as one
    block whose candidate mass is at most (count x the candidate's K-th probability), the
    rest as one block; minimised over that one free mass in closed form. Upper: JSD from
    ``psi(p, q) <= (p + q) ln2 / 2`` on every unshared entry; forward KL only with a stated
    floor on the candidate's log-probabilities (reverse KL: on the reference's), else inf.
    ``estimate`` is the seed's approximation (`metrics.topk`), clipped into the interval.

    Any K up to V in bounded memory: rows go in blocks of ``TOPK_BLOCK_ENTRIES`` entries,
    and the shared ids are found by a binary search over each row's sorted ids
    (`metrics._lookup`), never an [N, K, K] comparison.
    """
    ir = np.asarray(ref_ids, np.int64)
    ic = np.asarray(cand_ids, np.int64)
    lp = np.asarray(ref_logp, np.float64)
    lq = np.asarray(cand_logp, np.float64)
    parts = [_topk_vs_topk_block(ir[s], lp[s], ic[s], lq[s], vocab_size, floor_logp_ref, floor_logp_cand, divergences)
             for s in topk_row_blocks(ir.shape[0], max(ir.shape[1], ic.shape[1]))]
    if len(parts) == 1:
        return parts[0]
    out = {}
    for div in divergences:
        ivs = [p[div] for p in parts]
        out[div] = Interval(np.concatenate([iv.lower for iv in ivs]), np.concatenate([iv.upper for iv in ivs]),
                            np.concatenate([iv.estimate for iv in ivs]), next((iv.reason for iv in ivs if iv.reason), ""))
    return out


def _topk_vs_topk_block(ir, lp, ic, lq, vocab_size, floor_logp_ref, floor_logp_cand, divergences) -> dict[str, Interval]:
    """`topk_vs_topk` on one block of rows."""
    from .metrics import _lookup, topk as seed_topk

    vp, vq = ir >= 0, ic >= 0
    p = np.where(vp, np.exp(lp), 0.0)
    q = np.where(vq, np.exp(lq), 0.0)
    # ref entries also in the candidate's list (and q there); candidate entries in the ref's
    shared_p, q_at = _lookup(ir, vp, ic, vq, q)
    shared_q, _ = _lookup(ic, vq, ir, vp, p)
    lq_at = np.where(shared_p, np.log(np.where(shared_p, q_at, 1.0)), 0.0)
    # Mass outside the shared set. 1 - sum of K terms is off by at most ~K ulps, so the
    # candidate's rest is moved that far towards the reference's: rounding alone never
    # makes a rest 0 (an infinite "bound") nor two equal rests differ.
    slack = 4.0 * (ir.shape[1] + 1) * np.finfo(np.float64).eps
    p_rest = np.maximum(1.0 - np.where(shared_p, p, 0.0).sum(1), 0.0)
    q_rest = np.maximum(1.0 - np.where(shared_q, q, 0.0).sum(1), 0.0)
    q_rest = q_rest + np.clip(p_rest - q_rest, -slack, slack)
    a_mask = vp & ~shared_p
    p_a = np.minimum(np.where(a_mask, p, 0.0).sum(1), p_rest)
    q_min = np.where(vq, q, np.inf).min(1) if ic.shape[1] else np.full(len(p_rest), np.inf)  # every unlisted candidate entry is <= this
    q_min = np.where(np.isfinite(q_min), q_min, 0.0)
    full_q = vq.sum(1) >= ic.shape[1]  # a short list (server gave fewer) has no such cap
    q_a_cap = np.where(full_q, np.minimum(a_mask.sum(1) * q_min, q_rest), q_rest)
    p_min = np.where(vp, p, np.inf).min(1) if ir.shape[1] else np.full(len(p_rest), np.inf)
    p_min = np.where(np.isfinite(p_min), p_min, 0.0)
    seed = seed_topk(ir, lp, ic, lq, vocab_size)
    out = {}
    for div in divergences:
        if div == KL:
            shared_terms = np.where(shared_p, p * (lp - lq_at), 0.0).sum(1)
        elif div == KL_REV:
            shared_terms = np.where(shared_p, q_at * (lq_at - lp), 0.0).sum(1)
        else:
            lm = np.logaddexp(lp, lq_at) - LN2
            shared_terms = np.where(shared_p, 0.5 * (p * (lp - lm) + q_at * (lq_at - lm)), 0.0).sum(1)
        # two blocks A (ref-only listed) and C (everything else unshared): for any f-
        # divergence the min over q_A is at equal ratios q_A/q_rest = p_A/p_rest, or at
        # the cap when that exceeds it (convex in q_A).
        with np.errstate(invalid="ignore", divide="ignore"):
            q_a_free = np.where(p_rest > 0, q_rest * p_a / np.where(p_rest > 0, p_rest, 1.0), 0.0)
        q_a = np.minimum(q_a_free, q_a_cap)
        lower = shared_terms + _two_point(div, p_a, q_a, p_rest - p_a, q_rest - q_a)
        reason = ""
        if div == JSD:
            upper = shared_terms + 0.5 * LN2 * (p_rest + q_rest)
        elif div == KL:
            if floor_logp_cand is None:
                upper = np.full(len(p_rest), np.inf)
                reason = ("forward KL from top-K lists: the candidate's probability of reference tokens "
                          "outside its top-K has no lower bound (state a log-probability floor)")
            else:
                # unshared ref entries: p ln p - p ln q <= p (ln p - floor); unlisted p <= p_min
                a_terms = np.where(a_mask, p * (lp - floor_logp_cand), 0.0).sum(1)
                tail = np.maximum(p_rest - p_a, 0.0)
                upper = shared_terms + a_terms + tail * np.maximum(np.log(np.maximum(p_min, 1e-300)) - floor_logp_cand, 0.0)
        else:
            if floor_logp_ref is None:
                upper = np.full(len(p_rest), np.inf)
                reason = ("reverse KL from top-K lists: the reference's probability of candidate tokens "
                          "outside its top-K has no lower bound (state a log-probability floor)")
            else:
                b_mask = vq & ~shared_q
                q_b = np.where(b_mask, q, 0.0).sum(1)
                b_terms = np.where(b_mask, q * (lq - floor_logp_ref), 0.0).sum(1)
                tail = np.maximum(q_rest - q_b, 0.0)
                upper = shared_terms + b_terms + tail * np.maximum(np.log(np.maximum(q_min, 1e-300)) - floor_logp_ref, 0.0)
        iv = _interval(lower, upper, reason)
        if div == JSD:
            iv = _interval(np.minimum(iv.lower, LN2), np.minimum(iv.upper, LN2))
        if div == KL:
            iv.estimate = np.clip(seed["kl_nats"], iv.lower, iv.upper)
        out[div] = iv
    return out


# --------------------------------------------------------------------------------------
# llama.cpp --kl-divergence-base rows (uint16 log-probabilities, floor at max - 16 nats)
# --------------------------------------------------------------------------------------

# Half a code step is the rounding of the stored value; LLAMACPP_SLACK adds the float32
# arithmetic llama.cpp used to compute it (docs/bounds.md: about 1e-5 nats at |log p| <= 64
# from the lse, the scale and the product; 2^-15 = 3.1e-5 keeps a 3x margin).
LLAMACPP_SLACK = 2.0 ** -15


def llamacpp_boxes(codes, scale, min_log_prob) -> tuple[np.ndarray, np.ndarray]:
    """ln lo, ln hi of every entry of llama.cpp base rows: ``codes`` [N, V] uint16,
    ``scale``/``min_log_prob`` [N] float32 as stored. Code 0 holds the floored entries
    too, so its box reaches down to 0."""
    k = np.asarray(codes).astype(np.float64)
    s = np.asarray(scale, np.float64)[:, None]
    m = np.asarray(min_log_prob, np.float64)[:, None]
    centre = m + s * k
    hi = centre + 0.5 * s + LLAMACPP_SLACK
    lo = np.where(k > 0, centre - 0.5 * s - LLAMACPP_SLACK, _NEG_INF)
    return lo, np.minimum(hi, 0.0)


def llamacpp_from_logp(logp) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Codes, scale and min_log_prob of base rows from the float32 values an import stored
    (``min_log_prob + scale * code``). The row minimum is min_log_prob exactly (the smallest
    logit always gets code 0) and the maximum has code 65535, so scale = (max - min)/65535
    up to float32 rounding (relative ~1e-7): the codes come back exactly (their error is
    65535 * 1e-7 << 0.5) and the boxes move by < 2e-6 nats, inside LLAMACPP_SLACK."""
    v = np.asarray(logp, np.float32)
    mn = v.min(1)
    scale = ((v.max(1) - mn) / np.float32(65535.0)).astype(np.float32)
    with np.errstate(invalid="ignore", divide="ignore"):
        codes = np.where(scale[:, None] > 0, np.rint((v - mn[:, None]) / np.where(scale > 0, scale, 1)[:, None]), 0)
    return np.clip(codes, 0, 65535).astype(np.uint16), scale, mn


def llamacpp_placement(codes, scale, min_log_prob, lw) -> np.ndarray:
    """ln p [N, V] of the distribution inside the boxes of llama.cpp base rows that is
    closest to ``lw`` (ln w [N, V], any positive weights): p_i = clip(tau w_i, lo_i, hi_i)
    with sum 1. With the candidate's log-probabilities it is the reference that minimises
    every divergence at once (`group_ratio`); with the stored values it is the rows read on
    their own, as a distribution (the floored entries share what the others leave, in the
    stored shape, instead of e^min_log_prob each)."""
    lo, hi = llamacpp_boxes(codes, scale, min_log_prob)
    lw = np.asarray(lw, np.float64)
    lt = group_ratio(lw, lo, hi, np.ones(lw.shape[0]))
    return np.clip(lt[:, None] + lw, lo, hi)


# How far a candidate's total probability may be from 1 for its rows to count as a
# distribution inside the boxes (then the closest reference is the candidate itself): the
# rounding of a float64 sum of V terms and of the bisection that placed it (_BISECT_TOL).
_INSIDE_MASS_TOL = 1e-9


def llamacpp_vs_full(codes, scale, min_log_prob, cand_logp, divergences=DIVERGENCES) -> dict[str, Interval]:
    """Intervals between imported llama.cpp base rows (the reference, known only up to its
    quantisation step and floor) and a full candidate [N, V] (`llamacpp_compare`)."""
    return llamacpp_compare(codes, scale, min_log_prob, cand_logp, divergences)[1]


def llamacpp_compare(codes, scale, min_log_prob, cand_logp, divergences=DIVERGENCES) -> tuple[np.ndarray, dict[str, Interval]]:
    """The reference a comparison reads from base rows, and each divergence's interval.

    One group: every entry, total mass 1. The reference read is `llamacpp_placement` at the
    candidate (ln p [N, V], float64): the distribution inside the boxes closest to the
    candidate, so each divergence's ``estimate`` is its value there, the interval's lower
    end (as for a compact reference). Not the dequantised rows renormalised: their floored
    entries carry e^min_log_prob each, 96 % of a 262,144-token row, mass the true
    distribution puts mostly where the candidate has little, which lifted a mean KL above
    its own interval (issue 40). Where the candidate itself lies in the boxes (an imported
    base against itself) the reference read is the candidate and every divergence is 0."""
    lo, hi = llamacpp_boxes(codes, scale, min_log_prob)
    lq = np.asarray(cand_logp, np.float64)
    n = lq.shape[0]
    lt = group_ratio(lq, lo, hi, np.ones(n))
    lp = np.clip(lt[:, None] + lq, lo, hi)
    inside = ((lq >= lo) & (lq <= hi)).all(1) & (np.abs(np.exp(lq).sum(1) - 1.0) <= _INSIDE_MASS_TOL)
    lp[inside] = lq[inside]
    out = {}
    for div in divergences:
        term = TERMS[(div, UNKNOWN_REF)]
        lower, upper = group_bounds(term, lq, lo, hi, np.ones(n), ltau=lt)
        lower = np.where(inside, 0.0, lower)
        reason = ""
        if not np.isfinite(upper).all():
            reason = "reverse KL: entries at llama.cpp's floor (code 0) have no lower bound on their probability"
        iv = _interval(lower, upper, reason)
        if div == JSD:
            iv = _interval(np.minimum(iv.lower, LN2), np.minimum(iv.upper, LN2))
        iv.estimate = iv.lower.copy()
        out[div] = iv
    return lp, out
