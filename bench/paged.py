"""Prefix sharing: N sessions forked from one long shared prompt vs N
independent paged sessions on the same prompts — time to first token and
peak KV memory (physical pool blocks), same run.

    python bench/paged.py [--model PATH | --shape smollm2-135m] [--prefix 1024] [--n 8] [--json]
"""
import argparse
import json
import sys
import time

import numpy as np

import cism
from cism.bench import random_model
from bench_common import default_model


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--shape")
    ap.add_argument("--precision", default="int8")
    ap.add_argument("--prefix", type=int, default=1024)
    ap.add_argument("--suffix", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    path = args.model or (None if args.shape else default_model())
    model = (cism.load(path, precision=args.precision, threads=args.threads) if path
             else random_model(args.shape or "smollm2-135m", args.precision, args.threads))
    need = args.n * ((args.prefix + args.suffix + 8) // 16 + 2) + 64
    model.paged_pool_reset(need)
    block_bytes = model.paged_pool().kv_bytes() // model.paged_pool().num_blocks
    rng = np.random.default_rng(0)
    prefix = rng.integers(0, model.config.vocab, args.prefix).tolist()
    prompts = [prefix + rng.integers(0, model.config.vocab, args.suffix).tolist() for _ in range(args.n)]

    # independent: every session prefills its whole prompt
    t0 = time.perf_counter()
    indep, ttft_indep = [], []
    for p in prompts:
        s = model.create_paged_session(p, 4)
        t = time.perf_counter()
        s.next_tokens(1)
        ttft_indep.append(time.perf_counter() - t)
        indep.append(s)
    wall_indep = time.perf_counter() - t0
    peak_indep = model.paged_pool_phys_used()
    first_indep = [s.last_logits for s in indep]
    for s in indep:
        s.release()

    # shared: one source prefills the prefix once; children fork it
    t0 = time.perf_counter()
    src = model.create_paged_session(prefix, 1)
    t = time.perf_counter()
    src.prefill_fork_source()
    src_time = time.perf_counter() - t
    forks, ttft_fork = [], []
    for p in prompts:
        c = model.create_paged_fork_session(p, 4, src=src, prefix_len=args.prefix)
        t = time.perf_counter()
        c.next_tokens(1)
        ttft_fork.append(time.perf_counter() - t)
        forks.append(c)
    wall_fork = time.perf_counter() - t0
    peak_fork = model.paged_pool_phys_used()
    exact = all(np.array_equal(a, c.last_logits) for a, c in zip(first_indep, forks))
    report = {"model": path or args.shape, "precision": args.precision, "n": args.n,
              "prefix": args.prefix, "suffix": args.suffix,
              "independent": {"ttft_mean_s": float(np.mean(ttft_indep)), "total_s": wall_indep,
                              "peak_kv_bytes": peak_indep * block_bytes},
              "forked": {"source_prefill_s": src_time, "ttft_mean_s": float(np.mean(ttft_fork)),
                         "total_s": wall_fork, "peak_kv_bytes": peak_fork * block_bytes},
              "logits_identical": exact}
    if args.json:
        json.dump(report, sys.stdout)
        print()
        return
    i, f = report["independent"], report["forked"]
    print(f"{report['model']} {args.precision}: {args.n} sessions, shared prefix {args.prefix} + suffix {args.suffix}")
    print(f"independent: TTFT {1e3 * i['ttft_mean_s']:.1f} ms each, all {i['total_s']:.2f} s, "
          f"peak KV {i['peak_kv_bytes'] / 2**20:.1f} MiB")
    print(f"forked     : source prefill {f['source_prefill_s']:.2f} s once, TTFT {1e3 * f['ttft_mean_s']:.1f} ms "
          f"each, all {f['total_s']:.2f} s, peak KV {f['peak_kv_bytes'] / 2**20:.1f} MiB")
    print(f"first-token logits identical: {exact}")


if __name__ == "__main__":
    main()
