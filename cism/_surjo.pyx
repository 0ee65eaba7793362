"""Surjo hybrid (XSA attention + Gated DeltaNet): packed weights, the forward
pass over the execution plan, and sessions with speculative decoding.

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
from cism._session cimport DecodeSession, MAX_K, run_chunks
from cism._step cimport Stepper, StepBatch, StepRun
from cism._kvcache cimport KV, kv_alloc, kv_array, kv_cache_bytes, kv_free, kv_paged, kv_store
from cism._attention cimport QTILE, attend_group, attend_tile, query_tiles
from cism._layers cimport Rope, add_into, embed_rows, grow_f, lm_head, rmsnorm, rope_rotate, swiglu, team
from cism.matrix cimport Scratch, gemm_multi, gemm1, scratch_free
from cism.sampling cimport argmax
from cism._status cimport OK, CANCELLED, NOMEM, NONFINITE, RUNNING, cism_flag_check
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

cdef struct Layer:
    bint xsa
    const float *input_norm    # (hidden,)
    const float *post_norm     # (hidden,)
    # XSA: q (H*Dh, D), k and v (Hkv*Dh, D), o (D, H*Dh).
    # GDN: q and k (Kt, D), v (Vt, D), o (D, Vt).
    cism_mat q, k, v, o
    const float *q_norm        # XSA (Dh,)
    const float *k_norm        # XSA (Dh,)
    cism_mat b                 # GDN beta (Kt, D)
    cism_mat w                 # GDN write gate (Vt, D)
    cism_mat f0, f1            # GDN decay rate: (Dv, D), (Kt, Dv)
    cism_mat g0, g1            # GDN output gate: (Dv, D), (Vt, Dv)
    const float *q_conv        # GDN (Kt, W), tap W-1 multiplies the newest input
    const float *k_conv        # GDN (Kt, W)
    const float *v_conv        # GDN (Vt, W)
    const float *a_exp         # GDN (H,) exp(A_log)
    const float *dt_bias       # GDN (Kt,)
    const float *g_bias        # GDN (Vt,)
    const float *o_norm        # GDN (Dv,)
    cism_mat gate, up, down    # SwiGLU MLP (F, D), (F, D), (D, F)


cdef struct Step:
    size_t layer
    size_t pass_
    int slot                   # XSA KV slot, or -1
    int state                  # GDN state index, or -1


cdef struct ModelC:
    size_t hidden, inter, layers, heads, kv_heads, head_dim, vocab, context, q_width, kv_width
    size_t v_heads, k_dim, v_dim, key_total, value_total, conv, fifo   # fifo = conv - 1
    size_t state_len           # floats of one GDN state incl. its FIFOs
    float eps
    bint xsa_projection
    Layer *layer
    Step *plan
    size_t n_steps, n_slots, n_states
    cism_mat embed
    cism_mat head              # the embedding again when tied
    const float *final_norm
    Rope rope
    int threads
    bint act_q8
    bint kv_f16                # XSA slots hold binary16 (kv_precision "fp16")


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
    """
    cdef ModelC c
    cdef size_t stream_bytes_

    def __cinit__(self):
        memset(&self.c, 0, sizeof(ModelC))

    def __init__(self, config, weights, precision="fp32", threads=None, act_precision="fp32",
                 kv_precision="fp32"):
        from cism.surjo import Config, weight_shapes
        protected, mlp = self.begin(config, Config, precision, act_precision, threads, CODE_VERSION)
        check_kv_precision(kv_precision)
        self.c.kv_f16 = kv_precision == "fp16"
        self.kv_precision_ = kv_precision
        arrays = self.load_weights(weights, weight_shapes(config, "lm_head.weight" in weights), config.tied)

        c = config
        self.c.hidden = c.hidden
        self.c.inter = c.intermediate
        self.c.layers = c.layers
        self.c.heads = c.heads
        self.c.kv_heads = c.kv_heads
        self.c.head_dim = c.head_dim
        self.c.vocab = c.vocab
        self.c.context = c.context
        self.c.q_width = c.heads * c.head_dim
        self.c.kv_width = c.kv_heads * c.head_dim
        self.c.v_heads = c.gdn_v_heads
        self.c.k_dim = c.gdn_k_dim
        self.c.v_dim = c.gdn_v_dim
        self.c.key_total = c.key_total
        self.c.value_total = c.value_total
        self.c.conv = c.conv_kernel
        self.c.fifo = c.conv_kernel - 1
        self.c.state_len = (c.gdn_v_heads * c.gdn_k_dim * c.gdn_v_dim
                            + (2 * c.key_total + c.value_total) * (c.conv_kernel - 1))
        self.c.eps = c.eps
        self.c.xsa_projection = c.xsa_projection
        self.c.threads = self.threads_
        self.c.layer = <Layer*>calloc(c.layers, sizeof(Layer))
        if self.c.layer == NULL:
            raise MemoryError("cannot allocate the layer table")
        self._build_plan()

        self.c.embed = self.mat("model.embed_tokens.weight", arrays, protected)[0]
        if c.tied:
            self.c.head = self.c.embed
        else:
            self.c.head = self.mat("lm_head.weight", arrays, protected)[0]
        self.c.final_norm = self.vec("model.norm.weight", arrays)
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
                L.q = self.mat(a + "q_proj.weight", arrays, protected)[0]
                L.k = self.mat(a + "k_proj.weight", arrays, protected)[0]
                L.v = self.mat(a + "v_proj.weight", arrays, protected)[0]
                L.o = self.mat(a + "o_proj.weight", arrays, protected)[0]
                L.q_norm = self.vec(a + "q_norm.weight", arrays)
                L.k_norm = self.vec(a + "k_norm.weight", arrays)
            else:
                a = p + "linear_attn."
                L.q = self.mat(a + "q_proj.weight", arrays, protected)[0]
                L.k = self.mat(a + "k_proj.weight", arrays, protected)[0]
                L.v = self.mat(a + "v_proj.weight", arrays, protected)[0]
                L.b = self.mat(a + "b_proj.weight", arrays, protected)[0]
                L.w = self.mat(a + "w_proj.weight", arrays, protected)[0]
                L.f0 = self.mat(a + "f_proj.0.weight", arrays, protected)[0]
                L.f1 = self.mat(a + "f_proj.1.weight", arrays, protected)[0]
                L.g0 = self.mat(a + "g_proj.0.weight", arrays, protected)[0]
                L.g1 = self.mat(a + "g_proj.1.weight", arrays, protected)[0]
                L.o = self.mat(a + "o_proj.weight", arrays, protected)[0]
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
        self.build_rope(&self.c.rope, config.rope_theta, c.head_dim, c.context)
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
        return Session

    def stepper_class(self):
        return SurjoStepper

    def __dealloc__(self):
        free(self.c.layer)
        free(self.c.plan)

    # ---- properties ----

    cdef void apply_act_precision(self):
        self.c.act_q8 = self.act_q8_

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
                + f"threads={self.c.threads}, weight_bytes={self.weight_bytes_})")


