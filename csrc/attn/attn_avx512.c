/* AVX-512 (F/BW/VL/DQ) attention kernels: dot, axpy, axpy_tile(_h) and
 * scores16(_h), bit for bit attn_ref.c (the canonical dot of kernels.h;
 * every weighted sum one fma chain over the keys in order). */
#include "simd_avx512.h"

static float dot_avx512(const float *a, const float *b, size_t n) {
    __m512 acc = _mm512_setzero_ps();
    size_t i = 0;
    for (; i + 16 <= n; i += 16)
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    if (i < n) {
        const __mmask16 m = (__mmask16)((1u << (n - i)) - 1);
        acc = _mm512_mask3_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i), acc, m);
    }
    return hsum(acc);
}

static void axpy_avx512(float a, const float *x, float *y, size_t n) {
    const __m512 va = _mm512_set1_ps(a);
    size_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(y + i, _mm512_fmadd_ps(va, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
    if (i < n) {
        const __mmask16 m = (__mmask16)((1u << (n - i)) - 1);
        const __m512 r = _mm512_fmadd_ps(va, _mm512_maskz_loadu_ps(m, x + i), _mm512_maskz_loadu_ps(m, y + i));
        _mm512_mask_storeu_ps(y + i, m, r);
    }
}

/* axpy_tile's passes: AXQ queries x AXV * 16 columns, 24 accumulators
 * (+ 4 value vectors and a broadcast of the 32 zmm). Against 4 x 4, in
 * one process (tiles of 16 queries, 2048 keys, head size 64): 4% faster
 * for fp32 values, 11% for binary16 (each widened value serves 6 queries,
 * not 4); 8 x 2 and 12 x 2 were in between, 8 x 3 slower. */
#define AXQ 6
#define AXV 4
/* Up to QN queries x 16 * AXV columns per pass: QN * AXV zmm of O stay in
 * registers while the keys go by in order, each value vector loaded (and
 * widened, H: binary16 values) once for all queries of the pass. Every
 * output element is still one fma chain over the keys in order. */
ALWAYS_INLINE void axpy_pass_avx512(const int H, const int QN, const float *P, size_t ldp,
                                    const void *V, size_t ldv, size_t nk, float *O, size_t ldo, size_t c0,
                                    size_t n) {
    __m512 o[AXQ][AXV];
    __mmask16 m[AXV];
    for (int v = 0; v < AXV; v++) {
        const size_t c = c0 + 16 * v;
        m[v] = c >= n ? 0 : n - c >= 16 ? 0xffff : (__mmask16)((1u << (n - c)) - 1);
    }
    for (int q = 0; q < QN; q++)
        for (int v = 0; v < AXV; v++) o[q][v] = _mm512_maskz_loadu_ps(m[v], O + q * ldo + c0 + 16 * v);
    for (size_t k = 0; k < nk; k++) {
        __m512 x[AXV];
        for (int v = 0; v < AXV; v++)
            x[v] = H ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m[v], (const uint16_t *)V + k * ldv + c0 + 16 * v))
                     : _mm512_maskz_loadu_ps(m[v], (const float *)V + k * ldv + c0 + 16 * v);
        for (int q = 0; q < QN; q++) {
            const __m512 a = _mm512_set1_ps(P[q * ldp + k]);
            for (int v = 0; v < AXV; v++) o[q][v] = _mm512_fmadd_ps(a, x[v], o[q][v]);
        }
    }
    for (int q = 0; q < QN; q++)
        for (int v = 0; v < AXV; v++) _mm512_mask_storeu_ps(O + q * ldo + c0 + 16 * v, m[v], o[q][v]);
}

