/* Probe for a design not built yet: quantized products from exact integer group sums ("digits").
 *
 *   cc -O3 -march=native -ffp-contract=off -fopenmp -std=gnu11 -Wno-psabi -Isrc/ternlm/kernels \
 *      benchmarks/digits_probe.c -o /tmp/digits_probe -lm && /tmp/digits_probe [warm]
 *
 * The idea (benchmarks/RESULTS.md, "activations as exact integer parts"): each group of 32 activations
 * becomes a power of two times three signed 8-bit digits (q = d0 * 2^16 + d1 * 2^8 + d2, |q| < 2^23:
 * 23 bits of the group's largest value). A digit times a code is a small integer and a group's sum of
 * 32 of them stays below 2^24, so every instruction that adds them in fp32 (AMX TDPBF16PS, AVX-512
 * VDPBF16PS, plain FMAs) gets the exact sum in any order; the same bits on every path and every M.
 *
 * 1. Rounding (AMX hosts): TDPBF16PS on arbitrary bf16 data against sequential fp32 models of it (it
 *    matches none, so an AVX-512 path cannot reproduce an AMX product of fp32-derived parts), and on
 *    integer digits against the exact sums (it matches them, as VDPBF16PS does).
 * 2. Speed at M = 1 (decode), Q4_0 matrices of smollm2's and qwen2.5-0.5b's shapes: qmatmul.c's AVX-512
 *    path (the product the engine runs today) against a digits GEMV over weights repacked 16 rows
 *    interleaved (lanes = weight rows: a group's sum is a lane's own, no horizontal sum), codes widened
 *    to bf16 by one vpermw and multiplied by VDPBF16PS. Checks the digits GEMV bit for bit against a
 *    scalar model of the same formula (integer sums) and both against float64.
 * 3. Speed at M = 256 (a prefill chunk; AMX hosts): the engine's kernel against the same formula on AMX
 *    tiles (per 16 rows x 16 weight rows x group: three TDPBF16PS, one a digit, then the GEMV's epilogue
 *    lane by lane), the rows' digitizing (AVX-512, checked equal to the scalar one) timed apart, and checks
 *    that every row it computes has the decode GEMV's bits.
 * Timing and checks for this machine only; not a test, not part of the product. Writes nothing.
 */
#include "qmatmul.c"     /* the engine's kernel, as the engine builds it (AVX-512 path here) */
#include "probe_common.h"

#include <math.h>
#include <stdio.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#if !(defined(__AVX512BF16__) && defined(__AVX512BW__))
int main(void) { puts("needs AVX-512 BF16 (this probe's digits GEMV)"); return 0; }
#else

static uint16_t bf16_trunc(float f) { uint32_t u; memcpy(&u, &f, 4); return (uint16_t)(u >> 16); }
static float bf16_val(uint16_t b) { uint32_t u = (uint32_t)b << 16; float f; memcpy(&f, &u, 4); return f; }

/* ---- 1. AMX rounding --------------------------------------------------------------------------- */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
typedef struct { uint8_t palette, start; uint8_t res[14]; uint16_t colsb[16]; uint8_t rows[16]; } ProbeTileCfg;

