"""GGUF tensor blocks decoded to float32 (csrc/ggml.h), with the GIL
released and spread over OpenMP threads: the loaders' dequantization
(cism.loaders.ggml_types.dequantize_into)."""
from cython.parallel cimport prange
from libc.stdint cimport uint8_t

cdef extern from "ggml.h" nogil:
    int cism_ggml_decode(int type, const uint8_t *raw, size_t count, float *out)


cdef int decode_part(int type_id, const uint8_t *raw, size_t block, size_t block_bytes, size_t blocks,
                     size_t b0, size_t b1, float *out) noexcept nogil:
    if b1 > blocks:
        b1 = blocks
    if b0 >= b1:
        return 0
    return cism_ggml_decode(type_id, raw + b0 * block_bytes, (b1 - b0) * block, out + b0 * block)


DEF DECODE_PART = 1 << 16   # elements per work item of ggml_decode (256 KB of floats)


def ggml_decode(int type_id, const uint8_t[::1] raw, float[::1] out, int threads=1):
    """Decode whole ggml blocks of type_id from raw into out (len(out)
    elements), with the GIL released, in parts of about DECODE_PART elements
    spread over ``threads`` OpenMP threads (the decode is elementwise: the
    same bits whatever the count; no Python thread is involved, so nothing
    can fail outside the calling thread). The loader checks the sizes; this
    checks them again because it writes through raw pointers."""
    from cism.loaders.ggml_types import GGML_TYPES
    _, block, block_bytes = GGML_TYPES[type_id]
    cdef size_t count = out.shape[0], blk = block, bb = block_bytes
    if count % block or raw.shape[0] != count // block * block_bytes:
        raise ValueError(f"ggml_decode: {raw.shape[0]} bytes do not hold {count} elements")
    if not 1 <= threads <= 64:
        raise ValueError(f"ggml_decode: threads must be in [1, 64], got {threads}")
    cdef size_t blocks = count // blk
    cdef size_t per = max(<size_t>1, <size_t>DECODE_PART // blk)
    cdef size_t parts = (blocks + per - 1) // per, p
    cdef int rc = 0
    cdef int nt = threads if parts > 1 else 1
    if count:
        with nogil:
            for p in prange(parts, num_threads=nt, schedule='static'):
                rc += decode_part(type_id, &raw[0], blk, bb, blocks, p * per, (p + 1) * per, &out[0])
    if rc:
        raise ValueError(f"ggml_decode: type {type_id} is not decoded here")

