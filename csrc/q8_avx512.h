/* Integer weights x q8 activations on AVX-512 with dots in lanes: the
 * template of the avx512, avx512vnni and amx levels (gemm_q8/gemm_q8_*.c).
 * Bit-identical to gemm_q8_ref.c: one float chain per dot over exact
 * integer block sums (kernels.h). The tiles (8 rows for decode, 4 x 4 for
 * several tokens) finish the block sums of 8 dots in one reduction
 * (block_sums8, block_sums4x4) and keep 8 dots' chains in one ymm. 4-bit
 * decode goes two 64-element units per step, the low and high nibbles of
 * one 64-byte load into the same lanes (decode_nq8): half the unpacking and
 * reductions of one unit a step.
 *
 * What differs between the levels is a handful of byte operations, which
 * the including file names before it includes this header, each from the
 * instructions its own flags allow:
 *   Q8_DOT4(acc, w, a)    acc + the u8 x s8 four-element sums of w and a
 *                         (every pair sum within int16 where it is used):
 *                         maddubs + madd, or vpdpbusd
 *   Q8_I8_SUMS(R, TT, rows, A, t, u, v)
 *                         v[i * TT + j] = the four-element sums of int8 row
 *                         i's unit u and token t + j's q8 unit u
 *   Q8_INT4_NIBBLES(z, SIGNED)
 *                         the low nibbles of qwords 0, 1, 4, 5 of z and the
 *                         high ones of 2, 3, 6, 7 as bytes 0..15 (or SIGNED,
 *                         code - 8)
 *   Q8_NIB_HI(x)          the high nibble of every byte, 0..15
 *   Q8_LUT16(table, idx)  table[idx & 15] per byte, table repeating every
 *                         16 bytes (the index's other bits are ignored)
 * The portable choices (AVX-512BW) for the last three are here. */
#ifndef CISM_Q8_AVX512_H
#define CISM_Q8_AVX512_H

#include "simd_avx512.h"
#include "scratch.h"

#if !defined(Q8_DOT4) || !defined(Q8_I8_SUMS) || !defined(Q8_INT4_NIBBLES) || !defined(Q8_NIB_HI) || \
    !defined(Q8_LUT16)
#error "define the Q8_ byte operations before including q8_avx512.h"
#endif

ALWAYS_INLINE __m512i int4_nibbles_shift(__m512i z, const int SIGNED) {
    const __m512i c = _mm512_and_si512(_mm512_srlv_epi64(z, _mm512_setr_epi64(0, 0, 4, 4, 0, 0, 4, 4)),
                                       _mm512_set1_epi8(15));
    return SIGNED ? _mm512_sub_epi8(c, _mm512_set1_epi8(8)) : c;
}

ALWAYS_INLINE __m512i nib_hi_shift(__m512i x) {
    return _mm512_and_si512(_mm512_srli_epi16(x, 4), _mm512_set1_epi8(15));
}

ALWAYS_INLINE __m512i lut16_pshufb(__m512i table, __m512i idx) {
    return _mm512_shuffle_epi8(table, _mm512_and_si512(idx, _mm512_set1_epi8(15)));
}

/* ---- int8 x q8 ---- */

/* The block sums of 8 dots at once: v[p] holds dot p's four-product lane
 * sums of one unit; the result holds in lane p the sum of v[p]'s lanes 0-7
 * (block 2u) and in lane 8 + p that of lanes 8-15 (block 2u+1). Integer
 * additions, so the order is free. */
ALWAYS_INLINE void lane_sums4(const __m512i v[8], __m512i b[2]) {
    __m512i a[4];
    /* a[i], 128-bit lane L: [v2i, v2i+1, v2i, v2i+1] partial sums of lane L */
    for (int i = 0; i < 4; i++)
        a[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]),
                                _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]));
    /* b[i], 128-bit lane L: the sums of lane L of v4i .. v4i+3 */
    for (int i = 0; i < 2; i++)
        b[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(a[2 * i], a[2 * i + 1]),
                                _mm512_unpackhi_epi64(a[2 * i], a[2 * i + 1]));
}

ALWAYS_INLINE __m512i block_sums8(const __m512i v[8]) {
    __m512i b[2];
    lane_sums4(v, b);
    /* [block 2u of v0-3, block 2u+1 of v0-3, block 2u of v4-7, block 2u+1 of v4-7] */
    const __m512i s = _mm512_add_epi32(_mm512_shuffle_i32x4(b[0], b[1], 0x88),
                                       _mm512_shuffle_i32x4(b[0], b[1], 0xdd));
    return _mm512_shuffle_i32x4(s, s, 0xd8);
}

/* An R x TT tile of int8 x q8 dots (R * TT <= 16): rows r, r + rs, ...,
 * tokens t..t+TT-1; dot p = i * TT + j sits in lane p % 8 of acc[p / 8]. */
ALWAYS_INLINE void tile_i8q8(const int R, const int TT, const cism_mat *W, size_t r, size_t rs,
                             const cism_act *A, size_t t, float *Y, size_t ldy) {
    const size_t units = cism_div_up(W->cols, 64);
    const int P = R * TT, G = (P + 7) / 8;
    const uint8_t *rows[8];
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int i = 0; i < R; i++) rows[i] = (const uint8_t *)W->codes + (r + i * rs) * W->row_bytes;
    for (size_t u = 0; u < units; u++) {
        __m512i v[16];
        float sa[4], sb[4];
        for (int j = 0; j < TT; j++) {
            const float *as = A->qscale + (t + j) * A->ldqs + 2 * u;
            sa[j] = as[0];
            sb[j] = as[1];
        }
        Q8_I8_SUMS(R, TT, rows, A, t, u, v);
        for (int p = P; p < 8 * G; p++) v[p] = _mm512_setzero_si512();
        for (int g = 0; g < G; g++) {
            const __m512 f = _mm512_cvtepi32_ps(block_sums8(v + 8 * g));
            const int q = 8 * g;
            const __m256 sca = _mm256_setr_ps(sa[(q + 0) % TT], sa[(q + 1) % TT], sa[(q + 2) % TT], sa[(q + 3) % TT],
                                              sa[(q + 4) % TT], sa[(q + 5) % TT], sa[(q + 6) % TT], sa[(q + 7) % TT]);
            const __m256 scb = _mm256_setr_ps(sb[(q + 0) % TT], sb[(q + 1) % TT], sb[(q + 2) % TT], sb[(q + 3) % TT],
                                              sb[(q + 4) % TT], sb[(q + 5) % TT], sb[(q + 6) % TT], sb[(q + 7) % TT]);
            acc[g] = _mm256_fmadd_ps(_mm512_castps512_ps256(f), sca, acc[g]);
            acc[g] = _mm256_fmadd_ps(_mm512_extractf32x8_ps(f, 1), scb, acc[g]);
        }
    }
    float out[16];
    for (int g = 0; g < G; g++) _mm256_storeu_ps(out + 8 * g, acc[g]);
    for (int p = 0; p < P; p++) {
        const size_t row = r + (size_t)(p / TT) * rs;
        Y[(t + p % TT) * ldy + row] = out[p] * W->scales[row];
    }
}

/* ---- int4 and fp4 x q8: the same rule with a scale per (row, block) ----
 *
 * A 64-element unit of weights is unpacked to unsigned bytes (int4: the
 * codes 0..15; fp4: 2*E2M1 + 12, 0..24) and multiplied with the q8
 * activations by vpdpbusd, or by maddubs + madd without VNNI (unsigned x
 * signed pairs stay far inside int16: 2 * 24 * 127). Each lane sum starts
 * from -bias * (the activations' four-element sums), so it ends at exactly
 * sum(w * a). int4 bytes come out in element order (block 2u in lanes
 * 0-7, block 2u+1 in lanes 8-15, as for int8); fp4 bytes come out as
 * [even elements | odd elements] of each 16-element block, one block per
 * 128-bit lane, and the activations are shuffled the same way (once per
 * token and unit, for all the tile's rows). Integer sums: the order inside
 * a block is free. The chain then runs over the blocks with c_b =
 * wscale_b * ascale_b (one rounding), dots in lanes as for int8. */

/* Unit u of an int4 row: [block 2u | block 2u + 1], each [elements 0-15 (the
 * low nibbles of its 16 bytes) | 16-31 (the high ones)], as unsigned codes
 * or (SIGNED) as code - 8. */
ALWAYS_INLINE __m512i int4_unit(const int SIGNED, const uint8_t *codes, size_t u) {
    const __m512i x = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(codes + 32 * u)));
    /* qwords [b0, b0, b1, b1], each block's low then high nibbles */
    const __m512i z = _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 1, 0, 1, 2, 3, 2, 3), x);
    return Q8_INT4_NIBBLES(z, SIGNED);
}

