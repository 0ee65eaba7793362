"""Checkpoint loaders: Hugging Face directories, GGUF and llama2.c files.

Oracles, none of which calls cism: the safetensors and gguf packages write the
files and gguf-py's own dequantize decodes them; transformers saves tiny
Llama/Qwen3 models and runs stories260K (which must then tell the story the
data README quotes); rotary conventions are checked by applying both RoPE
variants. tests/malformed.py supplies the corpus of broken files.
"""
import json
import math
import os
import pickle
import struct
import tempfile
import time
import tracemalloc

import numpy as np
import pytest

import malformed as M
from cism.loaders import (Checkpoint, CheckpointError, load_checkpoint, load_gguf, load_hf_dir,
                          load_llama2c, read_config, read_gguf_metadata)
from conftest import hypothesis_examples, hypothesis_parts


# gguf-py and hypothesis are imported by the tests that use them, so that
# where one is missing only those tests skip (the malformed corpus needs neither).
def gguf_py():
    """gguf-py: the GGUF writer, reader and dequantize oracle."""
    return pytest.importorskip("gguf")


def assert_float32_c(weights):
    for name, w in weights.items():
        assert w.dtype == np.float32 and w.flags.c_contiguous, name


def same_bits(a, b):
    """Bitwise equality (NaN payloads included) of two float32 arrays."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def write_model_dir(directory, config=None):
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config or {"model_type": "llama"}, f)
    return directory


# --- Hugging Face directories ---------------------------------------------------------

def _bf16(values):
    """values rounded to bf16 by torch (the oracle), and what they widen to."""
    torch = pytest.importorskip("torch")
    t = torch.from_numpy(values).to(torch.bfloat16)
    return t, t.to(torch.float32).numpy()


def test_safetensors_roundtrip_every_dtype(tmp_path):
    torch = pytest.importorskip("torch")
    import safetensors.numpy
    import safetensors.torch
    rng = np.random.default_rng(0)
    f32 = {"a": rng.standard_normal((3, 5)).astype(np.float32),
           "scalar": np.array(2.5, np.float32),
           "empty": np.zeros((0, 4), np.float32),
           "special": np.array([np.inf, -np.inf, np.nan, -0.0, 1e-45], np.float32)}
    f16 = {"h": rng.standard_normal((7,)).astype(np.float16),
           "h_special": np.array([np.inf, 65504, 6e-8, -0.0], np.float16)}
    bf16_source = rng.standard_normal((4, 3)).astype(np.float32) * 1e30
    bf16_tensor, bf16_expected = _bf16(bf16_source)
    d = write_model_dir(tmp_path / "m")
    safetensors.numpy.save_file(dict(f32, **f16), str(tmp_path / "m" / "a.safetensors"))
    # A lone *.safetensors is accepted; here there are two, so use an index.
    safetensors.torch.save_file({"b": bf16_tensor, "b_inf": torch.tensor([float("inf"), -2.0**-133],
                                                                          dtype=torch.bfloat16)},
                                str(tmp_path / "m" / "b.safetensors"))
    weight_map = {k: "a.safetensors" for k in list(f32) + list(f16)}
    weight_map.update(b="b.safetensors", b_inf="b.safetensors")
    (tmp_path / "m" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))

    ck = load_checkpoint(d)
    assert isinstance(ck, Checkpoint) and ck.format == "hf" and ck.path == str(d)
    assert ck.tokenizer is None and ck.config == {"model_type": "llama"}
    assert set(ck.weights) == set(weight_map)
    assert_float32_c(ck.weights)
    for k, v in f32.items():
        assert same_bits(ck.weights[k], v), k
    for k, v in f16.items():
        assert same_bits(ck.weights[k], v.astype(np.float32)), k
    assert same_bits(ck.weights["b"], bf16_expected)
    assert same_bits(ck.weights["b_inf"], np.array([np.inf, -2.0**-133], np.float32))


def test_safetensors_roundtrip_property():
    """Any bit pattern of any shape comes back exactly (bf16 widened by a shift)."""
    given, st, settings = hypothesis_parts(hypothesis_examples(40))

    @settings
    @given(shape=st.lists(st.integers(0, 6), min_size=0, max_size=3),
           dtype=st.sampled_from(["F32", "F16", "BF16"]),
           seed=st.integers(0, 2**32 - 1))
    def check(shape, dtype, seed):
        roundtrip(shape, dtype, seed)
    check()


def roundtrip(shape, dtype, seed):
    import safetensors.numpy
    rng = np.random.default_rng(seed)
    n = math.prod(shape)
    with tempfile.TemporaryDirectory() as d:
        write_model_dir(d)
        if dtype == "BF16":
            bits = rng.integers(0, 1 << 16, n, dtype=np.uint16).reshape(shape)
            header = {"w": {"dtype": "BF16", "shape": shape, "data_offsets": [0, 2 * n]}}
            with open(os.path.join(d, "model.safetensors"), "wb") as f:
                f.write(M.safetensors_bytes(header, bits.astype("<u2").tobytes()))
            expected = (bits.astype(np.uint32) << 16).view(np.float32)
        else:
            np_type = np.float32 if dtype == "F32" else np.float16
            bits = rng.integers(0, 256, n * np.dtype(np_type).itemsize, dtype=np.uint8)
            values = bits.view(np_type).reshape(shape)
            safetensors.numpy.save_file({"w": values}, os.path.join(d, "model.safetensors"))
            expected = values.astype(np.float32)
        got = load_hf_dir(d).weights["w"]
        assert same_bits(got, expected)


def test_lone_safetensors_file_and_preference_order(tmp_path):
    import safetensors.numpy
    d = write_model_dir(tmp_path / "m")
    safetensors.numpy.save_file({"x": np.ones(3, np.float32)}, str(d / "weights.safetensors"))
    assert set(load_hf_dir(d).weights) == {"x"}
    # model.safetensors wins over an index, as in transformers.
    safetensors.numpy.save_file({"y": np.ones(2, np.float32)}, str(d / "model.safetensors"))
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "weights.safetensors"}}))
    assert set(load_hf_dir(d).weights) == {"y"}
    (d / "model.safetensors").unlink()
    assert set(load_hf_dir(d).weights) == {"x"}


def _tiny_llama(tie):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    LlamaConfig, LlamaForCausalLM = transformers.LlamaConfig, transformers.LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=100, max_position_embeddings=64,
                         tie_word_embeddings=tie, rope_theta=50000.0)
    return LlamaForCausalLM(config)


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("shards", [None, "20KB"])
def test_transformers_llama_directory(tmp_path, tie, shards):
    model = _tiny_llama(tie)
    kwargs = {"max_shard_size": shards} if shards else {}
    model.save_pretrained(tmp_path, safe_serialization=True, **kwargs)
    assert os.path.exists(tmp_path / "model.safetensors.index.json") == bool(shards)
    ck = load_checkpoint(tmp_path)
    assert ck.config == json.loads((tmp_path / "config.json").read_text())
    assert ck.config["model_type"] == "llama" and ck.config["tie_word_embeddings"] is tie
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    if tie:
        state.pop("lm_head.weight")   # transformers does not save a tied head
    assert set(ck.weights) == set(state)
    for name, value in state.items():
        assert same_bits(ck.weights[name], value), name
    assert_float32_c(ck.weights)


def test_transformers_qwen3_bf16_directory(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    Qwen3Config, Qwen3ForCausalLM = transformers.Qwen3Config, transformers.Qwen3ForCausalLM
    torch.manual_seed(1)
    config = Qwen3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=100, max_position_embeddings=64,
                         tie_word_embeddings=True)
    model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(tmp_path, safe_serialization=True)
    ck = load_hf_dir(tmp_path)
    assert ck.config["model_type"] == "qwen3" and ck.config["head_dim"] == 16
    state = {k: v.to(torch.float32).numpy() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    assert set(ck.weights) == set(state)
    assert "model.layers.1.self_attn.q_norm.weight" in ck.weights
    for name, value in state.items():
        assert same_bits(ck.weights[name], value), name


def test_fwkv_directory_loads_with_its_own_names(tmp_path):
    """Other families go through the same loader: names and shapes are the file's."""
    import safetensors.numpy
    d = write_model_dir(tmp_path / "m", {"model_type": "fwkv", "d_model": 8, "tie_word_embeddings": True})
    tensors = {"shared.weight": np.ones((10, 4), np.float32), "blocks.0.w": np.arange(8, dtype=np.float32),
               "norm.bias": np.zeros(8, np.float32)}
    safetensors.numpy.save_file(tensors, str(d / "model.safetensors"))
    ck = load_checkpoint(d)
    assert ck.config["model_type"] == "fwkv" and set(ck.weights) == set(tensors)
    assert same_bits(ck.weights["blocks.0.w"], tensors["blocks.0.w"])


