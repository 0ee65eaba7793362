"""Surjo's solo session: XSA KV slots, GDN states and conv FIFOs of its
own, a checkpoint of the recurrent state for verification (replayed after
a partial reject), and the neural drafter (the model with some plan steps
left out, greedy on its own guesses)."""
import numpy as np

from libc.stdint cimport int64_t, uint8_t
from libc.stdlib cimport calloc, free, malloc
from libc.string cimport memcpy, memset

from cism._session cimport DecodeSession, MAX_K, run_chunks
from cism._surjo cimport ModelC, State, SurjoModel, SurjoStepper, check_capacity, state_alloc, state_free
from cism.sampling cimport argmax
from cism._status cimport OK, NOMEM, RUNNING
from cism._checks cimport as_tokens, check_count, params_eos

from cism._config import is_int


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
        p = as_tokens(prompt, model.c.base.vocab)
        check_capacity(self.m, len(p), check_count(max_new_tokens, "max_new_tokens"))
        self.setup(p, 0, model.c.base.vocab, model.c.base.context, max_new_tokens, temperature, top_p,
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
            self.draft_logits = <float*>malloc(self.m.base.vocab * sizeof(float))
            if self.draft_logits == NULL:
                return NOMEM
        self.cands[0] = <int64_t>argmax(self.s.logits, self.m.base.vocab)
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
            self.cands[n] = <int64_t>argmax(self.draft_logits, self.m.base.vocab)
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
        """Up to k draft tokens from the neural drafter (the steps of
        set_draft_steps left out; none when it was never armed), leaving the
        session's state exactly as it was. Drafts are greedy; fewer than 2
        tokens are never drafted (the spec returns none for k < 2). k is at
        most 16, the most candidates verify takes (the spec has no cap)."""
        k = check_count(k, "k")
        if k > MAX_K:
            raise ValueError(f"k must be at most {MAX_K} (the most candidates verify takes), got {k}")
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
