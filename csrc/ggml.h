/* Decoders for the ggml tensor types cism reads from GGUF files, to float32.
 *
 * The oracle is gguf-py's gguf.quants.dequantize: these match it bit for bit
 * (tests/test_ggml_quants.py, tests/test_loaders.py), computing what it
 * computes in its order: the sub-block scale first (d * sc), then the element
 * (dl * q), then the offset (- ml, + m). Every product is exact in float32:
 * an fp16 significand has 11 bits and the integer factors together at most
 * 12 more (Q6_K: |sc| <= 128 and |q - 32| <= 32), within float32's 24. So
 * only the final offset rounds, and neither the order of the products nor a
 * fused multiply-add (ggml-quants.c writes the same expressions, and a
 * llama.cpp build may contract them) can change a bit of a finite result.
 *
 * Plain C called with the GIL released: loading is not a hot path, but
 * numpy's mixed-dtype ufuncs allocate their cast buffers without the GIL and
 * crash the process when that allocation fails, so the loader's decode must
 * not depend on them.
 *
 * Block layouts (ggml-common.h), byte offsets within one block; fp16 fields
 * are little-endian IEEE binary16. QK_K = 256 elements per super-block. */
#ifndef CISM_GGML_H
#define CISM_GGML_H
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include "formats.h"

enum { CISM_GGML_F32 = 0, CISM_GGML_F16 = 1, CISM_GGML_Q4_0 = 2, CISM_GGML_Q4_1 = 3,
       CISM_GGML_Q5_0 = 6, CISM_GGML_Q5_1 = 7, CISM_GGML_Q8_0 = 8, CISM_GGML_Q2_K = 10,
       CISM_GGML_Q3_K = 11, CISM_GGML_Q4_K = 12, CISM_GGML_Q5_K = 13, CISM_GGML_Q6_K = 14,
       CISM_GGML_IQ4_NL = 20, CISM_GGML_IQ4_XS = 23, CISM_GGML_BF16 = 30 };

/* 32-element blocks. Nibble byte j holds element j (low) and j + 16 (high);
 * Q5's qh is a little-endian u32 whose bit i is the fifth bit of element i. */
enum { CISM_Q8_0_D = 0, CISM_Q8_0_QS = 2, CISM_Q8_0_BYTES = 34 };   /* d * q, q int8 */
enum { CISM_Q4_0_D = 0, CISM_Q4_0_QS = 2, CISM_Q4_0_BYTES = 18 };   /* d * (q - 8) */
enum { CISM_Q4_1_D = 0, CISM_Q4_1_M = 2, CISM_Q4_1_QS = 4, CISM_Q4_1_BYTES = 20 };  /* d * q + m */
enum { CISM_Q5_0_D = 0, CISM_Q5_0_QH = 2, CISM_Q5_0_QS = 6, CISM_Q5_0_BYTES = 22 }; /* d * (q - 16) */
enum { CISM_Q5_1_D = 0, CISM_Q5_1_M = 2, CISM_Q5_1_QH = 4, CISM_Q5_1_QS = 8,
       CISM_Q5_1_BYTES = 24 };                                      /* d * q + m */
enum { CISM_IQ4_NL_D = 0, CISM_IQ4_NL_QS = 2, CISM_IQ4_NL_BYTES = 18 };  /* d * levels[q] */

/* 256-element super-blocks, described at each decoder below. Q4_K and Q6_K
 * are cism storages too (q4_k, q6_k): their layout, offsets and decoders
 * (cism_ggml_q4_k, cism_ggml_q6_k, cism_ggml_scale_min_k4, cism_ggml_half)
 * live in formats.h, the one definition of every packed layout. */
enum { CISM_Q2_K_SCALES = 0, CISM_Q2_K_QS = 16, CISM_Q2_K_D = 80, CISM_Q2_K_DMIN = 82,
       CISM_Q2_K_BYTES = 84 };
enum { CISM_Q3_K_HMASK = 0, CISM_Q3_K_QS = 32, CISM_Q3_K_SCALES = 96, CISM_Q3_K_D = 108,
       CISM_Q3_K_BYTES = 110 };
enum { CISM_Q5_K_D = 0, CISM_Q5_K_DMIN = 2, CISM_Q5_K_SCALES = 4, CISM_Q5_K_QH = 16,
       CISM_Q5_K_QS = 48, CISM_Q5_K_BYTES = 176 };
enum { CISM_IQ4_XS_D = 0, CISM_IQ4_XS_SCALES_H = 2, CISM_IQ4_XS_SCALES_L = 4, CISM_IQ4_XS_QS = 8,
       CISM_IQ4_XS_BYTES = 136 };

