"""NumPy reference for the FWKV recurrent family ("Myosotis", FWKVLanguageModel).

Written from the behavioural spec ``shared/spec/runtime.cpp.txt``: ``FwkvConfig::validate``
and ``fwkv_weight_shapes`` (502-553), the helpers and model (4535-4640),
``FwkvSession::forward_tokens`` (4831-4898) and ``forward_block`` (4900-4991).
It never imports ``cism``.

Config (a dict; C++ ``FwkvConfig`` names)
-----------------------------------------
    d_model d, d_emb e, layers L, ffn_mult m (default 4), vocab V,
    context (default 1024), wkv_floor (default 0.1, in [0, 1)), tied (must be True)

Weights (fwkv_weight_shapes; linear weights (out, in), no linear has a bias)
----------------------------------------------------------------------------
    shared.weight        (V, e)    token embedding AND output head (factorized, tied)
    shared.proj.weight   (d, e)    embedding space -> model space (its transpose maps back)
    norm.weight, norm.bias (d,)    final LayerNorm
    blocks.i.proj_k.weight, proj_v.weight, proj_r.weight, proj_out.weight   (d, d)
    blocks.i.w                      (d,)     decay logits
    blocks.i.ffn.0.weight           (m*d, d)
    blocks.i.ffn.2.weight           (d, m*d)
    blocks.i.norm_wkv.weight/.bias, blocks.i.norm_ffn.weight/.bias           (d,)

Equations, per token (state s_i (d,) per layer, zeros at the start)
-------------------------------------------------------------------
    LN(u; g, b)  = (u - mean(u)) / sqrt(var(u) + 1e-5) * g + b      (biased variance, 4553-4570)
    GELU(z)      = 0.5 z (1 + erf(z / sqrt(2)))                      (exact, 4548-4551)
    x            = P E[token],   E = shared.weight, P = shared.proj.weight
    per layer i:
      k, v       = Wk x, Wv x
      r          = sigmoid(Wr x)                      (one sigmoid; see note below)
      W          = clamp(sigmoid(w_i), wkv_floor, 0.999)
      s_i        = k * v + W * s_i
      x          = LN(x + 0.1 * Wout (r * s_i); norm_wkv)        residual scaled by 0.1,
      x          = LN(x + 0.1 * W2 GELU(W0 x); norm_ffn)         post-norm (LN after the add)
    logits       = E (P^T LN(x; norm))

Choices where the spec is ambiguous
-----------------------------------
* The comment above the implementation (4536-4540) writes ``proj_out(sigmoid(r)*s)``
  after already defining ``r = sigmoid(proj_r(x))``; the code applies the sigmoid once
  (``act_sigmoid(r_)``, 4866 / 4944). One sigmoid is used here.
* ``std::clamp(sigmoid(w), floor, 0.999)`` is undefined in C++ when floor > 0.999
  (validate allows floor < 1); this reference uses min(max(., floor), 0.999), so
  0.999 wins there.
* The FFN reads x after the WKV LayerNorm (4873-4876), i.e. the two sub-blocks are
  sequential post-norm residuals; the ffn sub-block has no pre-norm.

API: ``make_config``, ``weight_shapes``, ``random_weights(config, seed)``, ``init_state``,
``forward(config, weights, state, tokens)`` (block: all projections of the T tokens at
once, the WKV scan in closed form), ``step(config, weights, state, token)`` (one token,
plain recurrence), ``logits``, ``greedy``, ``nll``, and ``wkv_step`` for the core update.
"""
import math

import numpy as np

__all__ = ["make_config", "weight_shapes", "random_weights", "init_state", "forward",
           "step", "logits", "greedy", "nll", "wkv_step"]


def make_config(**fields):
    """A validated config dict (FwkvConfig::validate, 502-520)."""
    c = dict(model_type="fwkv", ffn_mult=4, context=1024, wkv_floor=0.1, tied=True)
    c.update(fields)
    for k in ("d_model", "d_emb", "layers", "vocab"):
        if not c.get(k):
            raise ValueError(f"{k} must be positive")
    if not 0 <= c["wkv_floor"] < 1:
        raise ValueError("wkv_floor must be in [0, 1)")
    if not c["tied"]:
        raise ValueError("FWKV requires tied embeddings (factorized tied head)")
    return c


