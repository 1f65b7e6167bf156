/* The caller's float dtypes, read and written here as torch converts them, so a kernel takes
 * its activations and writes its output in the model's dtype: a decoding step then runs no
 * conversion op before or after the kernel (each costs microseconds of dispatch, several
 * times the kernel's own work on a small weight). dtype 0 is float32, 1 bfloat16, 2 float16;
 * floats are widened from and rounded to their bits by hand (round half to even, NaN kept). */
#ifndef TIGHTFIT_DTYPES_H
#define TIGHTFIT_DTYPES_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define F32 0
#define BF16 1
#define F16 2

static inline float as_float(uint32_t bits) {
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

static inline uint32_t bits_of(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    return bits;
}

static inline float half_to_float(uint16_t half) {
    uint32_t word = half, exponent = (word >> 10) & 0x1F, mantissa = word & 0x3FF, size;
    if (exponent == 0) size = bits_of((float)mantissa * 5.9604644775390625e-08f); /* mantissa * 2**-24, exact */
    else if (exponent == 0x1F) size = 0x7F800000u | (mantissa << 13);          /* inf, NaN */
    else size = ((exponent + 112) << 23) | (mantissa << 13);
    return as_float(size | ((word & 0x8000u) << 16));
}

static inline float widen(const void *data, int dtype, int64_t i) {
    if (dtype == F32) return ((const float *)data)[i];
    if (dtype == BF16) return as_float((uint32_t)((const uint16_t *)data)[i] << 16);
    return half_to_float(((const uint16_t *)data)[i]);
}

static inline void store(void *data, int dtype, int64_t i, float value) {
    uint32_t word = bits_of(value);
    if (dtype == F32) {
        ((float *)data)[i] = value;
    } else if (dtype == BF16) {
        uint32_t rounded = (uint32_t)(word + 0x7FFFu + ((word >> 16) & 1u)) >> 16;
        ((uint16_t *)data)[i] = (uint16_t)(value != value ? 0x7FC0u : rounded);
    } else {
        uint32_t size = word & 0x7FFFFFFFu, half;
        if (size >= 0x47800000u) half = size > 0x7F800000u ? 0x7E00u : 0x7C00u; /* NaN, or 2**16 and past */
        else if (size < 0x38800000u) half = bits_of(as_float(size) + 0.5f) - 0x3F000000u; /* subnormal */
        else half = (uint32_t)(size + 0xC8000FFFu + ((size >> 13) & 1u)) >> 13; /* a carry rounds up to inf */
        ((uint16_t *)data)[i] = (uint16_t)(half | ((word >> 16) & 0x8000u));
    }
}

/* n values of data (dtype) in float32: data itself for float32, else a copy the caller frees
 * with release_floats (NULL: no memory). */
static inline float *floats_in(const void *data, int64_t dtype, int64_t n) {
    if (dtype == F32) return (float *)data;
    float *copy = (float *)malloc((size_t)(n > 0 ? n : 1) * sizeof(float));
    if (copy)
        for (int64_t i = 0; i < n; i++) copy[i] = widen(data, (int)dtype, i);
    return copy;
}

/* Where a kernel writes its float32 results for out (dtype): out itself for float32, else
 * scratch that floats_out rounds into out and frees (NULL: no memory). */
static inline float *floats_for(void *out, int64_t dtype, int64_t n) {
    if (dtype == F32) return (float *)out;
    return (float *)malloc((size_t)(n > 0 ? n : 1) * sizeof(float));
}

static inline void floats_out(float *values, void *out, int64_t dtype, int64_t n) {
    if (dtype == F32) return;
    for (int64_t i = 0; i < n; i++) store(out, (int)dtype, i, values[i]);
    free(values);
}

static inline void release_floats(const float *copy, const void *data) {
    if ((const void *)copy != data) free((void *)copy);
}

/* Where no scratch could be had: NaN in every output, so the caller sees no stale data. */
static inline void fill_nan(void *out, int64_t dtype, int64_t n) {
    for (int64_t i = 0; i < n; i++) store(out, (int)dtype, i, NAN);
}

#endif
