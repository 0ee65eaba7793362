"""Surjo: the hybrid of XSA attention and Gated DeltaNet layers (``cism.surjo``).

    from cism.surjo import Model
    model = Model.from_pretrained("path/to/surjo-dir", precision="hybrid-int4")
    session = model.create_session([1, 2, 3], max_new_tokens=16)
    tokens = session.next_tokens(16, spec_k=8)

Layer layout: a prelude of XSA layers, ``groups`` groups of ``per_xsa`` GDN layers
followed by one XSA layer, then a coda of XSA layers. The group section runs
``passes`` times (recurrent depth), so the execution plan is the prelude, the groups
pass after pass, then the coda; every XSA execution has its own KV slot and every
GDN (layer, pass) its own recurrent state and conv FIFOs. ``Model.plan`` lists it.

config.json keys (``Config.from_hf``); the spec's error messages use these names:

    model_type                 "surjo"
    hidden_size, intermediate_size, num_attention_heads, vocab_size,
    max_position_embeddings    as for Llama
    num_key_value_heads        default num_attention_heads
    head_dim                   default hidden_size / num_attention_heads
    num_hidden_layers          optional; when given it must equal the layout's total
    num_prelude_layers         XSA layers before the groups (default 0)      -> prelude
    num_groups                 groups in the recurrent section               -> groups
    gdn_layers_per_group       GDN layers before each group's XSA layer      -> per_xsa
    num_coda_layers            XSA layers after the groups (default 0)       -> coda
    recurrent_passes           times the group section runs                  -> passes
    recurrent_layers           optional; must equal num_groups*(gdn_layers_per_group+1)
    gdn_num_v_heads            GDN value heads (a multiple of num_attention_heads)
    gdn_key_dim, gdn_value_dim GDN key / value width per head
    gdn_conv_kernel_size       depthwise causal conv width (default 4)
    gdn_allow_neg_eigval       must be false (not implemented, as in the spec)
    xsa_projection             remove each head's component along its value (default true)
    rms_norm_eps (1e-5), rope_theta (10000), tie_word_embeddings (false), hidden_act (silu)

The prelude/coda/per-group key names are cism's choice (the spec names only the
fields); the GDN key heads are ``num_attention_heads``, as in the spec.
"""
from dataclasses import dataclass, fields

import numpy as np

from cism import _config as C
from cism._surjo import SurjoModel  # noqa: F401
from cism._surjo_session import Session  # noqa: F401
from cism.matrix import MAX_COLS, MAX_ROWS
from cism.generation import GenerationMixin

# Bound on recurrent_passes: the spec has none, but the plan (and every state)
# grows with it; 1024 passes is far past any trained model.
MAX_PASSES = 1024


