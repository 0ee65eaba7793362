"""FWKV decode and prefill tokens/s per precision and thread count, with
weight bytes, the bandwidth at which the model's threads read its own weights
(Model.scan, or a same-sized read where that is faster) in the same run and
the roofline ratio (decode tok/s / (that bandwidth / bytes per token)); the
machine's 2 GiB read is printed alongside.

    python bench/fwkv.py [--model DIR] [--json]

Without --model it builds random weights of the Myosotis-1-base shape (13
layers, d_model 768, d_emb 192, ffn_mult 4, GPT-2 vocabulary). Decode streams
every packed matrix once per token (the tied head included) and keeps a
(layers, d_model) state, so its cost does not grow with the position.

The load average is printed next to the figures: on a shared machine other
processes take cores, and two-thread runs suffer most (a preempted thread
stalls every parallel region).
"""
import argparse
import json
import os
import sys

from cism import _kernels
from cism.bench import format_table, measure, random_fwkv, read_bandwidth, timed_load

PRECISIONS = ["fp32", "fp16", "int8", "hybrid-int4", "hybrid-fp4", "int4", "fp4"]
SHAPE = "myosotis-1-base"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="an FWKV directory (config.json + safetensors)")
    ap.add_argument("--precision", nargs="+", default=PRECISIONS, choices=PRECISIONS)
    ap.add_argument("--act", nargs="+", default=["fp32"], choices=["fp32", "int8"])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    load_before = os.getloadavg()
    bandwidth = {t: read_bandwidth(t, args.repeats) for t in args.threads}
    rows = []
    for precision in args.precision:
        for act in args.act:
            for t in args.threads:
                load = {}
                if args.model:
                    from cism.fwkv import Model
                    model, load = timed_load(lambda: Model.from_pretrained(args.model, precision=precision,
                                                                           threads=t, act_precision=act))
                else:
                    model = random_fwkv(SHAPE, precision, t, act)
                rows.append({**measure(model, bandwidth[t], args.decode_tokens, args.prompt, args.repeats),
                             **load})
                del model
    report = {"model": args.model or f"random {SHAPE}", "isa": _kernels.isa(),
              "read_gb_s": {str(t): b / 1e9 for t, b in bandwidth.items()},
              "load_average": {"before": load_before, "after": os.getloadavg()},
              "cpus": os.cpu_count(), "results": rows}
    if args.json:
        json.dump(report, sys.stdout, indent=1)
        print()
        return
    print(f"{report['model']}  (ISA {report['isa']}; read bandwidth "
          + ", ".join(f"{t} thr {b / 1e9:.1f} GB/s" for t, b in bandwidth.items())
          + f"; load average {load_before[0]:.1f} -> {report['load_average']['after'][0]:.1f}"
          + f" on {report['cpus']} CPUs)")
    print(format_table(rows))


if __name__ == "__main__":
    main()