def test_hf_tokenizer_is_reported(tmp_path):
    import safetensors.numpy
    d = write_model_dir(tmp_path / "m")
    safetensors.numpy.save_file({"x": np.ones(3, np.float32)}, str(d / "model.safetensors"))
    assert load_hf_dir(d).tokenizer is None
    (d / "tokenizer.json").write_text("{}")
    assert load_hf_dir(d).tokenizer == {"kind": "hf_dir", "path": str(d)}


def _hub_snapshot(root, repo="models--org--tiny", rev="abc123"):
    """The Hugging Face cache layout: snapshot files are relative symlinks to blobs."""
    import safetensors.numpy
    blobs = root / repo / "blobs"
    snap = root / repo / "snapshots" / rev
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    (blobs / "c0nf1g").write_text(json.dumps({"model_type": "llama"}))
    safetensors.numpy.save_file({"x": np.arange(4, dtype=np.float32)}, str(blobs / "w31ght"))
    os.symlink("../../blobs/c0nf1g", snap / "config.json")
    os.symlink("../../blobs/w31ght", snap / "model.safetensors")
    return snap


def test_hf_cache_snapshot_symlinks_are_accepted(tmp_path):
    snap = _hub_snapshot(tmp_path)
    ck = load_checkpoint(snap)
    assert same_bits(ck.weights["x"], np.arange(4, dtype=np.float32))


def test_symlink_into_another_repos_blobs_is_refused(tmp_path):
    _hub_snapshot(tmp_path, repo="models--org--a")
    other = tmp_path / "models--org--b" / "snapshots" / "r"
    other.mkdir(parents=True)
    write_model_dir(other)
    os.symlink(tmp_path / "models--org--a" / "blobs" / "w31ght", other / "model.safetensors")
    with pytest.raises(CheckpointError, match="outside the model directory"):
        load_hf_dir(other)


def test_symlink_within_directory_is_accepted(tmp_path):
    import safetensors.numpy
    d = write_model_dir(tmp_path / "m")
    (d / "store").mkdir()
    safetensors.numpy.save_file({"x": np.ones(2, np.float32)}, str(d / "store" / "real.safetensors"))
    os.symlink("store/real.safetensors", d / "model.safetensors")
    assert set(load_hf_dir(d).weights) == {"x"}


def test_hf_read_config_is_cheap_and_equal(tmp_path):
    _tiny_llama(False).save_pretrained(tmp_path, safe_serialization=True)
    assert read_config(tmp_path) == load_checkpoint(tmp_path).config


# --- GGUF -----------------------------------------------------------------------------

def gguf_meta(arch, hidden=64, ffn=96, layers=1, heads=4, kv_heads=2, context=128, eps=1e-6,
              theta=None, key_length=None, vocab=None, extra=()):
    """Metadata as (key, value, GGUFValueType)."""
    V = gguf_py().GGUFValueType
    meta = [(f"{arch}.block_count", layers, V.UINT32), (f"{arch}.embedding_length", hidden, V.UINT32),
            (f"{arch}.feed_forward_length", ffn, V.UINT32), (f"{arch}.attention.head_count", heads, V.UINT32),
            (f"{arch}.attention.head_count_kv", kv_heads, V.UINT32),
            (f"{arch}.context_length", context, V.UINT32),
            (f"{arch}.attention.layer_norm_rms_epsilon", eps, V.FLOAT32)]
    if theta is not None:
        meta.append((f"{arch}.rope.freq_base", theta, V.FLOAT32))
    if key_length is not None:
        meta.append((f"{arch}.attention.key_length", key_length, V.UINT32))
    if vocab is not None:
        meta.append((f"{arch}.vocab_size", vocab, V.UINT32))
    return meta + list(extra)


def write_gguf(path, arch, meta, tensors):
    """tensors: gguf name -> (float32 array in numpy/HF shape, GGMLQuantizationType)."""
    gguf = gguf_py()
    Q = gguf.GGMLQuantizationType
    w = gguf.GGUFWriter(str(path), arch)
    for key, value, vtype in meta:
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_array(key, value)
        else:
            w.add_key_value(key, value, vtype)
    for name, (values, qtype) in tensors.items():
        values = np.ascontiguousarray(values, np.float32)
        if qtype == Q.F32:
            w.add_tensor(name, values)
        elif qtype == Q.F16:
            w.add_tensor(name, values.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def oracle_tensors(path):
    """gguf-py's reading of every tensor: name -> float32 array in numpy shape."""
    gguf = gguf_py()
    reader = gguf.GGUFReader(str(path))
    out = {}
    for t in reader.tensors:
        shape = tuple(int(x) for x in reversed(t.shape))
        out[t.name] = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape)
    return out


