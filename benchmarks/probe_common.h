/* Shared by the design probes (digits_probe.c, lanes_probe.c): their random data, timing and the
 * matrix shapes they run. Not part of the product. */
#ifndef TERNLM_PROBE_COMMON_H
#define TERNLM_PROBE_COMMON_H
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static uint64_t rs = 88172645463325252ull;     /* xorshift: the same data every run */
static uint64_t rnd(void) { rs ^= rs << 13; rs ^= rs >> 7; rs ^= rs << 17; return rs; }
static float frand(void) { return (float)((rnd() >> 11) * (1.0 / 9007199254740992.0)) * 2.0f - 1.0f; }
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
static int cmpd(const void *a, const void *b) { double x = *(const double *)a, y = *(const double *)b; return (x > y) - (x < y); }

/* (N, K) of smollm2-135m's and qwen2.5-0.5b's projections */
#define NSHAPES 6
static const int64_t SHAPES[NSHAPES][2] = {{576, 576}, {1536, 576}, {576, 1536}, {896, 896}, {4864, 896}, {896, 4864}};
static const char *const NAMES[NSHAPES] = {"smollm2 q/o 576x576", "smollm2 gate/up 1536x576", "smollm2 down 576x1536",
                                           "qwen q/o 896x896", "qwen gate/up 4864x896", "qwen down 896x4864"};

/* A random Q4_0 matrix (codes (N, K/2) in GGML's layout, fp16 d per group of 32) and n activations of
 * mixed magnitudes. */
static void random_q4_0(uint8_t *codes, uint16_t *d, int64_t N, int64_t K) {
    for (int64_t i = 0; i < N * K / 2; i++) codes[i] = (uint8_t)rnd();
    for (int64_t i = 0; i < N * (K / 32); i++) {
        _Float16 h = (_Float16)(0.01f + 0.02f * (float)(rnd() % 1000) / 1000.0f);
        memcpy(&d[i], &h, 2);
    }
}
static void random_x(float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) x[i] = frand() * ldexpf(1.0f, (int)(rnd() % 6) - 3);
}

/* Q4_0 code (0..15) of element (n, k): byte j of a group holds element j (low nibble) and j + 16 (high) */
static int q4_code(const uint8_t *codes, int64_t K, int64_t n, int64_t k) {
    const uint8_t *row = codes + n * (K / 2) + 16 * (k / 32);
    int e = (int)(k % 32);
    return e < 16 ? row[e] & 15 : row[e - 16] >> 4;
}
#endif