/* Unit u of a 4-bit row as unsigned bytes (see above). */
ALWAYS_INLINE __m512i nib_unit_u8(const int S, const uint8_t *codes, size_t u) {
    if (S == CISM_INT4) return int4_unit(0, codes, u);
    const __m512i x = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(codes + 32 * u)));
    /* fp4: byte k holds elements 2k (low nibble) and 2k + 1 (high); block
     * c's 8 bytes go to qword 2c shifted by 0 and qword 2c + 1 shifted by 4 */
    const __m512i z = _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 0, 1, 1, 2, 2, 3, 3), x);
    const __m512i table = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)cism_e2m1_x2_biased));
    const __m512i shifted = _mm512_srlv_epi64(z, _mm512_setr_epi64(0, 4, 0, 4, 0, 4, 0, 4));
    return Q8_LUT16(table, shifted);
}

/* Activation unit u of token row a in the weights' byte order. */
ALWAYS_INLINE __m512i nib_act(const int S, const int8_t *a, size_t u) {
    const __m512i v = _mm512_loadu_si512((const void *)(a + 64 * u));
    if (S == CISM_INT4) return v;
    const __m512i even_odd = _mm512_broadcast_i32x4(
        _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15));
    return _mm512_shuffle_epi8(v, even_odd);
}

/* fp4 block sums of 8 dots: v[p] holds dot p's four-element sums of one
 * unit, block k in 128-bit lane k; f01 gets [block 0 of dots 0-7 | block 1],
 * f23 [block 2 | block 3] (integer additions: any order). */
ALWAYS_INLINE void block_sums4x4(const __m512i v[8], __m512i *f01, __m512i *f23) {
    __m512i b[2]; /* b[i], 128-bit lane k: block k of dots 4i .. 4i + 3 */
    lane_sums4(v, b);
    const __m512i s01 = _mm512_shuffle_i32x4(b[0], b[1], 0x44), s23 = _mm512_shuffle_i32x4(b[0], b[1], 0xee);
    *f01 = _mm512_shuffle_i32x4(s01, s01, 0xd8);
    *f23 = _mm512_shuffle_i32x4(s23, s23, 0xd8);
}

/* 16 E4M3 scale bytes as e4m3 * 0.5, exactly: the byte's bits moved into a
 * binary16 (exponent bias 15 instead of 7, subnormals included) is the
 * value * 2^-8, which vcvtph2ps widens exactly; * 2^7 is exact. Scale
 * bytes are never negative (formats.h), so bit 7 is not looked at: a byte
 * past the row (a block that is never folded in) may read as anything. */
ALWAYS_INLINE __m512 e4m3_half16(__m128i bytes) {
    const __m256i h = _mm256_slli_epi16(_mm256_cvtepu8_epi16(bytes), 7);
    return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(128.0f));
}

/* 8 lanes of per-token values: lane p holds v[(8g + p) % TT]. */
ALWAYS_INLINE __m256 per_token8(const float *v, const int TT, const int g) {
    const int q = 8 * g;
    return _mm256_setr_ps(v[(q + 0) % TT], v[(q + 1) % TT], v[(q + 2) % TT], v[(q + 3) % TT], v[(q + 4) % TT],
                          v[(q + 5) % TT], v[(q + 6) % TT], v[(q + 7) % TT]);
}

/* 8 lanes of per-row values: lane p holds v[(8g + p) / TT] (0 past P). */
ALWAYS_INLINE __m256 per_row8(const float *v, const int P, const int TT, const int g) {
    float l[8];
    for (int p = 0; p < 8; p++) l[p] = 8 * g + p < P ? v[(8 * g + p) / TT] : 0.0f;
    return _mm256_setr_ps(l[0], l[1], l[2], l[3], l[4], l[5], l[6], l[7]);
}

/* out[k] lane i = in[i] lane k, for 8 x 8 doubles (here: pairs of floats). */
ALWAYS_INLINE void transpose8_pd(const __m512d in[8], __m512d out[8]) {
    __m512d t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm512_unpacklo_pd(in[i], in[i + 1]);     /* elements 0, 2, 4, 6 of rows i, i + 1 */
        t[i + 1] = _mm512_unpackhi_pd(in[i], in[i + 1]); /* elements 1, 3, 5, 7 */
    }
    for (int i = 0; i < 8; i += 4)
        for (int h = 0; h < 2; h++) {
            u[i + h] = _mm512_shuffle_f64x2(t[i + h], t[i + 2 + h], 0x88);     /* elements 0, 4 (1, 5) */
            u[i + 2 + h] = _mm512_shuffle_f64x2(t[i + h], t[i + 2 + h], 0xdd); /* elements 2, 6 (3, 7) */
        }
    /* u[0]: e0, e4 of rows 0-3; u[1]: e1, e5; u[2]: e2, e6; u[3]: e3, e7 */
    for (int k = 0; k < 4; k++) {
        out[k] = _mm512_shuffle_f64x2(u[k], u[4 + k], 0x88);
        out[k + 4] = _mm512_shuffle_f64x2(u[k], u[4 + k], 0xdd);
    }
}

/* Decode (8 rows, one token): the weight scales of units u0..u0+7 for the
 * 8 rows, loaded 16 (int4) or 32 (fp4) blocks per row at a time and
 * transposed so that lane p is row p. int4: cw[k] = [wscale 2u of rows
 * 0-7 | wscale 2u + 1], u = u0 + k; fp4: cw[2k] = [block 4u | 4u + 1],
 * cw[2k + 1] = [4u + 2 | 4u + 3] (e4m3 * 0.5). Loads stop at the row's
 * last block; lanes past it are zero and never folded in. */
ALWAYS_INLINE void row_scales8(const int S, const uint8_t *const rows[8], size_t so, size_t blocks, size_t u0,
                               __m512 cw[16]) {
    const __m512i even_odd = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    __m512d in[8], out[8];
    if (S == CISM_INT4) {
        const size_t b0 = 2 * u0, nb = blocks - b0 < 16 ? blocks - b0 : 16;
        const __mmask16 m = (__mmask16)((1u << nb) - 1);
        for (int i = 0; i < 8; i++)
            in[i] = _mm512_castps_pd(_mm512_maskz_loadu_ps(m, (const float *)(rows[i] + so) + b0));
        transpose8_pd(in, out);
        for (int k = 0; k < 8; k++) cw[k] = _mm512_permutexvar_ps(even_odd, _mm512_castpd_ps(out[k]));
        return;
    }
    /* fp4: each row's 32 scale bytes are 8 dwords, one per unit; the 8 x 8
     * dword transpose gives unit k's 4 bytes of every row, a byte shuffle
     * orders them [block 4u of rows 0-7 | 4u + 1 | 4u + 2 | 4u + 3] */
    const size_t b0 = 4 * u0, nb = blocks - b0 < 32 ? blocks - b0 : 32;
    const __mmask8 m = (__mmask8)((1u << cism_div_up(nb, 4)) - 1);
    __m256 d[8], e[8];
    for (int i = 0; i < 8; i++)
        d[i] = _mm256_castsi256_ps(_mm256_maskz_loadu_epi32(m, rows[i] + so + b0));
    /* 8 x 8 transpose of dwords (as floats) */
    for (int i = 0; i < 8; i += 2) {
        e[i] = _mm256_unpacklo_ps(d[i], d[i + 1]);
        e[i + 1] = _mm256_unpackhi_ps(d[i], d[i + 1]);
    }
    for (int i = 0; i < 8; i += 4)
        for (int h = 0; h < 2; h++) {
            d[i + 2 * h] = _mm256_shuffle_ps(e[i + h], e[i + 2 + h], 0x44);
            d[i + 2 * h + 1] = _mm256_shuffle_ps(e[i + h], e[i + 2 + h], 0xee);
        }
    /* d[0]: dwords 0, 4 of rows 0-3 (lanes), d[1]: 1, 5, d[2]: 2, 6, d[3]: 3, 7; d[4..7] rows 4-7 */
    const __m256i order = _mm256_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15,
                                           0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    const __m256i lanes = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int k = 0; k < 8; k++) {
        const __m256 lo = d[k % 4], hi = d[4 + k % 4]; /* rows 0-3 and 4-7 */
        const __m256 t = k < 4 ? _mm256_permute2f128_ps(lo, hi, 0x20) : _mm256_permute2f128_ps(lo, hi, 0x31);
        /* t: unit k's dword of rows 0-7; bytes to [block 0 of rows 0-7 | 1 | 2 | 3] */
        const __m256i b = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(_mm256_castps_si256(t), order), lanes);
        cw[2 * k] = e4m3_half16(_mm256_castsi256_si128(b));
        cw[2 * k + 1] = e4m3_half16(_mm256_extracti128_si256(b, 1));
    }
}