def llama_cpp_permute(w, n_head):
    """convert_hf_to_gguf.py LlamaModel.permute (HF rotate-half -> ggml interleaved)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dense_tensors(rng, hidden, ffn, heads, kv_heads, head_dim, vocab, layers=1, qwen3=False, head=False):
    """Random HF-named weights of a dense model."""
    t = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if head:
        t["lm_head.weight"] = (vocab, hidden)
    for i in range(layers):
        p = f"model.layers.{i}."
        t.update({p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
                  p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
                  p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
                  p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
                  p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
                  p + "mlp.gate_proj.weight": (ffn, hidden), p + "mlp.up_proj.weight": (ffn, hidden),
                  p + "mlp.down_proj.weight": (hidden, ffn)})
        if qwen3:
            t[p + "self_attn.q_norm.weight"] = (head_dim,)
            t[p + "self_attn.k_norm.weight"] = (head_dim,)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in t.items()}


# HF name -> GGUF name, written out independently of the loader's table.
def gguf_name(hf):
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf in fixed:
        return fixed[hf]
    _, _, i, rest = hf.split(".", 3)
    part = {"input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "ffn_norm",
            "self_attn.q_proj.weight": "attn_q", "self_attn.k_proj.weight": "attn_k",
            "self_attn.v_proj.weight": "attn_v", "self_attn.o_proj.weight": "attn_output",
            "self_attn.q_norm.weight": "attn_q_norm", "self_attn.k_norm.weight": "attn_k_norm",
            "mlp.gate_proj.weight": "ffn_gate", "mlp.up_proj.weight": "ffn_up",
            "mlp.down_proj.weight": "ffn_down"}[rest]
    return f"blk.{i}.{part}.weight"


def test_ggml_type_table_matches_gguf_py():
    from cism.loaders import ggml_types
    gguf = gguf_py()
    for type_id, (name, block, size) in ggml_types.GGML_TYPES.items():
        qt = gguf.GGMLQuantizationType(type_id)
        assert qt.name == name and gguf.GGML_QUANT_SIZES[qt] == (block, size), name


def test_dequantize_matches_gguf_py():
    """Bitwise equal to gguf-py's dequantize, for row counts and widths that are
    not multiples of anything convenient."""
    Q = gguf_py().GGMLQuantizationType
    given, st, settings = hypothesis_parts(hypothesis_examples(40))

    @settings
    @given(rows=st.integers(1, 9), blocks=st.integers(1, 5),
           qtype=st.sampled_from([Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1]),
           scale=st.sampled_from([1e-3, 1.0, 1e4]), seed=st.integers(0, 2**32 - 1))
    def check(rows, blocks, qtype, scale, seed):
        dequantize_like_gguf_py(rows, blocks, qtype, scale, seed)
    check()


def dequantize_like_gguf_py(rows, blocks, qtype, scale, seed):
    from cism.loaders import ggml_types
    gguf = gguf_py()
    Q = gguf.GGMLQuantizationType
    gguf_quantize, gguf_dequantize = gguf.quants.quantize, gguf.quants.dequantize
    values = (np.random.default_rng(seed).standard_normal((rows, 32 * blocks)) * scale).astype(np.float32)
    raw = (values.astype(np.float16) if qtype == Q.F16 else
           values if qtype == Q.F32 else gguf_quantize(values, qtype))
    expected = gguf_dequantize(raw, qtype).astype(np.float32)
    out = np.empty(values.shape, np.float32)
    ggml_types.dequantize_into(int(qtype), np.ascontiguousarray(raw).view(np.uint8).reshape(-1), out.reshape(-1))
    assert same_bits(out, expected)


def test_dequantize_arbitrary_bytes_matches_gguf_py():
    """Random bytes (NaN/inf scales, every nibble) decode like gguf-py's, bit for bit, in
    the C decoder the loader uses and in the numpy reference."""
    from cism.loaders import ggml_types
    gguf = gguf_py()
    Q, gguf_dequantize = gguf.GGMLQuantizationType, gguf.quants.dequantize
    rng = np.random.default_rng(5)
    for qtype in (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.F16, Q.BF16):
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, (7, 4 * size), dtype=np.uint8)
        with np.errstate(all="ignore"):
            expected = gguf_dequantize(raw, qtype).astype(np.float32)
        for decode in (ggml_types.dequantize_into, ggml_types.dequantize_into_reference):
            out = np.empty(expected.shape, np.float32)
            decode(int(qtype), raw.reshape(-1), out.reshape(-1))
            assert same_bits(out, expected), (qtype.name, decode.__name__)


def test_gguf_every_type_matches_gguf_py(tmp_path):
    """A qwen3 file (no q/k permutation) with each supported type on some tensor:
    every weight equals gguf-py's own reading of the file."""
    Q = gguf_py().GGMLQuantizationType
    rng = np.random.default_rng(3)
    hf = dense_tensors(rng, hidden=64, ffn=96, heads=4, kv_heads=2, head_dim=32, vocab=40, qwen3=True,
                       head=True)
    types = {"self_attn.q_proj": Q.Q4_0, "self_attn.k_proj": Q.Q4_1, "self_attn.v_proj": Q.Q8_0,
             "self_attn.o_proj": Q.F16, "mlp.gate_proj": Q.BF16, "mlp.up_proj": Q.Q4_1,
             "mlp.down_proj": Q.Q8_0, "embed_tokens": Q.Q8_0, "lm_head": Q.Q4_0}
    tensors = {}
    for name, value in hf.items():
        qtype = next((t for part, t in types.items() if part in name), Q.F32)
        tensors[gguf_name(name)] = (value, qtype)
    path = write_gguf(tmp_path / "m.gguf", "qwen3", gguf_meta("qwen3", key_length=32, theta=1e6), tensors)
    ck = load_gguf(path)
    oracle = oracle_tensors(path)
    assert ck.format == "gguf" and set(ck.weights) == set(hf)
    assert_float32_c(ck.weights)
    for name in hf:
        assert same_bits(ck.weights[name], oracle[gguf_name(name)]), name
    assert ck.config["head_dim"] == 32 and ck.config["rope_theta"] == 1e6
    assert ck.config["tie_word_embeddings"] is False and ck.config["model_type"] == "qwen3"


