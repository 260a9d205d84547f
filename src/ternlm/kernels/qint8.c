/* Integer products (issue 46): y[m, n] = sum_k x[m, k] * w[n, k] with x quantized per row to int8 in
 * groups of 32 and the weights' integer codes, every group's dot product an exact int32 sum.
 *
 * Why: the fp32-activation lanes kernels (qlanes.c) unpack every 4- or 6-bit code to fp32 and spend one
 * FMA a weight: decode ran at ~39% of the bandwidth bound on the 1.5B, prefill bound by fp32 FMAs. Here
 * one vpdpbusd (AVX-512 VNNI) or vpmaddubsw + vpmaddwd (AVX-512 BW without VNNI; AVX2) multiplies 4 codes by
 * 4 activations a lane.
 *
 * The value, per output (m, n) (every step per lane: nothing here depends on the vector width):
 *   activations, per row m and group g of 32 inputs (quant_row; the row alone decides):
 *     a = max |x[m, k]| over the group; dx[m, g] = a / 127 (0 when a = 0)
 *     q[m, k] = round-half-even(x[m, k] * (127 / a)) in -127..127; sx = sum of q over each 16
 *   the group's integer sum, exact whatever the order of the adds (lanes, tiles, threads):
 *     isum = sum_k (code[n, k] - off) * q[m, k]      (Q6_K: sc_a * sum over inputs 0-15 + sc_b * 16-31)
 *   then, groups in order, T = 0:
 *     T = fma(s[n, g] * dx[m, g], (float) isum, T)     (Q6_K: s = the super-block's d; sc is in isum)
 *     T = fma(b[n, g], dx[m, g] * (float) sx_g, T)     (modes with a bias: Q4_1, Q5_1, Q4_K, Q5_K, ...)
 *   y[m, n] = T. s and b are the exact fp32 GGML scales and biases of qlanes.c (scale_at / bias_at);
 *   off: the layout's own offset where the matrix's bias is exactly it (Q4_0 8, Q5_0 16, Q8_0 128,
 *   Q6_K 32), else 0. |isum| < 2^24, so (float) isum is exact.
 *
 * [BATCH-INVARIANT] and [SAME-BITS-EVERY-ISA]: the integer sums are exact and every float step is one
 * IEEE operation per lane in a fixed order, so M, the row tile, the thread count and the ISA (AVX-512
 * VNNI, AVX2, the scalar build: fmaf there, correctly rounded) cannot change a bit.
 *
 * Layouts (the lanes layouts' codes and high bits, rearranged so that a 32-bit lane holds 4 codes of one
 * weight row; scales, biases and super-block scales are the lanes layouts' own, models/qweight.py):
 *   i4x16: codes (N/16, K/8, 16, 4): octet o, lane j, byte i = code(16b+j, 8o+i) | code(16b+j, 8o+4+i) << 4
 *          (the low nibbles pair with inputs 8o..8o+3, the high ones with 8o+4..8o+7: x in its own order)
 *   i5x16: i4x16 + high (N/16, K/32, 16, 4): group g, lane j, byte i, bit s = bit 4 of code(32g + 8(s>>1)
 *          + 4(s&1) + i): the bit for octet o's low half sits at s = 2o, its high half at 2o + 1
 *   i6x16: i4x16's low nibbles + high (N/16, K/16, 16, 4): bits 2s, 2s+1 of byte i = bits 4-5 of code(16h
 *          + 4s + i) (Q6_K: 0.82 bytes a weight with its scales, GGML's own size)
 *   i8x16: codes (N/16, K/4, 16, 4): quad t, lane j, byte i = code(16b+j, 4t+i) (Q8_0's code + 128)
 * Built by kernels/build.py with the other sources.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#include <pthread.h>

#include "layouts.h"
#include "vec.h"

#define IINLINE static inline __attribute__((always_inline))

enum { I4 = 4, I5 = 5, I6 = 6, I8 = 8 };     /* code kinds: named and numbered by layouts.h's bits column */
/* scale modes: layouts.h's numbering (IM_F16I, internal: "f16s" whose constant is the layout's own offset) */
enum { IM_F32 = TQ_MODE_f32, IM_F16 = TQ_MODE_f16, IM_K = TQ_MODE_k, IM_K6 = TQ_MODE_k6, IM_F16S = TQ_MODE_f16s,
       IM_F16I = TQ_NMODES };
#define IBLK 16
#define IHAS_BIAS(mode) ((mode) != IM_F16I && (mode) != IM_K6)
/* activation rows a tile: 8 x (2 sums + a total) vectors beside the codes in AVX-512's 32 registers, 4 in
 * AVX2's 16 (the tile never changes a bit: every output's arithmetic is its own) */
#if defined(__AVX512BW__)
#define RT 8
#else
#define RT 4
#endif

typedef struct {
    const uint8_t *codes, *high;
    const void *scale, *bias;
    const uint16_t *sup;
    int64_t K;
} IMat;

/* ---- activations -------------------------------------------------------------------------------- */

