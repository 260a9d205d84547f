/* Causal attention: each query row over its own keys, online softmax over 256-key blocks. The (query
 * head, position) pairs that read one kv head (the query heads of a group, at up to RMAX positions) run
 * together and share each K/V load (pairs() below) without changing any pair's arithmetic.
 *
 *   q:   (H, T, D) fp32, already scaled by 1/sqrt(D); rows are positions [start, start + T)
 *   k,v: (KV, cap, rows of kv_row_bytes(mode, D)): fp32, fp16 or q8_0 rows (vec.h KV_*; one layer of a
 *        slot's cache); head h reads kv head h / (H / KV). fp16 and q8_0 values are widened to fp32 exactly
 *        as they are loaded, so a row's arithmetic is the fp32 one on the values the cache holds.
 *   out: row (t, h) written at out + t * ldo + h * D  (the (T, H * D) layout the o projection reads)
 *
 * [BATCH-INVARIANT] A query row at position p reads exactly keys [0, p], in blocks [0, 256),
 * [256, 512), ... and the partial block up to p, in that order; nothing it computes depends on T, on
 * start, on other rows or on the thread count. So a position gets the same bits in a 512-token prefill
 * chunk, in a 37-token tail after a reuse, or alone in a decode step. Keys past p are never read: the
 * masked triangle costs nothing, and no (queries x keys) buffer exists.
 *
 * [SWA] A windowed layer (window W > 0) gives a row at position p the keys (p - W, p]: lo = max(0, p + 1 - W).
 * Its blocks stay on the same absolute grid: it starts at the block holding lo, its keys there below lo
 * score -inf (exp gives exact zeros: the softmax sums and p @ V's +0 accumulators are untouched, since
 * they lie before its first key), and earlier blocks are skipped. So its bits still depend only on p
 * and W, and a decode step reads at most W + 255 keys whatever the context.
 *
 * Written with GCC vector extensions of the host's own width (vec.h `vf`: 16 floats on AVX-512, 8 on
 * AVX2, 4 on baseline x86-64; -march=native), so a row's bits depend on the build, never on the call.
 * exp is our own (range reduction + degree-6 polynomial): libm's may change with the system, ours
 * changes only with this file, whose digest is in the KV cache's fingerprint.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec.h"

#define BLOCK 256
#define MAXD 256

#define RMAX 8      /* positions of one sequence per task (8 rather than 4: -5% on a prefill) */
#define PMAX 32     /* (query head, position) pairs of one kv head per pass: they share each K/V tile */
/* Pairs whose p@V accumulators sit in registers together and share each V load (widened once for all
 * of them). 16 of the 32 zmm on AVX-512: a prefill task's 24 pairs (smollm2) take two passes instead of
 * three. Measured on Sapphire Rapids against 8 (attention_sweep.py, two runs each): smollm2 4,000-token
 * prefill x0.94 / x0.97, 1,024 x1.00 / x0.96, the 37-row reuse tail x1.01 / x0.93; qwen x0.96, x0.98,
 * x0.98; 12 was in between, 24 lost 20% (spills). AVX2's and SSE's 16 registers: 6 pairs of 2 chunks
 * each (CPV below). Only timing depends on it. */
#ifndef PVG
#if VN == 16
#define PVG 16
#else
#define PVG 6
#endif
#endif
/* VN-dim chunks of V each pass: AVX2 (and SSE, VN 4) holds 6 pairs x 2 chunks (12 accumulators, 2 V,
 * 1 broadcast) instead of 8 x 1: with 8 accumulators taking one FMA a key each, every key waited for
 * the FMA latency (perf: ~0.9 FMA a cycle in the loop, of 2); 12 independent chains keep both FMA
 * pipes busy. Measured on the AVX2 Zen 3 (attention_sweep.py against 8 x 1, same bits): smollm2 4,000-token
 * prefill x0.92, 1,024 x0.87, the 37-row reuse tail x0.91, decode after 4,000 x0.80; qwen x0.83, x0.94,
 * x0.93, x0.95. AVX-512 keeps 16 x 1 (not re-measured: no such host). Only timing depends on it. */
#ifndef CPV
#define CPV (VN == 16 ? 1 : 2)
#endif
#define NC (MAXD / VN)  /* most VN-lane chunks of a head */

