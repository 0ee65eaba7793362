"""Surjo hybrid (XSA attention + Gated DeltaNet): packed weights, the forward
pass over the execution plan and its ragged step (SurjoStepper); the solo
session with its neural drafter is cism._surjo_session.

The forward function runs T tokens of one sequence plan step by plan step:
every projection is one pass over its weight rows for all T tokens, while the
things that carry state (XSA keys/values, the GDN conv FIFOs and recurrent
states) advance token by token in order. Each token's arithmetic is therefore
the same whatever T, the chunking or the thread count: a prefilled block
equals T single-token steps bit for bit, and speculative verification can
restore a checkpoint and replay the accepted prefix exactly.

Recurrent state per GDN (layer, pass): one (K, Dv) state per VALUE head (the
spec shares key-head states among value heads when gdn_num_v_heads > heads,
an approximation it flags itself; tests/reference/surjo.py documents the
reading used here), and FIFOs of the W-1 previous raw conv inputs per channel.
"""
import numpy as np

cimport numpy as cnp
from cython.parallel cimport prange, threadid
from libc.math cimport sqrtf, exp, log1p
from libc.stdint cimport int64_t, uint8_t
from libc.stdlib cimport calloc, free, malloc, realloc
from libc.string cimport memcpy, memset

from cism._kernels cimport cism_kernels, cism_mat, kernel_table
from cism._weights cimport WeightStore
from cism._session cimport MAX_K
from cism._step cimport Stepper, StepBatch, StepRun
from cism._kvcache cimport KV, kv_alloc, kv_array, kv_cache_bytes, kv_free, kv_paged, kv_store
from cism._attention cimport QTILE, AttnWork, attend_group, attend_tile, attn_work_free, attn_work_reserve, query_tiles
from cism._layers cimport (Rope, add_into, embed_rows, grow_f, head_norms, lm_head, rmsnorm, rope_rotate,
                           swiglu, team)
from cism.matrix cimport Scratch, gemm_multi, gemm1, scratch_free
from cism.sampling cimport argmax
from cism._status cimport OK, CANCELLED, NOMEM, NONFINITE, NONFINITE_SCORE, RUNNING, cism_flag_check
from cism._checks cimport as_tokens, check_count, params_eos

from cism._config import MAX_KV_BYTES, is_int
from cism._weights import check_kv_precision, load_float

cnp.import_array()

# bumped whenever some output changes its bits (2: the int8 x q8 block sums;
# 3: int4 and fp4 x q8 activations, block sums too; 4: the attention
# softmax's maximum and sum by 16 lanes and the canonical tree)
CODE_VERSION = "cism-surjo-4"
MAX_SPEC_K = MAX_K
# Conv channels per parallel work item: one cache line of floats per token row.
DEF CONV_BLOCK = 16


# ----------------------------------------------------------------- model ---

# Order of the GDN projections sharing the normalized input (one gemm_multi).
DEF GDN_Q = 0
DEF GDN_K = 1
DEF GDN_V = 2
DEF GDN_B = 3
DEF GDN_W = 4
DEF GDN_F0 = 5
DEF GDN_G0 = 6


