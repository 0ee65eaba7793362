"""Dense Llama/Qwen3: packed weights, the forward pass, and sessions.

One forward function serves every session kind: it runs T tokens that may
belong to several sequences (a batch), each token at its own position, with
keys and values in contiguous caches or in pages of the shared block pool.
Every per-row computation is the same whatever the batch, the chunking, the
KV layout or the thread count, so all of those agree bit for bit.
"""
import hashlib
import threading

import numpy as np

cimport numpy as cnp
from cython.parallel cimport prange, threadid
from libc.math cimport sqrt, sqrtf, powf, cosf, sinf, exp, log, isfinite
from libc.stdint cimport int64_t, uint64_t, uint8_t
from libc.stdlib cimport malloc, calloc, realloc, free
from libc.string cimport memcpy, memset
from posix.mman cimport mlock, munlock

from cism._kernels cimport cism_kernels, cism_mat, kernel_table
from cism.matrix cimport Matrix, Scratch, gemm_multi, gemm1, mat_row, scratch_free
from cism.sampling cimport (cism_mt64, cism_sampler, rng_seed, argmax, sample_token,
                            sampler_free, draft_tokens, check_sampling)

from cism import _kernels
from cism._config import MAX_KV_BYTES, is_int
from cism._threads import resolve_threads
from cism.sampling import check_seed

cnp.import_array()

cdef extern from "flag.h" nogil:
    int cism_flag_get(const int *p)
    void cism_flag_set(int *p, int v)

cdef extern from "memscan.h" nogil:
    uint64_t cism_touch(const void *p, size_t n)
    uint64_t cism_scan(const void *p, size_t n)

PRECISIONS = ("fp32", "fp16", "int8", "hybrid-int4", "hybrid-fp4")
CODE_VERSION = "cism-dense-1"
DEF MAX_K = 16
MAX_SPEC_K = MAX_K
# Prompts are prefilled in chunks of this many tokens: bounded scratch, the
# activations stay in L2, and chunking changes no result (rows are independent).
DEF PREFILL_CHUNK = 256
# Rotary sin/cos are tabulated up to this many positions; later positions are
# computed with the same formula on the fly.
DEF ROPE_TABLE_MAX = 32768

# Return codes of the nogil layer.
DEF OK = 0
DEF CANCELLED = 1
DEF NOMEM = -1
DEF NONFINITE = -2

# finish reasons
DEF RUNNING = 0
DEF STOP = 1
DEF LENGTH = 2
DEF CANCEL = 3
FINISH_NAMES = ("", "stop", "length", "cancelled")


# ----------------------------------------------------------------- model ---

cdef struct Layer:
    cism_mat q, k, v, o, gate, up, down
    const float *input_norm
    const float *post_norm
    const float *q_norm
    const float *k_norm


cdef struct ModelC:
    size_t hidden, inter, layers, heads, kv_heads, head_dim, vocab, context, q_width, kv_width
    float eps
    bint qwen3
    Layer *layer
    cism_mat embed
    cism_mat head              # the embedding again when tied
    const float *final_norm
    float *inv_freq            # (head_dim/2,)
    float *rope_cos            # (rope_positions, head_dim/2)
    float *rope_sin
    size_t rope_positions
    int threads
    bint act_q8


