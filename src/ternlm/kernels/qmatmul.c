/* Weight-only quantized matmul: y[m, n] = sum_k x[m, k] * w[n, k], w stored as codes with a per-group
 * scale and bias, w = fma(scale, code, bias) (exactly GGML's dequantized fp32 value, see
 * ternlm/models/qweight.py). Activations and accumulation stay fp32.
 *
 * Layouts (K is a multiple of 32, rows of w are output features; every layout is read in chunks of
 * 32 inputs):
 *   q4g32: codes (N, K/2) bytes; in each group of 32, byte j holds element j (low nibble) and j+16
 *          (high nibble), GGML's layout; scale/bias (N, K/32).
 *   q5g32: q4g32's nibbles plus high (N, K/8) bytes: per group 4 bytes, bit j (little-endian) the
 *          fifth bit (value 16) of element j; scale/bias (N, K/32).
 *   q8g16: codes (N, K) bytes 0..255; scale/bias (N, K/16).
 *   q8g32: codes (N, K) bytes 0..255; scale/bias (N, K/32).
 * Scale and bias: see the scale modes below (fp32, fp16, or GGML's K-quant sub-scales with a fp16
 * super-block scale): every mode gives the exact GGML value; the smaller ones read fewer bytes.
 * Decode is bound by memory bandwidth, so bytes per weight is what sets its speed.
 *
 * [BATCH-INVARIANT] A row's result must not depend on how many rows are multiplied with it, nor on
 * how threads split the work: every (m, n) is computed by the same instruction sequence whatever M,
 * the row tile or the thread count. Tiles (up to TILE rows x COLS weight rows) only share loaded
 * vectors (x rows, dequantized weights); every (row, weight row) pair keeps its own accumulators, fed in
 * the same order and summed the same way at the end. Threads split output features n, never k.
 *
 * Built at run time for the host CPU by ternlm/kernels/build.py (cc -O3 -march=native -fopenmp);
 * the ISA paths below are picked by the compiler's own macros.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#if defined(__SSE__)
#include <immintrin.h>
#endif

#define INLINE static inline __attribute__((always_inline))

enum { Q4 = 4, Q5 = 5, Q8 = 8 };   /* code kinds: packed nibbles, nibbles + high bit, bytes */

/* ---- scale/bias loads: fp32, or fp16 converted exactly ----------------------------------------- */
INLINE float half_to_float(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t s = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu, u;
    float f;
    if (e == 0) {                                  /* zero or subnormal: m * 2^-24, exact in fp32 */
        f = (float)m * (1.0f / 16777216.0f);
        memcpy(&u, &f, 4);
        u |= s;
    } else if (e == 31) {
        u = s | 0x7F800000u | (m << 13);
    } else {
        u = s | ((e + 112) << 23) | (m << 13);
    }
    memcpy(&f, &u, 4);
    return f;
#endif
}

/* Group index of element e (0..31) of chunk g: groups of 16 (q8g16) or 32 (all others). */
INLINE int64_t grp(int kind, int g16, int64_t g, int e) { return (kind == Q8 && g16) ? 2 * g + e / 16 : g; }

/* Pointers to one weight row: codes, high bits (q5g32), scales, biases, K-quant super-block scales
 * (offsets in elements). */
typedef struct {
    const uint8_t *c;
    const uint8_t *h;
    const void *s;
    const void *b;
    const uint16_t *sup;
    int64_t g0;       /* this row's first group in s/b */
    int64_t pf;       /* bytes from this row's codes to the codes the next tile reads in its place */
} Row;

/* Scale modes: how a group's scale and bias are stored (`sm` is a compile-time constant in every
 * instantiation). Every mode yields exactly the fp32 value GGML's dequantizer computes.
 *   SM_F32: fp32 scale and bias per group.
 *   SM_F16: fp16 scale and bias per group (GGML's own fp16 d and m).
 *   SM_K:   Q4_K / Q5_K: uint8 sc and m per group of 32, fp16 (d, dmin) per 256 in sup:
 *           scale d*sc, bias -(dmin*m) (both products exact in fp32).
 *   SM_K6:  Q6_K: int8 sc per group of 16, fp16 d per 256 in sup: scale d*sc, bias -32*scale.
 *   SM_F16S: fp16 scale per group, bias = scale * bias[0], one fp32 constant for the matrix (Q4_0 -8,
 *           Q5_0 -16, Q8_0 -128: GGML derives the offset from d; a power of two times d is exact).
 *   SM_F16I: SM_F16S whose constant is the layout's own code offset -k (Q4 -8, Q5 -16, Q8 -128, as
 *           every Q4_0 / Q5_0 / Q8_0 matrix has; picked per call): the AVX-512 path dequantizes it as
 *           d * (c - k), one product of d and an exact small integer, which equals fma(d, c, -k*d)
 *           (the one rounding of the same exact value) and needs no bias: qwen's Q5_0 and Q8_0 GEMVs
 *           -5..-9% at M = 1. The other paths read it as SM_F16S. */
enum { SM_F32 = 0, SM_F16 = 1, SM_K = 2, SM_K6 = 3, SM_F16S = 4, SM_F16I = 5 };

/* group a's scale / bias (a counts groups from the matrix start: a / 8 or a / 16 is its super-block) */
INLINE float lds(const Row *r, int64_t a, int sm) {
    switch (sm) {
    case SM_F32: return ((const float *)r->s)[a];
    case SM_F16:
    case SM_F16S:
    case SM_F16I: return half_to_float(((const uint16_t *)r->s)[a]);
    case SM_K:   return half_to_float(r->sup[2 * (a / 8)]) * (float)((const uint8_t *)r->s)[a];
    default:     return half_to_float(r->sup[a / 16]) * (float)((const int8_t *)r->s)[a];
    }
}

INLINE float ldb(const Row *r, int64_t a, int sm) {
    switch (sm) {
    case SM_F32: return ((const float *)r->b)[a];
    case SM_F16: return half_to_float(((const uint16_t *)r->b)[a]);
    case SM_K:   return -(half_to_float(r->sup[2 * (a / 8) + 1]) * (float)((const uint8_t *)r->b)[a]);
    case SM_F16S:
    case SM_F16I: return lds(r, a, sm) * ((const float *)r->b)[0];
    default:     return lds(r, a, sm) * -32.0f;
    }
}