/* One row x (K) -> q (K) int8, d (K/32) fp32, s16 (K/16) int32 (see the top of the file). Element-wise
 * IEEE operations only (a division per group, a product and a rounding per input): every build, vector or
 * scalar, gives the same bits. */
static void quant_row(const float *x, int64_t K, int8_t *q, float *d, int32_t *s16) {
    for (int64_t g = 0; g < K / 32; g++) {
        const float *xg = x + 32 * g;
        float a = 0.0f;
        for (int k = 0; k < 32; k++) {
            const float v = fabsf(xg[k]);
            a = v > a ? v : a;
        }
        int8_t *qg = q + 32 * g;
        if (a == 0.0f) {
            memset(qg, 0, 32);
            d[g] = 0.0f;
            s16[2 * g] = s16[2 * g + 1] = 0;
            continue;
        }
        const float id = 127.0f / a;
        d[g] = a / 127.0f;
        for (int h = 0; h < 2; h++) {
            int32_t s = 0;
            for (int k = 16 * h; k < 16 * h + 16; k++) {
                const int v = (int)nearbyintf(xg[k] * id);     /* |x * id| <= 127 (+ an ulp): -127..127 */
                qg[k] = (int8_t)v;
                s += v;
            }
            s16[2 * g + h] = s;
        }
    }
}

/* ---- the integer sums ---------------------------------------------------------------------------- */

/* acc[r][sub][j]: for weight row 16b + j and activation row r, the group's sum over its inputs (sub 0:
 * all 32, or with `split` the first 16 and sub 1 the last 16) of (code - base) * q, base 128 for i8x16
 * on the AVX2 path (its signed product, DOT8_BASE) and 0 elsewhere. Exact int32. */
#if defined(__AVX512BW__) && VN == 16
#define IL 16
typedef __m512i vi;
IINLINE vi vi_ld(const uint8_t *p) { return _mm512_loadu_si512((const void *)p); }
IINLINE vi vi_bc(const int8_t *p) { int32_t v; memcpy(&v, p, 4); return _mm512_set1_epi32(v); }
IINLINE vi vi_and(vi a, int32_t m) { return _mm512_and_si512(a, _mm512_set1_epi32(m)); }
IINLINE vi vi_or(vi a, vi b) { return _mm512_or_si512(a, b); }
IINLINE vi vi_shift(vi a, int n) { return n > 0 ? _mm512_slli_epi32(a, n) : n < 0 ? _mm512_srli_epi32(a, -n) : a; }
IINLINE vi vi_zero(void) { return _mm512_setzero_si512(); }
IINLINE void vi_st(int32_t *p, vi a) { _mm512_storeu_si512((void *)p, a); }
#if defined(__AVX512VNNI__)
#define DOT8_BASE 0
#define INT8_PATH "avx512-vnni"
IINLINE vi dotu(vi acc, vi w, vi x) { return _mm512_dpbusd_epi32(acc, w, x); }    /* 4 u8 x s8 a lane */
IINLINE vi dot8(vi acc, vi w, vi x) { return _mm512_dpbusd_epi32(acc, w, x); }    /* codes 0..255 */
#else
/* AVX-512 without VNNI (Skylake-SP/X): AVX2's pair products at 512 bits; AVX-512 has no vpsignb, so q takes
 * the sign of c = code - 128 by a masked negation (where c = 0 its |c| = 0 zeroes the product anyway) */
#define DOT8_BASE 128
#define INT8_PATH "avx512bw"
IINLINE vi dotu(vi acc, vi w, vi x) {
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(w, x), _mm512_set1_epi16(1)));
}
IINLINE vi dot8(vi acc, vi w, vi x) {
    const vi c = _mm512_xor_si512(w, _mm512_set1_epi8((char)0x80));
    const vi xs = _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(c), _mm512_setzero_si512(), x);
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_abs_epi8(c), xs),
                                                   _mm512_set1_epi16(1)));
}
#endif
#define HAVE_VI 1
#elif defined(__AVX2__) && VN == 8      /* (an AVX2 build without FMA or F16C has VN 4: the scalar path) */
#define IL 8
#define DOT8_BASE 128
#define INT8_PATH "avx2"
typedef __m256i vi;
IINLINE vi vi_ld(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
IINLINE vi vi_bc(const int8_t *p) { int32_t v; memcpy(&v, p, 4); return _mm256_set1_epi32(v); }
IINLINE vi vi_and(vi a, int32_t m) { return _mm256_and_si256(a, _mm256_set1_epi32(m)); }
IINLINE vi vi_or(vi a, vi b) { return _mm256_or_si256(a, b); }
IINLINE vi vi_shift(vi a, int n) { return n > 0 ? _mm256_slli_epi32(a, n) : n < 0 ? _mm256_srli_epi32(a, -n) : a; }
IINLINE vi vi_zero(void) { return _mm256_setzero_si256(); }
IINLINE void vi_st(int32_t *p, vi a) { _mm256_storeu_si256((__m256i *)p, a); }
/* codes <= 63, |q| <= 127: a pair's int16 sum <= 16002, no saturation */
IINLINE vi dotu(vi acc, vi w, vi x) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
}
/* codes 0..255 would saturate vpmaddubsw (2 * 255 * 127): multiply c = code - 128 instead, as |c| (<= 128)
 * times q with c's sign (|q| <= 127: a pair <= 32512) */
