/* AVX2 + FMA vector activations, 8 floats per step.
 *
 * Bit for bit the scalar reference (act_ref.c): every lane runs the same
 * operations in the same order (fma where it calls fmaf, a plain mul/add
 * where it writes * and +, round-to-nearest-even for rintf, one IEEE
 * division), and its selects are spelt as compares and blends with the same
 * NaN behaviour: _mm256_min_ps(a, c) is a < c ? a : c, _mm256_max_ps(a, c) is
 * a > c ? a : c, and the ordered compares are false for NaN like C's < and >=.
 * The last n % 8 elements go through a zero-padded stack buffer, so the tail
 * runs the same vector code. y may alias the inputs: each step loads before
 * it stores, and the tail copies its inputs out first.
 */
#include "kernels.h"

#include <immintrin.h>
#include <math.h>
#include <string.h>

/* The constants of act_ref.c (tests compare the two levels bit for bit). */
#define EXP_HI 88.3762626647949f
#define EXP_LO -87.3365447505531f
#define LOG2E 1.44269504088896341f
#define LN2_HI 0.693359375f
#define LN2_LO -2.12194440e-4f

#define W 8

static inline __m256 neg8(__m256 x) { return _mm256_xor_ps(x, _mm256_set1_ps(-0.0f)); }

/* x < 0 ? -x : x (keeps -0 and the sign of NaN, as the reference does) */
static inline __m256 abs8(__m256 x) {
    const __m256 lt0 = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ);
    return _mm256_blendv_ps(x, neg8(x), lt0);
}

static inline __m256 exp8(__m256 x) {
    __m256 xc = _mm256_min_ps(x, _mm256_set1_ps(EXP_HI));
    xc = _mm256_max_ps(xc, _mm256_set1_ps(-88.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(LOG2E)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_HI), xc);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_LO), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    const __m256 z = _mm256_mul_ps(r, r);
    p = _mm256_add_ps(_mm256_fmadd_ps(p, z, r), _mm256_set1_ps(1.0f));
    /* n is an integer in [-127, 127], so truncation is exact */
    const __m256i ni = _mm256_cvttps_epi32(n);
    const __m256 scale = _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_add_epi32(ni, _mm256_set1_epi32(127)), 23));
    const __m256 y = _mm256_mul_ps(p, scale);
    const __m256 under = _mm256_cmp_ps(x, _mm256_set1_ps(EXP_LO), _CMP_LT_OQ);
    return _mm256_andnot_ps(under, y); /* +0 where x < EXP_LO */
}

static inline __m256 sigmoid8(__m256 x) {
    const __m256 e = exp8(neg8(abs8(x)));
    const __m256 ge0 = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GE_OQ);
    const __m256 num = _mm256_blendv_ps(e, _mm256_set1_ps(1.0f), ge0);
    return _mm256_div_ps(num, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}

static inline __m256 gelu8(__m256 x) {
    const __m256 ax = abs8(x);
    const __m256 z = _mm256_mul_ps(ax, _mm256_set1_ps(0.707106781186547524f));
    const __m256 t = _mm256_div_ps(_mm256_set1_ps(1.0f),
                                   _mm256_fmadd_ps(_mm256_set1_ps(0.5f), z, _mm256_set1_ps(1.0f)));
    __m256 p = _mm256_set1_ps(0.17087277f);
    p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(-0.82215223f));
    p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(1.48851587f));
    p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(-1.13520398f));
    p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(0.27886807f));
    p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(-0.18628806f));
    p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(0.09678418f));
    p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(0.37409196f));
    p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(1.00002368f));
    p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(-1.26551223f));
    const __m256 e = exp8(_mm256_fmadd_ps(neg8(z), z, p));
    const __m256 half_erfc = _mm256_mul_ps(_mm256_set1_ps(0.5f), _mm256_mul_ps(t, e));
    const __m256 ge0 = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GE_OQ);
    const __m256 phi = _mm256_blendv_ps(half_erfc,
                                        _mm256_sub_ps(_mm256_set1_ps(1.0f), half_erfc), ge0);
    return _mm256_mul_ps(x, phi);
}

static inline __m256 silu8(__m256 x) { return _mm256_mul_ps(x, sigmoid8(x)); }

