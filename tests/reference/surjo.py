"""NumPy reference for the Surjo hybrid family (XSA attention + Gated DeltaNet).

Written from the behavioural spec ``shared/spec/runtime.cpp.txt`` (line numbers below
refer to it): ``SurjoConfig::validate`` / ``is_xsa_layer`` / ``surjo_weight_shapes``
(402-500), ``SurjoModel::build_plan`` (3037-3058), ``SurjoSession::forward_tokens``
(3423-3861) and ``forward_block`` (3873-4243). It never imports ``cism``.

Config (a dict; field names are those of the C++ ``SurjoConfig``)
-----------------------------------------------------------------
    hidden D, intermediate F, layers L, heads H, kv_heads Hkv, head_dim Dh, vocab V,
    context (max positions), prelude P, groups G, per_xsa n, coda C, passes R,
    recurrent (= G*(n+1)), gdn_v_heads Hv, gdn_k_dim K, gdn_v_dim Dv,
    conv_kernel W (default 4), xsa_projection (default True), tied (default False),
    eps (rms_norm_eps, default 1e-5), rope_theta (default 10000)
    Constraints (validate): P + G*(n+1) + C == L, H % Hkv == 0, Dh even,
    Hv % H == 0, Hv >= H, allow_neg False.

Layer layout and execution plan (build_plan)
--------------------------------------------
Layers 0..P-1 are XSA ("prelude"), then G groups of [n GDN layers, 1 XSA layer], then
C XSA layers ("coda"). The plan executes: the prelude; then R passes, each running
every group's layers in order; then the coda. Every XSA *execution* owns a KV-cache
slot (P + G*R + C slots, numbered in plan order); every GDN (layer, pass) owns its own
recurrent state S and conv FIFOs (numbered in plan order). Weights are shared across
passes. Every plan step is followed by the layer's own SwiGLU MLP.

Weights (names and shapes from surjo_weight_shapes; linear weights are (out, in))
--------------------------------------------------------------------------------
    model.embed_tokens.weight (V, D); model.norm.weight (D,); lm_head.weight (V, D) if untied
    model.layers.i.input_layernorm.weight (D,), post_attention_layernorm.weight (D,)
    model.layers.i.mlp.gate_proj.weight (F, D), up_proj.weight (F, D), down_proj.weight (D, F)
    XSA layers, prefix model.layers.i.self_attn.:
        q_proj.weight (H*Dh, D), k_proj.weight (Hkv*Dh, D), v_proj.weight (Hkv*Dh, D),
        o_proj.weight (D, H*Dh), q_norm.weight (Dh,), k_norm.weight (Dh,)
    GDN layers, prefix model.layers.i.linear_attn.  (Kt = H*K key channels, Vt = Hv*Dv):
        q_proj.weight (Kt, D), k_proj.weight (Kt, D), v_proj.weight (Vt, D)
        q_conv.conv.weight (Kt, 1, W), k_conv.conv.weight (Kt, 1, W), v_conv.conv.weight (Vt, 1, W)
        f_proj.0.weight (Dv, D), f_proj.1.weight (Kt, Dv)       decay-rate path
        b_proj.weight (Kt, D)                                   per-key-channel beta
        w_proj.weight (Vt, D)                                   per-value-channel write gate
        A_log (H,), dt_bias (Kt,)
        g_proj.0.weight (Dv, D), g_proj.1.weight (Vt, Dv), g_proj.1.bias (Vt,)   output gate
        o_norm.weight (Dv,), o_proj.weight (D, Vt)

Equations, per token t at absolute position p (x is the residual stream, (D,))
------------------------------------------------------------------------------
    rms(u; g)     = u / sqrt(mean(u^2) + eps) * g            (eps = config eps everywhere)
    x             = embed[token]
    for each plan step (layer i, pass r):
      h           = rms(x; input_layernorm_i)
      XSA step (KV slot s):
        q = Wq h (H, Dh), k = Wk h (Hkv, Dh), v = Wv h (Hkv, Dh)
        q_j = rms(q_j; q_norm), k_j = rms(k_j; k_norm)                       per head
        RoPE rotate-half at position p, inv_freq_i = theta^(-2i/Dh)  (the spec's rope(), 1712)
        append (k, v) to slot s
        a_j = sum_{u<=p} softmax_u(q_j . K_s[u, j'] / sqrt(Dh)) V_s[u, j'],  j' = j // (H/Hkv)
        if xsa_projection (3617-3633):  with v' = v[j'] the CURRENT token's own value
            vector of the KV head that head j reads (raw v_proj output: no norm, no RoPE),
            a_j <- a_j - (a_j . v' / max(v' . v', 1e-4)) v'
        x += Wo concat_j a_j
      GDN step (state index g = this (layer, pass)):
        q, k = Wq h, Wk h (Kt,); v = Wv h (Vt,)
        f  = softplus(W_f1 (W_f0 h) + dt_bias)                 (Kt,)
        gt = W_g1 (W_g0 h) + g_bias                            (Vt,)
        depthwise causal conv, per channel c with FIFO of the W-1 previous raw inputs:
            y_c = sum_{i=0}^{W-2} conv_c[i] * fifo_c[i] + conv_c[W-1] * u_c,
            then fifo_c <- (fifo_c[1:], u_c)   (fifo_c[W-2] is the newest; zeros at start)
        q, k, v = silu(conv_q(q)), silu(conv_k(k)), silu(conv_v(v))
        beta = sigmoid(Wb h) (Kt,);  omega = sigmoid(Ww h) (Vt,)
        per key head m: q_m <- q_m / (||q_m|| + 1e-12), k_m <- k_m / (||k_m|| + 1e-12)
        per key head m, key channel c: decay_{m,c} = exp(-exp(A_log_m) * f_{m,c})
        per value head e (key head m = e // (Hv/H)), state S_e (K, Dv):
            S_e   <- diag(decay_m) S_e                      decay first
            r     =  S_e^T (beta_m * k_m)                   (Dv,)  read with beta-scaled key
            S_e   <- S_e + k_m (omega_e * v_e - r)^T        write with the plain key
            o_e   =  S_e^T q_m / sqrt(K)                    (Dv,)
            o_e   <- rms(o_e; o_norm) * sigmoid(gt_e)
        x += Wo concat_e o_e
      MLP:  h = rms(x; post_attention_layernorm_i);  x += Wdown(silu(Wgate h) * Wup h)
    logits = Whead rms(x; model.norm),  Whead = embed when tied.

Choices where the spec is ambiguous or approximate
--------------------------------------------------
* Hv > H. The spec sizes each GDN state (H, K, Dv) (3318, 3385, 3745) and, in its
  ``gva != 1`` branch (3784-3823, again 4170-4205), value head e uses state slot e when
  e < H and slot e // (Hv/H) otherwise (3789, 3793), so value heads alias states (with
  H = 2, Hv = 4, heads 1, 2 and 3 all share slot 1). It also turns the key head's ``f``
  into its decay in place once per value head (3801-3802), so the second value head of
  a group decays by exp(-A exp(-A f)). The spec itself calls this "approximate, tested
  Hv==H" (3790-3792). This reference gives every VALUE head its own state: S has shape
  (Hv, K, Dv); value head e reads its key-side tensors (q, k, beta, decay, all
  functions of the key head) from key head m = e // (Hv/H), and its value-side tensors
  (v, omega, gt, o) from e. When Hv == H, m == e and this is exactly the spec's
  ``gva == 1`` branch (3748-3783).
* ``act_sigmoid_mul(o_out, gout, n)`` (3828, 4208) is defined in kernels.hpp, which is
  not part of the spec. It is read as o <- o * sigmoid(gout): the gate is the projected
  ``g`` path (standard gated output); the sigmoid is NOT applied to o.
* softplus: the spec's ``surjo_softplus`` (3404) returns x above 20 and exp(x) below -20;
  these are float shortcuts of log(1 + e^x), used here exactly (np.logaddexp).
* RoPE angle: the spec forms inv_freq and the angle in float32 (3147, 1717);
  this reference uses float64 (differences ~ p * 1e-7 rad).
* Numeric types: the spec stores float32 and accumulates dot products in double; this
  reference runs in float64 by default (``dtype=np.float32`` available).

API
---
``make_config(**fields)``, ``weight_shapes(config, has_head)``, ``plan(config)``,
``random_weights(config, seed)``, ``logits(config, weights, tokens)`` -> (T, V),
``greedy(config, weights, prompt, n)``, ``nll(config, weights, tokens)``, and the stateful
``init_state(config)`` / ``forward(config, weights, state, tokens)`` (any number of new
tokens, returns their logits) / ``step(config, weights, state, token)`` (one token).
The layer pieces ``xsa_mixer``, ``gdn_mixer`` and ``gdn_recurrence`` are public so tests
can check them in isolation.
"""
import math
from dataclasses import dataclass