IINLINE vi dot8(vi acc, vi w, vi x) {
    const vi c = _mm256_xor_si256(w, _mm256_set1_epi8((char)0x80));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(c), _mm256_sign_epi8(x, c)),
                                                   _mm256_set1_epi16(1)));
}
#define HAVE_VI 1
#else
#define IL 16
#define DOT8_BASE 0
#define INT8_PATH "scalar"
#define HAVE_VI 0
#endif

#if HAVE_VI
#define NI (IBLK / IL)      /* vectors a block of 16 rows */
/* Vector h (rows 16b + IL h ..) of group g's sums for activation rows [0, R), left in A[r][sub]. */
IINLINE void half_dot(int kind, int split, const IMat *w, int64_t b, int64_t g, int h, int R, const int8_t *xq,
                      int64_t ldx, vi A[RT][2]) {
    const int64_t K = w->K;
    const int8_t *xg = xq + 32 * g;
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) A[r][0] = A[r][1] = vi_zero();
    if (kind == I8) {
#pragma GCC unroll 8
        for (int t = 0; t < 8; t++) {
            const vi c = vi_ld(w->codes + ((b * (K / 4) + 8 * g + t) * IBLK + h * IL) * 4);
            const int sub = split && t >= 4;
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) A[r][sub] = dot8(A[r][sub], c, vi_bc(xg + r * ldx + 4 * t));
        }
        return;
    }
    vi hw0 = vi_zero(), hw1 = vi_zero();
    if (kind == I5) hw0 = vi_ld(w->high + ((b * (K / 32) + g) * IBLK + h * IL) * 4);
    if (kind == I6) {
        hw0 = vi_ld(w->high + ((b * (K / 16) + 2 * g) * IBLK + h * IL) * 4);
        hw1 = vi_ld(w->high + ((b * (K / 16) + 2 * g + 1) * IBLK + h * IL) * 4);
    }
#pragma GCC unroll 4
    for (int o = 0; o < 4; o++) {
        const vi c = vi_ld(w->codes + ((b * (K / 8) + 4 * g + o) * IBLK + h * IL) * 4);
        vi lo = vi_and(c, 0x0F0F0F0F), hi = vi_and(vi_shift(c, -4), 0x0F0F0F0F);
        if (kind == I5) {           /* bits s = 2o (low half), 2o + 1 (high half) -> bit 4 */
            lo = vi_or(lo, vi_and(vi_shift(hw0, 4 - 2 * o), 0x10101010));
            hi = vi_or(hi, vi_and(vi_shift(hw0, 3 - 2 * o), 0x10101010));
        }
        if (kind == I6) {           /* fields s = 2 (o & 1), + 1 at bits 2s -> bits 4-5 */
            const vi h2 = o < 2 ? hw0 : hw1;
            const int s = 2 * (o & 1);
            lo = vi_or(lo, vi_and(vi_shift(h2, 4 - 2 * s), 0x30303030));
            hi = vi_or(hi, vi_and(vi_shift(h2, 2 - 2 * s), 0x30303030));
        }
        const int sub = split && o >= 2;
#pragma GCC unroll 8
        for (int r = 0; r < R; r++)
            A[r][sub] = dotu(dotu(A[r][sub], lo, vi_bc(xg + r * ldx + 8 * o)), hi, vi_bc(xg + r * ldx + 8 * o + 4));
    }
}
#else
/* The scalar build: the same sums, one product at a time. */
static void group_dot(int kind, int split, const IMat *w, int64_t b, int64_t g, int R, const int8_t *xq,
                      int64_t ldx, int32_t acc[RT][2][IBLK]) {
    const int64_t K = w->K;
    for (int r = 0; r < R; r++)
        for (int j = 0; j < IBLK; j++) {
            int32_t s[2] = {0, 0};
            for (int k = 0; k < 32; k++) {
                int c;
                if (kind == I8) {
                    c = w->codes[((b * (K / 4) + 8 * g + k / 4) * IBLK + j) * 4 + k % 4];
                } else {
                    const int o = k / 8, i = k % 4, half = (k % 8) / 4;
                    const uint8_t byte = w->codes[((b * (K / 8) + 4 * g + o) * IBLK + j) * 4 + i];
                    c = half ? byte >> 4 : byte & 15;
                    if (kind == I5)
                        c |= ((w->high[((b * (K / 32) + g) * IBLK + j) * 4 + i] >> (2 * o + half)) & 1) << 4;
                    if (kind == I6) {
                        const int sidx = 2 * (o & 1) + half;
                        c |= ((w->high[((b * (K / 16) + 2 * g + o / 2) * IBLK + j) * 4 + i] >> (2 * sidx)) & 3) << 4;
                    }
                }
                s[split && k >= 16] += c * (int32_t)xq[r * ldx + 32 * g + k];
            }
            acc[r][0][j] = s[0];
            acc[r][1][j] = s[1];
        }
}
#endif

/* ---- the float steps ----------------------------------------------------------------------------- */

