/* LLM.int8()'s row-wise steps for few rows, one thread: the activations' quantization and
 * the product's dequantization, bit for bit what the numba kernels in _kernels_int8_rows.py
 * compute (and so the reference): this is their port, taken where a call is small, since
 * numba's dispatch cost per call (tens of microseconds, hundreds in a decoding model) was
 * more than the work. Plain C: the same on every instruction-set path.
 *
 * Floats are widened and rounded as torch does (dtypes.h). Built with -ffp-contract=off, so
 * each product and sum rounds to float32 as the reference's do. The caller (Python) has checked every length,
 * dtype and stride (D9). */
#include "dtypes.h"

/* Rows of x (M x K, dtype) to int8 codes q, each row's scale (its largest |value| below
 * limit) in row_stats; columns holding a value at or past the limit are flagged in outlier
 * and coded 0 in every row; a row holding NaN or inf is only flagged in bad. */
void tf_int8_quant_rows(const void *x, int64_t dtype, int64_t M, int64_t K, float limit, int8_t *q, float *row_stats,
                        uint8_t *outlier, uint8_t *bad) {
    const uint32_t limit_bits = bits_of(limit);
    int any_outlier = 0;
    for (int64_t r = 0; r < M; r++) {
        uint32_t largest = 0, any_size = 0;
        for (int64_t k = 0; k < K; k++) {
            uint32_t size = bits_of(widen(x, (int)dtype, r * K + k)) & 0x7FFFFFFFu;
            any_size = size > any_size ? size : any_size;
            if (size < limit_bits && size > largest) largest = size;
        }
        if (any_size >= 0x7F800000u) {
            bad[r] = 1;
            continue;
        }
        float stat = as_float(largest);
        /* 127 times the reciprocal, each rounded to float32, as torch computes 127.0 / row_stats */
        float scale = largest > 0 ? (1.0f / stat) * 127.0f : 0.0f;
        for (int64_t k = 0; k < K; k++) {
            float value = widen(x, (int)dtype, r * K + k);
            if ((bits_of(value) & 0x7FFFFFFFu) < limit_bits) {
                /* adding and taking 1.5 * 2**23 rounds |x| <= 128 half to even */
                q[r * K + k] = (int8_t)((value * scale + 12582912.0f) - 12582912.0f);
            } else {
                q[r * K + k] = 0;
                outlier[k] = 1;
                any_outlier = 1;
            }
        }
        row_stats[r] = stat;
    }
    if (any_outlier)
        for (int64_t r = 0; r < M; r++)
            for (int64_t k = 0; k < K; k++)
                if (outlier[k]) q[r * K + k] = 0;
}

/* out = float32(product) * (row_stats * col_stats) * scale (+ bias), in that order in float32,
 * then rounded to out's dtype; bias_dtype < 0: no bias. */
void tf_int8_dequant_rows(const int32_t *product, int64_t M, int64_t N, const float *row_stats,
                          const float *col_stats, float scale, const void *bias, int64_t bias_dtype, void *out,
                          int64_t out_dtype) {
    for (int64_t r = 0; r < M; r++)
        for (int64_t c = 0; c < N; c++) {
            float value = (float)product[r * N + c] * (row_stats[r] * col_stats[c]) * scale;
            if (bias_dtype >= 0) value = value + widen(bias, (int)bias_dtype, c);
            store(out, (int)out_dtype, r * N + c, value);
        }
}

void tf_int8_matmul_rows(const int8_t *A, const int8_t *B, int32_t *out, int64_t M, int64_t N, int64_t K,
                         int64_t threads, int64_t vnni, const int64_t *cols, int64_t ncols, int8_t *gathered);

/* LLM.int8() for few rows in one call, the three steps above and int8_rows.c's product in
 * sequence: returns 1 where a row holds NaN or inf and 2 where a column holds an outlier
 * (nothing written to out then: the caller raises, or runs the steps one by one, which
 * multiply the outlier columns in float), else 0 with out written. Scratch: q (M x K),
 * row_stats (M), outlier (K, zeroed), bad (M, zeroed), product (M x N). */
int64_t tf_int8_linear_rows(const void *x, int64_t dtype, int64_t M, int64_t K, float limit, const int8_t *W,
                            int64_t N, const float *SCB, float scale, const void *bias, int64_t bias_dtype, void *out,
                            int64_t out_dtype, int64_t threads, int64_t vnni, int8_t *q, float *row_stats,
                            uint8_t *outlier, uint8_t *bad, int32_t *product) {
    tf_int8_quant_rows(x, dtype, M, K, limit, q, row_stats, outlier, bad);
    for (int64_t r = 0; r < M; r++)
        if (bad[r]) return 1;
    for (int64_t k = 0; k < K; k++)
        if (outlier[k]) return 2;
    tf_int8_matmul_rows(q, W, product, M, N, K, threads, vnni, NULL, 0, NULL);
    tf_int8_dequant_rows(product, M, N, row_stats, SCB, scale, bias, bias_dtype, out, out_dtype);
    return 0;
}
