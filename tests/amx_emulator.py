"""The AMX kernels (csrc/gemm/gemm_amx.c, csrc/gemm_q8/gemm_q8_amx.c) on an emulated tile unit.

Where the CPU has no AMX (or Linux does not grant it) the kernels cannot
run, so their logic (tile configurations, addressing, the pipelined
issue/fold steps, row, token and column tails, the bf16 packing, the 4-bit
unpacking) runs over scalar stand-ins for the tile instructions
(tests/native/amx_emulate.h): a small library built with gcc from the
kernel source and tests/native/amx_harness.c. Its kernels either run alone
(``library().cism_emu_gemm_q8``) or fill the amx level of cism's own
dispatch table (``emulated()``), so every test written for a real unit runs
here too. Under tools/sanitize.sh the library is built with the
sanitizers, which then check the bounds of every (emulated) tile load and
store.
"""
import ast
import atexit
import contextlib
import ctypes
import functools
import os
import shutil
import subprocess
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


class Unavailable(Exception):
    """The emulated unit cannot be built or run here (the reason)."""


def amx_flags():
    """setup.py's ISA_FLAGS["amx"], read without running setup.py."""
    with open(os.path.join(ROOT, "setup.py")) as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "ISA_FLAGS":
            return ast.literal_eval(node.value)["amx"]
    raise AssertionError("ISA_FLAGS not found in setup.py")


@functools.lru_cache(maxsize=None)
def _build():
    from cism import _kernels
    feats = _kernels.cpu_features()
    if "avx512vnni" not in _kernels.available_isas() or not feats["avx512_bf16"]:
        raise Unavailable("the AMX kernels' vector parts need AVX-512 VNNI and AVX512-BF16")
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise Unavailable("no C compiler")
    # loaded for the whole session (cism's table may point into it); the
    # file goes at exit
    tmp = tempfile.mkdtemp(prefix="cism-amx-")
    atexit.register(shutil.rmtree, tmp, True)
    lib = os.path.join(tmp, "amx_emulated.so")
    # every AMX CPU has VBMI and GFNI, an AVX-512 VNNI one may not: without
    # them the kernels' portable nibble code is built (as at avx512vnni)
    flags = [f for f in amx_flags()
             if not (f == "-mavx512vbmi" and not feats["avx512vbmi"]) and not (f == "-mgfni" and not feats["gfni"])]
    cmd = [cc, "-std=c11", "-O1", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC", *flags,
           "-I", os.path.join(ROOT, "csrc"), os.path.join(HERE, "native", "amx_harness.c"), "-o", lib, "-lm"]
    sanitize = os.environ.get("CISM_SANITIZE", "").strip()
    if sanitize:
        # under tools/sanitize.sh: the emulated tile loads and stores are
        # plain memory accesses, so AddressSanitizer checks their bounds
        cmd += [f"-fsanitize={sanitize}", "-fno-omit-frame-pointer", "-g"]
        if "undefined" in sanitize.split(","):
            cmd.append("-fno-sanitize-recover=undefined")
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0 and "amx" in p.stderr:
        raise Unavailable(f"the compiler does not take the AMX flags: {p.stderr.strip()[:200]}")
    assert p.returncode == 0, p.stderr
    h = ctypes.CDLL(lib)
    vp, sz = ctypes.c_void_p, ctypes.c_size_t
    h.cism_emu_gemm_q8.argtypes = [ctypes.c_int, vp, sz, sz, sz, sz, vp, vp, vp, sz, sz, sz, sz, sz, vp]
    h.cism_emu_gemm_q8.restype = ctypes.c_int
    h.cism_emu_refused.restype = ctypes.c_int
    return h


def library():
    """The emulated unit's library (built once per session); raises Unavailable."""
    return _build()


@contextlib.contextmanager
def emulated():
    """cism's amx level on the emulated unit, for the duration; fails the
    caller when a kernel asked the unit for a shape the real one refuses."""
    from cism import _kernels
    h = library()
    before = _kernels.isa()
    _kernels._emulate_amx(ctypes.cast(h.cism_emu_fill, ctypes.c_void_p).value)
    try:
        _kernels.set_isa("amx")
        h.cism_emu_refused()
        yield h
        assert not h.cism_emu_refused(), "a kernel used a tile shape or configuration the unit refuses"
    finally:
        _kernels._emulate_amx(0)
        _kernels.set_isa(before if before in _kernels.available_isas() else _kernels.isa_max())