/* fp4 decode sums of 8 rows: v[i] holds row i's four-element sums, block
 * m in dword lanes 2m and 2m + 1; out[k] = [block 2k of rows 0-7 | block
 * 2k + 1] (integer additions: any order). */
ALWAYS_INLINE void pair_block_sums8(const __m512i v[8], __m512i out[4]) {
    __m512i w[4]; /* w[k], qword m: block m of rows 2k and 2k + 1 */
    for (int k = 0; k < 4; k++) {
        const __m512i p = v[2 * k], q = v[2 * k + 1];
        const __m512i x = _mm512_mask_blend_epi32(0xAAAA, p, q); /* p0 q1 p2 q3 ... */
        const __m512i y = _mm512_mask_shuffle_epi32(_mm512_shuffle_epi32(p, _MM_PERM_CDAB), 0xAAAA, q,
                                                    _MM_PERM_CDAB); /* p1 q0 p3 q2 ... */
        w[k] = _mm512_add_epi32(x, y);
    }
    /* 128-bit lane m of P[0] (P[1]): block m (4 + m) of rows 0-3; Q: rows 4-7 */
    const __m512i lo = _mm512_setr_epi64(0, 8, 1, 9, 2, 10, 3, 11), hi = _mm512_setr_epi64(4, 12, 5, 13, 6, 14, 7, 15);
    const __m512i P[2] = {_mm512_permutex2var_epi64(w[0], lo, w[1]), _mm512_permutex2var_epi64(w[0], hi, w[1])};
    const __m512i Q[2] = {_mm512_permutex2var_epi64(w[2], lo, w[3]), _mm512_permutex2var_epi64(w[2], hi, w[3])};
    const __m512i first = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11), second = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
    for (int h = 0; h < 2; h++) {
        out[2 * h] = _mm512_permutex2var_epi64(P[h], first, Q[h]);
        out[2 * h + 1] = _mm512_permutex2var_epi64(P[h], second, Q[h]);
    }
}

/* Decode of int4 or fp4 x q8: 8 rows r, r + rs, ..., r + 7 rs and one
 * token, two 64-element units per step. A step's 64 code bytes of a row
 * split into their low and high nibbles (unsigned bytes, as in
 * nib_unit_u8), and both go to vpdpbusd into the same lanes against the
 * activations that belong in those bytes' places, shuffled so once per step
 * for all 8 rows. int4: 128-bit lane k of the low nibbles holds elements
 * 0-15 of block k, of the high nibbles elements 16-31, so each block is one
 * 128-bit lane (reduced as block_sums4x4 does); fp4: the low nibbles are
 * the even elements and the high the odd, so each block is two adjacent
 * dword lanes (pair_block_sums8). Against one unit per step this unpacks
 * with three instructions per 128 elements instead of six and reduces half
 * as often. The weight scales come from row_scales8 (units u..u+7 at once,
 * prefetched two such periods ahead); the chain folds each block in order,
 * blocks past the row never. An odd last unit meets zero activations in
 * the step's second half (its code bytes are the row's scales or the
 * matrix's slack). */
ALWAYS_INLINE void decode_nq8(const int S, const cism_mat *W, size_t r, size_t rs,
                              const cism_act *A, float *Y) {
    const size_t units = cism_div_up(W->cols, 64), so = W->scale_offset;
    const size_t blocks = cism_div_up(W->cols, S == CISM_INT4 ? 32 : 16);
    const size_t scale_step = S == CISM_INT4 ? 8 : 4; /* scale bytes per unit */
    const uint8_t *rows[8];
    for (int i = 0; i < 8; i++) rows[i] = (const uint8_t *)W->codes + (r + i * rs) * W->row_bytes;
    for (int i = 0; i < 8; i++)
        for (size_t u = 0; u < 16; u += 8) _mm_prefetch((const char *)(rows[i] + so + scale_step * u), _MM_HINT_T0);
    const __m512i bias = _mm512_set1_epi8(CISM_NIB_BIAS(S)), low4 = _mm512_set1_epi8(15);
    const __m512i table = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)cism_e2m1_x2_biased));
    const __m512i even_odd = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15));
    const __m512i evens = _mm512_setr_epi64(0, 2, 4, 6, 8, 10, 12, 14), odds = _mm512_setr_epi64(1, 3, 5, 7, 9, 11, 13, 15);
    const int8_t *a = A->q8;
    const float *as = A->qscale;
    __m256 acc = _mm256_setzero_ps();
    __m512 cws[16];
    for (size_t u = 0; u < units; u += 2) {
        const int two = u + 1 < units;
        const __m512i a0 = _mm512_loadu_si512((const void *)(a + 64 * u));
        const __m512i a1 = two ? _mm512_loadu_si512((const void *)(a + 64 * (u + 1))) : _mm512_setzero_si512();
        __m512i alo, ahi; /* the activations of the low and the high nibbles */
        if (S == CISM_INT4) {
            alo = _mm512_shuffle_i32x4(a0, a1, 0x88); /* elements 0-15 of each block */
            ahi = _mm512_shuffle_i32x4(a0, a1, 0xdd); /* 16-31 */
        } else {
            /* each 16 bytes to [evens | odds], then the evens' and the odds' qwords gathered */
            const __m512i e0 = _mm512_shuffle_epi8(a0, even_odd), e1 = _mm512_shuffle_epi8(a1, even_odd);
            alo = _mm512_permutex2var_epi64(e0, evens, e1);
            ahi = _mm512_permutex2var_epi64(e0, odds, e1);
        }
        const __m512i zero = _mm512_setzero_si512();
        const __m512i start = _mm512_sub_epi32(zero, Q8_DOT4(Q8_DOT4(zero, bias, alo), bias, ahi));
        __m512i v[8];
        for (int i = 0; i < 8; i++) {
            const __m512i x = _mm512_loadu_si512((const void *)(rows[i] + 32 * u));
            __m512i lo, hi;
            if (S == CISM_FP4) {
                lo = Q8_LUT16(table, x);
                hi = Q8_LUT16(table, _mm512_srli_epi16(x, 4));
            } else {
                lo = _mm512_and_si512(x, low4);
                hi = Q8_NIB_HI(x);
            }
            v[i] = Q8_DOT4(Q8_DOT4(start, lo, alo), hi, ahi);
        }
        if (u % 8 == 0) {
            row_scales8(S, rows, so, blocks, u, cws);
            /* the scales sit after the row's codes, out of the prefetchers'
             * sight: ask for those of two periods ahead (prefetches past the
             * matrix are harmless) */
            for (int i = 0; i < 8; i++) _mm_prefetch((const char *)(rows[i] + so + scale_step * (u + 16)), _MM_HINT_T0);
        }
        /* the activation scales of blocks 2u .. 2u + 3 (0 past the row) */
        const float s0 = as[2 * u], s1 = as[2 * u + 1], s2 = two ? as[2 * u + 2] : 0.0f, s3 = two ? as[2 * u + 3] : 0.0f;
        if (S == CISM_INT4) {
            __m512i f01, f23;
            block_sums4x4(v, &f01, &f23);
            const __m512 g[2] = {_mm512_cvtepi32_ps(f01), _mm512_cvtepi32_ps(f23)};
            const __m512 c[2] = {_mm512_mul_ps(cws[u % 8], join8(_mm256_set1_ps(s0), _mm256_set1_ps(s1))),
                                 _mm512_mul_ps(cws[u % 8 + 1], join8(_mm256_set1_ps(s2), _mm256_set1_ps(s3)))};
            const size_t b = 2 * u;
            for (int k = 0; k < 2; k++) {
                if (b + 2 * k < blocks) acc = _mm256_fmadd_ps(lo8(g[k]), lo8(c[k]), acc);
                if (b + 2 * k + 1 < blocks) acc = _mm256_fmadd_ps(hi8(g[k]), hi8(c[k]), acc);
            }
        } else {
            __m512i f[4];
            pair_block_sums8(v, f);
            const float s[4] = {s0, s1, s2, s3};
            const size_t b = 4 * u;
            for (int k = 0; k < 4; k++) {
                const __m512 g = _mm512_cvtepi32_ps(f[k]);
                const __m512 c = _mm512_mul_ps(cws[2 * (u % 8) + k], _mm512_set1_ps(s[k]));
                if (b + 2 * k < blocks) acc = _mm256_fmadd_ps(lo8(g), lo8(c), acc);
                if (b + 2 * k + 1 < blocks) acc = _mm256_fmadd_ps(hi8(g), hi8(c), acc);
            }
        }
    }
    float out[8];
    _mm256_storeu_ps(out, acc);
    for (int i = 0; i < 8; i++) Y[r + i * rs] = out[i];
}

