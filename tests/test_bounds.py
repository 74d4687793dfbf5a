"""Proven intervals (src/logitdiff/bounds.py) against the exact full-vocabulary value.

Every test computes the exact divergence independently in float64 with scipy and asserts
lower <= exact <= upper on every row. Tolerance: the bounds and the reference are both
float64 sums of at most V terms (pairwise summation in numpy/scipy), so each is within
~log2(V) * eps * sum|terms| of the real-number value; TOL allows 64 * eps * (sum|terms| + 1),
more than that for V <= 2^20 and still far below any width we report.
"""

from __future__ import annotations


import numpy as np
import pytest
from scipy.special import log_softmax, rel_entr

from logitdiff.numerics import bounds as B

EPS = np.finfo(np.float64).eps


def exact(lp, lq):
    p, q = np.exp(lp), np.exp(lq)
    m = 0.5 * (p + q)
    return {
        B.KL: rel_entr(p, q).sum(1),
        B.KL_REV: rel_entr(q, p).sum(1),
        B.JSD: 0.5 * (rel_entr(p, m).sum(1) + rel_entr(q, m).sum(1)),
    }


def tol(lp, lq):
    p, q = np.exp(lp), np.exp(lq)
    scale = (p * np.abs(lp - lq)).sum(1) + (q * np.abs(lp - lq)).sum(1) + 1.0
    return 64 * EPS * scale


def assert_covers(iv: B.Interval, ex: np.ndarray, t: np.ndarray, what: str):
    lo_bad = iv.lower > ex + t
    hi_bad = iv.upper < ex - t
    assert not lo_bad.any(), f"{what}: lower above exact at rows {np.nonzero(lo_bad)[0][:5]} ({iv.lower[lo_bad][:3]} > {ex[lo_bad][:3]})"
    assert not hi_bad.any(), f"{what}: upper below exact at rows {np.nonzero(hi_bad)[0][:5]} ({iv.upper[hi_bad][:3]} < {ex[hi_bad][:3]})"
    assert (iv.lower <= iv.estimate).all() and (iv.estimate <= iv.upper).all()


def compact_of(lp, n_exact, n_band):
    """A compact reference by the store's rules (largest E exact, next B banded with uint16
    codes on the row's band range, the rest summarised), built here independently of
    compact.py."""
    n, V = lp.shape
    order = np.argsort(-lp, axis=1, kind="stable")
    r = np.arange(n)[:, None]
    e_ids, b_ids, u_ids = order[:, :n_exact], order[:, n_exact:n_exact + n_band], order[:, n_exact + n_band:]
    b_lp, u_lp = lp[r, b_ids], lp[r, u_ids]
    if n_band:
        top, bot = b_lp[:, :1], b_lp[:, -1:]
        step = np.maximum((top - bot) / 65535, 1e-300)
        code = np.floor((top - b_lp) / step)
        lo, hi = top - (code + 1) * step - 1e-12, top - code * step + 1e-12
    else:
        lo = hi = np.zeros((n, 0))
    has_u = u_lp.shape[1] > 0
    return B.CompactRows(
        exact_ids=e_ids, exact_logp=lp[r, e_ids], band_ids=b_ids, band_lo=lo, band_hi=hi,
        band_mass=np.exp(b_lp).sum(1), rest_mass=np.exp(u_lp).sum(1),
        rest_max=u_lp.max(1) if has_u else np.full(n, -np.inf),
        rest_min=u_lp.min(1) if has_u else np.full(n, -np.inf),
    )


def check_compact(lp, lq, n_exact, n_band, what):
    """Both implementations (the compiled kernel where built, and numpy) cover the exact
    value, and agree with each other within the same tolerance (issue 28)."""
    ex, t = exact(lp, lq), tol(lp, lq)
    rows = compact_of(lp, n_exact, n_band)
    res = B.compact_vs_full(rows, lq)
    ref = B.compact_vs_full(rows, lq, compiled=False)
    for d in B.DIVERGENCES:
        assert_covers(res[d], ex[d], t, f"{what} {d}")
        assert_covers(ref[d], ex[d], t, f"{what} {d} (numpy)")
        for f in ("lower", "upper"):
            a, b = getattr(res[d], f), getattr(ref[d], f)
            assert (np.isinf(a) == np.isinf(b)).all(), f"{what} {d} {f}: inf differs"
            fin = np.isfinite(b)
            # float64 sums of the same terms in another order: within TOL plus 64 eps of the bound
            assert (np.abs(a[fin] - b[fin]) <= t[fin] + 64 * EPS * np.abs(b[fin])).all(), \
                f"{what} {d} {f}: compiled {a} vs numpy {b}"
    return res, ex


