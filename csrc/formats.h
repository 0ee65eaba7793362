/* Weight storage formats: the single definition of every packed layout.
 *
 * The Cython side mirrors this header in cism/_kernels.pxd; the packing
 * rules live in pack.c, and tests/test_matrix.py restates them in NumPy
 * (np_int8, np_int4, np_fp4; test_packing_matches_numpy_rules).
 *
 * All packed buffers cism allocates are 64-byte aligned and followed by
 * CISM_SLACK zero bytes, so SIMD kernels may read a whole vector past the
 * last row without leaving the allocation. Kernels never fold an over-read
 * element in (masked or -0 lanes, or a zero activation), so the slack never
 * changes a result whatever it holds. What a kernel may rely on is less:
 * the element alignment (4 bytes fp32; 2 fp16, q4_k, q6_k: weights are only
 * read with unaligned or masked vector loads) and CISM_SLACK readable bytes
 * after the last row, which is all a matrix mapped from its file gets
 * (cism/loaders/mapping.py).
 */
#ifndef CISM_FORMATS_H
#define CISM_FORMATS_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define CISM_SLACK 128

typedef enum {
    CISM_FP32 = 0, /* float[rows][cols] */
    CISM_FP16 = 1, /* uint16 IEEE binary16 [rows][cols], round to nearest even */
    CISM_INT8 = 2, /* int8[rows][cols] + float scale[rows]:
                      scale = max(absmax/127, FLT_TRUE_MIN) (1 for an all-zero row),
                      code = clamp(roundf(x/scale), -127, 127) (half away from zero) */
    CISM_INT4 = 3, /* per 32-element block: 16 code bytes + one float scale.
                      scale = (signed value of largest magnitude) / -8 (1 for an all-zero block),
                      code = clamp(trunc(x/scale + 8.5), 0, 15), value = (code-8)*scale.
                      Byte t of a block holds element t in its low nibble and
                      element t+16 in its high nibble. Every block takes 16 bytes,
                      a partial tail block too (missing elements keep code 0).
                      Row layout: [blocks32][16] code bytes, then [blocks32] float scales,
                      so one row is one contiguous stream. */
    CISM_FP4 = 4,  /* E2M1 nibbles, one E4M3 scale byte per 16 elements.
                      scale byte = E4M3 nearest-even encoding of absmax/6 (subnormals kept,
                      saturating at 448), element = nearest of the 8 E2M1 magnitudes of
                      |x|/scale (ties to the smaller), sign in bit 3. Element j of a row
                      sits in byte j/2, low nibble for even j, high for odd j.
                      Row layout: [blocks16][8] code bytes (zero padded), then
                      [blocks16] scale bytes. */
    /* ggml's K-quants, kept as the GGUF file has them (cols a multiple of 256):
     * a row is the file's super-blocks for that row, in order, byte for byte
     * (layouts below, "ggml K-quant super-blocks"); nothing is re-rounded. */
    CISM_Q4K = 5,  /* block_q4_K: 144 bytes per 256 elements (4.5 bits per weight) */
    CISM_Q6K = 6   /* block_q6_K: 210 bytes per 256 elements (6.5625 bits per weight) */
} cism_storage;

#define CISM_NUM_STORAGES 7
#define CISM_INT4_BLOCK 32
#define CISM_INT4_BLOCK_BYTES 16
#define CISM_FP4_BLOCK 16
#define CISM_ACT_BLOCK 32 /* quantized-activation (q8) block */

_Static_assert(CISM_INT4_BLOCK_BYTES * 2 == CISM_INT4_BLOCK, "two int4 codes per byte");
_Static_assert(CISM_FP4_BLOCK % 2 == 0, "fp4 blocks hold whole bytes");
_Static_assert(CISM_ACT_BLOCK == CISM_INT4_BLOCK, "int4 weights and activations share blocks");
_Static_assert(CISM_ACT_BLOCK == 2 * CISM_FP4_BLOCK, "two fp4 scale blocks per activation block");
_Static_assert(sizeof(float) == 4 && sizeof(uint16_t) == 2, "IEEE binary32/binary16 sizes");

