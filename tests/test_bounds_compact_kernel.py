"""The compiled compact-reference kernel from raw candidate logits (issue 28,
`kernel.compact_rows`, used by `compact.compare_rows`): it computes the candidate's side
(max, ln sum exp, entropy, top-k ids) and the bounds in one call. Against numpy (the same
columns to float64 summation error), against scipy (the intervals contain the exact
values) on random, adversarial and tie-heavy rows in every dtype the store holds, and its
refusal of NaN/inf candidate rows, as the full-store compare refuses them."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.special import log_softmax
from test_bounds import EPS, adversarial_rows, assert_covers, exact, tol

from logitdiff.numerics import bounds as B
from logitdiff.store import compact as C
from logitdiff.numerics import kernel
from logitdiff.compare import compare_runs
from logitdiff.errors import LogitdiffError
from logitdiff.numerics.metrics import NonFiniteLogits
from logitdiff.store import RunReader


def kernel_rows(z, block, kk, threads, isa="auto"):
    """`kernel.compact_rows` with the rest box and slack `compact` gives it."""
    return kernel.compact_rows(z, block, kk, threads, isa, rest_box=C.decode_rest(block), box_slack=C.BOX_SLACK)

pytestmark = pytest.mark.skipif(not kernel.available(), reason="compiled kernel not built")

DTYPES = ("float32", "bfloat16", "float16")


def raw_of(z: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """Raw rows as the store holds them (bf16: uint16 bits, rounded to nearest even) and
    their exact float32 values."""
    z32 = np.asarray(z, np.float32)
    if dtype == "float32":
        return z32, z32
    if dtype == "float16":
        h = z32.astype(np.float16)
        return h, h.astype(np.float32)
    b = z32.view(np.uint32)
    bits = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)
    return bits, (bits.astype(np.uint32) << 16).view(np.float32)


def check(z_ref, z_cand, dtype, spec, what, top_k=16, overlap_k=4):
    """compare_rows from the kernel and from numpy on the same rows: every column equal
    to float64 summation error, top ids identical, intervals containing scipy's values."""
    raw, zc = raw_of(z_cand, dtype)
    n = raw.shape[0]
    top_k, overlap_k = min(top_k, spec.exact), min(overlap_k, spec.exact)  # the reference's tops are its exact entries
    y = np.arange(n) % raw.shape[1]
    z_ref = np.asarray(z_ref, np.float32)  # the reference's logits as captured: float32
    block = C.encode(z_ref, y, spec)
    fused = C.compare_rows(block, raw, y, top_k=top_k, overlap_k=overlap_k, threads=2)
    ref = C._compare_rows_numpy(block, raw, y, top_k=top_k, overlap_k=overlap_k, eps=1e-12)
    lp = log_softmax(z_ref.astype(np.float64), 1)
    lq = log_softmax(zc.astype(np.float64), 1)
    ex, t = exact(lp, lq), tol(lp, lq)
    for div, col in (("kl", "kl_nats"), ("kl_rev", "kl_rev_nats"), ("jsd", "jsd_nats")):
        lo, hi = fused[col.replace("_nats", "_lower_nats")], fused[col.replace("_nats", "_upper_nats")]
        assert_covers(B.Interval(lo, hi, fused[col]), ex[div], t, f"{what} {dtype} {div}")
    for k, a in fused.items():
        b = ref[k]
        if k == "_tops":
            assert np.array_equal(a[0], b[0]) and np.array_equal(a[2], b[2]), f"{what} {dtype}: top ids differ"
            np.testing.assert_allclose(a[3], b[3], rtol=0, atol=64 * EPS * (1 + np.abs(b[3])).max())
            continue
        a, b = np.asarray(a), np.asarray(b)
        if a.dtype.kind != "f":
            assert np.array_equal(a, b), f"{what} {dtype} {k}"
            continue
        assert (np.isinf(a) == np.isinf(b)).all(), f"{what} {dtype} {k}: inf differs"
        fin = np.isfinite(b)
        bound = t[fin] + 64 * EPS * np.abs(b[fin])
        assert (np.abs(a[fin] - b[fin]) <= bound).all(), f"{what} {dtype} {k}: kernel {a[fin][:4]} numpy {b[fin][:4]}"
    return fused


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("V,spec", [(3000, C.CompactSpec(64, 512)), (700, C.CompactSpec(8, 40, 8)),
                                    (300, C.CompactSpec(2, 0)), (257, C.CompactSpec(16, 241))])
