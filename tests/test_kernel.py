"""The compiled full-vocabulary kernel (logitdiff.numerics._kernel via logitdiff.numerics.kernel): built by the
install, exact against scipy on the rows that stress it (ties, underflow, huge and tiny
spreads, non-finite input, SIMD tails), independent of threads and chunking, reading
bfloat16 in place. The scipy reference and tolerances are those of test_metrics.py.
"""

from __future__ import annotations

import math
import platform

import numpy as np
import pytest
import torch
from test_metrics import ATOL, RTOL, U, assert_matches, kl_error_bound, make_pair, ref_full_vocab

from logitdiff.numerics import kernel
from logitdiff.numerics.metrics import FULL_VOCAB_FIELDS, NonFiniteLogits, bfloat16_view, full_vocab

NATIVE = ("native", "native-scalar")
LN2 = math.log(2.0)


def test_kernel_is_built():
    """The install builds the extension (a CI machine without it would silently test only
    the torch path); on x86-64 with AVX2/FMA/F16C the SIMD path is the one taken."""
    assert kernel.available()
    if platform.machine() in ("x86_64", "AMD64"):
        flags = open("/proc/cpuinfo").read() if platform.system() == "Linux" else ""
        if all(f in flags.split() for f in ("avx2", "fma", "f16c")):
            assert kernel.has_simd()


@pytest.mark.parametrize("backend", NATIVE)
def test_kernel_edge_rows_match_scipy(backend):
    """Ties at the top and at the top-K boundary, probabilities that underflow, logits of
    +-1e38 (differences ~1e38: every exp but the top is 0), spreads of 1e-6, a row whose
    other side is a constant, exact zeros for identical rows."""
    v = 1003  # not a multiple of 8: the SIMD loops and their scalar tails both run
    rng = np.random.default_rng(21)
    zp = rng.standard_normal((8, v)).astype(np.float32)
    zq = (zp + 0.01 * rng.standard_normal((8, v))).astype(np.float32)
    zp[0, [9, 5, 3, 1001]] = 7.0  # top-1 tie -> 3; ids beyond the last full SIMD block
    zq[0, [1002, 5]] = 7.0
    zp[1] = 0.0
    zp[1, 700] = 1000.0  # p is a point; q's logits 1000 below it underflow
    zq[1, 700] = -1000.0
    zp[2] = np.linspace(-3e38, 3e38, v, dtype=np.float32)  # huge spread
    zq[2] = zp[2][::-1]
    zp[3] = 1.0 + np.arange(v, dtype=np.float32) * 1e-9  # tiny spread (rounds to few values)
    zq[3] = 1.0 + np.float32(1e-6) * rng.standard_normal(v).astype(np.float32)
    zq[4] = 5.0  # constant row: uniform
    zq[5] = zp[5]  # identical
    zp[6] = np.arange(v) % 3  # ties everywhere
    zq[6] = -(np.arange(v) % 5)
    zq[7] = zp[7] + 3.25  # shifted copy: identical distribution
    y = rng.integers(0, v, 8)
    got = full_vocab(zp, zq, y, k=6, top_k_out=12, backend=backend)
    want = ref_full_vocab(zp, zq, y, 6)
    finite = [0, 3, 4, 5, 6, 7]  # rows 1, 2: scipy's q underflows to 0 under p's point (KL inf)
    assert_matches({f: got[f][finite] for f in got}, {f: want[f][finite] for f in want})
    for f in FULL_VOCAB_FIELDS:
        assert not np.isnan(np.asarray(got[f], dtype=float)).any(), f
    assert got["top1_ref"][0] == 3 and got["top1_cand"][0] == 5
    assert got["kl_nats"][5] == 0.0 and got["kl_rev_nats"][5] == 0.0 and got["jsd_nats"][5] == 0.0
    # p is a point at id 700 (others e^-1000 = 0): KL = -lQ[700] = 1000 + logsumexp(zq[1])
    # (rounding: u * 1e3 on the difference); disjoint points: JSD = ln 2
    from scipy.special import logsumexp

    np.testing.assert_allclose(got["kl_nats"][1], 1000.0 + logsumexp(zq[1].astype(np.float64)), rtol=1e-13)
    np.testing.assert_allclose(got["jsd_nats"][1:3], LN2, rtol=0, atol=1e-15)
    # row 2: points at opposite ends, 6e38 apart (float64 holds the difference exactly)
    assert got["kl_nats"][2] == got["kl_rev_nats"][2] == float(np.float64(zp[2, -1]) - np.float64(zp[2, 0]))
    torch_path = full_vocab(zp, zq, y, k=6, top_k_out=12, backend="torch")
    for side in ("ref", "cand"):
        np.testing.assert_array_equal(got[f"topk_ids_{side}"], torch_path[f"topk_ids_{side}"])
        np.testing.assert_allclose(got[f"topk_logprobs_{side}"], torch_path[f"topk_logprobs_{side}"], rtol=0, atol=1e-12)


