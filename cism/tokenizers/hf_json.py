"""Vocabulary source: a Hugging Face `tokenizer.json`, encoded by HF
`tokenizers`, and decoded by cism's byte mapping when its decoder is one of the
two families reproduced here (byte-level, or Llama-style SentencePiece).
Like every vocabulary source, it returns the keyword arguments of `Tokenizer`
(cism/tokenizers/core.py); `Tokenizer.from_file` wraps it.
"""
from pathlib import Path

from cism.tokenizers import deps
from cism.tokenizers.bpe import byte_decode
from cism.tokenizers.files import eos_list, expect, id_of, parse_json, read_hf_config, read_text
from cism.tokenizers.spm import SPACE_MARK, piece_bytes


def from_tokenizer_json(path):
    """A HF `tokenizer.json`; reads `tokenizer_config.json` (and
    `generation_config.json`, `chat_template.jinja`) next to it."""
    tokenizers = deps.need_tokenizers()
    path = Path(path)
    raw = read_text(path, "tokenizer.json")
    data = parse_json(raw, path, "tokenizer.json")
    _check_tokenizer_json(data, path)
    try:
        hf = tokenizers.Tokenizer.from_str(raw)
    except Exception as e:  # the Rust side raises a bare Exception
        raise ValueError(f"{path}: not a valid tokenizer.json: {e}") from None

    vocab = hf.get_vocab(with_added_tokens=True)
    n = max(vocab.values(), default=-1) + 1
    tokens = [None] * n
    for t, i in vocab.items():
        tokens[i] = t
    added = [a for a in data.get("added_tokens") or [] if 0 <= a["id"] < n]
    special_ids = {a["id"] for a in added if a.get("special")}

    rule = _hf_decode_rule(data.get("decoder"))
    pieces, strip = None, False
    if rule is not None:
        # HF runs added tokens through the same decoder as the others.
        kind, strip, byte_fallback = rule
        if kind == "bytelevel":
            pieces = [b"" if t is None else byte_decode(t) for t in tokens]
        else:
            pieces = [b"" if t is None else piece_bytes(t, byte_fallback) for t in tokens]

    cfg = read_hf_config(path.parent)
    bos_id = id_of(vocab, cfg["bos_token"])
    eos_id = id_of(vocab, cfg["eos_token"])
    add_bos = cfg["add_bos"]
    if add_bos is None:
        # No explicit setting: BOS is added when the post-processor adds a
        # token in front (e.g. Llama's TemplateProcessing).
        try:
            plain = hf.encode("a", add_special_tokens=False).ids
            full = hf.encode("a", add_special_tokens=True).ids
        except Exception:  # "a" is not in a vocabulary without an unk token
            plain = full = []
        add_bos = len(full) > len(plain) and full[1:len(plain) + 1] == plain
        if add_bos and bos_id is None:
            bos_id = full[0]
    if add_bos and bos_id is None:
        add_bos = False
    eos_ids = eos_list(eos_id, cfg["eos_ids"], tokens, special_ids, n)
    return dict(kind="hf", tokens=tokens, pieces=pieces, special_ids=special_ids,
                bos_id=bos_id, eos_ids=eos_ids, add_bos=add_bos, strip_space=strip, hf=hf,
                chat_template=cfg["chat_template"],
                bos_token=cfg["bos_token"] or (tokens[bos_id] if bos_id is not None else None),
                eos_token=cfg["eos_token"] or (tokens[eos_id] if eos_id is not None else None),
                source=path)


def _check_tokenizer_json(data, path):
    """The structure checks that give a clear message before HF's own parser
    reports something cryptic."""
    expect(isinstance(data, dict), path, "tokenizer.json must hold a JSON object")
    model = data.get("model")
    expect(isinstance(model, dict), path, "tokenizer.json has no 'model' object")
    mtype = model.get("type", "BPE" if "merges" in model else None)
    if mtype == "BPE":
        vocab = model.get("vocab")
        expect(isinstance(vocab, dict), path,
               "'model.vocab' must be an object mapping token -> id")
        bad = next((t for t, i in vocab.items() if type(i) is not int or i < 0), None)
        expect(bad is None, path, f"'model.vocab' entry {bad!r} has id {vocab.get(bad)!r}; "
                                   "ids must be non-negative integers")
        expect("merges" in model, path, "BPE model has no 'model.merges'")
        merges = model["merges"]
        expect(isinstance(merges, list), path, "'model.merges' must be a list")
        bad = next((k for k, m in enumerate(merges) if not (
            (type(m) is str and " " in m[1:])
            or (type(m) is list and len(m) == 2 and type(m[0]) is str and type(m[1]) is str))),
            None)
        expect(bad is None, path,
               f"'model.merges'[{bad}] = {merges[bad] if bad is not None else None!r} "
               "is neither 'a b' nor ['a', 'b']")
    added = data.get("added_tokens", [])
    expect(isinstance(added, list), path, "'added_tokens' must be a list")
    for k, a in enumerate(added):
        expect(isinstance(a, dict) and isinstance(a.get("id"), int)
               and isinstance(a.get("content"), str), path,
               f"'added_tokens'[{k}] must be an object with an integer 'id' "
               "and a string 'content'")


def _flatten_decoders(dec):
    if not isinstance(dec, dict):
        return []
    if dec.get("type") == "Sequence":
        out = []
        for d in dec.get("decoders") or []:
            out.extend(_flatten_decoders(d))
        return out
    return [dec]


def _hf_decode_rule(decoder):
    """How a tokenizer.json `decoder` turns tokens into bytes, for the two
    families reproduced here: ("bytelevel", False, False) or
    ("spm", strip_first_space, byte_fallback) for Llama-style
    Replace("▁", " ") + ByteFallback + Fuse + Strip(" ", 1, 0). None for
    anything else, which is then decoded by HF itself. (HF's Metaspace decoder
    drops *every* "▁" of the first token, which no byte mapping reproduces.)"""
    steps = _flatten_decoders(decoder)
    types = [d.get("type") for d in steps]
    if types == ["ByteLevel"]:
        return ("bytelevel", False, False)
    if types and set(types) <= {"Replace", "ByteFallback", "Fuse", "Strip"} and "Replace" in types:
        for d in steps:
            if d["type"] == "Replace":
                pattern = d.get("pattern") or {}
                if pattern.get("String") != SPACE_MARK or d.get("content") != " ":
                    return None
            if d["type"] == "Strip" and (d.get("content") != " " or d.get("stop", 0) != 0
                                         or d.get("start", 0) > 1):
                return None
        strip = any(d["type"] == "Strip" and d.get("start", 0) == 1 for d in steps)
        return ("spm", strip, "ByteFallback" in types)
    return None


# ---------------------------------------------------------------------------
