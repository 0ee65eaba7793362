"""bench/quality.py reads llama-perplexity's output and base file; these tests
feed it both as llama.cpp writes them (no llama.cpp needed)."""
import numpy as np
import pytest

from bench_scripts import load_script


@pytest.fixture(scope="module")
def quality():
    return load_script("quality")


def test_plain_run(quality):
    out = ("0.38.042.814 I perplexity: 30.91 seconds per pass - ETA 3.06.771.829 "
           "I Final estimate: PPL = 27.8419 +/- 1.22027\n")
    assert quality.parse_llama(out) == {"ppl": 27.8419, "ppl_error": 1.22027}


def test_kl_divergence_run(quality):
    out = """====== Perplexity statistics ======
Mean PPL(Q)                   :  29.397564 ±   1.300648
Mean PPL(base)                :  27.841900 ±   1.220270
Mean PPL(Q)/PPL(base)         :   1.055871 ±   0.005506

====== KL divergence statistics ======
Mean    KLD:   0.058952 ±   0.001106
Maximum KLD:   3.201450
99.9%   KLD:   1.300000
99.0%   KLD:   0.401479
Median  KLD:   0.020000

====== Token probability statistics ======
99.0%   Δp: 13.838%
Same top p: 84.725 ± 0.504 %
"""
    r = quality.parse_llama(out)
    assert r["ppl"] == 29.397564 and r["ppl_error"] == 1.300648   # PPL(Q), not PPL(base)
    assert r["kld"] == 0.058952 and r["kld_error"] == 0.001106
    assert r["kld_p99"] == 0.401479
    assert r["top1"] == pytest.approx(0.84725) and r["top1_error"] == pytest.approx(0.00504)


def test_output_without_figures_fails(quality):
    with pytest.raises(RuntimeError, match="ppl"):
        quality.parse_llama("perplexity: tokenizing the input ..\n")


def test_base_file_tokens(quality, tmp_path):
    # "_logits_", n_ctx, n_vocab, n_chunk, the tokens, then log-probabilities
    tokens = np.arange(3 * 8, dtype=np.int32) * 7
    path = tmp_path / "base.kld"
    path.write_bytes(b"_logits_" + np.array([8, 50, 3], np.int32).tobytes() + tokens.tobytes()
                     + b"\0" * 64)
    assert (quality.llama_base_tokens(str(path)) == tokens).all()
    path.write_bytes(b"not-logits" + b"\0" * 64)
    with pytest.raises(RuntimeError, match="base file"):
        quality.llama_base_tokens(str(path))


def test_route_names(quality):
    assert quality.route_name("int8/int8") == "int8 x int8"
    assert quality.route_name("int8/fp32") == "int8"
    assert quality.route_name("hybrid-fp4") == "hybrid-fp4"
    cmd = quality.cism_command(type("A", (), {"ctx": 512, "chunks": 20, "threads": 2}), "m.gguf", "t.txt",
                               "auto/int8", "b.npy", save=False)
    assert cmd[cmd.index("--precision") + 1] == "auto" and cmd[cmd.index("--act-precision") + 1] == "int8"
    assert cmd[-2:] == ["--kl-base", "b.npy"] and "--normalize-newlines" not in cmd
