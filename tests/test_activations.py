"""Vector activations (csrc/act/): every ISA level bit for bit against the
scalar reference, in place and out of place, and the reference against
float64 oracles within the error bounds stated at the top of act_ref.c."""
import ctypes
import functools
import math

import numpy as np
import pytest

from cism import _kernels
from conftest import hypothesis_examples, hypothesis_or_skip, runnable_isas

UNARY = ("exp", "sigmoid", "silu", "gelu")
BINARY = ("silu_mul", "sigmoid_mul")
FUNCS = UNARY + BINARY
SIMD_LEVELS = [lvl for lvl in runnable_isas() if lvl != "ref"]
# the variant that fills the activation slots at each level
ACT_VARIANT = {"ref": "ref", "avx2": "avx2", "avx512": "avx512", "avx512vnni": "avx512", "amx": "avx512"}

F32 = np.float32
FLT_MIN = float(np.finfo(F32).tiny)
# the constants of act_ref.c, as float32
EXP_HI = F32(88.3762626647949)
EXP_LO = F32(-87.3365447505531)


def bits(x):
    return np.ascontiguousarray(x, dtype=F32).view(np.uint32)


def apply(level, name, x, b=None):
    _kernels.set_isa(level)
    return _kernels.activation(name, x, b if name in BINARY else None)


def second_input(x, rng):
    """The b of f(a) * b: mostly ordinary values, some specials."""
    b = rng.standard_normal(x.size).astype(F32)
    special = np.array([0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, np.nan, 3e38, 1e-45], F32)
    pick = rng.random(x.size) < 0.05
    b[pick] = rng.choice(special, int(pick.sum()))
    return b


def assert_same_bits(level, name, x, b=None, want=None):
    if want is None:
        want = apply("ref", name, x, b)
    got = apply(level, name, x, b)
    diff = np.flatnonzero(bits(got) != bits(want))
    if diff.size:
        i = diff[:8]
        raise AssertionError(
            f"{name} at {level}: {diff.size} of {x.size} differ from ref, e.g. x={x[i]!r} "
            f"b={None if b is None else b[i]!r} got={got[i]!r} ref={want[i]!r}")


# ---- inputs ----

def ulp_window(points, k):
    """Every float within k ulps of each point (and of its negation)."""
    p = np.asarray(points, F32)
    p = np.concatenate([p, -p])
    u = p.view(np.int32).astype(np.int64)
    # walk the ordered integer line so the window crosses zero correctly
    ordered = np.where(u < 0, np.int64(-0x80000000) - u, u)
    steps = ordered[:, None] + np.arange(-k, k + 1)[None, :]
    steps = np.clip(steps.ravel(), -0x7f800000, 0x7f800000)
    raw = np.where(steps < 0, np.int64(-0x80000000) - steps, steps)
    return raw.astype(np.int64).astype(np.uint32).view(F32)


def special_values():
    ln2 = math.log(2.0)
    points = [
        0.0, 1e-45, 1.1754942e-38, FLT_MIN, 1e-30, 1e-7, 0.5, 1.0, 2.0, 10.0, 3.4028235e38,
        # exp clamps and where it flushes, saturates or leaves the normal range
        EXP_HI, EXP_LO, 88.0, math.log(float(np.finfo(F32).max)), math.log(FLT_MIN),
        103.97, 104.0, 87.3, 88.3,
        # where the gelu exponent -z^2 + p crosses EXP_LO (result flushed to 0)
        13.1, 13.15,
    ]
    # rint(x * log2 e) switches between n and n+1 at (n + 1/2) ln 2
    points += [(n + 0.5) * ln2 for n in range(-128, 128)]
    x = np.concatenate([
        ulp_window(points, 64),
        np.arange(-120, 120, 1 / 64, dtype=F32),
        # -0 explicitly: the ulp walk maps it onto +0
        np.array([-0.0, np.inf, -np.inf, np.nan, -np.nan], F32),
        # NaNs with payloads (quiet and signalling), both signs
        np.array([0x7fc00001, 0xffc00001, 0x7f800001, 0xff800001, 0x7fffffff, 0xffffffff],
                 np.uint32).view(F32),
    ])
    return np.unique(x.view(np.uint32)).view(F32)


