"""Live servers for the HTTP tests: the app on uvicorn in a thread (ephemeral
port), and the oracle a seeded request is checked against (a solo session
on the same model, tokens and logprobs bit for bit)."""
import threading
import time

import numpy as np

from cism.sampling import logprobs as ref_logprobs


class LiveServer:
    """uvicorn serving `app` on 127.0.0.1 at a free port, in a daemon thread."""

    def __init__(self, app):
        import uvicorn

        from cism.server.run import bind
        self.sock = bind("127.0.0.1", 0)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="error", access_log=False,
                                                    timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()


def chat_ids(tok, messages):
    return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True), add_bos=False)


def solo(model, ids, max_new, temperature, top_p=1.0, top_k=0, seed=0, min_p=0.0, repetition_penalty=1.0,
         top_n=0):
    """Tokens, logprobs and top logprobs of a solo session, as the server
    must report them (eos = the tokenizer's end tokens)."""
    tok = model.tokenizer
    s = model.create_session(ids, max_new, temperature, top_p, top_k, seed, list(tok.eos_ids),
                             min_p=min_p, repetition_penalty=repetition_penalty)
    s.prefill()
    tokens, lps, tops = [], [], []
    while not s.finish_reason:
        logits = s.last_logits
        t = s.next_tokens(1)
        if not t:
            break
        lp, top = ref_logprobs(logits, t[0], top_n)
        tokens += t
        lps.append(lp)
        tops.append(top)
    return tokens, lps, tops, s.finish_reason


def idle(engine, timeout=30):
    """Wait until the engine runs nothing and holds only cached blocks."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        st = engine.stats()
        if st["running"] == 0 and st["waiting"] == 0 and st["kv_blocks_used"] == st["cached_blocks"]:
            return st
        time.sleep(0.02)
    raise AssertionError(f"the engine did not go idle: {engine.stats()}")


def prompt_of(seed, n, vocab):
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()