cdef class DenseModel:
    """Dense Llama/Qwen3 weights packed for inference.

    ``Model(config, weights, precision="fp32", threads=None, act_precision="fp32")``
    with ``weights`` a mapping of HF tensor names to float arrays.
    """
    cdef ModelC c
    cdef readonly object config
    cdef str precision_
    cdef list keep                 # Matrix objects and norm arrays the C pointers point into
    cdef dict matrices
    cdef size_t weight_bytes_
    cdef str compile_key_
    cdef bint pages_locked_
    cdef object lock_                # guards lock/unlock and the paged pool
    cdef object paged_state
    cdef uint64_t sink_
    cdef public object source      # the Checkpoint a model was loaded from, if any

    def __cinit__(self):
        memset(&self.c, 0, sizeof(ModelC))

    def __init__(self, config, weights, precision="fp32", threads=None, act_precision="fp32"):
        cls_config = getattr(type(self), "config_class", None)
        if cls_config is None:
            from cism.dense import Config as cls_config
        if not isinstance(config, cls_config):
            raise ValueError(f"config must be a cism.dense.Config, got {type(config).__name__}")
        if precision not in PRECISIONS:
            raise ValueError("precision must be fp32, fp16, int8, hybrid-int4, or hybrid-fp4, "
                             f"got {precision!r}")
        if act_precision not in ("fp32", "int8"):
            raise ValueError(f"act_precision must be fp32 or int8, got {act_precision!r}")
        if not hasattr(weights, "keys") or not hasattr(weights, "__getitem__"):
            raise ValueError("weights must be a mapping of tensor names to float arrays")
        from cism.dense import weight_shapes
        self.config = config
        self.precision_ = precision
        self.lock_ = threading.Lock()
        self.paged_state = None
        self.source = None
        nthreads = resolve_threads(threads)
        has_head = "lm_head.weight" in weights
        shapes = weight_shapes(config, has_head)
        names = set(weights.keys())
        unexpected = sorted(names - set(shapes))
        missing = sorted(set(shapes) - names)
        if unexpected or missing:
            parts = []
            if missing:
                parts.append("missing " + ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else ""))
            if unexpected:
                parts.append("unexpected " + ", ".join(unexpected[:5]) + (" ..." if len(unexpected) > 5 else ""))
            raise ValueError("unexpected or missing weights: " + "; ".join(parts))
        arrays = {}
        for name, shape in shapes.items():
            arrays[name] = _weight_array(weights[name], name, shape)
        if config.tied and has_head:
            if not np.array_equal(arrays["lm_head.weight"], arrays["model.embed_tokens.weight"]):
                raise ValueError("tied lm_head.weight must equal model.embed_tokens.weight")
        protected = {"fp32": "fp32", "fp16": "fp16"}.get(precision, "int8")
        mlp = {"hybrid-int4": "int4", "hybrid-fp4": "fp4"}.get(precision, protected)

        self.keep = []
        self.matrices = {}
        self.weight_bytes_ = 0
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
        self.c.eps = c.eps
        self.c.qwen3 = c.model_type == "qwen3"
        self.c.threads = nthreads
        self.c.layer = <Layer*>calloc(c.layers, sizeof(Layer))
        if self.c.layer == NULL:
            raise MemoryError("cannot allocate the layer table")

        self.c.embed = self._matrix("model.embed_tokens.weight", arrays, protected)[0]
        if c.tied:
            self.c.head = self.c.embed
        else:
            self.c.head = self._matrix("lm_head.weight", arrays, protected)[0]
        self.c.final_norm = self._norm("model.norm.weight", arrays)
        cdef Layer *L
        for i in range(c.layers):
            p = f"model.layers.{i}."
            L = &self.c.layer[i]
            L.input_norm = self._norm(p + "input_layernorm.weight", arrays)
            L.post_norm = self._norm(p + "post_attention_layernorm.weight", arrays)
            L.q = self._matrix(p + "self_attn.q_proj.weight", arrays, protected)[0]
            L.k = self._matrix(p + "self_attn.k_proj.weight", arrays, protected)[0]
            L.v = self._matrix(p + "self_attn.v_proj.weight", arrays, protected)[0]
            L.o = self._matrix(p + "self_attn.o_proj.weight", arrays, protected)[0]
            if self.c.qwen3:
                L.q_norm = self._norm(p + "self_attn.q_norm.weight", arrays)
                L.k_norm = self._norm(p + "self_attn.k_norm.weight", arrays)
            L.gate = self._matrix(p + "mlp.gate_proj.weight", arrays, mlp)[0]
            L.up = self._matrix(p + "mlp.up_proj.weight", arrays, mlp)[0]
            L.down = self._matrix(p + "mlp.down_proj.weight", arrays, mlp)[0]
            # the source arrays may go now; packed copies hold everything
            for suffix in ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                           "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                           "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"):
                arrays.pop(p + suffix, None)
        self._build_rope()
        self.set_act_precision(act_precision)

    cdef cism_mat* _matrix(self, name, dict arrays, storage) except NULL:
        cdef Matrix m = Matrix(arrays[name], storage, threads=self.c.threads)
        self.keep.append(m)
        self.matrices[name] = m
        self.weight_bytes_ += m.nbytes
        return &m.mat

    cdef const float* _norm(self, name, dict arrays) except NULL:
        cdef cnp.ndarray a = np.ascontiguousarray(arrays[name], dtype=np.float32).copy()
        self.keep.append(a)
        self.weight_bytes_ += a.nbytes
        return <const float*>cnp.PyArray_DATA(a)

    cdef _build_rope(self):
        """inv_freq[j] = 1 / theta^(2j/d) in float; tables of cos/sin of
        position * inv_freq[j], once, shared read-only by every session."""
        cdef size_t half = self.c.head_dim // 2, p, j
        cdef float theta = <float>self.config.rope_theta
        inv = np.empty(half, np.float32)
        cdef float[::1] iv = inv
        for j in range(half):
            iv[j] = 1.0 / powf(theta, <float>(2 * j) / <float>self.c.head_dim)
            if not isfinite(iv[j]) or not isfinite(iv[j] * <float>(self.c.context - 1)):
                raise ValueError("rope_theta produces non-finite FP32 rotary angles")
        positions = min(self.c.context, ROPE_TABLE_MAX)
        cos_t = np.empty((positions, half), np.float32)
        sin_t = np.empty((positions, half), np.float32)
        cdef float[:, ::1] ct = cos_t
        cdef float[:, ::1] st = sin_t
        cdef float angle
        with nogil:
            for p in range(positions):
                for j in range(half):
                    angle = <float>p * iv[j]
                    ct[p, j] = cosf(angle)
                    st[p, j] = sinf(angle)
        self.keep += [inv, cos_t, sin_t]
        self.c.inv_freq = <float*>cnp.PyArray_DATA(inv)
        self.c.rope_cos = <float*>cnp.PyArray_DATA(cos_t)
        self.c.rope_sin = <float*>cnp.PyArray_DATA(sin_t)
        self.c.rope_positions = positions

    def __dealloc__(self):
        free(self.c.layer)

    # ---- properties ----

    @property
    def precision(self):
        return self.precision_

    @property
    def act_precision(self):
        return "int8" if self.c.act_q8 else "fp32"

    def set_act_precision(self, act_precision):
        """``"fp32"`` keeps float activations; ``"int8"`` quantizes them per
        32-element block for the integer kernels. Not while sessions run."""
        if act_precision not in ("fp32", "int8"):
            raise ValueError(f"act_precision must be fp32 or int8, got {act_precision!r}")
        self.c.act_q8 = act_precision == "int8"
        for m in self.matrices.values():
            (<Matrix>m).act_q8 = self.c.act_q8
        self._refresh_compile_key()

    def _refresh_compile_key(self):
        text = "|".join([self.compile_canonical, self.precision_, self.act_precision,
                         str(self.c.threads), _kernels.isa(), CODE_VERSION])
        self.compile_key_ = hashlib.sha256(text.encode()).hexdigest()[:32]

    @property
    def thread_count(self):
        return self.c.threads

    @property
    def weight_bytes(self):
        """Bytes of packed weights, scales and norms (what decode streams per token)."""
        return self.weight_bytes_

    @property
    def compile_key(self):
        """Stable hash of shape, precisions, thread count, kernel variant and code version."""
        return self.compile_key_

    @property
    def compile_canonical(self):
        return self.config.canonical()

    @property
    def pages_locked(self):
        return self.pages_locked_

    def matrix(self, name):
        """The packed Matrix behind an HF tensor name (for inspection)."""
        try:
            return self.matrices[name]
        except KeyError:
            raise ValueError(f"no matrix named {name!r}") from None

    # ---- weight memory ----

    def _regions(self):
        cdef Matrix m
        out = []
        for obj in self.keep:
            if isinstance(obj, Matrix):
                m = obj
                out.append((<size_t>m.codes_buf, m.mat.rows * m.mat.row_bytes))
                if m.scales_buf != NULL:
                    out.append((<size_t>m.scales_buf, m.mat.rows * sizeof(float)))
            else:
                out.append((obj.ctypes.data, obj.nbytes))
        return out

    def lock_pages(self):
        """mlock the weights; returns the bytes actually locked (Linux may lock
        less than asked under RLIMIT_MEMLOCK; that is reported, not raised)."""
        with self.lock_:
            if self.pages_locked_:
                raise ValueError("weight pages are already locked")
            locked = 0
            for addr, n in self._regions():
                if n and mlock(<void*><size_t>addr, n) == 0:
                    locked += n
            self.pages_locked_ = True
            return locked

    def unlock_pages(self):
        with self.lock_:
            if not self.pages_locked_:
                raise ValueError("weight pages are not locked")
            unlocked = 0
            for addr, n in self._regions():
                if n and munlock(<void*><size_t>addr, n) == 0:
                    unlocked += n
            self.pages_locked_ = False
            return unlocked

    def touch(self):
        """Read every cache line of the weights once (residency refresh); returns bytes."""
        cdef uint64_t sink = 0
        cdef size_t a, n
        total = 0
        for addr, size in self._regions():
            a = addr
            n = size
            with nogil:
                sink += cism_touch(<const void*>a, n)
            total += n
        self.sink_ += sink
        return total

    def scan(self):
        """Stream all weights with the model's threads (a bandwidth probe);
        returns the bytes read."""
        regions = self._regions()
        cdef size_t count = len(regions), i, c, nchunks = 0
        cdef size_t *addr = <size_t*>malloc(count * sizeof(size_t) * 3 + 8)
        if addr == NULL:
            raise MemoryError
        cdef size_t *size = addr + count
        cdef size_t *first = size + count
        total = 0
        for i in range(count):
            addr[i], size[i] = regions[i]
            first[i] = nchunks
            nchunks += (size[i] + (1 << 20) - 1) >> 20
            total += size[i]
        cdef uint64_t sink = 0
        cdef size_t r, off, n
        with nogil:
            for c in prange(nchunks, num_threads=self.c.threads, schedule='static'):
                r = 0
                while r + 1 < count and first[r + 1] <= c:
                    r = r + 1
                off = (c - first[r]) << 20
                n = size[r] - off
                if n > (1 << 20):
                    n = 1 << 20
                sink += cism_scan(<const void*>(addr[r] + off), n)
        free(addr)
        self.sink_ += sink
        return total

    # ---- sessions and one-shot evaluation ----

    def create_session(self, prompt, max_new_tokens, temperature=0.0, top_p=1.0, top_k=0,
                       seed=0, eos=()):
        return Session(self, prompt, max_new_tokens, temperature, top_p, top_k, seed, eos)

    def logits(self, prompt):
        """Next-token logits after the prompt, float32 (vocab,)."""
        s = Session(self, prompt, 0, 0.0, 1.0, 0, 0, ())
        s._prefill_now()
        return s.last_logits

    def nll(self, tokens):
        """Mean negative log-likelihood of tokens[1:] given the tokens before
        (teacher forcing, positions from zero), in one pass."""
        return Session(self, tokens, 0, 0.0, 1.0, 0, 0, ())._nll()

    def __repr__(self):
        c = self.config
        return (f"{type(self).__name__}({c.model_type}, layers={c.layers}, hidden={c.hidden}, "
                f"precision={self.precision_!r}, act_precision={self.act_precision!r}, "
                f"threads={self.c.threads}, weight_bytes={self.weight_bytes_})")


