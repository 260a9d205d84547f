/* One whole decoder layer (llama / qwen2 / qwen3 / gemma3) for fp32 activations and quantized projections,
 * in one call: RMSNorm -> q/k/v -> (q/k norm) -> RoPE -> KV write -> attention (windowed or not) -> o
 * (-> RMSNorm) + residual -> RMSNorm -> gate/up -> SiLU or GELU-tanh * up -> down (-> RMSNorm) + residual.
 * What differs between the architectures is data in TqLayer (the activation, the optional output norms,
 * the window, the query scale, the RoPE tables), never a branch on a name. models/llama.py's torch code
 * computes the same layer; this exists because at decode (one row) its ~35 small torch ops a layer cost
 * more than the layer's arithmetic (~4 ms a token on smollm2, a quarter of the step).
 *
 * [BATCH-INVARIANT] Everything here is row-wise (a row's norm, RoPE, SiLU read only that row, in a fixed
 * order) or one of the batch-invariant kernels (qlanes.c, attention.c): a row's bits do not depend on
 * M, on the other sequences in the batch or on the thread count.
 *
 * [RECORD-WHERE-FED] The KV write is a side effect of this call, like the torch layer's; the caller
 * (runner.py) records the positions fed once the whole forward returned.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "layouts.h"
#include "vec.h"

typedef void (*mm_fn)(const float *x, int64_t M, int64_t K, const uint8_t *codes, const uint8_t *high,
                      const void *scale, const void *bias, const uint16_t *sup, int64_t N, float *y, int64_t ldy,
                      int nthreads);
#define MM_DECL(NAME) void NAME(const float *, int64_t, int64_t, const uint8_t *, const uint8_t *, const void *, \
                                const void *, const uint16_t *, int64_t, float *, int64_t, int);
#define TQ_ENTRY(L, M, bits) MM_DECL(tq_##L##_##M##_mm)
TQ_LAYOUTS(TQ_ENTRIES_ALL)                      /* every entry layouts.h lists: qamx.c's, qlanes.c's, qint8.c's */
#undef TQ_ENTRY
int tq_lanes_range(int64_t layout, int64_t mode, const float *x, int64_t M, int64_t K, const uint8_t *codes,
                   const uint8_t *high, const void *scale, const void *bias, const uint16_t *sup, int64_t N,
                   int64_t b0, int64_t b1, float *y, int64_t ldy);
void tq_int8_prepare(const float *x, int64_t K, int64_t m0, int64_t m1, int8_t *q, float *d, int32_t *s16,
                     float *ds);
int tq_int8_parts(const float *x, int64_t M, int64_t K, const void *parts, int64_t nparts, float *y, int64_t ldy,
                  int nthreads);
int tq_int8_range(int64_t layout, int64_t mode, const int8_t *q, const float *d, const int32_t *s16,
                  const float *ds, int64_t M, int64_t K, const uint8_t *codes, const uint8_t *high,
                  const void *scale, const void *bias, const uint16_t *sup, int64_t N, int64_t b0, int64_t b1,
                  float *y, int64_t ldy);
/* [RAW] layout TQ_LAYOUT_raw: an expert matrix's GGML blocks as read (mode: its GGML type, layouts.h's RAW_TYPE
 * lines), multiplied by qint8.c's tq_int8_raw_range with the bits of its int layout (experts only:
 * tq_moe_experts' shares) */
int tq_int8_raw_range(int64_t qtype, const int8_t *q, const float *d, const int32_t *s16, const float *ds,
                      int64_t M, int64_t K, const uint8_t *raw, int64_t N, int64_t b0, int64_t b1, float *y,
                      int64_t ldy);
int tq_attention_segments_window(const int64_t *segs, int64_t nseg, int64_t layer, const float *q, int64_t M,
                                 int64_t H, int64_t KV, int64_t D, float *out, int nthreads, int kv_mode,
                                 int64_t window);
void tq_kv_q8_row(const float *x, int64_t D, uint8_t *dst, int rotate);   /* attention.c: a KV row -> q8_0 */

/* [layout][scale mode] -> the entry, by layouts.h's codes (build.py LAYOUT_CODE, MODE_CODE): qamx.c's ROW
 * layouts (the opt-in AMX build), qlanes.c's LANES (fp32 activations), qint8.c's INT (int8 activations,
 * quantized inside each call). NULL: no such variant (the Python side never builds one: models/native_layer.py
 * checks build.py's MM_VARIANTS, read from the same rows). The RAW layout has no entries: it is never a dense
 * projection's part, only an expert's (run_shares). */
