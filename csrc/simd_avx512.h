/* AVX-512 (F/BW/VL/DQ) helpers shared by the kernel files of the avx512,
 * avx512vnni and amx levels. */
#ifndef CISM_SIMD_AVX512_H
#define CISM_SIMD_AVX512_H

#include "simd.h"

/* cism_reduce16 of one zmm of lane sums. */
ALWAYS_INLINE float hsum(__m512 v) {
    const __m256 lo = _mm512_castps512_ps256(v);
    const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    const __m256 s8 = _mm256_add_ps(lo, hi);
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
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

ALWAYS_INLINE __m512 join8(__m256 lo, __m256 hi) {
    return _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
}
ALWAYS_INLINE __m256 lo8(__m512 v) { return _mm512_castps512_ps256(v); }
ALWAYS_INLINE __m256 hi8(__m512 v) { return _mm512_extractf32x8_ps(v, 1); }

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

#endif
