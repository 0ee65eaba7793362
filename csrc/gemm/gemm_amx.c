/* AMX bf16 gemm: the opt-in "bf16" prefill precision (docs/EXACTNESS.md).
 *
 * NOT the canonical arithmetic of kernels.h. Weights (after dequantization)
 * and activations are rounded to bfloat16 (nearest even), and the tile unit
 * (TDPBF16PS) sums their products into fp32 in its own order and rounding,
 * which only the hardware defines. What stays true:
 *   - every (row, token) output depends only on that row and that token:
 *     the same bits whatever the thread count, the rows' split, the number
 *     of tokens in the call or their order (tokens are independent rows of
 *     the A tile, rows independent columns of the B tile, and the K blocks
 *     go by in one fixed order);
 *   - int8 and fp4 weights are exact in bf16 (at most 7 and 6 significant
 *     bits), so only activations, fp32/fp16 weights and int4 weights are
 *     rounded; the int8 row scale multiplies the finished dot as in the
 *     canonical path.
 *
 * Layout: C (16 tokens x 16 rows, fp32) += A (16 tokens x 32 k, bf16, the
 * activations in contiguous 1 KiB blocks, see cism_act) . B (16 k pairs x
 * 16 rows x 2, the weights in the "VNNI" pair layout). A is packed once per
 * call by the caller (pack_bf16); each 32-row block of weights is
 * dequantized, rounded and transposed into B blocks once per call, then
 * used for every token. C tiles are stored straight into Y (a token's row
 * of outputs is a row of C). Two A and two B tiles feed four C tiles: 32
 * tokens x 32 rows per step of 32 elements.
 * It dequantizes with dequant_avx512.h (the same weights the exact tiles
 * multiply) and is compiled with AMX and AVX512-BF16 flags; the table
 * filler installs it only when the CPU has AMX-BF16 and the kernel granted
 * this process the tile state. */
#include "bf16_avx512.h"
#include "scratch.h"
#include "simd_amx.h"

#define AMX_ROWS BF16_ROWS /* weight rows per B block (two tiles) */

