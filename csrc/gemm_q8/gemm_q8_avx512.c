/* AVX-512 (F/BW/VL/DQ): integer weights x q8 activations with dots in
 * lanes (the template in q8_avx512.h), the K-quants with tokens in lanes
 * from TQ_MIN_TOKENS on, the byte sums by maddubs + madd. */
#include "simd_avx512.h"

/* u8 x s8 four-element lane sums added to acc (exact where it is used:
 * the dots-in-lanes unsigned operand is at most 24, and the K-quant tokens
 * in lanes (a + 128) times |w| <= 32 stays within int16 by a pair). */
ALWAYS_INLINE __m512i dot4_maddubs(__m512i acc, __m512i w, __m512i a) {
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(w, a), _mm512_set1_epi16(1)));
}

/* int8 x q8, one 64-byte unit = blocks 2u (lanes 0-7) and 2u+1 (lanes 8-15):
 * each lane holds the exact integer sum of four products. |a| * (sign(a) w)
 * keeps every pair sum within int16 (|a|, |w| <= 127), so maddubs never
 * saturates and gives the integers vpdpbusd gives. */
ALWAYS_INLINE void i8_sums_signs(const int R, const int TT, const uint8_t *const rows[8], const cism_act *A,
                                 size_t t, size_t u, __m512i v[16]) {
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
            v[i * TT + j] = _mm512_madd_epi16(
                _mm512_maddubs_epi16(aa[j], _mm512_mask_sub_epi8(w, neg[j], _mm512_setzero_si512(), w)),
                _mm512_set1_epi16(1));
    }
}

#define Q8_DOT4 dot4_maddubs
#define Q8_I8_SUMS i8_sums_signs
#define Q8_INT4_NIBBLES int4_nibbles_shift
#define Q8_NIB_HI nib_hi_shift
#define Q8_LUT16 lut16_pshufb
#include "q8_avx512.h"

GEMM_Q(gemm_int8_q8_avx512, CISM_INT8)
GEMM_Q(gemm_int4_q8_avx512, CISM_INT4)
GEMM_Q(gemm_fp4_q8_avx512, CISM_FP4)
GEMM_KQ8(gemm_q4k_q8_avx512, CISM_Q4K)
GEMM_KQ8(gemm_q6k_q8_avx512, CISM_Q6K)

void cism_fill_gemm_q8_avx512(cism_kernels *k) {
    fill_e4m3_half();
    k->gemm_int8_q8 = gemm_int8_q8_avx512;
    k->gemm_int4_q8 = gemm_int4_q8_avx512;
    k->gemm_fp4_q8 = gemm_fp4_q8_avx512;
    k->gemm_q4k_q8 = gemm_q4k_q8_avx512;
    k->gemm_q6k_q8 = gemm_q6k_q8_avx512;
    k->name_gemm_q = "avx512";
}