/* Software prefetch of a row's codes r->pf bytes ahead, once per 64-byte line. With M <= 4 (decode) the
 * hardware prefetcher alone left the GEMVs well below the memory's bandwidth, and a fixed distance within
 * the row (1,024 bytes) lands, for short rows, on rows the same tile is already reading (qwen's 896-input
 * Q8_0 rows are 896 bytes). So decode tiles fetch the same chunk of the rows the next tile reads in their
 * place (Row.pf = tile columns x row bytes); bigger M keeps 1,024 bytes ahead in the row (the next tile's
 * rows measured +7% slower at M = 8 on smollm2). Either way only timing changes, never a value. */
#define PF 1024
INLINE void prefetch_codes(int kind, const Row *r, int64_t g) {
#if defined(__SSE__)
    if (kind == Q8 ? (g & 1) == 0 : (g & 3) == 0)
        _mm_prefetch((const char *)(r->c + (kind == Q8 ? 32 : 16) * g + r->pf), _MM_HINT_T0);
#else
    (void)kind; (void)r; (void)g;
#endif
}

INLINE uint32_t high_bits(const Row *r, int64_t g) {
    uint32_t v;
    memcpy(&v, r->h + 4 * g, 4);
    return v;
}

/* Rows of row tile t when M rows are cut into ceil(M / br) tiles of as even a size as can be (the
 * first M % tiles one row taller): 37 rows are 6, 6, 5, 5, 5, 5, 5, not 6 x 6 and a 1-row tile that
 * loads each weight vector for a single FMA (reuse tails, prefill chunk ends; smollm2's matrices at
 * M = 37, 2 threads, benchmarks/qmatmul_sweep.py: -1% AVX-512, -4% AVX2). Only timing depends on it: every (row, weight row) pair computes the same way in any tile ([BATCH-INVARIANT]). */
INLINE int tile_rows(int64_t M, int64_t t, int br) {
    int64_t tiles = (M + br - 1) / br;
    return (int)(M / tiles + (t < M % tiles));
}

/* The AVX-512 path needs BW and VL too (masked byte loads and adds): every AVX-512 CPU since Skylake-X. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define AVX512_PATH 1
#define BUF_PATH 1
#define TILE 8          /* most rows per tile */
#define COLS 3          /* most weight rows (output features) per tile */
#if !(defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__))
const char *tq_isa(void) { return "avx512"; }
#endif

/* The tile shape for a product of M rows: rows x cols x 2 accumulators, at most 24 of the 32 zmm.
 * Any shape gives the same bits ([BATCH-INVARIANT]), so it is picked for speed alone (measured on
 * Zen 4, 2 threads, qwen2.5-0.5b's and smollm2's shapes): decode (M <= 4) reads each weight row once for
 * every row, three weight rows at a time (Q8_0 one: qwen's 151,936 x 896 lm_head ran 4.8 ms with one,
 * 7.0 with two, 8.7 with three under the old in-row prefetch, 4.5 with one under the next tile's; the
 * other layouts were within 3% either way); bigger M shares each dequantized chunk over 8 rows (one weight
 * row at a time: +10-25% at M >= 8 over 4 x 3), except the K-quant modes, whose per-group scale products
 * are dearer and favour 6 rows x 2 weight rows (+20-27%), and the 4-bit codes at M >= 16 (prefill
 * chunks and reuse tails), where 6 x 2 loads each activation vector for two weight rows: smollm2's
 * matrices at M = 256 -4..-8%, M = 37 -2% (at M = 8 it cost +8%; the 5- and 8-bit layouts lost +5% at
 * M = 256 on qwen, so they keep 8 x 1). From M = DQ_M on, the weights are dequantized once into a buffer
 * instead (tiles_buf below) and these shapes serve only the smaller products. */
INLINE void tile_shape(int kind, int g16, int sm, int64_t M, int *rows, int *cols) {
    if (M <= 4) { *rows = 4; *cols = kind == Q8 && !g16 ? 1 : 3; }
    else if (sm == SM_K || sm == SM_K6) { *rows = 6; *cols = 2; }
    else if (M >= 16 && kind == Q4) { *rows = 6; *cols = 2; }
    else { *rows = 8; *cols = 1; }
}

/* Scales and biases of up to 16 consecutive groups of one weight row, as fp32. */
typedef struct { float s[16], b[16]; } Scales16;

/* The K-quant modes' groups a .. a+n-1 (n <= 16; a counts groups from the matrix start) -> sb: the values
 * lds/ldb give one at a time, bit for bit (the same conversions and products, 16 lanes at once: one
 * vector conversion instead of 16 scalar ones; decode is compute-bound on 2 cores, RESULTS.md). a is a
 * multiple of 8 (SM_K) or 16 (SM_K6): blocks start at a row's start or 16 groups on, and a row holds
 * whole super-blocks. (The fp16 modes' single conversion is no dearer inline: they do not come here.) */
INLINE void scales16(const Row *r, int64_t a, int n, int sm, Scales16 *sb) {
    __mmask16 m = (__mmask16)((1u << n) - 1u);
    __m512 s, b;
    if (sm == SM_K) {              /* groups a.. a+7 under super-block a/8, a+8.. under the next */
        const uint16_t *sup = r->sup + 2 * (a / 8);
        float d1 = n > 8 ? half_to_float(sup[2]) : 0.0f, m1 = n > 8 ? half_to_float(sup[3]) : 0.0f;
        __m512 d = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(half_to_float(sup[0])), _mm512_set1_ps(d1));
        __m512 dm = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(half_to_float(sup[1])), _mm512_set1_ps(m1));
        __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, (const uint8_t *)r->s + a)));
        __m512 mn = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, (const uint8_t *)r->b + a)));
        s = _mm512_mul_ps(d, sc);
        b = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(_mm512_mul_ps(dm, mn)),
                                                 _mm512_set1_epi32((int)0x80000000u)));  /* -(dmin*m), as ldb */
    } else {                       /* SM_K6: 16 groups of 16 under one super-block */
        __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, (const int8_t *)r->s + a)));
        s = _mm512_mul_ps(_mm512_set1_ps(half_to_float(r->sup[a / 16])), sc);
        b = _mm512_mul_ps(s, _mm512_set1_ps(-32.0f));
    }
    _mm512_storeu_ps(sb->s, s);
    _mm512_storeu_ps(sb->b, b);
}

/* Chunk g (32 inputs) of a weight row -> w0 (elements 0-15), w1 (16-31), fp32. The scales and biases:
 * sb's entries e0 (elements 0-15) and e1 (16-31) where the block's were computed (sb != NULL), else
 * read here (lds/ldb; after the codes' loads, where the lm_head measured 6% faster than before them). */
