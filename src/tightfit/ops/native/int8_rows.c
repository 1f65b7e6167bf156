/* Few-row int8 matmuls (LLM.int8()'s decode), exact: out[m, n] = sum_k A[m, k] * B[n, k] in
 * int32, wrapping as int32 accumulation wraps (addition modulo 2**32 is associative, so any
 * order of the sum gives the reference's bits). Each row of B (the weight) is read from
 * memory once, for all rows of A: while it sits in L1, every group of TOKENS rows of A
 * takes its turn.
 *
 * Vector paths sign-extend bytes to int16 and multiply with madd (pairs of int16 products
 * summed into int32: |a * b| <= 2**14, so a pair never overflows); A is widened once per
 * call into a scratch buffer (M x K int16). Where the CPU has AVX-512 VNNI (and the caller
 * allows it), the AVX-512 path takes vpdpbusd instead: unsigned bytes times signed bytes,
 * four products summed exactly into each int32 lane (|sum| <= 4 * 255 * 128) and added
 * with wrapping; A is shifted to unsigned (a + 128, scratch M x K bytes) and 128 * sum(b),
 * summed the same way per row of B, is taken off at the end: the same bits modulo 2**32.
 * A fourth of the instructions per weight, so 8 tokens stay at the memory roof. Portable C
 * accumulates in uint32 (signed overflow is undefined in C; unsigned wraps, same bits).
 *
 * Compiled once per instruction-set path (TF_AVX512, TF_AVX2, or neither); see
 * tightfit.ops._native. The caller (Python) has checked dtypes, shapes and contiguity
 * (D9): A is M x K, B is N x K, out is M x N, all contiguous.
 */
#include <stdint.h>
#include <stdlib.h>

#if defined(TF_AVX512) || defined(TF_AVX2)
#include <immintrin.h>
#endif

#define TOKENS 8
#define ALWAYS_INLINE static inline __attribute__((always_inline))
/* Each step also asks for the bytes this many rows of B ahead, into L2: the hardware
 * prefetchers alone leave a third of the memory's bandwidth unused here. */
#define PREFETCH(b, k, K) __builtin_prefetch((b) + (k) + 4 * (K), 0, 2)

/* Copies the bytes at cols of rows [n0, n1) of B into gathered (N x ncols): the outlier
 * columns LLM.int8() multiplies in float, taken while a chunk's rows are still cached
 * instead of in a second pass over B (which cost as much as the product). */
static void gather_rows(const int8_t *B, int64_t n0, int64_t n1, int64_t K, const int64_t *cols, int64_t ncols,
                        int8_t *gathered) {
    for (int64_t n = n0; n < n1; n++)
        for (int64_t j = 0; j < ncols; j++) gathered[n * ncols + j] = B[n * K + cols[j]];
}

/* One output element, element by element (the path when the scratch could not be had). */
static int32_t dot_scalar(const int8_t *a, const int8_t *b, int64_t K) {
    uint32_t acc = 0;
    for (int64_t k = 0; k < K; k++) acc += (uint32_t)((int32_t)a[k] * (int32_t)b[k]);
    return (int32_t)acc;
}

static void rows_scalar(const int8_t *A, const int8_t *B, int32_t *out, int64_t n0, int64_t n1, int64_t M,
                        int64_t N, int64_t K) {
    for (int64_t n = n0; n < n1; n++)
        for (int64_t m = 0; m < M; m++) out[m * N + n] = dot_scalar(A + m * K, B + n * K, K);
}

#if defined(TF_AVX512)

#define STEP 32
/* Rows [n0, n1) against mc rows of the widened A (a16, row stride K). */
ALWAYS_INLINE void rows_vec(const int16_t *a16, const int8_t *B, int32_t *out, int64_t n0, int64_t n1,
                            int64_t N, int64_t K, const int mc) {
    const int64_t whole = K - K % STEP;
    const __mmask32 tail = (__mmask32)((1ull << (K % STEP)) - 1);
    for (int64_t n = n0; n < n1; n++) {
        const int8_t *b = B + n * K;
        __m512i acc[TOKENS];
        for (int m = 0; m < mc; m++) acc[m] = _mm512_setzero_si512();
        for (int64_t k = 0; k < whole; k += STEP) {
            PREFETCH(b, k, K);
            __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(b + k)));
            for (int m = 0; m < mc; m++)
                acc[m] = _mm512_add_epi32(acc[m], _mm512_madd_epi16(w, _mm512_loadu_si512(a16 + m * K + k)));
        }
        if (tail) {
            __m512i w = _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(tail, b + whole));
            for (int m = 0; m < mc; m++)
                acc[m] = _mm512_add_epi32(acc[m], _mm512_madd_epi16(w, _mm512_maskz_loadu_epi16(tail, a16 + m * K + whole)));
        }
        for (int m = 0; m < mc; m++) out[m * N + n] = _mm512_reduce_add_epi32(acc[m]);
    }
}