static void amx_rounding(void) {
    if (syscall(SYS_arch_prctl, 0x1023, 18)) { puts("1. AMX: the OS did not grant the tiles"); return; }
    ProbeTileCfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 3; t++) { cfg.colsb[t] = 64; cfg.rows[t] = 16; }
    _tile_loadconfig(&cfg);
    long n = 0, miss_even = 0, miss_odd = 0, miss_exact = 0, miss_int = 0, n_int = 0;
    for (int trial = 0; trial < 2000; trial++) {
        uint16_t A[16][32], B[16][32];
        float C[16][16] = {{0}};
        int digits = trial & 1, ia[16][32], ib[16][32];
        for (int m = 0; m < 16; m++)
            for (int k = 0; k < 32; k++) {
                ia[m][k] = (int)(rnd() % 257) - 128;
                A[m][k] = digits ? bf16_trunc((float)ia[m][k]) : bf16_trunc(frand() * ldexpf(1.0f, (int)(rnd() % 20) - 10));
            }
        for (int k = 0; k < 16; k++)
            for (int j = 0; j < 32; j++) { ib[k][j] = (int)(rnd() % 256) - 128; B[k][j] = bf16_trunc((float)ib[k][j]); }
        _tile_loadd(0, C, 64);
        _tile_loadd(1, A, 64);
        _tile_loadd(2, B, 64);
        _tile_dpbf16ps(0, 1, 2);
        _tile_stored(0, C, 64);
        for (int m = 0; m < 16; m++)
            for (int j = 0; j < 16; j++) {
                float even = 0.0f, odd = 0.0f;
                double exact = 0.0;
                long isum = 0;
                for (int k = 0; k < 16; k++) {
                    float p0 = bf16_val(A[m][2 * k]) * bf16_val(B[k][2 * j]);
                    float p1 = bf16_val(A[m][2 * k + 1]) * bf16_val(B[k][2 * j + 1]);
                    even = even + p0; even = even + p1;
                    odd = odd + p1; odd = odd + p0;
                    exact += (double)p0 + (double)p1;
                    isum += (long)ia[m][2 * k] * ib[k][2 * j] + (long)ia[m][2 * k + 1] * ib[k][2 * j + 1];
                }
                float ex = (float)exact, in = (float)isum;
                if (digits) {
                    n_int++;
                    miss_int += memcmp(&in, &C[m][j], 4) != 0;
                } else {
                    n++;
                    miss_even += memcmp(&even, &C[m][j], 4) != 0;
                    miss_odd += memcmp(&odd, &C[m][j], 4) != 0;
                    miss_exact += memcmp(&ex, &C[m][j], 4) != 0;
                }
            }
    }
    _tile_release();
    printf("1. AMX TDPBF16PS, 16 x 16 x 32 tiles\n"
           "   arbitrary bf16 (exact products): differs from sequential fp32 even-first in %ld of %ld, "
           "odd-first %ld, exact-then-round %ld\n"
           "   integer digits x codes in [-128, 128): differs from the exact sum in %ld of %ld\n",
           miss_even, n, miss_odd, miss_exact, miss_int, n_int);
}
#else
static void amx_rounding(void) { puts("1. AMX: not an AMX build"); }
#endif

