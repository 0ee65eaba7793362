/* AVX-512 VNNI: the int8 x q8 product with vpdpbusd (one instruction per 64
 * multiply-adds). Everything else is the avx512 code, included here so both
 * translation units share one source; this one is compiled with -mavx512vnni. */
#include "gemm_avx512.c"

void cism_fill_gemm_avx512vnni(cism_kernels *k) {
    k->gemm_int8_q8 = gemm_int8_q8_avx512vnni;
    k->name_gemm_q = "avx512vnni";
}
