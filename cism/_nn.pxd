# Small numeric helpers the model families share, inlined into each module
# (cimport cism._nn). Plain C arithmetic, compiled without FMA contraction, so
# every module computes them identically.
from libc.math cimport sqrt
from libc.stdlib cimport free

cdef extern from "<stdlib.h>" nogil:
    void *aligned_alloc(size_t alignment, size_t size)

cdef inline int grow_f(float **p, size_t n) noexcept nogil:
    """Replace p[0] by a buffer of n floats (and 64 spare bytes), 64-byte
    aligned so that kernel loads never straddle cache lines. The old
    contents are NOT kept: every caller grows a buffer before filling it.
    On failure p[0] is NULL (and free()-able)."""
    free(p[0])
    p[0] = <float*>aligned_alloc(64, (n * sizeof(float) + 64 + 63) // 64 * 64)
    return -1 if p[0] == NULL else 0


cdef inline void rmsnorm(const float *x, float *out, const float *weight, size_t n, float eps) noexcept nogil:
    # sum of squares in double, one float scale (in place is fine: out[i] only after x[i])
    cdef double sum = 0
    cdef size_t i
    for i in range(n):
        sum += <double>x[i] * x[i]
    cdef float scale = <float>(1.0 / sqrt(sum / <double>n + eps))
    for i in range(n):
        out[i] = (x[i] * scale) * weight[i]


cdef inline void add_into(float *x, const float *y, size_t n) noexcept nogil:
    cdef size_t i
    for i in range(n):
        x[i] += y[i]


cdef inline void rotate(float *v, size_t heads, size_t dim, const float *c, const float *s) noexcept nogil:
    # HF rotate-half: pairs (j, j + dim/2)
    cdef size_t h, j, half = dim // 2
    cdef float a, b
    for h in range(heads):
        for j in range(half):
            a = v[h * dim + j]
            b = v[h * dim + j + half]
            v[h * dim + j] = a * c[j] - b * s[j]
            v[h * dim + j + half] = b * c[j] + a * s[j]