/* 2^e exactly (ldexpf's value; no libm call in the epilogue's loop) */
static inline float pow2f(int e) {
    if (e < -126 || e > 127) return ldexpf(1.0f, e);
    uint32_t u = (uint32_t)(e + 127) << 23;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* ---- 2. a digits GEMV ---------------------------------------------------------------------------- */
/* x (K) -> per group of 32: exponent e (max |x| < 2^e) and three digit vectors as bf16 pairs, the form
 * VDPBF16PS broadcasts: xd[(g * 3 + part) * 16 + k] = (digit 2k, digit 2k+1). */
static void digitize(const float *x, int64_t K, uint32_t *xd, int *xe) {
    for (int64_t g = 0; g < K / 32; g++) {
        float m = 0.0f;
        for (int i = 0; i < 32; i++) m = fmaxf(m, fabsf(x[32 * g + i]));
        int e;
        frexpf(m, &e);                             /* m < 2^e */
        xe[g] = e;
        int d[3][32];
        const float up = pow2f(23 - e);                /* exact: x * 2^(23 - e) rounds nothing */
        for (int i = 0; i < 32; i++) {
            int32_t q = (int32_t)rintf(x[32 * g + i] * up);   /* |q| <= 2^23 */
            int32_t d2 = ((q + 128) & 255) - 128, q1 = (q - d2) / 256;
            int32_t d1 = ((q1 + 128) & 255) - 128, d0 = (q1 - d1) / 256;
            d[0][i] = d0; d[1][i] = d1; d[2][i] = d2;
        }
        for (int p = 0; p < 3; p++)
            for (int k = 0; k < 16; k++)
                xd[(g * 3 + p) * 16 + k] = bf16_trunc((float)d[p][2 * k]) | (uint32_t)bf16_trunc((float)d[p][2 * k + 1]) << 16;
    }
}

/* GGML Q4_0 (codes (N, K/2): byte j of a group = element j low nibble, j + 16 high; fp16 d per group)
 * -> 16 rows interleaved: per (block of 16 rows, group, pair k) 16 bytes, byte n = element 2k of row n
 * (low nibble) and 2k + 1 (high); scales per (block, group) 16 fp16. N a multiple of 16. */
static void repack(const uint8_t *codes, const uint16_t *d, int64_t N, int64_t K, uint8_t *pc, uint16_t *pd) {
    const int64_t G = K / 32;
    for (int64_t nb = 0; nb < N / 16; nb++)
        for (int64_t g = 0; g < G; g++) {
            for (int k = 0; k < 16; k++)
                for (int n = 0; n < 16; n++) {
                    int c0 = q4_code(codes, K, nb * 16 + n, 32 * g + 2 * k), c1 = q4_code(codes, K, nb * 16 + n, 32 * g + 2 * k + 1);
                    pc[((nb * G + g) * 16 + k) * 16 + n] = (uint8_t)(c0 | c1 << 4);
                }
            for (int n = 0; n < 16; n++) pd[(nb * G + g) * 16 + n] = d[(nb * 16 + n) * G + g];
        }
}

/* The epilogue every path shares: a group's three exact sums -> one value, then scaled into acc. */
#define COMBINE(s0, s1, s2) ((s0) * 65536.0f + (s1) * 256.0f + (s2))

#ifndef PF_DIGITS
#define PF_DIGITS 4096   /* bytes ahead in a thread's stream of repacked codes (the engine prefetches too) */
#endif
static void gemv_digits(const uint32_t *xd, const int *xe, const uint8_t *pc, const uint16_t *pd, int64_t N, int64_t K,
                        float *y, int nthreads) {
    const int64_t G = K / 32;
    /* bf16 of c - 8 for c = 0..15 (words 16..31 unused) */
    uint16_t lut[32];
    for (int c = 0; c < 32; c++) lut[c] = bf16_trunc((float)((c & 15) - 8));
    const __m512i table = _mm512_loadu_si512(lut);
    float *xs = malloc(G * sizeof(float));          /* 2^(e - 23) per group, once per call */
    for (int64_t g = 0; g < G; g++) xs[g] = ldexpf(1.0f, xe[g] - 23);
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t nb = 0; nb < N / 16; nb++) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t g = 0; g < G; g++) {
            const uint8_t *b = pc + (nb * G + g) * 256;
            const uint32_t *xg = xd + g * 48;
            /* four accumulators per digit (pairs k = 4i + a): the sums are exact integers, so any
             * split and order gives the same value, and 12 independent chains hide VDPBF16PS's latency */
            __m512 a[3][4];
            for (int p = 0; p < 3; p++)
                for (int j = 0; j < 4; j++) a[p][j] = _mm512_setzero_ps();
#pragma GCC unroll 16
            for (int k = 0; k < 16; k++) {
                if ((k & 3) == 0) _mm_prefetch((const char *)(b + 16 * k + PF_DIGITS), _MM_HINT_T0);
                __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + 16 * k)));
                /* dword n: low nibble -> word 0's index, high nibble -> word 1's */
                __m512i idx = _mm512_ternarylogic_epi32(v, _mm512_slli_epi32(v, 12), _mm512_set1_epi32(0x000F000F), 0xA8);
                __m512bh w = (__m512bh)_mm512_permutexvar_epi16(idx, table);
#pragma GCC unroll 3
                for (int p = 0; p < 3; p++)
                    a[p][k & 3] = _mm512_dpbf16_ps(a[p][k & 3], w, (__m512bh)_mm512_set1_epi32((int)xg[16 * p + k]));
            }
            __m512 s0 = _mm512_add_ps(_mm512_add_ps(a[0][0], a[0][1]), _mm512_add_ps(a[0][2], a[0][3]));
            __m512 s1 = _mm512_add_ps(_mm512_add_ps(a[1][0], a[1][1]), _mm512_add_ps(a[1][2], a[1][3]));
            __m512 s2 = _mm512_add_ps(_mm512_add_ps(a[2][0], a[2][1]), _mm512_add_ps(a[2][2], a[2][3]));
            __m512 v = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(s0, _mm512_set1_ps(65536.0f)),
                                                   _mm512_mul_ps(s1, _mm512_set1_ps(256.0f))), s2);
            __m512 sc = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(pd + (nb * G + g) * 16))),
                                      _mm512_set1_ps(xs[g]));
            acc = _mm512_fmadd_ps(sc, v, acc);
        }
        _mm512_storeu_ps(y + 16 * nb, acc);
    }
    free(xs);
}