/* ---- ggml K-quant super-blocks: the q4_k and q6_k storages ----
 * Byte offsets within one 256-element super-block (ggml-common.h's
 * block_q4_K and block_q6_K); fp16 fields are little-endian IEEE binary16.
 * csrc/ggml.h decodes the same blocks for the loader (cism_ggml_q4_k and
 * cism_ggml_q6_k live here, so the loader, row() and the kernels read one
 * definition).
 *
 * Q4_K: d, dmin, 12 bytes of packed 6-bit scales and mins, 128 bytes of
 *   nibbles. 8 sub-blocks of 32: sub-block j takes nibble j % 2 (low first)
 *   of qs[32 (j / 2) + l], l < 32; its scale sc_j and min m_j (0..63) as
 *   cism_ggml_scale_min_k4 unpacks them.   value = (d * sc_j) * q - (dmin * m_j)
 * Q6_K: 128 bytes ql, 64 bytes qh, 16 int8 scales, d. 8 runs of 32: run g
 *   (elements 32g ...), h = g / 4, r = g % 4, takes its low four bits from
 *   nibble r / 2 of ql[64 h + 32 (r % 2) + l] and its top two from bit pair
 *   r of qh[32 h + l]; element l's scale is scales[2g + l / 16].
 *   value = (d * scale) * (code - 32), code in 0..63 */
#define CISM_QK_K 256
enum { CISM_Q4_K_D = 0, CISM_Q4_K_DMIN = 2, CISM_Q4_K_SCALES = 4, CISM_Q4_K_QS = 16,
       CISM_Q4_K_BYTES = 144 };
enum { CISM_Q6_K_QL = 0, CISM_Q6_K_QH = 128, CISM_Q6_K_SCALES = 192, CISM_Q6_K_D = 208,
       CISM_Q6_K_BYTES = 210 };
_Static_assert(CISM_Q4_K_QS == CISM_Q4_K_SCALES + 12 &&
               CISM_Q4_K_BYTES == CISM_Q4_K_QS + CISM_QK_K / 2, "q4_K");
_Static_assert(CISM_Q6_K_QH == CISM_QK_K / 2 && CISM_Q6_K_SCALES == CISM_Q6_K_QH + CISM_QK_K / 4 &&
               CISM_Q6_K_D == CISM_Q6_K_SCALES + CISM_QK_K / 16 && CISM_Q6_K_BYTES == CISM_Q6_K_D + 2,
               "q6_K");
_Static_assert(CISM_QK_K == 8 * CISM_ACT_BLOCK, "a super-block is 8 activation blocks");

/* A packed matrix as the kernels see it. Row r starts at codes + r * row_bytes;
 * int4/fp4 rows keep their scales inside the row at byte scale_offset. */
typedef struct cism_mat {
    int32_t storage;
    size_t rows, cols;
    const void *codes;
    size_t row_bytes;
    size_t scale_offset;        /* int4/fp4: where the row's scales start; else 0 */
    const float *scales;        /* int8: row scales [rows]; else NULL */
} cism_mat;

static inline size_t cism_div_up(size_t a, size_t b) { return (a + b - 1) / b; }

/* Bytes of the codes of one packed row (int4/fp4: before the scales; q4_k
 * and q6_k: cols must be a multiple of CISM_QK_K). */
static inline size_t cism_code_bytes(int storage, size_t cols) {
    switch (storage) {
    case CISM_FP32: return cols * 4;
    case CISM_FP16: return cols * 2;
    case CISM_INT8: return cols;
    case CISM_INT4: return cism_div_up(cols, CISM_INT4_BLOCK) * CISM_INT4_BLOCK_BYTES;
    case CISM_Q4K: return cols / CISM_QK_K * CISM_Q4_K_BYTES; /* (the whole row: scales inside) */
    case CISM_Q6K: return cols / CISM_QK_K * CISM_Q6_K_BYTES;
    default: return cism_div_up(cols, CISM_FP4_BLOCK) * (CISM_FP4_BLOCK / 2);
    }
}

