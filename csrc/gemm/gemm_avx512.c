/* AVX-512 (F/BW/VL/DQ) gemm with fp32 activations. Bit-identical to
 * gemm_ref.c: every (row, token) dot keeps one zmm accumulator whose lane
 * i sums the elements i mod 16 in order with fma, then the canonical
 * reduction tree.
 *
 * Tiling: decode (T = 1) runs 8 rows at a time (4 for 4-bit weights), i.e.
 * 8 independent weight streams per thread, which is what it takes to
 * saturate DRAM from two cores. The 8 rows are spread over the caller's
 * range (rows j, j + L, ..., j + 7L for L = range / 8), not adjacent: rows
 * of a small int8 matrix are 576 bytes, so 8 adjacent rows sit in one or two
 * pages and the prefetchers see one stream; spread, they see 8. That took
 * SmolLM2 int8 decode from 67 to 87 tok/s and fp16 from 39 to 64.
 *
 * Multi-token calls run 6 rows x 4 tokens tiles (4 x 4 for rows shorter
 * than 256 elements; rows longer than 1024 go by in column blocks, see
 * rows6_kblocked) over token chunks small enough for the activations to
 * stay in L2, fp32 tiles prefetching their next rows (or column block) a
 * slice per 4 tokens; each group of 4 rows reduces its dots together
 * (hsum_tile4).
 * Packed rows (fp16, int8, int4, fp4) are first dequantized into aligned
 * scratch (csrc/scratch.h) once per chunk (rows_deq), so the unpacking is
 * shared by up to 64 tokens and the fp32 tile does the rest. */
#include "dequant_avx512.h"
#include "scratch.h"

/* The canonical reductions of up to 4 x 4 dot accumulators at once:
 * element 4j + i of the result is hsum(acc[i][j]) (row i, token j), i.e.
 * block j holds token j's 4 rows. Each level adds the same pairs as hsum
 * (lanes i and i + 8, then i and i + 4 within each half, then i and i + 2,
 * then the last two), only 16 dots at a time: 15 additions and 30 shuffles
 * instead of 64 and 64. Missing rows (R < 4) and tokens (TT < 4) read as
 * zero and are not stored by the caller. */
ALWAYS_INLINE __m512 hsum_tile4(const __m512 (*acc)[4], const int R, const int TT) {
    __m512 a[16], b[8], c[4], d[2];
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 4; j++) a[4 * i + j] = i < R && j < TT ? acc[i][j] : _mm512_setzero_ps();
    /* b[m] = [s8(a[2m]) | s8(a[2m + 1])] */
    for (int m = 0; m < 8; m++)
        b[m] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * m], a[2 * m + 1], 0x44),
                             _mm512_shuffle_f32x4(a[2 * m], a[2 * m + 1], 0xee));
    /* c[p], 128-bit block k = s4(a[4p + k]) */
    for (int p = 0; p < 4; p++)
        c[p] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * p], b[2 * p + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * p], b[2 * p + 1], 0xdd));
    /* d[q], block k = [s2(a[8q + k]), s2(a[8q + 4 + k])] */
    for (int q = 0; q < 2; q++)
        d[q] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * q], c[2 * q + 1], 0x44),
                             _mm512_shuffle_ps(c[2 * q], c[2 * q + 1], 0xee));
    /* block k = [sum(a[k]), sum(a[4 + k]), sum(a[8 + k]), sum(a[12 + k])] */
    return _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xdd));
}

/* Store the dots of up to 4 adjacent rows (r..r+R-1) for TT tokens, times
 * the int8 row scales when `scales` is given (the same product as the
 * one-dot path). */
