"""Token selection: the spec's sampler bit for bit, its mt19937_64 generator,
and the prompt-lookup drafter used by speculative decoding.

Sampling (temperature > 0) orders the vocabulary by logit (descending, ties
by ascending token id), keeps ``top_k`` (0 = all), computes
``exp((logit - max) / temperature)`` in double, cuts the nucleus where the
running sum first reaches ``top_p * total``, and walks it with one draw
``(rng() >> 11) * 2**-53 * total``. Temperature 0 is argmax (first maximum).
"""
import math

import numpy as np

cimport numpy as cnp
from libc.stdint cimport int64_t, uint64_t
from libc.string cimport memset

from cism._kernels cimport cism_argmax_fn, kernel_table

cnp.import_array()

cdef extern from "sample.h" nogil:
    void cism_mt64_seed(cism_mt64 *g, uint64_t seed)
    uint64_t cism_mt64_next(cism_mt64 *g)
    void cism_sampler_free(cism_sampler *s)
    size_t cism_argmax(const float *logits, size_t n)
    void cism_sample_use_argmax(const cism_argmax_fn *slot)
    int64_t cism_sample(const float *logits, size_t vocab, double temperature, double top_p,
                        size_t top_k, cism_mt64 *rng, cism_sampler *s)
    size_t cism_draft(const int64_t *history, size_t n, size_t k, int64_t *out)
    double cism_logprobs(const float *logits, size_t vocab, int64_t token, size_t top_n,
                         int64_t *top_ids, double *top_lp)
    int64_t cism_choose(const float *logits, size_t vocab, const cism_knobs *k,
                        const int64_t *history, size_t n_history, cism_mt64 *rng, cism_sampler *s)


# argmax through the kernel table (vectorized, the same index on every level)
cism_sample_use_argmax(&kernel_table().argmax)


def argmax_of(x):
    """The first index of the largest element of a float32 vector (the
    sampler's temperature-0 rule), through the kernel table."""
    cdef cnp.ndarray a = np.ascontiguousarray(x, dtype=np.float32)
    if a.ndim != 1:
        raise ValueError("x must be one-dimensional")
    cdef size_t n = a.shape[0], r
    with nogil:
        r = cism_argmax(<const float*>cnp.PyArray_DATA(a), n)
    return int(r)


cdef void rng_seed(cism_mt64 *g, uint64_t seed) noexcept nogil:
    cism_mt64_seed(g, seed)

cdef size_t argmax(const float *logits, size_t n) noexcept nogil:
    return cism_argmax(logits, n)

cdef int64_t sample_token(const float *logits, size_t vocab, double temperature, double top_p,
                          size_t top_k, cism_mt64 *rng, cism_sampler *s) noexcept nogil:
    return cism_sample(logits, vocab, temperature, top_p, top_k, rng, s)

cdef int64_t choose_token(const float *logits, size_t vocab, const cism_knobs *k,
                          const int64_t *history, size_t n_history, cism_mt64 *rng,
                          cism_sampler *s) noexcept nogil:
    return cism_choose(logits, vocab, k, history, n_history, rng, s)

cdef void sampler_free(cism_sampler *s) noexcept nogil:
    cism_sampler_free(s)

cdef size_t draft_tokens(const int64_t *history, size_t n, size_t k, int64_t *out) noexcept nogil:
    return cism_draft(history, n, k, out)

cdef double token_logprobs(const float *logits, size_t vocab, int64_t token, size_t top_n,
                           int64_t *top_ids, double *top_lp) noexcept nogil:
    return cism_logprobs(logits, vocab, token, top_n, top_ids, top_lp)


def logprobs(logits, token, top_n=0):
    """(log p(token), [(id, log p), ...] of the top_n most likely) under
    the raw logits: what cism.Engine reports per generated token."""
    cdef cnp.ndarray l = np.ascontiguousarray(logits, dtype=np.float32)
    if l.ndim != 1 or l.shape[0] == 0:
        raise ValueError("logits must be a non-empty vector")
    if not _is_int(token) or not 0 <= token < l.shape[0]:
        raise ValueError(f"token must be in [0, {l.shape[0]}), got {token!r}")
    if not _is_int(top_n) or top_n < 0:
        raise ValueError("top_n must be a nonnegative integer")
    n = min(int(top_n), l.shape[0])
    cdef cnp.ndarray ids = np.zeros(max(n, 1), np.int64)
    cdef cnp.ndarray lps = np.zeros(max(n, 1), np.float64)
    lp = cism_logprobs(<const float*>cnp.PyArray_DATA(l), l.shape[0], token, n,
                       <int64_t*>cnp.PyArray_DATA(ids), <double*>cnp.PyArray_DATA(lps))
    return lp, [(int(ids[i]), float(lps[i])) for i in range(n)]


