/* AVX-512 (F/BW/VL/DQ) gemm family. Bit-identical to gemm_ref.c: every
 * (row, token) dot keeps one zmm accumulator whose lane i sums the elements
 * i mod 16 in order with fma, then the canonical reduction tree.
 *
 * Tiling: decode (T = 1) runs 8 rows at a time (4 for 4-bit weights), i.e.
 * 8 independent weight streams per thread, which is what it takes to
 * saturate DRAM from two cores. The 8 rows are spread over the caller's
 * range (rows j, j + L, ..., j + 7L for L = range / 8), not adjacent: rows
 * of a small int8 matrix are 576 bytes, so 8 adjacent rows sit in one or two
 * pages and the prefetchers see one stream; spread, they see 8. That took
 * SmolLM2 int8 decode from 67 to 87 tok/s and fp16 from 39 to 64.
 *
 * Multi-token calls run 6 rows x 4 tokens tiles (4 x 4 for rows shorter
 * than 256 elements; rows longer than 1024 go by in column blocks, see
 * rows6_kblocked) over token chunks small enough for the activations to
 * stay in L2, fp32 tiles prefetching their next rows (or column block) a
 * slice per 4 tokens; each group of 4 rows reduces its dots together
 * (hsum_tile4).
 * Packed rows (fp16, int8, int4, fp4) are first dequantized into aligned
 * scratch (csrc/scratch.h) once per chunk (rows_deq), so the unpacking is
 * shared by up to 64 tokens and the fp32 tile does the rest.
 *
 * Integer weights x q8 activations are the exception to the 16-lane form
 * (kernels.h): one chain per dot over exact integer block sums; their tiles
 * (8 rows for decode, 4 x 4 for several tokens) finish the block sums of 8
 * dots in one reduction (block_sums8, block_sums4x4) and keep 8 dots'
 * chains in one ymm. 4-bit decode goes two 64-element units per step, the
 * low and high nibbles of one 64-byte load into the same lanes
 * (decode_nq8): half the unpacking and reductions of one unit a step. */
#include "../kernels.h"
#include "../scratch.h"

#include <immintrin.h>
#include <stdlib.h>

#define ALWAYS_INLINE static inline __attribute__((always_inline))
#define TOKEN_CHUNK 64

/* e4m3(b) * 0.5, exact. Each translation unit that includes this file
 * (avx512, avx512vnni, amx) has its own copy, filled by its table filler. */
static float e4m3_half[256];

static void fill_e4m3_half(void) {
    for (int b = 0; b < 256; b++) e4m3_half[b] = cism_e4m3_to_f32((uint8_t)b) * 0.5f;
    e4m3_half[0x7f] = e4m3_half[0xff] = 0.0f; /* NaN codes are never packed */
}

ALWAYS_INLINE float hsum(__m512 v) {
    const __m256 lo = _mm512_castps512_ps256(v);
    const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    const __m256 s8 = _mm256_add_ps(lo, hi);
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

/* The canonical reductions of up to 4 x 4 dot accumulators at once:
 * element 4j + i of the result is hsum(acc[i][j]) (row i, token j), i.e.
 * block j holds token j's 4 rows. Each level adds the same pairs as hsum
 * (lanes i and i + 8, then i and i + 4 within each half, then i and i + 2,
 * then the last two), only 16 dots at a time: 15 additions and 30 shuffles
 * instead of 64 and 64. Missing rows (R < 4) and tokens (TT < 4) read as
 * zero and are not stored by the caller. */
ALWAYS_INLINE __m512 hsum_tile4(const __m512 (*acc)[4], const int R, const int TT) {
    __m512 a[16], b[8], c[4], d[2];
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 4; j++) a[4 * i + j] = i < R && j < TT ? acc[i][j] : _mm512_setzero_ps();
    /* b[m] = [s8(a[2m]) | s8(a[2m + 1])] */
    for (int m = 0; m < 8; m++)
        b[m] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * m], a[2 * m + 1], 0x44),
                             _mm512_shuffle_f32x4(a[2 * m], a[2 * m + 1], 0xee));
    /* c[p], 128-bit block k = s4(a[4p + k]) */
    for (int p = 0; p < 4; p++)
        c[p] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * p], b[2 * p + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * p], b[2 * p + 1], 0xdd));
    /* d[q], block k = [s2(a[8q + k]), s2(a[8q + 4 + k])] */
    for (int q = 0; q < 2; q++)
        d[q] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * q], c[2 * q + 1], 0x44),
                             _mm512_shuffle_ps(c[2 * q], c[2 * q + 1], 0xee));
    /* block k = [sum(a[k]), sum(a[4 + k]), sum(a[8 + k]), sum(a[12 + k])] */
    return _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xdd));
}

/* Store the dots of up to 4 adjacent rows (r..r+R-1) for TT tokens, times
 * the int8 row scales when `scales` is given (the same product as the
 * one-dot path). */
ALWAYS_INLINE void store_tile4(const __m512 (*acc)[4], const int R, const int TT, const float *scales,
                               size_t r, float *Y, size_t ldy) {
    const __mmask8 m = (__mmask8)((1u << R) - 1);
    __m512 v = hsum_tile4(acc, R, TT);
    if (scales) v = _mm512_mul_ps(v, _mm512_broadcast_f32x4(_mm_maskz_loadu_ps(m, scales + r)));
    _mm_mask_storeu_ps(Y + r, m, _mm512_castps512_ps128(v));
    if (TT > 1) _mm_mask_storeu_ps(Y + ldy + r, m, _mm512_extractf32x4_ps(v, 1));
    if (TT > 2) _mm_mask_storeu_ps(Y + 2 * ldy + r, m, _mm512_extractf32x4_ps(v, 2));
    if (TT > 3) _mm_mask_storeu_ps(Y + 3 * ldy + r, m, _mm512_extractf32x4_ps(v, 3));
}

/* Store an R-row tile (rows r..r+R-1 adjacent), 4 rows at a time. (No
 * loop: with R a constant each call is resolved at compile time and the
 * accumulators stay in registers.) */
ALWAYS_INLINE void store_tile(const __m512 acc[8][4], const int R, const int TT, const float *scales,
                              size_t r, float *Y, size_t ldy) {
    store_tile4(acc, R < 4 ? R : 4, TT, scales, r, Y, ldy);
    if (R > 4) store_tile4(acc + 4, R - 4, TT, scales, r + 4, Y, ldy);
}

/* ---- fp32 activations: weights dequantized 16 elements at a time ---- */

/* One pointer per row: int4/fp4 scales sit inside the row at scale_offset
 * (keeping 8 rows in flight without running out of general registers). */
typedef struct {
    const uint8_t *codes;
} row_ptr;

ALWAYS_INLINE row_ptr row_at(const int S, const cism_mat *W, size_t r) {
    (void)S;
    row_ptr p;
    p.codes = (const uint8_t *)W->codes + r * W->row_bytes;
    return p;
}

ALWAYS_INLINE float int4_scale(row_ptr p, size_t so, size_t b) {
    return ((const float *)(p.codes + so))[b];
}

/* 16 weights of chunk c (elements 16c..16c+15) as floats; lanes outside
 * `mask` are zero or finite garbage, always met by a zero activation.
 * (int4 goes through int4_block32 instead.) */
ALWAYS_INLINE __m512 deq16(const int S, row_ptr p, size_t so, size_t c, __mmask16 mask) {
    switch (S) {
    case CISM_FP32:
        return _mm512_maskz_loadu_ps(mask, (const float *)p.codes + 16 * c);
    case CISM_FP16:
        return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, (const uint16_t *)p.codes + 16 * c));
    case CISM_INT8:
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, p.codes + 16 * c)));
    default: { /* CISM_FP4: 8 bytes, low nibble = even element */
        /* the block's 16 possible values e2m1x2[code] * (e4m3 * 0.5) (exact
         * products, as in the reference), looked up with vpermps, which reads
         * only the low 4 bits of each index: byte j/2 shifted by 4*(j%2) */
        const __m512 table = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                               _mm_loadu_si128((const __m128i *)cism_e2m1_x2))),
                                           _mm512_set1_ps(e4m3_half[p.codes[so + c]]));
        const __m128i dup = _mm_shuffle_epi8(_mm_loadl_epi64((const __m128i *)(p.codes + 8 * c)),
                                             _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7));
        const __m512i idx = _mm512_srlv_epi32(_mm512_cvtepu8_epi32(dup),
                                              _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4));
        return _mm512_permutexvar_ps(idx, table);
    }
    }
}

/* Both halves of int4 block b: w = (float)(code - 8) * scale, one rounding,
 * exactly the reference (an fma(code, scale, -8*scale) rounds the same
 * value but gives +0 where the reference gives -0 for code 8). */
ALWAYS_INLINE void int4_block32(row_ptr p, size_t so, size_t b, __m512 *w0, __m512 *w1) {
    /* the block's 16 possible weights (code - 8) * scale, each rounded once as
     * in the reference, then looked up with vpermps (it reads only the low 4
     * bits of each index, so the low nibble needs no mask) */
    const __m512 codes = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    const __m512 table = _mm512_mul_ps(codes, _mm512_set1_ps(int4_scale(p, so, b)));
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p.codes + 16 * b)));
    *w0 = _mm512_permutexvar_ps(bytes, table);
    *w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
}

/* ---- ggml K-quants (q4_k, q6_k), fp32 activations: the decoded weights
 * (formats.h, csrc/ggml.h's bits) met by the canonical dot, a 64-element
 * part of a super-block at a time ---- */

/* Bytes [sc_0..sc_7, m_0..m_7] of a Q4_K super-block's 12 packed 6-bit
 * scales and mins at s (cism_ggml_scale_min_k4 for all j at once: j < 4
 * the low six bits of bytes j and j + 4; j >= 4 the nibbles of byte j + 4
 * under the top two bits of bytes j - 4 and j). Reads 16 bytes (the block
 * goes on past them). */
ALWAYS_INLINE __m128i q4k_scale_bytes(const uint8_t *s) {
    const __m128i x = _mm_loadu_si128((const __m128i *)s);
    /* p: [s0-3, s8-11, s4-7, s8-11]; q: the bytes whose top bits go on top */
    const __m128i p = _mm_shuffle_epi8(x, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
    const __m128i q = _mm_shuffle_epi8(x, _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7));
    const __m128i low = _mm_and_si128(p, _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0));
    const __m128i high_nib = _mm_and_si128(_mm_srli_epi16(p, 4), _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15));
    const __m128i top = _mm_srli_epi16(_mm_and_si128(q, _mm_set1_epi8((char)0xc0)), 2);
    return _mm_or_si128(_mm_or_si128(low, high_nib), top);
}

/* The per-super-block factors of the decode, exact products as in ggml.h:
 * q4_k sm[j] = d * sc_j, sm[8 + j] = dmin * m_j; q6_k sm[k] = d * scale_k. */
ALWAYS_INLINE void kq_scales(const int S, const uint8_t *blk, float sm[16]) {
    if (S == CISM_Q4K) {
        const __m512 sc_m = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q4k_scale_bytes(blk + CISM_Q4_K_SCALES)));
        int32_t dd;
        memcpy(&dd, blk + CISM_Q4_K_D, 4); /* d, dmin */
        const __m512 d = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
                                               _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi32_si128(dd))));
        _mm512_storeu_ps(sm, _mm512_mul_ps(sc_m, d));
    } else {
        uint16_t h;
        memcpy(&h, blk + CISM_Q6_K_D, 2);
        const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + CISM_Q6_K_SCALES))));
        _mm512_storeu_ps(sm, _mm512_mul_ps(sc, _mm512_set1_ps(_cvtsh_ss(h))));
    }
}

/* The 64 codes (0..63) of Q6_K runs 2k and 2k + 1, element order: the
 * low (k even) or high nibbles of ql[64h ...], h = k / 2, under bit pairs
 * (0, 1) or (2, 3) of qh[32h ...], brought to bits 4-5 of the two halves
 * from [qh | qh >> 2] (16-bit shifts: the mask drops what crosses from the
 * neighbouring byte). */
