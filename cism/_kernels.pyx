"""The kernel dispatch table and what the runtime found.

Importing this module fills the table once (reference kernels first, then
the best variants the CPU and the OS support, capped by CISM_ISA). Every other
Cython module reaches the kernels through ``kernel_table()``.
"""
import numpy as np

cimport numpy as cnp
from libc.stdint cimport int8_t

cnp.import_array()

from cython.parallel cimport prange
from libc.stdint cimport uint16_t, uint64_t

cdef extern from "scratch.h" nogil:
    int cism_scratch_fail(int n)

cdef extern from "omp_shim.h" nogil:
    int cism_omp_available()
    int cism_omp_max_threads()
    int cism_omp_release_team()

OPENMP = bool(cism_omp_available())

if cism_init() != 0:
    import warnings
    warnings.warn(cism_isa_error().decode() + "; using the reference kernels", RuntimeWarning)

cdef const cism_kernels *kernel_table() noexcept nogil:
    return cism_table()

ISA_LEVELS = ("ref", "avx2", "avx512", "avx512vnni", "amx")


def isa():
    """Name of the ISA level whose kernels are in use."""
    return cism_isa_name(cism_isa_level()).decode()


def isa_max():
    """Highest ISA level this CPU and OS support."""
    return cism_isa_name(cism_isa_max()).decode()


def available_isas():
    """ISA levels this machine can run, lowest first."""
    return ISA_LEVELS[: cism_isa_max() + 1]


def _fail_scratch(int n):
    """Test hook: the next ``n`` requests for kernel scratch (on any thread)
    fail as if memory were exhausted, so the kernels' fallbacks can be run
    on purpose (csrc/scratch.h); ``0`` ends it. Returns how many refusals
    the previous call had left unspent."""
    return cism_scratch_fail(n)


def _emulate_amx(size_t fill):
    """Test hook: run the amx level on the emulated tile unit whose table
    filler is at address ``fill`` (``cism_emu_fill`` of
    tests/native/amx_harness.c, loaded with ctypes and kept loaded), where
    the CPU has no tile unit; ``0`` removes it. ``set_isa("amx")`` then
    installs the emulated kernels; ``isa_max()``, ``available_isas()`` and
    ``cpu_features()`` still say what the CPU has (csrc/kernels.h)."""
    if cism_emulate_amx(<cism_amx_emulator>fill) != 0:
        raise ValueError("the AMX kernels' vector parts need the avx512vnni level and AVX512-BF16")


def set_isa(name):
    """Refill the dispatch table at the given level (for tests and benchmarks).

    Not safe while another thread runs kernels.
    """
    if name not in ISA_LEVELS:
        raise ValueError(f"unknown ISA {name!r}; choose one of {', '.join(ISA_LEVELS)}")
    if cism_set_isa(ISA_LEVELS.index(name)) != 0:
        raise ValueError(f"ISA {name!r} is not supported by this CPU/OS (highest: {isa_max()})")


def cpu_features():
    """CPU features usable by this process (CPUID and XGETBV both agree)."""
    cdef const cism_cpu *c = cism_cpu_features()
    return {
        "avx2": bool(c.avx2), "fma": bool(c.fma), "f16c": bool(c.f16c),
        "avx512f": bool(c.avx512f), "avx512bw": bool(c.avx512bw),
        "avx512vl": bool(c.avx512vl), "avx512dq": bool(c.avx512dq),
        "avx512vnni": bool(c.avx512vnni), "avx512vbmi": bool(c.avx512vbmi), "gfni": bool(c.gfni),
        "avx_vnni": bool(c.avx_vnni),
        "amx_tile (OS state)": bool(c.amx_tile),
        "avx512_bf16": bool(c.avx512bf16), "amx_bf16": bool(c.amx_bf16), "amx_int8": bool(c.amx_int8),
        "amx granted": bool(c.amx_granted),
    }


