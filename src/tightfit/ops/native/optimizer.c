/* Optimizer steps (ops/optimizer.py's reference, operation for operation in float32): with
 * 8-bit blockwise states, and (at the end) with float32 states.
 *
 * One optimizer step with 8-bit blockwise states (ops/optimizer.py's reference, operation for
 * operation in float32): for each block of 256 values, the gradient, the parameter (float32,
 * bfloat16 or float16) and the states (codes into a 256-entry map, times the block's absmax)
 * are read once into block-local float arrays; the rule updates them there; each new state
 * is coded again with its new absmax (nearest map entry, by the quantizer's one-lookup search
 * table: numba's _kernels_blockwise.code_of, rounded the same way), and the parameter written
 * back. Each loop works on a few local arrays the compiler knows apart, so it vectorizes
 * (gathers included); memory is read and written once. The caller (Python) has checked
 * every length and that each map's table needs one lookup a value.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "dtypes.h"

#define BLOCK 256

enum { ADAM, ADEMAMIX, MOMENTUM, RMSPROP, ADAGRAD, LION }; /* ops/optimizer.OPTIMIZERS' order */

/* The constants, in _cpu_optimizer.CONSTANTS' order. */
typedef struct {
    float beta1, beta2, beta3, rest1, rest2, rest3, alpha, eps, decay, keep, lr, inv1, inv2, step_size, first;
} hyper;

static void load_block(const void *data, int64_t dtype, int64_t start, int64_t size, float *restrict out) {
    if (dtype == F32) {
        memcpy(out, (const float *)data + start, (size_t)size * sizeof(float));
    } else if (dtype == BF16) {
        const uint16_t *bits = (const uint16_t *)data + start;
        for (int64_t i = 0; i < size; i++) out[i] = as_float((uint32_t)bits[i] << 16);
    } else {
        const uint16_t *bits = (const uint16_t *)data + start;
        for (int64_t i = 0; i < size; i++) out[i] = half_to_float(bits[i]);
    }
}

static void store_block(void *data, int64_t dtype, int64_t start, int64_t size, const float *restrict in) {
    if (dtype == F32) {
        memcpy((float *)data + start, in, (size_t)size * sizeof(float));
        return;
    }
    for (int64_t i = 0; i < size; i++) store(data, (int)dtype, start + i, in[i]);
}

static void decode(const uint8_t *restrict codes, const float *restrict map, float scale, int64_t size,
                   float *restrict out) {
    for (int64_t i = 0; i < size; i++) out[i] = map[codes[i]] * scale;
}

/* The rules: each updates p and its states in place, as the reference's _step does. */
static void adam(int64_t n, float *restrict g, float *restrict p, float *restrict m, float *restrict v,
                 const hyper *h) {
    const float b1 = h->beta1, b2 = h->beta2, r1 = h->rest1, r2 = h->rest2, inv2 = h->inv2, eps = h->eps;
    const float keep = h->decay > 0 ? h->keep : 1.0f, size = h->step_size;
    const int decay = h->decay > 0;
    for (int64_t i = 0; i < n; i++) {
        float pi = decay ? p[i] * keep : p[i];
        m[i] = m[i] * b1 + g[i] * r1;
        v[i] = v[i] * b2 + (g[i] * g[i]) * r2;
        p[i] = pi + (m[i] / (sqrtf(v[i]) * inv2 + eps)) * size;
    }
}

static void ademamix(int64_t n, float *restrict g, float *restrict p, float *restrict m1, float *restrict m2,
                     float *restrict v, const hyper *h) {
    const int decay = h->decay > 0;
    for (int64_t i = 0; i < n; i++) {
        float pi = decay ? p[i] * h->keep : p[i];
        m1[i] = m1[i] * h->beta1 + g[i] * h->rest1;
        m2[i] = m2[i] * h->beta3 + g[i] * h->rest3;
        v[i] = v[i] * h->beta2 + (g[i] * g[i]) * h->rest2;
        float mixed = m1[i] * h->inv1 + m2[i] * h->alpha;
        p[i] = pi - (mixed / (sqrtf(v[i]) * h->inv2 + h->eps)) * h->lr;
    }
}

static void one_state(int rule, int64_t n, float *restrict g, float *restrict p, float *restrict s, const hyper *h) {
    const int decay = h->decay > 0;
    if (decay && rule != LION)
        for (int64_t i = 0; i < n; i++) g[i] = g[i] + p[i] * h->decay;
    if (rule == MOMENTUM) {
        const int first = h->first != 0;
        for (int64_t i = 0; i < n; i++) {
            s[i] = first ? g[i] : s[i] * h->beta1 + g[i];
            p[i] = p[i] - s[i] * h->lr;
        }
    } else if (rule == RMSPROP) {
        for (int64_t i = 0; i < n; i++) {
            s[i] = s[i] * h->beta1 + (g[i] * g[i]) * h->rest1;
            p[i] = p[i] - (g[i] / (sqrtf(s[i]) + h->eps)) * h->lr;
        }
    } else if (rule == ADAGRAD) {
        for (int64_t i = 0; i < n; i++) {
            s[i] = s[i] + g[i] * g[i];
            p[i] = p[i] - (g[i] / (sqrtf(s[i]) + h->eps)) * h->lr;
        }
    } else { /* LION: decay shrinks p, the sign of the mix moves it (0 for 0 and NaN) */
        for (int64_t i = 0; i < n; i++) {
            float pi = decay ? p[i] * h->keep : p[i];
            float mixed = s[i] * h->beta1 + g[i] * h->rest1;
            float direction = (float)(mixed > 0) - (float)(mixed < 0);
            s[i] = s[i] * h->beta2 + g[i] * h->rest2;
            p[i] = pi - direction * h->lr;
        }
    }
}