ALWAYS_INLINE __m512i q6k_codes64(const uint8_t *blk, int k) {
    const int h = k / 2;
    const __m512i m4 = _mm512_set1_epi8(15), m30 = _mm512_set1_epi8(0x30);
    const __m512i ql = _mm512_loadu_si512((const void *)(blk + CISM_Q6_K_QL + 64 * h));
    const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + CISM_Q6_K_QH + 32 * h));
    const __m512i hh = _mm512_inserti64x4(_mm512_castsi256_si512(qh), _mm256_srli_epi16(qh, 2), 1);
    if (k % 2 == 0) return _mm512_or_si512(_mm512_and_si512(ql, m4), _mm512_and_si512(_mm512_slli_epi16(hh, 4), m30));
    return _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), m4), _mm512_and_si512(hh, m30));
}

/* Elements 64k .. 64k + 63 of a super-block as floats, w[c] = elements
 * 64k + 16c .. +15. q4_k: sub-blocks 2k (low nibbles of qs[32k ...]) and
 * 2k + 1 (high), each the 16 values fma(dl, q, -ml) = dl * q - ml (dl * q
 * is exact, so one rounding as in the decoder) looked up with vpermps
 * (which reads an index's low 4 bits only). q6_k: runs 2k, 2k + 1
 * (q6k_codes64), (float)(code - 32) * dl exactly. */
ALWAYS_INLINE void kq_part(const int S, const uint8_t *blk, const float sm[16], int k, __m512 w[4]) {
    if (S == CISM_Q4K) {
        const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const __m512 t0 = _mm512_fmsub_ps(_mm512_set1_ps(sm[2 * k]), iota, _mm512_set1_ps(sm[8 + 2 * k]));
        const __m512 t1 = _mm512_fmsub_ps(_mm512_set1_ps(sm[2 * k + 1]), iota, _mm512_set1_ps(sm[9 + 2 * k]));
        const uint8_t *qs = blk + CISM_Q4_K_QS + 32 * k;
        const __m512i i0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)qs));
        const __m512i i1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qs + 16)));
        w[0] = _mm512_permutexvar_ps(i0, t0);
        w[1] = _mm512_permutexvar_ps(i1, t0);
        w[2] = _mm512_permutexvar_ps(_mm512_srli_epi32(i0, 4), t1);
        w[3] = _mm512_permutexvar_ps(_mm512_srli_epi32(i1, 4), t1);
        return;
    }
    const __m512i code = _mm512_sub_epi8(q6k_codes64(blk, k), _mm512_set1_epi8(32)); /* code - 32 */
    w[0] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_castsi512_si128(code))), _mm512_set1_ps(sm[4 * k]));
    w[1] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(code, 1))), _mm512_set1_ps(sm[4 * k + 1]));
    w[2] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(code, 2))), _mm512_set1_ps(sm[4 * k + 2]));
    w[3] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(code, 3))), _mm512_set1_ps(sm[4 * k + 3]));
}

ALWAYS_INLINE size_t kq_block_bytes(const int S) { return S == CISM_Q4K ? CISM_Q4_K_BYTES : CISM_Q6_K_BYTES; }

/* Decode asks for the super-block KQ_PF ahead of blk (prefetches past the
 * matrix are harmless): the rows' unpacking is slow enough that the
 * hardware prefetchers fall behind (one thread, DRAM: q6_k x fp32 6.0 ->
 * 7.5 GB/s, q4_k x int8 17 -> 20.5, q6_k x int8 14 -> 17.4). */
#define KQ_PF 4
ALWAYS_INLINE void kq_prefetch(const int S, const uint8_t *blk) {
    for (size_t o = 0; o < kq_block_bytes(S); o += 64)
        _mm_prefetch((const char *)blk + KQ_PF * kq_block_bytes(S) + o, _MM_HINT_T0);
}

/* An R x TT tile of dots: rows r, r + rs, ..., r + (R-1) rs, tokens of X
 * (row stride ldx). */
ALWAYS_INLINE void tile_f32(const int S, const int R, const int TT, const cism_mat *W, size_t r,
                            size_t rs, const float *X, size_t ldx, float *Y, size_t ldy) {
    const size_t n = W->cols, full = n / 16, rem = n % 16, so = W->scale_offset;
    row_ptr p[8];
    __m512 acc[8][4];
    for (int i = 0; i < R; i++) {
        p[i] = row_at(S, W, r + i * rs);
        for (int j = 0; j < TT; j++) acc[i][j] = _mm512_setzero_ps();
    }
    if (S == CISM_Q4K || S == CISM_Q6K) {
        /* whole super-blocks (cols is a multiple of 256); the rows take
         * turns every 64 elements, so that their fma chains overlap */
        for (size_t sb = 0; sb < n / CISM_QK_K; sb++) {
            __attribute__((aligned(64))) float sm[8][16];
            for (int i = 0; i < R; i++) {
                kq_prefetch(S, p[i].codes + sb * kq_block_bytes(S));
                kq_scales(S, p[i].codes + sb * kq_block_bytes(S), sm[i]);
            }
            /* the factors are broadcast from memory (a load each), not
             * from the registers GCC still holds them in (a shuffle each,
             * and the lookups are shuffles already) */
            __asm__ __volatile__("" : : "r"(sm) : "memory");
            /* (fully unrolled, or the accumulators live in memory) */
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++)
#pragma GCC unroll 8
                for (int i = 0; i < R; i++) {
                    __m512 w[4];
                    kq_part(S, p[i].codes + sb * kq_block_bytes(S), sm[i], k, w);
                    for (int j = 0; j < TT; j++) {
                        const float *x = X + j * ldx + CISM_QK_K * sb + 64 * k;
                        for (int c = 0; c < 4; c++) acc[i][j] = _mm512_fmadd_ps(w[c], _mm512_loadu_ps(x + 16 * c), acc[i][j]);
                    }
                }
        }
    } else if (S == CISM_INT4) {
        /* whole 32-element blocks: one byte load feeds both halves */
        const size_t blocks = n / 32;
        for (size_t b = 0; b < blocks; b++) {
            __m512 x0[4], x1[4];
            for (int j = 0; j < TT; j++) {
                x0[j] = _mm512_loadu_ps(X + j * ldx + 32 * b);
                x1[j] = _mm512_loadu_ps(X + j * ldx + 32 * b + 16);
            }
            for (int i = 0; i < R; i++) {
                __m512 w0, w1;
                int4_block32(p[i], so, b, &w0, &w1);
                for (int j = 0; j < TT; j++) {
                    acc[i][j] = _mm512_fmadd_ps(w0, x0[j], acc[i][j]);
                    acc[i][j] = _mm512_fmadd_ps(w1, x1[j], acc[i][j]);
                }
            }
        }
        if (n % 32) {
            const size_t left = n % 32;
            const __mmask16 m0 = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1);
            const __mmask16 m1 = left > 16 ? (__mmask16)((1u << (left - 16)) - 1) : 0;
            __m512 x0[4], x1[4];
            for (int j = 0; j < TT; j++) {
                x0[j] = _mm512_maskz_loadu_ps(m0, X + j * ldx + 32 * blocks);
                x1[j] = _mm512_maskz_loadu_ps(m1, X + j * ldx + 32 * blocks + 16);
            }
            for (int i = 0; i < R; i++) {
                __m512 w0, w1;
                int4_block32(p[i], so, blocks, &w0, &w1);
                /* lanes past the end must stay untouched: a lane may hold -0 */
                for (int j = 0; j < TT; j++) {
                    acc[i][j] = _mm512_mask3_fmadd_ps(w0, x0[j], acc[i][j], m0);
                    if (m1) acc[i][j] = _mm512_mask3_fmadd_ps(w1, x1[j], acc[i][j], m1);
                }
            }
        }
    } else {
    for (size_t c = 0; c < full; c++) {
        __m512 x[4];
        for (int j = 0; j < TT; j++) x[j] = _mm512_loadu_ps(X + j * ldx + 16 * c);
        for (int i = 0; i < R; i++) {
            const __m512 w = deq16(S, p[i], so, c, 0xffff);
            for (int j = 0; j < TT; j++) acc[i][j] = _mm512_fmadd_ps(w, x[j], acc[i][j]);
        }
    }
    if (rem) {
        const __mmask16 m = (__mmask16)((1u << rem) - 1);
        __m512 x[4];
        for (int j = 0; j < TT; j++) x[j] = _mm512_maskz_loadu_ps(m, X + j * ldx + 16 * full);
        /* lanes past the end must stay untouched: a lane may hold -0 */
        for (int i = 0; i < R; i++) {
            const __m512 w = deq16(S, p[i], so, full, m);
            for (int j = 0; j < TT; j++) acc[i][j] = _mm512_mask3_fmadd_ps(w, x[j], acc[i][j], m);
        }
    }
    }
    /* int8 rows: the row scale after the dot; fp32 rows carry scales only
     * when they are int8 codes dequantized by rows_deq */
    const float *scales = S == CISM_INT8 || S == CISM_FP32 ? W->scales : NULL;
    if (rs == 1 && R > 1) {
        store_tile(acc, R, TT, scales, r, Y, ldy);
        return;
    }
    for (int i = 0; i < R; i++) {
        const size_t row = r + i * rs;
        for (int j = 0; j < TT; j++) {
            const float d = hsum(acc[i][j]);
            Y[j * ldy + row] = scales ? d * scales[row] : d;
        }
    }
}

/* The fp32 tiles' prefetch into L2 of the weights they meet next: the
 * first `bytes` of each of `rows` rows (`stride` apart) go by in slices of
 * pf_slice(bytes, T) bytes, one per 4 tokens; pf_part fetches slice k. */
ALWAYS_INLINE size_t pf_slice(size_t bytes, size_t T) { return cism_div_up(bytes, 64 * cism_div_up(T, 4)) * 64; }
ALWAYS_INLINE void pf_part(const char *next, int rows, size_t stride, size_t bytes, size_t slice, size_t k) {
    for (size_t o = k * slice; o < (k + 1) * slice && o < bytes; o += 64)
        for (int i = 0; i < rows; i++) _mm_prefetch(next + i * stride + o, _MM_HINT_T1);
}

ALWAYS_INLINE void rows_f32(const int S, const int R, const cism_mat *W, size_t r, const float *X,
                            size_t ldx, size_t T, float *Y, size_t ldy) {
    size_t t = 0;
    /* fp32 rows: while these rows meet the chunk's tokens, fetch the next
     * R rows into L2, a slice of each row per 4 tokens (a row of 1024
     * floats is a page of its own, where the L2 streamer starts cold).
     * Qwen3-0.6B's 3072 x 1024 and 2048 x 1024, 512 tokens, one thread,
     * in one binary: 10-35% more FMAs per tick. */
    const size_t rb = W->row_bytes, slice = pf_slice(rb, T);
    const char *next = S == CISM_FP32 && r + 2 * R <= W->rows ? (const char *)W->codes + (r + R) * rb : NULL;
    for (; t + 4 <= T; t += 4) {
        if (next) pf_part(next, R, rb, rb, slice, t / 4);
        tile_f32(S, R, 4, W, r, 1, X + t * ldx, ldx, Y + t * ldy, ldy);
    }
    switch (T - t) {
    case 3: tile_f32(S, R, 3, W, r, 1, X + t * ldx, ldx, Y + t * ldy, ldy); break;
    case 2: tile_f32(S, R, 2, W, r, 1, X + t * ldx, ldx, Y + t * ldy, ldy); break;
    case 1: tile_f32(S, R, 1, W, r, 1, X + t * ldx, ldx, Y + t * ldy, ldy); break;
    default: break;
    }
}

/* Rows r..r+R-1 as floats, exactly the weights the tiles multiply (int8:
 * the codes, the row scale comes after the dot). Elements past the end
 * are not written: the fp32 tile reads them masked. */
ALWAYS_INLINE void dequant_rows(const int S, const int R, const cism_mat *W, size_t r, float *out) {
    const size_t n = W->cols, so = W->scale_offset;
    for (int i = 0; i < R; i++) {
        const row_ptr p = row_at(S, W, r + i);
        float *o = out + i * n;
        if (S == CISM_Q4K || S == CISM_Q6K) {
            for (size_t sb = 0; sb < n / CISM_QK_K; sb++) {
                const uint8_t *blk = p.codes + sb * kq_block_bytes(S);
                __attribute__((aligned(64))) float sm[16];
                kq_scales(S, blk, sm);
                for (int k = 0; k < 4; k++) {
                    __m512 w[4];
                    kq_part(S, blk, sm, k, w);
                    for (int c = 0; c < 4; c++) _mm512_storeu_ps(o + CISM_QK_K * sb + 64 * k + 16 * c, w[c]);
                }
            }
        } else if (S == CISM_INT4) {
            for (size_t b = 0; 32 * b < n; b++) {
                __m512 w0, w1;
                int4_block32(p, so, b, &w0, &w1);
                const size_t left = n - 32 * b;
                _mm512_mask_storeu_ps(o + 32 * b, left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1), w0);
                if (left > 16)
                    _mm512_mask_storeu_ps(o + 32 * b + 16,
                                          left >= 32 ? 0xffff : (__mmask16)((1u << (left - 16)) - 1), w1);
            }
        } else {
            for (size_t c = 0; 16 * c < n; c++) {
                const size_t left = n - 16 * c;
                const __mmask16 m = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1);
                _mm512_mask_storeu_ps(o + 16 * c, m, deq16(S, p, so, c, m));
            }
        }
    }
}

