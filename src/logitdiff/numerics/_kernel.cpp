// Compiled full-vocabulary kernel of `logitdiff.metrics.full_vocab` (CPU path).
//
// Pure numerics: arrays in, sums out; no state outside a call. Called through ctypes
// (kernel.py), which releases the GIL; rows are spread over `threads` std::threads that
// live for one call. Per row and per side it returns the maximum, the exact top-kk
// (value descending, lowest id first on ties) and eight float64 sums from which
// metrics.py derives every field (see `pair_row`):
//
//   a = z - max, e = exp(a), d = a_p - a_q, g = e_p + r e_q with r = s_p / s_q
//   s_p = sum e_p   A_p = sum e_p a_p   s_q = sum e_q   A_q = sum e_q a_q
//   D_p = sum e_p d   D_q = sum e_q d   G = sum g ln g   S_d = sum (e_p - e_q)
//
// Two passes over each row. Pass 1 (per side, float32 SIMD, tiles of 1024 values in L1):
// maximum, non-finite check, top-kk through a bounded heap that is only touched when a
// tile's maximum beats the heap's threshold, and float32 estimates of s (online max).
// Pass 2 (both sides, float64): the eight sums with float64 exp and log, in tiles whose
// partial sums are added at the end (blocked summation: error ~ (256 + V/1024) ulp
// instead of V/4 ulp). G needs the exact r, known only at the end of pass 2; pass 2
// takes G at r0 (the pass-1 estimate) and its derivative H = sum e_q (ln g + 1), and
// G(r) = G(r0) + (r - r0) H + R with |R| <= s_q (r - r0)^2 / (2 min(r, r0)) (G'' =
// sum e_q^2 / g <= s_q / r). When that bound exceeds R_TOL s_p (R/(2 s_p) is the JSD
// error) the row's G is recomputed at the exact r (pass 3, rare: r0 is good to ~1e-6).
//
// Peaked rows (a head far above a long tail): pass 2 takes tiles that hold a tiny share of
// both sides' mass ("tail tiles", chosen from pass 1's per-tile estimates) with a cheaper
// exp (degree-7 minimax, < 4.1e-11 relative, taken as 1.25e-9) and, where
// |a_p - a_q - ln r0| <= 0.75 on the whole tile, ln g from ln cosh (a short series, no division) instead of log, in one loop whose
// G and H come from the linear sums (`pass2_tail_fused`). The extra error of
// every output field is bounded from the exact sums afterwards (`tail_bound`); the row
// keeps the result only when all bounds are <= 1/8 of the contract's atol, and is redone
// with exact tiles otherwise. Pass 1 sums tiles whose estimate is negligible next to s
// with a degree-4 float32 exp (only r0 and the tile choice depend on it).
//
// Builds: pass 2 is compiled twice from the same intrinsics, for AVX2 and for AVX-512VL
// (EVEX encoding: 32 ymm registers, no zmm), chosen at run time; see `pass2_evex`.
//
// Accuracy of the float64 primitives (error analysis in tests/test_kernel.py):
// exp_pd: |a| reduced by n ln2/2 to |r| <= ln2/4, Taylor degree 11 (truncation < 2e-18),
// times 2^(n/2) (exact power of two, and sqrt2 for odd n): <= 4 ulp. log_pd: m in
// [sqrt(1/2), sqrt(2)), ln m = 2 atanh(f), f = (m-1)/(m+1), series to f^19 (truncation
// < 3e-17 relative), plus n ln2 in two parts: <= 4 ulp of max(|ln g|, 1). Values below
// e^-708 (both sides) are flushed to 0: their total weight is < V e^-708 < 1e-300.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#define LD_X86 1
#include <immintrin.h>
#else
#define LD_X86 0
#endif

namespace {

enum Dtype : int { F32 = 0, BF16 = 1, F16 = 2 };
enum Isa : int { ISA_AUTO = 0, ISA_SCALAR = 1, ISA_AVX2 = 2 };
enum Flag : int { FLAG_BAD = 1, FLAG_PASS3 = 2, FLAG_TAIL = 4, FLAG_TAIL_REDONE = 8 };

constexpr int64_t TILE1 = 1024;  // pass-1 tile (values), fits L1 for any dtype
constexpr int64_t TILE2 = 1024;  // pass-2 tile (indices): 256 values per SIMD lane, 16 KB of exps
constexpr double R_TOL = 1e-15;  // Taylor remainder of G allowed, relative to s_p
constexpr double FLUSH = -708.0;  // exp(a) for a < FLUSH is taken as 0
constexpr double G_MIN = 1e-300;  // g >= G_MIN: g ln g of a flushed pair is ~1e-297

// Tail tiles (SIMD path; error analysis in the comment above `tail_bound`).
constexpr double TAIL_BUDGET = 1.25e-13;   // per field, absolute: 1/8 of the contract's atol 1e-12
constexpr double EPS_TAIL_EXP = 1.25e-9;   // bound on the relative error of exp_tail_pd (< 4.1e-11)
constexpr double ETA_TAIL_LOG = 7e-9;      // absolute error of ln g from ln_cosh_pd
constexpr double TAIL_DELTA_MAX = 0.75;
constexpr uint8_t TAIL = 1, TAIL_NOFLUSH = 2;  // tail tile; tail tile whose a >= FLUSH + 1 on both sides    // |delta| bound of a tile that takes ln_cosh_pd

struct Args {
    const void* zp;
    const void* zq;
    int64_t n, vocab, stride_p, stride_q;  // strides in elements
    int dtype, kk;
    double* sums;      // [n, 8]: s_p A_p s_q A_q D_p D_q G S_d
    double* maxes;     // [n, 2]
    int64_t* top_ids;  // [n, 2, kk]
    double* top_vals;  // [n, 2, kk]
    int32_t* flags;    // [n]: FLAG_BAD (non-finite input: sums NaN), FLAG_PASS3
};

// ----------------------------------------------------------------------------- scalar

inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man) {  // subnormal half: normalise
        int e = -1;
        do { man <<= 1; ++e; } while (!(man & 0x400));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ff) << 13);
    } else {
        bits = sign;
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

inline float load1(const void* base, int64_t i, int dtype) {
    if (dtype == F32) return static_cast<const float*>(base)[i];
    uint16_t h = static_cast<const uint16_t*>(base)[i];
    if (dtype == F16) return half_to_float(h);
    uint32_t bits = (uint32_t)h << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

// Bounded min-heap of the kk best (value desc, id asc) seen so far; ids arrive ascending,
// so a newcomer equal to the threshold never wins (it has the higher id).
struct TopK {
    int kk = 0;
    std::vector<std::pair<float, int64_t>> h;
    static bool worse(const std::pair<float, int64_t>& a, const std::pair<float, int64_t>& b) {
        return a.first < b.first || (a.first == b.first && a.second > b.second);
    }
    // heap comparator: "a after b" so that the worst element is at the front
    static bool cmp(const std::pair<float, int64_t>& a, const std::pair<float, int64_t>& b) { return worse(b, a); }
    void reset(int k) { kk = k; h.clear(); h.reserve(k); }
    bool full() const { return (int)h.size() == kk; }
    float threshold() const { return full() ? h.front().first : -std::numeric_limits<float>::infinity(); }
    void offer(float v, int64_t id) {
        if (!full()) {
            h.emplace_back(v, id);
            std::push_heap(h.begin(), h.end(), cmp);
        } else if (v > h.front().first) {
            std::pop_heap(h.begin(), h.end(), cmp);
            h.back() = {v, id};
            std::push_heap(h.begin(), h.end(), cmp);
        }
    }
    void write(int64_t* ids, double* vals) {
        std::sort(h.begin(), h.end(), [](const auto& a, const auto& b) { return worse(b, a); });
        for (int j = 0; j < kk; ++j) { ids[j] = h[j].second; vals[j] = h[j].first; }
    }
};

// Pass-1 record of one tile of TILE1 values (SIMD path): its maximum and its float32-grade
// sum of exp(z - m_ref), m_ref the running maximum when it was summed. Pass 2 uses it only
// to choose tail tiles (a guess; the choice is checked afterwards by `tail_bound`).
struct TileEst {
    float tmax, m_ref, tmin;  // tmin: lets pass 2 drop the exp's underflow test on the tile
    double sum;
};

struct Side1 {  // pass-1 result of one side
    float m;
    double s_est;  // float-grade estimate of sum exp(z - m)
    bool bad;
};

// Pass 1, portable: maximum, top-kk, estimate of s (std::exp: exact to the estimate's
// purpose), non-finite check.
Side1 pass1_scalar(const void* z, int64_t v, int dtype, TopK& top) {
    float m = -std::numeric_limits<float>::infinity();
    double s = 0.0;
    for (int64_t i = 0; i < v; ++i) {
        float x = load1(z, i, dtype);
        if (!std::isfinite(x)) return {x, NAN, true};
        if (x > m) {
            s = (m == -std::numeric_limits<float>::infinity()) ? 0.0 : s * std::exp((double)m - (double)x);
            m = x;
        }
        s += std::exp((double)x - (double)m);
        top.offer(x, i);
    }
    return {m, s, false};
}

struct Sums {
    double sp, ap, sq, aq, dp, dq, g0, h, sd;
};

// Totals over a row's tail tiles: sum e_p, sum e_q, sum e_p a_p, sum e_q a_q (<= 0),
// sum g |ln g|, sum g, max |delta|, tile count.
struct TailSums {
    double ep = 0, eq = 0, acp = 0, acq = 0, gabs = 0, gsum = 0, dmax = 0;
    int64_t tiles = 0;
};

// Pass 2 over [i0, i1), portable (also the tail of the SIMD pass).
void pass2_scalar(const void* zp, const void* zq, int64_t i0, int64_t i1, int dtype, double mp, double mq,
                  double r0, Sums& t) {
    for (int64_t i = i0; i < i1; ++i) {
        double ap = (double)load1(zp, i, dtype) - mp, aq = (double)load1(zq, i, dtype) - mq;
        double ep = ap < FLUSH ? 0.0 : std::exp(ap), eq = aq < FLUSH ? 0.0 : std::exp(aq);
        double d = ap - aq;
        t.sp += ep; t.ap += ep * ap; t.sq += eq; t.aq += eq * aq;
        t.dp += ep * d; t.dq += eq * d; t.sd += ep - eq;
        double g = std::max(std::fma(r0, eq, ep), G_MIN), lg = std::log(g);
        t.g0 += g * lg; t.h += eq * lg;
    }
}

// ----------------------------------------------------------------------------- AVX2

#if LD_X86
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

template <int dtype>
__attribute__((target("avx2,fma,f16c"))) inline __m256 load8(const void* base, int64_t i) {
    if (dtype == F32) return _mm256_loadu_ps(static_cast<const float*>(base) + i);
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + i));
    if (dtype == F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

template <int dtype>
__attribute__((target("avx2,fma,f16c"))) inline __m256d load4d(const void* base, int64_t i) {
    __m128 f;
    if (dtype == F32) {
        f = _mm_loadu_ps(static_cast<const float*>(base) + i);
    } else {
        __m128i h = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + i));
        // bf16: interleaving zeros below each value is its float32 bit pattern (one shuffle)
        f = dtype == F16 ? _mm_cvtph_ps(h) : _mm_castsi128_ps(_mm_unpacklo_epi16(_mm_setzero_si128(), h));
    }
    return _mm256_cvtps_pd(f);
}

// float32 exp for x <= 0 (the pass-1 estimate only): |rel err| < 3e-7. Built like
// exp_ps_rough (n from the rounding constant, 2^n added to the exponent field, x clamped at
// -86: e^-86 instead of 0 below it moves an estimate s >= 1 by < V 4e-38).
__attribute__((target("avx2,fma,f16c"))) inline __m256 exp_ps(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-86.0f));
    const __m256 magic = _mm256_set1_ps(12582912.0f);  // 1.5 * 2^23
    __m256 t = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504f), magic);
    __m256 n = _mm256_sub_ps(t, magic);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
    __m256 p = _mm256_set1_ps(1.0f / 5040);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), _mm256_slli_epi32(_mm256_castps_si256(t), 23)));
}

// float32 exp for x <= 0, Taylor degree 4 after the ln2 reduction (|r| <= 0.347):
// |rel err| <= e^|r| r^5/120 (5.9e-5) + n (ln2 - fl(ln2)) (2.4e-7) + rounding < 1e-4
// (ROUGH_ERR). Pass 1's estimate of deep tiles only (degree 3 had 1e-3: the deep-tile test
// then sent about half the tail tiles of a peaked row to the float64-accumulated loop). n from
// the rounding constant 1.5 * 2^23 (its low mantissa bits are then n), 2^n added to p's
// exponent field (exact: p in [0.7, 1.42], n >= -125); x is clamped at -86 rather than
// flushed: e^-86 = 4e-38 per value instead of 0 moves an estimate (s >= 1) by < V 4e-38.
__attribute__((target("avx2,fma,f16c"))) inline __m256 exp_ps_rough(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-86.0f));
    const __m256 magic = _mm256_set1_ps(12582912.0f);  // 1.5 * 2^23
    __m256 t = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504f), magic);
    __m256 n = _mm256_sub_ps(t, magic);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693147182f), x);
    __m256 p = _mm256_set1_ps(1.0f / 24);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), _mm256_slli_epi32(_mm256_castps_si256(t), 23)));
}

// exp_pd's argument reduction: a = n ln2/2 + r, |r| <= ln2/4; t holds n + 1.5 * 2^52
// (shared by exp_pd and the compact section's cb_exp_pd: same operations, same values)
__attribute__((target("avx2,fma,f16c"))) inline void exp_pd_split(__m256d a, __m256d& under, __m256d& t, __m256d& r) {
    const __m256d lo = _mm256_set1_pd(FLUSH);
    under = _mm256_cmp_pd(a, lo, _CMP_LT_OQ);
    __m256d x = _mm256_max_pd(lo, a);  // max(lo, NaN) = NaN
    const __m256d magic = _mm256_set1_pd(6755399441055744.0);  // 1.5 * 2^52
    t = _mm256_fmadd_pd(x, _mm256_set1_pd(2.8853900817779268), magic);  // x * 2/ln2
    __m256d n = _mm256_sub_pd(t, magic);
    // ln2/2 = C1 + C2 (fdlibm's ln2_hi/2, ln2_lo/2): n * C1 is exact for |n| <= 2043
    r = _mm256_fnmadd_pd(n, _mm256_set1_pd(0.34657359018456191), x);
    r = _mm256_fnmadd_pd(n, _mm256_set1_pd(9.5410746463529385e-11), r);
}

// exp_pd's end: p = e^r times 2^(n/2); below FLUSH, 0
__attribute__((target("avx2,fma,f16c"))) inline __m256d exp_pd_join(__m256d under, __m256d t, __m256d p) {
    const __m256d magic = _mm256_set1_pd(6755399441055744.0);  // 1.5 * 2^52
    // n in [-2043, 0]: u = n + 2048 >= 0, 2^floor(n/2) has biased exponent (u >> 1) - 1
    __m256i u = _mm256_add_epi64(_mm256_sub_epi64(_mm256_castpd_si256(t), _mm256_castpd_si256(magic)), _mm256_set1_epi64x(2048));
    __m256d scale = _mm256_castsi256_pd(_mm256_slli_epi64(_mm256_sub_epi64(_mm256_srli_epi64(u, 1), _mm256_set1_epi64x(1)), 52));
    __m256d odd = _mm256_castsi256_pd(_mm256_cmpeq_epi64(_mm256_and_si256(u, _mm256_set1_epi64x(1)), _mm256_set1_epi64x(1)));
    p = _mm256_mul_pd(p, _mm256_blendv_pd(_mm256_set1_pd(1.0), _mm256_set1_pd(1.4142135623730951), odd));
    return _mm256_andnot_pd(under, _mm256_mul_pd(p, scale));
}

// float64 exp for a <= 0 (see the header for its error); NaN propagates.
__attribute__((target("avx2,fma,f16c"))) inline __m256d exp_pd(__m256d a) {
    __m256d under, t, r;
    exp_pd_split(a, under, t, r);
    __m256d p = _mm256_set1_pd(1.0 / 39916800);
    p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(1.0 / 3628800));
    p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(1.0 / 362880));
    p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(1.0 / 40320));
    p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(1.0 / 5040));
    p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(1.0 / 720));
    p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(1.0 / 120));
    p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(1.0 / 24));
    p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(1.0 / 6));
    p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(0.5));
    p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(1.0));
    p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(1.0));
    return exp_pd_join(under, t, p);
}

// float64 exp for a <= 0, tail tiles only (EPS_TAIL_EXP). n = round(a / ln2) from the
// rounding constant 1.5 * 2^52, whose low mantissa bits are then n (two's complement);
// r = a - n ln2 in one FMA with ln2 rounded to double (|n ln2 - n fl(ln2)| <= 1021 *
// 2.3e-17 = 2.4e-14, relative error of e^r alike), |r| <= ln2/2; e^r by a degree-7
// minimax polynomial for the relative error on [-ln2/2, ln2/2] (Remez, coefficients
// rounded to double, checked in 50-digit arithmetic on 200,001 points: 4.03e-11; the
// error's derivative is ~1e-9, so between the points it cannot grow by more than 1e-14),
// Horner rounding < 2e-15; then 2^n by adding n to the exponent field of p (an integer add
// instead of a multiply: p in [0.7, 1.42] and n >= -1021 after the FLUSH clamp keep it
// normal, so it is exact). Total < 4.1e-11 relative; EPS_TAIL_EXP (1.25e-9) is kept as the
// bound: 30x above the error, so the tile choice and the redo rule are those measured.
// 14 operations per 4 values, 11 of them on the FMA/multiply pipes (the half-ln2 degree-6
// version this replaced: 22 and 15). `flush` false: the caller knows a >= FLUSH + 1 on the
// whole tile (pass 1's tile minimum): the underflow test and clamp are left out.
template <bool flush = true>
__attribute__((target("avx2,fma,f16c"))) inline __m256d exp_tail_pd(__m256d a) {
    const __m256d lo = _mm256_set1_pd(FLUSH);
    __m256d under = flush ? _mm256_cmp_pd(a, lo, _CMP_LT_OQ) : _mm256_setzero_pd();
    __m256d x = flush ? _mm256_max_pd(lo, a) : a;  // max(lo, NaN) = NaN
    const __m256d magic = _mm256_set1_pd(6755399441055744.0);  // 1.5 * 2^52
    __m256d t = _mm256_fmadd_pd(x, _mm256_set1_pd(1.4426950408889634), magic);  // x / ln2
    __m256d n = _mm256_sub_pd(t, magic);
    __m256d r = _mm256_fnmadd_pd(n, _mm256_set1_pd(0.69314718055994531), x);
    __m256d p = _mm256_set1_pd(0.00019775172970320967);
    p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(0.0013948183320226801));
    p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(0.008333561087398854));
    p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(0.04166622542563472));
    p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(0.16666665126153235));
    p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(0.5000000104536161));
    p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(1.0000000002430944));
    p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(0.999999999961682));
    __m256d e = _mm256_castsi256_pd(_mm256_add_epi64(_mm256_castpd_si256(p), _mm256_slli_epi64(_mm256_castpd_si256(t), 52)));
    return flush ? _mm256_andnot_pd(under, e) : e;
}

// float64 log for normal g > 0 (see the header for its error).
// log_pd's argument reduction: g = 2^e * m, m in (sqrt(1/2), sqrt(2)], f = (m - 1) / (m + 1)
// (shared by log_pd and the compact section's cb_log_pd: same operations, same values)
__attribute__((target("avx2,fma,f16c"))) inline void log_pd_split(__m256d g, __m256d& e, __m256d& f) {
    __m256i bits = _mm256_castpd_si256(g);
    __m256i ex = _mm256_srli_epi64(bits, 52);  // biased exponent (g > 0)
    __m256d m = _mm256_castsi256_pd(_mm256_or_si256(_mm256_and_si256(bits, _mm256_set1_epi64x(0x000fffffffffffffLL)),
                                                    _mm256_set1_epi64x(0x3ff0000000000000LL)));
    __m256d big = _mm256_cmp_pd(m, _mm256_set1_pd(1.4142135623730951), _CMP_GT_OQ);
    m = _mm256_blendv_pd(m, _mm256_mul_pd(m, _mm256_set1_pd(0.5)), big);
    ex = _mm256_sub_epi64(ex, _mm256_castpd_si256(big));  // big lanes are all ones = -1
    // exponent as double: ex - 1023 via the 2^52 trick
    const __m256d two52 = _mm256_set1_pd(4503599627370496.0);
    e = _mm256_sub_pd(_mm256_castsi256_pd(_mm256_or_si256(ex, _mm256_castpd_si256(two52))),
                      _mm256_set1_pd(4503599627370496.0 + 1023.0));
    f = _mm256_div_pd(_mm256_sub_pd(m, _mm256_set1_pd(1.0)), _mm256_add_pd(m, _mm256_set1_pd(1.0)));
}

// log_pd's end: 2f + 2f^3 P(f^2) + e ln2 (ln2 split hi + lo)
__attribute__((target("avx2,fma,f16c"))) inline __m256d log_pd_join(__m256d e, __m256d f, __m256d f2, __m256d p) {
    __m256d f2x = _mm256_add_pd(f, f);
    __m256d lnm = _mm256_fmadd_pd(_mm256_mul_pd(f2x, f2), p, f2x);  // 2f + 2f^3 P(f^2)
    __m256d lo = _mm256_fmadd_pd(e, _mm256_set1_pd(1.9082149292705877e-10), lnm);  // ln2 = hi + lo
    return _mm256_fmadd_pd(e, _mm256_set1_pd(0.69314718036912382), lo);
}

__attribute__((target("avx2,fma,f16c"))) inline __m256d log_pd(__m256d g) {
    __m256d e, f;
    log_pd_split(g, e, f);
    __m256d f2 = _mm256_mul_pd(f, f);
    __m256d p = _mm256_set1_pd(1.0 / 19);
    p = _mm256_fmadd_pd(p, f2, _mm256_set1_pd(1.0 / 17));
    p = _mm256_fmadd_pd(p, f2, _mm256_set1_pd(1.0 / 15));
    p = _mm256_fmadd_pd(p, f2, _mm256_set1_pd(1.0 / 13));
    p = _mm256_fmadd_pd(p, f2, _mm256_set1_pd(1.0 / 11));
    p = _mm256_fmadd_pd(p, f2, _mm256_set1_pd(1.0 / 9));
    p = _mm256_fmadd_pd(p, f2, _mm256_set1_pd(1.0 / 7));
    p = _mm256_fmadd_pd(p, f2, _mm256_set1_pd(1.0 / 5));
    p = _mm256_fmadd_pd(p, f2, _mm256_set1_pd(1.0 / 3));
    return log_pd_join(e, f, f2, p);
}

// ln cosh x for |x| <= TAIL_DELTA_MAX/2 = 0.375, series through x^10 (tail tiles only):
// ln cosh x = x^2/2 - x^4/12 + x^6/45 - 17x^8/2520 + 31x^10/14175 - 691x^12/935550 + ...
// alternates with decreasing terms for |x| < pi/2, so the truncation is below the first
// omitted term, 691/935550 * 0.375^12 = 5.7e-9; with ln g = ln2 + (a_p + a_q + ln r0)/2
// + ln cosh(delta/2) (rounding <= 4u (|ln g| + 1) <= 7e-13 for |ln g| <= 1500):
// ETA_TAIL_LOG = 7e-9 absolute.
__attribute__((target("avx2,fma,f16c"))) inline __m256d ln_cosh_pd(__m256d x) {
    __m256d y = _mm256_mul_pd(x, x);
    __m256d p = _mm256_set1_pd(31.0 / 14175);
    p = _mm256_fmadd_pd(p, y, _mm256_set1_pd(-17.0 / 2520));
    p = _mm256_fmadd_pd(p, y, _mm256_set1_pd(1.0 / 45));
    p = _mm256_fmadd_pd(p, y, _mm256_set1_pd(-1.0 / 12));
    p = _mm256_fmadd_pd(p, y, _mm256_set1_pd(0.5));
    return _mm256_mul_pd(p, y);
}

__attribute__((target("avx2,fma,f16c"))) inline double hsum(__m256d v) {
    __m128d s = _mm_add_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
    return _mm_cvtsd_f64(_mm_add_sd(s, _mm_unpackhi_pd(s, s)));
}

