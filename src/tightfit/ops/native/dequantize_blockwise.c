/* Blockwise codes decoded into float32 or bfloat16: out[i] = table[code_i] * absmax[i / blocksize]
 * in float32, as the reference computes it, bfloat16 rounded to nearest even as torch rounds
 * (its NaN: 0x7FC0). 4-bit codes are packed two a byte, the first in the high nibble.
 *
 * The many-token forwards decode a tile of weight rows at a time through this and hand it to
 * the BLAS: OpenMP here is torch's own runtime, so no hand-off between two thread pools sits
 * between each tile's decode and its product. Each block's loop is branch-free per value
 * (the table scaled once per block, 4-bit codes a byte at a time) so the compiler vectorizes
 * it. The caller (Python) has checked every length.
 */
#include <stdint.h>
#include <string.h>

#include "vector.h"

ALWAYS_INLINE uint16_t to_bf16(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    uint16_t rounded = (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
    return (bits & 0x7FFFFFFFu) > 0x7F800000u ? (uint16_t)0x7FC0 : rounded;
}

#if defined(TF_AVX512)
/* 16 float32 values stored as they are or as bfloat16 rounded as to_bf16 rounds. */
ALWAYS_INLINE void store16(__m512 v, float *f32, uint16_t *bf16, int64_t i) {
    if (f32) {
        _mm512_storeu_ps(f32 + i, v);
        return;
    }
    __m512i bits = _mm512_castps_si512(v);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
    __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF)),
                                            _mm512_set1_epi32(0x7F800000));
    rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC0));
    _mm256_storeu_si256((__m256i *)(bf16 + i), _mm512_cvtepi32_epi16(rounded));
}

/* The vector part of a block: 32 values a step (16 bytes of 4-bit codes, or 2 x 16 codes);
 * returns where the element-by-element tail starts. */
ALWAYS_INLINE int64_t block_vector(const uint8_t *w, const int bits, const float *tab, int64_t i, int64_t end,
                                   float *f32, uint16_t *bf16) {
    if (bits == 4) {
        if (i & 1) return i;
        const __m512 table = _mm512_loadu_ps(tab);
        const __m512i first = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
        const __m512i second = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
        for (; i + 32 <= end; i += 32) {
            __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(w + (i >> 1))));
            __m512 hi = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
            __m512 lo = _mm512_permutexvar_ps(bytes, table);
            store16(_mm512_permutex2var_ps(hi, first, lo), f32, bf16, i);
            store16(_mm512_permutex2var_ps(hi, second, lo), f32, bf16, i + 16);
        }
        return i;
    }
    for (; i + 16 <= end; i += 16) {
        __m512i codes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(w + i)));
        store16(_mm512_i32gather_ps(codes, tab, 4), f32, bf16, i);
    }
    return i;
}
#else
ALWAYS_INLINE int64_t block_vector(const uint8_t *w, const int bits, const float *tab, int64_t i, int64_t end,
                                   float *f32, uint16_t *bf16) {
    (void)w, (void)bits, (void)tab, (void)end, (void)f32, (void)bf16;
    return i;
}
#endif

/* Values [start, end) of one block, whose scaled table is `tab` (16 or 256 entries). */
ALWAYS_INLINE void block_values(const uint8_t *w, const int bits, const float *tab, int64_t start, int64_t end,
                                float *f32, uint16_t *bf16) {
    int64_t i = block_vector(w, bits, tab, start, end, f32, bf16);
    if (bits == 4) {
        if (i & 1) { /* a block starting on a low nibble (odd blocksizes never occur for 4-bit, but be exact) */
            float v = tab[w[i >> 1] & 15];
            if (f32) f32[i] = v;
            else bf16[i] = to_bf16(v);
            i++;
        }
        int64_t pairs_end = start + ((end - i) & ~(int64_t)1) + (i - start);
        for (; i < pairs_end; i += 2) {
            uint8_t byte = w[i >> 1];
            float hi = tab[byte >> 4], lo = tab[byte & 15];
            if (f32) {
                f32[i] = hi;
                f32[i + 1] = lo;
            } else {
                bf16[i] = to_bf16(hi);
                bf16[i + 1] = to_bf16(lo);
            }
        }
        if (i < end) {
            float v = tab[w[i >> 1] >> 4];
            if (f32) f32[i] = v;
            else bf16[i] = to_bf16(v);
        }
    } else if (f32) {
        for (; i < end; i++) f32[i] = tab[w[i]];
    } else {
        for (; i < end; i++) bf16[i] = to_bf16(tab[w[i]]);
    }
}

/* out_bf16: 0 writes float32 values, 1 bfloat16 bits. */
void tf_dequantize_blockwise(const uint8_t *w, int64_t bits, const float *absmax, const float *table, int64_t numel,
                             int64_t blocksize, void *out, int64_t out_bf16, int64_t threads) {
    int64_t blocks = (numel + blocksize - 1) / blocksize;
    int entries = bits == 4 ? 16 : 256;
    if (threads < 1) threads = 1;
#pragma omp parallel for num_threads((int)threads) schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        float tab[256];
        for (int e = 0; e < entries; e++) tab[e] = table[e] * absmax[b]; /* the reference's product, exactly */
        int64_t start = b * blocksize, end = start + blocksize < numel ? start + blocksize : numel;
        float *f32 = out_bf16 ? NULL : (float *)out;
        uint16_t *bf16 = out_bf16 ? (uint16_t *)out : NULL;
        if (bits == 4) block_values(w, 4, tab, start, end, f32, bf16);
        else block_values(w, 8, tab, start, end, f32, bf16);
    }
}