@dataclass(frozen=True)
class Config:
    """A Surjo model's shape, validated with the spec's bounds and messages on creation.
    ``layers`` and ``recurrent`` are derived when left None."""
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    context: int
    prelude: int
    groups: int
    per_xsa: int
    coda: int
    passes: int
    gdn_v_heads: int
    gdn_k_dim: int
    gdn_v_dim: int
    conv_kernel: int = 4
    xsa_projection: bool = True
    tied: bool = False
    eps: float = 1e-5
    rope_theta: float = 10000.0
    allow_neg: bool = False
    layers: int | None = None
    recurrent: int | None = None
    model_type: str = "surjo"

    def __post_init__(self):
        set_ = object.__setattr__
        if self.model_type != "surjo":
            raise ValueError(f"model_type must be surjo for Surjo models, got {self.model_type!r}")
        for name in ("prelude", "groups", "per_xsa", "coda", "passes"):
            value = getattr(self, name)
            if not C.is_int(value) or value < 0:
                raise ValueError(f"{_HF_NAME[name]} must be a nonnegative integer, got {value!r}")
            set_(self, name, int(value))
        body = self.groups * (self.per_xsa + 1)
        if self.recurrent is None:
            set_(self, "recurrent", body)
        if self.layers is None:
            set_(self, "layers", self.prelude + body + self.coda)
        set_(self, "hidden", C.bound(self.hidden, 65536, "hidden_size"))
        set_(self, "intermediate", C.bound(self.intermediate, 262144, "intermediate_size"))
        set_(self, "layers", C.bound(self.layers, 256, "num_hidden_layers"))
        set_(self, "heads", C.bound(self.heads, 512, "num_attention_heads"))
        set_(self, "kv_heads", C.bound(self.kv_heads, 512, "num_key_value_heads"))
        set_(self, "head_dim", C.bound(self.head_dim, 1024, "head_dim"))
        set_(self, "vocab", C.bound(self.vocab, 2_000_000, "vocab_size"))
        set_(self, "context", C.bound(self.context, 1_048_576, "max_position_embeddings"))
        set_(self, "gdn_v_heads", C.bound(self.gdn_v_heads, 4096, "gdn_num_v_heads"))
        set_(self, "gdn_k_dim", C.bound(self.gdn_k_dim, 4096, "gdn_key_dim"))
        set_(self, "gdn_v_dim", C.bound(self.gdn_v_dim, 4096, "gdn_value_dim"))
        if not C.is_int(self.conv_kernel) or not 1 <= self.conv_kernel <= 64:
            raise ValueError(f"gdn_conv_kernel_size is outside [1, 64]: got {self.conv_kernel!r}")
        set_(self, "conv_kernel", int(self.conv_kernel))
        if self.groups == 0 or self.passes == 0:
            raise ValueError("num_groups and recurrent_passes must be positive "
                             f"(num_groups={self.groups}, recurrent_passes={self.passes})")
        if self.passes > MAX_PASSES:
            raise ValueError(f"recurrent_passes is outside supported bounds [1, {MAX_PASSES}]: "
                             f"got {self.passes}")
        if self.prelude + body + self.coda != self.layers:
            raise ValueError("prelude + groups*(per_xsa+1) + coda must equal layers "
                             f"({self.prelude} + {self.groups}*({self.per_xsa}+1) + {self.coda} "
                             f"!= {self.layers})")
        if not C.is_int(self.recurrent) or self.recurrent != body:
            raise ValueError("recurrent_layers must equal groups*(per_xsa+1) "
                             f"(got {self.recurrent!r}, expected {body})")
        set_(self, "recurrent", int(self.recurrent))
        if self.heads % self.kv_heads or self.head_dim % 2:
            raise ValueError("attention heads must divide into KV groups and head_dim must be even "
                             f"(heads={self.heads}, kv_heads={self.kv_heads}, head_dim={self.head_dim})")
        if self.gdn_v_heads < self.heads or self.gdn_v_heads % self.heads:
            raise ValueError("gdn_num_v_heads must be >= heads and divisible by it "
                             f"(gdn_num_v_heads={self.gdn_v_heads}, heads={self.heads})")
        set_(self, "allow_neg", C.flag(self.allow_neg, "gdn_allow_neg_eigval"))
        if self.allow_neg:
            raise ValueError("gdn_allow_neg_eigval=true is not implemented")
        C.bound(self.heads * self.head_dim, 65536, "query width")
        set_(self, "eps", C.positive_float(self.eps, "rms_norm_eps"))
        set_(self, "rope_theta", C.positive_float(self.rope_theta, "rope_theta"))
        set_(self, "tied", C.flag(self.tied, "tie_word_embeddings"))
        set_(self, "xsa_projection", C.flag(self.xsa_projection, "xsa_projection"))

    # ---- derived sizes ----

    @property
    def kv_width(self):
        return self.kv_heads * self.head_dim

    @property
    def key_total(self):
        """GDN key channels: heads * gdn_k_dim."""
        return self.heads * self.gdn_k_dim

    @property
    def value_total(self):
        """GDN value channels: gdn_v_heads * gdn_v_dim."""
        return self.gdn_v_heads * self.gdn_v_dim

    def is_xsa_layer(self, i):
        """True for prelude and coda layers and the last layer of each group."""
        if i < self.prelude or i >= self.prelude + self.recurrent:
            return True
        return (i - self.prelude) % (self.per_xsa + 1) == self.per_xsa

    def plan(self):
        """The execution plan: a list of (layer, pass, kind) with kind "xsa" or "gdn"."""
        steps = [(i, 0, "xsa") for i in range(self.prelude)]
        for r in range(self.passes):
            for i in range(self.prelude, self.prelude + self.recurrent):
                steps.append((i, r, "xsa" if self.is_xsa_layer(i) else "gdn"))
        steps += [(i, 0, "xsa") for i in range(self.prelude + self.recurrent, self.layers)]
        return steps

    @property
    def xsa_slots(self):
        return self.prelude + self.groups * self.passes + self.coda

    @property
    def gdn_states(self):
        return self.groups * self.per_xsa * self.passes

    # ---- HF config.json ----

    @classmethod
    def from_hf(cls, d):
        """Map a Surjo ``config.json`` dict (key names in the module docstring)."""
        if not isinstance(d, dict):
            raise ValueError(f"config must be a dict, got {type(d).__name__}")
        model_type = d.get("model_type")
        if model_type != "surjo":
            raise ValueError(f"model_type must be surjo for Surjo models, got {model_type!r}")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"config.json hidden_act {act!r} is not supported (only silu)")
        C.hf_rope_theta(d)  # refuses rope scaling
        heads = C.hf_get(d, "num_attention_heads")
        hidden = C.hf_get(d, "hidden_size")
        head_dim = d.get("head_dim")
        if head_dim is None:
            if not (C.is_int(hidden) and C.is_int(heads) and heads > 0 and hidden % heads == 0):
                raise ValueError("config.json has no head_dim and hidden_size is not a multiple "
                                 "of num_attention_heads")
            head_dim = hidden // heads

        def opt(key, default):
            return d[key] if d.get(key) is not None else default

        return cls(
            hidden=hidden,
            intermediate=C.hf_get(d, "intermediate_size"),
            heads=heads,
            kv_heads=opt("num_key_value_heads", heads),
            head_dim=head_dim,
            vocab=C.hf_get(d, "vocab_size"),
            context=C.hf_get(d, "max_position_embeddings"),
            prelude=opt("num_prelude_layers", 0),
            groups=C.hf_get(d, "num_groups"),
            per_xsa=C.hf_get(d, "gdn_layers_per_group"),
            coda=opt("num_coda_layers", 0),
            passes=C.hf_get(d, "recurrent_passes"),
            gdn_v_heads=C.hf_get(d, "gdn_num_v_heads"),
            gdn_k_dim=C.hf_get(d, "gdn_key_dim"),
            gdn_v_dim=C.hf_get(d, "gdn_value_dim"),
            conv_kernel=opt("gdn_conv_kernel_size", 4),
            xsa_projection=opt("xsa_projection", True),
            tied=opt("tie_word_embeddings", False),
            eps=opt("rms_norm_eps", 1e-5),
            rope_theta=C.hf_rope_theta(d),
            allow_neg=opt("gdn_allow_neg_eigval", False),
            layers=d.get("num_hidden_layers"),
            recurrent=d.get("recurrent_layers"),
        )

    def to_hf(self):
        return {
            "model_type": "surjo", "hidden_size": self.hidden,
            "intermediate_size": self.intermediate, "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads, "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim, "vocab_size": self.vocab,
            "max_position_embeddings": self.context,
            "num_prelude_layers": self.prelude, "num_groups": self.groups,
            "gdn_layers_per_group": self.per_xsa, "num_coda_layers": self.coda,
            "recurrent_passes": self.passes, "recurrent_layers": self.recurrent,
            "gdn_num_v_heads": self.gdn_v_heads, "gdn_key_dim": self.gdn_k_dim,
            "gdn_value_dim": self.gdn_v_dim, "gdn_conv_kernel_size": self.conv_kernel,
            "gdn_allow_neg_eigval": self.allow_neg, "xsa_projection": self.xsa_projection,
            "rms_norm_eps": self.eps, "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tied, "hidden_act": "silu",
        }

    def canonical(self):
        """A canonical string of the shape (floats as hex of their float32 value)."""
        ints = [str(getattr(self, f.name)) for f in fields(self)
                if f.name not in ("eps", "rope_theta", "model_type")]
        return "|".join(["surjo"] + ints + [C.hexfloat(np.float32(self.eps)),
                                            C.hexfloat(np.float32(self.rope_theta))])


