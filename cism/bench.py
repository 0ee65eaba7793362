"""Throughput measurements shared by ``cism bench`` and bench/*.py.

Every figure comes with a baseline measured in the same run: the machine's
read bandwidth (multi-stream read of a 2 GiB buffer), from which the decode
roofline is bandwidth / bytes streamed per token.
"""
import statistics
import time

import numpy as np

from cism import _bandwidth

# Real model shapes, random weights (so benchmarks run anywhere).
SHAPES = {
    "smollm2-135m": dict(model_type="llama", hidden=576, intermediate=1536, layers=30, heads=9,
                         kv_heads=3, head_dim=64, vocab=49152, context=8192, eps=1e-5,
                         rope_theta=100000.0, tied=True),
    "qwen3-0.6b": dict(model_type="qwen3", hidden=1024, intermediate=3072, layers=28, heads=16,
                       kv_heads=8, head_dim=128, vocab=151936, context=40960, eps=1e-6,
                       rope_theta=1000000.0, tied=True),
    # Llama 3.2 3B without its rope scaling (random weights: the shape is what counts)
    "llama-3.2-3b": dict(model_type="llama", hidden=3072, intermediate=8192, layers=28, heads=24,
                         kv_heads=8, head_dim=128, vocab=128256, context=131072, eps=1e-5,
                         rope_theta=500000.0, tied=True),
    "myosotis-1-base": dict(model_type="fwkv", d_model=768, d_emb=192, layers=13, ffn_mult=4,
                            vocab=50257, context=1024, wkv_floor=0.1, tied=True),
    # ~53M parameters: XSA prelude, 2 groups of (3 GDN + 1 XSA) run twice, XSA coda
    "surjo-50m": dict(model_type="surjo", hidden=512, intermediate=1536, heads=8, kv_heads=4,
                      head_dim=64, vocab=32000, context=4096, prelude=1, groups=2, per_xsa=3,
                      coda=1, passes=2, gdn_v_heads=8, gdn_k_dim=64, gdn_v_dim=64, conv_kernel=4,
                      tied=True),
}


def random_dense(shape, precision="fp32", threads=None, act_precision="fp32", seed=0, kv_precision="fp32"):
    from cism.dense import Config, Model, weight_shapes
    config = Config(**SHAPES[shape])
    rng = np.random.default_rng(seed)
    weights = {}
    for name, s in weight_shapes(config, not config.tied).items():
        if len(s) == 1:
            weights[name] = np.ones(s, np.float32)
        else:
            w = rng.standard_normal(s, dtype=np.float32)
            w *= np.float32(1.0 / np.sqrt(s[1]))
            weights[name] = w
    return Model(config, weights, precision=precision, threads=threads, act_precision=act_precision,
                 kv_precision=kv_precision)


def random_surjo(shape="surjo-50m", precision="fp32", threads=None, act_precision="fp32", seed=0):
    """A Surjo model of a SHAPES entry with random weights: unit norms, linear
    weights N(0, 1/fan_in), GDN decays spread over roughly (0.5, 1)."""
    from cism.surjo import Config, Model, weight_shapes
    config = Config(**{k: v for k, v in SHAPES[shape].items() if k != "model_type"})
    rng = np.random.default_rng(seed)
    weights = {}
    for name, s in weight_shapes(config, not config.tied).items():
        if name.endswith("A_log"):
            w = np.log(rng.uniform(0.05, 1.0, s))
        elif name.endswith("dt_bias"):
            w = rng.uniform(-3.0, 0.5, s)
        elif name.endswith(".bias"):
            w = 0.5 * rng.standard_normal(s)
        elif len(s) == 1:
            w = np.ones(s)
        else:
            w = rng.standard_normal(s, dtype=np.float32) * np.float32(1.0 / np.sqrt(s[-1]))
        weights[name] = np.asarray(w, np.float32)
    return Model(config, weights, precision=precision, threads=threads, act_precision=act_precision)


