/* Scalar reference of the integer weights x q8 activations (act_precision
 * "int8"): exact integer block sums folded into one float chain per dot
 * (int8, int4, fp4), or into 8 lanes per dot (the K-quants), as kernels.h
 * states. This file IS that part of the arithmetic contract; every SIMD
 * variant must return exactly what these loops return. Compiled without
 * any -m flag. */
#include "kernels.h"

#include <math.h>

static void gemm_int8_q8_ref(const cism_mat *W, size_t r0, size_t r1, const cism_act *A,
                             size_t T, float *Y, size_t ldy) {
    const size_t n = W->cols, blocks = cism_div_up(n, 32);
    for (size_t r = r0; r < r1; r++) {
        const int8_t *w = (const int8_t *)W->codes + r * W->row_bytes;
        for (size_t t = 0; t < T; t++) {
            const int8_t *a = A->q8 + t * A->ldq;
            const float *as = A->qscale + t * A->ldqs;
            float acc = 0.0f;
            for (size_t b = 0; b < blocks; b++) {
                int32_t s = 0; /* exact: |s| <= 32 * 127 * 127 */
                for (size_t e = 32 * b; e < 32 * b + 32 && e < n; e++) s += (int32_t)w[e] * a[e];
                acc = fmaf((float)s, as[b], acc);
            }
            Y[t * ldy + r] = acc * W->scales[r];
        }
    }
}

static void gemm_int4_q8_ref(const cism_mat *W, size_t r0, size_t r1, const cism_act *A,
                             size_t T, float *Y, size_t ldy) {
    const size_t n = W->cols, blocks = cism_div_up(n, 32);
    for (size_t r = r0; r < r1; r++) {
        const uint8_t *row = (const uint8_t *)W->codes + r * W->row_bytes;
        for (size_t t = 0; t < T; t++) {
            const int8_t *a = A->q8 + t * A->ldq;
            const float *as = A->qscale + t * A->ldqs;
            float acc = 0.0f;
            for (size_t b = 0; b < blocks; b++) {
                int32_t s = 0; /* exact: |s| <= 32 * 8 * 127; activations past n are zero */
                for (size_t i = 0; i < 16; i++) {
                    const uint8_t byte = row[b * 16 + i];
                    s += ((byte & 15) - 8) * a[b * 32 + i] + ((byte >> 4) - 8) * a[b * 32 + 16 + i];
                }
                acc = fmaf((float)s, cism_int4_scale(row, W->scale_offset, b) * as[b], acc);
            }
            Y[t * ldy + r] = acc;
        }
    }
}

static void gemm_fp4_q8_ref(const cism_mat *W, size_t r0, size_t r1, const cism_act *A,
                            size_t T, float *Y, size_t ldy) {
    const size_t n = W->cols, blocks = cism_div_up(n, 16);
    for (size_t r = r0; r < r1; r++) {
        const uint8_t *row = (const uint8_t *)W->codes + r * W->row_bytes;
        const uint8_t *sb = row + W->scale_offset;
        for (size_t t = 0; t < T; t++) {
            const int8_t *a = A->q8 + t * A->ldq;
            const float *as = A->qscale + t * A->ldqs;
            float acc = 0.0f;
            for (size_t b = 0; b < blocks; b++) {
                int32_t s = 0; /* exact: |s| <= 16 * 12 * 127 */
                for (size_t e = b * 16; e < b * 16 + 16 && e < n; e++) {
                    const int code = (e % 2) ? (row[e / 2] >> 4) : (row[e / 2] & 15);
                    s += cism_e2m1_x2[code] * a[e];
                }
                acc = fmaf((float)s, (cism_e4m3_to_f32(sb[b]) * 0.5f) * as[b / 2], acc);
            }
            Y[t * ldy + r] = acc;
        }
    }
}

/* ---- ggml K-quants (q4_k, q6_k) x q8 activations ----
 *
 * The canonical order (kernels.h): a dot keeps 8 float lanes; lane j folds
 * in sub-block j (Q4_K) or run j (Q6_K) of each super-block, super-blocks
 * in order, and cism_reduce8 adds the lanes at the end. Inside a 32-element
 * block every sum is an exact integer; per block and lane
 *   q4_k: acc_j = fma(sc_j * isum, d * ascale_b, acc_j), then
 *         acc_j = fma(m_j * asum, -(dmin * ascale_b), acc_j)
 *   q6_k: acc_j = fma(sc_lo * isum_lo + sc_hi * isum_hi, d * ascale_b, acc_j)
 * with isum over q (Q4_K, 0..15) or code - 32 (Q6_K, per 16 elements) times
 * the activations, asum the activations' own sum. SIMD decode keeps a
 * dot's 8 lanes in one ymm: the scales of a super-block unpack straight
 * into those lanes, so nothing is transposed, and a lane's chain advances
 * once per 256 elements (the AVX-512 prefill kernel keeps a vector per
 * lane, 16 tokens wide). */
