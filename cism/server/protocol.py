"""The OpenAI API's request bodies, checked, and its response shapes.

Every problem with a request becomes an ``APIError`` (HTTP status, OpenAI
error type, code, param) that the app turns into
``{"error": {"message", "type", "param", "code"}}``. Nothing here touches
the engine.
"""
import math
import secrets
import time

from cism._config import is_int

MAX_N = 16
MAX_STOPS = 16
MAX_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5


class APIError(Exception):
    """A request the server answers with an error body."""

    def __init__(self, status, message, type_="invalid_request_error", param=None, code=None,
                 headers=None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self):
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad(message, param=None, code=None):
    return APIError(400, message, "invalid_request_error", param, code)


# ---------------------------------------------------------------- fields ---

def _number(body, name, default, lo, hi, lo_open=False):
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise bad(f"'{name}' must be a number, got {type(v).__name__}", name, "invalid_type")
    v = float(v)
    if not math.isfinite(v) or v > hi or v < lo or (lo_open and v == lo):
        left = "(" if lo_open else "["
        raise bad(f"'{name}' must be in {left}{lo}, {hi}], got {v}", name, "invalid_value")
    return v


def _integer(body, name, default, lo, hi):
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if not is_int(v):
        raise bad(f"'{name}' must be an integer, got {type(v).__name__}", name, "invalid_type")
    if not lo <= v <= hi:
        raise bad(f"'{name}' must be in [{lo}, {hi}], got {v}", name, "invalid_value")
    return int(v)


def _boolean(body, name, default=False):
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(f"'{name}' must be a boolean, got {type(v).__name__}", name, "invalid_type")
    return v


def _string(body, name, default=None):
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, str):
        raise bad(f"'{name}' must be a string, got {type(v).__name__}", name, "invalid_type")
    return v


def _stops(body):
    v = body.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise bad("'stop' must be a string or a list of strings", "stop", "invalid_type")
    if len(v) > MAX_STOPS:
        raise bad(f"'stop' takes at most {MAX_STOPS} strings, got {len(v)}", "stop", "invalid_value")
    return [s for s in v if s]


# ------------------------------------------------------------- sampling ---