/* The prefill tile is 6 rows x 4 tokens: 24 accumulators + 4 token vectors
 * + 1 weight vector of the 32 zmm registers. Each step loads 4 token
 * vectors (the chunk's activations, streamed from L2) and 6 weight vectors
 * (rows that stay in L1 for all the chunk's tokens) for 24 fmas: 10.7 bytes
 * from L2 per fma against 16 for a 4 x 4 tile. It needs the 6 rows and the
 * 4 token rows passing by to fit L1 (48 KiB here), so rows wider than
 * TILE6_MAX_COLS go by in column blocks (rows6_kblocked). Short rows
 * (attention keys, 64-128 wide) keep the 4 x 4 tile: there the
 * reductions weigh as much as the fmas. */
#define TILE6_MIN_COLS 256
#define TILE6_MAX_COLS 1024

/* 6 x 4 tiles over rows wider than TILE6_MAX_COLS: the columns go by in
 * blocks of KB_CHUNKS x 16, and between blocks each tile keeps its 24
 * accumulators in memory (a zmm stored and reloaded is the same 16 floats,
 * so every lane's fma chain is unchanged), so the 6 rows' block stays in L1
 * for all the chunk's tokens. */
#define KB_CHUNKS 32
ALWAYS_INLINE void tile6_part(const int TT, const float *w, size_t ldw, const float *X, size_t ldx,
                              size_t c0, size_t c1, __mmask16 tail, __m512 *keep, const int first,
                              const int last, const float *scales, size_t r, float *Y, size_t ldy) {
    __m512 acc[8][4];
    for (int i = 0; i < 6; i++)
        for (int j = 0; j < TT; j++) acc[i][j] = first ? _mm512_setzero_ps() : keep[4 * i + j];
    for (size_t c = c0; c < c1; c++) {
        __m512 x[4];
        for (int j = 0; j < TT; j++) x[j] = _mm512_loadu_ps(X + j * ldx + 16 * c);
        for (int i = 0; i < 6; i++) {
            const __m512 wv = _mm512_loadu_ps(w + i * ldw + 16 * c);
            for (int j = 0; j < TT; j++) acc[i][j] = _mm512_fmadd_ps(wv, x[j], acc[i][j]);
        }
    }
    if (tail) { /* lanes past the end must stay untouched: a lane may hold -0 */
        __m512 x[4];
        for (int j = 0; j < TT; j++) x[j] = _mm512_maskz_loadu_ps(tail, X + j * ldx + 16 * c1);
        for (int i = 0; i < 6; i++) {
            const __m512 wv = _mm512_maskz_loadu_ps(tail, w + i * ldw + 16 * c1);
            for (int j = 0; j < TT; j++) acc[i][j] = _mm512_mask3_fmadd_ps(wv, x[j], acc[i][j], tail);
        }
    }
    if (last) {
        store_tile(acc, 6, TT, scales, r, Y, ldy);
        return;
    }
    for (int i = 0; i < 6; i++)
        for (int j = 0; j < TT; j++) keep[4 * i + j] = acc[i][j];
}

/* Scratch of one multi-token call (the thread's kept heap buffer,
 * csrc/scratch.h): rows dequantized for the tile and the column-blocked
 * tiles' accumulators (up to 120 KiB, too much for the stack of a small
 * thread, e.g. musl's 128 KiB default). */
typedef struct {
    float *rows;         /* 6 x cols floats, 64-byte aligned */
    __m512 (*keep)[24];  /* TOKEN_CHUNK / 4 tiles x 24 accumulators */
} tile_scratch;

/* Rows r..r+5 of an fp32 matrix (or the dequantized buffer) for T <=
 * TOKEN_CHUNK tokens. */
static void rows6_kblocked(const cism_mat *W, size_t r, const float *X, size_t ldx, size_t T,
                           float *Y, size_t ldy, __m512 (*keep)[24]) {
    const size_t n = W->cols, full = n / 16, rem = n % 16, ldw = W->row_bytes / sizeof(float);
    const float *w = (const float *)W->codes + r * ldw;
    const size_t blocks = cism_div_up(full, KB_CHUNKS); /* full > 0: wider than TILE6_MAX_COLS */
    const size_t cb = KB_CHUNKS * 64, slice = pf_slice(cb, T);
    const int pf = W->rows > 6; /* not the 6 dequantized rows of rows_deq */
    for (size_t b = 0; b < blocks; b++) {
        const size_t c0 = b * KB_CHUNKS, c1 = c0 + KB_CHUNKS < full ? c0 + KB_CHUNKS : full;
        const int first = b == 0, last = b + 1 == blocks;
        const __mmask16 tail = last && rem ? (__mmask16)((1u << rem) - 1) : 0;
        /* the next column block of these rows, or the next rows' first,
         * into L2, a slice per 4 tokens (1024 x 3072 and 1024 x 2048: 3-5%) */
        const char *next = !pf ? NULL
                           : !last ? (const char *)(w + 16 * c1)
                           : r + 12 <= W->rows ? (const char *)(w + 6 * ldw) : NULL;
        size_t t = 0, k = 0;
        for (; t + 4 <= T; t += 4, k++) {
            if (next) pf_part(next, 6, W->row_bytes, cb, slice, k);
            tile6_part(4, w, ldw, X + t * ldx, ldx, c0, c1, tail, keep[k], first, last, W->scales, r,
                       Y + t * ldy, ldy);
        }
        switch (T - t) {
        case 3: tile6_part(3, w, ldw, X + t * ldx, ldx, c0, c1, tail, keep[k], first, last, W->scales, r, Y + t * ldy, ldy); break;
        case 2: tile6_part(2, w, ldw, X + t * ldx, ldx, c0, c1, tail, keep[k], first, last, W->scales, r, Y + t * ldy, ldy); break;
        case 1: tile6_part(1, w, ldw, X + t * ldx, ldx, c0, c1, tail, keep[k], first, last, W->scales, r, Y + t * ldy, ldy); break;
        default: break;
        }
    }
}

/* Prefill rows r..r+R-1 of a packed (not fp32) matrix: they are
 * dequantized once per token chunk into the scratch rows and the fp32 tile
 * runs over it, so the unpacking is shared by up to TOKEN_CHUNK tokens.
 * The floats are the very weights the direct tile would use, so every dot
 * is unchanged. Rows longer than DEQ_MAX_COLS take the direct tile. */
#define DEQ_MAX_COLS 4096
ALWAYS_INLINE void rows_deq(const int S, const int R, const cism_mat *W, size_t r, const float *X,
                            size_t ldx, size_t T, float *Y, size_t ldy, const tile_scratch *sc) {
    dequant_rows(S, R, W, r, sc->rows);
    const cism_mat F = {CISM_FP32, (size_t)R, W->cols, sc->rows, W->cols * sizeof(float), 0,
                        S == CISM_INT8 ? W->scales + r : NULL};
    if (R == 6 && W->cols > TILE6_MAX_COLS) rows6_kblocked(&F, 0, X, ldx, T, Y + r, ldy, sc->keep);
    else rows_f32(CISM_FP32, R, &F, 0, X, ldx, T, Y + r, ldy);
}

/* Rows r..r+R-1 (R <= 6) for tn tokens: through the buffer (DEQ) or
 * directly. */
ALWAYS_INLINE void rows_tiled(const int S, const int DEQ, const int R, const cism_mat *W, size_t r,
                              const float *X, size_t ldx, size_t tn, float *Y, size_t ldy,
                              const tile_scratch *sc) {
    if (DEQ) rows_deq(S, R, W, r, X, ldx, tn, Y, ldy, sc);
    else if (S == CISM_FP32 && R == 6 && W->cols > TILE6_MAX_COLS)
        rows6_kblocked(W, r, X, ldx, tn, Y, ldy, sc->keep);
    else rows_f32(S, R, W, r, X, ldx, tn, Y, ldy);
}

/* Rows r0..r1: 6-row tiles (when SIX), then 4-row tiles, then one tile of
 * the last 1-3 rows. */
ALWAYS_INLINE void rows_range(const int S, const int DEQ, const int SIX, const cism_mat *W, size_t r0,
                              size_t r1, const float *X, size_t ldx, size_t tn, float *Y, size_t ldy,
                              const tile_scratch *sc) {
    size_t r = r0;
    if (SIX)
        for (; r + 6 <= r1; r += 6) rows_tiled(S, DEQ, 6, W, r, X, ldx, tn, Y, ldy, sc);
    for (; r + 4 <= r1; r += 4) rows_tiled(S, DEQ, 4, W, r, X, ldx, tn, Y, ldy, sc);
    switch (r1 - r) {
    case 3: rows_tiled(S, DEQ, 3, W, r, X, ldx, tn, Y, ldy, sc); break;
    case 2: rows_tiled(S, DEQ, 2, W, r, X, ldx, tn, Y, ldy, sc); break;
    case 1: rows_tiled(S, DEQ, 1, W, r, X, ldx, tn, Y, ldy, sc); break;
    default: break;
    }
}

ALWAYS_INLINE void gemm_f32_tpl(const int S, const cism_mat *W, size_t r0, size_t r1,
                                const cism_act *A, size_t T, float *Y, size_t ldy) {
    if (T == 1) {
        /* 4-bit rows: 8 rows of dequantization would spill vector registers */
        const int R = S == CISM_FP32 || S == CISM_FP16 || S == CISM_INT8 || S == CISM_Q4K || S == CISM_Q6K ? 8 : 4;
        const size_t L = (r1 - r0) / R;
        for (size_t j = 0; j < L; j++) tile_f32(S, R, 1, W, r0 + j, L, A->x, A->ldx, Y, ldy);
        for (size_t r = r0 + R * L; r < r1; r++) tile_f32(S, 1, 1, W, r, 1, A->x, A->ldx, Y, ldy);
        return;
    }
    /* scratch for the dequantized rows (packed rows, more than 4 tokens)
     * and for column-blocked tiles (rows past TILE6_MAX_COLS); if it cannot
     * be had, the direct tiles do the work (4 x 4 past TILE6_MAX_COLS) */
    const int deq = S != CISM_FP32 && T > 4 && W->cols <= DEQ_MAX_COLS;
    const int kb = W->cols > TILE6_MAX_COLS && (S == CISM_FP32 || deq);
    tile_scratch sc = {NULL, NULL};
    void *mem = NULL;
    if (deq || kb) {
        const size_t rows_bytes = deq ? cism_div_up(6 * W->cols * sizeof(float), 64) * 64 : 0;
        mem = cism_scratch_get(rows_bytes + (kb ? sizeof(__m512) * 24 * (TOKEN_CHUNK / 4) : 0));
        if (mem) {
            sc.rows = deq ? (float *)mem : NULL;
            sc.keep = kb ? (__m512(*)[24])((char *)mem + rows_bytes) : NULL;
        }
    }
    const int six = W->cols >= TILE6_MIN_COLS && (W->cols <= TILE6_MAX_COLS || sc.keep);
    for (size_t t0 = 0; t0 < T; t0 += TOKEN_CHUNK) {
        const size_t tn = T - t0 < TOKEN_CHUNK ? T - t0 : TOKEN_CHUNK;
        const float *X = A->x + t0 * A->ldx;
        float *Yc = Y + t0 * ldy;
        if (S == CISM_FP32) {
            if (six) rows_range(S, 0, 1, W, r0, r1, X, A->ldx, tn, Yc, ldy, &sc);
            else rows_range(S, 0, 0, W, r0, r1, X, A->ldx, tn, Yc, ldy, &sc);
        } else if (tn > 4 && sc.rows) {
            if (six) rows_range(S, 1, 1, W, r0, r1, X, A->ldx, tn, Yc, ldy, &sc);
            else rows_range(S, 1, 0, W, r0, r1, X, A->ldx, tn, Yc, ldy, &sc);
        } else { /* few tokens, very long rows or no scratch: packed rows read directly */
            size_t r = r0;
            for (; r + 4 <= r1; r += 4) rows_f32(S, 4, W, r, X, A->ldx, tn, Yc, ldy);
            for (; r < r1; r++) rows_f32(S, 1, W, r, X, A->ldx, tn, Yc, ldy);
        }
    }
    cism_scratch_put(mem);
}

