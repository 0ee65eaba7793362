"""Dense Llama/Mistral/Qwen2/Qwen3: packed weights, the forward pass, the
solo session over its own KV cache, and the ragged step (DenseStepper) that
paged sessions, batches and the engine drive (cism._paged, cism._batch,
cism._engine); the model keeps the KV budget and the shared block pool.

One forward function serves every session kind: it runs T tokens that may
belong to several sequences (a batch), each token at its own position, with
keys and values in contiguous caches or in pages of the shared block pool.
Every per-row computation is the same whatever the batch, the chunking, the
KV layout or the thread count, so all of those agree bit for bit (in the
opt-in bf16 prefill precision too, for the prompt tokens it covers).
"""
import warnings

import numpy as np

cimport numpy as cnp
from cython.parallel cimport prange, threadid
from libc.math cimport sqrtf
from libc.stdint cimport int64_t
from libc.stdlib cimport calloc, free, realloc
from libc.string cimport memset

from cism._kernels cimport cism_kernels, cism_mat, kernel_table
from cism._weights cimport ModelBase, WeightStore
from cism._session cimport DecodeSession, MAX_K
from cism._step cimport Stepper, StepBatch, StepRun
from cism._kvcache cimport (KV, kv_alloc, kv_array, kv_block_bytes, kv_cache_bytes, kv_free, kv_paged,
                           kv_scores, kv_store, kv_weighted)
from cism._attention cimport (QTILE, AttnWork, attend_group, attend_tile, attn_work_free, attn_work_reserve,
                             query_tiles, window_softmax, window_start)
from cism._layers cimport (Rope, add_into, embed_rows, grow_f, head_norms, lm_head, rmsnorm, rope_rotate,
                           swiglu, team)
from cism.matrix cimport ACT_BF16, Scratch, bf16_ready, gemm_multi, gemm1, scratch_free
from cism._status cimport OK, CANCELLED, NOMEM, NONFINITE, NONFINITE_SCORE, cism_flag_check
from cism._checks cimport as_tokens, check_count

from cism._config import MAX_KV_BYTES, is_int, rope_attention_factor, rope_divisors
from cism._weights import check_kv_precision, check_storages
from cism.paging import BlockPool
from cism._batch import BatchSession
from cism._paged import PagedSession, PagedState, fork_session, paged_cap, paged_env_blocks

cnp.import_array()

# bumped whenever some output changes its bits (2: the int8 x q8 block sums;
# 3: int4 and fp4 x q8 activations, block sums too; 4: the attention
# softmax's maximum and sum by 16 lanes and the canonical tree)
CODE_VERSION = "cism-dense-4"
MAX_SPEC_K = MAX_K


# ----------------------------------------------------------------- model ---

cdef struct Layer:
    cism_mat q, k, v, o, gate, up, down
    const float *input_norm
    const float *post_norm
    const float *q_norm
    const float *k_norm
    const float *q_bias            # Qwen2's projection biases, or NULL
    const float *k_bias
    const float *v_bias


cdef struct ModelC:
    ModelBase base             # sizes, embedding, head, final norm, rope, threads (cism/_weights.pxd)
    bint qwen3
    size_t window              # a query attends to its last `window` positions (0: all of them)
    Layer *layer
    bint prefill_bf16          # prompt tokens' layer projections in the bf16 precision
    bint kv_f16                # KV caches hold binary16 (kv_precision "fp16")