#define TQ_ENTRY(L, M, bits) [TQ_LAYOUT_##L][TQ_MODE_##M] = tq_##L##_##M##_mm,
static const mm_fn MM[][TQ_NMODES] = {TQ_LAYOUTS(TQ_ENTRIES_ALL)};
#undef TQ_ENTRY

/* Mirrored by ctypes Structures in kernels/build.py (Part) and models/native_layer.py: every field 8 bytes, no
 * padding. */
typedef struct {
    int64_t layout, mode, n;              /* n: output features of this part */
    const uint8_t *codes, *high;
    const void *scale, *bias;
    const uint16_t *sup;
} TqPart;

#define MAXPARTS 4
typedef struct {
    int64_t nparts, n_out;
    const float *bias;                    /* (n_out,) added after the matmul, or NULL */
    TqPart parts[MAXPARTS];               /* stacked along the outputs */
} TqProj;

typedef struct {
    int64_t hidden, inter, H, KV, D, index;     /* index: this layer's place in the slots' caches */
    double eps;
    const float *in_norm, *post_norm;           /* (hidden,) */
    const float *q_norm, *k_norm;               /* (D,) or NULL (qwen3's per-head norms) */
    const float *cos, *sin;                     /* (max_pos, D) rotate-half tables: this layer's own RoPE */
    TqProj qkv, o, gate_up, down;
    int64_t kv_mode;                            /* the caches' rows: KV_F32 | KV_F16 (nearest even) | KV_Q8 (vec.h) */
    int64_t act;                                /* the gated MLP's activation: ACT_SILU | ACT_GELU_TANH */
    const float *attn_out_norm, *mlp_out_norm;  /* (hidden,) RMSNorm of the attention / MLP output before
                                                 * its residual add (Gemma's post-norms), or NULL */
    int64_t window;                             /* attention window W: keys (p - W, p]; 0: every key */
    double q_scale;                             /* on q before attention, used as fp32 (the torch path's) */
    int64_t qk_norm_full;                       /* q_norm / k_norm span all of q (H*D) / all of k (KV*D), before
                                                 * the heads split (olmoe), instead of each head (qwen3) */
} TqLayer;

enum { ACT_SILU = 0, ACT_GELU_TANH = 1 };       /* models/native_layer.py ACT_CODE */

/* y (M, n_out) = x (M, K) W^T (+ bias), part by part into column slices; parts all in int layouts: in one
 * call (qint8.c's tq_int8_parts: x quantized once, one parallel region for every part). */
static void project(const TqProj *p, const float *x, int64_t M, int64_t K, float *y, int nthreads) {
    int64_t off = 0, ints = 0;
    for (int64_t i = 0; i < p->nparts; i++) ints += tq_layout_int8(p->parts[i].layout);
    const int fused = p->nparts > 1 && ints == p->nparts
                      && tq_int8_parts(x, M, K, p->parts, p->nparts, y, p->n_out, nthreads) == 0;
    for (int64_t i = 0; !fused && i < p->nparts; i++) {
        const TqPart *t = &p->parts[i];
        MM[t->layout][t->mode](x, M, K, t->codes, t->high, t->scale, t->bias, t->sup, t->n, y + off, p->n_out,
                               nthreads);
        off += t->n;
    }
    if (p->bias)
        for (int64_t m = 0; m < M; m++)
            for (int64_t j = 0; j < p->n_out; j++) y[m * p->n_out + j] += p->bias[j];
}

/* out = w * (x * 1/sqrt(mean(x^2) + eps)): the torch rms_norm's formula, sums in a fixed order, VN lanes
 * (on AVX-512 the same bits as the former 16-float version: hsumn is hsum there). n % 16 == 0. out may
 * be x (every x is read before the first write). */
static void rms_row(const float *x, const float *w, int64_t n, float eps, float *out) {
    vf acc = splatn(0.0f);
    for (int64_t c = 0; c < n; c += VN) { vf v = loadn(x + c); acc += v * v; }
    float r = 1.0f / sqrtf(hsumn(acc) / (float)n + eps);
    for (int64_t c = 0; c < n; c += VN) storen(out + c, loadn(w + c) * (loadn(x + c) * splatn(r)));
}

/* In place: x (D,) rotated for its position (rotate-half layout): x*cos + [-x2, x1]*sin. */
static void rope_row(float *x, const float *cos, const float *sin, int64_t D) {
    float t[256];
    const int64_t half = D / 2;
    for (int64_t i = 0; i < half; i++) { t[i] = -x[half + i]; t[half + i] = x[i]; }
    for (int64_t i = 0; i < D; i++) x[i] = x[i] * cos[i] + t[i] * sin[i];
}