/* The same formula, scalar, from integer sums: what any path (AMX, VDPBF16PS, FMAs) must give. */
static float digits_model(const uint32_t *xd, const int *xe, const uint8_t *codes, const uint16_t *d, int64_t K, int64_t n) {
    const int64_t G = K / 32;
    float acc = 0.0f;
    for (int64_t g = 0; g < G; g++) {
        long s[3] = {0, 0, 0};
        for (int p = 0; p < 3; p++)
            for (int e = 0; e < 32; e++) {
                int c = q4_code(codes, K, n, 32 * g + e);
                uint32_t pr = xd[(g * 3 + p) * 16 + e / 2];
                int dg = (int)bf16_val((uint16_t)(e & 1 ? pr >> 16 : pr & 0xFFFF));
                s[p] += (long)(c - 8) * dg;
            }
        float v = COMBINE((float)s[0], (float)s[1], (float)s[2]);
        float sc = half_to_float(d[n * G + g]) * ldexpf(1.0f, xe[g] - 23);
        acc = fmaf(sc, v, acc);
    }
    return acc;
}


/* ---- 3. a digits GEMM on AMX tiles (prefill) -------------------------------------------------------- */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
/* Rows x (M, K) -> A tiles: at[((mb * G + g) * 3 + p) * 512 + r * 32 + e] = digit p of element e of group g
 * of row mb * 16 + r, as bf16 (a tile row is one group: 32 bf16 = 64 bytes); xe[row * G + g] its exponent.
 * The digits are digitize()'s, row by row (rows past M: zero). */
static void digitize_rows(const float *x, int64_t M, int64_t K, uint16_t *at, int *xe) {
    const int64_t G = K / 32, MB = (M + 15) / 16;
    uint32_t *xd = malloc(G * 48 * 4);
    memset(at, 0, (size_t)MB * G * 3 * 512 * 2);
    for (int64_t m = 0; m < M; m++) {
        digitize(x + m * K, K, xd, xe + m * G);
        for (int64_t g = 0; g < G; g++)
            for (int p = 0; p < 3; p++)
                memcpy(at + (((m / 16) * G + g) * 3 + p) * 512 + (m % 16) * 32, xd + (g * 3 + p) * 16, 64);
    }
    free(xd);
}

/* digitize_rows' digits, 16 lanes at a time and rows split over the threads: the same values (the
 * product x * 2^(23 - e) is exact and cvtps rounds to nearest even as rintf does; the digits are integer
 * operations; a small integer converts to bf16 exactly). What a product would pay per input. */
static void digitize_rows_vec(const float *x, int64_t M, int64_t K, uint16_t *at, int *xe, int nthreads) {
    const int64_t G = K / 32, MB = (M + 15) / 16;
    if (M % 16) memset(at, 0, (size_t)MB * G * 3 * 512 * 2);   /* rows past M: zero digits */
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < G; g++) {
            const float *xg = x + m * K + 32 * g;
            __m512 v0 = _mm512_loadu_ps(xg), v1 = _mm512_loadu_ps(xg + 16);
            float mx = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
            int e;
            frexpf(mx, &e);
            xe[m * G + g] = e;
            const __m512 up = _mm512_set1_ps(pow2f(23 - e));
            __m512i q[2] = {_mm512_cvtps_epi32(_mm512_mul_ps(v0, up)), _mm512_cvtps_epi32(_mm512_mul_ps(v1, up))};
            __m512 dg[3][2];
            for (int h = 0; h < 2; h++) {
                const __m512i c128 = _mm512_set1_epi32(128), c255 = _mm512_set1_epi32(255);
                __m512i d2 = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(q[h], c128), c255), c128);
                __m512i q1 = _mm512_srai_epi32(_mm512_sub_epi32(q[h], d2), 8);      /* exact: a multiple of 256 */
                __m512i d1 = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(q1, c128), c255), c128);
                __m512i d0 = _mm512_srai_epi32(_mm512_sub_epi32(q1, d1), 8);
                dg[0][h] = _mm512_cvtepi32_ps(d0);
                dg[1][h] = _mm512_cvtepi32_ps(d1);
                dg[2][h] = _mm512_cvtepi32_ps(d2);
            }
            for (int p = 0; p < 3; p++)
                _mm512_storeu_si512(at + (((m / 16) * G + g) * 3 + p) * 512 + (m % 16) * 32,
                                    (__m512i)_mm512_cvtne2ps_pbh(dg[p][1], dg[p][0]));
        }
}

