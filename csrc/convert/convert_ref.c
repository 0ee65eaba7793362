/* Scalar reference of the conversions: floats to binary16 (to_f16, the
 * fp16 KV caches) and to q8 activations (quant8: per 32-element block,
 * rint(x * 127/absmax), kernels.h). Every SIMD variant must return exactly
 * what these loops return. Compiled without any -m flag. */
#include "kernels.h"

#include <math.h>

static void to_f16_ref(const float *x, size_t n, uint16_t *out, size_t stride) {
    for (size_t i = 0; i < n; i++) out[i * stride] = cism_f32_to_fp16(x[i]);
}

static float block_absmax(const float *x, size_t start, size_t n) {
    float m = 0.0f;
    for (size_t i = start; i < start + 32 && i < n; i++) {
        const float v = fabsf(x[i]);
        m = v > m ? v : m;
    }
    return m;
}

static void quant8_ref(const float *x, size_t n, int8_t *q, float *scales) {
    const size_t len = cism_act_len(n);
    for (size_t b = 0; b * 32 < len; b++) {
        float m = b * 32 < n ? block_absmax(x, b * 32, n) : 0.0f;
        const float norm = quant_norm(&m, 127.0f);
        scales[b] = m / 127.0f;
        for (size_t i = b * 32; i < b * 32 + 32; i++) {
            float v = i < n ? rintf(x[i] * norm) : 0.0f;
            v = v < 127.0f ? v : 127.0f;
            v = v > -127.0f ? v : -127.0f;
            q[i] = (int8_t)v;
        }
    }
}

void cism_fill_convert_ref(cism_kernels *k) {
    k->to_f16 = to_f16_ref;
    k->quant8 = quant8_ref;
    k->name_quant = "ref";
}
