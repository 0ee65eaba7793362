"""Leak check of cism's own allocations, under LeakSanitizer (make sanitize).

CPython keeps much of its memory alive at exit, so a plain LeakSanitizer run
of any Python program reports "leaks" that are not cism's. This script runs
one workload (every kind of matrix, model, session and cancellation path,
error paths included) in two child processes, once and ``ROUNDS`` times, and
reports the leak records whose allocation stack passes through cism's
extension modules or kernels. A leak per use shows up as records (or bytes)
that grow with the number of rounds; what stays the same is one-time state.

    tools/sanitize.sh --leaks            # runs this with the sanitized build
"""
import os
import re
import subprocess
import sys

ROUNDS = 4


def workload(rounds):
    import threading

    import numpy as np

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from models import small_model
    from cism.loaders._ggml_decode import ggml_decode
    from cism.matrix import Matrix

    rng = np.random.default_rng(0)
    W = rng.standard_normal((70, 45)).astype(np.float32)
    X = rng.standard_normal((3, 45)).astype(np.float32)
    for _ in range(rounds):
        for storage in ("fp32", "fp16", "int8", "int4", "fp4"):
            m = Matrix(W, storage)
            m.act_precision = "int8"
            m.gemm(X)
            m.gemv(X[0])
            m.dequantize()
            _ = m.codes, m.scales
            try:
                Matrix(np.full((2, 2), np.nan, np.float32), storage)
            except ValueError:
                pass
        for precision in ("fp32", "int8", "hybrid-int4", "hybrid-fp4", "fp16"):
            model = small_model("qwen3" if precision == "int8" else "llama", precision, seed=1)
            prompt = list(rng.integers(0, 97, 300))
            model.logits(prompt)
            model.nll(prompt)
            model.logits_all(prompt[:40])
            s = model.create_session(prompt[:30], 20, temperature=0.8, top_k=20, top_p=0.9,
                                     min_p=0.05, repetition_penalty=1.1, seed=3, eos=[5])
            s.next_tokens(10)
            g = model.create_session(prompt[:7] * 5, 20)
            g.next_tokens(20, spec_k=4)
            g.verify([1, 2, 3])
            c = model.create_session(prompt, 10)
            c._cancel_after(4)
            c.next_tokens(10)
            c2 = model.create_session(prompt[:20], 400)
            t = threading.Thread(target=c2.next_tokens, args=(400,))
            t.start()
            c2.cancel()
            t.join()
            b = model.create_batch_session([prompt[:5], prompt[:260], prompt[:9]], 8, seed=2)
            b.next_tokens(3)
            b.cancel_seq(1)
            b.next_tokens(8)
            b2 = model.create_batch_session([prompt[:5], prompt[:9]], 8)
            b2._cancel_after(3)
            b2.next_tokens(8)
            model.paged_pool_reset(6)
            p = [model.create_paged_session(prompt[i:i + 40], 12, seed=i) for i in range(3)]
            for q in p:
                q.next_tokens(4)
            for q in p:
                q.next_tokens(4)
            src = p[0]
            fork = model.create_paged_fork_session(src.history + [1], 5, src=src,
                                                   prefix_len=len(src.history))
            fork.next_tokens(5)
            p[1]._cancel_after(2)
            p[1].next_tokens(4)
            for q in p:
                q.release()
            model.paged_logits(prompt[:50])
            try:
                model.create_session(prompt, 10**9)
            except ValueError:
                pass
            model.touch()
            model.scan()
            del model, s, g, c, c2, b, b2, p, src, fork
        # Surjo (XSA slots on the shared KV cache, both cache precisions) and
        # the GGUF decoder's parts
        for kv in ("fp32", "fp16"):
            model = surjo_model(kv)
            prompt = list(rng.integers(0, 101, 270))
            model.logits_all(prompt[:40])
            s = model.create_session(prompt, 12, temperature=0.7, seed=1)
            s.next_tokens(12)
            g = model.create_session(prompt[:8] * 4, 16)
            g.set_draft_steps([i for i, st in enumerate(model.plan) if st[1] == 1])
            g.next_tokens(16, spec_k=4)
            c = model.create_session(prompt, 10)
            c._cancel_after(3)
            c.next_tokens(10)
            del model, s, g, c
        raw = rng.integers(0, 256, 34 * 3000, dtype=np.uint8)
        raw[::34] = 0x3c   # Q8_0 blocks with finite scales
        raw[1::34] = 0
        ggml_decode(8, raw, np.empty(32 * 3000, np.float32), 2)
    print("workload done")


def surjo_model(kv_precision):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from reference import surjo as ref
    from cism.surjo import Config, Model
    fields = dict(hidden=48, intermediate=80, heads=4, kv_heads=2, head_dim=16, vocab=101, context=512,
                  prelude=1, groups=2, per_xsa=2, coda=1, passes=2, gdn_v_heads=4, gdn_k_dim=12,
                  gdn_v_dim=10, conv_kernel=4)
    rc = ref.make_config(**fields)
    return Model(Config(**fields), ref.random_weights(rc, 0), "hybrid-int4", 2, "int8",
                 kv_precision=kv_precision)


FRAME = re.compile(r"^\s+#\d+ .*$")


def cism_leaks(report):
    """[(kind, bytes, stack text)] of the records whose stack mentions cism."""
    out = []
    blocks = re.split(r"\n(?=(?:Direct|Indirect) leak of )", report)
    for block in blocks:
        head = re.match(r"(Direct|Indirect) leak of (\d+) byte", block)
        if not head:
            continue
        frames = [line for line in block.splitlines() if FRAME.match(line)]
        if any("/cism/" in f or "csrc/" in f for f in frames):
            out.append((head.group(1), int(head.group(2)), "\n".join(frames[:8])))
    return out


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--work":
        workload(int(sys.argv[2]))
        return 0
    env = dict(os.environ)
    env["ASAN_OPTIONS"] = "detect_leaks=1:abort_on_error=0"
    env["LSAN_OPTIONS"] = "exitcode=0:max_leaks=0"
    found = {}
    for rounds in (1, ROUNDS):
        proc = subprocess.run([sys.executable, "-P", __file__, "--work", str(rounds)], env=env,
                              capture_output=True, text=True)
        if proc.returncode != 0 or "workload done" not in proc.stdout:
            print(proc.stdout[-3000:], proc.stderr[-6000:])
            print(f"leakcheck: the workload failed (exit {proc.returncode})")
            return 1
        found[rounds] = cism_leaks(proc.stderr)
        total = sum(n for _, n, _ in found[rounds])
        print(f"rounds={rounds}: {len(found[rounds])} leak records through cism, {total} bytes")
    one, many = found[1], found[ROUNDS]
    for kind, n, stack in many:
        print(f"--- {kind} leak of {n} bytes\n{stack}")
    if len(many) > len(one) or sum(n for _, n, _ in many) > sum(n for _, n, _ in one):
        print("leakcheck: cism leaks memory per use")
        return 1
    print("leakcheck: no leak grows with use" + ("" if many else "; none at all"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