# ----------------------------------------------------------- forward pass ---

cdef struct State:
    # Everything a sequence carries between tokens.
    KV kv                      # the XSA slots' rotated keys and values: a KV
                               #   cache (cism/_kvcache.pxd) with one "layer" per slot
    float *rec                 # (states, state_len): per GDN (layer, pass)
                               #   S (Hv, K, Dv), then FIFOs q (Kt, W-1), k (Kt, W-1), v (Vt, W-1)


cdef struct Work:
    # token-major scratch for up to tokens_cap tokens
    float *x        # (T, hidden) residual stream
    float *xn       # (T, hidden) normalized
    float *proj     # (T, hidden) mixer / MLP output
    float *q        # (T, q_width)   XSA
    float *k        # (T, kv_width)
    float *v        # (T, kv_width)
    float *att      # (T, q_width)
    float *gq       # (T, Kt)        GDN q, conv'd in place
    float *gk       # (T, Kt)
    float *gv       # (T, Vt)
    float *gb       # (T, Kt)        beta
    float *gw       # (T, Vt)        write gate
    float *gf       # (T, Kt)        decay rate, then decay
    float *gg       # (T, Vt)        output gate logits
    float *go       # (T, Vt)        GDN output
    float *fmid     # (T, Dv)
    float *gmid     # (T, Dv)
    float *gate     # (T, inter)
    float *up       # (T, inter)
    float *head_in  # (n_out, hidden) final-normed rows that need logits
    float *scores   # (threads, QTILE * score_cap) scores of one query tile per thread
    float *rope     # (threads, head_dim) cos/sin beyond the table
    float *delta    # (threads, 2 * Dv) delta-rule read and update vectors
    size_t *out_rows  # (T,) the tokens whose logits are wanted, in row order
    int *seq_of     # (T,) the run (sequence) of each token
    size_t *pos_of  # (T,) the position of each token
    size_t *tile_of # (T,) first token of each attention query tile
    float **snapp   # (T,) a session's snapshot targets (unused: NULLs)
    size_t tokens_cap, score_cap, out_cap, threads_cap
    Scratch qs


