/* Weight-only quantized matmul with weight rows in the vector lanes ("lanes" layouts): y[m, n] =
 * sum_k x[m, k] * w[n, k] for every GGML type kept quantized: Q4_0, Q4_1, Q4_K (q4x16), Q5_0, Q5_1, Q5_K
 * (q5x16), Q8_0 (q8x16), Q6_K (q6x16; models/qweight.py). Activations and accumulation stay fp32.
 *
 * Why lanes: the row kernels this replaced put the inputs k in the lanes, so every output ended in a
 * horizontal sum and a prefill tile ran at 123-278 GFLOP/s against a measured 477 peak
 * (benchmarks/RESULTS.md, Decisions: weight rows in the vector lanes). Here lane j of a vector is weight
 * row j of a block of 16, an activation is broadcast, and every output is one chain of FMAs in the order
 * of k: no horizontal sum, and a row's bits depend on nothing but that order.
 *
 * The value, per output (m, n), groups g = 0 .. K/32-1 in order (GGML's own two-level structure):
 *     S_g = 0; S_g = fma(c'_k, x[m, k], S_g) for the 32 inputs k of g, in order
 *     T = fma(s_g, S_g, T)                     (T starts at 0)
 *     T = fma(b_g, X_g[m], T)                  (modes with a bias; X_g[m] = x's 32 inputs of g added in order)
 *     y[m, n] = T
 * where c' is the code minus the layout's own offset (8, 16, 128) when the matrix's bias is exactly that
 * offset times its scale (Q4_0, Q5_0, Q8_0: mode "f16s" with constant -8/-16/-128; then there is no bias
 * term), else the raw code. So w = s * c' (+ b) is GGML's dequantized weight, and the scale is applied
 * once per group, which keeps the error near the row kernels' (the probe: 1.4-4.6e-7 of max|y|, against
 * 0.8-2.2e-6 for one chain over all of K).
 *
 * [BATCH-INVARIANT] Every path below (the GEMV for small M, the buffered GEMM for large M, any tile, any
 * thread count) computes each output by exactly that sequence: lanes never mix, so neither the number
 * of rows nor the vector width (AVX-512, AVX2, SSE: VN lanes, vec.h) changes a bit. Threads split the
 * blocks of weight rows, never k. (A build without FMA rounds fman twice: its own bits, in its own digest.)
 *
 * Layouts (K a multiple of 32; block b = weight rows 16b .. 16b+15, lane j = row 16b + j; N rows in
 * ceil(N/16) blocks, the last one padded with zero codes and scales where N % 16 != 0):
 *   q4x16: codes (N/16, K/2, 16) bytes: [b][p][j] = code(16b+j, 2p) | code(16b+j, 2p+1) << 4
 *   q5x16: q4x16's codes (the low four bits) plus high (N/16, K) uint16 (little-endian): bit j of [b][k]
 *          is the fifth bit (value 16) of code(16b+j, k)
 *   q8x16: codes (N/16, K, 16) bytes 0..255: [b][k][j] = code(16b+j, k)
 *   scale: (N/16, K/32, 16) fp32 ("f32") or fp16 ("f16", "f16s"); bias: the same shape ("f32", "f16"),
 *          or for "f16s" one fp32 constant C (bias = scale * C, the product in fp32).
 * Decode reads every weight byte once a token: these hold exactly GGML's bytes per weight.
 *
 * The quantized product of every build (the opt-in AMX build aside: qamx.c, row layouts). Built by
 * kernels/build.py (cc -O3 -march=native -ffp-contract=off -fopenmp).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "layouts.h"
#include "vec.h"

#define LINLINE static inline __attribute__((always_inline))

enum { L4 = 4, L5 = 5, L8 = 8 };                 /* code kinds: named and numbered by layouts.h's bits column */
/* Scale modes (models/qweight.py's, numbered by layouts.h's MODE lines): LM_F16I is LM_F16S whose
 * constant is the layout's own offset (picked per call); LM_K: Q4_K / Q5_K's uint8 sc and m per group of
 * 32 under an fp16 (d, dmin) per 256 inputs (scale d*sc, bias -(dmin*m): exact fp32 products); LM_K6:
 * Q6_K's int8 sc per group of 16 under an fp16 d per 256 (scale d*sc, codes c - 32, no bias). */
enum { LM_F32 = TQ_MODE_f32, LM_F16 = TQ_MODE_f16, LM_K = TQ_MODE_k, LM_K6 = TQ_MODE_k6, LM_F16S = TQ_MODE_f16s,
       LM_F16I = TQ_NMODES };

#define BLK 16                  /* weight rows a block (interleaved in the layout) */
#define NV (BLK / VN)           /* vectors a block */
#define GS(mode) ((mode) == LM_K6 ? 16 : 32)          /* inputs a group */
#define HAS_BIAS(mode) ((mode) != LM_F16I && (mode) != LM_K6)

/* One matrix in a lanes layout (see the top of the file), K inputs. */
typedef struct {
    const uint8_t *codes;
    const uint16_t *high;       /* q5x16's fifth bits, else NULL */
    const void *scale, *bias;
    const uint16_t *sup;        /* LM_K: fp16 (N/16, K/256, 2, 16) d, dmin; LM_K6: (N/16, K/256, 16) d */
    int64_t K;
} LMat;

/* ---- codes --------------------------------------------------------------------------------------- */

/* ---- codes: the byte work on VN bytes (16 on AVX-512: one xmm), then one widening to int32 lanes (the
 * GEMV's cost per weight: doing the offset and the fifth bits on the bytes instead of the int32 lanes
 * took 4 of 10 zmm operations a pair off the decode loop). ---- */
