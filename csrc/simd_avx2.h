/* AVX2 (+FMA, F16C) helpers shared by the kernel files of the avx2 level. */
#ifndef CISM_SIMD_AVX2_H
#define CISM_SIMD_AVX2_H

#include "simd.h"

/* All-ones in lanes [0, k), k may be <= 0 or >= 8. */
ALWAYS_INLINE __m256i lane_mask(long k) {
    const int kk = k < 0 ? 0 : k > 8 ? 8 : (int)k;
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(kk), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* The nibbles of 16 fp4 code bytes as 2*E2M1 int8 values, element order:
 * *v0 = elements 0-15, *v1 = elements 16-31. */
ALWAYS_INLINE void fp4_values(const uint8_t *codes, __m128i *v0, __m128i *v1) {
    const __m128i lut = _mm_loadu_si128((const __m128i *)cism_e2m1_x2);
    const __m128i x = _mm_loadu_si128((const __m128i *)codes);
    const __m128i nl = _mm_and_si128(x, _mm_set1_epi8(15));
    const __m128i nh = _mm_and_si128(_mm_srli_epi16(x, 4), _mm_set1_epi8(15));
    *v0 = _mm_shuffle_epi8(lut, _mm_unpacklo_epi8(nl, nh));
    *v1 = _mm_shuffle_epi8(lut, _mm_unpackhi_epi8(nl, nh));
}

/* The 32 unsigned codes of Q4_K sub-block j or Q6_K run j (element order). */
ALWAYS_INLINE __m256i kq_codes32(const int S, const uint8_t *blk, int j) {
    const __m256i m4 = _mm256_set1_epi8(15);
    if (S == CISM_Q4K) {
        const __m256i x = _mm256_loadu_si256((const __m256i *)(blk + CISM_Q4_K_QS + 32 * (j / 2)));
        return j % 2 ? _mm256_and_si256(_mm256_srli_epi16(x, 4), m4) : _mm256_and_si256(x, m4);
    }
    const int h = j / 4, r = j % 4;
    const __m256i ql = _mm256_loadu_si256((const __m256i *)(blk + CISM_Q6_K_QL + 64 * h + 32 * (r % 2)));
    const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + CISM_Q6_K_QH + 32 * h));
    const __m256i low = r / 2 ? _mm256_and_si256(_mm256_srli_epi16(ql, 4), m4) : _mm256_and_si256(ql, m4);
    /* bit pair r of qh to bits 4-5 (16-bit shifts: the mask drops what
     * crosses from the neighbouring byte) */
    const __m256i top = r == 0 ? _mm256_slli_epi16(qh, 4) : r == 1 ? _mm256_slli_epi16(qh, 2)
                      : r == 2 ? qh : _mm256_srli_epi16(qh, 2);
    return _mm256_or_si256(low, _mm256_and_si256(top, _mm256_set1_epi8(0x30)));
}

#endif
