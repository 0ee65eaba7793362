"""The decoding session every model family builds on: sampling (the spec's
sampler and the optional knobs), eos and budget accounting, prompt-lookup
speculative decoding with exact greedy verification, cancellation, and the
Python session API. Families provide the forward pass and, for speculation,
how to return to a point inside a verified block (see _session.pxd)."""
import threading

import numpy as np

cimport numpy as cnp
from libc.math cimport exp, log
from libc.stdint cimport int64_t, uint64_t
from libc.stdlib cimport calloc, free, malloc, realloc
from libc.string cimport memcpy, memset

from cism._status cimport (OK, CANCELLED, NOMEM, NONFINITE, ERROR, RUNNING, STOP, LENGTH, CANCEL,
                           raise_for, cism_flag_get, cism_flag_set, cism_flag_check, arm_cancel)
from cism._checks cimport (Params, as_tokens, check_count, check_spec_k, parse_params, logits_copy,
                           params_eos, knobs_of)
from cism._layers cimport grow_f
from cism._step cimport Stepper, StepBatch, StepRun
from cism.sampling cimport cism_knobs, rng_seed, argmax, choose_token, sampler_free, draft_tokens

from cism._status import FINISH_NAMES
from cism.sampling import check_seed

cnp.import_array()


cdef int core_alloc(SeqCore *s, const int64_t *prompt, size_t prompt_len, size_t prefix_len,
                    size_t max_new, size_t vocab, uint64_t seed) noexcept nogil:
    memset(s, 0, sizeof(SeqCore))
    s.capacity = prefix_len + prompt_len + max_new
    s.prompt_end = prefix_len + prompt_len
    s.max_new = max_new
    s.prompt = <int64_t*>malloc((prompt_len + 1) * sizeof(int64_t))
    s.history = <int64_t*>malloc((s.capacity + 1) * sizeof(int64_t))
    s.logits = <float*>malloc(vocab * sizeof(float))
    if s.prompt == NULL or s.history == NULL or s.logits == NULL:
        return NOMEM
    memcpy(s.prompt, prompt, prompt_len * sizeof(int64_t))
    s.prompt_len = prompt_len
    rng_seed(&s.rng, seed)
    s.finish = LENGTH if max_new == 0 else RUNNING
    return OK


cdef void core_free(SeqCore *s) noexcept nogil:
    free(s.prompt)
    free(s.history)
    free(s.logits)
    sampler_free(&s.sampler)
    s.prompt = NULL
    s.history = NULL
    s.logits = NULL


cdef void core_account(SeqCore *s, const Params *p, int64_t token) noexcept nogil:
    """Count an emitted token: eos -> stop, budget reached -> length."""
    s.generated += 1
    if params_eos(p, token):
        s.finish = STOP
    elif s.generated == s.max_new:
        s.finish = LENGTH


cdef int64_t core_choose(SeqCore *s, const Params *p, const float *row, size_t vocab) noexcept nogil:
    """Choose the next token from row (every loop's sampling: a session's
    step, the engine's jobs)."""
    cdef cism_knobs kn = knobs_of(p)
    return choose_token(row, vocab, &kn, s.history, s.hist_len, &s.rng, &s.sampler)


cdef int run_chunks(Stepper st, StepRun *one, SeqCore *s, const int64_t *tokens, size_t T,
                    float *rows, float *last, float *snaps, int *cancel) noexcept nogil:
    """Forward T tokens of one sequence at s.position through the family's
    ragged step, one run (`one`: its cache or blocks, its state), in chunks
    of at most PREFILL_CHUNK tokens, none straddling the end of the prompt:
    the tokens below it are the step's prompt tokens (bf16 prefill runs
    them at its precision), whichever call runs them (prefill, nll, a
    recompute after eviction). rows == NULL: the last token's logits go to
    last; else every token's to rows (T, vocab), the last's also to last
    (when not NULL). snaps: the whole state after token t is copied to
    snaps + (t + 1) * state_floats (verification blocks of recurrent
    families). Chunking never changes a bit: a token's arithmetic does not
    depend on what else is in the step."""
    cdef size_t start = 0, n, i, vocab = st.vocab
    cdef float *snapp[PREFILL_CHUNK]
    cdef StepBatch b
    cdef int rc
    b.runs = one
    b.n_runs = 1
    b.cancel = cancel
    one.first = 0
    one.out_row = 0
    while start < T:
        n = T - start
        if n > PREFILL_CHUNK:
            n = PREFILL_CHUNK
        b.prompt = s.position < s.prompt_end
        if b.prompt and s.position + n > s.prompt_end:
            n = s.prompt_end - s.position
        b.tokens = tokens + start
        b.T = n
        one.n = n
        one.pos = s.position
        b.snap = NULL
        if snaps != NULL:
            for i in range(n):
                snapp[i] = snaps + (start + i + 1) * st.state_floats
            b.snap = snapp
        if rows != NULL:
            one.n_out = n
            b.logits = rows + start * vocab
        elif start + n == T and last != NULL:
            one.n_out = 1
            b.logits = last
        else:
            one.n_out = 0
            b.logits = NULL
        rc = st.forward(&b)
        if rc != OK:
            return rc
        s.position += n
        start += n
    if rows != NULL and last != NULL and T > 0:
        memcpy(last, rows + (T - 1) * vocab, vocab * sizeof(float))
    return OK