#if VN == 16
typedef __m128i bytes_t;
LINLINE bytes_t ld_bytes(const uint8_t *p) { return _mm_loadu_si128((const __m128i *)p); }
#elif VN == 8
typedef __m128i bytes_t;             /* the low 8 bytes */
LINLINE bytes_t ld_bytes(const uint8_t *p) { return _mm_loadl_epi64((const __m128i *)p); }
#else
typedef struct { int8_t b[VN]; } bytes_t;
LINLINE bytes_t ld_bytes(const uint8_t *p) { bytes_t r; memcpy(r.b, p, VN); return r; }
#endif

/* signed bytes -> int32 lanes -> floats */
LINLINE vf widen_s(bytes_t q) {
#if VN == 16
    return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q));
#elif VN == 8
    return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
#else
    vf r;
    for (int j = 0; j < VN; j++) r[j] = (float)q.b[j];
    return r;
#endif
}

/* unsigned bytes -> floats */
LINLINE vf widen_u(bytes_t q) {
#if VN == 16
    return (vf)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q));
#elif VN == 8
    return (vf)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q));
#else
    vf r;
    for (int j = 0; j < VN; j++) r[j] = (float)(uint8_t)q.b[j];
    return r;
#endif
}

LINLINE bytes_t sub_bytes(bytes_t q, int k) {
#if VN >= 8
    return _mm_sub_epi8(q, _mm_set1_epi8((char)k));
#else
    for (int j = 0; j < VN; j++) q.b[j] = (int8_t)(uint8_t)((uint8_t)q.b[j] - k);
    return q;
#endif
}

LINLINE void nibbles(bytes_t q, bytes_t *lo, bytes_t *hi) {
#if VN >= 8
    const __m128i m = _mm_set1_epi8(0x0F);
    *lo = _mm_and_si128(q, m);
    *hi = _mm_and_si128(_mm_srli_epi16(q, 4), m);
#else
    for (int j = 0; j < VN; j++) { lo->b[j] = (int8_t)((uint8_t)q.b[j] & 15); hi->b[j] = (int8_t)((uint8_t)q.b[j] >> 4); }
#endif
}

#if VN < 8
/* FIFTH[m] = VN bytes, byte j 16 if bit j of m is set, else 0: a lane's fifth bit from one load (AVX-512
 * uses a masked add instead, AVX2 FIFTH32 below). */
static uint8_t FIFTH[1 << VN][VN] __attribute__((aligned(64)));
__attribute__((constructor)) static void fill_fifth(void) {
    for (int m = 0; m < (1 << VN); m++)
        for (int j = 0; j < VN; j++) FIFTH[m][j] = (m >> j & 1) ? 16 : 0;
}
#endif

#if VN != 8
/* + 16 on the bytes whose bit in m (lanes v * VN ..) is set */
LINLINE bytes_t add_fifth(bytes_t q, unsigned m, int v) {
#if VN == 16
    (void)v;
    return _mm_mask_add_epi8(q, (__mmask16)m, q, _mm_set1_epi8(16));
#else
    const uint8_t *f = FIFTH[(m >> (VN * v)) & ((1u << VN) - 1)];
    for (int j = 0; j < VN; j++) q.b[j] = (int8_t)(uint8_t)((uint8_t)q.b[j] + f[j]);
    return q;
#endif
}
#endif

#if VN == 8
/* AVX2's codes work in the int32 lanes instead (no mask add to make the byte work pay): eight bytes widen
 * straight from memory (vpmovzxbd), a pair of 4-bit codes splits there (and / shift: 2 operations for 16
 * codes where the bytes took 3 and a widening each), and Q5's fifth bits come from FIFTH32, whose words
 * are 2^23's float bits (0x4B000000) with 16 added where the lane's bit is set: or-ed onto the code, the
 * float is exactly 2^23 + c, and subtracting 2^23 + offset leaves c' (exact: every value an integer below
 * 2^24). The same values as the byte path, so the same bits. */
static uint32_t FIFTH32[256][8] __attribute__((aligned(32)));
__attribute__((constructor)) static void fill_fifth32(void) {
    for (int m = 0; m < 256; m++)
        for (int j = 0; j < 8; j++) FIFTH32[m][j] = 0x4B000000u | ((m >> j & 1) ? 16u : 0u);
}

LINLINE __m256i widen8(const uint8_t *p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }

/* int32 lanes c -> the floats c - off */
LINLINE vf int_codes(__m256i c, int hasoff, int off) {
    const vf f = (vf)_mm256_cvtepi32_ps(c);
    return hasoff ? f - splatn((float)off) : f;
}

LINLINE void codes_pair8(int kind, int hasoff, int off, const LMat *w, int64_t b, int64_t p, int v, vf *c0, vf *c1) {
    const int64_t K = w->K;
    if (kind == L8) {
        *c0 = int_codes(widen8(w->codes + (b * K + 2 * p) * BLK + v * VN), hasoff, off);
        *c1 = int_codes(widen8(w->codes + (b * K + 2 * p + 1) * BLK + v * VN), hasoff, off);
        return;
    }
    const __m256i q = widen8(w->codes + (b * (K / 2) + p) * BLK + v * VN);
    const __m256i lo = _mm256_and_si256(q, _mm256_set1_epi32(0x0F)), hi = _mm256_srli_epi32(q, 4);
    if (kind == L5) {        /* byte v of the little-endian uint16 at (b, k): lanes 8v .. 8v + 7's bits */
        const uint8_t *h = (const uint8_t *)(w->high + b * K + 2 * p);
        const vf bias = splatn(8388608.0f + (float)off);
        *c0 = (vf)_mm256_castsi256_ps(_mm256_or_si256(lo, _mm256_load_si256((const __m256i *)FIFTH32[h[v]]))) - bias;
        *c1 = (vf)_mm256_castsi256_ps(_mm256_or_si256(hi, _mm256_load_si256((const __m256i *)FIFTH32[h[2 + v]]))) - bias;
        return;
    }
    *c0 = int_codes(lo, hasoff, off);
    *c1 = int_codes(hi, hasoff, off);
}
#endif

