"""Llama 3 ("llama-bpe") and Qwen2 GGUF tokenizers against llama.cpp's own
conformance vectors, for both BPE backends, plus their BOS/EOS metadata and a
random-text comparison with HF `tokenizers`.

The vocab GGUFs and vectors come from the llama-cpp-python sdist (the
`llamacpp_models` fixture in conftest.py). Oracles never call the code under
test: llama.cpp's .out files; HF tokenizers built from the vocabulary as read
by the `gguf` package, with the pre-tokenizer of Meta's Llama 3
tokenizer.json; Qwen's own tokenizer.json from shared/data.
"""
import pytest

from cism.tokenizers import Tokenizer

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytest.importorskip("regex")

SETTINGS = settings(max_examples=200, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])

BACKENDS = ["python", "hf"]


@pytest.fixture(scope="module")
def load(llamacpp_models):
    """(vocab, backend) -> Tokenizer, each loaded once per module."""
    cache = {}

    def get(vocab, backend):
        if backend == "hf":
            pytest.importorskip("tokenizers")
        if (vocab, backend) not in cache:
            path = llamacpp_models / f"ggml-vocab-{vocab}.gguf"
            cache[vocab, backend] = Tokenizer.from_gguf(path, backend=backend)
        return cache[vocab, backend]

    return get


@pytest.fixture(params=BACKENDS)
def llama3(request, load):
    return load("llama-bpe", request.param)


@pytest.fixture(params=BACKENDS)
def qwen2(request, load):
    return load("qwen2", request.param)


def load_vectors(models, vocab):
    """llama.cpp's test-tokenizer-0 data: each input is followed by
    "\\n__ggml_vocab_test__\\n", so splitting gives the inputs plus a final
    empty one, matched by the empty last line of the .out file."""
    inputs = (models / f"ggml-vocab-{vocab}.gguf.inp").read_text(encoding="utf-8")
    inputs = inputs.split("\n__ggml_vocab_test__\n")
    expected = (models / f"ggml-vocab-{vocab}.gguf.out").read_text(encoding="utf-8").split("\n")
    assert len(inputs) == len(expected) == 47
    return [(text, [int(x) for x in line.split()]) for text, line in zip(inputs, expected)]


# llama.cpp's test tokenizes with add_special=false (no BOS, although Llama 3
# adds one by default) and parse_special=false.
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("vocab", ["llama-bpe", "qwen2"])
def test_llama_cpp_vectors(llamacpp_models, load, vocab, backend):
    tok = load(vocab, backend)
    cases = load_vectors(llamacpp_models, vocab)
    failed = [(text, got, ids) for text, ids in cases
              if (got := tok.encode(text, add_bos=False, parse_special=False)) != ids]
    assert not failed, f"{len(failed)}/{len(cases)} differ; first: {failed[0]!r}"
    for text, ids in cases:
        assert tok.decode(ids) == text


def test_llama3_ignore_merges(llama3):
    """Llama 3 sets ignore_merges: a pre-tokenized word that is itself a token
    is that token, even when no merge sequence reaches it. " việc" is one of
    844 such words in this vocabulary; by merges it would be " vi" "ệ" "c".
    (One vector, "Cửa Việt", fails without the flag.)"""
    assert llama3.encode(" việc", add_bos=False) == [100769]
    assert llama3.id_to_token(100769) == "Ġviá»ĩc"


def test_llama3_metadata(llama3):
    """The vocab GGUF says bos 128000 / eos 128001 but nothing about adding
    BOS: llama.cpp's default for pre "llama-bpe" is to add it, as Meta's
    tokenizer does (<|begin_of_text|>)."""
    assert llama3.vocab_size == 128256
    assert llama3.bos_id == 128000 and llama3.id_to_token(128000) == "<|begin_of_text|>"
    assert llama3.add_bos
    assert llama3.encode("Hello world") == [128000, 9906, 1917]
    assert llama3.encode("Hello world", add_bos=False) == [9906, 1917]
    # <|end_of_text|> is EOS; <|eot_id|> ends a chat turn
    assert llama3.eos_ids == (128001, 128009)
    assert llama3.id_to_token(128009) == "<|eot_id|>"
    assert llama3.decode([128000, 9906, 1917, 128001], skip_special=True) == "Hello world"
    assert llama3.decode([128000, 9906]) == "<|begin_of_text|>Hello"