cdef class SessionState:
    """One sequence's state and settings, with the properties every session
    kind shares. Calls on one session run one at a time (from any thread);
    ``cancel()`` is safe at any moment."""

    def __cinit__(self, *args, **kwargs):
        memset(&self.s, 0, sizeof(SeqCore))
        memset(&self.p, 0, sizeof(Params))

    def __dealloc__(self):
        core_free(&self.s)
        free(self.p.eos)

    cdef object setup(self, prompt_tokens, size_t prefix_len, size_t vocab, size_t context,
                      max_new_tokens, temperature, top_p, top_k, seed, eos, min_p,
                      repetition_penalty):
        """Validate the common arguments and allocate the sequence:
        prompt_tokens run first, prefix_len tokens before them are cached."""
        max_new = check_count(max_new_tokens, "max_new_tokens")
        parse_params(&self.p, vocab, temperature, top_p, top_k, eos, min_p, repetition_penalty)
        seed = check_seed(seed)
        if prefix_len + len(prompt_tokens) + max_new > context:
            raise ValueError(f"prompt + max_new_tokens exceeds max_position_embeddings "
                             f"({prefix_len + len(prompt_tokens)} + {max_new} > {context})")
        self.vocab = vocab
        if core_alloc(&self.s, <const int64_t*>cnp.PyArray_DATA(prompt_tokens), len(prompt_tokens),
                      prefix_len, max_new, vocab, seed) != OK:
            raise MemoryError("cannot allocate session state")
        self.lock = threading.Lock()

    cdef object finish_call(self, int rc):
        """Turn a return code into session state (and an exception on failure:
        a failed forward leaves half-written state, so the session is done)."""
        if rc == OK:
            return
        if self.s.finish == RUNNING:
            self.s.finish = CANCEL
        cism_flag_set(&self.cancelled, 1)
        if rc == ERROR and self.pending_error is not None:
            err, self.pending_error = self.pending_error, None
            raise err
        if rc == ERROR:
            raise RuntimeError("the forward failed; the session is cancelled")
        raise_for(rc)

    def cancel(self):
        """Stop the session from any thread; it finishes with "cancelled"."""
        cism_flag_set(&self.cancelled, 1)

    def _cancel_after(self, checks):
        """Testing hook: cancel at the ``checks``-th cancellation point from now on."""
        arm_cancel(&self.cancelled, checks)

    @property
    def finish_reason(self):
        """"" while running, then "stop", "length" or "cancelled"."""
        if self.s.finish == RUNNING and cism_flag_get(&self.cancelled):
            return "cancelled"
        return FINISH_NAMES[self.s.finish]

    @property
    def generated_tokens(self):
        return self.s.generated

    @property
    def position(self):
        return self.s.position

    @property
    def capacity(self):
        return self.s.capacity

    @property
    def history(self):
        """Tokens the model has consumed (prompt, then generated)."""
        return [self.s.history[i] for i in range(self.s.hist_len)]

    @property
    def last_logits(self):
        """Logits of the latest forward (the next token's distribution), or
        None before the prompt has run."""
        if not self.s.have_logits:
            return None
        return logits_copy(self.s.logits, self.vocab)


