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
 * the row tile or the thread count. Row tiles (up to TILE rows) only share the dequantized weight
 * vectors; each row keeps its own accumulators, fed in the same order, summed the same way at the end.
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
#define TILE 8
const char *tq_isa(void) { return "avx512"; }

INLINE __m512 deq16(__m128i c8, float s, float b) {        /* 16 codes -> 16 fp32 weights */
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(c8)), _mm512_set1_ps(s), _mm512_set1_ps(b));
}

INLINE void q4_rows(const float *x, int64_t ldx, int R, int64_t K, const uint8_t *c, const float *sc,
                    const float *bi, float *y, int64_t ldy) {
    __m512 a0[8], a1[8];
    for (int r = 0; r < R; r++) { a0[r] = _mm512_setzero_ps(); a1[r] = _mm512_setzero_ps(); }
    for (int64_t g = 0; g < K / 32; g++) {
        __m128i q = _mm_loadu_si128((const __m128i *)(c + 16 * g));
        __m512 wl = deq16(_mm_and_si128(q, _mm_set1_epi8(0x0F)), sc[g], bi[g]);
        __m512 wh = deq16(_mm_and_si128(_mm_srli_epi16(q, 4), _mm_set1_epi8(0x0F)), sc[g], bi[g]);
        for (int r = 0; r < R; r++) {
            a0[r] = _mm512_fmadd_ps(wl, _mm512_loadu_ps(x + r * ldx + 32 * g), a0[r]);
            a1[r] = _mm512_fmadd_ps(wh, _mm512_loadu_ps(x + r * ldx + 32 * g + 16), a1[r]);
        }
    }
    for (int r = 0; r < R; r++) y[r * ldy] = _mm512_reduce_add_ps(_mm512_add_ps(a0[r], a1[r]));
}

INLINE void q8_rows(const float *x, int64_t ldx, int R, int64_t K, const uint8_t *c, const float *sc,
                    const float *bi, float *y, int64_t ldy) {
    __m512 a0[8], a1[8];
    for (int r = 0; r < R; r++) { a0[r] = _mm512_setzero_ps(); a1[r] = _mm512_setzero_ps(); }
    for (int64_t g = 0; g < K / 16; g += 2) {
        __m512 w0 = deq16(_mm_loadu_si128((const __m128i *)(c + 16 * g)), sc[g], bi[g]);
        __m512 w1 = deq16(_mm_loadu_si128((const __m128i *)(c + 16 * g + 16)), sc[g + 1], bi[g + 1]);
        for (int r = 0; r < R; r++) {
            a0[r] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + r * ldx + 16 * g), a0[r]);
            a1[r] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + r * ldx + 16 * g + 16), a1[r]);
        }
    }
    for (int r = 0; r < R; r++) y[r * ldy] = _mm512_reduce_add_ps(_mm512_add_ps(a0[r], a1[r]));
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

/* Column chunk per parallel task: its weights (~64 x K x 0.75 bytes) stay in L2 while every row tile
 * passes over them. */
#define NCHUNK 32

/* One row tile against one weight row n. Constant row counts let the compiler keep the accumulators
 * in registers; the per-row arithmetic is the same in every case. */
#define TILE_CASES(ROWS)                                                                  \
    switch (R) {                                                                          \
    case 1: ROWS(xm, K, 1, K, c, s, b, ym, ldy); break;                                   \
    case 2: ROWS(xm, K, 2, K, c, s, b, ym, ldy); break;                                   \
    case 3: ROWS(xm, K, 3, K, c, s, b, ym, ldy); break;                                   \
    case 4: ROWS(xm, K, 4, K, c, s, b, ym, ldy); break;                                   \
    case 5: ROWS(xm, K, 5, K, c, s, b, ym, ldy); break;                                   \
    case 6: ROWS(xm, K, 6, K, c, s, b, ym, ldy); break;                                   \
    case 7: ROWS(xm, K, 7, K, c, s, b, ym, ldy); break;                                   \
    default: ROWS(xm, K, 8, K, c, s, b, ym, ldy); break;                                  \
    }

/* Rows per tile: as many as keep the tile's activations within ~16 KiB (half of a typical L1), so each
 * weight row's pass over them hits L1. Only speed depends on it, not the bits (see above). */
static int64_t row_tile(int64_t K) {
    int64_t t = 4096 / K;
    return t < 1 ? 1 : t > TILE ? TILE : t;
}

/* x: (M, K) fp32 contiguous; y: rows of stride ldy (a column slice of a wider output is fine).
 * nthreads: passed in, not taken from OpenMP's per-thread default: the caller is often not the thread
 * torch.set_num_threads ran on. */
void tq_q4g32_mm(const float *x, int64_t M, int64_t K, const uint8_t *codes, const float *scale,
                 const float *bias, int64_t N, float *y, int64_t ldy, int nthreads) {
    int64_t nchunks = (N + NCHUNK - 1) / NCHUNK, tile = row_tile(K);
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t ch = 0; ch < nchunks; ch++) {
        int64_t n0 = ch * NCHUNK, n1 = n0 + NCHUNK < N ? n0 + NCHUNK : N;
        for (int64_t m = 0; m < M; m += tile) {
            int R = (int)(M - m < tile ? M - m : tile);
            for (int64_t n = n0; n < n1; n++) {
                const uint8_t *c = codes + n * (K / 2);
                const float *s = scale + n * (K / 32), *b = bias + n * (K / 32);
                const float *xm = x + m * K;
                float *ym = y + m * ldy + n;
                TILE_CASES(q4_rows)
            }
        }
    }
}

void tq_q8g16_mm(const float *x, int64_t M, int64_t K, const uint8_t *codes, const float *scale,
                 const float *bias, int64_t N, float *y, int64_t ldy, int nthreads) {
    int64_t nchunks = (N + NCHUNK - 1) / NCHUNK, tile = row_tile(K);
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t ch = 0; ch < nchunks; ch++) {
        int64_t n0 = ch * NCHUNK, n1 = n0 + NCHUNK < N ? n0 + NCHUNK : N;
        for (int64_t m = 0; m < M; m += tile) {
            int R = (int)(M - m < tile ? M - m : tile);
            for (int64_t n = n0; n < n1; n++) {
                const uint8_t *c = codes + n * K;
                const float *s = scale + n * (K / 16), *b = bias + n * (K / 16);
                const float *xm = x + m * K;
                float *ym = y + m * ldy + n;
                TILE_CASES(q8_rows)
            }
        }
    }
}
