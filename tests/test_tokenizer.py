"""cism.Tokenizer: conformance with llama.cpp's tokenizer test vectors, parity
with HF `tokenizers` and llama2.c, round trips, streaming, chat templates and
error handling.

Oracles never call the code under test: llama.cpp's *.out files; HF tokenizers
built here from vocabularies read with the `gguf` package; a literal
transcription of llama2.c's run.c encode(); transformers' apply_chat_template.
"""
import json
import re
import shutil
import struct
import unicodedata

import pytest

from cism.tokenizers import StreamDecoder, Tokenizer

from conftest import hypothesis_parts


# hypothesis, and regex (which only the pure Python byte-level BPE needs), are
# imported by the tests and fixtures that use them: where one is missing, only
# those skip.
def python_bpe():
    """Skip the caller unless regex, the pure Python BPE's pre-tokenizer, is installed."""
    pytest.importorskip("regex")


# ---------------------------------------------------------------------------
# fixtures: each tokenizer is loaded once per module
# ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tok_dir(data_dir):
    return data_dir / "tokenizers"


@pytest.fixture(scope="module")
def gpt2_gguf_py(tok_dir):
    python_bpe()
    return Tokenizer.from_gguf(tok_dir / "gguf-vocab" / "ggml-vocab-gpt-2.gguf", backend="python")


@pytest.fixture(scope="module")
def gpt2_gguf_hf(tok_dir):
    pytest.importorskip("tokenizers")
    return Tokenizer.from_gguf(tok_dir / "gguf-vocab" / "ggml-vocab-gpt-2.gguf", backend="hf")


@pytest.fixture(scope="module")
def gpt2_files_py(tok_dir):
    python_bpe()
    return Tokenizer.from_gpt2_files(tok_dir / "gpt2" / "encoder.json",
                                     tok_dir / "gpt2" / "vocab.bpe", backend="python")


@pytest.fixture(scope="module")
def gpt2_files_hf(tok_dir):
    pytest.importorskip("tokenizers")
    return Tokenizer.from_gpt2_files(tok_dir / "gpt2" / "encoder.json",
                                     tok_dir / "gpt2" / "vocab.bpe", backend="hf")


@pytest.fixture(scope="module")
def llama_spm(tok_dir):
    return Tokenizer.from_gguf(tok_dir / "gguf-vocab" / "ggml-vocab-llama-spm.gguf")


@pytest.fixture(scope="module")
def qwen3(tok_dir):
    pytest.importorskip("tokenizers")
    return Tokenizer.from_file(tok_dir / "qwen3" / "tokenizer.json")


