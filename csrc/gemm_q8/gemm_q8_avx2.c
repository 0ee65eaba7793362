/* AVX2 (+FMA, F16C): integer weights x q8 activations, bit for bit
 * gemm_q8_ref.c (one float chain per dot over exact integer block sums,
 * kernels.h). Quantized activations are zero padded to cism_act_len(cols):
 * these paths read whole units and the padding adds fma(0, s, acc) = acc.
 * (Their lanes are never -0: (float)p * s + acc is a multiple of 2^-149
 * like every float, so a nonzero result cannot round to 0, and a zero one
 * is +0.) The canonical dot's 16 lanes are two ymm here (gemm/gemm_avx2.c).
 * Decode runs 8 rows (the dots whose block sums one reduction finishes
 * together) spread over the caller's rows as in gemm/gemm_avx2.c; several
 * tokens run 4 x 2 tiles (one reduction), and from 8 tokens on tokens in
 * lanes (below). */
#include "scratch.h"
#include "simd_avx2.h"

#include <stdlib.h>

enum { Q_INT8 = 0, Q_INT4 = 1, Q_FP4 = 2 }; /* int8, int4, fp4 weights x q8 */

/* int8 x q8, one 32-byte block per step: lane j first holds the exact sum of
 * the products 4j..4j+3. maddubs(|a|, sign(a) w) pairs stay within int16
 * (|a|, |w| <= 127), so it never saturates. sign_epi8 also zeroes w where
 * a == 0 (product 0 anyway). */
ALWAYS_INLINE __m256i dot4_i8(__m256i a_abs, __m256i a, __m256i w) {
    const __m256i p16 = _mm256_maddubs_epi16(a_abs, _mm256_sign_epi8(w, a));
    return _mm256_madd_epi16(p16, _mm256_set1_epi16(1));
}

/* Lane p of *e (*o) = the sum of v[p]'s lanes 0-3 (4-7) (integers: any
 * order); for fp4 those are blocks 2u and 2u + 1 of dot p. */
ALWAYS_INLINE void block_sums4x2(const __m256i v[8], __m256i *e, __m256i *o) {
    __m256i a[4], b[2];
    for (int i = 0; i < 4; i++)
        a[i] = _mm256_add_epi32(_mm256_unpacklo_epi32(v[2 * i], v[2 * i + 1]),
                                _mm256_unpackhi_epi32(v[2 * i], v[2 * i + 1]));
    /* b[i], 128-bit half L: the sums of half L of v4i .. v4i+3 */
    for (int i = 0; i < 2; i++)
        b[i] = _mm256_add_epi32(_mm256_unpacklo_epi64(a[2 * i], a[2 * i + 1]),
                                _mm256_unpackhi_epi64(a[2 * i], a[2 * i + 1]));
    *e = _mm256_permute2x128_si256(b[0], b[1], 0x20);
    *o = _mm256_permute2x128_si256(b[0], b[1], 0x31);
}

/* Lane p of the result = the sum of v[p]'s 8 lanes. */
ALWAYS_INLINE __m256i block_sums8(const __m256i v[8]) {
    __m256i e, o;
    block_sums4x2(v, &e, &o);
    return _mm256_add_epi32(e, o);
}

/* Block b of tokens t .. t + TT - 1: a[j] their q8 bytes, aa[j] the bytes'
 * magnitudes (dot4_i8's operands); returns their scales, lane p = token
 * p % TT (dot p = i * TT + j). */
ALWAYS_INLINE __m256 act_block8(const cism_act *A, size_t t, const int TT, size_t b, __m256i a[8], __m256i aa[8]) {
    float sc[8];
    for (int j = 0; j < TT; j++) {
        a[j] = _mm256_loadu_si256((const __m256i *)(A->q8 + (t + j) * A->ldq + 32 * b));
        aa[j] = _mm256_abs_epi8(a[j]);
        sc[j] = A->qscale[(t + j) * A->ldqs + b];
    }
    return _mm256_setr_ps(sc[0 % TT], sc[1 % TT], sc[2 % TT], sc[3 % TT], sc[4 % TT], sc[5 % TT], sc[6 % TT],
                          sc[7 % TT]);
}

/* An R x TT tile of int8 x q8 dots (R * TT <= 8), one accumulator lane per
 * dot (the canonical chain over blocks): dot p = i * TT + j in lane p. */
ALWAYS_INLINE void tile_i8q8(const int R, const int TT, const cism_mat *W, size_t r, size_t rs,
                             const cism_act *A, size_t t, float *Y, size_t ldy) {
    const size_t blocks = cism_div_up(W->cols, 32);
    const int P = R * TT;
    const uint8_t *rows[8];
    __m256 acc = _mm256_setzero_ps();
    for (int i = 0; i < R; i++) rows[i] = (const uint8_t *)W->codes + (r + i * rs) * W->row_bytes;
    for (size_t b = 0; b < blocks; b++) {
        __m256i a[8], aa[8], v[8];
        const __m256 s = act_block8(A, t, TT, b, a, aa);
        for (int i = 0; i < R; i++) {
            const __m256i w = _mm256_loadu_si256((const __m256i *)(rows[i] + 32 * b));
            for (int j = 0; j < TT; j++) v[i * TT + j] = dot4_i8(aa[j], a[j], w);
        }
        for (int p = P; p < 8; p++) v[p] = _mm256_setzero_si256();
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block_sums8(v)), s, acc);
    }
    float out[8];
    _mm256_storeu_ps(out, acc);
    for (int p = 0; p < P; p++) {
        const size_t row = r + (size_t)(p / TT) * rs;
        Y[(t + p % TT) * ldy + row] = out[p] * W->scales[row];
    }
}

/* int4 / fp4 x q8: the same rule with c_b = wscale_b * ascale_b (kernels.h).
 * A unit is 32 elements: one int4 block, or fp4 blocks 2u and 2u + 1 (one
 * per 128-bit lane); the weights as signed bytes in element order go
 * through dot4_i8 like int8 codes (|w| <= 12). */
ALWAYS_INLINE __m256i nib_unit_i8(const int S, const uint8_t *codes, size_t u) {
    const __m128i x = _mm_loadu_si128((const __m128i *)(codes + 16 * u));
    if (S == CISM_INT4) { /* byte t: element t (low nibble), t + 16 (high) */
        const __m256i c = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(x, 4), x), _mm256_set1_epi8(15));
        return _mm256_sub_epi8(c, _mm256_set1_epi8(8));
    }
    __m128i v0, v1;
    fp4_values(codes + 16 * u, &v0, &v1);
    return _mm256_set_m128i(v1, v0);
}

/* Lane p = v[p / TT] (a value of dot p's row), 0 past P = R * TT. */
ALWAYS_INLINE __m256 per_row8(const float *v, const int R, const int TT) {
    float l[8];
    for (int p = 0; p < 8; p++) l[p] = p < R * TT ? v[p / TT] : 0.0f;
    return _mm256_setr_ps(l[0], l[1], l[2], l[3], l[4], l[5], l[6], l[7]);
}

/* An R x TT tile of int4 or fp4 x q8 dots (R * TT <= 8), dot p = i * TT + j
 * in lane p; blocks past the row are never folded in. */
ALWAYS_INLINE void tile_nq8(const int S, const int R, const int TT, const cism_mat *W, size_t r, size_t rs,
                            const cism_act *A, size_t t, float *Y, size_t ldy) {
    const size_t units = cism_div_up(W->cols, 32), so = W->scale_offset;
    const size_t blocks = cism_div_up(W->cols, S == CISM_INT4 ? 32 : 16);
    const int P = R * TT;
    const uint8_t *rows[8];
    __m256 acc = _mm256_setzero_ps();
    for (int i = 0; i < R; i++) rows[i] = (const uint8_t *)W->codes + (r + i * rs) * W->row_bytes;
    for (size_t u = 0; u < units; u++) {
        __m256i a[8], aa[8], v[8];
        const __m256 ca = act_block8(A, t, TT, u, a, aa);
        for (int i = 0; i < R; i++) {
            const __m256i w = nib_unit_i8(S, rows[i], u);
            for (int j = 0; j < TT; j++) v[i * TT + j] = dot4_i8(aa[j], a[j], w);
        }
        for (int p = P; p < 8; p++) v[p] = _mm256_setzero_si256();
        if (S == CISM_INT4) {
            float ws[8];
            for (int i = 0; i < R; i++) ws[i] = cism_int4_scale(rows[i], so, u);
            const __m256 c = _mm256_mul_ps(per_row8(ws, R, TT), ca); /* = wscale_b * ascale_b */
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block_sums8(v)), c, acc);
        } else {
            __m256i e, o;
            block_sums4x2(v, &e, &o);
            float w0[8], w1[8]; /* the odd block's byte is read only when it exists */
            for (int i = 0; i < R; i++) {
                w0[i] = e4m3_half[rows[i][so + 2 * u]];
                w1[i] = 2 * u + 1 < blocks ? e4m3_half[rows[i][so + 2 * u + 1]] : 0.0f;
            }
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(e), _mm256_mul_ps(per_row8(w0, R, TT), ca), acc);
            if (2 * u + 1 < blocks)
                acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(o), _mm256_mul_ps(per_row8(w1, R, TT), ca), acc);
        }
    }
    float out[8];
    _mm256_storeu_ps(out, acc);
    for (int p = 0; p < P; p++) Y[(t + p % TT) * ldy + r + (size_t)(p / TT) * rs] = out[p];
}

