/* GGML blocks -> the lanes layouts (models/qweight.py, kernels/qlanes.c), in C: the bits of
 * qweight.to_lanes(qweight.from_gguf(raw, qtype, rows, cols)), field for field.
 *
 * Why: a streamed expert (models/moe.py StreamedExperts) is converted on every cache miss. In
 * Python/torch that conversion took 31-39 ms of a 3 MB Qwen3 expert's ~57 ms miss (from_gguf's
 * unpacking and to_lanes' interleaving copies: ~0.08 GB/s), 6-14x the cost of reading the bytes
 * (benchmarks/results/moe-capped). The work is a memory-bound shuffle: read a block's fields, write
 * them to their lanes. Plain C but for [GATHER] (AVX-512 or AVX2 gathers for the K-quants' int codes; the plain
 * C path elsewhere): it builds for AVX-512, AVX2 and baseline x86-64 with the same bits.
 *
 * What is written (N rows a multiple of 16, block b = rows 16b..16b+15, lane j = row 16b + j; see
 * qlanes.c for the layouts; K the inputs a row):
 *   codes  q4x16 (N/16, K/2, 16): [b][p][j] = code(16b+j, 2p) & 15 | (code(16b+j, 2p+1) & 15) << 4
 *          q5x16: the same nibbles, high (N/16, K, 2): bit (j % 8) of byte [b][k][j / 8] = bit 4 of code(16b+j, k)
 *          q8x16, q6x16 (N/16, K, 16): [b][k][j] = code(16b+j, k)
 *   scale  (N/16, groups, 16): "k" Q4_K/Q5_K's uint8 sub-scale sc; "k6" Q6_K's int8 sc; "f16s"/"f16"
 *          GGML's fp16 d, its bits as they are (an fp16 -> fp32 -> fp16 round trip: the same bits for
 *          every finite value, which is when those modes are chosen)
 *   bias   "k": uint8 sub-min m, like scale; "f16": fp16 m; "f16s" and "k6": nothing here (the caller's
 *          constant / none)
 *   sup    "k": (N/16, K/256, 2, 16) fp16 d, dmin; "k6": (N/16, K/256, 16) fp16 d
 * The codes each type gets (qweight.py's converters): Q4_0/Q4_1 nibbles; Q5_0/Q5_1 nibble | qh bit << 4;
 * Q8_0 int8 q + 128 (q's byte with the top bit flipped); Q4_K/Q5_K as GGML's sub-blocks of 32 hold them;
 * Q6_K 0..63 (ql nibble | qh 2 bits << 4), the -32 left to the kernel.
 *
 * The scale mode is the caller's decision (qconvert.py): the K-quants' own always; for Q4_0/Q5_0/Q8_0
 * ("f16s") and Q4_1/Q5_1 ("f16") only when every fp16 d (and m) of the whole matrix is finite, as
 * qweight._scale_mode decides (tq_convert_finite says; otherwise the Python path's "f32" applies).
 *
 * tq_convert_int writes the int layouts instead (qint8.c; models/qweight.py to_int8's bits).
 *
 * Rows may be gathered (`order`: output row r is source row order[r]): the loader's q/k permutations
 * and fused-matrix splits take whole rows, and a row's blocks convert alone.
 */
#include <stdint.h>
#include <stdlib.h>
#include <limits.h>
#include <string.h>
#include <omp.h>

#define BLK 16          /* rows a lanes block */

/* GGML type numbers (gguf's GGMLQuantizationType) */
enum { T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14 };

typedef struct {
    int block;          /* inputs a GGML block */
    int size;           /* bytes a GGML block */
    int group;          /* inputs a scale group in the lanes layout */
    int nibbles;        /* codes packed two a byte (q4x16, q5x16) */
    int has_high;       /* q5x16's fifth bits */
} TypeInfo;

