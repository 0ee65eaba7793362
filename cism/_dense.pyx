"""Dense Llama/Qwen3: packed weights, the forward pass, and sessions.

One forward function serves every session kind: it runs T tokens that may
belong to several sequences (a batch), each token at its own position, with
keys and values in contiguous caches or in pages of the shared block pool.
Every per-row computation is the same whatever the batch, the chunking, the
KV layout or the thread count, so all of those agree bit for bit (in the
opt-in bf16 prefill precision too, for the prompt tokens it covers).
"""
import hashlib
import threading
import warnings

import numpy as np

cimport numpy as cnp
from cython.parallel cimport prange, threadid
from libc.math cimport sqrt, sqrtf, powf, cosf, sinf, exp, log, isfinite
from libc.stdint cimport int64_t, uint64_t, uint8_t, uint16_t
from libc.stdlib cimport malloc, calloc, realloc, free
from libc.string cimport memcpy, memset

from cism._kernels cimport cism_kernels, cism_mat, kernel_table
from cism._weights cimport WeightStore
from cism._session cimport (SeqCore, SessionState, DecodeSession, core_alloc, core_free,
                            core_account, MAX_K, PREFILL_CHUNK)
from cism._nn cimport (KV, add_into, all_finite_f, grow_f, k_tile, kv_array, kv_paged, kv_scores, kv_store,
                      kv_weighted, rmsnorm, rotate, tile_softmax, v_row, v_stride)
from cism.matrix cimport ACT_BF16, Matrix, Scratch, bf16_ready, gemm_multi, gemm1, mat_row, scratch_free
from cism.sampling cimport (cism_mt64, cism_sampler, cism_knobs, rng_seed, argmax, choose_token,
                            sampler_free, draft_tokens)
from cism._common cimport (OK, CANCELLED, NOMEM, NONFINITE, NONFINITE_SCORE, ERROR, RUNNING, STOP, LENGTH, CANCEL, Params,
                           as_tokens, check_count, check_spec_k, parse_params, raise_for,
                           logits_copy, params_eos, knobs_of, cism_flag_get, cism_flag_set,
                           cism_flag_check, arm_cancel)
from cism._common import FINISH_NAMES

from cism import _kernels
from cism._config import MAX_KV_BYTES, is_int, rope_divisors
from cism._threads import resolve_threads
from cism._weights import (PRECISIONS, check_kv_precision, check_precisions, check_storages,
                           check_weights, load_float, rope_tables)
from cism.sampling import check_seed

cnp.import_array()

# bumped whenever some output changes its bits (2: the int8 x q8 block sums;
# 3: int4 and fp4 x q8 activations, block sums too; 4: the attention
# softmax's maximum and sum by 16 lanes and the canonical tree)
CODE_VERSION = "cism-dense-4"
MAX_SPEC_K = MAX_K
# Rotary sin/cos are tabulated up to this many positions; later positions are
# computed with the same formula on the fly.
DEF ROPE_TABLE_MAX = 32768



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
    size_t hidden, inter, layers, heads, kv_heads, head_dim, vocab, context, q_width, kv_width
    float eps
    bint qwen3
    size_t window              # a query attends to its last `window` positions (0: all of them)
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
    bint prefill_bf16          # prompt tokens' layer projections in the bf16 precision
    bint kv_f16                # KV caches hold binary16 (kv_precision "fp16")