__attribute__((target("avx2,fma,f16c"))) inline double hmax_pd(__m256d v) {
    __m128d s = _mm_max_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
    return _mm_cvtsd_f64(_mm_max_sd(s, _mm_unpackhi_pd(s, s)));
}

__attribute__((target("avx2,fma,f16c"))) inline float hmin(__m256 v) {
    __m128 s = _mm_min_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_min_ps(s, _mm_movehl_ps(s, s));
    s = _mm_min_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

__attribute__((target("avx2,fma,f16c"))) inline float hmax(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

// Top-kk of the first vv values (a multiple of 8) into `top`, once every tile's maximum is
// known (est). The kk-th largest tile maximum T bounds the kk-th largest value from below (kk
// tiles hold a value >= T each), so only tiles whose maximum is >= T can hold a top-kk value,
// and in them only values >= T: those are offered, in ascending id order (the heap's tie
// rule needs it). A threshold known before the scan, not the heap's running one: that one
// starts low and, on real rows, rescanned ~kk ln(tiles / kk) tiles and made thousands of heap
// operations per row (+0.67 ms per row at V = 262,144, kk = 64; bench/RESULTS.md, issue 40).
template <int dtype>
__attribute__((target("avx2,fma,f16c"))) void topk_from_tiles(const void* z, int64_t vv, TopK& top, const TileEst* est) {
    const int64_t ntile = (vv + TILE1 - 1) / TILE1;
    float T = -std::numeric_limits<float>::infinity();
    if (ntile >= top.kk) {
        thread_local std::vector<float> mx;
        mx.resize((size_t)ntile);
        for (int64_t t = 0; t < ntile; ++t) mx[(size_t)t] = est[t].tmax;
        std::nth_element(mx.begin(), mx.begin() + (top.kk - 1), mx.end(), std::greater<float>());
        T = mx[(size_t)(top.kk - 1)];
    }
    for (int64_t t = 0; t < ntile; ++t) {
        if (!(est[t].tmax >= T)) continue;
        const int64_t t1 = std::min(vv, (t + 1) * TILE1);
        for (int64_t i = t * TILE1; i < t1; i += 8) {
            __m256 x = load8<dtype>(z, i);
            // not yet full: every value >= T; full: only one above the heap's worst (an equal
            // one has the higher id and loses), which is >= T
            int mask = top.full() ? _mm256_movemask_ps(_mm256_cmp_ps(x, _mm256_set1_ps(top.threshold()), _CMP_GT_OQ))
                                  : _mm256_movemask_ps(_mm256_cmp_ps(x, _mm256_set1_ps(T), _CMP_GE_OQ));
            while (mask) {
                int j = __builtin_ctz(mask);
                mask &= mask - 1;
                top.offer(load1(z, i + j, dtype), i + j);
            }
        }
    }
}

template <int dtype>
__attribute__((target("avx2,fma,f16c"))) Side1 pass1_avx2(const void* z, int64_t v, TopK& top, TileEst* est) {
    const float ninf = -std::numeric_limits<float>::infinity();
    float m = ninf;
    double s = 0.0;
    int64_t vv = v / 8 * 8;
    auto tile_sum = [&](int64_t t0, int64_t t1, float m) {
        __m256d acc = _mm256_setzero_pd();
        const __m256 mv = _mm256_set1_ps(m);
        for (int64_t i = t0; i < t1; i += 8) {
            __m256 e = exp_ps(_mm256_sub_ps(load8<dtype>(z, i), mv));
            acc = _mm256_add_pd(acc, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
            acc = _mm256_add_pd(acc, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
        }
        return hsum(acc);
    };
    // A tile whose estimate is tiny next to s may be summed with exp_ps_rough (rel err 1e-4)
    // in float32: it is kept when 1e-4 ts <= DEEP_REL max(s, 1) (s relative to the running
    // maximum is >= 1 at the end), so all such tiles move s by < V/TILE1 * DEEP_REL = 5e-9
    // relative, 1/9 of the 4.5e-8 error of r0 that the pass-3 bound tolerates (that bound,
    // not this one, guards the result). Whether to try it is guessed from the previous tile.
    constexpr double DEEP_REL = 2e-11, ROUGH_ERR = 1e-4;
    bool deep = false;
    for (int64_t t0 = 0; t0 < vv; t0 += TILE1) {
        int64_t t1 = std::min(vv, t0 + TILE1);
        // One loop for the tile's maximum, the non-finite check and the estimate relative to
        // the running maximum m; the rare tile that raises m (~ln(V/TILE1) of them) is summed
        // again (what the first loop gave it, possibly inf/NaN, is dropped).
        __m256 vmax = _mm256_set1_ps(ninf), vmin = _mm256_set1_ps(std::numeric_limits<float>::infinity()),
               bad = _mm256_setzero_ps();
        __m256d acc = _mm256_setzero_pd();
        __m256 acc32 = _mm256_setzero_ps();
        const __m256 mv = _mm256_set1_ps(m);
        if (deep) {
            for (int64_t i = t0; i < t1; i += 8) {
                __m256 x = load8<dtype>(z, i);
                vmax = _mm256_max_ps(vmax, x);
                vmin = _mm256_min_ps(vmin, x);
                __m256 dx = _mm256_sub_ps(x, x);
                bad = _mm256_or_ps(bad, _mm256_cmp_ps(dx, dx, _CMP_UNORD_Q));
                acc32 = _mm256_add_ps(acc32, exp_ps_rough(_mm256_sub_ps(x, mv)));
            }
        } else {
            for (int64_t i = t0; i < t1; i += 8) {
                __m256 x = load8<dtype>(z, i);
                vmax = _mm256_max_ps(vmax, x);
                vmin = _mm256_min_ps(vmin, x);
                __m256 dx = _mm256_sub_ps(x, x);  // NaN for NaN and +-inf
                bad = _mm256_or_ps(bad, _mm256_cmp_ps(dx, dx, _CMP_UNORD_Q));
                __m256 e = exp_ps(_mm256_sub_ps(x, mv));
                acc = _mm256_add_pd(acc, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
                acc = _mm256_add_pd(acc, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
            }
        }
        if (_mm256_movemask_ps(bad)) return {NAN, NAN, true};
        float tm = hmax(vmax);
        double ts;
        if (tm > m) {
            s = (m == ninf) ? 0.0 : s * std::exp((double)m - (double)tm);
            m = tm;
            ts = tile_sum(t0, t1, m);
        } else if (deep) {
            acc = _mm256_add_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(acc32)), _mm256_cvtps_pd(_mm256_extractf128_ps(acc32, 1)));
            ts = hsum(acc);
            if (ROUGH_ERR * ts > DEEP_REL * std::max(s, 1.0)) ts = tile_sum(t0, t1, m);  // not deep enough
        } else {
            ts = hsum(acc);
        }
        deep = ROUGH_ERR * ts <= 0.25 * DEEP_REL * std::max(s, 1.0);
        s += ts;
        est[t0 / TILE1] = {tm, m, hmin(vmin), ts};
    }
    topk_from_tiles<dtype>(z, vv, top, est);
    for (int64_t i = vv; i < v; ++i) {  // tail
        float x = load1(z, i, dtype);
        if (!std::isfinite(x)) return {x, NAN, true};
        if (x > m) {
            s = (m == ninf) ? 0.0 : s * std::exp((double)m - (double)x);
            m = x;
        }
        s += std::exp((double)x - (double)m);
        top.offer(x, i);
    }
    return {m, s, false};
}

// Per tile, two loops: exps and the seven linear sums (the exps kept in an L1-resident
// buffer), then g, ln g and their two sums. One fused loop needs more live vectors than
// AVX2 has registers; the split was measured ~30 % faster (CPU time per row).
// Tiles marked in `tail_tiles` take exp_tail_pd and, when every |delta| of the tile
// (delta = a_p - a_q - ln r0) is <= TAIL_DELTA_MAX, ln g from ln_cosh_pd instead of log_pd;
// their totals go to `ts` for `tail_bound`.
template <int dtype, bool tail>
__attribute__((target("avx2,fma,f16c"))) inline void pass2_tile(const void* zp, const void* zq, int64_t t0, int64_t t1,
                                                                double mp, double mq, double r0, double* bp, double* bq,
                                                                __m256d* T, TailSums& ts) {
    const __m256d mpv = _mm256_set1_pd(mp), mqv = _mm256_set1_pd(mq), r0v = _mm256_set1_pd(r0),
                  gmin = _mm256_set1_pd(G_MIN), lr0 = _mm256_set1_pd(std::log(r0)),
                  sign = _mm256_set1_pd(-0.0);
    __m256d sp = _mm256_setzero_pd(), ap_ = sp, sq = sp, aq_ = sp, dp = sp, dq = sp, sd = sp, dmax = sp;
    for (int64_t i = t0; i < t1; i += 4) {
        __m256d ap = _mm256_sub_pd(load4d<dtype>(zp, i), mpv);
        __m256d aq = _mm256_sub_pd(load4d<dtype>(zq, i), mqv);
        __m256d ep = tail ? exp_tail_pd(ap) : exp_pd(ap), eq = tail ? exp_tail_pd(aq) : exp_pd(aq);
        _mm256_store_pd(bp + (i - t0), ep);
        _mm256_store_pd(bq + (i - t0), eq);
        __m256d d = _mm256_sub_pd(ap, aq);
        sp = _mm256_add_pd(sp, ep);
        ap_ = _mm256_fmadd_pd(ep, ap, ap_);
        sq = _mm256_add_pd(sq, eq);
        aq_ = _mm256_fmadd_pd(eq, aq, aq_);
        dp = _mm256_fmadd_pd(ep, d, dp);
        dq = _mm256_fmadd_pd(eq, d, dq);
        sd = _mm256_add_pd(sd, _mm256_sub_pd(ep, eq));
        if (tail) dmax = _mm256_max_pd(dmax, _mm256_andnot_pd(sign, _mm256_sub_pd(d, lr0)));
    }
    __m256d g0 = _mm256_setzero_pd(), h = g0, gabs = g0, gsum = g0;
    double dm = tail ? hmax_pd(dmax) : 0.0;
    if (tail && dm <= TAIL_DELTA_MAX) {
        const __m256d half = _mm256_set1_pd(0.5), c0 = _mm256_set1_pd(0.69314718055994531 + 0.5 * std::log(r0));
        for (int64_t i = t0; i < t1; i += 4) {
            __m256d ap = _mm256_sub_pd(load4d<dtype>(zp, i), mpv);
            __m256d aq = _mm256_sub_pd(load4d<dtype>(zq, i), mqv);
            __m256d ep = _mm256_load_pd(bp + (i - t0)), eq = _mm256_load_pd(bq + (i - t0));
            __m256d g = _mm256_fmadd_pd(r0v, eq, ep);
            __m256d x = _mm256_mul_pd(half, _mm256_sub_pd(_mm256_sub_pd(ap, aq), lr0));
            __m256d lg = _mm256_add_pd(_mm256_fmadd_pd(half, _mm256_add_pd(ap, aq), c0), ln_cosh_pd(x));
            g0 = _mm256_fmadd_pd(g, lg, g0);
            h = _mm256_fmadd_pd(eq, lg, h);
            gabs = _mm256_fmadd_pd(g, _mm256_andnot_pd(sign, lg), gabs);
            gsum = _mm256_add_pd(gsum, g);
        }
    } else {
        for (int64_t i = 0; i < t1 - t0; i += 4) {
            __m256d ep = _mm256_load_pd(bp + i), eq = _mm256_load_pd(bq + i);
            __m256d g = _mm256_max_pd(_mm256_fmadd_pd(r0v, eq, ep), gmin);  // NaN g -> gmin (row is refused anyway)
            __m256d lg = log_pd(g);
            g0 = _mm256_fmadd_pd(g, lg, g0);
            h = _mm256_fmadd_pd(eq, lg, h);
            if (tail) {
                gabs = _mm256_fmadd_pd(g, _mm256_andnot_pd(sign, lg), gabs);
                gsum = _mm256_add_pd(gsum, g);
            }
        }
    }
    T[0] = _mm256_add_pd(T[0], sp); T[1] = _mm256_add_pd(T[1], ap_); T[2] = _mm256_add_pd(T[2], sq);
    T[3] = _mm256_add_pd(T[3], aq_); T[4] = _mm256_add_pd(T[4], dp); T[5] = _mm256_add_pd(T[5], dq);
    T[6] = _mm256_add_pd(T[6], g0); T[7] = _mm256_add_pd(T[7], h); T[8] = _mm256_add_pd(T[8], sd);
    if (tail) {
        ts.ep += hsum(sp); ts.eq += hsum(sq); ts.acp += hsum(ap_); ts.acq += hsum(aq_);
        ts.gabs += hsum(gabs); ts.gsum += hsum(gsum);
        ts.dmax = std::max(ts.dmax, dm);
        ts.tiles += 1;
    }
}

// Tail tiles, one fused loop (no exp buffer, no log, no second read of the tile). With
// x = delta/2 and delta = a_p - a_q - ln r0, ln g = c + (a_p + a_q)/2 + L, c = ln2 + ln(r0)/2,
// L = ln cosh(delta/2) (exact identity: e_p + r0 e_q = 2 sqrt(r0 e_p e_q) cosh(delta/2)). So
//   G0 = sum g ln g = c (E_p + r0 E_q) + (2 A_p - D_p + r0 (2 A_q + D_q))/2 + SL_p + r0 SL_q,
//   H  = sum e_q ln g = c E_q + (2 A_q + D_q)/2 + SL_q,
// (sum g a_p = A_p + r0 (A_q + D_q), sum g a_q = A_p - D_p + r0 A_q) from the linear sums
// the tile needs anyway plus SL = sum e L, two FMAs per side and a short polynomial in
// delta^2 instead of log. The computed G0 is sum g~ ln g with g~ = e~_p + r0 e~_q (linear
// in the computed exps with coefficient ln g, up to L's truncation eta and rounding of
// order ulp sum g |ln g|), so `tail_bound`'s dG0 = eps (Gabs + Gsum) + eta Gsum and dH hold
// as before. Gsum = E_p + r0 E_q; Gabs = sum g |ln g| <= -G0 + 2 max(0, ln(1 + r0)) Gsum
// (|ln g| = -ln g + 2 max(ln g, 0) and g <= 1 + r0 as e <= 1), plus eta Gsum for L's error.
// Returns false (nothing added) when some |delta| > TAIL_DELTA_MAX: the caller then takes
// the tile with `pass2_tile<dtype, true>` (log_pd). `flush`: see exp_tail_pd.
template <int dtype, bool flush>
__attribute__((target("avx2,fma,f16c"))) inline bool pass2_tail_fused(const void* zp, const void* zq, int64_t t0,
                                                                      int64_t t1, double mp, double mq, double r0,
                                                                      __m256d* T, TailSums& ts) {
    const __m256d mpv = _mm256_set1_pd(mp), mqv = _mm256_set1_pd(mq), lr0 = _mm256_set1_pd(std::log(r0));
    // ln cosh(delta/2) = sum_k c_k (delta^2/4)^k with c = 1/2, -1/12, 1/45, -17/2520, 31/14175
    // (see ln_cosh_pd: truncation <= 5.7e-9 for |delta| <= 0.75), the 4^-k folded in.
    const __m256d k1 = _mm256_set1_pd(1.0 / 8), k2 = _mm256_set1_pd(-1.0 / 192), k3 = _mm256_set1_pd(1.0 / 2880),
                  k4 = _mm256_set1_pd(-17.0 / 645120), k5 = _mm256_set1_pd(31.0 / 14515200);
    __m256d sp = _mm256_setzero_pd(), ap_ = sp, sq = sp, aq_ = sp, dp = sp, dq = sp, dmax = sp, slp = sp, slq = sp;
    for (int64_t i = t0; i < t1; i += 4) {
        __m256d ap = _mm256_sub_pd(load4d<dtype>(zp, i), mpv);
        __m256d aq = _mm256_sub_pd(load4d<dtype>(zq, i), mqv);
        __m256d ep = exp_tail_pd<flush>(ap), eq = exp_tail_pd<flush>(aq);
        __m256d d = _mm256_sub_pd(ap, aq);
        sp = _mm256_add_pd(sp, ep);
        ap_ = _mm256_fmadd_pd(ep, ap, ap_);
        sq = _mm256_add_pd(sq, eq);
        aq_ = _mm256_fmadd_pd(eq, aq, aq_);
        dp = _mm256_fmadd_pd(ep, d, dp);
        dq = _mm256_fmadd_pd(eq, d, dq);
        __m256d dl = _mm256_sub_pd(d, lr0);
        __m256d y = _mm256_mul_pd(dl, dl);
        dmax = _mm256_max_pd(y, dmax);  // of delta^2 (one operation less than of |delta|; NaN rows never get here)
        __m256d p = _mm256_fmadd_pd(k5, y, k4);
        p = _mm256_fmadd_pd(p, y, k3);
        p = _mm256_fmadd_pd(p, y, k2);
        p = _mm256_fmadd_pd(p, y, k1);
        __m256d l = _mm256_mul_pd(p, y);
        slp = _mm256_fmadd_pd(ep, l, slp);
        slq = _mm256_fmadd_pd(eq, l, slq);
    }
    double dm = std::sqrt(hmax_pd(dmax)) * (1 + 0x1p-50);  // >= max |delta| despite the rounding of delta^2
    if (!(dm <= TAIL_DELTA_MAX)) return false;  // also NaN
    double e_p = hsum(sp), e_q = hsum(sq), a_p = hsum(ap_), a_q = hsum(aq_), d_p = hsum(dp), d_q = hsum(dq);
    double sl_p = hsum(slp), sl_q = hsum(slq);
    double c = 0.69314718055994531 + 0.5 * std::log(r0), gsum = e_p + r0 * e_q;
    double g0 = c * gsum + 0.5 * (2 * a_p - d_p + r0 * (2 * a_q + d_q)) + sl_p + r0 * sl_q;
    double h = c * e_q + 0.5 * (2 * a_q + d_q) + sl_q;
    T[0] = _mm256_add_pd(T[0], sp); T[1] = _mm256_add_pd(T[1], ap_); T[2] = _mm256_add_pd(T[2], sq);
    T[3] = _mm256_add_pd(T[3], aq_); T[4] = _mm256_add_pd(T[4], dp); T[5] = _mm256_add_pd(T[5], dq);
    T[6] = _mm256_add_pd(T[6], _mm256_set_pd(0, 0, 0, g0)); T[7] = _mm256_add_pd(T[7], _mm256_set_pd(0, 0, 0, h));
    T[8] = _mm256_add_pd(T[8], _mm256_sub_pd(sp, sq));  // S_d of a tail tile: E_p - E_q (its rounding ~ ulp E, E << s)
    ts.ep += e_p; ts.eq += e_q; ts.acp += a_p; ts.acq += a_q;
    ts.gabs += std::max(0.0, -g0 + (2 * std::max(0.0, std::log1p(r0)) + ETA_TAIL_LOG) * gsum);
    ts.gsum += gsum;
    ts.dmax = std::max(ts.dmax, dm);
    ts.tiles += 1;
    return true;
}

// Pass 2 of a row; compiled twice (`pass2_avx2`, `pass2_evex`), see below.
template <int dtype>
__attribute__((target("avx2,fma,f16c"), always_inline)) inline void pass2_body(const void* zp, const void* zq, int64_t v,
                                                                               double mp, double mq, double r0,
                                                                               const uint8_t* tail_tiles, Sums& out,
                                                                               TailSums& ts) {
    alignas(32) double bp[TILE2], bq[TILE2];
    __m256d T[9];
    for (auto& x : T) x = _mm256_setzero_pd();
    ts = TailSums{};
    int64_t vv = v / 4 * 4;
    for (int64_t t0 = 0; t0 < vv; t0 += TILE2) {
        int64_t t1 = std::min(vv, t0 + TILE2);
        if (tail_tiles && tail_tiles[t0 / TILE2]) {
            bool fused = tail_tiles[t0 / TILE2] == TAIL_NOFLUSH ? pass2_tail_fused<dtype, false>(zp, zq, t0, t1, mp, mq, r0, T, ts)
                                                                : pass2_tail_fused<dtype, true>(zp, zq, t0, t1, mp, mq, r0, T, ts);
            if (!fused)
                pass2_tile<dtype, true>(zp, zq, t0, t1, mp, mq, r0, bp, bq, T, ts);
        }
        else
            pass2_tile<dtype, false>(zp, zq, t0, t1, mp, mq, r0, bp, bq, T, ts);
    }
    Sums t{0, 0, 0, 0, 0, 0, 0, 0, 0};
    pass2_scalar(zp, zq, vv, v, dtype, mp, mq, r0, t);
    out.sp = hsum(T[0]) + t.sp; out.ap = hsum(T[1]) + t.ap; out.sq = hsum(T[2]) + t.sq;
    out.aq = hsum(T[3]) + t.aq; out.dp = hsum(T[4]) + t.dp; out.dq = hsum(T[5]) + t.dq;
    out.g0 = hsum(T[6]) + t.g0; out.h = hsum(T[7]) + t.h; out.sd = hsum(T[8]) + t.sd;
}

// The same 256-bit code, twice. The fused tail loop keeps ~9 accumulators, the exp and ln
// cosh constants and its temporaries live: more than AVX2's 16 ymm registers, so the AVX2
// build keeps accumulators on the stack, and each iteration waits on a store-to-load
// round trip of its loop-carried sums (perf: the hottest instructions were those spills).
// Where the CPU has AVX-512VL, the EVEX build has 32 ymm registers and no spills; the
// arithmetic (the same intrinsics, no reassociation: no -ffast-math) is identical, so the
// two builds give bit-identical sums (tests/test_kernel.py checks it). Zen 4 runs these
// 256-bit EVEX instructions at full rate, and Intel parts without the 512-bit frequency
// penalty; no zmm register is used.
template <int dtype>
__attribute__((target("avx2,fma,f16c"), flatten)) void pass2_avx2(const void* zp, const void* zq, int64_t v, double mp,
                                                                   double mq, double r0, const uint8_t* tail_tiles,
                                                                   Sums& out, TailSums& ts) {
    pass2_body<dtype>(zp, zq, v, mp, mq, r0, tail_tiles, out, ts);
}

template <int dtype>
__attribute__((target("avx2,fma,f16c,avx512f,avx512vl"), flatten)) void pass2_evex(const void* zp, const void* zq,
                                                                                   int64_t v, double mp, double mq,
                                                                                   double r0, const uint8_t* tail_tiles,
                                                                                   Sums& out, TailSums& ts) {
    pass2_body<dtype>(zp, zq, v, mp, mq, r0, tail_tiles, out, ts);
}

// The dtype as a template parameter keeps the inner loops free of branches.
__attribute__((target("avx2,fma,f16c"))) Side1 pass1_simd(const void* z, int64_t v, int dtype, TopK& top, TileEst* est) {
    return dtype == F32 ? pass1_avx2<F32>(z, v, top, est) : dtype == BF16 ? pass1_avx2<BF16>(z, v, top, est) : pass1_avx2<F16>(z, v, top, est);
}

void pass2_simd(const void* zp, const void* zq, int64_t v, int dtype, double mp, double mq, double r0,
                const uint8_t* tail_tiles, Sums& out, TailSums& ts, bool evex) {
    if (evex) {
        if (dtype == F32) pass2_evex<F32>(zp, zq, v, mp, mq, r0, tail_tiles, out, ts);
        else if (dtype == BF16) pass2_evex<BF16>(zp, zq, v, mp, mq, r0, tail_tiles, out, ts);
        else pass2_evex<F16>(zp, zq, v, mp, mq, r0, tail_tiles, out, ts);
    } else {
        if (dtype == F32) pass2_avx2<F32>(zp, zq, v, mp, mq, r0, tail_tiles, out, ts);
        else if (dtype == BF16) pass2_avx2<BF16>(zp, zq, v, mp, mq, r0, tail_tiles, out, ts);
        else pass2_avx2<F16>(zp, zq, v, mp, mq, r0, tail_tiles, out, ts);
    }
}

#pragma GCC pop_options
#endif

bool have_avx2() {
#if LD_X86
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
    return false;
#endif
}

bool have_evex() {  // AVX-512F + VL: the 32-register build of pass 2
#if LD_X86
    return have_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl");
#else
    return false;
#endif
}

// Blocked pass 2 for the portable path too (same summation structure as the SIMD one).
void pass2_portable(const void* zp, const void* zq, int64_t v, int dtype, double mp, double mq, double r0, Sums& out) {
    out = Sums{0, 0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t t0 = 0; t0 < v; t0 += TILE2 / 4) {
        Sums t{0, 0, 0, 0, 0, 0, 0, 0, 0};
        pass2_scalar(zp, zq, t0, std::min(v, t0 + TILE2 / 4), dtype, mp, mq, r0, t);
        out.sp += t.sp; out.ap += t.ap; out.sq += t.sq; out.aq += t.aq; out.dp += t.dp;
        out.dq += t.dq; out.g0 += t.g0; out.h += t.h; out.sd += t.sd;
    }
}

// Per-thread scratch of `pair_row`.
struct Scratch {
    TopK tp, tq;
    std::vector<TileEst> est_p, est_q;
    std::vector<uint8_t> tail_tiles;
};

// Tail tiles: error analysis.
//
// A tail tile takes exp_tail_pd (relative error eps = EPS_TAIL_EXP instead of 4 ulp) and,
// when all its |delta| <= TAIL_DELTA_MAX, ln g = ln2 + (a_p + a_q + ln r0)/2 + ln cosh(delta/2)
// (absolute error eta = ETA_TAIL_LOG) instead of log_pd. With W_p = E_p/s_p, W_q = E_q/s_q
// the tail tiles' shares of the mass (E = sum of their e), B = -sum e a / s over them,
// dmax >= |d| there, Gabs = sum g |ln g| and Gsum = sum g over them, first-order bounds of
// each field's extra error (every sum is perturbed by at most eps times the sum of its
// tail terms' magnitudes; the ln g error eta enters G and H only):
//   entropy_p: eps (W_p (1 + |A_p/s_p|) + B_p), entropy_q alike;
//   c = ln(s_p/s_q) = log1p(x), x = S_d/s_q: dx = eps (r W_p + W_q (1 + |x|)),
//     dc = 2 dx + eps (W_p + W_q) (log1p's condition <= 2 for |x| <= 1/2; else ln s_p - ln s_q);
//   kl: eps W_p (dmax + |D_p/s_p|) + dc; kl_rev: eps W_q (dmax + |D_q/s_q|) + dc;
//   G = G0 + (r - r0)(H + s_q): dG0 = eps (Gabs + Gsum) + eta Gsum,
//     dH <= (eps Gabs + eta Gsum)/r0 (e_q <= g/r0), dr/r <= eps (W_p + W_q),
//     dG = dG0 + |r - r0| (dH + eps E_q) + r eps (W_p + W_q) |H + s_q|;
//   jsd: (dent_p + dent_q)/2 + (dG/s_p + |G/s_p| eps W_p)/2 + eps W_p;
//   top-K log-probs, nll, p and delta_p of the token, margin: <= eps (W_p + W_q).
// The row keeps its tail tiles only when every bound is <= TAIL_BUDGET (1/8 of the
// contract's atol, so also of every field's tolerance atol + rtol |x|); otherwise pass 2
// is redone without them (FLAG_TAIL_REDONE). Second-order terms (eps^2 W) are < 1e-27.
// The tiles are chosen beforehand from pass 1's per-tile estimates (a guess: predicted
// eps * mass * (|a| + 3) per tile within TAIL_BUDGET/4 of the row, pro rata); only the
// bound above, computed from the exact sums, decides.
double tail_bound(const Sums& s, const TailSums& ts, double r0, double g) {
    const double eps = EPS_TAIL_EXP, eta = ETA_TAIL_LOG;
    double r = s.sp / s.sq, wp = ts.ep / s.sp, wq = ts.eq / s.sq, bp = -ts.acp / s.sp, bq = -ts.acq / s.sq;
    double dmax = ts.dmax + std::fabs(std::log(r0));
    double ent_p = eps * (wp * (1 + std::fabs(s.ap / s.sp)) + bp), ent_q = eps * (wq * (1 + std::fabs(s.aq / s.sq)) + bq);
    double x = s.sd / s.sq, dx = eps * (r * wp + wq * (1 + std::fabs(x))), dc = 2 * dx + eps * (wp + wq);
    double kl = eps * wp * (dmax + std::fabs(s.dp / s.sp)) + dc, kl_rev = eps * wq * (dmax + std::fabs(s.dq / s.sq)) + dc;
    double dg0 = eps * (ts.gabs + ts.gsum) + eta * ts.gsum, dh = (eps * ts.gabs + eta * ts.gsum) / r0;
    double dg = dg0 + std::fabs(r - r0) * (dh + eps * ts.eq) + r * eps * (wp + wq) * std::fabs(s.h + s.sq);
    double jsd = 0.5 * (ent_p + ent_q) + 0.5 * (dg / s.sp + std::fabs(g / s.sp) * eps * wp) + eps * wp;
    double tok = eps * (wp + wq);
    double worst = std::max({ent_p, ent_q, kl, kl_rev, jsd, tok});
    return worst == worst ? worst : std::numeric_limits<double>::infinity();
}

// Marks the tiles pass 2 may take as tail tiles (see `tail_bound`): full TILE2 tiles whose
// predicted share of the error budget is small on both sides (TAIL, or TAIL_NOFLUSH when
// no value of the tile can underflow). Returns how many.
int64_t choose_tail_tiles(const Scratch& w, int64_t v, const Side1& p, const Side1& q, uint8_t* out) {
    int64_t nt = v / 8 * 8 / TILE2, count = 0;  // full tiles inside both passes' SIMD ranges
    double cap = TAIL_BUDGET / 4 * (double)TILE2 / (double)v / EPS_TAIL_EXP;
    for (int64_t t = 0; t < (v + TILE2 - 1) / TILE2; ++t) {
        bool ok = t < nt;
        for (int side = 0; ok && side < 2; ++side) {
            const TileEst& e = (side ? w.est_q : w.est_p)[t];
            const Side1& s1 = side ? q : p;
            double depth = (double)s1.m - (double)e.tmax;  // >= 0: |a| of the tile's top
            double mass = e.sum * std::exp((double)e.m_ref - (double)s1.m);
            ok = mass * (depth + 3.0) <= cap * s1.s_est;
        }
        // both sides' smallest a >= FLUSH + 1 (a margin for the rounding of z - m): no underflow test
        bool noflush = ok && (double)w.est_p[t].tmin - (double)p.m >= FLUSH + 1 && (double)w.est_q[t].tmin - (double)q.m >= FLUSH + 1;
        out[t] = ok ? (noflush ? TAIL_NOFLUSH : TAIL) : 0;
        count += ok;
    }
    return count;
}

// simd: 0 portable, 1 AVX2, 2 AVX2 code in the EVEX (32-register) build for pass 2.
void pair_row(const Args& a, int64_t row, int simd, Scratch& w) {
    [[maybe_unused]] bool avx2 = simd > 0;  // (no SIMD path off x86)
    TopK &tp = w.tp, &tq = w.tq;
    size_t es = a.dtype == F32 ? 4 : 2;
    const void* zp = static_cast<const char*>(a.zp) + (size_t)(row * a.stride_p) * es;
    const void* zq = static_cast<const char*>(a.zq) + (size_t)(row * a.stride_q) * es;
    double* sums = a.sums + row * 8;
    tp.reset(a.kk);
    tq.reset(a.kk);
    Side1 p, q;
#if LD_X86
    if (avx2) {
        int64_t ntiles = (a.vocab + TILE1 - 1) / TILE1;
        w.est_p.resize(ntiles);
        w.est_q.resize(ntiles);
        w.tail_tiles.resize(ntiles);
        p = pass1_simd(zp, a.vocab, a.dtype, tp, w.est_p.data());
        q = p.bad ? Side1{NAN, NAN, true} : pass1_simd(zq, a.vocab, a.dtype, tq, w.est_q.data());
    } else
#endif
    {
        p = pass1_scalar(zp, a.vocab, a.dtype, tp);
        q = p.bad ? Side1{NAN, NAN, true} : pass1_scalar(zq, a.vocab, a.dtype, tq);
    }
    a.flags[row] = 0;
    if (p.bad || q.bad) {
        a.flags[row] = FLAG_BAD;
        for (int j = 0; j < 8; ++j) sums[j] = NAN;
        a.maxes[row * 2] = a.maxes[row * 2 + 1] = NAN;
        for (int64_t j = 0; j < 2 * a.kk; ++j) {  // defined output for callers that skip the check
            a.top_ids[row * 2 * a.kk + j] = 0;
            a.top_vals[row * 2 * a.kk + j] = NAN;
        }
        return;
    }
    a.maxes[row * 2] = p.m;
    a.maxes[row * 2 + 1] = q.m;
    tp.write(a.top_ids + row * 2 * a.kk, a.top_vals + row * 2 * a.kk);
    tq.write(a.top_ids + (row * 2 + 1) * a.kk, a.top_vals + (row * 2 + 1) * a.kk);
    double r0 = p.s_est / q.s_est;
    Sums s;
    TailSums ts;
    const uint8_t* tail = nullptr;
#if LD_X86
    if (avx2 && choose_tail_tiles(w, a.vocab, p, q, w.tail_tiles.data()) > 0) tail = w.tail_tiles.data();
    auto pass2 = [&](double rr, const uint8_t* tt, Sums& out, TailSums& tso) {
        if (avx2) pass2_simd(zp, zq, a.vocab, a.dtype, p.m, q.m, rr, tt, out, tso, simd == 2);
        else pass2_portable(zp, zq, a.vocab, a.dtype, p.m, q.m, rr, out);
    };
#else
    auto pass2 = [&](double rr, const uint8_t*, Sums& out, TailSums&) {
        pass2_portable(zp, zq, a.vocab, a.dtype, p.m, q.m, rr, out);
    };
#endif
    double g = 0, r = 0;
    for (;;) {
        pass2(r0, tail, s, ts);
        r = s.sp / s.sq;
        g = s.g0 + (r - r0) * (s.h + s.sq);  // G(r0) + (r - r0) G'(r0)
        if (!tail || ts.tiles == 0) break;
        if (tail_bound(s, ts, r0, g) <= TAIL_BUDGET) {
            a.flags[row] |= FLAG_TAIL;
            break;
        }
        tail = nullptr;  // the bound failed: every tile exact
        a.flags[row] |= FLAG_TAIL_REDONE;
    }
    double bound = s.sq * (r - r0) * (r - r0) / (2.0 * std::min(r, r0));
    if (!(bound <= R_TOL * s.sp)) {  // also when not finite
        Sums s3;
        TailSums ts3;
        pass2(r, nullptr, s3, ts3);  // G only; exact tiles (its tail errors are in the bound above)
        g = s3.g0;
        a.flags[row] |= FLAG_PASS3;
    }
    double vals[8] = {s.sp, s.ap, s.sq, s.aq, s.dp, s.dq, g, s.sd};
    std::memcpy(sums, vals, sizeof vals);
}


// First of n rows (row stride `stride` elements) holding a NaN or an infinity, or -1: a
// capture's check of every row it stores, one read of each row, no temporaries. A value
// is non-finite when its exponent bits are all ones, i.e. when its bits shifted left by
// one (dropping the sign) are at least the exponent mask so shifted; the per-row maximum
// of those is an unsigned max that -O3 vectorises (an AVX2 build of the same loop is
// chosen at run time).
template <typename U, U LIMIT>
inline int64_t first_nonfinite_rows(const U* z, int64_t n, int64_t vocab, int64_t stride) {
    for (int64_t r = 0; r < n; ++r) {
        const U* x = z + r * stride;
        U m = 0;
        for (int64_t i = 0; i < vocab; ++i) {
            U v = (U)(x[i] << 1);
            m = v > m ? v : m;
        }
        if (m >= LIMIT) return r;
    }
    return -1;
}

int64_t first_nonfinite(const void* z, int64_t n, int64_t vocab, int64_t stride, int dtype) {
    if (dtype == F32) return first_nonfinite_rows<uint32_t, 0xFF000000u>(static_cast<const uint32_t*>(z), n, vocab, stride);
    if (dtype == BF16) return first_nonfinite_rows<uint16_t, 0xFF00>(static_cast<const uint16_t*>(z), n, vocab, stride);
    return first_nonfinite_rows<uint16_t, 0xF800>(static_cast<const uint16_t*>(z), n, vocab, stride);
}

#if LD_X86
__attribute__((target("avx2"), flatten)) int64_t first_nonfinite_avx2(const void* z, int64_t n, int64_t vocab,
                                                                      int64_t stride, int dtype) {
    return first_nonfinite(z, n, vocab, stride, dtype);
}
#endif

}  // namespace

extern "C" {

// Returns 0 on success, 1 for bad arguments. `isa`: ISA_AUTO (the EVEX build of pass 2
// where the CPU has AVX-512VL), ISA_SCALAR or ISA_AVX2 (the AVX2 build only); the SIMD
// ones fall back to scalar where the CPU lacks AVX2/FMA/F16C.
__attribute__((visibility("default"))) int logitdiff_pair_rows(
    const void* zp, const void* zq, int64_t n, int64_t vocab, int64_t stride_p, int64_t stride_q, int dtype, int kk,
    int threads, int isa, double* sums, double* maxes, int64_t* top_ids, double* top_vals, int32_t* flags) {
    if (n < 0 || vocab < 1 || kk < 1 || kk > vocab || dtype < F32 || dtype > F16 || threads < 1) return 1;
    Args a{zp, zq, n, vocab, stride_p, stride_q, dtype, kk, sums, maxes, top_ids, top_vals, flags};
    int simd = isa == ISA_SCALAR || !have_avx2() ? 0 : isa != ISA_AVX2 && have_evex() ? 2 : 1;
    std::atomic<int64_t> next{0};
    auto work = [&]() {
        Scratch w;
        for (int64_t row; (row = next.fetch_add(1)) < n;) pair_row(a, row, simd, w);
    };
    int nt = (int)std::min<int64_t>(threads, std::max<int64_t>(n, 1));
    std::vector<std::thread> pool;
    for (int t = 1; t < nt; ++t) pool.emplace_back(work);
    work();
    for (auto& t : pool) t.join();
    return 0;
}

__attribute__((visibility("default"))) int logitdiff_has_avx2(void) { return have_avx2() ? 1 : 0; }

__attribute__((visibility("default"))) int logitdiff_has_evex(void) { return have_evex() ? 1 : 0; }

__attribute__((visibility("default"))) int64_t logitdiff_first_nonfinite(const void* z, int64_t n, int64_t vocab,
                                                                         int64_t stride, int dtype) {
    if (n < 0 || vocab < 0 || dtype < F32 || dtype > F16) return -2;
#if LD_X86
    if (have_avx2()) return first_nonfinite_avx2(z, n, vocab, stride, dtype);
#endif
    return first_nonfinite(z, n, vocab, stride, dtype);
}

}  // extern "C"

// ======================================================================================
// Hidden-state store decode (hidden.py `decode`, issue 28): a bf16/f16 reference's logits
// z_v = R(W_v . h) from the output head W [V, H] and the hidden states h [n, H] (16-bit
// bits), bit for bit. Appended section; nothing above depends on it.
//
// Each dot is first taken in float32 (a product of two bf16 or two f16 values is exact in
// float32's 24-bit significand, and the FMA rounds only the sum): 8 lanes; per lane,
// chains of at most HD_KB sequential FMAs from zero, added into the lane's total; then a
// fixed 3-level tree over the lanes. Every term passes through at most
// k = HD_KB + ceil(H / (8 HD_KB)) + 3 roundings, so |s32 - s| <= gamma_k sum_j |W_vj h_j|
// + N 2^-150 (underflow: at most 2^-150 per operation with a subnormal result, N ~ H + H/8
// operations in all, so < 2^-120 for H < 2^29) <= gamma_k ||W_v|| ||h|| + 2^-120 =: e_v
// (Higham 3.1, Cauchy-Schwarz). Overflow anywhere leaves s32 inf/NaN: the float64 path.
// Where R is constant on [s32 - e_v, s32 + e_v] (and the interval is inside the format's
// normal range) that value is R(s), the bf16 value of the exact sum, which is the
// model's value unless the entry is a stored exception (docs/bounds.md section 6). The
// other entries (a few per cent: those within e_v of a rounding boundary) take the
// float64 sum, the reference reconstruction itself. So the output is exactly what the
// float64 decode gives, at float32 speed. Where the CPU has AVX-512 BF16, bf16 heads take
// the VDPBF16PS path below instead (same contract, its own bound: see "AVX-512 BF16 decode").
// ======================================================================================
#if LD_X86
#include <cpuid.h>
#endif
namespace {

constexpr int HD_ISA_AVX512BF16 = 3;  // kernel.HIDDEN_ISA_CODES["avx512bf16"]

// IEEE underflow for the scope of a decode, whatever the caller's MXCSR: with DAZ set (e.g.
// torch.set_flush_denormal(True), or a library built with -ffast-math loaded in the process)
// a bf16 denormal read as float32, or converted to double, is zero, and FTZ flushes products
// below 2^-126: errors the bound above (2^-150 per operation) does not cover, and the float64
// path's conversions would drop the same values. Restored on exit. Set in the calling thread
// and in each worker (a thread's MXCSR is its own).
struct HdIeeeUnderflow {
#if LD_X86
    unsigned saved = _mm_getcsr();
    HdIeeeUnderflow() { _mm_setcsr(saved & ~0x8040u); }  // clear FTZ (bit 15) and DAZ (bit 6)
    ~HdIeeeUnderflow() { _mm_setcsr(saved); }
#endif
};

// hidden.round_bits for one value: float64 -> 16-bit bits, nearest, ties to even, one
// rounding (fmt BF16 or F16). For normal, finite results (others are stored exceptions).
inline uint16_t hd_round(double s, int fmt) {
    const int drop = fmt == F16 ? 42 : 45;
    uint64_t b;
    std::memcpy(&b, &s, 8);
    uint64_t lsb = (b >> drop) & 1u;
    uint64_t r = (b + ((uint64_t(1) << (drop - 1)) - 1) + lsb) & ~((uint64_t(1) << drop) - 1);
    double d;
    std::memcpy(&d, &r, 8);
    float f = (float)d;  // exact for a normal result
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if (fmt != F16) return (uint16_t)(u >> 16);
    // float -> half: exact for a normal half; subnormals rounded to nearest even, overflow
    // to inf, as numpy converts (only stored exceptions reach those)
    uint32_t sign = (u >> 16) & 0x8000u;
    int32_t e = (int32_t)((u >> 23) & 0xFF) - 127 + 15;
    if (e >= 31) return (uint16_t)(sign | 0x7C00u);
    if (e <= 0) return (uint16_t)(sign | (uint32_t)std::nearbyint(std::fabs(f) * 0x1p24));  // subnormal, as numpy rounds
    return (uint16_t)(sign | ((uint32_t)e << 10) | ((u >> 13) & 0x3FFu));
}

inline float hd_to_f32(uint16_t b, int fmt) {
    if (fmt == F16) return half_to_float(b);
    uint32_t u = (uint32_t)b << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

constexpr int64_t HD_TV = 64;  // head rows converted to float32 per tile (64 x H floats)
constexpr int64_t HD_KB = 8;   // FMA steps (of 8 lanes) per chain: bounds the roundings per term
constexpr int64_t HD_ROW_BLOCK_BYTES = 128 * 1024;  // hidden rows (float32) per pass over a tile: with the
                                                    // tile (HD_TV rows, 147 KB at H = 576) inside a 512 KB L2

inline double hd_roundings(int64_t Hp) { return (double)(HD_KB + (Hp / 8 + HD_KB - 1) / HD_KB + 3); }

struct HdArgs {
    const uint16_t* hidden;
    int64_t n;
    const uint16_t* head;
    int64_t V, H, Hp;  // Hp: H rounded up to 8 (zero padding)
    int fmt;
    const float* h32;   // [n, Hp]
    const double* h64;  // [n, H]
    const double* hn;   // gamma_k ||h|| per row (see hd_finish)
    uint16_t* out;      // [n, V]
    int64_t out_stride;
    int64_t out_v0 = 0;  // the column out's first entry stands for (a thread's tile scratch: its tile's first)
    float* out32 = nullptr;  // set: the AVX-512 BF16 finish writes float32 values here (row stride out_stride)
};

// The exact float64 dot (any order is within the writer's margin) and its rounding.
inline uint16_t hd_exact(const HdArgs& a, const float* w, int64_t r) {
    const double* h = a.h64 + r * a.H;
    double s = 0.0;
    for (int64_t j = 0; j < a.H; ++j) s += (double)w[j] * h[j];
    return hd_round(s, a.fmt);
}

// s32 (the float32 dot of the documented structure) -> the output bits, or the exact path.
template <typename Exact>
inline uint16_t hd_finish(const HdArgs& a, double wn, int64_t r, float s32, int64_t& nfb, Exact exact) {
    const double tiny = a.fmt == F16 ? 0x1p-14 : 0x1p-126;
    const double big = a.fmt == F16 ? 65504.0 : 3.3895313892515355e38;
    double s = (double)s32;
    // gamma_k ||W|| ||h|| (hn holds gamma_k ||h||), the underflow term (<= 2^-120, see above), and room for the
    // rounding of s -+ e below (2^-50 |s|)
    double e = wn * a.hn[r] + 0x1p-120 + 0x1p-50 * std::fabs(s);
    double lo = std::fabs(s) - e, hi = std::fabs(s) + e;
    if (lo >= tiny && hi < big) {  // also false for NaN
        // R on both ends by hd_round's integer rule, kept as (exponent, significand) bits
        const int drop = a.fmt == F16 ? 42 : 45;
        uint64_t bl, bh;
        std::memcpy(&bl, &lo, 8);
        std::memcpy(&bh, &hi, 8);
        const uint64_t half = (uint64_t(1) << (drop - 1)) - 1;
        uint64_t tl = (bl + half + ((bl >> drop) & 1u)) >> drop, th = (bh + half + ((bh >> drop) & 1u)) >> drop;
        if (tl == th) {  // positive, normal: exponent and significand of the 16-bit value
            const int sig = a.fmt == F16 ? 10 : 7, bias = a.fmt == F16 ? 15 : 127;
            uint64_t ex = (tl >> sig) - 1023 + bias, mant = tl & ((uint64_t(1) << sig) - 1);
            return (uint16_t)((s < 0 ? 0x8000u : 0u) | (ex << sig) | mant);
        }
    }
    ++nfb;
    return exact();
}

#if LD_X86
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
__attribute__((target("avx2,fma,f16c"))) inline float hd_hsum(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_shuffle_ps(x, x, 1));
    return _mm_cvtss_f32(x);
}

// VB head rows x RB hidden rows of float32 dots: 8 lanes of sequential FMAs, then hd_hsum.
// The chains' accumulators (VB x RB) stay in registers; the totals they are added into once
// a chain (every HD_KB steps) live in ``tot`` (caller memory, 8 VB RB floats, in L1): with
// both in registers the 4 x 3 block needed 28 of AVX2's 16 and the compiler spilled inside
// the FMA loop. Same operations in the same order: the same bits.
template <int VB, int RB>
__attribute__((target("avx2,fma,f16c"))) inline void hd_block(const float* w, int64_t ws, const float* h, int64_t hs,
                                                              int64_t Hp, float* s, float* tot) {
    for (int i = 0; i < VB * RB; ++i) _mm256_storeu_ps(tot + 8 * i, _mm256_setzero_ps());
    for (int64_t k0 = 0; k0 < Hp; k0 += 8 * HD_KB) {
        const int64_t k1 = std::min(Hp, k0 + 8 * HD_KB);
        __m256 acc[VB][RB];
        for (int i = 0; i < VB; ++i)
            for (int j = 0; j < RB; ++j) acc[i][j] = _mm256_setzero_ps();
        for (int64_t k = k0; k < k1; k += 8) {
            __m256 hv[RB];
            for (int j = 0; j < RB; ++j) hv[j] = _mm256_loadu_ps(h + j * hs + k);
            for (int i = 0; i < VB; ++i) {
                __m256 wv = _mm256_loadu_ps(w + i * ws + k);
                for (int j = 0; j < RB; ++j) acc[i][j] = _mm256_fmadd_ps(wv, hv[j], acc[i][j]);
            }
        }
        for (int i = 0; i < VB; ++i)
            for (int j = 0; j < RB; ++j) {
                float* t = tot + 8 * (i * RB + j);
                _mm256_storeu_ps(t, _mm256_add_ps(_mm256_loadu_ps(t), acc[i][j]));
            }
    }
    for (int i = 0; i < VB; ++i)
        for (int j = 0; j < RB; ++j) s[i * RB + j] = hd_hsum(_mm256_loadu_ps(tot + 8 * (i * RB + j)));
}

// The float64 dot of the fallback, 4 lanes x 4 chains (any order is within the writer's
// margin). One chain was bound by the FMA's latency: ~4 % of entries take this path at
// H = 576, and it was a quarter of the decode's time.
__attribute__((target("avx2,fma,f16c"))) inline uint16_t hd_exact_avx2(const HdArgs& a, const float* w, int64_t r) {
    const double* h = a.h64 + r * a.H;
    __m256d acc0 = _mm256_setzero_pd(), acc1 = _mm256_setzero_pd(), acc2 = _mm256_setzero_pd(), acc3 = _mm256_setzero_pd();
    int64_t j = 0;
    for (; j + 16 <= a.H; j += 16) {
        acc0 = _mm256_fmadd_pd(_mm256_cvtps_pd(_mm_loadu_ps(w + j)), _mm256_loadu_pd(h + j), acc0);
        acc1 = _mm256_fmadd_pd(_mm256_cvtps_pd(_mm_loadu_ps(w + j + 4)), _mm256_loadu_pd(h + j + 4), acc1);
        acc2 = _mm256_fmadd_pd(_mm256_cvtps_pd(_mm_loadu_ps(w + j + 8)), _mm256_loadu_pd(h + j + 8), acc2);
        acc3 = _mm256_fmadd_pd(_mm256_cvtps_pd(_mm_loadu_ps(w + j + 12)), _mm256_loadu_pd(h + j + 12), acc3);
    }
    for (; j + 4 <= a.H; j += 4)
        acc0 = _mm256_fmadd_pd(_mm256_cvtps_pd(_mm_loadu_ps(w + j)), _mm256_loadu_pd(h + j), acc0);
    double s = hsum(_mm256_add_pd(_mm256_add_pd(acc0, acc1), _mm256_add_pd(acc2, acc3)));
    for (; j < a.H; ++j) s += (double)w[j] * h[j];
    return hd_round(s, a.fmt);
}

// hd_finish for 4 head rows (i) of one hidden row, 4-wide: the same bound, the same
// integer rounding of both ends; lanes where they differ (or leave the normal range) take
// the exact path.
__attribute__((target("avx2,fma,f16c"))) inline void hd_finish4(const HdArgs& a, const double* wn, int64_t r, __m128 s4,
                                                                const float* w, uint16_t* out, int64_t& nfb) {
    const bool f16 = a.fmt == F16;
    const int drop = f16 ? 42 : 45, sig = f16 ? 10 : 7, bias = f16 ? 15 : 127;
    __m256d s = _mm256_cvtps_pd(s4);
    __m256d as = _mm256_andnot_pd(_mm256_set1_pd(-0.0), s);
    __m256d e = _mm256_fmadd_pd(_mm256_loadu_pd(wn), _mm256_set1_pd(a.hn[r]),
                                _mm256_fmadd_pd(as, _mm256_set1_pd(0x1p-50), _mm256_set1_pd(0x1p-120)));
    // e as hd_finish computes it (wn * hn + 2^-120 + 2^-50 |s|), rounded up by one more
    // 2^-50 |s| for the fused order
    e = _mm256_fmadd_pd(as, _mm256_set1_pd(0x1p-50), e);
    __m256d lo = _mm256_sub_pd(as, e), hi = _mm256_add_pd(as, e);
    __m256d ok = _mm256_and_pd(_mm256_cmp_pd(lo, _mm256_set1_pd(f16 ? 0x1p-14 : 0x1p-126), _CMP_GE_OQ),
                               _mm256_cmp_pd(hi, _mm256_set1_pd(f16 ? 65504.0 : 3.3895313892515355e38), _CMP_LT_OQ));
    const __m256i one = _mm256_set1_epi64x(1), halfm = _mm256_set1_epi64x((int64_t(1) << (drop - 1)) - 1);
    __m256i bl = _mm256_castpd_si256(lo), bh = _mm256_castpd_si256(hi);
    __m256i tl = _mm256_srli_epi64(_mm256_add_epi64(_mm256_add_epi64(bl, halfm), _mm256_and_si256(_mm256_srli_epi64(bl, drop), one)), drop);
    __m256i th = _mm256_srli_epi64(_mm256_add_epi64(_mm256_add_epi64(bh, halfm), _mm256_and_si256(_mm256_srli_epi64(bh, drop), one)), drop);
    ok = _mm256_and_pd(ok, _mm256_castsi256_pd(_mm256_cmpeq_epi64(tl, th)));
    __m256i ex = _mm256_add_epi64(_mm256_srli_epi64(tl, sig), _mm256_set1_epi64x(bias - 1023));
    __m256i res = _mm256_or_si256(_mm256_slli_epi64(ex, sig), _mm256_and_si256(tl, _mm256_set1_epi64x((1 << sig) - 1)));
    alignas(32) int64_t rb[4];
    _mm256_store_si256((__m256i*)rb, res);
    const int good = _mm256_movemask_pd(ok);
    alignas(16) float sv[4];
    _mm_store_ps(sv, s4);
    for (int i = 0; i < 4; ++i) {
        if (good >> i & 1) {
            out[i] = (uint16_t)((sv[i] < 0 ? 0x8000u : 0u) | (uint32_t)rb[i]);
        } else {
            ++nfb;
            out[i] = hd_exact_avx2(a, w + i * a.Hp, r);
        }
    }
}

// Hidden rows [r0, r1) against VB head rows.
template <int VB>
__attribute__((target("avx2,fma,f16c"))) void hd_rows(const HdArgs& a, const float* w, const double* wn, int64_t v0,
                                                      int64_t r0, int64_t r1, int64_t& nfb) {
    float s[VB * 3];
    alignas(32) float tot[VB * 3 * 8];
    int64_t r = r0;
    for (; r + 3 <= r1; r += 3) {
        hd_block<VB, 3>(w, a.Hp, a.h32 + r * a.Hp, a.Hp, a.Hp, s, tot);
        if constexpr (VB == 4) {
            for (int j = 0; j < 3; ++j) {
                uint16_t o[4];
                hd_finish4(a, wn, r + j, _mm_setr_ps(s[0 * 3 + j], s[1 * 3 + j], s[2 * 3 + j], s[3 * 3 + j]), w, o, nfb);
                std::memcpy(a.out + (r + j) * a.out_stride + (v0 - a.out_v0), o, sizeof o);
            }
            continue;
        }
        for (int i = 0; i < VB; ++i)
            for (int j = 0; j < 3; ++j)
                a.out[(r + j) * a.out_stride + (v0 - a.out_v0) + i] =
                    hd_finish(a, wn[i], r + j, s[i * 3 + j], nfb, [&] { return hd_exact_avx2(a, w + i * a.Hp, r + j); });
    }
    for (; r < r1; ++r) {
        hd_block<VB, 1>(w, a.Hp, a.h32 + r * a.Hp, a.Hp, a.Hp, s, tot);
        for (int i = 0; i < VB; ++i)
            a.out[r * a.out_stride + (v0 - a.out_v0) + i] =
                hd_finish(a, wn[i], r, s[i], nfb, [&] { return hd_exact_avx2(a, w + i * a.Hp, r); });
    }
}
#pragma GCC pop_options
#endif

// rows x cols 16-bit bits (row stride cols) -> float32 values at dst (row stride ds): exact
// (bf16: the bits are float32's top half; f16: widened).
void hd_widen(const uint16_t* src, int64_t rows, int64_t cols, int fmt, float* dst, int64_t ds) {
    for (int64_t r = 0; r < rows; ++r) {
        const uint16_t* s = src + r * cols;
        float* d = dst + r * ds;
        if (fmt == F16) {
            for (int64_t j = 0; j < cols; ++j) d[j] = half_to_float(s[j]);
        } else {
            for (int64_t j = 0; j < cols; ++j) {  // float32 bits (vectorised by the compiler)
                const uint32_t u = (uint32_t)s[j] << 16;
                std::memcpy(d + j, &u, 4);
            }
        }
    }
}

// One tile of head rows [v0, v1): convert to float32 (exact) with their float64 norms,
// then every hidden row against them.
void hd_tile(const HdArgs& a, int64_t v0, int64_t v1, bool simd, std::vector<float>& w, std::vector<double>& wn,
             int64_t& nfb) {
    const int64_t tv = v1 - v0;
    w.assign((size_t)(tv * a.Hp), 0.0f);
    wn.assign((size_t)tv, 0.0);
    for (int64_t i = 0; i < tv; ++i) {
        const uint16_t* src = a.head + (v0 + i) * a.H;
        float* dst = w.data() + i * a.Hp;
        double nn = 0.0;
        for (int64_t j = 0; j < a.H; ++j) {
            float x = hd_to_f32(src[j], a.fmt);
            dst[j] = x;
            nn += (double)x * x;
        }
        wn[i] = std::sqrt(nn);
    }
#if LD_X86
    if (simd) {
        // Hidden rows in blocks that stay in L2 beside the tile (HD_TV x Hp floats): each group
        // of 4 head rows reads the block's rows again, so a block of all n rows (n Hp 4 bytes,
        // 493 KB at n = 214, H = 576) was streamed from L3 once per 4 vocabulary entries.
        // Each output is the same dot in the same order whatever the blocking: the same bits.
        const int64_t rb = std::max<int64_t>(3, std::min<int64_t>(a.n, HD_ROW_BLOCK_BYTES / (4 * a.Hp)) / 3 * 3);
        for (int64_t r0 = 0; r0 < a.n; r0 += rb) {
            const int64_t r1 = std::min(a.n, r0 + rb);
            int64_t i = 0;
            for (; i + 4 <= tv; i += 4) hd_rows<4>(a, w.data() + i * a.Hp, wn.data() + i, v0 + i, r0, r1, nfb);
            for (; i < tv; ++i) hd_rows<1>(a, w.data() + i * a.Hp, wn.data() + i, v0 + i, r0, r1, nfb);
        }
        return;
    }
#endif
    (void)simd;
    for (int64_t i = 0; i < tv; ++i)
        for (int64_t r = 0; r < a.n; ++r) a.out[r * a.out_stride + (v0 - a.out_v0) + i] = hd_exact(a, w.data() + i * a.Hp, r);
}


// --------------------------------------------------------------------------------------
// AVX-512 BF16 decode (isa "avx512bf16", BF16 heads only; the default where the CPU has it).
// Same contract as above: R(s) where a proven bound on the float32 dot decides it, the
// float64 dot elsewhere. The head tile is repacked so 16 vocabulary entries sit in the
// lanes ([H2 = ceil(H/2)][32 entries][2 bf16]), and VDPBF16PS takes a hidden row's bf16
// pair broadcast against it: no horizontal sums. Per output, chains of at most HB_KB
// instructions from zero, each added into a running total whose magnitude after each
// addition is summed too (a running error bound, Higham 3.1), so (docs/bounds.md section 6):
//   * VDPBF16PS rounds (nearest even) after each of its two products per lane, or once:
//     a chain's first instruction adds its first product to zero (exact), so a term passes
//     through at most 2 HB_KB - 1 roundings in its chain; products of bf16 are exact in
//     float32 unless |p| < 2^-126 (flushed: FTZ) or they overflow (inf: the float64 path);
//   * each addition into the total errs by at most u |its result|;
//   so |s32 - s| <= gamma_(2 HB_KB - 1) ||W_v|| ||h|| + u sum_i |t_i| + N 2^-126, t_i the
//     totals, N = 5 H2 + 2 bounding the flushed products and results (each off by < 2^-126);
//   * denormal inputs are read as zero (DAZ): a tile or a call with bf16 denormals takes
//     the AVX2 path instead.
// The finish runs 16 lanes in float32/int32 with the bound rounded up (hb_finish).
// --------------------------------------------------------------------------------------
constexpr int HB_RB = 4;        // hidden rows per register block (x 2 vectors of 16 entries: 8 accumulators,
                                // 8 totals, 8 error sums)
constexpr int64_t HB_KB = 3;    // VDPBF16PS steps per chain (error 2 HB_KB - 1 roundings; shorter: more additions)
constexpr int64_t HB_TILE_BYTES = 256 * 1024;  // repacked tile: fits L2 (Zen4, Ice Lake+: >= 1 MB)

inline double hb_roundings() { return (double)(2 * HB_KB - 1); }

// CPUID: AVX512F, BW, VL and BF16, with the OS saving opmask and zmm state (XCR0 bits 1, 2, 5, 6, 7).
bool have_avx512bf16() {
#if LD_X86
    static const bool ok = [] {
        unsigned a, b, c, d;
        if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return false;  // OSXSAVE
        unsigned lo, hi;
        __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
        if ((lo & 0xE6u) != 0xE6u) return false;
        if (__get_cpuid_max(0, nullptr) < 7) return false;
        __cpuid_count(7, 0, a, b, c, d);
        const unsigned need = (1u << 16) | (1u << 30) | (1u << 31);  // avx512f, avx512bw, avx512vl
        if ((b & need) != need) return false;
        __cpuid_count(7, 1, a, b, c, d);
        return (a & (1u << 5)) != 0;  // avx512_bf16
    }();
    return ok;
#else
    return false;
#endif
}

struct HbArgs {
    const uint32_t* hp;  // [n_pad, H2] hidden rows as bf16 pairs (zero rows past n)
    int64_t H2;
    const float* hn32;   // per row: gamma_k ||h|| rounded up (hb_finish)
    float abs32;         // N 2^-126 (N = 5 H2 + 2) times 1 + 2^-16
    float run32;         // u (1 + 2 gamma_chains) (1 + 2^-16): sum_i |t_i| <= its float32 sum (1 + 2 gamma_chains)
};

// A bf16 denormal among count values: exponent 0, significand not 0.
inline bool hb_has_denormal(const uint16_t* x, int64_t count) {
    uint16_t any = 0;
    for (int64_t i = 0; i < count; ++i) any |= (uint16_t)(((x[i] & 0x7F80u) == 0) & ((x[i] & 0x7Fu) != 0));
    return any != 0;
}

#if LD_X86
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")
#define HB_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")))

// One chain of C steps (C <= HB_KB) from the accumulators' current values.
template <int C>
HB_TARGET inline void hb_chain(const uint32_t* w, const uint32_t* h, int64_t H2, int64_t k, __m512 (&acc)[2][HB_RB]) {
    for (int c = 0; c < C; ++c) {
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + (k + c) * 32);
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + (k + c) * 32 + 16);
        for (int j = 0; j < HB_RB; ++j) {
            const __m512bh hb = (__m512bh)_mm512_set1_epi32((int)h[j * H2 + k + c]);
            acc[0][j] = _mm512_dpbf16_ps(acc[0][j], w0, hb);
            acc[1][j] = _mm512_dpbf16_ps(acc[1][j], w1, hb);
        }
    }
}

HB_TARGET inline void hb_chain_n(const uint32_t* w, const uint32_t* h, int64_t H2, int64_t k, int64_t c,
                                 __m512 (&acc)[2][HB_RB]) {
    static_assert(HB_KB <= 4, "hb_chain_n unrolls chains of up to 4 steps");
    switch (c) {
        case 4: hb_chain<4>(w, h, H2, k, acc); break;
        case 3: hb_chain<3>(w, h, H2, k, acc); break;
        case 2: hb_chain<2>(w, h, H2, k, acc); break;
        default: hb_chain<1>(w, h, H2, k, acc); break;
    }
}

// 32 entries (w: [H2][32] pairs) x HB_RB hidden rows (h: [HB_RB][H2] pairs): the float32
// dots of the documented structure into out[0 .. 2 HB_RB) and the sums of |total| after
// each addition into out[2 HB_RB .. 4 HB_RB) (vectors of 16, [half][row]).
HB_TARGET __attribute__((noinline)) void hb_block(const uint32_t* w, const uint32_t* h, int64_t H2, float* out) {
    __m512 tot[2][HB_RB], err[2][HB_RB], acc[2][HB_RB];
    for (int i = 0; i < 2; ++i)
        for (int j = 0; j < HB_RB; ++j) tot[i][j] = err[i][j] = _mm512_setzero_ps();
    hb_chain_n(w, h, H2, 0, std::min(HB_KB, H2), tot);  // the first chain straight into the total
    int64_t k = HB_KB;
    for (; k + HB_KB <= H2; k += HB_KB) {
        for (int i = 0; i < 2; ++i)
            for (int j = 0; j < HB_RB; ++j) acc[i][j] = _mm512_setzero_ps();
        hb_chain<HB_KB>(w, h, H2, k, acc);
        for (int i = 0; i < 2; ++i)
            for (int j = 0; j < HB_RB; ++j) {
                tot[i][j] = _mm512_add_ps(tot[i][j], acc[i][j]);
                err[i][j] = _mm512_add_ps(err[i][j], _mm512_abs_ps(tot[i][j]));
            }
    }
    if (k < H2) {
        for (int i = 0; i < 2; ++i)
            for (int j = 0; j < HB_RB; ++j) acc[i][j] = _mm512_setzero_ps();
        hb_chain_n(w, h, H2, k, H2 - k, acc);
        for (int i = 0; i < 2; ++i)
            for (int j = 0; j < HB_RB; ++j) {
                tot[i][j] = _mm512_add_ps(tot[i][j], acc[i][j]);
                err[i][j] = _mm512_add_ps(err[i][j], _mm512_abs_ps(tot[i][j]));
            }
    }
    for (int i = 0; i < 2; ++i)
        for (int j = 0; j < HB_RB; ++j) {
            _mm512_storeu_ps(out + (i * HB_RB + j) * 16, tot[i][j]);
            _mm512_storeu_ps(out + ((2 + i) * HB_RB + j) * 16, err[i][j]);
        }
}

// The float64 dot of the fallback, from the bf16 head row (in L2: the tile was just read
// from it) and the hidden row as float64 (HdArgs::h64, converted once per call, not once
// per fallback entry: ~2 % of entries take this path, which cost ~15 % of the decode when
// both sides were converted here), 8 lanes x 2 (any order is within the writer's margin).
HB_TARGET inline __m512d hb_f64(const uint16_t* x) {  // 8 bf16 -> 8 float64 (exact)
    return _mm512_cvtps_pd(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)x)), 16)));
}