def log_uniform(n, rng):
    """Random sign, magnitude 2^u with u uniform over the whole float range."""
    mag = np.exp2(rng.uniform(-149.0, 127.99, n))
    return (rng.choice([-1.0, 1.0], n) * mag).astype(F32)


def finite_patterns(n, rng):
    x = rng.integers(0, 1 << 32, n, dtype=np.uint64).astype(np.uint32).view(F32)
    return x[np.isfinite(x)]


# ---- bit-for-bit against the reference ----

@pytest.mark.parametrize("level", SIMD_LEVELS)
def test_dispatch_names_the_variant(level, isa_level):
    isa_level(level)
    assert _kernels.kernel_variants()["vector activations"] == ACT_VARIANT[level]


@functools.lru_cache(maxsize=None)
def dataset(kind):
    """(a, b) of the large bitwise tests, built once per session."""
    if kind == "special":
        x = special_values()
        return x, second_input(x, np.random.default_rng(1))
    if kind == "patterns":  # 2^22 random bit patterns, the finite ones
        rng = np.random.default_rng(2)
        x = finite_patterns(1 << 22, rng)
    else:  # "log_uniform": 1e6 values over every magnitude, random sign
        rng = np.random.default_rng(3)
        x = log_uniform(1_000_000, rng)
    return x, second_input(x, rng)


@functools.lru_cache(maxsize=None)
def dataset_ref(kind, name):
    """The reference's output on a dataset, computed once for all levels."""
    before = _kernels.isa()
    try:
        return apply("ref", name, *dataset(kind))
    finally:
        _kernels.set_isa(before)


@pytest.mark.parametrize("kind", ["special", "patterns", "log_uniform"])
@pytest.mark.parametrize("name", FUNCS)
@pytest.mark.parametrize("level", SIMD_LEVELS)
def test_bitwise(level, name, kind, isa_level):
    x, b = dataset(kind)
    assert_same_bits(level, name, x, b, want=dataset_ref(kind, name))


@pytest.mark.parametrize("level", SIMD_LEVELS)
def test_every_length_and_offset(level, isa_level):
    """Lengths 0..70 (all tails of 8 and 16) starting at unaligned addresses."""
    rng = np.random.default_rng(4)
    buf = rng.standard_normal(200).astype(F32) * 8
    bbuf = rng.standard_normal(200).astype(F32)
    for n in range(71):
        for off in (0, 1, 3):
            for name in FUNCS:
                assert_same_bits(level, name, buf[off:off + n], bbuf[off:off + n])


def test_hypothesis_arrays_bitwise():
    h = hypothesis_or_skip()
    st = h.strategies
    import hypothesis.extra.numpy as hnp

    @h.settings(max_examples=hypothesis_examples(150), deadline=None)
    @h.given(x=hnp.arrays(F32, st.integers(0, 200), elements=st.floats(width=32)),
             seed=st.integers(0, 2**32 - 1))
    def check(x, seed):
        _hypothesis_arrays_bitwise(x, seed)
    check()


def _hypothesis_arrays_bitwise(x, seed):
    # restores the level itself: hypothesis does not rerun function fixtures
    before = _kernels.isa()
    try:
        b = second_input(x, np.random.default_rng(seed))
        for level in SIMD_LEVELS:
            for name in FUNCS:
                assert_same_bits(level, name, x, b)
    finally:
        _kernels.set_isa(before)


# ---- in place: y aliasing x (or a, or b) ----
# The Python wrapper always allocates its output, so these call the table's
# function pointers directly. _Table mirrors struct cism_kernels in
# csrc/kernels.h; test_table_mirror checks the mirror against the module.