ALWAYS_INLINE void axpy_tile_tpl(const int H, const float *P, size_t ldp, size_t nq, const void *V, size_t ldv,
                                 size_t nk, float *O, size_t ldo, size_t n) {
    for (size_t q = 0; q < nq; q += AXQ) {
        const float *Pq = P + q * ldp;
        float *Oq = O + q * ldo;
        for (size_t c0 = 0; c0 < n; c0 += 16 * AXV) {
            switch (nq - q) {
            case 1: axpy_pass_avx512(H, 1, Pq, ldp, V, ldv, nk, Oq, ldo, c0, n); break;
            case 2: axpy_pass_avx512(H, 2, Pq, ldp, V, ldv, nk, Oq, ldo, c0, n); break;
            case 3: axpy_pass_avx512(H, 3, Pq, ldp, V, ldv, nk, Oq, ldo, c0, n); break;
            case 4: axpy_pass_avx512(H, 4, Pq, ldp, V, ldv, nk, Oq, ldo, c0, n); break;
            case 5: axpy_pass_avx512(H, 5, Pq, ldp, V, ldv, nk, Oq, ldo, c0, n); break;
            default: axpy_pass_avx512(H, AXQ, Pq, ldp, V, ldv, nk, Oq, ldo, c0, n); break;
            }
        }
    }
}

static void axpy_tile_avx512(const float *P, size_t ldp, size_t nq, const float *V, size_t ldv,
                             size_t nk, float *O, size_t ldo, size_t n) {
    axpy_tile_tpl(0, P, ldp, nq, V, ldv, nk, O, ldo, n);
}

static void axpy_tile_h_avx512(const float *P, size_t ldp, size_t nq, const uint16_t *V, size_t ldv,
                               size_t nk, float *O, size_t ldo, size_t n) {
    axpy_tile_tpl(1, P, ldp, nq, V, ldv, nk, O, ldo, n);
}

/* Scores of nq queries against a key tile (kernels.h): keys in lanes, one
 * accumulator vector per lane of the canonical dot (element e goes to
 * acc[e % 16]), the reduction tree as vertical adds. */
ALWAYS_INLINE __m512 key_row16(const int H, const void *Kt, size_t e) {
    return H ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)Kt + 16 * e)))
             : _mm512_loadu_ps((const float *)Kt + 16 * e);
}

/* QN <= 4 queries against a key tile, the dot's 16 lanes in four passes
 * of four (lanes 4p..4p+3 of the QN queries: 4 QN accumulators), so each
 * key row loaded serves QN queries, not one. The passes go 0, 2, 1, 3, and
 * the reduction tree's first level (lane l plus lane l + 8) is taken as
 * soon as both of its lanes are done, the rest at the end: the same
 * additions in the same order as for one query alone. */
ALWAYS_INLINE void scores16_qn(const int H, const int QN, const float *Q, size_t ldq, const void *Kt, size_t hd,
                               float *S, size_t lds, __mmask16 m) {
    __attribute__((aligned(64))) float part[2][4][4][16]; /* [pass pair][query][lane][key] */
    static const int order[4] = {0, 2, 1, 3};
    for (int pi = 0; pi < 4; pi++) {
        const int p = order[pi];
        __m512 acc[4][4];
        for (int q = 0; q < QN; q++)
            for (int j = 0; j < 4; j++) acc[q][j] = _mm512_setzero_ps();
        size_t e0 = 0;
        for (; e0 + 16 <= hd; e0 += 16)
            for (int j = 0; j < 4; j++) {
                const size_t e = e0 + 4 * (size_t)p + (size_t)j;
                const __m512 k = key_row16(H, Kt, e);
                for (int q = 0; q < QN; q++) acc[q][j] = _mm512_fmadd_ps(_mm512_set1_ps(Q[q * ldq + e]), k, acc[q][j]);
            }
        for (int j = 0; j < 4; j++) {
            const size_t e = e0 + 4 * (size_t)p + (size_t)j;
            if (e >= hd) break;
            const __m512 k = key_row16(H, Kt, e);
            for (int q = 0; q < QN; q++) acc[q][j] = _mm512_fmadd_ps(_mm512_set1_ps(Q[q * ldq + e]), k, acc[q][j]);
        }
        /* passes 0 and 1 (lanes 0-7) wait for 2 and 3 (lanes 8-15) */
        float (*half)[4][16] = part[p & 1];
        for (int q = 0; q < QN; q++)
            for (int j = 0; j < 4; j++) {
                if (p < 2) _mm512_store_ps(half[q][j], acc[q][j]);
                else _mm512_store_ps(half[q][j], _mm512_add_ps(_mm512_load_ps(half[q][j]), acc[q][j]));
            }
    }
    /* part[0][q][l] = lanes l + (l + 8), part[1][q][l] = lanes (l + 4) + (l + 12) */
    for (int q = 0; q < QN; q++) {
        __m512 c[4];
        for (int l = 0; l < 4; l++) c[l] = _mm512_add_ps(_mm512_load_ps(part[0][q][l]), _mm512_load_ps(part[1][q][l]));
        _mm512_mask_storeu_ps(S + q * lds, m, _mm512_add_ps(_mm512_add_ps(c[0], c[2]), _mm512_add_ps(c[1], c[3])));
    }
}