/* SiLU(g) * u, VN lanes (vec.h), exp's argument kept <= 0: silu(g) = g / (1 + e^-g) for g >= 0, and
 * g e^g / (1 + e^g) for g < 0 (the same value, without overflow). */
static inline vf silu_muln(vf g, vf u) {
    vfi neg = g < splatn(0.0f);
    vf t = expn(selectn(neg, g, -g));                    /* e^-|g| */
    vf num = selectn(neg, g * t, g);
    return num / (splatn(1.0f) + t) * u;
}

/* GELU (tanh approximation)(g) * u, VN lanes: torch's formula (ATen/native/cpu/Gelu.h), its constants
 * and its order, 0.5 * g * (1 + tanh(beta * (g + kappa * g^3))) with g^3 = (g * g) * g; tanh from our
 * exp (not libm's or Sleef's: ours changes only with this source, whose digest the KV namespace holds),
 * tanh(y) = sign(y) (1 - e^-2|y|) / (1 + e^-2|y|), exp's argument <= 0 (no overflow). */
static inline vf gelu_tanh_muln(vf g, vf u) {
    const vf beta = splatn((float)(M_SQRT2 * M_2_SQRTPI * 0.5)), kappa = splatn((float)0.044715);
    vf inner = beta * (g + kappa * (g * g * g));
    vfi neg = inner < splatn(0.0f);
    vf na = selectn(neg, inner, -inner);                 /* -|inner| */
    vf t = expn(na + na);                                /* e^-2|inner| */
    vf th = (splatn(1.0f) - t) / (splatn(1.0f) + t);
    th = selectn(neg, -th, th);
    return splatn(0.5f) * g * (splatn(1.0f) + th) * u;
}

/* The layer's attention half: x += o(attention(...)) (Gemma: its post-norm first), then h = RMSNorm(x) with
 * the MLP's input norm, in scratch's first M * hidden floats. Scratch as tq_layer's. Side effects: x, h,
 * the KV of the rows' positions. Returns 0, or -1 on a shape it does not take (nothing written then). */
static int attention_half(const TqLayer *L, const int64_t *segs, int64_t nseg, float *x, int64_t M,
                          float *scratch, int nthreads) {
    const int64_t hid = L->hidden, I = L->inter, H = L->H, KV = L->KV, D = L->D, nqkv = L->qkv.n_out;
    if (hid % 16 || I % 16 || D % 16 || D > 256 || H % KV || M <= 0 || nqkv != (H + 2 * KV) * D
        || L->kv_mode < KV_F32 || L->kv_mode > KV_Q8 || (L->kv_mode == KV_Q8 && D % 32)
        || L->o.n_out != hid || L->window < 0 || (L->qk_norm_full && !(L->q_norm && L->k_norm)))
        return -1;
    const float eps = (float)L->eps;
    float *h = scratch, *qkv = h + M * hid, *qs = qkv + M * nqkv, *att = qs + M * H * D;
    float *o = att + M * H * D + 3 * M * I;         /* after gate|up and SiLU * up (tq_layer's) */
    int64_t *pos = malloc(M * sizeof *pos), *seg = malloc(M * sizeof *seg);
    if (!pos || !seg) { free(pos); free(seg); return -1; }
    for (int64_t s = 0; s < nseg; s++)
        for (int64_t t = 0; t < segs[6 * s + 1]; t++) {
            int64_t r = segs[6 * s] + t;
            if (r < 0 || r >= M) { free(pos); free(seg); return -1; }
            pos[r] = segs[6 * s + 2] + t;
            seg[r] = s;
        }
    const int par = M >= 8;           /* row loops: threads only where there are rows to share */

    #pragma omp parallel for schedule(static) num_threads(nthreads) if (par)
    for (int64_t r = 0; r < M; r++) rms_row(x + r * hid, L->in_norm, hid, eps, h + r * hid);
    project(&L->qkv, h, M, hid, qkv, nthreads);

    const float qscale = (float)L->q_scale;
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (par)
    for (int64_t r = 0; r < M; r++) {
        const int64_t *sg = segs + 6 * seg[r];
        const int64_t cap = sg[3], p = pos[r];
        const float *cs = L->cos + p * D, *sn = L->sin + p * D;
        float *row = qkv + r * nqkv;
        if (L->qk_norm_full) {                           /* one norm over all of q, one over all of k */
            rms_row(row, L->q_norm, H * D, eps, row);
            rms_row(row + H * D, L->k_norm, KV * D, eps, row + H * D);
        }
        for (int64_t hh = 0; hh < H + KV; hh++) {        /* q heads, then k heads */
            float *v = row + hh * D;
            const float *nw = L->qk_norm_full ? NULL : hh < H ? L->q_norm : L->k_norm;
            if (nw) rms_row(v, nw, D, eps, v);
            rope_row(v, cs, sn, D);
        }
        for (int64_t hh = 0; hh < H; hh++)
            for (int64_t i = 0; i < D; i++) qs[(hh * M + r) * D + i] = row[hh * D + i] * qscale;
        for (int64_t kv = 0; kv < KV; kv++) {
            const int64_t at = ((L->index * KV + kv) * cap + p) * kv_row_bytes((int)L->kv_mode, D);   /* bytes */
            const float *kr = row + (H + kv) * D, *vr = row + (H + KV + kv) * D;
            char *kc = (char *)(intptr_t)sg[4] + at, *vc = (char *)(intptr_t)sg[5] + at;
            if (L->kv_mode == KV_Q8) {
                tq_kv_q8_row(kr, D, (uint8_t *)kc, 1);      /* keys rotated [KV-ROTATE] */
                tq_kv_q8_row(vr, D, (uint8_t *)vc, 0);
            } else if (L->kv_mode == KV_F16) {
                for (int64_t i = 0; i < D; i += VN) {
                    storenh((_Float16 *)kc + i, loadn(kr + i));
                    storenh((_Float16 *)vc + i, loadn(vr + i));
                }
            } else {
                memcpy(kc, kr, D * sizeof(float));
                memcpy(vc, vr, D * sizeof(float));
            }
        }
    }
    free(pos);
    free(seg);
    if (tq_attention_segments_window(segs, nseg, L->index, qs, M, H, KV, D, att, nthreads, (int)L->kv_mode,
                                     L->window) != 0)
        return -1;

    project(&L->o, att, M, H * D, o, nthreads);
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (par)
    for (int64_t r = 0; r < M; r++) {
        if (L->attn_out_norm) rms_row(o + r * hid, L->attn_out_norm, hid, eps, o + r * hid);
        for (int64_t i = 0; i < hid; i++) x[r * hid + i] += o[r * hid + i];
        rms_row(x + r * hid, L->post_norm, hid, eps, h + r * hid);
    }
    return 0;
}

