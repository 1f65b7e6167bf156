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
 * x is M x K, out M x N, in float32, bfloat16 or float16 (dtypes.h: converted once at the
 * entry); tokens come in groups of TOKENS.
 */
#include <stdlib.h>

#include "block_scales.h"
#include "dtypes.h"
#include "vector.h"

#define TOKENS 8

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

/* The vector loops take a step of 32 weights of R rows at a time for up to TOKENS tokens:
 * each step decodes the R rows' codes into vectors of weights already multiplied by their
 * block's scale (the reference's float32 decode, exactly) and adds their products with
 * each token into an R x tokens tile of accumulators, so each x vector loaded serves R rows.
 * 4-bit codes look up a 16-entry table scaled once per block (a multiply per block, not
 * per weight); 8-bit codes gather from the 256-entry table and multiply. Needs K and the
 * blocksize to be multiples of 32 and the blocksize a power of two, so that every row and
 * block starts a step. 4-bit steps read 16 bytes: the high nibbles are the even elements,
 * the low ones the odd; rather than interleave the decoded weights, x is permuted once per
 * call so each 32-run holds its even elements, then its odd ones. */
#define STEP 32
static void permute_pairs(const float *x, float *xp, int64_t M, int64_t K) {
    for (int64_t i = 0; i < M * K; i += STEP)
        for (int t = 0; t < STEP / 2; t++) {
            xp[i + t] = x[i + 2 * t];
            xp[i + STEP / 2 + t] = x[i + 2 * t + 1];
        }
}

/* 8-bit VBMI steps of 64: vector j holds elements 16L + 4j + i (lane L, i < 4). */
static void permute_quads(const float *x, float *xq, int64_t M, int64_t K) {
    for (int64_t i = 0; i < M * K; i += 64)
        for (int j = 0; j < 4; j++)
            for (int lane = 0; lane < 4; lane++)
                for (int t = 0; t < 4; t++) xq[i + 16 * j + 4 * lane + t] = x[i + 16 * lane + 4 * j + t];
}

#if defined(TF_AVX512)

/* A row's current block: its scale, and for 4-bit codes the table times the scale. */
typedef struct {
    __m512 scale, tab;
} block_t;
ALWAYS_INLINE void set_block(block_t *b, const float *table, float scale, int bits) {
    b->scale = _mm512_set1_ps(scale);
    if (bits == 4) b->tab = _mm512_mul_ps(_mm512_loadu_ps(table), b->scale);
}

/* One row's step as LANES-wide vectors; X_OFFSET_* says where each one's x starts in the step.
 * vpermps reads only an index's low 4 bits, so no mask isolates the low nibble. */
ALWAYS_INLINE void decode_step(const uint8_t *w, int64_t flat, int bits, const float *table, const block_t *b,
                               vec *v) {
    if (bits == 4) {
        __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(w + (flat >> 1))));
        v[0] = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), b->tab);
        v[1] = _mm512_permutexvar_ps(bytes, b->tab);
    } else {
#if defined(TF_VBMI)
        /* 64 codes a step: each byte of the 256 floats is a 256-byte plane looked up with two
         * 128-entry byte permutes (bit 7 of the code picks one), and the four planes are
         * interleaved back into floats by unpacks within 128-bit lanes: vector j holds the
         * weights 16L + 4j + i of lane L, so x is permuted once per call to match. */
        const __m512i codes = _mm512_loadu_si512((const void *)(w + flat));
        const __mmask64 upper = _mm512_movepi8_mask(codes);
        const __m512i *plane = (const __m512i *)table; /* 4 planes x 4 vectors, built in gemv() */
        __m512i bytes[4];
        for (int j = 0; j < 4; j++) {
            __m512i low = _mm512_permutex2var_epi8(plane[4 * j], codes, plane[4 * j + 1]);
            __m512i high = _mm512_permutex2var_epi8(plane[4 * j + 2], codes, plane[4 * j + 3]);
            bytes[j] = _mm512_mask_blend_epi8(upper, low, high);
        }
        __m512i lo01 = _mm512_unpacklo_epi8(bytes[0], bytes[1]), hi01 = _mm512_unpackhi_epi8(bytes[0], bytes[1]);
        __m512i lo23 = _mm512_unpacklo_epi8(bytes[2], bytes[3]), hi23 = _mm512_unpackhi_epi8(bytes[2], bytes[3]);
        v[0] = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(lo01, lo23)), b->scale);
        v[1] = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(lo01, lo23)), b->scale);
        v[2] = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(hi01, hi23)), b->scale);
        v[3] = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(hi01, hi23)), b->scale);
#else
        for (int h = 0; h < 2; h++) {
            __m512i codes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(w + flat + LANES * h)));
            v[h] = _mm512_mul_ps(_mm512_i32gather_ps(codes, table, 4), b->scale);
        }
