"""Checkpoint loaders: Hugging Face directories, GGUF files and llama2.c .bin
files, each turned into one ``Checkpoint`` (an HF-style config dict plus float32
weights under HF tensor names, or lazy tensors that the model reads one at a
time as it packs them: lazy.FileTensor).

Loaders check the FILE (format, sizes, dtypes, shapes against the file's own
header, paths staying inside the model directory) and raise CheckpointError,
a ValueError naming the file, for anything wrong. Whether the tensor set fits
the config is the model classes' check, with the spec's messages.
"""
import os

from ._common import Checkpoint, CheckpointError, memory_for
from .gguf_file import GGUF_MAGIC, load_gguf, read_gguf_metadata
from .hf_dir import load_hf_dir
from .llama2c import load_llama2c
from . import gguf_file, hf_dir, llama2c

__all__ = ["Checkpoint", "CheckpointError", "load_checkpoint", "load_hf_dir", "load_gguf",
           "load_llama2c", "read_config", "read_gguf_metadata"]


def _kind(path):
    """"hf", "gguf" or "llama2c" for an existing path; CheckpointError otherwise."""
    if os.path.isdir(path):
        return "hf"
    if not os.path.exists(path):
        raise CheckpointError(path, "no such file or directory")
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise CheckpointError(path, f"cannot open: {e.strerror or e}") from None
    name = os.path.basename(path)
    if magic == GGUF_MAGIC or name.endswith(".gguf"):
        return "gguf"        # a wrong magic in a .gguf is reported by the GGUF parser
    if name.endswith(".safetensors") or name in ("config.json", "model.safetensors.index.json"):
        raise CheckpointError(path, "is part of a Hugging Face model; load its directory instead")
    return "llama2c"         # the legacy format has no magic: its header and size are checked


def load_checkpoint(path, keep_quantized=False, lazy=False, mmap=False):
    """Load any supported checkpoint: a directory is a Hugging Face model, a file
    starting with "GGUF" (or named *.gguf) is GGUF, anything else must be a
    llama2.c .bin whose header matches its size exactly. Weights are float32
    arrays; with ``lazy`` (or its older name ``keep_quantized``) they are
    lazy.FileTensors, checked against the file but not read. ``mmap`` (with
    ``lazy``; GGUF and safetensors files): the tensors carry a shared
    mapping.FileMap of their file, and a model maps the ones whose storage
    is the file's own encoding instead of copying them (mapping.py)."""
    path = os.fspath(path)
    lazy = lazy or keep_quantized
    with memory_for(path, "loading the checkpoint"):
        kind = _kind(path)
        if kind == "hf":
            return load_hf_dir(path, lazy=lazy, mmap=mmap)
        if kind == "gguf":
            return load_gguf(path, lazy=lazy, mmap=mmap)
        return load_llama2c(path, lazy=lazy)


def build_pretrained(model_class, path, precision, threads, act_precision, mmap=False, **options):
    """Load a checkpoint and build a model_class from it (every family's
    Model.from_pretrained; options go to the model's constructor). The
    model reads every tensor lazily as it packs it (lazy.FileTensor), a row
    block at a time, so no whole-model float32 copy exists; a GGUF's Q4_K
    and Q6_K matrices may be packed in their own encoding.

    precision "auto" (or its synonym "native"): each GGUF tensor keeps its
    file encoding where cism has a native storage for it, and otherwise
    takes the storage ggml_types.auto_storage names; any other checkpoint
    loads at fp32.

    ``mmap``: tensors whose storage is the file's encoding are mapped from
    the file (read-only, shared page cache) instead of copied
    (cism/loaders/mapping.py); the model then checks before each forward
    call that the file has not changed."""
    path = os.fspath(path)
    with memory_for(path, "loading the checkpoint"):
        ckpt = load_checkpoint(path, lazy=True, mmap=mmap)
        config = model_class.config_class.from_hf(ckpt.config)
        if precision in ("auto", "native"):
            if ckpt.types and getattr(model_class, "takes_ggml_tensors", False):
                from .ggml_types import auto_storages
                options["storages"] = auto_storages(ckpt.types)
            else:
                precision = "fp32"
        with memory_for(path, f"packing the weights at {precision}"):
            model = model_class(config, ckpt.weights, precision=precision, threads=threads,
                                act_precision=act_precision, **options)
        model.source = ckpt
        ckpt.weights = None  # the packed matrices hold everything now (a mapped file stays open: FileMap)
    return model


def read_config(path):
    """Just the HF-style config of any supported checkpoint, without reading weights."""
    path = os.fspath(path)
    with memory_for(path, "reading its config"):
        kind = _kind(path)
        if kind == "hf":
            return hf_dir.read_config(path)
        if kind == "gguf":
            return gguf_file.read_config(path)
        return llama2c.read_config(path)
