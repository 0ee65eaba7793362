/* Integer weights x q8 activations with AVX-512 VNNI: the avx512vnni and
 * amx levels' shared code. Their byte sums by vpdpbusd (one instruction per
 * 64 multiply-adds) for the dots-in-lanes template (q8_avx512.h, included
 * here), and from TQ_MIN_TOKENS tokens on the tokens-in-lanes kernels
 * below. The including file names Q8_DOT4 dot4_vnni, Q8_I8_SUMS
 * i8_sums_vnni and its nibble operations (see q8_avx512.h) first. */
#ifndef CISM_Q8_VNNI_H
#define CISM_Q8_VNNI_H

#include "simd_avx512.h"
#include "scratch.h"

/* u8 x s8 four-element lane sums added to acc. */
ALWAYS_INLINE __m512i dot4_vnni(__m512i acc, __m512i w, __m512i a) { return _mm512_dpbusd_epi32(acc, w, a); }

/* dot4_vnni against the dword at p, broadcast from memory by vpdpbusd
 * itself (no separate vpbroadcastd per product). */
typedef int32_t __attribute__((may_alias)) cism_i32_alias;
ALWAYS_INLINE __m512i dot4_bcast_vnni(__m512i acc, __m512i a, const int8_t *p) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(a), "m"(*(const cism_i32_alias *)p));
    return acc;
}
#define Q8_DOT4_BCAST dot4_bcast_vnni

/* int8 x q8 unit sums (see i8_sums_signs): vpdpbusd multiplies unsigned by
 * signed bytes, so the weights go in as w + 128 (w ^ 0x80) and each sum
 * starts from -128 * (the activations' group sum): it ends at exactly
 * sum(w * a). */
ALWAYS_INLINE void i8_sums_vnni(const int R, const int TT, const uint8_t *const rows[8], const cism_act *A,
                                size_t t, size_t u, __m512i v[16]) {
    const __m512i bias = _mm512_set1_epi8((char)0x80);
    __m512i a[4], start[4];
    for (int j = 0; j < TT; j++) {
        a[j] = _mm512_loadu_si512((const void *)(A->q8 + (t + j) * A->ldq + 64 * u));
        start[j] = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(_mm512_setzero_si512(), bias, a[j]));
    }
    for (int i = 0; i < R; i++) {
        const __m512i w = _mm512_xor_si512(_mm512_loadu_si512((const void *)(rows[i] + 64 * u)), bias);
        for (int j = 0; j < TT; j++) v[i * TT + j] = _mm512_dpbusd_epi32(start[j], w, a[j]);
    }
}

#include "q8_avx512.h"

/* ---- several tokens x q8 with VNNI: tokens in lanes ----
 *
 * From TQ_MIN_TOKENS tokens on, the q8 activations of each group of 16
 * tokens are transposed once per call (the layout of the AMX B tiles: one
 * zmm holds dword k of a 64-element unit for the 16 tokens) and flipped to
 * unsigned bytes a + 128. Each weight dword (4 signed bytes: the int8 codes
 * as packed, or int4/fp4 rows unpacked to bytes once per pass) is broadcast
 * to vpdpbusd against them, so a lane ends a block holding the block sum of
 * one (row, token) with no horizontal reduction: s_b = sum((a + 128) w) -
 * 128 sum(w), the second sum taken once per row and pass (bytes past the
 * row, met by a = 0, cancel in the difference). The chain then folds with
 * lane = token, as on the tile unit: acc = fma((float)s_b, c_b, acc). The
 * same bits as the reference, without the per-dot reductions and scale
 * gathers of the dots-in-lanes tiles (kept below TQ_MIN_TOKENS, where 16
 * token lanes would go mostly unused). TQ_MIN_TOKENS, TQ_PASS and
 * store_rows16 are q8_avx512.h's (the K-quants share them). */

