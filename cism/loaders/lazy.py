"""Lazy tensors: what every loader hands a model when it loads "tensor at a
time" (load_checkpoint(..., lazy=True); every family's from_pretrained).

The protocol the model classes pack from (cism._weights: is_lazy, load_float,
WeightStore.add_any_matrix) is small:

  ``shape``                       the tensor's shape, HF order
  ``load(threads)``               a new float32 C-contiguous array of that shape
  ``load_rows(r0, r1, threads)``  rows [r0, r1) of a 2-D tensor as float32
  ``path``, ``name``              the file and the file's own tensor name, for messages
  ``type_id``, ``raw_rows(r0, r1)`` the ggml type and rows of the tensor's encoded
                                  bytes, for the storages that keep a GGUF's encoding
                                  (q4_k, q6_k)

FileTensor is its one implementation: a tensor of some ggml type (F32, F16
and BF16 cover safetensors and llama2.c files; a GGUF's own type otherwise)
stored row after row at a byte offset of a file. Nothing is read until the
model asks, and then only the rows it asks for, so a model is packed with one
row block of floats in memory at a time and no whole-model float32 copy ever
exists. The loaders check every offset and size against the file before
making one (the file's own header); a file that shrinks afterwards is a
CheckpointError naming the file and the tensor, from read_into.
"""
import math

import numpy as np

from . import ggml_types
from ._common import memory_for, open_file, read_into, rotary_interleaved_to_halves


class FileTensor:
    """One tensor of a checkpoint file, read (and decoded) only when asked.

    ``heads``: llama's q and k in the file's interleaved-pair rotary order;
    rows come back in HF's rotate-half order (each head's rows reordered
    within the head, so a row block is read as whole heads)."""

    __slots__ = ("path", "name", "type_id", "offset", "shape", "heads", "rows", "cols", "row_bytes", "mapping")

    def __init__(self, path, name, type_id, offset, shape, heads=None, mapping=None):
        _, block, block_bytes = ggml_types.GGML_TYPES[type_id]
        self.path, self.name, self.type_id, self.offset = str(path), name, type_id, offset
        self.shape = tuple(int(d) for d in shape)
        self.heads = heads
        # a mapping.FileMap of the file when the model may map this tensor (mmap=True)
        self.mapping = mapping
        self.cols = self.shape[-1] if self.shape else 1
        self.rows = math.prod(self.shape[:-1])        # 1 for a vector or a scalar
        self.row_bytes = self.cols // block * block_bytes

    @property
    def type_name(self):
        return ggml_types.type_name(self.type_id)

    @property
    def nbytes(self):
        """Bytes the tensor takes in the file."""
        return self.rows * self.row_bytes

    def _read(self, r0, r1):
        n = (r1 - r0) * self.row_bytes
        with memory_for(self.path, f"loading tensor {self.name!r} ({n} bytes)"):
            raw = np.empty(n, np.uint8)
            with open_file(self.path) as f:
                read_into(f, self.offset + r0 * self.row_bytes, raw, self.path, f"tensor {self.name!r}")
        return raw

    def _head_rows(self, r0, r1):
        """[r0, r1) widened to whole heads when the rows are reordered within heads."""
        if not self.heads:
            return r0, r1
        h = self.rows // self.heads
        return r0 // h * h, -(-r1 // h) * h

    def _hf_order(self, block, a, b, r0, r1):
        """Rows [a, b) of the file (whole heads) -> rows [r0, r1) in HF order."""
        if not self.heads:
            return block
        with memory_for(self.path, f"loading tensor {self.name!r} (its rotary pairs reordered)"):
            block = rotary_interleaved_to_halves(block, (b - a) // (self.rows // self.heads))
            if (a, b) != (r0, r1):
                block = np.ascontiguousarray(block[r0 - a:r1 - a])
        return block

    def _check_rows(self, r0, r1):
        if not 0 <= r0 <= r1 <= self.rows:
            raise IndexError(f"rows [{r0}, {r1}) of a {self.rows}-row tensor")
        return self._head_rows(r0, r1)

    def raw_rows(self, r0, r1):
        """Rows [r0, r1) of the tensor's encoded bytes, uint8 (r1 - r0, row_bytes)."""
        a, b = self._check_rows(r0, r1)
        return self._hf_order(self._read(a, b).reshape(b - a, self.row_bytes), a, b, r0, r1)

    def raw(self):
        """The tensor's encoded bytes, uint8 (rows, row_bytes), rows in HF order."""
        return self.raw_rows(0, self.rows)

    def load_rows(self, r0, r1, threads=1):
        """Rows [r0, r1) as a new float32 (r1 - r0, cols) array, decoded by
        the C decoder (csrc/ggml.h: gguf-py's bits whatever ``threads``)."""
        a, b = self._check_rows(r0, r1)
        raw = self._read(a, b)
        with memory_for(self.path, f"loading tensor {self.name!r} "
                                   f"({4 * (b - a) * self.cols} bytes as float32)"):
            out = np.empty((b - a, self.cols), np.float32)
        ggml_types.dequantize_into(self.type_id, raw, out.reshape(-1), threads)
        del raw
        return self._hf_order(out, a, b, r0, r1)

    def load(self, threads=1):
        """The whole tensor as a new float32 C-contiguous array of ``shape``."""
        return self.load_rows(0, self.rows, threads).reshape(self.shape)

    def __repr__(self):
        return f"FileTensor({self.name!r}, {self.type_name}, shape={self.shape}, file={self.path!r})"


def load_all(tensors, threads=1):
    """name -> float32 array for a dict of lazy tensors, read one after another."""
    return {name: t.load(threads) for name, t in tensors.items()}