/* The offset subtracted from the codes of (kind, mode): see the top of the file. */
LINLINE int code_off(int kind, int mode) {
    return mode == LM_K6 ? 32 : mode != LM_F16I ? 0 : kind == L8 ? 128 : kind == L5 ? 16 : 8;
}

/* The VN lanes (v * VN ..) of block b's codes at inputs k = 2p and 2p + 1, as floats c' (see above).
 * off: code_off's; hasoff: off != 0, a separate argument so that a caller can make it a constant (the
 * GEMV does: gemv_part). */
LINLINE void codes_pair(int kind, int hasoff, int off, const LMat *w, int64_t b, int64_t p, int v, vf *c0, vf *c1) {
    if (!hasoff) off = 0;
#if VN == 8
    codes_pair8(kind, hasoff, off, w, b, p, v, c0, c1);
#else
    const int64_t K = w->K;
    bytes_t q0, q1;
    if (kind == L8) {
        q0 = ld_bytes(w->codes + (b * K + 2 * p) * BLK + v * VN);
        q1 = ld_bytes(w->codes + (b * K + 2 * p + 1) * BLK + v * VN);
    } else {
        nibbles(ld_bytes(w->codes + (b * (K / 2) + p) * BLK + v * VN), &q0, &q1);
        if (kind == L5) {          /* the fifth bits: lane j's bit j of the 16-bit mask, times 16 */
            const uint16_t *h = w->high + b * K + 2 * p;
            q0 = add_fifth(q0, h[0], v);
            q1 = add_fifth(q1, h[1], v);
        }
    }
    if (hasoff) {                  /* c - off fits a signed byte: Q8_0's -128..127, Q4 -8..7, Q5 -16..15, Q6_K -32..31 */
        *c0 = widen_s(sub_bytes(q0, off));
        *c1 = widen_s(sub_bytes(q1, off));
    } else {
        *c0 = widen_u(q0);
        *c1 = widen_u(q1);
    }
#endif
}

/* VN unsigned / signed bytes at p as float lanes (the K-quants' sub-block scales) */
LINLINE vf bytes_u(const uint8_t *p) { return widen_u(ld_bytes(p)); }
LINLINE vf bytes_s(const int8_t *p) { return widen_s(ld_bytes((const uint8_t *)p)); }

/* Lanes (v * VN ..) of block b's scale and bias for group g: exact fp32 values (GGML's, see above). */
LINLINE vf scale_at(int mode, const LMat *w, int64_t b, int64_t g, int v) {
    const int64_t G = w->K / GS(mode), i = (b * G + g) * BLK + v * VN;
    switch (mode) {
    case LM_F32: return loadn((const float *)w->scale + i);
    case LM_K:   return loadnh((const _Float16 *)w->sup + ((b * (w->K / 256) + g / 8) * 2) * BLK + v * VN)
                        * bytes_u((const uint8_t *)w->scale + i);
    case LM_K6:  return loadnh((const _Float16 *)w->sup + (b * (w->K / 256) + g / 16) * BLK + v * VN)
                        * bytes_s((const int8_t *)w->scale + i);
    default:     return loadnh((const _Float16 *)w->scale + i);
    }
}

LINLINE vf bias_at(int mode, const LMat *w, int64_t b, int64_t g, int v) {
    const int64_t G = w->K / GS(mode), i = (b * G + g) * BLK + v * VN;
    switch (mode) {
    case LM_F32:  return loadn((const float *)w->bias + i);
    case LM_F16S: return scale_at(mode, w, b, g, v) * splatn(((const float *)w->bias)[0]);
    case LM_K:    return -(loadnh((const _Float16 *)w->sup + ((b * (w->K / 256) + g / 8) * 2 + 1) * BLK + v * VN)
                           * bytes_u((const uint8_t *)w->bias + i));
    default:      return loadnh((const _Float16 *)w->bias + i);
    }
}

/* X[m * G + g] = x[m, 32g] + x[m, 32g+1] + ... + x[m, 32g+31], added in that order (the bias term's
 * input; every bias mode has groups of 32). */
static void group_sums(const float *x, int64_t M, int64_t K, float *X) {
    const int64_t G = K / 32;
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < G; g++) {
            float s = 0.0f;
            for (int k = 0; k < 32; k++) s += x[m * K + 32 * g + k];
            X[m * G + g] = s;
        }
}

/* T (the outputs' running total, kept in y) += the group's sums: the epilogue of both paths. The first
 * group starts T at +0, which y is not zeroed for (y's old values are never read). */
LINLINE void add_group(int mode, float *t, vf s, vf S, vf b, float X, int first) {
    vf T = fman(s, S, first ? splatn(0.0f) : loadn(t));
    if (HAS_BIAS(mode)) T = fman(b, splatn(X), T);
    storen(t, T);
}

/* ---- small M: straight from the codes ------------------------------------------------------------ */

