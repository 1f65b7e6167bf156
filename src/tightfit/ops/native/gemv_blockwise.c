/* Few-token matmuls against blockwise-quantized weights (4-bit NF4/FP4, 8-bit dynamic map),
 * reading each stored byte once: codes are decoded in registers and multiplied into the
 * accumulators, one accumulator set per token, and each block's partial sums are scaled
 * once by its absmax. Nothing the size of the decoded weight exists.
 *
 * Compiled once per instruction-set path (TF_AVX512, TF_AVX2, or neither: portable C that
 * the compiler vectorizes for the machine's baseline, NEON on ARM); tightfit.ops._native
 * chooses, builds and caches them. The caller (Python) has checked every length, dtype and
 * stride (D9): the pointers here are valid for the sizes given.
 *
 * Layout (bitsandbytes'): the weight is N x K, flattened row-major; block b covers flat
 * elements [b * blocksize, (b + 1) * blocksize), so a block may span rows. 4-bit codes are
 * packed two per byte, the first element in the high nibble. Scales are float32, or
 * double-quantized (uint8 codes into a 256-entry map, times a float32 per `nested_blocksize`
 * scales, plus an offset), decoded here per block in the reference's float32 order.
 *
 * x is M x K float32, out is M x N float32; tokens come in groups of TOKENS.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(TF_AVX512) || defined(TF_AVX2)
#include <immintrin.h>
#endif

#define TOKENS 8
#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* Where a block's scale comes from: absmax[b], or code2[qabsmax[b]] * absmax2[b / nested] + offset. */
typedef struct {
    const float *absmax;
    const uint8_t *qabsmax;
    const float *code2;
    const float *absmax2;
    int64_t nested_blocksize;
    float offset;
} scales_t;

ALWAYS_INLINE float block_scale(const scales_t *s, int64_t b) {
    if (s->absmax) return s->absmax[b];
    float decoded = s->code2[s->qabsmax[b]] * s->absmax2[b / s->nested_blocksize];
    return decoded + s->offset;
}

ALWAYS_INLINE int code_4bit(const uint8_t *w, int64_t flat) {
    uint8_t byte = w[flat >> 1];
    return (flat & 1) ? (byte & 15) : (byte >> 4);
}

/* Rows [n0, n1), any K, element by element: the path for shapes the vector loops do not cover. */
static void rows_scalar(const float *x, const uint8_t *w, int bits, const scales_t *s, const float *table,
                        int64_t n0, int64_t n1, int64_t M, int64_t N, int64_t K, int64_t bs, float *out) {
    for (int64_t n = n0; n < n1; n++) {
        for (int64_t m0 = 0; m0 < M; m0 += TOKENS) {
            int64_t mc = M - m0 < TOKENS ? M - m0 : TOKENS;
            float acc[TOKENS] = {0};
            int64_t start = n * K, k = 0, b = start / bs;
            while (k < K) {
                int64_t end = (b + 1) * bs - start;
                if (end > K) end = K;
                float part[TOKENS] = {0};
                for (; k < end; k++) {
                    float v = bits == 4 ? table[code_4bit(w, start + k)] : table[w[start + k]];
                    for (int64_t m = 0; m < mc; m++) part[m] += v * x[(m0 + m) * K + k];
                }
                float scale = block_scale(s, b);
                for (int64_t m = 0; m < mc; m++) acc[m] += part[m] * scale;
                b++;
            }
            for (int64_t m = 0; m < mc; m++) out[(m0 + m) * N + n] = acc[m];
        }
    }
}

/* 4-bit vector loops take 32 weights (16 bytes) a step: the high nibbles are the even
 * elements, the low nibbles the odd ones. Rather than interleave the decoded weights, x is
 * permuted once per call so each 32-run holds its even elements, then its odd ones. Needs
 * K and the blocksize to be multiples of 32, so that every row and block starts a run. */
static void permute_pairs(const float *x, float *xp, int64_t M, int64_t K) {
    for (int64_t i = 0; i < M * K; i += 32)
        for (int t = 0; t < 16; t++) {
            xp[i + t] = x[i + 2 * t];
            xp[i + 16 + t] = x[i + 2 * t + 1];
        }
}

#if defined(TF_AVX512)

