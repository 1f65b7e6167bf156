/* Activations quantized to int8 per block of 32 along K, as llama.cpp's Q8_0 does: the
 * "int8" compute choice of the blockwise formats (gemv_4bit_int8.c, gemv_8bit_int8.c).
 * The ops' references (tightfit.ops.blockwise_gemv_int8) are the spec:
 *   d = max |x[32j : 32j + 32]|,   q = rint(clamp(x * 127 / d, -127, 127)), NaN to 0
 * with the block's d NaN where it holds a NaN (as torch's amax makes it). */
#ifndef TIGHTFIT_INT8_ACTS_H
#define TIGHTFIT_INT8_ACTS_H

#include <math.h>

#include "vector.h"

#define XBLOCK 32

/* One block of n <= 32 activations to int8 levels (q), by the reference's arithmetic. */
ALWAYS_INLINE float quantize_block(const float *xb, int n, int8_t *q) {
    float amax = 0.0f;
    int nan = 0;
    for (int i = 0; i < n; i++) {
        float v = fabsf(xb[i]);
        amax = v > amax ? v : amax;
        nan |= v != v;
    }
    if (nan) amax = NAN; /* a NaN's block scale is NaN, as torch's amax makes it */
    float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    for (int i = 0; i < n; i++) {
        float t = xb[i] * inv; /* clamped by comparisons: libm's fminf is an SSE call
                                * that costs microseconds after AVX-512 code */
        t = t != t ? 0.0f : t < -127.0f ? -127.0f : t > 127.0f ? 127.0f : t;
        q[i] = (int8_t)rintf(t);
    }
    return amax;
}

#if defined(TF_AVX512)
/* A whole block of 32, the same arithmetic in two vectors: the largest |x| (NaN if any is),
 * then x * (127 / largest), NaN to 0, clamped to +-127 and rounded half to even (the
 * conversion's default mode, as rintf's). */
ALWAYS_INLINE float quantize_block32(const float *xb, int8_t *q) {
    const __m512 sign = _mm512_set1_ps(-0.0f), limit = _mm512_set1_ps(127.0f);
    __m512 lo = _mm512_loadu_ps(xb), hi = _mm512_loadu_ps(xb + 16);
    __mmask16 nan = _mm512_cmp_ps_mask(lo, lo, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(hi, hi, _CMP_UNORD_Q);
    float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, lo), _mm512_andnot_ps(sign, hi)));
    if (nan) amax = NAN;
    float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    __m512 scale = _mm512_set1_ps(inv), bound = _mm512_set1_ps(-127.0f);
    for (int half = 0; half < 2; half++) {
        __m512 t = _mm512_mul_ps(half ? hi : lo, scale);
        t = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(t, t, _CMP_ORD_Q), t);
        t = _mm512_min_ps(_mm512_max_ps(t, bound), limit);
        _mm_storeu_si128((__m128i *)(q + 16 * half), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(t)));
    }
    return amax;
}
#elif defined(TF_AVX2)
/* The same in four vectors of 8; the packs interleave 128-bit lanes, the permute restores order. */
ALWAYS_INLINE float quantize_block32(const float *xb, int8_t *q) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4], largest = _mm256_setzero_ps();
    int nan = 0;
    for (int i = 0; i < 4; i++) {
        v[i] = _mm256_loadu_ps(xb + 8 * i);
        nan |= _mm256_movemask_ps(_mm256_cmp_ps(v[i], v[i], _CMP_UNORD_Q));
        largest = _mm256_max_ps(largest, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(largest), _mm256_extractf128_ps(largest, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    float amax = nan ? NAN : _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
    float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    const __m256 scale = _mm256_set1_ps(inv), low = _mm256_set1_ps(-127.0f), high = _mm256_set1_ps(127.0f);
    __m256i r[4];
    for (int i = 0; i < 4; i++) {
        __m256 t = _mm256_mul_ps(v[i], scale);
        t = _mm256_and_ps(t, _mm256_cmp_ps(t, t, _CMP_ORD_Q));
        r[i] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(t, low), high));
    }
    __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]), _mm256_packs_epi32(r[2], r[3]));
    bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)q, bytes);
    return amax;
}
#else
ALWAYS_INLINE float quantize_block32(const float *xb, int8_t *q) { return quantize_block(xb, XBLOCK, q); }
#endif

#endif
