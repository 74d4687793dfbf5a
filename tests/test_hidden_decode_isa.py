"""The compiled hidden-state decode on every instruction set (`kernel.hidden_decode`, issue 28):
each path's bits against an independent float64 reference (numpy float64 dot, rounded to
bf16 nearest-even by integer arithmetic on the float64 bits), on inputs built to break a
wrong error bound: exact sums planted on rounding midpoints and one granule beside them,
sums nudged off a midpoint by products the AVX-512 BF16 instruction flushes to zero,
magnitudes near both ends of the range, bf16 denormal inputs (read as zero by VDPBF16PS:
routed to the AVX2 path), non-finite rows, and shapes off every block size (odd H, V not
a multiple of 16 or 32, n not a multiple of the row block). Every sum here is exact in
float64 whatever the order (integer significands over a range < 2^53), so the reference is
the exact rounding."""

from __future__ import annotations

import numpy as np
import pytest

from logitdiff.numerics import kernel

pytestmark = pytest.mark.skipif(
    kernel.hidden_decode(np.zeros((1, 1), np.uint16), np.zeros((1, 1), np.uint16), "bfloat16", 1) is None,
    reason="compiled kernel not built")


def _isas():
    out = [pytest.param("scalar"), pytest.param("auto")]
    out.append(pytest.param("avx2", marks=pytest.mark.skipif(not kernel.has_simd(), reason="this CPU lacks AVX2/FMA/F16C")))
    out.append(pytest.param("avx512bf16", marks=pytest.mark.skipif(
        not kernel.has_avx512bf16(),
        reason="this CPU lacks AVX-512 BF16 (VDPBF16PS) or the OS does not save zmm state: that path cannot run here")))
    return out


ISAS = _isas()