/* An R x TT tile of int4 or fp4 x q8 dots (R * TT <= 16, not the decode
 * tile): rows r, r + rs, ..., tokens t..t+TT-1; dot p = i * TT + j sits in
 * lane p % 8 of acc[p / 8]. Blocks past the row are never folded in. */
ALWAYS_INLINE void tile_nq8(const int S, const int R, const int TT, const cism_mat *W, size_t r,
                            size_t rs, const cism_act *A, size_t t, float *Y, size_t ldy) {
    const size_t units = cism_div_up(W->cols, 64), so = W->scale_offset;
    const size_t blocks = cism_div_up(W->cols, S == CISM_INT4 ? 32 : 16);
    const int P = R * TT, G = (P + 7) / 8;
    const uint8_t *rows[8];
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int i = 0; i < R; i++) rows[i] = (const uint8_t *)W->codes + (r + i * rs) * W->row_bytes;
    const __m512i bias = _mm512_set1_epi8(CISM_NIB_BIAS(S));
    for (size_t u = 0; u < units; u++) {
        __m512i a[4], start[4], v[16];
        for (int j = 0; j < TT; j++) {
            a[j] = nib_act(S, A->q8 + (t + j) * A->ldq, u);
            start[j] = _mm512_sub_epi32(_mm512_setzero_si512(), Q8_DOT4(_mm512_setzero_si512(), bias, a[j]));
        }
        for (int i = 0; i < R; i++) {
            const __m512i w = nib_unit_u8(S, rows[i], u);
            for (int j = 0; j < TT; j++) v[i * TT + j] = Q8_DOT4(start[j], w, a[j]);
        }
        for (int p = P; p < 8 * G; p++) v[p] = _mm512_setzero_si512();
        float s0[4], s1[4]; /* the tokens' scales of activation blocks 2u, 2u + 1 */
        for (int j = 0; j < TT; j++) {
            s0[j] = A->qscale[(t + j) * A->ldqs + 2 * u];
            s1[j] = A->qscale[(t + j) * A->ldqs + 2 * u + 1];
        }
        /* the rows' scales of this unit's blocks (0 past the row) */
        float ws[4][8];
        for (int i = 0; i < R; i++)
            for (int k = 0; k < (S == CISM_INT4 ? 2 : 4); k++) {
                const size_t b = (S == CISM_INT4 ? 2 : 4) * u + k;
                ws[k][i] = b >= blocks ? 0.0f
                           : S == CISM_INT4
                               ? ((const float *)((const uint8_t *)W->codes + (r + i * rs) * W->row_bytes + so))[b]
                               : e4m3_half[rows[i][so + b]];
            }
        for (int g = 0; g < G; g++) {
            const __m256 a0 = per_token8(s0, TT, g), a1 = per_token8(s1, TT, g);
            if (S == CISM_INT4) {
                const __m512 f = _mm512_cvtepi32_ps(block_sums8(v + 8 * g));
                const __m512 cw = join8(per_row8(ws[0], P, TT, g), per_row8(ws[1], P, TT, g));
                const __m512 c = _mm512_mul_ps(cw, join8(a0, a1)); /* wscale_b * ascale_b */
                acc[g] = _mm256_fmadd_ps(lo8(f), lo8(c), acc[g]);
                if (2 * u + 1 < blocks) acc[g] = _mm256_fmadd_ps(hi8(f), hi8(c), acc[g]);
            } else {
                __m512i f01, f23;
                block_sums4x4(v + 8 * g, &f01, &f23);
                const __m512 cw01 = join8(per_row8(ws[0], P, TT, g), per_row8(ws[1], P, TT, g));
                const __m512 cw23 = join8(per_row8(ws[2], P, TT, g), per_row8(ws[3], P, TT, g));
                const __m512 c01 = _mm512_mul_ps(cw01, join8(a0, a0)), c23 = _mm512_mul_ps(cw23, join8(a1, a1));
                const __m512 g01 = _mm512_cvtepi32_ps(f01), g23 = _mm512_cvtepi32_ps(f23);
                const size_t b = 4 * u;
                acc[g] = _mm256_fmadd_ps(lo8(g01), lo8(c01), acc[g]);
                if (b + 1 < blocks) acc[g] = _mm256_fmadd_ps(hi8(g01), hi8(c01), acc[g]);
                if (b + 2 < blocks) acc[g] = _mm256_fmadd_ps(lo8(g23), lo8(c23), acc[g]);
                if (b + 3 < blocks) acc[g] = _mm256_fmadd_ps(hi8(g23), hi8(c23), acc[g]);
            }
        }
    }
    float out[16];
    for (int g = 0; g < G; g++) _mm256_storeu_ps(out + 8 * g, acc[g]);
    for (int p = 0; p < P; p++) Y[(t + p % TT) * ldy + r + (size_t)(p / TT) * rs] = out[p];
}

/* S: the weights' storage (int8, int4, fp4) x q8 activations. */
ALWAYS_INLINE void tile_q(const int S, const int R, const int TT, const cism_mat *W, size_t r,
                          size_t rs, const cism_act *A, size_t t, float *Y, size_t ldy) {
    if (S == CISM_INT8) tile_i8q8(R, TT, W, r, rs, A, t, Y, ldy);
    else if (R == 8 && TT == 1) decode_nq8(S, W, r, rs, A, Y);
    else tile_nq8(S, R, TT, W, r, rs, A, t, Y, ldy);
}

ALWAYS_INLINE void rows_q(const int S, const int R, const cism_mat *W, size_t r,
                          const cism_act *A, size_t t0, size_t t1, float *Y, size_t ldy) {
    size_t t = t0;
    for (; t + 4 <= t1; t += 4) tile_q(S, R, 4, W, r, 1, A, t, Y, ldy);
    switch (t1 - t) {
    case 3: tile_q(S, R, 3, W, r, 1, A, t, Y, ldy); break;
    case 2: tile_q(S, R, 2, W, r, 1, A, t, Y, ldy); break;
    case 1: tile_q(S, R, 1, W, r, 1, A, t, Y, ldy); break;
    default: break;
    }
}

ALWAYS_INLINE void gemm_q_tpl(const int S, const cism_mat *W, size_t r0, size_t r1,
                              const cism_act *A, size_t T, float *Y, size_t ldy) {
    if (T == 1) { /* 8 streams spread over the rows, as in gemm_f32_tpl */
        const size_t L = (r1 - r0) / 8;
        for (size_t j = 0; j < L; j++) tile_q(S, 8, 1, W, r0 + j, L, A, 0, Y, ldy);
        for (size_t r = r0 + 8 * L; r < r1; r++) tile_q(S, 1, 1, W, r, 1, A, 0, Y, ldy);
        return;
    }
    for (size_t t0 = 0; t0 < T; t0 += TOKEN_CHUNK) {
        const size_t t1 = T - t0 < TOKEN_CHUNK ? T : t0 + TOKEN_CHUNK;
        size_t r = r0;
        for (; r + 4 <= r1; r += 4) rows_q(S, 4, W, r, A, t0, t1, Y, ldy);
        for (; r < r1; r++) rows_q(S, 1, W, r, A, t0, t1, Y, ldy);
    }
}

#define GEMM_Q(NAME, S)                                                                          \
    static void NAME(const cism_mat *W, size_t r0, size_t r1, const cism_act *A, size_t T,       \
                     float *Y, size_t ldy) {                                                     \
        gemm_q_tpl(S, W, r0, r1, A, T, Y, ldy);                                            \
    }

/* ---- ggml K-quants (q4_k, q6_k) x q8 activations ----
 *
 * The canonical order (kernels.h, gemm_q8_ref.c): a dot's 8 float lanes,
 * lane j folding in sub-block (run) j of each super-block. Here two rows
 * share a zmm of lanes, [row A | row B], each half in a fixed permutation
 * of j (the block sums come out of the reduction that way; the scales and
 * activation scales are put in the same order, and the lanes go back
 * before cism_reduce8's tree). Per super-block each row's 256 codes meet
 * the token's 256 activations in four vpdpbusd (or maddubs + madd), whose
 * dword lanes (four products each) a pack-and-madd tree sums to 16 group
 * sums per row: the partial sums it packs fit int16 (q4_k: 4 * 15 * 127,
 * then twice that; q6_k with code - 32 taken off first: 4 * 32 * 127, then
 * twice that, 32512), so vpackssdw never saturates and two rows go through
 * the tree together.
 * q4_k: the two 64-byte code loads split into low and high nibbles give
 * [sub-block 0 | 2], [1 | 3], [4 | 6], [5 | 7], so the activation blocks are
 * paired the same way once per token; sub-block sums come out in lane
 * order Q4K_ORDER. q6_k: the codes of runs [0 | 1], [2 | 3], [4 | 5],
 * [6 | 7] come from the ql nibbles and the qh bit pairs and meet the
 * activations in element order, each dword starting from -32 times its
 * four activations; the 16-element group sums, times the int8 scales, add
 * up in pairs to run sums in lane order Q6K_ORDER. */