/* y (M, N) = the digits formula, on tiles: per (16 rows, 16 weight rows, group) three TDPBF16PS (one per
 * digit, each an exact integer sum), then gemv_digits' epilogue lane by lane (lanes = weight rows). The
 * codes of a weight block are widened to bf16 B tiles once for all row blocks. Same value as the GEMV for
 * every row. at/xe from digitize_rows. */
static void gemm_digits_amx(const uint16_t *at, const int *xe, const uint8_t *pc, const uint16_t *pd, int64_t M,
                            int64_t N, int64_t K, float *y, int nthreads) {
    const int64_t G = K / 32, MB = (M + 15) / 16;
    uint16_t lut[32];
    for (int c = 0; c < 32; c++) lut[c] = bf16_trunc((float)((c & 15) - 8));
    const __m512i table = _mm512_loadu_si512(lut);
    #pragma omp parallel num_threads(nthreads)
    {
        ProbeTileCfg cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.palette = 1;
        for (int t = 0; t < 7; t++) { cfg.colsb[t] = 64; cfg.rows[t] = 16; }
        _tile_loadconfig(&cfg);
        uint16_t *bt = aligned_alloc(64, (size_t)G * 512 * 2);     /* a weight block's B tiles, every group */
        float (*c)[16][16] = aligned_alloc(64, 3 * 16 * 16 * 4);
        #pragma omp for schedule(static)
        for (int64_t nb = 0; nb < N / 16; nb++) {
            for (int64_t g = 0; g < G; g++)
                for (int k = 0; k < 16; k++) {
                    __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(pc + (nb * G + g) * 256 + 16 * k)));
                    __m512i idx = _mm512_ternarylogic_epi32(v, _mm512_slli_epi32(v, 12), _mm512_set1_epi32(0x000F000F), 0xA8);
                    _mm512_store_si512(bt + g * 512 + k * 32, _mm512_permutexvar_epi16(idx, table));
                }
            for (int64_t mb = 0; mb < MB; mb++) {
                __m512 acc[16];
                for (int r = 0; r < 16; r++) acc[r] = _mm512_setzero_ps();
                for (int64_t g = 0; g < G; g++) {
                    const uint16_t *a = at + ((mb * G + g) * 3) * 512;
                    _tile_zero(0); _tile_zero(1); _tile_zero(2);
                    _tile_loadd(6, bt + g * 512, 64);
                    _tile_loadd(3, a, 64);
                    _tile_loadd(4, a + 512, 64);
                    _tile_loadd(5, a + 1024, 64);
                    _tile_dpbf16ps(0, 3, 6);
                    _tile_dpbf16ps(1, 4, 6);
                    _tile_dpbf16ps(2, 5, 6);
                    _tile_stored(0, c[0], 64);
                    _tile_stored(1, c[1], 64);
                    _tile_stored(2, c[2], 64);
                    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(pd + (nb * G + g) * 16)));
                    for (int r = 0; r < 16; r++) {
                        int64_t m = mb * 16 + r;
                        float e2 = m < M ? pow2f(xe[m * G + g] - 23) : 0.0f;
                        __m512 v = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(_mm512_load_ps(c[0][r]), _mm512_set1_ps(65536.0f)),
                                                               _mm512_mul_ps(_mm512_load_ps(c[1][r]), _mm512_set1_ps(256.0f))),
                                                 _mm512_load_ps(c[2][r]));
                        acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(e2)), v, acc[r]);
                    }
                }
                for (int r = 0; r < 16 && mb * 16 + r < M; r++) _mm512_storeu_ps(y + (mb * 16 + r) * N + 16 * nb, acc[r]);
            }
        }
        free(bt);
        free(c);
        _tile_release();
    }
}