cdef class SurjoModel(WeightStore):
    """Surjo weights packed for inference.

    ``Model(config, weights, precision="fp32", threads=None, act_precision="fp32",
    kv_precision="fp32")`` with ``weights`` a mapping of the spec's tensor names to float arrays.
    Attention and GDN projections, the embedding and the head use the protected
    storage (fp32, fp16 or int8); the MLPs use int4 / fp4 in the hybrid precisions.
    int4 and fp4 put the attention and GDN projections at 4 bits as well
    (check_precisions names the embedding/head storage).
    """

    def __cinit__(self):
        memset(&self.c, 0, sizeof(ModelC))

    def __init__(self, config, weights, precision="fp32", threads=None, act_precision="fp32",
                 kv_precision="fp32"):
        from cism.surjo import Config, weight_shapes
        embed, linear, mlp = self.begin(config, Config, precision, act_precision, threads, CODE_VERSION)
        check_kv_precision(kv_precision)
        self.c.kv_f16 = kv_precision == "fp16"
        self.kv_precision_ = kv_precision
        arrays = self.load_weights(weights, weight_shapes(config, "lm_head.weight" in weights), config.tied)

        c = config
        self.fill_base(&self.c.base, config)
        self.c.v_heads = c.gdn_v_heads
        self.c.k_dim = c.gdn_k_dim
        self.c.v_dim = c.gdn_v_dim
        self.c.key_total = c.key_total
        self.c.value_total = c.value_total
        self.c.conv = c.conv_kernel
        self.c.fifo = c.conv_kernel - 1
        self.c.state_len = (c.gdn_v_heads * c.gdn_k_dim * c.gdn_v_dim
                            + (2 * c.key_total + c.value_total) * (c.conv_kernel - 1))
        self.c.xsa_projection = c.xsa_projection
        self.c.layer = <Layer*>calloc(c.layers, sizeof(Layer))
        if self.c.layer == NULL:
            raise MemoryError("cannot allocate the layer table")
        self._build_plan()

        self.pack_ends(&self.c.base, arrays, embed, c.tied)
        layer_bytes = []
        cdef Layer *L
        for i in range(c.layers):
            before = self.weight_bytes_
            p = f"model.layers.{i}."
            L = &self.c.layer[i]
            L.xsa = c.is_xsa_layer(i)
            L.input_norm = self.vec(p + "input_layernorm.weight", arrays)
            L.post_norm = self.vec(p + "post_attention_layernorm.weight", arrays)
            if L.xsa:
                a = p + "self_attn."
                L.q = self.mat(a + "q_proj.weight", arrays, linear)[0]
                L.k = self.mat(a + "k_proj.weight", arrays, linear)[0]
                L.v = self.mat(a + "v_proj.weight", arrays, linear)[0]
                L.o = self.mat(a + "o_proj.weight", arrays, linear)[0]
                L.q_norm = self.vec(a + "q_norm.weight", arrays)
                L.k_norm = self.vec(a + "k_norm.weight", arrays)
            else:
                a = p + "linear_attn."
                L.q = self.mat(a + "q_proj.weight", arrays, linear)[0]
                L.k = self.mat(a + "k_proj.weight", arrays, linear)[0]
                L.v = self.mat(a + "v_proj.weight", arrays, linear)[0]
                L.b = self.mat(a + "b_proj.weight", arrays, linear)[0]
                L.w = self.mat(a + "w_proj.weight", arrays, linear)[0]
                L.f0 = self.mat(a + "f_proj.0.weight", arrays, linear)[0]
                L.f1 = self.mat(a + "f_proj.1.weight", arrays, linear)[0]
                L.g0 = self.mat(a + "g_proj.0.weight", arrays, linear)[0]
                L.g1 = self.mat(a + "g_proj.1.weight", arrays, linear)[0]
                L.o = self.mat(a + "o_proj.weight", arrays, linear)[0]
                L.q_conv = self.vec(a + "q_conv.conv.weight", arrays)
                L.k_conv = self.vec(a + "k_conv.conv.weight", arrays)
                L.v_conv = self.vec(a + "v_conv.conv.weight", arrays)
                # exp(A_log) once, in double, rounded to float (stored in A_log's place)
                arrays[a + "A_log"] = np.exp(load_float(arrays[a + "A_log"], a + "A_log").astype(np.float64)
                                             ).astype(np.float32)
                L.a_exp = self.vec(a + "A_log", arrays)
                L.dt_bias = self.vec(a + "dt_bias", arrays)
                L.g_bias = self.vec(a + "g_proj.1.bias", arrays)
                L.o_norm = self.vec(a + "o_norm.weight", arrays)
            L.gate = self.mat(p + "mlp.gate_proj.weight", arrays, mlp)[0]
            L.up = self.mat(p + "mlp.up_proj.weight", arrays, mlp)[0]
            L.down = self.mat(p + "mlp.down_proj.weight", arrays, mlp)[0]
            for name in [n for n in arrays if n.startswith(p)]:
                del arrays[name]  # the packed copies hold everything now
            layer_bytes.append(self.weight_bytes_ - before)
        # Bytes one decoded token streams: every plan step's layer, the final
        # norm and the head (the embedding is only gathered, one row).
        head = self.matrices["model.embed_tokens.weight" if c.tied else "lm_head.weight"]
        self.stream_bytes_ = (head.nbytes + 4 * c.hidden
                              + sum(layer_bytes[self.c.plan[s].layer] for s in range(self.c.n_steps)))
        self.build_rope(&self.c.base.rope, config.rope_theta, c.head_dim, c.context)
        self.set_act_precision(act_precision)

    cdef _build_plan(self):
        """Prelude, then every pass over the groups, then coda (the spec's build_plan)."""
        plan = self.config.plan()
        self.c.plan = <Step*>calloc(len(plan), sizeof(Step))
        if self.c.plan == NULL:
            raise MemoryError("cannot allocate the execution plan")
        slot = state = 0
        for i, (layer, pass_, kind) in enumerate(plan):
            self.c.plan[i].layer = layer
            self.c.plan[i].pass_ = pass_
            if kind == "xsa":
                self.c.plan[i].slot, self.c.plan[i].state = slot, -1
                slot += 1
            else:
                self.c.plan[i].slot, self.c.plan[i].state = -1, state
                state += 1
        self.c.n_steps = len(plan)
        self.c.n_slots = slot
        self.c.n_states = state

    def session_class(self):
        from cism._surjo_session import Session
        return Session

    def stepper_class(self):
        return SurjoStepper

    def __dealloc__(self):
        free(self.c.layer)
        free(self.c.plan)

    # ---- properties ----

    cdef void apply_act_precision(self):
        self.c.base.act_q8 = self.act_q8_

    @property
    def stream_bytes(self):
        """Weight bytes one decoded token reads: each plan step's layer (the
        group section once per pass), the final norm and the head; the
        embedding only as one row. Decode roofline = read bandwidth / this."""
        return self.stream_bytes_

    @property
    def plan(self):
        """The execution plan, one (layer, pass, kind, index) per step: kind
        "xsa" with its KV slot or "gdn" with its state index. Step numbers are
        what Session.set_draft_steps takes."""
        out = []
        for i in range(self.c.n_steps):
            s = self.c.plan[i]
            out.append((s.layer, s.pass_, "xsa", s.slot) if s.slot >= 0 else
                       (s.layer, s.pass_, "gdn", s.state))
        return out

    def __repr__(self):
        c = self.config
        return (f"{type(self).__name__}(surjo, layers={c.layers}, passes={c.passes}, "
                f"hidden={c.hidden}, precision={self.precision_!r}, "
                f"act_precision={self.act_precision!r}, "
                + (f"kv_precision={self.kv_precision_!r}, " if self.c.kv_f16 else "")
                + f"threads={self.c.base.threads}, weight_bytes={self.weight_bytes_})")


