# The serving engine's scheduler (cimport cism._scheduler): the queues of
# requests, the pool's blocks and the prefix cache, and who runs how many
# tokens in the next step. cism._engine.EngineCore derives from it.
from cism._prefix cimport PrefixCache
from cism._requests cimport Seq
from cism._step cimport Stepper


cdef class Scheduler:
    cdef readonly Stepper stepper
    cdef readonly object pool            # cism.paging.BlockPool, or None (no paged KV)
    cdef readonly PrefixCache cache      # or None
    cdef readonly size_t vocab, context, max_seqs, max_step_tokens, aging_steps
    cdef size_t budget_cap               # lowered after a step ran out of memory
    cdef readonly list waiting, active
    cdef readonly size_t preempted_total

    cdef void sync_blocks(self, Seq q)
    cdef release(self, Seq q)
    cdef bint make_room(self, size_t need, tuple above, list plan, Seq keep)
    cdef bint grow_to(self, Seq q, size_t length, list plan)
    cdef preempt(self, Seq q)
    cdef list block_keys(self, Seq q, size_t start, size_t count)
    cdef bint admit(self, Seq q, size_t budget, list plan)
    cdef size_t wanted(self, Seq q, size_t budget)
    cdef list schedule(self)
    cdef bint follows(self, Seq q)
    cdef unlink(self, Seq q)
    cdef fork_followers(self, Seq lead)
