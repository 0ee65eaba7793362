"""NumPy reference for karpathy/llama2.c checkpoints (legacy ``.bin``, as ``run.c`` reads them).

File layout (little-endian)
---------------------------
Header: 7 int32 ``dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len``.
A negative ``vocab_size`` means the classifier is NOT shared: its |vocab_size| x dim
matrix ``wcls`` follows the other tensors. Then fp32 tensors, each linear stored
(out, in) row-major because ``run.c``'s ``matmul(xout, x, w, n, d)`` computes
``xout[i] = sum_j w[i*n + j] x[j]``:

    token_embedding  (vocab, dim)
    rms_att          (n_layers, dim)
    wq               (n_layers, n_heads*head_size, dim)
    wk               (n_layers, n_kv_heads*head_size, dim)
    wv               (n_layers, n_kv_heads*head_size, dim)
    wo               (n_layers, dim, n_heads*head_size)
    rms_ffn          (n_layers, dim)
    w1               (n_layers, hidden_dim, dim)
    w2               (n_layers, dim, hidden_dim)
    w3               (n_layers, hidden_dim, dim)
    rms_final        (dim,)
    freq_cis_real    (seq_len, head_size/2)   legacy, unused by run.c (it recomputes RoPE)
    freq_cis_imag    (seq_len, head_size/2)   legacy, unused
    wcls             (vocab, dim)             only when vocab_size < 0

with ``head_size = dim / n_heads``.

Forward pass of ``run.c`` (token at position ``pos``)
-----------------------------------------------------
    rmsnorm(x; g)  = g * x / sqrt(mean(x^2) + 1e-5)
    x              = token_embedding[token]
    per layer:
      h            = rmsnorm(x; rms_att)
      q, k, v      = wq h, wk h, wv h
      RoPE on *interleaved* pairs: for every even i, with j = i mod head_size,
            a = pos * 10000^(-j/head_size),
            (u_i, u_{i+1}) <- (u_i cos a - u_{i+1} sin a, u_i sin a + u_{i+1} cos a)
            (q over all dim entries, k over its kv_dim entries)
      head m attends to KV head m // (n_heads/n_kv_heads) over positions 0..pos with
            softmax(q_m . k_s / sqrt(head_size)) weights
      x           += wo concat(att)
      h            = rmsnorm(x; rms_ffn)
      x           += w2 (silu(w1 h) * w3 h)
    logits         = wcls rmsnorm(x; rms_final)      (wcls = token_embedding when shared)

Tokenizer ``tokenizer.bin``: int32 ``max_token_length``, then per token
``float32 score, int32 len, len bytes``. A piece of the form ``<0xHH>`` stands for the
raw byte HH (run.c's decode).
"""
import math
import re
import struct

import numpy as np

__all__ = ["load_checkpoint", "load_tokenizer", "logits", "greedy", "decode"]

