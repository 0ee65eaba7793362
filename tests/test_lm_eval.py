"""cism as an lm-evaluation-harness backend, against lm-eval's own HF backend
on the same weights: a tiny Llama (random weights, GPT-2's tokenizer) saved
by transformers, which cism loads as an HF directory. Two local tasks built
here from the shared corpora (no hub): last-word cloze sentences with four
choices, and paragraphs scored by loglikelihood_rolling (word perplexity)."""
import json
import os
from pathlib import Path

import numpy as np
import pytest

# local files only: lm-eval's datasets must never reach for the hub
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("transformers")

import cism  # noqa: E402
import cism.lm_eval  # noqa: E402,F401  (registers "cism")
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from bench_scripts import load_script  # noqa: E402

# the cloze task bench/evaluate.py times, built by the same code
_common = load_script("bench_common")
cloze_docs, cloze_sentences, write_choice_task = (_common.cloze_docs, _common.cloze_sentences,
                                                  _common.write_choice_task)

MAX_LENGTH = 128   # short windows, so the rolling task spans several per paragraph


@pytest.fixture(scope="module")
def hf_dir(data_dir, tmp_path_factory):
    """A 2-layer Llama with GPT-2's vocabulary and tokenizer, in transformers'
    own save_pretrained layout. Weights drawn with std 0.2 (not 0.02) so the
    next-token distributions are far from uniform and the choices' scores
    are far apart compared with float32 rounding."""
    import torch
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    gpt2 = data_dir / "tokenizers" / "gpt2"
    vocab = json.loads((gpt2 / "encoder.json").read_text(encoding="utf-8"))
    lines = (gpt2 / "vocab.bpe").read_text(encoding="utf-8").split("\n")[1:]
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split()) for m in lines if m.strip()]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken("<|endoftext|>", special=True)])
    eot = vocab["<|endoftext|>"]
    out = tmp_path_factory.mktemp("lm_eval") / "tiny-llama"
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True, initializer_range=0.2, bos_token_id=eot, eos_token_id=eot)
    LlamaForCausalLM(config).eval().save_pretrained(out, safe_serialization=True)
    PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<|endoftext|>",
                            eos_token="<|endoftext|>").save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def task_dir(data_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("tasks")
    write_choice_task(d, "cism_cloze", cloze_docs(cloze_sentences(data_dir)[:400:10], 4))   # 40 questions
    paragraphs = (data_dir / "corpora" / "pride_and_prejudice.txt").read_text(encoding="utf-8").split("\n\n")
    paragraphs = [p.strip() for p in paragraphs if 300 < len(p) < 900][:6]
    with open(d / "paragraphs.jsonl", "w") as f:
        for p in paragraphs:
            f.write(json.dumps({"text": p}) + "\n")
    (d / "cism_paragraphs.yaml").write_text(f"""task: cism_paragraphs
dataset_path: json
dataset_kwargs:
  data_files:
    test: {d / "paragraphs.jsonl"}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
""")
    return d


def evaluate(model, model_args, task_dir, tasks=("cism_cloze", "cism_paragraphs")):
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=list(tasks),
                                   task_manager=TaskManager(include_path=str(task_dir), include_defaults=False),
                                   bootstrap_iters=0, log_samples=True, batch_size=1, device="cpu")


def per_request(results, task):
    """Every request's response in doc and choice order."""
    docs = sorted(results["samples"][task], key=lambda s: s["doc_id"])
    return [r for s in docs for r in s["resps"]]


@pytest.fixture(scope="module")
def hf_results(hf_dir, task_dir):
    return evaluate("hf", f"pretrained={hf_dir},dtype=float32,max_length={MAX_LENGTH}", task_dir)


def test_cism_equals_hf_backend(hf_dir, task_dir, hf_results):
    got = evaluate("cism", f"pretrained={hf_dir},precision=fp32,threads=2,max_length={MAX_LENGTH}", task_dir)
    want = hf_results
    assert got["results"]["cism_cloze"]["acc,none"] == want["results"]["cism_cloze"]["acc,none"]
    # the choices' loglikelihoods (and whether each was greedy)
    a, b = per_request(got, "cism_cloze"), per_request(want, "cism_cloze")
    assert len(a) == len(b) == 160
    ll_a, ll_b = np.array([r[0][0] for r in a]), np.array([r[0][0] for r in b])
    assert np.abs(ll_a - ll_b).max() < 1e-3
    assert [r[0][1] for r in a] == [r[0][1] for r in b]
    # the paragraphs' rolling loglikelihoods and word perplexity
    ra, rb = per_request(got, "cism_paragraphs"), per_request(want, "cism_paragraphs")
    assert np.abs(np.array(ra, float).ravel() - np.array(rb, float).ravel()).max() < 1e-3
    wa = got["results"]["cism_paragraphs"]["word_perplexity,none"]
    wb = want["results"]["cism_paragraphs"]["word_perplexity,none"]
    assert abs(wa / wb - 1) < 0.005