void tq_kv_rotate_q(const float *q, int64_t n, int64_t D, float *out);   /* [KV-ROTATE], below */

/* The scores of one pair for one tile of VN keys: lane jj = the dot product of q and key jj, as hsumn of
 * VN lane sums (lane i sums dims i, VN + i, ... in order). Each lane sum starts from +0 and every
 * product is a written fused multiply-add onto it (fman): left to the compiler, `d = q0 * k0; d += q1 *
 * k1` was fused differently in two shapes of this loop, and a row's bits must not depend on the code
 * shape that computed it. kt: the tile's keys, fp32, row jj at kt + jj * D; keys jn..VN-1 score 0
 * (never read). The VN lane sums stay in registers for hsumnx. nc: D / VN.
 * A full tile runs its VN chains side by side, chunk outer (each chain's next FMA VN instructions
 * later): written key by key, GCC kept each key's nc dependent FMAs together and the FMA pipes waited
 * on their latency (perf on the reuse tail: pairs_any 25% of the samples for as many FMAs as block_pv's
 * 13%). Each chain's order is unchanged: the same bits. Measured on the AVX2 Zen 3 (attention_sweep.py):
 * the 37-row tail x0.96 (smollm2 and qwen), prefills x0.90-0.99. */
static inline __attribute__((always_inline)) vf tile_scores(int64_t nc, const float *q, const float *kt,
                                                           int64_t jn, int64_t D) {
    vf qv[NC], dd[VN];
    if (jn == VN) {
#pragma GCC unroll 16
        for (int jj = 0; jj < VN; jj++) dd[jj] = splatn(0.0f);
        for (int64_t c = 0; c < nc; c++) {
            const vf qc = loadn(q + VN * c);
#pragma GCC unroll 16
            for (int jj = 0; jj < VN; jj++) dd[jj] = fman(qc, loadn(kt + jj * D + VN * c), dd[jj]);
        }
        return hsumnx(dd);
    }
    for (int64_t c = 0; c < nc; c++) qv[c] = loadn(q + VN * c);
    for (int jj = 0; jj < VN; jj++) {                 /* a partial tile (the block's last keys) */
        vf d = splatn(0.0f);
        if (jj < jn)
            for (int64_t c = 0; c < nc; c++) d = fman(qv[c], loadn(kt + jj * D + VN * c), d);
        dd[jj] = d;
    }
    return hsumnx(dd);                                /* = hsumn(dd[jj]) in lane jj, bit for bit */
}

/* The scores of R pairs (R <= 4) for one tile, keys outer: each K load (fp16 / q8_0 widened as it is
 * loaded) serves every pair, which for a few pairs (a decode row's head group) costs less
 * than widening the tile into a buffer. Per pair exactly tile_scores' arithmetic: the same bits. Writes
 * s[r][j0 .. j0 + VN). */
static inline __attribute__((always_inline)) void tile_scores_shared(int R, int64_t nc, int mode,
                                                                    const float *const *q, const void *kb,
                                                                    int64_t jn, int64_t D, float (*s)[BLOCK],
                                                                    int64_t j0) {
    const int64_t rb = kv_row_bytes(mode, D);
    vf dd[4][VN];
    for (int64_t jj = 0; jj < jn; jj++) {
        vf d[4];
        for (int r = 0; r < R; r++) d[r] = splatn(0.0f);
        for (int64_t c = 0; c < nc; c++) {
            vf kc = loadn_kv((const char *)kb + jj * rb, VN * c, mode, D);
            for (int r = 0; r < R; r++) d[r] = fman(loadn(q[r] + VN * c), kc, d[r]);
        }
        for (int r = 0; r < R; r++) dd[r][jj] = d[r];
    }
    for (int r = 0; r < R; r++)
        for (int64_t jj = jn; jj < VN; jj++) dd[r][jj] = splatn(0.0f);   /* no key: never read */
    for (int r = 0; r < R; r++) storen(s[r] + j0, hsumnx(dd[r]));
}

/* p @ V for G pairs over one block's keys, W chunks of VN dims (from chunk c) at a time: W chunks side
 * by side are the same FMAs as one at a time, in more independent chains. Pair g adds key j only for
 * j < nb[g] (keys below nmin: every pair; nmin..nmax: some). Each accumulator stays in a register. */
