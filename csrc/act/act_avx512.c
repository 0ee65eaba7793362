/* AVX-512 vector activations, 16 floats per step.
 *
 * Bit for bit the scalar reference (act_ref.c), with the same rules as
 * act_avx2.c: the same operations in the same order (fma for fmaf, plain
 * mul/add for * and +, round-to-nearest-even for rintf, one IEEE division),
 * _mm512_min_ps(a, c) = a < c ? a : c and _mm512_max_ps(a, c) = a > c ? a : c
 * (so NaN clamps like the scalar code), ordered compares false for NaN. The
 * last n % 16 elements use masked loads and stores (masked-off lanes compute
 * on zeros and are never written). y may alias the inputs: each step loads
 * before it stores.
 */
#include "kernels.h"

#include <immintrin.h>
#include <float.h>
#include <math.h>

/* The constants of act_ref.c (tests compare the two levels bit for bit). */
#define EXP_HI 88.3762626647949f
#define EXP_LO -87.3365447505531f
#define LOG2E 1.44269504088896341f
#define LN2_HI 0.693359375f
#define LN2_LO -2.12194440e-4f

#define W 16

static inline __m512 neg16(__m512 x) {
    return _mm512_castsi512_ps(
        _mm512_xor_si512(_mm512_castps_si512(x), _mm512_set1_epi32((int)0x80000000u)));
}

/* x < 0 ? -x : x (keeps -0 and the sign of NaN, as the reference does) */
static inline __m512 abs16(__m512 x) {
    const __mmask16 lt0 = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
    return _mm512_mask_blend_ps(lt0, x, neg16(x));
}

static inline __m512 exp16(__m512 x) {
    __m512 xc = _mm512_min_ps(x, _mm512_set1_ps(EXP_HI));
    xc = _mm512_max_ps(xc, _mm512_set1_ps(-88.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(LOG2E)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-LN2_HI), xc);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(-LN2_LO), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    const __m512 z = _mm512_mul_ps(r, r);
    p = _mm512_add_ps(_mm512_fmadd_ps(p, z, r), _mm512_set1_ps(1.0f));
    /* n is an integer in [-127, 127], so truncation is exact */
    const __m512i ni = _mm512_cvttps_epi32(n);
    const __m512 scale = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_add_epi32(ni, _mm512_set1_epi32(127)), 23));
    const __m512 y = _mm512_mul_ps(p, scale);
    const __mmask16 under = _mm512_cmp_ps_mask(x, _mm512_set1_ps(EXP_LO), _CMP_LT_OQ);
    return _mm512_maskz_mov_ps((__mmask16)~under, y); /* +0 where x < EXP_LO */
}

static inline __m512 sigmoid16(__m512 x) {
    const __m512 e = exp16(neg16(abs16(x)));
    const __mmask16 ge0 = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GE_OQ);
    const __m512 num = _mm512_mask_blend_ps(ge0, e, _mm512_set1_ps(1.0f));
    return _mm512_div_ps(num, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
}

static inline __m512 gelu16(__m512 x) {
    const __m512 ax = abs16(x);
    const __m512 z = _mm512_mul_ps(ax, _mm512_set1_ps(0.707106781186547524f));
    const __m512 t = _mm512_div_ps(_mm512_set1_ps(1.0f),
                                   _mm512_fmadd_ps(_mm512_set1_ps(0.5f), z, _mm512_set1_ps(1.0f)));
    __m512 p = _mm512_set1_ps(0.17087277f);
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(-0.82215223f));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(1.48851587f));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(-1.13520398f));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(0.27886807f));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(-0.18628806f));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(0.09678418f));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(0.37409196f));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(1.00002368f));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(-1.26551223f));
    const __m512 e = exp16(_mm512_fmadd_ps(neg16(z), z, p));
    const __m512 half_erfc = _mm512_mul_ps(_mm512_set1_ps(0.5f), _mm512_mul_ps(t, e));
    const __mmask16 ge0 = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GE_OQ);
    const __m512 phi = _mm512_mask_blend_ps(ge0, half_erfc,
                                            _mm512_sub_ps(_mm512_set1_ps(1.0f), half_erfc));
    return _mm512_mul_ps(x, phi);
}

static inline __m512 silu16(__m512 x) { return _mm512_mul_ps(x, sigmoid16(x)); }

static inline __mmask16 tail_mask(size_t rem) { return (__mmask16)((1u << rem) - 1u); }