def _weight_array(value, name, shape):
    if not isinstance(value, np.ndarray):
        raise ValueError(f"weight {name} must be a numpy array, got {type(value).__name__}")
    if value.dtype.kind != "f":
        raise ValueError(f"weight {name} must be a float array, got dtype {value.dtype}")
    if tuple(value.shape) != tuple(shape):
        raise ValueError(f"missing or incorrectly sized weight: {name} "
                         f"(expected shape {tuple(shape)}, got {tuple(value.shape)})")
    a = np.ascontiguousarray(value, dtype=np.float32)
    if not np.isfinite(a).all():
        raise ValueError(f"non-finite weight: {name}")
    return a


# ----------------------------------------------------------- forward pass ---

cdef struct KV:
    # Contiguous caches: keys/values are (layers, capacity, kv_width).
    # Paged: keys/values are the pool's pages (blocks, layers, 16, kv_width)
    # and `blocks` maps position // 16 to a page.
    float *keys
    float *values
    size_t capacity
    const size_t *blocks
    size_t layers, kv_width


cdef inline float *k_row(const KV *kv, size_t l, size_t pos) noexcept nogil:
    if kv.blocks == NULL:
        return kv.keys + (l * kv.capacity + pos) * kv.kv_width
    return kv.keys + ((kv.blocks[pos >> 4] * kv.layers + l) * 16 + (pos & 15)) * kv.kv_width


