/* The opt-in quantized product on AMX tiles (Intel Sapphire Rapids and later; TERNLM_AMX=1, kernels/build.py):
 * y[m, n] = sum_k x[m, k] * w[n, k] over the row layouts of models/qweight.py, w = fma(scale, code, bias) per
 * group (exactly GGML's dequantized fp32 value). Every other build, and this one without TERNLM_AMX=1, runs
 * the lanes layouts (qlanes.c) instead; there only the entries' stubs at the end are compiled.
 *
 * Row layouts (K a multiple of 32; rows of w are output features):
 *   q4g32: codes (N, K/2) bytes; in each group of 32, byte j holds element j (low nibble) and j+16
 *          (high nibble), GGML's layout; scale/bias (N, K/32).
 *   q5g32: q4g32's nibbles plus high (N, K/8) bytes: per group 4 bytes, bit j (little-endian) the
 *          fifth bit (value 16) of element j; scale/bias (N, K/32).
 *   q8g16: codes (N, K) bytes 0..255; Q6_K's int8 scales per group of 16 (mode "k6" only).
 *   q8g32: codes (N, K) bytes 0..255; scale/bias (N, K/32).
 *
 * Why: with fp32 activations the FMA path is FMA-bound at ~15 multiply-adds a cycle a core; one
 * TDPBF16PS does 16 x 16 x 32 of them in ~16 cycles. AMX multiplies bf16 only, so:
 *   - the weights enter as their codes, exact small integers in bf16 (c - k where the layout has an
 *     offset k, else c), and the group's scale s and bias b are applied after the tile product:
 *       sum_k w x = s * sum_k (c - k) x  [+ b * sum_k x]      (per group of 32, or 16 for q8g16);
 *   - each fp32 activation is held exactly as three bf16 parts, x = x1 + x2 + x3 (x1 = bf16(x),
 *     x2 = bf16(x - x1), x3 = x - x1 - x2: 8 + 8 + 8 significant bits cover fp32's 24), and the tile
 *     product runs once per part into the same fp32 accumulators. Every product of a code and a part
 *     is exact in fp32; only the sums round, as in the fp32 path. (Inputs below 2^-126 / 2^16 lose bits
 *     in x3: AMX flushes bf16 denormals.) Activations are fp32 here, as on every other path.
 *
 * [BATCH-INVARIANT] A row's bits do not depend on M, the tile it lands in, or the threads: element
 * (m, n) of a group's tile product depends only on row m's parts and weight row n's codes (checked:
 * the same bits with 1 or 16 columns), and the epilogue is the same scalar arithmetic per element,
 *     acc = fma(s, C, acc); acc = fma(b, xs, acc)      (groups in order; xs: row m's group sum)
 * whether lanes run over weight rows (narrow: M <= 4) or over activation rows (wide). TDPBF16PS rounds in
 * an order no AVX-512 code reproduces, so every M of every product runs here: the build's ISA, "amx", is
 * in the cache namespace.
 *
 * Opt-in, because of what it measured against the lanes kernels (2-core Sapphire Rapids, 1,024-token
 * prompt, `ternlm bench engine`, interleaved rounds on a busy host: benchmarks/results/k40/TABLE.md):
 * prefill x1.34 (smollm2) and x1.47 (qwen2.5-0.5b), decode x0.38 and x0.40 (medians of 6 rounds).
 * Decode is the catch: every group's tile product has to leave the tiles (a 1 KiB store, a reload) for
 * its scale before the next group, and the codes have to be written out as bf16 to be loaded as a tile:
 * at M = 1 that costs more than dequantize-and-FMA, and batch invariance forbids another path for small M.
 *
 * Linux hands out the tiles' 8 KiB of state on request (arch_prctl ARCH_REQ_XCOMP_PERM): tq_amx_init,
 * called once by kernels/build.py before any product when TERNLM_AMX=1.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "layouts.h"

#define MM_ARGS const float *x, int64_t M, int64_t K, const uint8_t *codes, const uint8_t *high, \
    const void *scale, const void *bias, const uint16_t *sup, int64_t N, float *y, int64_t ldy, int nthreads

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__) \
    && defined(__AVX512VL__) && defined(__F16C__)
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <sys/syscall.h>
#include <unistd.h>

#define INLINE static inline __attribute__((always_inline))

enum { Q4 = 4, Q5 = 5, Q8 = 8 };   /* code kinds: packed nibbles, nibbles + high bit, bytes (layouts.h bits) */