@pytest.fixture(scope="module")
def qwen2_gguf_path(tok_dir, tmp_path_factory):
    """A vocab-only GGUF (model gpt2, pre qwen2) written with the `gguf`
    package from qwen3/tokenizer.json, so that the GGUF qwen2 pre-tokenizer
    runs against llama.cpp's qwen2 vectors."""
    gguf = pytest.importorskip("gguf")
    data = json.loads((tok_dir / "qwen3" / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = data["model"]["vocab"]
    n = max([*vocab.values(), *(a["id"] for a in data["added_tokens"])]) + 1
    tokens, types = [""] * n, [1] * n
    for t, i in vocab.items():
        tokens[i] = t
    for a in data["added_tokens"]:
        tokens[a["id"]] = a["content"]
        types[a["id"]] = 3 if a["special"] else 4
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    path = tmp_path_factory.mktemp("gguf") / "qwen2-vocab.gguf"
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def qwen2_gguf_py(qwen2_gguf_path):
    python_bpe()
    return Tokenizer.from_gguf(qwen2_gguf_path, backend="python")


@pytest.fixture(scope="module")
def qwen2_gguf_hf(qwen2_gguf_path):
    pytest.importorskip("tokenizers")
    return Tokenizer.from_gguf(qwen2_gguf_path, backend="hf")


@pytest.fixture(scope="module")
def stories_dir(data_dir):
    return data_dir / "models" / "stories260K"


@pytest.fixture(scope="module")
def stories(stories_dir):
    return Tokenizer.from_llama2c(stories_dir / "tok512.bin")


@pytest.fixture(scope="module")
def smollm2_py(smollm2_gguf):
    python_bpe()
    return Tokenizer.from_gguf(smollm2_gguf, backend="python")


@pytest.fixture(scope="module")
def smollm2_hf(smollm2_gguf):
    pytest.importorskip("tokenizers")
    return Tokenizer.from_gguf(smollm2_gguf, backend="hf")


ALL_TOKENIZERS = ["gpt2_gguf_py", "gpt2_gguf_hf", "gpt2_files_py", "gpt2_files_hf", "llama_spm",
                  "qwen3", "qwen2_gguf_py", "stories"]


@pytest.fixture(params=ALL_TOKENIZERS)
def any_tok(request):
    return request.getfixturevalue(request.param)


# ---------------------------------------------------------------------------
# llama.cpp conformance vectors
# ---------------------------------------------------------------------------
def load_vectors(tok_dir, name):
    """llama.cpp's test-tokenizer-0 data: inputs separated by
    "\\n__ggml_vocab_test__\\n", one line of expected ids per input. Each input
    ends with the separator, so splitting gives 46 texts plus a final empty
    one, matched by the empty last line of the .out file: 47 cases."""
    d = tok_dir / "gguf-vocab"
    inputs = (d / f"ggml-vocab-{name}.gguf.inp").read_text(encoding="utf-8")
    inputs = inputs.split("\n__ggml_vocab_test__\n")
    expected = (d / f"ggml-vocab-{name}.gguf.out").read_text(encoding="utf-8").split("\n")
    assert len(inputs) == len(expected) == 47
    return [(text, [int(x) for x in line.split()]) for text, line in zip(inputs, expected)]


# llama.cpp's test tokenizes with add_special=false: no BOS, even for the
# Llama SPM vocabulary whose add_bos_token is true (its .out has no leading 1).
@pytest.mark.parametrize("fixture,vectors", [
    ("gpt2_gguf_py", "gpt-2"), ("gpt2_gguf_hf", "gpt-2"),
    ("gpt2_files_py", "gpt-2"), ("gpt2_files_hf", "gpt-2"),
    ("llama_spm", "llama-spm"),
    ("qwen3", "qwen2"), ("qwen2_gguf_py", "qwen2"), ("qwen2_gguf_hf", "qwen2"),
])
def test_llama_cpp_vectors(request, tok_dir, fixture, vectors):
    tok = request.getfixturevalue(fixture)
    cases = load_vectors(tok_dir, vectors)
    failed = [(text, tok.encode(text, add_bos=False), ids) for text, ids in cases
              if tok.encode(text, add_bos=False) != ids]
    assert not failed, f"{len(failed)}/{len(cases)} differ; first: {failed[0]!r}"
    # and every vector decodes back to its text
    for text, ids in cases:
        assert tok.decode(ids) == text


# ---------------------------------------------------------------------------
# properties of the vocabularies
# ---------------------------------------------------------------------------
def test_special_ids_and_defaults(gpt2_files_py, gpt2_gguf_py, llama_spm, qwen3, stories):
    assert gpt2_files_py.vocab_size == gpt2_gguf_py.vocab_size == 50257
    assert gpt2_gguf_py.bos_id == 50256 and gpt2_gguf_py.eos_ids == (50256,)
    assert gpt2_files_py.eos_ids == (50256,) and not gpt2_files_py.add_bos
    assert llama_spm.vocab_size == 32000
    assert llama_spm.bos_id == 1 and llama_spm.eos_ids == (2,) and llama_spm.add_bos
    assert llama_spm.encode("Hello world") == [1, 15043, 3186]
    assert qwen3.vocab_size == 151669
    assert qwen3.bos_id is None and not qwen3.add_bos
    # eos from tokenizer_config, plus <|endoftext|> which also ends generation
    assert qwen3.eos_ids == (151645, 151643)
    with pytest.raises(ValueError, match="no BOS"):
        qwen3.encode("hi", add_bos=True)
    assert stories.vocab_size == 512 and stories.bos_id == 1 and stories.eos_ids == (2,)
    assert stories.encode("Hi")[0] == 1


def test_token_lookup(any_tok):
    # No vocabulary here spells two ids the same, so every id comes back.
    for i in range(any_tok.vocab_size):
        t = any_tok.id_to_token(i)
        assert isinstance(t, str)
        assert any_tok.token_to_id(t) == i, (i, t)
    assert any_tok.token_to_id("\x00no such token\x00") is None
    with pytest.raises(ValueError, match="out of range"):
        any_tok.id_to_token(any_tok.vocab_size)


def test_token_strings(gpt2_files_py, llama_spm, qwen3, stories):
    assert gpt2_files_py.token_to_id("Ġthe") == 262
    assert llama_spm.id_to_token(15043) == "▁Hello"
    assert qwen3.token_to_id("<|im_end|>") == 151645
    assert stories.id_to_token(1) == "<s>" and stories.id_to_token(261) == " a"


def test_special_tokens_in_text(qwen3, qwen2_gguf_py, gpt2_gguf_py, llama_spm):
    text = "<|im_start|>user\nhi<|im_end|>"
    for tok in (qwen3, qwen2_gguf_py):
        ids = tok.encode(text)
        assert ids[0] == 151644 and ids[-1] == 151645
        assert tok.decode(ids) == text
        plain = tok.encode(text, parse_special=False)
        assert 151644 not in plain and tok.decode(plain) == text
    assert gpt2_gguf_py.encode("a<|endoftext|>b") == [64, 50256, 65]
    # SPM: a special token is followed by a fresh dummy-prefix space (llama.cpp)
    assert llama_spm.encode("<s>Hi", add_bos=False) == [1, *llama_spm.encode("Hi", add_bos=False)]


# ---------------------------------------------------------------------------
# round trips
# ---------------------------------------------------------------------------
CORPORA = ["tinyshakespeare.txt", "pride_and_prejudice.txt", "moby_dick.txt",
           "wikitext-2-test.raw.txt", "wikitext-2-test.tokens.txt"]


@pytest.fixture(scope="module")
def corpus_slices(data_dir):
    """Three 6 KB slices of each corpus, CRLF normalised to LF (the round trip
    itself would keep CRLF; normalising just makes the slices line-based)."""
    out = []
    for name in CORPORA:
        text = (data_dir / "corpora" / name).read_bytes().decode("utf-8")
        text = text.replace("\r\n", "\n")
        for frac in (0.0, 0.37, 0.81):
            start = int(len(text) * frac)
            out.append(text[start:start + 6000])
    return out


def test_corpus_round_trip(any_tok, corpus_slices):
    """decode(encode(text)) == text exactly, for every tokenizer kind. For
    SentencePiece vocabularies this holds because decode removes exactly the
    one dummy-prefix space that encode added. parse_special=False: the
    tokenized WikiText spells "<unk>", which is Llama's special unknown token."""
    for text in corpus_slices:
        ids = any_tok.encode(text, parse_special=False)
        assert any_tok.decode(ids, skip_special=True) == text


def test_corpus_crlf_round_trip(gpt2_files_py, llama_spm, data_dir):
    raw = (data_dir / "corpora" / "moby_dick.txt").read_bytes().decode("utf-8")[:4000]
    assert "\r\n" in raw
    for tok in (gpt2_files_py, llama_spm):
        assert tok.decode(tok.encode(raw), skip_special=True) == raw


def test_special_text_in_corpus(llama_spm, gpt2_files_py, data_dir):
    """With parse_special (the default) text that spells a special token
    becomes that token: WikiText's "<unk>" is Llama's id 0."""
    text = (data_dir / "corpora" / "wikitext-2-test.tokens.txt").read_text(encoding="utf-8")
    text = text[:3000]
    assert "<unk>" in text
    ids = llama_spm.encode(text, add_bos=False)
    assert 0 in ids and 0 not in llama_spm.encode(text, add_bos=False, parse_special=False)
    # "<unk>" is no special token for GPT-2: the default round-trips exactly
    assert gpt2_files_py.decode(gpt2_files_py.encode(text)) == text


# Byte-level and llama2.c vocabularies round-trip any text. The guarantees
# that are weaker, and why:
# - llama.cpp SPM maps both " " and U+2581 "▁" to "▁", so "▁" decodes as a space;
# - Qwen's tokenizer.json NFC-normalises its input, so only NFC text survives.
# With parse_special=True, text that spells a special token ("<|im_end|>")
# becomes that token, which decodes back to the same text except under SPM,
# where a dummy-prefix space follows each special token.
def _text_for(name, st):
    if name == "llama_spm":
        return st.text().map(lambda s: s.replace("\u2581", "_"))
    if name == "qwen3":
        return st.text().map(lambda s: unicodedata.normalize("NFC", s))
    return st.text()


@pytest.mark.parametrize("name", ALL_TOKENIZERS)
def test_random_text_round_trip(request, name):
    tok = request.getfixturevalue(name)
    spm_like = name in ("llama_spm", "stories")
    given, st, SETTINGS = hypothesis_parts(60)

    @SETTINGS
    @given(_text_for(name, st))
    def check(text):
        ids = tok.encode(text, parse_special=False)
        assert tok.decode(ids, skip_special=True) == text
        # Kept special tokens print as text; after a printed BOS the SPM
        # dummy-prefix space stays (as in HF and llama.cpp).
        prefix = ""
        if tok.add_bos:
            prefix = tok.id_to_token(tok.bos_id) + (" " if spm_like and text else "")
        assert tok.decode(ids, skip_special=False) == prefix + text

    check()


def test_spm_leading_spaces(llama_spm, stories):
    for tok in (llama_spm, stories):
        for text in ("Hello", " Hello", "  Hello", "\nHello", " ", "", "a  b   c"):
            assert tok.decode(tok.encode(text), skip_special=True) == text
    # the dummy prefix: "Hello" and " Hello" differ by one leading "▁"
    assert llama_spm.encode(" Hello", add_bos=False) == [29871, 15043]


# ---------------------------------------------------------------------------
# pure Python and HF backends agree
# ---------------------------------------------------------------------------
BPE_PIECES = (list("aZ09 ,.;:'\"!?-_()[]{}<>/\\|\n\t\r") +
              ["'s", "'LL", "  ", "123", "é", "ß", "ﬁ", "½", "²", "٣", "नमस्ते",
               "日本", "🦙", "😶‍🌫️", "\u200d", "\x00", "\u2581"])


def test_python_and_hf_bpe_agree(gpt2_gguf_py, gpt2_gguf_hf):
    given, st, SETTINGS = hypothesis_parts(60)

    @SETTINGS
    @given(st.lists(st.sampled_from(BPE_PIECES), max_size=40).map("".join))
    def check(text):
        assert gpt2_gguf_py.encode(text) == gpt2_gguf_hf.encode(text)

    check()


# SentencePiece encoders cut the text into words before the first space of
# each space run and cache the words; this must not change a single id.
@pytest.fixture(scope="module")
def unsplit_spm(tok_dir, stories_dir):
    spm = Tokenizer.from_gguf(tok_dir / "gguf-vocab" / "ggml-vocab-llama-spm.gguf")
    l2c = Tokenizer.from_llama2c(stories_dir / "tok512.bin")
    for tok in (spm, l2c):
        assert tok._encoder.split_words
        tok._encoder.split_words = False
    return spm, l2c


def test_spm_word_split_is_exact(unsplit_spm, llama_spm, stories, corpus_slices):
    spm, l2c = unsplit_spm
    for text in corpus_slices[::3]:
        assert llama_spm.encode(text) == spm.encode(text)
        assert stories.encode(text) == l2c.encode(text)
    given, st, SETTINGS = hypothesis_parts(60)

    @SETTINGS
    @given(st.lists(st.sampled_from(["a", "b", "ab", " ", "  ", "\n", "the", "é", "🦙", "▁", "3"]),
                    max_size=30).map("".join))
    def check(text):
        assert llama_spm.encode(text) == spm.encode(text)
        assert stories.encode(text) == l2c.encode(text)

    check()


# ---------------------------------------------------------------------------
# streaming
# ---------------------------------------------------------------------------
def _stream(tok, ids, skip_special=True):
    dec = tok.stream_decoder(skip_special=skip_special)
    parts = [dec.push(i) for i in ids]
    return parts, dec.flush()


@pytest.mark.parametrize("name", ALL_TOKENIZERS)
def test_stream_equals_decode_random_ids(request, name):
    tok = request.getfixturevalue(name)
    given, st, SETTINGS = hypothesis_parts(60)
    ids_st = st.lists(st.one_of(st.integers(0, tok.vocab_size - 1),
                                st.integers(0, min(tok.vocab_size, 600) - 1)), max_size=30)

    @SETTINGS
    @given(ids_st, st.booleans())
    def check(ids, skip_special):
        parts, tail = _stream(tok, ids, skip_special)
        assert "".join(parts) + tail == tok.decode(ids, skip_special=skip_special)

    check()


STREAM_TEXTS = [
    "Once upon a time, there was a little girl named Lily.",
    "Grüße aus Köln — naïve café, Cửa Việt, нещо на Български",
    "🚀 (normal) 😶‍🌫️ (multiple emojis concatenated) ✅ 🦙🦙 我想在apple工作1314151天～",
    "កាន់តែពិសេសអាចខលចេញ and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝟙𝟚𝟛 \U0001F468\u200d\U0001F469\u200d\U0001F467",
]


def test_stream_never_splits_characters(any_tok):
    for text in STREAM_TEXTS:
        ids = any_tok.encode(text)
        parts, tail = _stream(any_tok, ids)
        assert "".join(parts) + tail == text == any_tok.decode(ids, skip_special=True)
        assert all("\ufffd" not in p for p in parts)
        assert tail == ""


def test_stream_decoder_is_reusable_after_flush(llama_spm):
    dec = llama_spm.stream_decoder()
    assert isinstance(dec, StreamDecoder)
    for text in ("Hello world", "Hi 🦙"):
        ids = llama_spm.encode(text)
        assert "".join(dec.push(i) for i in ids) + dec.flush() == text


def test_stream_holds_partial_character(gpt2_files_py):
    ids = gpt2_files_py.encode("🦙")
    assert len(ids) > 1  # the emoji is split across byte-level tokens
    dec = gpt2_files_py.stream_decoder()
    assert [dec.push(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert dec.push(ids[-1]) == "🦙"


def test_numpy_ids(any_tok):
    np = pytest.importorskip("numpy")
    ids = any_tok.encode("Hello, world! 🦙")
    for arr in (np.array(ids, dtype=np.int32), np.array(ids, dtype=np.int64)):
        assert any_tok.decode(arr) == any_tok.decode(ids)
        dec = any_tok.stream_decoder(skip_special=False)
        assert "".join(dec.push(i) for i in arr) + dec.flush() == any_tok.decode(ids)


def test_decode_rejects_bad_ids(any_tok):
    for bad in (-1, any_tok.vocab_size, 10**9):
        with pytest.raises(ValueError, match="out of range"):
            any_tok.decode([1, bad])
        with pytest.raises(ValueError, match=rf"token id {bad} is out of range \[0, {any_tok.vocab_size}\)"):
            any_tok.stream_decoder().push(bad)
    with pytest.raises(TypeError, match="token ids must be integers, got float"):
        any_tok.decode([1.5])


def test_decode_matches_hf(qwen3, tok_dir):
    """Byte-level decode reproduces HF's decoder, incl. invalid UTF-8 and specials."""
    tokenizers = pytest.importorskip("tokenizers")
    hf = tokenizers.Tokenizer.from_file(str(tok_dir / "qwen3" / "tokenizer.json"))
    given, st, SETTINGS = hypothesis_parts(60)

    @SETTINGS
    @given(st.lists(st.one_of(st.integers(0, qwen3.vocab_size - 1),
                              st.integers(151640, qwen3.vocab_size - 1),
                              st.integers(0, 300)), max_size=20), st.booleans())
    def check(ids, skip):
        assert qwen3.decode(ids, skip_special=skip) == hf.decode(ids, skip_special_tokens=skip)

    check()


def _spm_tokenizer_json(llama_spm, decoder):
    tokens = [llama_spm.id_to_token(i) for i in range(llama_spm.vocab_size)]
    return {
        "version": "1.0",
        "added_tokens": [{"id": i, "content": tokens[i], "single_word": False,
                          "lstrip": False, "rstrip": False, "normalized": False,
                          "special": True} for i in (0, 1, 2)],
        "normalizer": None, "pre_tokenizer": None, "post_processor": None,
        "decoder": decoder,
        "model": {"type": "WordLevel", "vocab": {t: i for i, t in enumerate(tokens)},
                  "unk_token": "<unk>"},
    }


@pytest.mark.parametrize("decoder", [
    {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
        {"type": "ByteFallback"}, {"type": "Fuse"},
        {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
    {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": True},
], ids=["llama-sequence", "metaspace"])
def test_spm_style_tokenizer_json_decode(llama_spm, tmp_path, decoder):
    """Llama-style tokenizer.json decoders are reproduced from the vocabulary,
    exactly whenever the bytes are valid UTF-8. For invalid bytes both give
    U+FFFD but not the same text: HF's ByteFallback turns a whole run of byte
    tokens into one U+FFFD per byte, even its valid part ("\x00\x80" -> two),
    we decode like Python (one per invalid sequence). Metaspace goes through
    HF's own decoder. Streaming equals decode() for both."""
    tokenizers = pytest.importorskip("tokenizers")
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(_spm_tokenizer_json(llama_spm, decoder)), encoding="utf-8")
    tok = Tokenizer.from_file(path)
    hf = tokenizers.Tokenizer.from_file(str(path))
    given, st, SETTINGS = hypothesis_parts(60)

    @SETTINGS
    @given(st.lists(st.one_of(st.integers(0, 31999), st.integers(0, 300)), max_size=20),
           st.booleans())
    def check(ids, skip):
        ours = tok.decode(ids, skip_special=skip)
        theirs = hf.decode(ids, skip_special_tokens=skip)
        if "\ufffd" in theirs:
            assert "\ufffd" in ours
        else:
            assert ours == theirs
        parts, tail = _stream(tok, ids, skip)
        assert "".join(parts) + tail == ours

    check()
    ids = llama_spm.encode("Hello  world\n", add_bos=False)
    assert tok.decode(ids) == hf.decode(ids)


# ---------------------------------------------------------------------------
# SmolLM2 GGUF (gpt2 BPE, pre "smollm")
# ---------------------------------------------------------------------------
SMOLLM_TEXT = """\
def fibonacci(n: int) -> list[int]:
    a, b = 0, 1
    out = []
    for _ in range(n):   # 3 spaces before the comment
        out.append(a); a, b = b, a + b
    return out

if __name__ == "__main__":
    print(fibonacci(12), 0x1F, 1_000_000, 3.14159e-10, -42, 007)

Digits: 0 12 345 6789 1234567890 3.3 3..3 3...3 ½ ¾ ²³ ٣٤٥ १२३ ①②
Punctuation: !!!!!! ?????? ...... ------======= ''''''```````\"\"\"\" ~!@#$%^&*()_+{}|:<>?
Contractions: I've been 'told he's there, 'RE you sure? 'M not sure I'll make it, 'D you like some tea? We'Ve a'lL
Unicode: naïve café Führer Cửa Việt нещо на Български Ελληνικά עברית العربية हिन्दी 日本語 한국어
Emoji: 🚀 (normal) 😶‍🌫️ (multiple emojis concatenated) ✅ 🦙🦙 👨‍👩‍👧 🇫🇷
Whitespace:\ttab\t\ttabs   spaces\n\n\nnewlines \r\n crlf\u00a0nbsp\u2003emsp   \n    indented
Specials: <|im_start|>user\nHello!<|im_end|>\n<|endoftext|>
"""


def _smollm2_oracle(path):
    """HF tokenizers BPE from the GGUF's vocab/merges (read with the `gguf`
    package) and SmolLM2's own tokenizer.json pre-tokenizer: individual digits,
    then GPT-2 byte-level."""
    gguf = pytest.importorskip("gguf")
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers

    reader = gguf.GGUFReader(str(path))
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    merges = reader.fields["tokenizer.ggml.merges"].contents()
    types = reader.fields["tokenizer.ggml.token_type"].contents()
    hf = tokenizers.Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                                         merges=[tuple(m.split(" ", 1)) for m in merges]))
    hf.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    hf.add_special_tokens([t for t, ty in zip(tokens, types) if ty == 3])
    return hf


@pytest.fixture(scope="module")
def smollm2_oracle(smollm2_gguf):
    return _smollm2_oracle(smollm2_gguf)


@pytest.fixture(scope="module")
def smollm2_text(data_dir):
    prose = (data_dir / "corpora" / "pride_and_prejudice.txt").read_text(encoding="utf-8")
    wiki = (data_dir / "corpora" / "wikitext-2-test.raw.txt").read_bytes().decode("utf-8")
    return SMOLLM_TEXT + prose[10000:12000] + wiki[50000:52000]


def test_smollm2_matches_hf(smollm2_py, smollm2_hf, smollm2_oracle, smollm2_text):
    assert len(smollm2_text.encode("utf-8")) > 4000
    expected = smollm2_oracle.encode(smollm2_text, add_special_tokens=False).ids
    assert smollm2_py.encode(smollm2_text) == expected
    assert smollm2_hf.encode(smollm2_text) == expected
    for line in smollm2_text.splitlines(keepends=True):
        assert smollm2_py.encode(line) == smollm2_oracle.encode(line, add_special_tokens=False).ids


def test_smollm2_round_trip_and_metadata(smollm2_py, smollm2_text):
    assert smollm2_py.decode(smollm2_py.encode(smollm2_text)) == smollm2_text
    assert smollm2_py.vocab_size == 49152
    assert not smollm2_py.add_bos and smollm2_py.bos_id == 1
    im_end = smollm2_py.token_to_id("<|im_end|>")
    assert smollm2_py.eos_ids[0] == im_end == 2
    assert smollm2_py.token_to_id("<|endoftext|>") in smollm2_py.eos_ids
    assert smollm2_py.decode(smollm2_py.encode("<|im_start|>hi<|im_end|>"),
                             skip_special=True) == "hi"


def test_smollm2_chat_template(smollm2_py):
    assert smollm2_py.has_chat_template
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "What is 2+2?"}]
    text = smollm2_py.apply_chat_template(messages, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nYou are terse.<|im_end|>\n"
                    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
                    "<|im_start|>assistant\n")
    assert text.endswith("<|im_start|>assistant\n")
    ids = smollm2_py.encode(text)
    assert ids[0] == smollm2_py.token_to_id("<|im_start|>")
    assert ids.count(smollm2_py.token_to_id("<|im_end|>")) == 2
    # without a system message the template inserts its default one
    text = smollm2_py.apply_chat_template(messages[1:], add_generation_prompt=False)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_end|>\n")


# ---------------------------------------------------------------------------
# llama2.c tokenizer.bin (stories260K tok512.bin)
# ---------------------------------------------------------------------------
def run_c_encode(path, text, bos=True):
    """A literal transcription of llama2.c run.c encode(), the oracle: O(n^2)
    and written independently of cism/tokenizers/spm.py."""
    data = path.read_bytes()
    off = 4
    vocab, scores = [], []
    while off < len(data):
        score, n = struct.unpack_from("<fi", data, off)
        vocab.append(data[off + 8:off + 8 + n])
        scores.append(score)
        off += 8 + n

    def str_lookup(s):
        return vocab.index(s) if s in vocab else -1

    tokens = [1] if bos else []
    raw = text.encode("utf-8")
    if raw:
        tokens.append(str_lookup(b" "))
    buf = b""
    for k, c in enumerate(raw):
        if c & 0xC0 != 0x80:
            buf = b""
        buf += bytes([c])
        if k + 1 < len(raw) and raw[k + 1] & 0xC0 == 0x80 and len(buf) < 4:
            continue
        tid = str_lookup(buf)
        if tid != -1:
            tokens.append(tid)
        else:
            tokens.extend(b + 3 for b in buf)
        buf = b""
    while True:
        best_score, best_id, best_idx = -1e10, -1, -1
        for i in range(len(tokens) - 1):
            tid = str_lookup(vocab[tokens[i]] + vocab[tokens[i + 1]])
            if tid != -1 and scores[tid] > best_score:
                best_score, best_id, best_idx = scores[tid], tid, i
        if best_idx == -1:
            break
        tokens[best_idx:best_idx + 2] = [best_id]
    return tokens


def test_stories_once_upon_a_time(stories, stories_dir):
    expected = run_c_encode(stories_dir / "tok512.bin", "Once upon a time")
    assert expected == [1, 403, 407, 261, 378]  # <s> " Once" " upon" " a" " time"
    assert stories.encode("Once upon a time") == expected
    assert stories.decode(expected, skip_special=True) == "Once upon a time"


@pytest.mark.parametrize("text", [
    "Lily and Ben went to the park. They saw a big red ball!",
    "\"Mom, can I have a cookie?\" asked Tim.\nShe said yes.",
    "Zoë's café — 🦙 x",  # byte fallback for characters outside the 512-token vocabulary
    "",
])
def test_stories_matches_run_c(stories, stories_dir, text):
    expected = run_c_encode(stories_dir / "tok512.bin", text)
    assert stories.encode(text) == expected
    assert stories.decode(expected, skip_special=True) == text


def test_stories_stream_like_run_c(stories):
    """run.c strips the leading space of the piece after BOS."""
    ids = stories.encode("Once upon a time, there was a little girl.")
    parts, tail = _stream(stories, ids)
    assert parts[0] == "" and parts[1] == "Once" and parts[2] == " upon"
    assert "".join(parts) + tail == "Once upon a time, there was a little girl."


# ---------------------------------------------------------------------------
# from_pretrained
# ---------------------------------------------------------------------------
def test_from_pretrained_dispatch(tok_dir, stories_dir, tmp_path, small_tokenizer_json):
    pytest.importorskip("tokenizers")
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "tokenizer.json").write_text(json.dumps(small_tokenizer_json))
    # AddedToken-style entries in tokenizer_config.json
    (hf_dir / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": {"__type": "AddedToken", "content": "ab", "special": True}}))
    tok = Tokenizer.from_pretrained(hf_dir)
    assert tok.vocab_size == 4 and tok.eos_ids == (2,)
    assert Tokenizer.from_pretrained(hf_dir / "tokenizer.json").vocab_size == 4
    assert Tokenizer.from_pretrained(tok_dir / "gpt2").vocab_size == 50257
    gguf_path = tok_dir / "gguf-vocab" / "ggml-vocab-llama-spm.gguf"
    assert Tokenizer.from_pretrained(gguf_path).vocab_size == 32000
    for p in (stories_dir, stories_dir / "stories260K.bin", stories_dir / "tok512.bin"):
        tok = Tokenizer.from_pretrained(p)
        assert tok.vocab_size == 512 and tok.encode("Once")[:2] == [1, 403]
    # vocab.json + merges.txt (HF's names for GPT-2's files)
    shutil.copy(tok_dir / "gpt2" / "encoder.json", tmp_path / "vocab.json")
    shutil.copy(tok_dir / "gpt2" / "vocab.bpe", tmp_path / "merges.txt")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|endoftext|>", "chat_template": "{{ messages[0]['content'] }}"}))
    tok = Tokenizer.from_pretrained(tmp_path)
    assert tok.encode("Hello world") == [15496, 995]
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "x"


def test_from_pretrained_reads_a_version_1_llama2c_header(tmp_path, stories_dir):
    """The tokenizer finds a model's vocab_size with the loaders' llama2.c header
    reader, so the "ak42" version 1 header works too (the tokenizer's own
    parser read any .bin as version 0: vocab_size came out as n_kv_heads)."""
    header = struct.pack("<Ii7iB", 0x616B3432, 1, 64, 172, 5, 8, 4, 512, 512, 1)
    (tmp_path / "model.bin").write_bytes(header.ljust(256, b"\0"))
    shutil.copy(stories_dir / "tok512.bin", tmp_path / "tok512.bin")
    tok = Tokenizer.from_pretrained(tmp_path / "model.bin")
    assert tok.vocab_size == 512 and tok.encode("Once")[:2] == [1, 403]


def test_gguf_tokens_go_through_the_loaders_reader(tmp_path):
    """One GGUF metadata reader: the tokenizer's is the loader's, and a token
    whose bytes are not UTF-8 is refused by name."""
    import cism.loaders.gguf_file
    import cism.tokenizers.gguf
    assert cism.tokenizers.gguf.read_gguf_metadata is cism.loaders.gguf_file.read_gguf_metadata

    def gstr(s):
        return struct.pack("<Q", len(s)) + s

    p = tmp_path / "bad-utf8.gguf"
    p.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 2)
                  + gstr(b"tokenizer.ggml.model") + struct.pack("<I", 8) + gstr(b"llama")
                  + gstr(b"tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, 3)
                  + gstr(b"a") + gstr(b"b") + gstr(b"\xff\xfe"))
    _raises_naming(p, lambda: Tokenizer.from_gguf(p), r"tokenizer\.ggml\.tokens\[2\] is not valid UTF-8")


def test_from_pretrained_errors(tmp_path, stories_dir):
    with pytest.raises(ValueError, match="no tokenizer found"):
        Tokenizer.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="no such file"):
        Tokenizer.from_pretrained(tmp_path / "missing")
    model = tmp_path / "model.bin"
    shutil.copy(stories_dir / "stories260K.bin", model)
    with pytest.raises(ValueError, match="no llama2.c tokenizer"):
        Tokenizer.from_pretrained(model)