cdef inline float *v_row(const KV *kv, size_t l, size_t pos) noexcept nogil:
    if kv.blocks == NULL:
        return kv.values + (l * kv.capacity + pos) * kv.kv_width
    return kv.values + ((kv.blocks[pos >> 4] * kv.layers + l) * 16 + (pos & 15)) * kv.kv_width


cdef struct Work:
    # token-major scratch for up to tokens_cap tokens
    float *x        # (T, hidden) residual stream
    float *xn       # (T, hidden) normalized
    float *q        # (T, q_width)
    float *k        # (T, kv_width)
    float *v        # (T, kv_width)
    float *att      # (T, q_width)
    float *proj     # (T, hidden)
    float *gate     # (T, inter)
    float *up       # (T, inter)
    float *head_in  # (n_out, hidden) final-normed rows that need logits
    float *scores   # (threads, score_cap) attention scores, one row per thread
    float *rope     # (threads, head_dim) cos/sin beyond the table
    int *seq_of     # (T,) sequence of each token
    size_t *pos_of  # (T,) position of each token
    size_t *out_rows
    size_t tokens_cap, score_cap, out_cap, threads_cap
    Scratch qs


cdef int grow_f(float **p, size_t n) noexcept nogil:
    cdef float *q = <float*>realloc(p[0], n * sizeof(float) + 64)
    if q == NULL:
        return -1
    p[0] = q
    return 0


cdef int work_reserve(Work *w, const ModelC *m, size_t T, size_t S, size_t n_out) noexcept nogil:
    cdef size_t nt = m.threads
    if T > w.tokens_cap:
        if (grow_f(&w.x, T * m.hidden) or grow_f(&w.xn, T * m.hidden) or grow_f(&w.q, T * m.q_width)
                or grow_f(&w.k, T * m.kv_width) or grow_f(&w.v, T * m.kv_width)
                or grow_f(&w.att, T * m.q_width) or grow_f(&w.proj, T * m.hidden)
                or grow_f(&w.gate, T * m.inter) or grow_f(&w.up, T * m.inter)):
            return -1
        w.seq_of = <int*>realloc(w.seq_of, T * sizeof(int))
        w.pos_of = <size_t*>realloc(w.pos_of, T * sizeof(size_t))
        w.out_rows = <size_t*>realloc(w.out_rows, T * sizeof(size_t))
        if w.seq_of == NULL or w.pos_of == NULL or w.out_rows == NULL:
            return -1
        w.tokens_cap = T
    if n_out > w.out_cap:
        if grow_f(&w.head_in, n_out * m.hidden):
            return -1
        w.out_cap = n_out
    if S > w.score_cap or nt > w.threads_cap:
        if grow_f(&w.scores, nt * S) or grow_f(&w.rope, nt * m.head_dim):
            return -1
        w.score_cap = S
        w.threads_cap = nt
    return 0


cdef void work_free(Work *w) noexcept nogil:
    free(w.x); free(w.xn); free(w.q); free(w.k); free(w.v); free(w.att); free(w.proj)
    free(w.gate); free(w.up); free(w.head_in); free(w.scores); free(w.rope)
    free(w.seq_of); free(w.pos_of); free(w.out_rows)
    scratch_free(&w.qs)
    memset(w, 0, sizeof(Work))


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


cdef void qk_rope_store(const ModelC *m, Work *w, size_t l, size_t g, const KV *kv, size_t pos,
                        int tid) noexcept nogil:
    cdef const Layer *L = &m.layer[l]
    cdef size_t hd = m.head_dim, half = hd // 2, h, j
    cdef float *q = w.q + g * m.q_width
    cdef float *k = w.k + g * m.kv_width
    cdef const float *c
    cdef const float *s
    cdef float *tmp
    cdef float angle
    if m.qwen3:
        # per-head RMS norms of q and k before rotation
        for h in range(m.heads):
            rmsnorm(q + h * hd, q + h * hd, L.q_norm, hd, m.eps)
        for h in range(m.kv_heads):
            rmsnorm(k + h * hd, k + h * hd, L.k_norm, hd, m.eps)
    if pos < m.rope_positions:
        c = m.rope_cos + pos * half
        s = m.rope_sin + pos * half
    else:
        tmp = w.rope + tid * hd
        for j in range(half):
            angle = <float>pos * m.inv_freq[j]
            tmp[j] = cosf(angle)
            tmp[half + j] = sinf(angle)
        c = tmp
        s = tmp + half
    rotate(q, m.heads, hd, c, s)
    rotate(k, m.kv_heads, hd, c, s)
    memcpy(k_row(kv, l, pos), k, m.kv_width * sizeof(float))
    memcpy(v_row(kv, l, pos), w.v + g * m.kv_width, m.kv_width * sizeof(float))


cdef void attend(const ModelC *m, const cism_kernels *K, Work *w, size_t l, size_t g, size_t h,
                 const KV *kv, size_t pos, float *sc) noexcept nogil:
    """Causal attention of token g, head h over positions 0..pos of its sequence."""
    cdef size_t hd = m.head_dim, span = pos + 1, tau
    cdef size_t kvh = h // (m.heads // m.kv_heads)
    cdef const float *q = w.q + g * m.q_width + h * hd
    cdef float *out = w.att + g * m.q_width + h * hd
    cdef float scale = 1.0 / sqrtf(<float>hd)
    cdef float maximum, denom = 0
    for tau in range(span):
        sc[tau] = K.dot(q, k_row(kv, l, tau) + kvh * hd, hd) * scale
    maximum = sc[0]
    for tau in range(1, span):
        if sc[tau] > maximum:
            maximum = sc[tau]
    for tau in range(span):
        sc[tau] = sc[tau] - maximum
    K.exp(sc, sc, span)
    for tau in range(span):
        denom = denom + sc[tau]
    memset(out, 0, hd * sizeof(float))
    for tau in range(span):
        K.axpy(sc[tau] / denom, v_row(kv, l, tau) + kvh * hd, out, hd)