static int type_info(int qtype, TypeInfo *t) {
    switch (qtype) {
    case T_Q4_0: *t = (TypeInfo){32, 18, 32, 1, 0}; return 0;
    case T_Q4_1: *t = (TypeInfo){32, 20, 32, 1, 0}; return 0;
    case T_Q5_0: *t = (TypeInfo){32, 22, 32, 1, 1}; return 0;
    case T_Q5_1: *t = (TypeInfo){32, 24, 32, 1, 1}; return 0;
    case T_Q8_0: *t = (TypeInfo){32, 34, 32, 0, 0}; return 0;
    case T_Q4_K: *t = (TypeInfo){256, 144, 32, 1, 0}; return 0;
    case T_Q5_K: *t = (TypeInfo){256, 176, 32, 1, 1}; return 0;
    case T_Q6_K: *t = (TypeInfo){256, 210, 16, 0, 0}; return 0;
    default: return -1;
    }
}

static inline uint16_t rd16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }
static inline int f16_finite(uint16_t h) { return (h & 0x7C00) != 0x7C00; }

/* Q4_K / Q5_K: 12 bytes -> 8 six-bit scales and 8 six-bit mins (ggml_blocks._k_scales_mins). */
static inline void k_scales_mins(const uint8_t *p, uint8_t sc[8], uint8_t mn[8]) {
    for (int i = 0; i < 4; i++) {
        sc[i] = p[i] & 0x3F;
        mn[i] = p[4 + i] & 0x3F;
        sc[4 + i] = (uint8_t)((p[8 + i] & 0x0F) | ((p[i] >> 2) & 0x30));
        mn[4 + i] = (uint8_t)((p[8 + i] >> 4) | ((p[4 + i] >> 2) & 0x30));
    }
}

/* One GGML row (cols / block blocks at `src`) -> its codes c[0..cols) (c NULL: the K-quants' codes are not
 * wanted, [GATHER] writes them) and, at lane j of block-row `lane_base` (the address of [b][0][j] in each field,
 * element stride BLK), its scale, bias and sup. */
static void row(int qtype, const TypeInfo *t, const uint8_t *src, int64_t cols, uint8_t *c,
                uint8_t *scale, uint8_t *bias, uint16_t *sup) {
    const int64_t nblk = cols / t->block;
    for (int64_t k = 0; k < nblk; k++) {
        const uint8_t *b = src + k * t->size;
        uint8_t *q = c ? c + k * t->block : NULL;
        switch (qtype) {
        case T_Q4_0: case T_Q4_1: {
            const uint8_t *qs = b + (qtype == T_Q4_0 ? 2 : 4);
            for (int i = 0; i < 16; i++) { q[i] = qs[i] & 0x0F; q[i + 16] = qs[i] >> 4; }
            ((uint16_t *)scale)[k * BLK] = rd16(b);
            if (qtype == T_Q4_1) ((uint16_t *)bias)[k * BLK] = rd16(b + 2);
            break;
        }
        case T_Q5_0: case T_Q5_1: {
            const uint8_t *qh = b + (qtype == T_Q5_0 ? 2 : 4), *qs = qh + 4;
            for (int i = 0; i < 16; i++) { q[i] = qs[i] & 0x0F; q[i + 16] = qs[i] >> 4; }
            for (int i = 0; i < 32; i++) q[i] |= (uint8_t)(((qh[i >> 3] >> (i & 7)) & 1) << 4);
            ((uint16_t *)scale)[k * BLK] = rd16(b);
            if (qtype == T_Q5_1) ((uint16_t *)bias)[k * BLK] = rd16(b + 2);
            break;
        }
        case T_Q8_0:
            for (int i = 0; i < 32; i++) q[i] = b[2 + i] ^ 0x80;
            ((uint16_t *)scale)[k * BLK] = rd16(b);
            break;
        case T_Q4_K: case T_Q5_K: {
            uint8_t sc[8], mn[8];
            k_scales_mins(b + 4, sc, mn);
            const uint8_t *qs = b + (qtype == T_Q4_K ? 16 : 48), *qh = b + 16;
            for (int s = 0; s < 8; s++) {           /* sub-block s: byte run s/2, nibble s%2 */
                const uint8_t *run = qs + (s >> 1) * 32;
                const int sh = (s & 1) * 4;
                scale[(k * 8 + s) * BLK] = sc[s];
                bias[(k * 8 + s) * BLK] = mn[s];
                if (!c) continue;
                for (int l = 0; l < 32; l++) q[s * 32 + l] = (run[l] >> sh) & 0x0F;
                if (qtype == T_Q5_K)
                    for (int l = 0; l < 32; l++) q[s * 32 + l] |= (uint8_t)(((qh[l] >> s) & 1) << 4);
            }
            sup[(k * 2) * BLK] = rd16(b);           /* (K/256, 2, 16): d, then dmin */
            sup[(k * 2 + 1) * BLK] = rd16(b + 2);
            break;
        }
        case T_Q6_K: {
            /* code i = 128 h + 32 g + l: the low nibble of ql[64 h + 32 (g & 1) + l] (its high nibble for
             * g >= 2), bits 2g, 2g+1 of qh[32 h + l]. Runs of 32 with constant shifts: the compiler
             * vectorizes them (one index expression per code ran ~14 cycles a weight, a streamed Q6_K
             * expert's conversion 10x its Q4_K matrices': benchmarks/RESULTS.md, issue 49). */
            const uint8_t *ql = b, *qh = b + 128;
            for (int h = 0; h < 2 && c; h++)
                for (int g = 0; g < 4; g++) {
                    const uint8_t *lq = ql + h * 64 + (g & 1) * 32, *hq = qh + h * 32;
                    const int ls = (g >> 1) * 4, hs = g * 2;
                    uint8_t *o = q + h * 128 + g * 32;
                    for (int l = 0; l < 32; l++)
                        o[l] = (uint8_t)(((lq[l] >> ls) & 0x0F) | (((hq[l] >> hs) & 0x03) << 4));
                }
            for (int s = 0; s < 16; s++) scale[(k * 16 + s) * BLK] = b[192 + s];
            sup[k * BLK] = rd16(b + 208);
            break;
        }
        }
    }
}

