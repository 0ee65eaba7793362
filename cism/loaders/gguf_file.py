"""GGUF files (llama.cpp): header parsed here, tensors dequantised to float32 in C.

The header is read by our own bounds-checked parser instead of gguf-py's
GGUFReader: GGUFReader builds numpy views for every element of the token and
merge arrays, which takes 3.2 s on the 98 MB SmolLM2 file before a single weight
is read; this parser walks the same header in about 0.05 s, checks every count
and length against the bytes left before using it, and needs no gguf package.
gguf-py stays the independent oracle in the tests.

Layout (GGUF v2/v3, little-endian): magic "GGUF", u32 version, u64 tensor_count,
u64 kv_count; kv_count (key string, u32 type, value); tensor_count (name, u32
n_dims, u64 ne[n_dims], u32 type, u64 offset); padding to general.alignment;
tensor data, each offset relative to that data start. Strings are a u64 length
and UTF-8 bytes; arrays a u32 element type, u64 count and the elements.
ne[0] is the fastest-varying dimension, so the numpy shape is ne reversed.
"""
import math
import os
import re
import struct
from dataclasses import dataclass

import numpy as np

from . import ggml_types
from ._common import Checkpoint, CheckpointError, check_addressable, file_size, open_file, read_into
from .lazy import FileTensor

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4            # GGML_MAX_DIMS
MAX_ARRAY_DEPTH = 4     # nested arrays deeper than this appear in no real file
SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3")

# value type -> (struct format, size) for the fixed-size scalars
_SCALARS = {0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4),
            5: ("<i", 4), 6: ("<f", 4), 7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8),
            12: ("<d", 8)}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1",
          10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY, _FLOAT32 = 8, 9, 6
_U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class ArrayInfo:
    """An array value left undecoded (read_config needs only its length)."""
    element_type: int
    count: int

    def __len__(self):
        return self.count


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple        # numpy order (ne reversed)
    type_id: int
    offset: int         # absolute byte offset of the data in the file
    nbytes: int


