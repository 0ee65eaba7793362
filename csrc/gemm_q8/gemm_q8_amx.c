/* The amx level's integer weights x q8 activations: the exact int8, int4
 * and fp4 gemms on the tile unit (TDPBSSD), bit for bit gemm_q8_ref.c.
 * Below them (few tokens, no scratch, and fp4 from FP4_TILE_MAX_TOKENS on)
 * run the avx512vnni kernels of q8_vnni.h, built here with this level's
 * flags: every AMX CPU has AVX512-VBMI and GFNI, so fp4 codes are looked
 * up with vpermb (no nibble masks) and int4 nibbles become code - 8 with
 * one vgf2p8affineqb. (tests/test_amx_emulated.py builds this file without
 * -mavx512vbmi or -mgfni on a VNNI CPU that lacks them: then the portable
 * byte operations.) The table filler installs it only where Linux granted
 * this process the tile state. */
#include "simd_amx.h"

#ifdef __GFNI__
/* vgf2p8affineqb computes each byte as an 8x8 bit matrix (the qword at the
 * same place, result bit i from the matrix's byte 7 - i) times the byte,
 * plus a constant: these pick a nibble as 0..15 (constant 0), or as the
 * signed byte code - 8 (constant 0xf8: bits 3-7 are the nibble's top bit
 * flipped, bits 0-2 its low bits), in one instruction. */
#define NIB_LO_U 0x0102040800000000LL
#define NIB_HI_U 0x1020408000000000LL
#define NIB_LO_S 0x0102040808080808LL
#define NIB_HI_S 0x1020408080808080LL

ALWAYS_INLINE __m512i int4_nibbles_gfni(__m512i z, const int SIGNED) {
    if (SIGNED)
        return _mm512_gf2p8affine_epi64_epi8(
            z, _mm512_setr_epi64(NIB_LO_S, NIB_LO_S, NIB_HI_S, NIB_HI_S, NIB_LO_S, NIB_LO_S, NIB_HI_S, NIB_HI_S), 0xf8);
    return _mm512_gf2p8affine_epi64_epi8(
        z, _mm512_setr_epi64(NIB_LO_U, NIB_LO_U, NIB_HI_U, NIB_HI_U, NIB_LO_U, NIB_LO_U, NIB_HI_U, NIB_HI_U), 0);
}

ALWAYS_INLINE __m512i nib_hi_gfni(__m512i x) { return _mm512_gf2p8affine_epi64_epi8(x, _mm512_set1_epi64(NIB_HI_U), 0); }
#define Q8_INT4_NIBBLES int4_nibbles_gfni
#define Q8_NIB_HI nib_hi_gfni
#else
#define Q8_INT4_NIBBLES int4_nibbles_shift
#define Q8_NIB_HI nib_hi_shift
#endif

#ifdef __AVX512VBMI__
/* vpermb reads an index's low 6 bits, and the table repeats every 16. */
ALWAYS_INLINE __m512i lut16_vpermb(__m512i table, __m512i idx) { return _mm512_permutexvar_epi8(idx, table); }
#define Q8_LUT16 lut16_vpermb
#else
#define Q8_LUT16 lut16_pshufb
#endif

#define Q8_DOT4 dot4_vnni
#define Q8_I8_SUMS i8_sums_vnni
#include "q8_vnni.h"

/* the avx512vnni kernels, for what the tiles leave to them */
GEMM_Q_VNNI(gemm_int8_q8_avx512vnni, CISM_INT8)
GEMM_Q_VNNI(gemm_int4_q8_avx512vnni, CISM_INT4)
GEMM_Q_VNNI(gemm_fp4_q8_avx512vnni, CISM_FP4)

