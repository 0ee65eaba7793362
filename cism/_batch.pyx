"""Batches of sequences decoded together (BatchSession), for any family
with paged attention: a user of the serving engine's core (cism._engine)
over a pool of its own."""
import threading

from libc.stdlib cimport free
from libc.string cimport memset

from cism._checks cimport Params, as_tokens, check_count, parse_params
from cism._kvcache cimport kv_block_bytes
from cism._session cimport PREFILL_CHUNK
from cism._step cimport Stepper

from cism._config import MAX_KV_BYTES, is_int
from cism.paging import BlockPool
from cism.sampling import check_seed


cdef class BatchSession:
    """Up to 256 sequences decoded together: the serving engine's step
    (cism._engine) over a pool of its own, sized for the batch, so every
    projection runs once over the tokens of all active sequences while
    attention and sampling stay per sequence. Each sequence produces exactly
    what it would alone in a Session with the same seed (bitwise, logits
    included)."""
    cdef object model
    cdef object core
    cdef list seqs
    cdef list handles
    cdef size_t B
    cdef object lock
    cdef size_t kv_bytes       # reserved in the model's KV budget

    def __cinit__(self):
        self.kv_bytes = 0

    def __init__(self, model, prompts, max_new_tokens, temperature=0.0, top_p=1.0,
                 top_k=0, seed=0, eos=(), seq_seeds=None, *, min_p=0.0, repetition_penalty=1.0):
        from cism._engine import EngineCore
        from cism._requests import Collector
        cdef Params p
        cdef Stepper stepper = model._engine_stepper()
        self.model = model
        vocab = stepper.vocab
        context = model.config.context
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
            if len(a) + max_new > context:
                raise ValueError(f"prompt + max_new_tokens exceeds max_position_embeddings "
                                 f"({len(a)} + {max_new} > {context}, prompt {i})")
        blocks = sum((len(a) + max_new + 15) // 16 for a in arrays)
        per_block = kv_block_bytes(stepper.kv_dtype.itemsize, stepper.kv_layers, stepper.kv_width)
        if blocks * per_block > MAX_KV_BYTES:
            raise ValueError(f"KV cache exceeds the 8 GiB safety limit ({blocks * per_block} bytes)")
        nbytes = blocks * per_block
        model._reserve_kv(nbytes, f"this batch of {len(arrays)} sequences")
        self.kv_bytes = nbytes
        self.B = len(arrays)
        pool = BlockPool(blocks, stepper.kv_layers, stepper.kv_width, dtype=stepper.kv_dtype,
                         head_dim=stepper.head_dim)
        # the pool holds every sequence whole: no preemption, no cache
        self.core = EngineCore(stepper, pool, False, 0, self.B, PREFILL_CHUNK, 1, model.thread_count)
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
            self.model._release_kv(self.kv_bytes)

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