@pytest.mark.parametrize("qtype", ["F32", "Q8_0", "Q4_1"])
def test_gguf_llama_qk_permutation_round_trips(tmp_path, qtype):
    """Write q/k permuted as convert_hf_to_gguf.py does; loading gives HF order back.
    Quantisation is row-local, so it commutes with the row permutation."""
    gguf = gguf_py()
    Q, gguf_quantize, gguf_dequantize = gguf.GGMLQuantizationType, gguf.quants.quantize, gguf.quants.dequantize
    qtype = Q[qtype]
    rng = np.random.default_rng(4)
    heads, kv_heads, head_dim = 4, 2, 16
    hf = dense_tensors(rng, hidden=64, ffn=96, heads=heads, kv_heads=kv_heads, head_dim=head_dim, vocab=40,
                       layers=2)
    tensors = {}
    for name, value in hf.items():
        if name.endswith("q_proj.weight"):
            value = llama_cpp_permute(value, heads)
        elif name.endswith("k_proj.weight"):
            value = llama_cpp_permute(value, kv_heads)
        tensors[gguf_name(name)] = (value, qtype if value.ndim == 2 else Q.F32)
    path = write_gguf(tmp_path / "m.gguf", "llama", gguf_meta("llama", layers=2), tensors)
    ck = load_gguf(path)
    for name, value in hf.items():
        expected = value if qtype == Q.F32 or value.ndim == 1 else \
            gguf_dequantize(gguf_quantize(value, qtype), qtype).astype(np.float32)
        assert same_bits(ck.weights[name], expected), name


def _rope_interleaved(x, pos, theta=10000.0):
    """llama2.c run.c / ggml mode 0: pairs (2i, 2i+1) rotate by pos * theta^(-2i/d)."""
    d = x.shape[-1]
    freq = theta ** (-np.arange(0, d, 2) / d)
    c, s = np.cos(pos * freq), np.sin(pos * freq)
    out = x.copy()
    out[..., 0::2] = x[..., 0::2] * c - x[..., 1::2] * s
    out[..., 1::2] = x[..., 0::2] * s + x[..., 1::2] * c
    return out


