"""llama2.c checkpoints (Karpathy's export.py): the legacy headerless format
("version 0") and the fp32 "ak42" version 1.

Version 0: 7 int32 (dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size,
seq_len), a negative vocab_size meaning "untied classifier at the end"; then
fp32 token_embedding (vocab, dim), rms_att (L, dim), wq (L, dim, dim),
wk (L, kv_dim, dim), wv (L, kv_dim, dim), wo (L, dim, dim), rms_ffn (L, dim),
w1 (L, hidden, dim), w2 (L, dim, hidden), w3 (L, hidden, dim), rms_final (dim),
freq_cis_real and freq_cis_imag (seq_len, head_size/2), [wcls (vocab, dim)].

Version 1: u32 magic 0x616b3432 ("ak42"), int32 version, the same 7 int32 (vocab
positive), a u8 shared-classifier flag, zero padding to 256 bytes; then fp32
rms_att, rms_ffn, rms_final, token_embedding, wq, wk, wv, wo, w1, w2, w3, [wcls].

w1 is the gate, w3 the up and w2 the down projection. llama2.c rotates
interleaved pairs, so wq and wk are reordered for HF's rotate-half rotary.
The freq_cis tables are ignored, as run.c ignores them: it always uses
rope_theta 10000.
"""
import glob
import math
import os
import struct

from ._common import Checkpoint, CheckpointError, file_size, open_file
from .ggml_types import F32
from .lazy import FileTensor, load_all

