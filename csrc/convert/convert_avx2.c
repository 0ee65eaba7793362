/* AVX2 (+FMA, F16C) conversions: floats to binary16 (to_f16) and to q8
 * activations (quant8), bit for bit convert_ref.c. */
#include "simd_avx2.h"

/* n floats to binary16 (vcvtps2ph, nearest even), out[i * stride]. */
static void to_f16_avx2(const float *x, size_t n, uint16_t *out, size_t stride) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        if (stride == 1) {
            _mm_storeu_si128((__m128i *)(out + i), h);
        } else {
            uint16_t t[8];
            _mm_storeu_si128((__m128i *)t, h);
            for (size_t j = 0; j < 8; j++) out[(i + j) * stride] = t[j];
        }
    }
    for (; i < n; i++) out[i * stride] = cism_f32_to_fp16(x[i]);
}

/* One 32-element block: four vectors (zero past n), their lane masks and the
 * absolute maximum. max_ps(|x|, m) is the reference's `|x| > m ? |x| : m`
 * lane by lane (a NaN element is skipped, as there). */
ALWAYS_INLINE float block_absmax(const float *x, size_t start, size_t n, __m256 v[4], __m256 in[4]) {
    const long left = start < n ? (long)(n - start) : 0;
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 m = _mm256_setzero_ps();
    for (int k = 0; k < 4; k++) {
        const __m256i mk = lane_mask(left - 8 * k);
        in[k] = _mm256_castsi256_ps(mk);
        v[k] = left >= 32 ? _mm256_loadu_ps(x + start + 8 * k) : _mm256_maskload_ps(x + start + 8 * k, mk);
        m = _mm256_max_ps(_mm256_and_ps(v[k], abs_mask), m);
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
    return _mm_cvtss_f32(m4);
}

/* rint(v * norm) clamped to +-limit, as int32, and 0 past n. min_ps(q, l) is
 * `q < l ? q : l` and max_ps(q, -l) is `q > -l ? q : -l`, the reference's
 * clamps, NaN included (NaN inputs only: quant_norm keeps the norm finite). */
ALWAYS_INLINE __m256i quant_lanes(__m256 v, __m256 in, __m256 norm, __m256 limit) {
    __m256 q = _mm256_round_ps(_mm256_mul_ps(v, norm), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    q = _mm256_min_ps(q, limit);
    q = _mm256_max_ps(q, _mm256_sub_ps(_mm256_setzero_ps(), limit));
    return _mm256_cvtps_epi32(_mm256_and_ps(q, in));
}

static void quant8_avx2(const float *x, size_t n, int8_t *q, float *scales) {
    const size_t len = cism_act_len(n);
    const __m256 limit = _mm256_set1_ps(127.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (size_t b = 0; b * 32 < len; b++) {
        __m256 v[4], in[4];
        float m = block_absmax(x, 32 * b, n, v, in);
        const __m256 norm = _mm256_set1_ps(quant_norm(&m, 127.0f));
        scales[b] = m / 127.0f;
        const __m256i p01 = _mm256_packs_epi32(quant_lanes(v[0], in[0], norm, limit), quant_lanes(v[1], in[1], norm, limit));
        const __m256i p23 = _mm256_packs_epi32(quant_lanes(v[2], in[2], norm, limit), quant_lanes(v[3], in[3], norm, limit));
        /* dword k of packs_epi16 holds 4 codes of vector k % 4, half k / 4 */
        const __m256i p = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p01, p23), order);
        _mm256_storeu_si256((__m256i *)(q + 32 * b), p);
    }
}

void cism_fill_convert_avx2(cism_kernels *k) {
    k->to_f16 = to_f16_avx2;
    k->quant8 = quant8_avx2;
    k->name_quant = "avx2";
}
