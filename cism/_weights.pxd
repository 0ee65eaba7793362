# The base of every model class: the packed weights it keeps and the
# controls over their memory (cimport cism._weights).
from libc.stdint cimport uint64_t

cdef class WeightStore:
    cdef readonly object config
    cdef str precision_
    cdef str compile_key_
    cdef str code_version
    cdef int threads_
    cdef bint act_q8_
    cdef str prefill_precision_   # "exact" or "bf16" (dense models; see set_prefill_precision)
    cdef str kv_precision_        # "fp32" or "fp16" (dense and Surjo models; fixed at construction)
    cdef public object source  # the Checkpoint a model was loaded from, if any
    cdef list keep            # Matrix objects and norm/vector arrays the C pointers point into
    cdef dict matrices        # HF name -> Matrix
    cdef dict storages_       # precision "auto": HF name -> the storage the loader chose
    cdef size_t weight_bytes_
    cdef bint pages_locked_
    cdef object lock_         # guards page locking (and, in subclasses, shared state)
    cdef uint64_t sink_
    cdef int scan_threads     # threads scan() uses
    cdef list mapped_files_   # the mapping.FileMaps that mapped matrices point into
    cdef dict map_notes_      # HF name -> None (mapped from its file) or why it was copied (mmap=True loads)
    cdef object add_matrix(self, name, values, storage, int threads)
    cdef object add_any_matrix(self, name, value, storage, int threads)
    cdef object add_vector(self, name, values)
    # a GGUF tensor's Q4_K / Q6_K blocks kept as they are (Matrix.from_ggml)
    cdef object add_ggml_matrix(self, name, type_id, raw, rows, cols, int threads)
    # copy act_q8_ into the family's C model struct (called by set_act_precision)
    cdef void apply_act_precision(self)
    cdef object update_key(self)
    # CheckpointError when a mapped file changed since the load (each forward call's first step)
    cdef object check_mapped(self)