ALWAYS_INLINE void rows_4bit_vec(const float *xp, const uint8_t *w, const scales_t *s, const float *table,
                                 int64_t n0, int64_t n1, int64_t N, int64_t K, int64_t bs, float *out,
                                 const int mc) {
    const __m512 tab = _mm512_loadu_ps(table);
    const __m512i low4 = _mm512_set1_epi32(15);
    for (int64_t n = n0; n < n1; n++) {
        __m512 acc[TOKENS];
        for (int m = 0; m < mc; m++) acc[m] = _mm512_setzero_ps();
        int64_t start = n * K, k = 0, b = start / bs;
        while (k < K) {
            int64_t end = (b + 1) * bs - start;
            if (end > K) end = K;
            __m512 even[TOKENS], odd[TOKENS];
            for (int m = 0; m < mc; m++) even[m] = odd[m] = _mm512_setzero_ps();
            for (; k < end; k += 32) {
                __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(w + ((start + k) >> 1))));
                __m512 hi = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), tab);
                __m512 lo = _mm512_permutexvar_ps(_mm512_and_si512(bytes, low4), tab);
                for (int m = 0; m < mc; m++) {
                    even[m] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xp + m * K + k), even[m]);
                    odd[m] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xp + m * K + k + 16), odd[m]);
                }
            }
            __m512 scale = _mm512_set1_ps(block_scale(s, b));
            for (int m = 0; m < mc; m++) acc[m] = _mm512_fmadd_ps(_mm512_add_ps(even[m], odd[m]), scale, acc[m]);
            b++;
        }
        for (int m = 0; m < mc; m++) out[m * N + n] = _mm512_reduce_add_ps(acc[m]);
    }
}

#define STEP_8BIT 16
ALWAYS_INLINE void rows_8bit_vec(const float *x, const uint8_t *w, const scales_t *s, const float *table,
                                 int64_t n0, int64_t n1, int64_t N, int64_t K, int64_t bs, float *out,
                                 const int mc) {
    for (int64_t n = n0; n < n1; n++) {
        __m512 acc[TOKENS];
        for (int m = 0; m < mc; m++) acc[m] = _mm512_setzero_ps();
        int64_t start = n * K, k = 0, b = start / bs;
        while (k < K) {
            int64_t end = (b + 1) * bs - start;
            if (end > K) end = K;
            __m512 part[TOKENS];
            for (int m = 0; m < mc; m++) part[m] = _mm512_setzero_ps();
            for (; k < end; k += STEP_8BIT) {
                __m512i codes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(w + start + k)));
                __m512 v = _mm512_i32gather_ps(codes, table, 4);
                for (int m = 0; m < mc; m++) part[m] = _mm512_fmadd_ps(v, _mm512_loadu_ps(x + m * K + k), part[m]);
            }
            __m512 scale = _mm512_set1_ps(block_scale(s, b));
            for (int m = 0; m < mc; m++) acc[m] = _mm512_fmadd_ps(part[m], scale, acc[m]);
            b++;
        }
        for (int m = 0; m < mc; m++) out[m * N + n] = _mm512_reduce_add_ps(acc[m]);
    }
}

#elif defined(TF_AVX2)

ALWAYS_INLINE float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Table of 16 by two 8-entry permutes, chosen by bit 3 of the code (moved to the sign bit). */
ALWAYS_INLINE __m256 lookup16(__m256 tab_lo, __m256 tab_hi, __m256i codes) {
    __m256 lo = _mm256_permutevar8x32_ps(tab_lo, codes);
    __m256 hi = _mm256_permutevar8x32_ps(tab_hi, codes);
    return _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_slli_epi32(codes, 28)));
}

