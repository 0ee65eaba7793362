"""Build cism: C kernels compiled per ISA with only their own flags, and the
Cython modules, with OpenMP when the compiler really has it.

Switches (environment variables at build time):
  CISM_DEBUG=1         Cython bounds/wraparound checks on, -O0 -g
  CISM_SANITIZE=...    e.g. "address,undefined": build with those sanitizers
  CISM_NO_OPENMP=1     build single-threaded even when OpenMP works
"""
import glob
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
DEBUG = os.environ.get("CISM_DEBUG", "") not in ("", "0")
SANITIZE = os.environ.get("CISM_SANITIZE", "").strip()
X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")

# Every compile: no silent FMA contraction (results must not depend on the
# compiler's choices), no global -march.
BASE_CFLAGS = ["-std=c11", "-ffp-contract=off", "-fno-math-errno"]
OPT_CFLAGS = ["-O0", "-g"] if DEBUG else ["-O3"]
SAN_FLAGS = [f"-fsanitize={SANITIZE}", "-fno-omit-frame-pointer", "-g"] if SANITIZE else []
# Undefined behaviour aborts at its first report instead of printing and going
# on, so a test run cannot pass over it (docs/HARDENING.md).
if "undefined" in SANITIZE.split(","):
    SAN_FLAGS.append("-fno-sanitize-recover=undefined")

# ISA variants: name -> flags. One table; nothing ISA-specific anywhere else.
ISA_FLAGS = {
    "ref": [],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "avx512": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"],
    "avx512vnni": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl",
                   "-mavx512dq", "-mavx512vnni"],
    # the opt-in bf16 precision without AMX (VDPBF16PS; installed at run time
    # only where the CPU has AVX512-BF16)
    "avx512bf16": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl",
                   "-mavx512dq", "-mavx512vnni", "-mavx512bf16"],
    # every AMX CPU also has AVX512-VBMI and GFNI (fp4 lookups, int4 nibbles)
    "amx": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl",
            "-mavx512dq", "-mavx512vnni", "-mavx512vbmi", "-mgfni", "-mavx512bf16",
            "-mamx-tile", "-mamx-bf16", "-mamx-int8"],
}
# Kernel families: one folder each, one file per ISA it has a variant for
# (csrc/<family>/<family>_<isa>.c); the SIMD helpers the files share are
# headers in csrc/ (csrc/kernels.h lists what each family holds).
KERNEL_FAMILIES = {
    # fp32 activations; avx512bf16 and amx: the opt-in bf16 precision
    "gemm": ["ref", "avx2", "avx512", "avx512bf16", "amx"],
    "gemm_q8": ["ref", "avx2", "avx512", "avx512vnni", "amx"],  # integer weights x q8
    "attn": ["ref", "avx2", "avx512", "avx512bf16"],  # avx512bf16: bf16 prefill's prompt attention
    "convert": ["ref", "avx2", "avx512"],
    "act": ["ref", "avx2", "avx512"],
}
# Kernel sources: (path, ISA). x86 variants are skipped on other machines.
KERNEL_SOURCES = [(f"csrc/{family}/{family}_{isa}.c", isa)
                  for family, isas in KERNEL_FAMILIES.items() for isa in isas]
KERNEL_SOURCES += [("csrc/dispatch.c", "ref"), ("csrc/scratch.c", "ref")]
# Every shared header: a change to any of them rebuilds what includes it
# (flag.h and memscan.h are included by Cython modules, not only by kernels).
HEADERS = sorted(glob.glob(os.path.join("csrc", "*.h")))


def probe_openmp():
    """Compile, link and run a tiny OpenMP program; return the flags or None."""
    if os.environ.get("CISM_NO_OPENMP", "") not in ("", "0"):
        return None
    cc = sysconfig.get_config_var("CC") or "cc"
    cc = cc.split()[0]
    src = "#include <omp.h>\nint main(void){int n=0;\n#pragma omp parallel reduction(+:n)\nn+=1;\nreturn n>0&&omp_get_max_threads()>0?0:1;}\n"
    with tempfile.TemporaryDirectory() as tmp:
        c_path = os.path.join(tmp, "probe.c")
        exe = os.path.join(tmp, "probe")
        with open(c_path, "w") as f:
            f.write(src)
        try:
            subprocess.run([cc, "-fopenmp", c_path, "-o", exe], check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120)
            subprocess.run([exe], check=True, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, timeout=60)
        except (OSError, subprocess.SubprocessError):
            return None
    return ["-fopenmp"]