cdef class DenseModel(WeightStore):
    """Dense Llama/Qwen3 weights packed for inference.

    ``Model(config, weights, precision="fp32", threads=None, act_precision="fp32",
    prefill_precision="exact", kv_precision="fp32")`` with ``weights`` a
    mapping of HF tensor names to float arrays.
    """
    cdef ModelC c
    cdef list rope_keep            # inv_freq and the rotary tables (not weights)
    cdef object paged_state
    cdef object kv_budget_         # bytes all KV caches of this model may take (None: no budget)
    cdef size_t kv_reserved        # bytes reserved by live sessions and the paged pool

    def __cinit__(self):
        memset(&self.c, 0, sizeof(ModelC))

    def __init__(self, config, weights, precision="fp32", threads=None, act_precision="fp32",
                 prefill_precision="exact", kv_precision="fp32", storages=None):
        cls_config = getattr(type(self), "config_class", None)
        if cls_config is None:
            from cism.dense import Config as cls_config
        if not isinstance(config, cls_config):
            raise ValueError(f"config must be a cism.dense.Config, got {type(config).__name__}")
        # "auto": each matrix in the storage `storages` names (the loader's
        # choice per GGUF tensor), fp32 for any it does not name
        protected, mlp = check_precisions("fp32" if precision in ("auto", "native") else precision,
                                          act_precision)
        if precision == "native":
            precision = "auto"
        self.storages_ = check_storages(storages, precision)
        check_prefill_precision(prefill_precision)
        check_kv_precision(kv_precision)
        from cism.dense import weight_shapes
        self.config = config
        self.precision_ = precision
        self.paged_state = None
        self.kv_budget_ = kv_budget_from_env()
        nthreads = resolve_threads(threads)
        has_head = "lm_head.weight" in weights
        shapes = weight_shapes(config, has_head)
        arrays = check_weights(weights, shapes)
        if config.tied and has_head:
            if not np.array_equal(load_float(arrays["lm_head.weight"], "lm_head.weight"),
                                  load_float(arrays["model.embed_tokens.weight"], "model.embed_tokens.weight")):
                raise ValueError("tied lm_head.weight must equal model.embed_tokens.weight")

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
        self.c.window = c.sliding_window
        self.c.kv_f16 = kv_precision == "fp16"
        self.kv_precision_ = kv_precision
        self.c.threads = nthreads
        self.scan_threads = nthreads
        self.threads_ = nthreads
        self.code_version = CODE_VERSION
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
            if c.qkv_bias:
                L.q_bias = self._norm(p + "self_attn.q_proj.bias", arrays)
                L.k_bias = self._norm(p + "self_attn.k_proj.bias", arrays)
                L.v_bias = self._norm(p + "self_attn.v_proj.bias", arrays)
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
        self.set_prefill_precision(prefill_precision)

    cdef cism_mat* _matrix(self, name, dict arrays, storage) except NULL:
        cdef Matrix m = self.add_any_matrix(name, arrays[name], self.storages_.get(name, storage),
                                            self.c.threads)
        return &m.mat

    cdef const float* _norm(self, name, dict arrays) except NULL:
        cdef cnp.ndarray a = self.add_vector(name, arrays[name])
        return <const float*>cnp.PyArray_DATA(a)

    cdef _build_rope(self):
        divisors = rope_divisors(self.config.rope_scaling, self.config.rope_theta, self.c.head_dim)
        inv, cos_t, sin_t = rope_tables(self.config.rope_theta, self.c.head_dim, self.c.context,
                                        ROPE_TABLE_MAX, divisors)
        self.rope_keep = [inv, cos_t, sin_t]
        self.c.inv_freq = <float*>cnp.PyArray_DATA(inv)
        self.c.rope_cos = <float*>cnp.PyArray_DATA(cos_t)
        self.c.rope_sin = <float*>cnp.PyArray_DATA(sin_t)
        self.c.rope_positions = cos_t.shape[0]

    def __dealloc__(self):
        free(self.c.layer)

    # ---- properties ----

    cdef void apply_act_precision(self):
        self.c.act_q8 = self.act_q8_

    @property
    def kv_precision(self):
        """What the KV caches hold: ``"fp32"`` (default) or ``"fp16"``: keys
        and values rounded to binary16 as they are stored (half the bytes
        per cached position, so twice the positions per budget and faster
        long-context decode; attention then runs in fp32 over the widened
        values, with every bitwise guarantee kept; docs/EXACTNESS.md).
        Chosen when the model is built."""
        return self.kv_precision_

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

    # ---- sessions and one-shot evaluation ----

    def create_session(self, prompt, max_new_tokens, temperature=0.0, top_p=1.0, top_k=0,
                       seed=0, eos=(), *, min_p=0.0, repetition_penalty=1.0):
        """A generation with its own KV cache. min_p and repetition_penalty are
        extensions (off by default, leaving the spec's sampler bit-exact)."""
        return Session(self, prompt, max_new_tokens, temperature, top_p, top_k, seed, eos,
                       min_p=min_p, repetition_penalty=repetition_penalty)

    def logits(self, prompt):
        """Next-token logits after the prompt, float32 (vocab,)."""
        s = Session(self, prompt, 0, 0.0, 1.0, 0, 0, ())
        s._prefill_now()
        return s.last_logits

    def nll(self, tokens):
        """Mean negative log-likelihood of tokens[1:] given the tokens before
        (teacher forcing, positions from zero), in one pass."""
        return Session(self, tokens, 0, 0.0, 1.0, 0, 0, ())._nll()

    def logits_all(self, tokens):
        """Logits after every prefix of tokens, float32 (T, vocab): row i is
        the distribution for token i+1 (for perplexity and KL evaluations)."""
        return Session(self, tokens, 0, 0.0, 1.0, 0, 0, ())._all_logits()

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

    def _engine_stepper(self):
        """The forward over ragged batches that cism.Engine drives."""
        return DenseStepper(self)

    # ---- paged KV and batches ----

    def _paged_state(self):
        with self.lock_:
            if self.paged_state is None:
                cap = paged_cap(self.c.layers, self.c.kv_width, paged_env_blocks(), kv_elem_bytes(&self.c))
                nbytes = cap * self.c.layers * 16 * self.c.kv_width * 2 * kv_elem_bytes(&self.c)
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
        if src is None:
            raise ValueError("fork source session is null")
        if not isinstance(src, PagedSession):
            raise ValueError("fork source must be a PagedSession")
        if (<PagedSession>src).model is not self:
            raise ValueError("fork source belongs to a different model")
        prefix_len = check_count(prefix_len, "prefix_len")
        p = as_tokens(prompt, self.c.vocab, "prompt", True)
        if len(p) < prefix_len:
            raise ValueError(f"fork prefix longer than child prompt ({prefix_len} > {len(p)})")
        hist, logits = src._source_view()
        if len(p) == prefix_len:
            # nothing to prefill: the first sample needs the source's logits
            # for exactly this prefix, or it would sample garbage
            if prefix_len == 0:
                raise ValueError("fork with empty prompt cannot seed first-token logits")
            if logits is None:
                raise ValueError("fork source has no forward output to seed from; "
                                 "prefill the source first")
            if len(hist) > prefix_len:
                raise ValueError("fork source advanced past the shared prefix; "
                                 "empty-suffix fork cannot seed first-token logits")
        if prefix_len > len(hist):
            raise ValueError(f"fork prefix longer than source history ({prefix_len} > {len(hist)})")
        if not np.array_equal(p[:prefix_len], hist[:prefix_len]):
            raise ValueError("fork prefix tokens differ from source history")
        fork = {"prefix": np.ascontiguousarray(p[:prefix_len]),
                "suffix": np.ascontiguousarray(p[prefix_len:]),
                "src_req": (<PagedSession>src).req_id, "seed_logits": logits}
        return PagedSession(self, None, max_new_tokens, temperature, top_p, top_k, seed, eos,
                            priority, _fork=fork, min_p=min_p, repetition_penalty=repetition_penalty)

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
            cap = paged_cap(self.c.layers, self.c.kv_width, max_blocks or st.max_blocks, kv_elem_bytes(&self.c))
            old = st.pool.kv_bytes()
            new = cap * self.c.layers * 16 * self.c.kv_width * 2 * kv_elem_bytes(&self.c)
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
        return BlockPool(cap, self.c.layers, self.c.kv_width,
                         dtype=np.float16 if self.c.kv_f16 else np.float32, head_dim=self.c.head_dim)

    def __repr__(self):
        c = self.config
        return (f"{type(self).__name__}({c.model_type}, layers={c.layers}, hidden={c.hidden}, "
                f"precision={self.precision_!r}, act_precision={self.act_precision!r}, "
                + (f"prefill_precision={self.prefill_precision_!r}, " if self.c.prefill_bf16 else "")
                + (f"kv_precision={self.kv_precision_!r}, " if self.c.kv_f16 else "")
                + f"threads={self.c.threads}, weight_bytes={self.weight_bytes_})")


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


cdef inline void kv_shape(KV *kv, const ModelC *m, size_t capacity) noexcept nogil:
    kv.capacity = capacity
    kv.layers = m.layers
    kv.kv_width = m.kv_width
    kv.kv_heads = m.kv_heads
    kv.head_dim = m.head_dim
    kv.esize = kv_elem_bytes(m)


