"""Automatic prefix caching for the serving engine (cism.Engine).

A full block of 16 positions is keyed by a hash of the previous block's
key, its 16 tokens, how many of them ran at the bf16 prefill precision (0
unless the model prefills in bf16), and the model's compile key: equal keys
mean bit-identical keys and values, because a position's cache depends only
on the tokens up to it. An entry holds

- the block (attention families): one reference in the BlockPool, so the
  block outlives the request that computed it, and
- a snapshot of the recurrent state after the block (Surjo, FWKV), so a
  recurrent model resumes after a cached prefix without running it.

A request reuses the longest chain of cached entries along its tokens (for
recurrent models, up to the last entry with a snapshot). Blocks that only
the cache holds stay until the pool needs them, then go least recently used
first; a chain's later blocks are marked older than its earlier ones, so a
chain is cut from its tail. Snapshots live within a byte budget, also LRU.
"""
import hashlib
from collections import OrderedDict

import numpy as np

BLOCK = 16


cdef class Entry:
    def __init__(self, key, phys, snap):
        self.key = key
        self.phys = phys
        self.snap = snap


cdef class PrefixCache:
    """Entries by key, the pool references they hold, and LRU order."""

    def __init__(self, pool, compile_key, size_t state_floats, size_t snapshot_budget):
        self.pool = pool
        self.state_floats = state_floats
        self.snapshot_budget = snapshot_budget
        self.snapshot_bytes = 0
        self.root = hashlib.blake2b(str(compile_key).encode(), digest_size=16).digest()
        self.entries = {}
        self.by_phys = {}
        self.evictable = OrderedDict()
        self.snaps = OrderedDict()

    @staticmethod
    def next_key(bytes prev, bytes tokens, int n_bf16):
        """The key of a block after the block keyed prev (tokens: 16 int64)."""
        return hashlib.blake2b(prev + tokens + bytes((n_bf16,)), digest_size=16).digest()

    # ---- lookup ----

    def lookup(self, list keys):
        """The longest usable chain for a request's block keys (computed by
        the caller, at most one per full block it may reuse): returns
        (entries, snapshot or None). Counts the lookup."""
        cdef list found = []
        cdef Entry e
        cdef size_t usable = 0
        need_block = self.pool is not None
        need_snap = self.state_floats > 0
        for key in keys:
            e = self.entries.get(key)
            if e is None or (need_block and e.phys < 0):
                break
            found.append(e)
            if not need_snap or e.snap is not None:
                usable = len(found)
        found = found[:usable]
        self.lookups += 1
        self.queried_tokens += BLOCK * len(keys)
        if found:
            self.hits += 1
            self.hit_tokens += BLOCK * len(found)
            # most recent use; the chain's tail older than its head
            for e in reversed(found):
                if e.snap is not None:
                    self.snaps.move_to_end(e.key)
        return found, (found[len(found) - 1].snap if found and need_snap else None)

    def holds(self, long long phys):
        """Whether a block is held by the cache (one of its references)."""
        return phys in self.by_phys

    # ---- insertion and release ----

    def insert(self, bytes key, long long phys, snap):
        """Cache a full block computed by a live request (phys: its block,
        which gains the cache's reference; snap: the state after it, copied).
        A key already cached keeps its entry."""
        cdef Entry e = self.entries.get(key)
        if e is not None:
            if e.snap is None and snap is not None and self.state_floats:
                self._add_snap(e, snap)
            return
        if self.pool is not None and phys >= 0:
            if phys in self.by_phys:
                return  # the block already backs another key (cannot happen with exact keys)
            self.pool.retain_block(phys)
            self.by_phys[phys] = key
        else:
            phys = -1
        e = Entry(key, phys, None)
        self.entries[key] = e
        if snap is not None and self.state_floats:
            self._add_snap(e, snap)

    cdef _add_snap(self, Entry e, snap):
        cdef size_t nbytes = 4 * self.state_floats
        if nbytes > self.snapshot_budget:
            return
        while self.snapshot_bytes + nbytes > self.snapshot_budget and self.snaps:
            self._drop_snap(next(iter(self.snaps)))
        e.snap = np.array(snap, dtype=np.float32, copy=True)
        self.snaps[e.key] = None
        self.snapshot_bytes += nbytes

    cdef _drop_snap(self, bytes key):
        cdef Entry e = self.entries[key]
        del self.snaps[key]
        e.snap = None
        self.snapshot_bytes -= 4 * self.state_floats
        if e.phys < 0:
            del self.entries[key]   # nothing left in it

    def released(self, list blocks):
        """A request let go of its blocks (finish, cancel, preemption): the
        cached ones only the cache now holds become evictable, the last
        block first in line."""
        for phys in reversed(blocks):
            if phys in self.by_phys and self.pool.refcount(phys) == 1:
                self.evictable[phys] = None
                self.evictable.move_to_end(phys)

    def claimed(self, list entries):
        """Entries reused by a request (which took references to their blocks)."""
        cdef Entry e
        for e in entries:
            if e.phys >= 0:
                self.evictable.pop(e.phys, None)

    # ---- pressure ----

    def evict(self, size_t n):
        """Free up to n blocks that only the cache holds, least recently
        used first; returns how many were freed."""
        cdef size_t done = 0
        cdef Entry e
        while done < n and self.evictable:
            phys, _ = self.evictable.popitem(last=False)
            key = self.by_phys.pop(phys)
            e = self.entries.pop(key)
            if e.snap is not None:
                del self.snaps[key]
                self.snapshot_bytes -= 4 * self.state_floats
            self.pool.release_block(phys)
            done += 1
        self.evicted_blocks += done
        return done

    def evictable_count(self):
        return len(self.evictable)

    def clear(self):
        """Drop every entry (the blocks only the cache holds go back to the pool)."""
        for phys in list(self.by_phys):
            self.pool.release_block(phys)
        self.entries.clear()
        self.by_phys.clear()
        self.evictable.clear()
        self.snaps.clear()
        self.snapshot_bytes = 0

    # ---- inspection ----

    @property
    def cached_blocks(self):
        return len(self.by_phys)

    @property
    def entry_count(self):
        return len(self.entries)

    def cached_phys(self):
        return set(self.by_phys)

    def stats(self):
        return {"prefix_lookups": self.lookups, "prefix_hits": self.hits,
                "prefix_misses": self.lookups - self.hits,
                "prefix_queried_tokens": self.queried_tokens, "prefix_hit_tokens": self.hit_tokens,
                "prefix_hit_rate": (<double>self.hit_tokens / self.queried_tokens) if self.queried_tokens else 0.0,
                "cached_blocks": len(self.by_phys), "cached_entries": len(self.entries),
                "evictable_blocks": len(self.evictable), "evicted_blocks": self.evicted_blocks,
                "snapshot_bytes": self.snapshot_bytes}