HB_TARGET __attribute__((noinline)) uint16_t hb_exact(const uint16_t* w, const double* h, int64_t H) {
    __m512d acc0 = _mm512_setzero_pd(), acc1 = _mm512_setzero_pd(), acc2 = _mm512_setzero_pd(), acc3 = _mm512_setzero_pd();
    int64_t j = 0;
    for (; j + 32 <= H; j += 32) {  // four chains: the FMA latency, not the conversions, bound two
        acc0 = _mm512_fmadd_pd(hb_f64(w + j), _mm512_loadu_pd(h + j), acc0);
        acc1 = _mm512_fmadd_pd(hb_f64(w + j + 8), _mm512_loadu_pd(h + j + 8), acc1);
        acc2 = _mm512_fmadd_pd(hb_f64(w + j + 16), _mm512_loadu_pd(h + j + 16), acc2);
        acc3 = _mm512_fmadd_pd(hb_f64(w + j + 24), _mm512_loadu_pd(h + j + 24), acc3);
    }
    acc0 = _mm512_add_pd(acc0, acc2);
    acc1 = _mm512_add_pd(acc1, acc3);
    for (; j + 16 <= H; j += 16) {
        acc0 = _mm512_fmadd_pd(hb_f64(w + j), _mm512_loadu_pd(h + j), acc0);
        acc1 = _mm512_fmadd_pd(hb_f64(w + j + 8), _mm512_loadu_pd(h + j + 8), acc1);
    }
    double s = _mm512_reduce_add_pd(_mm512_add_pd(acc0, acc1));
    for (; j < H; ++j) s += (double)hd_to_f32(w[j], BF16) * h[j];
    return hd_round(s, BF16);
}