_fp = ctypes.c_void_p
_UNARY_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
_BINARY_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                              ctypes.c_size_t)
CISM_NUM_STORAGES = 7


class _Table(ctypes.Structure):
    _fields_ = [("gemm", _fp * CISM_NUM_STORAGES), ("gemm_int8_q8", _fp),
                ("gemm_int4_q8", _fp), ("gemm_fp4_q8", _fp), ("gemm_q4k_q8", _fp), ("gemm_q6k_q8", _fp),
                ("gemm_bf16", _fp), ("pack_bf16", _fp),
                ("dot", _fp), ("axpy", _fp), ("axpy_tile", _fp), ("scores16", _fp),
                ("scores16_h", _fp), ("axpy_tile_h", _fp), ("scores16_bf16", _fp), ("scores16_bf16_h", _fp),
                ("axpy_tile_bf16", _fp), ("axpy_tile_bf16_h", _fp), ("to_f16", _fp), ("quant8", _fp)]
    _fields_ += [(name, _fp) for name in FUNCS]
    _fields_ += [("softmax", _fp), ("argmax", _fp)]
    _fields_ += [(name, ctypes.c_char_p) for name in
                 ("name_gemm", "name_gemm_q", "name_dot", "name_quant", "name_act", "name_gemm_bf16",
                  "name_attn_bf16")]


def _table():
    lib = ctypes.CDLL(_kernels.__file__)  # the module already loaded: same table
    lib.cism_table.restype = ctypes.POINTER(_Table)
    return lib.cism_table().contents


def _ptr(a):
    return a.ctypes.data_as(ctypes.c_void_p)


@pytest.mark.parametrize("level", runnable_isas())
def test_table_mirror(level, isa_level):
    isa_level(level)
    t = _table()
    assert t.name_act.decode() == ACT_VARIANT[level]
    x = np.linspace(-20, 20, 37, dtype=F32)
    y = np.empty_like(x)
    _UNARY_FN(t.exp)(_ptr(x), _ptr(y), x.size)
    np.testing.assert_array_equal(bits(y), bits(_kernels.activation("exp", x)))


@pytest.mark.parametrize("n", [0, 1, 7, 15, 16, 17, 37, 4096 + 13])
@pytest.mark.parametrize("level", runnable_isas())
def test_in_place(level, n, isa_level):
    rng = np.random.default_rng(5)
    a = (rng.standard_normal(n) * 10).astype(F32)
    b = rng.standard_normal(n).astype(F32)
    isa_level(level)
    t = _table()
    for name in UNARY:
        want = _kernels.activation(name, a)
        y = a.copy()
        _UNARY_FN(getattr(t, name))(_ptr(y), _ptr(y), n)
        np.testing.assert_array_equal(bits(y), bits(want), err_msg=f"{name} y=x")
    for name in BINARY:
        fn = _BINARY_FN(getattr(t, name))
        want = _kernels.activation(name, a, b)
        y = a.copy()
        fn(_ptr(y), _ptr(b), _ptr(y), n)
        np.testing.assert_array_equal(bits(y), bits(want), err_msg=f"{name} y=a")
        y = b.copy()
        fn(_ptr(a), _ptr(y), _ptr(y), n)
        np.testing.assert_array_equal(bits(y), bits(want), err_msg=f"{name} y=b")
        want = _kernels.activation(name, a, a)
        y = a.copy()
        fn(_ptr(y), _ptr(y), _ptr(y), n)
        np.testing.assert_array_equal(bits(y), bits(want), err_msg=f"{name} y=a=b")


# ---- the reference against float64 oracles ----

_erfc = np.frompyfunc(math.erfc, 1, 1)


