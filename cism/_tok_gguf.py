"""Read the key/value metadata of a GGUF file (tokenizer.*, general.*).

The tokenizer only needs the metadata section, which sits at the start of the
file. The `gguf` package's GGUFReader also parses every tensor descriptor and
wraps each string in a numpy view (about 3 s for a 50k-token vocabulary), so
this small reader walks the header itself with bounds checks and stops before
the tensor infos. Every problem becomes a ValueError that names the file.

Layout (little-endian, GGUF v2/v3): magic b"GGUF", uint32 version,
uint64 tensor_count, uint64 kv_count, then kv_count times
(string key, uint32 value_type, value); a string is uint64 length + UTF-8 bytes;
an array is uint32 element_type, uint64 count, elements.
"""
import os
import struct

import numpy as np

# value_type -> (struct format, numpy dtype) for the fixed-size scalars.
_SCALARS = {
    0: ("<B", np.uint8),
    1: ("<b", np.int8),
    2: ("<H", np.uint16),
    3: ("<h", np.int16),
    4: ("<I", np.uint32),
    5: ("<i", np.int32),
    6: ("<f", np.float32),
    7: ("<?", np.bool_),
    10: ("<Q", np.uint64),
    11: ("<q", np.int64),
    12: ("<d", np.float64),
}
_STRING = 8
_ARRAY = 9
# A vocabulary has at most a few hundred thousand entries; a count far beyond
# that means a corrupt file, and refusing it avoids a huge allocation.
_MAX_COUNT = 1 << 28
# Arrays of arrays deeper than this appear in no real file; without a bound a
# file of nested array headers would exhaust Python's recursion limit.
_MAX_ARRAY_DEPTH = 4


class _Cursor:
    """Sequential reader over a file that reads ahead in large chunks, so a
    98 MB model file costs only the few MB of its metadata."""

    def __init__(self, f, path):
        self.f = f
        self.buf = b""
        self.pos = 0   # position in buf
        self.base = 0  # file offset of buf[0]
        self.path = path
        self.size = os.fstat(f.fileno()).st_size

    def fail(self, what):
        where = self.base + self.pos
        raise ValueError(f"{self.path}: malformed GGUF file: {what} (at byte {where})")

    def take(self, n, what):
        end = self.pos + n
        # Checked against the file before reading: f.read(n) allocates n bytes
        # up front, so a length from a corrupt header must not reach it.
        if self.base + end > self.size:
            self.fail(f"truncated while reading {what}")
        if end > len(self.buf):
            more = self.f.read(max(end - len(self.buf), 1 << 22))
            self.buf = self.buf[self.pos:] + more
            self.base += self.pos
            end -= self.pos
            self.pos = 0
            if end > len(self.buf):
                self.fail(f"truncated while reading {what}")
        view = self.buf[self.pos:end]
        self.pos = end
        return view

    def scalar(self, fmt, what):
        size = struct.calcsize(fmt)
        return struct.unpack(fmt, self.take(size, what))[0]

    def count(self, what):
        n = self.scalar("<Q", what)
        if n > _MAX_COUNT:
            self.fail(f"implausible {what} {n}")
        return n

    def string(self, what):
        n = self.count(f"length of {what}")
        raw = self.take(n, what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            self.fail(f"{what} is not valid UTF-8")

    def value(self, vtype, key, depth=0):
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype][0], key)
        if vtype == _STRING:
            return self.string(key)
        if vtype == _ARRAY:
            etype = self.scalar("<I", f"element type of {key}")
            n = self.count(f"length of {key}")
            if etype in _SCALARS:
                fmt, dtype = _SCALARS[etype]
                raw = self.take(n * struct.calcsize(fmt), key)
                return np.frombuffer(raw, dtype=np.dtype(dtype).newbyteorder("<")).tolist()
            if etype == _STRING:
                return [self.string(f"{key}[{i}]") for i in range(n)]
            if etype == _ARRAY:
                if depth + 1 >= _MAX_ARRAY_DEPTH:
                    self.fail(f"{key} nests arrays more than {_MAX_ARRAY_DEPTH} deep")
                return [self.value(_ARRAY, f"{key}[{i}]", depth + 1) for i in range(n)]
            self.fail(f"unknown element type {etype} in {key}")
        self.fail(f"unknown value type {vtype} for {key}")


def read_gguf_metadata(path):
    """Return the metadata of the GGUF file at `path` as a dict key -> value
    (ints, floats, bools, strs, or lists of them)."""
    try:
        f = open(path, "rb")
    except OSError as e:
        raise ValueError(f"{path}: cannot read GGUF file: {e.strerror or e}") from None
    with f:
        cur = _Cursor(f, path)
        try:
            if cur.take(4, "magic") != b"GGUF":
                raise ValueError(f"{path}: not a GGUF file (bad magic)")
            version = cur.scalar("<I", "version")
            if version not in (2, 3):
                # v1 used 32-bit counts; a byte-swapped version means big-endian.
                raise ValueError(f"{path}: unsupported GGUF version {version} "
                                 "(need 2 or 3, little-endian)")
            cur.scalar("<Q", "tensor count")
            n_kv = cur.count("key/value count")
            meta = {}
            for i in range(n_kv):
                key = cur.string(f"key #{i}")
                vtype = cur.scalar("<I", f"type of {key}")
                meta[key] = cur.value(vtype, key)
        except OSError as e:
            raise ValueError(f"{path}: cannot read GGUF file: {e.strerror or e}") from None
    return meta