# ---------------------------------------------------------------------------
# chat templates
# ---------------------------------------------------------------------------
CONVERSATIONS = [
    [{"role": "user", "content": "Hi é 🦙"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
    [{"role": "system", "content": "S"}, {"role": "user", "content": "a"},
     {"role": "assistant", "content": "<think>\nhm\n</think>\n\nb"},
     {"role": "user", "content": "c"}],
]


@pytest.fixture(scope="module")
def hf_qwen3(tok_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(tok_dir / "qwen3"))


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}])
@pytest.mark.parametrize("gen", [True, False])
def test_qwen3_template_matches_transformers(qwen3, hf_qwen3, messages, kwargs, gen):
    ours = qwen3.apply_chat_template(messages, add_generation_prompt=gen, **kwargs)
    theirs = hf_qwen3.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen,
                                          **kwargs)
    assert ours == theirs


def test_template_features_match_transformers(tmp_path, small_tokenizer_json):
    """bos/eos variables, trim_blocks + lstrip_blocks, loop controls, tojson
    keeping non-ASCII, {% generation %}: rendered as transformers renders them."""
    transformers = pytest.importorskip("transformers")
    template = ("{{ bos_token }}{% for m in messages %}\n"
                "  {% if m['role'] == 'skip' %}{% continue %}{% endif %}\n"
                "  [{{ m['role'] }}] {{ m['content'] | tojson }}\n"
                "  {% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}"
                "{% endgeneration %}{% endif %}\n"
                "{% endfor %}{% if add_generation_prompt %}>>{% endif %}{{ eos_token }}")
    data = dict(small_tokenizer_json)
    data["added_tokens"] = [
        {"id": 4 + k, "content": c, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True} for k, c in enumerate(("<s>", "</s>"))]
    (tmp_path / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template,
        "bos_token": "<s>", "eos_token": "</s>"}), encoding="utf-8")
    ours = Tokenizer.from_file(tmp_path / "tokenizer.json")
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    messages = [{"role": "user", "content": "Grüße \"quoted\""}, {"role": "skip", "content": "x"},
                {"role": "assistant", "content": "ok"}]
    for gen in (True, False):
        assert ours.apply_chat_template(messages, add_generation_prompt=gen) == \
            theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    assert ours.bos_id == 4 and ours.eos_ids == (5,)