/* Lane p of a dot holds sub-block (run) ORDER[p]; as lane indices the way
 * back is Q4K_ORDER itself or Q6K_BACK. */
#define Q4K_ORDER 0, 1, 4, 5, 2, 3, 6, 7
#define Q6K_ORDER 0, 2, 4, 6, 1, 3, 5, 7
#define Q6K_BACK 0, 4, 1, 5, 2, 6, 3, 7

/* Four vectors of dword lane sums -> their 128-bit lane sums: lane L of
 * the result holds [v0 lane L, v1 lane L, v2 lane L, v3 lane L] (each the
 * sum of that 128-bit lane's 4 dwords; integer additions, any order).
 * Every dword and every pair of dwords must fit in int16. */
ALWAYS_INLINE __m512i lane_sums16(const __m512i v[4]) {
    const __m512i ones = _mm512_set1_epi16(1);
    const __m512i m01 = _mm512_madd_epi16(_mm512_packs_epi32(v[0], v[1]), ones); /* [v0 pairs, v1 pairs] */
    const __m512i m23 = _mm512_madd_epi16(_mm512_packs_epi32(v[2], v[3]), ones);
    return _mm512_madd_epi16(_mm512_packs_epi32(m01, m23), ones);
}

/* Two rows' lane_sums16 results: [A lanes 0+1, A lanes 2+3 | B lanes 0+1,
 * B lanes 2+3]. */
ALWAYS_INLINE __m512i pair_halves(__m512i a, __m512i b) {
    return _mm512_add_epi32(_mm512_shuffle_i32x4(a, b, 0x88), _mm512_shuffle_i32x4(a, b, 0xdd));
}

/* One token's share of a super-block, made once for all rows. */
typedef struct {
    __m512i a[4];     /* q4_k: [b0|b2], [b1|b3], [b4|b6], [b5|b7]; q6_k: [b0|b1] .. [b6|b7] */
    __m512i start[4]; /* q6_k: -32 x the four-activation sums of a[c] */
    __m512i asum;     /* q4_k: [asum | asum] (Q4K_ORDER) */
    __m512 scale;     /* [ascale | ascale] (ORDER) */
} kq_tok;

ALWAYS_INLINE void kq8_token(const int S, const cism_act *A, size_t t, size_t sb, kq_tok *k) {
    const int8_t *a = A->q8 + t * A->ldq + CISM_QK_K * sb;
    const __m256 as = _mm256_loadu_ps(A->qscale + t * A->ldqs + 8 * sb);
    __m512i x[4];
    for (int c = 0; c < 4; c++) x[c] = _mm512_loadu_si512((const void *)(a + 64 * c));
    const __m512i zero = _mm512_setzero_si512();
    if (S == CISM_Q4K) {
        k->a[0] = _mm512_shuffle_i64x2(x[0], x[1], 0x44);
        k->a[1] = _mm512_shuffle_i64x2(x[0], x[1], 0xee);
        k->a[2] = _mm512_shuffle_i64x2(x[2], x[3], 0x44);
        k->a[3] = _mm512_shuffle_i64x2(x[2], x[3], 0xee);
        __m512i v[4];
        for (int c = 0; c < 4; c++) v[c] = Q8_DOT4(zero, _mm512_set1_epi8(1), k->a[c]);
        const __m512i u = lane_sums16(v);
        k->asum = pair_halves(u, u);
        k->scale = _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(
            _mm256_permutevar8x32_ps(as, _mm256_setr_epi32(Q4K_ORDER)))));
    } else {
        for (int c = 0; c < 4; c++) {
            k->a[c] = x[c];
            k->start[c] = _mm512_sub_epi32(zero, Q8_DOT4(zero, _mm512_set1_epi8(32), x[c]));
        }
        k->scale = _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(
            _mm256_permutevar8x32_ps(as, _mm256_setr_epi32(Q6K_ORDER)))));
    }
}

/* A row's 256 code bytes, arranged as kq_tok.a. */
ALWAYS_INLINE void kq8_codes(const int S, const uint8_t *blk, __m512i q[4]) {
    const __m512i m4 = _mm512_set1_epi8(15);
    if (S == CISM_Q4K) {
        for (int h = 0; h < 2; h++) {
            const __m512i x = _mm512_loadu_si512((const void *)(blk + CISM_Q4_K_QS + 64 * h));
            q[2 * h] = _mm512_and_si512(x, m4);
            q[2 * h + 1] = _mm512_and_si512(_mm512_srli_epi16(x, 4), m4);
        }
        return;
    }
    for (int c = 0; c < 4; c++) q[c] = q6k_codes64(blk, c);
}

/* Two rows' super-block scales, in their lanes: q4_k sc = [sc_A | sc_B],
 * m = [m_A | m_B] (Q4K_ORDER), d = [d_A | d_B], dmin = [dmin_A | dmin_B];
 * q6_k sc = A's 16 int8 scales in the group sums' order (group 4k + L at
 * dword 4L + k), m = B's, d = [d_A | d_B]. */
typedef struct {
    __m512i sc, m;
    __m512 d, dmin;
} kq_scales2;

ALWAYS_INLINE void kq8_scales2(const int S, const uint8_t *ba, const uint8_t *bb, kq_scales2 *p) {
    if (S == CISM_Q4K) {
        /* q4k_scale_bytes on both rows at once, then [sc_A sc_B | m_A m_B] */
        const __m256i x = _mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(ba + CISM_Q4_K_SCALES))),
            _mm_loadu_si128((const __m128i *)(bb + CISM_Q4_K_SCALES)), 1);
        const __m256i pick = _mm256_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11,
                                              0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11);
        const __m256i tops = _mm256_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7,
                                              -1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7);
        const __m256i pv = _mm256_shuffle_epi8(x, pick), qv = _mm256_shuffle_epi8(x, tops);
        const __m256i low = _mm256_and_si256(pv, _mm256_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0,
                                                                  63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0));
        const __m256i nib = _mm256_and_si256(_mm256_srli_epi16(pv, 4),
                                             _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15,
                                                              0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15));
        const __m256i top = _mm256_srli_epi16(_mm256_and_si256(qv, _mm256_set1_epi8((char)0xc0)), 2);
        const __m256i b = _mm256_shuffle_epi8(_mm256_or_si256(_mm256_or_si256(low, nib), top),
                                              _mm256_setr_epi8(0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15,
                                                               0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15));
        const __m256i sm = _mm256_permute4x64_epi64(b, 0xd8); /* [sc_A sc_B | m_A m_B] */
        p->sc = _mm512_cvtepu8_epi32(_mm256_castsi256_si128(sm));
        p->m = _mm512_cvtepu8_epi32(_mm256_extracti128_si256(sm, 1));
        int32_t da, db;
        memcpy(&da, ba + CISM_Q4_K_D, 4);
        memcpy(&db, bb + CISM_Q4_K_D, 4);
        const __m512 dd = _mm512_castps128_ps512(_mm_cvtph_ps(_mm_insert_epi32(_mm_cvtsi32_si128(da), db, 1)));
        p->d = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2), dd);
        p->dmin = _mm512_permutexvar_ps(_mm512_setr_epi32(1, 1, 1, 1, 1, 1, 1, 1, 3, 3, 3, 3, 3, 3, 3, 3), dd);
        return;
    }
    const __m128i order = _mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    p->sc = _mm512_cvtepi8_epi32(_mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(ba + CISM_Q6_K_SCALES)), order));
    p->m = _mm512_cvtepi8_epi32(_mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(bb + CISM_Q6_K_SCALES)), order));
    uint16_t ha, hb;
    memcpy(&ha, ba + CISM_Q6_K_D, 2);
    memcpy(&hb, bb + CISM_Q6_K_D, 2);
    const __m512 dd = _mm512_castps128_ps512(_mm_cvtph_ps(_mm_insert_epi16(_mm_cvtsi32_si128(ha), hb, 1)));
    p->d = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1), dd);
}

