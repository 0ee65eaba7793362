"""The family-neutral side of a ragged forward step (see _step.pxd)."""
import numpy as np

cimport numpy as cnp
from libc.stdint cimport int64_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy

from cism._status cimport OK, CANCELLED, NOMEM, NONFINITE, ERROR, cism_flag_check
from cism._layers cimport all_finite_f, grow_f

cnp.import_array()


cdef class Stepper:
    """A model family's forward over a ragged batch of sequences. Families
    subclass it (cism._dense.DenseStepper, ...); the engine owns one."""

    def __cinit__(self, *args, **kwargs):
        self.kvs = NULL
        self.kvs_cap = 0

    def __dealloc__(self):
        free(self.kvs)

    def __init__(self, model):
        self.model = model
        self.k_pages = NULL
        self.v_pages = NULL

    def set_pages(self, pool):
        """Point the paged attention at a BlockPool's pages (the pool keeps
        them: pages never move while its blocks are in use)."""
        cdef cnp.ndarray k = pool.k_pages
        cdef cnp.ndarray v = pool.v_pages
        if (pool.num_layers != self.kv_layers or pool.kv_width != self.kv_width
                or pool.head_dim != self.head_dim):
            raise ValueError("the pool's shape does not match the model's KV")
        if pool.dtype != self.kv_dtype:
            raise ValueError("the pool's dtype does not match the model's kv_precision")
        self.pages_keep = (k, v)
        self.n_pages = pool.num_blocks
        self.k_pages = <char*>cnp.PyArray_DATA(k)
        self.v_pages = <char*>cnp.PyArray_DATA(v)

    cdef int forward(self, StepBatch *b) noexcept nogil:
        return NOMEM


cdef int forward_split_prompts(Stepper st, StepBatch *b, const size_t *prompt_end) except? -9:
    """bf16 prefill (st.bf16_prompts): run r's tokens below prompt_end[r]
    go in a first forward at the bf16 precision, the others in a second,
    exact one, so every token runs as a solo session runs it (a run's
    logits rows are its last n_out tokens, whichever pass runs them)."""
    cdef size_t n = b.n_runs + 1, V = st.vocab
    cdef StepRun *part = <StepRun*>malloc(2 * n * sizeof(StepRun))
    cdef size_t *dest = <size_t*>malloc(2 * n * sizeof(size_t))   # each part's first row in b.logits
    cdef float *rows = NULL
    cdef size_t r, i, k, start, end, cut, in_hi
    cdef size_t counts[2]
    cdef size_t total_rows = 0
    cdef int rc = OK, rc2
    cdef StepBatch a
    if part == NULL or dest == NULL:
        free(part)
        free(dest)
        return NOMEM
    counts[0] = 0
    counts[1] = 0
    for r in range(b.n_runs):
        total_rows += b.runs[r].n_out
        start = b.runs[r].pos
        end = start + b.runs[r].n
        cut = min(max(prompt_end[r], start), end)
        in_hi = min(b.runs[r].n_out, end - cut)
        if cut > start:
            i = counts[0]
            part[i] = b.runs[r]
            part[i].n = cut - start
            part[i].n_out = b.runs[r].n_out - in_hi
            dest[i] = b.runs[r].out_row
            counts[0] += 1
        if end > cut:
            i = n + counts[1]
            part[i] = b.runs[r]
            part[i].first = b.runs[r].first + (cut - start)
            part[i].pos = cut
            part[i].n = end - cut
            part[i].n_out = in_hi
            dest[i] = b.runs[r].out_row + (b.runs[r].n_out - in_hi)
            counts[1] += 1
    if grow_f(&rows, total_rows * V + 1):
        free(part)
        free(dest)
        free(rows)
        return NOMEM
    a = b[0]
    a.logits = rows
    with nogil:
        for k in range(2):
            if counts[k] == 0 or not (rc == OK or rc == NONFINITE):
                continue
            a.runs = part + k * n
            a.n_runs = counts[k]
            a.prompt = k == 0
            # rows of a pass are consecutive in run order, from 0
            total_rows = 0
            for i in range(counts[k]):
                a.runs[i].out_row = total_rows
                total_rows += a.runs[i].n_out
            rc2 = st.forward(&a)
            if rc2 != OK and rc != NOMEM and rc != CANCELLED:
                rc = rc2
            if rc2 == OK or rc2 == NONFINITE:
                for i in range(counts[k]):
                    memcpy(b.logits + dest[k * n + i] * V, rows + a.runs[i].out_row * V,
                           a.runs[i].n_out * V * sizeof(float))
    free(part)
    free(dest)
    free(rows)
    return rc


