/* x86 helpers shared by the SIMD kernel files of every level (avx2 and
 * up): only SSE-level intrinsics here, so each file compiled with its own
 * flags gets its own copy of the same instructions. Level-specific helpers
 * are in simd_avx2.h and simd_avx512.h. */
#ifndef CISM_SIMD_H
#define CISM_SIMD_H

#include "kernels.h"

#include <immintrin.h>
#include <string.h>

#define ALWAYS_INLINE static inline __attribute__((always_inline))
/* a helper some includers of a header do not call */
#define MAYBE_UNUSED static __attribute__((unused))
/* tokens per chunk of a multi-token call: their activations stay in L2 */
#define TOKEN_CHUNK 64

/* e4m3(b) * 0.5, exact (fp4 block scales). Each translation unit that
 * reads it has its own copy, filled by its table filler. */
MAYBE_UNUSED float e4m3_half[256];

static inline void fill_e4m3_half(void) {
    for (int b = 0; b < 256; b++) e4m3_half[b] = cism_e4m3_to_f32((uint8_t)b) * 0.5f;
    e4m3_half[0x7f] = e4m3_half[0xff] = 0.0f; /* NaN codes are never packed */
}

/* ---- ggml K-quants (q4_k, q6_k): super-block fields ---- */

/* Bytes [sc_0..sc_7, m_0..m_7] of a Q4_K super-block's 12 packed 6-bit
 * scales and mins at s (cism_ggml_scale_min_k4 for all j at once: j < 4
 * the low six bits of bytes j and j + 4; j >= 4 the nibbles of byte j + 4
 * under the top two bits of bytes j - 4 and j). Reads 16 bytes (the block
 * goes on past them). */
ALWAYS_INLINE __m128i q4k_scale_bytes(const uint8_t *s) {
    const __m128i x = _mm_loadu_si128((const __m128i *)s);
    /* p: [s0-3, s8-11, s4-7, s8-11]; q: the bytes whose top bits go on top */
    const __m128i p = _mm_shuffle_epi8(x, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
    const __m128i q = _mm_shuffle_epi8(x, _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7));
    const __m128i low = _mm_and_si128(p, _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0));
    const __m128i high_nib = _mm_and_si128(_mm_srli_epi16(p, 4), _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15));
    const __m128i top = _mm_srli_epi16(_mm_and_si128(q, _mm_set1_epi8((char)0xc0)), 2);
    return _mm_or_si128(_mm_or_si128(low, high_nib), top);
}

ALWAYS_INLINE size_t kq_block_bytes(const int S) { return S == CISM_Q4K ? CISM_Q4_K_BYTES : CISM_Q6_K_BYTES; }

/* Decode asks for the super-block KQ_PF ahead of blk (prefetches past the
 * matrix are harmless): the rows' unpacking is slow enough that the
 * hardware prefetchers fall behind (AVX-512, one thread, DRAM: q6_k x fp32 6.0 ->
 * 7.5 GB/s, q4_k x int8 17 -> 20.5, q6_k x int8 14 -> 17.4). */
#define KQ_PF 4
ALWAYS_INLINE void kq_prefetch(const int S, const uint8_t *blk) {
    for (size_t o = 0; o < kq_block_bytes(S); o += 64)
        _mm_prefetch((const char *)blk + KQ_PF * kq_block_bytes(S) + o, _MM_HINT_T0);
}

#endif
