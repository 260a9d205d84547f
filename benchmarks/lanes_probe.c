/* Probe for a design not built yet: fp32 products with lanes over weight rows, one FMA chain per output.
 *
 *   cc -O3 -march=native -ffp-contract=off -fopenmp -std=gnu11 -Wno-psabi -Isrc/ternlm/kernels \
 *      benchmarks/lanes_probe.c -o /tmp/lanes_probe -lm && /tmp/lanes_probe
 *
 * Today's kernels (qmatmul.c) put the inputs k in the vector lanes: each output is two 16-lane partial
 * sums folded by a tree at the end, and a prefill tile pays a horizontal sum per (row, weight row) and
 * loads its activations as vectors. The textbook GEMM puts weight rows n in the lanes instead: y[m][n] =
 * fma(w[n][k], x[m][k], y[m][n]) for k = 0, 1, ... in order, one chain per output, x[m][k] broadcast.
 * Its bits then depend on nothing but the order of k: the same for M = 1 and any M, any tile shape, any
 * thread count, and any vector width (AVX-512, AVX2, scalar: a lane is a lane), while the activations
 * stay fp32. This probe measures both sides on Q4_0 matrices of both models, 2 threads:
 *   prefill (M = 256): the engine's kernel against a 12-row x 32-weight-row microkernel over weights
 *   dequantized into a buffer of [block of 32 rows][k][32] (the dequantizing, scalar here, timed apart);
 *   decode (M = 1, caches cold): the engine's kernel against the same chains over codes repacked 16 rows
 *   interleaved at load (8 blocks' chains side by side: FMA latency);
 * and checks every output it computes bit for bit against the single-row chain. Then the two-level form
 * (a chain per group of 32 inputs over the codes c - 8, the group's scale applied once into the total:
 * GGML's structure, a tenth of the single chain's rounding error) on both sides, checked against its
 * scalar model and GEMV rows against GEMM rows. Timing and checks for this machine only; not a test, not
 * part of the product. Writes nothing.
 */
#include "qmatmul.c"     /* the engine's kernel, as the engine builds it */
#include "probe_common.h"

#include <math.h>
#include <stdio.h>
#include <time.h>

#if !defined(__AVX512F__)

int main(void) { puts("needs AVX-512 (this probe's microkernel)"); return 0; }
#else

#define NB 32            /* weight rows per block: two zmm */
#define MR 12            /* activation rows per tile: 24 accumulators */


/* Q4_0 element (n, k): d * (c - 8) */
static float q4_0(const uint8_t *codes, const uint16_t *d, int64_t K, int64_t n, int64_t k) {
    return half_to_float(d[n * (K / 32) + k / 32]) * (float)(q4_code(codes, K, n, k) - 8);
}

/* weights -> wb[(nb * K + k) * NB + j] = w[nb * NB + j][k] (N a multiple of NB) */
static void dequant_blocks(const uint8_t *codes, const uint16_t *d, int64_t N, int64_t K, float *wb, int nthreads) {
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t nb = 0; nb < N / NB; nb++)
        for (int64_t j = 0; j < NB; j++)
            for (int64_t k = 0; k < K; k++) wb[(nb * K + k) * NB + j] = q4_0(codes, d, K, nb * NB + j, k);
}

/* y (M, N) = x (M, K) w^T: per tile of MR rows x NB weight rows, acc = fma(w[.][k], x[m][k], acc) for
 * k = 0 .. K-1, one chain per output. */
