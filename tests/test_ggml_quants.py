"""Every ggml tensor type cism decodes, against gguf-py's dequantize.

The oracle is gguf.quants.dequantize (gguf-py's numpy decoders, which never
call cism); csrc/ggml.h must give its float32 bits exactly, NaN payloads
included. Blocks are random bytes with the fp16 scale fields set to finite
values of every magnitude (zero, subnormal, near one, near the fp16 maximum),
plus fixed edge patterns and fully random bytes (NaN and inf scales).
The decoder has no ISA variants (plain C, compiled once), so there is no
scalar path to test separately; thread counts must not change a bit.

tests/data/ggml holds small Llama files quantised by llama.cpp's own
llama-quantize (its README says how): cism loads each, every tensor equals
gguf-py's reading of the file, and the model generates.
"""
import glob
import os
import struct

import numpy as np
import pytest

from cism.loaders import CheckpointError, ggml_types, load_gguf
from conftest import hypothesis_examples, hypothesis_or_skip

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf.quants import dequantize as gguf_dequantize  # noqa: E402

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "ggml")
FILES = sorted(glob.glob(os.path.join(DATA, "*.gguf")))

# Byte offsets of the fp16 scale fields in one block, from ggml-common.h
# (written out here, not taken from csrc/ggml.h).
HALF_FIELDS = {Q.Q8_0: (0,), Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2),
               Q.IQ4_NL: (0,), Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2),
               Q.Q6_K: (208,), Q.IQ4_XS: (0,)}
QUANTIZED = sorted(HALF_FIELDS)
PLAIN = [Q.F32, Q.F16, Q.BF16]
NEW = [Q.Q5_0, Q.Q5_1, Q.IQ4_NL, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS]

# fp16 bit patterns by magnitude class (a random sign is added to each draw).
SCALE_CLASSES = {
    "zero": (0x0000, 0x0000),
    "subnormal": (0x0001, 0x03ff),
    "tiny": (0x0400, 0x0fff),        # the smallest normals
    "unit": (0x3000, 0x43ff),        # 0.125 .. 4
    "large": (0x7000, 0x7bfe),       # 8192 .. below the maximum
    "max": (0x7bff, 0x7bff),         # 65504, the largest finite
}


def same_bits(a, b):
    """Bitwise equality (NaN payloads included) of two float32 arrays."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def oracle(raw, qtype):
    """gguf-py's float32 values of raw, a (blocks, block bytes) uint8 array."""
    with np.errstate(all="ignore"):    # inf/NaN scales: no warnings, same values
        return gguf_dequantize(raw, qtype).astype(np.float32).reshape(-1)


def check_c_decoder(raw, qtype):
    """csrc/ggml.h at 1 and 2 threads (and the numpy reference where there is
    one) against gguf-py, bit for bit."""
    want = oracle(raw, qtype)
    decoders = [lambda r, o: ggml_types.dequantize_into(int(qtype), r, o, 1),
                lambda r, o: ggml_types.dequantize_into(int(qtype), r, o, 2)]
    if int(qtype) in ggml_types.DEQUANTIZERS:
        decoders.append(lambda r, o: ggml_types.dequantize_into_reference(int(qtype), r, o))
    for i, decode in enumerate(decoders):
        out = np.full(want.size, np.nan, np.float32)
        decode(np.ascontiguousarray(raw).reshape(-1), out)
        if not same_bits(out, want):
            bad = np.flatnonzero(out.view(np.uint32) != want.view(np.uint32))
            raise AssertionError(f"{qtype.name} decoder {i}: {bad.size} elements differ, first at "
                                 f"{bad[0]}: {out[bad[0]]!r} != {want[bad[0]]!r}")


def set_scales(raw, qtype, halves):
    """Write the fp16 bit patterns halves (blocks, fields) into raw's scale fields."""
    for k, at in enumerate(HALF_FIELDS[qtype]):
        raw[:, at:at + 2] = halves[:, k:k + 1].astype("<u2").view(np.uint8).reshape(-1, 2)


def random_halves(rng, shape, classes):
    lo, hi = np.array([SCALE_CLASSES[c] for c in classes]).T
    pick = rng.integers(0, len(classes), shape)
    bits = rng.integers(lo[pick], hi[pick], endpoint=True).astype(np.uint16)
    return bits | (rng.integers(0, 2, shape).astype(np.uint16) << 15)


