"""FWKV: the RWKV-style recurrent family, e.g. Myosotis-1-base (``cism.fwkv``).

    from cism.fwkv import Model
    model = Model.from_pretrained("path/to/myosotis-dir", precision="int8")
    session = model.create_session([464, 3290], max_new_tokens=16)
    tokens = session.next_tokens(16)

Per token: a factorized tied embedding (``shared.weight`` rows of width d_emb,
mapped to d_model by ``shared.proj``), then per layer a WKV recurrence over a
(d_model,) state and a GELU FFN, each a 0.1-scaled residual followed by a
LayerNorm; logits through the same two tensors in reverse. The state is
(layers, d_model) whatever the sequence length.
"""
import math
from dataclasses import dataclass

import numpy as np

from cism import _config as C
from cism._fwkv import FwkvModel, Session  # noqa: F401
from cism.generation import GenerationMixin

MODEL_TYPE = "fwkv"


@dataclass(frozen=True)
class Config:
    """An FWKV model's shape, validated with the spec's bounds on creation
    (field names are the spec's FwkvConfig names; ``from_hf`` maps config.json)."""
    d_model: int
    d_emb: int
    layers: int
    vocab: int
    ffn_mult: int = 4
    context: int = 1024
    wkv_floor: float = 0.1
    tied: bool = True
    model_type: str = MODEL_TYPE

    def __post_init__(self):
        if self.model_type != MODEL_TYPE:
            raise ValueError(f"model_type must be fwkv for FWKV models, got {self.model_type!r}")
        set_ = object.__setattr__
        set_(self, "d_model", C.bound(self.d_model, 8192, "d_model"))
        set_(self, "d_emb", C.bound(self.d_emb, 2048, "d_emb"))
        set_(self, "layers", C.bound(self.layers, 128, "n_layers"))
        set_(self, "ffn_mult", C.bound(self.ffn_mult, 16, "ffn_mult"))
        set_(self, "vocab", C.bound(self.vocab, 2_000_000, "vocab_size"))
        set_(self, "context", C.bound(self.context, 1_048_576, "max_position_embeddings"))
        set_(self, "wkv_floor", _floor(self.wkv_floor))
        set_(self, "tied", C.flag(self.tied, "tie_word_embeddings"))
        if not self.tied:
            raise ValueError("FWKV requires tie_word_embeddings=true (factorized tied head)")

    @property
    def ffn(self):
        """Width of the FFN hidden layer, d_model * ffn_mult."""
        return self.d_model * self.ffn_mult

    @classmethod
    def from_hf(cls, d):
        """Map an FWKV ``config.json`` dict; absent optional keys take the spec's
        defaults (ffn_mult 4, context 1024, wkv_floor 0.1, tied)."""
        if not isinstance(d, dict):
            raise ValueError(f"config must be a dict, got {type(d).__name__}")
        model_type = d.get("model_type")
        if model_type != MODEL_TYPE:
            raise ValueError(f"model_type must be fwkv for FWKV models, got {model_type!r}")
        return cls(
            d_model=C.hf_get(d, "d_model"),
            d_emb=C.hf_get(d, "d_emb"),
            layers=C.hf_get(d, "n_layers"),
            vocab=C.hf_get(d, "vocab_size"),
            ffn_mult=C.hf_get(d, "ffn_mult", 4),
            context=C.hf_get(d, "max_position_embeddings", 1024),
            wkv_floor=C.hf_get(d, "wkv_floor", 0.1),
            tied=C.hf_get(d, "tie_word_embeddings", True),
        )

    def to_hf(self):
        return {"model_type": MODEL_TYPE, "d_model": self.d_model, "d_emb": self.d_emb,
                "n_layers": self.layers, "ffn_mult": self.ffn_mult, "vocab_size": self.vocab,
                "max_position_embeddings": self.context, "wkv_floor": self.wkv_floor,
                "tie_word_embeddings": self.tied}

    def canonical(self):
        """The shape as one string (the float in hex), the first part of compile_key."""
        return "|".join([MODEL_TYPE] + [str(v) for v in (self.d_model, self.d_emb, self.layers,
                                                         self.ffn_mult, self.vocab, self.context)]
                        + [C.hexfloat(np.float32(self.wkv_floor)), str(int(self.tied))])


def _floor(value):
    # The spec holds wkv_floor as a float32 and checks the rounded value, so
    # 0.99999999 (which rounds to 1.0f) is refused.
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise ValueError(f"wkv_floor must be a number, got {value!r}")
    f = float(np.float32(value))
    if not math.isfinite(f) or not 0 <= f < 1:
        raise ValueError(f"wkv_floor must be in [0, 1), got {value!r}")
    return f


def weight_shapes(config):
    """Every tensor an FWKV model needs, name -> shape (the published names)."""
    if not isinstance(config, Config):
        raise ValueError(f"config must be a cism.fwkv.Config, got {type(config).__name__}")
    c = config
    d, ffn = c.d_model, c.ffn
    shapes = {"shared.weight": (c.vocab, c.d_emb), "shared.proj.weight": (d, c.d_emb),
              "norm.weight": (d,), "norm.bias": (d,)}
    for i in range(c.layers):
        p = f"blocks.{i}."
        for name in ("proj_k", "proj_v", "proj_r", "proj_out"):
            shapes[p + name + ".weight"] = (d, d)
        shapes[p + "w"] = (d,)
        shapes[p + "ffn.0.weight"] = (ffn, d)
        shapes[p + "ffn.2.weight"] = (d, ffn)
        for name in ("norm_wkv.weight", "norm_wkv.bias", "norm_ffn.weight", "norm_ffn.bias"):
            shapes[p + name] = (d,)
    total = sum(C.checked_elements(s) * 4 for s in shapes.values())
    if total > C.MAX_WEIGHT_BYTES:
        raise ValueError("FP32 source weights exceed the 64 GiB safety limit")
    return shapes


class Model(GenerationMixin, FwkvModel):
    """An FWKV model (see FwkvModel for the methods)."""

    config_class = Config

    @classmethod
    def from_pretrained(cls, path, precision="auto", threads=None, act_precision="fp32"):
        """Load an FWKV directory: config.json plus safetensors (one file or
        sharded with model.safetensors.index.json; fp32/fp16/bf16 tensors)."""
        from cism.loaders import build_pretrained
        return build_pretrained(cls, path, precision, threads, act_precision)
