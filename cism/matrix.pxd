# C-level matrix products for the model modules (cimport cism.matrix).
from libc.stdint cimport int8_t, uint8_t, uint16_t
from cism._kernels cimport cism_mat

# Activation modes of gemm_multi (bit flags): ACT_Q8 selects the
# quantized-activation kernels for integer storages; ACT_BF16 the opt-in bf16
# kernel (gemm_amx.c) for every storage, where the CPU has it (elsewhere the
# call runs as if ACT_BF16 were not set).
cdef enum:
    ACT_FP32 = 0
    ACT_Q8 = 1
    ACT_BF16 = 2

# Per-caller scratch for quantized activations. Every session owns one, so
# concurrent sessions never share buffers. Zero-initialise, free with
# scratch_free().
ctypedef struct Scratch:
    int8_t *q8
    float *qs8
    uint16_t *xb
    size_t cap8, caps8, capb

cdef void scratch_free(Scratch *s) noexcept nogil

# Y_i[t*ldy_i + r] = row r of W_i . X[t], for count matrices sharing one
# input: one parallel pass over all their rows (fused q/k/v, gate/up).
# mode: ACT_* flags above.
# Returns 0, or -1 when scratch memory could not be allocated.
cdef int gemm_multi(const cism_mat **W, float **Y, const size_t *ldy, int count, int mode,
                    const float *X, size_t ldx, size_t T, Scratch *s, int threads) noexcept nogil
cdef int gemm1(const cism_mat *W, int mode, const float *X, size_t ldx, size_t T,
               float *Y, size_t ldy, Scratch *s, int threads) noexcept nogil
# Whether a bf16 kernel is in the dispatch table (AVX512-BF16, or AMX-BF16 granted by the OS).
cdef bint bf16_ready() noexcept nogil
# Row i of W (fp32/fp16/int8 only) into out[cols].
cdef void mat_row(const cism_mat *W, size_t i, float *out) noexcept nogil

cdef class Matrix:
    cdef cism_mat mat
    cdef void *codes_buf
    cdef float *scales_buf
    cdef size_t nbytes_
    cdef int act_mode
    cdef str storage_name
    cdef object base_      # the owner of codes_buf when the Matrix does not own it (a file mapping), else None