static void gemm_lanes(const float *x, int64_t M, int64_t K, const float *wb, int64_t N, float *y, int nthreads) {
    #pragma omp parallel for collapse(2) schedule(static) num_threads(nthreads)
    for (int64_t nb = 0; nb < N / NB; nb++)
        for (int64_t m0 = 0; m0 < M; m0 += MR) {
            __m512 a[MR][2];
            for (int r = 0; r < MR; r++) for (int c = 0; c < 2; c++) a[r][c] = _mm512_setzero_ps();
            const float *w = wb + nb * K * NB;
            const int R = (int)(M - m0 < MR ? M - m0 : MR);
            if (R == MR) {
                for (int64_t k = 0; k < K; k++) {
                    __m512 w0 = _mm512_load_ps(w + k * NB), w1 = _mm512_load_ps(w + k * NB + 16);
#pragma GCC unroll 12
                    for (int r = 0; r < MR; r++) {
                        __m512 xb = _mm512_set1_ps(x[(m0 + r) * K + k]);
                        a[r][0] = _mm512_fmadd_ps(w0, xb, a[r][0]);
                        a[r][1] = _mm512_fmadd_ps(w1, xb, a[r][1]);
                    }
                }
            } else {
                for (int64_t k = 0; k < K; k++) {
                    __m512 w0 = _mm512_load_ps(w + k * NB), w1 = _mm512_load_ps(w + k * NB + 16);
                    for (int r = 0; r < R; r++) {
                        __m512 xb = _mm512_set1_ps(x[(m0 + r) * K + k]);
                        a[r][0] = _mm512_fmadd_ps(w0, xb, a[r][0]);
                        a[r][1] = _mm512_fmadd_ps(w1, xb, a[r][1]);
                    }
                }
            }
            for (int r = 0; r < R; r++)
                for (int c = 0; c < 2; c++) _mm512_storeu_ps(y + (m0 + r) * N + nb * NB + 16 * c, a[r][c]);
        }
}

/* ---- decode: the same chains at M = 1 over a repacked layout ------------------------------------------
 * Codes repacked at load, 16 rows interleaved: per (block of 16 rows, pair of inputs k, k + 1) 16 bytes,
 * byte j = row j's code at k (low nibble) and at k + 1 (high); per (block, group) the 16 rows' fp16 d. */
static void repack16(const uint8_t *codes, const uint16_t *d, int64_t N, int64_t K, uint8_t *pc, uint16_t *pd) {
    for (int64_t b = 0; b < N / 16; b++) {
        for (int64_t k = 0; k < K; k += 2)
            for (int j = 0; j < 16; j++) {
                int c0 = q4_code(codes, K, b * 16 + j, k), c1 = q4_code(codes, K, b * 16 + j, k + 1);
                pc[(b * (K / 2) + k / 2) * 16 + j] = (uint8_t)(c0 | c1 << 4);
            }
        for (int64_t g = 0; g < K / 32; g++)
            for (int j = 0; j < 16; j++) pd[(b * (K / 32) + g) * 16 + j] = d[(b * 16 + j) * (K / 32) + g];
    }
}

#define CH 8             /* blocks of 16 rows whose chains run side by side (FMA latency x ports) */
/* ch blocks of 16 rows from block b0: each row's weight d * (c - 8), then acc = fma(w, x[k], acc) for k
 * in order: the GEMM's values and order, so its bits. */
static inline __attribute__((always_inline)) void gemv_blocks(int ch, const float *x, int64_t K, const uint8_t *pc,
                                                              const uint16_t *pd, int64_t b0, float *y) {
    __m512 acc[CH], sc[CH];
    for (int c = 0; c < ch; c++) acc[c] = _mm512_setzero_ps();
    for (int64_t g = 0; g < K / 32; g++) {
        for (int c = 0; c < ch; c++)
            sc[c] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(pd + ((b0 + c) * (K / 32) + g) * 16)));
        for (int64_t kp = 16 * g; kp < 16 * g + 16; kp++) {        /* pairs of inputs 2kp, 2kp + 1 */
            const __m512 x0 = _mm512_set1_ps(x[2 * kp]), x1 = _mm512_set1_ps(x[2 * kp + 1]);
#pragma GCC unroll 8
            for (int c = 0; c < ch; c++) {
                const uint8_t *q = pc + ((b0 + c) * (K / 2) + kp) * 16;
                if ((kp & 3) == 0) _mm_prefetch((const char *)q + 4096, _MM_HINT_T0);
                __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q));
                __m512i lo = _mm512_sub_epi32(_mm512_and_si512(v, _mm512_set1_epi32(15)), _mm512_set1_epi32(8));
                __m512i hi = _mm512_sub_epi32(_mm512_srli_epi32(v, 4), _mm512_set1_epi32(8));
                __m512 w0 = _mm512_mul_ps(sc[c], _mm512_cvtepi32_ps(lo)), w1 = _mm512_mul_ps(sc[c], _mm512_cvtepi32_ps(hi));
                acc[c] = _mm512_fmadd_ps(w1, x1, _mm512_fmadd_ps(w0, x0, acc[c]));
            }
        }
    }
    for (int c = 0; c < ch; c++) _mm512_storeu_ps(y + (b0 + c) * 16, acc[c]);
}