/* x: (M, hidden) fp32, updated in place (the residual stream); segs: as tq_attention_segments, one
 * row per sequence; scratch: at least M * (2 hidden + qkv_out + 2 H*D + 3 inter) floats (scratch_per_row
 * in models/native_layer.py).
 * Side effects: x; each sequence's K/V of its positions in this layer. Returns 0, or -1 on a shape
 * it does not take (nothing written then). */
int tq_layer(const TqLayer *L, const int64_t *segs, int64_t nseg, float *x, int64_t M, float *scratch,
             int nthreads) {
    const int64_t hid = L->hidden, I = L->inter, H = L->H, D = L->D;
    if (L->gate_up.n_out != 2 * I || L->down.n_out != hid || (L->act != ACT_SILU && L->act != ACT_GELU_TANH))
        return -1;
    if (attention_half(L, segs, nseg, x, M, scratch, nthreads) != 0)
        return -1;
    const float eps = (float)L->eps;
    const int par = M >= 8;
    float *h = scratch, *gu = h + M * hid + M * L->qkv.n_out + 2 * M * H * D, *act = gu + M * 2 * I, *o = act + M * I;
    project(&L->gate_up, h, M, hid, gu, nthreads);
    const int gelu = L->act == ACT_GELU_TANH;
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (par)
    for (int64_t r = 0; r < M; r++)
        for (int64_t c = 0; c < I; c += VN) {
            vf g = loadn(gu + r * 2 * I + c), u = loadn(gu + r * 2 * I + I + c);
            storen(act + r * I + c, gelu ? gelu_tanh_muln(g, u) : silu_muln(g, u));
        }
    project(&L->down, act, M, I, o, nthreads);
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (par)
    for (int64_t r = 0; r < M; r++) {
        if (L->mlp_out_norm) rms_row(o + r * hid, L->mlp_out_norm, hid, eps, o + r * hid);
        for (int64_t i = 0; i < hid; i++) x[r * hid + i] += o[r * hid + i];
    }
    return 0;
}

