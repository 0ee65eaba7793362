"""Safetensors files, parsed here rather than by the safetensors package so that
every header field is checked against the file before anything is allocated.

Layout: an 8-byte little-endian header length N, N bytes of JSON mapping each
tensor name to {"dtype", "shape", "data_offsets": [begin, end]} (offsets are
relative to byte 8 + N) plus an optional "__metadata__" object, then the data.
"""
import json
import math
import sys
from dataclasses import dataclass

import numpy as np

from . import ggml_types
from ._common import CheckpointError, check_addressable, file_size, open_file, read_into
from .lazy import FileTensor, load_all
from .mapping import FileMap

# A header is a few hundred bytes per tensor; the reference implementation
# refuses anything over 100 MB, and so do we.
MAX_HEADER_BYTES = 100 * 1024 * 1024

# dtype -> (numpy dtype of the stored elements, bytes per element)
_DTYPES = {"F32": ("<f4", 4), "F16": ("<f2", 2), "BF16": ("<u2", 2)}


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str          # "F32" | "F16" | "BF16"
    shape: tuple
    begin: int          # absolute byte offset in the file
    end: int


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _reject_duplicates(path, what):
    def hook(pairs):
        seen = set()
        for key, _ in pairs:
            if key in seen:
                raise CheckpointError(path, f"{what} has the key {key!r} twice")
            seen.add(key)
        return dict(pairs)
    return hook


def parse_json(path, data, what):
    """JSON text -> object, with duplicate keys as an error (json keeps the last
    silently, which would hide a corrupt or hand-edited file)."""
    try:
        return json.loads(data.decode("utf-8"), object_pairs_hook=_reject_duplicates(path, what))
    except UnicodeDecodeError as e:
        raise CheckpointError(path, f"{what} is not UTF-8 ({e.reason} at byte {e.start})") from None
    except CheckpointError:
        raise
    except json.JSONDecodeError as e:
        raise CheckpointError(path, f"{what} is not valid JSON: {e}") from None
    except ValueError:   # an integer literal longer than int() takes (sys.set_int_max_str_digits)
        raise CheckpointError(path, f"{what} holds an integer literal of more than "
                                    f"{sys.get_int_max_str_digits()} digits") from None
    except RecursionError:
        raise CheckpointError(path, f"{what} nests too deeply") from None


def read_header(path):
    """Validated entries of one safetensors file, sorted by offset: (entries, metadata)."""
    size = file_size(path)
    if size < 8:
        raise CheckpointError(path, f"{size} bytes is too short for a safetensors header")
    with open_file(path) as f:
        prefix = np.empty(8, np.uint8)
        read_into(f, 0, prefix, path, "the header length")
        n = int(prefix.view("<u8")[0])
        if n > MAX_HEADER_BYTES:
            raise CheckpointError(path, f"header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit")
        if 8 + n > size:
            raise CheckpointError(path, f"header length {n} (after the 8-byte length) runs past the end of the {size}-byte file")
        raw = np.empty(n, np.uint8)
        read_into(f, 8, raw, path, "the header")
    header = parse_json(path, raw.tobytes(), "the header")
    if not isinstance(header, dict):
        raise CheckpointError(path, f"header is a JSON {type(header).__name__}, expected an object")

    data_start = 8 + n
    data_size = size - data_start
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not isinstance(metadata, dict):
        raise CheckpointError(path, "__metadata__ is not a JSON object")

    entries = []
    for name, info in header.items():
        entries.append(_entry(path, name, info, data_start, data_size))

    # Overlapping ranges would alias two tensors to the same bytes: a corrupt
    # or crafted file either way.
    entries.sort(key=lambda e: (e.begin, e.end))
    prev = None
    for e in entries:
        if prev is not None and e.begin < prev.end:
            raise CheckpointError(path, f"data overlaps tensor {prev.name!r} "
                                  f"([{prev.begin}, {prev.end}) vs [{e.begin}, {e.end}))", e.name)
        if prev is None or e.end > prev.end:
            prev = e
    return entries, metadata or {}


def _entry(path, name, info, data_start, data_size):
    if not isinstance(info, dict):
        raise CheckpointError(path, f"header entry is a JSON {type(info).__name__}, expected an object", name)
    for key in ("dtype", "shape", "data_offsets"):
        if key not in info:
            raise CheckpointError(path, f"header entry has no {key!r}", name)
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str):
        raise CheckpointError(path, f"dtype is {dtype!r}, expected a string", name)
    if dtype not in _DTYPES:
        raise CheckpointError(path, f"dtype {dtype} is not supported (F32, F16 or BF16)", name)
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise CheckpointError(path, f"shape {shape!r} is not a list of non-negative integers", name)
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(_is_int(o) and o >= 0 for o in offsets)):
        raise CheckpointError(path, f"data_offsets {offsets!r} is not two non-negative integers", name)
    begin, end = offsets
    if begin > end or end > data_size:
        raise CheckpointError(path, f"data_offsets [{begin}, {end}) lie outside the "
                              f"{data_size}-byte data section", name)
    # Python integers: a shape crafted to overflow 64 bits still compares honestly.
    nbytes = math.prod(shape) * _DTYPES[dtype][1]
    if nbytes != end - begin:
        raise CheckpointError(path, f"shape {shape} in {dtype} needs {nbytes} bytes but "
                              f"data_offsets span {end - begin}", name)
    check_addressable(path, shape, 4, name)   # only a zero-element shape can still fail
    return TensorEntry(name, dtype, tuple(shape), data_start + begin, data_start + end)


# safetensors dtype -> the ggml type of the same bytes (lazy.FileTensor decodes
# them: bf16 widened by a shift, exact; f16 by F16C or the C reference)
GGML_TYPE = {"F32": ggml_types.F32, "F16": ggml_types.F16, "BF16": ggml_types.BF16}


def lazy_tensors(path, entries, mmap=False):
    """name -> lazy.FileTensor for the given entries of one file (nothing
    read); ``mmap``: the tensors share one mapping.FileMap of the file, which
    the model may multiply in place (safetensors is little-endian)."""
    mapping = FileMap(path) if mmap else None
    return {e.name: FileTensor(path, e.name, GGML_TYPE[e.dtype], e.begin, e.shape, mapping=mapping)
            for e in entries}


def read_tensors(path, entries):
    """Load the given entries of one file as float32 arrays in their shapes."""
    return load_all(lazy_tensors(path, entries))