/* Tokens t..t+tn-1 (tn <= 16, missing ones zero) transposed: unit u at
 * B + 256 u (int32s), its row k holding dword k of the unit for each token
 * (the layout of an AMX B tile; a 32-element block is 8 such rows, a
 * 16-element one 4); the block scales of block b at S + 16 b. flip: the
 * bytes as unsigned a + 128 (for vpdpbusd), else as they are (TDPBSSD). */
MAYBE_UNUSED void pack_q8_group(const cism_act *A, size_t t, size_t tn, size_t units, int32_t *B, float *S, int flip) {
    const __m512i bias = _mm512_set1_epi8(flip ? (char)0x80 : 0);
    for (size_t u = 0; u < units; u++) {
        __m512i in[16], out[16];
        for (size_t n = 0; n < 16; n++)
            in[n] = n < tn ? _mm512_loadu_si512((const void *)(A->q8 + (t + n) * A->ldq + 64 * u))
                           : _mm512_setzero_si512();
        transpose16(in, out); /* out[k] = dword k of the unit, all tokens */
        for (int k = 0; k < 16; k++)
            _mm512_store_si512((void *)(B + 256 * u + 16 * k), _mm512_xor_si512(out[k], bias));
        for (size_t h = 0; h < 2; h++)
            for (size_t n = 0; n < 16; n++)
                S[16 * (2 * u + h) + n] = n < tn ? A->qscale[(t + n) * A->ldqs + 2 * u + h] : 0.0f;
    }
}

/* Rows r..r+rn-1 (rn <= 16) as signed bytes at wb (row stride kp = 64 *
 * units; rows rn..15 zero) and their block scales at cw (row stride ldc). */
ALWAYS_INLINE void nib_unpack16(const int S, const cism_mat *W, size_t r, size_t rn, size_t units,
                                int8_t *wb, float *cw, size_t ldc) {
    const size_t kp = 64 * units, so = W->scale_offset;
    const size_t blocks = cism_div_up(W->cols, S == CISM_INT4 ? 32 : 16);
    for (size_t m = 0; m < 16; m++) {
        int8_t *o = wb + m * kp;
        if (m >= rn) {
            memset(o, 0, kp);
            memset(cw + m * ldc, 0, ldc * sizeof(float));
            continue;
        }
        const uint8_t *row = (const uint8_t *)W->codes + (r + m) * W->row_bytes;
        for (size_t u = 0; u < units; u++) {
            __m512i v;
            if (S == CISM_INT4) {
                v = int4_unit(1, row, u);
            } else {
                /* byte k holds elements 2k (low nibble), 2k + 1 (high): as
                 * words, (x | x << 4) & 0x0f0f puts them in bytes 2k, 2k + 1
                 * (half the shuffles of interleaving two nibble vectors) */
                const __m512i x = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(row + 32 * u)));
                const __m512i table = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)cism_e2m1_x2));
                const __m512i nib = _mm512_ternarylogic_epi32(x, _mm512_slli_epi16(x, 4),
                                                              _mm512_set1_epi16(0x0f0f), 0xa8); /* (x | y) & m */
                v = Q8_LUT16(table, nib);
            }
            _mm512_store_si512((void *)(o + 64 * u), v);
        }
        /* blocks past the row are never issued; their scales stay 0 */
        if (S == CISM_INT4) {
            for (size_t b = 0; b < ldc; b++) cw[m * ldc + b] = b < blocks ? cism_int4_scale(row, so, b) : 0.0f;
            continue;
        }
        /* fp4's 16 at a time (one by one they cost as much as the unpack) */
        for (size_t b = 0; b < ldc; b += 16) {
            const __mmask16 in = b >= blocks ? 0 : blocks - b >= 16 ? 0xffff : (__mmask16)((1u << (blocks - b)) - 1);
            const __mmask16 st = ldc - b >= 16 ? 0xffff : (__mmask16)((1u << (ldc - b)) - 1);
            {
                /* e4m3 s.eeee.mmm as the half s.0eeee.mmm0000000 is the same
                 * value / 2^8, exactly (subnormals too): e4m3_half's values,
                 * its zeroed NaN codes aside (a gather or one-by-one stores
                 * stalled the loop) */
                const __m256i x = _mm256_cvtepu8_epi16(_mm_maskz_loadu_epi8(in, row + so + b));
                const __m256i h = _mm256_or_si256(_mm256_and_si256(_mm256_slli_epi16(x, 8), _mm256_set1_epi16((short)0x8000)),
                                                  _mm256_and_si256(_mm256_slli_epi16(x, 7), _mm256_set1_epi16(0x3f80)));
                const __mmask16 nan = _mm256_cmpeq_epi16_mask(_mm256_and_si256(x, _mm256_set1_epi16(0x7f)),
                                                              _mm256_set1_epi16(0x7f));
                const __m512 c = _mm512_maskz_mul_ps((__mmask16)~nan, _mm512_cvtph_ps(h), _mm512_set1_ps(128.0f));
                _mm512_mask_storeu_ps(cw + m * ldc + b, st, c);
            }
        }
    }
}