/* 1 when every fp16 d (and Q4_1/Q5_1's m) of `nblocks` blocks at `src` is finite (the modes "f16s" /
 * "f16" apply), else 0; -1 for a type not covered. The K-quants: always 1 (their mode is their own). */
int tq_convert_finite(int qtype, const uint8_t *src, int64_t nblocks) {
    TypeInfo t;
    if (type_info(qtype, &t)) return -1;
    if (qtype == T_Q4_K || qtype == T_Q5_K || qtype == T_Q6_K) return 1;
    const int two = qtype == T_Q4_1 || qtype == T_Q5_1;
    for (int64_t i = 0; i < nblocks; i++) {
        const uint8_t *b = src + i * t.size;
        if (!f16_finite(rd16(b)) || (two && !f16_finite(rd16(b + 2)))) return 0;
    }
    return 1;
}

/* 16 rows' codes c (row-major, 16 x cols) -> their int layout (qint8.c's top comment; models/qweight.py
 * to_int8 is the reference): out one block's codes, high its high bits (i5x16, i6x16) or NULL.
 * Every output unit is one lane's 4 bytes, made from 4-byte words of that lane's codes (SWAR on
 * little-endian words, byte b of a word = code b; memcpy for the unaligned loads and stores): a lane at a
 * time, its codes read in order. The per-byte loops with strided reads this replaced ran ~2 GB/s, most of
 * a streamed expert's miss (benchmarks/RESULTS.md, issue 49). */
static inline uint32_t ld32(const uint8_t *p) { uint32_t w; memcpy(&w, p, 4); return w; }
static inline void st32(uint8_t *p, uint32_t w) { memcpy(p, &w, 4); }