/* Scale modes (layouts.h's numbering; SM_F16I internal): how a group's scale and bias are stored. Every
 * mode yields exactly the fp32 value GGML's dequantizer computes.
 *   SM_F32: fp32 scale and bias per group.
 *   SM_F16: fp16 scale and bias per group (GGML's own fp16 d and m).
 *   SM_K:   Q4_K / Q5_K: uint8 sc and m per group of 32, fp16 (d, dmin) per 256 in sup:
 *           scale d*sc, bias -(dmin*m) (both products exact in fp32).
 *   SM_K6:  Q6_K: int8 sc per group of 16, fp16 d per 256 in sup: scale d*sc, codes c - 32, no bias.
 *   SM_F16S: fp16 scale per group, bias = scale * bias[0], one fp32 constant for the matrix.
 *   SM_F16I: SM_F16S whose constant is the layout's own code offset -k (Q4_0 -8, Q5_0 -16, Q8_0 -128;
 *           picked per call): the codes enter as c - k and there is no bias term. */
enum { SM_F32 = TQ_MODE_f32, SM_F16 = TQ_MODE_f16, SM_K = TQ_MODE_k, SM_K6 = TQ_MODE_k6, SM_F16S = TQ_MODE_f16s,
       SM_F16I = TQ_NMODES };

/* Pointers to one weight row: codes, high bits (q5g32), scales, biases, K-quant super-block scales. */
typedef struct {
    const uint8_t *c;
    const uint8_t *h;
    const void *s;
    const void *b;
    const uint16_t *sup;
    int64_t g0;       /* this row's first group in s/b */
} Row;

INLINE float half_to_float(uint16_t h) { return _cvtsh_ss(h); }

INLINE uint32_t high_bits(const Row *r, int64_t g) {
    uint32_t v;
    memcpy(&v, r->h + 4 * g, 4);
    return v;
}

/* Scales and biases of up to 16 consecutive groups of one weight row, as fp32. */
typedef struct { float s[16], b[16]; } Scales16;

/* The K-quant modes' groups a .. a+n-1 (n <= 16; a counts groups from the matrix start) -> sb: scale d*sc
 * and bias -(dmin*m) (SM_K) or -32 * scale (SM_K6), exact fp32 products. a is a multiple of 8 (SM_K) or
 * 16 (SM_K6): blocks start at a row's start or 16 groups on, and a row holds whole super-blocks. */
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
                                                 _mm512_set1_epi32((int)0x80000000u)));  /* -(dmin*m) */
    } else {                       /* SM_K6: 16 groups of 16 under one super-block */
        __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, (const int8_t *)r->s + a)));
        s = _mm512_mul_ps(_mm512_set1_ps(half_to_float(r->sup[a / 16])), sc);
        b = _mm512_mul_ps(s, _mm512_set1_ps(-32.0f));
    }
    _mm512_storeu_ps(sb->s, s);
    _mm512_storeu_ps(sb->b, b);
}

/* Set once by tq_amx_init, before any product runs, never after: which path this process takes. */
static int amx_on;

int tq_amx_init(void) {
    amx_on = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
    return amx_on;
}

/* Tiles: 0-3 C (16 weight rows x mt columns, fp32), 4 A (16 weight rows x gsz codes, bf16), 5-7 B (the
 * three parts: gsz/2 pairs x mt columns). */
typedef struct __attribute__((aligned(64))) {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileCfg;

static void amx_config(int mt, int gsz) {
    TileCfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 4; i++) { c.rows[i] = 16; c.colsb[i] = (uint16_t)(4 * mt); }
    c.rows[4] = 16; c.colsb[4] = (uint16_t)(2 * gsz);
    for (int i = 5; i < 8; i++) { c.rows[i] = (uint8_t)(gsz / 2); c.colsb[i] = (uint16_t)(4 * mt); }
    __asm__ volatile("" ::: "memory");      /* the stores above before ldtilecfg reads them */
    _tile_loadconfig(&c);
}

