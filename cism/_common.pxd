# What every model family's sessions share (cimport cism._common).
from libc.stdint cimport int64_t
from cism.sampling cimport cism_knobs

# Return codes of the nogil layers.
cdef enum:
    OK = 0
    CANCELLED = 1
    NOMEM = -1
    NONFINITE = -2
    ERROR = -3         # an exception was stored on the session (pending_error)
    NONFINITE_SCORE = -4   # an attention score was inf or NaN (the forward stopped)

# Finish reasons (FINISH_NAMES in _common.pyx names them).
cdef enum:
    RUNNING = 0
    STOP = 1
    LENGTH = 2
    CANCEL = 3

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
cdef object raise_for(int rc, what=*)
cdef object logits_copy(const float *p, size_t n)
cdef object check_spec_k(spec_k, const Params *p)
cdef object arm_cancel(int *flag, checks)

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

cdef extern from "flag.h" nogil:
    int cism_flag_get(const int *p)
    void cism_flag_set(int *p, int v)
    int cism_flag_check(int *p)