_Static_assert(CISM_Q5_0_QS == CISM_Q5_0_QH + 4 && CISM_Q5_0_BYTES == CISM_Q5_0_QS + 16, "q5_0");
_Static_assert(CISM_Q5_1_QS == CISM_Q5_1_QH + 4 && CISM_Q5_1_BYTES == CISM_Q5_1_QS + 16, "q5_1");
_Static_assert(CISM_Q2_K_QS == CISM_QK_K / 16 && CISM_Q2_K_D == CISM_Q2_K_QS + CISM_QK_K / 4 &&
               CISM_Q2_K_BYTES == CISM_Q2_K_DMIN + 2, "q2_K");
_Static_assert(CISM_Q3_K_QS == CISM_QK_K / 8 && CISM_Q3_K_SCALES == CISM_Q3_K_QS + CISM_QK_K / 4 &&
               CISM_Q3_K_D == CISM_Q3_K_SCALES + 12 && CISM_Q3_K_BYTES == CISM_Q3_K_D + 2, "q3_K");
_Static_assert(CISM_Q5_K_QH == CISM_Q5_K_SCALES + 12 && CISM_Q5_K_QS == CISM_Q5_K_QH + CISM_QK_K / 8 &&
               CISM_Q5_K_BYTES == CISM_Q5_K_QS + CISM_QK_K / 2, "q5_K");
_Static_assert(CISM_IQ4_XS_QS == CISM_IQ4_XS_SCALES_L + CISM_QK_K / 64 &&
               CISM_IQ4_XS_BYTES == CISM_IQ4_XS_QS + CISM_QK_K / 2, "iq4_xs");