INLINE void deq32(int kind, int g16, int sm, const Row *r, int64_t g, const Scales16 *sb, int e0, int e1,
                  __m512 *w0, __m512 *w1) {
    __m512i i0, i1;
    prefetch_codes(kind, r, g);
    if (kind == Q8 && sm == SM_F16I) {      /* c - 128 as a signed byte: c ^ 0x80 */
        i0 = _mm512_cvtepi8_epi32(_mm_xor_si128(_mm_loadu_si128((const __m128i *)(r->c + 32 * g)), _mm_set1_epi8((char)0x80)));
        i1 = _mm512_cvtepi8_epi32(_mm_xor_si128(_mm_loadu_si128((const __m128i *)(r->c + 32 * g + 16)), _mm_set1_epi8((char)0x80)));
    } else if (kind == Q8) {
        i0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(r->c + 32 * g)));
        i1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(r->c + 32 * g + 16)));
    } else {
        __m128i q = _mm_loadu_si128((const __m128i *)(r->c + 16 * g));
        __m128i lo = _mm_and_si128(q, _mm_set1_epi8(0x0F)), hi = _mm_and_si128(_mm_srli_epi16(q, 4), _mm_set1_epi8(0x0F));
        if (kind == Q5) {          /* the fifth bit on the bytes, before widening (two 128-bit ops, not 512) */
            uint32_t hb = high_bits(r, g);
            lo = _mm_mask_add_epi8(lo, (__mmask16)(hb & 0xFFFF), lo, _mm_set1_epi8(16));
            hi = _mm_mask_add_epi8(hi, (__mmask16)(hb >> 16), hi, _mm_set1_epi8(16));
        }
        if (sm == SM_F16I) {       /* c - 8 (Q4) or c - 16 (Q5), signed bytes */
            __m128i k = _mm_set1_epi8(kind == Q5 ? 16 : 8);
            i0 = _mm512_cvtepi8_epi32(_mm_sub_epi8(lo, k));
            i1 = _mm512_cvtepi8_epi32(_mm_sub_epi8(hi, k));
        } else {
            i0 = _mm512_cvtepu8_epi32(lo);
            i1 = _mm512_cvtepu8_epi32(hi);
        }
    }
    if (sm == SM_F16I) {
        int64_t a = r->g0 + g;
        *w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(i0), _mm512_set1_ps(lds(r, a, sm)));
        *w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(i1), _mm512_set1_ps(lds(r, a, sm)));
        return;
    }
    float s0, b0, s1, b1;
    if (sb) {
        s0 = sb->s[e0]; b0 = sb->b[e0]; s1 = sb->s[e1]; b1 = sb->b[e1];
    } else {
        int64_t a = r->g0 + grp(kind, g16, g, 0), b = r->g0 + grp(kind, g16, g, 16);
        s0 = lds(r, a, sm); b0 = ldb(r, a, sm); s1 = lds(r, b, sm); b1 = ldb(r, b, sm);
    }
    *w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i0), _mm512_set1_ps(s0), _mm512_set1_ps(b0));
    *w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i1), _mm512_set1_ps(s1), _mm512_set1_ps(b1));
}

/* Chunk g of R rows times the dequantized chunks of C weight rows, into each pair's accumulators. */
INLINE void fma_chunk(const float *x, int64_t ldx, int R, int C, int64_t g, const __m512 *w0, const __m512 *w1,
                      __m512 a0[][COLS], __m512 a1[][COLS]) {
    for (int r = 0; r < R; r++) {
        __m512 x0 = _mm512_loadu_ps(x + r * ldx + 32 * g), x1 = _mm512_loadu_ps(x + r * ldx + 32 * g + 16);
        if (C > 1) __asm__("" : "+v"(x0), "+v"(x1));   /* loaded once for the C weight rows: GCC
                                                        * otherwise reloads x for every FMA */
        for (int j = 0; j < C; j++) {
            a0[r][j] = _mm512_fmadd_ps(w0[j], x0, a0[r][j]);
            a1[r][j] = _mm512_fmadd_ps(w1[j], x1, a1[r][j]);
        }
    }
}

/* R rows x C weight rows. Each (row, weight row) pair has accumulators a0 (elements 0-15 of every
 * chunk of 32) and a1 (16-31), fed chunk by chunk and summed as reduce(a0 + a1): the same sequence
 * whatever R and C are. */
INLINE void tile(int kind, int g16, int sm, const float *x, int64_t ldx, int R, int C, int64_t K,
                 const Row *rows, float *y, int64_t ldy) {
    __m512 a0[TILE][COLS], a1[TILE][COLS];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < C; j++) { a0[r][j] = _mm512_setzero_ps(); a1[r][j] = _mm512_setzero_ps(); }
    /* The K-quant modes' scales (two conversions and a product each) are computed a block of 16 groups
     * at a time (qwen's 896 x 4864 Q4_K / Q6_K, 2 threads: -25% / -36% at M = 1, -17% / -14% at M = 8);
     * the fp16 modes' single conversion is no dearer inline (blocks measured 0.94-1.09x there), so they
     * take one group at a time. Both give the same values, so the same bits. */
    if (sm == SM_K || sm == SM_K6) {
        const int64_t G = K / 32, per = g16 ? 8 : 16;  /* chunks per block of 16 groups */
        for (int64_t gb = 0; gb < G; gb += per) {
            int nb = (int)(G - gb < per ? G - gb : per);
            Scales16 sb[COLS];
            for (int j = 0; j < C; j++)
                scales16(&rows[j], rows[j].g0 + grp(kind, g16, gb, 0), g16 ? 2 * nb : nb, sm, &sb[j]);
            for (int64_t g = gb; g < gb + nb; g++) {
                int e0 = (int)grp(kind, g16, g - gb, 0), e1 = (int)grp(kind, g16, g - gb, 16);
                __m512 w0[COLS], w1[COLS];
                for (int j = 0; j < C; j++) deq32(kind, g16, sm, &rows[j], g, &sb[j], e0, e1, &w0[j], &w1[j]);
                fma_chunk(x, ldx, R, C, g, w0, w1, a0, a1);
            }
        }
    } else {
        for (int64_t g = 0; g < K / 32; g++) {
            __m512 w0[COLS], w1[COLS];
            for (int j = 0; j < C; j++) deq32(kind, g16, sm, &rows[j], g, NULL, 0, 0, &w0[j], &w1[j]);
            fma_chunk(x, ldx, R, C, g, w0, w1, a0, a1);
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < C; j++) y[r * ldy + j] = _mm512_reduce_add_ps(_mm512_add_ps(a0[r][j], a1[r][j]));
}

