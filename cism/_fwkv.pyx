"""FWKV (RWKV-style recurrent) models: packed weights, the forward pass, and sessions.

One forward function runs T tokens of one sequence from its WKV state. Every
projection of a layer runs once over all T tokens (k, v and r together, then
proj_out, ffn.0, ffn.2); only the recurrence walks the tokens in order, and it
is elementwise, so its columns run in parallel. Each row of every product and
each element of the recurrence is computed the same way whatever T, the
chunking or the thread count, so a block of T tokens equals T single steps bit
for bit.
"""
import numpy as np

cimport numpy as cnp
from cython.parallel cimport prange
from libc.math cimport sqrtf
from libc.stdint cimport int64_t
from libc.stdlib cimport calloc, free, realloc
from libc.string cimport memcpy, memset

from cism._kernels cimport cism_kernels, cism_mat, cism_div_up, kernel_table
from cism._weights cimport WeightStore
from cism._session cimport StateSession, MAX_K
from cism._step cimport Stepper, StepBatch, StepRun
from cism._layers cimport all_finite_f, embed_rows, grow_f, team
from cism.matrix cimport Scratch, gemm_multi, gemm1, scratch_free
from cism._status cimport OK, CANCELLED, NOMEM, NONFINITE, cism_flag_check
from cism._checks cimport as_tokens

from cism import _kernels
from cism._weights import load_float

cnp.import_array()


# bumped whenever some output changes its bits (2: the int8 x q8 block sums;
# 3: int4 and fp4 x q8 activations, block sums too)
CODE_VERSION = "cism-fwkv-3"
MAX_SPEC_K = MAX_K
# Columns per work item of the shared.proj products and of the recurrence.
DEF COLS = 64


# ----------------------------------------------------------------- model ---

cdef struct Layer:
    cism_mat k, v, r, out      # (d_model, d_model), protected storage (4-bit in int4/fp4)
    cism_mat ffn0              # (ffn, d_model), 4-bit in the hybrids
    cism_mat ffn2              # (d_model, ffn), 4-bit in the hybrids
    const float *decay         # (d_model,) clamp(sigmoid(w), wkv_floor, 0.999)
    const float *norm_wkv_w    # (d_model,) LayerNorm after the WKV residual
    const float *norm_wkv_b
    const float *norm_ffn_w    # (d_model,) LayerNorm after the FFN residual
    const float *norm_ffn_b


cdef struct ModelC:
    size_t d, e, ffn, layers, vocab, context
    Layer *layer
    cism_mat shared            # (vocab, d_emb): embedding rows and the tied head
    const float *proj          # (d_model, d_emb) shared.proj, always fp32
    const float *norm_w        # (d_model,) final LayerNorm
    const float *norm_b
    int threads
    bint act_q8


