# The serving engine's model step (cimport cism._engine_step): a plan of
# requests laid out as one ragged StepBatch, its forward, and its results
# read back (draft acceptance, state snapshots, token-choosing jobs).
# cism._scheduler decides the plan; cism._engine runs the lifecycle around it.
from libc.stdint cimport int64_t
from cism._requests cimport Job, Seq
from cism._step cimport Stepper, StepRun


cdef class EngineStep:
    cdef readonly Stepper stepper
    cdef size_t vocab
    cdef size_t S                # the stepper's state floats
    cdef int threads
    cdef int inject              # tests: the next forward's result, without running it
    # buffers, grown on demand
    cdef int64_t *tokens         # (T,)
    cdef StepRun *runs           # (runs,)
    cdef float **snap            # (T,): where the state after each token goes, or NULL
    cdef float *snap_mem         # (snapshots, S)
    cdef float *logits           # (rows, vocab)
    cdef Job *jobs               # (jobs,)
    cdef int64_t *top_ids        # (jobs, MAX_TOP)
    cdef double *top_lp          # (jobs, MAX_TOP)
    cdef size_t tokens_cap, runs_cap, snap_cap, logits_cap, jobs_cap, top_cap
    cdef size_t rows             # logits rows of the last layout

    cdef int reserve(self, size_t T, size_t runs, size_t rows, size_t snaps, size_t jobs) except -1
    cdef size_t lay_out(self, list plan, bint block_snaps) except? 0
    cdef int forward(self, list plan, size_t T, int *cancel) except? -9
    cdef int run_forward(self, list plan, size_t T, int *cancel) except? -9
    cdef size_t accept_drafts(self, Seq q)
    cdef void add_job(self, size_t i, Seq q, const float *row, int64_t token) noexcept
    cdef void run_jobs(self, size_t n) noexcept
    cdef object snapshot(self, Seq q, size_t boundary)
