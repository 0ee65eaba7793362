"""Packed weight matrices and their products (``cism.matrix.Matrix``).

A Matrix packs a float32 (rows, cols) array into one storage (fp32, fp16,
int8, int4, fp4; layouts in csrc/formats.h), or keeps a GGUF tensor's Q4_K or
Q6_K blocks as the file has them (q4_k, q6_k: ``Matrix.from_ggml``), and
multiplies it with activation rows. Rows fan out over OpenMP threads in contiguous chunks; each row is
computed by one thread with the arithmetic of the scalar reference, so
results are bitwise identical for every thread count and every number of
tokens (a gemm row equals the gemv of that token).
"""
import numpy as np

cimport numpy as cnp
from cython.parallel cimport prange
from libc.stdint cimport int8_t, uint8_t, uint16_t, uint32_t
from libc.stdlib cimport free, malloc, realloc
from libc.string cimport memcpy, memset
from cpython.ref cimport Py_INCREF

from cism._kernels cimport (
    CISM_FP16, CISM_FP32, CISM_FP4, CISM_INT4, CISM_INT8, CISM_Q4K, CISM_Q4_K_BYTES, CISM_Q4_K_D,
    CISM_Q4_K_DMIN, CISM_Q6K, CISM_Q6_K_BYTES, CISM_Q6_K_D, CISM_QK_K, CISM_SLACK, cism_act, cism_act_len,
    cism_bf16_len, cism_bf16_rows,
    cism_code_bytes, cism_div_up, cism_gemm_fn, cism_kernels, cism_mat, cism_row_bytes, kernel_table)
from cism._threads import resolve_threads

cnp.import_array()

cdef extern from "pack.h" nogil:
    void cism_pack_rows(int storage, const float *values, size_t cols, size_t r0, size_t r1,
                        void *codes, float *row_scales)
    void cism_unpack_row(const cism_mat *W, size_t r, float *out)

cdef extern from "<stdlib.h>" nogil:
    void *aligned_alloc(size_t alignment, size_t size)

STORAGES = ("fp32", "fp16", "int8", "int4", "fp4", "q4_k", "q6_k")
# What Matrix(values, storage) packs float32 into; q4_k and q6_k come only
# from a GGUF file's own blocks (Matrix.from_ggml).
FLOAT_STORAGES = STORAGES[:5]
# ggml type id -> the storage that keeps its blocks (csrc/ggml.h's ids).
GGML_NATIVE = {12: "q4_k", 14: "q6_k"}
GGML_NAMES = {"Q4_K": 12, "Q6_K": 14}
MAX_ROWS = 2_000_000      # the largest vocabulary the configs accept
MAX_COLS = 262_144        # the largest intermediate size the configs accept
MAX_SOURCE_BYTES = 64 << 30

# Rows per parallel work item: a multiple of every kernel's row group.
DEF CHUNK = 32
# Below this many multiply-adds a parallel region costs more than it saves.
DEF PARALLEL_MIN_WORK = 65536
# Several-token calls on the fp32 tiles hand out pieces of PIECE_CHUNKS
# chunks (96 rows: 16 six-row tiles) dynamically from DYNAMIC_MIN_TOKENS on.
DEF PIECE_CHUNKS = 3
DEF DYNAMIC_MIN_TOKENS = 16


cdef void *alloc_zeroed(size_t nbytes) noexcept nogil:
    """64-byte aligned, with CISM_SLACK zero bytes after the payload."""
    cdef size_t total = cism_div_up(nbytes + CISM_SLACK, 64) * 64
    cdef void *p = aligned_alloc(64, total)
    if p != NULL:
        memset(p, 0, total)
    return p


cdef void scratch_free(Scratch *s) noexcept nogil:
    free(s.q8)
    free(s.qs8)
    free(s.xb)
    memset(s, 0, sizeof(Scratch))


cdef int grow(void **p, size_t *cap, size_t need) noexcept nogil:
    """Scratch of at least `need` bytes, 64-byte aligned (contents not kept)."""
    if need <= cap[0]:
        return 0
    free(p[0])
    cap[0] = 0
    p[0] = aligned_alloc(64, cism_div_up(need, 64) * 64)
    if p[0] == NULL:
        return -1
    cap[0] = need
    return 0


cdef bint bf16_ready() noexcept nogil:
    return kernel_table().gemm_bf16 != NULL


cdef inline bint kquant_storage(const cism_mat *W) noexcept nogil:
    return W.storage == CISM_Q4K or W.storage == CISM_Q6K


cdef inline cism_gemm_fn pick_kernel(const cism_kernels *k, const cism_mat *W, int mode) noexcept nogil:
    if mode & ACT_BF16:
        # (the bf16 kernel has no K-quant dequantization: those matrices keep
        # the canonical fp32-activation kernel, which pick_act hands fp32 rows)
        if kquant_storage(W):
            return k.gemm[W.storage]
        return k.gemm_bf16
    if mode & ACT_Q8:
        if W.storage == CISM_INT8:
            return k.gemm_int8_q8
        if W.storage == CISM_INT4:
            return k.gemm_int4_q8
        if W.storage == CISM_FP4:
            return k.gemm_fp4_q8
        if W.storage == CISM_Q4K:
            return k.gemm_q4k_q8
        if W.storage == CISM_Q6K:
            return k.gemm_q6k_q8
    return k.gemm[W.storage]