cdef int forward(const ModelC *m, Work *w, const int64_t *tokens, size_t T, const KV *kvs,
                 const size_t *out_rows, size_t n_out, float *logits, const int *cancel) noexcept nogil:
    """Run T tokens (w.seq_of / w.pos_of give each token's sequence and
    position) through the model; logits of the tokens listed in out_rows go
    to logits (n_out, vocab). Keys and values are written for every token.
    Returns OK, CANCELLED, NOMEM or NONFINITE."""
    cdef const cism_kernels *K = kernel_table()
    cdef size_t H = m.hidden, I = m.inter, QW = m.q_width, KW = m.kv_width
    cdef int nt = m.threads
    cdef int ntT = nt if T > 1 else 1
    cdef int ntH = nt if T * m.heads > 1 else 1
    cdef int ntO = nt if n_out > 1 else 1
    cdef size_t S = 0, g, l, r, i
    cdef const Layer *L
    cdef const cism_mat *mats[3]
    cdef float *outs[3]
    cdef size_t lds[3]
    cdef bint q8 = m.act_q8
    cdef int rc
    for g in range(T):
        if w.pos_of[g] + 1 > S:
            S = w.pos_of[g] + 1
    if work_reserve(w, m, T, S, n_out) != 0:
        return NOMEM
    for g in prange(T, num_threads=ntT, schedule='static'):
        mat_row(&m.embed, <size_t>tokens[g], w.x + g * H)
    for l in range(m.layers):
        if cism_flag_get(cancel):
            return CANCELLED
        L = &m.layer[l]
        # attention rmsnorm (after the previous layer's MLP residual)
        for g in prange(T, num_threads=ntT, schedule='static'):
            if l > 0:
                add_into(w.x + g * H, w.proj + g * H, H)
            rmsnorm(w.x + g * H, w.xn + g * H, L.input_norm, H, m.eps)
        # q, k, v projections in one pass over their rows
        mats[0] = &L.q
        mats[1] = &L.k
        mats[2] = &L.v
        outs[0] = w.q
        outs[1] = w.k
        outs[2] = w.v
        lds[0] = QW
        lds[1] = KW
        lds[2] = KW
        if gemm_multi(mats, outs, lds, 3, q8, w.xn, H, T, &w.qs, nt) != 0:
            return NOMEM
        # (qwen3 q/k norms,) rotate q and k, store k and v
        for g in prange(T, num_threads=ntT, schedule='static'):
            qk_rope_store(m, w, l, g, &kvs[w.seq_of[g]], w.pos_of[g], threadid())
        # causal GQA attention, one (token, head) row per work item
        for r in prange(T * m.heads, num_threads=ntH, schedule='static'):
            attend(m, K, w, l, r // m.heads, r % m.heads, &kvs[w.seq_of[r // m.heads]],
                   w.pos_of[r // m.heads], w.scores + threadid() * w.score_cap)
        # output projection, residual, MLP rmsnorm
        if gemm1(&L.o, q8, w.att, QW, T, w.proj, H, &w.qs, nt) != 0:
            return NOMEM
        for g in prange(T, num_threads=ntT, schedule='static'):
            add_into(w.x + g * H, w.proj + g * H, H)
            rmsnorm(w.x + g * H, w.xn + g * H, L.post_norm, H, m.eps)
        # SwiGLU: silu(gate) * up, then down
        mats[0] = &L.gate
        mats[1] = &L.up
        outs[0] = w.gate
        outs[1] = w.up
        lds[0] = I
        lds[1] = I
        if gemm_multi(mats, outs, lds, 2, q8, w.xn, H, T, &w.qs, nt) != 0:
            return NOMEM
        for g in prange(T, num_threads=ntT, schedule='static'):
            K.silu_mul(w.gate + g * I, w.up + g * I, w.gate + g * I, I)
        if gemm1(&L.down, q8, w.gate, I, T, w.proj, H, &w.qs, nt) != 0:
            return NOMEM
    if n_out == 0:
        return OK
    # final residual and norm, only for the rows whose logits are wanted
    for i in prange(n_out, num_threads=ntO, schedule='static'):
        add_into(w.x + out_rows[i] * H, w.proj + out_rows[i] * H, H)
        rmsnorm(w.x + out_rows[i] * H, w.head_in + i * H, m.final_norm, H, m.eps)
    if gemm1(&m.head, q8, w.head_in, H, n_out, logits, m.vocab, &w.qs, nt) != 0:
        return NOMEM
    for i in range(n_out * m.vocab):
        if not isfinite(logits[i]):
            return NONFINITE
    return OK


# --------------------------------------------------------------- sessions ---

cdef object as_tokens(value, size_t vocab, what="prompt", bint allow_empty=False):
    """A 1-D int64 array of token ids, each inside the vocabulary."""
    if isinstance(value, (str, bytes)):
        raise ValueError(f"{what} must be a sequence of token ids, not text (use a Tokenizer)")
    try:
        a = np.asarray(value)
    except Exception:
        raise ValueError(f"{what} must be a sequence of integer token ids") from None
    if a.size == 0:
        if not allow_empty:
            raise ValueError(f"{what} must contain at least one token")
        return np.zeros(0, np.int64)
    if a.ndim != 1 or a.dtype.kind not in "iu":
        raise ValueError(f"{what} must be a 1-D sequence of integer token ids")
    a = a.astype(np.int64)
    bad = (a < 0) | (a >= <int64_t>vocab)
    if bad.any():
        raise ValueError(f"token ID is outside the vocabulary: {int(a[np.argmax(bad)])} "
                         f"in {what} (vocab_size={vocab})")
    return np.ascontiguousarray(a)


cdef object check_count(value, name):
    if not is_int(value) or value < 0:
        raise ValueError(f"{name} must be a nonnegative integer, got {value!r}")
    return int(value)


cdef class Session:
    """One generation over a dense model with its own contiguous KV cache
    ``(layers, capacity, kv_width)``. Methods may be called from any thread;
    calls on one session run one at a time, and ``cancel()`` is always safe."""
    cdef DenseModel model
    cdef const ModelC *m
    cdef Work w
    cdef KV kv
    cdef int64_t *prompt       # pending prompt (prefilled on first use)
    cdef size_t prompt_len
    cdef int64_t *history      # tokens whose keys/values are cached, in order
    cdef size_t hist_len
    cdef size_t capacity, position, generated, max_new
    cdef float *logits_        # (vocab,) distribution for the next token
    cdef bint have_logits
    cdef float *block_logits   # (T, vocab) during verification
    cdef size_t block_cap
    cdef double temperature, top_p
    cdef size_t top_k
    cdef cism_mt64 rng
    cdef cism_sampler sampler
    cdef int64_t *eos
    cdef size_t n_eos
    cdef int cancelled
    cdef int finish
    cdef size_t spec_proposed, spec_accepted
    cdef int64_t emitted[MAX_K + 1]
    cdef int64_t cands[MAX_K]
    cdef object lock

    def __cinit__(self):
        memset(&self.w, 0, sizeof(Work))
        memset(&self.kv, 0, sizeof(KV))
        memset(&self.sampler, 0, sizeof(cism_sampler))
        self.prompt = NULL
        self.history = NULL
        self.logits_ = NULL
        self.block_logits = NULL
        self.eos = NULL

    def __init__(self, DenseModel model, prompt, max_new_tokens, temperature=0.0, top_p=1.0,
                 top_k=0, seed=0, eos=()):
        self.model = model
        self.m = &model.c
        vocab = model.c.vocab
        p = as_tokens(prompt, vocab)
        max_new = check_count(max_new_tokens, "max_new_tokens")
        self.temperature, self.top_p, self.top_k = check_sampling(temperature, top_p, top_k, vocab)
        seed = check_seed(seed)
        e = as_tokens(list(eos) if not isinstance(eos, np.ndarray) else eos, vocab, "eos", True)
        capacity = len(p) + max_new
        if capacity > model.c.context:
            raise ValueError(f"prompt + max_new_tokens exceeds max_position_embeddings "
                             f"({len(p)} + {max_new} > {model.c.context})")
        kv_bytes = 2 * 4 * model.c.layers * capacity * model.c.kv_width
        if kv_bytes > MAX_KV_BYTES:
            raise ValueError(f"KV cache exceeds the 8 GiB safety limit ({kv_bytes} bytes)")
        self.capacity = capacity
        self.max_new = max_new
        self.prompt_len = len(p)
        self.prompt = <int64_t*>malloc(max(1, len(p)) * sizeof(int64_t))
        self.history = <int64_t*>malloc(max(1, capacity) * sizeof(int64_t))
        self.logits_ = <float*>malloc(vocab * sizeof(float))
        self.n_eos = len(e)
        self.eos = <int64_t*>malloc(max(1, len(e)) * sizeof(int64_t))
        if self.prompt == NULL or self.history == NULL or self.logits_ == NULL or self.eos == NULL:
            raise MemoryError("cannot allocate session state")
        if len(p):
            memcpy(self.prompt, cnp.PyArray_DATA(p), len(p) * sizeof(int64_t))
        if len(e):
            memcpy(self.eos, cnp.PyArray_DATA(e), len(e) * sizeof(int64_t))
        rng_seed(&self.rng, seed)
        self.kv.capacity = capacity
        self.kv.layers = model.c.layers
        self.kv.kv_width = model.c.kv_width
        self.lock = threading.Lock()
        if max_new == 0:
            self.finish = LENGTH

    def __dealloc__(self):
        free(self.prompt)
        free(self.history)
        free(self.logits_)
        free(self.block_logits)
        free(self.eos)
        free(self.kv.keys)
        free(self.kv.values)
        work_free(&self.w)
        sampler_free(&self.sampler)

    # ---- nogil core ----

    cdef int run(self, const int64_t *tokens, size_t T, bint all_rows) noexcept nogil:
        """Forward T tokens at the current position; logits of the last token
        (all_rows: of every token, into block_logits)."""
        cdef size_t i
        cdef int rc
        if work_reserve(&self.w, self.m, T, 0, 0) != 0:
            return NOMEM
        for i in range(T):
            self.w.seq_of[i] = 0
            self.w.pos_of[i] = self.position + i
        if all_rows:
            if T * self.m.vocab > self.block_cap:
                if grow_f(&self.block_logits, T * self.m.vocab):
                    return NOMEM
                self.block_cap = T * self.m.vocab
            for i in range(T):
                self.w.out_rows[i] = i
            rc = forward(self.m, &self.w, tokens, T, &self.kv, self.w.out_rows, T,
                         self.block_logits, &self.cancelled)
            if rc == OK:
                memcpy(self.logits_, self.block_logits + (T - 1) * self.m.vocab,
                       self.m.vocab * sizeof(float))
        else:
            self.w.out_rows[0] = T - 1
            rc = forward(self.m, &self.w, tokens, T, &self.kv, self.w.out_rows, 1,
                         self.logits_, &self.cancelled)
        if rc == OK:
            self.position += T
            self.have_logits = True
        return rc

    cdef int alloc_kv(self) noexcept nogil:
        cdef size_t n = self.m.layers * self.capacity * self.m.kv_width
        if self.kv.keys == NULL:
            self.kv.keys = <float*>malloc(n * sizeof(float) + 64)
            self.kv.values = <float*>malloc(n * sizeof(float) + 64)
            if self.kv.keys == NULL or self.kv.values == NULL:
                return NOMEM
        return OK

    cdef int prefill(self) noexcept nogil:
        """Run the pending prompt in chunks (bitwise equal to one block)."""
        cdef size_t start = 0, n
        cdef int rc
        if self.prompt_len == 0:
            return OK
        if cism_flag_get(&self.cancelled):
            return CANCELLED
        if self.alloc_kv() != OK:
            return NOMEM
        while start < self.prompt_len:
            n = self.prompt_len - start
            if n > PREFILL_CHUNK:
                n = PREFILL_CHUNK
            rc = self.run(self.prompt + start, n, False)
            if rc != OK:
                return rc
            start += n
        memcpy(self.history + self.hist_len, self.prompt, self.prompt_len * sizeof(int64_t))
        self.hist_len += self.prompt_len
        self.prompt_len = 0
        return OK

    cdef int64_t sample(self) noexcept nogil:
        return sample_token(self.logits_, self.m.vocab, self.temperature, self.top_p, self.top_k,
                            &self.rng, &self.sampler)

    cdef bint is_eos(self, int64_t token) noexcept nogil:
        cdef size_t i
        for i in range(self.n_eos):
            if self.eos[i] == token:
                return True
        return False

    cdef int verify_block(self, size_t ncand, size_t *n_emitted) noexcept nogil:
        """Greedy verification of self.cands[:ncand] (temperature 0): emit the
        head token; when it equals the first candidate, forward the whole
        block once, accept the argmax-matching prefix and add the correction
        (or bonus) token, rolling back the positions of rejected drafts."""
        cdef size_t allowed = self.max_new - self.generated
        cdef size_t accepted = 0, n = 0, vocab = self.m.vocab
        cdef int64_t first
        cdef int rc
        n_emitted[0] = 0
        if allowed == 0:
            return OK
        self.spec_proposed += ncand
        first = <int64_t>argmax(self.logits_, vocab)
        self.emitted[n] = first
        n += 1
        if allowed > 1 and first == self.cands[0]:
            accepted = 1
            rc = self.run(self.cands, ncand, True)
            if rc != OK:
                self.spec_accepted += accepted
                n_emitted[0] = n
                return rc
            while accepted < ncand and n < allowed:
                if <int64_t>argmax(self.block_logits + (accepted - 1) * vocab, vocab) != self.cands[accepted]:
                    break
                self.emitted[n] = self.cands[accepted]
                n += 1
                accepted += 1
            if n < allowed:
                self.emitted[n] = <int64_t>argmax(self.block_logits + (accepted - 1) * vocab, vocab)
                n += 1
            self.position -= ncand - accepted
            self.spec_accepted += accepted
        n_emitted[0] = n
        return OK

    cdef int step(self, size_t ncand, int64_t *out, size_t *produced) noexcept nogil:
        """One decoding step: sample (or verify ncand drafts), account the
        emitted tokens, forward the last one unless the session finished."""
        cdef size_t n = 0, i
        cdef int64_t tok
        cdef int rc = OK
        if ncand >= 1:
            rc = self.verify_block(ncand, &n)
        else:
            tok = self.sample()
            if tok < 0:
                return NOMEM
            self.emitted[0] = tok
            n = 1
        for i in range(n):
            out[produced[0]] = self.emitted[i]
            produced[0] += 1
            self.generated += 1
            if self.is_eos(self.emitted[i]):
                self.finish = STOP
            elif self.generated == self.max_new:
                self.finish = LENGTH
            if self.finish != RUNNING:
                break
        if rc != OK:
            return rc
        if self.finish != RUNNING:
            return OK
        if cism_flag_get(&self.cancelled):
            return CANCELLED
        # intermediate accepted tokens are already cached by the verify block
        rc = self.run(&self.emitted[n - 1], 1, False)
        if rc != OK:
            return rc
        memcpy(self.history + self.hist_len, self.emitted, n * sizeof(int64_t))
        self.hist_len += n
        return OK

    cdef int generate(self, size_t count, size_t spec_k, int64_t *out, size_t *produced) noexcept nogil:
        cdef size_t wanted, budget, k, ncand
        cdef int rc
        produced[0] = 0
        if self.finish != RUNNING:
            return OK
        if cism_flag_get(&self.cancelled):
            return CANCELLED
        wanted = self.max_new - self.generated
        if count < wanted:
            wanted = count
        if wanted == 0:
            return OK
        rc = self.prefill()
        if rc != OK:
            return rc
        while produced[0] < wanted:
            if cism_flag_get(&self.cancelled):
                return CANCELLED
            budget = wanted - produced[0]
            ncand = 0
            if spec_k >= 2:
                k = spec_k if spec_k < budget - 1 else budget - 1
                ncand = draft_tokens(self.history, self.hist_len, k, self.cands)
                if ncand < 2:
                    ncand = 0  # too short to pay for a verification block
            rc = self.step(ncand, out, produced)
            if rc != OK:
                return rc
            if self.finish != RUNNING:
                break
        return OK

    # ---- Python API ----

    cdef object fail(self, int rc):
        """Turn a nogil return code into the session's state and an exception."""
        if rc == OK:
            return
        cism_flag_set(&self.cancelled, 1)
        self.finish = CANCEL
        if rc == NOMEM:
            raise MemoryError("out of memory during inference; the session is cancelled")
        if rc == NONFINITE:
            raise RuntimeError("non-finite logits during inference; the session is cancelled")

    def next_tokens(self, count, spec_k=0):
        """Up to ``count`` new tokens. ``spec_k`` 2..16 turns on prompt-lookup
        speculation (greedy only); the tokens are identical either way."""
        count = check_count(count, "count")
        if not is_int(spec_k) or (spec_k != 0 and not 2 <= spec_k <= MAX_SPEC_K):
            raise ValueError(f"spec_k must be 0 (off) or in [2, {MAX_SPEC_K}], got {spec_k!r}")
        if spec_k and self.temperature != 0:
            raise ValueError("spec_k > 0 needs greedy decoding (temperature 0)")
        with self.lock:
            wanted = min(count, self.max_new - self.generated)
            out = np.empty(max(1, wanted), np.int64)
            return self._generate(wanted, spec_k, out)

    cdef object _generate(self, size_t wanted, size_t spec_k, cnp.ndarray out):
        cdef size_t produced = 0
        cdef int rc
        cdef int64_t *buf = <int64_t*>cnp.PyArray_DATA(out)
        with nogil:
            rc = self.generate(wanted, spec_k, buf, &produced)
        result = out[:produced].tolist()
        if rc == CANCELLED:
            self.finish = CANCEL
        else:
            self.fail(rc)
        return result

    def _prefill_now(self):
        cdef int rc
        with self.lock:
            with nogil:
                rc = self.prefill()
            if rc == CANCELLED:
                self.finish = CANCEL
            self.fail(rc)

    def _nll(self):
        """Teacher-forced mean NLL of the pending prompt (model.nll)."""
        cdef size_t n = self.prompt_len, start = 0, T, i, v, vocab = self.m.vocab
        cdef int rc = OK
        cdef double total = 0, lse
        cdef float mx
        cdef const float *row
        if n < 2:
            raise ValueError("nll requires at least 2 tokens")
        with self.lock:
            with nogil:
                rc = self.alloc_kv()
                while rc == OK and start < n:
                    T = n - start
                    if T > PREFILL_CHUNK:
                        T = PREFILL_CHUNK
                    rc = self.run(self.prompt + start, T, True)
                    if rc != OK:
                        break
                    for i in range(T):
                        if start + i + 1 >= n:
                            break
                        row = self.block_logits + i * vocab
                        mx = row[0]
                        for v in range(1, vocab):
                            if row[v] > mx:
                                mx = row[v]
                        lse = 0
                        for v in range(vocab):
                            lse += exp(<double>row[v] - <double>mx)
                        total += <double>mx + log(lse) - <double>row[self.prompt[start + i + 1]]
                    start += T
            self.fail(rc)
            if rc == CANCELLED:
                raise RuntimeError("nll was cancelled")
            return total / (n - 1)

    def draft(self, k):
        """The prompt-lookup draft of up to k tokens from the history."""
        k = check_count(k, "k")
        k = min(k, MAX_SPEC_K)
        with self.lock:
            n = draft_tokens(self.history, self.hist_len, k, self.cands)
            return [self.cands[i] for i in range(n)]

    def verify(self, candidates):
        """Verify explicit draft tokens greedily; returns the tokens emitted
        (the accepted prefix plus the correction or bonus token), leaving the
        session ready for the next call exactly as next_tokens would."""
        if self.temperature != 0:
            raise ValueError("verify needs greedy decoding (temperature 0)")
        c = as_tokens(candidates, self.m.vocab, "candidates", True)
        if len(c) > MAX_SPEC_K:
            raise ValueError(f"at most {MAX_SPEC_K} candidates, got {len(c)}")
        if len(c) == 0:
            return []
        cdef size_t produced = 0, n = len(c)
        cdef int rc = OK
        out = np.empty(MAX_SPEC_K + 1, np.int64)
        cdef int64_t *buf = <int64_t*>cnp.PyArray_DATA(out)
        with self.lock:
            if self.finish != RUNNING or self.generated >= self.max_new:
                return []
            for i in range(n):
                self.cands[i] = c[i]
            with nogil:
                rc = self.prefill()
                if rc == OK:
                    rc = self.step(n, buf, &produced)
            if rc == CANCELLED:
                self.finish = CANCEL
            else:
                self.fail(rc)
            return out[:produced].tolist()

    def spec_stats(self):
        """(proposed, accepted) draft tokens over the session's life."""
        return (self.spec_proposed, self.spec_accepted)

    def cancel(self):
        """Stop the session from any thread; it finishes with "cancelled"."""
        cism_flag_set(&self.cancelled, 1)

    @property
    def finish_reason(self):
        if self.finish == RUNNING and cism_flag_get(&self.cancelled):
            return "cancelled"
        return FINISH_NAMES[self.finish]

    @property
    def generated_tokens(self):
        return self.generated

    @property
    def position(self):
        return self.position

    @property
    def capacity(self):
        return self.capacity

    @property
    def history(self):
        """Tokens whose keys and values are cached (prompt, then generated)."""
        return [self.history[i] for i in range(self.hist_len)]

    @property
    def last_logits(self):
        """Logits of the latest forward (the next token's distribution), or
        None before the prompt has run."""
        if not self.have_logits:
            return None
        out = np.empty(self.m.vocab, np.float32)
        memcpy(cnp.PyArray_DATA(out), self.logits_, self.m.vocab * sizeof(float))
        return out

