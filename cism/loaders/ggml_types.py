"""ggml tensor types: sizes of every type (to bound-check any file), the set
cism decodes, and numpy dequantisers for the simplest of them.

Every decoded type is dequantised to float32 by the C decoder (csrc/ggml.h,
which spells out the byte offsets and the order of every float operation);
the model then packs those floats into its chosen precision. The oracle is
gguf-py's gguf.quants.dequantize: the C decoder equals it bit for bit on every
type (tests/test_ggml_quants.py, tests/test_loaders.py). The numpy decoders
below (DEQUANTIZERS: F32, F16, BF16, Q8_0, Q4_0, Q4_1) are a second readable
reference held to the same bits; for the other types the tests use gguf-py's
own numpy decoders as the only reference.

Block layouts (ggml-common.h; d, m, dmin are little-endian fp16 scales;
"nibbles" means byte j holds element j in its low nibble and j + 16 in its
high nibble):
  Q8_0    34 bytes / 32: d, 32 x int8 q                value = q * d
  Q4_0    18 bytes / 32: d, 16 bytes of nibbles        value = (q - 8) * d
  Q4_1    20 bytes / 32: d, m, 16 bytes of nibbles     value = q * d + m
  Q5_0    22 bytes / 32: d, u32 fifth bits, nibbles    value = (q - 16) * d
  Q5_1    24 bytes / 32: d, m, u32 fifth bits, nibbles value = q * d + m
  IQ4_NL  18 bytes / 32: d, nibbles indexing 16 fixed int8 levels: value = level * d
  Q2_K    84 bytes / 256: 16 sub-blocks of 16, 4-bit scale and min each; 2-bit q;
          d, dmin                                      value = (d*sc) * q - (dmin*m)
  Q3_K   110 bytes / 256: 16 sub-blocks of 16, 6-bit scales; 2-bit q plus a
          high-bit mask; d                             value = (d*(sc-32)) * q, q in [-4, 3]
  Q4_K   144 bytes / 256: d, dmin, 8 sub-blocks of 32 with 6-bit scale and min
          packed in 12 bytes; 4-bit q                  value = (d*sc) * q - (dmin*m)
  Q5_K   176 bytes / 256: Q4_K plus one high bit per element
  Q6_K   210 bytes / 256: 4 + 2 bit q, 16 int8 scales, d  value = (d*sc) * (q - 32)
  IQ4_XS 136 bytes / 256: d, 8 sub-blocks of 32 with 6-bit scales, IQ4_NL levels
          value = (d*(sc-32)) * level
Every product is exact in float32 (an 11-bit fp16 significand times integers
of at most 12 bits together), so only the final offset rounds: gguf-py,
ggml-quants.c and csrc/ggml.h agree to the bit whatever their product order.
"""
import numpy as np

# type id -> (name, elements per block, bytes per block), as ggml defines them.
# Unsupported types are listed too, so that a file using them is still
# bound-checked and the error can name the type.
GGML_TYPES = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40),
    10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50), 20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1), 25: ("I16", 1, 2),
    26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17),
}
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 0, 1, 2, 3, 6, 7, 8
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, BF16 = 10, 11, 12, 13, 14, 20, 23, 30

# The types csrc/ggml.h decodes: the types a GGUF file may hold.
DECODED = (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL,
           Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS)


def type_name(type_id):
    entry = GGML_TYPES.get(type_id)
    return entry[0] if entry else f"unknown type {type_id}"


def _scale(blocks, at):
    """The fp16 field at byte ``at`` of every block, as a (blocks, 1) float32 column."""
    return blocks[:, at:at + 2].view("<f2").astype(np.float32)


# The numpy decoders below are a reference for the types they cover. The
# loader decodes with the C version (csrc/ggml.h, equal bit for bit): numpy's
# ufuncs allocate their iterator buffers with the GIL released, and when the
# OS refuses that allocation numpy 2.4 raises MemoryError without a thread
# state and the process dies with SIGSEGV (found by tests/test_memory.py).


def _dequant_q8_0(raw, out):
    blocks = raw.reshape(-1, 34)
    np.multiply(blocks[:, 2:].view(np.int8), _scale(blocks, 0), out=out.reshape(-1, 32))


