"""llama.cpp's tokenizer conformance files and its HF -> GGUF converter,
taken from the llama-cpp-python sdist.

llama.cpp ships vocab-only GGUFs with test vectors in its models/ folder
(`ggml-vocab-NAME.gguf`, `.gguf.inp`, `.gguf.out`). The Llama 3 ("llama-bpe")
and Qwen2 ones are 7.8 and 5.9 MB, too big for shared/data, but they sit in the
llama-cpp-python source distribution on PyPI, which CI can reach.

`models_dir()` returns a folder holding the files, in this order of preference:
1. an unpacked sdist named by $CISM_LLAMACPP_SDIST;
2. an unpacked sdist at ~/.cache/llamacpp/llama_cpp_python-0.3.36;
3. the files already extracted by an earlier run into ~/.cache/cism-tests/;
4. otherwise `pip download` of the sdist (checked against its SHA-256) and
   extraction of just those files into ~/.cache/cism-tests/.
A failed download fails the test with pip's message; with $CISM_OFFLINE=1 the
tests are skipped instead (a silent skip would hide a broken CI).

`converter_dir()` does the same for llama.cpp's root folder with
convert_hf_to_gguf.py, its conversion/ package and the gguf-py it imports.
"""
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import pytest

VERSION = "0.3.36"
SDIST = f"llama_cpp_python-{VERSION}"
# sha256 of llama_cpp_python-0.3.36.tar.gz as PyPI serves it (76.6 MB).
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
MODELS = "vendor/llama.cpp/models"
VOCABS = ("llama-bpe", "qwen2")
FILES = tuple(f"ggml-vocab-{v}.gguf{ext}" for v in VOCABS for ext in ("", ".inp", ".out"))


def cache_root():
    return Path.home() / ".cache" / "cism-tests"


def _complete(models):
    return all((models / f).is_file() for f in FILES)


def _candidates():
    env = os.environ.get("CISM_LLAMACPP_SDIST")
    if env:
        yield Path(env) / MODELS
    yield Path.home() / ".cache" / "llamacpp" / SDIST / MODELS
    yield cache_root() / SDIST / MODELS


def _sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _download(dest):
    """pip download the sdist into `dest`; return its path or fail the test."""
    # --no-binary names only the package: with ":all:" pip would also build the
    # sdist's build requirements (scikit-build-core, cmake) from source to read
    # its metadata, which takes many minutes. As it is, about 17 s on this
    # machine with an empty pip cache.
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps",
           "--no-binary", "llama-cpp-python", "--disable-pip-version-check",
           f"llama-cpp-python=={VERSION}", "-d", str(dest)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired:
        pytest.fail(f"`{' '.join(cmd)}` took over 15 minutes; set CISM_OFFLINE=1 to "
                    "skip the llama.cpp tokenizer vectors, or CISM_LLAMACPP_SDIST to an "
                    "unpacked copy of the sdist")
    path = Path(dest) / f"{SDIST}.tar.gz"
    if proc.returncode != 0 or not path.is_file():
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        pytest.fail(f"could not download the llama-cpp-python {VERSION} sdist, which holds "
                    f"llama.cpp's Llama 3 and Qwen2 tokenizer vectors (`{' '.join(cmd)}` "
                    f"exited {proc.returncode}). Without network, set CISM_OFFLINE=1 to skip "
                    f"these tests, or CISM_LLAMACPP_SDIST to an unpacked copy.\n{tail}")
    digest = _sha256(path)
    if digest != SDIST_SHA256:
        pytest.fail(f"{path}: sha256 {digest}, expected {SDIST_SHA256}")
    return path


def _extract(archive, wanted, dest):
    """Copy the members `wanted` names (paths under the sdist's top folder,
    or folder prefixes ending in "/") into `dest`; each file is written
    under a temporary name and renamed, so an interrupted run leaves no half
    file behind."""
    files = {w for w in wanted if not w.endswith("/")}
    folders = tuple(w for w in wanted if w.endswith("/"))
    with tarfile.open(archive, "r:gz") as tf:
        for member in tf:
            rel = member.name[len(SDIST) + 1:] if member.name.startswith(SDIST + "/") else None
            if rel is None or not member.isfile() or not (rel in files or rel.startswith(folders)):
                continue
            if ".." in Path(rel).parts:
                continue
            files.discard(rel)
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(target.name + ".part")
            with tf.extractfile(member) as src, open(tmp, "wb") as dst:
                shutil.copyfileobj(src, dst)
            os.replace(tmp, target)
    if files:
        pytest.fail(f"{archive}: missing {sorted(files)}")


def _fetch(wanted, what):
    """Download the sdist and extract `wanted` into the cache (or skip offline)."""
    if os.environ.get("CISM_OFFLINE") == "1":
        pytest.skip(f"CISM_OFFLINE=1 and llama.cpp's {what} is not cached "
                    f"(llama-cpp-python {VERSION} sdist; see tests/llamacpp_sdist.py)")
    cache_root().mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_root()) as tmp:
        _extract(_download(tmp), wanted, cache_root() / SDIST)


def models_dir():
    for models in _candidates():
        if _complete(models):
            return models
    _fetch([f"{MODELS}/{f}" for f in FILES], "vocab files")
    return cache_root() / SDIST / MODELS


LLAMA_CPP = "vendor/llama.cpp"
CONVERTER = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")


def converter_dir():
    """llama.cpp's folder holding convert_hf_to_gguf.py, conversion/ and gguf-py/."""
    cached = cache_root() / SDIST / LLAMA_CPP
    for models in _candidates():
        root = models.parent
        whole = all((root / p).exists() for p in ("convert_hf_to_gguf.py", "conversion/__init__.py",
                                                   "gguf-py/gguf/__init__.py"))
        # our own extraction counts once it finished (its marker)
        if whole and (root != cached or (root / ".converter-complete").exists()):
            return root
    _fetch([f"{LLAMA_CPP}/{c}" for c in CONVERTER], "converter")
    (cached / ".converter-complete").touch()
    return cached
