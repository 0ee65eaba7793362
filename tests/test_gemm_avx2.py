"""The avx2 gemm family against the scalar reference, bit for bit.

tests/test_matrix.py already compares every runnable ISA with "ref" on a few
shapes and runs its property test on the best ISA only; this file forces
"avx2" over many shapes that are not multiples of the 8-lane vector, the
16-lane dot, the 32-element block or the 64-element activation unit, over
every tile shape of the token loop (T = 1..9, and past the 64-token chunk),
with both activation precisions, and over the attention helpers and the
activation quantizers.
"""
import numpy as np
import pytest

from cism import _kernels
from cism.matrix import Matrix

from conftest import hypothesis_examples, hypothesis_or_skip, runnable_isas

STORAGES = ["fp32", "fp16", "int8", "int4", "fp4"]

pytestmark = pytest.mark.skipif("avx2" not in runnable_isas(), reason="CPU/OS cannot run avx2")


def bits(a):
    """Exact bit pattern (tells -0 from +0 and compares NaNs)."""
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def both(fn):
    """fn() under "ref" and under "avx2"; the previous level is restored."""
    before = _kernels.isa()
    try:
        _kernels.set_isa("ref")
        want = fn()
        _kernels.set_isa("avx2")
        got = fn()
    finally:
        _kernels.set_isa(before)
    return want, got


def products(m, X):
    out = []
    for act in ("fp32", "int8"):
        m.act_precision = act
        out.append(m.gemm(X, threads=1))
    return out


def check_matrix(W, X, storage):
    m = Matrix(W, storage)
    want, got = both(lambda: products(m, X))
    for act, w, g in zip(("fp32", "int8"), want, got):
        assert np.array_equal(bits(g), bits(w)), (storage, act, W.shape, X.shape[0])


COLS = [1, 2, 7, 8, 9, 15, 16, 17, 24, 31, 32, 33, 40, 47, 48, 63, 64, 65, 96, 97, 127, 128, 129, 200, 255, 257]