class _Header:
    """Sequential little-endian reads from the start of the file, each checked
    against the file size before it happens. The file is read in growing
    chunks as the header turns out to be longer."""

    def __init__(self, f, path, size):
        self.f, self.path, self.size = f, path, size
        self.buf = bytearray()
        self.pos = 0

    def fail(self, problem):
        raise CheckpointError(self.path, problem)

    def need(self, n, what):
        end = self.pos + n
        if end > self.size:
            self.fail(f"truncated: {what} at byte {self.pos} needs {n} bytes, the file has {self.size}")
        if end > len(self.buf):
            want = min(self.size, max(end, 2 * len(self.buf), 1 << 20))
            try:
                self.f.seek(len(self.buf))
                self.buf += self.f.read(want - len(self.buf))
            except OSError as e:
                self.fail(f"read error: {e.strerror or e}")
            if end > len(self.buf):
                self.fail(f"file ended inside {what} at byte {self.pos}")

    def scalar(self, fmt, size, what):
        self.need(size, what)
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += size
        return value

    def u32(self, what):
        return self.scalar("<I", 4, what)

    def u64(self, what):
        return self.scalar("<Q", 8, what)

    def string(self, what):
        n = self.u64(what)
        self.need(n, what)
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            self.fail(f"{what} is not valid UTF-8")

    def strings(self, count, what, decode):
        """``count`` strings: a list, or just skipped (the 150k-entry vocabularies
        of real files make this loop the hot spot of header parsing)."""
        out = [] if decode else None
        buf, pos, unpack = self.buf, self.pos, _U64.unpack_from
        for _ in range(count):
            if pos + 8 > len(buf):
                self.pos = pos
                self.need(8, what)
                buf = self.buf
            n = unpack(buf, pos)[0]
            pos += 8
            if pos + n > len(buf):
                self.pos = pos
                self.need(n, what)
                buf = self.buf
            if decode:
                # Vocabulary entries can be arbitrary bytes; surrogateescape keeps
                # them recoverable with .encode("utf-8", "surrogateescape").
                out.append(bytes(buf[pos:pos + n]).decode("utf-8", "surrogateescape"))
            pos += n
        self.pos = pos
        return out

    def value(self, vtype, what, decode, depth=0):
        if vtype in _SCALARS:
            fmt, size = _SCALARS[vtype]
            value = self.scalar(fmt, size, what)
            if vtype == _FLOAT32:
                # The shortest decimal that is the same float32: 1e-05, not
                # 9.999999747378752e-06, as the HF config.json would say.
                value = float(str(np.float32(value)))
            return value
        if vtype == _STRING:
            return self.string(what)
        if vtype != _ARRAY:
            self.fail(f"{what} has unknown value type {vtype}")
        if depth >= MAX_ARRAY_DEPTH:
            self.fail(f"{what} nests arrays more than {MAX_ARRAY_DEPTH} deep")
        etype = self.u32(what)
        count = self.u64(what)
        # Every element takes at least one byte (8 for a string's length, 12 for
        # an array's header): a count the rest of the file cannot hold is a lie,
        # caught before any list or array of that length exists.
        least = _SCALARS[etype][1] if etype in _SCALARS else {_STRING: 8, _ARRAY: 12}.get(etype)
        if least is None:
            self.fail(f"{what} is an array of unknown type {etype}")
        if count * least > self.size - self.pos:
            self.fail(f"truncated or corrupt: {what} claims {count} elements, more than the rest "
                      "of the file can hold")
        if etype in _SCALARS:
            nbytes = count * least
            self.need(nbytes, what)
            if decode:
                values = np.frombuffer(self.buf, _NUMPY[etype], count, self.pos).copy()
                if etype == 7:
                    values = values != 0
            self.pos += nbytes
            return values if decode else ArrayInfo(etype, count)
        if etype == _STRING:
            values = self.strings(count, what, decode)
            return values if decode else ArrayInfo(etype, count)
        values = [self.value(_ARRAY, what, decode, depth + 1) for _ in range(count)]
        return values if decode else ArrayInfo(etype, count)