static void widen(const int8_t *A, int16_t *a16, int64_t count) {
    int64_t i = 0;
    for (; i + 32 <= count; i += 32)
        _mm512_storeu_si512(a16 + i, _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(A + i))));
    for (; i < count; i++) a16[i] = A[i];
}

#define VNNI __attribute__((target("avx512vnni,avx512bw,avx512f")))
#define VNNI_STEP 64

/* Rows [n0, n1) against mc rows of A shifted to unsigned (au, row stride K), by vpdpbusd. */
VNNI ALWAYS_INLINE void rows_vnni_vec(const uint8_t *au, const int8_t *B, int32_t *out, int64_t n0, int64_t n1,
                                      int64_t N, int64_t K, const int mc) {
    const int64_t whole = K - K % VNNI_STEP;
    const __mmask64 tail = (__mmask64)((K % VNNI_STEP) ? (1ull << (K % VNNI_STEP)) - 1 : 0);
    const __m512i ones = _mm512_set1_epi8(1);
    for (int64_t n = n0; n < n1; n++) {
        const int8_t *b = B + n * K;
        __m512i acc[TOKENS], sum = _mm512_setzero_si512();
        for (int m = 0; m < mc; m++) acc[m] = _mm512_setzero_si512();
        for (int64_t k = 0; k < whole; k += VNNI_STEP) {
            PREFETCH(b, k, K);
            __m512i w = _mm512_loadu_si512(b + k);
            sum = _mm512_dpbusd_epi32(sum, ones, w);
            for (int m = 0; m < mc; m++) acc[m] = _mm512_dpbusd_epi32(acc[m], _mm512_loadu_si512(au + m * K + k), w);
        }
        if (tail) {
            __m512i w = _mm512_maskz_loadu_epi8(tail, b + whole);
            sum = _mm512_dpbusd_epi32(sum, ones, w);
            for (int m = 0; m < mc; m++)
                acc[m] = _mm512_dpbusd_epi32(acc[m], _mm512_maskz_loadu_epi8(tail, au + m * K + whole), w);
        }
        uint32_t shift = 128u * (uint32_t)_mm512_reduce_add_epi32(sum);
        for (int m = 0; m < mc; m++) out[m * N + n] = (int32_t)((uint32_t)_mm512_reduce_add_epi32(acc[m]) - shift);
    }
}

#define FOR_TOKEN_COUNTS(CASE) CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)

VNNI static void rows_vnni(const uint8_t *au, const int8_t *B, int32_t *out, int64_t n0, int64_t n1, int64_t N,
                           int64_t K, int mc) {
    switch (mc) {
#define CASE(c) \
    case c: rows_vnni_vec(au, B, out, n0, n1, N, K, c); break;
        FOR_TOKEN_COUNTS(CASE)
#undef CASE
    }
}

static int has_vnni(void) { return __builtin_cpu_supports("avx512vnni"); }

#elif defined(TF_AVX2)

#define STEP 16
ALWAYS_INLINE int32_t hsum256_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(s);
}

ALWAYS_INLINE void rows_vec(const int16_t *a16, const int8_t *B, int32_t *out, int64_t n0, int64_t n1,
                            int64_t N, int64_t K, const int mc) {
    const int64_t whole = K - K % STEP;
    for (int64_t n = n0; n < n1; n++) {
        const int8_t *b = B + n * K;
        __m256i acc[TOKENS];
        for (int m = 0; m < mc; m++) acc[m] = _mm256_setzero_si256();
        for (int64_t k = 0; k < whole; k += STEP) {
            PREFETCH(b, k, K);
            __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + k)));
            for (int m = 0; m < mc; m++)
                acc[m] = _mm256_add_epi32(
                    acc[m], _mm256_madd_epi16(w, _mm256_loadu_si256((const __m256i *)(a16 + m * K + k))));
        }
        for (int m = 0; m < mc; m++) {
            uint32_t total = (uint32_t)hsum256_epi32(acc[m]);
            for (int64_t k = whole; k < K; k++) total += (uint32_t)((int32_t)a16[m * K + k] * (int32_t)b[k]);
            out[m * N + n] = (int32_t)total;
        }
    }
}

static void widen(const int8_t *A, int16_t *a16, int64_t count) {
    int64_t i = 0;
    for (; i + 16 <= count; i += 16)
        _mm256_storeu_si256((__m256i *)(a16 + i), _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(A + i))));
    for (; i < count; i++) a16[i] = A[i];
}

#else /* portable: fixed-width lanes of uint32 the compiler vectorizes (SSE2 on x86-64, NEON on ARM) */