def sampling(body, vocab):
    """The knobs every generation route shares, as engine parameters, plus
    n, stops and the OpenAI penalties (declined unless 0)."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object", None, "invalid_type")
    for name in ("presence_penalty", "frequency_penalty"):
        v = _number(body, name, 0.0, -2.0, 2.0)
        if v != 0.0:
            raise bad(f"'{name}' is not supported by cism (use 'repetition_penalty'); send 0 or omit it",
                      name, "unsupported_parameter")
    if body.get("logit_bias"):
        raise bad("'logit_bias' is not supported by cism", "logit_bias", "unsupported_parameter")
    for name in ("tools", "functions", "tool_choice", "function_call"):
        if body.get(name) not in (None, [], "none"):
            raise bad(f"'{name}' is not supported by cism", name, "unsupported_parameter")
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise bad("'response_format' other than {\"type\": \"text\"} is not supported by cism",
                  "response_format", "unsupported_parameter")
    _string(body, "user")
    out = {
        "temperature": _number(body, "temperature", 1.0, 0.0, 2.0),
        "top_p": _number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        "top_k": _integer(body, "top_k", 0, 0, vocab),
        "min_p": _number(body, "min_p", 0.0, 0.0, 1.0),
        "repetition_penalty": _number(body, "repetition_penalty", 1.0, 0.0, 10.0, lo_open=True),
        "spec_k": _integer(body, "spec_k", 0, 0, 16),
    }
    seed = body.get("seed")
    if seed is None:
        out["seed"] = secrets.randbits(63)
    else:
        out["seed"] = _integer(body, "seed", 0, -2**63, 2**64 - 1) % 2**64
    if out["spec_k"] == 1:
        raise bad("'spec_k' must be 0 (off) or in [2, 16]", "spec_k", "invalid_value")
    if out["spec_k"] and (out["temperature"] != 0 or out["repetition_penalty"] != 1):
        raise bad("'spec_k' needs greedy decoding: temperature 0 and no repetition_penalty",
                  "spec_k", "invalid_value")
    n = _integer(body, "n", 1, 1, MAX_N)
    best_of = body.get("best_of")
    if best_of is not None and _integer(body, "best_of", n, 1, MAX_N) != n:
        raise bad("'best_of' other than n is not supported by cism", "best_of", "unsupported_parameter")
    priority = _integer(body, "priority", 0, -2**31, 2**31 - 1)
    out["ignore_eos"] = _boolean(body, "ignore_eos")
    return out, n, _stops(body), priority


def max_tokens(body, names=("max_completion_tokens", "max_tokens")):
    for name in names:
        if body.get(name) is not None:
            return _integer(body, name, None, 0, 1 << 30), name
    return None, None


def stream_flags(body):
    stream = _boolean(body, "stream")
    opts = body.get("stream_options")
    usage = False
    if opts is not None:
        if not isinstance(opts, dict):
            raise bad("'stream_options' must be an object", "stream_options", "invalid_type")
        if not stream:
            raise bad("'stream_options' needs 'stream': true", "stream_options", "invalid_value")
        usage = _boolean(opts, "include_usage")
    return stream, usage


# ----------------------------------------------------------------- chat ---

ROLES = ("system", "developer", "user", "assistant", "tool")


def chat_messages(body):
    """OpenAI messages as the chat template's {"role", "content"} dicts
    (text parts joined; "developer" is sent as "system")."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("'messages' must be a non-empty list", "messages", "invalid_type")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}] must be an object", f"messages[{i}]", "invalid_type")
        role = m.get("role")
        if role not in ROLES:
            raise bad(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}",
                      f"messages[{i}].role", "invalid_value")
        content = m.get("content")
        if content is None:
            content = ""
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad(f"messages[{i}].content[{j}]: cism takes text parts only "
                              "({\"type\": \"text\", \"text\": ...})",
                              f"messages[{i}].content", "unsupported_content")
                parts.append(part["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise bad(f"messages[{i}].content must be a string or a list of text parts",
                      f"messages[{i}].content", "invalid_type")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out


def chat_logprobs(body):
    want = _boolean(body, "logprobs")
    top = _integer(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS)
    if top and not want:
        raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs", "invalid_value")
    return want, top


# ---------------------------------------------------------- completions ---

def completion_prompts(body, vocab):
    """The prompts of /v1/completions: a string, a list of strings, a list
    of token ids, or a list of such lists. Returns [(text or None, ids or None)]."""
    p = body.get("prompt")
    if p is None:
        raise bad("'prompt' is required", "prompt", "missing_required_parameter")
    if isinstance(p, str):
        return [(p, None)]
    if isinstance(p, list) and p:
        if all(isinstance(x, str) for x in p):
            return [(x, None) for x in p]
        if all(is_int(x) for x in p):
            return [(None, _ids(p, vocab, "prompt"))]
        if all(isinstance(x, list) for x in p):
            return [(None, _ids(x, vocab, f"prompt[{i}]")) for i, x in enumerate(p)]
    raise bad("'prompt' must be a string, a list of strings, a list of token ids or a list of such lists",
              "prompt", "invalid_type")


def _ids(values, vocab, param):
    if not values:
        raise bad(f"'{param}' must hold at least one token", param, "invalid_value")
    for v in values:
        if not is_int(v) or not 0 <= v < vocab:
            raise bad(f"'{param}': token id {v!r} is outside the vocabulary (vocab_size={vocab})",
                      param, "invalid_value")
    return [int(v) for v in values]


def completion_logprobs(body):
    v = body.get("logprobs")
    if v is None or v is False:
        return False, 0
    if v is True:
        return True, 0
    return True, _integer(body, "logprobs", 0, 0, MAX_COMPLETION_LOGPROBS)


# ------------------------------------------------------------ responses ---

def new_id(prefix):
    return f"{prefix}-{secrets.token_hex(12)}"


def now():
    return int(time.time())


def finish_reason(engine_reason, stop_hit):
    if stop_hit or engine_reason == "stop":
        return "stop"
    return "length" if engine_reason == "length" else engine_reason


def usage(prompt_tokens, completion_tokens, cached=0):
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}
