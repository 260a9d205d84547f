/* Weight-only quantized matmul: y[m, n] = sum_k x[m, k] * w[n, k], w stored as codes with a per-group
 * fp32 scale and bias, w = fma(scale, code, bias) (exactly GGML's dequantized fp32 value, see
 * ternlm/models/qweight.py). Activations and accumulation stay fp32.
 *
 * Formats (K is a multiple of 32, rows of w are output features):
 *   Q4G32: codes (N, K/2) bytes; in each group of 32, byte j holds element j (low nibble) and j+16
 *          (high nibble), GGML's layout; scale/bias (N, K/32).
 *   Q8G16: codes (N, K) bytes 0..255; scale/bias (N, K/16).
 *
 * [BATCH-INVARIANT] A row's result must not depend on how many rows are multiplied with it, nor on
 * how threads split the work: every (m, n) is computed by the same instruction sequence whatever M,
 * the row tile or the thread count. Tiles (up to TILE rows x COLS weight rows) only share loaded
 * vectors (x rows, dequantized weights); every (row, weight row) pair keeps its own accumulators, fed in
 * the same order and summed the same way at the end.
 * Threads split output features n, never k.
 *
 * Built at run time for the host CPU by ternlm/kernels/build.py (cc -O3 -march=native -fopenmp);
 * the ISA paths below are picked by the compiler's own macros.
 */
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define INLINE static inline __attribute__((always_inline))

#if defined(__AVX512F__)
#define TILE 4          /* rows per tile */
#define COLS 3          /* weight rows (output features) per tile: 4 x 3 x 2 accumulators in 24 zmm */
const char *tq_isa(void) { return "avx512"; }

INLINE __m512 deq16(__m128i c8, float s, float b) {        /* 16 codes -> 16 fp32 weights */
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(c8)), _mm512_set1_ps(s), _mm512_set1_ps(b));
}

/* R rows x C weight rows. Each (row, weight row) pair has accumulators a0 (elements 0-15 of every
 * group of 32) and a1 (16-31), fed group by group and summed as reduce(a0 + a1): the same sequence
 * whatever R and C are. */