#define STEP 16
ALWAYS_INLINE void rows_vec(const int16_t *a16, const int8_t *B, int32_t *out, int64_t n0, int64_t n1,
                            int64_t N, int64_t K, const int mc) {
    const int64_t whole = K - K % STEP;
    for (int64_t n = n0; n < n1; n++) {
        const int8_t *b = B + n * K;
        uint32_t acc[TOKENS][STEP] = {{0}};
        for (int64_t k = 0; k < whole; k += STEP) {
            PREFETCH(b, k, K);
            int32_t w[STEP];
            for (int t = 0; t < STEP; t++) w[t] = b[k + t];
            for (int m = 0; m < mc; m++)
                for (int t = 0; t < STEP; t++) acc[m][t] += (uint32_t)(w[t] * (int32_t)a16[m * K + k + t]);
        }
        for (int m = 0; m < mc; m++) {
            uint32_t total = 0;
            for (int t = 0; t < STEP; t++) total += acc[m][t];
            for (int64_t k = whole; k < K; k++) total += (uint32_t)((int32_t)a16[m * K + k] * (int32_t)b[k]);
            out[m * N + n] = (int32_t)total;
        }
    }
}

static void widen(const int8_t *A, int16_t *a16, int64_t count) {
    for (int64_t i = 0; i < count; i++) a16[i] = A[i];
}

#endif

/* One function per token count, so each has its accumulators in registers. */
#ifndef FOR_TOKEN_COUNTS
#define FOR_TOKEN_COUNTS(CASE) CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
#endif

static void rows(const int16_t *a16, const int8_t *B, int32_t *out, int64_t n0, int64_t n1, int64_t N, int64_t K,
                 int mc) {
    switch (mc) {
#define CASE(c) \
    case c: rows_vec(a16, B, out, n0, n1, N, K, c); break;
        FOR_TOKEN_COUNTS(CASE)
#undef CASE
    }
}

/* B's rows in chunks that stay in L1 while every group of A's rows reads them. */
#define CHUNK_BYTES (16 * 1024)

/* out[M x N] = A[M x K] @ B[N x K].T in int32; vnni: take vpdpbusd where the CPU has it (the
 * AVX-512 path). Rows of B are split into contiguous ranges, one per thread, so each thread
 * streams its own bytes. Where ncols > 0, B[:, cols] (each col in [0, K)) is also copied
 * into gathered (N x ncols). */
void tf_int8_matmul_rows(const int8_t *A, const int8_t *B, int32_t *out, int64_t M, int64_t N, int64_t K,
                         int64_t threads, int64_t vnni, const int64_t *cols, int64_t ncols, int8_t *gathered) {
    if (M <= 0 || N <= 0) return;
#if defined(TF_AVX512)
    uint8_t *au = vnni && K > 0 && has_vnni() ? (uint8_t *)malloc((size_t)(M * K)) : NULL;
    if (au) {
        for (int64_t i = 0; i < M * K; i++) au[i] = (uint8_t)(A[i] ^ 0x80); /* a + 128 */
        if (threads < 1) threads = 1;
        if (threads > N) threads = N;
        int64_t chunk = K < CHUNK_BYTES ? CHUNK_BYTES / K : 1;
#pragma omp parallel for num_threads((int)threads) schedule(static, 1)
        for (int64_t part = 0; part < threads; part++) {
            int64_t first = N * part / threads, last = N * (part + 1) / threads;
            for (int64_t n0 = first; n0 < last; n0 += chunk) {
                int64_t n1 = n0 + chunk < last ? n0 + chunk : last;
                for (int64_t m0 = 0; m0 < M; m0 += TOKENS) {
                    int mc = (int)(M - m0 < TOKENS ? M - m0 : TOKENS);
                    rows_vnni(au + m0 * K, B, out + m0 * N, n0, n1, N, K, mc);
                }
                if (ncols) gather_rows(B, n0, n1, K, cols, ncols, gathered);
            }
        }
        free(au);
        return;
    }
#else
    (void)vnni;
#endif
    int16_t *a16 = K > 0 ? (int16_t *)malloc((size_t)(M * K) * sizeof(int16_t)) : NULL;
    if (a16) widen(A, a16, M * K);
    if (threads < 1) threads = 1;
    if (threads > N) threads = N;
    int64_t chunk = K > 0 && K < CHUNK_BYTES ? CHUNK_BYTES / K : 1;
#pragma omp parallel for num_threads((int)threads) schedule(static, 1)
    for (int64_t part = 0; part < threads; part++) {
        int64_t first = N * part / threads, last = N * (part + 1) / threads;
        if (!a16) {
            rows_scalar(A, B, out, first, last, M, N, K);
            if (ncols) gather_rows(B, first, last, K, cols, ncols, gathered);
            continue;
        }
        for (int64_t n0 = first; n0 < last; n0 += chunk) {
            int64_t n1 = n0 + chunk < last ? n0 + chunk : last;
            for (int64_t m0 = 0; m0 < M; m0 += TOKENS) {
                int mc = (int)(M - m0 < TOKENS ? M - m0 : TOKENS);
                rows(a16 + m0 * K, B, out + m0 * N, n0, n1, N, K, mc);
            }
            if (ncols) gather_rows(B, n0, n1, K, cols, ncols, gathered);
        }
    }
    free(a16);
}