/* ---- int8 x q8 on the tile unit: the canonical arithmetic, bit for bit ----
 *
 * The one-chain rule of kernels.h needs, per (row, token) and block b, the
 * exact integer sum s_b of the block's 32 products; TDPBSSD sums signed
 * byte products into int32 exactly, so a tile step with K = 32 bytes gives
 * 16 rows x 16 tokens of them at once, in whatever order the unit likes.
 * The float chain then runs on vectors (lane = token): acc[m] =
 * fma((float)C[m][:], ascale_b[:], acc[m]) block by block, and the row scale
 * multiplies the finished dot. Same bits as gemm_q8_ref.c, any T, any split.
 *
 * Tiles: A = 16 weight rows x 32 bytes, loaded straight from the packed
 * rows (stride row_bytes); B = 8 rows x 16 tokens x 4 bytes, the q8
 * activations of one block transposed once per call; C = int32 16 x 16.
 * Two blocks go through C0/C1 or C2/C3 per step, are stored and folded
 * into the chain in block order, the next step's tile work overlapping
 * this step's vector work. Below Q8_MIN_TOKENS the VNNI tiles run (a tile
 * step costs the same for 1 token as for 16). */
#define Q8_MIN_TOKENS 8
#define Q8_GROUPS 4 /* token groups of 16 per pass over the rows */

/* kb: bytes of K per block (32 for int8 and int4 blocks, 16 for fp4). */
static void amx_configure_q8(int kb) {
    volatile tile_config cfg;
    memset((void *)&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 4; t++) { /* C: 16 rows x 16 int32 */
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    for (int t = 4; t < 6; t++) { /* A: 16 weight rows x kb bytes */
        cfg.rows[t] = 16;
        cfg.colsb[t] = (uint16_t)kb;
    }
    for (int t = 6; t < 8; t++) { /* B: kb / 4 dword rows x 16 tokens */
        cfg.rows[t] = (uint8_t)(kb / 4);
        cfg.colsb[t] = 64;
    }
    __asm__ volatile("" ::: "memory");
    _tile_loadconfig((const void *)&cfg);
}

/* Blocks b and b+1 (when two) of 16 weight rows, block b's bytes at a
 * (row stride lda) and block b+1's at a + KB, times the B tiles at Bg,
 * into C tiles CA and CB, stored at c and c + 256. Tile numbers must be
 * constants: set 0 is C0/C1, set 1 C2/C3 (the operands A4/B6, A5/B7). */
#define Q8_ISSUE(CA, CB)                                     \
    do {                                                     \
        _tile_zero(CA);                                      \
        _tile_loadd(4, a, (long)lda);                        \
        _tile_loadd(6, Bg + 4 * KB * b, 64);                 \
        _tile_dpbssd(CA, 4, 6);                              \
        if (two) {                                           \
            _tile_zero(CB);                                  \
            _tile_loadd(5, a + KB, (long)lda);               \
            _tile_loadd(7, Bg + 4 * KB * (b + 1), 64);       \
            _tile_dpbssd(CB, 5, 7);                          \
        }                                                    \
        _tile_stored(CA, c, 64);                             \
        if (two) _tile_stored(CB, c + 256, 64);              \
    } while (0)

ALWAYS_INLINE void q8_issue0(const int KB, const int8_t *a, size_t lda, const int32_t *Bg, size_t b, int two,
                             int32_t *c) {
    Q8_ISSUE(0, 1);
}
ALWAYS_INLINE void q8_issue1(const int KB, const int8_t *a, size_t lda, const int32_t *Bg, size_t b, int two,
                             int32_t *c) {
    Q8_ISSUE(2, 3);
}

/* The chain step of blocks b (and b+1): acc[m] = fma((float)C[m][:], scale, acc[m]). */
ALWAYS_INLINE void q8_fold(const int32_t *c, const float *Sg, size_t b, int two, __m512 acc[16]) {
    for (int q = 0; q < 1 + two; q++) {
        const __m512 s = _mm512_load_ps(Sg + 16 * (b + q));
        for (int m = 0; m < 16; m++)
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512((const void *)(c + 256 * q + 16 * m))),
                                     s, acc[m]);
    }
}

