/* AVX2 (+FMA, F16C) gemm with fp32 activations. Bit-identical to gemm_ref.c.
 *
 * The canonical dot has 16 lanes and a ymm holds 8, so every (row, token) dot
 * keeps TWO accumulators, lo = lanes 0-7 and hi = lanes 8-15: lane i of the
 * pair sums exactly what lane i of the avx512 zmm sums, in the same order, and
 * hsum2() is cism_reduce16 (lo + hi, the xmm halves, movehl, the last pair).
 *
 * Tails without mask registers: fp32 activations are read with
 * _mm256_maskload_ps (masked lanes are +0 and touch no memory); weights may be
 * read past the row into the next row or the CISM_SLACK bytes, and the tail
 * lanes of the dequantized weights are set to -0 with the same mask, so not
 * even an fp16 infinity in the next row can make a NaN, and the product -0
 * leaves a lane that underflowed to -0 as it is (see past_end_neg0).
 *
 * Tiling (16 ymm registers; an R rows x TT tokens tile holds 2*R*TT
 * accumulators). Decode (T = 1) runs R independent weight streams: 6 rows for
 * fp32/fp16/int8 weights, 4 where the dequantization needs more registers,
 * spread over the caller's rows (j, j + L, ...) as in gemm_avx512.c.
 * Multi-token calls run 3x2 tiles (fp32/fp16/int8 weights: each
 * activation vector feeds 3 rows) or 2x3 tiles (4-bit weights: each
 * dequantized vector feeds 3 tokens) over chunks of TOKEN_CHUNK tokens that stay in L2; measured on a 512x4096
 * matrix, T = 64, one core: 3x2 gives fp16 22 GMAC/s against 17 for 2x3,
 * 2x3 gives fp4 16 against 13.
 *
 * GCC 12 note: _mm256_broadcast_ss(ptr) acts as a memory clobber for the
 * accumulator arrays (they were stored to the stack on every iteration), so
 * scalars are broadcast with _mm256_set1_ps(*ptr), which compiles to the same
 * vbroadcastss from memory. */
#include "scratch.h"
#include "simd_avx2.h"

#include <math.h>
#include <stdlib.h>

#define DECODE_ROWS 6     /* T = 1, fp32/fp16/int8 weights x fp32 activations */
#define DECODE_ROWS_NIB 4 /* T = 1, int4/fp4 weights x fp32 activations */
#define MAX_R 6           /* array bounds only: loops run to the compile-time R and TT */
#define MAX_T 3
#define DEQ_ROWS 3       /* rows per dequantized buffer: the fp32 tile's */
#define DEQ_MIN_TOKENS 3 /* more tokens than this dequantize once per chunk */
_Static_assert(DECODE_ROWS <= MAX_R && DECODE_ROWS_NIB <= MAX_R, "tile rows");

/* cism_reduce16 of the lanes lo (0-7) and hi (8-15). */
ALWAYS_INLINE float hsum2(__m256 lo, __m256 hi) {
    const __m256 s8 = _mm256_add_ps(lo, hi);
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

/* Weights of the lanes outside `mask` replaced by -0. Those lanes meet +0
 * activations (maskload), and the product -0 leaves every accumulator as it
 * is, -0 included: a lane CAN hold -0 (fma(w, x, +0) rounds a tiny negative
 * w*x to -0) and the reference never touches lanes past the end, whereas a +0
 * product would turn that -0 into +0. */
ALWAYS_INLINE __m256 past_end_neg0(__m256 w, __m256i mask) {
    const __m256 m = _mm256_castsi256_ps(mask);
    return _mm256_or_ps(_mm256_and_ps(w, m), _mm256_andnot_ps(m, _mm256_set1_ps(-0.0f)));
}

/* ---- fp32 activations: weights dequantized to floats, 16 (fp32/fp16/int8)
 * or 32 (int4/fp4) elements at a time ---- */

/* fp32, fp16, int8 rows: elements 16c..16c+7 (lo) and 16c+8..16c+15 (hi) as floats. */
ALWAYS_INLINE void deq16(const int S, const uint8_t *p, __m256 *lo, __m256 *hi, size_t c) {
    switch (S) {
    case CISM_FP32:
        *lo = _mm256_loadu_ps((const float *)p + 16 * c);
        *hi = _mm256_loadu_ps((const float *)p + 16 * c + 8);
        break;
    case CISM_FP16:
        *lo = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 32 * c)));
        *hi = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 32 * c + 16)));
        break;
    default: /* CISM_INT8 */
        *lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 16 * c))));
        *hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 16 * c + 8))));
        break;
    }
}

