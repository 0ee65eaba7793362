/* AVX512-BF16 prompt attention: the opt-in bf16 prefill precision's scores
 * and weighted sums (scores16_bf16(_h), axpy_tile_bf16(_h); kernels.h has
 * the contract). Installed with the VDPBF16PS gemm, on CPUs that have
 * AVX512-BF16 (the AMX ones included); NULL elsewhere, where prompt
 * attention stays canonical.
 *
 * Not the canonical arithmetic: queries, keys, softmax weights and values
 * are rounded to bfloat16 (nearest even, by the conversion instruction) and
 * VDPBF16PS adds each pair's two products to an fp32 sum. What makes the
 * bits independent of how a prompt is split (chunks, query tiles, KV pages,
 * threads): a score is one chain over the head's element pairs in order,
 * from zero, for that query and key alone (keys in lanes, queries in
 * registers); a weighted sum is one chain per output element over the key
 * pairs (0, 1), (2, 3), ... in order, continued through O between calls, a
 * last unpaired key paired with a zero weight and a zero value (the callers
 * start every call at an even position, so each query's chain is the same
 * pairs whoever cuts it). */
#include "simd_avx512.h"

/* 16 lanes' (even, odd) elements as 16 bf16 pairs, lane j's pair in dword j
 * (low half even, as VDPBF16PS reads it). */
ALWAYS_INLINE __m512i pairs16(__m512 even, __m512 odd) {
    const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                         23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(idx, (__m512i)_mm512_cvtne2ps_pbh(odd, even));
}

/* n floats (masked: zero past n, n may be 0) rounded to bf16, 32 at x. */
ALWAYS_INLINE void round32(const float *x, size_t n, uint16_t *out) {
    const __mmask16 m0 = n >= 16 ? 0xffff : (__mmask16)((1u << n) - 1);
    const __mmask16 m1 = n >= 32 ? 0xffff : n > 16 ? (__mmask16)((1u << (n - 16)) - 1) : 0;
    const __m512 lo = _mm512_maskz_loadu_ps(m0, x), hi = _mm512_maskz_loadu_ps(m1, x + 16);
    _mm512_storeu_si512((void *)out, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}

ALWAYS_INLINE __m512 key_row(const int H, const void *Kt, size_t e, size_t hd) {
    if (e >= hd) return _mm512_setzero_ps();
    return H ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)Kt + 16 * e)))
             : _mm512_loadu_ps((const float *)Kt + 16 * e);
}

#define SB_PAIRS 64 /* element pairs of the queries rounded at a time */
#define SB_Q 16     /* queries per pass: 16 accumulators */

/* QN queries against one key tile: per query, for each element pair p in
 * order, acc = VDPBF16PS(acc, (q[2p], q[2p+1]), (k[2p], k[2p+1])) per key lane. */
ALWAYS_INLINE void scores_pass(const int H, const int QN, const float *Q, size_t ldq, const void *Kt, size_t hd,
                               float *S, size_t lds, __mmask16 m) {
    __attribute__((aligned(64))) uint32_t qb[SB_Q][SB_PAIRS];
    __m512 acc[SB_Q];
    for (int q = 0; q < QN; q++) acc[q] = _mm512_setzero_ps();
    for (size_t p0 = 0; 2 * p0 < hd; p0 += SB_PAIRS) {
        const size_t np = (hd + 1) / 2 - p0 < SB_PAIRS ? (hd + 1) / 2 - p0 : SB_PAIRS;
        for (int q = 0; q < QN; q++)
            for (size_t e = 0; e < 2 * np; e += 32)
                round32(Q + q * ldq + 2 * p0 + e, hd - 2 * p0 - e > 2 * np - e ? 2 * np - e : hd - 2 * p0 - e,
                        (uint16_t *)qb[q] + e);
        for (size_t p = 0; p < np; p++) {
            const size_t e = 2 * (p0 + p);
            const __m512bh k = (__m512bh)pairs16(key_row(H, Kt, e, hd), key_row(H, Kt, e + 1, hd));
            for (int q = 0; q < QN; q++)
                acc[q] = _mm512_dpbf16_ps(acc[q], (__m512bh)_mm512_set1_epi32((int)qb[q][p]), k);
        }
    }
    for (int q = 0; q < QN; q++) _mm512_mask_storeu_ps(S + q * lds, m, acc[q]);
}

