"""A corpus of broken checkpoints, in every format the loaders read.

Each generator yields ``(case_id, build)``; ``build(directory)`` writes one
broken checkpoint under ``directory`` and returns the path to load. Every case
must raise CheckpointError naming that path; none may crash, hang or allocate
what the file could not hold. Files are written with plain struct/json here
(not the gguf or safetensors packages) so that any header field can be made
to lie.
"""
import json
import os
import struct

import numpy as np

# --- safetensors -------------------------------------------------------------------


def safetensors_bytes(header, data=b"", length=None):
    """Header (dict, or raw JSON text/bytes) + data, with an optional lying length."""
    if isinstance(header, dict):
        header = json.dumps(header)
    if isinstance(header, str):
        header = header.encode()
    n = len(header) if length is None else length
    return struct.pack("<Q", n) + header + data


def valid_safetensors_parts():
    """(header dict, data bytes) of a small file with one tensor per dtype."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((2, 3)).astype("<f4").tobytes()
    b = rng.standard_normal(4).astype("<f2").tobytes()
    c = rng.integers(0, 1 << 16, 4, dtype="<u2").tobytes()
    header = {
        "__metadata__": {"format": "pt"},
        "a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
        "b": {"dtype": "F16", "shape": [4], "data_offsets": [24, 32]},
        "c": {"dtype": "BF16", "shape": [2, 2], "data_offsets": [32, 40]},
    }
    return header, a + b + c


def _with_entry(header, name, **changes):
    h = json.loads(json.dumps(header))
    h[name].update(changes)
    return h


def safetensors_cases():
    """(case_id, file bytes) of broken safetensors files."""
    header, data = valid_safetensors_parts()
    good = safetensors_bytes(header, data)
    cases = []
    for cut in sorted(set(list(range(0, 24)) + list(range(24, len(good), 7)))):
        cases.append((f"truncated-{cut}", good[:cut]))
    text = json.dumps(header).encode()
    cases += [
        ("length-huge", safetensors_bytes(header, data, length=1 << 62)),
        ("length-max", safetensors_bytes(header, data, length=(1 << 64) - 1)),
        ("length-past-eof", safetensors_bytes(header, data, length=len(text) + len(data) + 1)),
        ("length-short", safetensors_bytes(header, data, length=len(text) - 1)),
        ("length-zero", safetensors_bytes(header, data, length=0)),
        ("not-json", safetensors_bytes("{not json", data)),
        ("not-utf8", safetensors_bytes(b'{"a\xff": 1}', data)),
        ("json-list", safetensors_bytes("[1, 2, 3]", data)),
        ("json-string", safetensors_bytes('"hello"', data)),
        ("deep-nesting", safetensors_bytes("[" * 100000 + "]" * 100000, data)),
        ("huge-int-literal", safetensors_bytes('{"a": {"dtype": "F32", "shape": [' + "9" * 5000
                                               + '], "data_offsets": [0, 24]}}', data)),
        ("entry-not-object", safetensors_bytes({"a": [1, 2]}, data)),
        ("metadata-not-object", safetensors_bytes(dict(header, __metadata__=[1]), data)),
        ("missing-dtype", safetensors_bytes({"a": {"shape": [2, 3], "data_offsets": [0, 24]}}, data)),
        ("missing-shape", safetensors_bytes({"a": {"dtype": "F32", "data_offsets": [0, 24]}}, data)),
        ("missing-offsets", safetensors_bytes({"a": {"dtype": "F32", "shape": [2, 3]}}, data)),
        ("dtype-I64", safetensors_bytes(_with_entry(header, "a", dtype="I64", shape=[3]), data)),
        ("dtype-F64", safetensors_bytes(_with_entry(header, "a", dtype="F64", shape=[3]), data)),
        ("dtype-lowercase", safetensors_bytes(_with_entry(header, "a", dtype="f32"), data)),
        ("dtype-number", safetensors_bytes(_with_entry(header, "a", dtype=32), data)),
        ("shape-negative", safetensors_bytes(_with_entry(header, "a", shape=[-2, -3]), data)),
        ("shape-float", safetensors_bytes(_with_entry(header, "a", shape=[2.0, 3]), data)),
        ("shape-bool", safetensors_bytes(_with_entry(header, "a", shape=[True, 6]), data)),
        ("shape-string", safetensors_bytes(_with_entry(header, "a", shape="2,3"), data)),
        ("shape-overflow-64", safetensors_bytes(_with_entry(header, "a", shape=[1 << 32, 1 << 32, 6]), data)),
        ("shape-overflow-wraps-to-6", safetensors_bytes(
            _with_entry(header, "a", shape=[(1 << 64) + 6]), data)),
        ("shape-mismatch", safetensors_bytes(_with_entry(header, "a", shape=[2, 4]), data)),
        ("offsets-reversed", safetensors_bytes(_with_entry(header, "a", data_offsets=[24, 0]), data)),
        ("offsets-past-eof", safetensors_bytes(_with_entry(header, "c", data_offsets=[32, 48],
                                                           shape=[2, 4]), data)),
        ("offsets-huge", safetensors_bytes(_with_entry(header, "c", data_offsets=[1 << 62, (1 << 62) + 8]), data)),
        ("offsets-negative", safetensors_bytes(_with_entry(header, "a", data_offsets=[-24, 0]), data)),
        ("offsets-three", safetensors_bytes(_with_entry(header, "a", data_offsets=[0, 12, 24]), data)),
        ("offsets-not-list", safetensors_bytes(_with_entry(header, "a", data_offsets={"0": 24}), data)),
        ("overlap", safetensors_bytes(_with_entry(header, "b", data_offsets=[20, 28]), data)),
        ("same-range-twice", safetensors_bytes(_with_entry(header, "c", dtype="F16", shape=[4],
                                                           data_offsets=[24, 32]), data)),
        ("duplicate-name", safetensors_bytes(
            text[:-1] + b', "a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}}', data)),
        ("duplicate-field", safetensors_bytes(
            b'{"a": {"dtype": "F32", "dtype": "F16", "shape": [2, 3], "data_offsets": [0, 24]}}', data)),
        # zero elements, so the byte count is honest, but numpy cannot shape it (found by fuzzing)
        ("zero-size-shape-too-large", safetensors_bytes(
            dict(header, z={"dtype": "F32", "shape": [0, 1 << 62], "data_offsets": [40, 40]}), data)),
        ("zero-size-shape-past-intp", safetensors_bytes(
            dict(header, z={"dtype": "F16", "shape": [1 << 40, 0, 1 << 40], "data_offsets": [40, 40]}),
            data)),
    ]
    return cases


# --- GGUF --------------------------------------------------------------------------

GGUF_U32, GGUF_I32, GGUF_F32, GGUF_BOOL, GGUF_STR, GGUF_ARR, GGUF_U64 = 4, 5, 6, 7, 8, 9, 10


def gstr(s):
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def kv(key, vtype, value):
    """One metadata entry; ``value`` is already-encoded payload bytes or a Python value."""
    if isinstance(value, bytes) and vtype != GGUF_STR:
        payload = value
    elif vtype == GGUF_STR:
        payload = gstr(value)
    else:
        payload = struct.pack({GGUF_U32: "<I", GGUF_I32: "<i", GGUF_F32: "<f", GGUF_BOOL: "<?",
                               GGUF_U64: "<Q"}[vtype], value)
    return gstr(key) + struct.pack("<I", vtype) + payload


def kv_str_array(key, items):
    return (gstr(key) + struct.pack("<IIQ", GGUF_ARR, GGUF_STR, len(items))
            + b"".join(gstr(i) for i in items))


def tensor_info(name, dims, type_id, offset):
    return (gstr(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims)
            + struct.pack("<IQ", type_id, offset))


def gguf_bytes(kvs, infos, data, magic=b"GGUF", version=3, n_kv=None, n_tensors=None, alignment=32):
    head = (magic + struct.pack("<I", version)
            + struct.pack("<QQ", len(infos) if n_tensors is None else n_tensors,
                          len(kvs) if n_kv is None else n_kv)
            + b"".join(kvs) + b"".join(infos))
    pad = -len(head) % alignment
    return head + b"\0" * pad + data


# A complete one-layer llama: hidden 32, 2 heads of 16, 1 KV head, FFN 64, vocab 8.
# (name, ne (fastest first), ggml type id)
GGUF_TENSORS = [
    ("token_embd.weight", (32, 8), 8),          # Q8_0
    ("blk.0.attn_norm.weight", (32,), 0),       # F32
    ("blk.0.attn_q.weight", (32, 32), 2),       # Q4_0
    ("blk.0.attn_k.weight", (32, 16), 3),       # Q4_1
    ("blk.0.attn_v.weight", (32, 16), 1),       # F16
    ("blk.0.attn_output.weight", (32, 32), 30),  # BF16
    ("blk.0.ffn_norm.weight", (32,), 0),
    ("blk.0.ffn_gate.weight", (32, 64), 0),
    ("blk.0.ffn_up.weight", (32, 64), 0),
    ("blk.0.ffn_down.weight", (64, 32), 8),
    ("output_norm.weight", (32,), 0),
]
_BLOCK = {0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 8: (32, 34), 9: (32, 40), 12: (256, 144),
          30: (1, 2)}


def gguf_metadata(arch="llama", **overrides):
    entries = {
        "general.architecture": (GGUF_STR, arch),
        f"{arch}.block_count": (GGUF_U32, 1),
        f"{arch}.embedding_length": (GGUF_U32, 32),
        f"{arch}.feed_forward_length": (GGUF_U32, 64),
        f"{arch}.attention.head_count": (GGUF_U32, 2),
        f"{arch}.attention.head_count_kv": (GGUF_U32, 1),
        f"{arch}.context_length": (GGUF_U32, 64),
        f"{arch}.attention.layer_norm_rms_epsilon": (GGUF_F32, 1e-5),
        f"{arch}.rope.freq_base": (GGUF_F32, 10000.0),
    }
    entries.update(overrides)
    kvs = []
    for key, spec in entries.items():
        if spec is None:
            continue
        kvs.append(kv_str_array(key, spec[1]) if spec[0] == "strings" else kv(key, *spec))
    return kvs


def gguf_tensor_infos(tensors=GGUF_TENSORS, alignment=32):
    """(tensor info entries, data bytes) with each tensor aligned."""
    rng = np.random.default_rng(1)
    infos, data = [], b""
    for name, ne, type_id in tensors:
        block, nbytes = _BLOCK[type_id]
        size = int(np.prod(ne)) // block * nbytes
        data += b"\0" * (-len(data) % alignment)
        infos.append(tensor_info(name, ne, type_id, len(data)))
        if type_id in (0, 1):   # finite floats for the plain float types
            data += rng.standard_normal(size // (4 if type_id == 0 else 2)).astype(
                "<f4" if type_id == 0 else "<f2").tobytes()
        else:
            data += rng.integers(0, 256, size, dtype=np.uint8).tobytes()
    return infos, data


def valid_gguf():
    infos, data = gguf_tensor_infos()
    return gguf_bytes(gguf_metadata(), infos, data)


def gguf_cases():
    good = valid_gguf()
    infos, data = gguf_tensor_infos()
    meta = gguf_metadata()
    cases = []
    header_len = len(good) - len(data)
    for cut in sorted(set(list(range(0, min(header_len, 200))) + list(range(200, header_len, 9))
                          + list(range(header_len, len(good), 997)) + [len(good) - 1])):
        cases.append((f"truncated-{cut}", good[:cut]))

    def with_tensors(tensors, **kw):
        i, d = gguf_tensor_infos(tensors)
        return gguf_bytes(meta, i, d, **kw)

    def replace_tensor(name, ne=None, type_id=None):
        return [(n, ne if n == name and ne else e, type_id if n == name and type_id is not None else t)
                for n, e, t in GGUF_TENSORS]

    big = 1 << 63
    cases += [
        ("bad-magic", b"GGUG" + good[4:]),
        ("version-1", gguf_bytes(meta, infos, data, version=1)),
        ("version-4", gguf_bytes(meta, infos, data, version=4)),
        ("big-endian", gguf_bytes(meta, infos, data, version=3 << 24)),
        ("huge-tensor-count", gguf_bytes(meta, infos, data, n_tensors=1 << 60)),
        ("huge-kv-count", gguf_bytes(meta, infos, data, n_kv=1 << 60)),
        ("kv-count-too-high", gguf_bytes(meta, infos, data, n_kv=len(meta) + 1)),
        ("tensor-count-too-high", gguf_bytes(meta, infos, data, n_tensors=len(infos) + 1)),
        ("huge-key-length", gguf_bytes([struct.pack("<Q", big)] + meta, infos, data)),
        ("huge-string-value", gguf_bytes(meta + [gstr("general.name") + struct.pack("<IQ", GGUF_STR, big)],
                                         infos, data)),
        ("huge-array-count", gguf_bytes(meta + [gstr("x") + struct.pack("<IIQ", GGUF_ARR, GGUF_U32, big)],
                                        infos, data)),
        ("huge-string-array", gguf_bytes(meta + [gstr("tokenizer.ggml.tokens")
                                                 + struct.pack("<IIQ", GGUF_ARR, GGUF_STR, 1 << 40)],
                                         infos, data)),
        ("array-string-length-lies", gguf_bytes(meta + [gstr("tokenizer.ggml.tokens")
                                                        + struct.pack("<IIQQ", GGUF_ARR, GGUF_STR, 2, 3)
                                                        + b"abc" + struct.pack("<Q", big)],
                                                infos, data)),
        ("deep-array-nesting", gguf_bytes(meta + [gstr("x") + struct.pack("<I", GGUF_ARR)
                                                  + struct.pack("<IQ", GGUF_ARR, 1) * 50
                                                  + struct.pack("<IQ", GGUF_U32, 0)], infos, data)),
        ("unknown-value-type", gguf_bytes(meta + [gstr("x") + struct.pack("<I", 99)], infos, data)),
        ("unknown-array-type", gguf_bytes(meta + [gstr("x") + struct.pack("<IIQ", GGUF_ARR, 99, 1)],
                                          infos, data)),
        ("key-not-utf8", gguf_bytes(meta + [kv(b"\xff\xfe", GGUF_U32, 1)], infos, data)),
        ("duplicate-key", gguf_bytes(meta + [kv("llama.block_count", GGUF_U32, 1)], infos, data)),
        ("duplicate-tensor", gguf_bytes(meta, infos + [infos[1]], data)),
        ("n-dims-0", gguf_bytes(meta, [tensor_info("output_norm.weight", (), 0, 0)] + infos[:-1], data)),
        ("n-dims-5", gguf_bytes(meta, infos[:-1] + [tensor_info("output_norm.weight", (32, 1, 1, 1, 1), 0,
                                                                0)], data)),
        ("dims-overflow", gguf_bytes(meta, infos[:-1] + [tensor_info("output_norm.weight", (big, big), 0,
                                                                     0)], data)),
        # 32 * 2**59 wraps to 0 in 64-bit arithmetic.
        ("dims-wrap-to-0", gguf_bytes(meta, infos[:-1] + [tensor_info("output_norm.weight",
                                                                      (32, 1 << 59), 0, 0)], data)),
        ("offset-past-eof", gguf_bytes(meta, infos[:-1] + [tensor_info("output_norm.weight", (32,), 0,
                                                                       len(data) + 32)], data)),
        ("offset-huge", gguf_bytes(meta, infos[:-1] + [tensor_info("output_norm.weight", (32,), 0,
                                                                   (1 << 64) - 32)], data)),
        ("offset-misaligned", gguf_bytes(meta, infos[:-1] + [tensor_info("output_norm.weight", (32,), 0,
                                                                         4)], data)),
        ("overlapping", gguf_bytes(meta, infos[:-1] + [tensor_info("output_norm.weight", (32,), 0, 0)],
                                   data)),
        ("unknown-ggml-type", gguf_bytes(meta, infos[:-1] + [tensor_info("output_norm.weight", (32,), 77,
                                                                         0)], data)),
        # Q8_1 is a known ggml type that cism does not decode (llama.cpp uses it
        # only for activations).
        ("unsupported-q8_1", with_tensors(replace_tensor("blk.0.attn_q.weight", type_id=9))),
        ("row-not-whole-blocks", with_tensors(replace_tensor("blk.0.ffn_down.weight", ne=(48, 32)))),
        ("row-not-whole-q4_k-blocks", with_tensors(replace_tensor("blk.0.attn_q.weight", type_id=12))),
        ("alignment-3", gguf_bytes(meta + [kv("general.alignment", GGUF_U32, 3)], infos, data)),
        ("alignment-0", gguf_bytes(meta + [kv("general.alignment", GGUF_U32, 0)], infos, data)),
        ("alignment-string", gguf_bytes(meta + [kv("general.alignment", GGUF_STR, "32")], infos, data)),
        ("no-architecture", gguf_bytes(gguf_metadata(**{"general.architecture": None}), infos, data)),
        ("architecture-number", gguf_bytes(gguf_metadata(**{"general.architecture": (GGUF_U32, 1)}),
                                           infos, data)),
        ("architecture-gpt2", gguf_bytes(gguf_metadata(arch="gpt2"), infos, data)),
        ("architecture-phi3", gguf_bytes(gguf_metadata(arch="phi3"), infos, data)),
        ("no-block-count", gguf_bytes(gguf_metadata(**{"llama.block_count": None}), infos, data)),
        ("head-count-zero", gguf_bytes(gguf_metadata(**{"llama.attention.head_count": (GGUF_U32, 0)}),
                                       infos, data)),
        ("head-count-string", gguf_bytes(gguf_metadata(**{"llama.attention.head_count": (GGUF_STR, "2")}),
                                         infos, data)),
        ("head-count-array", gguf_bytes(gguf_metadata(**{"llama.attention.head_count": ("strings", ["2"])}),
                                        infos, data)),
        ("head-count-negative", gguf_bytes(gguf_metadata(**{"llama.attention.head_count": (GGUF_I32, -2)}),
                                           infos, data)),
        ("eps-string", gguf_bytes(gguf_metadata(**{"llama.attention.layer_norm_rms_epsilon": (GGUF_STR, "x")}),
                                  infos, data)),
        ("hidden-not-multiple-of-heads", gguf_bytes(gguf_metadata(**{"llama.attention.head_count":
                                                                     (GGUF_U32, 3)}), infos, data)),
        ("heads-not-multiple-of-pairs", gguf_bytes(gguf_metadata(**{"llama.attention.head_count": (GGUF_U32, 4),
                                                                    "llama.attention.key_length": (GGUF_U32, 8),
                                                                    "llama.attention.head_count_kv":
                                                                    (GGUF_U32, 3)}), infos, data)),
        ("value-length-differs", gguf_bytes(gguf_metadata(**{"llama.attention.value_length": (GGUF_U32, 8)}),
                                            infos, data)),
        ("partial-rotary", gguf_bytes(gguf_metadata(**{"llama.rope.dimension_count": (GGUF_U32, 8)}),
                                      infos, data)),
        ("rope-scaling-longrope", gguf_bytes(gguf_metadata(**{"llama.rope.scaling.type": (GGUF_STR, "longrope"),
                                                              "llama.rope.scaling.factor": (GGUF_F32, 4.0)}),
                                             infos, data)),
        ("rope-scaling-yarn-ext-factor", gguf_bytes(gguf_metadata(**{
            "llama.rope.scaling.type": (GGUF_STR, "yarn"), "llama.rope.scaling.factor": (GGUF_F32, 4.0),
            "llama.rope.scaling.yarn_ext_factor": (GGUF_F32, 0.5)}), infos, data)),
        ("rope-scaling-yarn-beta-negative", gguf_bytes(gguf_metadata(**{
            "llama.rope.scaling.type": (GGUF_STR, "yarn"), "llama.rope.scaling.factor": (GGUF_F32, 4.0),
            "llama.rope.scaling.yarn_beta_fast": (GGUF_F32, -32.0)}), infos, data)),
        ("rope-scaling-attn-factor", gguf_bytes(gguf_metadata(**{"llama.rope.scaling.attn_factor": (GGUF_F32, 2.0)}),
                                                infos, data)),
        ("rope-scaling-linear-negative", gguf_bytes(gguf_metadata(**{"llama.rope.scaling.type": (GGUF_STR, "linear"),
                                                                     "llama.rope.scaling.factor": (GGUF_F32, -2.0)}),
                                                    infos, data)),
        ("rope-freqs-negative", with_tensors(GGUF_TENSORS + [("rope_freqs.weight", (8,), 0)])),  # random signs
        ("rope-freqs-wrong-length", with_tensors(GGUF_TENSORS + [("rope_freqs.weight", (6,), 0)])),
        ("rope-freqs-f16", with_tensors(GGUF_TENSORS + [("rope_freqs.weight", (8,), 1)])),
        ("moe", gguf_bytes(gguf_metadata(**{"llama.expert_count": (GGUF_U32, 8)}), infos, data)),
        ("split-file", gguf_bytes(gguf_metadata(**{"split.count": (GGUF_U32, 3)}), infos, data)),
        ("unknown-tensor-name", with_tensors(GGUF_TENSORS + [("blk.0.attn_output.bias", (32,), 0)])),
        ("unmappable-layer-name", with_tensors(GGUF_TENSORS + [("blk.x.attn_q.weight", (32,), 0)])),
        ("two-names-one-target", with_tensors(GGUF_TENSORS + [("blk.00.attn_norm.weight", (32,), 0)])),
        ("no-vocab-anywhere", with_tensors(GGUF_TENSORS[1:])),
        ("zero-dim-past-intp", with_tensors(replace_tensor("output_norm.weight", ne=(0, 1 << 63)))),
        ("zero-dim-too-large", with_tensors(replace_tensor("output_norm.weight",
                                                           ne=(0, 1 << 40, 1 << 40)))),
    ]
    return cases


# --- llama2.c ----------------------------------------------------------------------

LLAMA2C_PARAMS = dict(dim=8, hidden_dim=12, n_layers=2, n_heads=2, n_kv_heads=1, vocab_size=10, seq_len=6)


def llama2c_float_count(p, tied=True):
    dim, hidden, layers, vocab = p["dim"], p["hidden_dim"], p["n_layers"], abs(p["vocab_size"])
    kv_dim = dim * p["n_kv_heads"] // p["n_heads"]
    head = dim // p["n_heads"]
    n = (vocab * dim + 2 * layers * dim + 2 * layers * dim * dim + 2 * layers * kv_dim * dim
         + 3 * layers * hidden * dim + dim + p["seq_len"] * head)
    return n if tied else n + vocab * dim


def llama2c_bytes(p=LLAMA2C_PARAMS, tied=True, floats=None, seed=2):
    header = dict(p, vocab_size=abs(p["vocab_size"]) * (1 if tied else -1))
    if floats is None:
        floats = np.random.default_rng(seed).standard_normal(llama2c_float_count(p, tied)).astype("<f4")
    return struct.pack("<7i", *header.values()) + np.asarray(floats, "<f4").tobytes()


def llama2c_cases():
    good = llama2c_bytes()
    cases = [(f"truncated-{cut}", good[:cut])
             for cut in sorted(set(list(range(0, 40)) + list(range(40, len(good), 61))))]
    cases += [("one-byte-extra", good + b"\0"), ("one-float-extra", good + b"\0" * 4),
              ("tied-flag-flipped", llama2c_bytes(tied=False)[:len(good) - 4] + b"\0" * 4)]
    body = good[28:]
    for field, values in [("dim", [0, -8, 1 << 20, 7]), ("hidden_dim", [0, -1, 1 << 30]),
                          ("n_layers", [0, -2, 100000]), ("n_heads", [0, -2, 3, 1 << 20]),
                          ("n_kv_heads", [0, -1, 3, 4]), ("vocab_size", [0, -(1 << 31), 1 << 30]),
                          ("seq_len", [0, -6, 1 << 30])]:
        for v in values:
            p = dict(LLAMA2C_PARAMS, **{field: v})
            cases.append((f"{field}={v}", struct.pack("<7i", *p.values()) + body))
    odd_head = dict(LLAMA2C_PARAMS, dim=6, n_heads=2)   # head size 3
    cases.append(("odd-head-size", struct.pack("<7i", *odd_head.values()) + body))
    cases.append(("v2-int8", struct.pack("<Ii", 0x616B3432, 2) + good))
    cases.append(("v7", struct.pack("<Ii", 0x616B3432, 7) + good))
    cases.append(("v1-short-header", struct.pack("<Ii", 0x616B3432, 1) + good[:100]))
    v1_flag = struct.pack("<Ii7iB", 0x616B3432, 1, *LLAMA2C_PARAMS.values(), 5)
    cases.append(("v1-bad-flag", v1_flag + b"\0" * (256 - len(v1_flag)) + body))
    return cases


# --- Hugging Face directories ------------------------------------------------------

CONFIG = {"model_type": "llama", "hidden_size": 32, "num_hidden_layers": 1}


def _write(path, data):
    with open(path, "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())


def _good_file():
    header, data = valid_safetensors_parts()
    return safetensors_bytes(header, data)


def _sharded(directory, weight_map, shards=None):
    """Two shards: s1 holds a and b, s2 holds c; the index says ``weight_map``."""
    header, data = valid_safetensors_parts()
    if shards is None:
        shards = {"s1.safetensors": {k: header[k] for k in ("a", "b")},
                  "s2.safetensors": {"c": dict(header["c"], data_offsets=[0, 8])}}
    for name, entries in shards.items():
        _write(os.path.join(directory, name), safetensors_bytes(entries, data))
    _write(os.path.join(directory, "model.safetensors.index.json"),
           json.dumps({"metadata": {}, "weight_map": weight_map}))


GOOD_MAP = {"a": "s1.safetensors", "b": "s1.safetensors", "c": "s2.safetensors"}


def hf_dir_cases():
    """(case_id, build(directory) -> model directory)."""
    def model_dir(config=CONFIG, weights=True):
        def build(root):
            d = os.path.join(root, "model")
            os.makedirs(d)
            if config is not None:
                _write(os.path.join(d, "config.json"), config if isinstance(config, (str, bytes))
                       else json.dumps(config))
            if weights:
                _write(os.path.join(d, "model.safetensors"), _good_file())
            return d
        return build

    def sharded(weight_map, shards=None, extra=None):
        def build(root):
            d = model_dir(weights=False)(root)
            _sharded(d, weight_map, shards)
            if extra:
                extra(root, d)
            return d
        return build

    def outside_file(root, d):
        _write(os.path.join(root, "outside.safetensors"), _good_file())

    def symlink_out(root, d):
        outside_file(root, d)
        os.symlink(os.path.join(root, "outside.safetensors"), os.path.join(d, "link.safetensors"))

    def symlink_dir_out(root, d):
        os.makedirs(os.path.join(root, "elsewhere"))
        os.symlink(os.path.join(root, "elsewhere"), os.path.join(d, "sub"))

    header, _ = valid_safetensors_parts()
    cases = [
        ("no-config", model_dir(config=None)),
        ("config-not-json", model_dir(config="{oops")),
        ("config-list", model_dir(config="[1, 2]")),
        ("config-not-utf8", model_dir(config=b'{"model_type": "\xff"}')),
        ("config-duplicate-key", model_dir(config='{"model_type": "llama", "model_type": "qwen3"}')),
        ("config-no-model-type", model_dir(config={"hidden_size": 32})),
        ("config-model-type-number", model_dir(config={"model_type": 3})),
        ("config-hidden-string", model_dir(config=dict(CONFIG, hidden_size="32"))),
        ("config-hidden-float", model_dir(config=dict(CONFIG, hidden_size=32.0))),
        ("config-layers-bool", model_dir(config=dict(CONFIG, num_hidden_layers=True))),
        ("config-eps-string", model_dir(config=dict(CONFIG, rms_norm_eps="1e-5"))),
        ("config-tie-int", model_dir(config=dict(CONFIG, tie_word_embeddings=1))),
        ("config-head-dim-list", model_dir(config=dict(CONFIG, head_dim=[64]))),
        ("no-weights", model_dir(weights=False)),
        ("index-not-json", sharded(GOOD_MAP, extra=lambda r, d: _write(
            os.path.join(d, "model.safetensors.index.json"), "{"))),
        ("index-no-weight-map", sharded(GOOD_MAP, extra=lambda r, d: _write(
            os.path.join(d, "model.safetensors.index.json"), '{"metadata": {}}'))),
        ("index-weight-map-list", sharded(GOOD_MAP, extra=lambda r, d: _write(
            os.path.join(d, "model.safetensors.index.json"), '{"weight_map": ["a"]}'))),
        ("index-empty", sharded({})),
        ("index-shard-number", sharded(dict(GOOD_MAP, c=3))),
        ("index-absolute-path", sharded(dict(GOOD_MAP, c="/etc/passwd"))),
        ("index-dotdot", sharded(dict(GOOD_MAP, c="../outside.safetensors"), extra=outside_file)),
        ("index-subdir", sharded(dict(GOOD_MAP, c="sub/s2.safetensors"))),
        ("index-dot", sharded(dict(GOOD_MAP, c="."))),
        ("index-dir-symlink-out", sharded(dict(GOOD_MAP, c="sub"), extra=symlink_dir_out)),
        ("index-empty-name", sharded(dict(GOOD_MAP, c=""))),
        ("index-symlink-escape", sharded(dict(GOOD_MAP, c="link.safetensors"), extra=symlink_out)),
        ("index-missing-shard", sharded(dict(GOOD_MAP, c="s3.safetensors"))),
        ("index-tensor-absent", sharded(dict(GOOD_MAP, d="s2.safetensors"))),
        ("index-wrong-shard", sharded(dict(GOOD_MAP, b="s2.safetensors"))),
        ("index-unlisted-tensor", sharded({"a": "s1.safetensors", "c": "s2.safetensors"})),
        ("tensor-in-two-shards", sharded(GOOD_MAP, shards={
            "s1.safetensors": {k: header[k] for k in ("a", "b")},
            "s2.safetensors": {"c": dict(header["c"], data_offsets=[0, 8]),
                               "a": dict(header["a"], data_offsets=[8, 32])}})),
        ("bad-shard-header", sharded(GOOD_MAP, shards={
            "s1.safetensors": {k: header[k] for k in ("a", "b")},
            "s2.safetensors": {"c": dict(header["c"], dtype="I8")}})),
        ("model-safetensors-symlink-escape", lambda root: _symlinked_single(root)),
        ("model-safetensors-dangling", lambda root: _dangling_single(root)),
        ("two-files-no-index", lambda root: _two_files(root)),
        ("pytorch-only", lambda root: _pytorch_only(root)),
        ("not-a-directory-config", lambda root: _config_file(root)),
    ]
    for name, data in safetensors_cases():
        cases.append((f"safetensors-{name}", _single_file(data)))
    return cases


def _single_file(data):
    def build(root):
        d = os.path.join(root, "model")
        os.makedirs(d)
        _write(os.path.join(d, "config.json"), json.dumps(CONFIG))
        _write(os.path.join(d, "model.safetensors"), data)
        return d
    return build


def _symlinked_single(root):
    d = os.path.join(root, "model")
    os.makedirs(d)
    _write(os.path.join(d, "config.json"), json.dumps(CONFIG))
    _write(os.path.join(root, "secret.safetensors"), _good_file())
    os.symlink(os.path.join(root, "secret.safetensors"), os.path.join(d, "model.safetensors"))
    return d


def _dangling_single(root):
    d = os.path.join(root, "model")
    os.makedirs(d)
    _write(os.path.join(d, "config.json"), json.dumps(CONFIG))
    os.symlink(os.path.join(d, "nowhere"), os.path.join(d, "model.safetensors"))
    return d


def _two_files(root):
    d = os.path.join(root, "model")
    os.makedirs(d)
    _write(os.path.join(d, "config.json"), json.dumps(CONFIG))
    _write(os.path.join(d, "a.safetensors"), _good_file())
    _write(os.path.join(d, "b.safetensors"), _good_file())
    return d


def _pytorch_only(root):
    d = os.path.join(root, "model")
    os.makedirs(d)
    _write(os.path.join(d, "config.json"), json.dumps(CONFIG))
    _write(os.path.join(d, "pytorch_model.bin"), b"PK\3\4")
    return d


def _config_file(root):
    d = os.path.join(root, "model")
    os.makedirs(d)
    _write(os.path.join(d, "config.json"), json.dumps(CONFIG))
    return os.path.join(d, "config.json")


# --- the message each case must produce --------------------------------------------
# Each case's fragments must all appear in str(CheckpointError), with the loaded
# path written <P> and the temporary directory holding it <R>. They name the
# defect, and for a truncation where the file ends. Messages that quote Python's
# own parser (json) are matched up to that quotation only.

def gguf_truncated_message(cut):
    """What loading valid_gguf()[:cut] must say."""
    meta = gguf_metadata()
    infos, _ = gguf_tensor_infos()
    for start, size, field in ((0, 4, "the magic"), (4, 4, "the version"), (8, 8, "the tensor count"),
                               (16, 8, "the metadata count")):
        if cut < start + size:
            return (f"truncated: {field} at byte {start} needs {size} bytes, the file has {cut}",)
    # The smallest entries the counts can describe: 13 bytes per metadata entry, 32 per tensor.
    if cut - 24 < 13 * len(meta) + 32 * len(infos):
        return (f"header claims {len(meta)} metadata entries and {len(infos)} tensors, "
                f"more than the {cut}-byte file can hold",)
    pos = 24 + sum(map(len, meta))
    for i, (name, ne, _) in enumerate(GGUF_TENSORS):
        fields = [(f"tensor name {i}", 8), (f"tensor name {i}", len(name)), (f"tensor {name!r}", 4)]
        fields += [(f"tensor {name!r}", 8)] * len(ne) + [(f"tensor {name!r}", 4), (f"tensor {name!r}", 8)]
        for what, size in fields:
            if cut < pos + size:
                return (f"truncated: {what} at byte {pos} needs {size} bytes, the file has {cut}",)
            pos += size
    data_start = pos + -pos % 32
    offset = 0
    for name, ne, type_id in GGUF_TENSORS:
        block, nbytes = _BLOCK[type_id]
        offset += -offset % 32
        start, end = data_start + offset, data_start + offset + int(np.prod(ne)) // block * nbytes
        if end > cut:
            return (f"tensor {name!r}: data [{start}, {end}) runs past the end of the {cut}-byte file",)
        offset = end - data_start
    raise AssertionError(f"cut {cut} leaves the file whole")


def llama2c_truncated_message(cut):
    """What loading llama2c_bytes()[:cut] must say."""
    if cut < 28:
        return (f"{cut} bytes is too short for a llama2.c header (28 bytes)",)
    return (f"is {cut} bytes but its header (dim=8, hidden_dim=12, n_layers=2, n_heads=2, n_kv_heads=1, "
            f"vocab_size=10, seq_len=6, tied) implies {len(llama2c_bytes())}",)


def safetensors_truncated_message(cut):
    """What loading a directory whose model.safetensors is the valid file cut at byte ``cut`` must say."""
    header, data = valid_safetensors_parts()
    n = len(json.dumps(header).encode())
    if cut < 8:
        return (f"<P>/model.safetensors: {cut} bytes is too short for a safetensors header",)
    if cut < 8 + n:
        return (f"<P>/model.safetensors: header length {n} (after the 8-byte length) runs past the end "
                f"of the {cut}-byte file",)
    have = cut - 8 - n
    name, entry = next((k, e) for k, e in header.items() if k != "__metadata__" and e["data_offsets"][1] > have)
    a, b = entry["data_offsets"]
    return (f"<P>/model.safetensors: tensor {name!r}: data_offsets [{a}, {b}) lie outside "
            f"the {have}-byte data section",)


# A complete one-layer llama's messages for each broken variant.
GGUF_MESSAGES = {
    "bad-magic": "not a GGUF file (starts with b'GGUG', expected b'GGUF')",
    "version-1": "GGUF version 1 is not supported (2 or 3)",
    "version-4": "GGUF version 4 is not supported (2 or 3)",
    "big-endian": "big-endian GGUF files are not supported",
    "huge-tensor-count": "header claims 9 metadata entries and 1152921504606846976 tensors, more than the "
                         "24256-byte file can hold",
    "huge-kv-count": "header claims 1152921504606846976 metadata entries and 11 tensors, more than the "
                     "24256-byte file can hold",
    # One entry too many: the first tensor entry is read as metadata, and what
    # follows no longer parses (the file cannot say which count lies).
    "kv-count-too-high": "truncated: tensor name 0 at byte 433 needs 2251799813685248 bytes",
    # One tensor too many: the zero padding after the tensor list is read as a
    # tensor entry with an empty name and no dimensions.
    "tensor-count-too-high": "tensor '': has 0 dimensions (1 to 4 allowed)",
    "huge-key-length": "truncated: metadata key 0 at byte 32 needs 9223372036854775808 bytes",
    "huge-string-value": "truncated: metadata 'general.name' at byte 426 needs 9223372036854775808 bytes",
    "huge-array-count": "metadata 'x' claims 9223372036854775808 elements, more than the rest of the file can hold",
    "huge-string-array": "metadata 'tokenizer.ggml.tokens' claims 1099511627776 elements, more than the rest "
                         "of the file can hold",
    "array-string-length-lies": "truncated: metadata 'tokenizer.ggml.tokens' at byte 458 needs "
                                "9223372036854775808 bytes",
    "deep-array-nesting": "metadata 'x' nests arrays more than 4 deep",
    "unknown-value-type": "metadata 'x' has unknown value type 99",
    "unknown-array-type": "metadata 'x' is an array of unknown type 99",
    "key-not-utf8": "metadata key 9 is not valid UTF-8",
    "duplicate-key": "metadata key 'llama.block_count' appears twice",
    "duplicate-tensor": "tensor 'blk.0.attn_norm.weight': appears twice in the tensor list",
    "n-dims-0": "tensor 'output_norm.weight': has 0 dimensions (1 to 4 allowed)",
    "n-dims-5": "tensor 'output_norm.weight': has 5 dimensions (1 to 4 allowed)",
    "dims-overflow": "tensor 'output_norm.weight': data [1056, 340282366920938463463374607431768212512) runs "
                     "past the end of the 24256-byte file",
    "dims-wrap-to-0": "tensor 'output_norm.weight': data [1056, 73786976294838207520) runs past the end "
                      "of the 24256-byte file",
    "offset-past-eof": "tensor 'output_norm.weight': data [24288, 24416) runs past the end of the 24256-byte file",
    "offset-huge": "tensor 'output_norm.weight': data [18446744073709552640, 18446744073709552768) runs past "
                   "the end of the 24256-byte file",
    "offset-misaligned": "tensor 'output_norm.weight': data offset 4 is not a multiple of the alignment 32",
    "overlapping": "tensor 'output_norm.weight': data overlaps tensor 'token_embd.weight'",
    "unknown-ggml-type": "tensor 'output_norm.weight': has unknown ggml type 77",
    "unsupported-q8_1": "tensor 'blk.0.attn_q.weight': type Q8_1 is not supported (F32, F16, BF16, Q8_0, Q4_0, "
                        "Q4_1, Q5_0, Q5_1, IQ4_NL, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS)",
    "row-not-whole-blocks": "tensor 'blk.0.ffn_down.weight': row length 48 is not a multiple of the Q8_0 "
                            "block size 32",
    "row-not-whole-q4_k-blocks": "tensor 'blk.0.attn_q.weight': row length 32 is not a multiple of the Q4_K "
                                 "block size 256",
    "alignment-3": "metadata 'general.alignment' is 3, expected a positive power of two",
    "alignment-0": "metadata 'general.alignment' is 0, expected a positive power of two",
    "alignment-string": "metadata 'general.alignment' is '32' (a str), expected an integer power of two",
    "no-architecture": "metadata 'general.architecture' is missing or not a string",
    "architecture-number": "metadata 'general.architecture' is missing or not a string",
    "architecture-gpt2": "architecture 'gpt2' is not supported (supported: llama, qwen2, qwen3)",
    "architecture-phi3": "architecture 'phi3' is not supported (supported: llama, qwen2, qwen3)",
    "no-block-count": "metadata 'llama.block_count' is missing",
    "head-count-zero": "metadata 'llama.attention.head_count' is 0, expected a positive integer",
    "head-count-string": "metadata 'llama.attention.head_count' is '2', expected one int",
    "head-count-array": "metadata 'llama.attention.head_count' is an array of 1, expected one int",
    "head-count-negative": "metadata 'llama.attention.head_count' is -2, expected a positive integer",
    "eps-string": "metadata 'llama.attention.layer_norm_rms_epsilon' is 'x', expected one float",
    "hidden-not-multiple-of-heads": "embedding_length 32 is not a multiple of head_count 3 and no "
                                    "attention.key_length is given",
    "heads-not-multiple-of-pairs": "tensor 'blk.0.attn_k.weight': shape (16, 32) cannot be split into 3 heads "
                                   "of rotary pairs",
    "value-length-differs": "attention.value_length 8 differs from key_length 16; cism needs one head_dim",
    "partial-rotary": "rope.dimension_count 8 rotates only part of the 16-wide heads; partial rotary is not "
                      "supported",
    "rope-scaling-longrope": "uses rope scaling type 'longrope' (factor 4.0); cism implements plain, linear, "
                             "yarn and Llama 3 (rope_freqs) RoPE",
    "rope-scaling-yarn-ext-factor": "uses yarn_ext_factor 0.5 and yarn_log_multiplier 0.0; cism implements YaRN "
                                    "as transformers does (ext_factor 1, no log multiplier)",
    "rope-scaling-yarn-beta-negative": "metadata rope.scaling.yarn_beta_fast is -32.0, expected a positive number",
    "rope-scaling-attn-factor": "metadata rope.scaling.attn_factor is 2.0; cism implements only 1",
    "rope-scaling-linear-negative": "metadata rope.scaling.factor is -2.0, expected a positive number",
    "rope-freqs-negative": "tensor 'rope_freqs.weight': holds factors that are not finite and positive",
    "rope-freqs-wrong-length": "tensor 'rope_freqs.weight': is F32 of shape (6,); expected F32 of (8,)",
    "rope-freqs-f16": "tensor 'rope_freqs.weight': is F16 of shape (8,); expected F32 of (8,)",
    "moe": "is a mixture of 8 experts; not supported",
    "split-file": "is part 0 of a 3-file split GGUF; merge it first (llama-gguf-split --merge)",
    "unknown-tensor-name": "tensor 'blk.0.attn_output.bias': has no Hugging Face equivalent in cism's "
                           "llama/qwen2/qwen3 models",
    "unmappable-layer-name": "tensor 'blk.x.attn_q.weight': has no Hugging Face equivalent",
    # blk.00 would land on blk.0's target: layer numbers are read strictly, so it maps nowhere
    "two-names-one-target": "tensor 'blk.00.attn_norm.weight': has no Hugging Face equivalent",
    "no-vocab-anywhere": "no vocabulary size: no vocab_size, token list or token_embd.weight",
    "zero-dim-past-intp": "tensor 'output_norm.weight': shape [0, 9223372036854775808] is too large to address",
    "zero-dim-too-large": "tensor 'output_norm.weight': shape [0, 1099511627776, 1099511627776] is too large "
                          "to address",
}

_LLAMA2C_HEADER = "dim=8, hidden_dim=12, n_layers=2, n_heads=2, n_kv_heads=1, vocab_size=10, seq_len=6"
_LLAMA2C_RANGES = {"dim": 65536, "hidden_dim": 262144, "n_layers": 256, "n_heads": 512, "n_kv_heads": 512,
                   "vocab_size": 2000000, "seq_len": 1048576}

LLAMA2C_MESSAGES = {
    "one-byte-extra": f"is 4445 bytes but its header ({_LLAMA2C_HEADER}, tied) implies 4444",
    "one-float-extra": f"is 4448 bytes but its header ({_LLAMA2C_HEADER}, tied) implies 4444",
    "tied-flag-flipped": f"is 4444 bytes but its header ({_LLAMA2C_HEADER}, untied) implies 4764",
    "dim=7": "header dim 7 is not a multiple of n_heads 2",
    "n_heads=3": "header dim 8 is not a multiple of n_heads 3",
    "n_kv_heads=3": "header n_heads 2 is not a multiple of n_kv_heads 3",
    "n_kv_heads=4": "header n_heads 2 is not a multiple of n_kv_heads 4",
    "odd-head-size": "head size 3 is odd; rotary needs pairs",
    "v2-int8": "llama2.c version 2 (int8 (Q8_0) weights) is not supported (legacy version 0 and fp32 "
               "version 1 are)",
    "v7": "llama2.c version 7 (an unknown layout) is not supported (legacy version 0 and fp32 version 1 are)",
    "v1-short-header": "108 bytes is too short for the 256-byte version 1 header",
    "v1-bad-flag": "shared-classifier flag is 5, expected 0 or 1",
}
LLAMA2C_MESSAGES.update({
    # a negative vocab_size only marks an untied classifier: its size is the magnitude
    f"{field}={v}": (f"not a llama2.c checkpoint: header {field} = {abs(v) if field == 'vocab_size' else v} "
                     f"is outside [1, {_LLAMA2C_RANGES[field]}]")
    for field, values in [("dim", [0, -8, 1 << 20]), ("hidden_dim", [0, -1, 1 << 30]),
                          ("n_layers", [0, -2, 100000]), ("n_heads", [0, -2, 1 << 20]),
                          ("n_kv_heads", [0, -1]), ("vocab_size", [0, -(1 << 31), 1 << 30]),
                          ("seq_len", [0, -6, 1 << 30])]
    for v in values})

SAFETENSORS_MESSAGES = {   # after "<P>/model.safetensors: "
    "length-huge": "header length 4611686018427387904 exceeds the 104857600-byte limit",
    "length-max": "header length 18446744073709551615 exceeds the 104857600-byte limit",
    "length-past-eof": "header length 270 (after the 8-byte length) runs past the end of the 277-byte file",
    "length-short": "the header is not valid JSON",
    "length-zero": "the header is not valid JSON",
    "not-json": "the header is not valid JSON",
    "not-utf8": "the header is not UTF-8 (invalid start byte at byte 3)",
    "json-list": "header is a JSON list, expected an object",
    "json-string": "header is a JSON str, expected an object",
    "deep-nesting": "the header nests too deeply",
    "huge-int-literal": "the header holds an integer literal of more than 4300 digits",
    "entry-not-object": "tensor 'a': header entry is a JSON list, expected an object",
    "metadata-not-object": "__metadata__ is not a JSON object",
    "missing-dtype": "tensor 'a': header entry has no 'dtype'",
    "missing-shape": "tensor 'a': header entry has no 'shape'",
    "missing-offsets": "tensor 'a': header entry has no 'data_offsets'",
    "dtype-I64": "tensor 'a': dtype I64 is not supported (F32, F16 or BF16)",
    "dtype-F64": "tensor 'a': dtype F64 is not supported (F32, F16 or BF16)",
    "dtype-lowercase": "tensor 'a': dtype f32 is not supported (F32, F16 or BF16)",
    "dtype-number": "tensor 'a': dtype is 32, expected a string",
    "shape-negative": "tensor 'a': shape [-2, -3] is not a list of non-negative integers",
    "shape-float": "tensor 'a': shape [2.0, 3] is not a list of non-negative integers",
    "shape-bool": "tensor 'a': shape [True, 6] is not a list of non-negative integers",
    "shape-string": "tensor 'a': shape '2,3' is not a list of non-negative integers",
    "shape-overflow-64": "tensor 'a': shape [4294967296, 4294967296, 6] in F32 needs 442721857769029238784 bytes "
                         "but data_offsets span 24",
    "shape-overflow-wraps-to-6": "tensor 'a': shape [18446744073709551622] in F32 needs 73786976294838206488 "
                                 "bytes but data_offsets span 24",
    "shape-mismatch": "tensor 'a': shape [2, 4] in F32 needs 32 bytes but data_offsets span 24",
    "offsets-reversed": "tensor 'a': data_offsets [24, 0) lie outside the 40-byte data section",
    "offsets-past-eof": "tensor 'c': data_offsets [32, 48) lie outside the 40-byte data section",
    "offsets-huge": "tensor 'c': data_offsets [4611686018427387904, 4611686018427387912) lie outside the "
                    "40-byte data section",
    "offsets-negative": "tensor 'a': data_offsets [-24, 0] is not two non-negative integers",
    "offsets-three": "tensor 'a': data_offsets [0, 12, 24] is not two non-negative integers",
    "offsets-not-list": "tensor 'a': data_offsets {'0': 24} is not two non-negative integers",
    "overlap": "tensor 'b': data overlaps tensor 'a' ([237, 261) vs [257, 265))",
    "same-range-twice": "tensor 'c': data overlaps tensor 'b' ([257, 265) vs [257, 265))",
    "duplicate-name": "the header has the key 'a' twice",
    "duplicate-field": "the header has the key 'dtype' twice",
    "zero-size-shape-too-large": "tensor 'z': shape [0, 4611686018427387904] is too large to address",
    "zero-size-shape-past-intp": "tensor 'z': shape [1099511627776, 0, 1099511627776] is too large to address",
}

_INDEX = "model.safetensors.index.json"
HF_DIR_MESSAGES = {
    "no-config": "<P>/config.json: file 'config.json' is missing",
    "config-not-json": "<P>/config.json: config.json is not valid JSON",
    "config-list": "<P>/config.json: config.json holds a JSON list, expected an object",
    "config-not-utf8": "<P>/config.json: config.json is not UTF-8 (invalid start byte at byte 16)",
    "config-duplicate-key": "<P>/config.json: config.json has the key 'model_type' twice",
    "config-no-model-type": "<P>/config.json: config has no model_type string",
    "config-model-type-number": "<P>/config.json: config has no model_type string",
    "config-hidden-string": "<P>/config.json: hidden_size is '32' (JSON str), expected an integer",
    "config-hidden-float": "<P>/config.json: hidden_size is 32.0 (JSON float), expected an integer",
    "config-layers-bool": "<P>/config.json: num_hidden_layers is True (JSON bool), expected an integer",
    "config-eps-string": "<P>/config.json: rms_norm_eps is '1e-5' (JSON str), expected a number",
    "config-tie-int": "<P>/config.json: tie_word_embeddings is 1 (JSON int), expected true or false",
    "config-head-dim-list": "<P>/config.json: head_dim is [64] (JSON list), expected an integer",
    "no-weights": "<P>: no model.safetensors, model.safetensors.index.json or other *.safetensors file",
    "index-not-json": f"<P>/{_INDEX}: the index is not valid JSON",
    "index-no-weight-map": f"<P>/{_INDEX}: has no weight_map object",
    "index-weight-map-list": f"<P>/{_INDEX}: has no weight_map object",
    "index-empty": f"<P>/{_INDEX}: weight_map is empty",
    "index-shard-number": f"<P>/{_INDEX}: tensor 'c': weight_map gives 3, expected a file name",
    "index-absolute-path": f"<P>: {_INDEX} shard '/etc/passwd' is not a plain file name inside the directory",
    "index-dotdot": f"<P>: {_INDEX} shard '../outside.safetensors' is not a plain file name inside the directory",
    "index-subdir": f"<P>: {_INDEX} shard 'sub/s2.safetensors' is not a plain file name inside the directory",
    "index-dot": f"<P>: {_INDEX} shard '.' is not a plain file name inside the directory",
    "index-dir-symlink-out": f"<P>/sub: {_INDEX} shard 'sub' resolves to <R>/elsewhere, outside the model "
                             "directory <P>",
    "index-empty-name": f"<P>: {_INDEX} shard '' is not a plain file name inside the directory",
    "index-symlink-escape": f"<P>/link.safetensors: {_INDEX} shard 'link.safetensors' resolves to "
                            "<R>/outside.safetensors, outside the model directory <P>",
    "index-missing-shard": f"<P>/s3.safetensors: {_INDEX} shard 's3.safetensors' is missing",
    "index-tensor-absent": f"<P>/s2.safetensors: tensor 'd': listed for this shard by <P>/{_INDEX} but absent",
    "index-wrong-shard": f"<P>/s1.safetensors: tensor 'b': not assigned to this shard by <P>/{_INDEX}",
    "index-unlisted-tensor": f"<P>/s1.safetensors: tensor 'b': not assigned to this shard by <P>/{_INDEX}",
    "tensor-in-two-shards": "<P>/s2.safetensors: tensor 'a': also present in <P>/s1.safetensors",
    "bad-shard-header": "<P>/s2.safetensors: tensor 'c': dtype I8 is not supported (F32, F16 or BF16)",
    "model-safetensors-symlink-escape": "<P>/model.safetensors: file 'model.safetensors' resolves to "
                                        "<R>/secret.safetensors, outside the model directory <P>",
    "model-safetensors-dangling": "<P>/model.safetensors: file 'model.safetensors' is missing",
    "two-files-no-index": "<P>: 2 safetensors files (a.safetensors, b.safetensors) but no "
                          f"{_INDEX} to say how they fit",
    "pytorch-only": "<P>: no model.safetensors, model.safetensors.index.json or other *.safetensors file "
                    "(only PyTorch .bin weights are present: convert them to safetensors)",
    "not-a-directory-config": "<P>: is part of a Hugging Face model; load its directory instead",
}


def expected_messages():
    """Case id (as test_loaders names it: gguf:..., llama2c:..., hf:...) -> the
    fragments its CheckpointError must contain."""
    out = {}
    for name, data in gguf_cases():
        out[f"gguf:{name}"] = (gguf_truncated_message(len(data)) if name.startswith("truncated-")
                               else (GGUF_MESSAGES[name],))
    for name, data in llama2c_cases():
        out[f"llama2c:{name}"] = (llama2c_truncated_message(len(data)) if name.startswith("truncated-")
                                  else (LLAMA2C_MESSAGES[name],))
    for name, _ in hf_dir_cases():
        if name.startswith("safetensors-truncated-"):
            out[f"hf:{name}"] = safetensors_truncated_message(int(name.rsplit("-", 1)[1]))
        elif name.startswith("safetensors-"):
            out[f"hf:{name}"] = ("<P>/model.safetensors: " + SAFETENSORS_MESSAGES[name[len("safetensors-"):]],)
        else:
            out[f"hf:{name}"] = (HF_DIR_MESSAGES[name],)
    return out