/* S accumulators a GEMV tile holds: R rows x CB blocks x NV vectors (at most 8 blocks: GV_C's cases).
 * 8 measured best on Sapphire Rapids (2 and 4: 6-15% slower at M = 1). No software prefetch: unlike
 * the row kernels' GEMV this one measured slower with every kind tried (4 KB, 1 KB or 512 B ahead in a
 * block's own stream, or the next tile's blocks at the same input; to L1 or L2): qwen's Q5_0 layers
 * 1.22-1.36x the time without, in a pass over 24 layers' matrices. */
#define GV_ACC (VN == 16 ? 16 : 8)
#define GV_RMAX (VN == 16 ? 8 : 4)      /* rows a GEMV tile: R x NV accumulators must fit beside the codes */

/* R rows x CB blocks from b0: every output's chain, T accumulated in y (block b0's first column). xt: the
 * R rows packed input by input (xt[k * R + r] = x[r, k]: one base address for all the broadcasts; 8 row pointers left GCC short
 * of registers, the output projection of 8 streams 1.4x slower; a single row is its own packing).
 * X: the rows' group sums (bias modes). */
LINLINE void gemv_tile(int kind, int hasoff, int mode, int R, int CB, const float *xt, const LMat *w,
                       const float *X, int64_t b0, float *y, int64_t ldy) {
    const int64_t K = w->K, G = K / GS(mode), PG = GS(mode) / 2;       /* input pairs a group */
    const int off = code_off(kind, mode);
    for (int64_t g = 0; g < G; g++) {
        vf S[GV_RMAX][8 * NV];
        for (int r = 0; r < R; r++)
            for (int i = 0; i < CB * NV; i++) S[r][i] = splatn(0.0f);
        for (int64_t p = PG * g; p < PG * g + PG; p++) {
            const float *x0 = xt + 2 * p * R, *x1 = x0 + R;
#pragma GCC unroll 8
            for (int c = 0; c < CB; c++) {
#pragma GCC unroll 4
                for (int v = 0; v < NV; v++) {
                    vf c0, c1;
                    codes_pair(kind, hasoff, off, w, b0 + c, p, v, &c0, &c1);
                    /* broadcasts from memory, inside the FMAs: held in registers they left no room
                     * for 16 accumulators */
#pragma GCC unroll 8
                    for (int r = 0; r < R; r++)
                        S[r][c * NV + v] = fman(c1, splatn(x1[r]), fman(c0, splatn(x0[r]), S[r][c * NV + v]));
                }
            }
        }
        for (int c = 0; c < CB; c++)
            for (int v = 0; v < NV; v++) {
                const vf s = scale_at(mode, w, b0 + c, g, v);
                const vf b = HAS_BIAS(mode) ? bias_at(mode, w, b0 + c, g, v) : splatn(0.0f);
                for (int r = 0; r < R; r++)
                    add_group(mode, y + r * ldy + c * BLK + v * VN, s, S[r][c * NV + v], b,
                              HAS_BIAS(mode) ? X[r * G + g] : 0.0f, g == 0);
            }
    }
}

/* blocks per GEMV tile for R rows: as many as GV_ACC accumulators hold */
#define GV_CB(R) (GV_ACC / ((R) * NV) > 8 ? 8 : GV_ACC / ((R) * NV) > 0 ? GV_ACC / ((R) * NV) : 1)

#define GV_C(R_, C_) case C_:                                                                   \
    if ((C_) <= GV_CB(R_)) gemv_tile(kind, hasoff, mode, R_, C_, xm, w, Xm, b, yb, ldy);       \
    break;
#define GV_R(R_) case R_:                                                                       \
    switch (CB) { GV_C(R_, 1) GV_C(R_, 2) GV_C(R_, 3) GV_C(R_, 4) GV_C(R_, 5) GV_C(R_, 6) GV_C(R_, 7) GV_C(R_, 8) } \
    break;

/* Rows a GEMV tile up to which gemv_part's copies hold the code kind as a constant. Above it one copy
 * with the kind at run time (gemv_tile_rt): there R rows' FMAs share each code pair's tests, and six
 * copies of AVX-512's 3-8-row tiles more than doubled qlanes.c's compile time (40 -> 112 s). */
#define GV_SPEC_R (VN == 16 ? 2 : GV_RMAX)

#if GV_RMAX > GV_SPEC_R
static __attribute__((noinline)) void gemv_tile_rt(int kind, int hasoff, int mode, int R, int CB, const float *xm,
                                                   const LMat *w, const float *Xm, int64_t b, float *yb, int64_t ldy) {
    switch (R) {
        GV_R(3) GV_R(4) GV_R(5) GV_R(6) GV_R(7) GV_R(8)
    }
}
#endif

/* Blocks [b0, b1) for every row. xp: x packed by pack_rows in groups of GV_RMAX rows (each pass reads
 * every code of the blocks once, so a product below LANES_GEMM_M takes one pass where the registers
 * allow: on AVX-512 8 rows x 1 block, 8 chains; the output projection of 8 decoding streams read twice
 * measured 1.45x the row kernel's time), or NULL: x's rows one at a time (same bits, M passes). */