/* ---- activations: rows -> three bf16 parts in B-tile layout, and group sums ------------------------
 * xb[((t * G + g) * 3 + part) * TB + p * mt + c]: the pair p (elements 2p, 2p+1 of group g) of row
 * t * mt + c, TB = gsz / 2 * mt dwords a tile; rows past M are zero. xs[(t * G + g) * mt + c]: the
 * group's fp32 sum (a fixed tree, _mm512_reduce_add_ps), used by the scale modes with a bias. */
INLINE void split_row(const float *xr, int valid, int64_t G, int gsz, int mt, int c, uint32_t *xbt, float *xst) {
    const int64_t TB = gsz / 2 * mt;
    for (int64_t g = 0; g < G; g++) {
        __m512 v0 = valid ? _mm512_loadu_ps(xr + gsz * g) : _mm512_setzero_ps();
        __m512 v1 = valid && gsz == 32 ? _mm512_loadu_ps(xr + gsz * g + 16) : _mm512_setzero_ps();
        xst[g * mt + c] = _mm512_reduce_add_ps(gsz == 32 ? _mm512_add_ps(v0, v1) : v0);
        for (int part = 0; part < 3; part++) {
            __m512i h = (__m512i)_mm512_cvtne2ps_pbh(v1, v0);    /* elements 0-15 from v0, 16-31 from v1 */
            uint32_t d[16];
            _mm512_storeu_si512(d, h);
            uint32_t *dst = xbt + (g * 3 + part) * TB + c;
            for (int p = 0; p < gsz / 2; p++) dst[p * mt] = d[p];
            /* the exact remainder: x - bf16(x) (bf16 -> fp32 is a 16-bit shift) */
            v0 = _mm512_sub_ps(v0, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(h)), 16)));
            v1 = _mm512_sub_ps(v1, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(h, 1)), 16)));
        }
    }
}

/* ---- weights: 16 weight rows' group g -> an A tile of bf16 codes; their scales (scales_block) ----- */
typedef struct {
    __m512i lut;       /* bf16(i - off), i = 0..31: the 4- and 5-bit codes */
    int off;           /* the layout's code offset absorbed into the codes (0: a bias term instead) */
} Codes;

INLINE Codes codes_for(int kind, int sm) {
    Codes k;
    k.off = sm == SM_F16I ? (kind == Q8 ? 128 : kind == Q5 ? 16 : 8) : sm == SM_K6 ? 32 : 0;
    __m512 lo = _mm512_sub_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_ps((float)k.off));
    __m512 hi = _mm512_add_ps(lo, _mm512_set1_ps(16.0f));
    k.lut = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
    return k;
}