cdef class FwkvModel(WeightStore):
    """FWKV weights packed for inference.

    ``Model(config, weights, precision="fp32", threads=None, act_precision="fp32")``
    with ``weights`` a mapping of the published tensor names to float arrays.
    The four WKV projections and the shared embedding/head are stored at the
    protected precision (fp32, fp16, or int8 for int8 and both hybrids);
    ffn.0/ffn.2 go to int4 or fp4 in the hybrids, and int4/fp4 put the WKV
    projections there too (check_precisions names the shared matrix's storage). shared.proj, the decays and
    the LayerNorms stay fp32.
    """
    cdef ModelC c

    def __cinit__(self):
        memset(&self.c, 0, sizeof(ModelC))

    def __init__(self, config, weights, precision="fp32", threads=None, act_precision="fp32"):
        from cism.fwkv import Config, weight_shapes
        embed, linear, mlp = self.begin(config, getattr(type(self), "config_class", None) or Config,
                                    precision, act_precision, threads, CODE_VERSION)
        arrays = self.load_weights(weights, weight_shapes(config), False)

        c = config
        self.c.d = c.d_model
        self.c.e = c.d_emb
        self.c.ffn = c.d_model * c.ffn_mult
        self.c.layers = c.layers
        self.c.vocab = c.vocab
        self.c.context = c.context
        self.c.threads = self.threads_
        self.c.layer = <Layer*>calloc(c.layers, sizeof(Layer))
        if self.c.layer == NULL:
            raise MemoryError("cannot allocate the layer table")

        # One packed copy serves the embedding gather and the tied head (the
        # spec builds two identical copies; one is read per token either way).
        self.c.shared = self.mat("shared.weight", arrays, embed)[0]
        self.c.proj = self.vec("shared.proj.weight", arrays)
        self.c.norm_w = self.vec("norm.weight", arrays)
        self.c.norm_b = self.vec("norm.bias", arrays)
        floor = np.float32(c.wkv_floor)
        cdef Layer *L
        for i in range(c.layers):
            p = f"blocks.{i}."
            L = &self.c.layer[i]
            L.k = self.mat(p + "proj_k.weight", arrays, linear)[0]
            L.v = self.mat(p + "proj_v.weight", arrays, linear)[0]
            L.r = self.mat(p + "proj_r.weight", arrays, linear)[0]
            L.out = self.mat(p + "proj_out.weight", arrays, linear)[0]
            L.ffn0 = self.mat(p + "ffn.0.weight", arrays, mlp)[0]
            L.ffn2 = self.mat(p + "ffn.2.weight", arrays, mlp)[0]
            # the decay depends on the weights only: once here, not per token
            w = load_float(arrays[p + "w"], p + "w")
            arrays[p + "w"] = np.minimum(np.maximum(_kernels.activation("sigmoid", w),
                                                    floor), np.float32(0.999))
            L.decay = self.vec(p + "w", arrays)
            L.norm_wkv_w = self.vec(p + "norm_wkv.weight", arrays)
            L.norm_wkv_b = self.vec(p + "norm_wkv.bias", arrays)
            L.norm_ffn_w = self.vec(p + "norm_ffn.weight", arrays)
            L.norm_ffn_b = self.vec(p + "norm_ffn.bias", arrays)
            for suffix in ("proj_k.weight", "proj_v.weight", "proj_r.weight", "proj_out.weight",
                           "ffn.0.weight", "ffn.2.weight"):
                arrays.pop(p + suffix, None)   # the packed copies hold everything
        self.set_act_precision(act_precision)

    def session_class(self):
        return Session

    def stepper_class(self):
        return FwkvStepper

    def __dealloc__(self):
        free(self.c.layer)

    # ---- properties ----

    cdef void apply_act_precision(self):
        self.c.act_q8 = self.act_q8_

    def __repr__(self):
        c = self.config
        return (f"{type(self).__name__}(fwkv, layers={c.layers}, d_model={c.d_model}, "
                f"d_emb={c.d_emb}, precision={self.precision_!r}, "
                f"act_precision={self.act_precision!r}, threads={self.c.threads}, "
                f"weight_bytes={self.weight_bytes_})")


# ----------------------------------------------------------- forward pass ---

cdef struct Work:
    # token-major scratch for up to tokens_cap tokens
    float *x        # (T, d_model) residual stream
    float *k        # (T, d_model)
    float *v        # (T, d_model)
    float *r        # (T, d_model) receptance, sigmoid applied in place
    float *g        # (T, d_model) r * s, proj_out's input
    float *o        # (T, d_model) proj_out / ffn.2 output
    float *f        # (T, ffn) FFN hidden layer
    float *emb      # (T, d_emb) embedding rows; later the head's inputs
    float *h        # (T, d_model) final-normed rows that need logits
    size_t *out_rows  # (T,) the tokens whose logits are wanted, in row order
    float **snapp     # (T,) a session's snapshot targets (verification blocks)
    size_t tokens_cap
    Scratch qs


