/* Causal attention for one sequence, one query row at a time, online softmax over 256-key blocks.
 *
 *   q:   (H, T, D) fp32, already scaled by 1/sqrt(D); rows are positions [start, start + T)
 *   k,v: (KV, cap, D) fp32 (one layer of a slot's cache); head h reads kv head h / (H / KV)
 *   out: row (t, h) written at out + t * ldo + h * D  (the (T, H * D) layout the o projection reads)
 *
 * [BATCH-INVARIANT] A query row at position p reads exactly keys [0, p], in blocks [0, 256),
 * [256, 512), ... and the partial block up to p, in that order; nothing it computes depends on T, on
 * start, on other rows or on the thread count. So a position gets the same bits in a 512-token prefill
 * chunk, in a 37-token tail after a reuse, or alone in a decode step. Keys past p are never read: the
 * masked triangle costs nothing, and no (queries x keys) buffer exists.
 *
 * Written with GCC vector extensions (16 floats): the compiler maps them onto AVX-512, AVX2 or SSE for
 * the host (-march=native). exp is our own (range reduction + degree-6 polynomial): libm's may change
 * with the system, ours changes only with this file, whose digest is in the KV cache's fingerprint.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec.h"

#define BLOCK 256
#define MAXD 256

static void row(const float *q, const float *k, const float *v, int64_t n, int64_t D, float *out) {
    const int64_t nv = D / 16;
    v16 qv[MAXD / 16], acc[MAXD / 16];
    for (int64_t c = 0; c < nv; c++) { qv[c] = load16(q + 16 * c); acc[c] = splat(0.0f); }
    float m = -INFINITY, l = 0.0f;
    float s[BLOCK] __attribute__((aligned(64)));
    for (int64_t b0 = 0; b0 < n; b0 += BLOCK) {
        int64_t nb = n - b0 < BLOCK ? n - b0 : BLOCK;
        for (int64_t j = 0; j < nb; j++) {                /* scores of this block's keys */
            const float *kj = k + (b0 + j) * D;
            v16 d = qv[0] * load16(kj);
            for (int64_t c = 1; c < nv; c++) d += qv[c] * load16(kj + 16 * c);
            s[j] = hsum(d);
        }
        int64_t nb16 = (nb + 15) & ~(int64_t)15;
        for (int64_t j = nb; j < nb16; j++) s[j] = -INFINITY;   /* lanes past the row's last key */
        v16 mv = load16(s);
        for (int64_t j = 16; j < nb16; j += 16) { v16 t = load16(s + j); mv = select16(mv > t, mv, t); }
        float mb = hmax(mv), mn = mb > m ? mb : m;
        float alpha = exp16(splat(m - mn))[0];            /* rescales what earlier blocks summed */
        v16 lsum = splat(0.0f);
        for (int64_t j = 0; j < nb16; j += 16) {
            v16 p = exp16(load16(s + j) - splat(mn));
            memcpy(s + j, &p, sizeof p);
            lsum += p;
        }
        l = l * alpha + hsum(lsum);
        for (int64_t c = 0; c < nv; c++) acc[c] *= splat(alpha);
        for (int64_t j = 0; j < nb; j++) {                /* p @ V, keys in order */
            const float *vj = v + (b0 + j) * D;
            v16 pj = splat(s[j]);
            for (int64_t c = 0; c < nv; c++) acc[c] += pj * load16(vj + 16 * c);
        }
        m = mn;
    }
    v16 inv = splat(1.0f / l);
    for (int64_t c = 0; c < nv; c++) { v16 o = acc[c] * inv; memcpy(out + 16 * c, &o, sizeof o); }
}

const char *tq_attention_isa(void) {  /* for a quick look with ctypes */
#if defined(__AVX512F__)
    return "avx512";
#elif defined(__AVX2__)
    return "avx2";
#else
    return "sse";
#endif
}

/* Returns 0, or -1 when D is not a multiple of 16 up to MAXD (the caller checks first). */
int tq_attention(const float *q, int64_t T, int64_t H, int64_t KV, int64_t D, const float *k, const float *v,
                 int64_t cap, int64_t start, float *out, int64_t ldo, int nthreads) {
    if (D % 16 || D > MAXD || H % KV) return -1;
    const int64_t G = H / KV;
    /* the G query heads of one kv head and position run back to back: its keys stay in cache */
    #pragma omp parallel for collapse(2) schedule(static) num_threads(nthreads)
    for (int64_t kvh = 0; kvh < KV; kvh++)
        for (int64_t t = 0; t < T; t++)
            for (int64_t h = kvh * G; h < (kvh + 1) * G; h++)
                row(q + (h * T + t) * D, k + kvh * cap * D, v + kvh * cap * D, start + t + 1, D,
                    out + t * ldo + h * D);
    return 0;
}

/* Many sequences' rows in one call (continuous batching): one parallel region per layer instead of one
 * per sequence. segs: nseg rows of 6 int64 (first row in q/out, rows, start position, cache capacity,
 * address of the slot's K cache and of its V cache, each (layers, KV, cap, D) fp32 contiguous).
 * q: (H, M, D) scaled; out: (M, H * D). Each row runs `row` exactly as tq_attention would run it, so a
 * sequence's bits are the same alone or in company. Returns -1 on a shape it does not take. */
int tq_attention_segments(const int64_t *segs, int64_t nseg, int64_t layer, const float *q, int64_t M,
                          int64_t H, int64_t KV, int64_t D, float *out, int nthreads) {
    if (D % 16 || D > MAXD || H % KV || M <= 0) return -1;
    const int64_t G = H / KV;
    int64_t *seg_of = malloc(M * sizeof *seg_of);        /* row -> segment */
    if (!seg_of) return -1;
    for (int64_t s = 0; s < nseg; s++)
        for (int64_t r = segs[6 * s]; r < segs[6 * s] + segs[6 * s + 1]; r++) {
            if (r < 0 || r >= M) { free(seg_of); return -1; }
            seg_of[r] = s;
        }
    #pragma omp parallel for collapse(2) schedule(static) num_threads(nthreads)
    for (int64_t r = 0; r < M; r++)
        for (int64_t kvh = 0; kvh < KV; kvh++) {
            const int64_t *sg = segs + 6 * seg_of[r];
            const int64_t cap = sg[3], t = r - sg[0];
            const float *k = (const float *)(intptr_t)sg[4] + ((layer * KV + kvh) * cap) * D;
            const float *v = (const float *)(intptr_t)sg[5] + ((layer * KV + kvh) * cap) * D;
            for (int64_t h = kvh * G; h < (kvh + 1) * G; h++)
                row(q + (h * M + r) * D, k, v, sg[2] + t + 1, D, out + r * H * D + h * D);
        }
    free(seg_of);
    return 0;
}