#endif
    }
}
#define VECS_4BIT 2
static const int X_OFFSET_4BIT[] = {0, 16};
#if defined(TF_VBMI)
#define STEP_8BIT 64
#define VECS_8BIT 4
static const int X_OFFSET_8BIT[] = {0, 16, 32, 48};
#else
#define VECS_8BIT 2
static const int X_OFFSET_8BIT[] = {0, 16};
#endif

#elif defined(TF_AVX2)

typedef struct {
    __m256 scale, lo, hi;
} block_t;
ALWAYS_INLINE void set_block(block_t *b, const float *table, float scale, int bits) {
    b->scale = _mm256_set1_ps(scale);
    if (bits == 4) {
        b->lo = _mm256_mul_ps(_mm256_loadu_ps(table), b->scale);
        b->hi = _mm256_mul_ps(_mm256_loadu_ps(table + 8), b->scale);
    }
}

/* 16 entries by two 8-entry permutes (each reads an index's low 3 bits), chosen by bit 3
 * of the index, moved to the sign bit: higher bits of the index are ignored. */
ALWAYS_INLINE __m256 lookup16(const block_t *b, __m256i codes) {
    __m256 lo = _mm256_permutevar8x32_ps(b->lo, codes), hi = _mm256_permutevar8x32_ps(b->hi, codes);
    return _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_slli_epi32(codes, 28)));
}

ALWAYS_INLINE void decode_step(const uint8_t *w, int64_t flat, int bits, const float *table, const block_t *b,
                               vec *v) {
    for (int h = 0; h < 2; h++) {
        if (bits == 4) {
            __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(w + (flat >> 1) + 8 * h)));
            v[h] = lookup16(b, _mm256_srli_epi32(bytes, 4));
            v[2 + h] = lookup16(b, bytes);
        } else {
            for (int q = 0; q < 2; q++) {
                __m256i codes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(w + flat + 16 * h + 8 * q)));
                v[2 * h + q] = _mm256_mul_ps(_mm256_i32gather_ps(table, codes, 4), b->scale);
            }
        }
    }
}
#define VECS_4BIT 4
#define VECS_8BIT 4
static const int X_OFFSET_4BIT[] = {0, 8, 16, 24}, X_OFFSET_8BIT[] = {0, 8, 16, 24};

#else /* portable: fixed-width arrays the compiler vectorizes (SSE2 on x86-64, NEON on ARM) */
typedef struct {
    float scale, tab[16];
} block_t;
ALWAYS_INLINE void set_block(block_t *b, const float *table, float scale, int bits) {
    b->scale = scale;
    if (bits == 4)
        for (int t = 0; t < 16; t++) b->tab[t] = table[t] * scale;
}
ALWAYS_INLINE void decode_step(const uint8_t *w, int64_t flat, int bits, const float *table, const block_t *b,
                               vec *v) {
    for (int h = 0; h < 2; h++)
        for (int t = 0; t < LANES; t++) {
            if (bits == 4) {
                uint8_t byte = w[(flat >> 1) + LANES * h + t];
                v[h].f[t] = b->tab[byte >> 4];
                v[2 + h].f[t] = b->tab[byte & 15];
            } else {
                v[h].f[t] = table[w[flat + LANES * h + t]] * b->scale;
                v[2 + h].f[t] = table[w[flat + 2 * LANES + LANES * h + t]] * b->scale;
            }
        }
}
#define VECS_4BIT 4
#define VECS_8BIT 4
static const int X_OFFSET_4BIT[] = {0, 8, 16, 24}, X_OFFSET_8BIT[] = {0, 8, 16, 24};
#endif

#ifndef STEP_8BIT
#define STEP_8BIT STEP
#endif
#define MAX_VECS 4

/* R rows from n0, tokens [0, mc) of x (already offset), into out (already offset). */
ALWAYS_INLINE void tile(const float *x, const uint8_t *w, const int bits, const scales_t *s, const float *table,
                        int64_t n0, const int R, int64_t N, int64_t K, int shift, float *out, const int mc) {
    vec acc[4][TOKENS];
    block_t block[4];
    memset(block, 0, sizeof block); /* each is set at k == 0; this only quiets the compiler */
    const int64_t mask = (INT64_C(1) << shift) - 1;
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int m = 0; m < mc; m++) acc[r][m] = VZERO;
    const int step = bits == 4 ? STEP : STEP_8BIT, vecs = bits == 4 ? VECS_4BIT : VECS_8BIT;
    const int *x_offset = bits == 4 ? X_OFFSET_4BIT : X_OFFSET_8BIT;
    const prefetch_t prefetch = prefetch_plan(w + n0 * K * bits / 8, (int64_t)R * K * bits / 8, K / step);
    for (int64_t k = 0; k < K; k += step) {
        vec v[4][MAX_VECS];
        prefetch_step(&prefetch, k / step);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            int64_t flat = (n0 + r) * K + k;
            if (k == 0 || (flat & mask) == 0) set_block(&block[r], table, block_scale(s, flat >> shift), bits);
            decode_step(w, flat, bits, table, &block[r], v[r]);
        }
#pragma GCC unroll 8
        for (int m = 0; m < mc; m++)
