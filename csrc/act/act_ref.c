/* Scalar reference of the vector activations. SIMD variants evaluate the
 * same operations (fma, rint, one division) in the same order, so they match
 * these functions bit for bit.
 *
 * Measured maximum errors against the double-precision functions
 * (tests/test_kernels.py::test_activation_error_bounds checks them):
 *   exp       x in [-87.3, 88.3]: relative error < 3e-7 (about 2.5 ulp);
 *             below -87.34 it returns 0 (absolute error < 1.2e-38)
 *   sigmoid   relative error < 5e-7 everywhere
 *   silu      relative error < 5e-7 everywhere
 *   gelu      (exact erf form) relative error < 2e-6 for |x| <= 10, and
 *             absolute error < 1e-7 * max(1, |x|) everywhere
 */
#include "../kernels.h"

#include <math.h>

/* exp: Cody-Waite reduction by ln 2 and Cephes' degree-6 polynomial. */
#define EXP_HI 88.3762626647949f
#define EXP_LO -87.3365447505531f
#define LOG2E 1.44269504088896341f
#define LN2_HI 0.693359375f
#define LN2_LO -2.12194440e-4f

static inline float exp1(float x) {
    float xc = x < EXP_HI ? x : EXP_HI; /* min, then max: the order SIMD uses */
    xc = xc > -88.0f ? xc : -88.0f;
    const float n = rintf(xc * LOG2E);
    float r = fmaf(n, -LN2_HI, xc);
    r = fmaf(n, -LN2_LO, r);
    float p = 1.9875691500e-4f;
    p = fmaf(p, r, 1.3981999507e-3f);
    p = fmaf(p, r, 8.3334519073e-3f);
    p = fmaf(p, r, 4.1665795894e-2f);
    p = fmaf(p, r, 1.6666665459e-1f);
    p = fmaf(p, r, 5.0000001201e-1f);
    const float z = r * r;
    p = fmaf(p, z, r) + 1.0f;
    /* n is in [-127, 127]; n = -127 only below EXP_LO, where 0 is returned */
    const int ni = (int)n;
    const float scale = cism_bits_to_f32((uint32_t)(ni + 127) << 23);
    const float y = p * scale;
    return x < EXP_LO ? 0.0f : y;
}

/* 1/(1+e^-|x|) for x >= 0, e^-|x|/(1+e^-|x|) otherwise: one division, no overflow. */
static inline float sigmoid1(float x) {
    const float ax = x < 0.0f ? -x : x;
    const float e = exp1(-ax);
    const float num = x >= 0.0f ? 1.0f : e;
    return num / (1.0f + e);
}

/* x * Phi(x) with Phi from erfc(|x|/sqrt 2) (Numerical Recipes' erfcc, whose
 * fractional error is below 1.2e-7 for every argument), so both tails keep
 * their relative precision. */
static inline float gelu1(float x) {
    const float ax = x < 0.0f ? -x : x;
    const float z = ax * 0.707106781186547524f;
    const float t = 1.0f / fmaf(0.5f, z, 1.0f);
    float p = 0.17087277f;
    p = fmaf(p, t, -0.82215223f);
    p = fmaf(p, t, 1.48851587f);
    p = fmaf(p, t, -1.13520398f);
    p = fmaf(p, t, 0.27886807f);
    p = fmaf(p, t, -0.18628806f);
    p = fmaf(p, t, 0.09678418f);
    p = fmaf(p, t, 0.37409196f);
    p = fmaf(p, t, 1.00002368f);
    p = fmaf(p, t, -1.26551223f);
    const float half_erfc = 0.5f * (t * exp1(fmaf(-z, z, p)));
    const float phi = x >= 0.0f ? 1.0f - half_erfc : half_erfc;
    return x * phi;
}

static void exp_ref(const float *x, float *y, size_t n) {
    for (size_t i = 0; i < n; i++) y[i] = exp1(x[i]);
}
static void sigmoid_ref(const float *x, float *y, size_t n) {
    for (size_t i = 0; i < n; i++) y[i] = sigmoid1(x[i]);
}
static void silu_ref(const float *x, float *y, size_t n) {
    for (size_t i = 0; i < n; i++) y[i] = x[i] * sigmoid1(x[i]);
}
static void gelu_ref(const float *x, float *y, size_t n) {
    for (size_t i = 0; i < n; i++) y[i] = gelu1(x[i]);
}
static void silu_mul_ref(const float *a, const float *b, float *y, size_t n) {
    for (size_t i = 0; i < n; i++) y[i] = (a[i] * sigmoid1(a[i])) * b[i];
}
static void sigmoid_mul_ref(const float *a, const float *b, float *y, size_t n) {
    for (size_t i = 0; i < n; i++) y[i] = sigmoid1(a[i]) * b[i];
}

void cism_fill_act_ref(cism_kernels *k) {
    k->exp = exp_ref;
    k->sigmoid = sigmoid_ref;
    k->silu = silu_ref;
    k->gelu = gelu_ref;
    k->silu_mul = silu_mul_ref;
    k->sigmoid_mul = sigmoid_mul_ref;
    k->name_act = "ref";
}