MAGIC_V1 = 0x616B3432
HEADER_V1 = 256
_FIELDS = ("dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "seq_len")
# Upper bounds: the dense Config's own limits, so no header can make us size
# arrays the model would refuse anyway.
_BOUNDS = {"dim": 65536, "hidden_dim": 262144, "n_layers": 256, "n_heads": 512,
           "n_kv_heads": 512, "vocab_size": 2000000, "seq_len": 1048576}


def _header(path, size):
    """(version, params dict, tied, data offset), every value checked."""
    with open_file(path) as f:
        try:
            raw = f.read(HEADER_V1)
        except OSError as e:
            raise CheckpointError(path, f"read error: {e.strerror or e}") from None
    if len(raw) >= 8 and struct.unpack_from("<I", raw)[0] == MAGIC_V1:
        version = struct.unpack_from("<i", raw, 4)[0]
        if version != 1:
            what = "int8 (Q8_0) weights" if version == 2 else "an unknown layout"
            raise CheckpointError(path, f"llama2.c version {version} ({what}) is not supported "
                                  "(legacy version 0 and fp32 version 1 are)")
        if len(raw) < HEADER_V1:
            raise CheckpointError(path, f"{size} bytes is too short for the 256-byte version 1 header")
        values = struct.unpack_from("<7i", raw, 8)
        shared = raw[36]
        if shared not in (0, 1):
            raise CheckpointError(path, f"shared-classifier flag is {shared}, expected 0 or 1")
        offset, tied = HEADER_V1, bool(shared)
    else:
        version = 0
        if len(raw) < 28:
            raise CheckpointError(path, f"{size} bytes is too short for a llama2.c header (28 bytes)")
        values = struct.unpack_from("<7i", raw)
        offset, tied = 28, values[5] > 0

    p = dict(zip(_FIELDS, values))
    if version == 0:
        p["vocab_size"] = abs(p["vocab_size"])
    for name, value in p.items():
        if not 1 <= value <= _BOUNDS[name]:
            raise CheckpointError(path, f"not a llama2.c checkpoint: header {name} = {value} "
                                  f"is outside [1, {_BOUNDS[name]}]")
    if p["dim"] % p["n_heads"]:
        raise CheckpointError(path, f"header dim {p['dim']} is not a multiple of n_heads {p['n_heads']}")
    if p["n_heads"] % p["n_kv_heads"]:
        raise CheckpointError(path, f"header n_heads {p['n_heads']} is not a multiple of "
                              f"n_kv_heads {p['n_kv_heads']}")
    if (p["dim"] // p["n_heads"]) % 2:
        raise CheckpointError(path, f"head size {p['dim'] // p['n_heads']} is odd; rotary needs pairs")
    return version, p, tied, offset


def read_header(path):
    """The checked header fields of a llama2.c model (dim ... seq_len; vocab_size
    positive), without reading the weights: the tokenizer uses it to pick the
    tokenizer.bin that matches a model."""
    path = os.fspath(path)
    return _header(path, file_size(path))[1]


def _layout(version, p, tied):
    """[(key, shape)] in file order."""
    dim, hidden, layers = p["dim"], p["hidden_dim"], p["n_layers"]
    kv_dim = dim * p["n_kv_heads"] // p["n_heads"]
    half_head = dim // p["n_heads"] // 2
    embedding = [("embed", (p["vocab_size"], dim))]
    attention = [("wq", (layers, dim, dim)), ("wk", (layers, kv_dim, dim)),
                 ("wv", (layers, kv_dim, dim)), ("wo", (layers, dim, dim))]
    ffn = [("w1", (layers, hidden, dim)), ("w2", (layers, dim, hidden)), ("w3", (layers, hidden, dim))]
    if version == 0:
        order = (embedding + [("rms_att", (layers, dim))] + attention + [("rms_ffn", (layers, dim))]
                 + ffn + [("rms_final", (dim,)), ("freq_cis_real", (p["seq_len"], half_head)),
                          ("freq_cis_imag", (p["seq_len"], half_head))])
    else:
        order = ([("rms_att", (layers, dim)), ("rms_ffn", (layers, dim)), ("rms_final", (dim,))]
                 + embedding + attention + ffn)
    if not tied:
        order.append(("wcls", (p["vocab_size"], dim)))
    return order


def _config(p, tied):
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": p["dim"],
        "intermediate_size": p["hidden_dim"],
        "num_hidden_layers": p["n_layers"],
        "num_attention_heads": p["n_heads"],
        "num_key_value_heads": p["n_kv_heads"],
        "head_dim": p["dim"] // p["n_heads"],
        "vocab_size": p["vocab_size"],
        "max_position_embeddings": p["seq_len"],
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "hidden_act": "silu",
        "tie_word_embeddings": tied,
        # llama2.c's sentencepiece vocabularies: 1 = <s>, 2 = </s>.
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


def _checked(path):
    path = os.fspath(path)
    size = file_size(path)
    version, p, tied, offset = _header(path, size)
    layout = _layout(version, p, tied)
    floats = sum(math.prod(shape) for _, shape in layout)
    expected = offset + 4 * floats
    if size != expected:
        raise CheckpointError(path, f"is {size} bytes but its header ({', '.join(f'{k}={v}' for k, v in p.items())}, "
                              f"{'tied' if tied else 'untied'}) implies {expected}")
    return path, version, p, tied, offset, layout, floats


def read_config(path):
    """The HF-style config of a llama2.c checkpoint, from its header (and size)."""
    path, _, p, tied, *_ = _checked(path)
    return _config(p, tied)


def _find_tokenizer(path, tokenizer_path):
    if tokenizer_path is not None:
        tokenizer_path = os.fspath(tokenizer_path)
        file_size(tokenizer_path)   # exists and is a regular file
        return {"kind": "llama2c", "path": tokenizer_path}
    directory = os.path.dirname(os.path.abspath(path))
    candidate = os.path.join(directory, "tokenizer.bin")
    if os.path.isfile(candidate):
        return {"kind": "llama2c", "path": candidate}
    others = [c for c in sorted(glob.glob(os.path.join(glob.escape(directory), "tok*.bin")))
              if os.path.isfile(c) and not os.path.samefile(c, path)]
    if len(others) == 1:
        return {"kind": "llama2c", "path": others[0]}
    return None


def load_llama2c(path, tokenizer_path=None, lazy=False):
    """A llama2.c .bin checkpoint -> Checkpoint (format "llama2c"): float32
    arrays, or with ``lazy`` lazy.FileTensors read when the model packs them."""
    path, version, p, tied, offset, layout, _ = _checked(path)
    tokenizer = _find_tokenizer(path, tokenizer_path)

    # Every per-layer matrix is one slice of the file (wq and wk reordered
    # for rotate-half rotary as they are read).
    start = {}
    at = offset
    for key, shape in layout:
        start[key] = (at, shape)
        at += 4 * math.prod(shape)

    def tensor(key, i=None, heads=None):
        at, shape = start[key]
        if i is not None:
            shape = shape[1:]
            at += 4 * math.prod(shape) * i
        return FileTensor(path, key if i is None else f"{key}[{i}]", F32, at, shape, heads)

    weights = {"model.embed_tokens.weight": tensor("embed")}
    for i in range(p["n_layers"]):
        pre = f"model.layers.{i}."
        weights[pre + "input_layernorm.weight"] = tensor("rms_att", i)
        weights[pre + "self_attn.q_proj.weight"] = tensor("wq", i, p["n_heads"])
        weights[pre + "self_attn.k_proj.weight"] = tensor("wk", i, p["n_kv_heads"])
        weights[pre + "self_attn.v_proj.weight"] = tensor("wv", i)
        weights[pre + "self_attn.o_proj.weight"] = tensor("wo", i)
        weights[pre + "post_attention_layernorm.weight"] = tensor("rms_ffn", i)
        weights[pre + "mlp.gate_proj.weight"] = tensor("w1", i)
        weights[pre + "mlp.down_proj.weight"] = tensor("w2", i)
        weights[pre + "mlp.up_proj.weight"] = tensor("w3", i)
    weights["model.norm.weight"] = tensor("rms_final")
    if not tied:
        weights["lm_head.weight"] = tensor("wcls")
    if not lazy:
        weights = load_all(weights)
    return Checkpoint(config=_config(p, tied), weights=weights, path=path, format="llama2c",
                      tokenizer=tokenizer)
