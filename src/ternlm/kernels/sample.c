/* sample.c: one logits row -> one token id, in a few vector passes over the row (no sort, no log-softmax).
 *
 * The distribution is sampling.py's (the request's, exactly): with m the largest logit and
 *   K = {i : x_i >= the k-th largest x}   (top-k; ties at the k-th value stay; all of the row without top-k)
 *   e_i = exp((x_i - m) / T) on K, 0 elsewhere;  p_i = e_i / sum_K e
 * min-p keeps e_i >= min_p (p_i >= min_p * p_max, as e_max = 1); top-p keeps the shortest prefix of K ordered
 * by (p desc, index asc) whose mass reaches top_p (a token stays while the mass before it is < top_p); F, the
 * tokens both keep, is renormalized. The draw is an inverse CDF: the first i of F, in index order, whose running
 * sum of e exceeds u * sum_F e, u in [0, 1) from the request's (seed, position) (sampling.draw_seed).
 *
 * Why no sort [SELECT-NOT-SORT]: the k-th largest comes from counting the row against a few thresholds below the
 * max and a quickselect among the candidates above one of them; the nucleus's edge from a mass-weighted
 * quickselect among the tokens above a threshold that already holds top_p of the mass (almost always a few
 * hundred tokens); an unfiltered draw walks per-block sums, then one block. A row of 262,144 logits: ~3 passes.
 * Single-threaded: a row is ~1 MB, and the step's other rows sample in turn (penalty state is sequential).
 */
#include "vec.h"
#include <stdlib.h>

#define BLK 1024           /* elements per block sum: the unfiltered draw walks blocks, then one block */

static float row_max(const float *x, int64_t V) {
    vf acc = splatn(-INFINITY);
    int64_t i = 0;
    for (; i + VN <= V; i += VN) acc = maxn(loadn(x + i), acc);
    float m = hmaxn(acc);
    for (; i < V; i++) m = x[i] > m ? x[i] : m;
    return m;
}

/* exp of one value, the vector path's bits (the tail of a row must not round differently from its body) */
static inline float exp1(float z) { return expn(splatn(z))[0]; }

/* e[i] = x[i] >= lo ? exp((x[i] - m) * s) : 0; bsum[b] = the sum of block b's e (fixed order: VN lanes, then
 * hsumn, then double). Returns the sum of the blocks, in block order. */
static double exp_pass(const float *x, int64_t V, float m, float s, float lo, float *e, double *bsum) {
    double total = 0.0;
    const vf vm = splatn(m), vs = splatn(s), vlo = splatn(lo), zero = splatn(0.0f);
    for (int64_t b0 = 0, b = 0; b0 < V; b0 += BLK, b++) {
        int64_t end = b0 + BLK < V ? b0 + BLK : V, i = b0;
        vf acc = zero;
        for (; i + VN <= end; i += VN) {
            vf v = loadn(x + i);
            vf ex = selectn(v >= vlo, expn((v - vm) * vs), zero);
            storen(e + i, ex);
            acc += ex;
        }
        double sum = hsumn(acc);
        for (; i < end; i++) {
            e[i] = x[i] >= lo ? exp1((x[i] - m) * s) : 0.0f;
            sum += e[i];
        }
        bsum[b] = sum;
        total += sum;
    }
    return total;
}

/* lanes of v that are >= c, as bits (lane j -> bit j) */
static inline unsigned ge_bits(vf v, float c) {
#if VN == 16
    return _mm512_cmp_ps_mask((__m512)v, _mm512_set1_ps(c), _CMP_GE_OQ);
#elif VN == 8
    return (unsigned)_mm256_movemask_ps(_mm256_cmp_ps((__m256)v, _mm256_set1_ps(c), _CMP_GE_OQ));
#else
    unsigned r = 0;
    for (int j = 0; j < VN; j++) r |= (unsigned)(v[j] >= c) << j;
    return r;
#endif
}