# The HF key of each layout field, for messages about the layout.
_HF_NAME = {"prelude": "num_prelude_layers", "groups": "num_groups",
            "per_xsa": "gdn_layers_per_group", "coda": "num_coda_layers",
            "passes": "recurrent_passes"}


def weight_shapes(config, has_head):
    """Every tensor a Surjo model needs, name -> shape (the spec's names)."""
    c = config
    D, F, V, Dh, Dv, W = c.hidden, c.intermediate, c.vocab, c.head_dim, c.gdn_v_dim, c.conv_kernel
    kt, vt = c.key_total, c.value_total
    shapes = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,)}
    if has_head:
        shapes["lm_head.weight"] = (V, D)
    elif not c.tied:
        raise ValueError("missing lm_head.weight for untied model")
    for i in range(c.layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (D,)
        shapes[p + "post_attention_layernorm.weight"] = (D,)
        shapes[p + "mlp.gate_proj.weight"] = (F, D)
        shapes[p + "mlp.up_proj.weight"] = (F, D)
        shapes[p + "mlp.down_proj.weight"] = (D, F)
        if c.is_xsa_layer(i):
            a = p + "self_attn."
            shapes[a + "q_proj.weight"] = (c.heads * Dh, D)
            shapes[a + "k_proj.weight"] = (c.kv_heads * Dh, D)
            shapes[a + "v_proj.weight"] = (c.kv_heads * Dh, D)
            shapes[a + "o_proj.weight"] = (D, c.heads * Dh)
            shapes[a + "q_norm.weight"] = (Dh,)
            shapes[a + "k_norm.weight"] = (Dh,)
        else:
            a = p + "linear_attn."
            shapes[a + "q_proj.weight"] = (kt, D)
            shapes[a + "k_proj.weight"] = (kt, D)
            shapes[a + "v_proj.weight"] = (vt, D)
            shapes[a + "q_conv.conv.weight"] = (kt, 1, W)
            shapes[a + "k_conv.conv.weight"] = (kt, 1, W)
            shapes[a + "v_conv.conv.weight"] = (vt, 1, W)
            shapes[a + "f_proj.0.weight"] = (Dv, D)
            shapes[a + "f_proj.1.weight"] = (kt, Dv)
            shapes[a + "b_proj.weight"] = (kt, D)
            shapes[a + "w_proj.weight"] = (vt, D)
            shapes[a + "A_log"] = (c.heads,)
            shapes[a + "dt_bias"] = (kt,)
            shapes[a + "g_proj.0.weight"] = (Dv, D)
            shapes[a + "g_proj.1.weight"] = (vt, Dv)
            shapes[a + "g_proj.1.bias"] = (vt,)
            shapes[a + "o_norm.weight"] = (Dv,)
            shapes[a + "o_proj.weight"] = (D, vt)
    total = sum(C.checked_elements(s) * 4 for s in shapes.values())
    if total > C.MAX_WEIGHT_BYTES:
        raise ValueError("FP32 source weights exceed the 64 GiB safety limit")
    # The config admits GDN widths (gdn_num_v_heads * gdn_value_dim up to 2^24,
    # heads * gdn_key_dim up to 2^21) beyond what a Matrix holds; refuse them
    # here, by tensor, before any weight is read or packed.
    for name, shape in shapes.items():
        if len(shape) == 2 and (shape[0] > MAX_ROWS or shape[1] > MAX_COLS):
            raise ValueError(f"{name} would be a {shape[0]}x{shape[1]} matrix; a Matrix holds at most "
                             f"{MAX_ROWS} rows and {MAX_COLS} columns")
    return shapes


class Model(GenerationMixin, SurjoModel):
    """A Surjo model (see SurjoModel for the methods)."""

    config_class = Config

    @classmethod
    def from_pretrained(cls, path, precision="auto", threads=None, act_precision="fp32", kv_precision="fp32"):
        """Load a Hugging Face-style directory: config.json and safetensors weights
        (one file or shards with model.safetensors.index.json; bf16/fp16/fp32)."""
        from cism._weights import check_kv_precision
        from cism.loaders import build_pretrained
        check_kv_precision(kv_precision)
        return build_pretrained(cls, path, precision, threads, act_precision, kv_precision=kv_precision)