def test_llama3_special_tokens(llama3):
    text = "<|start_header_id|>user<|end_header_id|>\n\nHi!<|eot_id|>"
    ids = llama3.encode(text, add_bos=False)
    assert ids == [128006, 882, 128007, 271, 13347, 0, 128009]
    assert llama3.decode(ids) == text
    assert llama3.decode(ids, skip_special=True) == "user\n\nHi!"
    plain = llama3.encode(text, add_bos=False, parse_special=False)
    assert not set(plain) & {128006, 128007, 128009}
    assert llama3.decode(plain) == text
    # BOS written in the text is parsed too, and add_bos adds another (llama.cpp
    # does the same; it only warns about the double BOS)
    assert llama3.encode("<|begin_of_text|>Hi") == [128000, 128000, 13347]


def test_qwen2_metadata(qwen2):
    """The Qwen2 vocab names bos 151643 (<|endoftext|>) but Qwen adds no BOS:
    the file does not say add_bos and llama.cpp's default for "qwen2" is off."""
    assert qwen2.vocab_size == 151936
    assert qwen2.bos_id == 151643 and not qwen2.add_bos
    assert qwen2.encode("Hello world") == [9707, 1879]
    assert qwen2.eos_ids == (151643, 151645)
    assert qwen2.has_chat_template
    text = "<|im_start|>user\nHi<|im_end|>"
    ids = qwen2.encode(text)
    assert ids[0] == 151644 and ids[-1] == 151645 and qwen2.decode(ids) == text


# ---------------------------------------------------------------------------
# random text against HF tokenizers
# ---------------------------------------------------------------------------
# Meta's Llama 3 tokenizer.json pre-tokenizer regex, as HF writes it (with
# "(?i:...)" where llama.cpp spells the case classes out).
HF_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                   r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

ALPHABET = st.sampled_from(
    list("aZ09 ,.;:'\"!?-_()[]{}<>/\\|\n\t\r") +
    ["'s", "'S", "'LL", "'Ve", "'ſ", "  ", "\r\n", "123", "12345", "é", "ß", "ﬁ", "½", "²",
     "٣", "नमस्ते", "日本", "🦙", "😶‍🌫️", "\u200d", "\x00", "\u2581", "\u00a0", "\u2003",
     " việc", "Việt", "ǅ", "İ", "K"])


@pytest.fixture(scope="module")
def llama3_oracle(llamacpp_models):
    """HF tokenizers with the vocabulary and merges of the GGUF (read with the
    `gguf` package) and the model and pre-tokenizer settings of Meta's
    tokenizer.json: BPE with ignore_merges, Split(regex, isolated), ByteLevel
    without its own regex."""
    gguf = pytest.importorskip("gguf")
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import Regex, models, pre_tokenizers

    reader = gguf.GGUFReader(str(llamacpp_models / "ggml-vocab-llama-bpe.gguf"))
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    merges = reader.fields["tokenizer.ggml.merges"].contents()
    hf = tokenizers.Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                                         merges=[tuple(m.split(" ", 1)) for m in merges],
                                         ignore_merges=True))
    hf.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(HF_LLAMA3_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return hf


@pytest.fixture(scope="module")
def qwen_oracle(data_dir):
    """Qwen's own tokenizer.json (Qwen3's, whose BPE vocabulary and merges are
    Qwen2's; only added tokens differ). It NFC-normalises its input."""
    tokenizers = pytest.importorskip("tokenizers")
    return tokenizers.Tokenizer.from_file(str(data_dir / "tokenizers" / "qwen3" / "tokenizer.json"))


@pytest.fixture(scope="module")
def wiki_raw(data_dir):
    # the CRLF file as is: "\r\n" runs are where the pre-tokenizers differ most
    return (data_dir / "corpora" / "wikitext-2-test.raw.txt").read_bytes().decode("utf-8")[:200000]


def test_llama3_matches_hf(llama3, llama3_oracle, wiki_raw):
    expected = llama3_oracle.encode(wiki_raw, add_special_tokens=False).ids
    assert llama3.encode(wiki_raw, add_bos=False, parse_special=False) == expected

    @SETTINGS
    @given(st.lists(ALPHABET, max_size=40).map("".join))
    def check(text):
        expected = llama3_oracle.encode(text, add_special_tokens=False).ids
        assert llama3.encode(text, add_bos=False, parse_special=False) == expected
        assert llama3.decode(expected) == text

    check()


def test_qwen2_matches_hf(qwen2, qwen_oracle, wiki_raw):
    import unicodedata

    expected = qwen_oracle.encode(wiki_raw, add_special_tokens=False).ids
    assert qwen2.encode(wiki_raw, parse_special=False) == expected

    @SETTINGS
    @given(st.lists(ALPHABET, max_size=40).map(lambda s: unicodedata.normalize("NFC", "".join(s))))
    def check(text):
        expected = qwen_oracle.encode(text, add_special_tokens=False).ids
        assert qwen2.encode(text, parse_special=False) == expected
        assert qwen2.decode(expected) == text

    check()
