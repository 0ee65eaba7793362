"""Vocabulary source: the `tokenizer.ggml.*` metadata of a GGUF file, read by
the loaders' one bounded GGUF reader (cism/loaders/gguf_file.py), so a
malformed file fails with the same message whether a model or only its
tokenizer is loaded. `tokenizer.ggml.model` "gpt2" is byte-level BPE with the
pre-tokenizer `tokenizer.ggml.pre` names; "llama" is llama.cpp's SentencePiece.
Like every vocabulary source, it returns the keyword arguments of `Tokenizer`
(cism/tokenizers/core.py); `Tokenizer.from_gguf` wraps it.
"""
from pathlib import Path

import numpy as np

from cism.loaders.gguf_file import read_gguf_metadata
from cism.tokenizers.bpe import PRE_TOKENIZERS, byte_decode, check_backend, make_bpe
from cism.tokenizers.files import eos_list, expect
from cism.tokenizers.spm import BYTE_TOKEN, SPACE_MARK, LlamaSPM, piece_bytes

# GGUF tokenizer.ggml.token_type values (llama.cpp LLAMA_TOKEN_TYPE_*).
_TT_NORMAL, _TT_UNKNOWN, _TT_CONTROL, _TT_USER, _TT_UNUSED, _TT_BYTE = 1, 2, 3, 4, 5, 6


def from_gguf(path, backend="python"):
    """The tokenizer stored in a GGUF file's `tokenizer.ggml.*` metadata.
    `backend` (BPE vocabularies only): "python" or "hf", same ids."""
    check_backend(backend)
    path = Path(path)
    # The loader's bounded reader: numeric arrays come back as numpy arrays and
    # vocabulary strings with surrogateescape; plain lists keep the checks below simple.
    meta = {k: v.tolist() if isinstance(v, np.ndarray) else v
            for k, v in read_gguf_metadata(path).items()}

    def get(key, types, default=None, required=False):
        if key not in meta:
            expect(not required, path, f"GGUF metadata has no {key}")
            return default
        v = meta[key]
        expect(isinstance(v, types) and not (isinstance(v, bool) and bool not in types),
               path, f"GGUF {key} has the wrong type ({type(v).__name__})")
        return v

    def get_list(key, elem, label, n=None, required=False):
        v = get(key, (list,), None, required)
        if v is None:
            return None
        expect(all(isinstance(x, elem) for x in v), path, f"GGUF {key} must be a list of {label}")
        expect(n is None or len(v) == n, path,
               f"GGUF {key} has {len(v)} entries, tokenizer.ggml.tokens has {n}")
        return v

    model = get("tokenizer.ggml.model", (str,), required=True)
    tokens = get_list("tokenizer.ggml.tokens", str, "strings", required=True)
    n = len(tokens)
    expect(n > 0, path, "GGUF tokenizer.ggml.tokens is empty")
    bad = _first_non_utf8(tokens)
    expect(bad is None, path, f"GGUF tokenizer.ggml.tokens[{bad}] is not valid UTF-8")
    types = get_list("tokenizer.ggml.token_type", int, "integers", n) or [_TT_NORMAL] * n
    # llama.cpp renames empty tokens so they can be looked up
    tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]

    def token_id(key, default):
        v = get(key, (int,), default)
        if v is not None:
            expect(0 <= v < n, path, f"GGUF {key} = {v} is outside the vocabulary (size {n})")
        return v

    if model == "gpt2":
        merges_raw = get_list("tokenizer.ggml.merges", str, "strings", required=True)
        merges = []
        for k, m in enumerate(merges_raw):
            # llama.cpp splits at the first space after the first character
            pos = m.find(" ", 1)
            expect(pos > 0, path,
                   f"GGUF tokenizer.ggml.merges[{k}] = {m!r} is not 'left right'")
            merges.append((m[:pos], m[pos + 1:]))
        pre_name = get("tokenizer.ggml.pre", (str,), "default")
        pre = PRE_TOKENIZERS.get(pre_name)
        known = ", ".join(sorted(PRE_TOKENIZERS))
        expect(pre is not None, path,
               f"unsupported tokenizer.ggml.pre {pre_name!r} (known: {known})")
        vocab = {t: i for i, t in enumerate(tokens)}
        encoder = make_bpe(vocab, merges, pre, backend, path)
        kind, strip, add_bos_default = "bpe", False, pre.add_bos
        pieces = [t.encode("utf-8") if ty in (_TT_UNKNOWN, _TT_CONTROL, _TT_USER)
                  else byte_decode(t) for t, ty in zip(tokens, types)]
        bos_default = eos_default = None
    elif model == "llama":
        scores = get_list("tokenizer.ggml.scores", (int, float), "numbers", n) or [0.0] * n
        if "tokenizer.ggml.token_type" not in meta:
            types = [_TT_BYTE if BYTE_TOKEN.fullmatch(t) else _TT_NORMAL for t in tokens]
        unk_id = token_id("tokenizer.ggml.unknown_token_id", 0)
        encoder = LlamaSPM(tokens, [float(s) for s in scores], unk_id)
        kind, add_bos_default = "spm", True
        strip = get("tokenizer.ggml.add_space_prefix", (bool,), True)
        pieces = []
        for t, ty in zip(tokens, types):
            if ty == _TT_BYTE and BYTE_TOKEN.fullmatch(t):
                pieces.append(piece_bytes(t))
            elif ty in (_TT_UNKNOWN, _TT_CONTROL, _TT_USER):
                pieces.append(t.encode("utf-8"))
            else:
                pieces.append(t.replace(SPACE_MARK, " ").encode("utf-8"))
        bos_default, eos_default = (1, 2) if n > 2 else (None, None)
    else:
        raise ValueError(f"{path}: unsupported tokenizer.ggml.model {model!r} "
                         "(supported: 'gpt2', 'llama')")

    special_ids = {i for i, ty in enumerate(types) if ty in (_TT_UNKNOWN, _TT_CONTROL)}
    specials = [(tokens[i], i) for i in special_ids]
    user_specials = [(t, i) for i, (t, ty) in enumerate(zip(tokens, types)) if ty == _TT_USER]
    bos_id = token_id("tokenizer.ggml.bos_token_id", bos_default)
    eos_id = token_id("tokenizer.ggml.eos_token_id", eos_default)
    extra_eos = [token_id(k, None) for k in ("tokenizer.ggml.eot_token_id",
                                             "tokenizer.ggml.eom_token_id")]
    add_bos = get("tokenizer.ggml.add_bos_token", (bool,), add_bos_default)
    template = get("tokenizer.chat_template", (str,), None)
    return dict(kind=kind, tokens=tokens, pieces=pieces, special_ids=special_ids,
                bos_id=bos_id,
                eos_ids=eos_list(eos_id, [e for e in extra_eos if e is not None], tokens,
                                special_ids | {i for _, i in user_specials}, n),
                add_bos=add_bos and bos_id is not None, strip_space=strip, specials=specials,
                user_specials=user_specials, encoder=encoder, chat_template=template,
                bos_token=tokens[bos_id] if bos_id is not None else None,
                eos_token=tokens[eos_id] if eos_id is not None else None, source=path)


def _first_non_utf8(tokens):
    """Index of the first token whose bytes were not UTF-8 (the reader keeps
    them as surrogate escapes), or None."""
    try:
        "".join(tokens).encode("utf-8")
        return None
    except UnicodeEncodeError:
        return next(i for i, t in enumerate(tokens) if not t.isascii() and _bad(t))


def _bad(text):
    try:
        text.encode("utf-8")
        return False
    except UnicodeEncodeError:
        return True