INLINE void q4_tile(const float *x, int64_t ldx, int R, int C, int64_t K, const uint8_t *c, int64_t ldc,
                    const float *sc, const float *bi, int64_t ldg, float *y, int64_t ldy) {
    __m512 a0[TILE][COLS], a1[TILE][COLS];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < C; j++) { a0[r][j] = _mm512_setzero_ps(); a1[r][j] = _mm512_setzero_ps(); }
    for (int64_t g = 0; g < K / 32; g++) {
        __m512 wl[COLS], wh[COLS];
        for (int j = 0; j < C; j++) {
            __m128i q = _mm_loadu_si128((const __m128i *)(c + j * ldc + 16 * g));
            float s = sc[j * ldg + g], b = bi[j * ldg + g];
            wl[j] = deq16(_mm_and_si128(q, _mm_set1_epi8(0x0F)), s, b);
            wh[j] = deq16(_mm_and_si128(_mm_srli_epi16(q, 4), _mm_set1_epi8(0x0F)), s, b);
        }
        for (int r = 0; r < R; r++) {
            __m512 xl = _mm512_loadu_ps(x + r * ldx + 32 * g), xh = _mm512_loadu_ps(x + r * ldx + 32 * g + 16);
            for (int j = 0; j < C; j++) {
                a0[r][j] = _mm512_fmadd_ps(wl[j], xl, a0[r][j]);
                a1[r][j] = _mm512_fmadd_ps(wh[j], xh, a1[r][j]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < C; j++) y[r * ldy + j] = _mm512_reduce_add_ps(_mm512_add_ps(a0[r][j], a1[r][j]));
}

/* Groups of 16 taken in pairs: a0 gets the even groups, a1 the odd ones. */
INLINE void q8_tile(const float *x, int64_t ldx, int R, int C, int64_t K, const uint8_t *c, int64_t ldc,
                    const float *sc, const float *bi, int64_t ldg, float *y, int64_t ldy) {
    __m512 a0[TILE][COLS], a1[TILE][COLS];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < C; j++) { a0[r][j] = _mm512_setzero_ps(); a1[r][j] = _mm512_setzero_ps(); }
    for (int64_t g = 0; g < K / 16; g += 2) {
        __m512 w0[COLS], w1[COLS];
        for (int j = 0; j < C; j++) {
            const uint8_t *cj = c + j * ldc + 16 * g;
            const float *s = sc + j * ldg + g, *b = bi + j * ldg + g;
            w0[j] = deq16(_mm_loadu_si128((const __m128i *)cj), s[0], b[0]);
            w1[j] = deq16(_mm_loadu_si128((const __m128i *)(cj + 16)), s[1], b[1]);
        }
        for (int r = 0; r < R; r++) {
            __m512 x0 = _mm512_loadu_ps(x + r * ldx + 16 * g), x1 = _mm512_loadu_ps(x + r * ldx + 16 * g + 16);
            for (int j = 0; j < C; j++) {
                a0[r][j] = _mm512_fmadd_ps(w0[j], x0, a0[r][j]);
                a1[r][j] = _mm512_fmadd_ps(w1[j], x1, a1[r][j]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < C; j++) y[r * ldy + j] = _mm512_reduce_add_ps(_mm512_add_ps(a0[r][j], a1[r][j]));
}

#elif defined(__AVX2__) && defined(__FMA__)
#define TILE 4
const char *tq_isa(void) { return "avx2"; }

INLINE __m256 deq8(__m128i c8, float s, float b) {         /* low 8 codes of c8 -> 8 fp32 weights */
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(c8)), _mm256_set1_ps(s), _mm256_set1_ps(b));
}

INLINE float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

INLINE void q4_rows(const float *x, int64_t ldx, int R, int64_t K, const uint8_t *c, const float *sc,
                    const float *bi, float *y, int64_t ldy) {
    __m256 a0[8], a1[8];
    for (int r = 0; r < R; r++) { a0[r] = _mm256_setzero_ps(); a1[r] = _mm256_setzero_ps(); }
    for (int64_t g = 0; g < K / 32; g++) {
        __m128i q = _mm_loadu_si128((const __m128i *)(c + 16 * g));
        __m128i lo = _mm_and_si128(q, _mm_set1_epi8(0x0F));
        __m128i hi = _mm_and_si128(_mm_srli_epi16(q, 4), _mm_set1_epi8(0x0F));
        __m256 w0 = deq8(lo, sc[g], bi[g]), w1 = deq8(_mm_srli_si128(lo, 8), sc[g], bi[g]);
        __m256 w2 = deq8(hi, sc[g], bi[g]), w3 = deq8(_mm_srli_si128(hi, 8), sc[g], bi[g]);
        for (int r = 0; r < R; r++) {
            const float *xr = x + r * ldx + 32 * g;
            a0[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xr), a0[r]);
            a1[r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr + 8), a1[r]);
            a0[r] = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xr + 16), a0[r]);
            a1[r] = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xr + 24), a1[r]);
        }
    }
    for (int r = 0; r < R; r++) y[r * ldy] = hsum8(_mm256_add_ps(a0[r], a1[r]));
}

INLINE void q8_rows(const float *x, int64_t ldx, int R, int64_t K, const uint8_t *c, const float *sc,
                    const float *bi, float *y, int64_t ldy) {
    __m256 a0[8], a1[8];
    for (int r = 0; r < R; r++) { a0[r] = _mm256_setzero_ps(); a1[r] = _mm256_setzero_ps(); }
    for (int64_t g = 0; g < K / 16; g++) {
        __m128i q = _mm_loadu_si128((const __m128i *)(c + 16 * g));
        __m256 w0 = deq8(q, sc[g], bi[g]), w1 = deq8(_mm_srli_si128(q, 8), sc[g], bi[g]);
        for (int r = 0; r < R; r++) {
            const float *xr = x + r * ldx + 16 * g;
            a0[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xr), a0[r]);
            a1[r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr + 8), a1[r]);
        }
    }
    for (int r = 0; r < R; r++) y[r * ldy] = hsum8(_mm256_add_ps(a0[r], a1[r]));
}


#else
#define TILE 4
const char *tq_isa(void) { return "scalar"; }

INLINE void q4_rows(const float *x, int64_t ldx, int R, int64_t K, const uint8_t *c, const float *sc,
                    const float *bi, float *y, int64_t ldy) {
    for (int r = 0; r < R; r++) {
        float acc = 0.0f;
        for (int64_t g = 0; g < K / 32; g++)
            for (int j = 0; j < 32; j++) {
                uint8_t b = c[16 * g + (j & 15)];
                float w = __builtin_fmaf(sc[g], (float)(j < 16 ? b & 15 : b >> 4), bi[g]);
                acc = __builtin_fmaf(w, x[r * ldx + 32 * g + j], acc);
            }
        y[r * ldy] = acc;
    }
}

