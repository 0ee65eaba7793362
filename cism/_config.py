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
    for plain RoPE, ("linear", factor) or ("llama3", factor,
    low_freq_factor, high_freq_factor, original_max_position_embeddings)
    from rope_scaling (transformers 4) or rope_parameters (transformers 5),
    or ("factors", f0, f1, ...) from cism's own key rope_freq_factors (a
    GGUF file's rope_freqs tensor: one divisor per rotary frequency). Other
    kinds (yarn, dynamic, longrope) are refused, never ignored."""
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
        elif kind not in ("default", None):
            raise ValueError(f"config.json {where} type {kind!r} is not implemented "
                             "(cism implements plain, linear and llama3 RoPE)")
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


def rope_divisors(rope, theta, head_dim):
    """Per rotary frequency j, the divisor of 1 / theta^(2j/head_dim) that
    the scaling asks for (a float32 array), or None for plain RoPE. llama3
    (Meta's formula, as transformers and llama.cpp apply it): wavelengths
    shorter than original / high_freq_factor keep their frequency, longer
    than original / low_freq_factor divide it by factor, and the band
    between blends the two."""
    if not rope:
        return None
    half = head_dim // 2
    kind = rope[0]
    sizes = {"linear": 2, "llama3": 5, "factors": half + 1}
    if kind not in sizes:
        raise ValueError(f"rope_scaling kind {kind!r} is not linear, llama3 or factors")
    if len(rope) != sizes[kind]:
        what = f"{len(rope) - 1} factors; head_dim {head_dim} needs {half}" if kind == "factors" else rope
        raise ValueError(f"rope_scaling {kind} has {what}")
    for value in rope[1:]:
        positive_float(value, "rope_freq_factors" if kind == "factors" else f"rope_scaling {kind}")
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
    return {"rope_freq_factors": list(rope[1:])}


def checked_elements(shape):
    n = 1
    for d in shape:
        n *= int(d)
    return n
