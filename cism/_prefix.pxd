# The engine's automatic prefix cache (cimport cism._prefix); see _prefix.pyx.

cdef class Entry:
    cdef readonly bytes key
    cdef readonly long long phys      # the pool block, or -1
    cdef public object snap           # float32 state after the block, or None


cdef class PrefixCache:
    cdef object pool                  # BlockPool or None (FWKV: snapshots only)
    cdef readonly size_t state_floats
    cdef readonly size_t snapshot_budget
    cdef readonly size_t snapshot_bytes
    cdef readonly bytes root
    cdef dict entries                 # key -> Entry
    cdef dict by_phys                 # phys -> key
    cdef object evictable             # OrderedDict phys -> None: blocks only the cache holds, LRU first
    cdef object snaps                 # OrderedDict key -> None: entries with snapshots, LRU first
    cdef readonly size_t lookups, hits, queried_tokens, hit_tokens, evicted_blocks

    cdef _add_snap(self, Entry e, snap)
    cdef _drop_snap(self, bytes key)