LINLINE void gemv_blocks(int kind, int hasoff, int mode, const float *x, const float *xp, int64_t M,
                         const LMat *w, const float *X, int64_t b0, int64_t b1, float *y, int64_t ldy) {
    const int64_t K = w->K, G = K / 32, rmax = xp ? GV_RMAX : 1;     /* y: block b0's first column */
    for (int64_t m = 0; m < M; m += rmax) {
        const int R = (int)(M - m < rmax ? M - m : rmax);
        const float *xm = (xp ? xp : x) + m * K, *Xm = X ? X + m * G : NULL;
        float *ym = y + m * ldy;
        for (int64_t b = b0; b < b1;) {
            const int full = GV_CB(R);
            const int CB = b1 - b >= full ? full : (int)(b1 - b);
            float *yb = ym + (b - b0) * BLK;
#if GV_RMAX > GV_SPEC_R
            if (R > GV_SPEC_R) {
                gemv_tile_rt(kind, hasoff, mode, R, CB, xm, w, Xm, b, yb, ldy);
                b += CB;
                continue;
            }
#endif
            switch (R) {
                GV_R(1) GV_R(2)
#if GV_SPEC_R == 4
                GV_R(3) GV_R(4)
#endif
            }
            b += CB;
        }
    }
}

/* gemv_blocks with the code kind and whether it has an offset as constants (6 copies): left to run time,
 * every code pair tested both (the tests and the branches were most of the instructions of an AVX2 GEMV:
 * ~27 for 16 weights of Q4_1 against ~8 of arithmetic, counted by callgrind). The mode stays a run-time
 * value: it decides only the group's epilogue. y: block b0's first column. */
static __attribute__((noinline)) void gemv_part(int kind, int mode, const float *x, const float *xp, int64_t M,
                                                const LMat *w, const float *X, int64_t b0, int64_t b1, float *y,
                                                int64_t ldy) {
    const int hasoff = code_off(kind, mode) != 0;
#define GV_KIND(K_) if (kind == K_) {                                                              \
        if (hasoff) gemv_blocks(K_, 1, mode, x, xp, M, w, X, b0, b1, y, ldy);                    \
        else gemv_blocks(K_, 0, mode, x, xp, M, w, X, b0, b1, y, ldy);                           \
        return; }
    GV_KIND(L4) GV_KIND(L5) GV_KIND(L8)
#undef GV_KIND
}

/* ---- large M: codes converted to floats once, every row tile over them --------------------------- */

#define NW (2 * VN)                     /* weight rows a GEMM tile: two vectors */
#define MR (VN == 16 ? 12 : 6)          /* rows a GEMM tile: 2 MR accumulators (24 of 32 zmm, 12 of 16 ymm) */
/* From this M on, the buffered path: converting every code once costs about a GEMV pass, so the GEMV
 * (re-reading the codes once per 4 rows) wins below it. Measured on Sapphire Rapids, 2 threads, both
 * models' shapes: Q4_1 / Q8_0 GEMV faster up to M = 8-11, Q5_0's (its fifth bits cost a mask add per
 * input) only to ~7. On AVX2 (Zen 3), with gemv_part's constant kinds, Q5_0 too up to 11 (qwen's
 * matrices at M = 8: 0.82-0.85x the GEMM's time; at 12 1.1x). Only timing depends on it
 * ([BATCH-INVARIANT]). */
#ifndef LANES_GEMM_M
#define LANES_GEMM_M(kind) ((kind) == L5 && VN == 16 ? 8 : 12)
#endif
#ifndef KC_BYTES
#define KC_BYTES 131072                 /* a thread's converted codes: NW rows x KC inputs of fp32 */
#endif
#define KC_MAX ((KC_BYTES / (4 * NW)) / 256 * 256 < 256 ? 256 : (KC_BYTES / (4 * NW)) / 256 * 256)

/* Weight rows [n0, n0 + NW), inputs [k0, k0 + kc) -> buf[(k - k0) * NW + j] = c' of row n0 + j at k (the
 * values codes_pair gives); their groups' scales and biases -> sb, bb [(g - k0/GS) * NW + j]. */
LINLINE void convert_tile(int kind, int mode, const LMat *w, int64_t n0, int64_t k0, int64_t kc, float *buf,
                          float *sb, float *bb) {
    const int64_t gs = GS(mode);
    const int off = code_off(kind, mode);
    for (int h = 0; h < NW / VN; h++) {          /* vector h of the tile: block (n0 + h VN) / 16, lanes v */
        const int64_t b = (n0 + h * VN) / BLK;
        const int v = (int)((n0 + h * VN) % BLK) / VN;
        for (int64_t p = k0 / 2; p < (k0 + kc) / 2; p++) {
            vf c0, c1;
            codes_pair(kind, off != 0, off, w, b, p, v, &c0, &c1);
            storen(buf + (2 * p - k0) * NW + h * VN, c0);
            storen(buf + (2 * p + 1 - k0) * NW + h * VN, c1);
        }
        for (int64_t g = k0 / gs; g < (k0 + kc) / gs; g++) {
            storen(sb + (g - k0 / gs) * NW + h * VN, scale_at(mode, w, b, g, v));
            if (HAS_BIAS(mode)) storen(bb + (g - k0 / gs) * NW + h * VN, bias_at(mode, w, b, g, v));
        }
    }
}

/* One group's S for R rows: GS_ inputs from wk (converted weights) and xk (the rows' packed inputs).
 * GS_ a constant (32, or 16 for Q6_K), so the input loop unrolls. */
LINLINE void gemm_group(int R, int GS_, const float *xk, const float *wk, vf (*S)[2]) {
#pragma GCC unroll 8
    for (int k = 0; k < GS_; k++) {
        const vf w0 = loadn(wk + k * NW), w1 = loadn(wk + k * NW + VN);
#pragma GCC unroll 12
        for (int r = 0; r < R; r++) {
            const vf xb = splatn(xk[k * R + r]);
            S[r][0] = fman(w0, xb, S[r][0]);
            S[r][1] = fman(w1, xb, S[r][1]);
        }
    }
}

