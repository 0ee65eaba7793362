"""The read-bandwidth probe behind cism.bench's rooflines: a buffer well
above the last-level cache read by OpenMP threads as interleaved streams
(csrc/memscan.h, the reader Model.scan uses on the weights)."""
import time

import numpy as np

cimport numpy as cnp
from cython.parallel cimport prange
from libc.stdint cimport uint64_t

cnp.import_array()

cdef extern from "memscan.h" nogil:
    uint64_t cism_scan_regions(const size_t *addr, const size_t *size, size_t count,
                               size_t begin, size_t end, size_t streams)


def read_bandwidth(nbytes=1 << 31, threads=None, repeats=5, streams=8):
    """Best-of-``repeats`` read bandwidth in bytes/s over a buffer of
    ``nbytes`` (well above the last-level cache), each thread reading its
    share as ``streams`` interleaved streams."""
    from cism._threads import resolve_threads
    cdef int nt = resolve_threads(threads)
    buf = np.ones(int(nbytes) // 8, dtype=np.uint64)
    cdef size_t addr = <size_t>cnp.PyArray_DATA(buf)
    cdef size_t n = buf.nbytes, part = n // nt, t
    cdef size_t ns = streams
    cdef uint64_t sink = 0
    best = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        with nogil:
            for t in prange(nt, num_threads=nt, schedule='static'):
                sink += cism_scan_regions(&addr, &n, 1, t * part, (t + 1) * part, ns)
        best = max(best, (part * nt) / (time.perf_counter() - start))
    if sink == 1:  # keep the reads
        print("", end="")
    return best