static void gemm_int8_q8_amx(const cism_mat *W, size_t r0, size_t r1, const cism_act *A, size_t T,
                             float *Y, size_t ldy) {
    if (T < Q8_MIN_TOKENS) {
        gemm_int8_q8_avx512vnni(W, r0, r1, A, T, Y, ldy);
        return;
    }
    if (r1 <= r0) return;
    const size_t units = cism_div_up(W->cols, 64), blocks = cism_div_up(W->cols, 32);
    const size_t groups = cism_div_up(T, 16), rb = W->row_bytes;
    const size_t b_bytes = groups * units * 1024, s_bytes = groups * units * 128;
    const size_t tail_bytes = cism_div_up(16 * rb + 64, 64) * 64;
    uint8_t *mem = cism_scratch_get(b_bytes + s_bytes + 4096 + tail_bytes);
    if (!mem) { /* the VNNI tiles need no scratch and give the same bits */
        gemm_int8_q8_avx512vnni(W, r0, r1, A, T, Y, ldy);
        return;
    }
    int32_t *B = (int32_t *)mem;
    float *S = (float *)(mem + b_bytes);
    int32_t *c = (int32_t *)(mem + b_bytes + s_bytes);
    int8_t *tail = (int8_t *)(mem + b_bytes + s_bytes + 4096);
    for (size_t g = 0; g < groups; g++) {
        const size_t tn = T - 16 * g < 16 ? T - 16 * g : 16;
        pack_q8_group(A, 16 * g, tn, units, B + g * units * 256, S + g * units * 32, 0);
    }
    amx_configure_q8(32);
    /* 64 tokens at a time: their B tiles (64 x cols bytes) stay in L1 or
     * L2 while every row group goes through them */
    for (size_t g0 = 0; g0 < groups; g0 += Q8_GROUPS)
    for (size_t r = r0; r < r1; r += 16) {
        const size_t g1 = groups - g0 < Q8_GROUPS ? groups : g0 + Q8_GROUPS;
        const size_t rn = r1 - r < 16 ? r1 - r : 16;
        const int8_t *w = (const int8_t *)W->codes + r * rb;
        if (r + 16 > W->rows) {
            /* the tile would read past the matrix: a zero-padded copy */
            memset(tail, 0, tail_bytes);
            memcpy(tail, w, (W->rows - r) * rb);
            w = tail;
        }
        __m512 sc[16];
        for (size_t m = 0; m < 16; m++) sc[m] = _mm512_set1_ps(m < rn ? W->scales[r + m] : 0.0f);
        for (size_t g = g0; g < g1; g++) {
            const int32_t *Bg = B + g * units * 256;
            const float *Sg = S + g * units * 32;
            __m512 acc[16];
            for (int m = 0; m < 16; m++) acc[m] = _mm512_setzero_ps();
            /* two blocks per step, software pipelined: the tile unit works
             * on step k + 1 (the other C tiles and buffer) while the vector
             * units fold step k into the chains */
            const size_t steps = cism_div_up(blocks, 2);
            /* the tile loads stall on memory: while the first token group
             * goes through these rows, fetch the next 16 rows' line of each
             * step (two blocks = 64 bytes) */
            const int8_t *next = g == g0 && r + 32 <= r1 ? w + 16 * rb : NULL;
            q8_issue0(32, w, rb, Bg, 0, blocks > 1, c);
            for (size_t k = 0; k < steps; k += 2) {
                const size_t b0 = 2 * k, b1 = b0 + 2, b2 = b0 + 4;
                if (next)
                    for (int m = 0; m < 16; m++) {
                        _mm_prefetch((const char *)(next + m * rb + 32 * b0), _MM_HINT_T0);
                        _mm_prefetch((const char *)(next + m * rb + 32 * b1), _MM_HINT_T0);
                    }
                if (k + 1 < steps) q8_issue1(32, w + 32 * b1, rb, Bg, b1, b1 + 1 < blocks, c + 512);
                q8_fold(c, Sg, b0, b0 + 1 < blocks, acc);
                if (k + 2 < steps) q8_issue0(32, w + 32 * b2, rb, Bg, b2, b2 + 1 < blocks, c);
                if (k + 1 < steps) q8_fold(c + 512, Sg, b1, b1 + 1 < blocks, acc);
            }
            /* times the row scale, stored as token rows */
            for (int m = 0; m < 16; m++) acc[m] = _mm512_mul_ps(acc[m], sc[m]);
            store_rows16(acc, rn, T - 16 * g < 16 ? T - 16 * g : 16, Y, ldy, 16 * g, r);
        }
    }
    _tile_release();
    cism_scratch_put(mem);
}