/* Bytes of one packed row, scales included for int4/fp4. */
static inline size_t cism_row_bytes(int storage, size_t cols) {
    switch (storage) {
    case CISM_INT4: return cism_code_bytes(storage, cols) + cism_div_up(cols, CISM_INT4_BLOCK) * 4;
    case CISM_FP4: return cism_code_bytes(storage, cols) + cism_div_up(cols, CISM_FP4_BLOCK);
    default: return cism_code_bytes(storage, cols);
    }
}

static inline float cism_int4_scale(const uint8_t *row, size_t scale_offset, size_t b) {
    float s;
    memcpy(&s, row + scale_offset + 4 * b, 4);
    return s;
}

/* ---- exact scalar conversions shared by packing, kernels and row() ---- */

static inline float cism_bits_to_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t cism_f32_to_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

/* IEEE binary16 -> binary32, exact (subnormals, inf and NaN included). */
static inline float cism_fp16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1fu;
    const uint32_t man = h & 0x3ffu;
    if (exp == 0) {
        /* zero or subnormal: man * 2^-24, exact in binary32 */
        float v = (float)man * 5.9604644775390625e-8f;
        return cism_bits_to_f32(cism_f32_to_bits(v) | sign);
    }
    if (exp == 31) return cism_bits_to_f32(sign | 0x7f800000u | (man << 13));
    return cism_bits_to_f32(sign | ((exp + 112) << 23) | (man << 13));
}

/* binary32 -> binary16, round to nearest even (same as F16C vcvtps2ph imm 0). */
static inline uint16_t cism_f32_to_fp16(float f) {
    const uint32_t u = cism_f32_to_bits(f);
    const uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    const uint32_t abs = u & 0x7fffffffu;
    if (abs >= 0x7f800000u) /* inf or NaN (quiet the NaN) */
        return sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u | ((abs >> 13) & 0x3ffu) : 0);
    if (abs >= 0x477ff000u) return sign | 0x7c00u; /* rounds to >= 65520: inf */
    if (abs < 0x38800000u) {
        /* result is subnormal or zero: round abs * 2^24 to an integer, nearest even */
        if (abs < 0x33000000u) return sign; /* below half the smallest subnormal */
        const uint32_t e = abs >> 23;
        const uint32_t m = (abs & 0x7fffffu) | 0x800000u;
        const uint32_t shift = 126 - e; /* 14..24 */
        uint32_t q = m >> shift;
        const uint32_t rem = m & ((1u << shift) - 1);
        const uint32_t half = 1u << (shift - 1);
        if (rem > half || (rem == half && (q & 1u))) q++;
        return sign | (uint16_t)q;
    }
    /* normal: rebias the exponent, round the 13 dropped mantissa bits */
    uint32_t r = abs - 0x38000000u; /* exponent bias 127 -> 15 */
    const uint32_t rem = r & 0x1fffu;
    r >>= 13;
    if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) r++;
    return sign | (uint16_t)r;
}

/* ---- ggml K-quant decoding (gguf-py's bits; see csrc/ggml.h for why
 * every product is exact and only Q4_K's offset rounds) ---- */

static inline float cism_ggml_half(const uint8_t *p) {
    return cism_fp16_to_f32((uint16_t)(p[0] | (p[1] << 8)));   /* little-endian in the file */
}

/* The six-bit scale and min of sub-block j of Q4_K and Q5_K (ggml's
 * get_scale_min_k4): for j < 4 the low six bits of s[j] and s[j + 4]; for
 * j >= 4 the nibbles of s[j + 4] (scale low, min high) with the top two bits
 * of s[j - 4] and s[j] above them. */
static inline void cism_ggml_scale_min_k4(const uint8_t *s, int j, int *sc, int *m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 15) | (s[j - 4] >> 6) << 4;
        *m = (s[j + 4] >> 4) | (s[j] >> 6) << 4;
    }
}

