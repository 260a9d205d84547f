/* The gated delta rule (Qwen3.5 / Qwen3-Next's linear-attention layers), one token at a time, in prefill and
 * in decode alike (models/deltanet.py).
 *
 * Why one token at a time: a recurrent layer's state cannot be cut back to a prefix, so reuse resumes it
 * from a snapshot (kv/recurrent.py). The chunked scan (transformers' torch_chunk_gated_delta_rule) and the
 * one-step update compute the same state with different roundings, so a state reached by a decode, a
 * prefill in chunks or a cold run would differ in its bits. Here every path takes the same per-token
 * steps: the state after position p has the same bits however p was reached (cold, resumed, chunked,
 * batched, decoded), which is what makes a snapshot at any position exact [RESUME-EXACT].
 *
 * Per value head h (key head h / (Hv / Hk), or h % Hk in a GGUF's tiled order), per token t, with S (dk, dv) the head's state:
 *   S *= exp(g[t, h])                                  (each element: one product)
 *   m[j] = sum_i S[i][j] k[i]                          (i ascending: each j its own chain)
 *   d[j] = (v[j] - m[j]) * beta[t, h]
 *   S[i][j] += k[i] d[j]                               (one fma each)
 *   o[j] = sum_i S[i][j] q[i]                          (i ascending)
 * Every lane j runs its own chains in the order of i, so the vector width cannot change a bit; heads are
 * independent (threads split them). q, k arrive L2-normalised and q scaled (deltanet.py, in torch).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vec.h"

/* q, k: (T, Hk, dk) fp32; v: (T, Hv, dv); g, beta: (T, Hv); state: (Hv, dk, dv), updated in place; out: (T, Hv,
 * dv). Hv a multiple of Hk, dv <= 512; value head h reads key head h % Hk when `tiled` (a GGUF's order), else
 * h / (Hv / Hk) (transformers'). Side effects: state, out. 0, or -1 on a shape it does not take. */
int tq_delta_rule(const float *q, const float *k, const float *v, const float *g, const float *beta, int64_t T,
                  int64_t Hk, int64_t Hv, int64_t dk, int64_t dv, int64_t tiled, float *state, float *out,
                  int nthreads) {
    if (T < 0 || Hk <= 0 || Hv % Hk || dk <= 0 || dv <= 0 || dv > 512) return -1;
    const int64_t rep = Hv / Hk;
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (Hv > 1 && T * dk * dv > 32768)
    for (int64_t h = 0; h < Hv; h++) {
        float *S = state + h * dk * dv;
        float m[512], d[512];
        const int64_t kh = tiled ? h % Hk : h / rep;
        for (int64_t t = 0; t < T; t++) {
            const float *qt = q + (t * Hk + kh) * dk, *kt = k + (t * Hk + kh) * dk;
            const float *vt = v + (t * Hv + h) * dv;
            const float e = expf(g[t * Hv + h]), b = beta[t * Hv + h];
            for (int64_t j = 0; j < dv; j++) m[j] = 0.0f;
            for (int64_t i = 0; i < dk; i++) {
                float *row = S + i * dv;
                const float ki = kt[i];
                for (int64_t j = 0; j < dv; j++) {
                    row[j] *= e;
                    m[j] = fmaf(row[j], ki, m[j]);
                }
            }
            for (int64_t j = 0; j < dv; j++) d[j] = (vt[j] - m[j]) * b;
            float *o = out + (t * Hv + h) * dv;
            for (int64_t j = 0; j < dv; j++) o[j] = 0.0f;
            for (int64_t i = 0; i < dk; i++) {
                float *row = S + i * dv;
                const float ki = kt[i], qi = qt[i];
                for (int64_t j = 0; j < dv; j++) {
                    row[j] = fmaf(ki, d[j], row[j]);
                    o[j] = fmaf(row[j], qi, o[j]);
                }
            }
        }
    }
    return 0;
}