/* Two rows' super-block and one token folded into their lanes [A | B]. */
ALWAYS_INLINE __m512 kq8_fold2(const int S, const __m512i qa[4], const __m512i qb[4],
                               const kq_scales2 *p, const kq_tok *k, __m512 acc) {
    __m512i va[4], vb[4];
    for (int c = 0; c < 4; c++) {
        const __m512i s0 = S == CISM_Q4K ? _mm512_setzero_si512() : k->start[c];
        va[c] = Q8_DOT4(s0, qa[c], k->a[c]);
        vb[c] = Q8_DOT4(s0, qb[c], k->a[c]);
    }
    if (S == CISM_Q4K) {
        /* [sc * isum | ...], [m * asum | ...] and d * ascale, -(dmin * ascale) */
        const __m512i isum = pair_halves(lane_sums16(va), lane_sums16(vb));
        const __m512 f = _mm512_cvtepi32_ps(_mm512_mullo_epi32(isum, p->sc));
        const __m512 g = _mm512_cvtepi32_ps(_mm512_mullo_epi32(k->asum, p->m));
        acc = _mm512_fmadd_ps(f, _mm512_mul_ps(p->d, k->scale), acc);
        return _mm512_fmadd_ps(g, _mm512_xor_ps(_mm512_mul_ps(p->dmin, k->scale), _mm512_set1_ps(-0.0f)), acc);
    }
    /* group sums times the scales, pairs into runs */
    const __m512i ga = _mm512_mullo_epi32(lane_sums16(va), p->sc);
    const __m512i gb = _mm512_mullo_epi32(lane_sums16(vb), p->m);
    const __m512 f = _mm512_cvtepi32_ps(pair_halves(ga, gb));
    return _mm512_fmadd_ps(f, _mm512_mul_ps(p->d, k->scale), acc);
}

/* The canonical tree over a dot's lanes (held in ORDER). */
ALWAYS_INLINE float kq8_finish(const int S, __m256 acc) {
    const __m256 c = _mm256_permutevar8x32_ps(acc, S == CISM_Q4K ? _mm256_setr_epi32(Q4K_ORDER)
                                                                 : _mm256_setr_epi32(Q6K_BACK));
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(c), _mm256_extractf128_ps(c, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4)); /* [s4_0 + s4_2, s4_1 + s4_3] */
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

/* An R x TT tile: rows r, r + rs, ..., tokens t .. t + TT - 1; rows go in
 * pairs (a last odd row paired with itself, computed twice, stored once). */
ALWAYS_INLINE void kq8_tile(const int S, const int R, const int TT, const cism_mat *W, size_t r,
                            size_t rs, const cism_act *A, size_t t, float *Y, size_t ldy) {
    const int P = (R + 1) / 2;
    const size_t bb = kq_block_bytes(S);
    const uint8_t *rows[8];
    __m512 acc[4][4];
    for (int i = 0; i < 2 * P; i++) rows[i] = (const uint8_t *)W->codes + (r + (i < R ? i : R - 1) * rs) * W->row_bytes;
    for (int i = 0; i < P; i++)
        for (int j = 0; j < TT; j++) acc[i][j] = _mm512_setzero_ps();
    for (size_t sb = 0; sb < W->cols / CISM_QK_K; sb++) {
        kq_tok k[4];
        for (int j = 0; j < TT; j++) kq8_token(S, A, t + j, sb, &k[j]);
        /* (fully unrolled, or the accumulators live in memory) */
#pragma GCC unroll 4
        for (int i = 0; i < P; i++) {
            const uint8_t *ba = rows[2 * i] + sb * bb, *bq = rows[2 * i + 1] + sb * bb;
            kq_prefetch(S, ba);
            kq_prefetch(S, bq);
            __m512i qa[4], qb[4];
            kq_scales2 p;
            kq8_codes(S, ba, qa);
            kq8_codes(S, bq, qb);
            kq8_scales2(S, ba, bq, &p);
#pragma GCC unroll 4
            for (int j = 0; j < TT; j++) acc[i][j] = kq8_fold2(S, qa, qb, &p, &k[j], acc[i][j]);
        }
    }
    for (int i = 0; i < R; i++)
        for (int j = 0; j < TT; j++)
            Y[(t + j) * ldy + r + i * rs] = kq8_finish(S, i % 2 ? hi8(acc[i / 2][j]) : lo8(acc[i / 2][j]));
}

ALWAYS_INLINE void gemm_kq8_tpl(const int S, const cism_mat *W, size_t r0, size_t r1,
                                const cism_act *A, size_t T, float *Y, size_t ldy) {
    if (T == 1) { /* 8 streams spread over the rows, as in gemm_f32_tpl */
        const size_t L = (r1 - r0) / 8;
        for (size_t j = 0; j < L; j++) kq8_tile(S, 8, 1, W, r0 + j, L, A, 0, Y, ldy);
        size_t r = r0 + 8 * L;
        for (; r + 2 <= r1; r += 2) kq8_tile(S, 2, 1, W, r, 1, A, 0, Y, ldy);
        if (r < r1) kq8_tile(S, 1, 1, W, r, 1, A, 0, Y, ldy);
        return;
    }
    /* 4 rows x 4 tokens, the rows' data staying in L1 while a chunk of
     * tokens goes by */
    for (size_t t0 = 0; t0 < T; t0 += TOKEN_CHUNK) {
        const size_t t1 = T - t0 < TOKEN_CHUNK ? T : t0 + TOKEN_CHUNK;
        for (size_t r = r0; r < r1; r += 4) {
            const int R = r1 - r < 4 ? (int)(r1 - r) : 4;
            size_t t = t0;
            for (; t + 4 <= t1; t += 4) {
                switch (R) {
                case 4: kq8_tile(S, 4, 4, W, r, 1, A, t, Y, ldy); break;
                case 3: kq8_tile(S, 3, 4, W, r, 1, A, t, Y, ldy); break;
                case 2: kq8_tile(S, 2, 4, W, r, 1, A, t, Y, ldy); break;
                default: kq8_tile(S, 1, 4, W, r, 1, A, t, Y, ldy); break;
                }
            }
            for (; t < t1; t++) {
                switch (R) {
                case 4: kq8_tile(S, 4, 1, W, r, 1, A, t, Y, ldy); break;
                case 3: kq8_tile(S, 3, 1, W, r, 1, A, t, Y, ldy); break;
                case 2: kq8_tile(S, 2, 1, W, r, 1, A, t, Y, ldy); break;
                default: kq8_tile(S, 1, 1, W, r, 1, A, t, Y, ldy); break;
                }
            }
        }
    }
}

/* Q8_DOT4 against the dword at p in every lane. The including file may
 * name a form that reads it straight from memory (vpdpbusd's embedded
 * broadcast), which GCC does not emit for Q8_DOT4(set1) by itself. */
#ifndef Q8_DOT4_BCAST
ALWAYS_INLINE __m512i dot4_bcast(__m512i acc, __m512i a, const int8_t *p) {
    int32_t x;
    memcpy(&x, p, 4);
    return Q8_DOT4(acc, a, _mm512_set1_epi32(x));
}
#define Q8_DOT4_BCAST dot4_bcast
#endif

/* The tokens-in-lanes kernels (these K-quant ones, q8_vnni.h's) from
 * TQ_MIN_TOKENS tokens on, TQ_PASS groups of 16 tokens per pass over the
 * rows. */
#define TQ_MIN_TOKENS 8
#define TQ_PASS 8

/* acc[m] lane n = the result of row r + m, token t0 + n: stored as token
 * rows (one masked 16-row store per token, rows r..r+rn-1, tokens
 * t0..t0+tn-1), through a 16 x 16 transpose. */
ALWAYS_INLINE void store_rows16(const __m512 acc[16], size_t rn, size_t tn, float *Y, size_t ldy, size_t t0,
                                size_t r) {
    __m512i in[16], out[16];
    for (int m = 0; m < 16; m++) in[m] = _mm512_castps_si512(acc[m]);
    transpose16(in, out); /* out[n]: token n's 16 rows */
    const __mmask16 mask = rn >= 16 ? 0xffff : (__mmask16)((1u << rn) - 1);
    for (size_t n = 0; n < tn; n++) _mm512_mask_storeu_ps(Y + (t0 + n) * ldy + r, mask, _mm512_castsi512_ps(out[n]));
}

/* A tokens-in-lanes pass's results, buf[q][i] = row r + i's 16 tokens of
 * group g + q (rn rows, G groups), written to Y token-major. */