def test_template_errors(gpt2_files_py, tmp_path):
    assert not gpt2_files_py.has_chat_template
    with pytest.raises(ValueError, match="no chat template"):
        gpt2_files_py.apply_chat_template([{"role": "user", "content": "x"}])
    # a tiny vocab.json + merges.txt directory whose config carries the template
    (tmp_path / "vocab.json").write_text(json.dumps({"o": 0, "k": 1, "ok": 2}))
    (tmp_path / "merges.txt").write_text("#version: 0.2\no k\n")

    def with_template(template):
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
        return Tokenizer.from_pretrained(tmp_path)

    tok = with_template("{% if messages[0]['role'] != 'user' %}"
                        "{{ raise_exception('user first!') }}{% endif %}ok")
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "ok"
    assert tok.encode("ok") == [2]
    with pytest.raises(ValueError, match="user first!"):
        tok.apply_chat_template([{"role": "system", "content": "x"}])
    # the sandbox refuses access to Python internals
    with pytest.raises(ValueError, match="chat template"):
        with_template("{{ messages.__class__.__mro__ }}").apply_chat_template([])
    with pytest.raises(ValueError, match="does not parse"):
        with_template("{% for %}").apply_chat_template([])


# ---------------------------------------------------------------------------
# malformed files: ValueError naming the file
# ---------------------------------------------------------------------------
def _raises_naming(path, fn, match):
    with pytest.raises(ValueError) as info:
        fn()
    assert str(path) in str(info.value), info.value
    assert re.search(match, str(info.value)), info.value
    return info.value