@pytest.mark.parametrize("V,E,nb,scale,noise", [
    (16, 1, 0, 1.0, 0.5), (64, 4, 8, 3.0, 0.3), (500, 20, 50, 2.0, 0.05), (4096, 64, 512, 4.0, 0.3),
    (4096, 256, 0, 6.0, 0.01), (300, 0, 40, 2.0, 1.0), (300, 5, 295, 2.0, 0.2),
])
def test_compact_random_rows_are_covered(V, E, nb, scale, noise):
    rng = np.random.default_rng(V + E + nb)
    z = rng.normal(size=(24, V)) * scale
    zq = z + rng.normal(size=z.shape) * noise
    check_compact(log_softmax(z, 1), log_softmax(zq, 1), E, nb, f"V={V} E={E} B={nb}")


def test_full_information_gives_zero_width_and_the_exact_value():
    rng = np.random.default_rng(1)
    z = rng.normal(size=(10, 700)) * 3
    lp, lq = log_softmax(z, 1), log_softmax(z + rng.normal(size=z.shape) * 0.2, 1)
    ex, t = exact(lp, lq), tol(lp, lq)
    res = B.compact_vs_full(B.full_information(lq, lp), lq)
    for d in B.DIVERGENCES:
        assert (res[d].width == 0).all()
        np.testing.assert_array_less(np.abs(res[d].estimate - ex[d]), t)
    # all entries exact or banded: only the band's code step remains, the rest is empty
    res2, _ = check_compact(lp, lq, 100, 600, "all stored")
    assert (res2[B.KL].width < 1e-3 * res2[B.KL].estimate + 1e-12).all()


def test_width_shrinks_as_more_is_stored():
    rng = np.random.default_rng(2)
    z = rng.normal(size=(12, 2000)) * 4
    lp, lq = log_softmax(z, 1), log_softmax(z + rng.normal(size=z.shape) * 0.1, 1)
    widths = [check_compact(lp, lq, e, b, f"E={e} B={b}")[0][B.KL].width.mean() for e, b in ((8, 0), (32, 64), (64, 512), (128, 1500))]
    assert widths == sorted(widths, reverse=True) and widths[-1] < 0.05 * widths[0]


def adversarial_rows(V=400, seed=3):
    """(name, lp, lq) rows built to break careless bounds."""
    rng = np.random.default_rng(seed)
    rows = []
    z = rng.normal(size=V) * 3
    lp = log_softmax(z)
    # the candidate puts most of its mass on the reference's least likely tokens
    zq = z.copy()
    tail = np.argsort(z)[:5]
    zq[tail] = z.max() + 4
    rows.append(("cand mass in ref tail", lp, log_softmax(zq)))
    # ties everywhere, cut through by E and B
    zt = np.round(rng.normal(size=V)) * 2
    rows.append(("ties", log_softmax(zt), log_softmax(zt + rng.normal(size=V) * 0.05)))
    # near-identical rows (KL ~ 1e-12)
    rows.append(("near-identical", lp, log_softmax(z + rng.normal(size=V) * 1e-6)))
    # identical rows
    rows.append(("identical", lp, lp.copy()))
    # a flat row: every entry equal
    flat = log_softmax(np.zeros(V))
    rows.append(("flat ref", flat, log_softmax(rng.normal(size=V))))
    rows.append(("flat both", flat, flat.copy()))
    # a peaked row: one token holds ~all mass, the rest at -60 nats
    zp = np.full(V, -60.0)
    zp[7] = 0.0
    rows.append(("peaked", log_softmax(zp), log_softmax(zp + rng.normal(size=V))))
    # the candidate is peaked where the reference is flat-ish
    rows.append(("cand peaked", log_softmax(rng.normal(size=V) * 0.1), log_softmax(zp)))
    return rows


@pytest.mark.parametrize("E,nb", [(1, 0), (5, 20), (40, 100), (0, 1)])
def test_compact_adversarial_rows_are_covered(E, nb):
    for name, lp, lq in adversarial_rows():
        check_compact(lp[None], lq[None], E, nb, f"{name} E={E} B={nb}")


def test_compact_identical_rows_have_lower_zero_and_small_upper():
    rng = np.random.default_rng(4)
    lp = log_softmax(rng.normal(size=(5, 300)) * 3, 1)
    res, _ = check_compact(lp, lp.copy(), 20, 100, "identical")
    assert (res[B.KL].lower <= 1e-12).all()


