"""Argument checks and conversions every session and request shares, with
the spec's messages."""
import numpy as np

cimport numpy as cnp
from libc.stdint cimport int64_t
from libc.stdlib cimport malloc
from libc.string cimport memcpy

from cism._config import is_int
from cism.sampling cimport check_knobs, check_sampling

cnp.import_array()

MAX_SPEC_K = 16


cdef object as_tokens(value, size_t vocab, what="prompt", bint allow_empty=False):
    """A 1-D int64 array of token ids, each inside the vocabulary."""
    if isinstance(value, (str, bytes)):
        raise ValueError(f"{what} must be a sequence of token ids, not text (use a Tokenizer)")
    try:
        a = np.asarray(value)
    except Exception:
        raise ValueError(f"{what} must be a sequence of integer token ids") from None
    if a.size == 0:
        if not allow_empty:
            raise ValueError(f"{what} must contain at least one token")
        return np.zeros(0, np.int64)
    if a.ndim != 1 or a.dtype.kind not in "iu":
        raise ValueError(f"{what} must be a 1-D sequence of integer token ids")
    a = a.astype(np.int64)
    bad = (a < 0) | (a >= <int64_t>vocab)
    if bad.any():
        raise ValueError(f"token ID is outside the vocabulary: {int(a[np.argmax(bad)])} "
                         f"in {what} (vocab_size={vocab})")
    return np.ascontiguousarray(a)


cdef object check_count(value, name):
    if not is_int(value) or value < 0:
        raise ValueError(f"{name} must be a nonnegative integer, got {value!r}")
    return int(value)


cdef object check_spec_k(spec_k, const Params *p):
    if not is_int(spec_k) or (spec_k != 0 and not 2 <= spec_k <= MAX_SPEC_K):
        raise ValueError(f"spec_k must be 0 (off) or in [2, {MAX_SPEC_K}], got {spec_k!r}")
    if spec_k and p.temperature != 0:
        raise ValueError("spec_k > 0 needs greedy decoding (temperature 0)")
    if spec_k and p.repetition_penalty != 1:
        raise ValueError("spec_k > 0 cannot be combined with repetition_penalty "
                         "(verification compares raw argmaxes)")
    return int(spec_k)


cdef object parse_params(Params *p, size_t vocab, temperature, top_p, top_k, eos,
                         min_p=0.0, repetition_penalty=1.0):
    """Validate sampling settings and eos ids into p (p.eos is malloc'd: free it)."""
    p.temperature, p.top_p, p.top_k = check_sampling(temperature, top_p, top_k, vocab)
    p.min_p, p.repetition_penalty = check_knobs(min_p, repetition_penalty)
    if isinstance(eos, (int, np.integer)):
        eos = [eos]
    e = as_tokens(eos if isinstance(eos, np.ndarray) else list(eos), vocab, "eos", True)
    p.n_eos = len(e)
    p.eos = <int64_t*>malloc((len(e) + 1) * sizeof(int64_t))
    if p.eos == NULL:
        raise MemoryError
    if len(e):
        memcpy(p.eos, cnp.PyArray_DATA(e), len(e) * sizeof(int64_t))


cdef object logits_copy(const float *p, size_t n):
    out = np.empty(n, np.float32)
    memcpy(cnp.PyArray_DATA(out), p, n * sizeof(float))
    return out