def test_decoded_types_are_the_ones_tested():
    assert set(ggml_types.DECODED) == {int(t) for t in QUANTIZED + PLAIN}
    for t in QUANTIZED:
        assert gguf.GGML_QUANT_SIZES[t] == ggml_types.GGML_TYPES[int(t)][1:], t.name


def test_random_blocks_with_finite_scales():
    h = hypothesis_or_skip()
    st = h.strategies

    @h.settings(max_examples=hypothesis_examples(60), deadline=None)
    @h.given(qtype=st.sampled_from(QUANTIZED), blocks=st.integers(1, 9), seed=st.integers(0, 2**32 - 1),
             classes=st.lists(st.sampled_from(sorted(SCALE_CLASSES)), min_size=1, max_size=3, unique=True))
    def check(qtype, blocks, seed, classes):
        _random_blocks_with_finite_scales(qtype, blocks, seed, classes)
    check()


def _random_blocks_with_finite_scales(qtype, blocks, seed, classes):
    rng = np.random.default_rng(seed)
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    raw = rng.integers(0, 256, (blocks, size), dtype=np.uint8)
    set_scales(raw, qtype, random_halves(rng, (blocks, len(HALF_FIELDS[qtype])), classes))
    check_c_decoder(raw, qtype)


@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda t: t.name)
def test_edge_blocks(qtype):
    """Every code byte at one pattern (all bits clear, all set, the int8 extremes,
    alternating bits), under zero, subnormal, unit and +-maximum scales."""
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    fields = len(HALF_FIELDS[qtype])
    scales = [0x0000, 0x8000, 0x0001, 0x83ff, 0x3c00, 0xbc00, 0x7bff, 0xfbff]
    rows = []
    for fill in (0x00, 0xFF, 0x7F, 0x80, 0x55, 0xAA):
        for s in scales:
            for s2 in (scales if fields == 2 else [None]):
                block = np.full((1, size), fill, np.uint8)
                set_scales(block, qtype, np.array([[s] if s2 is None else [s, s2]], np.uint16))
                rows.append(block)
    check_c_decoder(np.concatenate(rows), qtype)


@pytest.mark.parametrize("qtype", QUANTIZED + PLAIN, ids=lambda t: t.name)
def test_arbitrary_bytes(qtype):
    """Nothing set: NaN and inf scales, every code; F32/F16/BF16 every bit pattern."""
    rng = np.random.default_rng(int(qtype))
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    raw = rng.integers(0, 256, (300 if size < 8 else 40, size), dtype=np.uint8)
    check_c_decoder(raw, qtype)