/* R rows x NW weight rows over groups [g0, g1) of the converted tile (buf's group 0 is g0). xt: the R rows
 * packed input by input (xt[k * R + r] = x[r, k]: one base address for all R broadcasts; with a pointer per
 * row GCC ran out of registers and reloaded them from the stack in the inner loop). */
LINLINE void gemm_tile(int mode, int R, const float *xt, int64_t K, const float *buf, const float *sb,
                       const float *bb, const float *X, int64_t g0, int64_t g1, float *y, int64_t ldy) {
    const int gs = GS(mode);
    for (int64_t g = g0; g < g1; g++) {
        vf S[MR][2];
#pragma GCC unroll 12
        for (int r = 0; r < R; r++) { S[r][0] = splatn(0.0f); S[r][1] = splatn(0.0f); }
        const float *wk = buf + (g - g0) * gs * NW, *xk = xt + gs * g * R;
        if (gs == 32) gemm_group(R, 32, xk, wk, S);
        else gemm_group(R, 16, xk, wk, S);
        const float *s = sb + (g - g0) * NW, *b = bb + (g - g0) * NW;
#pragma GCC unroll 12
        for (int r = 0; r < R; r++)
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++)
                add_group(mode, y + r * ldy + h * VN, loadn(s + h * VN), S[r][h],
                          HAS_BIAS(mode) ? loadn(b + h * VN) : splatn(0.0f), HAS_BIAS(mode) ? X[r * (K / 32) + g] : 0.0f,
                          g == 0);
    }
}

/* Rows of row tile t when M rows are cut into ceil(M / MR) tiles as even as can be (timing only). */
LINLINE int lanes_tile_rows(int64_t M, int64_t t) {
    int64_t tiles = (M + MR - 1) / MR;
    return (int)(M / tiles + (t < M % tiles));
}

/* R rows of x (stride K) -> dst[k * R + r]: how gemm_tile and gemv_tile read a tile's rows. */
LINLINE void pack_rows_r(const float *x, int64_t K, int R, float *dst) {
    for (int64_t k = 0; k < K; k++)
#pragma GCC unroll 12
        for (int r = 0; r < R; r++) dst[k * R + r] = x[r * K + k];
}

/* pack_rows_r with R a constant up to 12 (every tile height here): the row loop unrolls into R
 * independent loads and stores an input. With R a run-time count the packing of a prefill chunk's x
 * was ~6% of a 1,024-token smollm2 prefill on the AVX2 Zen 3 (perf: a counted loop over the strided
 * rows, once per matrix and chunk). Data movement only: no bit changes. */
static void pack_rows(const float *x, int64_t K, int R, float *dst) {
    switch (R) {
#define PACK_R(R_) case R_: pack_rows_r(x, K, R_, dst); return;
    PACK_R(1) PACK_R(2) PACK_R(3) PACK_R(4) PACK_R(5) PACK_R(6)
    PACK_R(7) PACK_R(8) PACK_R(9) PACK_R(10) PACK_R(11) PACK_R(12)
#undef PACK_R
    default: pack_rows_r(x, K, R, dst);
    }
}

/* x (M, K) -> xp: row tile t (rows m .. m+R-1) at xp + m K, packed. Tiles [t0, t1) only (threads share
 * the work). */
static void pack_tiles(const float *x, int64_t M, int64_t K, float *xp, int64_t t0, int64_t t1) {
    int64_t m = 0, t = 0;
    for (; t < t0; t++) m += lanes_tile_rows(M, t);
    for (; t < t1; m += lanes_tile_rows(M, t), t++) pack_rows(x + m * K, K, lanes_tile_rows(M, t), xp + m * K);
}

#define GM_CASE(R_) case R_: gemm_tile(mode, R_, xm, K, buf, sb, bb, Xm, g0, g1, ym, ldy); break;

/* Weight rows [n0, n1) (multiples of NW apart from a last block of 16 on AVX-512, taken by the GEMV
 * path: same bits) for all M rows. buf: this thread's KC_BYTES, then room for two scale tiles. */
LINLINE void gemm_rows(int kind, int mode, const float *x, const float *xp, int64_t M, const LMat *w,
                       const float *X, int64_t n0, int64_t n1, float *y, int64_t ldy, float *buf) {
    const int64_t K = w->K, G32 = K / 32, gs = GS(mode);
    float *sb = buf + KC_MAX * NW, *bb = sb + KC_MAX / 16 * NW;
    int64_t n = n0;
    for (; n + NW <= n1; n += NW)
        for (int64_t k0 = 0; k0 < K; k0 += KC_MAX) {
            const int64_t kc = K - k0 < KC_MAX ? K - k0 : KC_MAX, g0 = k0 / gs, g1 = (k0 + kc) / gs;
            convert_tile(kind, mode, w, n, k0, kc, buf, sb, bb);
            for (int64_t m = 0, t = 0; m < M; m += lanes_tile_rows(M, t++)) {
                const int R = lanes_tile_rows(M, t);
                const float *xm = xp + m * K, *Xm = X ? X + m * G32 : NULL;
                float *ym = y + m * ldy + n;
                switch (R) {
#if MR == 12
                    GM_CASE(1) GM_CASE(2) GM_CASE(3) GM_CASE(4) GM_CASE(5) GM_CASE(6)
                    GM_CASE(7) GM_CASE(8) GM_CASE(9) GM_CASE(10) GM_CASE(11) default: GM_CASE(12)
#else
                    GM_CASE(1) GM_CASE(2) GM_CASE(3) GM_CASE(4) GM_CASE(5) default: GM_CASE(6)
#endif
                }
            }
        }
    if (n < n1)          /* a last block of 16 rows narrower than a tile: the GEMV, the same chains */
        gemv_part(kind, mode, x, NULL, M, w, X, n / BLK, n1 / BLK, y + n, ldy);
}

