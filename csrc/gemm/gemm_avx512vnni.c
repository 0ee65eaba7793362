/* AVX-512 VNNI: the integer x q8 products with vpdpbusd (one instruction per
 * 64 multiply-adds). Everything else is the avx512 code, included here so both
 * translation units share one source; this one is compiled with -mavx512vnni. */
/* (only the q8 products of the included family are used here) */
#pragma GCC diagnostic ignored "-Wunused-function"
#include "gemm_avx512.c"

void cism_fill_gemm_avx512vnni(cism_kernels *k) {
    fill_e4m3_half();
    k->gemm_int8_q8 = gemm_int8_q8_avx512vnni;
    k->gemm_int4_q8 = gemm_int4_q8_avx512vnni;
    k->gemm_fp4_q8 = gemm_fp4_q8_avx512vnni;
    k->gemm_q4k_q8 = gemm_q4k_q8_avx512vnni;
    k->gemm_q6k_q8 = gemm_q6k_q8_avx512vnni;
    k->name_gemm_q = "avx512vnni";
}