ALWAYS_INLINE void store_groups16(float buf[2][16][16], size_t G, size_t rn, size_t g, size_t T, float *Y,
                                  size_t ldy, size_t r) {
    for (size_t q = 0; q < G; q++) {
        __m512 rowsv[16];
        for (size_t i = 0; i < 16; i++) rowsv[i] = i < rn ? _mm512_load_ps(buf[q][i]) : _mm512_setzero_ps();
        const size_t t0 = 16 * (g + q);
        store_rows16(rowsv, rn, T - t0 < 16 ? T - t0 : 16, Y, ldy, t0, r);
    }
}

/* ---- ggml K-quants x q8, several tokens: tokens in lanes ----
 *
 * From TQ_MIN_TOKENS tokens on, as for the other integer storages: the
 * token groups' q8 activations are transposed once per call (a + 128 as
 * unsigned bytes), each row's codes unpacked once per pass to signed bytes
 * (q4_k: q; q6_k: code - 32), and every weight dword broadcast to Q8_DOT4
 * against 16 tokens' dwords (vpdpbusd; on the avx512 level maddubs + madd,
 * exact here: a + 128 <= 255 times |w| <= 32 keeps a pair within 16320), so a lane ends a block (q6_k: a 16-element
 * group) holding one (row, token) integer sum plus 128 times the weights'
 * own sum, which is taken off (it is computed once per row). The canonical
 * lanes (kernels.h) become one vector per (row, sub-block j), 16 tokens
 * wide: lane j's chain over the super-blocks, in order, for j = 0..7 one
 * after the other, then the tree as vertical adds.
 * Both sides are stored lane-major (block 8 sb + j at position j * nsb +
 * sb), so a lane's chain reads memory in order rather than at a 4 KiB
 * stride that meets in few L1 sets; a tile is 4 rows x 2 token groups:
 * eight independent Q8_DOT4 chains, each weight broadcast serving 32
 * tokens, each row's scales 2 groups (4 rows x 1 group, one chain per row,
 * ran at half the int4 kernel's rate). The integers go to float by exact
 * float products (kernels.h's bounds: every factor and product below
 * 2^24): (float)(sc * isum) = (float)isum * sc, (float)(m * asum) = asum *
 * m, and q6_k's sc_lo * isum_lo + sc_hi * isum_hi is one fma of two such
 * products; q4_k's asum are the activations' block sums, made once per
 * call. */

/* What a (row, sub-block j, super-block sb) contributes besides its codes:
 * q4_k corr[0] = -128 x the sub-block's code sum, sc = {sc_j, m_j};
 * q6_k corr = -128 x the two groups' sums of code - 32, sc = their int8
 * scales. */
typedef struct {
    int32_t corr[2];
    float sc[2];
} kq_meta;

/* A row's scratch: codes at wb (lane-major, 32 bytes per (j, sb)); at
 * meta, 8 nsb kq_meta (lane-major), then per super-block {d, -dmin}
 * (q4_k; -dmin * as = -(dmin * as), the reference's product negated) or
 * {d, 0} (q6_k). */
ALWAYS_INLINE size_t kq_meta_bytes(size_t nsb) { return 8 * nsb * sizeof(kq_meta) + 2 * nsb * sizeof(float); }

ALWAYS_INLINE void kq_unpack_row(const int S, const uint8_t *row, size_t nsb, int8_t *wb, kq_meta *meta) {
    const __m512i zero = _mm512_setzero_si512();
    float *dd = (float *)(meta + 8 * nsb);
    for (size_t sb = 0; sb < nsb; sb++) {
        const uint8_t *blk = row + sb * kq_block_bytes(S);
        __m512i q[4]; /* element order: sub-blocks (runs) 2k and 2k + 1 */
        if (S == CISM_Q4K) {
            /* sub-blocks 2k, 2k + 1: the low and high nibbles of qs[32k ...] */
            const __m512i m4 = _mm512_set1_epi8(15);
            for (int k = 0; k < 4; k++) {
                const __m512i x = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(blk + CISM_Q4_K_QS + 32 * k)));
                q[k] = _mm512_inserti64x4(_mm512_and_si512(x, m4),
                                          _mm512_castsi512_si256(_mm512_and_si512(_mm512_srli_epi16(x, 4), m4)), 1);
            }
        } else {
            for (int k = 0; k < 4; k++) q[k] = q6k_codes64(blk, k);
        }
        /* code sums per 8 bytes (vpsadbw): sub-block j is sums[4j .. 4j + 3] */
        __attribute__((aligned(64))) int64_t sums[32];
        for (int k = 0; k < 4; k++) {
            _mm512_store_si512((void *)(sums + 8 * k), _mm512_sad_epu8(q[k], zero));
            const __m512i v = S == CISM_Q4K ? q[k] : _mm512_sub_epi8(q[k], _mm512_set1_epi8(32));
            _mm256_storeu_si256((__m256i *)(wb + 32 * (2 * k * nsb + sb)), _mm512_castsi512_si256(v));
            _mm256_storeu_si256((__m256i *)(wb + 32 * ((2 * k + 1) * nsb + sb)), _mm512_extracti64x4_epi64(v, 1));
        }
        if (S == CISM_Q4K) {
            uint8_t sm[16];
            _mm_storeu_si128((__m128i *)sm, q4k_scale_bytes(blk + CISM_Q4_K_SCALES));
            for (int j = 0; j < 8; j++) {
                kq_meta *mt = meta + j * nsb + sb;
                mt->corr[0] = -128 * (int32_t)(sums[4 * j] + sums[4 * j + 1] + sums[4 * j + 2] + sums[4 * j + 3]);
                mt->corr[1] = 0;
                mt->sc[0] = (float)sm[j];
                mt->sc[1] = (float)sm[8 + j];
            }
            int32_t d2;
            memcpy(&d2, blk + CISM_Q4_K_D, 4);
            _mm_storel_pi((__m64 *)(dd + 2 * sb), _mm_xor_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(d2)), _mm_setr_ps(0.0f, -0.0f, 0.0f, 0.0f)));
        } else {
            for (int j = 0; j < 8; j++) {
                kq_meta *mt = meta + j * nsb + sb;
                for (int h = 0; h < 2; h++) {
                    mt->corr[h] = -128 * ((int32_t)(sums[4 * j + 2 * h] + sums[4 * j + 2 * h + 1]) - 32 * 16);
                    mt->sc[h] = (float)(int8_t)blk[CISM_Q6_K_SCALES + 2 * j + h];
                }
            }
            uint16_t h;
            memcpy(&h, blk + CISM_Q6_K_D, 2);
            dd[2 * sb] = _cvtsh_ss(h);
            dd[2 * sb + 1] = 0.0f;
        }
    }
}

/* Tokens t..t+tn-1 (tn <= 16; missing ones zero) of a K-quant product,
 * lane-major: block b = 8 sb + j at x = j * nsb + sb holds its 8 dwords'
 * rows (16 tokens each, a + 128) at B + 128 x, its scales at Sg + 16 x and
 * (q4_k) its sums at Ag + 16 x, as floats. */
ALWAYS_INLINE void kq_pack_group(const int S, const cism_act *A, size_t t, size_t tn, size_t nsb, int32_t *B,
                                 float *Sg, float *Ag) {
    const __m512i bias = _mm512_set1_epi8((char)0x80), ones = _mm512_set1_epi8(1);
    for (size_t u = 0; u < 4 * nsb; u++) {
        __m512i in[16], out[16];
        for (size_t n = 0; n < 16; n++)
            in[n] = n < tn ? _mm512_loadu_si512((const void *)(A->q8 + (t + n) * A->ldq + 64 * u))
                           : _mm512_setzero_si512();
        transpose16(in, out); /* out[k] = dword k of the unit, all tokens */
        for (size_t h = 0; h < 2; h++) {
            const size_t b = 2 * u + h, x = (b % 8) * nsb + b / 8;
            __m512i s = _mm512_set1_epi32(-128 * 32); /* sum(a + 128) - 128 * 32 */
            for (int k = 0; k < 8; k++) {
                const __m512i v = _mm512_xor_si512(out[8 * h + k], bias);
                _mm512_store_si512((void *)(B + 128 * x + 16 * k), v);
                if (S == CISM_Q4K) s = Q8_DOT4(s, v, ones);
            }
            if (S == CISM_Q4K) _mm512_store_ps(Ag + 16 * x, _mm512_cvtepi32_ps(s));
            for (size_t n = 0; n < 16; n++) Sg[16 * x + n] = n < tn ? A->qscale[(t + n) * A->ldqs + b] : 0.0f;
        }
    }
}