@pytest.mark.parametrize("backend", NATIVE)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_kernel_non_finite_names_row(backend, dtype, bad):
    rng = np.random.default_rng(1)
    v = 700  # 696 values in SIMD blocks, 4 in the scalar tail
    for col in (123, 698):
        zp = torch.from_numpy(rng.standard_normal((10, v)).astype(np.float32)).to(getattr(torch, dtype))
        zq = torch.from_numpy(rng.standard_normal((10, v)).astype(np.float32)).to(getattr(torch, dtype))
        zq[7, col] = bad
        zp[9, 5] = bad
        with pytest.raises(NonFiniteLogits) as ei:
            full_vocab(zp, zq, k=3, backend=backend, chunk_bytes=1)
        assert ei.value.row == 7 and ei.value.side == "candidate"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kernel_threads_and_chunking_do_not_change_results(dtype):
    rng = np.random.default_rng(5)
    zp, zq, y = make_pair(rng, 11, 20_001, 2.0, dtype)
    one = full_vocab(zp, zq, y, k=7, top_k_out=5, threads=1, chunk_bytes=1 << 40, backend="native")
    for threads, chunk in ((2, 1), (3, 1 << 40), (5, 20_001 * 8)):
        other = full_vocab(zp, zq, y, k=7, top_k_out=5, threads=threads, chunk_bytes=chunk, backend="native")
        for f in one:
            np.testing.assert_array_equal(one[f], other[f], err_msg=f)


def test_kernel_simd_and_scalar_agree_within_error_bound():
    """The SIMD exp/log and the portable libm path differ only by rounding: KL within the
    worst-case bound of test_metrics.kl_error_bound, every field within the contract."""
    rng = np.random.default_rng(9)
    zp = (rng.standard_normal((6, 30_000)) * 3).astype(np.float32)
    zq = (zp + rng.standard_normal((6, 30_000)) * 1e-3).astype(np.float32)
    a = full_vocab(zp, zq, k=5, backend="native")
    b = full_vocab(zp, zq, k=5, backend="native-scalar")
    (b1, b1_rev), (b2, b2_rev) = (kl_error_bound(zp, zq, path, True) for path in ("native", "native-scalar"))
    assert (np.abs(a["kl_nats"] - b["kl_nats"]) <= b1 + b2).all()
    assert (np.abs(a["kl_rev_nats"] - b["kl_rev_nats"]) <= b1_rev + b2_rev).all()
    assert_matches(a, b)


def test_kernel_exact_ratio_pass_for_jsd():
    """G = sum g ln g needs r = s_p/s_q, known only after the pass; the kernel takes G at
    the float32 estimate r0 plus the first-order term, and redoes G at the exact r when
    the remainder bound exceeds 1e-15 s_p (short rows, where the estimate's float32
    rounding does not average out, take that path). JSD matches scipy either way."""
    if not kernel.has_simd():
        pytest.skip("the portable path's estimate is float64 (no float32 rounding to correct)")
    rng = np.random.default_rng(13)
    zp = torch.from_numpy(rng.standard_normal((2000, 8)).astype(np.float32))
    zq = torch.from_numpy(rng.standard_normal((2000, 8)).astype(np.float32))
    flags = kernel.pair_rows(zp, zq, 2, 2)["flags"]
    assert (flags & kernel.FLAG_PASS3).any() and not (flags & kernel.FLAG_PASS3).all()
    got = full_vocab(zp, zq, k=2, backend="native")
    want = ref_full_vocab(zp, zq, np.zeros(2000, int), 2)
    np.testing.assert_allclose(got["jsd_nats"], want["jsd_nats"], rtol=RTOL, atol=ATOL)