ALWAYS_INLINE void rows_4bit_vec(const float *xp, const uint8_t *w, const scales_t *s, const float *table,
                                 int64_t n0, int64_t n1, int64_t N, int64_t K, int64_t bs, float *out,
                                 const int mc) {
    const __m256 tab_lo = _mm256_loadu_ps(table), tab_hi = _mm256_loadu_ps(table + 8);
    const __m256i low4 = _mm256_set1_epi32(15);
    for (int64_t n = n0; n < n1; n++) {
        __m256 acc[TOKENS];
        for (int m = 0; m < mc; m++) acc[m] = _mm256_setzero_ps();
        int64_t start = n * K, k = 0, b = start / bs;
        while (k < K) {
            int64_t end = (b + 1) * bs - start;
            if (end > K) end = K;
            __m256 even[TOKENS], odd[TOKENS];
            for (int m = 0; m < mc; m++) even[m] = odd[m] = _mm256_setzero_ps();
            for (; k < end; k += 32) {
                const uint8_t *p = w + ((start + k) >> 1);
                for (int half = 0; half < 2; half++) {
                    __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8 * half)));
                    __m256 hi = lookup16(tab_lo, tab_hi, _mm256_srli_epi32(bytes, 4));
                    __m256 lo = lookup16(tab_lo, tab_hi, _mm256_and_si256(bytes, low4));
                    for (int m = 0; m < mc; m++) {
                        even[m] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(xp + m * K + k + 8 * half), even[m]);
                        odd[m] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(xp + m * K + k + 16 + 8 * half), odd[m]);
                    }
                }
            }
            __m256 scale = _mm256_set1_ps(block_scale(s, b));
            for (int m = 0; m < mc; m++) acc[m] = _mm256_fmadd_ps(_mm256_add_ps(even[m], odd[m]), scale, acc[m]);
            b++;
        }
        for (int m = 0; m < mc; m++) out[m * N + n] = hsum256(acc[m]);
    }
}

#define STEP_8BIT 8
ALWAYS_INLINE void rows_8bit_vec(const float *x, const uint8_t *w, const scales_t *s, const float *table,
                                 int64_t n0, int64_t n1, int64_t N, int64_t K, int64_t bs, float *out,
                                 const int mc) {
    for (int64_t n = n0; n < n1; n++) {
        __m256 acc[TOKENS];
        for (int m = 0; m < mc; m++) acc[m] = _mm256_setzero_ps();
        int64_t start = n * K, k = 0, b = start / bs;
        while (k < K) {
            int64_t end = (b + 1) * bs - start;
            if (end > K) end = K;
            __m256 part[TOKENS];
            for (int m = 0; m < mc; m++) part[m] = _mm256_setzero_ps();
            for (; k < end; k += STEP_8BIT) {
                __m256i codes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(w + start + k)));
                __m256 v = _mm256_i32gather_ps(table, codes, 4);
                for (int m = 0; m < mc; m++) part[m] = _mm256_fmadd_ps(v, _mm256_loadu_ps(x + m * K + k), part[m]);
            }
            __m256 scale = _mm256_set1_ps(block_scale(s, b));
            for (int m = 0; m < mc; m++) acc[m] = _mm256_fmadd_ps(part[m], scale, acc[m]);
            b++;
        }
        for (int m = 0; m < mc; m++) out[m * N + n] = hsum256(acc[m]);
    }
}

#else /* portable: fixed-width lanes the compiler vectorizes (SSE2 on x86-64, NEON on ARM) */

#define LANES 16
ALWAYS_INLINE float lanes_sum(const float *v) {
    float total = 0.0f;
    for (int t = 0; t < LANES; t++) total += v[t];
    return total;
}

ALWAYS_INLINE void rows_4bit_vec(const float *xp, const uint8_t *w, const scales_t *s, const float *table,
                                 int64_t n0, int64_t n1, int64_t N, int64_t K, int64_t bs, float *out,
                                 const int mc) {
    for (int64_t n = n0; n < n1; n++) {
        float acc[TOKENS][LANES] = {{0}};
        int64_t start = n * K, k = 0, b = start / bs;
        while (k < K) {
            int64_t end = (b + 1) * bs - start;
            if (end > K) end = K;
            float part[TOKENS][LANES] = {{0}};
            for (; k < end; k += 32) {
                const uint8_t *p = w + ((start + k) >> 1);
                float hi[LANES], lo[LANES];
                for (int t = 0; t < LANES; t++) {
                    hi[t] = table[p[t] >> 4];
                    lo[t] = table[p[t] & 15];
                }
                for (int m = 0; m < mc; m++)
                    for (int t = 0; t < LANES; t++)
                        part[m][t] += hi[t] * xp[m * K + k + t] + lo[t] * xp[m * K + k + 16 + t];
            }
            float scale = block_scale(s, b);
            for (int m = 0; m < mc; m++)
                for (int t = 0; t < LANES; t++) acc[m][t] += part[m][t] * scale;
            b++;
        }
        for (int m = 0; m < mc; m++) out[m * N + n] = lanes_sum(acc[m]);
    }
}

