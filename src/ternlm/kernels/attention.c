/* Causal attention: each query row over its own keys, online softmax over 256-key blocks; up to 4
 * query rows reading one kv head (several positions, or the query heads of a group) share each K/V load
 * (rows() below) without changing any row's arithmetic.
 *
 *   q:   (H, T, D) fp32, already scaled by 1/sqrt(D); rows are positions [start, start + T)
 *   k,v: (KV, cap, D) fp32, or fp16 where `half` is set (one layer of a slot's cache); head h reads kv
 *        head h / (H / KV). fp16 values are widened exactly, so a row's arithmetic is the same in both.
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

#define RMAX 4      /* query rows of one head that share each key and value load */

/* R query rows reading one kv head (R <= RMAX), row r reading keys [0, n[r]): every row runs exactly the
 * single-row algorithm (its own online softmax, blocks in order, the same operations on the same
 * values); the rows only share the loads of K and V, which at a long prompt come from L3, not L2.
 * So a row's bits are the same whatever R and whichever rows it shares with [BATCH-INVARIANT]. */
static inline __attribute__((always_inline)) void rows(int R, int half, const float *const *q, const void *k,
                                                       const void *v, const int64_t *n, int64_t D,
                                                       float *const *out) {
    const int64_t nv = D / 16;
    v16 qv[RMAX][MAXD / 16], acc[RMAX][MAXD / 16];
    float m[RMAX], l[RMAX];
    float s[RMAX][BLOCK] __attribute__((aligned(64)));
    int64_t nmax = 0;
    for (int r = 0; r < R; r++) {
        for (int64_t c = 0; c < nv; c++) { qv[r][c] = load16(q[r] + 16 * c); acc[r][c] = splat(0.0f); }
        m[r] = -INFINITY;
        l[r] = 0.0f;
        nmax = n[r] > nmax ? n[r] : nmax;
    }
    for (int64_t b0 = 0; b0 < nmax; b0 += BLOCK) {
        int64_t nb[RMAX], nbmax = 0;
        for (int r = 0; r < R; r++) {
            nb[r] = n[r] - b0 <= 0 ? 0 : n[r] - b0 < BLOCK ? n[r] - b0 : BLOCK;
            nbmax = nb[r] > nbmax ? nb[r] : nbmax;
        }
        for (int64_t j0 = 0; j0 < nbmax; j0 += 16) {      /* scores of this block's keys, 16 at a time */
            const int64_t jn = nbmax - j0 < 16 ? nbmax - j0 : 16;
            v16 dd[RMAX][16];                             /* per key, the 16 lanes its score sums */
            for (int64_t jj = 0; jj < jn; jj++) {
                const int64_t kj = (b0 + j0 + jj) * D;
                v16 d[RMAX];
                v16 kc = load_kv(k, kj, half);
                for (int r = 0; r < R; r++) d[r] = qv[r][0] * kc;
                for (int64_t c = 1; c < nv; c++) {
                    kc = load_kv(k, kj + 16 * c, half);
                    for (int r = 0; r < R; r++) d[r] += qv[r][c] * kc;
                }
                for (int r = 0; r < R; r++) dd[r][jj] = d[r];
            }
            for (int r = 0; r < R; r++) {
                for (int64_t jj = jn; jj < 16; jj++) dd[r][jj] = splat(0.0f);   /* no key: never read */
                v16 sc = hsum16x(dd[r]);                  /* = hsum(dd[r][jj]) in lane jj, bit for bit */
                memcpy(s[r] + j0, &sc, sizeof sc);
            }
        }
        for (int r = 0; r < R; r++) {
            if (nb[r] == 0) continue;                     /* this row ended before the block */
            float *sr = s[r];
            int64_t nb16 = (nb[r] + 15) & ~(int64_t)15;
            for (int64_t j = nb[r]; j < nb16; j++) sr[j] = -INFINITY;   /* lanes past the row's last key */
            v16 mv = load16(sr);
            for (int64_t j = 16; j < nb16; j += 16) { v16 t = load16(sr + j); mv = select16(mv > t, mv, t); }
            float mb = hmax(mv), mn = mb > m[r] ? mb : m[r];
            float alpha = exp16(splat(m[r] - mn))[0];    /* rescales what earlier blocks summed */
            v16 lsum = splat(0.0f);
            for (int64_t j = 0; j < nb16; j += 16) {
                v16 p = exp16(load16(sr + j) - splat(mn));
                memcpy(sr + j, &p, sizeof p);
                lsum += p;
            }
            l[r] = l[r] * alpha + hsum(lsum);
            for (int64_t c = 0; c < nv; c++) acc[r][c] *= splat(alpha);
            m[r] = mn;
        }
        for (int64_t c = 0; c < nv; c++) {                /* p @ V, keys in order, 16 dims at a time */
            v16 a[RMAX];   /* in registers across the keys (were stored and reloaded per key: +27%); each
                            * (row, 16 dims) still adds the keys' terms in key order, so the same bits */
            for (int r = 0; r < R; r++) a[r] = acc[r][c];
            for (int64_t j = 0; j < nbmax; j++) {
                v16 vc = load_kv(v, (b0 + j) * D + 16 * c, half);
                for (int r = 0; r < R; r++)
                    if (j < nb[r]) a[r] += splat(s[r][j]) * vc;
            }
            for (int r = 0; r < R; r++) acc[r][c] = a[r];
        }
    }
    for (int r = 0; r < R; r++) {
        v16 inv = splat(1.0f / l[r]);
        for (int64_t c = 0; c < nv; c++) { v16 o = acc[r][c] * inv; memcpy(out[r] + 16 * c, &o, sizeof o); }
    }
}

