/* A block's float32 scale as the blockwise formats store it: absmax[b], or double-quantized
 * as code2[qabsmax[b]] * absmax2[b / nested_blocksize] + offset, decoded in the reference's
 * float32 order (the kernels are built with -ffp-contract=off). Shared by the few-token kernels. */
#ifndef TIGHTFIT_BLOCK_SCALES_H
#define TIGHTFIT_BLOCK_SCALES_H

#include <stdint.h>

typedef struct {
    const float *absmax;
    const uint8_t *qabsmax;
    const float *code2;
    const float *absmax2;
    int64_t nested_blocksize;
    float offset;
} scales_t;

static inline __attribute__((always_inline)) float block_scale(const scales_t *s, int64_t b) {
    if (s->absmax) return s->absmax[b];
    float decoded = s->code2[s->qabsmax[b]] * s->absmax2[b / s->nested_blocksize];
    return decoded + s->offset;
}

#endif
