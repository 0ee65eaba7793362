"""The native GGUF storages q4_k and q6_k (Matrix.from_ggml): the file's
blocks kept as they are, and their products on every ISA level.

Exactness policy (csrc/kernels.h): with fp32 activations a K-quant matrix
is the canonical 16-lane dot over its decoded weights, so its products are
the bits of an fp32 Matrix holding that decode; with int8 (q8) activations
each dot keeps 8 lanes, one per sub-block of the super-block, folding
exact integer block sums with fixed float operations, reduced by a fixed
tree. Every ISA level, thread count and token count gives the scalar
reference's bits.

Oracles that never call cism: gguf-py's dequantize for the decode, the
NumPy statement of the q8 rule below (ggml-common.h's layouts written out
here, exact rationals for every rounding), and float64 products.
"""
from fractions import Fraction

import numpy as np
import pytest

from cism import _kernels
from cism.loaders import ggml_types
from cism.matrix import Matrix

from conftest import hypothesis_examples, hypothesis_or_skip, isas_under_test
from reference import canonical

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf.quants import dequantize as gguf_dequantize  # noqa: E402

ISAS = isas_under_test()
TYPES = {"q4_k": (Q.Q4_K, 144), "q6_k": (Q.Q6_K, 210)}

# fp16 bit patterns by magnitude class; a random sign is added to each draw.
SCALE_CLASSES = {
    "zero": (0x0000, 0x0000),
    "subnormal": (0x0001, 0x03ff),
    "tiny": (0x0400, 0x0fff),
    "unit": (0x2c00, 0x3fff),        # 1/16 .. 2
    "large": (0x7000, 0x7bfe),       # 8192 .. below the maximum
    "max": (0x7bff, 0x7bff),         # 65504
}


def same_bits(a, b):
    """Bitwise equality (tells -0 from +0, unlike ==)."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def halves(rng, n, classes):
    lo, hi = np.array([SCALE_CLASSES[c] for c in classes]).T
    pick = rng.integers(0, len(classes), n)
    bits = rng.integers(lo[pick], hi[pick], endpoint=True).astype(np.uint16)
    return bits | (rng.integers(0, 2, n).astype(np.uint16) << 15)


def put_half(raw, at, bits):
    raw[:, at:at + 2] = bits.astype("<u2").view(np.uint8).reshape(-1, 2)


def random_raw(storage, rows, cols, seed, classes=("unit",), edges=True):
    """(rows, row_bytes) random super-blocks with fp16 scales drawn from
    `classes`; with `edges`, the first rows (those that exist) hold edge
    blocks: every code 0, every code 15 (63), 6-bit scales and mins at 0
    and 63, Q6_K scales at -128, 127 and 0, then d (and dmin) +0, the
    smallest negative subnormal and -65504."""
    qtype, size = TYPES[storage]
    rng = np.random.default_rng(seed)
    nb = cols // 256
    raw = rng.integers(0, 256, (rows * nb, size), dtype=np.uint8)
    fields = (0, 2) if storage == "q4_k" else (208,)
    for at in fields:
        put_half(raw, at, halves(rng, len(raw), classes))
    raw = raw.reshape(rows, nb, size)
    if edges:
        def fill(at, *values):
            """Bytes from `at` on set to the given (value, count) runs."""
            def edit(b):
                i = at
                for v, n in values:
                    b[:, i:i + n] = v
                    i += n
            return edit
        if storage == "q4_k":   # codes at 16..143; 6-bit scales and mins in bytes 4..15
            edge = [fill(16, (0x00, 128)), fill(16, (0xFF, 128)),
                    fill(4, (0xFF, 4), (0x00, 4), (0x0F, 4)),      # every scale 63, every min 0
                    fill(4, (0x00, 4), (0xFF, 4), (0xF0, 4)),      # every scale 0, every min 63
                    fill(4, (0xFF, 12))]                           # scales and mins 63
        else:                   # codes at 0..191; int8 scales at 192..207
            edge = [fill(0, (0x00, 192)), fill(0, (0xFF, 192)),
                    fill(192, (0x80, 16)), fill(192, (0x7F, 16)), fill(192, (0x00, 16))]
        edge += [lambda b: [put_half(b, at, np.zeros(len(b), np.uint16)) for at in fields],
                 lambda b: [put_half(b, at, np.full(len(b), 0x8001, np.uint16)) for at in fields],
                 lambda b: [put_half(b, at, np.full(len(b), 0xfbff, np.uint16)) for at in fields]]
        for r in range(min(rows, len(edge))):
            edge[r](raw[r])
    return np.ascontiguousarray(raw.reshape(rows, nb * size))


def decode(storage, raw):
    """gguf-py's float32 decode of (rows, row_bytes) blocks."""
    qtype, size = TYPES[storage]
    rows = raw.shape[0]
    return gguf_dequantize(raw.reshape(-1, size), qtype).astype(np.float32).reshape(rows, -1)


