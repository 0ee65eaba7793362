"""The serving engine's core: requests, the scheduler and the step.

A step is one forward over a ragged batch (cism._step): the decode token of
every running sequence (or its verification block, when it speculates),
then prompt chunks of sequences still prefilling, up to a per-step token
budget. After the forward every sequence whose pending tokens have all run
samples its next token. Tokens never depend on the rest of the step: each
sequence keeps its own generator, history and logits, and every row of the
forward has the bits a solo session computes for it.

This module is single-threaded: cism.engine.Engine runs it from one thread
(or lets a caller step it by hand) and carries requests in and tokens out.
"""
import numpy as np

cimport numpy as cnp
from cython.parallel cimport prange
from libc.stdint cimport int64_t, uint64_t
from libc.stdlib cimport malloc, calloc, free
from libc.string cimport memcmp, memcpy, memset

from cism._status cimport (OK, CANCELLED, NOMEM, NONFINITE, NONFINITE_SCORE, RUNNING, STOP, LENGTH, CANCEL,
                           cism_flag_get, cism_flag_set, cism_flag_check)
from cism._checks cimport Params, as_tokens, check_count, parse_params, params_eos, knobs_of, logits_copy
from cism._layers cimport all_finite_f, grow_f
from cism._session cimport SeqCore, core_alloc, core_free, core_account, MAX_K
from cism._requests cimport ACTIVE, DONE, MAX_TOP, WAITING, Job, Seq, run_job
from cism._step cimport Stepper, StepBatch, StepRun, forward_split_prompts
from cism.sampling cimport (cism_knobs, cism_mt64, cism_sampler, argmax, choose_token,
                            draft_tokens, token_logprobs)
from cism._prefix cimport PrefixCache, Entry

from cism._status import FINISH_NAMES
from cism.paging import OutOfBlocks

cnp.import_array()

DEF BLOCK = 16