def probe_amx():
    """Whether the compiler takes the AMX (tile, bf16, int8) and AVX512-BF16 flags
    and intrinsics (GCC 11+, Clang 12+); without them neither the "amx" level nor the AVX512-BF16 bf16 kernel is built."""
    if not X86 or os.environ.get("CISM_NO_AMX", "") not in ("", "0"):
        return False
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    src = ("#include <immintrin.h>\nint main(void){_tile_zero(0);_tile_release();"
           "_tile_dpbssd(0,1,2);__m512 a=_mm512_setzero_ps();__m256bh b=_mm512_cvtneps_pbh(a);(void)b;return 0;}\n")
    with tempfile.TemporaryDirectory() as tmp:
        c_path = os.path.join(tmp, "probe.c")
        with open(c_path, "w") as f:
            f.write(src)
        try:
            subprocess.run([cc, "-c", *ISA_FLAGS["amx"], c_path, "-o", os.path.join(tmp, "probe.o")],
                           check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120)
        except (OSError, subprocess.SubprocessError):
            return False
    return True


HAVE_AMX = probe_amx()
OPENMP = probe_openmp()
if OPENMP is None:
    bar = "!" * 72
    print(f"\n{bar}\ncism: OpenMP is NOT available with this compiler; building a\n"
          f"single-threaded library (results are identical, only slower).\n{bar}\n",
          file=sys.stderr)


class BuildExt(build_ext):
    """Compile each kernel source with its own ISA flags, then link them."""

    def build_extensions(self):
        objects = []
        for path, isa in KERNEL_SOURCES:
            if (isa != "ref" and not X86) or (isa in ("amx", "avx512bf16") and not HAVE_AMX):
                continue
            flags = BASE_CFLAGS + OPT_CFLAGS + SAN_FLAGS + ["-fPIC"] + ISA_FLAGS[isa]
            objects += self.compiler.compile(
                [path], output_dir=self.build_temp, include_dirs=["csrc"],
                macros=[("CISM_HAVE_AMX", "1")] if HAVE_AMX else [],
                extra_postargs=flags, depends=HEADERS)
        for ext in self.extensions:
            if ext.name == "cism._kernels":
                ext.extra_objects = list(objects)
                # relink when a kernel object changes, not only the .pyx
                ext.depends = list(ext.depends) + [p for p, _ in KERNEL_SOURCES]
        super().build_extensions()


def extension(name, sources, extra_cflags=()):
    compile_args = ["-ffp-contract=off", "-fno-math-errno", "-Wno-unused-function",
                    "-Wno-unreachable-code"] + OPT_CFLAGS + SAN_FLAGS + (OPENMP or []) + list(extra_cflags)
    link_args = SAN_FLAGS + (OPENMP or []) + ["-lm"]
    return Extension(
        name, sources, include_dirs=["csrc", numpy.get_include()],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
        extra_compile_args=compile_args, extra_link_args=link_args,
        depends=HEADERS)


EXTENSIONS = [
    extension("cism._kernels", ["cism/_kernels.pyx"]),
    extension("cism._bandwidth", ["cism/_bandwidth.pyx"]),
    extension("cism.loaders._ggml_decode", ["cism/loaders/_ggml_decode.pyx"]),
    # -fno-trapping-math lets the packing loops (csrc/pack.c) turn their float
    # compares into vector selects; values are unchanged, only FP exception
    # flags (which nothing reads) may differ.
    extension("cism.matrix", ["cism/matrix.pyx", "csrc/pack.c"], ["-fno-trapping-math"]),
    extension("cism.sampling", ["cism/sampling.pyx", "csrc/sample.c"]),
    extension("cism._status", ["cism/_status.pyx"]),
    extension("cism._checks", ["cism/_checks.pyx"]),
    extension("cism._weights", ["cism/_weights.pyx"]),
    extension("cism._step", ["cism/_step.pyx"]),
    extension("cism._session", ["cism/_session.pyx"]),
    extension("cism.paging", ["cism/paging.pyx"]),
    extension("cism._paged", ["cism/_paged.pyx"]),
    extension("cism._dense", ["cism/_dense.pyx"]),
    extension("cism._fwkv", ["cism/_fwkv.pyx"]),
    extension("cism._surjo", ["cism/_surjo.pyx"]),
    extension("cism._surjo_session", ["cism/_surjo_session.pyx"]),
    extension("cism._prefix", ["cism/_prefix.pyx"]),
    extension("cism._requests", ["cism/_requests.pyx"]),
    extension("cism._scheduler", ["cism/_scheduler.pyx"]),
    extension("cism._engine_step", ["cism/_engine_step.pyx"]),
    extension("cism._engine", ["cism/_engine.pyx"]),
    extension("cism._batch", ["cism/_batch.pyx"]),
]

DIRECTIVES = {
    "language_level": 3,
    "boundscheck": DEBUG,
    "wraparound": DEBUG,
    "initializedcheck": DEBUG,
    "cdivision": not DEBUG,
    "embedsignature": True,
}

setup(
    ext_modules=cythonize(EXTENSIONS, compiler_directives=DIRECTIVES),
    cmdclass={"build_ext": BuildExt},
)
