"""Helpers shared by the model families' Config classes: the spec's bound
checks, with messages that name the field, its bounds and the value."""
import math

import numpy as np

MAX_WEIGHT_BYTES = 64 << 30
MAX_KV_BYTES = 8 << 30


def is_int(value):
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def bound(value, maximum, name):
    """1 <= value <= maximum, else ValueError '<name> is outside supported bounds'."""
    if not is_int(value):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if not 1 <= value <= maximum:
        raise ValueError(f"{name} is outside supported bounds [1, {maximum}]: got {value}")
    return int(value)


def hexfloat(value):
    """`value` as C's printf("%a") writes a double, which is what the spec's
    `std::hexfloat` produces: no trailing zero hex digits ("0x1.388p+13", where
    Python's float.hex() pads to "0x1.3880000000000p+13"), subnormals as
    "0x0.<digits>p-1022", zeros as "0x0p+0", and "inf"/"nan" with their sign
    (glibc writes "-nan" for a NaN whose sign bit is set)."""
    value = float(value)
    sign = "-" if math.copysign(1.0, value) < 0 else ""
    if math.isnan(value):
        return sign + "nan"
    if math.isinf(value):
        return sign + "inf"
    mantissa, exponent = value.hex().lstrip("-").split("p")
    mantissa = mantissa.rstrip("0").rstrip(".") if "." in mantissa else mantissa
    return f"{sign}{mantissa}p{exponent}"


_C_SPACE = " \t\n\v\f\r"   # isspace() in the C locale
_LLONG_MIN, _LLONG_MAX = -(1 << 63), (1 << 63) - 1


def stoll(text):
    """`text` read as C++'s std::stoll reads it (strtoll, base 10): leading C
    whitespace, an optional sign, then the longest run of ASCII digits; the
    rest is ignored ("12abc" is 12). ValueError("stoll") when there is no digit
    (std::invalid_argument) or the value is outside long long
    (std::out_of_range); libstdc++'s what() is "stoll" for both."""
    i, n = 0, len(text)
    while i < n and text[i] in _C_SPACE:
        i += 1
    sign = 1
    if i < n and text[i] in "+-":
        sign = -1 if text[i] == "-" else 1
        i += 1
    start = i
    while i < n and "0" <= text[i] <= "9":
        i += 1
    if i == start:
        raise ValueError("stoll")
    value = sign * int(text[start:i])
    if not _LLONG_MIN <= value <= _LLONG_MAX:
        raise ValueError("stoll")
    return value


def positive_float(value, name):
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    value = float(np.float32(value))
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be finite and positive, got {value!r}")
    return value


def flag(value, name):
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be true or false, got {value!r}")
    return bool(value)


def hf_get(d, key, default=None, required=True):
    """A key of an HF config dict; a clear error when it is missing."""
    if key in d and d[key] is not None:
        return d[key]
    if required and default is None:
        raise ValueError(f"config.json is missing {key!r}")
    return default


def hf_rope_theta(d, default=10000.0):
    """rope_theta, or rope_parameters.rope_theta as transformers 5 writes it,
    for a family with plain RoPE only: any rope scaling is refused, never
    ignored."""
    theta, rope = hf_rope(d, default)
    if rope:
        raise ValueError(f"config.json rope scaling {rope[0]!r} is not implemented for "
                         f"{d.get('model_type')!r} (only plain RoPE)")
    return theta


def _rope_number(block, key, where, default=None):
    value = block.get(key, default)
    if value is None:
        raise ValueError(f"config.json {where} has no {key!r}")
    return positive_float(value, f"{where}.{key}")