/* a * b + c rounded once on every build (the scalar build has no FMA instruction: libm's fmaf, exact). */
IINLINE vf fmai(vf a, vf b, vf c) {
#if VN >= 8 || defined(__FMA__)
    return fman(a, b, c);
#else
    vf r;
    for (int i = 0; i < VN; i++) r[i] = fmaf(a[i], b[i], c[i]);
    return r;
#endif
}

/* VN unsigned bytes -> floats; VN signed bytes -> int32 lanes (one widening each: a scalar loop here was
 * the decode GEMV's hottest code, measured with perf on Q4_K) */
IINLINE vf bytes_uf(const uint8_t *p) {
#if VN == 16
    return (vf)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)));
#elif VN == 8
    return (vf)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#else
    vf r;
    for (int i = 0; i < VN; i++) r[i] = (float)p[i];
    return r;
#endif
}
IINLINE vfi bytes_si(const int8_t *p) {
#if VN == 16
    return (vfi)_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p));
#elif VN == 8
    return (vfi)_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p));
#else
    vfi r;
    for (int i = 0; i < VN; i++) r[i] = p[i];
    return r;
#endif
}
IINLINE vf halfs(const uint16_t *p) { return loadnh((const _Float16 *)p); }

/* Lanes (v * VN ..) of block b's group-g scale (qlanes.c's scale_at: exact fp32) for the modes with groups
 * of 32; IM_K6's is the super-block's d (its int8 sc are applied to the integer sums). */
IINLINE vf iscale(int mode, const IMat *w, int64_t b, int64_t g, int v) {
    const int64_t G = w->K / 32, i = (b * G + g) * IBLK + v * VN;
    switch (mode) {
    case IM_F32: return loadn((const float *)w->scale + i);
    case IM_K:   return halfs(w->sup + ((b * (w->K / 256) + g / 8) * 2) * IBLK + v * VN)
                        * bytes_uf((const uint8_t *)w->scale + i);
    case IM_K6:  return halfs(w->sup + (b * (w->K / 256) + g / 8) * IBLK + v * VN);
    default:     return halfs((const uint16_t *)w->scale + i);
    }
}

IINLINE vf ibias(int mode, const IMat *w, int64_t b, int64_t g, int v) {
    const int64_t G = w->K / 32, i = (b * G + g) * IBLK + v * VN;
    switch (mode) {
    case IM_F32:  return loadn((const float *)w->bias + i);
    case IM_F16S: return iscale(mode, w, b, g, v) * splatn(((const float *)w->bias)[0]);
    case IM_K:    return -(halfs(w->sup + ((b * (w->K / 256) + g / 8) * 2 + 1) * IBLK + v * VN)
                           * bytes_uf((const uint8_t *)w->bias + i));
    default:      return halfs((const uint16_t *)w->bias + i);
    }
}

/* The code offset subtracted in the integer sum (see the top of the file). */
IINLINE int ioff(int kind, int mode) {
    return mode == IM_K6 ? 32 : mode != IM_F16I ? 0 : kind == I8 ? 128 : kind == I5 ? 16 : 8;
}

/* T[r] = group g's terms added to T[r] (every step one IEEE operation a lane, the order of the top
 * comment), for the VN weight rows 16b + VN v .. of block b; a0[r], a1[r]: the group's integer sums
 * (a1: the second 16 inputs', Q6_K only). */
IINLINE void group_out(int kind, int mode, const IMat *w, int64_t b, int64_t g, int v, int R, const vfi a0[RT],
                       const vfi a1[RT], const float *dx, const int32_t *s16, const float *ds, int64_t G,
                       vf T[RT]) {
    const int off = ioff(kind, mode) - (kind == I8 ? DOT8_BASE : 0);    /* what the sums still hold of the codes */
    const vf s = iscale(mode, w, b, g, v);
    const vf bv = IHAS_BIAS(mode) ? ibias(mode, w, b, g, v) : splatn(0.0f);
    vfi sca = {0}, scb = {0};
    if (mode == IM_K6) {
        sca = bytes_si((const int8_t *)w->scale + (b * (w->K / 16) + 2 * g) * IBLK + v * VN);
        scb = bytes_si((const int8_t *)w->scale + (b * (w->K / 16) + 2 * g + 1) * IBLK + v * VN);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
        const int32_t sa = s16[r * 2 * G + 2 * g], sb = s16[r * 2 * G + 2 * g + 1];
        const float d = dx[r * G + g];           /* ds[r G + g] = d * (float) (sa + sb): one product, made once */
        const vfi isum = mode == IM_K6 ? sca * (a0[r] - off * sa) + scb * (a1[r] - off * sb) : a0[r] - off * (sa + sb);
        T[r] = fmai(s * splatn(d), __builtin_convertvector(isum, vf), T[r]);
        if (IHAS_BIAS(mode)) T[r] = fmai(bv, splatn(ds[r * G + g]), T[r]);
    }
}

/* Rows [0, R) (R <= RT) of the quantized activations x block b: y's 16 columns (y: block b's first).
 * T starts at +0 and stays in registers over the groups (g in order). */