/* 16 x 16 floats in place: v[i] lane j <-> v[j] lane i (lane shuffles only: moves values, rounds nothing). */
INLINE void transpose16(__m512 v[16]) {
    __m512 t[16], u[16];
    for (int i = 0; i < 16; i += 2) {          /* t[i], t[i+1]: rows i, i+1 interleaved, per 128-bit lane */
        t[i] = _mm512_unpacklo_ps(v[i], v[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(v[i], v[i + 1]);
    }
    for (int a = 0; a < 4; a++) {              /* u[4a + b]: rows 4a..4a+3 of columns b, b+4, b+8, b+12 */
        __m512d t0 = _mm512_castps_pd(t[4 * a]), t1 = _mm512_castps_pd(t[4 * a + 1]);
        __m512d t2 = _mm512_castps_pd(t[4 * a + 2]), t3 = _mm512_castps_pd(t[4 * a + 3]);
        u[4 * a] = _mm512_castpd_ps(_mm512_unpacklo_pd(t0, t2));
        u[4 * a + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(t0, t2));
        u[4 * a + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(t1, t3));
        u[4 * a + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(t1, t3));
    }
    for (int b = 0; b < 4; b++) {              /* column b + 4l gathers lane l of u[b], u[4+b], u[8+b], u[12+b] */
        __m512 p = _mm512_shuffle_f32x4(u[b], u[4 + b], 0x44), q = _mm512_shuffle_f32x4(u[b], u[4 + b], 0xEE);
        __m512 p2 = _mm512_shuffle_f32x4(u[8 + b], u[12 + b], 0x44), q2 = _mm512_shuffle_f32x4(u[8 + b], u[12 + b], 0xEE);
        v[b] = _mm512_shuffle_f32x4(p, p2, 0x88);
        v[b + 4] = _mm512_shuffle_f32x4(p, p2, 0xDD);
        v[b + 8] = _mm512_shuffle_f32x4(q, q2, 0x88);
        v[b + 12] = _mm512_shuffle_f32x4(q, q2, 0xDD);
    }
}

/* Does the scale mode carry a bias term (one not absorbed as the code offset)? */
INLINE int has_bias(int sm) { return !(sm == SM_F16I || sm == SM_K6); }

/* Weight row r's group j (gsz codes) -> gsz bf16 at dst, exact. g16 layouts: j counts groups of 16. */
INLINE void deq_codes(int kind, int gsz, const Row *r, int64_t j, const Codes *k, uint16_t *dst) {
    if (kind == Q8) {
        const uint8_t *p = r->c + (int64_t)gsz * j;
        __m512 f0 = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)), _mm512_set1_epi32(k->off)));
        if (gsz == 16) {
            _mm256_store_si256((__m256i *)dst, (__m256i)_mm512_cvtneps_pbh(f0));
            return;
        }
        __m512 f1 = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + 16))), _mm512_set1_epi32(k->off)));
        _mm512_store_si512(dst, (__m512i)_mm512_cvtne2ps_pbh(f1, f0));
        return;
    }
    /* 16 bytes: element e < 16 in the low nibble of byte e, e >= 16 in the high nibble of byte e - 16 */
    const __m512i shifts = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
    __m512i w = _mm512_cvtepu8_epi16(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(r->c + 16 * j))));
    w = _mm512_and_si512(_mm512_srlv_epi16(w, shifts), _mm512_set1_epi16(15));
    if (kind == Q5) w = _mm512_mask_add_epi16(w, (__mmask32)high_bits(r, j), w, _mm512_set1_epi16(16));
    _mm512_store_si512(dst, _mm512_permutexvar_epi16(w, k->lut));
}

/* nr (<= 16) weight rows' group j -> the A tile at a (16 x gsz bf16; rows past nr zero). */
INLINE void deq_tile(int kind, int gsz, const Row *rows, int nr, int64_t j, const Codes *k, uint16_t *a) {
    for (int r = 0; r < nr; r++) deq_codes(kind, gsz, &rows[r], j, k, a + r * gsz);
    for (int r = nr; r < 16; r++) memset(a + r * gsz, 0, 2 * (size_t)gsz);
}

/* The scales (and biases) of nr weight rows for groups jb .. jb+n-1 (n <= 16), the modes' values bit for
 * bit, transposed for the epilogue: s[jj * ld + r] is row r's scale of group jb + jj (rows past nr: 0).
 * A row's 16 groups are converted at once (vcvtph2ps, or scales16 for the K-quant modes) and a 16 x 16
 * transpose turns them into vectors over weight rows (fewer instructions than one conversion per row and
 * group; no speed difference was measurable at M = 1, where the tile stores dominate). */
