/* Shared by attention.c and layer.c: 16-float vectors (GCC vector extensions, mapped by the compiler
 * onto AVX-512, AVX2 or SSE for the host), vectors of the host's own width (`vf`), fixed-order
 * horizontal sums and our own exp. Part of the kernels' digest (kernels/build.py), so a change here
 * changes the KV cache's namespace. */
#ifndef TERNLM_VEC_H
#define TERNLM_VEC_H
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__F16C__) || defined(__AVX512F__) || defined(__FMA__)
#include <immintrin.h>
#endif

typedef float v16 __attribute__((vector_size(64)));

static inline __attribute__((unused)) v16 load16(const float *p) { v16 r; memcpy(&r, p, sizeof r); return r; }
static inline __attribute__((unused)) v16 splat(float x) { return (v16){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }

/* Sum of 16 lanes as a fixed tree: halves, quarters, ... */
static inline __attribute__((unused)) float hsum(v16 a) {
    typedef float v8 __attribute__((vector_size(32)));
    typedef float v4 __attribute__((vector_size(16)));
    v8 b = __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
    v4 c = __builtin_shufflevector(b, b, 0, 1, 2, 3) + __builtin_shufflevector(b, b, 4, 5, 6, 7);
    return (c[0] + c[2]) + (c[1] + c[3]);
}

/* hsum of 16 vectors at once: lane j of the result = hsum(d[j]) bit for bit, the same adds of the same
 * lanes in the same tree (halves, quarters, then (c0 + c2) + (c1 + c3)), done for 16 vectors side by
 * side with two-source shuffles: 15 shuffle pairs and adds instead of 16 separate trees and stores
 * (attention scores: +12% on the kernel). */
static inline __attribute__((unused)) v16 hsum16x(const v16 *d) {
#define SH2(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
    v16 e[8], f[4], g[2];
    for (int i = 0; i < 8; i++)        /* lanes 0-7: vector 2i's b = lo8 + hi8, lanes 8-15: vector 2i+1's */
        e[i] = SH2(d[2 * i], d[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
             + SH2(d[2 * i], d[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; i++)        /* lanes 4m..4m+3: vector 4i+m's c = b[0..3] + b[4..7] */
        f[i] = SH2(e[2 * i], e[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27)
             + SH2(e[2 * i], e[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int i = 0; i < 2; i++)        /* lanes 2m, 2m+1: vector 8i+m's c0 + c2, c1 + c3 */
        g[i] = SH2(f[2 * i], f[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29)
             + SH2(f[2 * i], f[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return SH2(g[0], g[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30)
         + SH2(g[0], g[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
#undef SH2
}

/* ---- The host's own vector width: VN floats (16 on AVX-512, 8 on AVX2, 4 on baseline x86-64) ----
 * Without AVX-512, GCC has no machine mode for a 16-float vector: a v16 lives in memory, every operation
 * loads and stores its pieces, and a comparison or a two-source shuffle of it becomes 16 scalar steps
 * (measured in the x86-64-v3 build: attention 6-7x slower than the AVX-512 build, exp16 285 scalar
 * instructions). Code that runs long loops (attention.c) is written for `vf` instead: the same
 * algorithm with VN lanes, so its bits depend on the build (as the cache's kernel digest does). */
#if defined(__AVX512F__)
#define VN 16
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define VN 8
#else
#define VN 4
#endif
typedef float vf __attribute__((vector_size(VN * 4)));
typedef int32_t vfi __attribute__((vector_size(VN * 4)));

static inline __attribute__((unused)) vf loadn(const float *p) { vf r; memcpy(&r, p, sizeof r); return r; }
static inline __attribute__((unused)) void storen(float *p, vf x) { memcpy(p, &x, sizeof x); }
static inline __attribute__((unused)) vf splatn(float x) {   /* (a loop of lane stores is not a broadcast) */
#if VN == 16
    return (vf){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x};
#elif VN == 8
    return (vf){x, x, x, x, x, x, x, x};
#else
    return (vf){x, x, x, x};
#endif
}

/* a * b + c, VN lanes, rounded once where the build has FMA (twice on baseline x86-64, which has none).
 * The kernels build with -ffp-contract=off (kernels/build.py): a fused product is one written here, never
 * one the compiler chose for this code shape, so every shape computes a value the same way. */
static inline __attribute__((unused)) vf fman(vf a, vf b, vf c) {
#if VN == 16
    return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif VN == 8
    return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#elif defined(__FMA__)
    return (vf)_mm_fmadd_ps((__m128)a, (__m128)b, (__m128)c);
#else
    return a * b + c;
#endif
}

/* fp16 <-> fp32 for the KV cache, VN lanes (IEEE, round to nearest even both ways): AVX-512 or F16C
 * instructions where the build has them, libgcc's exact software conversion on baseline x86-64, so every
 * build stores and reads the same bits. (GCC turns a _Float16 vector conversion into scalar ones, hence
 * the intrinsics.) */
static inline __attribute__((unused)) vf loadnh(const _Float16 *p) {
#if VN == 16
    return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#elif VN == 8
    return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
    vf o;
    for (int i = 0; i < VN; i++) o[i] = (float)p[i];
    return o;
#endif
}

static inline __attribute__((unused)) void storenh(_Float16 *p, vf x) {
#if VN == 16
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtps_ph((__m512)x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#elif VN == 8
    _mm_storeu_si128((__m128i *)p, _mm256_cvtps_ph((__m256)x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#else
    for (int i = 0; i < VN; i++) p[i] = (_Float16)x[i];
#endif
}

/* The KV cache's row formats (a row: one token's D values of one kv head), models/../kv/kvtype.py's codes:
 *   KV_F32  D floats;  KV_F16  D fp16;
 *   KV_Q8   D int8 codes, then D / 32 fp16 scales (GGML's Q8_0 numbers, codes and scales apart so a chunk's
 *           codes load as one vector): value i = code[i] * scale[i / 32], a product that is exact in fp32
 *           (8-bit code x 11-bit significand), so reading a q8_0 row gives the same floats on every build. */
enum { KV_F32 = 0, KV_F16 = 1, KV_Q8 = 2 };

static inline __attribute__((unused)) int64_t kv_row_bytes(int mode, int64_t D) {
    return mode == KV_F32 ? 4 * D : mode == KV_F16 ? 2 * D : D + D / 16;
}

/* VN int8 -> VN floats, exactly. */
static inline __attribute__((unused)) vf loadn_i8(const int8_t *p) {
#if VN == 16
    return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
#elif VN == 8
    return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#else
    vf o;
    for (int i = 0; i < VN; i++) o[i] = (float)p[i];
    return o;
#endif
}

/* VN lanes of one KV row (`row`: its first byte) from value `col` (a multiple of VN; VN divides 32, so the
 * lanes share one q8_0 scale), widened to fp32 exactly. mode: KV_F32 | KV_F16 | KV_Q8; D: the row's values. */
static inline __attribute__((unused)) vf loadn_kv(const void *row, int64_t col, int mode, int64_t D) {
    if (mode == KV_F16) return loadnh((const _Float16 *)row + col);
    if (mode == KV_F32) return loadn((const float *)row + col);
    _Float16 sc;
    memcpy(&sc, (const char *)row + D + 2 * (col / 32), sizeof sc);
    return loadn_i8((const int8_t *)row + col) * splatn((float)sc);
}

static inline __attribute__((unused)) vf selectn(vfi mask, vf a, vf b) {   /* a where mask, else b */
    vfi ai, bi, r;
    memcpy(&ai, &a, sizeof a);
    memcpy(&bi, &b, sizeof b);
    r = (ai & mask) | (bi & ~mask);
    vf out;
    memcpy(&out, &r, sizeof out);
    return out;
}

#define SH2(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
/* Sum of VN lanes as a fixed tree: halves, quarters, ..., then (c0 + c2) + (c1 + c3): hsum's tree
 * when VN = 16. */
static inline __attribute__((unused)) float hsumn(vf a) {
    typedef float v4 __attribute__((vector_size(16)));
#if VN == 16
    return hsum(a);
#elif VN == 8
    v4 c = SH2(a, a, 0, 1, 2, 3) + SH2(a, a, 4, 5, 6, 7);
    return (c[0] + c[2]) + (c[1] + c[3]);
#else
    return (a[0] + a[2]) + (a[1] + a[3]);
#endif
}

/* hsumn of VN vectors at once: lane j of the result = hsumn(d[j]) bit for bit (the same adds of the same
 * lanes, side by side, with two-source shuffles). hsum16x when VN = 16. */
static inline __attribute__((unused)) vf hsumnx(const vf *d) {
#if VN == 16
    return hsum16x(d);
#elif VN == 8
    vf e[4], f[2], h;
    for (int i = 0; i < 4; i++)        /* lanes 0-3: vector 2i's c = a[0..3] + a[4..7], lanes 4-7: 2i+1's */
        e[i] = SH2(d[2 * i], d[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11)
             + SH2(d[2 * i], d[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
    for (int i = 0; i < 2; i++)        /* lanes 0-1: vector 4i's c0 + c2, c1 + c3; 2-3: 4i+2's; 4-5: 4i+1's;
                                        * 6-7: 4i+3's */
        f[i] = SH2(e[2 * i], e[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13)
             + SH2(e[2 * i], e[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    /* vectors (0, 2, 4, 6, 1, 3, 5, 7): (c0 + c2) + (c1 + c3), then into order */
    h = SH2(f[0], f[1], 0, 2, 8, 10, 4, 6, 12, 14) + SH2(f[0], f[1], 1, 3, 9, 11, 5, 7, 13, 15);
    return SH2(h, h, 0, 4, 1, 5, 2, 6, 3, 7);
#else
    vf f0 = SH2(d[0], d[1], 0, 1, 4, 5) + SH2(d[0], d[1], 2, 3, 6, 7);   /* d0: c0+c2, c1+c3; d1: same */
    vf f1 = SH2(d[2], d[3], 0, 1, 4, 5) + SH2(d[2], d[3], 2, 3, 6, 7);
    return SH2(f0, f1, 0, 2, 4, 6) + SH2(f0, f1, 1, 3, 5, 7);
#endif
}
#undef SH2

static inline __attribute__((unused)) float hmaxn(vf a) {
    float m = a[0];
    for (int i = 1; i < VN; i++) m = a[i] > m ? a[i] : m;
    return m;
}

static inline __attribute__((unused)) vf maxn(vf a, vf b) { return selectn(a > b, a, b); }

/* e^x for x <= 0 (softmax arguments), exact 0 below -104 (and for -inf). Relative error ~2e-7. */
static inline __attribute__((unused)) vf expn(vf x) {
    vfi under = x < splatn(-87.0f);                      /* 2^n below would leave fp32's normal range */
    x = selectn(under, splatn(-87.0f), x);
    /* round to nearest: adding and removing 1.5 * 2^23 (exact for |t| < 2^22; no -ffast-math here) */
    vf n = fman(x, splatn(1.44269504088896341f), splatn(12582912.0f)) - splatn(12582912.0f);
    vf r = fman(n, splatn(-0.693359375f), x);            /* ln2 split in two for an exact-ish reduction */
    r = fman(n, splatn(2.12194440e-4f), r);
    vf p = splatn(1.0f / 720.0f);
    p = fman(p, r, splatn(1.0f / 120.0f));
    p = fman(p, r, splatn(1.0f / 24.0f));
    p = fman(p, r, splatn(1.0f / 6.0f));
    p = fman(p, r, splatn(0.5f));
    p = fman(p, r, splatn(1.0f));
    p = fman(p, r, splatn(1.0f));
    vfi e = (__builtin_convertvector(n, vfi) + 127) << 23;
    vf scale;
    memcpy(&scale, &e, sizeof scale);
    return selectn(under, splatn(0.0f), p * scale);
}

#endif
