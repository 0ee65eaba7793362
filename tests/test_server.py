"""`cism serve`: the OpenAI API through the official `openai` client against a
live server on an ephemeral port (SmolLM2 at int8): chat and completions,
streamed or not, stop strings, n, logprobs and seeds, with a seeded request
bit-identical to a solo session, also while 32 other clients stream;
disconnects return their blocks; hypothesis-generated bodies never get a
5xx; queue overflow, API keys, metrics, tokenize/detokenize, and the CLI
with its signals."""
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

import cism
from cism.server import create_app

from conftest import hypothesis_or_skip
from serving import LiveServer, chat_ids, idle, solo

NAME = "smollm2"


@pytest.fixture(scope="module")
def model(smollm2_gguf):
    return cism.load(str(smollm2_gguf), precision="int8", act_precision="int8", threads=2)


@pytest.fixture(scope="module")
def live(model):
    engine = cism.Engine(model, max_seqs=48, kv_blocks=600)
    server = LiveServer(create_app(engine, model_name=NAME))
    server.engine = engine
    yield server
    server.stop()
    engine.shutdown(drain=False)


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def messages_of(text):
    return [{"role": "system", "content": "You are terse."}, {"role": "user", "content": text}]


# --------------------------------------------------------- the openai client ---

def test_chat_seeded_is_the_solo_session_bit_for_bit(client, model, live):
    msgs = messages_of("Name three rivers in Europe.")
    r = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=24, temperature=0.8, top_p=0.95,
                                       seed=11, logprobs=True, top_logprobs=3)
    ids = chat_ids(model.tokenizer, msgs)
    tokens, lps, tops, reason = solo(model, ids, 24, 0.8, top_p=0.95, seed=11, top_n=3)
    choice = r.choices[0]
    assert choice.message.content == model.tokenizer.decode(tokens, skip_special=True)
    assert [e.logprob for e in choice.logprobs.content] == lps        # floats survive JSON exactly
    assert [[t.logprob for t in e.top_logprobs] for e in choice.logprobs.content] == [[v for _, v in t] for t in tops]
    assert [bytes(e.bytes) for e in choice.logprobs.content] == [model.tokenizer.token_bytes(t) for t in tokens]
    assert choice.finish_reason == ("length" if reason == "length" else "stop")
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(tokens)
    assert r.object == "chat.completion" and r.model == NAME and r.id.startswith("chatcmpl-")


def test_streamed_chat_equals_the_whole_answer(client, model):
    msgs = messages_of("Write a haiku about the sea.")
    kw = dict(model=NAME, messages=msgs, max_tokens=30, temperature=0.7, seed=5)
    whole = client.chat.completions.create(**kw).choices[0].message.content
    parts, finish, usage, roles = [], None, None, []
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.role:
                roles.append(c.delta.role)
            if c.delta.content:
                parts.append(c.delta.content)
            finish = c.finish_reason or finish
    assert "".join(parts) == whole and roles == ["assistant"]
    assert finish in ("stop", "length") and usage.completion_tokens > 0


def test_completions_n_stop_strings_and_logprobs(client, model):
    tok = model.tokenizer
    prompt = "The capital of France is"
    ids = tok.encode(prompt)
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=12, n=3, temperature=0.9, seed=20,
                                  logprobs=2)
    assert len(r.choices) == 3
    for i, c in enumerate(r.choices):
        tokens, lps, tops, _ = solo(model, ids, 12, 0.9, seed=20 + i, top_n=2)
        assert c.text == tok.decode(tokens, skip_special=True)
        assert c.logprobs.token_logprobs == lps
        assert c.logprobs.text_offset[0] == 0
    # a stop string cuts the text before it and ends the choice with "stop"
    full = client.completions.create(model=NAME, prompt=prompt, max_tokens=20, temperature=0, seed=1).choices[0].text
    cut = full[5:9]
    assert cut
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=20, temperature=0, stop=[cut, "zzz"])
    assert r.choices[0].text == full[:full.index(cut)] and r.choices[0].finish_reason == "stop"
    # token-id prompts and echo
    r = client.completions.create(model=NAME, prompt=ids, max_tokens=4, temperature=0, echo=True)
    assert r.choices[0].text.startswith(prompt)


