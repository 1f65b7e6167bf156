/* 4-bit matmuls with int8 activations (the "int8" compute choice): each token's activations
 * are quantized to int8 per block of 32 along K, the 4-bit table is rounded to int8 levels
 * (table8 = round(127 * table), passed in), and codes meet activations in integer dot
 * products, as llama.cpp's Q4_0 x Q8_0 does. Four to eight times fewer instructions per
 * weight than the float32 kernels (gemv_blockwise.c), so two cores keep up with memory.
 *
 * What it computes (the op's reference, tightfit.ops.blockwise_gemv_int8, is the spec):
 *   d[m, j]  = max |x[m, 32j : 32j + 32]| / 127,   q = rint(clamp(x * 127 / max, -127, 127))
 *   out[m, n] = sum_k q[m, k] * table8[code[n, k]] * (d[m, k / 32] / 127) * absmax[block(n, k)]
 * Integer sums are exact over each run of 8 weights; runs are scaled and summed in float32,
 * so results agree with the reference to the rounding of the sum order.
 *
 * Layout: the weight is bitsandbytes' packed 4-bit (two codes a byte, the first element in
 * the high nibble; block b covers flat elements [b * blocksize, (b + 1) * blocksize)). The
 * vector loops take steps of S weights (S/2 bytes): the high nibbles of a step are its even
 * elements, the low nibbles its odd ones, so x is quantized into the same order once per
 * call (each S-run: its S/2 even elements, then its S/2 odd ones). A 32-bit lane of a dot
 * product then covers 8 consecutive weights, and per-lane scales are indexed by k / 8.
 *
 * Paths: AVX-512 VNNI (S = 128; vpdpbusd multiplies unsigned by signed bytes, so the table is
 * shifted to table8 + 128 and 128 * sum(q) over each lane is the accumulator's start);
 * AVX2 (S = 64; maddubs with the sign moved from the weight onto the activation, |products|
 * <= 2 * 127 * 127 never saturate), also taken by AVX-512 CPUs without VNNI; portable C
 * (S = 64, per lane). The vector loops need K % S == 0 and a power-of-two blocksize >= 64;
 * other shapes take the element-by-element loop. The caller (Python) has checked every
 * length, dtype and stride (D9). */
#include <math.h>
#include <stdlib.h>

#include "block_scales.h"
#include "dtypes.h"
#include "int8_acts.h"
#include "vector.h"

#define TOKENS 8

/* The activations as the dot products read them: q (M x K int8, each S-run's even elements
 * then its odd ones), lane_scale (M x K/8: d / 127 of the 32-block the lane lies in) and,
 * for VNNI, bias (M x K/8: -128 times the lane's sum of q). */
typedef struct {
    int8_t *q;
    float *lane_scale;
    int32_t *bias;
} acts_t;

static void free_acts(acts_t *a) {
    free(a->q);
    free(a->lane_scale);
    free(a->bias);
}

/* The sums of q over each lane (8 consecutive values) of a block of n <= 32. */
ALWAYS_INLINE void lane_sums(const int8_t *q, int n, int32_t *sums) {
    for (int lane = 0; lane < (n + 7) / 8; lane++) {
        sums[lane] = 0;
        for (int i = 8 * lane; i < n && i < 8 * lane + 8; i++) sums[lane] += q[i];
    }
}

/* A full block's codes in the vector loops' order (its even elements to evens, its odd ones
 * to odds) and its four lanes' sums of q. */
#if defined(TF_AVX512) || defined(TF_AVX2)
ALWAYS_INLINE void place_block32(const int8_t *q, int8_t *evens, int8_t *odds, int32_t *sums) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)q);
    const __m256i split = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15, 0, 2, 4, 6, 8, 10,
                                           12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    const __m256i parts = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(v, split), 0xD8); /* evens | odds */
    _mm_storeu_si128((__m128i *)evens, _mm256_castsi256_si128(parts));
    _mm_storeu_si128((__m128i *)odds, _mm256_extracti128_si256(parts, 1));
    /* q + 128 as unsigned bytes, summed per 8 by sad against zero */
    int64_t shifted[4];
    _mm256_storeu_si256((__m256i *)shifted,
                        _mm256_sad_epu8(_mm256_xor_si256(v, _mm256_set1_epi8((char)0x80)), _mm256_setzero_si256()));
    for (int lane = 0; lane < 4; lane++) sums[lane] = (int32_t)shifted[lane] - 8 * 128;
}
#else
ALWAYS_INLINE void place_block32(const int8_t *q, int8_t *evens, int8_t *odds, int32_t *sums) {
    for (int i = 0; i < XBLOCK / 2; i++) {
        evens[i] = q[2 * i];
        odds[i] = q[2 * i + 1];
    }
    lane_sums(q, XBLOCK, sums);
}
#endif