def random_fwkv(shape, precision="fp32", threads=None, act_precision="fp32", seed=0):
    from cism.fwkv import Config, Model, weight_shapes
    config = Config(**SHAPES[shape])
    rng = np.random.default_rng(seed)
    weights = {}
    for name, s in weight_shapes(config).items():
        if len(s) == 1:
            weights[name] = (np.zeros if name.endswith((".bias", ".w")) else np.ones)(s, np.float32)
        else:
            w = rng.standard_normal(s, dtype=np.float32)
            w *= np.float32(1.0 / np.sqrt(s[1]))
            weights[name] = w
    return Model(config, weights, precision=precision, threads=threads, act_precision=act_precision)


def random_model(shape, precision="fp32", threads=None, act_precision="fp32", seed=0, kv_precision="fp32"):
    """A random-weight model of a known shape, whatever its family
    (kv_precision "fp16": dense shapes only)."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose one of {', '.join(sorted(SHAPES))}")
    family = SHAPES[shape].get("model_type")
    make = {"fwkv": random_fwkv, "surjo": random_surjo}.get(family)
    if make is None:
        return random_dense(shape, precision, threads, act_precision, seed, kv_precision)
    if kv_precision != "fp32":
        raise ValueError(f"kv_precision {kv_precision!r} is for dense shapes; {shape} is {family}")
    return make(shape, precision, threads, act_precision, seed)


def read_bandwidth(threads, repeats=5):
    """Bytes per second the machine reads with this many threads."""
    return _bandwidth.read_bandwidth(1 << 31, threads=threads, repeats=repeats)


def scan_bandwidth(model, repeats=5):
    """Bytes per second the model's threads read its own packed weights
    (Model.scan): the roofline's bandwidth, measured on the same bytes and
    threads decode streams. A 2 GiB read (read_bandwidth)
    runs slower on these hosts than reads of model-sized buffers. Best of
    ``repeats`` after a warm-up, like read_bandwidth: a ceiling."""
    best = 0.0
    for i in range(repeats + 1):
        t = time.perf_counter()
        n = model.scan()
        if i:
            best = max(best, n / (time.perf_counter() - t))
    return best


def roofline_bandwidth(model, repeats=5):
    """The faster of the model's scan (scan_bandwidth) and a same-sized
    read of one buffer (read_bandwidth of weight_bytes): the conservative
    ceiling for the roofline (on some hosts the scan of many matrices reads
    slower than decode streams them, which would put ratios over 100%)."""
    same = _bandwidth.read_bandwidth(max(model.weight_bytes, 1 << 20), threads=model.thread_count,
                                   repeats=repeats)
    return max(scan_bandwidth(model, repeats), same)


def decode_rate(model, tokens=64, repeats=5, prompt_len=16, seed=0):
    """Median decode tokens/s after a warm-up, prompt prefilled outside the timing."""
    rng = np.random.default_rng(seed)
    vocab = model.config.vocab if hasattr(model.config, "vocab") else model.config.vocab_size
    rates = []
    for i in range(repeats + 1):
        prompt = rng.integers(0, vocab, prompt_len).tolist()
        s = model.create_session(prompt, tokens + 1)
        s.next_tokens(1)  # prefill and the first token
        t = time.perf_counter()
        s.next_tokens(tokens)
        if i:  # the first run warms caches and allocators
            rates.append(tokens / (time.perf_counter() - t))
    return statistics.median(rates)


def prefill_rate(model, prompt_len=512, repeats=5, seed=1):
    """Median prompt tokens/s of a prefill (logits of the last token)."""
    rng = np.random.default_rng(seed)
    vocab = model.config.vocab
    rates = []
    for i in range(repeats + 1):
        prompt = rng.integers(0, vocab, prompt_len).tolist()
        t = time.perf_counter()
        model.logits(prompt)
        if i:
            rates.append(prompt_len / (time.perf_counter() - t))
    return statistics.median(rates)


def prefill_bf16_rate(model, prompt_len=512, repeats=5):
    """prefill_rate with the opt-in bf16 prefill precision (the model is left
    as it was), or None where the model family or the CPU has none."""
    from cism.matrix import bf16_available
    if not hasattr(model, "set_prefill_precision") or not bf16_available():
        return None
    before = model.prefill_precision
    model.set_prefill_precision("bf16")
    try:
        return prefill_rate(model, prompt_len, repeats)
    finally:
        model.set_prefill_precision(before)


def measure(model, bandwidth, decode_tokens=64, prompt_len=512, repeats=5, per_token=None):
    """Decode and prefill figures of one model, with its roofline ratio:
    roofline = roofline_bandwidth (the model's scan or a same-sized read,
    whichever is faster) / bytes read per token (per_token, default the
    weight bytes). ``bandwidth`` (the machine's 2 GiB read) is reported next
    to it."""
    decode = decode_rate(model, decode_tokens, repeats)
    prefill = prefill_rate(model, prompt_len, repeats)
    prefill_bf16 = prefill_bf16_rate(model, prompt_len, repeats)
    scan = roofline_bandwidth(model, repeats)
    per_token = per_token or model.weight_bytes
    roofline = scan / per_token
    return {"prefill_bf16_tok_s": prefill_bf16, "precision": model.precision, "act_precision": model.act_precision,
            "threads": model.thread_count, "weight_bytes": model.weight_bytes,
            "stream_bytes": per_token, "decode_tok_s": decode, "prefill_tok_s": prefill,
            "read_gb_s": bandwidth / 1e9, "roof_gb_s": scan / 1e9, "roofline_tok_s": roofline,
            "roofline_ratio": decode / roofline}


def peak_rss_bytes():
    """This process's peak resident set so far: Linux's VmHWM (ru_maxrss
    also counts the high-water mark of the parent a child was forked
    from), else ru_maxrss."""
    try:
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM"))
    except (OSError, StopIteration):
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # KiB on Linux


def timed_load(load):
    """Call ``load()`` (a model loader); returns the model and its load
    figures: wall seconds and the process's peak RSS so far (so a later,
    smaller load in the same process shows the earlier peak; bench/load.py
    measures each load in a fresh process)."""
    start = time.perf_counter()
    model = load()
    seconds = time.perf_counter() - start
    return model, {"load_s": seconds, "peak_rss_bytes": peak_rss_bytes()}


def format_table(rows):
    """The human-readable table of measure() rows (with timed_load's
    figures when a row has them)."""
    loads = any("load_s" in r for r in rows)
    lines = [f"{'precision':12} {'act':5} {'thr':>3} {'weights MB':>10} "
             + (f"{'load s':>6} {'peak RSS MB':>11} " if loads else "")
             + f"{'MB/token':>9} {'roof GB/s':>9} "
             f"{'decode':>8} {'roofline':>9} {'ratio':>6} {'prefill':>8} {'bf16 pre':>8}"]
    for r in rows:
        load = ""
        if loads:
            load = (f"{r['load_s']:6.2f} {r['peak_rss_bytes'] / 1e6:11.1f} " if "load_s" in r
                    else f"{'-':>6} {'-':>11} ")
        lines.append(f"{r['precision']:12} {r['act_precision']:5} {r['threads']:3d} "
                     f"{r['weight_bytes'] / 1e6:10.1f} {load}{r['stream_bytes'] / 1e6:9.1f} "
                     f"{r['roof_gb_s']:9.1f} {r['decode_tok_s']:8.1f} {r['roofline_tok_s']:9.1f} "
                     f"{100 * r['roofline_ratio']:5.0f}% {r['prefill_tok_s']:8.1f} "
                     + (f"{r['prefill_bf16_tok_s']:8.1f}" if r.get("prefill_bf16_tok_s") else f"{'-':>8}"))
    return "\n".join(lines)