/* ---- mixture of experts (qwen3moe, Mixtral, olmoe: models/moe.py's arithmetic, row by row) -----------
 * A MoE layer is three calls from models/native_moe.py, because its experts may stream from disk and only
 * Python's store (models/moe.py) knows where they are: tq_layer_attn (the attention half, h = the MLP's
 * normed input), tq_moe_route (each row's k experts and weights), then the experts the rows use fetched
 * by Python and run by tq_moe_experts (a group at a time: a streamed store holds at most EXPERTS_IN_USE
 * experts at once), and tq_moe_sum (the residual add).
 * [BATCH-INVARIANT] A row's router logits, softmax, top-k and weights read that row alone; an expert's
 * products are lanes products of the rows routed to it (row-invariant in M and in the block range a task
 * takes); a row's k weighted outputs are summed in one fixed order, ascending expert index [SUM-ORDER].
 */

/* The attention half of tq_layer, for a MoE layer (its gate_up / down are empty: the experts are the MLP).
 * Side effects: x (+= attention), scratch's first M * hidden floats = h, the rows' KV. 0, or -1 (shape). */
int tq_layer_attn(const TqLayer *L, const int64_t *segs, int64_t nseg, float *x, int64_t M, float *scratch,
                  int nthreads) {
    return attention_half(L, segs, nseg, x, M, scratch, nthreads);
}

/* h: (M, hid) -> route (M, k) expert indices, ascending in each row, and weights (M, k) fp32: the softmax
 * over the E router logits (router (E, hid) fp32: each logit one dot product of VN-lane partial sums in
 * the order of the inputs, then hsumn), the k largest probabilities (equal ones: the lower index first
 * [TOP-K-TIES]), divided by their sum (added in rank order) when norm. Our expn, not libm's: the bits
 * change only with these sources (the kernels' digest). 0, or -1 on a shape it does not take. */
int tq_moe_route(const float *h, int64_t M, int64_t hid, const float *router, int64_t E, int64_t k, int64_t norm,
                 int64_t *route, float *weights, int nthreads) {
    if (hid % VN || E <= 0 || k <= 0 || k > E || k > 64 || M <= 0) return -1;
    const int64_t EP = (E + VN - 1) / VN * VN;
    int err = 0;
    #pragma omp parallel num_threads(nthreads) if (M >= 8)
    {
        float *p = malloc((size_t)EP * sizeof(float));
        unsigned char *taken = malloc((size_t)E);
        if (!p || !taken) {
            #pragma omp atomic write
            err = -1;
        }
        #pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) {
            if (!p || !taken) continue;
            const float *x = h + m * hid;
            int64_t e = 0;
            for (; e + 4 <= E; e += 4) {               /* four logits side by side: four chains, each in order */
                vf a0 = splatn(0.0f), a1 = a0, a2 = a0, a3 = a0;
                const float *w = router + e * hid;
                for (int64_t c = 0; c < hid; c += VN) {
                    const vf xc = loadn(x + c);
                    a0 = fman(xc, loadn(w + c), a0);
                    a1 = fman(xc, loadn(w + hid + c), a1);
                    a2 = fman(xc, loadn(w + 2 * hid + c), a2);
                    a3 = fman(xc, loadn(w + 3 * hid + c), a3);
                }
                p[e] = hsumn(a0); p[e + 1] = hsumn(a1); p[e + 2] = hsumn(a2); p[e + 3] = hsumn(a3);
            }
            for (; e < E; e++) {
                vf acc = splatn(0.0f);
                for (int64_t c = 0; c < hid; c += VN) acc = fman(loadn(x + c), loadn(router + e * hid + c), acc);
                p[e] = hsumn(acc);
            }
            float mx = p[0];
            for (e = 1; e < E; e++) mx = p[e] > mx ? p[e] : mx;
            for (e = E; e < EP; e++) p[e] = -INFINITY;       /* exp: exactly 0 */
            vf sum = splatn(0.0f);
            for (e = 0; e < EP; e += VN) {
                vf t = expn(loadn(p + e) - splatn(mx));
                storen(p + e, t);
                sum += t;
            }
            const float total = hsumn(sum);
            int64_t idx[64];
            float val[64];
            memset(taken, 0, (size_t)E);
            for (int64_t j = 0; j < k; j++) {          /* selection: the largest left, the lower index on ties */
                int64_t best = -1;
                for (e = 0; e < E; e++)
                    if (!taken[e] && (best < 0 || p[e] > p[best])) best = e;
                idx[j] = best;
                val[j] = p[best] / total;
                taken[best] = 1;
            }
            if (norm) {
                float s = 0.0f;
                for (int64_t j = 0; j < k; j++) s += val[j];
                for (int64_t j = 0; j < k; j++) val[j] /= s;
            }
            for (int64_t j = 1; j < k; j++)            /* ascending expert index [SUM-ORDER] */
                for (int64_t i = j; i > 0 && idx[i - 1] > idx[i]; i--) {
                    int64_t ti = idx[i]; idx[i] = idx[i - 1]; idx[i - 1] = ti;
                    float tv = val[i]; val[i] = val[i - 1]; val[i - 1] = tv;
                }
            for (int64_t j = 0; j < k; j++) { route[m * k + j] = idx[j]; weights[m * k + j] = val[j]; }
        }
        free(p);
        free(taken);
    }
    return err;
}