def activations(rng, T, cols):
    """Gaussian rows of mixed magnitude, with an all-zero block and tiny values."""
    X = (rng.standard_normal((T, cols)) * rng.choice([1e-3, 1.0, 30.0], size=(T, 1))).astype(np.float32)
    X[:, 32:64] = 0                          # an all-zero activation block (scale 0)
    X[0, 100:110] = np.float32(1e-30)
    return X


def products(m, X, threads=1):
    out = {}
    for act in ("fp32", "int8"):
        m.act_precision = act
        out[act] = m.gemm(X, threads=threads)
    m.act_precision = "fp32"
    return out


# ------------------------------------------------------------------- storage ---

@pytest.mark.parametrize("storage", sorted(TYPES))
@pytest.mark.parametrize("classes", [("unit",), ("zero", "subnormal", "tiny"), ("large", "max", "unit")])
def test_rows_are_the_file_bytes_and_decode_as_gguf_py(storage, classes):
    """codes are the given bytes; row(i) (the embedding gather, mat_row),
    dequantize() and the loader's decoder (csrc/ggml.h) all give gguf-py's
    bits, edge blocks included."""
    rows, cols = 11, 768
    raw = random_raw(storage, rows, cols, seed=len(classes), classes=classes)
    m = Matrix.from_ggml(TYPES[storage][0].name, raw, rows, cols)
    assert m.storage == storage and m.shape == (rows, cols) and m.nbytes == raw.nbytes
    assert np.array_equal(m.codes, raw) and m.scales is None
    want = decode(storage, raw)
    loader = np.empty(rows * cols, np.float32)
    ggml_types.dequantize_into(int(TYPES[storage][0]), raw.reshape(-1), loader, 2)
    assert same_bits(loader.reshape(rows, cols), want)
    assert same_bits(m.dequantize(), want)
    for i in range(rows):
        assert same_bits(m.row(i), want[i]), i


def test_type_ids_and_names_and_sizes():
    raw = random_raw("q4_k", 3, 512, seed=1)
    for t in (12, "Q4_K", "q4_k", np.int32(12)):
        assert Matrix.from_ggml(t, raw, 3, 512).storage == "q4_k"
    raw6 = random_raw("q6_k", 2, 256, seed=2)
    assert Matrix.from_ggml(14, raw6.reshape(-1), 2, 256).nbytes == 2 * 210
    assert Matrix.from_ggml("Q6_K", raw6, 2, 256, threads=2).storage == "q6_k"


