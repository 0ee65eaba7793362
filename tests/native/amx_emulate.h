/* Scalar stand-ins for the AMX tile intrinsics that csrc/gemm/gemm_amx.c
 * uses, so that its kernels' logic (tile shapes, addressing, pipelining,
 * folds, stores) can be tested on CPUs without a tile unit
 * (tests/test_amx_emulated.py). Include after <immintrin.h>; the macros
 * below replace the intrinsics at every later call site.
 *
 * Semantics as the Intel SDM states them for palette 1: 8 tiles of up to
 * 16 rows x 64 bytes; a load or store moves rows[t] rows of colsb[t] bytes
 * with the given stride; TDPBSSD adds to each int32 C[m][n] the products of
 * the signed bytes A[m][4k + i] and B[k][4n + i] (k < colsb(A) / 4); it
 * requires rows(A) = rows(C), colsb(B) = colsb(C) and rows(B) = colsb(A) / 4,
 * which is checked here (a mismatch sets emu_error, which the harness
 * reports, so a wrong configuration cannot pass a test).
 *
 * TDPBF16PS follows the SDM's pseudo-code step for step: per C element two
 * fp32 partial sums, the even and the odd halves of the bf16 pairs, each a
 * chain of FMAs (one rounding each) over k starting from zero; then their
 * sum, then that added to C. Every step rounds to nearest even, treats
 * denormal inputs as zero and flushes denormal results to zero (here: the
 * correctly rounded fp32 result, zeroed when it is denormal), whatever
 * MXCSR says. tests/test_bf16.py's emulate_tile_unit states the same
 * arithmetic in NumPy and the emulated kernel must match it bit for bit.
 * Whether a real unit sums in exactly this order is not documented beyond
 * the pseudo-code (docs/EXACTNESS.md: orders tried on one did not match
 * it), so on real AMX tests/test_bf16.py keeps its tolerance. */
#ifndef CISM_AMX_EMULATE_H
#define CISM_AMX_EMULATE_H

#include <math.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    uint8_t data[8][16][64];
    uint8_t rows[8];
    uint16_t colsb[8];
    int configured;
} emu_tiles;

static _Thread_local emu_tiles emu;
static _Thread_local int emu_error; /* a shape or configuration the unit would refuse */

static int emu_check(int ok) {
    if (!ok) emu_error = 1;
    return ok;
}

static void emu_loadconfig(const void *p) {
    const uint8_t *c = (const uint8_t *)p;
    memset(&emu, 0, sizeof emu);
    if (!emu_check(c[0] == 1)) return; /* palette 1 */
    for (int t = 0; t < 8; t++) {
        memcpy(&emu.colsb[t], c + 16 + 2 * t, 2);
        emu.rows[t] = c[48 + t];
        if (!emu_check(emu.rows[t] <= 16 && emu.colsb[t] <= 64)) return;
    }
    emu.configured = 1;
}

static void emu_release(void) { memset(&emu, 0, sizeof emu); }

static void emu_zero(int t) {
    if (!emu_check(emu.configured)) return;
    memset(emu.data[t], 0, sizeof emu.data[t]);
}

static void emu_loadd(int t, const void *base, long stride) {
    if (!emu_check(emu.configured && emu.rows[t] && emu.colsb[t])) return;
    memset(emu.data[t], 0, sizeof emu.data[t]);
    for (int m = 0; m < emu.rows[t]; m++)
        memcpy(emu.data[t][m], (const uint8_t *)base + m * stride, emu.colsb[t]);
}

static void emu_stored(int t, void *base, long stride) {
    if (!emu_check(emu.configured && emu.rows[t] && emu.colsb[t])) return;
    for (int m = 0; m < emu.rows[t]; m++) memcpy((uint8_t *)base + m * stride, emu.data[t][m], emu.colsb[t]);
}

static int emu_shapes(int c, int a, int b) {
    return emu_check(emu.configured && emu.rows[a] == emu.rows[c] && emu.colsb[b] == emu.colsb[c] &&
                     emu.rows[b] * 4 == emu.colsb[a] && emu.colsb[c] % 4 == 0);
}

static void emu_dpbssd(int c, int a, int b) {
    if (!emu_shapes(c, a, b)) return;
    for (int m = 0; m < emu.rows[c]; m++)
        for (int n = 0; n < emu.colsb[c] / 4; n++) {
            int32_t acc;
            memcpy(&acc, emu.data[c][m] + 4 * n, 4);
            for (int k = 0; k < emu.colsb[a] / 4; k++)
                for (int i = 0; i < 4; i++)
                    acc += (int32_t)(int8_t)emu.data[a][m][4 * k + i] * (int8_t)emu.data[b][k][4 * n + i];
            memcpy(emu.data[c][m] + 4 * n, &acc, 4);
        }
}

/* DAZ on the way in, FTZ on the way out: a denormal counts as a zero of its sign. */
static float emu_flush(float x) { return fpclassify(x) == FP_SUBNORMAL ? copysignf(0.0f, x) : x; }

static float emu_bf16(const uint8_t *p) {
    uint32_t u = (uint32_t)(p[0] | (p[1] << 8)) << 16;
    float f;
    memcpy(&f, &u, 4);
    return emu_flush(f);
}

static float emu_fma(float a, float b, float c) { return emu_flush(fmaf(a, b, emu_flush(c))); }
static float emu_add(float a, float b) { return emu_flush(emu_flush(a) + emu_flush(b)); }

static void emu_dpbf16ps(int c, int a, int b) {
    if (!emu_shapes(c, a, b)) return;
    for (int m = 0; m < emu.rows[c]; m++)
        for (int n = 0; n < emu.colsb[c] / 4; n++) {
            float even = 0.0f, odd = 0.0f, acc;
            for (int k = 0; k < emu.colsb[a] / 4; k++) {
                even = emu_fma(emu_bf16(emu.data[a][m] + 4 * k), emu_bf16(emu.data[b][k] + 4 * n), even);
                odd = emu_fma(emu_bf16(emu.data[a][m] + 4 * k + 2), emu_bf16(emu.data[b][k] + 4 * n + 2), odd);
            }
            memcpy(&acc, emu.data[c][m] + 4 * n, 4);
            acc = emu_add(acc, emu_add(even, odd));
            memcpy(emu.data[c][m] + 4 * n, &acc, 4);
        }
}

#undef _tile_loadconfig
#undef _tile_release
#undef _tile_zero
#undef _tile_loadd
#undef _tile_stored
#undef _tile_dpbssd
#undef _tile_dpbf16ps
#define _tile_loadconfig(p) emu_loadconfig(p)
#define _tile_release() emu_release()
#define _tile_zero(t) emu_zero(t)
#define _tile_loadd(t, base, stride) emu_loadd(t, base, stride)
#define _tile_stored(t, base, stride) emu_stored(t, base, stride)
#define _tile_dpbssd(c, a, b) emu_dpbssd(c, a, b)
#define _tile_dpbf16ps(c, a, b) emu_dpbf16ps(c, a, b)

#endif
