"""Fuzz target: a llama2.c tokenizer.bin (cism.Tokenizer.from_llama2c), then
encode/decode with whatever loaded.

    PYTHONPATH=. python tests/fuzz/fuzz_tok_llama2c.py -max_total_time=120
"""
import struct

from _harness import Workdir, exercise_tokenizer, expect_value_error, instrumented, main

with instrumented():
    from cism.tokenizers import Tokenizer

work = Workdir("tok_llama2c")


def one_input(data):
    work.fresh()
    path = work.write("tokenizer.bin", data)
    tok = expect_value_error(lambda: Tokenizer.from_llama2c(path), path)
    if tok is not None:
        exercise_tokenizer(tok)


def llama2c_tokenizer(pieces, scores=None, max_len=None):
    max_len = max(len(p) for p in pieces) if max_len is None else max_len
    out = struct.pack("<i", max_len)
    for i, p in enumerate(pieces):
        out += struct.pack("<fi", (scores or [float(-i)] * len(pieces))[i], len(p)) + p
    return out


def seeds():
    import os
    from conftest import DATA
    base = [b"<unk>", b"\n<s>\n", b"\n</s>\n"] + [b"<0x%02X>" % i for i in range(256)]
    words = [b" ", b"a", b"b", b"ab", b" a", b"\xe2\x96\x81", b"\xff", b"Hello", b" world"]
    yield llama2c_tokenizer(base + words)
    yield llama2c_tokenizer(base + words, max_len=3)
    yield llama2c_tokenizer(base)
    if DATA is not None:
        with open(os.path.join(DATA, "models", "stories260K", "tok512.bin"), "rb") as f:
            good = f.read()
        yield good
        yield good[:len(good) // 2]


if __name__ == "__main__":
    main(one_input, seeds, "tok_llama2c")
