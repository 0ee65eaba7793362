"""gemv bandwidth: GB/s of packed weights streamed per product, for every
storage at 1 and 2 threads, next to the machine's read bandwidth measured in
the same run (a multi-stream read of a 2 GiB buffer).

    python bench/gemv.py [--json] [--rows 16384] [--cols 4096] [--repeats 7]
                         [--storages int4 q4_k ...]

q4_k and q6_k (GGUF's own Q4_K / Q6_K blocks, Matrix.from_ggml) hold random
super-blocks with fp16 scales near those of real weights: their speed does
not depend on the values. --cols must then be a multiple of 256.

The matrix must be well above the last-level cache (the default fp32 matrix
is 256 MiB; the host reports a 105 MiB L3). Decode on a CPU is exactly this
loop, so the ratio to read bandwidth is the fraction of the roofline reached.
"""
import argparse
import json
import sys

import numpy as np

from bench_common import median_seconds
from cism import _bandwidth, _kernels
from cism.matrix import Matrix

STORAGES = ["fp32", "fp16", "int8", "int4", "fp4", "q4_k", "q6_k"]
GGML = {"q4_k": (12, 144, (0, 2)), "q6_k": (14, 210, (208,))}  # type id, block bytes, fp16 fields


def random_ggml(storage, rows, cols, rng):
    """A Matrix of random GGUF super-blocks: random codes, 6-bit and int8
    scales, fp16 d (and dmin) in [2^-10, 2^-9)."""
    type_id, size, fields = GGML[storage]
    raw = rng.integers(0, 256, (rows * (cols // 256), size), dtype=np.uint8)
    for at in fields:
        halves = rng.integers(0x1400, 0x1800, len(raw)).astype("<u2")
        raw[:, at:at + 2] = halves.view(np.uint8).reshape(-1, 2)
    return Matrix.from_ggml(type_id, raw, rows, cols)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=16384)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--storages", nargs="+", default=STORAGES, choices=STORAGES)
    ap.add_argument("--json", action="store_true", help="print one JSON document")
    args = ap.parse_args(argv)
    if set(args.storages) & set(GGML) and args.cols % 256:
        ap.error("q4_k and q6_k need --cols a multiple of 256")

    rng = np.random.default_rng(0)
    W = rng.standard_normal((args.rows, args.cols), dtype=np.float32)
    x = rng.standard_normal(args.cols, dtype=np.float32)
    bandwidth = {t: _bandwidth.read_bandwidth(1 << 31, threads=t, repeats=args.repeats) for t in args.threads}
    rows = []
    for storage in args.storages:
        m = random_ggml(storage, args.rows, args.cols, rng) if storage in GGML else Matrix(W, storage)
        for act in (("fp32",) if storage in ("fp32", "fp16") else ("fp32", "int8")):
            m.act_precision = act
            for t in args.threads:
                secs = median_seconds(lambda: m.gemv(x, threads=t), args.repeats)
                gbs = m.nbytes / secs / 1e9
                rows.append({"storage": storage, "act_precision": act, "threads": t,
                             "bytes": m.nbytes, "ms": secs * 1e3, "gb_per_s": gbs,
                             "read_gb_per_s": bandwidth[t] / 1e9,
                             "ratio": gbs / (bandwidth[t] / 1e9)})
        del m
    report = {"isa": _kernels.isa(), "matrix": [args.rows, args.cols],
              "read_bandwidth_gb_per_s": {str(t): b / 1e9 for t, b in bandwidth.items()},
              "results": rows}
    if args.json:
        json.dump(report, sys.stdout, indent=1)
        print()
        return
    print(f"ISA {report['isa']}, matrix {args.rows}x{args.cols}; read bandwidth: "
          + ", ".join(f"{t} thr {b / 1e9:.1f} GB/s" for t, b in bandwidth.items()))
    print(f"{'storage':8} {'act':5} {'thr':>3} {'MB':>7} {'ms':>7} {'GB/s':>6} {'of read':>7}")
    for r in rows:
        print(f"{r['storage']:8} {r['act_precision']:5} {r['threads']:3d} {r['bytes'] / 1e6:7.1f} "
              f"{r['ms']:7.2f} {r['gb_per_s']:6.1f} {100 * r['ratio']:6.0f}%")


if __name__ == "__main__":
    main()
