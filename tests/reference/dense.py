"""NumPy reference forward pass for dense Llama, Mistral, Qwen2 and Qwen3
decoders (HF layout).

Inputs
------
``config``: an HF ``config.json``-style dict with

    model_type            "llama" | "mistral" | "qwen2" | "qwen3"
    hidden_size           D
    intermediate_size     F
    num_hidden_layers     L
    num_attention_heads   H
    num_key_value_heads   Hkv            (H % Hkv == 0; each KV head serves H/Hkv heads)
    head_dim              Dh             (default D // H; Qwen3 sets it explicitly)
    vocab_size            V
    rms_norm_eps          eps
    rope_theta            theta          (or rope_parameters["rope_theta"], transformers 5)
    tie_word_embeddings   lm_head == embed_tokens when true
    sliding_window        W: mistral only (null: none)
    rope_scaling          {"rope_type": "linear", "factor"} or llama3's (factor,
                          low_freq_factor, high_freq_factor, original_max_position_embeddings)
                          or yarn's (factor, original_max_position_embeddings, beta_fast 32,
                          beta_slow 1, attention_factor 0.1 ln(factor) + 1, truncate true)

``weights``: HF tensor names -> arrays, every linear weight stored (out, in):

    model.embed_tokens.weight                      (V, D)
    model.layers.N.input_layernorm.weight          (D,)
    model.layers.N.self_attn.q_proj.weight         (H*Dh, D)
    model.layers.N.self_attn.k_proj.weight         (Hkv*Dh, D)
    model.layers.N.self_attn.v_proj.weight         (Hkv*Dh, D)
    model.layers.N.self_attn.o_proj.weight         (D, H*Dh)
    model.layers.N.self_attn.{q,k,v}_proj.bias     qwen2 only
    model.layers.N.self_attn.q_norm.weight         (Dh,)   qwen3 only
    model.layers.N.self_attn.k_norm.weight         (Dh,)   qwen3 only
    model.layers.N.post_attention_layernorm.weight (D,)
    model.layers.N.mlp.gate_proj.weight            (F, D)
    model.layers.N.mlp.up_proj.weight              (F, D)
    model.layers.N.mlp.down_proj.weight            (D, F)
    model.norm.weight                              (D,)
    lm_head.weight                                 (V, D)  only read when untied

Equations (x_t is the residual stream of token t at absolute position p_t)
---------------------------------------------------------------------------
    rms(x; g)      = x / sqrt(mean(x^2) + eps) * g
    x_t            = embed[token_t]
    per layer:
      h            = rms(x; input_layernorm)
      q, k, v      = Wq h, Wk h, Wv h  (+ bq, bk, bv: qwen2)   split into heads of Dh
      qwen3:  q_i  = rms(q_i; q_norm), k_j = rms(k_j; k_norm)   per head, before RoPE
      RoPE (HF rotate-half): for i < Dh/2, inv_freq_i = theta^(-2i/Dh), a = p * inv_freq_i,
              (linear: inv_freq_i / factor; llama3: wavelength 2pi/inv_freq_i below
               orig/high kept, above orig/low divided by factor, blended between;
               yarn: d(r) = Dh ln(orig / (2 pi r)) / (2 ln theta), low = floor d(beta_fast),
               high = ceil d(beta_slow) clipped to [0, Dh-1], ramp_i = clip((i - low) / (high - low)),
               inv_freq_i (1 - ramp_i) + inv_freq_i / factor ramp_i, and m = attention_factor)
              (u_i, u_{i+Dh/2}) <- m (u_i cos a - u_{i+Dh/2} sin a, u_{i+Dh/2} cos a + u_i sin a)
      att_i(t)     = sum_{t-W<s<=t} softmax_s(q_i(t).k_j(s) / sqrt(Dh)) v_j(s),  j = i // (H/Hkv)
      x           += Wo concat_i att_i
      h            = rms(x; post_attention_layernorm)
      x           += Wdown (silu(Wgate h) * Wup h)          silu(z) = z sigmoid(z)
    logits_t       = Whead rms(x_t; model.norm)

The whole sequence goes through every matmul at once (T rows), so SmolLM2-135M over
512 tokens takes a few seconds in float32. ``greedy`` keeps a KV cache and feeds one
token at a time after the prompt, like an engine's decode loop.
"""
import math

import numpy as np

__all__ = ["logits", "greedy", "nll", "forward"]