cdef class PyStepper(Stepper):
    """A family's ragged step in Python, for a toy family or a prototype
    (no KV pages: its memory is a recurrent state of state_floats floats per
    sequence, or none). A subclass defines forward_py(tokens, state): run
    the int64 tokens of one sequence in order from its state (a float32
    view, advanced in place; None when state_floats is 0) and return every
    token's logits, (len(tokens), vocab) float32. It must give each token
    the same result however the tokens are split, as every family does:
    the scaffold splits runs into chunks, and at the tokens whose state it
    snapshots (verification blocks, prefix caching)."""

    def __init__(self, model, size_t vocab, size_t state_floats=0):
        Stepper.__init__(self, model)
        self.vocab = vocab
        self.state_floats = state_floats
        self.kv_layers = 0
        self.kv_width = 0
        self.head_dim = 0
        self.kv_dtype = None
        self.bf16_prompts = False
        self.error = None

    def forward_py(self, tokens, state):
        raise NotImplementedError

    cdef int forward(self, StepBatch *b) noexcept nogil:
        cdef int rc
        with gil:
            try:
                rc = self.forward_gil(b)
            except MemoryError:
                rc = NOMEM
            except BaseException as e:
                self.error = e
                rc = ERROR
        return rc

    cdef int forward_gil(self, StepBatch *b) except -9:
        cdef size_t V = self.vocab, S = self.state_floats, r, g, seg, stop, first_out, n_rows = 0
        cdef const StepRun *run
        cdef float[:, ::1] out
        cdef float[:, ::1] got
        cdef float[::1] st
        cdef size_t i
        if cism_flag_check(b.cancel):
            return CANCELLED
        for r in range(b.n_runs):
            n_rows += b.runs[r].n_out
        tokens = np.array(<int64_t[:b.T]>b.tokens) if b.T else np.zeros(0, np.int64)
        if n_rows:
            out = <float[:n_rows, :V]>b.logits
        for r in range(b.n_runs):
            run = &b.runs[r]
            state = np.asarray(<float[:S]>run.state) if S else None
            first_out = run.first + run.n - run.n_out
            seg = run.first
            while seg < run.first + run.n:
                # up to the next token whose state is wanted, or the run's end
                stop = seg + 1
                while stop < run.first + run.n and not (b.snap != NULL and b.snap[stop - 1] != NULL):
                    stop += 1
                got = np.ascontiguousarray(self.forward_py(tokens[seg:stop], state), np.float32)
                if <size_t>got.shape[0] != stop - seg or <size_t>got.shape[1] != V:
                    raise ValueError(f"forward_py returned logits of shape {(got.shape[0], got.shape[1])}, "
                                     f"expected {(stop - seg, V)}")
                for g in range(max(seg, first_out), stop):
                    out[run.out_row + g - first_out, :] = got[g - seg, :]
                if S and b.snap != NULL and b.snap[stop - 1] != NULL:
                    st = state
                    for i in range(S):
                        b.snap[stop - 1][i] = st[i]
                seg = stop
        if n_rows and not all_finite_f(b.logits, n_rows * V):
            return NONFINITE
        return OK