INLINE void scales_block(int sm, const Row *rows, int nr, int64_t jb, int n, float *s, float *b, int ld) {
    const __mmask16 m = (__mmask16)((1u << n) - 1u);
    __m512 vs[16], vb[16];
    for (int r = 0; r < 16; r++) {
        vs[r] = vb[r] = _mm512_setzero_ps();
        if (r >= nr) continue;
        const Row *w = &rows[r];
        const int64_t a = w->g0 + jb;
        if (sm == SM_K || sm == SM_K6) {
            Scales16 sb;
            scales16(w, a, n, sm, &sb);
            vs[r] = _mm512_maskz_loadu_ps(m, sb.s);
            vb[r] = _mm512_maskz_loadu_ps(m, sb.b);
        } else if (sm == SM_F32) {
            vs[r] = _mm512_maskz_loadu_ps(m, (const float *)w->s + a);
            vb[r] = _mm512_maskz_loadu_ps(m, (const float *)w->b + a);
        } else {
            vs[r] = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, (const uint16_t *)w->s + a));
            if (sm == SM_F16) vb[r] = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, (const uint16_t *)w->b + a));
            else if (sm == SM_F16S) vb[r] = _mm512_mul_ps(vs[r], _mm512_set1_ps(((const float *)w->b)[0]));
        }
    }
    transpose16(vs);
    for (int jj = 0; jj < n; jj++) _mm512_store_ps(s + jj * ld, vs[jj]);
    if (has_bias(sm)) {
        transpose16(vb);
        for (int jj = 0; jj < n; jj++) _mm512_store_ps(b + jj * ld, vb[jj]);
    }
}

/* Column c of a stored 16 x mt C tile (mt <= 4, rows of mt floats) as a vector over the 16 weight rows. */
INLINE __m512 tile_column(const float *cb, int mt, int c) {
    __m512i idx = _mm512_add_epi32(_mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                                      _mm512_set1_epi32(mt)), _mm512_set1_epi32(c));
    __m512 lo = _mm512_permutex2var_ps(_mm512_load_ps(cb), idx, _mm512_load_ps(cb + 16));
    if (mt <= 2) return lo;
    __m512 hi = _mm512_permutex2var_ps(_mm512_load_ps(cb + 32), idx, _mm512_load_ps(cb + 48));
    return _mm512_mask_blend_ps(_mm512_cmpge_epi32_mask(idx, _mm512_set1_epi32(32)), lo, hi);
}

#define TDP3(C_) do { _tile_dpbf16ps(C_, 4, 5); _tile_dpbf16ps(C_, 4, 6); _tile_dpbf16ps(C_, 4, 7); } while (0)

/* Weight row n's Row. */
INLINE Row amx_row(int kind, int g16, const uint8_t *codes, const uint8_t *high, const void *scale,
                   const void *bias, const uint16_t *sup, int64_t K, int64_t n) {
    Row r;
    int64_t ldc = kind == Q8 ? K : K / 2, ldg = K / (g16 ? 16 : 32);
    r.c = codes + n * ldc;
    r.h = kind == Q5 ? high + n * (K / 8) : NULL;
    r.s = scale; r.b = bias; r.sup = sup;
    r.g0 = n * ldg;
    return r;
}

#define WROWS 64        /* weight rows per task: 4 tiles of 16 */

/* Narrow products (M <= 4, decode): one tile of mt = M columns. Tasks of 64 weight rows (4 C tiles: the
 * B tiles of a group are loaded once for all 4, and the 4 tile products overlap instead of waiting on
 * each other); per group, the 64 rows' codes are converted into 4 A tiles and the epilogue runs in
 * lanes over weight rows. */
