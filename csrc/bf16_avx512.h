/* The opt-in bf16 precision's packing, shared by its two kernels (the AMX
 * tile kernel, gemm/gemm_amx.c, and the VDPBF16PS one,
 * gemm/gemm_avx512bf16.c): both round with the same instruction, so their
 * inputs are the same bits. Include after dequant_avx512.h (transpose16),
 * in a file compiled with AVX512-BF16. */
#ifndef CISM_BF16_AVX512_H
#define CISM_BF16_AVX512_H

#include "dequant_avx512.h"

#define BF16_ROWS 32 /* weight rows per packed block: two groups of 16 */

/* 32 floats (masked: elements past n are zero) as 32 bf16, nearest even. */
ALWAYS_INLINE __m512i bf16x32(const float *x, size_t n) {
    const __mmask16 m0 = n >= 16 ? 0xffff : (__mmask16)((1u << n) - 1);
    const __mmask16 m1 = n >= 32 ? 0xffff : n > 16 ? (__mmask16)((1u << (n - 16)) - 1) : 0;
    const __m512 lo = _mm512_maskz_loadu_ps(m0, x), hi = _mm512_maskz_loadu_ps(m1, x + 16);
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

/* The table's pack_bf16: n floats as cism_bf16_len(n) bf16, elements
 * 32kb..32kb+31 at out + kb * stride (the callers' A-tile blocks). */
static inline void bf16_pack_row(const float *x, size_t n, uint16_t *out, size_t stride) {
    const size_t len = cism_bf16_len(n);
    for (size_t k = 0; k < len; k += 32) {
        const size_t left = k < n ? n - k : 0;
        _mm512_storeu_si512((void *)(out + k / 32 * stride), bf16x32(x + k, left));
    }
}

/* Rows r..r+R-1 (R <= 32; missing rows are zero) in the pair layout: block
 * (j, kb) at B + (j * kblocks + kb) * 512 holds, in its row p, the pairs
 * (w[16j + i][32kb + 2p], w[16j + i][32kb + 2p + 1]) for i = 0..15 (the
 * AMX B tile; for VDPBF16PS, the vector of k pair 16kb + p of 16 rows).
 * fp32 rows are read in place, the others from fbuf (row i at fbuf + i * n,
 * dequantized by the caller). */
ALWAYS_INLINE void bf16_pack_pairs(const int S, const cism_mat *W, size_t r, size_t R, const float *fbuf,
                                   uint16_t *B) {
    const size_t n = W->cols, kblocks = cism_bf16_len(n) / 32;
    for (size_t j = 0; j < BF16_ROWS / 16; j++) {
        for (size_t kb = 0; kb < kblocks; kb++) {
            __m512i rows[16], cols[16];
            const size_t k = 32 * kb;
            for (size_t i = 0; i < 16; i++) {
                const size_t row = 16 * j + i;
                if (row >= R) {
                    rows[i] = _mm512_setzero_si512();
                    continue;
                }
                const float *src = S == CISM_FP32
                    ? (const float *)((const uint8_t *)W->codes + (r + row) * W->row_bytes)
                    : fbuf + row * n;
                rows[i] = bf16x32(src + k, n - k);
            }
            transpose16(rows, cols);
            uint16_t *blk = B + (j * kblocks + kb) * 512;
            for (int p = 0; p < 16; p++) _mm512_store_si512((void *)(blk + 32 * p), cols[p]);
        }
    }
}

#endif