@pytest.fixture(scope="module")
def small_tokenizer_json():
    vocab = {"a": 0, "b": 1, "ab": 2, "Ġ": 3}
    return {"version": "1.0", "added_tokens": [], "normalizer": None,
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False,
                              "trim_offsets": True, "use_regex": True},
            "post_processor": None,
            "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                        "use_regex": True},
            "model": {"type": "BPE", "vocab": vocab, "merges": ["a b"]}}


def test_small_tokenizer_json_works(tmp_path, small_tokenizer_json):
    pytest.importorskip("tokenizers")
    p = tmp_path / "tokenizer.json"
    p.write_text(json.dumps(small_tokenizer_json))
    tok = Tokenizer.from_file(p)
    assert tok.encode("ab a") == [2, 3, 0]
    assert tok.decode([2, 3, 0]) == "ab a"
    assert not tok.has_chat_template and tok.bos_id is None and tok.eos_ids == ()


@pytest.mark.parametrize("mutate,match", [
    (lambda j: json.dumps(j)[:40], "invalid JSON"),                       # truncated
    (lambda j: "", "invalid JSON"),
    (lambda j: json.dumps([1, 2]), "JSON object"),
    (lambda j: json.dumps({**j, "model": {**j["model"], "vocab": ["a", "b"]}}), "model.vocab"),
    (lambda j: json.dumps({**j, "model": {**j["model"], "vocab": {"a": "0"}}}), "ids must be"),
    (lambda j: json.dumps({**j, "model": {k: v for k, v in j["model"].items() if k != "merges"}}),
     "merges"),
    (lambda j: json.dumps({**j, "model": {**j["model"], "merges": [1]}}), "merges"),
    (lambda j: json.dumps({**j, "model": {**j["model"], "merges": ["a x"]}}), ""),
    (lambda j: json.dumps({**j, "added_tokens": [{"id": "x"}]}), "added_tokens"),
    (lambda j: json.dumps({k: v for k, v in j.items() if k != "model"}), "model"),
])
def test_malformed_tokenizer_json(tmp_path, small_tokenizer_json, mutate, match):
    pytest.importorskip("tokenizers")
    p = tmp_path / "tokenizer.json"
    p.write_text(mutate(small_tokenizer_json))
    _raises_naming(p, lambda: Tokenizer.from_file(p), match)


