/* Scalar reference of the attention kernels: the canonical dot (kernels.h)
 * of a query with a key (dot, scores16 over key tiles) and the weighted
 * sums of values as fma chains over the keys in order (axpy, axpy_tile),
 * over fp32 or binary16 caches. This file IS that part of the arithmetic
 * contract; every SIMD variant must return exactly what these loops
 * return. Compiled without any -m flag. */
#include "kernels.h"

#include <math.h>

static float dot_ref(const float *a, const float *b, size_t n) {
    float acc[16] = {0};
    for (size_t i = 0; i < n; i++) acc[i % 16] = fmaf(a[i], b[i], acc[i % 16]);
    return cism_reduce16(acc);
}

static void axpy_ref(float a, const float *x, float *y, size_t n) {
    for (size_t i = 0; i < n; i++) y[i] = fmaf(a, x[i], y[i]);
}

static void axpy_tile_ref(const float *P, size_t ldp, size_t nq, const float *V, size_t ldv,
                          size_t nk, float *O, size_t ldo, size_t n) {
    for (size_t q = 0; q < nq; q++)
        for (size_t k = 0; k < nk; k++) axpy_ref(P[q * ldp + k], V + k * ldv, O + q * ldo, n);
}

static void scores16_ref(const float *Q, size_t ldq, size_t nq, const float *Kt, size_t hd, float *S,
                         size_t lds, size_t nk) {
    for (size_t i = 0; i < nq; i++)
        for (size_t j = 0; j < nk; j++) {
            float acc[16] = {0};
            for (size_t e = 0; e < hd; e++) acc[e % 16] = fmaf(Kt[16 * e + j], Q[i * ldq + e], acc[e % 16]);
            S[i * lds + j] = cism_reduce16(acc);
        }
}

static void scores16_h_ref(const float *Q, size_t ldq, size_t nq, const uint16_t *Kt, size_t hd, float *S,
                           size_t lds, size_t nk) {
    for (size_t i = 0; i < nq; i++)
        for (size_t j = 0; j < nk; j++) {
            float acc[16] = {0};
            for (size_t e = 0; e < hd; e++)
                acc[e % 16] = fmaf(cism_fp16_to_f32(Kt[16 * e + j]), Q[i * ldq + e], acc[e % 16]);
            S[i * lds + j] = cism_reduce16(acc);
        }
}

static void axpy_tile_h_ref(const float *P, size_t ldp, size_t nq, const uint16_t *V, size_t ldv, size_t nk,
                            float *O, size_t ldo, size_t n) {
    for (size_t q = 0; q < nq; q++)
        for (size_t k = 0; k < nk; k++)
            for (size_t i = 0; i < n; i++)
                O[q * ldo + i] = fmaf(P[q * ldp + k], cism_fp16_to_f32(V[k * ldv + i]), O[q * ldo + i]);
}

void cism_fill_attn_ref(cism_kernels *k) {
    k->dot = dot_ref;
    k->axpy = axpy_ref;
    k->axpy_tile = axpy_tile_ref;
    k->scores16 = scores16_ref;
    k->scores16_h = scores16_h_ref;
    k->axpy_tile_h = axpy_tile_h_ref;
    k->name_dot = "ref";
}
