/* AVX512-BF16 bf16 gemm: the opt-in "bf16" prefill precision on CPUs that
 * have VDPBF16PS but no AMX tile unit (AMD Zen 4/5, Intel Cooper Lake).
 *
 * NOT the canonical arithmetic of kernels.h, and not the AMX kernel's bits
 * either: the inputs are rounded exactly as there (weights after
 * dequantization and activations to bfloat16, nearest even, by the same
 * conversion instruction), and VDPBF16PS adds each lane's two products to
 * its fp32 accumulator in the order and rounding the instruction defines.
 * What stays true, as for AMX (docs/EXACTNESS.md):
 *   - every (row, token) output depends only on that row and that token:
 *     a lane is one row, a register one token, and the k pairs go by in
 *     one fixed order, so the thread count, the rows' split, the number of
 *     tokens in a call and their order do not change a bit;
 *   - int8 and fp4 weights are exact in bf16; the int8 row scale multiplies
 *     the finished dot.
 *
 * Layout: rows in lanes. Each block of 32 weight rows is dequantized,
 * rounded and transposed into pair vectors once per call (the AMX B-block
 * layout: for k pair p, 16 rows' (w[2p], w[2p+1]) as 16 dwords); each
 * token's k pair is broadcast from the caller's A-tile blocks (pack_bf16).
 * A pass is 32 rows x up to 12 tokens: 24 accumulators, two weight vectors
 * and a broadcast of the 32 zmm registers, 24 VDPBF16PS per k pair. A
 * token's 32 results are two contiguous stores into its output row. */
/* dequant_rows (the floats the exact tiles multiply, as gemm_amx.c rounds
 * them), transpose16 and fill_e4m3_half come from the shared AVX-512
 * headers, as for the tile kernel. */
#include "bf16_avx512.h"
#include "scratch.h"

#define BF_ROWS BF16_ROWS /* weight rows per block: two vectors of 16 rows */
#define BF_TOKENS 12 /* tokens per pass */

static void pack_bf16_avx512(const float *x, size_t n, uint16_t *out, size_t stride) {
    bf16_pack_row(x, n, out, stride);
}

/* NT tokens (their A-tile rows at xt[i]) against one 32-row block. */
ALWAYS_INLINE void pass(const int NT, const uint16_t *const *xt, const uint16_t *B0, const uint16_t *B1,
                        size_t kblocks, size_t rn, const float *scales, float *Y, size_t ldy) {
    __m512 acc0[BF_TOKENS], acc1[BF_TOKENS];
#pragma GCC unroll 12
    for (int i = 0; i < NT; i++) acc0[i] = acc1[i] = _mm512_setzero_ps();
    for (size_t kb = 0; kb < kblocks; kb++) {
        const uint16_t *b0 = B0 + 512 * kb, *b1 = B1 + 512 * kb;
        for (int p = 0; p < 16; p++) {
            const __m512bh w0 = (__m512bh)_mm512_load_si512((const void *)(b0 + 32 * p));
            const __m512bh w1 = (__m512bh)_mm512_load_si512((const void *)(b1 + 32 * p));
#pragma GCC unroll 12
            for (int i = 0; i < NT; i++) {
                int32_t pair;
                memcpy(&pair, xt[i] + 512 * kb + 2 * p, sizeof pair);
                const __m512bh x = (__m512bh)_mm512_set1_epi32(pair);
                acc0[i] = _mm512_dpbf16_ps(acc0[i], x, w0);
                acc1[i] = _mm512_dpbf16_ps(acc1[i], x, w1);
            }
        }
    }
    const size_t rn0 = rn < 16 ? rn : 16, rn1 = rn > 16 ? rn - 16 : 0;
    const __mmask16 m0 = rn0 >= 16 ? 0xffff : (__mmask16)((1u << rn0) - 1);
    const __mmask16 m1 = rn1 >= 16 ? 0xffff : (__mmask16)((1u << rn1) - 1);
    const __m512 s0 = scales ? _mm512_maskz_loadu_ps(m0, scales) : _mm512_set1_ps(1.0f);
    const __m512 s1 = scales ? _mm512_maskz_loadu_ps(m1, scales + 16) : _mm512_set1_ps(1.0f);
#pragma GCC unroll 12
    for (int i = 0; i < NT; i++) {
        _mm512_mask_storeu_ps(Y + i * ldy, m0, scales ? _mm512_mul_ps(acc0[i], s0) : acc0[i]);
        if (rn1) _mm512_mask_storeu_ps(Y + i * ldy + 16, m1, scales ? _mm512_mul_ps(acc1[i], s1) : acc1[i]);
    }
}

