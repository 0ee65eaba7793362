/* The AMX kernels of csrc/gemm/gemm_amx.c (bf16) and csrc/gemm_q8/gemm_q8_amx.c
 * (integer x q8) over the emulated tile unit of amx_emulate.h, built with gcc
 * and loaded with ctypes by tests/amx_emulator.py.
 * Two ways in: cism_emu_gemm_q8 calls an integer kernel on one row range
 * (tests/test_amx_emulated.py), and cism_emu_fill fills the amx slots of
 * cism's own dispatch table (cism._kernels._emulate_amx), so that Matrix,
 * the models and the tests written for a real unit run every AMX kernel
 * (gemm_bf16, pack_bf16 and the three integer x q8 ones) on this one. */
#include <immintrin.h>

#include "amx_emulate.h"

/* The kernels' scratch: this library's own copy of csrc/scratch.c until
 * cism_emu_fill hands over cism's (whose cism_scratch_fail the tests use). */
void *emu_scratch_get(size_t bytes);
void emu_scratch_put(void *p);
#define cism_scratch_get emu_scratch_get
#define cism_scratch_put emu_scratch_put
/* The kernel sources (the only includes of them; a move of csrc/gemm/ or
 * csrc/gemm_q8/ changes these lines). */
#include "../../csrc/gemm/gemm_amx.c"
#include "../../csrc/gemm_q8/gemm_q8_amx.c"
#undef cism_scratch_get
#undef cism_scratch_put
#include "../../csrc/scratch.c"

static void *(*scratch_get)(size_t) = cism_scratch_get;
static void (*scratch_put)(void *) = cism_scratch_put;
void *emu_scratch_get(size_t bytes) { return scratch_get(bytes); }
void emu_scratch_put(void *p) { scratch_put(p); }

/* A kernel that asked the unit for something it refuses (emu_error) has
 * no defined result: its outputs become NaN, so no comparison passes. */
static int refused;

static void emu_checked(cism_gemm_fn f, const cism_mat *W, size_t r0, size_t r1, const cism_act *A, size_t T,
                        float *Y, size_t ldy) {
    emu_error = 0;
    f(W, r0, r1, A, T, Y, ldy);
    if (emu_error) {
        __atomic_store_n(&refused, 1, __ATOMIC_RELAXED);
        for (size_t t = 0; t < T; t++)
            for (size_t r = r0; r < r1; r++) Y[t * ldy + r] = __builtin_nanf("");
    }
}

static cism_gemm_fn kernel_bf16, kernel_int8, kernel_int4, kernel_fp4;
#define EMU_WRAP(name, kernel)                                                                                  \
    static void name(const cism_mat *W, size_t r0, size_t r1, const cism_act *A, size_t T, float *Y,           \
                     size_t ldy) {                                                                             \
        emu_checked(kernel, W, r0, r1, A, T, Y, ldy);                                                          \
    }
EMU_WRAP(emu_gemm_bf16, kernel_bf16)
EMU_WRAP(emu_gemm_int8_q8, kernel_int8)
EMU_WRAP(emu_gemm_int4_q8, kernel_int4)
EMU_WRAP(emu_gemm_fp4_q8, kernel_fp4)

/* The filler cism._kernels._emulate_amx installs: gemm_amx.c's and
 * gemm_q8_amx.c's own, their kernels wrapped to report refused shapes, named
 * as emulated. */
void cism_emu_fill(cism_kernels *k, void *(*get)(size_t), void (*put)(void *)) {
    scratch_get = get;
    scratch_put = put;
    cism_fill_gemm_amx(k);
    cism_fill_gemm_q8_amx(k);
    kernel_bf16 = k->gemm_bf16;
    kernel_int8 = k->gemm_int8_q8;
    kernel_int4 = k->gemm_int4_q8;
    kernel_fp4 = k->gemm_fp4_q8;
    k->gemm_bf16 = emu_gemm_bf16;
    k->gemm_int8_q8 = emu_gemm_int8_q8;
    k->gemm_int4_q8 = emu_gemm_int4_q8;
    k->gemm_fp4_q8 = emu_gemm_fp4_q8;
    k->name_gemm_bf16 = k->name_gemm_q = "amx (emulated)";
}

/* Whether any kernel called through cism_emu_fill's table was refused a
 * shape since the last call (which clears it). */
int cism_emu_refused(void) { return __atomic_exchange_n(&refused, 0, __ATOMIC_RELAXED); }

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
