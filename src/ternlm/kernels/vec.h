/* Shared by attention.c and layer.c: 16-float vectors (GCC vector extensions, mapped by the compiler
 * onto AVX-512, AVX2 or SSE for the host), a fixed-order horizontal sum and our own exp. Part of the
 * kernels' digest (kernels/build.py), so a change here changes the KV cache's namespace. */
#ifndef TERNLM_VEC_H
#define TERNLM_VEC_H
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

static inline __attribute__((unused)) v16 load16(const float *p) { v16 r; memcpy(&r, p, sizeof r); return r; }
static inline __attribute__((unused)) v16 splat(float x) { return (v16){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }

/* fp16 <-> fp32 for the KV cache, 16 lanes (IEEE, round to nearest even both ways): AVX-512 or F16C
 * instructions where the build has them, libgcc's exact software conversion on baseline x86-64, so every
 * build stores and reads the same bits. (GCC turns a _Float16 vector conversion into 16 scalar ones,
 * hence the intrinsics.) */
static inline __attribute__((unused)) v16 load16h(const _Float16 *p) {
    v16 o;
#if defined(__AVX512F__)
    __m512 r = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
    memcpy(&o, &r, sizeof o);
#elif defined(__F16C__) && defined(__AVX__)
    __m256 r[2] = {_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)),
                   _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8)))};
    memcpy(&o, r, sizeof o);
#else
    for (int i = 0; i < 16; i++) o[i] = (float)p[i];
#endif
    return o;
}

static inline __attribute__((unused)) void store16h(_Float16 *p, v16 x) {
#if defined(__AVX512F__)
    __m512 r;
    memcpy(&r, &x, sizeof r);
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtps_ph(r, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#elif defined(__F16C__) && defined(__AVX__)
    __m256 r[2];
    memcpy(r, &x, sizeof r);
    _mm_storeu_si128((__m128i *)p, _mm256_cvtps_ph(r[0], _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    _mm_storeu_si128((__m128i *)(p + 8), _mm256_cvtps_ph(r[1], _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#else
    for (int i = 0; i < 16; i++) p[i] = (_Float16)x[i];
#endif
}

/* 16 lanes of a KV row at element i: fp16 (half != 0) or fp32. */
static inline __attribute__((unused)) v16 load_kv(const void *base, int64_t i, int half) {
    return half ? load16h((const _Float16 *)base + i) : load16((const float *)base + i);
}

/* Lanes of a where mask (all ones) is set, else of b (C has no vector ?:). */
static inline __attribute__((unused)) v16 select16(v16i mask, v16 a, v16 b) {
    v16i ai, bi, r;
    memcpy(&ai, &a, sizeof a);
    memcpy(&bi, &b, sizeof b);
    r = (ai & mask) | (bi & ~mask);
    v16 out;
    memcpy(&out, &r, sizeof out);
    return out;
}

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

static inline __attribute__((unused)) float hmax(v16 a) {
    float m = a[0];
    for (int i = 1; i < 16; i++) m = a[i] > m ? a[i] : m;
    return m;
}

/* e^x for x <= 0 (softmax arguments), exact 0 below -104 (and for -inf). Relative error ~2e-7. */
static inline __attribute__((unused)) v16 exp16(v16 x) {
    v16i under = x < splat(-87.0f);                      /* 2^n below would leave fp32's normal range */
    x = select16(under, splat(-87.0f), x);
    /* round to nearest: adding and removing 1.5 * 2^23 (exact for |t| < 2^22; no -ffast-math here) */
    v16 n = (x * splat(1.44269504088896341f) + splat(12582912.0f)) - splat(12582912.0f);
    v16 r = x - n * splat(0.693359375f);                 /* ln2 split in two for an exact-ish reduction */
    r = r - n * splat(-2.12194440e-4f);
    v16 p = splat(1.0f / 720.0f);
    p = p * r + splat(1.0f / 120.0f);
    p = p * r + splat(1.0f / 24.0f);
    p = p * r + splat(1.0f / 6.0f);
    p = p * r + splat(0.5f);
    p = p * r + splat(1.0f);
    p = p * r + splat(1.0f);
    v16i e = (__builtin_convertvector(n, v16i) + 127) << 23;
    v16 scale;
    memcpy(&scale, &e, sizeof scale);
    return select16(under, splat(0.0f), p * scale);
}

#endif