// 16 lanes of one hidden row: the bound e of the header, rounded up in float32 (see
// docs/bounds.md section 6): e32 >= e (1 + 3u) from hn32, wn32 and abs32 (each carries a
// factor 1 + 2^-16); e' = e32 + 4u|s| so that the rounded |s| - e' and |s| + e' still
// enclose [|s| - e, |s| + e]. Where R is the same on both ends, inside the normal range,
// that is R(s); other lanes (and non-finite s) take hb_exact.
HB_TARGET inline void hb_finish(const HdArgs& a, const HbArgs& b, const uint16_t* head_rows, __m512 s,
                                                   __m512 run, __m512 wn32, int64_t r, int64_t v0, __mmask16 valid, int64_t& nfb) {
    const __m512 as = _mm512_abs_ps(s);
    // gamma ||W|| ||h|| + N 2^-126, then + u' sum |t_i| (u' = b.run32: u and the float32 error sum's own rounding)
    const __m512 e32 = _mm512_fmadd_ps(run, _mm512_set1_ps(b.run32),
                                       _mm512_fmadd_ps(wn32, _mm512_set1_ps(b.hn32[r]), _mm512_set1_ps(b.abs32)));
    // fused: one rounding of wn hn + abs (>= the two-rounding bound); then + 4u |s| = 2^-22 |s|
    const __m512 e = _mm512_fmadd_ps(as, _mm512_set1_ps(0x1p-22f), e32);
    const __m512 lo = _mm512_sub_ps(as, e), hi = _mm512_add_ps(as, e);
    // both ends with the sign of s, rounded to bf16 by VCVTNEPS2BF16 (nearest even; it reads
    // denormals as zero, but a lo below 2^-126 fails the range test anyway)
    const __m512i sign = _mm512_and_si512(_mm512_castps_si512(s), _mm512_set1_epi32((int)0x80000000u));
    const __m256i rl = (__m256i)_mm512_cvtneps_pbh(_mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(lo), sign)));
    const __m256i rh = (__m256i)_mm512_cvtneps_pbh(_mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(hi), sign)));
    // lo in the normal range (false for NaN), R(hi) finite (hi below bf16's largest finite + half an ulp), R(lo) = R(hi)
    const __mmask16 ok = _mm512_cmp_ps_mask(lo, _mm512_set1_ps(0x1p-126f), _CMP_GE_OQ) &
                         _mm512_cmp_ps_mask(hi, _mm512_castsi512_ps(_mm512_set1_epi32(0x7F7F8000)), _CMP_LT_OQ) &
                         _mm256_cmpeq_epi16_mask(rl, rh);
    const __m256i bits = rl;
    unsigned bad = (unsigned)(valid & ~ok);
    if (a.out32) {  // float32 values straight into the caller's rows (no 16-bit scratch)
        alignas(64) uint16_t fix[16];
        _mm256_store_si256((__m256i*)fix, bits);
        while (bad) {
            const int i = __builtin_ctz(bad);
            bad &= bad - 1;
            ++nfb;
            fix[i] = hb_exact(head_rows + i * a.H, a.h64 + r * a.H, a.H);
        }
        const __m512i wide = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_load_si256((const __m256i*)fix)), 16);
        _mm512_mask_storeu_ps(a.out32 + r * a.out_stride + v0, valid, _mm512_castsi512_ps(wide));
        return;
    }
    uint16_t* dst = a.out + r * a.out_stride + (v0 - a.out_v0);
    _mm256_mask_storeu_epi16(dst, valid, bits);
    while (bad) {
        const int i = __builtin_ctz(bad);
        bad &= bad - 1;
        ++nfb;
        dst[i] = hb_exact(head_rows + i * a.H, a.h64 + r * a.H, a.H);
    }
}