cdef int work_reserve(Work *w, const ModelC *m, size_t T) noexcept nogil:
    if T <= w.tokens_cap:
        return 0
    w.tokens_cap = 0  # stays 0 if a grow fails (the buffers are replaced)
    if (grow_f(&w.x, T * m.d) or grow_f(&w.k, T * m.d) or grow_f(&w.v, T * m.d)
            or grow_f(&w.r, T * m.d) or grow_f(&w.g, T * m.d) or grow_f(&w.o, T * m.d)
            or grow_f(&w.f, T * m.ffn) or grow_f(&w.emb, T * m.e) or grow_f(&w.h, T * m.d)):
        return -1
    w.out_rows = <size_t*>realloc(w.out_rows, T * sizeof(size_t))
    w.snapp = <float**>realloc(w.snapp, T * sizeof(float*))
    if w.out_rows == NULL or w.snapp == NULL:
        return -1
    w.tokens_cap = T
    return 0


cdef void work_free(Work *w) noexcept nogil:
    free(w.x); free(w.k); free(w.v); free(w.r); free(w.g); free(w.o); free(w.f)
    free(w.emb); free(w.h); free(w.out_rows); free(w.snapp)
    scratch_free(&w.qs)
    memset(w, 0, sizeof(Work))


cdef inline void proj_in(const ModelC *m, const float *emb, float *x, size_t chunk) noexcept nogil:
    """Rows [chunk*COLS, +COLS) of x = shared.proj @ emb: fp32 weights, double
    accumulation in column order (the spec's arithmetic). Four rows at a time
    keep four independent sums in flight (one chain per row stalls on the
    add latency); each row's order of operations is unchanged."""
    cdef size_t e = m.e, i, j
    cdef size_t r0 = chunk * COLS
    cdef size_t r1 = r0 + COLS if r0 + COLS < m.d else m.d
    cdef const float *p0
    cdef const float *p1
    cdef const float *p2
    cdef const float *p3
    cdef double a0, a1, a2, a3, ej
    i = r0
    while i + 4 <= r1:
        p0 = m.proj + i * e
        p1 = p0 + e
        p2 = p1 + e
        p3 = p2 + e
        a0 = 0
        a1 = 0
        a2 = 0
        a3 = 0
        for j in range(e):
            ej = emb[j]
            a0 += <double>p0[j] * ej
            a1 += <double>p1[j] * ej
            a2 += <double>p2[j] * ej
            a3 += <double>p3[j] * ej
        x[i] = <float>a0
        x[i + 1] = <float>a1
        x[i + 2] = <float>a2
        x[i + 3] = <float>a3
        i += 4
    while i < r1:
        p0 = m.proj + i * e
        a0 = 0
        for j in range(e):
            a0 += <double>p0[j] * emb[j]
        x[i] = <float>a0
        i += 1


cdef inline void proj_back(const ModelC *m, const float *h, float *out, size_t chunk) noexcept nogil:
    """Columns [chunk*COLS, +COLS) of out = shared.projᵀ @ h: the same double
    sums over rows in order as the spec, kept in COLS accumulators so that
    shared.proj is read row by row."""
    cdef size_t e = m.e, i, j
    cdef size_t c0 = chunk * COLS
    cdef size_t n = COLS if c0 + COLS < e else e - c0
    cdef double acc[COLS]
    cdef const float *row
    cdef double hi
    for j in range(n):
        acc[j] = 0
    for i in range(m.d):
        row = m.proj + i * e + c0
        hi = h[i]
        for j in range(n):
            acc[j] += <double>row[j] * hi
    for j in range(n):
        out[c0 + j] = <float>acc[j]


cdef inline void layer_norm(const float *x, float *out, const float *weight, const float *bias,
                            size_t n) noexcept nogil:
    # nn.LayerNorm, eps 1e-5: mean and biased variance in double, one float
    # scale (in place is fine: out[i] only after x[i] was read for the last time)
    cdef double mean = 0, var = 0, dev
    cdef size_t i
    cdef float eps = 1e-5, one = 1, mu, inv
    for i in range(n):
        mean += x[i]
    mean /= <double>n
    for i in range(n):
        dev = <double>x[i] - mean
        var += dev * dev
    var /= <double>n
    mu = <float>mean
    inv = one / sqrtf(<float>var + eps)
    for i in range(n):
        out[i] = ((x[i] - mu) * inv) * weight[i] + bias[i]