cdef class DenseModel(WeightStore):
    """Dense Llama/Qwen3 weights packed for inference.

    ``Model(config, weights, precision="fp32", threads=None, act_precision="fp32",
    prefill_precision="exact", kv_precision="fp32")`` with ``weights`` a
    mapping of HF tensor names to float arrays.
    """
    cdef ModelC c
    cdef object paged_state
    cdef object kv_budget_         # bytes all KV caches of this model may take (None: no budget)
    cdef size_t kv_reserved        # bytes reserved by live sessions and the paged pool

    def __cinit__(self):
        memset(&self.c, 0, sizeof(ModelC))

    def __init__(self, config, weights, precision="fp32", threads=None, act_precision="fp32",
                 prefill_precision="exact", kv_precision="fp32", storages=None):
        from cism.dense import Config, weight_shapes
        # "auto": each matrix in the storage `storages` names (the loader's
        # choice per GGUF tensor), fp32 for any it does not name
        auto = precision in ("auto", "native")
        embed, linear, mlp = self.begin(config, getattr(type(self), "config_class", None) or Config,
                                    "fp32" if auto else precision, act_precision, threads, CODE_VERSION)
        if auto:
            self.precision_ = precision = "auto"
        self.storages_ = check_storages(storages, precision)
        check_prefill_precision(prefill_precision)
        check_kv_precision(kv_precision)
        self.paged_state = None
        self.kv_budget_ = kv_budget_from_env()
        arrays = self.load_weights(weights, weight_shapes(config, "lm_head.weight" in weights), config.tied)

        c = config
        self.fill_base(&self.c.base, config)
        self.c.qwen3 = c.model_type == "qwen3"
        self.c.window = c.sliding_window
        self.c.kv_f16 = kv_precision == "fp16"
        self.kv_precision_ = kv_precision
        self.c.layer = <Layer*>calloc(c.layers, sizeof(Layer))
        if self.c.layer == NULL:
            raise MemoryError("cannot allocate the layer table")

        self.pack_ends(&self.c.base, arrays, embed, c.tied)
        cdef Layer *L
        for i in range(c.layers):
            p = f"model.layers.{i}."
            L = &self.c.layer[i]
            L.input_norm = self.vec(p + "input_layernorm.weight", arrays)
            L.post_norm = self.vec(p + "post_attention_layernorm.weight", arrays)
            L.q = self.mat(p + "self_attn.q_proj.weight", arrays, linear)[0]
            L.k = self.mat(p + "self_attn.k_proj.weight", arrays, linear)[0]
            L.v = self.mat(p + "self_attn.v_proj.weight", arrays, linear)[0]
            L.o = self.mat(p + "self_attn.o_proj.weight", arrays, linear)[0]
            if self.c.qwen3:
                L.q_norm = self.vec(p + "self_attn.q_norm.weight", arrays)
                L.k_norm = self.vec(p + "self_attn.k_norm.weight", arrays)
            if c.qkv_bias:
                L.q_bias = self.vec(p + "self_attn.q_proj.bias", arrays)
                L.k_bias = self.vec(p + "self_attn.k_proj.bias", arrays)
                L.v_bias = self.vec(p + "self_attn.v_proj.bias", arrays)
            L.gate = self.mat(p + "mlp.gate_proj.weight", arrays, mlp)[0]
            L.up = self.mat(p + "mlp.up_proj.weight", arrays, mlp)[0]
            L.down = self.mat(p + "mlp.down_proj.weight", arrays, mlp)[0]
            # the source arrays may go now; packed copies hold everything
            for suffix in ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                           "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                           "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"):
                arrays.pop(p + suffix, None)
        self.build_rope(&self.c.base.rope, config.rope_theta, c.head_dim, c.context,
                        rope_divisors(config.rope_scaling, config.rope_theta, c.head_dim),
                        rope_attention_factor(config.rope_scaling))
        self.set_act_precision(act_precision)
        self.set_prefill_precision(prefill_precision)

    def session_class(self):
        return Session

    def stepper_class(self):
        return DenseStepper

    def __dealloc__(self):
        free(self.c.layer)

    # ---- properties ----

    cdef void apply_act_precision(self):
        self.c.base.act_q8 = self.act_q8_

    @property
    def prefill_precision(self):
        """The precision prompt tokens run at: ``"exact"`` (the canonical
        arithmetic, bit for bit what decoding computes) or ``"bf16"``."""
        return self.prefill_precision_

    def set_prefill_precision(self, prefill_precision):
        """``"exact"`` (default) or ``"bf16"``: the opt-in precision for
        prompt tokens. Their layer projections then run on the AMX tile unit
        with weights and activations rounded to bfloat16 (several times
        faster prefill; results close to, not equal to, exact ones).
        Generated and verified tokens and the LM head stay exact; every
        prompt token gets the same bits however the prompt is chunked or
        batched and whatever the thread count (docs/EXACTNESS.md). Where
        the CPU or OS has neither AVX512-BF16 nor AMX-BF16 this warns and stays ``"exact"``. Not
        while sessions run."""
        check_prefill_precision(prefill_precision)
        if prefill_precision == "bf16" and not bf16_ready():
            warnings.warn("prefill_precision 'bf16' needs AVX512-BF16 or AMX-BF16, which this CPU, its OS or the "
                          "kernel level in use (CISM_ISA) does not offer; prefill stays exact",
                          RuntimeWarning, stacklevel=2)
            prefill_precision = "exact"
        self.prefill_precision_ = prefill_precision
        self.c.prefill_bf16 = prefill_precision == "bf16"
        self.update_key()

    # ---- KV memory budget ----

    @property
    def kv_budget(self):
        """Bytes that all KV caches of this model together may take (sessions,
        batches and the paged pool), or None for no budget beyond the 8 GiB
        per-cache limit. Defaults to $CISM_KV_BUDGET (e.g. 2G, 512M)."""
        return self.kv_budget_

    def set_kv_budget(self, nbytes):
        if nbytes is not None and (not is_int(nbytes) or nbytes < 0):
            raise ValueError(f"kv budget must be a nonnegative number of bytes or None, got {nbytes!r}")
        self.kv_budget_ = None if nbytes is None else int(nbytes)

    @property
    def kv_in_use(self):
        """Bytes of KV cache reserved by live sessions and the paged pool."""
        return self.kv_reserved

    cdef object reserve_kv(self, size_t nbytes, what):
        # every session, batch and paged pool starts here: a mapped file
        # that changed is an error now, before a kernel reads its pages
        self.check_mapped()
        # checked before anything is allocated; the GIL serialises the counter
        if self.kv_budget_ is not None and self.kv_reserved + nbytes > self.kv_budget_:
            raise ValueError(f"KV budget exceeded: {what} needs {nbytes} bytes of KV cache and "
                             f"{self.kv_reserved} of the {self.kv_budget_}-byte budget are in use "
                             "(Model.set_kv_budget or CISM_KV_BUDGET)")
        self.kv_reserved += nbytes

    cdef void release_kv(self, size_t nbytes) noexcept:
        self.kv_reserved -= nbytes if nbytes <= self.kv_reserved else self.kv_reserved

    def _reserve_kv(self, nbytes, what):
        """Reserve KV bytes in the model's budget (cism.Engine's pool)."""
        self.reserve_kv(nbytes, what)

    def _release_kv(self, nbytes):
        self.release_kv(nbytes)

    # ---- paged KV and batches ----

    def _paged_state(self):
        with self.lock_:
            if self.paged_state is None:
                cap = paged_cap(self.c.base.layers, self.c.base.kv_width, paged_env_blocks(),
                                kv_elem_bytes(&self.c))
                nbytes = cap * kv_block_bytes(kv_elem_bytes(&self.c), self.c.base.layers, self.c.base.kv_width)
                self.reserve_kv(nbytes, f"the paged pool ({cap} blocks)")
                try:
                    self.paged_state = PagedState(self.new_pool(cap), cap)
                except BaseException:
                    self.release_kv(nbytes)
                    raise
            return self.paged_state

    def create_paged_session(self, prompt, max_new_tokens, temperature=0.0, top_p=1.0, top_k=0,
                             seed=0, eos=(), priority=0, *, min_p=0.0, repetition_penalty=1.0):
        return PagedSession(self, prompt, max_new_tokens, temperature, top_p, top_k, seed, eos,
                            priority, min_p=min_p, repetition_penalty=repetition_penalty)

    def create_paged_fork_session(self, prompt, max_new_tokens, temperature=0.0, top_p=1.0, top_k=0,
                                  seed=0, eos=(), src=None, prefix_len=0, priority=0, *, min_p=0.0,
                                  repetition_penalty=1.0):
        """A paged session whose first prefix_len tokens share src's cached
        blocks (copy on write). Its prompt must start with exactly those tokens
        of src's history; only the rest is prefilled."""
        return fork_session(self, prompt, max_new_tokens, temperature, top_p, top_k, seed, eos, src,
                            prefix_len, priority, min_p, repetition_penalty)

    def create_batch_session(self, prompts, max_new_tokens, temperature=0.0, top_p=1.0, top_k=0,
                             seed=0, eos=(), seq_seeds=None, *, min_p=0.0, repetition_penalty=1.0):
        return BatchSession(self, prompts, max_new_tokens, temperature, top_p, top_k, seed, eos,
                            seq_seeds, min_p=min_p, repetition_penalty=repetition_penalty)

    def paged_logits(self, prompt):
        """Next-token logits after the prompt, computed through the paged pool."""
        s = PagedSession(self, prompt, 0)
        try:
            s.prefill_fork_source()
            return s.last_logits
        finally:
            s.release()

    def paged_pool_usage(self):
        """(logical used, free, total) blocks of the shared pool."""
        st = self._paged_state()
        with st:
            return st.pool.usage()

    def paged_pool_phys_used(self):
        st = self._paged_state()
        with st:
            return st.pool.phys_used()

    def paged_pool_max_blocks(self):
        st = self._paged_state()
        with st:
            return st.max_blocks

    def paged_pool_reset(self, max_blocks=0):
        """Replace the pool (max_blocks 0 keeps the cap). Safe at any time:
        live paged sessions recompute their cache on their next call."""
        max_blocks = check_count(max_blocks, "max_blocks")
        st = self._paged_state()
        with st:
            cap = paged_cap(self.c.base.layers, self.c.base.kv_width, max_blocks or st.max_blocks,
                            kv_elem_bytes(&self.c))
            old = st.pool.kv_bytes()
            new = cap * kv_block_bytes(kv_elem_bytes(&self.c), self.c.base.layers, self.c.base.kv_width)
            self.release_kv(old)
            try:
                self.reserve_kv(new, f"the paged pool ({cap} blocks)")
                try:
                    pool = self.new_pool(cap)
                except BaseException:
                    self.release_kv(new)
                    raise
            except BaseException:
                self.kv_reserved += old  # the old pool stays
                raise
            st.pool = pool
            st.max_blocks = cap

    def paged_pool(self):
        """The shared BlockPool (for inspection; hold no reference across calls)."""
        return self._paged_state().pool

    cdef object new_pool(self, cap):
        return BlockPool(cap, self.c.base.layers, self.c.base.kv_width,
                         dtype=np.float16 if self.c.kv_f16 else np.float32, head_dim=self.c.base.head_dim)

    def __repr__(self):
        c = self.config
        return (f"{type(self).__name__}({c.model_type}, layers={c.layers}, hidden={c.hidden}, "
                f"precision={self.precision_!r}, act_precision={self.act_precision!r}, "
                + (f"prefill_precision={self.prefill_precision_!r}, " if self.c.prefill_bf16 else "")
                + (f"kv_precision={self.kv_precision_!r}, " if self.c.kv_f16 else "")
                + f"threads={self.c.base.threads}, weight_bytes={self.weight_bytes_})")