/* ---- the entries ---------------------------------------------------------------------------------- */

/* The vector path this build took (kernels/build.py: Kernels.isa, part of the cache namespace). */
const char *tq_isa(void) { return VN == 16 ? "avx512" : VN == 8 ? "avx2" : "scalar"; }

/* Blocks a chunk of lanes_mm's work: about CHUNKS_PER_THREAD chunks a thread, each whole tiles of the
 * path (the GEMM's NW rows, the GEMV's GV_CB blocks of its first row tile). Why chunks and not an even
 * share: a thread that finishes early takes the next chunk, so a core slowed by something else (a noisy
 * neighbour of a VM, an interrupt) no longer holds the other at the closing barrier. Measured on a 2-core
 * Zen 3 guest (perf, qwen's decode): with one even share a thread the main thread waited there 7.5% of
 * both threads' samples (the worker's vCPU ran ~11% slower), with chunks 1.8%. Which thread does a
 * block never changes its arithmetic ([BATCH-INVARIANT]). nb >= 1. */
#ifndef CHUNKS_PER_THREAD
#define CHUNKS_PER_THREAD 8
#endif
static int64_t chunk_blocks(int gemm, int64_t M, int64_t nb, int nt) {
    const int64_t tile = gemm ? (NW > BLK ? NW / BLK : 1) : GV_CB(M < GV_RMAX ? (int)M : GV_RMAX);
    int64_t per = (nb + (int64_t)nt * CHUNKS_PER_THREAD - 1) / ((int64_t)nt * CHUNKS_PER_THREAD);
    return (per + tile - 1) / tile * tile;
}

/* x: (M, K) fp32 contiguous; y: rows of stride ldy (a column slice of a wider output is fine); w: the
 * layout above, N real rows (the last block padded when N % 16 != 0). nthreads: passed in (the caller is
 * often not the thread torch.set_num_threads ran on). Side effects: writes y[:, :N] only; allocates and
 * frees its scratch. */
static void lanes_mm(int kind, int mode, const float *x, int64_t M, const LMat *w, int64_t N, float *y,
                     int64_t ldy, int nthreads) {
    const int64_t K = w->K, nb = N / BLK;     /* whole blocks; a padded last one after them */
    if (M <= 0 || N <= 0) return;
    float *X = NULL;
    if (HAS_BIAS(mode)) {
        X = malloc((size_t)(M * (K / 32)) * sizeof(float));
        if (!X) abort();         /* M x K/32 floats: a 32nd of x */
        group_sums(x, M, K, X);
    }
    int gemm = M >= LANES_GEMM_M(kind);
    const size_t per_thread = KC_BYTES + 2 * (KC_MAX / 16 * NW * sizeof(float)) + 256;
    char *bufs = gemm ? aligned_alloc(64, (size_t)nthreads * per_thread) : NULL;
    /* x packed: by GEMM tiles, or in groups of GV_RMAX rows for the GEMV (M > 1) */
    float *xp = M > 1 ? aligned_alloc(64, ((size_t)(M * K) * sizeof(float) + 63) / 64 * 64) : NULL;
    if (gemm && !(bufs && xp)) gemm = 0;     /* out of memory: the GEMV path, the same bits, no buffers */
    if (!gemm && xp)
        for (int64_t m = 0; m < M; m += GV_RMAX) pack_rows(x + m * K, K, (int)(M - m < GV_RMAX ? M - m : GV_RMAX), xp + m * K);
    const int64_t tiles = (M + MR - 1) / MR;
#pragma omp parallel num_threads(nthreads) if (nb > 0)
    if (nb > 0) {                               /* (N < 16: only the padded block) */
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        if (gemm) {
            pack_tiles(x, M, K, xp, tiles * t / nt, tiles * (t + 1) / nt);
#pragma omp barrier
        }
        /* The blocks in chunks handed out as threads come free (whole tiles of either path). */
        const int64_t per = chunk_blocks(gemm, M, nb, nt);
#pragma omp for schedule(dynamic, 1)
        for (int64_t c = 0; c < (nb + per - 1) / per; c++) {
            const int64_t b0 = c * per, b1 = b0 + per < nb ? b0 + per : nb;
            if (gemm)
                gemm_rows(kind, mode, x, xp, M, w, X, b0 * BLK, b1 * BLK, y, ldy,
                          (float *)(bufs + (size_t)t * per_thread));
            else
                gemv_part(kind, mode, x, xp, M, w, X, b0, b1, y + b0 * BLK, ldy);
        }
    }
    if (N % BLK) {      /* the padded block: whole into scratch (the GEMV, the same chains), its N % 16 real
                         * columns copied out (y's next columns may be another part's) */
        float *t = malloc((size_t)(M * BLK) * sizeof(float));
        if (!t) abort();
        gemv_part(kind, mode, x, gemm ? NULL : xp, M, w, X, nb, nb + 1, t, BLK);
        for (int64_t m = 0; m < M; m++) memcpy(y + m * ldy + nb * BLK, t + m * BLK, (size_t)(N % BLK) * sizeof(float));
        free(t);
    }
    free(bufs);
    free(xp);
    free(X);
}