def test_kernel_reads_bfloat16_memory_map_in_place(tmp_path):
    """bf16 stored as uint16 bits, memory-mapped and viewed as bfloat16: the kernel takes it
    as is (no float32 copy of the chunk: the tensor shares the map's memory) and gives the
    same answers as a bfloat16 tensor in memory; a stride-0 expansion is read in place."""
    rng = np.random.default_rng(6)
    zp, zq, y = make_pair(rng, 5, 3001, 2.0, "bfloat16")
    for name, z in (("p", zp), ("q", zq)):
        np.save(tmp_path / f"{name}.npy", z.view(torch.int16).numpy().view(np.uint16))
    maps = [np.load(tmp_path / f"{n}.npy", mmap_mode="r") for n in ("p", "q")]
    tp, tq = (bfloat16_view(m) for m in maps)
    with pytest.raises(TypeError):
        bfloat16_view(np.zeros(3, np.float32))
    assert kernel.supports(tp) and tp.data_ptr() == maps[0].ctypes.data
    a = full_vocab(tp, tq, y, k=4, backend="native")
    b = full_vocab(zp, zq, y, k=4, backend="native")
    for f in FULL_VOCAB_FIELDS:
        np.testing.assert_array_equal(a[f], b[f], err_msg=f)
    wide = zp[:1].expand(3, -1)
    assert wide.stride(0) == 0 and kernel.supports(wide)
    c = full_vocab(wide, zq[:1].expand(3, -1), k=4, backend="native")
    assert (c["kl_nats"] == c["kl_nats"][0]).all()
    np.testing.assert_allclose(c["kl_nats"][0], ref_full_vocab(zp[:1], zq[:1], [0], 4)["kl_nats"][0], rtol=RTOL, atol=ATOL)


def test_kernel_rejects_what_it_cannot_read():
    with pytest.raises(ValueError, match="backend"):
        full_vocab(np.zeros((2, 5)), np.zeros((2, 5)), k=2, backend="native")  # float64
    with pytest.raises(ValueError, match="backend"):
        full_vocab(np.zeros((2, 5), np.float32), np.zeros((2, 5), np.float32), k=2, backend="fast")
    with pytest.raises(ValueError, match="threads"):
        full_vocab(np.zeros((2, 5), np.float32), np.zeros((2, 5), np.float32), k=2, threads=0)
    assert not kernel.supports(torch.zeros(4, 6)[:, ::2])  # column stride 2
    # auto falls back to torch for what the kernel cannot read, with the same answers
    z = np.random.default_rng(0).standard_normal((3, 50))
    y = np.array([0, 7, 49])
    assert_matches(full_vocab(z, z[::-1].copy(), y, k=3), ref_full_vocab(z, z[::-1], y, 3))
    assert U == 2.0**-53


# Tail tiles (peaked rows). The kernel's SIMD path takes a cheaper exp (degree-7 minimax,
# relative error < 4.1e-11, taken as eps = 1.25e-9) and ln g = ln2 + (a_p + a_q + ln r0)/2 + ln cosh(delta/2)
# (absolute error eta = 7e-9, for tiles with |delta| <= 0.75) on tiles that hold a tiny
# share W of the mass. First order, every field moves by at most eps or eta times
# tail-weighted sums the kernel accumulates (W, sum p|a|, sum g|ln g|, max|d|; the
# formulas are in _kernel.cpp above `tail_bound`), and the row keeps the tail tiles only
# when the largest of those bounds is <= 1.25e-13 = atol/8: the extra error is within 1/8
# of every field's tolerance atol + rtol|x|, whatever the field's size. So the contract
# test below is unchanged (rtol 1e-9, atol 1e-12), and the tail path differs from the
# portable path (no tail tiles) by at most both paths' worst-case rounding bounds plus
# TAIL_BUDGET.
TAIL_BUDGET = 1.25e-13
V_DESIGN = 248_320