# ----------------------------------------------------------- forward pass ---

cdef int work_reserve(Work *w, const ModelC *m, size_t T, size_t S, size_t n_out) noexcept nogil:
    cdef size_t kt = m.key_total, vt = m.value_total
    # the GDN buffers first: attn_work_reserve raises the caps they share
    if T > w.a.tokens_cap:
        w.a.tokens_cap = 0
        if (grow_f(&w.gq, T * kt) or grow_f(&w.gk, T * kt) or grow_f(&w.gv, T * vt)
                or grow_f(&w.gb, T * kt) or grow_f(&w.gw, T * vt) or grow_f(&w.gf, T * kt)
                or grow_f(&w.gg, T * vt) or grow_f(&w.go, T * vt)
                or grow_f(&w.fmid, T * m.v_dim) or grow_f(&w.gmid, T * m.v_dim)):
            return -1
    if S > w.a.score_cap or <size_t>m.base.threads > w.a.threads_cap:
        w.a.score_cap = 0
        if grow_f(&w.delta, m.base.threads * 2 * m.v_dim):
            return -1
    return attn_work_reserve(&w.a, T, S, n_out, m.base.hidden, m.base.inter, m.base.q_width, m.base.kv_width,
                             m.base.head_dim, m.base.threads)


cdef void work_free(Work *w) noexcept nogil:
    attn_work_free(&w.a)
    free(w.gq); free(w.gk); free(w.gv); free(w.gb); free(w.gw); free(w.gf); free(w.gg); free(w.go)
    free(w.fmid); free(w.gmid); free(w.delta)
    memset(w, 0, sizeof(Work))


cdef inline void l2norm(float *x, size_t n) noexcept nogil:
    # the spec's surjo_l2norm: x / (||x|| + 1e-12), the sum of squares in double
    cdef double sum = 0
    cdef size_t i
    for i in range(n):
        sum += <double>x[i] * x[i]
    cdef float inv = 1.0 / (sqrtf(<float>sum) + <float>1e-12)
    for i in range(n):
        x[i] *= inv


cdef inline float softplus(float x) noexcept nogil:
    # log(1 + e^x) with the spec's shortcuts outside [-20, 20]
    if x > 20:
        return x
    if x < -20:
        return <float>exp(<double>x)
    return <float>log1p(exp(<double>x))


