/* AVX2 (+FMA, F16C) attention kernels: dot, axpy, axpy_tile(_h) and
 * scores16(_h), bit for bit attn_ref.c. The canonical dot's 16 lanes are
 * two ymm (lanes 0-7 and 8-15); tails run the reference's scalar code. */
#include "simd_avx2.h"

#include <math.h>

static float dot_avx2(const float *a, const float *b, size_t n) {
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        lo = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), lo);
        hi = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), hi);
    }
    float acc[16];
    _mm256_storeu_ps(acc, lo);
    _mm256_storeu_ps(acc + 8, hi);
    for (; i < n; i++) acc[i % 16] = fmaf(a[i], b[i], acc[i % 16]); /* the reference's tail */
    return cism_reduce16(acc);
}

static void axpy_avx2(float a, const float *x, float *y, size_t n) {
    const __m256 va = _mm256_set1_ps(a);
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; i++) y[i] = fmaf(a, x[i], y[i]);
}

/* 8 binary16 values widened exactly; past `left` (0..7 valid) zeros. */
ALWAYS_INLINE __m256 load8_h(const uint16_t *p, long left) {
    if (left >= 8) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    uint16_t t[8] = {0};
    for (long i = 0; i < left; i++) t[i] = p[i];
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)t));
}

/* axpy_tile's passes: AXQ queries x 8 * AXV columns, 12 accumulators (+ 2
 * value vectors and a broadcast: 15 of the 16 ymm). The 4 x 4 passes
 * before (16 accumulators) spilled. In one process (16 queries, 512 or
 * 2048 keys, head size 64 or 128): 6 x 2 against 4 x 4 +12-36% for fp32
 * values, -10% to +22% for binary16; 4 x 2, 2 x 4 and 3 x 4 no better. */
#define AXQ 6
#define AXV 2

/* Up to QN queries x 8 * AXV columns per pass (QN * AXV ymm of O in
 * registers); the last partial vector goes through maskload/maskstore,
 * whose lanes outside the mask read 0 and are not written (H: binary16
 * values, widened). */
ALWAYS_INLINE void axpy_pass_avx2(const int H, const int QN, const float *P, size_t ldp, const void *V,
                                  size_t ldv, size_t nk, float *O, size_t ldo, size_t c0, size_t n) {
    __m256 o[AXQ][AXV];
    __m256i m[AXV];
    for (int v = 0; v < AXV; v++) m[v] = lane_mask((long)n - (long)(c0 + 8 * v));
    for (int q = 0; q < QN; q++)
        for (int v = 0; v < AXV; v++) o[q][v] = _mm256_maskload_ps(O + q * ldo + c0 + 8 * v, m[v]);
    for (size_t k = 0; k < nk; k++) {
        __m256 x[AXV];
        for (int v = 0; v < AXV; v++)
            x[v] = H ? load8_h((const uint16_t *)V + k * ldv + c0 + 8 * v, (long)n - (long)(c0 + 8 * v))
                     : _mm256_maskload_ps((const float *)V + k * ldv + c0 + 8 * v, m[v]);
        for (int q = 0; q < QN; q++) {
            const __m256 a = _mm256_set1_ps(P[q * ldp + k]);
            for (int v = 0; v < AXV; v++) o[q][v] = _mm256_fmadd_ps(a, x[v], o[q][v]);
        }
    }
    for (int q = 0; q < QN; q++)
        for (int v = 0; v < AXV; v++) _mm256_maskstore_ps(O + q * ldo + c0 + 8 * v, m[v], o[q][v]);
}

/* Scores of nq queries against a key tile (kernels.h): keys in lanes, 8 at
 * a time. The lane chains of the canonical dot go in pairs (l, l + 8), whose
 * sum is the tree's first level, so 8 partial sums live at once instead of
 * 16 accumulators; the rest of the tree is vertical adds. Up to four
 * queries go together (scores16_qn). */
ALWAYS_INLINE __m256 key_row8(const int H, const void *Kt, size_t e, size_t h) {
    return H ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)Kt + 16 * e + h)))
             : _mm256_loadu_ps((const float *)Kt + 16 * e + h);
}