IINLINE void block_rows(int kind, int mode, const IMat *w, int64_t b, int R, const int8_t *xq, const float *dx,
                        const int32_t *s16, const float *ds, float *y, int64_t ldy) {
    const int64_t K = w->K, G = K / 32;
#if HAVE_VI
#pragma GCC unroll 2
    for (int h = 0; h < NI; h++) {          /* IL == VN on every vector path (the #if chain above): vector h is lane vector h */
        vf T[RT];
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) T[r] = splatn(0.0f);
        for (int64_t g = 0; g < G; g++) {
            vi A[RT][2];
            half_dot(kind, mode == IM_K6, w, b, g, h, R, xq, K, A);
            vfi a0[RT], a1[RT];
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) {
                memcpy(&a0[r], &A[r][0], sizeof a0[r]);
                memcpy(&a1[r], &A[r][1], sizeof a1[r]);
            }
            group_out(kind, mode, w, b, g, h, R, a0, a1, dx, s16, ds, G, T);
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) storen(y + r * ldy + h * VN, T[r]);
    }
#else
    int32_t acc[RT][2][IBLK] __attribute__((aligned(64)));
    vf T[IBLK / VN][RT];
    for (int v = 0; v < IBLK / VN; v++)
        for (int r = 0; r < R; r++) T[v][r] = splatn(0.0f);
    for (int64_t g = 0; g < G; g++) {
        group_dot(kind, mode == IM_K6, w, b, g, R, xq, K, acc);
        for (int v = 0; v < IBLK / VN; v++) {
            vfi a0[RT], a1[RT];
            for (int r = 0; r < R; r++) {
                memcpy(&a0[r], acc[r][0] + v * VN, sizeof a0[r]);
                memcpy(&a1[r], acc[r][1] + v * VN, sizeof a1[r]);
            }
            group_out(kind, mode, w, b, g, v, R, a0, a1, dx, s16, ds, G, T[v]);
        }
    }
    for (int v = 0; v < IBLK / VN; v++)
        for (int r = 0; r < R; r++) storen(y + r * ldy + v * VN, T[v][r]);
#endif
}

/* The quantized activations of M rows (int_mm's scratch): q (M, K), d (M, G), s16 (M, 2G), ds (M, G). */
typedef struct {
    const int8_t *q;
    const float *d;
    const int32_t *s16;
    const float *ds;
} IAct;

/* Blocks [b0, b1) for all M rows, RT rows at a time (a block's codes stay in L1/L2 across the row tiles).
 * The padded last block (N % 16 != 0) goes through scratch, its N % 16 real columns copied out. */
static inline __attribute__((always_inline)) void blocks_kind(int kind, int mode, const IMat *w, int64_t N, int64_t M,
                                                              const IAct *x, int64_t b0, int64_t b1, float *y,
                                                              int64_t ldy) {
    const int64_t K = w->K, G = K / 32;
    for (int64_t b = b0; b < b1; b++) {
        const int padded = (b + 1) * IBLK > N;
        for (int64_t m = 0; m < M; m += RT) {
            const int R = (int)(M - m < RT ? M - m : RT);
            float tmp[RT * IBLK] __attribute__((aligned(64)));
            float *yb = padded ? tmp : y + m * ldy + b * IBLK;
            const int64_t ld = padded ? IBLK : ldy;
            const int8_t *xm = x->q + m * K;
            const float *dm = x->d + m * G, *dsm = x->ds + m * G;
            const int32_t *sm = x->s16 + m * 2 * G;
            switch (R) {            /* R a constant: the row loops unroll */
#define BR(n) case n: block_rows(kind, mode, w, b, n, xm, dm, sm, dsm, yb, ld); break;
            BR(1) BR(2) BR(3)
#if RT > 4
            BR(4) BR(5) BR(6) BR(7)
#endif
#undef BR
            default: block_rows(kind, mode, w, b, RT, xm, dm, sm, dsm, yb, ld); break;
            }
            if (padded)
                for (int r = 0; r < R; r++) memcpy(y + (m + r) * ldy + b * IBLK, tmp + r * IBLK, (size_t)(N - b * IBLK) * sizeof(float));
        }
    }
}

/* blocks_kind with the kind and the mode constants (15 copies: a run-time mode's branches were the
 * decode GEMV's second-hottest instruction). */
static void blocks(int kind, int mode, const IMat *w, int64_t N, int64_t M, const IAct *x, int64_t b0, int64_t b1,
                   float *y, int64_t ldy) {
#define BK(K_, M_) if (kind == K_ && mode == M_) { blocks_kind(K_, M_, w, N, M, x, b0, b1, y, ldy); return; }
    BK(I4, IM_F32) BK(I4, IM_F16) BK(I4, IM_K) BK(I4, IM_F16S) BK(I4, IM_F16I)
    BK(I5, IM_F32) BK(I5, IM_F16) BK(I5, IM_K) BK(I5, IM_F16S) BK(I5, IM_F16I)
    BK(I8, IM_F32) BK(I8, IM_F16) BK(I8, IM_F16S) BK(I8, IM_F16I)
    BK(I6, IM_K6)
#undef BK
    abort();            /* the entries below make no other pair */
}