/* One expert's projections; mirrored by models/native_moe.py's _Expert. */
typedef struct {
    TqProj gate_up, down;       /* (2 I, hid) gate rows first; (hid, I); no bias */
} TqExpert;

/* The rows' int8 activations (qint8.c's tq_int8_prepare) for the int layouts, or all NULL (lanes only):
 * q (R, K), d and ds (R, K/32), s16 (R, K/16). */
typedef struct {
    int8_t *q;
    float *d, *ds;
    int32_t *s16;
} QRows;

/* A product's share: blocks [b0, b1) of one part, for the rows x (M, K) (and their int8 activations xq at
 * the same rows) -> y (stride ldy). */
typedef struct {
    const TqPart *part;
    const float *x;
    QRows xq;
    float *y;
    int64_t M, K, ldy, b0, b1;
} Share;

/* R rows of K activations' int8 form, or all NULL when none of the experts' parts is an int layout (or on a
 * failed allocation: *err then). */
static QRows qrows_alloc(int any_int, int64_t R, int64_t K, int *err) {
    QRows r = {NULL, NULL, NULL, NULL};
    if (!any_int) return r;
    r.q = malloc((size_t)(R * K));
    r.d = malloc((size_t)(R * K / 32) * sizeof(float));
    r.ds = malloc((size_t)(R * K / 32) * sizeof(float));
    r.s16 = malloc((size_t)(R * K / 16) * sizeof(int32_t));
    if (!r.q || !r.d || !r.ds || !r.s16) *err = -1;
    return r;
}

static void qrows_free(QRows *r) { free(r->q); free(r->d); free(r->ds); free(r->s16); }

/* x (R, K) -> r's rows (every row its own quantization: the split across threads changes nothing). */
static void qrows_fill(const QRows *r, const float *x, int64_t R, int64_t K, int par, int nthreads) {
    if (!r->q) return;
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (par)
    for (int64_t m = 0; m < R; m++) tq_int8_prepare(x, K, m, m + 1, r->q, r->d, r->s16, r->ds);
}

/* r's rows from `start` on (an expert's first gathered row). */
static QRows qrows_at(const QRows *r, int64_t start, int64_t K) {
    if (!r->q) return *r;
    return (QRows){r->q + start * K, r->d + start * K / 32, r->ds + start * K / 32, r->s16 + start * K / 16};
}

/* Every projection `which` (0 gate_up, 1 down) of the n experts cut into shares, about 4 a thread. */
static int64_t shares(const TqExpert *const *ex, int64_t n, const int64_t *start, const int64_t *count, int which,
                      const float *x, const QRows *xq, int64_t K, float *y, int64_t ldy, int nthreads, Share *out) {
    int64_t parts = 0, t = 0;
    for (int64_t i = 0; i < n; i++) if (count[i]) parts += which ? ex[i]->down.nparts : ex[i]->gate_up.nparts;
    const int64_t want = 4 * (int64_t)nthreads, cut = parts ? (want + parts - 1) / parts : 1;
    for (int64_t i = 0; i < n; i++) {
        if (!count[i]) continue;
        const TqProj *p = which ? &ex[i]->down : &ex[i]->gate_up;
        int64_t off = 0;
        for (int64_t q = 0; q < p->nparts; q++) {
            const TqPart *pt = &p->parts[q];
            const int64_t nb = (pt->n + 15) / 16, c = cut < nb ? cut : nb;
            for (int64_t s = 0; s < c; s++)
                out[t++] = (Share){pt, x + start[i] * K, qrows_at(xq, start[i], K), y + start[i] * ldy + off,
                                   count[i], K, ldy, nb * s / c, nb * (s + 1) / c};
            off += pt->n;
        }
    }
    return t;
}

