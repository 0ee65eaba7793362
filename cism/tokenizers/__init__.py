"""Text in, text out: `cism.Tokenizer`.

One class (core.py) over four vocabulary sources, one module each:

| source                                   | encoder                                  |
|------------------------------------------|------------------------------------------|
| HF `tokenizer.json`                      | HF `tokenizers` (required)               |
| GPT-2 `encoder.json` + `vocab.bpe`       | byte-level BPE, pure Python with a word  |
| (or `vocab.json` + `merges.txt`)         | cache (or HF `tokenizers`: backend="hf") |
| GGUF `tokenizer.ggml.model = gpt2`       | same, pre-tokenizer from `.pre`          |
| GGUF `tokenizer.ggml.model = llama`      | llama.cpp's SentencePiece merge, Python  |
| llama2.c `tokenizer.bin`                 | llama2.c run.c `encode()`, Python        |

Decoding never goes through a third-party decoder when the vocabulary is
byte-level or SentencePiece-like: every token id maps to a byte string once, at
load time, and text is those bytes decoded as UTF-8 (invalid sequences become
U+FFFD). The streaming decoder feeds the same bytes through an incremental
UTF-8 decoder, so the concatenation of its output equals `decode()` exactly and
never splits a character.

Two decode rules that keep `decode(encode(text)) == text`:
- SentencePiece vocabularies add a "dummy prefix" space when encoding; decode
  removes one leading space from the first token that produces output, if that
  token is a normal (not special) token. This matches HF's `Strip` decoder.
- No `clean_up_tokenization_spaces` (transformers' " ." -> "." rewrite): it
  would break the round trip.

Modules: core (Tokenizer: encode, decode, chat), stream (StreamDecoder), bpe
and spm (the encoders), chat (Jinja templates), files (reads that name the
file, HF side files), deps (optional imports); the sources hf_json, gpt2, gguf,
llama2c, and pretrained (which source a path is).
"""
from cism.tokenizers.core import Tokenizer
from cism.tokenizers.stream import StreamDecoder

__all__ = ["Tokenizer", "StreamDecoder"]
