"""Sessions whose keys and values live in a model's shared block pool
(cism.paging.BlockPool), for any family with paged attention: the pool's
state (PagedState: its lock, its cap, orphaned requests) and PagedSession,
a DecodeSession whose forward takes its blocks under the pool lock and then
runs the family's ragged step (cism._step) over them."""
import threading

import numpy as np

cimport numpy as cnp
from libc.stdint cimport int64_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy

from cism._status cimport OK, CANCELLED, ERROR, RUNNING, CANCEL, cism_flag_set
from cism._checks cimport as_tokens, check_count, logits_copy
from cism._kvcache cimport kv_block_bytes, kv_cache_bytes
from cism._session cimport DecodeSession
from cism._step cimport Stepper

from cism._config import MAX_KV_BYTES, is_int
from cism.paging import OutOfBlocks

cnp.import_array()

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
    per_block = kv_block_bytes(esize, layers, kv_width)
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
    its forward differs: blocks first, under the pool's lock, then the
    family's ragged step (cism._step) over them."""
    cdef object model
    cdef object state
    cdef readonly long long req_id
    cdef int priority_
    cdef size_t recomputes_
    cdef size_t *blocks
    cdef size_t blocks_cap
    cdef bint released           # set under the pool lock by release()

    def __cinit__(self, *args, **kwargs):
        self.blocks = NULL
        self.req_id = -1

    def __init__(self, model, prompt, max_new_tokens, temperature=0.0, top_p=1.0,
                 top_k=0, seed=0, eos=(), priority=0, _fork=None, *, min_p=0.0,
                 repetition_penalty=1.0):
        cdef Stepper st = model._engine_stepper()
        vocab = st.vocab
        if _fork is None:
            p = as_tokens(prompt, vocab)
            prefix = np.zeros(0, np.int64)
        else:
            prefix, p = _fork["prefix"], _fork["suffix"]
        if not is_int(priority) or not -2**31 <= priority < 2**31:
            raise ValueError(f"priority must be a 32-bit integer, got {priority!r}")
        model.check_mapped_files()   # (the pool reserved its KV once, before this session)
        self.model = model
        self.stepper = st
        self.setup(p, len(prefix), vocab, model.config.context, max_new_tokens, temperature,
                   top_p, top_k, seed, eos, min_p, repetition_penalty)
        kv_bytes = kv_cache_bytes(st.kv_dtype.itemsize, st.kv_layers, self.s.capacity, st.kv_width)
        if kv_bytes > MAX_KV_BYTES:
            raise ValueError(f"KV cache exceeds the 8 GiB safety limit ({kv_bytes} bytes)")
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
                memcpy(self.s.logits, cnp.PyArray_DATA(_fork["seed_logits"]), vocab * sizeof(float))
                self.s.have_logits = True

    def __dealloc__(self):
        free(self.blocks)

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
            self.stepper.set_pages(pool)
            self.one.blocks = self.blocks
            with nogil:
                if redo:
                    # (the last logits it leaves are the live ones again, bit for bit)
                    rc = self.run_one(self.s.history, redo, NULL)
                if rc == OK:
                    rc = self.run_one(tokens, T, rows)
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
            logits = logits_copy(self.s.logits, self.vocab) if self.s.have_logits else None
            return hist, logits


def fork_session(model, prompt, max_new_tokens, temperature, top_p, top_k, seed, eos, src, prefix_len,
                 priority, min_p, repetition_penalty):
    """A paged session whose first prefix_len tokens share src's cached
    blocks (copy on write); its prompt must start with exactly those tokens
    of src's history (Model.create_paged_fork_session)."""
    vocab = model.config.vocab
    if src is None:
        raise ValueError("fork source session is null")
    if not isinstance(src, PagedSession):
        raise ValueError("fork source must be a PagedSession")
    if (<PagedSession>src).model is not model:
        raise ValueError("fork source belongs to a different model")
    prefix_len = check_count(prefix_len, "prefix_len")
    p = as_tokens(prompt, vocab, "prompt", True)
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
    return PagedSession(model, None, max_new_tokens, temperature, top_p, top_k, seed, eos,
                        priority, _fork=fork, min_p=min_p, repetition_penalty=repetition_penalty)