/* Quantizes x (dtype) per 32-block; S = 0 keeps the natural order (the element-by-element loop). */
static int quantize_acts(const void *x, int dtype, int64_t M, int64_t K, int S, acts_t *a) {
    int64_t lanes = (K + 7) / 8;
    a->q = (int8_t *)malloc((size_t)(M * K) + 1);
    a->lane_scale = (float *)malloc((size_t)(M * lanes + 1) * sizeof(float));
    a->bias = (int32_t *)malloc((size_t)(M * lanes + 1) * sizeof(int32_t));
    if (!a->q || !a->lane_scale || !a->bias) return 0;
    for (int64_t m = 0; m < M; m++)
        for (int64_t k0 = 0; k0 < K; k0 += XBLOCK) {
            float widened[XBLOCK];
            int8_t q[XBLOCK];
            int32_t sums[XBLOCK / 8];
            int n = K - k0 < XBLOCK ? (int)(K - k0) : XBLOCK;
            const float *xb = (const float *)x + m * K + k0;
            if (dtype != F32) {
                for (int i = 0; i < n; i++) widened[i] = widen(x, dtype, m * K + k0 + i);
                xb = widened;
            }
            float scale = (n == XBLOCK ? quantize_block32(xb, q) : quantize_block(xb, n, q)) / 127.0f / 127.0f;
            int8_t *row = a->q + m * K;
            if (S) { /* the vector loops' order: a full 32-block lies in one S-run (S % 32 == 0) */
                int64_t run = k0 - k0 % S, half = (k0 % S) / 2;
                place_block32(q, row + run + half, row + run + S / 2 + half, sums);
            } else {
                memcpy(row + k0, q, (size_t)n);
                lane_sums(q, n, sums);
            }
            for (int lane = 0; lane < (n + 7) / 8; lane++) {
                a->lane_scale[m * lanes + k0 / 8 + lane] = scale;
                a->bias[m * lanes + k0 / 8 + lane] = -128 * sums[lane];
            }
        }
    return 1;
}

ALWAYS_INLINE int code_at(const uint8_t *w, int64_t flat) {
    uint8_t byte = w[flat >> 1];
    return (flat & 1) ? (byte & 15) : (byte >> 4);
}

/* Rows [n0, n1), any shape, element by element (acts in natural order). */
static void rows_scalar(const acts_t *a, const uint8_t *w, const scales_t *s, const int8_t *table8, int64_t n0,
                        int64_t n1, int64_t M, int64_t N, int64_t K, int64_t bs, float *out) {
    int64_t lanes = (K + 7) / 8;
    for (int64_t n = n0; n < n1; n++)
        for (int64_t m = 0; m < M; m++) {
            float acc = 0.0f;
            for (int64_t k0 = 0; k0 < K; k0 += 8) {
                int32_t dot = 0;
                float wscale = 0.0f;
                for (int64_t k = k0; k < K && k < k0 + 8; k++) {
                    /* a run of 8 may span two weight blocks (blocksize 32 never splits one) */
                    if (k == k0 || (n * K + k) % bs == 0) {
                        if (k != k0) acc += (float)dot * (wscale * a->lane_scale[m * lanes + k0 / 8]);
                        wscale = block_scale(s, (n * K + k) / bs);
                        dot = 0;
                    }
                    dot += (int32_t)a->q[m * K + k] * table8[code_at(w, n * K + k)];
                }
                acc += (float)dot * (wscale * a->lane_scale[m * lanes + k0 / 8]);
            }
            out[m * N + n] = acc;
        }
}



#if defined(TF_AVX512) || defined(TF_AVX2)

/* AVX2, S = 64: R rows x mc tokens, 8 lanes of 8 weights a step. */
#define S2 64
ALWAYS_INLINE __m256i lookup32(__m256i table, __m256i nibbles) { return _mm256_shuffle_epi8(table, nibbles); }