def test_fork_equals_recompute(hf_dir, task_dir):
    """Forking each question's context in the paged pool scores exactly what
    logits_all over context + continuation does."""
    model = cism.load(hf_dir, threads=2)
    forked = evaluate(cism.lm_eval.CismLM(pretrained=model), None, task_dir, ["cism_cloze"])
    alone = evaluate(cism.lm_eval.CismLM(pretrained=model, fork=False), None, task_dir, ["cism_cloze"])
    assert per_request(forked, "cism_cloze") == per_request(alone, "cism_cloze")


def test_generate_until_is_model_generate(data_dir):
    model = cism.load(data_dir / "models" / "stories260K" / "stories260K.bin", threads=2)
    lm = cism.lm_eval.CismLM(pretrained=model)
    full = model.generate("Once upon a time", max_new_tokens=60).text
    stop = full[20:24]
    reqs = [Instance("generate_until", {}, ("Once upon a time", {"until": [stop], "max_gen_toks": 60}), 0),
            Instance("generate_until", {}, ("Once upon a time", {"until": ["zzz"], "max_gen_toks": 12}), 1),
            Instance("generate_until", {}, ("Lily", {"until": ["."], "do_sample": True, "temperature": 0.8,
                                                     "max_gen_toks": 40}), 2)]
    got = lm.generate_until(reqs, disable_tqdm=True)
    assert got[0] == full[:full.index(stop)]
    assert got[1] == model.generate("Once upon a time", max_new_tokens=12).text
    assert got[2] == model.generate("Lily", max_new_tokens=40, temperature=0.8, stop=["."]).text


# ------------------------------------------------------- every family ---
# The dense checkpoint above, and a Surjo and an FWKV checkpoint with the same
# GPT-2 tokenizer (random weights as their own tests draw them, saved as the
# loaders read them), run through simple_evaluate by path: multiple choice,
# rolling loglikelihood and generate_until. Each answer is checked against the
# family's own calls: logits_all (the same float32 logits, so the scores are
# equal exactly), nll (its own float64 sum of the same logits, within 1e-9
# relative) and greedy next-token logits for generation.

FAMILY_MAX_LENGTH = 512   # every paragraph fits in one rolling window


@pytest.fixture(scope="module")
def family_dirs(hf_dir, tmp_path_factory):
    import shutil

    import safetensors.numpy
    from cism.surjo import Config as SurjoConfig
    from reference import surjo as surjo_ref
    from test_fwkv import config as fwkv_config, weights as fwkv_weights
    from test_surjo import CASES, ref_config as surjo_ref_config

    vocab = json.loads((hf_dir / "config.json").read_text())["vocab_size"]
    fwkv = fwkv_config(vocab=vocab)
    surjo = SurjoConfig(**dict(CASES["gqa-p2-k4"], vocab=vocab, context=512))
    dirs = {"dense": hf_dir}
    root = tmp_path_factory.mktemp("families")
    for name, config, weights in (("fwkv", fwkv, fwkv_weights(fwkv)),
                                  ("surjo", surjo, surjo_ref.random_weights(surjo_ref_config(surjo)))):
        d = root / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(config.to_hf()))
        safetensors.numpy.save_file(weights, str(d / "model.safetensors"))
        for f in hf_dir.iterdir():
            if f.name.startswith(("tokenizer", "special_tokens")):
                shutil.copy(f, d / f.name)
        dirs[name] = d
    return dirs


@pytest.fixture(scope="module")
def generate_task(task_dir):
    """Greedy continuations of the cloze contexts, stopped at the first "e"
    (random weights write long tokens: most answers stop there, some run to
    max_gen_toks)."""
    (task_dir / "cism_continue.yaml").write_text(f"""task: cism_continue
dataset_path: json
dataset_kwargs:
  data_files:
    test: {task_dir / "cism_cloze.jsonl"}
test_split: test
output_type: generate_until
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{choices[label]}}}}"
generation_kwargs:
  until: ["e"]
  max_gen_toks: 12
  do_sample: false
metric_list:
  - metric: exact_match
""")
    return task_dir