#define GEMM_F32(NAME, S)                                                                        \
    static void NAME(const cism_mat *W, size_t r0, size_t r1, const cism_act *A, size_t T,       \
                     float *Y, size_t ldy) {                                                     \
        gemm_f32_tpl(S, W, r0, r1, A, T, Y, ldy);                                                \
    }
GEMM_F32(gemm_fp32_avx512, CISM_FP32)
GEMM_F32(gemm_fp16_avx512, CISM_FP16)
GEMM_F32(gemm_int8_avx512, CISM_INT8)
GEMM_F32(gemm_int4_avx512, CISM_INT4)
GEMM_F32(gemm_fp4_avx512, CISM_FP4)
GEMM_F32(gemm_q4k_avx512, CISM_Q4K)
GEMM_F32(gemm_q6k_avx512, CISM_Q6K)

/* ---- quantized activations ---- */

/* int8 x q8, one 64-byte unit = blocks 2u (lanes 0-7) and 2u+1 (lanes 8-15):
 * each lane first holds the exact integer sum of four products (without
 * VNNI; tile_i8q8 uses vpdpbusd directly where it has it). |a| * (sign(a) w)
 * keeps every pair sum within int16 (|a|, |w| <= 127), so maddubs never
 * saturates and gives the integers vpdpbusd gives. */
ALWAYS_INLINE __m512i dot4_u8s8(__m512i a_abs, __m512i w_signed) {
    return _mm512_madd_epi16(_mm512_maddubs_epi16(a_abs, w_signed), _mm512_set1_epi16(1));
}

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
ALWAYS_INLINE void tile_i8q8(const int VNNI, const int R, const int TT, const cism_mat *W, size_t r, size_t rs,
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
#ifdef __AVX512VNNI__
        if (VNNI) {
            /* vpdpbusd multiplies unsigned by signed bytes: the weights go in
             * as w + 128 (w ^ 0x80) and each sum starts from -128 * (the
             * activations' group sum), so it ends at exactly sum(w * a) */
            const __m512i bias = _mm512_set1_epi8((char)0x80);
            __m512i a[4], start[4];
            for (int j = 0; j < TT; j++) {
                a[j] = _mm512_loadu_si512((const void *)(A->q8 + (t + j) * A->ldq + 64 * u));
                start[j] = _mm512_sub_epi32(_mm512_setzero_si512(),
                                            _mm512_dpbusd_epi32(_mm512_setzero_si512(), bias, a[j]));
            }
            for (int i = 0; i < R; i++) {
                const __m512i w = _mm512_xor_si512(_mm512_loadu_si512((const void *)(rows[i] + 64 * u)), bias);
                for (int j = 0; j < TT; j++) v[i * TT + j] = _mm512_dpbusd_epi32(start[j], w, a[j]);
            }
        } else
#endif
        {
            __m512i aa[4];
            __mmask64 neg[4];
            for (int j = 0; j < TT; j++) {
                const __m512i a = _mm512_loadu_si512((const void *)(A->q8 + (t + j) * A->ldq + 64 * u));
                aa[j] = _mm512_abs_epi8(a);
                neg[j] = _mm512_movepi8_mask(a);
            }
            for (int i = 0; i < R; i++) {
                const __m512i w = _mm512_loadu_si512((const void *)(rows[i] + 64 * u));
                for (int j = 0; j < TT; j++)
                    v[i * TT + j] = dot4_u8s8(aa[j], _mm512_mask_sub_epi8(w, neg[j], _mm512_setzero_si512(), w));
            }
        }
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

#ifdef __GFNI__
/* vgf2p8affineqb computes each byte as an 8x8 bit matrix (the qword at the
 * same place, result bit i from the matrix's byte 7 - i) times the byte,
 * plus a constant: these pick a nibble as 0..15 (constant 0), or as the
 * signed byte code - 8 (constant 0xf8: bits 3-7 are the nibble's top bit
 * flipped, bits 0-2 its low bits), in one instruction. */
#define NIB_LO_U 0x0102040800000000LL
#define NIB_HI_U 0x1020408000000000LL
#define NIB_LO_S 0x0102040808080808LL
#define NIB_HI_S 0x1020408080808080LL
#endif

/* Unit u of an int4 row: [block 2u | block 2u + 1], each [elements 0-15 (the
 * low nibbles of its 16 bytes) | 16-31 (the high ones)], as unsigned codes
 * or (SIGNED) as code - 8. */
ALWAYS_INLINE __m512i int4_unit(const int SIGNED, const uint8_t *codes, size_t u) {
    const __m512i x = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(codes + 32 * u)));
    /* qwords [b0, b0, b1, b1], each block's low then high nibbles */
    const __m512i z = _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 1, 0, 1, 2, 3, 2, 3), x);
#ifdef __GFNI__
    if (SIGNED)
        return _mm512_gf2p8affine_epi64_epi8(
            z, _mm512_setr_epi64(NIB_LO_S, NIB_LO_S, NIB_HI_S, NIB_HI_S, NIB_LO_S, NIB_LO_S, NIB_HI_S, NIB_HI_S), 0xf8);
    return _mm512_gf2p8affine_epi64_epi8(
        z, _mm512_setr_epi64(NIB_LO_U, NIB_LO_U, NIB_HI_U, NIB_HI_U, NIB_LO_U, NIB_LO_U, NIB_HI_U, NIB_HI_U), 0);
#else
    const __m512i c = _mm512_and_si512(_mm512_srlv_epi64(z, _mm512_setr_epi64(0, 0, 4, 4, 0, 0, 4, 4)),
                                       _mm512_set1_epi8(15));
    return SIGNED ? _mm512_sub_epi8(c, _mm512_set1_epi8(8)) : c;
#endif
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
#ifdef __AVX512VBMI__
    /* vpermb reads an index's low 6 bits; the table repeats every 16 */
    return _mm512_permutexvar_epi8(shifted, table);
#else
    return _mm512_shuffle_epi8(table, _mm512_and_si512(shifted, _mm512_set1_epi8(15)));
#endif
}

/* Activation unit u of token row a in the weights' byte order. */
ALWAYS_INLINE __m512i nib_act(const int S, const int8_t *a, size_t u) {
    const __m512i v = _mm512_loadu_si512((const void *)(a + 64 * u));
    if (S == CISM_INT4) return v;
    const __m512i even_odd = _mm512_broadcast_i32x4(
        _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15));
    return _mm512_shuffle_epi8(v, even_odd);
}

/* u8 x s8 four-element lane sums added to acc: vpdpbusd, or maddubs + madd
 * (exact here: the unsigned operand is at most 24). */
ALWAYS_INLINE __m512i dot4_acc(const int VNNI, __m512i acc, __m512i w, __m512i a) {
#ifdef __AVX512VNNI__
    if (VNNI) return _mm512_dpbusd_epi32(acc, w, a);
#endif
    (void)VNNI;
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(w, a), _mm512_set1_epi16(1)));
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

ALWAYS_INLINE __m512 join8(__m256 lo, __m256 hi) {
    return _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
}
ALWAYS_INLINE __m256 lo8(__m512 v) { return _mm512_castps512_ps256(v); }
ALWAYS_INLINE __m256 hi8(__m512 v) { return _mm512_extractf32x8_ps(v, 1); }

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
ALWAYS_INLINE void decode_nq8(const int S, const int VNNI, const cism_mat *W, size_t r, size_t rs,
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
        const __m512i start = _mm512_sub_epi32(zero, dot4_acc(VNNI, dot4_acc(VNNI, zero, bias, alo), bias, ahi));
        __m512i v[8];
        for (int i = 0; i < 8; i++) {
            const __m512i x = _mm512_loadu_si512((const void *)(rows[i] + 32 * u));
            __m512i lo, hi;
#ifdef __AVX512VBMI__
            if (S == CISM_FP4) {
                /* vpermb looks at an index's low 6 bits and the table
                 * repeats every 16 entries: no masks */
                lo = _mm512_permutexvar_epi8(x, table);
                hi = _mm512_permutexvar_epi8(_mm512_srli_epi16(x, 4), table);
            } else
#endif
            {
                lo = _mm512_and_si512(x, low4);
#ifdef __GFNI__
                hi = _mm512_gf2p8affine_epi64_epi8(x, _mm512_set1_epi64(NIB_HI_U), 0);
#else
                hi = _mm512_and_si512(_mm512_srli_epi16(x, 4), low4);
#endif
                if (S == CISM_FP4) {
                    lo = _mm512_shuffle_epi8(table, lo);
                    hi = _mm512_shuffle_epi8(table, hi);
                }
            }
            v[i] = dot4_acc(VNNI, dot4_acc(VNNI, start, lo, alo), hi, ahi);
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
ALWAYS_INLINE void tile_nq8(const int S, const int VNNI, const int R, const int TT, const cism_mat *W, size_t r,
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
            start[j] = _mm512_sub_epi32(_mm512_setzero_si512(), dot4_acc(VNNI, _mm512_setzero_si512(), bias, a[j]));
        }
        for (int i = 0; i < R; i++) {
            const __m512i w = nib_unit_u8(S, rows[i], u);
            for (int j = 0; j < TT; j++) v[i * TT + j] = dot4_acc(VNNI, start[j], w, a[j]);
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
                           : S == CISM_INT4 ? int4_scale(row_at(S, W, r + i * rs), so, b)
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
ALWAYS_INLINE void tile_q(const int S, const int VNNI, const int R, const int TT, const cism_mat *W, size_t r,
                          size_t rs, const cism_act *A, size_t t, float *Y, size_t ldy) {
    if (S == CISM_INT8) tile_i8q8(VNNI, R, TT, W, r, rs, A, t, Y, ldy);
    else if (R == 8 && TT == 1) decode_nq8(S, VNNI, W, r, rs, A, Y);
    else tile_nq8(S, VNNI, R, TT, W, r, rs, A, t, Y, ldy);
}

ALWAYS_INLINE void rows_q(const int S, const int VNNI, const int R, const cism_mat *W, size_t r,
                          const cism_act *A, size_t t0, size_t t1, float *Y, size_t ldy) {
    size_t t = t0;
    for (; t + 4 <= t1; t += 4) tile_q(S, VNNI, R, 4, W, r, 1, A, t, Y, ldy);
    switch (t1 - t) {
    case 3: tile_q(S, VNNI, R, 3, W, r, 1, A, t, Y, ldy); break;
    case 2: tile_q(S, VNNI, R, 2, W, r, 1, A, t, Y, ldy); break;
    case 1: tile_q(S, VNNI, R, 1, W, r, 1, A, t, Y, ldy); break;
    default: break;
    }
}

ALWAYS_INLINE void gemm_q_tpl(const int S, const int VNNI, const cism_mat *W, size_t r0, size_t r1,
                              const cism_act *A, size_t T, float *Y, size_t ldy) {
    if (T == 1) { /* 8 streams spread over the rows, as in gemm_f32_tpl */
        const size_t L = (r1 - r0) / 8;
        for (size_t j = 0; j < L; j++) tile_q(S, VNNI, 8, 1, W, r0 + j, L, A, 0, Y, ldy);
        for (size_t r = r0 + 8 * L; r < r1; r++) tile_q(S, VNNI, 1, 1, W, r, 1, A, 0, Y, ldy);
        return;
    }
    for (size_t t0 = 0; t0 < T; t0 += TOKEN_CHUNK) {
        const size_t t1 = T - t0 < TOKEN_CHUNK ? T : t0 + TOKEN_CHUNK;
        size_t r = r0;
        for (; r + 4 <= r1; r += 4) rows_q(S, VNNI, 4, W, r, A, t0, t1, Y, ldy);
        for (; r < r1; r++) rows_q(S, VNNI, 1, W, r, A, t0, t1, Y, ldy);
    }
}

#define GEMM_Q(NAME, S, VNNI)                                                                    \
    static void NAME(const cism_mat *W, size_t r0, size_t r1, const cism_act *A, size_t T,       \
                     float *Y, size_t ldy) {                                                     \
        gemm_q_tpl(S, VNNI, W, r0, r1, A, T, Y, ldy);                                            \
    }
GEMM_Q(gemm_int8_q8_avx512, CISM_INT8, 0)
GEMM_Q(gemm_int4_q8_avx512, CISM_INT4, 0)
GEMM_Q(gemm_fp4_q8_avx512, CISM_FP4, 0)

/* ---- ggml K-quants (q4_k, q6_k) x q8 activations ----
 *
 * The canonical order (kernels.h, gemm_ref.c): a dot's 8 float lanes,
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

ALWAYS_INLINE void kq8_token(const int S, const int VNNI, const cism_act *A, size_t t, size_t sb, kq_tok *k) {
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
        for (int c = 0; c < 4; c++) v[c] = dot4_acc(VNNI, zero, _mm512_set1_epi8(1), k->a[c]);
        const __m512i u = lane_sums16(v);
        k->asum = pair_halves(u, u);
        k->scale = _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(
            _mm256_permutevar8x32_ps(as, _mm256_setr_epi32(Q4K_ORDER)))));
    } else {
        for (int c = 0; c < 4; c++) {
            k->a[c] = x[c];
            k->start[c] = _mm512_sub_epi32(zero, dot4_acc(VNNI, zero, _mm512_set1_epi8(32), x[c]));
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
ALWAYS_INLINE __m512 kq8_fold2(const int S, const int VNNI, const __m512i qa[4], const __m512i qb[4],
                               const kq_scales2 *p, const kq_tok *k, __m512 acc) {
    __m512i va[4], vb[4];
    for (int c = 0; c < 4; c++) {
        const __m512i s0 = S == CISM_Q4K ? _mm512_setzero_si512() : k->start[c];
        va[c] = dot4_acc(VNNI, s0, qa[c], k->a[c]);
        vb[c] = dot4_acc(VNNI, s0, qb[c], k->a[c]);
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
ALWAYS_INLINE void kq8_tile(const int S, const int VNNI, const int R, const int TT, const cism_mat *W, size_t r,
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
        for (int j = 0; j < TT; j++) kq8_token(S, VNNI, A, t + j, sb, &k[j]);
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
            for (int j = 0; j < TT; j++) acc[i][j] = kq8_fold2(S, VNNI, qa, qb, &p, &k[j], acc[i][j]);
        }
    }
    for (int i = 0; i < R; i++)
        for (int j = 0; j < TT; j++)
            Y[(t + j) * ldy + r + i * rs] = kq8_finish(S, i % 2 ? hi8(acc[i / 2][j]) : lo8(acc[i / 2][j]));
}

ALWAYS_INLINE void gemm_kq8_tpl(const int S, const int VNNI, const cism_mat *W, size_t r0, size_t r1,
                                const cism_act *A, size_t T, float *Y, size_t ldy) {
    if (T == 1) { /* 8 streams spread over the rows, as in gemm_f32_tpl */
        const size_t L = (r1 - r0) / 8;
        for (size_t j = 0; j < L; j++) kq8_tile(S, VNNI, 8, 1, W, r0 + j, L, A, 0, Y, ldy);
        size_t r = r0 + 8 * L;
        for (; r + 2 <= r1; r += 2) kq8_tile(S, VNNI, 2, 1, W, r, 1, A, 0, Y, ldy);
        if (r < r1) kq8_tile(S, VNNI, 1, 1, W, r, 1, A, 0, Y, ldy);
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
                case 4: kq8_tile(S, VNNI, 4, 4, W, r, 1, A, t, Y, ldy); break;
                case 3: kq8_tile(S, VNNI, 3, 4, W, r, 1, A, t, Y, ldy); break;
                case 2: kq8_tile(S, VNNI, 2, 4, W, r, 1, A, t, Y, ldy); break;
                default: kq8_tile(S, VNNI, 1, 4, W, r, 1, A, t, Y, ldy); break;
                }
            }
            for (; t < t1; t++) {
                switch (R) {
                case 4: kq8_tile(S, VNNI, 4, 1, W, r, 1, A, t, Y, ldy); break;
                case 3: kq8_tile(S, VNNI, 3, 1, W, r, 1, A, t, Y, ldy); break;
                case 2: kq8_tile(S, VNNI, 2, 1, W, r, 1, A, t, Y, ldy); break;
                default: kq8_tile(S, VNNI, 1, 1, W, r, 1, A, t, Y, ldy); break;
                }
            }
        }
    }
}

