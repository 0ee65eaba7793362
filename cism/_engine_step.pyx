"""The serving engine's model step: the scheduler's plan laid out as one
ragged StepBatch (cism._step), its forward, and what the engine reads back
from it.

A plan is a list of requests (cism._requests.Seq), each running `run_n`
tokens from its `position`: its pending history, then its drafts when it
speculates. A run wants logits for every token of a verification block,
for the last token of its history otherwise, and none for a prompt chunk
that does not reach the end. Recurrent families also copy their state after
every token of a verification block (to roll back to after the last
accepted one) and at every block boundary when the prefix cache is on.
"""
import numpy as np

cimport numpy as cnp
from cython.parallel cimport prange
from libc.stdint cimport int64_t
from libc.stdlib cimport malloc, free
from libc.string cimport memcpy

from cism._status cimport OK, NOMEM, NONFINITE
from cism._layers cimport grow_f
from cism._requests cimport MAX_TOP, Job, Seq, run_job
from cism._step cimport Stepper, StepBatch, StepRun, forward_split_prompts
from cism.sampling cimport argmax

cnp.import_array()

DEF BLOCK = 16


cdef class EngineStep:
    """The step's buffers and its forward; one thread at a time (the engine's)."""

    def __cinit__(self):
        self.tokens = NULL
        self.runs = NULL
        self.snap = NULL
        self.snap_mem = NULL
        self.logits = NULL
        self.jobs = NULL
        self.top_ids = NULL
        self.top_lp = NULL

    def __init__(self, Stepper stepper, int threads):
        self.stepper = stepper
        self.vocab = stepper.vocab
        self.S = stepper.state_floats
        self.threads = threads

    def __dealloc__(self):
        free(self.tokens)
        free(self.runs)
        free(self.snap)
        free(self.snap_mem)
        free(self.logits)
        free(self.jobs)
        free(self.top_ids)
        free(self.top_lp)

    cdef int reserve(self, size_t T, size_t runs, size_t rows, size_t snaps, size_t jobs) except -1:
        if T > self.tokens_cap:
            free(self.tokens)
            self.tokens_cap = 0
            self.tokens = <int64_t*>malloc(T * sizeof(int64_t))
            free(self.snap)
            self.snap = <float**>malloc(T * sizeof(float*))
            if self.tokens == NULL or self.snap == NULL:
                raise MemoryError("cannot allocate the step's buffers")
            self.tokens_cap = T
        if runs > self.runs_cap:
            free(self.runs)
            self.runs_cap = 0
            self.runs = <StepRun*>malloc(runs * sizeof(StepRun))
            if self.runs == NULL:
                raise MemoryError("cannot allocate the step's buffers")
            self.runs_cap = runs
        if rows * self.vocab > self.logits_cap:
            self.logits_cap = 0
            if grow_f(&self.logits, rows * self.vocab):
                raise MemoryError("cannot allocate the step's logits")
            self.logits_cap = rows * self.vocab
        if snaps * self.S > self.snap_cap:
            self.snap_cap = 0
            if grow_f(&self.snap_mem, snaps * self.S):
                raise MemoryError("cannot allocate the step's state snapshots")
            self.snap_cap = snaps * self.S
        if jobs > self.jobs_cap:
            free(self.jobs)
            self.jobs_cap = 0
            self.jobs = <Job*>malloc(jobs * sizeof(Job))
            if self.jobs == NULL:
                raise MemoryError("cannot allocate the step's buffers")
            self.jobs_cap = jobs
        if jobs * MAX_TOP > self.top_cap:
            free(self.top_ids)
            free(self.top_lp)
            self.top_cap = 0
            self.top_ids = <int64_t*>malloc(jobs * MAX_TOP * sizeof(int64_t))
            self.top_lp = <double*>malloc(jobs * MAX_TOP * sizeof(double))
            if self.top_ids == NULL or self.top_lp == NULL:
                raise MemoryError("cannot allocate the step's buffers")
            self.top_cap = jobs * MAX_TOP
        return 0

    cdef size_t lay_out(self, list plan, bint block_snaps) except? 0:
        """The plan's tokens, runs, logits rows and snapshot slots (one at
        each block boundary a run crosses when `block_snaps`); returns T."""
        cdef Seq q
        cdef size_t T = 0, rows = 0, n_snaps = 0, i, r, pos
        cdef size_t S = self.S
        for q in plan:
            T += q.run_n
            if q.s.position + q.run_n == q.s.hist_len or q.n_drafts:
                rows += q.run_n if q.n_drafts else 1
            if S:
                if q.n_drafts:
                    n_snaps += q.run_n
                elif block_snaps:
                    n_snaps += (q.s.position + q.run_n) // BLOCK - q.s.position // BLOCK
        self.reserve(T, len(plan), rows, n_snaps, rows)
        T = 0
        rows = 0
        n_snaps = 0
        for r, q in enumerate(plan):
            q.run_first = T
            memcpy(self.tokens + T, q.s.history + q.s.position, (q.run_n - q.n_drafts) * sizeof(int64_t))
            if q.n_drafts:
                memcpy(self.tokens + T + 1, q.drafts, q.n_drafts * sizeof(int64_t))
            self.runs[r].first = T
            self.runs[r].n = q.run_n
            self.runs[r].pos = q.s.position
            self.runs[r].blocks = q.blocks
            self.runs[r].kv = NULL
            self.runs[r].state = q.state
            self.runs[r].out_row = rows
            self.runs[r].n_out = 0
            if q.n_drafts:
                self.runs[r].n_out = q.run_n
            elif q.s.position + q.run_n == q.s.hist_len:
                self.runs[r].n_out = 1
            q.out_row = rows
            q.run_pos = q.s.position
            rows += self.runs[r].n_out
            if S:
                q.snap_first = n_snaps
                for i in range(q.run_n):
                    pos = q.s.position + i + 1   # the state after token i is at position pos
                    if q.n_drafts or (block_snaps and pos % BLOCK == 0):
                        self.snap[T + i] = self.snap_mem + n_snaps * S
                        n_snaps += 1
                    else:
                        self.snap[T + i] = NULL
            T += q.run_n
        self.rows = rows
        return T

    cdef int forward(self, list plan, size_t T, int *cancel) except? -9:
        """The laid-out step's forward, or the result a test injected."""
        cdef int rc
        if self.inject == NONFINITE:   # tests: the step's first logits row turns NaN
            self.inject = 0
            rc = self.run_forward(plan, T, cancel)
            if self.rows and (rc == OK or rc == NONFINITE):
                self.logits[0] = float("nan")
                rc = NONFINITE
        elif self.inject:
            rc = self.inject
            self.inject = 0
        else:
            rc = self.run_forward(plan, T, cancel)
        return rc

    cdef int run_forward(self, list plan, size_t T, int *cancel) except? -9:
        """The step's forward (two for a model with bf16 prefill: prompt
        tokens at that precision first, then the rest)."""
        cdef StepBatch b
        cdef int rc
        cdef Seq q
        cdef size_t r
        cdef size_t *ends
        b.tokens = self.tokens
        b.T = T
        b.runs = self.runs
        b.n_runs = len(plan)
        b.snap = self.snap if self.S else NULL
        b.logits = self.logits
        b.prompt = False
        b.cancel = cancel
        if self.stepper.bf16_prompts:
            ends = <size_t*>malloc(len(plan) * sizeof(size_t) + 1)
            if ends == NULL:
                return NOMEM
            for r, q in enumerate(plan):
                ends[r] = q.s.prompt_end
            rc = forward_split_prompts(self.stepper, &b, ends)
            free(ends)
            return rc
        with nogil:
            rc = self.stepper.forward(&b)
        return rc

    cdef size_t accept_drafts(self, Seq q):
        """A verification block's result: the drafts the model itself
        chooses (its argmax) are kept; q moves past them and the token
        after them, its state back to the snapshot after the last kept one,
        its logits those after it. Returns how many drafts were kept."""
        cdef size_t a = 0, V = self.vocab, S = self.S
        cdef const float *row = self.logits + q.out_row * V
        while a < q.n_drafts and <int64_t>argmax(row + a * V, V) == q.drafts[a]:
            a += 1
        q.s.position += 1 + a
        if S and a < q.n_drafts:
            memcpy(q.state, self.snap_mem + (q.snap_first + a) * S, S * sizeof(float))
        memcpy(q.s.logits, row + a * V, V * sizeof(float))
        q.s.have_logits = True
        return a

    cdef void add_job(self, size_t i, Seq q, const float *row, int64_t token) noexcept:
        cdef Job *job = &self.jobs[i]
        job.row = row
        job.vocab = self.vocab
        job.token = token
        job.s = &q.s
        job.p = &q.p
        job.top_n = q.top_n
        job.want_lp = q.want_lp
        job.top_ids = self.top_ids + i * MAX_TOP
        job.top_lp = self.top_lp + i * MAX_TOP

    cdef void run_jobs(self, size_t n) noexcept:
        """Jobs 0..n-1 in parallel, each with its own request's generator."""
        cdef size_t i
        cdef int nt = self.threads
        with nogil:
            for i in prange(n, num_threads=nt if n > 1 else 1, schedule='dynamic'):
                run_job(&self.jobs[i])

    cdef object snapshot(self, Seq q, size_t boundary):
        """A copy of q's state at position `boundary` from this step's
        snapshots (a verification block keeps one after every token, other
        runs one at each block boundary), or None when the step kept none."""
        cdef size_t idx, S = self.S
        cdef cnp.ndarray out
        if boundary <= q.run_pos or boundary > q.run_pos + q.run_n:
            return None
        if q.n_drafts:
            idx = q.snap_first + (boundary - q.run_pos - 1)
        else:
            idx = q.snap_first + (boundary // BLOCK - (q.run_pos // BLOCK + 1))
        out = np.empty(S, np.float32)
        memcpy(cnp.PyArray_DATA(out), self.snap_mem + idx * S, S * sizeof(float))
        return out