@pytest.mark.parametrize("args,message", [
    ((13, np.zeros(176, np.uint8), 1, 256), "no native storage"),
    (("Q8_0", np.zeros(34, np.uint8), 1, 32), "no native storage"),
    (("F32", np.zeros(4, np.uint8), 1, 1), "no native storage"),
    ((True, np.zeros(144, np.uint8), 1, 256), "no native storage"),
    ((12, np.zeros(144, np.uint8), 1, 100), "multiple of 256"),
    ((14, np.zeros(210 * 3, np.uint8), 1, 768 + 32), "multiple of 256"),
    ((12, np.zeros(143, np.uint8), 1, 256), "raw holds 143 bytes"),
    ((12, np.zeros(144 * 4, np.uint8), 2, 256), "raw holds 576 bytes"),
    ((14, np.zeros(210, np.int8), 1, 256), "uint8"),
    ((14, list(range(210)), 1, 256), "uint8"),
    ((12, np.zeros((2, 288), np.uint8)[:, ::2], 2, 256), "C-contiguous"),
    ((12, np.zeros(144, np.uint8), 0, 256), "rows must be in"),
    ((12, np.zeros(144, np.uint8), 1, 0), "cols must be in"),
    ((12, np.zeros(144, np.uint8), 1.0, 256), "rows must be an int"),
])
def test_bad_construction(args, message):
    with pytest.raises(ValueError, match=message):
        Matrix.from_ggml(*args)


@pytest.mark.parametrize("storage", sorted(TYPES))
def test_non_finite_scales_are_refused(storage):
    """An inf or NaN fp16 scale would make weights non-finite: refused,
    naming the row and super-block (unless check_finite=False)."""
    raw = random_raw(storage, 3, 512, seed=4)
    fields = (0, 2) if storage == "q4_k" else (208,)
    for at in fields:
        for bits in (0x7c00, 0xfc00, 0x7e01):
            bad = raw.copy()
            bad[2, 144 if storage == "q4_k" else 210:][at:at + 2] = np.array([bits], "<u2").view(np.uint8)
            with pytest.raises(ValueError, match="super-block 1 of row 2"):
                Matrix.from_ggml(TYPES[storage][0], bad, 3, 512)
            Matrix.from_ggml(TYPES[storage][0], bad, 3, 512, check_finite=False)


def test_float_packing_and_bf16_are_refused_for_native_storages():
    with pytest.raises(ValueError, match="from_ggml"):
        Matrix(np.zeros((2, 256), np.float32), "q4_k")
    m = Matrix.from_ggml(12, random_raw("q4_k", 2, 256, seed=5), 2, 256)
    with pytest.raises(ValueError, match="bf16"):
        m.act_precision = "bf16"
    m.act_precision = "int8"
    assert m.act_precision == "int8" and "q4_k" in repr(m)


# ------------------------------------------------------------------ products ---

SHAPES = [(1, 256), (3, 512), (7, 768), (13, 1536), (33, 256), (8, 4352)]


@pytest.mark.parametrize("storage", sorted(TYPES))
@pytest.mark.parametrize("rows,cols", SHAPES)
def test_every_isa_matches_reference_bitwise(storage, rows, cols, isa_level):
    """Both activation precisions, decode (T = 1) and several tokens (the
    direct tiles up to 4, the dequantized rows from 5, two token chunks at
    70), tail row counts: every level gives the reference's bits. 4352
    columns is past the AVX-512 dequantized-row buffer."""
    rng = np.random.default_rng(rows * cols)
    raw = random_raw(storage, rows, cols, seed=cols, classes=("unit", "tiny", "large"))
    m = Matrix.from_ggml(TYPES[storage][0], raw, rows, cols)
    for T in (1, 2, 3, 5, 9, 70):
        X = activations(rng, T, cols)
        isa_level("ref")
        want = products(m, X)
        for isa in ISAS[1:]:
            isa_level(isa)
            got = products(m, X)
            for act in want:
                assert same_bits(got[act], want[act]), (isa, act, T)