/* 128 * (the sum of each weight block) of 16 rows of signed weight bytes
 * (w[m], units of 64), at ws + 16 b + m: vpdpbusd with unsigned ones, then
 * the block sums of 8 rows at a time. */
ALWAYS_INLINE void row_sums16(const int S, const int8_t *const w[16], size_t units, int32_t *ws) {
    const __m512i ones = _mm512_set1_epi8(1);
    for (size_t u = 0; u < units; u++)
        for (int h = 0; h < 2; h++) {
            __m512i v[8];
            for (int i = 0; i < 8; i++)
                v[i] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones,
                                           _mm512_loadu_si512((const void *)(w[8 * h + i] + 64 * u)));
            if (S == CISM_FP4) {
                __m512i f01, f23;
                block_sums4x4(v, &f01, &f23);
                f01 = _mm512_slli_epi32(f01, 7);
                f23 = _mm512_slli_epi32(f23, 7);
                int32_t *o = ws + 16 * 4 * u + 8 * h;
                _mm256_storeu_si256((__m256i *)o, _mm512_castsi512_si256(f01));
                _mm256_storeu_si256((__m256i *)(o + 16), _mm512_extracti64x4_epi64(f01, 1));
                _mm256_storeu_si256((__m256i *)(o + 32), _mm512_castsi512_si256(f23));
                _mm256_storeu_si256((__m256i *)(o + 48), _mm512_extracti64x4_epi64(f23, 1));
            } else {
                const __m512i f = _mm512_slli_epi32(block_sums8(v), 7);
                int32_t *o = ws + 16 * 2 * u + 8 * h;
                _mm256_storeu_si256((__m256i *)o, _mm512_castsi512_si256(f));
                _mm256_storeu_si256((__m256i *)(o + 16), _mm512_extracti64x4_epi64(f, 1));
            }
        }
}

/* R rows (w[i]: signed weight bytes; ws: their 128 * block sums at
 * ws + 16 b + i; cw: int4/fp4 block scales at cw[i * ldc + b]) x G groups
 * of 16 tokens (Bg + g * gstride, scales Sg + g * sstride): acc[i][g] lane
 * n = the chain of row i, token 16 g + n, over blocks [0, blocks). R * G
 * <= 8: eight independent vpdpbusd chains hide its latency (with four,
 * the 16-token batch waited on them). pf: pf_bytes to prefetch, spread
 * over the blocks (NULL: none). A burst of them up front stalled the core
 * (a fifth of the kernel's time, perf on Zen 4); spread, they beat none by
 * ~1.3x at 16 tokens (the hardware prefetchers alone fall behind). */
