/* 8-bit blockwise matmuls with int8 activations (the "int8" compute choice of 8-bit layers):
 * activations are quantized per block of 32 along K (int8_acts.h), the 256-entry code map is
 * rounded to int16 levels (table16 = round(code * 32767 / max|code|), passed in with
 * unit = max|code| / 32767), and codes meet activations in integer dot products, exact over
 * each step, then scaled in float32. Decoding an 8-bit code to a float32 weight took the
 * float kernel (gemv_blockwise.c) four byte lookups and four unpacks; here it takes two and
 * one, and the products are summed in integers, as llama.cpp's Q8_0 x Q8_0 does.
 *
 * What it computes (the op's reference, tightfit.ops.blockwise_gemv_int8, is the spec):
 *   out[m, n] = sum_k q[m, k] * (d[m, k / 32] / 127) * table16[code[n, k]] * unit * absmax[block(n, k)]
 * Integer sums hold at most 4 products of 32767 * 127 per lane, so they are exact (and exact
 * in float32, under 2**24); results agree with the reference to the rounding of the sum order.
 *
 * Layout: the weight is N x K code bytes, flattened row-major; block b covers flat elements
 * [b * blocksize, (b + 1) * blocksize). The activations are widened to int16 in the order
 * each vector loop multiplies them (see quantize_acts8).
 *
 * Paths: AVX-512 with VBMI and VNNI (steps of 64: the table's low and high bytes are two
 * 256-byte planes looked up with byte permutes, interleaved into words by one unpack each
 * way, and multiplied by vpdpwssd); AVX2, also taken by AVX-512 CPUs without VBMI or VNNI
 * (steps of 32: the table gathered as int32, packed to words, multiplied by madd); portable
 * C (steps of 32, per row). The vector loops need K % step == 0 and a power-of-two
 * blocksize >= 64, so a step never leaves its block; other shapes take the
 * element-by-element loop. The caller (Python) has checked every length, dtype and
 * stride (D9). */
#include <math.h>
#include <stdlib.h>

#include "block_scales.h"
#include "dtypes.h"
#include "int8_acts.h"
#include "vector.h"

#define TOKENS 8
#define ORDER_NATURAL 0
#define ORDER_PACKS 1 /* 16-runs as madd multiplies packed gathers: 0-3, 8-11, 4-7, 12-15 */
#define ORDER_VNNI 2  /* 64-runs: 0-7, 16-23, 32-39, 48-55, then 8-15, 24-31, 40-47, 56-63 */

/* The activations as the loops read them: x16 (M x K int16 levels, in the loop's order),
 * scale (M x K/32: each block's d / 127) and, for the VNNI loop, lanes (M x K/4: per step
 * of 64, its first block's scale 8 times, then its second block's 8 times). */
typedef struct {
    int16_t *x16;
    float *scale;
    float *lanes;
} acts8_t;

static void free_acts8(acts8_t *a) {
    free(a->x16);
    free(a->scale);
    free(a->lanes);
}

static int64_t position(int64_t k, int order) {
    if (order == ORDER_PACKS) return (k & ~INT64_C(15)) | (k & 3) | ((k & 4) << 1) | ((k & 8) >> 1);
    if (order == ORDER_VNNI) {
        int64_t r = k & 63, lane = r >> 4, j = r & 15;
        return (k & ~INT64_C(63)) + (j < 8 ? 8 * lane + j : 32 + 8 * lane + j - 8);
    }
    return k;
}

static int quantize_acts8(const void *x, int dtype, int64_t M, int64_t K, int order, acts8_t *a) {
    int64_t blocks = (K + XBLOCK - 1) / XBLOCK;
    a->x16 = (int16_t *)malloc((size_t)(M * K + 1) * sizeof(int16_t));
    a->scale = (float *)malloc((size_t)(M * blocks + 1) * sizeof(float));
    a->lanes = order == ORDER_VNNI ? (float *)malloc((size_t)(M * (K / 4) + 1) * sizeof(float)) : NULL;
    if (!a->x16 || !a->scale || (order == ORDER_VNNI && !a->lanes)) return 0;
    for (int64_t m = 0; m < M; m++)
        for (int64_t k0 = 0; k0 < K; k0 += XBLOCK) {
            float widened[XBLOCK];
            int8_t q[XBLOCK];
            int n = K - k0 < XBLOCK ? (int)(K - k0) : XBLOCK;
            for (int i = 0; i < n; i++) widened[i] = widen(x, dtype, m * K + k0 + i);
            float scale = (n == XBLOCK ? quantize_block32(widened, q) : quantize_block(widened, n, q)) / 127.0f;
            a->scale[m * blocks + k0 / XBLOCK] = scale;
            for (int i = 0; i < n; i++) a->x16[m * K + position(k0 + i, order)] = q[i];
            if (order == ORDER_VNNI)
                for (int i = 0; i < 8; i++) a->lanes[m * (K / 4) + (k0 / 64) * 16 + (k0 % 64 ? 8 : 0) + i] = scale;
        }
    return 1;
}

