// The AVX-512 BF16 instruction's rate on this CPU, against which the hidden decode
// (_kernel.cpp, "AVX-512 BF16 decode") is read (issue 28 item 3): a bare VDPBF16PS loop (12
// independent zmm accumulators, no loads), the decode's inner structure (2 x RB accumulators
// of 16 entries, chains of KB instructions added into a total whose |t| is summed after each
// chain: hb_block) with its head group in L1 (one group) or streamed from L2 (a whole 256 KB
// tile), and the register-blocking variants RB 6 and KB 6. GMAC per CPU second of the thread
// (CLOCK_THREAD_CPUTIME_ID: the figure holds on a loaded machine as long as the thread runs
// alone on its core while it runs). 32 multiply-adds per instruction (16 lanes x 2 bf16 pairs).
//
//     g++ -O3 -std=c++17 bench/vdpbf16ps_bare.cpp -o /tmp/vdpbf16ps_bare && /tmp/vdpbf16ps_bare
#include <immintrin.h>
#include <cstdio>
#include <ctime>
#include <cstdint>
static double cpu() { timespec t; clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
__attribute__((target("avx512f,avx512bf16,avx512bw,avx512vl"), noinline)) float bare(long iters) {
    __m512 a[12]; for (int i = 0; i < 12; ++i) a[i] = _mm512_setzero_ps();
    __m512bh x = (__m512bh)_mm512_set1_epi32(0x3f803f80), y = (__m512bh)_mm512_set1_epi32(0x3f003f00);
    for (long k = 0; k < iters; ++k) {
        for (int i = 0; i < 12; ++i) a[i] = _mm512_dpbf16_ps(a[i], x, y);
        __asm__ volatile("" : "+v"(x));
    }
    __m512 s = a[0]; for (int i = 1; i < 12; ++i) s = _mm512_add_ps(s, a[i]);
    return _mm512_reduce_add_ps(s);
}
// the decode's structure: 2 x RB accumulators, chains of KB steps, tot += acc; err += |tot|
template <int RB, int KB>
__attribute__((target("avx512f,avx512bf16,avx512bw,avx512vl"), noinline)) float chain(const uint32_t* w, const uint32_t* h, long H2, long reps) {
    __m512 out = _mm512_setzero_ps();
    for (long r = 0; r < reps; ++r) {
        __m512 tot[2][RB], err[2][RB], acc[2][RB];
        for (int i = 0; i < 2; ++i) for (int j = 0; j < RB; ++j) tot[i][j] = err[i][j] = _mm512_setzero_ps();
        for (long k = 0; k + KB <= H2; k += KB) {
            for (int i = 0; i < 2; ++i) for (int j = 0; j < RB; ++j) acc[i][j] = _mm512_setzero_ps();
            for (int c = 0; c < KB; ++c) {
                const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + (k + c) * 32);
                const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + (k + c) * 32 + 16);
                for (int j = 0; j < RB; ++j) {
                    const __m512bh hb = (__m512bh)_mm512_set1_epi32((int)h[j * H2 + k + c]);
                    acc[0][j] = _mm512_dpbf16_ps(acc[0][j], w0, hb);
                    acc[1][j] = _mm512_dpbf16_ps(acc[1][j], w1, hb);
                }
            }
            for (int i = 0; i < 2; ++i) for (int j = 0; j < RB; ++j) { tot[i][j] = _mm512_add_ps(tot[i][j], acc[i][j]); err[i][j] = _mm512_add_ps(err[i][j], _mm512_abs_ps(tot[i][j])); }
        }
        for (int i = 0; i < 2; ++i) for (int j = 0; j < RB; ++j) out = _mm512_add_ps(out, _mm512_add_ps(tot[i][j], err[i][j]));
        __asm__ volatile("" : "+v"(out));
    }
    return _mm512_reduce_add_ps(out);
}
static uint32_t W[288 * 32 * 8], Hh[16 * 288];
template <int RB, int KB> void runL2(const char* name, long H2, int groups) {
    long reps = 20000000L / H2 / groups;
    double t0 = cpu(); float s = 0; for (long r = 0; r < reps; ++r) for (int g = 0; g < groups; ++g) s += chain<RB, KB>(W + g * H2 * 32, Hh, H2, 1); double t = cpu() - t0;
    double macs = (double)reps * groups * H2 * 2.0 * 16 * 2 * RB;
    printf("%s H2=%ld groups=%d (%ld KB): %.1f GMAC/cpu-s (%g)\n", name, H2, groups, H2 * 32 * 4 * groups / 1024, macs / t / 1e9, s);
}
template <int RB, int KB> void run(const char* name, long H2) {
    long reps = 20000000L / H2;
    double t0 = cpu(); float s = chain<RB, KB>(W, Hh, H2, reps); double t = cpu() - t0;
    const double macs = (double)reps * H2 * 2.0 * 16 * 2 * RB;  // 2 MAC per lane and instruction, 16 lanes x 2 vectors x RB rows
    printf("%s H2=%ld: %.1f GMAC/cpu-s (%g)\n", name, H2, macs / t / 1e9, s);
}
int main() {
    for (int i = 0; i < 288 * 32 * 8; ++i) W[i] = 0x3f803f80u; for (int i = 0; i < 16 * 288; ++i) Hh[i] = 0x3c003c00u;
    for (int rep = 0; rep < 2; ++rep) {
        long it = 100000000; double t0 = cpu(); float s = bare(it); double t = cpu() - t0;
        printf("bare 12 acc: %.1f GMAC/cpu-s (%g)\n", it * 12.0 * 32 / t / 1e9, s);
        run<4, 3>("RB4 KB3", 288); run<4, 3>("RB4 KB3", 64);
        run<6, 3>("RB6 KB3", 288); run<6, 3>("RB6 KB3", 64);
        run<4, 6>("RB4 KB6", 288);
        runL2<4, 3>("L2 RB4 KB3", 288, 7); runL2<4, 3>("L2 RB4 KB3", 64, 32); runL2<4, 3>("L1 RB4 KB3", 288, 1);
    }
}