static inline __attribute__((always_inline)) void pv_chunks(int G, int W, int mode, int64_t c, const void *v,
                                                           int64_t b0, int64_t D, const int64_t *nb,
                                                           int64_t nmin, int64_t nmax, float (*s)[BLOCK],
                                                           vf (*acc)[NC]) {
    const int64_t rb = kv_row_bytes(mode, D);
    vf a[PVG][CPV];
    for (int g = 0; g < G; g++)
        for (int h = 0; h < W; h++) a[g][h] = acc[g][c + h];
    for (int64_t j = 0; j < nmin; j++) {                /* every pair has these keys: no test */
        vf vc[CPV];
        for (int h = 0; h < W; h++) vc[h] = loadn_kv((const char *)v + (b0 + j) * rb, VN * (c + h), mode, D);
        for (int g = 0; g < G; g++) {
            const vf sg = splatn(s[g][j]);
            for (int h = 0; h < W; h++) a[g][h] = fman(sg, vc[h], a[g][h]);
        }
    }
    for (int64_t j = nmin; j < nmax; j++) {
        vf vc[CPV];
        for (int h = 0; h < W; h++) vc[h] = loadn_kv((const char *)v + (b0 + j) * rb, VN * (c + h), mode, D);
        for (int g = 0; g < G; g++)
            if (j < nb[g]) {
                const vf sg = splatn(s[g][j]);
                for (int h = 0; h < W; h++) a[g][h] = fman(sg, vc[h], a[g][h]);
            }
    }
    for (int g = 0; g < G; g++)
        for (int h = 0; h < W; h++) acc[g][c + h] = a[g][h];
}

/* p @ V for G pairs (G <= PVG) over one block's keys, in key order, VN dims at a time; pair g adds key j
 * only for j < nb[g]. CPV chunks at a time, then one at a time (what is left). */
static inline __attribute__((always_inline)) void block_pv(int G, int mode, int64_t nc, const void *v, int64_t b0,
                                                          int64_t D, const int64_t *nb, float (*s)[BLOCK],
                                                          vf (*acc)[NC]) {
    int64_t nmin = BLOCK, nmax = 0;
    for (int g = 0; g < G; g++) {
        nmin = nb[g] < nmin ? nb[g] : nmin;
        nmax = nb[g] > nmax ? nb[g] : nmax;
    }
    int64_t c = 0;
    for (; CPV > 1 && c + CPV <= nc; c += CPV) pv_chunks(G, CPV, mode, c, v, b0, D, nb, nmin, nmax, s, acc);
    for (; c < nc; c++) pv_chunks(G, 1, mode, c, v, b0, D, nb, nmin, nmax, s, acc);
}

static void block_pv_any(int G, int mode, int64_t nc, const void *v, int64_t b0, int64_t D, const int64_t *nb,
                         float (*s)[BLOCK], vf (*acc)[NC]) {
    switch (G * 3 + mode) {
/* G <= PVG always; `g <= PVG` keeps block_pv (whose arrays hold PVG) from being compiled for a larger g */
#define PV_CASE(g) case 3 * g: if (g <= PVG) block_pv(g, KV_F32, nc, v, b0, D, nb, s, acc); break; \
                   case 3 * g + 1: if (g <= PVG) block_pv(g, KV_F16, nc, v, b0, D, nb, s, acc); break; \
                   case 3 * g + 2: if (g <= PVG) block_pv(g, KV_Q8, nc, v, b0, D, nb, s, acc); break;
    PV_CASE(1) PV_CASE(2) PV_CASE(3) PV_CASE(4) PV_CASE(5) PV_CASE(6) PV_CASE(7) PV_CASE(8)
    PV_CASE(9) PV_CASE(10) PV_CASE(11) PV_CASE(12) PV_CASE(13) PV_CASE(14) PV_CASE(15) PV_CASE(16)
#undef PV_CASE
    }
}

/* P (query head, position) pairs reading one kv head (P <= PMAX), pair p reading keys [lo[p], n[p]): every
 * pair runs exactly the single-row algorithm (its own online softmax, blocks in order, the same
 * operations on the same values); the pairs only share the loads of K and V (an fp16 tile of K is
 * widened once for all of them). So a row's bits are the same whatever P and whichever pairs it shares
 * with [BATCH-INVARIANT]. NC_: D / VN when it is a compile-time constant (0: from D). */