/* Row m of x (K) -> its quantized activations in act's row m: q, d, s16 (quant_row) and ds[g] = d[g] *
 * (s16[2g] + s16[2g + 1]) (a bias mode's second term, computed once a row, not once a weight row). */
static void prepare_row(const float *x, int64_t K, int64_t m, int8_t *q, float *d, int32_t *s16, float *ds) {
    const int64_t G = K / 32;
    quant_row(x + m * K, K, q + m * K, d + m * G, s16 + m * 2 * G);
    for (int64_t g = 0; g < G; g++)
        ds[m * G + g] = d[m * G + g] * (float)(s16[m * 2 * G + 2 * g] + s16[m * 2 * G + 2 * g + 1]);
}

/* The mode an "f16s" matrix takes: its bias exactly the layout's own offset -> IM_F16I (the offset is
 * subtracted in the integer sum), else IM_F16S. Other modes: themselves. */
static int resolve_mode(int kind, int mode, const void *bias) {
    if (mode != IM_F16S) return mode;
    const float off = kind == I8 ? 128.0f : kind == I5 ? 16.0f : 8.0f;
    return ((const float *)bias)[0] == -off ? IM_F16I : IM_F16S;
}

/* int_mm's scratch, one per calling thread, grown when a call needs more and otherwise kept. Why: malloc
 * and free on every call made a prefill GEMM's quantized rows (M 512, K 8,960: 6.9 MB) an mmap / munmap
 * in glibc, every page faulted in afresh on each of a forward's calls. The calling thread owns its buffer:
 * its OpenMP workers touch it only inside that call's parallel region. The key's destructor frees it when
 * the thread exits (chat_cli answers each turn on a new thread). */
typedef struct {
    void *base;         /* 64-byte aligned, cap bytes */
    size_t cap;
} Scratch;
static __thread Scratch scratch;
static pthread_key_t scratch_key;
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;

static void scratch_make_key(void) {
    if (pthread_key_create(&scratch_key, free)) abort();
}

/* This thread's scratch, at least `bytes` (a multiple of 64); its contents are whatever a call left. */
static void *scratch_get(size_t bytes) {
    if (bytes <= scratch.cap) return scratch.base;
    pthread_once(&scratch_once, scratch_make_key);
    free(scratch.base);
    scratch.base = aligned_alloc(64, bytes);
    if (!scratch.base || pthread_setspecific(scratch_key, scratch.base)) abort();
    scratch.cap = bytes;
    return scratch.base;
}

static size_t round64(size_t n) { return (n + 63) / 64 * 64; }

/* The quantized rows of M x K activations in the calling thread's scratch: one buffer, xq (M, K) | dx (M, G) |
 * ds (M, G) | s16 (M, 2G), each part 64-byte aligned (G = K / 32). Valid until the thread's next call. */
static void act_scratch(int64_t M, int64_t K, int8_t **xq, float **dx, float **ds, int32_t **s16) {
    const int64_t G = K / 32;
    const size_t nq = round64((size_t)(M * K)), nd = round64((size_t)(M * G) * sizeof(float));
    char *buf = scratch_get(nq + 2 * nd + round64((size_t)(M * 2 * G) * sizeof(int32_t)));
    *xq = (int8_t *)buf;
    *dx = (float *)(buf + nq);
    *ds = (float *)(buf + nq + nd);
    *s16 = (int32_t *)(buf + nq + 2 * nd);
}

/* x: (M, K) fp32 contiguous, K a multiple of 32; y: rows of stride ldy; w: a layout above, N real rows.
 * Side effects: writes y[:, :N] only, and the calling thread's scratch (the quantized rows: 1.5 K bytes a
 * row; grown, never freed before the thread exits). Threads quantize rows, then take chunks of blocks as
 * they come free (which thread does a block never changes its arithmetic). */
static void int_mm(int kind, int mode, const float *x, int64_t M, const IMat *w, int64_t N, float *y,
                   int64_t ldy, int nthreads) {
    const int64_t K = w->K, nb = (N + IBLK - 1) / IBLK;
    if (M <= 0 || N <= 0) return;
    int8_t *xq;
    float *dx, *ds;
    int32_t *s16;
    act_scratch(M, K, &xq, &dx, &ds, &s16);
    const IAct act = {xq, dx, s16, ds};
    const int64_t per = (nb + (int64_t)nthreads * 8 - 1) / ((int64_t)nthreads * 8);
#pragma omp parallel num_threads(nthreads) if (M * K * N > (1 << 18))
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) prepare_row(x, K, m, xq, dx, s16, ds);
#pragma omp for schedule(dynamic, 1)
        for (int64_t c = 0; c < (nb + per - 1) / per; c++) {
            const int64_t b0 = c * per, b1 = b0 + per < nb ? b0 + per : nb;
            blocks(kind, mode, w, N, M, &act, b0, b1, y, ldy);
        }
    }
}

/* One projection's parts (int layouts, stacked along the outputs, as layer.c's TqPart: every field 8 bytes). */
typedef struct {
    int64_t layout, mode, n;
    const uint8_t *codes, *high;
    const void *scale, *bias;
    const uint16_t *sup;
} IPart;