cdef inline void residual_norm(float *x, const float *y, const float *weight, const float *bias,
                               size_t n) noexcept nogil:
    """x = LayerNorm(x + 0.1 y): the 0.1-scaled residual, post-norm."""
    cdef float tenth = 0.1
    cdef size_t i
    for i in range(n):
        x[i] = x[i] + tenth * y[i]
    layer_norm(x, x, weight, bias, n)


cdef inline void wkv_columns(const cism_kernels *K, const float *decay, Work *w, float *s,
                             float **snap, size_t snap_offset, size_t d, size_t first, size_t T,
                             size_t chunk) noexcept nogil:
    """Columns [chunk*COLS, +COLS) of the WKV recurrence over tokens
    first..first+T-1 of one sequence, in order: r = sigmoid(r), s = k*v +
    W*s, g = r*s. Where snap[t] is set, that column range of s after token t
    is copied there (at snap_offset: this layer's place in the state)."""
    cdef size_t i0 = chunk * COLS
    cdef size_t n = COLS if i0 + COLS < d else d - i0
    cdef size_t t, i
    cdef const float *k
    cdef const float *v
    cdef float *r
    cdef float *g
    cdef float *si = s + i0
    cdef const float *W = decay + i0
    for t in range(first, first + T):
        k = w.k + t * d + i0
        v = w.v + t * d + i0
        r = w.r + t * d + i0
        g = w.g + t * d + i0
        K.sigmoid(r, r, n)
        for i in range(n):
            si[i] = k[i] * v[i] + W[i] * si[i]
            g[i] = r[i] * si[i]
        if snap != NULL and snap[t] != NULL:
            memcpy(snap[t] + snap_offset + i0, si, n * sizeof(float))


