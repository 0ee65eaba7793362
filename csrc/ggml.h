/* Decoders for the ggml tensor types cism reads from GGUF files (layouts in
 * cism/loaders/ggml_types.py, whose numpy versions are the reference these
 * match bit for bit). Plain C called with the GIL released: loading is not a
 * hot path, but numpy's mixed-dtype ufuncs allocate their cast buffers
 * without the GIL and crash the process when that allocation fails, so the
 * loader's worker threads must not depend on them. Values are rounded as
 * the reference rounds them: (q - 8) * d for Q4_0, q * d then + m for Q4_1
 * (two roundings: build without floating-point contraction). */
#ifndef CISM_GGML_H
#define CISM_GGML_H
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include "formats.h"

enum { CISM_GGML_F32 = 0, CISM_GGML_F16 = 1, CISM_GGML_Q4_0 = 2, CISM_GGML_Q4_1 = 3,
       CISM_GGML_Q8_0 = 8, CISM_GGML_BF16 = 30 };

static inline float cism_ggml_half(const uint8_t *p) {
    return cism_fp16_to_f32((uint16_t)(p[0] | (p[1] << 8)));   /* little-endian in the file */
}

/* Decode `count` elements (whole blocks) of type `type` from raw into out.
 * Returns 0, or -1 for a type this file does not decode. */
static inline int cism_ggml_decode(int type, const uint8_t *raw, size_t count, float *out) {
    size_t i, b;
    int j;
    switch (type) {
    case CISM_GGML_F32:
        for (i = 0; i < count; i++) {
            uint32_t u = (uint32_t)raw[4 * i] | (uint32_t)raw[4 * i + 1] << 8 |
                         (uint32_t)raw[4 * i + 2] << 16 | (uint32_t)raw[4 * i + 3] << 24;
            out[i] = cism_bits_to_f32(u);
        }
        return 0;
    case CISM_GGML_F16:
        for (i = 0; i < count; i++) out[i] = cism_ggml_half(raw + 2 * i);
        return 0;
    case CISM_GGML_BF16:
        for (i = 0; i < count; i++)
            out[i] = cism_bits_to_f32((uint32_t)(raw[2 * i] | (raw[2 * i + 1] << 8)) << 16);
        return 0;
    case CISM_GGML_Q8_0:
        for (b = 0; b < count / 32; b++, raw += 34, out += 32) {
            const float d = cism_ggml_half(raw);
            for (j = 0; j < 32; j++) out[j] = (float)(int8_t)raw[2 + j] * d;
        }
        return 0;
    case CISM_GGML_Q4_0:
        for (b = 0; b < count / 32; b++, raw += 18, out += 32) {
            const float d = cism_ggml_half(raw);
            for (j = 0; j < 16; j++) {
                out[j] = ((float)(raw[2 + j] & 15) - 8.0f) * d;
                out[j + 16] = ((float)(raw[2 + j] >> 4) - 8.0f) * d;
            }
        }
        return 0;
    case CISM_GGML_Q4_1:
        for (b = 0; b < count / 32; b++, raw += 20, out += 32) {
            const float d = cism_ggml_half(raw), m = cism_ggml_half(raw + 2);
            for (j = 0; j < 16; j++) {
                float lo = (float)(raw[4 + j] & 15) * d, hi = (float)(raw[4 + j] >> 4) * d;
                out[j] = lo + m;
                out[j + 16] = hi + m;
            }
        }
        return 0;
    }
    return -1;
}
#endif