def weight_shapes(c):
    """name -> shape, as fwkv_weight_shapes (522-553)."""
    d, e, ffn = c["d_model"], c["d_emb"], c["d_model"] * c["ffn_mult"]
    shapes = {"shared.weight": (c["vocab"], e), "shared.proj.weight": (d, e),
              "norm.weight": (d,), "norm.bias": (d,)}
    for i in range(c["layers"]):
        p = f"blocks.{i}."
        for name in ("proj_k", "proj_v", "proj_r", "proj_out"):
            shapes[p + name + ".weight"] = (d, d)
        shapes.update({p + "w": (d,), p + "ffn.0.weight": (ffn, d), p + "ffn.2.weight": (d, ffn),
                       p + "norm_wkv.weight": (d,), p + "norm_wkv.bias": (d,),
                       p + "norm_ffn.weight": (d,), p + "norm_ffn.bias": (d,)})
    return shapes


def random_weights(c, seed=0):
    """Random float32 weights; ``w`` spread so that sigmoid(w) covers (floor, 0.999)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in sorted(weight_shapes(c).items()):
        if name.endswith("norm.weight") or name.endswith("norm_wkv.weight") or name.endswith("norm_ffn.weight"):
            w = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name.endswith(".bias"):
            w = 0.1 * rng.standard_normal(shape)
        elif name.endswith(".w"):
            w = rng.uniform(-3.0, 8.0, shape)
        elif name == "shared.weight":
            w = rng.standard_normal(shape)
        else:
            w = rng.standard_normal(shape) / math.sqrt(shape[-1])
        out[name] = w.astype(np.float32)
    return out


def _layer_norm(u, g, b):
    mean = u.mean(axis=-1, keepdims=True)
    var = ((u - mean) ** 2).mean(axis=-1, keepdims=True)
    return (u - mean) / np.sqrt(var + 1e-5) * g + b


_erf = np.vectorize(math.erf, otypes=[np.float64])      # NumPy has no erf; math.erf is exact


def _gelu(z):
    return (0.5 * z * (1.0 + _erf(z / math.sqrt(2.0)))).astype(z.dtype, copy=False)


def _sigmoid(z):
    return 0.5 * (1.0 + np.tanh(0.5 * z))


def _decay(c, w):
    return np.minimum(np.maximum(_sigmoid(w), c["wkv_floor"]), 0.999)


def wkv_step(s, k, v, decay):
    """The WKV recurrence for one token: s <- k * v + decay * s (new array)."""
    return k * v + decay * s


def _wkv_scan(a, W, s0, chunk=64):
    """All states s_1..s_T of s_t = a_t + W s_{t-1} from s0, in closed form per chunk.
    a: (T, d); W: (d,); s0: (d,). Returns (T, d)."""
    out = np.empty_like(a)
    for start in range(0, len(a), chunk):
        ac = a[start:start + chunk]
        n = len(ac)
        lag = np.arange(n)[:, None] - np.arange(n)[None, :]                 # t - u
        powers = W ** np.maximum(lag, 0)[:, :, None] * (lag >= 0)[:, :, None]   # (n, n, d)
        out[start:start + n] = np.einsum("tud,ud->td", powers, ac) + W ** np.arange(1, n + 1)[:, None] * s0
        s0 = out[start + n - 1]
    return out


def init_state(c, dtype=np.float64):
    """WKV state (layers, d_model), zeros."""
    return np.zeros((c["layers"], c["d_model"]), dtype)


class _Weights:
    def __init__(self, weights, dtype):
        self._src, self._dtype, self._cache = weights, dtype, {}

    def __call__(self, name):
        if name not in self._cache:
            self._cache[name] = np.asarray(self._src[name]).astype(self._dtype, copy=False)
        return self._cache[name]


def _head(w, x):
    """Final LayerNorm, back to embedding space with P^T, tied logits."""
    h = _layer_norm(x, w("norm.weight"), w("norm.bias"))
    return (h @ w("shared.proj.weight")) @ w("shared.weight").T


def step(c, weights, state, token):
    """One token with the plain recurrence; updates ``state`` (layers, d); logits (V,)."""
    w = weights if isinstance(weights, _Weights) else _Weights(weights, state.dtype)
    x = w("shared.proj.weight") @ w("shared.weight")[int(token)]             # (d,)
    for i in range(c["layers"]):
        p = f"blocks.{i}."
        k, v = w(p + "proj_k.weight") @ x, w(p + "proj_v.weight") @ x
        r = _sigmoid(w(p + "proj_r.weight") @ x)
        state[i] = wkv_step(state[i], k, v, _decay(c, w(p + "w")))
        x = _layer_norm(x + 0.1 * (w(p + "proj_out.weight") @ (r * state[i])),
                        w(p + "norm_wkv.weight"), w(p + "norm_wkv.bias"))
        x = _layer_norm(x + 0.1 * (w(p + "ffn.2.weight") @ _gelu(w(p + "ffn.0.weight") @ x)),
                        w(p + "norm_ffn.weight"), w(p + "norm_ffn.bias"))
    return _head(w, x)


def forward(c, weights, state, tokens):
    """Feed ``tokens`` after ``state`` (updated in place); logits (T, V).

    Every projection runs over all T tokens at once. The WKV scan is evaluated in its
    closed form, chunk by chunk (an independent route to ``step``'s recurrence): with
    a_u = k_u v_u and s_0 the state entering a chunk,
        s_t = sum_{u<=t} W^(t-u) a_u + W^t s_0      (t, u = 1.. within the chunk)."""
    w = weights if isinstance(weights, _Weights) else _Weights(weights, state.dtype)
    tokens = np.asarray(tokens, dtype=np.int64)
    x = w("shared.weight")[tokens] @ w("shared.proj.weight").T               # (T, d)
    for i in range(c["layers"]):
        p = f"blocks.{i}."
        k, v = x @ w(p + "proj_k.weight").T, x @ w(p + "proj_v.weight").T
        r = _sigmoid(x @ w(p + "proj_r.weight").T)
        s = _wkv_scan(k * v, _decay(c, w(p + "w")), state[i])
        state[i] = s[-1]
        x = _layer_norm(x + 0.1 * ((r * s) @ w(p + "proj_out.weight").T),
                        w(p + "norm_wkv.weight"), w(p + "norm_wkv.bias"))
        x = _layer_norm(x + 0.1 * (_gelu(x @ w(p + "ffn.0.weight").T) @ w(p + "ffn.2.weight").T),
                        w(p + "norm_ffn.weight"), w(p + "norm_ffn.bias"))
    return _head(w, x)


def logits(c, weights, tokens, dtype=np.float64):
    """Logits (T, V) at every position of ``tokens`` from a zero state."""
    return forward(c, weights, init_state(c, dtype), tokens)


def greedy(c, weights, prompt, n, dtype=np.float64):
    """``n`` argmax continuation tokens (block prefill, then ``step``)."""
    state = init_state(c, dtype)
    w = _Weights(weights, dtype)
    last = forward(c, w, state, prompt)[-1]
    out = []
    for _ in range(n):
        out.append(int(np.argmax(last)))
        if len(out) < n:
            last = step(c, w, state, out[-1])
    return out


def nll(c, weights, tokens, dtype=np.float64):
    """Mean negative log-likelihood of tokens[1:] (FwkvModel::nll, 4764-4781)."""
    tokens = np.asarray(tokens, dtype=np.int64)
    if len(tokens) < 2:
        raise ValueError("nll needs at least 2 tokens")
    z = logits(c, weights, tokens, dtype)[:-1].astype(np.float64)
    m = z.max(axis=-1, keepdims=True)
    logz = m[:, 0] + np.log(np.exp(z - m).sum(axis=-1))
    return float(np.mean(logz - z[np.arange(len(z)), tokens[1:]]))