static inline __attribute__((always_inline)) void pairs(int NC_, int P, int mode, const float *const *q,
                                                       const void *k, const void *v, const int64_t *lo,
                                                       const int64_t *n, int64_t D, float *const *out) {
    const int64_t nc = NC_ ? NC_ : D / VN;
    vf acc[PMAX][NC];
    float m[PMAX], l[PMAX];
    float s[PMAX][BLOCK] __attribute__((aligned(64)));
    float kt[VN * MAXD] __attribute__((aligned(64)));  /* a tile of an fp16 / q8_0 K, widened (exactly) */
    const int64_t rb = kv_row_bytes(mode, D);
    int64_t nmax = 0, lmin = INT64_MAX;
    for (int p = 0; p < P; p++) {
        for (int64_t c = 0; c < nc; c++) acc[p][c] = splatn(0.0f);
        m[p] = -INFINITY;
        l[p] = 0.0f;
        nmax = n[p] > nmax ? n[p] : nmax;
        lmin = lo[p] < lmin ? lo[p] : lmin;
    }
    for (int64_t b0 = lmin / BLOCK * BLOCK; b0 < nmax; b0 += BLOCK) {   /* [SWA] the absolute block grid */
        int64_t nb[PMAX], nbmax = 0;
        for (int p = 0; p < P; p++) {
            nb[p] = n[p] - b0 <= 0 || lo[p] >= b0 + BLOCK ? 0 : n[p] - b0 < BLOCK ? n[p] - b0 : BLOCK;
            nbmax = nb[p] > nbmax ? nb[p] : nbmax;
        }
        for (int64_t j0 = 0; j0 < nbmax; j0 += VN) {      /* scores of this block's keys, VN at a time */
            const int64_t jn = nbmax - j0 < VN ? nbmax - j0 : VN;
            const void *kb = (const char *)k + (b0 + j0) * rb;
            if (P <= 4) {                                 /* few pairs: share each K load */
                switch (P * 3 + mode) {
#define SC_CASE(r) case 3 * r: tile_scores_shared(r, nc, KV_F32, q, kb, jn, D, s, j0); break; \
                   case 3 * r + 1: tile_scores_shared(r, nc, KV_F16, q, kb, jn, D, s, j0); break; \
                   case 3 * r + 2: tile_scores_shared(r, nc, KV_Q8, q, kb, jn, D, s, j0); break;
                SC_CASE(1) SC_CASE(2) SC_CASE(3) SC_CASE(4)
#undef SC_CASE
                }
                continue;
            }
            /* more pairs (prefill rows, big head groups): an fp16 / q8_0 tile is widened once (exactly)
             * into kt for all of them (measured: widening per pair costs +38% on a prefill) */
            if (mode != KV_F32) {
                for (int64_t jj = 0; jj < jn; jj++)
                    for (int64_t c = 0; c < nc; c++)
                        storen(kt + jj * D + VN * c, loadn_kv((const char *)kb + jj * rb, VN * c, mode, D));
                kb = kt;
            }
            for (int p = 0; p < P; p++) {
                if (nb[p] <= j0) continue;                /* this pair's keys ended before the tile */
                storen(s[p] + j0, tile_scores(nc, q[p], (const float *)kb, jn, D));
            }
        }
        for (int p = 0; p < P; p++) {
            if (nb[p] == 0) continue;                     /* this pair ended before the block */
            float *sr = s[p];
            int64_t nbv = (nb[p] + VN - 1) / VN * VN;
            for (int64_t j = nb[p]; j < nbv; j++) sr[j] = -INFINITY;    /* lanes past the pair's last key */
            for (int64_t j = 0; j < lo[p] - b0; j++) sr[j] = -INFINITY; /* [SWA] keys before its window */
            vf mv = loadn(sr);
            for (int64_t j = VN; j < nbv; j += VN) mv = maxn(mv, loadn(sr + j));
            float mb = hmaxn(mv), mn = mb > m[p] ? mb : m[p];
            float alpha = expn(splatn(m[p] - mn))[0];    /* rescales what earlier blocks summed */
            vf lsum = splatn(0.0f);
            for (int64_t j = 0; j < nbv; j += VN) {
                vf e = expn(loadn(sr + j) - splatn(mn));
                storen(sr + j, e);
                lsum += e;
            }
            l[p] = l[p] * alpha + hsumn(lsum);
            for (int64_t c = 0; c < nc; c++) acc[p][c] *= splatn(alpha);
            m[p] = mn;
        }
        for (int p0 = 0; p0 < P; p0 += PVG) {             /* p @ V, PVG pairs sharing each V load */
            const int G = P - p0 < PVG ? P - p0 : PVG;
            block_pv_any(G, mode, nc, v, b0, D, nb + p0, s + p0, acc + p0);
        }
    }
    for (int p = 0; p < P; p++) {
        vf inv = splatn(1.0f / l[p]);
        for (int64_t c = 0; c < nc; c++) storen(out[p] + VN * c, acc[p][c] * inv);
    }
}

