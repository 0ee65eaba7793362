"""cism.matrix: packing rules, products on every ISA the host can run, error
bounds, thread and batch invariance, bad input.

Kernel exactness policy: every SIMD variant implements the canonical
arithmetic of csrc/kernels.h, so results are compared with the scalar
reference BIT FOR BIT. Accuracy against float64 is a separate table below.
"""
import gc
import os
import subprocess
import sys
import threading
from fractions import Fraction

import numpy as np
import pytest

from cism import _kernels
from cism.matrix import Matrix

from conftest import hypothesis_examples, hypothesis_or_skip, isas_under_test
from reference import canonical

STORAGES = ["fp32", "fp16", "int8", "int4", "fp4"]
ISAS = isas_under_test()

# Accuracy of W @ x against float64 for Gaussian weights and activations:
# normalised mean squared error bound per (storage, act_precision).
NMSE_BOUND = {
    ("fp32", "fp32"): 1e-13,   # measured 2.2e-14
    ("fp16", "fp32"): 1e-7,    # 3.7e-8
    ("int8", "fp32"): 1e-4,    # 5.4e-5
    ("int8", "int8"): 1.5e-4,  # 8.3e-5
    ("int4", "fp32"): 1e-2,    # 6.7e-3
    ("int4", "int8"): 1e-2,    # 6.7e-3
    ("fp4", "fp32"): 1e-2,     # 7.9e-3
    ("fp4", "int8"): 1e-2,     # 7.9e-3
}


def rng(seed=0):
    return np.random.default_rng(seed)


def same_bits(a, b):
    """Bitwise equality (tells -0 from +0, unlike ==)."""
    return a.shape == b.shape and np.array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32))


# ---------------------------------------------------------------- packing ---
# Independent NumPy statements of each storage rule (csrc/formats.h).

def np_int8(W):
    m = np.abs(W).max(axis=1)
    s = np.where(m == 0, np.float32(1), np.maximum(m / np.float32(127), np.float32(1e-45)))
    s = s.astype(np.float32)
    q = (W / s[:, None]).astype(np.float64)  # float32 quotient, exactly widened
    q = np.sign(q) * np.floor(np.abs(q) + 0.5)  # half away from zero
    return np.clip(q, -127, 127).astype(np.int8), s


