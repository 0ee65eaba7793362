"""The quality table of docs/VALIDATION.md: perplexity of SmolLM2-135M-
Instruct on WikiText-2 (test, raw) for every precision x activation
precision, with mean KL divergence and top-1 agreement against fp32.

    python bench/validation.py [--chunks 60] [--threads 1] [--out DIR]

Each row is one `cism perplexity` command (printed in the table), the fp32
run saving the log-probabilities the others are compared with.
"""
import argparse
import json
import os
import subprocess
import sys

from bench_common import shared_data

PRECISIONS = ["fp32", "fp16", "int8", "hybrid-int4", "hybrid-fp4", "int4", "fp4"]


def command(args, text, precision, act, base, save):
    cmd = ["cism", "perplexity", "--file", text, "--ctx", str(args.ctx), "--threads", str(args.threads),
           "--precision", precision, "--act-precision", act, "--json"]
    if args.chunks:
        cmd += ["--chunks", str(args.chunks)]
    cmd += ["--save-kl-base", base] if save else ["--kl-base", base]
    return cmd


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunks", type=int, default=60, help="windows of --ctx tokens (0: all)")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="/tmp/cism-validation")
    ap.add_argument("--reuse", action="store_true", help="keep results already in --out")
    ap.add_argument("--precision", nargs="+", default=PRECISIONS, choices=PRECISIONS,
                    help="the rows to run (fp32 always: the KL base)")
    args = ap.parse_args(argv)
    data = shared_data()
    if data is None:
        sys.exit("shared data not found (set CISM_DATA)")
    raw = os.path.join(data, "corpora", "wikitext-2-test.raw.txt")
    os.makedirs(args.out, exist_ok=True)
    text = os.path.join(args.out, "wikitext-2-test.raw.lf.txt")  # CRLF normalised
    with open(raw, "rb") as f, open(text, "wb") as g:
        g.write(f.read().replace(b"\r\n", b"\n"))
    base = os.path.join(args.out, "fp32.npy")
    rows = []
    for precision in ["fp32"] + [p for p in args.precision if p != "fp32"]:
        for act in ("fp32", "int8"):
            first = precision == "fp32" and act == "fp32"
            out = os.path.join(args.out, f"{precision}-{act}.json")
            cmd = command(args, text, precision, act, base, first)
            if not (args.reuse and os.path.exists(out)):
                result = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
                with open(out, "w") as f:
                    f.write(result)
            with open(out) as f:
                rows.append((precision, act, json.load(f), cmd))
    print("| precision | activations | PPL | mean KLD vs fp32 | KLD p99 | top-1 agreement |")
    print("|---|---|---|---|---|---|")
    for precision, act, r, cmd in rows:
        if "kld" in r:
            k = r["kld"]
            extra = f"{k['mean']:.5f} ± {k['error']:.5f} | {k['p99']:.4f} | {100 * r['top1_agreement']:.2f}%"
        else:
            extra = "— | — | —"
        print(f"| {precision} | {act} | {r['ppl']:.4f} ± {r['ppl_error']:.4f} | {extra} |")
    print()
    print(f"{rows[0][2]['tokens_scored']} scored tokens ({rows[0][2]['chunks']} windows of {args.ctx}).")
    print("Commands:")
    for precision, act, r, cmd in rows:
        print("    " + " ".join(cmd).replace(text, "wikitext-2-test.raw.txt").replace(args.out + "/", ""))


if __name__ == "__main__":
    main()