/* Rows [n0, n1), any shape, element by element (natural order): integer sums run until a
 * block of the activations or of the weight ends. */
static void rows_scalar(const acts8_t *a, const uint8_t *w, const scales_t *s, const int16_t *table16, float unit,
                        int64_t n0, int64_t n1, int64_t M, int64_t N, int64_t K, int64_t bs, float *out) {
    int64_t blocks = (K + XBLOCK - 1) / XBLOCK;
    for (int64_t n = n0; n < n1; n++)
        for (int64_t m = 0; m < M; m++) {
            float acc = 0.0f, scale = 0.0f;
            int32_t dot = 0;
            for (int64_t k = 0; k < K; k++) {
                int64_t flat = n * K + k;
                if (k % XBLOCK == 0 || flat % bs == 0) {
                    acc += (float)dot * scale;
                    scale = block_scale(s, flat / bs) * unit * a->scale[m * blocks + k / XBLOCK];
                    dot = 0;
                }
                dot += (int32_t)table16[w[flat]] * a->x16[m * K + k];
            }
            out[m * N + n] = acc + (float)dot * scale;
        }
}

#if defined(TF_AVX512) || defined(TF_AVX2)
#define S_PACKS 32

/* R rows x mc tokens, 32 weights a step: two gathers of 8 int32 levels packed to 16 words,
 * twice, against the activations in ORDER_PACKS. */
ALWAYS_INLINE void tile_avx2(const acts8_t *a, const uint8_t *w, const scales_t *s, const int32_t *table, float unit,
                             int64_t n0, const int R, int64_t N, int64_t K, int shift, float *out, const int mc) {
    __m256 acc[2][TOKENS];
    const int64_t blocks = K / XBLOCK;
    for (int r = 0; r < R; r++)
        for (int m = 0; m < mc; m++) acc[r][m] = _mm256_setzero_ps();
    const prefetch_t prefetch = prefetch_plan(w + n0 * K, (int64_t)R * K, K / S_PACKS);
    for (int64_t k = 0; k < K; k += S_PACKS) {
        prefetch_step(&prefetch, k / S_PACKS);
        __m256i W[2][2];
        __m256 ws[2];
        for (int r = 0; r < R; r++) {
            int64_t flat = (n0 + r) * K + k;
            for (int h = 0; h < 2; h++) {
                const uint8_t *codes = w + flat + 16 * h;
                __m256i g0 = _mm256_i32gather_epi32(table, _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)codes)), 4);
                __m256i g1 = _mm256_i32gather_epi32(table, _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(codes + 8))), 4);
                W[r][h] = _mm256_packs_epi32(g0, g1);
            }
            ws[r] = _mm256_set1_ps(block_scale(s, flat >> shift) * unit);
        }
        for (int m = 0; m < mc; m++) {
            __m256i x0 = _mm256_loadu_si256((const __m256i *)(a->x16 + m * K + k));
            __m256i x1 = _mm256_loadu_si256((const __m256i *)(a->x16 + m * K + k + 16));
            __m256 xs = _mm256_set1_ps(a->scale[m * blocks + k / XBLOCK]);
            for (int r = 0; r < R; r++) {
                __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(W[r][0], x0), _mm256_madd_epi16(W[r][1], x1));
                acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(ws[r], xs), acc[r][m]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int m = 0; m < mc; m++) out[m * N + n0 + r] = sum256(acc[r][m]);
}

static void rows_avx2(const acts8_t *a, const uint8_t *w, const scales_t *s, const int32_t *table, float unit,
                      int64_t n0, int64_t n1, int64_t N, int64_t K, int shift, float *out, int mc) {
    TILES_BY_TOKEN_COUNT(tile_avx2, c <= 2 ? 2 : 1, a, w, s, table, unit)
}
#endif