def test_reverse_kl_without_a_floor_is_unbounded_with_a_reason():
    rng = np.random.default_rng(5)
    lp = log_softmax(rng.normal(size=(3, 100)), 1)
    rows = compact_of(lp, 10, 0)
    rows.rest_min = np.full(3, -np.inf)
    lq = log_softmax(rng.normal(size=(3, 100)), 1)
    for compiled in (True, False):
        res = B.compact_vs_full(rows, lq, compiled=compiled)
        assert np.isinf(res[B.KL_REV].upper).all() and "lower bound" in res[B.KL_REV].reason
        assert np.isfinite(res[B.KL].upper).all() and np.isfinite(res[B.JSD].upper).all()


# ------------------------------------------------------------------------------------
# the group primitives on their own
# ------------------------------------------------------------------------------------


def test_group_bounds_match_brute_force_over_vertices():
    """n = 4 entries: the max of a convex function over {box, sum} is at a vertex (all but
    one coordinate at a bound); enumerate them and check lower <= true min, upper >= max."""
    import itertools

    rng = np.random.default_rng(6)
    for trial in range(40):
        n = 4
        lw = np.log(rng.dirichlet(np.ones(n)))
        lo = rng.uniform(0, 0.1, n)
        hi = lo + rng.uniform(0.01, 0.5, n)
        mass = rng.uniform(lo.sum(), hi.sum())
        for term in (B.XLOGX, B.NEGLOG, B.JS):
            lower, upper = B.group_bounds(term, lw[None], np.log(lo)[None], np.log(hi)[None], np.array([mass]))
            best, worst = np.inf, -np.inf
            for free in range(n):
                for corner in itertools.product((0, 1), repeat=n - 1):
                    x = np.empty(n)
                    others = [i for i in range(n) if i != free]
                    for i, c in zip(others, corner):
                        x[i] = hi[i] if c else lo[i]
                    x[free] = mass - x[others].sum()
                    if lo[free] - 1e-15 <= x[free] <= hi[free] + 1e-15:
                        v = B.divergence_terms(term, np.log(np.maximum(x, 1e-300)), lw).sum()
                        worst = max(worst, v)
            # the minimum: dense random feasible points can only be >= it
            for _ in range(200):
                x = lo + rng.dirichlet(np.ones(n)) * 0  # start at lo
                room = hi - lo
                y = rng.dirichlet(np.ones(n)) * (mass - lo.sum())
                y = np.minimum(y, room)
                short = mass - lo.sum() - y.sum()
                for i in np.argsort(-(room - y)):
                    add = min(short, room[i] - y[i])
                    y[i] += add
                    short -= add
                x = lo + y
                best = min(best, B.divergence_terms(term, np.log(x), lw).sum())
            assert lower[0] <= best + 1e-12, (term, trial)
            assert upper[0] >= worst - 1e-12, (term, trial)
            assert upper[0] <= worst + 0.5 * ((hi - lo) ** 2 / lo.clip(1e-3)).sum() + 1e-9  # chord gap only


def test_common_box_equals_general_group():
    rng = np.random.default_rng(7)
    n_rows, n = 6, 300
    lw = np.log(rng.dirichlet(np.ones(n), size=n_rows))
    valid = rng.random((n_rows, n)) < 0.8
    llo = np.log(rng.uniform(1e-6, 1e-4, n_rows))
    lhi = llo + rng.uniform(0.5, 4, n_rows)
    cnt = valid.sum(1)
    mass = np.exp(llo) * cnt + rng.uniform(0.1, 0.9, n_rows) * (np.exp(lhi) - np.exp(llo)) * cnt
    for term in (B.XLOGX, B.NEGLOG, B.JS):
        a = B.common_box_bounds(term, lw, llo, lhi, mass, valid)
        b = B.group_bounds(term, lw, np.broadcast_to(llo[:, None], lw.shape), np.broadcast_to(lhi[:, None], lw.shape), mass, valid)
        np.testing.assert_allclose(a[0], b[0], rtol=1e-9, atol=1e-13)
        np.testing.assert_allclose(a[1], b[1], rtol=1e-9, atol=1e-13)


# ------------------------------------------------------------------------------------
# top-K on both sides
# ------------------------------------------------------------------------------------


def topk_of(lp, k):
    order = np.argsort(-lp, axis=1, kind="stable")[:, :k]
    return order, np.take_along_axis(lp, order, 1)