/* ---- decode of int4 / fp4 x q8: 8 rows, one token ----
 *
 * A step is 64 elements (32 code bytes) of each row. The codes are used as
 * unsigned bytes, int4: the code 0..15, fp4: 2 * E2M1 + 12 (0..24), against
 * the signed q8 activations, so maddubs needs no sign juggling and two of
 * its pair sums still fit int16 (2 * 2 * 24 * 127); the bias (8 or 12)
 * times the activations' sums, computed once per step for all 8 rows, is
 * taken off the lanes before they are reduced, so every block sum is
 * exactly sum(w * a) (kernels.h: integer sums, any order).
 *   int4: a block is 32 elements and 16 code bytes, element e in the low
 *   nibble of byte e (e < 16) or the high nibble of byte e - 16. The low
 *   nibbles of a step's 32 bytes meet [elements 0-15 | 32-47] of the
 *   activations and the high ones [16-31 | 48-63]: lanes 0-3 end with block
 *   2s, lanes 4-7 with block 2s + 1.
 *   fp4: a block is 16 elements and 8 code bytes, byte k holding elements
 *   2k (low nibble) and 2k + 1 (high). Low nibbles meet the even elements
 *   and high ones the odd: int32 lanes [b0 b0 b1 b1 | b2 b2 b3 b3].
 * The weight scales sit after each row's codes, out of the hardware
 * prefetchers' sight: they are loaded for 8 steps at once, transposed so
 * that lane i is row i, and prefetched two such periods ahead (without that
 * the AVX-512 gemv waited on them; see q8_avx512.h). */

#define STEP_PERIOD 8 /* steps per load of the weight scales */


/* out[k] lane i = in[i] lane k (8 x 8 floats). */
ALWAYS_INLINE void transpose8(const __m256 in[8], __m256 out[8]) {
    __m256 t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(in[i], in[i + 1]);     /* [e0 e0 e1 e1 | e4 e4 e5 e5] of rows i, i+1 */
        t[i + 1] = _mm256_unpackhi_ps(in[i], in[i + 1]); /* [e2 e2 e3 e3 | e6 e6 e7 e7] */
    }
    for (int i = 0; i < 8; i += 4)
        for (int h = 0; h < 2; h++) {
            u[i + 2 * h] = _mm256_shuffle_ps(t[i + h], t[i + 2 + h], 0x44);     /* e(2h), e(2h+4) of rows i..i+3 */
            u[i + 2 * h + 1] = _mm256_shuffle_ps(t[i + h], t[i + 2 + h], 0xee); /* e(2h+1), e(2h+5) */
        }
    for (int k = 0; k < 4; k++) {
        out[k] = _mm256_permute2f128_ps(u[k], u[4 + k], 0x20);
        out[k + 4] = _mm256_permute2f128_ps(u[k], u[4 + k], 0x31);
    }
}

/* The weight scales of steps s0..s0+7 of the 8 rows, lane i = row i.
 * int4: cw[k] = wscale of block 2 * s0 + k (k < 16). fp4: cw[k] = the 4
 * scale bytes of step s0 + k (blocks 4(s0+k) .. +3), still as bytes. Loads
 * stop at the row's last block (fp4: its dword); lanes past it are never
 * folded in. */
ALWAYS_INLINE void step_scales8(const int S, const uint8_t *const rows[8], size_t so, size_t blocks, size_t s0,
                                __m256 cw[16]) {
    __m256 in[8];
    if (S == CISM_INT4) {
        const size_t b0 = 2 * s0, nb = blocks - b0 < 16 ? blocks - b0 : 16;
        for (int h = 0; h < 2; h++) {
            const __m256i m = lane_mask((long)nb - 8 * h);
            for (int i = 0; i < 8; i++) in[i] = _mm256_maskload_ps((const float *)(rows[i] + so) + b0 + 8 * h, m);
            transpose8(in, cw + 8 * h);
        }
        return;
    }
    const size_t b0 = 4 * s0, nb = blocks - b0 < 32 ? blocks - b0 : 32;
    const __m256i m = lane_mask((long)cism_div_up(nb, 4));
    for (int i = 0; i < 8; i++) in[i] = _mm256_castsi256_ps(_mm256_maskload_epi32((const int *)(rows[i] + so + b0), m));
    transpose8(in, cw);
}

/* The 4 blocks' scales of one fp4 step (its dword of each row, as
 * step_scales8 leaves it) as e4m3 * 0.5 floats, f[k] = block 4s + k of
 * rows 0-7. The byte's bits moved into a binary16 (exponent bias 15
 * instead of 7, subnormals included) is the value * 2^-8, which vcvtph2ps
 * widens exactly, and * 2^7 is exact. Scale bytes are never negative
 * (formats.h); a byte past the row may read as anything, and is never
 * folded in. */
ALWAYS_INLINE void fp4_step_scales(__m256 dw, __m256 f[4]) {
    const __m256i by_block = _mm256_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15,
                                              0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    /* each half: [block k of its 4 rows] for k = 0..3; then dwords to
     * [b0 rows 0-3, b0 rows 4-7, b1 ..., b2 ..., b3 ...] */
    const __m256i b = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(_mm256_castps_si256(dw), by_block),
                                                  _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    const __m256 k128 = _mm256_set1_ps(128.0f);
    for (int h = 0; h < 2; h++) {
        const __m128i bytes = h ? _mm256_extracti128_si256(b, 1) : _mm256_castsi256_si128(b);
        const __m256i x = _mm256_slli_epi16(_mm256_cvtepu8_epi16(bytes), 7);
        f[2 * h] = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(x)), k128);
        f[2 * h + 1] = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(x, 1)), k128);
    }
}

/* Lane p of out[k] = the sum of the two lanes of v[p] that hold block k
 * (v[p] = [b0 b0 b1 b1 | b2 b2 b3 b3], the fp4 layout above). */
ALWAYS_INLINE void fp4_block_sums(const __m256i v[8], __m256i out[4]) {
    __m256 h[4];
    for (int j = 0; j < 4; j++) h[j] = _mm256_castsi256_ps(_mm256_hadd_epi32(v[2 * j], v[2 * j + 1]));
    /* h[j] = [b0 b1 of row 2j, b0 b1 of row 2j+1 | b2 b3, b2 b3] */
    const __m256 x0 = _mm256_shuffle_ps(h[0], h[1], 0x88), x1 = _mm256_shuffle_ps(h[0], h[1], 0xdd);
    const __m256 y0 = _mm256_shuffle_ps(h[2], h[3], 0x88), y1 = _mm256_shuffle_ps(h[2], h[3], 0xdd);
    /* x0 = [b0 of rows 0-3 | b2 of rows 0-3], x1 = [b1 | b3]; y for rows 4-7 */
    out[0] = _mm256_castps_si256(_mm256_permute2f128_ps(x0, y0, 0x20));
    out[1] = _mm256_castps_si256(_mm256_permute2f128_ps(x1, y1, 0x20));
    out[2] = _mm256_castps_si256(_mm256_permute2f128_ps(x0, y0, 0x31));
    out[3] = _mm256_castps_si256(_mm256_permute2f128_ps(x1, y1, 0x31));
}

/* maddubs of two byte vectors pairs with two activation vectors, added in
 * int16 (exact, see above), then widened to int32 lane sums of 8 products. */