def _rope_half(x, pos, theta=10000.0):
    """HF rotate_half: element i pairs with i + d/2."""
    d = x.shape[-1]
    freq = theta ** (-np.arange(0, d, 2) / d)
    c, s = np.cos(pos * freq), np.sin(pos * freq)
    a, b = x[..., :d // 2], x[..., d // 2:]
    return np.concatenate([a * c - b * s, a * s + b * c], axis=-1)


def test_rotary_conversion_preserves_attention_scores():
    """The reordered weights under HF rotate-half RoPE give the same q.k scores as
    the original weights under interleaved RoPE: the direction of the permutation
    is right, not merely invertible."""
    from cism.loaders._common import rotary_interleaved_to_halves
    rng = np.random.default_rng(6)
    heads, head_dim, dim = 3, 8, 12
    wq = rng.standard_normal((heads * head_dim, dim))
    wk = rng.standard_normal((heads * head_dim, dim))
    x1, x2 = rng.standard_normal(dim), rng.standard_normal(dim)
    hq, hk = rotary_interleaved_to_halves(wq, heads), rotary_interleaved_to_halves(wk, heads)
    for p1, p2 in [(0, 0), (3, 1), (17, 40)]:
        q = _rope_interleaved((wq @ x1).reshape(heads, head_dim), p1)
        k = _rope_interleaved((wk @ x2).reshape(heads, head_dim), p2)
        q2 = _rope_half((hq @ x1).reshape(heads, head_dim), p1)
        k2 = _rope_half((hk @ x2).reshape(heads, head_dim), p2)
        np.testing.assert_allclose((q * k).sum(-1), (q2 * k2).sum(-1), rtol=1e-10, atol=1e-10)
    # ... and llama.cpp's permute is its exact inverse.
    assert np.array_equal(llama_cpp_permute(hq, heads), wq)


def test_gguf_qwen2_biases_rope_freqs_and_linear_scaling(tmp_path):
    """Qwen2 files carry q/k/v biases (blk.N.attn_q.bias ...) and no
    permutation; Llama 3's rope scaling arrives as the rope_freqs tensor, a
    divisor per rotary frequency (config rope_freq_factors); linear scaling
    as metadata. Each loads into the model with the matching Config."""
    from cism.dense import Config, Model
    gguf = gguf_py()
    V, Q = gguf.GGUFValueType, gguf.GGMLQuantizationType
    rng = np.random.default_rng(8)
    hf = dense_tensors(rng, hidden=64, ffn=96, heads=4, kv_heads=2, head_dim=16, vocab=30, head=True)
    for part, width in (("q", 64), ("k", 32), ("v", 32)):
        hf[f"model.layers.0.self_attn.{part}_proj.bias"] = rng.standard_normal(width).astype(np.float32)
    tensors = {(gguf_name(k) if not k.endswith(".bias") else
                f"blk.0.attn_{k.split('.')[-2][0]}.bias"): (v, Q.F32) for k, v in hf.items()}
    path = write_gguf(tmp_path / "q.gguf", "qwen2", gguf_meta("qwen2", theta=1e6), tensors)
    ck = load_gguf(path)
    assert ck.config["model_type"] == "qwen2" and ck.config["architectures"] == ["Qwen2ForCausalLM"]
    assert set(ck.weights) == set(hf) and all(same_bits(ck.weights[k], hf[k]) for k in hf)
    assert Config.from_hf(ck.config).qkv_bias

    hf = {k: v for k, v in hf.items() if not k.endswith(".bias")}
    plain = {gguf_name(k): (v, Q.F32) for k, v in hf.items()}
    factors = np.array([1, 1, 1.5, 2.5, 4, 8, 8, 8], np.float32)
    path = write_gguf(tmp_path / "l3.gguf", "llama", gguf_meta("llama"), {**plain, "rope_freqs.weight": (factors, Q.F32)})
    config = read_config(path)
    assert config["rope_freq_factors"] == factors.tolist() and "rope_freqs.weight" not in load_gguf(path).weights
    assert Config.from_hf(config).rope_scaling == ("factors", *factors.tolist())
    path = write_gguf(tmp_path / "lin.gguf", "llama",
                      gguf_meta("llama", extra=[("llama.rope.scaling.type", "linear", V.STRING),
                                                ("llama.rope.scaling.factor", 4.0, V.FLOAT32)]), plain)
    assert Config.from_hf(read_config(path)).rope_scaling == ("linear", 4.0)
    # linear by 4 is the factors (4, 4, ...): the same rotary tables, the same logits
    lin = Model.from_pretrained(path)
    same = Config.from_hf({**read_config(path), "rope_scaling": None, "rope_freq_factors": [4.0] * 8})
    weights = load_gguf(path).weights
    assert np.array_equal(lin.logits([1, 2, 3, 4, 5]), Model(same, weights).logits([1, 2, 3, 4, 5]))

    # YaRN as convert_hf_to_gguf.py writes it: the keys config.json had, with
    # transformers' meaning; the original context defaults to context_length
    yarn = [("llama.rope.scaling.type", "yarn", V.STRING), ("llama.rope.scaling.factor", 4.0, V.FLOAT32)]
    path = write_gguf(tmp_path / "yarn.gguf", "llama", gguf_meta("llama", extra=yarn), plain)
    assert read_config(path)["rope_scaling"] == {"rope_type": "yarn", "factor": 4.0,
                                                 "original_max_position_embeddings": 128}
    assert Config.from_hf(read_config(path)).rope_scaling == ("yarn", 4.0, 128, 32.0, 1.0,
                                                              np.float32(0.1 * np.log(4) + 1), True)
    full = yarn + [("llama.rope.scaling.original_context_length", 32, V.UINT32),
                   ("llama.rope.scaling.yarn_beta_fast", 16.0, V.FLOAT32),
                   ("llama.rope.scaling.yarn_beta_slow", 2.0, V.FLOAT32),
                   ("llama.rope.scaling.yarn_attn_factor", 1.5, V.FLOAT32),
                   ("llama.rope.scaling.yarn_ext_factor", 1.0, V.FLOAT32)]
    path = write_gguf(tmp_path / "yarn2.gguf", "llama", gguf_meta("llama", extra=full), plain)
    assert Config.from_hf(read_config(path)).rope_scaling == ("yarn", 4.0, 32, 16.0, 2.0, 1.5, True)
    # yarn by 1 (or 0: unset) is plain RoPE, as in llama.cpp
    path = write_gguf(tmp_path / "yarn1.gguf", "llama",
                      gguf_meta("llama", extra=[yarn[0], ("llama.rope.scaling.factor", 0.0, V.FLOAT32)]), plain)
    assert read_config(path)["rope_scaling"] is None


def test_gguf_config_mapping_and_defaults(tmp_path):
    gguf = gguf_py()
    V, Q = gguf.GGUFValueType, gguf.GGMLQuantizationType
    rng = np.random.default_rng(7)
    hf = dense_tensors(rng, hidden=64, ffn=96, heads=4, kv_heads=4, head_dim=16, vocab=30, head=True)
    tensors = {gguf_name(k): (v, Q.F32) for k, v in hf.items()}
    # No head_count_kv (-> heads), no freq_base (-> 10000), no vocab_size but a token list.
    meta = [m for m in gguf_meta("llama") if not m[0].endswith("head_count_kv")]
    meta += [("tokenizer.ggml.model", "llama", V.STRING),
             ("tokenizer.ggml.tokens", [f"t{i}" for i in range(30)], V.ARRAY),
             ("tokenizer.ggml.bos_token_id", 1, V.UINT32), ("tokenizer.ggml.eos_token_id", 2, V.UINT32),
             ("llama.rope.scaling.type", "linear", V.STRING), ("llama.rope.scaling.factor", 1.0, V.FLOAT32)]
    path = write_gguf(tmp_path / "m.gguf", "llama", meta, tensors)
    expected = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
                "intermediate_size": 96, "num_hidden_layers": 1, "num_attention_heads": 4,
                "num_key_value_heads": 4, "head_dim": 16, "vocab_size": 30, "max_position_embeddings": 128,
                "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "rope_scaling": None, "hidden_act": "silu",
                "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}
    assert read_config(path) == expected
    ck = load_checkpoint(path)
    assert ck.config == expected and ck.tokenizer == {"kind": "gguf", "path": str(path)}

    # vocab from the embedding when there is neither vocab_size nor a token list;
    # tied when output.weight is absent; no tokenizer without tokenizer.ggml.model.
    del tensors["output.weight"]
    path = write_gguf(tmp_path / "n.gguf", "llama", gguf_meta("llama", kv_heads=4), tensors)
    ck = load_gguf(path)
    assert ck.config["vocab_size"] == 30 and ck.config["tie_word_embeddings"] is True
    assert "lm_head.weight" not in ck.weights and ck.tokenizer is None
    # explicit vocab_size wins
    path = write_gguf(tmp_path / "o.gguf", "llama", gguf_meta("llama", kv_heads=4, vocab=32), tensors)
    assert read_config(path)["vocab_size"] == 32


def test_gguf_threads_do_not_change_results(tmp_path):
    """An embedding large enough to be decoded in chunks by several threads."""
    Q = gguf_py().GGMLQuantizationType
    rng = np.random.default_rng(8)
    embd = rng.standard_normal((40000, 64)).astype(np.float32)   # > one 2M-element job
    path = write_gguf(tmp_path / "m.gguf", "qwen3", gguf_meta("qwen3", heads=4, kv_heads=2),
                      {"token_embd.weight": (embd, Q.Q4_1), "output_norm.weight": (embd[0], Q.F32)})
    one = load_gguf(path, threads=1).weights["model.embed_tokens.weight"]
    two = load_gguf(path, threads=2).weights["model.embed_tokens.weight"]
    assert same_bits(one, two)
    assert same_bits(one, oracle_tensors(path)["token_embd.weight"])


@pytest.mark.parametrize("qtype", ["F32", "F16", "Q8_0", "Q4_1"])
def test_ggml_decode_parts_and_threads(qtype):
    """ggml_decode splits the blocks into parts over OpenMP threads: every
    part boundary (a part of 65536 elements, a last part of a few blocks)
    gives the one-thread bits, which are gguf-py's."""
    from cism.loaders._ggml_decode import ggml_decode
    gguf = gguf_py()
    Q, gguf_quantize, gguf_dequantize = gguf.GGMLQuantizationType, gguf.quants.quantize, gguf.quants.dequantize
    qtype = Q[qtype]
    rng = np.random.default_rng(9)
    for n in (32, 65536, 65536 + 32, 3 * 65536 - 96):
        values = rng.standard_normal((1, n)).astype(np.float32)
        src = (values.astype(np.float16) if qtype == Q.F16 else
               values if qtype == Q.F32 else gguf_quantize(values, qtype))
        want = gguf_dequantize(src, qtype).astype(np.float32)
        raw = np.ascontiguousarray(src).view(np.uint8).reshape(-1)
        for threads in (1, 2, 3):
            out = np.full(n, np.nan, np.float32)
            ggml_decode(int(qtype), raw, out, threads)
            assert same_bits(out, want.reshape(-1)), (n, threads)
    for bad in (0, 65):
        with pytest.raises(ValueError, match=r"threads must be in \[1, 64\], got " + str(bad)):
            ggml_decode(int(qtype), raw, out, bad)


def test_gguf_loader_starts_no_python_thread(tmp_path, monkeypatch):
    """The GGUF loader decodes with OpenMP inside the calling thread: a
    Python worker thread that fails on its own under an exhausted address
    space (outside any job) ends the whole process in CPython's thread
    excepthook, which tests/test_memory.py's capped loads hit about once in
    50 runs while the loader used a thread pool."""
    import threading
    started = []
    real_start = threading.Thread.start
    monkeypatch.setattr(threading.Thread, "start", lambda self: (started.append(self.name), real_start(self)))
    Q = gguf_py().GGMLQuantizationType
    rng = np.random.default_rng(10)
    embd = rng.standard_normal((40000, 64)).astype(np.float32)
    path = write_gguf(tmp_path / "m.gguf", "qwen3", gguf_meta("qwen3", heads=4, kv_heads=2),
                      {"token_embd.weight": (embd, Q.Q4_1), "output_norm.weight": (embd[0], Q.F32)})
    load_gguf(path, threads=2)
    assert started == []


def _metadata_equal(mine, reader):
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        value = field.contents()
        got = mine[key]
        if isinstance(got, np.ndarray):
            assert np.array_equal(got, np.asarray(value, dtype=got.dtype)), key
        elif isinstance(got, float):
            assert np.float32(got) == np.float32(value), key
        else:
            assert got == value, key
    assert set(mine) == {k for k in reader.fields if not k.startswith("GGUF.")}


def test_gguf_metadata_matches_gguf_reader(data_dir):
    path = data_dir / "tokenizers" / "gguf-vocab" / "ggml-vocab-llama-spm.gguf"
    mine = read_gguf_metadata(path)
    _metadata_equal(mine, gguf_py().GGUFReader(str(path)))
    assert len(mine["tokenizer.ggml.tokens"]) == 32000 and mine["tokenizer.ggml.scores"].dtype == np.float32
    lazy = read_gguf_metadata(path, arrays=False)
    assert len(lazy["tokenizer.ggml.tokens"]) == 32000
    assert read_config(path)["vocab_size"] == 32000
    with pytest.raises(CheckpointError, match="holds no tensors"):
        load_checkpoint(path)


# --- SmolLM2 (a real trained GGUF) ----------------------------------------------------

@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    t0 = time.perf_counter()
    ck = load_gguf(smollm2_gguf)
    seconds = time.perf_counter() - t0
    print(f"\nSmolLM2-135M Q4_1 GGUF -> float32 in {seconds:.3f} s")
    return ck, seconds


def test_smollm2_config_and_tensors(smollm2, smollm2_gguf):
    ck, _ = smollm2
    c = ck.config
    assert (c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"], c["num_key_value_heads"],
            c["vocab_size"], c["intermediate_size"], c["head_dim"]) == (576, 30, 9, 3, 49152, 1536, 64)
    assert c["tie_word_embeddings"] is True and c["rope_theta"] == 100000.0 and c["rms_norm_eps"] == 1e-5
    assert c["model_type"] == "llama" and c["max_position_embeddings"] == 8192
    assert len(ck.weights) == 272
    expected = {"model.embed_tokens.weight": (49152, 576), "model.norm.weight": (576,)}
    for i in range(30):
        p = f"model.layers.{i}."
        expected.update({p + "input_layernorm.weight": (576,), p + "post_attention_layernorm.weight": (576,),
                         p + "self_attn.q_proj.weight": (576, 576), p + "self_attn.k_proj.weight": (192, 576),
                         p + "self_attn.v_proj.weight": (192, 576), p + "self_attn.o_proj.weight": (576, 576),
                         p + "mlp.gate_proj.weight": (1536, 576), p + "mlp.up_proj.weight": (1536, 576),
                         p + "mlp.down_proj.weight": (576, 1536)})
    assert {k: v.shape for k, v in ck.weights.items()} == expected
    assert_float32_c(ck.weights)
    assert ck.tokenizer == {"kind": "gguf", "path": str(smollm2_gguf)}
    assert read_config(smollm2_gguf) == c
    # (load time is measured by bench/load.py, not asserted: a loaded host made a 5 s bound flaky)


def test_smollm2_matches_gguf_py(smollm2, smollm2_gguf):
    ck, _ = smollm2
    gguf = gguf_py()
    reader = gguf.GGUFReader(str(smollm2_gguf))
    _metadata_equal(read_gguf_metadata(smollm2_gguf), reader)
    checked = 0
    for t in reader.tensors:
        if not (t.name.startswith(("blk.0.", "blk.29.")) or "blk" not in t.name):
            continue
        shape = tuple(int(x) for x in reversed(t.shape))
        expected = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape)
        name = gguf_name_to_hf(t.name)
        got = ck.weights[name]
        if t.name.endswith("attn_q.weight"):
            got = llama_cpp_permute(got, 9)
        elif t.name.endswith("attn_k.weight"):
            got = llama_cpp_permute(got, 3)
        assert same_bits(got, expected), t.name
        checked += 1
    assert checked == 2 * 9 + 2


