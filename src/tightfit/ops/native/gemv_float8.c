/* Few-token matmuls against float8 weights (layerwise casting's storage): out = x @ (w * s).T
 * (+ bias), reading each stored byte once. Bytes are decoded in registers to float32,
 * exactly, and multiplied by the row's scale (the reference's upcast: exact for the
 * power-of-two scales layerwise casting stores), then into one accumulator per token;
 * nothing the size of the upcast weight exists.
 *
 * Decoding: an e5m2 byte is the high byte of a float16 (vcvtph2ps widens it). An e4m3fn
 * byte is rebuilt as the float16 of its value times 2**-8 (sign to bit 15, exponent and
 * mantissa moved up by 7 bits: the exponent bias differs by 8, subnormals included), its
 * NaNs (0x7F, 0xFF) made float16 NaNs. Portable C (and the K % STEP tail) looks bytes up in
 * a 256-entry table of their values, built per call. The row's scale (times 2**8 for
 * e4m3fn's patterns) multiplies each token's sum once, not each weight: the same value as
 * scaling each weight first, exactly, for the power-of-two scales layerwise casting stores.
 * A row the reference's upcast would make non-finite takes the table path, scaling each
 * weight and making it infinite as the upcast does: a scale that is not finite, scaled
 * weights that may reach `ceiling` (the least magnitude the compute dtype rounds to
 * infinity: 65520 for float16), or an e4m3fn factor that would overflow (past 2**119).
 *
 * Compiled once per instruction-set path (TF_AVX512, TF_AVX2, or neither); see
 * tightfit.ops._native. The caller (Python) has checked dtypes, shapes and contiguity (D9):
 * x is M x K, w is N x K bytes, scale is NULL, one float32 or N of them, bias is NULL or N
 * values, out is M x N; x, bias and out in float32, bfloat16 or float16 (dtypes.h).
 */
#include <math.h>

#include "dtypes.h"
#include "vector.h"

#define TOKENS 8
#define E4M3FN 0
#define E5M2 1

/* The float32 value of every byte, exactly. */
static void build_table(int format, float *table) {
    for (int b = 0; b < 256; b++) {
        int sign = b >> 7;
        float value;
        if (format == E4M3FN) {
            int e = (b >> 3) & 15, m = b & 7;
            if (e == 15 && m == 7) value = NAN;
            else if (e == 0) value = ldexpf((float)m, -9);
            else value = ldexpf((float)(8 + m), e - 10);
        } else {
            int e = (b >> 2) & 31, m = b & 3;
            if (e == 31) value = m ? NAN : INFINITY;
            else if (e == 0) value = ldexpf((float)m, -16);
            else value = ldexpf((float)(4 + m), e - 17);
        }
        table[b] = sign ? -value : value;
    }
}

typedef struct {
    const float *x;
    const uint8_t *w;
    int format;
    float largest; /* the format's largest finite magnitude */
    float ceiling;
    const float *scale; /* NULL: none */
    int64_t scale_stride; /* 0: one scale for the tensor, 1: one a row */
    const float *bias;
    const float *table;
    int64_t N, K;
    float *out;
} job_t;

ALWAYS_INLINE float row_scale(const job_t *j, int64_t n) { return j->scale ? j->scale[n * j->scale_stride] : 1.0f; }

/* Rows [n0, n1) for tokens [m0, m0 + mc), byte by byte through the table. */
static void rows_scalar(const job_t *j, int64_t n0, int64_t n1, int64_t m0, int64_t mc) {
    const int64_t K = j->K;
    for (int64_t n = n0; n < n1; n++) {
        float s = row_scale(j, n), acc[TOKENS] = {0};
        const uint8_t *w = j->w + n * K;
        for (int64_t k = 0; k < K; k++) {
            float v = j->table[w[k]] * s;
            if (fabsf(v) >= j->ceiling) v = copysignf(INFINITY, v);
            for (int64_t m = 0; m < mc; m++) acc[m] += v * j->x[(m0 + m) * K + k];
        }
        for (int64_t m = 0; m < mc; m++) j->out[(m0 + m) * j->N + n] = acc[m] + (j->bias ? j->bias[n] : 0.0f);
    }
}

