"""The serving engine's core: a request's lifecycle around the step.

A step is one forward over a ragged batch (cism._step): the decode token of
every running sequence (or its verification block, when it speculates),
then prompt chunks of sequences still prefilling, up to a per-step token
budget. After the forward every sequence whose pending tokens have all run
samples its next token. Tokens never depend on the rest of the step: each
sequence keeps its own generator, history and logits, and every row of the
forward has the bits a solo session computes for it.

EngineCore adds requests, runs a step (cism._scheduler plans it,
cism._engine_step lays it out and runs the forward), accepts drafts,
publishes the chosen tokens, caches full blocks, and ends requests
(finished, cancelled, failed). This module is single-threaded:
cism.engine.Engine runs it from one thread (or lets a caller step it by
hand) and carries requests in and tokens out.
"""
import numpy as np

cimport numpy as cnp
from libc.stdint cimport int64_t
from libc.stdlib cimport malloc
from libc.string cimport memcmp, memcpy

from cism._status cimport (OK, CANCELLED, NOMEM, NONFINITE, NONFINITE_SCORE, RUNNING, CANCEL,
                           cism_flag_get, cism_flag_set, cism_flag_check)
from cism._checks cimport as_tokens, check_count, parse_params
from cism._layers cimport all_finite_f
from cism._session cimport core_alloc, core_account
from cism._requests cimport ACTIVE, DONE, WAITING, Job, Seq
from cism._step cimport Stepper
from cism._scheduler cimport Scheduler
from cism._engine_step cimport EngineStep
from cism.sampling cimport argmax

from cism._status import FINISH_NAMES

cnp.import_array()

DEF BLOCK = 16