/* 4-bit rows go 32 elements (16 code bytes) at a time: w[0..3] = elements
 * 0-7, 8-15, 16-23, 24-31 (lanes lo, hi, lo, hi). The scales sit inside the
 * row at scale_offset, so one pointer per row suffices. */

/* int4 block b: w = (float)(code - 8) * scale, literally the reference.
 * (fma(code, scale, -8 * scale) rounds the same and saves the subtraction,
 * but gives +0 for code 8 where 0.0f * scale is -0 for a negative scale,
 * which shows once a lane has underflowed to -0.) */
ALWAYS_INLINE void int4_block32(const uint8_t *p, size_t so, size_t b, __m256 w[4]) {
    const __m256 s = _mm256_set1_ps(cism_int4_scale(p, so, b));
    const __m256i m15 = _mm256_set1_epi32(15), eight = _mm256_set1_epi32(8);
    const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 16 * b)));
    const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 16 * b + 8)));
    w[0] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(b0, m15), eight)), s);
    w[1] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(b1, m15), eight)), s);
    w[2] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(b0, 4), eight)), s);
    w[3] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(b1, 4), eight)), s);
}

/* fp4 blocks 2u and 2u+1: value * (e4m3 * 0.5) is exact. The odd block may
 * lie past the row (codes and scale byte from the next row or the slack);
 * its lanes are masked or meet zero activations, and e4m3_half maps the two
 * NaN codes to 0. */
ALWAYS_INLINE void fp4_unit32(const uint8_t *p, size_t so, size_t u, __m256 w[4]) {
    __m128i v0, v1;
    fp4_values(p + 16 * u, &v0, &v1);
    const __m256 s0 = _mm256_set1_ps(e4m3_half[p[so + 2 * u]]);
    const __m256 s1 = _mm256_set1_ps(e4m3_half[p[so + 2 * u + 1]]);
    w[0] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v0)), s0);
    w[1] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(v0, v0))), s0);
    w[2] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v1)), s1);
    w[3] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(v1, v1))), s1);
}

ALWAYS_INLINE void deq32(const int S, const uint8_t *p, size_t so, size_t u, __m256 w[4]) {
    if (S == CISM_INT4) int4_block32(p, so, u, w);
    else fp4_unit32(p, so, u, w);
}

/* ---- ggml K-quants (q4_k, q6_k): fp32 activations over the decoded
 * weights (formats.h, csrc/ggml.h's bits), 32 elements (one Q4_K
 * sub-block, one Q6_K run) at a time ---- */

/* The per-super-block factors of the decode, exact products as in ggml.h:
 * q4_k sm[j] = d * sc_j, sm[8 + j] = dmin * m_j; q6_k sm[k] = d * scale_k. */