ALWAYS_INLINE __m256i dot8_u8s8(__m256i w0, __m256i a0, __m256i w1, __m256i a1) {
    const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(w0, a0), _mm256_maddubs_epi16(w1, a1));
    return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
}

/* Rows r, r + rs, ..., r + 7 rs of an int4 or fp4 matrix times one q8
 * activation row: Y[row] = the canonical chain (kernels.h). */
ALWAYS_INLINE void gemv_nq8_rows8(const int S, const cism_mat *W, size_t r, size_t rs, const cism_act *A,
                                  float *Y) {
    const size_t so = W->scale_offset, steps = cism_div_up(W->cols, 64);
    const size_t blocks = cism_div_up(W->cols, S == CISM_INT4 ? 32 : 16);
    const size_t scale_bytes = S == CISM_INT4 ? 8 : 4; /* per row and step */
    const uint8_t *rows[8];
    for (int i = 0; i < 8; i++) {
        rows[i] = (const uint8_t *)W->codes + (r + i * rs) * W->row_bytes;
        for (size_t s = 0; s < 2 * STEP_PERIOD; s += 64 / scale_bytes)
            _mm_prefetch((const char *)(rows[i] + so + scale_bytes * s), _MM_HINT_T0);
    }
    const __m256i low4 = _mm256_set1_epi8(15);
    const __m256i lut = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)cism_e2m1_x2_biased));
    const __m256i even_odd = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                              0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    const __m256i bias = _mm256_set1_epi8(CISM_NIB_BIAS(S));
    __m256 cw[16];
    __m256 acc = _mm256_setzero_ps();
    for (size_t s = 0; s < steps; s++) {
        if (s % STEP_PERIOD == 0) {
            step_scales8(S, rows, so, blocks, s, cw);
            for (int i = 0; i < 8; i++) /* two periods ahead; past the matrix is harmless */
                _mm_prefetch((const char *)(rows[i] + so + scale_bytes * (s + 2 * STEP_PERIOD)), _MM_HINT_T0);
        }
        /* the step's activations, paired with the low (a0) and high (a1) nibbles */
        const __m256i x0 = _mm256_loadu_si256((const __m256i *)(A->q8 + 64 * s));
        const __m256i x1 = _mm256_loadu_si256((const __m256i *)(A->q8 + 64 * s + 32));
        __m256i a0, a1;
        if (S == CISM_INT4) {
            a0 = _mm256_permute2x128_si256(x0, x1, 0x20);
            a1 = _mm256_permute2x128_si256(x0, x1, 0x31);
        } else { /* [evens | odds] of each 16 bytes, then the evens (odds) of both halves together */
            const __m256i e0 = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(x0, even_odd), 0xd8);
            const __m256i e1 = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(x1, even_odd), 0xd8);
            a0 = _mm256_permute2x128_si256(e0, e1, 0x20);
            a1 = _mm256_permute2x128_si256(e0, e1, 0x31);
        }
        const __m256i start = dot8_u8s8(bias, a0, bias, a1);
        __m256i v[8];
        for (int i = 0; i < 8; i++) {
            const __m256i c = _mm256_loadu_si256((const __m256i *)(rows[i] + 32 * s));
            __m256i lo = _mm256_and_si256(c, low4), hi = _mm256_and_si256(_mm256_srli_epi16(c, 4), low4);
            if (S == CISM_FP4) {
                lo = _mm256_shuffle_epi8(lut, lo);
                hi = _mm256_shuffle_epi8(lut, hi);
            }
            v[i] = _mm256_sub_epi32(dot8_u8s8(lo, a0, hi, a1), start);
        }
        const float *as = A->qscale + 2 * s; /* activation blocks 2s, 2s + 1 */
        const size_t k = s % STEP_PERIOD;
        if (S == CISM_INT4) {
            __m256i e, o;
            block_sums4x2(v, &e, &o);
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(e), _mm256_mul_ps(cw[2 * k], _mm256_set1_ps(as[0])), acc);
            if (2 * s + 1 < blocks)
                acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(o), _mm256_mul_ps(cw[2 * k + 1], _mm256_set1_ps(as[1])),
                                      acc);
        } else {
            __m256i f[4];
            __m256 c[4];
            fp4_block_sums(v, f);
            fp4_step_scales(cw[k], c);
            for (int j = 0; j < 4; j++)
                if (4 * s + j < blocks)
                    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(f[j]), _mm256_mul_ps(c[j], _mm256_set1_ps(as[j / 2])),
                                          acc);
        }
    }
    float out[8];
    _mm256_storeu_ps(out, acc);
    for (int i = 0; i < 8; i++) Y[r + i * rs] = out[i];
}

ALWAYS_INLINE void tile_q(const int kind, const int R, const int TT, const cism_mat *W, size_t r, size_t rs,
                          const cism_act *A, size_t t, float *Y, size_t ldy) {
    if (kind == Q_INT8) tile_i8q8(R, TT, W, r, rs, A, t, Y, ldy);
    else tile_nq8(kind == Q_INT4 ? CISM_INT4 : CISM_FP4, R, TT, W, r, rs, A, t, Y, ldy);
}

ALWAYS_INLINE void rows_q(const int kind, const int R, const int TT, const cism_mat *W, size_t r,
                          const cism_act *A, size_t t0, size_t t1, float *Y, size_t ldy) {
    size_t t = t0;
    for (; t + TT <= t1; t += TT) tile_q(kind, R, TT, W, r, 1, A, t, Y, ldy);
    if (TT > 2 && t + 2 <= t1) {
        tile_q(kind, R, 2, W, r, 1, A, t, Y, ldy);
        t += 2;
    }
    if (t < t1) tile_q(kind, R, 1, W, r, 1, A, t, Y, ldy);
}

ALWAYS_INLINE void gemm_q_tpl(const int kind, const cism_mat *W, size_t r0, size_t r1,
                              const cism_act *A, size_t T, float *Y, size_t ldy) {
    if (T == 1) {
        /* 8 streams spread over the rows, as above: the dots whose block
         * sums one reduction finishes together */
        const size_t L = (r1 - r0) / 8;
        for (size_t j = 0; j < L; j++) {
            if (kind == Q_INT8) tile_q(kind, 8, 1, W, r0 + j, L, A, 0, Y, ldy);
            else gemv_nq8_rows8(kind == Q_INT4 ? CISM_INT4 : CISM_FP4, W, r0 + j, L, A, Y);
        }
        for (size_t r = r0 + 8 * L; r < r1; r++) tile_q(kind, 1, 1, W, r, 1, A, 0, Y, ldy);
        return;
    }
    /* 4 x 2 tiles: the 8 dots of one reduction */
    for (size_t t0 = 0; t0 < T; t0 += TOKEN_CHUNK) {
        const size_t t1 = T - t0 < TOKEN_CHUNK ? T : t0 + TOKEN_CHUNK;
        size_t r = r0;
        for (; r + 4 <= r1; r += 4) rows_q(kind, 4, 2, W, r, A, t0, t1, Y, ldy);
        for (; r < r1; r++) rows_q(kind, 1, 2, W, r, A, t0, t1, Y, ldy);
    }
}

/* ---- several tokens x int4 / fp4 weights x q8: tokens in lanes ----
 *
 * From TQ_MIN_TOKENS tokens on, the q8 activations of each group of 8
 * tokens are transposed once, at the start of the pass over the rows that
 * uses them, so that one ymm holds dword k of an activation block for the 8
 * tokens, and each tile of up to TQ_ROWS rows is
 * unpacked once per pass to unsigned bytes in element order (int4: the
 * code, fp4: 2 * E2M1 + 12, as in the decode kernel above). Each weight
 * dword is broadcast to maddubs against the token vector, and a block's
 * pair sums add up in int16 lanes: a block is 8 dwords of int4 (16 products
 * of at most 15 * 127 per lane) or 4 of fp4 (8 of at most 24 * 127), well
 * inside 32767. One madd then gives each lane the block sum of one (row,
 * token) plus the bias times the activations' sum, which was taken once
 * per token and block when they were packed. The chain folds with lane =
 * token, as in the AVX-512 VNNI kernel: acc = fma((float)s_b, c_b, acc) --
 * the same bits as the reference, without the per-dot reductions and scale
 * gathers of the dots-in-lanes tiles (kept below TQ_MIN_TOKENS). */
