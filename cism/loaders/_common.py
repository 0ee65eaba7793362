"""What every loader shares: the error type, the result type, bounded reads and
the rule for which files inside a model directory may be opened."""
import os
from dataclasses import dataclass

import numpy as np

from cism._oom import memory_for  # noqa: F401  (re-exported: cism.loaders.memory_for)


class CheckpointError(ValueError):
    """A checkpoint is unreadable, or inconsistent with its own header.

    The message always starts with the file (and the tensor, when one is at
    fault); ``.path``, ``.tensor`` and ``.problem`` hold the same for programs.
    """

    def __init__(self, path, problem, tensor=None):
        # args mirror the constructor so the exception pickles and copies.
        super().__init__(str(path), problem, tensor)
        self.path = str(path)
        self.problem = problem
        self.tensor = tensor

    def __str__(self):
        where = self.path if self.tensor is None else f"{self.path}: tensor {self.tensor!r}"
        return f"{where}: {self.problem}"


@dataclass
class Checkpoint:
    config: dict            # HF config.json-style, always with "model_type"
    weights: dict           # HF tensor name -> float32 C-contiguous ndarray, HF shape
                            # (or a lazy.FileTensor, read when packed: a lazy load)
    path: str               # the directory or file that was loaded
    format: str             # "hf" | "gguf" | "llama2c"
    tokenizer: dict | None  # {"kind": "hf_dir"|"gguf"|"llama2c", "path": ...} or None
    types: dict | None = None   # GGUF: HF tensor name -> the file's ggml type name


def file_size(path):
    """Size of a regular file, or CheckpointError (missing, a directory, unreadable)."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise CheckpointError(path, f"cannot open: {e.strerror or e}") from None
    if not os.path.isfile(path):
        raise CheckpointError(path, "not a regular file")
    return st.st_size


def open_file(path):
    try:
        return open(path, "rb")
    except OSError as e:
        raise CheckpointError(path, f"cannot open: {e.strerror or e}") from None


def read_into(f, offset, out, path, what):
    """Fill ``out`` (any contiguous ndarray) from byte ``offset`` of the open file.

    Plain reads rather than np.memmap: the weights are copied anyway, and a
    mapped file that shrinks under us would kill the process with SIGBUS where
    a short read is just an error.
    """
    view = memoryview(out).cast("B")
    try:
        f.seek(offset)
        done = 0
        while done < len(view):
            n = f.readinto(view[done:])
            if not n:
                break
            done += n
    except OSError as e:
        raise CheckpointError(path, f"read error in {what}: {e.strerror or e}") from None
    if done != len(view):
        raise CheckpointError(path, f"file ended inside {what} (got {done} of {len(view)} bytes)")


def read_small_file(path, limit, what):
    """Whole contents of a small file (config, index), refusing anything over ``limit``."""
    size = file_size(path)
    if size > limit:
        raise CheckpointError(path, f"{what} is {size} bytes, over the {limit}-byte limit")
    with open_file(path) as f:
        try:
            # Not f.read(limit + 1): that allocates the whole limit up front.
            data = f.read(size + 1)
        except OSError as e:
            raise CheckpointError(path, f"read error: {e.strerror or e}") from None
    if len(data) > limit:
        raise CheckpointError(path, f"{what} grew past the {limit}-byte limit while reading")
    return data


def _in_hf_cache_blobs(root, real):
    """True when ``root`` is a Hugging Face hub snapshot (``models--x/snapshots/<rev>``)
    and ``real`` is one of that repository's blobs: the hub stores every file of a
    snapshot as a symlink to ``../../blobs/<hash>``, and refusing those would make
    the most common checkpoint location unloadable."""
    snapshots = os.path.dirname(root)
    repo = os.path.dirname(snapshots)
    return (os.path.basename(snapshots) == "snapshots"
            and os.path.basename(repo).startswith("models--")
            and os.path.dirname(real) == os.path.join(repo, "blobs"))


def file_in_dir(directory, name, what):
    """The path of the file ``name`` directly inside ``directory``, for reading.

    ``name`` comes from files we do not trust (an index's weight_map), so it must
    be a plain file name, and what it resolves to (after symlinks) must still lie
    in the directory, or be a blob of the same Hugging Face cache repository.
    The path returned is the one the user will recognise (directory/name).
    """
    if (not isinstance(name, str) or not name or name in (".", "..") or "/" in name
            or "\\" in name or "\0" in name or os.path.isabs(name)):
        raise CheckpointError(directory, f"{what} {name!r} is not a plain file name inside the directory")
    shown = os.path.join(directory, name)
    root = os.path.realpath(directory)
    real = os.path.realpath(shown)
    if os.path.commonpath([root, real]) != root and not _in_hf_cache_blobs(root, real):
        raise CheckpointError(shown, f"{what} {name!r} resolves to {real}, outside the model "
                              f"directory {root}")
    if not os.path.exists(real):
        raise CheckpointError(shown, f"{what} {name!r} is missing")
    if not os.path.isfile(real):
        raise CheckpointError(shown, f"{what} {name!r} is not a regular file")
    return shown


# numpy refuses arrays whose shape, zero dimensions counted as one, spans more
# bytes than an intp can hold; a zero-element tensor can still claim such a
# shape in a file, and would then fail inside numpy without naming the file.
MAX_SHAPE_BYTES = 1 << 62


def check_addressable(path, shape, itemsize, tensor):
    """CheckpointError unless an array of ``shape`` (float32 after loading,
    ``itemsize`` bytes per element) could exist, even with zero elements."""
    span = itemsize
    for d in shape:
        span *= max(int(d), 1)
    if span > MAX_SHAPE_BYTES:
        raise CheckpointError(path, f"shape {list(shape)} is too large to address", tensor)


def rotary_interleaved_to_halves(w, n_heads):
    """Reorder the rows of a q or k projection from the interleaved-pair rotary
    convention (Meta/llama2.c/ggml: pairs (2i, 2i+1) rotate together) to HF's
    rotate-half convention (rows i and i + head_dim/2 rotate together).

    This is transformers' convert_llama_weights_to_hf ``permute`` and the
    inverse of llama.cpp's ``LlamaModel.permute``: within each head, row 2i
    moves to i and row 2i+1 to i + head_dim/2.
    """
    rows, cols = w.shape
    head_dim = rows // n_heads
    return np.ascontiguousarray(
        w.reshape(n_heads, head_dim // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols))