/* ---- int4 and fp4 x q8 on the tile unit: the same rule, bit for bit ----
 *
 * kernels.h's chain for 4-bit weights needs the exact integer sum of each
 * weight block (32 elements for int4, 16 for fp4) and a scale per (row,
 * block). TDPBSSD multiplies signed bytes only, so each group of 16 rows is
 * unpacked once per pass into a 16 x (64 * units) scratch of signed bytes
 * (int4: code - 8; fp4: 2 * E2M1) in element order, with the rows' block
 * scales as floats (int4: the stored scales; fp4: e4m3 * 0.5), zero for
 * rows past the range. The tiles then run as for int8 over the scratch
 * (K = 32 bytes per int4 block, 16 per fp4 block: B tiles of 8 or 4 dword
 * rows of the same packed activations), and the fold computes c_b =
 * wscale_b * ascale_b (one rounding, lane = token) before its fma.
 *
 * One group of at most 16 tokens (batched decode) shares the unpacking
 * with no other group, so nq8_amx_group unpacks as it goes: one step (two
 * blocks) of 16 rows at a time, three steps ahead of the tiles, into a
 * ring of 1 KiB slots, and the steps of every row group run as one
 * pipelined sequence. The whole-row scratch (16 x 1536 bytes for SmolLM2's
 * down projection) next to 24 KiB of B tiles crowded L1, and each row
 * group's first tile load waited for its unpacking's stores. In-process
 * A/B, one thread, 16 tokens, weights cycling through L3: int4 3072 x 576
 * 9% and 576 x 1536 17% less time per call, fp4 18% on both. */

/* The chain step of blocks b (and b+1), the weight scales of block b at
 * cw (row m's at cw[m * ldc], block b+1's next to them):
 * acc[m] = fma((float)C[m][:], ascale_b[:] * cw[m * ldc], acc[m]). */
ALWAYS_INLINE void nib_fold(const int S, const int32_t *c, const float *Sg, const float *cw, size_t ldc,
                            size_t b, int two, __m512 acc[16]) {
    for (int q = 0; q < 1 + two; q++) {
        const size_t blk = b + q;
        const __m512 s = _mm512_load_ps(Sg + 16 * (S == CISM_INT4 ? blk : blk / 2));
        for (int m = 0; m < 16; m++) {
            const __m512 sc = _mm512_mul_ps(s, _mm512_set1_ps(cw[m * ldc + q]));
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512((const void *)(c + 256 * q + 16 * m))),
                                     sc, acc[m]);
        }
    }
}

/* Elements 32k..32k+31 of an fp4 row as signed bytes 2 * E2M1. */
ALWAYS_INLINE __m256i fp4_step(const uint8_t *row, size_t k) {
    /* byte j: elements 2j (low nibble) and 2j + 1 (high), interleaved */
    const __m128i x = _mm_loadu_si128((const __m128i *)(row + 16 * k)), m15 = _mm_set1_epi8(15);
    const __m128i lo = _mm_and_si128(x, m15), hi = _mm_and_si128(_mm_srli_epi16(x, 4), m15);
    const __m256i nib = _mm256_setr_m128i(_mm_unpacklo_epi8(lo, hi), _mm_unpackhi_epi8(lo, hi));
    return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)cism_e2m1_x2)), nib);
}
/* Step k (blocks 2k, 2k + 1; `both` when block 2k + 1 exists) of one
 * 4-bit row as signed bytes at slot (int4: the 64 bytes of unit k, fp4:
 * 32 bytes) and the two blocks' scales at sc, zero for a missing one. */