def check_prefill_precision(value):
    if value not in ("exact", "bf16"):
        raise ValueError(f"prefill_precision must be exact or bf16, got {value!r}")


def kv_budget_from_env():
    """$CISM_KV_BUDGET as bytes (plain, or with a K/M/G suffix); None when unset."""
    import os
    text = os.environ.get("CISM_KV_BUDGET", "").strip().upper()
    if not text:
        return None
    last = text[len(text) - 1]
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(last, 1)
    try:
        value = int(float(text[:len(text) - 1] if scale > 1 else text) * scale)
    except ValueError:
        raise ValueError(f"CISM_KV_BUDGET must be a number of bytes (e.g. 2G, 512M), got {text!r}") from None
    if value < 0:
        raise ValueError(f"CISM_KV_BUDGET must not be negative, got {text!r}")
    return value


# ----------------------------------------------------------- forward pass ---

cdef inline size_t kv_elem_bytes(const ModelC *m) noexcept nogil:
    return 2 if m.kv_f16 else 4


DEF SPLIT_MIN_SPAN = 256  # a lone decode token attends in phases (attend_split) from here on
DEF SPLIT_COLS = 32       # value columns per work item of attend_split's weighted sums


cdef struct Work:
    AttnWork a      # the attention family's token-major scratch
    float *hscores  # (heads, score_cap) every head's scores of a lone token (attend_split)
    bint prompt     # the next forward holds prompt tokens only (set by its caller)