def test_malformed_tokenizer_config(tmp_path, small_tokenizer_json):
    pytest.importorskip("tokenizers")
    p = tmp_path / "tokenizer.json"
    p.write_text(json.dumps(small_tokenizer_json))
    cfg = tmp_path / "tokenizer_config.json"
    cfg.write_text('{"eos_token": ')
    _raises_naming(cfg, lambda: Tokenizer.from_file(p), "invalid JSON")
    cfg.write_bytes(b"\xff\xfe{}")
    _raises_naming(cfg, lambda: Tokenizer.from_file(p), "UTF-8")


def test_missing_files(tmp_path):
    missing = tmp_path / "nope.json"
    _raises_naming(missing, lambda: Tokenizer.from_gpt2_files(missing, missing), "not found")
    _raises_naming(missing, lambda: Tokenizer.from_gguf(missing), "cannot open: No such file")
    _raises_naming(missing, lambda: Tokenizer.from_llama2c(missing), "not found")


def test_missing_tokenizer_json(tmp_path):
    pytest.importorskip("tokenizers")   # from_file asks for it before it opens the file
    missing = tmp_path / "nope.json"
    _raises_naming(missing, lambda: Tokenizer.from_file(missing), "not found")
    _raises_naming(tmp_path, lambda: Tokenizer.from_file(tmp_path), "directory")


