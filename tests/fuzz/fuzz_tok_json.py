"""Fuzz target: an HF tokenizer.json with its tokenizer_config.json and
generation_config.json (cism.Tokenizer.from_file), then encode/decode with
whatever loaded. The input is a set of files (_harness.pack_files).

    PYTHONPATH=. python tests/fuzz/fuzz_tok_json.py -max_total_time=120
"""
import json

from _harness import (Workdir, exercise_tokenizer, expect_value_error, instrumented, main,
                      pack_files, unpack_files)

with instrumented():
    from cism.tokenizers import Tokenizer

SLOTS = ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]
work = Workdir("tok_json")


def one_input(data):
    root = work.fresh()
    files = unpack_files(SLOTS, data)
    for name, payload in files.items():
        work.write(name, payload)
    path = work.write("tokenizer.json", files.get("tokenizer.json", b""))
    tok = expect_value_error(lambda: Tokenizer.from_file(path), root)
    if tok is not None:
        exercise_tokenizer(tok)


def small_bpe(**changes):
    vocab = {"a": 0, "b": 1, "ab": 2, "\u0120": 3, "<s>": 4, "</s>": 5}
    data = {"version": "1.0",
            "added_tokens": [{"id": 4, "content": "<s>", "special": True},
                             {"id": 5, "content": "</s>", "special": True}],
            "normalizer": None,
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                              "use_regex": True},
            "post_processor": None,
            "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                        "use_regex": True},
            "model": {"type": "BPE", "vocab": vocab, "merges": ["a b"]}}
    data.update(changes)
    return json.dumps(data).encode()


def seeds():
    config = json.dumps({"bos_token": "<s>", "eos_token": {"content": "</s>"}, "add_bos_token": True,
                         "added_tokens_decoder": {"4": {"content": "<s>", "special": True}}}).encode()
    gen = json.dumps({"eos_token_id": [5, 4]}).encode()
    yield pack_files(SLOTS, {"tokenizer.json": small_bpe()})
    yield pack_files(SLOTS, {"tokenizer.json": small_bpe(), "tokenizer_config.json": config,
                             "generation_config.json": gen})
    spm_decoder = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
        {"type": "ByteFallback"}, {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1,
                                                      "stop": 0}]}
    yield pack_files(SLOTS, {"tokenizer.json": small_bpe(decoder=spm_decoder, pre_tokenizer=None)})
    yield pack_files(SLOTS, {"tokenizer.json": small_bpe(model={"type": "WordLevel", "vocab": {"a": 0},
                                                                "unk_token": "a"})})


if __name__ == "__main__":
    main(one_input, seeds, "tok_json")
