"""A request inside the serving engine's core (Seq: its tokens, sampling
state, block table and recurrent state), the in-process handle that keeps
what the core publishes (Collector), and the job that chooses one token
(run_job, run in parallel by the step)."""
from libc.stdlib cimport free
from libc.string cimport memset

from cism._status cimport cism_flag_get, cism_flag_set
from cism._checks cimport Params, logits_copy
from cism._session cimport SeqCore, core_choose, core_free
from cism.sampling cimport token_logprobs


cdef class Seq:
    """One request inside the core: its tokens, sampling state and resources."""

    def __cinit__(self):
        memset(&self.s, 0, sizeof(SeqCore))
        memset(&self.p, 0, sizeof(Params))
        self.blocks = NULL
        self.state = NULL

    def __dealloc__(self):
        core_free(&self.s)
        free(self.p.eos)
        free(self.blocks)
        free(self.state)

    @property
    def position(self):
        return self.s.position

    @property
    def history(self):
        return [self.s.history[i] for i in range(self.s.hist_len)]

    @property
    def generated(self):
        return self.s.generated

    @property
    def prompt_len(self):
        return self.s.prompt_end

    @property
    def last_logits(self):
        """The logits of its latest forward (the next token's distribution), or None."""
        if not self.s.have_logits:
            return None
        return logits_copy(self.s.logits, self.vocab)

    @property
    def block_table(self):
        return [self.blocks[i] for i in range(self.n_blocks)]

    def cancel(self):
        """From any thread: the request leaves at the next step."""
        cism_flag_set(&self.cancel_flag, 1)

    @property
    def cancelled(self):
        return bool(cism_flag_get(&self.cancel_flag))

    cpdef tuple rank(self, size_t aging):
        """Scheduling order (higher first): priority minus one for every
        `aging` steps of the engine before it arrived, then the older
        arrival. A request's order against another never changes (both age
        alike), so preemptions cannot cycle, and a request that has been
        there a·(P - p) steps outranks every later one of priority up to P."""
        return (<long long>self.priority * <long long>aging - self.since, -self.arrival)


class Collector:
    """The handle of a request driven in-process (BatchSession): it keeps
    what the core publishes."""

    def __init__(self):
        self.tokens = []
        self.finish_reason = ""
        self.error = None

    def _publish(self, tokens, lps, tops):
        self.tokens.extend(tokens)

    def _finish(self, reason, error):
        self.finish_reason = reason
        self.error = error


cdef void run_job(Job *job) noexcept nogil:
    if job.token < 0:
        job.token = core_choose(job.s, job.p, job.row, job.vocab)
        if job.token < 0:
            return
    if job.want_lp:
        job.lp = token_logprobs(job.row, job.vocab, job.token, job.top_n, job.top_ids, job.top_lp)
