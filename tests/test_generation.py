"""Text generation: generate/stream, stop strings, logprobs, knobs, and the
cism command end to end."""
import json
import math
import subprocess
import sys

import numpy as np
import pytest

import cism
from cism import cli


@pytest.fixture(scope="module")
def model(stories):
    return cism.load(stories, threads=2)


def test_generate_equals_session_tokens_and_stream(model):
    tok = model.tokenizer
    ids = tok.encode("Once upon a time")
    want = model.create_session(ids, 40, eos=list(tok.eos_ids)).next_tokens(40)
    r = model.generate("Once upon a time", max_new_tokens=40)
    assert r.tokens == want and r.prompt_tokens == len(ids)
    assert r.text == tok.decode(want, skip_special=True)
    pieces = list(stream := model.stream("Once upon a time", max_new_tokens=40))
    assert "".join(pieces) == r.text and stream.result.tokens == want
    # sampled, with a seed: the same stream as a session
    s = model.create_session(ids, 30, temperature=0.9, top_k=40, seed=5, eos=list(tok.eos_ids))
    assert model.generate("Once upon a time", 30, temperature=0.9, top_k=40, seed=5).tokens == s.next_tokens(30)
    # speculation: identical tokens
    assert model.generate("Once upon a time", max_new_tokens=40, spec_k=4).tokens == want


def test_stop_strings_cut_exactly(model):
    full = model.generate("Once upon a time", max_new_tokens=60).text
    stop = full[10:14]
    cut = full.index(stop)
    r = model.generate("Once upon a time", max_new_tokens=60, stop=[stop, "zzzz"])
    assert r.text == full[:cut] and r.finish_reason == "stop" and r.stop_string == stop
    assert "".join(model.stream("Once upon a time", max_new_tokens=60, stop=stop)) == full[:cut]


def test_logprobs_are_the_models(model):
    tok = model.tokenizer
    r = model.generate("Lily", max_new_tokens=5, logprobs=True)
    s = model.create_session(tok.encode("Lily"), 5)
    s.prefill()
    for t, lp in zip(r.tokens, r.logprobs):
        z = s.last_logits.astype(np.float64)
        want = z[t] - z.max() - math.log(np.exp(z - z.max()).sum())
        assert abs(lp - want) < 1e-9
        s.next_tokens(1)


def test_knobs_change_only_when_used(model):
    base = model.generate("Once upon a time", 40, temperature=0.8, seed=1)
    assert model.generate("Once upon a time", 40, temperature=0.8, seed=1, min_p=0.0,
                          repetition_penalty=1.0).tokens == base.tokens
    pen = model.generate("Once upon a time", 40, repetition_penalty=1.5)
    assert pen.tokens != model.generate("Once upon a time", 40).tokens
    with pytest.raises(ValueError, match="repetition_penalty"):
        model.generate("Once upon a time", 10, repetition_penalty=1.2, spec_k=4)


def run_cli(*argv, capsys):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_generate_json_and_stream(stories, capsys):
    code, out, err = run_cli("generate", "--model", stories, "--prompt", "Once upon a time",
                             "--max-new-tokens", 20, "--json", capsys=capsys)
    assert code == 0
    r = json.loads(out)
    assert r["finish_reason"] == "length" and len(r["tokens"]) == 20
    code, out2, err2 = run_cli("generate", "--model", stories, "--prompt", "Once upon a time",
                               "--max-new-tokens", 20, capsys=capsys)
    assert code == 0 and out2 == r["text"] + "\n" and "tok/s" in err2