// 16 x 16 32-bit transpose in registers: r[i] lane j -> r[j] lane i.
HB_TARGET inline void hb_transpose16(__m512i (&r)[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 8; ++i) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int g = 0; g < 4; ++g) {  // u[4g + c], 128-bit lane L: rows 4g..4g+3 of column 4L + c
        u[4 * g + 0] = _mm512_unpacklo_epi64(t[4 * g + 0], t[4 * g + 2]);
        u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g + 0], t[4 * g + 2]);
        u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
        u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
    }
    for (int c = 0; c < 4; ++c) {
        const __m512i a0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88), a1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xDD);
        const __m512i b0 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88), b1 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xDD);
        r[c] = _mm512_shuffle_i32x4(a0, b0, 0x88);
        r[c + 8] = _mm512_shuffle_i32x4(a0, b0, 0xDD);
        r[c + 4] = _mm512_shuffle_i32x4(a1, b1, 0x88);
        r[c + 12] = _mm512_shuffle_i32x4(a1, b1, 0xDD);
    }
}

// One tile [v0, v1) of a BF16 head: repack (pairs, 32 entries a group, zero padding) with
// the rows' norms, then every block of hidden rows against every group. False (nothing
// written) when the tile holds a bf16 denormal: the caller takes the AVX2 path.
HB_TARGET bool hb_tile(const HdArgs& a, const HbArgs& b, int64_t v0, int64_t v1, std::vector<uint32_t>& w,
                       std::vector<float>& wn, std::vector<float>& part, int64_t& nfb) {
    const int64_t tv = v1 - v0, groups = (tv + 31) / 32, H2 = b.H2;
    w.resize((size_t)(groups * H2 * 32));
    wn.resize((size_t)(groups * 32));
    // 16 entries at a time: 16 x 16 blocks of pairs transposed (entries into the lanes),
    // stored, and their squares summed in float64 (x^2 exact, 8 lanes x 2)
    const int64_t full = a.H / 2;  // pairs inside the row (an odd H's last pair is padded below)
    for (int64_t e0 = 0; e0 < groups * 32; e0 += 16) {
        const uint16_t* src = a.head + (v0 + std::min(e0, tv)) * a.H;
        uint32_t* dst = w.data() + (e0 / 32) * H2 * 32 + (e0 % 32);
        __m512d n0 = _mm512_setzero_pd(), n1 = _mm512_setzero_pd(), n2 = _mm512_setzero_pd(), n3 = _mm512_setzero_pd();
        auto add = [&](__m512i pr) {
            const __m512 x = _mm512_castsi512_ps(_mm512_slli_epi32(pr, 16));
            const __m512 y = _mm512_castsi512_ps(_mm512_and_si512(pr, _mm512_set1_epi32((int)0xFFFF0000u)));
            const __m512d x0 = _mm512_cvtps_pd(_mm512_castps512_ps256(x)), y0 = _mm512_cvtps_pd(_mm512_castps512_ps256(y));
            const __m512d x1 = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
            const __m512d y1 = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(y), 1)));
            n0 = _mm512_fmadd_pd(x0, x0, n0);
            n1 = _mm512_fmadd_pd(x1, x1, n1);
            n2 = _mm512_fmadd_pd(y0, y0, n2);
            n3 = _mm512_fmadd_pd(y1, y1, n3);
        };
        // bf16 denormals (exponent 0, significand not 0) in either half of any pair
        const __m512i exp_lo = _mm512_set1_epi32(0x7F80), exp_hi = _mm512_set1_epi32(0x7F800000), sig_lo = _mm512_set1_epi32(0x7F), sig_hi = _mm512_set1_epi32(0x7F0000);
        __mmask16 denormal = 0;
        const int rows = (int)std::min<int64_t>(16, std::max<int64_t>(0, tv - e0));
        for (int64_t k0 = 0; k0 < full; k0 += 16) {
            // 16 pairs of each of the 16 rows (zeros past the tile and the row), transposed
            const int64_t m = std::min<int64_t>(16, full - k0);
            const __mmask16 cols = m == 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << m) - 1);
            __m512i blk[16];
            for (int i = 0; i < 16; ++i)
                blk[i] = i < rows ? _mm512_maskz_loadu_epi32(cols, src + i * a.H + 2 * k0) : _mm512_setzero_si512();
            hb_transpose16(blk);
            for (int c = 0; c < m; ++c) {
                const __m512i pr = blk[c];
                _mm512_storeu_si512(dst + (k0 + c) * 32, pr);
                add(pr);
                denormal |= _mm512_mask_testn_epi32_mask(_mm512_test_epi32_mask(pr, sig_lo), pr, exp_lo);
                denormal |= _mm512_mask_testn_epi32_mask(_mm512_test_epi32_mask(pr, sig_hi), pr, exp_hi);
            }
        }
        if (denormal) return false;
        if (full < H2) {  // odd H: the last value alone, its pair's other half zero
            alignas(64) uint32_t last[16] = {};
            for (int i = 0; i < 16 && e0 + i < tv; ++i) last[i] = src[i * a.H + a.H - 1];
            for (int i = 0; i < 16; ++i)
                if (hb_has_denormal((const uint16_t*)(last + i), 1)) return false;
            const __m512i pr = _mm512_load_si512(last);
            _mm512_storeu_si512(dst + full * 32, pr);
            add(pr);
        }
        // float64 norms (error ~H 2^-53, inside the 1 + 2^-16) rounded up to float32
        alignas(64) double nn[16];
        _mm512_store_pd(nn, _mm512_add_pd(n0, n2));
        _mm512_store_pd(nn + 8, _mm512_add_pd(n1, n3));
        for (int i = 0; i < 16; ++i) wn[e0 + i] = (float)(std::sqrt(nn[i]) * (1.0 + 0x1p-16));
    }
    part.resize((size_t)(4 * HB_RB * 16));
    for (int64_t r0 = 0; r0 < a.n; r0 += HB_RB) {
        const uint32_t* h = b.hp + r0 * H2;
        for (int64_t g = 0; g < groups; ++g) {
            hb_block(w.data() + g * H2 * 32, h, H2, part.data());
            for (int half = 0; half < 2; ++half) {
                const int64_t e0 = g * 32 + half * 16;
                if (e0 >= tv) break;
                const __mmask16 valid = tv - e0 >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (tv - e0)) - 1);
                const __m512 wn32 = _mm512_loadu_ps(wn.data() + e0);
                for (int j = 0; j < HB_RB && r0 + j < a.n; ++j)
                    hb_finish(a, b, a.head + (v0 + e0) * a.H, _mm512_loadu_ps(part.data() + (half * HB_RB + j) * 16),
                              _mm512_loadu_ps(part.data() + ((2 + half) * HB_RB + j) * 16), wn32, r0 + j, v0 + e0, valid, nfb);
            }
        }
    }
    return true;
}
#undef HB_TARGET
#pragma GCC pop_options
#endif

}  // namespace

namespace {
// hidden [n, H], head [V, H] -> out (16-bit bits) or out32 (float32 values), whichever is given
int hd_decode(const uint16_t* hidden, int64_t n, const uint16_t* head, int64_t V, int64_t H, int fmt, int threads,
              int isa, uint16_t* out, float* out32, int64_t out_stride, int64_t* fallbacks);
}  // namespace

extern "C" {

// 1 where the AVX-512 BF16 decode runs on this CPU (CPUID and the OS's zmm state).
__attribute__((visibility("default"))) int logitdiff_has_avx512bf16(void) { return have_avx512bf16() ? 1 : 0; }

// hidden [n, H] and head [V, H] as 16-bit bits (fmt: BF16 or F16), rows contiguous; out
// [n, V] (row stride out_stride) receives the reconstructed bits before exceptions.
// fallbacks (optional): the number of entries that took the float64 path. isa: 0 auto
// (AVX-512 BF16 for a BF16 head where the CPU has it, else AVX2, else portable), 1
// portable, 2 AVX2, 3 AVX-512 BF16 (F16 heads take AVX2). Returns 0, 1 for bad
// arguments, or 2 when isa 3 is asked for on a CPU without it.
__attribute__((visibility("default"))) int logitdiff_hidden_decode(const uint16_t* hidden, int64_t n,
                                                                   const uint16_t* head, int64_t V, int64_t H, int fmt,
                                                                   int threads, int isa, uint16_t* out,
                                                                   int64_t out_stride, int64_t* fallbacks) {
    return hd_decode(hidden, n, head, V, H, fmt, threads, isa, out, nullptr, out_stride, fallbacks);
}

// The same, the output as float32 values (bf16 bits << 16, f16 widened: exact) [n, V] (row
// stride out_stride): what a caller comparing against float32 rows converts the bits to,
// written by the decode's threads a tile at a time (each thread decodes a tile into its own
// 16-bit scratch, then widens it while it is in cache), so the caller's single-threaded
// conversion pass over the whole block goes away.
__attribute__((visibility("default"))) int logitdiff_hidden_decode_f32(const uint16_t* hidden, int64_t n,
                                                                       const uint16_t* head, int64_t V, int64_t H,
                                                                       int fmt, int threads, int isa, float* out,
                                                                       int64_t out_stride, int64_t* fallbacks) {
    return hd_decode(hidden, n, head, V, H, fmt, threads, isa, nullptr, out, out_stride, fallbacks);
}

}  // extern "C"

namespace {
int hd_decode(const uint16_t* hidden, int64_t n, const uint16_t* head, int64_t V, int64_t H, int fmt, int threads,
              int isa, uint16_t* out, float* out32, int64_t out_stride, int64_t* fallbacks) {
    if (n < 0 || V < 1 || H < 1 || (fmt != BF16 && fmt != F16) || threads < 1 || out_stride < V) return 1;
    if (isa == HD_ISA_AVX512BF16 && !have_avx512bf16()) return 2;  // asked for by name on a CPU without it
    HdIeeeUnderflow ieee;  // before the conversions below
    const int64_t Hp = (H + 7) / 8 * 8;
    std::vector<float> h32((size_t)(n * Hp), 0.0f);
    std::vector<double> h64((size_t)(n * H)), hn((size_t)n), hnorm((size_t)n);
    for (int64_t r = 0; r < n; ++r) {
        double nn = 0.0;
        for (int64_t j = 0; j < H; ++j) {
            float x = hd_to_f32(hidden[r * H + j], fmt);
            h32[r * Hp + j] = x;
            h64[r * H + j] = x;
            nn += (double)x * x;
        }
        // gamma_k = k u / (1 - k u), u = 2^-24, k = hd_roundings(Hp) per term; 1.01 covers
        // the float64 norms' own rounding
        const double k = hd_roundings(Hp), u = 0x1p-24;
        hnorm[r] = std::sqrt(nn);
        hn[r] = 1.01 * k * u / (1.0 - k * u) * hnorm[r];
    }
    HdArgs a{hidden, n, head, V, H, Hp, fmt, h32.data(), h64.data(), hn.data(), out, out_stride};
    bool simd = isa != ISA_SCALAR && have_avx2();
    // the AVX-512 BF16 path: BF16 only, by default where the CPU has it, hidden rows without
    // bf16 denormals (read as zero by VDPBF16PS)
    const bool bf16 = (isa == ISA_AUTO || isa == HD_ISA_AVX512BF16) && fmt == BF16 && have_avx512bf16() &&
                      !hb_has_denormal(hidden, n * H);
    const int64_t H2 = (H + 1) / 2, n_pad = (n + HB_RB - 1) / HB_RB * HB_RB;
    std::vector<uint32_t> hp;
    std::vector<float> hn32;
    HbArgs b{nullptr, H2, nullptr, 0.0f, 0.0f};
    int64_t tile = HD_TV;
    if (bf16) {
        hp.assign((size_t)(n_pad * H2), 0u);
        hn32.assign((size_t)n, 0.0f);
        const double k = hb_roundings(), u = 0x1p-24;
        for (int64_t r = 0; r < n; ++r) {
            const uint16_t* src = hidden + r * H;
            for (int64_t j = 0; j < H2; ++j) hp[r * H2 + j] = src[2 * j] | (2 * j + 1 < H ? (uint32_t)src[2 * j + 1] << 16 : 0u);
            // gamma_k ||h|| with this path's k; 1.01 covers the float64 norm, 1 + 2^-16 the float32 finish
            hn32[r] = (float)(1.01 * k * u / (1.0 - k * u) * hnorm[r] * (1.0 + 0x1p-16));
        }
        const double chains = (double)((H2 + HB_KB - 1) / HB_KB), g = 1.0 + 2.0 * chains * u / (1.0 - chains * u);
        b = HbArgs{hp.data(), H2, hn32.data(), (float)((5.0 * (double)H2 + 2.0) * 0x1p-126 * (1.0 + 0x1p-16)),
                   (float)(u * g * (1.0 + 0x1p-16))};
        tile = std::max<int64_t>(32, std::min<int64_t>(1024, HB_TILE_BYTES / (4 * H2) / 32 * 32));
    }
    std::atomic<int64_t> next{0}, nfb_all{0};
    auto work = [&]() {
        HdIeeeUnderflow ieee;
        std::vector<float> w;
        std::vector<double> wn;
        int64_t nfb = 0;
#if LD_X86
        std::vector<uint32_t> wp;
        std::vector<float> wn32;
        std::vector<float> part;
#endif
        std::vector<uint16_t> scratch;  // float32 output: this thread's tile as bits, widened below
        for (int64_t t; (t = next.fetch_add(1)) * tile < V;) {
            const int64_t v0 = t * tile, v1 = std::min(V, v0 + tile);
#if LD_X86
            if (bf16) {  // float32 output: written by its finish directly
                HdArgs ab = a;
                ab.out32 = out32;
                if (hb_tile(ab, b, v0, v1, wp, wn32, part, nfb)) continue;  // false: nothing written
            }
#endif
            // the AVX2 (or portable) path in its own tiles (float32 output: through a scratch)
            HdArgs at = a;
            if (out32) {
                scratch.resize((size_t)(n * (v1 - v0)));
                at.out = scratch.data();
                at.out_stride = v1 - v0;
                at.out_v0 = v0;
            }
            for (int64_t u0 = v0; u0 < v1; u0 += HD_TV) hd_tile(at, u0, std::min(v1, u0 + HD_TV), simd, w, wn, nfb);
            if (out32) hd_widen(scratch.data(), n, v1 - v0, fmt, out32 + v0, out_stride);
        }
        nfb_all += nfb;
    };
    int64_t tiles = (V + tile - 1) / tile;
    int nt = (int)std::min<int64_t>(threads, tiles);
    std::vector<std::thread> pool;
    for (int t = 1; t < nt; ++t) pool.emplace_back(work);
    work();
    for (auto& t : pool) t.join();
    if (fallbacks) *fallbacks = nfb_all.load();
    return 0;
}
}  // namespace

// ======================================================================================
// Compact reference bounds (bounds.compact_vs_full, issue 28): per row, the exact
// entries' terms, the band group (`group_bounds`) and the rest group (`common_box_bounds`)
// of forward KL, reverse KL and JSD with the reference unknown. Same mathematics as the
// numpy code, without its sorts and fixed bisections: the ratio tau solving
// sum_i clip(tau w_i, lo_i, hi_i) = M is found by an active-set iteration (tau from the
// entries inside their boxes, safeguarded by a bracket, started at the unclipped solution
// M / sum w), which ends at the root instead of within 1e-13 of it (the dual value is flat
// there: the two agree to rounding; the rest's last evaluation is the lower pass's own
// split count); the knapsack of the upper bound is a slope histogram and a weighted
// selection instead of a sort; the rest's fill of the smallest w is one order statistic
// of ln w (a histogram of ln w, nth_element in the bin that holds it) and one pass that
// puts hi below it and lo above it (ties at it counted and weighted afterwards: their
// terms are equal). The passes over the rest (ratio, lower, upper) and the band's are
// 4-wide float64 (AVX2; isa "scalar" runs the portable ones) with the JSD's log in
// log_pd's arithmetic (<= 4 ulp); a quad holding an entry where a term needs its special
// case (x = 0, w = 0, x + w subnormal) goes through the scalar cb_phi. Results agree with
// the numpy functions to float64 summation error (tests/test_bounds.py checks both
// against scipy and against each other; docs/bounds.md section 1, "Compiled path").
//
// `logitdiff_compact_rows` reads the reference in its stored form (exact logits, band
// codes) and also does the candidate's side from its raw logits (float32,
// bf16 or f16 rows, read in place): max, ln sum exp, log-probabilities and probabilities
// in the thread's scratch (exp_pd, one exp per entry: q = e / s), the entropy
// ln s - sum e a / s, the top-kk ids (value descending, lowest id first on ties) and a
// non-finite check: no [n, V] float64 array leaves the kernel, the scratch is allocated
// once per call and thread (O(V)), and a block of any number of rows is one call.
// Appended section; nothing above depends on it.
// ======================================================================================
#include <memory>  // std::unique_ptr (CbBuf)

