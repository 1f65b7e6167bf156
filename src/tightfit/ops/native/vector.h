/* What the few-token kernels share: one float vector type per instruction-set path, with
 * the few operations the multiply-accumulate loops use. TF_AVX512: 16 lanes; TF_AVX2: 8;
 * neither: 8 lanes of plain C the compiler vectorizes for its baseline (SSE2 on x86-64,
 * NEON on ARM). */
#ifndef TIGHTFIT_VECTOR_H
#define TIGHTFIT_VECTOR_H

#include <stdint.h>
#include <string.h>
#if defined(TF_AVX512) || defined(TF_AVX2)
#include <immintrin.h>
#endif

#define ALWAYS_INLINE static inline __attribute__((always_inline))

#if defined(TF_AVX512) || defined(TF_AVX2)
/* The sum of 8 floats (AVX2 loops, on AVX-512 builds too). */
ALWAYS_INLINE float sum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

#if defined(TF_AVX512)
#define LANES 16
typedef __m512 vec;
#define VZERO _mm512_setzero_ps()
#define VLOAD _mm512_loadu_ps
#define VFMA _mm512_fmadd_ps
#define VSUM _mm512_reduce_add_ps

#elif defined(TF_AVX2)
#define LANES 8
typedef __m256 vec;
#define VZERO _mm256_setzero_ps()
#define VLOAD _mm256_loadu_ps
#define VFMA _mm256_fmadd_ps
#define VSUM sum256

#else
#define LANES 8
typedef struct {
    float f[LANES];
} vec;
static const vec VZERO = {{0}};
ALWAYS_INLINE vec VLOAD(const float *p) {
    vec v;
    memcpy(v.f, p, sizeof v.f);
    return v;
}
ALWAYS_INLINE vec VFMA(vec a, vec b, vec c) {
    for (int t = 0; t < LANES; t++) c.f[t] += a.f[t] * b.f[t];
    return c;
}
ALWAYS_INLINE float VSUM(vec v) {
    float total = 0.0f;
    for (int t = 0; t < LANES; t++) total += v.f[t];
    return total;
}
#endif

/* The hardware prefetchers leave about a third of the read bandwidth unused on a tile's R
 * interleaved row streams: each of a tile's steps also prefetches its share of the bytes a
 * distance ahead (at least the next tile), so by the tile's end they are cached. */
#define PREFETCH_BYTES 4096
typedef struct {
    const uint8_t *ahead;
    int64_t per_step;
} prefetch_t;

/* For a tile of tile_bytes bytes from tile, read in steps steps. */
ALWAYS_INLINE prefetch_t prefetch_plan(const uint8_t *tile, int64_t tile_bytes, int64_t steps) {
    prefetch_t plan = {tile + (tile_bytes > PREFETCH_BYTES ? tile_bytes : PREFETCH_BYTES),
                       (tile_bytes + steps - 1) / steps};
    return plan;
}

ALWAYS_INLINE void prefetch_step(const prefetch_t *plan, int64_t step) {
    for (int64_t p = 0; p < plan->per_step; p += 64) __builtin_prefetch(plan->ahead + step * plan->per_step + p, 0, 3);
}

/* Rows [n0, n1) in tiles of ROWS(c) rows for each token count c (1 to 8, in mc), one unrolled
 * copy of TILE per count so each keeps its accumulators in registers; the rows left over one
 * by one. TILE takes the leading arguments given, then n, R, N, K, shift, out and c. */
#define TILES_BY_TOKEN_COUNT(TILE, ROWS, ...)                                                 \
    switch (mc) {                                                                             \
        CASE_TILES(TILE, ROWS, 1, __VA_ARGS__) CASE_TILES(TILE, ROWS, 2, __VA_ARGS__)         \
        CASE_TILES(TILE, ROWS, 3, __VA_ARGS__) CASE_TILES(TILE, ROWS, 4, __VA_ARGS__)         \
        CASE_TILES(TILE, ROWS, 5, __VA_ARGS__) CASE_TILES(TILE, ROWS, 6, __VA_ARGS__)         \
        CASE_TILES(TILE, ROWS, 7, __VA_ARGS__) CASE_TILES(TILE, ROWS, 8, __VA_ARGS__)         \
    }
#define CASE_TILES(TILE, ROWS, count, ...)                                                     \
    case count: {                                                                             \
        const int c = count, R = ROWS;                                                        \
        int64_t n = n0;                                                                       \
        for (; n + R <= n1; n += R) TILE(__VA_ARGS__, n, R, N, K, shift, out, c);             \
        for (; n < n1; n++) TILE(__VA_ARGS__, n, 1, N, K, shift, out, c);                     \
        break;                                                                                \
    }

#endif
