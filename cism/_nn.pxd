# Small numeric helpers the model families share, inlined into each module
# (cimport cism._nn). Plain C arithmetic, compiled without FMA contraction, so
# every module computes them identically.
from libc.math cimport sqrt
from libc.stdlib cimport free
from libc.string cimport memset
from cism._kernels cimport cism_kernels, cism_mat, cism_act, CISM_FP32

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


# ---- attention by query tiles (cism/_dense.pyx and cism/_surjo.pyx) ----
# nq queries at consecutive positions p0.. of one sequence; every query gets
# exactly the arithmetic of attending alone (docs/EXACTNESS.md).

cdef inline void tile_scores(const cism_kernels *K, const float *q, size_t ldq, size_t nq,
                             const float *keys, size_t ldk, size_t nkeys, size_t hd,
                             float *sc, size_t ldsc) noexcept nogil:
    """sc[i * ldsc + j] = dot(query i, key j) for nkeys keys in consecutive
    cache rows (stride ldk floats): canonical dots, through the fp32 gemm
    kernel with the keys as the matrix and the queries as tokens."""
    cdef cism_mat m
    cdef cism_act a
    memset(&a, 0, sizeof(cism_act))
    a.x = q
    a.ldx = ldq
    m.storage = CISM_FP32
    m.rows = nkeys
    m.cols = hd
    m.codes = keys
    m.row_bytes = ldk * sizeof(float)
    m.scale_offset = 0
    m.scales = NULL
    K.gemm[CISM_FP32](&m, 0, nkeys, &a, nq, sc, ldsc)


cdef inline void tile_softmax(const cism_kernels *K, float *sc, size_t ldsc, size_t nq, size_t p0,
                              float scale, float *out, size_t ldo, size_t hd) noexcept nogil:
    """Row i of sc (positions 0..p0 + i) becomes the weights of query i
    (K.softmax: times scale, minus the maximum, exp, each divided by the
    sum, the maximum and the sum by 16 lanes and the canonical tree).
    Zeroes each query's output row (hd floats)."""
    cdef size_t i
    for i in range(nq):
        K.softmax(sc + i * ldsc, p0 + i + 1, scale)
        memset(out + i * ldo, 0, hd * sizeof(float))
