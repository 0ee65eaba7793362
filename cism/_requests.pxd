# A request inside the serving engine's core (cimport cism._requests): its
# tokens, sampling state and resources, and the token-choosing jobs the
# step runs in parallel (cism._engine_step).
from libc.stdint cimport int64_t
from cism._checks cimport Params
from cism._session cimport SeqCore, MAX_K

# Phases of a request.
cdef enum:
    WAITING = 0     # queued, or preempted: holds no blocks and no state
    ACTIVE = 1      # admitted: holds blocks and state, runs in steps
    DONE = 2

cdef enum:
    MAX_TOP = 20    # top logprobs per token, at most


cdef class Seq:
    cdef readonly object handle       # what the caller holds (cism.engine.Request)
    cdef readonly long long req_id
    cdef readonly int priority
    cdef readonly long long arrival
    cdef readonly long long since     # the engine's step count when it arrived (aging)
    cdef readonly int phase
    cdef SeqCore s                    # history = prompt + generated; position = tokens run
    cdef Params p
    cdef readonly size_t vocab
    cdef readonly size_t spec_k
    cdef public size_t hold           # no token is chosen once generated reaches it (BatchSession)
    cdef readonly size_t top_n        # top logprobs per token
    cdef readonly bint want_lp
    cdef int cancel_flag
    cdef size_t *blocks               # its block table, mirrored from the pool
    cdef size_t n_blocks, blocks_cap
    cdef float *state                 # recurrent state (Surjo, FWKV)
    cdef list keys                    # prefix-cache keys of its leading full blocks
    cdef readonly size_t cached_tokens, preemptions, recomputed_tokens
    cdef readonly object error
    cdef readonly Seq leader          # a request with the same prompt it forks from once prefilled
    cdef list followers               # requests waiting to fork from this one
    # this step
    cdef size_t run_n, run_first, run_pos, out_row, n_drafts, snap_first
    cdef int64_t drafts[MAX_K]
    cdef bint in_step

    cpdef tuple rank(self, size_t aging)


cdef struct Job:
    # a token to choose (or a known one to report) from one logits row
    const float *row
    size_t vocab
    int64_t token           # -1: choose it (core_choose) for the sequence s
    SeqCore *s
    const Params *p
    size_t top_n
    bint want_lp
    double lp
    int64_t *top_ids
    double *top_lp


cdef void run_job(Job *job) noexcept nogil