cdef void xsa_qk_store(const ModelC *m, Work *w, const Layer *L, const KV *kv, size_t slot,
                       size_t g, size_t pos, int tid) noexcept nogil:
    """Per-head q/k RMS norms, RoPE at pos, then token g's k and v into the slot."""
    cdef const cism_kernels *K = kernel_table()
    cdef size_t hd = m.base.head_dim, h
    cdef float *q = w.a.q + g * m.base.q_width
    cdef float *k = w.a.k + g * m.base.kv_width
    head_norms(q, m.base.heads, hd, L.q_norm, m.base.eps)
    head_norms(k, m.base.kv_heads, hd, L.k_norm, m.base.eps)
    rope_rotate(&m.base.rope, pos, q, m.base.heads, k, m.base.kv_heads, w.a.rope + tid * hd)
    for h in range(m.base.kv_heads):
        kv_store(K, kv, slot, h, pos, k + h * hd, w.a.v + g * m.base.kv_width + h * hd)


cdef void xsa_project(const ModelC *m, Work *w, size_t g, size_t kvh, float *out) noexcept nogil:
    """a -= (a.v / max(v.v, 1e-4)) v for the attention output a (out) of a
    head of KV head kvh and token g's own value v of that head, the dot
    products in double (the spec's order)."""
    cdef size_t hd = m.base.head_dim, j
    cdef const float *vv = w.a.v + g * m.base.kv_width + kvh * hd
    cdef double av = 0, vv2 = 0
    cdef float coef
    for j in range(hd):
        av += <double>out[j] * vv[j]
        vv2 += <double>vv[j] * vv[j]
    if vv2 < 1e-4:
        vv2 = 1e-4
    coef = <float>(av / vv2)
    for j in range(hd):
        out[j] -= coef * vv[j]


cdef void xsa_attend(const ModelC *m, const cism_kernels *K, Work *w, const KV *kv, size_t slot,
                     size_t g0, size_t nq, size_t h, size_t p0, float *sc) noexcept nogil:
    """Causal attention of head h for the nq tokens g0.. at positions p0..
    of the slot (one query tile: cism._attention's, as the dense layers'),
    then (xsa_projection) the removal of each output's component along its
    token's own value vector of that KV head."""
    cdef size_t hd = m.base.head_dim, QW = m.base.q_width, i
    cdef size_t kvh = h // (m.base.heads // m.base.kv_heads)
    cdef float *out = w.a.att + g0 * QW + h * hd
    attend_tile(K, kv, slot, kvh, w.a.q + g0 * QW + h * hd, out, QW, nq, p0, 0, sc, &w.a.bad_score)
    if m.xsa_projection:
        for i in range(nq):
            xsa_project(m, w, g0 + i, kvh, out + i * QW)


cdef void xsa_attend_group(const ModelC *m, const cism_kernels *K, Work *w, const KV *kv, size_t slot,
                           size_t g, size_t kvh, size_t p, float *sc) noexcept nogil:
    """Attention of token g alone in its tile (at position p) for the heads
    that share KV head kvh as one tile of queries (cism._attention), each
    head with exactly xsa_attend's arithmetic for it alone, then the
    projection of each head's output."""
    cdef size_t hd = m.base.head_dim, G = m.base.heads // m.base.kv_heads, j
    cdef float *out = w.a.att + g * m.base.q_width + kvh * G * hd
    attend_group(K, kv, slot, kvh, w.a.q + g * m.base.q_width + kvh * G * hd, out, G, p, 0, sc, &w.a.bad_score)
    if m.xsa_projection:
        for j in range(G):
            xsa_project(m, w, g, kvh, out + j * hd)