ALWAYS_INLINE void nib_row_step(const int S, const uint8_t *row, size_t so, size_t k, int both, int8_t *slot,
                                float *sc) {
    if (S == CISM_INT4) {
        _mm512_store_si512((void *)slot, int4_unit(1, row, k));
        if (both) {
            memcpy(sc, row + so + 8 * k, 8);
        } else {
            sc[0] = cism_int4_scale(row, so, 2 * k);
            sc[1] = 0.0f;
        }
    } else {
        _mm256_store_si256((__m256i *)slot, fp4_step(row, k));
        sc[0] = e4m3_half[row[so + 2 * k]];
        sc[1] = both ? e4m3_half[row[so + 2 * k + 1]] : 0.0f;
    }
}
/* Step k of 16 rows at slot (row stride 64) and sc (2 scales per row).
 * Rows past rn are zero: their dots are never stored, and zero codes keep
 * their chains at zero. */
ALWAYS_INLINE void nib_step16(const int S, const uint8_t *row0, size_t rb, size_t so, size_t rn, size_t k,
                              size_t blocks, int8_t *slot, float *sc) {
    const int both = 2 * k + 1 < blocks;
    if (rn == 16) {
        for (size_t m = 0; m < 16; m++) nib_row_step(S, row0 + m * rb, so, k, both, slot + 64 * m, sc + 2 * m);
        return;
    }
    for (size_t m = 0; m < 16; m++) {
        if (m < rn) {
            nib_row_step(S, row0 + m * rb, so, k, both, slot + 64 * m, sc + 2 * m);
        } else {
            _mm512_store_si512((void *)(slot + 64 * m), _mm512_setzero_si512());
            sc[2 * m] = sc[2 * m + 1] = 0.0f;
        }
    }
}

/* A position in nq8_amx_group's sequence of steps: step k of the row
 * group at r. */
typedef struct {
    size_t k, r;
} amx_pos;
ALWAYS_INLINE void amx_next(amx_pos *p, size_t steps) {
    if (++p->k == steps) {
        p->k = 0;
        p->r += 16;
    }
}

#define NIB_SLOTS 4
/* Rows r0..r1 of 4-bit weights for one group of up to 16 tokens. The
 * steps (two blocks each) of all row groups run as one sequence, row group
 * by row group: each step of 16 rows is unpacked three steps before its
 * tiles load it, into a ring of NIB_SLOTS 1 KiB slots, and the tile unit
 * works on the next step while the vector units fold this one, across
 * row groups too. */
ALWAYS_INLINE void nq8_amx_group(const int S, const cism_mat *W, size_t r0, size_t r1, const int32_t *Bg,
                                 const float *Sg, size_t T, float *Y, size_t ldy, int32_t *c, int8_t *ring,
                                 float *scr) {
    const int KB = S == CISM_INT4 ? 32 : 16;
    const size_t blocks = cism_div_up(W->cols, (size_t)KB), steps = cism_div_up(blocks, 2), rb = W->row_bytes;
    const size_t so = W->scale_offset, J = cism_div_up(r1 - r0, 16) * steps;
    const uint8_t *codes = (const uint8_t *)W->codes;
#define SLOT(j) (ring + 1024 * ((j) % NIB_SLOTS))
#define SCL(j) (scr + 32 * ((j) % NIB_SLOTS))
#define UNPACK(j, p)                                                                                       \
    nib_step16(S, codes + (p).r * rb, rb, so, r1 - (p).r < 16 ? r1 - (p).r : 16, (p).k, blocks, SLOT(j), SCL(j))
    amx_pos cur = {0, r0}, nxt = {0, r0}, unp = {0, r0};
    for (size_t j = 0; j < 3 && j < J; j++) {
        UNPACK(j, unp);
        amx_next(&unp, steps);
    }
    __m512 acc[16];
    for (int m = 0; m < 16; m++) acc[m] = _mm512_setzero_ps();
    q8_issue0(KB, SLOT(0), 64, Bg, 0, blocks > 1, c);
    amx_next(&nxt, steps);
    for (size_t j = 0; j < J; j += 2) {
        for (int h = 0; h < 2; h++) {
            const size_t i = j + h;
            if (i >= J) break;
            const size_t k = cur.k, r = cur.r;
            /* the next row group's packed rows, one line of each per step */
            if (64 * k < rb && r + 32 <= r1)
                for (int m = 0; m < 16; m++)
                    _mm_prefetch((const char *)(codes + (r + 16 + m) * rb + 64 * k), _MM_HINT_T0);
            if (i + 1 < J) {
                const size_t b = 2 * nxt.k;
                if (h == 0) q8_issue1(KB, SLOT(i + 1), 64, Bg, b, b + 1 < blocks, c + 512);
                else q8_issue0(KB, SLOT(i + 1), 64, Bg, b, b + 1 < blocks, c);
                amx_next(&nxt, steps);
            }
            if (i + 3 < J) {
                UNPACK(i + 3, unp);
                amx_next(&unp, steps);
            }
            if (k == 0)
                for (int m = 0; m < 16; m++) acc[m] = _mm512_setzero_ps();
            nib_fold(S, c + 512 * h, Sg, SCL(i), 2, 2 * k, 2 * k + 1 < blocks, acc);
            if (k + 1 == steps) store_rows16(acc, r1 - r < 16 ? r1 - r : 16, T, Y, ldy, 0, r);
            amx_next(&cur, steps);
        }
    }
#undef UNPACK
#undef SLOT
#undef SCL
}