/* Every tile 16 rows of 64 bytes. */
static void amx_configure(void) {
    volatile tile_config cfg;
    memset((void *)&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    __asm__ volatile("" ::: "memory");
    _tile_loadconfig((const void *)&cfg);
}

static void pack_bf16_amx(const float *x, size_t n, uint16_t *out, size_t stride) {
    bf16_pack_row(x, n, out, stride);
}

/* Store a C tile (16 tokens x 16 rows) into Y: tokens t..t+tn-1, rows
 * r..r+rn-1, times the int8 row scales when given. */
ALWAYS_INLINE void store_c(const float *c, size_t tn, size_t rn, const float *scales, float *Y,
                           size_t ldy) {
    const __mmask16 m = rn >= 16 ? 0xffff : (__mmask16)((1u << rn) - 1);
    const __m512 s = scales ? _mm512_maskz_loadu_ps(m, scales) : _mm512_set1_ps(1.0f);
    for (size_t t = 0; t < tn; t++) {
        __m512 v = _mm512_load_ps(c + 16 * t);
        if (scales) v = _mm512_mul_ps(v, s);
        _mm512_mask_storeu_ps(Y + t * ldy, m, v);
    }
}

ALWAYS_INLINE void gemm_bf16_tpl(const int S, const cism_mat *W, size_t r0, size_t r1, const cism_act *A,
                                 size_t T, float *Y, size_t ldy) {
    const size_t n = W->cols, kp = cism_bf16_len(n), kblocks = kp / 32;
    if (T == 0 || r1 <= r0) return;
    /* B blocks of 32 rows, the dequantized rows, four C tiles */
    const size_t b_bytes = (AMX_ROWS / 16) * kblocks * 1024;
    const size_t f_bytes = S == CISM_FP32 ? 0 : cism_div_up(AMX_ROWS * n * sizeof(float), 64) * 64;
    uint8_t *mem = cism_scratch_get(b_bytes + f_bytes + 4 * 1024);
    if (!mem) {
        /* no scratch: the caller reports it (never a silent other precision) */
        __atomic_store_n(A->err, 1, __ATOMIC_RELAXED);
        return;
    }
    uint16_t *B = (uint16_t *)mem;
    float *fbuf = (float *)(mem + b_bytes);
    float *cbuf = (float *)(mem + b_bytes + f_bytes);
    const float *scales = S == CISM_INT8 ? W->scales : NULL;
    amx_configure();
    for (size_t r = r0; r < r1; r += AMX_ROWS) {
        const size_t R = r1 - r < AMX_ROWS ? r1 - r : AMX_ROWS;
        if (S != CISM_FP32) dequant_rows(S, (int)R, W, r, fbuf);
        bf16_pack_pairs(S, W, r, R, fbuf, B);
        const uint16_t *B0 = B, *B1 = B + kblocks * 512;
        for (size_t t = 0; t < T; t += 32) {
            const uint16_t *A0 = A->xb + t / 16 * A->ldb, *A1 = A0 + A->ldb;
            const int two = T - t > 16;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            if (two) {
                for (size_t kb = 0; kb < kblocks; kb++) {
                    _tile_loadd(4, A0 + 512 * kb, 64);
                    _tile_loadd(5, A1 + 512 * kb, 64);
                    _tile_loadd(6, B0 + 512 * kb, 64);
                    _tile_loadd(7, B1 + 512 * kb, 64);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(1, 4, 7);
                    _tile_dpbf16ps(2, 5, 6);
                    _tile_dpbf16ps(3, 5, 7);
                }
            } else {
                for (size_t kb = 0; kb < kblocks; kb++) {
                    _tile_loadd(4, A0 + 512 * kb, 64);
                    _tile_loadd(6, B0 + 512 * kb, 64);
                    _tile_loadd(7, B1 + 512 * kb, 64);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(1, 4, 7);
                }
            }
            const size_t tn0 = T - t < 16 ? T - t : 16, tn1 = two ? (T - t - 16 < 16 ? T - t - 16 : 16) : 0;
            const size_t rn0 = R < 16 ? R : 16, rn1 = R > 16 ? R - 16 : 0;
            float *Yt = Y + t * ldy + r;
            /* C0: tokens t.., rows r..; C1: rows r+16..; C2/C3: tokens t+16.. */
            _tile_stored(0, cbuf, 64);
            store_c(cbuf, tn0, rn0, scales ? scales + r : NULL, Yt, ldy);
            if (rn1) {
                _tile_stored(1, cbuf + 256, 64);
                store_c(cbuf + 256, tn0, rn1, scales ? scales + r + 16 : NULL, Yt + 16, ldy);
            }
            if (tn1) {
                _tile_stored(2, cbuf + 512, 64);
                store_c(cbuf + 512, tn1, rn0, scales ? scales + r : NULL, Yt + 16 * ldy, ldy);
                if (rn1) {
                    _tile_stored(3, cbuf + 768, 64);
                    store_c(cbuf + 768, tn1, rn1, scales ? scales + r + 16 : NULL, Yt + 16 * ldy + 16, ldy);
                }
            }
        }
    }
    _tile_release();
    cism_scratch_put(mem);
}

static void gemm_bf16_amx(const cism_mat *W, size_t r0, size_t r1, const cism_act *A, size_t T, float *Y,
                          size_t ldy) {
    switch (W->storage) {
    case CISM_FP32: gemm_bf16_tpl(CISM_FP32, W, r0, r1, A, T, Y, ldy); break;
    case CISM_FP16: gemm_bf16_tpl(CISM_FP16, W, r0, r1, A, T, Y, ldy); break;
    case CISM_INT8: gemm_bf16_tpl(CISM_INT8, W, r0, r1, A, T, Y, ldy); break;
    case CISM_INT4: gemm_bf16_tpl(CISM_INT4, W, r0, r1, A, T, Y, ldy); break;
    /* (q4_k and q6_k never come here: matrix.pyx's pick_kernel keeps their
     * canonical kernels under the bf16 precision) */
    default: gemm_bf16_tpl(CISM_FP4, W, r0, r1, A, T, Y, ldy); break;
    }
}

void cism_fill_gemm_amx(cism_kernels *k) {
    fill_e4m3_half();
    k->gemm_bf16 = gemm_bf16_amx;
    k->pack_bf16 = pack_bf16_amx;
    k->name_gemm_bf16 = "amx";
}