def _parse(path, decode_arrays=False, tensors=True):
    """(metadata dict, [TensorInfo], file size) of a GGUF file, all checked.
    With ``tensors=False`` the tensor list is neither read nor checked (the
    tokenizer needs only the metadata) and comes back empty."""
    size = file_size(path)
    with open_file(path) as f:
        h = _Header(f, path, size)
        h.need(4, "the magic")
        magic = bytes(h.buf[:4])
        if magic != GGUF_MAGIC:
            h.fail(f"not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r})")
        h.pos = 4
        version = h.u32("the version")
        if version & 0xFFFF == 0 and version:
            h.fail("big-endian GGUF files are not supported")
        if version not in (2, 3):
            h.fail(f"GGUF version {version} is not supported (2 or 3)")
        n_tensors = h.u64("the tensor count")
        n_kv = h.u64("the metadata count")
        # Smallest possible metadata entry: 8 (key length) + 4 (type) + 1 byte;
        # smallest tensor entry: 8 + 4 + 8 + 4 + 8.
        if n_kv * 13 + n_tensors * 32 > size - h.pos:
            h.fail(f"truncated or corrupt: header claims {n_kv} metadata entries and {n_tensors} tensors, "
                   f"more than the {size}-byte file can hold")

        meta = {}
        for i in range(n_kv):
            key = h.string(f"metadata key {i}")
            vtype = h.u32(f"the type of {key!r}")
            value = h.value(vtype, f"metadata {key!r}", decode_arrays)
            if key in meta:
                h.fail(f"metadata key {key!r} appears twice")
            meta[key] = value
        if not tensors:
            return meta, [], size

        raw_infos = []
        seen = set()
        for i in range(n_tensors):
            name = h.string(f"tensor name {i}")
            if name in seen:
                raise CheckpointError(path, "appears twice in the tensor list", name)
            seen.add(name)
            n_dims = h.u32(f"tensor {name!r}")
            if not 1 <= n_dims <= MAX_DIMS:
                raise CheckpointError(path, f"has {n_dims} dimensions (1 to {MAX_DIMS} allowed)", name)
            dims = [h.u64(f"tensor {name!r}") for _ in range(n_dims)]
            type_id = h.u32(f"tensor {name!r}")
            offset = h.u64(f"tensor {name!r}")
            raw_infos.append((name, dims, type_id, offset))
        header_end = h.pos

    alignment = meta.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or isinstance(alignment, bool):
        raise CheckpointError(path, f"metadata 'general.alignment' is {alignment!r} (a {type(alignment).__name__}), "
                                    "expected an integer power of two")
    if alignment <= 0 or alignment & (alignment - 1):
        raise CheckpointError(path, f"metadata 'general.alignment' is {alignment}, expected a positive power of two")
    data_start = -(-header_end // alignment) * alignment

    infos = [_tensor_info(path, size, data_start, alignment, *raw) for raw in raw_infos]
    by_offset = sorted(infos, key=lambda t: t.offset)
    for a, b in zip(by_offset, by_offset[1:]):
        if b.offset < a.offset + a.nbytes:
            raise CheckpointError(path, f"data overlaps tensor {a.name!r}", b.name)
    return meta, infos, size


def _tensor_info(path, size, data_start, alignment, name, dims, type_id, offset):
    if type_id not in ggml_types.GGML_TYPES:
        raise CheckpointError(path, f"has unknown ggml type {type_id}", name)
    type_name, block, block_bytes = ggml_types.GGML_TYPES[type_id]
    if dims[0] % block:
        raise CheckpointError(path, f"row length {dims[0]} is not a multiple of the "
                              f"{type_name} block size {block}", name)
    # Python integers: dimensions crafted to overflow 64 bits still compare honestly.
    nbytes = math.prod(dims) // block * block_bytes
    if offset % alignment:
        raise CheckpointError(path, f"data offset {offset} is not a multiple of the alignment {alignment}", name)
    start = data_start + offset
    if start + nbytes > size:
        raise CheckpointError(path, f"data [{start}, {start + nbytes}) runs past the end of "
                              f"the {size}-byte file", name)
    check_addressable(path, dims, 4, name)    # only a zero-element shape can still fail
    return TensorInfo(name, tuple(reversed(dims)), type_id, start, nbytes)


def read_gguf_metadata(path, arrays=True):
    """All metadata of a GGUF file as a dict (for the tokenizer and tools).

    Numeric arrays become numpy arrays, string arrays lists of str (bytes that
    are not UTF-8 decoded with surrogateescape). With ``arrays=False`` arrays are
    left as ArrayInfo (type and length only), which is much faster. The
    tensor list after the metadata is not read.
    """
    return _parse(os.fspath(path), decode_arrays=arrays, tensors=False)[0]


# --- metadata -> HF config -------------------------------------------------------

class _Meta:
    def __init__(self, path, meta, arch):
        self.path, self.meta, self.arch = path, meta, arch

    def get(self, key, kind, default=None, required=False):
        full = f"{self.arch}.{key}" if not key.startswith(("general.", "tokenizer.")) else key
        if full not in self.meta:
            if required:
                raise CheckpointError(self.path, f"metadata {full!r} is missing")
            return default
        value = self.meta[full]
        ok = {"int": isinstance(value, int) and not isinstance(value, bool),
              "float": isinstance(value, (int, float)) and not isinstance(value, bool),
              "str": isinstance(value, str)}[kind]
        if not ok:
            shown = f"an array of {len(value)}" if isinstance(value, (ArrayInfo, list, np.ndarray)) else repr(value)
            raise CheckpointError(self.path, f"metadata {full!r} is {shown}, expected one {kind}")
        if kind == "int" and value <= 0:
            raise CheckpointError(self.path, f"metadata {full!r} is {value}, expected a positive integer")
        return float(value) if kind == "float" else value


def _config(path, meta, infos):
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise CheckpointError(path, "metadata 'general.architecture' is missing or not a string")
    if arch not in SUPPORTED_ARCHS:
        raise CheckpointError(path, f"architecture {arch!r} is not supported "
                              f"(supported: {', '.join(SUPPORTED_ARCHS)})")
    m = _Meta(path, meta, arch)
    split_count = meta.get("split.count", 1)
    if split_count != 1:
        raise CheckpointError(path, f"is part {meta.get('split.no', 0)} of a {split_count}-file split "
                              "GGUF; merge it first (llama-gguf-split --merge)")
    hidden = m.get("embedding_length", "int", required=True)
    heads = m.get("attention.head_count", "int", required=True)
    kv_heads = m.get("attention.head_count_kv", "int", default=heads)
    head_dim = m.get("attention.key_length", "int")
    if head_dim is None:
        if hidden % heads:
            raise CheckpointError(path, f"embedding_length {hidden} is not a multiple of "
                                  f"head_count {heads} and no attention.key_length is given")
        head_dim = hidden // heads
    value_dim = m.get("attention.value_length", "int", default=head_dim)
    if value_dim != head_dim:
        raise CheckpointError(path, f"attention.value_length {value_dim} differs from key_length "
                              f"{head_dim}; cism needs one head_dim")
    rope_dims = m.get("rope.dimension_count", "int", default=head_dim)
    if rope_dims != head_dim:
        raise CheckpointError(path, f"rope.dimension_count {rope_dims} rotates only part of the "
                              f"{head_dim}-wide heads; partial rotary is not supported")
    experts = meta.get(f"{arch}.expert_count", 0)
    if experts:
        raise CheckpointError(path, f"is a mixture of {experts} experts; not supported")

    # Linear or YaRN scaling by 1 is plain RoPE; a factor of 0 is how
    # llama.cpp writes "unset". Llama 3's scaling comes as the rope_freqs
    # tensor: one divisor per rotary frequency (convert_hf_to_gguf.py
    # computes them).
    scaling = m.get("rope.scaling.type", "str", default="none")
    factor = m.get("rope.scaling.factor", "float", default=0.0)
    if scaling not in ("none", "linear", "yarn"):
        raise CheckpointError(path, f"uses rope scaling type {scaling!r} (factor {factor}); cism implements "
                              "plain, linear, yarn and Llama 3 (rope_freqs) RoPE")
    attn = m.get("rope.scaling.attn_factor", "float", default=1.0)
    if attn != 1.0:
        raise CheckpointError(path, f"metadata rope.scaling.attn_factor is {attn}; cism implements only 1")
    rope_scaling = None
    if scaling in ("linear", "yarn") and factor not in (0.0, 1.0):
        if not (math.isfinite(factor) and factor > 0):
            raise CheckpointError(path, f"metadata rope.scaling.factor is {factor}, expected a positive number")
        rope_scaling = {"rope_type": "linear", "factor": factor} if scaling == "linear" else \
            _yarn_scaling(path, m, factor)
    names = {t.name for t in infos}
    freqs = next((t for t in infos if t.name == "rope_freqs.weight"), None)
    factors = None
    if freqs is not None:
        if rope_scaling:
            raise CheckpointError(path, "has both rope_freqs.weight and linear rope scaling")
        factors = _rope_factors(path, freqs, head_dim)

    vocab = m.get("vocab_size", "int")
    if vocab is None:
        tokens = meta.get("tokenizer.ggml.tokens")
        embd = next((t for t in infos if t.name == "token_embd.weight"), None)
        if isinstance(tokens, (ArrayInfo, list)) and len(tokens):
            vocab = len(tokens)
        elif embd is not None and len(embd.shape) == 2:
            vocab = embd.shape[0]
        else:
            raise CheckpointError(path, "no vocabulary size: no vocab_size, token list or token_embd.weight")

    config = {
        "model_type": arch,
        "architectures": [{"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}.get(arch, "LlamaForCausalLM")],
        "hidden_size": hidden,
        "intermediate_size": m.get("feed_forward_length", "int", required=True),
        "num_hidden_layers": m.get("block_count", "int", required=True),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": vocab,
        "max_position_embeddings": m.get("context_length", "int", required=True),
        "rms_norm_eps": m.get("attention.layer_norm_rms_epsilon", "float", required=True),
        "rope_theta": m.get("rope.freq_base", "float", default=10000.0),
        "rope_scaling": rope_scaling,
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in names,
    }
    if factors is not None:
        config["rope_freq_factors"] = factors
    for key in ("bos_token_id", "eos_token_id"):
        value = meta.get(f"tokenizer.ggml.{key}")
        if isinstance(value, int) and not isinstance(value, bool):
            config[key] = value
    return config


def _yarn_scaling(path, m, factor):
    """YaRN as transformers' rope_scaling. convert_hf_to_gguf.py writes
    factor, original_context_length and, when config.json has them,
    yarn_beta_fast, yarn_beta_slow and yarn_attn_factor (transformers'
    attention_factor, copied as is); cism reads them with transformers'
    meaning. It cannot write mscale/mscale_all_dim or truncate=false, so a
    file stands for the default attention factor 0.1 ln(factor) + 1 and a
    truncated ramp (as llama.cpp runs every yarn file). yarn_ext_factor
    (llama.cpp's mix of the ramp, 1 for YaRN) and yarn_log_multiplier
    (DeepSeek's mscale_all_dim) have no transformers meaning here: refused
    unless at their neutral values."""
    ext = m.get("rope.scaling.yarn_ext_factor", "float", default=1.0)
    log_mul = m.get("rope.scaling.yarn_log_multiplier", "float", default=0.0)
    if ext != 1.0 or log_mul != 0.0:
        raise CheckpointError(path, f"uses yarn_ext_factor {ext} and yarn_log_multiplier {log_mul}; cism "
                              "implements YaRN as transformers does (ext_factor 1, no log multiplier)")
    scaling = {"rope_type": "yarn", "factor": factor,
               "original_max_position_embeddings": m.get("rope.scaling.original_context_length", "int",
                                                         default=m.get("context_length", "int", required=True))}
    for key, name in (("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow"),
                      ("attention_factor", "yarn_attn_factor")):
        value = m.get(f"rope.scaling.{name}", "float")
        if value is not None:
            if not (math.isfinite(value) and value > 0):
                raise CheckpointError(path, f"metadata rope.scaling.{name} is {value}, expected a positive number")
            scaling[key] = value
    return scaling


def _rope_factors(path, info, head_dim):
    """The rope_freqs tensor's values (F32: head_dim / 2 of them), read
    with the header's bounds: they belong to the config, not the weights."""
    if info.type_id != ggml_types.F32 or info.shape != (head_dim // 2,):
        raise CheckpointError(path, f"is {ggml_types.type_name(info.type_id)} of shape {info.shape}; "
                              f"expected F32 of ({head_dim // 2},)", info.name)
    raw = np.empty(info.nbytes, np.uint8)
    with open_file(path) as f:
        read_into(f, info.offset, raw, path, f"tensor {info.name!r}")
    values = raw.view("<f4").astype(np.float64)
    if not (np.isfinite(values).all() and (values > 0).all()):
        raise CheckpointError(path, "holds factors that are not finite and positive", info.name)
    return values.tolist()


# --- tensors ------------------------------------------------------------------------

_FLOAT_TYPES = (ggml_types.F32, ggml_types.F16, ggml_types.BF16)

_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                 "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_LAYER_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
                "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
                "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
_LAYER_RE = re.compile(r"blk\.(0|[1-9][0-9]{0,5})\.([a-z_]+)\.(weight|bias)")
_BIASES = ("attn_q", "attn_k", "attn_v")      # Qwen2's


def hf_name(path, name):
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    match = _LAYER_RE.fullmatch(name)
    if match and match.group(2) in _LAYER_NAMES and (match.group(3) == "weight" or match.group(2) in _BIASES):
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}.{match.group(3)}"
    raise CheckpointError(path, "has no Hugging Face equivalent in cism's llama/qwen2/qwen3 models", name)


def load_gguf(path, threads=None, keep_quantized=False, lazy=False, mmap=False):
    """A GGUF file -> Checkpoint (format "gguf"), weights dequantised to float32.

    ``lazy`` (or its older name ``keep_quantized``): every tensor is a
    lazy.FileTensor instead, read and decoded only when the model packs it
    (a quantised matrix can also be packed in its own encoding, Q4_K and
    Q6_K); llama's q/k rows are reordered all the same (ggml blocks never
    cross rows). ``mmap`` (with ``lazy``): the tensors share one
    mapping.FileMap of the file, so the model may multiply a tensor whose
    storage is the file's encoding where the file lies (mapping.py says
    when; the header's size and byte-order checks above have run).

    ``threads`` (None = the process default) only changes the speed: every
    element is decoded by the same block-local C expression (csrc/ggml.h).
    """
    from .._threads import resolve_threads
    path = os.fspath(path)
    threads = resolve_threads(threads)
    meta, infos, _ = _parse(path)
    config = _config(path, meta, infos)
    if not infos:
        raise CheckpointError(path, "holds no tensors (a vocabulary-only GGUF?)")

    plan = []
    targets = set()
    for info in infos:
        if info.name == "rope_freqs.weight":    # read into the config by _config
            continue
        target = hf_name(path, info.name)
        if target in targets:
            raise CheckpointError(path, f"maps to {target!r} like another tensor", info.name)
        targets.add(target)
        if info.type_id not in ggml_types.DECODED:
            supported = ", ".join(ggml_types.type_name(t) for t in ggml_types.DECODED)
            raise CheckpointError(path, f"type {ggml_types.type_name(info.type_id)} is not supported "
                                  f"({supported})", info.name)
        plan.append((info, target))

    # llama.cpp stores llama's q and k rows in the interleaved-pair rotary order
    # (convert_hf_to_gguf.py LlamaModel.permute); HF rotate-half wants them back.
    # qwen2/qwen3 are converted without that permutation (NEOX rope in ggml).
    heads_of = {}
    if config["model_type"] == "llama":
        for info, target in plan:
            if target.endswith("self_attn.q_proj.weight"):
                heads_of[target] = config["num_attention_heads"]
            elif target.endswith("self_attn.k_proj.weight"):
                heads_of[target] = config["num_key_value_heads"]
            else:
                continue
            n = heads_of[target]
            if len(info.shape) != 2 or info.shape[0] % (2 * n):
                raise CheckpointError(path, f"shape {info.shape} cannot be split into {n} heads "
                                      "of rotary pairs", info.name)

    from .mapping import FileMap
    mapping = FileMap(path) if mmap and (lazy or keep_quantized) else None
    weights = {target: FileTensor(path, info.name, info.type_id, info.offset, info.shape,
                                  heads_of.get(target), mapping)
               for info, target in plan}
    if not (lazy or keep_quantized):
        # One tensor at a time in file order (sequential reads): its bytes,
        # then its floats decoded by the OpenMP threads inside ggml_decode.
        # No Python thread runs here: under an exhausted address space a
        # worker thread's own failure (outside any job) ended the process in
        # CPython's thread excepthook; every allocation and every error stays
        # in the calling thread, named by memory_for.
        loaded = {target: weights[target].load(threads)
                  for _, target in sorted(plan, key=lambda p: p[0].offset)}
        weights = {target: loaded.pop(target) for _, target in plan}   # the file's order
    return Checkpoint(config=config, weights=weights, path=path, format="gguf",
                      tokenizer=_tokenizer(path, meta),
                      types={target: ggml_types.type_name(info.type_id) for info, target in plan})


def _tokenizer(path, meta):
    return {"kind": "gguf", "path": path} if "tokenizer.ggml.model" in meta else None


def read_config(path):
    """The HF-style config of a GGUF file, from its header alone."""
    path = os.fspath(path)
    meta, infos, _ = _parse(path)
    return _config(path, meta, infos)