@pytest.mark.parametrize("V,K,noise", [(50, 5, 0.5), (400, 8, 0.3), (400, 64, 0.05), (2000, 20, 1.0)])
def test_topk_intervals_cover(V, K, noise):
    rng = np.random.default_rng(V + K)
    z = rng.normal(size=(30, V)) * 3
    lp, lq = log_softmax(z, 1), log_softmax(z + rng.normal(size=z.shape) * noise, 1)
    ex, t = exact(lp, lq), tol(lp, lq)
    ir, vr = topk_of(lp, K)
    ic, vc = topk_of(lq, K)
    res = B.topk_vs_topk(ir, vr, ic, vc, V)
    for d in B.DIVERGENCES:
        assert_covers(res[d], ex[d], t, f"topk {d}")
    assert np.isinf(res[B.KL].upper).all() and "floor" in res[B.KL].reason
    assert np.isfinite(res[B.JSD].upper).all()
    # with a stated (true) floor the forward and reverse KL become finite and still cover
    res_f = B.topk_vs_topk(ir, vr, ic, vc, V, floor_logp_cand=float(lq.min()), floor_logp_ref=float(lp.min()))
    for d in B.DIVERGENCES:
        assert_covers(res_f[d], ex[d], t, f"topk floor {d}")
        assert np.isfinite(res_f[d].upper).all()
    # the partition bound is at least the coarse two-block bound
    assert (res[B.KL].lower >= 0).all()


def test_topk_adversarial_rows_are_covered():
    for name, lp, lq in adversarial_rows(V=300):
        lp, lq = lp[None], lq[None]
        ex, t = exact(lp, lq), tol(lp, lq)
        for K in (1, 4, 32):
            ir, vr = topk_of(lp, K)
            ic, vc = topk_of(lq, K)
            res = B.topk_vs_topk(ir, vr, ic, vc, 300, floor_logp_cand=float(lq.min()), floor_logp_ref=float(lp.min()))
            for d in B.DIVERGENCES:
                assert_covers(res[d], ex[d], t, f"topk {name} K={K} {d}")


def test_topk_lower_bound_sees_a_dropped_reference_token():
    """The candidate drops the reference's top token: its probability is at most the
    candidate's K-th, so the lower bound exceeds the coarse partition bound."""
    V, K = 1000, 4
    z = np.full(V, -8.0)
    z[:4] = [0, -1, -1.5, -2]
    zq = z.copy()
    zq[0] = -7.0  # candidate pushed token 0 out of its top-4
    zq[10:14] = -1.0
    lp, lq = log_softmax(z)[None], log_softmax(zq)[None]
    ir, vr = topk_of(lp, K)
    ic, vc = topk_of(lq, K)
    res = B.topk_vs_topk(ir, vr, ic, vc, V)
    ex = exact(lp, lq)[B.KL]
    assert res[B.KL].lower[0] <= ex[0]
    shared = np.isin(ir, ic)
    p_rest = 1 - np.exp(vr[shared]).sum()
    q_rest = 1 - np.exp(vc[np.isin(ic, ir)]).sum()
    coarse = p_rest * np.log(p_rest / q_rest)
    assert res[B.KL].lower[0] > coarse + 0.1


# ------------------------------------------------------------------------------------
# llama.cpp base rows, through the real file layout
# ------------------------------------------------------------------------------------