/* One loop shape per arity: full vectors, then the tail through a zero-padded
 * buffer (zeros are harmless inputs; only rem results are copied out). */
#define UNARY(name, f)                                                     \
    static void name(const float *x, float *y, size_t n) {                 \
        size_t i = 0;                                                      \
        for (; i + W <= n; i += W) _mm256_storeu_ps(y + i, f(_mm256_loadu_ps(x + i))); \
        if (i < n) {                                                       \
            float buf[W] = {0};                                            \
            memcpy(buf, x + i, (n - i) * sizeof(float));                   \
            _mm256_storeu_ps(buf, f(_mm256_loadu_ps(buf)));                \
            memcpy(y + i, buf, (n - i) * sizeof(float));                   \
        }                                                                  \
    }

#define BINARY(name, f)                                                    \
    static void name(const float *a, const float *b, float *y, size_t n) { \
        size_t i = 0;                                                      \
        for (; i + W <= n; i += W)                                         \
            _mm256_storeu_ps(y + i, _mm256_mul_ps(f(_mm256_loadu_ps(a + i)), \
                                                  _mm256_loadu_ps(b + i))); \
        if (i < n) {                                                       \
            float ba[W] = {0}, bb[W] = {0};                                \
            memcpy(ba, a + i, (n - i) * sizeof(float));                    \
            memcpy(bb, b + i, (n - i) * sizeof(float));                    \
            _mm256_storeu_ps(ba, _mm256_mul_ps(f(_mm256_loadu_ps(ba)), _mm256_loadu_ps(bb))); \
            memcpy(y + i, ba, (n - i) * sizeof(float));                    \
        }                                                                  \
    }

UNARY(exp_avx2, exp8)
UNARY(sigmoid_avx2, sigmoid8)
UNARY(silu_avx2, silu8)
UNARY(gelu_avx2, gelu8)
BINARY(silu_mul_avx2, silu8)         /* (a * sigmoid(a)) * b */
BINARY(sigmoid_mul_avx2, sigmoid8)   /* sigmoid(a) * b */

/* The reference's 16 lanes are two ymm, lo (elements 16c .. 16c + 7) and
 * hi (16c + 8 .. 16c + 15); its trees are these halvings (vmaxps(a, b) =
 * a > b ? a : b, the reference's rule). The last n % 16 elements go by
 * masked loads and stores; lanes past the end take no part. */
static inline float max_tree(__m256 lo, __m256 hi) {
    const __m256 h = _mm256_max_ps(lo, hi);
    __m128 q = _mm_max_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    q = _mm_max_ps(q, _mm_movehl_ps(q, q));
    return _mm_cvtss_f32(_mm_max_ss(q, _mm_shuffle_ps(q, q, 1)));
}

static inline float sum_tree(__m256 lo, __m256 hi) {
    const __m256 h = _mm256_add_ps(lo, hi);
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    return _mm_cvtss_f32(_mm_add_ss(q, _mm_shuffle_ps(q, q, 1)));
}