/* The vector paths decode a step of STEP bytes into VECS vectors of LANES floats. */
#if defined(TF_AVX512)
#define VECS 2

/* 32 bytes as float16 bit patterns (e4m3fn: of the value times 2**-8), then float32. For
 * e4m3fn, (byte << 8) shifted right arithmetically by one puts the sign in bits 15 and 14
 * and the exponent and mantissa in bits 13..7; bit 14 is cleared. */
ALWAYS_INLINE void decode(const uint8_t *w, int format, vec *v) {
    __m512i u = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)w));
    __m512i h = _mm512_slli_epi16(u, 8);
    if (format == E4M3FN) {
        h = _mm512_and_si512(_mm512_srai_epi16(h, 1), _mm512_set1_epi16((short)0xBFFF));
        __mmask32 nan = _mm512_cmpeq_epi16_mask(_mm512_or_si512(u, _mm512_set1_epi16(0x80)), _mm512_set1_epi16(0xFF));
        h = _mm512_mask_mov_epi16(h, nan, _mm512_set1_epi16(0x7E00));
    }
    v[0] = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
    v[1] = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
}

#elif defined(TF_AVX2)
#define VECS 2

ALWAYS_INLINE void decode(const uint8_t *w, int format, vec *v) {
    __m256i u = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)w));
    __m256i h = _mm256_slli_epi16(u, 8);
    if (format == E4M3FN) {
        h = _mm256_and_si256(_mm256_srai_epi16(h, 1), _mm256_set1_epi16((short)0xBFFF));
        __m256i nan = _mm256_cmpeq_epi16(_mm256_or_si256(u, _mm256_set1_epi16(0x80)), _mm256_set1_epi16(0xFF));
        h = _mm256_or_si256(h, _mm256_and_si256(nan, _mm256_set1_epi16(0x7C00))); /* exponent all ones, mantissa kept */
    }
    v[0] = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
    v[1] = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
}

#else /* portable: fixed-width arrays the compiler vectorizes (SSE2 on x86-64, NEON on ARM) */
#define VECS 2
#endif
#define STEP (LANES * VECS)

/* What a row's sums of decoded vectors are multiplied by: its scale, times 2**8 for
 * e4m3fn's float16 patterns in the vector paths. */
ALWAYS_INLINE float row_factor(const job_t *j, int64_t n) {
    float s = row_scale(j, n);
#if defined(TF_AVX512) || defined(TF_AVX2)
    if (j->format == E4M3FN) return s * 256.0f;
#endif
    return s;
}

ALWAYS_INLINE void decode_step(const job_t *j, const uint8_t *w, vec *v) {
#if defined(TF_AVX512) || defined(TF_AVX2)
    decode(w, j->format, v);
#else
    for (int h = 0; h < VECS; h++)
        for (int t = 0; t < LANES; t++) v[h].f[t] = j->table[w[LANES * h + t]];
#endif
}

/* R rows from n0 (each with a usable factor), tokens [m0, m0 + mc): STEP weights of the R
 * rows a step, each x vector loaded serving the R rows; the K % STEP tail by the table. */
ALWAYS_INLINE void tile(const job_t *j, int64_t n0, const int R, int64_t m0, const int mc) {
    const int64_t K = j->K, whole = K - K % STEP;
    const float *x = j->x + m0 * K;
    vec acc[4][TOKENS];
    for (int r = 0; r < R; r++)
        for (int m = 0; m < mc; m++) acc[r][m] = VZERO;
    for (int64_t k = 0; k < whole; k += STEP) {
        vec v[4][VECS];
        for (int r = 0; r < R; r++) {
            /* the next tile's rows, into L2: the streams of R rows at once are more than the
             * hardware prefetchers follow (about 1.8x the bytes a second from memory) */
            __builtin_prefetch(j->w + (n0 + r + R) * K + k, 0, 2);
            decode_step(j, j->w + (n0 + r) * K + k, v[r]);
        }
        for (int m = 0; m < mc; m++)
            for (int h = 0; h < VECS; h++) {
                vec xv = VLOAD(x + m * K + k + LANES * h);
                for (int r = 0; r < R; r++) acc[r][m] = VFMA(v[r][h], xv, acc[r][m]);
            }
    }
    for (int r = 0; r < R; r++) {
        int64_t n = n0 + r;
        float s = row_scale(j, n), factor = row_factor(j, n), bias = j->bias ? j->bias[n] : 0.0f;
        for (int m = 0; m < mc; m++) {
            float tail = 0.0f;
            for (int64_t k = whole; k < K; k++) tail += j->table[j->w[n * K + k]] * x[m * K + k];
            j->out[(m0 + m) * j->N + n] = VSUM(acc[r][m]) * factor + tail * s + bias;
        }
    }
}

