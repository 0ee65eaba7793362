"""bench/evaluate.py: its cloze questions, and its rounds (the backends
taking turns, every round one loglikelihood call per backend over whole
questions), run on SmolLM2 without HF."""
import json
import re

import pytest

pytest.importorskip("lm_eval")

from bench_scripts import load_script  # noqa: E402


@pytest.mark.parametrize("choices", [4, 10])
def test_cloze_questions(data_dir, choices):
    bench = load_script("evaluate")
    qs = bench.cloze_questions(str(data_dir), 12, choices)
    text = re.sub(r"\s+", " ", (data_dir / "corpora" / "pride_and_prejudice.txt").read_text(encoding="utf-8"))
    assert len(qs) == 12 and len({q["context"] for q in qs}) == 12
    for q in qs:
        assert len(set(q["choices"])) == choices and all(re.fullmatch(r" [a-z]+", c) for c in q["choices"])
        assert q["context"] + q["choices"][q["label"]] + "." in text


def test_rounds_score_whole_questions_in_turn(smollm2_gguf, data_dir, monkeypatch, capsys):
    bench = load_script("evaluate")
    import cism.lm_eval
    calls = []
    real = cism.lm_eval.CismLM.loglikelihood

    def recorded(self, requests, disable_tqdm=False):
        calls.append((self.fork, sorted({r.doc_id for r in requests}), len(requests)))
        return real(self, requests, disable_tqdm=disable_tqdm)

    monkeypatch.setattr(cism.lm_eval.CismLM, "loglikelihood", recorded)
    bench.main(["--model", str(smollm2_gguf), "--no-hf", "--questions", "5", "--choices", "4",
                "--per-round", "2", "--json"])
    # a warm-up call each, then three rounds (2 + 2 + 1 questions), the
    # backend going first alternating
    assert calls[2:] == [(True, [0, 1], 8), (False, [0, 1], 8), (False, [2, 3], 8), (True, [2, 3], 8),
                         (True, [4], 4), (False, [4], 4)]
    row = json.loads(capsys.readouterr().out)["results"][0]
    assert row["requests"] == 20
    fork, alone = row["cism fork"], row["cism no-fork"]
    # forking scores what recomputing does, in the same request order
    assert alone["max_abs_ll_diff_vs_fork"] == 0.0 and fork["acc"] == alone["acc"]