#define TQ_MIN_TOKENS 8
#define TQ_PASS 8 /* token groups of 8 per pass over the rows */
#define TQ_ROWS 6 /* rows per tile: 6 int16 sums, 6 chains, a token vector, a weight */

/* Tokens t..t+tn-1 (tn <= 8, missing ones zero) transposed: activation
 * block b (32 elements) at B + 64 b (int32s), its row k holding dword k of
 * the block for each token; the 8 tokens' scales of block b at Sa + 8 b;
 * bias * (the sum of the activations of weight block wb) at Bs + 8 wb. */
static void pack_q8_group8(const int S, const cism_act *A, size_t t, size_t tn, size_t ablocks, int32_t *B,
                           float *Sa, int32_t *Bs) {
    const __m256i bias = _mm256_set1_epi8(CISM_NIB_BIAS(S)), ones = _mm256_set1_epi16(1);
    for (size_t b = 0; b < ablocks; b++) {
        __m256 in[8], out[8];
        for (size_t n = 0; n < 8; n++)
            in[n] = n < tn ? _mm256_loadu_ps((const float *)(A->q8 + (t + n) * A->ldq + 32 * b))
                           : _mm256_setzero_ps();
        transpose8(in, out); /* out[k] = dword k of the block, all tokens */
        __m256i sum16[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
        for (int k = 0; k < 8; k++) {
            const __m256i a = _mm256_castps_si256(out[k]);
            _mm256_store_si256((__m256i *)(B + 64 * b + 8 * k), a);
            sum16[k / 4] = _mm256_add_epi16(sum16[k / 4], _mm256_maddubs_epi16(bias, a)); /* 8 products <= 12 * 127 */
        }
        const __m256i h0 = _mm256_madd_epi16(sum16[0], ones), h1 = _mm256_madd_epi16(sum16[1], ones);
        if (S == CISM_INT4) {
            _mm256_store_si256((__m256i *)(Bs + 8 * b), _mm256_add_epi32(h0, h1));
        } else { /* fp4 blocks 2b (dwords 0-3) and 2b + 1 (dwords 4-7) */
            _mm256_store_si256((__m256i *)(Bs + 16 * b), h0);
            _mm256_store_si256((__m256i *)(Bs + 16 * b + 8), h1);
        }
        for (size_t n = 0; n < 8; n++) Sa[8 * b + n] = n < tn ? A->qscale[(t + n) * A->ldqs + b] : 0.0f;
    }
}

/* Rows r..r+rn-1 as unsigned bytes in element order at wb (row stride kp
 * = 32 * activation blocks) and their block scales at cw (row stride ldc =
 * the row's blocks). Code bytes read past a row's last block (fp4: the
 * second half of its last 16 bytes) meet zero activations and are never
 * folded in. */
ALWAYS_INLINE void tq_unpack(const int S, const cism_mat *W, size_t r, size_t rn, size_t kp, uint8_t *wb,
                             float *cw, size_t ldc) {
    const __m128i low4 = _mm_set1_epi8(15);
    const __m128i lut = _mm_loadu_si128((const __m128i *)cism_e2m1_x2_biased);
    for (size_t m = 0; m < rn; m++) {
        const uint8_t *row = (const uint8_t *)W->codes + (r + m) * W->row_bytes;
        uint8_t *o = wb + m * kp;
        for (size_t j = 0; 32 * j < kp; j++) {
            const __m128i x = _mm_loadu_si128((const __m128i *)(row + 16 * j));
            const __m128i lo = _mm_and_si128(x, low4), hi = _mm_and_si128(_mm_srli_epi16(x, 4), low4);
            if (S == CISM_INT4) { /* block j: elements 0-15 low nibbles, 16-31 high */
                _mm256_store_si256((__m256i *)(o + 32 * j), _mm256_set_m128i(hi, lo));
            } else { /* blocks 2j, 2j + 1: byte k holds elements 2k (low), 2k + 1 (high) */
                _mm256_store_si256((__m256i *)(o + 32 * j),
                                   _mm256_set_m128i(_mm_shuffle_epi8(lut, _mm_unpackhi_epi8(lo, hi)),
                                                    _mm_shuffle_epi8(lut, _mm_unpacklo_epi8(lo, hi))));
            }
        }
        for (size_t b = 0; b < ldc; b++)
            cw[m * ldc + b] = S == CISM_INT4 ? cism_int4_scale(row, W->scale_offset, b)
                                             : e4m3_half[row[W->scale_offset + b]];
    }
}

/* R rows (unpacked at wb, row stride kp; scales cw, row stride blocks) x
 * one group of 8 tokens (B, Sa, Bs as pack_q8_group8 leaves them): acc[i]
 * lane n = the chain of row i, token n, over the row's blocks. */
ALWAYS_INLINE void tq_tile(const int S, const int R, const uint8_t *wb, size_t kp, const float *cw, size_t blocks,
                           const int32_t *B, const float *Sa, const int32_t *Bs, __m256 acc[TQ_ROWS]) {
    const int KD = S == CISM_FP4 ? 4 : 8; /* dwords per weight block */
    const __m256i ones = _mm256_set1_epi16(1);
    for (int i = 0; i < R; i++) acc[i] = _mm256_setzero_ps();
    for (size_t b = 0; b < blocks; b++) {
        __m256i s16[TQ_ROWS];
        for (int i = 0; i < R; i++) s16[i] = _mm256_setzero_si256();
        for (int k = 0; k < KD; k++) {
            const size_t d = (size_t)KD * b + k; /* dword d of the row: elements 4d..4d+3 */
            const __m256i av = _mm256_load_si256((const __m256i *)(B + 8 * d));
            for (int i = 0; i < R; i++) {
                int32_t x;
                memcpy(&x, wb + i * kp + 4 * d, 4);
                s16[i] = _mm256_add_epi16(s16[i], _mm256_maddubs_epi16(_mm256_set1_epi32(x), av));
            }
            /* keep each sum a chain in one register: GCC 12 otherwise
             * reassociates the integer additions into trees whose products
             * all live at once, and spills them */
            for (int i = 0; i < R; i++) __asm__("" : "+x"(s16[i]));
        }
        const __m256i bs = _mm256_load_si256((const __m256i *)(Bs + 8 * b));
        const __m256 sa = _mm256_load_ps(Sa + 8 * (S == CISM_FP4 ? b / 2 : b));
        for (int i = 0; i < R; i++) {
            const __m256i sb = _mm256_sub_epi32(_mm256_madd_epi16(s16[i], ones), bs);
            const __m256 c = _mm256_mul_ps(_mm256_set1_ps(cw[i * blocks + b]), sa); /* wscale_b * ascale_b */
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sb), c, acc[i]);
        }
    }
}