ALWAYS_INLINE void tq_tile(const int S, const int R, const int G, const int8_t *const *w, const int32_t *ws,
                           const float *cw, size_t ldc, const int32_t *Bg, size_t gstride, const float *Sg,
                           size_t sstride, size_t blocks, const uint8_t *pf, size_t pf_bytes,
                           __m512 acc[8][2]) {
    const int KD = S == CISM_FP4 ? 4 : 8; /* dwords per block */
    const size_t pf_step = pf ? cism_div_up(cism_div_up(pf_bytes, blocks), 64) * 64 : 0;
    for (int i = 0; i < R; i++)
        for (int g = 0; g < G; g++) acc[i][g] = _mm512_setzero_ps();
    for (size_t b = 0; b < blocks; b++) {
        for (size_t o = b * pf_step; o < (b + 1) * pf_step && o < pf_bytes; o += 64)
            _mm_prefetch((const char *)(pf + o), _MM_HINT_T0);
        __m512i ai[8][2];
        for (int i = 0; i < R; i++)
            for (int g = 0; g < G; g++) ai[i][g] = _mm512_set1_epi32(-ws[16 * b + i]);
        for (int k = 0; k < KD; k++) {
            const size_t d = (size_t)KD * b + k; /* dword d of the row: B row d % 16 of unit d / 16 */
            __m512i av[2];
            for (int g = 0; g < G; g++) av[g] = _mm512_load_si512((const void *)(Bg + g * gstride + 16 * d));
            for (int i = 0; i < R; i++) {
                int32_t x;
                memcpy(&x, w[i] + 4 * d, 4);
                const __m512i wb = _mm512_set1_epi32(x);
                for (int g = 0; g < G; g++) ai[i][g] = _mm512_dpbusd_epi32(ai[i][g], av[g], wb);
            }
        }
        for (int g = 0; g < G; g++) {
            const __m512 s = _mm512_load_ps(Sg + g * sstride + 16 * (S == CISM_FP4 ? b / 2 : b));
            for (int i = 0; i < R; i++) {
                const __m512 c = S == CISM_INT8 ? s : _mm512_mul_ps(s, _mm512_set1_ps(cw[i * ldc + b]));
                acc[i][g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ai[i][g]), c, acc[i][g]);
            }
        }
    }
}

