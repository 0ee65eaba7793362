"""Batched decode: aggregate tokens/s for batch sizes 1..32 (one weight stream
for every sequence), against batch 1 measured in the same run.

    python bench/batch.py [--model PATH | --shape smollm2-135m] [--precision fp32 int8]
                          [--act fp32 int8] [--kv-precision fp32 fp16] [--json]

--act lists activation precisions to run for each weight precision (int8
activations reach the exact AMX int8 gemm where the CPU has one);
--kv-precision the KV caches (fp16 halves the cache bytes every step reads,
which a batch of long sequences spends much of its time on).

The batch sizes are measured in rounds: each round times every batch size
once (in an order that rotates from round to round), and a batch's ratio is
the median over the rounds of its rate divided by batch 1's rate in the same
round, so a host whose speed drifts during the run moves both sides of each
ratio together. tok/s is the median rate over the rounds.
"""
import argparse
import json
import statistics
import sys
import time

import numpy as np

import cism
from cism.bench import random_model
from bench_common import default_model


def rate(model, batch, tokens, rng):
    """Aggregate tokens/s of one timed run: ``batch`` random 16-token
    prompts, prefilled untimed, then ``tokens`` steps."""
    prompts = [rng.integers(0, model.config.vocab, 16).tolist() for _ in range(batch)]
    s = model.create_batch_session(prompts, tokens + 1)
    s.next_tokens(1)  # prefill
    t = time.perf_counter()
    s.next_tokens(tokens)
    return batch * tokens / (time.perf_counter() - t)


def rounds(model, batches, tokens, repeats, seed=0):
    """{batch: [rate per round]} over one warm-up and ``repeats`` timed
    rounds, the order of the batch sizes rotating each round."""
    rng = np.random.default_rng(seed)
    rates = {b: [] for b in batches}
    for i in range(repeats + 1):
        shift = i % len(batches)
        for b in batches[shift:] + batches[:shift]:
            r = rate(model, b, tokens, rng)
            if i:
                rates[b].append(r)
    return rates


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--shape")
    ap.add_argument("--precision", nargs="+", default=["fp32", "int8"])
    ap.add_argument("--act", nargs="+", default=["fp32"], choices=["fp32", "int8"])
    ap.add_argument("--kv-precision", nargs="+", default=["fp32"], choices=["fp32", "fp16"],
                    help="KV cache precisions to run (fp16: dense models)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds (after one warm-up round)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    path = args.model or (None if args.shape else default_model())
    if any(b < 1 for b in args.batch):
        ap.error("batch sizes must be at least 1")
    # batch 1 is every ratio's baseline: always measured, in each round
    batches = [1] + sorted(set(args.batch) - {1})
    rows = []
    for precision in args.precision:
        for kv in args.kv_precision:
            kw = {} if kv == "fp32" else {"kv_precision": kv}
            model = (cism.load(path, precision=precision, threads=args.threads, **kw) if path
                     else random_model(args.shape or "smollm2-135m", precision, args.threads, **kw))
            for act in args.act:
                model.set_act_precision(act)
                rates = rounds(model, batches, args.tokens, args.repeats)
                for b in batches:
                    ratio = statistics.median(r / r1 for r, r1 in zip(rates[b], rates[1]))
                    rows.append({"precision": precision, "act": act, "kv": kv, "batch": b,
                                 "tok_s": statistics.median(rates[b]), "speedup_vs_batch1": ratio})
    if args.json:
        json.dump({"model": path or args.shape, "threads": args.threads, "results": rows}, sys.stdout)
        print()
        return
    print(f"{path or args.shape}, {args.threads} threads")
    print(f"{'precision':11} {'act':5} {'kv':5} {'batch':>5} {'tok/s':>8} {'x batch 1':>9}")
    for r in rows:
        print(f"{r['precision']:11} {r['act']:5} {r['kv']:5} {r['batch']:5d} {r['tok_s']:8.1f} "
              f"{r['speedup_vs_batch1']:9.2f}")


if __name__ == "__main__":
    main()