def hf_rope(d, default=10000.0):
    """(rope_theta, rope_scaling) of an HF config dict. rope_scaling is ()
    for plain RoPE, ("linear", factor), ("llama3", factor,
    low_freq_factor, high_freq_factor, original_max_position_embeddings) or
    ("yarn", factor, original_max_position_embeddings, beta_fast,
    beta_slow, attention_factor, truncate) from rope_scaling (transformers
    4) or rope_parameters (transformers 5), or ("factors", f0, f1, ...) from
    cism's own key rope_freq_factors (a GGUF file's rope_freqs tensor: one
    divisor per rotary frequency). Other kinds (dynamic, longrope) are
    refused, never ignored."""
    params = d.get("rope_parameters")
    scaling = d.get("rope_scaling")
    theta = d.get("rope_theta")
    kinds = []
    for block, where in ((params, "rope_parameters"), (scaling, "rope_scaling")):
        if block is None:
            continue
        if not isinstance(block, dict):
            raise ValueError(f"config.json {where} must be an object, got {block!r}")
        kind = block.get("rope_type", block.get("type", "default"))
        if kind == "linear":
            factor = _rope_number(block, "factor", where)
            kinds.append(() if factor == 1.0 else ("linear", factor))
        elif kind == "llama3":
            orig = block.get("original_max_position_embeddings", 8192)
            if not is_int(orig) or orig <= 0:
                raise ValueError(f"config.json {where}.original_max_position_embeddings must be a "
                                 f"positive integer, got {orig!r}")
            low = _rope_number(block, "low_freq_factor", where, 1.0)
            high = _rope_number(block, "high_freq_factor", where, 4.0)
            if not high > low:
                raise ValueError(f"config.json {where} needs high_freq_factor > low_freq_factor, "
                                 f"got {high} and {low}")
            kinds.append(("llama3", _rope_number(block, "factor", where, 8.0), low, high, int(orig)))
        elif kind == "yarn":
            kinds.append(_hf_yarn(d, block, where))
        elif kind not in ("default", None):
            raise ValueError(f"config.json {where} type {kind!r} is not implemented "
                             "(cism implements plain, linear, llama3 and yarn RoPE)")
        if theta is None and block.get("rope_theta") is not None:
            theta = block["rope_theta"]
    kinds = [k for k in kinds if k]
    if len(set(kinds)) > 1:
        raise ValueError(f"config.json rope_scaling and rope_parameters disagree: {kinds}")
    rope = kinds[0] if kinds else ()
    factors = d.get("rope_freq_factors")
    if factors is not None:
        if rope:
            raise ValueError("rope_freq_factors and a rope scaling type are both given")
        values = [positive_float(f, "rope_freq_factors") for f in factors]
        rope = ("factors", *values)
    return (default if theta is None else theta), rope


def _yarn_mscale(factor, mscale=1.0):
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _hf_yarn(d, block, where):
    """YaRN's parameters with transformers' defaults (_compute_yarn_parameters):
    original_max_position_embeddings defaults to max_position_embeddings and
    factor to their ratio; beta_fast 32, beta_slow 1; attention_factor (which
    multiplies cos and sin) to 0.1 ln(factor) + 1, or the ratio of mscale to
    mscale_all_dim (DeepSeek's form) when both are given; truncate True."""
    orig = block.get("original_max_position_embeddings", d.get("max_position_embeddings"))
    if not is_int(orig) or orig <= 0:
        raise ValueError(f"config.json {where}.original_max_position_embeddings must be a "
                         f"positive integer, got {orig!r}")
    factor = block.get("factor")
    if factor is None:
        factor = positive_float(hf_get(d, "max_position_embeddings"), "max_position_embeddings") / orig
    factor = positive_float(factor, f"{where}.factor")
    # transformers reads a beta of 0 (or null) as its default: `or 32`
    fast = positive_float(block.get("beta_fast") or 32.0, f"{where}.beta_fast")
    slow = positive_float(block.get("beta_slow") or 1.0, f"{where}.beta_slow")
    attention = block.get("attention_factor")
    if attention is None:
        mscale, mscale_all = block.get("mscale"), block.get("mscale_all_dim")
        if mscale and mscale_all:
            attention = _yarn_mscale(factor, positive_float(mscale, f"{where}.mscale")) / \
                _yarn_mscale(factor, positive_float(mscale_all, f"{where}.mscale_all_dim"))
        else:
            attention = _yarn_mscale(factor)
    attention = positive_float(attention, f"{where}.attention_factor")
    truncate = flag(block.get("truncate", True), f"{where}.truncate")
    if factor == 1.0 and attention == 1.0:
        return ()       # no interpolation, no attention factor: plain RoPE
    return ("yarn", factor, int(orig), fast, slow, attention, truncate)