ALWAYS_INLINE void gemm_tq8_tpl(const int S, const cism_mat *W, size_t r0, size_t r1, const cism_act *A,
                                size_t T, float *Y, size_t ldy) {
    const size_t KB = S == CISM_FP4 ? 16 : 32;
    const size_t units = cism_div_up(W->cols, 64), blocks = cism_div_up(W->cols, KB), nbk = units * (64 / KB);
    const size_t groups = cism_div_up(T, 16), kp = 64 * units;
    const size_t b_bytes = groups * units * 1024, s_bytes = groups * units * 128;
    const size_t w_bytes = S == CISM_INT8 ? 0 : 16 * kp;
    const size_t ws_bytes = cism_div_up(16 * nbk * sizeof(int32_t), 64) * 64;
    const size_t c_bytes = S == CISM_INT8 ? 0 : cism_div_up(16 * nbk * sizeof(float), 64) * 64;
    if (r1 <= r0) return;
    uint8_t *mem = cism_scratch_get(b_bytes + s_bytes + w_bytes + ws_bytes + c_bytes);
    if (!mem) { /* the dots-in-lanes tiles need no scratch and give the same bits */
        gemm_q_tpl(S, W, r0, r1, A, T, Y, ldy);
        return;
    }
    int32_t *B = (int32_t *)mem;
    float *Sc = (float *)(mem + b_bytes);
    int8_t *wb = (int8_t *)(mem + b_bytes + s_bytes);
    int32_t *ws = (int32_t *)(mem + b_bytes + s_bytes + w_bytes);
    float *cw = (float *)(mem + b_bytes + s_bytes + w_bytes + ws_bytes);
    for (size_t g = 0; g < groups; g++) {
        const size_t tn = T - 16 * g < 16 ? T - 16 * g : 16;
        pack_q8_group(A, 16 * g, tn, units, B + g * units * 256, Sc + g * units * 32, 1);
    }
    for (size_t g0 = 0; g0 < groups; g0 += TQ_PASS)
    for (size_t r = r0; r < r1; r += 16) {
        const size_t g1 = groups - g0 < TQ_PASS ? groups : g0 + TQ_PASS;
        const size_t rn = r1 - r < 16 ? r1 - r : 16;
        const int8_t *w[16];
        if (S == CISM_INT8) {
            /* the packed codes themselves; rows past rn repeat the last one
             * (computed, not stored) */
            for (size_t m = 0; m < 16; m++)
                w[m] = (const int8_t *)W->codes + (r + (m < rn ? m : rn - 1)) * W->row_bytes;
        } else {
            nib_unpack16(S, W, r, rn, units, wb, cw, nbk);
            for (size_t m = 0; m < 16; m++) w[m] = wb + m * kp;
        }
        row_sums16(S, w, units, ws);
        /* the next 16 rows come from memory: fetch them while these are
         * multiplied */
        const uint8_t *next = r + 32 <= r1 ? (const uint8_t *)W->codes + (r + 16) * W->row_bytes : NULL;
        for (size_t g = g0; g < g1; g += 2) {
            const size_t G = g1 - g < 2 ? g1 - g : 2;
            const int32_t *Bg = B + g * units * 256;
            const float *Sg = Sc + g * units * 32;
            /* the 16 rows' results, row-major per group, then written
             * transposed: one 16-row store per token instead of 16 scalar
             * stores a row stride apart (which all meet in few cache sets
             * when the stride is a multiple of 4 KiB) */
            __attribute__((aligned(64))) float buf[2][16][16];
            const size_t RT = G == 1 ? 8 : 4; /* rows per tile: 8 chains either way */
            for (size_t i0 = 0; i0 < rn; i0 += RT) {
                const size_t R = rn - i0 < RT ? rn - i0 : RT;
                /* the tile's share of the next 16 rows, fetched while the
                 * first token groups are multiplied */
                const uint8_t *pf = next && g == g0 ? next + i0 * W->row_bytes : NULL;
                const float *cwi = cw + i0 * nbk;
                __m512 acc[8][2];
                for (int i = 0; i < 8; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps(); /* (for the compiler) */
#define TQ_CASE(RR, GG)                                                                                  \
    tq_tile(S, RR, GG, w + i0, ws + i0, cwi, nbk, Bg, units * 256, Sg, units * 32, blocks, pf,          \
            R * W->row_bytes, acc)
                switch (G == 1 ? R - 1 : 8 + R - 1) {
                case 0: TQ_CASE(1, 1); break;
                case 1: TQ_CASE(2, 1); break;
                case 2: TQ_CASE(3, 1); break;
                case 3: TQ_CASE(4, 1); break;
                case 4: TQ_CASE(5, 1); break;
                case 5: TQ_CASE(6, 1); break;
                case 6: TQ_CASE(7, 1); break;
                case 7: TQ_CASE(8, 1); break;
                case 8: TQ_CASE(1, 2); break;
                case 9: TQ_CASE(2, 2); break;
                case 10: TQ_CASE(3, 2); break;
                default: TQ_CASE(4, 2); break;
                }
#undef TQ_CASE
                for (size_t i = 0; i < R; i++)
                    for (size_t q = 0; q < G; q++)
                        _mm512_store_ps(buf[q][i0 + i], S == CISM_INT8
                                        ? _mm512_mul_ps(acc[i][q], _mm512_set1_ps(W->scales[r + i0 + i]))
                                        : acc[i][q]);
            }
            store_groups16(buf, G, rn, g, T, Y, ldy, r);
        }
    }
    cism_scratch_put(mem);
}

#define GEMM_Q_VNNI(NAME, S)                                                                     \
    static void NAME(const cism_mat *W, size_t r0, size_t r1, const cism_act *A, size_t T,       \
                     float *Y, size_t ldy) {                                                     \
        if (T >= TQ_MIN_TOKENS) gemm_tq8_tpl(S, W, r0, r1, A, T, Y, ldy);                        \
        else gemm_q_tpl(S, W, r0, r1, A, T, Y, ldy);                                          \
    }

#endif