def test_malformed_gpt2_files(tmp_path, tok_dir):
    enc, bpe = tmp_path / "encoder.json", tmp_path / "vocab.bpe"
    shutil.copy(tok_dir / "gpt2" / "encoder.json", enc)
    bpe.write_text("#version: 0.2\n")
    _raises_naming(bpe, lambda: Tokenizer.from_gpt2_files(enc, bpe), "no merges")
    bpe.write_text("#version: 0.2\nĠ t\nthree parts here\n")
    _raises_naming(bpe, lambda: Tokenizer.from_gpt2_files(enc, bpe), "line 3")
    bpe.write_text("#version: 0.2\nĠ t\n")
    enc.write_text('["a", "b"]')
    _raises_naming(enc, lambda: Tokenizer.from_gpt2_files(enc, bpe), "JSON object")
    enc.write_text('{"a": 0, "b": -1}')
    _raises_naming(enc, lambda: Tokenizer.from_gpt2_files(enc, bpe), "non-negative")
    enc.write_text('{"a": 0, "b": ')
    _raises_naming(enc, lambda: Tokenizer.from_gpt2_files(enc, bpe), "invalid JSON")


def test_malformed_tokenizer_bin(tmp_path, stories_dir):
    good = (stories_dir / "tok512.bin").read_bytes()
    offsets = [4]  # where each token record starts
    while offsets[-1] < len(good):
        offsets.append(offsets[-1] + 8 + struct.unpack_from("<i", good, offsets[-1] + 4)[0])
    assert len(offsets) == 513 and offsets[-1] == len(good)
    p = tmp_path / "tokenizer.bin"
    for cut, match in ((len(good) - 2, "truncated .* token 511"),
                       (offsets[300] + 5, "truncated .* token 300"),
                       (offsets[300] + 9, "truncated .* token 300"),
                       (2, "truncated"), (0, "truncated")):
        p.write_bytes(good[:cut])
        _raises_naming(p, lambda: Tokenizer.from_llama2c(p), match)
    # cut at a record boundary: detectable only against the model's vocab_size
    p.write_bytes(good[:offsets[300]])
    _raises_naming(p, lambda: Tokenizer.from_llama2c(p, vocab_size=512), "vocab_size")
    p.write_bytes(struct.pack("<i", -5) + good[4:])
    _raises_naming(p, lambda: Tokenizer.from_llama2c(p), "max_token_length")
    bad = bytearray(good)
    struct.pack_into("<i", bad, 4 + 4, 10**6)  # first token's length
    p.write_bytes(bytes(bad))
    _raises_naming(p, lambda: Tokenizer.from_llama2c(p), "length")


def test_malformed_gguf(tmp_path, tok_dir):
    gguf = pytest.importorskip("gguf")
    good = (tok_dir / "gguf-vocab" / "ggml-vocab-llama-spm.gguf").read_bytes()
    p = tmp_path / "bad.gguf"
    for data, match in ((good[:1000], "truncated"), (good[:len(good) // 2], "truncated"),
                        (b"GGUF", "truncated"), (b"", "truncated"),
                        (b"NOPE" + good[4:], "not a GGUF"),
                        (good[:4] + struct.pack("<I", 1) + good[8:], "version")):
        p.write_bytes(data)
        _raises_naming(p, lambda: Tokenizer.from_gguf(p), match)

    def write(**kv):
        w = gguf.GGUFWriter(str(p), "llama")
        for key, value in kv.items():
            if isinstance(value, str):
                w.add_string(key, value)
            elif isinstance(value, list) and value and isinstance(value[0], str):
                w.add_array(key, value)
            elif isinstance(value, list):
                w.add_array(key, value)
            else:
                w.add_uint32(key, value)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.close()

    write(**{"tokenizer.ggml.model": "gpt2"})
    _raises_naming(p, lambda: Tokenizer.from_gguf(p), "tokenizer.ggml.tokens")
    write(**{"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b"]})
    _raises_naming(p, lambda: Tokenizer.from_gguf(p), "tokenizer.ggml.merges")
    write(**{"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b", "ab"],
             "tokenizer.ggml.merges": ["a b"], "tokenizer.ggml.pre": "no-such-pre"})
    _raises_naming(p, lambda: Tokenizer.from_gguf(p), "no-such-pre")
    write(**{"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b", "ab"],
             "tokenizer.ggml.merges": ["ab"], "tokenizer.ggml.pre": "gpt-2"})
    _raises_naming(p, lambda: Tokenizer.from_gguf(p), "merges")
    write(**{"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]})
    _raises_naming(p, lambda: Tokenizer.from_gguf(p), "unsupported tokenizer.ggml.model")
    write(**{"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a", "b", "c"],
             "tokenizer.ggml.scores": [0.0, 1.0]})
    _raises_naming(p, lambda: Tokenizer.from_gguf(p), "scores")
    write(**{"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a", "b", "c"],
             "tokenizer.ggml.bos_token_id": 7})
    _raises_naming(p, lambda: Tokenizer.from_gguf(p), "bos_token_id")
    write(**{"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": [1, 2, 3]})
    _raises_naming(p, lambda: Tokenizer.from_gguf(p), "tokenizer.ggml.tokens")
    # and a minimal valid one
    write(**{"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b", "ab"],
             "tokenizer.ggml.merges": ["a b"], "tokenizer.ggml.pre": "gpt-2"})
    tok = Tokenizer.from_gguf(p)
    assert tok.encode("abab") == [2, 2] and tok.decode([2, 0]) == "aba"