def _is_int(v):
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


cpdef check_sampling(temperature, top_p, top_k, size_t vocab):
    """Validate sampling parameters; returns (temperature, top_p, top_k)."""
    try:
        t = float(temperature)
        p = float(top_p)
    except (TypeError, ValueError):
        raise ValueError("temperature and top_p must be numbers") from None
    if not math.isfinite(t) or t < 0:
        raise ValueError(f"temperature must be finite and nonnegative, got {temperature!r}")
    if not math.isfinite(p) or p <= 0 or p > 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    if not _is_int(top_k) or top_k < 0 or top_k > vocab:
        raise ValueError(f"top_k must be in [0, vocab_size={vocab}], got {top_k!r}")
    return t, p, int(top_k)


cpdef check_knobs(min_p, repetition_penalty):
    """Validate the optional knobs; returns (min_p, repetition_penalty)."""
    try:
        m = float(min_p)
        r = float(repetition_penalty)
    except (TypeError, ValueError):
        raise ValueError("min_p and repetition_penalty must be numbers") from None
    if not math.isfinite(m) or not 0 <= m <= 1:
        raise ValueError(f"min_p must be in [0, 1], got {min_p!r}")
    if not math.isfinite(r) or r <= 0:
        raise ValueError(f"repetition_penalty must be finite and positive, got {repetition_penalty!r}")
    return m, r


def check_seed(seed):
    if not _is_int(seed) or not 0 <= seed < 2**64:
        raise ValueError(f"seed must be an integer in [0, 2**64), got {seed!r}")
    return int(seed)


def mt19937_64(seed, count):
    """The first ``count`` outputs of std::mt19937_64 seeded with ``seed``."""
    cdef cism_mt64 g
    cism_mt64_seed(&g, check_seed(seed))
    return [cism_mt64_next(&g) for _ in range(count)]


def sample(logits, temperature=1.0, top_p=1.0, top_k=0, seed=0, draws=1, *, min_p=0.0,
           repetition_penalty=1.0, history=()):
    """Sample ``draws`` tokens from one logits vector with a fresh generator
    (as a session seeded with ``seed`` would for its first tokens).
    ``history`` is what the repetition penalty looks at."""
    cdef cnp.ndarray l = np.ascontiguousarray(logits, dtype=np.float32)
    if l.ndim != 1 or l.shape[0] == 0:
        raise ValueError("logits must be a non-empty vector")
    if not np.isfinite(l).all():
        raise ValueError("logits must be finite")
    cdef cism_knobs k
    k.temperature, k.top_p, k.top_k = check_sampling(temperature, top_p, top_k, l.shape[0])
    k.min_p, k.repetition_penalty = check_knobs(min_p, repetition_penalty)
    cdef cnp.ndarray h = np.ascontiguousarray(np.asarray(history, dtype=np.int64).reshape(-1))
    cdef cism_mt64 g
    cdef cism_sampler s
    memset(&s, 0, sizeof(s))
    cism_mt64_seed(&g, check_seed(seed))
    out = []
    try:
        for _ in range(draws):
            tok = cism_choose(<const float*>cnp.PyArray_DATA(l), l.shape[0], &k,
                              <const int64_t*>cnp.PyArray_DATA(h), h.shape[0], &g, &s)
            if tok < 0:
                raise MemoryError("cannot allocate sampler scratch")
            out.append(tok)
    finally:
        cism_sampler_free(&s)
    return out


def draft(history, k):
    """The prompt-lookup draft of up to k tokens continuing ``history``."""
    cdef cnp.ndarray h = np.ascontiguousarray(history, dtype=np.int64)
    if h.ndim != 1:
        raise ValueError("history must be one-dimensional")
    if not _is_int(k) or k < 0:
        raise ValueError("k must be a nonnegative integer")
    cdef cnp.ndarray out = np.empty(max(int(k), 1), dtype=np.int64)
    cdef size_t n = cism_draft(<const int64_t*>cnp.PyArray_DATA(h), h.shape[0], k,
                               <int64_t*>cnp.PyArray_DATA(out))
    return out[:n].tolist()
