# Cython mirror of csrc/formats.h and csrc/kernels.h (the one place the C
# storage formats and kernel signatures are declared for Cython).
from libc.stdint cimport int8_t, int16_t, int32_t, uint8_t, uint16_t

cdef extern from "formats.h" nogil:
    enum:
        CISM_FP32
        CISM_FP16
        CISM_INT8
        CISM_INT4
        CISM_FP4
        CISM_Q4K
        CISM_Q6K
        CISM_NUM_STORAGES
        CISM_QK_K
        CISM_Q4_K_D
        CISM_Q4_K_DMIN
        CISM_Q4_K_BYTES
        CISM_Q6_K_D
        CISM_Q6_K_BYTES
        CISM_SLACK
        CISM_INT4_BLOCK
        CISM_FP4_BLOCK
        CISM_ACT_BLOCK

    ctypedef struct cism_mat:
        int32_t storage
        size_t rows, cols
        const void *codes
        size_t row_bytes
        size_t scale_offset
        const float *scales

    size_t cism_div_up(size_t a, size_t b)
    size_t cism_code_bytes(int storage, size_t cols)
    size_t cism_row_bytes(int storage, size_t cols)
    float cism_fp16_to_f32(uint16_t h)
    uint16_t cism_f32_to_fp16(float f)
    float cism_e4m3_to_f32(uint8_t b)
    uint8_t cism_f32_to_e4m3(float x)

cdef extern from "kernels.h" nogil:
    enum:
        CISM_ACT_PAD
        CISM_ISA_REF
        CISM_ISA_AVX2
        CISM_ISA_AVX512
        CISM_ISA_AVX512VNNI
        CISM_ISA_AMX

    size_t cism_act_len(size_t n)
    size_t cism_bf16_len(size_t n)
    size_t cism_bf16_rows(size_t T)

    ctypedef struct cism_act:
        const float *x
        size_t ldx
        const int8_t *q8
        const float *qscale
        size_t ldq, ldqs
        const uint16_t *xb
        size_t ldb
        int *err

    ctypedef void (*cism_gemm_fn)(const cism_mat *W, size_t r0, size_t r1, const cism_act *A,
                                  size_t T, float *Y, size_t ldy) noexcept nogil
    ctypedef float (*cism_dot_fn)(const float *a, const float *b, size_t n) noexcept nogil
    ctypedef void (*cism_axpy_fn)(float a, const float *x, float *y, size_t n) noexcept nogil
    ctypedef void (*cism_axpy_tile_fn)(const float *P, size_t ldp, size_t nq, const float *V,
                                       size_t ldv, size_t nk, float *O, size_t ldo,
                                       size_t n) noexcept nogil
    ctypedef void (*cism_scores16_fn)(const float *Q, size_t ldq, size_t nq, const float *Kt,
                                      size_t hd, float *S, size_t lds, size_t nk) noexcept nogil
    ctypedef void (*cism_scores16_h_fn)(const float *Q, size_t ldq, size_t nq, const uint16_t *Kt,
                                        size_t hd, float *S, size_t lds, size_t nk) noexcept nogil
    ctypedef void (*cism_axpy_tile_h_fn)(const float *P, size_t ldp, size_t nq, const uint16_t *V,
                                         size_t ldv, size_t nk, float *O, size_t ldo,
                                         size_t n) noexcept nogil
    ctypedef void (*cism_to_f16_fn)(const float *x, size_t n, uint16_t *out, size_t stride) noexcept nogil
    ctypedef void (*cism_quant8_fn)(const float *x, size_t n, int8_t *q, float *scales) noexcept nogil
    ctypedef void (*cism_pack_bf16_fn)(const float *x, size_t n, uint16_t *out, size_t stride) noexcept nogil
    ctypedef void (*cism_unary_fn)(const float *x, float *y, size_t n) noexcept nogil
    ctypedef void (*cism_binary_fn)(const float *a, const float *b, float *y, size_t n) noexcept nogil
    ctypedef void (*cism_softmax_fn)(float *x, size_t n, float scale) noexcept nogil
    ctypedef size_t (*cism_argmax_fn)(const float *x, size_t n) noexcept nogil

    ctypedef struct cism_kernels:
        cism_gemm_fn gemm[7]
        cism_gemm_fn gemm_int8_q8
        cism_gemm_fn gemm_int4_q8
        cism_gemm_fn gemm_fp4_q8
        cism_gemm_fn gemm_q4k_q8
        cism_gemm_fn gemm_q6k_q8
        cism_gemm_fn gemm_bf16
        cism_pack_bf16_fn pack_bf16
        cism_dot_fn dot
        cism_axpy_fn axpy
        cism_axpy_tile_fn axpy_tile
        cism_scores16_fn scores16
        cism_scores16_h_fn scores16_h
        cism_axpy_tile_h_fn axpy_tile_h
        cism_scores16_fn scores16_bf16
        cism_scores16_h_fn scores16_bf16_h
        cism_axpy_tile_fn axpy_tile_bf16
        cism_axpy_tile_h_fn axpy_tile_bf16_h
        cism_to_f16_fn to_f16
        cism_quant8_fn quant8
        cism_unary_fn exp
        cism_unary_fn sigmoid
        cism_unary_fn silu
        cism_unary_fn gelu
        cism_binary_fn silu_mul
        cism_binary_fn sigmoid_mul
        cism_softmax_fn softmax
        cism_argmax_fn argmax
        const char *name_gemm
        const char *name_gemm_q
        const char *name_dot
        const char *name_quant
        const char *name_act
        const char *name_gemm_bf16
        const char *name_attn_bf16

    ctypedef struct cism_cpu:
        int avx2, fma, f16c, avx512f, avx512bw, avx512vl, avx512dq, avx512vnni, avx_vnni, amx_tile
        int avx512bf16, amx_bf16, amx_int8
        int os_avx, os_avx512, os_amx
        int amx_granted
        int avx512vbmi
        int gfni

    int cism_init()
    const cism_kernels *cism_table()
    const cism_cpu *cism_cpu_features()
    int cism_isa_level()
    int cism_isa_max()
    const char *cism_isa_name(int level)
    const char *cism_isa_error()
    int cism_set_isa(int level)
    ctypedef void (*cism_amx_emulator)(cism_kernels *k, void *(*scratch_get)(size_t), void (*scratch_put)(void *))
    int cism_emulate_amx(cism_amx_emulator fill)

# The dispatch table, filled once when cism._kernels is imported. Other
# modules cimport this function, so every module shares one table.
cdef const cism_kernels *kernel_table() noexcept nogil