#pragma GCC unroll 4
            for (int j = 0; j < vecs; j++) {
                vec xv = VLOAD(x + m * K + k + x_offset[j]);
#pragma GCC unroll 4
                for (int r = 0; r < R; r++) acc[r][m] = VFMA(v[r][j], xv, acc[r][m]);
            }
    }
    for (int r = 0; r < R; r++)
        for (int m = 0; m < mc; m++) out[m * N + n0 + r] = VSUM(acc[r][m]);
}

/* Rows per tile, as many as the vector registers hold (32 with AVX-512, 16 with AVX2). */
#if defined(TF_VBMI)
#define TILE_ROWS(mc, bits) ((bits) == 8 ? 1 : (mc) <= 4 ? 4 : 2)
#elif defined(TF_AVX512)
#define TILE_ROWS(mc, bits) ((mc) <= 4 ? 4 : 2)
#else
#define TILE_ROWS(mc, bits) 1
#endif
#define FOR_TOKEN_COUNTS(CASE) CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)

ALWAYS_INLINE void rows_vec(const float *x, const uint8_t *w, const int bits, const scales_t *s, const float *table,
                            int64_t n0, int64_t n1, int64_t N, int64_t K, int shift, float *out, int mc) {
#if !defined(TF_AVX512) && !defined(TF_AVX2)
    /* portable: one tile function for every token count (the fallback path; eight copies
     * of its unrolled loops took most of the build's time) */
    for (int64_t n = n0; n < n1; n++) tile(x, w, bits, s, table, n, 1, N, K, shift, out, mc);
    return;
#endif
    switch (mc) {
#define CASE(c)                                                                                \
    case c: {                                                                                  \
        int64_t n = n0;                                                                        \
        for (; n + TILE_ROWS(c, bits) <= n1; n += TILE_ROWS(c, bits))                          \
            tile(x, w, bits, s, table, n, TILE_ROWS(c, bits), N, K, shift, out, c);            \
        for (; n < n1; n++) tile(x, w, bits, s, table, n, 1, N, K, shift, out, c);            \
        break;                                                                                 \
    }
        FOR_TOKEN_COUNTS(CASE)
#undef CASE
    }
}

/* Rows are split into contiguous ranges, one per thread, so each streams its own bytes. */
static void gemv(const float *x, const uint8_t *w, int bits, const scales_t *s, const float *table, int64_t M,
                 int64_t N, int64_t K, int64_t bs, float *out, int threads) {
    int64_t step = bits == 4 ? STEP : STEP_8BIT;
    int vector = K % step == 0 && bs % step == 0 && (bs & (bs - 1)) == 0;
    int shift = 0;
    while ((INT64_C(1) << shift) < bs) shift++;
    float *xp = NULL;
    int permuted = bits == 4 || STEP_8BIT == 64;
    if (vector && permuted) {
        xp = (float *)malloc((size_t)(M * K) * sizeof(float));
        if (!xp) vector = 0;
        else if (bits == 4) permute_pairs(x, xp, M, K);
        else permute_quads(x, xp, M, K);
    }
    const float *xv = permuted ? xp : x;
    /* The vector loops' table: for 8-bit VBMI steps, the table's bytes as 4 planes of 256. */
    _Alignas(64) uint8_t planes[4 * 256];
    const float *vtable = table;
    if (bits == 8 && STEP_8BIT == 64) {
        for (int j = 0; j < 4; j++)
            for (int e = 0; e < 256; e++) planes[256 * j + e] = ((const uint8_t *)&table[e])[j];
        vtable = (const float *)planes;
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
            if (bits == 4) rows_vec(xv + m0 * K, w, 4, s, vtable, n0, n1, N, K, shift, out + m0 * N, mc);
            else rows_vec(xv + m0 * K, w, 8, s, vtable, n0, n1, N, K, shift, out + m0 * N, mc);
        }
    }
    free(xp);
}

/* out[M x N] = x[M x K] @ decode(w).T; bits is 4 or 8; absmax is NULL where the scales are
 * double-quantized (qabsmax, code2, absmax2, nested_blocksize, offset); x and out in dtype. */
void tf_gemv_blockwise(const void *x, const uint8_t *w, int64_t bits, const float *absmax, const uint8_t *qabsmax,
                       const float *code2, const float *absmax2, int64_t nested_blocksize, float offset,
                       const float *table, int64_t M, int64_t N, int64_t K, int64_t blocksize, void *out,
                       int64_t threads, int64_t dtype) {
    scales_t s = {absmax, qabsmax, code2, absmax2, nested_blocksize, offset};
    float *x32 = floats_in(x, dtype, M * K), *out32 = floats_for(out, dtype, M * N);
    if (x32 && out32) {
        gemv(x32, w, (int)bits, &s, table, M, N, K, blocksize, out32, (int)threads);
        floats_out(out32, out, dtype, M * N);
    } else {
        release_floats(out32, out);
        fill_nan(out, dtype, M * N);
    }
    release_floats(x32, x);
}