DEF QTILE = 16  # queries of one sequence attended together (scores16 takes them four at a time)
DEF SPLIT_MIN_SPAN = 256  # a lone decode token attends in phases (attend_split) from here on
DEF SPLIT_COLS = 32       # value columns per work item of attend_split's weighted sums


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
    float *scores   # (threads, QTILE * score_cap) attention scores of one query tile per thread
    float *hscores  # (heads, score_cap) every head's scores of a lone token (attend_split)
    float *rope     # (threads, head_dim) cos/sin beyond the table
    int *seq_of     # (T,) sequence of each token
    size_t *pos_of  # (T,) position of each token
    size_t *out_rows
    size_t *tile_of  # (T,) first token of each attention query tile
    size_t tokens_cap, score_cap, out_cap, threads_cap
    bint prompt     # the next forward holds prompt tokens only (set by its caller)
    int bad_score   # set (atomically, by any thread) when an attention score is not finite
    Scratch qs


cdef int work_reserve(Work *w, const ModelC *m, size_t T, size_t S, size_t n_out) noexcept nogil:
    cdef size_t nt = m.threads
    # a cap is zeroed before its buffers are replaced, so a failed grow
    # leaves nothing that a later, smaller call could mistake for room
    if T > w.tokens_cap:
        w.tokens_cap = 0
        if (grow_f(&w.x, T * m.hidden) or grow_f(&w.xn, T * m.hidden) or grow_f(&w.q, T * m.q_width)
                or grow_f(&w.k, T * m.kv_width) or grow_f(&w.v, T * m.kv_width)
                or grow_f(&w.att, T * m.q_width) or grow_f(&w.proj, T * m.hidden)
                or grow_f(&w.gate, T * m.inter) or grow_f(&w.up, T * m.inter)):
            return -1
        w.seq_of = <int*>realloc(w.seq_of, T * sizeof(int))
        w.pos_of = <size_t*>realloc(w.pos_of, T * sizeof(size_t))
        w.out_rows = <size_t*>realloc(w.out_rows, T * sizeof(size_t))
        w.tile_of = <size_t*>realloc(w.tile_of, T * sizeof(size_t))
        if w.seq_of == NULL or w.pos_of == NULL or w.out_rows == NULL or w.tile_of == NULL:
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
        if (grow_f(&w.scores, nt * QTILE * S) or grow_f(&w.hscores, m.heads * S)
                or grow_f(&w.rope, nt * m.head_dim)):
            return -1
        w.score_cap = S
        w.threads_cap = nt
    return 0


cdef void work_free(Work *w) noexcept nogil:
    free(w.x); free(w.xn); free(w.q); free(w.k); free(w.v); free(w.att); free(w.proj)
    free(w.gate); free(w.up); free(w.head_in); free(w.scores); free(w.hscores); free(w.rope)
    free(w.seq_of); free(w.pos_of); free(w.out_rows); free(w.tile_of)
    scratch_free(&w.qs)
    memset(w, 0, sizeof(Work))


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
    cdef const cism_kernels *K = kernel_table()
    if L.q_bias != NULL:
        # after the projection's sum, as torch's linear adds them
        add_into(q, L.q_bias, m.q_width)
        add_into(k, L.k_bias, m.kv_width)
        add_into(w.v + g * m.kv_width, L.v_bias, m.kv_width)
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
    for h in range(m.kv_heads):
        kv_store(K, kv, l, h, pos, k + h * hd, w.v + g * m.kv_width + h * hd)