cdef class DecodeSession(SessionState):
    """A generation: ``next_tokens`` (with optional speculation), ``verify``,
    ``draft``, ``prefill`` and the state properties, over a family's hooks."""

    def __cinit__(self, *args, **kwargs):
        self.block_logits = NULL
        self.snaps = NULL
        memset(&self.one, 0, sizeof(StepRun))

    def __dealloc__(self):
        free(self.block_logits)

    # ---- hooks: families override ----

    cdef int alloc(self) noexcept nogil:
        return OK

    cdef int run(self, const int64_t *tokens, size_t T, float *rows) noexcept nogil:
        return self.run_one(tokens, T, rows)

    cdef int block_begin(self, size_t ncand) noexcept nogil:
        return OK

    cdef int rewind(self, size_t ncand, size_t j) noexcept nogil:
        return OK

    cdef int fallback_draft(self, size_t k, size_t *ncand) noexcept nogil:
        ncand[0] = 0
        return OK

    # ---- the shared decoding loop ----

    cdef int run_one(self, const int64_t *tokens, size_t T, float *rows) noexcept nogil:
        """The stepper's forward of T tokens over this sequence's run."""
        cdef int rc = run_chunks(self.stepper, &self.one, &self.s, tokens, T, rows,
                                 self.s.logits if rows == NULL else NULL, self.snaps, &self.cancelled)
        if rc == OK and rows == NULL and T > 0:
            self.s.have_logits = True
        return rc

    cdef int run_prompt(self) noexcept nogil:
        cdef int rc
        if self.s.prompt_len == 0:
            return OK
        if cism_flag_check(&self.cancelled):
            return CANCELLED
        # storage is allocated only once the caller holds a cancellable session
        rc = self.alloc()
        if rc != OK:
            return rc
        rc = self.run(self.s.prompt, self.s.prompt_len, NULL)
        if rc != OK:
            return rc
        self.s.have_logits = True
        memcpy(self.s.history + self.s.hist_len, self.s.prompt, self.s.prompt_len * sizeof(int64_t))
        self.s.hist_len += self.s.prompt_len
        self.s.prompt_len = 0
        return OK

    cdef int verify_block(self, size_t ncand, size_t *n_emitted, bint *blocked) noexcept nogil:
        """Greedy verification of cands[:ncand]: emit the head token; when it
        equals the first candidate, forward the block once, accept the
        argmax-matching prefix and add the correction (or bonus) token,
        within the budget. The model is left after the whole block; step()
        rewinds it to the emitted prefix."""
        cdef size_t allowed = self.s.max_new - self.s.generated
        cdef size_t accepted = 0, n = 0, vocab = self.vocab
        cdef int rc
        n_emitted[0] = 0
        blocked[0] = False
        if allowed == 0:
            return OK
        self.spec_proposed += ncand
        self.emitted[0] = <int64_t>argmax(self.s.logits, vocab)
        n = 1
        if allowed > 1 and self.emitted[0] == self.cands[0]:
            accepted = 1
            if ncand * vocab > self.block_cap:
                self.block_cap = 0
                if grow_f(&self.block_logits, ncand * vocab):
                    return NOMEM
                self.block_cap = ncand * vocab
            self.block_pos = self.s.position
            rc = self.block_begin(ncand)
            if rc == OK:
                blocked[0] = True
                rc = self.run(self.cands, ncand, self.block_logits)
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
            self.spec_accepted += accepted
        n_emitted[0] = n
        return OK

    cdef int step(self, size_t ncand, int64_t *out, size_t *produced) noexcept nogil:
        """One decoding step: sample (or verify ncand drafts), account the
        emitted tokens, forward the last one unless the session finished.
        Afterwards the model, logits, position and history are exactly those
        of plain decoding after the same tokens."""
        cdef size_t n = 0, i, j = 0
        cdef bint blocked = False
        cdef int64_t tok
        cdef int rc = OK
        if ncand >= 1:
            rc = self.verify_block(ncand, &n, &blocked)
        else:
            tok = core_choose(&self.s, &self.p, self.s.logits, self.vocab)
            if tok < 0:
                return NOMEM
            self.emitted[0] = tok
            n = 1
        for i in range(n):
            out[produced[0]] = self.emitted[i]
            produced[0] += 1
            j = i
            core_account(&self.s, &self.p, self.emitted[i])
            if self.s.finish != RUNNING:
                break
        if rc != OK:
            return rc
        if blocked:
            # back to "after emitted[:j]" (the drafts matched them), as plain decoding
            rc = self.rewind(ncand, j)
            if rc != OK:
                return rc
            self.s.position = self.block_pos + j
            if j > 0:
                memcpy(self.s.logits, self.block_logits + (j - 1) * self.vocab, self.vocab * sizeof(float))
        memcpy(self.s.history + self.s.hist_len, self.emitted, j * sizeof(int64_t))
        self.s.hist_len += j
        # a finished session never runs its last token
        if self.s.finish != RUNNING:
            return OK
        if cism_flag_check(&self.cancelled):
            return CANCELLED
        rc = self.run(&self.emitted[j], 1, NULL)
        if rc != OK:
            return rc
        self.s.history[self.s.hist_len] = self.emitted[j]
        self.s.hist_len += 1
        return OK

    cdef int generate(self, size_t wanted, size_t spec_k, int64_t *out, size_t *produced) noexcept nogil:
        cdef size_t budget, k, ncand
        cdef int rc
        produced[0] = 0
        if self.s.finish != RUNNING or wanted == 0:
            return OK
        if cism_flag_check(&self.cancelled):
            return CANCELLED
        rc = self.run_prompt()
        if rc != OK:
            return rc
        while produced[0] < wanted:
            if cism_flag_check(&self.cancelled):
                return CANCELLED
            budget = wanted - produced[0]
            ncand = 0
            if spec_k >= 2:
                k = spec_k if spec_k < budget - 1 else budget - 1
                ncand = draft_tokens(self.s.history, self.s.hist_len, k, self.cands)
                if ncand < 2:
                    rc = self.fallback_draft(k, &ncand)
                    if rc != OK:
                        return rc
                if ncand < 2:
                    ncand = 0  # too short to pay for a verification block
            rc = self.step(ncand, out, produced)
            if rc != OK or self.s.finish != RUNNING:
                return rc
        return OK

    # ---- Python API ----

    def next_tokens(self, count, spec_k=0):
        """Up to ``count`` new tokens. ``spec_k`` 2..16 turns on prompt-lookup
        speculation (greedy only); the tokens are identical either way."""
        count = check_count(count, "count")
        cdef size_t produced = 0, wanted, k = check_spec_k(spec_k, &self.p)
        cdef int rc
        cdef int64_t *buf
        with self.lock:
            wanted = min(count, self.s.max_new - self.s.generated)
            out = np.empty(wanted + 1, np.int64)
            buf = <int64_t*>cnp.PyArray_DATA(out)
            with nogil:
                rc = self.generate(wanted, k, buf, &produced)
            result = out[:produced].tolist()
            self.finish_call(rc)
            return result

    def prefill(self):
        """Run the prompt now (next_tokens does it on first use); afterwards
        last_logits holds the first token's distribution."""
        cdef int rc
        with self.lock:
            with nogil:
                rc = self.run_prompt()
            self.finish_call(rc)

    _prefill_now = prefill

    def _nll(self):
        """Teacher-forced mean NLL of the pending prompt (model.nll), chunk by chunk."""
        cdef size_t n = self.s.prompt_len, start = 0, T, i, v, vocab = self.vocab
        cdef int rc = OK
        cdef double total = 0, lse
        cdef float mx
        cdef const float *row
        if n < 2:
            raise ValueError("nll requires at least 2 tokens")
        with self.lock:
            with nogil:
                rc = self.alloc()
                if rc == OK and PREFILL_CHUNK * vocab > self.block_cap:
                    self.block_cap = 0
                    if grow_f(&self.block_logits, PREFILL_CHUNK * vocab):
                        rc = NOMEM
                    else:
                        self.block_cap = PREFILL_CHUNK * vocab
                while rc == OK and start < n:
                    T = n - start
                    if T > PREFILL_CHUNK:
                        T = PREFILL_CHUNK
                    rc = self.run(self.s.prompt + start, T, self.block_logits)
                    if rc != OK:
                        break
                    for i in range(T):
                        if start + i + 1 >= n:
                            break
                        # log-sum-exp in double around the row maximum
                        row = self.block_logits + i * vocab
                        mx = row[0]
                        for v in range(1, vocab):
                            if row[v] > mx:
                                mx = row[v]
                        lse = 0
                        for v in range(vocab):
                            lse += exp(<double>row[v] - <double>mx)
                        total += <double>mx + log(lse) - <double>row[self.s.prompt[start + i + 1]]
                    start += T
            self.finish_call(rc)
            return total / (n - 1)

    def _all_logits(self):
        """Logits after every prefix of the pending prompt (model.logits_all)."""
        cdef size_t n = self.s.prompt_len, start = 0, T
        cdef int rc
        out = np.empty((n, self.vocab), np.float32)
        cdef float *rows = <float*>cnp.PyArray_DATA(out)
        with self.lock:
            with nogil:
                rc = self.alloc()
                while rc == OK and start < n:
                    T = n - start
                    if T > PREFILL_CHUNK:
                        T = PREFILL_CHUNK
                    rc = self.run(self.s.prompt + start, T, rows + start * self.vocab)
                    start += T
            self.finish_call(rc)
        return out

    def draft(self, k):
        """The prompt-lookup draft of up to k tokens from the history. k is
        at most 16, the most candidates verify takes (the spec has no cap)."""
        k = check_count(k, "k")
        if k > MAX_K:
            raise ValueError(f"k must be at most {MAX_K} (the most candidates verify takes), got {k}")
        cdef int64_t buf[MAX_K]
        with self.lock:
            n = draft_tokens(self.s.history, self.s.hist_len, k, buf)
            return [buf[i] for i in range(n)]

    def verify(self, candidates):
        """Verify explicit draft tokens greedily and return the tokens emitted
        (the accepted prefix plus the correction or bonus token), leaving the
        session exactly as next_tokens would."""
        if self.p.temperature != 0 or self.p.repetition_penalty != 1:
            raise ValueError("verify needs plain greedy decoding (temperature 0, no repetition_penalty)")
        c = as_tokens(candidates, self.vocab, "candidates", True)
        if len(c) > MAX_K:
            raise ValueError(f"at most {MAX_K} candidates, got {len(c)}")
        cdef size_t produced = 0, n = len(c), i
        cdef int rc = OK
        out = np.empty(MAX_K + 1, np.int64)
        cdef int64_t *buf = <int64_t*>cnp.PyArray_DATA(out)
        with self.lock:
            if n == 0 or self.s.finish != RUNNING:
                return []
            for i in range(n):
                self.cands[i] = c[i]
            with nogil:
                rc = self.run_prompt()
                if rc == OK:
                    rc = self.step(n, buf, &produced)
            result = out[:produced].tolist()
            self.finish_call(rc)
            return result

    def spec_stats(self):
        """(proposed, accepted) draft tokens over the session's life."""
        return (self.spec_proposed, self.spec_accepted)