def oracle(name, x):
    """float64 values of the exact functions (never calls cism)."""
    x = x.astype(np.float64)
    with np.errstate(over="ignore"):
        if name == "exp":
            return np.exp(x)
        sig = 1.0 / (1.0 + np.exp(-x))
    if name == "sigmoid":
        return sig
    if name == "silu":
        return x * sig
    # gelu = x/2 (1 + erf(x/sqrt 2)) = x/2 erfc(-x/sqrt 2); the erfc form keeps
    # the negative tail, where 1 + erf cancels to nothing in float64.
    # (math.erfc agrees with 200-bit mpmath to 4e-16 relative on [-12, 12].)
    return 0.5 * x * _erfc(-x / math.sqrt(2.0)).astype(np.float64)


# Inputs where the exhaustive measurement over every float32 found the
# largest errors, so the test sees the stated maxima and not only a sample.
WORST = {
    "exp": [26.69040298461914],
    "sigmoid": [-5.878161430358887, 0.9912270903587341],
    "silu": [-5.9370856285095215, 4.087072849273682, -87.33655548095703],
    "gelu": [-9.916287422180176, -4.961075782775879, -2.9959118366241455,
             -1.7588516473770142, -0.9804788827896118, 0.004914817865937948,
             1.148961067199707, -13.134714126586914],
}


@functools.lru_cache(maxsize=None)
def bound_data(name):
    """(x, float64 oracle, reference output) over every kind of input."""
    rng = np.random.default_rng(6)
    x = np.concatenate([
        np.linspace(-120.0, 120.0, 400_001).astype(F32),
        np.linspace(-15.0, 15.0, 200_001).astype(F32),
        finite_patterns(1 << 20, rng),
        log_uniform(200_000, rng),
        special_values(),
        np.asarray(WORST[name], F32),
    ])
    x = x[np.isfinite(x)]
    before = _kernels.isa()
    try:
        y = apply("ref", name, x)
    finally:
        _kernels.set_isa(before)
    return x, oracle(name, x), y


BELOW_EXP_LO = float(np.nextafter(EXP_LO, F32(-np.inf)))

# The statements at the top of csrc/act/act_ref.c, one row each:
# (function, x from, x to (both inclusive), kind, bound). "rel" is the
# relative error where the exact value is a normal float (and then the
# absolute error must stay below FLT_MIN where it is not); "abs" is
# |y - f|; "abs*x" is |y - f| / max(1, |x|).
BOUNDS = [
    ("exp", float(EXP_LO), float(EXP_HI), "rel", 8.5e-8),
    ("exp", -np.inf, BELOW_EXP_LO, "abs", FLT_MIN),
    ("sigmoid", -np.inf, np.inf, "rel", 1.8e-7),
    ("silu", float(EXP_LO), np.inf, "rel", 2.3e-7),
    ("silu", -np.inf, BELOW_EXP_LO, "abs", 1.1e-36),
    ("gelu", 0.0, np.inf, "rel", 4.6e-7),
    ("gelu", -1.0, np.inf, "rel", 4.8e-7),
    ("gelu", -3.0, np.inf, "rel", 1.3e-6),
    ("gelu", -5.0, np.inf, "rel", 2e-6),
    ("gelu", -10.0, np.inf, "rel", 7.2e-6),
    ("gelu", -np.inf, np.inf, "abs*x", 1.4e-7),
]


@pytest.mark.parametrize("name, lo, hi, kind, bound", BOUNDS)
def test_error_bounds(name, lo, hi, kind, bound):
    # the SIMD levels match ref bit for bit (tests above), so the bound of
    # the reference is the bound of every level
    x, f, y = bound_data(name)
    inside = (x >= lo) & (x <= hi)
    x, f, y = x[inside], f[inside], y[inside]
    err = np.abs(y.astype(np.float64) - f)
    if kind == "rel":
        normal = np.abs(f) >= FLT_MIN
        assert np.all(err[~normal] < FLT_MIN), f"{name}: error >= FLT_MIN on a tiny result"
        err = np.where(normal, err / np.where(normal, np.abs(f), 1.0), 0.0)
    elif kind == "abs*x":
        err = err / np.maximum(1.0, np.abs(x.astype(np.float64)))
    i = int(np.argmax(err))
    assert err[i] < bound, f"{name}: {kind} error {err[i]:.3e} at x={x[i]!r} (bound {bound:g})"


