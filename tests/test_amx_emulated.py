"""The AMX integer kernels (csrc/gemm_q8/gemm_q8_amx.c) on an emulated tile unit.

Where the CPU has no AMX (or Linux does not grant it) the kernels cannot
run, so their logic (tile configurations, addressing, the pipelined
issue/fold steps, row and token tails, the 4-bit unpacking) is tested here
over scalar stand-ins for the tile instructions (tests/native/amx_emulate.h):
a small library built with gcc from the kernel source and the harness,
compared bit for bit with the reference kernels. On AMX machines
tests/test_matrix.py runs the same kernels on the real unit. Under
tools/sanitize.sh the library is built with the sanitizers, which then
check the bounds of every (emulated) tile load and store.
"""
import ast
import ctypes
import os
import shutil
import subprocess

import numpy as np
import pytest

from cism import _kernels
from cism.matrix import Matrix

from conftest import runnable_isas

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def amx_flags():
    """setup.py's ISA_FLAGS["amx"], read without running setup.py."""
    with open(os.path.join(ROOT, "setup.py")) as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "ISA_FLAGS":
            return ast.literal_eval(node.value)["amx"]
    raise AssertionError("ISA_FLAGS not found in setup.py")


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    if "avx512vnni" not in runnable_isas():
        pytest.skip("the AMX kernels' vector parts need AVX-512 VNNI")
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler")
    lib = str(tmp_path_factory.mktemp("amx") / "amx_emulated.so")
    # every AMX CPU has VBMI and GFNI, an AVX-512 VNNI one may not: without
    # them the kernels' portable nibble code is built (as at avx512vnni)
    feats = _kernels.cpu_features()
    flags = [f for f in amx_flags()
             if not (f == "-mavx512vbmi" and not feats["avx512vbmi"]) and not (f == "-mgfni" and not feats["gfni"])]
    cmd = [cc, "-std=c11", "-O1", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC", *flags,
           "-I", os.path.join(ROOT, "csrc"), os.path.join(HERE, "native", "amx_harness.c"), "-o", lib]
    sanitize = os.environ.get("CISM_SANITIZE", "").strip()
    if sanitize:
        # under tools/sanitize.sh: the emulated tile loads and stores are
        # plain memory accesses, so AddressSanitizer checks their bounds
        cmd += [f"-fsanitize={sanitize}", "-fno-omit-frame-pointer", "-g"]
        if "undefined" in sanitize.split(","):
            cmd.append("-fno-sanitize-recover=undefined")
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0 and "amx" in p.stderr:
        pytest.skip(f"the compiler does not take the AMX flags: {p.stderr.strip()[:200]}")
    assert p.returncode == 0, p.stderr
    h = ctypes.CDLL(lib)
    vp, sz = ctypes.c_void_p, ctypes.c_size_t
    h.cism_emu_gemm_q8.argtypes = [ctypes.c_int, vp, sz, sz, sz, sz, vp, vp, vp, sz, sz, sz, sz, sz, vp]
    h.cism_emu_gemm_q8.restype = ctypes.c_int
    return h


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
