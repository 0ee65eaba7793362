# The decoding session every model family builds on (cimport cism._session).
#
# A family subclasses DecodeSession and provides the hooks: alloc (state or
# KV storage, once, at the first forward), run (forward tokens at the
# position), and for speculative verification block_begin/rewind (the
# family's way of returning to "after the first j drafts" once a block was
# verified: a position roll-back for attention caches, a checkpoint for
# recurrent state). Everything else — sampling, eos/budget accounting,
# speculative decoding, cancellation, the Python API — lives here once.
from libc.stdint cimport int64_t, uint64_t
from cism.sampling cimport cism_mt64, cism_sampler
from cism._common cimport Params

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
    cdef int run(self, const int64_t *tokens, size_t T, float *rows) noexcept nogil
    cdef int block_begin(self, size_t ncand) noexcept nogil
    # After a verified block of ncand drafts (run from block_pos), leave the
    # model exactly as plain decoding after the first j of them (j <= ncand).
    cdef int rewind(self, size_t ncand, size_t j) noexcept nogil
    # Drafts when prompt lookup finds none (Surjo's neural drafter).
    cdef int fallback_draft(self, size_t k, size_t *ncand) noexcept nogil

    # ---- the shared decoding loop ----
    cdef int run_prompt(self) noexcept nogil
    cdef int verify_block(self, size_t ncand, size_t *n_emitted, bint *blocked) noexcept nogil
    cdef int step(self, size_t ncand, int64_t *out, size_t *produced) noexcept nogil
    cdef int generate(self, size_t wanted, size_t spec_k, int64_t *out, size_t *produced) noexcept nogil