ALWAYS_INLINE void store_tile4(const __m512 (*acc)[4], const int R, const int TT, const float *scales,
                               size_t r, float *Y, size_t ldy) {
    const __mmask8 m = (__mmask8)((1u << R) - 1);
    __m512 v = hsum_tile4(acc, R, TT);
    if (scales) v = _mm512_mul_ps(v, _mm512_broadcast_f32x4(_mm_maskz_loadu_ps(m, scales + r)));
    _mm_mask_storeu_ps(Y + r, m, _mm512_castps512_ps128(v));
    if (TT > 1) _mm_mask_storeu_ps(Y + ldy + r, m, _mm512_extractf32x4_ps(v, 1));
    if (TT > 2) _mm_mask_storeu_ps(Y + 2 * ldy + r, m, _mm512_extractf32x4_ps(v, 2));
    if (TT > 3) _mm_mask_storeu_ps(Y + 3 * ldy + r, m, _mm512_extractf32x4_ps(v, 3));
}

/* Store an R-row tile (rows r..r+R-1 adjacent), 4 rows at a time. (No
 * loop: with R a constant each call is resolved at compile time and the
 * accumulators stay in registers.) */
ALWAYS_INLINE void store_tile(const __m512 acc[8][4], const int R, const int TT, const float *scales,
                              size_t r, float *Y, size_t ldy) {
    store_tile4(acc, R < 4 ? R : 4, TT, scales, r, Y, ldy);
    if (R > 4) store_tile4(acc + 4, R - 4, TT, scales, r + 4, Y, ldy);
}

/* An R x TT tile of dots: rows r, r + rs, ..., r + (R-1) rs, tokens of X
 * (row stride ldx). */