static void int_codes(int qtype, const uint8_t *c, int64_t cols, uint8_t *out, uint8_t *high) {
    for (int j = 0; j < BLK; j++) {
        const uint8_t *cj = c + j * cols;
        if (qtype == T_Q8_0) {                               /* i8x16: quad t, lane j, byte i = code 4t + i */
            for (int64_t t = 0; t < cols / 4; t++) st32(out + (t * BLK + j) * 4, ld32(cj + 4 * t));
            continue;
        }
        for (int64_t o = 0; o < cols / 8; o++)               /* octet o: low nibble 8o + i, high 8o + 4 + i */
            st32(out + (o * BLK + j) * 4,
                 (ld32(cj + 8 * o) & 0x0F0F0F0Fu) | (ld32(cj + 8 * o + 4) & 0x0F0F0F0Fu) << 4);
        if (qtype == T_Q5_0 || qtype == T_Q5_1 || qtype == T_Q5_K) {   /* bit s: bit 4 of code 32g + 4s + i */
            for (int64_t g = 0; g < cols / 32; g++) {
                uint32_t v = 0;
                for (int s = 0; s < 8; s++) v |= ((ld32(cj + 32 * g + 4 * s) >> 4) & 0x01010101u) << s;
                st32(high + (g * BLK + j) * 4, v);
            }
        } else if (qtype == T_Q6_K) {                        /* bits 2s, 2s+1: bits 4-5 of code 16h + 4s + i */
            for (int64_t h = 0; h < cols / 16; h++) {
                uint32_t v = 0;
                for (int s = 0; s < 4; s++) v |= ((ld32(cj + 16 * h + 4 * s) >> 4) & 0x03030303u) << (2 * s);
                st32(high + (h * BLK + j) * 4, v);
            }
        }
    }
}

/* [GATHER] Q4_K / Q6_K codes straight from the GGML blocks into the int layout (i4x16's codes; i6x16's codes
 * and high bits), with vector gathers: each output unit is lane j's 4-byte word, and the 16 lanes' words of one
 * unit sit at the same offset in 16 rows' blocks, so one gather of 16 (AVX-512; two of 8 with AVX2) loads a
 * unit's 4 source bytes of every lane, a shift and a mask pick the nibbles (or 2-bit fields), and the 64 output
 * bytes are one store. No row-major codes in between. Why: a streamed expert's miss converted at ~0.25 ms a
 * 768 x 2048 Q4_K slab through `row` + `int_codes` (a byte loop, then a lane loop with 64-byte strided
 * stores), 3.2 s of an 11.6 s turn 2 on the capped 30B benchmark (issue 49). Same words as `int_codes` of
 * `row`'s codes, by the derivation in each loop's comment; tests/test_qconvert.py checks the bits.
 * off: the 16 rows' byte offsets from src (each < 2^31: the caller checks). */
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#if defined(__AVX512F__)
typedef __m512i vq;
#define VQ_GATHER(base, idx) _mm512_i32gather_epi32((idx), (const void *)(base), 1)
#define VQ_SET1(x) _mm512_set1_epi32((int)(x))
#define VQ_AND _mm512_and_si512
#define VQ_OR _mm512_or_si512
#define VQ_SRL(v, n) _mm512_srl_epi32((v), _mm_cvtsi32_si128(n))
#define VQ_SLL(v, n) _mm512_sll_epi32((v), _mm_cvtsi32_si128(n))
#define VQ_STORE(p, v) _mm512_storeu_si512((void *)(p), (v))
#define VQ_LOADIDX(p) _mm512_loadu_si512((const void *)(p))
#define VQ_ZERO _mm512_setzero_si512()
#define VQ_LANES 16
#else
typedef __m256i vq;
#define VQ_GATHER(base, idx) _mm256_i32gather_epi32((const int *)(base), (idx), 1)
#define VQ_SET1(x) _mm256_set1_epi32((int)(x))
#define VQ_AND _mm256_and_si256
#define VQ_OR _mm256_or_si256
#define VQ_SRL(v, n) _mm256_srl_epi32((v), _mm_cvtsi32_si128(n))
#define VQ_SLL(v, n) _mm256_sll_epi32((v), _mm_cvtsi32_si128(n))
#define VQ_STORE(p, v) _mm256_storeu_si256((__m256i *)(p), (v))
#define VQ_LOADIDX(p) _mm256_loadu_si256((const __m256i *)(p))
#define VQ_ZERO _mm256_setzero_si256()
#define VQ_LANES 8
#endif
#define HAVE_GATHER 1
#define PREFETCH_BLOCKS 2   /* GGML blocks a row ahead that [GATHER] asks the cache for */