/* rows() with R and the KV dtype compile-time constants (registers for the accumulators). */
static void rows_any(int R, int half, const float *const *q, const void *k, const void *v, const int64_t *n,
                     int64_t D, float *const *out) {
    switch (R * 2 + (half != 0)) {
    case 2: rows(1, 0, q, k, v, n, D, out); break;
    case 3: rows(1, 1, q, k, v, n, D, out); break;
    case 4: rows(2, 0, q, k, v, n, D, out); break;
    case 5: rows(2, 1, q, k, v, n, D, out); break;
    case 6: rows(3, 0, q, k, v, n, D, out); break;
    case 7: rows(3, 1, q, k, v, n, D, out); break;
    case 8: rows(4, 0, q, k, v, n, D, out); break;
    default: rows(4, 1, q, k, v, n, D, out); break;
    }
}

/* Query rows [t0, t0 + R) of head h (positions start + t), one call of rows(). */
static void head_rows(const float *q, int64_t T, int64_t h, int64_t t0, int R, const float *k, const float *v,
                      int64_t start, int64_t D, float *out, int64_t ldo) {
    const float *qp[RMAX];
    float *op[RMAX];
    int64_t n[RMAX];
    for (int r = 0; r < R; r++) {
        qp[r] = q + (h * T + t0 + r) * D;
        op[r] = out + (t0 + r) * ldo + h * D;
        n[r] = start + t0 + r + 1;
    }
    rows_any(R, 0, qp, k, v, n, D, op);
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
    const int64_t G = H / KV, ngroups = (T + RMAX - 1) / RMAX;
    /* the G query heads of one kv head and RMAX positions run back to back: its keys stay in cache */
    #pragma omp parallel for collapse(2) schedule(static) num_threads(nthreads)
    for (int64_t kvh = 0; kvh < KV; kvh++)
        for (int64_t gi = 0; gi < ngroups; gi++) {
            int64_t t0 = gi * RMAX;
            int R = (int)(T - t0 < RMAX ? T - t0 : RMAX);
            for (int64_t h = kvh * G; h < (kvh + 1) * G; h++)
                head_rows(q, T, h, t0, R, k + kvh * cap * D, v + kvh * cap * D, start, D, out, ldo);
        }
    return 0;
}

/* Many sequences' rows in one call (continuous batching): one parallel region per layer instead of one
 * per sequence. segs: nseg rows of 6 int64 (first row in q/out, rows, start position, cache capacity,
 * address of the slot's K cache and of its V cache, each (layers, KV, cap, D) contiguous, fp16 where
 * kv_half is set, else fp32).
 * q: (H, M, D) scaled; out: (M, H * D). Each row runs `rows` exactly as tq_attention would run it, so a
 * sequence's bits are the same alone or in company. Returns -1 on a shape it does not take. */
int tq_attention_segments(const int64_t *segs, int64_t nseg, int64_t layer, const float *q, int64_t M,
                          int64_t H, int64_t KV, int64_t D, float *out, int nthreads, int kv_half) {
    if (D % 16 || D > MAXD || H % KV || M <= 0) return -1;
    const int64_t G = H / KV;
    /* tasks: up to RMAX consecutive rows of one segment (segment, first row) */
    int64_t ntask = 0, *task = malloc(2 * (M + nseg) * sizeof *task);
    if (!task) return -1;
    for (int64_t sg = 0; sg < nseg; sg++) {
        int64_t r0 = segs[6 * sg], len = segs[6 * sg + 1];
        if (r0 < 0 || len < 0 || r0 + len > M) { free(task); return -1; }
        for (int64_t t = 0; t < len; t += RMAX) { task[2 * ntask] = sg; task[2 * ntask + 1] = t; ntask++; }
    }
    /* kv head outermost: a thread's consecutive tasks read the same kv head's K/V, which then stays in
     * its L2 (a prefill chunk's tasks all read the whole prefix: at 2,000 keys, 0.5 MB a kv head in
     * fp16, the same again per row group when the heads alternate): +5% on a 37-row tail after 2,084
     * keys. The order of tasks never changes a row's arithmetic. */
    #pragma omp parallel for collapse(2) schedule(static) num_threads(nthreads)
    for (int64_t kvh = 0; kvh < KV; kvh++)
        for (int64_t ti = 0; ti < ntask; ti++) {
            const int64_t *sg = segs + 6 * task[2 * ti];
            const int64_t r0 = sg[0], len = sg[1], cap = sg[3], t0 = task[2 * ti + 1];
            const int R = (int)(len - t0 < RMAX ? len - t0 : RMAX);
            const int64_t at = ((layer * KV + kvh) * cap) * D * (kv_half ? 2 : 4);   /* bytes */
            const void *k = (const char *)(intptr_t)sg[4] + at, *v = (const char *)(intptr_t)sg[5] + at;
            /* The task's (head, row) pairs that read this kv head, up to RMAX per rows() call: they all
             * share each K/V load. A decode row (R = 1) thus reads its K/V once for the G query heads
             * of the group instead of G times; every pair still runs the single-row algorithm. */
            const float *qp[RMAX];
            float *op[RMAX];
            int64_t n[RMAX];
            int cnt = 0;
            for (int64_t h = kvh * G; h < (kvh + 1) * G; h++)
                for (int r = 0; r < R; r++) {
                    qp[cnt] = q + (h * M + r0 + t0 + r) * D;
                    op[cnt] = out + (r0 + t0 + r) * H * D + h * D;
                    n[cnt] = sg[2] + t0 + r + 1;
                    if (++cnt == RMAX) { rows_any(cnt, kv_half, qp, k, v, n, D, op); cnt = 0; }
                }
            if (cnt) rows_any(cnt, kv_half, qp, k, v, n, D, op);
        }
    free(task);
    return 0;
}