ALWAYS_INLINE void gemm_nq8_amx_tpl(const int S, const cism_mat *W, size_t r0, size_t r1, const cism_act *A,
                                    size_t T, float *Y, size_t ldy) {
    const int KB = S == CISM_INT4 ? 32 : 16;
    if (T < Q8_MIN_TOKENS) {
        if (S == CISM_INT4) gemm_int4_q8_avx512vnni(W, r0, r1, A, T, Y, ldy);
        else gemm_fp4_q8_avx512vnni(W, r0, r1, A, T, Y, ldy);
        return;
    }
    if (r1 <= r0) return;
    const size_t units = cism_div_up(W->cols, 64), blocks = cism_div_up(W->cols, (size_t)KB);
    const size_t groups = cism_div_up(T, 16), kp = 64 * units, ldc = units * (64 / KB), rb = W->row_bytes;
    /* one token group: the ring of nq8_amx_group; else whole unpacked rows
     * (wb, cw) shared by up to Q8_GROUPS token groups */
    const int ring = groups == 1;
    const size_t b_bytes = groups * units * 1024, s_bytes = groups * units * 128;
    const size_t w_bytes = ring ? NIB_SLOTS * 1024 : 16 * kp;
    const size_t c_bytes = ring ? NIB_SLOTS * 32 * sizeof(float) : cism_div_up(16 * ldc * sizeof(float), 64) * 64;
    uint8_t *mem = cism_scratch_get(b_bytes + s_bytes + 4096 + w_bytes + c_bytes);
    if (!mem) { /* the VNNI tiles need no scratch and give the same bits */
        if (S == CISM_INT4) gemm_int4_q8_avx512vnni(W, r0, r1, A, T, Y, ldy);
        else gemm_fp4_q8_avx512vnni(W, r0, r1, A, T, Y, ldy);
        return;
    }
    int32_t *B = (int32_t *)mem;
    float *Sc = (float *)(mem + b_bytes);
    int32_t *c = (int32_t *)(mem + b_bytes + s_bytes);
    int8_t *wb = (int8_t *)(mem + b_bytes + s_bytes + 4096);
    float *cw = (float *)(mem + b_bytes + s_bytes + 4096 + w_bytes);
    for (size_t g = 0; g < groups; g++) {
        const size_t tn = T - 16 * g < 16 ? T - 16 * g : 16;
        pack_q8_group(A, 16 * g, tn, units, B + g * units * 256, Sc + g * units * 32, 0);
    }
    amx_configure_q8(KB);
    if (ring) {
        nq8_amx_group(S, W, r0, r1, B, Sc, T, Y, ldy, c, wb, cw);
        _tile_release();
        cism_scratch_put(mem);
        return;
    }
    const size_t steps = cism_div_up(blocks, 2);
    for (size_t g0 = 0; g0 < groups; g0 += Q8_GROUPS)
    for (size_t r = r0; r < r1; r += 16) {
        const size_t g1 = groups - g0 < Q8_GROUPS ? groups : g0 + Q8_GROUPS;
        const size_t rn = r1 - r < 16 ? r1 - r : 16;
        nib_unpack16(S, W, r, rn, units, wb, cw, ldc);
        /* while the first token group goes through these rows, fetch the
         * next group's packed rows, one line of each per step */
        const uint8_t *next = r + 32 <= r1 ? (const uint8_t *)W->codes + (r + 16) * rb : NULL;
        for (size_t g = g0; g < g1; g++) {
            const int32_t *Bg = B + g * units * 256;
            const float *Sg = Sc + g * units * 32;
            __m512 acc[16];
            for (int m = 0; m < 16; m++) acc[m] = _mm512_setzero_ps();
            /* two blocks per step, pipelined as in gemm_int8_q8_amx */
            q8_issue0(KB, wb, kp, Bg, 0, blocks > 1, c);
            for (size_t k = 0; k < steps; k += 2) {
                const size_t b0 = 2 * k, b1 = b0 + 2, b2 = b0 + 4;
                if (next && g == g0)
                    for (size_t h = 0; h < 2; h++)
                        if (64 * (k + h) < rb)
                            for (int m = 0; m < 16; m++)
                                _mm_prefetch((const char *)(next + m * rb + 64 * (k + h)), _MM_HINT_T0);
                if (k + 1 < steps) q8_issue1(KB, wb + KB * b1, kp, Bg, b1, b1 + 1 < blocks, c + 512);
                nib_fold(S, c, Sg, cw + b0, ldc, b0, b0 + 1 < blocks, acc);
                if (k + 2 < steps) q8_issue0(KB, wb + KB * b2, kp, Bg, b2, b2 + 1 < blocks, c);
                if (k + 1 < steps) nib_fold(S, c + 512, Sg, cw + b1, ldc, b1, b1 + 1 < blocks, acc);
            }
            store_rows16(acc, rn, T - 16 * g < 16 ? T - 16 * g : 16, Y, ldy, 16 * g, r);
        }
    }
    _tile_release();
    cism_scratch_put(mem);
}

