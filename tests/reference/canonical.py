"""NumPy statements of the canonical fp32-activation arithmetic (csrc/kernels.h,
docs/EXACTNESS.md) and of the packed weight layouts (csrc/formats.h), written
from those documents, never from the C code. Like every module here it does not
import ``cism``: the tests hand it a Matrix's ``codes`` and ``scales`` views.

    fma32(a, b, c)       fl32(a * b + c), one rounding (IEEE fmaf)
    dot16(w, x)          the 16-lane dot: lane i % 16 takes fma(w_i, x_i, lane) in
                         order from +0, then s8 = l[i] + l[i+8], s4, s2, s1
    decode(storage, codes, scales, cols, int8_scale)
                         the float32 weights a product sees (int8: the codes,
                         the row scale applied after the dot unless int8_scale)
"""
import numpy as np

F32, F64 = np.float32, np.float64

# fp4 (csrc/formats.h): 2 x E2M1 per nibble (sign in bit 3), E4M3 scale bytes.
E2M1_X2 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], F64)


def e4m3(byte):
    """E4M3 (bias 7, exponent 0 subnormal: man/8 * 2^-6) as float64, exact."""
    b = np.asarray(byte, np.int64)
    e, m = (b >> 3) & 15, b & 7
    mag = np.where(e == 0, m / 8 * 2.0 ** -6, (1 + m / 8) * 2.0 ** (e - 7))
    return np.where(b & 0x80, -mag, mag)


def fma32(a, b, c):
    """fl32(a * b + c) rounded once, elementwise over float32 arrays.

    Why float64 is enough: a * b of two floats is exact in float64 (24 + 24 <
    53 bits, exponents far inside its range). The sum s = fl64(p + c) is not
    always exact, and rounding it again to float32 could round twice; so the
    sum is made *round-to-odd*: TwoSum gives its exact error e, and when e != 0
    and s is even, s steps to its odd neighbour toward e. A round-to-odd value
    with at least 2 more bits than the target (53 >= 24 + 2) rounds to the
    target as the exact value would (Boldo and Melquiond, "When double rounding
    is odd", 2005). Zeros keep IEEE's signs: an exact zero sum is +0 unless both
    addends are -0, in float64 as in float32.
    test_matrix.py::test_fma32_is_one_rounding checks this against exact
    rationals."""
    a, b, c = (np.asarray(v, F32).astype(F64) for v in (a, b, c))
    p = a * b
    s = p + c
    bp = s - p                          # TwoSum (Knuth): e = (p + c) - s exactly
    e = (p - (s - bp)) + (c - bp)
    even = (s.view(np.uint64) & 1) == 0
    toward = np.where(e > 0, np.inf, -np.inf)
    s = np.where((e != 0) & even, np.nextafter(s, toward), s)
    return s.astype(F32)


def reduce16(acc):
    """The fixed tree over the last axis (16 lanes): s8[i] = a[i] + a[i+8],
    s4[i] = s8[i] + s8[i+4], s2[i] = s4[i] + s4[i+2], s2[0] + s2[1]; float32
    additions."""
    acc = np.asarray(acc, F32)
    for half in (8, 4, 2, 1):
        acc = acc[..., :half] + acc[..., half:2 * half]
    return acc[..., 0]


def dot16(w, x):
    """Canonical dots of weight rows w (R, n) with activation rows x (T, n):
    (T, R) float32. Lanes start at +0; element i goes to lane i % 16 in order;
    elements past n never touch a lane."""
    w, x = np.asarray(w, F32), np.asarray(x, F32)
    n = w.shape[1]
    acc = np.zeros((x.shape[0], w.shape[0], 16), F32)
    for i in range(n):
        lane = i % 16
        acc[:, :, lane] = fma32(x[:, i, None], w[None, :, i], acc[:, :, lane])
    return reduce16(acc)


def decode(storage, codes, scales, cols, int8_scale=True):
    """Float32 weights (rows, cols) from a packed matrix's codes and scales,
    by the layouts of csrc/formats.h:

    fp32   the floats themselves
    fp16   IEEE binary16 bits, widened exactly (NumPy's float16)
    int8   code (times the row scale, one float32 product, if int8_scale)
    int4   (rows, blocks32, 16) bytes: byte t of a block holds element t in its
           low nibble and t + 16 in its high one; value (code - 8) * block scale,
           one float32 product
    fp4    byte j // 2 holds element j, low nibble for even j; value
           E2M1_X2[nibble] * (e4m3(scale byte of j // 16) * 0.5), exact"""
    if storage == "fp32":
        return np.array(codes, F32)
    if storage == "fp16":
        return np.asarray(codes, np.uint16).view(np.float16).astype(F32)
    if storage == "int8":
        w = np.asarray(codes, np.int8).astype(F32)
        return w * np.asarray(scales, F32)[:, None] if int8_scale else w
    rows = codes.shape[0]
    if storage == "int4":
        c = np.asarray(codes, np.int64)
        nib = np.concatenate([c & 15, c >> 4], axis=2)            # (rows, blocks, 32)
        w = (nib - 8).astype(F32) * np.asarray(scales, F32)[:, :, None]
        return w.reshape(rows, -1)[:, :cols]
    if storage == "fp4":
        c = np.asarray(codes, np.int64)
        nib = np.stack([c & 15, c >> 4], axis=2).reshape(rows, -1)[:, :cols]
        half_scale = e4m3(np.repeat(np.asarray(scales), 16, axis=1)[:, :cols]) * 0.5
        exact = E2M1_X2[nib] * half_scale                          # float64, exact
        w = exact.astype(F32)
        assert np.array_equal(w.astype(F64), exact), "an fp4 weight is not a float32"
        return w
    raise ValueError(f"no NumPy decode for {storage!r} (q4_k/q6_k: gguf-py's dequantize)")