@pytest.mark.parametrize("storage", STORAGES)
def test_odd_columns_every_token_count(storage):
    r = np.random.default_rng(1)
    for cols in COLS:
        # rows: a decode tile, the 2-row and 1-row leftovers, and a partial gemm tile
        W = r.standard_normal((11, cols)).astype(np.float32)
        W[3, : cols // 2] = 0                         # all-zero blocks
        W[5] *= np.float32(1e-30)                     # tiny scales
        W[7] = np.round(W[7] * 4) / 4                 # exact ties
        X = r.standard_normal((9, cols)).astype(np.float32)
        X[1] = 0                                      # an all-zero token
        X[2, ::3] = 0
        for T in range(1, 10):
            check_matrix(W, X[:T], storage)


@pytest.mark.parametrize("storage", STORAGES)
def test_token_chunks_and_row_tiles(storage):
    r = np.random.default_rng(2)
    for rows, cols, T in [(37, 100, 70), (64, 33, 129), (9, 256, 64), (5, 300, 65)]:
        W = r.standard_normal((rows, cols)).astype(np.float32)
        X = r.standard_normal((T, cols)).astype(np.float32)
        check_matrix(W, X, storage)


@pytest.mark.parametrize("storage", ["int4", "fp4"])
def test_4bit_decode_rows_over_many_scale_periods(storage):
    # Decode of 4-bit x q8 runs 8 rows at a time (spread over the caller's
    # rows), loading their scales for 8 steps of 64 elements at once: rows
    # of 16+ give row strides above 1, and columns past 512 give several
    # scale periods with a partial last one (and fp4 blocks past the row).
    r = np.random.default_rng(7)
    for rows, cols in [(16, 513), (17, 1000), (24, 1040), (40, 2065), (64, 4096)]:
        W = r.standard_normal((rows, cols)).astype(np.float32)
        W[1] *= np.float32(1e-30)
        W[2, : cols // 3] = 0
        x = r.standard_normal((1, cols)).astype(np.float32)
        m = Matrix(W, storage)
        m.act_precision = "int8"
        want, got = both(lambda: [m.gemm(x, threads=1), m.gemm(x, threads=2)])
        for w, g in zip(want, got):
            assert np.array_equal(bits(g), bits(w)), (storage, rows, cols)


@pytest.mark.parametrize("storage", ["int8", "int4", "fp4"])
def test_tokens_in_lanes_equal_decode(storage):
    # From 8 tokens on, int8, int4 and fp4 x q8 run with tokens in lanes:
    # groups of 8 (a partial last one), passes of several groups (int8: as
    # many as fit 192 KiB, so 1 at 12000 columns), tiles of 1-6 rows, rows
    # whose length is not a multiple of 16 or 32. Each output must be the
    # reference's and decode's, bit for bit.
    r = np.random.default_rng(8)
    for rows, cols, T in [(13, 1040, 8), (7, 2065, 17), (20, 100, 130), (6, 33, 64), (1, 5000, 9), (50, 520, 71),
                          (5, 12000, 24), (9, 7, 10)]:
        W = r.standard_normal((rows, cols)).astype(np.float32)
        W[0] *= np.float32(1e-30)
        X = r.standard_normal((T, cols)).astype(np.float32)
        X[3] = 0
        X[4] *= np.float32(1e-38)
        m = Matrix(W, storage)
        m.act_precision = "int8"
        want, got = both(lambda: [m.gemm(X, threads=1), m.gemm(X, threads=2)])
        for w, g in zip(want, got):
            assert np.array_equal(bits(g), bits(w)), (storage, rows, cols, T)
        before = _kernels.isa()
        _kernels.set_isa("avx2")
        try:
            solo = np.vstack([m.gemm(X[t:t + 1], threads=1) for t in range(T)])
        finally:
            _kernels.set_isa(before)
        assert np.array_equal(bits(solo), bits(got[0])), (storage, rows, cols, T)


@pytest.mark.parametrize("storage", STORAGES)
def test_threads_split_rows_identically(storage):
    r = np.random.default_rng(3)
    W = r.standard_normal((301, 129)).astype(np.float32)
    X = r.standard_normal((5, 129)).astype(np.float32)
    m = Matrix(W, storage)

    def run():
        out = []
        for act in ("fp32", "int8"):
            m.act_precision = act
            out += [m.gemm(X, threads=2), m.gemm(X[:1], threads=2)]
        return out

    want, got = both(run)
    for w, g in zip(want, got):
        assert np.array_equal(bits(g), bits(w))


def test_fp16_infinity_in_the_next_row_is_not_read_into_the_tail():
    # 1e5 overflows binary16: row 1 holds +-inf, and the tail of row 0 lies
    # right before it; lanes past the end must not compute 0 * inf = NaN.
    for cols in (1, 5, 9, 17, 33):
        W = np.ones((3, cols), np.float32)
        W[1] = 1e5
        W[1, ::2] = -1e5
        X = np.random.default_rng(cols).standard_normal((5, cols)).astype(np.float32)
        m = Matrix(W, "fp16")
        # T = 5 takes the prefill path (rows dequantized into a buffer)
        want, got = both(lambda: [m.gemm(X[:T], threads=1) for T in (1, 2, 3, 4, 5)])
        for w, g in zip(want, got):
            assert np.isfinite(g[:, 0]).all() and np.isfinite(g[:, 2]).all()
            assert np.array_equal(bits(g), bits(w))


@pytest.mark.parametrize("storage,w,x", [
    ("fp32", -2.0 ** -100, 2.0 ** -60),
    ("fp16", -2.0 ** -24, 2.0 ** -130),
    ("int4", -2.0 ** -100, 2.0 ** -60),
    ("fp4", -0.0117, 2.0 ** -149),
])
def test_lanes_that_underflow_to_negative_zero_stay_negative_zero(storage, w, x):
    # Every product is a negative number too small for binary32, so
    # fma(w, x, +0) = -0 in every lane and the reference returns -0. Lanes past
    # the end must then add -0, not +0 (which would turn the -0 into +0).
    for cols in (17, 33, 47, 100):
        W = np.full((7, cols), w, np.float32)
        X = np.full((5, cols), x, np.float32)
        m = Matrix(W, storage)
        want, got = both(lambda: [m.gemm(X[:T], threads=1) for T in (1, 3, 5)])
        for wv, g in zip(want, got):
            assert (bits(wv) == 0x80000000).all(), (storage, cols)  # the case is really -0
            assert np.array_equal(bits(g), bits(wv)), (storage, cols)


def test_int4_zero_code_keeps_the_sign_of_a_negative_scale():
    # Positive extremes give negative int4 scales; code 8 then dequantizes to
    # 0.0f * scale = -0 in the reference. Elements 0-15 underflow every lane to
    # -0 first, so a +0 weight for elements 16-31 would flip the result.
    W = np.array([[1e-30] * 16 + [0] * 16] * 3, np.float32)
    X = np.array([[-1e-20] * 16 + [1] * 16] * 5, np.float32)
    m = Matrix(W, "int4")
    assert (m.scales < 0).all()
    want, got = both(lambda: [m.gemm(X[:T], threads=1) for T in (1, 2, 3, 4, 5)])
    for w, g in zip(want, got):
        assert (bits(w) == 0x80000000).all()
        assert np.array_equal(bits(g), bits(w))


def test_avx2_equality_property():
    h = hypothesis_or_skip()
    st = h.strategies

    @h.settings(max_examples=hypothesis_examples(60), deadline=None)
    @h.given(rows=st.integers(1, 40), cols=st.integers(1, 300), T=st.integers(1, 9),
             storage=st.sampled_from(STORAGES), scale=st.sampled_from([1.0, 1e-20, 1e20]),
             seed=st.integers(0, 2**32 - 1))
    def check(rows, cols, T, storage, scale, seed):
        _avx2_equality_property(rows, cols, T, storage, scale, seed)
    check()


def _avx2_equality_property(rows, cols, T, storage, scale, seed):
    r = np.random.default_rng(seed)
    W = (r.standard_normal((rows, cols)) * scale).astype(np.float32)
    X = r.standard_normal((T, cols)).astype(np.float32)
    if storage == "fp16" and scale != 1.0:
        W = r.standard_normal((rows, cols)).astype(np.float32)
    check_matrix(W, X, storage)


def test_dot_axpy_and_quantizers():
    r = np.random.default_rng(4)
    for n in list(range(0, 70)) + [127, 128, 129, 255, 1000, 1001]:
        a = r.standard_normal(n).astype(np.float32)
        b = r.standard_normal(n).astype(np.float32)
        x = (r.standard_normal(n) * r.choice([1e-30, 1.0, 1e30])).astype(np.float32)
        if n > 40:
            x[32:64] = 0                 # an all-zero block
            x[5] = -x[:32].__abs__().max() * 2  # the extreme is negative
            x[6] = 0.5 * x[5] / np.float32(127)  # an exact half
        want, got = both(lambda: [np.float32(_kernels.dot(a, b)), _kernels.axpy(np.float32(0.3), a, b),
                                  *_kernels.quantize(x)])
        for w, g in zip(want, got):
            if w.dtype == np.float32:
                assert np.array_equal(bits(g), bits(w)), n
            else:
                assert np.array_equal(g, w), n


@pytest.mark.parametrize("scale", [1e-36, 1e-40, 1e-45, 1e30, 3e38])
def test_tiny_and_huge_activation_blocks(scale):
    # absmax < 127 / FLT_MAX would make the block's norm +inf: such a block
    # counts as zero (codes and scale 0, quant_norm in kernels.h), and the
    # padding past the row stays 0, or the quantized products would read
    # garbage weights.
    r = np.random.default_rng(6)
    for cols in (1, 20, 40, 100):
        with np.errstate(over="ignore"):
            x = (r.standard_normal(cols) * scale).astype(np.float32)  # 3e38: some +-inf
        x[::7] = 0
        W = r.standard_normal((5, cols)).astype(np.float32)
        mats = {s: Matrix(W, s) for s in ("int8", "int4", "fp4")}

        def run():
            out = [*_kernels.quantize(x)]
            for m in mats.values():
                m.act_precision = "int8"
                if np.isfinite(x).all():
                    out.append(m.gemv(x, threads=1))
            return out

        with np.errstate(over="ignore"):
            want, got = both(run)
        assert not want[0][cols:].any()
        for w, g in zip(want, got):
            assert np.array_equal(bits(g), bits(w)) if w.dtype == np.float32 else np.array_equal(g, w)


def test_quantizer_rounds_ties_to_even():
    # block absmax 127 makes norm exactly 1: the codes are rint(x)
    x = np.array([127, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.49999976] + [0.0] * 24, np.float32)
    want, got = both(lambda: _kernels.quantize(x))
    assert np.array_equal(got[0], want[0]) and np.array_equal(bits(got[1]), bits(want[1]))
    assert list(got[0][:8]) == [127, 0, 2, 2, 0, -2, -2, 3]


def test_runtime_reports_avx2():
    before = _kernels.isa()
    try:
        _kernels.set_isa("avx2")
        v = _kernels.kernel_variants()
        assert v["gemm (fp32 activations)"] == v["gemm (int8 activations)"] == "avx2"
        assert v["dot/axpy (attention)"] == v["activation quantization"] == "avx2"
    finally:
        _kernels.set_isa(before)