cdef class StateSession(DecodeSession):
    """One generation of a family whose memory is a recurrent state (the
    stepper's state_floats floats, zero to start), whatever the length:
    FWKV's, or a toy family's. Its run is the stepper's; a verification
    block keeps the state after every token, so a partial reject needs no
    replay."""

    def __cinit__(self, *args, **kwargs):
        self.state_ = NULL
        self.block_states = NULL

    def __init__(self, model, prompt, max_new_tokens, temperature=0.0, top_p=1.0, top_k=0, seed=0,
                 eos=(), *, min_p=0.0, repetition_penalty=1.0):
        cdef Stepper st = model._engine_stepper()
        self.model = model
        self.stepper = st
        self.setup(as_tokens(prompt, st.vocab), 0, st.vocab, model.config.context, max_new_tokens,
                   temperature, top_p, top_k, seed, eos, min_p, repetition_penalty)
        self.state_ = <float*>calloc(st.state_floats + 1, sizeof(float))
        if self.state_ == NULL:
            raise MemoryError("cannot allocate session state")
        self.one.state = self.state_
        if st.state_floats == 0:
            self.one.state = NULL

    def __dealloc__(self):
        free(self.state_)
        free(self.block_states)

    cdef int block_begin(self, size_t ncand) noexcept nogil:
        # the recurrence overwrites the state: keep it before the block and
        # after every candidate (snaps)
        cdef size_t S = self.stepper.state_floats
        if S == 0:
            return OK
        if ncand + 1 > self.block_cap_states:
            self.block_cap_states = 0
            if grow_f(&self.block_states, (ncand + 1) * S):
                return NOMEM
            self.block_cap_states = ncand + 1
        memcpy(self.block_states, self.state_, S * sizeof(float))
        self.snaps = self.block_states
        return OK

    cdef int rewind(self, size_t ncand, size_t j) noexcept nogil:
        cdef size_t S = self.stepper.state_floats
        if S == 0:
            return OK
        self.snaps = NULL
        memcpy(self.state_, self.block_states + j * S, S * sizeof(float))
        return OK
