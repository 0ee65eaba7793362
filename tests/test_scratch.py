"""Kernel scratch (csrc/scratch.h): each thread keeps one buffer, and when
scratch cannot be had every multi-token kernel falls back to a path that
needs none and gives the same bits, except the opt-in bf16 kernel, which
reports it. ``_kernels._fail_scratch`` refuses scratch on purpose."""
import numpy as np
import pytest

from cism import _kernels
from cism.matrix import Matrix

from conftest import runnable_isas
from models import small_model

STORAGES = ["fp32", "fp16", "int8", "int4", "fp4"]
# tokens: the tile kernels (5+), the AMX integer ones (8+), fp4's VNNI
# tokens-in-lanes past 32; columns: the column-blocked fp32 tiles past 1024
SHAPES = [(40, 96, 6), (35, 200, 16), (20, 1100, 9), (48, 64, 40)]


@pytest.fixture
def refused():
    """Call with n: the next n scratch requests fail; always reset after."""
    yield _kernels._fail_scratch
    _kernels._fail_scratch(0)


# amx: on the emulated tile unit where there is no real one
LEVELS = runnable_isas() + ([] if "amx" in runnable_isas() else ["amx"])


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("act", ["fp32", "int8"])
def test_kernels_without_scratch_give_the_same_bits(level, storage, act, isa_level, refused, request):
    if level == "amx":
        request.getfixturevalue("amx_unit")
    isa_level(level)
    rng = np.random.default_rng(len(storage) + 7 * len(act))
    spent = 0
    for rows, cols, T in SHAPES:
        m = Matrix(rng.standard_normal((rows, cols)).astype(np.float32), storage)
        m.act_precision = act
        X = rng.standard_normal((T, cols)).astype(np.float32)
        want = m.gemm(X, threads=2)
        refused(1 << 30)
        got = m.gemm(X, threads=2)
        spent += (1 << 30) - refused(0)
        assert np.array_equal(got, want), (level, storage, act, rows, cols, T)
        # and the kept buffers, reused by later calls of other sizes
        assert np.array_equal(m.gemm(X, threads=2), want)
        assert np.array_equal(m.gemm(X[: T // 2 + 1], threads=1), want[: T // 2 + 1])
    # which kernels take scratch for some of these shapes (so their fallbacks
    # ran above): none at ref; at avx2 the fp4 rows dequantized for the fp32
    # tiles and the integer x q8 tokens-in-lanes kernels; at avx512 the fp32
    # tiles' dequantized rows and column blocks (integer x q8 there is
    # dots-in-lanes, scratch-free); from avx512vnni on all of these
    q8 = act == "int8" and storage in ("int8", "int4", "fp4")
    uses = {"ref": False, "avx2": storage == "fp4" or q8, "avx512": not q8}.get(level, True)
    assert (spent > 0) == uses, spent


@pytest.mark.parametrize("storage", STORAGES)
def test_bf16_without_scratch_raises_memory_error(storage, refused, bf16_unit):
    rng = np.random.default_rng(5)
    m = Matrix(rng.standard_normal((40, 96)).astype(np.float32), storage)
    m.act_precision = "bf16"
    X = rng.standard_normal((7, 96)).astype(np.float32)
    want = m.gemm(X)
    refused(1)  # one thread's call fails: the whole product is refused
    with pytest.raises(MemoryError, match="scratch"):
        m.gemm(X, threads=2)
    assert refused(0) == 0
    assert np.array_equal(m.gemm(X), want)


def test_batch_step_without_scratch_gives_the_same_tokens(refused):
    """A batch's forward is a multi-token call: refusing its kernels scratch
    changes nothing the batch returns."""
    model = small_model("llama", precision="int8")
    model.set_act_precision("int8")
    prompts = [[1, 5, 9, 2], [3, 3, 8], [7, 1, 4, 4, 2], [6, 2], [9, 9, 1]] * 2
    want = model.create_batch_session(prompts, 6).next_tokens(6)
    refused(1 << 30)
    got = model.create_batch_session(prompts, 6).next_tokens(6)
    left = refused(0)
    assert got == want
    # int8 x q8 takes scratch from avx2 on, except at avx512, whose
    # several-token kernel for it is dots in lanes
    assert (left < 1 << 30) == (_kernels.isa() not in ("ref", "avx512"))