def read_base_rows(path):
    """(codes [rows, V], scale, min_log_prob) of every scored row of a base file."""
    from logitdiff.store.importers import read_kld_header

    n_ctx, n_vocab, n_chunk = read_kld_header(path)
    nv = 2 * ((n_vocab + 1) // 2) + 4
    n_scored = n_ctx - 1 - n_ctx // 2
    raw = path.read_bytes()
    off = 20 + 4 * n_ctx * n_chunk
    rows = np.frombuffer(raw, "<u2", count=nv * n_scored * n_chunk, offset=off).reshape(-1, nv)
    sm = np.ascontiguousarray(rows[:, :4]).view("<f4")
    return rows[:, 4:4 + n_vocab], sm[:, 0], sm[:, 1]


@pytest.mark.parametrize("spread", [1.0, 3.0, 8.0])
def test_llamacpp_base_rows_are_covered(tmp_path, spread):
    from logitdiff.store.importers import write_llamacpp_kld

    rng = np.random.default_rng(int(spread * 10))
    n_chunk, n_ctx, V = 2, 8, 600
    z = (rng.normal(size=(n_chunk, n_ctx, V)) * spread).astype(np.float32)
    z[0, 5, 3] += 30  # a peaked row: most entries fall under the -16 nat floor
    tokens = rng.integers(0, V, size=(n_chunk, n_ctx))
    path = tmp_path / "base.kld"
    write_llamacpp_kld(path, z, tokens)
    codes, scale, mn = read_base_rows(path)
    first = n_ctx // 2
    zp = z[:, first:n_ctx - 1].reshape(-1, V).astype(np.float64)
    lp = log_softmax(zp, 1)
    lq = log_softmax(zp + rng.normal(size=zp.shape) * 0.1, 1)
    ex, t = exact(lp, lq), tol(lp, lq)
    res = B.llamacpp_vs_full(codes, scale, mn, lq)
    for d in B.DIVERGENCES:
        assert_covers(res[d], ex[d], t, f"llama.cpp spread={spread} {d}")
    assert np.isinf(res[B.KL_REV].upper).any() and "floor" in res[B.KL_REV].reason
    # the boxes hold every true log-probability
    lo, hi = B.llamacpp_boxes(codes, scale, mn)
    assert (lo <= lp).all() and (lp <= hi).all()
    # what an import stores (float32 min + scale * code) gives the codes back exactly
    stored = (mn[:, None] + scale[:, None] * codes.astype(np.float32)).astype(np.float32)
    c2, s2, m2 = B.llamacpp_from_logp(stored)
    np.testing.assert_array_equal(c2, codes)
    np.testing.assert_array_equal(m2, mn)
    np.testing.assert_allclose(s2, scale, rtol=1e-6)


def test_llamacpp_boxes_edge_cases():
    # scale 0 (all logits equal): every code is 0, the box is (0, e^min + slack]
    lo, hi = B.llamacpp_boxes(np.zeros((1, 4), np.uint16), np.zeros(1, np.float32), np.full(1, np.log(0.25), np.float32))
    assert np.isneginf(lo).all() and np.allclose(hi, np.log(0.25) + B.LLAMACPP_SLACK)


def test_topk_at_k_equal_v_is_exact_in_bounded_memory():
    """K = V (full rows given as top-K lists, a legitimate request for full served rows):
    the lower bound, the seed's estimate and JSD's interval are the exact full-row values,
    and the work is per row block with a sorted-id search, never an [N, K, K] comparison:
    the peak memory above the inputs is a small multiple of one [block, K] array, far under
    one [N, K, K] bool array (N K^2 bytes)."""
    import tracemalloc

    V, N = 4096, 300  # 1.2 M entries: two row blocks
    rng = np.random.default_rng(7)
    z = rng.normal(size=(N, V)) * 2
    lp, lq = log_softmax(z, 1), log_softmax(z + rng.normal(size=z.shape) * 0.3, 1)
    # each side's list in its own order (descending logprob), as servers send them
    ir, vr = topk_of(lp, V)
    ic, vc = topk_of(lq, V)
    ex, t = exact(lp, lq), tol(lp, lq)
    tracemalloc.start()
    res = B.topk_vs_topk(ir, vr, ic, vc, V, floor_logp_cand=float(lq.min()), floor_logp_ref=float(lp.min()))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    nkk = N * V * V  # bytes of one [N, K, K] bool comparison (5 GB here)
    block = B.TOPK_BLOCK_ENTRIES * 8  # one [block rows, K] float64 array (8 MiB)
    assert peak < 24 * block < nkk / 20, (peak, block, nkk)
    for d in B.DIVERGENCES:
        assert_covers(res[d], ex[d], t, f"K=V {d}")
        # every id listed on both sides: nothing unknown, the interval is the exact value
        np.testing.assert_allclose(res[d].lower, ex[d], rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(res[d].upper, ex[d], rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(res[B.KL].estimate, ex[B.KL], rtol=1e-9, atol=1e-12)
    # the same rows cut into K < V lists: block results equal a one-block run (row order kept)
    from logitdiff.numerics import metrics as M

    seed = M.topk(ir, vr, ic, vc, V)
    np.testing.assert_allclose(seed["kl_nats"], ex[B.KL], rtol=1e-9, atol=1e-12)
    assert (seed["shared_tokens"] == V).all() and (seed["top1_ref"] == lp.argmax(1)).all()
    one = B.topk_vs_topk(ir[:, :100], vr[:, :100], ic[:, :100], vc[:, :100], V)
    rows = [B.topk_vs_topk(ir[i:i + 1, :100], vr[i:i + 1, :100], ic[i:i + 1, :100], vc[i:i + 1, :100], V) for i in range(0, N, 17)]
    for d in B.DIVERGENCES:
        np.testing.assert_array_equal(one[d].lower[::17], np.concatenate([r[d].lower for r in rows]))