static void int_codes_gather(int qtype, const uint8_t *src, const int32_t off[BLK], int64_t cols, uint8_t *out,
                             uint8_t *high) {
    const int size = qtype == T_Q4_K ? 144 : 210;
    const vq m4 = VQ_SET1(0x0F0F0F0Fu), m2 = VQ_SET1(0x03030303u);
    for (int half = 0; half < BLK / VQ_LANES; half++) {             /* lanes [half * VQ_LANES, +VQ_LANES) */
        const vq idx = VQ_LOADIDX(off + half * VQ_LANES);
        uint8_t *o_base = out + half * VQ_LANES * 4, *h_base = high ? high + half * VQ_LANES * 4 : NULL;
        for (int64_t k = 0; k < cols / 256; k++) {
            const uint8_t *b = src + k * size;
            if (k + PREFETCH_BLOCKS < cols / 256)      /* the gathers wait for their slowest line: fetch ahead */
                for (int j = 0; j < VQ_LANES; j++)
                    for (int l = 0; l < size; l += 64)
                        _mm_prefetch((const char *)b + off[half * VQ_LANES + j] + PREFETCH_BLOCKS * size + l,
                                     _MM_HINT_T0);
            for (int o = 0; o < 32; o++) {
                /* octet o of the block: codes 8o..8o+7, one run of 8 bytes of one nibble:
                 * Q4_K: sub-block s = o / 4 in qs (= b + 16) run s / 2, nibble s % 2, bytes 8 (o % 4) ..;
                 * Q6_K: code 128 h + 32 g + l is ql[64 h + 32 (g % 2) + l]'s nibble g / 2 (low bits) */
                int a, sh;
                if (qtype == T_Q4_K) {
                    const int s = o >> 2;
                    a = 16 + (s >> 1) * 32 + (o & 3) * 8;
                    sh = (s & 1) * 4;
                } else {
                    const int i = o * 8, h = i >> 7, g = (i & 127) >> 5;
                    a = 64 * h + 32 * (g & 1) + (i & 31);
                    sh = (g >> 1) * 4;
                }
                const vq lo = VQ_AND(VQ_SRL(VQ_GATHER(b + a, idx), sh), m4);
                const vq hi = VQ_AND(VQ_SRL(VQ_GATHER(b + a + 4, idx), sh), m4);
                VQ_STORE(o_base + (k * 32 + o) * BLK * 4, VQ_OR(lo, VQ_SLL(hi, 4)));
            }
            if (qtype != T_Q6_K) continue;
            for (int u = 0; u < 16; u++) {
                /* codes 16u..16u+15 of the block: their bits 4-5 are qh[32 h + l] >> 2 g (l = 16u % 32 + 4 s + i);
                 * unit u's byte i holds code 16u + 4s + i's pair at bits 2s, 2s+1 */
                const int i = u * 16, h = i >> 7, g = (i & 127) >> 5;
                const uint8_t *q = b + 128 + 32 * h + (i & 31);
                vq v = VQ_ZERO;
                for (int s4 = 0; s4 < 4; s4++)
                    v = VQ_OR(v, VQ_SLL(VQ_AND(VQ_SRL(VQ_GATHER(q + 4 * s4, idx), 2 * g), m2), 2 * s4));
                VQ_STORE(h_base + (k * 16 + u) * BLK * 4, v);
            }
        }
    }
}
#endif

/* One block of 16 rows -> every field's block (the top of the file): src + off[j] is row j's GGML bytes;
 * codes, high, scale, bias, sup: the block's first element of each field (high, bias, sup NULL where the
 * layout or mode has none); c: 16 x cols bytes of work for the row-major codes, or NULL with `gather`
 * ([GATHER]: the K-quant int codes straight from the blocks). No allocation, no threads: convert's body,
 * and tq_convert_int_block's ([RAW] in qint8.c, a streamed expert's block converted where it is multiplied). */