def _yarn_divisors(factor, orig, fast, slow, truncate, theta, head_dim):
    """transformers' YaRN blend as divisors: frequency j keeps its value
    (extrapolation) below the correction range [low, high], is divided by
    factor (interpolation) above it, and ramps linearly between. The ramp is
    computed in float32 as transformers does."""
    if theta == 1.0:    # every frequency is 1: the ramp's dimensions divide by ln(theta) = 0
        raise ValueError("rope_scaling yarn needs rope_theta other than 1")
    def correction_dim(rotations):
        return head_dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))
    low, high = correction_dim(fast), correction_dim(slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001      # transformers' guard against a zero-width ramp
    ramp = (np.arange(head_dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low)
    keep = (np.float32(1) - np.clip(ramp, 0, 1)).astype(np.float64)   # 1: extrapolate, 0: interpolate
    return (1.0 / ((1.0 - keep) / factor + keep)).astype(np.float32)


def rope_attention_factor(rope):
    """What cos and sin are multiplied by: YaRN's attention factor, else 1."""
    return float(rope[5]) if rope and rope[0] == "yarn" else 1.0


def rope_divisors(rope, theta, head_dim):
    """Per rotary frequency j, the divisor of 1 / theta^(2j/head_dim) that
    the scaling asks for (a float32 array), or None for plain RoPE. llama3
    (Meta's formula, as transformers and llama.cpp apply it): wavelengths
    shorter than original / high_freq_factor keep their frequency, longer
    than original / low_freq_factor divide it by factor, and the band
    between blends the two. yarn: _yarn_divisors (its attention factor is
    rope_attention_factor's)."""
    if not rope:
        return None
    half = head_dim // 2
    kind = rope[0]
    sizes = {"linear": 2, "llama3": 5, "yarn": 7, "factors": half + 1}
    if kind not in sizes:
        raise ValueError(f"rope_scaling kind {kind!r} is not linear, llama3, yarn or factors")
    if len(rope) != sizes[kind]:
        what = f"{len(rope) - 1} factors; head_dim {head_dim} needs {half}" if kind == "factors" else rope
        raise ValueError(f"rope_scaling {kind} has {what}")
    for value in rope[1:6] if kind == "yarn" else rope[1:]:
        positive_float(value, "rope_freq_factors" if kind == "factors" else f"rope_scaling {kind}")
    if kind == "yarn":
        _, factor, orig, fast, slow, _, truncate = rope
        return _yarn_divisors(factor, orig, fast, slow, flag(truncate, "rope_scaling yarn truncate"),
                              float(theta), head_dim)
    if kind == "linear":
        return np.full(half, rope[1], np.float32)
    if kind == "factors":
        return np.array(rope[1:], np.float32)
    _, factor, low, high, orig = rope
    inv = 1.0 / np.float32(theta) ** (np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim))
    out = np.empty(half, np.float32)
    for j, freq in enumerate(inv.astype(np.float64)):
        wavelen = 2 * math.pi / freq
        if wavelen < orig / high:
            out[j] = 1.0
        elif wavelen > orig / low:
            out[j] = factor
        else:
            smooth = (orig / wavelen - low) / (high - low)
            out[j] = 1.0 / ((1 - smooth) / factor + smooth)
    return out


def rope_to_hf(rope):
    """rope_scaling as config.json writes it (the inverse of hf_rope)."""
    if not rope:
        return {}
    if rope[0] == "linear":
        return {"rope_scaling": {"rope_type": "linear", "factor": rope[1]}}
    if rope[0] == "llama3":
        return {"rope_scaling": {"rope_type": "llama3", "factor": rope[1], "low_freq_factor": rope[2],
                                 "high_freq_factor": rope[3], "original_max_position_embeddings": rope[4]}}
    if rope[0] == "yarn":
        return {"rope_scaling": {"rope_type": "yarn", "factor": rope[1], "original_max_position_embeddings": rope[2],
                                 "beta_fast": rope[3], "beta_slow": rope[4], "attention_factor": rope[5],
                                 "truncate": bool(rope[6])}}
    return {"rope_freq_factors": list(rope[1:])}


def checked_elements(shape):
    n = 1
    for d in shape:
        n *= int(d)
    return n
