"""What every model class shares: keeping packed weights and controlling
their memory (lock_pages, unlock_pages, touch, scan), the load-time checks
of one weight tensor, and the scaffold a family builds on: the
constructor's preamble, rotary tables, and the session and evaluation
methods (create_session, logits, nll, logits_all) over the family's
session class."""
import hashlib
import threading

import numpy as np

cimport numpy as cnp
from cython.parallel cimport prange
from libc.math cimport cosf, isfinite, powf, sinf
from libc.stdint cimport uint32_t, uint64_t
from libc.stdlib cimport free, malloc
from posix.mman cimport mlock, munlock

from cism._kernels cimport cism_mat
from cism._layers cimport ROPE_TABLE_MAX, Rope
from cism.matrix cimport ACT_FP32, ACT_Q8, Matrix

from cism import _kernels
from cism._threads import resolve_threads

cnp.import_array()

cdef extern from "memscan.h" nogil:
    uint64_t cism_touch(const void *p, size_t n)
    uint64_t cism_scan_regions(const size_t *addr, const size_t *size, size_t count,
                               size_t begin, size_t end, size_t streams)


PRECISIONS = ("fp32", "fp16", "int8", "hybrid-int4", "hybrid-fp4", "int4", "fp4")

# The embedding/head storage of the all-4-bit precisions: 4-bit too. An int8
# embedding/head would cut SmolLM2's KL against fp32 by 0.12 (int4 0.40 ->
# 0.29, fp4 0.35 -> 0.24) and add 16-20% to Qwen3-0.6B's bytes per token
# (int4 373 -> 432 MB, fp4 336 -> 404 MB), the same trade as the step from
# the hybrids; the 4-bit head is what makes these precisions the smallest
# (docs/VALIDATION.md).
EMBED_HEAD_4BIT = {"int4": "int4", "fp4": "fp4"}


# Floats per row block when a lazy matrix is packed (add_any_matrix): the
# transient of a load, against the packed weights it builds (a Llama 3
# embedding is 1.6 GB as float32; 8 MiB keeps the load's peak near the
# packed size while each block still spans many of pack's 256-row chunks).
PACK_BLOCK_BYTES = 8 << 20


def check_kv_precision(value):
    """The KV cache precisions: fp32, or fp16 (keys and values rounded to
    binary16 when stored; dense and Surjo models)."""
    if value not in ("fp32", "fp16"):
        raise ValueError(f"kv_precision must be fp32 or fp16, got {value!r}")


def check_precisions(precision, act_precision):
    """The spec's precision names; returns the storages of (embedding and
    head, the other linear layers, the MLP): hybrids keep attention,
    embedding and head at int8 and put the MLP at 4 bits; int4 and fp4 put
    every linear layer at 4 bits and the embedding/head at EMBED_HEAD_4BIT."""
    if precision not in PRECISIONS:
        raise ValueError("precision must be fp32, fp16, int8, hybrid-int4, hybrid-fp4, int4, or fp4, "
                         f"got {precision!r}")
    if act_precision not in ("fp32", "int8"):
        raise ValueError(f"act_precision must be fp32 or int8, got {act_precision!r}")
    if precision in ("int4", "fp4"):
        return EMBED_HEAD_4BIT[precision], precision, precision
    protected = {"fp32": "fp32", "fp16": "fp16"}.get(precision, "int8")
    return protected, protected, {"hybrid-int4": "int4", "hybrid-fp4": "fp4"}.get(precision, protected)


def check_weights(weights, shapes):
    """Exactly the expected tensors, each of its shape and finite; returns
    name -> float32 array (the spec's messages, naming the tensors)."""
    if not hasattr(weights, "keys") or not hasattr(weights, "__getitem__"):
        raise ValueError("weights must be a mapping of tensor names to float arrays")
    names = set(weights.keys())
    unexpected = sorted(names - set(shapes))
    missing = sorted(set(shapes) - names)
    if unexpected or missing:
        parts = []
        if missing:
            parts.append("missing " + ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else ""))
        if unexpected:
            parts.append("unexpected " + ", ".join(unexpected[:5]) + (" ..." if len(unexpected) > 5 else ""))
        raise ValueError("unexpected or missing weights: " + "; ".join(parts))
    return {name: weight_array(weights[name], name, shape) for name, shape in shapes.items()}