ALWAYS_INLINE void tile_f32(const int S, const int R, const int TT, const cism_mat *W, size_t r,
                            size_t rs, const float *X, size_t ldx, float *Y, size_t ldy) {
    const size_t n = W->cols, full = n / 16, rem = n % 16, so = W->scale_offset;
    row_ptr p[8];
    __m512 acc[8][4];
    for (int i = 0; i < R; i++) {
        p[i] = row_at(S, W, r + i * rs);
        for (int j = 0; j < TT; j++) acc[i][j] = _mm512_setzero_ps();
    }
    if (S == CISM_Q4K || S == CISM_Q6K) {
        /* whole super-blocks (cols is a multiple of 256); the rows take
         * turns every 64 elements, so that their fma chains overlap */
        for (size_t sb = 0; sb < n / CISM_QK_K; sb++) {
            __attribute__((aligned(64))) float sm[8][16];
            for (int i = 0; i < R; i++) {
                kq_prefetch(S, p[i].codes + sb * kq_block_bytes(S));
                kq_scales(S, p[i].codes + sb * kq_block_bytes(S), sm[i]);
            }
            /* the factors are broadcast from memory (a load each), not
             * from the registers GCC still holds them in (a shuffle each,
             * and the lookups are shuffles already) */
            __asm__ __volatile__("" : : "r"(sm) : "memory");
            /* (fully unrolled, or the accumulators live in memory) */
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++)
#pragma GCC unroll 8
                for (int i = 0; i < R; i++) {
                    __m512 w[4];
                    kq_part(S, p[i].codes + sb * kq_block_bytes(S), sm[i], k, w);
                    for (int j = 0; j < TT; j++) {
                        const float *x = X + j * ldx + CISM_QK_K * sb + 64 * k;
                        for (int c = 0; c < 4; c++) acc[i][j] = _mm512_fmadd_ps(w[c], _mm512_loadu_ps(x + 16 * c), acc[i][j]);
                    }
                }
        }
    } else if (S == CISM_INT4) {
        /* whole 32-element blocks: one byte load feeds both halves */
        const size_t blocks = n / 32;
        for (size_t b = 0; b < blocks; b++) {
            __m512 x0[4], x1[4];
            for (int j = 0; j < TT; j++) {
                x0[j] = _mm512_loadu_ps(X + j * ldx + 32 * b);
                x1[j] = _mm512_loadu_ps(X + j * ldx + 32 * b + 16);
            }
            for (int i = 0; i < R; i++) {
                __m512 w0, w1;
                int4_block32(p[i], so, b, &w0, &w1);
                for (int j = 0; j < TT; j++) {
                    acc[i][j] = _mm512_fmadd_ps(w0, x0[j], acc[i][j]);
                    acc[i][j] = _mm512_fmadd_ps(w1, x1[j], acc[i][j]);
                }
            }
        }
        if (n % 32) {
            const size_t left = n % 32;
            const __mmask16 m0 = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1);
            const __mmask16 m1 = left > 16 ? (__mmask16)((1u << (left - 16)) - 1) : 0;
            __m512 x0[4], x1[4];
            for (int j = 0; j < TT; j++) {
                x0[j] = _mm512_maskz_loadu_ps(m0, X + j * ldx + 32 * blocks);
                x1[j] = _mm512_maskz_loadu_ps(m1, X + j * ldx + 32 * blocks + 16);
            }
            for (int i = 0; i < R; i++) {
                __m512 w0, w1;
                int4_block32(p[i], so, blocks, &w0, &w1);
                /* lanes past the end must stay untouched: a lane may hold -0 */
                for (int j = 0; j < TT; j++) {
                    acc[i][j] = _mm512_mask3_fmadd_ps(w0, x0[j], acc[i][j], m0);
                    if (m1) acc[i][j] = _mm512_mask3_fmadd_ps(w1, x1[j], acc[i][j], m1);
                }
            }
        }
    } else {
    for (size_t c = 0; c < full; c++) {
        __m512 x[4];
        for (int j = 0; j < TT; j++) x[j] = _mm512_loadu_ps(X + j * ldx + 16 * c);
        for (int i = 0; i < R; i++) {
            const __m512 w = deq16(S, p[i], so, c, 0xffff);
            for (int j = 0; j < TT; j++) acc[i][j] = _mm512_fmadd_ps(w, x[j], acc[i][j]);
        }
    }
    if (rem) {
        const __mmask16 m = (__mmask16)((1u << rem) - 1);
        __m512 x[4];
        for (int j = 0; j < TT; j++) x[j] = _mm512_maskz_loadu_ps(m, X + j * ldx + 16 * full);
        /* lanes past the end must stay untouched: a lane may hold -0 */
        for (int i = 0; i < R; i++) {
            const __m512 w = deq16(S, p[i], so, full, m);
            for (int j = 0; j < TT; j++) acc[i][j] = _mm512_mask3_fmadd_ps(w, x[j], acc[i][j], m);
        }
    }
    }
    /* int8 rows: the row scale after the dot; fp32 rows carry scales only
     * when they are int8 codes dequantized by rows_deq */
    const float *scales = S == CISM_INT8 || S == CISM_FP32 ? W->scales : NULL;
    if (rs == 1 && R > 1) {
        store_tile(acc, R, TT, scales, r, Y, ldy);
        return;
    }
    for (int i = 0; i < R; i++) {
        const size_t row = r + i * rs;
        for (int j = 0; j < TT; j++) {
            const float d = hsum(acc[i][j]);
            Y[j * ldy + row] = scales ? d * scales[row] : d;
        }
    }
}

/* The fp32 tiles' prefetch into L2 of the weights they meet next: the
 * first `bytes` of each of `rows` rows (`stride` apart) go by in slices of
 * pf_slice(bytes, T) bytes, one per 4 tokens; pf_part fetches slice k. */
ALWAYS_INLINE size_t pf_slice(size_t bytes, size_t T) { return cism_div_up(bytes, 64 * cism_div_up(T, 4)) * 64; }
ALWAYS_INLINE void pf_part(const char *next, int rows, size_t stride, size_t bytes, size_t slice, size_t k) {
    for (size_t o = k * slice; o < (k + 1) * slice && o < bytes; o += 64)
        for (int i = 0; i < rows; i++) _mm_prefetch(next + i * stride + o, _MM_HINT_T1);
}