#define MAX_IPARTS 8

/* y[:, off_p : off_p + n_p] = x parts[p]^T for every part p (off_p: the parts before it), x quantized once and
 * every part's chunks of blocks in one parallel region. Why: a fused q|k|v or gate|up (or a DeltaNet's four
 * input projections) took a parallel region and a quantization of x per part; a decode step's regions cost
 * more than its products. The bits are each part's own int_mm's (an output's arithmetic never depends on the
 * chunk or thread that runs it). 0, or -2 on a part it does not take (nothing written then). */
int tq_int8_parts(const float *x, int64_t M, int64_t K, const IPart *parts, int64_t nparts, float *y, int64_t ldy,
                  int nthreads) {
    int kinds[MAX_IPARTS], modes[MAX_IPARTS];
    int64_t first[MAX_IPARTS + 1], per[MAX_IPARTS], off[MAX_IPARTS], total_n = 0;
    if (nparts < 1 || nparts > MAX_IPARTS || K % 32 || M <= 0) return -2;
    first[0] = 0;
    for (int64_t p = 0; p < nparts; p++) {
        const IPart *t = &parts[p];
        if (tq_layout_family(t->layout) != TQ_INT || !tq_has_entry(t->layout, t->mode) || t->n <= 0) return -2;
        kinds[p] = tq_layout_bits(t->layout);       /* the kind enum's values are the bits */
        modes[p] = resolve_mode(kinds[p], (int)t->mode, t->bias);
        const int64_t nb = (t->n + IBLK - 1) / IBLK;
        per[p] = (nb + (int64_t)nthreads * 8 - 1) / ((int64_t)nthreads * 8);
        first[p + 1] = first[p] + (nb + per[p] - 1) / per[p];
        off[p] = total_n;
        total_n += t->n;
    }
    int8_t *xq;
    float *dx, *ds;
    int32_t *s16;
    act_scratch(M, K, &xq, &dx, &ds, &s16);
    const IAct act = {xq, dx, s16, ds};
#pragma omp parallel num_threads(nthreads) if (M * K * total_n > (1 << 18))
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) prepare_row(x, K, m, xq, dx, s16, ds);
#pragma omp for schedule(dynamic, 1)
        for (int64_t c = 0; c < first[nparts]; c++) {
            int64_t p = 0;
            while (c >= first[p + 1]) p++;
            const IPart *t = &parts[p];
            const IMat w = {t->codes, t->high, t->scale, t->bias, t->sup, K};
            const int64_t nb = (t->n + IBLK - 1) / IBLK, b0 = (c - first[p]) * per[p];
            const int64_t b1 = b0 + per[p] < nb ? b0 + per[p] : nb;
            blocks(kinds[p], modes[p], &w, t->n, M, &act, b0, b1, y + off[p], ldy);
        }
    }
    return 0;
}

/* ---- the entries (kernels/build.py INT8_VARIANTS; the mm_fn signature of layer.c's table) ---------- */

/* The integer path this build took: part of the kernels' description (the bits do not depend on it). */
const char *tq_int8_path(void) { return INT8_PATH; }

/* x (M, K) -> q (M, K) int8, d (M, K/32), s16 (M, K/16): the activations' quantization, for tests. */
void tq_int8_quant(const float *x, int64_t M, int64_t K, int8_t *q, float *d, int32_t *s16) {
    for (int64_t m = 0; m < M; m++) quant_row(x + m * K, K, q + m * K, d + m * (K / 32), s16 + m * (K / 16));
}

/* x (M, K) -> the rows' quantized activations for tq_int8_range: q (M, K) int8, d (M, K/32), s16 (M, K/16),
 * ds (M, K/32); rows [m0, m1) only (the caller's threads split the rows). Side effects: those rows. */
void tq_int8_prepare(const float *x, int64_t K, int64_t m0, int64_t m1, int8_t *q, float *d, int32_t *s16,
                     float *ds) {
    for (int64_t m = m0; m < m1; m++) prepare_row(x, K, m, q, d, s16, ds);
}

/* One thread's share of an int-layout product on prepared activations (tq_int8_prepare): blocks [b0, b1)
 * of 16 weight rows for all M rows -> y (stride ldy). layout, mode: an INT layout of layouts.h and a mode it
 * has an entry for, by their codes. The same bits as the tq_i*_mm entries (the arithmetic of
 * an output never depends on which blocks a call takes). 0, or -2 on a layout / mode / range it does not
 * take. Side effects: y's rows at those blocks' columns. */
int tq_int8_range(int64_t layout, int64_t mode, const int8_t *q, const float *d, const int32_t *s16,
                  const float *ds, int64_t M, int64_t K, const uint8_t *codes, const uint8_t *high,
                  const void *scale, const void *bias, const uint16_t *sup, int64_t N, int64_t b0, int64_t b1,
                  float *y, int64_t ldy) {
    if (tq_layout_family(layout) != TQ_INT || !tq_has_entry(layout, mode) || K % 32 || b0 < 0
        || b1 > (N + IBLK - 1) / IBLK)
        return -2;
    const int kind = tq_layout_bits(layout);
    const IMat w = {codes, high, scale, bias, sup, K};
    const IAct act = {q, d, s16, ds};
    if (M > 0 && b1 > b0) blocks(kind, resolve_mode(kind, (int)mode, bias), &w, N, M, &act, b0, b1, y, ldy);
    return 0;
}