/* ---- the same, two-level: per group of 32 inputs a chain s = fma(c - 8, x[k], s) from 0, then
 * acc = fma(d, s, acc) in group order (GGML's own structure: the scale applied once per group). The
 * error of one chain over K inputs becomes that of a chain over 32 plus one over K / 32. ------------- */
static float chain2_model(const uint8_t *codes, const uint16_t *d, int64_t K, int64_t n, const float *x) {
    float acc = 0.0f;
    for (int64_t g = 0; g < K / 32; g++) {
        float sg = 0.0f;
        for (int64_t k = 32 * g; k < 32 * g + 32; k++) {
            sg = fmaf((float)(q4_code(codes, K, n, k) - 8), x[k], sg);
        }
        acc = fmaf(half_to_float(d[n * (K / 32) + g]), sg, acc);
    }
    return acc;
}

/* codes as floats c - 8 in [block of 32 rows][k][32], d as floats [block][group][32] */
static void codes_blocks(const uint8_t *codes, const uint16_t *d, int64_t N, int64_t K, float *cb, float *db, int nthreads) {
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t nb = 0; nb < N / NB; nb++)
        for (int64_t j = 0; j < NB; j++) {
            const int64_t n = nb * NB + j;
            for (int64_t k = 0; k < K; k++) {
                cb[(nb * K + k) * NB + j] = (float)(q4_code(codes, K, n, k) - 8);
            }
            for (int64_t g = 0; g < K / 32; g++) db[(nb * (K / 32) + g) * NB + j] = half_to_float(d[n * (K / 32) + g]);
        }
}

#define MR2 6            /* 12 group sums + 12 totals */
static void gemm_lanes2(const float *x, int64_t M, int64_t K, const float *cb, const float *db, int64_t N, float *y, int nthreads) {
    #pragma omp parallel for collapse(2) schedule(static) num_threads(nthreads)
    for (int64_t nb = 0; nb < N / NB; nb++)
        for (int64_t m0 = 0; m0 < M; m0 += MR2) {
            const int R = (int)(M - m0 < MR2 ? M - m0 : MR2);
            __m512 t[MR2][2];
            for (int r = 0; r < MR2; r++) { t[r][0] = _mm512_setzero_ps(); t[r][1] = _mm512_setzero_ps(); }
            const float *w = cb + nb * K * NB;
            for (int64_t g = 0; g < K / 32; g++) {
                __m512 a[MR2][2];
                for (int r = 0; r < MR2; r++) { a[r][0] = _mm512_setzero_ps(); a[r][1] = _mm512_setzero_ps(); }
                if (R == MR2) {
                    for (int64_t k = 32 * g; k < 32 * g + 32; k++) {
                        __m512 w0 = _mm512_load_ps(w + k * NB), w1 = _mm512_load_ps(w + k * NB + 16);
#pragma GCC unroll 6
                        for (int r = 0; r < MR2; r++) {
                            __m512 xb = _mm512_set1_ps(x[(m0 + r) * K + k]);
                            a[r][0] = _mm512_fmadd_ps(w0, xb, a[r][0]);
                            a[r][1] = _mm512_fmadd_ps(w1, xb, a[r][1]);
                        }
                    }
                } else {
                    for (int64_t k = 32 * g; k < 32 * g + 32; k++) {
                        __m512 w0 = _mm512_load_ps(w + k * NB), w1 = _mm512_load_ps(w + k * NB + 16);
                        for (int r = 0; r < R; r++) {
                            __m512 xb = _mm512_set1_ps(x[(m0 + r) * K + k]);
                            a[r][0] = _mm512_fmadd_ps(w0, xb, a[r][0]);
                            a[r][1] = _mm512_fmadd_ps(w1, xb, a[r][1]);
                        }
                    }
                }
                const __m512 d0 = _mm512_load_ps(db + (nb * (K / 32) + g) * NB), d1 = _mm512_load_ps(db + (nb * (K / 32) + g) * NB + 16);
                for (int r = 0; r < MR2; r++) { t[r][0] = _mm512_fmadd_ps(d0, a[r][0], t[r][0]); t[r][1] = _mm512_fmadd_ps(d1, a[r][1], t[r][1]); }
            }
            for (int r = 0; r < R; r++)
                for (int c = 0; c < 2; c++) _mm512_storeu_ps(y + (m0 + r) * N + nb * NB + 16 * c, t[r][c]);
        }
}