#define UNARY(name, f)                                                        \
    static void name(const float *x, float *y, size_t n) {                    \
        size_t i = 0;                                                         \
        for (; i + W <= n; i += W) _mm512_storeu_ps(y + i, f(_mm512_loadu_ps(x + i))); \
        if (i < n) {                                                          \
            const __mmask16 m = tail_mask(n - i);                             \
            _mm512_mask_storeu_ps(y + i, m, f(_mm512_maskz_loadu_ps(m, x + i))); \
        }                                                                     \
    }

#define BINARY(name, f)                                                       \
    static void name(const float *a, const float *b, float *y, size_t n) {    \
        size_t i = 0;                                                         \
        for (; i + W <= n; i += W)                                            \
            _mm512_storeu_ps(y + i, _mm512_mul_ps(f(_mm512_loadu_ps(a + i)),  \
                                                  _mm512_loadu_ps(b + i)));   \
        if (i < n) {                                                          \
            const __mmask16 m = tail_mask(n - i);                             \
            _mm512_mask_storeu_ps(y + i, m, _mm512_mul_ps(f(_mm512_maskz_loadu_ps(m, a + i)), \
                                                          _mm512_maskz_loadu_ps(m, b + i))); \
        }                                                                     \
    }

UNARY(exp_avx512, exp16)
UNARY(sigmoid_avx512, sigmoid16)
UNARY(silu_avx512, silu16)
UNARY(gelu_avx512, gelu16)
BINARY(silu_mul_avx512, silu16)         /* (a * sigmoid(a)) * b */
BINARY(sigmoid_mul_avx512, sigmoid16)   /* sigmoid(a) * b */

/* The reference's 16 lanes are one zmm: its maximum and sum trees are
 * these halvings (vmaxps(a, b) = a > b ? a : b, the reference's rule). */
static inline float max_tree16(__m512 m) {
    __m256 h = _mm256_max_ps(_mm512_castps512_ps256(m), _mm512_extractf32x8_ps(m, 1));
    __m128 q = _mm_max_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    q = _mm_max_ps(q, _mm_movehl_ps(q, q)); /* lanes 0, 1: max(m0, m2), max(m1, m3) */
    return _mm_cvtss_f32(_mm_max_ss(q, _mm_shuffle_ps(q, q, 1)));
}

static inline float sum_tree16(__m512 s) {
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(s), _mm512_extractf32x8_ps(s, 1));
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    return _mm_cvtss_f32(_mm_add_ss(q, _mm_shuffle_ps(q, q, 1)));
}

/* The softmax's weight x / sum (0 <= x <= sum, 1 <= sum <= FLT_MAX), the
 * division's bits without its cost (vdivps: one vector per ~10 cycles):
 * y = 1 / sum rounded, q = x * y, then Markstein's correction q + r * y
 * with the residual r = x - q * sum (one fma, exact). The result is the
 * correctly rounded quotient whenever the residual is exact, which holds
 * while q is a normal number well above the underflow threshold (Boldo
 * and Daumas; the correction: Markstein 1990, Russinoff's verified proof).
 * Lanes with q < 2^-100 divide. 3.2e9 random pairs with sum in [1, 2^21)
 * and x in [2^-100, 1] (special significands included) matched vdivps
 * (tools/check_markstein.c). */
static inline __m512 weight16(__m512 x, __m512 sum, __m512 y) {
    const __m512 q = _mm512_mul_ps(x, y);
    const __m512 q2 = _mm512_fmadd_ps(_mm512_fnmadd_ps(q, sum, x), y, q);
    const __mmask16 small = _mm512_cmp_ps_mask(q, _mm512_set1_ps(0x1p-100f), _CMP_LT_OQ);
    return small ? _mm512_mask_div_ps(q2, small, x, sum) : q2;
}

