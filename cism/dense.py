"""Dense decoder-only transformers: Llama, Mistral (with its sliding
window), Qwen2 (q/k/v biases) and Qwen3, with linear, Llama 3's or YaRN's
rope scaling (``cism.dense``).

    from cism.dense import Model
    model = Model.from_pretrained("path/to/hf-dir-or.gguf", precision="int8")
    session = model.create_session([1, 2, 3], max_new_tokens=16)
    tokens = session.next_tokens(16)
"""
from dataclasses import dataclass, fields

import numpy as np

from cism import _config as C
from cism._batch import BatchSession  # noqa: F401
from cism._dense import DenseModel, Session  # noqa: F401
from cism._paged import PagedSession  # noqa: F401
from cism.generation import GenerationMixin

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class Config:
    """A dense model's shape, validated with the spec's bounds on creation."""
    model_type: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    context: int
    eps: float = 1e-6
    rope_theta: float = 10000.0
    tied: bool = False
    # Beyond plain Llama; each is left out of canonical() at its default, so
    # the compile keys of the models that do not use it are unchanged.
    qkv_bias: bool = False           # Qwen2: biases on the q, k and v projections
    sliding_window: int = 0          # Mistral: a query sees its last `sliding_window` positions (0: all)
    rope_scaling: tuple = ()         # _config.hf_rope's form: (), linear, llama3, yarn or per-frequency factors

    def __post_init__(self):
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"model_type must be one of {', '.join(MODEL_TYPES)} (dense models only), "
                             f"got {self.model_type!r}")
        set_ = object.__setattr__
        set_(self, "hidden", C.bound(self.hidden, 65536, "hidden_size"))
        set_(self, "intermediate", C.bound(self.intermediate, 262144, "intermediate_size"))
        set_(self, "layers", C.bound(self.layers, 256, "num_hidden_layers"))
        set_(self, "heads", C.bound(self.heads, 512, "num_attention_heads"))
        set_(self, "kv_heads", C.bound(self.kv_heads, 512, "num_key_value_heads"))
        set_(self, "head_dim", C.bound(self.head_dim, 1024, "head_dim"))
        set_(self, "vocab", C.bound(self.vocab, 2_000_000, "vocab_size"))
        set_(self, "context", C.bound(self.context, 1_048_576, "max_position_embeddings"))
        if self.heads % self.kv_heads or self.head_dim % 2:
            raise ValueError("attention heads must divide into KV groups and head_dim must be even "
                             f"(heads={self.heads}, kv_heads={self.kv_heads}, head_dim={self.head_dim})")
        C.bound(self.heads * self.head_dim, 65536, "query width")
        set_(self, "eps", C.positive_float(self.eps, "rms_norm_eps"))
        set_(self, "rope_theta", C.positive_float(self.rope_theta, "rope_theta"))
        set_(self, "tied", C.flag(self.tied, "tie_word_embeddings"))
        set_(self, "qkv_bias", C.flag(self.qkv_bias, "qkv_bias"))
        if self.sliding_window:
            set_(self, "sliding_window", C.bound(self.sliding_window, 1 << 30, "sliding_window"))
        set_(self, "rope_scaling", tuple(self.rope_scaling))
        C.rope_divisors(self.rope_scaling, self.rope_theta, self.head_dim)   # checks the factors' count

    @property
    def kv_width(self):
        return self.kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, d):
        """Map an HF ``config.json`` dict (LlamaConfig / Qwen3Config)."""
        if not isinstance(d, dict):
            raise ValueError(f"config must be a dict, got {type(d).__name__}")
        model_type = d.get("model_type")
        if model_type not in MODEL_TYPES:
            raise ValueError(f"model_type must be one of {', '.join(MODEL_TYPES)} (dense models only), "
                             f"got {model_type!r}")
        for key, what in (("attention_bias", "attention biases"), ("mlp_bias", "MLP biases")):
            if d.get(key):
                raise ValueError(f"config.json {key}=true is not supported ({what} are not implemented)")
        window = 0
        if model_type == "mistral" and d.get("sliding_window") is not None:
            window = d["sliding_window"]
        if model_type == "qwen2" and d.get("use_sliding_window"):
            raise ValueError("config.json use_sliding_window=true is not supported (Qwen2's windows "
                             "on some layers only are not implemented)")
        theta, rope = C.hf_rope(d)
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"config.json hidden_act {act!r} is not supported (only silu)")
        heads = C.hf_get(d, "num_attention_heads")
        hidden = C.hf_get(d, "hidden_size")
        head_dim = d.get("head_dim")
        if head_dim is None:
            if not (C.is_int(hidden) and C.is_int(heads) and heads > 0 and hidden % heads == 0):
                raise ValueError("config.json has no head_dim and hidden_size is not a multiple "
                                 "of num_attention_heads")
            head_dim = hidden // heads
        return cls(
            model_type=model_type,
            hidden=hidden,
            intermediate=C.hf_get(d, "intermediate_size"),
            layers=C.hf_get(d, "num_hidden_layers"),
            heads=heads,
            kv_heads=d.get("num_key_value_heads") if d.get("num_key_value_heads") is not None else heads,
            head_dim=head_dim,
            vocab=C.hf_get(d, "vocab_size"),
            context=C.hf_get(d, "max_position_embeddings"),
            eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            tied=d.get("tie_word_embeddings", False),
            qkv_bias=model_type == "qwen2",
            sliding_window=window,
            rope_scaling=rope,
        )

    def to_hf(self):
        return {
            "model_type": self.model_type, "hidden_size": self.hidden,
            "intermediate_size": self.intermediate, "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads, "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim, "vocab_size": self.vocab,
            "max_position_embeddings": self.context, "rms_norm_eps": self.eps,
            "rope_theta": self.rope_theta, "tie_word_embeddings": self.tied,
            "hidden_act": "silu",
            **({"sliding_window": self.sliding_window} if self.sliding_window else {}),
            **C.rope_to_hf(self.rope_scaling),
        }

    def canonical(self):
        """The spec's canonical string of the shape (floats in hex)."""
        return "|".join([self.model_type] + [str(getattr(self, f.name)) for f in fields(self)[1:9]]
                        + [C.hexfloat(np.float32(self.eps)), C.hexfloat(np.float32(self.rope_theta)),
                           str(int(self.tied))]
                        + (["qkv-bias"] if self.qkv_bias else [])
                        + ([f"window={self.sliding_window}"] if self.sliding_window else [])
                        + ([self.rope_scaling[0]] + [C.hexfloat(np.float32(v)) for v in self.rope_scaling[1:]]
                           if self.rope_scaling else []))