static inline __attribute__((always_inline)) void gemv_blocks2(int ch, const float *x, int64_t K, const uint8_t *pc,
                                                               const uint16_t *pd, int64_t b0, float *y) {
    __m512 acc[CH];
    for (int c = 0; c < ch; c++) acc[c] = _mm512_setzero_ps();
    for (int64_t g = 0; g < K / 32; g++) {
        __m512 sg[CH];
        for (int c = 0; c < ch; c++) sg[c] = _mm512_setzero_ps();
        for (int64_t kp = 16 * g; kp < 16 * g + 16; kp++) {
            const __m512 x0 = _mm512_set1_ps(x[2 * kp]), x1 = _mm512_set1_ps(x[2 * kp + 1]);
#pragma GCC unroll 8
            for (int c = 0; c < ch; c++) {
                const uint8_t *q = pc + ((b0 + c) * (K / 2) + kp) * 16;
                if ((kp & 3) == 0) _mm_prefetch((const char *)q + 4096, _MM_HINT_T0);
                __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q));
                __m512 c0 = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_and_si512(v, _mm512_set1_epi32(15)), _mm512_set1_epi32(8)));
                __m512 c1 = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(v, 4), _mm512_set1_epi32(8)));
                sg[c] = _mm512_fmadd_ps(c1, x1, _mm512_fmadd_ps(c0, x0, sg[c]));
            }
        }
        for (int c = 0; c < ch; c++)
            acc[c] = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(pd + ((b0 + c) * (K / 32) + g) * 16))), sg[c], acc[c]);
    }
    for (int c = 0; c < ch; c++) _mm512_storeu_ps(y + (b0 + c) * 16, acc[c]);
}

/* y (N) = w x over repack16's layout, single chains (blocks = gemv_blocks) or two-level (gemv_blocks2):
 * CH blocks a task and a last task of fewer. N a multiple of 16. */
#define GEMV(NAME, BLOCKS)                                                                                      \
    static void NAME(const float *x, int64_t K, const uint8_t *pc, const uint16_t *pd, int64_t N, float *y, int nthreads) { \
        const int64_t nb = N / 16;                                                                              \
        _Pragma("omp parallel for schedule(static) num_threads(nthreads)")                                      \
        for (int64_t b0 = 0; b0 < nb; b0 += CH) {                                                               \
            int64_t b = b0;                                                                                     \
            if (nb - b >= CH) { BLOCKS(CH, x, K, pc, pd, b, y); continue; }                                     \
            if (nb - b >= 4) { BLOCKS(4, x, K, pc, pd, b, y); b += 4; }                                         \
            for (; b < nb; b++) BLOCKS(1, x, K, pc, pd, b, y);                                                  \
        }                                                                                                       \
    }
GEMV(gemv_lanes, gemv_blocks)
GEMV(gemv_lanes2, gemv_blocks2)

