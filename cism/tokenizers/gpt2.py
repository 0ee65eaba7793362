"""Vocabulary source: GPT-2's `encoder.json` + `vocab.bpe` (or HF's
`vocab.json` + `merges.txt`), byte-level BPE with the GPT-2 pre-tokenizer.
Like every vocabulary source, it returns the keyword arguments of `Tokenizer`
(cism/tokenizers/core.py); `Tokenizer.from_gpt2_files` wraps it.
"""
from pathlib import Path

from cism.tokenizers.bpe import PRE_TOKENIZERS, byte_decode, check_backend, make_bpe
from cism.tokenizers.files import eos_list, expect, id_of, read_hf_config, read_json, read_text


def from_gpt2_files(encoder_json, vocab_bpe, backend="python"):
    """GPT-2's `encoder.json` + `vocab.bpe` (or HF's `vocab.json` +
    `merges.txt`): byte-level BPE with the GPT-2 pre-tokenizer. A
    `tokenizer_config.json` next to them adds special tokens, BOS/EOS and
    the chat template. `backend`: "python" or "hf" (HF tokenizers runs
    the same vocabulary); both give the same ids."""
    check_backend(backend)
    encoder_json, vocab_bpe = Path(encoder_json), Path(vocab_bpe)
    vocab = read_json(encoder_json, "vocabulary JSON")
    expect(isinstance(vocab, dict) and vocab, encoder_json,
           "the vocabulary must be a non-empty JSON object mapping token -> id")
    bad = next((t for t, i in vocab.items() if type(i) is not int or not 0 <= i < 1 << 24),
               None)
    expect(bad is None, encoder_json, f"token {bad!r} has id {vocab.get(bad)!r}; "
                                       "ids must be non-negative integers")
    merges = _parse_merges(read_text(vocab_bpe, "merges file"), vocab_bpe)

    cfg = read_hf_config(encoder_json.parent)
    n = max(vocab.values()) + 1
    for i, (content, _) in cfg["added_tokens"].items():
        n = max(n, i + 1)
    tokens = [None] * n
    for t, i in vocab.items():
        tokens[i] = t
    # Added tokens are raw text, not byte-level spellings; the special ones
    # are parsed only with parse_special, the others always (as in HF).
    special_ids = {i for i, (_, special) in cfg["added_tokens"].items() if special}
    if "<|endoftext|>" in vocab:
        special_ids.add(vocab["<|endoftext|>"])
    for i, (content, _) in cfg["added_tokens"].items():
        tokens[i] = content
    added_ids = set(cfg["added_tokens"]) | special_ids
    pieces = [b"" if t is None else t.encode("utf-8") if i in added_ids else byte_decode(t)
              for i, t in enumerate(tokens)]

    ids_by_text = {t: i for i, t in enumerate(tokens) if t is not None}
    bos_token = cfg["bos_token"] or ("<|endoftext|>" if "<|endoftext|>" in vocab else None)
    eos_token = cfg["eos_token"] or ("<|endoftext|>" if "<|endoftext|>" in vocab else None)
    bos_id, eos_id = id_of(ids_by_text, bos_token), id_of(ids_by_text, eos_token)
    encoder = make_bpe(vocab, merges, PRE_TOKENIZERS["gpt-2"], backend, vocab_bpe)
    return dict(kind="bpe", tokens=tokens, pieces=pieces, special_ids=special_ids,
                bos_id=bos_id, eos_ids=eos_list(eos_id, cfg["eos_ids"], tokens, special_ids, n),
                add_bos=bool(cfg["add_bos"]) and bos_id is not None,
                specials=[(tokens[i], i) for i in special_ids],
                user_specials=[(tokens[i], i) for i in added_ids - special_ids],
                encoder=encoder, chat_template=cfg["chat_template"],
                bos_token=bos_token, eos_token=eos_token, source=encoder_json)


def _parse_merges(text, path):
    """vocab.bpe / merges.txt: an optional "#version" line, then "left right"."""
    merges = []
    for k, line in enumerate(text.split("\n"), start=1):
        line = line.rstrip("\r")
        if not line or (k == 1 and line.startswith("#version")):
            continue
        parts = line.split(" ")
        expect(len(parts) == 2 and all(parts), path,
               f"line {k}: expected two tokens separated by one space, got {line!r}")
        merges.append((parts[0], parts[1]))
    expect(merges, path, "no merges in the merges file")
    return merges