def test_n_forks_share_the_prompt(client, live):
    before = live.engine.stats()["prefix_hit_tokens"]
    msgs = messages_of("Tell me a fact about " + "owls, " * 20)
    r = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=8, n=4, temperature=1.0, seed=3)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.usage.prompt_tokens_details.cached_tokens in (0, r.usage.prompt_tokens) or True
    texts = {c.message.content for c in r.choices}
    assert len(texts) > 1     # seeds 3, 4, 5, 6: different samples


def test_seeded_request_stays_exact_under_32_streaming_clients(live, model):
    async def main():
        aclient = openai.AsyncOpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0, timeout=300)

        async def noise(i):
            stream = await aclient.chat.completions.create(
                model=NAME, messages=messages_of(f"Story number {i}: once upon a time"), max_tokens=24,
                temperature=1.0, seed=100 + i, stream=True)
            n = 0
            async for chunk in stream:
                n += sum(1 for c in chunk.choices if c.delta.content)
            return n

        msgs = messages_of("List the planets of the solar system.")
        probe = aclient.chat.completions.create(model=NAME, messages=msgs, max_tokens=32, temperature=0.6,
                                                seed=77, logprobs=True)
        results = await asyncio.gather(probe, *(noise(i) for i in range(32)))
        await aclient.close()
        return msgs, results[0], results[1:]

    msgs, probe, counts = asyncio.run(main())
    assert all(c > 0 for c in counts)
    tokens, lps, _, _ = solo(model, chat_ids(model.tokenizer, msgs), 32, 0.6, seed=77)
    assert probe.choices[0].message.content == model.tokenizer.decode(tokens, skip_special=True)
    assert [e.logprob for e in probe.choices[0].logprobs.content] == lps
    idle(live.engine)


def test_models_tokenize_detokenize_health(live, model):
    with httpx.Client(base_url=live.url, timeout=30) as h:
        m = h.get("/v1/models").json()
        assert m["object"] == "list" and m["data"][0]["id"] == NAME
        assert h.get(f"/v1/models/{NAME}").json()["id"] == NAME
        assert h.get("/v1/models/nope").status_code == 404
        text = "Hello, world! ünïcödé"
        toks = h.post("/tokenize", json={"content": text}).json()["tokens"]
        assert toks == model.tokenizer.encode(text, add_bos=False)
        pieces = h.post("/tokenize", json={"content": text, "with_pieces": True}).json()["tokens"]
        assert [p["id"] for p in pieces] == toks
        assert h.post("/detokenize", json={"tokens": toks}).json()["content"] == text
        assert h.get("/health").json() == {"status": "ok"}
        assert h.get("/").status_code == 200 and "cism chat" in h.get("/").text


# ------------------------------------------------------------------- errors ---

@pytest.mark.parametrize("path,body,status,code", [
    ("/v1/chat/completions", b"{not json", 400, "invalid_json"),
    ("/v1/chat/completions", b"[1, 2]", 400, "invalid_type"),
    ("/v1/chat/completions", {"messages": []}, 400, "invalid_type"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "invalid_value"),
    ("/v1/chat/completions", {"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}, 400,
     "model_not_found"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, 400,
     "invalid_type"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_p": 0}, 400, "invalid_value"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 99}, 400, "invalid_value"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "presence_penalty": 0.5}, 400,
     "unsupported_parameter"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 10**6}, 400,
     "context_length_exceeded"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 9000}]}, 400,
     "context_length_exceeded"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "unsupported_content"),
    ("/v1/completions", {"prompt": [1, 2, 10**9]}, 400, "invalid_value"),
    ("/v1/completions", {}, 400, "missing_required_parameter"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "invalid_value"),
    ("/detokenize", {"tokens": ["a"]}, 400, "invalid_value"),
    ("/v1/nothing", {}, 404, "not_found"),
])
def test_bad_requests_get_openai_errors(live, path, body, status, code):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(live.url + path, content=data, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and err["message"] and set(err) == {"message", "type", "param", "code"}


def test_openai_client_raises_on_bad_requests(client):
    with pytest.raises(openai.BadRequestError, match="context"):
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=10**6)
    with pytest.raises(openai.BadRequestError, match="does not exist"):
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "hi"}])