ALWAYS_INLINE void gemm_tq8_tpl(const int S, const cism_mat *W, size_t r0, size_t r1, const cism_act *A,
                                size_t T, float *Y, size_t ldy) {
    const size_t ablocks = cism_div_up(W->cols, 32), kp = 32 * ablocks;
    const size_t blocks = cism_div_up(W->cols, S == CISM_INT4 ? 32 : 16);
    const size_t groups = cism_div_up(T, 8), pass = groups < TQ_PASS ? groups : TQ_PASS;
    /* one pass's packed activations, one tile's unpacked rows */
    const size_t b_bytes = pass * ablocks * 256, sa_bytes = pass * ablocks * 32;
    const size_t bs_bytes = pass * ablocks * 64, w_bytes = TQ_ROWS * kp;
    const size_t c_bytes = cism_div_up(TQ_ROWS * blocks * sizeof(float), 32) * 32;
    if (r1 <= r0) return;
    uint8_t *mem = cism_scratch_get(b_bytes + sa_bytes + bs_bytes + w_bytes + c_bytes);
    if (!mem) { /* the dots-in-lanes tiles need no scratch and give the same bits */
        gemm_q_tpl(S == CISM_INT4 ? Q_INT4 : Q_FP4, W, r0, r1, A, T, Y, ldy);
        return;
    }
    int32_t *B = (int32_t *)mem;
    float *Sa = (float *)(mem + b_bytes);
    int32_t *Bs = (int32_t *)(mem + b_bytes + sa_bytes);
    uint8_t *wb = mem + b_bytes + sa_bytes + bs_bytes;
    float *cw = (float *)(mem + b_bytes + sa_bytes + bs_bytes + w_bytes);
    for (size_t g0 = 0; g0 < groups; g0 += pass) {
        const size_t g1 = groups - g0 < pass ? groups : g0 + pass;
        for (size_t g = g0; g < g1; g++) {
            const size_t tn = T - 8 * g < 8 ? T - 8 * g : 8, j = g - g0;
            pack_q8_group8(S, A, 8 * g, tn, ablocks, B + j * ablocks * 64, Sa + j * ablocks * 8,
                           Bs + j * ablocks * 16);
        }
        for (size_t r = r0; r < r1; r += TQ_ROWS) {
            const size_t rn = r1 - r < TQ_ROWS ? r1 - r : TQ_ROWS;
            tq_unpack(S, W, r, rn, kp, wb, cw, blocks);
            for (size_t g = g0; g < g1; g++) {
                const int32_t *Bg = B + (g - g0) * ablocks * 64, *Bsg = Bs + (g - g0) * ablocks * 16;
                const float *Sag = Sa + (g - g0) * ablocks * 8;
                __m256 acc[8];
#define TQ_CASE(RR) tq_tile(S, RR, wb, kp, cw, blocks, Bg, Sag, Bsg, acc)
                switch (rn) {
                case 1: TQ_CASE(1); break;
                case 2: TQ_CASE(2); break;
                case 3: TQ_CASE(3); break;
                case 4: TQ_CASE(4); break;
                case 5: TQ_CASE(5); break;
                default: TQ_CASE(6); break;
                }
#undef TQ_CASE
                /* acc[i] lane n = row r + i, token 8g + n: stored as token rows
                 * through a transpose (one masked store of rn floats per token,
                 * not rn scalar stores a row stride apart) */
                __m256 out[8];
                for (size_t i = rn; i < 8; i++) acc[i] = _mm256_setzero_ps();
                transpose8(acc, out);
                const __m256i mask = lane_mask((long)rn);
                const size_t tn = T - 8 * g < 8 ? T - 8 * g : 8;
                for (size_t n = 0; n < tn; n++) _mm256_maskstore_ps(Y + (8 * g + n) * ldy + r, mask, out[n]);
            }
        }
    }
    cism_scratch_put(mem);
}

/* ---- several tokens x int8 weights x q8: tokens in lanes ----
 *
 * int8 codes run up to 127, so no maddubs layout adds two pair sums in
 * int16, and the dots-in-lanes tile spends a sign, a maddubs, a madd and a
 * share of the lane reduction per 32 products. From T8_MIN_TOKENS tokens on,
 * weights and activations are instead widened to int16, once per pass over
 * the rows for the activations of that pass (groups of 8 tokens, as many as
 * fit T8_PASS_BYTES) and once per pass and tile for the rows, and one madd of a broadcast
 * weight dword (2 elements) against a vector of 8 tokens' dwords gives each
 * lane 2 exact products summed: 16 products per madd and an add, no sign
 * juggling, no reduction. A block's 16 madds add up in int32 (at most
 * 32 * 127 * 127) to its exact sum s_b, and the chain folds with lane =
 * token: acc = fma((float)s_b, ascale_b, acc), then * wscale -- the
 * reference's bits (kernels.h). Measured on Zen 3 (one core, 64 tokens):
 * int8 x q8 57-74 -> 87-104 GFLOP/s over the four bench/gemm.py shapes, near
 * this core's issue limit for a broadcast, a madd and an add (~0.9 cycles). */
#define T8_MIN_TOKENS 8
#define T8_ROWS 6              /* rows per tile: 6 int32 sums, 6 chains, a token vector, a weight */
#define T8_PASS_BYTES (192 << 10) /* widened activations per pass over the rows: within L2 */

/* Tokens t..t+tn-1 (tn <= 8, missing ones zero) widened and transposed:
 * activation block b at B + 128 b (int32s), its row k holding elements 2k,
 * 2k + 1 of the block (as two int16) for each token; the 8 tokens' scales of
 * block b at Sa + 8 b. */
static void pack_q8_group8_i16(const cism_act *A, size_t t, size_t tn, size_t ablocks, int32_t *B, float *Sa) {
    for (size_t b = 0; b < ablocks; b++) {
        __m256 lo[8], hi[8], out[8];
        for (size_t n = 0; n < 8; n++) {
            __m256i x = _mm256_setzero_si256();
            if (n < tn) x = _mm256_loadu_si256((const __m256i *)(A->q8 + (t + n) * A->ldq + 32 * b));
            lo[n] = _mm256_castsi256_ps(_mm256_cvtepi8_epi16(_mm256_castsi256_si128(x)));
            hi[n] = _mm256_castsi256_ps(_mm256_cvtepi8_epi16(_mm256_extracti128_si256(x, 1)));
        }
        transpose8(lo, out); /* out[k] = elements 2k, 2k + 1 of each token */
        for (int k = 0; k < 8; k++) _mm256_store_ps((float *)(B + 128 * b + 8 * k), out[k]);
        transpose8(hi, out);
        for (int k = 0; k < 8; k++) _mm256_store_ps((float *)(B + 128 * b + 64 + 8 * k), out[k]);
        for (size_t n = 0; n < 8; n++) Sa[8 * b + n] = n < tn ? A->qscale[(t + n) * A->ldqs + b] : 0.0f;
    }
}

/* Rows r..r+rn-1 widened to int16 at wb (row stride kp = 32 * blocks
 * elements), zero past each row's cols (no byte past a row is read). */
static void t8_unpack(const cism_mat *W, size_t r, size_t rn, size_t kp, int16_t *wb) {
    const size_t cols = W->cols;
    for (size_t m = 0; m < rn; m++) {
        const int8_t *row = (const int8_t *)W->codes + (r + m) * W->row_bytes;
        int16_t *o = wb + m * kp;
        size_t j = 0;
        for (; j + 16 <= cols; j += 16)
            _mm256_store_si256((__m256i *)(o + j), _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(row + j))));
        for (; j < cols; j++) o[j] = row[j];
        for (; j < kp; j++) o[j] = 0;
    }
}

/* R rows (widened at wb, row stride kp) x one group of 8 tokens (B, Sa as
 * pack_q8_group8_i16 leaves them): acc[i] lane n = the chain of row i,
 * token n. */
ALWAYS_INLINE void t8_tile(const int R, const int16_t *wb, size_t kp, size_t blocks, const int32_t *B,
                           const float *Sa, __m256 acc[T8_ROWS]) {
    for (int i = 0; i < R; i++) acc[i] = _mm256_setzero_ps();
    for (size_t b = 0; b < blocks; b++) {
        __m256i s[T8_ROWS];
        for (int i = 0; i < R; i++) s[i] = _mm256_setzero_si256();
        for (int k = 0; k < 16; k++) {
            const size_t d = 16 * b + k; /* dword d of the row: elements 2d, 2d + 1 */
            const __m256i av = _mm256_load_si256((const __m256i *)(B + 8 * d));
            for (int i = 0; i < R; i++) {
                int32_t x;
                memcpy(&x, wb + i * kp + 2 * d, 4);
                s[i] = _mm256_add_epi32(s[i], _mm256_madd_epi16(_mm256_set1_epi32(x), av));
            }
            for (int i = 0; i < R; i++) __asm__("" : "+x"(s[i])); /* one chain per sum (see tq_tile) */
        }
        const __m256 sa = _mm256_load_ps(Sa + 8 * b);
        for (int i = 0; i < R; i++) acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[i]), sa, acc[i]);
    }
}