def peaked_rows(rng, v):
    """Reference: N(0, 2^2) tail plus a head of 20 ids `depth` nats up; candidate: the
    reference plus N(0, noise^2). (depth, noise) per row: the benchmark's shape, a tiny-KL
    near-identical row, deeper and shallower tails, an identical row, a noisy tail (|delta|
    beyond ln cosh's range: log in tail tiles) and a shifted copy."""
    kinds = [(25, 0.05), (25, 1e-3), (35, 0.05), (60, 0.05), (18, 0.05), (25, 0.0), (25, 0.5), (25, "shift")]
    zp = rng.standard_normal((len(kinds), v)) * 2.0
    zq = np.empty_like(zp)
    y = rng.integers(0, v, len(kinds))
    for i, (depth, noise) in enumerate(kinds):
        head = rng.choice(v, 20, replace=False)
        zp[i, head] += depth
        zq[i] = zp[i] + 3.25 if noise == "shift" else zp[i] + rng.standard_normal(v) * noise
        if i % 2:
            y[i] = head[0]  # the token in the head, else anywhere
    return zp, zq, y


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kernel_tail_tiles_keep_the_contract(dtype):
    rng = np.random.default_rng(14)
    zp, zq, y = peaked_rows(rng, V_DESIGN)
    if dtype == "bfloat16":
        zp, zq = (torch.from_numpy(z).to(torch.bfloat16) for z in (zp, zq))
    else:
        zp, zq = (torch.from_numpy(z.astype(np.float32)) for z in (zp, zq))
    got = full_vocab(zp, zq, y, k=10, backend="native")
    want = ref_full_vocab(zp, zq, y, 10)
    assert_matches(got, want)
    assert got["kl_nats"][5] == got["kl_rev_nats"][5] == got["jsd_nats"][5] == 0.0
    if kernel.has_simd():
        flags = kernel.pair_rows(zp, zq, 10, 2)["flags"]
        tail = (flags & kernel.FLAG_TAIL) != 0
        assert tail[[0, 1, 2, 3, 5, 6, 7]].all(), flags  # the path under test was taken
        assert not (flags & kernel.FLAG_TAIL_REDONE).any(), flags
    # against the portable path (no tail tiles): both rounding bounds plus the tail budget
    scalar = full_vocab(zp, zq, y, k=10, backend="native-scalar")
    (b1, b1_rev), (b2, b2_rev) = (kl_error_bound(zp, zq, path, True) for path in ("native", "native-scalar"))
    assert (np.abs(got["kl_nats"] - scalar["kl_nats"]) <= b1 + b2 + TAIL_BUDGET).all()
    assert (np.abs(got["kl_rev_nats"] - scalar["kl_rev_nats"]) <= b1_rev + b2_rev + TAIL_BUDGET).all()
    for f in ("entropy_ref", "entropy_cand", "jsd_nats", "nll_ref", "p_cand_token"):
        np.testing.assert_allclose(got[f], scalar[f], rtol=RTOL, atol=ATOL, err_msg=f)


def test_kernel_tail_bound_failure_redoes_row():
    """Head of 20 logits at exactly 26 over an N(0, 2^2) tail (tail mass W_p ~ 4.7e-7),
    candidate = the same head over the tail lowered by a gap: the tail tiles are chosen
    (small mass on both sides), and the KL bound eps W_p max|d| ~ 5.9e-16 * gap decides:
    a 20-nat gap stays within the 1.25e-13 budget, a 600-nat gap does not, and that row is
    redone with every tile exact. Both match scipy."""
    if not kernel.has_simd():
        pytest.skip("tail tiles are a SIMD-path feature")
    rng = np.random.default_rng(3)
    zp = rng.standard_normal((2, V_DESIGN)) * 2.0
    zq = np.empty_like(zp)
    for i, gap in enumerate((20.0, 600.0)):
        head = rng.choice(V_DESIGN, 20, replace=False)
        zp[i, head] = 26.0
        zq[i] = zp[i] - gap
        zq[i, head] = zp[i, head]
    zp, zq = (torch.from_numpy(z.astype(np.float32)) for z in (zp, zq))
    flags = kernel.pair_rows(zp, zq, 10, 2)["flags"]
    assert flags[0] & kernel.FLAG_TAIL and not flags[0] & kernel.FLAG_TAIL_REDONE, flags
    assert flags[1] & kernel.FLAG_TAIL_REDONE and not flags[1] & kernel.FLAG_TAIL, flags
    y = np.array([5, 7])
    assert_matches(full_vocab(zp, zq, y, k=10, backend="native"), ref_full_vocab(zp, zq, y, 10))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_kernel_evex_and_avx2_builds_are_bit_identical(dtype):
    """Where the CPU has AVX-512VL, "auto" runs pass 2 in the EVEX build (the same 256-bit
    intrinsics with 32 registers): every output equal to the AVX2 build's, bit for bit, on
    rows that take each path (peaked rows: fused tail tiles with and without the underflow
    test, a noisy tail taking log; broad rows: exact tiles; short rows: pass 3); and a row
    whose tail tiles hold values that underflow (e^-900) still matches scipy."""
    if not kernel.has_evex():
        pytest.skip("no AVX-512VL on this CPU: auto is the AVX2 build")
    rng = np.random.default_rng(24)
    zp, zq, y = peaked_rows(rng, V_DESIGN)
    zp[0, ::997] -= 900.0  # tiles whose minimum underflows: the exp's underflow test is kept
    zq[0, ::997] -= 900.0
    zq[2, 5::1009] -= 900.0  # one side only
    broad = rng.standard_normal((3, V_DESIGN)) * 3.0
    zp, zq = np.concatenate([zp, broad]), np.concatenate([zq, broad + rng.standard_normal(broad.shape) * 0.05])
    y = np.concatenate([y, [1, 2, 3]])
    torch_dtype = getattr(torch, dtype)
    zp, zq = (torch.from_numpy(z.astype(np.float32)).to(torch_dtype) for z in (zp, zq))
    a, b = kernel.pair_rows(zp, zq, 10, 2, "auto"), kernel.pair_rows(zp, zq, 10, 2, "avx2")
    for f in a:
        np.testing.assert_array_equal(a[f], b[f], err_msg=f)
    assert (a["flags"][[0, 1, 2]] & kernel.FLAG_TAIL).all(), a["flags"]
    short = [torch.from_numpy(rng.standard_normal((2000, 8)).astype(np.float32)) for _ in range(2)]  # float32 rounding: pass 3
    c, d = kernel.pair_rows(*short, 2, 2, "auto"), kernel.pair_rows(*short, 2, 2, "avx2")
    assert (c["flags"] & kernel.FLAG_PASS3).any()
    for f in c:
        np.testing.assert_array_equal(c[f], d[f], err_msg=f)
    # row 0 (row 2's one-sided e^-900 is 0 in scipy's q: an infinite KL there, not here)
    got = full_vocab(zp[:1], zq[:1], y[:1], k=10, backend="native")
    assert_matches(got, ref_full_vocab(zp[:1], zq[:1], y[:1], 10))