namespace {

enum CbTerm : int { CB_XLOGX = 0, CB_NEGLOG = 1, CB_JS = 2 };
constexpr double CB_LN2 = 0.6931471805599453;
constexpr double CB_INF = std::numeric_limits<double>::infinity();

// phi(x) = w g(x / w) from ln x, ln w and x, w (bounds._phi; x = 0 allowed).
inline double cb_phi(int term, double lx, double lw, double x, double w) {
    if (term == CB_XLOGX) {
        double o = (lx - lw) * x;
        return std::isnan(o) ? 0.0 : o;
    }
    if (term == CB_NEGLOG) return x > 0 ? w * (lw - lx) : (w > 0 ? CB_INF : 0.0);
    // 0.5 (x ln(2x/(x+w)) + w ln(2w/(x+w))) with one log: the terms cancel to within a few
    // ulp of (x + w) |ln(x + w)|, summed that is ~1e-16 of the group's masses
    double a = x > 0 ? x * (CB_LN2 + lx) : 0.0, b = w > 0 ? w * (CB_LN2 + lw) : 0.0, s = x + w;
    return s > 0 ? 0.5 * (a + b - s * std::log(s)) : 0.0;
}

// Compensated sum (Neumaier): the group sums below run over up to V terms in sequence;
// compensated, their error is ~2 eps of the sum of magnitudes, within the log2(V) eps bound
// documented for the numpy code's pairwise sums (docs/bounds.md, Rounding). inf passes through.
struct CbSum {
    double s = 0.0, c = 0.0;
    inline void add(double x) {
        double t = s + x;
        if (!std::isfinite(t)) { s = t; return; }
        c += std::fabs(s) >= std::fabs(x) ? (s - t) + x : (x - t) + s;
        s = t;
    }
    inline double get() const { return std::isfinite(s) ? s + c : s; }
};

inline double cb_dphi(int term, double lt) {
    if (term == CB_XLOGX) return lt + 1.0;
    if (term == CB_NEGLOG) return -std::exp(-lt);
    double m = std::max(lt, 0.0);  // logaddexp(lt, 0)
    return 0.5 * (CB_LN2 + lt - (m + std::log1p(std::exp(-std::fabs(lt)))));
}

// ln tau with sum_i clip(tau w_i, lo_i, hi_i) = mass, in [a, b] (f(a) <= mass <= f(b)),
// from `start` (the bracket's middle where it is outside). eval(E, Clo, Chi, Wm) returns f
// at tau = E with the sums of the entries at lo, at hi and the w of those in between; the
// next ln tau is the one that solves the equation with that split (exact once the split
// is right), bisection where it leaves the bracket.
// The iteration's state, so that a caller can stop after a few evaluations and resume.
// Where the split's solution leaves the bracket, the next ln tau is the bracket's regula
// falsi point (Illinois: the end kept twice in a row has its excess halved), from f at the
// ends where known (fa, fb; NaN: unknown, bisection): a band of narrow boxes has few
// entries in between at any tau, so its split's solution is rarely inside the bracket.
struct CbRoot {
    double a, b, lt, fa, fb;
    bool done = false, from_cand = false;  // from_cand: lt is the last split's solution
    int it = 0, side = 0;                  // side: -1 / +1, the end moved last
    CbRoot(double a_, double b_, double start, double fa_ = std::numeric_limits<double>::quiet_NaN(),
           double fb_ = std::numeric_limits<double>::quiet_NaN())
        : a(a_), b(b_), lt((start > a_ && start < b_) ? start : 0.5 * (a_ + b_)), fa(fa_), fb(fb_) {}
};

template <typename Eval>
void cb_root_steps(CbRoot& R, double mass, int evals, Eval eval) {
    for (int k = 0; k < evals && !R.done; ++k) {
        if (!(R.it < 200 && R.b - R.a >= 1e-13)) { R.done = true; break; }
        ++R.it;
        double clo, chi, wm;
        double f = eval(std::exp(R.lt), clo, chi, wm);
        if (f < mass) {
            if (R.side == -1) R.fb = mass + 0.5 * (R.fb - mass);
            R.a = R.lt; R.fa = f; R.side = -1;
        } else {
            if (R.side == 1) R.fa = mass - 0.5 * (mass - R.fa);
            R.b = R.lt; R.fb = f; R.side = 1;
        }
        double r = mass - clo - chi;
        double cand = (wm > 0 && r > 0) ? std::log(r / wm) : std::numeric_limits<double>::quiet_NaN();
        if (cand == R.lt) { R.done = true; break; }  // the split reproduces itself: the root
        R.from_cand = cand > R.a && cand < R.b;
        if (R.from_cand) { R.lt = cand; continue; }
        double t = R.fb > R.fa ? R.a + (mass - R.fa) / (R.fb - R.fa) * (R.b - R.a) : std::numeric_limits<double>::quiet_NaN();
        R.lt = (t > R.a && t < R.b) ? t : 0.5 * (R.a + R.b);
    }
}

template <typename Eval>
double cb_root(double a, double b, double mass, double start, Eval eval, double fa = std::numeric_limits<double>::quiet_NaN(),
               double fb = std::numeric_limits<double>::quiet_NaN()) {
    CbRoot R(a, b, start, fa, fb);
    cb_root_steps(R, mass, 1 << 30, eval);
    return R.lt;
}

// Sum of s_i y_i maximised over 0 <= y_i <= c_i, sum y_i = rest (steepest first); only
// entries with c_i > 0 are passed. Weighted quickselect on s.
double cb_knapsack(std::vector<std::pair<double, double>>& sc, double rest) {
    double gain = 0.0;
    size_t lo = 0, hi = sc.size();
    while (lo < hi && rest > 0) {
        double p = sc[lo + (hi - lo) / 2].first;
        // three-way partition: [lo, g) s > p, [g, e) s == p, [e, hi) s < p
        size_t g = lo, i = lo, e = hi;
        while (i < e) {
            if (sc[i].first > p) std::swap(sc[i++], sc[g++]);
            else if (sc[i].first < p) std::swap(sc[i], sc[--e]);
            else ++i;
        }
        double cg = 0.0, sg = 0.0, ce = 0.0;
        for (size_t k = lo; k < g; ++k) { cg += sc[k].second; }
        if (cg >= rest) { hi = g; continue; }
        for (size_t k = lo; k < g; ++k) sg += sc[k].first * sc[k].second;
        for (size_t k = g; k < e; ++k) ce += sc[k].second;
        gain += sg;
        rest -= cg;
        if (ce >= rest) { gain += p * rest; return gain; }
        if (ce > 0) gain += p * ce;
        rest -= ce;
        lo = e;
    }
    return gain;
}

// ---------------------------------------------------------------- vector passes
// Every pass sums in 4 lanes over blocks of 64 entries, the blocks compensated (CbSum):
// error ~ 18 eps of the sum of magnitudes (docs/bounds.md, Rounding).

// One entry of the rest's lower pass (scalar; the SIMD passes' special quads and tails).
inline void cb_lower1(double lw, double w, double lt, double Et, double llo, double lhi, double lo, double hi, double* acc) {
    double lx = std::min(std::max(lt + lw, llo), lhi);
    double x = std::min(std::max(Et * w, lo), hi);
    acc[0] += x;
    acc[1] += cb_phi(CB_XLOGX, lx, lw, x, w);
    acc[2] += cb_phi(CB_NEGLOG, lx, lw, x, w);
    acc[3] += cb_phi(CB_JS, lx, lw, x, w);
}

// Entries of the rest at lo (below) and hi: the three terms (scalar).
inline void cb_box1(double lx, double lw, double x, double w, double* acc) {
    acc[0] += cb_phi(CB_XLOGX, lx, lw, x, w);
    acc[1] += cb_phi(CB_NEGLOG, lx, lw, x, w);
    acc[2] += cb_phi(CB_JS, lx, lw, x, w);
}

void cb_rest_eval_scalar(const double* w, size_t n, double Et, double lo, double hi, double& nlo, double& nhi, double& wmid) {
    double a = 0, b = 0, m = 0;
    for (size_t i = 0; i < n; ++i) {
        double x = Et * w[i];
        bool l = x <= lo, h = !l && x >= hi;  // lo == hi: an entry is counted once
        a += l; b += h;
        m += (l | h) ? 0.0 : w[i];
    }
    nlo = a; nhi = b; wmid = m;
}

#if LD_X86
__attribute__((target("avx2,fma,f16c"))) void cb_rest_eval_avx2(const double* w, size_t n, double Et, double lo, double hi,
                                                                 double& nlo, double& nhi, double& wmid) {
    const __m256d E = _mm256_set1_pd(Et), L = _mm256_set1_pd(lo), H = _mm256_set1_pd(hi), one = _mm256_set1_pd(1.0);
    __m256d a = _mm256_setzero_pd(), b = a, m = a;
    size_t i = 0;
    for (; i + 4 <= n; i += 4) {
        __m256d wv = _mm256_loadu_pd(w + i), x = _mm256_mul_pd(E, wv);
        __m256d l = _mm256_cmp_pd(x, L, _CMP_LE_OQ);
        __m256d h = _mm256_andnot_pd(l, _mm256_cmp_pd(x, H, _CMP_GE_OQ));
        a = _mm256_add_pd(a, _mm256_and_pd(l, one));
        b = _mm256_add_pd(b, _mm256_and_pd(h, one));
        m = _mm256_add_pd(m, _mm256_andnot_pd(_mm256_or_pd(l, h), wv));
    }
    double ta, tb, tm;
    cb_rest_eval_scalar(w + i, n - i, Et, lo, hi, ta, tb, tm);
    nlo = hsum(a) + ta; nhi = hsum(b) + tb; wmid = hsum(m) + tm;
}

// log_pd and exp_pd with their constants read from memory, four copies each (an FMA takes
// one as its memory operand; the register-bound passes below reloaded every broadcast
// constant per quad): the same operations in the same order, so the same values.
struct alignas(32) CbConsts {
    double log_c[9][4], exp_c[12][4];
    CbConsts() {
        const double lc[9] = {1.0 / 19, 1.0 / 17, 1.0 / 15, 1.0 / 13, 1.0 / 11, 1.0 / 9, 1.0 / 7, 1.0 / 5, 1.0 / 3};
        const double ec[12] = {1.0 / 39916800, 1.0 / 3628800, 1.0 / 362880, 1.0 / 40320, 1.0 / 5040, 1.0 / 720,
                               1.0 / 120,      1.0 / 24,      1.0 / 6,      0.5,          1.0,          1.0};
        for (int k = 0; k < 4; ++k) {
            for (int j = 0; j < 9; ++j) log_c[j][k] = lc[j];
            for (int j = 0; j < 12; ++j) exp_c[j][k] = ec[j];
        }
    }
};
const CbConsts cb_c;

__attribute__((target("avx2,fma,f16c"))) inline __m256d cb_log_pd(__m256d g) {
    __m256d e, f;
    log_pd_split(g, e, f);
    __m256d f2 = _mm256_mul_pd(f, f);
    __m256d p = _mm256_load_pd(cb_c.log_c[0]);
    for (int j = 1; j < 9; ++j) p = _mm256_fmadd_pd(p, f2, _mm256_load_pd(cb_c.log_c[j]));
    return log_pd_join(e, f, f2, p);
}

__attribute__((target("avx2,fma,f16c"))) inline __m256d cb_exp_pd(__m256d a) {
    __m256d under, t, r;
    exp_pd_split(a, under, t, r);
    __m256d p = _mm256_load_pd(cb_c.exp_c[0]);
    for (int j = 1; j < 12; ++j) p = _mm256_fmadd_pd(p, r, _mm256_load_pd(cb_c.exp_c[j]));
    return exp_pd_join(under, t, p);
}

// JSD terms 0.5 (x (ln2 + lx) + w (ln2 + lw) - s ln s), s = x + w, of four entries with
// x > 0, w > 0, s normal (the caller checks).
__attribute__((target("avx2,fma,f16c"))) inline __m256d cb_js4(__m256d x, __m256d lx, __m256d w, __m256d lw) {
    const __m256d ln2 = _mm256_set1_pd(CB_LN2), half = _mm256_set1_pd(0.5);
    __m256d s = _mm256_add_pd(x, w);
    __m256d ab = _mm256_fmadd_pd(x, _mm256_add_pd(ln2, lx), _mm256_mul_pd(w, _mm256_add_pd(ln2, lw)));
    return _mm256_mul_pd(half, _mm256_fnmadd_pd(s, cb_log_pd(s), ab));
}

// a quad whose four entries take the common formulas: x > 0, w > 0, x + w normal
__attribute__((target("avx2,fma,f16c"))) inline bool cb_plain4(__m256d x, __m256d w) {
    const __m256d tiny = _mm256_set1_pd(std::numeric_limits<double>::min()), zero = _mm256_setzero_pd();
    __m256d ok = _mm256_and_pd(_mm256_and_pd(_mm256_cmp_pd(x, zero, _CMP_GT_OQ), _mm256_cmp_pd(w, zero, _CMP_GT_OQ)),
                               _mm256_cmp_pd(_mm256_add_pd(x, w), tiny, _CMP_GE_OQ));
    return _mm256_movemask_pd(ok) == 0xF;
}

// exp of an array of a <= 0 (exp_pd, <= 4 ulp); a > 0 (a box's end a rounding above 0)
// through std::exp.
__attribute__((target("avx2,fma,f16c"))) void cb_exp_avx2(const double* a, size_t n, double* out) {
    size_t i = 0;
    const __m256d zero = _mm256_setzero_pd();
    for (; i + 4 <= n; i += 4) {
        __m256d v = _mm256_loadu_pd(a + i);
        if (_mm256_movemask_pd(_mm256_cmp_pd(v, zero, _CMP_LE_OQ)) != 0xF) {
            for (size_t k = i; k < i + 4; ++k) out[k] = std::exp(a[k]);
            continue;
        }
        _mm256_storeu_pd(out + i, cb_exp_pd(v));
    }
    for (; i < n; ++i) out[i] = std::exp(a[i]);
}

// The rest's entries compacted out of the row: ln w = lq - shift, w = q * scale (the fused
// path's row is a = z - max and e = exp(a): shift = ln sum e, scale = 1 / sum e), where
// mask is 1 and ln w > -inf; with their minimum and maximum ln w and sum of w.
__attribute__((target("avx2,fma,f16c"))) size_t cb_build_avx2(const double* lq, const double* q, const uint8_t* mask, int64_t V,
                                                              double shift, double scale, double* rlw, double* rw,
                                                              double& lw_min, double& lw_max, double& sw) {
    const __m256d S = _mm256_set1_pd(shift), K = _mm256_set1_pd(scale), NINF = _mm256_set1_pd(-CB_INF);
    __m256d mn = _mm256_set1_pd(CB_INF), mx = NINF, sv = _mm256_setzero_pd();
    double smn = CB_INF, smx = -CB_INF, ss = 0;
    size_t cnt = 0;
    int64_t v = 0;
    auto one = [&](int64_t k) {
        double l = lq[k] - shift, w = q[k] * scale;
        if (!mask[k] || !(l > -CB_INF)) return;
        rlw[cnt] = l; rw[cnt] = w; ++cnt;
        smn = std::min(smn, l); smx = std::max(smx, l); ss += w;
    };
    for (; v + 4 <= V; v += 4) {
        uint32_t mb;
        std::memcpy(&mb, mask + v, 4);
        __m256d l = _mm256_sub_pd(_mm256_loadu_pd(lq + v), S), w = _mm256_mul_pd(_mm256_loadu_pd(q + v), K);
        if (mb != 0x01010101u || _mm256_movemask_pd(_mm256_cmp_pd(l, NINF, _CMP_GT_OQ)) != 0xF) {
            for (int64_t k = v; k < v + 4; ++k) one(k);
            continue;
        }
        _mm256_storeu_pd(rlw + cnt, l);
        _mm256_storeu_pd(rw + cnt, w);
        cnt += 4;
        mn = _mm256_min_pd(mn, l); mx = _mm256_max_pd(mx, l); sv = _mm256_add_pd(sv, w);
    }
    for (; v < V; ++v) one(v);
    alignas(32) double a[4], b[4];
    _mm256_store_pd(a, mn); _mm256_store_pd(b, mx);
    for (int k = 0; k < 4; ++k) { smn = std::min(smn, a[k]); smx = std::max(smx, b[k]); }
    lw_min = smn; lw_max = smx; sw = ss + hsum(sv);
    return cnt;
}

// The band's ratio equation at tau = Et: sums of lo over the entries at lo, of hi over
// those at hi, and w of those in between (per-entry boxes).
__attribute__((target("avx2,fma,f16c"))) void cb_band_eval_avx2(const double* w, const double* lo, const double* hi, size_t m,
                                                                double Et, double& clo, double& chi, double& wm) {
    const __m256d E = _mm256_set1_pd(Et);
    __m256d a = _mm256_setzero_pd(), b = a, c = a;
    size_t i = 0;
    for (; i + 4 <= m; i += 4) {
        __m256d wv = _mm256_loadu_pd(w + i), L = _mm256_loadu_pd(lo + i), H = _mm256_loadu_pd(hi + i);
        __m256d x = _mm256_mul_pd(E, wv);
        __m256d l = _mm256_cmp_pd(x, L, _CMP_LE_OQ);
        __m256d h = _mm256_andnot_pd(l, _mm256_cmp_pd(x, H, _CMP_GE_OQ));
        a = _mm256_add_pd(a, _mm256_and_pd(l, L));
        b = _mm256_add_pd(b, _mm256_and_pd(h, H));
        c = _mm256_add_pd(c, _mm256_andnot_pd(_mm256_or_pd(l, h), wv));
    }
    double ta = 0, tb = 0, tc = 0;
    for (; i < m; ++i) {
        double x = Et * w[i];
        if (x <= lo[i]) ta += lo[i];
        else if (x >= hi[i]) tb += hi[i];
        else tc += w[i];
    }
    clo = hsum(a) + ta; chi = hsum(b) + tb; wm = hsum(c) + tc;
}

// The band's lower pass (per-entry boxes): sum x, and the three terms.
__attribute__((target("avx2,fma,f16c"))) void cb_band_lower_avx2(const double* lw, const double* w, const double* llo,
                                                                 const double* lhi, const double* lo, const double* hi, size_t m,
                                                                 double lt, double Et, double* out) {
    const __m256d LT = _mm256_set1_pd(lt), E = _mm256_set1_pd(Et);
    CbSum t[4];
    size_t i = 0;
    while (i < m) {
        size_t end = std::min(m, i + 64);
        __m256d sx = _mm256_setzero_pd(), s0 = sx, s1 = sx, s2 = sx;
        double acc[4] = {0, 0, 0, 0};
        for (; i + 4 <= end; i += 4) {
            __m256d lwv = _mm256_loadu_pd(lw + i), wv = _mm256_loadu_pd(w + i);
            __m256d lx = _mm256_min_pd(_mm256_max_pd(_mm256_add_pd(LT, lwv), _mm256_loadu_pd(llo + i)), _mm256_loadu_pd(lhi + i));
            __m256d x = _mm256_min_pd(_mm256_max_pd(_mm256_mul_pd(E, wv), _mm256_loadu_pd(lo + i)), _mm256_loadu_pd(hi + i));
            if (!cb_plain4(x, wv)) {
                for (size_t k = i; k < i + 4; ++k) cb_lower1(lw[k], w[k], lt, Et, llo[k], lhi[k], lo[k], hi[k], acc);
                continue;
            }
            sx = _mm256_add_pd(sx, x);
            s0 = _mm256_fmadd_pd(_mm256_sub_pd(lx, lwv), x, s0);
            s1 = _mm256_fmadd_pd(wv, _mm256_sub_pd(lwv, lx), s1);
            s2 = _mm256_add_pd(s2, cb_js4(x, lx, wv, lwv));
        }
        for (; i < end; ++i) cb_lower1(lw[i], w[i], lt, Et, llo[i], lhi[i], lo[i], hi[i], acc);
        t[0].add(hsum(sx) + acc[0]); t[1].add(hsum(s0) + acc[1]); t[2].add(hsum(s1) + acc[2]); t[3].add(hsum(s2) + acc[3]);
    }
    for (int k = 0; k < 4; ++k) out[k] = t[k].get();
}

// The candidate's raw row (float32): maximum, and false where it holds NaN/inf.
__attribute__((target("avx2,fma,f16c"))) bool cb_max_avx2(const float* z, int64_t V, float& m) {
    __m256 mx = _mm256_set1_ps(-std::numeric_limits<float>::infinity()), bad = _mm256_setzero_ps();
    const __m256 zero = _mm256_setzero_ps();
    int64_t v = 0;
    for (; v + 8 <= V; v += 8) {
        __m256 x = _mm256_loadu_ps(z + v);
        mx = _mm256_max_ps(mx, x);
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(_mm256_sub_ps(x, x), zero, _CMP_NEQ_UQ));  // NaN or inf: x - x is NaN
    }
    float r = hmax(mx);
    bool ok = _mm256_movemask_ps(bad) == 0;
    for (; v < V; ++v) { r = std::max(r, z[v]); ok &= z[v] - z[v] == 0.0f; }
    m = r;
    return ok;
}

// Top-kk of a row into `top`: blocks of 16 whose maximum beats the heap's threshold.
__attribute__((target("avx2,fma,f16c"))) void cb_topk_avx2(const float* z, int64_t V, TopK& top) {
    int64_t v = 0;
    for (; v + 16 <= V; v += 16) {
        if (top.full() && !(hmax(_mm256_max_ps(_mm256_loadu_ps(z + v), _mm256_loadu_ps(z + v + 8))) > top.threshold())) continue;
        for (int64_t k = v; k < v + 16; ++k) top.offer(z[k], k);
    }
    for (; v < V; ++v) top.offer(z[v], v);
}
#endif

// The compact section's instruction set, chosen per call (logitdiff_compact_rows' isa:
// 0 auto, 1 scalar, 2 avx2) and held by each of the call's worker threads for the call.
thread_local bool cb_scalar_only = false;

inline bool cb_simd() {
#if LD_X86
    static const bool simd = have_avx2();
    return simd && !cb_scalar_only;
#else
    return false;
#endif
}

inline void cb_rest_eval(const double* w, size_t n, double Et, double lo, double hi, double& nlo, double& nhi, double& wmid) {
#if LD_X86
    if (cb_simd()) return cb_rest_eval_avx2(w, n, Et, lo, hi, nlo, nhi, wmid);
#endif
    cb_rest_eval_scalar(w, n, Et, lo, hi, nlo, nhi, wmid);
}

inline void cb_exp(const double* a, size_t n, double* out) {
#if LD_X86
    if (cb_simd()) return cb_exp_avx2(a, n, out);
#endif
    for (size_t i = 0; i < n; ++i) out[i] = std::exp(a[i]);
}

// ---------------------------------------------------------------- rows

struct CbArgs {
    int64_t n, V, ld;
    const double *lq, *q;  // null in the fused path (the candidate's row is in the scratch)
    int64_t E;
    const int64_t* e_ids;
    const double* e_logp;
    int64_t B;
    const int64_t* b_ids;
    const double *b_lo, *b_hi, *band_mass, *rest_mass, *rest_max, *rest_min;
    double *lower, *upper;  // [3, n]
    // fused path: raw candidate logits and their outputs
    const void* z;
    int dtype, kk;
    double* stats;     // [n, 3]: max, ln sum exp(z - max), entropy
    int64_t* top_ids;  // [n, kk]
    int32_t* bad;      // [n]: 1 where the row holds NaN/inf (its sums are NaN)
    // the stored form (compact.decode's arithmetic done here), where e_logp / b_lo are null:
    // ln p of an exact entry (logit - max) - ln sum; of a band entry with code c the box
    // [top - (c + 1) step - slack, min(top - c step + slack, 0)]
    const float* e_logits = nullptr;
    const double *e_max = nullptr, *e_ls = nullptr, *b_top = nullptr, *b_step = nullptr;
    const void* b_codes = nullptr;
    int code_bits = 16;
    double slack = 0.0;
    int isa = 0;  // 0 auto, 1 scalar, 2 avx2 (kernel.ISA_CODES)
};

// A buffer of n values, not initialised (every use writes before it reads: a row's O(V)
// arrays would otherwise be zeroed once per call and thread for nothing).
template <typename T>
struct CbBuf {
    std::unique_ptr<T[]> p;
    size_t n = 0;
    T* get(size_t m) {
        if (n < m) { p.reset(new T[m]); n = m; }
        return p.get();
    }
};

// Per worker thread, sized once per call; nothing survives the call.
struct CbScratch {
    std::vector<uint8_t> mask;     // 1 for every id between rows
    CbBuf<double> a, e;            // the fused path's row: z - max and exp(z - max)
    CbBuf<double> rlw, rw;         // the rest, compacted (4 entries of room past V)
    // set by the fused path's candidate pass: rlw, rw hold the rest's z - max and
    // exp(z - max) (n of them), cb_row applies shift and scale
    struct { bool ready; size_t n; } rest{false, 0};
    CbBuf<float> zf;
    std::vector<double> lw, w, llo, lhi, lo, hi, sel, tv;
    std::vector<double> ks[3], kc[3];  // the band's chord slopes and capacities per term
    std::vector<uint32_t> hist;
    std::vector<int32_t> bins, kbins;
    std::vector<std::pair<double, double>> kpart;
    std::vector<double> khist;
    TopK top;
    explicit CbScratch(int64_t V) : mask((size_t)V, 1) {
        rlw.get((size_t)V + 4);
        rw.get((size_t)V + 4);
    }
    void band_size(size_t b) {  // room for b band entries (grown once per call)
        if (lw.size() >= b) return;
        for (auto* v : {&lw, &w, &llo, &lhi, &lo, &hi}) v->resize(b);
        for (int t = 0; t < 3; ++t) { ks[t].resize(b); kc[t].resize(b); }
        kbins.resize(b);
    }
};

#if LD_X86
// a = z - m, e = exp(a) (exp_pd: a < -708 gives 0), sums of e and e a per block of 64
// entries (4 lanes, blocks compensated); returns how many entries it did (whole blocks).
// The rest's entries (mask 1) are also copied, compacted, to ra, re (rc of them so far):
// the rest's arrays without a second pass over the row (CbScratch::rest). A quad's four
// mask bytes become a 4-bit keep mask (one multiply) that picks a permutation moving the
// kept lanes to the front; the quad is stored whole and rc advances by the kept count
// (ra, re have 4 entries of room past V).
struct CbCompactLut {
    alignas(32) int32_t idx[16][8];
    CbCompactLut() {
        for (int mk = 0; mk < 16; ++mk) {
            int j = 0;
            for (int l = 0; l < 4; ++l)
                if (mk >> l & 1) { idx[mk][2 * j] = 2 * l; idx[mk][2 * j + 1] = 2 * l + 1; ++j; }
            for (; j < 4; ++j) { idx[mk][2 * j] = 0; idx[mk][2 * j + 1] = 1; }
        }
    }
};
const CbCompactLut cb_lut;

// bit l of the result: byte l of the 4 mask bytes at p (each 0 or 1)
inline unsigned cb_keep4(const uint8_t* p) {
    uint32_t mb;
    std::memcpy(&mb, p, 4);
    return (mb * 0x10204080u) >> 28;
}

__attribute__((target("avx2,fma,f16c"))) int64_t cb_softmax_avx2(const float* z, int64_t V, double m, double* a, double* e,
                                                                  CbSum& ts, CbSum& ta, const uint8_t* mask, double* ra,
                                                                  double* re, size_t& rc) {
    const __m256d M = _mm256_set1_pd(m);
    size_t c = rc;
    int64_t v = 0;
    for (; v + 64 <= V; v += 64) {
        __m256d s = _mm256_setzero_pd(), sa = s;
        for (int64_t k = v; k < v + 64; k += 4) {
            __m256d av = _mm256_sub_pd(_mm256_cvtps_pd(_mm_loadu_ps(z + k)), M);
            __m256d ev = cb_exp_pd(av);
            _mm256_storeu_pd(a + k, av);
            _mm256_storeu_pd(e + k, ev);
            s = _mm256_add_pd(s, ev);
            sa = _mm256_fmadd_pd(ev, av, sa);
            const unsigned keep = cb_keep4(mask + k);
            const __m256i p = _mm256_load_si256(reinterpret_cast<const __m256i*>(cb_lut.idx[keep]));
            _mm256_storeu_pd(ra + c, _mm256_castsi256_pd(_mm256_permutevar8x32_epi32(_mm256_castpd_si256(av), p)));
            _mm256_storeu_pd(re + c, _mm256_castsi256_pd(_mm256_permutevar8x32_epi32(_mm256_castpd_si256(ev), p)));
            c += (size_t)__builtin_popcount(keep);
        }
        ts.add(hsum(s));
        ta.add(hsum(sa));
    }
    rc = c;
    return v;
}

// ln w = a - shift and w = e * scale in place (cb_build's arithmetic), with the extremes
// of ln w and sum w
__attribute__((target("avx2,fma,f16c"))) size_t cb_shift_scale_avx2(double* la, double* e, size_t n, double shift, double scale,
                                                                     double& lw_min, double& lw_max, double& sw, double& w_min) {
    const __m256d S = _mm256_set1_pd(shift), K = _mm256_set1_pd(scale);
    __m256d mn = _mm256_set1_pd(CB_INF), mx = _mm256_set1_pd(-CB_INF), sv = _mm256_setzero_pd(), wm = mn;
    size_t i = 0;
    for (; i + 4 <= n; i += 4) {
        __m256d l = _mm256_sub_pd(_mm256_loadu_pd(la + i), S), w = _mm256_mul_pd(_mm256_loadu_pd(e + i), K);
        _mm256_storeu_pd(la + i, l);
        _mm256_storeu_pd(e + i, w);
        mn = _mm256_min_pd(mn, l); mx = _mm256_max_pd(mx, l); sv = _mm256_add_pd(sv, w); wm = _mm256_min_pd(wm, w);
    }
    alignas(32) double x[4], y[4], z[4];
    _mm256_store_pd(x, mn); _mm256_store_pd(y, mx); _mm256_store_pd(z, wm);
    for (int k = 0; k < 4; ++k) { lw_min = std::min(lw_min, x[k]); lw_max = std::max(lw_max, y[k]); w_min = std::min(w_min, z[k]); }
    sw += hsum(sv);
    return i;
}
#endif

#if LD_X86
void cb_widen_avx2(const void* base, int64_t V, int dtype, float* out);
#endif

// The candidate's row from raw logits into S.a (z - max) and S.e (exp(z - max)); st: max,
// ln sum e, entropy. False when the row holds NaN/inf.
bool cb_candidate(const CbArgs& A, int64_t r, CbScratch& S, double* st) {
    const int64_t V = A.V;
    const float* z;
    const char* base = static_cast<const char*>(A.z) + (size_t)(r * A.ld) * (A.dtype == F32 ? 4 : 2);
    if (A.dtype == F32) {
        z = reinterpret_cast<const float*>(base);
    } else {
        float* zf = S.zf.get((size_t)V);
#if LD_X86
        if (cb_simd()) cb_widen_avx2(base, V, A.dtype, zf);
        else
#endif
            for (int64_t v = 0; v < V; ++v) zf[v] = load1(base, v, A.dtype);
        z = zf;
    }
    float m = -std::numeric_limits<float>::infinity();
    bool ok = true;
    if (A.kk > 0) S.top.reset(A.kk);
#if LD_X86
    if (cb_simd()) {
        ok = cb_max_avx2(z, V, m);
        if (ok && A.kk > 0) cb_topk_avx2(z, V, S.top);
    } else
#endif
    {
        for (int64_t v = 0; v < V; ++v) { m = std::max(m, z[v]); ok &= z[v] - z[v] == 0.0f; }
        if (ok && A.kk > 0) for (int64_t v = 0; v < V; ++v) S.top.offer(z[v], v);
    }
    if (!ok) return false;
    double* a = S.a.get((size_t)V);
    double* e = S.e.get((size_t)V);
    CbSum ts, ta;
    const double md = m;
    int64_t v = 0;
    const uint8_t* mask = S.mask.data();
    double* ra = S.rlw.p.get();
    double* re = S.rw.p.get();
    size_t rc = 0;
#if LD_X86
    if (cb_simd()) v = cb_softmax_avx2(z, V, md, a, e, ts, ta, mask, ra, re, rc);
#endif
    for (; v < V; v += 64) {
        double s = 0, sa = 0;
        for (int64_t k = v; k < std::min(V, v + 64); ++k) {
            a[k] = (double)z[k] - md;
            e[k] = std::exp(a[k]);
            s += e[k];
            sa += e[k] * a[k];
            if (mask[k]) { ra[rc] = a[k]; re[rc] = e[k]; ++rc; }
        }
        ts.add(s); ta.add(sa);
    }
    S.rest = {true, rc};
    double s = ts.get(), ls = std::log(s);
    st[0] = md;
    st[1] = ls;
    st[2] = std::max(ls - ta.get() / s, 0.0);  // -sum q ln q = ln s - sum e a / s
    if (A.kk > 0) {
        S.tv.resize((size_t)A.kk);
        S.top.write(A.top_ids + r * A.kk, S.tv.data());
    }
    return true;
}