static void gemm_t8(const cism_mat *W, size_t r0, size_t r1, const cism_act *A, size_t T, float *Y,
                    size_t ldy) {
    const size_t blocks = cism_div_up(W->cols, 32), kp = 32 * blocks;
    const size_t groups = cism_div_up(T, 8), group_bytes = blocks * 512;
    size_t pass = T8_PASS_BYTES / group_bytes < 1 ? 1 : T8_PASS_BYTES / group_bytes;
    if (pass > groups) pass = groups;
    /* one pass's widened activations and scales, one tile's widened rows */
    const size_t b_bytes = pass * group_bytes, sa_bytes = pass * blocks * 32;
    const size_t w_bytes = T8_ROWS * kp * sizeof(int16_t);
    if (r1 <= r0) return;
    uint8_t *mem = cism_scratch_get(b_bytes + sa_bytes + w_bytes);
    if (!mem) { /* the dots-in-lanes tiles need no scratch and give the same bits */
        gemm_q_tpl(Q_INT8, W, r0, r1, A, T, Y, ldy);
        return;
    }
    int32_t *B = (int32_t *)mem;
    float *Sa = (float *)(mem + b_bytes);
    int16_t *wb = (int16_t *)(mem + b_bytes + sa_bytes);
    for (size_t g0 = 0; g0 < groups; g0 += pass) {
        const size_t g1 = groups - g0 < pass ? groups : g0 + pass;
        for (size_t g = g0; g < g1; g++) {
            const size_t tn = T - 8 * g < 8 ? T - 8 * g : 8;
            pack_q8_group8_i16(A, 8 * g, tn, blocks, B + (g - g0) * blocks * 128, Sa + (g - g0) * blocks * 8);
        }
        for (size_t r = r0; r < r1; r += T8_ROWS) {
            const size_t rn = r1 - r < T8_ROWS ? r1 - r : T8_ROWS;
            t8_unpack(W, r, rn, kp, wb);
            __m256 ws[T8_ROWS];
            for (size_t i = 0; i < rn; i++) ws[i] = _mm256_set1_ps(W->scales[r + i]);
            for (size_t g = g0; g < g1; g++) {
                const int32_t *Bg = B + (g - g0) * blocks * 128;
                const float *Sag = Sa + (g - g0) * blocks * 8;
                __m256 acc[8];
#define T8_CASE(RR) t8_tile(RR, wb, kp, blocks, Bg, Sag, acc)
                switch (rn) {
                case 1: T8_CASE(1); break;
                case 2: T8_CASE(2); break;
                case 3: T8_CASE(3); break;
                case 4: T8_CASE(4); break;
                case 5: T8_CASE(5); break;
                default: T8_CASE(6); break;
                }
#undef T8_CASE
                /* lane n of acc[i]: row r + i, token 8g + n; * wscale, then stored
                 * as token rows through a transpose as in gemm_tq8_tpl */
                __m256 out[8];
                for (size_t i = 0; i < rn; i++) acc[i] = _mm256_mul_ps(acc[i], ws[i]);
                for (size_t i = rn; i < 8; i++) acc[i] = _mm256_setzero_ps();
                transpose8(acc, out);
                const __m256i mask = lane_mask((long)rn);
                const size_t tn = T - 8 * g < 8 ? T - 8 * g : 8;
                for (size_t n = 0; n < tn; n++) _mm256_maskstore_ps(Y + (8 * g + n) * ldy + r, mask, out[n]);
            }
        }
    }
    cism_scratch_put(mem);
}

static void gemm_int8_q8_avx2(const cism_mat *W, size_t r0, size_t r1, const cism_act *A,
                              size_t T, float *Y, size_t ldy) {
    if (T >= T8_MIN_TOKENS) gemm_t8(W, r0, r1, A, T, Y, ldy);
    else gemm_q_tpl(Q_INT8, W, r0, r1, A, T, Y, ldy);
}
static void gemm_int4_q8_avx2(const cism_mat *W, size_t r0, size_t r1, const cism_act *A,
                              size_t T, float *Y, size_t ldy) {
    if (T >= TQ_MIN_TOKENS) gemm_tq8_tpl(CISM_INT4, W, r0, r1, A, T, Y, ldy);
    else gemm_q_tpl(Q_INT4, W, r0, r1, A, T, Y, ldy);
}
static void gemm_fp4_q8_avx2(const cism_mat *W, size_t r0, size_t r1, const cism_act *A,
                             size_t T, float *Y, size_t ldy) {
    if (T >= TQ_MIN_TOKENS) gemm_tq8_tpl(CISM_FP4, W, r0, r1, A, T, Y, ldy);
    else gemm_q_tpl(Q_FP4, W, r0, r1, A, T, Y, ldy);
}

/* ---- ggml K-quants (q4_k, q6_k) x q8 activations ----
 *
 * The canonical order (kernels.h, gemm_q8_ref.c): a dot's 8 float lanes,
 * lane j folding in sub-block (run) j of each super-block; here they are
 * one ymm in that order. Per super-block, row and token, block j's 32
 * products go by maddubs (unsigned codes: q4_k 0..15, q6_k 0..63, so the
 * pairs stay within int16) and madd into 8 dword lanes, and one reduction
 * (hsum8x8) gives the 8 block sums. q6_k takes code - 32 off in int16 (its
 * pair sums less maddubs(32, a): within 2 * 32 * 127) and applies its two
 * int8 scales in the madd, one per 128-bit lane (elements 0-15 and 16-31
 * of the run). Tiles are R rows (8 spread over the range for decode) x one
 * token, the token's activation sums (q4_k) made once per super-block. */

/* v[i]'s eight dwords summed, into lane i (integer additions: any order). */
ALWAYS_INLINE __m256i hsum8x8(const __m256i v[8]) {
    const __m256i q0 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    const __m256i q1 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(q0, q1, 0x20), _mm256_permute2x128_si256(q0, q1, 0x31));
}

/* Rows r, r + rs, ..., r + (R - 1) rs x token t. */
ALWAYS_INLINE void kq8_rows(const int S, const int R, const cism_mat *W, size_t r, size_t rs, const cism_act *A,
                            size_t t, float *Y, size_t ldy) {
    const size_t bb = kq_block_bytes(S);
    const int8_t *a = A->q8 + t * A->ldq;
    const __m256i ones = _mm256_set1_epi16(1), m16 = _mm256_set1_epi32(0xffff);
    const uint8_t *rows[8];
    __m256 acc[8];
    for (int i = 0; i < R; i++) {
        rows[i] = (const uint8_t *)W->codes + (r + i * rs) * W->row_bytes;
        acc[i] = _mm256_setzero_ps();
    }
    for (size_t sb = 0; sb < W->cols / CISM_QK_K; sb++) {
        const int8_t *x = a + CISM_QK_K * sb;
        const __m256 as = _mm256_loadu_ps(A->qscale + t * A->ldqs + 8 * sb);
        __m256i asum = _mm256_setzero_si256();
        if (S == CISM_Q4K) {
            __m256i v[8];
            for (int j = 0; j < 8; j++)
                v[j] = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1),
                                                              _mm256_loadu_si256((const __m256i *)(x + 32 * j))), ones);
            asum = hsum8x8(v);
        }
        for (int i = 0; i < R; i++) {
            const uint8_t *blk = rows[i] + sb * bb;
            kq_prefetch(S, blk);
            __m256i v[8];
            if (S == CISM_Q4K) {
                for (int j = 0; j < 8; j++)
                    v[j] = _mm256_madd_epi16(_mm256_maddubs_epi16(kq_codes32(S, blk, j),
                                                                  _mm256_loadu_si256((const __m256i *)(x + 32 * j))), ones);
                const __m128i b = q4k_scale_bytes(blk + CISM_Q4_K_SCALES);
                int32_t dd;
                memcpy(&dd, blk + CISM_Q4_K_D, 4);
                const __m128 d2 = _mm_cvtph_ps(_mm_cvtsi32_si128(dd));
                const __m256 d = _mm256_set1_ps(_mm_cvtss_f32(d2)), dmin = _mm256_set1_ps(_mm_cvtss_f32(_mm_movehdup_ps(d2)));
                const __m256 f = _mm256_cvtepi32_ps(_mm256_mullo_epi32(hsum8x8(v), _mm256_cvtepu8_epi32(b)));
                const __m256 g = _mm256_cvtepi32_ps(_mm256_mullo_epi32(asum, _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8))));
                acc[i] = _mm256_fmadd_ps(f, _mm256_mul_ps(d, as), acc[i]);
                acc[i] = _mm256_fmadd_ps(g, _mm256_xor_ps(_mm256_mul_ps(dmin, as), _mm256_set1_ps(-0.0f)), acc[i]);
            } else {
                /* the int8 scales, each duplicated into both halves of a dword */
                const __m128i sc = _mm_loadu_si128((const __m128i *)(blk + CISM_Q6_K_SCALES));
                const __m256i s0 = _mm256_cvtepi8_epi32(sc), s1 = _mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8));
                const __m256i dup[2] = {_mm256_or_si256(_mm256_and_si256(s0, m16), _mm256_slli_epi32(s0, 16)),
                                        _mm256_or_si256(_mm256_and_si256(s1, m16), _mm256_slli_epi32(s1, 16))};
                for (int j = 0; j < 8; j++) {
                    const __m256i xa = _mm256_loadu_si256((const __m256i *)(x + 32 * j));
                    const __m256i p = _mm256_sub_epi16(_mm256_maddubs_epi16(kq_codes32(S, blk, j), xa),
                                                       _mm256_maddubs_epi16(_mm256_set1_epi8(32), xa));
                    const int k = 2 * j % 8; /* scales 2j, 2j + 1 for the run's two halves */
                    const __m256i s = _mm256_permutevar8x32_epi32(dup[j / 4], _mm256_setr_epi32(k, k, k, k, k + 1, k + 1, k + 1, k + 1));
                    v[j] = _mm256_madd_epi16(p, s);
                }
                uint16_t h;
                memcpy(&h, blk + CISM_Q6_K_D, 2);
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hsum8x8(v)), _mm256_mul_ps(_mm256_set1_ps(_cvtsh_ss(h)), as), acc[i]);
            }
        }
    }
    for (int i = 0; i < R; i++) {
        /* cism_reduce8: lanes j + (j + 4), then the halves' pairs */
        const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(acc[i]), _mm256_extractf128_ps(acc[i], 1));
        const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        Y[t * ldy + r + i * rs] = _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
    }
}