@pytest.mark.parametrize("level", runnable_isas())
def test_stated_edge_behaviour(level, isa_level):
    """Clamps and non-finite inputs, as act_ref.c documents them."""
    isa_level(level)
    top = F32(2.4061436e38)  # exp(EXP_HI): the saturation value
    x = np.array([EXP_HI, np.nextafter(EXP_HI, F32(np.inf)), np.inf, np.nan, -np.inf,
                  BELOW_EXP_LO], F32)
    np.testing.assert_array_equal(_kernels.activation("exp", x), [top, top, top, top, 0, 0])
    s = _kernels.activation("sigmoid", np.array([np.nan, np.inf, -np.inf, -0.0], F32))
    np.testing.assert_array_equal(s, [1, 1, 0, 0.5])
    assert np.isnan(_kernels.activation("silu", np.array([-np.inf], F32))[0])
    assert np.isnan(_kernels.activation("gelu", np.array([-np.inf], F32))[0])
    g = _kernels.activation("gelu", np.array([-13.134714, -13.13471, 200.0, np.inf], F32))
    assert g[0] == 0 and np.signbit(g[0]) and -1.4e-38 < g[1] < 0
    np.testing.assert_array_equal(g[2:], [200.0, np.inf])


# ---- the attention softmax ----

def softmax_oracle(x, scale):
    """The softmax as csrc/kernels.h states it, in NumPy float32 (exp from
    the reference level, whose bits every level shares): the maximum and
    the sum by 16 lanes, lane i taking elements i, i + 16, ... in order,
    then the canonical tree."""
    s = np.asarray(x, F32) * F32(scale)
    lanes = np.full(16, -np.inf, F32)
    for t, v in enumerate(s):
        if v > lanes[t % 16]:
            lanes[t % 16] = v
    m8 = np.where(lanes[:8] > lanes[8:], lanes[:8], lanes[8:])
    m4 = np.where(m8[:4] > m8[4:], m8[:4], m8[4:])
    a = m4[0] if m4[0] > m4[2] else m4[2]
    b = m4[1] if m4[1] > m4[3] else m4[3]
    top = a if a > b else b
    with np.errstate(over="ignore", invalid="ignore"):  # -3e38 - 3e38 is -inf, as in C
        e = apply("ref", "exp", (s - F32(top)).astype(F32))
    acc = np.zeros(16, F32)
    with np.errstate(over="ignore"):  # all scores -inf: clamped exps sum to inf, as in C
        for t, v in enumerate(e):
            acc[t % 16] = F32(acc[t % 16] + v)
        s8 = acc[:8] + acc[8:]
        s4 = s8[:4] + s8[4:]
        total = F32(F32(s4[0] + s4[2]) + F32(s4[1] + s4[3]))
    return (e / total).astype(F32)


def score_rows(rng):
    """Rows of every length 0..70 and some long ones, ordinary scores and a
    few with ties, -inf (masked) and huge values."""
    rows = [(rng.standard_normal(n) * 6).astype(F32) for n in list(range(71)) + [255, 256, 257, 4099]]
    tie = np.zeros(40, F32)
    tie[[3, 19, 35]] = 5.0
    rows.append(tie)
    masked = (rng.standard_normal(50) * 3).astype(F32)
    masked[::7] = -np.inf
    rows.append(masked)
    rows.append(np.array([3e38, -3e38, 0.0, -0.0, 1e-45] * 5, F32))
    # weights down through 2^-100 (where the AVX-512 level's quotient turns
    # from Markstein's correction to a division) to subnormals and zero,
    # at scale 0.125; and equal scores, whose weights are all 1 / n
    rows.append((-8 * np.sort(rng.uniform(0, 110, 3000))).astype(F32))
    rows.append(np.zeros(300, F32))
    # every score -inf: the clamped exps sum to inf, so the AVX-512 level
    # takes its plain division (a sum outside [1, FLT_MAX]) like the others
    rows.append(np.full(20, -np.inf, F32))
    return rows