cdef int work_reserve(Work *w, const ModelC *m, size_t T, size_t S, size_t n_out) noexcept nogil:
    cdef size_t nt = m.threads
    cdef size_t kt = m.key_total, vt = m.value_total
    # a cap is zeroed before its buffers are replaced, so a failed grow
    # leaves nothing that a later, smaller call could mistake for room
    if T > w.tokens_cap:
        w.tokens_cap = 0
        if (grow_f(&w.x, T * m.hidden) or grow_f(&w.xn, T * m.hidden) or grow_f(&w.proj, T * m.hidden)
                or grow_f(&w.q, T * m.q_width) or grow_f(&w.k, T * m.kv_width)
                or grow_f(&w.v, T * m.kv_width) or grow_f(&w.att, T * m.q_width)
                or grow_f(&w.gq, T * kt) or grow_f(&w.gk, T * kt) or grow_f(&w.gv, T * vt)
                or grow_f(&w.gb, T * kt) or grow_f(&w.gw, T * vt) or grow_f(&w.gf, T * kt)
                or grow_f(&w.gg, T * vt) or grow_f(&w.go, T * vt)
                or grow_f(&w.fmid, T * m.v_dim) or grow_f(&w.gmid, T * m.v_dim)
                or grow_f(&w.gate, T * m.inter) or grow_f(&w.up, T * m.inter)):
            return -1
        w.out_rows = <size_t*>realloc(w.out_rows, T * sizeof(size_t))
        w.seq_of = <int*>realloc(w.seq_of, T * sizeof(int))
        w.pos_of = <size_t*>realloc(w.pos_of, T * sizeof(size_t))
        w.tile_of = <size_t*>realloc(w.tile_of, T * sizeof(size_t))
        if w.out_rows == NULL or w.seq_of == NULL or w.pos_of == NULL or w.tile_of == NULL:
            return -1
        w.tokens_cap = T
    if n_out > w.out_cap:
        w.out_cap = 0
        if grow_f(&w.head_in, n_out * m.hidden):
            return -1
        w.out_cap = n_out
    if S > w.score_cap or nt > w.threads_cap:
        w.score_cap = 0
        w.threads_cap = 0
        if (grow_f(&w.scores, nt * QTILE * S) or grow_f(&w.rope, nt * m.head_dim)
                or grow_f(&w.delta, nt * 2 * m.v_dim)):
            return -1
        w.score_cap = S
        w.threads_cap = nt
    return 0


cdef void work_free(Work *w) noexcept nogil:
    free(w.x); free(w.xn); free(w.proj); free(w.q); free(w.k); free(w.v); free(w.att)
    free(w.gq); free(w.gk); free(w.gv); free(w.gb); free(w.gw); free(w.gf); free(w.gg); free(w.go)
    free(w.fmid); free(w.gmid); free(w.gate); free(w.up); free(w.head_in)
    free(w.scores); free(w.rope); free(w.delta); free(w.out_rows)
    free(w.seq_of); free(w.pos_of); free(w.tile_of)
    scratch_free(&w.qs)
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
    cdef size_t hd = m.head_dim, h
    cdef float *q = w.q + g * m.q_width
    cdef float *k = w.k + g * m.kv_width
    for h in range(m.heads):
        rmsnorm(q + h * hd, q + h * hd, L.q_norm, hd, m.eps)
    for h in range(m.kv_heads):
        rmsnorm(k + h * hd, k + h * hd, L.k_norm, hd, m.eps)
    rope_rotate(&m.rope, pos, q, m.heads, k, m.kv_heads, w.rope + tid * hd)
    for h in range(m.kv_heads):
        kv_store(K, kv, slot, h, pos, k + h * hd, w.v + g * m.kv_width + h * hd)