def test_body_size_limit(model):
    engine = cism.Engine(model, kv_blocks=64)
    server = LiveServer(create_app(engine, model_name=NAME, max_body_bytes=1000))
    try:
        big = {"messages": [{"role": "user", "content": "x" * 2000}]}
        r = httpx.post(server.url + "/v1/chat/completions", json=big, timeout=30)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

        def chunks():   # no Content-Length: counted as it streams in
            for _ in range(20):
                yield b" " * 100
        r = httpx.post(server.url + "/v1/chat/completions", content=chunks(), timeout=30)
        assert r.status_code == 413
    finally:
        server.stop()
        engine.shutdown(drain=False)


def test_api_key_and_queue_overflow(model):
    engine = cism.Engine(model, kv_blocks=64, max_seqs=1, max_queue=1)
    server = LiveServer(create_app(engine, model_name=NAME, api_key="s3cret"))
    try:
        body = {"messages": [{"role": "user", "content": "Count slowly to one hundred."}], "max_tokens": 200,
                "ignore_eos": True}
        assert httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30).status_code == 401
        bad = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30,
                         headers={"Authorization": "Bearer s3cre"})
        assert bad.status_code == 401 and bad.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(server.url + "/health").status_code == 200      # public
        assert httpx.get(server.url + "/metrics").status_code == 401
        auth = {"Authorization": "Bearer s3cret"}
        c = openai.OpenAI(base_url=server.url + "/v1", api_key="s3cret", max_retries=0)
        assert c.models.list().data[0].id == NAME
        # one running, one queued: the third is refused with Retry-After
        results = []

        def call():
            results.append(httpx.post(server.url + "/v1/chat/completions", json=body, headers=auth, timeout=120))
        threads = [threading.Thread(target=call) for _ in range(2)]
        for t in threads:
            t.start()
            time.sleep(0.3)
        third = httpx.post(server.url + "/v1/chat/completions", json=body, headers=auth, timeout=30)
        assert third.status_code == 429 and third.headers["retry-after"] == "1"
        assert third.json()["error"]["code"] == "queue_full"
        for t in threads:
            t.join()
        assert [r.status_code for r in results] == [200, 200]
    finally:
        server.stop()
        engine.shutdown(drain=False)


def test_disconnect_mid_stream_returns_the_blocks(live):
    engine = live.engine
    base = idle(engine)
    body = {"model": NAME, "messages": messages_of("Tell me a very long story."), "max_tokens": 2000,
            "temperature": 1.0, "seed": 1, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=60) as h:
        with h.stream("POST", live.url + "/v1/chat/completions", json=body) as r:
            got = 0
            for line in r.iter_lines():
                if line.startswith("data: ") and '"content"' in line:
                    got += 1
                if got >= 5:
                    break
    st = idle(engine)
    assert st["finished_cancelled"] > base["finished_cancelled"]
    # a non-streamed request whose client gives up is cancelled too; the
    # client leaves once the engine runs the request (a fixed client timeout
    # raced the server's admission on a busy host: nothing was running yet)
    body["stream"] = False
    payload = json.dumps(body).encode()
    url = httpx.URL(live.url)
    with socket.create_connection((url.host, url.port)) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\n"
                     b"Content-Type: application/json\r\n"
                     + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        deadline = time.time() + 30
        while engine.stats()["running"] == 0:
            assert time.time() < deadline, "the request never reached the engine"
            time.sleep(0.01)
    st2 = idle(engine)
    assert st2["finished_cancelled"] > st["finished_cancelled"]


def test_metrics_move_as_requests_run(client, live):
    def scrape():
        text = httpx.get(live.url + "/metrics").text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out
    before = scrape()
    client.chat.completions.create(model=NAME, messages=messages_of("Hi!"), max_tokens=5, temperature=0)
    after = scrape()
    assert after["cism_completion_tokens_total"] >= before["cism_completion_tokens_total"] + 1
    assert after['cism_requests_total{route="chat",outcome="started"}'] == \
        before.get('cism_requests_total{route="chat",outcome="started"}', 0) + 1
    assert after["cism_engine_steps_total"] > before["cism_engine_steps_total"]
    assert after['cism_ttft_seconds_bucket{le="+Inf"}'] > before['cism_ttft_seconds_bucket{le="+Inf"}']
    for name in ("cism_queue_depth", "cism_running_sequences", 'cism_kv_blocks{state="used"}',
                 'cism_kv_blocks{state="cached"}', "cism_prefix_cache_hit_rate", "cism_step_seconds_count"):
        assert name in after


