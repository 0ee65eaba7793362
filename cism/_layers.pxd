# The nogil building blocks the model families' forwards share (cimport
# cism._layers): scratch buffers, norms, rotary tables, the embedding
# gather, the SwiGLU MLP, the LM head, and the one rule for how many
# threads a loop gets. Inlined into each module and compiled there without
# FMA contraction, so every family computes them identically.
from cython.parallel cimport prange
from libc.math cimport cosf, sinf, sqrt
from libc.stdint cimport int64_t, uint32_t
from libc.stdlib cimport free
from cism._kernels cimport cism_kernels, cism_mat, kernel_table
from cism.matrix cimport Scratch, gemm1, gemm_multi, mat_row

cdef extern from "<stdlib.h>" nogil:
    void *aligned_alloc(size_t alignment, size_t size)

cdef enum:
    # Rotary sin/cos are tabulated up to this many positions; later
    # positions are computed with the same formula on the fly.
    ROPE_TABLE_MAX = 32768
    # Below about this many multiply-adds a parallel region costs more than
    # it saves (the figure cism.matrix uses); such loops run on the caller.
    PARALLEL_MIN_WORK = 65536


cdef inline int team(int nt, size_t items, size_t work) noexcept nogil:
    """Threads for a loop of `items` independent items and `work`
    multiply-adds in all: the whole team only where there is work for it.
    (The thread count never changes a bit: each item's arithmetic is fixed.)"""
    return nt if items > 1 and work >= PARALLEL_MIN_WORK else 1


# ---- scratch and checks ----

cdef inline int grow_f(float **p, size_t n) noexcept nogil:
    """Replace p[0] by a buffer of n floats (and 64 spare bytes), 64-byte
    aligned so that kernel loads never straddle cache lines. The old
    contents are NOT kept: every caller grows a buffer before filling it.
    On failure p[0] is NULL (and free()-able)."""
    free(p[0])
    p[0] = <float*>aligned_alloc(64, (n * sizeof(float) + 64 + 63) // 64 * 64)
    return -1 if p[0] == NULL else 0


cdef inline bint all_finite_f(const float *x, size_t n) noexcept nogil:
    """No inf or NaN among n floats: their exponent bits OR-reduced without
    an early exit, so the compiler vectorizes the scan (a model's logits,
    once per forward: the scalar test with its early return took about
    25 us on 49152 logits, 6-8 us this way, while the other threads wait)."""
    cdef const uint32_t *u = <const uint32_t*>x
    cdef uint32_t bad = 0
    cdef size_t i
    for i in range(n):
        bad |= <uint32_t>((u[i] & 0x7f800000u) == 0x7f800000u)
    return bad == 0


# ---- norms and residuals ----

cdef inline void rmsnorm(const float *x, float *out, const float *weight, size_t n, float eps) noexcept nogil:
    # sum of squares in double, one float scale (in place is fine: out[i] only after x[i])
    cdef double sum = 0
    cdef size_t i
    for i in range(n):
        sum += <double>x[i] * x[i]
    cdef float scale = <float>(1.0 / sqrt(sum / <double>n + eps))
    for i in range(n):
        out[i] = (x[i] * scale) * weight[i]


cdef inline void head_norms(float *x, size_t heads, size_t hd, const float *weight, float eps) noexcept nogil:
    """RMSNorm of each of the `heads` rows of hd floats of x, in place (the
    per-head q and k norms of Qwen3 and of Surjo's XSA)."""
    cdef size_t h
    for h in range(heads):
        rmsnorm(x + h * hd, x + h * hd, weight, hd, eps)


cdef inline void add_into(float *x, const float *y, size_t n) noexcept nogil:
    cdef size_t i
    for i in range(n):
        x[i] += y[i]


# ---- rotary position embedding ----

cdef struct Rope:
    const float *inv_freq      # (head_dim/2,)
    const float *cos           # (positions, head_dim/2)
    const float *sin
    size_t positions           # min(context, ROPE_TABLE_MAX)
    size_t head_dim
    float scale                # multiplies cos and sin: YaRN's attention factor, else 1


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


cdef inline void rope_rotate(const Rope *r, size_t pos, float *q, size_t heads, float *k, size_t kv_heads,
                             float *tmp) noexcept nogil:
    """Rotate q (heads) and k (kv_heads) to position pos: the tables' row,
    or beyond them the same formula into tmp (head_dim floats)."""
    cdef size_t hd = r.head_dim, half = hd // 2, j
    cdef const float *c
    cdef const float *s
    cdef float angle
    if pos < r.positions:
        c = r.cos + pos * half
        s = r.sin + pos * half
    else:
        for j in range(half):
            angle = <float>pos * r.inv_freq[j]
            tmp[j] = cosf(angle) * r.scale
            tmp[half + j] = sinf(angle) * r.scale
        c = tmp
        s = tmp + half
    rotate(q, heads, hd, c, s)
    rotate(k, kv_heads, hd, c, s)


# ---- embedding, MLP, head (over T token rows) ----

cdef inline void embed_rows(const cism_mat *E, const int64_t *tokens, size_t T, float *x, size_t ld,
                            int nt) noexcept nogil:
    """x[g] = row tokens[g] of the embedding E (ld floats apart)."""
    cdef size_t g
    for g in prange(T, num_threads=nt, schedule='static'):
        mat_row(E, <size_t>tokens[g], x + g * ld)


cdef inline int swiglu(const cism_mat *gate, const cism_mat *up, const cism_mat *down, int mode,
                       const float *xn, size_t H, size_t I, size_t T, float *g, float *u, float *out,
                       Scratch *qs, int nt, int ntT) noexcept nogil:
    """out = down(silu(gate(xn)) * up(xn)) for T rows: gate and up in one
    pass over their rows (g, u: (T, I) scratch). Returns 0, or -1 without memory."""
    cdef const cism_kernels *K = kernel_table()
    cdef const cism_mat *mats[2]
    cdef float *outs[2]
    cdef size_t lds[2]
    cdef size_t t
    mats[0] = gate
    mats[1] = up
    outs[0] = g
    outs[1] = u
    lds[0] = I
    lds[1] = I
    if gemm_multi(mats, outs, lds, 2, mode, xn, H, T, qs, nt) != 0:
        return -1
    for t in prange(T, num_threads=ntT, schedule='static'):
        K.silu_mul(g + t * I, u + t * I, g + t * I, I)
    return gemm1(down, mode, g, I, T, out, H, qs, nt)


cdef inline int lm_head(const cism_mat *head, const float *norm, float eps, float *x, const float *residual,
                        const size_t *rows, size_t n_out, size_t H, size_t vocab, int mode, float *head_in,
                        float *logits, Scratch *qs, int nt) noexcept nogil:
    """Logits (n_out, vocab) of the token rows `rows` of x: (the last
    residual added when given,) the final RMSNorm into head_in, the head.
    Returns 0, -1 without memory, or -2 when a logit is not finite."""
    cdef size_t i
    for i in prange(n_out, num_threads=team(nt, n_out, n_out * H), schedule='static'):
        if residual != NULL:
            add_into(x + rows[i] * H, residual + rows[i] * H, H)
        rmsnorm(x + rows[i] * H, head_in + i * H, norm, H, eps)
    if gemm1(head, mode, head_in, H, n_out, logits, vocab, qs, nt) != 0:
        return -1
    return 0 if all_finite_f(logits, n_out * vocab) else -2