/* [RAW] A streamed expert's matrix multiplied straight from its GGML blocks as read (models/moe.py serves an expert
 * it does not keep this way): each block of 16 rows is converted into this call's scratch by convert.c's
 * tq_convert_int_block (the same fields tq_convert_int writes for those rows) and multiplied there at once by
 * `blocks`, for all M rows, so the arithmetic of every output is tq_int8_range's on the converted matrix: the same
 * bits ([SAME-BITS]; tests/test_qint8_raw.py). Why: converting a whole expert into the int layout first, then
 * multiplying, wrote and re-read ~2.9 MB an expert and cost a conversion call (and its Python) a slab: 3.0-3.5 s
 * of C and ~1 s of Python of the capped 30B benchmark's turn 2 (issue 49). Here a block's codes stay in L1 from
 * conversion to product.
 * qtype: GGML's Q4_K (12), Q5_K (13), Q6_K (14); raw: N rows of K / 256 blocks each (N % 16 == 0); the rest as
 * tq_int8_range. 0, or -2 on a type, shape or range it does not take, -3 out of memory (nothing written then).
 * Side effects: y's rows at blocks [b0, b1)'s columns. */
int tq_convert_int_block(int qtype, const uint8_t *src, int64_t cols, uint8_t *codes, uint8_t *high,
                         uint8_t *scale, uint8_t *bias, uint16_t *sup, uint8_t *work);

int tq_int8_raw_range(int64_t qtype, const int8_t *q, const float *d, const int32_t *s16, const float *ds,
                      int64_t M, int64_t K, const uint8_t *raw, int64_t N, int64_t b0, int64_t b1, float *y,
                      int64_t ldy) {
    int kind, mode, size;
    switch (qtype) {
#define RAW_CASE(ggml, code, layout, m, bytes) \
    case code: kind = tq_layout_bits(TQ_LAYOUT_##layout); mode = TQ_MODE_##m; size = bytes; break;
    TQ_RAW_TYPES(RAW_CASE)          /* layouts.h's RAW_TYPE lines: the int layout each type's bits are */
#undef RAW_CASE
    default: return -2;
    }
    if (K <= 0 || K % 256 || N <= 0 || N % IBLK || b0 < 0 || b1 > N / IBLK) return -2;
    if (M <= 0 || b1 <= b0) return 0;
    const int64_t row_bytes = K / 256 * size;
    const size_t n_codes = round64((size_t)K * 8), n_high = round64((size_t)K * 4), n_sc = round64((size_t)K),
                 n_sup = round64((size_t)K / 4), n_work = (size_t)K * IBLK;
    uint8_t *buf = aligned_alloc(64, n_codes + n_high + 2 * n_sc + n_sup + n_work);
    if (!buf) return -3;
    uint8_t *codes = buf, *high = codes + n_codes, *scale = high + n_high, *bias = scale + n_sc;
    uint16_t *sup = (uint16_t *)(bias + n_sc);
    uint8_t *work = bias + n_sc + n_sup;
    const IMat w = {codes, kind == I4 ? NULL : high, scale, mode == IM_K ? bias : NULL, sup, K};
    const IAct act = {q, d, s16, ds};
    int rc = 0;
    for (int64_t b = b0; b < b1 && !rc; b++) {
        rc = tq_convert_int_block((int)qtype, raw + b * IBLK * row_bytes, K, codes, (uint8_t *)w.high,
                                  scale, (uint8_t *)w.bias, sup, work) ? -2 : 0;
        if (!rc) blocks(kind, mode, &w, IBLK, M, &act, 0, 1, y + b * IBLK, ldy);
    }
    free(buf);
    return rc;
}

#define INT_ARGS const float *x, int64_t M, int64_t K, const uint8_t *codes, const uint8_t *high, \
    const void *scale, const void *bias, const uint16_t *sup, int64_t N, float *y, int64_t ldy, int nthreads
#define INT_MAT {codes, high, scale, bias, sup, K}
/* Every INT entry of layouts.h: tq_<layout>_<mode>_mm. f16s: the layout's own offset (Q4_0 / Q5_0 / Q8_0) is
 * subtracted in the integer sum (resolve_mode; for the other modes the test is constant false). */
#define INT_EXPORT(NAME, KIND, MODE) void NAME(INT_ARGS) { \
    const IMat w = INT_MAT; \
    int_mm(KIND, (int)(MODE) == IM_F16S ? resolve_mode(KIND, IM_F16S, bias) : (MODE), x, M, &w, N, y, ldy, nthreads); }
#define TQ_ENTRY(L, M, bits) INT_EXPORT(tq_##L##_##M##_mm, I##bits, TQ_MODE_##M)
TQ_LAYOUTS(TQ_ENTRIES_INT)
#undef TQ_ENTRY