#define STEP_8BIT LANES
ALWAYS_INLINE void rows_8bit_vec(const float *x, const uint8_t *w, const scales_t *s, const float *table,
                                 int64_t n0, int64_t n1, int64_t N, int64_t K, int64_t bs, float *out,
                                 const int mc) {
    for (int64_t n = n0; n < n1; n++) {
        float acc[TOKENS][LANES] = {{0}};
        int64_t start = n * K, k = 0, b = start / bs;
        while (k < K) {
            int64_t end = (b + 1) * bs - start;
            if (end > K) end = K;
            float part[TOKENS][LANES] = {{0}};
            for (; k < end; k += LANES) {
                float v[LANES];
                for (int t = 0; t < LANES; t++) v[t] = table[w[start + k + t]];
                for (int m = 0; m < mc; m++)
                    for (int t = 0; t < LANES; t++) part[m][t] += v[t] * x[m * K + k + t];
            }
            float scale = block_scale(s, b);
            for (int m = 0; m < mc; m++)
                for (int t = 0; t < LANES; t++) acc[m][t] += part[m][t] * scale;
            b++;
        }
        for (int m = 0; m < mc; m++) out[m * N + n] = lanes_sum(acc[m]);
    }
}

#endif

/* One function per token count, so each has its accumulators in registers. */
#define FOR_TOKEN_COUNTS(CASE) CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)

static void rows_4bit(const float *xp, const uint8_t *w, const scales_t *s, const float *table, int64_t n0,
                      int64_t n1, int64_t N, int64_t K, int64_t bs, float *out, int mc) {
    switch (mc) {
#define CASE(c) \
    case c: rows_4bit_vec(xp, w, s, table, n0, n1, N, K, bs, out, c); break;
        FOR_TOKEN_COUNTS(CASE)
#undef CASE
    }
}

static void rows_8bit(const float *x, const uint8_t *w, const scales_t *s, const float *table, int64_t n0,
                      int64_t n1, int64_t N, int64_t K, int64_t bs, float *out, int mc) {
    switch (mc) {
#define CASE(c) \
    case c: rows_8bit_vec(x, w, s, table, n0, n1, N, K, bs, out, c); break;
        FOR_TOKEN_COUNTS(CASE)
#undef CASE
    }
}

/* Rows are split into contiguous ranges, one per thread, so each streams its own bytes. */
static void gemv(const float *x, const uint8_t *w, int bits, const scales_t *s, const float *table, int64_t M,
                 int64_t N, int64_t K, int64_t bs, float *out, int threads) {
    int64_t step = bits == 4 ? 32 : STEP_8BIT; /* rows and blocks must start whole steps */
    int vector = K % step == 0 && bs % step == 0;
    float *xp = NULL;
    if (vector && bits == 4) {
        xp = (float *)malloc((size_t)(M * K) * sizeof(float));
        if (!xp) vector = 0;
        else permute_pairs(x, xp, M, K);
    }
    if (threads < 1) threads = 1;
    if (threads > N) threads = (int)(N > 0 ? N : 1);
#pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (int part = 0; part < threads; part++) {
        int64_t n0 = N * part / threads, n1 = N * (part + 1) / threads;
        if (!vector) {
            rows_scalar(x, w, bits, s, table, n0, n1, M, N, K, bs, out);
            continue;
        }
        for (int64_t m0 = 0; m0 < M; m0 += TOKENS) {
            int mc = (int)(M - m0 < TOKENS ? M - m0 : TOKENS);
            if (bits == 4) rows_4bit(xp + m0 * K, w, s, table, n0, n1, N, K, bs, out + m0 * N, mc);
            else rows_8bit(x + m0 * K, w, s, table, n0, n1, N, K, bs, out + m0 * N, mc);
        }
    }
    free(xp);
}

/* out[M x N] = x[M x K] @ decode(w).T; bits is 4 or 8; absmax is NULL where the scales are
 * double-quantized (qabsmax, code2, absmax2, nested_blocksize, offset). */
void tf_gemv_blockwise(const float *x, const uint8_t *w, int64_t bits, const float *absmax, const uint8_t *qabsmax,
                       const float *code2, const float *absmax2, int64_t nested_blocksize, float offset,
                       const float *table, int64_t M, int64_t N, int64_t K, int64_t blocksize, float *out,
                       int64_t threads) {
    scales_t s = {absmax, qabsmax, code2, absmax2, nested_blocksize, offset};
    gemv(x, w, (int)bits, &s, table, M, N, K, blocksize, out, (int)threads);
}