INLINE void amx_narrow(int kind, int g16, int sm, const float *x, int64_t M, int64_t K, const uint8_t *codes,
                       const uint8_t *high, const void *scale, const void *bias, const uint16_t *sup,
                       int64_t N, float *y, int64_t ldy, int nthreads) {
    const int gsz = g16 ? 16 : 32, mt = (int)M;
    const int64_t G = K / gsz, NT = (N + WROWS - 1) / WROWS, TB = gsz / 2 * mt;
    uint32_t *xball = aligned_alloc(64, (size_t)(G * 3 * TB) * 4 + 64);
    float *xs = aligned_alloc(64, (size_t)(G * mt) * 4 + 64);
    if (!xball || !xs) {       /* a few hundred KiB at most: no other path gives these bits */
        fputs("ternlm qamx.c: out of memory\n", stderr);
        abort();
    }
    for (int c = 0; c < mt; c++) split_row(x + c * K, 1, G, gsz, mt, c, xball, xs);
    const Codes k = codes_for(kind, sm);
    #pragma omp parallel num_threads(nthreads)
    {
        amx_config(mt, gsz);
        uint16_t a[4][16 * 32] __attribute__((aligned(64)));
        /* scales of the current and the next block of 16 groups; C tiles stored by group parity: the
         * epilogue of group j runs after group j + 1's tile products are issued (it waits on j's tile
         * stores, not the TMUL on it) */
        float s[2][4][16 * 16] __attribute__((aligned(64))), b[2][4][16 * 16] __attribute__((aligned(64)));
        float cb[2][4][64] __attribute__((aligned(64)));
        #pragma omp for schedule(static)
        for (int64_t task = 0; task < NT; task++) {
            const int64_t n0 = task * WROWS;
            Row rows[4][16];
            int nr[4];
            for (int i = 0; i < 4; i++) {
                const int64_t nb0 = n0 + 16 * i;
                nr[i] = nb0 >= N ? 0 : N - nb0 < 16 ? (int)(N - nb0) : 16;
                for (int r = 0; r < nr[i]; r++) rows[i][r] = amx_row(kind, g16, codes, high, scale, bias, sup, K, nb0 + r);
            }
            __m512 acc[4][4];
            for (int i = 0; i < 4; i++)
                for (int c = 0; c < 4; c++) acc[i][c] = _mm512_setzero_ps();
#define NARROW_ISSUE(j_) do {                                                                        \
                const int64_t jn = (j_);                                                            \
                if (jn % 16 == 0)                                                                   \
                    for (int i = 0; i < 4; i++)                                                     \
                        scales_block(sm, rows[i], nr[i], jn, G - jn < 16 ? (int)(G - jn) : 16,      \
                                     s[(jn / 16) & 1][i], b[(jn / 16) & 1][i], 16);                 \
                for (int i = 0; i < 4; i++) deq_tile(kind, gsz, rows[i], nr[i], jn, &k, a[i]);       \
                const uint32_t *xg = xball + jn * 3 * TB;                                           \
                _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);                         \
                _tile_loadd(5, xg, 4 * mt);                                                         \
                _tile_loadd(6, xg + TB, 4 * mt);                                                    \
                _tile_loadd(7, xg + 2 * TB, 4 * mt);                                                \
                _tile_loadd(4, a[0], 2 * gsz); TDP3(0);                                             \
                _tile_loadd(4, a[1], 2 * gsz); TDP3(1);                                             \
                _tile_loadd(4, a[2], 2 * gsz); TDP3(2);                                             \
                _tile_loadd(4, a[3], 2 * gsz); TDP3(3);                                             \
            } while (0)
            NARROW_ISSUE(0);
            for (int64_t j = 0; j < G; j++) {
                float (*cj)[64] = cb[j & 1];
                _tile_stored(0, cj[0], 4 * mt); _tile_stored(1, cj[1], 4 * mt);
                _tile_stored(2, cj[2], 4 * mt); _tile_stored(3, cj[3], 4 * mt);
                if (j + 1 < G) NARROW_ISSUE(j + 1);
                const int jj = (int)(j % 16), p = (int)((j / 16) & 1);
                for (int i = 0; i < 4; i++) {
                    const __m512 sv = _mm512_load_ps(s[p][i] + jj * 16);
                    for (int c = 0; c < mt; c++) {
                        acc[i][c] = _mm512_fmadd_ps(sv, tile_column(cj[i], mt, c), acc[i][c]);
                        if (has_bias(sm))
                            acc[i][c] = _mm512_fmadd_ps(_mm512_load_ps(b[p][i] + jj * 16), _mm512_set1_ps(xs[j * mt + c]), acc[i][c]);
                    }
                }
            }
#undef NARROW_ISSUE
            for (int i = 0; i < 4; i++)
                for (int c = 0; c < mt; c++)
                    if (nr[i]) _mm512_mask_storeu_ps(y + c * ldy + n0 + 16 * i, (__mmask16)((1u << nr[i]) - 1u), acc[i][c]);
        }
        _tile_release();
    }
    free(xball);
    free(xs);
}

/* Wide products (M >= 5: prefill chunks, reuse tails, batched decode): activations in tiles of 16 rows
 * (the last padded with zeros), weights in tasks of 64 rows (4 C tiles: each B load serves 4 weight
 * tiles), each task's codes converted once into a buffer and reused by every activation tile; the
 * epilogue runs in lanes over activation rows, accumulators in a 4 KiB buffer. */