static void softmax_avx2(float *x, size_t n, float scale) {
    const __m256 sc = _mm256_set1_ps(scale), ninf = _mm256_set1_ps(-INFINITY);
    const size_t full = n & ~(size_t)15, rem = n - full;
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i klo = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)rem), idx);
    const __m256i khi = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)rem - 8), idx);
    float *const xt = x + full;
    __m256 mlo = ninf, mhi = ninf;
    for (size_t i = 0; i < full; i += 16) {
        const __m256 a = _mm256_mul_ps(_mm256_loadu_ps(x + i), sc), b = _mm256_mul_ps(_mm256_loadu_ps(x + i + 8), sc);
        _mm256_storeu_ps(x + i, a);
        _mm256_storeu_ps(x + i + 8, b);
        mlo = _mm256_max_ps(a, mlo);
        mhi = _mm256_max_ps(b, mhi);
    }
    if (rem) {
        const __m256 a = _mm256_mul_ps(_mm256_maskload_ps(xt, klo), sc);
        const __m256 b = _mm256_mul_ps(_mm256_maskload_ps(xt + 8, khi), sc);
        _mm256_maskstore_ps(xt, klo, a);
        _mm256_maskstore_ps(xt + 8, khi, b);
        mlo = _mm256_max_ps(_mm256_blendv_ps(ninf, a, _mm256_castsi256_ps(klo)), mlo);
        mhi = _mm256_max_ps(_mm256_blendv_ps(ninf, b, _mm256_castsi256_ps(khi)), mhi);
    }
    const __m256 top = _mm256_set1_ps(max_tree(mlo, mhi));
    __m256 slo = _mm256_setzero_ps(), shi = _mm256_setzero_ps();
    for (size_t i = 0; i < full; i += 16) {
        const __m256 a = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), top));
        const __m256 b = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i + 8), top));
        _mm256_storeu_ps(x + i, a);
        _mm256_storeu_ps(x + i + 8, b);
        slo = _mm256_add_ps(slo, a);
        shi = _mm256_add_ps(shi, b);
    }
    if (rem) {
        /* lanes past the end: exp of (0 - top) zeroed, so the sums keep their bits */
        const __m256 a = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_maskload_ps(xt, klo), top)), _mm256_castsi256_ps(klo));
        const __m256 b = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_maskload_ps(xt + 8, khi), top)), _mm256_castsi256_ps(khi));
        _mm256_maskstore_ps(xt, klo, a);
        _mm256_maskstore_ps(xt + 8, khi, b);
        slo = _mm256_add_ps(slo, a);
        shi = _mm256_add_ps(shi, b);
    }
    const __m256 sum = _mm256_set1_ps(sum_tree(slo, shi));
    for (size_t i = 0; i < full; i += 8) _mm256_storeu_ps(x + i, _mm256_div_ps(_mm256_loadu_ps(x + i), sum));
    if (rem) {
        _mm256_maskstore_ps(xt, klo, _mm256_div_ps(_mm256_maskload_ps(xt, klo), sum));
        _mm256_maskstore_ps(xt + 8, khi, _mm256_div_ps(_mm256_maskload_ps(xt + 8, khi), sum));
    }
}

/* argmax as act_avx512.c's: 4 x 8 lanes each keep the first largest of
 * their elements and its index, then the largest value and the smallest
 * index among the lanes that hold it, then the tail in order. */
static size_t argmax_avx2(const float *x, size_t n) {
    if (n < 64 || n >= ((size_t)1 << 31) || x[0] != x[0]) return cism_argmax_scan(x, 1, n, 0);
    __m256 b[4];
    __m256i ix[4], c[4];
    for (int j = 0; j < 4; j++) {
        b[j] = _mm256_set1_ps(-INFINITY);
        ix[j] = _mm256_set1_epi32(-1);
        c[j] = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(8 * j));
    }
    const __m256i step = _mm256_set1_epi32(32);
    size_t i = 0;
    for (; i + 32 <= n; i += 32)
        for (int j = 0; j < 4; j++) {
            const __m256 v = _mm256_loadu_ps(x + i + 8 * j);
            const __m256 g = _mm256_cmp_ps(b[j], v, _CMP_LT_OQ);
            b[j] = _mm256_blendv_ps(b[j], v, g);
            ix[j] = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(ix[j]), _mm256_castsi256_ps(c[j]), g));
            c[j] = _mm256_add_epi32(c[j], step);
        }
    /* explicitly aligned: GCC aligns such arrays to 64 bytes anyway and
     * then stores with vmovaps, but AddressSanitizer's fake stack frames
     * (detect_stack_use_after_return) honour only declared alignments */
    __attribute__((aligned(64))) float bv[32];
    __attribute__((aligned(64))) int32_t bi[32];
    for (int j = 0; j < 4; j++) {
        _mm256_storeu_ps(bv + 8 * j, b[j]);
        _mm256_storeu_si256((__m256i *)(bi + 8 * j), ix[j]);
    }
    /* the tail, in order, against the lanes' winner (or index 0) */
    return cism_argmax_scan(x, i, n, cism_argmax_lanes(bv, bi, 32));
}

void cism_fill_act_avx2(cism_kernels *k) {
    k->exp = exp_avx2;
    k->sigmoid = sigmoid_avx2;
    k->silu = silu_avx2;
    k->gelu = gelu_avx2;
    k->silu_mul = silu_mul_avx2;
    k->sigmoid_mul = sigmoid_mul_avx2;
    k->softmax = softmax_avx2;
    k->argmax = argmax_avx2;
    k->name_act = "avx2";
}