static void two_level(void) {
    const int64_t M = 256;
    const int threads = 2;
    puts("two-level chains (a chain per group of 32, then the group's scale into the total), 2 threads: prefill M = 256 "
         "(median of 15, codes as floats in blocks), decode M = 1 cold (median of 301)");
    float *flush = malloc(64 << 20);
    memset(flush, 0, 64 << 20);
    for (int s = 0; s < NSHAPES; s++) {
        const int64_t N = SHAPES[s][0], K = SHAPES[s][1], G = K / 32;
        uint8_t *codes = malloc(N * K / 2), *pc = malloc(N * K / 2);
        uint16_t *d = malloc(N * G * 2), *pd = malloc(N * G * 2);
        float *x = malloc(M * K * 4), *y0 = malloc(M * N * 4), *y1 = malloc(M * N * 4), *y2 = malloc(N * 4), *y3 = malloc(N * 4), bias = -8.0f;
        float *cb = aligned_alloc(64, (size_t)N * K * 4), *db = aligned_alloc(64, (size_t)N * G * 4);
        random_q4_0(codes, d, N, K);
        random_x(x, M * K);
        codes_blocks(codes, d, N, K, cb, db, threads);
        repack16(codes, d, N, K, pc, pd);
        gemm_lanes2(x, M, K, cb, db, N, y1, threads);
        tq_q4g32_f16s_mm(x, M, K, codes, NULL, d, &bias, NULL, N, y0, N, threads);
        long miss = 0, missv = 0;
        double err0 = 0, err1 = 0, ymax = 0;
        for (int64_t m = 0; m < M; m += 5) {
            gemv_lanes2(x + m * K, K, pc, pd, N, y2, threads);
            missv += memcmp(y2, y1 + m * N, N * 4) != 0;
            for (int64_t n = 0; n < N; n++) {
                float mdl = chain2_model(codes, d, K, n, x + m * K);
                double ref = 0.0;
                for (int64_t k = 0; k < K; k++) ref += (double)q4_0(codes, d, K, n, k) * x[m * K + k];
                miss += memcmp(&mdl, &y1[m * N + n], 4) != 0;
                err0 = fmax(err0, fabs(y0[m * N + n] - ref));
                err1 = fmax(err1, fabs(y1[m * N + n] - ref));
                ymax = fmax(ymax, fabs(ref));
            }
        }
        double t0[301], t1[301];
        for (int r = 0; r < 15; r++)
            for (int i = 0; i < 2; i++) {
                double t = now();
                if ((r + i) & 1) gemm_lanes2(x, M, K, cb, db, N, y1, threads);
                else tq_q4g32_f16s_mm(x, M, K, codes, NULL, d, &bias, NULL, N, y0, N, threads);
                ((r + i) & 1 ? t1 : t0)[r] = now() - t;
            }
        qsort(t0, 15, sizeof(double), cmpd);
        qsort(t1, 15, sizeof(double), cmpd);
        double p0 = t0[7], p1 = t1[7];
        for (int r = 0; r < 301; r++)
            for (int i = 0; i < 2; i++) {
                for (int64_t j = 0; j < (16 << 20); j += 16) flush[j] += 1.0f;
                double t = now();
                if ((r + i) & 1) gemv_lanes2(x, K, pc, pd, N, y3, threads);
                else tq_q4g32_f16s_mm(x, 1, K, codes, NULL, d, &bias, NULL, N, y2, N, threads);
                ((r + i) & 1 ? t1 : t0)[r] = now() - t;
            }
        qsort(t0, 301, sizeof(double), cmpd);
        qsort(t1, 301, sizeof(double), cmpd);
        printf("   %-26s prefill engine %8.1f us  two-level %8.1f us (%.2f)   decode engine %6.1f us  two-level %6.1f us (%.2f)   "
               "GEMM outputs != model: %ld, GEMV rows != GEMM rows: %ld of %ld; error / max|y|: engine %.1e, two-level %.1e\n",
               NAMES[s], p0 * 1e6, p1 * 1e6, p1 / p0, t0[150] * 1e6, t1[150] * 1e6, t1[150] / t0[150], miss, missv,
               (long)((M + 4) / 5), err0 / ymax, err1 / ymax);
        free(codes); free(pc); free(d); free(pd); free(x); free(y0); free(y1); free(y2); free(y3); free(cb); free(db);
    }
    free(flush);
}

