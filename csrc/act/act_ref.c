/* Scalar reference of the vector activations. SIMD variants evaluate the
 * same operations (fma, rint, one division) in the same order, so they match
 * these functions bit for bit (act_avx2.c and act_avx512.c were checked on
 * all 2^32 inputs, random b for the *_mul forms; the tests sample them).
 *
 * Maximum errors against the exact functions, measured over EVERY float32
 * input against float64 (gelu: math.erfc) and rounded up; the tests
 * (tests/test_activations.py::test_error_bounds) check these statements.
 * "Relative" is |y - f| / |f| where the exact f is a normal float
 * (|f| >= FLT_MIN = 1.18e-38); wherever |f| < FLT_MIN the absolute error is
 * below FLT_MIN. EXP_LO = -87.33655 and EXP_HI = 88.37626 (floats below).
 *   exp       x in [EXP_LO, EXP_HI]: relative error < 8.5e-8.
 *             x < EXP_LO (and -inf): +0 (the exact value is below FLT_MIN).
 *             x > EXP_HI, +inf and NaN: saturates at exp(EXP_HI) = 2.4061436e38
 *             (never inf; a NaN input does not come out as NaN).
 *   sigmoid   relative error < 1.8e-7 for every x (the exact value falls below
 *             FLT_MIN at x = EXP_LO; below EXP_LO it returns 0). NaN gives 1.
 *   silu      relative error < 2.3e-7 for x >= EXP_LO; below EXP_LO it returns
 *             -0 (absolute error < 1.1e-36). silu(-inf) is NaN (-inf * 0).
 *   gelu      (exact erf form) relative error < 4.6e-7 for x >= 0, < 4.8e-7 for
 *             x >= -1, < 1.3e-6 for x >= -3, < 2e-6 for x >= -5, < 7.2e-6 for
 *             x >= -10: in the negative tail it grows like 7e-8 x^2, because
 *             the rounding of z = |x|/sqrt 2 is magnified by exp(-z^2).
 *             Absolute error < 1.4e-7 * max(1, |x|) for every finite x (for
 *             x <= -13.1347 the exponent falls below EXP_LO and it returns -0,
 *             absolute error < 1.4e-38). gelu(-inf) is NaN (-inf * 0).
 */
#include "kernels.h"

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

/* a > b ? a : b: the rule of the softmax's maximum (vmaxps's, NaN b
 * excepted, which never arises: the lanes start at -inf and take only
 * values that compare greater) */
static inline float max_rule(float a, float b) { return a > b ? a : b; }

static void softmax_ref(float *x, size_t n, float scale) {
    float m[16], s[16];
    for (int i = 0; i < 16; i++) {
        m[i] = -INFINITY;
        s[i] = 0.0f;
    }
    for (size_t t = 0; t < n; t++) {
        x[t] = x[t] * scale;
        m[t % 16] = max_rule(x[t], m[t % 16]);
    }
    for (int i = 0; i < 8; i++) m[i] = max_rule(m[i], m[i + 8]);
    for (int i = 0; i < 4; i++) m[i] = max_rule(m[i], m[i + 4]);
    const float top = max_rule(max_rule(m[0], m[2]), max_rule(m[1], m[3]));
    for (size_t t = 0; t < n; t++) {
        x[t] = exp1(x[t] - top);
        s[t % 16] = s[t % 16] + x[t];
    }
    const float sum = cism_reduce16(s);
    for (size_t t = 0; t < n; t++) x[t] = x[t] / sum;
}

static size_t argmax_ref(const float *x, size_t n) { return cism_argmax_scan(x, 1, n, 0); }

void cism_fill_act_ref(cism_kernels *k) {
    k->exp = exp_ref;
    k->sigmoid = sigmoid_ref;
    k->silu = silu_ref;
    k->gelu = gelu_ref;
    k->silu_mul = silu_mul_ref;
    k->sigmoid_mul = sigmoid_mul_ref;
    k->softmax = softmax_ref;
    k->argmax = argmax_ref;
    k->name_act = "ref";
}