INLINE int amx_wide(int kind, int g16, int sm, const float *x, int64_t M, int64_t K, const uint8_t *codes,
                     const uint8_t *high, const void *scale, const void *bias, const uint16_t *sup,
                     int64_t N, float *y, int64_t ldy, int nthreads) {
    const int gsz = g16 ? 16 : 32, mt = 16;
    const int64_t G = K / gsz, T = (M + 15) / 16, TB = gsz / 2 * mt, NT = (N + WROWS - 1) / WROWS;
    uint32_t *xb = aligned_alloc(64, (size_t)(T * G * 3 * TB) * 4);
    float *xs = aligned_alloc(64, (size_t)(T * G * mt) * 4);
    /* per thread: a task's codes (4 tiles a group), scales and biases (4 x 16 a group) */
    uint16_t *abuf = aligned_alloc(64, (size_t)nthreads * (size_t)(G * 4 * 16 * gsz) * 2);
    float *sbuf = aligned_alloc(64, (size_t)nthreads * (size_t)(G * 2 * WROWS) * 4);
    if (!xb || !xs || !abuf || !sbuf) { free(xb); free(xs); free(abuf); free(sbuf); return -1; }
    const Codes k = codes_for(kind, sm);
    #pragma omp parallel num_threads(nthreads)
    {
        #pragma omp for schedule(static, 16)          /* a tile's rows in one thread: they share lines */
        for (int64_t m = 0; m < T * 16; m++)
            split_row(x + m * K, m < M, G, gsz, mt, (int)(m % 16), xb + (m / 16) * G * 3 * TB, xs + (m / 16) * G * mt);
        amx_config(mt, gsz);
        const int th = omp_get_thread_num();
        uint16_t *a = abuf + (size_t)th * (size_t)(G * 4 * 16 * gsz);
        float *sc = sbuf + (size_t)th * (size_t)(G * 2 * WROWS), *bi = sc + G * WROWS;
        float acc[4][16][16] __attribute__((aligned(64)));
        float cb[4][256] __attribute__((aligned(64)));
        #pragma omp for schedule(static)
        for (int64_t task = 0; task < NT; task++) {
            const int64_t n0 = task * WROWS;
            for (int i = 0; i < 4; i++) {
                const int64_t nb0 = n0 + 16 * i;
                const int nr = nb0 >= N ? 0 : N - nb0 < 16 ? (int)(N - nb0) : 16;
                Row rows[16];
                for (int r = 0; r < nr; r++) rows[r] = amx_row(kind, g16, codes, high, scale, bias, sup, K, nb0 + r);
                for (int64_t j = 0; j < G; j++) {
                    if (j % 16 == 0)
                        scales_block(sm, rows, nr, j, G - j < 16 ? (int)(G - j) : 16, sc + j * WROWS + 16 * i,
                                     bi + j * WROWS + 16 * i, WROWS);
                    deq_tile(kind, gsz, rows, nr, j, &k, a + (j * 4 + i) * 16 * gsz);
                }
            }
            for (int64_t t = 0; t < T; t++) {
                memset(acc, 0, sizeof acc);
                const uint32_t *xt = xb + t * G * 3 * TB;
                const float *xst = xs + t * G * mt;
                for (int64_t j = 0; j < G; j++) {
                    const uint32_t *xg = xt + j * 3 * TB;
                    const uint16_t *aj = a + j * 4 * 16 * gsz;
                    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
                    _tile_loadd(5, xg, 64);
                    _tile_loadd(6, xg + TB, 64);
                    _tile_loadd(7, xg + 2 * TB, 64);
                    _tile_loadd(4, aj, 2 * gsz); TDP3(0);
                    _tile_loadd(4, aj + 16 * gsz, 2 * gsz); TDP3(1);
                    _tile_loadd(4, aj + 32 * gsz, 2 * gsz); TDP3(2);
                    _tile_loadd(4, aj + 48 * gsz, 2 * gsz); TDP3(3);
                    _tile_stored(0, cb[0], 64); _tile_stored(1, cb[1], 64);
                    _tile_stored(2, cb[2], 64); _tile_stored(3, cb[3], 64);
                    const __m512 xsv = _mm512_load_ps(xst + j * mt);
                    for (int i = 0; i < 4; i++)
                        for (int r = 0; r < 16; r++) {
                            __m512 v = _mm512_fmadd_ps(_mm512_set1_ps(sc[j * WROWS + 16 * i + r]), _mm512_load_ps(cb[i] + 16 * r),
                                                       _mm512_load_ps(acc[i][r]));
                            if (has_bias(sm)) v = _mm512_fmadd_ps(_mm512_set1_ps(bi[j * WROWS + 16 * i + r]), xsv, v);
                            _mm512_store_ps(acc[i][r], v);
                        }
                }
                const int rows_t = M - t * 16 < 16 ? (int)(M - t * 16) : 16;
                for (int i = 0; i < 4 && n0 + 16 * i < N; i++) {
                    const int64_t nb0 = n0 + 16 * i;
                    const __mmask16 mk = (__mmask16)(N - nb0 >= 16 ? 0xFFFFu : (1u << (N - nb0)) - 1u);
                    __m512 v[16];
                    for (int r = 0; r < 16; r++) v[r] = _mm512_load_ps(acc[i][r]);
                    transpose16(v);            /* rows over weight rows -> rows over activation rows */
                    for (int c = 0; c < rows_t; c++) _mm512_mask_storeu_ps(y + (t * 16 + c) * ldy + nb0, mk, v[c]);
                }
            }
        }
        _tile_release();
    }
    free(xb); free(xs); free(abuf); free(sbuf);
    return 0;
}