ALWAYS_INLINE void kq_scales(const int S, const uint8_t *blk, float sm[16]) {
    if (S == CISM_Q4K) {
        const __m128i b = q4k_scale_bytes(blk + CISM_Q4_K_SCALES);
        int32_t dd;
        memcpy(&dd, blk + CISM_Q4_K_D, 4); /* d, dmin */
        const __m128 d2 = _mm_cvtph_ps(_mm_cvtsi32_si128(dd));
        const __m256 d = _mm256_set1_ps(_mm_cvtss_f32(d2)), dmin = _mm256_set1_ps(_mm_cvtss_f32(_mm_movehdup_ps(d2)));
        _mm256_storeu_ps(sm, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)), d));
        _mm256_storeu_ps(sm + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8))), dmin));
    } else {
        uint16_t h;
        memcpy(&h, blk + CISM_Q6_K_D, 2);
        const __m256 d = _mm256_set1_ps(_cvtsh_ss(h));
        const __m128i b = _mm_loadu_si128((const __m128i *)(blk + CISM_Q6_K_SCALES));
        _mm256_storeu_ps(sm, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), d));
        _mm256_storeu_ps(sm + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8))), d));
    }
}

/* Elements 32j .. 32j + 31 of a super-block as floats, w[c] = elements
 * 32j + 8c .. + 7. q4_k: fma(dl, q, -ml) = dl * q - ml (dl * q is exact:
 * one rounding, as in the decoder); q6_k: (float)(code - 32) * dl, exact. */
ALWAYS_INLINE void kq_sub32(const int S, const uint8_t *blk, const float sm[16], int j, __m256 w[4]) {
    if (S == CISM_Q4K) {
        const __m256 dl = _mm256_set1_ps(sm[j]), ml = _mm256_set1_ps(sm[8 + j]);
        const uint8_t *qs = blk + CISM_Q4_K_QS + 32 * (j / 2);
        for (int c = 0; c < 4; c++) {
            const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qs + 8 * c)));
            const __m256i q = j % 2 ? _mm256_srli_epi32(b, 4) : _mm256_and_si256(b, _mm256_set1_epi32(15));
            w[c] = _mm256_fmsub_ps(dl, _mm256_cvtepi32_ps(q), ml);
        }
        return;
    }
    const __m256i code = _mm256_sub_epi8(kq_codes32(S, blk, j), _mm256_set1_epi8(32)); /* code - 32 */
    const __m128i c0 = _mm256_castsi256_si128(code), c1 = _mm256_extracti128_si256(code, 1);
    const __m128i part[4] = {c0, _mm_srli_si128(c0, 8), c1, _mm_srli_si128(c1, 8)};
    for (int c = 0; c < 4; c++)
        w[c] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(part[c])), _mm256_set1_ps(sm[2 * j + c / 2]));
}

