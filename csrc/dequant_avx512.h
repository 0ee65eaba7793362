/* AVX-512 dequantization: packed weights as floats, exactly the weights
 * the canonical dot multiplies (gemm_ref.c). Shared by the fp32-activation
 * gemm (gemm/gemm_avx512.c) and the amx level's bf16 gemm
 * (gemm/gemm_amx.c), which rounds these floats to bf16. */
#ifndef CISM_DEQUANT_AVX512_H
#define CISM_DEQUANT_AVX512_H

#include "simd_avx512.h"

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

/* ggml K-quants (q4_k, q6_k): the decoded weights (formats.h, csrc/ggml.h's
 * bits), a 64-element part of a super-block at a time. */

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

#endif