static int run_shares(const Share *sh, int64_t n, int nthreads) {
    int err = 0;
    #pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads) if (n > 1)
    for (int64_t i = 0; i < n; i++) {
        const TqPart *p = sh[i].part;
        const QRows *q = &sh[i].xq;
        const int rc = p->layout == TQ_LAYOUT_raw
            ? (q->q ? tq_int8_raw_range(p->mode, q->q, q->d, q->s16, q->ds, sh[i].M, sh[i].K, p->codes, p->n,
                                        sh[i].b0, sh[i].b1, sh[i].y, sh[i].ldy) : -1)
            : tq_layout_family(p->layout) == TQ_INT
            ? (q->q ? tq_int8_range(p->layout, p->mode, q->q, q->d, q->s16, q->ds, sh[i].M, sh[i].K, p->codes,
                                    p->high, p->scale, p->bias, p->sup, p->n, sh[i].b0, sh[i].b1, sh[i].y, sh[i].ldy)
                    : -1)
            : tq_lanes_range(p->layout, p->mode, sh[i].x, sh[i].M, sh[i].K, p->codes, p->high, p->scale, p->bias,
                             p->sup, p->n, sh[i].b0, sh[i].b1, sh[i].y, sh[i].ldy);
        if (rc != 0) {
            #pragma omp atomic write
            err = -1;
        }
    }
    return err;
}

/* The n experts ex[i] (expert index ids[i], ascending) on the rows routed to them: for every (m, j) with
 * route[m k + j] == ids[i], slots[(m k + j) hid ...] = weights[m k + j] * down(act(gate(h_m)) * up(h_m)).
 * Each expert's product runs once over all its rows; the shares of every expert's gate|up run in one
 * parallel region, then the activation, then every down in one more. h: (M, hid); act: ACT_SILU or
 * ACT_GELU_TANH; scratch: >= R (2 hid + 3 I) floats, R the (m, j) routed to the n experts (models/native_moe.py
 * sizes it). Side effects: those slots, the scratch. 0, or -1 (a shape, memory, a layout without a range
 * kernel: nothing is meaningful in the slots then). */
int tq_moe_experts(const float *h, int64_t M, int64_t hid, int64_t I, int64_t k, const int64_t *route,
                   const float *weights, int64_t n, const int64_t *ids, const TqExpert *const *ex, int64_t act,
                   float *slots, float *scratch, int64_t scratch_floats, int nthreads) {
    if (hid % 16 || I % 16 || n <= 0 || M <= 0 || (act != ACT_SILU && act != ACT_GELU_TANH)) return -1;
    for (int64_t i = 0; i < n; i++)
        if (ex[i]->gate_up.n_out != 2 * I || ex[i]->down.n_out != hid || ex[i]->gate_up.bias || ex[i]->down.bias
            || (i && ids[i] <= ids[i - 1]))
            return -1;
    int64_t *count = calloc((size_t)n, sizeof *count), *start = malloc((size_t)(n + 1) * sizeof *start);
    int64_t *pos = malloc((size_t)(M * k) * sizeof *pos), *at = malloc((size_t)n * sizeof *at);
    Share *sh = NULL;
    float *xg;
    int rc = -1, any_int = 0;
    QRows qx = {NULL, NULL, NULL, NULL}, qa = qx;      /* the gathered rows' and SiLU * up's int8 form */
    for (int64_t i = 0; i < n; i++)
        for (int w = 0; w < 2; w++) {
            const TqProj *p = w ? &ex[i]->down : &ex[i]->gate_up;
            for (int64_t q = 0; q < p->nparts; q++) any_int |= tq_layout_int8(p->parts[q].layout);
        }
    if (any_int && (hid % 32 || I % 32)) goto out;
    if (!count || !start || !pos || !at) goto out;
    for (int64_t r = 0; r < M * k; r++) {                  /* rows per expert: ids ascending, a binary search */
        int64_t lo = 0, hi = n - 1, e = route[r];
        while (lo < hi) { int64_t mid = (lo + hi) / 2; if (ids[mid] < e) lo = mid + 1; else hi = mid; }
        if (ids[lo] == e) count[lo]++;
    }
    start[0] = 0;
    for (int64_t i = 0; i < n; i++) { start[i + 1] = start[i] + count[i]; at[i] = start[i]; }
    const int64_t R = start[n];
    for (int64_t r = 0; r < M * k; r++) {                  /* (m, j) of each gathered row, rows ascending */
        int64_t lo = 0, hi = n - 1, e = route[r];
        while (lo < hi) { int64_t mid = (lo + hi) / 2; if (ids[mid] < e) lo = mid + 1; else hi = mid; }
        if (ids[lo] == e) pos[at[lo]++] = r;
    }
    rc = 0;
    if (R == 0) goto out;
    int64_t maxparts = 0;
    for (int64_t i = 0; i < n; i++) maxparts += ex[i]->gate_up.nparts + ex[i]->down.nparts;
    sh = malloc((size_t)(maxparts * (4 * (int64_t)nthreads + 1)) * sizeof *sh);
    xg = scratch;
    qx = qrows_alloc(any_int, R, hid, &rc);
    qa = qrows_alloc(any_int, R, I, &rc);
    if (rc || !sh || scratch_floats < R * (2 * hid + 3 * I)) { rc = -1; goto out; }   /* rc: an allocation */
    float *gu = xg + R * hid, *a = gu + R * 2 * I, *y = a + R * I;
    const int par = R >= 64;         /* row loops: a parallel region costs more than a decode step's few rows */
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (par)
    for (int64_t r = 0; r < R; r++) memcpy(xg + r * hid, h + (pos[r] / k) * hid, (size_t)hid * sizeof(float));
    qrows_fill(&qx, xg, R, hid, par, nthreads);      /* once for every expert's gate|up (the int layouts') */
    rc = run_shares(sh, shares(ex, n, start, count, 0, xg, &qx, hid, gu, 2 * I, nthreads, sh), nthreads);
    if (rc) goto out;
    const int gelu = act == ACT_GELU_TANH;
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (par)
    for (int64_t r = 0; r < R; r++)
        for (int64_t c = 0; c < I; c += VN) {
            vf g = loadn(gu + r * 2 * I + c), u = loadn(gu + r * 2 * I + I + c);
            storen(a + r * I + c, gelu ? gelu_tanh_muln(g, u) : silu_muln(g, u));
        }
    qrows_fill(&qa, a, R, I, par, nthreads);
    rc = run_shares(sh, shares(ex, n, start, count, 1, a, &qa, I, y, hid, nthreads, sh), nthreads);
    if (rc) goto out;
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (par)
    for (int64_t r = 0; r < R; r++) {
        const float w = weights[pos[r]];
        float *dst = slots + pos[r] * hid;
        for (int64_t c = 0; c < hid; c++) dst[c] = y[r * hid + c] * w;
    }
out:
    free(count); free(start); free(pos); free(at); free(sh);
    qrows_free(&qx); qrows_free(&qa);
    return rc;
}

