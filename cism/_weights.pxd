# The base of every model class: the packed weights it keeps and the
# controls over their memory (cimport cism._weights).
from libc.stdint cimport uint64_t
from cism._kernels cimport cism_mat
from cism._layers cimport Rope


# What the C model struct of an attention family (dense, Surjo) starts with,
# as its member `base`: the sizes its forward reads, the two ends of the
# network, the rotary tables and the loop settings.
cdef struct ModelBase:
    size_t hidden, inter, layers, heads, kv_heads, head_dim, vocab, context, q_width, kv_width
    float eps
    cism_mat embed
    cism_mat head              # the embedding again when tied
    const float *final_norm
    Rope rope
    int threads
    bint act_q8

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
    cdef list rope_keep       # inv_freq and the rotary tables (not weights)

    # ---- the scaffold a family's constructor and classes build on ----
    # The constructor's preamble: the config's class, the precisions and the
    # threads checked and kept; returns the storages of (embedding and head,
    # the other linear layers, the MLP).
    cpdef tuple begin(self, config, config_class, precision, act_precision, threads, code_version)
    # check_weights against the shapes, and a tied head equal to the embedding
    cdef dict load_weights(self, weights, shapes, bint tied)
    # pack (or keep) a named matrix / vector; pointers into what the store keeps
    cdef cism_mat* mat(self, name, dict arrays, storage) except NULL
    cdef const float* vec(self, name, dict arrays) except NULL
    # a ModelBase's sizes, eps and threads from the config; its embedding,
    # head and final norm packed (the head at `storage` unless tied)
    cdef object fill_base(self, ModelBase *b, config)
    cdef object pack_ends(self, ModelBase *b, dict arrays, storage, bint tied)
    # rotary tables (ROPE_TABLE_MAX positions), kept by the store
    cdef object build_rope(self, Rope *r, theta, size_t head_dim, size_t context, divisors=*, scale=*)
    # (families define session_class() and stepper_class(): the solo session
    # and ragged-step classes the methods below use; see _weights.pyx)