def gguf_name_to_hf(name):
    """The inverse of gguf_name, by search."""
    candidates = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    if name.startswith("blk."):
        i = name.split(".")[1]
        candidates = [f"model.layers.{i}.{part}.weight" for part in (
            "input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
            "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
    return next(hf for hf in candidates if gguf_name(hf) == name)


# --- llama2.c -------------------------------------------------------------------------

def test_stories260k_config_and_tokenizer(data_dir):
    path = data_dir / "models" / "stories260K" / "stories260K.bin"
    ck = load_checkpoint(path)
    assert ck.format == "llama2c" and ck.path == str(path)
    c = ck.config
    assert (c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["num_attention_heads"],
            c["num_key_value_heads"], c["vocab_size"], c["max_position_embeddings"]) == (64, 172, 5, 8, 4, 512, 512)
    assert c["tie_word_embeddings"] is True and c["rope_theta"] == 10000.0 and c["rms_norm_eps"] == 1e-5
    assert c["model_type"] == "llama" and c["head_dim"] == 8
    assert ck.tokenizer == {"kind": "llama2c", "path": str(data_dir / "models" / "stories260K" / "tok512.bin")}
    assert len(ck.weights) == 2 + 9 * 5 and "lm_head.weight" not in ck.weights
    assert ck.weights["model.layers.4.self_attn.k_proj.weight"].shape == (32, 64)
    assert ck.weights["model.layers.0.mlp.down_proj.weight"].shape == (64, 172)
    assert_float32_c(ck.weights)
    assert read_config(path) == c


def _llama2c_vocab(path):
    with open(path, "rb") as f:
        data = f.read()
    pos, pieces = 4, []
    while pos < len(data):
        _, n = struct.unpack_from("<fi", data, pos)
        pieces.append(data[pos + 8:pos + 8 + n])
        pos += 8 + n
    return pieces


def test_stories260k_tells_its_story_in_transformers(data_dir):
    """Loaded into transformers' Llama (rotate-half RoPE), greedy decoding from BOS
    gives the text the data README quotes: the rotary reordering is right."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    LlamaConfig, LlamaForCausalLM = transformers.LlamaConfig, transformers.LlamaForCausalLM
    ck = load_checkpoint(data_dir / "models" / "stories260K" / "stories260K.bin")
    c = ck.config
    config = LlamaConfig(hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
                         num_hidden_layers=c["num_hidden_layers"], num_attention_heads=c["num_attention_heads"],
                         num_key_value_heads=c["num_key_value_heads"], vocab_size=c["vocab_size"],
                         max_position_embeddings=c["max_position_embeddings"], rms_norm_eps=c["rms_norm_eps"],
                         rope_theta=c["rope_theta"], tie_word_embeddings=True)
    model = LlamaForCausalLM(config).eval()
    missing, unexpected = model.load_state_dict({k: torch.from_numpy(v) for k, v in ck.weights.items()},
                                                strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    model.tie_weights()
    tokens = [1]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # 40x faster for a model this small on a busy machine
    try:
        with torch.no_grad():
            for _ in range(40):
                logits = model(torch.tensor([tokens])).logits[0, -1]
                tokens.append(int(logits.argmax()))
    finally:
        torch.set_num_threads(threads)
    pieces = _llama2c_vocab(ck.tokenizer["path"])
    text = b"".join(pieces[t] for t in tokens[1:]).decode()
    assert text.strip().startswith("Once upon a time, there was a little girl named Lily. She loved to play")


def _llama2c_parts(p, floats, tied):
    """Split llama2.c legacy floats in file order, independently of the loader."""
    dim, hidden, layers, vocab = p["dim"], p["hidden_dim"], p["n_layers"], p["vocab_size"]
    kv_dim = dim * p["n_kv_heads"] // p["n_heads"]
    order = [("embed", (vocab, dim)), ("rms_att", (layers, dim)), ("wq", (layers, dim, dim)),
             ("wk", (layers, kv_dim, dim)), ("wv", (layers, kv_dim, dim)), ("wo", (layers, dim, dim)),
             ("rms_ffn", (layers, dim)), ("w1", (layers, hidden, dim)), ("w2", (layers, dim, hidden)),
             ("w3", (layers, hidden, dim)), ("rms_final", (dim,)),
             ("freq_real", (p["seq_len"], dim // p["n_heads"] // 2)),
             ("freq_imag", (p["seq_len"], dim // p["n_heads"] // 2))]
    if not tied:
        order.append(("wcls", (vocab, dim)))
    parts, at = {}, 0
    for key, shape in order:
        n = math.prod(shape)
        parts[key] = floats[at:at + n].reshape(shape)
        at += n
    assert at == len(floats)
    return parts


@pytest.mark.parametrize("tied", [True, False])
def test_llama2c_synthetic_mapping(tmp_path, tied):
    p = M.LLAMA2C_PARAMS
    floats = np.arange(M.llama2c_float_count(p, tied), dtype=np.float32)  # every value tells its origin
    path = tmp_path / "model.bin"
    path.write_bytes(M.llama2c_bytes(p, tied=tied, floats=floats))
    ck = load_llama2c(path)
    parts = _llama2c_parts(p, floats, tied)
    w = ck.weights
    assert ck.config["tie_word_embeddings"] is tied and ck.tokenizer is None
    assert same_bits(w["model.embed_tokens.weight"], parts["embed"])
    assert same_bits(w["model.norm.weight"], parts["rms_final"])
    assert ("lm_head.weight" in w) is not tied
    if not tied:
        assert same_bits(w["lm_head.weight"], parts["wcls"])
    head_dim = p["dim"] // p["n_heads"]
    for i in range(p["n_layers"]):
        pre = f"model.layers.{i}."
        assert same_bits(w[pre + "input_layernorm.weight"], parts["rms_att"][i])
        assert same_bits(w[pre + "post_attention_layernorm.weight"], parts["rms_ffn"][i])
        assert same_bits(w[pre + "self_attn.v_proj.weight"], parts["wv"][i])
        assert same_bits(w[pre + "self_attn.o_proj.weight"], parts["wo"][i])
        assert same_bits(w[pre + "mlp.gate_proj.weight"], parts["w1"][i])
        assert same_bits(w[pre + "mlp.down_proj.weight"], parts["w2"][i])
        assert same_bits(w[pre + "mlp.up_proj.weight"], parts["w3"][i])
        # Rotate-half order: within each head, row r < d/2 is interleaved row 2r,
        # row d/2 + r is interleaved row 2r + 1.
        for key, src, n_heads in (("q_proj", parts["wq"][i], p["n_heads"]),
                                  ("k_proj", parts["wk"][i], p["n_kv_heads"])):
            got = w[f"{pre}self_attn.{key}.weight"]
            for h in range(n_heads):
                for r in range(head_dim // 2):
                    assert same_bits(got[h * head_dim + r], src[h * head_dim + 2 * r])
                    assert same_bits(got[h * head_dim + head_dim // 2 + r], src[h * head_dim + 2 * r + 1])
    assert_float32_c(w)


def test_llama2c_version1_equals_legacy(tmp_path):
    p = M.LLAMA2C_PARAMS
    floats = np.random.default_rng(9).standard_normal(M.llama2c_float_count(p, False)).astype(np.float32)
    legacy = tmp_path / "legacy.bin"
    legacy.write_bytes(M.llama2c_bytes(p, tied=False, floats=floats))
    parts = _llama2c_parts(p, floats, tied=False)
    layers = p["n_layers"]
    order = [parts["rms_att"], parts["rms_ffn"], parts["rms_final"], parts["embed"], parts["wq"], parts["wk"],
             parts["wv"], parts["wo"], parts["w1"], parts["w2"], parts["w3"], parts["wcls"]]
    header = struct.pack("<Ii7iB", 0x616B3432, 1, *p.values(), 0)
    v1 = tmp_path / "v1.bin"
    v1.write_bytes(header + b"\0" * (256 - len(header))
                   + b"".join(np.ascontiguousarray(a, "<f4").tobytes() for a in order))
    a, b = load_checkpoint(legacy), load_checkpoint(v1)
    assert a.config == b.config and a.config["num_hidden_layers"] == layers
    assert set(a.weights) == set(b.weights)
    for k in a.weights:
        assert same_bits(a.weights[k], b.weights[k]), k


def test_llama2c_tokenizer_lookup(tmp_path):
    (tmp_path / "m.bin").write_bytes(M.llama2c_bytes())
    assert load_llama2c(tmp_path / "m.bin").tokenizer is None
    (tmp_path / "tok100.bin").write_bytes(b"\0" * 4)
    assert load_llama2c(tmp_path / "m.bin").tokenizer["path"] == str(tmp_path / "tok100.bin")
    (tmp_path / "tok200.bin").write_bytes(b"\0" * 4)
    assert load_llama2c(tmp_path / "m.bin").tokenizer is None         # ambiguous
    (tmp_path / "tokenizer.bin").write_bytes(b"\0" * 4)
    assert load_llama2c(tmp_path / "m.bin").tokenizer["path"] == str(tmp_path / "tokenizer.bin")
    explicit = load_llama2c(tmp_path / "m.bin", tokenizer_path=tmp_path / "tok200.bin").tokenizer
    assert explicit == {"kind": "llama2c", "path": str(tmp_path / "tok200.bin")}
    with pytest.raises(CheckpointError, match="nope.bin"):
        load_llama2c(tmp_path / "m.bin", tokenizer_path=tmp_path / "nope.bin")


# --- dispatch and the error type ------------------------------------------------------

def test_dispatch_and_missing_paths(tmp_path):
    with pytest.raises(CheckpointError, match="no such file or directory"):
        load_checkpoint(tmp_path / "absent")
    with pytest.raises(CheckpointError, match="no such file or directory"):
        read_config(tmp_path / "absent")
    with pytest.raises(CheckpointError, match="no such directory"):
        load_hf_dir(tmp_path / "absent")
    with pytest.raises(CheckpointError, match="not a GGUF file"):
        (tmp_path / "x.gguf").write_bytes(M.llama2c_bytes())
        load_checkpoint(tmp_path / "x.gguf")
    # A GGUF without the extension is still recognised by its magic.
    (tmp_path / "renamed.bin").write_bytes(M.valid_gguf())
    assert load_checkpoint(tmp_path / "renamed.bin").format == "gguf"
    with pytest.raises(CheckpointError, match="load its directory"):
        (tmp_path / "model.safetensors").write_bytes(b"")
        load_checkpoint(tmp_path / "model.safetensors")


def test_checkpoint_error_is_a_value_error_that_pickles():
    e = CheckpointError("/x/model.bin", "is broken", "w")
    assert isinstance(e, ValueError) and str(e) == "/x/model.bin: tensor 'w': is broken"
    e2 = pickle.loads(pickle.dumps(e))
    assert str(e2) == str(e) and e2.tensor == "w" and e2.path == "/x/model.bin"


# --- the malformed corpus -------------------------------------------------------------

def _corpus():
    for name, data in M.gguf_cases():
        yield f"gguf:{name}", lambda root, data=data: _file(root, "model.gguf", data)
    for name, data in M.llama2c_cases():
        yield f"llama2c:{name}", lambda root, data=data: _file(root, "model.bin", data)
    for name, build in M.hf_dir_cases():
        yield f"hf:{name}", build


def _file(root, name, data):
    path = os.path.join(root, name)
    with open(path, "wb") as f:
        f.write(data)
    return path


CORPUS = list(_corpus())
MESSAGES = M.expected_messages()


def test_corpus_is_large():
    assert len(CORPUS) > 600


def test_every_case_has_its_message():
    assert set(MESSAGES) == {name for name, _ in CORPUS}

    def cases(prefix):
        return {name[len(prefix):] for name in MESSAGES if name.startswith(prefix)}
    # and no table entry outlives its case
    assert set(M.GGUF_MESSAGES) <= cases("gguf:") and set(M.LLAMA2C_MESSAGES) <= cases("llama2c:")
    assert set(M.HF_DIR_MESSAGES) <= cases("hf:") and set(M.SAFETENSORS_MESSAGES) <= cases("hf:safetensors-")


@pytest.mark.parametrize("name,build", CORPUS, ids=[n for n, _ in CORPUS])
def test_malformed_checkpoint_is_rejected(tmp_path, name, build):
    path = build(str(tmp_path))
    size = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(tmp_path) for f in fs
               if os.path.isfile(os.path.join(dp, f)))
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointError) as info:
            load_checkpoint(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    message = str(info.value)
    assert message.startswith(str(path)), message
    shown = message.replace(str(path), "<P>").replace(str(tmp_path), "<R>")
    for fragment in MESSAGES[name]:
        assert fragment in shown, (fragment, shown)
    # Nothing sized from a lying header: at most a few MB beyond what the files hold.
    assert peak < 4 * 1024 * 1024 + 16 * size, peak
    # read_config looks at headers only, so it may accept what loading refuses,
    # but it fails the same way when it fails.
    try:
        assert isinstance(read_config(path), dict)
    except CheckpointError as e:
        assert str(e).startswith(str(path)), str(e)


def _valid_files():
    header, data = M.valid_safetensors_parts()
    return {"safetensors": M.safetensors_bytes(header, data), "gguf": M.valid_gguf(),
            "llama2c": M.llama2c_bytes()}


VALID = _valid_files()


def test_valid_corpus_bases_load(tmp_path):
    """The bases the corpus breaks are themselves fine."""
    d = write_model_dir(tmp_path / "m")
    (d / "model.safetensors").write_bytes(VALID["safetensors"])
    assert set(load_checkpoint(d).weights) == {"a", "b", "c"}
    (tmp_path / "m.gguf").write_bytes(VALID["gguf"])
    assert len(load_checkpoint(tmp_path / "m.gguf").weights) == len(M.GGUF_TENSORS)
    (tmp_path / "m.bin").write_bytes(VALID["llama2c"])
    assert load_checkpoint(tmp_path / "m.bin").config["hidden_size"] == 8


def test_mutated_files_load_or_raise_checkpoint_error():
    """Random byte edits and truncations: a Checkpoint or a CheckpointError,
    never any other exception."""
    given, st, settings = hypothesis_parts(hypothesis_examples(300))

    @settings
    @given(kind=st.sampled_from(sorted(VALID)), data=st.data())
    def check(kind, data):
        load_mutated(kind, data, st)
    check()


def load_mutated(kind, data, st):
    blob = bytearray(VALID[kind])
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["set", "truncate", "insert", "delete"]))
        at = data.draw(st.integers(0, max(len(blob) - 1, 0)))
        if op == "set" and blob:
            blob[at] = data.draw(st.integers(0, 255))
        elif op == "truncate":
            del blob[at:]
        elif op == "insert":
            blob[at:at] = data.draw(st.binary(min_size=1, max_size=8))
        elif blob:
            del blob[at:at + data.draw(st.integers(1, 8))]
    with tempfile.TemporaryDirectory() as root:
        if kind == "safetensors":
            path = write_model_dir(os.path.join(root, "m"))
            _file(path, "model.safetensors", bytes(blob))
        else:
            path = _file(root, "model.gguf" if kind == "gguf" else "model.bin", bytes(blob))
        try:
            ck = load_checkpoint(path)
        except CheckpointError as e:
            assert str(e).startswith(path)
        else:
            assert_float32_c(ck.weights)
