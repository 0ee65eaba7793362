"""The family-neutral side of a ragged forward step (see _step.pxd)."""
import numpy as np

cimport numpy as cnp
from libc.stdlib cimport free

from cism._common cimport NOMEM

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