def test_bad_backend(tok_dir):
    with pytest.raises(ValueError, match="backend"):
        Tokenizer.from_gguf(tok_dir / "gguf-vocab" / "ggml-vocab-gpt-2.gguf", backend="rust")


def test_optional_dependencies(monkeypatch, tok_dir, stories_dir):
    """SentencePiece GGUF and llama2.c need no optional package; the others
    fail with an ImportError that names the extra to install."""
    from cism.tokenizers import deps as _tok_deps

    for name in ("regex", "tokenizers", "jinja2", "gguf"):
        monkeypatch.setitem(__import__("sys").modules, name, None)
    assert Tokenizer.from_llama2c(stories_dir / "tok512.bin").encode("Once")[:2] == [1, 403]
    spm = Tokenizer.from_gguf(tok_dir / "gguf-vocab" / "ggml-vocab-llama-spm.gguf")
    assert spm.decode(spm.encode("Hello world")) == "<s> Hello world"
    hint = r'pip install "cism\[text\]"'
    with pytest.raises(ImportError, match=hint):
        Tokenizer.from_gguf(tok_dir / "gguf-vocab" / "ggml-vocab-gpt-2.gguf")
    with pytest.raises(ImportError, match=hint):
        Tokenizer.from_file(tok_dir / "qwen3" / "tokenizer.json")
    with pytest.raises(ImportError, match=hint):
        _tok_deps.need_jinja2()


def test_gguf_special_token_kinds(tmp_path):
    """Control tokens are cut out of text only with parse_special, user-defined
    ones always; longer special tokens win (llama.cpp's partition order)."""
    gguf = pytest.importorskip("gguf")
    tokens = ["a", "b", "ab", "<c>", "<u>", "<c><u>", "Ġ"]
    types = [1, 1, 1, 3, 4, 3, 1]
    p = tmp_path / "specials.gguf"
    w = gguf.GGUFWriter(str(p), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(["a b"])
    w.add_eos_token_id(3)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    tok = Tokenizer.from_gguf(p)
    assert tok.encode("ab<c><u>a<u>") == [2, 5, 0, 4]
    assert tok.encode("ab<u>a", parse_special=False) == [2, 4, 0]
    assert 3 not in tok.encode("<c>", parse_special=False)
    assert tok.decode([2, 5, 0, 4], skip_special=True) == "aba<u>"
    assert tok.decode([2, 5, 0, 4]) == "ab<c><u>a<u>"
    assert tok.eos_ids == (3,)


def test_gguf_lengths_are_checked_before_reading(tmp_path):
    """A count or length from the header is checked against the file before
    the read: f.read(n) allocates n bytes up front, so a 100-byte file that
    claims a 256 MB array must fail without allocating it (under the fuzz
    harness's address-space cap this was a MemoryError)."""
    import tracemalloc

    def gstr(s):
        return struct.pack("<Q", len(s)) + s

    head = b"GGUF" + struct.pack("<IQQ", 3, 0, 2)
    model = gstr(b"tokenizer.ggml.model") + struct.pack("<I", 8) + gstr(b"llama")
    p = tmp_path / "lies.gguf"
    for lie in (gstr(b"tokenizer.ggml.scores") + struct.pack("<IIQ", 9, 10, 1 << 25),  # u64 array
                gstr(b"tokenizer.ggml.tokens") + struct.pack("<IQ", 8, 1 << 27)):       # one string
        p.write_bytes(head + model + lie + b"\0" * 16)
        tracemalloc.start()
        try:
            _raises_naming(p, lambda: Tokenizer.from_gguf(p), "truncated")
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 16 << 20, peak


def test_tokenizer_json_without_unk_token(tmp_path, small_tokenizer_json):
    """A model that cannot encode "a" (no unk token): loading must not trip on
    the BOS probe, and encoding unknown text is a ValueError naming the file
    (HF raises a bare Exception). Found by tests/fuzz/fuzz_tok_json.py."""
    pytest.importorskip("tokenizers")
    p = tmp_path / "tokenizer.json"
    p.write_text(json.dumps({"model": {"type": "WordLevel", "vocab": {"b": 0}, "unk_token": "?"}}))
    tok = Tokenizer.from_file(p)
    assert not tok.add_bos and tok.encode("b") == [0]
    _raises_naming(p, lambda: tok.encode("a"), "cannot encode")
    p.write_text('{"model": {"yp": "", "vocab": []}}')   # the fuzzer's input
    tok = Tokenizer.from_file(p)
    _raises_naming(p, lambda: tok.encode("a"), "cannot encode")


def test_gguf_deeply_nested_arrays(tmp_path):
    """3000 nested array headers: a ValueError naming the file, not Python's
    RecursionError; four levels (what the checkpoint loader accepts) still read."""
    def gstr(s):
        return struct.pack("<Q", len(s)) + s

    def nested(levels):
        return (b"GGUF" + struct.pack("<IQQ", 3, 0, 2) + gstr(b"x") + struct.pack("<I", 9)
                + struct.pack("<IQ", 9, 1) * (levels - 1) + struct.pack("<IQ", 4, 0)
                + gstr(b"tokenizer.ggml.model") + struct.pack("<I", 8) + gstr(b"bert"))

    p = tmp_path / "deep.gguf"
    p.write_bytes(nested(3000))
    _raises_naming(p, lambda: Tokenizer.from_gguf(p), "nests arrays")
    p.write_bytes(nested(4))
    _raises_naming(p, lambda: Tokenizer.from_gguf(p), "no tokenizer.ggml.tokens")   # read past it