static void amx_gemm(void) {
    if (syscall(SYS_arch_prctl, 0x1023, 18)) { puts("3. AMX: the OS did not grant the tiles"); return; }
    const int64_t M = 256;
    const int threads = 2, reps = 15;
    puts("3. Q4_0 products at M = 256 (a prefill chunk), 2 threads, median of 15: the engine's AVX-512 kernel against "
         "digits on AMX tiles (the digitizing of the rows, AVX-512 on both threads, timed apart)");
    for (int s = 0; s < NSHAPES; s++) {
        const int64_t N = SHAPES[s][0], K = SHAPES[s][1], G = K / 32;
        uint8_t *codes = malloc(N * K / 2), *pc = malloc(N * K / 2);
        uint16_t *d = malloc(N * G * 2), *pd = malloc(N * G * 2), *at = malloc((size_t)(M / 16) * G * 3 * 512 * 2);
        float *x = malloc(M * K * 4), *y0 = malloc(M * N * 4), *y1 = malloc(M * N * 4), *y2 = malloc(N * 4), bias = -8.0f;
        int *xe = malloc(M * G * sizeof(int)), *xe1 = malloc(G * sizeof(int));
        uint32_t *xd = malloc(G * 48 * 4);
        random_q4_0(codes, d, N, K);
        random_x(x, M * K);
        repack(codes, d, N, K, pc, pd);
        digitize_rows(x, M, K, at, xe);
        uint16_t *at2 = malloc((size_t)(M / 16) * G * 3 * 512 * 2);
        int *xe2 = malloc(M * G * sizeof(int));
        digitize_rows_vec(x, M, K, at2, xe2, threads);
        if (memcmp(at, at2, (size_t)(M / 16) * G * 3 * 512 * 2) || memcmp(xe, xe2, M * G * sizeof(int)))
            printf("   %s: the vector digitizing differs from the scalar one\n", NAMES[s]);
        free(at2);
        free(xe2);
        gemm_digits_amx(at, xe, pc, pd, M, N, K, y1, threads);
        /* the same bits as the decode GEMV (VDPBF16PS) for every row checked, and near the fp32 path */
        long cross = 0;
        double worst = 0, ymax = 0;
        tq_q4g32_f16s_mm(x, M, K, codes, NULL, d, &bias, NULL, N, y0, N, threads);
        for (int64_t m = 0; m < M; m += 17) {
            digitize(x + m * K, K, xd, xe1);
            gemv_digits(xd, xe1, pc, pd, N, K, y2, threads);
            cross += memcmp(y2, y1 + m * N, N * 4) != 0;
        }
        for (int64_t i = 0; i < M * N; i++) { worst = fmax(worst, fabs(y1[i] - y0[i])); ymax = fmax(ymax, fabs(y0[i])); }
        double t0[15], t1[15], t2[15];
        for (int r = 0; r < reps; r++)
            for (int i = 0; i < 2; i++) {
                double t = now();
                if ((r + i) & 1) {
                    digitize_rows_vec(x, M, K, at, xe, threads);
                    t2[r] = now() - t;
                    t = now();
                    gemm_digits_amx(at, xe, pc, pd, M, N, K, y1, threads);
                } else {
                    tq_q4g32_f16s_mm(x, M, K, codes, NULL, d, &bias, NULL, N, y0, N, threads);
                }
                ((r + i) & 1 ? t1 : t0)[r] = now() - t;
            }
        qsort(t0, reps, sizeof(double), cmpd);
        qsort(t1, reps, sizeof(double), cmpd);
        qsort(t2, reps, sizeof(double), cmpd);
        printf("   %-26s engine %8.1f us  AMX digits %8.1f us (%.2f)  + digitizing %7.1f us  "
               "rows whose bits differ from the decode GEMV's: %ld of %ld; largest difference from the fp32 path %.1e of max|y|\n",
               NAMES[s], t0[reps / 2] * 1e6, t1[reps / 2] * 1e6, t1[reps / 2] / t0[reps / 2], t2[reps / 2] * 1e6, cross,
               (long)((M + 16) / 17), worst / ymax);
        free(codes); free(pc); free(d); free(pd); free(at); free(x); free(y0); free(y1); free(y2); free(xe); free(xe1); free(xd);
    }
}
#else
static void amx_gemm(void) { puts("3. AMX: not an AMX build"); }
#endif