import numpy as np

__all__ = ["make_config", "weight_shapes", "plan", "random_weights", "init_state",
           "forward", "step", "logits", "greedy", "nll", "Weights", "xsa_mixer",
           "gdn_mixer", "gdn_recurrence"]

_REQUIRED = ("hidden", "intermediate", "heads", "kv_heads", "head_dim", "vocab",
             "prelude", "groups", "per_xsa", "coda", "passes",
             "gdn_v_heads", "gdn_k_dim", "gdn_v_dim")


def make_config(**fields):
    """A validated config dict (spec ``SurjoConfig`` names; see the module docstring).
    ``layers`` and ``recurrent`` are derived when omitted."""
    c = dict(model_type="surjo", context=4096, conv_kernel=4, allow_neg=False,
             xsa_projection=True, tied=False, eps=1e-5, rope_theta=10000.0)
    c.update(fields)
    missing = [k for k in _REQUIRED if k not in c]
    if missing:
        raise ValueError(f"missing config fields: {missing}")
    c.setdefault("recurrent", c["groups"] * (c["per_xsa"] + 1))
    c.setdefault("layers", c["prelude"] + c["recurrent"] + c["coda"])
    # SurjoConfig::validate (402-438), the structural checks
    if c["model_type"] != "surjo":
        raise ValueError("model_type must be surjo")
    if not 1 <= c["conv_kernel"] <= 64:
        raise ValueError("conv_kernel must be in [1, 64]")
    if c["groups"] == 0 or c["passes"] == 0:
        raise ValueError("groups and passes must be positive")
    if c["prelude"] + c["groups"] * (c["per_xsa"] + 1) + c["coda"] != c["layers"]:
        raise ValueError("prelude + groups*(per_xsa+1) + coda must equal layers")
    if c["recurrent"] != c["groups"] * (c["per_xsa"] + 1):
        raise ValueError("recurrent must equal groups*(per_xsa+1)")
    if c["heads"] % c["kv_heads"] or c["head_dim"] % 2:
        raise ValueError("heads must divide into KV groups and head_dim must be even")
    if c["gdn_v_heads"] < c["heads"] or c["gdn_v_heads"] % c["heads"]:
        raise ValueError("gdn_v_heads must be a positive multiple of heads")
    if c["allow_neg"]:
        raise ValueError("allow_neg is not implemented")
    return c