def _cfg(config):
    """Derived sizes, named once."""
    hidden = config["hidden_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    theta = config.get("rope_theta")
    if theta is None:
        theta = (config.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    model_type = config.get("model_type", "llama")
    if model_type not in ("llama", "mistral", "qwen2", "qwen3"):
        raise ValueError(f"unsupported model_type {model_type!r}")
    if heads % kv_heads:
        raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
    return dict(model_type=model_type, hidden=hidden, heads=heads, kv_heads=kv_heads,
                head_dim=head_dim, layers=config["num_hidden_layers"],
                vocab=config["vocab_size"], eps=float(config.get("rms_norm_eps", 1e-6)),
                theta=float(theta), tied=bool(config.get("tie_word_embeddings", False)),
                window=(config.get("sliding_window") or 0) if model_type == "mistral" else 0,
                rope_scaling=config.get("rope_scaling") or {})


def _rms_norm(x, weight, eps):
    """rms(x; g) over the last axis."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def _inv_freq(half, theta, scaling):
    """Rotary frequencies, scaled as transformers scales them."""
    inv_freq = theta ** (-np.arange(0, 2 * half, 2, dtype=np.float64) / (2 * half))  # (Dh/2,)
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        orig = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (orig / wavelen - low) / (high - low)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        return np.where(wavelen < orig / high, inv_freq, np.where(wavelen > orig / low, inv_freq / factor, blended))
    if kind == "yarn":
        factor, orig, dim = scaling["factor"], scaling["original_max_position_embeddings"], 2 * half
        def dim_of(rotations):   # the dimension that turns `rotations` times over orig positions
            return dim * math.log(orig / (2 * math.pi * rotations)) / (2 * math.log(theta))
        low, high = dim_of(scaling.get("beta_fast") or 32), dim_of(scaling.get("beta_slow") or 1)
        if scaling.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        ramp = np.clip((np.arange(half) - low) / max(high - low, 0.001), 0, 1)   # 0: keep, 1: divide
        return inv_freq * (1 - ramp) + inv_freq / factor * ramp
    assert kind in (None, "default"), kind
    return inv_freq


def _attention_factor(scaling):
    """What cos and sin are multiplied by (yarn only)."""
    if scaling.get("rope_type", scaling.get("type")) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return scaling["attention_factor"]
    factor = scaling["factor"]
    def mscale(m):
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0
    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return mscale(scaling["mscale"]) / mscale(scaling["mscale_all_dim"])
    return mscale(1.0)


def _rope(u, positions, theta, scaling=None):
    """HF rotate-half RoPE. u: (T, heads, Dh); positions: (T,) absolute."""
    half = u.shape[-1] // 2
    inv_freq = _inv_freq(half, theta, scaling or {})
    angle = positions.astype(np.float64)[:, None] * inv_freq[None, :]                # (T, Dh/2)
    m = _attention_factor(scaling or {})
    cos = (m * np.cos(angle)).astype(u.dtype)[:, None, :]
    sin = (m * np.sin(angle)).astype(u.dtype)[:, None, :]
    a, b = u[..., :half], u[..., half:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def _silu(z):
    return z / (1.0 + np.exp(-z))


class _Weights:
    """Casts each HF tensor to the working dtype once, on first use."""

    def __init__(self, weights, dtype):
        self._src, self._dtype, self._cache = weights, dtype, {}

    def __call__(self, name):
        if name not in self._cache:
            self._cache[name] = np.asarray(self._src[name]).astype(self._dtype, copy=False)
        return self._cache[name]


def forward(config, weights, tokens, cache=None, dtype=np.float64, kv_round=None):
    """Run ``tokens`` after the ``cache`` (a dict made and grown here; pass the same
    dict back to continue). Returns logits (T, V) for the new tokens. ``kv_round``
    (e.g. np.float16): keys and values are rounded to that type as they are
    cached (after RoPE), as a KV cache of that precision holds them."""
    c = _cfg(config)
    w = weights if isinstance(weights, _Weights) else _Weights(weights, dtype)
    dtype = w._dtype
    if cache is None:
        cache = {}
    tokens = np.asarray(tokens, dtype=np.int64)
    T, Dh, H, Hkv = len(tokens), c["head_dim"], c["heads"], c["kv_heads"]
    start = cache.get("length", 0)
    positions = np.arange(start, start + T)
    # new token t (absolute start+t) may see cached/new keys s <= start+t
    mask = np.arange(start + T)[None, :] > positions[:, None]              # (T, start+T)
    if c["window"]:   # and keys W or more positions back
        mask |= np.arange(start + T)[None, :] <= positions[:, None] - c["window"]
    x = w("model.embed_tokens.weight")[tokens]                               # (T, D)
    for n in range(c["layers"]):
        p = f"model.layers.{n}."
        # attention rmsnorm
        h = _rms_norm(x, w(p + "input_layernorm.weight"), c["eps"])
        q = (h @ w(p + "self_attn.q_proj.weight").T).reshape(T, H, Dh)
        k = (h @ w(p + "self_attn.k_proj.weight").T).reshape(T, Hkv, Dh)
        v = (h @ w(p + "self_attn.v_proj.weight").T).reshape(T, Hkv, Dh)
        if c["model_type"] == "qwen2":
            q = q + w(p + "self_attn.q_proj.bias").reshape(H, Dh)
            k = k + w(p + "self_attn.k_proj.bias").reshape(Hkv, Dh)
            v = v + w(p + "self_attn.v_proj.bias").reshape(Hkv, Dh)
        if c["model_type"] == "qwen3":
            # per-head q/k RMSNorm over head_dim, before RoPE
            q = _rms_norm(q, w(p + "self_attn.q_norm.weight"), c["eps"])
            k = _rms_norm(k, w(p + "self_attn.k_norm.weight"), c["eps"])
        # rotate q and k
        q, k = (_rope(u, positions, c["theta"], c["rope_scaling"]) for u in (q, k))
        if kv_round is not None:
            k, v = k.astype(kv_round).astype(dtype), v.astype(kv_round).astype(dtype)
        # append to this layer's cache
        if n in cache:
            k = np.concatenate([cache[n][0], k]); v = np.concatenate([cache[n][1], v])
        cache[n] = (k, v)                                                    # (start+T, Hkv, Dh)
        # causal GQA attention: head i reads KV head i // (H/Hkv)
        kh = np.repeat(k, H // Hkv, axis=1).transpose(1, 2, 0)              # (H, Dh, S)
        vh = np.repeat(v, H // Hkv, axis=1).transpose(1, 0, 2)              # (H, S, Dh)
        scores = (q.transpose(1, 0, 2) @ kh) / math.sqrt(Dh)                 # (H, T, S)
        scores = np.where(mask[None], -np.inf, scores)
        scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs = scores / scores.sum(axis=-1, keepdims=True)
        att = (probs @ vh).transpose(1, 0, 2).reshape(T, H * Dh)            # (T, H*Dh)
        # residual
        x = x + att @ w(p + "self_attn.o_proj.weight").T
        # SwiGLU MLP
        h = _rms_norm(x, w(p + "post_attention_layernorm.weight"), c["eps"])
        gate = h @ w(p + "mlp.gate_proj.weight").T
        up = h @ w(p + "mlp.up_proj.weight").T
        x = x + (_silu(gate) * up) @ w(p + "mlp.down_proj.weight").T
    cache["length"] = start + T
    # final norm and head
    h = _rms_norm(x, w("model.norm.weight"), c["eps"])
    head = w("model.embed_tokens.weight") if c["tied"] else w("lm_head.weight")
    return h @ head.T


def logits(config, weights, tokens, dtype=np.float64, kv_round=None):
    """Logits (T, vocab) at every position of ``tokens`` (causal)."""
    return forward(config, weights, tokens, None, dtype, kv_round)


def greedy(config, weights, prompt, n, dtype=np.float64):
    """``n`` greedy (argmax, lowest id on ties) continuation tokens of ``prompt``."""
    w = _Weights(weights, dtype)
    cache = {}
    last = forward(config, w, prompt, cache)[-1]
    out = []
    for _ in range(n):
        token = int(np.argmax(last))
        out.append(token)
        if len(out) < n:
            last = forward(config, w, [token], cache)[-1]
    return out


def nll(config, weights, tokens, dtype=np.float64):
    """Mean negative log-likelihood of tokens[1:] given their prefixes."""
    tokens = np.asarray(tokens, dtype=np.int64)
    if len(tokens) < 2:
        raise ValueError("nll needs at least 2 tokens")
    z = logits(config, weights, tokens, dtype)[:-1].astype(np.float64)
    m = z.max(axis=-1, keepdims=True)
    logz = m[:, 0] + np.log(np.exp(z - m).sum(axis=-1))
    return float(np.mean(logz - z[np.arange(len(z)), tokens[1:]]))