cdef void gdn_conv(const ModelC *m, Work *w, const Layer *L, float *rec, size_t blk,
                   size_t first, size_t T, float **snap, size_t snap_offset) noexcept nogil:
    """Depthwise causal conv of one block of channels (of q, k or v) over
    tokens first..first+T-1 of one sequence, token by token: y = sum_i W[i]
    * fifo[i] + W[W-1] * u in double, then the FIFO shifts the raw input u
    in (fifo[W-2] is the newest). Where snap[t] is set, these channels' FIFO
    after token t is copied there (snap_offset: this state's place)."""
    cdef size_t kt = m.key_total, vt = m.value_total, km = m.fifo, kw = m.conv
    cdef size_t nbk = (kt + CONV_BLOCK - 1) // CONV_BLOCK
    cdef float *buf
    cdef float *fifo
    cdef const float *wt
    cdef size_t ld, c0, c1, ch, t, i
    cdef float raw
    cdef float *f
    cdef const float *wr
    cdef double acc
    if blk < nbk:
        buf, fifo, wt, ld, c0 = w.gq, rec + m.v_heads * m.k_dim * m.v_dim, L.q_conv, kt, blk * CONV_BLOCK
    elif blk < 2 * nbk:
        buf, fifo, wt, ld, c0 = w.gk, rec + m.v_heads * m.k_dim * m.v_dim + kt * km, L.k_conv, kt, (blk - nbk) * CONV_BLOCK
    else:
        buf, fifo, wt, ld, c0 = w.gv, rec + m.v_heads * m.k_dim * m.v_dim + 2 * kt * km, L.v_conv, vt, (blk - 2 * nbk) * CONV_BLOCK
    c1 = c0 + CONV_BLOCK
    if c1 > ld:
        c1 = ld
    for t in range(first, first + T):
        for ch in range(c0, c1):
            raw = buf[t * ld + ch]
            f = fifo + ch * km
            wr = wt + ch * kw
            acc = 0
            for i in range(km):
                acc += <double>f[i] * wr[i]
            acc += <double>raw * wr[km]
            buf[t * ld + ch] = <float>acc
            if km:
                for i in range(km - 1):
                    f[i] = f[i + 1]
                f[km - 1] = raw
        if km and snap != NULL and snap[t] != NULL:
            memcpy(snap[t] + snap_offset + (fifo - rec) + c0 * km, fifo + c0 * km,
                   (c1 - c0) * km * sizeof(float))