def test_cli_perplexity_equals_nll(stories, data_dir, tmp_path, capsys, model):
    text = (data_dir / "corpora" / "tinyshakespeare.txt").read_text()[:3000]
    f = tmp_path / "t.txt"
    f.write_text(text)
    code, out, _ = run_cli("perplexity", "--model", stories, "--file", f, "--ctx", 64, "--json",
                           capsys=capsys)
    assert code == 0
    r = json.loads(out)
    # llama-perplexity's protocol by hand: the text less its final newline,
    # tokenized with BOS in front; windows of 64 of that, each with BOS as
    # its first token; the second half scored
    read = text[:-1] if text.endswith("\n") else text
    ids = [1] + model.tokenizer.encode(read, add_bos=False, parse_special=False)
    nlls = []
    for c in range(len(ids) // 64):
        w = [1] + ids[c * 64 + 1:(c + 1) * 64]
        z = model.logits_all(w).astype(np.float64)
        for i in range(32, 63):
            row = z[i]
            nlls.append(row.max() + math.log(np.exp(row - row.max()).sum()) - row[w[i + 1]])
    assert r["tokens_scored"] == len(nlls)
    assert abs(r["ppl"] - math.exp(np.mean(nlls))) < 1e-9 * r["ppl"]
    # KL against itself is zero, against int8 small and positive
    base = tmp_path / "base.npy"
    assert run_cli("perplexity", "--model", stories, "--file", f, "--ctx", 64, "--save-kl-base", base,
                   "--json", capsys=capsys)[0] == 0
    code, out, _ = run_cli("perplexity", "--model", stories, "--file", f, "--ctx", 64, "--precision", "int8",
                           "--kl-base", base, "--json", capsys=capsys)
    k = json.loads(out)
    assert code == 0 and 0 < k["kld"]["mean"] < 0.05 and k["top1_agreement"] > 0.8


def test_cli_bench_and_info(stories, capsys):
    code, out, _ = run_cli("bench", "--model", stories, "--precision", "fp32", "int8", "--threads", 1,
                           "--repeats", 1, "--decode-tokens", 8, "--prompt", 32, "--json", capsys=capsys)
    r = json.loads(out)
    assert code == 0 and [x["precision"] for x in r["results"]] == ["fp32", "int8"]
    assert all(x["decode_tok_s"] > 0 and x["prefill_tok_s"] > 0 and x["roofline_ratio"] > 0
               for x in r["results"])
    code, out, _ = run_cli("info", "--model", stories, "--json", capsys=capsys)
    info = json.loads(out)
    assert code == 0 and info["model"]["config"]["vocab"] == 512 and info["isa"]


@pytest.mark.parametrize("argv,message", [
    (["generate", "--model", "/nonexistent/x", "--prompt", "hi"], "does not exist"),
    (["perplexity", "--model", "{stories}", "--file", "/nonexistent.txt"], "cannot read"),
    (["perplexity", "--model", "{stories}", "--file", "{stories}"], "not UTF-8"),
    (["perplexity", "--model", "{stories}", "--file", "{short}", "--ctx", "4096"], "less than one window"),
    (["generate", "--model", "{bad}", "--prompt", "hi"], "config"),
    (["generate", "--model", "{stories}", "--prompt", "hi", "--temperature", "-1"], "temperature"),
    (["generate", "--model", "{stories}", "--prompt", "hi", "--chat"], "chat template"),
    (["generate", "--model", "{stories}"], "--prompt"),
])
def test_cli_errors_are_one_line(argv, message, stories, tmp_path, capsys):
    short = tmp_path / "short.txt"
    short.write_text("a b c")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    argv = [a.format(stories=stories, short=short, bad=bad) for a in argv]
    code, out, err = run_cli(*argv, capsys=capsys)
    assert code != 0
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_cli_bad_flags_exit_2():
    r = subprocess.run([sys.executable, "-m", "cism.cli", "generate", "--threads", "many"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "invalid int value" in r.stderr and "Traceback" not in r.stderr


def test_cli_default_model_chat(smollm2_gguf, capsys):
    code, out, err = run_cli("generate", "--chat", "--prompt", "What is the capital of France?",
                             "--max-new-tokens", 24, "--precision", "int8", capsys=capsys)
    assert code == 0 and "Paris" in out