_HEADER = ("dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "seq_len")


def load_checkpoint(path):
    """(config dict, weights dict of float32 arrays) from a legacy llama2.c ``.bin``."""
    with open(path, "rb") as f:
        raw = f.read()
    config = dict(zip(_HEADER, struct.unpack("<7i", raw[:28])))
    config["shared_classifier"] = config["vocab_size"] > 0
    config["vocab_size"] = abs(config["vocab_size"])
    dim, hidden, layers = config["dim"], config["hidden_dim"], config["n_layers"]
    heads, kv_heads, vocab, seq_len = (config["n_heads"], config["n_kv_heads"],
                                       config["vocab_size"], config["seq_len"])
    head_size = dim // heads
    shapes = [
        ("token_embedding", (vocab, dim)),
        ("rms_att", (layers, dim)),
        ("wq", (layers, heads * head_size, dim)),
        ("wk", (layers, kv_heads * head_size, dim)),
        ("wv", (layers, kv_heads * head_size, dim)),
        ("wo", (layers, dim, heads * head_size)),
        ("rms_ffn", (layers, dim)),
        ("w1", (layers, hidden, dim)),
        ("w2", (layers, dim, hidden)),
        ("w3", (layers, hidden, dim)),
        ("rms_final", (dim,)),
        ("freq_cis_real", (seq_len, head_size // 2)),
        ("freq_cis_imag", (seq_len, head_size // 2)),
    ]
    if not config["shared_classifier"]:
        shapes.append(("wcls", (vocab, dim)))
    data = np.frombuffer(raw, dtype="<f4", offset=28)
    weights, offset = {}, 0
    for name, shape in shapes:
        size = math.prod(shape)
        if offset + size > data.size:
            raise ValueError(f"{path}: file too short for {name}")
        weights[name] = data[offset:offset + size].reshape(shape)
        offset += size
    if offset != data.size:
        raise ValueError(f"{path}: {data.size - offset} trailing floats")
    return config, weights


def load_tokenizer(path, vocab_size):
    """List of ``vocab_size`` byte strings (the pieces) from a llama2.c ``tokenizer.bin``."""
    with open(path, "rb") as f:
        raw = f.read()
    offset, pieces = 4, []                                   # skip max_token_length
    for _ in range(vocab_size):
        _score, length = struct.unpack_from("<fi", raw, offset)
        offset += 8
        pieces.append(raw[offset:offset + length])
        offset += length
    return pieces


def decode(pieces, tokens, strip_after_bos=False):
    """Concatenate the pieces of ``tokens`` as text. ``<0xHH>`` pieces are raw bytes.
    run.c drops the leading space of the piece that follows BOS (token 1); that is
    ``strip_after_bos=True``; the default keeps every piece as stored."""
    out, prev = bytearray(), None
    for t in tokens:
        piece = pieces[t]
        if strip_after_bos and prev == 1 and piece.startswith(b" "):
            piece = piece[1:]
        m = re.fullmatch(rb"<0x([0-9A-Fa-f]{2})>", piece)
        out += bytes([int(m.group(1), 16)]) if m else piece
        prev = t
    return out.decode("utf-8", errors="replace")


def _rmsnorm(x, g):
    return g * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-5))


def _rope_interleaved(u, positions, head_size):
    """run.c RoPE: rotate pairs (2i, 2i+1); frequency from the index within the head.
    u: (T, width) with width a multiple of head_size; positions: (T,)."""
    j = np.arange(0, u.shape[1], 2) % head_size                              # (width/2,)
    angle = positions[:, None].astype(np.float64) * 10000.0 ** (-j / head_size)
    cos, sin = np.cos(angle).astype(u.dtype), np.sin(angle).astype(u.dtype)
    a, b = u[:, 0::2], u[:, 1::2]
    out = np.empty_like(u)
    out[:, 0::2] = a * cos - b * sin
    out[:, 1::2] = a * sin + b * cos
    return out


def logits(config, weights, tokens, dtype=np.float64):
    """Logits (T, vocab) at every position of ``tokens`` (all positions at once)."""
    w = {k: np.asarray(v).astype(dtype) for k, v in weights.items()}
    tokens = np.asarray(tokens, dtype=np.int64)
    T = len(tokens)
    dim, heads, kv_heads = config["dim"], config["n_heads"], config["n_kv_heads"]
    hs = dim // heads
    positions = np.arange(T)
    future = np.arange(T)[None, :] > positions[:, None]                      # (T, T)
    x = w["token_embedding"][tokens]                                         # (T, dim)
    for l in range(config["n_layers"]):
        # attention rmsnorm, qkv, rotate
        h = _rmsnorm(x, w["rms_att"][l])
        q = _rope_interleaved(h @ w["wq"][l].T, positions, hs).reshape(T, heads, hs)
        k = _rope_interleaved(h @ w["wk"][l].T, positions, hs).reshape(T, kv_heads, hs)
        v = (h @ w["wv"][l].T).reshape(T, kv_heads, hs)
        # causal GQA attention
        k = np.repeat(k, heads // kv_heads, axis=1)
        v = np.repeat(v, heads // kv_heads, axis=1)
        scores = np.einsum("thd,shd->hts", q, k) / math.sqrt(hs)              # (heads, T, T)
        scores = np.where(future[None], -np.inf, scores)
        p = np.exp(scores - scores.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)
        att = np.einsum("hts,shd->thd", p, v).reshape(T, dim)
        x = x + att @ w["wo"][l].T
        # SwiGLU FFN
        h = _rmsnorm(x, w["rms_ffn"][l])
        g = h @ w["w1"][l].T
        x = x + (g / (1.0 + np.exp(-g)) * (h @ w["w3"][l].T)) @ w["w2"][l].T
    h = _rmsnorm(x, w["rms_final"])
    wcls = w["token_embedding"] if config["shared_classifier"] else w["wcls"]
    return h @ wcls.T


def greedy(config, weights, prompt, n, dtype=np.float64):
    """``n`` argmax tokens after ``prompt``. Recomputes the full sequence each step
    (fine for stories260K-sized models and keeps this file free of cache logic)."""
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(int(np.argmax(logits(config, weights, tokens, dtype)[-1])))
    return tokens[len(prompt):]