cdef void attend(const ModelC *m, const cism_kernels *K, Work *w, size_t l, size_t g0, size_t nq,
                 size_t h, const KV *kv, float *sc) noexcept nogil:
    """Causal attention of head h for the nq tokens g0.. of one sequence at
    consecutive positions p0..p0 + nq - 1 (one query tile).

    Every query gets exactly the arithmetic of attending alone, position by
    position: its scores are canonical dots (scores16 over the key tiles:
    the fp32 gemm's bits for each key), times the scale;
    then max, exp, one sum in position order, each weight score / sum; then
    out = fma(weight, value, out) over positions in order (axpy_tile: the
    tile for the positions every query sees, each query alone for the
    rest)."""
    cdef size_t hd = m.head_dim, QW = m.q_width
    cdef size_t p0 = w.pos_of[g0], span = p0 + nq, i, lo
    cdef size_t kvh = h // (m.heads // m.kv_heads)
    cdef const float *q = w.q + g0 * QW + h * hd
    cdef float *out = w.att + g0 * QW + h * hd
    cdef float scale = 1.0 / sqrtf(<float>hd)
    kv_scores(K, kv, q, QW, nq, l, kvh, hd, sc, span, span, window_start(m, p0) // 16, (span + 15) // 16)
    if window_start(m, span - 1) == 0:
        tile_softmax(K, sc, span, nq, p0, scale, out, QW, hd, &w.bad_score)
        kv_weighted(K, kv, sc, span, nq, l, kvh, 0, p0 + 1, 0, out, QW, hd)
        for i in range(1, nq):
            kv_weighted(K, kv, sc + i * span, span, 1, l, kvh, p0 + 1, p0 + i + 1, 0, out + i * QW, QW, hd)
    else:
        # a sliding window cuts in: each query over its own positions (the
        # tile's split above gives each query these bits too, axpy_tile's
        # chain being plain axpy's)
        for i in range(nq):
            lo = window_start(m, p0 + i)
            window_softmax(K, sc + i * span, lo, p0 + i, scale, out + i * QW, hd, &w.bad_score)
            kv_weighted(K, kv, sc + i * span, span, 1, l, kvh, lo, p0 + i + 1, 0, out + i * QW, QW, hd)


cdef inline size_t window_start(const ModelC *m, size_t p) noexcept nogil:
    """The first position a query at position p attends to: 0, or the
    start of its sliding window (Mistral: the last `window` positions,
    itself included, as transformers masks them)."""
    return p + 1 - m.window if m.window and p + 1 > m.window else 0


cdef inline void window_softmax(const cism_kernels *K, float *row, size_t lo, size_t p, float scale,
                                float *out, size_t hd, int *bad) noexcept nogil:
    """tile_softmax for one query at position p over positions lo..p of its
    score row (lo = 0: tile_softmax's bits); zeroes its output."""
    if not all_finite_f(row + lo, p + 1 - lo):
        cism_flag_set(bad, 1)
    K.softmax(row + lo, p + 1 - lo, scale)
    memset(out, 0, hd * sizeof(float))


cdef void attend_group(const ModelC *m, const cism_kernels *K, Work *w, size_t l, size_t g, size_t kvh,
                       const KV *kv, float *sc) noexcept nogil:
    """Attention of token g alone in its tile (decode, a batch of decode
    tokens) for the heads that share KV head kvh, up to QTILE of them at a
    time as one tile of queries over the same keys and values: scores16
    gives each query the dots it gets alone and axpy_tile each output the
    fma chain of plain axpy calls (csrc/kernels.h), so every head gets
    exactly attend()'s arithmetic for it alone; the tile reads each key and
    value once for the heads and gives the weighted sums several
    independent chains."""
    cdef size_t hd = m.head_dim, G = m.heads // m.kv_heads
    cdef size_t p = w.pos_of[g], span = p + 1, h0, nh, j, lo = window_start(m, p)
    cdef const float *q
    cdef float *out
    for h0 in range(kvh * G, (kvh + 1) * G, QTILE):
        nh = min(<size_t>QTILE, (kvh + 1) * G - h0)
        q = w.q + g * m.q_width + h0 * hd
        out = w.att + g * m.q_width + h0 * hd
        kv_scores(K, kv, q, hd, nh, l, kvh, hd, sc, span, span, lo // 16, (span + 15) // 16)
        for j in range(nh):
            window_softmax(K, sc + j * span, lo, p, 1.0 / sqrtf(<float>hd), out + j * hd, hd, &w.bad_score)
        kv_weighted(K, kv, sc, span, nh, l, kvh, lo, span, 0, out, hd, hd)


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
    cdef size_t hd = m.head_dim
    cdef size_t p = w.pos_of[0], span = p + 1, lo = window_start(m, p)
    cdef size_t t0 = lo // 16, tiles = (span + 15) // 16 - t0   # the key tiles read: from the window's
    cdef size_t runs = min(tiles, <size_t>(4 * nt))      # runs of key tiles per KV group
    cdef size_t cols = (hd + SPLIT_COLS - 1) // SPLIT_COLS
    cdef size_t r
    for r in prange(m.kv_heads * runs, num_threads=nt, schedule='static'):
        split_scores(m, K, w, l, kv, r // runs, t0 + tiles * (r % runs) // runs,
                     t0 + tiles * (r % runs + 1) // runs)
    for r in prange(m.heads, num_threads=nt, schedule='static'):
        window_softmax(K, w.hscores + r * span, lo, p, 1.0 / sqrtf(<float>hd), w.att + r * hd, hd,
                       &w.bad_score)
    for r in prange(m.kv_heads * cols, num_threads=nt, schedule='static'):
        split_weighted(m, K, w, l, kv, r // cols, (r % cols) * SPLIT_COLS)


cdef void split_scores(const ModelC *m, const cism_kernels *K, Work *w, size_t l, const KV *kv, size_t kvh,
                       size_t t0, size_t t1) noexcept nogil:
    """attend_split's scores of KV group kvh's heads against key tiles t0..t1."""
    cdef size_t hd = m.head_dim, G = m.heads // m.kv_heads, span = w.pos_of[0] + 1, h0, nh
    for h0 in range(kvh * G, (kvh + 1) * G, QTILE):
        nh = min(<size_t>QTILE, (kvh + 1) * G - h0)
        kv_scores(K, kv, w.q + h0 * hd, hd, nh, l, kvh, hd, w.hscores + h0 * span, span, span, t0, t1)


cdef void split_weighted(const ModelC *m, const cism_kernels *K, Work *w, size_t l, const KV *kv, size_t kvh,
                         size_t c0) noexcept nogil:
    """attend_split's weighted sums of KV group kvh's heads, value columns
    c0..c0 + SPLIT_COLS (within the head), every position in order."""
    cdef size_t hd = m.head_dim, G = m.heads // m.kv_heads, span = w.pos_of[0] + 1
    cdef size_t n = min(<size_t>SPLIT_COLS, hd - c0), h0, nh, lo = window_start(m, span - 1)
    for h0 in range(kvh * G, (kvh + 1) * G, QTILE):
        nh = min(<size_t>QTILE, (kvh + 1) * G - h0)
        kv_weighted(K, kv, w.hscores + h0 * span, span, nh, l, kvh, lo, span, c0, w.att + h0 * hd + c0, hd, n)


cdef size_t query_tiles(Work *w, size_t T) noexcept nogil:
    """Cut the T tokens into runs of up to QTILE tokens of one sequence at
    consecutive positions (a prompt chunk gives full tiles, a batch of
    single decode tokens tiles of one); w.tile_of[i] = first token of tile
    i. Returns the number of tiles."""
    cdef size_t g, n = 0
    for g in range(T):
        if (n == 0 or g - w.tile_of[n - 1] == QTILE or w.seq_of[g] != w.seq_of[g - 1]
                or w.pos_of[g] != w.pos_of[g - 1] + 1):
            w.tile_of[n] = g
            n += 1
    return n


cdef int forward(const ModelC *m, Work *w, const int64_t *tokens, size_t T, const KV *kvs,
                 const size_t *out_rows, size_t n_out, float *logits, int *cancel) noexcept nogil:
    """Run T tokens (w.seq_of / w.pos_of give each token's sequence and
    position) through the model; logits of the tokens listed in out_rows go
    to logits (n_out, vocab). Keys and values are written for every token.
    Returns OK, CANCELLED, NOMEM, NONFINITE_SCORE (checked for every token,
    so also in a prompt chunk that wants no logits) or NONFINITE."""
    cdef const cism_kernels *K = kernel_table()
    cdef size_t H = m.hidden, I = m.inter, QW = m.q_width, KW = m.kv_width
    cdef int nt = m.threads
    cdef int ntT = nt if T > 1 else 1
    cdef int ntH
    cdef size_t ntiles
    cdef int ntO = nt if n_out > 1 else 1
    cdef size_t S = 0, g, l, r, i, nq, h, per_tile, items
    cdef size_t group = m.heads // m.kv_heads
    cdef bint split
    cdef float *sc
    cdef const Layer *L
    cdef const cism_mat *mats[3]
    cdef float *outs[3]
    cdef size_t lds[3]
    cdef bint q8 = m.act_q8
    # the layers' projections: bf16 for prompt tokens when the model asks for
    # it (the head, and every generated token, stay canonical)
    cdef int lmode = (ACT_BF16 | q8) if (m.prefill_bf16 and w.prompt) else q8
    cdef int rc
    for g in range(T):
        if w.pos_of[g] + 1 > S:
            S = w.pos_of[g] + 1
    if work_reserve(w, m, T, S, n_out) != 0:
        return NOMEM
    ntiles = query_tiles(w, T)
    split = T == 1 and nt > 1 and w.pos_of[0] + 1 >= SPLIT_MIN_SPAN
    per_tile = m.kv_heads if nt == 1 or ntiles * m.kv_heads >= 2 * <size_t>nt else m.heads
    items = ntiles * per_tile
    ntH = nt if items > 1 else 1
    w.bad_score = 0
    for g in prange(T, num_threads=ntT, schedule='static'):
        mat_row(&m.embed, <size_t>tokens[g], w.x + g * H)
    for l in range(m.layers):
        if cism_flag_check(cancel):
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
        if gemm_multi(mats, outs, lds, 3, lmode, w.xn, H, T, &w.qs, nt) != 0:
            return NOMEM
        # (qwen3 q/k norms,) rotate q and k, store k and v
        for g in prange(T, num_threads=ntT, schedule='static'):
            qk_rope_store(m, w, l, g, &kvs[w.seq_of[g]], w.pos_of[g], threadid())
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
            attend_split(m, K, w, l, &kvs[w.seq_of[0]], nt)
        else:
            for r in prange(items, num_threads=ntH, schedule='dynamic'):
                g = w.tile_of[r % ntiles]
                nq = (w.tile_of[r % ntiles + 1] if r % ntiles + 1 < ntiles else T) - g
                sc = w.scores + threadid() * QTILE * w.score_cap
                if per_tile == m.heads:
                    attend(m, K, w, l, g, nq, r // ntiles, &kvs[w.seq_of[g]], sc)
                elif nq == 1:
                    attend_group(m, K, w, l, g, r // ntiles, &kvs[w.seq_of[g]], sc)
                else:
                    for h in range((r // ntiles) * group, (r // ntiles + 1) * group):
                        attend(m, K, w, l, g, nq, h, &kvs[w.seq_of[g]], sc)
        if w.bad_score:
            return NONFINITE_SCORE
        # output projection, residual, MLP rmsnorm
        if gemm1(&L.o, lmode, w.att, QW, T, w.proj, H, &w.qs, nt) != 0:
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
        if gemm_multi(mats, outs, lds, 2, lmode, w.xn, H, T, &w.qs, nt) != 0:
            return NOMEM
        for g in prange(T, num_threads=ntT, schedule='static'):
            K.silu_mul(w.gate + g * I, w.up + g * I, w.gate + g * I, I)
        if gemm1(&L.down, lmode, w.gate, I, T, w.proj, H, &w.qs, nt) != 0:
            return NOMEM
    if n_out == 0:
        return OK
    # final residual and norm, only for the rows whose logits are wanted
    for i in prange(n_out, num_threads=ntO, schedule='static'):
        add_into(w.x + out_rows[i] * H, w.proj + out_rows[i] * H, H)
        rmsnorm(w.x + out_rows[i] * H, w.head_in + i * H, m.final_norm, H, m.eps)
    if gemm1(&m.head, q8, w.head_in, H, n_out, logits, m.vocab, &w.qs, nt) != 0:
        return NOMEM
    if not all_finite_f(logits, n_out * m.vocab):
        return NONFINITE
    return OK


# --------------------------------------------------------------- sessions ---

cdef int kv_alloc(KV *kv, const ModelC *m, size_t capacity) noexcept nogil:
    cdef size_t n = m.layers * capacity * m.kv_width
    cdef size_t nk = m.layers * ((capacity + 15) >> 4) * 16 * m.kv_width
    kv_shape(kv, m, capacity)
    kv.blocks = NULL
    if kv.keys_mem == NULL:
        # zeroed (calloc: lazily, page by page), so the lanes of the last
        # tile past the written positions hold zeros, never stray bits
        kv.keys_mem = calloc(nk * kv.esize + 64, 1)
        kv.values = <char*>malloc(n * kv.esize + 64)
        if kv.keys_mem == NULL or kv.values == NULL:
            kv_free(kv)   # all or nothing: a later call allocates afresh
            return NOMEM
        kv.keys = <char*>((<size_t>kv.keys_mem + 63) // 64 * 64)
    return OK


cdef void kv_free(KV *kv) noexcept nogil:
    free(kv.keys_mem)
    free(kv.values)
    kv.keys_mem = NULL
    kv.keys = NULL
    kv.values = NULL


cdef int seq_run(const ModelC *m, Work *w, SeqCore *s, const KV *kv, const int64_t *tokens,
                 size_t T, float *rows, int *cancel) noexcept nogil:
    """Forward T tokens of one sequence at its position, in chunks. rows ==
    NULL: logits of the last token into s.logits; else logits of every token
    into rows (T, vocab). With bf16 prefill, a chunk never straddles the end
    of the prompt: tokens below s.prompt_end run bf16, the rest canonical
    (whichever call runs them: prefill, nll, a recompute after eviction)."""
    cdef size_t start = 0, n, i, vocab = m.vocab
    cdef int rc
    while start < T:
        n = T - start
        if n > PREFILL_CHUNK:
            n = PREFILL_CHUNK
        w.prompt = m.prefill_bf16 and s.position < s.prompt_end
        if w.prompt and s.position + n > s.prompt_end:
            n = s.prompt_end - s.position
        if work_reserve(w, m, n, 0, 0) != 0:
            return NOMEM
        for i in range(n):
            w.seq_of[i] = 0
            w.pos_of[i] = s.position + i
        if rows != NULL:
            for i in range(n):
                w.out_rows[i] = i
            rc = forward(m, w, tokens + start, n, kv, w.out_rows, n, rows + start * vocab, cancel)
        elif start + n == T:
            w.out_rows[0] = n - 1
            rc = forward(m, w, tokens + start, n, kv, w.out_rows, 1, s.logits, cancel)
        else:
            rc = forward(m, w, tokens + start, n, kv, w.out_rows, 0, NULL, cancel)
        if rc != OK:
            return rc
        s.position += n
        start += n
    if rows == NULL and T > 0:
        s.have_logits = True
    return OK


cdef size_t kv_cache_bytes(const ModelC *m, size_t capacity) noexcept:
    # values by position, keys by whole tiles of 16
    return kv_elem_bytes(m) * m.layers * (capacity + (capacity + 15) // 16 * 16) * m.kv_width


cdef object check_kv(const ModelC *m, size_t capacity, size_t sequences=1):
    kv_bytes = kv_cache_bytes(m, capacity) * sequences
    if kv_bytes > MAX_KV_BYTES:
        raise ValueError(f"KV cache exceeds the 8 GiB safety limit ({kv_bytes} bytes)")


cdef class Session(DecodeSession):
    """One generation over a dense model with its own contiguous KV cache
    ``(layers, capacity, kv_width)``."""
    cdef DenseModel model
    cdef const ModelC *m
    cdef Work w
    cdef KV kv
    cdef size_t kv_bytes         # reserved in the model's KV budget

    def __cinit__(self, *args, **kwargs):
        memset(&self.w, 0, sizeof(Work))
        memset(&self.kv, 0, sizeof(KV))
        self.kv_bytes = 0

    def __init__(self, DenseModel model, prompt, max_new_tokens, temperature=0.0, top_p=1.0,
                 top_k=0, seed=0, eos=(), *, min_p=0.0, repetition_penalty=1.0):
        self.model = model
        self.m = &model.c
        self.setup(as_tokens(prompt, model.c.vocab), 0, model.c.vocab, model.c.context,
                   max_new_tokens, temperature, top_p, top_k, seed, eos, min_p, repetition_penalty)
        check_kv(self.m, self.s.capacity)
        nbytes = kv_cache_bytes(self.m, self.s.capacity)
        model.reserve_kv(nbytes, "this session")
        self.kv_bytes = nbytes

    def __dealloc__(self):
        if self.kv_bytes and self.model is not None:
            self.model.release_kv(self.kv_bytes)
        kv_free(&self.kv)
        work_free(&self.w)

    cdef int alloc(self) noexcept nogil:
        return kv_alloc(&self.kv, self.m, self.s.capacity)

    cdef int run(self, const int64_t *tokens, size_t T, float *rows) noexcept nogil:
        # rejected drafts need no undo: rows past the position are rewritten
        # before any query reads them, so the position roll-back in step() is all
        return seq_run(self.m, &self.w, &self.s, &self.kv, tokens, T, rows, &self.cancelled)


# ----------------------------------------------------------- paged KV ---

from cism.paging import BlockPool, OutOfBlocks

DEF PAGED_DEFAULT_BLOCKS = 256
DEF PAGED_MAX_BLOCKS = 1 << 20


class PagedState:
    """The block pool one model shares among its paged sessions. The lock is
    held (``with state:``) for every pool operation and for each whole paged
    forward, so page pointers never move under a running forward.

    A session deleted while the lock is busy (the garbage collector can run
    inside any allocation, including one made under the lock by this very
    thread) does not wait for it: its request goes on ``orphans`` and whoever
    takes the lock next frees it."""

    def __init__(self, pool, max_blocks):
        self.lock = threading.Lock()
        self.pool = pool
        self.max_blocks = max_blocks
        self.req_ctr = 0
        self.orphans = []

    def __enter__(self):
        self.lock.acquire()
        try:
            self.collect()
        except BaseException:
            self.lock.release()
            raise
        return self

    def __exit__(self, *exc):
        self.lock.release()

    def collect(self):
        """Free the requests of deleted sessions (with the lock held)."""
        while self.orphans:
            req = self.orphans.pop()
            if self.pool.contains(req):
                self.pool.free(req)

    def free_or_orphan(self, req):
        """Free a deleted session's request now if the lock is free, else later."""
        if self.lock.acquire(False):
            try:
                self.collect()
                if self.pool.contains(req):
                    self.pool.free(req)
            finally:
                self.lock.release()
        else:
            self.orphans.append(req)


def paged_cap(layers, kv_width, wanted, esize=4):
    """Clamp a pool size to [1, 2^20] blocks and to the 8 GiB KV limit."""
    cap = min(max(wanted, 1), PAGED_MAX_BLOCKS)
    per_block = layers * 16 * kv_width * esize * 2
    return max(1, min(cap, MAX_KV_BYTES // per_block))


def paged_env_blocks():
    """CISM_PAGED_MAX_BLOCKS read as the spec reads it (std::stoll: "12abc" is
    12), else the default 256: when unset, without digits, beyond long long
    or not positive, as the spec ignores such values without a message."""
    import os
    from cism._config import stoll
    try:
        value = stoll(os.environ.get("CISM_PAGED_MAX_BLOCKS", ""))
    except ValueError:
        return PAGED_DEFAULT_BLOCKS
    return value if value > 0 else PAGED_DEFAULT_BLOCKS


cdef class PagedSession(DecodeSession):
    """A generation whose keys and values live in the model's shared block
    pool. Logits are bit-identical to a dense Session on the same tokens;
    under pool pressure other sessions may evict this one, and it then
    recomputes its cache from its tokens on the next call. Its decoding
    loop (sampling, speculation, cancellation) is DecodeSession's; only
    its forward differs: blocks first, under the pool's lock."""
    cdef DenseModel model
    cdef const ModelC *m
    cdef Work w
    cdef KV kv
    cdef object state
    cdef readonly long long req_id
    cdef int priority_
    cdef size_t recomputes_
    cdef size_t *blocks
    cdef size_t blocks_cap
    cdef bint released           # set under the pool lock by release()

    def __cinit__(self, *args, **kwargs):
        memset(&self.w, 0, sizeof(Work))
        memset(&self.kv, 0, sizeof(KV))
        self.blocks = NULL
        self.req_id = -1

    def __init__(self, DenseModel model, prompt, max_new_tokens, temperature=0.0, top_p=1.0,
                 top_k=0, seed=0, eos=(), priority=0, _fork=None, *, min_p=0.0,
                 repetition_penalty=1.0):
        if _fork is None:
            p = as_tokens(prompt, model.c.vocab)
            prefix = np.zeros(0, np.int64)
        else:
            prefix, p = _fork["prefix"], _fork["suffix"]
        if not is_int(priority) or not -2**31 <= priority < 2**31:
            raise ValueError(f"priority must be a 32-bit integer, got {priority!r}")
        model.check_mapped()    # (the pool reserved its KV once, before this session)
        self.model = model
        self.m = &model.c
        self.setup(p, len(prefix), model.c.vocab, model.c.context, max_new_tokens, temperature,
                   top_p, top_k, seed, eos, min_p, repetition_penalty)
        check_kv(self.m, self.s.capacity)
        self.priority_ = priority
        self.blocks_cap = self.s.capacity // 16 + 2
        self.blocks = <size_t*>malloc(self.blocks_cap * sizeof(size_t))
        if self.blocks == NULL:
            raise MemoryError("cannot allocate session state")
        self.state = model._paged_state()
        with self.state:
            pool = self.state.pool
            if _fork is None:
                self.state.req_ctr += 1
                self.req_id = self.state.req_ctr
                pool.allocate(self.req_id, 0)
            else:
                if not pool.contains(_fork["src_req"]):
                    raise RuntimeError("fork source was evicted; retry the fork")
                self.state.req_ctr += 1
                self.req_id = self.state.req_ctr
                pool.fork(self.req_id, _fork["src_req"], len(prefix))
            pool.set_priority(self.req_id, self.priority_)
        if _fork is not None:
            # the shared prefix is cached already: it is history at its positions
            memcpy(self.s.history, cnp.PyArray_DATA(prefix), len(prefix) * sizeof(int64_t))
            self.s.hist_len = len(prefix)
            self.s.position = len(prefix)
            if len(p) == 0:
                # nothing to prefill: the first sample reads the source's last logits
                memcpy(self.s.logits, cnp.PyArray_DATA(_fork["seed_logits"]),
                       model.c.vocab * sizeof(float))
                self.s.have_logits = True

    def __dealloc__(self):
        free(self.blocks)
        work_free(&self.w)

    def __del__(self):
        # never blocks: the collector may run this inside a pool operation
        if self.state is not None and self.req_id >= 0:
            self.released = True
            self.state.free_or_orphan(self.req_id)

    def release(self):
        """Give this session's blocks back to the pool (also done on deletion).
        The session is finished: a run in progress in another thread stops at
        its next cancellation point and ends "cancelled"."""
        if self.state is None or self.req_id < 0:
            return
        cism_flag_set(&self.cancelled, 1)
        with self.state:
            # under the pool lock, so no forward can allocate blocks again after this
            self.released = True
            if self.state.pool.contains(self.req_id):
                self.state.pool.free(self.req_id)
        if self.s.finish == RUNNING:
            self.s.finish = CANCEL

    # ---- the DecodeSession hook: a forward through the pool ----

    cdef int run(self, const int64_t *tokens, size_t T, float *rows) noexcept nogil:
        cdef int rc
        with gil:
            try:
                rc = self.paged_run(tokens, T, rows)
            except BaseException as e:   # OutOfBlocks, MemoryError: raised by the caller
                self.pending_error = e
                rc = ERROR
        return rc

    cdef int paged_run(self, const int64_t *tokens, size_t T, float *rows) except? -9:
        """Blocks for T more tokens (evicting others if needed; an evicted
        session first recomputes its history), then the forward, with the
        pool lock held, so page arrays never move under it."""
        cdef size_t i, base, covered, redo = 0
        cdef int rc = OK
        cdef cnp.ndarray kp, vp
        state = self.state
        with state:
            if self.released:
                return CANCELLED
            pool = state.pool
            fresh = not pool.contains(self.req_id)
            if fresh:
                redo = self.s.position   # evicted (or the pool was reset): recompute
            while True:
                try:
                    if fresh:
                        pool.allocate(self.req_id, redo + T)
                    else:
                        # privatize shared blocks this call writes into
                        base = self.s.position
                        covered = len(pool.get_blocks(self.req_id)) * 16
                        for i in range(T):
                            if base + i < covered:
                                pool.copy_on_write(self.req_id, base + i)
                        pool.ensure(self.req_id, self.s.position + T)
                    break
                except OutOfBlocks:
                    if pool.evict_one(self.req_id) == -1:
                        raise
            pool.set_priority(self.req_id, self.priority_)
            if redo:
                self.s.position = 0
                self.recomputes_ += 1
            blocks = pool.get_blocks(self.req_id)
            for i in range(len(blocks)):
                self.blocks[i] = blocks[i]
            kp = pool.k_pages
            vp = pool.v_pages
            kv_paged(&self.kv, <char*>cnp.PyArray_DATA(kp), <char*>cnp.PyArray_DATA(vp), self.blocks,
                     pool.num_blocks, self.m.layers, self.m.kv_heads, self.m.head_dim, kv_elem_bytes(self.m))
            with nogil:
                if redo:
                    # (the last logits it leaves are the live ones again, bit for bit)
                    rc = seq_run(self.m, &self.w, &self.s, &self.kv, self.s.history, redo, NULL,
                                 &self.cancelled)
                if rc == OK:
                    rc = seq_run(self.m, &self.w, &self.s, &self.kv, tokens, T, rows, &self.cancelled)
        return rc

    def prefill_fork_source(self):
        """Run the prompt without generating, so an empty-suffix fork can seed
        its first token from this session's logits. A second call does nothing."""
        cdef int rc
        with self.lock:
            with nogil:
                rc = self.run_prompt()
            self.finish_call(rc)
            return rc == OK

    def set_priority(self, priority):
        """Eviction priority (default 0; higher survives longer)."""
        if not is_int(priority) or not -2**31 <= priority < 2**31:
            raise ValueError(f"priority must be a 32-bit integer, got {priority!r}")
        with self.lock:
            self.priority_ = priority
            with self.state:
                if self.state.pool.contains(self.req_id):
                    self.state.pool.set_priority(self.req_id, priority)

    @property
    def priority(self):
        return self.priority_

    @property
    def recomputes(self):
        """How many times this session rebuilt its cache after an eviction."""
        return self.recomputes_

    def _source_view(self):
        """(history, logits or None) read under this session's lock (forks)."""
        with self.lock:
            hist = np.array([self.s.history[i] for i in range(self.s.hist_len)], np.int64)
            logits = logits_copy(self.s.logits, self.m.vocab) if self.s.have_logits else None
            return hist, logits


# ----------------------------------------------------------- batches ---

cdef class BatchSession:
    """Up to 256 sequences decoded together: the serving engine's step
    (cism._engine) over a pool of its own, sized for the batch, so every
    projection runs once over the tokens of all active sequences while
    attention and sampling stay per sequence. Each sequence produces exactly
    what it would alone in a Session with the same seed (bitwise, logits
    included)."""
    cdef DenseModel model
    cdef object core
    cdef list seqs
    cdef list handles
    cdef size_t B
    cdef object lock
    cdef size_t kv_bytes       # reserved in the model's KV budget

    def __cinit__(self):
        self.kv_bytes = 0

    def __init__(self, DenseModel model, prompts, max_new_tokens, temperature=0.0, top_p=1.0,
                 top_k=0, seed=0, eos=(), seq_seeds=None, *, min_p=0.0, repetition_penalty=1.0):
        from cism._engine import EngineCore, Collector
        cdef Params p
        self.model = model
        vocab = model.c.vocab
        if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__len__"):
            raise ValueError("prompts must be a list of token-id sequences")
        if len(prompts) == 0:
            raise ValueError("prompts must contain at least one sequence")
        if len(prompts) > 256:
            raise ValueError(f"batch size exceeds 256 sequences (got {len(prompts)})")
        max_new = check_count(max_new_tokens, "max_new_tokens")
        memset(&p, 0, sizeof(Params))
        try:
            parse_params(&p, vocab, temperature, top_p, top_k, eos, min_p, repetition_penalty)
        finally:
            free(p.eos)
        seed = check_seed(seed)
        if seq_seeds is not None:
            seq_seeds = [check_seed(x) for x in seq_seeds]
            if len(seq_seeds) != len(prompts):
                raise ValueError("seq_seeds length must match prompts")
        arrays = []
        for i, pr in enumerate(prompts):
            try:
                arrays.append(as_tokens(pr, vocab, f"prompt {i}"))
            except ValueError as e:
                if "at least one token" in str(e):
                    raise ValueError(f"each prompt must contain at least one token (prompt {i} is empty)") from None
                raise
        for i, a in enumerate(arrays):
            if len(a) + max_new > model.c.context:
                raise ValueError(f"prompt + max_new_tokens exceeds max_position_embeddings "
                                 f"({len(a)} + {max_new} > {model.c.context}, prompt {i})")
        blocks = sum((len(a) + max_new + 15) // 16 for a in arrays)
        per_block = self.model.c.layers * 16 * self.model.c.kv_width * 2 * kv_elem_bytes(&model.c)
        if blocks * per_block > MAX_KV_BYTES:
            raise ValueError(f"KV cache exceeds the 8 GiB safety limit ({blocks * per_block} bytes)")
        nbytes = blocks * per_block
        model.reserve_kv(nbytes, f"this batch of {len(arrays)} sequences")
        self.kv_bytes = nbytes
        self.B = len(arrays)
        stepper = DenseStepper(model)
        pool = BlockPool(blocks, model.c.layers, model.c.kv_width, dtype=stepper.kv_dtype,
                         head_dim=model.c.head_dim)
        # the pool holds every sequence whole: no preemption, no cache
        self.core = EngineCore(stepper, pool, False, 0, self.B, PREFILL_CHUNK, 1, model.c.threads)
        self.seqs = []
        self.handles = []
        for i, a in enumerate(arrays):
            s_i = seq_seeds[i] if seq_seeds is not None else (seed + i) % 2**64
            h = Collector()
            self.handles.append(h)
            self.seqs.append(self.core.add(h, i, a, max_new, temperature, top_p, top_k, s_i, eos,
                                           min_p, repetition_penalty, 0, 0, False, 0))
            self.seqs[i].hold = 0
        self.lock = threading.Lock()

    def __dealloc__(self):
        if self.kv_bytes and self.model is not None:
            self.model.release_kv(self.kv_bytes)

    def next_tokens(self, count):
        """Up to ``count`` tokens for each sequence: a list of B lists."""
        count = check_count(count, "count")
        with self.lock:
            start = [len(h.tokens) for h in self.handles]
            for q in self.seqs:
                q.hold = min(q.generated + count, 2**63)
            core = self.core
            while core.busy:
                core.step()
            result = [h.tokens[n:] for h, n in zip(self.handles, start)]
            errors = [h.error for h in self.handles if h.error is not None]
            if errors:
                core.cancel_all()
                core.step()
                err = errors[0]
                if isinstance(err, MemoryError):
                    raise MemoryError("out of memory during batched inference; the session is cancelled") from err
                raise RuntimeError(f"{err} during batched inference; the session is cancelled") from err
            return result

    def cancel(self):
        """Cancel every sequence (safe from any thread)."""
        self.core.abort_forward()

    def _cancel_after(self, checks):
        """Testing hook: cancel at the ``checks``-th cancellation point from now on."""
        if not is_int(checks) or not 1 <= checks < 2**31:
            raise ValueError(f"checks must be an integer in [1, 2^31), got {checks!r}")
        self.core.arm_abort(checks)

    def cancel_seq(self, index):
        """Finish one sequence with "cancelled" (from the next step on)."""
        if not is_int(index) or not 0 <= index < self.B:
            raise ValueError(f"batch index is out of range: {index!r} (batch size {self.B})")
        if not self.handles[index].finish_reason:
            self.seqs[index].cancel()   # it leaves at the next step

    def finish_reasons(self):
        aborted = self.core.aborted
        return [h.finish_reason or ("cancelled" if aborted or q.cancelled else "")
                for h, q in zip(self.handles, self.seqs)]

    def generated_tokens_list(self):
        return [q.generated for q in self.seqs]

    @property
    def batch_size(self):
        return self.B

    def last_logits(self, index):
        """Logits of sequence ``index``'s latest forward, or None."""
        if not is_int(index) or not 0 <= index < self.B:
            raise ValueError(f"batch index is out of range: {index!r} (batch size {self.B})")
        return self.seqs[index].last_logits


# ------------------------------------------------------------ the engine ---

from cism._step cimport Stepper, StepBatch, StepRun


cdef class DenseStepper(Stepper):
    """The dense forward over a ragged batch (cism.Engine): every sequence's
    keys and values in the engine's pool pages, through its block table."""
    cdef const ModelC *m
    cdef Work w

    def __cinit__(self, *args, **kwargs):
        memset(&self.w, 0, sizeof(Work))

    def __init__(self, DenseModel model):
        Stepper.__init__(self, model)
        self.m = &model.c
        self.vocab = model.c.vocab
        self.state_floats = 0
        self.kv_layers = model.c.layers
        self.kv_width = model.c.kv_width
        self.head_dim = model.c.head_dim
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
            kv_paged(&self.kvs[r], self.k_pages, self.v_pages, run.blocks, self.n_pages, self.m.layers,
                     self.m.kv_heads, self.m.head_dim, kv_elem_bytes(self.m))
            for i in range(run.n):
                self.w.seq_of[run.first + i] = <int>r
                self.w.pos_of[run.first + i] = run.pos + i
            for i in range(run.n_out):
                self.w.out_rows[run.out_row + i] = run.first + run.n - run.n_out + i
        self.w.prompt = b.prompt and self.m.prefill_bf16
        return forward(self.m, &self.w, b.tokens, b.T, self.kvs, self.w.out_rows, n_out,
                       b.logits, b.cancel)