int main(int argc, char **argv) {
    const int warm = argc > 1 && strcmp(argv[1], "warm") == 0;   /* no sweep between calls: compute-bound */
    amx_rounding();
    const int threads = 2, reps = 301;
    printf("2. Q4_0 GEMV at M = 1, 2 threads, median of 301 calls, %s\n", warm ? "caches warm (`warm`: the same matrix "
           "again and again, compute-bound)" : "caches cold as in a decode step (a 64 MB sweep between calls)");
    float *flush = malloc(64 << 20);
    memset(flush, 0, 64 << 20);
    for (int s = 0; s < NSHAPES; s++) {
        const int64_t N = SHAPES[s][0], K = SHAPES[s][1], G = K / 32;
        uint8_t *codes = malloc(N * K / 2), *pc = malloc(N * K / 2);
        uint16_t *d = malloc(N * G * 2), *pd = malloc(N * G * 2);
        float *x = malloc(K * 4), *y0 = malloc(N * 4), *y1 = malloc(N * 4), bias = -8.0f;
        uint32_t *xd = malloc(G * 48 * 4);
        int *xe = malloc(G * sizeof(int));
        random_q4_0(codes, d, N, K);
        random_x(x, K);
        repack(codes, d, N, K, pc, pd);
        digitize(x, K, xd, xe);
        tq_q4g32_f16s_mm(x, 1, K, codes, NULL, d, &bias, NULL, N, y0, N, threads);
        gemv_digits(xd, xe, pc, pd, N, K, y1, threads);
        double worst0 = 0, worst1 = 0, ymax = 0;
        long model_miss = 0;
        for (int64_t n = 0; n < N; n++) {
            double ref = 0;
            for (int64_t k = 0; k < K; k++) {
                ref += (double)half_to_float(d[n * G + k / 32]) * (q4_code(codes, K, n, k) - 8) * x[k];
            }
            ymax = fmax(ymax, fabs(ref));
            worst0 = fmax(worst0, fabs(y0[n] - ref));
            worst1 = fmax(worst1, fabs(y1[n] - ref));
            float m = digits_model(xd, xe, codes, d, K, n);
            model_miss += memcmp(&m, &y1[n], 4) != 0;
        }
        double t0[301], t1[301];
        for (int r = 0; r < reps; r++) {
            for (int i = 0; i < 2; i++) {
                for (int64_t j = 0; !warm && j < (16 << 20); j += 16) flush[j] += 1.0f;
                double t = now();
                if ((r + i) & 1) gemv_digits(xd, xe, pc, pd, N, K, y1, threads);
                else tq_q4g32_f16s_mm(x, 1, K, codes, NULL, d, &bias, NULL, N, y0, N, threads);
                ((r + i) & 1 ? t1 : t0)[r] = now() - t;
            }
        }
        qsort(t0, reps, sizeof(double), cmpd);
        qsort(t1, reps, sizeof(double), cmpd);
        printf("   %-26s engine %7.1f us  digits %7.1f us  digits/engine %.2f   error / max|y|: engine %.1e, digits %.1e; "
               "digits != its integer model: %ld of %ld\n",
               NAMES[s], t0[reps / 2] * 1e6, t1[reps / 2] * 1e6, t1[reps / 2] / t0[reps / 2], worst0 / ymax, worst1 / ymax,
               model_miss, (long)N);
        free(codes); free(pc); free(d); free(pd); free(x); free(y0); free(y1); free(xd); free(xe);
    }
    free(flush);
    amx_gemm();
    return 0;
}
#endif
