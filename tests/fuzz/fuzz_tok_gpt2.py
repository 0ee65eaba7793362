"""Fuzz target: GPT-2 vocabulary files, encoder.json + vocab.bpe with an
optional tokenizer_config.json (cism.Tokenizer.from_gpt2_files), then
encode/decode with whatever loaded. The first input byte picks the backend
(even: python, odd: HF tokenizers); the rest is a set of files.

    PYTHONPATH=. python tests/fuzz/fuzz_tok_gpt2.py -max_total_time=120
"""
import json

from _harness import (Workdir, exercise_tokenizer, expect_value_error, instrumented, main,
                      pack_files, unpack_files)

with instrumented():
    from cism.tokenizers import Tokenizer

SLOTS = ["encoder.json", "vocab.bpe", "tokenizer_config.json"]
work = Workdir("tok_gpt2")


def one_input(data):
    if not data:
        return
    backend = "hf" if data[0] & 1 else "python"
    root = work.fresh()
    files = unpack_files(SLOTS, data[1:])
    for name in SLOTS[:2]:
        files.setdefault(name, b"")
    for name, payload in files.items():
        work.write(name, payload)
    tok = expect_value_error(
        lambda: Tokenizer.from_gpt2_files(f"{root}/encoder.json", f"{root}/vocab.bpe", backend=backend),
        root)
    if tok is not None:
        exercise_tokenizer(tok)


def seeds():
    vocab = {"a": 0, "b": 1, "ab": 2, "\u0120": 3, "\u0120a": 4, "<|endoftext|>": 5}
    merges = "#version: 0.2\na b\n\u0120 a\n".encode()
    config = json.dumps({"added_tokens_decoder": {"6": {"content": "<x>", "special": False},
                                                  "7": {"content": "<y>", "special": True}},
                         "eos_token": "<y>"}).encode()
    for b in (b"\0", b"\1"):
        yield b + pack_files(SLOTS, {"encoder.json": json.dumps(vocab).encode(), "vocab.bpe": merges})
        yield b + pack_files(SLOTS, {"encoder.json": json.dumps(vocab).encode(), "vocab.bpe": merges,
                                     "tokenizer_config.json": config})


if __name__ == "__main__":
    main(one_input, seeds, "tok_gpt2")