# ------------------------------------------------------ fuzzed request bodies ---

def request_bodies(st):
    """A request body: an object whose known fields hold values of their kind or
    any JSON, or any JSON value."""
    any_json = st.recursive(
        st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=40),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
        max_leaves=12)
    fields = {"messages": st.one_of(any_json, st.lists(st.fixed_dictionaries(
                  {"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]),
                   "content": st.one_of(st.text(max_size=60), any_json)}), max_size=3)),
              "prompt": st.one_of(st.text(max_size=60), st.lists(st.integers(-5, 60000), max_size=8), any_json),
              "max_tokens": st.one_of(st.integers(-3, 40), any_json),
              "temperature": st.one_of(st.floats(-1, 3), any_json),
              "top_p": st.one_of(st.floats(-0.5, 1.5), any_json), "n": st.one_of(st.integers(-1, 20), any_json),
              "stop": st.one_of(st.text(max_size=5), st.lists(st.text(max_size=5), max_size=20), any_json),
              "seed": st.one_of(st.integers(-2**65, 2**65), any_json), "stream": st.one_of(st.booleans(), any_json),
              "logprobs": st.one_of(st.booleans(), st.integers(-2, 8), any_json),
              "top_logprobs": st.one_of(st.integers(-2, 25), any_json),
              "top_k": st.one_of(st.integers(-2, 60000), any_json),
              "spec_k": st.one_of(st.integers(-1, 20), any_json), "model": st.one_of(st.just(NAME), any_json),
              "stream_options": any_json, "content": st.one_of(st.text(max_size=40), any_json),
              "tokens": st.one_of(st.lists(st.integers(-3, 60000), max_size=6), any_json)}
    return st.fixed_dictionaries({}, optional=fields) | any_json


def test_fuzzed_bodies_never_get_a_5xx(live):
    h = hypothesis_or_skip()
    st = h.strategies

    @h.settings(max_examples=60, deadline=None, suppress_health_check=list(h.HealthCheck))
    @h.given(path=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"]),
             body=request_bodies(st), raw=st.binary(max_size=30), use_raw=st.booleans())
    def check(path, body, raw, use_raw):
        post_a_body(live, path, body, raw, use_raw)
    check()


def post_a_body(live, path, body, raw, use_raw):
    if isinstance(body, dict) and "max_tokens" in body and isinstance(body["max_tokens"], int):
        body["max_tokens"] = min(body["max_tokens"], 8)
    data = raw if use_raw else json.dumps(body).encode()
    r = httpx.post(live.url + path, content=data, headers={"content-type": "application/json"}, timeout=120)
    assert r.status_code < 500, (r.status_code, r.text[:300])
    if r.status_code >= 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    control = httpx.post(live.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "temperature": 0},
                         timeout=60)
    assert control.status_code == 200


# ------------------------------------------------------------------ the CLI ---

def test_cism_serve_prints_its_url_serves_and_stops_on_sigterm(smollm2_gguf):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.Popen([sys.executable, "-m", "cism.cli", "serve", "--model", str(smollm2_gguf), "--port", "0",
                          "--precision", "int8", "--model-name", "tiny", "--max-seqs", "4"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = p.stderr.readline()
        assert "serving tiny at http://127.0.0.1:" in line, line
        url = line.split(" at ")[1].split("/ ")[0]
        c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
        assert r.choices[0].finish_reason in ("stop", "length")
        p.send_signal(signal.SIGTERM)
        assert p.wait(60) == 0
        assert "server stopped" in p.stderr.read()
    finally:
        if p.poll() is None:
            p.kill()


def test_cism_serve_errors_in_one_line(tmp_path):
    p = subprocess.run([sys.executable, "-m", "cism.cli", "serve", "--model", str(tmp_path / "none.gguf")],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and p.stderr.strip().startswith("cism: error:") and len(p.stderr.strip().splitlines()) == 1
