"""Vocabulary source: llama2.c's `tokenizer.bin` (encoded as run.c's
`encode()` does), and the rule for finding the tokenizer of a llama2.c model:
the tokenizer.bin or tok*.bin next to it whose size matches the model's
vocab_size, read from the model header by the loader's one header reader
(cism/loaders/llama2c.py).
Like every vocabulary source, it returns the keyword arguments of `Tokenizer`
(cism/tokenizers/core.py); `Tokenizer.from_llama2c` wraps it.
"""
import struct
from pathlib import Path

from cism.loaders import llama2c as llama2c_checkpoint
from cism.tokenizers.files import expect, read_bytes
from cism.tokenizers.spm import BYTE_TOKEN, Llama2cSPM


def from_llama2c(path, vocab_size=None):
    """A llama2.c `tokenizer.bin`: int32 max_token_length, then per token
    float32 score, int32 length, bytes. The token count is whatever the
    file holds; pass `vocab_size` (the model's) to check it. BOS=1, EOS=2,
    encode prepends BOS by default (as run.c does for prompts)."""
    path = Path(path)
    pieces, scores = _parse(read_bytes(path, "llama2.c tokenizer"), path)
    n = len(pieces)
    # Ids 0-2 are <unk>, <s>, </s> and 3-258 the byte tokens (run.c's +3).
    expect(n >= 259, path, f"llama2.c tokenizer has {n} tokens; needs at least 259 "
                            "(3 specials + 256 byte tokens)")
    if vocab_size is not None:
        expect(n == vocab_size, path,
               f"llama2.c tokenizer has {n} tokens but the model's vocab_size is {vocab_size}")
    # llama2.c's exporter writes BOS/EOS as "\n<s>\n" / "\n</s>\n".
    tokens = [p.decode("utf-8", errors="replace") for p in pieces]
    tokens[:3] = [t.strip() for t in tokens[:3]]
    out_pieces = []
    for i, p in enumerate(pieces):
        m = BYTE_TOKEN.fullmatch(tokens[i])
        if i < 3:
            out_pieces.append(tokens[i].encode("utf-8"))
        elif m:
            out_pieces.append(bytes([int(m.group(1), 16)]))
        else:
            out_pieces.append(p)
    return dict(kind="llama2c", tokens=tokens, pieces=out_pieces, special_ids={0, 1, 2},
                bos_id=1, eos_ids=[2], add_bos=True, strip_space=True,
                encoder=Llama2cSPM(pieces, scores), bos_token="<s>", eos_token="</s>",
                source=path)


def _parse(data, path):
    """(pieces, scores) of the bytes of a tokenizer.bin, every length checked."""
    expect(len(data) >= 4, path, "truncated llama2.c tokenizer: no header")
    (max_len,) = struct.unpack_from("<i", data, 0)
    expect(0 < max_len <= 1 << 16, path,
           f"not a llama2.c tokenizer: max_token_length {max_len} is implausible")
    pieces, scores = [], []
    off = 4
    while off < len(data):
        i = len(pieces)
        expect(off + 8 <= len(data), path, f"truncated llama2.c tokenizer inside token {i}")
        score, length = struct.unpack_from("<fi", data, off)
        off += 8
        expect(0 <= length <= max_len, path,
               f"corrupt llama2.c tokenizer: token {i} has length {length} "
               f"(max_token_length is {max_len})")
        expect(off + length <= len(data), path,
               f"truncated llama2.c tokenizer inside token {i}")
        pieces.append(data[off:off + length])
        scores.append(score)
        off += length
    return pieces, scores


def tokenizers_in(directory):
    """llama2.c tokenizers in `directory`: tokenizer.bin first, then tok*.bin."""
    d = Path(directory)
    out = [d / "tokenizer.bin"] if (d / "tokenizer.bin").is_file() else []
    out += sorted(p for p in d.glob("tok*.bin") if p.is_file() and p.name != "tokenizer.bin")
    return out


def model_vocab_size(path):
    """vocab_size from a llama2.c model's header (version 0 or 1)."""
    return llama2c_checkpoint.read_header(path)["vocab_size"]


def token_count(path):
    """Token count of a llama2.c tokenizer file, or None if it does not parse."""
    try:
        return len(_parse(Path(path).read_bytes(), path)[0])
    except (OSError, ValueError):
        return None