ALWAYS_INLINE void scores_tpl(const int H, const float *Q, size_t ldq, size_t nq, const void *Kt, size_t hd,
                              float *S, size_t lds, size_t nk) {
    const __mmask16 m = nk >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << nk) - 1);
    for (size_t i = 0; i < nq; i += SB_Q) {
        const float *Qi = Q + i * ldq;
        float *Si = S + i * lds;
        switch (nq - i < SB_Q ? nq - i : SB_Q) {
#define SB_CASE(N) case N: scores_pass(H, N, Qi, ldq, Kt, hd, Si, lds, m); break;
        SB_CASE(16) SB_CASE(15) SB_CASE(14) SB_CASE(13) SB_CASE(12) SB_CASE(11) SB_CASE(10) SB_CASE(9)
        SB_CASE(8) SB_CASE(7) SB_CASE(6) SB_CASE(5) SB_CASE(4) SB_CASE(3) SB_CASE(2) SB_CASE(1)
#undef SB_CASE
        default: break;
        }
    }
}

static void scores16_bf16_avx512(const float *Q, size_t ldq, size_t nq, const float *Kt, size_t hd, float *S,
                                 size_t lds, size_t nk) {
    scores_tpl(0, Q, ldq, nq, Kt, hd, S, lds, nk);
}

static void scores16_bf16_h_avx512(const float *Q, size_t ldq, size_t nq, const uint16_t *Kt, size_t hd,
                                   float *S, size_t lds, size_t nk) {
    scores_tpl(1, Q, ldq, nq, Kt, hd, S, lds, nk);
}

#define PV_Q 6      /* queries per pass */
#define PV_V 4      /* 16-column vectors per pass: 24 accumulators */
#define PV_PAIRS 32 /* key pairs rounded at a time (weights and values) */
#define PV_COLS 256 /* value columns rounded at a time */

ALWAYS_INLINE __m512 value_row(const int H, const void *V, size_t ldv, size_t k, size_t nk, size_t c,
                               __mmask16 m) {
    if (k >= nk) return _mm512_setzero_ps();
    return H ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, (const uint16_t *)V + k * ldv + c))
             : _mm512_maskz_loadu_ps(m, (const float *)V + k * ldv + c);
}

/* QN queries x 16 * PV_V columns from c0 (of the cn in vb) over np key
 * pairs: pb holds each query's weight pairs (PV_PAIRS dwords a query), vb
 * the value pairs (pair p, column c: dword p * PV_COLS + c). O is loaded
 * and stored around the pass (exact), so the chain continues. */
ALWAYS_INLINE void pv_pass(const int QN, const uint32_t *pb, const uint32_t *vb, size_t np, float *O, size_t ldo,
                           size_t c0, size_t cn) {
    __m512 o[PV_Q][PV_V];
    __mmask16 m[PV_V];
    for (int v = 0; v < PV_V; v++) {
        const size_t c = c0 + 16 * v;
        m[v] = c >= cn ? 0 : cn - c >= 16 ? 0xffff : (__mmask16)((1u << (cn - c)) - 1);
    }
    for (int q = 0; q < QN; q++)
        for (int v = 0; v < PV_V; v++) o[q][v] = _mm512_maskz_loadu_ps(m[v], O + q * ldo + c0 + 16 * v);
    for (size_t p = 0; p < np; p++) {
        __m512bh x[PV_V];
        for (int v = 0; v < PV_V; v++) x[v] = (__m512bh)_mm512_load_si512((const void *)(vb + p * PV_COLS + c0 + 16 * v));
        for (int q = 0; q < QN; q++) {
            const __m512bh a = (__m512bh)_mm512_set1_epi32((int)pb[q * PV_PAIRS + p]);
            for (int v = 0; v < PV_V; v++) o[q][v] = _mm512_dpbf16_ps(o[q][v], a, x[v]);
        }
    }
    for (int q = 0; q < QN; q++)
        for (int v = 0; v < PV_V; v++) _mm512_mask_storeu_ps(O + q * ldo + c0 + 16 * v, m[v], o[q][v]);
}