def test_softmax_reference_is_the_stated_order(isa_level):
    isa_level("ref")
    rng = np.random.default_rng(11)
    for x in score_rows(rng)[:40] + score_rows(rng)[-4:]:
        for scale in (1.0, 0.125):
            got, want = _kernels.softmax(x, scale), softmax_oracle(x, scale)
            np.testing.assert_array_equal(bits(got), bits(want), err_msg=f"n={x.size} scale={scale}")


@pytest.mark.parametrize("level", SIMD_LEVELS)
def test_softmax_every_level_bitwise(level, isa_level):
    rng = np.random.default_rng(12)
    rows = score_rows(rng)
    isa_level("ref")
    want = [_kernels.softmax(x, 0.125) for x in rows]
    isa_level(level)
    for x, w in zip(rows, want):
        for off in (0, 1):  # an unaligned start
            buf = np.empty(x.size + off, F32)[off:]
            buf[:] = x
            got = _kernels.softmax(buf, 0.125)
            np.testing.assert_array_equal(bits(got), bits(w), err_msg=f"{level} n={x.size} off={off}")


def test_softmax_against_float64():
    rng = np.random.default_rng(13)
    for n in (1, 5, 16, 33, 700, 4096):
        x = (rng.standard_normal(n) * 8).astype(F32)
        got = _kernels.softmax(x, 0.125).astype(np.float64)
        s = x.astype(np.float64) * np.float64(F32(0.125))
        want = np.exp(s - s.max())
        want /= want.sum()
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-30)
        assert abs(got.sum() - 1.0) < 1e-6


# ---- argmax (the sampler's temperature-0 rule) ----

def argmax_rule(x):
    """std::max_element: index i replaces the best only if best < x[i]."""
    best = 0
    for i in range(1, len(x)):
        if x[best] < x[i]:
            best = i
    return best


def argmax_rows(rng):
    rows = []
    for n in list(range(0, 70)) + [95, 96, 97, 127, 128, 129, 1000, 49152, 49152 + 17]:
        rows.append(rng.standard_normal(n).astype(F32))
    big = rng.standard_normal(4099).astype(F32)
    for where in (0, 1, 31, 32, 33, 4095, 4098):          # the maximum in every place
        r = big.copy()
        r[where] = 50.0
        rows.append(r)
    tie = np.zeros(300, F32)
    tie[[7, 40, 299]] = 3.0                              # ties keep the first
    rows.append(tie)
    z = np.full(200, -0.0, F32)
    z[150] = 0.0                                         # -0 and +0 tie: index 0
    rows.append(z)
    nan0 = rng.standard_normal(200).astype(F32)
    nan0[0] = np.nan                                     # NaN at 0 keeps 0
    rows.append(nan0)
    nans = rng.standard_normal(200).astype(F32)
    nans[::3] = np.nan                                   # NaNs never win
    rows.append(nans)
    rows.append(np.full(150, -np.inf, F32))              # nothing beats -inf: 0
    late = np.full(150, -np.inf, F32)
    late[149] = -1e38
    rows.append(late)
    return rows


@pytest.mark.parametrize("level", runnable_isas())
def test_argmax_every_level_is_the_rule(level, isa_level):
    """The kernel table's argmax, as the sampler reaches it (cism.sampling
    follows the level), gives max_element's index on every level."""
    from cism import sampling
    rows = argmax_rows(np.random.default_rng(14))
    isa_level(level)
    for x in rows:
        assert sampling.argmax_of(x) == argmax_rule(x), (level, x.size)
    x = next(r for r in rows if r.size == 49152 + 17)  # also numpy's answer
    assert sampling.argmax_of(x) == int(np.argmax(x))