inline size_t cb_build(const double* lq, const double* q, const uint8_t* mask, int64_t V, double shift, double scale, double* rlw,
                       double* rw, double& lw_min, double& lw_max, double& sw) {
#if LD_X86
    if (cb_simd()) return cb_build_avx2(lq, q, mask, V, shift, scale, rlw, rw, lw_min, lw_max, sw);
#endif
    size_t cnt = 0;
    lw_min = CB_INF; lw_max = -CB_INF; sw = 0;
    for (int64_t v = 0; v < V; ++v) {
        double l = lq[v] - shift, w = q[v] * scale;
        if (!mask[v] || !(l > -CB_INF)) continue;
        rlw[cnt] = l; rw[cnt] = w; ++cnt;
        lw_min = std::min(lw_min, l); lw_max = std::max(lw_max, l); sw += w;
    }
    return cnt;
}

constexpr int CB_NB = 4096;
inline int cb_bin(double v, double xmin, double sc) { return (int)std::min<double>((v - xmin) * sc, CB_NB - 1); }

#if LD_X86
// the bins of x[0, n) (the same rounding as cb_bin: one subtraction, one product, a min
// and truncation)
__attribute__((target("avx2,fma,f16c"))) void cb_bins_avx2(const double* x, size_t n, double xmin, double sc, int32_t* out) {
    const __m256d X = _mm256_set1_pd(xmin), S = _mm256_set1_pd(sc), T = _mm256_set1_pd(CB_NB - 1);
    size_t i = 0;
    for (; i + 4 <= n; i += 4) {
        __m256d v = _mm256_min_pd(_mm256_mul_pd(_mm256_sub_pd(_mm256_loadu_pd(x + i), X), S), T);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm256_cvttpd_epi32(v));
    }
    for (; i < n; ++i) out[i] = cb_bin(x[i], xmin, sc);
}

// x[i] of the entries of bin b, appended to out[j...] (8 bins compared at once: bin b is a
// small part of the row); returns how many entries it looked at (whole octets)
__attribute__((target("avx2,fma,f16c"))) size_t cb_bin_members_avx2(const double* x, const int32_t* bins, size_t n, int32_t b,
                                                                    double* out, size_t& j) {
    const __m256i B = _mm256_set1_epi32(b);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        unsigned mk = (unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(
            _mm256_cmpeq_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bins + i)), B)));
        for (; mk; mk &= mk - 1) out[j++] = x[i + __builtin_ctz(mk)];
    }
    return i;
}
#endif


// The rest's lower pass and upper assignment in one pass. Lower: an entry whose x =
// tau w lies strictly inside the box ("mid": the ratio equation puts nearly every entry
// there) has terms x ln tau, -w ln tau and w g(tau), so the pass only sums their w
// (w_mid) and takes the per-entry terms of the clipped ones (at lo or hi; low: their sum
// of x and three terms). Upper: ln w below thr takes (lhi, hi), above it (llo, lo); those
// equal to thr are counted (n_eq; their w in w_eq: equal ln w, equal terms) and left to
// the caller; up: the three upper terms, n_lt: how many lie below thr.
struct CbPassOut {
    double low[4], w_mid, up[3], n_lt, n_eq, w_eq;
    double n_lo, n_hi;  // the lower placement's split: entries at lo, at hi (as cb_rest_eval counts them)
};

void cb_pass_lower_scalar(const double* lw, const double* w, size_t n, double lt, double Et, double llo, double lhi, double lo,
                          double hi, CbPassOut& o) {
    CbSum tl[4], tw;
    double nl = 0, nh = 0;
    for (size_t i0 = 0; i0 < n; i0 += 64) {
        double la[4] = {0, 0, 0, 0}, wm = 0;
        for (size_t i = i0; i < std::min(n, i0 + 64); ++i) {
            double x = Et * w[i];
            bool l = x <= lo, h = !l && x >= hi;
            nl += l; nh += h;
            if (l || h) cb_lower1(lw[i], w[i], lt, Et, llo, lhi, lo, hi, la);
            else wm += w[i];
        }
        for (int k = 0; k < 4; ++k) tl[k].add(la[k]);
        tw.add(wm);
    }
    for (int k = 0; k < 4; ++k) o.low[k] = tl[k].get();
    o.w_mid = tw.get();
    o.n_lo = nl; o.n_hi = nh;
}

// the upper placement of one entry: ties at thr counted (n_eq, their w in w_eq), the others'
// three terms at hi (ln w below thr; n_lt counts them) or lo
inline void cb_upper1(double lwi, double wi, double thr, double llo, double lhi, double lo, double hi, double* uacc, double& nlt,
                      double& neq, double& weq) {
    if (lwi == thr) { neq += 1; weq = wi; return; }
    bool full = lwi < thr;
    nlt += full;
    cb_box1(full ? lhi : llo, lwi, full ? hi : lo, wi, uacc);
}

void cb_pass_upper_scalar(const double* lw, const double* w, size_t n, double thr, double llo, double lhi, double lo, double hi,
                          CbPassOut& o) {
    CbSum tu[3];
    double nlt = 0, neq = 0, weq = 0;
    for (size_t i0 = 0; i0 < n; i0 += 64) {
        double ua[3] = {0, 0, 0};
        for (size_t i = i0; i < std::min(n, i0 + 64); ++i) cb_upper1(lw[i], w[i], thr, llo, lhi, lo, hi, ua, nlt, neq, weq);
        for (int k = 0; k < 3; ++k) tu[k].add(ua[k]);
    }
    for (int k = 0; k < 3; ++k) o.up[k] = tu[k].get();
    o.n_lt = nlt; o.n_eq = neq; o.w_eq = weq;
}

#if LD_X86
// The lower terms of the lanes of a quad whose x is clipped to lo or hi (a helper out of
// the pass's loop: its accumulators live in memory, the loop's in registers).
__attribute__((target("avx2,fma,f16c"), noinline)) void cb_clipped4(const double* lw, const double* w, __m256d clipped, __m256d xc,
                                                                     double lt, double llo, double lhi, double* acc) {
    __m256d lwv = _mm256_loadu_pd(lw), wv = _mm256_loadu_pd(w);
    __m256d lxc = _mm256_min_pd(_mm256_max_pd(_mm256_add_pd(_mm256_set1_pd(lt), lwv), _mm256_set1_pd(llo)), _mm256_set1_pd(lhi));
    _mm256_store_pd(acc, _mm256_add_pd(_mm256_load_pd(acc), _mm256_and_pd(clipped, xc)));
    _mm256_store_pd(acc + 4, _mm256_add_pd(_mm256_load_pd(acc + 4), _mm256_and_pd(clipped, _mm256_mul_pd(_mm256_sub_pd(lxc, lwv), xc))));
    _mm256_store_pd(acc + 8, _mm256_add_pd(_mm256_load_pd(acc + 8), _mm256_and_pd(clipped, _mm256_mul_pd(wv, _mm256_sub_pd(lwv, lxc)))));
    _mm256_store_pd(acc + 12, _mm256_add_pd(_mm256_load_pd(acc + 12), _mm256_and_pd(clipped, cb_js4(xc, lxc, wv, lwv))));
}

// Two loops over the rest (each with its accumulators and constants in registers: one loop
// holding both spilled them): the lower placement (w of the entries in between; the terms
// of the clipped ones) and the upper one (hi below thr, lo above it, ties counted).
__attribute__((target("avx2,fma,f16c"), noinline)) void cb_pass_lower_avx2(const double* lw, const double* w, size_t n, double lt,
                                                                  double Et, double llo, double lhi, double lo, double hi,
                                                                  bool lo_normal, CbPassOut& o) {
    const __m256d E = _mm256_set1_pd(Et), L = _mm256_set1_pd(lo), H = _mm256_set1_pd(hi), zero = _mm256_setzero_pd();
    CbSum tl[4], tw;
    int64_t nl = 0, nh = 0;
    size_t i = 0;
    while (i < n) {
        const size_t end = std::min(n, i + 64);
        __m256d wm = zero;
        alignas(32) double cacc[16] = {0};  // four lanes each of the clipped entries' sum x and three terms
        double la[4] = {0, 0, 0, 0}, wms = 0;
        for (; i + 4 <= end; i += 4) {
            __m256d wv = _mm256_loadu_pd(w + i), x = _mm256_mul_pd(E, wv);
            __m256d clipped = _mm256_or_pd(_mm256_cmp_pd(x, L, _CMP_LE_OQ), _mm256_cmp_pd(x, H, _CMP_GE_OQ));
            wm = _mm256_add_pd(wm, _mm256_andnot_pd(clipped, wv));
            if (_mm256_movemask_pd(clipped) == 0) continue;
            const unsigned ml = (unsigned)_mm256_movemask_pd(_mm256_cmp_pd(x, L, _CMP_LE_OQ));
            nl += __builtin_popcount(ml);
            nh += __builtin_popcount((unsigned)_mm256_movemask_pd(clipped) & ~ml);
            __m256d xc = _mm256_min_pd(_mm256_max_pd(x, L), H);
            bool scalar = lo_normal ? _mm256_movemask_pd(_mm256_cmp_pd(wv, zero, _CMP_GT_OQ)) != 0xF : !cb_plain4(xc, wv);
            if (scalar) {  // the clipped lanes' terms one by one (special cases: cb_phi)
                for (size_t k = i; k < i + 4; ++k) {
                    double xk = Et * w[k];
                    if (xk <= lo || xk >= hi) cb_lower1(lw[k], w[k], lt, Et, llo, lhi, lo, hi, la);
                }
                continue;
            }
            cb_clipped4(lw + i, w + i, clipped, xc, lt, llo, lhi, cacc);
        }
        for (; i < end; ++i) {
            double x = Et * w[i];
            bool l = x <= lo, h = !l && x >= hi;
            nl += l; nh += h;
            if (l || h) cb_lower1(lw[i], w[i], lt, Et, llo, lhi, lo, hi, la);
            else wms += w[i];
        }
        for (int k = 0; k < 4; ++k) tl[k].add(cacc[4 * k] + cacc[4 * k + 1] + cacc[4 * k + 2] + cacc[4 * k + 3] + la[k]);
        tw.add(hsum(wm) + wms);
    }
    for (int k = 0; k < 4; ++k) o.low[k] = tl[k].get();
    o.w_mid = tw.get();
    o.n_lo = (double)nl; o.n_hi = (double)nh;
}

// CHECK false: the caller knows every w > 0 and lo normal (every quad plain: no test)
template <bool CHECK>
__attribute__((target("avx2,fma,f16c"), noinline)) void cb_pass_upper_avx2(const double* lw, const double* w, size_t n, double thr,
                                                                  double llo, double lhi, double lo, double hi, bool lo_normal,
                                                                  CbPassOut& o) {
    const __m256d LLO = _mm256_set1_pd(llo), LHI = _mm256_set1_pd(lhi), L = _mm256_set1_pd(lo), H = _mm256_set1_pd(hi);
    const __m256d one = _mm256_set1_pd(1.0), T = _mm256_set1_pd(thr), zero = _mm256_setzero_pd();
    CbSum tu[3];
    double nlt = 0, neq = 0, weq = 0;
    __m256d clt = zero, ceq = zero;
    size_t i = 0;
    while (i < n) {
        const size_t end = std::min(n, i + 64);
        __m256d u0 = zero, u1 = zero, u2 = zero;
        double ua[3] = {0, 0, 0};
        for (; i + 4 <= end; i += 4) {
            __m256d lwv = _mm256_loadu_pd(lw + i), wv = _mm256_loadu_pd(w + i);
            __m256d full = _mm256_cmp_pd(lwv, T, _CMP_LT_OQ), eq = _mm256_cmp_pd(lwv, T, _CMP_EQ_OQ);
            __m256d xu = _mm256_blendv_pd(L, H, full), lxu = _mm256_blendv_pd(LLO, LHI, full);
            bool scalar = CHECK && (lo_normal ? _mm256_movemask_pd(_mm256_cmp_pd(wv, zero, _CMP_GT_OQ)) != 0xF : !cb_plain4(xu, wv));
            if (scalar) {
                for (size_t k = i; k < i + 4; ++k) cb_upper1(lw[k], w[k], thr, llo, lhi, lo, hi, ua, nlt, neq, weq);
                continue;
            }
            const int em = _mm256_movemask_pd(eq);
            if (em) {  // ties at thr: counted, left out of the sums
                ceq = _mm256_add_pd(ceq, _mm256_and_pd(eq, one));
                weq = w[i + __builtin_ctz((unsigned)em)];
            }
            u0 = _mm256_add_pd(u0, _mm256_andnot_pd(eq, _mm256_mul_pd(_mm256_sub_pd(lxu, lwv), xu)));
            u1 = _mm256_add_pd(u1, _mm256_andnot_pd(eq, _mm256_mul_pd(wv, _mm256_sub_pd(lwv, lxu))));
            u2 = _mm256_add_pd(u2, _mm256_andnot_pd(eq, cb_js4(xu, lxu, wv, lwv)));
            clt = _mm256_add_pd(clt, _mm256_and_pd(full, one));
        }
        for (; i < end; ++i) cb_upper1(lw[i], w[i], thr, llo, lhi, lo, hi, ua, nlt, neq, weq);
        tu[0].add(hsum(u0) + ua[0]); tu[1].add(hsum(u1) + ua[1]); tu[2].add(hsum(u2) + ua[2]);
    }
    for (int k = 0; k < 3; ++k) o.up[k] = tu[k].get();
    o.n_lt = nlt + hsum(clt); o.n_eq = neq + hsum(ceq); o.w_eq = weq;
}

// bf16 / f16 bits -> float32 (exact)
__attribute__((target("avx2,fma,f16c"))) void cb_widen_avx2(const void* base, int64_t V, int dtype, float* out) {
    int64_t v = 0;
    for (; v + 8 <= V; v += 8) _mm256_storeu_ps(out + v, dtype == F16 ? load8<F16>(base, v) : load8<BF16>(base, v));
    for (; v < V; ++v) out[v] = load1(base, v, dtype);
}
#endif

// lo normal: every x of the upper and x + w is >= lo, so a quad is plain where w > 0
inline void cb_pass_lower(const double* lw, const double* w, size_t n, double lt, double Et, double llo, double lhi, double lo,
                          double hi, CbPassOut& o) {
#if LD_X86
    if (cb_simd()) return cb_pass_lower_avx2(lw, w, n, lt, Et, llo, lhi, lo, hi, lo >= std::numeric_limits<double>::min(), o);
#endif
    cb_pass_lower_scalar(lw, w, n, lt, Et, llo, lhi, lo, hi, o);
}

inline void cb_pass_upper(const double* lw, const double* w, size_t n, double thr, double llo, double lhi, double lo, double hi,
                          bool w_pos, CbPassOut& o) {
#if LD_X86
    if (cb_simd()) {
        const bool lo_normal = lo >= std::numeric_limits<double>::min();
        if (w_pos && lo_normal) return cb_pass_upper_avx2<false>(lw, w, n, thr, llo, lhi, lo, hi, true, o);
        return cb_pass_upper_avx2<true>(lw, w, n, thr, llo, lhi, lo, hi, lo_normal, o);
    }
#endif
    cb_pass_upper_scalar(lw, w, n, thr, llo, lhi, lo, hi, o);
}

// The value at rank k (0-based, ascending) of x[0, n), k < n, all in [xmin, xmax]: a
// histogram of CB_NB bins (the bin index is monotone in x) locates its bin, nth_element
// among that bin's entries finds it.
double cb_rank(const double* x, size_t n, size_t k, double xmin, double xmax, CbScratch& S) {
    if (!(xmax > xmin)) return xmin;
    const double sc = (CB_NB - 1) / (xmax - xmin);
    S.bins.resize(n);
    int32_t* bins = S.bins.data();
#if LD_X86
    if (cb_simd()) cb_bins_avx2(x, n, xmin, sc, bins);
    else
#endif
        for (size_t i = 0; i < n; ++i) bins[i] = cb_bin(x[i], xmin, sc);
    S.hist.assign(4 * CB_NB, 0);  // four interleaved counts: no chain of increments of one slot
    uint32_t* h = S.hist.data();
    size_t i = 0;
    for (; i + 4 <= n; i += 4) {
        ++h[bins[i]];
        ++h[CB_NB + bins[i + 1]];
        ++h[2 * CB_NB + bins[i + 2]];
        ++h[3 * CB_NB + bins[i + 3]];
    }
    for (; i < n; ++i) ++h[bins[i]];
    for (int b = 0; b < CB_NB; ++b) h[b] += h[CB_NB + b] + h[2 * CB_NB + b] + h[3 * CB_NB + b];
    size_t before = 0;
    int32_t b = 0;
    for (; b < CB_NB - 1 && before + (size_t)h[b] <= k; ++b) before += (size_t)h[b];
    S.sel.resize((size_t)h[b]);
    size_t j = 0, i2 = 0;
#if LD_X86
    if (cb_simd()) i2 = cb_bin_members_avx2(x, bins, n, b, S.sel.data(), j);
#endif
    for (; i2 < n; ++i2) if (bins[i2] == b) S.sel[j++] = x[i2];
    std::nth_element(S.sel.begin(), S.sel.begin() + (k - before), S.sel.end());
    return S.sel[k - before];
}

inline void cb_band_eval(const double* w, const double* lo, const double* hi, size_t m, double Et, double& clo, double& chi,
                         double& wm) {
#if LD_X86
    if (cb_simd()) return cb_band_eval_avx2(w, lo, hi, m, Et, clo, chi, wm);
#endif
    clo = chi = wm = 0;
    for (size_t i = 0; i < m; ++i) {
        double x = Et * w[i];
        if (x <= lo[i]) clo += lo[i];
        else if (x >= hi[i]) chi += hi[i];
        else wm += w[i];
    }
}

inline void cb_band_lower(const double* lw, const double* w, const double* llo, const double* lhi, const double* lo,
                          const double* hi, size_t m, double lt, double Et, double* out) {
#if LD_X86
    if (cb_simd()) return cb_band_lower_avx2(lw, w, llo, lhi, lo, hi, m, lt, Et, out);
#endif
    CbSum t[4];
    for (size_t i = 0; i < m; ++i) {
        double acc[4] = {0, 0, 0, 0};
        cb_lower1(lw[i], w[i], lt, Et, llo[i], lhi[i], lo[i], hi[i], acc);
        for (int k = 0; k < 4; ++k) t[k].add(acc[k]);
    }
    for (int k = 0; k < 4; ++k) out[k] = t[k].get();
}

// The band's upper bound, per term t (forward KL, reverse KL, JSD): base_t = sum of the
// terms at lo (blocks of 64, compensated) and, of each entry with cap = hi - lo > 0 and a
// finite term at lo, its chord slope (phi(hi) - phi(lo)) / cap and cap, written to
// ks[t], kc[t] (cnt[t] of them): the knapsack's items. One pass for the three terms.
inline void cb_chord1(size_t i, const double* lw, const double* w, const double* llo, const double* lhi, const double* lo,
                      const double* hi, double* const* ks, double* const* kc, size_t* cnt, double* blk) {
    const double cap = hi[i] - lo[i], rc = 1.0 / cap;
    for (int t = 0; t < 3; ++t) {
        double p0 = cb_phi(t, llo[i], lw[i], lo[i], w[i]);
        blk[t] += p0;
        if (!(cap > 0) || !std::isfinite(p0)) continue;  // an infinite p0 makes base inf
        ks[t][cnt[t]] = (cb_phi(t, lhi[i], lw[i], hi[i], w[i]) - p0) * rc;
        kc[t][cnt[t]++] = cap;
    }
}

void cb_band_chords_scalar(const double* lw, const double* w, const double* llo, const double* lhi, const double* lo,
                           const double* hi, size_t m, double* const* ks, double* const* kc, double* base, size_t* cnt) {
    CbSum b[3];
    cnt[0] = cnt[1] = cnt[2] = 0;
    for (size_t i0 = 0; i0 < m; i0 += 64) {
        double blk[3] = {0, 0, 0};
        for (size_t i = i0; i < std::min(m, i0 + 64); ++i) cb_chord1(i, lw, w, llo, lhi, lo, hi, ks, kc, cnt, blk);
        for (int t = 0; t < 3; ++t) b[t].add(blk[t]);
    }
    for (int t = 0; t < 3; ++t) base[t] = b[t].get();
}

#if LD_X86
__attribute__((target("avx2,fma,f16c"))) void cb_band_chords_avx2(const double* lw, const double* w, const double* llo,
                                                                   const double* lhi, const double* lo, const double* hi,
                                                                   size_t m, double* const* ks, double* const* kc, double* base,
                                                                   size_t* cnt) {
    CbSum b[3];
    cnt[0] = cnt[1] = cnt[2] = 0;
    const __m256d zero = _mm256_setzero_pd(), one = _mm256_set1_pd(1.0);
    size_t i = 0;
    while (i < m) {
        const size_t end = std::min(m, i + 64);
        __m256d a0 = zero, a1 = zero, a2 = zero;
        double blk[3] = {0, 0, 0};
        for (; i + 4 <= end; i += 4) {
            __m256d lwv = _mm256_loadu_pd(lw + i), wv = _mm256_loadu_pd(w + i), L = _mm256_loadu_pd(lo + i),
                    H = _mm256_loadu_pd(hi + i), LL = _mm256_loadu_pd(llo + i), LH = _mm256_loadu_pd(lhi + i);
            __m256d cap = _mm256_sub_pd(H, L);
            // plain (lo > 0, w > 0, lo + w normal: every term finite, hi >= lo) with cap > 0
            if (_mm256_movemask_pd(_mm256_cmp_pd(cap, zero, _CMP_GT_OQ)) != 0xF || !cb_plain4(L, wv)) {
                for (size_t k = i; k < i + 4; ++k) cb_chord1(k, lw, w, llo, lhi, lo, hi, ks, kc, cnt, blk);
                continue;
            }
            __m256d rc = _mm256_div_pd(one, cap);
            __m256d p0 = _mm256_mul_pd(_mm256_sub_pd(LL, lwv), L), p1 = _mm256_mul_pd(_mm256_sub_pd(LH, lwv), H);
            a0 = _mm256_add_pd(a0, p0);
            _mm256_storeu_pd(ks[0] + cnt[0], _mm256_mul_pd(_mm256_sub_pd(p1, p0), rc));
            p0 = _mm256_mul_pd(wv, _mm256_sub_pd(lwv, LL)); p1 = _mm256_mul_pd(wv, _mm256_sub_pd(lwv, LH));
            a1 = _mm256_add_pd(a1, p0);
            _mm256_storeu_pd(ks[1] + cnt[1], _mm256_mul_pd(_mm256_sub_pd(p1, p0), rc));
            p0 = cb_js4(L, LL, wv, lwv); p1 = cb_js4(H, LH, wv, lwv);
            a2 = _mm256_add_pd(a2, p0);
            _mm256_storeu_pd(ks[2] + cnt[2], _mm256_mul_pd(_mm256_sub_pd(p1, p0), rc));
            for (int t = 0; t < 3; ++t) { _mm256_storeu_pd(kc[t] + cnt[t], cap); cnt[t] += 4; }
        }
        for (; i < end; ++i) cb_chord1(i, lw, w, llo, lhi, lo, hi, ks, kc, cnt, blk);
        b[0].add(hsum(a0) + blk[0]); b[1].add(hsum(a1) + blk[1]); b[2].add(hsum(a2) + blk[2]);
    }
    for (int t = 0; t < 3; ++t) base[t] = b[t].get();
}