def bf16_of(x) -> np.ndarray:
    """float64 values that are bf16 numbers -> their bits (checked exact)."""
    x = np.asarray(x, np.float64)
    f = x.astype(np.float32)
    bits = (f.view(np.uint32) >> 16).astype(np.uint16)
    back = (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    assert np.array_equal(back, x, equal_nan=True), "test input is not a bf16 number"
    return bits


def f64_of(bits) -> np.ndarray:
    return (np.asarray(bits, np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def reference(hidden: np.ndarray, head: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float64 dot, then nearest-even to bf16 from the float64 bits (8-bit significand:
    drop 45 bits); and where the result is a normal bf16 (the decode's contract: other
    entries are stored exceptions)."""
    with np.errstate(over="ignore", invalid="ignore"):
        s = f64_of(hidden) @ f64_of(head).T
    b = np.ascontiguousarray(s).view(np.uint64)
    sign = (b >> np.uint64(63)).astype(np.uint16)
    mag = b & np.uint64(0x7FFFFFFFFFFFFFFF)
    t = (mag + np.uint64((1 << 44) - 1) + ((mag >> np.uint64(45)) & np.uint64(1))) >> np.uint64(45)
    e = (t >> np.uint64(7)).astype(np.int64) - 1023 + 127  # a carry out of the significand lands here
    ok = np.isfinite(s) & (e >= 1) & (e <= 254)
    bits = (sign << 15) | (np.clip(e, 0, 255).astype(np.uint16) << 7) | (t & np.uint64(0x7F)).astype(np.uint16)
    return np.where(ok, bits, 0).astype(np.uint16), ok


def check(hidden, head, isa, threads=2, *, normal_only=False):
    got, fallbacks = kernel.hidden_decode(hidden, head, "bfloat16", threads, isa=isa)
    want, ok = reference(hidden, head)
    assert not normal_only or ok.all()
    bad = ok & (got != want)
    assert not bad.any(), (f"{isa}: {int(bad.sum())} of {int(ok.sum())} entries differ, first at "
                           f"{tuple(int(x) for x in np.argwhere(bad)[0])}")
    return got, fallbacks


# --------------------------------------------------------------------------------------
# planted sums: integer significands (|w|, |h| <= 255: bf16) times powers of two
# --------------------------------------------------------------------------------------

SPECIAL = 3  # positions 0..2 of every hidden row are 1, 2^8, 2^16 (units): the head sets the sum there


def planted(rng, n, V, H, a, b, kinds=("mid", "mid+1", "mid-1", "exact", "binade-1", "random")):
    """Hidden rows [n, H] and a head [V, H] (bf16 bits) whose entry (v mod m, v) has an
    exact sum of the given kind (m = the base rows; rows m.. are the base rows times
    -+2^k, so their sums sit on the same grid): W = wint 2^-a, h = hint 2^-b."""
    m = max(1, n // 2)
    hint = rng.integers(-255, 256, (m, H)).astype(np.int64)
    hint[:, :SPECIAL] = [1, 256, 65536][:min(SPECIAL, H)]
    wint = rng.integers(-255, 256, (V, H)).astype(np.int64)
    mids = []  # entries v planted on a midpoint (in base row v mod m and its copies)
    for v in range(V):
        r = v % m
        rest = int(wint[v, SPECIAL:] @ hint[r, SPECIAL:])  # exact: |.| < 2^16 H
        kind = kinds[v % len(kinds)]
        if kind == "random" or abs(rest) < 2**12:
            continue
        E = abs(rest).bit_length() - 1
        sp = 1 << (E - 7)  # bf16 spacing in this binade (units of 2^-(a+b))
        base = (abs(rest) // sp) * sp
        target = {"mid": base + sp // 2, "mid+1": base + sp // 2 + 1, "mid-1": base + sp // 2 - 1, "exact": base,
                  "binade-1": (1 << (E + 1)) - 1}[kind]
        target = target if rest > 0 else -target
        if kind == "mid":
            mids.append(v)
        delta = target - rest  # = w0 + 256 w1 + 65536 w2, digits in [-128, 128)
        digits = []
        for _ in range(SPECIAL):
            d = (delta + 128) % 256 - 128
            digits.append(d)
            delta = (delta - d) // 256
        assert delta == 0
        wint[v, :SPECIAL] = digits
    scale = np.ldexp(1.0, rng.integers(-3, 4, n - m)) * rng.choice([-1.0, 1.0], n - m)
    rows = np.concatenate([hint, hint[np.arange(n - m) % m] * scale[:, None]]) if n > m else hint
    ties = sum(1 + int(np.sum(np.arange(n - m) % m == v % m)) for v in mids)  # (row, v) entries on a midpoint
    return bf16_of(np.ldexp(rows.astype(np.float64), -b)), bf16_of(np.ldexp(wint.astype(np.float64), -a)), ties


@pytest.mark.parametrize("isa", ISAS)
# (121, 70, 577): the AVX2 path passes over a tile's hidden rows in blocks of 54 at this H
# (HD_ROW_BLOCK_BYTES): three blocks, the last of 13 rows (not a multiple of its 3-row groups)
@pytest.mark.parametrize("n,V,H", [(7, 67, 129), (13, 33, 577), (5, 1, 3), (1, 17, 4), (12, 250, 64), (121, 70, 577)])
def test_planted_midpoints_on_every_isa(isa, n, V, H):
    rng = np.random.default_rng(n * 1000 + H)
    for a, b in ((8, 8), (-40, -40), (60, 60)):  # ~1, ~2^100 and ~2^-100 sums
        hid, head, ties = planted(rng, n, V, H, a, b)
        got, fallbacks = check(hid, head, isa, normal_only=True)
        if isa in ("avx2", "avx512bf16") or (isa == "auto" and kernel.has_simd()):
            # a midpoint's float32 interval always straddles it: each took the float64 path
            assert fallbacks >= ties, (fallbacks, ties)
        if isa == "scalar":
            assert fallbacks == 0


@pytest.mark.parametrize("isa", ISAS)
def test_flushed_products_decide_a_tie(isa):
    """259 2^-120 = 7 2^-60 x 37 2^-60 is a bf16 midpoint (between 258 and 260 2^-120, even
    260). Eight products of +-2^-64 x 2^-64 = +-2^-128 (below float32's normal range:
    VDPBF16PS flushes them to zero) move the exact sum off the tie, so the right answer is
    258 (negative nudge) or 260 (positive). The float32 bound without the flushed
    products' term is ~2^-132 here: only that term sends these entries to float64."""
    H = 41
    hid = np.zeros((3, H))
    hid[:, 0] = 37 * 2.0**-60
    hid[:, 1:9] = 2.0**-64
    hid[1] *= -1  # the row's sums change sign: the same ties, mirrored
    hid[2, 9:] = 2.0**-70  # and a row with more (flushed) products
    head = np.zeros((64 + 5, H))
    head[:, 0] = 7 * 2.0**-60
    signs = np.where(np.arange(len(head)) % 2 == 0, -1.0, 1.0)
    head[:, 1:9] = signs[:, None] * 2.0**-64
    head[:, 9:] = 2.0**-62
    got, _ = check(bf16_of(hid), bf16_of(head), isa, normal_only=True)
    want, _ = reference(bf16_of(hid), bf16_of(head))
    assert (want[0, ::2] == bf16_of(258 * 2.0**-120)).all() and (want[0, 1::2] == bf16_of(260 * 2.0**-120)).all()


@pytest.mark.parametrize("isa", ISAS)
def test_tiny_and_flushed_magnitudes(isa):
    # products ~2^-140 .. 2^-124 (most flushed by VDPBF16PS), sums around bf16's normal minimum
    rng = np.random.default_rng(3)
    hid, head, _ = planted(rng, 9, 97, 33, 70, 70)
    got, _ = check(hid, head, isa)
    assert reference(hid, head)[1].mean() > 0.5  # most results are normal (compared), some not (exceptions)


@pytest.mark.parametrize("isa", ISAS)
def test_denormal_inputs_and_non_finite_rows(isa):
    rng = np.random.default_rng(5)
    n, V, H = 7, 300, 31
    hid = bf16_of(np.ldexp(rng.integers(-255, 256, (n, H)).astype(np.float64), -8))
    head = bf16_of(np.ldexp(rng.integers(-255, 256, (V, H)).astype(np.float64), -12))
    # a bf16 denormal in one head tile: that tile takes the AVX2 path, the others not
    head_d = head.copy()
    head_d[250, 3] = 0x0001
    head_d[251, 30] = 0x8042
    check(hid, head_d, isa)
    # a denormal in a hidden row: the whole call takes the AVX2 path
    hid_d = hid.copy()
    hid_d[4, 7] = 0x0005
    check(hid_d, head, isa)
    # overflow (products > float32's range) and non-finite inputs: the same bits on every
    # path for infinities, NaN where the reference is NaN (its sign is the summation order's)
    big = head.copy()
    big[10] = bf16_of(np.full(H, 2.0**100))
    hid_x = hid.copy()
    hid_x[0, :] = bf16_of(np.full(H, 2.0**60))
    hid_x[1, 2] = bf16_of(np.inf)
    hid_x[2, 5] = 0x7FC0  # NaN
    got, _ = check(hid_x, big, isa)
    port, _ = kernel.hidden_decode(hid_x, big, "bfloat16", 1, isa="scalar")
    nan = lambda x: ((x & 0x7F80) == 0x7F80) & ((x & 0x7F) != 0)  # noqa: E731
    assert np.array_equal(nan(got), nan(port))
    assert np.array_equal(got[~nan(port)], port[~nan(port)])
    assert nan(got[2]).all() and (got[1] & 0x7FFF == 0x7F80).any()


@pytest.mark.parametrize("threads", [1, 3])
def test_isas_agree_on_random_rows_and_the_fast_path_runs(threads):
    rng = np.random.default_rng(11)
    n, V, H = 23, 1000 + 7, 160 + 1
    to_bf16 = lambda x: ((np.asarray(x, np.float32).view(np.uint32) + 0x8000) >> 16).astype(np.uint16)  # noqa: E731
    hid = to_bf16(rng.normal(0, 1, (n, H)))
    head = to_bf16(rng.normal(0, 0.05, (V, H)) * np.exp(rng.normal(0, 1, (V, 1))))
    outs = {}
    isas = ["scalar", "auto"] + ["avx2"] * kernel.has_simd() + ["avx512bf16"] * kernel.has_avx512bf16()
    for isa in isas:
        outs[isa] = kernel.hidden_decode(hid, head, "bfloat16", threads, isa=isa)
    want = outs["scalar"][0]
    assert np.array_equal(want, reference(hid, head)[0])
    for isa, (got, fb) in outs.items():
        assert np.array_equal(got, want), isa
        if isa != "scalar":
            assert 0 < fb < 0.1 * n * V, (isa, fb)  # most entries took the float32 path, midpoint-near ones did not


def test_isa_by_name_and_float16():
    hid = np.zeros((2, 8), np.uint16)
    head = np.zeros((3, 8), np.uint16)
    if kernel.has_avx512bf16():
        kernel.hidden_decode(hid, head, "bfloat16", 1, isa="avx512bf16")
        # float16 heads keep the AVX2 path under this isa: the same bits as the portable one
        rng = np.random.default_rng(2)
        h16 = rng.normal(0, 1, (5, 37)).astype(np.float16).view(np.uint16)
        w16 = rng.normal(0, 0.1, (70, 37)).astype(np.float16).view(np.uint16)
        a = kernel.hidden_decode(h16, w16, "float16", 2, isa="avx512bf16")[0]
        assert np.array_equal(a, kernel.hidden_decode(h16, w16, "float16", 2, isa="scalar")[0])
    else:
        with pytest.raises(ValueError, match="AVX-512 BF16"):
            kernel.hidden_decode(hid, head, "bfloat16", 1, isa="avx512bf16")
    with pytest.raises(KeyError):
        kernel.hidden_decode(hid, head, "bfloat16", 1, isa="avx1024")


@pytest.mark.parametrize("isa", ISAS)
def test_cancellation_inside_a_chain_and_across_chains(isa):
    """Float32 results on the wrong side of a rounding boundary, with each error term of
    the AVX-512 BF16 bound the one that catches it (a bound without it decides wrongly).

    Row 0, inside one chain: 2^30 + 259 - 2^30. float32 keeps 2^30 + 256, so the dot is
    256; the exact 259 = 7 x 37 is the midpoint 258 | 260 (even: 260). Only the chain term
    gamma ||W|| ||h|| (~2^8.6 here) straddles it.
    Row 1, across chains: A' = 2^30 - 2^21 - 640 (2^30 - 2^21: the midpoint between
    2^30 - 2^22 and 2^30), then 40 chains of +31 each lost to rounding (ulp 64): float32
    keeps A', 640 below the midpoint, the exact sum is 600 above it (rounds up to 2^30).
    The chain term (~320) and 4u|s| (256) do not reach the midpoint; the running term
    u sum |t_i| (~2^11) does."""
    H = 246
    hid = np.zeros((2, H))
    head = np.zeros((3, H))
    hid[0, :3] = [2.0**15, 37, 2.0**15]
    head[0, :3] = [2.0**15, 7, -(2.0**15)]
    hid[1, 0], head[1, 0] = 73 * 2.0**10, 7 * 2.0**11
    hid[1, 1], head[1, 1] = 1.0, -640.0
    for i in range(1, 41):
        hid[1, 6 * i], head[1, 6 * i] = 1.0, 31.0
    head[2] = head[1] * 2.0**-3  # row 1 again, scaled (and row 0 x head 1, row 1 x head 0: ordinary sums)
    hid_b, head_b = bf16_of(hid), bf16_of(head)
    want, ok = reference(hid_b, head_b)
    assert want[0, 0] == bf16_of(260.0) and want[1, 1] == bf16_of(2.0**30) and want[1, 2] == bf16_of(2.0**27)
    got, fallbacks = check(hid_b, head_b, isa, threads=1)


@pytest.mark.parametrize("isa", ISAS)
def test_the_callers_flush_to_zero_does_not_change_the_bits(isa):
    """A process may run with FTZ/DAZ set (torch.set_flush_denormal(True), a library built
    with -ffast-math): bf16 denormal hidden values would then read as zero and tiny products
    flush, errors the bound does not cover. The decode runs with IEEE underflow and leaves
    the caller's setting as it was. Rows: a normal term and a denormal hidden value times a
    large head weight, which decides the rounding of most entries."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(7)
    n, V = 3, 96
    hid = np.zeros((n, 2))
    hid[:, 0] = rng.integers(128, 256, n) * 2.0**-128  # normal
    hid[:, 1] = rng.integers(1, 128, n) * 2.0**-133  # bf16 (and float32) denormal
    head = rng.integers(128, 256, (V, 2)) * 2.0**13 * rng.choice([-1.0, 1.0], (V, 2))
    h, w = bf16_of(hid), bf16_of(head)
    want, ok = reference(h, w)  # before FTZ/DAZ: the reference converts through float32
    dropped, _ = reference(h, w * np.array([1, 0], np.uint16))  # what reading the denormal as zero gives
    assert ok.all() and (dropped != want).sum() > V  # the denormal decides many entries
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU has no FTZ/DAZ to set")
    try:
        assert np.float32(2.0**-129) * np.float32(1.0) == 0  # DAZ is on in this thread
        got, _ = kernel.hidden_decode(h, w, "bfloat16", 2, isa=isa)
        still = np.float32(2.0**-129) * np.float32(1.0) == 0  # and still on after the call
    finally:
        torch.set_flush_denormal(False)
    np.testing.assert_array_equal(got, want)
    assert still


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("isa", ISAS)
def test_float32_output_is_the_bits_widened(isa, threads):
    """``out`` float32 (what a compare against float32 rows reads): every entry the 16-bit
    decode's value widened, exactly, whatever path took it -- several tiles of each path
    (each thread widens its tile from its own scratch), a head tile with a bf16 denormal
    (that tile goes through the AVX2 path), float16 heads -- and nothing left of what the
    buffer held before."""
    rng = np.random.default_rng(5)
    n, V, H = 9, 2 * 1024 + 37, 161  # > 2 AVX-512 tiles (800 entries at H = 161), ~33 AVX2 tiles
    to_bf16 = lambda x: ((np.asarray(x, np.float32).view(np.uint32) + 0x8000) >> 16).astype(np.uint16)  # noqa: E731
    hid = to_bf16(rng.normal(0, 1, (n, H)))
    head = to_bf16(rng.normal(0, 0.05, (V, H)))
    head[1500, 3] = 0x0005  # a bf16 denormal in the second tile
    want = kernel.hidden_decode(hid, head, "bfloat16", threads, isa=isa)[0]
    out = np.full((n, V), np.nan, np.float32)
    got, _ = kernel.hidden_decode(hid, head, "bfloat16", threads, isa=isa, out=out)
    assert got is out and got.dtype == np.float32
    assert np.array_equal(got.view(np.uint32), want.astype(np.uint32) << 16)
    if isa in ("scalar", "avx2", "auto"):  # float16 heads: the AVX2 and portable paths
        h16 = rng.normal(0, 1, (n, 37)).astype(np.float16).view(np.uint16)
        w16 = rng.normal(0, 0.1, (300, 37)).astype(np.float16).view(np.uint16)
        b16 = kernel.hidden_decode(h16, w16, "float16", threads, isa=isa)[0]
        f32 = kernel.hidden_decode(h16, w16, "float16", threads, isa=isa, out=np.full((n, 300), np.nan, np.float32))[0]
        assert np.array_equal(f32, b16.view(np.float16).astype(np.float32))
    with pytest.raises(ValueError, match="float32"):
        kernel.hidden_decode(hid, head, "bfloat16", threads, isa=isa, out=np.zeros((n, V), np.float64))