int main(void) {
    const int64_t M = 256;
    const int threads = 2, reps = 15;
    puts("Q4_0 products at M = 256, 2 threads, median of 15: the engine's kernel (its own dequantizing included) "
         "against lanes over weight rows (the dequantizing into blocks, scalar here, timed apart)");
    for (int s = 0; s < NSHAPES; s++) {
        const int64_t N = SHAPES[s][0], K = SHAPES[s][1], G = K / 32;
        uint8_t *codes = malloc(N * K / 2);
        uint16_t *d = malloc(N * G * 2);
        float *x = malloc(M * K * 4), *y0 = malloc(M * N * 4), *y1 = malloc(M * N * 4), bias = -8.0f;
        float *wb = aligned_alloc(64, (size_t)N * K * 4);
        random_q4_0(codes, d, N, K);
        random_x(x, M * K);
        dequant_blocks(codes, d, N, K, wb, threads);
        gemm_lanes(x, M, K, wb, N, y1, threads);
        /* every output checked against the single-row chain (what a decode GEMV in this layout computes),
         * and both kernels' errors against float64 */
        long miss = 0;
        double err0 = 0, err1 = 0, ymax = 0;
        tq_q4g32_f16s_mm(x, M, K, codes, NULL, d, &bias, NULL, N, y0, N, threads);
        for (int64_t m = 0; m < M; m += 5)
            for (int64_t n = 0; n < N; n++) {
                float acc = 0.0f;
                double ref = 0.0;
                for (int64_t k = 0; k < K; k++) {
                    acc = fmaf(q4_0(codes, d, K, n, k), x[m * K + k], acc);
                    ref += (double)q4_0(codes, d, K, n, k) * x[m * K + k];
                }
                miss += memcmp(&acc, &y1[m * N + n], 4) != 0;
                err0 = fmax(err0, fabs(y0[m * N + n] - ref));
                err1 = fmax(err1, fabs(y1[m * N + n] - ref));
                ymax = fmax(ymax, fabs(ref));
            }
        double t0[15], t1[15], t2[15];
        for (int r = 0; r < reps; r++)
            for (int i = 0; i < 2; i++) {
                double t = now();
                if ((r + i) & 1) {
                    dequant_blocks(codes, d, N, K, wb, threads);
                    t2[r] = now() - t;
                    t = now();
                    gemm_lanes(x, M, K, wb, N, y1, threads);
                } else {
                    tq_q4g32_f16s_mm(x, M, K, codes, NULL, d, &bias, NULL, N, y0, N, threads);
                }
                ((r + i) & 1 ? t1 : t0)[r] = now() - t;
            }
        qsort(t0, reps, sizeof(double), cmpd);
        qsort(t1, reps, sizeof(double), cmpd);
        qsort(t2, reps, sizeof(double), cmpd);
        double gf = 2.0 * M * N * K / 1e9;
        printf("   %-26s engine %8.1f us (%3.0f GFLOP/s)  lanes %8.1f us (%3.0f GFLOP/s, %.2f)  + dequantizing %7.1f us  "
               "outputs that differ from the single-row chain: %ld of %ld; error / max|y|: engine %.1e, lanes %.1e\n",
               NAMES[s], t0[reps / 2] * 1e6, gf / t0[reps / 2], t1[reps / 2] * 1e6, gf / t1[reps / 2],
               t1[reps / 2] / t0[reps / 2], t2[reps / 2] * 1e6, miss, (long)(((M + 4) / 5) * N), err0 / ymax, err1 / ymax);
        free(codes); free(d); free(x); free(y0); free(y1); free(wb);
    }
    puts("decode, M = 1, 2 threads, median of 301, caches cold (a 64 MB sweep between calls): the engine's kernel "
         "against the same chains over codes repacked 16 rows interleaved");
    float *flush = malloc(64 << 20);
    memset(flush, 0, 64 << 20);
    for (int s = 0; s < NSHAPES; s++) {
        const int64_t N = SHAPES[s][0], K = SHAPES[s][1], G = K / 32;
        uint8_t *codes = malloc(N * K / 2), *pc = malloc(N * K / 2);
        uint16_t *d = malloc(N * G * 2), *pd = malloc(N * G * 2);
        float *x = malloc(K * 4), *y0 = malloc(N * 4), *y1 = malloc(N * 4), bias = -8.0f;
        random_q4_0(codes, d, N, K);
        random_x(x, K);
        repack16(codes, d, N, K, pc, pd);
        gemv_lanes(x, K, pc, pd, N, y1, threads);
        long miss = 0;
        for (int64_t n = 0; n < N; n++) {
            float acc = 0.0f;
            for (int64_t k = 0; k < K; k++) acc = fmaf(q4_0(codes, d, K, n, k), x[k], acc);
            miss += memcmp(&acc, &y1[n], 4) != 0;
        }
        double t0[301], t1[301];
        for (int r = 0; r < 301; r++)
            for (int i = 0; i < 2; i++) {
                for (int64_t j = 0; j < (16 << 20); j += 16) flush[j] += 1.0f;
                double t = now();
                if ((r + i) & 1) gemv_lanes(x, K, pc, pd, N, y1, threads);
                else tq_q4g32_f16s_mm(x, 1, K, codes, NULL, d, &bias, NULL, N, y0, N, threads);
                ((r + i) & 1 ? t1 : t0)[r] = now() - t;
            }
        qsort(t0, 301, sizeof(double), cmpd);
        qsort(t1, 301, sizeof(double), cmpd);
        printf("   %-26s engine %7.1f us  lanes %7.1f us  lanes/engine %.2f   outputs that differ from the chain "
               "(so from the GEMM): %ld of %ld\n", NAMES[s], t0[150] * 1e6, t1[150] * 1e6, t1[150] / t0[150], miss, (long)N);
        free(codes); free(pc); free(d); free(pd); free(x); free(y0); free(y1);
    }
    free(flush);
    two_level();
    return 0;
}
#endif