def check_storages(storages, precision):
    """precision "auto"'s map of HF name -> storage (matrix.STORAGES names),
    checked; an empty dict for every other precision."""
    from cism.matrix import STORAGES
    if storages is None:
        return {}
    if precision != "auto":
        raise ValueError(f"storages are for precision 'auto', not {precision!r}")
    if not isinstance(storages, dict):
        raise ValueError(f"storages must be a dict of tensor name -> storage, got {type(storages).__name__}")
    for name, storage in storages.items():
        if storage not in STORAGES:
            raise ValueError(f"storage {storage!r} of {name} is not one of {', '.join(STORAGES)}")
    return dict(storages)


def is_lazy(value):
    """Whether a weight is a lazy tensor (cism.loaders.lazy: ``shape``,
    ``load``, ``load_rows``; read from its file when the model packs it)."""
    from cism.loaders.lazy import FileTensor
    return isinstance(value, FileTensor)


def load_float(value, name, threads=1):
    """A weight as float32: a lazy tensor is read now and checked finite
    (the spec's message naming the tensor); an array, checked already by
    check_weights, is returned as it is."""
    if not is_lazy(value):
        return value
    a = value.load(threads)
    if not all_finite(a):
        raise ValueError(f"non-finite weight: {name}")
    return a


def weight_array(value, name, shape):
    """A float tensor of the expected shape as C-contiguous finite float32,
    else ValueError with the spec's message naming the tensor. A lazy
    tensor is checked for shape here and for finite values when the model
    reads it (add_any_matrix, add_vector, load_float)."""
    if is_lazy(value):
        if tuple(value.shape) != tuple(shape):
            raise ValueError(f"missing or incorrectly sized weight: {name} "
                             f"(expected shape {tuple(shape)}, got {tuple(value.shape)})")
        return value
    if not isinstance(value, np.ndarray):
        raise ValueError(f"weight {name} must be a numpy array, got {type(value).__name__}")
    if value.dtype.kind != "f":
        raise ValueError(f"weight {name} must be a float array, got dtype {value.dtype}")
    if tuple(value.shape) != tuple(shape):
        raise ValueError(f"missing or incorrectly sized weight: {name} "
                         f"(expected shape {tuple(shape)}, got {tuple(value.shape)})")
    a = np.ascontiguousarray(value, dtype=np.float32)
    if not all_finite(a):
        raise ValueError(f"non-finite weight: {name}")
    return a


def all_finite(a):
    """Whether a C-contiguous float32 array holds no inf or nan: one pass over
    its bits with the GIL released and nothing allocated (np.isfinite(a).all()
    would build a boolean copy of the whole tensor first)."""
    cdef const uint32_t[::1] bits = a.reshape(-1).view(np.uint32)
    cdef size_t n = bits.shape[0], i
    cdef uint32_t bad = 0
    if n == 0:
        return True
    with nogil:
        for i in range(n):   # the exponent all ones: inf or nan
            bad |= (bits[i] & 0x7f800000u) == 0x7f800000u
    return bad == 0


def rope_tables(theta, size_t head_dim, size_t context, size_t max_positions=32768, divisors=None,
                scale=1.0):
    """Rotary tables: inv_freq[j] = 1 / theta^(2j/d) in float (divided by
    divisors[j] when the model scales its rope: linear, llama3, yarn, a
    GGUF's rope_freqs), and scale * cos/sin of position * inv_freq[j] for
    the first min(context, max_positions) positions (later positions use the
    same formula on the fly). scale is YaRN's attention factor, else 1 (an
    exact multiply: plain tables keep their bits)."""
    cdef size_t half = head_dim // 2, p, j
    cdef float th = <float>theta
    inv = np.empty(half, np.float32)
    cdef float[::1] iv = inv
    cdef float[::1] dv
    if divisors is not None:
        dv = np.ascontiguousarray(divisors, np.float32)
        if dv.shape[0] != half:
            raise ValueError(f"{dv.shape[0]} rope divisors for {half} rotary frequencies")
    for j in range(half):
        iv[j] = 1.0 / powf(th, <float>(2 * j) / <float>head_dim)
        if divisors is not None:
            iv[j] = iv[j] / dv[j]
        if not isfinite(iv[j]) or not isfinite(iv[j] * <float>(context - 1)):
            raise ValueError("rope_theta produces non-finite FP32 rotary angles")
    positions = min(context, max_positions)
    cos_t = np.empty((positions, half), np.float32)
    sin_t = np.empty((positions, half), np.float32)
    cdef float[:, ::1] ct = cos_t
    cdef float[:, ::1] st = sin_t
    cdef float angle, sc = <float>scale
    if not (isfinite(sc) and sc > 0):
        raise ValueError(f"rope attention factor must be a positive number, got {scale!r}")
    with nogil:
        for p in range(positions):
            for j in range(half):
                angle = <float>p * iv[j]
                ct[p, j] = cosf(angle) * sc
                st[p, j] = sinf(angle) * sc
    return inv, cos_t, sin_t


