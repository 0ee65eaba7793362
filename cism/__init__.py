"""cism: a CPU inference engine for language models.

    import cism
    model = cism.load("path/to/model")          # HF directory, .gguf or llama2.c .bin
    session = model.create_session([1, 2, 3], max_new_tokens=16)
    print(session.next_tokens(16))
"""
import os as _os

# OpenMP threads of libgomp spin for a long time (300k iterations) before
# sleeping. On a machine shared with other busy processes, a spinning thread
# holds a core the other needs and every barrier waits for a descheduled
# peer: decode slowed 3x in our measurements. A short spin keeps back-to-back
# parallel regions fast and yields under contention. Users' own settings win.
if "OMP_WAIT_POLICY" not in _os.environ and "GOMP_SPINCOUNT" not in _os.environ:
    _os.environ["GOMP_SPINCOUNT"] = "10000"

from cism import _kernels  # noqa: E402  (after the OpenMP setting: libgomp reads it on load)
from cism._threads import default_threads as _default_threads  # noqa: E402
from cism._oom import memory_for as _memory_for  # noqa: E402

_kernels.start_threads(_default_threads())   # see start_threads: libgomp exits if it cannot
from cism.paging import OutOfBlocks  # noqa: F401
from cism.tokenizers import Tokenizer  # noqa: F401
from cism.engine import Engine, EngineClosed, QueueFull, Request  # noqa: F401

__version__ = "0.1.0"

FAMILIES = {"llama": "cism.dense", "mistral": "cism.dense", "qwen2": "cism.dense", "qwen3": "cism.dense",
            "fwkv": "cism.fwkv", "surjo": "cism.surjo"}


def load(path, **kwargs):
    """Load a checkpoint and pick the model family from its config's model_type.

    Keyword arguments (precision, threads, act_precision) go to the family's
    Model.from_pretrained."""
    import importlib

    with _memory_for(path, "loading the checkpoint"):   # the loaders' first import too
        from cism.loaders import read_config
        config = read_config(path)
        model_type = config.get("model_type")
        if model_type not in FAMILIES:
            raise ValueError(f"{path}: model_type {model_type!r} is not supported "
                             f"(supported: {', '.join(sorted(FAMILIES))})")
        family = importlib.import_module(FAMILIES[model_type])
        return family.Model.from_pretrained(path, **kwargs)


def show_runtime(file=None):
    """Print the CPU features found, OpenMP, threads and each kernel's variant."""
    import sys

    from cism._threads import default_threads
    out = file or sys.stdout
    feats = _kernels.cpu_features()
    print(f"cism {__version__}", file=out)
    print(f"ISA in use: {_kernels.isa()} (best available: {_kernels.isa_max()}; "
          "set CISM_ISA=ref|avx2|avx512|avx512vnni|amx to cap it)", file=out)
    print("CPU features: " + ", ".join(k for k, v in feats.items() if v), file=out)
    print(f"OpenMP: {'yes' if _kernels.OPENMP else 'NO (single-threaded build)'}; "
          f"default threads: {default_threads()}", file=out)
    for family, variant in _kernels.kernel_variants().items():
        print(f"  {family}: {variant}", file=out)


def runtime_info():
    """The same facts as show_runtime(), as a dict."""
    from cism._threads import default_threads
    return {"version": __version__, "isa": _kernels.isa(), "isa_max": _kernels.isa_max(),
            "cpu_features": _kernels.cpu_features(), "openmp": _kernels.OPENMP,
            "default_threads": default_threads(), "kernels": _kernels.kernel_variants()}
