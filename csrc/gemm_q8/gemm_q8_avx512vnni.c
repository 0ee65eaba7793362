/* AVX-512 VNNI: integer weights x q8 activations with vpdpbusd, dots in
 * lanes for a few tokens and tokens in lanes from TQ_MIN_TOKENS on
 * (q8_vnni.h). */
#define Q8_DOT4 dot4_vnni
#define Q8_I8_SUMS i8_sums_vnni
#define Q8_INT4_NIBBLES int4_nibbles_shift
#define Q8_NIB_HI nib_hi_shift
#define Q8_LUT16 lut16_pshufb
#include "q8_vnni.h"

GEMM_Q_VNNI(gemm_int8_q8_avx512vnni, CISM_INT8)
GEMM_Q_VNNI(gemm_int4_q8_avx512vnni, CISM_INT4)
GEMM_Q_VNNI(gemm_fp4_q8_avx512vnni, CISM_FP4)
GEMM_KQ8(gemm_q4k_q8_avx512vnni, CISM_Q4K)
GEMM_KQ8(gemm_q6k_q8_avx512vnni, CISM_Q6K)

void cism_fill_gemm_q8_avx512vnni(cism_kernels *k) {
    fill_e4m3_half();
    k->gemm_int8_q8 = gemm_int8_q8_avx512vnni;
    k->gemm_int4_q8 = gemm_int4_q8_avx512vnni;
    k->gemm_fp4_q8 = gemm_fp4_q8_avx512vnni;
    k->gemm_q4k_q8 = gemm_q4k_q8_avx512vnni;
    k->gemm_q6k_q8 = gemm_q6k_q8_avx512vnni;
    k->name_gemm_q = "avx512vnni";
}