def np_int4(W):
    rows, cols = W.shape
    blocks = -(-cols // 32)
    codes = np.zeros((rows, blocks, 16), np.uint8)
    scales = np.zeros((rows, blocks), np.float32)
    for b in range(blocks):
        blk = W[:, 32 * b: 32 * b + 32]
        idx = np.argmax(np.abs(blk), axis=1)
        extreme = blk[np.arange(rows), idx]
        s = np.where(extreme == 0, np.float32(1), extreme / np.float32(-8)).astype(np.float32)
        scales[:, b] = s
        x = (blk / s[:, None]).astype(np.float32) + np.float32(8.5)
        code = np.clip(np.trunc(x), 0, 15).astype(np.uint8)
        for t in range(blk.shape[1]):
            codes[:, b, t % 16] |= code[:, t] << (0 if t < 16 else 4)
    return codes, scales


E4M3 = []
for code in range(0x7F):  # non-negative finite codes 0..0x7e
    e, m = code >> 3, code & 7
    E4M3.append(m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
E4M3 = np.array(E4M3)


def np_e4m3(x):
    """Nearest E4M3 code by brute force, ties to the even code, saturating."""
    d = np.abs(E4M3[None, :] - np.asarray(x, np.float64)[:, None])
    best = d.min(axis=1, keepdims=True)
    ties = d == best
    out = []
    for row in ties:
        cands = np.flatnonzero(row)
        even = [c for c in cands if c % 2 == 0]
        out.append(even[0] if even else cands[0])
    return np.array(out, np.uint8)


E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)


def np_fp4(W):
    rows, cols = W.shape
    blocks = -(-cols // 16)
    codes = np.zeros((rows, blocks * 8), np.uint8)
    scales = np.zeros((rows, blocks), np.uint8)
    for b in range(blocks):
        blk = W[:, 16 * b: 16 * b + 16]
        ideal = (np.abs(blk).max(axis=1) / np.float32(6)).astype(np.float32)
        sc = np_e4m3(ideal)
        scales[:, b] = sc
        s = E4M3[sc].astype(np.float32)
        safe = np.where(s > 0, s, np.float32(1)).astype(np.float32)
        mag = (np.abs(blk) / safe[:, None]).astype(np.float32)
        err = np.abs(mag[:, :, None] - E2M1[None, None, :])
        best = np.argmin(err, axis=2).astype(np.uint8)  # first minimum: ties to smaller
        nib = np.where(blk < 0, best | 8, best).astype(np.uint8)
        for t in range(blk.shape[1]):
            j = 16 * b + t
            codes[:, j // 2] |= nib[:, t] << (4 * (j % 2))
    return codes, scales


def special_matrix(rows, cols, seed):
    """Gaussian rows mixed with all-zero blocks, ties, tiny and huge values."""
    W = rng(seed).standard_normal((rows, cols)).astype(np.float32)
    W[0, :] = 0                                   # all-zero row
    if rows > 1:
        W[1, : min(cols, 40)] = 0                 # all-zero blocks
    if rows > 2:
        W[2] *= np.float32(1e-30)                 # E4M3 subnormal / zero scales
    if rows > 3:
        W[3] *= np.float32(1e4)                   # saturating fp4 scales
    if rows > 4:
        W[4] = np.round(W[4] * 4) / 4             # many exact ties
    return W


@pytest.mark.parametrize("shape", [(7, 1), (6, 17), (9, 33), (5, 64), (8, 100)])
def test_packing_matches_numpy_rules(shape):
    W = special_matrix(*shape, seed=shape[1])
    assert np.array_equal(Matrix(W, "fp32").codes, W)
    assert np.array_equal(Matrix(W, "fp16").codes, W.astype(np.float16).view(np.uint16))
    q, s = np_int8(W)
    m = Matrix(W, "int8")
    assert np.array_equal(m.codes, q) and np.array_equal(m.scales, s)
    codes, scales = np_int4(W)
    m = Matrix(W, "int4")
    assert np.array_equal(m.codes, codes) and np.array_equal(m.scales, scales)
    codes, scales = np_fp4(W)
    m = Matrix(W, "fp4")
    assert np.array_equal(m.codes, codes) and np.array_equal(m.scales, scales)


def test_int8_rounds_every_half_away_from_zero():
    """Absmax 127 makes the scale exactly 1, so each k + 0.5 is a tie: all of
    them round away from zero (the packer rounds without libm, see pack.c)."""
    halves = np.arange(-127, 127, dtype=np.float32) + np.float32(0.5)
    W = np.stack([np.concatenate([halves, [127, -0.0]]),
                  np.concatenate([-halves, [-127, 0.0]]),
                  np.concatenate([np.nextafter(halves, 0), [127, 1e-45]])]).astype(np.float32)
    q, s = np_int8(W)
    m = Matrix(W, "int8")
    assert np.array_equal(m.scales, [1, 1, 1])
    assert np.array_equal(m.codes, q)
    assert m.codes[0, 0] == -127 and m.codes[0, 1] == -126 and m.codes[0, 253] == 127


def test_int8_packing_matches_the_rule_for_any_floats():
    """Subnormal, huge and mixed magnitudes: codes and scales equal the
    numpy statement of the rule."""
    h = hypothesis_or_skip()
    st = h.strategies

    @h.settings(max_examples=hypothesis_examples(200), deadline=None)
    @h.given(st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False), min_size=1, max_size=70),
             st.integers(0, 3))
    def check(values, rows):
        _int8_packing_matches_the_rule_for_any_floats(values, rows)
    check()


def _int8_packing_matches_the_rule_for_any_floats(values, rows):
    W = np.array([values] * (rows + 1), np.float32)
    W[1:] *= np.float32(-0.75)
    q, s = np_int8(W)
    m = Matrix(W, "int8")
    assert np.array_equal(m.codes, q) and np.array_equal(m.scales, s)


def test_int4_signed_max_maps_exactly():
    W = rng(1).standard_normal((4, 64)).astype(np.float32)
    deq = Matrix(W, "int4").dequantize()
    for r in range(4):
        for b in range(2):
            blk = W[r, 32 * b: 32 * b + 32]
            i = np.argmax(np.abs(blk))
            assert deq[r, 32 * b + i] == blk[i]  # the extreme is exact


def test_e4m3_subnormal_scales_are_kept():
    W = np.full((1, 16), 0.02, np.float32)  # absmax/6 = 0.0033 is an E4M3 subnormal
    m = Matrix(W, "fp4")
    assert 0 < m.scales[0, 0] < 8  # a subnormal code, not clamped to 2^-6
    assert np.allclose(m.dequantize(), W, rtol=0.35)


# ------------------------------------------------------- products & ISAs ---

def products(m, X):
    out = {}
    for act in ("fp32", "int8"):
        m.act_precision = act
        out[act] = m.gemm(X)
    m.act_precision = "fp32"
    return out


@pytest.mark.parametrize("storage", STORAGES)
def test_every_isa_matches_reference_bitwise(storage, isa_level):
    r = rng(3)
    # T > 4 runs the prefill path (rows dequantized once per token chunk);
    # 4100 columns is past its buffer (DEQ_MAX_COLS), so the direct tiles.
    # From 256 columns on, AVX-512 takes 6-row tiles: 14, 13 and 33 rows end
    # in a 2-, 1- and 3-row tile; past 1024 columns they go by in column
    # blocks with the accumulators kept in memory between blocks (1025: a
    # 1-element tail; 1040: a last block of one chunk; 67 tokens: two chunks).
    for rows, cols, T in [(1, 1, 1), (13, 15, 1), (9, 33, 3), (40, 97, 5), (33, 256, 9), (8, 48, 70),
                          (7, 49, 6), (6, 4100, 6), (14, 300, 7), (13, 1024, 67), (11, 1025, 5),
                          (7, 1040, 67)]:
        W = special_matrix(rows, cols, seed=cols).astype(np.float32)
        X = r.standard_normal((T, cols)).astype(np.float32)
        m = Matrix(W, storage)
        isa_level("ref")
        want = products(m, X)
        for isa in ISAS[1:]:
            isa_level(isa)
            got = products(m, X)
            for act in want:
                assert same_bits(got[act], want[act]), (isa, storage, act, rows, cols, T)


def test_isa_equality_property():
    h = hypothesis_or_skip()
    st = h.strategies

    @h.settings(max_examples=hypothesis_examples(60), deadline=None)
    @h.given(rows=st.integers(1, 40), cols=st.integers(1, 300), T=st.integers(1, 6),
             storage=st.sampled_from(STORAGES), seed=st.integers(0, 2**32 - 1),
             wscale=st.sampled_from([1.0, 1e-30, 1e20]), xscale=st.sampled_from([1.0, 1e-20, 1e-36]))
    def check(rows, cols, T, storage, seed, wscale, xscale):
        _isa_equality_property(rows, cols, T, storage, seed, wscale, xscale)
    check()


def _isa_equality_property(rows, cols, T, storage, seed, wscale, xscale):
    r = np.random.default_rng(seed)
    W = (r.standard_normal((rows, cols)) * wscale).astype(np.float32)
    X = (r.standard_normal((T, cols)) * xscale).astype(np.float32)
    m = Matrix(W, storage)
    before = _kernels.isa()
    try:
        _kernels.set_isa("ref")
        want = products(m, X)
        for isa in ISAS[1:]:
            _kernels.set_isa(isa)
            got = products(m, X)
            for act in want:
                assert same_bits(got[act], want[act]), (isa, act)
    finally:
        _kernels.set_isa(before)


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("rows,cols,T,prefixes", [(300, 200, 11, (1, 2, 5)), (1000, 232, 40, (16, 17, 40))])
def test_gemm_rows_equal_gemv_and_threads_do_not_matter(storage, rows, cols, T, prefixes):
    """Every thread count gives the one-thread bits, which are the gemv's,
    and a prefix batch equals the same rows of the full batch. The second
    shape runs, from 16 tokens on, the dynamic 96-row pieces of calls on the
    fp32 tiles (10 pieces and a short one; int8 activations keep the fixed
    shares for integer weights and take the pieces for fp32 / fp16 ones)."""
    r = rng(5 + rows)
    W = r.standard_normal((rows, cols)).astype(np.float32)
    X = r.standard_normal((T, cols)).astype(np.float32)
    m = Matrix(W, storage)
    for act in ("fp32", "int8"):
        m.act_precision = act
        base = m.gemm(X, threads=1)
        for threads in (2, 3, 7):
            assert same_bits(m.gemm(X, threads=threads), base), (act, threads)
        for t in (0, T // 2, T - 1):
            assert same_bits(m.gemv(X[t], threads=2), base[t])
        for n in prefixes:
            for threads in (2, 3):
                assert same_bits(m.gemm(X[:n], threads=threads), base[:n]), (act, threads, n)


@pytest.mark.parametrize("storage", STORAGES)
def test_parallel_decode_spreads_rows_without_changing_them(storage):
    """Above the parallel threshold a gemv hands each thread its whole share
    and the kernel reads rows j, j + L, ... (uneven shares, leftover rows):
    every thread count and ISA gives the single-threaded reference bits."""
    r = rng(11)
    W = special_matrix(709, 160, seed=3)   # 113440 multiply-adds, 23 chunks of 32 rows
    x = r.standard_normal(160).astype(np.float32)
    m = Matrix(W, storage)
    before = _kernels.isa()
    try:
        _kernels.set_isa("ref")
        want = {act: (setattr(m, "act_precision", act), m.gemv(x, threads=1))[1] for act in ("fp32", "int8")}
        for isa in ISAS:
            _kernels.set_isa(isa)
            for act in ("fp32", "int8"):
                m.act_precision = act
                for threads in (1, 2, 3, 7):
                    assert same_bits(m.gemv(x, threads=threads), want[act]), (isa, act, threads)
    finally:
        _kernels.set_isa(before)
        m.act_precision = "fp32"


@pytest.mark.parametrize("storage", ["int4", "fp4"])
def test_4bit_decode_over_scale_periods_on_every_isa(storage, isa_level):
    """4-bit x q8 decode goes 8 rows (spread over the range) at a time, two
    64-element units per step on AVX-512, with the rows' scales loaded for 8
    units at once: odd and even unit counts, partial last steps and scale
    periods, blocks past the row, tiny and zero rows, 1 and 2 threads: the
    reference bits on every level."""
    r = rng(17)
    for rows, cols in [(16, 513), (17, 1000), (24, 1040), (40, 2065), (64, 4096), (8, 96), (9, 64), (8, 1)]:
        W = r.standard_normal((rows, cols)).astype(np.float32)
        W[1] *= np.float32(1e-30)
        W[2, : cols // 3] = 0
        x = (r.standard_normal(cols) * r.choice([1e-3, 1.0, 50.0], size=cols)).astype(np.float32)
        m = Matrix(W, storage)
        m.act_precision = "int8"
        isa_level("ref")
        want = m.gemv(x, threads=1)
        for isa in ISAS:
            isa_level(isa)
            for threads in (1, 2):
                assert same_bits(m.gemv(x, threads=threads), want), (isa, rows, cols, threads)


@pytest.mark.parametrize("storage,act", sorted(NMSE_BOUND))
def test_error_against_float64(storage, act):
    r = rng(7)
    W = r.standard_normal((256, 1024)).astype(np.float32)
    X = r.standard_normal((4, 1024)).astype(np.float32)
    m = Matrix(W, storage)
    m.act_precision = act
    got = m.gemm(X).astype(np.float64)
    want = X.astype(np.float64) @ W.astype(np.float64).T
    nmse = np.sum((got - want) ** 2) / np.sum(want ** 2)
    assert nmse < NMSE_BOUND[(storage, act)], nmse


def test_fma32_is_one_rounding():
    """The oracle's fma (float64 round-to-odd, tests/reference/canonical.py)
    against exact rationals rounded to float32: exponent gaps up to 60 bits
    (where a plain float64 sum would round twice), cancellations, and sums
    that sit exactly on float32 midpoints."""
    r = rng(21)
    n = 4000
    a = (r.standard_normal(n) * 2.0 ** r.integers(-30, 30, n)).astype(np.float32)
    b = r.standard_normal(n).astype(np.float32)
    c = (r.standard_normal(n) * 2.0 ** r.integers(-60, 60, n)).astype(np.float32)
    c[:500] = -(a[:500].astype(np.float64) * b[:500]).astype(np.float32)    # near cancellation
    # 1 + 2^-24 is a float32 midpoint (ties to even: 1). (1 + 2^-23) (2^-24 (1 -
    # 2^-23)) + (1 + 2^-23) = 1 + 2^-23 + 2^-24 - 2^-70 lies just below the
    # midpoint between 1 + 2^-23 and 1 + 2^-22: the float64 sum rounds onto
    # it and a second rounding would give the even 1 + 2^-22; the fma gives
    # 1 + 2^-23
    a[500:503] = [1.0, 1.0 + 2.0 ** -23, -1.0]
    b[500:503] = [2.0 ** -24, 2.0 ** -24 * (1 - 2.0 ** -23), 2.0 ** -24]
    c[500:503] = [1.0, 1.0 + 2.0 ** -23, -1.0]
    got = canonical.fma32(a, b, c)
    want = np.array([f32_round(Fraction(float(x)) * Fraction(float(y)) + Fraction(float(z)))
                     for x, y, z in zip(a, b, c)], np.float32)
    assert same_bits(got, want)
    assert got[500] == 1 and got[501] == np.float32(1 + 2.0 ** -23)
    assert (a[501].astype(np.float64) * b[501] + c[501]).astype(np.float32) == np.float32(1 + 2.0 ** -22)


def np_weights(m, int8_scale=True):
    """A packed Matrix's weights decoded by NumPy from its codes and scales."""
    return canonical.decode(m.storage, m.codes, m.scales, m.cols, int8_scale)


@pytest.mark.parametrize("storage", STORAGES)
def test_dequantize_is_the_numpy_decode_of_the_codes(storage):
    """dequantize() (the oracle input of the Surjo, FWKV and bf16 tests) shares
    its decode with the reference gemm; here it meets a NumPy decode of the
    packed codes and scales, bit for bit (zero, tiny, huge and tie rows, tail
    blocks, negative int4 scales whose code 8 gives -0)."""
    for rows, cols in [(7, 1), (6, 17), (9, 33), (5, 100), (8, 300)]:
        m = Matrix(special_matrix(rows, cols, seed=cols), storage)
        assert same_bits(m.dequantize(), np_weights(m)), (rows, cols)


@pytest.mark.parametrize("storage", STORAGES)
def test_fp32_activation_dot_is_the_documented_order(storage, isa_level):
    """The fp32-activation product on every ISA level is, bit for bit, the
    documented arithmetic stated in NumPy (tests/reference/canonical.py): the
    16 fma lanes over the NumPy-decoded weights, the fixed tree, and for int8
    the row scale after the dot. Lengths with tails of every size, one chunk
    and more (1025 > the reference's 1024-column chunks), and token counts for
    decode, the prefill tiles and a 67-token prefill."""
    r = rng(23)
    for rows, cols, T in [(1, 1, 1), (13, 15, 1), (9, 33, 3), (7, 100, 6), (14, 300, 7), (5, 1025, 5),
                          (6, 64, 67)]:
        W = special_matrix(rows, cols, seed=cols + 1)
        X = (r.standard_normal((T, cols)) * r.choice([1e-3, 1.0, 40.0], size=(T, 1))).astype(np.float32)
        m = Matrix(W, storage)
        want = canonical.dot16(np_weights(m, int8_scale=False), X)
        if storage == "int8":
            want = want * m.scales[None, :]
        for isa in ISAS:
            isa_level(isa)
            assert same_bits(m.gemm(X), want), (isa, rows, cols, T)
            assert same_bits(m.gemv(X[-1]), want[-1]), (isa, rows, cols)


def f32_round(x):
    """The float32 nearest the exact rational x (ties to even)."""
    f = np.float32(float(x))
    near = [f, np.nextafter(f, np.float32(np.inf)), np.nextafter(f, np.float32(-np.inf))]
    return min(near, key=lambda c: (abs(Fraction(float(c)) - x), int(np.array(c).view(np.uint32)) & 1))


E2M1_X2 = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12]


def weight_blocks(m):
    """Each row of a packed int8/int4/fp4 Matrix as (integer weights, block
    size, per-block weight scales, row scale), read from its codes and
    scales views by the layout of csrc/formats.h."""
    rows, cols = m.shape
    if m.storage == "int8":
        return [(m.codes[i].astype(np.int64), 32, None, m.scales[i]) for i in range(rows)]
    if m.storage == "int4":
        codes = m.codes.astype(np.int64)  # (rows, blocks, 16): element t low, t + 16 high
        w = np.concatenate([codes & 15, codes >> 4], axis=2).reshape(rows, -1)[:, :cols] - 8
        return [(w[i], 32, m.scales[i], None) for i in range(rows)]
    codes = m.codes.astype(np.int64)  # (rows, bytes): element j in byte j // 2, low nibble for even j
    nib = np.stack([codes & 15, codes >> 4], axis=2).reshape(rows, -1)[:, :cols]
    w = np.array(E2M1_X2)[nib]
    halves = [[np.float32(E4M3[c] * 0.5) for c in m.scales[i]] for i in range(rows)]
    return [(w[i], 16, halves[i], None) for i in range(rows)]


@pytest.mark.parametrize("storage", ["int8", "int4", "fp4"])
def test_q8_activations_follow_the_one_chain_rule(storage, isa_level):
    """Integer weights x q8 activations (csrc/kernels.h): per weight block
    the exact integer sum of its products, then one fma chain over the
    blocks with c_b = ascale (int8, times the row scale at the end) or the
    rounded product wscale_b * ascale (int4 per 32, fp4 per 16 elements);
    stated here with exact rationals and compared bit for bit on every ISA
    (the AMX tiles too: 40 tokens)."""
    r = rng(13)
    rows, cols, T = 19, 100, 40  # a 4-element tail block, 16 + 3 rows
    W = r.standard_normal((rows, cols)).astype(np.float32)
    X = (r.standard_normal((T, cols)) * np.linspace(0.01, 30, cols)).astype(np.float32)
    m = Matrix(W, storage)
    acts = [_kernels.quantize(x) for x in X]
    want = np.zeros((T, rows), np.float32)
    for i, (w, bs, wscale, row_scale) in enumerate(weight_blocks(m)):
        for t, (a, ascale) in enumerate(acts):
            acc = np.float32(0)
            for b in range(0, cols, bs):
                blk = int(np.dot(w[b:b + bs], a[b:min(b + bs, cols)].astype(np.int64)))
                c = ascale[b // 32] if wscale is None else wscale[b // bs] * ascale[b // 32]  # float32 product
                acc = f32_round(Fraction(blk) * Fraction(float(c)) + Fraction(float(acc)))
            want[t, i] = acc * row_scale if row_scale is not None else acc
    m.act_precision = "int8"
    for isa in ISAS:
        isa_level(isa)
        assert same_bits(m.gemm(X), want), isa
        assert same_bits(m.gemv(X[7]), want[7]), isa


@pytest.mark.parametrize("isa", ["avx512vnni", "amx"])
@pytest.mark.parametrize("storage", ["int8", "int4", "fp4"])
@pytest.mark.parametrize("rows,cols", [(37, 1), (37, 33), (16, 64), (50, 100), (33, 1040)])
def test_integer_tiles_for_many_tokens_match_the_reference(isa, storage, rows, cols, isa_level, request):
    """The integer x q8 gemms of 8 tokens and more (the VNNI tokens-in-lanes
    kernel, the AMX tiles): row groups of 16 with a tail past the matrix
    end, token groups of 16 in passes of 64, one to 65 blocks, any thread
    split: the reference bits. (Where there is no real tile unit the AMX
    kernels run on the emulated one, tests/amx_emulator.py.)"""
    if isa == "amx":
        request.getfixturevalue("amx_unit")
    elif isa not in ISAS:
        pytest.skip(f"{isa} does not run here")
    r = rng(rows * cols)
    W = special_matrix(rows, cols, seed=cols).astype(np.float32)
    m = Matrix(W, storage)
    m.act_precision = "int8"
    for T in (8, 15, 16, 17, 64, 65, 130):
        X = (r.standard_normal((T, cols)) * r.choice([1e-3, 1.0, 50.0], size=(T, 1))).astype(np.float32)
        isa_level("ref")
        want = m.gemm(X, threads=1)
        isa_level(isa)
        for threads in (1, 2, 3):
            assert same_bits(m.gemm(X, threads=threads), want), (T, threads)


def run_with_isa(value):
    code = ("import warnings; warnings.simplefilter('always')\n"
            "from cism import _kernels; v = _kernels.kernel_variants()\n"
            "print(_kernels.isa(), v['gemm (int8 activations)'], v['gemm (bf16, opt-in)'])")
    env = dict(os.environ, CISM_ISA=value)
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return p.stdout.split(), p.stderr


def test_cism_isa_caps_the_kernels_and_names_the_levels():
    """CISM_ISA picks a level (capped at what the CPU has); below amx neither
    AMX kernel is installed (the bf16 precision runs on VDPBF16PS there, where
    the CPU has AVX512-BF16); an unknown name warns, listing every level, and
    runs the reference."""
    (isa, gemm_q, bf16), _ = run_with_isa("avx512vnni")
    avx512bf16 = isa == "avx512vnni" and _kernels.cpu_features()["avx512_bf16"]
    assert isa == ISAS[min(3, len(ISAS) - 1)] and gemm_q != "amx"
    assert bf16 == ("avx512bf16" if avx512bf16 else "none")
    (_, _, bf16), _ = run_with_isa("avx512")
    assert bf16 == "none"
    (isa, gemm_q, _), _ = run_with_isa("amx")
    assert isa == ISAS[-1]
    assert (gemm_q == "amx") == (ISAS[-1] == "amx")
    (isa, gemm_q, bf16), err = run_with_isa("avx9000")
    assert (isa, gemm_q, bf16) == ("ref", "ref", "none")
    assert "CISM_ISA must be one of ref, avx2, avx512, avx512vnni, amx" in err


def test_tiny_activation_blocks_quantize_to_zero(isa_level):
    """A block whose qmax/absmax overflows counts as zero on every ISA."""
    x = np.full(40, 1e-38, np.float32)  # 127/absmax overflows
    x[3] = 0
    for isa in ISAS:
        isa_level(isa)
        codes, scales = _kernels.quantize(x)
        assert not codes.any() and not scales.any(), isa


def test_negative_zero_lanes_survive_tails(isa_level):
    """Tiny products round to -0 in a lane; padding must not flip it."""
    W = np.full((7, 17), -2.0 ** -100, np.float32)
    x = np.full(17, 2.0 ** -60, np.float32)
    for storage in ("fp32", "fp16", "int4", "fp4"):
        m = Matrix(W, storage)
        isa_level("ref")
        want = m.gemv(x)
        for isa in ISAS[1:]:
            isa_level(isa)
            assert same_bits(m.gemv(x), want), (isa, storage)


def test_attention_scores16_are_the_gemv_dots_on_every_isa(isa_level):
    """scores16 (attention's score dots against keys kept transposed in
    tiles of 16 positions, keys in lanes) gives, for every query and key,
    the bits of the fp32 gemv with the key as a matrix row: head sizes with
    lane tails below and past 16, several queries, partial tiles (lanes past
    nk are never stored), tiny products that round to -0 in a lane."""
    r = rng(23)
    for hd in (1, 5, 16, 17, 31, 64, 80, 128, 256):
        for nq in (1, 3, 4, 5, 9):   # groups of four queries and the rest
            keys = r.standard_normal((16, hd)).astype(np.float32)
            Q = r.standard_normal((nq, hd)).astype(np.float32)
            keys[3] = -(2.0 ** -100)
            Q[0] = np.abs(Q[0]) * np.float32(2.0 ** -60)
            isa_level("ref")
            want = Matrix(keys, "fp32").gemm(Q, threads=1)
            for isa in ISAS:
                isa_level(isa)
                assert same_bits(_kernels.scores16(Q, keys.T), want), (isa, hd, nq)
                for nk in (1, 7, 8, 9, 15):
                    got = _kernels.scores16(Q, keys.T, nk)
                    assert same_bits(got[:, :nk], want[:, :nk]) and not got[:, nk:].any(), (isa, hd, nq, nk)
    with pytest.raises(ValueError, match="Kt"):
        _kernels.scores16(np.zeros((2, 8)), np.zeros((8, 15)))
    with pytest.raises(ValueError, match="nk"):
        _kernels.scores16(np.zeros((2, 8)), np.zeros((8, 16)), 0)


def test_fp16_kv_kernels_are_the_fp32_ones_over_widened_values(isa_level):
    """kv_precision "fp16": to_f16 rounds as NumPy's float16 cast (nearest
    even, overflow to inf, subnormals), into strided destinations; the
    binary16 attention kernels give exactly the fp32 kernels' bits over the
    widened keys and values, on every level."""
    r = rng(29)
    x = np.concatenate([r.standard_normal(61) * 10, [65504, 65519.99, 65520, 1e5, -1e5, 6e-8, 2.9e-8, 3e-8,
                                                       1e-5, -0.0, 0.0, 1 + 2 ** -11, 1 + 3 * 2 ** -11]]).astype(np.float32)
    with np.errstate(over="ignore"):   # 65520 and 1e5 overflow to inf on purpose
        want = x.astype(np.float16)
    for isa in ISAS:
        isa_level(isa)
        for stride in (1, 16):
            got = _kernels.to_f16(x, stride)[::stride]
            assert np.array_equal(got.view(np.uint16), want.view(np.uint16)), (isa, stride)
    for hd in (16, 17, 64, 80):
        Kt = (r.standard_normal((hd, 16)) * 3).astype(np.float16)
        Q = r.standard_normal((hd % 7 + 1, hd)).astype(np.float32)  # 3, 4, 2, 4 queries, then 1
        Q1 = Q[:1]
        P = r.standard_normal((hd // 4 + 3, 21)).astype(np.float32)  # 7 to 23 queries: 6-query passes and tails
        V = (r.standard_normal((21, hd)) * 3).astype(np.float16)
        O = r.standard_normal((len(P), hd)).astype(np.float32)
        isa_level("ref")
        want_s = _kernels.scores16(Q, Kt.astype(np.float32))
        want_1 = _kernels.scores16(Q1, Kt.astype(np.float32))
        want_o = _kernels.axpy_tile(P, V.astype(np.float32), O)
        for isa in ISAS:
            isa_level(isa)
            assert same_bits(_kernels.scores16(Q, Kt), want_s), (isa, hd)
            assert same_bits(_kernels.scores16(Q1, Kt), want_1), (isa, hd)
            assert same_bits(_kernels.scores16(Q, Kt, 9)[:, :9], want_s[:, :9]), (isa, hd)
            assert same_bits(_kernels.axpy_tile(P, V, O), want_o), (isa, hd)


def test_attention_axpy_tile_is_the_axpy_chain_on_every_isa(isa_level):
    """axpy_tile (attention's weighted sum of values, several queries at
    once) equals the same axpy calls made one by one, bit for bit, for
    ragged query counts, key counts and widths (masked tails), including a
    -0 start that a +0 product must turn into +0 exactly as axpy does."""
    r = rng(13)
    cases = [(nq, nk, n) for nq in (1, 2, 3, 4, 5, 6, 7, 9, 13, 16) for nk in (0, 1, 7, 33)
             for n in (1, 8, 15, 16, 17, 63, 64, 65, 100, 128)]
    for nq, nk, n in cases:
        P = r.standard_normal((nq, nk)).astype(np.float32)
        V = r.standard_normal((nk, n)).astype(np.float32)
        O = r.standard_normal((nq, n)).astype(np.float32)
        O[:, ::5] = -0.0
        if nk:
            P[:, 0] = 0.0
        isa_level("ref")
        want = O.copy()
        for q in range(nq):
            for k in range(nk):
                want[q] = _kernels.axpy(P[q, k], V[k], want[q])
        for isa in ISAS:
            isa_level(isa)
            assert same_bits(_kernels.axpy_tile(P, V, O), want), (isa, nq, nk, n)
    with pytest.raises(ValueError, match="do not chain"):
        _kernels.axpy_tile(np.zeros((2, 3)), np.zeros((4, 5)), np.zeros((2, 5)))
    with pytest.raises(ValueError, match="must be 2-D"):
        _kernels.axpy_tile(np.zeros(3), np.zeros((3, 5)), np.zeros((1, 5)))


def test_quantized_activations_match_numpy_rule():
    x = rng(9).standard_normal(100).astype(np.float32)
    x[32:64] = 0
    qmax = 127
    codes, scales = _kernels.quantize(x)
    assert codes.shape == (128,) and codes.dtype == np.int8 and scales.shape == (4,)
    for b in range(4):
        blk = x[32 * b: 32 * b + 32]
        m = np.abs(blk).max() if blk.size else np.float32(0)
        norm = np.float32(qmax) / m if m > 0 else np.float32(0)
        want = np.clip(np.rint((blk * norm).astype(np.float32)), -qmax, qmax)
        assert np.array_equal(codes[32 * b: 32 * b + blk.size], want.astype(codes.dtype))
        assert scales[b] == (m / np.float32(qmax) if m > 0 else 0)
    assert not codes[100:].any()


def test_calls_from_many_python_threads():
    r = rng(11)
    W = r.standard_normal((512, 384)).astype(np.float32)
    mats = {s: Matrix(W, s) for s in STORAGES}
    X = r.standard_normal((3, 384)).astype(np.float32)
    want = {s: m.gemm(X, threads=1) for s, m in mats.items()}
    errors = []

    def work(s):
        try:
            for _ in range(20):
                if not np.array_equal(mats[s].gemm(X, threads=2), want[s]):
                    errors.append(s)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=work, args=(s,)) for s in STORAGES for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


# ------------------------------------------------------------- accessors ---

def test_row_and_sizes():
    W = rng(13).standard_normal((10, 70)).astype(np.float32)
    assert np.array_equal(Matrix(W, "fp32").row(3), W[3])
    assert np.array_equal(Matrix(W, "fp16").row(4), W[4].astype(np.float16).astype(np.float32))
    m8 = Matrix(W, "int8")
    assert np.array_equal(m8.row(5), m8.dequantize()[5])
    assert Matrix(W, "fp32").nbytes == 10 * 70 * 4
    assert Matrix(W, "fp16").nbytes == 10 * 70 * 2
    assert Matrix(W, "int8").nbytes == 10 * 70 + 10 * 4
    assert Matrix(W, "int4").nbytes == 10 * 3 * (16 + 4)
    assert Matrix(W, "fp4").nbytes == 10 * 5 * (8 + 1)
    for s in ("int4", "fp4"):
        with pytest.raises(ValueError, match="row\\(\\) needs fp32, fp16, int8, q4_k or q6_k"):
            Matrix(W, s).row(0)
    with pytest.raises(ValueError, match="out of range"):
        Matrix(W, "fp32").row(10)
    m = Matrix(W, "int4")
    assert (m.rows, m.cols, m.storage, m.act_precision) == (10, 70, "int4", "fp32")
    assert "int4" in repr(m)


def test_views_are_read_only_and_keep_the_matrix_alive():
    W = rng(14).standard_normal((4, 40)).astype(np.float32)
    m = Matrix(W, "int4")
    scales = m.scales
    codes = m.codes
    del m
    gc.collect()   # the views alone keep the packed buffers alive
    assert not codes.flags.writeable and not scales.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        codes[0, 0, 0] = 1
    # fill the heap: a view into freed memory would now read junk
    junk = [np.full(codes.nbytes, 0xA5, np.uint8) for _ in range(64)]
    want_codes, want_scales = np_int4(W)
    assert np.array_equal(codes, want_codes) and np.array_equal(scales, want_scales)
    del junk


# ------------------------------------------------------------- bad input ---

@pytest.mark.parametrize("values,storage,message", [
    (np.zeros((2, 3), np.float64), "fp32", "float32"),
    (np.zeros((6,), np.float32), "fp32", "two-dimensional"),
    (np.zeros((3, 4), np.float32)[:, ::2], "fp32", "C-contiguous"),
    (np.zeros((0, 4), np.float32), "fp32", "rows must be in"),
    (np.zeros((4, 0), np.float32), "fp32", "cols must be in"),
    (np.zeros((2, 3), np.float32), "int3", "unknown storage"),
    (np.array([[1.0, np.nan]], np.float32), "int8", "finite"),
    (np.array([[np.inf, 1.0]], np.float32), "fp32", "finite"),
    ([[1.0, 2.0]], "fp32", "numpy float32 array"),
])
def test_bad_construction(values, storage, message):
    with pytest.raises(ValueError, match=message):
        Matrix(values, storage)


def test_bad_products_and_settings():
    m = Matrix(np.ones((3, 4), np.float32), "int8")
    with pytest.raises(ValueError, match="columns"):
        m.gemv(np.ones(5, np.float32))
    with pytest.raises(ValueError, match="float32"):
        m.gemv(np.ones(4, np.float64))
    with pytest.raises(ValueError, match="2-dimensional"):
        m.gemm(np.ones(4, np.float32))
    with pytest.raises(ValueError, match="finite"):
        m.gemv(np.array([1, 2, np.nan, 0], np.float32))
    with pytest.raises(ValueError, match="act_precision"):
        m.act_precision = "int4"
    for bad in (0, 65, -1, 2.5, "2", True):
        with pytest.raises(ValueError, match="threads"):
            m.gemv(np.ones(4, np.float32), threads=bad)
    assert m.gemm(np.ones((0, 4), np.float32)).shape == (0, 3)