cdef void gdn_gates(const ModelC *m, const cism_kernels *K, Work *w, const Layer *L,
                    size_t g) noexcept nogil:
    """Token g's pointwise GDN maps: SiLU after the conv, per-key-head L2 norms
    of q and k, beta and write-gate sigmoids, decay = exp(-exp(A_log) *
    softplus(f + dt_bias)) per key channel, output-gate bias."""
    cdef size_t kt = m.key_total, vt = m.value_total, kd = m.k_dim, h, i
    cdef float *q = w.gq + g * kt
    cdef float *k = w.gk + g * kt
    cdef float *f = w.gf + g * kt
    cdef float *gt = w.gg + g * vt
    K.silu(q, q, kt)
    K.silu(k, k, kt)
    K.silu(w.gv + g * vt, w.gv + g * vt, vt)
    for h in range(m.base.heads):
        l2norm(q + h * kd, kd)
        l2norm(k + h * kd, kd)
    K.sigmoid(w.gb + g * kt, w.gb + g * kt, kt)
    K.sigmoid(w.gw + g * vt, w.gw + g * vt, vt)
    for i in range(kt):
        f[i] = -L.a_exp[i // kd] * softplus(f[i] + L.dt_bias[i])
    K.exp(f, f, kt)
    for i in range(vt):
        gt[i] += L.g_bias[i]


cdef void gdn_head(const ModelC *m, const cism_kernels *K, Work *w, const Layer *L, float *S,
                   size_t e, size_t first, size_t T, float *scratch, float **snap,
                   size_t snap_offset) noexcept nogil:
    """The gated delta rule of value head e (state S, (K, Dv)), tokens in order:
        S <- diag(decay) S;  r = S^T (beta*k);  S <- S + k (omega*v - r)^T;
        o = S^T q / sqrt(K);  o <- rmsnorm(o; o_norm) * sigmoid(gate)
    Key-side tensors come from key head e // (Hv/H). Tokens first..first+T-1
    of one sequence; where snap[t] is set, S after token t is copied there
    (snap_offset: this head's place in the sequence's state)."""
    cdef size_t kt = m.key_total, vt = m.value_total, kd = m.k_dim, dv = m.v_dim
    cdef size_t kh = e // (m.v_heads // m.base.heads), t, i, j
    cdef float rscale = 1.0 / sqrtf(<float>kd)
    cdef float *r = scratch
    cdef float *d = scratch + dv
    cdef float *row
    cdef float dec
    cdef const float *q
    cdef const float *k
    cdef const float *beta
    cdef const float *decay
    cdef const float *v
    cdef const float *om
    cdef float *o
    for t in range(first, first + T):
        q = w.gq + t * kt + kh * kd
        k = w.gk + t * kt + kh * kd
        beta = w.gb + t * kt + kh * kd
        decay = w.gf + t * kt + kh * kd
        v = w.gv + t * vt + e * dv
        om = w.gw + t * vt + e * dv
        o = w.go + t * vt + e * dv
        # decay first, and read r = S^T (beta * k) in the same sweep
        memset(r, 0, dv * sizeof(float))
        for i in range(kd):
            row = S + i * dv
            dec = decay[i]
            for j in range(dv):
                row[j] = row[j] * dec
            K.axpy(beta[i] * k[i], row, r, dv)
        # write with the plain key, and read the output in the same sweep
        for j in range(dv):
            d[j] = om[j] * v[j] - r[j]
        memset(o, 0, dv * sizeof(float))
        for i in range(kd):
            row = S + i * dv
            K.axpy(k[i], d, row, dv)
            K.axpy(q[i], row, o, dv)
        for j in range(dv):
            o[j] = o[j] * rscale
        rmsnorm(o, o, L.o_norm, dv, m.base.eps)
        K.sigmoid_mul(w.gg + t * vt + e * dv, o, o, dv)
        if snap != NULL and snap[t] != NULL:
            memcpy(snap[t] + snap_offset, S, kd * dv * sizeof(float))


cdef int forward(const ModelC *m, Work *w, const StepBatch *b, const KV *kvs,
                 const uint8_t *skip) noexcept nogil:
    """Run the step's tokens (cism._step: runs of sequences at their own
    positions, run r with XSA slots kvs[r] and recurrent state
    b.runs[r].state) through the plan (steps with skip[s] set are left out:
    the neural drafter). Each run's logits rows go to b.logits; b.snap, if
    given, receives a run's whole recurrent state after the tokens it names.
    Returns OK, CANCELLED, NOMEM, NONFINITE_SCORE (checked for every token,
    so also in a prompt chunk that wants no logits) or NONFINITE."""
    cdef const cism_kernels *K = kernel_table()
    cdef size_t D = m.base.hidden, I = m.base.inter, QW = m.base.q_width, KW = m.base.kv_width, T = b.T
    cdef size_t KT = m.key_total, VT = m.value_total, DV = m.v_dim
    cdef size_t nbk = (KT + CONV_BLOCK - 1) // CONV_BLOCK
    cdef size_t nconv = 2 * nbk + (VT + CONV_BLOCK - 1) // CONV_BLOCK
    cdef size_t S = 0, n_out = 0, ntiles, per_tile, items, group = m.base.heads // m.base.kv_heads, nq, h
    cdef size_t R = b.n_runs
    # threads per loop: the whole team only where the loop has the work for it
    cdef int nt = m.base.threads
    cdef int ntT = team(nt, T, T * D)
    cdef int ntH
    cdef int ntC = team(nt, R * nconv, T * (2 * KT + VT) * m.conv)
    cdef int ntG = team(nt, T, T * (2 * KT + VT) * 8)
    cdef int ntV = team(nt, R * m.v_heads, T * m.v_heads * m.k_dim * DV * 4)
    cdef int rc
    cdef size_t si, g, r, i, slot, st_index
    cdef const Layer *L
    cdef const StepRun *run
    cdef const cism_mat *mats[7]
    cdef float *outs[7]
    cdef size_t lds[7]
    cdef bint q8 = m.base.act_q8
    for r in range(R):
        if b.runs[r].pos + b.runs[r].n > S:
            S = b.runs[r].pos + b.runs[r].n
        n_out += b.runs[r].n_out
    if work_reserve(w, m, T, S, n_out) != 0:
        return NOMEM
    w.a.bad_score = 0
    for r in range(R):
        run = &b.runs[r]
        for i in range(run.n):
            w.a.seq_of[run.first + i] = <int>r
            w.a.pos_of[run.first + i] = run.pos + i
        for i in range(run.n_out):
            w.a.out_rows[run.out_row + i] = run.first + run.n - run.n_out + i
    ntiles = query_tiles(w.a.tile_of, w.a.seq_of, w.a.pos_of, T)
    per_tile = m.base.kv_heads if nt == 1 or ntiles * m.base.kv_heads >= 2 * <size_t>nt else m.base.heads
    items = ntiles * per_tile
    ntH = team(nt, items, T * m.base.heads * S * m.base.head_dim)
    embed_rows(&m.base.embed, b.tokens, T, w.a.x, D, ntT)
    for si in range(m.n_steps):
        if skip != NULL and skip[si]:
            continue
        if cism_flag_check(b.cancel):
            return CANCELLED
        L = &m.layer[m.plan[si].layer]
        # mixer rmsnorm
        for g in prange(T, num_threads=ntT, schedule='static'):
            rmsnorm(w.a.x + g * D, w.a.xn + g * D, L.input_norm, D, m.base.eps)
        if L.xsa:
            slot = m.plan[si].slot
            # q, k, v projections in one pass over their rows
            mats[0], mats[1], mats[2] = &L.q, &L.k, &L.v
            outs[0], outs[1], outs[2] = w.a.q, w.a.k, w.a.v
            lds[0], lds[1], lds[2] = QW, KW, KW
            if gemm_multi(mats, outs, lds, 3, q8, w.a.xn, D, T, &w.a.qs, nt) != 0:
                return NOMEM
            # q/k norms, rotate, store k and v in this execution's slot
            for g in prange(T, num_threads=ntT, schedule='static'):
                xsa_qk_store(m, w, L, &kvs[w.a.seq_of[g]], slot, g, w.a.pos_of[g], threadid())
            # causal GQA attention and the value projection: one (query tile,
            # KV group) per item, a lone query's heads of the group together;
            # with fewer than two groups per thread, one (tile, head) per item.
            # Later tiles see more positions, hence the dynamic schedule; KV
            # group first, so consecutive items read the same keys and values.
            for r in prange(items, num_threads=ntH, schedule='dynamic'):
                g = w.a.tile_of[r % ntiles]
                nq = (w.a.tile_of[r % ntiles + 1] if r % ntiles + 1 < ntiles else T) - g
                if per_tile == m.base.heads:
                    xsa_attend(m, K, w, &kvs[w.a.seq_of[g]], slot, g, nq, r // ntiles, w.a.pos_of[g],
                               w.a.scores + threadid() * QTILE * w.a.score_cap)
                elif nq == 1:
                    xsa_attend_group(m, K, w, &kvs[w.a.seq_of[g]], slot, g, r // ntiles, w.a.pos_of[g],
                                     w.a.scores + threadid() * QTILE * w.a.score_cap)
                else:
                    for h in range((r // ntiles) * group, (r // ntiles + 1) * group):
                        xsa_attend(m, K, w, &kvs[w.a.seq_of[g]], slot, g, nq, h, w.a.pos_of[g],
                                   w.a.scores + threadid() * QTILE * w.a.score_cap)
            if w.a.bad_score:
                return NONFINITE_SCORE
            if gemm1(&L.o, q8, w.a.att, QW, T, w.a.proj, D, &w.a.qs, nt) != 0:
                return NOMEM
        else:
            st_index = <size_t>m.plan[si].state
            # q, k, v, beta, write gate and both low-rank inputs in one pass
            mats[GDN_Q], mats[GDN_K], mats[GDN_V] = &L.q, &L.k, &L.v
            mats[GDN_B], mats[GDN_W], mats[GDN_F0], mats[GDN_G0] = &L.b, &L.w, &L.f0, &L.g0
            outs[GDN_Q], outs[GDN_K], outs[GDN_V] = w.gq, w.gk, w.gv
            outs[GDN_B], outs[GDN_W], outs[GDN_F0], outs[GDN_G0] = w.gb, w.gw, w.fmid, w.gmid
            lds[GDN_Q], lds[GDN_K], lds[GDN_V] = KT, KT, VT
            lds[GDN_B], lds[GDN_W], lds[GDN_F0], lds[GDN_G0] = KT, VT, DV, DV
            if gemm_multi(mats, outs, lds, 7, q8, w.a.xn, D, T, &w.a.qs, nt) != 0:
                return NOMEM
            # decay-rate and output-gate up-projections
            if gemm1(&L.f1, q8, w.fmid, DV, T, w.gf, KT, &w.a.qs, nt) != 0:
                return NOMEM
            if gemm1(&L.g1, q8, w.gmid, DV, T, w.gg, VT, &w.a.qs, nt) != 0:
                return NOMEM
            # causal conv with each sequence's FIFOs of this (layer, pass), channels in parallel
            for r in prange(R * nconv, num_threads=ntC, schedule='static'):
                gdn_conv(m, w, L, b.runs[r // nconv].state + st_index * m.state_len, r % nconv,
                         b.runs[r // nconv].first, b.runs[r // nconv].n, b.snap, st_index * m.state_len)
            # SiLU, L2 norms, gates and decays, token by token
            for g in prange(T, num_threads=ntG, schedule='static'):
                gdn_gates(m, K, w, L, g)
            # the delta rule: one (sequence, value head) per item, its tokens in order
            for r in prange(R * m.v_heads, num_threads=ntV, schedule='static'):
                gdn_head(m, K, w, L, b.runs[r // m.v_heads].state + st_index * m.state_len
                         + (r % m.v_heads) * m.k_dim * DV, r % m.v_heads,
                         b.runs[r // m.v_heads].first, b.runs[r // m.v_heads].n,
                         w.delta + threadid() * 2 * DV, b.snap,
                         st_index * m.state_len + (r % m.v_heads) * m.k_dim * DV)
            if gemm1(&L.o, q8, w.go, VT, T, w.a.proj, D, &w.a.qs, nt) != 0:
                return NOMEM
        # residual, MLP rmsnorm
        for g in prange(T, num_threads=ntT, schedule='static'):
            add_into(w.a.x + g * D, w.a.proj + g * D, D)
            rmsnorm(w.a.x + g * D, w.a.xn + g * D, L.post_norm, D, m.base.eps)
        # SwiGLU: silu(gate) * up, then down, residual
        if swiglu(&L.gate, &L.up, &L.down, q8, w.a.xn, D, I, T, w.a.gate, w.a.up, w.a.proj, &w.a.qs, nt, ntT) != 0:
            return NOMEM
        for g in prange(T, num_threads=ntT, schedule='static'):
            add_into(w.a.x + g * D, w.a.proj + g * D, D)
    if n_out == 0:
        return OK
    # final norm and head, only for the rows whose logits are wanted
    rc = lm_head(&m.base.head, m.base.final_norm, m.base.eps, w.a.x, NULL, w.a.out_rows, n_out, D, m.base.vocab,
                 q8, w.a.head_in, b.logits, &w.a.qs, nt)
    return OK if rc == 0 else (NOMEM if rc == -1 else NONFINITE)


# --------------------------------------------------------------- sessions ---

cdef inline size_t slot_elem_bytes(const ModelC *m) noexcept nogil:
    return 2 if m.kv_f16 else 4


cdef int state_alloc(State *st, const ModelC *m, size_t capacity) noexcept nogil:
    """Empty KV slots, zero GDN states and FIFOs (once per session; all or
    nothing: a failure leaves nothing behind)."""
    if st.rec != NULL:
        return OK
    st.rec = <float*>calloc(m.n_states * m.state_len + 16, sizeof(float))
    if (st.rec == NULL or kv_alloc(&st.kv, m.n_slots, capacity, m.base.kv_heads, m.base.head_dim,
                                   slot_elem_bytes(m)) != 0):
        state_free(st)
        return NOMEM
    return OK


cdef void state_free(State *st) noexcept nogil:
    kv_free(&st.kv)
    free(st.rec)
    memset(st, 0, sizeof(State))


cdef class SurjoStepper(Stepper):
    """The Surjo forward over a ragged batch (cism.Engine, sessions): each
    sequence's XSA keys and values in pool pages (one "layer" per slot) or
    in its own slots, its GDN states and conv FIFOs in its own recurrent
    state."""

    def __cinit__(self, *args, **kwargs):
        memset(&self.w, 0, sizeof(Work))
        self.skip = NULL

    def __init__(self, SurjoModel model):
        Stepper.__init__(self, model)
        self.m = &model.c
        self.vocab = model.c.base.vocab
        self.state_floats = model.c.n_states * model.c.state_len
        self.kv_layers = model.c.n_slots
        self.kv_width = model.c.base.kv_width
        self.head_dim = model.c.base.head_dim
        self.kv_dtype = np.dtype(np.float16 if model.c.kv_f16 else np.float32)
        self.bf16_prompts = False

    def __dealloc__(self):
        work_free(&self.w)

    cdef int forward(self, StepBatch *b) noexcept nogil:
        cdef size_t r
        if kv_array(&self.kvs, &self.kvs_cap, b.n_runs) != 0:
            return NOMEM
        for r in range(b.n_runs):
            if b.runs[r].kv != NULL:
                self.kvs[r] = b.runs[r].kv[0]
            else:
                kv_paged(&self.kvs[r], self.k_pages, self.v_pages, b.runs[r].blocks, self.n_pages,
                         self.m.n_slots, self.m.base.kv_heads, self.m.base.head_dim, slot_elem_bytes(self.m))
        return forward(self.m, &self.w, b, self.kvs, self.skip)


cdef object check_capacity(const ModelC *m, size_t prompt_len, size_t max_new):
    capacity = prompt_len + max_new
    if capacity > m.base.context:
        raise ValueError(f"prompt + max_new_tokens exceeds max_position_embeddings "
                         f"({prompt_len} + {max_new} > {m.base.context})")
    state_bytes = (kv_cache_bytes(slot_elem_bytes(m), m.n_slots, capacity, m.base.kv_width)
                   + 4 * m.n_states * m.state_len)
    if state_bytes > MAX_KV_BYTES:
        raise ValueError(f"KV cache exceeds the 8 GiB safety limit ({state_bytes} bytes of "
                         "XSA keys/values and GDN states)")