// minimum and maximum of s[0, n); false where one is not finite (NaN or inf)
__attribute__((target("avx2,fma,f16c"))) bool cb_minmax_avx2(const double* s, size_t n, double& mn, double& mx) {
    __m256d a = _mm256_set1_pd(CB_INF), b = _mm256_set1_pd(-CB_INF), bad = _mm256_setzero_pd();
    size_t i = 0;
    for (; i + 4 <= n; i += 4) {
        __m256d v = _mm256_loadu_pd(s + i);
        a = _mm256_min_pd(a, v); b = _mm256_max_pd(b, v);
        bad = _mm256_or_pd(bad, _mm256_cmp_pd(_mm256_sub_pd(v, v), _mm256_setzero_pd(), _CMP_NEQ_UQ));  // NaN or inf
    }
    alignas(32) double x[4], y[4];
    _mm256_store_pd(x, a); _mm256_store_pd(y, b);
    bool ok = _mm256_movemask_pd(bad) == 0;
    mn = std::min(std::min(x[0], x[1]), std::min(x[2], x[3]));
    mx = std::max(std::max(y[0], y[1]), std::max(y[2], y[3]));
    for (; i < n; ++i) { ok &= s[i] - s[i] == 0.0; mn = std::min(mn, s[i]); mx = std::max(mx, s[i]); }
    return ok;
}

// bins of the knapsack's histogram, steepest first: min((smax - s) f, nb - 1), truncated
__attribute__((target("avx2,fma,f16c"))) void cb_kbins_avx2(const double* s, size_t n, double smax, double f, int nb, int32_t* out) {
    const __m256d X = _mm256_set1_pd(smax), F = _mm256_set1_pd(f), T = _mm256_set1_pd(nb - 1);
    size_t i = 0;
    for (; i + 4 <= n; i += 4) {
        __m256d v = _mm256_min_pd(_mm256_mul_pd(_mm256_sub_pd(X, _mm256_loadu_pd(s + i)), F), T);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm256_cvttpd_epi32(v));
    }
    for (; i < n; ++i) out[i] = (int32_t)std::min<double>((smax - s[i]) * f, nb - 1);
}
#endif

#if LD_X86
// cb_knapsack_soa's scan: sum s c over the items of bins below b, the items of bin b
// appended to part; returns how many items it looked at (whole quads)
__attribute__((target("avx2,fma,f16c"))) size_t cb_knap_scan_avx2(const double* s, const double* c, const int32_t* bins,
                                                                   size_t n, int b, double& gain,
                                                                   std::vector<std::pair<double, double>>& part) {
    const __m128i B = _mm_set1_epi32(b);
    __m256d g = _mm256_setzero_pd();
    size_t i = 0;
    for (; i + 4 <= n; i += 4) {
        __m128i bv = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bins + i));
        __m256d below = _mm256_castsi256_pd(_mm256_cvtepi32_epi64(_mm_cmplt_epi32(bv, B)));
        g = _mm256_fmadd_pd(_mm256_and_pd(below, _mm256_loadu_pd(s + i)), _mm256_loadu_pd(c + i), g);
        unsigned eq = (unsigned)_mm_movemask_ps(_mm_castsi128_ps(_mm_cmpeq_epi32(bv, B)));
        for (; eq; eq &= eq - 1) { size_t k = i + __builtin_ctz(eq); part.emplace_back(s[k], c[k]); }
    }
    gain += hsum(g);
    return i;
}
#endif

inline void cb_band_chords(const double* lw, const double* w, const double* llo, const double* lhi, const double* lo,
                           const double* hi, size_t m, double* const* ks, double* const* kc, double* base, size_t* cnt) {
#if LD_X86
    if (cb_simd()) return cb_band_chords_avx2(lw, w, llo, lhi, lo, hi, m, ks, kc, base, cnt);
#endif
    cb_band_chords_scalar(lw, w, llo, lhi, lo, hi, m, ks, kc, base, cnt);
}

// cb_knapsack of the items (s[i], c[i]), i < n, for many items: a histogram of the slopes
// (1,024 bins, steepest first; the bin index is monotone in s) gives the capacity and
// s-weighted capacity of whole bins, the bins before the one where the fill ends are taken
// whole, and cb_knapsack fills the rest within that bin. The same optimum (any order of
// equal slopes fills alike); slopes that are not finite go to cb_knapsack on the whole set.
double cb_knapsack_soa(const double* s, const double* c, size_t n, double rest, CbScratch& S) {
    auto all = [&]() {
        S.kpart.resize(n);
        for (size_t i = 0; i < n; ++i) S.kpart[i] = {s[i], c[i]};
        return cb_knapsack(S.kpart, rest);
    };
    if (n < 256 || !(rest > 0)) return all();
    constexpr int NB = 1024;
    double smin = CB_INF, smax = -CB_INF;
    bool finite = true;
    int32_t* bins = S.kbins.data();
#if LD_X86
    if (cb_simd()) finite = cb_minmax_avx2(s, n, smin, smax);
    else
#endif
        for (size_t i = 0; i < n; ++i) { finite &= s[i] - s[i] == 0.0; smin = std::min(smin, s[i]); smax = std::max(smax, s[i]); }
    if (!finite || !(smax > smin)) return all();
    const double f = (NB - 1) / (smax - smin);
#if LD_X86
    if (cb_simd()) cb_kbins_avx2(s, n, smax, f, NB, bins);
    else
#endif
        for (size_t i = 0; i < n; ++i) bins[i] = (int32_t)std::min<double>((smax - s[i]) * f, NB - 1);
    S.khist.assign(NB, 0.0);  // capacity per bin
    double* hist = S.khist.data();
    for (size_t i = 0; i < n; ++i) hist[bins[i]] += c[i];
    int b = 0;
    for (; b < NB && hist[b] < rest; ++b) rest -= hist[b];
    // the bins before b are taken whole: their gain sum s c; bin b's items to cb_knapsack
    S.kpart.clear();
    double gain = 0.0;
    size_t i = 0;
#if LD_X86
    if (cb_simd()) i = cb_knap_scan_avx2(s, c, bins, n, b, gain, S.kpart);
#endif
    for (; i < n; ++i) {
        if (bins[i] < b) gain += s[i] * c[i];
        else if (bins[i] == b) S.kpart.emplace_back(s[i], c[i]);
    }
    if (b == NB) return gain;  // every entry full
    return gain + cb_knapsack(S.kpart, rest);
}

// mask[id] = v for the exact and band ids of row r
inline void cb_mask(const CbArgs& A, int64_t r, uint8_t* mask, uint8_t v) {
    for (int64_t i = 0; i < A.E; ++i) { int64_t id = A.e_ids[r * A.E + i]; if (id >= 0) mask[id] = v; }
    for (int64_t i = 0; i < A.B; ++i) { int64_t id = A.b_ids[r * A.B + i]; if (id >= 0) mask[id] = v; }
}

inline void cb_shift_scale(double* la, double* e, size_t n, double shift, double scale, double& lw_min, double& lw_max,
                           double& sw, double& w_min) {
    lw_min = CB_INF; lw_max = -CB_INF; sw = 0; w_min = CB_INF;
    size_t i = 0;
#if LD_X86
    if (cb_simd()) i = cb_shift_scale_avx2(la, e, n, shift, scale, lw_min, lw_max, sw, w_min);
#endif
    for (; i < n; ++i) {
        la[i] -= shift; e[i] *= scale;
        lw_min = std::min(lw_min, la[i]); lw_max = std::max(lw_max, la[i]); sw += e[i]; w_min = std::min(w_min, e[i]);
    }
}

// One row. The candidate's ln q and q of entry v are lq[v] - shift and q[v] * scale
// (shift 0 and scale 1 where the caller gives them; the fused path's z - max and
// exp(z - max) with shift ln sum e, scale 1 / sum e).
void cb_row(const CbArgs& A, int64_t r, const double* lq, const double* q, double shift, double scale, CbScratch& S) {
    double lower[3] = {0, 0, 0}, upper[3] = {0, 0, 0};
    // ---- exact entries -------------------------------------------------------------
    CbSum ex[3];
    for (int64_t i = 0; i < A.E; ++i) {
        int64_t id = A.e_ids[r * A.E + i];
        if (id < 0) continue;
        double lx = A.e_logp ? A.e_logp[r * A.E + i] : ((double)A.e_logits[r * A.E + i] - A.e_max[r]) - A.e_ls[r];
        double x = std::exp(lx);
        for (int t = 0; t < 3; ++t) ex[t].add(cb_phi(t, lx, lq[id] - shift, x, q[id] * scale));
    }
    for (int t = 0; t < 3; ++t) upper[t] = lower[t] = ex[t].get();
    // ---- band: one group, a box per entry --------------------------------------------
    {
        S.band_size((size_t)A.B);
        size_t m = 0;
        for (int64_t i = 0; i < A.B; ++i) {
            int64_t id = A.b_ids[r * A.B + i];
            if (id < 0) continue;
            double l = lq[id] - shift;
            if (!std::isfinite(l)) continue;
            double l0, l1;
            if (A.b_lo) {
                l0 = A.b_lo[r * A.B + i];
                l1 = std::max(A.b_hi[r * A.B + i], l0);
            } else {
                const int64_t k = r * A.B + i;
                const double c = A.code_bits == 8 ? (double)static_cast<const uint8_t*>(A.b_codes)[k]
                                                  : (double)static_cast<const uint16_t*>(A.b_codes)[k];
                const double top = A.b_top[r], step = A.b_step[r];
                l0 = (top - (c + 1.0) * step) - A.slack;
                l1 = std::max(std::min((top - c * step) + A.slack, 0.0), l0);
            }
            S.lw[m] = l; S.w[m] = q[id] * scale; S.llo[m] = l0; S.lhi[m] = l1;
            ++m;
        }
        if (m) {
            cb_exp(S.llo.data(), m, S.lo.data());
            cb_exp(S.lhi.data(), m, S.hi.data());
            double slo = 0, shi = 0, sw = 0;
            double r_lo = CB_INF, r_hi = -CB_INF;
            bool some_zero = false;
            for (size_t i = 0; i < m; ++i) {
                slo += S.lo[i]; shi += S.hi[i]; sw += S.w[i];
                if (S.llo[i] > -CB_INF) r_lo = std::min(r_lo, S.llo[i] - S.lw[i]); else some_zero = true;
                r_hi = std::max(r_hi, S.lhi[i] - S.lw[i]);
            }
            double mass = std::min(std::max(A.band_mass[r], slo), shi);
            double a = (some_zero ? std::min(r_lo, r_hi - 800.0) : std::min(r_lo, r_hi)) - 1.0, b = r_hi + 1.0;
            if (!std::isfinite(a)) a = 0.0;
            if (!std::isfinite(b)) b = 1.0;
            double start = (sw > 0 && mass > 0) ? std::log(mass / sw) : 0.5 * (a + b);
            double lt = cb_root(a, b, mass, start, [&](double Et, double& clo, double& chi, double& wm) {
                cb_band_eval(S.w.data(), S.lo.data(), S.hi.data(), m, Et, clo, chi, wm);
                return clo + chi + Et * wm;
            }, slo, shi);  // every entry at lo below the bracket, at hi above it
            double Et = std::exp(lt);
            double l4[4];
            cb_band_lower(S.lw.data(), S.w.data(), S.llo.data(), S.lhi.data(), S.lo.data(), S.hi.data(), m, lt, Et, l4);
            double rest = std::max(mass - slo, 0.0);
            for (int t = 0; t < 3; ++t) lower[t] += l4[1 + t] + cb_dphi(t, lt) * (mass - l4[0]);
            // upper: each term's chord slopes and capacities in one pass, then its knapsack
            double base[3];
            size_t cnt[3];
            double* ks[3] = {S.ks[0].data(), S.ks[1].data(), S.ks[2].data()};
            double* kc[3] = {S.kc[0].data(), S.kc[1].data(), S.kc[2].data()};
            cb_band_chords(S.lw.data(), S.w.data(), S.llo.data(), S.lhi.data(), S.lo.data(), S.hi.data(), m, ks, kc, base, cnt);
            for (int t = 0; t < 3; ++t) {
                double gain = cb_knapsack_soa(ks[t], kc[t], cnt[t], rest, S), bt = base[t];
                upper[t] += std::isinf(bt) ? CB_INF : bt + (std::isfinite(bt) ? gain : 0.0);
            }
        }
    }
    // ---- rest: one group sharing one box ---------------------------------------------
    {
        double* rlw = S.rlw.p.get();
        double* rw = S.rw.p.get();
        double lw_min, lw_max, sw, w_min = 0.0;
        size_t cnt;
        if (S.rest.ready) {  // compacted by the candidate's pass (the mask set by cb_run)
            S.rest.ready = false;
            cnt = S.rest.n;
            cb_shift_scale(rlw, rw, cnt, shift, scale, lw_min, lw_max, sw, w_min);
        } else {
            cb_mask(A, r, S.mask.data(), 0);
            cnt = cb_build(lq, q, S.mask.data(), A.V, shift, scale, rlw, rw, lw_min, lw_max, sw);
            cb_mask(A, r, S.mask.data(), 1);
        }
        if (cnt) {
            double llo = A.rest_min[r], lhi = std::max(A.rest_max[r], llo);
            double lo = std::exp(llo), hi = std::exp(lhi);
            double mass = std::min(std::max(A.rest_mass[r], cnt * lo), cnt * hi);
            double a = (std::isfinite(llo) ? llo - lw_max : lhi - lw_max - 800.0) - 1.0, b = lhi - lw_min + 1.0;
            double start = (sw > 0 && mass > 0) ? std::log(mass / sw) : 0.5 * (a + b);
            // upper: hi on the n_full smallest w, lo on the others, the chord of the next one
            double cap = hi - lo, rest = std::max(mass - cnt * lo, 0.0);
            int64_t n_full = cap > 0 ? (int64_t)std::floor(rest / cap) : 0;
            n_full = std::min<int64_t>(std::max<int64_t>(n_full, 0), (int64_t)cnt);
            double part = cap > 0 ? rest - n_full * cap : 0.0;
            const bool all_hi = n_full >= (int64_t)cnt;
            // thr: ln w at rank n_full (ascending), +inf when every entry is full
            double thr = all_hi ? CB_INF : n_full == 0 ? lw_min : cb_rank(rlw, cnt, (size_t)n_full, lw_min, lw_max, S);
            CbPassOut o;
            cb_pass_upper(rlw, rw, cnt, thr, llo, lhi, lo, hi, w_min > 0, o);  // w_min > 0: every w > 0 (fused path)
            // lower: tau by the active-set iteration. Its last evaluation only confirms the
            // split (the root's split reproduces itself); the lower pass counts its own split,
            // so after two evaluations the pass runs at the next tau and, where its split is
            // the previous evaluation's, that tau is the root the iteration would return
            // (the evaluation it saves would give the same sums, hence the same tau).
            double enlo = -1, enhi = -1;
            auto eval = [&](double Et, double& clo, double& chi, double& wm) {
                cb_rest_eval(rw, cnt, Et, lo, hi, enlo, enhi, wm);
                clo = enlo * lo; chi = enhi * hi;
                return clo + chi + Et * wm;
            };
            CbRoot R(a, b, start);
            cb_root_steps(R, mass, 2, eval);
            cb_pass_lower(rlw, rw, cnt, R.lt, std::exp(R.lt), llo, lhi, lo, hi, o);
            if (!R.done && !(R.from_cand && o.n_lo == enlo && o.n_hi == enhi)) {
                cb_root_steps(R, mass, 1 << 30, eval);
                cb_pass_lower(rlw, rw, cnt, R.lt, std::exp(R.lt), llo, lhi, lo, hi, o);
            }
            const double lt = R.lt, Et = std::exp(lt);
            // the mid entries' terms from their sum of w: x ln tau, -w ln tau, w g(tau)
            double x_mid = o.w_mid > 0 ? Et * o.w_mid : 0.0;
            double lp1 = lt > 0 ? lt + std::log1p(std::exp(-lt)) : std::log1p(std::exp(lt));  // ln(1 + tau)
            double g_tau = 0.5 * (Et * (CB_LN2 + lt - lp1) + (CB_LN2 - lp1));
            double mid[3] = {x_mid * lt, -o.w_mid * lt, o.w_mid > 0 ? o.w_mid * g_tau : 0.0};
            for (int t = 0; t < 3; ++t) lower[t] += (o.low[1 + t] + mid[t]) + cb_dphi(t, lt) * (mass - (o.low[0] + x_mid));
            // ties at thr: the first n_full - n_lt of them full (equal ln w: equal terms)
            double k_full = std::min(std::max((double)n_full - o.n_lt, 0.0), o.n_eq);
            double base[3] = {o.up[0], o.up[1], o.up[2]};
            for (int t = 0; t < 3; ++t) {
                if (k_full > 0) base[t] += k_full * cb_phi(t, lhi, thr, hi, o.w_eq);
                if (o.n_eq - k_full > 0) base[t] += (o.n_eq - k_full) * cb_phi(t, llo, thr, lo, o.w_eq);
            }
            double p_lw = thr, p_w = o.w_eq;  // the partly filled entry: rank n_full
            const bool has_part = !all_hi && part > 0;
            for (int t = 0; t < 3; ++t) {
                double bt = base[t];
                double gain = has_part ? (cb_phi(t, lhi, p_lw, hi, p_w) - cb_phi(t, llo, p_lw, lo, p_w)) / cap * part : 0.0;
                upper[t] += std::isinf(bt) ? CB_INF : bt + (std::isfinite(bt) ? gain : 0.0);
            }
        }
    }
    for (int t = 0; t < 3; ++t) {
        A.lower[t * A.n + r] = lower[t];
        A.upper[t * A.n + r] = upper[t];
    }
}

void cb_run(const CbArgs& A, int threads) {
    std::atomic<int64_t> next{0};
    auto work = [&]() {
        cb_scalar_only = A.isa == 1;
        CbScratch S(A.V);
        for (int64_t r; (r = next.fetch_add(1)) < A.n;) {
            if (A.z == nullptr) { cb_row(A, r, A.lq + r * A.ld, A.q + r * A.ld, 0.0, 1.0, S); continue; }
            double* st = A.stats + 3 * r;
            cb_mask(A, r, S.mask.data(), 0);  // the candidate's pass compacts the rest
            const bool ok = cb_candidate(A, r, S, st);
            cb_mask(A, r, S.mask.data(), 1);
            if (!ok) {
                S.rest.ready = false;
                A.bad[r] = 1;
                const double nan = std::numeric_limits<double>::quiet_NaN();
                st[0] = st[1] = st[2] = nan;
                for (int t = 0; t < 3; ++t) A.lower[t * A.n + r] = A.upper[t * A.n + r] = nan;
                for (int j = 0; j < A.kk; ++j) A.top_ids[r * A.kk + j] = 0;
                continue;
            }
            A.bad[r] = 0;
            double sum = std::exp(st[1]);  // e / sum e: the reciprocal of sum e once
            cb_row(A, r, S.a.p.get(), S.e.p.get(), st[1], 1.0 / sum, S);
        }
    };
    int nt = (int)std::min<int64_t>(threads, std::max<int64_t>(A.n, 1));
    std::vector<std::thread> pool;
    for (int t = 1; t < nt; ++t) pool.emplace_back(work);
    work();
    for (auto& t : pool) t.join();
    cb_scalar_only = false;
}

bool cb_ids_ok(int64_t n, int64_t V, int64_t E, const int64_t* e_ids, int64_t B, const int64_t* b_ids) {
    for (int64_t i = 0; i < n * E; ++i) if (e_ids[i] >= V) return false;
    for (int64_t i = 0; i < n * B; ++i) if (b_ids[i] >= V) return false;
    return true;
}

}  // namespace

extern "C" {

// Intervals of forward KL, reverse KL and JSD (rows of lower/upper [3, n], before the
// clamps of bounds._interval) of a compact reference against a full candidate: lq, q
// [n, V] (row stride ld) the candidate's log-probabilities and probabilities; the
// reference's exact entries (ids < 0: absent) with their log-probabilities, band ids with
// their boxes, the band and rest masses and the rest's box. Returns 0, or 1 for bad
// arguments.
__attribute__((visibility("default"))) int logitdiff_compact_bounds(
    int64_t n, int64_t V, const double* lq, const double* q, int64_t ld, int64_t E, const int64_t* e_ids,
    const double* e_logp, int64_t B, const int64_t* b_ids, const double* b_lo, const double* b_hi,
    const double* band_mass, const double* rest_mass, const double* rest_max, const double* rest_min, int threads,
    double* lower, double* upper) {
    if (n < 0 || V < 1 || ld < V || E < 0 || B < 0 || threads < 1) return 1;
    if (!cb_ids_ok(n, V, E, e_ids, B, b_ids)) return 1;
    CbArgs A{n, V, ld, lq, q, E, e_ids, e_logp, B, b_ids, b_lo, b_hi, band_mass, rest_mass, rest_max, rest_min, lower, upper,
             nullptr, 0, 0, nullptr, nullptr, nullptr};
    cb_run(A, threads);
    return 0;
}

// The same from the candidate's raw logits z [n, V] (row stride ld; dtype 0 float32,
// 1 bf16 bits, 2 f16 bits) and the reference in its stored form (compact.encode's arrays:
// exact logits float32 with the row's max logit and ln sum exp, band codes of code_bits
// 8 or 16 with the row's band_top and band_step, boxes widened by slack; rest_max and
// rest_min as compact.decode gives them; isa 0 auto, 1 scalar, 2 avx2), with the candidate's per-row max, ln sum
// exp(z - max) and entropy (stats [n, 3]), top-kk ids (top_ids [n, kk]) and bad[n] = 1 for
// a row holding NaN/inf (its outputs NaN). Returns 0, or 1 for bad arguments.
__attribute__((visibility("default"))) int logitdiff_compact_rows(
    int64_t n, int64_t V, const void* z, int64_t ld, int dtype, int64_t E, const int64_t* e_ids, const float* e_logits,
    const double* e_max, const double* e_ls, int64_t B, const int64_t* b_ids, const void* b_codes, int code_bits,
    const double* b_top, const double* b_step, double slack, const double* band_mass, const double* rest_mass,
    const double* rest_max, const double* rest_min, int kk, int threads, int isa, double* lower, double* upper,
    double* stats, int64_t* top_ids, int32_t* bad) {
    if (n < 0 || V < 1 || ld < V || E < 0 || B < 0 || threads < 1 || kk < 0 || kk > V) return 1;
    if (dtype != F32 && dtype != BF16 && dtype != F16) return 1;
    if (code_bits != 8 && code_bits != 16) return 1;
    if (isa < 0 || isa > 2 || (isa == 2 && !cb_simd())) return 1;
    if (!cb_ids_ok(n, V, E, e_ids, B, b_ids)) return 1;
    CbArgs A{n, V, ld, nullptr, nullptr, E, e_ids, nullptr, B, b_ids, nullptr, nullptr, band_mass, rest_mass, rest_max, rest_min,
             lower, upper, z, dtype, kk, stats, top_ids, bad};
    A.e_logits = e_logits; A.e_max = e_max; A.e_ls = e_ls;
    A.b_codes = b_codes; A.code_bits = code_bits; A.b_top = b_top; A.b_step = b_step; A.slack = slack;
    A.isa = isa;
    cb_run(A, threads);
    return 0;
}

}  // extern "C"

// The functions are reached through ctypes (logitdiff/kernel.py), so the library needs no
// Python headers (a machine without python3-dev still builds it); where they are present
// it is also an importable (empty) module.
#if __has_include(<Python.h>)
#include <Python.h>
static struct PyModuleDef kernel_module = {PyModuleDef_HEAD_INIT, "_kernel", "compiled full_vocab kernel (ctypes)", -1,
                                           nullptr};
PyMODINIT_FUNC PyInit__kernel(void) { return PyModule_Create(&kernel_module); }
#endif