/* ---- Big M: each weight row dequantized once per call ----------------------------------------------
 * tile() dequantizes a chunk of its weight rows for every row tile that passes over them: at M = 256 a
 * weight row was dequantized 43 times (6-row tiles). With M >= DQ_M, up to NBUF(K) weight rows are
 * dequantized into a thread's buffer once (dequant_rows) and every row tile of the product runs over
 * them from there (tile_buf, BR x BC). The values are deq32's, stored and reloaded exactly, and tile_buf
 * feeds them to fma_chunk in the same order and reduces the same way as tile(): the same bits, whatever
 * path a row takes ([BATCH-INVARIANT]; benchmarks/qmatmul_sweep.py checks up to M = 100). Measured
 * (2 threads, with fma_chunk's loads kept in registers): smollm2's matrices at M = 256 -18%, M = 37 -10%;
 * qwen's -19% / -13%. Below M = 24 it did not pay (M = 16: +9% on smollm2): the tiles below stay. Tried
 * and dropped: splitting K so that a tile's activations stay in L1 (no gain at K = 1,536 or 4,864, a
 * loss at 896); a 4 x 3 tile (the same as 6 x 2). */
#ifndef DQ_M
#define DQ_M 24
#endif

/* C weight rows -> buf: row j's element e at buf[j * K + e], deq32's values (the K-quant modes' scale
 * blocks computed as tile() computes them). */
INLINE void dequant_rows(int kind, int g16, int sm, int C, int64_t K, const Row *rows, float *buf) {
    if (sm == SM_K || sm == SM_K6) {
        const int64_t G = K / 32, per = g16 ? 8 : 16;
        for (int64_t gb = 0; gb < G; gb += per) {
            int nb = (int)(G - gb < per ? G - gb : per);
            for (int j = 0; j < C; j++) {
                Scales16 sb;
                scales16(&rows[j], rows[j].g0 + grp(kind, g16, gb, 0), g16 ? 2 * nb : nb, sm, &sb);
                for (int64_t g = gb; g < gb + nb; g++) {
                    __m512 w0, w1;
                    deq32(kind, g16, sm, &rows[j], g, &sb, (int)grp(kind, g16, g - gb, 0),
                          (int)grp(kind, g16, g - gb, 16), &w0, &w1);
                    _mm512_store_ps(buf + j * K + 32 * g, w0);
                    _mm512_store_ps(buf + j * K + 32 * g + 16, w1);
                }
            }
        }
    } else {
        for (int j = 0; j < C; j++)
            for (int64_t g = 0; g < K / 32; g++) {
                __m512 w0, w1;
                deq32(kind, g16, sm, &rows[j], g, NULL, 0, 0, &w0, &w1);
                _mm512_store_ps(buf + j * K + 32 * g, w0);
                _mm512_store_ps(buf + j * K + 32 * g + 16, w1);
            }
    }
}

#ifndef BR
#define BR 6            /* tile_buf's rows x weight rows: 24 accumulators a pass */
#define BC 4
#endif

/* One of a tile's two accumulator chains over all of K: off 0 feeds a0 (elements 0-15 of every chunk),
 * off 16 feeds a1 (16-31), each exactly as fma_chunk feeds it (the two chains never mix before the
 * final a0 + a1). A pass holds R x C accumulators instead of 2 R C, so a tile covers twice the
 * pairs and each loaded activation vector serves C = 4 weight rows. */
INLINE void chain(const float *x, int64_t ldx, int R, int C, int64_t K, const float *buf, int off,
                  __m512 a[][BC]) {
    for (int r = 0; r < R; r++)
        for (int j = 0; j < C; j++) a[r][j] = _mm512_setzero_ps();
    for (int64_t g = 0; g < K / 32; g++) {
        __m512 w[BC];
        for (int j = 0; j < C; j++) w[j] = _mm512_load_ps(buf + j * K + 32 * g + off);
        for (int r = 0; r < R; r++) {
            __m512 xv = _mm512_loadu_ps(x + r * ldx + 32 * g + off);
            __asm__("" : "+v"(xv));                        /* once per row, not once per FMA */
            for (int j = 0; j < C; j++) a[r][j] = _mm512_fmadd_ps(w[j], xv, a[r][j]);
        }
    }
}

/* tile() over weights already dequantized into buf (dequant_rows' layout): the same two accumulators
 * per pair, fed in the same order, reduced the same way. Two ways, the same bits:
 *   tile_buf2 (C <= 2) feeds both chains chunk by chunk, as tile() does: 2 R C accumulators;
 *   tile_buf4 (C <= 4) runs the two chains one after the other: R C accumulators a pass, so each loaded
 *   activation vector serves 4 weight rows. Measured (one thread, 256 rows): K = 576 101 vs 78 GFLOP/s,
 *   K = 1,536 75 vs 89 (a 6-row tile's activations, 36 KB, no longer fit in L1 and are read half as
 *   often): tiles_buf picks by K. */
INLINE void tile_buf2(const float *x, int64_t ldx, int R, int C, int64_t K, const float *buf, float *y,
                      int64_t ldy) {
    __m512 a0[TILE][COLS], a1[TILE][COLS];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < C; j++) { a0[r][j] = _mm512_setzero_ps(); a1[r][j] = _mm512_setzero_ps(); }
    for (int64_t g = 0; g < K / 32; g++) {
        __m512 w0[COLS], w1[COLS];
        for (int j = 0; j < C; j++) {
            w0[j] = _mm512_load_ps(buf + j * K + 32 * g);
            w1[j] = _mm512_load_ps(buf + j * K + 32 * g + 16);
        }
        fma_chunk(x, ldx, R, C, g, w0, w1, a0, a1);
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < C; j++) y[r * ldy + j] = _mm512_reduce_add_ps(_mm512_add_ps(a0[r][j], a1[r][j]));
}