#if defined(TF_VBMI)
#define VNNI8 __attribute__((target("avx512vnni,avx512vbmi,avx512bw,avx512f")))
#define S_VNNI 64

/* R rows x mc tokens, 64 weights a step: each code's int16 level from two byte planes (its
 * low and high bytes, 256 entries each: two 128-entry permutes and a blend by bit 7), the
 * bytes interleaved into words, two vpdpwssd against the activations in ORDER_VNNI. Lanes
 * 0-7 of the sums hold the step's first 32-block, lanes 8-15 its second. */
VNNI8 ALWAYS_INLINE void tile_vnni(const acts8_t *a, const uint8_t *w, const scales_t *s, const __m512i *planes,
                                   float unit, int64_t n0, const int R, int64_t N, int64_t K, int shift, float *out,
                                   const int mc) {
    __m512 acc[4][TOKENS];
    for (int r = 0; r < R; r++)
        for (int m = 0; m < mc; m++) acc[r][m] = _mm512_setzero_ps();
    const prefetch_t prefetch = prefetch_plan(w + n0 * K, (int64_t)R * K, K / S_VNNI);
    for (int64_t k = 0; k < K; k += S_VNNI) {
        prefetch_step(&prefetch, k / S_VNNI);
        __m512i W0[4], W1[4];
        __m512 ws[4];
        for (int r = 0; r < R; r++) {
            int64_t flat = (n0 + r) * K + k;
            const __m512i codes = _mm512_loadu_si512((const void *)(w + flat));
            const __mmask64 upper = _mm512_movepi8_mask(codes);
            __m512i low = _mm512_mask_blend_epi8(upper, _mm512_permutex2var_epi8(planes[0], codes, planes[1]),
                                                 _mm512_permutex2var_epi8(planes[2], codes, planes[3]));
            __m512i high = _mm512_mask_blend_epi8(upper, _mm512_permutex2var_epi8(planes[4], codes, planes[5]),
                                                  _mm512_permutex2var_epi8(planes[6], codes, planes[7]));
            W0[r] = _mm512_unpacklo_epi8(low, high);
            W1[r] = _mm512_unpackhi_epi8(low, high);
            ws[r] = _mm512_set1_ps(block_scale(s, flat >> shift) * unit);
        }
        for (int m = 0; m < mc; m++) {
            __m512i x0 = _mm512_loadu_si512((const void *)(a->x16 + m * K + k));
            __m512i x1 = _mm512_loadu_si512((const void *)(a->x16 + m * K + k + 32));
            __m512 xs = _mm512_loadu_ps(a->lanes + m * (K / 4) + k / 4);
            for (int r = 0; r < R; r++) {
                __m512i dot = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(_mm512_setzero_si512(), W0[r], x0), W1[r], x1);
                acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(ws[r], xs), acc[r][m]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int m = 0; m < mc; m++) out[m * N + n0 + r] = _mm512_reduce_add_ps(acc[r][m]);
}

VNNI8 static void rows_vnni(const acts8_t *a, const uint8_t *w, const scales_t *s, const __m512i *table, float unit,
                            int64_t n0, int64_t n1, int64_t N, int64_t K, int shift, float *out, int mc) {
    TILES_BY_TOKEN_COUNT(tile_vnni, c <= 4 ? 4 : 2, a, w, s, table, unit)
}
#endif

#if !defined(TF_AVX512) && !defined(TF_AVX2)
#define S_PACKS 32
/* portable, steps of 32 in natural order: per row an integer dot per step, then one scaled add. */
static void rows_portable(const acts8_t *a, const uint8_t *w, const scales_t *s, const int16_t *table16, float unit,
                          int64_t n0, int64_t n1, int64_t N, int64_t K, int shift, float *out, int mc) {
    const int64_t blocks = K / XBLOCK;
    for (int64_t n = n0; n < n1; n++) {
        float acc[TOKENS] = {0};
        const prefetch_t prefetch = prefetch_plan(w + n * K, K, K / S_PACKS);
        for (int64_t k = 0; k < K; k += S_PACKS) {
            int64_t flat = n * K + k;
            prefetch_step(&prefetch, k / S_PACKS);
            float wscale = block_scale(s, flat >> shift) * unit;
            int16_t levels[S_PACKS];
            for (int i = 0; i < S_PACKS; i++) levels[i] = table16[w[flat + i]];
            for (int m = 0; m < mc; m++) {
                const int16_t *xq = a->x16 + m * K + k;
                int32_t dot = 0;
                for (int i = 0; i < S_PACKS; i++) dot += (int32_t)levels[i] * xq[i];
                acc[m] += (float)dot * (wscale * a->scale[m * blocks + k / XBLOCK]);
            }
        }
        for (int m = 0; m < mc; m++) out[m * N + n] = acc[m];
    }
}
#endif

/* out[M x N] = quantized(x) @ table16-decoded(w).T, x and out in dtype (dtypes.h); vnni: take
 * vpdpwssd where the CPU has it (the AVX-512 VBMI path); absmax is NULL where the scales
 * are double-quantized. */
void tf_gemv_8bit_int8(const void *x, const uint8_t *w, const float *absmax, const uint8_t *qabsmax,
                       const float *code2, const float *absmax2, int64_t nested_blocksize, float offset,
                       const int16_t *table16, float unit, int64_t M, int64_t N, int64_t K, int64_t blocksize,
                       void *out_raw, int64_t threads, int64_t vnni, int64_t dtype) {
    if (M <= 0 || N <= 0) return;
    float *out = floats_for(out_raw, dtype, M * N);
    scales_t s = {absmax, qabsmax, code2, absmax2, nested_blocksize, offset};
    int shift = 0;
    while ((INT64_C(1) << shift) < blocksize) shift++;
    int aligned = blocksize >= 64 && (blocksize & (blocksize - 1)) == 0;
    int order = ORDER_NATURAL, step = 0;
#if defined(TF_VBMI)
    if (vnni && __builtin_cpu_supports("avx512vnni") && aligned && K % S_VNNI == 0) order = ORDER_VNNI, step = S_VNNI;
#else
    (void)vnni;
#endif
#if defined(TF_AVX512) || defined(TF_AVX2)
    if (!step && aligned && K % S_PACKS == 0) order = ORDER_PACKS, step = S_PACKS;
#else
    if (aligned && K % S_PACKS == 0) step = S_PACKS;
#endif
    acts8_t a = {NULL, NULL, NULL};
    if (!out || !quantize_acts8(x, (int)dtype, M, K, order, &a)) {
        free_acts8(&a);
        release_floats(out, out_raw);
        fill_nan(out_raw, dtype, M * N); /* no memory: the caller sees NaN, not stale data */
        return;
    }
#if defined(TF_AVX512) || defined(TF_AVX2)
    int32_t table32[256];
    for (int i = 0; i < 256; i++) table32[i] = table16[i];
#endif
#if defined(TF_VBMI)
    _Alignas(64) uint8_t plane_bytes[8 * 64];
    for (int i = 0; i < 256; i++) {
        plane_bytes[i] = (uint8_t)((uint16_t)table16[i] & 0xFF);
        plane_bytes[256 + i] = (uint8_t)((uint16_t)table16[i] >> 8);
    }
    const __m512i *planes = (const __m512i *)plane_bytes;
#endif
    if (threads < 1) threads = 1;
    if (threads > N) threads = N;
#pragma omp parallel for num_threads((int)threads) schedule(static, 1)
    for (int64_t part = 0; part < threads; part++) {
        int64_t n0 = N * part / threads, n1 = N * (part + 1) / threads;
        if (!step) {
            rows_scalar(&a, w, &s, table16, unit, n0, n1, M, N, K, blocksize, out);
            continue;
        }
        for (int64_t m0 = 0; m0 < M; m0 += TOKENS) {
            int mc = (int)(M - m0 < TOKENS ? M - m0 : TOKENS);
            acts8_t group = {a.x16 + m0 * K, a.scale + m0 * (K / XBLOCK), a.lanes ? a.lanes + m0 * (K / 4) : NULL};
#if defined(TF_VBMI)
            if (order == ORDER_VNNI) {
                rows_vnni(&group, w, &s, planes, unit, n0, n1, N, K, shift, out + m0 * N, mc);
                continue;
            }
#endif
#if defined(TF_AVX512) || defined(TF_AVX2)
            rows_avx2(&group, w, &s, table32, unit, n0, n1, N, K, shift, out + m0 * N, mc);
#else
            rows_portable(&group, w, &s, table16, unit, n0, n1, N, K, shift, out + m0 * N, mc);
#endif
        }
    }
    free_acts8(&a);
    floats_out(out, out_raw, dtype, M * N);
}