cdef inline bint integer_storage(const cism_mat *W) noexcept nogil:
    return (W.storage == CISM_INT8 or W.storage == CISM_INT4 or W.storage == CISM_FP4
            or kquant_storage(W))


cdef inline const cism_act *pick_act(const cism_mat *W, int mode, const cism_act *a32,
                                     const cism_act *a8) noexcept nogil:
    if mode & ACT_Q8 and not mode & ACT_BF16 and integer_storage(W):
        return a8
    return a32


cdef inline void gemm_chunks(const cism_kernels *k, const cism_mat **W, float **Y, const size_t *ldy,
                             int count, const size_t *starts, size_t c0, size_t c1, int mode,
                             const cism_act *a32, const cism_act *a8, size_t T) noexcept nogil:
    """The rows of CHUNK-row chunks [c0, c1) of the matrices laid end to end
    (matrix m holds chunks starts[m] .. starts[m + 1] - 1): one kernel call
    per matrix the range touches."""
    cdef int m
    cdef size_t lo, hi, r0, r1
    for m in range(count):
        lo = c0 if c0 > starts[m] else starts[m]
        hi = c1 if c1 < starts[m + 1] else starts[m + 1]
        if lo < hi:
            r0 = (lo - starts[m]) * CHUNK
            r1 = (hi - starts[m]) * CHUNK
            if r1 > W[m].rows:
                r1 = W[m].rows
            pick_kernel(k, W[m], mode)(W[m], r0, r1, pick_act(W[m], mode, a32, a8),
                                       T, Y[m], ldy[m])