INLINE void tile_buf4(const float *x, int64_t ldx, int R, int C, int64_t K, const float *buf, float *y,
                      int64_t ldy) {
    __m512 a0[BR][BC], a1[BR][BC];
    chain(x, ldx, R, C, K, buf, 0, a0);
    chain(x, ldx, R, C, K, buf, 16, a1);
    for (int r = 0; r < R; r++)
        for (int j = 0; j < C; j++) y[r * ldy + j] = _mm512_reduce_add_ps(_mm512_add_ps(a0[r][j], a1[r][j]));
}

/* From this K on, tiles_buf runs 6 x 4 chain tiles, below it 6 x 2 paired ones. */
#ifndef KCHAIN
#define KCHAIN 1024
#endif


/* All M rows of x times the nw weight rows in buf: row tiles outer (a tile's rows stay in L1 or L2 while
 * it passes over the buffer), 6 x 2 or 6 x 4 tiles by K. */
static void tiles_buf(const float *x, int64_t K, int64_t M, int64_t nw, const float *buf, float *y, int64_t ldy) {
    const int bc = K >= KCHAIN ? 4 : 2;
    for (int64_t m = 0, t = 0; m < M; m += tile_rows(M, t++, BR)) {
        int R = tile_rows(M, t, BR);
        const float *xm = x + m * K;
        for (int64_t n = 0; n < nw; n += bc) {
            int C = (int)(nw - n < bc ? nw - n : bc);
            float *ym = y + m * ldy + n;
            const float *bn = buf + n * K;
            switch ((R * 8 + C) * (bc == 4 ? -1 : 1)) {
#define BCASE(R_, C_) case (R_) * 8 + (C_): tile_buf2(xm, K, R_, C_, K, bn, ym, ldy); break; \
                      case -((R_) * 8 + (C_)): tile_buf4(xm, K, R_, C_, K, bn, ym, ldy); break;
#define BCASE4(R_, C_) case -((R_) * 8 + (C_)): tile_buf4(xm, K, R_, C_, K, bn, ym, ldy); break;
#define BCASES_C(C_) BCASE(1, C_) BCASE(2, C_) BCASE(3, C_) BCASE(4, C_) BCASE(5, C_) BCASE(6, C_)
#define BCASES_C4(C_) BCASE4(1, C_) BCASE4(2, C_) BCASE4(3, C_) BCASE4(4, C_) BCASE4(5, C_) BCASE4(6, C_)
            BCASES_C(1) BCASES_C(2) BCASES_C4(3) BCASES_C4(4)
#undef BCASES_C
#undef BCASES_C4
#undef BCASE
#undef BCASE4
            default: break;
            }
        }
    }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include "qmatmul_amx.h"
#endif
#elif defined(__AVX2__) && defined(__FMA__)
#define TILE 4
#define COLS 1          /* 16 vector registers leave no room for more weight rows */
const char *tq_isa(void) { return "avx2"; }

INLINE float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The K-quant modes' scales and biases of 8 consecutive groups from group a (a multiple of 8, so one
 * super-block for SM_K, half of one for SM_K6), as fp32: lds/ldb's values, 8 lanes at once (as the
 * AVX-512 path's scales16; blocks always whole here: a K-quant row holds whole super-blocks). */
typedef struct { float s[8], b[8]; } Scales8;
INLINE void scales8(const Row *r, int64_t a, int sm, Scales8 *sb) {
    __m128i raw = _mm_loadl_epi64((const __m128i *)((const uint8_t *)r->s + a));
    __m256 s, b;
    if (sm == SM_K) {
        const uint16_t *sup = r->sup + 2 * (a / 8);
        __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)((const uint8_t *)r->b + a))));
        s = _mm256_mul_ps(_mm256_set1_ps(half_to_float(sup[0])), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(raw)));
        b = _mm256_xor_ps(_mm256_mul_ps(_mm256_set1_ps(half_to_float(sup[1])), mn), _mm256_set1_ps(-0.0f));  /* -(dmin*m) */
    } else {
        s = _mm256_mul_ps(_mm256_set1_ps(half_to_float(r->sup[a / 16])), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw)));
        b = _mm256_mul_ps(s, _mm256_set1_ps(-32.0f));
    }
    _mm256_storeu_ps(sb->s, s);
    _mm256_storeu_ps(sb->b, b);
}

/* The fifth bits of a Q5 chunk as bytes: byte e of the result is 16 where bit e of hb is set, else 0
 * (elements 0-15 in the low 128 bits, 16-31 in the high). Each byte picks its byte of hb, sets every
 * other bit and compares with all-ones: 5 vector operations for 32 elements, where widening first and
 * testing 8 lanes at a time took 16. */
INLINE __m256i high_bytes(uint32_t hb) {
    const __m256i pick = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                          2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)hb), pick);
    v = _mm256_or_si256(v, _mm256_set1_epi64x((long long)0x7FBFDFEFF7FBFDFEull));
    return _mm256_and_si256(_mm256_cmpeq_epi8(v, _mm256_set1_epi8(-1)), _mm256_set1_epi8(16));
}

/* 8 bytes at p -> 8 int32 lanes (one load-and-widen instruction). */
INLINE __m256i widen8(const uint8_t *p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }

/* Chunk g of a weight row -> w[t], elements 8t..8t+7, fp32: w = fma(c, scale, bias) from unsigned codes.
 * The scales: sb's entries (group of element 8t, counted from gb, the block's first chunk) where a
 * block's were computed (sb != NULL), else lds/ldb. SM_F16I is read as SM_F16S here: fma(c, d, -k d)
 * is the one rounding of the exact d (c - k) (-k d is exact), the value the AVX-512 path's product
 * gives, and unsigned codes widen straight from memory (8 bytes an instruction; 4-bit codes split in
 * the 32-bit lanes after): 4-bit chunks 9 -> 6 integer operations, 8-bit 8 -> 4, and Q5's fifth bit
 * added to the bytes (high_bytes) instead of lane by lane. Same values as before, so the same bits. */
