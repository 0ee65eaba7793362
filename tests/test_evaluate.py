"""cism.evaluate: the perplexity protocol as a library. It is what `cism
perplexity` prints (bit for bit, every JSON key), and it is llama-perplexity's
protocol computed here independently in NumPy from model.logits_all."""
import json
import math

import numpy as np
import pytest

import cism
from cism import cli, evaluate


@pytest.fixture(scope="module")
def model(stories):
    return cism.load(stories, threads=2)


@pytest.fixture(scope="module")
def model_int8(stories):
    return cism.load(stories, precision="int8", threads=2)


@pytest.fixture(scope="module")
def text_file(data_dir, tmp_path_factory):
    f = tmp_path_factory.mktemp("evaluate") / "t.txt"
    f.write_text((data_dir / "corpora" / "tinyshakespeare.txt").read_text()[:4000])
    return f


def run_cli(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


def test_equals_cli_json_bit_for_bit(stories, model, model_int8, text_file, tmp_path, capsys):
    want = run_cli(capsys, "perplexity", "--model", stories, "--file", text_file, "--ctx", 64, "--json")
    r = evaluate.perplexity(model, cli.read_text(text_file), ctx=64)
    r.model, r.normalize_newlines = str(stories), False
    # through JSON as the CLI prints it: same keys, same order, same floats
    assert list(json.loads(json.dumps(r.to_dict())).items()) == list(want.items())

    base = tmp_path / "base.npy"
    run_cli(capsys, "perplexity", "--model", stories, "--file", text_file, "--ctx", 64, "--chunks", 5,
            "--save-kl-base", base, "--json")
    want = run_cli(capsys, "perplexity", "--model", stories, "--file", text_file, "--ctx", 64, "--chunks", 5,
                   "--precision", "int8", "--kl-base", base, "--json")
    lib_base = tmp_path / "lib_base.npy"
    evaluate.perplexity(model, cli.read_text(text_file), ctx=64, chunks=5, save_kl_base=lib_base)
    assert np.array_equal(np.load(lib_base), np.load(base))
    r = evaluate.perplexity(model_int8, cli.read_text(text_file), ctx=64, chunks=5, kl_base=lib_base)
    r.model, r.normalize_newlines = str(stories), False
    assert "kld" in want and list(json.loads(json.dumps(r.to_dict())).items()) == list(want.items())


def numpy_protocol(model, base_model, text, ctx):
    """llama-perplexity's protocol from the models' logits, written apart from
    cism.evaluate: BOS + the text's tokens, windows of ctx with BOS first,
    the second half of each scored; KL of model from base on those rows."""
    ids = [1] + model.tokenizer.encode(text, add_bos=False, parse_special=False)
    nll, kl, same = [], [], []
    for c in range(len(ids) // ctx):
        w = [1] + ids[c * ctx + 1:(c + 1) * ctx]
        rows = [model.logits_all(w).astype(np.float64), base_model.logits_all(w).astype(np.float64)]
        for i in range(ctx // 2, ctx - 1):
            lp, ref = [r[i] - r[i].max() - math.log(np.exp(r[i] - r[i].max()).sum()) for r in rows]
            nll.append(-lp[w[i + 1]])
            kl.append(float(np.sum(np.exp(ref) * (ref - lp))))
            same.append(lp.argmax() == ref.argmax())
    return len(ids), np.array(nll), np.array(kl), np.mean(same)


def test_equals_numpy_protocol(model, model_int8, text_file):
    text = cli.read_text(text_file)
    n_ids, nll, kl, agree = numpy_protocol(model_int8, model, text, 64)
    r = evaluate.kl_divergence(model_int8, model, text, ctx=64)
    assert r.text_tokens == n_ids and r.chunks == n_ids // 64 and r.tokens_scored == len(nll) == 31 * r.chunks
    np.testing.assert_allclose(r.nll, nll, rtol=1e-12, atol=1e-12)
    assert r.mean_nll == pytest.approx(nll.mean(), rel=1e-12)
    assert r.ppl == pytest.approx(math.exp(nll.mean()), rel=1e-12)
    assert r.ppl_error == pytest.approx(r.ppl * nll.std(ddof=1) / math.sqrt(len(nll)), rel=1e-9)
    np.testing.assert_allclose(r.kl, kl, rtol=1e-9, atol=1e-12)
    assert r.kld["mean"] == pytest.approx(kl.mean(), rel=1e-9)
    assert r.kld["p99"] == pytest.approx(np.percentile(kl, 99), rel=1e-9)
    assert r.kld["max"] == pytest.approx(kl.max(), rel=1e-9)
    assert r.top1_agreement == agree
    assert 0 < r.kld["mean"] < 0.05


def test_kl_divergence_routes(model, model_int8, text_file, tmp_path):
    text = cli.read_text(text_file)
    same = evaluate.kl_divergence(model, model, text, ctx=64, chunks=3)
    assert same.kld["max"] == 0 and same.top1_agreement == 1
    # a base model (float64 log-probabilities) against saved ones (float16)
    base = tmp_path / "b.npy"
    evaluate.perplexity(model, text, ctx=64, chunks=3, save_kl_base=base)
    live = evaluate.kl_divergence(model_int8, model, text, ctx=64, chunks=3)
    saved = evaluate.kl_divergence(model_int8, str(base), text, ctx=64, chunks=3)
    assert live.ppl == saved.ppl
    assert abs(live.kld["mean"] - saved.kld["mean"]) < 1e-3
    arr = evaluate.kl_divergence(model_int8, np.load(base), text, ctx=64, chunks=3)
    assert arr.kld == saved.kld
    with pytest.raises(evaluate.EvaluationError, match="need at least"):
        evaluate.kl_divergence(model_int8, base, text, ctx=32, chunks=3)


def test_ids_progress_and_cancel(model, text_file):
    text = cli.read_text(text_file)
    full = evaluate.perplexity(model, text, ctx=64)
    ids = [1] + model.tokenizer.encode(text, add_bos=False, parse_special=False)
    assert evaluate.perplexity(model, ids, ctx=64).to_dict() == full.to_dict()
    seen = []
    r = evaluate.perplexity(model, text, ctx=64, progress=lambda d, t, p: seen.append((d, t, p)))
    assert [d for d, _, _ in seen] == list(range(1, full.chunks + 1))
    assert seen[-1][1] == full.chunks and seen[-1][2] == pytest.approx(full.ppl, rel=1e-12)
    assert not r.cancelled

    # returning False stops after that window: the figures of the windows done
    r = evaluate.perplexity(model, text, ctx=64, progress=lambda d, t, p: d < 3)
    assert r.cancelled and r.chunks == 3 and r.to_dict()["cancelled"]
    part = evaluate.perplexity(model, text, ctx=64, chunks=3)
    assert (r.ppl, r.tokens_scored) == (part.ppl, part.tokens_scored)
    with pytest.raises(evaluate.EvaluationError, match="less than one window"):
        evaluate.perplexity(model, "a b c", ctx=64)
