"""Which vocabulary source a path is: `Tokenizer.from_pretrained`'s rule."""
from pathlib import Path

from cism.tokenizers import gguf, gpt2, hf_json, llama2c


def from_pretrained(path):
    """The Tokenizer keyword arguments of whichever source `path` is:
    - a directory with tokenizer.json, encoder.json + vocab.bpe,
      vocab.json + merges.txt, one .gguf file, or a llama2.c tokenizer.bin;
    - a .gguf file; a tokenizer.json file;
    - a llama2.c tokenizer (tokenizer.bin, tok*.bin) or model .bin, for
      which the tokenizer next to it whose size matches the model is used."""
    p = Path(path)
    if p.is_dir():
        if (p / "tokenizer.json").is_file():
            return hf_json.from_tokenizer_json(p / "tokenizer.json")
        for enc, mer in (("encoder.json", "vocab.bpe"), ("vocab.json", "merges.txt")):
            if (p / enc).is_file() and (p / mer).is_file():
                return gpt2.from_gpt2_files(p / enc, p / mer)
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            return gguf.from_gguf(ggufs[0])
        bins = llama2c.tokenizers_in(p)
        if len(ggufs) == 0 and bins:
            return llama2c.from_llama2c(bins[0])
        raise ValueError(f"{p}: no tokenizer found (looked for tokenizer.json, "
                         "encoder.json+vocab.bpe, vocab.json+merges.txt, one *.gguf, "
                         f"tokenizer.bin/tok*.bin){'; several .gguf files' if ggufs else ''}")
    if not p.exists():
        raise ValueError(f"{p}: no such file or directory")
    if p.suffix == ".gguf" or _has_magic(p, b"GGUF"):
        return gguf.from_gguf(p)
    if p.suffix == ".json":
        return hf_json.from_tokenizer_json(p)
    if p.suffix == ".bin":
        if p.name.startswith("tok"):
            return llama2c.from_llama2c(p)
        vocab_size = llama2c.model_vocab_size(p)
        candidates = [b for b in llama2c.tokenizers_in(p.parent) if b != p]
        for b in candidates:
            if vocab_size is None or llama2c.token_count(b) == vocab_size:
                return llama2c.from_llama2c(b, vocab_size=vocab_size)
        raise ValueError(f"{p}: no llama2.c tokenizer (tokenizer.bin or tok*.bin) "
                         f"with {vocab_size} tokens next to this model")
    raise ValueError(f"{p}: cannot tell which tokenizer format this file is "
                     "(expected .gguf, tokenizer.json or a llama2.c .bin)")


def _has_magic(path, magic):
    try:
        with open(path, "rb") as f:
            return f.read(len(magic)) == magic
    except OSError:
        return False
