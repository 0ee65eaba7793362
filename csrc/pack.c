/* Packing float32 rows into the storage formats of formats.h.
 * Portable C (no ISA flags): packing happens once at load. The Cython caller
 * fans row ranges out over threads; each row is packed independently. */
#include "pack.h"

#include <float.h>
#include <math.h>

static void pack_fp16(const float *v, size_t cols, uint16_t *out) {
    for (size_t j = 0; j < cols; j++) out[j] = cism_f32_to_fp16(v[j]);
}

/* int8 rows: scale = absmax / 127, code = round half away from zero of
 * v / scale, clamped to [-127, 127]. Written without libm calls so that the
 * compiler vectorises both loops (with -fno-trapping-math, set for this file
 * in setup.py; 8x faster than fmaxf/roundf/fminf per weight at load). The results equal those of that definition for every
 * float, NaN and infinities included (checked over all 2^32 inputs):
 * - the absmax is an integer maximum of the magnitude bits, which orders
 *   non-negative floats as the floats themselves; NaN bits are skipped as
 *   fmaxf skips NaN;
 * - rounding: t = trunc(x) is exact for |x| <= 128 (x is clamped there
 *   first, NaN to -128), x - t is then exact, and t moves one away from
 *   zero when the remainder reaches one half. */
static inline uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

static void pack_int8(const float *v, size_t cols, int8_t *out, float *scale) {
    int32_t mbits = 0; /* magnitude bits fit in 31 bits: signed compares vectorise on SSE2 */
    for (size_t j = 0; j < cols; j++) {
        int32_t a = (int32_t)(f32_bits(v[j]) & 0x7fffffffu);
        a = a > 0x7f800000 ? 0 : a; /* NaN */
        mbits = a > mbits ? a : mbits;
    }
    float m;
    memcpy(&m, &mbits, 4);
    const float s = m == 0.0f ? 1.0f : fmaxf(m / 127.0f, FLT_TRUE_MIN);
    *scale = s;
    for (size_t j = 0; j < cols; j++) {
        float x = v[j] / s;
        x = x == x ? x : -128.0f;
        x = x < -128.0f ? -128.0f : x;
        x = x > 128.0f ? 128.0f : x;
        int32_t t = (int32_t)x;
        const float rem = x - (float)t;
        t += (rem >= 0.5f) - (rem <= -0.5f);
        t = t < -127 ? -127 : t;
        t = t > 127 ? 127 : t;
        out[j] = (int8_t)t;
    }
}

static void pack_int4(const float *v, size_t cols, uint8_t *out) {
    const size_t blocks = cism_div_up(cols, CISM_INT4_BLOCK);
    memset(out, 0, blocks * CISM_INT4_BLOCK_BYTES);
    uint8_t *scale_bytes = out + cism_code_bytes(CISM_INT4, cols);
    for (size_t b = 0; b < blocks; b++) {
        const size_t start = b * 32, end = start + 32 < cols ? start + 32 : cols;
        /* signed extreme: the first element of largest magnitude keeps its sign,
         * so it maps exactly onto code 0 (-8 * scale) */
        float extreme = 0.0f;
        for (size_t j = start; j < end; j++)
            if (fabsf(v[j]) > fabsf(extreme)) extreme = v[j];
        const float s = extreme == 0.0f ? 1.0f : extreme / -8.0f;
        memcpy(scale_bytes + 4 * b, &s, 4);
        for (size_t j = start; j < end; j++) {
            int code = (int)(v[j] / s + 8.5f); /* truncation toward zero */
            code = code < 0 ? 0 : code > 15 ? 15 : code;
            const size_t t = j - start;
            out[b * 16 + (t % 16)] |= (uint8_t)(code << (t < 16 ? 0 : 4));
        }
    }
}

static void pack_fp4(const float *v, size_t cols, uint8_t *out) {
    memset(out, 0, cism_code_bytes(CISM_FP4, cols));
    uint8_t *scales = out + cism_code_bytes(CISM_FP4, cols);
    for (size_t start = 0, b = 0; start < cols; start += 16, b++) {
        const size_t end = start + 16 < cols ? start + 16 : cols;
        float m = 0.0f;
        for (size_t j = start; j < end; j++) m = fmaxf(m, fabsf(v[j]));
        const uint8_t bits = cism_f32_to_e4m3(m / 6.0f);
        scales[b] = bits;
        const float s = cism_e4m3_to_f32(bits);
        const float safe = s > 0.0f ? s : 1.0f; /* all-zero (or vanishing) block */
        for (size_t j = start; j < end; j++) {
            const float mag = fabsf(v[j]) / safe;
            int best = 0;
            float best_err = INFINITY;
            for (int k = 0; k < 8; k++) {
                const float err = fabsf(mag - (float)cism_e2m1_x2[k] * 0.5f);
                if (err < best_err) { best_err = err; best = k; }
            }
            const int nibble = v[j] < 0.0f ? (best | 8) : best;
            out[j / 2] |= (uint8_t)(nibble << (4 * (j % 2)));
        }
    }
}

void cism_pack_rows(int storage, const float *values, size_t cols, size_t r0, size_t r1,
                    void *codes, float *row_scales) {
    const size_t row_bytes = cism_row_bytes(storage, cols);
    for (size_t r = r0; r < r1; r++) {
        const float *v = values + r * cols;
        uint8_t *dst = (uint8_t *)codes + r * row_bytes;
        switch (storage) {
        case CISM_FP32: memcpy(dst, v, cols * sizeof(float)); break;
        case CISM_FP16: pack_fp16(v, cols, (uint16_t *)dst); break;
        case CISM_INT8: pack_int8(v, cols, (int8_t *)dst, row_scales + r); break;
        case CISM_INT4: pack_int4(v, cols, dst); break;
        case CISM_FP4: pack_fp4(v, cols, dst); break;
        default: break; /* q4_k, q6_k: only ever a GGUF file's own blocks (Matrix.from_ggml) */
        }
    }
}

/* Row r back to floats, exactly as the kernels see it (int8 with its scale). */
void cism_unpack_row(const cism_mat *W, size_t r, float *out) {
    cism_dequant_row(W, r, out, 1);
}