cdef int gemm_multi(const cism_mat **W, float **Y, const size_t *ldy, int count, int mode,
                    const float *X, size_t ldx, size_t T, Scratch *s, int threads) noexcept nogil:
    cdef const cism_kernels *k = kernel_table()
    cdef size_t cols = W[0].cols
    cdef size_t qlen = cism_act_len(cols)
    cdef size_t qblocks = qlen // 32
    cdef size_t blen = cism_bf16_len(cols)
    cdef bint need8 = False
    cdef int i, th, err = 0
    cdef size_t t, p, total = 0, work = 0
    cdef size_t starts[9]
    cdef cism_act a32, a8
    if count < 1 or count > 8:
        return -1
    if mode & ACT_BF16 and k.gemm_bf16 == NULL:
        mode = mode & ACT_Q8
    for i in range(count):
        # (the bf16 kernel takes its own activations, whatever the storage)
        if mode == ACT_Q8 and integer_storage(W[i]):
            need8 = True
        starts[i] = total
        total += cism_div_up(W[i].rows, CHUNK)
        work += W[i].rows * cols
    starts[count] = total
    memset(&a32, 0, sizeof(cism_act))
    a32.x = X
    a32.ldx = ldx
    a32.err = &err
    a8 = a32
    if T == 0:
        return 0
    if need8:
        if grow(<void**>&s.q8, &s.cap8, T * qlen) or \
                grow(<void**>&s.qs8, &s.caps8, T * qblocks * sizeof(float)):
            return -1
        if threads > 1 and T > 1:
            for t in prange(T, schedule='static', num_threads=threads):
                k.quant8(X + t * ldx, cols, s.q8 + t * qlen, s.qs8 + t * qblocks)
        else:
            for t in range(T):
                k.quant8(X + t * ldx, cols, s.q8 + t * qlen, s.qs8 + t * qblocks)
        a8.q8 = s.q8
        a8.qscale = s.qs8
        a8.ldq = qlen
        a8.ldqs = qblocks
    if mode & ACT_BF16:
        # every activation row as bf16 in A-tile blocks (cism_act in
        # csrc/kernels.h): 16 tokens x 32 elements per contiguous 1 KiB, so
        # each tile load reads one sequential KiB; tokens past T are zero
        # (tiles read 32 at a time)
        if grow(<void**>&s.xb, &s.capb, cism_bf16_rows(T) * blen * sizeof(uint16_t)):
            return -1
        memset(s.xb + (T // 16) * 16 * blen, 0, (cism_bf16_rows(T) - (T // 16) * 16) * blen * sizeof(uint16_t))
        if threads > 1 and T > 1:
            for t in prange(T, schedule='static', num_threads=threads):
                k.pack_bf16(X + t * ldx, cols, s.xb + (t // 16) * 16 * blen + (t % 16) * 32, 512)
        else:
            for t in range(T):
                k.pack_bf16(X + t * ldx, cols, s.xb + (t // 16) * 16 * blen + (t % 16) * 32, 512)
        a32.xb = s.xb
        a32.ldb = 16 * blen
    if threads > 1 and total > 1 and work * T >= PARALLEL_MIN_WORK:
        if T >= DYNAMIC_MIN_TOKENS and not need8 and not mode & ACT_BF16:
            # Prompts and batches on the fp32 tiles (fp32 activations, or
            # fp32 / fp16 weights): pieces of PIECE_CHUNKS chunks go to
            # whichever thread is free. These calls are compute-bound, and
            # on a shared host one core often runs slower than the other for
            # a while: with one fixed share each, every call waits for the
            # slower (the gain below is largest beside another job). A row's
            # bits do not depend on the call that computes it. In-process A/B
            # against the fixed shares (2 threads, 512-token prompts,
            # alternating): Qwen3 shape fp32 1.09x and 1.12x, SmolLM2 fp16
            # 1.08x, fp32 1.00x quiet and 1.12x beside another job, int8
            # 1.01x; fp32 batch of 16 1.10x. The integer x q8 and bf16
            # kernels pack the call's activations on every call, which small
            # pieces would repeat, so they keep the fixed shares below.
            for p in prange(cism_div_up(total, PIECE_CHUNKS), schedule='dynamic', num_threads=threads):
                gemm_chunks(k, W, Y, ldy, count, starts, p * PIECE_CHUNKS,
                            min(p * PIECE_CHUNKS + PIECE_CHUNKS, total), mode, &a32, &a8, T)
        else:
            # Each thread takes one contiguous share of the chunks, so the kernel
            # gets each matrix's part of it in one call: decode can spread its
            # row streams over the whole share (streams far apart are what reach
            # the memory bandwidth), and prefill runs whole 6-row tiles with at
            # most one short tile per matrix (see gemm_avx512.c).
            for th in prange(threads, schedule='static', num_threads=threads):
                gemm_chunks(k, W, Y, ldy, count, starts, total * th // threads,
                            total * (th + 1) // threads, mode, &a32, &a8, T)
    else:
        gemm_chunks(k, W, Y, ldy, count, starts, 0, total, mode, &a32, &a8, T)
    return -1 if err else 0


cdef int gemm1(const cism_mat *W, int mode, const float *X, size_t ldx, size_t T,
               float *Y, size_t ldy, Scratch *s, int threads) noexcept nogil:
    return gemm_multi(&W, &Y, &ldy, 1, mode, X, ldx, T, s, threads)


cdef void mat_row(const cism_mat *W, size_t i, float *out) noexcept nogil:
    cism_unpack_row(W, i, out)


cdef object numpy_view(object owner, void *data, int ndim, cnp.npy_intp *shape, int typenum):
    arr = cnp.PyArray_SimpleNewFromData(ndim, shape, typenum, data)
    Py_INCREF(owner)
    cnp.PyArray_SetBaseObject(arr, owner)
    arr.flags.writeable = False
    return arr


def _check_dims(rows, cols):
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"rows must be in [1, {MAX_ROWS}], got {rows}")
    if not 1 <= cols <= MAX_COLS:
        raise ValueError(f"cols must be in [1, {MAX_COLS}], got {cols}")
    if rows * cols * 4 > MAX_SOURCE_BYTES:
        raise ValueError("matrix exceeds the 64 GiB weight safety limit")


def _storage_index(storage):
    if isinstance(storage, str) and storage in GGML_NATIVE.values():
        raise ValueError(f"storage {storage!r} holds a GGUF file's own blocks: build it with "
                         "Matrix.from_ggml(type, raw, rows, cols), not from float values")
    if not isinstance(storage, str) or storage not in FLOAT_STORAGES:
        raise ValueError(f"unknown storage {storage!r}; choose one of {', '.join(FLOAT_STORAGES)}")
    return STORAGES.index(storage)


def _ggml_type(type_name_or_id):
    """A ggml type given by id (12) or name ("Q4_K", "q4_k") -> (id, storage)."""
    t = type_name_or_id
    if isinstance(t, str):
        key = t.upper()
        if key not in GGML_NAMES:
            raise ValueError(f"ggml type {t!r} has no native storage; native types: "
                             f"{', '.join(GGML_NAMES)} (decode others to float32 and pack them)")
        t = GGML_NAMES[key]
    if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or int(t) not in GGML_NATIVE:
        raise ValueError(f"ggml type {type_name_or_id!r} has no native storage; native types: "
                         + ", ".join(f"{n} ({i})" for n, i in GGML_NAMES.items()))
    return int(t), GGML_NATIVE[int(t)]


cdef size_t ggml_nonfinite_block(int s, const uint8_t *raw, size_t blocks) noexcept nogil:
    """The first super-block whose fp16 scale (Q4_K: d or dmin, Q6_K: d) is
    inf or NaN, else `blocks`. With finite scales every weight is finite
    (at most 65504 * 63 * 15 in magnitude), so this is the whole finite
    check, read from 2-4 bytes per 256 weights."""
    cdef size_t b
    cdef const uint8_t *p
    for b in range(blocks):   # (byte 1 of a little-endian fp16: sign and the 5 exponent bits)
        if s == CISM_Q4K:
            p = raw + b * CISM_Q4_K_BYTES
            if (p[CISM_Q4_K_D + 1] & 0x7c) == 0x7c or (p[CISM_Q4_K_DMIN + 1] & 0x7c) == 0x7c:
                return b
        else:
            p = raw + b * CISM_Q6_K_BYTES
            if (p[CISM_Q6_K_D + 1] & 0x7c) == 0x7c:
                return b
    return blocks


def _check_act_precision(value):
    if value not in ("fp32", "int8"):
        raise ValueError(f"act_precision must be fp32 or int8, got {value!r}")
    return value == "int8"


def bf16_available():
    """Whether the opt-in bf16 precision can run here: the CPU has
    AVX512-BF16 and the kernel level in use (``CISM_ISA``,
    ``cism._kernels.set_isa``) is avx512vnni or higher (the VDPBF16PS
    kernel), or the CPU has AMX-BF16, the OS granted this process the tile
    state and the level is amx (the tile kernel)."""
    return bf16_ready()


cdef matrix_alloc(Matrix m, int s, size_t R, size_t C):
    """Zeroed buffers for an R x C matrix of float storage s."""
    m.storage_name = STORAGES[s]
    m.act_mode = ACT_FP32
    cdef size_t row_bytes = cism_row_bytes(s, C)
    cdef size_t nscales = R if s == CISM_INT8 else 0
    m.codes_buf = alloc_zeroed(R * row_bytes)
    if nscales:
        m.scales_buf = <float*>alloc_zeroed(nscales * sizeof(float))
    if m.codes_buf == NULL or (nscales and m.scales_buf == NULL):
        raise MemoryError(f"cannot allocate a {R}x{C} {m.storage_name} matrix "
                          f"({R * row_bytes + nscales * 4} bytes)")
    m.nbytes_ = R * row_bytes + nscales * sizeof(float)
    m.mat.storage = s
    m.mat.rows = R
    m.mat.cols = C
    m.mat.codes = m.codes_buf
    m.mat.row_bytes = row_bytes
    m.mat.scale_offset = cism_code_bytes(s, C) if (s == CISM_INT4 or s == CISM_FP4) else 0
    m.mat.scales = m.scales_buf

cdef matrix_pack(Matrix m, values, size_t first, int nt):
    """Pack the float32 rows ``values`` (C-contiguous, n x cols) as rows
    [first, first + n): rows are independent (csrc/pack.h), so a matrix
    packed a block of rows at a time holds the same bytes."""
    cdef int s = m.mat.storage
    cdef size_t C = m.mat.cols, n = values.shape[0]
    cdef const float *src = <const float*>cnp.PyArray_DATA(values)
    # the block's rows are rows [0, n) of a matrix starting at row `first`
    cdef uint8_t *codes = <uint8_t*>m.codes_buf + first * m.mat.row_bytes
    cdef float *scales = m.scales_buf + first if m.scales_buf != NULL else NULL
    cdef size_t c, nchunks = cism_div_up(n, 256), r0, r1
    with nogil:
        if nt > 1 and nchunks > 1:
            for c in prange(nchunks, schedule='dynamic', num_threads=nt):
                r0 = c * 256
                r1 = r0 + 256
                if r1 > n:
                    r1 = n
                cism_pack_rows(s, src, C, r0, r1, codes, scales)
        else:
            cism_pack_rows(s, src, C, 0, n, codes, scales)


cdef matrix_alloc_ggml(Matrix m, int s, size_t R, size_t C):
    """A zeroed R x C matrix of native storage s (q4_k, q6_k; C a multiple of
    256): all-zero super-blocks are zero weights (fp16 scales of +0)."""
    cdef size_t row_bytes = cism_row_bytes(s, C), total = R * row_bytes
    m.storage_name = STORAGES[s]
    m.act_mode = ACT_FP32
    m.codes_buf = alloc_zeroed(total)
    if m.codes_buf == NULL:
        raise MemoryError(f"cannot allocate a {R}x{C} {m.storage_name} matrix ({total} bytes)")
    m.nbytes_ = total
    m.mat.storage = s
    m.mat.rows = R
    m.mat.cols = C
    m.mat.codes = m.codes_buf
    m.mat.row_bytes = row_bytes
    m.mat.scale_offset = 0
    m.mat.scales = NULL


cdef matrix_copy_ggml(Matrix m, raw, size_t first, int nt, bint check_finite):
    """Copy ``raw`` (C-contiguous uint8, whole rows of super-blocks) into rows
    [first, first + n) of a native matrix, its fp16 scales checked finite
    first (which makes every weight finite)."""
    cdef int s = m.mat.storage
    cdef size_t row_bytes = m.mat.row_bytes, total = raw.nbytes, n = total // row_bytes
    cdef const uint8_t *src = <const uint8_t*>cnp.PyArray_DATA(raw)
    cdef size_t per_row = m.mat.cols // CISM_QK_K, blocks = n * per_row, bad
    if check_finite:
        with nogil:
            bad = ggml_nonfinite_block(s, src, blocks)
        if bad != blocks:
            raise ValueError(f"non-finite scale in super-block {bad % per_row} of row {first + bad // per_row}: "
                             "the weights would not be finite")
    cdef uint8_t *dst = <uint8_t*>m.codes_buf + first * row_bytes
    cdef size_t part = 1 << 22, nparts = cism_div_up(total, part), c, k
    with nogil:
        if nt > 1 and nparts > 1:
            for c in prange(nparts, schedule='static', num_threads=nt):
                k = total - c * part if total - c * part < part else part
                memcpy(dst + c * part, src + c * part, k)
        else:
            memcpy(dst, src, total)


cdef bint f32_all_finite(const uint8_t *p, size_t n) noexcept nogil:
    """Whether n float32 (little-endian, 4-byte aligned) hold no inf or NaN."""
    cdef const uint32_t *u = <const uint32_t*>p
    cdef uint32_t bad = 0
    cdef size_t i
    for i in range(n):
        bad |= (u[i] & 0x7f800000u) == 0x7f800000u
    return bad == 0


cdef bint f16_all_finite(const uint8_t *p, size_t n) noexcept nogil:
    """Whether n binary16 (2-byte aligned) hold no inf or NaN."""
    cdef const uint16_t *u = <const uint16_t*>p
    cdef uint16_t bad = 0
    cdef size_t i
    for i in range(n):
        bad |= (u[i] & 0x7c00u) == 0x7c00u
    return bad == 0


cdef class Matrix:
    """A packed weight matrix.

    ``Matrix(values, storage)`` packs a C-contiguous float32 ``(rows, cols)``
    array as ``fp32``, ``fp16``, ``int8``, ``int4`` or ``fp4``. Values must be
    finite (``check_finite=False`` skips the check for callers that have
    already made it). ``Matrix.from_ggml`` keeps a GGUF tensor's Q4_K or
    Q6_K blocks as they are (storages ``q4_k``, ``q6_k``).
    """

    def __cinit__(self):
        self.codes_buf = NULL
        self.scales_buf = NULL
        self.base_ = None

    def __init__(self, values, storage="fp32", threads=None, *, check_finite=True):
        cdef int s = _storage_index(storage)
        cdef int nt = resolve_threads(threads)
        if not isinstance(values, np.ndarray):
            raise ValueError(f"values must be a numpy float32 array, got {type(values).__name__}")
        if values.dtype != np.float32:
            raise ValueError(f"values must be float32, got {values.dtype}")
        if values.ndim != 2:
            raise ValueError(f"values must be two-dimensional (rows, cols), got shape {values.shape}")
        if not values.flags.c_contiguous:
            raise ValueError("values must be C-contiguous (use numpy.ascontiguousarray)")
        rows, cols = values.shape
        _check_dims(rows, cols)
        if check_finite and not np.isfinite(values).all():
            bad = np.argwhere(~np.isfinite(values))[0]
            raise ValueError(f"values must be finite; found {values[tuple(bad)]} at {tuple(bad)}")
        matrix_alloc(self, s, rows, cols)
        matrix_pack(self, values, 0, nt)

    @staticmethod
    def empty(rows, cols, storage="fp32"):
        """A ``rows x cols`` matrix holding zeros, for ``pack_rows`` (float
        storages) or ``copy_ggml_rows`` (q4_k, q6_k) to fill a block of rows
        at a time: a model loading tensor by tensor never holds a whole
        matrix of floats or of a file's blocks."""
        cdef Matrix m = Matrix.__new__(Matrix)
        if isinstance(storage, str) and storage in GGML_NATIVE.values():
            _check_dims(rows, cols)
            if cols % CISM_QK_K:
                raise ValueError(f"a {storage} row holds whole 256-element super-blocks: "
                                 f"cols must be a multiple of 256, got {cols}")
            matrix_alloc_ggml(m, STORAGES.index(storage), rows, cols)
            return m
        cdef int s = _storage_index(storage)
        _check_dims(rows, cols)
        matrix_alloc(m, s, rows, cols)
        return m

    def copy_ggml_rows(self, first, raw, threads=None, *, check_finite=True):
        """Copy a GGUF tensor's rows ``[first, first + n)`` into a q4_k or
        q6_k matrix: ``raw`` a C-contiguous uint8 array of n whole rows
        (``n * row_bytes`` bytes, as Matrix.from_ggml takes them), its fp16
        scales checked finite unless ``check_finite=False``."""
        cdef int nt = resolve_threads(threads)
        if self.base_ is not None:
            raise ValueError("a mapped matrix is read-only")
        if self.storage_name not in GGML_NATIVE.values():
            raise ValueError(f"a {self.storage_name} matrix packs floats (pack_rows), not a GGUF file's blocks")
        if not isinstance(raw, np.ndarray) or raw.dtype != np.uint8 or not raw.flags.c_contiguous:
            raise ValueError("raw must be a C-contiguous numpy uint8 array")
        n, rest = divmod(raw.nbytes, self.mat.row_bytes)
        if rest or isinstance(first, bool) or not isinstance(first, (int, np.integer)) or first < 0 \
                or first + n > self.mat.rows:
            raise ValueError(f"raw holds {raw.nbytes} bytes: not whole {self.mat.row_bytes}-byte rows "
                             f"from row {first} of the {self.mat.rows}-row matrix")
        matrix_copy_ggml(self, raw, first, nt, check_finite)

    def pack_rows(self, first, values, threads=None):
        """Pack the C-contiguous float32 ``(n, cols)`` array ``values`` into
        rows ``[first, first + n)``: the bytes ``Matrix(whole, storage)``
        gives those rows. Values are not checked (the caller checks them)."""
        cdef int nt = resolve_threads(threads)
        if self.base_ is not None:
            raise ValueError("a mapped matrix is read-only")
        if self.storage_name not in FLOAT_STORAGES:
            raise ValueError(f"a {self.storage_name} matrix holds a GGUF file's own blocks, not packed floats")
        if (not isinstance(values, np.ndarray) or values.dtype != np.float32 or values.ndim != 2
                or not values.flags.c_contiguous or values.shape[1] != self.mat.cols):
            raise ValueError(f"values must be a C-contiguous float32 (n, {self.mat.cols}) array")
        if isinstance(first, bool) or not isinstance(first, (int, np.integer)) or first < 0 \
                or first + values.shape[0] > self.mat.rows:
            raise ValueError(f"rows [{first}, {first} + {values.shape[0]}) lie outside the "
                             f"{self.mat.rows}-row matrix")
        matrix_pack(self, values, first, nt)

    @staticmethod
    def from_ggml(type_name_or_id, raw, rows, cols, threads=None, *, check_finite=True):
        """A ``q4_k`` or ``q6_k`` Matrix holding a GGUF tensor's own blocks.

        ``type_name_or_id``: ggml's type, 12 or ``"Q4_K"``, 14 or ``"Q6_K"``
        (other types have no native storage: decode them and pack floats).
        ``raw``: a C-contiguous uint8 array (any shape) of exactly ``rows *
        row_bytes`` bytes, row r being bytes ``[r * row_bytes, (r + 1) *
        row_bytes)``: the file's super-blocks of that row, in order
        (``row_bytes = cols / 256 * 144`` for Q4_K, ``* 210`` for Q6_K).
        ``cols`` must be a multiple of 256. The bytes are copied (``threads``
        share the copy) into cism's 64-byte aligned buffer, followed by
        CISM_SLACK zero bytes like every packed matrix.

        Every fp16 scale (Q4_K's d and dmin, Q6_K's d) must be finite, which
        makes every weight finite; ``check_finite=False`` skips that check
        (2 bytes read per 256 weights) for callers that made it.

        Products: fp32 activations give the canonical dot over the decoded
        weights (the bits of ``Matrix(m.dequantize(), "fp32")``),
        ``act_precision = "int8"`` the K-quant x q8 rule of
        csrc/kernels.h; ``row(i)`` and ``dequantize()`` give csrc/ggml.h's
        decode (gguf-py's bits)."""
        type_id, storage = _ggml_type(type_name_or_id)
        cdef int nt = resolve_threads(threads)
        for name, v in (("rows", rows), ("cols", cols)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise ValueError(f"{name} must be an int, got {v!r}")
        if not 1 <= rows <= MAX_ROWS:
            raise ValueError(f"rows must be in [1, {MAX_ROWS}], got {rows}")
        if not 1 <= cols <= MAX_COLS:
            raise ValueError(f"cols must be in [1, {MAX_COLS}], got {cols}")
        if cols % CISM_QK_K:
            raise ValueError(f"a {storage} row holds whole 256-element super-blocks: "
                             f"cols must be a multiple of 256, got {cols}")
        cdef int s = STORAGES.index(storage)
        cdef size_t R = rows, C = cols
        cdef size_t row_bytes = cism_row_bytes(s, C)
        cdef size_t total = R * row_bytes
        if not isinstance(raw, np.ndarray) or raw.dtype != np.uint8:
            raise ValueError(f"raw must be a numpy uint8 array, got "
                             f"{type(raw).__name__ if not isinstance(raw, np.ndarray) else raw.dtype}")
        if not raw.flags.c_contiguous:
            raise ValueError("raw must be C-contiguous (use numpy.ascontiguousarray)")
        if <size_t>raw.nbytes != total:
            raise ValueError(f"raw holds {raw.nbytes} bytes; a {rows}x{cols} {type_name_or_id!r} "
                             f"tensor is {rows} rows x {row_bytes} bytes = {total}")
        cdef Matrix m = Matrix.__new__(Matrix)
        matrix_alloc_ggml(m, s, R, C)
        matrix_copy_ggml(m, raw, 0, nt, check_finite)
        return m

    @staticmethod
    def _mapped(storage, view, rows, cols, threads=None, *, check_finite=True):
        """A fp32, fp16, q4_k or q6_k Matrix multiplying ``view`` in place: a
        C-contiguous uint8 array of exactly ``rows * row_bytes`` bytes in the
        storage's layout (a file's F32, F16, Q4_K or Q6_K tensor), kept alive
        by the Matrix and never written or freed by it. The caller guarantees
        what cism's own buffers give the kernels (cism/loaders/mapping.py):
        CISM_SLACK readable bytes after the view (their values are never
        folded in) and the element alignment checked here. The values are
        checked finite unless ``check_finite=False`` (fp32/fp16: every
        element's exponent; q4_k/q6_k: the fp16 scales)."""
        cdef int s
        if storage not in ("fp32", "fp16", "q4_k", "q6_k"):
            raise ValueError(f"storage {storage!r} is not a file encoding (fp32, fp16, q4_k, q6_k)")
        s = STORAGES.index(storage)
        _check_dims(rows, cols)
        if (s == CISM_Q4K or s == CISM_Q6K) and cols % CISM_QK_K:
            raise ValueError(f"a {storage} row holds whole 256-element super-blocks: "
                             f"cols must be a multiple of 256, got {cols}")
        cdef size_t R = rows, C = cols, row_bytes = cism_row_bytes(s, C)
        if not isinstance(view, np.ndarray) or view.dtype != np.uint8 or not view.flags.c_contiguous \
                or <size_t>view.nbytes != R * row_bytes:
            raise ValueError(f"view must be a C-contiguous uint8 array of {R * row_bytes} bytes")
        cdef const uint8_t *p = <const uint8_t*>cnp.PyArray_DATA(view)
        cdef size_t align = 4 if s == CISM_FP32 else 2, bad = 0, n = R * row_bytes
        if <size_t>p % align:
            raise ValueError(f"view at {<size_t>p:#x} is not {align}-byte aligned")
        cdef bint ok = True
        if check_finite:
            with nogil:
                if s == CISM_FP32:
                    ok = f32_all_finite(p, n // 4)
                elif s == CISM_FP16:
                    ok = f16_all_finite(p, n // 2)
                else:
                    bad = ggml_nonfinite_block(s, p, n // cism_code_bytes(s, CISM_QK_K))
                    ok = bad == n // cism_code_bytes(s, CISM_QK_K)
            if not ok:
                raise ValueError("values must be finite" if s == CISM_FP32 or s == CISM_FP16 else
                                 f"non-finite scale in super-block {bad % (C // CISM_QK_K)} of row "
                                 f"{bad // (C // CISM_QK_K)}: the weights would not be finite")
        cdef Matrix m = Matrix.__new__(Matrix)
        m.storage_name = storage
        m.act_mode = ACT_FP32
        m.base_ = view
        m.codes_buf = <void*>p
        m.nbytes_ = n
        m.mat.storage = s
        m.mat.rows = R
        m.mat.cols = C
        m.mat.codes = p
        m.mat.row_bytes = row_bytes
        m.mat.scale_offset = 0
        m.mat.scales = NULL
        return m

    @property
    def mapped(self):
        """Whether the Matrix multiplies memory it does not own (a mapped
        file's pages: Matrix._mapped) rather than its own buffer."""
        return self.base_ is not None

    def __dealloc__(self):
        if self.base_ is None:    # (a mapped view is the file's, released with base_)
            free(self.codes_buf)
        free(self.scales_buf)

    @property
    def rows(self):
        return self.mat.rows

    @property
    def cols(self):
        return self.mat.cols

    @property
    def shape(self):
        return (self.mat.rows, self.mat.cols)

    @property
    def storage(self):
        return self.storage_name

    @property
    def nbytes(self):
        """Bytes of packed weights and scales (what one full product streams)."""
        return self.nbytes_

    @property
    def act_precision(self):
        """``"fp32"``, ``"int8"`` or ``"bf16"``: integer storages quantize
        activations per 32-element block when ``"int8"`` (fp32/fp16 storages
        ignore it); ``"bf16"`` is the opt-in AMX precision for every storage
        (weights and activations rounded to bfloat16, fp32 sums in the tile
        unit's order: not the canonical dot, see docs/EXACTNESS.md), settable
        only where ``bf16_available()``."""
        if self.act_mode == ACT_BF16:
            return "bf16"
        return "int8" if self.act_mode == ACT_Q8 else "fp32"

    @act_precision.setter
    def act_precision(self, value):
        if value == "bf16":
            if kquant_storage(&self.mat):
                raise ValueError(f"act_precision 'bf16' is not offered for {self.storage_name} matrices "
                                 "(their products keep the canonical kernels)")
            if not bf16_ready():
                raise ValueError("act_precision 'bf16' needs AVX512-BF16 or AMX-BF16, which this CPU, its OS or "
                                 "the kernel level in use (CISM_ISA) does not offer")
            self.act_mode = ACT_BF16
            return
        if value not in ("fp32", "int8"):
            raise ValueError(f"act_precision must be fp32, int8 or bf16, got {value!r}")
        self.act_mode = ACT_Q8 if value == "int8" else ACT_FP32

    def __repr__(self):
        return (f"Matrix(rows={self.mat.rows}, cols={self.mat.cols}, storage={self.storage_name!r}, "
                f"act_precision={self.act_precision!r})")

    def _input(self, X, int ndim):
        if not isinstance(X, np.ndarray):
            X = np.asarray(X)
        if X.dtype != np.float32:
            raise ValueError(f"input must be float32, got {X.dtype}")
        if X.ndim != ndim:
            raise ValueError(f"input must be {ndim}-dimensional, got shape {X.shape}")
        if X.shape[X.ndim - 1] != self.mat.cols:
            raise ValueError(f"input has {X.shape[X.ndim - 1]} columns, matrix has {self.mat.cols}")
        if not np.isfinite(X).all():
            raise ValueError("input must be finite")
        return np.ascontiguousarray(X)

    def gemv(self, x, threads=None):
        """W @ x for a float32 vector of length cols; returns (rows,) float32."""
        return self.gemm(self._input(x, 1)[None, :], threads)[0]

    def gemm(self, X, threads=None):
        """X @ W.T for float32 (T, cols) activations; returns (T, rows).

        Each weight row is streamed once for all T tokens, and row t of the
        result equals ``gemv(X[t])`` bit for bit (in every act_precision)."""
        cdef int nt = resolve_threads(threads)
        cdef cnp.ndarray Xc = self._input(X, 2)
        cdef size_t T = Xc.shape[0]
        cdef cnp.ndarray out = np.empty((T, self.mat.rows), dtype=np.float32)
        cdef Scratch s
        cdef int rc
        memset(&s, 0, sizeof(Scratch))
        with nogil:
            rc = gemm1(&self.mat, self.act_mode, <const float*>cnp.PyArray_DATA(Xc), self.mat.cols, T,
                       <float*>cnp.PyArray_DATA(out), self.mat.rows, &s, nt)
            scratch_free(&s)
        if rc != 0:
            raise MemoryError("cannot allocate activation scratch")
        return out

    def row(self, i):
        """Row i as float32 (fp32/fp16/int8/q4_k/q6_k storages: embedding
        gathers; q4_k and q6_k rows are csrc/ggml.h's decode)."""
        if self.mat.storage == CISM_INT4 or self.mat.storage == CISM_FP4:
            raise ValueError(f"row() needs fp32, fp16, int8, q4_k or q6_k storage, not {self.storage_name} "
                             "(embeddings are never packed at 4 bits)")
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or not 0 <= i < self.mat.rows:
            raise ValueError(f"row index {i!r} is out of range [0, {self.mat.rows})")
        cdef cnp.ndarray out = np.empty(self.mat.cols, dtype=np.float32)
        mat_row(&self.mat, <size_t>i, <float*>cnp.PyArray_DATA(out))
        return out

    def dequantize(self):
        """The whole matrix as float32, exactly as the kernels see it."""
        cdef cnp.ndarray out = np.empty((self.mat.rows, self.mat.cols), dtype=np.float32)
        cdef float *p = <float*>cnp.PyArray_DATA(out)
        cdef size_t r
        with nogil:
            for r in range(self.mat.rows):
                cism_unpack_row(&self.mat, r, p + r * self.mat.cols)
        return out

    def _row_view(self):
        cdef cnp.npy_intp shape[1]
        shape[0] = self.mat.rows * self.mat.row_bytes
        return numpy_view(self, self.codes_buf, 1, shape, cnp.NPY_UINT8)

    @property
    def codes(self):
        """Read-only view of the packed codes (layout: csrc/formats.h):
        fp32 (rows, cols) float32, fp16 (rows, cols) uint16 bits, int8 (rows,
        cols) int8, int4 (rows, blocks32, 16) bytes, fp4 (rows, blocks16*8) bytes,
        q4_k and q6_k (rows, row_bytes): the GGUF file's bytes."""
        s = self.mat.storage
        rows, cols, rb = self.mat.rows, self.mat.cols, self.mat.row_bytes
        flat = self._row_view()
        if s == CISM_Q4K or s == CISM_Q6K:
            return np.ndarray((rows, rb), np.uint8, flat, 0, (rb, 1))
        if s == CISM_FP32:
            return np.ndarray((rows, cols), np.float32, flat, 0, (rb, 4))
        if s == CISM_FP16:
            return np.ndarray((rows, cols), np.uint16, flat, 0, (rb, 2))
        if s == CISM_INT8:
            return np.ndarray((rows, cols), np.int8, flat, 0, (rb, 1))
        if s == CISM_INT4:
            return np.ndarray((rows, (cols + 31) // 32, 16), np.uint8, flat, 0, (rb, 16, 1))
        return np.ndarray((rows, self.mat.scale_offset), np.uint8, flat, 0, (rb, 1))

    @property
    def scales(self):
        """Read-only view of the scales: int8 (rows,) float32, int4 (rows,
        blocks32) float32, fp4 (rows, blocks16) E4M3 bytes; None for fp32/fp16
        and for q4_k/q6_k (their scales sit inside each super-block)."""
        cdef cnp.npy_intp shape[1]
        s = self.mat.storage
        rows, cols, rb, so = self.mat.rows, self.mat.cols, self.mat.row_bytes, self.mat.scale_offset
        if s == CISM_INT8:
            shape[0] = rows
            return numpy_view(self, self.scales_buf, 1, shape, cnp.NPY_FLOAT32)
        if s == CISM_INT4:
            return np.ndarray((rows, (cols + 31) // 32), np.float32, self._row_view(), so, (rb, 4))
        if s == CISM_FP4:
            return np.ndarray((rows, (cols + 15) // 16), np.uint8, self._row_view(), so, (rb, 1))
        return None