def weight_shapes(config, has_head):
    """Every tensor a dense model needs, name -> shape (HF names)."""
    c = config
    shapes = {"model.embed_tokens.weight": (c.vocab, c.hidden), "model.norm.weight": (c.hidden,)}
    if has_head:
        shapes["lm_head.weight"] = (c.vocab, c.hidden)
    elif not c.tied:
        raise ValueError("missing lm_head.weight for untied model")
    q, kv = c.heads * c.head_dim, c.kv_heads * c.head_dim
    for i in range(c.layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (c.hidden,)
        shapes[p + "post_attention_layernorm.weight"] = (c.hidden,)
        shapes[p + "self_attn.q_proj.weight"] = (q, c.hidden)
        shapes[p + "self_attn.k_proj.weight"] = (kv, c.hidden)
        shapes[p + "self_attn.v_proj.weight"] = (kv, c.hidden)
        shapes[p + "self_attn.o_proj.weight"] = (c.hidden, q)
        if c.qkv_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q,)
            shapes[p + "self_attn.k_proj.bias"] = (kv,)
            shapes[p + "self_attn.v_proj.bias"] = (kv,)
        if c.model_type == "qwen3":
            shapes[p + "self_attn.q_norm.weight"] = (c.head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (c.head_dim,)
        shapes[p + "mlp.gate_proj.weight"] = (c.intermediate, c.hidden)
        shapes[p + "mlp.up_proj.weight"] = (c.intermediate, c.hidden)
        shapes[p + "mlp.down_proj.weight"] = (c.hidden, c.intermediate)
    total = sum(C.checked_elements(s) * 4 for s in shapes.values())
    if total > C.MAX_WEIGHT_BYTES:
        raise ValueError("FP32 source weights exceed the 64 GiB safety limit")
    return shapes


class Model(GenerationMixin, DenseModel):
    """A dense Llama/Mistral/Qwen2/Qwen3 model: DenseModel's sessions and evaluation plus
    text generation (generate/stream) with the checkpoint's tokenizer."""

    config_class = Config
    takes_ggml_tensors = True    # precision "auto" picks a storage per GGUF tensor type (q4_k/q6_k kept)

    @classmethod
    def from_pretrained(cls, path, precision="auto", threads=None, act_precision="fp32",
                        prefill_precision="exact", kv_precision="fp32", mmap=True):
        """Load an HF directory (config.json + safetensors), a GGUF file or a
        llama2.c .bin checkpoint. precision "auto" (or "native"): a GGUF
        keeps each tensor in its file encoding where cism has a native
        storage (Q4_K, Q6_K) and otherwise takes the nearest storage that
        keeps its quality (cism.loaders.ggml_types.AUTO); other checkpoints
        load at fp32.

        ``mmap`` (default on): tensors whose storage is the file's own
        encoding (F32 at fp32, F16 at fp16, Q4_K/Q6_K at q4_k/q6_k) are
        mapped from the file, read-only, instead of copied: processes and
        replicas loading the same file share those pages (page cache), and
        the load reads only the bytes it checks. The file must then stay
        unchanged: each forward call checks it first and raises
        CheckpointError when it changed (docs/HARDENING.md). ``mmap=False``
        copies every tensor into private memory."""
        from cism.loaders import build_pretrained
        from cism._dense import check_kv_precision, check_prefill_precision
        check_prefill_precision(prefill_precision)   # before the checkpoint is read
        check_kv_precision(kv_precision)
        model = build_pretrained(cls, path, precision, threads, act_precision, mmap=mmap,
                                 kv_precision=kv_precision)
        model.set_prefill_precision(prefill_precision)
        return model