#define GEMM_KQ8(NAME, S, VNNI)                                                                  \
    static void NAME(const cism_mat *W, size_t r0, size_t r1, const cism_act *A, size_t T,       \
                     float *Y, size_t ldy) {                                                     \
        gemm_kq8_tpl(S, VNNI, W, r0, r1, A, T, Y, ldy);                                          \
    }
GEMM_KQ8(gemm_q4k_q8_avx512, CISM_Q4K, 0)
GEMM_KQ8(gemm_q6k_q8_avx512, CISM_Q6K, 0)
#ifdef __AVX512VNNI__
/* ---- several tokens x q8 with VNNI: tokens in lanes ----
 *
 * From TQ_MIN_TOKENS tokens on, the q8 activations of each group of 16
 * tokens are transposed once per call (the layout of the AMX B tiles: one
 * zmm holds dword k of a 64-element unit for the 16 tokens) and flipped to
 * unsigned bytes a + 128. Each weight dword (4 signed bytes: the int8 codes
 * as packed, or int4/fp4 rows unpacked to bytes once per pass) is broadcast
 * to vpdpbusd against them, so a lane ends a block holding the block sum of
 * one (row, token) with no horizontal reduction: s_b = sum((a + 128) w) -
 * 128 sum(w), the second sum taken once per row and pass (bytes past the
 * row, met by a = 0, cancel in the difference). The chain then folds with
 * lane = token, as on the tile unit: acc = fma((float)s_b, c_b, acc). The
 * same bits as the reference, without the per-dot reductions and scale
 * gathers of the dots-in-lanes tiles (kept below TQ_MIN_TOKENS, where 16
 * token lanes would go mostly unused). */
#define TQ_MIN_TOKENS 8
#define TQ_PASS 8 /* token groups of 16 per pass over the rows */

/* 16 x 16 dwords: in[i] holds row i; returns the transpose in out[j]. */
ALWAYS_INLINE void transpose16(const __m512i in[16], __m512i out[16]) {
    __m512i a[16], b[16];
    for (int i = 0; i < 16; i += 2) {
        a[i] = _mm512_unpacklo_epi32(in[i], in[i + 1]);
        a[i + 1] = _mm512_unpackhi_epi32(in[i], in[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        b[i] = _mm512_unpacklo_epi64(a[i], a[i + 2]);
        b[i + 1] = _mm512_unpackhi_epi64(a[i], a[i + 2]);
        b[i + 2] = _mm512_unpacklo_epi64(a[i + 1], a[i + 3]);
        b[i + 3] = _mm512_unpackhi_epi64(a[i + 1], a[i + 3]);
    }
    /* b[4q + s] holds, in 128-bit lane L, elements 4L..4L+3 of column
     * group s... of rows 4q..4q+3: gather lanes across q */
    for (int s = 0; s < 4; s++) {
        const __m512i t0 = _mm512_shuffle_i32x4(b[s], b[4 + s], 0x88);
        const __m512i t1 = _mm512_shuffle_i32x4(b[s], b[4 + s], 0xdd);
        const __m512i t2 = _mm512_shuffle_i32x4(b[8 + s], b[12 + s], 0x88);
        const __m512i t3 = _mm512_shuffle_i32x4(b[8 + s], b[12 + s], 0xdd);
        out[s] = _mm512_shuffle_i32x4(t0, t2, 0x88);
        out[8 + s] = _mm512_shuffle_i32x4(t0, t2, 0xdd);
        out[4 + s] = _mm512_shuffle_i32x4(t1, t3, 0x88);
        out[12 + s] = _mm512_shuffle_i32x4(t1, t3, 0xdd);
    }
}


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

/* Tokens t..t+tn-1 (tn <= 16, missing ones zero) transposed: unit u at
 * B + 256 u (int32s), its row k holding dword k of the unit for each token
 * (the layout of an AMX B tile; a 32-element block is 8 such rows, a
 * 16-element one 4); the block scales of block b at S + 16 b. flip: the
 * bytes as unsigned a + 128 (for vpdpbusd), else as they are (TDPBSSD). */
static void pack_q8_group(const cism_act *A, size_t t, size_t tn, size_t units, int32_t *B, float *S, int flip) {
    const __m512i bias = _mm512_set1_epi8(flip ? (char)0x80 : 0);
    for (size_t u = 0; u < units; u++) {
        __m512i in[16], out[16];
        for (size_t n = 0; n < 16; n++)
            in[n] = n < tn ? _mm512_loadu_si512((const void *)(A->q8 + (t + n) * A->ldq + 64 * u))
                           : _mm512_setzero_si512();
        transpose16(in, out); /* out[k] = dword k of the unit, all tokens */
        for (int k = 0; k < 16; k++)
            _mm512_store_si512((void *)(B + 256 * u + 16 * k), _mm512_xor_si512(out[k], bias));
        for (size_t h = 0; h < 2; h++)
            for (size_t n = 0; n < 16; n++)
                S[16 * (2 * u + h) + n] = n < tn ? A->qscale[(t + n) * A->ldqs + 2 * u + h] : 0.0f;
    }
}

/* Rows r..r+rn-1 (rn <= 16) as signed bytes at wb (row stride kp = 64 *
 * units; rows rn..15 zero) and their block scales at cw (row stride ldc). */
ALWAYS_INLINE void nib_unpack16(const int S, const cism_mat *W, size_t r, size_t rn, size_t units,
                                int8_t *wb, float *cw, size_t ldc) {
    const size_t kp = 64 * units, so = W->scale_offset;
    const size_t blocks = cism_div_up(W->cols, S == CISM_INT4 ? 32 : 16);
    for (size_t m = 0; m < 16; m++) {
        int8_t *o = wb + m * kp;
        if (m >= rn) {
            memset(o, 0, kp);
            memset(cw + m * ldc, 0, ldc * sizeof(float));
            continue;
        }
        const uint8_t *row = (const uint8_t *)W->codes + (r + m) * W->row_bytes;
        for (size_t u = 0; u < units; u++) {
            __m512i v;
            if (S == CISM_INT4) {
                v = int4_unit(1, row, u);
            } else {
                /* byte k: elements 2k (low nibble), 2k + 1 (high): interleave */
                const __m256i x = _mm256_loadu_si256((const __m256i *)(row + 32 * u));
                const __m512i table = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)cism_e2m1_x2));
#ifdef __AVX512VBMI__
                /* vpermb reads an index's low 6 bits and the table repeats
                 * every 16: the nibbles need no masks */
                const __m256i lo = x, hi = _mm256_srli_epi16(x, 4);
#else
                const __m256i lo = _mm256_and_si256(x, _mm256_set1_epi8(15));
                const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(x, 4), _mm256_set1_epi8(15));
#endif
                /* [0-15 | 32-47] and [16-31 | 48-63] -> element order */
                const __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_unpacklo_epi8(lo, hi)),
                                                     _mm256_unpackhi_epi8(lo, hi), 1);
                const __m512i nib = _mm512_shuffle_i64x2(z, z, 0xd8);
#ifdef __AVX512VBMI__
                v = _mm512_permutexvar_epi8(nib, table);
#else
                v = _mm512_shuffle_epi8(table, nib);
#endif
            }
            _mm512_store_si512((void *)(o + 64 * u), v);
        }
        /* blocks past the row are never issued; their scales stay 0 */
        for (size_t b = 0; b < ldc; b++)
            cw[m * ldc + b] = b >= blocks ? 0.0f
                              : S == CISM_INT4 ? cism_int4_scale(row, so, b) : e4m3_half[row[so + b]];
    }
}

/* 128 * (the sum of each weight block) of 16 rows of signed weight bytes
 * (w[m], units of 64), at ws + 16 b + m: vpdpbusd with unsigned ones, then
 * the block sums of 8 rows at a time. */