def kernel_variants():
    """Which variant fills each kernel family."""
    cdef const cism_kernels *k = cism_table()
    return {
        "gemm (fp32 activations)": k.name_gemm.decode(),
        "gemm (int8 activations)": k.name_gemm_q.decode(),
        "dot/axpy (attention)": k.name_dot.decode(),
        "activation quantization": k.name_quant.decode(),
        "vector activations": k.name_act.decode(),
        "gemm (bf16, opt-in)": k.name_gemm_bf16.decode() if k.name_gemm_bf16 != NULL else "none",
        "prompt attention (bf16, opt-in)": k.name_attn_bf16.decode() if k.name_attn_bf16 != NULL else "none",
    }


def openmp_max_threads():
    return cism_omp_max_threads()


# ---- thin wrappers used by tests and benchmarks ----

cdef cnp.ndarray _f32(x, name):
    a = np.ascontiguousarray(x, dtype=np.float32)
    if a.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional")
    return a


def activation(str name, x, y=None):
    """Apply a vector activation: exp, sigmoid, silu, gelu (one input) or
    silu_mul, sigmoid_mul (two inputs: f(x) * y)."""
    cdef const cism_kernels *k = cism_table()
    cdef cnp.ndarray a = _f32(x, "x")
    cdef cnp.ndarray out = np.empty_like(a)
    cdef cnp.ndarray b
    cdef size_t n = a.shape[0]
    cdef cism_unary_fn f1 = NULL
    cdef cism_binary_fn f2 = NULL
    if name == "exp": f1 = k.exp
    elif name == "sigmoid": f1 = k.sigmoid
    elif name == "silu": f1 = k.silu
    elif name == "gelu": f1 = k.gelu
    elif name == "silu_mul": f2 = k.silu_mul
    elif name == "sigmoid_mul": f2 = k.sigmoid_mul
    else:
        raise ValueError(f"unknown activation {name!r}")
    if f1 != NULL:
        if y is not None:
            raise ValueError(f"{name} takes one input")
        with nogil:
            f1(<const float*>cnp.PyArray_DATA(a), <float*>cnp.PyArray_DATA(out), n)
    else:
        if y is None:
            raise ValueError(f"{name} takes two inputs")
        b = _f32(y, "y")
        if b.shape[0] != a.shape[0]:
            raise ValueError("x and y must have the same length")
        with nogil:
            f2(<const float*>cnp.PyArray_DATA(a), <const float*>cnp.PyArray_DATA(b),
               <float*>cnp.PyArray_DATA(out), n)
    return out


def softmax(x, float scale=1.0):
    """The attention softmax of one row of scores (a new array): the
    weights exp(x * scale - max) / sum, the maximum and the sum taken by 16
    lanes and the canonical tree (csrc/kernels.h), the same bits on every
    ISA level."""
    cdef cnp.ndarray out = np.array(_f32(x, "x"), dtype=np.float32, copy=True)
    with nogil:
        cism_table().softmax(<float*>cnp.PyArray_DATA(out), out.shape[0], scale)
    return out


def dot(a, b):
    """The canonical fp32 dot product used by attention."""
    cdef cnp.ndarray x = _f32(a, "a")
    cdef cnp.ndarray y = _f32(b, "b")
    if x.shape[0] != y.shape[0]:
        raise ValueError("a and b must have the same length")
    return cism_table().dot(<const float*>cnp.PyArray_DATA(x), <const float*>cnp.PyArray_DATA(y),
                            x.shape[0])


def axpy(float alpha, x, y):
    """Return y + alpha * x with one rounding per element (fma)."""
    cdef cnp.ndarray a = _f32(x, "x")
    cdef cnp.ndarray out = _f32(y, "y").copy()
    if a.shape[0] != out.shape[0]:
        raise ValueError("x and y must have the same length")
    cism_table().axpy(alpha, <const float*>cnp.PyArray_DATA(a), <float*>cnp.PyArray_DATA(out),
                      a.shape[0])
    return out