def log_softmax64(z):
    z = np.asarray(z, np.float64)
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


@pytest.mark.parametrize("precision", ["fp32", "int8", "int4"])
@pytest.mark.parametrize("family", ["dense", "fwkv", "surjo"])
def test_every_family_through_simple_evaluate(family, precision, family_dirs, generate_task, data_dir):
    path = family_dirs[family]
    got = lm_eval.simple_evaluate(
        model="cism", model_args=f"pretrained={path},precision={precision},threads=2,max_length={FAMILY_MAX_LENGTH}",
        tasks=["cism_cloze", "cism_paragraphs", "cism_continue"],
        task_manager=TaskManager(include_path=str(generate_task), include_defaults=False),
        bootstrap_iters=0, log_samples=True, limit=8)
    model = cism.load(path, precision=precision, threads=2)
    assert type(model).__module__ == {"dense": "cism.dense", "fwkv": "cism.fwkv", "surjo": "cism.surjo"}[family]
    tok = model.tokenizer

    # multiple choice: log p(choice | context) from logits_all over both
    samples = sorted(got["samples"]["cism_cloze"], key=lambda s: s["doc_id"])
    assert len(samples) == 8
    for s in samples:
        context = s["doc"]["context"]
        for choice, resp in zip(s["doc"]["choices"], s["resps"]):
            whole = tok.encode(context + choice)
            cont = whole[len(tok.encode(context)):]
            lp = log_softmax64(model.logits_all(whole[:-1]))[-len(cont):]
            assert resp[0][0] == lp[np.arange(len(cont)), cont].sum()
            assert resp[0][1] == bool((lp.argmax(-1) == cont).all())

    # rolling: one window per paragraph, every token predicted from the prefix token
    prefix = tok.bos_id if tok.bos_id is not None else tok.eos_ids[0]
    for s in got["samples"]["cism_paragraphs"]:
        ids = tok.encode(s["doc"]["text"])
        assert len(ids) <= FAMILY_MAX_LENGTH
        want = -model.nll([prefix] + ids) * len(ids)
        assert s["resps"][0][0] == pytest.approx(want, rel=1e-9)

    # generation: greedy from next-token logits, cut at the stop text
    stopped = 0
    for s in got["samples"]["cism_continue"]:
        ids = tok.encode(s["doc"]["context"])
        out = []
        while len(out) < 12:
            t = int(np.argmax(model.logits(ids + out)))
            if t in tok.eos_ids:
                break
            out.append(t)
            if "e" in tok.decode(out):
                break
        text = tok.decode(out)
        stopped += "e" in text
        assert s["resps"][0][0] == text.split("e")[0]
    assert stopped > 0


@pytest.mark.slow
def test_lm_eval_command_line(hf_dir, task_dir, tmp_path):
    """`python -m cism.lm_eval` is lm-eval's own command line (its legacy
    form, without the `run` subcommand, as `lm_eval --model ...` takes it)
    with "cism" registered: it runs a local task and writes the results and
    samples simple_evaluate gives in process. (lm-eval 0.4 reads no entry
    points for models, so its own `lm_eval` command cannot know "cism".)"""
    import subprocess
    import sys

    args = f"pretrained={hf_dir},precision=fp32,threads=2,max_length={MAX_LENGTH}"
    root = str(Path(__file__).resolve().parents[1])   # this tree's cism, not an installed one
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    run = subprocess.run([sys.executable, "-m", "cism.lm_eval", "--model", "cism", "--model_args", args,
                          "--tasks", "cism_cloze", "--include_path", str(task_dir),
                          "--output_path", str(tmp_path), "--log_samples"],
                         env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "cism_cloze" in run.stdout
    results = json.loads(next(tmp_path.rglob("results_*.json")).read_text())
    samples = [json.loads(line) for line in next(tmp_path.rglob("samples_cism_cloze_*.jsonl")).open()]
    want = evaluate("cism", args, task_dir, ["cism_cloze"])
    assert results["results"]["cism_cloze"]["acc,none"] == want["results"]["cism_cloze"]["acc,none"]
    # lm-eval writes the responses as str(); a float's str() reads back exactly
    got = [(float(r[0][0]), r[0][1] == "True") for s in sorted(samples, key=lambda s: s["doc_id"])
           for r in s["resps"]]
    assert len(got) == 160
    assert got == [tuple(r[0]) for r in per_request(want, "cism_cloze")]