# Bits of the largest finite values and of every class of non-finite value, per dtype of the
# non-finite scan (bf16 as uint16 bits): a scan that looks at the wrong bits misses a class
# or flags the finite extremes.
_SCAN_BITS = {
    np.uint16: {"finite": [0x7F7F, 0xFF7F, 0x0001, 0x8000, 0x0080], "bad": [0x7F80, 0xFF80, 0x7FC0, 0xFFC1, 0x7F81, 0xFFFF]},
    np.float16: {"finite": [0x7BFF, 0xFBFF, 0x0001, 0x8000], "bad": [0x7C00, 0xFC00, 0x7E00, 0xFE01, 0x7C01, 0xFFFF]},
    np.float32: {"finite": [0x7F7FFFFF, 0xFF7FFFFF, 0x00000001, 0x80000000],
                 "bad": [0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00001, 0x7F800001, 0xFFFFFFFF]},
}


@pytest.mark.parametrize("dtype", [np.uint16, np.float16, np.float32])
def test_nonfinite_scan_finds_every_class_at_every_place(dtype):
    """The compiled scan that checks every captured row: each kind of NaN and infinity, of
    either sign, at the first, a middle and the last column (SIMD body and scalar tail),
    in any row; the finite extremes (largest magnitude, subnormals, -0) never flagged;
    strided rows (a column slice of a wider array) read in place."""
    bits = _SCAN_BITS[dtype]
    ubits = np.uint16 if dtype in (np.uint16, np.float16) else np.uint32
    v = 1003
    rng = np.random.default_rng(5)
    base = rng.integers(0, 0x3F00, (6, v)).astype(ubits)  # finite, positive, small
    base[:, : len(bits["finite"])] = bits["finite"]
    base[3, v - len(bits["finite"]) :] = bits["finite"]
    assert kernel.first_nonfinite(base.view(dtype)) is None
    for b in bits["bad"]:
        for row, col in ((0, 0), (2, 517), (5, v - 1), (4, v - 3)):
            z = base.copy()
            z[row, col] = b
            z[min(5, row + 1), 7] = b  # a later bad row does not hide the first
            assert kernel.first_nonfinite(z.view(dtype)) == row, (hex(b), row, col)
    wide = np.zeros((4, 2 * v), ubits)
    wide[2, v + 5] = bits["bad"][0]  # outside the slice: not seen
    wide[3, 10] = bits["bad"][1]
    assert kernel.first_nonfinite(wide[:, :v].view(dtype)) == 3
    assert kernel.first_nonfinite(wide[:, : v].view(dtype)[:0]) is None


def test_nonfinite_scan_declines_layouts_it_cannot_read():
    """-1 means "not checked here" (the writer checks with numpy): float64, a column stride,
    a 1-D array."""
    assert kernel.first_nonfinite(np.zeros((2, 8))) == -1
    assert kernel.first_nonfinite(np.zeros((2, 8), np.float32)[:, ::2]) == -1
    assert kernel.first_nonfinite(np.zeros(8, np.float32)) == -1