static void softmax_avx512(float *x, size_t n, float scale) {
    const __m512 sc = _mm512_set1_ps(scale);
    const size_t full = n & ~(size_t)(W - 1);
    const __mmask16 tail = tail_mask(n - full);
    __m512 m = _mm512_set1_ps(-INFINITY);
    for (size_t i = 0; i < full; i += W) {
        const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(x + i), sc);
        _mm512_storeu_ps(x + i, v);
        m = _mm512_max_ps(v, m);
    }
    if (tail) {
        const __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(tail, x + full), sc);
        _mm512_mask_storeu_ps(x + full, tail, v);
        m = _mm512_mask_max_ps(m, tail, v, m);
    }
    const __m512 top = _mm512_set1_ps(max_tree16(m));
    __m512 s = _mm512_setzero_ps();
    for (size_t i = 0; i < full; i += W) {
        const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(x + i), top));
        _mm512_storeu_ps(x + i, e);
        s = _mm512_add_ps(s, e);
    }
    if (tail) {
        const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, x + full), top));
        _mm512_mask_storeu_ps(x + full, tail, e);
        s = _mm512_mask_add_ps(s, tail, s, e);
    }
    const float total = sum_tree16(s);
    const __m512 sum = _mm512_set1_ps(total);
    if (total >= 1.0f && total <= FLT_MAX) {
        const __m512 y = _mm512_div_ps(_mm512_set1_ps(1.0f), sum);
        for (size_t i = 0; i < full; i += W) _mm512_storeu_ps(x + i, weight16(_mm512_loadu_ps(x + i), sum, y));
        if (tail) _mm512_mask_storeu_ps(x + full, tail, weight16(_mm512_maskz_loadu_ps(tail, x + full), sum, y));
        return;
    }
    for (size_t i = 0; i < full; i += W) _mm512_storeu_ps(x + i, _mm512_div_ps(_mm512_loadu_ps(x + i), sum));
    if (tail) _mm512_mask_storeu_ps(x + full, tail, _mm512_div_ps(_mm512_maskz_loadu_ps(tail, x + full), sum));
}

/* argmax: each of 2 x 16 lanes keeps the first largest of its elements
 * (replaced only by a greater one: a NaN never wins) and its index; the
 * lanes then give the largest value, and among lanes that hold it the
 * smallest index, which is the reference's answer. Lanes start at -inf
 * with no index: if no element beats -inf, every element is -inf or NaN
 * and the reference keeps index 0. Indices are 32-bit (n < 2^31). */
static size_t argmax_avx512(const float *x, size_t n) {
    if (n < 64 || n >= ((size_t)1 << 31) || x[0] != x[0]) return cism_argmax_scan(x, 1, n, 0);
    const __m512i step = _mm512_set1_epi32(32), none = _mm512_set1_epi32(-1);
    __m512 b0 = _mm512_set1_ps(-INFINITY), b1 = b0;
    __m512i i0 = none, i1 = none;
    __m512i c0 = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i c1 = _mm512_add_epi32(c0, _mm512_set1_epi32(16));
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        const __m512 v0 = _mm512_loadu_ps(x + i), v1 = _mm512_loadu_ps(x + i + 16);
        const __mmask16 g0 = _mm512_cmp_ps_mask(b0, v0, _CMP_LT_OQ), g1 = _mm512_cmp_ps_mask(b1, v1, _CMP_LT_OQ);
        b0 = _mm512_mask_mov_ps(b0, g0, v0);
        b1 = _mm512_mask_mov_ps(b1, g1, v1);
        i0 = _mm512_mask_mov_epi32(i0, g0, c0);
        i1 = _mm512_mask_mov_epi32(i1, g1, c1);
        c0 = _mm512_add_epi32(c0, step);
        c1 = _mm512_add_epi32(c1, step);
    }
    /* explicitly aligned: GCC aligns such arrays to 64 bytes anyway and
     * then stores with vmovaps, but AddressSanitizer's fake stack frames
     * (detect_stack_use_after_return) honour only declared alignments */
    __attribute__((aligned(64))) float bv[32];
    __attribute__((aligned(64))) int32_t bi[32];
    _mm512_storeu_ps(bv, b0);
    _mm512_storeu_ps(bv + 16, b1);
    _mm512_storeu_si512((void *)bi, i0);
    _mm512_storeu_si512((void *)(bi + 16), i1);
    /* the tail, in order, against the lanes' winner (or index 0) */
    return cism_argmax_scan(x, i, n, cism_argmax_lanes(bv, bi, 32));
}

void cism_fill_act_avx512(cism_kernels *k) {
    k->exp = exp_avx512;
    k->sigmoid = sigmoid_avx512;
    k->silu = silu_avx512;
    k->gelu = gelu_avx512;
    k->silu_mul = silu_mul_avx512;
    k->sigmoid_mul = sigmoid_mul_avx512;
    k->softmax = softmax_avx512;
    k->argmax = argmax_avx512;
    k->name_act = "avx512";
}