ALWAYS_INLINE void gemm_kq8_tpl(const int S, const cism_mat *W, size_t r0, size_t r1, const cism_act *A, size_t T,
                                float *Y, size_t ldy) {
    if (T == 1) { /* 8 streams spread over the rows */
        const size_t L = (r1 - r0) / 8;
        for (size_t j = 0; j < L; j++) kq8_rows(S, 8, W, r0 + j, L, A, 0, Y, ldy);
        for (size_t r = r0 + 8 * L; r < r1; r++) kq8_rows(S, 1, W, r, 1, A, 0, Y, ldy);
        return;
    }
    /* 4 rows at a time, which stay in L1 while a chunk of tokens goes by */
    for (size_t t0 = 0; t0 < T; t0 += TOKEN_CHUNK) {
        const size_t t1 = T - t0 < TOKEN_CHUNK ? T : t0 + TOKEN_CHUNK;
        size_t r = r0;
        for (; r + 4 <= r1; r += 4)
            for (size_t t = t0; t < t1; t++) kq8_rows(S, 4, W, r, 1, A, t, Y, ldy);
        for (; r < r1; r++)
            for (size_t t = t0; t < t1; t++) kq8_rows(S, 1, W, r, 1, A, t, Y, ldy);
    }
}

/* ---- K-quants x q8, several tokens: tokens in lanes ----
 *
 * From TQ_MIN_TOKENS tokens on, the AVX-512 kernel's scheme (q8_avx512.h)
 * in 8-token ymms: each group of 8 tokens' activations transposed once
 * (one ymm holds dword k of a block for the 8 tokens) and stored lane-major
 * (block 8 sb + j at j * nsb + sb, so a lane's chain over the super-blocks
 * reads memory in order); each tile's rows unpacked once per pass to their
 * unsigned codes (q4_k 0..15, q6_k 0..63), lane-major too. A broadcast
 * weight dword goes to maddubs as the unsigned operand against the tokens'
 * signed activations, and the pair sums add up in int16 before one madd:
 * q4_k over a whole block (8 dwords, at most 8 * 2 * 15 * 128 = 30720),
 * q6_k over two dwords (2 * 2 * 63 * 128 = 32256), its 16-element group
 * sums then less 32 x the activations' group sums (taken once per token
 * at packing). The float steps are the AVX-512 kernel's exact products, so
 * every lane's chain is the reference's. */
#define KQ_TQ_ROWS 4

/* Tokens t..t+tn-1 (tn <= 8, missing ones zero): block b = 8 sb + j at
 * x = j * nsb + sb holds its 8 dword rows at B + 64 x, its scales at
 * Sa + 8 x; q4_k its activation sums (floats) at As + 8 x, q6_k 32 x its
 * two groups' sums (int32) at As + 16 x and + 8. */
static void kq_pack_group8(const int S, const cism_act *A, size_t t, size_t tn, size_t nsb, int32_t *B,
                           float *Sa, int32_t *As) {
    const __m256i ones8 = _mm256_set1_epi8(1), ones = _mm256_set1_epi16(1);
    for (size_t b = 0; b < 8 * nsb; b++) {
        const size_t x = (b % 8) * nsb + b / 8;
        __m256 in[8], out[8];
        for (size_t n = 0; n < 8; n++)
            in[n] = n < tn ? _mm256_loadu_ps((const float *)(A->q8 + (t + n) * A->ldq + 32 * b))
                           : _mm256_setzero_ps();
        transpose8(in, out);
        __m256i h[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
        for (int k = 0; k < 8; k++) {
            const __m256i a = _mm256_castps_si256(out[k]);
            _mm256_store_si256((__m256i *)(B + 64 * x + 8 * k), a);
            h[k / 4] = _mm256_add_epi16(h[k / 4], _mm256_maddubs_epi16(ones8, a)); /* |8 a| <= 1024 */
        }
        const __m256i s0 = _mm256_madd_epi16(h[0], ones), s1 = _mm256_madd_epi16(h[1], ones);
        if (S == CISM_Q4K) {
            _mm256_store_ps((float *)As + 8 * x, _mm256_cvtepi32_ps(_mm256_add_epi32(s0, s1)));
        } else {
            _mm256_store_si256((__m256i *)(As + 16 * x), _mm256_slli_epi32(s0, 5));
            _mm256_store_si256((__m256i *)(As + 16 * x + 8), _mm256_slli_epi32(s1, 5));
        }
        for (size_t n = 0; n < 8; n++) Sa[8 * x + n] = n < tn ? A->qscale[(t + n) * A->ldqs + b] : 0.0f;
    }
}

/* A row's codes, lane-major (32 bytes per (j, sb)) at wb; at sc, per
 * (j, sb) the two float scales (q4_k sc_j and m_j, q6_k the run's two int8
 * scales), then per super-block {d, -dmin} (q4_k) or {d, 0} (q6_k). */
static void kq_unpack_row8(const int S, const uint8_t *row, size_t nsb, uint8_t *wb, float *sc) {
    float *dd = sc + 16 * nsb;
    for (size_t sb = 0; sb < nsb; sb++) {
        const uint8_t *blk = row + sb * kq_block_bytes(S);
        for (int j = 0; j < 8; j++) _mm256_storeu_si256((__m256i *)(wb + 32 * (j * nsb + sb)), kq_codes32(S, blk, j));
        if (S == CISM_Q4K) {
            uint8_t sm[16];
            _mm_storeu_si128((__m128i *)sm, q4k_scale_bytes(blk + CISM_Q4_K_SCALES));
            for (int j = 0; j < 8; j++) {
                sc[2 * (j * nsb + sb)] = (float)sm[j];
                sc[2 * (j * nsb + sb) + 1] = (float)sm[8 + j];
            }
            dd[2 * sb] = cism_ggml_half(blk + CISM_Q4_K_D);
            dd[2 * sb + 1] = -cism_ggml_half(blk + CISM_Q4_K_DMIN);
        } else {
            for (int j = 0; j < 8; j++)
                for (int h = 0; h < 2; h++) sc[2 * (j * nsb + sb) + h] = (float)(int8_t)blk[CISM_Q6_K_SCALES + 2 * j + h];
            dd[2 * sb] = cism_ggml_half(blk + CISM_Q6_K_D);
            dd[2 * sb + 1] = 0.0f;
        }
    }
}

/* R rows (codes w[i], scales c[i]) x one group of 8 tokens: out[i] lane n
 * = the dot of row i and token n. */
ALWAYS_INLINE void kq_tq_tile8(const int S, const int R, const uint8_t *const *w, const float *const *c, size_t nsb,
                               const int32_t *B, const float *Sa, const int32_t *As, __m256 out[KQ_TQ_ROWS]) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 lane[8][KQ_TQ_ROWS];
    for (int j = 0; j < 8; j++) {
        __m256 acc[KQ_TQ_ROWS];
        for (int i = 0; i < R; i++) acc[i] = _mm256_setzero_ps();
        for (size_t sb = 0; sb < nsb; sb++) {
            const size_t x = j * nsb + sb;
            const __m256 as = _mm256_load_ps(Sa + 8 * x);
            __m256 f[KQ_TQ_ROWS];
            /* q4_k: one int16 sum over the block; q6_k: two per group */
            for (int part = 0; part < (S == CISM_Q4K ? 1 : 2); part++) {
                __m256i s[KQ_TQ_ROWS];
                for (int i = 0; i < R; i++) s[i] = _mm256_setzero_si256();
                for (int k2 = 0; k2 < (S == CISM_Q4K ? 8 : 4); k2 += (S == CISM_Q4K ? 8 : 2)) {
                    __m256i p[KQ_TQ_ROWS];
                    for (int i = 0; i < R; i++) p[i] = _mm256_setzero_si256();
                    for (int k = k2; k < k2 + (S == CISM_Q4K ? 8 : 2); k++) {
                        const int kk = S == CISM_Q4K ? k : 4 * part + k;
                        const __m256i av = _mm256_load_si256((const __m256i *)(B + 64 * x + 8 * kk));
                        for (int i = 0; i < R; i++) {
                            int32_t wd;
                            memcpy(&wd, w[i] + 32 * x + 4 * kk, 4);
                            p[i] = _mm256_add_epi16(p[i], _mm256_maddubs_epi16(_mm256_set1_epi32(wd), av));
                        }
                        /* (one chain per register; see tq_tile) */
                        for (int i = 0; i < R; i++) __asm__("" : "+x"(p[i]));
                    }
                    for (int i = 0; i < R; i++) s[i] = _mm256_add_epi32(s[i], _mm256_madd_epi16(p[i], ones));
                }
                for (int i = 0; i < R; i++) {
                    const float *cs = c[i] + 2 * x;
                    if (S == CISM_Q4K) {
                        f[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(s[i]), _mm256_set1_ps(cs[0]));
                    } else {
                        const __m256i g = _mm256_sub_epi32(s[i], _mm256_load_si256((const __m256i *)(As + 16 * x + 8 * part)));
                        f[i] = part == 0 ? _mm256_mul_ps(_mm256_cvtepi32_ps(g), _mm256_set1_ps(cs[0]))
                                         : _mm256_fmadd_ps(_mm256_cvtepi32_ps(g), _mm256_set1_ps(cs[1]), f[i]);
                    }
                }
            }
            for (int i = 0; i < R; i++) {
                const float *dd = c[i] + 16 * nsb + 2 * sb;
                acc[i] = _mm256_fmadd_ps(f[i], _mm256_mul_ps(_mm256_set1_ps(dd[0]), as), acc[i]);
                if (S == CISM_Q4K)
                    acc[i] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_load_ps((const float *)As + 8 * x),
                                                           _mm256_set1_ps(c[i][2 * x + 1])),
                                             _mm256_mul_ps(_mm256_set1_ps(dd[1]), as), acc[i]);
            }
        }
        for (int i = 0; i < R; i++) lane[j][i] = acc[i];
    }
    for (int i = 0; i < R; i++)
        out[i] = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(lane[0][i], lane[4][i]), _mm256_add_ps(lane[2][i], lane[6][i])),
                               _mm256_add_ps(_mm256_add_ps(lane[1][i], lane[5][i]), _mm256_add_ps(lane[3][i], lane[7][i])));
}