cdef void xsa_project(const ModelC *m, Work *w, size_t g, size_t kvh, float *out) noexcept nogil:
    """a -= (a.v / max(v.v, 1e-4)) v for the attention output a (out) of a
    head of KV head kvh and token g's own value v of that head, the dot
    products in double (the spec's order)."""
    cdef size_t hd = m.head_dim, j
    cdef const float *vv = w.v + g * m.kv_width + kvh * hd
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
    cdef size_t hd = m.head_dim, QW = m.q_width, i
    cdef size_t kvh = h // (m.heads // m.kv_heads)
    cdef float *out = w.att + g0 * QW + h * hd
    attend_tile(K, kv, slot, kvh, w.q + g0 * QW + h * hd, out, QW, nq, p0, 0, sc)
    if m.xsa_projection:
        for i in range(nq):
            xsa_project(m, w, g0 + i, kvh, out + i * QW)


cdef void xsa_attend_group(const ModelC *m, const cism_kernels *K, Work *w, const KV *kv, size_t slot,
                           size_t g, size_t kvh, size_t p, float *sc) noexcept nogil:
    """Attention of token g alone in its tile (at position p) for the heads
    that share KV head kvh as one tile of queries (cism._attention), each
    head with exactly xsa_attend's arithmetic for it alone, then the
    projection of each head's output."""
    cdef size_t hd = m.head_dim, G = m.heads // m.kv_heads, j
    cdef float *out = w.att + g * m.q_width + kvh * G * hd
    attend_group(K, kv, slot, kvh, w.q + g * m.q_width + kvh * G * hd, out, G, p, 0, sc)
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
    for h in range(m.heads):
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
    cdef size_t kh = e // (m.v_heads // m.heads), t, i, j
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
        rmsnorm(o, o, L.o_norm, dv, m.eps)
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
    Returns OK, CANCELLED, NOMEM or NONFINITE."""
    cdef const cism_kernels *K = kernel_table()
    cdef size_t D = m.hidden, I = m.inter, QW = m.q_width, KW = m.kv_width, T = b.T
    cdef size_t KT = m.key_total, VT = m.value_total, DV = m.v_dim
    cdef size_t nbk = (KT + CONV_BLOCK - 1) // CONV_BLOCK
    cdef size_t nconv = 2 * nbk + (VT + CONV_BLOCK - 1) // CONV_BLOCK
    cdef size_t S = 0, n_out = 0, ntiles, per_tile, items, group = m.heads // m.kv_heads, nq, h
    cdef size_t R = b.n_runs
    # threads per loop: the whole team only where the loop has the work for it
    cdef int nt = m.threads
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
    cdef bint q8 = m.act_q8
    for r in range(R):
        if b.runs[r].pos + b.runs[r].n > S:
            S = b.runs[r].pos + b.runs[r].n
        n_out += b.runs[r].n_out
    if work_reserve(w, m, T, S, n_out) != 0:
        return NOMEM
    for r in range(R):
        run = &b.runs[r]
        for i in range(run.n):
            w.seq_of[run.first + i] = <int>r
            w.pos_of[run.first + i] = run.pos + i
        for i in range(run.n_out):
            w.out_rows[run.out_row + i] = run.first + run.n - run.n_out + i
    ntiles = query_tiles(w.tile_of, w.seq_of, w.pos_of, T)
    per_tile = m.kv_heads if nt == 1 or ntiles * m.kv_heads >= 2 * <size_t>nt else m.heads
    items = ntiles * per_tile
    ntH = team(nt, items, T * m.heads * S * m.head_dim)
    embed_rows(&m.embed, b.tokens, T, w.x, D, ntT)
    for si in range(m.n_steps):
        if skip != NULL and skip[si]:
            continue
        if cism_flag_check(b.cancel):
            return CANCELLED
        L = &m.layer[m.plan[si].layer]
        # mixer rmsnorm
        for g in prange(T, num_threads=ntT, schedule='static'):
            rmsnorm(w.x + g * D, w.xn + g * D, L.input_norm, D, m.eps)
        if L.xsa:
            slot = m.plan[si].slot
            # q, k, v projections in one pass over their rows
            mats[0], mats[1], mats[2] = &L.q, &L.k, &L.v
            outs[0], outs[1], outs[2] = w.q, w.k, w.v
            lds[0], lds[1], lds[2] = QW, KW, KW
            if gemm_multi(mats, outs, lds, 3, q8, w.xn, D, T, &w.qs, nt) != 0:
                return NOMEM
            # q/k norms, rotate, store k and v in this execution's slot
            for g in prange(T, num_threads=ntT, schedule='static'):
                xsa_qk_store(m, w, L, &kvs[w.seq_of[g]], slot, g, w.pos_of[g], threadid())
            # causal GQA attention and the value projection: one (query tile,
            # KV group) per item, a lone query's heads of the group together;
            # with fewer than two groups per thread, one (tile, head) per item.
            # Later tiles see more positions, hence the dynamic schedule; KV
            # group first, so consecutive items read the same keys and values.
            for r in prange(items, num_threads=ntH, schedule='dynamic'):
                g = w.tile_of[r % ntiles]
                nq = (w.tile_of[r % ntiles + 1] if r % ntiles + 1 < ntiles else T) - g
                if per_tile == m.heads:
                    xsa_attend(m, K, w, &kvs[w.seq_of[g]], slot, g, nq, r // ntiles, w.pos_of[g],
                               w.scores + threadid() * QTILE * w.score_cap)
                elif nq == 1:
                    xsa_attend_group(m, K, w, &kvs[w.seq_of[g]], slot, g, r // ntiles, w.pos_of[g],
                                     w.scores + threadid() * QTILE * w.score_cap)
                else:
                    for h in range((r // ntiles) * group, (r // ntiles + 1) * group):
                        xsa_attend(m, K, w, &kvs[w.seq_of[g]], slot, g, nq, h, w.pos_of[g],
                                   w.scores + threadid() * QTILE * w.score_cap)
            if gemm1(&L.o, q8, w.att, QW, T, w.proj, D, &w.qs, nt) != 0:
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
            if gemm_multi(mats, outs, lds, 7, q8, w.xn, D, T, &w.qs, nt) != 0:
                return NOMEM
            # decay-rate and output-gate up-projections
            if gemm1(&L.f1, q8, w.fmid, DV, T, w.gf, KT, &w.qs, nt) != 0:
                return NOMEM
            if gemm1(&L.g1, q8, w.gmid, DV, T, w.gg, VT, &w.qs, nt) != 0:
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
            if gemm1(&L.o, q8, w.go, VT, T, w.proj, D, &w.qs, nt) != 0:
                return NOMEM
        # residual, MLP rmsnorm
        for g in prange(T, num_threads=ntT, schedule='static'):
            add_into(w.x + g * D, w.proj + g * D, D)
            rmsnorm(w.x + g * D, w.xn + g * D, L.post_norm, D, m.eps)
        # SwiGLU: silu(gate) * up, then down, residual
        if swiglu(&L.gate, &L.up, &L.down, q8, w.xn, D, I, T, w.gate, w.up, w.proj, &w.qs, nt, ntT) != 0:
            return NOMEM
        for g in prange(T, num_threads=ntT, schedule='static'):
            add_into(w.x + g * D, w.proj + g * D, D)
    if n_out == 0:
        return OK
    # final norm and head, only for the rows whose logits are wanted
    rc = lm_head(&m.head, m.final_norm, m.eps, w.x, NULL, w.out_rows, n_out, D, m.vocab, q8, w.head_in,
                 b.logits, &w.qs, nt)
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
    if (st.rec == NULL or kv_alloc(&st.kv, m.n_slots, capacity, m.kv_heads, m.head_dim,
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
    cdef const ModelC *m
    cdef Work w
    cdef const uint8_t *skip     # plan steps left out (the neural drafter), or NULL

    def __cinit__(self, *args, **kwargs):
        memset(&self.w, 0, sizeof(Work))
        self.skip = NULL

    def __init__(self, SurjoModel model):
        Stepper.__init__(self, model)
        self.m = &model.c
        self.vocab = model.c.vocab
        self.state_floats = model.c.n_states * model.c.state_len
        self.kv_layers = model.c.n_slots
        self.kv_width = model.c.kv_width
        self.head_dim = model.c.head_dim
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
                         self.m.n_slots, self.m.kv_heads, self.m.head_dim, slot_elem_bytes(self.m))
        return forward(self.m, &self.w, b, self.kvs, self.skip)


cdef object check_capacity(const ModelC *m, size_t prompt_len, size_t max_new):
    capacity = prompt_len + max_new
    if capacity > m.context:
        raise ValueError(f"prompt + max_new_tokens exceeds max_position_embeddings "
                         f"({prompt_len} + {max_new} > {m.context})")
    state_bytes = kv_cache_bytes(slot_elem_bytes(m), m.n_slots, capacity, m.kv_width) + 4 * m.n_states * m.state_len
    if state_bytes > MAX_KV_BYTES:
        raise ValueError(f"KV cache exceeds the 8 GiB safety limit ({state_bytes} bytes of "
                         "XSA keys/values and GDN states)")


cdef class Session(DecodeSession):
    """One generation over a Surjo model: its own XSA KV slots
    ``(slots, capacity, kv_width)``, GDN states and conv FIFOs."""
    cdef SurjoModel model
    cdef const ModelC *m
    cdef SurjoStepper xs         # the stepper, typed (the neural drafter's skip)
    cdef State st
    cdef float *ckpt             # (states, state_len) recurrent checkpoint
    cdef float *draft_logits     # (vocab,) the neural drafter's own logits
    cdef uint8_t *skip           # (steps,) plan steps the neural drafter leaves out
    cdef bint draft_armed

    def __cinit__(self, *args, **kwargs):
        memset(&self.st, 0, sizeof(State))
        self.ckpt = NULL
        self.draft_logits = NULL
        self.skip = NULL

    def __init__(self, SurjoModel model, prompt, max_new_tokens, temperature=0.0, top_p=1.0,
                 top_k=0, seed=0, eos=(), *, min_p=0.0, repetition_penalty=1.0):
        self.model = model
        self.m = &model.c
        self.xs = SurjoStepper(model)
        self.stepper = self.xs
        p = as_tokens(prompt, model.c.vocab)
        check_capacity(self.m, len(p), check_count(max_new_tokens, "max_new_tokens"))
        self.setup(p, 0, model.c.vocab, model.c.context, max_new_tokens, temperature, top_p,
                   top_k, seed, eos, min_p, repetition_penalty)
        self.skip = <uint8_t*>calloc(self.m.n_steps + 1, 1)
        if self.skip == NULL:
            raise MemoryError("cannot allocate session state")

    def __dealloc__(self):
        state_free(&self.st)
        free(self.ckpt)
        free(self.draft_logits)
        free(self.skip)

    # ---- hooks of the decoding loop ----

    cdef int alloc(self) noexcept nogil:
        if state_alloc(&self.st, self.m, self.s.capacity) != OK:
            return NOMEM
        self.one.kv = &self.st.kv
        self.one.state = self.st.rec
        if self.ckpt == NULL:
            self.ckpt = <float*>malloc((self.m.n_states * self.m.state_len + 16) * sizeof(float))
            if self.ckpt == NULL:
                return NOMEM
        return OK

    # run() is the stepper's forward over these slots and states; with rows
    # (a verification block) the live logits stay untouched.

    cdef int block_begin(self, size_t ncand) noexcept nogil:
        # the recurrence cannot be rolled back: checkpoint GDN states and FIFOs.
        # The XSA key/value tail needs no checkpoint: rows past the position are
        # rewritten before any query reads them (a deviation from the spec).
        self.save_states(False)
        return OK

    cdef int rewind(self, size_t ncand, size_t j) noexcept nogil:
        """Restore the checkpoint and replay the first j drafts (bit for bit
        what the block computed for them)."""
        if j == ncand:
            return OK
        self.restore_states(False)
        self.s.position = self.block_pos
        # (the replay's last logits equal the block's row j-1, which step() copies)
        return run_chunks(self.stepper, &self.one, &self.s, self.cands, j, NULL, self.s.logits, NULL,
                          &self.cancelled)

    cdef int fallback_draft(self, size_t k, size_t *ncand) noexcept nogil:
        ncand[0] = 0
        if not self.draft_armed:
            return OK
        return self.neural(k, ncand)

    cdef void save_states(self, bint only_drafted) noexcept nogil:
        """Copy the GDN states and FIFOs to the checkpoint (only_drafted: just
        those the neural drafter will advance)."""
        cdef size_t i, n = self.m.state_len
        cdef int g
        if not only_drafted:
            memcpy(self.ckpt, self.st.rec, self.m.n_states * n * sizeof(float))
            return
        for i in range(self.m.n_steps):
            g = self.m.plan[i].state
            if g >= 0 and not self.skip[i]:
                memcpy(self.ckpt + g * n, self.st.rec + g * n, n * sizeof(float))

    cdef void restore_states(self, bint only_drafted) noexcept nogil:
        cdef size_t i, n = self.m.state_len
        cdef int g
        if not only_drafted:
            memcpy(self.st.rec, self.ckpt, self.m.n_states * n * sizeof(float))
            return
        for i in range(self.m.n_steps):
            g = self.m.plan[i].state
            if g >= 0 and not self.skip[i]:
                memcpy(self.st.rec + g * n, self.ckpt + g * n, n * sizeof(float))

    cdef int neural(self, size_t k, size_t *ncand) noexcept nogil:
        """Draft up to k tokens into cands: the head is the argmax of the live
        logits, then the model with the skipped plan steps runs greedily on its
        own guesses. Every state it touches is restored before returning.
        XSA keys/values written past the position need no restoring: a position
        is always written before any query reads it."""
        cdef size_t n = 0, pos = self.s.position
        cdef int rc = OK
        ncand[0] = 0
        if k < 2:
            return OK
        if k > MAX_K:
            k = MAX_K
        if self.draft_logits == NULL:
            self.draft_logits = <float*>malloc(self.m.vocab * sizeof(float))
            if self.draft_logits == NULL:
                return NOMEM
        self.cands[0] = <int64_t>argmax(self.s.logits, self.m.vocab)
        n = 1
        self.save_states(True)
        self.xs.skip = self.skip
        while n < k and self.s.position < self.s.capacity:
            if params_eos(&self.p, self.cands[n - 1]):
                break
            rc = run_chunks(self.stepper, &self.one, &self.s, &self.cands[n - 1], 1, NULL, self.draft_logits,
                            NULL, &self.cancelled)
            if rc != OK:
                break
            self.cands[n] = <int64_t>argmax(self.draft_logits, self.m.vocab)
            n += 1
        self.xs.skip = NULL
        self.restore_states(True)
        self.s.position = pos
        ncand[0] = n
        return rc

    # ---- Surjo-specific API ----

    def set_draft_steps(self, steps):
        """Arm the neural drafter with the plan steps it leaves out (indices
        into Model.plan; an empty list drafts with the whole model), or disarm
        it with None. next_tokens(spec_k=...) uses it when prompt lookup finds
        nothing; verification keeps the output exactly greedy."""
        cdef size_t i
        if steps is None:
            with self.lock:
                self.draft_armed = False
                memset(self.skip, 0, self.m.n_steps)
            return
        if isinstance(steps, (str, bytes)) or not hasattr(steps, "__iter__"):
            raise ValueError("draft steps must be a sequence of plan step indices")
        chosen = list(steps)
        for step in chosen:
            if not is_int(step) or not 0 <= step < self.m.n_steps:
                raise ValueError(f"draft step out of range: {step!r} (the plan has "
                                 f"{self.m.n_steps} steps)")
        with self.lock:
            memset(self.skip, 0, self.m.n_steps)
            for step in chosen:
                self.skip[<size_t>step] = 1
            self.draft_armed = True

    @property
    def draft_steps(self):
        """The plan steps the neural drafter leaves out, or None when disarmed."""
        if not self.draft_armed:
            return None
        return [i for i in range(self.m.n_steps) if self.skip[i]]

    def neural_draft(self, k):
        """Up to k (<= 16) draft tokens from the neural drafter (the steps of
        set_draft_steps left out; none when it was never armed), leaving the
        session's state exactly as it was. Drafts are greedy; fewer than 2
        tokens are never drafted (the spec returns none for k < 2)."""
        k = min(check_count(k, "k"), MAX_K)
        cdef size_t kk = k, n = 0, i
        cdef int rc
        with self.lock:
            if self.s.finish != RUNNING:
                return []
            with nogil:
                rc = self.run_prompt()
                if rc == OK:
                    rc = self.neural(kk, &n)
            self.finish_call(rc)
            return [self.cands[i] for i in range(n)]