def _nibbles(qs, out):
    # Measured: masking then a casting assignment is 2.5x faster than gathering
    # from a 256-entry float table with np.take.
    out[:, :16] = qs & 15
    out[:, 16:] = qs >> 4


def _dequant_q4_0(raw, out):
    blocks = raw.reshape(-1, 18)
    out = out.reshape(-1, 32)
    _nibbles(blocks[:, 2:], out)
    out -= 8           # exact in float32, so (q - 8) * d rounds once, as ggml does
    out *= _scale(blocks, 0)


def _dequant_q4_1(raw, out):
    blocks = raw.reshape(-1, 20)
    out = out.reshape(-1, 32)
    _nibbles(blocks[:, 4:], out)
    out *= _scale(blocks, 0)
    out += _scale(blocks, 2)


def _dequant_f16(raw, out):
    out[...] = raw.view("<f2")


def _dequant_bf16(raw, out):
    # bf16 is the top half of a float32: widening is a shift, and exact.
    out.view(np.uint32)[...] = raw.view("<u2")
    out.view(np.uint32)[...] <<= 16


def _dequant_f32(raw, out):
    out[...] = raw.view("<f4")


DEQUANTIZERS = {F32: _dequant_f32, F16: _dequant_f16, BF16: _dequant_bf16,
                Q8_0: _dequant_q8_0, Q4_0: _dequant_q4_0, Q4_1: _dequant_q4_1}


# Elements decoded per step. The decoders make several passes (unpack, scale,
# offset); a 512 KB slice of output keeps them in L2 between passes. Measured:
# 1.85x faster on one 106M-element Q4_1 array, ~5% on SmolLM2's smaller tensors.
_STEP_ELEMENTS = 1 << 17


def dequantize_into(type_id, raw, out, threads=1):
    """Decode whole blocks: ``raw`` is a uint8 array of n blocks, ``out`` a
    contiguous float32 array of the n * block elements they hold (``threads``
    OpenMP threads: the same bits whatever the count)."""
    if type_id not in DECODED:
        raise KeyError(type_id)
    from cism.loaders._ggml_decode import ggml_decode
    ggml_decode(type_id, raw, out, threads)


def dequantize_into_reference(type_id, raw, out):
    """dequantize_into with the numpy reference decoders (the types in
    DEQUANTIZERS only)."""
    _, block, block_bytes = GGML_TYPES[type_id]
    decode = DEQUANTIZERS[type_id]
    step = _STEP_ELEMENTS // block
    with np.errstate(all="ignore"):  # inf/NaN scales are the model's problem, not a warning
        for b in range(0, len(raw) // block_bytes, step):
            decode(raw[b * block_bytes:(b + step) * block_bytes], out[b * block:(b + step) * block])


# precision "auto": the storage a tensor of each type gets. Its own encoding
# where cism has a native storage (NATIVE, when the matrix module has it);
# else the nearest cism storage that loses nothing that matters: int8 for
# every type of 8 or fewer bits (its per-row grid rounds a 2-6 bit source
# far below the source's own error: on SmolLM2's Q4_1 file, KL 0.006 from
# exact, where a 4-bit storage re-rounds at full 4-bit size, KL 0.27); fp16
# for Q8_0 (8.5 bits with its scales) and F16; fp32 for F32 and BF16 (fp16
# lacks its range).
NATIVE = {Q4_K: "q4_k", Q6_K: "q6_k"}
AUTO = {F32: "fp32", F16: "fp16", BF16: "fp32", Q8_0: "fp16",
        **{t: "int8" for t in (Q6_K, Q5_K, Q5_0, Q5_1, Q4_K, Q4_0, Q4_1, IQ4_NL, IQ4_XS, Q3_K, Q2_K)}}


def native_storages():
    """type id -> cism storage name, for the native storages this build has."""
    from cism import matrix
    have = set(getattr(matrix, "STORAGES", ()))
    return {t: name for t, name in NATIVE.items() if name in have}


def auto_storages(types):
    """HF tensor name -> cism storage for precision "auto", from the
    checkpoint's name -> ggml type name map."""
    ids = {type_name(t): t for t in GGML_TYPES}
    native = native_storages()
    return {name: native.get(ids[t], AUTO.get(ids[t], "fp32")) for name, t in types.items()}