/* The keys by PV_PAIRS pairs and the columns by PV_COLS: each value pair
 * rounded once for all the queries, each query's weights once per block. */
ALWAYS_INLINE void pv_tpl(const int H, const float *P, size_t ldp, size_t nq, const void *V, size_t ldv, size_t nk,
                          float *O, size_t ldo, size_t n) {
    __attribute__((aligned(64))) uint32_t vb[PV_PAIRS * PV_COLS];
    __attribute__((aligned(64))) uint32_t pb[PV_Q * PV_PAIRS];
    for (size_t k0 = 0; k0 < nk; k0 += 2 * PV_PAIRS) {
        const size_t kn = nk - k0 < 2 * PV_PAIRS ? nk - k0 : 2 * PV_PAIRS, np = (kn + 1) / 2;
        for (size_t cc = 0; cc < n; cc += PV_COLS) {
            const size_t cn = n - cc < PV_COLS ? n - cc : PV_COLS;
            for (size_t p = 0; p < np; p++)
                for (size_t c = 0; c < cn; c += 16) {
                    const __mmask16 m = cn - c >= 16 ? 0xffff : (__mmask16)((1u << (cn - c)) - 1);
                    const size_t k = k0 + 2 * p;
                    _mm512_store_si512((void *)(vb + p * PV_COLS + c),
                                       pairs16(value_row(H, V, ldv, k, nk, cc + c, m),
                                               value_row(H, V, ldv, k + 1, nk, cc + c, m)));
                }
            for (size_t q = 0; q < nq; q += PV_Q) {
                const size_t qn = nq - q < PV_Q ? nq - q : PV_Q;
                for (size_t i = 0; i < qn; i++)
                    for (size_t e = 0; e < kn; e += 32)
                        round32(P + (q + i) * ldp + k0 + e, kn - e, (uint16_t *)(pb + i * PV_PAIRS) + e);
                float *Oq = O + q * ldo + cc;
                for (size_t c0 = 0; c0 < cn; c0 += 16 * PV_V) {
                    switch (qn) {
#define PV_CASE(N) case N: pv_pass(N, pb, vb, np, Oq, ldo, c0, cn); break;
                    PV_CASE(6) PV_CASE(5) PV_CASE(4) PV_CASE(3) PV_CASE(2) PV_CASE(1)
#undef PV_CASE
                    default: break;
                    }
                }
            }
        }
    }
}

static void axpy_tile_bf16_avx512(const float *P, size_t ldp, size_t nq, const float *V, size_t ldv, size_t nk,
                                  float *O, size_t ldo, size_t n) {
    pv_tpl(0, P, ldp, nq, V, ldv, nk, O, ldo, n);
}

static void axpy_tile_bf16_h_avx512(const float *P, size_t ldp, size_t nq, const uint16_t *V, size_t ldv,
                                    size_t nk, float *O, size_t ldo, size_t n) {
    pv_tpl(1, P, ldp, nq, V, ldv, nk, O, ldo, n);
}

void cism_fill_attn_avx512bf16(cism_kernels *k) {
    k->scores16_bf16 = scores16_bf16_avx512;
    k->scores16_bf16_h = scores16_bf16_h_avx512;
    k->axpy_tile_bf16 = axpy_tile_bf16_avx512;
    k->axpy_tile_bf16_h = axpy_tile_bf16_h_avx512;
    k->name_attn_bf16 = "avx512bf16";
}