cdef int work_reserve(Work *w, const ModelC *m, size_t T, size_t S, size_t n_out) noexcept nogil:
    if S > w.a.score_cap or <size_t>m.base.threads > w.a.threads_cap:
        w.a.score_cap = 0   # (attn_work_reserve grows the rest)
        if grow_f(&w.hscores, m.base.heads * S):
            return -1
    return attn_work_reserve(&w.a, T, S, n_out, m.base.hidden, m.base.inter, m.base.q_width, m.base.kv_width,
                             m.base.head_dim, m.base.threads)


cdef void work_free(Work *w) noexcept nogil:
    attn_work_free(&w.a)
    free(w.hscores)
    memset(w, 0, sizeof(Work))


cdef void qk_rope_store(const ModelC *m, Work *w, size_t l, size_t g, const KV *kv, size_t pos,
                        int tid) noexcept nogil:
    cdef const Layer *L = &m.layer[l]
    cdef size_t hd = m.base.head_dim, h
    cdef float *q = w.a.q + g * m.base.q_width
    cdef float *k = w.a.k + g * m.base.kv_width
    cdef const cism_kernels *K = kernel_table()
    if L.q_bias != NULL:
        # after the projection's sum, as torch's linear adds them
        add_into(q, L.q_bias, m.base.q_width)
        add_into(k, L.k_bias, m.base.kv_width)
        add_into(w.a.v + g * m.base.kv_width, L.v_bias, m.base.kv_width)
    if m.qwen3:
        # per-head RMS norms of q and k before rotation
        head_norms(q, m.base.heads, hd, L.q_norm, m.base.eps)
        head_norms(k, m.base.kv_heads, hd, L.k_norm, m.base.eps)
    rope_rotate(&m.base.rope, pos, q, m.base.heads, k, m.base.kv_heads, w.a.rope + tid * hd)
    for h in range(m.base.kv_heads):
        kv_store(K, kv, l, h, pos, k + h * hd, w.a.v + g * m.base.kv_width + h * hd)