ALWAYS_INLINE void row_sums16(const int S, const int8_t *const w[16], size_t units, int32_t *ws) {
    const __m512i ones = _mm512_set1_epi8(1);
    for (size_t u = 0; u < units; u++)
        for (int h = 0; h < 2; h++) {
            __m512i v[8];
            for (int i = 0; i < 8; i++)
                v[i] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones,
                                           _mm512_loadu_si512((const void *)(w[8 * h + i] + 64 * u)));
            if (S == CISM_FP4) {
                __m512i f01, f23;
                block_sums4x4(v, &f01, &f23);
                f01 = _mm512_slli_epi32(f01, 7);
                f23 = _mm512_slli_epi32(f23, 7);
                int32_t *o = ws + 16 * 4 * u + 8 * h;
                _mm256_storeu_si256((__m256i *)o, _mm512_castsi512_si256(f01));
                _mm256_storeu_si256((__m256i *)(o + 16), _mm512_extracti64x4_epi64(f01, 1));
                _mm256_storeu_si256((__m256i *)(o + 32), _mm512_castsi512_si256(f23));
                _mm256_storeu_si256((__m256i *)(o + 48), _mm512_extracti64x4_epi64(f23, 1));
            } else {
                const __m512i f = _mm512_slli_epi32(block_sums8(v), 7);
                int32_t *o = ws + 16 * 2 * u + 8 * h;
                _mm256_storeu_si256((__m256i *)o, _mm512_castsi512_si256(f));
                _mm256_storeu_si256((__m256i *)(o + 16), _mm512_extracti64x4_epi64(f, 1));
            }
        }
}

/* R rows (w[i]: signed weight bytes; ws: their 128 * block sums at
 * ws + 16 b + i; cw: int4/fp4 block scales at cw[i * ldc + b]) x G groups
 * of 16 tokens (Bg + g * gstride, scales Sg + g * sstride): acc[i][g] lane
 * n = the chain of row i, token 16 g + n, over blocks [0, blocks). */
ALWAYS_INLINE void tq_tile(const int S, const int R, const int G, const int8_t *const *w, const int32_t *ws,
                           const float *cw, size_t ldc, const int32_t *Bg, size_t gstride, const float *Sg,
                           size_t sstride, size_t blocks, __m512 acc[4][2]) {
    const int KD = S == CISM_FP4 ? 4 : 8; /* dwords per block */
    for (int i = 0; i < R; i++)
        for (int g = 0; g < G; g++) acc[i][g] = _mm512_setzero_ps();
    for (size_t b = 0; b < blocks; b++) {
        __m512i ai[4][2];
        for (int i = 0; i < R; i++)
            for (int g = 0; g < G; g++) ai[i][g] = _mm512_set1_epi32(-ws[16 * b + i]);
        for (int k = 0; k < KD; k++) {
            const size_t d = (size_t)KD * b + k; /* dword d of the row: B row d % 16 of unit d / 16 */
            __m512i av[2];
            for (int g = 0; g < G; g++) av[g] = _mm512_load_si512((const void *)(Bg + g * gstride + 16 * d));
            for (int i = 0; i < R; i++) {
                int32_t x;
                memcpy(&x, w[i] + 4 * d, 4);
                const __m512i wb = _mm512_set1_epi32(x);
                for (int g = 0; g < G; g++) ai[i][g] = _mm512_dpbusd_epi32(ai[i][g], av[g], wb);
            }
        }
        for (int g = 0; g < G; g++) {
            const __m512 s = _mm512_load_ps(Sg + g * sstride + 16 * (S == CISM_FP4 ? b / 2 : b));
            for (int i = 0; i < R; i++) {
                const __m512 c = S == CISM_INT8 ? s : _mm512_mul_ps(s, _mm512_set1_ps(cw[i * ldc + b]));
                acc[i][g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ai[i][g]), c, acc[i][g]);
            }
        }
    }
}

ALWAYS_INLINE void gemm_tq8_tpl(const int S, const cism_mat *W, size_t r0, size_t r1, const cism_act *A,
                                size_t T, float *Y, size_t ldy) {
    const size_t KB = S == CISM_FP4 ? 16 : 32;
    const size_t units = cism_div_up(W->cols, 64), blocks = cism_div_up(W->cols, KB), nbk = units * (64 / KB);
    const size_t groups = cism_div_up(T, 16), kp = 64 * units;
    const size_t b_bytes = groups * units * 1024, s_bytes = groups * units * 128;
    const size_t w_bytes = S == CISM_INT8 ? 0 : 16 * kp;
    const size_t ws_bytes = cism_div_up(16 * nbk * sizeof(int32_t), 64) * 64;
    const size_t c_bytes = S == CISM_INT8 ? 0 : cism_div_up(16 * nbk * sizeof(float), 64) * 64;
    if (r1 <= r0) return;
    uint8_t *mem = cism_scratch_get(b_bytes + s_bytes + w_bytes + ws_bytes + c_bytes);
    if (!mem) { /* the dots-in-lanes tiles need no scratch and give the same bits */
        gemm_q_tpl(S, 1, W, r0, r1, A, T, Y, ldy);
        return;
    }
    int32_t *B = (int32_t *)mem;
    float *Sc = (float *)(mem + b_bytes);
    int8_t *wb = (int8_t *)(mem + b_bytes + s_bytes);
    int32_t *ws = (int32_t *)(mem + b_bytes + s_bytes + w_bytes);
    float *cw = (float *)(mem + b_bytes + s_bytes + w_bytes + ws_bytes);
    for (size_t g = 0; g < groups; g++) {
        const size_t tn = T - 16 * g < 16 ? T - 16 * g : 16;
        pack_q8_group(A, 16 * g, tn, units, B + g * units * 256, Sc + g * units * 32, 1);
    }
    for (size_t g0 = 0; g0 < groups; g0 += TQ_PASS)
    for (size_t r = r0; r < r1; r += 16) {
        const size_t g1 = groups - g0 < TQ_PASS ? groups : g0 + TQ_PASS;
        const size_t rn = r1 - r < 16 ? r1 - r : 16;
        const int8_t *w[16];
        if (S == CISM_INT8) {
            /* the packed codes themselves; rows past rn repeat the last one
             * (computed, not stored) */
            for (size_t m = 0; m < 16; m++)
                w[m] = (const int8_t *)W->codes + (r + (m < rn ? m : rn - 1)) * W->row_bytes;
        } else {
            nib_unpack16(S, W, r, rn, units, wb, cw, nbk);
            for (size_t m = 0; m < 16; m++) w[m] = wb + m * kp;
        }
        row_sums16(S, w, units, ws);
        /* the next 16 rows come from memory: fetch them while these are
         * multiplied, a quarter per 4-row tile of the first token groups */
        const uint8_t *next = r + 32 <= r1 ? (const uint8_t *)W->codes + (r + 16) * W->row_bytes : NULL;
        for (size_t g = g0; g < g1; g += 2) {
            const size_t G = g1 - g < 2 ? g1 - g : 2;
            const int32_t *Bg = B + g * units * 256;
            const float *Sg = Sc + g * units * 32;
            /* the 16 rows' results, row-major per group, then written
             * transposed: one 16-row store per token instead of 16 scalar
             * stores a row stride apart (which all meet in few cache sets
             * when the stride is a multiple of 4 KiB) */
            __attribute__((aligned(64))) float buf[2][16][16];
            for (size_t i0 = 0; i0 < rn; i0 += 4) {
                const size_t R = rn - i0 < 4 ? rn - i0 : 4;
                if (next && g == g0)
                    for (size_t o = 0; o < 4 * W->row_bytes; o += 64)
                        _mm_prefetch((const char *)(next + i0 * W->row_bytes + o), _MM_HINT_T0);
                const float *cwi = cw + i0 * nbk;
                __m512 acc[4][2];
                for (int i = 0; i < 4; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps(); /* (for the compiler) */
#define TQ_CASE(RR, GG)                                                                                  \
    tq_tile(S, RR, GG, w + i0, ws + i0, cwi, nbk, Bg, units * 256, Sg, units * 32, blocks, acc)
                switch (4 * (G - 1) + R - 1) {
                case 0: TQ_CASE(1, 1); break;
                case 1: TQ_CASE(2, 1); break;
                case 2: TQ_CASE(3, 1); break;
                case 3: TQ_CASE(4, 1); break;
                case 4: TQ_CASE(1, 2); break;
                case 5: TQ_CASE(2, 2); break;
                case 6: TQ_CASE(3, 2); break;
                default: TQ_CASE(4, 2); break;
                }
#undef TQ_CASE
                for (size_t i = 0; i < R; i++)
                    for (size_t q = 0; q < G; q++)
                        _mm512_store_ps(buf[q][i0 + i], S == CISM_INT8
                                        ? _mm512_mul_ps(acc[i][q], _mm512_set1_ps(W->scales[r + i0 + i]))
                                        : acc[i][q]);
            }
            for (size_t q = 0; q < G; q++) {
                __m512 rowsv[16];
                for (size_t i = 0; i < 16; i++) rowsv[i] = i < rn ? _mm512_load_ps(buf[q][i]) : _mm512_setzero_ps();
                const size_t t0 = 16 * (g + q);
                store_rows16(rowsv, rn, T - t0 < 16 ? T - t0 : 16, Y, ldy, t0, r);
            }
        }
    }
    cism_scratch_put(mem);
}

#define GEMM_Q_VNNI(NAME, S)                                                                     \
    static void NAME(const cism_mat *W, size_t r0, size_t r1, const cism_act *A, size_t T,       \
                     float *Y, size_t ldy) {                                                     \
        if (T >= TQ_MIN_TOKENS) gemm_tq8_tpl(S, W, r0, r1, A, T, Y, ldy);                        \
        else gemm_q_tpl(S, 1, W, r0, r1, A, T, Y, ldy);                                          \
    }
/* Built only in the avx512vnni and amx translation units (gemm_avx512vnni.c
 * and gemm_amx.c include this file). */
GEMM_Q_VNNI(gemm_int8_q8_avx512vnni, CISM_INT8)
GEMM_Q_VNNI(gemm_int4_q8_avx512vnni, CISM_INT4)
GEMM_Q_VNNI(gemm_fp4_q8_avx512vnni, CISM_FP4)

/* ---- ggml K-quants x q8 with VNNI, several tokens: tokens in lanes ----
 *
 * From TQ_MIN_TOKENS tokens on, as for the other integer storages: the
 * token groups' q8 activations are transposed once per call (pack_q8_group,
 * a + 128 as unsigned bytes), each row's codes unpacked once per pass to
 * signed bytes in element order (q4_k: q; q6_k: code - 32), and every
 * weight dword broadcast to vpdpbusd against 16 tokens' dwords, so a lane
 * ends a block (q6_k: a 16-element group) holding one (row, token) integer
 * sum plus 128 times the weights' own sum, which is taken off (it is
 * computed once per row). The canonical lanes (kernels.h) become one
 * vector per (row, sub-block j), 16 tokens wide: lane j's chain over the
 * super-blocks, in order, for j = 0..7 one after the other, then the tree
 * as vertical adds. q4_k's min term takes the activations' block sums,
 * made once per call from the packed bytes (their sum less 128 * 32). */

/* A row's super-blocks unpacked for the token lanes: codes at wb (element
 * order, cols bytes); per super-block s, at meta + 48 s (int32s): 16
 * corrections (q4_k: 128 x the sub-block code sums, then 8 unused; q6_k:
 * 128 x the group sums of code - 32), 16 scales (q4_k: sc, then m; q6_k
 * the int8 scales), d and (q4_k) -dmin as float bits, and 14 unused. */
#define KQ_META 48
ALWAYS_INLINE void kq_unpack_row(const int S, const uint8_t *row, size_t nsb, int8_t *wb, int32_t *meta) {
    const __m512i zero = _mm512_setzero_si512();
    for (size_t sb = 0; sb < nsb; sb++) {
        const uint8_t *blk = row + sb * kq_block_bytes(S);
        int32_t *mt = meta + KQ_META * sb;
        __m512i q[4];
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
        /* code sums per 8 bytes (vpsadbw), then per sub-block or group */
        __attribute__((aligned(64))) int64_t sums[32];
        for (int k = 0; k < 4; k++) _mm512_store_si512((void *)(sums + 8 * k), _mm512_sad_epu8(q[k], zero));
        for (int k = 0; k < 4; k++) {
            const __m512i v = S == CISM_Q4K ? q[k] : _mm512_sub_epi8(q[k], _mm512_set1_epi8(32));
            _mm512_storeu_si512((void *)(wb + CISM_QK_K * sb + 64 * k), v);
        }
        if (S == CISM_Q4K) {
            for (int j = 0; j < 8; j++)
                mt[j] = 128 * (int32_t)(sums[4 * j] + sums[4 * j + 1] + sums[4 * j + 2] + sums[4 * j + 3]);
            _mm512_storeu_si512((void *)(mt + 16), _mm512_cvtepu8_epi32(q4k_scale_bytes(blk + CISM_Q4_K_SCALES)));
            int32_t dd;
            memcpy(&dd, blk + CISM_Q4_K_D, 4);
            /* d and -dmin (dmin * -as = -(dmin * as): the reference's product, negated) */
            _mm_storel_pi((__m64 *)(mt + 32), _mm_xor_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(dd)), _mm_setr_ps(0.0f, -0.0f, 0.0f, 0.0f)));
        } else {
            for (int g = 0; g < 16; g++) mt[g] = 128 * ((int32_t)(sums[2 * g] + sums[2 * g + 1]) - 32 * 16);
            _mm512_storeu_si512((void *)(mt + 16),
                                _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + CISM_Q6_K_SCALES))));
            uint16_t h;
            memcpy(&h, blk + CISM_Q6_K_D, 2);
            const float d = _cvtsh_ss(h);
            memcpy(mt + 32, &d, 4);
        }
    }
}