cdef class WeightStore:
    """Packed weights of a model, the model-wide settings (precision,
    activation precision, threads, compile key) and the controls over the
    weights' memory. The model families derive from it."""

    def __cinit__(self, *args, **kwargs):
        self.keep = []
        self.matrices = {}
        self.weight_bytes_ = 0
        self.lock_ = threading.Lock()
        self.scan_threads = 1
        self.threads_ = 1
        self.source = None
        self.code_version = "cism-1"
        self.prefill_precision_ = "exact"
        self.kv_precision_ = "fp32"
        self.storages_ = {}
        self.mapped_files_ = []
        self.map_notes_ = {}

    cdef void apply_act_precision(self):
        pass

    # ---- the family scaffold ----

    cpdef tuple begin(self, config, config_class, precision, act_precision, threads, code_version):
        """The constructor's preamble (callable from a Python family too):
        config of config_class, precisions checked, threads resolved and
        kept with the code version; returns the (embedding and head, other
        linear layers, MLP) storages of check_precisions."""
        if not isinstance(config, config_class):
            raise ValueError(f"config must be a {config_class.__module__}.Config, got {type(config).__name__}")
        storages = check_precisions(precision, act_precision)
        self.config = config
        self.precision_ = precision
        self.threads_ = resolve_threads(threads)
        self.scan_threads = self.threads_
        self.code_version = code_version
        return storages

    cdef dict load_weights(self, weights, shapes, bint tied):
        arrays = check_weights(weights, shapes)
        if tied and "lm_head.weight" in arrays:
            if not np.array_equal(load_float(arrays["lm_head.weight"], "lm_head.weight"),
                                  load_float(arrays["model.embed_tokens.weight"], "model.embed_tokens.weight")):
                raise ValueError("tied lm_head.weight must equal model.embed_tokens.weight")
        return arrays

    cdef cism_mat* mat(self, name, dict arrays, storage) except NULL:
        cdef Matrix m = self.add_any_matrix(name, arrays[name], self.storages_.get(name, storage),
                                            self.threads_)
        return &m.mat

    cdef const float* vec(self, name, dict arrays) except NULL:
        cdef cnp.ndarray a = self.add_vector(name, arrays[name])
        return <const float*>cnp.PyArray_DATA(a)

    cdef object fill_base(self, ModelBase *b, config):
        b.hidden = config.hidden
        b.inter = config.intermediate
        b.layers = config.layers
        b.heads = config.heads
        b.kv_heads = config.kv_heads
        b.head_dim = config.head_dim
        b.vocab = config.vocab
        b.context = config.context
        b.q_width = config.heads * config.head_dim
        b.kv_width = config.kv_heads * config.head_dim
        b.eps = config.eps
        b.threads = self.threads_

    cdef object pack_ends(self, ModelBase *b, dict arrays, storage, bint tied):
        b.embed = self.mat("model.embed_tokens.weight", arrays, storage)[0]
        if tied:
            b.head = b.embed
        else:
            b.head = self.mat("lm_head.weight", arrays, storage)[0]
        b.final_norm = self.vec("model.norm.weight", arrays)

    cdef object build_rope(self, Rope *r, theta, size_t head_dim, size_t context, divisors=None, scale=1.0):
        inv, cos_t, sin_t = rope_tables(theta, head_dim, context, ROPE_TABLE_MAX, divisors, scale)
        r.scale = <float>scale
        self.rope_keep = [inv, cos_t, sin_t]
        r.inv_freq = <float*>cnp.PyArray_DATA(inv)
        r.cos = <float*>cnp.PyArray_DATA(cos_t)
        r.sin = <float*>cnp.PyArray_DATA(sin_t)
        r.positions = cos_t.shape[0]
        r.head_dim = head_dim

    def session_class(self):
        """The family's solo session class: (model, prompt, max_new_tokens,
        temperature, top_p, top_k, seed, eos, *, min_p, repetition_penalty)."""
        raise NotImplementedError

    def stepper_class(self):
        """The family's ragged step (a cism._step.Stepper class): (model)."""
        raise NotImplementedError

    def create_session(self, prompt, max_new_tokens, temperature=0.0, top_p=1.0, top_k=0,
                       seed=0, eos=(), *, min_p=0.0, repetition_penalty=1.0):
        """A generation with its own cache or state. min_p and
        repetition_penalty are extensions (off by default, leaving the
        spec's sampler bit-exact)."""
        return self.session_class()(self, prompt, max_new_tokens, temperature, top_p, top_k, seed,
                                    eos, min_p=min_p, repetition_penalty=repetition_penalty)

    def logits(self, prompt):
        """Next-token logits after the prompt, float32 (vocab,)."""
        s = self.session_class()(self, prompt, 0, 0.0, 1.0, 0, 0, ())
        s._prefill_now()
        return s.last_logits

    def nll(self, tokens):
        """Mean negative log-likelihood of tokens[1:] given the tokens before
        (teacher forcing, positions from zero), chunk by chunk."""
        return self.session_class()(self, tokens, 0, 0.0, 1.0, 0, 0, ())._nll()

    def logits_all(self, tokens):
        """Logits after every prefix of tokens, float32 (T, vocab): row i is
        the distribution for token i+1 (for perplexity and KL evaluations)."""
        return self.session_class()(self, tokens, 0, 0.0, 1.0, 0, 0, ())._all_logits()

    def _engine_stepper(self):
        """The forward over ragged batches that cism.Engine drives."""
        return self.stepper_class()(self)

    @property
    def kv_precision(self):
        """What the KV caches hold: ``"fp32"`` (default) or ``"fp16"``: keys
        and values rounded to binary16 as they are stored (half the bytes
        per cached position, so twice the positions per budget and faster
        long-context decode; attention then runs in fp32 over the widened
        values, with every bitwise guarantee kept; docs/EXACTNESS.md).
        Chosen when the model is built (a family without a KV cache: fp32)."""
        return self.kv_precision_

    @property
    def precision(self):
        return self.precision_

    @property
    def act_precision(self):
        return "int8" if self.act_q8_ else "fp32"

    def set_act_precision(self, act_precision):
        """``"fp32"`` keeps float activations; ``"int8"`` quantizes them per
        32-element block for the integer kernels. Not while sessions run."""
        if act_precision not in ("fp32", "int8"):
            raise ValueError(f"act_precision must be fp32 or int8, got {act_precision!r}")
        self.act_q8_ = act_precision == "int8"
        for m in self.matrices.values():
            (<Matrix>m).act_mode = ACT_Q8 if self.act_q8_ else ACT_FP32
        self.apply_act_precision()
        self.update_key()

    cdef object update_key(self):
        parts = [self.compile_canonical, self.precision_, self.act_precision,
                 str(self.threads_), _kernels.isa(), self.code_version]
        if self.prefill_precision_ != "exact":
            # (exact models keep the keys they always had)
            parts.append("prefill=" + self.prefill_precision_)
        if self.kv_precision_ != "fp32":
            parts.append("kv=" + self.kv_precision_)
        if self.storages_:
            parts.append("storages=" + hashlib.sha256(repr(sorted(self.storages_.items())).encode()).hexdigest())
        self.compile_key_ = hashlib.sha256("|".join(parts).encode()).hexdigest()[:32]

    @property
    def thread_count(self):
        return self.threads_

    @property
    def compile_key(self):
        """Stable hash of shape, precisions, thread count, kernel variant and code version."""
        return self.compile_key_

    @property
    def compile_canonical(self):
        return self.config.canonical()

    cdef object add_matrix(self, name, values, storage, int threads):
        """Pack one matrix (validated already) and keep it."""
        cdef Matrix m
        try:
            m = Matrix(values, storage, threads=threads, check_finite=False)
        except MemoryError:
            rows, cols = values.shape
            raise MemoryError(f"out of memory packing {name} ({rows}x{cols} as {storage}; "
                              f"{self.weight_bytes_} bytes packed so far)") from None
        self.keep.append(m)
        self.matrices[name] = m
        self.weight_bytes_ += m.nbytes
        return m

    cdef object add_any_matrix(self, name, value, storage, int threads):
        """add_matrix for a float array or a lazy tensor. A lazy tensor is
        kept as the file has it when `storage` is its native storage (a
        GGUF's Q4_K, Q6_K), else read, checked and packed; either way a
        block of rows at a time (PACK_BLOCK_BYTES of floats, or of the
        file's blocks): loading never holds more than one block of a matrix
        besides the matrix. An allocation the OS refuses is a MemoryError
        naming the file and the tensor."""
        from cism.loaders.ggml_types import NATIVE
        from cism._oom import memory_for
        cdef Matrix m
        if not is_lazy(value):
            return self.add_matrix(name, value, storage, threads)
        rows, cols = value.shape
        if value.mapping is not None:
            m = self.map_matrix(name, value, storage, threads)
            if m is not None:
                return m
        with memory_for(value.path, f"packing tensor {value.name!r} ({rows}x{cols} as {storage}; "
                                    f"{self.weight_bytes_} bytes packed so far)"):
            m = Matrix.empty(rows, cols, storage)
            if NATIVE.get(value.type_id) == storage:
                # the file's blocks, PACK_BLOCK_BYTES of them at a time
                step = max(1, PACK_BLOCK_BYTES // value.row_bytes)
                for r0 in range(0, rows, step):
                    try:
                        m.copy_ggml_rows(r0, value.raw_rows(r0, min(rows, r0 + step)), threads)
                    except ValueError as e:
                        raise ValueError(f"weight {name}: {e}") from None
            else:
                # whole 256-row chunks, at least one per thread (pack's parallel unit)
                step = max(256 * threads, PACK_BLOCK_BYTES // (4 * cols) // 256 * 256)
                for r0 in range(0, rows, step):
                    block = value.load_rows(r0, min(rows, r0 + step), threads)
                    if not all_finite(block):
                        raise ValueError(f"non-finite weight: {name}")
                    m.pack_rows(r0, block, threads)
                    del block
        self.keep.append(m)
        self.matrices[name] = m
        self.weight_bytes_ += m.nbytes
        return m

    def map_matrix(self, name, value, storage, int threads):
        """The lazy tensor ``value`` multiplied where its file is mapped
        (Matrix._mapped), or None when it must be copied (the reason is
        kept for mapping_report): cism/loaders/mapping.py says when a
        tensor maps."""
        cdef Matrix m
        view, why = value.mapping.view(value, storage)
        if view is None:
            self.map_notes_[name] = why
            return None
        rows, cols = value.shape
        try:
            m = Matrix._mapped(storage, view, rows, cols, threads)
        except ValueError as e:   # a non-finite weight: the copy reports it as it always did
            self.map_notes_[name] = f"not mapped: {e}"
            return None
        if not any(f is value.mapping for f in self.mapped_files_):
            self.mapped_files_.append(value.mapping)
        self.map_notes_[name] = None
        self.keep.append(m)
        self.matrices[name] = m
        self.weight_bytes_ += m.nbytes
        return m

    cdef object check_mapped(self):
        for f in self.mapped_files_:
            f.check()

    def check_mapped_files(self):
        """Raise CheckpointError (a ValueError naming the file) when a file
        this model's weights are mapped from changed since the load (fstat:
        device, inode, size, mtime); the forward calls run it first."""
        self.check_mapped()

    @property
    def mapped_bytes(self):
        """Bytes of weights mapped from their files (part of weight_bytes):
        the page cache's pages, shared with every process mapping the same
        file, not this process's private memory."""
        return sum((<Matrix>m).nbytes for m in self.matrices.values() if (<Matrix>m).mapped)

    def mapping_report(self):
        """HF name -> "mapped", or "copied: <why>" for each matrix (a model
        loaded with mmap=False reports "copied: mmap off")."""
        out = {}
        for name, m in self.matrices.items():
            if (<Matrix>m).mapped:
                out[name] = "mapped"
            else:
                out[name] = "copied: " + (self.map_notes_.get(name) or "mmap off")
        return out

    def storage_report(self):
        """HF name -> (source type, storage) of every packed matrix: the
        source is the GGUF tensor type when the model came from a GGUF
        file, else "float"."""
        types = getattr(self.source, "types", None) or {}
        return {name: (types.get(name, "float"), (<Matrix>m).storage_name)
                for name, m in self.matrices.items()}

    cdef object add_vector(self, name, values):
        """Keep a flat float32 copy of a vector (norms, biases, conv taps; a
        lazy tensor is read and checked here); returns the array."""
        a = np.ascontiguousarray(load_float(values, name), dtype=np.float32).reshape(-1).copy()
        self.keep.append(a)
        self.weight_bytes_ += a.nbytes
        return a

    cdef object add_ggml_matrix(self, name, type_id, raw, rows, cols, int threads):
        """Keep one matrix in its GGUF encoding, as the file has it: type_id
        12 (Q4_K) or 14 (Q6_K) (or their names), raw the tensor's bytes (a
        C-contiguous uint8 array of rows x row_bytes: each row's super-blocks
        in order), cols a multiple of 256; the bytes are copied
        (Matrix.from_ggml). Its fp16 scales are checked to be finite, which
        makes every weight finite (no decode needed). A bad size, type or
        scale raises ValueError naming the tensor. Returns the Matrix (storage
        "q4_k" or "q6_k"), multiplied like any other (set_act_precision
        reaches it)."""
        cdef Matrix m
        try:
            m = Matrix.from_ggml(type_id, raw, rows, cols, threads=threads)
        except MemoryError:
            raise MemoryError(f"out of memory keeping {name} ({rows}x{cols} GGUF type {type_id}; "
                              f"{self.weight_bytes_} bytes packed so far)") from None
        except ValueError as e:
            raise ValueError(f"weight {name}: {e}") from None
        self.keep.append(m)
        self.matrices[name] = m
        self.weight_bytes_ += m.nbytes
        return m

    @property
    def weight_bytes(self):
        """Bytes of packed weights, scales and vectors (what decode streams per token)."""
        return self.weight_bytes_

    @property
    def pages_locked(self):
        return self.pages_locked_

    def matrix(self, name):
        """The packed Matrix behind an HF tensor name (for inspection)."""
        try:
            return self.matrices[name]
        except KeyError:
            raise ValueError(f"no matrix named {name!r}") from None

    def _regions(self):
        cdef Matrix m
        out = []
        for obj in self.keep:
            if isinstance(obj, Matrix):
                m = obj
                out.append((<size_t>m.codes_buf, m.mat.rows * m.mat.row_bytes))
                if m.scales_buf != NULL:
                    out.append((<size_t>m.scales_buf, m.mat.rows * sizeof(float)))
            else:
                out.append((obj.ctypes.data, obj.nbytes))
        return out

    def lock_pages(self):
        """mlock the weights; returns the bytes actually locked (Linux may lock
        less than asked under RLIMIT_MEMLOCK; that is reported, not raised)."""
        with self.lock_:
            if self.pages_locked_:
                raise ValueError("weight pages are already locked")
            locked = 0
            for addr, n in self._regions():
                if n and mlock(<void*><size_t>addr, n) == 0:
                    locked += n
            self.pages_locked_ = True
            return locked

    def unlock_pages(self):
        with self.lock_:
            if not self.pages_locked_:
                raise ValueError("weight pages are not locked")
            unlocked = 0
            for addr, n in self._regions():
                if n and munlock(<void*><size_t>addr, n) == 0:
                    unlocked += n
            self.pages_locked_ = False
            return unlocked

    def touch(self):
        """Read every cache line of the weights once (residency refresh); returns bytes."""
        cdef uint64_t sink = 0
        cdef size_t a, n
        total = 0
        for addr, size in self._regions():
            a = addr
            n = size
            with nogil:
                sink += cism_touch(<const void*>a, n)
            total += n
        self.sink_ += sink
        return total

    def scan(self, int streams=8):
        """Stream all weights with the model's threads (a bandwidth probe);
        returns the bytes read. Each thread reads one contiguous share of the
        weights as ``streams`` (1..16) interleaved streams far apart, as
        decode's gemv reads its rows (csrc/memscan.h: cism_scan_regions)."""
        if not 1 <= streams <= 16:
            raise ValueError(f"streams must be in [1, 16], got {streams}")
        regions = self._regions()
        cdef size_t count = len(regions), i
        cdef size_t *addr = <size_t*>malloc(count * sizeof(size_t) * 2 + 8)
        if addr == NULL:
            raise MemoryError
        cdef size_t *size = addr + count
        cdef size_t total_c = 0
        for i in range(count):
            addr[i], size[i] = regions[i]
            total_c += size[i]
        total = total_c
        cdef uint64_t sink = 0
        cdef int nt = self.scan_threads, t
        # (a run-time stream count: built with the constant 8, GCC 12's
        # unrolled loop read a Qwen3-sized model at 27-31 GB/s on a Zen 5
        # host where this reads 38-49, like the 2 GiB probe)
        cdef size_t ns = streams
        with nogil:
            for t in prange(nt, num_threads=nt, schedule='static'):
                sink += cism_scan_regions(addr, size, count, total_c * t // nt,
                                          total_c * (t + 1) // nt, ns)
        free(addr)
        self.sink_ += sink
        return total