def test_kernel_matches_numpy_and_covers_random_rows(dtype, V, spec):
    rng = np.random.default_rng(V)
    z = rng.normal(0, 3, (9, V)) + 8 * (rng.random((9, V)) < 0.01)
    check(z, z + rng.normal(0, 0.3, z.shape), dtype, spec, f"V={V}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_matches_numpy_and_covers_adversarial_rows(dtype):
    for name, lp, lq in adversarial_rows():
        # logits as stored: the rows' log-probabilities (any shift gives the same softmax)
        check(lp[None], lq[None], dtype, C.CompactSpec(5, 20), name)
        check(lp[None], lq[None], dtype, C.CompactSpec(2, 0), name)


def test_kernel_ties_at_the_fill_threshold():
    """Quantised candidate logits put thousands of entries on one value, so the rest's fill
    threshold falls inside a tie: its terms are counted, not selected (kernel) or sorted
    (numpy); both agree and cover."""
    rng = np.random.default_rng(11)
    z = np.round(rng.normal(0, 2, (6, 5000)) * 2) / 2
    zc = np.round((z + rng.normal(0, 0.5, z.shape)) * 2) / 2
    for spec in (C.CompactSpec(16, 64), C.CompactSpec(4, 0)):
        check(z, zc, "bfloat16", spec, "ties")


def test_candidate_side_matches_scipy():
    """max, ln sum exp, entropy and top-k of the candidate from the kernel against float64."""
    rng = np.random.default_rng(3)
    z = (rng.normal(0, 4, (5, 2000))).astype(np.float32)
    z[2, 100:110] = z[2].max()  # a tie at the top: lowest ids first
    block = C.encode(z, np.zeros(5, np.int64), C.CompactSpec(8, 32))
    out = kernel_rows(z, block, 12, 1)
    zd = z.astype(np.float64)
    m = zd.max(1)
    ls = np.log(np.exp(zd - m[:, None]).sum(1))
    lq = log_softmax(zd, 1)
    np.testing.assert_array_equal(out["max"], m)
    # float64 error analysis (docs/bounds.md, Rounding): s = sum e carries a relative error of
    # a few ulp per exp_pd term plus the sums' (~log2 V eps on either side, kernel and numpy),
    # so ln s is off by <= 64 eps (1 + |ln s|); H = ln s - sum q a by <= 64 eps (|ln s| + sum q |a|)
    np.testing.assert_array_less(np.abs(out["log_sum"] - ls), 64 * EPS * (1 + np.abs(ls)))
    a = zd - m[:, None]
    h_scale = np.abs(ls) + (np.exp(lq) * np.abs(a)).sum(1)
    np.testing.assert_array_less(np.abs(out["entropy"] + (np.exp(lq) * lq).sum(1)), 64 * EPS * h_scale)
    want = np.stack([np.lexsort((np.arange(2000), -zd[r]))[:12] for r in range(5)])
    np.testing.assert_array_equal(out["top_ids"], want)
    assert not out["bad"].any()


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("dtype", DTYPES)
def test_nonfinite_candidate_rows_are_refused(value, dtype):
    """NaN or +-inf anywhere in a raw candidate row: the kernel flags the row, compare_rows
    raises naming it (the full-store compare refuses such logits too)."""
    rng = np.random.default_rng(5)
    z = rng.normal(0, 2, (4, 600)).astype(np.float32)
    block = C.encode(z, np.zeros(4, np.int64), C.CompactSpec(8, 40))
    bad = z.copy()
    bad[2, 597] = value  # in the scalar tail of the 8-wide scan
    bad[3, 5] = value
    raw, _ = raw_of(bad, dtype)
    if dtype == "bfloat16":
        raw[2, 597] = raw[3, 5] = {np.inf: 0x7F80, -np.inf: 0xFF80}.get(value, 0x7FC0)
    out = kernel_rows(raw, block, 4, 1)
    assert out["bad"].tolist() == [False, False, True, True]
    assert np.isnan(out["lower"][:, 2:]).all() and np.isfinite(out["lower"][:, :2]).all()
    with pytest.raises(NonFiniteLogits) as ei:
        C.compare_rows(block, raw, np.zeros(4, np.int64), top_k=4, overlap_k=2)
    assert ei.value.row == 2 and ei.value.side == "candidate"
    with pytest.raises(NonFiniteLogits) as ei:  # the numpy path: the same row
        C._compare_rows_numpy(block, raw, np.zeros(4, np.int64), top_k=4, overlap_k=2, eps=1e-12)
    assert ei.value.row == 2


@pytest.mark.parametrize("compiled", [True, False])
def test_compact_vs_full_refuses_nonfinite_log_probabilities(compiled):
    """The library entry point: a candidate row of log-probabilities holding NaN or +-inf
    is refused (it used to return a finite interval: for NaN, and for -inf where the
    reference has mass, whose forward KL is inf)."""
    rng = np.random.default_rng(6)
    lp = log_softmax(rng.normal(0, 2, (3, 200)), 1)
    rows = C.decode(C.encode(lp, np.zeros(3, np.int64), C.CompactSpec(8, 20)))
    for value in (np.nan, np.inf, -np.inf):
        for col in (50, int(rows.exact_ids[1, 0]), int(rows.band_ids[1, 0])):  # rest, exact, band entry
            lq = lp.copy()
            lq[1, col] = value
            with pytest.raises(NonFiniteLogits) as ei:
                B.compact_vs_full(rows, lq, compiled=compiled)
            assert ei.value.row == 1 and (np.isnan(ei.value.value) if np.isnan(value) else ei.value.value == value)


def test_compare_refuses_a_nan_candidate_like_the_full_compare(tmp_path):
    """compare_runs with a candidate row holding NaN: the compact reference refuses it with
    the same one-line error, naming the item and position, as the full reference."""
    from test_bounds_store import make_run

    rng = np.random.default_rng(7)
    lens = {"a": 6, "b": 9}
    ref = {k: rng.normal(0, 3, (n, 400)).astype(np.float32) for k, n in lens.items()}
    cand = {k: (v + rng.normal(0, 0.2, v.shape)).astype(np.float32) for k, v in ref.items()}
    teacher = {k: rng.integers(0, 400, n) for k, n in lens.items()}
    full = make_run(tmp_path / "full", ref, teacher)
    comp = make_run(tmp_path / "comp", ref, teacher, store="compact:exact=8,band=40")
    c = make_run(tmp_path / "cand", cand, teacher)
    # a NaN in the stored candidate rows (the writer refuses one; a damaged file has it)
    r = RunReader(c)
    chunk = r.path / "chunks" / r.manifest["chunks"][-1]["data"]
    arr = np.load(chunk, mmap_mode="r+")
    arr[4, 123] = np.nan
    arr.flush()
    del arr
    msgs = []
    for refp in (full, comp):
        with pytest.raises(LogitdiffError) as ei:
            compare_runs(RunReader(refp), RunReader(c))
        msgs.append(str(ei.value))
    assert msgs[0] == msgs[1] and "NaN/inf logits at output position" in msgs[0], msgs


def _isa_cases():
    """(name, reference logits, candidate logits, spec): wide bands (the knapsack's histogram
    path, >= 256 chords), few or no band entries, ties at the fill threshold, and the
    adversarial rows (special quads: x = 0, w = 0, subnormal sums)."""
    rng = np.random.default_rng(29)
    z = rng.normal(0, 3, (6, 4000)) + 8 * (rng.random((6, 4000)) < 0.01)
    yield "random wide band", z, z + rng.normal(0, 0.3, z.shape), C.CompactSpec(64, 700)
    yield "random 8-bit band", z, z + rng.normal(0, 0.3, z.shape), C.CompactSpec(16, 300, 8)
    zt = np.round(rng.normal(0, 2, (4, 3000)) * 2) / 2
    yield "ties", zt, np.round((zt + rng.normal(0, 0.5, zt.shape)) * 2) / 2, C.CompactSpec(16, 64)
    yield "no band", z[:3], z[:3] + rng.normal(0, 0.5, z[:3].shape), C.CompactSpec(4, 0)
    for name, lp, lq in adversarial_rows():
        yield name, lp[None], lq[None], C.CompactSpec(5, 20)


@pytest.mark.skipif(not kernel.has_simd(), reason="no AVX2 on this CPU: only the scalar path runs")
@pytest.mark.parametrize("dtype", DTYPES)
def test_avx2_and_scalar_paths_agree_and_cover(dtype):
    """The compact kernel's two instruction sets (isa="auto": the AVX2 passes; "scalar": the
    portable ones a CPU without AVX2 runs) give every output to float64 summation error of
    each other, and both intervals contain scipy's values."""
    for name, zr, zc_, spec in _isa_cases():
        raw, zc = raw_of(zc_, dtype)
        zr32 = np.asarray(zr, np.float32)
        block = C.encode(zr32, np.zeros(len(zr32), np.int64), spec)
        got = {isa: kernel_rows(raw, block, 8, 2, isa=isa) for isa in ("auto", "scalar")}
        lp = log_softmax(zr32.astype(np.float64), 1)
        lq = log_softmax(zc.astype(np.float64), 1)
        ex, t = exact(lp, lq), tol(lp, lq)
        for isa, out in got.items():
            ivs = B._compact_intervals(out["lower"], out["upper"])  # the clamps compare_rows applies
            for div in (B.KL, B.KL_REV, B.JSD):
                assert_covers(ivs[div], ex[div], t, f"{name} {dtype} {isa} {div}")
        a, b = got["auto"], got["scalar"]
        assert np.array_equal(a["top_ids"], b["top_ids"]) and np.array_equal(a["bad"], b["bad"]), name
        for k in ("lower", "upper"):
            fin = np.isfinite(b[k])
            assert (np.isinf(a[k]) == np.isinf(b[k])).all(), f"{name} {dtype} {k}: inf differs"
            assert (np.abs(a[k][fin] - b[k][fin]) <= np.broadcast_to(t, b[k].shape)[fin] + 64 * EPS * np.abs(b[k][fin])).all(), \
                f"{name} {dtype} {k}: auto {a[k][fin][:4]} scalar {b[k][fin][:4]}"
        for k in ("max", "log_sum", "entropy"):
            np.testing.assert_allclose(a[k], b[k], rtol=64 * EPS, atol=64 * EPS, err_msg=f"{name} {dtype} {k}")


def test_isa_avx2_refused_where_absent_and_unknown_isa():
    z = np.zeros((1, 300), np.float32)
    block = C.encode(z, np.zeros(1, np.int64), C.CompactSpec(4, 8))
    with pytest.raises(KeyError):
        kernel_rows(z, block, 4, 1, isa="sse9")
    if not kernel.has_simd():
        with pytest.raises(ValueError, match="isa"):
            kernel_rows(z, block, 4, 1, isa="avx2")
    else:
        assert np.array_equal(kernel_rows(z, block, 4, 1, isa="avx2")["lower"],
                              kernel_rows(z, block, 4, 1, isa="auto")["lower"])


def test_reference_top_same_rule_for_stored_and_unordered_ids():
    """The reference's top-k from its exact entries: value descending, lowest id first on
    ties, whether the ids come ascending (a stored chunk: the stable-sort path) or in any
    order (encode's blocks: lexsort), on tie-heavy rows."""
    rng = np.random.default_rng(5)
    z = np.round(rng.normal(0, 2, (7, 900)))  # many equal logits among the exact entries
    block = C.encode(z.astype(np.float32), np.zeros(7, np.int64), C.CompactSpec(64, 32))
    order = np.argsort(block["exact_ids"], axis=1)
    stored = {**block, "exact_ids": np.take_along_axis(block["exact_ids"], order, 1),
              "exact_logits": np.take_along_axis(block["exact_logits"], order, 1)}
    for b in (block, stored):
        ids, lp = C.reference_top(b, 40)
        want = np.stack([np.lexsort((np.arange(900), -z[r]))[:40] for r in range(7)])
        np.testing.assert_array_equal(ids, want)
        exact_lp = np.take_along_axis(log_softmax(z, 1), want, 1)
        np.testing.assert_allclose(lp, exact_lp, rtol=0, atol=64 * EPS * (1 + np.abs(exact_lp).max()))