@pytest.mark.parametrize("storage", sorted(TYPES))
def test_fp32_activations_are_the_fp32_matrix_of_the_decode(storage, isa_level):
    """The fp32-activation rule: the canonical dot over the decoded weights,
    i.e. exactly what an fp32 Matrix holding gguf-py's decode computes."""
    rng = np.random.default_rng(3)
    rows, cols = 21, 1024
    raw = random_raw(storage, rows, cols, seed=9, classes=("unit", "subnormal", "max"))
    m = Matrix.from_ggml(TYPES[storage][0], raw, rows, cols)
    f = Matrix(decode(storage, raw), "fp32")
    for isa in ISAS:
        isa_level(isa)
        for T in (1, 4, 6):
            X = activations(rng, T, cols)
            assert same_bits(m.gemm(X), f.gemm(X)), (isa, T)


@pytest.mark.parametrize("storage", sorted(TYPES))
def test_fp32_activations_are_the_documented_dot_of_gguf_py_decode(storage, isa_level):
    """The same rule without an fp32 Matrix in between: the 16-lane dot and
    tree stated in NumPy (tests/reference/canonical.py) over gguf-py's decode,
    bit for bit on every level (decode, a prefill tile, two super-blocks)."""
    rng = np.random.default_rng(31)
    rows, cols = 7, 512
    raw = random_raw(storage, rows, cols, seed=17, classes=("unit", "subnormal", "large"))
    m = Matrix.from_ggml(TYPES[storage][0], raw, rows, cols)
    for T in (1, 6):
        X = activations(rng, T, cols)
        want = canonical.dot16(decode(storage, raw), X)
        for isa in ISAS:
            isa_level(isa)
            assert same_bits(m.gemm(X), want), (isa, T)