/* Blocks [b0, b1) of the product (output columns 16 b0 .. min(16 b1, N)), on the calling thread alone: for
 * a caller that runs many products in one parallel region of its own (layer.c's experts: every expert's
 * share of blocks a task, one region for all of them instead of one a product). b1 <= ceil(N / 16). The
 * same paths as lanes_mm, chosen by M alone, so the same bits whatever the range ([BATCH-INVARIANT]).
 * Side effects: writes those columns of y only; allocates and frees its scratch. Returns 0, or -1 when out
 * of memory (nothing written then). */
static int lanes_range(int kind, int mode, const float *x, int64_t M, const LMat *w, int64_t N, int64_t b0,
                       int64_t b1, float *y, int64_t ldy) {
    const int64_t K = w->K, nb = N / BLK, e1 = b1 < nb ? b1 : nb;     /* e1: the range's whole blocks end */
    if (M <= 0 || b0 >= b1) return 0;
    const int gemm = M >= LANES_GEMM_M(kind);
    float *X = HAS_BIAS(mode) ? malloc((size_t)(M * (K / 32)) * sizeof(float)) : NULL;
    float *buf = gemm ? aligned_alloc(64, KC_BYTES + 2 * (KC_MAX / 16 * NW * sizeof(float)) + 256) : NULL;
    float *xp = M > 1 ? aligned_alloc(64, ((size_t)(M * K) * sizeof(float) + 63) / 64 * 64) : NULL;
    float *t = (N % BLK && b1 > nb) ? malloc((size_t)(M * BLK) * sizeof(float)) : NULL;
    int rc = 0;
    if ((HAS_BIAS(mode) && !X) || (gemm && !buf) || (M > 1 && !xp) || (N % BLK && b1 > nb && !t)) { rc = -1; goto out; }
    if (X) group_sums(x, M, K, X);
    if (gemm) pack_tiles(x, M, K, xp, 0, (M + MR - 1) / MR);
    else if (xp)
        for (int64_t m = 0; m < M; m += GV_RMAX) pack_rows(x + m * K, K, (int)(M - m < GV_RMAX ? M - m : GV_RMAX), xp + m * K);
    if (b0 < e1) {
        if (gemm) gemm_rows(kind, mode, x, xp, M, w, X, b0 * BLK, e1 * BLK, y, ldy, buf);
        else gemv_part(kind, mode, x, xp, M, w, X, b0, e1, y + b0 * BLK, ldy);
    }
    if (t) {            /* the padded block, as lanes_mm computes it */
        gemv_part(kind, mode, x, gemm ? NULL : xp, M, w, X, nb, nb + 1, t, BLK);
        for (int64_t m = 0; m < M; m++) memcpy(y + m * ldy + nb * BLK, t + m * BLK, (size_t)(N % BLK) * sizeof(float));
    }
out:
    free(t);
    free(buf);
    free(xp);
    free(X);
    return rc;
}

/* The code offset of a kind whose "f16s" matrix takes the integer codes (GGML's Q4_0 / Q5_0 / Q8_0). */
#define F16S_OFF(kind) ((kind) == L8 ? 128.0f : (kind) == L5 ? 16.0f : 8.0f)

/* lanes_range for layer.c: a LANES layout and a scale mode it has an entry for, by their layouts.h codes
 * (f16s with the layout's own offset takes the integer codes, as LANES_EXPORT). Returns 0, -1 out of memory,
 * -2 a layout or mode it has no kernel for. */
int tq_lanes_range(int64_t layout, int64_t mode, const float *x, int64_t M, int64_t K, const uint8_t *codes,
                   const uint8_t *high, const void *scale, const void *bias, const uint16_t *sup, int64_t N,
                   int64_t b0, int64_t b1, float *y, int64_t ldy) {
    if (tq_layout_family(layout) != TQ_LANES || !tq_has_entry(layout, mode) || b0 < 0 || b1 > (N + BLK - 1) / BLK)
        return -2;
    const int kind = tq_layout_bits(layout);        /* the kind enum's values are the bits */
    int lm = (int)mode;
    if (mode == LM_F16S) lm = ((const float *)bias)[0] == -F16S_OFF(kind) ? LM_F16I : LM_F16S;
    const LMat w = {codes, (const uint16_t *)high, scale, bias, sup, K};
    return lanes_range(kind, lm, x, M, &w, N, b0, b1, y, ldy);
}

#define LANES_ARGS const float *x, int64_t M, int64_t K, const uint8_t *codes, const uint8_t *high, \
    const void *scale, const void *bias, const uint16_t *sup, int64_t N, float *y, int64_t ldy, int nthreads
#define LANES_MAT {codes, (const uint16_t *)high, scale, bias, sup, K}
/* Every LANES entry of layouts.h: tq_<layout>_<mode>_mm. An f16s matrix whose constant is the layout's own
 * offset (GGML's Q4_0 / Q5_0 / Q8_0) takes the integer codes c - offset (LM_F16I); for the other modes the
 * test is constant false and the entry is the one call. */
#define LANES_EXPORT(NAME, KIND, MODE) void NAME(LANES_ARGS) { \
    const LMat w = LANES_MAT; \
    if ((int)(MODE) == LM_F16S && ((const float *)bias)[0] == -F16S_OFF(KIND)) \
        lanes_mm(KIND, LM_F16I, x, M, &w, N, y, ldy, nthreads); \
    else lanes_mm(KIND, MODE, x, M, &w, N, y, ldy, nthreads); }
#define TQ_ENTRY(lay, M, bits) LANES_EXPORT(tq_##lay##_##M##_mm, L##bits, TQ_MODE_##M)
TQ_LAYOUTS(TQ_ENTRIES_LANES)
#undef TQ_ENTRY