/* Q4_K super-blocks to floats: value = (d * sc) * q - (dmin * m). */
static inline void cism_ggml_q4_k(const uint8_t *raw, size_t blocks, float *out) {
    for (size_t b = 0; b < blocks; b++, raw += CISM_Q4_K_BYTES) {
        const float d = cism_ggml_half(raw + CISM_Q4_K_D), dmin = cism_ggml_half(raw + CISM_Q4_K_DMIN);
        for (int j = 0; j < 8; j++, out += 32) {
            int sc, m;
            cism_ggml_scale_min_k4(raw + CISM_Q4_K_SCALES, j, &sc, &m);
            const float dl = d * (float)sc, ml = dmin * (float)m;
            const uint8_t *q = raw + CISM_Q4_K_QS + 32 * (j / 2);
            const int shift = 4 * (j % 2);
            for (int l = 0; l < 32; l++) out[l] = dl * (float)((q[l] >> shift) & 15) - ml;
        }
    }
}

/* The 6-bit code of element l of run g of a Q6_K super-block. */
static inline int cism_q6k_code(const uint8_t *raw, int g, int l) {
    const int h = g / 4, r = g % 4;
    const uint8_t ql = raw[CISM_Q6_K_QL + 64 * h + 32 * (r % 2) + l];
    const uint8_t qh = raw[CISM_Q6_K_QH + 32 * h + l];
    return ((ql >> (4 * (r / 2))) & 15) | ((qh >> (2 * r)) & 3) << 4;
}

/* Q6_K super-blocks to floats: value = (d * scale) * (code - 32). */
static inline void cism_ggml_q6_k(const uint8_t *raw, size_t blocks, float *out) {
    for (size_t b = 0; b < blocks; b++, raw += CISM_Q6_K_BYTES) {
        const float d = cism_ggml_half(raw + CISM_Q6_K_D);
        for (int g = 0; g < 8; g++, out += 32) {
            const float dl[2] = {d * (float)(int8_t)raw[CISM_Q6_K_SCALES + 2 * g],
                                 d * (float)(int8_t)raw[CISM_Q6_K_SCALES + 2 * g + 1]};
            for (int l = 0; l < 32; l++) out[l] = dl[l / 16] * (float)(cism_q6k_code(raw, g, l) - 32);
        }
    }
}

/* E4M3 (bias 7, no infinities, 0x7f/0xff NaN) -> binary32, exact. */
static inline float cism_e4m3_to_f32(uint8_t b) {
    const uint32_t exp = (b >> 3) & 0xfu;
    const uint32_t man = b & 7u;
    float v;
    if (exp == 0) v = (float)man * 0.001953125f; /* man/8 * 2^-6 */
    else v = cism_bits_to_f32(((exp + 120) << 23) | (man << 20));
    return (b & 0x80u) ? -v : v;
}

/* Non-negative binary32 -> E4M3, nearest even, subnormals kept, saturating
 * at 448 (0x7e). Only non-negative scales are ever encoded. */
static inline uint8_t cism_f32_to_e4m3(float x) {
    if (!(x > 0.0f)) return 0;
    if (x >= 448.0f) return 0x7e;
    if (x < 0.015625f) {
        /* subnormal range: multiples of 2^-9; 8 * 2^-9 is the smallest normal (code 8) */
        float q = x * 512.0f;
        float r = __builtin_rintf(q);
        return (uint8_t)(int)r;
    }
    const uint32_t u = cism_f32_to_bits(x);
    uint32_t e = (u >> 23) - 127 + 7;       /* 1..15 */
    const uint32_t man = u & 0x7fffffu;
    uint32_t m = man >> 20;                   /* top 3 mantissa bits */
    const uint32_t rem = man & 0xfffffu;
    if (rem > 0x80000u || (rem == 0x80000u && (m & 1u))) m++;
    if (m == 8) { m = 0; e++; }
    uint32_t code = (e << 3) | m;
    if (code > 0x7e) code = 0x7e;
    return (uint8_t)code;
}