INLINE void deq32(int kind, int g16, int sm, const Row *r, int64_t g, const Scales8 *sb, int64_t gb, __m256 w[4]) {
    __m256i i[4];
    prefetch_codes(kind, r, g);
    if (kind == Q8) {
        for (int t = 0; t < 4; t++) i[t] = widen8(r->c + 32 * g + 8 * t);
    } else if (kind == Q4) {      /* byte j: element j (low nibble), j + 16 (high) */
        __m256i b0 = widen8(r->c + 16 * g), b1 = widen8(r->c + 16 * g + 8), m = _mm256_set1_epi32(0x0F);
        i[0] = _mm256_and_si256(b0, m); i[1] = _mm256_and_si256(b1, m);
        i[2] = _mm256_srli_epi32(b0, 4); i[3] = _mm256_srli_epi32(b1, 4);
    } else {
        __m128i q = _mm_loadu_si128((const __m128i *)(r->c + 16 * g));
        __m256i hb = high_bytes(high_bits(r, g));
        __m128i lo = _mm_add_epi8(_mm_and_si128(q, _mm_set1_epi8(0x0F)), _mm256_castsi256_si128(hb));
        __m128i hi = _mm_add_epi8(_mm_and_si128(_mm_srli_epi16(q, 4), _mm_set1_epi8(0x0F)),
                                  _mm256_extracti128_si256(hb, 1));
        i[0] = _mm256_cvtepu8_epi32(lo); i[1] = _mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8));
        i[2] = _mm256_cvtepu8_epi32(hi); i[3] = _mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8));
    }
    for (int t = 0; t < 4; t++) {
        if (sb) {
            int e = (int)grp(kind, g16, g - gb, 8 * t);
            w[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i[t]), _mm256_set1_ps(sb->s[e]), _mm256_set1_ps(sb->b[e]));
        } else {
            int64_t a = r->g0 + grp(kind, g16, g, 8 * t);
            w[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i[t]), _mm256_set1_ps(lds(r, a, sm)), _mm256_set1_ps(ldb(r, a, sm)));
        }
    }
}

/* Chunk g of R rows times a dequantized chunk w of one weight row, into each row's accumulators a0
 * (elements 0-7 and 16-23 of each chunk) and a1 (8-15, 24-31). */
INLINE void fma_chunk(const float *x, int64_t ldx, int R, int64_t g, const __m256 w[4], __m256 *a0, __m256 *a1) {
    for (int r = 0; r < R; r++) {
        const float *xr = x + r * ldx + 32 * g;
        a0[r] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xr), a0[r]);
        a1[r] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xr + 8), a1[r]);
        a0[r] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xr + 16), a0[r]);
        a1[r] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xr + 24), a1[r]);
    }
}

/* The K-quant modes' scales come a block at a time where a row holds whole blocks (8 groups; 4 chunks
 * of q8g16). */
#define BLOCKED(sm, g16, K) (((sm) == SM_K || (sm) == SM_K6) && ((K) / 32) % ((g16) ? 4 : 8) == 0)

/* R rows x one weight row: fma_chunk's accumulators, summed as hsum8(a0 + a1). */
INLINE void tile(int kind, int g16, int sm, const float *x, int64_t ldx, int R, int C, int64_t K,
                 const Row *rows, float *y, int64_t ldy) {
    (void)C;
    __m256 a0[TILE], a1[TILE];
    for (int r = 0; r < R; r++) { a0[r] = _mm256_setzero_ps(); a1[r] = _mm256_setzero_ps(); }
    const int blocked = BLOCKED(sm, g16, K);
    Scales8 sb;
    for (int64_t g = 0; g < K / 32; g++) {
        __m256 w[4];
        int64_t gb = blocked ? g - g % (g16 ? 4 : 8) : 0;   /* the block's first chunk */
        if (blocked && g == gb) scales8(&rows[0], rows[0].g0 + grp(kind, g16, g, 0), sm, &sb);
        deq32(kind, g16, sm, &rows[0], g, blocked ? &sb : NULL, gb, w);
        fma_chunk(x, ldx, R, g, w, a0, a1);
    }
    for (int r = 0; r < R; r++) y[r * ldy] = hsum8(_mm256_add_ps(a0[r], a1[r]));
}

/* Big M (see the AVX-512 path's note): one weight row dequantized into buf (deq32's values, as tile()
 * computes them), then every row tile runs over it: the same bits. C is 1 here. */
#define BUF_PATH 1
#ifndef DQ_M
#define DQ_M 24
#endif
#define BR 6            /* 12 accumulators and the 4 weight vectors: all 16 ymm */
#define BC 1
INLINE void dequant_rows(int kind, int g16, int sm, int C, int64_t K, const Row *rows, float *buf) {
    (void)C;
    const int blocked = BLOCKED(sm, g16, K);
    Scales8 sb;
    for (int64_t g = 0; g < K / 32; g++) {
        __m256 w[4];
        int64_t gb = blocked ? g - g % (g16 ? 4 : 8) : 0;
        if (blocked && g == gb) scales8(&rows[0], rows[0].g0 + grp(kind, g16, g, 0), sm, &sb);
        deq32(kind, g16, sm, &rows[0], g, blocked ? &sb : NULL, gb, w);
        for (int t = 0; t < 4; t++) _mm256_store_ps(buf + 32 * g + 8 * t, w[t]);
    }
}

INLINE void tile_buf(const float *x, int64_t ldx, int R, int64_t K, const float *buf, float *y, int64_t ldy) {
    __m256 a0[BR], a1[BR];
    for (int r = 0; r < R; r++) { a0[r] = _mm256_setzero_ps(); a1[r] = _mm256_setzero_ps(); }
    for (int64_t g = 0; g < K / 32; g++) {
        __m256 w[4];
        for (int t = 0; t < 4; t++) w[t] = _mm256_load_ps(buf + 32 * g + 8 * t);
        fma_chunk(x, ldx, R, g, w, a0, a1);
    }
    for (int r = 0; r < R; r++) y[r * ldy] = hsum8(_mm256_add_ps(a0[r], a1[r]));
}

/* All M rows of x times the nw weight rows in buf (row j at buf + j * K): BR x 1 tiles. */
static void tiles_buf(const float *x, int64_t K, int64_t M, int64_t nw, const float *buf, float *y, int64_t ldy) {
    for (int64_t m = 0, t = 0; m < M; m += tile_rows(M, t++, BR)) {
        int R = tile_rows(M, t, BR);
        for (int64_t n = 0; n < nw; n++) {
            const float *xm = x + m * K, *bn = buf + n * K;
            float *ym = y + m * ldy + n;
            switch (R) {
            case 1: tile_buf(xm, K, 1, K, bn, ym, ldy); break;
            case 2: tile_buf(xm, K, 2, K, bn, ym, ldy); break;
            case 3: tile_buf(xm, K, 3, K, bn, ym, ldy); break;
            case 4: tile_buf(xm, K, 4, K, bn, ym, ldy); break;
            case 5: tile_buf(xm, K, 5, K, bn, ym, ldy); break;
            default: tile_buf(xm, K, 6, K, bn, ym, ldy); break;
            }
        }
    }
}