ALWAYS_INLINE void tile_avx2(const acts_t *a, const uint8_t *w, const scales_t *s, __m256i table, int64_t n0,
                             const int R, int64_t N, int64_t K, int shift, float *out, const int mc) {
    __m256 acc[4][TOKENS];
    const int64_t lanes = K / 8;
    for (int r = 0; r < R; r++)
        for (int m = 0; m < mc; m++) acc[r][m] = _mm256_setzero_ps();
    const __m256i low4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    const prefetch_t prefetch = prefetch_plan(w + n0 * K / 2, (int64_t)R * K / 2, K / S2);
    for (int64_t k = 0; k < K; k += S2) {
        prefetch_step(&prefetch, k / S2);
        __m256i H[4], L[4], Habs[4], Labs[4];
        __m256 ws[4];
        for (int r = 0; r < R; r++) {
            int64_t flat = (n0 + r) * K + k;
            __m256i bytes = _mm256_loadu_si256((const __m256i *)(w + flat / 2));
            H[r] = lookup32(table, _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4));
            L[r] = lookup32(table, _mm256_and_si256(bytes, low4));
            Habs[r] = _mm256_abs_epi8(H[r]);
            Labs[r] = _mm256_abs_epi8(L[r]);
            ws[r] = _mm256_set1_ps(block_scale(s, flat >> shift));
        }
        for (int m = 0; m < mc; m++) {
            __m256i xh = _mm256_loadu_si256((const __m256i *)(a->q + m * K + k));
            __m256i xl = _mm256_loadu_si256((const __m256i *)(a->q + m * K + k + S2 / 2));
            __m256 xs = _mm256_loadu_ps(a->lane_scale + m * lanes + k / 8);
            for (int r = 0; r < R; r++) {
                __m256i ph = _mm256_maddubs_epi16(Habs[r], _mm256_sign_epi8(xh, H[r]));
                __m256i pl = _mm256_maddubs_epi16(Labs[r], _mm256_sign_epi8(xl, L[r]));
                __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(ph, ones), _mm256_madd_epi16(pl, ones));
                acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(ws[r], xs), acc[r][m]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int m = 0; m < mc; m++) out[m * N + n0 + r] = sum256(acc[r][m]);
}
#endif

#if defined(TF_AVX512)
#define VNNI __attribute__((target("avx512vnni,avx512bw,avx512f")))
#define S5 128

/* A step's weight scales per lane: one block, or (blocksize 64) lanes 0-7 and 8-15 in two. */
ALWAYS_INLINE __m512 lane_wscale(const scales_t *s, int64_t flat, int shift) {
    int64_t b = flat >> shift;
    if (shift >= 7) return _mm512_set1_ps(block_scale(s, b));
    return _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(block_scale(s, b)), _mm512_set1_ps(block_scale(s, b + 1)));
}

VNNI ALWAYS_INLINE void tile_vnni(const acts_t *a, const uint8_t *w, const scales_t *s, __m512i table, int64_t n0,
                                  const int R, int64_t N, int64_t K, int shift, float *out, const int mc) {
    __m512 acc[4][TOKENS];
    const int64_t lanes = K / 8;
    for (int r = 0; r < R; r++)
        for (int m = 0; m < mc; m++) acc[r][m] = _mm512_setzero_ps();
    const __m512i low4 = _mm512_set1_epi8(15);
    const prefetch_t prefetch = prefetch_plan(w + n0 * K / 2, (int64_t)R * K / 2, K / S5);
    for (int64_t k = 0; k < K; k += S5) {
        prefetch_step(&prefetch, k / S5);
        __m512i H[4], L[4];
        __m512 ws[4];
        for (int r = 0; r < R; r++) {
            int64_t flat = (n0 + r) * K + k;
            __m512i bytes = _mm512_loadu_si512((const void *)(w + flat / 2));
            H[r] = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low4));
            L[r] = _mm512_shuffle_epi8(table, _mm512_and_si512(bytes, low4));
            ws[r] = lane_wscale(s, flat, shift);
        }
        for (int m = 0; m < mc; m++) {
            __m512i xh = _mm512_loadu_si512((const void *)(a->q + m * K + k));
            __m512i xl = _mm512_loadu_si512((const void *)(a->q + m * K + k + S5 / 2));
            __m512i bias = _mm512_loadu_si512((const void *)(a->bias + m * lanes + k / 8));
            __m512 xs = _mm512_loadu_ps(a->lane_scale + m * lanes + k / 8);
            for (int r = 0; r < R; r++) {
                __m512i dot = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(bias, H[r], xh), L[r], xl);
                acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(ws[r], xs), acc[r][m]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int m = 0; m < mc; m++) out[m * N + n0 + r] = _mm512_reduce_add_ps(acc[r][m]);
}

VNNI static void rows_vnni(const acts_t *a, const uint8_t *w, const scales_t *s, __m512i table, int64_t n0,
                           int64_t n1, int64_t N, int64_t K, int shift, float *out, int mc) {
    TILES_BY_TOKEN_COUNT(tile_vnni, c <= 4 ? 4 : 2, a, w, s, table)
}
static int has_vnni(void) { return __builtin_cpu_supports("avx512vnni"); }
#endif

