"""The AMX kernels (csrc/gemm/gemm_amx.c: bf16; csrc/gemm_q8/gemm_q8_amx.c:
integer x q8) on the emulated tile unit of tests/amx_emulator.py, on every
CPU with AVX-512 VNNI and AVX512-BF16 (a real tile unit or not): the
integer x q8 kernels bit for bit against the reference kernels, the bf16
kernel bit for bit against test_bf16.py's emulate_tile_unit (the SDM's
TDPBF16PS arithmetic), over row, token and column tails and thread splits.
On AMX machines tests/test_matrix.py and tests/test_bf16.py run the same
kernels on the real unit.
"""
import numpy as np
import pytest

import amx_emulator
from cism import _kernels
from cism.matrix import FLOAT_STORAGES, Matrix

from test_bf16 import emulate, emulate_tile_unit


@pytest.fixture(scope="module")
def harness():
    try:
        return amx_emulator.library()
    except amx_emulator.Unavailable as e:
        pytest.skip(str(e))


@pytest.fixture
def emulated_unit(harness):
    """cism's amx level on the emulated unit, even where a real one exists."""
    with amx_emulator.emulated() as h:
        yield h


STORAGE_ID = {"int8": 2, "int4": 3, "fp4": 4}


def emulated(h, m, X, r0, r1):
    """Rows [r0, r1) of m's int8-activation product with X, by the AMX kernel."""
    rows, cols = m.shape
    acts = [_kernels.quantize(x) for x in X]
    q8 = np.ascontiguousarray(np.stack([a for a, _ in acts]))
    qs = np.ascontiguousarray(np.stack([s for _, s in acts]))
    codes = m._row_view()
    row_bytes = codes.nbytes // rows
    scale_offset = {"int8": 0, "int4": m.codes.shape[1] * 16, "fp4": m.codes.shape[1]}[m.storage]
    scales = m.scales if m.storage == "int8" else None
    Y = np.zeros((len(X), rows), np.float32)
    rc = h.cism_emu_gemm_q8(STORAGE_ID[m.storage], codes.ctypes.data, rows, cols, row_bytes, scale_offset,
                            None if scales is None else scales.ctypes.data, q8.ctypes.data, qs.ctypes.data,
                            q8.shape[1], qs.shape[1], len(X), r0, r1, Y.ctypes.data)
    assert rc != 2, "the kernel used a tile shape or configuration the unit refuses"
    assert rc == 0
    return Y[:, r0:r1]


@pytest.mark.parametrize("storage", ["int8", "int4", "fp4"])
@pytest.mark.parametrize("rows,cols", [(37, 1), (37, 33), (16, 64), (50, 100), (19, 576), (33, 1040)])
def test_amx_integer_kernels_match_the_reference(harness, storage, rows, cols, isa_level):
    """Every row group of 16 (a tail past the matrix end included), token
    groups of 16 in passes of 64, one to 65 fp4 blocks, row ranges as
    threads split them: the reference bits, T >= 8 (the tile path)."""
    r = np.random.default_rng(rows * cols)
    W = r.standard_normal((rows, cols)).astype(np.float32)
    W[1, : min(cols, 40)] = 0  # all-zero blocks
    if rows > 3:
        W[3] *= np.float32(1e-30)  # E4M3 subnormal scales
    m = Matrix(W, storage)
    m.act_precision = "int8"
    isa_level("ref")
    for T in (8, 16, 17, 64, 65, 130):
        X = (r.standard_normal((T, cols)) * r.choice([1e-3, 1.0, 50.0], size=(T, 1))).astype(np.float32)
        want = m.gemm(X, threads=1)
        for r0, r1 in {(0, rows), (0, min(17, rows)), (min(17, rows - 1), rows), (5, rows - 3)}:
            got = emulated(harness, m, X, r0, r1).view(np.uint32)
            bad = np.argwhere(got != want[:, r0:r1].view(np.uint32))
            assert not len(bad), f"T={T}, rows [{r0}, {r1}): {len(bad)} outputs differ, first (token, row) {bad[:4].tolist()}"


@pytest.mark.parametrize("storage", FLOAT_STORAGES)
@pytest.mark.parametrize("rows,cols", [(1, 1), (16, 32), (37, 33), (32, 64), (50, 100), (70, 1040)])
def test_amx_bf16_kernel_is_the_tile_units_arithmetic(emulated_unit, storage, rows, cols):
    """gemm_bf16 and pack_bf16: row blocks of 32 (two B tiles) with a tail,
    tokens in steps of 32 (two A tiles) with one-tile and partial tails,
    columns past and short of a 32-element K step, the rows split over
    threads: emulate_tile_unit's bits, and within test_bf16.py's tolerance
    of the float64 product."""
    assert _kernels.isa() == "amx" and _kernels.kernel_variants()["gemm (bf16, opt-in)"] == "amx (emulated)"
    r = np.random.default_rng(rows * cols + len(storage))
    W = r.standard_normal((rows, cols)).astype(np.float32)
    W[0, : min(cols, 40)] = 0  # an all-zero K step
    m = Matrix(W, storage)
    m.act_precision = "bf16"
    for T in (1, 5, 16, 17, 32, 33, 47, 70):
        X = (r.standard_normal((T, cols)) * r.choice([1e-3, 1.0, 50.0], size=(T, 1))).astype(np.float32)
        want = emulate_tile_unit(m, X)
        for threads in (1, 2, 3):
            got = m.gemm(X, threads=threads)
            bad = np.argwhere(got.view(np.uint32) != want.view(np.uint32))
            assert not len(bad), \
                f"T={T}, {threads} threads: {len(bad)} outputs differ, first (token, row) {bad[:4].tolist()}"
        exact, mag = emulate(m, X)
        assert np.all(np.abs(want - exact) <= 2e-6 * mag + 1e-30)


def test_emulated_tdpbf16ps_rounds_as_documented(emulated_unit):
    """The emulated instruction itself, on sums whose bits tell the orders
    apart: FMA chains (one rounding per product), even and odd elements in
    separate chains, denormal inputs and results as zero."""
    def product(w, x):
        m = Matrix(np.asarray(w, np.float32)[None, :], "fp32")
        m.act_precision = "bf16"
        return m.gemm(np.asarray(x, np.float32)[None, :], threads=1)[0, 0]

    big = 2.0 ** 24  # its ulp is 2: adding 1 ties, to even, so 1 is lost
    x = np.zeros(64)
    x[0] = big
    # the even and the odd elements go in separate chains: the two 1s (odd)
    # meet big once, as 2; in one chain each 1 alone would be lost
    x[[1, 3]] = 1
    assert product(x, np.ones(64)) == np.float32(big + 2)
    # two 1s in one chain with big are lost one by one
    x[[1, 3]], x[[2, 4]] = 0, 1
    assert product(x, np.ones(64)) == np.float32(big)
    # each K step of 32 elements starts its chains from zero: two 1s in the
    # next step reach big as one 2
    x[[2, 4]], x[[32, 34]] = 0, 1
    assert product(x, np.ones(64)) == np.float32(big + 2)
    # a denormal result is flushed to zero: 2^-70 * 2^-70 = 2^-140 < 2^-126
    assert product([2.0 ** -70], [2.0 ** -70]) == 0
    assert product([2.0 ** -60], [2.0 ** -60]) == np.float32(2.0 ** -120)