ALWAYS_INLINE void rows_f32(const int S, const int R, const cism_mat *W, size_t r, const float *X,
                            size_t ldx, size_t T, float *Y, size_t ldy) {
    size_t t = 0;
    /* fp32 rows: while these rows meet the chunk's tokens, fetch the next
     * R rows into L2, a slice of each row per 4 tokens (a row of 1024
     * floats is a page of its own, where the L2 streamer starts cold).
     * Qwen3-0.6B's 3072 x 1024 and 2048 x 1024, 512 tokens, one thread,
     * in one binary: 10-35% more FMAs per tick. */
    const size_t rb = W->row_bytes, slice = pf_slice(rb, T);
    const char *next = S == CISM_FP32 && r + 2 * R <= W->rows ? (const char *)W->codes + (r + R) * rb : NULL;
    for (; t + 4 <= T; t += 4) {
        if (next) pf_part(next, R, rb, rb, slice, t / 4);
        tile_f32(S, R, 4, W, r, 1, X + t * ldx, ldx, Y + t * ldy, ldy);
    }
    switch (T - t) {
    case 3: tile_f32(S, R, 3, W, r, 1, X + t * ldx, ldx, Y + t * ldy, ldy); break;
    case 2: tile_f32(S, R, 2, W, r, 1, X + t * ldx, ldx, Y + t * ldy, ldy); break;
    case 1: tile_f32(S, R, 1, W, r, 1, X + t * ldx, ldx, Y + t * ldy, ldy); break;
    default: break;
    }
}

/* The prefill tile is 6 rows x 4 tokens: 24 accumulators + 4 token vectors
 * + 1 weight vector of the 32 zmm registers. Each step loads 4 token
 * vectors (the chunk's activations, streamed from L2) and 6 weight vectors
 * (rows that stay in L1 for all the chunk's tokens) for 24 fmas: 10.7 bytes
 * from L2 per fma against 16 for a 4 x 4 tile. It needs the 6 rows and the
 * 4 token rows passing by to fit L1 (48 KiB here), so rows wider than
 * TILE6_MAX_COLS go by in column blocks (rows6_kblocked). Short rows
 * (attention keys, 64-128 wide) keep the 4 x 4 tile: there the
 * reductions weigh as much as the fmas. */
#define TILE6_MIN_COLS 256
#define TILE6_MAX_COLS 1024

/* 6 x 4 tiles over rows wider than TILE6_MAX_COLS: the columns go by in
 * blocks of KB_CHUNKS x 16, and between blocks each tile keeps its 24
 * accumulators in memory (a zmm stored and reloaded is the same 16 floats,
 * so every lane's fma chain is unchanged), so the 6 rows' block stays in L1
 * for all the chunk's tokens. */
#define KB_CHUNKS 32
ALWAYS_INLINE void tile6_part(const int TT, const float *w, size_t ldw, const float *X, size_t ldx,
                              size_t c0, size_t c1, __mmask16 tail, __m512 *keep, const int first,
                              const int last, const float *scales, size_t r, float *Y, size_t ldy) {
    __m512 acc[8][4];
    for (int i = 0; i < 6; i++)
        for (int j = 0; j < TT; j++) acc[i][j] = first ? _mm512_setzero_ps() : keep[4 * i + j];
    for (size_t c = c0; c < c1; c++) {
        __m512 x[4];
        for (int j = 0; j < TT; j++) x[j] = _mm512_loadu_ps(X + j * ldx + 16 * c);
        for (int i = 0; i < 6; i++) {
            const __m512 wv = _mm512_loadu_ps(w + i * ldw + 16 * c);
            for (int j = 0; j < TT; j++) acc[i][j] = _mm512_fmadd_ps(wv, x[j], acc[i][j]);
        }
    }
    if (tail) { /* lanes past the end must stay untouched: a lane may hold -0 */
        __m512 x[4];
        for (int j = 0; j < TT; j++) x[j] = _mm512_maskz_loadu_ps(tail, X + j * ldx + 16 * c1);
        for (int i = 0; i < 6; i++) {
            const __m512 wv = _mm512_maskz_loadu_ps(tail, w + i * ldw + 16 * c1);
            for (int j = 0; j < TT; j++) acc[i][j] = _mm512_mask3_fmadd_ps(wv, x[j], acc[i][j], tail);
        }
    }
    if (last) {
        store_tile(acc, 6, TT, scales, r, Y, ldy);
        return;
    }
    for (int i = 0; i < 6; i++)
        for (int j = 0; j < TT; j++) keep[4 * i + j] = acc[i][j];
}