/* The indices i with a[i] >= c, in index order, into cand; *mass: the sum of their a (double, index order). */
static int64_t compact_ge(const float *a, int64_t V, float c, int32_t *cand, double *mass) {
    int64_t n = 0, i = 0;
    double s = 0.0;
    for (; i + VN <= V; i += VN) {
        unsigned bits = ge_bits(loadn(a + i), c);
        while (bits) {
            int j = __builtin_ctz(bits);
            bits &= bits - 1;
            cand[n++] = (int32_t)(i + j);
            s += a[i + j];
        }
    }
    for (; i < V; i++)
        if (a[i] >= c) { cand[n++] = (int32_t)i; s += a[i]; }
    *mass = s;
    return n;
}

static inline void swapf(float *w, int64_t a, int64_t b) { float t = w[a]; w[a] = w[b]; w[b] = t; }

static inline float median3(float a, float b, float c) {
    return a < b ? (b < c ? b : (a < c ? c : a)) : (a < c ? a : (b < c ? c : b));
}

/* Three-way partition of w[0, n) around p: [0, *gt) > p, [*gt, *eq) == p, the rest < p. */
static void partition3(float *w, int64_t n, float p, int64_t *gt, int64_t *eq) {
    int64_t lo = 0, mid = 0, hi = n;
    while (mid < hi) {
        if (w[mid] > p) swapf(w, lo++, mid++);
        else if (w[mid] < p) swapf(w, mid, --hi);
        else mid++;
    }
    *gt = lo;
    *eq = mid;
}

/* The k-th largest (k >= 1) of w[0, n) (k <= n). Reorders w. Expected O(n). */
static float select_kth(float *w, int64_t n, int64_t k) {
    for (;;) {
        float p = median3(w[0], w[n / 2], w[n - 1]);
        int64_t gt, eq;
        partition3(w, n, p, &gt, &eq);
        if (k <= gt) { n = gt; continue; }
        if (k <= eq) return p;
        k -= eq;
        w += eq;
        n -= eq;
    }
}

/* The nucleus's edge among w[0, n) (the e of candidates that hold at least P of the mass): the value t of the
 * token where the running mass, in descending order, reaches P; *above: the mass of the values > t. Reorders w.
 * If rounding leaves the whole array short of P, t is its smallest value (every candidate stays). */
static float select_mass(float *w, int64_t n, double P, double *above) {
    double acc = 0.0;
    float smallest = INFINITY;
    while (n > 0) {
        float p = median3(w[0], w[n / 2], w[n - 1]);
        int64_t gt, eq;
        partition3(w, n, p, &gt, &eq);
        double mg = 0.0, me = 0.0;
        for (int64_t i = 0; i < gt; i++) mg += w[i];
        me = (double)p * (double)(eq - gt);
        if (acc + mg >= P) { n = gt; continue; }
        if (acc + mg + me >= P) { *above = acc + mg; return p; }
        acc += mg + me;
        smallest = p;
        w += eq;
        n -= eq;
    }
    *above = acc;
    return smallest;
}

/* Thresholds (relative to the max's e = 1) tried in turn for the nucleus's candidates: the first whose tokens
 * hold top_p of the mass is taken; the last takes every nonzero e (expn's smallest is ~e^-87). */
static const float LADDER[] = {0x1p-7f, 0x1p-14f, 0x1p-24f, 0x1p-40f, 1e-38f};

/* x: (V,) fp32 logits (bias, penalties and grammar mask applied); temperature > 0; top_k 0 = off; top_p in
 * (0, 1]; min_p in [0, 1]; u in [0, 1). Scratch the caller owns: e (V floats), w (V floats), cand (V int32),
 * bsum ((V + 1023) / 1024 doubles). probs: NULL, or (V,) written with the final distribution (0 outside F).
 * Returns the token id, or -1 when no token has any probability (every logit -inf). Writes only the scratch
 * and probs. */
