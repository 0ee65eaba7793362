"""`cism perplexity` reads its file as llama-perplexity does: the bytes as
they are (CRLF stays CRLF) less one final "\\n"; --normalize-newlines turns
CRLF into LF first. On WikiText-2's CRLF test file (SmolLM2 as an F32 GGUF,
ctx 512, 20 windows) llama.cpp reads 27.8419 and cism 27.8422, 26.9262 when
normalised: the default must be llama.cpp's for the figures to compare."""
import json

import pytest

from cism import cli


@pytest.fixture(scope="module")
def stories(data_dir):
    return data_dir / "models" / "stories260K" / "stories260K.bin"


def test_read_text_keeps_crlf(tmp_path):
    f = tmp_path / "t.txt"
    f.write_bytes(b"one\r\ntwo\r\n\r\nthree\r\n")
    # llama.cpp's -f drops one final "\n", here leaving the CR before it
    assert cli.read_text(f) == "one\r\ntwo\r\n\r\nthree\r"
    assert cli.read_text(f, normalize_newlines=True) == "one\ntwo\n\nthree"
    f.write_bytes(b"a lone\rCR and\n\n")
    assert cli.read_text(f) == "a lone\rCR and\n"
    assert cli.read_text(f, normalize_newlines=True) == "a lone\rCR and\n"
    f.write_bytes(b"")
    assert cli.read_text(f) == ""


def _ppl(path, stories, capsys, *extra):
    code = cli.main(["perplexity", "--model", str(stories), "--file", str(path), "--ctx", "64",
                     "--json", *extra])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


def test_crlf_is_kept_by_default(stories, data_dir, tmp_path, capsys):
    # Moby Dick has CRLF line ends; a slice of it and its LF twin
    raw = (data_dir / "corpora" / "moby_dick.txt").read_bytes()[20000:23000]
    assert raw.count(b"\r\n") > 40
    crlf, lf = tmp_path / "crlf.txt", tmp_path / "lf.txt"
    crlf.write_bytes(raw)
    lf.write_bytes(raw.replace(b"\r\n", b"\n"))

    kept = _ppl(crlf, stories, capsys)
    normalised = _ppl(crlf, stories, capsys, "--normalize-newlines")
    plain = _ppl(lf, stories, capsys)
    assert not kept["normalize_newlines"] and normalised["normalize_newlines"]
    # every CR is one more token (this vocabulary spells it as byte <0x0D>)
    assert kept["text_tokens"] == plain["text_tokens"] + raw.count(b"\r\n")
    assert kept["ppl"] != plain["ppl"]
    # the flag gives exactly the LF file's figures
    for key in ("text_tokens", "chunks", "tokens_scored", "ppl", "mean_nll"):
        assert normalised[key] == plain[key], key
    # and changes nothing on a file without CRs
    assert _ppl(lf, stories, capsys, "--normalize-newlines")["ppl"] == plain["ppl"]


def test_tokens_as_llama_perplexity(stories, tmp_path, capsys):
    """BOS in front of the whole text (the first window is BOS and the
    text's first 63 tokens), and special-token text such as "<s>" stays text,
    as llama.cpp's common_tokenize(add_special=true, parse_special=false)."""
    import cism

    tok = cism.load(stories).tokenizer
    assert tok.add_bos and tok.bos_id == 1
    text = "Once upon a time <s> there was a cat.</s>\n" * 40
    f = tmp_path / "t.txt"
    f.write_text(text)
    ids = [1] + tok.encode(text[:-1], add_bos=False, parse_special=False)
    assert 1 not in ids[1:] and 2 not in ids
    r = _ppl(f, stories, capsys)
    assert r["text_tokens"] == len(ids) and r["chunks"] == len(ids) // 64