/* An R x TT tile of dots: rows r, r + rs, ..., tokens of X (row stride ldx). */
ALWAYS_INLINE void tile_f32(const int S, const int R, const int TT, const cism_mat *W, size_t r, size_t rs,
                            const float *X, size_t ldx, float *Y, size_t ldy) {
    const size_t n = W->cols, so = W->scale_offset;
    const uint8_t *p[MAX_R];
    __m256 lo[MAX_R][MAX_T], hi[MAX_R][MAX_T];
    for (int i = 0; i < R; i++) {
        p[i] = (const uint8_t *)W->codes + (r + i * rs) * W->row_bytes;
        for (int j = 0; j < TT; j++) lo[i][j] = hi[i][j] = _mm256_setzero_ps();
    }
    if (S == CISM_Q4K || S == CISM_Q6K) {
        /* whole super-blocks (cols is a multiple of 256); the rows take
         * turns every 32 elements, so that their fma chains overlap */
        for (size_t sb = 0; sb < n / CISM_QK_K; sb++) {
            float sm[MAX_R][16];
            for (int i = 0; i < R; i++) {
                kq_prefetch(S, p[i] + sb * kq_block_bytes(S));
                kq_scales(S, p[i] + sb * kq_block_bytes(S), sm[i]);
            }
            /* the factors are broadcast from memory (a load each), not
             * from the registers GCC still holds them in (a shuffle each) */
            __asm__ __volatile__("" : : "r"(sm) : "memory");
            for (int q = 0; q < 8; q++)
#pragma GCC unroll 6
                for (int i = 0; i < R; i++) {
                    __m256 w[4];
                    kq_sub32(S, p[i] + sb * kq_block_bytes(S), sm[i], q, w);
                    for (int j = 0; j < TT; j++) {
                        const float *x = X + j * ldx + CISM_QK_K * sb + 32 * q;
                        lo[i][j] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(x), lo[i][j]);
                        hi[i][j] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(x + 8), hi[i][j]);
                        lo[i][j] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(x + 16), lo[i][j]);
                        hi[i][j] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(x + 24), hi[i][j]);
                    }
                }
        }
    } else if (S == CISM_INT4 || S == CISM_FP4) {
        const size_t units = n / 32;
        for (size_t b = 0; b < units; b++) {
            for (int i = 0; i < R; i++) {
                __m256 w[4];
                deq32(S, p[i], so, b, w);
                for (int j = 0; j < TT; j++) {
                    const float *x = X + j * ldx + 32 * b;
                    lo[i][j] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(x), lo[i][j]);
                    hi[i][j] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(x + 8), hi[i][j]);
                    lo[i][j] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(x + 16), lo[i][j]);
                    hi[i][j] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(x + 24), hi[i][j]);
                }
            }
        }
        if (n % 32) {
            const long left = (long)(n % 32);
            __m256i m[4];
            for (int k = 0; k < 4; k++) m[k] = lane_mask(left - 8 * k);
            __m256 x[MAX_T][4];
            for (int j = 0; j < TT; j++)
                for (int k = 0; k < 4; k++) x[j][k] = _mm256_maskload_ps(X + j * ldx + 32 * units + 8 * k, m[k]);
            for (int i = 0; i < R; i++) {
                __m256 w[4];
                deq32(S, p[i], so, units, w);
                for (int k = 0; k < 4; k++) w[k] = past_end_neg0(w[k], m[k]);
                for (int j = 0; j < TT; j++) {
                    lo[i][j] = _mm256_fmadd_ps(w[0], x[j][0], lo[i][j]);
                    hi[i][j] = _mm256_fmadd_ps(w[1], x[j][1], hi[i][j]);
                    lo[i][j] = _mm256_fmadd_ps(w[2], x[j][2], lo[i][j]);
                    hi[i][j] = _mm256_fmadd_ps(w[3], x[j][3], hi[i][j]);
                }
            }
        }
    } else {
        const size_t full = n / 16, rem = n % 16;
        for (size_t c = 0; c < full; c++) {
            for (int i = 0; i < R; i++) {
                __m256 wl, wh;
                deq16(S, p[i], &wl, &wh, c);
                for (int j = 0; j < TT; j++) {
                    const float *x = X + j * ldx + 16 * c;
                    lo[i][j] = _mm256_fmadd_ps(wl, _mm256_loadu_ps(x), lo[i][j]);
                    hi[i][j] = _mm256_fmadd_ps(wh, _mm256_loadu_ps(x + 8), hi[i][j]);
                }
            }
        }
        if (rem) {
            const __m256i ml = lane_mask((long)rem), mh = lane_mask((long)rem - 8);
            __m256 xl[MAX_T], xh[MAX_T];
            for (int j = 0; j < TT; j++) {
                xl[j] = _mm256_maskload_ps(X + j * ldx + 16 * full, ml);
                xh[j] = _mm256_maskload_ps(X + j * ldx + 16 * full + 8, mh);
            }
            for (int i = 0; i < R; i++) {
                __m256 wl, wh;
                deq16(S, p[i], &wl, &wh, full);
                wl = past_end_neg0(wl, ml);
                wh = past_end_neg0(wh, mh);
                for (int j = 0; j < TT; j++) {
                    lo[i][j] = _mm256_fmadd_ps(wl, xl[j], lo[i][j]);
                    hi[i][j] = _mm256_fmadd_ps(wh, xh[j], hi[i][j]);
                }
            }
        }
    }
    for (int i = 0; i < R; i++) {
        const float scale = S == CISM_INT8 ? W->scales[r + i * rs] : 1.0f;
        for (int j = 0; j < TT; j++) {
            const float d = hsum2(lo[i][j], hi[i][j]);
            Y[j * ldy + r + i * rs] = S == CISM_INT8 ? d * scale : d;
        }
    }
}

