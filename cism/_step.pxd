# One forward step over a ragged batch: what the serving engine hands a model
# family (cimport cism._step). The step holds tokens of several sequences
# (runs), each at its own positions: a decode token, a verification block or
# a prompt chunk. Every projection runs once over all of the step's tokens;
# attention and recurrences run per run over that sequence's own KV blocks
# and state. A token's bits never depend on what else is in the step.
from libc.stdint cimport int64_t
from cism._kvcache cimport KV


cdef struct StepRun:
    size_t first, n        # its tokens: tokens[first:first + n], in order
    size_t pos             # the position of its first token
    const size_t *blocks   # its block table in the pool pages (attention families)
    const KV *kv           # or its own contiguous cache (a solo session), used instead when set
    float *state           # its recurrent state (Surjo, FWKV), state_floats floats
    size_t out_row         # its first row in the step's logits
    size_t n_out           # logits rows it wants: 0, 1 (its last token) or n (every token)


cdef struct StepBatch:
    const int64_t *tokens  # (T,)
    size_t T
    StepRun *runs          # (n_runs,), runs in any order, tokens of a run contiguous
    size_t n_runs
    float **snap           # NULL, or (T,): where to copy the run's whole state after
                           # token g (NULL: nowhere); recurrent families only
    float *logits          # (rows, vocab), rows = sum of n_out
    bint prompt            # every token is a prompt token (dense bf16 prefill applies)
    int *cancel            # checked once per layer


# A model family's side of the engine and of every session: one object per
# engine or session, owning its scratch. forward() runs a StepBatch; it returns OK, CANCELLED, NOMEM,
# NONFINITE_SCORE (an attention score was inf or NaN: the forward stopped
# after that layer's attention, no row holds logits) or NONFINITE
# (cism._status), with NONFINITE meaning every row was computed and at
# least one holds an inf or NaN.
cdef class Stepper:
    cdef readonly object model
    cdef readonly size_t vocab
    cdef readonly size_t state_floats    # floats of one sequence's recurrent state (0: none)
    cdef readonly size_t kv_layers       # KV "layers" in the pool pages (0: no paged KV)
    cdef readonly size_t kv_width
    cdef readonly size_t head_dim        # the pool's head_dim (its KV heads' width)
    cdef readonly object kv_dtype        # numpy dtype of the pool pages
    cdef readonly bint bf16_prompts      # prompt tokens run at the bf16 prefill precision
    cdef char *k_pages
    cdef char *v_pages
    cdef size_t n_pages      # blocks in the pool
    cdef object pages_keep
    cdef KV *kvs             # per run: its view of the pages (attention families)
    cdef size_t kvs_cap

    cdef int forward(self, StepBatch *b) noexcept nogil


# Run a step whose prompt tokens go at the bf16 prefill precision: each run's
# tokens below prompt_end[r] in a first forward, the rest in a second one.
cdef int forward_split_prompts(Stepper st, StepBatch *b, const size_t *prompt_end) except? -9


# A ragged step written in Python (a toy family, a prototype): forward_py
# runs under the GIL; see _step.pyx.
cdef class PyStepper(Stepper):
    cdef public object error      # the exception forward_py raised last, if any
    cdef int forward_gil(self, StepBatch *b) except -9
