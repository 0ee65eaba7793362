# Argument checks and conversions every session and request shares, with
# the spec's messages (cimport cism._checks), and the sampling settings
# they parse into.
from libc.stdint cimport int64_t
from cism.sampling cimport cism_knobs

# Sampling shared by the sequences of a session.
cdef struct Params:
    double temperature, top_p
    size_t top_k
    double min_p                # 0 = off
    double repetition_penalty   # 1 = off
    int64_t *eos
    size_t n_eos

cdef object as_tokens(value, size_t vocab, what=*, bint allow_empty=*)
cdef object check_count(value, name)
cdef object parse_params(Params *p, size_t vocab, temperature, top_p, top_k, eos,
                         min_p=*, repetition_penalty=*)
cdef object logits_copy(const float *p, size_t n)
cdef object check_spec_k(spec_k, const Params *p)

cdef inline bint params_eos(const Params *p, int64_t token) noexcept nogil:
    cdef size_t i
    for i in range(p.n_eos):
        if p.eos[i] == token:
            return True
    return False

cdef inline cism_knobs knobs_of(const Params *p) noexcept nogil:
    cdef cism_knobs k
    k.temperature = p.temperature
    k.top_p = p.top_p
    k.top_k = p.top_k
    k.min_p = p.min_p
    k.repetition_penalty = p.repetition_penalty
    return k