ALWAYS_INLINE void scores16_tpl(const int H, const float *Q, size_t ldq, size_t nq, const void *Kt, size_t hd,
                                float *S, size_t lds, size_t nk) {
    const __mmask16 m = nk >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << nk) - 1);
    size_t i = 0;
    for (; i + 4 <= nq; i += 4) scores16_qn(H, 4, Q + i * ldq, ldq, Kt, hd, S + i * lds, lds, m);
    /* binary16 keys: two or three left (a decode token's KV group of 2 or
     * 3 heads, say) share each widened key row too (one process, 128 key
     * tiles: +32-68%); fp32 keys run them one by one, which was as fast or
     * faster there (the passes' partial sums weigh more than the loads
     * they save, presumably, when no widening is shared) */
    if (H && nq - i == 3) {
        scores16_qn(H, 3, Q + i * ldq, ldq, Kt, hd, S + i * lds, lds, m);
        return;
    }
    if (H && nq - i == 2) {
        scores16_qn(H, 2, Q + i * ldq, ldq, Kt, hd, S + i * lds, lds, m);
        return;
    }
    for (; i < nq; i++) {
        const float *q = Q + i * ldq;
        __m512 acc[16];
        for (int l = 0; l < 16; l++) acc[l] = _mm512_setzero_ps();
        size_t e = 0;
        for (; e + 16 <= hd; e += 16)
            for (int l = 0; l < 16; l++)
                acc[l] = _mm512_fmadd_ps(_mm512_set1_ps(q[e + l]), key_row16(H, Kt, e + l), acc[l]);
        for (int l = 0; e + l < hd; l++)
            acc[l] = _mm512_fmadd_ps(_mm512_set1_ps(q[e + l]), key_row16(H, Kt, e + l), acc[l]);
        for (int l = 0; l < 8; l++) acc[l] = _mm512_add_ps(acc[l], acc[l + 8]);
        for (int l = 0; l < 4; l++) acc[l] = _mm512_add_ps(acc[l], acc[l + 4]);
        _mm512_mask_storeu_ps(S + i * lds, m, _mm512_add_ps(_mm512_add_ps(acc[0], acc[2]), _mm512_add_ps(acc[1], acc[3])));
    }
}

static void scores16_avx512(const float *Q, size_t ldq, size_t nq, const float *Kt, size_t hd, float *S,
                            size_t lds, size_t nk) {
    scores16_tpl(0, Q, ldq, nq, Kt, hd, S, lds, nk);
}

static void scores16_h_avx512(const float *Q, size_t ldq, size_t nq, const uint16_t *Kt, size_t hd, float *S,
                              size_t lds, size_t nk) {
    scores16_tpl(1, Q, ldq, nq, Kt, hd, S, lds, nk);
}

void cism_fill_attn_avx512(cism_kernels *k) {
    k->dot = dot_avx512;
    k->axpy = axpy_avx512;
    k->axpy_tile = axpy_tile_avx512;
    k->scores16 = scores16_avx512;
    k->scores16_h = scores16_h_avx512;
    k->axpy_tile_h = axpy_tile_h_avx512;
    k->name_dot = "avx512";
}