/* The entry: narrow or wide by M; either gives the same bits for a row, so a wide product whose buffers
 * cannot be allocated runs as narrow ones of 4 rows. */
INLINE void amx_mm(int kind, int g16, int sm, const float *x, int64_t M, int64_t K, const uint8_t *codes,
                   const uint8_t *high, const void *scale, const void *bias, const uint16_t *sup, int64_t N,
                   float *y, int64_t ldy, int nthreads) {
    if (M <= 0) return;
    if (M > 4 && amx_wide(kind, g16, sm, x, M, K, codes, high, scale, bias, sup, N, y, ldy, nthreads) == 0) return;
    for (int64_t m = 0; m < M; m += 4)
        amx_narrow(kind, g16, sm, x + m * K, M - m < 4 ? M - m : 4, K, codes, high, scale, bias, sup, N, y + m * ldy, ldy, nthreads);
}

/* The entries: tq_<layout>_<scale mode>_mm, every ROW entry of layouts.h (the end of the file). An SM_F16S
 * matrix whose constant is the layout's own offset takes SM_F16I (for the other modes the test is constant
 * false); SM_K6 (Q6_K) has groups of 16. Only after tq_amx_init granted the tiles. */
#define ROW_MM(NAME, KIND, SM) void NAME(MM_ARGS) { \
    if (!amx_on) abort(); \
    const float k = (KIND) == Q8 ? 128.0f : (KIND) == Q5 ? 16.0f : 8.0f; \
    amx_mm(KIND, (int)(SM) == SM_K6, (int)(SM) == SM_F16S && ((const float *)bias)[0] == -k ? SM_F16I : (SM), x, M, K, codes, \
           high, scale, bias, sup, N, y, ldy, nthreads); }
#else
/* No AMX tiles in this build: nothing to ask the OS for, and nothing calls the row entries (kernels/build.py
 * gives every product the lanes layouts). */
int tq_amx_init(void) { return 0; }
#define ROW_MM(NAME, KIND, SM) void NAME(MM_ARGS) { \
    (void)x; (void)M; (void)K; (void)codes; (void)high; (void)scale; (void)bias; (void)sup; (void)N; (void)y; \
    (void)ldy; (void)nthreads; abort(); }
#endif

#define TQ_ENTRY(L, M, bits) ROW_MM(tq_##L##_##M##_mm, Q##bits, TQ_MODE_##M)
TQ_LAYOUTS(TQ_ENTRIES_ROW)
#undef TQ_ENTRY
