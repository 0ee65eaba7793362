/* The AMX kernels of csrc/gemm_q8/gemm_q8_amx.c over the emulated tile unit of
 * amx_emulate.h, for tests/test_amx_emulated.py (built there with gcc and
 * loaded with ctypes). */
#include <immintrin.h>

#include "amx_emulate.h"

#include "../../csrc/gemm_q8/gemm_q8_amx.c"
#include "../../csrc/scratch.c"

static cism_kernels table;

/* Y[t * rows + r] for rows [r0, r1) of the packed matrix (its
 * Matrix.codes buffer, int8 row scales) and T quantized activation rows;
 * returns 0; 1 when `storage` has no AMX integer kernel; 2 when the
 * kernel asked the emulated unit for something the real one refuses. */
int cism_emu_gemm_q8(int storage, const void *codes, size_t rows, size_t cols, size_t row_bytes,
                     size_t scale_offset, const float *row_scales, const int8_t *q8, const float *qscale,
                     size_t ldq, size_t ldqs, size_t T, size_t r0, size_t r1, float *Y) {
    cism_fill_gemm_q8_amx(&table);
    const cism_mat W = {storage, rows, cols, codes, row_bytes, scale_offset, row_scales};
    int err = 0;
    cism_act A;
    memset(&A, 0, sizeof A);
    A.q8 = q8;
    A.qscale = qscale;
    A.ldq = ldq;
    A.ldqs = ldqs;
    A.err = &err;
    cism_gemm_fn f = storage == CISM_INT8 ? table.gemm_int8_q8 : storage == CISM_INT4 ? table.gemm_int4_q8
                     : storage == CISM_FP4 ? table.gemm_fp4_q8 : NULL;
    if (!f) return 1;
    emu_error = 0;
    f(&W, r0, r1, &A, T, Y, rows);
    return emu_error ? 2 : err;
}