int64_t tq_sample(const float *x, int64_t V, float temperature, int64_t top_k, float top_p, float min_p,
                  double u, float *e, float *w, int32_t *cand, double *bsum, float *probs) {
    float m = row_max(x, V);
    if (!(m > -INFINITY)) return -1;
    float lo = -INFINITY;
    if (top_k > 0 && top_k < V) {          /* K: x >= the k-th largest [SELECT-NOT-SORT] */
        static const float D[] = {0.5f, 1.0f, 2.0f, 4.0f, 8.0f, 16.0f, 32.0f, 64.0f};
        float thr = -INFINITY;
        for (int t = 0; t < 8; t++) {      /* the nearest threshold below the max with >= k values above it */
            int64_t cnt = 0;
            float c = m - D[t];
            for (int64_t i = 0; i < V; i++) cnt += x[i] >= c;
            if (cnt >= top_k) { thr = c; break; }
        }
        double unused;
        int64_t n = compact_ge(x, V, thr, cand, &unused);
        if (n >= top_k) {
            for (int64_t i = 0; i < n; i++) w[i] = x[cand[i]];
            lo = select_kth(w, n, top_k);
        }                                  /* fewer than k finite values: K is the whole row */
    }
    double Z = exp_pass(x, V, m, 1.0f / temperature, lo, e, bsum);
    int64_t nb = (V + BLK - 1) / BLK, nf = -1;   /* nf: |F| when F is the candidate list, -1: F is K */
    float t = 0.0f;                        /* top-p: keep e > t, and the first `ties` tokens with e == t */
    int64_t ties = 0;
    if (top_p < 1.0f) {
        double P = (double)top_p * Z, mass = 0.0, above = 0.0;
        for (int r = 0; r < (int)(sizeof LADDER / sizeof LADDER[0]); r++) {
            float c = LADDER[r] > min_p ? LADDER[r] : min_p;
            nf = compact_ge(e, V, c, cand, &mass);
            if (mass >= P || c == min_p || r == (int)(sizeof LADDER / sizeof LADDER[0]) - 1) break;
        }
        if (mass >= P) {                   /* the edge lies among the candidates */
            for (int64_t i = 0; i < nf; i++) w[i] = e[cand[i]];
            t = select_mass(w, nf, P, &above);
            int64_t neq = 0;
            for (int64_t i = 0; i < nf; i++) neq += e[cand[i]] == t;
            double q = t > 0.0f ? ceil((P - above) / (double)t) : (double)neq;
            ties = q < 1.0 ? 1 : q > (double)neq ? neq : (int64_t)q;
            int64_t kept = 0;              /* F in index order: e > t, and ties in index order up to `ties` */
            for (int64_t i = 0, seen = 0; i < nf; i++) {
                float v = e[cand[i]];
                if (v > t || (v == t && seen++ < ties)) cand[kept++] = cand[i];
            }
            nf = kept;
        }                                  /* else: min_p (or rounding) cut first: every candidate stays */
    } else if (min_p > 0.0f) {
        double mass;
        nf = compact_ge(e, V, min_p, cand, &mass);
    }
    int64_t tok = -1;
    double ZF = 0.0;
    if (nf < 0) {                          /* F = K: walk the block sums, then one block */
        ZF = Z;
        double target = u * Z, cum = 0.0;
        int64_t b = 0;
        while (b < nb - 1 && cum + bsum[b] <= target) cum += bsum[b++];
        int64_t end = (b + 1) * BLK < V ? (b + 1) * BLK : V;
        for (int64_t i = b * BLK; i < end; i++) {
            if (e[i] > 0.0f) tok = i;      /* rounding left the block short: its last nonzero */
            cum += e[i];
            if (e[i] > 0.0f && cum > target) break;
        }
        for (int64_t bb = b; tok < 0 && bb >= 0; bb--)   /* (an empty block: the last nonzero before it) */
            for (int64_t i = (bb + 1) * BLK < V ? (bb + 1) * BLK : V; tok < 0 && i-- > bb * BLK;)
                if (e[i] > 0.0f) tok = i;
    } else {
        for (int64_t i = 0; i < nf; i++) ZF += e[cand[i]];
        double target = u * ZF, cum = 0.0;
        for (int64_t i = 0; i < nf; i++) {
            tok = cand[i];
            cum += e[cand[i]];
            if (cum > target) break;
        }
    }
    if (probs) {
        memset(probs, 0, (size_t)V * sizeof *probs);
        if (nf < 0)
            for (int64_t i = 0; i < V; i++) probs[i] = (float)(e[i] / ZF);
        else
            for (int64_t i = 0; i < nf; i++) probs[cand[i]] = (float)(e[cand[i]] / ZF);
    }
    return tok;
}