/* pairs() with the head dimension's chunk count a compile-time constant where it is a common one. */
static void pairs_any(int P, int mode, const float *const *q, const void *k, const void *v, const int64_t *lo,
                      const int64_t *n, int64_t D, float *const *out) {
    switch (D) {
    case 64: pairs(64 / VN, P, mode, q, k, v, lo, n, D, out); break;
    case 128: pairs(128 / VN, P, mode, q, k, v, lo, n, D, out); break;
    case 256: pairs(256 / VN, P, mode, q, k, v, lo, n, D, out); break;
    default: pairs(0, P, mode, q, k, v, lo, n, D, out); break;
    }
}

/* The (query head, position) pairs of one task: query heads [h0, h1) (all or some of one kv head's group) at
 * R consecutive rows of one sequence, PMAX at a time. q rows at q + (h * ldq_h + row) * D, out rows at
 * out + row * ldo + h * D, row r at position pos0 + r; window > 0: it reads only the window's keys [SWA]. */
static void kv_task(int64_t h0, int64_t h1, int R, int mode, const float *q, int64_t ldq_h, int64_t row0,
                    int64_t pos0, const void *k, const void *v, int64_t D, float *out, int64_t ldo, int64_t window) {
    const float *qp[PMAX];
    float *op[PMAX];
    int64_t n[PMAX], lo[PMAX];
    int cnt = 0;
    for (int64_t h = h0; h < h1; h++)
        for (int r = 0; r < R; r++) {
            qp[cnt] = q + (h * ldq_h + row0 + r) * D;
            op[cnt] = out + (row0 + r) * ldo + h * D;
            n[cnt] = pos0 + r + 1;
            lo[cnt] = window > 0 && n[cnt] > window ? n[cnt] - window : 0;
            if (++cnt == PMAX) { pairs_any(cnt, mode, qp, k, v, lo, n, D, op); cnt = 0; }
        }
    if (cnt) pairs_any(cnt, mode, qp, k, v, lo, n, D, op);
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
    #pragma omp parallel for collapse(2) schedule(dynamic, 1) num_threads(nthreads)
    for (int64_t kvh = 0; kvh < KV; kvh++)
        for (int64_t gi = 0; gi < ngroups; gi++) {
            int64_t t0 = gi * RMAX;
            int R = (int)(T - t0 < RMAX ? T - t0 : RMAX);
            kv_task(kvh * G, (kvh + 1) * G, R, KV_F32, q, T, t0, start + t0, k + kvh * cap * D, v + kvh * cap * D, D, out,
                    ldo, 0);
        }
    return 0;
}

/* Many sequences' rows in one call (continuous batching): one parallel region per layer instead of one
 * per sequence. segs: nseg rows of 6 int64 (first row in q/out, rows, start position, cache capacity,
 * address of the slot's K cache and of its V cache, each (layers, KV, cap, rows) contiguous, rows of
 * kv_mode's format: KV_F32 | KV_F16 | KV_Q8, vec.h).
 * q: (H, M, D) scaled; out: (M, H * D). Each row runs pairs() exactly as tq_attention would run it, so a
 * sequence's bits are the same alone or in company. window > 0: each row reads only the keys of its
 * window [SWA] (0: all its keys). Returns -1 on a shape it does not take. */