static void convert_block(int as_int, int qtype, const TypeInfo *t, int gather, const uint8_t *src,
                          const int64_t off[BLK], int64_t cols, uint8_t *c, uint8_t *codes, uint8_t *high,
                          uint8_t *scale, uint8_t *bias, uint16_t *sup) {
    const int ksz = (qtype == T_Q4_K || qtype == T_Q5_K || qtype == T_Q6_K) ? 1 : 2;
    for (int j = 0; j < BLK; j++)
        row(qtype, t, src + off[j], cols, c ? c + j * cols : NULL, scale + j * ksz, bias ? bias + j * ksz : NULL,
            sup ? sup + j : NULL);
#ifdef HAVE_GATHER
    if (gather) {
        int32_t o32[BLK];
        for (int j = 0; j < BLK; j++) o32[j] = (int32_t)off[j];
        int_codes_gather(qtype, src, o32, cols, codes, high);
        return;
    }
#endif
    (void)gather;
    if (as_int) {
        int_codes(qtype, c, cols, codes, high);
        return;
    }
    if (t->nibbles) {
        for (int64_t p = 0; p < cols / 2; p++)
            for (int j = 0; j < BLK; j++)
                codes[p * BLK + j] = (uint8_t)((c[j * cols + 2 * p] & 0x0F) | ((c[j * cols + 2 * p + 1] & 0x0F) << 4));
    } else {
        for (int64_t i = 0; i < cols; i++)
            for (int j = 0; j < BLK; j++) codes[i * BLK + j] = c[j * cols + i];
    }
    if (t->has_high) {
        for (int64_t i = 0; i < cols; i++) {
            uint8_t lo = 0, hi = 0;
            for (int j = 0; j < 8; j++) {
                lo |= (uint8_t)(((c[j * cols + i] >> 4) & 1) << j);
                hi |= (uint8_t)(((c[(j + 8) * cols + i] >> 4) & 1) << j);
            }
            high[2 * i] = lo;
            high[2 * i + 1] = hi;
        }
    }
}

/* Elements a block of 16 rows takes in each field (int: the int layout's codes and high bits). */
typedef struct {
    int64_t codes, high, scale, sup;    /* bytes: codes, high; elements: scale and bias (ksz bytes), sup (fp16) */
} BlockSizes;

static BlockSizes block_sizes(int as_int, int qtype, const TypeInfo *t, int64_t cols) {
    const int64_t code_w = t->nibbles || (as_int && qtype == T_Q6_K) ? cols / 2 : cols;   /* bytes a lane */
    int64_t high_w = 0;
    if (as_int) high_w = qtype == T_Q6_K ? cols / 4 : t->has_high ? cols / 8 : 0;
    else high_w = t->has_high ? cols * 2 / BLK : 0;
    const int k = qtype == T_Q4_K || qtype == T_Q5_K;
    return (BlockSizes){code_w * BLK, high_w * BLK, cols / t->group * BLK,
                        qtype == T_Q6_K ? cols / 256 * BLK : k ? cols / 256 * 2 * BLK : 0};
}

/* rows x cols GGML blocks -> lanes fields (the top of the file); with as_int the int layout's codes and
 * high bits instead (the same scale, bias and sup fields: the int layouts share them). src: the source matrix, src_rows rows
 * of cols / block blocks; order: NULL (output row r = source row r) or rows int64 source rows. The
 * caller allocates every field (scale/bias/sup per the type's mode; bias, high, sup NULL where the
 * mode has none). Returns 0, or -1 for a type not covered, -2 for a shape (rows % 16, cols % block, an
 * order index out of range), -3 when out of memory. Threads split the blocks of 16 rows. */
static int convert(int as_int, int qtype, const uint8_t *src, int64_t src_rows, const int64_t *order, int64_t rows,
                   int64_t cols, uint8_t *codes, uint8_t *high, uint8_t *scale, uint8_t *bias, uint16_t *sup,
                   int nthreads) {
    TypeInfo t;
    if (type_info(qtype, &t)) return -1;
    if (rows % BLK || cols <= 0 || cols % t.block) return -2;
    if (order)
        for (int64_t r = 0; r < rows; r++)
            if (order[r] < 0 || order[r] >= src_rows) return -2;
    const int64_t nb = rows / BLK, row_bytes = cols / t.block * t.size;
    const int ksz = (qtype == T_Q4_K || qtype == T_Q5_K || qtype == T_Q6_K) ? 1 : 2;
    const BlockSizes z = block_sizes(as_int, qtype, &t, cols);
    int gather = 0;                    /* [GATHER]: the K-quant int codes without row-major codes */
#ifdef HAVE_GATHER
    gather = as_int && (qtype == T_Q4_K || qtype == T_Q6_K) && src_rows * row_bytes <= INT32_MAX;
#endif
    int err = 0;
    #pragma omp parallel num_threads(nthreads > 0 ? nthreads : 1) if (nb > 1 && nthreads > 1)
    {
        uint8_t *c = gather ? NULL : malloc((size_t)(BLK * cols));     /* 16 rows' codes, row-major */
        if (!c && !gather) {
            #pragma omp atomic write
            err = -3;
        }
        #pragma omp for schedule(static)
        for (int64_t b = 0; b < nb; b++) {
            if (!c && !gather) continue;
            int64_t off[BLK];
            for (int j = 0; j < BLK; j++) off[j] = (order ? order[b * BLK + j] : b * BLK + j) * row_bytes;
            convert_block(as_int, qtype, &t, gather, src, off, cols, c, codes + b * z.codes,
                          high ? high + b * z.high : NULL, scale + b * z.scale * ksz,
                          bias ? bias + b * z.scale * ksz : NULL, sup ? sup + b * z.sup : NULL);
        }
        free(c);
    }
    return err;
}

