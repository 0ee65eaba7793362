"""Fuzz target: the tokenizer in a GGUF file's tokenizer.ggml.* metadata
(cism.Tokenizer.from_gguf, SentencePiece "llama" and byte-level BPE "gpt2"
vocabularies), then encode/decode with whatever loaded. The first input byte
picks the BPE backend (even: python, odd: HF tokenizers).

    PYTHONPATH=. python tests/fuzz/fuzz_tok_gguf.py -max_total_time=120
"""
import struct

from _harness import Workdir, exercise_tokenizer, expect_value_error, instrumented, main

with instrumented():
    from cism.tokenizers import Tokenizer

work = Workdir("tok_gguf")


def one_input(data):
    if not data:
        return
    backend = "hf" if data[0] & 1 else "python"
    work.fresh()
    path = work.write("vocab.gguf", data[1:])
    tok = expect_value_error(lambda: Tokenizer.from_gguf(path, backend=backend), path)
    if tok is not None:
        exercise_tokenizer(tok)


def _array(key, etype, fmt, values):
    import malformed
    payload = b"".join(malformed.gstr(v) for v in values) if etype == malformed.GGUF_STR else \
        b"".join(struct.pack(fmt, v) for v in values)
    return malformed.gstr(key) + struct.pack("<IIQ", malformed.GGUF_ARR, etype, len(values)) + payload


def vocab_gguf(model, tokens, merges=None, scores=None, types=None, extra=()):
    import malformed as m
    kvs = [m.kv("tokenizer.ggml.model", m.GGUF_STR, model),
           _array("tokenizer.ggml.tokens", m.GGUF_STR, None, tokens)]
    if merges is not None:
        kvs.append(_array("tokenizer.ggml.merges", m.GGUF_STR, None, merges))
    if scores is not None:
        kvs.append(_array("tokenizer.ggml.scores", m.GGUF_F32, "<f", scores))
    if types is not None:
        kvs.append(_array("tokenizer.ggml.token_type", m.GGUF_I32, "<i", types))
    kvs += list(extra)
    return m.gguf_bytes(kvs, [], b"")


def seeds():
    import malformed as m
    spm = ["<unk>", "<s>", "</s>"] + ["<0x%02X>" % i for i in range(256)] + \
        ["\u2581", "a", "b", "ab", "\u2581a", "\u2581Hello", "\u2581world", "<|im_end|>"]
    types = [2, 3, 3] + [6] * 256 + [1] * 7 + [3]
    for b in (b"\0", b"\1"):
        yield b + vocab_gguf("llama", spm, scores=[-float(i) for i in range(len(spm))], types=types,
                             extra=[m.kv("tokenizer.ggml.bos_token_id", m.GGUF_U32, 1),
                                    m.kv("tokenizer.ggml.eos_token_id", m.GGUF_U32, 2)])
        bpe = ["a", "b", "ab", "\u0120", "\u0120a", "<|endoftext|>", "<c>", "<u>"]
        yield b + vocab_gguf("gpt2", bpe, merges=["a b", "\u0120 a"], types=[1] * 5 + [3, 3, 4],
                             extra=[m.kv("tokenizer.ggml.pre", m.GGUF_STR, "gpt-2"),
                                    m.kv("tokenizer.ggml.eos_token_id", m.GGUF_U32, 5)])
        yield b + vocab_gguf("gpt2", bpe, merges=["a b"],
                             extra=[m.kv("tokenizer.ggml.pre", m.GGUF_STR, "qwen2")])
        yield b + vocab_gguf("llama", ["a", "b", "c"])


if __name__ == "__main__":
    main(one_input, seeds, "tok_gguf")