/* 2 x E2M1 magnitude for codes 0..7: 0, 0.5, 1, 1.5, 2, 3, 4, 6 doubled, so
 * every element is a small integer; kernels fold the 1/2 into the scale. */
static const int8_t cism_e2m1_x2[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
/* The same values + 12 (0..24): unsigned bytes for maddubs / vpdpbusd. The
 * integer kernels use 4-bit weights as such unsigned bytes (int4: the code
 * itself, the value + 8) and take CISM_NIB_BIAS(storage) times the
 * activations' sum off afterwards. */
#define CISM_NIB_BIAS(storage) ((storage) == CISM_INT4 ? 8 : 12)
static const uint8_t cism_e2m1_x2_biased[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};
_Static_assert(sizeof cism_e2m1_x2_biased == sizeof cism_e2m1_x2, "one biased value per fp4 code");

/* Elements i0..i1-1 of row r of W as floats (out[0] is element i0),
 * exactly as the kernels see the weights (q4_k, q6_k: csrc/ggml.h's decode,
 * gguf-py's bits); int8 rows are multiplied by their
 * row scale only when with_int8_scale is set (the dot products apply it
 * after the sum). */
static inline void cism_dequant_range(const cism_mat *W, size_t r, size_t i0, size_t i1, float *out,
                                      int with_int8_scale) {
    const uint8_t *row = (const uint8_t *)W->codes + r * W->row_bytes;
    switch (W->storage) {
    case CISM_FP32:
        memcpy(out, row + 4 * i0, (i1 - i0) * sizeof(float));
        break;
    case CISM_FP16:
        for (size_t i = i0; i < i1; i++) {
            uint16_t h;
            memcpy(&h, row + 2 * i, 2);
            out[i - i0] = cism_fp16_to_f32(h);
        }
        break;
    case CISM_INT8: {
        const float s = with_int8_scale ? W->scales[r] : 1.0f;
        for (size_t i = i0; i < i1; i++)
            out[i - i0] = with_int8_scale ? (float)(int8_t)row[i] * s : (float)(int8_t)row[i];
        break;
    }
    case CISM_INT4:
        for (size_t i = i0; i < i1; i++) {
            const size_t b = i / 32, t = i % 32;
            const uint8_t byte = row[b * 16 + (t % 16)];
            const int code = t < 16 ? (byte & 15) : (byte >> 4);
            out[i - i0] = (float)(code - 8) * cism_int4_scale(row, W->scale_offset, b);
        }
        break;
    case CISM_Q4K:
    case CISM_Q6K: { /* whole super-blocks decoded, the range's part kept */
        float blk[CISM_QK_K];
        for (size_t s = i0 / CISM_QK_K; s * CISM_QK_K < i1; s++) {
            if (W->storage == CISM_Q4K) cism_ggml_q4_k(row + s * CISM_Q4_K_BYTES, 1, blk);
            else cism_ggml_q6_k(row + s * CISM_Q6_K_BYTES, 1, blk);
            const size_t lo = s * CISM_QK_K > i0 ? s * CISM_QK_K : i0;
            const size_t hi = s * CISM_QK_K + CISM_QK_K < i1 ? s * CISM_QK_K + CISM_QK_K : i1;
            memcpy(out + (lo - i0), blk + (lo - s * CISM_QK_K), (hi - lo) * sizeof(float));
        }
        break;
    }
    default: { /* CISM_FP4 */
        const uint8_t *sb = row + W->scale_offset;
        for (size_t i = i0; i < i1; i++) {
            const int code = (i % 2) ? (row[i / 2] >> 4) : (row[i / 2] & 15);
            out[i - i0] = (float)cism_e2m1_x2[code] * (cism_e4m3_to_f32(sb[i / 16]) * 0.5f);
        }
        break;
    }
    }
}

/* Row r of W as floats (see cism_dequant_range). */
static inline void cism_dequant_row(const cism_mat *W, size_t r, float *out, int with_int8_scale) {
    cism_dequant_range(W, r, 0, W->cols, out, with_int8_scale);
}

#endif