int tq_attention_segments_window(const int64_t *segs, int64_t nseg, int64_t layer, const float *q, int64_t M,
                                 int64_t H, int64_t KV, int64_t D, float *out, int nthreads, int kv_mode,
                                 int64_t window) {
    if (D % 16 || D > MAXD || H % KV || M <= 0 || window < 0 || kv_mode < KV_F32 || kv_mode > KV_Q8
        || (kv_mode == KV_Q8 && D % 32))
        return -1;
    const int64_t G = H / KV;
    /* tasks: up to RMAX consecutive rows of one segment (segment, first row) */
    int64_t ntask = 0, *task = malloc(2 * (M + nseg) * sizeof *task);
    float *qr = NULL;                 /* a q8_0 cache's keys are rotated: so are the queries [KV-ROTATE] */
    if (kv_mode == KV_Q8) {
        if (!(qr = malloc(H * M * D * sizeof *qr))) { free(task); return -1; }
        #pragma omp parallel for schedule(static) num_threads(nthreads) if (H * M >= 8)
        for (int64_t r = 0; r < H * M; r++) tq_kv_rotate_q(q + r * D, 1, D, qr + r * D);
        q = qr;
    }
    if (!task) { free(qr); return -1; }
    for (int64_t sg = 0; sg < nseg; sg++) {
        int64_t r0 = segs[6 * sg], len = segs[6 * sg + 1];
        if (r0 < 0 || len < 0 || r0 + len > M) { free(task); free(qr); return -1; }
        for (int64_t t = 0; t < len; t += RMAX) { task[2 * ntask] = sg; task[2 * ntask + 1] = t; ntask++; }
    }
    /* kv head outermost: a thread's consecutive tasks read the same kv head's K/V, which then stays in
     * its L2 (a prefill chunk's tasks all read the whole prefix: at 2,000 keys, 0.5 MB a kv head in
     * fp16, the same again per row group when the heads alternate): +5% on a 37-row tail after 2,084
     * keys. Handed out one at a time: tasks differ in rows (a 37-row tail is 8, 8, 8, 8, 5 a kv head)
     * and keys (sequences of different lengths), and static halves left one thread idle up to 18% of
     * a tail (a 37-row tail -5%, prefill chunks within 1%). Neither the order nor the thread changes a row's
     * arithmetic.
     * Fewer tasks than threads (a lone decode row of a model with one kv head, gemma3's: one task, and one
     * thread read all 16,000 keys of a global layer while the other waited): the group's query heads are
     * split into HP parts instead, each a task that reads the kv head's K/V for its own heads. A pair's
     * arithmetic does not depend on the pairs that share its loads, so no bit changes. */
    int64_t HP = 1;
    if (KV * ntask < nthreads) HP = (nthreads + KV * ntask - 1) / (KV * ntask);
    if (HP > G) HP = G;
    #pragma omp parallel for collapse(3) schedule(dynamic, 1) num_threads(nthreads)
    for (int64_t kvh = 0; kvh < KV; kvh++)
        for (int64_t ti = 0; ti < ntask; ti++)
            for (int64_t hp = 0; hp < HP; hp++) {
            const int64_t *sg = segs + 6 * task[2 * ti];
            const int64_t r0 = sg[0], len = sg[1], cap = sg[3], t0 = task[2 * ti + 1];
            const int R = (int)(len - t0 < RMAX ? len - t0 : RMAX);
            const int64_t at = ((layer * KV + kvh) * cap) * kv_row_bytes(kv_mode, D);   /* bytes */
            const void *k = (const char *)(intptr_t)sg[4] + at, *v = (const char *)(intptr_t)sg[5] + at;
            /* The task's (head, row) pairs that read this kv head share each K/V load: a decode row
             * (R = 1) reads its K/V once for the G query heads of the group instead of G times; every
             * pair still runs the single-row algorithm. */
            kv_task(kvh * G + hp * G / HP, kvh * G + (hp + 1) * G / HP, R, kv_mode, q, M, r0 + t0, sg[2] + t0, k, v,
                    D, out, H * D, window);
        }
    free(task);
    free(qr);
    return 0;
}

/* Full causal attention (layer.c's call): tq_attention_segments_window with no window. */
int tq_attention_segments(const int64_t *segs, int64_t nseg, int64_t layer, const float *q, int64_t M,
                          int64_t H, int64_t KV, int64_t D, float *out, int nthreads, int kv_mode) {
    return tq_attention_segments_window(segs, nseg, layer, q, M, H, KV, D, out, nthreads, kv_mode, 0);
}