/* 4-bit rows r..r+R-1 as floats at out (row stride ld, a multiple of
 * 32): exactly the weights the tiles multiply. Elements past the end hold
 * whatever the unpacking gives (finite: e4m3_half maps the NaN codes to
 * 0); the fp32 tile replaces them with -0. */
ALWAYS_INLINE void dequant_rows(const int S, const int R, const cism_mat *W, size_t r, float *out, size_t ld) {
    const size_t n = W->cols, so = W->scale_offset;
    for (int i = 0; i < R; i++) {
        const uint8_t *p = (const uint8_t *)W->codes + (r + i) * W->row_bytes;
        float *o = out + i * ld;
        if (S == CISM_Q4K || S == CISM_Q6K) {
            for (size_t sb = 0; sb < n / CISM_QK_K; sb++) {
                const uint8_t *blk = p + sb * kq_block_bytes(S);
                float sm[16];
                kq_scales(S, blk, sm);
                for (int q = 0; q < 8; q++) {
                    __m256 w[4];
                    kq_sub32(S, blk, sm, q, w);
                    for (int c = 0; c < 4; c++) _mm256_store_ps(o + CISM_QK_K * sb + 32 * q + 8 * c, w[c]);
                }
            }
            continue;
        }
        for (size_t u = 0; 32 * u < n; u++) {
            __m256 w[4];
            deq32(S, p, so, u, w);
            for (int k = 0; k < 4; k++) _mm256_store_ps(o + 32 * u + 8 * k, w[k]);
        }
    }
}

ALWAYS_INLINE void rows_f32(const int S, const int R, const int TT, const cism_mat *W, size_t r,
                            const float *X, size_t ldx, size_t T, float *Y, size_t ldy) {
    size_t t = 0;
    for (; t + TT <= T; t += TT) tile_f32(S, R, TT, W, r, 1, X + t * ldx, ldx, Y + t * ldy, ldy);
    if (TT > 2 && t + 2 <= T) {
        tile_f32(S, R, 2, W, r, 1, X + t * ldx, ldx, Y + t * ldy, ldy);
        t += 2;
    }
    if (t < T) tile_f32(S, R, 1, W, r, 1, X + t * ldx, ldx, Y + t * ldy, ldy);
}