cdef class EngineCore(Scheduler):
    """Requests, pool, prefix cache and the step. Not thread-safe: one
    thread at a time (cism.engine.Engine serialises)."""
    cdef readonly dict by_id
    cdef long long next_arrival
    cdef int abort                       # cancels the forward in flight (shutdown)
    cdef EngineStep work                 # the step's buffers and forward
    # counters
    cdef readonly size_t steps, tokens_run, generated_total
    cdef readonly size_t spec_proposed, spec_accepted

    def __init__(self, Stepper stepper, pool, prefix_caching, size_t snapshot_budget,
                 size_t max_seqs, size_t max_step_tokens, size_t aging_steps, int threads):
        Scheduler.__init__(self, stepper, pool, prefix_caching, snapshot_budget, max_seqs,
                           max_step_tokens, aging_steps)
        self.work = EngineStep(stepper, threads)
        self.by_id = {}
        self.next_arrival = 0

    # ------------------------------------------------------------ requests ---

    def check(self, prompt, max_new_tokens):
        """Validate what admission needs (raises ValueError); the prompt as int64."""
        p = as_tokens(prompt, self.vocab)
        max_new = check_count(max_new_tokens, "max_new_tokens")
        if len(p) + max_new > self.context:
            raise ValueError(f"prompt + max_new_tokens exceeds the context length "
                             f"({len(p)} + {max_new} > {self.context})")
        if self.pool is not None:
            need = (len(p) + max_new + BLOCK - 1) // BLOCK
            if need > self.pool.num_blocks:
                raise ValueError(f"prompt + max_new_tokens needs {need} KV blocks, more than the "
                                 f"engine's whole pool ({self.pool.num_blocks}; kv_blocks=)")
        return p, max_new

    def add(self, handle, long long req_id, prompt, max_new_tokens, temperature, top_p, top_k,
            seed, eos, min_p, repetition_penalty, priority, spec_k, logprobs, top_logprobs,
            Seq leader=None):
        """Queue a request (arguments validated by the caller with check(),
        parse_params and check_spec_k); returns its Seq. With a leader of
        the same prompt, it waits for the leader's prefill and forks from it
        (sharing its blocks, copying its logits and state): n completions of
        one prompt prefill it once."""
        cdef Seq q = Seq()
        cdef cnp.ndarray p
        p, max_new = self.check(prompt, max_new_tokens)
        parse_params(&q.p, self.vocab, temperature, top_p, top_k, eos, min_p, repetition_penalty)
        q.handle = handle
        q.vocab = self.vocab
        q.req_id = req_id
        q.priority = priority
        q.spec_k = spec_k
        q.want_lp = bool(logprobs)
        q.top_n = top_logprobs
        q.hold = max_new
        q.followers = []
        q.keys = []
        if core_alloc(&q.s, <const int64_t*>cnp.PyArray_DATA(p), len(p), 0, max_new, self.vocab,
                      seed) != OK:
            raise MemoryError("cannot allocate the request's state")
        # the prompt is history not yet run (position 0)
        memcpy(q.s.history, q.s.prompt, len(p) * sizeof(int64_t))
        q.s.hist_len = len(p)
        q.s.prompt_len = 0
        q.blocks_cap = (len(p) + max_new) // BLOCK + 2
        q.blocks = <size_t*>malloc(q.blocks_cap * sizeof(size_t))
        if q.blocks == NULL:
            raise MemoryError("cannot allocate the request's state")
        q.arrival = self.next_arrival
        q.since = self.steps
        self.next_arrival += 1
        q.phase = WAITING
        self.by_id[req_id] = q
        if q.s.finish != RUNNING:  # max_new_tokens 0: done before it starts
            self.finish(q, None)
        else:
            if (leader is not None and leader.phase != DONE and leader.s.position < leader.s.prompt_end
                    and leader.s.prompt_end == q.s.prompt_end
                    and memcmp(leader.s.history, q.s.history, q.s.prompt_end * sizeof(int64_t)) == 0):
                q.leader = leader
                leader.followers.append(q)
            self.waiting.append(q)
        return q

    def cancel_all(self):
        cdef Seq q
        for q in list(self.waiting) + list(self.active):
            q.cancel()

    def _inject_forward_result(self, name):
        """Testing hook: the next step's forward "returns" NOMEM or CANCELLED
        without running, or ("nonfinite") runs and has its first logits row
        turned NaN, so the recovery paths run on purpose."""
        self.work.inject = {"nomem": NOMEM, "cancelled": CANCELLED, "nonfinite": NONFINITE}[name]

    def abort_forward(self):
        """Stop the forward in flight at its next layer (from any thread)."""
        cism_flag_set(&self.abort, 1)

    @property
    def busy(self):
        """Whether a step has anything to do: a request waiting, a token to
        run, or a token to choose (a request held below its count has none)."""
        cdef Seq q
        if self.waiting:
            return True
        for q in self.active:
            if q.s.hist_len > q.s.position or q.s.generated < q.hold:
                return True
        return False

    # -------------------------------------------------------------- step ---

    def step(self):
        """One step: reap cancelled requests, schedule, one forward, choose
        tokens. Returns the number of tokens the forward ran (0: idle)."""
        cdef Seq q
        cdef list plan
        cdef size_t T
        cdef int rc
        if cism_flag_check(&self.abort):
            self.cancel_everything()
            return 0
        self.reap()
        self.choose_held()
        plan = self.schedule()
        if not plan:
            return 0
        T = self.work.lay_out(plan, self.cache is not None)
        rc = self.work.forward(plan, T, &self.abort)
        self.steps += 1
        self.tokens_run += T
        if rc == NOMEM:
            self.out_of_memory(plan, T)
            return T
        if rc == CANCELLED:   # the abort flag: everything ends "cancelled"
            for q in plan:
                q.in_step = False
            self.cancel_everything()
            return T
        if rc == NONFINITE_SCORE:   # the forward stopped: no row holds logits
            for q in plan:
                q.in_step = False
                self.fail(q, RuntimeError("non-finite attention score"))
            return T
        self.budget_cap = min(self.max_step_tokens, self.budget_cap * 2)
        self.finish_step(plan, rc == NONFINITE)
        return T

    cdef out_of_memory(self, list plan, size_t T):
        """A forward without memory: its requests go back to waiting (they
        recompute, nothing lost) and steps shrink; a step of one token that
        still fails fails its request."""
        cdef Seq q
        if T <= 1:
            for q in plan:
                q.in_step = False
                self.fail(q, MemoryError("out of memory in the engine's forward"))
            return
        self.budget_cap = max(1, T // 2)
        for q in plan:
            q.in_step = False
            self.preempt(q)

    cdef finish_step(self, list plan, bint check_rows):
        """After the forward: accept drafts, choose tokens (in parallel, each
        with its own generator), account, publish, cache full blocks."""
        cdef Seq q
        cdef size_t n_jobs = 0, i, a, V = self.vocab
        cdef const float *row
        cdef list emits = []
        for q in plan:
            q.in_step = False
            row = self.work.logits + q.out_row * V
            if q.n_drafts:
                if check_rows and not all_finite_f(row, q.run_n * V):
                    self.fail(q, RuntimeError("non-finite logits"))
                    continue
                # the drafts the model itself chooses, then the token after them
                a = self.work.accept_drafts(q)
                self.spec_proposed += q.n_drafts
                self.spec_accepted += a
                for i in range(a + 1):
                    self.work.add_job(n_jobs, q, row + i * V,
                                      q.drafts[i] if i < a else <int64_t>argmax(row + a * V, V))
                    n_jobs += 1
                emits.append((q, a + 1))
            elif q.s.position + q.run_n == q.s.hist_len:
                if check_rows and not all_finite_f(row, V):
                    self.fail(q, RuntimeError("non-finite logits"))
                    continue
                q.s.position += q.run_n
                memcpy(q.s.logits, row, V * sizeof(float))
                q.s.have_logits = True
                if q.s.generated >= q.hold:   # held: choose when the count is raised
                    self.commit_blocks(q)
                    continue
                self.work.add_job(n_jobs, q, q.s.logits, -1)
                n_jobs += 1
                emits.append((q, 1))
            else:
                q.s.position += q.run_n
                self.commit_blocks(q)
        self.work.run_jobs(n_jobs)
        n_jobs = 0
        for q, count in emits:
            if q.followers and q.s.position == q.s.prompt_end:
                self.fork_followers(q)   # (before emit: the leader may finish at its first token)
            self.emit(q, n_jobs, count)
            n_jobs += count

    cdef emit(self, Seq q, size_t first_job, size_t count):
        """Account and publish the tokens jobs first_job.. chose for q."""
        cdef Job *job
        cdef size_t i, j
        tokens, lps, tops = [], [], []
        for i in range(count):
            job = &self.work.jobs[first_job + i]
            if job.token < 0:
                self.fail(q, MemoryError("cannot allocate sampler scratch"))
                return
            tokens.append(job.token)
            if q.want_lp:
                lps.append(job.lp)
                tops.append([(job.top_ids[j], job.top_lp[j]) for j in range(q.top_n)])
            core_account(&q.s, &q.p, job.token)
            if q.s.finish != RUNNING:
                break
        # every emitted token joins the history: accepted drafts have run,
        # the last one is pending (the next step runs it)
        for i in range(len(tokens)):
            q.s.history[q.s.hist_len] = tokens[i]
            q.s.hist_len += 1
        if q.s.position > q.s.hist_len:
            q.s.position = q.s.hist_len   # finished inside a verification block
        self.generated_total += len(tokens)
        self.commit_blocks(q)
        q.handle._publish(tokens, lps if q.want_lp else None, tops if q.want_lp else None)
        if q.s.finish != RUNNING:
            self.finish(q, None)

    cdef commit_blocks(self, Seq q):
        """Cache q's blocks that just became full (every position run), with
        the recurrent state after each (one of this step's snapshots)."""
        cdef size_t full, have, b
        if self.cache is None:
            return
        full = q.s.position // BLOCK
        have = len(q.keys)
        if full <= have:
            return
        q.keys.extend(self.block_keys(q, have, full - have))
        for b in range(have, full):
            snapshot = self.work.snapshot(q, (b + 1) * BLOCK) if self.stepper.state_floats else None
            self.cache.insert(q.keys[b], q.blocks[b] if self.pool is not None else -1, snapshot)

    cdef choose_held(self):
        """Requests that ran all their tokens while held (logits ready, no
        token chosen) and may go on now: choose their tokens first."""
        cdef Seq q
        cdef list ready = [x for x in self.active
                           if (<Seq>x).s.hist_len == (<Seq>x).s.position and (<Seq>x).s.have_logits
                           and (<Seq>x).s.generated < (<Seq>x).hold]
        cdef size_t i, n = len(ready)
        if not n:
            return
        self.work.reserve(0, 0, 0, 0, n)
        for i in range(n):
            self.work.add_job(i, ready[i], (<Seq>ready[i]).s.logits, -1)
        self.work.run_jobs(n)
        for i in range(n):
            self.emit(ready[i], i, 1)

    def arm_abort(self, int checks):
        """Testing hook (BatchSession._cancel_after): the abort flag trips at
        the checks-th cancellation point from now on."""
        if not cism_flag_get(&self.abort):
            cism_flag_set(&self.abort, -checks)

    @property
    def aborted(self):
        return bool(cism_flag_get(&self.abort))

    cdef cancel_everything(self):
        """After the abort flag: every request ends "cancelled"."""
        cdef Seq q
        for q in list(self.waiting) + list(self.active):
            if q.s.finish == RUNNING:
                q.s.finish = CANCEL
            self.finish(q, None)

    # ------------------------------------------------------------ endings ---

    cdef reap(self):
        """Cancelled requests leave before the step is planned."""
        cdef Seq q
        for q in [x for x in self.waiting + self.active if (<Seq>x).cancelled]:
            if q.s.finish == RUNNING:
                q.s.finish = CANCEL
            self.finish(q, None)

    cdef finish(self, Seq q, error):
        self.unlink(q)
        for f in list(q.followers):
            self.unlink(f)
        if q.phase == ACTIVE:
            self.active.remove(q)
        elif q.phase == WAITING and q in self.waiting:
            self.waiting.remove(q)
        self.release(q)
        q.phase = DONE
        self.by_id.pop(q.req_id, None)
        if error is not None:
            q.error = error
            reason = "error"
        else:
            reason = FINISH_NAMES[q.s.finish] or "cancelled"
        q.handle._finish(reason, error)

    cdef fail(self, Seq q, error):
        if q.s.finish == RUNNING:
            q.s.finish = CANCEL
        self.finish(q, error)

    # ----------------------------------------------------------- inspect ---

    def stats(self):
        out = {"steps": self.steps, "tokens_run": self.tokens_run,
               "generated_tokens": self.generated_total, "waiting": len(self.waiting),
               "running": len(self.active), "preemptions": self.preempted_total,
               "spec_proposed": self.spec_proposed, "spec_accepted": self.spec_accepted,
               "step_token_budget": self.budget_cap}
        if self.pool is not None:
            used, free_, total = self.pool.usage()
            out.update({"kv_blocks_total": total, "kv_blocks_used": self.pool.phys_used(),
                        "kv_blocks_free": free_})
        if self.cache is not None:
            out.update(self.cache.stats())
        else:
            out.update({"cached_blocks": 0, "prefix_hits": 0, "prefix_misses": 0,
                        "prefix_hit_tokens": 0, "prefix_hit_rate": 0.0})
        return out

    def check_invariants(self):
        """Raise AssertionError unless the pool's references are exactly the
        active requests' blocks plus the cache's (tests call it after every step)."""
        cdef Seq q
        if self.pool is None:
            return
        want = [0] * self.pool.num_blocks
        for q in self.active:
            assert q.phase == ACTIVE
            table = self.pool.get_blocks(q.req_id)
            assert table == q.block_table, f"request {q.req_id}: stale block table"
            assert len(table) * BLOCK >= q.s.position
            for b in table:
                want[b] += 1
        for q in self.waiting:
            assert q.phase == WAITING and not self.pool.contains(q.req_id)
        assert len(self.pool.table) == len(self.active), "the pool holds requests that are not active"
        cached = self.cache.cached_phys() if self.cache is not None else set()
        for b in cached:
            want[b] += 1
        for b in range(self.pool.num_blocks):
            assert self.pool.refcount(b) == want[b], \
                f"block {b}: refcount {self.pool.refcount(b)}, held {want[b]} times"
        free_ = self.pool.free_stack
        assert len(free_) == len(set(free_)), "a block is free twice"
        assert set(free_) == {b for b in range(self.pool.num_blocks) if want[b] == 0}