/* ---- the Mamba-2 (SSD) recurrence (Nemotron-H's mixer, models/mamba2.py), one token at a time ---------------
 * Why not the chunked SSD form transformers runs in prefill: the same reason as the delta rule above. A state
 * reached by one pass, by chunks, by decodes or by a resume must have the same bits [RESUME-EXACT], so every path
 * takes these per-token steps. Per head h (B/C group g = h / (H / G)), per token t, with S (P, N) the head's
 * state, d = dt[t, h] (softplus'd and clamped in mamba2.py), a = expf(d * A[h]) (A = -exp(A_log) < 0):
 *   dB[n] = d * B[n]
 *   S[p][n] = S[p][n] * a + dB[n] * x[p]              (transformers' decode order: state * dA + dB * x)
 *   y[p] = (sum_n S[p][n] C[n]) + D[h] x[p]           (n ascending, one fma each: each p its own chain)
 * No sum runs across lanes, so the vector width cannot change a bit; heads are independent (threads split them).
 * x: (T, H, P) fp32 (after conv + SiLU); B, C: (T, G, N); dt: (T, H); A, D: (H,); state: (H, P, N), updated in
 * place; out: (T, H, P). N <= 1024. Side effects: state, out. 0, or -1 on a shape it does not take. */
int tq_ssd_scan(const float *x, const float *B, const float *C, const float *dt, const float *A, const float *D,
                int64_t T, int64_t H, int64_t G, int64_t P, int64_t N, float *state, float *out, int nthreads) {
    if (T < 0 || H <= 0 || G <= 0 || H % G || P <= 0 || N <= 0 || N > 1024) return -1;
    const int64_t per_g = H / G;
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (H > 1 && T * P * N > 32768)
    for (int64_t h = 0; h < H; h++) {
        float *S = state + h * P * N;
        float dB[1024];
        const int64_t g = h / per_g;
        const float Ah = A[h], Dh = D[h];
        for (int64_t t = 0; t < T; t++) {
            const float d = dt[t * H + h], a = expf(d * Ah);
            const float *Bt = B + (t * G + g) * N, *Ct = C + (t * G + g) * N, *xt = x + (t * H + h) * P;
            float *o = out + (t * H + h) * P;
            for (int64_t n = 0; n < N; n++) dB[n] = d * Bt[n];
            for (int64_t p = 0; p < P; p++) {
                float *row = S + p * N;
                const float xp = xt[p];
                for (int64_t n = 0; n < N; n++) row[n] = row[n] * a + dB[n] * xp;
                float acc = 0.0f;
                for (int64_t n = 0; n < N; n++) acc = fmaf(row[n], Ct[n], acc);
                o[p] = acc + Dh * xp;
            }
        }
    }
    return 0;
}

/* ---- pointwise functions, the same bits for every element wherever it lies --------------------------
 * Why: torch's CPU sigmoid / SiLU take a vector formula for most elements and another for a buffer's tail
 * (and for each thread's chunk tail), so an element's bits depended on how many rows were computed with it
 * (measured: a 7-row chunk's SiLU differed from the same rows inside 80). A recurrent state carries such a
 * difference forever, so the hybrid layers take these: one formula per element, VN lanes at a time, a tail
 * padded into a full vector (vec.h's expn: IEEE operations per lane, nothing across lanes), any split across
 * threads. op: 0 sigmoid(x) = 1 / (1 + e^-x), 1 silu(x) = x / (1 + e^-x), 2 softplus(x) (libm log1pf(expf(x)),
 * x above 20: x, torch's threshold; a few values a row), 3 silu(x) * u. e^-x with -x capped at 88 (finite). */
static inline vf pointwise_n(int op, vf x, vf u) {
    const vf t = expn(selectn(-x < splatn(88.0f), -x, splatn(88.0f)));
    const vf one = splatn(1.0f);
    switch (op) {
    case 0: return one / (one + t);
    case 1: return x / (one + t);
    default: return (x / (one + t)) * u;
    }
}

void tq_pointwise(int op, const float *x, const float *u, float *y, int64_t n, int nthreads) {
    if (op == 2) {
        for (int64_t i = 0; i < n; i++) y[i] = x[i] > 20.0f ? x[i] : log1pf(expf(x[i]));
        return;
    }
    const int64_t full = n / VN;
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (n > 65536)
    for (int64_t c = 0; c <= full; c++) {
        const int64_t i = c * VN, m = n - i < VN ? n - i : VN;
        if (m <= 0) continue;
        float xb[VN] = {0}, ub[VN] = {0}, yb[VN];
        memcpy(xb, x + i, (size_t)m * sizeof(float));
        if (op == 3) memcpy(ub, u + i, (size_t)m * sizeof(float));
        storen(yb, pointwise_n(op, loadn(xb), loadn(ub)));
        memcpy(y + i, yb, (size_t)m * sizeof(float));
    }
}