ALWAYS_INLINE void gemm_bf16_tpl(const int S, const cism_mat *W, size_t r0, size_t r1, const cism_act *A,
                                 size_t T, float *Y, size_t ldy) {
    const size_t n = W->cols, kblocks = cism_bf16_len(n) / 32;
    if (T == 0 || r1 <= r0) return;
    const size_t b_bytes = (BF_ROWS / 16) * kblocks * 1024;
    const size_t f_bytes = S == CISM_FP32 ? 0 : cism_div_up(BF_ROWS * n * sizeof(float), 64) * 64;
    uint8_t *mem = cism_scratch_get(b_bytes + f_bytes);
    if (!mem) {
        /* no scratch: the caller reports it (never a silent other precision) */
        __atomic_store_n(A->err, 1, __ATOMIC_RELAXED);
        return;
    }
    uint16_t *B = (uint16_t *)mem;
    float *fbuf = (float *)(mem + b_bytes);
    const float *scales = S == CISM_INT8 ? W->scales : NULL;
    for (size_t r = r0; r < r1; r += BF_ROWS) {
        const size_t R = r1 - r < BF_ROWS ? r1 - r : BF_ROWS;
        if (S != CISM_FP32) dequant_rows(S, (int)R, W, r, fbuf);
        bf16_pack_pairs(S, W, r, R, fbuf, B);
        const uint16_t *B0 = B, *B1 = B + kblocks * 512;
        for (size_t t = 0; t < T; t += BF_TOKENS) {
            const size_t nt = T - t < BF_TOKENS ? T - t : BF_TOKENS;
            const uint16_t *xt[BF_TOKENS];
            for (size_t i = 0; i < nt; i++) xt[i] = A->xb + (t + i) / 16 * A->ldb + (t + i) % 16 * 32;
            const float *sc = scales ? scales + r : NULL;
            float *Yt = Y + t * ldy + r;
            switch (nt) {
#define BF_CASE(N) case N: pass(N, xt, B0, B1, kblocks, R, sc, Yt, ldy); break;
            BF_CASE(12) BF_CASE(11) BF_CASE(10) BF_CASE(9) BF_CASE(8) BF_CASE(7)
            BF_CASE(6) BF_CASE(5) BF_CASE(4) BF_CASE(3) BF_CASE(2) BF_CASE(1)
#undef BF_CASE
            default: break;
            }
        }
    }
    cism_scratch_put(mem);
}

static void gemm_bf16_avx512(const cism_mat *W, size_t r0, size_t r1, const cism_act *A, size_t T,
                             float *Y, size_t ldy) {
    switch (W->storage) {
    case CISM_FP32: gemm_bf16_tpl(CISM_FP32, W, r0, r1, A, T, Y, ldy); break;
    case CISM_FP16: gemm_bf16_tpl(CISM_FP16, W, r0, r1, A, T, Y, ldy); break;
    case CISM_INT8: gemm_bf16_tpl(CISM_INT8, W, r0, r1, A, T, Y, ldy); break;
    case CISM_INT4: gemm_bf16_tpl(CISM_INT4, W, r0, r1, A, T, Y, ldy); break;
    /* (q4_k and q6_k never come here: matrix.pyx keeps their canonical
     * kernels under the bf16 precision) */
    default: gemm_bf16_tpl(CISM_FP4, W, r0, r1, A, T, Y, ldy); break;
    }
}

/* Installed at the avx512vnni level when the CPU has AVX512-BF16; the amx
 * level, where granted, replaces it with the tile kernel. */
void cism_fill_gemm_avx512bf16(cism_kernels *k) {
    fill_e4m3_half(); /* this translation unit's copy of the fp4 scale table */
    k->gemm_bf16 = gemm_bf16_avx512;
    k->pack_bf16 = pack_bf16_avx512;
    k->name_gemm_bf16 = "avx512bf16";
}