/* Scratch of one multi-token call (the thread's kept heap buffer,
 * csrc/scratch.h): rows dequantized for the tile and the column-blocked
 * tiles' accumulators (up to 120 KiB, too much for the stack of a small
 * thread, e.g. musl's 128 KiB default). */
typedef struct {
    float *rows;         /* 6 x cols floats, 64-byte aligned */
    __m512 (*keep)[24];  /* TOKEN_CHUNK / 4 tiles x 24 accumulators */
} tile_scratch;

/* Rows r..r+5 of an fp32 matrix (or the dequantized buffer) for T <=
 * TOKEN_CHUNK tokens. */
static void rows6_kblocked(const cism_mat *W, size_t r, const float *X, size_t ldx, size_t T,
                           float *Y, size_t ldy, __m512 (*keep)[24]) {
    const size_t n = W->cols, full = n / 16, rem = n % 16, ldw = W->row_bytes / sizeof(float);
    const float *w = (const float *)W->codes + r * ldw;
    const size_t blocks = cism_div_up(full, KB_CHUNKS); /* full > 0: wider than TILE6_MAX_COLS */
    const size_t cb = KB_CHUNKS * 64, slice = pf_slice(cb, T);
    const int pf = W->rows > 6; /* not the 6 dequantized rows of rows_deq */
    for (size_t b = 0; b < blocks; b++) {
        const size_t c0 = b * KB_CHUNKS, c1 = c0 + KB_CHUNKS < full ? c0 + KB_CHUNKS : full;
        const int first = b == 0, last = b + 1 == blocks;
        const __mmask16 tail = last && rem ? (__mmask16)((1u << rem) - 1) : 0;
        /* the next column block of these rows, or the next rows' first,
         * into L2, a slice per 4 tokens (1024 x 3072 and 1024 x 2048: 3-5%) */
        const char *next = !pf ? NULL
                           : !last ? (const char *)(w + 16 * c1)
                           : r + 12 <= W->rows ? (const char *)(w + 6 * ldw) : NULL;
        size_t t = 0, k = 0;
        for (; t + 4 <= T; t += 4, k++) {
            if (next) pf_part(next, 6, W->row_bytes, cb, slice, k);
            tile6_part(4, w, ldw, X + t * ldx, ldx, c0, c1, tail, keep[k], first, last, W->scales, r,
                       Y + t * ldy, ldy);
        }
        switch (T - t) {
        case 3: tile6_part(3, w, ldw, X + t * ldx, ldx, c0, c1, tail, keep[k], first, last, W->scales, r, Y + t * ldy, ldy); break;
        case 2: tile6_part(2, w, ldw, X + t * ldx, ldx, c0, c1, tail, keep[k], first, last, W->scales, r, Y + t * ldy, ldy); break;
        case 1: tile6_part(1, w, ldw, X + t * ldx, ldx, c0, c1, tail, keep[k], first, last, W->scales, r, Y + t * ldy, ldy); break;
        default: break;
        }
    }
}