@pytest.mark.parametrize("storage", sorted(TYPES))
@pytest.mark.parametrize("rows,cols,T", [(300, 512, 11), (709, 256, 3), (1000, 768, 40)])
def test_gemm_rows_equal_gemv_and_threads_do_not_matter(storage, rows, cols, T, isa_level):
    """Every thread count gives the one-thread bits, which are the gemv's, on
    every level (709 rows: 23 chunks of 32 split unevenly; 40 tokens: the
    fp32 tiles' dynamic pieces)."""
    rng = np.random.default_rng(rows + T)
    raw = random_raw(storage, rows, cols, seed=rows)
    m = Matrix.from_ggml(TYPES[storage][0], raw, rows, cols)
    X = activations(rng, T, cols)
    isa_level("ref")
    want = products(m, X, threads=1)
    for isa in ISAS:
        isa_level(isa)
        for act in ("fp32", "int8"):
            m.act_precision = act
            for threads in (1, 2, 3):
                assert same_bits(m.gemm(X, threads=threads), want[act]), (isa, act, threads)
            for t in (0, T // 2, T - 1):
                assert same_bits(m.gemv(X[t], threads=2), want[act][t]), (isa, act, t)
            assert same_bits(m.gemm(X[:2], threads=3), want[act][:2]), (isa, act)


def test_isa_equality_property():
    h = hypothesis_or_skip()
    st = h.strategies

    @h.settings(max_examples=hypothesis_examples(40), deadline=None)
    @h.given(storage=st.sampled_from(sorted(TYPES)), rows=st.integers(1, 40), blocks=st.integers(1, 6),
             T=st.integers(1, 9), seed=st.integers(0, 2**32 - 1),
             classes=st.lists(st.sampled_from(sorted(SCALE_CLASSES)), min_size=1, max_size=3, unique=True),
             xscale=st.sampled_from([1.0, 1e-20, 1e20]))
    def check(storage, rows, blocks, T, seed, classes, xscale):
        _isa_equality_property(storage, rows, blocks, T, seed, classes, xscale)
    check()


def _isa_equality_property(storage, rows, blocks, T, seed, classes, xscale):
    rng = np.random.default_rng(seed)
    cols = 256 * blocks
    raw = random_raw(storage, rows, cols, seed=seed, classes=classes, edges=seed % 2 == 0)
    m = Matrix.from_ggml(TYPES[storage][0], raw, rows, cols)
    X = (activations(rng, T, cols) * np.float32(xscale)).astype(np.float32)
    before = _kernels.isa()
    try:
        _kernels.set_isa("ref")
        want = products(m, X)
        for isa in ISAS[1:]:
            _kernels.set_isa(isa)
            got = products(m, X, threads=2)
            for act in want:
                assert same_bits(got[act], want[act]), (isa, act)
    finally:
        _kernels.set_isa(before)


# ------------------------------------------------ the q8 rule, stated exactly ---

def f32_round(x):
    """The float32 nearest the exact rational x (ties to even)."""
    f = np.float32(float(x))
    near = [f, np.nextafter(f, np.float32(np.inf)), np.nextafter(f, np.float32(-np.inf))]
    return min(near, key=lambda c: (abs(Fraction(float(c)) - x), int(np.array(c).view(np.uint32)) & 1))


def fp16(raw2):
    return np.float32(raw2.view("<f2")[0])


def q4k_fields(block):
    """(d, dmin, scales[8], mins[8], codes[256]) of one block_q4_K, from
    ggml-common.h's layout: 6-bit scale/min j < 4 in the low bits of bytes
    j and j + 4; j >= 4 in the nibbles of byte j + 4 with their top two
    bits in the top bits of bytes j - 4 and j."""
    s = block[4:16].astype(np.int64)
    sc = [s[j] & 63 if j < 4 else (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4) for j in range(8)]
    mn = [s[j + 4] & 63 if j < 4 else (s[j + 4] >> 4) | ((s[j] >> 6) << 4) for j in range(8)]
    qs = block[16:144].astype(np.int64).reshape(4, 32)
    codes = np.concatenate([np.concatenate([qs[k] & 15, qs[k] >> 4]) for k in range(4)])
    return fp16(block[0:2]), fp16(block[2:4]), sc, mn, codes


def q6k_fields(block):
    """(d, scales[16], codes[256]) of one block_q6_K: element l of run g =
    4h + r takes nibble r // 2 of ql[64h + 32 (r % 2) + l] and bit pair r
    of qh[32h + l]."""
    ql = block[0:128].astype(np.int64)
    qh = block[128:192].astype(np.int64)
    codes = []
    for g in range(8):
        h, r = divmod(g, 4)
        low = (ql[64 * h + 32 * (r % 2): 64 * h + 32 * (r % 2) + 32] >> (4 * (r // 2))) & 15
        high = (qh[32 * h: 32 * h + 32] >> (2 * r)) & 3
        codes.append(low | (high << 4))
    return fp16(block[208:210]), block[192:208].view(np.int8).astype(np.int64), np.concatenate(codes)


def q8_rule(storage, raw, cols, a, ascale):
    """One dot of a K-quant row with q8 activations, stated with exact
    rationals: 8 lanes, lane j takes block j of every super-block in order
    (fma: one rounding of the exact value), then (l0+l4 + l2+l6) + (l1+l5 +
    l3+l7) in float32."""
    size = TYPES[storage][1]
    acc = [np.float32(0)] * 8
    for s in range(cols // 256):
        block = raw[s * size:(s + 1) * size]
        x = a[256 * s: 256 * s + 256].astype(np.int64)
        if storage == "q4_k":
            d, dmin, sc, mn, codes = q4k_fields(block)
        else:
            d, scales, codes = q6k_fields(block)
        for j in range(8):
            e = slice(32 * j, 32 * j + 32)
            asc = ascale[8 * s + j]
            if storage == "q4_k":
                isum = int(sc[j]) * int(np.dot(codes[e], x[e]))
                msum = int(mn[j]) * int(x[e].sum())
                acc[j] = f32_round(Fraction(isum) * Fraction(float(d * asc)) + Fraction(float(acc[j])))
                acc[j] = f32_round(Fraction(msum) * -Fraction(float(dmin * asc)) + Fraction(float(acc[j])))
            else:
                c = codes[e] - 32
                isum = (int(scales[2 * j]) * int(np.dot(c[:16], x[e][:16]))
                        + int(scales[2 * j + 1]) * int(np.dot(c[16:], x[e][16:])))
                acc[j] = f32_round(Fraction(isum) * Fraction(float(d * asc)) + Fraction(float(acc[j])))
    s4 = [np.float32(acc[i] + acc[i + 4]) for i in range(4)]
    return np.float32(np.float32(s4[0] + s4[2]) + np.float32(s4[1] + s4[3]))


@pytest.mark.parametrize("storage", sorted(TYPES))
def test_q8_activations_follow_the_k_quant_rule(storage, isa_level):
    """The q8 rule of csrc/kernels.h, stated here independently (exact
    rationals, ggml-common.h's layouts), equals every level bit for bit:
    decode, a few tokens and many. Tokens 1 and 2 quantize to +-127
    everywhere, which against the all-zero and all-one code rows makes the
    largest integer partial sums the SIMD reductions hold (q6_k: 4 * 32 *
    127 per dword, twice that per pair, near int16's limit)."""
    rng = np.random.default_rng(17)
    rows, cols, T = 9, 768, 10
    raw = random_raw(storage, rows, cols, seed=31, classes=("unit", "subnormal", "large"))
    X = activations(rng, T, cols)
    X[1], X[2] = 1.0, -3.0
    acts = [_kernels.quantize(x) for x in X]
    want = np.array([[q8_rule(storage, raw[i], cols, a, s) for i in range(rows)] for a, s in acts], np.float32)
    m = Matrix.from_ggml(TYPES[storage][0], raw, rows, cols)
    m.act_precision = "int8"
    for isa in ISAS:
        isa_level(isa)
        assert same_bits(m.gemm(X), want), isa
        assert same_bits(m.gemm(X[:3]), want[:3]), isa
        assert same_bits(m.gemv(X[4]), want[4]), isa


# ------------------------------------------------------------------ accuracy ---

@pytest.mark.parametrize("storage", sorted(TYPES))
@pytest.mark.parametrize("cols", [256, 1536])
def test_reference_is_close_to_float64(storage, cols, isa_level):
    """The reference is correct, not only consistent: fp32 activations
    within 1e-5 (relative to the magnitudes summed) of float64 products of
    gguf-py's decode; q8 within 1e-5 of float64 products with the
    activations' own quantized values."""
    isa_level("ref")
    rng = np.random.default_rng(cols)
    rows, T = 40, 3
    raw = random_raw(storage, rows, cols, seed=cols + 1, classes=("unit", "tiny", "large"))
    W = decode(storage, raw).astype(np.float64)
    X = activations(rng, T, cols)
    m = Matrix.from_ggml(TYPES[storage][0], raw, rows, cols)
    got = m.gemm(X).astype(np.float64)
    want, mag = X.astype(np.float64) @ W.T, np.abs(X.astype(np.float64)) @ np.abs(W).T
    assert np.all(np.abs(got - want) <= 1e-5 * mag), np.max(np.abs(got - want) / mag)
    Xq = np.array([np.repeat(s.astype(np.float64), 32)[:cols] * c[:cols]
                   for c, s in (_kernels.quantize(x) for x in X)])
    m.act_precision = "int8"
    got = m.gemm(X).astype(np.float64)
    want, mag = Xq @ W.T, np.abs(Xq) @ np.abs(W).T
    assert np.all(np.abs(got - want) <= 1e-5 * mag + 1e-300), np.max(np.abs(got - want) / mag)


# ------------------------------------------------------------ real GGUF data ---

def test_llama_quantize_tensors(isa_level):
    """The Q4_K and Q6_K tensors llama.cpp's llama-quantize wrote
    (tests/data/ggml/tiny-llama.Q4_K_M.gguf): rows are gguf-py's decode and
    every level gives the reference's bits in both activation precisions."""
    import os
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "ggml", "tiny-llama.Q4_K_M.gguf")
    if not os.path.exists(path):
        pytest.skip("tests/data/ggml is not here")
    reader = gguf.GGUFReader(path)
    seen = set()
    rng = np.random.default_rng(5)
    for t in reader.tensors:
        if t.tensor_type not in (Q.Q4_K, Q.Q6_K):
            continue
        cols, rows = (int(v) for v in t.shape[:2])
        raw = np.ascontiguousarray(np.asarray(t.data, np.uint8).reshape(rows, -1))
        m = Matrix.from_ggml(t.tensor_type.name, raw, rows, cols)
        want = gguf_dequantize(raw, t.tensor_type).astype(np.float32).reshape(rows, cols)
        assert same_bits(m.dequantize(), want), t.name
        X = rng.standard_normal((6, cols)).astype(np.float32)
        isa_level("ref")
        ref = products(m, X)
        for isa in ISAS[1:]:
            isa_level(isa)
            got = products(m, X, threads=2)
            for act in ref:
                assert same_bits(got[act], ref[act]), (t.name, isa, act)
        seen.add(t.tensor_type)
    assert seen == {Q.Q4_K, Q.Q6_K}


def test_native_q4_k_m_model_is_the_fp32_model_of_its_decode(isa_level):
    """A whole model: with fp32 activations the q4_k and q6_k matrices of a
    llama-quantize Q4_K_M file (precision "auto") give the logits and the
    greedy tokens of the fp32 model of gguf-py's decode, bit for bit, on
    the reference and the best level."""
    import os
    from cism.dense import Model
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "ggml", "tiny-llama.Q4_K_M.gguf")
    if not os.path.exists(path):
        pytest.skip("tests/data/ggml is not here")
    native = Model.from_pretrained(path, precision="auto", threads=2)
    storages = {s for _, s in native.storage_report().values()}
    assert {"q4_k", "q6_k"} <= storages <= {"q4_k", "q6_k", "fp32"}, storages
    decoded = Model.from_pretrained(path, precision="fp32", threads=2)
    prompt = [1, 5, 9, 60, 7, 3, 11, 2]
    for isa in (ISAS[0], ISAS[-1]):
        isa_level(isa)
        assert same_bits(native.logits(prompt), decoded.logits(prompt)), isa
        a = native.create_session(prompt, 12)
        b = decoded.create_session(prompt, 12)
        assert a.next_tokens(12) == b.next_tokens(12), isa


@pytest.mark.parametrize("storage", sorted(TYPES))
def test_kernels_without_scratch_give_the_same_bits(storage, isa_level):
    """The multi-token kernels that take scratch (the dequantized rows of
    the fp32 tiles, the tokens-in-lanes q8 kernels) fall back to
    scratch-free paths with the same bits when it cannot be had."""
    rng = np.random.default_rng(8)
    rows, cols = 37, 1280
    m = Matrix.from_ggml(TYPES[storage][0], random_raw(storage, rows, cols, seed=8), rows, cols)
    try:
        for isa in ISAS:
            isa_level(isa)
            spent = {"fp32": 0, "int8": 0}
            for T in (6, 9, 40):
                X = activations(rng, T, cols)
                for act in spent:
                    m.act_precision = act
                    want = m.gemm(X, threads=2)
                    _kernels._fail_scratch(1 << 30)
                    got = m.gemm(X, threads=2)
                    spent[act] += (1 << 30) - _kernels._fail_scratch(0)
                    assert same_bits(got, want), (isa, act, T)
            # the fallbacks ran: fp32 activations' dequantized rows and q8's
            # tokens in lanes from avx2 on
            assert (spent["fp32"] > 0) == (isa != "ref"), (isa, spent)
            assert (spent["int8"] > 0) == (isa != "ref"), (isa, spent)
            m.act_precision = "fp32"
    finally:
        _kernels._fail_scratch(0)