#else
#define TILE 4
#define COLS 1
const char *tq_isa(void) { return "scalar"; }

INLINE int code(int kind, const Row *r, int64_t g, int e) {
    if (kind == Q8) return r->c[32 * g + e];
    uint8_t b = r->c[16 * g + (e & 15)];
    int v = e < 16 ? b & 15 : b >> 4;
    return kind == Q5 ? v | (int)((high_bits(r, g) >> e) & 1) << 4 : v;
}

INLINE void tile(int kind, int g16, int sm, const float *x, int64_t ldx, int R, int C, int64_t K,
                 const Row *rows, float *y, int64_t ldy) {
    (void)C;
    for (int r = 0; r < R; r++) {
        float acc = 0.0f;
        for (int64_t g = 0; g < K / 32; g++)
            for (int e = 0; e < 32; e++) {
                int64_t a = rows[0].g0 + grp(kind, g16, g, e);
                float w = __builtin_fmaf(lds(&rows[0], a, sm), (float)code(kind, &rows[0], g, e), ldb(&rows[0], a, sm));
                acc = __builtin_fmaf(w, x[r * ldx + 32 * g + e], acc);
            }
        y[r * ldy] = acc;
    }
}
#endif

#if !defined(AVX512_PATH)
/* One tile shape for every M on the AVX2 and scalar paths (16 vector registers hold no bigger tile). */
INLINE void tile_shape(int kind, int g16, int sm, int64_t M, int *rows, int *cols) { (void)kind; (void)g16; (void)sm; (void)M; *rows = TILE; *cols = COLS; }
#endif

/* Output features per parallel task: its weights stay in L2 while every row tile passes over them. */
#define NCHUNK 48

/* Dispatch a tile to constant (R, C), so that the compiler keeps the accumulators in registers. Only
 * the shapes tile_shape and the edges of a product can ask for are instantiated: a full or edge tile
 * of rows x cols is R <= rows, C <= cols. */
#define CASE(KIND, G16, SM, R_, C_) \
    case (R_) * 8 + (C_): tile(KIND, G16, SM, xm, K, R_, C_, K, rows, ym, ldy); break;
#define C1_4(K_, G_, S_, C_) CASE(K_, G_, S_, 1, C_) CASE(K_, G_, S_, 2, C_) CASE(K_, G_, S_, 3, C_) CASE(K_, G_, S_, 4, C_)
#if TILE == 8
#define CASES(K_, G_, S_) C1_4(K_, G_, S_, 1) CASE(K_, G_, S_, 5, 1) CASE(K_, G_, S_, 6, 1) CASE(K_, G_, S_, 7, 1) \
    CASE(K_, G_, S_, 8, 1) C1_4(K_, G_, S_, 2) CASE(K_, G_, S_, 5, 2) CASE(K_, G_, S_, 6, 2) C1_4(K_, G_, S_, 3)
#else
#define CASES(K_, G_, S_) C1_4(K_, G_, S_, 1)
#endif

#if defined(BUF_PATH)
#ifndef NBUF_BYTES
#define NBUF_BYTES 196608   /* a thread's dequantized weight rows: in L2 beside the activations */
#endif
/* weight rows per buffer for K inputs: as many as NBUF_BYTES hold, a multiple of BC, at most NCHUNK */
#define NBUF(K) ((int64_t)(NBUF_BYTES / (4 * (K)) / BC * BC < BC ? BC : NBUF_BYTES / (4 * (K)) / BC * BC > NCHUNK ? NCHUNK : NBUF_BYTES / (4 * (K)) / BC * BC))
/* M >= DQ_M: per parallel task (NCHUNK weight rows), NBUF(K) weight rows at a time are dequantized
 * into the thread's part of bufs (nthreads x NBUF(K) x K floats, allocated by the caller) and every
 * BR-row tile of x runs over them. */
#define BUFFERED(M) ((M) >= DQ_M)
#define DEFINE_MM_BUF(NAME, KIND, G16, SM)                                                  \
static void NAME##_buf(const float *x, int64_t M, int64_t K, const uint8_t *codes,          \
          const uint8_t *high, const void *scale, const void *bias, const uint16_t *sup,    \
          int64_t N, float *y, int64_t ldy, int nthreads, float *bufs) {                    \
    int64_t ldc = (KIND) == Q8 ? K : K / 2, ldg = K / ((G16) ? 16 : 32);                    \
    int64_t nchunks = (N + NCHUNK - 1) / NCHUNK;                                            \
    _Pragma("omp parallel num_threads(nthreads)")                                           \
    {                                                                                       \
        float *buf = bufs + (int64_t)omp_get_thread_num() * NBUF(K) * K;                    \
        const int64_t nbuf = NBUF(K);                                                       \
        _Pragma("omp for schedule(static)")                                                 \
        for (int64_t ch = 0; ch < nchunks; ch++) {                                          \
            int64_t n0 = ch * NCHUNK, n1 = n0 + NCHUNK < N ? n0 + NCHUNK : N;               \
            for (int64_t nb0 = n0; nb0 < n1; nb0 += nbuf) {                                 \
                int64_t nb1 = nb0 + nbuf < n1 ? nb0 + nbuf : n1;                            \
                Row rows[1];                                                                \
                for (int64_t n = nb0; n < nb1; n++) {                                       \
                    rows[0].c = codes + n * ldc;                                            \
                    rows[0].h = (KIND) == Q5 ? high + n * (K / 8) : NULL;                   \
                    rows[0].s = scale; rows[0].b = bias; rows[0].sup = sup;                 \
                    rows[0].g0 = n * ldg;                                                   \
                    rows[0].pf = PF;                                                        \
                    dequant_rows(KIND, G16, SM, 1, K, rows, buf + (n - nb0) * K);           \
                }                                                                           \
                tiles_buf(x, K, M, nb1 - nb0, buf, y + nb0, ldy);                           \
            }                                                                               \
        }                                                                                   \
    }                                                                                       \
}
#else
#define BUFFERED(M) 0
#define NBUF(K) 1
#define DEFINE_MM_BUF(NAME, KIND, G16, SM)                                                  \
static void NAME##_buf(const float *x, int64_t M, int64_t K, const uint8_t *codes,          \
          const uint8_t *high, const void *scale, const void *bias, const uint16_t *sup,    \
          int64_t N, float *y, int64_t ldy, int nthreads, float *bufs) {                    \
    (void)bufs; (void)x; (void)M; (void)K; (void)codes; (void)high; (void)scale; (void)bias; (void)sup; \
    (void)N; (void)y; (void)ldy; (void)nthreads;                                            \
}
#endif