def is_xsa_layer(c, i):
    """SurjoConfig::is_xsa_layer (440-444)."""
    body_end = c["prelude"] + c["groups"] * (c["per_xsa"] + 1)
    if i < c["prelude"] or i >= body_end:
        return True
    return (i - c["prelude"]) % (c["per_xsa"] + 1) == c["per_xsa"]


def weight_shapes(c, has_head=None):
    """name -> shape, as surjo_weight_shapes (446-500). ``has_head`` defaults to untied."""
    if has_head is None:
        has_head = not c["tied"]
    D, F, V, Dh = c["hidden"], c["intermediate"], c["vocab"], c["head_dim"]
    kt, vt = c["heads"] * c["gdn_k_dim"], c["gdn_v_heads"] * c["gdn_v_dim"]
    Dv, W = c["gdn_v_dim"], c["conv_kernel"]
    shapes = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,)}
    if has_head:
        shapes["lm_head.weight"] = (V, D)
    elif not c["tied"]:
        raise ValueError("missing lm_head.weight for untied model")
    for i in range(c["layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
                       p + "mlp.gate_proj.weight": (F, D), p + "mlp.up_proj.weight": (F, D),
                       p + "mlp.down_proj.weight": (D, F)})
        if is_xsa_layer(c, i):
            a = p + "self_attn."
            shapes.update({a + "q_proj.weight": (c["heads"] * Dh, D),
                           a + "k_proj.weight": (c["kv_heads"] * Dh, D),
                           a + "v_proj.weight": (c["kv_heads"] * Dh, D),
                           a + "o_proj.weight": (D, c["heads"] * Dh),
                           a + "q_norm.weight": (Dh,), a + "k_norm.weight": (Dh,)})
        else:
            a = p + "linear_attn."
            shapes.update({a + "q_proj.weight": (kt, D), a + "k_proj.weight": (kt, D),
                           a + "v_proj.weight": (vt, D),
                           a + "q_conv.conv.weight": (kt, 1, W), a + "k_conv.conv.weight": (kt, 1, W),
                           a + "v_conv.conv.weight": (vt, 1, W),
                           a + "f_proj.0.weight": (Dv, D), a + "f_proj.1.weight": (kt, Dv),
                           a + "b_proj.weight": (kt, D), a + "w_proj.weight": (vt, D),
                           a + "A_log": (c["heads"],), a + "dt_bias": (kt,),
                           a + "g_proj.0.weight": (Dv, D), a + "g_proj.1.weight": (vt, Dv),
                           a + "g_proj.1.bias": (vt,),
                           a + "o_norm.weight": (Dv,), a + "o_proj.weight": (D, vt)})
    return shapes