/* The 16 non-uniform levels of IQ4_NL and IQ4_XS (kvalues_iq4nl). */
static const int8_t cism_ggml_iq4_levels[16] = {
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

static inline uint32_t cism_ggml_u32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static void cism_ggml_q8_0(const uint8_t *raw, size_t blocks, float *out) {
    for (size_t b = 0; b < blocks; b++, raw += CISM_Q8_0_BYTES, out += 32) {
        const float d = cism_ggml_half(raw + CISM_Q8_0_D);
        for (int j = 0; j < 32; j++) out[j] = (float)(int8_t)raw[CISM_Q8_0_QS + j] * d;
    }
}

static void cism_ggml_q4_0(const uint8_t *raw, size_t blocks, float *out) {
    for (size_t b = 0; b < blocks; b++, raw += CISM_Q4_0_BYTES, out += 32) {
        const float d = cism_ggml_half(raw + CISM_Q4_0_D);
        const uint8_t *qs = raw + CISM_Q4_0_QS;
        for (int j = 0; j < 16; j++) {
            out[j] = (float)((qs[j] & 15) - 8) * d;
            out[j + 16] = (float)((qs[j] >> 4) - 8) * d;
        }
    }
}

static void cism_ggml_q4_1(const uint8_t *raw, size_t blocks, float *out) {
    for (size_t b = 0; b < blocks; b++, raw += CISM_Q4_1_BYTES, out += 32) {
        const float d = cism_ggml_half(raw + CISM_Q4_1_D), m = cism_ggml_half(raw + CISM_Q4_1_M);
        const uint8_t *qs = raw + CISM_Q4_1_QS;
        for (int j = 0; j < 16; j++) {
            out[j] = (float)(qs[j] & 15) * d + m;
            out[j + 16] = (float)(qs[j] >> 4) * d + m;
        }
    }
}

static void cism_ggml_q5_0(const uint8_t *raw, size_t blocks, float *out) {
    for (size_t b = 0; b < blocks; b++, raw += CISM_Q5_0_BYTES, out += 32) {
        const float d = cism_ggml_half(raw + CISM_Q5_0_D);
        const uint32_t qh = cism_ggml_u32(raw + CISM_Q5_0_QH);
        const uint8_t *qs = raw + CISM_Q5_0_QS;
        for (int j = 0; j < 16; j++) {
            const int lo = (qs[j] & 15) | (int)((qh >> j) & 1) << 4;
            const int hi = (qs[j] >> 4) | (int)((qh >> (j + 16)) & 1) << 4;
            out[j] = d * (float)(lo - 16);
            out[j + 16] = d * (float)(hi - 16);
        }
    }
}

static void cism_ggml_q5_1(const uint8_t *raw, size_t blocks, float *out) {
    for (size_t b = 0; b < blocks; b++, raw += CISM_Q5_1_BYTES, out += 32) {
        const float d = cism_ggml_half(raw + CISM_Q5_1_D), m = cism_ggml_half(raw + CISM_Q5_1_M);
        const uint32_t qh = cism_ggml_u32(raw + CISM_Q5_1_QH);
        const uint8_t *qs = raw + CISM_Q5_1_QS;
        for (int j = 0; j < 16; j++) {
            const int lo = (qs[j] & 15) | (int)((qh >> j) & 1) << 4;
            const int hi = (qs[j] >> 4) | (int)((qh >> (j + 16)) & 1) << 4;
            out[j] = d * (float)lo + m;
            out[j + 16] = d * (float)hi + m;
        }
    }
}

static void cism_ggml_iq4_nl(const uint8_t *raw, size_t blocks, float *out) {
    for (size_t b = 0; b < blocks; b++, raw += CISM_IQ4_NL_BYTES, out += 32) {
        const float d = cism_ggml_half(raw + CISM_IQ4_NL_D);
        const uint8_t *qs = raw + CISM_IQ4_NL_QS;
        for (int j = 0; j < 16; j++) {
            out[j] = d * (float)cism_ggml_iq4_levels[qs[j] & 15];
            out[j + 16] = d * (float)cism_ggml_iq4_levels[qs[j] >> 4];
        }
    }
}

/* The 2-bit codes of Q2_K and Q3_K: sub-block j (16 elements) of a
 * super-block reads bit pair j % 8 / 2 of the 16 bytes qs[32 * (j / 8) +
 * 16 * (j % 2) ...]: each 32-byte half of qs holds four 32-element runs. */
static inline const uint8_t *cism_ggml_q2_run(const uint8_t *qs, int j, int *shift) {
    *shift = 2 * (j % 8 / 2);
    return qs + 32 * (j / 8) + 16 * (j % 2);
}

/* Q2_K: 16 sub-blocks of 16. scales[j] holds sub-block j's scale (low
 * nibble) and min (high nibble); value = (d * sc) * q - (dmin * m). */
static void cism_ggml_q2_k(const uint8_t *raw, size_t blocks, float *out) {
    for (size_t b = 0; b < blocks; b++, raw += CISM_Q2_K_BYTES) {
        const float d = cism_ggml_half(raw + CISM_Q2_K_D), dmin = cism_ggml_half(raw + CISM_Q2_K_DMIN);
        for (int j = 0; j < 16; j++, out += 16) {
            const uint8_t sc = raw[CISM_Q2_K_SCALES + j];
            const float dl = d * (float)(sc & 15), ml = dmin * (float)(sc >> 4);
            int shift;
            const uint8_t *q = cism_ggml_q2_run(raw + CISM_Q2_K_QS, j, &shift);
            for (int l = 0; l < 16; l++) out[l] = dl * (float)((q[l] >> shift) & 3) - ml;
        }
    }
}

/* Q3_K: 16 sub-blocks of 16; 2-bit codes as Q2_K, plus a high bit: hmask
 * bit j / 2 of byte (16 * (j % 2) + l), set meaning no offset and clear
 * meaning -4, so q is in [-4, 3]. Six-bit scales, biased by 32: the low four
 * bits of scale j are byte j % 8 of scales (low nibble for j < 8, high for
 * j >= 8), the top two bits are bit pair j / 4 of byte 8 + j % 4.
 * value = (d * (scale - 32)) * q. */
static void cism_ggml_q3_k(const uint8_t *raw, size_t blocks, float *out) {
    for (size_t b = 0; b < blocks; b++, raw += CISM_Q3_K_BYTES) {
        const float d = cism_ggml_half(raw + CISM_Q3_K_D);
        const uint8_t *sc = raw + CISM_Q3_K_SCALES, *hmask = raw + CISM_Q3_K_HMASK;
        for (int j = 0; j < 16; j++, out += 16) {
            const int low = (sc[j % 8] >> (j < 8 ? 0 : 4)) & 15;
            const int high = (sc[8 + j % 4] >> (2 * (j / 4))) & 3;
            const float dl = d * (float)((low | high << 4) - 32);
            int shift;
            const uint8_t *q = cism_ggml_q2_run(raw + CISM_Q3_K_QS, j, &shift);
            const uint8_t *h = hmask + 16 * (j % 2);
            for (int l = 0; l < 16; l++) {
                const int hbit = (h[l] >> (j / 2)) & 1;
                out[l] = dl * (float)(((q[l] >> shift) & 3) - (hbit ? 0 : 4));
            }
        }
    }
}

/* Q5_K: Q4_K plus a fifth bit, bit j of qh[l] for element l of sub-block j. */
static void cism_ggml_q5_k(const uint8_t *raw, size_t blocks, float *out) {
    for (size_t b = 0; b < blocks; b++, raw += CISM_Q5_K_BYTES) {
        const float d = cism_ggml_half(raw + CISM_Q5_K_D), dmin = cism_ggml_half(raw + CISM_Q5_K_DMIN);
        const uint8_t *qh = raw + CISM_Q5_K_QH;
        for (int j = 0; j < 8; j++, out += 32) {
            int sc, m;
            cism_ggml_scale_min_k4(raw + CISM_Q5_K_SCALES, j, &sc, &m);
            const float dl = d * (float)sc, ml = dmin * (float)m;
            const uint8_t *q = raw + CISM_Q5_K_QS + 32 * (j / 2);
            const int shift = 4 * (j % 2);
            for (int l = 0; l < 32; l++) {
                const int code = ((q[l] >> shift) & 15) | ((qh[l] >> j) & 1) << 4;
                out[l] = dl * (float)code - ml;
            }
        }
    }
}

/* IQ4_XS: 8 sub-blocks of 32, each an IQ4_NL block without its own d:
 * nibble bytes qs[16j ...] (element l low, l + 16 high). Six-bit scales
 * biased by 32: low four bits in nibble j % 2 of scales_l[j / 2], top two in
 * bit pair j of the little-endian u16 scales_h. value = (d * (ls - 32)) * level. */
static void cism_ggml_iq4_xs(const uint8_t *raw, size_t blocks, float *out) {
    for (size_t b = 0; b < blocks; b++, raw += CISM_IQ4_XS_BYTES) {
        const float d = cism_ggml_half(raw + CISM_IQ4_XS_D);
        const unsigned scales_h = raw[CISM_IQ4_XS_SCALES_H] | raw[CISM_IQ4_XS_SCALES_H + 1] << 8;
        for (int j = 0; j < 8; j++, out += 32) {
            const int low = (raw[CISM_IQ4_XS_SCALES_L + j / 2] >> (4 * (j % 2))) & 15;
            const int high = (scales_h >> (2 * j)) & 3;
            const float dl = d * (float)((low | high << 4) - 32);
            const uint8_t *qs = raw + CISM_IQ4_XS_QS + 16 * j;
            for (int l = 0; l < 16; l++) {
                out[l] = dl * (float)cism_ggml_iq4_levels[qs[l] & 15];
                out[l + 16] = dl * (float)cism_ggml_iq4_levels[qs[l] >> 4];
            }
        }
    }
}

/* Decode `count` elements (whole blocks) of type `type` from raw into out.
 * Returns 0, or -1 for a type this file does not decode. */
static inline int cism_ggml_decode(int type, const uint8_t *raw, size_t count, float *out) {
    size_t i;
    switch (type) {
    case CISM_GGML_F32:
        for (i = 0; i < count; i++) out[i] = cism_bits_to_f32(cism_ggml_u32(raw + 4 * i));
        return 0;
    case CISM_GGML_F16:
        for (i = 0; i < count; i++) out[i] = cism_ggml_half(raw + 2 * i);
        return 0;
    case CISM_GGML_BF16:   /* the top half of a float32: widening is exact */
        for (i = 0; i < count; i++)
            out[i] = cism_bits_to_f32((uint32_t)(raw[2 * i] | (raw[2 * i + 1] << 8)) << 16);
        return 0;
    case CISM_GGML_Q8_0: cism_ggml_q8_0(raw, count / 32, out); return 0;
    case CISM_GGML_Q4_0: cism_ggml_q4_0(raw, count / 32, out); return 0;
    case CISM_GGML_Q4_1: cism_ggml_q4_1(raw, count / 32, out); return 0;
    case CISM_GGML_Q5_0: cism_ggml_q5_0(raw, count / 32, out); return 0;
    case CISM_GGML_Q5_1: cism_ggml_q5_1(raw, count / 32, out); return 0;
    case CISM_GGML_IQ4_NL: cism_ggml_iq4_nl(raw, count / 32, out); return 0;
    case CISM_GGML_Q2_K: cism_ggml_q2_k(raw, count / CISM_QK_K, out); return 0;
    case CISM_GGML_Q3_K: cism_ggml_q3_k(raw, count / CISM_QK_K, out); return 0;
    case CISM_GGML_Q4_K: cism_ggml_q4_k(raw, count / CISM_QK_K, out); return 0;
    case CISM_GGML_Q5_K: cism_ggml_q5_k(raw, count / CISM_QK_K, out); return 0;
    case CISM_GGML_Q6_K: cism_ggml_q6_k(raw, count / CISM_QK_K, out); return 0;
    case CISM_GGML_IQ4_XS: cism_ggml_iq4_xs(raw, count / CISM_QK_K, out); return 0;
    }
    return -1;
}
#endif
