# C-level token selection for the model modules (cimport cism.sampling).
from libc.stdint cimport int64_t, uint64_t

cdef extern from "sample.h" nogil:
    ctypedef struct cism_mt64:
        uint64_t mt[312]
        size_t index
    ctypedef struct cism_sampler:
        uint64_t *keys
        uint64_t *tmp
        double *probs
        float *work
        size_t cap, work_cap
    ctypedef struct cism_knobs:
        double temperature, top_p
        size_t top_k
        double min_p
        double repetition_penalty

cdef void rng_seed(cism_mt64 *g, uint64_t seed) noexcept nogil
cdef size_t argmax(const float *logits, size_t n) noexcept nogil
# -1 when scratch memory cannot be allocated
cdef int64_t sample_token(const float *logits, size_t vocab, double temperature, double top_p,
                          size_t top_k, cism_mt64 *rng, cism_sampler *s) noexcept nogil
# with min_p / repetition_penalty (both off = sample_token exactly)
cdef int64_t choose_token(const float *logits, size_t vocab, const cism_knobs *k,
                          const int64_t *history, size_t n_history, cism_mt64 *rng,
                          cism_sampler *s) noexcept nogil
cdef void sampler_free(cism_sampler *s) noexcept nogil
# log p(token) under the raw logits, and the top_n most likely (ids, log p)
cdef double token_logprobs(const float *logits, size_t vocab, int64_t token, size_t top_n,
                           int64_t *top_ids, double *top_lp) noexcept nogil
cdef size_t draft_tokens(const int64_t *history, size_t n, size_t k, int64_t *out) noexcept nogil

# Shared argument checks (Python level), with the spec's messages.
cpdef check_sampling(temperature, top_p, top_k, size_t vocab)
cpdef check_knobs(min_p, repetition_penalty)