#if defined(TF_AVX512) || defined(TF_AVX2)
static void rows_avx2(const acts_t *a, const uint8_t *w, const scales_t *s, __m256i table, int64_t n0, int64_t n1,
                      int64_t N, int64_t K, int shift, float *out, int mc) {
    TILES_BY_TOKEN_COUNT(tile_avx2, c <= 2 ? 2 : 1, a, w, s, table)
}
#else
/* portable, S = 64: per lane of 8 weights, integer dot then one scaled float add. */
#define S2 64
static void rows_portable(const acts_t *a, const uint8_t *w, const scales_t *s, const int8_t *table8, int64_t n0,
                          int64_t n1, int64_t N, int64_t K, int shift, float *out, int mc) {
    const int64_t lanes = K / 8;
    for (int64_t n = n0; n < n1; n++) {
        float acc[TOKENS] = {0};
        const prefetch_t prefetch = prefetch_plan(w + n * K / 2, K / 2, K / S2);
        for (int64_t k = 0; k < K; k += S2) {
            int64_t flat = n * K + k;
            prefetch_step(&prefetch, k / S2);
            float wscale = block_scale(s, flat >> shift);
            int8_t hi[S2 / 2], lo[S2 / 2];
            for (int i = 0; i < S2 / 2; i++) {
                uint8_t byte = w[flat / 2 + i];
                hi[i] = table8[byte >> 4];
                lo[i] = table8[byte & 15];
            }
            for (int m = 0; m < mc; m++) {
                const int8_t *xh = a->q + m * K + k, *xl = xh + S2 / 2;
                for (int lane = 0; lane < S2 / 8; lane++) {
                    int32_t dot = 0;
                    for (int i = 4 * lane; i < 4 * lane + 4; i++) dot += hi[i] * xh[i] + lo[i] * xl[i];
                    acc[m] += (float)dot * (wscale * a->lane_scale[m * lanes + k / 8 + lane]);
                }
            }
        }
        for (int m = 0; m < mc; m++) out[m * N + n] = acc[m];
    }
}
#endif

/* out[M x N] = quantized(x) @ table8-decoded(w).T, x and out in dtype (dtypes.h); vnni: take
 * vpdpbusd where the CPU has it (the AVX-512 path); absmax is NULL where the scales are
 * double-quantized. */
void tf_gemv_4bit_int8(const void *x, const uint8_t *w, const float *absmax, const uint8_t *qabsmax,
                       const float *code2, const float *absmax2, int64_t nested_blocksize, float offset,
                       const int8_t *table8, int64_t M, int64_t N, int64_t K, int64_t blocksize, void *out_raw,
                       int64_t threads, int64_t vnni, int64_t dtype) {
    if (M <= 0 || N <= 0) return;
    float *out = floats_for(out_raw, dtype, M * N);
    scales_t s = {absmax, qabsmax, code2, absmax2, nested_blocksize, offset};
    int shift = 0;
    while ((INT64_C(1) << shift) < blocksize) shift++;
    int S = 64;
#if defined(TF_AVX512)
    int use_vnni = vnni && has_vnni();
    if (use_vnni) S = 128;
#else
    (void)vnni;
#endif
    int vector = K % S == 0 && blocksize >= 64 && (blocksize & (blocksize - 1)) == 0;
    acts_t a = {NULL, NULL, NULL};
    if (!out || !quantize_acts(x, (int)dtype, M, K, vector ? S : 0, &a)) {
        free_acts(&a);
        release_floats(out, out_raw);
        fill_nan(out_raw, dtype, M * N); /* no memory: the caller sees NaN, not stale data */
        return;
    }
#if defined(TF_AVX512) || defined(TF_AVX2)
    const __m256i table256 = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)table8));
#endif
#if defined(TF_AVX512)
    uint8_t shifted[16];
    for (int i = 0; i < 16; i++) shifted[i] = (uint8_t)(table8[i] + 128);
    const __m512i table512 = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)shifted));
#endif
    if (threads < 1) threads = 1;
    if (threads > N) threads = N;
#pragma omp parallel for num_threads((int)threads) schedule(static, 1)
    for (int64_t part = 0; part < threads; part++) {
        int64_t n0 = N * part / threads, n1 = N * (part + 1) / threads;
        if (!vector) {
            rows_scalar(&a, w, &s, table8, n0, n1, M, N, K, blocksize, out);
            continue;
        }
        for (int64_t m0 = 0; m0 < M; m0 += TOKENS) {
            int mc = (int)(M - m0 < TOKENS ? M - m0 : TOKENS);
            acts_t group = {a.q + m0 * K, a.lane_scale + m0 * (K / 8), a.bias + m0 * (K / 8)};
#if defined(TF_AVX512)
            if (use_vnni) {
                rows_vnni(&group, w, &s, table512, n0, n1, N, K, shift, out + m0 * N, mc);
                continue;
            }
#endif
#if defined(TF_AVX512) || defined(TF_AVX2)
            rows_avx2(&group, w, &s, table256, n0, n1, N, K, shift, out + m0 * N, mc);
#else
            rows_portable(&group, w, &s, table8, n0, n1, N, K, shift, out + m0 * N, mc);
#endif
        }
    }
    free_acts(&a);
    floats_out(out, out_raw, dtype, M * N);
}