ALWAYS_INLINE void gemm_f32_tpl(const int S, const cism_mat *W, size_t r0, size_t r1,
                                const cism_act *A, size_t T, float *Y, size_t ldy) {
    const int nib = S == CISM_INT4 || S == CISM_FP4 || S == CISM_Q4K || S == CISM_Q6K;
    if (T == 1) {
        /* R streams spread over the rows (see gemm_avx512.c) */
        const int R = nib ? DECODE_ROWS_NIB : DECODE_ROWS;
        const size_t L = (r1 - r0) / R;
        for (size_t j = 0; j < L; j++) tile_f32(S, R, 1, W, r0 + j, L, A->x, A->ldx, Y, ldy);
        for (size_t r = r0 + R * L; r < r1; r++) tile_f32(S, 1, 1, W, r, 1, A->x, A->ldx, Y, ldy);
        return;
    }
    /* fp4 rows for more than DEQ_MIN_TOKENS tokens are dequantized once per
     * token chunk into a buffer of DEQ_ROWS rows and the fp32 tile runs over
     * it: the unpacking (a table lookup, two widenings and a multiply per 8
     * elements) is shared by the whole chunk instead of by the 3 tokens of
     * a tile. The floats are the very weights the direct tile would use, so
     * every dot is unchanged. Measured on Zen 3 (576 x 1536, 64 tokens, one
     * core, alternating builds): fp4 26-30 -> 33-36 GFLOP/s; int4, fp16 and
     * int8 through the buffer ran no faster than directly (the fp32 tile
     * over it is the limit, 38-48), so they keep the direct tiles: 4-bit
     * weights with more tokens per dequantized vector, others with more
     * rows per activation vector. Without the buffer (no memory) fp4 takes
     * the direct tiles too. */
    const size_t ld = cism_div_up(W->cols, 32) * 32;
    /* (q4_k and q6_k: their unpacking costs more than fp4's, so they take
     * the buffer too) */
    const int via_buf = S == CISM_FP4 || S == CISM_Q4K || S == CISM_Q6K;
    float *buf = via_buf && T > DEQ_MIN_TOKENS ? cism_scratch_get(DEQ_ROWS * ld * sizeof(float)) : NULL;
    const int R = nib ? 2 : 3, TT = nib ? 3 : 2;
    for (size_t t0 = 0; t0 < T; t0 += TOKEN_CHUNK) {
        const size_t tn = T - t0 < TOKEN_CHUNK ? T - t0 : TOKEN_CHUNK;
        const float *X = A->x + t0 * A->ldx;
        float *Yc = Y + t0 * ldy;
        size_t r = r0;
        if (buf && tn > DEQ_MIN_TOKENS) {
            for (; r < r1; r += DEQ_ROWS) {
                const size_t rn = r1 - r < DEQ_ROWS ? r1 - r : DEQ_ROWS;
                const cism_mat F = {CISM_FP32, rn, W->cols, buf, ld * sizeof(float), 0, NULL};
                dequant_rows(S, (int)rn, W, r, buf, ld);
                if (rn == DEQ_ROWS) rows_f32(CISM_FP32, DEQ_ROWS, 2, &F, 0, X, A->ldx, tn, Yc + r, ldy);
                else
                    for (size_t i = 0; i < rn; i++) rows_f32(CISM_FP32, 1, 2, &F, i, X, A->ldx, tn, Yc + r, ldy);
            }
            continue;
        }
        for (; r + R <= r1; r += R) rows_f32(S, R, TT, W, r, X, A->ldx, tn, Yc, ldy);
        for (; r < r1; r++) rows_f32(S, 1, TT, W, r, X, A->ldx, tn, Yc, ldy);
    }
    cism_scratch_put(buf);
}

#define GEMM_F32(NAME, S)                                                                        \
    static void NAME(const cism_mat *W, size_t r0, size_t r1, const cism_act *A, size_t T,       \
                     float *Y, size_t ldy) {                                                     \
        gemm_f32_tpl(S, W, r0, r1, A, T, Y, ldy);                                                \
    }
GEMM_F32(gemm_fp32_avx2, CISM_FP32)
GEMM_F32(gemm_fp16_avx2, CISM_FP16)
GEMM_F32(gemm_int8_avx2, CISM_INT8)
GEMM_F32(gemm_int4_avx2, CISM_INT4)
GEMM_F32(gemm_fp4_avx2, CISM_FP4)
GEMM_F32(gemm_q4k_avx2, CISM_Q4K)
GEMM_F32(gemm_q6k_avx2, CISM_Q6K)

void cism_fill_gemm_avx2(cism_kernels *k) {
    fill_e4m3_half();
    k->gemm[CISM_FP32] = gemm_fp32_avx2;
    k->gemm[CISM_FP16] = gemm_fp16_avx2;
    k->gemm[CISM_INT8] = gemm_int8_avx2;
    k->gemm[CISM_INT4] = gemm_int4_avx2;
    k->gemm[CISM_FP4] = gemm_fp4_avx2;
    k->gemm[CISM_Q4K] = gemm_q4k_avx2;
    k->gemm[CISM_Q6K] = gemm_q6k_avx2;
    k->name_gemm = "avx2";
}