/* Prefill rows r..r+R-1 of a packed (not fp32) matrix: they are
 * dequantized once per token chunk into the scratch rows and the fp32 tile
 * runs over it, so the unpacking is shared by up to TOKEN_CHUNK tokens.
 * The floats are the very weights the direct tile would use, so every dot
 * is unchanged. Rows longer than DEQ_MAX_COLS take the direct tile. */
#define DEQ_MAX_COLS 4096
ALWAYS_INLINE void rows_deq(const int S, const int R, const cism_mat *W, size_t r, const float *X,
                            size_t ldx, size_t T, float *Y, size_t ldy, const tile_scratch *sc) {
    dequant_rows(S, R, W, r, sc->rows);
    const cism_mat F = {CISM_FP32, (size_t)R, W->cols, sc->rows, W->cols * sizeof(float), 0,
                        S == CISM_INT8 ? W->scales + r : NULL};
    if (R == 6 && W->cols > TILE6_MAX_COLS) rows6_kblocked(&F, 0, X, ldx, T, Y + r, ldy, sc->keep);
    else rows_f32(CISM_FP32, R, &F, 0, X, ldx, T, Y + r, ldy);
}

/* Rows r..r+R-1 (R <= 6) for tn tokens: through the buffer (DEQ) or
 * directly. */
ALWAYS_INLINE void rows_tiled(const int S, const int DEQ, const int R, const cism_mat *W, size_t r,
                              const float *X, size_t ldx, size_t tn, float *Y, size_t ldy,
                              const tile_scratch *sc) {
    if (DEQ) rows_deq(S, R, W, r, X, ldx, tn, Y, ldy, sc);
    else if (S == CISM_FP32 && R == 6 && W->cols > TILE6_MAX_COLS)
        rows6_kblocked(W, r, X, ldx, tn, Y, ldy, sc->keep);
    else rows_f32(S, R, W, r, X, ldx, tn, Y, ldy);
}

/* Rows r0..r1: 6-row tiles (when SIX), then 4-row tiles, then one tile of
 * the last 1-3 rows. */
ALWAYS_INLINE void rows_range(const int S, const int DEQ, const int SIX, const cism_mat *W, size_t r0,
                              size_t r1, const float *X, size_t ldx, size_t tn, float *Y, size_t ldy,
                              const tile_scratch *sc) {
    size_t r = r0;
    if (SIX)
        for (; r + 6 <= r1; r += 6) rows_tiled(S, DEQ, 6, W, r, X, ldx, tn, Y, ldy, sc);
    for (; r + 4 <= r1; r += 4) rows_tiled(S, DEQ, 4, W, r, X, ldx, tn, Y, ldy, sc);
    switch (r1 - r) {
    case 3: rows_tiled(S, DEQ, 3, W, r, X, ldx, tn, Y, ldy, sc); break;
    case 2: rows_tiled(S, DEQ, 2, W, r, X, ldx, tn, Y, ldy, sc); break;
    case 1: rows_tiled(S, DEQ, 1, W, r, X, ldx, tn, Y, ldy, sc); break;
    default: break;
    }
}

