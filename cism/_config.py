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
    """rope_theta, or rope_parameters.rope_theta as transformers 5 writes it;
    refuses rope scaling we do not implement instead of ignoring it."""
    params = d.get("rope_parameters")
    scaling = d.get("rope_scaling")
    theta = d.get("rope_theta")
    for block, where in ((params, "rope_parameters"), (scaling, "rope_scaling")):
        if block is None:
            continue
        if not isinstance(block, dict):
            raise ValueError(f"config.json {where} must be an object, got {block!r}")
        kind = block.get("rope_type", block.get("type", "default"))
        if kind not in ("default", None):
            factor = block.get("factor", 1.0)
            if not (kind == "linear" and factor == 1.0):
                raise ValueError(f"config.json {where} type {kind!r} is not implemented "
                                 "(only plain RoPE is supported)")
        if theta is None and block.get("rope_theta") is not None:
            theta = block["rope_theta"]
    return default if theta is None else theta


def checked_elements(shape):
    n = 1
    for d in shape:
        n *= int(d)
    return n