cdef const cism_kernels *bf16_attention() except NULL:
    cdef const cism_kernels *k = cism_table()
    if k.scores16_bf16 == NULL:
        raise RuntimeError("no bf16 attention kernels at this ISA level (they need AVX512-BF16)")
    return k


def axpy_tile(P, V, O, bf16=False):
    """Return O + P @ V computed as attention does: for each query row q and
    key k in order, O[q] = fma(P[q, k], V[k], O[q]) element by element (the
    table's tiled kernel; bit-identical to the same axpy calls). A float16 V
    goes to the binary16 kernel (axpy_tile_h: the values widened). bf16:
    the bf16 prefill's kernel (axpy_tile_bf16(_h), csrc/kernels.h)."""
    half = isinstance(V, np.ndarray) and V.dtype == np.float16
    cdef cnp.ndarray p = np.ascontiguousarray(P, dtype=np.float32)
    cdef cnp.ndarray v = np.ascontiguousarray(V, dtype=np.float16 if half else np.float32)
    cdef cnp.ndarray out = np.array(O, dtype=np.float32, order="C", copy=True)
    if p.ndim != 2 or v.ndim != 2 or out.ndim != 2:
        raise ValueError("P, V and O must be 2-D")
    if p.shape[1] != v.shape[0] or out.shape[0] != p.shape[0] or out.shape[1] != v.shape[1]:
        raise ValueError(f"shapes do not chain: P {np.shape(p)}, V {np.shape(v)}, O {np.shape(out)}")
    cdef const cism_kernels *k = bf16_attention() if bf16 else cism_table()
    if bf16 and half:
        k.axpy_tile_bf16_h(<const float*>cnp.PyArray_DATA(p), p.shape[1], p.shape[0],
                           <const uint16_t*>cnp.PyArray_DATA(v), v.shape[1], v.shape[0],
                           <float*>cnp.PyArray_DATA(out), out.shape[1], out.shape[1])
    elif bf16:
        k.axpy_tile_bf16(<const float*>cnp.PyArray_DATA(p), p.shape[1], p.shape[0],
                         <const float*>cnp.PyArray_DATA(v), v.shape[1], v.shape[0],
                         <float*>cnp.PyArray_DATA(out), out.shape[1], out.shape[1])
    elif half:
        cism_table().axpy_tile_h(<const float*>cnp.PyArray_DATA(p), p.shape[1], p.shape[0],
                                 <const uint16_t*>cnp.PyArray_DATA(v), v.shape[1], v.shape[0],
                                 <float*>cnp.PyArray_DATA(out), out.shape[1], out.shape[1])
    else:
        cism_table().axpy_tile(<const float*>cnp.PyArray_DATA(p), p.shape[1], p.shape[0],
                               <const float*>cnp.PyArray_DATA(v), v.shape[1], v.shape[0],
                               <float*>cnp.PyArray_DATA(out), out.shape[1], out.shape[1])
    return out