cdef class EngineCore:
    """Requests, pool, prefix cache and the step. Not thread-safe: one
    thread at a time (cism.engine.Engine serialises)."""
    cdef readonly Stepper stepper
    cdef readonly object pool
    cdef readonly PrefixCache cache
    cdef readonly size_t vocab, context, max_seqs, max_step_tokens, aging_steps
    cdef size_t budget_cap               # lowered after a step ran out of memory
    cdef readonly list waiting, active
    cdef readonly dict by_id
    cdef long long next_arrival
    cdef int abort                       # cancels the forward in flight (shutdown)
    cdef int inject                      # tests: the next forward's result, without running it
    # step buffers
    cdef int64_t *tokens
    cdef StepRun *runs
    cdef float **snap
    cdef float *snap_mem
    cdef float *logits
    cdef Job *jobs
    cdef int64_t *top_ids
    cdef double *top_lp
    cdef size_t tokens_cap, runs_cap, snap_cap, logits_cap, jobs_cap, top_cap
    cdef int threads
    # counters
    cdef readonly size_t steps, tokens_run, generated_total, preempted_total
    cdef readonly size_t spec_proposed, spec_accepted

    def __cinit__(self):
        self.tokens = NULL
        self.runs = NULL
        self.snap = NULL
        self.snap_mem = NULL
        self.logits = NULL
        self.jobs = NULL
        self.top_ids = NULL
        self.top_lp = NULL

    def __init__(self, Stepper stepper, pool, prefix_caching, size_t snapshot_budget,
                 size_t max_seqs, size_t max_step_tokens, size_t aging_steps, int threads):
        self.stepper = stepper
        self.pool = pool
        model = stepper.model
        self.vocab = stepper.vocab
        self.context = model.config.context
        self.max_seqs = max_seqs
        self.max_step_tokens = max_step_tokens
        self.budget_cap = max_step_tokens
        self.aging_steps = aging_steps
        self.threads = threads
        self.cache = (PrefixCache(pool, model.compile_key, stepper.state_floats, snapshot_budget)
                      if prefix_caching else None)
        self.waiting = []
        self.active = []
        self.by_id = {}
        self.next_arrival = 0
        if pool is not None:
            stepper.set_pages(pool)

    def __dealloc__(self):
        free(self.tokens)
        free(self.runs)
        free(self.snap)
        free(self.snap_mem)
        free(self.logits)
        free(self.jobs)
        free(self.top_ids)
        free(self.top_lp)

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
        self.inject = {"nomem": NOMEM, "cancelled": CANCELLED, "nonfinite": NONFINITE}[name]

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

    # --------------------------------------------------------- resources ---

    cdef void sync_blocks(self, Seq q):
        blocks = self.pool.get_blocks(q.req_id)
        q.n_blocks = len(blocks)
        for i in range(q.n_blocks):
            q.blocks[i] = blocks[i]

    cdef release(self, Seq q):
        """Give back a request's blocks and state (finish, cancel, preemption)."""
        if self.pool is not None and self.pool.contains(q.req_id):
            blocks = self.pool.free(q.req_id)
            if self.cache is not None:
                self.cache.released(blocks)
        q.n_blocks = 0
        free(q.state)
        q.state = NULL

    cdef bint make_room(self, size_t need, tuple above, list plan, Seq keep):
        """Free blocks until `need` are free: evict cached blocks nobody
        uses, then preempt active requests ranked below `above` (lowest
        first; among equals the newest), never `keep`. Returns success."""
        cdef Seq victim, q
        while self.pool.free_count() < need:
            if self.cache is not None and self.cache.evict(need - self.pool.free_count()):
                continue
            victim = None
            for q in self.active:
                if q is keep or q.rank(self.aging_steps) >= above:
                    continue
                if victim is None or q.rank(self.aging_steps) < victim.rank(self.aging_steps):
                    victim = q
            if victim is None:
                return False
            if victim.in_step:
                plan.remove(victim)
                victim.in_step = False
            self.preempt(victim)
        return True

    cdef bint grow_to(self, Seq q, size_t length, list plan):
        """Blocks for `length` positions of an active request."""
        if self.pool is None:
            return True
        need = (length + BLOCK - 1) // BLOCK - q.n_blocks
        if need <= 0:
            return True
        if need > self.pool.free_count():
            if not self.make_room(need, q.rank(self.aging_steps), plan, q):
                return False
        self.pool.ensure(q.req_id, length)
        self.sync_blocks(q)
        return True

    cdef preempt(self, Seq q):
        """Back to waiting with every token kept; it recomputes when readmitted."""
        self.release(q)
        self.active.remove(q)
        q.recomputed_tokens += q.s.position
        q.s.position = 0
        q.keys = []
        q.phase = WAITING
        q.preemptions += 1
        self.preempted_total += 1
        self.waiting.append(q)

    cdef list block_keys(self, Seq q, size_t start, size_t count):
        """Prefix-cache keys of q's full blocks start..start+count-1."""
        cdef list keys = []
        cdef bytes prev = q.keys[start - 1] if start > 0 else self.cache.root
        cdef size_t b, pos, n_bf16
        for b in range(start, start + count):
            n_bf16 = 0
            if self.stepper.bf16_prompts:
                pos = b * BLOCK
                n_bf16 = min(<size_t>BLOCK, q.s.prompt_end - pos) if q.s.prompt_end > pos else 0
            prev = PrefixCache.next_key(prev, (<char*>(q.s.history + b * BLOCK))[:BLOCK * sizeof(int64_t)],
                                        n_bf16)
            keys.append(prev)
        return keys

    cdef bint admit(self, Seq q, size_t budget, list plan):
        """Blocks (reusing cached ones) and state for a waiting request's
        first chunk; on failure it stays waiting, holding nothing."""
        cdef Entry e
        cdef list found = []
        cdef cnp.ndarray snap
        cdef size_t full, want
        snapshot = None
        if self.cache is not None:
            full = (q.s.hist_len - 1) // BLOCK   # the last token always runs: its logits
            keys = self.block_keys(q, 0, full)
            found, snapshot = self.cache.lookup(keys)
        if self.stepper.state_floats:
            q.state = <float*>calloc(self.stepper.state_floats + 16, sizeof(float))
            if q.state == NULL:
                raise MemoryError("cannot allocate a recurrent state")
            if snapshot is not None:
                snap = snapshot
                memcpy(q.state, cnp.PyArray_DATA(snap), self.stepper.state_floats * sizeof(float))
        if self.pool is not None:
            self.pool.allocate(q.req_id, 0)
            for e in found:
                self.pool.share_block(q.req_id, e.phys)
            self.cache.claimed(found) if self.cache is not None else None
            self.sync_blocks(q)
        q.s.position = BLOCK * len(found)
        q.keys = [e.key for e in found]
        want = self.wanted(q, budget)
        q.phase = ACTIVE
        self.active.append(q)
        self.waiting.remove(q)
        if not self.grow_to(q, q.s.position + want, plan):
            # undo: back to waiting, as it was
            self.active.remove(q)
            self.waiting.append(q)
            q.phase = WAITING
            self.release(q)
            q.s.position = 0
            q.keys = []
            return False
        q.cached_tokens += q.s.position
        q.run_n = want
        return True

    # ---------------------------------------------------------- schedule ---

    cdef size_t wanted(self, Seq q, size_t budget):
        """Tokens q runs this step within `budget`: the pending ones (prompt
        chunks, recompute), or its decode token and drafts."""
        cdef size_t pending = q.s.hist_len - q.s.position, k, room
        q.n_drafts = 0
        if budget == 0 or pending == 0:
            return 0
        if pending > 1 or q.spec_k == 0:
            return pending if pending < budget else budget
        # one pending token: the last one chosen; drafts ride along (greedy)
        room = min(q.s.max_new, q.hold) - q.s.generated   # emits at most room: accepted drafts + one more
        k = q.spec_k
        if k + 1 > room:
            k = room - 1 if room else 0
        if k > budget - 1:
            k = budget - 1
        if k >= 1:
            q.n_drafts = draft_tokens(q.s.history, q.s.hist_len, k, q.drafts)
        return 1 + q.n_drafts

    cdef list schedule(self):
        cdef list plan = []
        cdef Seq q
        cdef size_t budget = self.budget_cap, want
        cdef size_t aging = self.aging_steps
        order = sorted(self.active, key=lambda s: s.rank(aging), reverse=True)
        for q in order:
            if q.phase != ACTIVE:
                continue   # preempted for someone ranked above it
            want = self.wanted(q, budget)
            if want == 0:
                continue
            if not self.grow_to(q, q.s.position + want, plan):
                self.preempt(q)
                continue
            q.run_n = want
            q.in_step = True
            plan.append(q)
            budget -= want
        # admission: best-ranked first, while there is room (a follower
        # waits while its leader prefills: it forks from it afterwards)
        while len(self.active) < self.max_seqs and budget > 0:
            candidates = [x for x in self.waiting if not self.follows(x)]
            if not candidates:
                break
            q = max(candidates, key=lambda s: s.rank(aging))
            if not self.admit(q, budget, plan):
                break   # no skipping ahead of it: it would wait forever behind smaller ones
            q.in_step = True
            plan.append(q)
            # (admission may have preempted planned requests ranked below it)
            budget = self.budget_cap - sum((<Seq>x).run_n for x in plan)
        return plan

    cdef bint follows(self, Seq q):
        """Whether q still waits for its leader's prefill (the link is dropped
        once the leader cannot lead any more)."""
        cdef Seq lead = q.leader
        if lead is None:
            return False
        if lead.phase == ACTIVE and lead.s.position < lead.s.prompt_end:
            return True
        if lead.phase == WAITING and lead.s.position == 0 and lead.s.hist_len == lead.s.prompt_end:
            return True   # not admitted yet, its prompt untouched
        self.unlink(q)
        return False

    cdef unlink(self, Seq q):
        if q.leader is not None:
            if q in q.leader.followers:
                q.leader.followers.remove(q)
            q.leader = None

    cdef fork_followers(self, Seq lead):
        """Right after lead's prompt ran: its waiting followers start from
        its blocks (full ones shared, the tail copied), logits and state,
        as far as there is room; the others are admitted as usual later."""
        cdef Seq f
        cdef size_t S = self.stepper.state_floats
        for f in list(lead.followers):
            self.unlink(f)
            if f.phase != WAITING or f.cancelled or len(self.active) >= self.max_seqs:
                continue
            if self.pool is not None:
                if lead.s.prompt_end % BLOCK and self.pool.free_count() == 0:
                    if self.cache is None or not self.cache.evict(1):
                        continue
                self.pool.fork(f.req_id, lead.req_id, lead.s.prompt_end)
                self.sync_blocks(f)
            if S:
                f.state = <float*>malloc((S + 16) * sizeof(float))
                if f.state == NULL:
                    self.release(f)
                    continue
                memcpy(f.state, lead.state, S * sizeof(float))
            f.s.position = lead.s.prompt_end
            memcpy(f.s.logits, lead.s.logits, self.vocab * sizeof(float))
            f.s.have_logits = True
            f.keys = list(lead.keys[:lead.s.prompt_end // BLOCK])
            f.cached_tokens += lead.s.prompt_end
            f.phase = ACTIVE
            self.waiting.remove(f)
            self.active.append(f)

    # -------------------------------------------------------------- step ---

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
        if snaps * self.stepper.state_floats > self.snap_cap:
            self.snap_cap = 0
            if grow_f(&self.snap_mem, snaps * self.stepper.state_floats):
                raise MemoryError("cannot allocate the step's state snapshots")
            self.snap_cap = snaps * self.stepper.state_floats
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

    def step(self):
        """One step: reap cancelled requests, schedule, one forward, choose
        tokens. Returns the number of tokens the forward ran (0: idle)."""
        cdef Seq q
        cdef list plan
        cdef size_t T = 0, rows = 0, n_snaps = 0, i, r, pos, g
        cdef size_t S = self.stepper.state_floats
        cdef int rc
        if cism_flag_check(&self.abort):
            self.cancel_everything()
            return 0
        self.reap()
        self.choose_held()
        plan = self.schedule()
        if not plan:
            return 0
        # lay out the step: the tokens of each run, its logits rows, its snapshots
        for q in plan:
            T += q.run_n
            if q.s.position + q.run_n == q.s.hist_len or q.n_drafts:
                rows += q.run_n if q.n_drafts else 1
            if S:
                n_snaps += q.run_n if q.n_drafts else self.boundaries(q)
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
                    if q.n_drafts or (self.cache is not None and pos % BLOCK == 0):
                        self.snap[T + i] = self.snap_mem + n_snaps * S
                        n_snaps += 1
                    else:
                        self.snap[T + i] = NULL
            T += q.run_n
        if self.inject == NONFINITE:   # tests: the step's first logits row turns NaN
            self.inject = 0
            rc = self.run_forward(plan, T)
            if rows and (rc == OK or rc == NONFINITE):
                self.logits[0] = float("nan")
                rc = NONFINITE
        elif self.inject:
            rc = self.inject
            self.inject = 0
        else:
            rc = self.run_forward(plan, T)
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

    cdef size_t boundaries(self, Seq q):
        """Block boundaries q's run crosses (a snapshot after each, for the cache)."""
        if self.cache is None:
            return 0
        return (q.s.position + q.run_n) // BLOCK - q.s.position // BLOCK

    cdef int run_forward(self, list plan, size_t T) except? -9:
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
        b.snap = self.snap if self.stepper.state_floats else NULL
        b.logits = self.logits
        b.prompt = False
        b.cancel = &self.abort
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
        cdef size_t n_jobs = 0, i, a, V = self.vocab, S = self.stepper.state_floats
        cdef const float *row
        cdef list emits = []
        cdef int nt = self.threads
        for q in plan:
            q.in_step = False
            row = self.logits + q.out_row * V
            if q.n_drafts:
                if check_rows and not all_finite_f(row, q.run_n * V):
                    self.fail(q, RuntimeError("non-finite logits"))
                    continue
                # the drafts the model itself chooses, then the token after them
                a = 0
                while a < q.n_drafts and <int64_t>argmax(row + a * V, V) == q.drafts[a]:
                    a += 1
                self.spec_proposed += q.n_drafts
                self.spec_accepted += a
                q.s.position += 1 + a
                if S and a < q.n_drafts:   # back to the state after the accepted tokens
                    memcpy(q.state, self.snap_mem + (q.snap_first + a) * S, S * sizeof(float))
                memcpy(q.s.logits, row + a * V, V * sizeof(float))
                q.s.have_logits = True
                for i in range(a + 1):
                    self.add_job(n_jobs, q, row + i * V,
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
                self.add_job(n_jobs, q, q.s.logits, -1)
                n_jobs += 1
                emits.append((q, 1))
            else:
                q.s.position += q.run_n
                self.commit_blocks(q)
        with nogil:
            for i in prange(n_jobs, num_threads=nt if n_jobs > 1 else 1, schedule='dynamic'):
                run_job(&self.jobs[i])
        n_jobs = 0
        for q, count in emits:
            if q.followers and q.s.position == q.s.prompt_end:
                self.fork_followers(q)   # (before emit: the leader may finish at its first token)
            self.emit(q, n_jobs, count)
            n_jobs += count

    cdef void add_job(self, size_t i, Seq q, const float *row, int64_t token):
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

    cdef emit(self, Seq q, size_t first_job, size_t count):
        """Account and publish the tokens jobs first_job.. chose for q."""
        cdef Job *job
        cdef size_t i, j
        tokens, lps, tops = [], [], []
        for i in range(count):
            job = &self.jobs[first_job + i]
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
        cdef size_t full, have, b, S = self.stepper.state_floats, idx
        cdef cnp.ndarray snap
        if self.cache is None:
            return
        full = q.s.position // BLOCK
        have = len(q.keys)
        if full <= have:
            return
        q.keys.extend(self.block_keys(q, have, full - have))
        for b in range(have, full):
            snapshot = None
            if S:
                idx = self.snap_index(q, (b + 1) * BLOCK)
                if idx != <size_t>-1:
                    snapshot = np.empty(S, np.float32)
                    snap = snapshot
                    memcpy(cnp.PyArray_DATA(snap), self.snap_mem + idx * S, S * sizeof(float))
            self.cache.insert(q.keys[b], q.blocks[b] if self.pool is not None else -1, snapshot)

    cdef size_t snap_index(self, Seq q, size_t boundary):
        """Which of this step's snapshots holds q's state at position
        `boundary`, or -1 (a verification block keeps one after every
        token, other runs one at each block boundary)."""
        if boundary <= q.run_pos or boundary > q.run_pos + q.run_n:
            return <size_t>-1
        if q.n_drafts:
            return q.snap_first + (boundary - q.run_pos - 1)
        return q.snap_first + (boundary // BLOCK - (q.run_pos // BLOCK + 1))

    cdef choose_held(self):
        """Requests that ran all their tokens while held (logits ready, no
        token chosen) and may go on now: choose their tokens first."""
        cdef Seq q
        cdef list ready = [x for x in self.active
                           if (<Seq>x).s.hist_len == (<Seq>x).s.position and (<Seq>x).s.have_logits
                           and (<Seq>x).s.generated < (<Seq>x).hold]
        cdef size_t i, n = len(ready)
        cdef int nt = self.threads
        if not n:
            return
        self.reserve(0, 0, 0, 0, n)
        for i in range(n):
            self.add_job(i, ready[i], (<Seq>ready[i]).s.logits, -1)
        with nogil:
            for i in prange(n, num_threads=nt if n > 1 else 1, schedule='dynamic'):
                run_job(&self.jobs[i])
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
