"""Weights mapped from their file instead of copied (``mmap=True``).

A tensor whose storage is byte for byte the file's encoding (F32 kept at
fp32, F16 at fp16, a GGUF's Q4_K / Q6_K at q4_k / q6_k) can be multiplied
where the file's pages sit in the page cache: several processes or replicas
of one model then share one copy of the weights. What a packed buffer must
give the kernels (csrc/formats.h, and the kernels' loads):

* Alignment. No kernel uses an aligned vector load on weight memory (every
  weight load is ``loadu``/masked, or a tile load; the aligned loads in
  csrc/gemm/ all read activation scratch), and the scalar references read
  fp32 as ``float`` and fp16 / K-quant scales as ``uint16_t`` or bytes. So a
  mapped tensor needs its element alignment: 4 bytes for fp32, 2 for fp16,
  q4_k and q6_k (a copied q6_k matrix's rows are only 2-byte aligned
  anyway: 210-byte blocks). The 64-byte alignment formats.h promises is a
  cache-line preference of cism's own buffers, not a requirement of a load.
  A mmap'd address has the file offset's alignment modulo the page size.
* Slack. Kernels may read up to CISM_SLACK bytes past the matrix's last
  row (a whole vector of a tail); those bytes must be readable. Their value
  never matters: a row's over-read lanes are masked or set to -0 and never
  folded in (csrc/kernels.h, gemm_avx2.c's header), which every row but the
  last already relies on, since the bytes after it are the next row's. So a
  tensor maps when ``end + CISM_SLACK`` lies inside the file or inside the
  zero-filled rest of the file's last page; past that the mapping would
  fault, and the tensor is copied.
* Byte order. GGUF (the parser rejects big-endian files) and safetensors
  are little-endian; a big-endian host copies (and decodes).
* Row order. llama's q and k rows of a GGUF are reordered (the interleaved
  rotary pairs to HF's rotate-half), so they are copied.

Anything else that fails (a finite check, an odd offset) falls back to the
copy, which reports the problem as it always did.

MAP_SHARED with PROT_READ: pages are the page cache's own, shared with every
process mapping the file, and the file is opened read-only, so the mapping
can never be made writable (mprotect would fail) and cism can never write
the file. (A read-only MAP_PRIVATE mapping would share the same pages; it
only differs once written, which PROT_READ forbids, so it adds nothing.)

The mapped file must not change underneath: ``FileMap.check`` compares the
file's (device, inode, size, mtime_ns) by fstat on the mapped descriptor
against the values at load, and the models call it before every forward
call (docs/HARDENING.md states what remains).
"""
import mmap as _mmap
import os
import sys

import numpy as np

from . import ggml_types
from ._common import CheckpointError

SLACK = 128          # csrc/formats.h CISM_SLACK
PAGE = _mmap.PAGESIZE

# ggml type -> the storage that holds its bytes unchanged, and that storage's alignment
FILE_STORAGE = {ggml_types.F32: ("fp32", 4), ggml_types.F16: ("fp16", 2), 12: ("q4_k", 2), 14: ("q6_k", 2)}


class FileMap:
    """One read-only shared mapping of a whole checkpoint file, made on the
    first tensor that maps (a load that maps nothing maps no file)."""

    def __init__(self, path):
        self.path = str(path)
        self._mm = None
        self._fd = None
        self.array = None
        self.identity = None
        self.mapped_bytes = 0

    def _open(self):
        if self._mm is not None:
            return
        fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            st = os.fstat(fd)
            if st.st_size == 0:
                raise CheckpointError(self.path, "is empty")
            mm = _mmap.mmap(fd, st.st_size, flags=_mmap.MAP_SHARED, prot=_mmap.PROT_READ)
        except BaseException:
            os.close(fd)
            raise
        self._fd, self._mm = fd, mm
        self.identity = _identity(st)
        self.size = st.st_size
        self.array = np.frombuffer(mm, np.uint8)     # read-only: mm is PROT_READ

    def view(self, tensor, storage):
        """(uint8 view of the tensor's bytes, None), or (None, why it is copied)."""
        if sys.byteorder != "little":
            return None, "big-endian host"
        want = FILE_STORAGE.get(tensor.type_id)
        if want is None or want[0] != storage:
            return None, f"{tensor.type_name} packed as {storage}"
        if tensor.heads:
            return None, "rows reordered (llama rotary pairs)"
        align = want[1]
        start, n = tensor.offset, tensor.nbytes
        if start % align:
            return None, f"offset {start} not {align}-byte aligned"
        self._open()
        if start + n + SLACK > -(-self.size // PAGE) * PAGE:
            return None, f"no {SLACK} readable bytes after it (end of file)"
        if start + n > self.size:     # the header's checks ran on this size already
            raise CheckpointError(self.path, f"data [{start}, {start + n}) runs past the end of the "
                                  f"{self.size}-byte file", tensor.name)
        if (self.array.ctypes.data + start) % align:
            raise CheckpointError(self.path, f"mapped at an address not {align}-byte aligned", tensor.name)
        self.mapped_bytes += n
        return self.array[start:start + n], None

    def check(self):
        """CheckpointError naming the file when it changed since it was mapped."""
        if self._fd is None:
            return
        try:
            now = _identity(os.fstat(self._fd))
        except OSError as e:
            raise CheckpointError(self.path, f"cannot be checked (fstat: {e.strerror or e})") from None
        if now != self.identity:
            raise CheckpointError(
                self.path, f"changed on disk after its weights were mapped (size {self.identity[2]} -> "
                f"{now[2]}, mtime_ns {self.identity[3]} -> {now[3]}); the model's mapped weights are no "
                "longer the file it loaded: reload it (or load with mmap=False to copy the weights)")

    @property
    def mapped(self):
        return self._mm is not None

    def __del__(self):
        # (the arrays viewing the mapping hold it alive; the descriptor is ours)
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None


def _identity(st):
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