cdef int forward(const ModelC *m, Work *w, const StepBatch *b) noexcept nogil:
    """Run the step's tokens (cism._step: runs of sequences, each from its
    own WKV state (layers, d_model), which advances); each run's logits rows
    go to b.logits. b.snap, if given, receives a run's whole state after the
    tokens it names. Returns OK, CANCELLED, NOMEM or NONFINITE."""
    cdef const cism_kernels *K = kernel_table()
    cdef size_t d = m.d, e = m.e, F = m.ffn, V = m.vocab, L = m.layers, T = b.T
    cdef size_t n_out = 0
    cdef size_t d_chunks = cism_div_up(d, COLS), e_chunks = cism_div_up(e, COLS)
    # threads per loop: the whole team only where the loop has the work for it
    cdef int nt = m.threads
    cdef int ntT = team(nt, T, T * d)
    cdef int ntW = team(nt, b.n_runs * d_chunks, T * d * 4)
    cdef int ntO
    cdef int ntP = team(nt, T * d_chunks, T * d * e)
    cdef int ntQ
    cdef size_t t, l, c, i, r
    cdef const Layer *Ly
    cdef const StepRun *run
    cdef const cism_mat *mats[3]
    cdef float *outs[3]
    cdef size_t lds[3]
    cdef bint q8 = m.act_q8
    if work_reserve(w, m, T) != 0:
        return NOMEM
    for r in range(b.n_runs):
        run = &b.runs[r]
        for i in range(run.n_out):
            w.out_rows[run.out_row + i] = run.first + run.n - run.n_out + i
        n_out += run.n_out
    ntO = team(nt, n_out, n_out * d)
    ntQ = team(nt, n_out * e_chunks, n_out * d * e)
    # factorized embedding: a d_emb row of shared.weight, up to d_model by shared.proj
    embed_rows(&m.shared, b.tokens, T, w.emb, e, ntT)
    for c in prange(T * d_chunks, num_threads=ntP, schedule='static'):
        proj_in(m, w.emb + (c // d_chunks) * e, w.x + (c // d_chunks) * d, c % d_chunks)
    for l in range(L):
        if cism_flag_check(b.cancel):
            return CANCELLED
        Ly = &m.layer[l]
        # k, v and receptance projections of all T tokens in one pass over their rows
        mats[0] = &Ly.k
        mats[1] = &Ly.v
        mats[2] = &Ly.r
        outs[0] = w.k
        outs[1] = w.v
        outs[2] = w.r
        lds[0] = d
        lds[1] = d
        lds[2] = d
        if gemm_multi(mats, outs, lds, 3, q8, w.x, d, T, &w.qs, nt) != 0:
            return NOMEM
        # WKV recurrence: each sequence's tokens in order; columns are independent
        for c in prange(b.n_runs * d_chunks, num_threads=ntW, schedule='static'):
            wkv_columns(K, Ly.decay, w, b.runs[c // d_chunks].state + l * d, b.snap, l * d, d,
                        b.runs[c // d_chunks].first, b.runs[c // d_chunks].n, c % d_chunks)
        # proj_out of r*s for all T tokens at once, 0.1-scaled residual, LayerNorm
        if gemm1(&Ly.out, q8, w.g, d, T, w.o, d, &w.qs, nt) != 0:
            return NOMEM
        for t in prange(T, num_threads=ntT, schedule='static'):
            residual_norm(w.x + t * d, w.o + t * d, Ly.norm_wkv_w, Ly.norm_wkv_b, d)
        # FFN with exact (erf) GELU, 0.1-scaled residual, LayerNorm
        if gemm1(&Ly.ffn0, q8, w.x, d, T, w.f, F, &w.qs, nt) != 0:
            return NOMEM
        for t in prange(T, num_threads=ntT, schedule='static'):
            K.gelu(w.f + t * F, w.f + t * F, F)
        if gemm1(&Ly.ffn2, q8, w.f, F, T, w.o, d, &w.qs, nt) != 0:
            return NOMEM
        for t in prange(T, num_threads=ntT, schedule='static'):
            residual_norm(w.x + t * d, w.o + t * d, Ly.norm_ffn_w, Ly.norm_ffn_b, d)
    if n_out == 0:
        return OK
    # final LayerNorm, back to d_emb with shared.projᵀ, tied head (rows with logits only)
    for i in prange(n_out, num_threads=ntO, schedule='static'):
        layer_norm(w.x + w.out_rows[i] * d, w.h + i * d, m.norm_w, m.norm_b, d)
    for c in prange(n_out * e_chunks, num_threads=ntQ, schedule='static'):
        proj_back(m, w.h + (c // e_chunks) * d, w.emb + (c // e_chunks) * e, c % e_chunks)
    if gemm1(&m.shared, q8, w.emb, e, n_out, b.logits, V, &w.qs, nt) != 0:
        return NOMEM
    if not all_finite_f(b.logits, n_out * V):
        return NONFINITE
    return OK


# --------------------------------------------------------------- sessions ---

cdef class FwkvStepper(Stepper):
    """The FWKV forward over a ragged batch (cism.Engine, sessions): each
    sequence runs from its own WKV state; there is no KV cache."""
    cdef const ModelC *m
    cdef Work w

    def __cinit__(self, *args, **kwargs):
        memset(&self.w, 0, sizeof(Work))

    def __init__(self, FwkvModel model):
        Stepper.__init__(self, model)
        self.m = &model.c
        self.vocab = model.c.vocab
        self.state_floats = model.c.layers * model.c.d
        self.kv_layers = 0
        self.kv_width = 0
        self.head_dim = 0
        self.kv_dtype = None
        self.bf16_prompts = False

    def __dealloc__(self):
        work_free(&self.w)

    cdef int forward(self, StepBatch *b) noexcept nogil:
        return forward(self.m, &self.w, b)


cdef class Session(StateSession):
    """One generation over an FWKV model. Its memory is the WKV state
    ``(layers, d_model)``, whatever the length (the spec's 8 GiB state
    limit cannot bind: the bounds cap the state at 4 MiB)."""

    @property
    def state(self):
        """A copy of the WKV state, float32 (layers, d_model); zeros before
        the prompt has run."""
        with self.lock:
            out = np.empty((self.model.config.layers, self.model.config.d_model), np.float32)
            memcpy(cnp.PyArray_DATA(out), self.state_, out.nbytes)
            return out