int tq_convert_lanes(int qtype, const uint8_t *src, int64_t src_rows, const int64_t *order, int64_t rows,
                     int64_t cols, uint8_t *codes, uint8_t *high, uint8_t *scale, uint8_t *bias, uint16_t *sup,
                     int nthreads) {
    return convert(0, qtype, src, src_rows, order, rows, cols, codes, high, scale, bias, sup, nthreads);
}

/* The same into the int layout (i4x16 / i5x16 / i8x16 / i6x16; high: i5x16 (N/16, K/32, 16, 4), i6x16
 * (N/16, K/16, 16, 4), else NULL): a streamed expert read straight into what qint8.c multiplies. */
int tq_convert_int(int qtype, const uint8_t *src, int64_t src_rows, const int64_t *order, int64_t rows,
                   int64_t cols, uint8_t *codes, uint8_t *high, uint8_t *scale, uint8_t *bias, uint16_t *sup,
                   int nthreads) {
    if (qtype == T_Q6_K && !high) return -2;
    return convert(1, qtype, src, src_rows, order, rows, cols, codes, high, scale, bias, sup, nthreads);
}

/* [RAW] One block of 16 consecutive rows of a Q4_K / Q5_K / Q6_K matrix (src: row 16b's bytes, `cols` inputs a
 * row) -> that block of the int layout's fields, exactly the block tq_convert_int writes for those rows (block b
 * of a whole conversion is its 16 rows' alone): codes (cols * 8 bytes), high (i5x16 cols * 2, i6x16 cols * 4, else
 * NULL), scale and bias (cols / group * 16 bytes; bias NULL for Q6_K), sup (fp16: Q4_K/Q5_K cols / 8, Q6_K cols / 16).
 * work: 16 * cols bytes (the row-major codes where [GATHER] does not apply; may be NULL where it does: Q4_K, Q6_K on
 * an AVX2 or AVX-512 build). No allocation, no threads: qint8.c's tq_int8_raw_range calls it from its own.
 * 0, or -1 for another type, -2 for a shape. */
int tq_convert_int_block(int qtype, const uint8_t *src, int64_t cols, uint8_t *codes, uint8_t *high,
                         uint8_t *scale, uint8_t *bias, uint16_t *sup, uint8_t *work) {
    TypeInfo t;
    if ((qtype != T_Q4_K && qtype != T_Q5_K && qtype != T_Q6_K) || type_info(qtype, &t)) return -1;
    if (cols <= 0 || cols % t.block || (qtype == T_Q6_K) != (bias == NULL) || (qtype != T_Q4_K) != (high != NULL))
        return -2;
    const int64_t row_bytes = cols / t.block * t.size;
    int gather = 0;
#ifdef HAVE_GATHER
    gather = (qtype == T_Q4_K || qtype == T_Q6_K) && BLK * row_bytes <= INT32_MAX;
#endif
    if (!gather && !work) return -2;
    int64_t off[BLK];
    for (int j = 0; j < BLK; j++) off[j] = j * row_bytes;
    convert_block(1, qtype, &t, gather, src, off, cols, gather ? NULL : work, codes, high, scale, bias, sup);
    return 0;
}
