"""Surjo decode and prefill tokens/s per precision and thread count, with the
weight bytes, the bytes one decoded token streams (the group section once per
recurrent pass), the bandwidth at which the model's threads read its own
weights (Model.scan, or a same-sized read where that is faster) in the same
run and the roofline ratio (decode tok/s / (that bandwidth / streamed bytes
per token)); the machine's 2 GiB read is printed alongside.

    python bench/surjo.py [--model DIR | --shape surjo-50m] [--json]

Without --model it uses random weights of the ~50M-parameter shape
(hidden 512, 8 query / 4 KV heads of 64, 1 + 2x(3 GDN + 1 XSA)x2 passes + 1).
The machine's cores may be shared with other processes: figures are medians of
--repeats runs, and the bandwidth is measured alongside each model so the
ratio stays meaningful.
"""
import argparse
import json
import sys

from cism import _kernels
from cism.bench import SHAPES, format_table, measure, random_surjo, read_bandwidth, timed_load

PRECISIONS = ["fp32", "fp16", "int8", "hybrid-int4", "hybrid-fp4", "int4", "fp4"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="a Surjo directory (config.json + safetensors)")
    ap.add_argument("--shape", default="surjo-50m",
                    choices=sorted(k for k, v in SHAPES.items() if v["model_type"] == "surjo"))
    ap.add_argument("--precision", nargs="+", default=PRECISIONS)
    ap.add_argument("--act", nargs="+", default=["fp32"], choices=["fp32", "int8"])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    bandwidth = {t: read_bandwidth(t, args.repeats) for t in args.threads}
    rows = []
    for precision in args.precision:
        for act in args.act:
            for t in args.threads:
                load = {}
                if args.model:
                    from cism.surjo import Model
                    model, load = timed_load(lambda: Model.from_pretrained(args.model, precision=precision,
                                                                           threads=t, act_precision=act))
                else:
                    model = random_surjo(args.shape, precision, t, act)
                rows.append({**measure(model, bandwidth[t], args.decode_tokens, args.prompt, args.repeats,
                                       per_token=model.stream_bytes),
                             **load})
                del model
    report = {"model": args.model or f"random {args.shape}", "isa": _kernels.isa(),
              "read_gb_s": {str(t): b / 1e9 for t, b in bandwidth.items()}, "results": rows}
    if args.json:
        json.dump(report, sys.stdout, indent=1)
        print()
        return
    print(f"{report['model']}  (ISA {report['isa']}; read bandwidth "
          + ", ".join(f"{t} thr {b / 1e9:.1f} GB/s" for t, b in bandwidth.items()) + ")")
    print(format_table(rows))


if __name__ == "__main__":
    main()