cdef void attend_split(const ModelC *m, const cism_kernels *K, Work *w, size_t l, const KV *kv,
                       int nt) noexcept nogil:
    """Attention of one sequence's lone decode token (token 0) over a long
    context, in three phases that spread evenly over the threads, each
    reading every key and value once and each exact:
    the scores by (KV group, run of key tiles), the group's heads as one
    tile of queries (scores16: each key's dot whatever tiles the call
    covers); the softmax by head (the same function, positions in order);
    the weighted sums by (KV group, SPLIT_COLS value columns), the group's
    heads as one tile (axpy_tile: each output element's fma chain over the
    positions in order, whatever columns the call covers). So every head
    gets attend()'s bits for it alone."""
    cdef size_t hd = m.base.head_dim
    cdef size_t p = w.a.pos_of[0], span = p + 1, lo = window_start(m.window, p)
    cdef size_t t0 = lo // 16, tiles = (span + 15) // 16 - t0   # the key tiles read: from the window's
    cdef size_t runs = min(tiles, <size_t>(4 * nt))      # runs of key tiles per KV group
    cdef size_t cols = (hd + SPLIT_COLS - 1) // SPLIT_COLS
    cdef size_t r
    for r in prange(m.base.kv_heads * runs, num_threads=nt, schedule='static'):
        split_scores(m, K, w, l, kv, r // runs, t0 + tiles * (r % runs) // runs,
                     t0 + tiles * (r % runs + 1) // runs)
    for r in prange(m.base.heads, num_threads=nt, schedule='static'):
        window_softmax(K, w.hscores + r * span, lo, p, 1.0 / sqrtf(<float>hd), w.a.att + r * hd, hd,
                       &w.a.bad_score)
    for r in prange(m.base.kv_heads * cols, num_threads=nt, schedule='static'):
        split_weighted(m, K, w, l, kv, r // cols, (r % cols) * SPLIT_COLS)


cdef void split_scores(const ModelC *m, const cism_kernels *K, Work *w, size_t l, const KV *kv, size_t kvh,
                       size_t t0, size_t t1) noexcept nogil:
    """attend_split's scores of KV group kvh's heads against key tiles t0..t1."""
    cdef size_t hd = m.base.head_dim, G = m.base.heads // m.base.kv_heads, span = w.a.pos_of[0] + 1, t, h0, nh
    for t in range((G + QTILE - 1) // QTILE):
        h0 = kvh * G + t * QTILE
        nh = min(<size_t>QTILE, (kvh + 1) * G - h0)
        kv_scores(K, kv, w.a.q + h0 * hd, hd, nh, l, kvh, hd, w.hscores + h0 * span, span, span, t0, t1)


cdef void split_weighted(const ModelC *m, const cism_kernels *K, Work *w, size_t l, const KV *kv, size_t kvh,
                         size_t c0) noexcept nogil:
    """attend_split's weighted sums of KV group kvh's heads, value columns
    c0..c0 + SPLIT_COLS (within the head), every position in order."""
    cdef size_t hd = m.base.head_dim, G = m.base.heads // m.base.kv_heads, span = w.a.pos_of[0] + 1
    cdef size_t n = min(<size_t>SPLIT_COLS, hd - c0), t, h0, nh, lo = window_start(m.window, span - 1)
    for t in range((G + QTILE - 1) // QTILE):
        h0 = kvh * G + t * QTILE
        nh = min(<size_t>QTILE, (kvh + 1) * G - h0)
        kv_weighted(K, kv, w.hscores + h0 * span, span, nh, l, kvh, lo, span, c0, w.a.att + h0 * hd + c0, hd, n)


cdef int forward(const ModelC *m, Work *w, const int64_t *tokens, size_t T, const KV *kvs,
                 const size_t *out_rows, size_t n_out, float *logits, int *cancel) noexcept nogil:
    """Run T tokens (w.a.seq_of / w.a.pos_of give each token's sequence and
    position) through the model; logits of the tokens listed in out_rows go
    to logits (n_out, vocab). Keys and values are written for every token.
    Returns OK, CANCELLED, NOMEM, NONFINITE_SCORE (checked for every token,
    so also in a prompt chunk that wants no logits) or NONFINITE."""
    cdef const cism_kernels *K = kernel_table()
    cdef size_t H = m.base.hidden, I = m.base.inter, hd = m.base.head_dim
    cdef size_t QW = m.base.q_width, KW = m.base.kv_width
    # threads per loop: the whole team only where the loop has the work for it
    cdef int nt = m.base.threads
    cdef int ntT = team(nt, T, T * H)
    cdef int ntH
    cdef size_t ntiles
    cdef size_t S = 0, g, l, r, nq, h, per_tile, items
    cdef size_t group = m.base.heads // m.base.kv_heads
    cdef bint split
    cdef float *sc
    cdef const Layer *L
    cdef const cism_mat *mats[3]
    cdef float *outs[3]
    cdef size_t lds[3]
    cdef bint q8 = m.base.act_q8
    # the layers' projections: bf16 for prompt tokens when the model asks for
    # it (the head, and every generated token, stay canonical)
    cdef int lmode = (ACT_BF16 | q8) if (m.prefill_bf16 and w.prompt) else q8
    # and their attention, where the CPU has the kernels (AVX512-BF16) and
    # no sliding window cuts the key pairs: a quarter of a bf16 prefill's
    # time left at fp32 otherwise (SmolLM2, 512 tokens)
    cdef bint abf16 = (lmode & ACT_BF16) != 0 and K.scores16_bf16 != NULL and m.window == 0
    cdef int rc
    for g in range(T):
        if w.a.pos_of[g] + 1 > S:
            S = w.a.pos_of[g] + 1
    if work_reserve(w, m, T, S, n_out) != 0:
        return NOMEM
    ntiles = query_tiles(w.a.tile_of, w.a.seq_of, w.a.pos_of, T)
    split = T == 1 and nt > 1 and w.a.pos_of[0] + 1 >= SPLIT_MIN_SPAN and not abf16
    per_tile = m.base.kv_heads if nt == 1 or ntiles * m.base.kv_heads >= 2 * <size_t>nt else m.base.heads
    items = ntiles * per_tile
    ntH = team(nt, items, T * m.base.heads * S * hd)
    w.a.bad_score = 0
    embed_rows(&m.base.embed, tokens, T, w.a.x, H, ntT)
    for l in range(m.base.layers):
        if cism_flag_check(cancel):
            return CANCELLED
        L = &m.layer[l]
        # attention rmsnorm (after the previous layer's MLP residual)
        for g in prange(T, num_threads=ntT, schedule='static'):
            if l > 0:
                add_into(w.a.x + g * H, w.a.proj + g * H, H)
            rmsnorm(w.a.x + g * H, w.a.xn + g * H, L.input_norm, H, m.base.eps)
        # q, k, v projections in one pass over their rows
        mats[0] = &L.q
        mats[1] = &L.k
        mats[2] = &L.v
        outs[0] = w.a.q
        outs[1] = w.a.k
        outs[2] = w.a.v
        lds[0] = QW
        lds[1] = KW
        lds[2] = KW
        if gemm_multi(mats, outs, lds, 3, lmode, w.a.xn, H, T, &w.a.qs, nt) != 0:
            return NOMEM
        # (qwen3 q/k norms,) rotate q and k, store k and v
        for g in prange(T, num_threads=ntT, schedule='static'):
            qk_rope_store(m, w, l, g, &kvs[w.a.seq_of[g]], w.a.pos_of[g], threadid())
        # causal GQA attention. One sequence's lone decode token over a long
        # context: in phases over all threads (attend_split). Else one
        # (query tile, KV group) per work item: a lone query's heads of the
        # group go together (attend_group), a tile of several queries head
        # by head; with fewer than two groups per thread (one sequence, few
        # KV heads), one (tile, head) per item instead, for balance. Later
        # tiles attend over more positions, hence the dynamic schedule. Items
        # go KV group (or head) first, tiles within it, so consecutive items
        # read the same keys and values (a long prompt's stay in L2).
        if split:
            attend_split(m, K, w, l, &kvs[w.a.seq_of[0]], nt)
        else:
            for r in prange(items, num_threads=ntH, schedule='dynamic'):
                g = w.a.tile_of[r % ntiles]
                nq = (w.a.tile_of[r % ntiles + 1] if r % ntiles + 1 < ntiles else T) - g
                sc = w.a.scores + threadid() * QTILE * w.a.score_cap
                if per_tile == m.base.heads:
                    h = r // ntiles
                    attend_tile(K, &kvs[w.a.seq_of[g]], l, h // group, w.a.q + g * QW + h * hd,
                                w.a.att + g * QW + h * hd, QW, nq, w.a.pos_of[g], m.window, sc,
                                &w.a.bad_score, abf16)
                elif nq == 1:
                    h = (r // ntiles) * group
                    attend_group(K, &kvs[w.a.seq_of[g]], l, r // ntiles, w.a.q + g * QW + h * hd,
                                 w.a.att + g * QW + h * hd, group, w.a.pos_of[g], m.window, sc,
                                 &w.a.bad_score, abf16)
                else:
                    for h in range((r // ntiles) * group, (r // ntiles + 1) * group):
                        attend_tile(K, &kvs[w.a.seq_of[g]], l, h // group, w.a.q + g * QW + h * hd,
                                    w.a.att + g * QW + h * hd, QW, nq, w.a.pos_of[g], m.window, sc,
                                    &w.a.bad_score, abf16)
        if w.a.bad_score:
            return NONFINITE_SCORE
        # output projection, residual, MLP rmsnorm
        if gemm1(&L.o, lmode, w.a.att, QW, T, w.a.proj, H, &w.a.qs, nt) != 0:
            return NOMEM
        for g in prange(T, num_threads=ntT, schedule='static'):
            add_into(w.a.x + g * H, w.a.proj + g * H, H)
            rmsnorm(w.a.x + g * H, w.a.xn + g * H, L.post_norm, H, m.base.eps)
        # SwiGLU: silu(gate) * up, then down (its residual is added by the next layer)
        if swiglu(&L.gate, &L.up, &L.down, lmode, w.a.xn, H, I, T, w.a.gate, w.a.up, w.a.proj, &w.a.qs, nt, ntT) != 0:
            return NOMEM
    if n_out == 0:
        return OK
    # final residual, norm and head, only for the rows whose logits are wanted
    rc = lm_head(&m.base.head, m.base.final_norm, m.base.eps, w.a.x, w.a.proj, out_rows, n_out, H, m.base.vocab,
                 q8, w.a.head_in, logits, &w.a.qs, nt)
    return OK if rc == 0 else (NOMEM if rc == -1 else NONFINITE)


# --------------------------------------------------------------- sessions ---

cdef size_t session_kv_bytes(const ModelC *m, size_t capacity) noexcept:
    return kv_cache_bytes(kv_elem_bytes(m), m.base.layers, capacity, m.base.kv_width)


cdef object check_kv(const ModelC *m, size_t capacity, size_t sequences=1):
    kv_bytes = session_kv_bytes(m, capacity) * sequences
    if kv_bytes > MAX_KV_BYTES:
        raise ValueError(f"KV cache exceeds the 8 GiB safety limit ({kv_bytes} bytes)")


cdef class Session(DecodeSession):
    """One generation over a dense model with its own contiguous KV cache
    ``(layers, capacity, kv_width)``."""
    cdef DenseModel model
    cdef const ModelC *m
    cdef KV kv
    cdef size_t kv_bytes         # reserved in the model's KV budget

    def __cinit__(self, *args, **kwargs):
        memset(&self.kv, 0, sizeof(KV))
        self.kv_bytes = 0

    def __init__(self, DenseModel model, prompt, max_new_tokens, temperature=0.0, top_p=1.0,
                 top_k=0, seed=0, eos=(), *, min_p=0.0, repetition_penalty=1.0):
        self.model = model
        self.m = &model.c
        self.stepper = DenseStepper(model)
        self.one.kv = &self.kv
        self.setup(as_tokens(prompt, model.c.base.vocab), 0, model.c.base.vocab, model.c.base.context,
                   max_new_tokens, temperature, top_p, top_k, seed, eos, min_p, repetition_penalty)
        check_kv(self.m, self.s.capacity)
        nbytes = session_kv_bytes(self.m, self.s.capacity)
        model.reserve_kv(nbytes, "this session")
        self.kv_bytes = nbytes

    def __dealloc__(self):
        if self.kv_bytes and self.model is not None:
            self.model.release_kv(self.kv_bytes)
        kv_free(&self.kv)

    # run() is the stepper's forward over this cache. Rejected drafts need no
    # undo: rows past the position are rewritten before any query reads them,
    # so the position roll-back in step() is all.
    cdef int alloc(self) noexcept nogil:
        return (OK if kv_alloc(&self.kv, self.m.base.layers, self.s.capacity, self.m.base.kv_heads,
                               self.m.base.head_dim, kv_elem_bytes(self.m)) == 0 else NOMEM)


# -------------------------------------------------------- the ragged step ---


cdef class DenseStepper(Stepper):
    """The dense forward over a ragged batch (cism.Engine, sessions): each
    sequence's keys and values in pool pages through its block table, or in
    its own contiguous cache."""
    cdef const ModelC *m
    cdef Work w

    def __cinit__(self, *args, **kwargs):
        memset(&self.w, 0, sizeof(Work))

    def __init__(self, DenseModel model):
        Stepper.__init__(self, model)
        self.m = &model.c
        self.vocab = model.c.base.vocab
        self.state_floats = 0
        self.kv_layers = model.c.base.layers
        self.kv_width = model.c.base.kv_width
        self.head_dim = model.c.base.head_dim
        self.kv_dtype = np.dtype(np.float16 if model.c.kv_f16 else np.float32)
        self.bf16_prompts = model.c.prefill_bf16

    def __dealloc__(self):
        work_free(&self.w)

    cdef int forward(self, StepBatch *b) noexcept nogil:
        cdef size_t r, i, n_out = 0
        cdef const StepRun *run
        if kv_array(&self.kvs, &self.kvs_cap, b.n_runs) != 0:
            return NOMEM
        for r in range(b.n_runs):
            n_out += b.runs[r].n_out
        if work_reserve(&self.w, self.m, b.T, 0, n_out) != 0:
            return NOMEM
        for r in range(b.n_runs):
            run = &b.runs[r]
            if run.kv != NULL:
                self.kvs[r] = run.kv[0]
            else:
                kv_paged(&self.kvs[r], self.k_pages, self.v_pages, run.blocks, self.n_pages, self.m.base.layers,
                         self.m.base.kv_heads, self.m.base.head_dim, kv_elem_bytes(self.m))
            for i in range(run.n):
                self.w.a.seq_of[run.first + i] = <int>r
                self.w.a.pos_of[run.first + i] = run.pos + i
            for i in range(run.n_out):
                self.w.a.out_rows[run.out_row + i] = run.first + run.n - run.n_out + i
        self.w.prompt = b.prompt and self.m.prefill_bf16
        return forward(self.m, &self.w, b.tokens, b.T, self.kvs, self.w.a.out_rows, n_out,
                       b.logits, b.cancel)