/* [KV-ROTATE] A q8_0 cache holds each key row rotated: every 32 values (a quantization block) times the
 * 32 x 32 Hadamard matrix H (entries +-1, H^T H = 32 I), and attention multiplies each query row by H / 32
 * before it reads them: (H q / 32) . (H k) = q . k. Why: a key row's few large dimensions (Qwen2's key
 * bias puts values ~50x the rest in some) set their block's step, and every other value of the block lost
 * its precision to them (qwen2.5-coder-1.5b: perplexity +0.38% over 8,192 tokens of context unrotated);
 * rotated, each block's energy is spread over its 32 values. Values are untouched (the output would need the
 * inverse). The butterflies are scalar IEEE additions in a fixed order and /32 is exact: the same bits on
 * every build; kv/kvtype.py's hadamard32 repeats them in torch. x: 32 floats, in place. */
static void hadamard32(float *x) {
    for (int h = 1; h < 32; h <<= 1)
        for (int i = 0; i < 32; i += 2 * h)
            for (int j = i; j < i + h; j++) {
                const float a = x[j], b = x[j + h];
                x[j] = a + b;
                x[j + h] = a - b;
            }
}

/* n query rows of D values (D % 32 == 0) -> H q / 32 per block of 32 [KV-ROTATE] (out may not be q). */
void tq_kv_rotate_q(const float *q, int64_t n, int64_t D, float *out) {
    for (int64_t r = 0; r < n; r++)
        for (int64_t b = 0; b < D; b += 32) {
            float *o = out + r * D + b;
            memcpy(o, q + r * D + b, 32 * sizeof *o);
            hadamard32(o);
            for (int i = 0; i < 32; i++) o[i] *= 0.03125f;
        }
}

/* One KV row (D fp32 values, D % 32 == 0) -> q8_0 (vec.h KV_Q8), each block of 32 first rotated where
 * `rotate` is set (keys [KV-ROTATE]): per block d = max|x| / 127 rounded to fp16 (nearest even; the largest
 * finite fp16 at most), code = x / d rounded to nearest even, within [-127, 127] (0 where d is 0). Scalar
 * IEEE operations only (a division, not a reciprocal): the same bytes on every build, and a row's bytes
 * depend on that row alone, so cached == cold and batched == alone hold for a q8_0 cache as for an fp32
 * one. Codes are computed from the stored (fp16) scale, so code * d is the nearest value the block can hold. */
void tq_kv_q8_row(const float *x, int64_t D, uint8_t *dst, int rotate) {
    int8_t *codes = (int8_t *)dst;
    for (int64_t b = 0; b < D; b += 32) {
        float t[32], amax = 0.0f;
        memcpy(t, x + b, sizeof t);
        if (rotate) hadamard32(t);
        for (int i = 0; i < 32; i++) {
            const float a = fabsf(t[i]);
            amax = a > amax ? a : amax;
        }
        float d = amax / 127.0f;
        d = d < 65504.0f ? d : 65504.0f;
        const _Float16 d16 = (_Float16)d;
        const float df = (float)d16;
        for (int i = 0; i < 32; i++) {
            float c = df > 0.0f ? rintf(t[i] / df) : 0.0f;
            c = c > 127.0f ? 127.0f : c < -127.0f ? -127.0f : c == c ? c : 0.0f;   /* NaN: 0 */
            codes[b + i] = (int8_t)c;
        }
        memcpy(dst + D + 2 * (b / 32), &d16, sizeof d16);
    }
}

/* n rows of D fp32 values (row r at x + r * D) -> n q8_0 rows of D + D / 16 bytes at dst, rotated where
 * `rotate` is set (keys [KV-ROTATE]) (the torch layers' KV write, models/llama.py). Returns 0, or -1 when D is
 * not a multiple of 32. */
int tq_kv_q8_rows(const float *x, int64_t n, int64_t D, uint8_t *dst, int rotate) {
    if (D % 32 || D <= 0 || n < 0) return -1;
    for (int64_t r = 0; r < n; r++) tq_kv_q8_row(x + r * D, D, dst + r * (D + D / 16), rotate);
    return 0;
}
