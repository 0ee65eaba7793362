/* AVX-512 (F/BW/VL/DQ) conversions: floats to binary16 (to_f16) and to q8
 * activations (quant8), bit for bit convert_ref.c. */
#include "simd_avx512.h"

/* n floats to binary16 (vcvtps2ph, nearest even: cism_f32_to_fp16's bits),
 * out[i * stride]. */
static void to_f16_avx512(const float *x, size_t n, uint16_t *out, size_t stride) {
    for (size_t i = 0; i < n; i += 16) {
        const __mmask16 m = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1);
        const __m256i h = _mm512_cvtps_ph(_mm512_maskz_loadu_ps(m, x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        if (stride == 1) {
            _mm256_mask_storeu_epi16(out + i, m, h);
        } else {
            uint16_t t[16];
            _mm256_storeu_si256((__m256i *)t, h);
            for (size_t j = 0; j < 16 && i + j < n; j++) out[(i + j) * stride] = t[j];
        }
    }
}

/* Absolute maximum and the two rounded halves of one 32-element block. */
ALWAYS_INLINE float block_absmax(const float *x, size_t start, size_t n, __m512 *v0, __m512 *v1) {
    const size_t left = start < n ? n - start : 0;
    const __mmask16 m0 = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1);
    const __mmask16 m1 = left >= 32 ? 0xffff : left > 16 ? (__mmask16)((1u << (left - 16)) - 1) : 0;
    *v0 = _mm512_maskz_loadu_ps(m0, x + start);
    *v1 = _mm512_maskz_loadu_ps(m1, x + start + 16);
    return _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(*v0), _mm512_abs_ps(*v1)));
}

ALWAYS_INLINE __m512i quant_half(__m512 v, float norm, float limit) {
    __m512 q = _mm512_roundscale_ps(_mm512_mul_ps(v, _mm512_set1_ps(norm)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    q = _mm512_min_ps(q, _mm512_set1_ps(limit));
    q = _mm512_max_ps(q, _mm512_set1_ps(-limit));
    return _mm512_cvtps_epi32(q);
}

static void quant8_avx512(const float *x, size_t n, int8_t *q, float *scales) {
    const size_t len = cism_act_len(n);
    for (size_t b = 0; b * 32 < len; b++) {
        __m512 v0, v1;
        float m = block_absmax(x, 32 * b, n, &v0, &v1);
        const float norm = quant_norm(&m, 127.0f);
        scales[b] = m / 127.0f;
        _mm_storeu_si128((__m128i *)(q + 32 * b), _mm512_cvtepi32_epi8(quant_half(v0, norm, 127.0f)));
        _mm_storeu_si128((__m128i *)(q + 32 * b + 16), _mm512_cvtepi32_epi8(quant_half(v1, norm, 127.0f)));
    }
}

void cism_fill_convert_avx512(cism_kernels *k) {
    k->to_f16 = to_f16_avx512;
    k->quant8 = quant8_avx512;
    k->name_quant = "avx512";
}