/* QN (<= 4) queries at once: each key row loaded serves them all. */
ALWAYS_INLINE void scores16_qn(const int H, const int QN, const float *Q, size_t ldq, const void *Kt, size_t hd,
                               float *S, size_t lds, size_t nk) {
    for (size_t h = 0; h < nk; h += 8) {
        __m256 s8[4][8];
        for (int l = 0; l < 8; l++) {
            __m256 a[4], b[4];
            for (int q = 0; q < QN; q++) a[q] = b[q] = _mm256_setzero_ps();
            /* lane l's chain (a) and lane l + 8's (b) side by side: twice
             * the independent fmas in flight, each chain in its order */
            size_t e = (size_t)l;
            for (; e + 8 < hd; e += 16) {
                const __m256 k0 = key_row8(H, Kt, e, h), k1 = key_row8(H, Kt, e + 8, h);
                for (int q = 0; q < QN; q++) {
                    a[q] = _mm256_fmadd_ps(_mm256_set1_ps(Q[q * ldq + e]), k0, a[q]);
                    b[q] = _mm256_fmadd_ps(_mm256_set1_ps(Q[q * ldq + e + 8]), k1, b[q]);
                }
            }
            if (e < hd) {
                const __m256 k0 = key_row8(H, Kt, e, h);
                for (int q = 0; q < QN; q++) a[q] = _mm256_fmadd_ps(_mm256_set1_ps(Q[q * ldq + e]), k0, a[q]);
            }
            for (int q = 0; q < QN; q++) s8[q][l] = _mm256_add_ps(a[q], b[q]);
        }
        for (int q = 0; q < QN; q++) {
            for (int l = 0; l < 4; l++) s8[q][l] = _mm256_add_ps(s8[q][l], s8[q][l + 4]);
            const __m256 r = _mm256_add_ps(_mm256_add_ps(s8[q][0], s8[q][2]), _mm256_add_ps(s8[q][1], s8[q][3]));
            if (nk - h >= 8) {
                _mm256_storeu_ps(S + q * lds + h, r);
            } else {
                float t[8];
                _mm256_storeu_ps(t, r);
                for (size_t j = 0; j < nk - h; j++) S[q * lds + h + j] = t[j];
            }
        }
    }
}

ALWAYS_INLINE void scores16_tpl(const int H, const float *Q, size_t ldq, size_t nq, const void *Kt, size_t hd,
                                float *S, size_t lds, size_t nk) {
    for (size_t i = 0; i < nq; i += 4) {
        const float *q = Q + i * ldq;
        float *o = S + i * lds;
        switch (nq - i) {
        case 1: scores16_qn(H, 1, q, ldq, Kt, hd, o, lds, nk); break;
        case 2: scores16_qn(H, 2, q, ldq, Kt, hd, o, lds, nk); break;
        case 3: scores16_qn(H, 3, q, ldq, Kt, hd, o, lds, nk); break;
        default: scores16_qn(H, 4, q, ldq, Kt, hd, o, lds, nk); break;
        }
    }
}

static void scores16_avx2(const float *Q, size_t ldq, size_t nq, const float *Kt, size_t hd, float *S,
                          size_t lds, size_t nk) {
    scores16_tpl(0, Q, ldq, nq, Kt, hd, S, lds, nk);
}

static void scores16_h_avx2(const float *Q, size_t ldq, size_t nq, const uint16_t *Kt, size_t hd, float *S,
                            size_t lds, size_t nk) {
    scores16_tpl(1, Q, ldq, nq, Kt, hd, S, lds, nk);
}


ALWAYS_INLINE void axpy_tile_tpl(const int H, const float *P, size_t ldp, size_t nq, const void *V, size_t ldv,
                                 size_t nk, float *O, size_t ldo, size_t n) {
    for (size_t q = 0; q < nq; q += AXQ) {
        const float *Pq = P + q * ldp;
        float *Oq = O + q * ldo;
        for (size_t c0 = 0; c0 < n; c0 += 8 * AXV) {
            switch (nq - q) {
            case 1: axpy_pass_avx2(H, 1, Pq, ldp, V, ldv, nk, Oq, ldo, c0, n); break;
            case 2: axpy_pass_avx2(H, 2, Pq, ldp, V, ldv, nk, Oq, ldo, c0, n); break;
            case 3: axpy_pass_avx2(H, 3, Pq, ldp, V, ldv, nk, Oq, ldo, c0, n); break;
            case 4: axpy_pass_avx2(H, 4, Pq, ldp, V, ldv, nk, Oq, ldo, c0, n); break;
            case 5: axpy_pass_avx2(H, 5, Pq, ldp, V, ldv, nk, Oq, ldo, c0, n); break;
            default: axpy_pass_avx2(H, AXQ, Pq, ldp, V, ldv, nk, Oq, ldo, c0, n); break;
            }
        }
    }
}

static void axpy_tile_avx2(const float *P, size_t ldp, size_t nq, const float *V, size_t ldv,
                           size_t nk, float *O, size_t ldo, size_t n) {
    axpy_tile_tpl(0, P, ldp, nq, V, ldv, nk, O, ldo, n);
}

static void axpy_tile_h_avx2(const float *P, size_t ldp, size_t nq, const uint16_t *V, size_t ldv,
                             size_t nk, float *O, size_t ldo, size_t n) {
    axpy_tile_tpl(1, P, ldp, nq, V, ldv, nk, O, ldo, n);
}


void cism_fill_attn_avx2(cism_kernels *k) {
    k->dot = dot_avx2;
    k->axpy = axpy_avx2;
    k->axpy_tile = axpy_tile_avx2;
    k->scores16 = scores16_avx2;
    k->scores16_h = scores16_h_avx2;
    k->axpy_tile_h = axpy_tile_h_avx2;
    k->name_dot = "avx2";
}