/* Rows per tile, as many as the vector registers hold (32 with AVX-512, 16 with AVX2). */
#if defined(TF_AVX512)
#define TILE_ROWS(mc) ((mc) <= 4 ? 4 : 2)
#else
#define TILE_ROWS(mc) 1
#endif
#define FOR_TOKEN_COUNTS(CASE) CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)

/* Whether the vector loop can take rows [n, n + R): finite scales and factors, scaled
 * weights below the ceiling. */
static int usable(const job_t *j, int64_t n, int R) {
    for (int r = 0; r < R; r++) {
        float s = row_scale(j, n + r);
        if (!isfinite(s) || !isfinite(row_factor(j, n + r)) || fabsf(s) * j->largest >= j->ceiling) return 0;
    }
    return 1;
}

static void rows_vec(const job_t *j, int64_t n0, int64_t n1, int64_t m0, int mc) {
    switch (mc) {
#define CASE(c)                                                                   \
    case c: {                                                                     \
        int64_t n = n0;                                                           \
        while (n < n1) {                                                          \
            if (n + TILE_ROWS(c) <= n1 && usable(j, n, TILE_ROWS(c))) {           \
                tile(j, n, TILE_ROWS(c), m0, c);                                  \
                n += TILE_ROWS(c);                                                \
            } else if (usable(j, n, 1)) {                                         \
                tile(j, n, 1, m0, c);                                             \
                n++;                                                              \
            } else {                                                              \
                rows_scalar(j, n, n + 1, m0, c);                                  \
                n++;                                                              \
            }                                                                     \
        }                                                                         \
        break;                                                                    \
    }
        FOR_TOKEN_COUNTS(CASE)
#undef CASE
    }
}

/* out[M x N] = x[M x K] @ (decode(w) * scale).T + bias. format: 0 e4m3fn, 1 e5m2; scale NULL
 * (none), or scale_count 1 (the tensor's) or N (a row's); scaled weights of magnitude
 * `ceiling` and more are infinite; bias NULL or N values; x, bias and out in dtype. Rows are
 * split into contiguous ranges, one per thread, so each thread streams its own bytes. */
void tf_gemv_float8(const void *x, const uint8_t *w, int64_t format, const float *scale, int64_t scale_count,
                    float ceiling, const void *bias, int64_t M, int64_t N, int64_t K, void *out, int64_t threads,
                    int64_t dtype) {
    if (M <= 0 || N <= 0) return;
    float *x32 = floats_in(x, dtype, M * K), *out32 = floats_for(out, dtype, M * N);
    float *bias32 = bias ? floats_in(bias, dtype, N) : NULL;
    if (!x32 || !out32 || (bias && !bias32)) {
        release_floats(out32, out);
        fill_nan(out, dtype, M * N);
    } else {
        float table[256];
        build_table((int)format, table);
        float largest = format == E4M3FN ? 448.0f : 57344.0f;
        job_t j = {x32, w, (int)format, largest, ceiling, scale, scale_count > 1 ? 1 : 0, bias32, table, N, K, out32};
        if (threads < 1) threads = 1;
        if (threads > N) threads = N;
#pragma omp parallel for num_threads((int)threads) schedule(static, 1)
        for (int64_t part = 0; part < threads; part++) {
            int64_t n0 = N * part / threads, n1 = N * (part + 1) / threads;
            for (int64_t m0 = 0; m0 < M; m0 += TOKENS) {
                int mc = (int)(M - m0 < TOKENS ? M - m0 : TOKENS);
                rows_vec(&j, n0, n1, m0, mc);
            }
        }
        floats_out(out32, out, dtype, M * N);
    }
    release_floats(x32, x);
    release_floats(bias32, bias);
}