/* Order-preserving 32-bit keys of floats (numba's code_of computes the same): the keys of -1
 * and 1, and of the positive quiet NaN that a NaN value scales to. */
#define KEY_MINUS_ONE 0x407FFFFFu
#define KEY_ONE 0xBF800000u
#define KEY_NAN 0xFFC00000u

/* The codes of ``size`` scaled values (times ``factor``, or divided by it): each clamped to
 * [-1, 1] as the reference clamps it, NaN taken as the positive quiet NaN (it sorts last),
 * then the search table's one lookup. Written on the keys, with integer masks rather than
 * branches, so that the loop vectorizes (a float select kept it scalar). */
static void code_values(const float *restrict values, int64_t size, float factor, int divide,
                        const uint32_t *restrict table, uint8_t *restrict codes) {
    for (int64_t i = 0; i < size; i++) {
        uint32_t bits = bits_of(divide ? values[i] / factor : values[i] * factor);
        uint32_t nan = 0u - (uint32_t)((bits & 0x7FFFFFFFu) > 0x7F800000u);
        uint32_t key = bits ^ (0x80000000u | (0u - (bits >> 31)));
        key = key < KEY_MINUS_ONE ? KEY_MINUS_ONE : key;
        key = key > KEY_ONE ? KEY_ONE : key;
        key = (key & ~nan) | (KEY_NAN & nan);
        uint32_t entry = table[key >> 16];
        uint32_t above = (key & 0xFFFFu) > (entry & 0xFFFFu);
        codes[i] = (uint8_t)(entry >> (16u + 8u * above));
    }
}

/* A block's new state coded: its absmax (the largest |value|; NaN where one is NaN; clamped
 * in a partial block), then each value times the reciprocal (divided, in a partial block). */
static void quantize(const float *restrict values, int64_t size, const uint32_t *restrict table,
                     uint8_t *restrict codes, float *absmax) {
    uint32_t peak = 0;
    for (int64_t i = 0; i < size; i++) {
        uint32_t magnitude = bits_of(values[i]) & 0x7FFFFFFFu;
        peak = magnitude > peak ? magnitude : peak;
    }
    const int full = size == BLOCK;
    float factor;
    if (peak > 0x7F800000u) {
        *absmax = __builtin_nanf("");
        factor = __builtin_nanf("");
    } else {
        float largest = as_float(peak), clamped = largest > 1e-38f ? largest : 1e-38f;
        *absmax = full ? largest : clamped;
        factor = full ? 1.0f / clamped : clamped;
    }
    if (full) code_values(values, size, factor, 0, table, codes);
    else code_values(values, size, factor, 1, table, codes);
}

void tf_optimizer_8bit(int64_t rule, const void *g, int64_t g_dtype, void *p, int64_t p_dtype, uint8_t *c0,
                       uint8_t *c1, uint8_t *c2, float *a0, float *a1, float *a2, const float *m0, const float *m1,
                       const float *m2, const uint32_t *t0, const uint32_t *t1, const uint32_t *t2, int64_t n,
                       const float *constants, int64_t threads) {
    hyper h;
    memcpy(&h, constants, sizeof h);
    const int64_t blocks = (n + BLOCK - 1) / BLOCK;
    const int count = rule == ADEMAMIX ? 3 : (rule == ADAM ? 2 : 1);
#pragma omp parallel for num_threads((int)threads) schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        float gf[BLOCK], pf[BLOCK], s0[BLOCK], s1[BLOCK], s2[BLOCK];
        const int64_t start = b * BLOCK, size = n - start < BLOCK ? n - start : BLOCK;
        load_block(g, g_dtype, start, size, gf);
        load_block(p, p_dtype, start, size, pf);
        decode(c0 + start, m0, a0[b], size, s0);
        if (count > 1) decode(c1 + start, m1, a1[b], size, s1);
        if (count > 2) decode(c2 + start, m2, a2[b], size, s2);
        if (rule == ADAM) adam(size, gf, pf, s0, s1, &h);
        else if (rule == ADEMAMIX) ademamix(size, gf, pf, s0, s1, s2, &h);
        else one_state((int)rule, size, gf, pf, s0, &h);
        quantize(s0, size, t0, c0 + start, &a0[b]);
        if (count > 1) quantize(s1, size, t1, c1 + start, &a1[b]);
        if (count > 2) quantize(s2, size, t2, c2 + start, &a2[b]);
        store_block(p, p_dtype, start, size, pf);
    }
}

/* One step with float32 states, updated in place: the gradient and the parameter through
 * block-local float arrays (their dtype widened and rounded back), the rule as above. */
void tf_optimizer_32bit(int64_t rule, const void *g, int64_t g_dtype, void *p, int64_t p_dtype, float *s0, float *s1,
                        float *s2, int64_t n, const float *constants, int64_t threads) {
    hyper h;
    memcpy(&h, constants, sizeof h);
    const int64_t blocks = (n + BLOCK - 1) / BLOCK;
#pragma omp parallel for num_threads((int)threads) schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        float gf[BLOCK], pf[BLOCK];
        const int64_t start = b * BLOCK, size = n - start < BLOCK ? n - start : BLOCK;
        load_block(g, g_dtype, start, size, gf);
        load_block(p, p_dtype, start, size, pf);
        if (rule == ADAM) adam(size, gf, pf, s0 + start, s1 + start, &h);
        else if (rule == ADEMAMIX) ademamix(size, gf, pf, s0 + start, s1 + start, s2 + start, &h);
        else one_state((int)rule, size, gf, pf, s0 + start, &h);
        store_block(p, p_dtype, start, size, pf);
    }
}