/* R rows (codes w[i], meta m[i]) x one group of 16 tokens (B: packed
 * activations, Sg: block scales, As: q4_k's activation block sums):
 * out[i] lane n = the dot of row i and token n. */
ALWAYS_INLINE void kq_tq_tile(const int S, const int R, const int8_t *const *w, const int32_t *const *m,
                              size_t nsb, const int32_t *B, const float *Sg, const int32_t *As, __m512 out[4]) {
    __m512 lane[4][8];
    for (int j = 0; j < 8; j++) {
        __m512 acc[4];
        for (int i = 0; i < R; i++) acc[i] = _mm512_setzero_ps();
        for (size_t sb = 0; sb < nsb; sb++) {
            const size_t b = 8 * sb + j; /* the activation block: dwords 8b .. 8b + 7 */
            __m512i bv[8];
            for (int k = 0; k < 8; k++) bv[k] = _mm512_load_si512((const void *)(B + 16 * (8 * b + k)));
            const __m512 as = _mm512_load_ps(Sg + 16 * b);
            for (int i = 0; i < R; i++) {
                const int32_t *mt = m[i] + KQ_META * sb;
                const int32_t *wd = (const int32_t *)(w[i] + 32 * b);
                float d;
                memcpy(&d, mt + 32, 4);
                if (S == CISM_Q4K) {
                    __m512i s0 = _mm512_set1_epi32(-mt[j]);
                    for (int k = 0; k < 8; k++) s0 = _mm512_dpbusd_epi32(s0, bv[k], _mm512_set1_epi32(wd[k]));
                    float ndmin;
                    memcpy(&ndmin, mt + 33, 4);
                    const __m512 f = _mm512_cvtepi32_ps(_mm512_mullo_epi32(s0, _mm512_set1_epi32(mt[16 + j])));
                    const __m512 g = _mm512_cvtepi32_ps(_mm512_mullo_epi32(_mm512_load_si512((const void *)(As + 16 * b)),
                                                                           _mm512_set1_epi32(mt[24 + j])));
                    acc[i] = _mm512_fmadd_ps(f, _mm512_mul_ps(_mm512_set1_ps(d), as), acc[i]);
                    acc[i] = _mm512_fmadd_ps(g, _mm512_mul_ps(_mm512_set1_ps(ndmin), as), acc[i]);
                } else {
                    __m512i s0 = _mm512_set1_epi32(-mt[2 * j]), s1 = _mm512_set1_epi32(-mt[2 * j + 1]);
                    for (int k = 0; k < 4; k++) {
                        s0 = _mm512_dpbusd_epi32(s0, bv[k], _mm512_set1_epi32(wd[k]));
                        s1 = _mm512_dpbusd_epi32(s1, bv[4 + k], _mm512_set1_epi32(wd[4 + k]));
                    }
                    const __m512i isum = _mm512_add_epi32(_mm512_mullo_epi32(s0, _mm512_set1_epi32(mt[16 + 2 * j])),
                                                          _mm512_mullo_epi32(s1, _mm512_set1_epi32(mt[17 + 2 * j])));
                    acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(_mm512_set1_ps(d), as), acc[i]);
                }
            }
        }
        for (int i = 0; i < R; i++) lane[i][j] = acc[i];
    }
    /* cism_reduce8, lane by lane */
    for (int i = 0; i < R; i++) {
        const __m512 *l = lane[i];
        out[i] = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(l[0], l[4]), _mm512_add_ps(l[2], l[6])),
                               _mm512_add_ps(_mm512_add_ps(l[1], l[5]), _mm512_add_ps(l[3], l[7])));
    }
}

ALWAYS_INLINE void gemm_kq8_tq_tpl(const int S, const cism_mat *W, size_t r0, size_t r1, const cism_act *A,
                                   size_t T, float *Y, size_t ldy) {
    const size_t units = W->cols / 64, blocks = W->cols / 32, nsb = W->cols / CISM_QK_K;
    const size_t groups = cism_div_up(T, 16);
    const size_t b_bytes = groups * units * 1024, s_bytes = groups * units * 128;
    const size_t a_bytes = S == CISM_Q4K ? groups * blocks * 64 : 0;
    const size_t w_bytes = 16 * W->cols, m_bytes = 16 * nsb * KQ_META * sizeof(int32_t);
    if (r1 <= r0) return;
    uint8_t *mem = cism_scratch_get(b_bytes + s_bytes + a_bytes + w_bytes + m_bytes);
    if (!mem) { /* the dots-in-lanes tiles need no scratch and give the same bits */
        gemm_kq8_tpl(S, 1, W, r0, r1, A, T, Y, ldy);
        return;
    }
    int32_t *B = (int32_t *)mem;
    float *Sc = (float *)(mem + b_bytes);
    int32_t *As = (int32_t *)(mem + b_bytes + s_bytes);
    int8_t *wb = (int8_t *)(mem + b_bytes + s_bytes + a_bytes);
    int32_t *meta = (int32_t *)(mem + b_bytes + s_bytes + a_bytes + w_bytes);
    for (size_t g = 0; g < groups; g++) {
        const size_t tn = T - 16 * g < 16 ? T - 16 * g : 16;
        int32_t *Bg = B + g * units * 256;
        pack_q8_group(A, 16 * g, tn, units, Bg, Sc + g * units * 32, 1);
        if (S == CISM_Q4K) /* block sums: sum(a + 128) - 128 * 32 */
            for (size_t b = 0; b < blocks; b++) {
                __m512i v = _mm512_set1_epi32(-128 * 32);
                for (int k = 0; k < 8; k++)
                    v = _mm512_dpbusd_epi32(v, _mm512_load_si512((const void *)(Bg + 16 * (8 * b + k))), _mm512_set1_epi8(1));
                _mm512_store_si512((void *)(As + g * blocks * 16 + 16 * b), v);
            }
    }
    for (size_t g0 = 0; g0 < groups; g0 += TQ_PASS)
    for (size_t r = r0; r < r1; r += 16) {
        const size_t g1 = groups - g0 < TQ_PASS ? groups : g0 + TQ_PASS;
        const size_t rn = r1 - r < 16 ? r1 - r : 16;
        const int8_t *w[16];
        const int32_t *mt[16];
        for (size_t i = 0; i < rn; i++) {
            kq_unpack_row(S, (const uint8_t *)W->codes + (r + i) * W->row_bytes, nsb, wb + i * W->cols,
                          meta + i * nsb * KQ_META);
            w[i] = wb + i * W->cols;
            mt[i] = meta + i * nsb * KQ_META;
        }
        for (size_t g = g0; g < g1; g++) {
            const int32_t *Bg = B + g * units * 256;
            const float *Sg = Sc + g * units * 32;
            const int32_t *Ag = As + (S == CISM_Q4K ? g * blocks * 16 : 0);
            __m512 rowsv[16];
            for (size_t i0 = 0; i0 < 16; i0 += 4) {
                if (i0 >= rn) {
                    for (size_t i = 0; i < 4; i++) rowsv[i0 + i] = _mm512_setzero_ps();
                    continue;
                }
                switch (rn - i0 < 4 ? rn - i0 : 4) {
                case 1: kq_tq_tile(S, 1, w + i0, mt + i0, nsb, Bg, Sg, Ag, rowsv + i0); break;
                case 2: kq_tq_tile(S, 2, w + i0, mt + i0, nsb, Bg, Sg, Ag, rowsv + i0); break;
                case 3: kq_tq_tile(S, 3, w + i0, mt + i0, nsb, Bg, Sg, Ag, rowsv + i0); break;
                default: kq_tq_tile(S, 4, w + i0, mt + i0, nsb, Bg, Sg, Ag, rowsv + i0); break;
                }
                for (size_t i = rn - i0; i < 4; i++) rowsv[i0 + i] = _mm512_setzero_ps();
            }
            const size_t t0 = 16 * g;
            store_rows16(rowsv, rn, T - t0 < 16 ? T - t0 : 16, Y, ldy, t0, r);
        }
    }
    cism_scratch_put(mem);
}

#define GEMM_KQ8_VNNI(NAME, S)                                                                   \
    static void NAME(const cism_mat *W, size_t r0, size_t r1, const cism_act *A, size_t T,       \
                     float *Y, size_t ldy) {                                                     \
        if (T >= TQ_MIN_TOKENS) gemm_kq8_tq_tpl(S, W, r0, r1, A, T, Y, ldy);                     \
        else gemm_kq8_tpl(S, 1, W, r0, r1, A, T, Y, ldy);                                        \
    }
GEMM_KQ8_VNNI(gemm_q4k_q8_avx512vnni, CISM_Q4K)
GEMM_KQ8_VNNI(gemm_q6k_q8_avx512vnni, CISM_Q6K)
#endif


/* ---- attention helpers and activation quantization ---- */

static float dot_avx512(const float *a, const float *b, size_t n) {
    __m512 acc = _mm512_setzero_ps();
    size_t i = 0;
    for (; i + 16 <= n; i += 16)
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    if (i < n) {
        const __mmask16 m = (__mmask16)((1u << (n - i)) - 1);
        acc = _mm512_mask3_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i), acc, m);
    }
    return hsum(acc);
}

static void axpy_avx512(float a, const float *x, float *y, size_t n) {
    const __m512 va = _mm512_set1_ps(a);
    size_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(y + i, _mm512_fmadd_ps(va, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
    if (i < n) {
        const __mmask16 m = (__mmask16)((1u << (n - i)) - 1);
        const __m512 r = _mm512_fmadd_ps(va, _mm512_maskz_loadu_ps(m, x + i), _mm512_maskz_loadu_ps(m, y + i));
        _mm512_mask_storeu_ps(y + i, m, r);
    }
}

/* axpy_tile's passes: AXQ queries x AXV * 16 columns, 24 accumulators
 * (+ 4 value vectors and a broadcast of the 32 zmm). Against 4 x 4, in
 * one process (tiles of 16 queries, 2048 keys, head size 64): 4% faster
 * for fp32 values, 11% for binary16 (each widened value serves 6 queries,
 * not 4); 8 x 2 and 12 x 2 were in between, 8 x 3 slower. */
#define AXQ 6
#define AXV 4
/* Up to QN queries x 16 * AXV columns per pass: QN * AXV zmm of O stay in
 * registers while the keys go by in order, each value vector loaded (and
 * widened, H: binary16 values) once for all queries of the pass. Every
 * output element is still one fma chain over the keys in order. */
ALWAYS_INLINE void axpy_pass_avx512(const int H, const int QN, const float *P, size_t ldp,
                                    const void *V, size_t ldv, size_t nk, float *O, size_t ldo, size_t c0,
                                    size_t n) {
    __m512 o[AXQ][AXV];
    __mmask16 m[AXV];
    for (int v = 0; v < AXV; v++) {
        const size_t c = c0 + 16 * v;
        m[v] = c >= n ? 0 : n - c >= 16 ? 0xffff : (__mmask16)((1u << (n - c)) - 1);
    }
    for (int q = 0; q < QN; q++)
        for (int v = 0; v < AXV; v++) o[q][v] = _mm512_maskz_loadu_ps(m[v], O + q * ldo + c0 + 16 * v);
    for (size_t k = 0; k < nk; k++) {
        __m512 x[AXV];
        for (int v = 0; v < AXV; v++)
            x[v] = H ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m[v], (const uint16_t *)V + k * ldv + c0 + 16 * v))
                     : _mm512_maskz_loadu_ps(m[v], (const float *)V + k * ldv + c0 + 16 * v);
        for (int q = 0; q < QN; q++) {
            const __m512 a = _mm512_set1_ps(P[q * ldp + k]);
            for (int v = 0; v < AXV; v++) o[q][v] = _mm512_fmadd_ps(a, x[v], o[q][v]);
        }
    }
    for (int q = 0; q < QN; q++)
        for (int v = 0; v < AXV; v++) _mm512_mask_storeu_ps(O + q * ldo + c0 + 16 * v, m[v], o[q][v]);
}