/* R rows (codes w[i], scratch m[i]) x G groups of 16 tokens (at Bg, Sg,
 * Ag, group g a stride of gstride int32s or sstride floats on): out[i][g]
 * lane n = the dot of row i and token 16 g + n. */
ALWAYS_INLINE void kq_tq_tile(const int S, const int R, const int G, const int8_t *const *w,
                              const kq_meta *const *m, size_t nsb, const int32_t *Bg, size_t gstride,
                              const float *Sg, const float *Ag, size_t sstride, __m512 out[4][2]) {
    __m512 lane[8][4][2];
    for (int j = 0; j < 8; j++) {
        __m512 acc[4][2];
        for (int i = 0; i < R; i++)
            for (int g = 0; g < G; g++) acc[i][g] = _mm512_setzero_ps();
        for (size_t sb = 0; sb < nsb; sb++) {
            const size_t x = j * nsb + sb;
            __m512i lo[4][2], hi[4][2]; /* q6_k: the run's two groups; q4_k: lo only */
            for (int i = 0; i < R; i++) {
                const __m512i c0 = _mm512_set1_epi32(m[i][x].corr[0]);
                const __m512i c1 = _mm512_set1_epi32(m[i][x].corr[1]);
                for (int g = 0; g < G; g++) {
                    lo[i][g] = c0;
                    hi[i][g] = c1;
                }
            }
            for (int k = 0; k < 8; k++) {
                __m512i av[2];
                for (int g = 0; g < G; g++) av[g] = _mm512_load_si512((const void *)(Bg + g * gstride + 128 * x + 16 * k));
                for (int i = 0; i < R; i++)
                    for (int g = 0; g < G; g++) {
                        const int8_t *wd = w[i] + 32 * x + 4 * k;
                        if (S == CISM_Q6K && k >= 4) hi[i][g] = Q8_DOT4_BCAST(hi[i][g], av[g], wd);
                        else lo[i][g] = Q8_DOT4_BCAST(lo[i][g], av[g], wd);
                    }
            }
            __m512 as[2], am[2];
            for (int g = 0; g < G; g++) {
                as[g] = _mm512_load_ps(Sg + g * sstride + 16 * x);
                if (S == CISM_Q4K) am[g] = _mm512_load_ps(Ag + g * sstride + 16 * x);
            }
            for (int i = 0; i < R; i++) {
                const kq_meta *mt = m[i] + x;
                const float *dd = (const float *)(m[i] + 8 * nsb) + 2 * sb;
                const __m512 d = _mm512_set1_ps(dd[0]), sc0 = _mm512_set1_ps(mt->sc[0]), sc1 = _mm512_set1_ps(mt->sc[1]);
                for (int g = 0; g < G; g++) {
                    if (S == CISM_Q4K) {
                        /* sc * isum, then m * asum against -(dmin * ascale) */
                        const __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(lo[i][g]), sc0);
                        acc[i][g] = _mm512_fmadd_ps(f, _mm512_mul_ps(d, as[g]), acc[i][g]);
                        acc[i][g] = _mm512_fmadd_ps(_mm512_mul_ps(am[g], sc1),
                                                    _mm512_mul_ps(_mm512_set1_ps(dd[1]), as[g]), acc[i][g]);
                    } else {
                        const __m512 f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi[i][g]), sc1,
                                                         _mm512_mul_ps(_mm512_cvtepi32_ps(lo[i][g]), sc0));
                        acc[i][g] = _mm512_fmadd_ps(f, _mm512_mul_ps(d, as[g]), acc[i][g]);
                    }
                }
            }
        }
        for (int i = 0; i < R; i++)
            for (int g = 0; g < G; g++) lane[j][i][g] = acc[i][g];
    }
    /* cism_reduce8, lane by lane */
    for (int i = 0; i < R; i++)
        for (int g = 0; g < G; g++) {
            __m512 l[8];
            for (int j = 0; j < 8; j++) l[j] = lane[j][i][g];
            out[i][g] = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(l[0], l[4]), _mm512_add_ps(l[2], l[6])),
                                      _mm512_add_ps(_mm512_add_ps(l[1], l[5]), _mm512_add_ps(l[3], l[7])));
        }
}

ALWAYS_INLINE void gemm_kq8_tq_tpl(const int S, const cism_mat *W, size_t r0, size_t r1, const cism_act *A,
                                   size_t T, float *Y, size_t ldy) {
    const size_t nsb = W->cols / CISM_QK_K, nx = 8 * nsb;
    const size_t groups = cism_div_up(T, 16);
    const size_t gstride = 128 * nx, sstride = 16 * nx; /* int32s, floats per token group */
    const size_t b_bytes = groups * gstride * 4, s_bytes = groups * sstride * 4;
    const size_t a_bytes = S == CISM_Q4K ? s_bytes : 0;
    const size_t w_bytes = 16 * W->cols, mrow = cism_div_up(kq_meta_bytes(nsb), 64) * 64;
    if (r1 <= r0) return;
    uint8_t *mem = cism_scratch_get(b_bytes + s_bytes + a_bytes + w_bytes + 16 * mrow);
    if (!mem) { /* the dots-in-lanes tiles need no scratch and give the same bits */
        gemm_kq8_tpl(S, W, r0, r1, A, T, Y, ldy);
        return;
    }
    int32_t *B = (int32_t *)mem;
    float *Sc = (float *)(mem + b_bytes);
    float *As = (float *)(mem + b_bytes + s_bytes);
    int8_t *wb = (int8_t *)(mem + b_bytes + s_bytes + a_bytes);
    uint8_t *meta = mem + b_bytes + s_bytes + a_bytes + w_bytes;
    for (size_t g = 0; g < groups; g++) {
        const size_t tn = T - 16 * g < 16 ? T - 16 * g : 16;
        kq_pack_group(S, A, 16 * g, tn, nsb, B + g * gstride, Sc + g * sstride, As + g * sstride);
    }
    for (size_t g0 = 0; g0 < groups; g0 += TQ_PASS)
    for (size_t r = r0; r < r1; r += 16) {
        const size_t g1 = groups - g0 < TQ_PASS ? groups : g0 + TQ_PASS;
        const size_t rn = r1 - r < 16 ? r1 - r : 16;
        const int8_t *w[16];
        const kq_meta *mt[16];
        for (size_t i = 0; i < rn; i++) {
            kq_unpack_row(S, (const uint8_t *)W->codes + (r + i) * W->row_bytes, nsb, wb + i * W->cols,
                          (kq_meta *)(meta + i * mrow));
            w[i] = wb + i * W->cols;
            mt[i] = (const kq_meta *)(meta + i * mrow);
        }
        for (size_t g = g0; g < g1; g += 2) {
            const size_t G = g1 - g < 2 ? g1 - g : 2;
            const int32_t *Bg = B + g * gstride;
            const float *Sg = Sc + g * sstride, *Ag = As + g * sstride;
            /* the 16 rows' results, row-major per group, then written
             * transposed (store_rows16) */
            __attribute__((aligned(64))) float buf[2][16][16];
            for (size_t i0 = 0; i0 < rn; i0 += 4) {
                const size_t R = rn - i0 < 4 ? rn - i0 : 4;
                __m512 acc[4][2];
                for (int i = 0; i < 4; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps(); /* (for the compiler) */
#define KQ_CASE(RR, GG) kq_tq_tile(S, RR, GG, w + i0, mt + i0, nsb, Bg, gstride, Sg, Ag, sstride, acc)
                switch (4 * (G - 1) + R - 1) {
                case 0: KQ_CASE(1, 1); break;
                case 1: KQ_CASE(2, 1); break;
                case 2: KQ_CASE(3, 1); break;
                case 3: KQ_CASE(4, 1); break;
                case 4: KQ_CASE(1, 2); break;
                case 5: KQ_CASE(2, 2); break;
                case 6: KQ_CASE(3, 2); break;
                default: KQ_CASE(4, 2); break;
                }
#undef KQ_CASE
                for (size_t i = 0; i < R; i++)
                    for (size_t q = 0; q < G; q++) _mm512_store_ps(buf[q][i0 + i], acc[i][q]);
            }
            store_groups16(buf, G, rn, g, T, Y, ldy, r);
        }
    }
    cism_scratch_put(mem);
}

#define GEMM_KQ8(NAME, S)                                                                        \
    static void NAME(const cism_mat *W, size_t r0, size_t r1, const cism_act *A, size_t T,       \
                     float *Y, size_t ldy) {                                                     \
        if (T >= TQ_MIN_TOKENS) gemm_kq8_tq_tpl(S, W, r0, r1, A, T, Y, ldy);                     \
        else gemm_kq8_tpl(S, W, r0, r1, A, T, Y, ldy);                                        \
    }

#endif