static void gemm_int4_q8_amx(const cism_mat *W, size_t r0, size_t r1, const cism_act *A, size_t T,
                             float *Y, size_t ldy) {
    gemm_nq8_amx_tpl(CISM_INT4, W, r0, r1, A, T, Y, ldy);
}
/* fp4 blocks are 16 elements, so the tiles run at K = 16: per weight
 * element, twice the tile steps, stores and folds of int4. From
 * FP4_TILE_MAX_TOKENS tokens on the VNNI tokens-in-lanes kernel is faster
 * (single thread, SmolLM2's 3072 x 576 and 576 x 1536 in cache: 7-9% at
 * 32 tokens, 12-16% at 64 to 512; below 32 the tiles are 3-9% ahead), and
 * it gives the same bits. */
#define FP4_TILE_MAX_TOKENS 32
static void gemm_fp4_q8_amx(const cism_mat *W, size_t r0, size_t r1, const cism_act *A, size_t T,
                            float *Y, size_t ldy) {
    if (T >= FP4_TILE_MAX_TOKENS) gemm_fp4_q8_avx512vnni(W, r0, r1, A, T, Y, ldy);
    else gemm_nq8_amx_tpl(CISM_FP4, W, r0, r1, A, T, Y, ldy);
}

void cism_fill_gemm_q8_amx(cism_kernels *k) {
    fill_e4m3_half();
    k->gemm_int8_q8 = gemm_int8_q8_amx;
    k->gemm_int4_q8 = gemm_int4_q8_amx;
    k->gemm_fp4_q8 = gemm_fp4_q8_amx;
    k->name_gemm_q = "amx";
}
