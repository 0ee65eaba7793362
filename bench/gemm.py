"""Prefill gemm: GFLOP/s of the exact multi-token kernels against the opt-in
bf16 (AMX) kernel on the same matrix and tokens, in the same run; for the
integer storages (int8, int4, fp4) also the exact kernel with int8
activations ("int8 act": on the AMX tile unit where the CPU has AMX-INT8,
else the VNNI kernels).

    python bench/gemm.py [--threads 1] [--tokens 256] [--repeats 5] [--json]

Shapes are SmolLM2's and Qwen3-0.6B's projections, random weights. The bf16
column is absent where the CPU has no AMX-BF16 (cism.matrix.bf16_available).
The GGUF K-quant storages (--storages q4_k q6_k) take random super-blocks
(unit-range fp16 scales) and only the shapes whose width is a multiple of
256 (Qwen3's).
"""
import argparse
import json

import numpy as np

from bench_common import median_seconds
from cism.matrix import Matrix, bf16_available

SHAPES = [(576, 1536, "SmolLM2 down"), (1536, 576, "SmolLM2 gate/up"),
          (2048, 1024, "Qwen3 q"), (1024, 3072, "Qwen3 down")]


def kquant_matrix(rng, storage, r, c):
    """Random Q4_K / Q6_K super-blocks (scales d, dmin in 1/16..2) as a Matrix."""
    size, fields = {"q4_k": (144, (0, 2)), "q6_k": (210, (208,))}[storage]
    raw = rng.integers(0, 256, (r * c // 256, size), dtype=np.uint8)
    for at in fields:
        raw[:, at:at + 2] = rng.integers(0x2c00, 0x3fff, (len(raw), 1), dtype=np.uint16).view(np.uint8)
    return Matrix.from_ggml(storage.upper(), raw.reshape(r, -1), r, c)


def gflops(m, X, threads, repeats):
    secs = median_seconds(lambda: m.gemm(X, threads=threads), repeats)
    return 2 * m.rows * m.cols * X.shape[0] / secs / 1e9


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--storages", nargs="+", default=["fp32", "int8", "int4", "fp4"])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    bf16 = bf16_available()
    rows = []
    for storage in args.storages:
        kquant = storage in ("q4_k", "q6_k")
        for r, c, name in SHAPES:
            if kquant and c % 256:
                continue
            m = (kquant_matrix(rng, storage, r, c) if kquant
                 else Matrix(rng.standard_normal((r, c)).astype(np.float32), storage))
            X = rng.standard_normal((args.tokens, c)).astype(np.float32)
            exact = gflops(m, X, args.threads, args.repeats)
            q8 = None
            if storage in ("int8", "int4", "fp4", "q4_k", "q6_k"):
                m.act_precision = "int8"
                q8 = gflops(m, X, args.threads, args.repeats)
            fast = None
            if bf16 and not kquant:  # (K-quants keep the canonical kernels)
                m.act_precision = "bf16"
                fast = gflops(m, X, args.threads, args.repeats)
            rows.append({"storage": storage, "rows": r, "cols": c, "shape": name,
                         "exact_gflops": exact, "int8_act_gflops": q8, "bf16_gflops": fast,
                         "ratio": fast / exact if fast else None})
    if args.json:
        print(json.dumps({"threads": args.threads, "tokens": args.tokens, "results": rows}, indent=1))
        return
    print(f"{args.tokens} tokens, {args.threads} thread(s); GFLOP/s (median of {args.repeats})")
    print(f"{'storage':7} {'rows x cols':>12} {'':16} {'exact':>7} {'int8 act':>8} {'bf16':>7} {'x':>5}")
    for x in rows:
        b = f"{x['bf16_gflops']:7.0f} {x['ratio']:5.2f}" if x["bf16_gflops"] else f"{'-':>7} {'-':>5}"
        q = f"{x['int8_act_gflops']:8.0f}" if x["int8_act_gflops"] else f"{'-':>8}"
        print(f"{x['storage']:7} {x['rows']:5d} x {x['cols']:<5d} {x['shape']:16} {x['exact_gflops']:7.0f} {q} {b}")


if __name__ == "__main__":
    main()