def scores16(Q, Kt, nk=16, bf16=False):
    """Attention scores of queries Q (nq, hd) against a key tile Kt (hd, 16):
    the table's kernel (keys in lanes), (nq, 16) canonical dots, each the
    bits of the fp32 gemm with key j = Kt[:, j] as a matrix row; columns
    from nk on stay zero (the kernel stores keys j < nk only). A float16 Kt
    goes to the binary16 kernel (scores16_h: the keys widened). bf16: the
    bf16 prefill's kernel (scores16_bf16(_h), csrc/kernels.h)."""
    half = isinstance(Kt, np.ndarray) and Kt.dtype == np.float16
    cdef cnp.ndarray q = np.ascontiguousarray(Q, dtype=np.float32)
    cdef cnp.ndarray kt = np.ascontiguousarray(Kt, dtype=np.float16 if half else np.float32)
    if q.ndim != 2 or kt.ndim != 2 or kt.shape[1] != 16 or kt.shape[0] != q.shape[1]:
        raise ValueError(f"Q must be (nq, hd) and Kt (hd, 16): got {np.shape(q)} and {np.shape(kt)}")
    if not 1 <= nk <= 16:
        raise ValueError(f"nk must be in [1, 16]: got {nk}")
    cdef cnp.ndarray out = np.zeros((q.shape[0], 16), np.float32)
    cdef const cism_kernels *k = bf16_attention() if bf16 else cism_table()
    if bf16 and half:
        k.scores16_bf16_h(<const float*>cnp.PyArray_DATA(q), q.shape[1], q.shape[0],
                          <const uint16_t*>cnp.PyArray_DATA(kt), q.shape[1],
                          <float*>cnp.PyArray_DATA(out), 16, nk)
    elif bf16:
        k.scores16_bf16(<const float*>cnp.PyArray_DATA(q), q.shape[1], q.shape[0],
                        <const float*>cnp.PyArray_DATA(kt), q.shape[1],
                        <float*>cnp.PyArray_DATA(out), 16, nk)
    elif half:
        cism_table().scores16_h(<const float*>cnp.PyArray_DATA(q), q.shape[1], q.shape[0],
                                <const uint16_t*>cnp.PyArray_DATA(kt), q.shape[1],
                                <float*>cnp.PyArray_DATA(out), 16, nk)
    else:
        cism_table().scores16(<const float*>cnp.PyArray_DATA(q), q.shape[1], q.shape[0],
                              <const float*>cnp.PyArray_DATA(kt), q.shape[1],
                              <float*>cnp.PyArray_DATA(out), 16, nk)
    return out


def to_f16(x, stride=1):
    """x (float32) rounded to binary16 by the table's kernel (the KV caches'
    fp16 stores), written every stride elements of a zeroed float16 array."""
    cdef cnp.ndarray a = _f32(x, "x")
    if not 1 <= stride <= 64:
        raise ValueError(f"stride must be in [1, 64]: got {stride}")
    cdef cnp.ndarray out = np.zeros(max(a.shape[0] * stride, 1), np.float16)
    cism_table().to_f16(<const float*>cnp.PyArray_DATA(a), a.shape[0], <uint16_t*>cnp.PyArray_DATA(out), stride)
    return out[: a.shape[0] * stride]


def quantize(x):
    """Quantize an activation row as the int8 activation paths do: int8
    codes, 127/absmax per 32-element block. Returns (codes zero padded to a
    multiple of 64, block scales)."""
    cdef cnp.ndarray a = _f32(x, "x")
    cdef size_t n = a.shape[0]
    cdef size_t length = cism_act_len(n)
    cdef cnp.ndarray scales = np.zeros(length // 32, dtype=np.float32)
    cdef cnp.ndarray codes = np.zeros(length, dtype=np.int8)
    cism_table().quant8(<const float*>cnp.PyArray_DATA(a), n,
                        <int8_t*>cnp.PyArray_DATA(codes), <float*>cnp.PyArray_DATA(scales))
    return codes, scales


def start_threads(int threads):
    """Run one empty parallel region of ``threads`` threads, so that the
    OpenMP team of the calling thread exists before any model needs it.
    libgomp ends the whole process when it cannot create a thread (say, the
    address space is exhausted); creating the team at import, while memory
    is plentiful, keeps that failure from happening later in the middle of a
    forward. (A team is per calling thread: a new Python thread that runs a
    model creates its own on first use.)"""
    cdef int t
    cdef uint64_t sink = 0
    if threads < 1:
        return
    with nogil:
        for t in prange(threads, num_threads=threads, schedule='static'):
            sink += <uint64_t>t


def release_threads():
    """End the calling thread's OpenMP team. libgomp keeps one team per
    thread that runs parallel code, and once it manages more threads than
    the CPUs it may use, every team's workers stop spinning between parallel
    regions and sleep: each region then waits for a wake-up, which halved a
    serving engine's decode when the thread that loaded the model kept its
    team. cism.Engine calls this on the thread that starts it; a later
    parallel region on this thread makes a new team. Returns libgomp's code
    (0: done)."""
    return cism_omp_release_team()
