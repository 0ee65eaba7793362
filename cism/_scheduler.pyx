"""The serving engine's scheduler: who runs how many tokens in the next step.

Requests wait (queued, or preempted: holding nothing) or are active
(holding pool blocks and a recurrent state). Each step plans, in rank
order (priority, aged by arrival; cism._requests.Seq.rank), the active
requests' pending tokens (decode token and drafts first, then prompt
chunks) within the step's token budget, growing their block tables; when
the pool runs dry it evicts blocks only the prefix cache holds, then
preempts the lowest-ranked, newest request (it recomputes later, nothing
lost). Then it admits the best-ranked waiting request while there is room,
starting it after the longest cached prefix of its prompt. Requests with
one prompt (submit_n) wait for their leader's prefill and fork from it.

The lifecycle around it (adding, finishing, the step itself) is
cism._engine.EngineCore, which derives from this class.
"""
cimport numpy as cnp
from libc.stdint cimport int64_t
from libc.stdlib cimport malloc, calloc, free
from libc.string cimport memcpy

from cism._requests cimport ACTIVE, WAITING, Seq
from cism._step cimport Stepper
from cism.sampling cimport draft_tokens
from cism._prefix cimport PrefixCache, Entry

cnp.import_array()

DEF BLOCK = 16


cdef class Scheduler:
    """Queues, blocks, prefix cache and the plan of a step."""

    def __init__(self, Stepper stepper, pool, prefix_caching, size_t snapshot_budget,
                 size_t max_seqs, size_t max_step_tokens, size_t aging_steps):
        self.stepper = stepper
        self.pool = pool
        model = stepper.model
        self.vocab = stepper.vocab
        self.context = model.config.context
        self.max_seqs = max_seqs
        self.max_step_tokens = max_step_tokens
        self.budget_cap = max_step_tokens
        self.aging_steps = aging_steps
        self.cache = (PrefixCache(pool, model.compile_key, stepper.state_floats, snapshot_budget)
                      if prefix_caching else None)
        self.waiting = []
        self.active = []
        if pool is not None:
            stepper.set_pages(pool)

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