ALWAYS_INLINE void gemm_kq8_tq_tpl(const int S, const cism_mat *W, size_t r0, size_t r1, const cism_act *A, size_t T,
                                   float *Y, size_t ldy) {
    const size_t nsb = W->cols / CISM_QK_K, nx = 8 * nsb;
    const size_t groups = cism_div_up(T, 8), pass = groups < TQ_PASS ? groups : TQ_PASS;
    const size_t b_bytes = pass * nx * 256, sa_bytes = pass * nx * 32, as_bytes = pass * nx * 64;
    const size_t w_bytes = KQ_TQ_ROWS * W->cols, c_bytes = KQ_TQ_ROWS * 18 * nsb * sizeof(float);
    if (r1 <= r0) return;
    uint8_t *mem = cism_scratch_get(b_bytes + sa_bytes + as_bytes + w_bytes + c_bytes);
    if (!mem) { /* the dots-in-lanes rows need no scratch and give the same bits */
        gemm_kq8_tpl(S, W, r0, r1, A, T, Y, ldy);
        return;
    }
    int32_t *B = (int32_t *)mem;
    float *Sa = (float *)(mem + b_bytes);
    int32_t *As = (int32_t *)(mem + b_bytes + sa_bytes);
    uint8_t *wb = mem + b_bytes + sa_bytes + as_bytes;
    float *cw = (float *)(mem + b_bytes + sa_bytes + as_bytes + w_bytes);
    for (size_t g0 = 0; g0 < groups; g0 += pass) {
        const size_t g1 = groups - g0 < pass ? groups : g0 + pass;
        for (size_t g = g0; g < g1; g++) {
            const size_t tn = T - 8 * g < 8 ? T - 8 * g : 8, q = g - g0;
            kq_pack_group8(S, A, 8 * g, tn, nsb, B + q * nx * 64, Sa + q * nx * 8, As + q * nx * 16);
        }
        for (size_t r = r0; r < r1; r += KQ_TQ_ROWS) {
            const size_t rn = r1 - r < KQ_TQ_ROWS ? r1 - r : KQ_TQ_ROWS;
            const uint8_t *w[KQ_TQ_ROWS];
            const float *c[KQ_TQ_ROWS];
            for (size_t i = 0; i < rn; i++) {
                w[i] = wb + i * W->cols;
                c[i] = cw + i * 18 * nsb;
                kq_unpack_row8(S, (const uint8_t *)W->codes + (r + i) * W->row_bytes, nsb, wb + i * W->cols,
                               cw + i * 18 * nsb);
            }
            for (size_t g = g0; g < g1; g++) {
                const size_t q = g - g0;
                const int32_t *Bg = B + q * nx * 64, *Ag = As + q * nx * 16;
                const float *Sg = Sa + q * nx * 8;
                __m256 acc[8];
                switch (rn) {
                case 1: kq_tq_tile8(S, 1, w, c, nsb, Bg, Sg, Ag, acc); break;
                case 2: kq_tq_tile8(S, 2, w, c, nsb, Bg, Sg, Ag, acc); break;
                case 3: kq_tq_tile8(S, 3, w, c, nsb, Bg, Sg, Ag, acc); break;
                default: kq_tq_tile8(S, 4, w, c, nsb, Bg, Sg, Ag, acc); break;
                }
                /* acc[i] lane n = row r + i, token 8g + n: token rows through a transpose */
                __m256 out[8];
                for (size_t i = rn; i < 8; i++) acc[i] = _mm256_setzero_ps();
                transpose8(acc, out);
                const __m256i mask = lane_mask((long)rn);
                const size_t tn = T - 8 * g < 8 ? T - 8 * g : 8;
                for (size_t n = 0; n < tn; n++) _mm256_maskstore_ps(Y + (8 * g + n) * ldy + r, mask, out[n]);
            }
        }
    }
    cism_scratch_put(mem);
}

static void gemm_q4k_q8_avx2(const cism_mat *W, size_t r0, size_t r1, const cism_act *A, size_t T, float *Y,
                             size_t ldy) {
    if (T >= TQ_MIN_TOKENS) gemm_kq8_tq_tpl(CISM_Q4K, W, r0, r1, A, T, Y, ldy);
    else gemm_kq8_tpl(CISM_Q4K, W, r0, r1, A, T, Y, ldy);
}
static void gemm_q6k_q8_avx2(const cism_mat *W, size_t r0, size_t r1, const cism_act *A, size_t T, float *Y,
                             size_t ldy) {
    if (T >= TQ_MIN_TOKENS) gemm_kq8_tq_tpl(CISM_Q6K, W, r0, r1, A, T, Y, ldy);
    else gemm_kq8_tpl(CISM_Q6K, W, r0, r1, A, T, Y, ldy);
}

void cism_fill_gemm_q8_avx2(cism_kernels *k) {
    fill_e4m3_half();
    k->gemm_int8_q8 = gemm_int8_q8_avx2;
    k->gemm_int4_q8 = gemm_int4_q8_avx2;
    k->gemm_fp4_q8 = gemm_fp4_q8_avx2;
    k->gemm_q4k_q8 = gemm_q4k_q8_avx2;
    k->gemm_q6k_q8 = gemm_q6k_q8_avx2;
    k->name_gemm_q = "avx2";
}