static void gemm_q4k_q8_ref(const cism_mat *W, size_t r0, size_t r1, const cism_act *A, size_t T,
                            float *Y, size_t ldy) {
    const size_t sblocks = W->cols / CISM_QK_K;
    for (size_t r = r0; r < r1; r++) {
        const uint8_t *row = (const uint8_t *)W->codes + r * W->row_bytes;
        for (size_t t = 0; t < T; t++) {
            const int8_t *a = A->q8 + t * A->ldq;
            const float *as = A->qscale + t * A->ldqs;
            float acc[8] = {0};
            for (size_t s = 0; s < sblocks; s++) {
                const uint8_t *blk = row + s * CISM_Q4_K_BYTES;
                const float d = cism_ggml_half(blk + CISM_Q4_K_D), dmin = cism_ggml_half(blk + CISM_Q4_K_DMIN);
                for (int j = 0; j < 8; j++) {
                    const uint8_t *q = blk + CISM_Q4_K_QS + 32 * (j / 2);
                    const int8_t *x = a + CISM_QK_K * s + 32 * j;
                    int sc, m;
                    cism_ggml_scale_min_k4(blk + CISM_Q4_K_SCALES, j, &sc, &m);
                    int32_t isum = 0, asum = 0; /* |isum| <= 32 * 15 * 127 */
                    for (int l = 0; l < 32; l++) {
                        isum += ((q[l] >> (4 * (j % 2))) & 15) * x[l];
                        asum += x[l];
                    }
                    const float ascale = as[8 * s + j];
                    acc[j] = fmaf((float)(sc * isum), d * ascale, acc[j]);
                    acc[j] = fmaf((float)(m * asum), -(dmin * ascale), acc[j]);
                }
            }
            Y[t * ldy + r] = cism_reduce8(acc);
        }
    }
}

static void gemm_q6k_q8_ref(const cism_mat *W, size_t r0, size_t r1, const cism_act *A, size_t T,
                            float *Y, size_t ldy) {
    const size_t sblocks = W->cols / CISM_QK_K;
    for (size_t r = r0; r < r1; r++) {
        const uint8_t *row = (const uint8_t *)W->codes + r * W->row_bytes;
        for (size_t t = 0; t < T; t++) {
            const int8_t *a = A->q8 + t * A->ldq;
            const float *as = A->qscale + t * A->ldqs;
            float acc[8] = {0};
            for (size_t s = 0; s < sblocks; s++) {
                const uint8_t *blk = row + s * CISM_Q6_K_BYTES;
                const float d = cism_ggml_half(blk + CISM_Q6_K_D);
                for (int g = 0; g < 8; g++) {
                    const int8_t *x = a + CISM_QK_K * s + 32 * g;
                    int32_t half[2] = {0, 0}; /* |half| <= 16 * 32 * 127 */
                    for (int l = 0; l < 32; l++) half[l / 16] += (cism_q6k_code(blk, g, l) - 32) * x[l];
                    const int32_t isum = (int8_t)blk[CISM_Q6_K_SCALES + 2 * g] * half[0] +
                                         (int8_t)blk[CISM_Q6_K_SCALES + 2 * g + 1] * half[1];
                    acc[g] = fmaf((float)isum, d * as[8 * s + g], acc[g]);
                }
            }
            Y[t * ldy + r] = cism_reduce8(acc);
        }
    }
}

void cism_fill_gemm_q8_ref(cism_kernels *k) {
    k->gemm_int8_q8 = gemm_int8_q8_ref;
    k->gemm_int4_q8 = gemm_int4_q8_ref;
    k->gemm_fp4_q8 = gemm_fp4_q8_ref;
    k->gemm_q4k_q8 = gemm_q4k_q8_ref;
    k->gemm_q6k_q8 = gemm_q6k_q8_ref;
    k->name_gemm_q = "ref";
}