@dataclass(frozen=True)
class PlanStep:
    layer: int
    pass_: int
    slot: int      # XSA KV slot, or -1 for a GDN step
    state: int     # GDN state index, or -1 for an XSA step


def plan(c):
    """SurjoModel::build_plan (3037-3058): prelude, R passes over the groups, coda."""
    steps, slot, state = [], 0, 0

    def xsa(layer, pass_):
        nonlocal slot
        steps.append(PlanStep(layer, pass_, slot, -1)); slot += 1

    for i in range(c["prelude"]):
        xsa(i, 0)
    for r in range(c["passes"]):
        for g in range(c["groups"]):
            base = c["prelude"] + g * (c["per_xsa"] + 1)
            for j in range(c["per_xsa"]):
                steps.append(PlanStep(base + j, r, -1, state)); state += 1
            xsa(base + c["per_xsa"], r)
    coda_start = c["prelude"] + c["groups"] * (c["per_xsa"] + 1)
    for i in range(coda_start, coda_start + c["coda"]):
        xsa(i, 0)
    return steps


def random_weights(c, seed=0, has_head=None):
    """Random float32 weights with the spec's names/shapes, scaled so that activations
    stay O(1) and GDN decays spread over roughly (0.5, 1)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in sorted(weight_shapes(c, has_head).items()):
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            w = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name.endswith("A_log"):
            w = np.log(rng.uniform(0.05, 1.0, shape))
        elif name.endswith("dt_bias"):
            w = rng.uniform(-3.0, 0.5, shape)
        elif name.endswith("conv.weight"):
            w = rng.standard_normal(shape) / math.sqrt(shape[-1])
        elif name.endswith(".bias"):
            w = 0.5 * rng.standard_normal(shape)
        elif name == "model.embed_tokens.weight":
            w = rng.standard_normal(shape)
        else:                                                   # linear (out, in)
            w = rng.standard_normal(shape) / math.sqrt(shape[-1])
        out[name] = w.astype(np.float32)
    return out


# ---- elementwise helpers ----

def _rms(u, g, eps):
    return u / np.sqrt(np.mean(u * u, axis=-1, keepdims=True) + eps) * g


def _sigmoid(z):
    return 0.5 * (1.0 + np.tanh(0.5 * z))        # overflow-free sigmoid


def _silu(z):
    return z * _sigmoid(z)


def _softplus(z):
    return np.logaddexp(0.0, z)


def _l2norm(u):
    """Spec surjo_l2norm (3412): u / (||u|| + 1e-12) over the last axis."""
    return u / (np.sqrt(np.sum(u * u, axis=-1, keepdims=True)) + 1e-12)


def _rope(u, positions, theta):
    """Rotate-half RoPE (spec rope(), 1712-1726). u: (T, heads, Dh)."""
    half = u.shape[-1] // 2
    inv_freq = theta ** (-2.0 * np.arange(half) / u.shape[-1])
    angle = positions[:, None].astype(np.float64) * inv_freq[None, :]      # (T, Dh/2)
    cos = np.cos(angle).astype(u.dtype)[:, None, :]
    sin = np.sin(angle).astype(u.dtype)[:, None, :]
    a, b = u[..., :half], u[..., half:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


# ---- state ----

@dataclass
class State:
    """Everything a session carries between tokens.

    keys/values[slot]: (positions so far, Hkv, Dh) per XSA slot
    S[g]:              (Hv, K, Dv) per GDN (layer, pass)
    fifo_q/k[g]:       (W-1, H*K) previous raw conv inputs, oldest first
    fifo_v[g]:         (W-1, Hv*Dv)
    """
    position: int
    keys: list
    values: list
    S: list
    fifo_q: list
    fifo_k: list
    fifo_v: list
    kv_round: object = None   # e.g. np.float16: keys and values rounded so as they are cached


def init_state(c, dtype=np.float64, kv_round=None):
    """A fresh session: empty KV slots, zero GDN states and zero conv FIFOs."""
    steps = plan(c)
    slots = sum(1 for s in steps if s.slot >= 0)
    states = sum(1 for s in steps if s.state >= 0)
    Hkv, Dh = c["kv_heads"], c["head_dim"]
    kt, vt = c["heads"] * c["gdn_k_dim"], c["gdn_v_heads"] * c["gdn_v_dim"]
    km = c["conv_kernel"] - 1
    return State(
        position=0,
        keys=[np.zeros((0, Hkv, Dh), dtype) for _ in range(slots)],
        values=[np.zeros((0, Hkv, Dh), dtype) for _ in range(slots)],
        S=[np.zeros((c["gdn_v_heads"], c["gdn_k_dim"], c["gdn_v_dim"]), dtype) for _ in range(states)],
        fifo_q=[np.zeros((km, kt), dtype) for _ in range(states)],
        fifo_k=[np.zeros((km, kt), dtype) for _ in range(states)],
        fifo_v=[np.zeros((km, vt), dtype) for _ in range(states)],
        kv_round=kv_round,
    )


class Weights:
    """Name -> array in the working dtype, each HF tensor cast once on first use."""

    def __init__(self, weights, dtype):
        self._src, self._dtype, self._cache = weights, dtype, {}

    def __call__(self, name):
        if name not in self._cache:
            self._cache[name] = np.asarray(self._src[name]).astype(self._dtype, copy=False)
        return self._cache[name]


# ---- mixers (each takes the normalized block h: (T, D) and returns the residual update) ----

def xsa_mixer(c, w, p, h, state, slot, positions):
    """XSA attention for T tokens at ``positions``; appends to KV ``slot``.
    w: a ``Weights``; p: "model.layers.i.self_attn."; h: (T, D) normalized input."""
    T, H, Hkv, Dh = len(h), c["heads"], c["kv_heads"], c["head_dim"]
    rep = H // Hkv
    q = (h @ w(p + "q_proj.weight").T).reshape(T, H, Dh)
    k = (h @ w(p + "k_proj.weight").T).reshape(T, Hkv, Dh)
    v = (h @ w(p + "v_proj.weight").T).reshape(T, Hkv, Dh)
    # per-head q/k rmsnorm, then rotate q and k
    q = _rope(_rms(q, w(p + "q_norm.weight"), c["eps"]), positions, c["rope_theta"])
    k = _rope(_rms(k, w(p + "k_norm.weight"), c["eps"]), positions, c["rope_theta"])
    # append to this execution's KV slot (rounded first with kv_round; the
    # projection below uses the token's own value as computed)
    kc, vc = k, v
    if state.kv_round is not None:
        kc, vc = k.astype(state.kv_round).astype(k.dtype), v.astype(state.kv_round).astype(v.dtype)
    keys = state.keys[slot] = np.concatenate([state.keys[slot], kc])        # (S, Hkv, Dh)
    vals = state.values[slot] = np.concatenate([state.values[slot], vc])
    # causal GQA attention: head j reads KV head j // rep
    kh = np.repeat(keys, rep, axis=1)                                        # (S, H, Dh)
    vh = np.repeat(vals, rep, axis=1)
    scores = np.einsum("thd,shd->hts", q, kh) / math.sqrt(Dh)                # (H, T, S)
    future = np.arange(len(keys))[None, :] > positions[:, None]              # (T, S)
    scores = np.where(future[None], -np.inf, scores)
    prob = np.exp(scores - scores.max(axis=-1, keepdims=True))
    prob /= prob.sum(axis=-1, keepdims=True)
    a = np.einsum("hts,shd->thd", prob, vh)                                  # (T, H, Dh)
    if c["xsa_projection"]:
        # remove each head's component along the current token's own value vector
        vv = np.repeat(v, rep, axis=1)                                       # (T, H, Dh)
        coef = np.sum(a * vv, -1, keepdims=True) / np.maximum(np.sum(vv * vv, -1, keepdims=True), 1e-4)
        a = a - coef * vv
    return a.reshape(T, H * Dh) @ w(p + "o_proj.weight").T


def _causal_conv(u, fifo, weight):
    """Depthwise causal conv over (fifo rows, then the T new rows).
    u: (T, C) raw inputs; fifo: (W-1, C); weight: (C, 1, W). Returns (y (T, C), new fifo)."""
    T, km = len(u), len(fifo)
    seq = np.concatenate([fifo, u])                                          # (W-1+T, C)
    wt = weight[:, 0, :]                                                     # (C, W)
    y = sum(seq[i:i + T] * wt[:, i] for i in range(km + 1))
    return y, seq[len(seq) - km:] if km else fifo


def gdn_recurrence(S, q, k, v, beta, omega, decay):
    """One token of the gated delta rule for every value head (in place on S).

    S: (Hv, K, Dv); q, k, beta, decay: (Hv, K) (key-head tensors already repeated to
    value heads); v, omega: (Hv, Dv). Returns o = S^T q (Hv, Dv), unscaled."""
    S *= decay[:, :, None]                                                   # decay first
    r = np.einsum("ekd,ek->ed", S, beta * k)                                 # read
    S += k[:, :, None] * (omega * v - r)[:, None, :]                         # write
    return np.einsum("ekd,ek->ed", S, q)


def gdn_mixer(c, w, p, h, state, g):
    """Gated DeltaNet for T tokens with state/FIFOs index ``g``.
    w: a ``Weights``; p: "model.layers.i.linear_attn."; h: (T, D) normalized input."""
    T, H, Hv, K, Dv = len(h), c["heads"], c["gdn_v_heads"], c["gdn_k_dim"], c["gdn_v_dim"]
    ratio = Hv // H
    q_raw = h @ w(p + "q_proj.weight").T                                     # (T, H*K)
    k_raw = h @ w(p + "k_proj.weight").T                                     # (T, H*K)
    v_raw = h @ w(p + "v_proj.weight").T                                     # (T, Hv*Dv)
    f = _softplus((h @ w(p + "f_proj.0.weight").T) @ w(p + "f_proj.1.weight").T + w(p + "dt_bias"))
    gt = (h @ w(p + "g_proj.0.weight").T) @ w(p + "g_proj.1.weight").T + w(p + "g_proj.1.bias")
    # depthwise causal conv with this (layer, pass)'s FIFOs, then SiLU
    q, state.fifo_q[g] = _causal_conv(q_raw, state.fifo_q[g], w(p + "q_conv.conv.weight"))
    k, state.fifo_k[g] = _causal_conv(k_raw, state.fifo_k[g], w(p + "k_conv.conv.weight"))
    v, state.fifo_v[g] = _causal_conv(v_raw, state.fifo_v[g], w(p + "v_conv.conv.weight"))
    q, k, v = _silu(q), _silu(k), _silu(v)
    beta = _sigmoid(h @ w(p + "b_proj.weight").T)                            # (T, H*K)
    omega = _sigmoid(h @ w(p + "w_proj.weight").T).reshape(T, Hv, Dv)
    # per key head L2 norm
    q = _l2norm(q.reshape(T, H, K))
    k = _l2norm(k.reshape(T, H, K))
    decay = np.exp(-np.exp(w(p + "A_log"))[None, :, None] * f.reshape(T, H, K))
    # key-side tensors to value heads: value head e reads key head e // ratio
    q, k, decay = (np.repeat(u, ratio, axis=1) for u in (q, k, decay))
    beta = np.repeat(beta.reshape(T, H, K), ratio, axis=1)
    v = v.reshape(T, Hv, Dv)
    o = np.empty((T, Hv, Dv), h.dtype)
    for t in range(T):                                                       # sequential in time
        o[t] = gdn_recurrence(state.S[g], q[t], k[t], v[t], beta[t], omega[t], decay[t])
    o = o / math.sqrt(K)
    # per value head rmsnorm, output gate, projection
    o = _rms(o, w(p + "o_norm.weight"), c["eps"]) * _sigmoid(gt.reshape(T, Hv, Dv))
    return o.reshape(T, Hv * Dv) @ w(p + "o_proj.weight").T


def forward(c, weights, state, tokens, dtype=None):
    """Feed ``tokens`` after ``state`` (updated in place); logits (T, V) of the new tokens.
    Projections run over all T tokens at once; recurrences run token by token."""
    if dtype is None:
        dtype = state.keys[0].dtype if state.keys else state.S[0].dtype
    w = weights if isinstance(weights, Weights) else Weights(weights, dtype)
    tokens = np.asarray(tokens, dtype=np.int64)
    if state.position + len(tokens) > c["context"]:
        raise ValueError("sequence exceeds context")
    positions = np.arange(state.position, state.position + len(tokens))
    x = w("model.embed_tokens.weight")[tokens]                               # (T, D)
    for s in plan(c):
        p = f"model.layers.{s.layer}."
        h = _rms(x, w(p + "input_layernorm.weight"), c["eps"])
        if s.slot >= 0:
            x = x + xsa_mixer(c, w, p + "self_attn.", h, state, s.slot, positions)
        else:
            x = x + gdn_mixer(c, w, p + "linear_attn.", h, state, s.state)
        # shared SwiGLU MLP after every step
        h = _rms(x, w(p + "post_attention_layernorm.weight"), c["eps"])
        x = x + (_silu(h @ w(p + "mlp.gate_proj.weight").T) * (h @ w(p + "mlp.up_proj.weight").T)) \
            @ w(p + "mlp.down_proj.weight").T
    state.position += len(tokens)
    h = _rms(x, w("model.norm.weight"), c["eps"])
    head = w("model.embed_tokens.weight") if c["tied"] else w("lm_head.weight")
    return h @ head.T


def step(c, weights, state, token):
    """One token; logits (V,)."""
    return forward(c, weights, state, [token])[0]


def logits(c, weights, tokens, dtype=np.float64, kv_round=None):
    """Logits (T, V) at every position of ``tokens`` from a fresh state
    (``kv_round``: the cache's keys and values rounded to that dtype)."""
    return forward(c, weights, init_state(c, dtype, kv_round), tokens)


def greedy(c, weights, prompt, n, dtype=np.float64):
    """``n`` argmax continuation tokens (prefill the prompt, then one token at a time)."""
    state = init_state(c, dtype)
    w = Weights(weights, dtype)
    last = forward(c, w, state, prompt)[-1]
    out = []
    for _ in range(n):
        out.append(int(np.argmax(last)))
        if len(out) < n:
            last = forward(c, w, state, [out[-1]])[-1]
    return out


def nll(c, weights, tokens, dtype=np.float64):
    """Mean negative log-likelihood of tokens[1:] (SurjoModel::nll, 3310-3336)."""
    tokens = np.asarray(tokens, dtype=np.int64)
    if len(tokens) < 2:
        raise ValueError("nll needs at least 2 tokens")
    z = logits(c, weights, tokens, dtype)[:-1].astype(np.float64)
    m = z.max(axis=-1, keepdims=True)
    logz = m[:, 0] + np.log(np.exp(z - m).sum(axis=-1))
    return float(np.mean(logz - z[np.arange(len(z)), tokens[1:]]))
