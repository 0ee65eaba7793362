# The decoding session every model family builds on (cimport cism._session).
#
# A family subclasses DecodeSession, sets its `stepper` (the family's forward
# over a ragged step, cism._step) and provides the hooks: alloc (state or KV
# storage for its run `one`, once, at the first forward), run (forward tokens
# at the position: by default the stepper over `one`, in chunks), and for
# speculative verification block_begin/rewind (the
# family's way of returning to "after the first j drafts" once a block was
# verified: a position roll-back for attention caches, a checkpoint for
# recurrent state). Everything else — sampling, eos/budget accounting,
# speculative decoding, cancellation, the Python API — lives here once.
from libc.stdint cimport int64_t, uint64_t
from cism.sampling cimport cism_mt64, cism_sampler
from cism._checks cimport Params
from cism._step cimport Stepper, StepRun

cdef enum:
    MAX_K = 16           # most draft tokens one verification block takes
    PREFILL_CHUNK = 256  # prompts run in chunks of this many tokens (bitwise equal to one block)

# One sequence's generation state, whatever the family.
cdef struct SeqCore:
    int64_t *prompt            # tokens not yet run (prefilled on first use)
    size_t prompt_len
    int64_t *history           # tokens the model has consumed, in order
    size_t hist_len
    size_t capacity, position, generated, max_new
    size_t prompt_end          # positions below it hold prompt tokens (prefix included)
    float *logits              # (vocab,) distribution for the next token
    bint have_logits
    cism_mt64 rng
    cism_sampler sampler
    int finish

cdef int core_alloc(SeqCore *s, const int64_t *prompt, size_t prompt_len, size_t prefix_len,
                    size_t max_new, size_t vocab, uint64_t seed) noexcept nogil
cdef void core_free(SeqCore *s) noexcept nogil
cdef void core_account(SeqCore *s, const Params *p, int64_t token) noexcept nogil
# The next token from a logits row: the spec's sampler with the sequence's
# knobs, history, generator and scratch (-1 without memory).
cdef int64_t core_choose(SeqCore *s, const Params *p, const float *row, size_t vocab) noexcept nogil

# Forward T tokens of one sequence (its run `one`: cache or blocks, state)
# at s.position through the family's ragged step, in chunks; see _session.pyx.
cdef int run_chunks(Stepper st, StepRun *one, SeqCore *s, const int64_t *tokens, size_t T,
                    float *rows, float *last, float *snaps, int *cancel) noexcept nogil


# One sequence's state, its sampling settings, the cancel flag and the lock
# serialising calls, with the common properties (finish_reason, history...).
cdef class SessionState:
    cdef SeqCore s
    cdef Params p
    cdef size_t vocab
    cdef int cancelled
    cdef object lock
    cdef object pending_error     # raised by finish_call(ERROR): a hook's exception

    cdef object setup(self, prompt_tokens, size_t prefix_len, size_t vocab, size_t context,
                      max_new_tokens, temperature, top_p, top_k, seed, eos, min_p,
                      repetition_penalty)
    cdef object finish_call(self, int rc)


# The generic decoding loop over the family hooks.
cdef class DecodeSession(SessionState):
    cdef Stepper stepper         # the family's forward (cism._step), driven with one run
    cdef StepRun one             # this sequence's run: its cache or blocks, its recurrent state
    cdef float *snaps            # NULL, or where run() copies the state after each token

    cdef float *block_logits     # (ncand, vocab) during verification
    cdef size_t block_cap
    cdef size_t block_pos        # position before the verification block
    cdef size_t spec_proposed, spec_accepted
    cdef int64_t emitted[MAX_K + 1]
    cdef int64_t cands[MAX_K]

    # ---- hooks (nogil; return OK, CANCELLED, NOMEM or NONFINITE) ----
    cdef int alloc(self) noexcept nogil
    # Forward T tokens at s.position and advance it. rows == NULL: the last
    # token's logits go to s.logits; else every token's go to rows (T, vocab).
    # By default the stepper's forward over `one` (run_one).
    cdef int run(self, const int64_t *tokens, size_t T, float *rows) noexcept nogil
    cdef int block_begin(self, size_t ncand) noexcept nogil
    # After a verified block of ncand drafts (run from block_pos), leave the
    # model exactly as plain decoding after the first j of them (j <= ncand).
    cdef int rewind(self, size_t ncand, size_t j) noexcept nogil
    # Drafts when prompt lookup finds none (Surjo's neural drafter).
    cdef int fallback_draft(self, size_t k, size_t *ncand) noexcept nogil

    # ---- the shared decoding loop ----
    cdef int run_one(self, const int64_t *tokens, size_t T, float *rows) noexcept nogil
    cdef int run_prompt(self) noexcept nogil
    cdef int verify_block(self, size_t ncand, size_t *n_emitted, bint *blocked) noexcept nogil
    cdef int step(self, size_t ncand, int64_t *out, size_t *produced) noexcept nogil
    cdef int generate(self, size_t wanted, size_t spec_k, int64_t *out, size_t *produced) noexcept nogil


# The solo session of a family whose memory is one recurrent state per
# sequence (stepper.state_floats floats; none for a stateless family):
# FWKV's, a Python toy family's (cism._step.PyStepper).
cdef class StateSession(DecodeSession):
    cdef readonly object model
    cdef float *state_           # (state_floats,)
    cdef float *block_states     # (ncand + 1, state_floats): [0] before a verification
                                 # block, [t + 1] after candidate t (run() fills them: snaps)
    cdef size_t block_cap_states