INLINE void q8_rows(const float *x, int64_t ldx, int R, int64_t K, const uint8_t *c, const float *sc,
                    const float *bi, float *y, int64_t ldy) {
    for (int r = 0; r < R; r++) {
        float acc = 0.0f;
        for (int64_t k = 0; k < K; k++)
            acc = __builtin_fmaf(__builtin_fmaf(sc[k / 16], (float)c[k], bi[k / 16]), x[r * ldx + k], acc);
        y[r * ldy] = acc;
    }
}


#endif

#if !defined(__AVX512F__)
/* AVX2 and scalar: one weight row per tile (16 vector registers leave no room for more accumulators). */
#define COLS 1
INLINE void q4_tile(const float *x, int64_t ldx, int R, int C, int64_t K, const uint8_t *c, int64_t ldc,
                    const float *sc, const float *bi, int64_t ldg, float *y, int64_t ldy) {
    (void)C; (void)ldc; (void)ldg;
    q4_rows(x, ldx, R, K, c, sc, bi, y, ldy);
}
INLINE void q8_tile(const float *x, int64_t ldx, int R, int C, int64_t K, const uint8_t *c, int64_t ldc,
                    const float *sc, const float *bi, int64_t ldg, float *y, int64_t ldy) {
    (void)C; (void)ldc; (void)ldg;
    q8_rows(x, ldx, R, K, c, sc, bi, y, ldy);
}
#endif

/* Output features per parallel task: its weights (32 x K x 0.75 bytes) stay in L2 while every row tile
 * passes over them. */
#define NCHUNK 48

/* Dispatch a tile to constant (R, C), so that the compiler keeps the accumulators in registers. */
#define CASE(FN, R_, C_) case (R_) * 8 + (C_): FN(xm, K, R_, C_, K, c, ldc, s, b, ldg, ym, ldy); break;
#define CASES_R(FN, R_) CASE(FN, R_, 1) CASE(FN, R_, 2) CASE(FN, R_, 3)
#define TILE_SWITCH(FN)                                                                     \
    switch (R * 8 + (C > COLS ? COLS : C)) {                                                \
        CASES_R(FN, 1) CASES_R(FN, 2) CASES_R(FN, 3) CASES_R(FN, 4)                         \
        default: break;                                                                     \
    }

/* x: (M, K) fp32 contiguous; y: rows of stride ldy (a column slice of a wider output is fine).
 * nthreads: passed in, not taken from OpenMP's per-thread default: the caller is often not the thread
 * torch.set_num_threads ran on. */
#define DEFINE_MM(NAME, FN, LDC, GROUP)                                                     \
void NAME(const float *x, int64_t M, int64_t K, const uint8_t *codes, const float *scale,   \
          const float *bias, int64_t N, float *y, int64_t ldy, int nthreads) {              \
    int64_t ldc = (LDC), ldg = K / (GROUP), nchunks = (N + NCHUNK - 1) / NCHUNK;            \
    _Pragma("omp parallel for schedule(static) num_threads(nthreads)")                      \
    for (int64_t ch = 0; ch < nchunks; ch++) {                                              \
        int64_t n0 = ch * NCHUNK, n1 = n0 + NCHUNK < N ? n0 + NCHUNK : N;                   \
        for (int64_t m = 0; m < M; m += TILE) {                                             \
            int R = (int)(M - m < TILE ? M - m : TILE);                                     \
            for (int64_t n = n0; n < n1; n += COLS) {                                       \
                int C = (int)(n1 - n < COLS ? n1 - n : COLS);                               \
                const uint8_t *c = codes + n * ldc;                                         \
                const float *s = scale + n * ldg, *b = bias + n * ldg, *xm = x + m * K;     \
                float *ym = y + m * ldy + n;                                                \
                TILE_SWITCH(FN)                                                             \
            }                                                                               \
        }                                                                                   \
    }                                                                                       \
}

DEFINE_MM(tq_q4g32_mm, q4_tile, K / 2, 32)
DEFINE_MM(tq_q8g16_mm, q8_tile, K, 16)
