/* Blockwise codes decoded into float32 or bfloat16: out[i] = table[code_i] * absmax[i / blocksize]
 * in float32, as the reference computes it, bfloat16 rounded to nearest even as torch rounds
 * (its NaN: 0x7FC0). 4-bit codes are packed two a byte, the first in the high nibble.
 *
 * The many-token forwards decode a tile of weight rows at a time through this and hand it to
 * the BLAS: OpenMP here is torch's own runtime, so no hand-off between two thread pools sits
 * between each tile's decode and its product. The caller (Python) has checked every length.
 */
#include <stdint.h>
#include <string.h>

static inline uint16_t to_bf16(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
    return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

static inline float code_at(const uint8_t *w, int bits, int64_t i, const float *table) {
    if (bits == 8) return table[w[i]];
    uint8_t byte = w[i >> 1];
    return table[(i & 1) ? (byte & 15) : (byte >> 4)];
}

/* out_bf16: 0 writes float32 values, 1 bfloat16 bits. */
void tf_dequantize_blockwise(const uint8_t *w, int64_t bits, const float *absmax, const float *table, int64_t numel,
                             int64_t blocksize, void *out, int64_t out_bf16, int64_t threads) {
    int64_t blocks = (numel + blocksize - 1) / blocksize;
    if (threads < 1) threads = 1;
#pragma omp parallel for num_threads((int)threads) schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        float scale = absmax[b];
        int64_t start = b * blocksize, end = start + blocksize < numel ? start + blocksize : numel;
        if (out_bf16) {
            uint16_t *dst = (uint16_t *)out;
            for (int64_t i = start; i < end; i++) dst[i] = to_bf16(code_at(w, (int)bits, i, table) * scale);
        } else {
            float *dst = (float *)out;
            for (int64_t i = start; i < end; i++) dst[i] = code_at(w, (int)bits, i, table) * scale;
        }
    }
}
