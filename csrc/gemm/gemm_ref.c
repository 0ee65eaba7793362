/* Scalar reference of the gemm with fp32 activations: products of packed
 * weight rows with activation rows, the canonical 16-lane dot of kernels.h
 * over the weights as cism_dequant_range gives them. This file IS that
 * part of the arithmetic contract; every SIMD variant must return exactly
 * what these loops return. Compiled without any -m flag. */
#include "kernels.h"

#include <math.h>
#include <string.h>

/* The canonical dot's lanes after elements i0..i0+n-1 (i0 a multiple of
 * 16, so element i still goes to lane i % 16). */
static void lanes16(const float *w, const float *x, size_t n, float acc[16]) {
    for (size_t i = 0; i < n; i++) acc[i % 16] = fmaf(w[i], x[i], acc[i % 16]);
}

/* No heap: rows are dequantized REF_CHUNK columns at a time into the stack
 * and met by up to REF_TOKENS tokens' lane accumulators (4 KiB each). */
#define REF_CHUNK 1024
#define REF_TOKENS 64
_Static_assert(REF_CHUNK % 16 == 0, "a chunk keeps every element in its lane");

static void gemm_ref(const cism_mat *W, size_t r0, size_t r1, const cism_act *A, size_t T,
                     float *Y, size_t ldy) {
    float w[REF_CHUNK], acc[REF_TOKENS][16];
    for (size_t r = r0; r < r1; r++) {
        const float row_scale = W->storage == CISM_INT8 ? W->scales[r] : 1.0f;
        for (size_t t0 = 0; t0 < T; t0 += REF_TOKENS) {
            const size_t tn = T - t0 < REF_TOKENS ? T - t0 : REF_TOKENS;
            memset(acc, 0, sizeof acc);
            for (size_t i0 = 0; i0 < W->cols; i0 += REF_CHUNK) {
                const size_t n = W->cols - i0 < REF_CHUNK ? W->cols - i0 : REF_CHUNK;
                cism_dequant_range(W, r, i0, i0 + n, w, 0);
                for (size_t t = 0; t < tn; t++) lanes16(w, A->x + (t0 + t) * A->ldx + i0, n, acc[t]);
            }
            for (size_t t = 0; t < tn; t++) {
                const float d = cism_reduce16(acc[t]);
                Y[(t0 + t) * ldy + r] = W->storage == CISM_INT8 ? d * row_scale : d;
            }
        }
    }
}

void cism_fill_gemm_ref(cism_kernels *k) {
    for (int s = 0; s < CISM_NUM_STORAGES; s++) k->gemm[s] = gemm_ref;
    k->name_gemm = "ref";
}