/* qwen2moe's shared expert, every row: out (M, hid) = sigmoid(h . gate) * down(SiLU(gate(h)) * up(h)); the
 * gate's dot product in VN-lane partial sums then hsumn (as the router's), sigmoid from our exp with its
 * argument <= 0. sh: its projections (gate|up (2 Is, hid), down (hid, Is)); scratch: >= M * 3 Is floats.
 * Side effects: out, scratch. 0, or -1 on a shape it does not take. */
int tq_moe_shared(const float *h, int64_t M, int64_t hid, const TqExpert *sh, const float *gate, float *out,
                  float *scratch, int nthreads) {
    const int64_t Is = sh->gate_up.n_out / 2;
    if (hid % 16 || Is % 16 || Is <= 0 || sh->down.n_out != hid || M <= 0) return -1;
    float *gu = scratch, *a = gu + M * 2 * Is;
    project(&sh->gate_up, h, M, hid, gu, nthreads);
    const int par = M >= 64;
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (par)
    for (int64_t r = 0; r < M; r++)
        for (int64_t c = 0; c < Is; c += VN)
            storen(a + r * Is + c, silu_muln(loadn(gu + r * 2 * Is + c), loadn(gu + r * 2 * Is + Is + c)));
    project(&sh->down, a, M, Is, out, nthreads);
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (par)
    for (int64_t r = 0; r < M; r++) {
        vf acc = splatn(0.0f);
        for (int64_t c = 0; c < hid; c += VN) acc = fman(loadn(h + r * hid + c), loadn(gate + c), acc);
        const float z = hsumn(acc);
        vf t = expn(splatn(z < 0.0f ? z : -z));              /* e^-|z| */
        const float e = t[0], g = z < 0.0f ? e / (1.0f + e) : 1.0f / (1.0f + e);
        for (int64_t c = 0; c < hid; c++) out[r * hid + c] *= g;
    }
    return 0;
}

/* x (M, hid) += the sum of each row's k slots (M, k, hid), added slot 0 first, then 1, ... (ascending expert
 * index [SUM-ORDER]), then the shared expert's row when there is one (shared (M, hid) or NULL):
 * x + (((s0 + s1) + s2 ...) + shared), the torch path's order. Side effect: x. */
void tq_moe_sum(float *x, const float *slots, const float *shared, int64_t M, int64_t k, int64_t hid, int nthreads) {
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (M >= 64)
    for (int64_t m = 0; m < M; m++)
        for (int64_t c = 0; c < hid; c++) {
            float s = slots[(m * k) * hid + c];
            for (int64_t j = 1; j < k; j++) s += slots[(m * k + j) * hid + c];
            if (shared) s += shared[m * hid + c];
            x[m * hid + c] += s;
        }
}