ALWAYS_INLINE void axpy_tile_tpl(const int H, const float *P, size_t ldp, size_t nq, const void *V, size_t ldv,
                                 size_t nk, float *O, size_t ldo, size_t n) {
    for (size_t q = 0; q < nq; q += AXQ) {
        const float *Pq = P + q * ldp;
        float *Oq = O + q * ldo;
        for (size_t c0 = 0; c0 < n; c0 += 16 * AXV) {
            switch (nq - q) {
            case 1: axpy_pass_avx512(H, 1, Pq, ldp, V, ldv, nk, Oq, ldo, c0, n); break;
            case 2: axpy_pass_avx512(H, 2, Pq, ldp, V, ldv, nk, Oq, ldo, c0, n); break;
            case 3: axpy_pass_avx512(H, 3, Pq, ldp, V, ldv, nk, Oq, ldo, c0, n); break;
            case 4: axpy_pass_avx512(H, 4, Pq, ldp, V, ldv, nk, Oq, ldo, c0, n); break;
            case 5: axpy_pass_avx512(H, 5, Pq, ldp, V, ldv, nk, Oq, ldo, c0, n); break;
            default: axpy_pass_avx512(H, AXQ, Pq, ldp, V, ldv, nk, Oq, ldo, c0, n); break;
            }
        }
    }
}

static void axpy_tile_avx512(const float *P, size_t ldp, size_t nq, const float *V, size_t ldv,
                             size_t nk, float *O, size_t ldo, size_t n) {
    axpy_tile_tpl(0, P, ldp, nq, V, ldv, nk, O, ldo, n);
}

static void axpy_tile_h_avx512(const float *P, size_t ldp, size_t nq, const uint16_t *V, size_t ldv,
                               size_t nk, float *O, size_t ldo, size_t n) {
    axpy_tile_tpl(1, P, ldp, nq, V, ldv, nk, O, ldo, n);
}

/* Scores of nq queries against a key tile (kernels.h): keys in lanes, one
 * accumulator vector per lane of the canonical dot (element e goes to
 * acc[e % 16]), the reduction tree as vertical adds. */
ALWAYS_INLINE __m512 key_row16(const int H, const void *Kt, size_t e) {
    return H ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)Kt + 16 * e)))
             : _mm512_loadu_ps((const float *)Kt + 16 * e);
}

/* QN <= 4 queries against a key tile, the dot's 16 lanes in four passes
 * of four (lanes 4p..4p+3 of the QN queries: 4 QN accumulators), so each
 * key row loaded serves QN queries, not one. The passes go 0, 2, 1, 3, and
 * the reduction tree's first level (lane l plus lane l + 8) is taken as
 * soon as both of its lanes are done, the rest at the end: the same
 * additions in the same order as for one query alone. */
ALWAYS_INLINE void scores16_qn(const int H, const int QN, const float *Q, size_t ldq, const void *Kt, size_t hd,
                               float *S, size_t lds, __mmask16 m) {
    __attribute__((aligned(64))) float part[2][4][4][16]; /* [pass pair][query][lane][key] */
    static const int order[4] = {0, 2, 1, 3};
    for (int pi = 0; pi < 4; pi++) {
        const int p = order[pi];
        __m512 acc[4][4];
        for (int q = 0; q < QN; q++)
            for (int j = 0; j < 4; j++) acc[q][j] = _mm512_setzero_ps();
        size_t e0 = 0;
        for (; e0 + 16 <= hd; e0 += 16)
            for (int j = 0; j < 4; j++) {
                const size_t e = e0 + 4 * (size_t)p + (size_t)j;
                const __m512 k = key_row16(H, Kt, e);
                for (int q = 0; q < QN; q++) acc[q][j] = _mm512_fmadd_ps(_mm512_set1_ps(Q[q * ldq + e]), k, acc[q][j]);
            }
        for (int j = 0; j < 4; j++) {
            const size_t e = e0 + 4 * (size_t)p + (size_t)j;
            if (e >= hd) break;
            const __m512 k = key_row16(H, Kt, e);
            for (int q = 0; q < QN; q++) acc[q][j] = _mm512_fmadd_ps(_mm512_set1_ps(Q[q * ldq + e]), k, acc[q][j]);
        }
        /* passes 0 and 1 (lanes 0-7) wait for 2 and 3 (lanes 8-15) */
        float (*half)[4][16] = part[p & 1];
        for (int q = 0; q < QN; q++)
            for (int j = 0; j < 4; j++) {
                if (p < 2) _mm512_store_ps(half[q][j], acc[q][j]);
                else _mm512_store_ps(half[q][j], _mm512_add_ps(_mm512_load_ps(half[q][j]), acc[q][j]));
            }
    }
    /* part[0][q][l] = lanes l + (l + 8), part[1][q][l] = lanes (l + 4) + (l + 12) */
    for (int q = 0; q < QN; q++) {
        __m512 c[4];
        for (int l = 0; l < 4; l++) c[l] = _mm512_add_ps(_mm512_load_ps(part[0][q][l]), _mm512_load_ps(part[1][q][l]));
        _mm512_mask_storeu_ps(S + q * lds, m, _mm512_add_ps(_mm512_add_ps(c[0], c[2]), _mm512_add_ps(c[1], c[3])));
    }
}

ALWAYS_INLINE void scores16_tpl(const int H, const float *Q, size_t ldq, size_t nq, const void *Kt, size_t hd,
                                float *S, size_t lds, size_t nk) {
    const __mmask16 m = nk >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << nk) - 1);
    size_t i = 0;
    for (; i + 4 <= nq; i += 4) scores16_qn(H, 4, Q + i * ldq, ldq, Kt, hd, S + i * lds, lds, m);
    /* binary16 keys: two or three left (a decode token's KV group of 2 or
     * 3 heads, say) share each widened key row too (one process, 128 key
     * tiles: +32-68%); fp32 keys run them one by one, which was as fast or
     * faster there (the passes' partial sums weigh more than the loads
     * they save, presumably, when no widening is shared) */
    if (H && nq - i == 3) {
        scores16_qn(H, 3, Q + i * ldq, ldq, Kt, hd, S + i * lds, lds, m);
        return;
    }
    if (H && nq - i == 2) {
        scores16_qn(H, 2, Q + i * ldq, ldq, Kt, hd, S + i * lds, lds, m);
        return;
    }
    for (; i < nq; i++) {
        const float *q = Q + i * ldq;
        __m512 acc[16];
        for (int l = 0; l < 16; l++) acc[l] = _mm512_setzero_ps();
        size_t e = 0;
        for (; e + 16 <= hd; e += 16)
            for (int l = 0; l < 16; l++)
                acc[l] = _mm512_fmadd_ps(_mm512_set1_ps(q[e + l]), key_row16(H, Kt, e + l), acc[l]);
        for (int l = 0; e + l < hd; l++)
            acc[l] = _mm512_fmadd_ps(_mm512_set1_ps(q[e + l]), key_row16(H, Kt, e + l), acc[l]);
        for (int l = 0; l < 8; l++) acc[l] = _mm512_add_ps(acc[l], acc[l + 8]);
        for (int l = 0; l < 4; l++) acc[l] = _mm512_add_ps(acc[l], acc[l + 4]);
        _mm512_mask_storeu_ps(S + i * lds, m, _mm512_add_ps(_mm512_add_ps(acc[0], acc[2]), _mm512_add_ps(acc[1], acc[3])));
    }
}

static void scores16_avx512(const float *Q, size_t ldq, size_t nq, const float *Kt, size_t hd, float *S,
                            size_t lds, size_t nk) {
    scores16_tpl(0, Q, ldq, nq, Kt, hd, S, lds, nk);
}

static void scores16_h_avx512(const float *Q, size_t ldq, size_t nq, const uint16_t *Kt, size_t hd, float *S,
                              size_t lds, size_t nk) {
    scores16_tpl(1, Q, ldq, nq, Kt, hd, S, lds, nk);
}

/* n floats to binary16 (vcvtps2ph, nearest even: cism_f32_to_fp16's bits),
 * out[i * stride]. */
static void to_f16_avx512(const float *x, size_t n, uint16_t *out, size_t stride) {
    for (size_t i = 0; i < n; i += 16) {
        const __mmask16 m = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1);
        const __m256i h = _mm512_cvtps_ph(_mm512_maskz_loadu_ps(m, x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        if (stride == 1) {
            _mm256_mask_storeu_epi16(out + i, m, h);
        } else {
            uint16_t t[16];
            _mm256_storeu_si256((__m256i *)t, h);
            for (size_t j = 0; j < 16 && i + j < n; j++) out[(i + j) * stride] = t[j];
        }
    }
}

/* Absolute maximum and the two rounded halves of one 32-element block. */
ALWAYS_INLINE float block_absmax(const float *x, size_t start, size_t n, __m512 *v0, __m512 *v1) {
    const size_t left = start < n ? n - start : 0;
    const __mmask16 m0 = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1);
    const __mmask16 m1 = left >= 32 ? 0xffff : left > 16 ? (__mmask16)((1u << (left - 16)) - 1) : 0;
    *v0 = _mm512_maskz_loadu_ps(m0, x + start);
    *v1 = _mm512_maskz_loadu_ps(m1, x + start + 16);
    return _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(*v0), _mm512_abs_ps(*v1)));
}

ALWAYS_INLINE __m512i quant_half(__m512 v, float norm, float limit) {
    __m512 q = _mm512_roundscale_ps(_mm512_mul_ps(v, _mm512_set1_ps(norm)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    q = _mm512_min_ps(q, _mm512_set1_ps(limit));
    q = _mm512_max_ps(q, _mm512_set1_ps(-limit));
    return _mm512_cvtps_epi32(q);
}

static void quant8_avx512(const float *x, size_t n, int8_t *q, float *scales) {
    const size_t len = cism_act_len(n);
    for (size_t b = 0; b * 32 < len; b++) {
        __m512 v0, v1;
        float m = block_absmax(x, 32 * b, n, &v0, &v1);
        const float norm = quant_norm(&m, 127.0f);
        scales[b] = m / 127.0f;
        _mm_storeu_si128((__m128i *)(q + 32 * b), _mm512_cvtepi32_epi8(quant_half(v0, norm, 127.0f)));
        _mm_storeu_si128((__m128i *)(q + 32 * b + 16), _mm512_cvtepi32_epi8(quant_half(v1, norm, 127.0f)));
    }
}

#ifndef __AVX512VNNI__
void cism_fill_gemm_avx512(cism_kernels *k) {
    fill_e4m3_half();
    k->gemm[CISM_FP32] = gemm_fp32_avx512;
    k->gemm[CISM_FP16] = gemm_fp16_avx512;
    k->gemm[CISM_INT8] = gemm_int8_avx512;
    k->gemm[CISM_INT4] = gemm_int4_avx512;
    k->gemm[CISM_FP4] = gemm_fp4_avx512;
    k->gemm[CISM_Q4K] = gemm_q4k_avx512;
    k->gemm[CISM_Q6K] = gemm_q6k_avx512;
    k->gemm_int8_q8 = gemm_int8_q8_avx512;
    k->gemm_int4_q8 = gemm_int4_q8_avx512;
    k->gemm_fp4_q8 = gemm_fp4_q8_avx512;
    k->gemm_q4k_q8 = gemm_q4k_q8_avx512;
    k->gemm_q6k_q8 = gemm_q6k_q8_avx512;
    k->dot = dot_avx512;
    k->axpy = axpy_avx512;
    k->axpy_tile = axpy_tile_avx512;
    k->scores16 = scores16_avx512;
    k->scores16_h = scores16_h_avx512;
    k->axpy_tile_h = axpy_tile_h_avx512;
    k->to_f16 = to_f16_avx512;
    k->quant8 = quant8_avx512;
    k->name_gemm = k->name_gemm_q = k->name_dot = k->name_quant = "avx512";
}
#endif