ALWAYS_INLINE void gemm_f32_tpl(const int S, const cism_mat *W, size_t r0, size_t r1,
                                const cism_act *A, size_t T, float *Y, size_t ldy) {
    if (T == 1) {
        /* 4-bit rows: 8 rows of dequantization would spill vector registers */
        const int R = S == CISM_FP32 || S == CISM_FP16 || S == CISM_INT8 || S == CISM_Q4K || S == CISM_Q6K ? 8 : 4;
        const size_t L = (r1 - r0) / R;
        for (size_t j = 0; j < L; j++) tile_f32(S, R, 1, W, r0 + j, L, A->x, A->ldx, Y, ldy);
        for (size_t r = r0 + R * L; r < r1; r++) tile_f32(S, 1, 1, W, r, 1, A->x, A->ldx, Y, ldy);
        return;
    }
    /* scratch for the dequantized rows (packed rows, more than 4 tokens)
     * and for column-blocked tiles (rows past TILE6_MAX_COLS); if it cannot
     * be had, the direct tiles do the work (4 x 4 past TILE6_MAX_COLS) */
    const int deq = S != CISM_FP32 && T > 4 && W->cols <= DEQ_MAX_COLS;
    const int kb = W->cols > TILE6_MAX_COLS && (S == CISM_FP32 || deq);
    tile_scratch sc = {NULL, NULL};
    void *mem = NULL;
    if (deq || kb) {
        const size_t rows_bytes = deq ? cism_div_up(6 * W->cols * sizeof(float), 64) * 64 : 0;
        mem = cism_scratch_get(rows_bytes + (kb ? sizeof(__m512) * 24 * (TOKEN_CHUNK / 4) : 0));
        if (mem) {
            sc.rows = deq ? (float *)mem : NULL;
            sc.keep = kb ? (__m512(*)[24])((char *)mem + rows_bytes) : NULL;
        }
    }
    const int six = W->cols >= TILE6_MIN_COLS && (W->cols <= TILE6_MAX_COLS || sc.keep);
    for (size_t t0 = 0; t0 < T; t0 += TOKEN_CHUNK) {
        const size_t tn = T - t0 < TOKEN_CHUNK ? T - t0 : TOKEN_CHUNK;
        const float *X = A->x + t0 * A->ldx;
        float *Yc = Y + t0 * ldy;
        if (S == CISM_FP32) {
            if (six) rows_range(S, 0, 1, W, r0, r1, X, A->ldx, tn, Yc, ldy, &sc);
            else rows_range(S, 0, 0, W, r0, r1, X, A->ldx, tn, Yc, ldy, &sc);
        } else if (tn > 4 && sc.rows) {
            if (six) rows_range(S, 1, 1, W, r0, r1, X, A->ldx, tn, Yc, ldy, &sc);
            else rows_range(S, 1, 0, W, r0, r1, X, A->ldx, tn, Yc, ldy, &sc);
        } else { /* few tokens, very long rows or no scratch: packed rows read directly */
            size_t r = r0;
            for (; r + 4 <= r1; r += 4) rows_f32(S, 4, W, r, X, A->ldx, tn, Yc, ldy);
            for (; r < r1; r++) rows_f32(S, 1, W, r, X, A->ldx, tn, Yc, ldy);
        }
    }
    cism_scratch_put(mem);
}

#define GEMM_F32(NAME, S)                                                                        \
    static void NAME(const cism_mat *W, size_t r0, size_t r1, const cism_act *A, size_t T,       \
                     float *Y, size_t ldy) {                                                     \
        gemm_f32_tpl(S, W, r0, r1, A, T, Y, ldy);                                                \
    }
GEMM_F32(gemm_fp32_avx512, CISM_FP32)
GEMM_F32(gemm_fp16_avx512, CISM_FP16)
GEMM_F32(gemm_int8_avx512, CISM_INT8)
GEMM_F32(gemm_int4_avx512, CISM_INT4)
GEMM_F32(gemm_fp4_avx512, CISM_FP4)
GEMM_F32(gemm_q4k_avx512, CISM_Q4K)
GEMM_F32(gemm_q6k_avx512, CISM_Q6K)

void cism_fill_gemm_avx512(cism_kernels *k) {
    fill_e4m3_half();
    k->gemm[CISM_FP32] = gemm_fp32_avx512;
    k->gemm[CISM_FP16] = gemm_fp16_avx512;
    k->gemm[CISM_INT8] = gemm_int8_avx512;
    k->gemm[CISM_INT4] = gemm_int4_avx512;
    k->gemm[CISM_FP4] = gemm_fp4_avx512;
    k->gemm[CISM_Q4K] = gemm_q4k_avx512;
    k->gemm[CISM_Q6K] = gemm_q6k_avx512;
    k->name_gemm = "avx512";
}