@pytest.mark.parametrize("qtype", NEW, ids=lambda t: t.name)
def test_parts_and_threads(qtype):
    """ggml_decode splits the blocks into parts of whole blocks (65536 elements,
    256 K super-blocks) over OpenMP threads: every part boundary and thread
    count gives gguf-py's bits."""
    from cism.loaders._ggml_decode import ggml_decode
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(7)
    for elements in (block, 65536, 65536 + block, 3 * 65536 - 3 * block):
        raw = rng.integers(0, 256, (elements // block, size), dtype=np.uint8)
        set_scales(raw, qtype, random_halves(rng, (len(raw), len(HALF_FIELDS[qtype])), ["unit", "tiny"]))
        want = oracle(raw, qtype)
        for threads in (1, 2, 3):
            out = np.full(elements, np.nan, np.float32)
            ggml_decode(int(qtype), raw.reshape(-1), out, threads)
            assert same_bits(out, want), (elements, threads)


# --- GGUF files -----------------------------------------------------------------------

def write_gguf(path, tensors):
    """A qwen3 header (no q/k permutation) and raw tensors: name -> (uint8 bytes
    array of shape (rows, row bytes), GGMLQuantizationType)."""
    w = gguf.GGUFWriter(str(path), "qwen3")
    for key, value in (("block_count", 1), ("embedding_length", 256), ("feed_forward_length", 256),
                       ("attention.head_count", 4), ("attention.head_count_kv", 4),
                       ("context_length", 64)):
        w.add_uint32(f"qwen3.{key}", value)
    w.add_float32("qwen3.attention.layer_norm_rms_epsilon", 1e-6)
    for name, (raw, qtype) in tensors.items():
        w.add_tensor(name, raw, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_row_not_whole_super_blocks_is_refused(tmp_path):
    """The header's row length is checked against the type's block before any
    size is derived from it: a Q4_K row of 288 elements is refused, naming the
    tensor and the block size."""
    rng = np.random.default_rng(1)
    raw = rng.integers(0, 256, (4, 144), dtype=np.uint8)     # 4 rows of one 256-element block
    path = write_gguf(tmp_path / "m.gguf", {"token_embd.weight": (raw, Q.Q4_K)})
    data = bytearray(path.read_bytes())
    name = b"token_embd.weight"
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    assert struct.unpack_from("<IQQ", data, at) == (2, 256, 4)
    struct.pack_into("<Q", data, at + 4, 288)
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"row length 288 is not a multiple of the Q4_K block "
                                              r"size 256") as info:
        load_gguf(path)
    assert "token_embd.weight" in str(info.value)


def test_undecoded_type_is_refused_by_name(tmp_path):
    rng = np.random.default_rng(2)
    raw = rng.integers(0, 256, (4, 66), dtype=np.uint8)      # IQ2_XXS: 66 bytes per 256 elements
    path = write_gguf(tmp_path / "m.gguf", {"token_embd.weight": (raw, Q.IQ2_XXS)})
    with pytest.raises(CheckpointError, match=r"type IQ2_XXS is not supported \(.*Q4_K.*IQ4_XS") as info:
        load_gguf(path)
    assert "token_embd.weight" in str(info.value)


def halves_order(w, heads):
    """llama.cpp's interleaved q/k rows back in HF's rotate-half order
    (the inverse of convert_hf_to_gguf.py's LlamaModel.permute)."""
    rows, cols = w.shape
    return w.reshape(heads, rows // heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def gguf_py_weights(path):
    """gguf-py's reading of every tensor, by GGUF name, in numpy shape, and the types."""
    reader = gguf.GGUFReader(path)
    weights, types = {}, {}
    for t in reader.tensors:
        shape = tuple(int(x) for x in reversed(t.shape))
        weights[t.name] = gguf_dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape)
        types[t.name] = t.tensor_type
    return weights, types


def test_files_cover_every_new_type():
    assert FILES, f"no GGUF files in {DATA}"
    seen = set()
    for path in FILES:
        seen |= set(gguf_py_weights(path)[1].values())
    assert set(NEW) <= seen, sorted(t.name for t in set(NEW) - seen)


# The one-layer files' GGUF names and their HF names, written out here.
GGUF_TO_HF = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}
for _gguf, _hf in (("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm"),
                   ("attn_q", "self_attn.q_proj"), ("attn_k", "self_attn.k_proj"),
                   ("attn_v", "self_attn.v_proj"), ("attn_output", "self_attn.o_proj"),
                   ("ffn_gate", "mlp.gate_proj"), ("ffn_up", "mlp.up_proj"), ("ffn_down", "mlp.down_proj")):
    GGUF_TO_HF[f"blk.0.{_gguf}.weight"] = f"model.layers.0.{_hf}.weight"


@pytest.mark.parametrize("path", FILES, ids=os.path.basename)
def test_llama_quantize_file_matches_gguf_py(path):
    """Each tensor of a file llama-quantize wrote equals gguf-py's dequantisation,
    bit for bit (q and k rows brought to HF order, as the loader does)."""
    ck = load_gguf(path, threads=2)
    heads, kv_heads = ck.config["num_attention_heads"], ck.config["num_key_value_heads"]
    want, _ = gguf_py_weights(path)
    assert set(GGUF_TO_HF) == set(want) and set(ck.weights) == set(GGUF_TO_HF.values())
    for name, hf in GGUF_TO_HF.items():
        w = want[name]
        if name.endswith("attn_q.weight"):
            w = halves_order(w, heads)
        elif name.endswith("attn_k.weight"):
            w = halves_order(w, kv_heads)
        assert same_bits(ck.weights[hf], w), name


@pytest.mark.parametrize("path", FILES, ids=os.path.basename)
def test_llama_quantize_file_generates(path):
    import cism
    model = cism.load(path, precision="fp32", threads=1)
    prompt = model.tokenizer.encode("the cat and the dog")
    tokens = model.create_session(prompt, 4).next_tokens(4)
    assert len(tokens) == 4 and all(0 <= t < model.config.vocab for t in tokens)


@pytest.mark.parametrize("precision", ["fp16", "int8", "hybrid-int4", "hybrid-fp4", "int4", "fp4"])
def test_k_quant_file_packs_into_every_precision(precision):
    """K-quants load by dequantising to float32, then packing like any weights."""
    import cism
    path = os.path.join(DATA, "tiny-llama.Q4_K_M.gguf")
    model = cism.load(path, precision=precision, threads=1)
    assert len(model.generate("the cat", max_new_tokens=3).tokens) == 3