/* x: (M, K) fp32 contiguous; y: rows of stride ldy (a column slice of a wider output is fine);
 * high: the q5g32 high bits, sup: the K-quant super-block scales, else unused. nthreads: passed in, not taken from OpenMP's per-thread
 * default: the caller is often not the thread torch.set_num_threads ran on. */
#define DEFINE_MM(NAME, KIND, G16, SM)                                                      \
DEFINE_MM_BUF(NAME, KIND, G16, SM)                                                          \
static void NAME##_sm(const float *x, int64_t M, int64_t K, const uint8_t *codes,           \
          const uint8_t *high, const void *scale, const void *bias, const uint16_t *sup,    \
          int64_t N, float *y, int64_t ldy, int nthreads) {                                 \
    int64_t ldc = (KIND) == Q8 ? K : K / 2, ldg = K / ((G16) ? 16 : 32);                    \
    int64_t nchunks = (N + NCHUNK - 1) / NCHUNK;                                            \
    if (BUFFERED(M)) {             /* no buffer (out of memory): the tiles below, same bits */ \
        float *buf = aligned_alloc(64, (size_t)(nthreads * NBUF(K) * K) * sizeof(float));        \
        if (buf) {                                                                          \
            NAME##_buf(x, M, K, codes, high, scale, bias, sup, N, y, ldy, nthreads, buf);   \
            free(buf);                                                                      \
            return;                                                                         \
        }                                                                                   \
    }                                                                                       \
    int trows, tcols;                                                                       \
    tile_shape(KIND, G16, SM, M, &trows, &tcols);                                                     \
    _Pragma("omp parallel for schedule(static) num_threads(nthreads)")                      \
    for (int64_t ch = 0; ch < nchunks; ch++) {                                              \
        int64_t n0 = ch * NCHUNK, n1 = n0 + NCHUNK < N ? n0 + NCHUNK : N;                   \
        for (int64_t m = 0; m < M; m += trows) {                                            \
            int R = (int)(M - m < trows ? M - m : trows);                                   \
            for (int64_t n = n0; n < n1; n += tcols) {                                      \
                int C = (int)(n1 - n < tcols ? n1 - n : tcols);                             \
                Row rows[COLS];                                                             \
                for (int j = 0; j < C; j++) {                                               \
                    rows[j].c = codes + (n + j) * ldc;                                      \
                    rows[j].h = (KIND) == Q5 ? high + (n + j) * (K / 8) : NULL;             \
                    rows[j].s = scale; rows[j].b = bias; rows[j].sup = sup;                 \
                    rows[j].g0 = (n + j) * ldg;                                             \
                    rows[j].pf = M <= 4 ? tcols * ldc : PF;                                \
                }                                                                           \
                const float *xm = x + m * K;                                                \
                float *ym = y + m * ldy + n;                                                \
                switch (R * 8 + C) {                                                        \
                    CASES(KIND, G16, SM)                                                    \
                    default: break;                                                         \
                }                                                                           \
            }                                                                               \
        }                                                                                   \
    }                                                                                       \
}

#define MM_ARGS(T) const float *x, int64_t M, int64_t K, const uint8_t *codes, const uint8_t *high, \
    const void *scale, const void *bias, const uint16_t *sup, int64_t N, float *y, int64_t ldy, int nthreads
#define MM_PASS x, M, K, codes, high, scale, bias, sup, N, y, ldy, nthreads

#if !defined(AMX_PATH)
/* Builds without AMX tiles: nothing to ask the OS for. */
int tq_amx_init(void) { return 0; }
#define AMX_OR(KIND, G16, SM)
#else
/* On an AMX build whose process was granted the tiles (tq_amx_init), every product takes them. */
#define AMX_OR(KIND, G16, SM) if (amx_on) { amx_mm(KIND, G16, SM, MM_PASS); return; }
#endif

/* The exported entries. An SM_F16S matrix whose constant is the layout's own offset takes SM_F16I. */
#define EXPORT_MM(NAME, KIND, G16, SM) \
    DEFINE_MM(NAME, KIND, G16, SM) \
    void NAME(MM_ARGS()) { AMX_OR(KIND, G16, SM) NAME##_sm(MM_PASS); }
#define EXPORT_MM_F16S(NAME, KIND) \
    DEFINE_MM(NAME##_any, KIND, 0, SM_F16S) \
    DEFINE_MM(NAME##_int, KIND, 0, SM_F16I) \
    void NAME(MM_ARGS()) { \
        float k = (KIND) == Q8 ? 128.0f : (KIND) == Q5 ? 16.0f : 8.0f; \
        if (((const float *)bias)[0] == -k) { AMX_OR(KIND, 0, SM_F16I) NAME##_int_sm(MM_PASS); } \
        else { AMX_OR(KIND, 0, SM_F16S) NAME##_any_sm(MM_PASS); } \
    }

/* tq_<layout>_<scale mode>_mm: the combinations GGML's types need (models/qweight.py) */
EXPORT_MM(tq_q4g32_f32_mm, Q4, 0, SM_F32)
EXPORT_MM(tq_q4g32_f16_mm, Q4, 0, SM_F16)
EXPORT_MM(tq_q4g32_k_mm, Q4, 0, SM_K)
EXPORT_MM_F16S(tq_q4g32_f16s_mm, Q4)
EXPORT_MM(tq_q5g32_f32_mm, Q5, 0, SM_F32)
EXPORT_MM(tq_q5g32_f16_mm, Q5, 0, SM_F16)
EXPORT_MM(tq_q5g32_k_mm, Q5, 0, SM_K)
EXPORT_MM_F16S(tq_q5g32_f16s_mm, Q5)
EXPORT_MM(tq_q8g16_f32_mm, Q8, 1, SM_F32)
EXPORT_MM(tq_q8g16_f16_mm, Q8, 1, SM_F16)
EXPORT_MM(tq_q8g16_k6_mm, Q8, 1, SM_K6)
EXPORT_MM(tq_q8g32_f32_mm, Q8, 0, SM_F32)
EXPORT_MM(tq_q8g32_f16_mm, Q8, 0, SM_F16)
EXPORT_MM_F16S(tq_q8g32_f16s_mm, Q8)
